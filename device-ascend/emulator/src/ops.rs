//! The aclnn operators: first phases that check their arguments as the documentation states
//! and build an executor, and one launch that enqueues an executor's kernel on a stream.
//!
//! Emulated: the two-phase protocol (an executor not made repeatable is gone after its launch,
//! whether the launch succeeds or fails; an abandoned one is released with
//! `aclSetAclOpExecutorRepeatable` + `aclDestroyAclOpExecutor`; executors neither run nor
//! destroyed are counted, [`crate::EmuStats::executors`]), the workspace contract (the matmul
//! family, the fill, the fused attention and a copy that must first make its source contiguous,
//! cast or broadcast it ask for scratch, which the kernel overwrites, and a smaller workspace
//! is refused), dtype and shape rules, the SoC families' missing kernels
//! and `cubeMathType` rule, f32 accumulation with results rounded to the output dtype, and
//! checks of every operand's storage against live memory: at launch (a launch whose operand
//! lies outside a live allocation of the stream's NPU is refused with 161002) and again when
//! the kernel runs (507053, a task fault).
//! Not emulated: tiling, kernel-level precision differences (HF32, fp16 accumulation),
//! formats other than ND, and performance.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use crate::config::{self, When};
use crate::dtype::Dtype;
use crate::error::{EmuError, codes, report};
use crate::kernels::{self, broadcast, broadcast_shape};
use crate::runtime::{Device, lock, panic_text, stream_ref};
use crate::stream::Job;
use crate::tensor::{
    EXECUTOR_MAGIC, EXECUTORS, IntArray, Scalar, Tensor, View, int_array_ref, optional_tensor,
    scalar_ref, tensor_ref,
};

/// Scratch the matmul family asks for.
pub const MATMUL_WORKSPACE: u64 = 32 << 10;
/// Scratch the fill asks for: aclnn lets every op ask for a workspace, and a caller must not
/// count on a fill needing none.
pub const FILL_WORKSPACE: u64 = 512;
/// Scratch the fused attention asks for.
pub const ATTENTION_WORKSPACE: u64 = 64 << 10;
/// What the emulated kernels write over their workspace, so that a caller keeping data there
/// sees it destroyed.
const SCRIBBLE: u8 = 0x5a;

/// A kernel: runs on the stream's worker with the device whose memory it touches.
pub type Kernel = Box<dyn FnOnce(&Device) -> Result<(), EmuError> + Send>;

/// `aclOpExecutor`.
#[repr(C)]
pub struct Executor {
    magic: u64,
    /// Frees this executor with the code of the library copy that created it.
    destroy: extern "C" fn(*mut Executor),
    /// The op (`aclnnMatmul`).
    pub name: &'static str,
    /// Workspace bytes it needs.
    pub workspace: u64,
    kernel: Option<Kernel>,
    repeatable: bool,
    /// Device bytes `(address, length)` of every tensor the first phase was given, checked
    /// against live memory at launch.
    operands: Vec<(usize, u64)>,
}

std::thread_local! {
    /// The storages of the tensors a first phase on this thread has read so far.
    static OPERANDS: std::cell::RefCell<Vec<(usize, u64)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

extern "C" fn destroy_executor(ptr: *mut Executor) {
    EXECUTORS.fetch_sub(1, Ordering::SeqCst);
    // SAFETY: `ptr` is a live executor boxed by `phase1` of this copy; freed once.
    let mut boxed = unsafe { Box::from_raw(ptr) };
    boxed.magic = 0;
}

/// Runs a first phase: checks, builds, and hands out an executor.
///
/// # Safety
/// `workspace_size` and `executor` are null or writable.
pub unsafe fn phase1(
    name: &'static str,
    workspace_size: *mut u64,
    executor: *mut *mut Executor,
    build: impl FnOnce() -> Result<(u64, Kernel), EmuError>,
) -> i32 {
    let cfg = config::get();
    if cfg.stub {
        return codes::STUB_MODE;
    }
    if workspace_size.is_null() || executor.is_null() {
        return report(&EmuError::new(
            codes::ACLNN_PARAM_NULLPTR,
            format!("{name}GetWorkspaceSize: null workspaceSize or executor"),
        ));
    }
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Some((op, at, When::Call)) = &cfg.panic_op
            && op == name
            && count(&PHASE1_CALLS, name) == *at
        {
            panic!("injected panic in {name}GetWorkspaceSize");
        }
        OPERANDS.with(|seen| seen.borrow_mut().clear());
        build()
    }));
    let operands = OPERANDS.with(|seen| std::mem::take(&mut *seen.borrow_mut()));
    match built {
        Ok(Ok((workspace, kernel))) => {
            EXECUTORS.fetch_add(1, Ordering::SeqCst);
            let boxed = Box::into_raw(Box::new(Executor {
                magic: EXECUTOR_MAGIC,
                destroy: destroy_executor,
                name,
                workspace,
                kernel: Some(kernel),
                repeatable: false,
                operands,
            }));
            // SAFETY: both out-pointers are non-null (checked above).
            unsafe {
                workspace_size.write(workspace);
                executor.write(boxed);
            }
            codes::SUCCESS
        }
        Ok(Err(err)) => report(&EmuError::new(
            err.code,
            format!("{name}GetWorkspaceSize: {}", err.message),
        )),
        Err(payload) => report(&EmuError::new(
            codes::ACLNN_INNER,
            format!(
                "{name}GetWorkspaceSize panicked: {}",
                panic_text(payload.as_ref())
            ),
        )),
    }
}

/// [`phase1`] for callers whose own contract covers the out-pointers.
/// First phases (`aclnnXxxGetWorkspaceSize` calls) of this library copy so far.
pub fn first_phases() -> u64 {
    FIRST_PHASES.load(std::sync::atomic::Ordering::SeqCst)
}

static FIRST_PHASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn first_phase(
    name: &'static str,
    workspace_size: *mut u64,
    executor: *mut *mut Executor,
    build: impl FnOnce() -> Result<(u64, Kernel), EmuError>,
) -> i32 {
    FIRST_PHASES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: every exported first phase documents writable out-pointers as its contract.
    unsafe { phase1(name, workspace_size, executor, build) }
}

fn executor_ref<'a>(ptr: *mut Executor) -> Result<&'a mut Executor, EmuError> {
    if ptr.is_null() {
        return Err(EmuError::new(codes::ACLNN_PARAM_NULLPTR, "null executor"));
    }
    // SAFETY: non-null; the magic is checked before anything else is read.
    let e = unsafe { &mut *ptr };
    if e.magic != EXECUTOR_MAGIC {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            "not a live executor (run or destroyed already?)",
        ));
    }
    Ok(e)
}

/// `aclSetAclOpExecutorRepeatable`.
pub fn set_repeatable(ptr: *mut Executor) -> i32 {
    if config::get().stub {
        return codes::STUB_MODE;
    }
    match executor_ref(ptr) {
        Ok(e) => {
            e.repeatable = true;
            codes::SUCCESS
        }
        Err(err) => report(&err),
    }
}

