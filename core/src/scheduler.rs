//! The scheduler: which prompt tokens and which encoder inputs run in each step.
//!
//! It reproduces vLLM v1's scheduler on the multimodal path. Per step, with a token budget of
//! `max_num_batched_tokens` and the encoder compute budget, running requests are placed first (in
//! admission order), then waiting ones (first come, first served, up to `max_num_seqs` running).
//! A request is offered `min(remaining prompt, token budget)` tokens and its items are walked in
//! position order:
//!
//! 1. stop at the first item that starts beyond this step's token window;
//! 2. skip items whose positions are all consumed;
//! 3. skip an item whose hash this request already picked this step (it shares that output);
//! 4. skip an item whose hash is cached, taking a reference to it;
//! 5. with chunked multimodal input disabled, if the window would cover the item only in part, cut
//!    the tokens back to just before the item and stop (an item is never split across steps);
//! 6. if the encoder cache cannot allocate it, cut the tokens back to the item's start and stop;
//! 7. otherwise spend its embedding tokens from the compute budget and schedule it.
//!
//! Encoder-cache allocation happens after the request is placed. Every scheduled token counts as
//! consumed when [`SchedulerPolicy::update_from_output`] sees the step's output; an input is
//! released once all its positions are consumed; a request is finished once its whole prompt is
//! (iris ends where the language model's input embeddings begin), and finished or aborted requests
//! release everything.
//!
//! # Progress (no livelock)
//!
//! vLLM can stall for good when encoder-cache space is held by a request that cannot move (a
//! waiting request that took cache references in a walk and was then not placed, or a request
//! whose tokens were trimmed to zero while it held an input), or when space that frees up is
//! taken, step after step, by requests behind the one that needs it. Two maximum-size items and a
//! cache that fits one is the smallest such case. iris keeps three rules:
//!
//! - **Only placed requests hold references.** References a walk takes (step 4) are rolled back
//!   when the request ends up with no tokens. So every held reference belongs to a request whose
//!   next window starts inside or before that input, and such a request always gets tokens when it
//!   gets budget: the cut-back of steps 5 and 6 lands at a later item's start, past its position.
//!   Held space therefore drains.
//! - **A request refused for space has first claim on the space that frees.** When step 6 refuses
//!   an item for lack of cache space (not compute), the item's size is reserved for the rest of the
//!   step: later requests may still hit cached entries and schedule text, but they allocate only
//!   what leaves the reserved slots available. Running requests are walked before waiting ones and
//!   keep their admission order, so the refused request is first in line at the next step.
//! - **Every item can be scheduled on its own.** [`BudgetPolicy::check_item`] refuses, when the
//!   request is added, an item larger than the cache or the compute budget, or (chunked
//!   multimodal input disabled) larger than `max_num_batched_tokens`.
//!
//! Together: whenever requests are unfinished, every step schedules at least one token, and every
//! request completes. The tests pin the two-maximum-items case in every configuration, and the
//! property tests check progress after every step.
//!
//! [`Scheduler`] is the default [`SchedulerPolicy`]; it is generic over the encoder cache manager
//! ([`EncoderCacheManagement`]) and the budget ([`BudgetPolicy`]).
//!
//! ```
//! use iris_core::budget::{EncoderBudget, Modality, ModalityLimits, SchedulerConfig};
//! use iris_core::scheduler::{MmItem, NewRequest, Scheduler, SchedulerPolicy};
//!
//! let config = SchedulerConfig { max_num_batched_tokens: 1000, ..SchedulerConfig::default() };
//! let mut s = Scheduler::with_item_limit(config, 600).unwrap();
//! let id = s
//!     .add_request(NewRequest::new(800, vec![MmItem::new("img", 100, 600)]))
//!     .unwrap();
//! let out = s.schedule().unwrap();
//! assert_eq!(out.scheduled, vec![(id, 800)]);
//! assert_eq!(out.encoder_inputs[0].index, 0);
//! assert_eq!(s.update_from_output(&out), vec![id]); // prompt fully consumed: finished
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use thiserror::Error;

