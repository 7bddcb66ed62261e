//! Admission: a request enters the engine here, prepared (its token ids checked against the
//! vocabulary, its structured output compiled: [`PreparedRequest`], done once, by the caller or
//! here), its SLO class turned into a deadline (admission
//! control refuses or demotes one the queue already makes unmeetable), then it is queued in the
//! scheduler and gets its entry in the request table. A refused request changes nothing.

use std::time::Instant;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_sched::{AddError, Deadline, QueueAhead, Request, SchedulingPolicy};

use super::{EngineCore, EngineError};
use crate::PoolingParams;
use crate::hooks::SloControl;
use crate::hooks::slo::Arrival;
use crate::pooling::PoolState;
use crate::prepared::{PrepareError, PreparedRequest};
use crate::requests::LiveRequest;
use crate::slo::{AdmissionDecision, Admitted, Prediction, decide};

impl EngineCore {
    /// Queues a request; lower `priority` is more urgent (used by the priority policy).
    pub fn add_request(
        &mut self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<RequestId, EngineError> {
        let id = RequestId(self.next_id);
        self.add_request_with_id(id, prompt, params, priority)?;
        Ok(id)
    }

    /// [`EngineCore::add_request`] with an id chosen by the caller (unique among unfinished
    /// requests; ids from [`EngineCore::add_request`] count up from 0). Prepares the request
    /// here (see [`PreparedRequest::compile`]); a server prepares off the engine thread and
    /// calls [`EngineCore::add_prepared`].
    pub fn add_request_with_id(
        &mut self,
        id: RequestId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<(), EngineError> {
        let vocab_size = self.runner.vocab_size();
        let request = PreparedRequest::compile(prompt, params, vocab_size, self.grammar.as_ref())?;
        self.add_prepared(id, request, priority)
    }

    /// Queues a request the caller prepared (ids checked, structured output compiled) under
    /// `id`: the engine trusts both and checks only that it was prepared for this vocabulary.
    pub fn add_prepared(
        &mut self,
        id: RequestId,
        request: PreparedRequest,
        priority: i64,
    ) -> Result<(), EngineError> {
        if self.requests.contains(id) {
            return Err(AddError::DuplicateId(id).into());
        }
        let model = self.runner.vocab_size();
        if request.vocab_size() != model {
            let prepared = request.vocab_size();
            return Err(PrepareError::VocabMismatch { prepared, model }.into());
        }
        let slot = request.adapter();
        let cache_key = self.admit_adapter(slot).map_err(AddError::InvalidSampling)?;
        if request.adapter_key().is_some_and(|k| k != cache_key) {
            let why = format!("the LoRA adapter in slot {slot} was unloaded");
            return Err(AddError::InvalidSampling(why).into());
        }
        let pool = self.admit_pooling(request.pooling(), request.params())?;
        let kv_export = request.kv_export();
        if kv_export {
            let why = if !self.kv_pins.enabled() {
                Some("KV export is off on this server (--kv-role prefill or both turns it on)")
            } else if slot != 0 {
                Some("KV export is not supported with a LoRA adapter")
            } else if pool.is_some() {
                Some("a pooling request has no KV to export")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(AddError::InvalidSampling(why.into()).into());
            }
        }
        let (prompt, params, constraint, adapter) = request.into_parts();
        let num_prompt_tokens = prompt.len();
        let kv_export = kv_export.then(|| prompt.clone());
        let ttft_ms = self.config.slo.classes.get(&priority).map(|c| c.ttft_ms);
        let tpot_ms = self.config.slo.tpot_ms_for(priority);
        let admitted = self.admit_deadline(priority, num_prompt_tokens);
        if let Err(AddError::DeadlineUnmeetable { .. }) = &admitted {
            self.stats.num_slo_rejected += 1;
        }
        let admitted = admitted?;
        let predicted = admitted.and_then(|a| a.predicted);
        let mut request = Request::new(id, prompt, params)
            .with_priority(priority)
            .with_adapter(adapter, cache_key)
            .with_eos_token_ids(self.config.eos_token_ids.clone());
        request = match admitted {
            Some(Admitted { deadline, demoted: false, .. }) => request.with_deadline(deadline),
            Some(Admitted { deadline, demoted: true, .. }) => {
                request.with_demoted_deadline(deadline)
            }
            None => request,
        };
        let demoted = request.is_demoted();
        self.scheduler.add(request)?;
        self.num_admission_demoted += u64::from(demoted);
        let mut live =
            LiveRequest { constraint, adapter, pool, kv_export, ..LiveRequest::default() };
        let now = Instant::now();
        if self.hooks.get::<SloControl>().is_some() {
            live.arrival = Some(Arrival { at: now, ttft_ms, tpot_ms, predicted });
        }
        self.hooks.on_arrival(num_prompt_tokens, now.duration_since(self.epoch).as_secs_f64());
        self.requests.insert(id, live);
        self.next_id = self.next_id.max(id.0 + 1);
        self.refresh_stats();
        Ok(())
    }

    /// A request's pooling state: a pooling engine takes pooling requests only (of one
    /// output token), a generative one none.
    fn admit_pooling(
        &self,
        pooling: Option<PoolingParams>,
        params: &SamplingParams,
    ) -> Result<Option<PoolState>, AddError> {
        match (self.config.pooling, pooling) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(AddError::InvalidSampling(
                "the model is not a pooling model: it serves generation, not embeddings".into(),
            )),
            (Some(_), None) => Err(AddError::InvalidSampling(
                "the model is a pooling model: it serves embeddings, not generation".into(),
            )),
            (Some(config), Some(pooling)) => {
                if params.max_tokens != 1 {
                    let why = "a pooling request asks for exactly one output token";
                    return Err(AddError::InvalidSampling(why.into()));
                }
                let hidden = self.runner.hidden_size();
                let classifier = self.config.classifier.clone();
                if classifier.is_some() && pooling != PoolingParams::default() {
                    let why = "a classifier's scores take no `dimensions` or `normalize`";
                    return Err(AddError::InvalidSampling(why.into()));
                }
                pooling.check(hidden).map_err(AddError::InvalidSampling)?;
                Ok(Some(PoolState::new(config, pooling, hidden, classifier)))
            }
        }
    }

    /// Milliseconds on the engine's clock.
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The request's deadline from its SLO class, after admission control: `Err` when it must
    /// be refused, `Ok(None)` when it has no deadline.
    fn admit_deadline(
        &self,
        priority: i64,
        num_prompt_tokens: usize,
    ) -> Result<Option<Admitted>, AddError> {
        let slo = &self.config.slo;
        let now = self.now_ms();
        let is_deadline_policy = self.config.scheduler.policy == SchedulingPolicy::Deadline;
        let shift = self.config.scheduler.slo_demotion_ms;
        let Some(class) = slo.class_for(priority) else {
            // Under the deadline policy every request is due some time, so none starves.
            let best_effort = Deadline { first_token_ms: now.saturating_add(shift), tpot_ms: None };
            let admitted = Admitted { deadline: best_effort, demoted: false, predicted: None };
            return Ok(is_deadline_policy.then_some(admitted));
        };
        let deadline =
            Deadline { first_token_ms: now.saturating_add(class.ttft_ms), tpot_ms: class.tpot_ms };
        let prediction = self.predict_first_token(deadline, num_prompt_tokens);
        match decide(slo.admission, class.ttft_ms, prediction.alone_ms, prediction.queued_ms) {
            AdmissionDecision::Admit => {
                Ok(Some(Admitted { deadline, demoted: false, predicted: prediction.uncalibrated }))
            }
            AdmissionDecision::Reject { predicted_ms } => {
                Err(AddError::DeadlineUnmeetable { predicted_ms, ttft_slo_ms: class.ttft_ms })
            }
            AdmissionDecision::Demote => {
                let first_token_ms = deadline.first_token_ms.saturating_add(shift);
                let deadline = Deadline { first_token_ms, ..deadline };
                Ok(Some(Admitted { deadline, demoted: true, predicted: None }))
            }
        }
    }

    /// The first-token time of a request due at `deadline` with `num_prompt_tokens` tokens:
    /// alone, and behind the work served ahead of it (all `None` until the batch controller's
    /// cost model is fitted).
    fn predict_first_token(&self, deadline: Deadline, num_prompt_tokens: usize) -> Prediction {
        let Some(SloControl { controller }) = self.hooks.get::<SloControl>() else {
            return Prediction::default();
        };
        let before = (self.config.scheduler.policy == SchedulingPolicy::Deadline)
            .then_some(deadline.first_token_ms);
        let running = self.scheduler.num_running();
        let free_seats = self.scheduler.limits().max_num_seqs.saturating_sub(running);
        let queue = QueueAhead {
            prompt_tokens: num_prompt_tokens,
            tokens_ahead: self.scheduler.pending_prefill_tokens(before),
            num_running: running,
            seats_needed: (self.scheduler.num_waiting_ahead(before) + 1).saturating_sub(free_seats),
        };
        let alone = QueueAhead { prompt_tokens: num_prompt_tokens, ..QueueAhead::default() };
        let now = self.epoch.elapsed().as_secs_f64();
        let ms = |seconds: Option<f64>| seconds.map(|s| (s * 1e3).ceil() as u64);
        Prediction {
            alone_ms: ms(controller.calibrated_first_token_seconds(&alone, now)),
            queued_ms: ms(controller.calibrated_first_token_seconds(&queue, now)),
            uncalibrated: controller.predict_first_token_seconds(&queue),
        }
    }
}
