//! The public chart description ([`Chart`], [`Series`], [`Style`]) and its output entry points.
//!
//! A [`Chart`] is plain data; rendering never mutates it and never panics, whatever the points
//! hold. Both outputs go through the same layout (`scene`), so the SVG and the PNG of one chart
//! show the same axes, ticks, legend and data at the same pixel positions. Requested sizes are
//! clamped to [`MIN_WIDTH`]×[`MIN_HEIGHT`] ..= [`MAX_SIDE`]×[`MAX_SIDE`] pixels.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use crate::{encode, raster, scene, svg};

/// Smallest width, in pixels, a chart is rendered at.
pub const MIN_WIDTH: u32 = 160;
/// Smallest height, in pixels, a chart is rendered at.
pub const MIN_HEIGHT: u32 = 120;
/// Largest width or height, in pixels, a chart is rendered at.
pub const MAX_SIDE: u32 = 8192;

/// How a series' points are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Style {
    /// Consecutive points joined by a 2 px line, in the order given (no sorting). A point that
    /// has no line neighbour (isolated by non-finite points, or alone) still gets a marker.
    Line,
    /// A filled marker per point: circles for even series indices, squares for odd ones.
    Markers,
    /// Both of the above.
    #[default]
    LineAndMarkers,
}

impl Style {
    pub(crate) fn has_line(self) -> bool {
        matches!(self, Style::Line | Style::LineAndMarkers)
    }

    pub(crate) fn has_markers(self) -> bool {
        matches!(self, Style::Markers | Style::LineAndMarkers)
    }
}

/// One named data series. Points are `(x, y)` in data units; points with a non-finite
/// coordinate (or a non-positive x on a log axis) are skipped and break a line into pieces.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Series {
    /// Shown in the legend.
    pub name: String,
    /// Data points, drawn in this order.
    pub points: Vec<(f64, f64)>,
    /// How the points are drawn.
    pub style: Style,
}

impl Series {
    /// A series from its parts.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>, style: Style) -> Series {
        Series { name: name.into(), points, style }
    }
}

/// A 2-D chart: title, axis labels and any number of series sharing one pair of axes.
///
/// Series `i` is coloured [`series_color(i)`](crate::series_color). Axes are fitted to all
/// drawable points of all series, padded slightly and rounded out to "nice" ticks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chart {
    /// Centred above the plot.
    pub title: String,
    /// Centred below the x axis.
    pub x_label: String,
    /// Written horizontally above the y axis.
    pub y_label: String,
    /// Drawn in order; later series paint over earlier ones.
    pub series: Vec<Series>,
    /// Use a log10 x axis spanning whole decades (non-positive x values are skipped).
    pub x_log: bool,
}

impl Chart {
    /// An empty chart with the given title and axis labels and a linear x axis.
    pub fn new(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
    ) -> Chart {
        Chart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
            x_log: false,
        }
    }

    /// Adds a series (builder style).
    #[must_use]
    pub fn with_series(mut self, series: Series) -> Chart {
        self.series.push(series);
        self
    }

    /// The chart as a standalone SVG document of `width`×`height` pixels (after clamping).
    pub fn to_svg(&self, width: u32, height: u32) -> String {
        let (width, height) = clamp_size(width, height);
        svg::render(&scene::build(self, width, height))
    }

    /// The chart as encoded PNG bytes (8-bit RGB) of `width`×`height` pixels (after clamping).
    ///
    /// Encoding into memory cannot fail for clamped sizes; should the encoder ever report an
    /// error anyway, the result is empty. [`Chart::try_to_png`] returns that error instead.
    pub fn to_png(&self, width: u32, height: u32) -> Vec<u8> {
        self.try_to_png(width, height).unwrap_or_default()
    }

    /// Like [`Chart::to_png`], but reports an encoder error instead of returning no bytes.
    pub fn try_to_png(&self, width: u32, height: u32) -> io::Result<Vec<u8>> {
        let (width, height) = clamp_size(width, height);
        let canvas = raster::render(&scene::build(self, width, height));
        encode::png_rgb(canvas.width(), canvas.height(), canvas.pixels())
    }

    /// Writes `<path>.svg` and `<path>.png` (the extensions are appended, so `runs/v1.2` gives
    /// `runs/v1.2.svg`). The parent directory must exist. Returns the first I/O error met.
    pub fn save(&self, path_without_extension: &Path, width: u32, height: u32) -> io::Result<()> {
        std::fs::write(with_suffix(path_without_extension, ".svg"), self.to_svg(width, height))?;
        std::fs::write(with_suffix(path_without_extension, ".png"), self.try_to_png(width, height)?)
    }
}

/// `path` with `suffix` appended to its final component.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

/// Clamps a requested size into the supported range.
fn clamp_size(width: u32, height: u32) -> (u32, u32) {
    (width.clamp(MIN_WIDTH, MAX_SIDE), height.clamp(MIN_HEIGHT, MAX_SIDE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_clamped() {
        assert_eq!(clamp_size(0, 0), (MIN_WIDTH, MIN_HEIGHT));
        assert_eq!(clamp_size(800, 500), (800, 500));
        assert_eq!(clamp_size(u32::MAX, 9000), (MAX_SIDE, MAX_SIDE));
    }

    #[test]
    fn suffix_is_appended_not_substituted() {
        assert_eq!(with_suffix(Path::new("runs/v1.2"), ".svg"), PathBuf::from("runs/v1.2.svg"));
    }

    #[test]
    fn style_flags() {
        assert!(Style::Line.has_line() && !Style::Line.has_markers());
        assert!(!Style::Markers.has_line() && Style::Markers.has_markers());
        assert!(Style::LineAndMarkers.has_line() && Style::LineAndMarkers.has_markers());
    }

    #[test]
    fn save_writes_both_files() {
        let dir = std::env::temp_dir().join(format!("kiln-plot-save-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("pareto");
        let chart = Chart::new("Pareto", "tok/s", "ms").with_series(Series::new(
            "front",
            vec![(1.0, 2.0), (3.0, 4.0)],
            Style::Line,
        ));
        chart.save(&base, 320, 240).unwrap();
        let svg = std::fs::read_to_string(dir.join("pareto.svg")).unwrap();
        let png = std::fs::read(dir.join("pareto.png")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("front"));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(chart.save(&dir.join("missing-dir").join("x"), 320, 240).is_err());
    }
}
