//! The encoder budget: how many embedding tokens the encoder may compute per step and how many
//! the encoder cache holds, derived from the scheduler configuration and the model's largest item.
//!
//! The rules are vLLM's (`compute_mm_encoder_budget`, `MultiModalBudget`):
//!
//! - compute budget = `max(max_num_encoder_input_tokens, m)` and cache size =
//!   `max(encoder_cache_size, m)`, where `m` is the largest per-item maximum over the modalities
//!   and both settings default to `max_num_batched_tokens`; the cache always fits one maximum item;
//! - with chunked multimodal input disabled, an item larger than `max_num_batched_tokens` can never
//!   be scheduled: an error naming both numbers and the flags to change;
//! - max items per prompt = `max(1, min(limit_per_prompt, max_model_len / T))`, max items per batch
//!   = `max(1, min(budget / T, requests * per_prompt))`, with `requests = max_num_seqs`, capped by
//!   `max_num_batched_tokens / T` when chunked prefill is off;
//! - a request whose item exceeds the cache or the compute budget is refused with the numbers
//!   and the settings to change (the compute budget's is `--max-num-batched-tokens` unless
//!   `max_num_encoder_input_tokens` is configured).
//!
//! [`EncoderBudget`] is the default [`BudgetPolicy`].
//!
//! ```
//! use iris_core::budget::{BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig};
//!
//! let config = SchedulerConfig { max_num_batched_tokens: 8192, ..SchedulerConfig::default() };
//! let budget = EncoderBudget::new(&config, &[(Modality::Image, ModalityLimits::new(16384))])
//!     .unwrap();
//! assert_eq!((budget.compute_budget(), budget.cache_size()), (16384, 16384));
//! // The cache in bytes for 3584-wide bf16 embeddings.
//! assert_eq!(budget.cache_bytes(3584, 2).unwrap(), 16384 * 3584 * 2);
//! ```

use std::fmt;

use thiserror::Error;

/// `max_num_batched_tokens` when none is given (vLLM's default for online serving with chunked
/// prefill on a large GPU).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u64 = 8192;
/// `max_num_seqs` when none is given (vLLM's default).
pub const DEFAULT_MAX_NUM_SEQS: u64 = 256;
/// Tokens per KV-cache block when none is given (vLLM's default block size).
pub const DEFAULT_KV_BLOCK_SIZE: u64 = 16;

/// Which rules the scheduler follows.
///
/// ```
/// use iris_core::budget::Policy;
///
/// assert_eq!("progress".parse::<Policy>().unwrap(), Policy::Progress);
/// assert_eq!(Policy::default().to_string(), "vllm");
/// assert!("fcfs".parse::<Policy>().unwrap_err().contains("vllm, progress"));
/// ```
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// vLLM 0.33.0's v1 scheduler, step for step, stalls included.
    #[default]
    Vllm,
    /// vLLM's rules plus iris's progress guarantees: every step schedules a token while requests
    /// are unfinished, and every request completes (see [`crate::scheduler`]).
    Progress,
}

impl Policy {
    /// Every policy, as named on the command line and in configuration.
    pub const ALL: [Policy; 2] = [Policy::Vllm, Policy::Progress];

    /// The name used on the command line and in configuration.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Vllm => "vllm",
            Policy::Progress => "progress",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("unknown scheduler policy {s:?}; expected one of vllm, progress")
            })
    }
}

/// The part of the scheduler configuration that the encoder budget depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens (text and multimodal positions) scheduled per step, all requests together.
    pub max_num_batched_tokens: u64,
    /// Requests running at once.
    pub max_num_seqs: u64,
    /// Longest prompt in tokens; bounds items per prompt.
    pub max_model_len: u64,
    /// Encoder compute budget per step; `None`: `max_num_batched_tokens`.
    pub max_num_encoder_input_tokens: Option<u64>,
    /// Encoder cache size in embedding tokens; `None`: `max_num_batched_tokens`.
    pub encoder_cache_size: Option<u64>,
    /// Never split a multimodal item across steps.
    pub disable_chunked_mm_input: bool,
    /// Whether a prompt may be prefilled over several steps.
    pub enable_chunked_prefill: bool,
    /// Which rules the scheduler follows.
    pub policy: Policy,
    /// Tokens per KV-cache block (vLLM's `--block-size`).
    pub kv_block_size: u64,
    /// KV-cache blocks, counted as vLLM's `num_gpu_blocks` (one of them is the null block no
    /// request gets); `None`: unlimited, so no request is ever preempted.
    pub num_kv_blocks: Option<u64>,
    /// Items of each modality per prompt (`--limit-mm-per-prompt`).
    pub limit_mm_per_prompt: MmLimits,
}

