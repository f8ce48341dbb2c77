//! The encoder ops as sequences of aclnn calls.
//!
//! Every ABI op is written once, as a function over an [`Exec`], and runs in two modes:
//!
//! - **measure** (the `*_workspace` queries): each aclnn call's first phase only, its executor
//!   released; the answer is a [`Requirement`]: scratch for intermediate tensors this plugin
//!   needs plus the largest aclnn workspace of the sequence. Operands need not exist yet, so
//!   every descriptor points at one small block the device keeps for this purpose: a real,
//!   aligned device address that no first phase reads, where a null one might be refused.
//! - **run**: the same calls with the operands' device addresses, each first phase followed by
//!   its second phase on the device's stream. Intermediates live in the scratch part of the
//!   caller's workspace, and every aclnn call shares the rest (the calls run one after another
//!   on one stream, so they never overlap).
//!
//! The caller's workspace comes from the host's caching allocator, so every byte an op uses is
//! accounted by the host. A first phase that asks for more than was measured is an internal
//! error naming the op, never an overrun.

pub mod attention;
pub mod elementwise;
pub mod gemm;
pub mod norm;
pub mod rotary;

use std::ffi::c_void;

use iris_plugin::abi::{BufferHandle, DType};
use iris_plugin::validate::Mat;

use crate::error::AscendError;
use crate::memory::Memory;
use crate::runtime::Runtime;
use crate::stream::offset_ptr;
use crate::sys;
use crate::tensor::{Desc, Tensor, acl_dtype, release_executor};

/// Alignment of intermediates and of the aclnn workspace inside the caller's workspace.
pub const ALIGN: u64 = 512;

/// The second phase of every aclnn op.
pub type RunFn = unsafe extern "C" fn(
    *mut c_void,
    u64,
    *mut sys::aclOpExecutor,
    sys::aclrtStream,
) -> sys::aclnnStatus;

/// Both phases of one aclnn op, resolved in an op library (see the `aclnn!` macro).
#[derive(Clone, Copy)]
pub struct OpFns<W: Copy> {
    /// `aclnnXxxGetWorkspaceSize`.
    pub get_workspace: W,
    /// `aclnnXxx`.
    pub run: RunFn,
    /// The first phase's name.
    pub ws_name: &'static str,
    /// The op's name.
    pub name: &'static str,
    /// The op library it came from.
    pub library: &'static str,
}

/// What an op needs from the caller's workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Requirement {
    /// Bytes of intermediates (each aligned to [`ALIGN`]).
    pub scratch: u64,
    /// The largest aclnn workspace of the sequence.
    pub aclnn: u64,
}

impl Requirement {
    /// Bytes to ask the caller for: both parts plus room to align the start.
    pub fn total(&self) -> u64 {
        if self.scratch == 0 && self.aclnn == 0 {
            0
        } else {
            self.scratch + align(self.aclnn) + ALIGN
        }
    }
}

enum Mode {
    Measure {
        address: *mut c_void,
    },
    Run {
        stream: sys::aclrtStream,
        base: *mut c_void,
        planned: Requirement,
    },
}

/// One op's sequence of aclnn calls, measuring or running.
pub struct Exec<'a> {
    rt: &'static Runtime,
    memory: Option<&'a Memory>,
    mode: Mode,
    scratch: u64,
    aclnn: u64,
}

impl<'a> Exec<'a> {
    /// Measures: first phases only, every descriptor at `address` (see the module's docs).
    pub fn measure(rt: &'static Runtime, address: *mut c_void) -> Exec<'a> {
        Exec {
            rt,
            memory: None,
            mode: Mode::Measure { address },
            scratch: 0,
            aclnn: 0,
        }
    }

    /// Runs on `stream` with the operands of `memory` and the caller's workspace at
    /// `workspace` (its device address; null when `planned` needs nothing).
    pub fn run(
        rt: &'static Runtime,
        memory: &'a Memory,
        stream: sys::aclrtStream,
        workspace: *mut c_void,
        planned: Requirement,
    ) -> Exec<'a> {
        // The caller's slice holds `planned.total()` bytes, which includes room to align.
        let base = if workspace.is_null() {
            workspace
        } else {
            let addr = workspace as usize as u64;
            offset_ptr(workspace, align(addr) - addr)
        };
        Exec {
            rt,
            memory: Some(memory),
            mode: Mode::Run {
                stream,
                base,
                planned,
            },
            scratch: 0,
            aclnn: 0,
        }
    }

