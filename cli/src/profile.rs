//! `iris profile`: the start-up memory report (weights, peak activation, non-allocator growth,
//! encoder cache size, memory available under `--device-memory-utilization`), with how the
//! peak was found (`--profile dry` or `real`) and how long each phase took.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use iris_core::budget::SchedulerConfig;
use iris_core::memory::CachingAllocator;
use iris_core::profile::{
    DEFAULT_DEVICE_MEMORY_UTILIZATION, ProfileMode, ProfileRequest, WarmUpMode, profile_startup,
};

use crate::encode::ModelArgs;
use crate::settings::{GlobalArgs, print_stdout, registry};

/// Arguments of `iris profile`.
#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens scheduled per step; the encoder budget derives from it.
    #[arg(long, default_value_t = SchedulerConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: u64,
    /// Requests running at once.
    #[arg(long, default_value_t = SchedulerConfig::default().max_num_seqs)]
    max_num_seqs: u64,
    /// Encoder cache size in embedding tokens (default: --max-num-batched-tokens, at least one
    /// largest item).
    #[arg(long)]
    encoder_cache_size: Option<u64>,
    /// Share of the device's total memory iris may use, in (0, 1].
    #[arg(long, default_value_t = DEFAULT_DEVICE_MEMORY_UTILIZATION, value_parser = crate::engine::utilization)]
    device_memory_utilization: f64,
    /// How the largest step is sized: `dry` walks the tower's ops at that size with compute
    /// skipped, allocating as a real run does (seconds on any device); `real` runs it on the
    /// device and measures it (seconds on an accelerator, far longer on a CPU).
    #[arg(long = "profile", value_name = "MODE", default_value_t = ProfileMode::Dry)]
    profile_mode: ProfileMode,
    /// Whether start-up runs the tower once at each size of a ladder of steps before serving:
    /// `auto` (when the device asks for it, as the CUDA device does: it chooses and loads
    /// kernels by problem size on first use), `on` or `off`.
    #[arg(long = "warm-up", value_name = "MODE", default_value_t = WarmUpMode::Auto)]
    warm_up: WarmUpMode,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    mm_limits: crate::engine::MmLimitArgs,
}

/// Runs `iris profile`.
pub fn run(global: &GlobalArgs, args: &ProfileArgs) -> anyhow::Result<ExitCode> {
    let dtype = args.model.dtype()?;
    let spec = args.model.spec()?;
    let weights = args.model.weight_source()?;
    let mut scheduler = SchedulerConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        encoder_cache_size: args.encoder_cache_size,
        ..SchedulerConfig::default()
    };
    args.mm_limits.apply(&mut scheduler)?;
    let video = spec
        .video_processing(args.model.model_dir.as_deref())
        .context("the model's video processor settings")?;
    let config = global.config()?;
    let device = registry(&config).open_selected(&config)?;
    let device_name = format!("{} ({})", device.description().name, device.plugin().name());
    let on_host = device.plugin().name() == iris_device_cpu::NAME;
    let allocator = CachingAllocator::new(Arc::new(device));
    let request = ProfileRequest {
        spec: spec.clone(),
        weights,
        dtype,
        scheduler,
        device_memory_utilization: args.device_memory_utilization,
        mode: args.profile_mode,
        warm_up: args.warm_up,
        progress: crate::progress::startup_progress(),
        video,
    };
    let (tower, report) =
        profile_startup(&allocator, &request).context("start-up profiling failed")?;
    drop(tower);
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["model"] = serde_json::Value::from(spec.name.clone());
        value["device"] = serde_json::Value::from(device_name);
        value["dtype"] = serde_json::Value::from(dtype.to_string());
        value["process_peak_resident_bytes"] = serde_json::Value::from(peak_resident());
        print_stdout(&format!("{}\n", serde_json::to_string_pretty(&value)?))?;
        return Ok(ExitCode::SUCCESS);
    }
    let mib = |bytes: u64| format!("{bytes} B ({:.1} MiB)", bytes as f64 / 1_048_576.0);
    let grid = report.max_item_grid;
    let mut lines = vec![
        format!(
            "model                      {} in {dtype} on {device_name}",
            spec.name
        ),
        format!(
            "device total               {}",
            mib(report.before_start.device_total)
        ),
        format!(
            "device used before start   {}",
            mib(report.before_start.device_used)
        ),
        format!(
            "device used after start    {}",
            mib(report.after_start.device_used)
        ),
        format!("weights                    {}", mib(report.weights_bytes)),
        format!(
            "largest item               {} grid {grid:?}, {} tokens; {} per batch (the {} set the peak)",
            report.max_item_modality,
            report.max_item_tokens,
            report.items_per_batch,
            report.max_item_modality
        ),
        format!(
            "largest item per modality  {}",
            report
                .modality_max_tokens
                .iter()
                .map(|(m, t)| format!("{m} {t} tokens"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!(
            "peak activation            {} ({} profile)",
            mib(report.peak_activation_bytes),
            report.mode
        ),
        format!(
            "live tensors at the peak   {} (the arena is {:.3}x)",
            mib(report.planned_peak_activation_bytes),
            report.peak_activation_bytes as f64
                / report.planned_peak_activation_bytes.max(1) as f64
        ),
        format!(
            "step outputs               {} (to the encoder cache)",
            mib(report.step_outputs_bytes)
        ),
        format!(
            "non-allocator growth       {}",
            mib(report.non_allocator_growth_bytes)
        ),
        format!(
            "encoder compute budget     {} tokens per step",
            report.encoder_compute_budget
        ),
        format!(
            "encoder cache              {} tokens, {}",
            report.encoder_cache_tokens,
            mib(report.encoder_cache_bytes)
        ),
        format!(
            "requested memory           {} ({} of total)",
            mib(report.requested_bytes),
            args.device_memory_utilization
        ),
        format!("available                  {}", mib(report.available_bytes)),
        format!(
            "start-up time              weights {:.1} s loaded + {:.1} s uploaded, profile {:.1} s, warm-up {:.1} s ({} step sizes)",
            report.timings.read_weights_s,
            report.timings.upload_weights_s,
            report.timings.profile_s,
            report.timings.warm_up_s,
            report.warm_up_steps.len()
        ),
    ];
    if let Some(peak) = peak_resident() {
        lines.push(format!("process peak resident      {}", mib(peak)));
    }
    if on_host {
        lines.push(
            "note: the CPU device's memory is this process's memory: the weights above are all \
             of their copies (host copies go as they upload, packed weights replace their \
             buffers' pages)"
                .to_owned(),
        );
    }
    print_stdout(&(lines.join("\n") + "\n"))?;
    Ok(ExitCode::SUCCESS)
}

/// The process's peak resident memory (`VmHWM` in /proc/self/status), where the OS reports it.
fn peak_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
