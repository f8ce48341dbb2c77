//! The load generator: sends the workload to a [`BenchTarget`], samples memory while it runs,
//! then resets and records the four checkpoints.
//!
//! Sequence: read the start-up checkpoints (before start, after start) and the cache counters;
//! send every prompt at its arrival time, at most `max_concurrency` in flight (a prompt whose
//! time has come waits for a slot, as in `vllm bench serve`), sampling memory every
//! `sample_interval`; when the last response is in, record "after load" and the counters; call
//! `reset_all`; record "after reset". Latency runs from the moment a request is sent (after its
//! slot is free) to its complete response.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::faults;
use super::report::{
    BenchReport, CacheStats, EngineCounters, MemoryCheckpoints, MemoryPoint, RunInfo, StepStats,
    TimedPoint, verdict,
};
use super::stats::{ErrorKind, RequestError, RequestOutcome, summarize};
use super::workload::{EncodedMedia, RequestRate, Workload, arrival_offsets};
use crate::epd::{Epd, EpdRequest, Item, ProduceError, Stored};
use crate::http::MetricsSnapshot;
use crate::http::engine_api::{EncodeOptions, Engine, EngineError, ImageInput, ProcessorOverrides};
use crate::http::request::{RequestItem, media_inputs};
use iris_core::budget::Modality;

/// Default interval between memory samples during the load.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// Default limit on one HTTP call of the bench client, response body included.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// The error code of a 503 that refuses a request beyond the server's admission bounds.
const OVERLOADED_CODE: &str = "overloaded";

/// What the bench needs from one encoded image or video.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedItem {
    /// The item's content hash.
    pub mm_hash: String,
    /// Embedding tokens it produced.
    pub num_tokens: u64,
    /// Whether the encoder cache served it.
    pub cached: bool,
}

/// The start-up checkpoints, taken by the engine when it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartupMemory {
    /// Before anything was loaded.
    pub before_start: MemoryPoint,
    /// After start-up finished: the baseline.
    pub after_start: MemoryPoint,
}

/// Why a call on a bench target failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// The server answered with an error status.
    #[error("HTTP {status} from {path}: {message}")]
    Http {
        /// The route.
        path: String,
        /// The status code.
        status: u16,
        /// The error message from the JSON body, or the body itself.
        message: String,
    },
    /// The request could not be sent or its response not read.
    #[error("{path}: {message}")]
    Transport {
        /// The route.
        path: String,
        /// What failed.
        message: String,
    },
    /// The answer did not have the expected shape.
    #[error("unexpected response from {path}: {message}")]
    BadResponse {
        /// The route.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The `--url` is unusable.
    #[error("server URL {url:?}: {message}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong.
        message: String,
    },
    /// The engine refused the request at admission, beyond its bounds (503 `overloaded`): the
    /// load exceeded what it queues, nothing went wrong.
    #[error("refused: {0}")]
    Refused(String),
    /// The engine failed (in-process targets).
    #[error("engine: {0}")]
    Engine(String),
    /// The client gave up on the request (`--inject-faults`).
    #[error("{}", super::faults::ABORTED)]
    Aborted,
}

/// Why a bench run stopped before producing a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A checkpoint, counter read or reset failed (request failures are counted, not fatal).
    #[error("{stage}: {error}")]
    Target {
        /// What the run was doing.
        stage: &'static str,
        /// The target's error (a field, not a `source`: the message already carries it).
        error: TargetError,
    },
    /// The progress bar template is invalid.
    #[error("progress bar template: {0}")]
    Progress(#[from] indicatif::style::TemplateError),
}

