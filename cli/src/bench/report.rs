//! The bench report: memory checkpoints and verdict, cache figures, the text printout and
//! `--result-json`.
//!
//! The verdict compares the checkpoint after `reset_all` with the one after start-up:
//! `leaked_bytes` is the largest growth of device used, allocator reserved and allocator
//! allocated bytes (0 when none grew), and memory "returns to the baseline" exactly when it is 0.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};

use super::faults::FaultReport;
use super::stats::RunStats;
use crate::http::MemoryGauges;

/// Device memory at one instant, as the bench records it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryPoint {
    /// Device used (total - free).
    pub device_used_bytes: u64,
    /// Bytes the caching allocator holds from the device.
    pub allocator_reserved_bytes: u64,
    /// Bytes handed out to live tensors.
    pub allocator_allocated_bytes: u64,
    /// Device bytes held by the encoder cache.
    pub encoder_cache_bytes: u64,
    /// Device bytes the plugin holds outside the allocator (context, streams, allocation
    /// padding and page rounding).
    #[serde(default)]
    pub plugin_held_bytes: u64,
}

impl From<MemoryGauges> for MemoryPoint {
    fn from(g: MemoryGauges) -> Self {
        Self {
            device_used_bytes: g.device_used_bytes,
            allocator_reserved_bytes: g.allocator_reserved_bytes,
            allocator_allocated_bytes: g.allocator_allocated_bytes,
            encoder_cache_bytes: g.encoder_cache_bytes,
            plugin_held_bytes: g.plugin_held_bytes,
        }
    }
}

/// A memory point on the run's clock (seconds since the load started; negative before it).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TimedPoint {
    /// Seconds since the load phase started.
    pub t_s: f64,
    /// The figures.
    pub point: MemoryPoint,
}

/// The four checkpoints of a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryCheckpoints {
    /// Before the engine loaded anything.
    pub before_start: MemoryPoint,
    /// After start-up: the baseline.
    pub after_start: MemoryPoint,
    /// After the last request completed.
    pub after_load: MemoryPoint,
    /// After `reset_all`.
    pub after_reset: MemoryPoint,
}

impl MemoryCheckpoints {
    /// `(label, json key, point)` for each checkpoint, in order.
    pub fn rows(&self) -> [(&'static str, &'static str, MemoryPoint); 4] {
        [
            ("before start", "before_start", self.before_start),
            ("after start", "after_start", self.after_start),
            ("after load", "after_load", self.after_load),
            ("after reset", "after_reset", self.after_reset),
        ]
    }
}

/// Whether memory came back to the post-start baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// True when nothing grew between after start and after reset.
    pub returned: bool,
    /// The largest growth among device used, allocator reserved and allocator allocated.
    pub leaked_bytes: u64,
}

/// Computes the verdict from the checkpoints.
pub fn verdict(c: &MemoryCheckpoints) -> Verdict {
    let (base, end) = (c.after_start, c.after_reset);
    let leaked_bytes = [
        end.device_used_bytes.saturating_sub(base.device_used_bytes),
        end.allocator_reserved_bytes
            .saturating_sub(base.allocator_reserved_bytes),
        end.allocator_allocated_bytes
            .saturating_sub(base.allocator_allocated_bytes),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    Verdict {
        returned: leaked_bytes == 0,
        leaked_bytes,
    }
}

/// The verdict line: `memory after reset returns to the post-start baseline: yes|no (+N bytes)`.
pub fn verdict_line(v: &Verdict) -> String {
    let answer = if v.returned {
        "yes".to_owned()
    } else {
        format!("no (+{} bytes)", v.leaked_bytes)
    };
    format!("memory after reset returns to the post-start baseline: {answer}")
}

/// Cumulative cache counters as the engine reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Processor cache hits.
    pub processor_hits: u64,
    /// Processor cache misses.
    pub processor_misses: u64,
    /// Processor cache evictions.
    pub processor_evictions: u64,
    /// Encoder cache hits.
    pub encoder_hits: u64,
    /// Encoder cache misses.
    pub encoder_misses: u64,
    /// Encoder cache evictions.
    pub encoder_evictions: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Time in steps, ns.
    pub step_time_ns: u64,
    /// Time in the tower's forward passes, ns.
    pub encoder_time_ns: u64,
    /// FLOPs of those forward passes.
    pub encoder_flops: u64,
    /// The device's dense FLOP/s at the engine's dtype, if it reports one.
    pub peak_flops: Option<u64>,
}

