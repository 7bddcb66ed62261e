//! [`EngineHandle`]: runs an [`EngineCore`] on its own thread and talks to it over std channels
//! (no async runtime in the engine: the server hands in an [`OutputSink`] that forwards into
//! its own runtime's channel).
//!
//! The engine thread blocks on the command channel while idle, and between steps drains every
//! pending command (submit, abort, shutdown) before the next step. Each request's outputs go to
//! its own sink; a sink that reports its receiver gone gets the request aborted, and dropping a
//! [`RequestStream`] before it finished aborts the request too, which frees its blocks at once.
//! Request ids are handed out by the handle, so [`EngineHandle::submit_with_sink`] never waits
//! for the engine thread.
//!
//! LoRA adapters change at run time through the same channel: a bind waits for the step in
//! flight, if any, to be reported first (the model must be on the engine thread); an unbind
//! refuses new requests of the slot at once and answers once its last request has ended and
//! the slot is empty.

mod kv;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use kiln_core::{RequestId, SamplingParams, TokenId};

pub use kv::{ExportReply, KvImport, KvPort};

use crate::{EngineCore, EngineError, EngineOutput, EngineStats, LoraAdapter, PreparedRequest};

/// One item of a request's output: a token (the last one carries the finish reason) or the
/// error that ended the request.
pub type StreamItem = Result<EngineOutput, EngineError>;

/// Receives one request's outputs on the engine thread; returns `false` once nobody listens
/// (the engine then aborts the request). It must not block.
pub type OutputSink = Box<dyn FnMut(StreamItem) -> bool + Send>;

/// Called on the engine thread with the engine's counters after every step (before that step's
/// outputs go to the sinks, and again if delivering them aborted a request), and when commands
/// left it idle (the gauges changed without a step).
pub type StepObserver = Box<dyn FnMut(&EngineStats) + Send>;

struct Submission {
    id: RequestId,
    request: Unprepared,
    priority: i64,
    sink: OutputSink,
    /// Told whether the request was accepted; without it a refusal goes to the sink.
    reply: Option<Sender<Result<(), EngineError>>>,
    /// KV fetched from a prefill worker, imported just before the request is added.
    import: Option<KvImport>,
}

/// A submitted request: prepared by the caller, or to be prepared on the engine thread.
#[expect(clippy::large_enum_variant, reason = "it travels inside the boxed Submission")]
enum Unprepared {
    Raw { prompt: Vec<TokenId>, params: SamplingParams },
    Prepared(PreparedRequest),
}

enum Command {
    Submit(Box<Submission>),
    Abort(RequestId),
    /// [`EngineCore::set_adapter`], answered with the binding's cache key.
    SetAdapter {
        slot: u32,
        adapter: Option<Arc<LoraAdapter>>,
        reply: Sender<AdapterReply>,
    },
    /// [`EngineCore::unbind_adapter_when_drained`], answered once the slot is empty.
    UnbindAdapter {
        slot: u32,
        reply: Sender<Result<(), EngineError>>,
    },
    /// Prefill/decode disaggregation (`handle/kv.rs`).
    Kv(kv::KvCommand),
    Shutdown,
}

/// The answer to a bind: the binding's prefix-cache key.
pub type AdapterReply = Result<u64, EngineError>;

/// Unbinds waiting for their slot's requests to end.
type PendingUnbinds = Vec<(u32, Sender<Result<(), EngineError>>)>;

/// A running engine thread. Dropping it shuts the engine down (like [`EngineHandle::shutdown`]).
pub struct EngineHandle {
    commands: Sender<Command>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_id: AtomicU64,
    stats: Arc<Mutex<EngineStats>>,
}

/// The outputs of one request, in order. Ends (`recv` returns `None`) after the token that
/// carries a finish reason, after an error, or when the engine shuts down.
pub struct RequestStream {
    id: RequestId,
    outputs: Receiver<StreamItem>,
    commands: Sender<Command>,
    finished: bool,
}

impl EngineHandle {
    /// Starts the engine thread.
    pub fn spawn(core: EngineCore) -> std::io::Result<Self> {
        Self::spawn_with_observer(core, None)
    }

