//! CUDA graphs: a forward step recorded once and replayed with one launch, instead of the
//! several hundred kernel launches and cuBLAS calls of an eager step (vLLM's default; its
//! `--enforce-eager` turns it off, as kiln's does).
//!
//! How [`Cuda::run_step_graphed`] runs a step that may be graphed (at most [`MAX_GRAPH_TOKENS`]
//! tokens, no sequence with more than [`MAX_GRAPH_QUERY`] query rows: decode and speculative
//! verification, not prefill):
//! 1. **Trace.** The model's forward runs with every kernel launch, GEMM and device copy
//!    written down as words (which kernel, its launch shape, every argument with device
//!    addresses) instead of queued. The step's metadata (token ids, positions, slots, block
//!    tables) is uploaded to its scratch slots as in an eager step: it is the graph's input.
//! 2. **Replay.** A graph captured from the same words is launched, and the logits copied back.
//! 3. Otherwise the step runs eagerly. The second time a trace is seen it is **captured**
//!    first: the forward runs again into a stream capture, and the graph is launched.
//!
//! Invariants:
//! - a graph is launched only for a step whose trace equals, word for word, the trace it was
//!   captured from: the same kernels with the same shapes and arguments, reading the metadata
//!   just uploaded, so replay == eager bit for bit. Buffers freed since the capture cannot
//!   matter: a trace naming the same addresses describes the same launches.
//! - the graph reads each metadata slot once per launch, so a trace that changes a kind of
//!   metadata after it was used in the step is never replayed, and a capture that would
//!   upload, allocate or read back anything is discarded ([`Recorder::poison`]); such steps run
//!   eagerly.
//! - at most [`MAX_GRAPHS`] graphs are kept; the least recently launched goes first.
//!
//! Cost: a trace runs the model's host code without launches (tens of microseconds at 8B),
//! a replay one graph launch. Capture instantiates a graph of the step's launches once.

use std::collections::HashMap;

use cudarc::driver::{CudaGraph, sys};
use kiln_backend::{ForwardBatch, ForwardError, Logits};

use crate::Cuda;

/// Most tokens of a step that is graphed (vLLM's largest default capture size).
pub const MAX_GRAPH_TOKENS: usize = 512;
/// Most query rows of one sequence in a graphed step (decode and speculative verification).
pub const MAX_GRAPH_QUERY: usize = 16;
/// Most graphs kept.
pub const MAX_GRAPHS: usize = 256;

/// How operations are issued right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Queued on the stream as they come.
    Eager,
    /// Written down, not queued (metadata uploads still happen).
    Trace,
    /// Written down and queued into a stream capture.
    Capture,
}

/// The words of a traced or captured step, and what kept it from being a graph.
#[derive(Default)]
pub(crate) struct Recording {
    words: Vec<u64>,
    poisoned: Option<&'static str>,
    /// The logits' device address and length, read back after the step.
    download: Option<(u64, usize)>,
}

/// The recording in progress (one per device; the engine runs one step at a time).
pub(crate) struct Recorder {
    mode: Mode,
    rec: Recording,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self { mode: Mode::Eager, rec: Recording::default() }
    }

    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }

    /// Writes down one operation; whether to queue it on the stream.
    pub(crate) fn issue(&mut self, words: &[u64]) -> bool {
        if self.mode == Mode::Eager {
            return true;
        }
        self.rec.words.push(words.len() as u64);
        self.rec.words.extend_from_slice(words);
        self.mode == Mode::Capture
    }

    /// Marks the recording unusable as a graph (the first reason is kept).
    pub(crate) fn poison(&mut self, why: &'static str) {
        if self.mode != Mode::Eager {
            self.rec.poisoned.get_or_insert(why);
        }
    }

    /// Whether a host read of `len` f32 at `src` is put off until after the step (it is when
    /// recording; a second one poisons the recording).
    pub(crate) fn defer_download(&mut self, src: u64, len: usize) -> bool {
        if self.mode == Mode::Eager {
            return false;
        }
        if self.rec.download.replace((src, len)).is_some() {
            self.poison("two host reads in one step");
        }
        true
    }

    fn begin(&mut self, mode: Mode, words: Vec<u64>) {
        self.mode = mode;
        self.rec = Recording { words, poisoned: None, download: None };
        self.rec.words.clear();
    }

    fn finish(&mut self) -> Recording {
        self.mode = Mode::Eager;
        std::mem::take(&mut self.rec)
    }
}

/// A captured graph (`CudaGraph` holds raw driver handles; it is only touched under the
/// cache's lock, on the thread running the step).
struct Captured {
    graph: CudaGraph,
    words: Vec<u64>,
    last_used: u64,
}

// SAFETY: the graph's handles are used only through `GraphCache`'s mutex, one thread at a
// time, with the context bound by `CudaGraph::launch`.
unsafe impl Send for Captured {}

