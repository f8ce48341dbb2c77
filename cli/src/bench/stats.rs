//! Latency percentiles and throughput of a bench run.
//!
//! Percentiles use linear interpolation between closest ranks (NumPy's default `linear`
//! method, Hyndman and Fan's definition 7): for `n` sorted samples and quantile `q`, the rank is
//! `h = (n - 1) q`, and the value `x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h])`.
//! Only completed requests count towards latency and throughput. The others are counted apart,
//! by what happened to them ([`ErrorKind`]): refused by the engine's admission bounds (503
//! `overloaded`), abandoned by their client, or failed (something went wrong).
//! Throughput divides by the wall time of the load phase (first send to last completion).

use std::time::Duration;

/// The outcome of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    /// Time from send to the complete response.
    pub latency: Duration,
    /// Images in the request.
    pub images: u64,
    /// Videos in the request.
    pub videos: u64,
    /// Embedding tokens the response reported (0 when failed).
    pub tokens: u64,
    /// Images the response marked as served from the encoder cache.
    pub cached_images: u64,
    /// Videos the response marked as served from the encoder cache.
    pub cached_videos: u64,
    /// Why the request did not complete; `None` when it did.
    pub error: Option<RequestError>,
}

/// What kept a request from completing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The engine refused it at admission (503 `overloaded`): load, not a fault.
    Refused,
    /// Its client gave up on it (`--inject-faults`).
    Aborted,
    /// Anything else: something went wrong.
    Failed,
}

/// A request that did not complete: why, and the error's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    /// Which count it goes to.
    pub kind: ErrorKind,
    /// The error as the target reported it.
    pub message: String,
}

impl RequestError {
    /// A failure (the [`ErrorKind::Failed`] kind) with `message`.
    pub fn failed(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Failed,
            message: message.into(),
        }
    }
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Fastest.
    pub min: f64,
    /// Slowest.
    pub max: f64,
}

/// Rates over the load phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Throughput {
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Images of completed requests per second.
    pub images_per_s: f64,
    /// Videos of completed requests per second.
    pub videos_per_s: f64,
    /// Embedding tokens of completed requests per second.
    pub tokens_per_s: f64,
}

/// Summary of the load phase.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStats {
    /// Requests that completed.
    pub completed: u64,
    /// Requests the engine refused at admission (503 `overloaded`).
    pub refused: u64,
    /// Requests their client abandoned.
    pub aborted: u64,
    /// Requests that failed: something went wrong.
    pub failed: u64,
    /// Images in completed requests.
    pub images: u64,
    /// Videos in completed requests.
    pub videos: u64,
    /// Embedding tokens in completed requests.
    pub tokens: u64,
    /// Images answered from the encoder cache, as the responses said.
    pub cached_images: u64,
    /// Videos answered from the encoder cache, as the responses said.
    pub cached_videos: u64,
    /// Wall time of the load phase.
    pub duration: Duration,
    /// Latency of completed requests.
    pub latency_ms: LatencySummary,
    /// Rates.
    pub throughput: Throughput,
    /// Up to the first few distinct messages of failed requests, for the report.
    pub errors: Vec<String>,
    /// The first refusal's message, if any request was refused.
    pub refusal: Option<String>,
}

/// Distinct error messages kept for the report.
const MAX_ERRORS_KEPT: usize = 5;

/// The `q`-quantile (`q` in `[0, 1]`) of ascending `sorted`, by linear interpolation; 0 if empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted {
        [] => 0.0,
        [only] => *only,
        _ => {
            let h = (sorted.len() - 1) as f64 * q.clamp(0.0, 1.0);
            let lo = h.floor();
            // `h` is in [0, len - 1], so both indices are in range.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let i = lo as usize;
            let next = sorted.get(i + 1).copied().unwrap_or(sorted[i]);
            sorted[i] + (h - lo) * (next - sorted[i])
        }
    }
}

/// Summarises latencies given in milliseconds.
pub fn latency_summary(samples_ms: &[f64]) -> LatencySummary {
    let mut sorted: Vec<f64> = samples_ms
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .collect();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return LatencySummary::default();
    }
    LatencySummary {
        p50: percentile(&sorted, 0.50),
        p90: percentile(&sorted, 0.90),
        p99: percentile(&sorted, 0.99),
        mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
        min: sorted[0],
        max: sorted[sorted.len() - 1],
    }
}