use crate::budget::{
    BudgetError, BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig,
};
use crate::cache::encoder::{
    EncoderCacheError, EncoderCacheManagement, EncoderCacheManager, EncoderCacheReset,
};
pub use crate::cache::encoder::{MmHash, RequestId};

/// One multimodal item of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmItem {
    /// The item's content hash.
    pub hash: MmHash,
    /// Its kind.
    pub modality: Modality,
    /// First placeholder position in the prompt.
    pub offset: u64,
    /// Placeholder positions.
    pub length: u64,
    /// Positions that are embeddings (its encoder-cache size); `length` when all are.
    pub embeds: u64,
}

impl MmItem {
    /// An image item whose placeholder positions are all embeddings.
    pub fn new(hash: impl Into<MmHash>, offset: u64, length: u64) -> Self {
        MmItem {
            hash: hash.into(),
            modality: Modality::Image,
            offset,
            length,
            embeds: length,
        }
    }

    /// An image item where only `embeds` of its `length` positions are embeddings (the rest are
    /// separators or timestamps in the placeholder).
    pub fn with_embeds(hash: impl Into<MmHash>, offset: u64, length: u64, embeds: u64) -> Self {
        MmItem {
            embeds,
            ..MmItem::new(hash, offset, length)
        }
    }

    /// An image item sized by its embedding mask: one entry per placeholder position.
    pub fn with_mask(hash: impl Into<MmHash>, offset: u64, is_embed: &[bool]) -> Self {
        let length = u64::try_from(is_embed.len()).unwrap_or(u64::MAX);
        let embeds = u64::try_from(is_embed.iter().filter(|e| **e).count()).unwrap_or(u64::MAX);
        MmItem::with_embeds(hash, offset, length, embeds)
    }

    /// One past the last placeholder position.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.length)
    }
}

/// A request to schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// Prompt tokens, placeholders included.
    pub prompt_len: u64,
    /// Items in position order, not overlapping, inside the prompt.
    pub items: Vec<MmItem>,
}

impl NewRequest {
    /// A request of `prompt_len` tokens with these items.
    pub fn new(prompt_len: u64, items: Vec<MmItem>) -> Self {
        NewRequest { prompt_len, items }
    }
}

/// An encoder input to run this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderInput {
    /// The request.
    pub request: RequestId,
    /// The item index in the request.
    pub index: usize,
    /// The item hash (the device cache key for its output).
    pub hash: MmHash,
    /// Embedding tokens the encoder produces.
    pub embeds: u64,
}

/// What one step schedules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// The step number, from 0.
    pub step: u64,
    /// Tokens scheduled per request, in placement order.
    pub scheduled: Vec<(RequestId, u64)>,
    /// Encoder inputs to run, in placement order.
    pub encoder_inputs: Vec<EncoderInput>,
    /// Hashes the device cache must free before storing this step's outputs.
    pub freed: Vec<MmHash>,
    /// Encoder-cache free slots after scheduling.
    pub free_slots: u64,
    /// Encoder-cache freeable slots after scheduling.
    pub freeable_slots: u64,
}

impl StepOutput {
    /// Tokens scheduled in all.
    pub fn total_tokens(&self) -> u64 {
        self.scheduled.iter().map(|(_, t)| t).sum()
    }
}

/// Scheduler errors.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchedulerError {
    /// The request can never be scheduled under the budget.
    #[error("item {index} of the request: {source}")]
    Budget {
        /// The item index.
        index: usize,
        /// What the budget refused.
        #[source]
        source: BudgetError,
    },
    /// A request field is inconsistent.
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// The encoder cache manager refused an allocation the walk had checked.
    #[error(transparent)]
    Cache(#[from] EncoderCacheError),
}

