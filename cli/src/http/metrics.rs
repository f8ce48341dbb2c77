//! `GET /metrics`: Prometheus text exposition.
//!
//! HTTP metrics (requests by route, method and status; latency by route; images encoded) are
//! recorded by a middleware as requests finish. Cache and memory figures belong to the engine:
//! they are read from [`Engine::metrics_snapshot`] at scrape time by [`EngineCollector`], so the
//! exported values are always the engine's own cumulative counters, never a second copy. The EC
//! store's counters (`iris_ec_store_*`) are read from the store the same way, and its write
//! latency histogram (`iris_ec_store_write_seconds`) is observed at each write. The push
//! connector's counters and latency histogram (`iris_ec_push*`) are observed by each request.

use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder, proto,
};

use iris_ec::storage::StoreStats;

use super::engine_api::{Engine, MetricsSnapshot};
use crate::epd::Producer;

/// Latency histogram buckets in seconds: 1 ms to about 65 s, doubling.
const LATENCY_BUCKETS: [f64; 17] = [
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096,
    8.192, 16.384, 32.768, 65.536,
];

/// Why the metrics registry could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The prometheus crate refused a metric definition or registration.
    #[error("metrics registry: {0}")]
    Prometheus(#[from] prometheus::Error),
    /// The text encoder produced bytes that are not UTF-8.
    #[error("metrics text is not UTF-8: {0}")]
    Utf8(#[from] std::string::FromUtf8Error),
}

/// The server's metrics: its registry, HTTP metrics, and the engine collector.
pub struct HttpMetrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    images: IntCounterVec,
}

impl HttpMetrics {
    /// Builds the registry with the HTTP metrics and the engine's cache and memory figures.
    ///
    /// # Errors
    /// [`MetricsError::Prometheus`] if a metric cannot be defined or registered.
    pub fn new<E: Engine>(
        engine: Arc<E>,
        producer: Option<Arc<Producer>>,
    ) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "iris_http_requests_total",
                "HTTP requests by route, method and status",
            ),
            &["route", "method", "status"],
        )?;
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "iris_http_request_duration_seconds",
                "HTTP request latency by route, in seconds",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route"],
        )?;
        let images = IntCounterVec::new(
            Opts::new(
                "iris_images_total",
                "Images encoded, by whether the encoder cache had them",
            ),
            &["cached"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(images.clone()))?;
        registry.register(Box::new(EngineCollector::over_engine(engine)?))?;
        if let Some(producer) = producer {
            if let Some(push) = producer.push_metrics() {
                for collector in push.collectors() {
                    registry.register(collector)?;
                }
            }
            if let Some(write_seconds) = producer.write_seconds() {
                registry.register(Box::new(write_seconds.clone()))?;
                registry.register(Box::new(SnapshotCollector::new(
                    move || producer.stats(),
                    &STORE_COUNTERS,
                    &STORE_GAUGES,
                )?))?;
            }
        }
        Ok(Self {
            registry,
            requests,
            latency,
            images,
        })
    }

    /// Records one finished request.
    pub fn observe_request(&self, route: &str, method: &str, status: u16, seconds: f64) {
        self.requests
            .with_label_values(&[route, method, &status.to_string()])
            .inc();
        self.latency.with_label_values(&[route]).observe(seconds);
    }

    /// Records images served by one encode request.
    pub fn observe_images(&self, cached: u64, encoded: u64) {
        self.images.with_label_values(&["true"]).inc_by(cached);
        self.images.with_label_values(&["false"]).inc_by(encoded);
    }

    /// The Prometheus text exposition of every metric.
    ///
    /// # Errors
    /// [`MetricsError`] if encoding fails.
    pub fn render(&self) -> Result<String, MetricsError> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8(buf)?)
    }
}

/// Counters and gauges read from a snapshot at scrape time: the engine's [`MetricsSnapshot`]
/// or the EC store's [`StoreStats`], so the exported values are always their owners' own
/// cumulative counters, never a second copy.
pub struct SnapshotCollector<T> {
    snapshot: Box<dyn Fn() -> T + Send + Sync>,
    counters: Vec<(IntCounter, Field<T>)>,
    gauges: Vec<(IntGauge, Field<T>)>,
    descs: Vec<Desc>,
    /// Setting the reusable metrics and collecting them must not interleave between scrapes.
    collecting: Mutex<()>,
}

