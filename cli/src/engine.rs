//! Starting the engine from flags, for `iris serve` and `iris bench`, and the engine as the HTTP
//! layer's [`http::Engine`].

use std::future::Future;

use anyhow::Context;
use clap::Args;
use iris_core::budget::{Policy, SchedulerConfig};
use iris_core::engine::admission::{AdmissionConfig, Permit, PermitHold};
use iris_core::engine::liveness::PANIC_AT_STEP_ENV;
use iris_core::engine::{DEFAULT_PROCESSOR_CACHE_BYTES, Engine, EngineConfig};
use iris_core::preprocess::video::ffmpeg::MAX_DECODE_TIME;
use iris_core::profile::{DEFAULT_DEVICE_MEMORY_UTILIZATION, ProfileMode, WarmUpMode};

use crate::encode::ModelArgs;
use crate::http::engine_api::{
    DecodedVideo, EncodeOptions, EngineError, ImagePlan, ImageResult, ImageSize, MediaInput,
    OpenedClip, OutputLayout, ProcessorOverrides, SamplingOptions, VideoProcessing,
};
use crate::http::{self, MetricsSnapshot, ResetReport};
use crate::settings::{GlobalArgs, registry};

/// Flags that shape the engine (names follow vLLM's where the meaning is the same).
#[derive(Debug, Args)]
pub struct EngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens (text and image positions) scheduled per step; the encoder budget derives from it.
    #[arg(long, default_value_t = SchedulerConfig::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: u64,
    /// Requests running at once.
    #[arg(long, default_value_t = SchedulerConfig::default().max_num_seqs)]
    pub max_num_seqs: u64,
    /// Encoder cache size in embedding tokens (default: --max-num-batched-tokens, at least one
    /// largest item).
    #[arg(long)]
    pub encoder_cache_size: Option<u64>,
    /// Never split an image's positions across steps.
    #[arg(long)]
    pub disable_chunked_mm_input: bool,
    /// Scheduler rules: `vllm` (vLLM 0.33.0 step for step) or `progress` (every request
    /// completes). Default: the config file's `[scheduler] policy`, else `vllm`.
    #[arg(long, value_name = "POLICY")]
    pub scheduler_policy: Option<Policy>,
    /// Share of the device's total memory iris may use, in (0, 1]; start-up is refused when
    /// less than that is free.
    #[arg(long, default_value_t = DEFAULT_DEVICE_MEMORY_UTILIZATION, value_parser = utilization)]
    pub device_memory_utilization: f64,
    /// How start-up sizes the largest step: `dry` walks the tower's ops at that size with
    /// compute skipped, allocating as a real run does (seconds on any device); `real` runs it
    /// on the device and measures it (seconds on an accelerator, far longer on a CPU).
    #[arg(long = "profile", value_name = "MODE", default_value_t = ProfileMode::Dry)]
    pub profile_mode: ProfileMode,
    /// Whether start-up runs the tower once at each size of a ladder of steps before serving:
    /// `auto` (when the device asks for it, as the CUDA device does: it chooses and loads
    /// kernels by problem size on first use), `on` or `off`.
    #[arg(long = "warm-up", value_name = "MODE", default_value_t = WarmUpMode::Auto)]
    pub warm_up: WarmUpMode,
    /// Processor cache size in GiB of preprocessed pixels (0 disables it).
    #[arg(long, default_value_t = DEFAULT_PROCESSOR_CACHE_BYTES as f64 / f64::from(1u32 << 30))]
    pub mm_processor_cache_gb: f64,
    /// Most requests admitted and not finished (preprocessing, queued or running); more get
    /// 503 `overloaded` with `Retry-After`. Default: 2 x --max-num-seqs; at least 1.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_queued_requests: Option<u64>,
    /// Most embedding tokens of images admitted and not finished (estimated from the image
    /// headers, before decoding); more get 503 `overloaded`. A request alone is always
    /// admitted. Default: 4 x --max-num-batched-tokens.
    #[arg(long, value_name = "TOKENS")]
    pub max_pending_tokens: Option<u64>,
    /// Longest the FFmpeg programs may spend on one video, probing and decoding every frame up
    /// to the last one sampled, in seconds; past it they are stopped and the video refused.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = MAX_DECODE_TIME.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub video_decode_timeout: u64,
    #[command(flatten)]
    pub mm_limits: MmLimitArgs,
}

