//! The scheduler: which prompt tokens and which encoder inputs run in each step.
//!
//! Two policies ([`Policy`], chosen in [`SchedulerConfig::policy`]) share the step structure of
//! vLLM v1's `Scheduler.schedule()`: with a token budget of `max_num_batched_tokens` and the
//! encoder compute budget, running requests are placed first (in admission order), then waiting
//! ones (up to `max_num_seqs` running). A request is offered `min(remaining prompt, token
//! budget)` tokens and its items are walked in position order.
//!
//! # `vllm`: vLLM 0.33.0, step for step
//!
//! The default reproduces vLLM 0.33.0 (`_try_schedule_encoder_inputs`, the running and waiting
//! loops, preemption); the committed traces under `core/tests/fixtures/vllm-traces/` were written
//! by vLLM's own scheduler and are replayed step by step in CI. For each item whose placeholder
//! meets the window `[computed, computed + tokens)`:
//!
//! 1. with chunked multimodal input disabled, if the window starts at or before the item and
//!    would cover it only in part, cut the tokens back to the item's start and stop (this comes
//!    first, so an item that is cached or picked twice still stops the window);
//! 2. skip an item whose hash this request already picked this step (it shares that output);
//! 3. skip an item whose hash is cached, taking a reference to it;
//! 4. if the encoder cache cannot allocate it (compute budget or space), cut the tokens back to
//!    the item's start (to zero if the window starts inside it) and stop;
//! 5. skip an item none of whose embedding positions are in the window;
//! 6. otherwise spend its embeddings from the compute budget and schedule it.
//!
//! A running request left with no tokens is passed over; a waiting one is set aside for this
//! step and keeps its place at the head of the queue, so the requests behind it are tried.
//! References a walk took stay held in both cases (vLLM's behaviour, and the root of its
//! stalls). With `num_kv_blocks` set, KV blocks are allocated as vLLM's `KVCacheManager` does
//! without prefix caching: a running request that does not fit preempts the last running request
//! (possibly itself), which releases everything and returns to the head of the waiting queue
//! with its progress reset; a waiting request is admitted only if its whole prompt fits; no
//! waiting request is admitted in a step that preempted.
//!
//! Every scheduled token counts as consumed when [`SchedulerPolicy::update_from_output`] sees
//! the step's output; an input is released once all its positions are consumed; a request is
//! finished once its whole prompt is (iris ends where the language model's input embeddings
//! begin, as a vLLM request with `max_tokens = 1` does), and finished or aborted requests
//! release everything.
//!
//! # `progress`: no livelock
//!
//! vLLM can stall for good when encoder-cache space is held by a request that cannot move (a
//! waiting request that took cache references in a walk and was then not placed, or a request
//! whose tokens were trimmed to zero while it held an input), or when space that frees up is
//! taken, step after step, by requests behind the one that needs it. Two maximum-size items and a
//! cache that fits one is the smallest such case. The `progress` policy walks items with steps 2
//! and 3 before step 1 and without step 5, and keeps three rules:
//!
//! - **Only placed requests hold references.** References a walk takes (step 3) are rolled back
//!   when the request ends up with no tokens. So every held reference belongs to a request whose
//!   next window starts inside or before that input, and such a request always gets tokens when it
//!   gets budget: the cut-back of steps 1 and 4 lands at a later item's start, past its position.
//!   Held space therefore drains.
//! - **A request refused for space has first claim on the space that frees.** When step 4 refuses
//!   an item for lack of cache space (not compute), the item's size is reserved for the rest of the
//!   step: later requests may still hit cached entries and schedule text, but they allocate only
//!   what leaves the reserved slots available. Running requests are walked before waiting ones and
//!   keep their admission order, and a waiting request that cannot move blocks those behind it, so
//!   the refused request is first in line at the next step.
//! - **Every item can be scheduled on its own.** [`BudgetPolicy::check_item`] refuses, when the
//!   request is added, an item larger than the cache or the compute budget, or (chunked
//!   multimodal input disabled) larger than `max_num_batched_tokens`.
//!
//! Together: whenever requests are unfinished, every step schedules at least one token, and every
//! request completes. The tests pin the two-maximum-items case in every configuration, and the
//! property tests check progress after every step. Where the two policies part on the committed
//! traces is listed, with the reason, in `core/tests/scheduler_traces.rs`.
//!
//! [`Scheduler`] implements [`SchedulerPolicy`]; it is generic over the encoder cache manager
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