/// Where the engine's step time went during the load.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepStats {
    /// Steps run.
    pub steps: u64,
    /// Seconds in steps.
    pub step_time_s: f64,
    /// Seconds of that in the vision tower.
    pub encoder_time_s: f64,
    /// Share of step time outside the tower (scheduling, cache upkeep, gathering, delivery),
    /// from 0 to 1; 0 without steps.
    pub overhead_share: f64,
    /// FLOPs of the tower's forward passes (the tower's FLOP count, as the GPU check counts).
    pub encoder_flops: u64,
    /// Those FLOPs over the encoder's time, in TFLOP/s; 0 without encoder time.
    pub encoder_tflops: f64,
    /// The peak they are held against, in TFLOP/s: `--peak-tflops`, else the device's
    /// `peak_flops` at the engine's dtype; `None` when neither gives one.
    pub peak_tflops: Option<f64>,
    /// Where the peak came from: `device` or `--peak-tflops`.
    pub peak_source: Option<&'static str>,
    /// `encoder_tflops / peak_tflops`.
    pub peak_share: Option<f64>,
}

impl StepStats {
    /// Figures for the load phase from counters read before and after it; `peak_tflops`, when
    /// given, replaces the device's peak.
    pub fn between(
        before: &EngineCounters,
        after: &EngineCounters,
        peak_tflops: Option<f64>,
    ) -> Self {
        let step_ns = after.step_time_ns.saturating_sub(before.step_time_ns);
        let encoder_ns = after.encoder_time_ns.saturating_sub(before.encoder_time_ns);
        let overhead_share = if step_ns == 0 {
            0.0
        } else {
            step_ns.saturating_sub(encoder_ns) as f64 / step_ns as f64
        };
        let encoder_flops = after.encoder_flops.saturating_sub(before.encoder_flops);
        let encoder_tflops = if encoder_ns == 0 {
            0.0
        } else {
            // FLOP per ns is GFLOP/s.
            encoder_flops as f64 / encoder_ns as f64 / 1e3
        };
        let (peak_tflops, peak_source) = match (peak_tflops, after.peak_flops) {
            (Some(given), _) => (Some(given), Some("--peak-tflops")),
            (None, Some(flops)) => (Some(flops as f64 / 1e12), Some("device")),
            (None, None) => (None, None),
        };
        Self {
            steps: after.steps.saturating_sub(before.steps),
            step_time_s: step_ns as f64 / 1e9,
            encoder_time_s: encoder_ns as f64 / 1e9,
            overhead_share,
            encoder_flops,
            encoder_tflops,
            peak_tflops,
            peak_source,
            peak_share: peak_tflops
                .filter(|peak| *peak > 0.0)
                .map(|peak| encoder_tflops / peak),
        }
    }

    /// The report's `encoder:` line: FLOPs, achieved TFLOP/s and their share of the peak.
    pub fn encoder_line(&self) -> String {
        let peak = match (self.peak_tflops, self.peak_share, self.peak_source) {
            (Some(peak), Some(share), Some("device")) => format!(
                "{:.1}% of the device's peak ({peak:.3} TFLOPS at the engine's dtype, its peak_flops)",
                share * 100.0
            ),
            (Some(peak), Some(share), _) => format!(
                "{:.1}% of the peak given by --peak-tflops ({peak:.3} TFLOPS)",
                share * 100.0
            ),
            _ => "no peak to hold it against (the device reports none; --peak-tflops gives one)"
                .to_owned(),
        };
        format!(
            "encoder:    {:.3} TFLOP in {:.2} s of forward passes: {:.3} TFLOPS achieved, {peak}",
            self.encoder_flops as f64 / 1e12,
            self.encoder_time_s,
            self.encoder_tflops
        )
    }
}

/// Cache figures over the load phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CacheStats {
    /// Processor cache hits / lookups during the load (0 without lookups).
    pub processor_hit_rate: f64,
    /// Encoder cache hits / lookups during the load (0 without lookups).
    pub encoder_hit_rate: f64,
    /// Processor cache evictions during the load.
    pub processor_evictions: u64,
    /// Encoder cache evictions during the load.
    pub encoder_evictions: u64,
}