/// Flags that bound the multimodal items of a prompt (vLLM's), which the start-up profile
/// sizes the largest item from.
#[derive(Debug, Clone, Default, Args)]
pub struct MmLimitArgs {
    /// Items of each modality one request may carry, as vLLM's flag: JSON such as
    /// `{"image": 16, "video": 0}` (or `{"video": {"count": 0}}`); 999 for a modality not named.
    /// A modality at 0 is refused and left out of the start-up profile: `{"video": 0}` sizes
    /// the engine for images only (vLLM profiles Qwen2/2.5-VL with a 14-frame video).
    #[arg(long, value_name = "JSON")]
    pub limit_mm_per_prompt: Option<String>,
    /// The language model's context, in tokens: bounds the frames of the largest video the
    /// profile sizes (Qwen2/2.5-VL), as vLLM's `--max-model-len`. Default: no bound (the
    /// 14-frame cap decides).
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<u64>,
}

impl MmLimitArgs {
    /// Applies the flags to `scheduler`.
    ///
    /// # Errors
    /// A `--limit-mm-per-prompt` that is not such a JSON object, or a zero `--max-model-len`.
    pub fn apply(&self, scheduler: &mut SchedulerConfig) -> anyhow::Result<()> {
        if let Some(len) = self.max_model_len {
            anyhow::ensure!(len > 0, "--max-model-len must be at least 1");
            scheduler.max_model_len = len;
        }
        let Some(text) = &self.limit_mm_per_prompt else {
            return Ok(());
        };
        let value: serde_json::Value = serde_json::from_str(text)
            .with_context(|| format!("--limit-mm-per-prompt is not JSON: {text}"))?;
        let serde_json::Value::Object(map) = value else {
            anyhow::bail!("--limit-mm-per-prompt must be a JSON object such as {{\"video\": 0}}");
        };
        for (key, value) in &map {
            let count = match value {
                serde_json::Value::Object(options) => {
                    if let Some(other) = options.keys().find(|k| *k != "count") {
                        anyhow::bail!(
                            "--limit-mm-per-prompt {key}.{other}: iris takes only `count` (the dummy-item options of vLLM's profile are not supported)"
                        );
                    }
                    options.get("count").and_then(serde_json::Value::as_u64)
                }
                other => other.as_u64(),
            }
            .with_context(|| {
                format!("--limit-mm-per-prompt {key} must be a count (0 or more), got {value}")
            })?;
            match key.as_str() {
                "image" => scheduler.limit_mm_per_prompt.image = count,
                "video" => scheduler.limit_mm_per_prompt.video = count,
                other => {
                    anyhow::bail!("--limit-mm-per-prompt {other}: iris takes image and video items")
                }
            }
        }
        anyhow::ensure!(
            scheduler.limit_mm_per_prompt.image > 0 || scheduler.limit_mm_per_prompt.video > 0,
            "--limit-mm-per-prompt leaves no modality: at least one of image and video must be above 0"
        );
        Ok(())
    }
}