/// What a bench runs against: an in-process engine or a server behind `--url`.
pub trait BenchTarget: Send + Sync + 'static {
    /// `in-process` or the URL, for the report.
    fn describe(&self) -> String;
    /// Encodes one prompt's images and videos, returning one result per item in order.
    fn encode(
        &self,
        items: Vec<Arc<EncodedMedia>>,
    ) -> impl Future<Output = Result<Vec<EncodedItem>, TargetError>> + Send;
    /// The engine's start-up checkpoints.
    fn startup_memory(&self) -> impl Future<Output = Result<StartupMemory, TargetError>> + Send;
    /// Memory now.
    fn memory(&self) -> impl Future<Output = Result<MemoryPoint, TargetError>> + Send;
    /// The engine's cumulative cache counters.
    fn cache_counters(&self) -> impl Future<Output = Result<EngineCounters, TargetError>> + Send;
    /// Resets the processor cache, the encoder cache and the allocator.
    fn reset_all(&self) -> impl Future<Output = Result<(), TargetError>> + Send;
}

/// Counters of an engine's [`MetricsSnapshot`].
pub fn counters_of(m: &MetricsSnapshot) -> EngineCounters {
    EngineCounters {
        processor_hits: m.processor_cache_hits,
        processor_misses: m.processor_cache_misses,
        processor_evictions: m.processor_cache_evictions,
        encoder_hits: m.encoder_cache_hits,
        encoder_misses: m.encoder_cache_misses,
        encoder_evictions: m.encoder_cache_evictions,
        steps: m.steps,
        step_time_ns: m.step_time_ns,
        encoder_time_ns: m.encoder_time_ns,
        encoder_flops: m.encoder_flops,
        peak_flops: m.peak_flops,
    }
}

/// How to run the load.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    /// Arrival process.
    pub request_rate: RequestRate,
    /// Most requests in flight; `None` for no limit.
    pub max_concurrency: Option<usize>,
    /// Seed of the arrival times.
    pub seed: u64,
    /// Interval between memory samples.
    pub sample_interval: Duration,
    /// Draw a progress bar on stderr (drawn only when stderr is a terminal).
    pub show_progress: bool,
    /// Abandon and reset at random while the load runs ([`super::faults`]).
    pub inject_faults: bool,
    /// The device's peak in TFLOP/s, instead of the one it reports (`--peak-tflops`).
    pub peak_tflops: Option<f64>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            request_rate: RequestRate::Infinite,
            max_concurrency: None,
            seed: 0,
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            show_progress: true,
            inject_faults: false,
            peak_tflops: None,
        }
    }
}

