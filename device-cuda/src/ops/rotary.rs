//! Rotary embedding from f32 cos/sin tables, in place: `rotary_<dtype>`, one thread per pair.

use iris_plugin::abi::{PluginError, RotaryArgs};
use iris_plugin::validate;

use super::{THREADS, addr, dim, dtype_name, grid_2d, kernel_args};
use crate::device::CudaDevice;

kernel_args! {
    /// `rotary_<dtype>(x, xs, cos, cos_stride, sin, sin_stride, rows, heads, head_dim)`.
    struct RotaryKernel {
        x: u64, xs: i64, cos: u64, cos_stride: i64, sin: u64, sin_stride: i64, rows: i64,
        heads: i64, head_dim: i64,
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
        let pairs = (rotary.heads * rotary.head_dim / 2) as u64;
        let mut launch = RotaryKernel {
            x: addr(self, op, &rotary.x)?,
            xs: dim(rotary.x.stride),
            cos: addr(self, op, &rotary.cos)?,
            cos_stride: dim(rotary.cos.stride),
            sin: addr(self, op, &rotary.sin)?,
            sin_stride: dim(rotary.sin.stride),
            rows: dim(rotary.x.rows),
            heads: dim(rotary.heads),
            head_dim: dim(rotary.head_dim),
        };
        let name = format!("rotary_{}", dtype_name(rotary.x.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                grid_2d(rotary.x.rows as u64, pairs),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}
