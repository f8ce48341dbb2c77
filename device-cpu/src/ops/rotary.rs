//! Rotary position embedding from cos/sin tables, in place: every head `h` of token `t`
//! becomes `h · cos[t] + rotate_half(h) · sin[t]`, computed in f32.
//!
//! The tables come from the host (one `[tokens, head_dim]` pair per step, reused by every
//! layer), so this op does no trigonometry: it is one pass over `x`.

use iris_plugin::abi::{PluginError, RotaryArgs};
use iris_plugin::validate::{self, Checker};

use super::{Touch, Touches, View, with_elem};
use crate::device::CpuDevice;
use crate::queue::Exec;

impl CpuDevice {
    /// Checks [`RotaryArgs`] and resolves the operands.
    pub(crate) fn prepare_rotary(&self, args: &RotaryArgs) -> Result<RotaryJob, PluginError> {
        const OP: &str = "rotary";
        let lens = self.lens();
        let checked = validate::rotary(&Checker::new(OP, &lens), args)?;
        Ok(RotaryJob {
            x: View::new(self, OP, "x", &checked.x)?,
            cos: View::new(self, OP, "cos", &checked.cos)?,
            sin: View::new(self, OP, "sin", &checked.sin)?,
            head_dim: checked.head_dim,
        })
    }
}

/// A checked rotary embedding.
pub(crate) struct RotaryJob {
    x: View,
    cos: View,
    sin: View,
    head_dim: usize,
}

impl Touches for RotaryJob {
    fn touches(&self) -> Vec<Touch> {
        vec![self.x.touch(), self.cos.touch(), self.sin.touch()]
    }
}

impl RotaryJob {
    /// Rotates every head of every row of `x` on `exec`'s pool.
    pub(crate) fn run(&self, exec: &Exec) -> Result<(), PluginError> {
        let RotaryJob {
            x,
            cos,
            sin,
            head_dim,
        } = self;
        let (head_dim, half) = (*head_dim, *head_dim / 2);
        with_elem!("rotary", x.dtype, T => {
            exec.par_rows(x.rows, x.cols, x.cols, |rows, row| {
                for r in rows {
                    // SAFETY: the tables are f32 views disjoint from `x` (checked), which
                    // nothing writes during the op.
                    let (c, s) = unsafe { (cos.row::<f32>(r), sin.row::<f32>(r)) };
                    // SAFETY: each task owns its rows of `x`, read before written.
                    unsafe { x.load_row::<T>(r, row) };
                    for head in row.chunks_exact_mut(head_dim) {
                        let (x1, x2) = head.split_at_mut(half);
                        for i in 0..half {
                            let (a, b) = (x1[i], x2[i]);
                            x1[i] = a * c[i] - b * s[i];
                            x2[i] = b * c[half + i] + a * s[half + i];
                        }
                    }
                    // SAFETY: as above.
                    unsafe { x.store_row::<T>(r, row) };
                }
            });
            Ok(())
        })
    }
}
