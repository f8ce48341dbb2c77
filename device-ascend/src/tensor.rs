//! aclnn's host-side objects as RAII values: tensor descriptors, scalars, int arrays, and the
//! release of an executor that will not run.
//!
//! A descriptor ([`Desc`]) is a strided view: dimensions, strides and offset in elements (not
//! bytes), over a 1-D storage of the base address of an `aclrtMalloc` block, which keeps the
//! data pointer at the 32-byte alignment aclnn requires whatever the view's offset.

use std::ffi::c_void;

use iris_plugin::abi::DType;

use crate::error::AscendError;
use crate::runtime::Runtime;
use crate::sys;
use crate::sys::nnopbase::NnopBase;

/// The aclnn data type of an iris dtype.
pub fn acl_dtype(dtype: DType) -> Result<sys::aclDataType::Type, AscendError> {
    Ok(match dtype {
        DType::F32 => sys::aclDataType::ACL_FLOAT,
        DType::F16 => sys::aclDataType::ACL_FLOAT16,
        DType::BF16 => sys::aclDataType::ACL_BF16,
        DType::I32 => sys::aclDataType::ACL_INT32,
        DType::U8 => sys::aclDataType::ACL_UINT8,
        other => {
            return Err(AscendError::Unsupported {
                op: "tensor",
                reason: format!("dtype {other} has no aclDataType"),
            });
        }
    })
}

/// A strided view in elements: what `aclCreateTensor` takes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Desc {
    /// aclnn dtype.
    pub dtype: sys::aclDataType::Type,
    /// Dimensions, outermost first.
    pub dims: Vec<i64>,
    /// Element strides per dimension.
    pub strides: Vec<i64>,
    /// Offset of element 0 from the storage's start, in elements.
    pub offset: i64,
}

impl Desc {
    /// A contiguous (row-major) view of `dims`.
    pub fn contiguous(dtype: sys::aclDataType::Type, dims: &[i64]) -> Desc {
        let mut strides = vec![1i64; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1].max(1);
        }
        Desc {
            dtype,
            dims: dims.to_vec(),
            strides,
            offset: 0,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> i64 {
        self.dims.iter().product()
    }

    /// Elements of storage the view reaches (offset included).
    pub fn storage_len(&self) -> i64 {
        if self.numel() == 0 {
            return self.offset;
        }
        self.offset
            + 1
            + self
                .dims
                .iter()
                .zip(&self.strides)
                .map(|(d, s)| (d - 1) * s)
                .sum::<i64>()
    }
}

/// An `aclTensor`, destroyed on drop.
pub struct Tensor<'r> {
    nnop: &'r NnopBase,
    raw: *mut sys::aclTensor,
}

