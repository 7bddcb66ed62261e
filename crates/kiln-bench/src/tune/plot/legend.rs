//! The legend box right of the plot: one row per series, a swatch (the series' line, marker or
//! both, in its colour) and its name.
//!
//! Invariants: rows follow series order; names are cleaned of control characters and shortened
//! to fit the width given to [`Legend::plan`]; when the rows would be taller than the height
//! given, the last row that fits reads "+N more" (no swatch) instead, counting the series left
//! out. The box is [`Legend::width`] pixels wide; nothing is drawn for a chart without series.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::draw::{DrawResult, Metrics, Px};
use super::text::{clean, fit, width};
use super::{Chart, Style, series_color};

const BORDER: RGBColor = RGBColor(0xbb, 0xbb, 0xbb);

/// One legend row: its label and, for a series row, the style and index picking its swatch.
struct Row {
    label: String,
    swatch: Option<(Style, usize)>,
}

/// Legend rows, already fitted, and the box width they need.
pub(super) struct Legend {
    rows: Vec<Row>,
    pub(super) width: u32,
}

impl Legend {
    /// Lays out the rows of `chart`'s legend within `max_width` × `max_height` pixels.
    pub(super) fn plan(
        chart: &Chart,
        style: &TextStyle<'_>,
        max_width: u32,
        max_height: u32,
        m: Metrics,
    ) -> Legend {
        let inner = m.pad / 2;
        let text_max = max_width.saturating_sub(m.swatch + 2 * inner);
        let fit_rows = (max_height.saturating_sub(2 * inner) / m.row_h().max(1)).max(1) as usize;
        let total = chart.series.len();
        let shown = if total > fit_rows { fit_rows - 1 } else { total };
        let mut rows: Vec<Row> = chart
            .series
            .iter()
            .enumerate()
            .take(shown)
            .map(|(i, s)| Row {
                label: fit(&clean(&s.name), text_max, style),
                swatch: Some((s.style, i)),
            })
            .collect();
        if shown < total {
            let label = fit(&format!("+{} more", total - shown), text_max, style);
            rows.push(Row { label, swatch: None });
        }
        let text_w = rows.iter().map(|r| width(&r.label, style)).max().unwrap_or(0);
        Legend { rows, width: text_w + m.swatch + 2 * inner }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Draws the box with its top-left corner at `(x, y)` of `root`.
    pub(super) fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        (x, y): Px,
        m: Metrics,
    ) -> DrawResult<DB> {
        if self.is_empty() {
            return Ok(());
        }
        let (inner, row_h) = (m.pad as i32 / 2, m.row_h() as i32);
        let corner = (x + self.width as i32, y + self.rows.len() as i32 * row_h + 2 * inner);
        root.draw(&Rectangle::new([(x, y), corner], WHITE.filled()))?;
        root.draw(&Rectangle::new([(x, y), corner], BORDER))?;
        let style = Metrics::style(m.text).pos(Pos::new(HPos::Left, VPos::Center));
        for (i, row) in self.rows.iter().enumerate() {
            let mid = y + inner + i as i32 * row_h + row_h / 2;
            if let Some((series_style, index)) = row.swatch {
                swatch(root, (x + inner, mid), series_style, index, m)?;
            }
            let text_x = x + inner + m.swatch as i32;
            root.draw(&Text::new(row.label.as_str(), (text_x, mid), &style))?;
        }
        Ok(())
    }
}

/// Draws the swatch of series `index` in `style` on `root`, its left end at `at`: its line,
/// its marker (circle for even indices, square for odd) or both. Parts not shown are
/// transparent, which both backends skip, so the element has one type whatever the style.
fn swatch<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    at: Px,
    style: Style,
    index: usize,
    m: Metrics,
) -> DrawResult<DB> {
    let color = series_color(index);
    let show = |on: bool| if on { color.to_rgba() } else { TRANSPARENT };
    let even = index.is_multiple_of(2);
    let w = m.swatch as i32 - m.pad as i32 / 2;
    let (r, mid) = (m.marker, w / 2);
    let element = EmptyElement::at(at)
        + PathElement::new(vec![(0, 0), (w, 0)], show(style.has_line()).stroke_width(m.line))
        + Circle::new((mid, 0), r, show(style.has_markers() && even).filled())
        + Rectangle::new(
            [(mid - r, -r), (mid + r, r)],
            show(style.has_markers() && !even).filled(),
        );
    root.draw(&element)
}
