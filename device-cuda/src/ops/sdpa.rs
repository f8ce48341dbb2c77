//! Attention through cuDNN's fused kernel ([`crate::cudnn`]): whether the device may use it,
//! which calls and runs of segments take it, and its plans.
//!
//! The option `attention_engine` chooses: `auto` (the default) takes cuDNN on compute
//! capability 9.0 and newer, where PyTorch's attention runs it and where it measured two to
//! three times the plugin's `mma.sync` kernels on an H200; `cudnn` takes it on any device of
//! compute capability 8.0 or newer (and fails the open when cuDNN cannot be loaded); `kernel`
//! never loads it. Either way cuDNN serves a head dim and type only once the device's open has
//! run it against the plugin's tensor-core kernel on the same inputs
//! (`CudaDevice::check_cudnn_attention`), and only for calls whose operands are aligned as its
//! plans declare ([`crate::cudnn::ALIGNMENT`]). A run of segments whose shape no cuDNN engine
//! takes runs the plugin's kernel, within the same call.
//!
//! A plan is made for one shape (segment length, segments, head dim, type), and building one
//! (heuristics, finalizing, and the kernels cuDNN may compile for it) takes tens to hundreds of
//! milliseconds, so a serving device would stall at every image size it had not seen. After
//! open, plans are therefore built on a thread of their own: a run whose plan is not ready runs
//! the plugin's kernel (checked against cuDNN at open) and asks for the plan, and later calls of
//! that shape take cuDNN. The two threads share one handle, one at a time: a call that finds
//! the builder holding it runs the kernel rather than wait. Calls get a workspace of a fixed
//! size (the largest the check's plans needed), so that the step plans the host made before a
//! plan was ready stay right after; a shape whose every configuration needs more runs the
//! kernel.
//!
//! A plan whose execution fails after open (its first may need device memory for what cuDNN
//! loads, and the device may be full) is dropped and its call runs the kernel, so the call
//! succeeds; the shape then runs the kernel, until the next drop of the plans built after open
//! (a trim) where the failure may have been for lack of memory, or until the device closes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use cudarc::driver::CudaContext;
use iris_plugin::Logger;
use iris_plugin::abi::{DType, HeldMemory};
use iris_plugin::validate::Mat;

use super::{dtype_name, lock};
use crate::cudnn::{self, CudnnLibrary, Handle, SdpaOperands, SdpaPlan, SdpaShape};
use crate::device::{AttentionEngine, CudaOptions, Info, push_growth, used};
use crate::error::CudaError;
use crate::memory;

/// The compute capability from which cuDNN's fused attention runs at all (its bf16 and f16
/// flash engines start with Ampere).
pub(crate) const CUDNN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);
/// The compute capability from which `auto` takes it (Hopper).
pub(crate) const CUDNN_AUTO_COMPUTE_CAPABILITY: (i32, i32) = (9, 0);
/// Plans kept at most; beyond it the device waits for its queue and starts over (every
/// distinct segment length and batch has its own).
const MAX_PLANS: usize = 1024;

/// cuDNN attention on one device.
pub(crate) struct Sdpa {
    /// cuDNN, its handle on the device's queue and the plans, when the options and the device
    /// let it be tried and it loaded.
    cudnn: Option<Arc<Shared>>,
    /// The thread that builds plans after open, and the queue of shapes it builds.
    builder: Mutex<Option<Builder>>,
    /// `(dtype, head dim)` pairs that passed the check at open.
    pub(crate) ready: Vec<(DType, u64)>,
    /// What `iris devices` shows: the engine in use, and why.
    pub(crate) note: String,
    /// Set once the device's open is over: from then on plans are built in the background,
    /// calls get [`Sdpa::workspace`]'s fixed workspace, and device memory a plan's first
    /// execution adds is measured and reported ([`Sdpa::grown`]), where before it counts in the
    /// open's own warm-up.
    opened: AtomicBool,
    /// The workspace every call gets after open: the most the check's plans needed.
    workspace_after_open: AtomicU64,
    /// Option `cudnn_plan_memory`: once plans built after open hold this much device memory,
    /// shapes without a plan run the plugin's kernel.
    plan_memory: u64,
    log: Logger,
}