/// `aclDestroyAclOpExecutor`: only for repeatable executors, as documented.
pub fn destroy(ptr: *mut Executor) -> i32 {
    if config::get().stub {
        return codes::STUB_MODE;
    }
    match executor_ref(ptr) {
        Ok(e) if e.repeatable => {
            (e.destroy)(ptr);
            codes::SUCCESS
        }
        Ok(_) => report(&EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            "aclDestroyAclOpExecutor: the executor is not repeatable",
        )),
        Err(err) => report(&err),
    }
}

/// Launches per op (the kernels' run numbers for fault injection).
static RUNS: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);
/// First phases per op.
static PHASE1_CALLS: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);

/// Counts one more event of `name`; returns its 1-based number.
fn count(counters: &Mutex<Option<HashMap<&'static str, u64>>>, name: &'static str) -> u64 {
    let mut map = lock(counters);
    let counter = map
        .get_or_insert_with(HashMap::new)
        .entry(name)
        .or_insert(0);
    *counter += 1;
    *counter
}

/// A launch's checks: the executor's op, the workspace, the stream, and every operand's
/// storage against live memory. The kernel to run and the stream, or why not.
fn check_launch<'a>(
    name: &'static str,
    workspace: *mut std::ffi::c_void,
    size: u64,
    e: &mut Executor,
    stream: *mut std::ffi::c_void,
) -> Result<(Kernel, &'a crate::runtime::Stream), EmuError> {
    if e.name != name {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            format!(
                "{name}: the executor was made by {}GetWorkspaceSize",
                e.name
            ),
        ));
    }
    if size < e.workspace || (e.workspace > 0 && workspace.is_null()) {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            format!(
                "{name}: workspace of {size} bytes at {workspace:p}, {} needed",
                e.workspace
            ),
        ));
    }
    let s = stream_ref(stream)?;
    // Every operand's storage must lie inside one live allocation of the stream's NPU when
    // the op is launched: a descriptor left pointing at freed memory, at a placeholder smaller
    // than its storage, or at another NPU's memory would have the kernel read and write memory
    // it does not own.
    for (index, (start, len)) in e.operands.iter().enumerate() {
        s.inner
            .device
            .check(&format!("{name}: operand {index}"), *start, *len)
            .map_err(|err| EmuError::new(codes::ACLNN_PARAM_INVALID, err.message))?;
    }
    let Some(kernel) = e.kernel.take() else {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            format!("{name}: the executor already ran"),
        ));
    };
    Ok((kernel, s))
}

/// The second phase of every op: checks the executor, workspace and operands, and enqueues
/// the kernel.
pub fn launch(
    name: &'static str,
    workspace: *mut std::ffi::c_void,
    size: u64,
    executor: *mut Executor,
    stream: *mut std::ffi::c_void,
) -> i32 {
    let cfg = config::get();
    if cfg.stub {
        return codes::STUB_MODE;
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let e = executor_ref(executor)?;
        let (repeatable, destroy) = (e.repeatable, e.destroy);
        let checked = check_launch(name, workspace, size, e, stream);
        // aclDestroyAclOpExecutor's documentation: an executor not made repeatable is
        // destroyed by its second phase; a launch that fails consumes it too.
        if !repeatable {
            destroy(executor);
        }
        let (kernel, s) = checked?;
        let run = count(&RUNS, name);
        let fail = match &cfg.fail_op {
            Some((op, at, when)) if op == name && *at == run => Some(*when),
            _ => None,
        };
        if fail == Some(When::Call) {
            return Err(EmuError::new(
                codes::ACLNN_INNER,
                format!("{name}: launch failed (injected at run #{run})"),
            ));
        }
        let panics =
            matches!(&cfg.panic_op, Some((op, at, When::Kernel)) if op == name && *at == run);
        let (ws, ws_len) = (workspace as usize, size);
        let job: Job = Box::new(move |dev: &Device| {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if fail == Some(When::Kernel) {
                    return Err(EmuError::new(
                        codes::RT_AICORE_EXCEPTION,
                        format!("{name}: AI core exception (injected at run #{run})"),
                    ));
                }
                if panics {
                    panic!("injected panic in the {name} kernel");
                }
                if ws_len > 0 {
                    dev.check(name, ws, ws_len)?;
                    // SAFETY: the workspace lies in a live block (checked).
                    unsafe {
                        std::ptr::write_bytes(
                            ws as *mut u8,
                            SCRIBBLE,
                            usize::try_from(ws_len).unwrap_or(0),
                        );
                    }
                }
                kernel(dev)
            }));
            ran.unwrap_or_else(|payload| {
                Err(EmuError::new(
                    codes::RT_AICORE_EXCEPTION,
                    format!("{name} kernel panicked: {}", panic_text(payload.as_ref())),
                ))
            })
        });
        s.inner.submit(job);
        Ok(())
    }));
    match result {
        Ok(Ok(())) => codes::SUCCESS,
        Ok(Err(err)) => report(&err),
        Err(payload) => report(&EmuError::new(
            codes::ACLNN_INNER,
            format!("{name} panicked: {}", panic_text(payload.as_ref())),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Argument helpers
// ---------------------------------------------------------------------------------------------

fn invalid(message: impl Into<String>) -> EmuError {
    EmuError::new(codes::ACLNN_PARAM_INVALID, message)
}

/// A required tensor's view.
///
/// # Safety
/// `t` is null or a tensor handle.
unsafe fn view(t: *const Tensor) -> Result<View, EmuError> {
    // SAFETY: caller's contract.
    let view = unsafe { tensor_ref(t) }.map(Tensor::view)?;
    OPERANDS.with(|seen| seen.borrow_mut().push(view.storage_bytes()));
    Ok(view)
}

/// An optional tensor's view.
///
/// # Safety
/// As for [`view`].
unsafe fn optional(t: *const Tensor) -> Result<Option<View>, EmuError> {
    // SAFETY: caller's contract.
    let view = unsafe { optional_tensor(t) }?.map(Tensor::view);
    if let Some(view) = &view {
        OPERANDS.with(|seen| seen.borrow_mut().push(view.storage_bytes()));
    }
    Ok(view)
}

/// # Safety
/// `s` is null or a scalar handle.
unsafe fn scalar<'a>(s: *const Scalar) -> Result<&'a Scalar, EmuError> {
    // SAFETY: caller's contract.
    unsafe { scalar_ref(s) }
}

/// # Safety
/// `a` is null or an int array handle.
unsafe fn ints<'a>(a: *const IntArray) -> Result<&'a IntArray, EmuError> {
    // SAFETY: caller's contract.
    unsafe { int_array_ref(a) }
}

fn float(v: &View, what: &str) -> Result<(), EmuError> {
    if matches!(v.dtype, Dtype::F32 | Dtype::F16 | Dtype::Bf16) {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what}: dtype {:?} is not FLOAT, FLOAT16 or BFLOAT16",
            v.dtype
        )))
    }
}

