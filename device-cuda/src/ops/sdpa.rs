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

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

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
/// Plans kept at most; beyond it the device waits for its queue and starts over (a plan is
/// built in a few library calls, but every distinct segment length and batch has its own).
const MAX_PLANS: usize = 1024;

/// cuDNN attention on one device.
pub(crate) struct Sdpa {
    /// Declared (so dropped) before the handle they were built with.
    plans: Mutex<Plans>,
    /// cuDNN and a handle on the device's queue, when the options and the device let it be
    /// tried and it loaded.
    cudnn: Option<(&'static CudnnLibrary, Handle)>,
    /// `(dtype, head dim)` pairs that passed the check at open.
    pub(crate) ready: Vec<(DType, u64)>,
    /// What `iris devices` shows: the engine in use, and why.
    pub(crate) note: String,
    /// Set once the device's open is over: device memory a plan adds from then on is measured
    /// and reported ([`Sdpa::grown`]), where before it counts in the open's own warm-up.
    opened: AtomicBool,
}

/// Plans by shape, or why cuDNN has none for it.
#[derive(Default)]
struct Plans {
    by_shape: HashMap<SdpaShape, Result<SdpaPlan, String>>,
    /// Device memory first executions of plans made after open added (loaded kernels).
    grown: u64,
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
        let without = |note: String| Sdpa {
            cudnn: None,
            plans: Mutex::default(),
            ready: Vec::new(),
            note,
            opened: AtomicBool::new(false),
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
            return Ok(without(format!("kernel: {why}")));
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
                Ok(Sdpa {
                    cudnn: Some((library, handle)),
                    note: format!("cudnn {}: not checked yet", library.version_text()),
                    ..without(String::new())
                })
            }
            Err(why) if explicit => Err(CudaError::Unavailable(format!(
                "attention_engine = cudnn: {why}"
            ))),
            Err(why) => Ok(without(format!("kernel: {why}"))),
        }
    }

    /// The loaded cuDNN, if any.
    pub(crate) fn library(&self) -> Option<&'static CudnnLibrary> {
        self.cudnn.as_ref().map(|(library, _)| *library)
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

    /// Marks the device's open as over (see `opened`).
    pub(crate) fn set_opened(&self) {
        self.opened.store(true, Ordering::Release);
    }

    /// Device memory that plans built after open added, for the memory report.
    pub(crate) fn grown(&self) -> u64 {
        lock(&self.plans).grown
    }

    /// The largest workspace the plans of `shapes` need (building those not built yet); 0 for
    /// shapes without a plan, which run the plugin's kernel.
    pub(crate) fn workspace(&self, shapes: &[SdpaShape]) -> u64 {
        let Some((library, handle)) = &self.cudnn else {
            return 0;
        };
        let mut plans = lock(&self.plans);
        let mut most = 0;
        for shape in shapes {
            if let Ok(plan) = plans.plan(library, handle, shape) {
                most = most.max(plan.workspace);
            }
        }
        most
    }

    /// Enqueues `shape`'s plan over `operands` on `stream` (the handle's), building the plan
    /// first where needed. `Ok(false)`: cuDNN has no plan for the shape, and the caller runs
    /// its kernel. A plan's first execution after the device's open waits for the queue, so
    /// that what the library loaded for it is measured and reported.
    pub(crate) fn run(
        &self,
        shape: &SdpaShape,
        operands: &SdpaOperands,
        workspace_given: u64,
        scale: f32,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<bool, CudaError> {
        let Some((library, handle)) = &self.cudnn else {
            return Ok(false);
        };
        let mut plans = lock(&self.plans);
        if plans.by_shape.len() >= MAX_PLANS && !plans.by_shape.contains_key(shape) {
            // Plans may still be referenced by queued work: let it finish first.
            memory::wait(stream)?;
            plans.by_shape.clear();
        }
        let opened = self.opened.load(Ordering::Acquire);
        let (plan, before) = match plans.plan(library, handle, shape) {
            // A plan's first execution after open: what it adds is measured from here (its
            // build may have come earlier, in a workspace query).
            Ok(plan) if !plan.executed && opened => (plan, Some(used()?)),
            Ok(plan) => (plan, None),
            Err(_) => return Ok(false),
        };
        if plan.workspace > workspace_given {
            return Err(CudaError::Invalid(format!(
                "the workspace has {workspace_given} bytes, cuDNN's plan for this call needs {} \
                 (as attention_workspace reports)",
                plan.workspace
            )));
        }
        cudnn::execute(&library.lib, handle, plan, operands, scale)?;
        plan.executed = true;
        if let Some(before) = before {
            memory::wait(stream)?;
            plans.grown += used()?.saturating_sub(before);
        }
        Ok(true)
    }
}

impl Plans {
    /// The plan of `shape`, built at the first call; or why there is none (built once too).
    fn plan(
        &mut self,
        library: &'static CudnnLibrary,
        handle: &Handle,
        shape: &SdpaShape,
    ) -> Result<&mut SdpaPlan, &str> {
        self.by_shape
            .entry(*shape)
            .or_insert_with(|| {
                cudnn::build_plan(&library.lib, handle, shape).map_err(|err| err.to_string())
            })
            .as_mut()
            .map_err(|why| why.as_str())
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