/// Runs the workload against `target` and builds the report.
///
/// # Errors
/// [`RunError`] when a checkpoint, a counter read or the reset fails. Failed encode requests do
/// not stop the run; they are counted in the report.
pub async fn run_bench<T: BenchTarget>(
    target: Arc<T>,
    workload: &Workload,
    opts: &RunOptions,
) -> Result<BenchReport, RunError> {
    let stage = |stage: &'static str| move |error| RunError::Target { stage, error };
    let startup = target
        .startup_memory()
        .await
        .map_err(stage("reading the start-up memory checkpoints"))?;
    let counters_before = target
        .cache_counters()
        .await
        .map_err(stage("reading cache counters before the load"))?;
    let num_prompts = workload.prompts.len();
    let progress = if opts.show_progress {
        ProgressBar::new(u64::try_from(num_prompts).unwrap_or(u64::MAX))
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}, eta {eta})",
        )?
        .progress_chars("=> "),
    );

    let start = Instant::now();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_memory(
        Arc::clone(&target),
        start,
        opts.sample_interval,
        Arc::clone(&samples),
        Arc::clone(&stop),
    ));

    let slots = Arc::new(Semaphore::new(
        opts.max_concurrency
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS),
    ));
    let offsets = arrival_offsets(num_prompts, opts.request_rate, opts.seed);
    let offered_requests_per_s = offered_rate(&offsets);
    let mut tasks = Vec::with_capacity(num_prompts);
    let mut resets = Vec::new();
    for (index, offset) in offsets.into_iter().enumerate() {
        tokio::time::sleep_until((start + offset).into()).await;
        // The semaphore is never closed, so acquiring can only succeed.
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            break;
        };
        let items = workload.prompt_items(index);
        let plan = if opts.inject_faults {
            faults::plan(opts.seed, index)
        } else {
            faults::Plan::NONE
        };
        if plan.reset {
            let target = Arc::clone(&target);
            resets.push(tokio::spawn(async move { target.reset_all().await }));
        }
        let target = Arc::clone(&target);
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            let modalities: Vec<Modality> = items.iter().map(|item| item.modality).collect();
            let sent = Instant::now();
            let result = match plan.abort_after {
                // Dropping the call is the client hanging up.
                Some(after) => tokio::time::timeout(after, target.encode(items))
                    .await
                    .unwrap_or(Err(TargetError::Aborted)),
                None => target.encode(items).await,
            };
            let latency = sent.elapsed();
            drop(permit);
            progress.inc(1);
            outcome(latency, &modalities, result)
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.unwrap_or_else(|err| RequestOutcome {
            latency: Duration::ZERO,
            images: 0,
            videos: 0,
            tokens: 0,
            cached_images: 0,
            cached_videos: 0,
            error: Some(RequestError::failed(format!("request task failed: {err}"))),
        }));
    }
    let mut reset_results = Vec::with_capacity(resets.len());
    for reset in resets {
        reset_results.push(match reset.await {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(err) => Err(format!("reset task failed: {err}")),
        });
    }
    let load_duration = start.elapsed();
    progress.finish_and_clear();
    stop.store(true, Ordering::SeqCst);
    // A sampler that panicked only loses samples; the checkpoints below are taken directly.
    let _ = sampler.await;

    let after_load = target
        .memory()
        .await
        .map_err(stage("reading memory after the load"))?;
    let t_load = start.elapsed().as_secs_f64();
    let counters_after = target
        .cache_counters()
        .await
        .map_err(stage("reading cache counters after the load"))?;
    target
        .reset_all()
        .await
        .map_err(stage("calling reset_all"))?;
    let after_reset = target
        .memory()
        .await
        .map_err(stage("reading memory after reset_all"))?;
    let t_reset = start.elapsed().as_secs_f64();

    let memory = MemoryCheckpoints {
        before_start: startup.before_start,
        after_start: startup.after_start,
        after_load,
        after_reset,
    };
    let mut timeline = vec![
        TimedPoint {
            t_s: 0.0,
            point: startup.before_start,
        },
        TimedPoint {
            t_s: 0.0,
            point: startup.after_start,
        },
    ];
    timeline.extend(samples.lock().map(|s| s.clone()).unwrap_or_default());
    timeline.push(TimedPoint {
        t_s: t_load,
        point: after_load,
    });
    timeline.push(TimedPoint {
        t_s: t_reset,
        point: after_reset,
    });
    Ok(BenchReport {
        info: RunInfo {
            target: target.describe(),
            num_prompts,
            images_per_prompt: workload.per_prompt(Modality::Image),
            videos_per_prompt: workload.per_prompt(Modality::Video),
            distinct_images: workload.distinct(Modality::Image),
            distinct_videos: workload.distinct(Modality::Video),
            repeated_slots: workload.repeated_slots,
            request_rate: opts.request_rate.to_string(),
            max_concurrency: opts.max_concurrency,
            seed: opts.seed,
            offered_requests_per_s,
        },
        stats: summarize(&outcomes, load_duration),
        faults: opts
            .inject_faults
            .then(|| faults::FaultReport::new(&outcomes, &reset_results)),
        cache: CacheStats::between(&counters_before, &counters_after),
        steps: StepStats::between(&counters_before, &counters_after, opts.peak_tflops),
        verdict: verdict(&memory),
        memory,
        timeline,
        checkpoint_times_s: [0.0, 0.0, t_load, t_reset],
    })
}