impl EngineArgs {
    /// The scheduler settings the flags describe.
    pub fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            encoder_cache_size: self.encoder_cache_size,
            disable_chunked_mm_input: self.disable_chunked_mm_input,
            policy: self.scheduler_policy.unwrap_or_default(),
            ..SchedulerConfig::default()
        }
    }

    /// The engine configuration the flags describe.
    ///
    /// # Errors
    /// A bad dtype, model, weight list or cache size.
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        let gib = self.mm_processor_cache_gb;
        if !gib.is_finite() || gib < 0.0 {
            anyhow::bail!("--mm-processor-cache-gb must be 0 or more, got {gib}");
        }
        let spec = self.model.spec()?;
        let video = spec
            .video_processing(self.model.model_dir.as_deref())
            .context("the model's video processor settings")?;
        let mut config = EngineConfig::new(spec, self.model.weight_source()?);
        config.video = video;
        config.dtype = self.model.dtype()?;
        config.scheduler = self.scheduler();
        self.mm_limits.apply(&mut config.scheduler)?;
        config.device_memory_utilization = self.device_memory_utilization;
        config.profile_mode = self.profile_mode;
        config.warm_up = self.warm_up;
        config.progress = crate::progress::startup_progress();
        // Rounded down to whole bytes; the bound is a budget, not an exact figure.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bytes = (gib * f64::from(1u32 << 30)) as u64;
        config.processor_cache_bytes = bytes;
        config.admission = AdmissionConfig {
            max_queued_requests: self.max_queued_requests,
            max_pending_tokens: self.max_pending_tokens,
        };
        config.video_limits.max_decode_time =
            std::time::Duration::from_secs(self.video_decode_timeout);
        config.panic_at_step = panic_at_step_from_env()?;
        Ok(config)
    }

    /// Opens the configured device and starts the engine on it (start-up profiling included).
    ///
    /// # Errors
    /// Configuration, device selection or start-up failures, with the numbers.
    pub fn start(&self, global: &GlobalArgs) -> anyhow::Result<Engine> {
        self.start_with(global, |_| {})
    }

    /// [`EngineArgs::start`] with the resolved configuration adjusted first (e.g. a device's
    /// fault options for `iris bench --inject-faults`).
    ///
    /// # Errors
    /// Those of [`EngineArgs::start`].
    pub fn start_with(
        &self,
        global: &GlobalArgs,
        adjust: impl FnOnce(&mut iris_core::config::Config),
    ) -> anyhow::Result<Engine> {
        self.start_with_admission(global, adjust, AdmissionConfig::default())
    }

    /// [`EngineArgs::start_with`], with `fallback`'s bounds in place of the engine's defaults
    /// wherever neither a flag nor the config file sets one (`iris bench` sizes them for its
    /// workload). A bound the user set is always kept.
    ///
    /// # Errors
    /// Those of [`EngineArgs::start`].
    pub fn start_with_admission(
        &self,
        global: &GlobalArgs,
        adjust: impl FnOnce(&mut iris_core::config::Config),
        fallback: AdmissionConfig,
    ) -> anyhow::Result<Engine> {
        let mut engine_config = self.engine_config()?;
        let mut config = global.config()?;
        adjust(&mut config);
        if self.scheduler_policy.is_none() {
            engine_config.scheduler.policy = config.scheduler_policy.unwrap_or_default();
        }
        let admission = &mut engine_config.admission;
        admission.max_queued_requests = admission
            .max_queued_requests
            .or(config.admission.max_queued_requests)
            .or(fallback.max_queued_requests);
        admission.max_pending_tokens = admission
            .max_pending_tokens
            .or(config.admission.max_pending_tokens)
            .or(fallback.max_pending_tokens);
        let device = registry(&config).open_selected(&config)?;
        Engine::start(engine_config, device).context("the engine did not start")
    }
}

/// The fault-injection step of [`PANIC_AT_STEP_ENV`], when set.
fn panic_at_step_from_env() -> anyhow::Result<Option<u64>> {
    match std::env::var(PANIC_AT_STEP_ENV) {
        Ok(value) if !value.trim().is_empty() => {
            let step = value.trim().parse::<u64>().ok().filter(|s| *s > 0);
            let step = step.with_context(|| {
                format!("{PANIC_AT_STEP_ENV} must be a step number from 1, got {value:?}")
            })?;
            eprintln!(
                "iris: fault injection: the engine core will panic at step {step} ({PANIC_AT_STEP_ENV})"
            );
            Ok(Some(step))
        }
        _ => Ok(None),
    }
}

/// One line on what the engine started with, for the terminal.
pub fn startup_line(engine: &Engine) -> String {
    let info = engine.info_json();
    let p = engine.startup();
    let mib = |b: u64| b as f64 / 1_048_576.0;
    let t = p.timings;
    let warm_up = if p.warm_up_steps.is_empty() {
        String::new()
    } else {
        format!(
            ", warm-up {:.1} s at {} step sizes",
            t.warm_up_s,
            p.warm_up_steps.len()
        )
    };
    format!(
        "engine: model {} ({}) on {} [{}], weights {:.1} MiB, peak activation {:.1} MiB ({} profile), encoder cache {} tokens ({:.1} MiB), device used {:.1} MiB before start, {:.1} MiB after; started in {:.1} s (weights {:.1} s, profile {:.1} s{warm_up})",
        info["model"].as_str().unwrap_or("?"),
        info["dtype"].as_str().unwrap_or("?"),
        info["device"].as_str().unwrap_or("?"),
        info["plugin"].as_str().unwrap_or("?"),
        mib(p.weights_bytes),
        mib(p.peak_activation_bytes),
        p.mode,
        p.encoder_cache_tokens,
        mib(p.encoder_cache_bytes),
        mib(p.before_start.device_used),
        mib(p.after_start.device_used),
        t.read_weights_s + t.upload_weights_s + t.profile_s + t.warm_up_s,
        t.read_weights_s + t.upload_weights_s,
        t.profile_s,
    )
}

