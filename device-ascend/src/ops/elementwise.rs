//! Activations, add and multiply, cast, row gather and strided copies.
//!
//! aclnn calls used (signatures from the op_api headers named in `src/sys/opapi.rs`):
//! `aclnnGeluV2(x, approximate = 0, y)` for the exact GELU, `aclnnGelu(self, out)` for the
//! tanh approximation, `aclnnSilu(self, out)`, quick GELU composed as
//! `aclnnMuls(x, 1.702) -> aclnnInplaceSigmoid -> aclnnMul(x, ·)`, `aclnnAdd(self, other,
//! alpha, out)` / `aclnnInplaceAdd`, `aclnnMul` / `aclnnInplaceMul`, `aclnnCast(self, dtype,
//! out)`, `aclnnIndexSelect(self, dim = 0, index, out)` and `aclnnInplaceCopy(selfRef, src)`.
//!
//! Outputs that are not contiguous (a row stride wider than the row) are computed into an
//! intermediate and copied into place with `aclnnInplaceCopy`: aclnn documents strided inputs
//! for these ops, not strided outputs.

use std::ffi::c_void;

use iris_plugin::abi::{Activation, BinaryOp, BufferHandle, DType};
use iris_plugin::validate::Mat;

use super::norm::needs_stage;
use super::{Exec, bytes, dim, mat_desc};
use crate::error::AscendError;
use crate::runtime::aclnn;
use crate::sys;
use crate::tensor::{Desc, Scalar, Tensor, acl_dtype};

/// Quick GELU's sigmoid scale (CLIP's `x * sigmoid(1.702 x)`).
pub const QUICK_GELU_SCALE: f32 = 1.702;
/// `aclnnGeluV2`'s `approximate` for the exact (erf) GELU.
const GELU_V2_NONE: i64 = 0;

/// Where a tensor's data lives: a caller's buffer or an intermediate.
#[derive(Debug, Clone, Copy)]
pub enum Place {
    /// A buffer from `alloc`.
    Buf(BufferHandle),
    /// An intermediate from [`Exec::temp`].
    Temp(*mut c_void),
}

impl Exec<'_> {
    /// A descriptor of `desc` at `place`.
    pub fn at(&self, desc: &Desc, place: Place) -> Result<Tensor<'static>, AscendError> {
        match place {
            Place::Buf(buf) => self.tensor(desc, buf),
            Place::Temp(ptr) => self.temp_tensor(desc, ptr),
        }
    }
}

/// `out = act(x)`; `out` may be exactly `x`.
pub fn activation(
    x: &mut Exec<'_>,
    input: &Mat,
    out: &Mat,
    act: Activation,
) -> Result<(), AscendError> {
    if input.is_empty() {
        return Ok(());
    }
    let quick = act == Activation::QUICK_GELU;
    let count = input.rows * input.cols;
    // Intermediates depend only on the shapes, so the workspace query and the call agree.
    let t = if needs_stage(out, input) && !quick {
        Some(x.temp(bytes(count, input.dtype))?)
    } else {
        None
    };
    let s = if quick {
        Some(x.temp(bytes(count, input.dtype))?)
    } else {
        None
    };
    let in_desc = mat_desc(input)?;
    let flat = Desc::contiguous(in_desc.dtype, &[dim(input.rows), dim(input.cols)]);
    let input_t = x.tensor(&in_desc, input.buf)?;
    let out_t = x.tensor(&mat_desc(out)?, out.buf)?;
    let in_place = out.same_as(input);
    let direct = out.is_contiguous() && !in_place;
    if let Some(s) = s {
        let s_t = x.at(&flat, Place::Temp(s))?;
        sigmoid_scaled(x, &input_t, &s_t)?;
        if in_place {
            return inplace_binary(x, BinaryOp::MUL, &input_t, &s_t);
        }
        if direct {
            return binary_into(x, BinaryOp::MUL, &input_t, &s_t, &out_t);
        }
        inplace_binary(x, BinaryOp::MUL, &s_t, &input_t)?;
        return copy(x, &out_t, &s_t);
    }
    match (direct, t) {
        (true, _) => apply(x, act, &input_t, &out_t),
        (false, Some(t)) => {
            let t_t = x.at(&flat, Place::Temp(t))?;
            apply(x, act, &input_t, &t_t)?;
            copy(x, &out_t, &t_t)
        }
        (false, None) => Err(AscendError::Internal(
            "activation: an in-place or strided output without an intermediate".into(),
        )),
    }
}

