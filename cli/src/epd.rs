//! iris as vLLM's encoder instance (encoder disaggregation, "EPD"): the EC producer behind
//! `POST /v1/chat/completions` and `iris bench --ec-transfer-config`.
//!
//! For each request: every image gets vLLM's identifier (its hasher over the original bytes,
//! or the client's uuid); the engine preprocesses the images (grids, through the processor
//! cache); then the configured connector publishes the rows.
//!
//! - Shared storage (`ECExampleConnector`): items whose entry is already in the store are not
//!   encoded again; the others are encoded in one engine request and written to the store off
//!   the engine step, on the blocking pool. Concurrent requests for one identifier encode and
//!   write once: the first claims it and the others wait for its entry. A claim is never held
//!   while waiting for another, so requests that share several items cannot deadlock.
//! - Mooncake push (`ECMooncakeConnector`): the request names its consumer and one transfer id
//!   per item; iris reserves room on every shard of the consumer first, encodes (in one engine
//!   request) only the items some shard does not hold yet, and writes the rows into the
//!   reservations before replying. The push runs in the request's task, after the engine has
//!   returned the rows: it never holds an engine step. Any failure cancels every reservation.
//!   With `--allowed-ec-consumers`, a consumer off the list is refused (403) before anything
//!   is encoded, and an address it answers with off the list fails the push.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use iris_core::budget::Modality;
use iris_core::engine::api::{
    EncodeOptions, EngineError, ImageInput, ImagePlan, ImageResult, MediaInput, OutputLayout,
    ProcessorOverrides, VideoInput,
};
use iris_core::preprocess::ImageSize;
use iris_core::preprocess::video::ffmpeg::{DecodedVideo, OpenedClip};
use iris_core::preprocess::video::{SamplingOptions, VideoLoader, qwen3_timestamps};
use iris_ec::config::{ConnectorConfig, EcRole, EcTransferConfig};
use iris_ec::identifier::{
    DEFAULT_BACKGROUND, HashAlgorithm, HashFactors, IdentifierError, ItemSource, JsonValue,
    OrderedJson, VideoSource, item_identifier, merge_media_io_kwargs, video_identifier,
};
use iris_ec::mooncake::{ConsumerAllowList, MooncakeProducer, PushError, PushFailure, PushSpec};
use iris_ec::storage::{
    Claim, ClaimGuard, EcDtype, EntryShape, Lookup, SharedStorage, StoreError, StoreStats,
    check_identifier, pack_rows, wait_for_owner,
};
use iris_plugin::DType;

use crate::http::Engine;

/// Push latency buckets in seconds: 100 us to about 6.6 s, doubling.
const PUSH_BUCKETS: [f64; 17] = [
    1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3, 6.4e-3, 1.28e-2, 2.56e-2, 5.12e-2, 0.1024, 0.2048,
    0.4096, 0.8192, 1.6384, 3.2768, 6.5536,
];

/// Write latency buckets in seconds: 50 us to about 3.3 s, doubling.
const WRITE_BUCKETS: [f64; 17] = [
    5e-5, 1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3, 6.4e-3, 1.28e-2, 2.56e-2, 5.12e-2, 0.1024,
    0.2048, 0.4096, 0.8192, 1.6384, 3.2768,
];

/// Flags of iris as vLLM's encoder instance (names as vLLM's where the meaning is the same).
#[derive(Debug, Clone, Default, Args)]
pub struct EpdArgs {
    /// vLLM's EC transfer configuration, as JSON. Shared storage: `{"ec_connector":
    /// "ECExampleConnector", "ec_role": "ec_producer", "ec_connector_extra_config":
    /// {"shared_storage_path": DIR}}`: `/v1/chat/completions` writes every image's embeddings
    /// where vLLM's consumers read them. Mooncake push: `{"ec_connector": "ECMooncakeConnector",
    /// "ec_role": "ec_producer", "ec_connector_extra_config": {"mooncake_protocol": "tcp",
    /// "control_timeout_s": 30}}`: each request's images are pushed into the consumer its
    /// `ec_transfer_params.consumer_zmq` names, over Mooncake's TCP transport.
    #[arg(long, value_name = "JSON")]
    pub ec_transfer_config: Option<String>,
    /// ECMooncakeConnector only: the hosts pushes may connect to, as host names, IP
    /// addresses or CIDR blocks, no ports (repeat or separate with commas). A request naming
    /// another consumer is refused (403), and so is a push to an address the consumer names
    /// off the list (502). Default: any host, as vLLM's producer.
    #[arg(long, value_name = "ENTRY", value_delimiter = ',')]
    pub allowed_ec_consumers: Vec<String>,
    /// Bound of the bytes of entries this process keeps in the shared store; beyond it the
    /// entries it wrote that were least recently written or found are deleted, apart from those
    /// of requests being answered (vLLM never deletes entries). Default: no bound.
    #[arg(long, value_name = "BYTES")]
    pub ec_storage_max_bytes: Option<u64>,
    /// Hash of item identifiers: blake3 (vLLM's default), sha256 or sha512. Must equal the
    /// consumers' `--mm-hasher-algorithm`.
    #[arg(long, default_value = "blake3", value_name = "ALGORITHM")]
    pub mm_hasher_algorithm: HashAlgorithm,
    /// The model id hashed into identifiers: the consumers' `--model` string exactly as they
    /// were started with it (e.g. `Qwen/Qwen2.5-VL-3B-Instruct`). Default: `--model`, or the
    /// `--model-dir` path as given.
    #[arg(long, value_name = "ID")]
    pub model_id: Option<String>,
    /// The model name `/v1/models` lists and requests must name. Default: the model id.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Server-wide media I/O options per modality, as vLLM's `--media-io-kwargs` (JSON, e.g.
    /// `{"image": {"rgba_background_color": [0, 0, 0]}}`); a request's `media_io_kwargs` are
    /// merged over them.
    #[arg(long, value_name = "JSON")]
    pub media_io_kwargs: Option<String>,
}

/// The parsed EPD settings of a server.
#[derive(Debug)]
pub struct Epd {
    /// The producer, when `--ec-transfer-config` is set.
    pub producer: Option<Arc<Producer>>,
    /// The id hashed into identifiers.
    pub model_id: String,
    /// The name served in `/v1/models`.
    pub served_model_name: String,
    /// Identifier hash.
    pub algorithm: HashAlgorithm,
    /// `--media-io-kwargs`.
    pub server_media_io: Option<OrderedJson>,
}

impl EpdArgs {
    /// Checks the flags; `default_model_id` is the `--model` (or `--model-dir`) string, and
    /// `file_config` the config file's `[ec_transfer_config]`, used when the flag is absent.
    ///
    /// # Errors
    /// A bad `--ec-transfer-config` or `--media-io-kwargs`, or a store folder that cannot be
    /// used, with what is supported.
    pub fn resolve(
        &self,
        default_model_id: &str,
        file_config: Option<&serde_json::Value>,
    ) -> anyhow::Result<Epd> {
        let model_id = self
            .model_id
            .clone()
            .unwrap_or_else(|| default_model_id.to_owned());
        let server_media_io = self
            .media_io_kwargs
            .as_deref()
            .map(|text| OrderedJson::parse("--media-io-kwargs", text))
            .transpose()?;
        // The server-wide options are checked at start, not in the first request.
        HashFactors {
            mm_processor_kwargs: None,
            media_io_kwargs: server_media_io.clone(),
        }
        .background_color()
        .context("--media-io-kwargs")?;
        let config = match (&self.ec_transfer_config, file_config) {
            (Some(json), _) => Some(EcTransferConfig::parse(json)?),
            (None, Some(serde_json::Value::Object(map))) => {
                Some(EcTransferConfig::from_map(map).context("config file, [ec_transfer_config]")?)
            }
            (None, Some(_)) => anyhow::bail!("config file: [ec_transfer_config] must be a table"),
            (None, None) => None,
        };
        if config.is_none() && self.ec_storage_max_bytes.is_some() {
            anyhow::bail!("--ec-storage-max-bytes needs an EC transfer configuration");
        }
        // Absent, any consumer may be named: vLLM's proxy names them, and vLLM's producer
        // connects to each.
        let allowed_consumers = if self.allowed_ec_consumers.is_empty() {
            None
        } else {
            let pushes = config
                .as_ref()
                .is_some_and(|c| matches!(c.connector, ConnectorConfig::Mooncake(_)));
            if !pushes {
                anyhow::bail!(
                    "--allowed-ec-consumers restricts the consumers ECMooncakeConnector pushes to; this server has {}, which connects to no consumer",
                    config.as_ref().map_or_else(
                        || "no EC transfer configuration".to_owned(),
                        |c| format!("the {} connector", c.connector.name())
                    )
                );
            }
            Some(
                ConsumerAllowList::parse(&self.allowed_ec_consumers)
                    .context("--allowed-ec-consumers")?,
            )
        };
        let producer = match config {
            None => None,
            Some(config) => {
                let connector = match &config.connector {
                    ConnectorConfig::SharedStorage { path } => {
                        let store = SharedStorage::open(path.clone(), self.ec_storage_max_bytes)?;
                        let write_seconds = prometheus::Histogram::with_opts(
                            prometheus::HistogramOpts::new(
                                "iris_ec_store_write_seconds",
                                "Latency of one EC store entry's write (first byte to rename), in seconds",
                            )
                            .buckets(WRITE_BUCKETS.to_vec()),
                        )?;
                        Connector::SharedStorage(Arc::new(StorageConnector {
                            store,
                            write_seconds,
                            path: path.clone(),
                        }))
                    }
                    ConnectorConfig::Mooncake(settings) => {
                        if self.ec_storage_max_bytes.is_some() {
                            anyhow::bail!(
                                "--ec-storage-max-bytes bounds the shared-storage connector's store; ECMooncakeConnector keeps nothing (the consumers own their receive pools)"
                            );
                        }
                        let name = format!("iris-{}", std::process::id());
                        let mut pusher = MooncakeProducer::new(*settings, name);
                        if let Some(allowed) = allowed_consumers.clone() {
                            pusher = pusher.with_allowed_consumers(allowed);
                        }
                        Connector::Mooncake {
                            pusher,
                            metrics: PushMetrics::new()?,
                            control_timeout_s: settings.control_timeout.as_secs_f64(),
                        }
                    }
                    other => anyhow::bail!(
                        "--ec-transfer-config: connector {} is not supported",
                        other.name()
                    ),
                };
                Some(Arc::new(Producer {
                    connector,
                    role: config.role,
                    engine_id: config.engine_id,
                }))
            }
        };
        Ok(Epd {
            producer,
            served_model_name: self
                .served_model_name
                .clone()
                .unwrap_or_else(|| model_id.clone()),
            model_id,
            algorithm: self.mm_hasher_algorithm,
            server_media_io,
        })
    }
}