pub use crate::budget::Policy;
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
    /// Where the embeddings are, as `[start, end)` runs relative to `offset`, in order and not
    /// overlapping; `None` when every position is one.
    pub embed_runs: Option<Arc<[(u64, u64)]>>,
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
            embed_runs: None,
        }
    }

    /// An image item whose first `embeds` of its `length` positions are embeddings (the rest are
    /// separators or timestamps in the placeholder). `embeds > length` is refused when the
    /// request is added.
    pub fn with_embeds(hash: impl Into<MmHash>, offset: u64, length: u64, embeds: u64) -> Self {
        if embeds == length {
            return MmItem::new(hash, offset, length);
        }
        MmItem::with_runs(hash, offset, length, vec![(0, embeds)])
    }

    /// An image item sized by its embedding mask: one entry per placeholder position.
    pub fn with_mask(hash: impl Into<MmHash>, offset: u64, is_embed: &[bool]) -> Self {
        let length = u64::try_from(is_embed.len()).unwrap_or(u64::MAX);
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (p, _) in is_embed.iter().enumerate().filter(|(_, e)| **e) {
            let p = u64::try_from(p).unwrap_or(u64::MAX);
            match runs.last_mut() {
                Some((_, end)) if *end == p => *end = p + 1,
                _ => runs.push((p, p + 1)),
            }
        }
        MmItem::with_runs(hash, offset, length, runs)
    }

    /// An image item whose embeddings are the positions in `runs` (`[start, end)` relative to
    /// `offset`, in order, not overlapping, inside the item; checked when the request is added).
    pub fn with_runs(
        hash: impl Into<MmHash>,
        offset: u64,
        length: u64,
        runs: Vec<(u64, u64)>,
    ) -> Self {
        let embeds = runs.iter().map(|(s, e)| e.saturating_sub(*s)).sum();
        MmItem {
            embeds,
            embed_runs: Some(runs.into()),
            ..MmItem::new(hash, offset, length)
        }
    }

    /// One past the last placeholder position.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.length)
    }

    /// Embedding positions among the item's positions `[start, end)` (relative to `offset`).
    pub fn embeds_between(&self, start: u64, end: u64) -> u64 {
        match &self.embed_runs {
            None => end.saturating_sub(start),
            Some(runs) => runs
                .iter()
                .map(|&(s, e)| e.min(end).saturating_sub(s.max(start)))
                .sum(),
        }
    }

    fn check(&self, index: usize, prompt_len: u64, previous_end: u64) -> Result<(), String> {
        if self.length == 0 {
            return Err(format!("item {index}: length must be at least 1"));
        }
        if self.embeds > self.length {
            return Err(format!(
                "item {index}: embeds {} exceeds its length {}",
                self.embeds, self.length
            ));
        }
        if self.embeds == 0 {
            return Err(format!("item {index}: it has no embedding position"));
        }
        if let Some(runs) = &self.embed_runs {
            let mut last = 0;
            for &(s, e) in runs.iter() {
                if s < last || e <= s || e > self.length {
                    return Err(format!(
                        "item {index}: embedding run {s}..{e} is empty, out of order or past the item's length {}",
                        self.length
                    ));
                }
                last = e;
            }
        }
        if self.offset < previous_end {
            return Err(format!(
                "item {index}: offset {} overlaps or precedes the previous item, which ends at {previous_end}",
                self.offset
            ));
        }
        if self.end() > prompt_len {
            return Err(format!(
                "item {index}: positions {}..{} extend past prompt_len {prompt_len}",
                self.offset,
                self.end()
            ));
        }
        Ok(())
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
    /// Requests preempted this step (KV blocks ran out), in preemption order: they released
    /// everything and wait again from the start of their prompts.
    pub preempted: Vec<RequestId>,
    /// Hashes the device cache must free before storing this step's outputs, in eviction order.
    pub freed: Vec<MmHash>,
    /// Encoder-cache free slots after scheduling.
    pub free_slots: u64,
    /// Encoder-cache freeable slots after scheduling.
    pub freeable_slots: u64,
    /// Free KV blocks after scheduling; `None` when KV blocks are unlimited.
    pub free_kv_blocks: Option<u64>,
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
    /// The prompt needs more KV blocks than there are.
    #[error(
        "the prompt of {prompt_len} tokens needs {needed} KV blocks of {block_size} tokens but only {usable} exist (num_kv_blocks {num_kv_blocks} less the null block), so it can never be admitted; raise --num-kv-blocks to at least {}",
        needed + 1
    )]
    PromptExceedsKvCache {
        /// Prompt tokens.
        prompt_len: u64,
        /// Blocks it needs.
        needed: u64,
        /// Tokens per block.
        block_size: u64,
        /// Blocks a request can get.
        usable: u64,
        /// The configured count.
        num_kv_blocks: u64,
    },
    /// The encoder cache manager refused an allocation the walk had checked.
    #[error(transparent)]
    Cache(#[from] EncoderCacheError),
}

