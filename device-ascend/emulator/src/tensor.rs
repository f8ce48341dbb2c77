//! The aclnn base objects (libnnopbase.so): tensor descriptors, scalars, int arrays,
//! executors, and the strided views the kernels read and write.
//!
//! Every object starts with a magic number so that a stale or foreign handle is an error, and
//! live objects are counted ([`stats`]) so that tests can prove the caller released each
//! descriptor and executor exactly once.

use std::sync::atomic::{AtomicI64, Ordering};

use crate::dtype::Dtype;
use crate::error::{EmuError, codes};

const TENSOR_MAGIC: u64 = 0x5445_4e53_4f52_454d; // "TENSOREM"
const SCALAR_MAGIC: u64 = 0x5343_414c_4152_454d;
const ARRAY_MAGIC: u64 = 0x4152_5241_5945_4d55;
/// Magic of executors.
pub const EXECUTOR_MAGIC: u64 = 0x4558_4543_5554_4f52;

static TENSORS: AtomicI64 = AtomicI64::new(0);
static SCALARS: AtomicI64 = AtomicI64::new(0);
static ARRAYS: AtomicI64 = AtomicI64::new(0);
/// Live executors created in this copy of the emulation.
pub static EXECUTORS: AtomicI64 = AtomicI64::new(0);

/// Live objects: `(tensors, scalars, int arrays, executors)`.
pub fn stats() -> (i64, i64, i64, i64) {
    (
        TENSORS.load(Ordering::SeqCst),
        SCALARS.load(Ordering::SeqCst),
        ARRAYS.load(Ordering::SeqCst),
        EXECUTORS.load(Ordering::SeqCst),
    )
}

/// `aclTensor`: a strided view over a 1-D storage at a device address.
#[repr(C)]
pub struct Tensor {
    magic: u64,
    /// Element type.
    pub dtype: Dtype,
    /// View dimensions.
    pub dims: Vec<i64>,
    /// View strides in elements.
    pub strides: Vec<i64>,
    /// Offset of element 0 in elements.
    pub offset: i64,
    /// Storage length in elements (product of the storage dims).
    pub storage: i64,
    /// Storage start (device address).
    pub data: usize,
}

/// `aclScalar`: a host value with a dtype.
#[repr(C)]
pub struct Scalar {
    magic: u64,
    /// The value's dtype.
    pub dtype: Dtype,
    /// The value widened to f64 (what float kernels use).
    pub value: f64,
    /// The value's bits as an integer (what integer fills use).
    pub bits: i64,
}

/// `aclIntArray`.
#[repr(C)]
pub struct IntArray {
    magic: u64,
    /// The values.
    pub values: Vec<i64>,
}

/// A view the kernels use: element `idx` (row-major over `dims`) lives at
/// `data + (offset + Σ idx_i · strides_i) · size`.
#[derive(Debug, Clone)]
pub struct View {
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub dims: Vec<usize>,
    /// Strides in elements.
    pub strides: Vec<i64>,
    /// Offset in elements.
    pub offset: i64,
    /// Storage start.
    pub data: usize,
    /// Storage length in elements.
    pub storage: i64,
}

impl View {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Whether the elements lie in row-major order without gaps (dimensions of extent 1 may
    /// have any stride), as aclnn's `IsContiguous` decides before an op makes a copy.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1i64;
        for (&dim, &stride) in self.dims.iter().zip(&self.strides).rev() {
            if dim == 1 {
                continue;
            }
            if stride != expected {
                return false;
            }
            expected = expected.saturating_mul(i64::try_from(dim).unwrap_or(i64::MAX));
        }
        true
    }

    /// Byte range of the storage `(start, len)`.
    pub fn storage_bytes(&self) -> (usize, u64) {
        (
            self.data,
            u64::try_from(self.storage).unwrap_or(0) * self.dtype.size() as u64,
        )
    }

    /// Element offsets (in elements from `data`) of every element in row-major order.
    pub fn offsets(&self) -> Vec<i64> {
        let n = self.numel();
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let rank = self.dims.len();
        let mut idx = vec![0usize; rank];
        let mut at = self.offset;
        for _ in 0..n {
            out.push(at);
            for d in (0..rank).rev() {
                idx[d] += 1;
                at += self.strides[d];
                if idx[d] < self.dims[d] {
                    break;
                }
                at -= self.strides[d] * self.dims[d] as i64;
                idx[d] = 0;
            }
        }
        out
    }

    /// Reads every element as f32, row-major.
    ///
    /// # Safety
    /// The storage lies in live memory (checked by the kernel context) and no other thread
    /// writes it meanwhile (the queue orders work).
    pub unsafe fn read(&self) -> Vec<f32> {
        let base = self.data as *const u8;
        self.offsets()
            .into_iter()
            // SAFETY: offsets lie inside the storage (checked at the first phase).
            .map(|at| unsafe { self.dtype.load(base, at) })
            .collect()
    }

