//! A corpus of malformed GGUF files built in code: each must give a clear error, never a panic.

use super::parse::parse_header;
use super::writer::GgufWriter;
use super::{GgufFile, GgufValue};

/// Hand-built header bytes, for files the writer would refuse to make.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn start(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut r = Self::default();
        r.0.extend_from_slice(b"GGUF");
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// One tensor info record.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad_to(&mut self, len: usize) -> &mut Self {
        self.0.resize(len, 0);
        self
    }
}

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", GgufValue::String("llama".into()))
        .metadata("llama.block_count", GgufValue::U32(2))
        .metadata("x.f", GgufValue::F32(0.5))
        .metadata("x.b", GgufValue::Bool(true))
        .metadata(
            "tokenizer.ggml.tokens",
            GgufValue::Array(vec![GgufValue::String("a".into()), GgufValue::String("bc".into())]),
        )
        .metadata("x.nested", GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I32(-1)])]))
        .tensor_f32("a", &[4, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
        .tensor_f32("b", &[3], &[9.0, 10.0, 11.0]);
    w.to_bytes()
}

fn err_of(bytes: &[u8]) -> String {
    match parse_header(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn valid_file_round_trips() {
    let bytes = valid_file();
    let h = parse_header(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.metadata["llama.block_count"].as_u64(), Some(2));
    assert_eq!(h.metadata["x.f"].as_f32(), Some(0.5));
    assert_eq!(h.metadata["x.b"].as_bool(), Some(true));
    assert_eq!(h.metadata["tokenizer.ggml.tokens"].as_array().unwrap()[1].as_str(), Some("bc"));
    assert_eq!(h.tensors.len(), 2);
    let a = &h.tensors[0];
    assert_eq!((a.dims.as_slice(), a.type_id, a.num_bytes), (&[4u64, 2][..], 0, 32));
    assert_eq!(a.offset % 32, 0);
    let first = f32::from_le_bytes(bytes[a.offset..a.offset + 4].try_into().unwrap());
    assert_eq!(first, 1.0);
    let b = &h.tensors[1];
    assert_eq!(f32::from_le_bytes(bytes[b.offset..b.offset + 4].try_into().unwrap()), 9.0);
}

#[test]
fn open_reads_through_the_file_api() {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ok.gguf");
    std::fs::write(&path, valid_file()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.require_usize("llama.block_count").unwrap(), 2);
    assert_eq!(f.str("general.architecture").unwrap(), Some("llama"));
    let tokens = f.array("tokenizer.ggml.tokens", "a string", |v| v.as_str().map(String::from));
    assert_eq!(tokens.unwrap().unwrap(), vec!["a", "bc"]);
    assert!(f.u64("general.architecture").unwrap_err().to_string().contains("unsigned integer"));
    assert!(f.require_usize("missing.key").unwrap_err().to_string().contains("missing"));
    let b = f.tensor("b").unwrap();
    assert_eq!(f.tensor_bytes(b).len(), 12);
    std::fs::write(dir.join("bad.gguf"), b"GGUF").unwrap();
    let e = GgufFile::open(&dir.join("bad.gguf")).err().unwrap().to_string();
    assert!(e.contains("bad.gguf") && e.contains("truncated"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid_file();
    for len in 0..bytes.len() {
        let e = err_of(&bytes[..len]);
        assert!(e.contains("truncated") || e.contains("past the end"), "len {len}: {e}");
    }
}

#[test]
fn bad_magic_and_versions() {
    assert!(err_of(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    assert!(err_of(&Raw::start(1, 0, 0).0).contains("version 1"));
    assert!(err_of(&Raw::start(3u32.swap_bytes(), 0, 0).0).contains("big-endian"));
    assert!(err_of(&Raw::start(99, 0, 0).0).contains("unsupported GGUF version 99"));
    assert!(parse_header(&Raw::start(2, 0, 0).0).is_ok());
}

#[test]
fn absurd_counts_and_lengths() {
    assert!(err_of(&Raw::start(3, 1 << 63, 0).0).contains("tensor count"));
    assert!(err_of(&Raw::start(3, 0, 1 << 63).0).contains("metadata count"));
    // A plausible count with nothing behind it.
    assert!(err_of(&Raw::start(3, 0, 1000).0).contains("truncated"));
    // String lengths: 2^63, u64::MAX (a "negative" i64), and merely past the end.
    for len in [1u64 << 63, u64::MAX, 100] {
        let mut r = Raw::start(3, 0, 1);
        r.u64(len);
        let e = err_of(&r.0);
        assert!(e.contains("cap") || e.contains("truncated"), "{len}: {e}");
    }
    // Array lengths.
    for len in [1u64 << 63, u64::MAX, 1 << 20] {
        let mut r = Raw::start(3, 0, 1);
        r.str("k").u32(9).u32(4).u64(len);
        let e = err_of(&r.0);
        assert!(e.contains("cap") || e.contains("truncated"), "{len}: {e}");
    }
}

#[test]
fn bad_values() {
    let mut r = Raw::start(3, 0, 1);
    r.str("k").u32(13);
    assert!(err_of(&r.0).contains("unknown value type 13"));
    let mut r = Raw::start(3, 0, 1);
    r.str("k").u32(7).0.push(2);
    assert!(err_of(&r.0).contains("bool"));
    let mut r = Raw::start(3, 0, 1);
    r.str("k").u32(8).u64(2).0.extend_from_slice(&[0xff, 0xfe]);
    assert!(err_of(&r.0).contains("UTF-8"));
    // Arrays of arrays of arrays.
    let mut r = Raw::start(3, 0, 1);
    r.str("k").u32(9).u32(9).u64(1).u32(9).u64(1).u32(4).u64(1).u32(7);
    assert!(err_of(&r.0).contains("nested"));
    let mut r = Raw::start(3, 0, 2);
    r.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    assert!(err_of(&r.0).contains("duplicate metadata key `k`"));
}

#[test]
fn bad_alignment() {
    for (ty, a) in [(4u32, 0u64), (4, 3), (4, 48), (10, 1 << 40)] {
        let mut r = Raw::start(3, 0, 1);
        r.str("general.alignment").u32(ty);
        if ty == 4 {
            r.u32(a as u32)
        } else {
            r.u64(a)
        };
        assert!(err_of(&r.0).contains("general.alignment"), "{a}");
    }
    let mut r = Raw::start(3, 0, 1);
    r.str("general.alignment").u32(8).str("32");
    assert!(err_of(&r.0).contains("general.alignment"));
}

/// A file with one tensor record and `data` bytes of data section.
fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
    let mut r = Raw::start(3, 1, 0);
    r.tensor("t", dims, ty, offset);
    let start = r.0.len().next_multiple_of(32);
    r.pad_to(start + data);
    r.0
}

#[test]
fn bad_tensors() {
    assert!(parse_header(&one_tensor(&[4, 2], 0, 0, 32)).is_ok());
    let cases: &[(Vec<u8>, &str)] = &[
        (one_tensor(&[4, 2], 0, 0, 31), "past the end"),
        (one_tensor(&[4, 2], 0, 32, 32), "past the end"),
        (one_tensor(&[4, 2], 0, u64::MAX - 31, 32), "offset overflows"),
        (one_tensor(&[4, 2], 0, 4, 64), "not aligned"),
        (one_tensor(&[4, 2], 99, 0, 64), "unknown or unsupported tensor type 99"),
        (one_tensor(&[4, 2], 15, 0, 64), "unsupported tensor type 15 (Q8_K)"),
        (one_tensor(&[4, 2], 28, 0, 64), "(F64); kiln reads F32"),
        (
            one_tensor(&[4, 2], 35, 0, 64),
            "row length 4 is not a multiple of the type's block of 256",
        ),
        (one_tensor(&[64, 1], 23, 0, 64), "multiple of the type's block of 256"),
        (one_tensor(&[1 << 32, 1 << 32, 1 << 8], 0, 0, 64), "overflow"),
        (one_tensor(&[1 << 62, 4], 0, 0, 64), "overflow"),
        (one_tensor(&[4, 0], 0, 0, 64), "zero"),
        (one_tensor(&[], 0, 0, 64), "dimensions"),
        (one_tensor(&[1, 1, 1, 1, 1], 0, 0, 64), "dimensions"),
        (one_tensor(&[33, 1], 8, 0, 64), "multiple of the type's block of 32"),
        (one_tensor(&[64, 1 << 50], 8, 0, 64), "past the end"),
    ];
    for (bytes, expected) in cases {
        let e = err_of(bytes);
        assert!(e.contains(expected), "expected `{expected}` in `{e}`");
    }
    let mut r = Raw::start(3, 2, 0);
    r.tensor("t", &[1], 0, 0).tensor("t", &[1], 0, 32);
    let start = r.0.len().next_multiple_of(32);
    r.pad_to(start + 64);
    assert!(err_of(&r.0).contains("duplicate tensor name `t`"));
    // A tensor count that the header cannot hold.
    let mut r = Raw::start(3, 60_000, 0);
    r.tensor("t", &[1], 0, 0);
    assert!(err_of(&r.0).contains("truncated"));
}