/// Summarises the outcomes of a load phase that took `duration`.
pub fn summarize(outcomes: &[RequestOutcome], duration: Duration) -> RunStats {
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let count = |kind: ErrorKind| {
        let n = outcomes
            .iter()
            .filter(|o| o.error.as_ref().is_some_and(|e| e.kind == kind))
            .count();
        u64::try_from(n).unwrap_or(u64::MAX)
    };
    let mut errors: Vec<String> = Vec::new();
    let failures = outcomes
        .iter()
        .filter_map(|o| o.error.as_ref())
        .filter(|e| e.kind == ErrorKind::Failed);
    for e in failures {
        if errors.len() < MAX_ERRORS_KEPT && !errors.contains(&e.message) {
            errors.push(e.message.clone());
        }
    }
    let refusal = outcomes
        .iter()
        .filter_map(|o| o.error.as_ref())
        .find(|e| e.kind == ErrorKind::Refused)
        .map(|e| e.message.clone());
    let completed = u64::try_from(ok.len()).unwrap_or(u64::MAX);
    let images: u64 = ok.iter().map(|o| o.images).sum();
    let videos: u64 = ok.iter().map(|o| o.videos).sum();
    let tokens: u64 = ok.iter().map(|o| o.tokens).sum();
    let secs = duration.as_secs_f64();
    let rate = |count: u64| if secs > 0.0 { count as f64 / secs } else { 0.0 };
    let latencies: Vec<f64> = ok.iter().map(|o| o.latency.as_secs_f64() * 1e3).collect();
    RunStats {
        completed,
        refused: count(ErrorKind::Refused),
        aborted: count(ErrorKind::Aborted),
        failed: count(ErrorKind::Failed),
        images,
        videos,
        tokens,
        cached_images: ok.iter().map(|o| o.cached_images).sum(),
        cached_videos: ok.iter().map(|o| o.cached_videos).sum(),
        duration,
        latency_ms: latency_summary(&latencies),
        throughput: Throughput {
            requests_per_s: rate(completed),
            images_per_s: rate(images),
            videos_per_s: rate(videos),
            tokens_per_s: rate(tokens),
        },
        errors,
        refusal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ms: u64, images: u64, tokens: u64) -> RequestOutcome {
        RequestOutcome {
            latency: Duration::from_millis(ms),
            images,
            videos: 0,
            tokens,
            cached_images: 0,
            cached_videos: 0,
            error: None,
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let x: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile(range(1, 11), [50, 90, 99]) == [5.5, 9.1, 9.91]
        assert!((percentile(&x, 0.5) - 5.5).abs() < 1e-12);
        assert!((percentile(&x, 0.9) - 9.1).abs() < 1e-12);
        assert!((percentile(&x, 0.99) - 9.91).abs() < 1e-12);
        assert_eq!(percentile(&x, 0.0), 1.0);
        assert_eq!(percentile(&x, 1.0), 10.0);
        assert_eq!(percentile(&[4.0], 0.9), 4.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn summary_counts_only_completed_requests() {
        let mut outcomes = vec![
            ok(10, 2, 100),
            ok(30, 2, 50),
            RequestOutcome {
                videos: 3,
                cached_videos: 1,
                ..ok(20, 1, 10)
            },
        ];
        for _ in 0..2 {
            outcomes.push(RequestOutcome {
                error: Some(RequestError::failed("HTTP 500")),
                ..ok(1, 4, 0)
            });
        }
        for (kind, message) in [
            (ErrorKind::Refused, "overloaded"),
            (ErrorKind::Aborted, "hung up"),
        ] {
            outcomes.push(RequestOutcome {
                error: Some(RequestError {
                    kind,
                    message: message.into(),
                }),
                ..ok(1, 4, 0)
            });
        }
        let s = summarize(&outcomes, Duration::from_secs(2));
        assert_eq!((s.completed, s.failed, s.images, s.tokens), (3, 2, 5, 160));
        assert_eq!((s.videos, s.cached_videos), (3, 1));
        assert_eq!((s.refused, s.aborted), (1, 1));
        assert_eq!(s.errors, vec!["HTTP 500".to_owned()]);
        assert_eq!(s.refusal.as_deref(), Some("overloaded"));
        assert_eq!(
            s.throughput,
            Throughput {
                requests_per_s: 1.5,
                images_per_s: 2.5,
                videos_per_s: 1.5,
                tokens_per_s: 80.0
            }
        );
        assert_eq!(
            (
                s.latency_ms.p50,
                s.latency_ms.min,
                s.latency_ms.max,
                s.latency_ms.mean
            ),
            (20.0, 10.0, 30.0, 20.0)
        );
        let empty = summarize(&[], Duration::ZERO);
        assert_eq!(empty.throughput, Throughput::default());
    }
}