impl SchedulerConfig {
    /// Checks the values that must be positive (and the KV blocks beyond the null block),
    /// which need no model: an engine checks them before it loads anything.
    ///
    /// # Errors
    /// [`BudgetError::Zero`] or [`BudgetError::TooFewKvBlocks`], naming the setting.
    pub fn check(&self) -> Result<(), BudgetError> {
        let zero = |value: u64, name| {
            if value == 0 {
                Err(BudgetError::Zero { name })
            } else {
                Ok(())
            }
        };
        zero(self.max_num_batched_tokens, "max_num_batched_tokens")?;
        zero(self.max_num_seqs, "max_num_seqs")?;
        zero(self.kv_block_size, "kv_block_size")?;
        match self.num_kv_blocks {
            Some(num_kv_blocks) if num_kv_blocks < 2 => {
                Err(BudgetError::TooFewKvBlocks { num_kv_blocks })
            }
            _ => Ok(()),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_model_len: u64::MAX,
            max_num_encoder_input_tokens: None,
            encoder_cache_size: None,
            disable_chunked_mm_input: false,
            enable_chunked_prefill: true,
            policy: Policy::Vllm,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            num_kv_blocks: None,
            limit_mm_per_prompt: MmLimits::default(),
        }
    }
}

/// A kind of multimodal input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Modality {
    /// A still image.
    Image,
    /// A video.
    Video,
}

impl Modality {
    /// The indefinite article of the modality's name ("an image", "a video").
    #[must_use]
    pub fn article(self) -> &'static str {
        match self {
            Modality::Image => "an",
            Modality::Video => "a",
        }
    }
}

impl fmt::Display for Modality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Modality::Image => "image",
            Modality::Video => "video",
        })
    }
}

/// vLLM's default `--limit-mm-per-prompt` count of every modality.
pub const DEFAULT_LIMIT_PER_PROMPT: u64 = 999;

/// vLLM's `--limit-mm-per-prompt` counts: the items of each modality one prompt may carry. A
/// modality at 0 is refused and left out of the start-up profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmLimits {
    /// Images per prompt.
    pub image: u64,
    /// Videos per prompt.
    pub video: u64,
}

impl Default for MmLimits {
    fn default() -> Self {
        MmLimits {
            image: DEFAULT_LIMIT_PER_PROMPT,
            video: DEFAULT_LIMIT_PER_PROMPT,
        }
    }
}

impl MmLimits {
    /// The count of `modality`.
    #[must_use]
    pub fn get(&self, modality: Modality) -> u64 {
        match modality {
            Modality::Image => self.image,
            Modality::Video => self.video,
        }
    }

    /// Checks one request's counts of images and videos against the limits.
    ///
    /// # Errors
    /// The message of the first count over its limit, naming `--limit-mm-per-prompt`.
    pub fn check(&self, images: u64, videos: u64) -> Result<(), String> {
        for (modality, count) in [(Modality::Image, images), (Modality::Video, videos)] {
            let limit = self.get(modality);
            if count > limit {
                return Err(format!(
                    "at most {limit} {modality}(s) may be provided in one request (--limit-mm-per-prompt), got {count}"
                ));
            }
        }
        Ok(())
    }
}

/// What the model allows per modality.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModalityLimits {
    /// Embedding tokens of the largest item (Qwen2/2.5/3-VL images: 16384).
    pub max_tokens_per_item: u64,
    /// Items allowed per prompt (`--limit-mm-per-prompt`).
    pub limit_per_prompt: u64,
}

impl ModalityLimits {
    /// Limits with the given per-item maximum and no per-prompt limit of its own.
    pub fn new(max_tokens_per_item: u64) -> Self {
        ModalityLimits {
            max_tokens_per_item,
            limit_per_prompt: u64::MAX,
        }
    }
}