/// `y = act(x)` for two distinct tensors of one shape. Quick GELU needs an intermediate of
/// `x`'s size, which the caller passes as `scratch` (unused by the other activations).
pub fn apply_into(
    x: &mut Exec<'_>,
    act: Activation,
    input: &Tensor<'_>,
    output: &Tensor<'_>,
    scratch: Option<&Tensor<'_>>,
) -> Result<(), AscendError> {
    if act == Activation::QUICK_GELU {
        let Some(s) = scratch else {
            return Err(AscendError::Internal(
                "quick GELU needs an intermediate".into(),
            ));
        };
        sigmoid_scaled(x, input, s)?;
        return binary_into(x, BinaryOp::MUL, input, s, output);
    }
    apply(x, act, input, output)
}

/// Bytes of intermediate [`apply_into`] needs for `count` elements.
pub fn apply_scratch(act: Activation, count: usize, dtype: DType) -> u64 {
    if act == Activation::QUICK_GELU {
        bytes(count, dtype)
    } else {
        0
    }
}

fn apply(
    x: &mut Exec<'_>,
    act: Activation,
    input: &Tensor<'_>,
    output: &Tensor<'_>,
) -> Result<(), AscendError> {
    let rt = x.rt();
    let (i, o) = (input.raw(), output.raw());
    match act {
        Activation::GELU_ERF => {
            let op = aclnn!(rt, aclnnGeluV2GetWorkspaceSize, aclnnGeluV2)?;
            // SAFETY: live descriptors; out-pointers from `call`.
            x.call(op, |f, ws, ex| unsafe { f(i, GELU_V2_NONE, o, ws, ex) })
        }
        Activation::GELU_TANH => {
            let op = aclnn!(rt, aclnnGeluGetWorkspaceSize, aclnnGelu)?;
            // SAFETY: as above.
            x.call(op, |f, ws, ex| unsafe { f(i, o, ws, ex) })
        }
        Activation::SILU => {
            let op = aclnn!(rt, aclnnSiluGetWorkspaceSize, aclnnSilu)?;
            // SAFETY: as above.
            x.call(op, |f, ws, ex| unsafe { f(i, o, ws, ex) })
        }
        other => Err(AscendError::Unsupported {
            op: "activation",
            reason: format!("activation {} has no aclnn op", other.0),
        }),
    }
}

/// `s = sigmoid(1.702 · x)`.
fn sigmoid_scaled(x: &mut Exec<'_>, input: &Tensor<'_>, s: &Tensor<'_>) -> Result<(), AscendError> {
    let rt = x.rt();
    let scale = Scalar::f32(rt, QUICK_GELU_SCALE)?;
    let (i, sr, k) = (input.raw(), s.raw(), scale.raw());
    let muls = aclnn!(rt, aclnnMulsGetWorkspaceSize, aclnnMuls)?;
    // SAFETY: live descriptors and scalar; out-pointers from `call`.
    x.call(muls, |f, ws, ex| unsafe { f(i, k, sr, ws, ex) })?;
    let sigmoid = aclnn!(rt, aclnnInplaceSigmoidGetWorkspaceSize, aclnnInplaceSigmoid)?;
    // SAFETY: as above.
    x.call(sigmoid, |f, ws, ex| unsafe { f(sr, ws, ex) })
}

