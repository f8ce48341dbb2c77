//! `iris bench --inject-faults`: the load with the faults a production server meets, and a
//! verdict on how the engine took them.
//!
//! With the flag, each request (seeded by `--seed` and its index):
//!
//! - is abandoned by its client after a random 0 to [`MAX_ABORT_AFTER_MS`] ms with probability
//!   1 in [`ABORT_ONE_IN`] (the client hangs up: the engine must release its work);
//! - starts a `reset_all` in the middle of the load with probability 1 in [`RESET_ONE_IN`].
//!
//! In process on the CPU device, the device also refuses every [`CPU_FAIL_ALLOC_EVERY`]-th
//! allocation with out of memory (its `fail_alloc_every` fault option). Against `--url`, start
//! the server with the fault options of its device instead (for the CPU device,
//! `[plugins.cpu] fail_alloc_every = "53"` in its config file).
//!
//! Every request is then counted as answered, an expected error (the client's own abort, a 503
//! `overloaded`, an error that names an injected fault) or an unexpected error. The run fails
//! (exit status 1) on any unexpected error or failed reset, as it does when memory does not
//! return to the post-start baseline.

use std::time::Duration;

use serde::Serialize;

use super::stats::{ErrorKind, RequestOutcome};
use super::workload::SplitMix64;

/// One request in this many is abandoned by its client.
pub const ABORT_ONE_IN: u64 = 5;
/// One request in this many starts a `reset_all` while the load runs.
pub const RESET_ONE_IN: u64 = 25;
/// Longest a client waits before abandoning its request, in milliseconds.
pub const MAX_ABORT_AFTER_MS: u64 = 40;
/// In process on the CPU device, every this-many-th allocation fails with out of memory.
pub const CPU_FAIL_ALLOC_EVERY: u64 = 53;
/// The text of a client's own abort, as the request's error.
pub const ABORTED: &str = "abandoned by the client (fault injection)";

/// What happens to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The client hangs up after this long.
    pub abort_after: Option<Duration>,
    /// A `reset_all` starts when the request is sent.
    pub reset: bool,
}

impl Plan {
    /// No fault.
    pub const NONE: Plan = Plan {
        abort_after: None,
        reset: false,
    };
}

/// The faults of request `index` under `seed`.
pub fn plan(seed: u64, index: usize) -> Plan {
    let index = u64::try_from(index).unwrap_or(u64::MAX);
    let mut rng = SplitMix64::new(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xfa17);
    let abort = rng.next_below(ABORT_ONE_IN) == 0;
    let after = Duration::from_millis(rng.next_below(MAX_ABORT_AFTER_MS + 1));
    Plan {
        abort_after: abort.then_some(after),
        reset: rng.next_below(RESET_ONE_IN) == 0,
    }
}

/// The counts of a fault-injection run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FaultReport {
    /// Requests answered with their results.
    pub answered: u64,
    /// Requests their client abandoned.
    pub aborted: u64,
    /// Requests refused with 503 `overloaded`.
    pub overloaded: u64,
    /// Requests failed by an injected fault, saying so.
    pub injected: u64,
    /// Requests failed for any other reason: the engine did not take the faults.
    pub unexpected: u64,
    /// `reset_all` calls made during the load.
    pub resets: u64,
    /// Of them, calls that failed.
    pub failed_resets: u64,
    /// The distinct unexpected errors (at most [`MAX_ERRORS_KEPT`]).
    pub unexpected_errors: Vec<String>,
}

/// Distinct unexpected errors kept for the report.
pub const MAX_ERRORS_KEPT: usize = 5;

impl FaultReport {
    /// Counts `outcomes` and the results of the resets.
    pub fn new(outcomes: &[RequestOutcome], resets: &[Result<(), String>]) -> FaultReport {
        let mut report = FaultReport::default();
        for outcome in outcomes {
            let Some(error) = &outcome.error else {
                report.answered += 1;
                continue;
            };
            match error.kind {
                ErrorKind::Aborted => report.aborted += 1,
                ErrorKind::Refused => report.overloaded += 1,
                ErrorKind::Failed if error.message.contains("injected fault") => {
                    report.injected += 1;
                }
                ErrorKind::Failed => report.unexpected(&error.message),
            }
        }
        report.resets = u64::try_from(resets.len()).unwrap_or(u64::MAX);
        for err in resets.iter().filter_map(|r| r.as_ref().err()) {
            report.failed_resets += 1;
            report.keep(&format!("reset_all: {err}"));
        }
        report
    }