/// Budget errors, each naming the numbers and what to change.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum BudgetError {
    /// Chunked multimodal input is disabled and an item exceeds the step's token budget.
    #[error(
        "the {modality} item has {tokens} embedding tokens, more than max_num_batched_tokens ({max_num_batched_tokens}), and chunked multimodal input is disabled, so it can never be scheduled; raise --max-num-batched-tokens to at least {tokens} or remove --disable-chunked-mm-input"
    )]
    ItemExceedsBatch {
        /// The modality.
        modality: Modality,
        /// The item's tokens.
        tokens: u64,
        /// The step's token budget.
        max_num_batched_tokens: u64,
    },
    /// An item needs more encoder-cache slots than the cache has. The advice names every
    /// setting to raise: the compute budget too when the item exceeds it, so that following
    /// it is not answered by [`BudgetError::ItemExceedsCompute`].
    #[error(
        "the prompt contains {article} {modality} item with {tokens} embedding tokens, which exceeds the encoder cache size of {cache_size} tokens; reduce the input size or raise --encoder-cache-size to at least {tokens}{also}",
        article = .modality.article(),
        also = also_raise_compute(*.tokens, *.compute_budget, .compute_setting)
    )]
    ItemExceedsCache {
        /// The modality.
        modality: Modality,
        /// The item's embedding tokens.
        tokens: u64,
        /// The cache size.
        cache_size: u64,
        /// The compute budget per step.
        compute_budget: u64,
        /// The setting the compute budget derives from: [`COMPUTE_BUDGET_FLAG`], or
        /// [`COMPUTE_BUDGET_SETTING`] when that is configured.
        compute_setting: &'static str,
    },
    /// An item needs more encoder compute than one step allows.
    #[error(
        "the {modality} item has {tokens} embedding tokens, more than the encoder compute budget of {compute_budget} tokens per step; reduce the input size or raise {compute_setting} (the compute budget is the larger of it and the model's largest item) to at least {tokens}"
    )]
    ItemExceedsCompute {
        /// The modality.
        modality: Modality,
        /// The item's embedding tokens.
        tokens: u64,
        /// The compute budget.
        compute_budget: u64,
        /// The setting the compute budget derives from, as in [`BudgetError::ItemExceedsCache`].
        compute_setting: &'static str,
    },
    /// A configuration value that must be positive is zero.
    #[error("{name} must be at least 1, got 0")]
    Zero {
        /// The setting.
        name: &'static str,
    },
    /// Fewer KV blocks than the null block plus one.
    #[error(
        "num_kv_blocks must be at least 2 (one is the null block), got {num_kv_blocks}; raise --num-kv-blocks"
    )]
    TooFewKvBlocks {
        /// The configured count.
        num_kv_blocks: u64,
    },
    /// A byte figure overflowed 64 bits.
    #[error("encoder budget in bytes overflows: {tokens} tokens x {width} x {dtype_bytes} bytes")]
    Overflow {
        /// Tokens.
        tokens: u64,
        /// Embedding width.
        width: u64,
        /// Bytes per element.
        dtype_bytes: u64,
    },
}

/// The flag the encoder compute budget derives from when `max_num_encoder_input_tokens` is not
/// configured (vLLM's default, and the only one the command line offers).
pub const COMPUTE_BUDGET_FLAG: &str = "--max-num-batched-tokens";
/// The setting the encoder compute budget derives from when configured; no flag sets it.
pub const COMPUTE_BUDGET_SETTING: &str = "max_num_encoder_input_tokens";

/// The budget rules a scheduler relies on. [`EncoderBudget`] is the default.
pub trait BudgetPolicy {
    /// Embedding tokens the encoder may compute per step.
    fn compute_budget(&self) -> u64;
    /// Encoder cache capacity in embedding tokens.
    fn cache_size(&self) -> u64;
    /// Whether one item of `tokens` placeholder positions (`embeds` of them embeddings) can ever
    /// be scheduled; the error says what to change.
    fn check_item(&self, modality: Modality, tokens: u64, embeds: u64) -> Result<(), BudgetError>;
}

/// The default encoder budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderBudget {
    max_num_batched_tokens: u64,
    disable_chunked_mm_input: bool,
    compute: u64,
    /// The setting `compute` derives from, named in errors.
    compute_setting: &'static str,
    cache: u64,
    modalities: Vec<(Modality, ModalityBudget)>,
}

