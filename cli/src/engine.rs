//! Starting the engine from flags, for `iris serve` and `iris bench`, and the engine as the HTTP
//! layer's [`http::Engine`].

use std::future::Future;

use anyhow::Context;
use clap::Args;
use iris_core::budget::{Policy, SchedulerConfig};
use iris_core::engine::{DEFAULT_PROCESSOR_CACHE_BYTES, Engine, EngineConfig};
use iris_core::profile::DEFAULT_DEVICE_MEMORY_UTILIZATION;

use crate::encode::ModelArgs;
use crate::http::engine_api::{EncodeOptions, EngineError, ImageInput, ImageResult};
use crate::http::{self, MetricsSnapshot, ResetReport};
use crate::settings::{GlobalArgs, discover};

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
    #[arg(long, default_value_t = DEFAULT_DEVICE_MEMORY_UTILIZATION)]
    pub device_memory_utilization: f64,
    /// Processor cache size in GiB of preprocessed pixels (0 disables it).
    #[arg(long, default_value_t = DEFAULT_PROCESSOR_CACHE_BYTES as f64 / f64::from(1u32 << 30))]
    pub mm_processor_cache_gb: f64,
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
        let mut config = EngineConfig::new(self.model.spec()?, self.model.weight_source()?);
        config.dtype = self.model.dtype()?;
        config.scheduler = self.scheduler();
        config.device_memory_utilization = self.device_memory_utilization;
        // Rounded down to whole bytes; the bound is a budget, not an exact figure.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bytes = (gib * f64::from(1u32 << 30)) as u64;
        config.processor_cache_bytes = bytes;
        Ok(config)
    }

    /// Opens the configured device and starts the engine on it (start-up profiling included).
    ///
    /// # Errors
    /// Configuration, device selection or start-up failures, with the numbers.
    pub fn start(&self, global: &GlobalArgs) -> anyhow::Result<Engine> {
        let mut engine_config = self.engine_config()?;
        let config = global.config()?;
        if self.scheduler_policy.is_none() {
            engine_config.scheduler.policy = config.scheduler_policy.unwrap_or_default();
        }
        let device = discover(&config).open_selected(&config)?;
        Engine::start(engine_config, device).context("the engine did not start")
    }
}

/// One line on what the engine started with, for the terminal.
pub fn startup_line(engine: &Engine) -> String {
    let info = engine.info_json();
    let p = engine.startup();
    let mib = |b: u64| b as f64 / 1_048_576.0;
    format!(
        "engine: model {} ({}) on {} [{}], weights {:.1} MiB, peak activation {:.1} MiB, encoder cache {} tokens ({:.1} MiB), device used {:.1} MiB before start, {:.1} MiB after",
        info["model"].as_str().unwrap_or("?"),
        info["dtype"].as_str().unwrap_or("?"),
        info["device"].as_str().unwrap_or("?"),
        info["plugin"].as_str().unwrap_or("?"),
        mib(p.weights_bytes),
        mib(p.peak_activation_bytes),
        p.encoder_cache_tokens,
        mib(p.encoder_cache_bytes),
        mib(p.before_start.device_used),
        mib(p.after_start.device_used),
    )
}

impl http::Engine for Engine {
    fn encode(
        &self,
        images: Vec<ImageInput>,
        opts: EncodeOptions,
    ) -> impl Future<Output = Result<Vec<ImageResult>, EngineError>> + Send {
        Engine::encode(self, images, opts)
    }

    fn reset_mm_cache(&self) -> impl Future<Output = ResetReport> + Send {
        std::future::ready(Engine::reset_mm_cache(self))
    }

    fn reset_encoder_cache(&self) -> impl Future<Output = ResetReport> + Send {
        Engine::reset_encoder_cache(self)
    }

    fn reset_allocator(&self) -> impl Future<Output = ResetReport> + Send {
        Engine::reset_allocator(self)
    }

    fn reset_all(&self) -> impl Future<Output = ResetReport> + Send {
        Engine::reset_all(self)
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