/// A bench target that talks to `iris serve` over HTTP/1.1 (plain HTTP: iris serves loopback).
pub struct HttpTarget {
    base: String,
    api_key: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl HttpTarget {
    /// A target for the server at `url` (`http://host:port`), sending `api_key` as a bearer token.
    ///
    /// # Errors
    /// [`TargetError::Url`] when the URL is not `http://` with a host.
    pub fn new(url: &str, api_key: Option<String>) -> Result<Self, TargetError> {
        let base = url.trim().trim_end_matches('/').to_owned();
        let bad = |message: &str| TargetError::Url {
            url: url.to_owned(),
            message: message.to_owned(),
        };
        let uri: hyper::Uri = base
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad(
                "only http:// is supported (iris serves plain HTTP, on loopback by default)",
            ));
        }
        if uri.host().is_none() {
            return Err(bad("the URL has no host"));
        }
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Self {
            base,
            api_key,
            client,
            timeout: DEFAULT_REQUEST_TIMEOUT,
        })
    }

    /// Sets how long one call may take, response body included, before it counts as failed.
    #[must_use]
    #[cfg(test)]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Value, TargetError> {
        let transport = |message: String| TargetError::Transport {
            path: path.to_owned(),
            message,
        };
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(key) = &self.api_key {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| transport(e.to_string()))?;
        let exchange = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| transport(error_chain(&e)))?;
            let status = resp.status();
            let body = resp.into_body().collect().await;
            let bytes = body.map_err(|e| transport(e.to_string()))?.to_bytes();
            Ok::<_, TargetError>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| transport(format!("no complete response within {:?}", self.timeout)))??;
        let value: Result<Value, _> = serde_json::from_slice(&bytes);
        if !status.is_success() {
            let error = value.ok();
            let field = |name: &str| {
                error
                    .as_ref()
                    .and_then(|v| v.pointer(&format!("/error/{name}")))
                    .and_then(Value::as_str)
            };
            let message = field("message").map_or_else(
                || String::from_utf8_lossy(&bytes).into_owned(),
                str::to_owned,
            );
            if status == hyper::StatusCode::SERVICE_UNAVAILABLE
                && field("code") == Some(OVERLOADED_CODE)
            {
                return Err(TargetError::Refused(format!(
                    "HTTP 503 {OVERLOADED_CODE} from {path}: {message}"
                )));
            }
            return Err(TargetError::Http {
                path: path.to_owned(),
                status: status.as_u16(),
                message,
            });
        }
        value.map_err(|e| TargetError::BadResponse {
            path: path.to_owned(),
            message: format!("not JSON: {e}"),
        })
    }

    async fn metrics_snapshot(&self) -> Result<MetricsSnapshot, TargetError> {
        let v = self.call(hyper::Method::GET, "/memory", None).await?;
        serde_json::from_value(v.get("metrics").cloned().unwrap_or(Value::Null)).map_err(|e| {
            TargetError::BadResponse {
                path: "/memory".into(),
                message: format!("`metrics`: {e}"),
            }
        })
    }
}

impl BenchTarget for HttpTarget {
    fn describe(&self) -> String {
        self.base.clone()
    }