/// What calls and the builder thread share.
struct Shared {
    library: &'static CudnnLibrary,
    /// Declared (so dropped) before the handle they were built with.
    plans: Mutex<Plans>,
    /// One thread at a time: the builder while it builds, a call while it executes.
    handle: Mutex<Handle>,
    /// Set when the device closes: the builder stops after the plan at hand.
    closing: AtomicBool,
}

/// The thread building plans after open.
struct Builder {
    shapes: mpsc::Sender<SdpaShape>,
    thread: JoinHandle<()>,
}

/// A shape's plan: asked for, ready, why cuDNN has none, or why its plan was dropped.
enum Entry {
    Building,
    Ready(SdpaPlan),
    Refused(String),
    /// Its plan's execution failed after open, and the plugin's kernel runs the shape.
    Failed {
        why: String,
        /// Whether the failure may have been for lack of memory (an allocation-failure status,
        /// or the plan's first execution, where cuDNN allocates what it loads and may say so
        /// only as an internal error): then the next drop of the plans built after open (a
        /// trim) drops this entry too, and the shape's plan is asked for again, once memory
        /// may be free. Otherwise the shape stays on the kernel until the device closes.
        until_trim: bool,
    },
}

/// Plans by shape.
#[derive(Default)]
struct Plans {
    by_shape: HashMap<SdpaShape, Entry>,
    /// The shapes the check at open built, which [`Sdpa::trim`] keeps (their memory is part of
    /// the open's).
    from_open: HashSet<SdpaShape>,
    /// Device memory first executions of plans made after open added (loaded kernels), less
    /// what dropping plans gave back.
    grown: u64,
    /// Whether `grown` reached the option `cudnn_plan_memory` (said once in the log).
    full: bool,
}

/// One cuDNN call of an attention launch: `batch` consecutive segments of `tokens` tokens
/// each, from segment `first` on, whose first token is `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    /// Index of its first segment.
    pub(crate) first: usize,
    /// Segments in it.
    pub(crate) batch: usize,
    /// Its first token.
    pub(crate) start: usize,
    /// Tokens of each of its segments.
    pub(crate) tokens: usize,
}

/// Runs a call may have for cuDNN to take it: one call of the plugin's kernel beats many short
/// cuDNN calls (Qwen2.5-VL's windows of a size that is not a multiple of the window alternate
/// lengths, which would make a call per window).
pub(crate) const MAX_RUNS: usize = 16;

/// The runs of `segments` (`(start, length)`, consecutive): maximal stretches of one length
/// cut into powers of two, largest first, so that a step of many images of one size needs a
/// few plans (41 segments: 32, 8 and 1) however many images it holds. Empty segments are
/// left out (nothing to compute).
pub(crate) fn runs(segments: &[(usize, usize)]) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut index = 0;
    while index < segments.len() {
        let (start, tokens) = segments[index];
        let same = segments[index..]
            .iter()
            .take_while(|segment| segment.1 == tokens)
            .count();
        if tokens > 0 {
            let mut first = index;
            let mut left = same;
            let mut at = start;
            while left > 0 {
                let batch = 1 << left.ilog2();
                runs.push(Run {
                    first,
                    batch,
                    start: at,
                    tokens,
                });
                first += batch;
                at += batch * tokens;
                left -= batch;
            }
        }
        index += same;
    }
    runs
}

