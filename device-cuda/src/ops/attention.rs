//! Variable-length attention, the segment bounds read from `cu_seqlens` on the device.
//!
//! f16 and bf16 at head dims 64, 72, 80, 96 and 128 with a positive scale, on sm_80 and later,
//! run the tensor-core kernel `flash_attention_<dtype>_<head dim>` (64 queries of one head of
//! one segment per block, `mma.sync` and `ldmatrix`, K and V tiles double-buffered by
//! `cp.async` in dynamic shared memory). Everything else runs `attention_<dtype>_<size>`
//! (32 queries per block, f32 compute).

use iris_plugin::abi::{AttentionArgs, DType, PluginError};
use iris_plugin::validate;

use super::{
    ATTENTION_QUERIES, ATTENTION_THREADS, GRID_YZ, addr, dim, dtype_name, grid, kernel_args,
};
use crate::device::CudaDevice;
use crate::kernels::{
    ATTENTION_SIZES, FLASH_ATTENTION_QUERIES, FLASH_ATTENTION_SIZES, flash_attention_shared_bytes,
};

kernel_args! {
    /// `attention_<dtype>_<size>(q, qs, k, ks, v, vs, out, os, cu_seqlens, head_dim, scale)`
    /// and `flash_attention_<dtype>_<head dim>` with the same parameters.
    struct AttentionKernel {
        q: u64, qs: i64, k: u64, ks: i64, v: u64, vs: i64, out: u64, os: i64, cu_seqlens: u64,
        head_dim: i32, scale: f32,
    }
}

impl CudaDevice {
    pub(crate) fn attention_impl(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        let op = "attention";
        let att = self.with_checker(op, |check| validate::attention(check, args))?;
        let compute = self.compute(op)?;
        let head_dim = att.head_dim as u64;
        let Some(size) = ATTENTION_SIZES
            .iter()
            .copied()
            .find(|size| *size >= head_dim)
        else {
            return Err(PluginError::unsupported(format!(
                "attention: head_dim {head_dim} is larger than the largest kernel ({})",
                ATTENTION_SIZES[ATTENTION_SIZES.len() - 1]
            )));
        };
        let segments = att.segments.len() as u64;
        let heads = att.heads as u64;
        if heads > GRID_YZ || segments > GRID_YZ {
            return Err(PluginError::unsupported(format!(
                "attention: {heads} heads and {segments} segments; at most {GRID_YZ} of each"
            )));
        }
        if att.tokens == 0 || segments == 0 || args.max_seqlen == 0 {
            return Ok(());
        }
        let mut launch = AttentionKernel {
            q: addr(self, op, &att.q)?,
            qs: dim(att.q.stride),
            k: addr(self, op, &att.k)?,
            ks: dim(att.k.stride),
            v: addr(self, op, &att.v)?,
            vs: dim(att.v.stride),
            out: addr(self, op, &att.out)?,
            os: dim(att.out.stride),
            cu_seqlens: addr(self, op, &att.cu_seqlens_device)?,
            // At most the largest kernel size (checked above).
            head_dim: i32::try_from(head_dim).unwrap_or(i32::MAX),
            scale: args.scale,
        };
        let dtype = dtype_name(att.q.dtype);
        let flash = matches!(att.q.dtype, DType::F16 | DType::BF16)
            && FLASH_ATTENTION_SIZES.contains(&head_dim)
            // The kernel takes the row maximum before scaling (validation rules out NaN).
            && args.scale > 0.0
            && compute.has_flash_attention();
        let (name, queries, shared) = if flash {
            (
                format!("flash_attention_{dtype}_{head_dim}"),
                FLASH_ATTENTION_QUERIES,
                flash_attention_shared_bytes(head_dim),
            )
        } else {
            (format!("attention_{dtype}_{size}"), ATTENTION_QUERIES, 0)
        };
        let tiles = args.max_seqlen.div_ceil(queries);
        let grid_dims = (
            grid(tiles, i32::MAX as u64),
            grid(heads, GRID_YZ),
            grid(segments, GRID_YZ),
        );
        compute
            .launch_with_shared(
                self.cu_stream(),
                &name,
                grid_dims,
                ATTENTION_THREADS,
                shared,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}
