//! The few MessagePack encodings a KV event batch needs (arrays, string-keyed maps, strings,
//! unsigned integers, floats, nil), written as the specification gives them: the smallest form
//! for each value, as msgspec and rmp write them.

/// Appends MessagePack values to a byte buffer.
#[derive(Default)]
pub struct Writer {
    pub bytes: Vec<u8>,
}

impl Writer {
    pub fn nil(&mut self) {
        self.bytes.push(0xc0);
    }

    pub fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.bytes.push(v as u8),
            0x80..=0xff => self.bytes.extend([0xcc, v as u8]),
            0x100..=0xffff => {
                self.bytes.push(0xcd);
                self.bytes.extend((v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.bytes.push(0xce);
                self.bytes.extend((v as u32).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xcf);
                self.bytes.extend(v.to_be_bytes());
            }
        }
    }

    pub fn f64(&mut self, v: f64) {
        self.bytes.push(0xcb);
        self.bytes.extend(v.to_be_bytes());
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.bytes.push(0xa0 | n as u8),
            32..=0xff => self.bytes.extend([0xd9, n as u8]),
            0x100..=0xffff => {
                self.bytes.push(0xda);
                self.bytes.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.bytes.push(0xdb);
                self.bytes.extend(u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
            }
        }
        self.bytes.extend(s.as_bytes());
    }

    /// The header of an array of `n` values (the values follow).
    pub fn array(&mut self, n: usize) {
        self.container(n, 0x90, 0xdc, 0xdd);
    }

    /// The header of a map of `n` key-value pairs (the pairs follow).
    pub fn map(&mut self, n: usize) {
        self.container(n, 0x80, 0xde, 0xdf);
    }

    fn container(&mut self, n: usize, fix: u8, x16: u8, x32: u8) {
        match n {
            0..=15 => self.bytes.push(fix | n as u8),
            16..=0xffff => {
                self.bytes.push(x16);
                self.bytes.extend((n as u16).to_be_bytes());
            }
            _ => {
                self.bytes.push(x32);
                self.bytes.extend(u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Writer;

    #[test]
    fn values_take_their_smallest_forms() {
        let mut w = Writer::default();
        for v in [0, 127, 128, 255, 256, 65_535, 65_536, u64::from(u32::MAX), u64::MAX] {
            w.uint(v);
        }
        let want: Vec<u8> = [
            &[0x00][..],
            &[0x7f],
            &[0xcc, 0x80],
            &[0xcc, 0xff],
            &[0xcd, 0x01, 0x00],
            &[0xcd, 0xff, 0xff],
            &[0xce, 0x00, 0x01, 0x00, 0x00],
            &[0xce, 0xff, 0xff, 0xff, 0xff],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        ]
        .concat();
        assert_eq!(w.bytes, want);

        let mut w = Writer::default();
        w.map(1);
        w.str("type");
        w.array(2);
        w.nil();
        w.f64(1.5);
        w.array(16);
        w.str(&"x".repeat(32));
        assert_eq!(&w.bytes[..7], &[0x81, 0xa4, b't', b'y', b'p', b'e', 0x92]);
        assert_eq!(&w.bytes[7..17], &[0xc0, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&w.bytes[17..22], &[0xdc, 0x00, 0x10, 0xd9, 32]);
        assert_eq!(w.bytes.len(), 22 + 32);
    }
}
