//! cuDNN's fused attention (`libcudnn.so.9`, loaded at run time when present): what PyTorch's
//! scaled-dot-product attention runs on Hopper, through cuDNN's backend API from Rust.
//!
//! The plugin builds one graph per attention shape: a single `OPERATION_SDPA_FWD` (cuDNN
//! 9.13.1 and later) over Q, K, V and O as `[batch, heads, tokens, head dim]` views of the
//! tower's own row-major buffers (no copies: strides `[tokens · row, head dim, row, 1]`, so Q,
//! K and V may be column blocks of one fused QKV output), with the score scale passed by value.
//! A launch of packed segments becomes one call per run of consecutive segments of one length,
//! the run cut into powers of two (41 images of 784 tokens: 32, 8 and 1), so that a few plans
//! serve every step of a size. cuDNN's heuristic (mode A, then its fallback list) chooses the
//! engine; the first configuration whose plan finalizes is kept, per shape (after open, built
//! on the attention state's own thread: `ops/sdpa.rs`).
//!
//! Loading, the handle and the descriptors live here; which calls take this path, and the
//! check at open that lets it serve, are the attention op's (`ops/attention.rs`).

use std::ffi::{CStr, c_void};
use std::path::PathBuf;
use std::sync::Mutex;

use crate::error::CudaError;
use crate::loader::{self, Library};
use crate::sys::Cudnn;
use crate::sys::cudnn::{
    cudaStream_t, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as AttrType,
    cudnnBackendDescriptor_t, cudnnBackendDescriptorType_t as Kind, cudnnBackendHeurMode_t,
    cudnnDataType_t, cudnnHandle_t, cudnnStatus_t as Status,
};

/// The oldest cuDNN whose fused attention operation
/// (`CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR`, added in 9.13.0) the plugin uses, as
/// `cudnnGetVersion` encodes it: 9.13.1, the oldest cuDNN's own frontend builds that operation
/// with.
pub const MIN_VERSION: usize = 9_13_01;

/// cuDNN, loaded for the process and checked.
#[derive(Debug)]
pub struct CudnnLibrary {
    /// Its entry points.
    pub lib: Cudnn,
    /// `cudnnGetVersion`: `major * 10000 + minor * 100 + patch`.
    pub version: usize,
    /// `cudnnGetCudartVersion`: the CUDA release it was built for (`12080`).
    pub cudart: usize,
    /// Where it was opened from.
    pub path: PathBuf,
}

impl CudnnLibrary {
    /// `9.17.0`.
    pub fn version_text(&self) -> String {
        dotted(self.version)
    }
}

/// `91700` as `9.17.0`.
fn dotted(version: usize) -> String {
    format!(
        "{}.{}.{}",
        version / 10_000,
        version % 10_000 / 100,
        version % 100
    )
}

/// cuDNN for a process running CUDA `major`'s libraries: opened at the first call, then the
/// same library (or the same reason it is not usable) for every later call. Usable means found,
/// every entry point present, version 9.13.1 or newer, built for CUDA `major` (a cuDNN of the
/// other major would load that major's cuBLAS beside the process's).
pub fn load(major: u32) -> Result<&'static CudnnLibrary, String> {
    static LOADED: Mutex<Option<Result<&'static CudnnLibrary, String>>> = Mutex::new(None);
    // The value is plain data, consistent across a panic.
    let mut loaded = LOADED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(done) = loaded.as_ref() {
        return done.clone();
    }
    let done = open(major).map(|library| &*Box::leak(Box::new(library)));
    *loaded = Some(done.clone());
    done
}

/// cuDNN from the folder `dir` (and no other place), checked as [`load`] checks it, for a
/// process running CUDA `major`'s libraries. Tests use it to build the plugin's graphs with a
/// pip-installed cuDNN.
pub fn open_in(dir: &std::path::Path, major: u32) -> Result<CudnnLibrary, String> {
    let opened = loader::open_in(dir, Library::Cudnn, major)
        .map_err(|err| format!("{err}; searched {} only", dir.display()))?;
    checked(opened, major)
}

fn open(major: u32) -> Result<CudnnLibrary, String> {
    let opened = loader::open(Library::Cudnn, major)
        .map_err(|err| format!("{err} ({})", loader::searched()))?;
    checked(opened, major)
}

