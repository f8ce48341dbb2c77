//! `iris bench`: the user's manual experiment (memory before start, after start, after a load
//! test, after reset) as one command with a verdict.
//!
//! - [`workload`]: synthetic images and clips or dataset directories, repeats, Poisson
//!   arrivals.
//! - [`runner`]: the load generator over a [`runner::BenchTarget`] (HTTP for `--url`), with
//!   memory sampling, the checkpoints and `reset_all`.
//! - [`stats`]: latency percentiles and throughput.
//! - [`report`]: memory table, verdict line, `--result-json`, exit status.
//! - [`plot`]: `--plot FILE.svg|png`.
//!
//! [`BenchArgs`] holds the flags; [`BenchArgs::workload_spec`] and [`BenchArgs::run_options`]
//! turn them into the runner's inputs, and [`finish`] prints and writes the results.

pub mod faults;
pub mod plot;
pub mod report;
pub mod runner;
pub mod stats;
pub mod workload;

use std::path::PathBuf;

use anyhow::Context as _;
use iris_core::engine::admission::AdmissionConfig;

use report::BenchReport;
use runner::RunOptions;
use workload::{ImageFormat, ImageSize, ImageSource, RequestRate, VideoSource, WorkloadSpec};

/// Flags of `iris bench` (names follow `vllm bench serve` where the meaning is the same).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Bench a running `iris serve` at this URL (http://host:port) instead of an in-process engine.
    #[arg(long)]
    pub url: Option<String>,
    /// API key for `--url` (sent as `Authorization: Bearer <key>`).
    #[arg(long, env = crate::http::API_KEY_ENV, hide_env_values = true)]
    pub api_key: Option<String>,
    /// Number of prompts (requests) to send. With the other defaults (the seed experiment's
    /// 1000 prompts at 20 requests/s), the in-process run takes about a minute on 2 cores.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Images in each prompt.
    #[arg(long, default_value_t = 2)]
    pub images_per_prompt: usize,
    /// Sizes of synthetic images, WIDTHxHEIGHT; repeat the flag or separate with commas. Fresh
    /// images use the sizes in turn.
    #[arg(long, value_delimiter = ',', default_value = "448x448")]
    pub image_size: Vec<ImageSize>,
    /// File format of synthetic images: png, jpeg or webp.
    #[arg(long, default_value = "png")]
    pub image_format: ImageFormat,
    /// Use the image files (.png, .jpg, .jpeg, .webp) of this directory instead of synthetic ones.
    #[arg(long, conflicts_with = "image_size")]
    pub dataset: Option<PathBuf>,
    /// Videos in each prompt, after its images (0: images only). Synthetic clips need the
    /// FFmpeg programs; the engine decodes every video with them.
    #[arg(long, default_value_t = 0)]
    pub videos_per_prompt: usize,
    /// Frame size of synthetic clips, WIDTHxHEIGHT with even sides.
    #[arg(long, default_value = "448x448")]
    pub video_size: ImageSize,
    /// Frames of each synthetic clip (a camera panning across a synthetic image, H.264).
    #[arg(long, default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(workload::MAX_SYNTHETIC_FRAMES)))]
    pub video_frames: u32,
    /// Frame rate of synthetic clips; vLLM's Qwen-VL loaders sample 2 frames a second of it.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=240))]
    pub video_fps: u32,
    /// Use the clips (.mp4, .m4v, .webm, .mkv, .mov, .avi) of this directory instead of
    /// synthetic ones.
    #[arg(long, conflicts_with_all = ["video_size", "video_frames", "video_fps"])]
    pub video_dataset: Option<PathBuf>,
    /// Share of image (and of video) slots that reuse an item from an earlier prompt, from 0
    /// to 1.
    #[arg(long, default_value_t = 0.25)]
    pub repeat_ratio: f64,
    /// Requests per second (Poisson arrivals), or `inf` to send every prompt at once.
    #[arg(long, default_value = "20")]
    pub request_rate: RequestRate,
    /// Most requests in flight at once (no limit when absent; at least 1).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_concurrency: Option<usize>,
    /// Seed of the images, the repeats and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Milliseconds between memory samples during the load (for the plot).
    #[arg(long, default_value_t = 100)]
    pub sample_interval_ms: u64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
    /// Draw the memory timeline to this file (.svg or .png, with title, axes and legend).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Do not draw the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Soak the engine with faults while the load runs: clients that hang up, resets in the
    /// middle, and (in process on the CPU device) injected out-of-memory. Counts answered,
    /// expected and unexpected errors; exits 1 on an unexpected error or leaked bytes.
    #[arg(long)]
    pub inject_faults: bool,
    /// The device's dense peak in TFLOP/s at the engine's dtype, which the encoder's achieved
    /// TFLOP/s are held against, instead of the one the device reports (a measured product's
    /// figure, say: the CUDA device's is the datasheet kind, SMs x clock x dense rate).
    #[arg(long, value_parser = positive_tflops)]
    pub peak_tflops: Option<f64>,
}

