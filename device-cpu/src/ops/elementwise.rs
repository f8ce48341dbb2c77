//! Elementwise ops: activation, binary add/mul with row broadcast, row gather by device
//! indices, and cast.

use iris_plugin::abi::{
    Activation, ActivationArgs, BinaryArgs, BinaryOp, CastArgs, GatherArgs, PluginError,
};
use iris_plugin::validate::{self, Checker};

use super::{Touch, Touches, View, math, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;
use crate::queue::Exec;

/// A checked elementwise op, ready to run.
pub(crate) enum ElementwiseJob {
    /// `out = act(x)`.
    Activation {
        /// Input.
        x: View,
        /// Output (`x` itself or disjoint).
        out: View,
        /// The function.
        act: Activation,
    },
    /// `out = a ∘ b`.
    Binary {
        /// Left operand.
        a: View,
        /// Right operand (full or one broadcast row).
        b: View,
        /// Output.
        out: View,
        /// Add or multiply.
        op: BinaryOp,
        /// `b` is one row.
        broadcast: bool,
    },
    /// `out[i] = src[indices[i]]`.
    Gather {
        /// Source rows.
        src: View,
        /// Destination.
        out: View,
        /// i32 row indices, read when the job runs.
        indices: View,
    },
    /// `out = src` converted.
    Cast {
        /// Source.
        src: View,
        /// Destination.
        out: View,
    },
}

impl CpuDevice {
    /// Checks [`ActivationArgs`].
    pub(crate) fn prepare_activation(
        &self,
        args: &ActivationArgs,
    ) -> Result<ElementwiseJob, PluginError> {
        const OP: &str = "activation";
        let lens = self.lens();
        let (x, out) = validate::activation(&Checker::new(OP, &lens), args)?;
        Ok(ElementwiseJob::Activation {
            x: View::new(self, OP, "x", &x)?,
            out: View::new(self, OP, "out", &out)?,
            act: args.activation,
        })
    }

    /// Checks [`BinaryArgs`].
    pub(crate) fn prepare_binary(&self, args: &BinaryArgs) -> Result<ElementwiseJob, PluginError> {
        const OP: &str = "binary";
        let lens = self.lens();
        let checked = validate::binary(&Checker::new(OP, &lens), args)?;
        Ok(ElementwiseJob::Binary {
            a: View::new(self, OP, "a", &checked.a)?,
            b: View::new(self, OP, "b", &checked.b)?,
            out: View::new(self, OP, "out", &checked.out)?,
            op: args.op,
            broadcast: checked.broadcast,
        })
    }

    /// Checks [`GatherArgs`] (the indices themselves are device data, checked when the job
    /// runs).
    pub(crate) fn prepare_gather(&self, args: &GatherArgs) -> Result<ElementwiseJob, PluginError> {
        const OP: &str = "gather_rows";
        let lens = self.lens();
        let (src, out, indices) = validate::gather_rows(&Checker::new(OP, &lens), args)?;
        Ok(ElementwiseJob::Gather {
            src: View::new(self, OP, "src", &src)?,
            out: View::new(self, OP, "out", &out)?,
            indices: View::new(self, OP, "indices", &indices)?,
        })
    }

    /// Checks [`CastArgs`].
    pub(crate) fn prepare_cast(&self, args: &CastArgs) -> Result<ElementwiseJob, PluginError> {
        const OP: &str = "cast";
        let lens = self.lens();
        let (src, out) = validate::cast(&Checker::new(OP, &lens), args)?;
        Ok(ElementwiseJob::Cast {
            src: View::new(self, OP, "src", &src)?,
            out: View::new(self, OP, "out", &out)?,
        })
    }
}

impl Touches for ElementwiseJob {
    fn touches(&self) -> Vec<Touch> {
        match self {
            ElementwiseJob::Activation { x, out, .. } => vec![x.touch(), out.touch()],
            ElementwiseJob::Binary { a, b, out, .. } => vec![a.touch(), b.touch(), out.touch()],
            ElementwiseJob::Gather { src, out, indices } => {
                vec![src.touch(), out.touch(), indices.touch()]
            }
            ElementwiseJob::Cast { src, out } => vec![src.touch(), out.touch()],
        }
    }
}

impl ElementwiseJob {
    /// Runs the op on `exec`'s pool.
    pub(crate) fn run(&self, exec: &Exec) -> Result<(), PluginError> {
        match self {
            ElementwiseJob::Activation { x, out, act } => activation(exec, x, out, *act),
            ElementwiseJob::Binary {
                a,
                b,
                out,
                op,
                broadcast,
            } => binary(exec, a, b, out, *op, *broadcast),
            ElementwiseJob::Gather { src, out, indices } => gather(exec, src, out, indices),
            ElementwiseJob::Cast { src, out } => cast(exec, src, out),
        }
    }
}

fn activation(exec: &Exec, x: &View, out: &View, act: Activation) -> Result<(), PluginError> {
    with_elem!("activation", x.dtype, T => {
        exec.par_rows(x.rows, x.cols, x.cols, |rows, scratch| {
            for r in rows {
                // SAFETY: each task owns its rows of `out`; `x` is `out` exactly or disjoint
                // from it, and is read before the row is written.
                unsafe { x.load_row::<T>(r, scratch) };
                math::activate_slice(act, scratch);
                // SAFETY: as above.
                unsafe { out.store_row::<T>(r, scratch) };
            }
        });
        Ok(())
    })
}

fn binary(
    exec: &Exec,
    a: &View,
    b: &View,
    out: &View,
    op: BinaryOp,
    broadcast: bool,
) -> Result<(), PluginError> {
    let cols = a.cols;
    with_elem!("binary", a.dtype, T => {
        let mut row_b = vec![0.0f32; if broadcast { cols } else { 0 }];
        if broadcast && a.rows > 0 {
            // SAFETY: a broadcast `b` is disjoint from `out` (checked), so nothing writes it.
            unsafe { b.load_row::<T>(0, &mut row_b) };
        }
        exec.par_rows(a.rows, cols, 2 * cols, |rows, scratch| {
            let (sa, sb) = scratch.split_at_mut(cols);
            for r in rows {
                // SAFETY: each task owns its rows of `out`; `a` and `b` are `out` exactly or
                // disjoint from it, and both rows are read before the row is written.
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

fn gather(exec: &Exec, src: &View, out: &View, indices: &View) -> Result<(), PluginError> {
    const OP: &str = "gather_rows";
    let index_row: &[i32] = if out.rows == 0 {
        &[]
    } else {
        // SAFETY: `indices` is an i32 `[1, len]` view disjoint from `out` (checked), and the
        // queue orders this read after the work that wrote it.
        unsafe { indices.i32_row() }
    };
    // A bad index is device data the host vouched for: its row becomes zeros (never a read
    // outside `src`) and the op reports the first one.
    let bad = index_row
        .iter()
        .enumerate()
        .find(|(_, i)| usize::try_from(**i).map_or(true, |i| i >= src.rows));
    // Rows are moved, never converted: copying their bytes serves every dtype the ABI lets
    // `src` have, integers as well as floats.
    let size = src
        .dtype
        .size()
        .and_then(|size| usize::try_from(size).ok())
        .ok_or_else(|| invalid(OP, format!("`src`: unknown dtype {:?}", src.dtype)))?;
    let row_bytes = src.cols * size;
    exec.par_rows(out.rows, out.cols, 0, |rows, _| {
        for r in rows {
            // SAFETY: row `r < out.rows` of the validated `out` view, whose rows start
            // `stride` elements of `size` bytes apart and hold `cols` elements; each task owns
            // its rows, and `out` overlaps neither `src` nor `indices` (checked).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out.addr().add(r * out.stride * size), row_bytes)
            };
            match usize::try_from(index_row[r]) {
                Ok(from) if from < src.rows => {
                    // SAFETY: row `from < src.rows` of the validated `src` view, which has
                    // `out`'s dtype and columns; `src` is disjoint from `out`.
                    let row = unsafe {
                        std::slice::from_raw_parts(
                            src.addr().add(from * src.stride * size),
                            row_bytes,
                        )
                    };
                    dst.copy_from_slice(row);
                }
                // Zero bytes are zero in every dtype.
                _ => dst.fill(0),
            }
        }
    });
    match bad {
        Some((i, index)) => Err(invalid(
            OP,
            format!(
                "`indices`[{i}] = {index} is out of range for `src` with {} rows",
                src.rows
            ),
        )),
        None => Ok(()),
    }
}

fn cast(exec: &Exec, src: &View, out: &View) -> Result<(), PluginError> {
    if src.buf == out.buf && src.dtype == out.dtype && std::ptr::eq(src.addr(), out.addr()) {
        // The same view of one dtype: nothing to convert.
        return Ok(());
    }
    let cols = src.cols;
    with_elem!("cast", src.dtype, S => {
        with_elem!("cast", out.dtype, D => {
            exec.par_rows(src.rows, cols, cols, |rows, scratch| {
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
