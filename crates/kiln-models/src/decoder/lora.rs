//! LoRA in the decoder: adapters bound to the backend in numbered slots, and each step's rows
//! grouped into runs of one adapter, so that every projection runs its base matmul once for
//! all rows and then each adapter's low-rank update on its own rows only
//! ([`Backend::lora_add`], one call per projection for all adapters, as Punica's SGMV).
//!
//! Invariants: slot 0 is the base model alone and is never bound; a run never mixes slots and
//! never spans rows of a slot-0 sequence; the update of a row depends on its own input and its
//! adapter alone, so a request's output is the same alone or beside other adapters.

use std::ops::Range;

use kiln_backend::{Backend, ForwardBatch, ForwardError, LoraJob};

use crate::LoadError;
use crate::lora::{LoraAdapter, LoraTarget, NUM_LORA_TARGETS};

/// One updated projection on the backend: `a` `[rank, k]`, `b_t` `[rank, n]`.
struct BoundMatrix<B: Backend> {
    rank: usize,
    a: B::LoraMatrix,
    b_t: B::LoraMatrix,
}

/// An adapter on the backend: per layer, the update of each target.
pub(super) struct BoundAdapter<B: Backend> {
    layers: Vec<[Option<BoundMatrix<B>>; NUM_LORA_TARGETS]>,
}

impl<B: Backend> BoundAdapter<B> {
    pub(super) fn bind(backend: &B, adapter: &LoraAdapter) -> Result<Self, LoadError> {
        let load = |name: String, values: &[f32]| {
            backend
                .load_lora_matrix(values, adapter.dtype())
                .map_err(|e| LoadError::Backend { name, message: e.to_string() })
        };
        let mut layers = Vec::with_capacity(adapter.num_layers());
        for l in 0..adapter.num_layers() {
            let mut targets: [Option<BoundMatrix<B>>; NUM_LORA_TARGETS] = Default::default();
            for target in LoraTarget::ALL {
                if let Some(m) = adapter.matrix(l, target) {
                    let name = |half: &str| format!("layer {l} {} lora_{half}", target.module());
                    targets[target as usize] = Some(BoundMatrix {
                        rank: m.rank,
                        a: load(name("A"), &m.a)?,
                        b_t: load(name("B"), &m.b_t)?,
                    });
                }
            }
            layers.push(targets);
        }
        Ok(Self { layers })
    }
}

/// The step's rows by adapter: runs of consecutive rows of one non-zero slot, over all token
/// rows (`full`) and over the logits rows compacted to the front (`pruned`, the last layer's).
#[derive(Default)]
pub(super) struct AdapterRuns {
    full: Vec<(Range<usize>, u32)>,
    pruned: Vec<(Range<usize>, u32)>,
}

impl AdapterRuns {
    /// The runs of `batch`, after checking every slot it names is bound.
    pub(super) fn of<B: Backend>(
        batch: &ForwardBatch,
        adapters: &[Option<BoundAdapter<B>>],
    ) -> Result<Self, ForwardError> {
        let mut runs = Self::default();
        if !batch.has_adapters() {
            return Ok(runs);
        }
        let slots = batch.seq_adapters();
        if let Some(&slot) = slots.iter().find(|&&s| s != 0 && !is_bound(adapters, s)) {
            return Err(ForwardError::Batch(format!("no LoRA adapter is loaded in slot {slot}")));
        }
        for (seq, &slot) in batch.seqs().iter().zip(slots) {
            push_rows(&mut runs.full, seq.query_start..seq.query_start + seq.query_len, slot);
        }
        let mut seqs = batch.seqs().iter().zip(slots).peekable();
        for (i, &row) in batch.logits_rows().iter().enumerate() {
            while seqs.peek().is_some_and(|(s, _)| s.query_start + s.query_len <= row) {
                seqs.next();
            }
            if let Some(&(_, &slot)) = seqs.peek() {
                push_rows(&mut runs.pruned, i..i + 1, slot);
            }
        }
        Ok(runs)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.full.is_empty()
    }

    /// The adapters of rows `slice` of layer `layer` (`pruned`: rows are the compacted logits
    /// rows), rows relative to the slice; `None` when no row of the slice has one.
    pub(super) fn slice<'a, B: Backend>(
        &self,
        pruned: bool,
        slice: &Range<usize>,
        adapters: &'a [Option<BoundAdapter<B>>],
        layer: usize,
    ) -> Option<SliceLora<'a, B>> {
        let runs = if pruned { &self.pruned } else { &self.full };
        let rows: Vec<(Range<usize>, &'a BoundAdapter<B>)> = runs
            .iter()
            .filter_map(|(r, slot)| {
                let (start, end) = (r.start.max(slice.start), r.end.min(slice.end));
                let adapter = adapters.get(*slot as usize - 1)?.as_ref()?;
                (start < end).then(|| (start - slice.start..end - slice.start, adapter))
            })
            .collect();
        (!rows.is_empty()).then_some(SliceLora { rows, layer })
    }
}

fn is_bound<B: Backend>(adapters: &[Option<BoundAdapter<B>>], slot: u32) -> bool {
    adapters.get(slot as usize - 1).is_some_and(Option::is_some)
}

/// Appends rows `r` of `slot`, extending the last run when it continues it (slot 0: none).
fn push_rows(runs: &mut Vec<(Range<usize>, u32)>, r: Range<usize>, slot: u32) {
    if slot == 0 {
        return;
    }
    match runs.last_mut() {
        Some((last, s)) if *s == slot && last.end == r.start => last.end = r.end,
        _ => runs.push((r, slot)),
    }
}

/// The adapters of one slice of one layer.
pub(super) struct SliceLora<'a, B: Backend> {
    rows: Vec<(Range<usize>, &'a BoundAdapter<B>)>,
    layer: usize,
}

impl<B: Backend> SliceLora<'_, B> {
    /// `out += ` each adapter's update of `target` on its rows (`x`: `[rows, k]`, `out`:
    /// `[rows, n]` of the slice).
    pub(super) fn apply(
        &self,
        backend: &B,
        target: LoraTarget,
        (x, k): (B::View<'_>, usize),
        (out, n): (B::ViewMut<'_>, usize),
    ) {
        let jobs: Vec<LoraJob<'_, B>> = self
            .rows
            .iter()
            .filter_map(|(rows, adapter)| {
                let m = adapter.layers[self.layer][target as usize].as_ref()?;
                Some(LoraJob { rows: rows.clone(), rank: m.rank, a: &m.a, b_t: &m.b_t })
            })
            .collect();
        if !jobs.is_empty() {
            backend.lora_add(x, k, n, &jobs, out);
        }
    }
}