/// The EC producer: the configured connector and its settings.
#[derive(Debug)]
pub struct Producer {
    connector: Connector,
    role: EcRole,
    engine_id: Option<String>,
}

/// The connector a producer publishes through.
#[derive(Debug)]
enum Connector {
    /// `ECExampleConnector`.
    SharedStorage(Arc<StorageConnector>),
    /// `ECMooncakeConnector`.
    Mooncake {
        pusher: MooncakeProducer,
        metrics: PushMetrics,
        control_timeout_s: f64,
    },
}

/// The shared-storage connector: the store and its settings.
#[derive(Debug)]
struct StorageConnector {
    store: SharedStorage,
    path: PathBuf,
    /// Latency of each entry's write, from its first byte to the rename.
    write_seconds: prometheus::Histogram,
}

/// The push connector's metrics (`iris_ec_push_*`).
#[derive(Debug, Clone)]
pub struct PushMetrics {
    /// Items pushed and completed (an item counts once however many shards took it).
    pushes: prometheus::IntCounter,
    /// Items every shard already held: reserved, not written.
    cached: prometheus::IntCounter,
    /// Bytes written over the data wire, all shards.
    bytes: prometheus::IntCounter,
    /// Failed pushes by reason.
    failures: prometheus::IntCounterVec,
    /// From the first reservation to the last completion, per request.
    seconds: prometheus::Histogram,
}

impl PushMetrics {
    fn new() -> prometheus::Result<Self> {
        let failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "iris_ec_push_failures_total",
                "Requests whose push to an EC consumer failed, by reason",
            ),
            &["reason"],
        )?;
        // Every reason is exported from the start, at zero, so that rates work at once.
        for failure in PushFailure::ALL {
            failures.with_label_values(&[failure.label()]);
        }
        Ok(Self {
            pushes: prometheus::IntCounter::new(
                "iris_ec_pushes_total",
                "Items pushed to EC consumers and completed",
            )?,
            cached: prometheus::IntCounter::new(
                "iris_ec_push_cached_total",
                "Items an EC consumer already held: reserved, not encoded nor written",
            )?,
            bytes: prometheus::IntCounter::new(
                "iris_ec_push_bytes_total",
                "Bytes written to EC consumers over Mooncake's TCP transport (all shards)",
            )?,
            failures,
            seconds: prometheus::Histogram::with_opts(
                prometheus::HistogramOpts::new(
                    "iris_ec_push_seconds",
                    "Latency of one request's push, first reservation to last completion, in seconds",
                )
                .buckets(PUSH_BUCKETS.to_vec()),
            )?,
        })
    }

    /// The collectors, for the server's registry.
    #[must_use]
    pub fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.pushes.clone()),
            Box::new(self.cached.clone()),
            Box::new(self.bytes.clone()),
            Box::new(self.failures.clone()),
            Box::new(self.seconds.clone()),
        ]
    }

    fn failed(&self, err: &PushError) {
        self.failures
            .with_label_values(&[err.failure.label()])
            .inc();
    }
}

impl Producer {
    /// The histogram of store write latencies (shared-storage connector only).
    #[must_use]
    pub fn write_seconds(&self) -> Option<&prometheus::Histogram> {
        match &self.connector {
            Connector::SharedStorage(storage) => Some(&storage.write_seconds),
            Connector::Mooncake { .. } => None,
        }
    }

    /// The push metrics (push connector only).
    #[must_use]
    pub fn push_metrics(&self) -> Option<&PushMetrics> {
        match &self.connector {
            Connector::Mooncake { metrics, .. } => Some(metrics),
            Connector::SharedStorage(_) => None,
        }
    }

    /// The store's counters (zero for the push connector, which keeps no store).
    #[must_use]
    pub fn stats(&self) -> StoreStats {
        match &self.connector {
            Connector::SharedStorage(storage) => storage.store.stats(),
            Connector::Mooncake { .. } => StoreStats::default(),
        }
    }

    /// The settings as JSON, for `/server_info` and reports.
    #[must_use]
    pub fn info_json(&self) -> serde_json::Value {
        match &self.connector {
            Connector::SharedStorage(storage) => serde_json::json!({
                "ec_connector": iris_ec::config::SHARED_STORAGE_CONNECTOR,
                "ec_role": self.role.as_str(),
                "engine_id": self.engine_id,
                "shared_storage_path": storage.path,
                "max_bytes": storage.store.max_bytes(),
            }),
            Connector::Mooncake {
                pusher,
                control_timeout_s,
                ..
            } => serde_json::json!({
                "ec_connector": iris_ec::config::MOONCAKE_CONNECTOR,
                "ec_role": self.role.as_str(),
                "engine_id": self.engine_id,
                "mooncake_protocol": "tcp",
                "control_timeout_s": control_timeout_s,
                // null: any consumer (--allowed-ec-consumers not given).
                "allowed_ec_consumers": pusher.allowed_consumers().map(ToString::to_string),
            }),
        }
    }
}

/// One media item of a request, as the client sent it.
#[derive(Debug, Clone)]
pub struct Item {
    /// The original encoded bytes (an image file, or a video clip).
    pub bytes: Vec<u8>,
    /// The part's `uuid`, when given.
    pub uuid: Option<String>,
    /// An image or a video.
    pub modality: Modality,
    /// A video sent as a JPEG frame list (`data:video/jpeg;base64,F1,F2,...`): `bytes` are the
    /// base64 text after the comma, as vLLM keeps (and hashes) them.
    pub jpeg_sequence: bool,
}

/// Where a request's items are pushed: what vLLM's proxy puts in `ec_transfer_params` when it
/// runs with `--ec-consumer-zmq-addrs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The consumer's control address (`consumer_zmq`, `tcp://host:port`).
    pub consumer_zmq: String,
    /// One transfer id per item, in item order (`ec_items[i].transfer_id`).
    pub transfer_ids: Vec<String>,
    /// `ec_items[i].mm_hash` where the proxy named it: it must equal the item's identifier.
    pub mm_hashes: Vec<Option<String>>,
}

/// What a request asks of the encoder instance.
#[derive(Debug, Clone, Default)]
pub struct EpdRequest {
    /// The images, in request order.
    pub items: Vec<Item>,
    /// The consumer to push to, when the request names one.
    pub push: Option<PushTarget>,
    /// The request's `mm_processor_kwargs`.
    pub mm_processor_kwargs: Option<OrderedJson>,
    /// The request's `media_io_kwargs`.
    pub media_io_kwargs: Option<OrderedJson>,
}

/// How an item's entry came to be in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Encoded and written by this request.
    Written,
    /// Already in the store (or written meanwhile by a concurrent request): not encoded.
    Hit,
    /// Written into the consumer's reservations (push connector).
    Pushed,
    /// No store configured, or no consumer named: encoded, not published.
    NotPublished,
}