/// The engine's cache counters and memory gauges.
pub type EngineCollector = SnapshotCollector<MetricsSnapshot>;

/// Reads one figure from a snapshot.
type Field<T> = fn(&T) -> u64;
/// A metric's name, help text and the figure it exports.
type MetricDef<T> = (&'static str, &'static str, Field<T>);

const COUNTERS: [MetricDef<MetricsSnapshot>; 11] = [
    (
        "iris_processor_cache_hits_total",
        "Processor cache hits",
        |s| s.processor_cache_hits,
    ),
    (
        "iris_processor_cache_misses_total",
        "Processor cache misses",
        |s| s.processor_cache_misses,
    ),
    (
        "iris_processor_cache_evictions_total",
        "Processor cache evictions",
        |s| s.processor_cache_evictions,
    ),
    ("iris_encoder_cache_hits_total", "Encoder cache hits", |s| {
        s.encoder_cache_hits
    }),
    (
        "iris_encoder_cache_misses_total",
        "Encoder cache misses",
        |s| s.encoder_cache_misses,
    ),
    (
        "iris_encoder_cache_evictions_total",
        "Encoder cache evictions",
        |s| s.encoder_cache_evictions,
    ),
    (
        "iris_encoder_cache_reencodes_total",
        "Device encoder-cache misses answered by encoding the item again",
        |s| s.encoder_cache_reencodes,
    ),
    (
        "iris_oom_recoveries_total",
        "Out-of-memory recoveries during steps (evict, trim, retry)",
        |s| s.oom_recoveries,
    ),
    (
        "iris_oom_failures_total",
        "Requests failed because an item did not fit in device memory",
        |s| s.oom_failures,
    ),
    (
        "iris_device_faults_total",
        "Steps failed by a device error other than out of memory",
        |s| s.device_faults,
    ),
    (
        "iris_requests_rejected_overloaded_total",
        "Requests refused with 503 overloaded (beyond the queue bounds)",
        |s| s.admission.rejected_requests,
    ),
];

const GAUGES: [MetricDef<MetricsSnapshot>; 15] = [
    (
        "iris_device_used_bytes",
        "Device memory used (total - free)",
        |s| s.memory.device_used_bytes,
    ),
    ("iris_device_total_bytes", "Device memory total", |s| {
        s.memory.device_total_bytes
    }),
    (
        "iris_allocator_reserved_bytes",
        "Bytes the caching allocator holds",
        |s| s.memory.allocator_reserved_bytes,
    ),
    (
        "iris_allocator_allocated_bytes",
        "Bytes handed out to live tensors",
        |s| s.memory.allocator_allocated_bytes,
    ),
    ("iris_allocator_peak_bytes", "Peak allocated bytes", |s| {
        s.memory.allocator_peak_bytes
    }),
    (
        "iris_encoder_cache_bytes",
        "Device bytes of cached encoder outputs",
        |s| s.memory.encoder_cache_bytes,
    ),
    ("iris_encoder_cache_entries", "Encoder cache entries", |s| {
        s.memory.encoder_cache_entries
    }),
    (
        "iris_processor_cache_bytes",
        "Host bytes of cached preprocessed inputs",
        |s| s.memory.processor_cache_bytes,
    ),
    (
        "iris_processor_cache_entries",
        "Processor cache entries",
        |s| s.memory.processor_cache_entries,
    ),
    // Backpressure: what is pending against the admission bounds.
    (
        "iris_pending_requests",
        "Requests admitted and not finished",
        |s| s.admission.pending_requests,
    ),
    (
        "iris_pending_tokens",
        "Embedding tokens of requests admitted and not finished",
        |s| s.admission.pending_tokens,
    ),
    (
        "iris_pending_requests_peak",
        "Most requests pending at once since start",
        |s| s.admission.peak_pending_requests,
    ),
    (
        "iris_pending_tokens_peak",
        "Most embedding tokens pending at once since start",
        |s| s.admission.peak_pending_tokens,
    ),
    (
        "iris_max_queued_requests",
        "Bound on pending requests",
        |s| s.admission.max_queued_requests,
    ),
    (
        "iris_max_pending_tokens",
        "Bound on pending embedding tokens",
        |s| s.admission.max_pending_tokens,
    ),
];