    /// Writes `values` (row-major), converted to the view's dtype.
    ///
    /// # Safety
    /// As for [`View::read`].
    pub unsafe fn write(&self, values: &[f32]) {
        let base = self.data as *mut u8;
        for (at, value) in self.offsets().into_iter().zip(values) {
            // SAFETY: as in `read`.
            unsafe { self.dtype.store(base, at, *value) };
        }
    }

    /// Reads every element as an integer (index tensors).
    ///
    /// # Safety
    /// As for [`View::read`].
    pub unsafe fn read_int(&self) -> Vec<i64> {
        let base = self.data as *const u8;
        self.offsets()
            .into_iter()
            // SAFETY: as in `read`.
            .map(|at| unsafe { self.dtype.load_int(base, at) })
            .collect()
    }

    /// Writes the same integer bits to every element (integer fills).
    ///
    /// # Safety
    /// As for [`View::read`].
    pub unsafe fn fill_int(&self, bits: i64) {
        let base = self.data as *mut u8;
        for at in self.offsets() {
            // SAFETY: as in `read`.
            unsafe { self.dtype.store_int(base, at, bits) };
        }
    }
}

impl Tensor {
    /// The view kernels use.
    pub fn view(&self) -> View {
        View {
            dtype: self.dtype,
            dims: self
                .dims
                .iter()
                .map(|d| usize::try_from(*d).unwrap_or(0))
                .collect(),
            strides: self.strides.clone(),
            offset: self.offset,
            data: self.data,
            storage: self.storage,
        }
    }

    /// Dimensions as `usize`.
    pub fn shape(&self) -> Vec<usize> {
        self.view().dims
    }
}

/// `aclCreateTensor`. Checks what the real library checks: a known dtype, non-negative
/// dimensions, a view inside its storage.
///
/// # Safety
/// The pointers hold `view_dims_num` (and `storage_dims_num`) elements.
#[allow(clippy::too_many_arguments)] // aclCreateTensor's own signature
pub unsafe fn create_tensor(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: i32,
    stride: *const i64,
    offset: i64,
    storage_dims: *const i64,
    storage_dims_num: u64,
    data: *mut std::ffi::c_void,
) -> *mut Tensor {
    let Some(dtype) = Dtype::from_code(data_type) else {
        return std::ptr::null_mut();
    };
    let rank = usize::try_from(view_dims_num).unwrap_or(0);
    let storage_rank = usize::try_from(storage_dims_num).unwrap_or(0);
    if (rank > 0 && (view_dims.is_null() || stride.is_null())) || rank > 8 {
        return std::ptr::null_mut();
    }
    let dims = if rank == 0 {
        Vec::new()
    } else {
        // SAFETY: caller's contract: `rank` elements, checked non-null above.
        unsafe { std::slice::from_raw_parts(view_dims, rank) }.to_vec()
    };
    let strides = if rank == 0 {
        Vec::new()
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(stride, rank) }.to_vec()
    };
    let storage = if storage_rank == 0 || storage_dims.is_null() {
        1
    } else {
        // SAFETY: caller's contract.
        unsafe { std::slice::from_raw_parts(storage_dims, storage_rank) }
            .iter()
            .product()
    };
    if dims.iter().any(|d| *d < 0) || strides.iter().any(|s| *s < 0) || offset < 0 {
        return std::ptr::null_mut();
    }
    let numel: i64 = dims.iter().product();
    if numel > 0 {
        let last = offset
            + dims
                .iter()
                .zip(&strides)
                .map(|(d, s)| (d - 1) * s)
                .sum::<i64>();
        if last >= storage {
            return std::ptr::null_mut();
        }
    }
    TENSORS.fetch_add(1, Ordering::SeqCst);
    Box::into_raw(Box::new(Tensor {
        magic: TENSOR_MAGIC,
        dtype,
        dims,
        strides,
        offset,
        storage,
        data: data as usize,
    }))
}

/// `aclDestroyTensor`.
///
/// # Safety
/// `tensor` came from [`create_tensor`] and is destroyed once.
pub unsafe fn destroy_tensor(tensor: *const Tensor) -> i32 {
    // SAFETY: checked for null and magic before the box is rebuilt.
    match unsafe { tensor_ref(tensor) } {
        Ok(_) => {
            TENSORS.fetch_sub(1, Ordering::SeqCst);
            // SAFETY: a live box from `create_tensor`; the magic is cleared before freeing so
            // that a second destroy is caught.
            unsafe {
                let boxed = Box::from_raw(tensor.cast_mut());
                let mut boxed = boxed;
                boxed.magic = 0;
                drop(boxed);
            }
            0
        }
        Err(err) => err.code,
    }
}

