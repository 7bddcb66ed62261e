//! Applying a step's results (`update`), and planning a step before the results of the one in
//! flight are known (`schedule_ahead`, `confirm`): asynchronous scheduling with placeholders.
//!
//! **Planning ahead.** While step N computes, `schedule_ahead(N)` plans step N+1. It first takes
//! step N's scheduled tokens as computed, and every request whose step-N row samples gets a
//! *placeholder* output token ([`PLACEHOLDER_TOKEN`]) standing for the token N will sample; then
//! it runs `schedule()`. A decoding request is thus scheduled for N+1 with the placeholder as
//! its input, which the runner replaces by the sampled token before N+1's forward starts. Once
//! N's tokens are known, `confirm(N)` puts them in place of the placeholders with the stop
//! checks of `update`; a request that stops there had its N+1 row computed for nothing (its
//! output is dropped, it is gone from the scheduler by then).
//!
//! Rules that keep this safe:
//! - A placeholder is never registered in the prefix cache: it is given to the KV manager as a
//!   lookahead slot, so the block holding it is registered by a later allocation, once its
//!   token is known.
//! - Planning ahead never preempts (step N's forward may still write a victim's blocks, and its
//!   sampled token would be lost): a running request that does not get its blocks is left out
//!   of the step with every request after it in the policy order, admission is skipped, and
//!   [`Scheduler::ahead_starved`] tells the engine to plan the next step the ordinary way,
//!   after N's update, where preemption works.
//! - A request whose placeholder is its last allowed token (`max_tokens`, `max_model_len`) is
//!   not scheduled again: it certainly finishes at `confirm`.
//! - Placeholders live only between `schedule_ahead` and `confirm` (or `unwind_ahead`); between
//!   engine steps no request holds one ([`Scheduler::check_invariants`]).
//!
//! Tokens per request are the synchronous engine's: a request's token at N+1 is computed from
//! the same inputs (its own tokens and KV), only the steps' compositions differ.

use std::mem;

use kiln_core::{RequestId, TokenId};

use super::Scheduler;
use crate::output::{ModelRunnerOutput, RequestOutput, SchedulerOutput};
use crate::request::RequestStatus;

/// The id a placeholder output token carries until its step's sample replaces it (never a
/// vocabulary id).
pub const PLACEHOLDER_TOKEN: TokenId = TokenId(u32::MAX);

/// The state of a step planned ahead.
#[derive(Debug, Default)]
pub(crate) struct Ahead {
    /// Inside `schedule_ahead` (no preemption, placeholders as lookahead).
    pub(crate) active: bool,
    /// The last `schedule()` planned ahead and left a running request without blocks.
    pub(crate) starved: bool,
    /// Step N's scheduled tokens taken as computed by `schedule_ahead`, per request (undone by
    /// `unwind_ahead`).
    moved: Vec<(RequestId, usize)>,
}

impl Scheduler {
    /// Confirms the step's tokens as computed, verifies speculation (accepted drafts stay
    /// computed, rejected ones are rolled back), appends the generated tokens one by one with
    /// the stop conditions after each (stop ids and EOS unless `ignore_eos`, both only past
    /// `min_tokens`; `max_tokens`, `max_model_len`; a stop drops the tokens after it) and frees
    /// finished requests. Returns one entry per appended token, in `model_output` order.
    pub fn update(
        &mut self,
        output: &SchedulerOutput,
        model_output: &ModelRunnerOutput,
    ) -> Vec<RequestOutput> {
        for (id, _) in output.scheduled() {
            if let Some(req) = self.requests.get_mut(&id) {
                req.num_computed_tokens += mem::take(&mut req.num_in_flight_tokens);
            }
        }
        let finished_from = self.finished_since_last.len();
        let mut outputs = Vec::with_capacity(model_output.num_sampled_tokens());
        for (id, token_ids) in model_output.iter() {
            let Some(req) = self.requests.get_mut(&id) else { continue }; // aborted meanwhile
            let num_spec = mem::take(&mut req.num_in_flight_spec_tokens);
            if req.status != RequestStatus::Running || req.num_uncomputed_tokens() > 0 {
                continue; // a partial prefill chunk samples nothing
            }
            let Some(num_accepted) = token_ids.len().checked_sub(1) else { continue };
            debug_assert!(num_accepted <= num_spec, "{id}: {num_accepted} of {num_spec} accepted");
            let num_accepted = num_accepted.min(num_spec);
            // The accepted drafts' KV is valid: they become computed tokens; the slots of the
            // `num_spec - num_accepted` rejected ones are not counted (rolled back).
            req.num_computed_tokens += num_accepted;
            for &token in &token_ids[..=num_accepted] {
                if self.append(id, token, &mut outputs) {
                    break;
                }
            }
        }
        if output.num_scheduled_spec_tokens > 0 {
            // Requests the runner did not report: their drafts count as rejected.
            for (id, _) in output.scheduled() {
                if let Some(req) = self.requests.get_mut(&id) {
                    req.num_in_flight_spec_tokens = 0;
                }
            }
        }
        self.remove_finished(finished_from);
        outputs
    }