/// `out = a ∘ b` (b may broadcast as a single row); `out` may be exactly `a` or `b`.
pub fn binary(
    x: &mut Exec<'_>,
    op: BinaryOp,
    a: &Mat,
    b: &Mat,
    out: &Mat,
) -> Result<(), AscendError> {
    let a_t = x.tensor(&mat_desc(a)?, a.buf)?;
    let b_t = x.tensor(&mat_desc(b)?, b.buf)?;
    if out.same_as(a) {
        return inplace_binary(x, op, &a_t, &b_t);
    }
    if out.same_as(b) {
        // Both ops commute; `b` has `a`'s shape here (a broadcast `b` cannot be the output).
        return inplace_binary(x, op, &b_t, &a_t);
    }
    let out_t = x.tensor(&mat_desc(out)?, out.buf)?;
    if out.is_contiguous() {
        return binary_into(x, op, &a_t, &b_t, &out_t);
    }
    let flat = Desc::contiguous(acl_dtype(a.dtype)?, &[dim(a.rows), dim(a.cols)]);
    let t = x.temp(bytes(a.rows * a.cols, a.dtype))?;
    let t_t = x.temp_tensor(&flat, t)?;
    binary_into(x, op, &a_t, &b_t, &t_t)?;
    copy(x, &out_t, &t_t)
}

/// `out = a ∘ b` into a distinct tensor.
pub fn binary_into(
    x: &mut Exec<'_>,
    op: BinaryOp,
    a: &Tensor<'_>,
    b: &Tensor<'_>,
    out: &Tensor<'_>,
) -> Result<(), AscendError> {
    let rt = x.rt();
    let (ar, br, or) = (a.raw(), b.raw(), out.raw());
    if op == BinaryOp::ADD {
        let alpha = Scalar::f32(rt, 1.0)?;
        let al = alpha.raw();
        let add = aclnn!(rt, aclnnAddGetWorkspaceSize, aclnnAdd)?;
        // SAFETY: live descriptors and scalar; out-pointers from `call`.
        x.call(add, |f, ws, ex| unsafe { f(ar, br, al, or, ws, ex) })
    } else {
        let mul = aclnn!(rt, aclnnMulGetWorkspaceSize, aclnnMul)?;
        // SAFETY: as above.
        x.call(mul, |f, ws, ex| unsafe { f(ar, br, or, ws, ex) })
    }
}

/// `a = a ∘ b`.
pub fn inplace_binary(
    x: &mut Exec<'_>,
    op: BinaryOp,
    a: &Tensor<'_>,
    b: &Tensor<'_>,
) -> Result<(), AscendError> {
    let rt = x.rt();
    let (ar, br) = (a.raw(), b.raw());
    if op == BinaryOp::ADD {
        let alpha = Scalar::f32(rt, 1.0)?;
        let al = alpha.raw();
        let add = aclnn!(rt, aclnnInplaceAddGetWorkspaceSize, aclnnInplaceAdd)?;
        // SAFETY: live descriptors and scalar; out-pointers from `call`.
        x.call(add, |f, ws, ex| unsafe { f(ar, br, al, ws, ex) })
    } else {
        let mul = aclnn!(rt, aclnnInplaceMulGetWorkspaceSize, aclnnInplaceMul)?;
        // SAFETY: as above.
        x.call(mul, |f, ws, ex| unsafe { f(ar, br, ws, ex) })
    }
}

/// `dst = src` (same shape; strides and dtypes may differ).
pub fn copy(x: &mut Exec<'_>, dst: &Tensor<'_>, src: &Tensor<'_>) -> Result<(), AscendError> {
    let rt = x.rt();
    let (d, s) = (dst.raw(), src.raw());
    let op = aclnn!(rt, aclnnInplaceCopyGetWorkspaceSize, aclnnInplaceCopy)?;
    // SAFETY: live descriptors; out-pointers from `call`.
    x.call(op, |f, ws, ex| unsafe { f(d, s, ws, ex) })
}

/// A copy of `rows` rows of `width` bytes, from `src` to `dst`, each a byte offset and a row
/// stride in bytes (one region when `rows` is 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteCopy {
    /// Source buffer, offset of its first row, and bytes between rows.
    pub src: (BufferHandle, u64, u64),
    /// Destination buffer, offset of its first row, and bytes between rows.
    pub dst: (BufferHandle, u64, u64),
    /// Rows.
    pub rows: u64,
    /// Bytes per row.
    pub width: u64,
}

