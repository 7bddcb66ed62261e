//! Chart layout: turns a [`Chart`] into a flat list of drawing primitives in pixel space.
//!
//! The scene is the single source of geometry for both back ends, so the SVG and the PNG agree.
//! Coordinates are `f64` pixels with the origin at the top-left corner and y growing downwards.
//! Text is measured with the built-in font's metrics (`font::text_width`); the SVG back end uses
//! a monospace font sized to the same advance. Invariants of a built [`Scene`]:
//!
//! - every coordinate is finite;
//! - the plot rectangle has positive width and height and lies inside the image;
//! - data primitives only contain points that the axes can show, and those lie in the plot
//!   rectangle (up to rounding), because the axes are fitted to exactly those points;
//! - text is free of control characters.
//!
//! Layout, top to bottom: title, y-axis label (horizontal), plot with tick labels on its left and
//! below, x-axis label. The legend, if any series exist, sits to the right of the plot.

use crate::chart::{Chart, Series, Style};
use crate::color::{self, Rgb};
use crate::font::{self, GLYPH_H};
use crate::scale::Axis;

/// Horizontal alignment of a text primitive relative to its `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Anchor {
    Start,
    Middle,
    End,
}

/// Shape of a data marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Circle,
    Square,
}

/// An axis-aligned rectangle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rect {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
}

impl Rect {
    pub(crate) fn right(&self) -> f64 {
        self.x + self.w
    }

    pub(crate) fn bottom(&self) -> f64 {
        self.y + self.h
    }
}

/// One drawing primitive.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prim {
    /// A filled rectangle, optionally outlined with a 1 px border.
    Rect { rect: Rect, fill: Option<Rgb>, stroke: Option<Rgb> },
    /// A 1 px line (grid, axes, ticks).
    Hairline { x1: f64, y1: f64, x2: f64, y2: f64, color: Rgb },
    /// A 2 px data line through at least two points.
    Polyline { points: Vec<(f64, f64)>, color: Rgb },
    /// A filled marker centred on (`x`, `y`); `radius` is half its width.
    Marker { x: f64, y: f64, shape: Shape, radius: f64, color: Rgb },
    /// Text whose glyph box starts at `y` (top) and is anchored horizontally at `x`.
    Text { x: f64, y: f64, text: String, scale: u32, anchor: Anchor, color: Rgb },
}

/// A laid-out chart.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scene {
    pub width: u32,
    pub height: u32,
    /// The chart title without control characters (the drawn one may be truncated).
    pub title: String,
    /// The data area, inside the axes frame.
    pub plot: Rect,
    /// Primitives in painting order.
    pub prims: Vec<Prim>,
}

/// Size-dependent spacing, all derived from the text scale so the chart scales as a whole.
#[derive(Debug, Clone, Copy)]
struct Metrics {
    /// Scale of tick labels, axis labels and legend text.
    text: u32,
    /// Scale of the title.
    title: u32,
    /// Outer padding and general gap.
    pad: f64,
    /// Length of tick marks outside the frame.
    tick: f64,
    /// Marker radius.
    marker: f64,
}

impl Metrics {
    fn for_size(width: u32, height: u32) -> Metrics {
        let text = if width.min(height) >= 480 { 2 } else { 1 };
        let s = f64::from(text);
        Metrics { text, title: text + 1, pad: 8.0 * s, tick: 4.0 * s, marker: 2.0 * s + 1.0 }
    }

    fn text_h(self) -> f64 {
        f64::from(GLYPH_H * self.text)
    }

    fn text_w(self, text: &str) -> f64 {
        self.chars_w(text.chars().count())
    }

    fn chars_w(self, chars: usize) -> f64 {
        font::text_width(chars, self.text)
    }
}