    async fn encode(&self, items: Vec<Arc<EncodedMedia>>) -> Result<Vec<EncodedItem>, TargetError> {
        let url = |item: &EncodedMedia| {
            format!(
                "data:{};base64,{}",
                item.media_type,
                STANDARD.encode(&item.bytes)
            )
        };
        let of = |modality: Modality| -> Vec<String> {
            items
                .iter()
                .filter(|item| item.modality == modality)
                .map(|item| url(item))
                .collect()
        };
        let (images, videos) = (of(Modality::Image), of(Modality::Video));
        let mut body = json!({ "images": images });
        if !videos.is_empty() {
            body["videos"] = json!(videos);
        }
        let v = self
            .call(
                hyper::Method::POST,
                "/v1/encode",
                Some(body.to_string().into_bytes()),
            )
            .await?;
        let bad = |message: String| TargetError::BadResponse {
            path: "/v1/encode".into(),
            message,
        };
        // Each result names its item's place in the request (`index`); images went first.
        let mut results: Vec<Option<EncodedItem>> = vec![None; items.len()];
        for key in ["images", "videos"] {
            let listed = match v.get(key) {
                Some(list) => list
                    .as_array()
                    .ok_or_else(|| bad(format!("`{key}` is not an array")))?,
                None if key == "videos" => continue,
                None => return Err(bad("no `images` array".into())),
            };
            for (i, item) in listed.iter().enumerate() {
                let field = |name: &str| bad(format!("{key}[{i}].{name}"));
                let index = item
                    .get("index")
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n < items.len())
                    .ok_or_else(|| field("index"))?;
                results[index] = Some(EncodedItem {
                    mm_hash: item
                        .get("mm_hash")
                        .and_then(Value::as_str)
                        .ok_or_else(|| field("mm_hash"))?
                        .to_owned(),
                    num_tokens: item
                        .get("num_tokens")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| field("num_tokens"))?,
                    cached: item
                        .get("cached")
                        .and_then(Value::as_bool)
                        .ok_or_else(|| field("cached"))?,
                });
            }
        }
        let answered = results.iter().flatten().count();
        if answered != items.len() {
            return Err(bad(format!(
                "{answered} results for {} items ({} images, {} videos)",
                items.len(),
                images.len(),
                videos.len()
            )));
        }
        Ok(results.into_iter().flatten().collect())
    }

    async fn startup_memory(&self) -> Result<StartupMemory, TargetError> {
        let m = self.metrics_snapshot().await?;
        Ok(StartupMemory {
            before_start: m.before_start.into(),
            after_start: m.after_start.into(),
        })
    }

    async fn memory(&self) -> Result<MemoryPoint, TargetError> {
        Ok(self.metrics_snapshot().await?.memory.into())
    }

    async fn cache_counters(&self) -> Result<EngineCounters, TargetError> {
        Ok(counters_of(&self.metrics_snapshot().await?))
    }

    async fn reset_all(&self) -> Result<(), TargetError> {
        self.call(hyper::Method::POST, "/reset_all", None)
            .await
            .map(|_| ())
    }
}

/// A bench target over an engine in this process (the default of `iris bench`).
pub struct InProcessTarget<E> {
    engine: Arc<E>,
    epd: Option<Arc<Epd>>,
}

impl<E: Engine> InProcessTarget<E> {
    /// A target over `engine`.
    pub fn new(engine: Arc<E>) -> Self {
        Self { engine, epd: None }
    }

    /// The same target sending every prompt through the EC producer of `epd`.
    #[must_use]
    pub fn with_epd(self, epd: Arc<Epd>) -> Self {
        Self {
            epd: Some(epd),
            ..self
        }
    }
}

impl<E: Engine> BenchTarget for InProcessTarget<E> {
    fn describe(&self) -> String {
        "in-process".to_owned()
    }

    async fn encode(&self, items: Vec<Arc<EncodedMedia>>) -> Result<Vec<EncodedItem>, TargetError> {
        let engine_error = |e: EngineError| match e {
            EngineError::Overloaded => TargetError::Refused(e.to_string()),
            _ => TargetError::Engine(e.to_string()),
        };
        let mut permit = self.engine.admit().map_err(engine_error)?;
        if let Some(epd) = &self.epd {
            let request = EpdRequest {
                items: items
                    .iter()
                    .map(|item| Item {
                        bytes: item.bytes.to_vec(),
                        uuid: None,
                        modality: item.modality,
                        jpeg_sequence: false,
                    })
                    .collect(),
                ..EpdRequest::default()
            };
            let published = epd
                .produce(self.engine.as_ref(), permit, request)
                .await
                .map_err(|e| match e {
                    ProduceError::Engine(e) => engine_error(e),
                    other => TargetError::Engine(other.to_string()),
                })?;
            return Ok(published
                .into_iter()
                .map(|p| EncodedItem {
                    cached: p.stored == Stored::Hit,
                    mm_hash: p.identifier,
                    num_tokens: p.num_tokens,
                })
                .collect());
        }
        // Clips are decoded as `/v1/encode` decodes them.
        let requested = items
            .iter()
            .map(|item| match item.modality {
                Modality::Video => RequestItem::Video(item.bytes.to_vec()),
                // The workload makes images and videos only.
                _ => RequestItem::Image(ImageInput {
                    bytes: item.bytes.to_vec(),
                }),
            })
            .collect();
        let inputs = media_inputs(
            self.engine.as_ref(),
            &mut permit,
            requested,
            &ProcessorOverrides::default(),
        )
        .await
        .map_err(engine_error)?;
        let results = self
            .engine
            .encode(permit, inputs, EncodeOptions::default())
            .await
            .map_err(engine_error)?;
        Ok(results
            .into_iter()
            .map(|r| EncodedItem {
                mm_hash: r.mm_hash,
                num_tokens: r.num_tokens,
                cached: r.cached,
            })
            .collect())
    }

