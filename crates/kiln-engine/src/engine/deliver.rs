//! The deliver phase: a step's outputs go to the sinks of their requests (the server's
//! streams), on the engine thread, after the step's counters are published.
//!
//! Invariant: a request with a sink leaves the request table here (finished and delivered, or
//! its receiver gone: aborted) or by an abort; one without a sink leaves when its step is
//! reported, and the caller of `step` takes its outputs.

use super::{EngineCore, EngineError, EngineOutput};

impl EngineCore {
    /// Hands each of `outputs` to its request's sink (`EngineCore::set_sink`):
    /// a request whose sink reports its receiver gone is aborted (its blocks freed at once), a
    /// finished one leaves the table. Outputs of requests without a sink are dropped. Returns
    /// whether a request was aborted (the gauges changed).
    pub(crate) fn deliver(&mut self, outputs: Vec<EngineOutput>) -> bool {
        let mut aborted = false;
        for out in outputs {
            let id = out.id;
            let finished = out.finish_reason.is_some();
            let Some(sink) = self.requests.get_mut(id).and_then(|r| r.sink.as_mut()) else {
                continue;
            };
            if !sink(Ok(out)) {
                self.abort(id);
                aborted = true;
            } else if finished {
                self.requests.remove(id);
            }
        }
        aborted
    }

    /// Ends every request that has a sink with `error` (a failed step): its sink gets the
    /// error, and it is aborted.
    pub(crate) fn fail_delivery(&mut self, error: &EngineError) {
        for id in self.requests.ids_with_sinks() {
            if let Some(mut sink) = self.requests.get_mut(id).and_then(|r| r.sink.take()) {
                sink(Err(error.clone()));
            }
            self.abort(id);
        }
    }
}