/// Lays out `chart` on a `width`×`height` image (sizes already clamped by the caller).
pub(crate) fn build(chart: &Chart, width: u32, height: u32) -> Scene {
    let m = Metrics::for_size(width, height);
    let (w, h) = (f64::from(width), f64::from(height));
    let title = fit_text(&clean(&chart.title), w - 2.0 * m.pad, m.title);
    let title_h = if title.is_empty() { 0.0 } else { f64::from(GLYPH_H * m.title) + m.pad };
    let y_label_h = if clean(&chart.y_label).trim().is_empty() { 0.0 } else { m.text_h() + m.pad };
    let x_label_h = if clean(&chart.x_label).trim().is_empty() { 0.0 } else { m.text_h() + m.pad };
    // Whole-pixel plot edges keep the frame and grid crisp in both back ends.
    let top = (m.pad + title_h + y_label_h + m.text_h() / 2.0).round();
    let bottom = m.tick + m.pad / 2.0 + m.text_h() + m.pad / 2.0 + x_label_h + m.pad / 2.0;
    let plot_h = (h - top - bottom).floor().max(1.0);

    let y_target = (plot_h / (40.0 * f64::from(m.text))).clamp(2.0, 10.0) as usize;
    let y_axis = Axis::fit(drawable(chart).map(|(_, y)| y), false, y_target);
    let left = (m.pad + m.chars_w(y_axis.max_label_chars()) + m.pad / 2.0 + m.tick).round();
    let legend = Legend::layout(chart, m, w / 3.0, plot_h);
    let right = if legend.rows.is_empty() { m.pad } else { legend.width + 2.0 * m.pad };

    let x_values: Vec<f64> = drawable(chart).map(|(x, _)| x).collect();
    let mut plot = Rect { x: left, y: top, w: (w - left - right).floor().max(1.0), h: plot_h };
    let mut x_axis = fit_x(&x_values, chart.x_log, plot.w, m);
    // Leave room for the last tick label, centred on the plot's right edge.
    let overhang = m.text_w(x_axis.labels.last().map_or("", String::as_str)) / 2.0 + m.pad / 2.0;
    if overhang > right {
        plot.w = (w - left - overhang).floor().max(1.0);
        x_axis = fit_x(&x_values, chart.x_log, plot.w, m);
    }

    let mut prims = vec![Prim::Rect {
        rect: Rect { x: 0.0, y: 0.0, w, h },
        fill: Some(color::BACKGROUND),
        stroke: None,
    }];
    grid(&mut prims, plot, &x_axis, &y_axis);
    for (index, series) in chart.series.iter().enumerate() {
        data(&mut prims, plot, &x_axis, &y_axis, series, index, m);
    }
    prims.push(Prim::Rect { rect: plot, fill: None, stroke: Some(color::AXIS) });
    ticks(&mut prims, plot, &x_axis, &y_axis, m);
    labels(&mut prims, chart, plot, &title, m, w);
    legend.emit(&mut prims, plot.right() + m.pad, plot.y, m);
    Scene { width, height, title: clean(&chart.title), plot, prims }
}

/// All points of all series the axes can show: both coordinates finite, x positive on a log axis.
fn drawable(chart: &Chart) -> impl Iterator<Item = (f64, f64)> + '_ {
    chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .filter(move |(x, _)| !chart.x_log || *x > 0.0)
}

/// Fits the x axis, thinning ticks until their labels no longer collide.
fn fit_x(values: &[f64], log: bool, plot_w: f64, m: Metrics) -> Axis {
    let mut target = (plot_w / (60.0 * f64::from(m.text))).clamp(2.0, 12.0) as usize;
    loop {
        let axis = Axis::fit(values.iter().copied(), log, target);
        let label_w = m.chars_w(axis.max_label_chars()) + 2.0 * m.pad;
        let spacing = axis
            .ticks
            .windows(2)
            .filter_map(|p| Some((axis.frac(p[1])? - axis.frac(p[0])?) * plot_w))
            .fold(f64::INFINITY, f64::min);
        if spacing >= label_w || target <= 1 {
            return axis;
        }
        target -= 1;
    }
}

/// Pixel position of a data point, if the axes can show it.
fn to_px(plot: Rect, x_axis: &Axis, y_axis: &Axis, (x, y): (f64, f64)) -> Option<(f64, f64)> {
    if !x.is_finite() || !y.is_finite() {
        return None;
    }
    let fx = x_axis.frac(x)?;
    let fy = y_axis.frac(y)?;
    Some((plot.x + fx * plot.w, plot.bottom() - fy * plot.h))
}