/// Runs a reset only on an engine whose device answers (a lost device's reset would report
/// figures it could not measure); a core that dies during the call is the reset's own error.
async fn checked_reset(
    engine: &Engine,
    reset: impl Future<Output = Result<ResetReport, EngineError>>,
) -> Result<ResetReport, EngineError> {
    engine.health()?;
    reset.await
}

impl http::Engine for Engine {
    type Permit = Permit;
    type Hold = PermitHold;

    fn hold(&self, permit: &Permit) -> PermitHold {
        permit.hold()
    }

    fn admit(&self) -> Result<Permit, EngineError> {
        Engine::admit(self)
    }

    fn encode(
        &self,
        permit: Permit,
        items: Vec<MediaInput>,
        opts: EncodeOptions,
    ) -> impl Future<Output = Result<Vec<ImageResult>, EngineError>> + Send {
        Engine::encode_admitted(self, permit, items, opts)
    }

    fn plan(
        &self,
        permit: &mut Permit,
        items: &[MediaInput],
        overrides: &ProcessorOverrides,
    ) -> impl Future<Output = Result<Vec<ImagePlan>, EngineError>> + Send {
        Engine::plan_admitted(self, permit, items, overrides)
    }

    fn open_video(
        &self,
        bytes: Vec<u8>,
        sampling: SamplingOptions,
    ) -> impl Future<Output = Result<OpenedClip, EngineError>> + Send {
        Engine::open_video(self, bytes, sampling)
    }

    fn reserve_video(
        &self,
        permit: &mut Permit,
        index: usize,
        frames: usize,
        size: ImageSize,
        overrides: &ProcessorOverrides,
    ) -> Result<(), EngineError> {
        Engine::reserve_video(self, permit, index, frames, size, overrides)
    }

    fn decode_video(
        &self,
        clip: OpenedClip,
        hold: PermitHold,
    ) -> impl Future<Output = Result<DecodedVideo, EngineError>> + Send {
        Engine::decode_video(self, clip, Some(hold))
    }

    fn video_processing(&self) -> VideoProcessing {
        Engine::video_processing(self).clone()
    }

    fn output_layout(&self) -> OutputLayout {
        Engine::output_layout(self)
    }

    fn health(&self) -> Result<(), EngineError> {
        Engine::health(self)
    }

    fn reset_mm_cache(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send {
        checked_reset(self, std::future::ready(Ok(Engine::reset_mm_cache(self))))
    }

    fn reset_encoder_cache(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send {
        checked_reset(self, Engine::reset_encoder_cache(self))
    }

    fn reset_allocator(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send {
        checked_reset(self, Engine::reset_allocator(self))
    }

    fn reset_all(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send {
        checked_reset(self, Engine::reset_all(self))
    }

    fn sleep(&self, level: u8) -> impl Future<Output = Result<ResetReport, EngineError>> + Send {
        Engine::sleep(self, level)
    }

    fn wake_up(&self) -> impl Future<Output = Result<(), EngineError>> + Send {
        Engine::wake_up(self)
    }

    fn is_sleeping(&self) -> bool {
        Engine::is_sleeping(self)
    }

    fn memory(&self) -> serde_json::Value {
        self.memory_json()
    }

    fn server_info(&self) -> serde_json::Value {
        self.info_json()
    }

    fn metrics_snapshot(&self) -> MetricsSnapshot {
        Engine::metrics_snapshot(self)
    }
}

/// `--device-memory-utilization`: a share in (0, 1], checked before any device is opened (on
/// CUDA an open compiles kernels and checks attention engines first).
pub(crate) fn utilization(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!(
            "expected a share of the device's memory in (0, 1], got `{text}`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn the_video_decode_time_limit_reaches_the_engine() {
        let config = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("iris").chain(args.iter().copied()))
                .expect("the flags parse")
                .engine
                .engine_config()
                .expect("a configuration")
        };
        assert_eq!(config(&[]).video_limits.max_decode_time, MAX_DECODE_TIME);
        assert_eq!(
            config(&["--video-decode-timeout", "7"])
                .video_limits
                .max_decode_time,
            std::time::Duration::from_secs(7)
        );
        assert!(Flags::try_parse_from(["iris", "--video-decode-timeout", "0"]).is_err());
    }
}