impl CacheStats {
    /// Figures for the load phase from counters read before and after it.
    pub fn between(before: &EngineCounters, after: &EngineCounters) -> Self {
        let rate = |hits: u64, misses: u64| {
            let lookups = hits + misses;
            if lookups == 0 {
                0.0
            } else {
                hits as f64 / lookups as f64
            }
        };
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Self {
            processor_hit_rate: rate(
                d(after.processor_hits, before.processor_hits),
                d(after.processor_misses, before.processor_misses),
            ),
            encoder_hit_rate: rate(
                d(after.encoder_hits, before.encoder_hits),
                d(after.encoder_misses, before.encoder_misses),
            ),
            processor_evictions: d(after.processor_evictions, before.processor_evictions),
            encoder_evictions: d(after.encoder_evictions, before.encoder_evictions),
        }
    }

    /// Evictions of both caches.
    pub fn evictions(&self) -> u64 {
        self.processor_evictions + self.encoder_evictions
    }
}

/// What was run, for the printout and the JSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunInfo {
    /// `in-process` or the server URL.
    pub target: String,
    /// Prompts sent.
    pub num_prompts: usize,
    /// Images per prompt.
    pub images_per_prompt: usize,
    /// Videos per prompt (after its images).
    pub videos_per_prompt: usize,
    /// Distinct images in the workload.
    pub distinct_images: usize,
    /// Distinct videos in the workload.
    pub distinct_videos: usize,
    /// Slots that reuse an earlier prompt's image or video.
    pub repeated_slots: usize,
    /// `--request-rate` as given (`inf` or requests per second).
    pub request_rate: String,
    /// `--max-concurrency`, if any.
    pub max_concurrency: Option<usize>,
    /// `--seed`.
    pub seed: u64,
    /// Requests per second the arrival times offered; `None` when every request was sent at
    /// once (`--request-rate inf`).
    pub offered_requests_per_s: Option<f64>,
}

/// Served below this share of the offered rate, the engine fell behind the load: requests
/// queued faster than they completed. (A run within capacity serves a little below the offered
/// rate only because its last requests still take their own latency.)
pub const SUSTAINED_SHARE: f64 = 0.9;

/// The offered load against what the engine served.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Capacity {
    /// Requests per second offered; `None` for `--request-rate inf`.
    pub offered_requests_per_s: Option<f64>,
    /// Completed requests per second over the load phase.
    pub served_requests_per_s: f64,
    /// Whether requests arrived faster than the engine completed them (always, when every
    /// request is sent at once), so that latency is mostly time spent queueing.
    pub over_capacity: bool,
}

impl Capacity {
    /// The figures of a run that offered `offered` requests per second and produced `stats`.
    pub fn new(offered: Option<f64>, stats: &RunStats) -> Self {
        let served = stats.throughput.requests_per_s;
        Self {
            offered_requests_per_s: offered,
            served_requests_per_s: served,
            over_capacity: offered.is_none_or(|o| served < o * SUSTAINED_SHARE),
        }
    }

    /// The one-line verdict on the load, `mean_step_ms` standing for the time a request needs
    /// without a queue (0 when unknown).
    pub fn line(&self, p50_ms: f64, mean_step_ms: f64) -> String {
        let served = self.served_requests_per_s;
        let queueing = if mean_step_ms > 0.0 {
            format!(
                "latency is dominated by queueing (p50 {p50_ms:.1} ms, a step takes {mean_step_ms:.1} ms)"
            )
        } else {
            format!("latency is dominated by queueing (p50 {p50_ms:.1} ms)")
        };
        match self.offered_requests_per_s {
            None => format!(
                "capacity:   every request offered at once; served {served:.2} requests/s, {queueing}"
            ),
            Some(offered) if self.over_capacity => format!(
                "capacity:   offered {offered:.2} requests/s, served {served:.2}: more than the engine sustains here, so requests queue and {queueing}; a lower --request-rate measures latency within capacity"
            ),
            Some(offered) => format!(
                "capacity:   offered {offered:.2} requests/s, served {served:.2}: within what the engine sustains"
            ),
        }
    }
}

