//! Text helpers: control characters out, widths measured with the embedded font, long strings
//! shortened with a trailing `...` to fit a width.
//!
//! Invariants: [`clean`] output has no control characters (plotters would otherwise break a
//! legend label at a newline); [`fit`] returns its input unchanged when it fits, else the longest
//! prefix plus `...` that fits, else an empty string. Measuring never fails: a font error (the
//! embedded font not registered) measures as zero width, and drawing then reports it.

use plotters::prelude::TextStyle;

/// `text` with control characters (newlines, tabs, escapes) replaced by spaces.
pub(super) fn clean(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// Width in pixels of `text` drawn in `style`.
pub(super) fn width(text: &str, style: &TextStyle<'_>) -> u32 {
    style.font.box_size(text).map_or(0, |(w, _)| w)
}

/// `text`, shortened with a trailing `...` if it is wider than `max_width` pixels in `style`.
pub(super) fn fit(text: &str, max_width: u32, style: &TextStyle<'_>) -> String {
    if width(text, style) <= max_width {
        return text.to_string();
    }
    let chars: Vec<char> = text.chars().collect();
    let candidate = |n: usize| chars[..n].iter().collect::<String>() + "...";
    // Widths grow with the prefix length, so bisect for the longest prefix that fits.
    let (mut lo, mut hi) = (0, chars.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if width(&candidate(mid), style) <= max_width { lo = mid } else { hi = mid - 1 }
    }
    let out = candidate(lo);
    if width(&out, style) <= max_width { out } else { String::new() }
}