    /// Starts the engine thread; `observer` sees the counters after every step.
    pub fn spawn_with_observer(
        core: EngineCore,
        observer: Option<StepObserver>,
    ) -> std::io::Result<Self> {
        let (commands, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(core.stats()));
        let shared = Arc::clone(&stats);
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || run(core, &rx, &shared, observer))?;
        Ok(Self { commands, thread: Mutex::new(Some(thread)), next_id: AtomicU64::new(0), stats })
    }

    /// Queues a request and waits until the engine thread accepted or refused it (at most one
    /// step). Lower `priority` is more urgent.
    pub fn submit(
        &self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<RequestStream, EngineError> {
        let (outputs_tx, outputs) = mpsc::channel();
        let (reply, reply_rx) = mpsc::channel();
        let sink: OutputSink = Box::new(move |item| outputs_tx.send(item).is_ok());
        let request = Unprepared::Raw { prompt, params };
        let id = self.send_submit(request, priority, sink, Some(reply), None)?;
        reply_rx.recv().map_err(|_| EngineError::Shutdown)??;
        Ok(RequestStream { id, outputs, commands: self.commands.clone(), finished: false })
    }

    /// Queues a request without waiting: its outputs, or the error refusing it, go to `sink`.
    /// Fails only when the engine has shut down.
    pub fn submit_with_sink(
        &self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
        sink: OutputSink,
    ) -> Result<RequestId, EngineError> {
        self.send_submit(Unprepared::Raw { prompt, params }, priority, sink, None, None)
    }

    /// [`EngineHandle::submit_with_sink`] for a request prepared off the engine thread (ids
    /// checked, structured output compiled): the engine does not redo either.
    pub fn submit_prepared_with_sink(
        &self,
        request: PreparedRequest,
        priority: i64,
        sink: OutputSink,
    ) -> Result<RequestId, EngineError> {
        self.send_submit(Unprepared::Prepared(request), priority, sink, None, None)
    }

    /// [`EngineHandle::submit_prepared_with_sink`] for a decode worker's request: `import`
    /// (its prompt's KV fetched from a prefill worker) goes into the prefix cache first, in
    /// the same command, so the request's admission finds it.
    pub fn submit_imported_with_sink(
        &self,
        request: PreparedRequest,
        priority: i64,
        sink: OutputSink,
        import: KvImport,
    ) -> Result<RequestId, EngineError> {
        self.send_submit(Unprepared::Prepared(request), priority, sink, None, Some(import))
    }

    fn send_submit(
        &self,
        request: Unprepared,
        priority: i64,
        sink: OutputSink,
        reply: Option<Sender<Result<(), EngineError>>>,
        import: Option<KvImport>,
    ) -> Result<RequestId, EngineError> {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let submission = Submission { id, request, priority, sink, reply, import };
        self.commands
            .send(Command::Submit(Box::new(submission)))
            .map_err(|_| EngineError::Shutdown)?;
        Ok(id)
    }

    /// Sends KV commands to this engine from other threads (prefill/decode disaggregation).
    pub fn kv_port(&self) -> KvPort {
        KvPort { commands: self.commands.clone() }
    }

    /// Binds `adapter` to `slot` (or empties it: `None`) between steps, without stopping the
    /// other requests ([`EngineCore::set_adapter`]); the receiver gets the binding's cache key
    /// or the refusal.
    pub fn set_adapter(
        &self,
        slot: u32,
        adapter: Option<Arc<LoraAdapter>>,
    ) -> Receiver<AdapterReply> {
        let (reply, rx) = mpsc::channel();
        let _ = self.commands.send(Command::SetAdapter { slot, adapter, reply });
        rx
    }

    /// Unloads the adapter in `slot` once its requests end (new ones are refused at once); the
    /// receiver gets `Ok` when the slot is empty. A closed receiver means the engine stopped.
    pub fn unbind_adapter_when_drained(&self, slot: u32) -> Receiver<Result<(), EngineError>> {
        let (reply, rx) = mpsc::channel();
        let _ = self.commands.send(Command::UnbindAdapter { slot, reply });
        rx
    }

    /// Aborts a request (a no-op when it already finished).
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// The engine's counters as of its last step or command (never waits for a step).
    pub fn stats(&self) -> EngineStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the engine thread after its current step; open streams end.
    pub fn shutdown(self) {
        self.stop();
    }

    /// Stops the engine thread after its current step and waits until it has run the core's
    /// shutdown hook and ended; later calls return at once. Open streams end; later
    /// submissions are refused.
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Whether the stream has delivered its last item.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The next output, blocking; `None` once the stream has ended.
    pub fn recv(&mut self) -> Option<StreamItem> {
        if self.finished {
            return None;
        }
        if let Ok(item) = self.outputs.recv() {
            Some(self.note(item))
        } else {
            self.finished = true;
            None
        }
    }

    /// The next output if one is ready: `Err(Empty)` when none yet, `Err(Disconnected)` once the
    /// stream has ended.
    pub fn try_recv(&mut self) -> Result<StreamItem, TryRecvError> {
        if self.finished {
            return Err(TryRecvError::Disconnected);
        }
        match self.outputs.try_recv() {
            Ok(item) => Ok(self.note(item)),
            Err(TryRecvError::Disconnected) => {
                self.finished = true;
                Err(TryRecvError::Disconnected)
            }
            Err(TryRecvError::Empty) => Err(TryRecvError::Empty),
        }
    }

    fn note(&mut self, item: StreamItem) -> StreamItem {
        if !matches!(item, Ok(EngineOutput { finish_reason: None, .. })) {
            self.finished = true;
        }
        item
    }
}

impl Iterator for RequestStream {
    type Item = StreamItem;