/// Everything a bench run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// What was run.
    pub info: RunInfo,
    /// Requests, latency, throughput.
    pub stats: RunStats,
    /// Cache figures.
    pub cache: CacheStats,
    /// Step time and the engine's share of it.
    pub steps: StepStats,
    /// With `--inject-faults`: how the engine took them.
    pub faults: Option<FaultReport>,
    /// The four checkpoints.
    pub memory: MemoryCheckpoints,
    /// The verdict.
    pub verdict: Verdict,
    /// Memory samples over time, checkpoints included.
    pub timeline: Vec<TimedPoint>,
    /// Times of the four checkpoints on the run's clock, in checkpoint order.
    pub checkpoint_times_s: [f64; 4],
}

impl BenchReport {
    /// The process exit status: 1 when memory does not return to the baseline or, with
    /// `--inject-faults`, when a fault was not handled; else 0.
    pub fn exit_code(&self) -> u8 {
        let faults_handled = self.faults.as_ref().is_none_or(FaultReport::passed);
        u8::from(!self.verdict.returned || !faults_handled)
    }

    /// The offered load against the served one.
    pub fn capacity(&self) -> Capacity {
        Capacity::new(self.info.offered_requests_per_s, &self.stats)
    }

    /// The `--result-json` document.
    pub fn to_json(&self) -> Value {
        let mut memory = serde_json::Map::new();
        for (_, key, p) in self.memory.rows() {
            memory.insert(
                key.into(),
                json!({
                    "device_used_bytes": p.device_used_bytes,
                    "allocator_reserved_bytes": p.allocator_reserved_bytes,
                    "allocator_allocated_bytes": p.allocator_allocated_bytes,
                    "encoder_cache_bytes": p.encoder_cache_bytes,
                }),
            );
        }
        let s = &self.stats;
        json!({
            "config": self.info,
            "requests": {
                "completed": s.completed,
                "refused": s.refused,
                "aborted": s.aborted,
                "failed": s.failed,
                "errors": s.errors,
            },
            "capacity": self.capacity(),
            "images": { "completed": s.images, "cached": s.cached_images },
            "videos": { "completed": s.videos, "cached": s.cached_videos },
            "tokens": s.tokens,
            "duration_s": s.duration.as_secs_f64(),
            "throughput": s.throughput,
            "latency_ms": s.latency_ms,
            "cache": {
                "processor_hit_rate": self.cache.processor_hit_rate,
                "encoder_hit_rate": self.cache.encoder_hit_rate,
                "evictions": self.cache.evictions(),
                "processor_evictions": self.cache.processor_evictions,
                "encoder_evictions": self.cache.encoder_evictions,
            },
            "engine": self.steps,
            "memory": memory,
            "memory_returned_to_baseline": self.verdict.returned,
            "leaked_bytes": self.verdict.leaked_bytes,
            "timeline": self.timeline,
            "faults": self.faults,
        })
    }

    /// Writes [`Self::to_json`] to `path`, pretty-printed.
    ///
    /// # Errors
    /// The I/O error, naming nothing: the caller adds the path.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(&self.to_json()).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }

