//! Draws a [`Chart`] on any plotters backend.
//!
//! Layout, top to bottom: the title, then the plot with its y tick labels and the rotated y-axis
//! label on the left and its x tick labels and x-axis label below; the legend box, when there
//! are series, sits right of the plot, top-aligned with it. Grid lines (light grey) run at the
//! labelled ticks and a dark frame closes the plot. All sizes scale with the image's smaller
//! side, so 960×600 gets 16 px text and a 22 px title.
//!
//! Invariants: label areas are sized from the measured tick labels, so labels never overlap the
//! plot; x tick labels are thinned until they no longer collide; the legend lists series in
//! order, names shortened to fit a third of the width, and when the rows would be taller than
//! the plot the last row that fits reads "+N more" instead. Every drawn point lies inside the
//! plot, because the axes are fitted to exactly the drawable points (see `range`).

use std::ops::Range;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::axis::{self, Axis};
use super::legend::Legend;
use super::range;
use super::text::{clean, fit, width};
use super::{Chart, FONT_FAMILY, series_color};

/// A pixel position on the backend (plotters' `BackendCoord`).
pub(super) type Px = (i32, i32);

pub(super) type DrawError<DB> = DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>;
pub(super) type DrawResult<DB> = Result<(), DrawError<DB>>;

pub(super) const GRID: RGBColor = RGBColor(0xe5, 0xe5, 0xe5);
pub(super) const AXIS: RGBColor = RGBColor(0x44, 0x44, 0x44);
pub(super) const TEXT: RGBColor = RGBColor(0x22, 0x22, 0x22);

/// Size-dependent spacing, all in pixels, derived from one scale factor.
#[derive(Debug, Clone, Copy)]
pub(super) struct Metrics {
    /// Font size of tick labels, axis labels and legend text.
    pub(super) text: f64,
    /// Font size of the title.
    pub(super) title: f64,
    /// Outer padding and general gap.
    pub(super) pad: u32,
    /// Length of tick marks outside the plot.
    pub(super) tick: u32,
    /// Marker radius (half the width of a square marker).
    pub(super) marker: i32,
    /// Data line width.
    pub(super) line: u32,
    /// Width of a legend swatch.
    pub(super) swatch: u32,
}

impl Metrics {
    fn for_size(width: u32, height: u32) -> Metrics {
        let s = (f64::from(width.min(height)) / 600.0).clamp(0.6, 3.0);
        let px = |v: f64| (v * s).round().max(1.0);
        Metrics {
            text: 16.0 * s,
            title: 22.0 * s,
            pad: px(10.0) as u32,
            tick: px(5.0) as u32,
            marker: px(5.0) as i32,
            line: px(2.0) as u32,
            swatch: px(32.0) as u32,
        }
    }

    pub(super) fn style(size: f64) -> TextStyle<'static> {
        (FONT_FAMILY, size).into_font().color(&TEXT)
    }

    /// Height of one legend row.
    pub(super) fn row_h(self) -> u32 {
        (self.text * 1.3).ceil() as u32
    }

    /// Height plotters gives a line of text at `size` (its layout uses size / 1.24).
    fn line_h(size: f64) -> u32 {
        (size / 1.24).ceil() as u32
    }
}

/// Everything the generic part needs besides the axes.
struct Parts<'c> {
    chart: &'c Chart,
    m: Metrics,
    x_label: String,
    y_label: String,
    x_axis: Axis,
    y_axis: Axis,
}

/// Draws `chart` filling `root`.
pub(super) fn chart<DB: DrawingBackend>(
    chart: &Chart,
    root: &DrawingArea<DB, Shift>,
) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let (w, h) = root.dim_in_pixel();
    let m = Metrics::for_size(w, h);
    let (text, title_style) = (Metrics::style(m.text), Metrics::style(m.title));
    let title = fit(&clean(&chart.title), w.saturating_sub(2 * m.pad), &title_style);
    let x_label = fit(&clean(&chart.x_label), w.saturating_sub(2 * m.pad), &text);
    let y_label = fit(&clean(&chart.y_label), h.saturating_sub(2 * m.pad), &text);
    let points = || chart.series.iter().flat_map(|s| range::runs(&s.points, chart.x_log)).flatten();

    let text_h = Metrics::line_h(m.text);
    let title_h = if title.is_empty() { 0 } else { Metrics::line_h(m.title) * 2 };
    let desc_h = |label: &str| if label.trim().is_empty() { 0 } else { text_h + m.pad };
    let x_area = m.tick + m.pad / 2 + text_h + desc_h(&x_label) + m.pad / 2;
    let plot_h = h.saturating_sub(2 * m.pad + title_h + x_area).max(1);

    let y_max = (f64::from(plot_h) / (2.5 * m.text)).clamp(2.0, 10.0) as usize;
    let y_axis = Axis::new(range::fit_linear(points().map(|p| p.1)), false, y_max);
    let y_label_w = y_axis.labels().map(|l| width(&l, &text)).max().unwrap_or(0);
    let y_area = m.tick + m.pad / 2 + y_label_w + desc_h(&y_label) + m.pad / 2;

    let legend = Legend::plan(chart, &text, w / 3, plot_h, m);
    let mut right = if legend.is_empty() { m.pad } else { legend.width + 2 * m.pad };
    let plot_w = w.saturating_sub(m.pad + y_area + right).max(1);
    let x_range = if chart.x_log {
        range::fit_log(points().map(|p| p.0))
    } else {
        range::fit_linear(points().map(|p| p.0))
    };
    let x_axis = x_axis(x_range, chart.x_log, plot_w, &text, m);
    let last_w = x_axis.labels().last().map_or(0, |l| width(&l, &text));
    // The last tick label is centred on the plot's right edge: leave room for its right half.
    right = right.max(last_w / 2 + m.pad / 2);

    let mut builder = ChartBuilder::on(root);
    builder
        .margin_top(m.pad)
        .margin_bottom(m.pad)
        .margin_left(m.pad)
        .margin_right(right)
        .x_label_area_size(x_area)
        .y_label_area_size(y_area);
    if !title.is_empty() {
        builder.caption(&title, title_style);
    }
    let y = y_axis.lo..y_axis.hi;
    let x = x_axis.lo..x_axis.hi;
    let parts = Parts { chart, m, x_label, y_label, x_axis, y_axis };
    let (plot_x, plot_y) = if chart.x_log {
        plot(&mut builder, x.log_scale(), y, parts)?
    } else {
        plot(&mut builder, x, y, parts)?
    };
    legend.draw(root, (plot_x.end + m.pad as i32, plot_y.start), m)
}