    /// Plans the step after `in_flight`, whose forward is running and whose tokens are not
    /// known yet (module docs). Call [`Scheduler::confirm`] with `in_flight`'s tokens next (or
    /// [`Scheduler::unwind_ahead`] if it failed), before anything else changes the scheduler.
    pub fn schedule_ahead(&mut self, in_flight: &SchedulerOutput) -> SchedulerOutput {
        debug_assert!(self.ahead.moved.is_empty(), "a step planned ahead was not confirmed");
        self.ahead.moved.clear();
        for (id, _) in in_flight.scheduled() {
            let Some(req) = self.requests.get_mut(&id) else { continue };
            let moved = mem::take(&mut req.num_in_flight_tokens);
            req.num_computed_tokens += moved;
            self.ahead.moved.push((id, moved));
            if req.status == RequestStatus::Running && req.num_uncomputed_tokens() == 0 {
                req.push_placeholder();
            }
        }
        self.ahead.active = true;
        let out = self.schedule();
        self.ahead.active = false;
        out
    }

    /// Whether the last step planned ahead left a running request without blocks: plan the
    /// next one after the update of the step in flight (where preemption can free blocks).
    pub fn ahead_starved(&self) -> bool {
        self.ahead.starved
    }

    /// The update of a step `in_flight` that the next one was planned ahead of: its sampled
    /// tokens replace the placeholders, with `update`'s stop checks; its scheduled tokens were
    /// taken as computed when the next step was planned. Returns one entry per token.
    pub fn confirm(
        &mut self,
        in_flight: &SchedulerOutput,
        model_output: &ModelRunnerOutput,
    ) -> Vec<RequestOutput> {
        debug_assert_eq!(in_flight.num_scheduled_spec_tokens, 0, "drafts planned ahead of");
        self.ahead.moved.clear();
        let finished_from = self.finished_since_last.len();
        let mut outputs = Vec::with_capacity(model_output.num_sampled_tokens());
        for (id, token_ids) in model_output.iter() {
            let Some(req) = self.requests.get_mut(&id) else { continue }; // aborted meanwhile
            if !req.take_placeholder() {
                continue; // a partial prefill chunk samples nothing
            }
            debug_assert_eq!(token_ids.len(), 1, "{id}: one token per placeholder");
            if let Some(&token) = token_ids.first() {
                self.append(id, token, &mut outputs);
            }
        }
        // A placeholder whose row went unreported (never, as the engine plans ahead) goes too:
        // none outlives its step's update.
        for (id, _) in in_flight.scheduled() {
            if let Some(req) = self.requests.get_mut(&id) {
                req.take_placeholder();
            }
        }
        self.remove_finished(finished_from);
        outputs
    }

    /// Undoes [`Scheduler::schedule_ahead`]'s taking of `in_flight`'s tokens as computed and
    /// its placeholders, and marks both steps as not run ([`Scheduler::fail_step`]): the forward
    /// of `in_flight` failed, so aborting a request frees exactly the KV really written. Abort
    /// the requests of both steps next: the runner was sent the plan that is undone.
    pub fn unwind_ahead(&mut self, in_flight: &SchedulerOutput, ahead: &SchedulerOutput) {
        for (id, moved) in mem::take(&mut self.ahead.moved) {
            if let Some(req) = self.requests.get_mut(&id) {
                req.take_placeholder();
                req.num_sent_tokens = req.num_sent_tokens.min(req.num_tokens());
                if req.status == RequestStatus::Running {
                    req.num_computed_tokens -= moved.min(req.num_computed_tokens);
                }
            }
        }
        self.fail_step(ahead);
        self.fail_step(in_flight);
    }

    /// Appends `token` to running request `id` with the stop checks; a finished request is
    /// freed (removed from `running` by `remove_finished`). Returns whether it finished.
    fn append(&mut self, id: RequestId, token: TokenId, out: &mut Vec<RequestOutput>) -> bool {
        let Some(req) = self.requests.get_mut(&id) else { return false };
        let finish_reason = req.append_output(token, self.config.max_model_len);
        out.push(RequestOutput { id, new_token: token, finish_reason });
        let Some(reason) = finish_reason else { return false };
        req.status = RequestStatus::Finished(reason);
        self.kv.free(id);
        self.finished_since_last.push(id);
        true
    }

    /// Drops the requests that finished in this update (`finished_since_last` past `from`) from
    /// `running` and the request map.
    fn remove_finished(&mut self, from: usize) {
        if self.finished_since_last.len() == from {
            return;
        }
        let requests = &mut self.requests;
        self.running.retain(|id| {
            let done = requests[id].is_finished();
            if done {
                requests.remove(id);
            }
            !done
        });
    }
}