    async fn startup_memory(&self) -> Result<StartupMemory, TargetError> {
        let m = self.engine.metrics_snapshot();
        Ok(StartupMemory {
            before_start: m.before_start.into(),
            after_start: m.after_start.into(),
        })
    }

    async fn memory(&self) -> Result<MemoryPoint, TargetError> {
        Ok(self.engine.metrics_snapshot().memory.into())
    }

    async fn cache_counters(&self) -> Result<EngineCounters, TargetError> {
        Ok(counters_of(&self.engine.metrics_snapshot()))
    }

    async fn reset_all(&self) -> Result<(), TargetError> {
        self.engine
            .reset_all()
            .await
            .map(|_| ())
            .map_err(|e| TargetError::Engine(e.to_string()))
    }
}

/// An error and its causes on one line: hyper's own message ("client error (Connect)") leaves
/// the cause (connection refused, DNS failure) to its source chain.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let part = c.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = c.source();
    }
    text
}

async fn sample_memory<T: BenchTarget>(
    target: Arc<T>,
    start: Instant,
    every: Duration,
    out: Arc<Mutex<Vec<TimedPoint>>>,
    stop: Arc<AtomicBool>,
) {
    let mut ticker = tokio::time::interval(every.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        ticker.tick().await;
        // A failed sample leaves a gap in the plot; the checkpoints are read separately.
        if let Ok(point) = target.memory().await
            && let Ok(mut samples) = out.lock()
        {
            samples.push(TimedPoint {
                t_s: start.elapsed().as_secs_f64(),
                point,
            });
        }
    }
}

/// Requests per second the arrival times offer: intervals over the span from the first
/// arrival to the last; `None` when they all arrive at once (or there is only one).
fn offered_rate(offsets: &[Duration]) -> Option<f64> {
    let span = offsets
        .last()?
        .saturating_sub(*offsets.first()?)
        .as_secs_f64();
    (span > 0.0).then(|| (offsets.len() - 1) as f64 / span)
}

/// The outcome of a request whose items had `modalities`, in order.
fn outcome(
    latency: Duration,
    modalities: &[Modality],
    result: Result<Vec<EncodedItem>, TargetError>,
) -> RequestOutcome {
    let count = |wanted: Modality, cached: Option<&[EncodedItem]>| {
        let n = modalities
            .iter()
            .enumerate()
            .filter(|&(i, &m)| {
                m == wanted && cached.is_none_or(|items| items.get(i).is_some_and(|r| r.cached))
            })
            .count();
        u64::try_from(n).unwrap_or(u64::MAX)
    };
    let (images, videos) = (count(Modality::Image, None), count(Modality::Video, None));
    match result {
        Ok(items) => RequestOutcome {
            latency,
            images,
            videos,
            tokens: items.iter().map(|i| i.num_tokens).sum(),
            cached_images: count(Modality::Image, Some(&items)),
            cached_videos: count(Modality::Video, Some(&items)),
            error: None,
        },
        Err(err) => RequestOutcome {
            latency,
            images,
            videos,
            tokens: 0,
            cached_images: 0,
            cached_videos: 0,
            error: Some(RequestError {
                kind: match err {
                    TargetError::Refused(_) => ErrorKind::Refused,
                    TargetError::Aborted => ErrorKind::Aborted,
                    _ => ErrorKind::Failed,
                },
                message: err.to_string(),
            }),
        },
    }
}

#[cfg(test)]
mod tests;
