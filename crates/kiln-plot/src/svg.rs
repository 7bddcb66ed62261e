//! SVG back end: writes a [`Scene`] as a standalone, hand-written SVG 1.1 document.
//!
//! The output is one `<svg>` element with a `<title>` (the chart title, if any) and one element
//! per primitive. All text goes through [`escape`], which escapes `& < > " '` and drops
//! characters XML 1.0 forbids, so any chart text yields well-formed XML.
//! Text uses a monospace font sized so its advance matches the layout's bitmap-font metrics.

use std::fmt::Write as _;

use crate::color::Rgb;
use crate::font::{ADVANCE, GLYPH_H};
use crate::scene::{Anchor, Prim, Scene, Shape};

/// Monospace fonts advance about 0.6 em per character.
const MONO_ADVANCE_EM: f64 = 0.6;

/// Renders `scene` as an SVG document.
pub(crate) fn render(scene: &Scene) -> String {
    let mut out = String::with_capacity(4096 + scene.prims.len() * 96);
    let (w, h) = (scene.width, scene.height);
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{w}" height="{h}" viewBox="0 0 {w} {h}">"#
    );
    if !scene.title.trim().is_empty() {
        let _ = writeln!(out, "<title>{}</title>", escape(&scene.title));
    }
    for prim in &scene.prims {
        write_prim(&mut out, prim);
    }
    out.push_str("</svg>\n");
    out
}

fn write_prim(out: &mut String, prim: &Prim) {
    let _ = match prim {
        Prim::Rect { rect, fill, stroke } => {
            let fill = fill.map_or_else(|| "none".to_string(), Rgb::hex);
            let stroke = stroke.map_or_else(String::new, |c| {
                format!(r#" stroke="{}" stroke-width="1" shape-rendering="crispEdges""#, c.hex())
            });
            writeln!(
                out,
                r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{fill}"{stroke}/>"#,
                num(rect.x),
                num(rect.y),
                num(rect.w),
                num(rect.h)
            )
        }
        Prim::Hairline { x1, y1, x2, y2, color } => writeln!(
            out,
            r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="1" shape-rendering="crispEdges"/>"#,
            num(*x1),
            num(*y1),
            num(*x2),
            num(*y2),
            color.hex()
        ),
        Prim::Polyline { points, color } => {
            let pts: Vec<String> =
                points.iter().map(|(x, y)| format!("{},{}", num(*x), num(*y))).collect();
            writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2" stroke-linejoin="round" stroke-linecap="round"/>"#,
                pts.join(" "),
                color.hex()
            )
        }
        Prim::Marker { x, y, shape, radius, color } => {
            write_marker(out, *x, *y, *shape, *radius, &color.hex())
        }
        Prim::Text { x, y, text, scale, anchor, color } => {
            let size = f64::from(ADVANCE * scale) / MONO_ADVANCE_EM;
            let baseline = y + f64::from(GLYPH_H * scale);
            let anchor = match anchor {
                Anchor::Start => "start",
                Anchor::Middle => "middle",
                Anchor::End => "end",
            };
            writeln!(
                out,
                r#"<text x="{}" y="{}" font-family="monospace" font-size="{}" text-anchor="{anchor}" fill="{}" xml:space="preserve">{}</text>"#,
                num(*x),
                num(baseline),
                num(size),
                color.hex(),
                escape(text)
            )
        }
    };
}

fn write_marker(
    out: &mut String,
    x: f64,
    y: f64,
    shape: Shape,
    r: f64,
    fill: &str,
) -> std::fmt::Result {
    match shape {
        Shape::Circle => writeln!(
            out,
            r#"<circle cx="{}" cy="{}" r="{}" fill="{fill}"/>"#,
            num(x),
            num(y),
            num(r)
        ),
        Shape::Square => writeln!(
            out,
            r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{fill}"/>"#,
            num(x - r),
            num(y - r),
            num(2.0 * r),
            num(2.0 * r)
        ),
    }
}

/// A coordinate with at most two decimals and no trailing zeros (`12`, `12.5`, `-0.25`).
fn num(v: f64) -> String {
    let v = if v.is_finite() { v } else { 0.0 };
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".to_string() } else { s.to_string() }
}

/// Escapes `text` for use in XML character data and attribute values: `&`, `<`, `>`, `"` and
/// `'` become entities, characters not allowed in XML 1.0 are dropped.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if allowed_in_xml(c) => out.push(c),
            _ => {}
        }
    }
    out
}

/// The XML 1.0 `Char` production, less tab/newline/carriage return (handled by the caller).
fn allowed_in_xml(c: char) -> bool {
    matches!(u32::from(c), 0x20..=0xD7FF | 0xE000..=0xFFFD | 0x1_0000..=0x10_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_drops_forbidden_characters() {
        assert_eq!(escape(r#"a<b> & "c" 'd'"#), "a&lt;b&gt; &amp; &quot;c&quot; &apos;d&apos;");
        assert_eq!(escape("x\u{0}y\u{1b}z\u{fffe}"), "xyz");
        assert_eq!(escape("p99 ≤ 5 ms"), "p99 ≤ 5 ms");
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(num(12.0), "12");
        assert_eq!(num(12.5), "12.5");
        assert_eq!(num(-0.001), "0");
        assert_eq!(num(1.0 / 3.0), "0.33");
        assert_eq!(num(f64::NAN), "0");
    }
}
