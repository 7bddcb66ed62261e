//! kiln-plot: small, dependency-light 2-D line/scatter charts rendered to SVG and PNG.
//!
//! Used by `kiln tune` to draw throughput–latency Pareto fronts and latency percentiles against
//! load. Describe a [`Chart`] (title, axis labels, [`Series`] of `(x, y)` points, each drawn in a
//! [`Style`]) and call [`Chart::to_svg`], [`Chart::to_png`] or [`Chart::save`]. All drawing is
//! this crate's own code; only PNG compression is delegated to the `png` crate.
//!
//! ```
//! use kiln_plot::{Chart, Series, Style};
//!
//! let chart = Chart::new("Pareto front", "throughput (tok/s)", "p99 TPOT (ms)")
//!     .with_series(Series::new("front", vec![(120.0, 9.5), (480.0, 14.0)], Style::LineAndMarkers));
//! let svg = chart.to_svg(800, 500);
//! assert!(svg.contains("Pareto front"));
//! let png = chart.to_png(800, 500);
//! assert!(png.starts_with(b"\x89PNG"));
//! ```
//!
//! Invariants: rendering never panics and never fails for any chart contents: empty charts,
//! empty series, single points, all-equal values and non-finite points all render (non-finite
//! points are skipped). Axes get "nice" 1/2/5 × 10^k ticks fitted to the data with a little
//! padding; the optional log10 x axis spans whole decades. Both outputs share one layout, so
//! they agree pixel for pixel on geometry; colours come from a fixed 8-colour [`PALETTE`].
//!
//! Modules: `chart` (public types and entry points), `scale` (axis fitting and ticks), `scene`
//! (layout into drawing primitives), `svg` and `raster` (the two back ends), `font` (5×7 bitmap
//! font), `encode` (PNG encoding), `color` (palette).

mod chart;
mod color;
mod encode;
mod font;
mod raster;
mod scale;
mod scene;
mod svg;

pub use chart::{Chart, MAX_SIDE, MIN_HEIGHT, MIN_WIDTH, Series, Style};
pub use color::{PALETTE, Rgb, series_color};

#[cfg(test)]
mod tests;