/// The x axis with the most tick labels that do not collide on a plot `plot_w` wide.
fn x_axis(range: (f64, f64), log: bool, plot_w: u32, style: &TextStyle<'_>, m: Metrics) -> Axis {
    let mut max = (f64::from(plot_w) / (3.75 * m.text)).clamp(2.0, 12.0) as usize;
    loop {
        let axis = Axis::new(range, log, max);
        let widest = axis.labels().map(|l| width(&l, style)).max().unwrap_or(0);
        let needed = (widest + 2 * m.pad) as usize * axis.values.len();
        if needed <= plot_w as usize || max <= 2 {
            return axis;
        }
        max -= 1;
    }
}

/// Builds the axes and draws mesh, series and frame. Returns the plot's pixel ranges (x, y).
fn plot<DB, X>(
    builder: &mut ChartBuilder<'_, '_, DB>,
    x: X,
    y: Range<f64>,
    parts: Parts<'_>,
) -> Result<(Range<i32>, Range<i32>), DrawError<DB>>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
{
    let Parts { chart, m, x_label, y_label, x_axis, y_axis } = parts;
    let mut ctx = builder.build_cartesian_2d(x, y)?;
    let text = Metrics::style(m.text);
    let x_fmt = |v: &f64| axis::format_tick(*v, x_axis.step);
    let y_fmt = |v: &f64| axis::format_tick(*v, y_axis.step);
    let mut mesh = ctx.configure_mesh();
    mesh.x_labels(x_axis.hint)
        .y_labels(y_axis.hint)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .max_light_lines(0)
        .bold_line_style(GRID)
        .axis_style(AXIS)
        .set_all_tick_mark_size(m.tick)
        .label_style(text.clone())
        .axis_desc_style(text.clone());
    if !x_label.trim().is_empty() {
        mesh.x_desc(x_label);
    }
    if !y_label.trim().is_empty() {
        mesh.y_desc(y_label);
    }
    mesh.draw()?;

    for (index, series) in chart.series.iter().enumerate() {
        for run in range::runs(&series.points, chart.x_log) {
            if series.style.has_line() && run.len() >= 2 {
                let line = series_color(index).stroke_width(m.line);
                ctx.draw_series(LineSeries::new(run.iter().copied(), line))?;
            }
            if series.style.has_markers() || run.len() == 1 {
                markers(&mut ctx, run, index, m)?;
            }
        }
    }
    let area = ctx.plotting_area();
    let (pw, ph) = area.dim_in_pixel();
    let frame = Rectangle::new([(0, 0), (pw as i32 - 1, ph as i32 - 1)], AXIS);
    area.strip_coord_spec().draw(&frame)?;
    Ok(area.get_pixel_range())
}

/// Filled markers of series `index` at `points`: circles for even indices, squares for odd.
fn markers<DB, CT>(
    ctx: &mut ChartContext<'_, DB, CT>,
    points: Vec<(f64, f64)>,
    index: usize,
    m: Metrics,
) -> DrawResult<DB>
where
    DB: DrawingBackend,
    CT: CoordTranslate<From = (f64, f64)>,
{
    let fill = series_color(index).filled();
    if index.is_multiple_of(2) {
        let circle = |c, r: i32, s| EmptyElement::at(c) + Circle::new((0, 0), r, s);
        ctx.draw_series(PointSeries::of_element(points, m.marker, fill, &circle))?;
    } else {
        let square = |c, r: i32, s| EmptyElement::at(c) + Rectangle::new([(-r, -r), (r, r)], s);
        ctx.draw_series(PointSeries::of_element(points, m.marker, fill, &square))?;
    }
    Ok(())
}
