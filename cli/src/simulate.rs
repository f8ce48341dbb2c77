//! `iris simulate`: capacity planning on recorded or synthetic traffic.
//!
//! The workload runs through the real scheduler, budget and encoder cache manager with sizes only
//! (no encoder runs, no device). The README's "Capacity planning with `iris simulate`" gives the
//! workload format and how to read the summary to size `--encoder-cache-size`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use iris_core::budget::{
    DEFAULT_KV_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Policy,
    SchedulerConfig,
};
use iris_core::simulate::{SimulationSummary, SizeOnlyOutputs, parse_workload, simulate};

/// Flags of `iris simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Workload file, JSON Lines: one request per line.
    #[arg(long, value_name = "FILE.jsonl")]
    pub workload: PathBuf,
    /// Tokens scheduled per step, all requests together.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: u64,
    /// Requests running at once.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: u64,
    /// Encoder cache size in embedding tokens (default: --max-num-batched-tokens; never less
    /// than the workload's largest item).
    #[arg(long, value_name = "N")]
    pub encoder_cache_size: Option<u64>,
    /// Never split a multimodal item across steps.
    #[arg(long)]
    pub disable_chunked_mm_input: bool,
    /// Scheduler rules: `vllm` (vLLM 0.33.0 step for step, stalls included) or `progress`
    /// (every request completes). Default: the config file's `[scheduler] policy`, else `vllm`.
    #[arg(long, value_name = "POLICY")]
    pub scheduler_policy: Option<Policy>,
    /// Tokens per KV-cache block.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_KV_BLOCK_SIZE)]
    pub kv_block_size: u64,
    /// KV-cache blocks, counted as vLLM's num_gpu_blocks (one is the null block); when set,
    /// requests are preempted as vLLM preempts them. Default: unlimited.
    #[arg(long, value_name = "N")]
    pub num_kv_blocks: Option<u64>,
    /// Write one JSON line per step to this file.
    #[arg(long, value_name = "FILE.jsonl")]
    pub steps_out: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `iris simulate`; `configured` is the config file's scheduler policy, if any.
pub fn run(args: &SimulateArgs, configured: Option<Policy>) -> Result<()> {
    let text = std::fs::read_to_string(&args.workload)
        .with_context(|| format!("reading workload {}", args.workload.display()))?;
    let workload = parse_workload(&text)
        .with_context(|| format!("in workload {}", args.workload.display()))?;
    let config = SchedulerConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        encoder_cache_size: args.encoder_cache_size,
        disable_chunked_mm_input: args.disable_chunked_mm_input,
        policy: args.scheduler_policy.or(configured).unwrap_or_default(),
        kv_block_size: args.kv_block_size,
        num_kv_blocks: args.num_kv_blocks,
        ..SchedulerConfig::default()
    };
    let mut steps_out = match &args.steps_out {
        Some(path) => Some(BufWriter::new(
            File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => None,
    };
    let summary = simulate(
        &workload,
        &config,
        None,
        &mut SizeOnlyOutputs::default(),
        |record| {
            if let Some(out) = steps_out.as_mut() {
                serde_json::to_writer(&mut *out, record).map_err(|e| e.to_string())?;
                out.write_all(b"\n").map_err(|e| e.to_string())?;
            }
            Ok(())
        },
    )
    .with_context(|| format!("in workload {}", args.workload.display()))?;
    if let (Some(mut out), Some(path)) = (steps_out, args.steps_out.as_ref()) {
        out.flush()
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    if args.json {
        serde_json::to_writer_pretty(&mut stdout, &summary)?;
        writeln!(stdout)?;
    } else {
        print_summary(&mut stdout, &summary, args.encoder_cache_size)?;
    }
    Ok(())
}

fn print_summary(
    out: &mut impl Write,
    s: &SimulationSummary,
    requested_cache: Option<u64>,
) -> std::io::Result<()> {
    writeln!(out, "scheduler policy         {}", s.policy)?;
    writeln!(out, "requests                 {}", s.num_requests)?;
    writeln!(out, "steps                    {}", s.steps)?;
    writeln!(out, "scheduled tokens         {}", s.scheduled_tokens)?;
    writeln!(
        out,
        "encoder tokens computed  {}",
        s.encoder_tokens_computed
    )?;
    writeln!(out, "encoder runs             {}", s.encoder_runs)?;
    writeln!(out, "encoder cache hits       {}", s.hits)?;
    writeln!(out, "evictions                {}", s.evictions)?;
    writeln!(out, "preemptions              {}", s.preemptions)?;
    write!(
        out,
        "peak cache use           {} of {} embedding tokens",
        s.peak_cache_use, s.encoder_cache_size
    )?;
    match requested_cache {
        Some(n) if n < s.encoder_cache_size => writeln!(
            out,
            " (raised from --encoder-cache-size {n} to fit the largest item)"
        )?,
        _ => writeln!(out)?,
    }
    writeln!(
        out,
        "encoder compute budget   {} per step",
        s.encoder_compute_budget
    )?;
    writeln!(
        out,
        "latency (steps)          mean {:.2}, max {}",
        s.mean_latency_steps, s.max_latency_steps
    )?;
    writeln!(out, "finishing steps:")?;
    for r in &s.requests {
        let verb = if r.aborted { "aborted " } else { "finished" };
        writeln!(
            out,
            "  {:<20} arrived {:>6}  {verb} {:>6}",
            r.id, r.arrival_step, r.finish_step
        )?;
    }
    Ok(())
}
