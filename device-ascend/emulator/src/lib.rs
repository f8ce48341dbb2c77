//! iris-cann-emulator: an emulated CANN runtime, so that iris's Ascend device can be built,
//! tested and run end to end on machines without an NPU.
//!
//! It implements, on the host, the AscendCL and aclnn entry points the plugin uses:
//! [`runtime`] (initialisation, devices, contexts, streams, events, memory, copies),
//! [`tensor`] (libnnopbase's descriptors) and [`ops`] (the operators, computed in f32 by
//! [`kernels`]). Streams are in-order queues run by worker threads ([`stream`]); device memory
//! is a separate mapping per NPU ([`memory`]). [`config`] lists the environment variables that
//! size the emulated machine and inject faults.
//!
//! This crate is a library; the shared objects are built by two small crates beside it, which
//! call the export macros below:
//! - `lib/` builds `libiris_cann_emulator.so`, exporting everything. Tests expose it (through
//!   symlinks, so that all names share one state) as `libacl_rt.so`, `libnnopbase.so` and the
//!   op libraries, in a folder named by `ASCEND_HOME_PATH`.
//! - `old-opapi/` builds `libiris_cann_emulator_old_opapi.so`, an op library of an older CANN
//!   without the transformer ops (`aclnnFlashAttentionVarLenScore`,
//!   `aclnnRotaryPositionEmbedding`): missing op symbols, for real. It is a separate copy of
//!   this crate; its ops reach the runtime's state only through the handles they are given
//!   (tensors, executors, streams), which is why those are plain `#[repr(C)]` objects and the
//!   queue uses nothing but a mutex and a condition variable.
//!
//! Every exported function catches panics and returns an error code, as a C library must.

pub mod config;
pub mod dtype;
pub mod error;
pub mod kernels;
pub mod memory;
pub mod ops;
pub mod runtime;
pub mod stream;
pub mod tensor;

/// Live objects and memory of the emulation, for tests (`iris_emu_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmuStats {
    /// `aclTensor`s not destroyed.
    pub tensors: i64,
    /// `aclScalar`s not destroyed.
    pub scalars: i64,
    /// `aclIntArray`s not destroyed.
    pub int_arrays: i64,
    /// Executors neither run nor destroyed (of this library copy).
    pub executors: i64,
    /// Live `aclrtMalloc` and `aclrtMallocAlign32` blocks on the NPU asked for.
    pub device_blocks: u64,
    /// Bytes they are charged.
    pub device_bytes: u64,
    /// Bytes the runtime's contexts and streams hold on that NPU.
    pub reserved_bytes: u64,
    /// Live `aclrtMallocHost` bytes.
    pub pinned_bytes: u64,
    /// First phases (`aclnnXxxGetWorkspaceSize`) of this library copy so far.
    pub first_phases: u64,
    /// Events created so far.
    pub events_created: u64,
    /// Device allocations (`aclrtMalloc`, `aclrtMallocAlign32`) asked for so far, on any NPU.
    pub mallocs: u64,
}

/// The emulation's counters, for physical NPU `device`.
pub fn stats(device: usize) -> EmuStats {
    let (tensors, scalars, int_arrays, executors) = tensor::stats();
    let (blocks, bytes, reserved) = runtime::device_usage(device).unwrap_or((0, 0, 0));
    EmuStats {
        tensors,
        scalars,
        int_arrays,
        executors,
        device_blocks: blocks as u64,
        device_bytes: bytes,
        reserved_bytes: reserved,
        pinned_bytes: runtime::pinned_bytes(),
        first_phases: ops::first_phases(),
        events_created: runtime::events_created(),
        mallocs: runtime::mallocs(),
    }
}