/// One item's outcome, in request order.
#[derive(Debug, Clone)]
pub struct Published {
    /// vLLM's identifier of the item.
    pub identifier: String,
    /// An image or a video.
    pub modality: Modality,
    /// Qwen3-VL's seconds of each temporal group of a video (the `timestamps` its processor
    /// gives and an EC consumer requires); `None` otherwise.
    pub timestamps: Option<Vec<f64>>,
    /// Grid `[t, h, w]` in patches.
    pub grid_thw: [u32; 3],
    /// Embedding tokens (rows of the entry).
    pub num_tokens: u64,
    /// What happened to its entry.
    pub stored: Stored,
    /// The transfer id it was pushed under (push connector).
    pub transfer_id: Option<String>,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The request is unusable: a 400 with `code`.
    #[error("{message}")]
    BadRequest {
        /// Stable code.
        code: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Writing to the store failed: a 500 naming the path and the reason.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// The request may not do what it asks: a 403 with `code`.
    #[error("{message}")]
    Forbidden {
        /// Stable code.
        code: &'static str,
        /// What is refused, and which setting refuses it.
        message: String,
    },
    /// Pushing to a consumer failed: a 502 (504 for a timeout) naming the consumer and reason.
    #[error("{0}")]
    Push(#[from] PushError),
    /// A fault inside iris.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<IdentifierError> for ProduceError {
    fn from(err: IdentifierError) -> Self {
        Self::BadRequest {
            code: "invalid_mm_kwargs",
            message: err.to_string(),
        }
    }
}

/// The store's element type for an engine dtype.
fn store_dtype(dtype: DType) -> Result<EcDtype, ProduceError> {
    match dtype {
        DType::F32 => Ok(EcDtype::F32),
        DType::F16 => Ok(EcDtype::F16),
        DType::BF16 => Ok(EcDtype::Bf16),
        other => Err(ProduceError::Internal(format!(
            "the engine runs in {other}, which has no EC store dtype"
        ))),
    }
}

/// The processor settings of `mm_processor_kwargs` and the background colour of the effective
/// `media_io_kwargs`. Keys iris does not implement are refused by name.
///
/// # Errors
/// [`ProduceError::BadRequest`] naming the key.
pub fn processor_overrides(factors: &HashFactors) -> Result<ProcessorOverrides, ProduceError> {
    let mut overrides = ProcessorOverrides::default();
    let bad = |message: String| ProduceError::BadRequest {
        code: "invalid_mm_processor_kwargs",
        message,
    };
    for (key, value) in factors
        .mm_processor_kwargs
        .as_ref()
        .map(OrderedJson::members)
        .unwrap_or_default()
    {
        let pixels = || {
            let number = match value {
                JsonValue::Int(v) => u64::try_from(*v).ok(),
                JsonValue::UInt(v) => Some(*v),
                _ => None,
            };
            number.filter(|v| *v > 0).ok_or_else(|| {
                bad(format!(
                    "mm_processor_kwargs.{key} must be a positive integer"
                ))
            })
        };
        match key.as_str() {
            "min_pixels" => overrides.min_pixels = Some(pixels()?),
            "max_pixels" => overrides.max_pixels = Some(pixels()?),
            // vLLM hands these to the video processor, which samples nothing from frames its
            // loader already chose (`do_sample_frames` false): they change the identifier (a
            // hash factor), not the rows. Where the loader read every frame, Qwen3-VL's
            // processor re-samples with them; `check_sampling_kwargs` refuses that case.
            "fps" => {
                if !value.as_f64().is_some_and(|r| r.is_finite() && r > 0.0) {
                    return Err(bad(
                        "mm_processor_kwargs.fps must be a positive number (one for every video; per-video lists are not supported)".to_owned(),
                    ));
                }
            }
            "num_frames" => {
                pixels().map_err(|_| {
                    bad("mm_processor_kwargs.num_frames must be a positive integer (one for every video; per-video lists are not supported)".to_owned())
                })?;
            }
            other => {
                return Err(bad(format!(
                    "mm_processor_kwargs key `{other}` is not supported by iris (supported: min_pixels, max_pixels, fps, num_frames)"
                )));
            }
        }
    }
    // Only a colour other than vLLM's default changes what the engine does: the model's own
    // alpha handling already pastes on white.
    let background = factors.background_color()?;
    if background != DEFAULT_BACKGROUND {
        overrides.background = Some(background);
    }
    Ok(overrides)
}

impl Epd {
    /// The hash factors of a request: its `mm_processor_kwargs`, and its `media_io_kwargs`
    /// merged over the server's.
    ///
    /// # Errors
    /// [`ProduceError::BadRequest`] for kwargs that are not objects of objects.
    pub fn factors(&self, request: &EpdRequest) -> Result<HashFactors, ProduceError> {
        Ok(HashFactors {
            mm_processor_kwargs: request.mm_processor_kwargs.clone(),
            media_io_kwargs: merge_media_io_kwargs(
                self.server_media_io.as_ref(),
                request.media_io_kwargs.as_ref(),
            )?,
        })
    }

    /// vLLM's identifier of every item of a request, in order; `videos[i]` is item `i`'s
    /// decoded video, `None` for an image.
    ///
    /// # Errors
    /// [`ProduceError::BadRequest`] for an image whose header cannot be read, or (with the
    /// shared-storage connector) a uuid that cannot name one entry of the store.
    pub fn identifiers(
        &self,
        items: &[Item],
        videos: &[Option<Arc<DecodedVideo>>],
        factors: &HashFactors,
    ) -> Result<Vec<String>, ProduceError> {
        let background = factors.background_color()?;
        let stores = matches!(
            self.producer.as_ref().map(|p| &p.connector),
            Some(Connector::SharedStorage(_))
        );
        items
            .iter()
            .zip(videos)
            .enumerate()
            .map(|(index, (item, video))| {
                let identifier = match video {
                    Some(video) => {
                        let source = VideoSource {
                            uuid: item.uuid.as_deref(),
                            bytes: &item.bytes,
                            frames: &video.frames,
                            metadata: &video.metadata,
                        };
                        video_identifier(self.algorithm, &self.model_id, &source, factors)
                    }
                    None => {
                        let converted = iris_core::preprocess::needs_rgb_conversion(&item.bytes)
                            .map_err(|err| ProduceError::BadRequest {
                                code: iris_core::engine::preprocess_error_code(&err),
                                message: format!("image {index}: {err}"),
                            })?
                            .then_some(background);
                        let source = ItemSource {
                            uuid: item.uuid.as_deref(),
                            bytes: &item.bytes,
                            converted,
                        };
                        item_identifier(self.algorithm, &self.model_id, &source, factors)
                    }
                };
                // Only a store makes a file of the identifier; a push (or no connector) sends
                // it as a string, any string, as vLLM does.
                if stores {
                    check_identifier(&identifier).map_err(|reason| ProduceError::BadRequest {
                        code: "invalid_uuid",
                        message: format!(
                            "{} {index}: uuid {:?} cannot name an EC store entry: {reason}",
                            item.modality,
                            item.uuid.as_deref().unwrap_or_default()
                        ),
                    })?;
                }
                Ok(identifier)
            })
            .collect()
    }

    /// Runs one request: identifiers, grids, store look-ups, one engine request for what is
    /// missing, and the writes. Consumes `permit` (the request's admission slot).
    ///
    /// # Errors
    /// [`ProduceError`]: bad input (400), the engine's refusal or failure, a store write that
    /// failed (500, naming the path; nothing partial is left).
    pub async fn produce<E: Engine>(
        &self,
        engine: &E,
        mut permit: E::Permit,
        request: EpdRequest,
    ) -> Result<Vec<Published>, ProduceError> {
        let factors = self.factors(&request)?;
        let overrides = processor_overrides(&factors)?;
        if let Some(target) = &request.push {
            check_target_count(target, request.items.len())?;
            check_consumer_allowed(self.producer.as_deref(), target)?;
        }
        let videos = load_videos(engine, &mut permit, &request.items, &factors, &overrides).await?;
        check_sampling_kwargs(engine.video_processing().loader, &videos, &factors)?;
        let identifiers = self.identifiers(&request.items, &videos, &factors)?;
        if let Some(target) = &request.push {
            check_target(target, &identifiers)?;
        }
        let described = describe(engine, &videos);
        let images: Vec<MediaInput> = request
            .items
            .into_iter()
            .zip(videos)
            .map(|(item, video)| match video {
                Some(video) => MediaInput::Video(VideoInput { video }),
                None => MediaInput::Image(ImageInput { bytes: item.bytes }),
            })
            .collect();
        let plans = engine.plan(&mut permit, &images, &overrides).await?;
        let connector = self.producer.as_ref().map(|p| &p.connector);
        let producer = match (connector, request.push) {
            (
                Some(Connector::Mooncake {
                    pusher, metrics, ..
                }),
                Some(target),
            ) => {
                let batch = PushBatch {
                    images,
                    identifiers,
                    plans,
                    described,
                    overrides,
                };
                return push(engine, permit, pusher, metrics, batch, target).await;
            }
            (None, Some(_)) => {
                return Err(ProduceError::BadRequest {
                    code: "ec_transfer_not_configured",
                    message: "ec_transfer_params names a consumer, but this server has no EC connector: start iris with --ec-transfer-config using ECMooncakeConnector".to_owned(),
                });
            }
            (Some(Connector::SharedStorage(_)), Some(_)) => {
                return Err(ProduceError::BadRequest {
                    code: "ec_transfer_not_configured",
                    message: "ec_transfer_params names a consumer to push to, but this server publishes to a shared store (ECExampleConnector): run the proxy without --ec-consumer-zmq-addrs, or start iris with ECMooncakeConnector".to_owned(),
                });
            }
            // As vLLM's producer: a request that names no consumer is encoded, not pushed.
            (None | Some(Connector::Mooncake { .. }), None) => {
                let results = engine
                    .encode(permit, images, options(overrides, false))
                    .await?;
                return Ok(identifiers
                    .into_iter()
                    .zip(results)
                    .zip(described)
                    .map(|((identifier, r), (modality, timestamps))| Published {
                        identifier,
                        modality,
                        timestamps,
                        grid_thw: r.grid_thw,
                        num_tokens: r.num_tokens,
                        stored: Stored::NotPublished,
                        transfer_id: None,
                    })
                    .collect());
            }
            (Some(Connector::SharedStorage(storage)), None) => storage,
        };
        let layout = engine.output_layout();
        let dtype = store_dtype(layout.dtype)?;
        // The first index of each distinct identifier: a repeated image is one entry.
        let mut first: HashMap<&str, usize> = HashMap::new();
        for (index, id) in identifiers.iter().enumerate() {
            first.entry(id.as_str()).or_insert(index);
        }
        let mut unique: Vec<usize> = first.values().copied().collect();
        unique.sort_unstable();
        let shape_of = |index: usize| entry_shape(&plans[index], &layout, dtype);

        // The entries this reply will name stay until it is built: no write of this request
        // (or of another) evicts them meanwhile.
        let _pins = producer
            .store
            .pin(unique.iter().map(|&index| identifiers[index].as_str()));
        let mut stored = vec![Stored::Hit; identifiers.len()];
        let mut owned = Vec::new();
        let mut waiting = Vec::new();
        for &index in &unique {
            match producer.store.claim(&identifiers[index]) {
                Claim::Owner(guard) => owned.push((index, guard)),
                Claim::Wait(receiver) => waiting.push((index, receiver)),
            }
        }
        // Our own items first, so that no claim is held while waiting for another's.
        let mut missing = Vec::new();
        for (index, guard) in owned {
            let lookup = self
                .lookup(producer, &identifiers[index], shape_of(index))
                .await?;
            if lookup != Lookup::Hit {
                missing.push((index, Some(guard)));
            }
        }
        let batch = Batch {
            producer,
            images: &images,
            identifiers: &identifiers,
            plans: &plans,
            overrides,
            layout: &layout,
            dtype,
        };
        let mut permit = Some(permit);
        self.encode_and_write(engine, &batch, &mut permit, missing, &mut stored)
            .await?;
        // Then the items another request was producing: its entry, or (if it failed) our own.
        let mut missing: Vec<(usize, Option<ClaimGuard>)> = Vec::new();
        for (index, receiver) in waiting {
            wait_for_owner(receiver).await;
            let lookup = self
                .lookup(producer, &identifiers[index], shape_of(index))
                .await?;
            if lookup != Lookup::Hit {
                missing.push((index, None));
            }
        }
        self.encode_and_write(engine, &batch, &mut permit, missing, &mut stored)
            .await?;
        // Repeats share their first occurrence's outcome.
        for (index, id) in identifiers.iter().enumerate() {
            stored[index] = stored[first[id.as_str()]];
        }
        Ok(identifiers
            .into_iter()
            .zip(plans)
            .zip(stored)
            .zip(described)
            .map(
                |(((identifier, plan), stored), (modality, timestamps))| Published {
                    identifier,
                    modality,
                    timestamps,
                    grid_thw: plan.grid_thw,
                    num_tokens: plan.num_tokens,
                    stored,
                    transfer_id: None,
                },
            )
            .collect())
    }

    async fn lookup(
        &self,
        producer: &Arc<StorageConnector>,
        identifier: &str,
        shape: EntryShape,
    ) -> Result<Lookup, ProduceError> {
        let producer = Arc::clone(producer);
        let identifier = identifier.to_owned();
        tokio::task::spawn_blocking(move || producer.store.lookup(&identifier, &shape))
            .await
            .map_err(|err| ProduceError::Internal(format!("EC store look-up task failed: {err}")))?
            .map_err(ProduceError::from)
    }

    /// Encodes the `missing` items of `batch` in one engine request and writes each entry.
    ///
    /// The items' claims (`G`) go with the write into its blocking task: a request whose client
    /// hangs up drops its future, not the write, and the claim must hold until the entry is
    /// written, or waiters would find it missing, encode it again, and write it beside a
    /// writer that holds no claim.
    async fn encode_and_write<E: Engine, G: Send + 'static>(
        &self,
        engine: &E,
        batch: &Batch<'_>,
        permit: &mut Option<E::Permit>,
        missing: Vec<(usize, Option<G>)>,
        stored: &mut [Stored],
    ) -> Result<(), ProduceError> {
        if missing.is_empty() {
            return Ok(());
        }
        let (missing, claims): (Vec<usize>, Vec<Option<G>>) = missing.into_iter().unzip();
        // The request's own slot serves its first engine request; a second (items another
        // request failed to produce) takes a slot of its own.
        let slot = match permit.take() {
            Some(permit) => permit,
            None => engine.admit()?,
        };
        let inputs = missing
            .iter()
            .map(|index| batch.images[*index].clone())
            .collect();
        let results = engine
            .encode(slot, inputs, options(batch.overrides, true))
            .await?;
        let mut writes = Vec::with_capacity(missing.len());
        for (index, result) in missing.iter().zip(results) {
            let shape = entry_shape(&batch.plans[*index], batch.layout, batch.dtype);
            writes.push((batch.identifiers[*index].clone(), shape, result));
        }
        let producer = Arc::clone(batch.producer);
        tokio::task::spawn_blocking(move || -> Result<(), ProduceError> {
            // Released when the writes are done (or failed), whoever still waits on them.
            let _claims = claims;
            for (identifier, shape, result) in writes {
                let rows = entry_rows(&result, &shape)?;
                let report = producer.store.write(&identifier, &shape, &rows)?;
                producer.write_seconds.observe(report.elapsed.as_secs_f64());
            }
            Ok(())
        })
        .await
        .map_err(|err| ProduceError::Internal(format!("EC store write task failed: {err}")))??;
        for index in missing {
            stored[index] = Stored::Written;
        }
        Ok(())
    }
}

/// One request's items and what is known of them, for [`push`].
struct PushBatch {
    images: Vec<MediaInput>,
    identifiers: Vec<String>,
    plans: Vec<ImagePlan>,
    described: Vec<(Modality, Option<Vec<f64>>)>,
    overrides: ProcessorOverrides,
}

/// Decodes the request's videos, sampling as the effective `media_io_kwargs.video` asks;
/// `None` for each image. Every video is first opened (a clip probed and sampled, a frame
/// list's frames counted and its first frame's header read; all at once, each on the blocking
/// pool), then its tokens are charged to `permit` under `overrides`, and only then are the
/// videos decoded (all at once): a request's decoded frames are held to the admission's token
/// bound, and a video no step could take is refused before any frame is decoded.
async fn load_videos<E: Engine>(
    engine: &E,
    permit: &mut E::Permit,
    items: &[Item],
    factors: &HashFactors,
    overrides: &ProcessorOverrides,
) -> Result<Vec<Option<Arc<DecodedVideo>>>, ProduceError> {
    if items.iter().all(|item| item.modality == Modality::Image) {
        return Ok(vec![None; items.len()]);
    }
    let loader = engine.video_processing().loader;
    let kwargs = Arc::new(video_kwargs(factors, loader)?);
    let opens = items.iter().enumerate().map(|(index, item)| {
        let kwargs = Arc::clone(&kwargs);
        async move {
            if item.modality == Modality::Image {
                return Ok(None);
            }
            open_video(engine, item, kwargs)
                .await
                .map(Some)
                .map_err(|err| ProduceError::Engine(name_video(index, err)))
        }
    });
    let opened = futures::future::try_join_all(opens).await?;
    for (index, video) in opened.iter().enumerate() {
        if let Some(video) = video {
            let (frames, size) = video.shape();
            engine.reserve_video(permit, index, frames, size, overrides)?;
        }
    }
    let permit = &*permit;
    let loads = items
        .iter()
        .zip(opened)
        .enumerate()
        .map(|(index, (item, video))| {
            let kwargs = Arc::clone(&kwargs);
            async move {
                let Some(video) = video else {
                    return Ok(None);
                };
                decode_video(engine, item, video, kwargs, engine.hold(permit))
                    .await
                    .map(|video| Some(Arc::new(video)))
                    .map_err(|err| ProduceError::Engine(name_video(index, err)))
            }
        });
    futures::future::try_join_all(loads).await
}

/// Refuses `mm_processor_kwargs` `fps`/`num_frames` for a Qwen3-VL video whose loader read
/// every frame: vLLM then lets transformers' processor sample the frames itself, with those
/// settings, which iris does not reproduce. Elsewhere they are hash factors only.
///
/// # Errors
/// [`ProduceError::BadRequest`] naming the video and the way out (`media_io_kwargs.video`).
fn check_sampling_kwargs(
    loader: VideoLoader,
    videos: &[Option<Arc<DecodedVideo>>],
    factors: &HashFactors,
) -> Result<(), ProduceError> {
    let sets_sampling = factors
        .mm_processor_kwargs
        .as_ref()
        .map(OrderedJson::members)
        .unwrap_or_default()
        .iter()
        .any(|(key, _)| key == "fps" || key == "num_frames");
    if loader != VideoLoader::Qwen3Vl || !sets_sampling {
        return Ok(());
    }
    match videos
        .iter()
        .position(|v| v.as_ref().is_some_and(|v| v.metadata.do_sample_frames))
    {
        Some(index) => Err(ProduceError::BadRequest {
            code: "invalid_mm_processor_kwargs",
            message: format!(
                "video {index}: its loader read every frame, so mm_processor_kwargs fps/num_frames would have Qwen3-VL's processor sample the frames again, which iris does not do; give the sampling as media_io_kwargs.video instead"
            ),
        }),
        None => Ok(()),
    }
}

/// `err` of video `index` of a request, naming the video when it is the client's.
pub(crate) fn name_video(index: usize, err: EngineError) -> EngineError {
    match err {
        EngineError::BadInput { message, code } => EngineError::BadInput {
            message: format!("video {index}: {message}"),
            code,
        },
        other => other,
    }
}

/// A video item opened, not decoded: how many frames it gives, and of what size.
enum OpenedVideo {
    /// A clip, probed and sampled by the engine.
    Clip(OpenedClip),
    /// A JPEG frame list: its frame count and its first frame's size from its header.
    Frames(usize, ImageSize),
}

impl OpenedVideo {
    /// Frames and their size, for the token charge.
    fn shape(&self) -> (usize, ImageSize) {
        match self {
            OpenedVideo::Clip(clip) => (clip.frames(), clip.size()),
            OpenedVideo::Frames(frames, size) => (*frames, *size),
        }
    }
}

/// Opens one video item: a clip through the engine (FFmpeg), a JPEG frame list here, each on
/// the blocking pool.
async fn open_video<E: Engine>(
    engine: &E,
    item: &Item,
    kwargs: Arc<VideoKwargs>,
) -> Result<OpenedVideo, EngineError> {
    if !item.jpeg_sequence {
        if kwargs.frames_indices.is_some()
            || kwargs.total_num_frames.is_some()
            || kwargs.duration.is_some()
        {
            return Err(EngineError::BadInput {
                message: "media_io_kwargs.video frames_indices, total_num_frames and duration describe a JPEG frame list; a clip's come from its container".to_owned(),
                code: "invalid_media_io_kwargs",
            });
        }
        return engine
            .open_video(item.bytes.clone(), kwargs.sampling)
            .await
            .map(OpenedVideo::Clip);
    }
    let payload = item.bytes.clone();
    tokio::task::spawn_blocking(move || {
        let (frames, size) = frame_list_shape(&payload, &kwargs)?;
        Ok(OpenedVideo::Frames(frames, size))
    })
    .await
    .map_err(|err| EngineError::Internal(format!("frame list task failed: {err}")))?
}

/// Decodes one opened video item; `hold` (of the request's permit) is kept until the
/// decoding ends, so that a request whose client hung up stays counted until then.
async fn decode_video<E: Engine>(
    engine: &E,
    item: &Item,
    video: OpenedVideo,
    kwargs: Arc<VideoKwargs>,
    hold: E::Hold,
) -> Result<DecodedVideo, EngineError> {
    match video {
        OpenedVideo::Clip(clip) => engine.decode_video(clip, hold).await,
        OpenedVideo::Frames(..) => {
            let payload = item.bytes.clone();
            tokio::task::spawn_blocking(move || {
                let _hold = hold;
                decode_jpeg_sequence(&payload, &kwargs)
            })
            .await
            .map_err(|err| EngineError::Internal(format!("frame decoding task failed: {err}")))?
        }
    }
}

/// The frames a JPEG frame list gives (the first `num_frames`, all for -1) and its first
/// frame's size, from that frame's header alone.
///
/// # Errors
/// [`EngineError::BadInput`]: not base64 text, a bad `num_frames`, a first frame that is not
/// an image iris decodes or is over the decode limits.
fn frame_list_shape(
    payload: &[u8],
    kwargs: &VideoKwargs,
) -> Result<(usize, ImageSize), EngineError> {
    use iris_core::preprocess::{DecodeLimits, PreprocessError, probe};
    let parts = frame_parts(payload, kwargs)?;
    let first = parts.first().copied().unwrap_or_default();
    let bytes = crate::http::request::decode_base64("frame 0", first).map_err(|err| {
        EngineError::BadInput {
            message: err.message,
            code: "invalid_base64",
        }
    })?;
    let info = probe(&bytes, &DecodeLimits::default()).map_err(|err| EngineError::BadInput {
        code: match err {
            PreprocessError::TooLarge { .. } => "video_too_large",
            ref err => iris_core::engine::preprocess_error_code(err),
        },
        message: format!("frame 0: {err}"),
    })?;
    Ok((parts.len(), info.size))
}

/// A frame list's base64 frames: the first `num_frames` (all for a negative count).
///
/// # Errors
/// [`EngineError::BadInput`] for text that is not UTF-8, or `num_frames` 0.
fn frame_parts<'a>(payload: &'a [u8], kwargs: &VideoKwargs) -> Result<Vec<&'a str>, EngineError> {
    let bad = |code: &'static str, message: &str| EngineError::BadInput {
        message: message.to_owned(),
        code,
    };
    let text = std::str::from_utf8(payload)
        .map_err(|_| bad("invalid_base64", "the frame list is not base64 text"))?;
    Ok(match usize::try_from(kwargs.num_frames) {
        Ok(0) => {
            return Err(bad(
                "invalid_media_io_kwargs",
                "media_io_kwargs.video.num_frames must be greater than 0 or -1",
            ));
        }
        Ok(n) => text.splitn(n + 1, ',').take(n).collect(),
        Err(_) => text.split(',').collect(),
    })
}

