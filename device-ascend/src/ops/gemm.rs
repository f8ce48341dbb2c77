//! `out = act(a · Wᵀ + bias) (+ out)` with aclnn's matmul family.
//!
//! - No bias: `aclnnMatmul(self = a, mat2 = Wᵀ, out, cubeMathType)`.
//! - Bias: `aclnnAddmm(self = bias [1, n], mat1 = a, mat2 = Wᵀ, beta = 1, alpha = 1, out,
//!   cubeMathType)`, the bias broadcast over rows.
//! - `Wᵀ` is a transposed view of the `[n, k]` weight (strides `[1, row_stride]`), which
//!   aclnn's matmul reads without a copy; a `[k, n]` weight (`w_transposed`) is used as is.
//! - The activation epilogue runs on an intermediate `T` (see [`super::elementwise`]); with
//!   `accumulate` the result is added into `out` with `aclnnInplaceAdd`. Without either, the
//!   product goes straight into a contiguous `out`.
//!
//! `cubeMathType` is 0 (keep the dtype) except on parts whose cube units cannot multiply f32
//! (the 310P), where it is 1 (`ALLOW_FP32_DOWN_PRECISION`): aclnnMatmul's documentation.

use iris_plugin::abi::{Activation, BinaryOp};
use iris_plugin::validate::Gemm;

use super::elementwise::{Place, apply_into, apply_scratch, copy, inplace_binary};
use super::{Exec, bytes, dim, elem, mat_desc};
use crate::error::AscendError;
use crate::runtime::aclnn;
use crate::tensor::{Desc, Scalar, acl_dtype};

/// Runs (or measures) one gemm.
pub fn gemm(
    x: &mut Exec<'_>,
    g: &Gemm,
    activation: Activation,
    accumulate: bool,
    w_transposed: bool,
    cube_math: i8,
) -> Result<(), AscendError> {
    if g.out.is_empty() {
        return Ok(());
    }
    let rt = x.rt();
    let dtype = acl_dtype(g.out.dtype)?;
    let flat = Desc::contiguous(dtype, &[dim(g.m), dim(g.n)]);
    let count = g.m * g.n;
    let staged = activation != Activation::NONE || accumulate || !g.out.is_contiguous();
    let second = activation != Activation::NONE && (accumulate || !g.out.is_contiguous());
    // Intermediates depend only on the shapes, so the workspace query and the call agree.
    let t = if staged {
        Some(x.temp(bytes(count, g.out.dtype))?)
    } else {
        None
    };
    let u = if second {
        Some(x.temp(bytes(count, g.out.dtype))?)
    } else {
        None
    };
    let s = match apply_scratch(activation, count, g.out.dtype) {
        0 => None,
        n => Some(x.temp(n)?),
    };

    let a_t = x.tensor(&mat_desc(&g.a)?, g.a.buf)?;
    let w_desc = if w_transposed {
        mat_desc(&g.w)?
    } else {
        Desc {
            dtype,
            dims: vec![dim(g.k), dim(g.n)],
            strides: vec![1, dim(g.w.stride)],
            offset: i64::try_from(g.w.offset / elem(g.w.dtype)).unwrap_or(i64::MAX),
        }
    };
    let w_t = x.tensor(&w_desc, g.w.buf)?;
    let out_t = x.tensor(&mat_desc(&g.out)?, g.out.buf)?;
    let t_t = match t {
        Some(ptr) => Some(x.at(&flat, Place::Temp(ptr))?),
        None => None,
    };
    let product = t_t.as_ref().unwrap_or(&out_t);

    let (a, w, p) = (a_t.raw(), w_t.raw(), product.raw());
    if g.k == 0 {
        // An empty contraction: aclnn's matmul rejects k = 0, and the sum is 0.
        zero(x, product)?;
        if let Some(bias) = &g.bias {
            let b_t = x.tensor(&mat_desc(bias)?, bias.buf)?;
            inplace_binary(x, BinaryOp::ADD, product, &b_t)?;
        }
    } else if let Some(bias) = &g.bias {
        let b_t = x.tensor(&mat_desc(bias)?, bias.buf)?;
        let one = Scalar::f32(rt, 1.0)?;
        let (b, o) = (b_t.raw(), one.raw());
        let addmm = aclnn!(rt, aclnnAddmmGetWorkspaceSize, aclnnAddmm)?;
        // SAFETY: live descriptors and scalars; out-pointers from `call`.
        x.call(addmm, |f, ws, ex| unsafe {
            f(b, a, w, o, o, p, cube_math, ws, ex)
        })?;
    } else {
        let matmul = aclnn!(rt, aclnnMatmulGetWorkspaceSize, aclnnMatmul)?;
        // SAFETY: as above.
        x.call(matmul, |f, ws, ex| unsafe { f(a, w, p, cube_math, ws, ex) })?;
    }

    let Some(t_t) = &t_t else {
        return Ok(());
    };
    let s_t = match s {
        Some(ptr) => Some(x.at(&flat, Place::Temp(ptr))?),
        None => None,
    };
    if activation == Activation::NONE {
        return if accumulate {
            inplace_binary(x, BinaryOp::ADD, &out_t, t_t)
        } else {
            copy(x, &out_t, t_t)
        };
    }
    match u {
        Some(ptr) => {
            let u_t = x.at(&flat, Place::Temp(ptr))?;
            apply_into(x, activation, t_t, &u_t, s_t.as_ref())?;
            if accumulate {
                inplace_binary(x, BinaryOp::ADD, &out_t, &u_t)
            } else {
                copy(x, &out_t, &u_t)
            }
        }
        None => apply_into(x, activation, t_t, &out_t, s_t.as_ref()),
    }
}

/// Sets every element of `t` to zero (`aclnnInplaceFillScalar`).
fn zero(x: &mut Exec<'_>, t: &crate::tensor::Tensor<'_>) -> Result<(), AscendError> {
    let rt = x.rt();
    let value = Scalar::f32(rt, 0.0)?;
    let (tr, v) = (t.raw(), value.raw());
    let fill = aclnn!(
        rt,
        aclnnInplaceFillScalarGetWorkspaceSize,
        aclnnInplaceFillScalar
    )?;
    // SAFETY: live descriptor and scalar; out-pointers from `call`.
    x.call(fill, |f, ws, ex| unsafe { f(tr, v, ws, ex) })
}