impl Sdpa {
    /// cuDNN for a device of `info` running CUDA `major`'s libraries, as `options` ask: loaded
    /// and given a handle on `stream`, or the reason it is not (an error only where
    /// `attention_engine = cudnn` asked for it). The handle's device memory is a held item.
    pub(crate) fn open(
        major: u32,
        stream: &cudarc::driver::CudaStream,
        info: &Info,
        options: &CudaOptions,
        log: &Logger,
        held: &mut Vec<HeldMemory>,
    ) -> Result<Sdpa, CudaError> {
        let explicit = options.attention_engine == AttentionEngine::Cudnn;
        let with = |cudnn: Option<Arc<Shared>>, note: String| Sdpa {
            cudnn,
            builder: Mutex::new(None),
            ready: Vec::new(),
            note,
            opened: AtomicBool::new(false),
            workspace_after_open: AtomicU64::new(0),
            plan_memory: options.cudnn_plan_memory,
            log: *log,
        };
        let cc = info.cc;
        let refused = match options.attention_engine {
            AttentionEngine::Kernel => Some("attention_engine = kernel".to_owned()),
            _ if cc < CUDNN_COMPUTE_CAPABILITY => Some(format!(
                "cuDNN's fused attention needs compute capability {}.{}, the device has {}.{}",
                CUDNN_COMPUTE_CAPABILITY.0, CUDNN_COMPUTE_CAPABILITY.1, cc.0, cc.1
            )),
            AttentionEngine::Auto if cc < CUDNN_AUTO_COMPUTE_CAPABILITY => Some(format!(
                "attention_engine = auto takes cuDNN from compute capability {}.{} (set \
                 attention_engine = cudnn to use it on {}.{})",
                CUDNN_AUTO_COMPUTE_CAPABILITY.0, CUDNN_AUTO_COMPUTE_CAPABILITY.1, cc.0, cc.1
            )),
            _ => None,
        };
        if let Some(why) = refused {
            if explicit {
                return Err(CudaError::Unsupported(format!(
                    "attention_engine = cudnn: {why}"
                )));
            }
            return Ok(with(None, format!("kernel: {why}")));
        }
        let loaded = cudnn::load(major).and_then(|library| {
            let before = used().map_err(|err| err.to_string())?;
            let handle = Handle::new(&library.lib, stream.cu_stream().cast())
                .map_err(|err| err.to_string())?;
            push_growth(held, "cuDNN handle", before).map_err(|err| err.to_string())?;
            Ok((library, handle))
        });
        match loaded {
            Ok((library, handle)) => {
                log.info(format!(
                    "cuDNN {} (built for CUDA {}.{}) from {}",
                    library.version_text(),
                    library.cudart / 1000,
                    library.cudart % 1000 / 10,
                    library.path.display()
                ));
                let shared = Shared {
                    library,
                    plans: Mutex::default(),
                    handle: Mutex::new(handle),
                    closing: AtomicBool::new(false),
                };
                Ok(with(
                    Some(Arc::new(shared)),
                    format!("cudnn {}: not checked yet", library.version_text()),
                ))
            }
            Err(why) if explicit => Err(CudaError::Unavailable(format!(
                "attention_engine = cudnn: {why}"
            ))),
            Err(why) => Ok(with(None, format!("kernel: {why}"))),
        }
    }