impl EngineCollector {
    /// A collector over `engine`'s snapshot.
    ///
    /// # Errors
    /// [`MetricsError::Prometheus`] if a metric definition is invalid.
    pub fn over_engine<E: Engine>(engine: Arc<E>) -> Result<Self, MetricsError> {
        SnapshotCollector::new(move || engine.metrics_snapshot(), &COUNTERS, &GAUGES)
    }
}

/// The EC store's counters (`iris_ec_store_*`).
const STORE_COUNTERS: [MetricDef<StoreStats>; 6] = [
    (
        "iris_ec_store_writes_total",
        "EC store entries written",
        |s| s.writes,
    ),
    (
        "iris_ec_store_bytes_written_total",
        "Bytes of EC store entries written",
        |s| s.bytes_written,
    ),
    (
        "iris_ec_store_hits_total",
        "Items found in the EC store and not encoded again",
        |s| s.hits,
    ),
    (
        "iris_ec_store_write_errors_total",
        "EC store writes that failed",
        |s| s.write_errors,
    ),
    (
        "iris_ec_store_invalid_replaced_total",
        "EC store files that were not valid entries and were replaced",
        |s| s.invalid_replaced,
    ),
    (
        "iris_ec_store_evictions_total",
        "EC store entries deleted for --ec-storage-max-bytes",
        |s| s.evictions,
    ),
];

const STORE_GAUGES: [MetricDef<StoreStats>; 1] = [(
    "iris_ec_store_resident_bytes",
    "Bytes of the EC store entries this process wrote that are still there",
    |s| s.resident_bytes,
)];

impl<T> SnapshotCollector<T> {
    /// A collector of `counters` and `gauges` over what `snapshot` returns at each scrape.
    ///
    /// # Errors
    /// [`MetricsError::Prometheus`] if a metric definition is invalid.
    pub fn new(
        snapshot: impl Fn() -> T + Send + Sync + 'static,
        counters: &[MetricDef<T>],
        gauges: &[MetricDef<T>],
    ) -> Result<Self, MetricsError> {
        let counters = counters
            .iter()
            .map(|(name, help, f)| Ok((IntCounter::new(*name, *help)?, *f)))
            .collect::<Result<Vec<_>, prometheus::Error>>()?;
        let gauges = gauges
            .iter()
            .map(|(name, help, f)| Ok((IntGauge::new(*name, *help)?, *f)))
            .collect::<Result<Vec<_>, prometheus::Error>>()?;
        let descs = counters
            .iter()
            .flat_map(|(c, _)| c.desc().into_iter().cloned())
            .chain(
                gauges
                    .iter()
                    .flat_map(|(g, _)| g.desc().into_iter().cloned()),
            )
            .collect();
        Ok(Self {
            snapshot: Box::new(snapshot),
            counters,
            gauges,
            descs,
            collecting: Mutex::new(()),
        })
    }
}

impl<T> Collector for SnapshotCollector<T> {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let snapshot = (self.snapshot)();
        // A poisoned lock only means another scrape panicked; the metrics are reset below anyway.
        let _guard = self
            .collecting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = Vec::with_capacity(self.counters.len() + self.gauges.len());
        for (counter, field) in &self.counters {
            counter.reset();
            counter.inc_by(field(&snapshot));
            out.extend(counter.collect());
        }
        for (gauge, field) in &self.gauges {
            gauge.set(i64::try_from(field(&snapshot)).unwrap_or(i64::MAX));
            out.extend(gauge.collect());
        }
        out
    }
}

#[cfg(test)]
/// Parses the value of an unlabelled sample `name` from Prometheus text (used by the bench client).
pub fn sample_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (metric, value) = l.split_once(' ')?;
        (metric == name)
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}