/// Derived figures for one modality.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModalityBudget {
    /// Embedding tokens of the largest item.
    pub max_tokens_per_item: u64,
    /// Items per prompt.
    pub max_items_per_prompt: u64,
    /// Items per batch (step).
    pub max_items_per_batch: u64,
}

impl EncoderBudget {
    /// Derives the budget; errors when an item could never be scheduled.
    pub fn new(
        config: &SchedulerConfig,
        modalities: &[(Modality, ModalityLimits)],
    ) -> Result<Self, BudgetError> {
        config.check()?;
        let (compute, cache) = compute_mm_encoder_budget(config, modalities)?;
        let encoder_budget = compute.min(cache);
        let modalities = modalities
            .iter()
            .filter(|(_, l)| l.max_tokens_per_item > 0)
            .map(|&(modality, limits)| {
                let t = limits.max_tokens_per_item;
                let per_prompt = limits.limit_per_prompt.min(config.max_model_len / t).max(1);
                let mut requests = config.max_num_seqs;
                if !config.enable_chunked_prefill {
                    requests = requests.min(config.max_num_batched_tokens / t);
                }
                let per_batch = (encoder_budget / t)
                    .min(requests.saturating_mul(per_prompt))
                    .max(1);
                (
                    modality,
                    ModalityBudget {
                        max_tokens_per_item: t,
                        max_items_per_prompt: per_prompt,
                        max_items_per_batch: per_batch,
                    },
                )
            })
            .collect();
        Ok(EncoderBudget {
            max_num_batched_tokens: config.max_num_batched_tokens,
            disable_chunked_mm_input: config.disable_chunked_mm_input,
            compute,
            compute_setting: if config.max_num_encoder_input_tokens.is_some() {
                COMPUTE_BUDGET_SETTING
            } else {
                COMPUTE_BUDGET_FLAG
            },
            cache,
            modalities,
        })
    }

    /// `min(compute budget, cache size)` (vLLM's `get_encoder_budget`).
    pub fn encoder_budget(&self) -> u64 {
        self.compute.min(self.cache)
    }

    /// Derived figures for `modality`, if the model accepts it.
    pub fn modality(&self, modality: Modality) -> Option<ModalityBudget> {
        self.modalities
            .iter()
            .find(|(m, _)| *m == modality)
            .map(|(_, b)| *b)
    }

    /// The cache size in bytes: tokens x embedding width x bytes per element.
    pub fn cache_bytes(&self, width: u64, dtype_bytes: u64) -> Result<u64, BudgetError> {
        tokens_to_bytes(self.cache, width, dtype_bytes)
    }

    /// The per-step compute budget in bytes of encoder output.
    pub fn compute_bytes(&self, width: u64, dtype_bytes: u64) -> Result<u64, BudgetError> {
        tokens_to_bytes(self.compute, width, dtype_bytes)
    }
}

impl BudgetPolicy for EncoderBudget {
    fn compute_budget(&self) -> u64 {
        self.compute
    }

    fn cache_size(&self) -> u64 {
        self.cache
    }

    fn check_item(&self, modality: Modality, tokens: u64, embeds: u64) -> Result<(), BudgetError> {
        if self.disable_chunked_mm_input && tokens > self.max_num_batched_tokens {
            return Err(BudgetError::ItemExceedsBatch {
                modality,
                tokens,
                max_num_batched_tokens: self.max_num_batched_tokens,
            });
        }
        if embeds > self.cache {
            return Err(BudgetError::ItemExceedsCache {
                modality,
                tokens: embeds,
                cache_size: self.cache,
                compute_budget: self.compute,
                compute_setting: self.compute_setting,
            });
        }
        // An item's encoder output is computed in one step, so it must also fit the compute
        // budget; compute >= cache is not guaranteed when both are configured.
        if embeds > self.compute {
            return Err(BudgetError::ItemExceedsCompute {
                modality,
                tokens: embeds,
                compute_budget: self.compute,
                compute_setting: self.compute_setting,
            });
        }
        Ok(())
    }
}