fn same_dtype(a: &View, b: &View, what: &str) -> Result<(), EmuError> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what}: dtypes {:?} and {:?} differ",
            a.dtype, b.dtype
        )))
    }
}

fn same_shape(a: &View, b: &View, what: &str) -> Result<(), EmuError> {
    if a.dims == b.dims {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what}: shapes {:?} and {:?} differ",
            a.dims, b.dims
        )))
    }
}

fn no_310p(op: &str) -> Result<(), EmuError> {
    if config::get().is_310p() {
        Err(invalid(format!(
            "{op} has no kernel on {} (Atlas inference series)",
            config::get().soc
        )))
    } else {
        Ok(())
    }
}

/// The fused transformer ops: Atlas A2 and A3 only, per their documentation.
fn a2_a3_only(op: &str) -> Result<(), EmuError> {
    if config::get().is_a2_a3() {
        Ok(())
    } else {
        Err(invalid(format!(
            "{op} has no kernel on {} (Atlas A2 and A3 only)",
            config::get().soc
        )))
    }
}

/// BFLOAT16 exists on Atlas A2 and A3 only.
fn bf16_ok(op: &str, dtypes: &[Dtype]) -> Result<(), EmuError> {
    if dtypes.contains(&Dtype::Bf16) && !config::get().is_a2_a3() {
        return Err(invalid(format!(
            "{op}: BFLOAT16 is not supported on {}",
            config::get().soc
        )));
    }
    Ok(())
}

/// Checks every view's storage against live memory, when the kernel runs.
fn live(dev: &Device, name: &str, views: &[&View]) -> Result<(), EmuError> {
    for v in views {
        let (start, len) = v.storage_bytes();
        dev.check(name, start, len)?;
    }
    Ok(())
}

/// A kernel over `inputs` writing `output`: reads, computes with `f`, writes.
fn map_kernel(
    name: &'static str,
    inputs: Vec<View>,
    output: View,
    f: impl FnOnce(Vec<Vec<f32>>) -> Result<Vec<f32>, EmuError> + Send + 'static,
) -> Kernel {
    Box::new(move |dev: &Device| {
        let mut all: Vec<&View> = inputs.iter().collect();
        all.push(&output);
        live(dev, name, &all)?;
        // SAFETY: storages checked live; the queue orders this work with every other use.
        let values = inputs.iter().map(|v| unsafe { v.read() }).collect();
        let result = f(values)?;
        // SAFETY: as above.
        unsafe { output.write(&result) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------------------------

fn check_cube(op: &str, dtype: Dtype, cube: i8) -> Result<bool, EmuError> {
    let down = !config::get().is_a2_a3();
    bf16_ok(op, &[dtype])?;
    if down && dtype == Dtype::F32 && cube == 0 {
        return Err(invalid(format!(
            "{op}: FLOAT32 needs cubeMathType 1 (ALLOW_FP32_DOWN_PRECISION) on {}",
            config::get().soc
        )));
    }
    if !(0..=4).contains(&cube) {
        return Err(invalid(format!("{op}: cubeMathType {cube}")));
    }
    // Outside A2 and A3, f32 inputs are computed in f16.
    Ok(down && dtype == Dtype::F32)
}

/// Batched product of `[.., m, k]` by `[.., k, n]` into `[.., m, n]` with batch broadcasting.
fn batched(
    a: &View,
    b: &View,
    out: &View,
    op: &str,
) -> Result<(Vec<usize>, usize, usize, usize), EmuError> {
    if a.dims.len() < 2 || b.dims.len() < 2 {
        return Err(invalid(format!(
            "{op}: operands need at least 2 dimensions"
        )));
    }
    let (m, k) = (a.dims[a.dims.len() - 2], a.dims[a.dims.len() - 1]);
    let (k2, n) = (b.dims[b.dims.len() - 2], b.dims[b.dims.len() - 1]);
    if k != k2 {
        return Err(invalid(format!("{op}: k {k} and {k2} differ")));
    }
    let batch = broadcast_shape(&a.dims[..a.dims.len() - 2], &b.dims[..b.dims.len() - 2])?;
    let mut want = batch.clone();
    want.extend([m, n]);
    if out.dims != want {
        return Err(invalid(format!(
            "{op}: out is {:?}, expected {want:?}",
            out.dims
        )));
    }
    Ok((batch, m, k, n))
}

fn product_kernel(
    name: &'static str,
    a: View,
    b: View,
    out: View,
    bias: Option<(View, f32, f32)>,
    half_inputs: bool,
    shape: (Vec<usize>, usize, usize, usize),
) -> Kernel {
    Box::new(move |dev: &Device| {
        let mut views = vec![&a, &b, &out];
        if let Some((v, _, _)) = &bias {
            views.push(v);
        }
        live(dev, name, &views)?;
        let (batch, m, k, n) = shape;
        let mut full_a = batch.clone();
        full_a.extend([m, k]);
        let mut full_b = batch.clone();
        full_b.extend([k, n]);
        let round = |v: Vec<f32>| -> Vec<f32> {
            if half_inputs {
                v.into_iter().map(|x| Dtype::F16.round(x)).collect()
            } else {
                v
            }
        };
        // SAFETY: storages checked live; the queue orders the work.
        let (av, bv) = unsafe {
            (
                round(broadcast(&a, &full_a)?.read()),
                round(broadcast(&b, &full_b)?.read()),
            )
        };
        let batches: usize = batch.iter().product();
        let mut result = vec![0.0f32; batches * m * n];
        for i in 0..batches {
            kernels::matmul(
                &av[i * m * k..(i + 1) * m * k],
                &bv[i * k * n..(i + 1) * k * n],
                &mut result[i * m * n..(i + 1) * m * n],
                m,
                k,
                n,
            );
        }
        if let Some((bias, beta, alpha)) = &bias {
            // SAFETY: as above.
            let bias = unsafe { broadcast(bias, &out.dims)?.read() };
            for (r, b) in result.iter_mut().zip(bias) {
                *r = beta * b + alpha * *r;
            }
        }
        // SAFETY: as above.
        unsafe { out.write(&result) };
        Ok(())
    })
}

/// `aclnnMatmulGetWorkspaceSize(self, mat2, out, cubeMathType, ...)`.
///
/// # Safety
/// Handles from this emulation (or null); out-pointers writable.
pub unsafe fn matmul(
    a: *const Tensor,
    b: *const Tensor,
    out: *mut Tensor,
    cube: i8,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnMatmul", ws, ex, || {
        // SAFETY: caller's contract.
        let (a, b, out) = unsafe { (view(a)?, view(b)?, view(out)?) };
        float(&a, "self")?;
        same_dtype(&a, &b, "mat2")?;
        same_dtype(&a, &out, "out")?;
        let half = check_cube("aclnnMatmul", a.dtype, cube)?;
        let shape = batched(&a, &b, &out, "aclnnMatmul")?;
        Ok((
            MATMUL_WORKSPACE,
            product_kernel("aclnnMatmul", a, b, out, None, half, shape),
        ))
    })
}

/// `aclnnBatchMatMulGetWorkspaceSize(self, mat2, out, cubeMathType, ...)`: 3-D only.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn batch_matmul(
    a: *const Tensor,
    b: *const Tensor,
    out: *mut Tensor,
    cube: i8,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnBatchMatMul", ws, ex, || {
        // SAFETY: caller's contract.
        let (a, b, out) = unsafe { (view(a)?, view(b)?, view(out)?) };
        if a.dims.len() != 3 || b.dims.len() != 3 {
            return Err(invalid("aclnnBatchMatMul: operands must be 3-D"));
        }
        float(&a, "self")?;
        same_dtype(&a, &b, "mat2")?;
        same_dtype(&a, &out, "out")?;
        let half = check_cube("aclnnBatchMatMul", a.dtype, cube)?;
        let shape = batched(&a, &b, &out, "aclnnBatchMatMul")?;
        Ok((
            MATMUL_WORKSPACE,
            product_kernel("aclnnBatchMatMul", a, b, out, None, half, shape),
        ))
    })
}

