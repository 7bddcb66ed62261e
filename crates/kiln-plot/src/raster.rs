//! Raster back end: paints a [`Scene`] into an 8-bit RGB pixel buffer.
//!
//! No anti-aliasing: every pixel holds exactly one of the scene's colours. Coordinates are
//! rounded to the nearest pixel; hairlines are 1 px Bresenham lines, data lines are Bresenham
//! lines drawn with a 2×2 brush, markers are filled discs or squares, and text uses the built-in
//! 5×7 font with each font pixel blown up to `scale`×`scale`. Drawing outside the canvas is
//! clipped per pixel, and coordinates are clamped to ±[`COORD_LIMIT`] first, so no input can
//! index out of bounds or make a line loop run for long.

use crate::color::{self, Rgb};
use crate::font::{self, ADVANCE, GLYPH_H, GLYPH_W};
use crate::scene::{Anchor, Prim, Scene, Shape};

/// Largest pixel coordinate magnitude the rasterizer works with.
const COORD_LIMIT: f64 = 1e5;

/// An RGB8 image, rows top to bottom, three bytes per pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Canvas {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl Canvas {
    /// A `width`×`height` canvas filled with `background`.
    pub(crate) fn new(width: u32, height: u32, background: Rgb) -> Canvas {
        let len = width as usize * height as usize;
        let pixels = [background.0, background.1, background.2].repeat(len);
        Canvas { width, height, pixels }
    }

    pub(crate) fn width(&self) -> u32 {
        self.width
    }

    pub(crate) fn height(&self) -> u32 {
        self.height
    }

    /// The raw RGB8 bytes, `width * height * 3` of them.
    pub(crate) fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The colour at (`x`, `y`), or `None` outside the canvas.
    #[cfg(test)]
    pub(crate) fn get(&self, x: i64, y: i64) -> Option<Rgb> {
        let i = self.index(x, y)?;
        Some(Rgb(self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]))
    }

    fn index(&self, x: i64, y: i64) -> Option<usize> {
        let x = u32::try_from(x).ok().filter(|&x| x < self.width)?;
        let y = u32::try_from(y).ok().filter(|&y| y < self.height)?;
        Some((y as usize * self.width as usize + x as usize) * 3)
    }

    fn put(&mut self, x: i64, y: i64, c: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.pixels[i..i + 3].copy_from_slice(&[c.0, c.1, c.2]);
        }
    }

    /// Fills pixels `x0..x1` × `y0..y1` (half-open), clipped to the canvas.
    fn fill_rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        let (w, h) = (i64::from(self.width), i64::from(self.height));
        for y in y0.max(0)..y1.min(h) {
            for x in x0.max(0)..x1.min(w) {
                self.put(x, y, c);
            }
        }
    }

    /// A Bresenham line from (`x0`, `y0`) to (`x1`, `y1`), both ends included, painting a
    /// `brush`×`brush` square at each step.
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), brush: i64, c: Rgb) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.fill_rect(x, y, x + brush, y + brush, c);
            if x == x1 && y == y1 {
                return;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A filled disc of radius `r` centred on (`cx`, `cy`).
    fn disc(&mut self, cx: i64, cy: i64, r: f64, c: Rgb) {
        let ri = r.ceil() as i64;
        let limit = (r + 0.5) * (r + 0.5);
        for dy in -ri..=ri {
            for dx in -ri..=ri {
                if ((dx * dx + dy * dy) as f64) <= limit {
                    self.put(cx + dx, cy + dy, c);
                }
            }
        }
    }

    /// `text` in the bitmap font, its glyph box's top edge at `y`, anchored at `x`.
    fn text(&mut self, x: f64, y: f64, text: &str, scale: u32, anchor: Anchor, c: Rgb) {
        let width = font::text_width(text.chars().count(), scale);
        let left = match anchor {
            Anchor::Start => x,
            Anchor::Middle => x - width / 2.0,
            Anchor::End => x - width,
        };
        let (left, top, s) = (px(left), px(y), i64::from(scale));
        for (i, ch) in text.chars().enumerate() {
            let gx = left + i as i64 * i64::from(ADVANCE) * s;
            if gx > i64::from(self.width) {
                break;
            }
            for col in 0..GLYPH_W {
                for row in (0..GLYPH_H).filter(|&row| font::is_ink(ch, col, row)) {
                    let (x0, y0) = (gx + i64::from(col) * s, top + i64::from(row) * s);
                    self.fill_rect(x0, y0, x0 + s, y0 + s, c);
                }
            }
        }
    }
}

/// Rounds a scene coordinate to a pixel index, clamping wild values.
fn px(v: f64) -> i64 {
    if v.is_finite() { v.clamp(-COORD_LIMIT, COORD_LIMIT).round() as i64 } else { 0 }
}