/// A JPEG frame list (`data:video/jpeg;base64,F1,F2,...`) as vLLM's `VideoMediaIO.load_base64`
/// reads it: the first `num_frames` frames (all for a negative count), each decoded as an
/// image, all of one size; the metadata from `media_io_kwargs.video` (`fps` 1, the indices
/// `0..n`, `total_num_frames` n, `duration` `total / fps` by default), `video_backend`
/// `jpeg_sequence`, not to be sampled again.
///
/// # Errors
/// [`EngineError::BadInput`]: bad base64, a frame that is not an image iris decodes, frames of
/// different sizes, options that disagree with the frames, frames over the decode limits.
pub fn decode_jpeg_sequence(
    payload: &[u8],
    kwargs: &VideoKwargs,
) -> Result<DecodedVideo, EngineError> {
    decode_frames_within(
        payload,
        kwargs,
        iris_core::preprocess::video::ffmpeg::MAX_DECODED_BYTES,
    )
}

/// [`decode_jpeg_sequence`] with at most `max_decoded_bytes` of decoded RGB in all.
fn decode_frames_within(
    payload: &[u8],
    kwargs: &VideoKwargs,
    max_decoded_bytes: u64,
) -> Result<DecodedVideo, EngineError> {
    use iris_core::preprocess::video::ffmpeg::VideoMetadata;
    use iris_core::preprocess::{AlphaMode, DecodeLimits, PreprocessError, decode_rgb};
    let bad = |code: &'static str, message: String| EngineError::BadInput { message, code };
    let too_large = || {
        bad(
            "video_too_large",
            format!(
                "the frames decode to more than {max_decoded_bytes} bytes (vLLM's VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES)"
            ),
        )
    };
    let parts = frame_parts(payload, kwargs)?;
    let mut frames = Vec::with_capacity(parts.len());
    let mut decoded_bytes = 0u64;
    for (index, part) in parts.iter().enumerate() {
        let bytes = crate::http::request::decode_base64(&format!("frame {index}"), part)
            .map_err(|err| bad("invalid_base64", err.message))?;
        // A frame may decode to what is left of the request's decode bytes, checked from its
        // header before it is decoded (a few kilobytes of one-colour JPEG can claim half a
        // gigabyte).
        let left = max_decoded_bytes - decoded_bytes;
        let limits = DecodeLimits {
            max_pixels: (left / 3).min(DecodeLimits::default().max_pixels),
            ..DecodeLimits::default()
        };
        let (_, rgb) =
            decode_rgb(&bytes, &limits, AlphaMode::CompositeWhite).map_err(|err| match err {
                PreprocessError::TooLarge { .. } => too_large(),
                err => bad(
                    iris_core::engine::preprocess_error_code(&err),
                    format!("frame {index}: {err}"),
                ),
            })?;
        if let Some(first) = frames
            .first()
            .map(|f: &iris_core::preprocess::RgbImage| f.size)
            && rgb.size != first
        {
            return Err(bad(
                "corrupt_video",
                format!(
                    "frame {index} is {}x{}, the first frame {}x{}: a frame list's frames must be of one size",
                    rgb.size.width, rgb.size.height, first.width, first.height
                ),
            ));
        }
        decoded_bytes += rgb.pixels.len() as u64;
        if decoded_bytes > max_decoded_bytes {
            return Err(too_large());
        }
        frames.push(rgb);
    }
    let count = u32::try_from(frames.len()).unwrap_or(u32::MAX);
    let frames_indices = match &kwargs.frames_indices {
        Some(indices) if indices.len() != frames.len() => {
            return Err(bad(
                "invalid_media_io_kwargs",
                format!(
                    "media_io_kwargs.video.frames_indices has {} entries for the {} frames sent",
                    indices.len(),
                    frames.len()
                ),
            ));
        }
        Some(indices) => indices.clone(),
        None => (0..count).collect(),
    };
    let total_num_frames = kwargs.total_num_frames.unwrap_or(count);
    if total_num_frames < count {
        return Err(bad(
            "invalid_media_io_kwargs",
            format!(
                "media_io_kwargs.video.total_num_frames ({total_num_frames}) must be at least the {count} frames sent"
            ),
        ));
    }
    let fps = kwargs.fps.unwrap_or(1.0);
    Ok(DecodedVideo {
        frames,
        metadata: VideoMetadata {
            total_num_frames,
            fps,
            duration: kwargs
                .duration
                .unwrap_or_else(|| f64::from(total_num_frames) / fps),
            video_backend: "jpeg_sequence",
            frames_indices,
            do_sample_frames: false,
        },
    })
}