/// `aclnnAddmmGetWorkspaceSize(self, mat1, mat2, beta, alpha, out, cubeMathType, ...)`.
///
/// # Safety
/// As for [`matmul`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn addmm(
    bias: *const Tensor,
    a: *const Tensor,
    b: *const Tensor,
    beta: *const Scalar,
    alpha: *const Scalar,
    out: *mut Tensor,
    cube: i8,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnAddmm", ws, ex, || {
        // SAFETY: caller's contract.
        let (bias, a, b, out) = unsafe { (view(bias)?, view(a)?, view(b)?, view(out)?) };
        // SAFETY: caller's contract.
        let (beta, alpha) = unsafe { (scalar(beta)?.value, scalar(alpha)?.value) };
        if a.dims.len() != 2 || b.dims.len() != 2 {
            return Err(invalid("aclnnAddmm: mat1 and mat2 must be 2-D"));
        }
        float(&a, "mat1")?;
        same_dtype(&a, &b, "mat2")?;
        same_dtype(&a, &out, "out")?;
        same_dtype(&a, &bias, "self")?;
        let half = check_cube("aclnnAddmm", a.dtype, cube)?;
        let shape = batched(&a, &b, &out, "aclnnAddmm")?;
        broadcast(&bias, &out.dims)?;
        #[allow(clippy::cast_possible_truncation)]
        let scales = (bias, beta as f32, alpha as f32);
        Ok((
            MATMUL_WORKSPACE,
            product_kernel("aclnnAddmm", a, b, out, Some(scales), half, shape),
        ))
    })
}

// ---------------------------------------------------------------------------------------------
// Norms
// ---------------------------------------------------------------------------------------------

/// `aclnnLayerNormGetWorkspaceSize(input, normalizedShape, weight?, bias?, eps, out, mean?,
/// rstd?, ...)`.
///
/// # Safety
/// As for [`matmul`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn layer_norm(
    input: *const Tensor,
    shape: *const IntArray,
    weight: *const Tensor,
    bias: *const Tensor,
    eps: f64,
    out: *mut Tensor,
    mean: *mut Tensor,
    rstd: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnLayerNorm", ws, ex, || {
        no_310p("aclnnLayerNorm")?;
        // SAFETY: caller's contract.
        let (x, out) = unsafe { (view(input)?, view(out)?) };
        // SAFETY: caller's contract.
        let normalized = unsafe { ints(shape)? }.values.clone();
        // SAFETY: caller's contract.
        let (weight, bias, mean, rstd) = unsafe {
            (
                optional(weight)?,
                optional(bias)?,
                optional(mean)?,
                optional(rstd)?,
            )
        };
        float(&x, "input")?;
        same_dtype(&x, &out, "out")?;
        same_shape(&x, &out, "out")?;
        let tail = normalized.len();
        if tail == 0 || tail > x.dims.len() {
            return Err(invalid("aclnnLayerNorm: normalizedShape"));
        }
        let norm_dims = &x.dims[x.dims.len() - tail..];
        if normalized
            .iter()
            .zip(norm_dims)
            .any(|(n, d)| usize::try_from(*n).ok() != Some(*d))
        {
            return Err(invalid(format!(
                "aclnnLayerNorm: normalizedShape {normalized:?} is not the trailing shape of {:?}",
                x.dims
            )));
        }
        let width: usize = norm_dims.iter().product();
        for p in [&weight, &bias].into_iter().flatten() {
            if p.numel() != width {
                return Err(invalid("aclnnLayerNorm: weight or bias shape"));
            }
        }
        #[allow(clippy::cast_possible_truncation)]
        let eps = eps as f32;
        let kernel: Kernel = Box::new(move |dev: &Device| {
            let mut views = vec![&x, &out];
            views.extend(weight.iter().chain(&bias).chain(&mean).chain(&rstd));
            live(dev, "aclnnLayerNorm", &views)?;
            // SAFETY: storages checked live; the queue orders the work.
            let xs = unsafe { x.read() };
            // SAFETY: as above.
            let w = weight.as_ref().map(|w| unsafe { w.read() });
            // SAFETY: as above.
            let b = bias.as_ref().map(|b| unsafe { b.read() });
            let rows = xs.len() / width.max(1);
            let mut ys = vec![0.0f32; xs.len()];
            let (mut means, mut rstds) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            for r in 0..rows {
                let row = &xs[r * width..(r + 1) * width];
                let mu = row.iter().sum::<f32>() / width as f32;
                let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / width as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for c in 0..width {
                    let scale = w.as_ref().map_or(1.0, |w| w[c]);
                    let shift = b.as_ref().map_or(0.0, |b| b[c]);
                    ys[r * width + c] = (row[c] - mu) * inv * scale + shift;
                }
                means[r] = mu;
                rstds[r] = inv;
            }
            // SAFETY: as above.
            unsafe {
                out.write(&ys);
                if let Some(m) = &mean {
                    m.write(&means);
                }
                if let Some(s) = &rstd {
                    s.write(&rstds);
                }
            }
            Ok(())
        });
        Ok((0, kernel))
    })
}

