//! Elementwise ops: activation, binary add/mul with row broadcast, row gather and cast.

use iris_plugin::abi::{
    Activation, ActivationArgs, BinaryArgs, BinaryOp, CastArgs, GatherArgs, PluginError,
};

use super::{View, alias_or_disjoint, disjoint, math, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;

impl CpuDevice {
    /// [`ActivationArgs`]: `out = act(x)`; `out` may be exactly `x`.
    pub(crate) fn activation_impl(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        const OP: &str = "activation";
        let x = View::new(self, OP, "x", &args.x)?;
        let out = View::new(self, OP, "out", &args.out)?;
        out.expect_dtype(OP, "out", x.dtype, "x")?;
        out.expect_shape(OP, "out", x.rows, x.cols)?;
        alias_or_disjoint(OP, "out", &out, "x", &x)?;
        check_activation(OP, "activation", args.activation)?;
        let act = args.activation;
        with_elem!(OP, x.dtype, T => {
            self.par_rows(x.rows, x.cols, x.cols, |rows, scratch| {
                for r in rows {
                    // SAFETY: each task owns its rows of `out`; `x` is `out` exactly or
                    // disjoint from it, and is read before the row is written.
                    unsafe { x.load_row::<T>(r, scratch) };
                    math::activate_slice(act, scratch);
                    // SAFETY: as above.
                    unsafe { out.store_row::<T>(r, scratch) };
                }
            });
            Ok(())
        })
    }

    /// [`BinaryArgs`]: `out = a ∘ b`, `b` full-shaped or one broadcast row.
    pub(crate) fn binary_impl(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        const OP: &str = "binary";
        let a = View::new(self, OP, "a", &args.a)?;
        let b = View::new(self, OP, "b", &args.b)?;
        let out = View::new(self, OP, "out", &args.out)?;
        b.expect_dtype(OP, "b", a.dtype, "a")?;
        out.expect_dtype(OP, "out", a.dtype, "a")?;
        let broadcast = b.rows == 1 && a.rows != 1;
        if !broadcast {
            b.expect_shape(OP, "b", a.rows, a.cols)?;
        } else if b.cols != a.cols {
            return Err(invalid(
                OP,
                format!(
                    "`b`: expected shape [{}, {}] or [1, {}], got [{}, {}]",
                    a.rows, a.cols, a.cols, b.rows, b.cols
                ),
            ));
        }
        out.expect_shape(OP, "out", a.rows, a.cols)?;
        alias_or_disjoint(OP, "out", &out, "a", &a)?;
        alias_or_disjoint(OP, "out", &out, "b", &b)?;
        let op = args.op;
        if op != BinaryOp::ADD && op != BinaryOp::MUL {
            return Err(invalid(OP, format!("`op`: unknown binary op {}", op.0)));
        }
        let cols = a.cols;
        with_elem!(OP, a.dtype, T => {
            let mut row_b = vec![0.0f32; if broadcast { cols } else { 0 }];
            if broadcast && a.rows > 0 {
                // SAFETY: row 0 of `b` is only read during this op (`out` cannot alias a
                // broadcast `b`: their shapes differ).
                unsafe { b.load_row::<T>(0, &mut row_b) };
            }
            self.par_rows(a.rows, cols, 2 * cols, |rows, scratch| {
                let (sa, sb) = scratch.split_at_mut(cols);
                for r in rows {
                    // SAFETY: each task owns its rows of `out`; `a` and `b` are `out` exactly
                    // or disjoint from it, and both rows are read before the row is written.
                    unsafe { a.load_row::<T>(r, sa) };
                    let rb: &[f32] = if broadcast {
                        &row_b
                    } else {
                        // SAFETY: as above.
                        unsafe { b.load_row::<T>(r, sb) };
                        sb
                    };
                    if op == BinaryOp::ADD {
                        math::add_assign(sa, rb);
                    } else {
                        math::mul_assign(sa, rb);
                    }
                    // SAFETY: as above.
                    unsafe { out.store_row::<T>(r, sa) };
                }
            });
            Ok(())
        })
    }

    /// [`GatherArgs`]: `out[i] = src[indices[i]]`.
    pub(crate) fn gather_rows_impl(&self, args: &GatherArgs<'_>) -> Result<(), PluginError> {
        const OP: &str = "gather_rows";
        let src = View::new(self, OP, "src", &args.src)?;
        let out = View::new(self, OP, "out", &args.out)?;
        let indices = args.indices.as_slice();
        out.expect_dtype(OP, "out", src.dtype, "src")?;
        out.expect_shape(OP, "out", indices.len(), src.cols)?;
        if let Some((i, index)) = indices
            .iter()
            .enumerate()
            .find(|(_, index)| usize::try_from(**index).map_or(true, |v| v >= src.rows))
        {
            return Err(invalid(
                OP,
                format!(
                    "`indices`[{i}] = {index} is out of range for `src` with {} rows",
                    src.rows
                ),
            ));
        }
        disjoint(OP, "out", &out, "src", &src)?;
        with_elem!(OP, src.dtype, T => {
            self.par_rows(out.rows, out.cols, 0, |rows, _| {
                for r in rows {
                    // Indices were checked against `src.rows` above.
                    let from = indices[r] as usize;
                    // SAFETY: each task owns its rows of `out`, which does not overlap `src`.
                    unsafe { out.row_mut::<T>(r).copy_from_slice(src.row::<T>(from)) };
                }
            });
            Ok(())
        })
    }

    /// [`CastArgs`]: `out = src` converted to `out.dtype`.
    pub(crate) fn cast_impl(&self, args: &CastArgs) -> Result<(), PluginError> {
        const OP: &str = "cast";
        let src = View::new(self, OP, "src", &args.src)?;
        let out = View::new(self, OP, "out", &args.out)?;
        out.expect_shape(OP, "out", src.rows, src.cols)?;
        if out.same_as(&src) {
            // Same elements, same dtype: nothing to convert.
            return Ok(());
        }
        disjoint(OP, "out", &out, "src", &src)?;
        let cols = src.cols;
        with_elem!(OP, src.dtype, S => {
            with_elem!(OP, out.dtype, D => {
                self.par_rows(src.rows, cols, cols, |rows, scratch| {
                    for r in rows {
                        // SAFETY: each task owns its rows of `out`, disjoint from `src`.
                        unsafe {
                            src.load_row::<S>(r, scratch);
                            out.store_row::<D>(r, scratch);
                        }
                    }
                });
                Ok(())
            })
        })
    }
}

/// Fails unless `act` is an activation this ABI version defines.
pub(crate) fn check_activation(op: &str, name: &str, act: Activation) -> Result<(), PluginError> {
    if Activation::ALL.contains(&act) {
        Ok(())
    } else {
        Err(invalid(
            op,
            format!("`{name}`: unknown activation {}", act.0),
        ))
    }
}