/// A [`ByteCopy`] as one `aclnnInplaceCopy` over `UINT8` views: any offsets (descriptors
/// point at the 32-byte aligned buffer start and offset in elements, here bytes) and any row
/// strides, where `aclrtMemcpyAsync` between device addresses wants both 64-byte aligned.
pub fn copy_bytes(x: &mut Exec<'_>, c: &ByteCopy) -> Result<(), AscendError> {
    // Validated ranges lie inside buffers, far below 2^63 bytes.
    let int = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
    let view = |offset: u64, stride: u64| Desc {
        dtype: sys::aclDataType::ACL_UINT8,
        dims: vec![int(c.rows), int(c.width)],
        strides: vec![int(stride), 1],
        offset: int(offset),
    };
    let src = x.tensor(&view(c.src.1, c.src.2), c.src.0)?;
    let dst = x.tensor(&view(c.dst.1, c.dst.2), c.dst.0)?;
    copy(x, &dst, &src)
}

/// `out = src` converted to `out`'s dtype.
pub fn cast(x: &mut Exec<'_>, src: &Mat, out: &Mat) -> Result<(), AscendError> {
    if out.same_as(src) || src.is_empty() {
        return Ok(());
    }
    let src_t = x.tensor(&mat_desc(src)?, src.buf)?;
    let out_t = x.tensor(&mat_desc(out)?, out.buf)?;
    if out.is_contiguous() {
        return cast_into(x, &src_t, &out_t, out.dtype);
    }
    let flat = Desc::contiguous(acl_dtype(out.dtype)?, &[dim(out.rows), dim(out.cols)]);
    let t = x.temp(bytes(out.rows * out.cols, out.dtype))?;
    let t_t = x.temp_tensor(&flat, t)?;
    cast_into(x, &src_t, &t_t, out.dtype)?;
    copy(x, &out_t, &t_t)
}

/// `out = src` as `dtype` (`out`'s dtype).
pub fn cast_into(
    x: &mut Exec<'_>,
    src: &Tensor<'_>,
    out: &Tensor<'_>,
    dtype: DType,
) -> Result<(), AscendError> {
    let rt = x.rt();
    let to = acl_dtype(dtype)?;
    let (s, o) = (src.raw(), out.raw());
    let op = aclnn!(rt, aclnnCastGetWorkspaceSize, aclnnCast)?;
    // SAFETY: live descriptors; out-pointers from `call`.
    x.call(op, |f, ws, ex| unsafe { f(s, to, o, ws, ex) })
}

/// `out[i] = src[indices[i]]`.
pub fn gather_rows(
    x: &mut Exec<'_>,
    src: &Mat,
    out: &Mat,
    indices: &Mat,
) -> Result<(), AscendError> {
    if out.is_empty() {
        return Ok(());
    }
    let rt = x.rt();
    let src_t = x.tensor(&mat_desc(src)?, src.buf)?;
    let index_desc = Desc {
        dtype: sys::aclDataType::ACL_INT32,
        dims: vec![dim(indices.cols)],
        strides: vec![1],
        offset: i64::try_from(indices.offset / 4).unwrap_or(i64::MAX),
    };
    let index_t = x.tensor(&index_desc, indices.buf)?;
    let out_t = x.tensor(&mat_desc(out)?, out.buf)?;
    let target = if out.is_contiguous() {
        None
    } else {
        let flat = Desc::contiguous(acl_dtype(out.dtype)?, &[dim(out.rows), dim(out.cols)]);
        let t = x.temp(bytes(out.rows * out.cols, out.dtype))?;
        Some(x.temp_tensor(&flat, t)?)
    };
    let dst = target.as_ref().unwrap_or(&out_t);
    let (s, i, d) = (src_t.raw(), index_t.raw(), dst.raw());
    let op = aclnn!(rt, aclnnIndexSelectGetWorkspaceSize, aclnnIndexSelect)?;
    // SAFETY: live descriptors; out-pointers from `call`. Indices are device data the
    // caller guarantees in range (ABI contract of `gather_rows`).
    x.call(op, |f, ws, ex| unsafe { f(s, 0, i, d, ws, ex) })?;
    if let Some(t_t) = &target {
        copy(x, &out_t, t_t)?;
    }
    Ok(())
}
