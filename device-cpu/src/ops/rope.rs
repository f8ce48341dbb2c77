//! Qwen-VL's 2-D (axial) rotary position embedding, in place.
//!
//! With `q = head_dim / 4` frequencies `f_i = 1 / theta^(2i / (head_dim / 2))` (computed in f32
//! as transformers does), channel `c < head_dim / 2` of every head rotates by `row · f_c` when
//! `c < q` and by `col · f_(c-q)` otherwise, together with channel `c + head_dim / 2`.
//! Positions in vision towers are small and repeat across tokens, so cos/sin are tabulated per
//! position value when that table is no larger than computing them per token.

use iris_plugin::abi::{PluginError, Rope2dArgs};

use super::{View, with_elem};
use crate::device::CpuDevice;
use crate::error::invalid;

impl CpuDevice {
    /// [`Rope2dArgs`], in place on `x`.
    pub(crate) fn rope_2d_impl(&self, args: &Rope2dArgs<'_>) -> Result<(), PluginError> {
        const OP: &str = "rope_2d";
        let x = View::new(self, OP, "x", &args.x)?;
        let positions = args.positions.as_slice();
        let too_big = |what: &str, value: u64| {
            invalid(OP, format!("`{what}`: {value} does not fit in memory"))
        };
        let heads = usize::try_from(args.heads).map_err(|_| too_big("heads", args.heads))?;
        let head_dim =
            usize::try_from(args.head_dim).map_err(|_| too_big("head_dim", args.head_dim))?;
        if head_dim == 0 || !head_dim.is_multiple_of(4) {
            return Err(invalid(
                OP,
                format!("`head_dim`: expected a positive multiple of 4, got {head_dim}"),
            ));
        }
        if heads.checked_mul(head_dim) != Some(x.cols) {
            return Err(invalid(
                OP,
                format!(
                    "`heads` {heads} x `head_dim` {head_dim} does not equal `x`'s {} columns",
                    x.cols
                ),
            ));
        }
        if Some(positions.len()) != x.rows.checked_mul(2) {
            return Err(invalid(
                OP,
                format!(
                    "`positions`: expected 2 x {} tokens = {} values, got {}",
                    x.rows,
                    x.rows.saturating_mul(2),
                    positions.len()
                ),
            ));
        }
        if !(args.theta > 0.0 && args.theta.is_finite()) {
            return Err(invalid(
                OP,
                format!("`theta`: expected a finite value > 0, got {}", args.theta),
            ));
        }
        let quarter = head_dim / 4;
        let half = head_dim / 2;
        let freqs: Vec<f32> = (0..quarter)
            .map(|i| {
                // Small integers: exact in f32. Matches `arange(0, dim, 2) / dim`.
                #[allow(clippy::cast_precision_loss)]
                let exponent = (2 * i) as f32 / half as f32;
                1.0 / args.theta.powf(exponent)
            })
            .collect();
        let max_pos = positions.iter().copied().max().unwrap_or(0) as usize;
        // Table of (cos, sin) for every position value up to `max_pos`, when cheaper than
        // computing per token.
        let table: Option<Vec<(f32, f32)>> = (max_pos < 2 * x.rows).then(|| {
            (0..=max_pos)
                .flat_map(|p| freqs.iter().map(move |f| angle(p, *f)))
                .collect()
        });
        let table = table.as_deref();
        with_elem!(OP, x.dtype, T => {
            // Per row: the row in f32, then cos and sin per rotated channel pair.
            self.par_rows(x.rows, x.cols, x.cols + 2 * half, |rows, scratch| {
                let (row, rest) = scratch.split_at_mut(x.cols);
                let (cos, sin) = rest.split_at_mut(half);
                for r in rows {
                    let (pr, pc) = (positions[2 * r] as usize, positions[2 * r + 1] as usize);
                    for (c, (cs, sn)) in cos.iter_mut().zip(sin.iter_mut()).enumerate() {
                        let (p, i) = if c < quarter { (pr, c) } else { (pc, c - quarter) };
                        (*cs, *sn) = match table {
                            Some(table) => table[p * quarter + i],
                            None => angle(p, freqs[i]),
                        };
                    }
                    // SAFETY: each task owns its rows of `x`, read before written.
                    unsafe { x.load_row::<T>(r, row) };
                    for head in row.chunks_exact_mut(head_dim) {
                        let (x1, x2) = head.split_at_mut(half);
                        for c in 0..half {
                            let (a, b) = (x1[c], x2[c]);
                            x1[c] = a * cos[c] - b * sin[c];
                            x2[c] = b * cos[c] + a * sin[c];
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

/// `(cos, sin)` of `position · freq`, the angle taken in f32.
fn angle(position: usize, freq: f32) -> (f32, f32) {
    // Positions are u32 values; their rounding to f32 is the rounding transformers applies.
    #[allow(clippy::cast_precision_loss)]
    let a = position as f32 * freq;
    (a.cos(), a.sin())
}