/// Exports the AscendCL runtime functions (`libacl_rt.so`) and `iris_emu_stats`.
#[macro_export]
macro_rules! export_runtime {
    () => {
        use ::std::ffi::{c_char, c_void};

        /// `aclInit`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclInit(_config_path: *const c_char) -> i32 {
            $crate::runtime::init()
        }
        /// `aclFinalize`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclFinalize() -> i32 {
            $crate::runtime::finalize()
        }
        /// `aclGetRecentErrMsg`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
            $crate::error::recent()
        }
        /// `aclrtGetVersion`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtGetVersion(
            major: *mut i32,
            minor: *mut i32,
            patch: *mut i32,
        ) -> i32 {
            $crate::runtime::get_version(major, minor, patch)
        }
        /// `aclsysGetCANNVersion`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclsysGetCANNVersion(name: u32, version: *mut c_char) -> i32 {
            $crate::runtime::cann_version(name, version)
        }
        /// `aclrtGetSocName`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtGetSocName() -> *const c_char {
            $crate::runtime::soc_name()
        }
        /// `aclrtGetDeviceCount`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> i32 {
            $crate::runtime::get_device_count(count)
        }
        /// `aclrtSetDevice`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtSetDevice(device_id: i32) -> i32 {
            $crate::runtime::set_device(device_id)
        }
        /// `aclrtResetDevice`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtResetDevice(device_id: i32) -> i32 {
            $crate::runtime::reset_device(device_id)
        }
        /// `aclrtCreateContext`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtCreateContext(context: *mut *mut c_void, device_id: i32) -> i32 {
            $crate::runtime::create_context(context, device_id)
        }
        /// `aclrtDestroyContext`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtDestroyContext(context: *mut c_void) -> i32 {
            $crate::runtime::destroy_context(context)
        }
        /// `aclrtSetCurrentContext`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtSetCurrentContext(context: *mut c_void) -> i32 {
            $crate::runtime::set_current_context(context)
        }
        /// `aclrtCreateStream`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtCreateStream(stream: *mut *mut c_void) -> i32 {
            $crate::runtime::create_stream(stream)
        }
        /// `aclrtDestroyStream`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtDestroyStream(stream: *mut c_void) -> i32 {
            $crate::runtime::destroy_stream(stream)
        }
        /// `aclrtSynchronizeStream`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtSynchronizeStream(stream: *mut c_void) -> i32 {
            $crate::runtime::synchronize_stream(stream)
        }
        /// `aclrtMalloc`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: u32) -> i32 {
            $crate::runtime::malloc(dev_ptr, size, policy)
        }
        /// `aclrtMallocAlign32`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMallocAlign32(
            dev_ptr: *mut *mut c_void,
            size: usize,
            policy: u32,
        ) -> i32 {
            $crate::runtime::malloc_align32(dev_ptr, size, policy)
        }
        /// `aclrtFree`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> i32 {
            $crate::runtime::free(dev_ptr)
        }
        /// `aclrtMallocHost`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> i32 {
            $crate::runtime::malloc_host(host_ptr, size)
        }
        /// `aclrtFreeHost`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> i32 {
            $crate::runtime::free_host(host_ptr)
        }
        /// `aclrtGetMemInfo`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtGetMemInfo(attr: u32, free: *mut usize, total: *mut usize) -> i32 {
            $crate::runtime::get_mem_info(attr, free, total)
        }
        /// `aclrtMemcpy`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMemcpy(
            dst: *mut c_void,
            dest_max: usize,
            src: *const c_void,
            count: usize,
            kind: u32,
        ) -> i32 {
            $crate::runtime::memcpy(dst, dest_max, src, count, kind)
        }
        /// `aclrtMemcpyAsync`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMemcpyAsync(
            dst: *mut c_void,
            dest_max: usize,
            src: *const c_void,
            count: usize,
            kind: u32,
            stream: *mut c_void,
        ) -> i32 {
            $crate::runtime::memcpy_async(dst, dest_max, src, count, kind, stream)
        }
        /// `aclrtMemsetAsync`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtMemsetAsync(
            dst: *mut c_void,
            max: usize,
            value: i32,
            count: usize,
            stream: *mut c_void,
        ) -> i32 {
            $crate::runtime::memset_async(dst, max, value, count, stream)
        }
        /// `aclrtCreateEvent`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtCreateEvent(event: *mut *mut c_void) -> i32 {
            $crate::runtime::create_event(event)
        }
        /// `aclrtDestroyEvent`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtDestroyEvent(event: *mut c_void) -> i32 {
            $crate::runtime::destroy_event(event)
        }
        /// `aclrtRecordEvent`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtRecordEvent(event: *mut c_void, stream: *mut c_void) -> i32 {
            $crate::runtime::record_event(event, stream)
        }
        /// `aclrtSynchronizeEvent`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtSynchronizeEvent(event: *mut c_void) -> i32 {
            $crate::runtime::synchronize_event(event)
        }
        /// `aclrtQueryEventStatus`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclrtQueryEventStatus(event: *mut c_void, status: *mut u32) -> i32 {
            $crate::runtime::query_event_status(event, status)
        }
        /// The emulation's counters for physical NPU `device` (tests read them).
        #[unsafe(no_mangle)]
        pub extern "C" fn iris_emu_stats(device: u32) -> $crate::EmuStats {
            $crate::stats(device as usize)
        }
    };
}