    /// The loaded cuDNN, if any.
    pub(crate) fn library(&self) -> Option<&'static CudnnLibrary> {
        self.cudnn.as_ref().map(|shared| shared.library)
    }

    /// Whether cuDNN serves attention over `dtype` at `head_dim` (it passed the check).
    pub(crate) fn serves(&self, dtype: DType, head_dim: u64) -> bool {
        self.ready.contains(&(dtype, head_dim))
    }

    /// Takes the outcome of the check at open (`CudaDevice::check_cudnn_attention`, which took
    /// `took_ms`): the pairs that passed serve, and `note` says which, and why any other runs
    /// the plugin's kernel.
    pub(crate) fn record_check(
        &mut self,
        ready: Vec<(DType, u64)>,
        failures: &[String],
        took_ms: u128,
    ) {
        let version = self
            .library()
            .map_or_else(String::new, CudnnLibrary::version_text);
        let mut note = if ready.is_empty() {
            format!("kernel: cuDNN {version} did not pass the check at open")
        } else {
            let pairs: Vec<String> = ready
                .iter()
                .map(|(dtype, head_dim)| format!("{} {head_dim}", dtype_name(*dtype)))
                .collect();
            format!(
                "cudnn {version} for {} (within the check's bound of the plugin kernel at open)",
                pairs.join(", ")
            )
        };
        if !failures.is_empty() {
            note.push_str(&format!(
                "; the plugin's kernel for {}",
                failures.join("; ")
            ));
        }
        note.push_str(&format!("; checked in {took_ms} ms"));
        self.note = note;
        self.ready = ready;
    }

    /// Marks the device's open as over (see `opened`): calls' workspace is fixed at what the
    /// check's plans needed, and a thread with `ctx` current starts building plans for the
    /// shapes calls ask for. Without that thread (it could not start), attention runs the
    /// plugin's kernel.
    pub(crate) fn set_opened(&self, ctx: &Arc<CudaContext>) {
        let log = self.log;
        if let Some(shared) = &self.cudnn {
            let most = {
                let mut plans = lock(&shared.plans);
                plans.from_open = plans.by_shape.keys().copied().collect();
                plans
                    .by_shape
                    .values()
                    .filter_map(|entry| match entry {
                        Entry::Ready(plan) => Some(plan.workspace),
                        _ => None,
                    })
                    .max()
                    .unwrap_or(0)
            };
            self.workspace_after_open.store(most, Ordering::Release);
            if !self.ready.is_empty() {
                let (shapes, queue) = mpsc::channel();
                let shared = Arc::clone(shared);
                let ctx = Arc::clone(ctx);
                let spawned = std::thread::Builder::new()
                    .name("iris-cudnn-plans".to_owned())
                    .spawn(move || build_plans(&shared, &ctx, &queue, most, log));
                match spawned {
                    Ok(thread) => *lock(&self.builder) = Some(Builder { shapes, thread }),
                    Err(err) => log.warn(format!(
                        "cuDNN attention: no thread to build plans ({err}); attention runs \
                         the plugin's kernel"
                    )),
                }
            }
        }
        self.opened.store(true, Ordering::Release);
    }

    /// Why cuDNN has no plan for `shape`, if it was tried and has none.
    pub(crate) fn why_not(&self, shape: &SdpaShape) -> Option<String> {
        let shared = self.cudnn.as_ref()?;
        match lock(&shared.plans).by_shape.get(shape)? {
            Entry::Refused(why) | Entry::Failed { why, .. } => Some(why.clone()),
            Entry::Building | Entry::Ready(_) => None,
        }
    }

    /// Device memory that plans built after open added, for the memory report.
    pub(crate) fn grown(&self) -> u64 {
        self.cudnn
            .as_ref()
            .map_or(0, |shared| lock(&shared.plans).grown)
    }

    /// The workspace calls over `shapes` get: during open, the most their plans need (building
    /// them; 0 for shapes without a plan, which run the plugin's kernel); after it, the same
    /// fixed size for every call, so that a plan finished between the host's sizing of a step
    /// and its run changes nothing the host planned.
    pub(crate) fn workspace(&self, shapes: &[SdpaShape]) -> u64 {
        let Some(shared) = &self.cudnn else {
            return 0;
        };
        if self.opened.load(Ordering::Acquire) {
            return self.workspace_after_open.load(Ordering::Acquire);
        }
        let mut plans = lock(&shared.plans);
        let handle = lock(&shared.handle);
        let mut most = 0;
        for shape in shapes {
            if let Entry::Ready(plan) = plans.entry_built_now(shared.library, &handle, shape) {
                most = most.max(plan.workspace);
            }
        }
        most
    }

    /// Enqueues `shape`'s plan over `operands` on `stream` (the handle's), if it is ready:
    /// `Ok(false)` when it is not (or the builder holds the handle), and the caller runs its
    /// kernel. During open the plan is built here; after it, a shape seen for the first time is
    /// handed to the builder thread. A plan's first execution after open waits for the queue,
    /// so that what the library loaded for it is measured and reported. A plan whose execution
    /// fails after open is dropped and the shape refused ([`Sdpa::refuse_failed`]): `Ok(false)`
    /// too, and the caller's kernel computes the run; during open (the check) the error is
    /// returned.
    pub(crate) fn run(
        &self,
        shape: &SdpaShape,
        operands: &SdpaOperands,
        workspace_given: u64,
        scale: f32,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<bool, CudaError> {
        let Some(shared) = &self.cudnn else {
            return Ok(false);
        };
        let library = shared.library;
        let mut plans = lock(&shared.plans);
        let opened = self.opened.load(Ordering::Acquire);
        let handle = if opened {
            match plans.by_shape.get(shape) {
                None => {
                    self.ask(shared, &mut plans, shape, stream)?;
                    return Ok(false);
                }
                Some(Entry::Ready(_)) => {}
                Some(Entry::Building | Entry::Refused(_) | Entry::Failed { .. }) => {
                    return Ok(false);
                }
            }
            match try_lock(&shared.handle) {
                Some(handle) => handle,
                // The builder is building: no waiting for it.
                None => return Ok(false),
            }
        } else {
            lock(&shared.handle)
        };
        // Shapes asked for while the plans held less than `cudnn_plan_memory` were all built,
        // and what a plan takes is known only once it ran: a plan not yet run when the option
        // is reached is dropped unrun, so that the plans exceed it by at most the one whose
        // first execution crossed it.
        if opened
            && plans.grown >= self.plan_memory
            && matches!(plans.by_shape.get(shape), Some(Entry::Ready(plan)) if !plan.executed)
        {
            let why = self.plans_full(&mut plans);
            plans.by_shape.insert(*shape, Entry::Refused(why));
            return Ok(false);
        }
        let plan = match plans.entry_built_now(library, &handle, shape) {
            Entry::Ready(plan) => plan,
            Entry::Building | Entry::Refused(_) | Entry::Failed { .. } => return Ok(false),
        };
        if plan.workspace > workspace_given {
            return Err(CudaError::Invalid(format!(
                "the workspace has {workspace_given} bytes, cuDNN's plan for this call needs {} \
                 (as attention_workspace reports)",
                plan.workspace
            )));
        }
        // A plan's first execution after open: what it adds is measured from here (its build
        // may have come earlier, in a workspace query or on the builder thread). Frees queued
        // before it give their blocks back at a wait: settled first, they are not taken for
        // memory the execution did not add.
        let before = if !plan.executed && opened {
            memory::wait(stream)?;
            Some(used()?)
        } else {
            None
        };
        if let Err(err) = cudnn::execute(&library.lib, &handle, plan, operands, scale) {
            if !opened {
                return Err(err);
            }
            // Left Ready, the plan would fail every later call of the shape the same way (an
            // execution that could not get its memory is never marked executed), where the
            // plugin's kernel needs no memory and serves it.
            self.refuse_failed(&mut plans, shape, &err, before, stream)?;
            return Ok(false);
        }
        plan.executed = true;
        if let Some(before) = before {
            memory::wait(stream)?;
            plans.grown += used()?.saturating_sub(before);
        }
        Ok(true)
    }

    /// Drops the plans built after open (and the shapes refused since, so that a shape refused
    /// at the option `cudnn_plan_memory`, or whose plan's execution failed for what may have
    /// been lack of memory, is tried again), after the queue that may still run them (on
    /// `stream`) and the builder's plan at hand; a plan the builder is making stays asked for.
    /// Returns the device memory that gave back, which leaves the plans' reported figure; the
    /// next call of a dropped shape asks for its plan again.
    pub(crate) fn trim(&self, stream: cudarc::driver::sys::CUstream) -> Result<u64, CudaError> {
        let Some(shared) = &self.cudnn else {
            return Ok(0);
        };
        if !self.opened.load(Ordering::Acquire) {
            return Ok(0);
        }
        // The order every thread takes them in: plans, then the handle.
        let mut plans = lock(&shared.plans);
        let _handle = lock(&shared.handle);
        self.drop_after_open(&mut plans, stream, "trim")
    }

    /// Drops the plans built after open and the shapes refused since (a plan being built stays
    /// asked for, and a shape whose plan failed other than for lack of memory stays on the
    /// kernel), after waiting for `stream` (queued work may still run them), with the handle
    /// held by the caller. Returns the device memory that gave back (the library's for
    /// those plans, taken from [`Plans::grown`]) and logs it, after `why`.
    fn drop_after_open(
        &self,
        plans: &mut Plans,
        stream: cudarc::driver::sys::CUstream,
        why: &str,
    ) -> Result<u64, CudaError> {
        memory::wait(stream)?;
        let before = used()?;
        let mut dropped = 0;
        let Plans {
            by_shape,
            from_open,
            ..
        } = plans;
        by_shape.retain(|shape, entry| {
            let keep = match entry {
                Entry::Building => true,
                Entry::Failed { until_trim, .. } => !*until_trim,
                Entry::Ready(_) | Entry::Refused(_) => from_open.contains(shape),
            };
            if !keep && matches!(entry, Entry::Ready(_)) {
                dropped += 1;
            }
            keep
        });
        let released = before.saturating_sub(used()?);
        plans.grown = plans.grown.saturating_sub(released);
        // Said again only if memory came back below the option and grows to it once more.
        plans.full = plans.grown >= self.plan_memory;
        if dropped > 0 {
            // Whether the library gives its memory back with the plans shows only on a GPU.
            self.log.info(format!(
                "{why}: dropped {dropped} cuDNN plans built after open, which gave back \
                 {released} bytes; {} bytes still reported for plans built after open",
                plans.grown
            ));
        }
        Ok(released)
    }

    /// Replaces `shape`'s plan, whose execution after open failed with `err`, by a refusal (the
    /// plugin's kernel runs the shape from the failed call on, and the log says why, once), with
    /// the caller holding the handle. `before` is the device memory in use before the
    /// execution, where it was the plan's first: what the failure left allocated (cuDNN may
    /// keep some of what it loaded) counts in [`Plans::grown`] as a success's growth would.
    /// Where the plan had run before, what dropping it gives back leaves that figure. A plan
    /// built at open is the open's, and its memory stays in the open's figure (an overestimate
    /// once it is dropped, on the side that keeps the host from over-filling the device).
    fn refuse_failed(
        &self,
        plans: &mut Plans,
        shape: &SdpaShape,
        err: &CudaError,
        before: Option<u64>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), CudaError> {
        // The execution may have queued work that still reads the plan.
        memory::wait(stream)?;
        let held = used()?;
        let until_trim = before.is_some() || err.is_out_of_memory();
        let which = if before.is_some() { "first" } else { "latest" };
        let why = format!("its plan's {which} execution failed: {err}");
        plans
            .by_shape
            .insert(*shape, Entry::Failed { why, until_trim });
        let after = used()?;
        // A shape of the open's refused here leaves the open's: trim treats its refusal as any
        // other, and a plan built for it later is measured as plans built after open are.
        let from_open = plans.from_open.remove(shape);
        match before {
            Some(before) => plans.grown += after.saturating_sub(before),
            None if !from_open => {
                plans.grown = plans.grown.saturating_sub(held.saturating_sub(after));
            }
            None => {}
        }
        if plans.grown < self.plan_memory {
            plans.full = false;
        }
        self.log.warn(format!(
            "{}: its {which} execution failed ({err}); the plugin's kernel ran the call and \
             runs the shape {}",
            describe(shape),
            if until_trim {
                "until the next trim (a reset), after which its plan is built again"
            } else {
                "until the device closes"
            }
        ));
        Ok(())
    }

    /// Hands `shape` to the builder thread, after making room for it (at [`MAX_PLANS`], the
    /// queue is waited for and the plans built after open are dropped, unless the builder
    /// holds the handle, when the shape is asked for again at its next call); or, once the
    /// plans hold the option `cudnn_plan_memory`'s device memory, records that the plugin's
    /// kernel runs it.
    fn ask(
        &self,
        shared: &Shared,
        plans: &mut Plans,
        shape: &SdpaShape,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), CudaError> {
        if plans.by_shape.len() >= MAX_PLANS {
            let Some(_handle) = try_lock(&shared.handle) else {
                return Ok(());
            };
            self.drop_after_open(plans, stream, &format!("{MAX_PLANS} cuDNN plans"))?;
        }
        if plans.grown >= self.plan_memory {
            let why = self.plans_full(plans);
            plans.by_shape.insert(*shape, Entry::Refused(why));
            return Ok(());
        }
        let entry = match lock(&self.builder).as_ref() {
            Some(builder) if builder.shapes.send(*shape).is_ok() => Entry::Building,
            _ => Entry::Refused("no thread builds cuDNN plans".to_owned()),
        };
        plans.by_shape.insert(*shape, entry);
        Ok(())
    }
}