/// vLLM's `num_frames` of a `VideoMediaIO`: the most frames a JPEG frame list gives.
const DEFAULT_NUM_FRAMES: i64 = 32;

/// What a request's effective `media_io_kwargs.video` asks (see [`video_kwargs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoKwargs {
    /// The loader's sampling of a clip.
    pub sampling: SamplingOptions,
    /// `fps` as given (a frame list's rate; 1 when absent).
    pub fps: Option<f64>,
    /// `num_frames`: the most frames a frame list gives (32 by default, all when negative);
    /// the Qwen loaders ignore it for clips.
    pub num_frames: i64,
    /// A frame list's `frames_indices`.
    pub frames_indices: Option<Vec<u32>>,
    /// A frame list's `total_num_frames`.
    pub total_num_frames: Option<u32>,
    /// A frame list's `duration`, in seconds.
    pub duration: Option<f64>,
}

/// The modality of each item and, for a Qwen3-VL video, its temporal groups' seconds (what
/// the EC metadata carries besides the grid).
fn describe<E: Engine>(
    engine: &E,
    videos: &[Option<Arc<DecodedVideo>>],
) -> Vec<(Modality, Option<Vec<f64>>)> {
    let video = videos
        .iter()
        .any(Option::is_some)
        .then(|| engine.video_processing());
    videos
        .iter()
        .map(|decoded| match (decoded, &video) {
            (Some(decoded), Some(video)) => {
                let timestamps = (video.loader == VideoLoader::Qwen3Vl).then(|| {
                    qwen3_timestamps(
                        &decoded.metadata.frames_indices,
                        decoded.metadata.fps,
                        video.config.temporal_patch_size,
                    )
                });
                (Modality::Video, timestamps)
            }
            _ => (Modality::Image, None),
        })
        .collect()
}

