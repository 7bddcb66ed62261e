//! [`EngineHandle`]: runs an [`EngineCore`] on its own thread and talks to it over std channels
//! (no async runtime in the engine; the server adapts [`RequestStream`] to its own).
//!
//! The engine thread blocks on the command channel while idle, and between steps drains every
//! pending command (submit, abort, shutdown) before the next step. Each request's outputs go to
//! its own channel; dropping a [`RequestStream`] before it finished aborts the request, which
//! frees its blocks at once.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvError, Sender, TryRecvError};
use std::thread::JoinHandle;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_sched::RequestOutput;

use crate::{EngineCore, EngineError, EngineStats};

/// One item of a [`RequestStream`]: a token (the last one carries the finish reason) or the
/// error that ended the request.
pub type StreamItem = Result<RequestOutput, EngineError>;

enum Command {
    Submit {
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
        outputs: Sender<StreamItem>,
        reply: Sender<Result<RequestId, EngineError>>,
    },
    Abort(RequestId),
    Stats(Sender<EngineStats>),
    Shutdown,
}

/// A running engine thread. Dropping it shuts the engine down (like [`EngineHandle::shutdown`]).
pub struct EngineHandle {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
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
        let (commands, rx) = mpsc::channel();
        let thread =
            std::thread::Builder::new().name("kiln-engine".into()).spawn(move || run(core, &rx))?;
        Ok(Self { commands, thread: Some(thread) })
    }

    /// Queues a request (blocks until the engine thread accepted or refused it, at most one
    /// step). Lower `priority` is more urgent.
    pub fn submit(
        &self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<RequestStream, EngineError> {
        let (outputs_tx, outputs) = mpsc::channel();
        let (reply, reply_rx) = mpsc::channel();
        self.commands
            .send(Command::Submit { prompt, params, priority, outputs: outputs_tx, reply })
            .map_err(|_| EngineError::Shutdown)?;
        let id = reply_rx.recv().map_err(|_| EngineError::Shutdown)??;
        Ok(RequestStream { id, outputs, commands: self.commands.clone(), finished: false })
    }

    /// Aborts a request (a no-op when it already finished).
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// The engine's counters as of its last step.
    pub fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.commands.send(Command::Stats(tx)).map_err(|_| EngineError::Shutdown)?;
        rx.recv().map_err(|_| EngineError::Shutdown)
    }

    /// Stops the engine thread after its current step; open streams end.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
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
        if !matches!(item, Ok(RequestOutput { finish_reason: None, .. })) {
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

/// The engine thread.
fn run(mut core: EngineCore, commands: &Receiver<Command>) {
    let mut streams: HashMap<RequestId, Sender<StreamItem>> = HashMap::new();
    loop {
        // Idle: sleep until a command arrives.
        if !core.has_unfinished() {
            match commands.recv() {
                Ok(cmd) => {
                    if !handle(&mut core, &mut streams, cmd) {
                        return;
                    }
                }
                Err(RecvError) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(cmd) => {
                    if !handle(&mut core, &mut streams, cmd) {
                        return;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        if !core.has_unfinished() {
            continue;
        }
        match core.step() {
            Ok(outputs) => {
                for out in outputs {
                    let Some(tx) = streams.get(&out.id) else { continue };
                    if tx.send(Ok(out)).is_err() {
                        streams.remove(&out.id);
                        core.abort(out.id);
                    } else if out.finish_reason.is_some() {
                        streams.remove(&out.id);
                    }
                }
            }
            Err(e) => {
                for (id, tx) in streams.drain() {
                    let _ = tx.send(Err(e.clone()));
                    core.abort(id);
                }
            }
        }
    }
}

/// Applies one command; `false` means shut down.
fn handle(
    core: &mut EngineCore,
    streams: &mut HashMap<RequestId, Sender<StreamItem>>,
    cmd: Command,
) -> bool {
    match cmd {
        Command::Submit { prompt, params, priority, outputs, reply } => {
            let result = core.add_request(prompt, params, priority);
            if let Ok(id) = result {
                streams.insert(id, outputs);
            }
            let _ = reply.send(result);
        }
        Command::Abort(id) => {
            streams.remove(&id);
            core.abort(id);
        }
        Command::Stats(reply) => {
            let _ = reply.send(core.stats());
        }
        Command::Shutdown => return false,
    }
    true
}
