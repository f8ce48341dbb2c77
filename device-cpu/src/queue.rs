//! The device's in-order queue, and the pool its work runs on.
//!
//! In `sync` mode every call runs its work before returning, as a plain CPU library would. In
//! `async` mode (the default) work goes to one worker thread that runs it in submission order
//! on the device's rayon pool, and calls return at once: the CPU device then behaves like an
//! accelerator's stream, so a host that forgets to synchronise gets wrong results in tests on
//! this device rather than on a customer's GPU. An optional delay before each item makes such
//! mistakes show deterministically.
//!
//! A failure of queued work is kept and reported by the next call that submits or waits
//! (the ABI's "at the next call or at `synchronize`"), naming the failed call; work submitted
//! after it still runs.

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use gemm::Parallelism;
use iris_plugin::abi::PluginError;
use iris_plugin::backend::panic_message;
use rayon::prelude::*;

use crate::error::invalid;
use crate::isa::Tier;
use crate::ops::native::Kernel;

/// Elements a row-parallel task handles at least, so that small ops do not drown in scheduling.
const MIN_ELEMENTS_PER_TASK: usize = 16 * 1024;

/// How calls complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueMode {
    /// Each call completes before it returns.
    Sync,
    /// Calls enqueue; a worker thread runs the queue in order.
    Async,
}

impl QueueMode {
    /// `sync` or `async`.
    pub fn name(self) -> &'static str {
        match self {
            QueueMode::Sync => "sync",
            QueueMode::Async => "async",
        }
    }
}

/// What queued work runs on: the device's thread pool.
pub(crate) struct Exec {
    pub(crate) pool: rayon::ThreadPool,
    pub(crate) threads: usize,
    /// The kernel tier ops run on.
    pub(crate) tier: Tier,
}

impl Exec {
    /// A pool of `threads` workers.
    pub(crate) fn new(threads: usize, tier: Tier) -> Result<Exec, PluginError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|index| format!("iris-cpu-{index}"))
            .start_handler(move |_| crate::isa::set_thread_simd(tier.simd()))
            .build()
            .map_err(|err| PluginError::internal(format!("open: cannot start threads: {err}")))?;
        Ok(Exec {
            pool,
            threads,
            tier,
        })
    }

    /// The native kernel bf16 products run on, if the tier has one.
    pub(crate) fn bf16_kernel(&self) -> Option<Kernel> {
        // The tier was resolved against this CPU at open; checking again costs a cached load
        // and keeps the kernels' safety contract local.
        Kernel::for_tier(self.tier).filter(|kernel| kernel.available())
    }

    /// The `gemm` crate's parallelism for this pool.
    pub(crate) fn parallelism(&self) -> Parallelism {
        if self.threads > 1 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        }
    }

    /// Runs `f` on the pool over row ranges covering `0..rows`, each with an f32 scratch of
    /// `scratch_len` elements.
    pub(crate) fn par_rows(
        &self,
        rows: usize,
        cols: usize,
        scratch_len: usize,
        f: impl Fn(Range<usize>, &mut [f32]) + Sync,
    ) {
        if rows == 0 {
            return;
        }
        let per_task = (MIN_ELEMENTS_PER_TASK / cols.max(1)).max(1);
        let tasks = rows.div_ceil(per_task);
        if tasks == 1 || self.threads == 1 {
            let mut scratch = vec![0.0; scratch_len];
            f(0..rows, &mut scratch);
            return;
        }
        self.pool.install(|| {
            (0..tasks).into_par_iter().for_each_init(
                || vec![0.0; scratch_len],
                |scratch, task| {
                    let start = task * per_task;
                    f(start..(start + per_task).min(rows), scratch);
                },
            );
        });
    }
}

/// One unit of queued work.
pub(crate) type Work = Box<dyn FnOnce(&Exec) -> Result<(), PluginError> + Send>;

/// The queue of one opened device.
pub(crate) struct Queue {
    mode: QueueMode,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

struct Shared {
    exec: Exec,
    delay: Duration,
    state: Mutex<State>,
    /// Signalled when work arrives or the queue shuts down.
    arrived: Condvar,
    /// Signalled when an item completes.
    completed: Condvar,
}

#[derive(Default)]
struct State {
    items: VecDeque<Item>,
    /// Queue positions given out so far, to work and to fences: a fence's value is its own
    /// position, so every fence gets a new, larger value.
    submitted: u64,
    /// Positions of work submitted and not yet complete. In sync mode several callers' threads
    /// may each be running an item, and they finish in any order: a fence is complete only
    /// when no earlier position is left here, not when some later item finished.
    pending: BTreeSet<u64>,
    /// The first failure not yet reported.
    failure: Option<PluginError>,
    shutdown: bool,
}

impl State {
    /// Every position up to this one is complete.
    fn done(&self) -> u64 {
        self.pending
            .first()
            .map_or(self.submitted, |first| first - 1)
    }

    /// Takes the next position for work, counted as pending until [`State::complete`].
    fn next(&mut self) -> u64 {
        self.submitted += 1;
        self.pending.insert(self.submitted);
        self.submitted
    }

