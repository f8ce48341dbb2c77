//! Layer norm and RMS norm: one kernel, `norm_<dtype>`, one block per row.

use iris_plugin::abi::{NormArgs, PluginError};
use iris_plugin::validate;

use super::{GRID_X_NORM, THREADS, addr, dim, dtype_name, grid, kernel_args, optional_addr};
use crate::device::CudaDevice;

kernel_args! {
    /// `norm_<dtype>(x, xs, out, os, w, b, rows, cols, eps, rms)`: `b` is 0 without a bias.
    struct NormKernel {
        x: u64, xs: i64, out: u64, os: i64, weight: u64, bias: u64, rows: i64, cols: i64,
        eps: f32, rms: i32,
    }
}

impl CudaDevice {
    pub(crate) fn norm_impl(
        &self,
        op: &str,
        args: &NormArgs,
        rms: bool,
    ) -> Result<(), PluginError> {
        let norm = self.with_checker(op, |check| validate::norm(check, args, rms))?;
        let compute = self.compute(op)?;
        if norm.x.is_empty() {
            return Ok(());
        }
        let mut launch = NormKernel {
            x: addr(self, op, &norm.x)?,
            xs: dim(norm.x.stride),
            out: addr(self, op, &norm.out)?,
            os: dim(norm.out.stride),
            weight: addr(self, op, &norm.weight)?,
            bias: optional_addr(self, op, &norm.bias)?,
            rows: dim(norm.x.rows),
            cols: dim(norm.x.cols),
            eps: args.eps,
            rms: i32::from(rms),
        };
        let name = format!("norm_{}", dtype_name(norm.x.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                (grid(norm.x.rows as u64, GRID_X_NORM), 1, 1),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}
