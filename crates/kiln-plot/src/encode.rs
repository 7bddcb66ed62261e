//! PNG encoding of an RGB8 pixel buffer with the `png` crate.
//!
//! The buffer must hold exactly `width * height * 3` bytes, rows top to bottom; a mismatch (or
//! any other encoder complaint) comes back as an [`io::Error`], never a panic.

use std::io;

/// Encodes `pixels` (RGB8, row-major) as a complete PNG file in memory.
pub(crate) fn png_rgb(width: u32, height: u32, pixels: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(io::Error::other)?;
    writer.write_image_data(pixels).map_err(io::Error::other)?;
    writer.finish().map_err(io::Error::other)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_the_decoder() {
        let pixels: Vec<u8> = (0..4 * 3 * 3).map(|i| (i * 7) as u8).collect();
        let bytes = png_rgb(4, 3, &pixels).unwrap();
        let decoder = png::Decoder::new(io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height, info.color_type), (4, 3, png::ColorType::Rgb));
        assert_eq!(&buf[..info.buffer_size()], &pixels[..]);
    }

    #[test]
    fn wrong_buffer_size_is_an_error() {
        assert!(png_rgb(4, 3, &[0; 5]).is_err());
        assert!(png_rgb(0, 3, &[]).is_err());
    }
}
