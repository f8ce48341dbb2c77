//! Rotary embedding from f32 cos/sin tables, in place: `rotary_<dtype>`, one thread per pair.

use iris_plugin::abi::{PluginError, RotaryArgs};
use iris_plugin::validate;

use super::{Access, THREADS, WIDE_LANES, addr, dim, dtype_name, kernel_args, lanes_grid};
use crate::device::CudaDevice;

kernel_args! {
    /// `rotary_<dtype>(x, xs, cos, cos_stride, sin, sin_stride, rows, heads, head_dim,
    /// lanes)`.
    struct RotaryKernel {
        x: u64, xs: i64, cos: u64, cos_stride: i64, sin: u64, sin_stride: i64, rows: i64,
        heads: i64, head_dim: i64, lanes: i32,
    }
}

impl CudaDevice {
    pub(crate) fn rotary_impl(&self, args: &RotaryArgs) -> Result<(), PluginError> {
        let op = "rotary";
        let rotary = self.with_checker(op, |check| validate::rotary(check, args))?;
        let compute = self.compute(op)?;
        if rotary.x.is_empty() {
            return Ok(());
        }
        let half = (rotary.head_dim / 2) as u64;
        let pairs = rotary.heads as u64 * half;
        let rows = rotary.x.rows as u64;
        let (x, cos, sin) = (
            addr(self, op, &rotary.x)?,
            addr(self, op, &rotary.cos)?,
            addr(self, op, &rotary.sin)?,
        );
        // A group of pairs must stay within one head's half: `half` a multiple of the lanes
        // (then every group's first column, and its partner half a head on, is too).
        let lanes = if half.is_multiple_of(u64::from(WIDE_LANES)) {
            compute.lanes(
                rows,
                pairs,
                &[
                    Access::of(x, &rotary.x),
                    Access::of(cos, &rotary.cos),
                    Access::of(sin, &rotary.sin),
                ],
            )
        } else {
            1
        };
        let mut launch = RotaryKernel {
            x,
            xs: dim(rotary.x.stride),
            cos,
            cos_stride: dim(rotary.cos.stride),
            sin,
            sin_stride: dim(rotary.sin.stride),
            rows: dim(rotary.x.rows),
            heads: dim(rotary.heads),
            head_dim: dim(rotary.head_dim),
            lanes: lanes as i32,
        };
        let name = format!("rotary_{}", dtype_name(rotary.x.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, pairs, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}