/// A scheduling policy. [`Scheduler`] is the default; an engine drives any policy through this
/// trait: add requests, then per step `schedule`, run the outputs, `update_from_output`.
pub trait SchedulerPolicy {
    /// Queues a request; refuses one that could never be scheduled.
    fn add_request(&mut self, request: NewRequest) -> Result<RequestId, SchedulerError>;
    /// Plans one step.
    fn schedule(&mut self) -> Result<StepOutput, SchedulerError>;
    /// Marks the step's tokens consumed, releases consumed inputs and returns the requests that
    /// finished (their prompts fully consumed), in placement order.
    fn update_from_output(&mut self, output: &StepOutput) -> Vec<RequestId>;
    /// Aborts a request, releasing everything it holds; false if unknown.
    fn abort(&mut self, request: RequestId) -> bool;
    /// Empties the encoder cache manager. In-flight requests keep going and re-encode what they
    /// still need; the device cache must be reset with it. Call it between steps (after
    /// `update_from_output`), so that no encoder output of a planned step lands in the device
    /// cache after the reset.
    fn reset_encoder_cache(&mut self) -> EncoderCacheReset;
    /// Requests waiting to be admitted.
    fn num_waiting(&self) -> usize;
    /// Requests admitted and not finished.
    fn num_running(&self) -> usize;
    /// Whether any request is unfinished.
    fn has_unfinished(&self) -> bool {
        self.num_waiting() + self.num_running() > 0
    }
}

/// The default scheduler (vLLM v1 semantics, with the progress rules above).
#[derive(Debug)]
pub struct Scheduler<M = EncoderCacheManager, B = EncoderBudget> {
    config: SchedulerConfig,
    budget: B,
    manager: M,
    requests: HashMap<RequestId, RequestState>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_id: u64,
    step: u64,
    walk: Walk,
}

#[derive(Debug)]
struct RequestState {
    prompt_len: u64,
    computed: u64,
    items: Arc<[MmItem]>,
    /// Items before this index are fully consumed and released.
    next_unconsumed: usize,
}

/// Scratch space for one request's walk, reused across requests and steps.
#[derive(Debug, Default)]
struct Walk {
    to_schedule: Vec<usize>,
    shared: Vec<usize>,
    took_refs: Vec<usize>,
    picked: Vec<MmHash>,
}

/// The result of one request's walk.
struct Placement {
    tokens: u64,
    compute_budget: u64,
    /// Cache slots this request needed and was refused for lack of space.
    refused_space: u64,
}

impl Scheduler<EncoderCacheManager, EncoderBudget> {
    /// A scheduler whose budget takes `max_tokens_per_item` as the largest image item and whose
    /// cache manager is sized by that budget.
    pub fn with_item_limit(
        config: SchedulerConfig,
        max_tokens_per_item: u64,
    ) -> Result<Self, BudgetError> {
        let budget = EncoderBudget::new(
            &config,
            &[(Modality::Image, ModalityLimits::new(max_tokens_per_item))],
        )?;
        let manager = EncoderCacheManager::new(budget.cache_size());
        Ok(Scheduler::new(config, budget, manager))
    }
}

impl<M: EncoderCacheManagement, B: BudgetPolicy> Scheduler<M, B> {
    /// A scheduler with this configuration, budget and cache manager.
    pub fn new(config: SchedulerConfig, budget: B, manager: M) -> Self {
        Scheduler {
            config,
            budget,
            manager,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            step: 0,
            walk: Walk::default(),
        }
    }

    /// The encoder cache manager.
    pub fn manager(&self) -> &M {
        &self.manager
    }

    /// Takes the scheduler apart: its budget and its cache manager (unfinished requests are
    /// dropped without releasing their references).
    pub fn into_parts(self) -> (B, M) {
        (self.budget, self.manager)
    }