/// What a request's effective `media_io_kwargs.video` asks, as vLLM reads it: the `qwen2_vl`
/// and `qwen3_vl` loaders sample clips by `fps`, `min_frames` and `max_frames` and ignore
/// `num_frames` (which still changes the identifier); a JPEG frame list takes `num_frames`,
/// `fps`, `frames_indices`, `total_num_frames`, `duration` and `do_sample_frames` (false).
/// Keys iris does not implement are refused by name.
///
/// # Errors
/// [`ProduceError::BadRequest`] naming the key.
pub fn video_kwargs(
    factors: &HashFactors,
    loader: VideoLoader,
) -> Result<VideoKwargs, ProduceError> {
    let mut kwargs = VideoKwargs {
        sampling: SamplingOptions::default(),
        fps: None,
        num_frames: DEFAULT_NUM_FRAMES,
        frames_indices: None,
        total_num_frames: None,
        duration: None,
    };
    let members = match factors
        .media_io_kwargs
        .as_ref()
        .and_then(|m| m.get("video"))
    {
        Some(JsonValue::Object(members)) => members.as_slice(),
        _ => &[],
    };
    let bad = |message: String| ProduceError::BadRequest {
        code: "invalid_media_io_kwargs",
        message,
    };
    let int = |value: &JsonValue| match value {
        JsonValue::Int(v) => Some(*v),
        JsonValue::UInt(v) => i64::try_from(*v).ok(),
        _ => None,
    };
    let count = |key: &str, value: &JsonValue| -> Result<u32, ProduceError> {
        int(value)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                bad(format!(
                    "media_io_kwargs.video.{key} must be a positive integer, got {}",
                    value.kind()
                ))
            })
    };
    for (key, value) in members {
        match key.as_str() {
            "fps" => {
                let fps = value
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| {
                        bad("media_io_kwargs.video.fps must be a positive number".to_owned())
                    })?;
                kwargs.sampling.fps = fps;
                kwargs.fps = Some(fps);
            }
            "min_frames" => kwargs.sampling.min_frames = count(key, value)?,
            "max_frames" => kwargs.sampling.max_frames = count(key, value)?,
            "num_frames" => {
                kwargs.num_frames = int(value).ok_or_else(|| {
                    bad("media_io_kwargs.video.num_frames must be an integer".to_owned())
                })?;
            }
            "frames_indices" => {
                let indices = match value {
                    JsonValue::Array(items) => items
                        .iter()
                        .map(|v| int(v).and_then(|v| u32::try_from(v).ok()))
                        .collect::<Option<Vec<u32>>>(),
                    _ => None,
                };
                kwargs.frames_indices = Some(indices.ok_or_else(|| {
                    bad(
                        "media_io_kwargs.video.frames_indices must be a list of frame indices"
                            .to_owned(),
                    )
                })?);
            }
            "total_num_frames" => kwargs.total_num_frames = Some(count(key, value)?),
            // vLLM hashes the value as given: a float here keeps iris's metadata equal to it.
            "duration" => match value {
                JsonValue::Float(v) if v.is_finite() && *v >= 0.0 => kwargs.duration = Some(*v),
                _ => {
                    return Err(bad(
                        "media_io_kwargs.video.duration must be a non-negative number written with a decimal point (e.g. 3.0)"
                            .to_owned(),
                    ));
                }
            },
            "do_sample_frames" if matches!(value, JsonValue::Bool(false)) => {}
            "video_backend" if matches!(value, JsonValue::String(name) if name == loader.name()) => {
            }
            "backend" if matches!(value, JsonValue::String(name) if name == "opencv") => {}
            "video_backend" | "backend" | "do_sample_frames" => {
                return Err(bad(format!(
                    "media_io_kwargs.video.{key} = {} is not supported: iris reads frames as vLLM's {} loader over OpenCV's FFmpeg decoding does",
                    value.kind(),
                    loader.name()
                )));
            }
            other => {
                return Err(bad(format!(
                    "media_io_kwargs.video key `{other}` is not supported by iris (supported: fps, min_frames, max_frames, num_frames, and for JPEG frame lists frames_indices, total_num_frames, duration)"
                )));
            }
        }
    }
    Ok(kwargs)
}

/// Refuses a push target that does not name one transfer per item.
fn check_target_count(target: &PushTarget, items: usize) -> Result<(), ProduceError> {
    if target.transfer_ids.len() != items {
        return Err(ProduceError::BadRequest {
            code: "invalid_ec_transfer_params",
            message: format!(
                "ec_transfer_params.ec_items has {} entries for {items} items: the proxy sends one transfer_id per item, in order",
                target.transfer_ids.len(),
            ),
        });
    }
    Ok(())
}

/// Refuses, before any connection, a consumer whose host is not on `--allowed-ec-consumers`.
fn check_consumer_allowed(
    producer: Option<&Producer>,
    target: &PushTarget,
) -> Result<(), ProduceError> {
    if let Some(Producer {
        connector: Connector::Mooncake { pusher, .. },
        ..
    }) = producer
        && !pusher.allows(&target.consumer_zmq)
    {
        // The list itself is not shown: it describes the operator's network to any client.
        return Err(ProduceError::Forbidden {
            code: "ec_consumer_not_allowed",
            message: format!(
                "ec_transfer_params.consumer_zmq {}: its host is not among the consumers this server may push to (--allowed-ec-consumers)",
                target.consumer_zmq
            ),
        });
    }
    Ok(())
}

/// Refuses a push target that names an `mm_hash` that is not the item's identifier, before
/// anything is preprocessed (its count was checked by [`check_target_count`]).
fn check_target(target: &PushTarget, identifiers: &[String]) -> Result<(), ProduceError> {
    let bad = |message: String| ProduceError::BadRequest {
        code: "invalid_ec_transfer_params",
        message,
    };
    for (index, (named, identifier)) in target.mm_hashes.iter().zip(identifiers).enumerate() {
        if let Some(named) = named
            && named != identifier
        {
            return Err(bad(format!(
                "ec_transfer_params.ec_items[{index}].mm_hash is {named:?}, but item {index}'s identifier is {identifier:?}"
            )));
        }
    }
    // A consumer keys its reservations by transfer id: two images under one id would share
    // one reservation, one's rows written over the other's and kept under both hashes.
    let mut first_of: HashMap<&str, usize> = HashMap::new();
    for (index, (id, identifier)) in target.transfer_ids.iter().zip(identifiers).enumerate() {
        match first_of.get(id.as_str()) {
            Some(&first) if identifiers[first] != *identifier => {
                return Err(bad(format!(
                    "ec_transfer_params.ec_items[{index}].transfer_id {id:?} is also item {first}'s, a different image: each image needs its own transfer id"
                )));
            }
            Some(_) => {}
            None => {
                first_of.insert(id, index);
            }
        }
    }
    Ok(())
}

