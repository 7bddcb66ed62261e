//! Colours: the fixed series palette and the neutral tones of the chart furniture.
//!
//! Series `i` is drawn in `PALETTE[i % PALETTE.len()]`; the palette (Tableau-like, minus grey and
//! olive) keeps neighbouring entries easy to tell apart. Every colour is opaque 8-bit RGB, so the
//! raster output holds these exact values (there is no anti-aliasing to blend them).

/// An opaque 8-bit RGB colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    /// `#rrggbb`, as used in SVG attributes.
    pub fn hex(self) -> String {
        format!("#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
    }
}

/// Eight distinguishable series colours, used in order and then repeated.
pub const PALETTE: [Rgb; 8] = [
    Rgb(0x1f, 0x77, 0xb4), // blue
    Rgb(0xff, 0x7f, 0x0e), // orange
    Rgb(0x2c, 0xa0, 0x2c), // green
    Rgb(0xd6, 0x27, 0x28), // red
    Rgb(0x94, 0x67, 0xbd), // purple
    Rgb(0x8c, 0x56, 0x4b), // brown
    Rgb(0xe3, 0x77, 0xc2), // pink
    Rgb(0x17, 0xbe, 0xcf), // cyan
];

/// The colour of the series at `index` in a chart.
pub fn series_color(index: usize) -> Rgb {
    PALETTE[index % PALETTE.len()]
}

pub(crate) const BACKGROUND: Rgb = Rgb(0xff, 0xff, 0xff);
pub(crate) const GRID: Rgb = Rgb(0xe5, 0xe5, 0xe5);
pub(crate) const AXIS: Rgb = Rgb(0x44, 0x44, 0x44);
pub(crate) const TEXT: Rgb = Rgb(0x22, 0x22, 0x22);
pub(crate) const LEGEND_BORDER: Rgb = Rgb(0xbb, 0xbb, 0xbb);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn palette_is_distinct_and_distinct_from_furniture() {
        for (i, a) in PALETTE.iter().enumerate() {
            for b in PALETTE.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
            for f in [BACKGROUND, GRID, AXIS, TEXT, LEGEND_BORDER] {
                assert_ne!(*a, f);
            }
        }
        assert_eq!(series_color(9), PALETTE[1]);
        assert_eq!(Rgb(0x1f, 0x77, 0xb4).hex(), "#1f77b4");
    }
}