/// `--peak-tflops`: a positive finite number.
fn positive_tflops(text: &str) -> Result<f64, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("{text:?} is not a positive number of TFLOP/s"))
}

impl BenchArgs {
    /// The workload the flags describe.
    pub fn workload_spec(&self) -> WorkloadSpec {
        let source = match &self.dataset {
            Some(dir) => ImageSource::Dataset(dir.clone()),
            None => ImageSource::Synthetic {
                sizes: self.image_size.clone(),
                format: self.image_format,
            },
        };
        let video_source = match &self.video_dataset {
            Some(dir) => VideoSource::Dataset(dir.clone()),
            None => VideoSource::Synthetic {
                size: self.video_size,
                frames: self.video_frames,
                fps: self.video_fps,
            },
        };
        WorkloadSpec {
            source,
            video_source,
            num_prompts: self.num_prompts,
            images_per_prompt: self.images_per_prompt,
            videos_per_prompt: self.videos_per_prompt,
            repeat_ratio: self.repeat_ratio,
            seed: self.seed,
        }
    }

    /// Checks, before the load, that `--result-json` and `--plot` can be written (and that
    /// the plot's name ends in `.svg` or `.png`): a run may take hours, and its report should
    /// not be lost to a typo at the end. A file that did not exist is not left behind.
    ///
    /// # Errors
    /// Naming the flag and the path.
    pub fn check_outputs(&self) -> anyhow::Result<()> {
        if let Some(path) = &self.plot {
            plot::plot_format(path).context("--plot")?;
        }
        for (flag, path) in [("--result-json", &self.result_json), ("--plot", &self.plot)] {
            let Some(path) = path else { continue };
            let existed = path.exists();
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .with_context(|| format!("{flag} {}: cannot be written", path.display()))?;
            if !existed {
                let _ = std::fs::remove_file(path);
            }
        }
        Ok(())
    }

    /// The runner options the flags describe.
    pub fn run_options(&self) -> RunOptions {
        RunOptions {
            request_rate: self.request_rate,
            max_concurrency: self.max_concurrency,
            seed: self.seed,
            sample_interval: std::time::Duration::from_millis(self.sample_interval_ms),
            show_progress: !self.no_progress,
            inject_faults: self.inject_faults,
            peak_tflops: self.peak_tflops,
        }
    }
}

