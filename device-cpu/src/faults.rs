//! Fault injection: options that make the device fail on purpose, so that the host's handling
//! of out-of-memory and device errors can be tested on any machine.
//!
//! - `fail_alloc_at = N`: the N-th `alloc` after open (counting from 1) fails with out of
//!   memory; `fail_alloc_every = N`: every N-th does.
//! - `fail_op = KIND` (an op name such as `gemm`, or `any`): calls of that op fail when they
//!   run with an internal error; `fail_op_at = N` picks the N-th call (default 1),
//!   `fail_op_every = N` every N-th; `fail_op_panics = true` makes such a call panic instead
//!   (the plugin boundary turns the panic into the call's error), to test that a plugin's
//!   panic is contained.
//!
//! An injected op failure happens when the work runs, so on the async queue it surfaces at a
//! later call, as a real device's would. Messages say that the fault was injected.

use std::sync::atomic::{AtomicU64, Ordering};

use iris_plugin::abi::{OpKind, PluginError};

/// Which op calls fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpTarget {
    /// Calls of one op.
    Op(OpKind),
    /// Calls of any op.
    Any,
}

/// When a counted event fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Every {
    /// Only the N-th (1-based).
    At(u64),
    /// Every N-th.
    Every(u64),
}

impl Every {
    fn hits(self, count: u64) -> bool {
        match self {
            Every::At(n) => count == n,
            Every::Every(n) => n > 0 && count.is_multiple_of(n),
        }
    }
}

/// The fault options of one device and their counters.
#[derive(Debug, Default)]
pub struct Faults {
    /// Allocation failures.
    pub alloc: Option<Every>,
    /// Op failures.
    pub op: Option<(OpTarget, Every)>,
    /// Whether an injected op failure panics (instead of returning its error).
    pub op_panics: bool,
    allocs: AtomicU64,
    ops: AtomicU64,
}

impl Faults {
    /// Whether any fault is configured.
    pub fn any(&self) -> bool {
        self.alloc.is_some() || self.op.is_some()
    }

    /// Counts an allocation of `bytes`; the injected error if this one must fail.
    pub(crate) fn on_alloc(&self, bytes: u64) -> Result<(), PluginError> {
        let Some(when) = self.alloc else {
            return Ok(());
        };
        let count = self.allocs.fetch_add(1, Ordering::Relaxed) + 1;
        if when.hits(count) {
            return Err(PluginError::out_of_memory(format!(
                "alloc: {bytes} bytes refused by an injected fault (allocation #{count})"
            )));
        }
        Ok(())
    }

    /// Counts a call of `op`; `Some(error)` if this call must fail when it runs.
    pub(crate) fn on_op(&self, op: OpKind) -> Option<PluginError> {
        let (target, when) = self.op?;
        if target != OpTarget::Any && target != OpTarget::Op(op) {
            return None;
        }
        let count = self.ops.fetch_add(1, Ordering::Relaxed) + 1;
        when.hits(count)
            .then(|| PluginError::internal(format!("{op}: injected fault (call #{count} of {op})")))
    }
}

/// Parses one fault option into `faults`; `Ok(false)` if `key` is not a fault option.
pub(crate) fn parse_option(faults: &mut Faults, key: &str, value: &str) -> Result<bool, String> {
    let count = || {
        value
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("option `{key}`: expected a positive integer, got `{value}`"))
    };
    match key {
        "fail_alloc_at" => faults.alloc = Some(Every::At(count()?)),
        "fail_alloc_every" => faults.alloc = Some(Every::Every(count()?)),
        "fail_op" => {
            let target = match value.trim() {
                "any" => OpTarget::Any,
                name => OpTarget::Op(OpKind::parse(name).ok_or_else(|| {
                    let known: Vec<&str> = OpKind::ALL.iter().filter_map(|op| op.name()).collect();
                    format!(
                        "option `fail_op`: unknown op `{name}` (known: any, {})",
                        known.join(", ")
                    )
                })?),
            };
            let when = faults.op.map_or(Every::At(1), |(_, when)| when);
            faults.op = Some((target, when));
        }
        "fail_op_at" | "fail_op_every" => {
            let when = if key == "fail_op_at" {
                Every::At(count()?)
            } else {
                Every::Every(count()?)
            };
            let target = faults.op.map_or(OpTarget::Any, |(target, _)| target);
            faults.op = Some((target, when));
        }
        "fail_op_panics" => {
            faults.op_panics = value.trim().parse::<bool>().map_err(|_| {
                format!("option `fail_op_panics`: expected `true` or `false`, got `{value}`")
            })?;
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Fault options, for the list of known keys.
pub(crate) const KEYS: [&str; 6] = [
    "fail_alloc_at",
    "fail_alloc_every",
    "fail_op",
    "fail_op_at",
    "fail_op_every",
    "fail_op_panics",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nth_allocation_and_every_nth_fail() {
        let mut faults = Faults::default();
        assert!(parse_option(&mut faults, "fail_alloc_at", "2").unwrap());
        assert!(faults.on_alloc(8).is_ok());
        let err = faults.on_alloc(8).unwrap_err();
        assert!(err.message.contains("injected"), "{}", err.message);
        assert!(faults.on_alloc(8).is_ok());
        let mut faults = Faults::default();
        parse_option(&mut faults, "fail_alloc_every", "2").unwrap();
        let failed: Vec<bool> = (0..4).map(|_| faults.on_alloc(1).is_err()).collect();
        assert_eq!(failed, [false, true, false, true]);
    }

    #[test]
    fn op_faults_count_only_their_op() {
        let mut faults = Faults::default();
        parse_option(&mut faults, "fail_op", "gemm").unwrap();
        parse_option(&mut faults, "fail_op_at", "2").unwrap();
        assert!(faults.on_op(OpKind::CAST).is_none());
        assert!(faults.on_op(OpKind::GEMM).is_none());
        assert!(faults.on_op(OpKind::CAST).is_none());
        assert!(faults.on_op(OpKind::GEMM).is_some());
        assert!(faults.on_op(OpKind::GEMM).is_none());
        let mut faults = Faults::default();
        assert!(parse_option(&mut faults, "fail_op", "gemmm").is_err());
        assert!(!parse_option(&mut faults, "threads", "2").unwrap());
    }
}