/// Light grid lines at every tick inside the plot.
fn grid(prims: &mut Vec<Prim>, plot: Rect, x_axis: &Axis, y_axis: &Axis) {
    prims.push(Prim::Rect { rect: plot, fill: Some(color::BACKGROUND), stroke: None });
    let c = color::GRID;
    for f in x_axis.ticks.iter().filter_map(|&t| x_axis.frac(t)) {
        let x = (plot.x + f * plot.w).round();
        prims.push(Prim::Hairline { x1: x, y1: plot.y, x2: x, y2: plot.bottom(), color: c });
    }
    for f in y_axis.ticks.iter().filter_map(|&t| y_axis.frac(t)) {
        let y = (plot.bottom() - f * plot.h).round();
        prims.push(Prim::Hairline { x1: plot.x, y1: y, x2: plot.right(), y2: y, color: c });
    }
}

/// Tick marks and tick labels on the left and bottom edges of the plot.
fn ticks(prims: &mut Vec<Prim>, plot: Rect, x_axis: &Axis, y_axis: &Axis, m: Metrics) {
    let c = color::AXIS;
    for (t, label) in x_axis.ticks.iter().zip(&x_axis.labels) {
        let Some(f) = x_axis.frac(*t) else { continue };
        let x = (plot.x + f * plot.w).round();
        let y2 = plot.bottom() + m.tick;
        prims.push(Prim::Hairline { x1: x, y1: plot.bottom(), x2: x, y2, color: c });
        prims.push(text(x, y2 + m.pad / 2.0, label.clone(), m.text, Anchor::Middle));
    }
    for (t, label) in y_axis.ticks.iter().zip(&y_axis.labels) {
        let Some(f) = y_axis.frac(*t) else { continue };
        let y = (plot.bottom() - f * plot.h).round();
        let x2 = plot.x - m.tick;
        prims.push(Prim::Hairline { x1: x2, y1: y, x2: plot.x, y2: y, color: c });
        let top = y - m.text_h() / 2.0;
        prims.push(text(x2 - m.pad / 2.0, top, label.clone(), m.text, Anchor::End));
    }
}

/// Title, x-axis label (below the tick labels) and y-axis label (above the plot, horizontal).
fn labels(prims: &mut Vec<Prim>, chart: &Chart, plot: Rect, title: &str, m: Metrics, w: f64) {
    if !title.is_empty() {
        prims.push(text(w / 2.0, m.pad, title.to_string(), m.title, Anchor::Middle));
    }
    let x_label = fit_text(&clean(&chart.x_label), w - 2.0 * m.pad, m.text);
    if !x_label.trim().is_empty() {
        let y = plot.bottom() + m.tick + m.pad / 2.0 + m.text_h() + m.pad;
        let x = (plot.x + plot.w / 2.0).clamp(m.pad, w - m.pad);
        prims.push(text(x, y, x_label, m.text, Anchor::Middle));
    }
    let y_label = fit_text(&clean(&chart.y_label), w - 2.0 * m.pad, m.text);
    if !y_label.trim().is_empty() {
        let y = plot.y - m.text_h() / 2.0 - m.pad - m.text_h();
        prims.push(text(m.pad, y, y_label, m.text, Anchor::Start));
    }
}

/// The primitives of one series: line pieces between drawable points, then markers.
fn data(
    prims: &mut Vec<Prim>,
    plot: Rect,
    x_axis: &Axis,
    y_axis: &Axis,
    series: &Series,
    index: usize,
    m: Metrics,
) {
    let color = color::series_color(index);
    let shape = marker_shape(index);
    let mut runs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for &p in &series.points {
        match to_px(plot, x_axis, y_axis, p) {
            Some(px) => {
                if let Some(run) = runs.last_mut() {
                    run.push(px);
                }
            }
            None => runs.push(Vec::new()),
        }
    }
    let mut markers = Vec::new();
    for run in runs.into_iter().filter(|r| !r.is_empty()) {
        if series.style.has_markers() || run.len() == 1 {
            markers.extend(run.iter().copied());
        }
        if series.style.has_line() && run.len() >= 2 {
            prims.push(Prim::Polyline { points: run, color });
        }
    }
    for (x, y) in markers {
        prims.push(Prim::Marker { x, y, shape, radius: m.marker, color });
    }
}

/// Circles for even series indices, squares for odd ones, so series stay apart in greyscale.
fn marker_shape(index: usize) -> Shape {
    if index.is_multiple_of(2) { Shape::Circle } else { Shape::Square }
}