/// `aclnnRmsNormGetWorkspaceSize(x, gamma, epsilon, yOut, rstdOut, ...)`.
///
/// # Safety
/// As for [`matmul`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn rms_norm(
    x: *const Tensor,
    gamma: *const Tensor,
    eps: f64,
    y: *const Tensor,
    rstd: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnRmsNorm", ws, ex, || {
        // SAFETY: caller's contract.
        let (x, gamma, y, rstd) = unsafe { (view(x)?, view(gamma)?, view(y)?, view(rstd)?) };
        float(&x, "x")?;
        same_dtype(&x, &gamma, "gamma")?;
        same_dtype(&x, &y, "yOut")?;
        same_shape(&x, &y, "yOut")?;
        bf16_ok("aclnnRmsNorm", &[x.dtype])?;
        if rstd.dtype != Dtype::F32 {
            return Err(invalid("aclnnRmsNorm: rstdOut must be FLOAT32"));
        }
        let tail = gamma.dims.len();
        if tail == 0 || tail > x.dims.len() || gamma.dims[..] != x.dims[x.dims.len() - tail..] {
            return Err(invalid(format!(
                "aclnnRmsNorm: gamma {:?} is not the trailing shape of x {:?}",
                gamma.dims, x.dims
            )));
        }
        let width = gamma.numel();
        let rows = x.numel() / width.max(1);
        if rstd.numel() != rows || rstd.dims.len() != x.dims.len() {
            return Err(invalid(format!(
                "aclnnRmsNorm: rstdOut {:?} must keep x's rank with the normalised dimensions 1",
                rstd.dims
            )));
        }
        #[allow(clippy::cast_possible_truncation)]
        let eps = eps as f32;
        let kernel: Kernel = Box::new(move |dev: &Device| {
            live(dev, "aclnnRmsNorm", &[&x, &gamma, &y, &rstd])?;
            // SAFETY: storages checked live; the queue orders the work.
            let (xs, g) = unsafe { (x.read(), gamma.read()) };
            let mut ys = vec![0.0f32; xs.len()];
            let mut rs = vec![0.0f32; rows];
            for r in 0..rows {
                let row = &xs[r * width..(r + 1) * width];
                let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for c in 0..width {
                    ys[r * width + c] = row[c] * inv * g[c];
                }
                rs[r] = inv;
            }
            // SAFETY: as above.
            unsafe {
                y.write(&ys);
                rstd.write(&rs);
            }
            Ok(())
        });
        Ok((0, kernel))
    })
}

// ---------------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------------

fn unary(
    name: &'static str,
    x: *const Tensor,
    out: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
    f: fn(f32) -> f32,
) -> i32 {
    first_phase(name, ws, ex, || {
        // SAFETY: the exported entry's caller passes handles from this emulation.
        let (x, out) = unsafe { (view(x)?, view(out)?) };
        float(&x, "self")?;
        same_dtype(&x, &out, "out")?;
        same_shape(&x, &out, "out")?;
        Ok((
            0,
            map_kernel(name, vec![x], out, move |v| {
                Ok(v[0].iter().map(|&x| f(x)).collect())
            }),
        ))
    })
}

/// `aclnnGeluGetWorkspaceSize(self, out, ...)`: the tanh approximation.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn gelu(
    x: *const Tensor,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    unary("aclnnGelu", x, out, ws, ex, kernels::gelu_tanh)
}

/// `aclnnGeluV2GetWorkspaceSize(x, approximate, y, ...)`: 0 exact, 1 tanh.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn gelu_v2(
    x: *const Tensor,
    approximate: i64,
    y: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    match approximate {
        0 => unary("aclnnGeluV2", x, y, ws, ex, kernels::gelu_erf),
        1 => unary("aclnnGeluV2", x, y, ws, ex, kernels::gelu_tanh),
        other => first_phase("aclnnGeluV2", ws, ex, || {
            Err(invalid(format!("approximate must be 0 or 1, got {other}")))
        }),
    }
}

/// `aclnnSiluGetWorkspaceSize(self, out, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn silu(
    x: *const Tensor,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    unary("aclnnSilu", x, out, ws, ex, |x| x * kernels::sigmoid(x))
}

/// `aclnnSigmoidGetWorkspaceSize(self, out, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn sigmoid(
    x: *const Tensor,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    unary("aclnnSigmoid", x, out, ws, ex, kernels::sigmoid)
}

/// `aclnnInplaceSigmoidGetWorkspaceSize(selfRef, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_sigmoid(x: *mut Tensor, ws: *mut u64, ex: *mut *mut Executor) -> i32 {
    unary("aclnnInplaceSigmoid", x, x, ws, ex, kernels::sigmoid)
}

/// Broadcasting binary op into `out` (which may be `a`, for the in-place forms); without `b`
/// the op is unary in `a` (a scalar folded into `f`).
fn binary(
    name: &'static str,
    a: *const Tensor,
    b: Option<*const Tensor>,
    out: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
    f: impl Fn(f32, f32) -> f32 + Send + 'static,
) -> i32 {
    first_phase(name, ws, ex, || {
        // SAFETY: the exported entry's caller passes handles from this emulation.
        let (a, out) = unsafe { (view(a)?, view(out)?) };
        float(&a, "self")?;
        same_dtype(&a, &out, "out")?;
        let b = match b {
            // SAFETY: as above.
            Some(t) => Some(unsafe { view(t)? }),
            None => None,
        };
        let shape = match &b {
            Some(b) => {
                same_dtype(&a, b, "other")?;
                broadcast_shape(&a.dims, &b.dims)?
            }
            None => a.dims.clone(),
        };
        if out.dims != shape {
            return Err(invalid(format!(
                "{name}: out is {:?}, the broadcast shape is {shape:?}",
                out.dims
            )));
        }
        let mut inputs = vec![broadcast(&a, &shape)?];
        if let Some(b) = &b {
            inputs.push(broadcast(b, &shape)?);
        }
        Ok((
            0,
            map_kernel(name, inputs, out, move |v| {
                Ok(match v.get(1) {
                    Some(other) => v[0].iter().zip(other).map(|(x, y)| f(*x, *y)).collect(),
                    None => v[0].iter().map(|x| f(*x, 0.0)).collect(),
                })
            }),
        ))
    })
}

/// `aclnnAddGetWorkspaceSize(self, other, alpha, out, ...)`: `self + alpha · other`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn add(
    a: *const Tensor,
    b: *const Tensor,
    alpha: *const Scalar,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    // SAFETY: caller's contract.
    let alpha = match unsafe { scalar(alpha) } {
        #[allow(clippy::cast_possible_truncation)]
        Ok(s) => s.value as f32,
        Err(err) => return first_phase("aclnnAdd", ws, ex, || Err(err)),
    };
    binary("aclnnAdd", a, Some(b), out, ws, ex, move |x, y| {
        x + alpha * y
    })
}

/// `aclnnInplaceAddGetWorkspaceSize(selfRef, other, alpha, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_add(
    a: *const Tensor,
    b: *const Tensor,
    alpha: *const Scalar,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    // SAFETY: caller's contract.
    let alpha = match unsafe { scalar(alpha) } {
        #[allow(clippy::cast_possible_truncation)]
        Ok(s) => s.value as f32,
        Err(err) => return first_phase("aclnnInplaceAdd", ws, ex, || Err(err)),
    };
    binary("aclnnInplaceAdd", a, Some(b), a, ws, ex, move |x, y| {
        x + alpha * y
    })
}

/// `aclnnMulGetWorkspaceSize(self, other, out, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn mul(
    a: *const Tensor,
    b: *const Tensor,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    binary("aclnnMul", a, Some(b), out, ws, ex, |x, y| x * y)
}

