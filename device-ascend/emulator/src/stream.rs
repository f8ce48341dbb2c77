//! An in-order queue executed by a worker thread: the emulated stream.
//!
//! Work runs after the call that enqueued it has returned, in enqueue order. The first
//! failure is kept and reported (once) by the next synchronisation that covers it.
//!
//! A task fault (a code in the 507xxx range: AI core exceptions such as 507015, memory
//! faults) is sticky, as on hardware: the stream stays in error, the tasks after it are
//! dropped without running, and every later synchronisation and event query on the stream
//! reports the fault, until the stream is destroyed.
//!
//! The queue is a mutex and a condition variable only (no channels, no thread-locals): op
//! libraries built as separate copies of this crate enqueue on streams the runtime copy
//! created, so the shared state must be plain memory both copies understand.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config;
use crate::error::{EmuError, codes};
use crate::runtime::{Device, lock, panic_text};

/// One task on the device.
pub type Job = Box<dyn FnOnce(&Device) -> Result<(), EmuError> + Send>;

struct State {
    jobs: VecDeque<Job>,
    submitted: u64,
    completed: u64,
    /// The first failure not yet reported, with the sequence number of its task.
    error: Option<(u64, EmuError)>,
    /// A task fault that leaves the stream in error for good.
    sticky: Option<EmuError>,
    shutdown: bool,
}

/// A stream's queue and its worker.
pub struct StreamInner {
    /// The NPU the stream runs on.
    pub device: Arc<Device>,
    state: Mutex<State>,
    changed: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl StreamInner {
    /// Starts a stream's worker.
    pub fn start(device: Arc<Device>) -> Result<Arc<StreamInner>, EmuError> {
        let inner = Arc::new(StreamInner {
            device,
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                submitted: 0,
                completed: 0,
                error: None,
                sticky: None,
                shutdown: false,
            }),
            changed: Condvar::new(),
            worker: Mutex::new(None),
        });
        let worker = Arc::clone(&inner);
        let handle = std::thread::Builder::new()
            .name("emulated-npu-stream".into())
            .spawn(move || worker.run())
            .map_err(|err| EmuError::new(codes::RT_INTERNAL_ERROR, err.to_string()))?;
        *lock(&inner.worker) = Some(handle);
        Ok(inner)
    }

    /// Enqueues a task; returns its sequence number.
    pub fn submit(&self, job: Job) -> u64 {
        let mut state = lock(&self.state);
        state.jobs.push_back(job);
        state.submitted += 1;
        self.changed.notify_all();
        state.submitted
    }

    /// Tasks enqueued so far.
    pub fn submitted(&self) -> u64 {
        lock(&self.state).submitted
    }

    /// Tasks finished so far.
    pub fn completed(&self) -> u64 {
        lock(&self.state).completed
    }

    /// Waits for every task enqueued so far; reports a failure among them.
    pub fn synchronize(&self) -> Result<(), EmuError> {
        let target = self.submitted();
        self.wait_for(target)
    }

    /// The fault that keeps this stream in error, if any.
    pub fn sticky(&self) -> Option<EmuError> {
        lock(&self.state).sticky.clone()
    }

    /// Waits until task `seq` is done; reports a failure at or before it, and a sticky fault
    /// every time.
    pub fn wait_for(&self, seq: u64) -> Result<(), EmuError> {
        let mut state = lock(&self.state);
        while state.completed < seq {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        if let Some(fault) = state.sticky.clone() {
            state.error = None;
            return Err(fault);
        }
        match state.error.take() {
            Some((at, err)) if at <= seq => Err(err),
            other => {
                state.error = other;
                Ok(())
            }
        }
    }

    /// Finishes the queued work and stops the worker.
    pub fn shutdown(&self) {
        {
            let mut state = lock(&self.state);
            state.shutdown = true;
            self.changed.notify_all();
        }
        if let Some(handle) = lock(&self.worker).take() {
            let _ = handle.join();
        }
    }

    fn run(self: Arc<Self>) {
        let delay = Duration::from_micros(config::get().queue_delay_us);
        loop {
            let (job, seq) = {
                let mut state = lock(&self.state);
                loop {
                    if let Some(job) = state.jobs.pop_front() {
                        if state.sticky.is_some() {
                            // A stream in error drops its tasks.
                            state.completed += 1;
                            self.changed.notify_all();
                            continue;
                        }
                        let seq = state.completed + 1;
                        break (job, seq);
                    }
                    if state.shutdown {
                        return;
                    }
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            let device = Arc::clone(&self.device);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&device)))
                .unwrap_or_else(|payload| {
                    Err(EmuError::new(
                        codes::RT_AICORE_EXCEPTION,
                        format!("a task panicked: {}", panic_text(payload.as_ref())),
                    ))
                });
            let mut state = lock(&self.state);
            state.completed += 1;
            if let Err(err) = result {
                if codes::is_task_fault(err.code) && state.sticky.is_none() {
                    state.sticky = Some(err.clone());
                }
                if state.error.is_none() {
                    state.error = Some((seq, err));
                }
            }
            self.changed.notify_all();
        }
    }
}