/// The push connector's request: reserve on every shard of the consumer, encode what some shard
/// needs, write, complete. Every failure after the reservations cancels them all.
async fn push<E: Engine>(
    engine: &E,
    permit: E::Permit,
    pusher: &MooncakeProducer,
    metrics: &PushMetrics,
    batch: PushBatch,
    target: PushTarget,
) -> Result<Vec<Published>, ProduceError> {
    let PushBatch {
        images,
        identifiers,
        plans,
        described,
        overrides,
    } = batch;
    let layout = engine.output_layout();
    let dtype = store_dtype(layout.dtype)?;
    let specs: Vec<PushSpec> = identifiers
        .iter()
        .zip(&plans)
        .zip(&target.transfer_ids)
        .map(|((identifier, plan), transfer_id)| {
            let shape = entry_shape(plan, &layout, dtype);
            PushSpec {
                transfer_id: transfer_id.clone(),
                mm_hash: identifier.clone(),
                rows: shape.rows,
                width: shape.width,
                dtype,
            }
        })
        .collect();
    let failed = |err: PushError| {
        metrics.failed(&err);
        ProduceError::Push(err)
    };
    let reserved = pusher
        .reserve(&target.consumer_zmq, specs)
        .await
        .map_err(failed)?;
    // What some shard needs, once per identifier (a repeated image is encoded once).
    let mut needed: Vec<usize> = Vec::new();
    for index in 0..identifiers.len() {
        if reserved.needs_write(index)
            && !needed.iter().any(|&n| identifiers[n] == identifiers[index])
        {
            needed.push(index);
        }
    }
    let mut rows: HashMap<&str, Arc<Vec<u8>>> = HashMap::new();
    if !needed.is_empty() {
        let inputs = needed.iter().map(|&i| images[i].clone()).collect();
        let results = match engine
            .encode(permit, inputs, options(overrides, true))
            .await
        {
            Ok(results) => results,
            Err(err) => {
                reserved.abandon().await;
                return Err(err.into());
            }
        };
        for (&index, result) in needed.iter().zip(&results) {
            let shape = entry_shape(&plans[index], &layout, dtype);
            match entry_rows(result, &shape) {
                Ok(bytes) => {
                    rows.insert(identifiers[index].as_str(), Arc::new(bytes));
                }
                Err(err) => {
                    reserved.abandon().await;
                    return Err(err);
                }
            }
        }
    }
    let payloads: Vec<Option<Arc<Vec<u8>>>> = identifiers
        .iter()
        .enumerate()
        .map(|(index, id)| {
            reserved
                .needs_write(index)
                .then(|| rows.get(id.as_str()).cloned())
                .flatten()
        })
        .collect();
    let cached: Vec<bool> = (0..identifiers.len())
        .map(|index| !reserved.needs_write(index))
        .collect();
    let report = pusher.push(reserved, &payloads).await.map_err(failed)?;
    metrics.bytes.inc_by(report.bytes);
    metrics.seconds.observe(report.elapsed.as_secs_f64());
    let cached_count = cached.iter().filter(|c| **c).count() as u64;
    metrics.cached.inc_by(cached_count);
    metrics
        .pushes
        .inc_by(identifiers.len() as u64 - cached_count);
    Ok(identifiers
        .into_iter()
        .zip(plans)
        .zip(target.transfer_ids)
        .zip(cached)
        .zip(described)
        .map(
            |((((identifier, plan), transfer_id), cached), (modality, timestamps))| Published {
                identifier,
                modality,
                timestamps,
                grid_thw: plan.grid_thw,
                num_tokens: plan.num_tokens,
                stored: if cached { Stored::Hit } else { Stored::Pushed },
                transfer_id: Some(transfer_id),
            },
        )
        .collect())
}

/// One request's items and what is known of them, for [`Epd::encode_and_write`].
struct Batch<'a> {
    producer: &'a Arc<StorageConnector>,
    images: &'a [MediaInput],
    identifiers: &'a [String],
    plans: &'a [ImagePlan],
    overrides: ProcessorOverrides,
    layout: &'a OutputLayout,
    dtype: EcDtype,
}

fn options(processor: ProcessorOverrides, return_embeddings: bool) -> EncodeOptions {
    EncodeOptions {
        return_embeddings,
        processor,
    }
}

fn entry_shape(plan: &ImagePlan, layout: &OutputLayout, dtype: EcDtype) -> EntryShape {
    EntryShape {
        rows: plan.num_tokens,
        width: layout.hidden * (1 + layout.deepstack_levels),
        dtype,
    }
}

