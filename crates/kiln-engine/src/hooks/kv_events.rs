//! KV events as a step hook: the prefix-cache index changes of each step (blocks stored with
//! their parent and tokens, removed, all cleared) go to their sink, in order, on the engine
//! thread. Never an empty batch.

use kiln_sched::Scheduler;

use super::{HookContext, StepHook, StepView};
use crate::KvEventSink;

pub(crate) struct KvEvents {
    sink: KvEventSink,
}

impl KvEvents {
    pub(crate) fn new(sink: KvEventSink) -> Self {
        Self { sink }
    }

    /// Hands the index changes since the last call to the sink, if any.
    pub(crate) fn flush(&mut self, scheduler: &mut Scheduler) {
        let events = scheduler.kv_cache_mut().take_events();
        if !events.is_empty() {
            (self.sink)(events);
        }
    }
}

impl StepHook for KvEvents {
    fn after_step(&mut self, _: &StepView<'_>, ctx: &mut HookContext<'_>) {
        self.flush(ctx.scheduler);
    }
}