/// A scheduling policy. [`Scheduler`] is the implementation; an engine drives it through this
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

/// The scheduler, following the [`Policy`] of its configuration.
#[derive(Debug)]
pub struct Scheduler<M = EncoderCacheManager, B = EncoderBudget> {
    config: SchedulerConfig,
    budget: B,
    manager: M,
    kv: Option<KvBlocks>,
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
    /// KV blocks held.
    blocks: u64,
}

/// KV-cache blocks as vLLM's `KVCacheManager` counts them for one full-attention group without
/// prefix caching: a request holds `ceil(tokens / block_size)` blocks for its computed and
/// scheduled tokens, and gives them all back when it finishes, is aborted or is preempted.
#[derive(Debug)]
struct KvBlocks {
    block_size: u64,
    /// Blocks a request can get: `num_kv_blocks` less the null block.
    usable: u64,
    free: u64,
}

impl KvBlocks {
    fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size)
    }
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
    /// Cache slots this request needed and was refused for lack of space (`progress` only).
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
        let kv = config.num_kv_blocks.map(|n| {
            let usable = n.saturating_sub(1);
            KvBlocks {
                block_size: config.kv_block_size.max(1),
                usable,
                free: usable,
            }
        });
        Scheduler {
            config,
            budget,
            manager,
            kv,
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

    /// Evicts every unreferenced encoder-cache entry; returns their hashes, whose device
    /// buffers the caller frees. What an engine does on a device out-of-memory before retrying.
    pub fn evict_unreferenced(&mut self) -> Vec<MmHash> {
        self.manager.evict_unreferenced()
    }

    /// Forgets the encoder-cache entry of `hash` and every reference to it (its output never
    /// reached the device, or was lost); requests that still need the item allocate it again
    /// and re-encode it. False if it is not cached.
    pub fn invalidate_encoder_output(&mut self, hash: &str) -> bool {
        self.manager.invalidate(hash)
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

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.config.policy
    }

    /// The next step's number.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Prompt tokens consumed by `request`, if it is unfinished.
    pub fn num_computed_tokens(&self, request: RequestId) -> Option<u64> {
        self.requests.get(&request).map(|r| r.computed)
    }

    /// Running requests, in the order the next step serves them.
    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    /// Waiting requests, head first.
    pub fn waiting(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().copied()
    }

    /// Free KV blocks; `None` when KV blocks are unlimited.
    pub fn free_kv_blocks(&self) -> Option<u64> {
        self.kv.as_ref().map(|kv| kv.free)
    }

    /// Walks one request's items the way its policy does. Leaves the items to encode in
    /// `walk.to_schedule` and the repeats in `walk.shared`; allocates nothing.
    fn walk(
        &mut self,
        id: RequestId,
        token_budget: u64,
        compute_budget: u64,
        reserved: u64,
    ) -> Placement {
        let mut placement = Placement {
            tokens: 0,
            compute_budget,
            refused_space: 0,
        };
        let walk = &mut self.walk;
        walk.to_schedule.clear();
        walk.shared.clear();
        walk.took_refs.clear();
        walk.picked.clear();
        let Some(state) = self.requests.get(&id) else {
            return placement;
        };
        let computed = state.computed;
        let mut tokens = (state.prompt_len - computed).min(token_budget);
        let items = &state.items;
        let first = state.next_unconsumed;
        let mut compute = compute_budget;
        let mut already = 0u64;
        let unchunked = self.config.disable_chunked_mm_input;
        match self.config.policy {
            Policy::Vllm => {
                let window_end = computed + tokens;
                for (i, item) in items.iter().enumerate().skip(first) {
                    if tokens == 0 || item.offset >= window_end {
                        break;
                    }
                    if item.end() <= computed {
                        continue;
                    }
                    // vLLM's rule 1: `<=`, so a window starting exactly at the item splits it too.
                    if unchunked && computed <= item.offset && computed + tokens < item.end() {
                        tokens = item.offset - computed;
                        break;
                    }
                    if walk.picked.contains(&item.hash) {
                        walk.shared.push(i);
                        continue;
                    }
                    if self.manager.check_and_update_cache(id, i, &item.hash) {
                        continue;
                    }
                    if !self.manager.can_allocate(item.embeds, compute, already) {
                        tokens = tokens.min(item.offset.saturating_sub(computed));
                        break;
                    }
                    let rel_start = computed.saturating_sub(item.offset);
                    let rel_end = item.length.min(window_end - item.offset);
                    if item.embeds_between(rel_start, rel_end) == 0 {
                        continue;
                    }
                    compute -= item.embeds;
                    already += item.embeds;
                    walk.to_schedule.push(i);
                    walk.picked.push(item.hash.clone());
                }
            }
            Policy::Progress => {
                for (i, item) in items.iter().enumerate().skip(first) {
                    if item.offset >= computed + tokens {
                        break;
                    }
                    if item.end() <= computed {
                        continue;
                    }
                    if walk.picked.contains(&item.hash) {
                        walk.shared.push(i);
                        continue;
                    }
                    // A reference taken here is rolled back if the request is not placed.
                    let held = self.manager.holds(id, i);
                    if self.manager.check_and_update_cache(id, i, &item.hash) {
                        if !held {
                            walk.took_refs.push(i);
                        }
                        continue;
                    }
                    if unchunked && computed + tokens < item.end() {
                        tokens = item.offset.saturating_sub(computed);
                        break;
                    }
                    // The reserved slots of a request refused earlier this step count as
                    // already scheduled.
                    if !self.manager.can_allocate(
                        item.embeds,
                        compute,
                        already.saturating_add(reserved),
                    ) {
                        if item.embeds <= compute {
                            placement.refused_space = item.embeds + already;
                        }
                        tokens = item.offset.saturating_sub(computed);
                        break;
                    }
                    compute -= item.embeds;
                    already += item.embeds;
                    walk.to_schedule.push(i);
                    walk.picked.push(item.hash.clone());
                }
            }
        }
        placement.tokens = tokens;
        placement.compute_budget = compute;
        placement
    }

    /// Takes the references of a placed request's walk: allocations for the items it encodes,
    /// hits for their repeats.
    fn commit(&mut self, id: RequestId) -> Result<(), SchedulerError> {
        let Some(state) = self.requests.get(&id) else {
            return Ok(());
        };
        for &i in &self.walk.to_schedule {
            let item = &state.items[i];
            self.manager.allocate(id, i, &item.hash, item.embeds)?;
        }
        for &i in &self.walk.shared {
            // Allocated just above by this request's earlier occurrence: a hit.
            self.manager
                .check_and_update_cache(id, i, &state.items[i].hash);
        }
        Ok(())
    }

    /// Undoes the references a `progress` walk took for a request that is not placed.
    fn roll_back(&mut self, id: RequestId) {
        for &i in &self.walk.took_refs {
            self.manager.free_encoder_input(id, i);
        }
    }

    /// KV blocks `id` needs beyond those it holds to have `tokens` tokens in the cache, if they
    /// are free; `Some(0)` when KV blocks are unlimited.
    fn kv_shortfall(&self, id: RequestId, tokens: u64) -> Option<u64> {
        let Some(kv) = &self.kv else {
            return Some(0);
        };
        let held = self.requests.get(&id).map_or(0, |r| r.blocks);
        let need = kv.blocks_for(tokens).saturating_sub(held);
        (need <= kv.free).then_some(need)
    }

    fn take_kv(&mut self, id: RequestId, blocks: u64) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        if let Some(state) = self.requests.get_mut(&id) {
            kv.free -= blocks;
            state.blocks += blocks;
        }
    }

    fn release_kv(&mut self, id: RequestId) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        if let Some(state) = self.requests.get_mut(&id) {
            kv.free += state.blocks;
            state.blocks = 0;
        }
    }

    /// vLLM's `_preempt_request`: everything released, progress reset, back to the head of the
    /// waiting queue.
    fn preempt(&mut self, id: RequestId, out: &mut StepOutput) {
        self.release_kv(id);
        self.manager.free(id);
        if let Some(state) = self.requests.get_mut(&id) {
            state.computed = 0;
            state.next_unconsumed = 0;
        }
        self.waiting.push_front(id);
        out.preempted.push(id);
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

    /// Releases, in position order, the inputs whose positions are all consumed.
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

    /// The running requests' pass; returns the slots reserved for a request refused for space
    /// (`progress` only). It ends early when a request cannot get KV blocks even after
    /// preempting every request behind it, as vLLM's does.
    fn schedule_running(
        &mut self,
        out: &mut StepOutput,
        token_budget: &mut u64,
        compute_budget: &mut u64,
    ) -> Result<u64, SchedulerError> {
        let mut reserved = 0u64;
        let mut index = 0;
        while index < self.running.len() && *token_budget > 0 {
            let id = self.running[index];
            let placed = self.walk(id, *token_budget, *compute_budget, reserved);
            reserved = reserved.max(placed.refused_space);
            if placed.tokens == 0 {
                if self.config.policy == Policy::Progress {
                    self.roll_back(id);
                }
                index += 1;
                continue;
            }
            let blocks = loop {
                if self.kv.is_none() {
                    break Some(0);
                }
                let computed = self.requests.get(&id).map_or(0, |r| r.computed);
                if let Some(blocks) = self.kv_shortfall(id, computed + placed.tokens) {
                    break Some(blocks);
                }
                // vLLM preempts the last running request, which is never one already placed
                // this step: those come before `index`.
                let Some(victim) = self.running.pop() else {
                    break None;
                };
                self.preempt(victim, out);
                if victim == id {
                    break None;
                }
            };
            let Some(blocks) = blocks else {
                break;
            };
            self.take_kv(id, blocks);
            self.commit(id)?;
            *compute_budget = placed.compute_budget;
            *token_budget -= placed.tokens;
            self.record(out, id, placed.tokens);
            index += 1;
        }
        Ok(reserved)
    }

    /// The waiting requests' pass.
    fn schedule_waiting(
        &mut self,
        out: &mut StepOutput,
        token_budget: &mut u64,
        compute_budget: &mut u64,
        reserved: u64,
    ) -> Result<(), SchedulerError> {
        let max_running = usize::try_from(self.config.max_num_seqs).unwrap_or(usize::MAX);
        let mut set_aside: Vec<RequestId> = Vec::new();
        while *token_budget > 0 && self.running.len() < max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let (prompt_len, computed) = self
                .requests
                .get(&id)
                .map_or((0, 0), |r| (r.prompt_len, r.computed));
            if !self.config.enable_chunked_prefill && prompt_len - computed > *token_budget {
                break;
            }
            let placed = self.walk(id, *token_budget, *compute_budget, reserved);
            if placed.tokens == 0 {
                match self.config.policy {
                    Policy::Vllm => {
                        // Kept at the head of the queue, with the references its walk took.
                        set_aside.push(id);
                        self.waiting.pop_front();
                        continue;
                    }
                    Policy::Progress => {
                        self.roll_back(id);
                        break;
                    }
                }
            }
            // vLLM admits a request only if its whole prompt fits (`scheduler_reserve_full_isl`),
            // and allocates for the tokens scheduled now.
            let fits = self.kv_shortfall(id, prompt_len).is_some();
            let Some(blocks) = self
                .kv_shortfall(id, computed + placed.tokens)
                .filter(|_| fits)
            else {
                match self.config.policy {
                    Policy::Vllm => self.manager.free(id),
                    Policy::Progress => self.roll_back(id),
                }
                break;
            };
            self.take_kv(id, blocks);
            self.commit(id)?;
            *compute_budget = placed.compute_budget;
            *token_budget -= placed.tokens;
            self.waiting.pop_front();
            self.running.push(id);
            self.record(out, id, placed.tokens);
        }
        for id in set_aside.into_iter().rev() {
            self.waiting.push_front(id);
        }
        Ok(())
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
            item.check(index, request.prompt_len, previous_end)
                .map_err(|reason| SchedulerError::InvalidRequest { reason })?;
            self.budget
                .check_item(item.modality, item.length, item.embeds)
                .map_err(|source| SchedulerError::Budget { index, source })?;
            previous_end = item.end();
        }
        if let (Some(kv), Some(num_kv_blocks)) = (&self.kv, self.config.num_kv_blocks) {
            let needed = kv.blocks_for(request.prompt_len);
            if needed > kv.usable {
                return Err(SchedulerError::PromptExceedsKvCache {
                    prompt_len: request.prompt_len,
                    needed,
                    block_size: kv.block_size,
                    usable: kv.usable,
                    num_kv_blocks,
                });
            }
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
                blocks: 0,
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
        let reserved = self.schedule_running(&mut out, &mut token_budget, &mut compute_budget)?;
        // vLLM admits no waiting request in a step that preempted one.
        if out.preempted.is_empty() {
            self.schedule_waiting(&mut out, &mut token_budget, &mut compute_budget, reserved)?;
        }
        out.freed = self.manager.get_freed_mm_hashes();
        out.free_slots = self.manager.num_free_slots();
        out.freeable_slots = self.manager.num_freeable_slots();
        out.free_kv_blocks = self.free_kv_blocks();
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
                self.release_kv(id);
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
        if !self.requests.contains_key(&request) {
            return false;
        }
        self.manager.free(request);
        self.release_kv(request);
        self.requests.remove(&request);
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
