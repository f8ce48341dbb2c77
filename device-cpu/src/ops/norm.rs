//! Layer normalisation and RMS normalisation over rows, in f32.

use iris_plugin::abi::{NormArgs, PluginError};
use iris_plugin::validate::{self, Checker};

use super::{Touch, Touches, View, math, with_elem};
use crate::device::CpuDevice;
use crate::queue::Exec;

/// Which normalisation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Layer,
    Rms,
}

impl CpuDevice {
    /// Checks [`NormArgs`] for a layer norm (`rms` false) or an RMS norm, and resolves the
    /// operands.
    pub(crate) fn prepare_norm(&self, args: &NormArgs, rms: bool) -> Result<NormJob, PluginError> {
        let op = if rms { "rms_norm" } else { "layer_norm" };
        let lens = self.lens();
        let checked = validate::norm(&Checker::new(op, &lens), args, rms)?;
        Ok(NormJob {
            kind: if rms { Kind::Rms } else { Kind::Layer },
            x: View::new(self, op, "x", &checked.x)?,
            weight: View::new(self, op, "weight", &checked.weight)?,
            bias: View::optional(self, op, "bias", checked.bias.as_ref())?,
            out: View::new(self, op, "out", &checked.out)?,
            eps: args.eps,
        })
    }
}

/// A checked normalisation.
pub(crate) struct NormJob {
    kind: Kind,
    x: View,
    weight: View,
    bias: Option<View>,
    out: View,
    eps: f32,
}

impl Touches for NormJob {
    fn touches(&self) -> Vec<Touch> {
        let mut touched = vec![self.x.touch(), self.weight.touch(), self.out.touch()];
        touched.extend(self.bias.as_ref().map(View::touch));
        touched
    }
}

impl NormJob {
    /// Normalises every row on `exec`'s pool.
    pub(crate) fn run(&self, exec: &Exec) -> Result<(), PluginError> {
        let NormJob {
            kind,
            x,
            weight,
            bias,
            out,
            eps,
        } = self;
        let (kind, eps, cols) = (*kind, *eps, x.cols);
        let op = "norm";
        if x.rows == 0 || cols == 0 {
            return Ok(());
        }
        // `cols` fits in memory, and f32 represents such counts closely enough for a mean.
        #[allow(clippy::cast_precision_loss)]
        let inv_n = 1.0 / cols as f32;
        with_elem!(op, x.dtype, T => {
            let mut w = vec![0.0f32; cols];
            let mut b = vec![0.0f32; if bias.is_some() { cols } else { 0 }];
            // SAFETY: parameters are disjoint from `out` (checked), so nothing writes them.
            unsafe {
                weight.load_row::<T>(0, &mut w);
                if let Some(bias) = bias {
                    bias.load_row::<T>(0, &mut b);
                }
            }
            let b = bias.as_ref().map(|_| b.as_slice());
            exec.par_rows(x.rows, cols, cols, |rows, row| {
                for r in rows {
                    // SAFETY: each task owns its rows of `out`; `x` is `out` exactly or
                    // disjoint from it, and is read before the row is written.
                    unsafe { x.load_row::<T>(r, row) };
                    let (center, inv) = match kind {
                        Kind::Layer => {
                            // Two passes (mean, then squared deviations) for stability.
                            let (sum, _) = math::centered_moments(row, 0.0);
                            let mean = sum * inv_n;
                            let (dev, sq) = math::centered_moments(row, mean);
                            let dm = dev * inv_n;
                            let var = (sq * inv_n - dm * dm).max(0.0);
                            (mean, 1.0 / (var + eps).sqrt())
                        }
                        Kind::Rms => {
                            let (_, sq) = math::centered_moments(row, 0.0);
                            (0.0, 1.0 / (sq * inv_n + eps).sqrt())
                        }
                    };
                    math::normalize(row, center, inv, &w, b);
                    // SAFETY: as above.
                    unsafe { out.store_row::<T>(r, row) };
                }
            });
            Ok(())
        })
    }
}