/// Resolves cuDNN's table and checks its version and CUDA release.
fn checked(opened: loader::Opened, major: u32) -> Result<CudnnLibrary, String> {
    let file = Library::Cudnn.file_name(major);
    // SAFETY: the file is cuDNN, found by its versioned name.
    let lib = unsafe { Cudnn::load(opened.library) }
        .map_err(|err| format!("{file} lacks an entry point: {err}"))?;
    // SAFETY: version queries without arguments or preconditions.
    let (version, cudart) = unsafe { ((lib.cudnnGetVersion)(), (lib.cudnnGetCudartVersion)()) };
    let path = opened.path;
    if version < MIN_VERSION {
        return Err(format!(
            "{} is cuDNN {}; its fused attention operation needs {} or newer",
            path.display(),
            dotted(version),
            dotted(MIN_VERSION)
        ));
    }
    if cudart / 1000 != major as usize {
        return Err(format!(
            "{} (cuDNN {}) is built for CUDA {}.{}, and this process runs CUDA {major}'s \
             libraries: install cuDNN for CUDA {major} (pip's nvidia-cudnn-cu{major})",
            path.display(),
            dotted(version),
            cudart / 1000,
            cudart % 1000 / 10
        ));
    }
    Ok(CudnnLibrary {
        lib,
        version,
        cudart,
        path,
    })
}

/// A cuDNN status as an error of `call`, named by the library (`CUDNN_STATUS_NOT_SUPPORTED`).
fn check(lib: &Cudnn, call: &str, status: i32) -> Result<(), CudaError> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: cudnnGetErrorString takes any status and returns a static string (or null).
    let name = unsafe { (lib.cudnnGetErrorString)(status) };
    let name = if name.is_null() {
        "an unnamed status".to_owned()
    } else {
        // SAFETY: a NUL-terminated string the library owns for the life of the process.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    Err(CudaError::Cudnn {
        call: call.to_owned(),
        status: format!("{name} ({status})"),
        alloc_failed: alloc_failed(status),
    })
}

/// Whether `status` says cuDNN could not allocate memory: cuDNN 9's
/// `CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED` (which 9.x keeps the 8.x name
/// `CUDNN_STATUS_ALLOC_FAILED` for) and `..._DEVICE_ALLOCATION_FAILED`. Such a
/// failure reaches the host as out of memory, which it answers by freeing memory and retrying.
pub(crate) fn alloc_failed(status: i32) -> bool {
    [
        Status::CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED,
        Status::CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED,
    ]
    .into_iter()
    .any(|alloc| alloc as i32 == status)
}

/// A cuDNN handle, bound to the device's queue; destroyed with it.
pub(crate) struct Handle {
    lib: &'static Cudnn,
    raw: cudnnHandle_t,
}

impl Handle {
    /// A handle for the current context, its work enqueued on `stream`.
    pub(crate) fn new(lib: &'static Cudnn, stream: cudaStream_t) -> Result<Handle, CudaError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the device's context is current.
        check(lib, "cudnnCreate", unsafe { (lib.cudnnCreate)(&mut raw) })?;
        let handle = Handle { lib, raw };
        // SAFETY: a live handle and the device's stream.
        check(lib, "cudnnSetStream", unsafe {
            (lib.cudnnSetStream)(handle.raw, stream)
        })?;
        Ok(handle)
    }
}

// SAFETY: a cuDNN handle may be used from any thread with the device's context current, one
// thread at a time; the attention state keeps it behind a mutex.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate, destroyed once. Nothing to do on failure.
        unsafe { (self.lib.cudnnDestroy)(self.raw) };
    }
}

/// A backend descriptor, destroyed when dropped.
struct Descriptor {
    lib: &'static Cudnn,
    raw: cudnnBackendDescriptor_t,
    kind: &'static str,
}