/// `aclnnInplaceMulGetWorkspaceSize(selfRef, other, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_mul(
    a: *mut Tensor,
    b: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    binary("aclnnInplaceMul", a, Some(b), a, ws, ex, |x, y| x * y)
}

/// `aclnnMulsGetWorkspaceSize(self, other (scalar), out, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn muls(
    a: *const Tensor,
    s: *const Scalar,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    // SAFETY: caller's contract.
    let s = match unsafe { scalar(s) } {
        #[allow(clippy::cast_possible_truncation)]
        Ok(s) => s.value as f32,
        Err(err) => return first_phase("aclnnMuls", ws, ex, || Err(err)),
    };
    binary("aclnnMuls", a, None, out, ws, ex, move |x, _| x * s)
}

/// `aclnnInplaceMulsGetWorkspaceSize(selfRef, other (scalar), ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_muls(
    a: *mut Tensor,
    s: *const Scalar,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    // SAFETY: caller's contract.
    let s = match unsafe { scalar(s) } {
        #[allow(clippy::cast_possible_truncation)]
        Ok(s) => s.value as f32,
        Err(err) => return first_phase("aclnnInplaceMuls", ws, ex, || Err(err)),
    };
    binary("aclnnInplaceMuls", a, None, a, ws, ex, move |x, _| x * s)
}

/// `aclnnCastGetWorkspaceSize(self, dtype, out, ...)`: round to nearest even.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn cast(
    src: *const Tensor,
    dtype: i32,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnCast", ws, ex, || {
        // SAFETY: handles from this emulation.
        let (src, out) = unsafe { (view(src)?, view(out)?) };
        if Dtype::from_code(dtype) != Some(out.dtype) {
            return Err(invalid(format!(
                "aclnnCast: dtype {dtype} differs from out's"
            )));
        }
        bf16_ok("aclnnCast", &[src.dtype, out.dtype])?;
        same_shape(&src, &out, "out")?;
        Ok((
            0,
            map_kernel("aclnnCast", vec![src], out, |v| {
                Ok(v.into_iter().next().unwrap_or_default())
            }),
        ))
    })
}

/// `aclnnInplaceCopyGetWorkspaceSize(selfRef, src, ...)`: `src` broadcast to `selfRef`,
/// converted to its dtype.
///
/// The workspace follows the op's published first phase: a non-contiguous `src` is first made
/// contiguous, then cast where the dtypes differ and broadcast where the shapes do, each step
/// into a tensor of the executor's workspace, before the view copy into `selfRef`. A copy
/// between strided views therefore asks for the bytes of its source.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_copy(
    dst: *mut Tensor,
    src: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnInplaceCopy", ws, ex, || {
        // SAFETY: handles from this emulation.
        let (dst, src) = unsafe { (view(dst)?, view(src)?) };
        let workspace = inplace_copy_workspace(&dst, &src);
        let src = broadcast(&src, &dst.dims)?;
        let kernel: Kernel = Box::new(move |dev: &Device| {
            live(dev, "aclnnInplaceCopy", &[&src, &dst])?;
            if src.dtype.is_float() || dst.dtype.is_float() {
                // SAFETY: storages checked live; the queue orders the work.
                unsafe { dst.write(&src.read()) };
            } else {
                // SAFETY: as above.
                let values = unsafe { src.read_int() };
                let base = dst.data as *mut u8;
                for (at, v) in dst.offsets().into_iter().zip(values) {
                    // SAFETY: as above.
                    unsafe { dst.dtype.store_int(base, at, v) };
                }
            }
            Ok(())
        });
        Ok((workspace, kernel))
    })
}

/// The intermediate tensors of [`inplace_copy`]'s first phase, in bytes (none for an empty
/// copy or a contiguous source of the destination's dtype and shape).
fn inplace_copy_workspace(dst: &View, src: &View) -> u64 {
    let bytes = |numel: usize, dtype: Dtype| (numel * dtype.size()) as u64;
    if dst.numel() == 0 || src.numel() == 0 {
        return 0;
    }
    let mut total = 0;
    if !src.is_contiguous() {
        total += bytes(src.numel(), src.dtype);
    }
    if src.dtype != dst.dtype {
        total += bytes(src.numel(), dst.dtype);
    }
    if src.dims != dst.dims {
        total += bytes(dst.numel(), dst.dtype);
    }
    total
}

/// `aclnnInplaceFillScalarGetWorkspaceSize(selfRef, value, ...)`: floats take the value,
/// integers its bits.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn inplace_fill_scalar(
    dst: *mut Tensor,
    value: *const Scalar,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnInplaceFillScalar", ws, ex, || {
        // SAFETY: caller's contract.
        let dst = unsafe { view(dst)? };
        // SAFETY: caller's contract.
        let value = unsafe { scalar(value)? };
        let (v, bits) = (value.value, value.bits);
        let kernel: Kernel = Box::new(move |dev: &Device| {
            live(dev, "aclnnInplaceFillScalar", &[&dst])?;
            if dst.dtype.is_float() {
                #[allow(clippy::cast_possible_truncation)]
                let values = vec![v as f32; dst.numel()];
                // SAFETY: storage checked live; the queue orders the work.
                unsafe { dst.write(&values) };
            } else {
                // SAFETY: as above.
                unsafe { dst.fill_int(bits) };
            }
            Ok(())
        });
        Ok((FILL_WORKSPACE, kernel))
    })
}

/// `aclnnSoftmaxGetWorkspaceSize(self, dim, out, ...)`.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn softmax(
    x: *const Tensor,
    dim: i64,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnSoftmax", ws, ex, || {
        // SAFETY: handles from this emulation.
        let (x, out) = unsafe { (view(x)?, view(out)?) };
        float(&x, "self")?;
        same_dtype(&x, &out, "out")?;
        same_shape(&x, &out, "out")?;
        let rank = i64::try_from(x.dims.len()).unwrap_or(0);
        let axis = if dim < 0 { dim + rank } else { dim };
        let Some(axis) = usize::try_from(axis).ok().filter(|a| *a < x.dims.len()) else {
            return Err(invalid(format!(
                "aclnnSoftmax: dim {dim} of a rank-{rank} tensor"
            )));
        };
        let dims = x.dims.clone();
        Ok((
            0,
            map_kernel("aclnnSoftmax", vec![x], out, move |mut v| {
                let mut values = v.pop().unwrap_or_default();
                kernels::softmax(&mut values, &dims, axis);
                Ok(values)
            }),
        ))
    })
}