/// The names and times of the four checkpoints, for the plot.
pub fn checkpoint_marks(report: &BenchReport) -> [(&'static str, f64); 4] {
    let t = report.checkpoint_times_s;
    [
        ("before start", t[0]),
        ("after start", t[1]),
        ("after load", t[2]),
        ("after reset", t[3]),
    ]
}

/// Prints the report, writes `--result-json` and `--plot`, and returns the exit status
/// (1 when memory did not return to the post-start baseline).
///
/// # Errors
/// When a result file cannot be written.
pub fn finish(report: &BenchReport, args: &BenchArgs) -> anyhow::Result<u8> {
    print!("{}", report.render_text());
    // Both are attempted before either error is returned: one failing keeps the other.
    let json = args.result_json.as_ref().map(|path| {
        report
            .write_json(path)
            .with_context(|| format!("writing --result-json {}", path.display()))
    });
    let plot = args.plot.as_ref().map(|path| {
        plot::write_plot(path, &report.timeline, &checkpoint_marks(report))
            .context("writing --plot")
    });
    json.transpose()?;
    plot.transpose()?;
    Ok(report.exit_code())
}

/// Arguments of `iris bench`: the engine's flags (for the in-process run) and the bench's.
#[derive(Debug, clap::Args)]
// The consumer allow-list only restricts ECMooncakeConnector's pushes, which the bench refuses.
#[command(mut_arg("allowed_ec_consumers", |arg| arg.hide(true)))]
pub struct BenchCmd {
    #[command(flatten)]
    engine: crate::engine::EngineArgs,
    #[command(flatten)]
    bench: BenchArgs,
    /// The in-process engine as vLLM's encoder instance: with `--ec-transfer-config`, every
    /// prompt goes through the EC producer (identifiers, store look-ups, writes) as
    /// `/v1/chat/completions` does.
    #[command(flatten)]
    epd: crate::epd::EpdArgs,
}

/// Runs `iris bench`: against `--url` when given, otherwise against an engine started in this
/// process on the configured device (the built-in CPU device by default).
///
/// # Errors
/// Start-up, workload, checkpoint or output failures.
pub fn run(
    global: &crate::settings::GlobalArgs,
    args: &BenchCmd,
) -> anyhow::Result<std::process::ExitCode> {
    args.bench.check_outputs()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let code = match &args.bench.url {
        Some(_) if args.epd.ec_transfer_config.is_some() => anyhow::bail!(
            "--ec-transfer-config configures the in-process engine; the server at --url has its own"
        ),
        Some(url) => runtime.block_on(run_against_url(url, &args.bench))?,
        None => {
            let epd = std::sync::Arc::new(args.epd.resolve(
                &args.engine.model.model_id(),
                global.config()?.ec_transfer_config.as_ref(),
            )?);
            if epd
                .producer
                .as_ref()
                .is_some_and(|p| p.push_metrics().is_some())
            {
                anyhow::bail!(
                    "iris bench publishes through the shared-storage connector only: ECMooncakeConnector pushes to the consumer each request names, and bench requests name none (docs/PERFORMANCE.md measures pushes with the iris-ec push bench)"
                );
            }
            let inject = args.bench.inject_faults;
            let adjust = |config: &mut iris_core::config::Config| {
                if inject {
                    inject_cpu_faults(config);
                }
            };
            let sized = workload_admission(&args.bench, &args.engine)?;
            let workload = runtime.block_on(build_workload(&args.bench))?;
            let engine = args.engine.start_with_admission(global, adjust, sized)?;
            let engine = std::sync::Arc::new(engine);
            eprintln!("{}", crate::engine::startup_line(&engine));
            eprintln!("{}", admission_line(&engine, &sized));
            let producer = epd.producer.clone();
            let target = runner::InProcessTarget::new(engine);
            let target = std::sync::Arc::new(match producer {
                Some(_) => target.with_epd(std::sync::Arc::clone(&epd)),
                None => target,
            });
            let code = runtime.block_on(run_against(target, &workload, &args.bench))?;
            if let Some(producer) = &epd.producer {
                crate::settings::print_stdout(&store_summary(&producer.stats()))?;
            }
            code
        }
    };
    Ok(std::process::ExitCode::from(code))
}

/// The EC store's line of the report: entries, bytes and write throughput.
fn store_summary(stats: &iris_ec::storage::StoreStats) -> String {
    let mib = stats.bytes_written as f64 / f64::from(1u32 << 20);
    let seconds = stats.write_time_ns as f64 / 1e9;
    let throughput = if seconds > 0.0 { mib / seconds } else { 0.0 };
    format!(
        "EC store:   {} entries written ({mib:.1} MiB, {throughput:.0} MiB/s while writing, {:.2} ms per entry), {} hits, {} write errors, {} evictions, {:.1} MiB resident\n",
        stats.writes,
        if stats.writes > 0 {
            seconds * 1e3 / stats.writes as f64
        } else {
            0.0
        },
        stats.hits,
        stats.write_errors,
        stats.evictions,
        stats.resident_bytes as f64 / f64::from(1u32 << 20),
    )
}

/// Admission bounds under which every prompt of the workload may queue in the in-process
/// engine: the bench measures the engine under the load it offers, and the engine's own default
/// bounds (sized for a server's bursts) would turn that load into refusals as soon as the
/// machine serves less than the offered rate. The token bound counts every image at the
/// processor's largest size, and every video as its largest frames, as many groups of them as
/// the loader may sample (a synthetic clip's frames, else vLLM's most). Bounds set by flag or
/// config file take precedence.
///
/// # Errors
/// An unusable model flag.
fn workload_admission(
    bench: &BenchArgs,
    engine: &crate::engine::EngineArgs,
) -> anyhow::Result<AdmissionConfig> {
    let spec = engine.model.spec()?;
    let most_tokens = |config: &iris_core::preprocess::ProcessorConfig| {
        let factor = u64::from(config.factor().max(1));
        (config.max_pixels / (factor * factor)).max(1)
    };
    let tokens_per_image = most_tokens(&spec.processor);
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let requests = count(bench.num_prompts).max(1);
    let images = requests.saturating_mul(count(bench.images_per_prompt));
    let mut tokens = images.saturating_mul(tokens_per_image);
    if bench.videos_per_prompt > 0 {
        let video = spec.video_processing(engine.model.model_dir.as_deref())?;
        let frames = match bench.video_dataset {
            Some(_) => iris_core::preprocess::video::MAX_FRAMES,
            None => bench.video_frames,
        };
        let groups = u64::from(frames.div_ceil(video.config.temporal_patch_size.max(1)));
        let videos = requests.saturating_mul(count(bench.videos_per_prompt));
        tokens = tokens.saturating_add(
            videos.saturating_mul(groups.saturating_mul(most_tokens(&video.config))),
        );
    }
    Ok(AdmissionConfig {
        max_queued_requests: Some(requests),
        max_pending_tokens: Some(tokens.max(1)),
    })
}

/// What the in-process engine admits, and whether the bounds are the workload's or the user's.
fn admission_line(engine: &iris_core::engine::Engine, sized: &AdmissionConfig) -> String {
    let info = engine.info_json();
    let bound = |key: &str| info["admission"][key].as_u64();
    let (requests, tokens) = (bound("max_queued_requests"), bound("max_pending_tokens"));
    let origin = if requests == sized.max_queued_requests && tokens == sized.max_pending_tokens {
        "sized for this workload, so every prompt may queue"
    } else {
        "set by --max-queued-requests, --max-pending-tokens or the config file; requests beyond them are refused and reported"
    };
    let show = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
    format!(
        "admission: at most {} requests and {} embedding tokens pending ({origin})",
        show(requests),
        show(tokens)
    )
}

/// Adds the CPU device's out-of-memory fault option (see [`faults`]) unless the config sets
/// its own.
fn inject_cpu_faults(config: &mut iris_core::config::Config) {
    config
        .plugins
        .entry("cpu".to_owned())
        .or_default()
        .entry("fail_alloc_every".to_owned())
        .or_insert_with(|| faults::CPU_FAIL_ALLOC_EVERY.to_string());
}

/// Builds the workload the flags describe (reads the datasets, makes the synthetic images and
/// clips), off the async threads. The bench does this before it starts an in-process engine,
/// so that a dataset that cannot be read is refused before a model loads.
///
/// # Errors
/// A bad count or ratio, an unreadable or empty dataset, an encoder error, or synthetic
/// videos without FFmpeg.
pub async fn build_workload(args: &BenchArgs) -> anyhow::Result<workload::Workload> {
    let spec = args.workload_spec();
    let started = std::time::Instant::now();
    let workload = tokio::task::spawn_blocking(move || workload::build_workload(&spec))
        .await
        .context("building the workload")??;
    let clips = workload.distinct(iris_core::budget::Modality::Video);
    if clips > 0 || started.elapsed() > std::time::Duration::from_secs(2) {
        // Making synthetic clips (or many large images) takes a while: say where the time
        // before the load went.
        eprintln!(
            "workload: {} distinct images and {clips} distinct videos ready in {:.1} s",
            workload.distinct(iris_core::budget::Modality::Image),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(workload)
}

/// Runs `workload` against `target` and finishes the bench (see [`finish`]).
///
/// # Errors
/// A bad flag, a failed checkpoint or reset, or an unwritable result file.
pub async fn run_against<T: runner::BenchTarget>(
    target: std::sync::Arc<T>,
    workload: &workload::Workload,
    args: &BenchArgs,
) -> anyhow::Result<u8> {
    let report = runner::run_bench(target, workload, &args.run_options()).await?;
    finish(&report, args)
}

/// Runs the bench against the server at `url` and finishes it (see [`finish`]).
///
/// # Errors
/// A bad URL, workload or flag, a failed checkpoint or reset, or an unwritable result file.
pub async fn run_against_url(url: &str, args: &BenchArgs) -> anyhow::Result<u8> {
    let target = std::sync::Arc::new(runner::HttpTarget::new(url, args.api_key.clone())?);
    let workload = build_workload(args).await?;
    run_against(target, &workload, args).await
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cmd::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    /// The flag only ECMooncakeConnector's pushes use is not offered by the bench, which
    /// refuses that connector; the EPD flags it does take are.
    #[test]
    fn bench_help_leaves_out_the_consumer_allow_list() {
        #[derive(Parser)]
        struct Bench {
            #[command(flatten)]
            cmd: BenchCmd,
        }
        let help = <Bench as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        assert!(!help.contains("--allowed-ec-consumers"), "{help}");
        assert!(help.contains("--ec-transfer-config"), "{help}");
    }

    #[test]
    fn flags_parse_into_spec_and_options() {
        let a = parse(&[
            "--image-size",
            "64x32,16x16",
            "--image-size",
            "8x8",
            "--request-rate",
            "2.5",
            "--max-concurrency",
            "4",
            "--repeat-ratio",
            "0.5",
            "--seed",
            "9",
            "--image-format",
            "jpeg",
        ])
        .unwrap();
        let spec = a.workload_spec();
        let ImageSource::Synthetic { sizes, format } = &spec.source else {
            panic!("synthetic expected")
        };
        assert_eq!(sizes.len(), 3);
        assert_eq!(*format, ImageFormat::Jpeg);
        assert_eq!((spec.repeat_ratio, spec.seed), (0.5, 9));
        let o = a.run_options();
        assert_eq!(o.request_rate, RequestRate::PerSecond(2.5));
        assert_eq!(o.max_concurrency, Some(4));
        let d = parse(&["--dataset", "/tmp/x"]).unwrap();
        assert_eq!(
            d.workload_spec().source,
            ImageSource::Dataset("/tmp/x".into())
        );
        assert!(parse(&["--dataset", "/tmp/x", "--image-size", "8x8"]).is_err());
        assert!(parse(&["--request-rate", "0"]).is_err());
        assert!(parse(&["--image-size", "8"]).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_against_url_writes_the_result_files() {
        let engine = std::sync::Arc::new(crate::http::test_engine::FakeEngine::new(false));
        let app = crate::http::router(engine, crate::http::ServerConfig::default()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(crate::http::serve(listener, app, async move {
            let _ = rx.await;
        }));
        let dir = std::env::temp_dir().join(format!("iris-bench-finish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (json_path, plot_path) = (dir.join("r.json"), dir.join("m.svg"));
        let args = parse(&[
            "--num-prompts",
            "5",
            "--images-per-prompt",
            "1",
            "--image-size",
            "56x56",
            "--no-progress",
            "--result-json",
            json_path.to_str().unwrap(),
            "--plot",
            plot_path.to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(run_against_url(&url, &args).await.unwrap(), 0);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(v["requests"]["completed"], 5);
        assert_eq!(v["memory_returned_to_baseline"], true);
        assert!(
            std::fs::read_to_string(&plot_path)
                .unwrap()
                .contains("after reset")
        );
        std::fs::remove_dir_all(&dir).unwrap();
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