/// Paints every primitive of `scene`, in order, onto a fresh canvas.
pub(crate) fn render(scene: &Scene) -> Canvas {
    let mut canvas = Canvas::new(scene.width, scene.height, color::BACKGROUND);
    for prim in &scene.prims {
        paint(&mut canvas, prim);
    }
    canvas
}

fn paint(canvas: &mut Canvas, prim: &Prim) {
    match prim {
        Prim::Rect { rect, fill, stroke } => {
            let (x0, y0, x1, y1) = (px(rect.x), px(rect.y), px(rect.right()), px(rect.bottom()));
            if let Some(c) = fill {
                canvas.fill_rect(x0, y0, x1, y1, *c);
            }
            if let Some(c) = stroke {
                for (a, b) in [((x0, y0), (x1, y0)), ((x1, y0), (x1, y1))] {
                    canvas.line(a, b, 1, *c);
                }
                for (a, b) in [((x1, y1), (x0, y1)), ((x0, y1), (x0, y0))] {
                    canvas.line(a, b, 1, *c);
                }
            }
        }
        Prim::Hairline { x1, y1, x2, y2, color } => {
            canvas.line((px(*x1), px(*y1)), (px(*x2), px(*y2)), 1, *color);
        }
        Prim::Polyline { points, color } => {
            for pair in points.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                // The 2×2 brush grows right and down; start it half a pixel up-left.
                let a = (px(a.0 - 0.5), px(a.1 - 0.5));
                let b = (px(b.0 - 0.5), px(b.1 - 0.5));
                canvas.line(a, b, 2, *color);
            }
        }
        Prim::Marker { x, y, shape, radius, color } => match shape {
            Shape::Circle => canvas.disc(px(*x), px(*y), *radius, *color),
            Shape::Square => {
                let (cx, cy, r) = (px(*x), px(*y), radius.round() as i64);
                canvas.fill_rect(cx - r, cy - r, cx + r + 1, cy + r + 1, *color);
            }
        },
        Prim::Text { x, y, text, scale, anchor, color } => {
            canvas.text(*x, *y, text, *scale, *anchor, *color);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RED: Rgb = Rgb(255, 0, 0);

    fn count(canvas: &Canvas, c: Rgb) -> usize {
        canvas.pixels().chunks(3).filter(|p| p == &[c.0, c.1, c.2]).count()
    }

    #[test]
    fn lines_are_continuous_and_two_pixels_wide() {
        let mut canvas = Canvas::new(40, 40, color::BACKGROUND);
        canvas.line((2, 5), (30, 5), 2, RED);
        for x in 2..=31 {
            assert_eq!(canvas.get(x, 5), Some(RED));
            assert_eq!(canvas.get(x, 6), Some(RED));
        }
        assert_eq!(count(&canvas, RED), 30 * 2);
        let mut canvas = Canvas::new(40, 40, color::BACKGROUND);
        canvas.line((0, 0), (10, 30), 1, RED);
        // A steep 1 px line has exactly one pixel per row.
        assert_eq!(count(&canvas, RED), 31);
    }

    #[test]
    fn drawing_off_canvas_is_clipped() {
        let mut canvas = Canvas::new(10, 10, color::BACKGROUND);
        canvas.line((-100_000, -7), (100_000, 3), 2, RED);
        canvas.disc(-3, -3, 5.0, RED);
        canvas.text(-20.0, 8.0, "hello", 2, Anchor::Start, RED);
        canvas.fill_rect(i64::MIN / 2, 0, i64::MAX / 2, 1, RED);
        assert_eq!(canvas.pixels().len(), 300);
        assert_eq!(canvas.get(10, 0), None);
        assert_eq!(canvas.get(-1, 0), None);
    }

    #[test]
    fn disc_is_round_and_filled() {
        let mut canvas = Canvas::new(21, 21, color::BACKGROUND);
        canvas.disc(10, 10, 5.0, RED);
        assert_eq!(canvas.get(10, 10), Some(RED));
        assert_eq!(canvas.get(15, 10), Some(RED));
        assert_eq!(canvas.get(10, 5), Some(RED));
        assert_eq!(canvas.get(15, 15), Some(color::BACKGROUND));
        let n = count(&canvas, RED);
        assert!((70..=100).contains(&n), "disc of radius 5 covers {n} pixels");
    }

    #[test]
    fn text_paints_glyph_pixels_at_scale() {
        let mut canvas = Canvas::new(30, 20, color::BACKGROUND);
        canvas.text(1.0, 1.0, "L", 2, Anchor::Start, RED);
        // 'L' is a 7-pixel column plus a 4-pixel foot: 11 font pixels, 4 canvas pixels each.
        assert_eq!(count(&canvas, RED), 11 * 4);
        assert_eq!(canvas.get(1, 1), Some(RED));
        assert_eq!(canvas.get(10, 14), Some(RED));
        let mut right = Canvas::new(30, 20, color::BACKGROUND);
        right.text(29.0, 1.0, "L", 2, Anchor::End, RED);
        assert_eq!(right.get(28, 14), Some(RED));
    }
}