    /// Marks the work at `seq` complete.
    fn complete(&mut self, seq: u64) {
        self.pending.remove(&seq);
    }
}

struct Item {
    seq: u64,
    name: &'static str,
    work: Work,
}

impl Queue {
    /// A queue running on `exec`; in async mode, with a worker thread that waits `delay`
    /// before each item.
    pub(crate) fn new(mode: QueueMode, exec: Exec, delay: Duration) -> Result<Queue, PluginError> {
        let shared = Arc::new(Shared {
            exec,
            delay,
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
            completed: Condvar::new(),
        });
        let worker = match mode {
            QueueMode::Sync => None,
            QueueMode::Async => {
                let shared = Arc::clone(&shared);
                let handle = std::thread::Builder::new()
                    .name("iris-cpu-queue".to_owned())
                    .spawn(move || shared.run())
                    .map_err(|err| {
                        PluginError::internal(format!("open: cannot start the queue thread: {err}"))
                    })?;
                Some(handle)
            }
        };
        Ok(Queue {
            mode,
            shared,
            worker,
        })
    }

    /// How calls complete.
    pub(crate) fn mode(&self) -> QueueMode {
        self.mode
    }

    /// Submits `work` named `name`: runs it now (sync) or enqueues it (async). A failure of
    /// earlier work not yet reported is returned instead, and `work` is dropped.
    pub(crate) fn submit(&self, name: &'static str, work: Work) -> Result<(), PluginError> {
        self.submit_with(name, move || work)
    }

    /// As [`Queue::submit`], building the work with `make` only once it is certain to be
    /// queued (under the queue's lock, so in queue order): what `make` counts, such as an
    /// injected fault's calls, counts work that runs, never work dropped for an earlier
    /// failure.
    pub(crate) fn submit_with(
        &self,
        name: &'static str,
        make: impl FnOnce() -> Work,
    ) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        if let Some(failure) = state.failure.take() {
            return Err(failure);
        }
        let work = make();
        let seq = state.next();
        match self.mode {
            QueueMode::Sync => {
                drop(state);
                let result = self.shared.execute(name, seq, work);
                self.shared.lock().complete(seq);
                // Another thread may be waiting for a fence that counts this item.
                self.shared.completed.notify_all();
                result
            }
            QueueMode::Async => {
                state.items.push_back(Item { seq, name, work });
                drop(state);
                self.shared.arrived.notify_one();
                Ok(())
            }
        }
    }

    /// Records a fence after everything submitted so far: a queue position of its own, so
    /// each call returns a larger value than the last.
    pub(crate) fn fence(&self) -> u64 {
        let mut state = self.shared.lock();
        state.submitted += 1;
        state.submitted
    }

    /// Waits until fence `value` is complete; reports a failure of queued work. A value no
    /// fence was given has nothing to wait for and would block forever: it is refused.
    pub(crate) fn wait(&self, value: u64) -> Result<(), PluginError> {
        let state = self.shared.lock();
        if value > state.submitted {
            return Err(invalid(
                "wait_fence",
                format!(
                    "fence {value} was never recorded (the latest is {})",
                    state.submitted
                ),
            ));
        }
        self.wait_locked(state, value)
    }

    fn wait_locked(&self, mut state: MutexGuard<'_, State>, value: u64) -> Result<(), PluginError> {
        while state.done() < value {
            state = self
                .shared
                .completed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        match state.failure.take() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    /// Waits for everything submitted so far.
    pub(crate) fn synchronize(&self) -> Result<(), PluginError> {
        let state = self.shared.lock();
        let last = state.submitted;
        self.wait_locked(state, last)
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.arrived.notify_all();
        if let Some(worker) = self.worker.take() {
            // The worker finishes the items already queued, then exits; it catches panics of
            // the work itself, so a join error would only mean a bug in the loop below.
            let _ = worker.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Work runs outside the lock and panics are caught, so a poisoned lock can only come
        // from a panic between two consistent updates; keep serving.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The worker thread: runs items in order until shut down and drained.
    fn run(&self) {
        loop {
            let item = {
                let mut state = self.lock();
                loop {
                    if let Some(item) = state.items.pop_front() {
                        break item;
                    }
                    if state.shutdown {
                        return;
                    }
                    state = self
                        .arrived
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            if !self.delay.is_zero() {
                std::thread::sleep(self.delay);
            }
            let Item { seq, name, work } = item;
            let result = self.execute(name, seq, work);
            let mut state = self.lock();
            if let Err(err) = result
                && state.failure.is_none()
            {
                state.failure = Some(PluginError::new(
                    err.code,
                    format!(
                        "asynchronous failure of {name} (call #{seq}): {}",
                        err.message
                    ),
                ));
            }
            state.complete(seq);
            drop(state);
            self.completed.notify_all();
        }
    }

    fn execute(&self, name: &str, seq: u64, work: Work) -> Result<(), PluginError> {
        let simd = self.exec.tier.simd();
        // The queue's thread (or the caller's, in sync mode) runs parts of ops itself.
        let run = || crate::isa::with_simd(simd, || work(&self.exec));
        match iris_plugin::backend::catch_panic(run) {
            Ok(result) => result,
            Err(payload) => Err(PluginError::internal(format!(
                "{name} (call #{seq}) panicked: {}",
                panic_message(payload.as_ref())
            ))),
        }
    }
}