impl Sdpa {
    /// Why a shape gets no plan once the plans built after open hold `cudnn_plan_memory`; the
    /// first time, the log says so.
    fn plans_full(&self, plans: &mut Plans) -> String {
        let why = format!(
            "cuDNN's plans built after open hold {} bytes of device memory, the option \
             cudnn_plan_memory's {} or more",
            plans.grown, self.plan_memory
        );
        if !plans.full {
            plans.full = true;
            self.log.warn(format!(
                "{why}: attention of shapes without a plan runs the plugin's kernel"
            ));
        }
        why
    }
}

impl Drop for Sdpa {
    /// Stops the builder thread (after the plan at hand) before the plans and the handle go.
    fn drop(&mut self) {
        if let Some(shared) = &self.cudnn {
            shared.closing.store(true, Ordering::Release);
        }
        if let Some(Builder { shapes, thread }) = lock(&self.builder).take() {
            drop(shapes);
            // A panic on that thread has been reported by the panic hook; nothing is left to
            // clean but what drops here.
            let _ = thread.join();
        }
    }
}

impl Plans {
    /// The entry of `shape`, its plan built here with `handle` at the first call (during
    /// open: its check builds what it runs).
    fn entry_built_now(
        &mut self,
        library: &'static CudnnLibrary,
        handle: &Handle,
        shape: &SdpaShape,
    ) -> &mut Entry {
        self.by_shape.entry(*shape).or_insert_with(|| {
            match cudnn::build_plan(&library.lib, handle, shape, None) {
                Ok(plan) => Entry::Ready(plan),
                Err(err) => Entry::Refused(err.to_string()),
            }
        })
    }
}