    fn next(&mut self) -> Option<StreamItem> {
        self.recv()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

/// The engine thread: steps until shut down, then runs the core's shutdown hook.
fn run(
    mut core: EngineCore,
    commands: &Receiver<Command>,
    shared: &Mutex<EngineStats>,
    observer: Option<StepObserver>,
) {
    run_until_shutdown(&mut core, commands, shared, observer);
    core.run_shutdown_hook();
}

fn run_until_shutdown(
    core: &mut EngineCore,
    commands: &Receiver<Command>,
    shared: &Mutex<EngineStats>,
    mut observer: Option<StepObserver>,
) {
    // After every step, before its outputs reach the clients (so a client that has its answer
    // reads metrics that count it), again when delivering aborted a request, and whenever
    // commands left the engine idle (aborts change the gauges): the stats and the prefix-cache
    // events.
    let mut publish = |core: &mut EngineCore| {
        core.flush_kv_events();
        let stats = core.stats();
        *shared.lock().unwrap_or_else(PoisonError::into_inner) = stats;
        if let Some(observe) = observer.as_mut() {
            observe(&stats);
        }
    };
    let mut unbinds = PendingUnbinds::new();
    loop {
        finish_unbinds(core, &mut unbinds, &mut publish);
        kv::expire(core, &mut publish);
        // Idle: sleep until a command arrives (or the next KV pin's deadline).
        if !core.has_unfinished() {
            let received = match core.next_kv_pin_deadline() {
                None => commands.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => commands.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match received {
                Ok(cmd) => {
                    if !handle(core, cmd, &mut unbinds, &mut publish) {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(cmd) => {
                    if !handle(core, cmd, &mut unbinds, &mut publish) {
                        return;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        if !core.has_unfinished() {
            publish(core);
            continue;
        }
        let stepped = core.step();
        report(core, stepped, &mut publish);
    }
}

/// Hands a step's outputs to the sinks (or its error to every request), publishing the
/// counters before the clients see them and again if delivering aborted a request.
fn report(
    core: &mut EngineCore,
    stepped: Result<Vec<EngineOutput>, EngineError>,
    publish: &mut dyn FnMut(&mut EngineCore),
) {
    match stepped {
        Ok(outputs) => {
            publish(core);
            if core.deliver(outputs) {
                publish(core);
            }
        }
        Err(e) => {
            core.fail_delivery(&e);
            publish(core);
        }
    }
}

/// Reports the step in flight, if any, so that the model is back on the engine thread.
fn settle(core: &mut EngineCore, publish: &mut dyn FnMut(&mut EngineCore)) {
    if core.has_step_in_flight() {
        let stepped = core.finish_in_flight();
        report(core, stepped, publish);
    }
}

/// Empties the draining slots whose requests have all ended and answers their unbinds.
fn finish_unbinds(
    core: &mut EngineCore,
    unbinds: &mut PendingUnbinds,
    publish: &mut dyn FnMut(&mut EngineCore),
) {
    if unbinds.is_empty() || !core.has_drained_adapters() {
        return;
    }
    settle(core, publish);
    let emptied = core.unbind_drained();
    unbinds.retain(|(slot, reply)| {
        let done = emptied.contains(slot);
        if done {
            let _ = reply.send(Ok(()));
        }
        !done
    });
    publish(core);
}

/// Applies one command; `false` means shut down.
fn handle(
    core: &mut EngineCore,
    cmd: Command,
    unbinds: &mut PendingUnbinds,
    publish: &mut dyn FnMut(&mut EngineCore),
) -> bool {
    match cmd {
        Command::Submit(submission) => {
            let Submission { id, request, priority, mut sink, reply, import } = *submission;
            if let Some(import) = &import {
                let prompt = match &request {
                    Unprepared::Raw { prompt, .. } => prompt.as_slice(),
                    Unprepared::Prepared(r) => r.prompt(),
                };
                kv::import(core, prompt, import, publish);
            }
            let added = match request {
                Unprepared::Raw { prompt, params } => {
                    core.add_request_with_id(id, prompt, params, priority)
                }
                Unprepared::Prepared(request) => core.add_prepared(id, request, priority),
            };
            match added {
                Ok(()) => {
                    core.set_sink(id, sink);
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(()));
                    }
                }
                Err(e) => match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(e));
                    }
                    None => {
                        sink(Err(e));
                    }
                },
            }
        }
        Command::Abort(id) => {
            core.abort(id);
        }
        Command::SetAdapter { slot, adapter, reply } => {
            settle(core, publish);
            let _ = reply.send(core.set_adapter(slot, adapter.as_deref()));
            publish(core);
        }
        Command::UnbindAdapter { slot, reply } => match core.unbind_adapter_when_drained(slot) {
            Ok(true) => {
                let _ = reply.send(Ok(()));
                publish(core);
            }
            Ok(false) => unbinds.push((slot, reply)),
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        },
        Command::Kv(cmd) => kv::handle(core, cmd, publish),
        Command::Shutdown => return false,
    }
    true
}