/// vLLM's `compute_mm_encoder_budget`: `(compute budget, cache size)` in embedding tokens.
/// No modality (or every maximum zero) gives `(0, 0)` with a warning: the model takes no
/// multimodal input.
pub fn compute_mm_encoder_budget(
    config: &SchedulerConfig,
    modalities: &[(Modality, ModalityLimits)],
) -> Result<(u64, u64), BudgetError> {
    let Some((modality, m)) = modalities
        .iter()
        .map(|(modality, l)| (*modality, l.max_tokens_per_item))
        .filter(|(_, t)| *t > 0)
        .max_by_key(|(_, t)| *t)
    else {
        tracing::warn!("no multimodal modality with items: encoder compute budget and cache are 0");
        return Ok((0, 0));
    };
    if config.disable_chunked_mm_input && m > config.max_num_batched_tokens {
        return Err(BudgetError::ItemExceedsBatch {
            modality,
            tokens: m,
            max_num_batched_tokens: config.max_num_batched_tokens,
        });
    }
    let compute = config
        .max_num_encoder_input_tokens
        .unwrap_or(config.max_num_batched_tokens)
        .max(m);
    let cache = config
        .encoder_cache_size
        .unwrap_or(config.max_num_batched_tokens)
        .max(m);
    Ok((compute, cache))
}

/// The advice [`BudgetError::ItemExceedsCache`] adds when the item exceeds the compute budget
/// as well: raising the cache alone would only trade one refusal for the other.
fn also_raise_compute(tokens: u64, compute_budget: u64, compute_setting: &str) -> String {
    if compute_budget < tokens {
        format!(
            " and {compute_setting} (which sets the encoder compute budget per step, now {compute_budget}) to at least {tokens}"
        )
    } else {
        String::new()
    }
}