/// The builder thread: builds the plans of the shapes `queue` brings with the device's context
/// current, each within `max_workspace` bytes of workspace, until the queue closes or the
/// device does. Why a shape has none is logged once.
fn build_plans(
    shared: &Shared,
    ctx: &CudaContext,
    queue: &mpsc::Receiver<SdpaShape>,
    max_workspace: u64,
    log: Logger,
) {
    let bound = ctx.bind_to_thread();
    for shape in queue {
        if shared.closing.load(Ordering::Acquire) {
            return;
        }
        let started = Instant::now();
        let built = match &bound {
            Ok(()) => {
                let handle = lock(&shared.handle);
                cudnn::build_plan(&shared.library.lib, &handle, &shape, Some(max_workspace))
                    .map_err(|err| err.to_string())
            }
            Err(err) => Err(format!(
                "the builder thread cannot bind the context: {err:?}"
            )),
        };
        let what = describe(&shape);
        let entry = match built {
            Ok(plan) => {
                log.info(format!(
                    "{what}: built in {} ms",
                    started.elapsed().as_millis()
                ));
                Entry::Ready(plan)
            }
            Err(why) => {
                log.info(format!("{what}: none, the plugin's kernel runs it: {why}"));
                Entry::Refused(why)
            }
        };
        lock(&shared.plans).by_shape.insert(shape, entry);
    }
}