impl Descriptor {
    fn new(lib: &'static Cudnn, kind: Kind, name: &'static str) -> Result<Descriptor, CudaError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check(
            lib,
            &format!("cudnnBackendCreateDescriptor ({name})"),
            unsafe { (lib.cudnnBackendCreateDescriptor)(kind, &mut raw) },
        )?;
        Ok(Descriptor {
            lib,
            raw,
            kind: name,
        })
    }

    /// Sets attribute `attr` to `values`, each an element of C type `ty`.
    fn set<T>(&self, attr: Attr, ty: AttrType, values: &[T]) -> Result<(), CudaError> {
        let count = i64::try_from(values.len()).unwrap_or(i64::MAX);
        // SAFETY: `values` holds `count` elements of the C type `ty` names (the callers below
        // pass each attribute its documented element type), read during the call only.
        let status = unsafe {
            (self.lib.cudnnBackendSetAttribute)(
                self.raw,
                attr,
                ty,
                count,
                values.as_ptr().cast::<c_void>(),
            )
        };
        check(
            self.lib,
            &format!("cudnnBackendSetAttribute ({}, {attr:?})", self.kind),
            status,
        )
    }

    fn set_i64(&self, attr: Attr, values: &[i64]) -> Result<(), CudaError> {
        self.set(attr, AttrType::CUDNN_TYPE_INT64, values)
    }

    fn set_descriptors(&self, attr: Attr, values: &[&Descriptor]) -> Result<(), CudaError> {
        let raw: Vec<cudnnBackendDescriptor_t> = values.iter().map(|d| d.raw).collect();
        self.set(attr, AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    fn set_handle(&self, attr: Attr, handle: &Handle) -> Result<(), CudaError> {
        self.set(attr, AttrType::CUDNN_TYPE_HANDLE, &[handle.raw])
    }

    fn finalize(&self) -> Result<(), CudaError> {
        // SAFETY: a live descriptor whose attributes were set above.
        let status = unsafe { (self.lib.cudnnBackendFinalize)(self.raw) };
        check(
            self.lib,
            &format!("cudnnBackendFinalize ({})", self.kind),
            status,
        )
    }

    /// Reads attribute `attr`, elements of C type `ty`, into `values` (room for `requested`
    /// of them; null with 0 to ask for the count only); returns how many there are.
    ///
    /// # Safety
    ///
    /// `values` must hold `requested` elements of the C type `ty` names.
    unsafe fn get(
        &self,
        attr: Attr,
        ty: AttrType,
        requested: i64,
        values: *mut c_void,
    ) -> Result<i64, CudaError> {
        let mut count = 0i64;
        // SAFETY: a live descriptor, a valid count pointer, and `values` as the caller vouches.
        let status = unsafe {
            (self.lib.cudnnBackendGetAttribute)(self.raw, attr, ty, requested, &mut count, values)
        };
        check(
            self.lib,
            &format!("cudnnBackendGetAttribute ({}, {attr:?})", self.kind),
            status,
        )?;
        Ok(count)
    }

    /// One `int64` attribute of a finalized descriptor.
    fn get_i64(&self, attr: Attr) -> Result<i64, CudaError> {
        let mut value = 0i64;
        // SAFETY: room for the one int64 requested.
        unsafe {
            self.get(
                attr,
                AttrType::CUDNN_TYPE_INT64,
                1,
                (&raw mut value).cast::<c_void>(),
            )
        }?;
        Ok(value)
    }

    /// The engine configurations this heuristic proposes, best first.
    fn heuristic_results(&self) -> Result<Vec<Descriptor>, CudaError> {
        let (results, ty) = (
            Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        );
        // SAFETY: asking for the count only: no elements are written.
        let count = unsafe { self.get(results, ty, 0, std::ptr::null_mut()) }?;
        let mut configs = (0..count.clamp(0, 64))
            .map(|_| {
                Descriptor::new(
                    self.lib,
                    Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                    "engine config",
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        if configs.is_empty() {
            return Ok(configs);
        }
        let mut raw: Vec<cudnnBackendDescriptor_t> = configs.iter().map(|c| c.raw).collect();
        let requested = i64::try_from(raw.len()).unwrap_or(0);
        // SAFETY: `raw` holds `requested` engine config descriptors for cuDNN to fill.
        let filled =
            unsafe { self.get(results, ty, requested, raw.as_mut_ptr().cast::<c_void>()) }?;
        configs.truncate(usize::try_from(filled).unwrap_or(0));
        Ok(configs)
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once. Nothing to do on
        // failure.
        unsafe { (self.lib.cudnnBackendDestroyDescriptor)(self.raw) };
    }
}

/// Tensor unique ids of the graph, one per operand.
const UID_Q: i64 = 1;
const UID_K: i64 = 2;
const UID_V: i64 = 3;
const UID_O: i64 = 4;
const UID_SCALE: i64 = 5;

/// The alignment the plan is built for: every operand's address and row stride in bytes must
/// be a multiple of it (what cuDNN's Hopper kernels load with TMA need).
pub(crate) const ALIGNMENT: u64 = 16;

/// One attention shape cuDNN computes: `batch` segments of `tokens` tokens each, laid out one
/// after another in the rows of Q, K, V and O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SdpaShape {
    /// `true` for bf16, `false` for f16.
    pub bf16: bool,
    /// Heads.
    pub heads: u64,
    /// Channels per head.
    pub head_dim: u64,
    /// Tokens of each segment (queries and keys alike).
    pub tokens: u64,
    /// Segments in the call.
    pub batch: u64,
    /// Row strides of Q, K, V and O, in elements.
    pub strides: [u64; 4],
}

/// A finalized execution plan and what it needs.
pub(crate) struct SdpaPlan {
    plan: Descriptor,
    /// Workspace bytes the plan needs.
    pub(crate) workspace: u64,
    /// Whether it has run (its first execution may load kernels).
    pub(crate) executed: bool,
    /// The graph's descriptors, kept for the plan's life.
    _graph: Vec<Descriptor>,
}

// SAFETY: cuDNN descriptors are host objects not tied to a thread; a plan is built on one
// thread and then used under the attention state's mutexes (its handle's among them).
unsafe impl Send for SdpaPlan {}

/// The attention operation of `shape` and its tensors (Q, K, V, O, scale), finalized: what
/// [`build_plan`] puts in a graph.
fn operation(
    lib: &'static Cudnn,
    shape: &SdpaShape,
) -> Result<(Vec<Descriptor>, Descriptor), CudaError> {
    let data_type = if shape.bf16 {
        cudnnDataType_t::CUDNN_DATA_BFLOAT16
    } else {
        cudnnDataType_t::CUDNN_DATA_HALF
    };
    let dim = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
    let (b, h, s, d) = (
        dim(shape.batch),
        dim(shape.heads),
        dim(shape.tokens),
        dim(shape.head_dim),
    );
    let tensor = |uid: i64, row: u64| -> Result<Descriptor, CudaError> {
        let t = Descriptor::new(lib, Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor")?;
        let row = dim(row);
        t.set(
            Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
            AttrType::CUDNN_TYPE_DATA_TYPE,
            &[data_type],
        )?;
        t.set_i64(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &[b, h, s, d])?;
        t.set_i64(
            Attr::CUDNN_ATTR_TENSOR_STRIDES,
            &[s.saturating_mul(row), d, row, 1],
        )?;
        t.set_i64(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
        t.set_i64(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT as i64])?;
        t.finalize()?;
        Ok(t)
    };
    let [qs, ks, vs, os] = shape.strides;
    let q = tensor(UID_Q, qs)?;
    let k = tensor(UID_K, ks)?;
    let v = tensor(UID_V, vs)?;
    let o = tensor(UID_O, os)?;
    let scale = Descriptor::new(lib, Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "scale tensor")?;
    scale.set(
        Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
        AttrType::CUDNN_TYPE_DATA_TYPE,
        &[cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    scale.set_i64(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &[1, 1, 1, 1])?;
    scale.set_i64(Attr::CUDNN_ATTR_TENSOR_STRIDES, &[1, 1, 1, 1])?;
    scale.set_i64(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[UID_SCALE])?;
    scale.set_i64(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT as i64])?;
    scale.set(
        Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
        AttrType::CUDNN_TYPE_BOOLEAN,
        &[true],
    )?;
    scale.finalize()?;
    let op = Descriptor::new(
        lib,
        Kind::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR,
        "attention operation",
    )?;
    op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, &[&q])?;
    op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, &[&k])?;
    op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, &[&v])?;
    op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, &[&o])?;
    op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, &[&scale])?;
    op.finalize()?;
    Ok((vec![q, k, v, o, scale], op))
}

