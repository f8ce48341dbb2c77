//! Liveness: the engine-core thread runs under a panic guard.
//!
//! A panic on that thread (a bug in iris or a device call that should have returned an error)
//! marks the engine **dead** with the panic's message, logged at error level. The engine is not
//! restarted: the device's state after a panic in the middle of a step is unknown, and a clear
//! 503 that an orchestrator restarts the process on is safer than a guess. From then on:
//!
//! - requests in flight fail with [`EngineError::Internal`] naming the panic (HTTP 500): the
//!   thread's unwinding drops their channels;
//! - every new call fails with [`EngineError::Dead`] (HTTP 503, code `engine_dead`), and
//!   `GET /health` answers 503.
//!
//! The engine is marked dead by a panic hook, at the moment of the panic and before unwinding
//! drops anything, so a caller that sees its request fail already sees the engine dead. A panic
//! a plugin boundary catches ([`iris_plugin::backend::catch_panic`]: a built-in plugin's call
//! on this thread) is that call's error, not death.
//!
//! For tests and drills, [`PANIC_AT_STEP_ENV`] injects such a panic.

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::{Arc, Once, OnceLock};

use crate::engine::api::EngineError;

/// Fault injection: when set to `N`, the engine-core thread panics at the start of its N-th
/// step (counting from 1). Read by the `iris` binary into [`EngineConfig::panic_at_step`];
/// meant for tests and failure drills only.
///
/// [`EngineConfig::panic_at_step`]: crate::engine::EngineConfig::panic_at_step
pub const PANIC_AT_STEP_ENV: &str = "IRIS_ENGINE_PANIC_AT_STEP";

/// Whether the engine-core thread is alive, and why not.
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    dead: OnceLock<String>,
}

impl Liveness {
    /// The reason the engine died, if it did.
    pub(crate) fn dead_reason(&self) -> Option<&str> {
        self.dead.get().map(String::as_str)
    }

    /// `Err(Dead)` once the engine died.
    pub(crate) fn check(&self) -> Result<(), EngineError> {
        match self.dead_reason() {
            Some(reason) => Err(EngineError::Dead(reason.to_owned())),
            None => Ok(()),
        }
    }

    fn mark_dead(&self, reason: String) {
        if self.dead.set(reason).is_ok() {
            tracing::error!(
                "the engine core panicked: {}; the engine is dead and refuses every call \
                 (GET /health answers 503); restart the process",
                self.dead_reason().unwrap_or_default()
            );
        }
    }
}

thread_local! {
    /// The liveness of the engine whose core runs on this thread, for the panic hook.
    static GUARDED: RefCell<Option<Arc<Liveness>>> = const { RefCell::new(None) };
}

/// Runs `body` (the engine-core thread's whole life) under the panic guard.
pub(crate) fn run_guarded(liveness: Arc<Liveness>, body: impl FnOnce()) {
    install_hook();
    GUARDED.with(|g| *g.borrow_mut() = Some(Arc::clone(&liveness)));
    let result = std::panic::catch_unwind(AssertUnwindSafe(body));
    GUARDED.with(|g| g.borrow_mut().take());
    if let Err(payload) = result {
        // Already marked by the hook unless another hook replaced it since.
        liveness.mark_dead(panic_message(payload.as_ref()).to_owned());
    }
}

/// Chains a hook in front of the present one (once per process) that marks the engine of the
/// panicking thread dead before unwinding starts.
fn install_hook() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            // A panic a plugin boundary catches (a built-in plugin's op, run on this thread in
            // its sync mode) becomes that call's error: the fault is contained, not death.
            if iris_plugin::backend::catches_panics() {
                previous(info);
                return;
            }
            let _ = GUARDED.try_with(|g| {
                if let Ok(guarded) = g.try_borrow()
                    && let Some(liveness) = guarded.as_ref()
                {
                    let message = panic_message(info.payload());
                    let place = info
                        .location()
                        .map(|l| format!(" at {}:{}", l.file(), l.line()))
                        .unwrap_or_default();
                    liveness.mark_dead(format!("{message}{place}"));
                }
            });
            previous(info);
        }));
    });
}

/// The text a panic was raised with (`panic!` with a literal or with formatting).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_marks_dead_with_its_message_and_is_contained() {
        let liveness = Arc::new(Liveness::default());
        assert!(liveness.check().is_ok());
        let thread_liveness = Arc::clone(&liveness);
        std::thread::spawn(move || run_guarded(thread_liveness, || panic!("boom at step 3")))
            .join()
            .expect("the guard contains the panic");
        let Err(EngineError::Dead(reason)) = liveness.check() else {
            panic!("not dead: {:?}", liveness.dead_reason());
        };
        assert!(reason.contains("boom at step 3"), "{reason}");
    }

    #[test]
    fn a_panic_a_plugin_boundary_catches_is_not_death() {
        let liveness = Arc::new(Liveness::default());
        let thread_liveness = Arc::clone(&liveness);
        std::thread::spawn(move || {
            run_guarded(thread_liveness, || {
                // A built-in plugin's op, run on the engine thread, panics inside its guard.
                let caught = iris_plugin::backend::catch_panic(|| panic!("an op's bug"));
                assert!(caught.is_err());
            });
        })
        .join()
        .unwrap();
        assert!(liveness.check().is_ok(), "{:?}", liveness.dead_reason());
    }

    #[test]
    fn a_normal_end_is_not_death() {
        let liveness = Arc::new(Liveness::default());
        let thread_liveness = Arc::clone(&liveness);
        std::thread::spawn(move || run_guarded(thread_liveness, || {}))
            .join()
            .unwrap();
        assert!(liveness.check().is_ok());
    }
}