/// A tensor handle as a reference, checked.
///
/// # Safety
/// `tensor` is null or points at memory at least as large as a [`Tensor`].
pub unsafe fn tensor_ref<'a>(tensor: *const Tensor) -> Result<&'a Tensor, EmuError> {
    if tensor.is_null() {
        return Err(EmuError::new(codes::ACLNN_PARAM_NULLPTR, "null tensor"));
    }
    // SAFETY: non-null; the magic tells a live tensor from anything else.
    let t = unsafe { &*tensor };
    if t.magic != TENSOR_MAGIC {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            "not a live aclTensor (destroyed twice, or a foreign pointer)",
        ));
    }
    Ok(t)
}

/// An optional tensor handle (null allowed).
///
/// # Safety
/// As for [`tensor_ref`].
pub unsafe fn optional_tensor<'a>(tensor: *const Tensor) -> Result<Option<&'a Tensor>, EmuError> {
    if tensor.is_null() {
        Ok(None)
    } else {
        // SAFETY: caller's contract.
        unsafe { tensor_ref(tensor) }.map(Some)
    }
}

/// `aclCreateScalar`.
///
/// # Safety
/// `value` points at a value of `data_type`.
pub unsafe fn create_scalar(value: *mut std::ffi::c_void, data_type: i32) -> *mut Scalar {
    let Some(dtype) = Dtype::from_code(data_type) else {
        return std::ptr::null_mut();
    };
    if value.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: caller's contract: a value of `dtype` at `value`.
    let (value, bits) = unsafe { dtype.load_scalar(value.cast::<u8>()) };
    SCALARS.fetch_add(1, Ordering::SeqCst);
    Box::into_raw(Box::new(Scalar {
        magic: SCALAR_MAGIC,
        dtype,
        value,
        bits,
    }))
}

/// `aclDestroyScalar`.
///
/// # Safety
/// `scalar` came from [`create_scalar`] and is destroyed once.
pub unsafe fn destroy_scalar(scalar: *const Scalar) -> i32 {
    // SAFETY: checked before use.
    match unsafe { scalar_ref(scalar) } {
        Ok(_) => {
            SCALARS.fetch_sub(1, Ordering::SeqCst);
            // SAFETY: a live box from `create_scalar`.
            let mut boxed = unsafe { Box::from_raw(scalar.cast_mut()) };
            boxed.magic = 0;
            0
        }
        Err(err) => err.code,
    }
}

/// A scalar handle as a reference, checked.
///
/// # Safety
/// `scalar` is null or points at memory at least as large as a [`Scalar`].
pub unsafe fn scalar_ref<'a>(scalar: *const Scalar) -> Result<&'a Scalar, EmuError> {
    if scalar.is_null() {
        return Err(EmuError::new(codes::ACLNN_PARAM_NULLPTR, "null scalar"));
    }
    // SAFETY: non-null; the magic is checked.
    let s = unsafe { &*scalar };
    if s.magic != SCALAR_MAGIC {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            "not a live aclScalar",
        ));
    }
    Ok(s)
}

/// `aclCreateIntArray`.
///
/// # Safety
/// `value` holds `size` elements.
pub unsafe fn create_int_array(value: *const i64, size: u64) -> *mut IntArray {
    let len = usize::try_from(size).unwrap_or(0);
    if value.is_null() && len > 0 {
        return std::ptr::null_mut();
    }
    let values = if len == 0 {
        Vec::new()
    } else {
        // SAFETY: caller's contract.
        unsafe { std::slice::from_raw_parts(value, len) }.to_vec()
    };
    ARRAYS.fetch_add(1, Ordering::SeqCst);
    Box::into_raw(Box::new(IntArray {
        magic: ARRAY_MAGIC,
        values,
    }))
}

/// `aclDestroyIntArray`.
///
/// # Safety
/// `array` came from [`create_int_array`] and is destroyed once.
pub unsafe fn destroy_int_array(array: *const IntArray) -> i32 {
    // SAFETY: checked before use.
    match unsafe { int_array_ref(array) } {
        Ok(_) => {
            ARRAYS.fetch_sub(1, Ordering::SeqCst);
            // SAFETY: a live box from `create_int_array`.
            let mut boxed = unsafe { Box::from_raw(array.cast_mut()) };
            boxed.magic = 0;
            0
        }
        Err(err) => err.code,
    }
}

/// An int array handle as a reference, checked.
///
/// # Safety
/// `array` is null or points at memory at least as large as an [`IntArray`].
pub unsafe fn int_array_ref<'a>(array: *const IntArray) -> Result<&'a IntArray, EmuError> {
    if array.is_null() {
        return Err(EmuError::new(codes::ACLNN_PARAM_NULLPTR, "null int array"));
    }
    // SAFETY: non-null; the magic is checked.
    let a = unsafe { &*array };
    if a.magic != ARRAY_MAGIC {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            "not a live aclIntArray",
        ));
    }
    Ok(a)
}