    /// The human-readable report, ending with the verdict line.
    pub fn render_text(&self) -> String {
        let (i, s, c) = (&self.info, &self.stats, &self.cache);
        let mut out = String::new();
        let conc = i
            .max_concurrency
            .map_or_else(|| "unlimited".to_owned(), |n| n.to_string());
        let mut items = Vec::new();
        if i.images_per_prompt > 0 || i.videos_per_prompt == 0 {
            items.push(format!(
                "{} images ({} distinct)",
                i.images_per_prompt, i.distinct_images
            ));
        }
        if i.videos_per_prompt > 0 {
            items.push(format!(
                "{} videos ({} distinct)",
                i.videos_per_prompt, i.distinct_videos
            ));
        }
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "target {}: {} prompts x {}, {} repeated slots, request rate {}, max concurrency {}, seed {}",
            i.target,
            i.num_prompts,
            items.join(" + "),
            i.repeated_slots,
            i.request_rate,
            conc,
            i.seed
        );
        let _ = writeln!(
            out,
            "requests:   {} completed in {:.2} s",
            s.completed,
            s.duration.as_secs_f64()
        );
        let refusal = s
            .refusal
            .as_ref()
            .map_or_else(String::new, |r| format!(": {r}"));
        let _ = writeln!(
            out,
            "  refused:  {} (beyond the engine's admission bounds{refusal})",
            s.refused
        );
        let _ = writeln!(out, "  aborted:  {} (abandoned by their client)", s.aborted);
        let _ = writeln!(out, "  failed:   {}", s.failed);
        for e in &s.errors {
            let _ = writeln!(out, "    error: {e}");
        }
        let t = &s.throughput;
        let videos = if i.videos_per_prompt > 0 {
            format!(" {:.2} videos/s,", t.videos_per_s)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "throughput: {:.2} requests/s, {:.2} images/s,{videos} {:.1} embedding tokens/s",
            t.requests_per_s, t.images_per_s, t.tokens_per_s
        );
        let l = &s.latency_ms;
        let _ = writeln!(
            out,
            "latency:    p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms (mean {:.1}, min {:.1}, max {:.1})",
            l.p50, l.p90, l.p99, l.mean, l.min, l.max
        );
        let _ = writeln!(
            out,
            "caches:     processor hit rate {:.1}%, encoder hit rate {:.1}%, evictions {} (processor {}, encoder {})",
            c.processor_hit_rate * 100.0,
            c.encoder_hit_rate * 100.0,
            c.evictions(),
            c.processor_evictions,
            c.encoder_evictions
        );
        let st = &self.steps;
        let mean_step_ms = if st.steps == 0 {
            0.0
        } else {
            st.step_time_s * 1e3 / st.steps as f64
        };
        let _ = writeln!(out, "{}", self.capacity().line(l.p50, mean_step_ms));
        let _ = writeln!(
            out,
            "engine:     {} steps, {:.2} s in steps, {:.2} s of it in the encoder; engine overhead {:.1}% of step time",
            st.steps,
            st.step_time_s,
            st.encoder_time_s,
            st.overhead_share * 100.0
        );
        let _ = writeln!(out, "{}", st.encoder_line());
        if let Some(faults) = &self.faults {
            out.push_str(&faults.render_text());
        }
        out.push('\n');
        out.push_str(&memory_table(&self.memory));
        out.push('\n');
        out.push_str(&verdict_line(&self.verdict));
        out.push('\n');
        out
    }
}