    /// The runtime.
    pub fn rt(&self) -> &'static Runtime {
        self.rt
    }

    /// What the sequence needed (after measuring).
    pub fn requirement(&self) -> Requirement {
        Requirement {
            scratch: self.scratch,
            aclnn: self.aclnn,
        }
    }

    /// An intermediate of `bytes` in the scratch part of the workspace (the sizing address
    /// when measuring).
    pub fn temp(&mut self, bytes: u64) -> Result<*mut c_void, AscendError> {
        let at = self.scratch;
        self.scratch += align(bytes.max(1));
        match self.mode {
            Mode::Measure { address } => Ok(address),
            Mode::Run { base, planned, .. } => {
                if self.scratch > planned.scratch {
                    return Err(AscendError::Internal(format!(
                        "an intermediate needs {} bytes of scratch, but {} were measured",
                        self.scratch, planned.scratch
                    )));
                }
                Ok(offset_ptr(base, at))
            }
        }
    }

    /// The device address of a buffer (the sizing address when measuring).
    pub fn base(&self, buf: BufferHandle) -> *mut c_void {
        match (self.memory, &self.mode) {
            (_, Mode::Measure { address }) => *address,
            (Some(memory), _) => memory.base(buf),
            (None, _) => std::ptr::null_mut(),
        }
    }

    /// A descriptor of `desc` in `buf`.
    pub fn tensor(&self, desc: &Desc, buf: BufferHandle) -> Result<Tensor<'static>, AscendError> {
        Tensor::new(self.rt, desc, self.base(buf))
    }

    /// A descriptor of `desc` over an intermediate from [`Exec::temp`].
    pub fn temp_tensor(
        &self,
        desc: &Desc,
        base: *mut c_void,
    ) -> Result<Tensor<'static>, AscendError> {
        Tensor::new(self.rt, desc, base)
    }

    /// One aclnn call: `phase1` calls the first phase with the workspace-size and executor
    /// out-pointers; then, when running, the second phase runs on the stream with the shared
    /// aclnn workspace.
    pub fn call<W: Copy>(
        &mut self,
        op: OpFns<W>,
        phase1: impl FnOnce(W, *mut u64, *mut *mut sys::aclOpExecutor) -> sys::aclnnStatus,
    ) -> Result<(), AscendError> {
        let mut size = 0u64;
        let mut executor: *mut sys::aclOpExecutor = std::ptr::null_mut();
        let status = phase1(op.get_workspace, &mut size, &mut executor);
        self.rt.check_aclnn(op.ws_name, status)?;
        match self.mode {
            Mode::Measure { .. } => {
                self.aclnn = self.aclnn.max(size);
                release_executor(self.rt, executor);
                Ok(())
            }
            Mode::Run {
                stream,
                base,
                planned,
            } => {
                if size > align(planned.aclnn) {
                    release_executor(self.rt, executor);
                    return Err(AscendError::Internal(format!(
                        "{} asks for {size} bytes of workspace, but {} were measured for this call",
                        op.ws_name, planned.aclnn
                    )));
                }
                let workspace = if size == 0 {
                    std::ptr::null_mut()
                } else {
                    offset_ptr(base, planned.scratch)
                };
                // SAFETY: `executor` came from the first phase just now; the workspace holds
                // `size` bytes of the caller's slice; operands and intermediates are live
                // until this work is done (queue-ordered frees, caller-owned workspace).
                let status = unsafe { (op.run)(workspace, size, executor, stream) };
                self.rt.check_aclnn(op.name, status)
            }
        }
    }
}

/// `value` rounded up to [`ALIGN`].
pub fn align(value: u64) -> u64 {
    value.div_ceil(ALIGN) * ALIGN
}

/// Element size of a dtype the validation accepted.
pub fn elem(dtype: DType) -> u64 {
    dtype.size().unwrap_or(4)
}

/// A 2-D descriptor of a checked matrix view.
pub fn mat_desc(mat: &Mat) -> Result<Desc, AscendError> {
    let size = elem(mat.dtype);
    Ok(Desc {
        dtype: acl_dtype(mat.dtype)?,
        dims: vec![dim(mat.rows), dim(mat.cols)],
        strides: vec![dim(mat.stride), 1],
        offset: i64::try_from(mat.offset / size).unwrap_or(i64::MAX),
    })
}

/// A checked dimension as aclnn's `int64_t` (validated sizes fit in memory, far below 2^63).
pub fn dim(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Bytes of `count` elements of `dtype`.
pub fn bytes(count: usize, dtype: DType) -> u64 {
    (count as u64).saturating_mul(elem(dtype))
}