/// Counts of how steps ran, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps replayed from a graph (the capturing step included).
    pub replayed: u64,
    /// Graphs captured.
    pub captured: u64,
    /// Steps that could have been graphed but ran eagerly (first sightings, poisoned traces).
    pub eager: u64,
    /// Captures thrown away (something in the step cannot be in a graph).
    pub discarded: u64,
}

/// What is known of a trace that has no graph.
#[derive(Clone, Copy)]
enum Sighting {
    Once,
    /// Its capture did not reproduce the trace: it runs eagerly from now on.
    Uncapturable,
}

/// The graphs, by the hash of their trace.
pub(crate) struct GraphCache {
    enabled: bool,
    graphs: HashMap<u64, Captured>,
    /// Traces without a graph, by hash (cleared when it grows past a bound).
    seen: HashMap<u64, Sighting>,
    clock: u64,
    stats: GraphStats,
    /// A spare words vector for the next trace.
    spare: Vec<u64>,
}

impl GraphCache {
    pub(crate) fn new() -> Self {
        Self {
            enabled: true,
            graphs: HashMap::new(),
            seen: HashMap::new(),
            clock: 0,
            stats: GraphStats::default(),
            spare: Vec::new(),
        }
    }

    /// Keeps `graph`, making room first.
    fn insert(&mut self, key: u64, graph: CudaGraph, words: Vec<u64>) {
        if self.graphs.len() >= MAX_GRAPHS {
            let oldest = self.graphs.iter().min_by_key(|(_, g)| g.last_used).map(|(&k, _)| k);
            if let Some(k) = oldest {
                self.graphs.remove(&k);
            }
        }
        self.clock += 1;
        self.graphs.insert(key, Captured { graph, words, last_used: self.clock });
    }

    /// Whether to capture a graph of trace `key` now: on its second sighting, unless a
    /// capture of it failed before.
    fn capture_now(&mut self, key: u64) -> bool {
        if self.seen.len() > 4 * MAX_GRAPHS {
            self.seen.clear();
        }
        match self.seen.insert(key, Sighting::Once) {
            None => false,
            Some(Sighting::Once) => true,
            Some(Sighting::Uncapturable) => {
                self.seen.insert(key, Sighting::Uncapturable);
                false
            }
        }
    }
}

/// FNV-1a over the words, folded a word at a time.
fn hash_words(words: &[u64]) -> u64 {
    words.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        (h ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(29)
    })
}

/// Whether `batch` is of the kind that is graphed.
fn graphable(batch: &ForwardBatch) -> bool {
    let t = batch.num_tokens();
    t > 0
        && t <= MAX_GRAPH_TOKENS
        && batch.tree_mask().is_none()
        && batch.seqs().iter().all(|s| s.query_len <= MAX_GRAPH_QUERY)
}

type Forward<'a> = dyn FnMut(&mut Logits) -> Result<(), ForwardError> + 'a;

impl Cuda {
    /// Turns graphs on or off (`--enforce-eager` turns them off); off drops those captured.
    pub fn set_graphs(&self, enabled: bool) {
        let mut cache = self.graph_cache();
        cache.enabled = enabled;
        if !enabled {
            cache.graphs.clear();
            cache.seen.clear();
        }
    }

    pub fn graphs_enabled(&self) -> bool {
        self.graph_cache().enabled
    }

    pub fn graph_stats(&self) -> GraphStats {
        self.graph_cache().stats
    }

    /// [`kiln_backend::Backend::run_step`]: see the module docs.
    pub(crate) fn run_step_graphed(
        &self,
        batch: &ForwardBatch,
        logits: &mut Logits,
        forward: &mut Forward<'_>,
    ) -> Result<(), ForwardError> {
        if !self.graphs_enabled() || !graphable(batch) {
            return forward(logits);
        }
        let spare = std::mem::take(&mut self.graph_cache().spare);
        let trace = self.record(Mode::Trace, spare, &mut *forward, logits)?;
        let key = hash_words(&trace.words);
        let mut cache = self.graph_cache();
        if trace.poisoned.is_some() {
            cache.stats.eager += 1;
            cache.spare = trace.words;
            drop(cache);
            return forward(logits);
        }
        cache.clock += 1;
        let clock = cache.clock;
        if let Some(g) = cache.graphs.get_mut(&key).filter(|g| g.words == trace.words) {
            g.last_used = clock;
            self.launch_graph(&g.graph, trace.download, logits);
            cache.stats.replayed += 1;
            cache.spare = trace.words;
            return Ok(());
        }
        if !cache.capture_now(key) {
            cache.stats.eager += 1;
            cache.spare = trace.words;
            drop(cache);
            return forward(logits);
        }
        drop(cache);
        let Some(graph) = self.capture(&mut *forward, logits, &trace.words) else {
            let mut cache = self.graph_cache();
            cache.stats.discarded += 1;
            cache.seen.insert(key, Sighting::Uncapturable);
            drop(cache);
            return forward(logits);
        };
        self.launch_graph(&graph, trace.download, logits);
        let mut cache = self.graph_cache();
        cache.stats.captured += 1;
        cache.stats.replayed += 1;
        cache.insert(key, graph, trace.words);
        Ok(())
    }

