//! Elementwise ops and row movement: activations, binary ops (with a broadcast row), casts
//! between the float types, and row gathers by device indices (a bad index is flagged in the
//! device status word and reported at the next synchronisation).

use std::sync::atomic::Ordering;

use iris_plugin::abi::{ActivationArgs, BinaryArgs, CastArgs, GatherArgs, PluginError};
use iris_plugin::validate;

use super::{Access, THREADS, addr, dim, dtype_name, grid_2d, kernel_args, lanes, lanes_grid};
use crate::device::CudaDevice;

kernel_args! {
    /// `activation_<dtype>(x, xs, out, os, rows, cols, kind, lanes)`.
    struct ActivationKernel {
        x: u64, xs: i64, out: u64, os: i64, rows: i64, cols: i64, kind: i32, lanes: i32,
    }
}

kernel_args! {
    /// `binary_<dtype>(a, as, b, bs, out, os, rows, cols, op, lanes)`: `bs` 0 broadcasts b's
    /// row.
    struct BinaryKernel {
        a: u64, a_stride: i64, b: u64, b_stride: i64, out: u64, os: i64, rows: i64, cols: i64,
        op: i32, lanes: i32,
    }
}

kernel_args! {
    /// `cast_<from>_<to>(src, ss, out, os, rows, cols, lanes)`.
    struct CastKernel { src: u64, ss: i64, out: u64, os: i64, rows: i64, cols: i64, lanes: i32 }
}

kernel_args! {
    /// `gather_b<width>(src, ss, src_rows, out, os, indices, rows, cols, status)`.
    struct GatherKernel {
        src: u64, ss: i64, src_rows: i64, out: u64, os: i64, indices: u64, rows: i64, cols: i64,
        status: u64,
    }
}

impl CudaDevice {
    pub(crate) fn activation_impl(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        let op = "activation";
        let (x, out) = self.with_checker(op, |check| validate::activation(check, args))?;
        let compute = self.compute(op)?;
        if x.is_empty() {
            return Ok(());
        }
        let (x_addr, out_addr) = (addr(self, op, &x)?, addr(self, op, &out)?);
        let (rows, cols) = (x.rows as u64, x.cols as u64);
        let lanes = lanes(
            rows,
            cols,
            &[Access::of(x_addr, &x), Access::of(out_addr, &out)],
        );
        let mut launch = ActivationKernel {
            x: x_addr,
            xs: dim(x.stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(x.rows),
            cols: dim(x.cols),
            kind: i32::try_from(args.activation.0).unwrap_or(0),
            lanes: lanes as i32,
        };
        let name = format!("activation_{}", dtype_name(x.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }

    pub(crate) fn binary_impl(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        let op = "binary";
        let checked = self.with_checker(op, |check| validate::binary(check, args))?;
        let compute = self.compute(op)?;
        let (a, b, out) = (checked.a, checked.b, checked.out);
        if a.is_empty() {
            return Ok(());
        }
        let (a_addr, b_addr, out_addr) = (
            addr(self, op, &a)?,
            addr(self, op, &b)?,
            addr(self, op, &out)?,
        );
        let b_stride = if checked.broadcast { 0 } else { b.stride };
        let (rows, cols) = (a.rows as u64, a.cols as u64);
        let b_access = Access {
            stride: b_stride as u64,
            ..Access::of(b_addr, &b)
        };
        let lanes = lanes(
            rows,
            cols,
            &[Access::of(a_addr, &a), b_access, Access::of(out_addr, &out)],
        );
        let mut launch = BinaryKernel {
            a: a_addr,
            a_stride: dim(a.stride),
            b: b_addr,
            b_stride: dim(b_stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(a.rows),
            cols: dim(a.cols),
            op: i32::try_from(args.op.0).unwrap_or(0),
            lanes: lanes as i32,
        };
        let name = format!("binary_{}", dtype_name(a.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }

    pub(crate) fn gather_impl(&self, args: &GatherArgs) -> Result<(), PluginError> {
        let op = "gather_rows";
        let (src, out, indices) =
            self.with_checker(op, |check| validate::gather_rows(check, args))?;
        let compute = self.compute(op)?;
        if out.is_empty() {
            return Ok(());
        }
        let width = match src.dtype.size() {
            Some(1) => "b1",
            Some(2) => "b2",
            _ => "b4",
        };
        let mut launch = GatherKernel {
            src: addr(self, op, &src)?,
            ss: dim(src.stride),
            src_rows: dim(src.rows),
            out: addr(self, op, &out)?,
            os: dim(out.stride),
            indices: addr(self, op, &indices)?,
            rows: dim(out.rows),
            cols: dim(out.cols),
            status: compute.status.ptr,
        };
        compute
            .launch(
                self.cu_stream(),
                &format!("gather_{width}"),
                grid_2d(out.rows as u64, out.cols as u64),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))?;
        compute.gathered.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn cast_impl(&self, args: &CastArgs) -> Result<(), PluginError> {
        let op = "cast";
        let (src, out) = self.with_checker(op, |check| validate::cast(check, args))?;
        let compute = self.compute(op)?;
        if src.is_empty() || out.same_as(&src) {
            return Ok(());
        }
        let (src_addr, out_addr) = (addr(self, op, &src)?, addr(self, op, &out)?);
        let (rows, cols) = (src.rows as u64, src.cols as u64);
        let lanes = lanes(
            rows,
            cols,
            &[Access::of(src_addr, &src), Access::of(out_addr, &out)],
        );
        let mut launch = CastKernel {
            src: src_addr,
            ss: dim(src.stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(src.rows),
            cols: dim(src.cols),
            lanes: lanes as i32,
        };
        let name = format!("cast_{}_{}", dtype_name(src.dtype), dtype_name(out.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}