/// `shape`'s plan, for the log.
fn describe(shape: &SdpaShape) -> String {
    format!(
        "cuDNN attention plan for {} x {} tokens, {} heads of {} ({})",
        shape.batch,
        shape.tokens,
        shape.heads,
        shape.head_dim,
        if shape.bf16 { "bf16" } else { "f16" }
    )
}

/// `mutex`'s guard if no other thread holds it (a poisoned lock's values stay consistent, as
/// for [`lock`]).
fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Whether cuDNN's plans take `views` (each a view and its address): every address and row
/// stride a multiple of [`cudnn::ALIGNMENT`] bytes.
pub(crate) fn aligned(views: &[(u64, &Mat)]) -> bool {
    views.iter().all(|(address, mat)| {
        let bytes = mat.dtype.size().unwrap_or(0);
        address.is_multiple_of(cudnn::ALIGNMENT)
            && (mat.stride as u64 * bytes).is_multiple_of(cudnn::ALIGNMENT)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cut_equal_lengths_into_powers_of_two() {
        let segments: Vec<(usize, usize)> = (0..41).map(|i| (i * 784, 784)).collect();
        let runs = runs(&segments);
        assert_eq!(
            runs,
            vec![
                Run {
                    first: 0,
                    batch: 32,
                    start: 0,
                    tokens: 784
                },
                Run {
                    first: 32,
                    batch: 8,
                    start: 32 * 784,
                    tokens: 784
                },
                Run {
                    first: 40,
                    batch: 1,
                    start: 40 * 784,
                    tokens: 784
                },
            ]
        );
    }

    #[test]
    fn runs_follow_changes_of_length_and_skip_empty_segments() {
        // Lengths 130, 130, 0, 1, 64, 64, 64.
        let segments = [
            (0, 130),
            (130, 130),
            (260, 0),
            (260, 1),
            (261, 64),
            (325, 64),
            (389, 64),
        ];
        let found: Vec<(usize, usize, usize, usize)> = runs(&segments)
            .iter()
            .map(|r| (r.first, r.batch, r.start, r.tokens))
            .collect();
        assert_eq!(
            found,
            vec![
                (0, 2, 0, 130),
                (3, 1, 260, 1),
                (4, 2, 261, 64),
                (6, 1, 389, 64)
            ]
        );
    }
}