/// `tokens x width x dtype_bytes`, checked.
pub fn tokens_to_bytes(tokens: u64, width: u64, dtype_bytes: u64) -> Result<u64, BudgetError> {
    tokens
        .checked_mul(width)
        .and_then(|b| b.checked_mul(dtype_bytes))
        .ok_or(BudgetError::Overflow {
            tokens,
            width,
            dtype_bytes,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mnbt: u64) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: mnbt,
            ..SchedulerConfig::default()
        }
    }

    #[test]
    fn budget_is_at_least_one_maximum_item() {
        let img = [(Modality::Image, ModalityLimits::new(16384))];
        assert_eq!(
            compute_mm_encoder_budget(&config(8192), &img).unwrap(),
            (16384, 16384)
        );
        assert_eq!(
            compute_mm_encoder_budget(&config(32768), &img).unwrap(),
            (32768, 32768)
        );
        let mut c = config(8192);
        c.encoder_cache_size = Some(50_000);
        c.max_num_encoder_input_tokens = Some(1000);
        assert_eq!(
            compute_mm_encoder_budget(&c, &img).unwrap(),
            (16384, 50_000)
        );
    }

    #[test]
    fn no_modality_gives_zero() {
        assert_eq!(
            compute_mm_encoder_budget(&config(8192), &[]).unwrap(),
            (0, 0)
        );
    }

    #[test]
    fn non_chunked_item_larger_than_batch_is_an_error_naming_the_flags() {
        let mut c = config(8192);
        c.disable_chunked_mm_input = true;
        let err = compute_mm_encoder_budget(&c, &[(Modality::Image, ModalityLimits::new(16384))])
            .unwrap_err();
        assert_eq!(
            err,
            BudgetError::ItemExceedsBatch {
                modality: Modality::Image,
                tokens: 16384,
                max_num_batched_tokens: 8192
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("16384") && msg.contains("8192"), "{msg}");
        assert!(
            msg.contains("--max-num-batched-tokens") && msg.contains("--disable-chunked-mm-input")
        );
    }

    #[test]
    fn item_larger_than_cache_is_an_error_naming_the_flag() {
        let mut c = config(1000);
        c.encoder_cache_size = Some(1000);
        let b = EncoderBudget::new(&c, &[(Modality::Image, ModalityLimits::new(800))]).unwrap();
        assert!(b.check_item(Modality::Image, 1200, 1000).is_ok());
        let err = b.check_item(Modality::Image, 1200, 1001).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("1001") && msg.contains("1000"), "{msg}");
        assert!(msg.contains("--encoder-cache-size"), "{msg}");
        assert!(msg.contains("contains an image item"), "{msg}");
        let video = b.check_item(Modality::Video, 1200, 1001).unwrap_err();
        assert!(
            video.to_string().contains("contains a video item"),
            "{video}"
        );
    }

    #[test]
    fn each_refusal_names_every_setting_that_lifts_it() {
        // The refusal of an item of `tokens` under `config`.
        let refusal = |config: &SchedulerConfig, modality: Modality, tokens: u64| {
            EncoderBudget::new(config, &[(Modality::Image, ModalityLimits::new(800))])
                .unwrap()
                .check_item(modality, tokens, tokens)
                .unwrap_err()
                .to_string()
        };
        // Cache and compute both 1000: an item of 1001 needs both raised, and says so, so that
        // raising the cache alone does not meet the compute refusal next.
        let mut c = config(1000);
        c.encoder_cache_size = Some(1000);
        let msg = refusal(&c, Modality::Image, 1001);
        assert!(
            msg.contains("--encoder-cache-size to at least 1001")
                && msg.contains("--max-num-batched-tokens (which sets the encoder compute budget"),
            "{msg}"
        );
        // A cache that is large enough already: the one refusal names the flag that sets the
        // compute budget, not a setting no flag has.
        c.encoder_cache_size = Some(5000);
        let msg = refusal(&c, Modality::Video, 1500);
        assert!(
            msg.contains("raise --max-num-batched-tokens") && msg.contains("at least 1500"),
            "{msg}"
        );
        assert!(!msg.contains("--encoder-cache-size"), "{msg}");
        // A cache refusal whose item fits the compute budget names the cache alone.
        let mut big_compute = config(4000);
        big_compute.encoder_cache_size = Some(1000);
        let msg = refusal(&big_compute, Modality::Image, 1001);
        assert!(
            msg.contains("--encoder-cache-size") && !msg.contains("--max-num-batched-tokens"),
            "{msg}"
        );
        // A configured compute budget is named by its setting.
        c.max_num_encoder_input_tokens = Some(1000);
        let msg = refusal(&c, Modality::Image, 1500);
        assert!(msg.contains("raise max_num_encoder_input_tokens"), "{msg}");
    }

    #[test]
    fn items_per_prompt_and_batch() {
        let c = SchedulerConfig {
            max_num_batched_tokens: 8192,
            max_num_seqs: 4,
            max_model_len: 16384,
            ..SchedulerConfig::default()
        };
        let b = EncoderBudget::new(
            &c,
            &[
                (
                    Modality::Image,
                    ModalityLimits {
                        max_tokens_per_item: 16384,
                        limit_per_prompt: 5,
                    },
                ),
                (
                    Modality::Video,
                    ModalityLimits {
                        max_tokens_per_item: 2048,
                        limit_per_prompt: 3,
                    },
                ),
            ],
        )
        .unwrap();
        assert_eq!(b.encoder_budget(), 16384);
        let img = b.modality(Modality::Image).unwrap();
        // 16384 / 16384 = 1 item per prompt; budget / T = 1 per batch.
        assert_eq!((img.max_items_per_prompt, img.max_items_per_batch), (1, 1));
        let vid = b.modality(Modality::Video).unwrap();
        // min(3, 16384/2048 = 8) = 3 per prompt; min(16384/2048 = 8, 4 seqs * 3) = 8 per batch.
        assert_eq!((vid.max_items_per_prompt, vid.max_items_per_batch), (3, 8));

        let mut c2 = c.clone();
        c2.enable_chunked_prefill = false;
        let b2 = EncoderBudget::new(&c2, &[(Modality::Video, ModalityLimits::new(2048))]).unwrap();
        // requests = min(4, 8192 / 2048 = 4); per prompt = 16384 / 2048 = 8;
        // per batch = min(8192 / 2048 = 4, 4 * 8).
        let v2 = b2.modality(Modality::Video).unwrap();
        assert_eq!((v2.max_items_per_prompt, v2.max_items_per_batch), (8, 4));
    }

    #[test]
    fn bytes() {
        let b = EncoderBudget::new(
            &config(8192),
            &[(Modality::Image, ModalityLimits::new(100))],
        )
        .unwrap();
        assert_eq!(b.cache_bytes(3584, 2).unwrap(), 8192 * 3584 * 2);
        assert_eq!(b.compute_bytes(1280, 4).unwrap(), 8192 * 1280 * 4);
        assert!(matches!(
            tokens_to_bytes(u64::MAX, 2, 1),
            Err(BudgetError::Overflow { .. })
        ));
    }

    #[test]
    fn zero_settings_are_refused() {
        assert!(matches!(
            EncoderBudget::new(&config(0), &[]),
            Err(BudgetError::Zero { .. })
        ));
    }
}
