//! The charts of `kiln tune`, drawn with `plotters`: a [`Chart`] (title, axis labels, [`Series`]
//! of `(x, y)` points, each drawn in a [`Style`]) becomes an SVG document ([`Chart::to_svg`]), an
//! RGB PNG ([`Chart::to_png`]) or both files ([`Chart::save`]).
//!
//! Text is laid out (and, in the PNG, rasterised) with a subset of DejaVu Sans compiled into the
//! binary and registered with plotters as `sans-serif`; plotters is built without its `ttf`
//! feature, so no system font is ever looked up. The SVG names the same family, so viewers draw
//! its text with their own sans-serif font.
//!
//! Invariants: rendering never panics for any chart contents (empty charts, empty series, single
//! points, all-equal values, non-finite or huge values); it fails only if the backend or the
//! embedded font does. Non-finite points, and non-positive x values on a log axis, are skipped
//! and break a line into pieces; a point left without a line neighbour still gets a marker.
//! Axes are fitted to the drawable points of all series (see `range`); a linear axis is widened
//! so its first and last ticks sit on its ends (see `axis`). Series `i` is drawn in
//! [`PALETTE`]`[i % 8]`, with circle markers for even `i` and squares for odd `i`. Requested
//! sizes are clamped to [`MIN_WIDTH`]×[`MIN_HEIGHT`] ..= [`MAX_SIDE`]×[`MAX_SIDE`] pixels.

mod axis;
mod draw;
mod legend;
mod range;
mod text;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Context;
use plotters::backend::{BitMapBackend, RGBPixel, SVGBackend};
use plotters::prelude::{FontStyle, IntoDrawingArea, RGBColor};

/// Smallest width, in pixels, a chart is rendered at.
pub const MIN_WIDTH: u32 = 160;
/// Smallest height, in pixels, a chart is rendered at.
pub const MIN_HEIGHT: u32 = 120;
/// Largest width or height, in pixels, a chart is rendered at.
pub const MAX_SIDE: u32 = 4096;

/// Eight distinguishable series colours (Tableau-like), used in order and then repeated.
pub const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4), // blue
    RGBColor(0xff, 0x7f, 0x0e), // orange
    RGBColor(0x2c, 0xa0, 0x2c), // green
    RGBColor(0xd6, 0x27, 0x28), // red
    RGBColor(0x94, 0x67, 0xbd), // purple
    RGBColor(0x8c, 0x56, 0x4b), // brown
    RGBColor(0xe3, 0x77, 0xc2), // pink
    RGBColor(0x17, 0xbe, 0xcf), // cyan
];

/// The colour of the series at `index` in a chart.
pub fn series_color(index: usize) -> RGBColor {
    PALETTE[index % PALETTE.len()]
}

/// The font family every text of a chart uses; the embedded font is registered under it.
const FONT_FAMILY: &str = "sans-serif";

/// DejaVu Sans, cut down to Latin-1 and a few punctuation marks (see `assets/fonts`).
const FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans-subset.ttf");

/// How a series' points are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Style {
    /// Consecutive points joined by a 2 px line, in the order given (no sorting).
    Line,
    /// A filled marker per point: circles for even series indices, squares for odd ones.
    Markers,
    /// Both of the above.
    #[default]
    LineAndMarkers,
}

impl Style {
    fn has_line(self) -> bool {
        matches!(self, Style::Line | Style::LineAndMarkers)
    }

    fn has_markers(self) -> bool {
        matches!(self, Style::Markers | Style::LineAndMarkers)
    }
}

/// One named data series: points in data units, drawn in order, named in the legend.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>, style: Style) -> Series {
        Series { name: name.into(), points, style }
    }
}

/// A 2-D chart: title, axis labels and any number of series sharing one pair of axes. Later
/// series paint over earlier ones; the legend, right of the plot, lists them in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
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
    pub fn to_svg(&self, width: u32, height: u32) -> anyhow::Result<String> {
        register_font()?;
        let size = clamp_size(width, height);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
            draw::chart(self, &root).context("drawing the SVG chart")?;
            root.present().context("finishing the SVG chart")?;
        }
        Ok(svg)
    }

    /// The chart as an encoded 8-bit RGB PNG of `width`×`height` pixels (after clamping).
    pub fn to_png(&self, width: u32, height: u32) -> anyhow::Result<Vec<u8>> {
        register_font()?;
        let (w, h) = clamp_size(width, height);
        let mut pixels = vec![0u8; w as usize * h as usize * 3];
        {
            let backend = BitMapBackend::<RGBPixel>::with_buffer_and_format(&mut pixels, (w, h))
                .context("creating the bitmap")?;
            let root = backend.into_drawing_area();
            draw::chart(self, &root).context("drawing the PNG chart")?;
            root.present().context("finishing the PNG chart")?;
        }
        encode_png(w, h, &pixels).context("encoding the PNG chart")
    }

    /// Writes `<path>.svg` and `<path>.png` (the extensions are appended, so `runs/v1.2` gives
    /// `runs/v1.2.svg`). The parent directory must exist.
    pub fn save(
        &self,
        path_without_extension: &Path,
        width: u32,
        height: u32,
    ) -> anyhow::Result<()> {
        for (suffix, bytes) in [
            (".svg", self.to_svg(width, height)?.into_bytes()),
            (".png", self.to_png(width, height)?),
        ] {
            let path = with_suffix(path_without_extension, suffix);
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// Registers the embedded font with plotters, once per process.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).is_ok()
    });
    anyhow::ensure!(ok, "the embedded chart font does not parse");
    Ok(())
}

/// Encodes RGB8 `pixels` (row-major, `width * height * 3` bytes) as a PNG file in memory.
fn encode_png(width: u32, height: u32, pixels: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(pixels)?;
    writer.finish()?;
    Ok(out)
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
mod tests;