    /// Whether the engine took every fault: no unexpected error, no failed reset.
    pub fn passed(&self) -> bool {
        self.unexpected == 0 && self.failed_resets == 0
    }

    /// The report's lines, ending with the faults verdict.
    pub fn render_text(&self) -> String {
        let mut out = format!(
            "faults:     {} answered, {} abandoned by their client, {} overloaded (503), {} failed by an injected fault, {} unexpected errors; {} resets during the load ({} failed)\n",
            self.answered,
            self.aborted,
            self.overloaded,
            self.injected,
            self.unexpected,
            self.resets,
            self.failed_resets
        );
        for e in &self.unexpected_errors {
            out.push_str(&format!("  unexpected: {e}\n"));
        }
        out.push_str(&format!(
            "every fault handled (no unexpected error): {}\n",
            if self.passed() { "yes" } else { "NO" }
        ));
        out
    }

    fn unexpected(&mut self, error: &str) {
        self.unexpected += 1;
        self.keep(error);
    }

    fn keep(&mut self, error: &str) {
        if self.unexpected_errors.len() < MAX_ERRORS_KEPT
            && !self.unexpected_errors.iter().any(|e| e == error)
        {
            self.unexpected_errors.push(error.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::RequestError;

    fn ended(kind: ErrorKind, message: &str) -> RequestOutcome {
        RequestOutcome {
            latency: Duration::ZERO,
            images: 1,
            videos: 0,
            tokens: 0,
            cached_images: 0,
            cached_videos: 0,
            error: Some(RequestError {
                kind,
                message: message.to_owned(),
            }),
        }
    }

    fn failed(message: &str) -> RequestOutcome {
        ended(ErrorKind::Failed, message)
    }

    #[test]
    fn plans_are_seeded_and_hit_about_their_rates() {
        let plans: Vec<Plan> = (0..2000).map(|i| plan(7, i)).collect();
        assert_eq!(plans, (0..2000).map(|i| plan(7, i)).collect::<Vec<_>>());
        let aborts = plans.iter().filter(|p| p.abort_after.is_some()).count();
        let resets = plans.iter().filter(|p| p.reset).count();
        assert!((300..500).contains(&aborts), "{aborts} aborts in 2000");
        assert!((40..130).contains(&resets), "{resets} resets in 2000");
        assert!(
            plans
                .iter()
                .filter_map(|p| p.abort_after)
                .all(|d| d <= Duration::from_millis(MAX_ABORT_AFTER_MS))
        );
    }

    #[test]
    fn errors_are_sorted_into_expected_and_unexpected() {
        let ok = RequestOutcome {
            error: None,
            ..failed("")
        };
        let outcomes = [
            ok,
            ended(ErrorKind::Aborted, ABORTED),
            ended(
                ErrorKind::Refused,
                "HTTP 503 from /v1/encode: the engine is overloaded; retry later",
            ),
            failed("engine: internal error: gemm: injected fault (call #3 of gemm)"),
            failed("HTTP 500 from /v1/encode: internal error: scheduling failed"),
        ];
        let report = FaultReport::new(&outcomes, &[Ok(()), Err("HTTP 503: dead".into())]);
        assert_eq!(
            (
                report.answered,
                report.aborted,
                report.overloaded,
                report.injected,
                report.unexpected
            ),
            (1, 1, 1, 1, 1)
        );
        assert_eq!((report.resets, report.failed_resets), (2, 1));
        assert!(!report.passed());
        assert_eq!(report.unexpected_errors.len(), 2);
        assert!(report.render_text().contains("no unexpected error): NO"));
        let clean = FaultReport::new(&outcomes[..4], &[Ok(())]);
        assert!(clean.passed(), "{clean:?}");
    }
}