/// `aclnnIndexSelectGetWorkspaceSize(self, dim, index, out, ...)`. An index outside `self`
/// is an AI core exception (507015), as an out-of-bounds read is on hardware: the output is
/// left as it was and the stream stays in error (see [`crate::stream`]).
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn index_select(
    src: *const Tensor,
    dim: i64,
    index: *const Tensor,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnIndexSelect", ws, ex, || {
        // SAFETY: handles from this emulation.
        let (src, index, out) = unsafe { (view(src)?, view(index)?, view(out)?) };
        if !matches!(index.dtype, Dtype::I32 | Dtype::I64) || index.dims.len() > 1 {
            return Err(invalid(
                "aclnnIndexSelect: index must be a 1-D INT32 or INT64 tensor",
            ));
        }
        same_dtype(&src, &out, "out")?;
        let rank = i64::try_from(src.dims.len()).unwrap_or(0);
        let axis = if dim < 0 { dim + rank } else { dim };
        let Some(axis) = usize::try_from(axis).ok().filter(|a| *a < src.dims.len()) else {
            return Err(invalid(format!("aclnnIndexSelect: dim {dim}")));
        };
        let mut want = src.dims.clone();
        want[axis] = index.numel();
        if out.dims != want {
            return Err(invalid(format!(
                "aclnnIndexSelect: out is {:?}, expected {want:?}",
                out.dims
            )));
        }
        let kernel: Kernel = Box::new(move |dev: &Device| {
            live(dev, "aclnnIndexSelect", &[&src, &index, &out])?;
            // SAFETY: storages checked live; the queue orders the work.
            let (values, picks) = unsafe { (src.read(), index.read_int()) };
            let outer: usize = src.dims[..axis].iter().product();
            let inner: usize = src.dims[axis + 1..].iter().product();
            let len = src.dims[axis];
            let mut result = vec![0.0f32; outer * picks.len() * inner];
            let mut bad = None;
            for o in 0..outer {
                for (j, &p) in picks.iter().enumerate() {
                    let Some(p) = usize::try_from(p).ok().filter(|p| *p < len) else {
                        bad.get_or_insert(p);
                        continue;
                    };
                    let from = (o * len + p) * inner;
                    let to = (o * picks.len() + j) * inner;
                    result[to..to + inner].copy_from_slice(&values[from..from + inner]);
                }
            }
            if let Some(p) = bad {
                return Err(EmuError::new(
                    codes::RT_AICORE_EXCEPTION,
                    format!("aclnnIndexSelect: index {p} outside [0, {len})"),
                ));
            }
            // SAFETY: as above.
            unsafe { out.write(&result) };
            Ok(())
        });
        Ok((0, kernel))
    })
}

// ---------------------------------------------------------------------------------------------
// Transformer ops
// ---------------------------------------------------------------------------------------------

/// `aclnnFlashAttentionVarLenScoreGetWorkspaceSize(...)` with the TND layout, no mask, no
/// dropout: `softmax(q·kᵀ · scale) · v` per sequence and head. `actualSeqQLen` and
/// `actualSeqKvLen` are the cumulative lengths without a leading 0. The softmax statistics
/// outputs get each row's maximum and sum, repeated 8 times.
///
/// # Safety
/// As for [`matmul`]; `layout` is a NUL-terminated string.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_attention_var_len(
    q: *const Tensor,
    k: *const Tensor,
    v: *const Tensor,
    real_shift: *const Tensor,
    drop_mask: *const Tensor,
    padding_mask: *const Tensor,
    atten_mask: *const Tensor,
    prefix: *const IntArray,
    seq_q: *const IntArray,
    seq_kv: *const IntArray,
    scale: f64,
    keep_prob: f64,
    _pre_tokens: i64,
    _next_tokens: i64,
    head_num: i64,
    layout: *const std::ffi::c_char,
    _inner_precise: i64,
    sparse_mode: i64,
    softmax_max: *const Tensor,
    softmax_sum: *const Tensor,
    softmax_out: *const Tensor,
    out: *const Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnFlashAttentionVarLenScore", ws, ex, || {
        a2_a3_only("aclnnFlashAttentionVarLenScore")?;
        if [real_shift, drop_mask, padding_mask, atten_mask, softmax_out]
            .iter()
            .any(|t| !t.is_null())
            || !prefix.is_null()
        {
            return Err(invalid(
                "masks, shifts, prefixes and the softmax output are not emulated; pass null",
            ));
        }
        if layout.is_null() {
            return Err(EmuError::new(
                codes::ACLNN_PARAM_NULLPTR,
                "null inputLayout",
            ));
        }
        // SAFETY: caller's contract: a NUL-terminated string.
        let layout = unsafe { std::ffi::CStr::from_ptr(layout) }.to_string_lossy();
        if layout != "TND" {
            return Err(invalid(format!(
                "inputLayout {layout:?}: only TND is emulated"
            )));
        }
        if (keep_prob - 1.0).abs() > f64::EPSILON || sparse_mode != 0 {
            return Err(invalid("keepProb must be 1 and sparseMode 0"));
        }
        // SAFETY: caller's contract.
        let (q, k, v, out) = unsafe { (view(q)?, view(k)?, view(v)?, view(out)?) };
        // SAFETY: caller's contract.
        let (smax, ssum) = unsafe { (view(softmax_max)?, view(softmax_sum)?) };
        // SAFETY: caller's contract.
        let (ends_q, ends_kv) =
            unsafe { (ints(seq_q)?.values.clone(), ints(seq_kv)?.values.clone()) };
        float(&q, "query")?;
        for (t, name) in [(&k, "key"), (&v, "value"), (&out, "attentionOut")] {
            same_dtype(&q, t, name)?;
            same_shape(&q, t, name)?;
        }
        if q.dims.len() != 3 {
            return Err(invalid("query must be [T, N, D] for TND"));
        }
        let (t, n, d) = (q.dims[0], q.dims[1], q.dims[2]);
        if usize::try_from(head_num).ok() != Some(n) || d == 0 || d > 768 {
            return Err(invalid(format!(
                "headNum {head_num} with query {:?}",
                q.dims
            )));
        }
        for s in [&smax, &ssum] {
            if s.dtype != Dtype::F32 || s.numel() != t * n * 8 {
                return Err(invalid(
                    "softmaxMax and softmaxSum must be FLOAT32 [T, N, 8]",
                ));
            }
        }
        if ends_q != ends_kv || ends_q.is_empty() {
            return Err(invalid(
                "actualSeqQLen and actualSeqKvLen must be equal and non-empty",
            ));
        }
        let mut starts = Vec::with_capacity(ends_q.len());
        let mut prev = 0i64;
        for &end in &ends_q {
            if end < prev {
                return Err(invalid(format!("actualSeqQLen decreases: {ends_q:?}")));
            }
            starts.push((
                usize::try_from(prev).unwrap_or(0),
                usize::try_from(end - prev).unwrap_or(0),
            ));
            prev = end;
        }
        if usize::try_from(prev).ok() != Some(t) {
            return Err(invalid(format!(
                "actualSeqQLen ends at {prev} but T is {t} (cumulative lengths, without a leading 0)"
            )));
        }
        #[allow(clippy::cast_possible_truncation)]
        let scale = scale as f32;
        let kernel: Kernel = Box::new(move |dev: &Device| {
            live(
                dev,
                "aclnnFlashAttentionVarLenScore",
                &[&q, &k, &v, &out, &smax, &ssum],
            )?;
            // SAFETY: storages checked live; the queue orders the work.
            let (qs, ks, vs) = unsafe { (q.read(), k.read(), v.read()) };
            let mut os = vec![0.0f32; t * n * d];
            let mut maxes = vec![0.0f32; t * n * 8];
            let mut sums = vec![0.0f32; t * n * 8];
            let at = |tok: usize, h: usize, c: usize| (tok * n + h) * d + c;
            for &(start, len) in &starts {
                for h in 0..n {
                    for i in start..start + len {
                        let scores: Vec<f32> = (start..start + len)
                            .map(|j| {
                                (0..d)
                                    .map(|c| qs[at(i, h, c)] * ks[at(j, h, c)])
                                    .sum::<f32>()
                                    * scale
                            })
                            .collect();
                        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                        let sum: f32 = exps.iter().sum();
                        for c in 0..d {
                            os[at(i, h, c)] = (start..start + len)
                                .zip(&exps)
                                .map(|(j, e)| e / sum * vs[at(j, h, c)])
                                .sum();
                        }
                        for s in 0..8 {
                            maxes[(i * n + h) * 8 + s] = max;
                            sums[(i * n + h) * 8 + s] = sum;
                        }
                    }
                }
            }
            // SAFETY: as above.
            unsafe {
                out.write(&os);
                smax.write(&maxes);
                ssum.write(&sums);
            }
            Ok(())
        });
        Ok((ATTENTION_WORKSPACE, kernel))
    })
}