/// The memory table: one row per checkpoint, bytes in binary units with exact bytes beside.
pub fn memory_table(c: &MemoryCheckpoints) -> String {
    let header = [
        "checkpoint",
        "device used",
        "allocator reserved",
        "allocator allocated",
        "encoder cache",
    ];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    for (label, _, p) in c.rows() {
        rows.push(vec![
            label.to_owned(),
            human_bytes(p.device_used_bytes),
            human_bytes(p.allocator_reserved_bytes),
            human_bytes(p.allocator_allocated_bytes),
            human_bytes(p.encoder_cache_bytes),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|col| rows.iter().map(|r| r[col].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(col, cell)| {
                if col == 0 {
                    format!("{cell:<w$}", w = widths[col])
                } else {
                    format!("{cell:>w$}", w = widths[col])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&non_allocator_note(&c.after_start));
    out
}

/// What device used beyond allocator reserved is, at the baseline: the part the device plugin
/// reports holding (its context and streams, allocation padding and page rounding) and the
/// rest (the runtime's own, the driver's, other processes').
fn non_allocator_note(p: &MemoryPoint) -> String {
    let beyond = p
        .device_used_bytes
        .saturating_sub(p.allocator_reserved_bytes);
    let held = p.plugin_held_bytes.min(beyond);
    format!(
        "device used - allocator reserved after start: {}; the device plugin holds {} of it (context, streams, allocation padding and page rounding), the rest {} is the runtime's, the driver's and other processes'\n",
        human_bytes(beyond),
        human_bytes(held),
        human_bytes(beyond - held)
    )
}

/// `1536` -> `1.50 KiB (1536)`; below 1 KiB just the bytes.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {} ({bytes})", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bench::stats::{RequestOutcome, summarize};

    fn point(used: u64, reserved: u64, allocated: u64) -> MemoryPoint {
        MemoryPoint {
            device_used_bytes: used,
            allocator_reserved_bytes: reserved,
            allocator_allocated_bytes: allocated,
            encoder_cache_bytes: 0,
            plugin_held_bytes: 0,
        }
    }

    fn checkpoints(after_reset: MemoryPoint) -> MemoryCheckpoints {
        MemoryCheckpoints {
            before_start: point(3_400, 0, 0),
            after_start: point(57_766, 50_000, 40_000),
            after_load: point(61_548, 54_000, 41_000),
            after_reset,
        }
    }

    #[test]
    fn verdict_takes_the_largest_growth() {
        let same = verdict(&checkpoints(point(57_766, 50_000, 40_000)));
        assert_eq!(
            same,
            Verdict {
                returned: true,
                leaked_bytes: 0
            }
        );
        assert_eq!(
            verdict_line(&same),
            "memory after reset returns to the post-start baseline: yes"
        );
        let lower = verdict(&checkpoints(point(57_000, 49_000, 40_000)));
        assert!(lower.returned);
        // The seed's numbers: reset_mm_cache gave nothing back; reserved grew the most.
        let leak = verdict(&checkpoints(point(61_548, 54_000, 40_000)));
        assert_eq!(
            leak,
            Verdict {
                returned: false,
                leaked_bytes: 4_000
            }
        );
        assert_eq!(
            verdict_line(&leak),
            "memory after reset returns to the post-start baseline: no (+4000 bytes)"
        );
        let alloc_only = verdict(&checkpoints(point(57_766, 50_000, 40_512)));
        assert_eq!(alloc_only.leaked_bytes, 512);
    }

    #[test]
    fn cache_rates_are_over_the_load_only() {
        let before = EngineCounters {
            processor_hits: 5,
            processor_misses: 5,
            encoder_hits: 0,
            encoder_misses: 3,
            ..EngineCounters::default()
        };
        let after = EngineCounters {
            processor_hits: 8,
            processor_misses: 6,
            processor_evictions: 2,
            encoder_hits: 1,
            encoder_misses: 6,
            encoder_evictions: 1,
            steps: 4,
            step_time_ns: 2_000,
            encoder_time_ns: 1_500,
            encoder_flops: 3_000_000,
            peak_flops: Some(4_000_000_000_000),
        };
        let c = CacheStats::between(&before, &after);
        assert_eq!(c.processor_hit_rate, 0.75);
        assert_eq!(c.encoder_hit_rate, 0.25);
        assert_eq!(c.evictions(), 3);
        assert_eq!(CacheStats::between(&after, &after).encoder_hit_rate, 0.0);
        let st = StepStats::between(&before, &after, None);
        assert_eq!((st.steps, st.overhead_share), (4, 0.25));
        assert_eq!(StepStats::between(&after, &after, None).overhead_share, 0.0);
        // 3e6 FLOP in 1.5 us: 2 TFLOPS, half the device's 4.
        assert!((st.encoder_tflops - 2.0).abs() < 1e-12, "{st:?}");
        assert_eq!(
            (st.peak_tflops, st.peak_source),
            (Some(4.0), Some("device"))
        );
        assert!((st.peak_share.unwrap() - 0.5).abs() < 1e-12);
        assert!(
            st.encoder_line().contains("50.0% of the device's peak"),
            "{}",
            st.encoder_line()
        );
        let given = StepStats::between(&before, &after, Some(8.0));
        assert_eq!(given.peak_source, Some("--peak-tflops"));
        assert!((given.peak_share.unwrap() - 0.25).abs() < 1e-12);
        let none = StepStats::between(
            &before,
            &EngineCounters {
                peak_flops: None,
                ..after
            },
            None,
        );
        assert_eq!(none.peak_share, None);
        assert!(none.encoder_line().contains("--peak-tflops gives one"));
    }

    fn report(after_reset: MemoryPoint) -> BenchReport {
        let outcomes = [RequestOutcome {
            latency: Duration::from_millis(12),
            images: 2,
            videos: 0,
            tokens: 64,
            cached_images: 1,
            cached_videos: 0,
            error: None,
        }];
        let memory = checkpoints(after_reset);
        BenchReport {
            info: RunInfo {
                target: "in-process".into(),
                num_prompts: 1,
                images_per_prompt: 2,
                videos_per_prompt: 0,
                distinct_images: 2,
                distinct_videos: 0,
                repeated_slots: 0,
                request_rate: "inf".into(),
                max_concurrency: None,
                seed: 0,
                offered_requests_per_s: Some(1.0),
            },
            stats: summarize(&outcomes, Duration::from_secs(1)),
            faults: None,
            cache: CacheStats::default(),
            steps: StepStats::default(),
            verdict: verdict(&memory),
            memory,
            timeline: vec![TimedPoint {
                t_s: 0.0,
                point: memory.after_start,
            }],
            checkpoint_times_s: [0.0, 0.0, 1.0, 1.1],
        }
    }

    #[test]
    fn result_json_has_the_documented_keys() {
        let r = report(point(57_766, 50_000, 40_000));
        let v = r.to_json();
        let number_paths = [
            "/requests/completed",
            "/requests/failed",
            "/throughput/requests_per_s",
            "/throughput/images_per_s",
            "/throughput/videos_per_s",
            "/videos/completed",
            "/videos/cached",
            "/throughput/tokens_per_s",
            "/latency_ms/p50",
            "/latency_ms/p90",
            "/latency_ms/p99",
            "/cache/processor_hit_rate",
            "/engine/overhead_share",
            "/engine/encoder_flops",
            "/engine/encoder_tflops",
            "/cache/encoder_hit_rate",
            "/cache/evictions",
            "/leaked_bytes",
        ];
        for path in number_paths {
            assert!(
                v.pointer(path).is_some_and(Value::is_number),
                "{path} in {v}"
            );
        }
        for cp in ["before_start", "after_start", "after_load", "after_reset"] {
            for field in [
                "device_used_bytes",
                "allocator_reserved_bytes",
                "allocator_allocated_bytes",
            ] {
                let path = format!("/memory/{cp}/{field}");
                assert!(v.pointer(&path).is_some_and(Value::is_u64), "{path}");
            }
        }
        assert_eq!(v["memory"]["after_load"]["device_used_bytes"], 61_548);
        assert_eq!(v["memory_returned_to_baseline"], true);
        assert_eq!(v["throughput"]["tokens_per_s"], 64.0);
        assert_eq!(r.exit_code(), 0);
        assert_eq!(report(point(57_767, 50_000, 40_000)).exit_code(), 1);
        let path =
            std::env::temp_dir().join(format!("iris-bench-result-{}.json", std::process::id()));
        r.write_json(&path).unwrap();
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, v);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn capacity_says_when_the_engine_falls_behind() {
        let mut r = report(point(57_766, 50_000, 40_000));
        r.stats.throughput.requests_per_s = 12.24;
        r.info.offered_requests_per_s = Some(20.0);
        let over = r.capacity();
        assert!(over.over_capacity);
        let line = over.line(4576.7, 52.4);
        assert!(
            line.starts_with("capacity:   offered 20.00 requests/s, served 12.24:"),
            "{line}"
        );
        assert!(
            line.contains("latency is dominated by queueing (p50 4576.7 ms, a step takes 52.4 ms)"),
            "{line}"
        );
        r.stats.throughput.requests_per_s = 19.5;
        let within = r.capacity();
        assert!(!within.over_capacity);
        assert!(
            within
                .line(100.0, 50.0)
                .ends_with("within what the engine sustains")
        );
        assert_eq!(r.to_json()["capacity"]["over_capacity"], false);
        r.info.offered_requests_per_s = None;
        assert!(r.capacity().over_capacity, "all at once always queues");
    }

    #[test]
    fn text_has_the_table_and_ends_with_the_verdict() {
        let text = report(point(57_766, 50_000, 40_000)).render_text();
        assert!(
            text.ends_with("memory after reset returns to the post-start baseline: yes\n"),
            "{text}"
        );
        assert!(text.contains("p50 12.0 ms"), "{text}");
        let table = memory_table(&checkpoints(point(1 << 30, 0, 0)));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6);
        assert!(
            lines[5].starts_with("device used - allocator reserved after start: 7.58 KiB (7766);"),
            "{table}"
        );
        let mut start = point(57_766, 50_000, 40_000);
        start.plugin_held_bytes = 5_000;
        let note = non_allocator_note(&start);
        assert!(
            note.contains("the device plugin holds 4.88 KiB (5000) of it")
                && note.contains("the rest 2.70 KiB (2766)"),
            "{note}"
        );
        assert!(lines[0].starts_with("checkpoint"));
        assert!(
            lines[4].starts_with("after reset") && lines[4].contains("1.00 GiB (1073741824)"),
            "{table}"
        );
        assert_eq!(human_bytes(1536), "1.50 KiB (1536)");
        assert_eq!(human_bytes(12), "12 B");
    }
}
