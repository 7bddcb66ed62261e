//! Device scratch space the operations share: the bf16 copy of a GEMM's input, attention's
//! per-split partial results, row gathers, the logits before they go to the host, and the
//! step's integer metadata.
//!
//! Metadata (token ids, positions, slots, block tables, sequence spans, row lists) arrives as
//! host slices with every operation ([`kiln_backend::Backend`]'s contract). It is the same for
//! every layer of a step, so each kind is uploaded only when it differs from the last upload
//! of that kind: once per step in practice. Uploads are queued on the stream like kernels, so
//! overwriting a slot never races a kernel still reading it.

use crate::device::{DevMem, Device};

/// The kinds of step metadata, each with its own device slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Meta {
    TokenIds,
    Positions,
    Slots,
    BlockTables,
    /// `[num_seqs, 4]`: query start, query length, context length, block-table start.
    Seqs,
    /// `[num_rows]`: the sequence of each query row.
    RowSeq,
    /// Row indices of a gather or compaction.
    Rows,
    /// `[num_tiles, 2]`: the sequence and first query row of each prefill attention tile.
    Tiles,
}

const NUM_META: usize = 8;

/// A device slot and a host copy of what it holds.
struct MetaSlot {
    host: Vec<u32>,
    dev: Option<DevMem>,
}

/// Scratch buffers, grown on demand and kept.
pub(crate) struct Scratch {
    meta: [MetaSlot; NUM_META],
    /// bf16 copy of a GEMM input.
    pub(crate) x_bf16: Option<DevMem>,
    /// f32: attention's partial outputs and (m, l) pairs, row gathers, logits.
    pub(crate) parts: Option<DevMem>,
    pub(crate) parts_ml: Option<DevMem>,
    pub(crate) rows: Option<DevMem>,
    pub(crate) logits: Option<DevMem>,
    /// Bit `kind` set once that kind was used in the current step.
    used_in_step: u8,
}

impl Scratch {
    pub(crate) fn new() -> Self {
        Self {
            meta: std::array::from_fn(|_| MetaSlot { host: Vec::new(), dev: None }),
            x_bf16: None,
            parts: None,
            parts_ml: None,
            rows: None,
            logits: None,
            used_in_step: 0,
        }
    }

    /// A step starts: no kind of metadata has been used in it yet.
    pub(crate) fn begin_step(&mut self) {
        self.used_in_step = 0;
    }

    /// The device address of `values` as `kind`, uploading only when they changed.
    ///
    /// A graph reads each slot once per launch, so while a step is recorded for one, a kind
    /// that changes after it was used in the step, or any upload during a capture, poisons the
    /// recording.
    pub(crate) fn meta(&mut self, device: &Device, kind: Meta, values: &[u32]) -> u64 {
        let bit = 1u8 << kind as u8;
        let used = self.used_in_step & bit != 0;
        self.used_in_step |= bit;
        let slot = &mut self.meta[kind as usize];
        let fits = slot.dev.as_ref().is_some_and(|d| d.bytes >= 4 * values.len().max(1));
        if fits && slot.host == values {
            return slot.dev.as_ref().map_or(0, |d| d.ptr);
        }
        if used {
            device.recorder().poison("step metadata that changes within the step");
        }
        if device.capturing() {
            device.recorder().poison("an upload during a capture");
            return slot.dev.as_ref().map_or(0, |d| d.ptr);
        }
        if !fits {
            // Grow by half again so a slowly growing batch does not reallocate every step.
            let bytes = 4 * (values.len() + values.len() / 2).max(256);
            slot.dev = Some(device.alloc_or_panic(bytes));
        }
        let ptr = slot.dev.as_ref().map_or(0, |d| d.ptr);
        device.upload(ptr, values);
        slot.host.clear();
        slot.host.extend_from_slice(values);
        ptr
    }
}

/// The address of `slot`, grown to at least `bytes` first (contents unspecified).
/// During a graph capture nothing is allocated: the capture is poisoned instead.
pub(crate) fn grown(device: &Device, slot: &mut Option<DevMem>, bytes: usize) -> u64 {
    if slot.as_ref().is_none_or(|m| m.bytes < bytes) {
        if device.capturing() {
            device.recorder().poison("an allocation during a capture");
            return slot.as_ref().map_or(0, |m| m.ptr);
        }
        *slot = None; // free the old one first: it may be large
        *slot = Some(device.alloc_or_panic(bytes + bytes / 4));
    }
    slot.as_ref().map_or(0, |m| m.ptr)
}
