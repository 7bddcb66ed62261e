//! The engine thread's side of prefill/decode disaggregation ([`crate::kv_handoff`]): a
//! [`KvPort`] (cloneable, for the server's transfer listener and its routes) sends KV commands
//! down the handle's channel; reading or writing blocks first waits for a step in flight.
//!
//! Invariant: pins expire on the engine thread, which wakes at the earliest deadline even
//! while idle (`run_until_shutdown`), so an unfetched pin never outlives its time by more than
//! one step.

use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Instant;

use kiln_core::TokenId;

use super::{Command, settle};
use crate::{EngineCore, KvHandoffError};

/// KV fetched from a prefill worker, imported before the request it belongs to is admitted.
#[derive(Debug)]
pub struct KvImport {
    /// The prompt block the data starts at (the blocks before it are cached here).
    pub first_block: usize,
    /// Whole blocks, as the prefill worker's backend read them out.
    pub data: Vec<u8>,
}

/// What the port asks of the engine thread.
pub(super) enum KvCommand {
    Export {
        pin: u64,
        prompt: std::sync::Arc<[TokenId]>,
        blocks: (usize, usize),
        release: bool,
        reply: Sender<ExportReply>,
    },
    Release(u64),
    CachedBlocks {
        prompt: Vec<TokenId>,
        reply: Sender<usize>,
    },
}

/// The KV of the blocks asked for, in order, or why not.
pub type ExportReply = Result<Vec<u8>, KvHandoffError>;

/// Sends KV commands to a running engine (a clone of the handle's channel).
#[derive(Clone)]
pub struct KvPort {
    pub(super) commands: Sender<Command>,
}

impl KvPort {
    /// Reads the KV of pin `pin`'s blocks `[from, from + count)` for an importer whose prompt
    /// is `prompt` ([`EngineCore::export_kv`]; released afterwards with `release`); the
    /// receiver gets the bytes, or why not (closed: the engine stopped).
    pub fn export(
        &self,
        pin: u64,
        prompt: std::sync::Arc<[TokenId]>,
        blocks: (usize, usize),
        release: bool,
    ) -> Receiver<ExportReply> {
        let (reply, rx) = mpsc::channel();
        let cmd = KvCommand::Export { pin, prompt, blocks, release, reply };
        let _ = self.commands.send(Command::Kv(cmd));
        rx
    }

    /// Releases pin `pin` (a no-op when it is gone).
    pub fn release(&self, pin: u64) {
        let _ = self.commands.send(Command::Kv(KvCommand::Release(pin)));
    }

    /// How many of `prompt`'s full blocks the prefix cache holds now.
    pub fn cached_blocks(&self, prompt: Vec<TokenId>) -> Receiver<usize> {
        let (reply, rx) = mpsc::channel();
        let _ = self.commands.send(Command::Kv(KvCommand::CachedBlocks { prompt, reply }));
        rx
    }
}

/// Applies one KV command.
pub(super) fn handle(
    core: &mut EngineCore,
    cmd: KvCommand,
    publish: &mut dyn FnMut(&mut EngineCore),
) {
    match cmd {
        KvCommand::Export { pin, prompt, blocks, release, reply } => {
            settle(core, publish);
            let mut out = Vec::new();
            let result = core.export_kv(pin, &prompt, blocks, release, &mut out).map(|()| out);
            let _ = reply.send(result);
            if release {
                publish(core);
            }
        }
        KvCommand::Release(pin) => {
            if core.release_kv_pin(pin) {
                publish(core);
            }
        }
        KvCommand::CachedBlocks { prompt, reply } => {
            let _ = reply.send(core.kv_cached_prefix_blocks(&prompt));
        }
    }
}

/// Imports `import` for `prompt` before its request is admitted (a step in flight settled
/// first). KV the cache has no room for is dropped: the request computes it.
pub(super) fn import(
    core: &mut EngineCore,
    prompt: &[TokenId],
    import: &KvImport,
    publish: &mut dyn FnMut(&mut EngineCore),
) {
    settle(core, publish);
    match core.import_kv(prompt, import.first_block, &import.data) {
        Ok(n) => tracing::debug!("imported {n} KV blocks from block {}", import.first_block),
        Err(e) => tracing::warn!("fetched KV not imported: {e}"),
    }
}

/// Releases the pins past their time.
pub(super) fn expire(core: &mut EngineCore, publish: &mut dyn FnMut(&mut EngineCore)) {
    if core.next_kv_pin_deadline().is_some_and(|d| d <= Instant::now()) {
        let n = core.expire_kv_pins(Instant::now());
        tracing::debug!("{n} KV pins expired unfetched");
        publish(core);
    }
}
