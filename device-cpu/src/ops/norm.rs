//! Layer normalisation and RMS normalisation over rows, in f32.

use iris_plugin::abi::{NormArgs, PluginError};

use super::{View, alias_or_disjoint, math, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;

/// Which normalisation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Layer,
    Rms,
}

impl CpuDevice {
    /// [`NormArgs`] as a layer norm (biased variance, optional bias).
    pub(crate) fn layer_norm_impl(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.norm(Kind::Layer, "layer_norm", args)
    }

    /// [`NormArgs`] as an RMS norm (no bias).
    pub(crate) fn rms_norm_impl(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.norm(Kind::Rms, "rms_norm", args)
    }

    fn norm(&self, kind: Kind, op: &str, args: &NormArgs) -> Result<(), PluginError> {
        let x = View::new(self, op, "x", &args.x)?;
        let weight = View::new(self, op, "weight", &args.weight)?;
        let bias = if args.bias.is_none() {
            None
        } else if kind == Kind::Rms {
            return Err(invalid(
                op,
                "`bias` must be absent (MatRef::NONE) for RMS norm",
            ));
        } else {
            Some(View::new(self, op, "bias", &args.bias)?)
        };
        let out = View::new(self, op, "out", &args.out)?;
        let cols = x.cols;
        weight.expect_dtype(op, "weight", x.dtype, "x")?;
        weight.expect_shape(op, "weight", 1, cols)?;
        if let Some(bias) = &bias {
            bias.expect_dtype(op, "bias", x.dtype, "x")?;
            bias.expect_shape(op, "bias", 1, cols)?;
        }
        out.expect_dtype(op, "out", x.dtype, "x")?;
        out.expect_shape(op, "out", x.rows, cols)?;
        alias_or_disjoint(op, "out", &out, "x", &x)?;
        // An output overlapping the parameters would change them while other rows read them.
        super::disjoint(op, "out", &out, "weight", &weight)?;
        if let Some(bias) = &bias {
            super::disjoint(op, "out", &out, "bias", bias)?;
        }
        if !(args.eps >= 0.0 && args.eps.is_finite()) {
            return Err(invalid(
                op,
                format!("`eps`: expected a finite value >= 0, got {}", args.eps),
            ));
        }
        if x.rows == 0 || cols == 0 {
            return Ok(());
        }
        let eps = args.eps;
        // `cols` fits in memory, and f32 represents such counts closely enough for a mean.
        #[allow(clippy::cast_precision_loss)]
        let inv_n = 1.0 / cols as f32;
        with_elem!(op, x.dtype, T => {
            let mut w = vec![0.0f32; cols];
            let mut b = vec![0.0f32; if bias.is_some() { cols } else { 0 }];
            // SAFETY: parameters are disjoint from `out` (checked), so nothing writes them.
            unsafe {
                weight.load_row::<T>(0, &mut w);
                if let Some(bias) = &bias {
                    bias.load_row::<T>(0, &mut b);
                }
            }
            let b = bias.as_ref().map(|_| b.as_slice());
            self.par_rows(x.rows, cols, cols, |rows, row| {
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