/// Exports libnnopbase's functions: descriptors, scalars, int arrays, executors.
#[macro_export]
macro_rules! export_nnopbase {
    () => {
        /// `aclCreateTensor`.
        ///
        /// # Safety
        /// The arrays hold the counts given.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclCreateTensor(
            view_dims: *const i64,
            view_dims_num: u64,
            data_type: i32,
            stride: *const i64,
            offset: i64,
            _format: i32,
            storage_dims: *const i64,
            storage_dims_num: u64,
            data: *mut ::std::ffi::c_void,
        ) -> *mut $crate::tensor::Tensor {
            if $crate::config::get().stub {
                return ::std::ptr::null_mut();
            }
            // SAFETY: forwarded to the caller.
            unsafe {
                $crate::tensor::create_tensor(
                    view_dims,
                    view_dims_num,
                    data_type,
                    stride,
                    offset,
                    storage_dims,
                    storage_dims_num,
                    data,
                )
            }
        }
        /// `aclDestroyTensor`.
        ///
        /// # Safety
        /// A tensor from `aclCreateTensor`, destroyed once.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclDestroyTensor(tensor: *const $crate::tensor::Tensor) -> i32 {
            // SAFETY: forwarded to the caller.
            unsafe { $crate::tensor::destroy_tensor(tensor) }
        }
        /// `aclCreateScalar`.
        ///
        /// # Safety
        /// `value` points at a value of `data_type`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclCreateScalar(
            value: *mut ::std::ffi::c_void,
            data_type: i32,
        ) -> *mut $crate::tensor::Scalar {
            if $crate::config::get().stub {
                return ::std::ptr::null_mut();
            }
            // SAFETY: forwarded to the caller.
            unsafe { $crate::tensor::create_scalar(value, data_type) }
        }
        /// `aclDestroyScalar`.
        ///
        /// # Safety
        /// A scalar from `aclCreateScalar`, destroyed once.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclDestroyScalar(scalar: *const $crate::tensor::Scalar) -> i32 {
            // SAFETY: forwarded to the caller.
            unsafe { $crate::tensor::destroy_scalar(scalar) }
        }
        /// `aclCreateIntArray`.
        ///
        /// # Safety
        /// `value` holds `size` elements.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclCreateIntArray(
            value: *const i64,
            size: u64,
        ) -> *mut $crate::tensor::IntArray {
            if $crate::config::get().stub {
                return ::std::ptr::null_mut();
            }
            // SAFETY: forwarded to the caller.
            unsafe { $crate::tensor::create_int_array(value, size) }
        }
        /// `aclDestroyIntArray`.
        ///
        /// # Safety
        /// An array from `aclCreateIntArray`, destroyed once.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn aclDestroyIntArray(array: *const $crate::tensor::IntArray) -> i32 {
            // SAFETY: forwarded to the caller.
            unsafe { $crate::tensor::destroy_int_array(array) }
        }
        /// `aclSetAclOpExecutorRepeatable`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclSetAclOpExecutorRepeatable(
            executor: *mut $crate::ops::Executor,
        ) -> i32 {
            $crate::ops::set_repeatable(executor)
        }
        /// `aclDestroyAclOpExecutor`.
        #[unsafe(no_mangle)]
        pub extern "C" fn aclDestroyAclOpExecutor(executor: *mut $crate::ops::Executor) -> i32 {
            $crate::ops::destroy(executor)
        }
    };
}

