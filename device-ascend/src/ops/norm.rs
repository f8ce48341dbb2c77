//! Layer norm and RMS norm over each row.
//!
//! - `aclnnLayerNorm(input, normalizedShape = [cols], weight, bias (or null), eps, out,
//!   meanOut = null, rstdOut = null)`; not offered on the 310P.
//! - `aclnnRmsNorm(x, gamma, epsilon, yOut, rstdOut)`: `rstdOut` is a required f32 `[rows, 1]`
//!   output whatever the input dtype, kept in the scratch part of the workspace.
//!
//! An output that is the input itself, or not contiguous, is written to an intermediate and
//! copied into place (`aclnnInplaceCopy`).

use iris_plugin::abi::DType;
use iris_plugin::validate::{Mat, Norm};

use super::elementwise::{Place, copy};
use super::{Exec, bytes, dim, elem, mat_desc};
use crate::error::AscendError;
use crate::runtime::aclnn;
use crate::sys;
use crate::tensor::{Desc, IntArray, Tensor, acl_dtype};

/// Runs (or measures) a layer norm (`rms = false`) or an RMS norm.
pub fn norm(x: &mut Exec<'_>, n: &Norm, eps: f32, rms: bool) -> Result<(), AscendError> {
    if n.x.is_empty() {
        return Ok(());
    }
    let rt = x.rt();
    let dtype = acl_dtype(n.x.dtype)?;
    let (rows, cols) = (n.x.rows, n.x.cols);
    let flat = Desc::contiguous(dtype, &[dim(rows), dim(cols)]);
    let staged = needs_stage(&n.out, &n.x);
    let t = if staged {
        Some(x.temp(bytes(rows * cols, n.x.dtype))?)
    } else {
        None
    };
    let rstd = if rms {
        Some(x.temp(bytes(rows, DType::F32))?)
    } else {
        None
    };

    let x_t = x.tensor(&mat_desc(&n.x)?, n.x.buf)?;
    let w_t = x.tensor(&row_desc(&n.weight)?, n.weight.buf)?;
    let b_t = match &n.bias {
        Some(bias) => Some(x.tensor(&row_desc(bias)?, bias.buf)?),
        None => None,
    };
    let out_t = x.tensor(&mat_desc(&n.out)?, n.out.buf)?;
    let direct = !staged || (!n.out.same_as(&n.x) && n.out.is_contiguous());
    let t_t = match t {
        Some(ptr) if !direct => Some(x.at(&flat, Place::Temp(ptr))?),
        _ => None,
    };
    let target: &Tensor<'_> = t_t.as_ref().unwrap_or(&out_t);
    let (xr, wr, tr) = (x_t.raw(), w_t.raw(), target.raw());
    if rms {
        let rstd_desc = Desc::contiguous(sys::aclDataType::ACL_FLOAT, &[dim(rows), 1]);
        let rstd_t = x.at(
            &rstd_desc,
            Place::Temp(rstd.unwrap_or(std::ptr::null_mut())),
        )?;
        let rr = rstd_t.raw();
        let op = aclnn!(rt, aclnnRmsNormGetWorkspaceSize, aclnnRmsNorm)?;
        // SAFETY: live descriptors; out-pointers from `call`.
        x.call(op, |f, ws, ex| unsafe {
            f(xr, wr, f64::from(eps), tr, rr, ws, ex)
        })?;
    } else {
        let shape = IntArray::new(rt, &[dim(cols)])?;
        let sr = shape.raw();
        let br = b_t.as_ref().map_or(std::ptr::null_mut(), Tensor::raw);
        let op = aclnn!(rt, aclnnLayerNormGetWorkspaceSize, aclnnLayerNorm)?;
        // SAFETY: live descriptors and array; null optional outputs are allowed
        // (`meanOutOptional`, `rstdOutOptional`); out-pointers from `call`.
        x.call(op, |f, ws, ex| unsafe {
            f(
                xr,
                sr,
                wr,
                br,
                f64::from(eps),
                tr,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ws,
                ex,
            )
        })?;
    }
    match &t_t {
        Some(t_t) => copy(x, &out_t, t_t),
        None => Ok(()),
    }
}

/// Whether an output must go through an intermediate: not contiguous, or possibly the input
/// itself. Decided from shapes alone, so that the workspace query agrees with the call.
pub fn needs_stage(out: &Mat, input: &Mat) -> bool {
    !out.is_contiguous()
        || (out.rows == input.rows
            && out.cols == input.cols
            && out.stride == input.stride
            && out.dtype == input.dtype)
}

/// A `[1, cols]` parameter as a 1-D `[cols]` descriptor.
fn row_desc(m: &Mat) -> Result<Desc, AscendError> {
    Ok(Desc {
        dtype: acl_dtype(m.dtype)?,
        dims: vec![dim(m.cols)],
        strides: vec![1],
        offset: i64::try_from(m.offset / elem(m.dtype)).unwrap_or(i64::MAX),
    })
}
