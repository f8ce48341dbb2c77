//! Rotary position embedding from cos/sin tables, in place. Two paths, chosen per call shape
//! by the device:
//!
//! - **fused**: `aclnnRotaryPositionEmbedding(x, cos, sin, mode = 0 (half), out)`: `x` is
//!   viewed as BSND `[1, tokens, heads, head_dim]` with the caller's row stride, the f32 tables
//!   as `[1, tokens, 1, head_dim]` (the op broadcasts them over heads). The op wants the tables
//!   in `x`'s dtype, so f16/bf16 rows get the tables cast into the workspace first
//!   (`aclnnCast`). The result goes to an intermediate and back into `x`
//!   (`aclnnInplaceCopy`), since the op documents no aliasing of `out` and `x`. Offered on
//!   Atlas A2/A3 parts.
//! - **composed**, where that op is missing (the 310P, op libraries that predate it): in f32
//!   in the workspace, `X = x`, `T = rotate_half(X)` as two half copies, `T *= sin` with the
//!   first half's signs flipped (`aclnnInplaceMuls(·, -1)` on a copy of the table), `X *= cos`,
//!   `X += T`, then `x = X` (`aclnnInplaceCopy` converts the dtype).

use iris_plugin::abi::DType;
use iris_plugin::validate::Rotary;

use super::attention::Path;
use super::elementwise::{Place, cast_into, copy, inplace_binary};
use super::{Exec, bytes, dim, elem};
use crate::error::AscendError;
use crate::runtime::aclnn;
use crate::sys;
use crate::tensor::{Desc, Scalar, acl_dtype};
use iris_plugin::abi::BinaryOp;

/// `aclnnRotaryPositionEmbedding`'s `mode` for `rotate_half` (halves of the head).
const MODE_HALF: i64 = 0;

/// Runs (or measures) a rotary embedding on `path`.
pub fn rotary(x: &mut Exec<'_>, r: &Rotary, path: Path) -> Result<(), AscendError> {
    match path {
        Path::Fused => fused(x, r),
        Path::Composed => composed(x, r),
    }
}

fn fused(x: &mut Exec<'_>, r: &Rotary) -> Result<(), AscendError> {
    let tokens = r.x.rows;
    if tokens == 0 {
        return Ok(());
    }
    let rt = x.rt();
    let dtype = r.x.dtype;
    let acl = acl_dtype(dtype)?;
    let (heads, hd) = (dim(r.heads), dim(r.head_dim));
    let t = dim(tokens);
    let cast_tables = dtype != DType::F32;
    let cos_cast = if cast_tables {
        Some(x.temp(bytes(tokens * r.head_dim, dtype))?)
    } else {
        None
    };
    let sin_cast = if cast_tables {
        Some(x.temp(bytes(tokens * r.head_dim, dtype))?)
    } else {
        None
    };
    let out = x.temp(bytes(tokens * r.heads * r.head_dim, dtype))?;

    let x_desc = Desc {
        dtype: acl,
        dims: vec![1, t, heads, hd],
        strides: vec![t * dim(r.x.stride), dim(r.x.stride), hd, 1],
        offset: i64::try_from(r.x.offset / elem(dtype)).unwrap_or(i64::MAX),
    };
    let table = |m: &iris_plugin::validate::Mat| Desc {
        dtype: sys::aclDataType::ACL_FLOAT,
        dims: vec![1, t, 1, hd],
        strides: vec![t * dim(m.stride), dim(m.stride), hd, 1],
        offset: i64::try_from(m.offset / 4).unwrap_or(i64::MAX),
    };
    let x_t = x.tensor(&x_desc, r.x.buf)?;
    let cos_t = x.tensor(&table(&r.cos), r.cos.buf)?;
    let sin_t = x.tensor(&table(&r.sin), r.sin.buf)?;
    let cast_desc = Desc::contiguous(acl, &[1, t, 1, hd]);
    let (cos_x, sin_x) = match (cos_cast, sin_cast) {
        (Some(c), Some(s)) => {
            let c_t = x.at(&cast_desc, Place::Temp(c))?;
            let s_t = x.at(&cast_desc, Place::Temp(s))?;
            cast_into(x, &cos_t, &c_t, dtype)?;
            cast_into(x, &sin_t, &s_t, dtype)?;
            (Some(c_t), Some(s_t))
        }
        _ => (None, None),
    };
    let cos_use = cos_x.as_ref().unwrap_or(&cos_t);
    let sin_use = sin_x.as_ref().unwrap_or(&sin_t);
    let out_t = x.at(&Desc::contiguous(acl, &[1, t, heads, hd]), Place::Temp(out))?;
    let (xr, cr, sr, or) = (x_t.raw(), cos_use.raw(), sin_use.raw(), out_t.raw());
    let op = aclnn!(
        rt,
        aclnnRotaryPositionEmbeddingGetWorkspaceSize,
        aclnnRotaryPositionEmbedding
    )?;
    // SAFETY: live descriptors; out-pointers from `call`.
    x.call(op, |f, ws, ex| unsafe {
        f(xr, cr, sr, MODE_HALF, or, ws, ex)
    })?;
    copy(x, &x_t, &out_t)
}