/// Exports aclnn ops by name: `export_ops!(Matmul, Softmax)` defines
/// `aclnnMatmulGetWorkspaceSize`, `aclnnMatmul`, and so on.
#[macro_export]
macro_rules! export_ops {
    ($($op:ident),* $(,)?) => {
        $( $crate::export_ops!(@op $op); )*
    };
    (@op Matmul) => { $crate::export_ops!(@pair aclnnMatmulGetWorkspaceSize, aclnnMatmul, $crate::ops::matmul,
        (a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor, cube: i8)); };
    (@op BatchMatMul) => { $crate::export_ops!(@pair aclnnBatchMatMulGetWorkspaceSize, aclnnBatchMatMul, $crate::ops::batch_matmul,
        (a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor, cube: i8)); };
    (@op Addmm) => { $crate::export_ops!(@pair aclnnAddmmGetWorkspaceSize, aclnnAddmm, $crate::ops::addmm,
        (bias: *const $crate::tensor::Tensor, a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor,
         beta: *const $crate::tensor::Scalar, alpha: *const $crate::tensor::Scalar, out: *mut $crate::tensor::Tensor, cube: i8)); };
    (@op LayerNorm) => { $crate::export_ops!(@pair aclnnLayerNormGetWorkspaceSize, aclnnLayerNorm, $crate::ops::layer_norm,
        (input: *const $crate::tensor::Tensor, shape: *const $crate::tensor::IntArray, weight: *const $crate::tensor::Tensor,
         bias: *const $crate::tensor::Tensor, eps: f64, out: *mut $crate::tensor::Tensor, mean: *mut $crate::tensor::Tensor,
         rstd: *mut $crate::tensor::Tensor)); };
    (@op RmsNorm) => { $crate::export_ops!(@pair aclnnRmsNormGetWorkspaceSize, aclnnRmsNorm, $crate::ops::rms_norm,
        (x: *const $crate::tensor::Tensor, gamma: *const $crate::tensor::Tensor, eps: f64, y: *const $crate::tensor::Tensor,
         rstd: *const $crate::tensor::Tensor)); };
    (@op Gelu) => { $crate::export_ops!(@pair aclnnGeluGetWorkspaceSize, aclnnGelu, $crate::ops::gelu,
        (x: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor)); };
    (@op GeluV2) => { $crate::export_ops!(@pair aclnnGeluV2GetWorkspaceSize, aclnnGeluV2, $crate::ops::gelu_v2,
        (x: *const $crate::tensor::Tensor, approximate: i64, y: *mut $crate::tensor::Tensor)); };
    (@op Silu) => { $crate::export_ops!(@pair aclnnSiluGetWorkspaceSize, aclnnSilu, $crate::ops::silu,
        (x: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor)); };
    (@op Sigmoid) => { $crate::export_ops!(@pair aclnnSigmoidGetWorkspaceSize, aclnnSigmoid, $crate::ops::sigmoid,
        (x: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor)); };
    (@op InplaceSigmoid) => { $crate::export_ops!(@pair aclnnInplaceSigmoidGetWorkspaceSize, aclnnInplaceSigmoid,
        $crate::ops::inplace_sigmoid, (x: *mut $crate::tensor::Tensor)); };
    (@op Softmax) => { $crate::export_ops!(@pair aclnnSoftmaxGetWorkspaceSize, aclnnSoftmax, $crate::ops::softmax,
        (x: *const $crate::tensor::Tensor, dim: i64, out: *mut $crate::tensor::Tensor)); };
    (@op IndexSelect) => { $crate::export_ops!(@pair aclnnIndexSelectGetWorkspaceSize, aclnnIndexSelect, $crate::ops::index_select,
        (src: *const $crate::tensor::Tensor, dim: i64, index: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor)); };
    (@op Add) => { $crate::export_ops!(@pair aclnnAddGetWorkspaceSize, aclnnAdd, $crate::ops::add,
        (a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor, alpha: *const $crate::tensor::Scalar,
         out: *mut $crate::tensor::Tensor)); };
    (@op InplaceAdd) => { $crate::export_ops!(@pair aclnnInplaceAddGetWorkspaceSize, aclnnInplaceAdd, $crate::ops::inplace_add,
        (a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor, alpha: *const $crate::tensor::Scalar)); };
    (@op Mul) => { $crate::export_ops!(@pair aclnnMulGetWorkspaceSize, aclnnMul, $crate::ops::mul,
        (a: *const $crate::tensor::Tensor, b: *const $crate::tensor::Tensor, out: *mut $crate::tensor::Tensor)); };
    (@op InplaceMul) => { $crate::export_ops!(@pair aclnnInplaceMulGetWorkspaceSize, aclnnInplaceMul, $crate::ops::inplace_mul,
        (a: *mut $crate::tensor::Tensor, b: *const $crate::tensor::Tensor)); };
    (@op Muls) => { $crate::export_ops!(@pair aclnnMulsGetWorkspaceSize, aclnnMuls, $crate::ops::muls,
        (a: *const $crate::tensor::Tensor, s: *const $crate::tensor::Scalar, out: *mut $crate::tensor::Tensor)); };
    (@op InplaceMuls) => { $crate::export_ops!(@pair aclnnInplaceMulsGetWorkspaceSize, aclnnInplaceMuls, $crate::ops::inplace_muls,
        (a: *mut $crate::tensor::Tensor, s: *const $crate::tensor::Scalar)); };
    (@op Cast) => { $crate::export_ops!(@pair aclnnCastGetWorkspaceSize, aclnnCast, $crate::ops::cast,
        (src: *const $crate::tensor::Tensor, dtype: i32, out: *mut $crate::tensor::Tensor)); };
    (@op InplaceCopy) => { $crate::export_ops!(@pair aclnnInplaceCopyGetWorkspaceSize, aclnnInplaceCopy, $crate::ops::inplace_copy,
        (dst: *mut $crate::tensor::Tensor, src: *const $crate::tensor::Tensor)); };
    (@op InplaceFillScalar) => { $crate::export_ops!(@pair aclnnInplaceFillScalarGetWorkspaceSize, aclnnInplaceFillScalar,
        $crate::ops::inplace_fill_scalar, (dst: *mut $crate::tensor::Tensor, value: *const $crate::tensor::Scalar)); };
    (@op RotaryPositionEmbedding) => { $crate::export_ops!(@pair aclnnRotaryPositionEmbeddingGetWorkspaceSize,
        aclnnRotaryPositionEmbedding, $crate::ops::rotary_position_embedding,
        (x: *const $crate::tensor::Tensor, cos: *const $crate::tensor::Tensor, sin: *const $crate::tensor::Tensor, mode: i64,
         out: *mut $crate::tensor::Tensor)); };
    (@op FlashAttentionVarLenScore) => { $crate::export_ops!(@pair aclnnFlashAttentionVarLenScoreGetWorkspaceSize,
        aclnnFlashAttentionVarLenScore, $crate::ops::flash_attention_var_len,
        (q: *const $crate::tensor::Tensor, k: *const $crate::tensor::Tensor, v: *const $crate::tensor::Tensor,
         real_shift: *const $crate::tensor::Tensor, drop_mask: *const $crate::tensor::Tensor,
         padding_mask: *const $crate::tensor::Tensor, atten_mask: *const $crate::tensor::Tensor,
         prefix: *const $crate::tensor::IntArray, seq_q: *const $crate::tensor::IntArray,
         seq_kv: *const $crate::tensor::IntArray, scale: f64, keep_prob: f64, pre_tokens: i64, next_tokens: i64,
         head_num: i64, layout: *const ::std::ffi::c_char, inner_precise: i64, sparse_mode: i64,
         softmax_max: *const $crate::tensor::Tensor, softmax_sum: *const $crate::tensor::Tensor,
         softmax_out: *const $crate::tensor::Tensor, out: *const $crate::tensor::Tensor)); };
    (@pair $ws:ident, $run:ident, $f:path, ($($arg:ident : $ty:ty),* $(,)?)) => {
        /// The first phase of the op: checks, workspace size, executor.
        ///
        /// # Safety
        /// Handles from this emulation (or null); the out-pointers are writable.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments, unused_unsafe)]
        pub unsafe extern "C" fn $ws(
            $($arg: $ty,)*
            workspace_size: *mut u64,
            executor: *mut *mut $crate::ops::Executor,
        ) -> i32 {
            // SAFETY: forwarded to the caller.
            unsafe { $f($($arg,)* workspace_size, executor) }
        }
        /// The second phase of the op: enqueues the executor's kernel.
        #[unsafe(no_mangle)]
        pub extern "C" fn $run(
            workspace: *mut ::std::ffi::c_void,
            workspace_size: u64,
            executor: *mut $crate::ops::Executor,
            stream: *mut ::std::ffi::c_void,
        ) -> i32 {
            $crate::ops::launch(stringify!($run), workspace, workspace_size, executor, stream)
        }
    };
}

/// The ops of the emulated CANN outside the transformer library: what an older `libopapi.so`
/// without the fused transformer ops exports.
#[macro_export]
macro_rules! export_core_ops {
    () => {
        $crate::export_ops!(
            Matmul,
            BatchMatMul,
            Addmm,
            LayerNorm,
            RmsNorm,
            Gelu,
            GeluV2,
            Silu,
            Sigmoid,
            InplaceSigmoid,
            Softmax,
            IndexSelect,
            Add,
            InplaceAdd,
            Mul,
            InplaceMul,
            Muls,
            InplaceMuls,
            Cast,
            InplaceCopy,
            InplaceFillScalar,
        );
    };
}

/// Every op of the current emulated CANN: the core ops and the transformer ops.
#[macro_export]
macro_rules! export_all_ops {
    () => {
        $crate::export_core_ops!();
        $crate::export_ops!(RotaryPositionEmbedding, FlashAttentionVarLenScore);
    };
}
