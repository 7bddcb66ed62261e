//! The bounded GGUF header reader. Every count, length and offset is checked against the bytes
//! that remain before anything is allocated or indexed, so a hostile file costs at most its own
//! size in memory and always ends in an error, never a panic.

use std::collections::HashMap;

use super::GgufValue;

/// Longest string we accept (chat templates are the longest real ones, a few tens of KiB).
pub(super) const MAX_STRING_BYTES: u64 = 16 << 20;
/// Most elements in one array (vocabularies reach a few hundred thousand).
pub(super) const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Most metadata entries and tensors.
pub(super) const MAX_KV_COUNT: u64 = 1 << 16;
pub(super) const MAX_TENSOR_COUNT: u64 = 1 << 16;
/// Arrays of arrays deeper than this are rejected.
const MAX_ARRAY_DEPTH: usize = 2;
/// ggml tensors have at most four dimensions.
pub(super) const MAX_DIMS: u32 = 4;

/// A tensor as the header describes it, validated against the file.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub type_id: u32,
    /// Absolute byte offset of the tensor's data in its file.
    pub offset: usize,
    pub num_bytes: usize,
    /// Which file of a split model holds it (0: the first, or the only one).
    pub shard: usize,
}

/// What the header parse yields.
pub(super) struct Header {
    pub version: u32,
    pub metadata: HashMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: usize,
}

/// Little-endian cursor that reports where it failed.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file has {remaining} left",
                self.pos
            ));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES {
            return Err(format!("{what}: string length {len} exceeds the {MAX_STRING_BYTES} cap"));
        }
        let b = self.take(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what}: string is not valid UTF-8"))
    }

    fn value(&mut self, type_id: u32, what: &str, depth: usize) -> Result<GgufValue, String> {
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("{what}: bool byte is {b}, not 0 or 1")),
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"));
                }
                let elem_type = self.u32(what)?;
                let len = self.u64(what)?;
                if len > MAX_ARRAY_LEN {
                    return Err(format!("{what}: array length {len} exceeds the cap"));
                }
                // Every element takes at least one byte: a length beyond the rest of the file
                // is a lie, caught before allocating for it.
                if len > self.remaining() {
                    return Err(format!(
                        "truncated: {what} claims {len} elements but {} bytes remain",
                        self.remaining()
                    ));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_type, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{what}: unknown value type {t}")),
        })
    }
}

/// ggml's tensor types by id (`ggml.h`), for naming the ones kiln cannot load.
const GGML_TYPE_NAMES: &[(u32, &str)] =
    &[(9, "Q8_1"), (15, "Q8_K"), (24, "I8"), (25, "I16"), (26, "I32"), (27, "I64"), (28, "F64")];

/// The refusal of a tensor of type `type_id`: named when ggml knows it, with what to do.
fn unsupported_type(what: &str, type_id: u32) -> String {
    match GGML_TYPE_NAMES.iter().find(|(id, _)| *id == type_id) {
        Some((_, name)) => format!(
            "{what}: unsupported tensor type {type_id} ({name}); kiln reads F32, F16, BF16, \
             Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, \
             IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and MXFP4 \
             (the types of every llama-quantize preset)"
        ),
        None => format!("{what}: unknown or unsupported tensor type {type_id}"),
    }
}

/// `(block elements, block bytes)` of the tensor types kiln can load.
pub(super) fn type_layout(type_id: u32) -> Option<(u64, u64)> {
    kiln_backend::GgmlType::from_gguf_id(type_id)
        .map(|t| (t.block_elems() as u64, t.block_bytes() as u64))
}

/// Parses and validates the header of a whole GGUF file held in `bytes`.
pub(super) fn parse_header(bytes: &[u8]) -> Result<Header, String> {
    let mut cur = Cursor { bytes, pos: 0 };
    let magic = cur.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"));
    }
    let version = cur.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (convert it to v3)".into()),
        v if v.swap_bytes() <= 3 => {
            return Err("big-endian GGUF files are not supported".into());
        }
        v => return Err(format!("unsupported GGUF version {v}")),
    }
    let tensor_count = cur.u64("tensor count")?;
    if tensor_count > MAX_TENSOR_COUNT {
        return Err(format!("tensor count {tensor_count} exceeds the {MAX_TENSOR_COUNT} cap"));
    }
    let kv_count = cur.u64("metadata count")?;
    if kv_count > MAX_KV_COUNT {
        return Err(format!("metadata count {kv_count} exceeds the {MAX_KV_COUNT} cap"));
    }
    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = cur.string(&format!("metadata key #{i}"))?;
        let type_id = cur.u32(&format!("type of `{key}`"))?;
        let value = cur.value(type_id, &format!("metadata `{key}`"), 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("duplicate metadata key `{key}`"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(format!(
                    "general.alignment must be a nonzero power of two up to 2^20, got {v:?}"
                ));
            }
        },
    };
    let mut raw = Vec::with_capacity(tensor_count.min(cur.remaining()) as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..tensor_count {
        let name = cur.string(&format!("tensor #{i} name"))?;
        let what = format!("tensor `{name}`");
        let n_dims = cur.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("{what}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)"));
        }
        let dims = (0..n_dims).map(|_| cur.u64(&what)).collect::<Result<Vec<_>, _>>()?;
        let type_id = cur.u32(&what)?;
        let offset = cur.u64(&what)?;
        if !names.insert(name.clone()) {
            return Err(format!("duplicate tensor name `{name}`"));
        }
        raw.push((name, dims, type_id, offset));
    }
    let tensors = place_tensors(raw, cur.pos as u64, bytes.len() as u64, alignment)?;
    Ok(Header { version, metadata, tensors, alignment: alignment as usize })
}

/// A tensor record as read: name, dims, type id, offset in the data section.
type RawTensor = (String, Vec<u64>, u32, u64);

/// Validates each tensor against its type and the data section (which starts at the first
/// multiple of `alignment` after `header_end`) and makes its offset absolute.
fn place_tensors(
    raw: Vec<RawTensor>,
    header_end: u64,
    file_len: u64,
    alignment: u64,
) -> Result<Vec<GgufTensorInfo>, String> {
    let data_start = header_end.next_multiple_of(alignment);
    if data_start > file_len && !raw.is_empty() {
        return Err(format!("data section starts at {data_start}, past the end ({file_len})"));
    }
    let data_len = file_len.saturating_sub(data_start);
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, type_id, offset) in raw {
        let what = format!("tensor `{name}`");
        let (block_elems, block_bytes) =
            type_layout(type_id).ok_or_else(|| unsupported_type(&what, type_id))?;
        let elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("{what}: dimensions {dims:?} overflow"))?;
        if elems == 0 {
            return Err(format!("{what}: a dimension is zero"));
        }
        if dims[0] % block_elems != 0 {
            return Err(format!(
                "{what}: row length {} is not a multiple of the type's block of {block_elems}",
                dims[0]
            ));
        }
        let num_bytes = (elems / block_elems)
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("{what}: byte size overflows"))?;
        if offset % alignment != 0 {
            return Err(format!("{what}: data offset {offset} is not aligned to {alignment}"));
        }
        let end =
            offset.checked_add(num_bytes).ok_or_else(|| format!("{what}: offset overflows"))?;
        if end > data_len {
            return Err(format!(
                "{what}: data [{offset}, {end}) lies past the end of the {data_len}-byte data section"
            ));
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            type_id,
            offset: (data_start + offset) as usize,
            num_bytes: num_bytes as usize,
            shard: 0,
        });
    }
    Ok(tensors)
}