/// Builds and finalizes the tensors and the attention operation of `shape` with `library`, and
/// nothing after them: the part of a plan that needs no device (the operation graph takes a
/// handle, which needs one). Tests run it against a real cuDNN on machines without a GPU.
pub fn finalize_operation(
    library: &'static CudnnLibrary,
    shape: &SdpaShape,
) -> Result<(), CudaError> {
    operation(&library.lib, shape).map(|_| ())
}

/// Builds the plan for `shape`: the graph, the heuristic's configurations in its order, and
/// the first whose plan finalizes and needs at most `max_workspace` bytes of workspace (any,
/// for `None`).
pub(crate) fn build_plan(
    lib: &'static Cudnn,
    handle: &Handle,
    shape: &SdpaShape,
    max_workspace: Option<u64>,
) -> Result<SdpaPlan, CudaError> {
    let (tensors, op) = operation(lib, shape)?;
    let graph = Descriptor::new(
        lib,
        Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
        "operation graph",
    )?;
    graph.set_handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
    graph.set_descriptors(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&op])?;
    graph.finalize()?;
    let mut refused = Vec::new();
    // Mode A first (what cuDNN's frontend asks), then the fallback list, whose engines are
    // slower but take more shapes.
    for mode in [
        cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        let heuristic =
            Descriptor::new(lib, Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristic")?;
        heuristic.set_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph])?;
        heuristic.set(
            Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
            AttrType::CUDNN_TYPE_HEUR_MODE,
            &[mode],
        )?;
        if let Err(err) = heuristic.finalize() {
            refused.push(err.to_string());
            continue;
        }
        let mut configs = match heuristic.heuristic_results() {
            Ok(configs) => configs,
            Err(err) => {
                refused.push(err.to_string());
                continue;
            }
        };
        for index in 0..configs.len() {
            let plan = Descriptor::new(
                lib,
                Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
                "execution plan",
            )?;
            plan.set_handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
            plan.set_descriptors(
                Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                &[&configs[index]],
            )?;
            match plan.finalize() {
                Ok(()) => {
                    let workspace = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
                    let workspace = u64::try_from(workspace).unwrap_or(0);
                    if let Some(most) = max_workspace.filter(|most| workspace > *most) {
                        refused.push(format!(
                            "a configuration needs {workspace} bytes of workspace, calls get \
                             {most}"
                        ));
                        continue;
                    }
                    // The chosen configuration lives as long as the plan made from it.
                    let config = configs.swap_remove(index);
                    return Ok(SdpaPlan {
                        plan,
                        workspace,
                        executed: false,
                        _graph: tensors
                            .into_iter()
                            .chain([op, graph, heuristic, config])
                            .collect(),
                    });
                }
                Err(err) => refused.push(err.to_string()),
            }
        }
    }
    Err(CudaError::Unsupported(if refused.is_empty() {
        "cuDNN's heuristics have no engine for this attention shape".to_owned()
    } else {
        format!(
            "no engine configuration of cuDNN's heuristics finalizes for this attention shape \
             ({})",
            refused.join("; ")
        )
    }))
}