/// An item's rows in the store's layout, from the engine's result.
fn entry_rows(result: &ImageResult, shape: &EntryShape) -> Result<Vec<u8>, ProduceError> {
    let internal = ProduceError::Internal;
    let (main, main_shape) = result
        .embeddings
        .as_ref()
        .ok_or_else(|| internal("the engine returned no embeddings".to_owned()))?;
    if main_shape[0] != shape.rows {
        return Err(internal(format!(
            "the engine returned {} rows for an item of {} tokens",
            main_shape[0], shape.rows
        )));
    }
    let levels: Vec<&[f32]> = result.deepstack.iter().map(|(d, _)| d.as_slice()).collect();
    let rows = usize::try_from(shape.rows).map_err(|e| internal(e.to_string()))?;
    let bytes = pack_rows(main, &levels, rows, shape.dtype).map_err(internal)?;
    if u64::try_from(bytes.len()).ok() != Some(shape.data_bytes()) {
        return Err(internal(format!(
            "{} bytes of rows for an entry of {} bytes",
            bytes.len(),
            shape.data_bytes()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_json(path: &std::path::Path) -> serde_json::Value {
        serde_json::json!({
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"shared_storage_path": path},
        })
    }

    #[test]
    fn the_config_files_table_applies_unless_the_flag_is_given() {
        let (file_store, flag_store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let file = config_json(file_store.path());
        let from_file = EpdArgs::default().resolve("tiny", Some(&file)).unwrap();
        let producer = from_file.producer.expect("a producer from the file");
        assert_eq!(producer.info_json()["ec_role"], "ec_both");
        assert_eq!(
            producer.info_json()["shared_storage_path"],
            serde_json::json!(file_store.path())
        );
        assert_eq!(from_file.model_id, "tiny");
        assert_eq!(from_file.served_model_name, "tiny");

        let flag = EpdArgs {
            ec_transfer_config: Some(config_json(flag_store.path()).to_string()),
            model_id: Some("Qwen/Qwen2.5-VL-3B-Instruct".into()),
            ..EpdArgs::default()
        };
        let from_flag = flag.resolve("tiny", Some(&file)).unwrap();
        assert_eq!(
            from_flag.producer.expect("a producer").info_json()["shared_storage_path"],
            serde_json::json!(flag_store.path())
        );
        assert_eq!(from_flag.served_model_name, "Qwen/Qwen2.5-VL-3B-Instruct");
    }

    #[test]
    fn allowed_ec_consumers_needs_the_push_connector_and_sound_entries() {
        let store = tempfile::tempdir().unwrap();
        let mooncake = serde_json::json!({
            "ec_connector": "ECMooncakeConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"mooncake_protocol": "tcp"},
        });
        let args = |config: Option<&serde_json::Value>, allowed: &[&str]| EpdArgs {
            ec_transfer_config: config.map(ToString::to_string),
            allowed_ec_consumers: allowed.iter().map(|a| (*a).to_owned()).collect(),
            ..EpdArgs::default()
        };
        let resolve = |config: Option<&serde_json::Value>, allowed: &[&str]| {
            args(config, allowed).resolve("tiny", None)
        };

        // Absent: any consumer, as vLLM's producer.
        let open = resolve(Some(&mooncake), &[]).unwrap();
        let info = open.producer.unwrap().info_json();
        assert_eq!(
            info["allowed_ec_consumers"],
            serde_json::Value::Null,
            "{info}"
        );

        let allowed = resolve(Some(&mooncake), &["PD-Host", "10.0.0.0/8", "fd00::/8"]).unwrap();
        assert_eq!(
            allowed.producer.unwrap().info_json()["allowed_ec_consumers"],
            "pd-host,10.0.0.0/8,fd00::/8"
        );

        // The flag is an error where no consumer is ever connected to.
        let storage = config_json(store.path());
        for (config, needle) in [
            (None, "no EC transfer configuration"),
            (Some(&storage), "the ECExampleConnector connector"),
        ] {
            let err = format!("{:#}", resolve(config, &["10.0.0.0/8"]).unwrap_err());
            assert!(
                err.contains("--allowed-ec-consumers") && err.contains(needle),
                "{err}"
            );
        }

        // Bad entries are named with what is wrong.
        for (entry, needle) in [
            ("10.0.0.7:15000", "carries a port"),
            ("10.0.0.1/8", "write 10.0.0.0/8"),
            ("10.0.0.0/40", "prefix length"),
            ("*.example", "no wildcards"),
            ("tcp://pd-host:15000", "not a host"),
            ("", "empty"),
        ] {
            let err = format!(
                "{:#}",
                resolve(Some(&mooncake), &["pd-host", entry]).unwrap_err()
            );
            assert!(
                err.starts_with("--allowed-ec-consumers: ") && err.contains(needle),
                "{entry:?}: {err}"
            );
        }
    }

    fn processor_kwargs(text: &str) -> HashFactors {
        HashFactors {
            mm_processor_kwargs: Some(OrderedJson::parse("mm_processor_kwargs", text).unwrap()),
            media_io_kwargs: None,
        }
    }

    #[test]
    fn sampling_processor_kwargs_are_hash_factors_unless_qwen3_would_resample() {
        // Scalars are taken (they change the identifier, not the processing).
        for ok in [
            r#"{"fps": 1}"#,
            r#"{"fps": 0.5, "num_frames": 8}"#,
            r#"{"max_pixels": 3136, "fps": 2.0}"#,
        ] {
            let overrides = processor_overrides(&processor_kwargs(ok)).unwrap();
            assert_eq!(overrides.min_pixels, None, "{ok}");
        }
        for (bad, needle) in [
            (r#"{"fps": [1, 2]}"#, "per-video lists"),
            (r#"{"fps": 0}"#, "positive number"),
            (r#"{"num_frames": 2.5}"#, "positive integer"),
            (r#"{"num_frames": [4]}"#, "per-video lists"),
            (r#"{"do_sample_frames": true}"#, "`do_sample_frames`"),
        ] {
            let err = processor_overrides(&processor_kwargs(bad)).unwrap_err();
            assert!(err.to_string().contains(needle), "{bad}: {err}");
        }
        let video = |do_sample_frames| {
            Some(Arc::new(DecodedVideo {
                frames: Vec::new(),
                metadata: iris_core::preprocess::video::ffmpeg::VideoMetadata {
                    total_num_frames: 4,
                    fps: 2.0,
                    duration: 2.0,
                    video_backend: "opencv",
                    frames_indices: vec![0, 1, 2, 3],
                    do_sample_frames,
                },
            }))
        };
        let fps = processor_kwargs(r#"{"fps": 1}"#);
        let sampled = [None, video(false)];
        let every_frame = [None, video(true)];
        assert!(check_sampling_kwargs(VideoLoader::Qwen3Vl, &sampled, &fps).is_ok());
        assert!(check_sampling_kwargs(VideoLoader::Qwen2Vl, &every_frame, &fps).is_ok());
        let err = check_sampling_kwargs(VideoLoader::Qwen3Vl, &every_frame, &fps).unwrap_err();
        assert!(
            err.to_string().starts_with("video 1: ") && err.to_string().contains("media_io_kwargs"),
            "{err}"
        );
        let pixels = processor_kwargs(r#"{"max_pixels": 3136}"#);
        assert!(check_sampling_kwargs(VideoLoader::Qwen3Vl, &every_frame, &pixels).is_ok());
    }

    #[test]
    fn bad_settings_are_refused_at_start_by_name() {
        let store = tempfile::tempdir().unwrap();
        let bound_alone = EpdArgs {
            ec_storage_max_bytes: Some(1 << 20),
            ..EpdArgs::default()
        };
        let err = bound_alone.resolve("tiny", None).unwrap_err().to_string();
        assert!(err.contains("--ec-storage-max-bytes"), "{err}");

        let mut file = config_json(store.path());
        file["ec_connector"] = serde_json::json!("ECMooncakeConnector");
        let err = format!(
            "{:#}",
            EpdArgs::default().resolve("tiny", Some(&file)).unwrap_err()
        );
        assert!(
            err.contains("[ec_transfer_config]") && err.contains("ECMooncakeConnector"),
            "{err}"
        );

        let missing = config_json(&store.path().join("missing"));
        let err = EpdArgs::default()
            .resolve("tiny", Some(&missing))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing") && err.contains("create it first"),
            "{err}"
        );

        let media = EpdArgs {
            media_io_kwargs: Some(r#"{"image": {"rgba_background_color": [0, 0]}}"#.into()),
            ..EpdArgs::default()
        };
        assert!(media.resolve("tiny", None).is_err());
    }

    /// JPEG frame lists decode, carry metadata and get identifiers as vLLM 0.33's
    /// `VideoMediaIO.load_base64` and hasher give them (`tools/video-goldens/jpeg_sequence.py`).
    #[test]
    fn jpeg_frame_lists_match_vllms_frames_metadata_and_identifiers() {
        use base64::Engine as _;
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../core/tests/fixtures/video/jpeg_sequence.json");
        let goldens: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let payload = goldens["payload"].as_str().unwrap();
        for (index, case) in goldens["cases"].as_array().unwrap().iter().enumerate() {
            let epd = EpdArgs {
                model_id: Some(case["model_id"].as_str().unwrap().to_owned()),
                ..EpdArgs::default()
            }
            .resolve("tiny", None)
            .unwrap();
            let request = EpdRequest {
                media_io_kwargs: Some(
                    OrderedJson::parse(
                        "media_io_kwargs",
                        case["media_io_kwargs_json"].as_str().unwrap(),
                    )
                    .unwrap(),
                ),
                ..EpdRequest::default()
            };
            let factors = epd.factors(&request).unwrap();
            let kwargs = video_kwargs(&factors, VideoLoader::Qwen2Vl).unwrap();
            let video = decode_jpeg_sequence(payload.as_bytes(), &kwargs).unwrap();
            let shape = &case["shape"];
            assert_eq!(
                video.frames.len() as u64,
                shape[0].as_u64().unwrap(),
                "case {index}"
            );
            // Pillow's frames, within the few levels by which iris's JPEG decoder differs from
            // libjpeg-turbo's (docs/ARCHITECTURE.md; 4 on these gradients).
            let pillow = base64::engine::general_purpose::STANDARD
                .decode(case["frames"].as_str().unwrap())
                .unwrap();
            let ours: Vec<u8> = video
                .frames
                .iter()
                .flat_map(|f| {
                    assert_eq!(
                        (u64::from(f.size.height), u64::from(f.size.width)),
                        (shape[1].as_u64().unwrap(), shape[2].as_u64().unwrap())
                    );
                    f.pixels.iter().copied()
                })
                .collect();
            assert_eq!(ours.len(), pillow.len());
            let worst = ours.iter().zip(&pillow).map(|(a, b)| a.abs_diff(*b)).max();
            assert!(
                worst <= Some(4),
                "case {index}: {worst:?} levels from Pillow's frames"
            );
            let m = &video.metadata;
            let want = &case["metadata"];
            assert_eq!(
                serde_json::json!({
                    "total_num_frames": m.total_num_frames,
                    "fps": m.fps,
                    "duration": m.duration,
                    "video_backend": m.video_backend,
                    "frames_indices": m.frames_indices,
                    "do_sample_frames": m.do_sample_frames,
                }),
                *want
            );
            let item = Item {
                bytes: payload.as_bytes().to_vec(),
                uuid: None,
                modality: Modality::Video,
                jpeg_sequence: true,
            };
            let identifiers = epd
                .identifiers(&[item], &[Some(Arc::new(video))], &factors)
                .unwrap();
            assert_eq!(
                identifiers[0],
                case["identifier"].as_str().unwrap(),
                "{case}"
            );
        }

        // What vLLM refuses, iris refuses by name.
        let parse = |text: &str| HashFactors {
            mm_processor_kwargs: None,
            media_io_kwargs: Some(OrderedJson::parse("media_io_kwargs", text).unwrap()),
        };
        for (text, needle) in [
            (r#"{"video": {"num_frames": 0}}"#, "num_frames"),
            (
                r#"{"video": {"frames_indices": [0, 1]}}"#,
                "frames_indices has 2 entries",
            ),
            (
                r#"{"video": {"total_num_frames": 2}}"#,
                "total_num_frames (2)",
            ),
        ] {
            let kwargs = video_kwargs(&parse(text), VideoLoader::Qwen2Vl).unwrap();
            let err = decode_jpeg_sequence(payload.as_bytes(), &kwargs).unwrap_err();
            assert!(err.to_string().contains(needle), "{text}: {err}");
        }
        for text in [
            r#"{"video": {"duration": 3}}"#,
            r#"{"video": {"do_sample_frames": true}}"#,
            r#"{"video": {"frames_indices": "all"}}"#,
            r#"{"video": {"decoder": "x"}}"#,
        ] {
            let err = video_kwargs(&parse(text), VideoLoader::Qwen2Vl).unwrap_err();
            assert!(
                matches!(
                    err,
                    ProduceError::BadRequest {
                        code: "invalid_media_io_kwargs",
                        ..
                    }
                ),
                "{text}: {err}"
            );
        }
        let two_sizes = [
            payload.split(',').next().unwrap(),
            &base64::engine::general_purpose::STANDARD.encode(png_of(8, 8)),
        ]
        .join(",");
        let err = decode_jpeg_sequence(
            two_sizes.as_bytes(),
            &video_kwargs(&parse("{}"), VideoLoader::Qwen2Vl).unwrap(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("of one size"), "{err}");
    }

    #[test]
    fn a_frame_past_the_request_s_decode_bytes_is_refused_from_its_header() {
        use base64::Engine as _;
        let encode = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
        let small = encode(&png_of(8, 8));
        // A PNG whose header claims 100x100 and whose pixels are missing (it ends at the
        // start of its first IDAT chunk): decoding it would fail as corrupt, so only a check
        // of its header before decoding names the size.
        let mut big = png_of(100, 100);
        assert_eq!(&big[37..41], b"IDAT");
        big.truncate(41);
        let kwargs = video_kwargs(&HashFactors::default(), VideoLoader::Qwen2Vl).unwrap();
        // Five 8x8 frames are 960 bytes of RGB: within 1000, and the sixth is not.
        let five = [small.as_str(); 5].join(",");
        assert_eq!(
            decode_frames_within(five.as_bytes(), &kwargs, 1000)
                .unwrap()
                .frames
                .len(),
            5
        );
        let list = format!("{five},{}", encode(&big));
        let err = decode_frames_within(list.as_bytes(), &kwargs, 1000).unwrap_err();
        assert!(
            matches!(
                &err,
                EngineError::BadInput {
                    code: "video_too_large",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("more than 1000 bytes"), "{err}");
    }

    fn png_of(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut out),
            &vec![7u8; (w * h * 3) as usize],
            w,
            h,
            image::ExtendedColorType::Rgb8,
        )
        .unwrap();
        out
    }
}