/// One legend row: a (possibly truncated) label and, for series rows, the style and index
/// that pick its swatch. The "+N more" row has no swatch.
struct Row {
    label: String,
    swatch: Option<(Style, usize)>,
}

/// Legend rows (already truncated to fit) and the box they need.
struct Legend {
    rows: Vec<Row>,
    width: f64,
}

impl Legend {
    /// Lays out one row per series, names truncated so the box is at most `max_width` wide.
    /// When the rows would be taller than `max_height`, the last row that fits reads
    /// "+N more" instead, counting the series left out.
    fn layout(chart: &Chart, m: Metrics, max_width: f64, max_height: f64) -> Legend {
        let (swatch, inner) = (Self::swatch_w(m), m.pad / 2.0);
        let text_max = (max_width - swatch - 3.0 * inner).max(0.0);
        let fit_rows = ((max_height - 2.0 * inner) / Self::row_h(m)).floor().max(1.0) as usize;
        let total = chart.series.len();
        let shown = if total > fit_rows { fit_rows - 1 } else { total };
        let mut rows: Vec<Row> = chart
            .series
            .iter()
            .enumerate()
            .take(shown)
            .map(|(i, s)| Row {
                label: fit_text(&clean(&s.name), text_max, m.text),
                swatch: Some((s.style, i)),
            })
            .collect();
        if shown < total {
            let label = fit_text(&format!("+{} more", total - shown), text_max, m.text);
            rows.push(Row { label, swatch: None });
        }
        let text_w = rows.iter().map(|r| m.text_w(&r.label)).fold(0.0, f64::max);
        Legend { rows, width: swatch + text_w + 4.0 * inner }
    }

    fn swatch_w(m: Metrics) -> f64 {
        16.0 * f64::from(m.text)
    }

    fn row_h(m: Metrics) -> f64 {
        m.text_h() + m.pad / 2.0 + 2.0
    }

    /// Emits the box and its rows with the box's top-left corner at (`x`, `y`).
    fn emit(self, prims: &mut Vec<Prim>, x: f64, y: f64, m: Metrics) {
        if self.rows.is_empty() {
            return;
        }
        let (swatch, inner, row_h) = (Self::swatch_w(m), m.pad / 2.0, Self::row_h(m));
        let rect = Rect { x, y, w: self.width, h: self.rows.len() as f64 * row_h + 2.0 * inner };
        prims.push(Prim::Rect {
            rect,
            fill: Some(color::BACKGROUND),
            stroke: Some(color::LEGEND_BORDER),
        });
        for (row_index, row) in self.rows.into_iter().enumerate() {
            let mid = (y + inner + (row_index as f64 + 0.5) * row_h).round();
            if let Some((style, index)) = row.swatch {
                let color = color::series_color(index);
                if style.has_line() {
                    let points = vec![(x + inner, mid), (x + inner + swatch, mid)];
                    prims.push(Prim::Polyline { points, color });
                }
                if style.has_markers() {
                    let (cx, shape) = (x + inner + swatch / 2.0, marker_shape(index));
                    prims.push(Prim::Marker { x: cx, y: mid, shape, radius: m.marker, color });
                }
            }
            let text_x = x + 2.0 * inner + swatch;
            prims.push(text(text_x, mid - m.text_h() / 2.0, row.label, m.text, Anchor::Start));
        }
    }
}

fn text(x: f64, y: f64, text: String, scale: u32, anchor: Anchor) -> Prim {
    Prim::Text { x, y, text, scale, anchor, color: color::TEXT }
}

/// `text` with control characters (newlines, tabs, ...) replaced by spaces.
fn clean(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// `text`, shortened with a trailing `...` if it is wider than `max_width` at `scale`.
fn fit_text(text: &str, max_width: f64, scale: u32) -> String {
    let fits = |n: usize| font::text_width(n, scale) <= max_width;
    let len = text.chars().count();
    if fits(len) {
        return text.to_string();
    }
    let keep = (0..len).rev().find(|&n| fits(n + 3)).unwrap_or(0);
    if keep == 0 && !fits(3) {
        return String::new();
    }
    let mut out: String = text.chars().take(keep).collect();
    out.push_str("...");
    out
}