/// `aclnnRotaryPositionEmbeddingGetWorkspaceSize(x, cos, sin, mode, out, ...)`: 4-D `x`,
/// `cos`/`sin` of `x`'s dtype broadcast to it; mode 0 rotates halves, 1 interleaved pairs.
///
/// # Safety
/// As for [`matmul`].
pub unsafe fn rotary_position_embedding(
    x: *const Tensor,
    cos: *const Tensor,
    sin: *const Tensor,
    mode: i64,
    out: *mut Tensor,
    ws: *mut u64,
    ex: *mut *mut Executor,
) -> i32 {
    first_phase("aclnnRotaryPositionEmbedding", ws, ex, || {
        a2_a3_only("aclnnRotaryPositionEmbedding")?;
        // SAFETY: handles from this emulation.
        let (x, cos, sin, out) = unsafe { (view(x)?, view(cos)?, view(sin)?, view(out)?) };
        float(&x, "x")?;
        same_dtype(&x, &cos, "cos")?;
        same_dtype(&x, &sin, "sin")?;
        same_dtype(&x, &out, "out")?;
        same_shape(&x, &out, "out")?;
        same_shape(&cos, &sin, "sin")?;
        if x.dims.len() != 4 {
            return Err(invalid("x must be 4-D"));
        }
        let d = x.dims[3];
        if d == 0 || d % 2 != 0 || d >= 896 || cos.dims.len() != 4 || cos.dims[3] != d {
            return Err(invalid(format!("head dim {d} with cos {:?}", cos.dims)));
        }
        if !(0..=1).contains(&mode) {
            return Err(invalid(format!(
                "mode {mode}: half (0) and interleave (1) are emulated"
            )));
        }
        let cos_b = broadcast(&cos, &x.dims)?;
        let sin_b = broadcast(&sin, &x.dims)?;
        Ok((
            0,
            map_kernel(
                "aclnnRotaryPositionEmbedding",
                vec![x, cos_b, sin_b],
                out,
                move |v| {
                    let (xs, c, s) = (&v[0], &v[1], &v[2]);
                    let mut ys = vec![0.0f32; xs.len()];
                    let half = d / 2;
                    for row in 0..xs.len() / d {
                        let base = row * d;
                        for i in 0..d {
                            let rotated = if mode == 0 {
                                if i < half {
                                    -xs[base + i + half]
                                } else {
                                    xs[base + i - half]
                                }
                            } else if i % 2 == 0 {
                                -xs[base + i + 1]
                            } else {
                                xs[base + i - 1]
                            };
                            ys[base + i] = xs[base + i] * c[base + i] + rotated * s[base + i];
                        }
                    }
                    Ok(ys)
                },
            ),
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::{CStr, c_void};
    use std::ptr::null_mut;

    use super::*;
    use crate::runtime;
    use crate::tensor::{create_tensor, destroy_tensor};

    #[test]
    fn a_launch_whose_operand_was_freed_is_refused_and_consumes_its_executor() {
        let init = runtime::init();
        assert!(init == codes::SUCCESS || init == codes::REPEAT_INITIALIZE);
        assert_eq!(runtime::set_device(0), codes::SUCCESS);
        let mut stream: *mut c_void = null_mut();
        assert_eq!(runtime::create_stream(&mut stream), codes::SUCCESS);
        let (mut src, mut dst): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
        assert_eq!(runtime::malloc(&mut src, 64, 0), codes::SUCCESS);
        assert_eq!(runtime::malloc(&mut dst, 64, 0), codes::SUCCESS);
        let (dims, strides) = ([16i64], [1i64]);
        // SAFETY: one dimension, stride and storage dimension each; ACL_FLOAT (0); 64 bytes.
        let tensor = |data| unsafe {
            create_tensor(
                dims.as_ptr(),
                1,
                0,
                strides.as_ptr(),
                0,
                dims.as_ptr(),
                1,
                data,
            )
        };
        let (src_t, dst_t) = (tensor(src), tensor(dst));
        assert!(!src_t.is_null() && !dst_t.is_null());
        let live = EXECUTORS.load(Ordering::SeqCst);
        let (mut ws, mut executor) = (0u64, null_mut());
        // SAFETY: live tensors of this emulation and valid out-pointers.
        let code = unsafe { inplace_copy(dst_t, src_t, &mut ws, &mut executor) };
        assert_eq!(code, codes::SUCCESS);
        // The source is freed between the two phases: the launch must not read it.
        assert_eq!(runtime::free(src), codes::SUCCESS);
        let code = launch("aclnnInplaceCopy", null_mut(), ws, executor, stream);
        assert_eq!(code, codes::ACLNN_PARAM_INVALID);
        // SAFETY: the message the failed call just set on this thread.
        let message = unsafe { CStr::from_ptr(crate::error::recent()) }.to_string_lossy();
        assert!(message.contains("operand 1"), "{message}");
        // The failed launch consumed the executor, as a launch does.
        assert_eq!(EXECUTORS.load(Ordering::SeqCst), live);
        // SAFETY: tensors of this emulation, destroyed once.
        unsafe {
            destroy_tensor(src_t);
            destroy_tensor(dst_t);
        }
        assert_eq!(runtime::free(dst), codes::SUCCESS);
        assert_eq!(runtime::synchronize_stream(stream), codes::SUCCESS);
        assert_eq!(runtime::destroy_stream(stream), codes::SUCCESS);
        assert_eq!(runtime::reset_device(0), codes::SUCCESS);
    }
}