/// Device addresses of one call's operands.
pub(crate) struct SdpaOperands {
    /// The first segment's first query row.
    pub(crate) q: u64,
    /// Its first key row.
    pub(crate) k: u64,
    /// Its first value row.
    pub(crate) v: u64,
    /// Its first output row.
    pub(crate) out: u64,
    /// The workspace (at least the plan's bytes; 0 when it needs none).
    pub(crate) workspace: u64,
}

/// Enqueues `plan` on the handle's stream over `operands` with score scale `scale`.
pub(crate) fn execute(
    lib: &'static Cudnn,
    handle: &Handle,
    plan: &SdpaPlan,
    operands: &SdpaOperands,
    scale: f32,
) -> Result<(), CudaError> {
    /// The by-value scale, aligned as the tensor declares.
    #[repr(C, align(16))]
    struct Scale(f32);
    let scale = Scale(scale);
    let pack = Descriptor::new(
        lib,
        Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR,
        "variant pack",
    )?;
    let pointer = |address: u64| crate::usize_of(address) as *mut c_void;
    pack.set_i64(
        Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
        &[UID_Q, UID_K, UID_V, UID_O, UID_SCALE],
    )?;
    pack.set(
        Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
        AttrType::CUDNN_TYPE_VOID_PTR,
        &[
            pointer(operands.q),
            pointer(operands.k),
            pointer(operands.v),
            pointer(operands.out),
            (&raw const scale).cast_mut().cast::<c_void>(),
        ],
    )?;
    pack.set(
        Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
        AttrType::CUDNN_TYPE_VOID_PTR,
        &[pointer(operands.workspace)],
    )?;
    pack.finalize()?;
    // SAFETY: a live handle, a finalized plan built with it, and a finalized pack whose device
    // pointers the caller checked against the plan's shape; the scale is read during the call.
    let status = unsafe { (lib.cudnnBackendExecute)(handle.raw, plan.plan.raw, pack.raw) };
    check(lib, "cudnnBackendExecute", status)
}