impl<'r> Tensor<'r> {
    /// A descriptor of `desc` over the storage starting at `base` (null when only sizing a
    /// workspace).
    pub fn new(rt: &'r Runtime, desc: &Desc, base: *mut c_void) -> Result<Tensor<'r>, AscendError> {
        let nnop = rt.nnopbase()?;
        let create = nnop
            .aclCreateTensor
            .as_ref()
            .map_err(|_| missing(rt, "aclCreateTensor"))?;
        let rank = u64::try_from(desc.dims.len()).unwrap_or(0);
        let storage = [desc.storage_len()];
        // SAFETY: the arrays live across the call and hold `rank` (or 1) elements; aclnn copies
        // them. `base` is an aclrtMalloc address or null.
        let raw = unsafe {
            create(
                desc.dims.as_ptr(),
                rank,
                desc.dtype,
                desc.strides.as_ptr(),
                desc.offset,
                sys::aclFormat::ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                base,
            )
        };
        if raw.is_null() {
            return Err(AscendError::Internal(format!(
                "aclCreateTensor returned null for {desc:?}"
            )));
        }
        Ok(Tensor { nnop, raw })
    }

    /// The handle, for aclnn calls.
    pub fn raw(&self) -> *mut sys::aclTensor {
        self.raw
    }
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        if let Ok(destroy) = self.nnop.aclDestroyTensor.as_ref() {
            // SAFETY: created by aclCreateTensor and not destroyed yet; the ops that used it
            // were enqueued (aclnn copies what the kernel needs into the executor).
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// An `aclScalar`, destroyed on drop.
pub struct Scalar<'r> {
    nnop: &'r NnopBase,
    raw: *mut sys::aclScalar,
}

impl<'r> Scalar<'r> {
    /// An f32 scalar.
    pub fn f32(rt: &'r Runtime, value: f32) -> Result<Scalar<'r>, AscendError> {
        let mut value = value;
        Self::new(
            rt,
            (&raw mut value).cast::<c_void>(),
            sys::aclDataType::ACL_FLOAT,
        )
    }

    /// An i32 scalar.
    pub fn i32(rt: &'r Runtime, value: i32) -> Result<Scalar<'r>, AscendError> {
        let mut value = value;
        Self::new(
            rt,
            (&raw mut value).cast::<c_void>(),
            sys::aclDataType::ACL_INT32,
        )
    }

    /// An i16 scalar.
    pub fn i16(rt: &'r Runtime, value: i16) -> Result<Scalar<'r>, AscendError> {
        let mut value = value;
        Self::new(
            rt,
            (&raw mut value).cast::<c_void>(),
            sys::aclDataType::ACL_INT16,
        )
    }

    fn new(
        rt: &'r Runtime,
        value: *mut c_void,
        dtype: sys::aclDataType::Type,
    ) -> Result<Scalar<'r>, AscendError> {
        let nnop = rt.nnopbase()?;
        let create = nnop
            .aclCreateScalar
            .as_ref()
            .map_err(|_| missing(rt, "aclCreateScalar"))?;
        // SAFETY: `value` points at a live value of `dtype` for the call; aclnn copies it.
        let raw = unsafe { create(value, dtype) };
        if raw.is_null() {
            return Err(AscendError::Internal(
                "aclCreateScalar returned null".into(),
            ));
        }
        Ok(Scalar { nnop, raw })
    }

    /// The handle, for aclnn calls.
    pub fn raw(&self) -> *mut sys::aclScalar {
        self.raw
    }
}

impl Drop for Scalar<'_> {
    fn drop(&mut self) {
        if let Ok(destroy) = self.nnop.aclDestroyScalar.as_ref() {
            // SAFETY: created by aclCreateScalar and not destroyed yet.
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// An `aclIntArray` (a host array of i64), destroyed on drop.
pub struct IntArray<'r> {
    nnop: &'r NnopBase,
    raw: *mut sys::aclIntArray,
}

impl<'r> IntArray<'r> {
    /// An array holding a copy of `values`.
    pub fn new(rt: &'r Runtime, values: &[i64]) -> Result<IntArray<'r>, AscendError> {
        let nnop = rt.nnopbase()?;
        let create = nnop
            .aclCreateIntArray
            .as_ref()
            .map_err(|_| missing(rt, "aclCreateIntArray"))?;
        let len = u64::try_from(values.len()).unwrap_or(0);
        // SAFETY: `values` holds `len` elements for the call; aclnn copies them.
        let raw = unsafe { create(values.as_ptr(), len) };
        if raw.is_null() {
            return Err(AscendError::Internal(
                "aclCreateIntArray returned null".into(),
            ));
        }
        Ok(IntArray { nnop, raw })
    }

    /// The handle, for aclnn calls.
    pub fn raw(&self) -> *mut sys::aclIntArray {
        self.raw
    }
}

impl Drop for IntArray<'_> {
    fn drop(&mut self) {
        if let Ok(destroy) = self.nnop.aclDestroyIntArray.as_ref() {
            // SAFETY: created by aclCreateIntArray and not destroyed yet.
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// Releases an executor from a first-phase call whose second phase will not run (a
/// workspace query, or a call abandoned after its first phase): aclnn's documented release is
/// to make it repeatable, then destroy it. Returns whether it could.
pub fn release_executor(rt: &Runtime, executor: *mut sys::aclOpExecutor) -> bool {
    if executor.is_null() {
        return true;
    }
    let Ok(nnop) = rt.nnopbase() else {
        return false;
    };
    let (Ok(repeatable), Ok(destroy)) = (
        nnop.aclSetAclOpExecutorRepeatable.as_ref(),
        nnop.aclDestroyAclOpExecutor.as_ref(),
    ) else {
        return false;
    };
    // SAFETY: `executor` came from a successful first phase and was never run or released.
    let status = unsafe { repeatable(executor) };
    if status != 0 {
        return false;
    }
    // SAFETY: as above; a repeatable executor is released by the caller with this call.
    unsafe { destroy(executor) == 0 }
}

fn missing(rt: &Runtime, function: &'static str) -> AscendError {
    AscendError::MissingSymbol {
        function,
        library: rt
            .nnopbase_path()
            .map_or_else(str::to_owned, |path| path.display().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_and_storage() {
        let desc = Desc::contiguous(sys::aclDataType::ACL_FLOAT, &[2, 3, 4]);
        assert_eq!(desc.strides, vec![12, 4, 1]);
        assert_eq!(desc.storage_len(), 24);
        let view = Desc {
            offset: 10,
            strides: vec![7, 1],
            dims: vec![3, 5],
            dtype: sys::aclDataType::ACL_FLOAT16,
        };
        // Last element at 10 + 2*7 + 4 = 28.
        assert_eq!(view.storage_len(), 29);
        let empty = Desc {
            dims: vec![0, 5],
            ..view
        };
        assert_eq!(empty.storage_len(), 10);
    }
}
