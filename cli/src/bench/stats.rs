//! Latency percentiles and throughput of a bench run.
//!
//! Percentiles use linear interpolation between closest ranks (NumPy's default `linear`
//! method, Hyndman and Fan's definition 7): for `n` sorted samples and quantile `q`, the rank is
//! `h = (n - 1) q`, and the value `x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h])`.
//! Only completed requests count towards latency and throughput; failed ones are counted apart.
//! Throughput divides by the wall time of the load phase (first send to last completion).

use std::time::Duration;

/// The outcome of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    /// Time from send to the complete response.
    pub latency: Duration,
    /// Images in the request.
    pub images: u64,
    /// Embedding tokens the response reported (0 when failed).
    pub tokens: u64,
    /// Images the response marked as served from the encoder cache.
    pub cached_images: u64,
    /// The error, when the request failed.
    pub error: Option<String>,
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
    /// Embedding tokens of completed requests per second.
    pub tokens_per_s: f64,
}

/// Summary of the load phase.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStats {
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Images in completed requests.
    pub images: u64,
    /// Embedding tokens in completed requests.
    pub tokens: u64,
    /// Images answered from the encoder cache, as the responses said.
    pub cached_images: u64,
    /// Wall time of the load phase.
    pub duration: Duration,
    /// Latency of completed requests.
    pub latency_ms: LatencySummary,
    /// Rates.
    pub throughput: Throughput,
    /// Up to the first few distinct error messages, for the report.
    pub errors: Vec<String>,
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
    let mut errors: Vec<String> = Vec::new();
    for e in outcomes.iter().filter_map(|o| o.error.as_ref()) {
        if errors.len() < MAX_ERRORS_KEPT && !errors.contains(e) {
            errors.push(e.clone());
        }
    }
    let completed = u64::try_from(ok.len()).unwrap_or(u64::MAX);
    let images: u64 = ok.iter().map(|o| o.images).sum();
    let tokens: u64 = ok.iter().map(|o| o.tokens).sum();
    let secs = duration.as_secs_f64();
    let rate = |count: u64| if secs > 0.0 { count as f64 / secs } else { 0.0 };
    let latencies: Vec<f64> = ok.iter().map(|o| o.latency.as_secs_f64() * 1e3).collect();
    RunStats {
        completed,
        failed: u64::try_from(outcomes.len() - ok.len()).unwrap_or(u64::MAX),
        images,
        tokens,
        cached_images: ok.iter().map(|o| o.cached_images).sum(),
        duration,
        latency_ms: latency_summary(&latencies),
        throughput: Throughput {
            requests_per_s: rate(completed),
            images_per_s: rate(images),
            tokens_per_s: rate(tokens),
        },
        errors,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ms: u64, images: u64, tokens: u64) -> RequestOutcome {
        RequestOutcome {
            latency: Duration::from_millis(ms),
            images,
            tokens,
            cached_images: 0,
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
        let mut outcomes = vec![ok(10, 2, 100), ok(30, 2, 50), ok(20, 1, 10)];
        outcomes.push(RequestOutcome {
            error: Some("HTTP 500".into()),
            ..ok(1, 4, 0)
        });
        outcomes.push(RequestOutcome {
            error: Some("HTTP 500".into()),
            ..ok(1, 4, 0)
        });
        let s = summarize(&outcomes, Duration::from_secs(2));
        assert_eq!((s.completed, s.failed, s.images, s.tokens), (3, 2, 5, 160));
        assert_eq!(s.errors, vec!["HTTP 500".to_owned()]);
        assert_eq!(
            s.throughput,
            Throughput {
                requests_per_s: 1.5,
                images_per_s: 2.5,
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