fn composed(x: &mut Exec<'_>, r: &Rotary) -> Result<(), AscendError> {
    let tokens = r.x.rows;
    if tokens == 0 {
        return Ok(());
    }
    let rt = x.rt();
    let f32 = sys::aclDataType::ACL_FLOAT;
    let (t, heads, hd) = (dim(tokens), dim(r.heads), dim(r.head_dim));
    let half = hd / 2;
    let count = tokens * r.heads * r.head_dim;
    let xf = x.temp(bytes(count, DType::F32))?;
    let tf = x.temp(bytes(count, DType::F32))?;
    let signed = x.temp(bytes(tokens * r.head_dim, DType::F32))?;

    let x_t = x.tensor(
        &Desc {
            dtype: acl_dtype(r.x.dtype)?,
            dims: vec![t, heads, hd],
            strides: vec![dim(r.x.stride), hd, 1],
            offset: i64::try_from(r.x.offset / elem(r.x.dtype)).unwrap_or(i64::MAX),
        },
        r.x.buf,
    )?;
    let whole = Desc::contiguous(f32, &[t, heads, hd]);
    let part = |offset: i64| Desc {
        dtype: f32,
        dims: vec![t, heads, half],
        strides: vec![heads * hd, hd, 1],
        offset,
    };
    let xf_t = x.at(&whole, Place::Temp(xf))?;
    let tf_t = x.at(&whole, Place::Temp(tf))?;
    copy(x, &xf_t, &x_t)?;
    copy(
        x,
        &x.at(&part(0), Place::Temp(tf))?,
        &x.at(&part(half), Place::Temp(xf))?,
    )?;
    copy(
        x,
        &x.at(&part(half), Place::Temp(tf))?,
        &x.at(&part(0), Place::Temp(xf))?,
    )?;

    let table = |m: &iris_plugin::validate::Mat| Desc {
        dtype: f32,
        dims: vec![t, 1, hd],
        strides: vec![dim(m.stride), hd, 1],
        offset: i64::try_from(m.offset / 4).unwrap_or(i64::MAX),
    };
    let signed_t = x.at(&Desc::contiguous(f32, &[t, 1, hd]), Place::Temp(signed))?;
    copy(x, &signed_t, &x.tensor(&table(&r.sin), r.sin.buf)?)?;
    let first_half = x.at(
        &Desc {
            dtype: f32,
            dims: vec![t, 1, half],
            strides: vec![hd, hd, 1],
            offset: 0,
        },
        Place::Temp(signed),
    )?;
    let minus = Scalar::f32(rt, -1.0)?;
    let (fh, m) = (first_half.raw(), minus.raw());
    let muls = aclnn!(rt, aclnnInplaceMulsGetWorkspaceSize, aclnnInplaceMuls)?;
    // SAFETY: live descriptor and scalar; out-pointers from `call`.
    x.call(muls, |f, ws, ex| unsafe { f(fh, m, ws, ex) })?;
    inplace_binary(x, BinaryOp::MUL, &tf_t, &signed_t)?;
    let cos_t = x.tensor(&table(&r.cos), r.cos.buf)?;
    inplace_binary(x, BinaryOp::MUL, &xf_t, &cos_t)?;
    inplace_binary(x, BinaryOp::ADD, &xf_t, &tf_t)?;
    copy(x, &x_t, &xf_t)
}
