//! Layer norm and RMS norm: one kernel, `norm_<dtype>`, one block per row.

use iris_plugin::abi::{NormArgs, PluginError};
use iris_plugin::validate;

use super::{
    Access, GRID_X_NORM, THREADS, addr, dim, dtype_name, grid, kernel_args, optional_addr,
};
use crate::device::CudaDevice;

kernel_args! {
    /// `norm_<dtype>(x, xs, out, os, w, b, rows, cols, eps, rms, lanes)`: `b` is 0 without a
    /// bias; `lanes` columns per thread and access.
    struct NormKernel {
        x: u64, xs: i64, out: u64, os: i64, weight: u64, bias: u64, rows: i64, cols: i64,
        eps: f32, rms: i32, lanes: i32,
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
        let x = addr(self, op, &norm.x)?;
        let out = addr(self, op, &norm.out)?;
        let weight = addr(self, op, &norm.weight)?;
        let bias = optional_addr(self, op, &norm.bias)?;
        // The weight and bias are single rows: their strides do not matter.
        let mut views = vec![
            Access::of(x, &norm.x),
            Access::of(out, &norm.out),
            Access {
                stride: 0,
                ..Access::of(weight, &norm.weight)
            },
        ];
        if let Some(b) = &norm.bias {
            views.push(Access {
                stride: 0,
                ..Access::of(bias, b)
            });
        }
        // A block takes a row, so only the columns and the alignment decide (one row of groups).
        let lanes = compute.lanes(1, norm.x.cols as u64, &views);
        let mut launch = NormKernel {
            x,
            xs: dim(norm.x.stride),
            out,
            os: dim(norm.out.stride),
            weight,
            bias,
            rows: dim(norm.x.rows),
            cols: dim(norm.x.cols),
            eps: args.eps,
            rms: i32::from(rms),
            lanes: lanes as i32,
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