    /// The budget.
    pub fn budget(&self) -> &B {
        &self.budget
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The next step's number.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Prompt tokens consumed by `request`, if it is unfinished.
    pub fn num_computed_tokens(&self, request: RequestId) -> Option<u64> {
        self.requests.get(&request).map(|r| r.computed)
    }

    /// Places one request: walks its items, then allocates or rolls back.
    fn place(
        &mut self,
        id: RequestId,
        token_budget: u64,
        compute_budget: u64,
        reserved: u64,
    ) -> Result<Placement, SchedulerError> {
        let Some(state) = self.requests.get(&id) else {
            return Ok(Placement {
                tokens: 0,
                compute_budget,
                refused_space: 0,
            });
        };
        let computed = state.computed;
        let items = Arc::clone(&state.items);
        let first = state.next_unconsumed;
        let mut tokens = (state.prompt_len - computed).min(token_budget);
        let mut compute = compute_budget;
        let mut already = 0u64;
        let mut refused_space = 0u64;
        let walk = &mut self.walk;
        walk.to_schedule.clear();
        walk.shared.clear();
        walk.took_refs.clear();
        walk.picked.clear();

        for (i, item) in items.iter().enumerate().skip(first) {
            // Step 1: beyond this step's window.
            if item.offset >= computed + tokens {
                break;
            }
            // Step 2: all positions consumed.
            if item.end() <= computed {
                continue;
            }
            // Step 3: this request already picked the hash this step.
            if walk.picked.contains(&item.hash) {
                walk.shared.push(i);
                continue;
            }
            // Step 4: cached; a reference taken here is rolled back if the request is not placed.
            let held = self.manager.holds(id, i);
            if self.manager.check_and_update_cache(id, i, &item.hash) {
                if !held {
                    walk.took_refs.push(i);
                }
                continue;
            }
            // Step 5: never split an item when chunked multimodal input is disabled.
            if self.config.disable_chunked_mm_input && computed + tokens < item.end() {
                tokens = item.offset.saturating_sub(computed);
                break;
            }
            // Step 6: no room (compute or space); the reserved slots of a request refused earlier
            // this step count as already scheduled.
            if !self
                .manager
                .can_allocate(item.embeds, compute, already.saturating_add(reserved))
            {
                if item.embeds <= compute {
                    refused_space = item.embeds + already;
                }
                tokens = item.offset.saturating_sub(computed);
                break;
            }
            // Step 7.
            compute -= item.embeds;
            already += item.embeds;
            walk.to_schedule.push(i);
            walk.picked.push(item.hash.clone());
        }

        if tokens == 0 {
            for &i in &walk.took_refs {
                self.manager.free_encoder_input(id, i);
            }
            return Ok(Placement {
                tokens: 0,
                compute_budget,
                refused_space,
            });
        }
        for &i in &walk.to_schedule {
            let item = &items[i];
            self.manager.allocate(id, i, &item.hash, item.embeds)?;
        }
        for &i in &walk.shared {
            let item = &items[i];
            // Allocated just above by this request's earlier occurrence: a hit.
            self.manager.check_and_update_cache(id, i, &item.hash);
        }
        Ok(Placement {
            tokens,
            compute_budget: compute,
            refused_space,
        })
    }

    fn record(&self, out: &mut StepOutput, id: RequestId, tokens: u64) {
        out.scheduled.push((id, tokens));
        if let Some(state) = self.requests.get(&id) {
            for &i in &self.walk.to_schedule {
                let item = &state.items[i];
                out.encoder_inputs.push(EncoderInput {
                    request: id,
                    index: i,
                    hash: item.hash.clone(),
                    embeds: item.embeds,
                });
            }
        }
    }

    fn release_consumed(&mut self, id: RequestId) {
        let Some(state) = self.requests.get_mut(&id) else {
            return;
        };
        while let Some(item) = state.items.get(state.next_unconsumed) {
            if item.end() > state.computed {
                break;
            }
            self.manager.free_encoder_input(id, state.next_unconsumed);
            state.next_unconsumed += 1;
        }
    }
}

impl<M: EncoderCacheManagement, B: BudgetPolicy> SchedulerPolicy for Scheduler<M, B> {
    fn add_request(&mut self, request: NewRequest) -> Result<RequestId, SchedulerError> {
        if request.prompt_len == 0 {
            return Err(SchedulerError::InvalidRequest {
                reason: "prompt_len must be at least 1".to_owned(),
            });
        }
        let mut previous_end = 0;
        for (index, item) in request.items.iter().enumerate() {
            if item.length == 0 {
                return Err(SchedulerError::InvalidRequest {
                    reason: format!("item {index}: length must be at least 1"),
                });
            }
            if item.embeds > item.length {
                return Err(SchedulerError::InvalidRequest {
                    reason: format!(
                        "item {index}: embeds {} exceeds its length {}",
                        item.embeds, item.length
                    ),
                });
            }
            if item.offset < previous_end {
                return Err(SchedulerError::InvalidRequest {
                    reason: format!(
                        "item {index}: offset {} overlaps or precedes the previous item, which ends at {previous_end}",
                        item.offset
                    ),
                });
            }
            if item.end() > request.prompt_len {
                return Err(SchedulerError::InvalidRequest {
                    reason: format!(
                        "item {index}: positions {}..{} extend past prompt_len {}",
                        item.offset,
                        item.end(),
                        request.prompt_len
                    ),
                });
            }
            self.budget
                .check_item(item.modality, item.length, item.embeds)
                .map_err(|source| SchedulerError::Budget { index, source })?;
            previous_end = item.end();
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.requests.insert(
            id,
            RequestState {
                prompt_len: request.prompt_len,
                computed: 0,
                items: request.items.into(),
                next_unconsumed: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    fn schedule(&mut self) -> Result<StepOutput, SchedulerError> {
        let mut out = StepOutput {
            step: self.step,
            ..StepOutput::default()
        };
        self.step += 1;
        let mut token_budget = self.config.max_num_batched_tokens;
        let mut compute_budget = self.budget.compute_budget();
        let mut reserved = 0u64;

        // Running requests first, in admission order.
        let mut index = 0;
        while index < self.running.len() && token_budget > 0 {
            let id = self.running[index];
            index += 1;
            let placed = self.place(id, token_budget, compute_budget, reserved)?;
            reserved = reserved.max(placed.refused_space);
            if placed.tokens == 0 {
                continue;
            }
            compute_budget = placed.compute_budget;
            token_budget -= placed.tokens;
            self.record(&mut out, id, placed.tokens);
        }

        // Then waiting ones, first come first served: one that cannot move blocks those behind.
        let max_running = usize::try_from(self.config.max_num_seqs).unwrap_or(usize::MAX);
        while token_budget > 0 && self.running.len() < max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if !self.config.enable_chunked_prefill {
                let remaining = self
                    .requests
                    .get(&id)
                    .map_or(0, |r| r.prompt_len - r.computed);
                if remaining > token_budget {
                    break;
                }
            }
            let placed = self.place(id, token_budget, compute_budget, reserved)?;
            if placed.tokens == 0 {
                break;
            }
            compute_budget = placed.compute_budget;
            token_budget -= placed.tokens;
            self.waiting.pop_front();
            self.running.push(id);
            self.record(&mut out, id, placed.tokens);
        }

        out.freed = self.manager.get_freed_mm_hashes();
        out.free_slots = self.manager.num_free_slots();
        out.freeable_slots = self.manager.num_freeable_slots();
        Ok(out)
    }

    fn update_from_output(&mut self, output: &StepOutput) -> Vec<RequestId> {
        let mut finished = Vec::new();
        for &(id, tokens) in &output.scheduled {
            let Some(state) = self.requests.get_mut(&id) else {
                continue; // aborted since the step was planned
            };
            state.computed = (state.computed + tokens).min(state.prompt_len);
            let done = state.computed == state.prompt_len;
            self.release_consumed(id);
            if done {
                self.manager.free(id);
                self.requests.remove(&id);
                finished.push(id);
            }
        }
        if !finished.is_empty() {
            self.running.retain(|id| self.requests.contains_key(id));
        }
        finished
    }

    fn abort(&mut self, request: RequestId) -> bool {
        if self.requests.remove(&request).is_none() {
            return false;
        }
        self.manager.free(request);
        self.running.retain(|id| *id != request);
        self.waiting.retain(|id| *id != request);
        true
    }

    fn reset_encoder_cache(&mut self) -> EncoderCacheReset {
        self.manager.reset()
    }

    fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    fn num_running(&self) -> usize {
        self.running.len()
    }
}

#[cfg(test)]
mod tests;