    /// Runs `forward` in `mode` and returns what it recorded.
    fn record(
        &self,
        mode: Mode,
        words: Vec<u64>,
        forward: &mut Forward<'_>,
        logits: &mut Logits,
    ) -> Result<Recording, ForwardError> {
        self.scratch().begin_step();
        self.device.recorder().begin(mode, words);
        let result = forward(logits);
        let rec = self.device.recorder().finish();
        result.map(|()| rec)
    }

    /// Captures `forward` into a graph; `None` when the capture does not reproduce `words`
    /// or something in it cannot be captured.
    fn capture(
        &self,
        forward: &mut Forward<'_>,
        logits: &mut Logits,
        words: &[u64],
    ) -> Option<CudaGraph> {
        let stream = &self.device.stream;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        stream.begin_capture(mode).ok()?;
        let rec = self.record(Mode::Capture, Vec::with_capacity(words.len()), forward, logits);
        // The capture must end whatever happened inside it.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let rec = rec.ok()?;
        let graph = graph.ok().flatten()?;
        (rec.poisoned.is_none() && rec.words == words).then_some(graph)
    }

    /// Launches `graph` and copies the logits it leaves at `download` into `logits` (already
    /// shaped by the trace).
    fn launch_graph(&self, graph: &CudaGraph, download: Option<(u64, usize)>, logits: &mut Logits) {
        crate::device::expect_ok(graph.launch(), "launching a CUDA graph");
        if let Some((src, len)) = download {
            let out = logits.as_mut_slice();
            assert_eq!(out.len(), len, "graph logits");
            self.device.download(out, src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorder_writes_down_only_while_recording() {
        let mut r = Recorder::new();
        assert!(r.issue(&[1, 2, 3]), "eager: queue it");
        assert!(!r.defer_download(64, 10), "eager: read back now");
        r.poison("ignored while eager");
        r.begin(Mode::Trace, Vec::new());
        assert!(!r.issue(&[1, 2, 3]), "trace: write down, do not queue");
        assert!(r.defer_download(64, 10));
        let trace = r.finish();
        assert_eq!(trace.words, [3, 1, 2, 3]);
        assert_eq!((trace.poisoned, trace.download), (None, Some((64, 10))));
        assert_eq!(r.mode(), Mode::Eager);
        r.begin(Mode::Capture, trace.words);
        assert!(r.issue(&[1, 2, 3]), "capture: queue into the capture");
        assert_eq!(r.finish().words, [3, 1, 2, 3], "a fresh recording each time");
    }

    #[test]
    fn a_second_read_back_or_a_poison_keeps_the_first_reason() {
        let mut r = Recorder::new();
        r.begin(Mode::Trace, Vec::new());
        assert!(r.defer_download(64, 10));
        assert!(r.defer_download(128, 10));
        r.poison("later");
        assert_eq!(r.finish().poisoned, Some("two host reads in one step"));
    }

    #[test]
    fn traces_differ_by_any_word_and_by_where_operations_split() {
        let mut r = Recorder::new();
        let mut trace = |ops: &[&[u64]]| {
            r.begin(Mode::Trace, Vec::new());
            for op in ops {
                r.issue(op);
            }
            r.finish().words
        };
        let a = trace(&[&[1, 2], &[3]]);
        assert_eq!(a, trace(&[&[1, 2], &[3]]));
        assert_ne!(a, trace(&[&[1], &[2, 3]]), "operation boundaries are part of the trace");
        assert_ne!(a, trace(&[&[1, 2], &[4]]));
        assert_ne!(hash_words(&a), hash_words(&trace(&[&[1, 2], &[4]])));
    }

    #[test]
    fn only_decode_and_verification_steps_are_graphed() {
        let mut batch = ForwardBatch::new(16);
        assert!(!graphable(&batch), "an empty step");
        let table: Vec<u32> = (0..8).collect();
        batch.push_seq(&[1], 10, &table, kiln_backend::LogitsWanted::Last).unwrap();
        batch.push_seq(&[1, 2, 3], 20, &table, kiln_backend::LogitsWanted::All).unwrap();
        assert!(graphable(&batch));
        let prompt = vec![1; MAX_GRAPH_QUERY + 1];
        batch.push_seq(&prompt, 0, &table, kiln_backend::LogitsWanted::Last).unwrap();
        assert!(!graphable(&batch), "a prompt chunk");
    }
}
