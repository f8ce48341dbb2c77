//! Vectorised f32 kernels shared by the ops: exp, activations, softmax pieces and reductions.
//!
//! Each public function is compiled three times (AVX-512, AVX2+FMA, baseline) and runs the one
//! of the thread's kernel tier ([`crate::isa::active`]): the loops are written so that the
//! compiler vectorises them, and the `x86-64` baseline alone would leave most of the machine
//! idle. The exp is Cephes' single-precision
//! polynomial (about 1 ulp on its reduced range) with branch-free range reduction, so it
//! vectorises where `f32::exp` (a libm call) cannot.

use iris_plugin::abi::Activation;

/// Lanes of the manual reductions: one AVX-512 register of f32.
const LANES: usize = 16;

/// Compiles `$body` for AVX-512, AVX2+FMA and the baseline, and dispatches at run time.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                fn v4($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                match $crate::isa::active() {
                    // SAFETY: `active` never exceeds what the CPU runs, and `Avx512` includes
                    // AVX-512F/VL, AVX2 and FMA, the features `v4` is compiled for.
                    $crate::isa::Simd::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above, `Avx2` includes AVX2 and FMA.
                    $crate::isa::Simd::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::isa::Simd::Baseline => {}
                }
            }
            generic($($arg),*)
        }
    };
}

/// `e^x` in f32, about 1 ulp; NaN propagates, results saturate below `e^-87` and above `e^88`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer (to nearest even) held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const MAGIC_BITS: u32 = 0x4B40_0000;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n lies in [-126, 127] after the clamp, so n + 127 is a valid biased exponent.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(MAGIC_BITS).wrapping_add(127) << 23);
    e * scale
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The scalar definition of every activation, in f32.
#[inline(always)]
pub(crate) fn activate(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GELU_ERF => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::GELU_TANH => gelu_tanh(x),
        Activation::QUICK_GELU => x * sigmoid(1.702 * x),
        Activation::SILU => x * sigmoid(x),
        _ => x,
    }
}

/// `0.5·x·(1 + tanh(z))` written as `x·sigmoid(2z)`, the same function without tanh's
/// cancellation near zero.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let z = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    x * sigmoid(2.0 * z)
}

multiversion! {
    /// Applies `act` to every element (the identity for [`Activation::NONE`]). The activation
    /// must be one this ABI defines; callers validate it.
    pub(crate) fn activate_slice(act: Activation, xs: &mut [f32]) {
        match act {
            Activation::GELU_ERF => {
                // libm's erff is scalar; the merger's GELU is a small share of the tower.
                for x in xs.iter_mut() {
                    *x = activate(Activation::GELU_ERF, *x);
                }
            }
            Activation::GELU_TANH => xs.iter_mut().for_each(|x| *x = gelu_tanh(*x)),
            Activation::QUICK_GELU => xs.iter_mut().for_each(|x| *x *= sigmoid(1.702 * *x)),
            Activation::SILU => xs.iter_mut().for_each(|x| *x *= sigmoid(*x)),
            _ => {}
        }
    }
}

multiversion! {
    /// `dst[i] += src[i]`.
    pub(crate) fn add_assign(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
        }
    }
}

multiversion! {
    /// `dst[i] *= src[i]`.
    pub(crate) fn mul_assign(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d *= *s;
        }
    }
}

multiversion! {
    /// `dst[i] *= factor`.
    pub(crate) fn scale(dst: &mut [f32], factor: f32) {
        for d in dst.iter_mut() {
            *d *= factor;
        }
    }
}

multiversion! {
    /// The largest element (`-inf` for an empty slice; NaN is ignored unless all are NaN).
    pub(crate) fn max(xs: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (a, x) in acc.iter_mut().zip(chunk) {
                *a = a.max(*x);
            }
        }
        let mut best = f32::NEG_INFINITY;
        for x in acc.iter().chain(tail) {
            best = best.max(*x);
        }
        best
    }
}

multiversion! {
    /// Replaces each element by `e^(x - shift)` and returns their sum.
    pub(crate) fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
        let mut acc = [0.0f32; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (a, x) in acc.iter_mut().zip(chunk.iter_mut()) {
                *x = exp(*x - shift);
                *a += *x;
            }
        }
        let mut sum = 0.0;
        for x in chunks.into_remainder() {
            *x = exp(*x - shift);
            sum += *x;
        }
        sum + acc.iter().sum::<f32>()
    }
}

multiversion! {
    /// Sum and sum of squares of `xs - center`, in f32 with lane-wise partial sums.
    pub(crate) fn centered_moments(xs: &[f32], center: f32) -> (f32, f32) {
        let mut sum = [0.0f32; LANES];
        let mut sq = [0.0f32; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for ((s, q), x) in sum.iter_mut().zip(sq.iter_mut()).zip(chunk) {
                let d = *x - center;
                *s += d;
                *q += d * d;
            }
        }
        let (mut s, mut q) = (0.0f32, 0.0f32);
        for x in tail {
            let d = *x - center;
            s += d;
            q += d * d;
        }
        (s + sum.iter().sum::<f32>(), q + sq.iter().sum::<f32>())
    }
}

multiversion! {
    /// `xs[i] = (xs[i] - center) · inv · weight[i] (+ bias[i])`.
    pub(crate) fn normalize(xs: &mut [f32], center: f32, inv: f32, weight: &[f32], bias: Option<&[f32]>) {
        match bias {
            Some(bias) => {
                for ((x, w), b) in xs.iter_mut().zip(weight).zip(bias) {
                    *x = (*x - center) * inv * *w + *b;
                }
            }
            None => {
                for (x, w) in xs.iter_mut().zip(weight) {
                    *x = (*x - center) * inv * *w;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_to_a_few_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = f64::from(exp(x));
            let want = f64::from(x).exp();
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1000.0) < 1e-37);
    }

    #[test]
    fn activations_match_their_definitions() {
        for i in -400..400 {
            let x = i as f32 * 0.025;
            let xd = f64::from(x);
            let sig = |t: f64| 1.0 / (1.0 + (-t).exp());
            let tanh_form = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            let cases = [
                (Activation::QUICK_GELU, xd * sig(1.702 * xd)),
                (Activation::SILU, xd * sig(xd)),
                (Activation::GELU_TANH, tanh_form),
            ];
            for (act, want) in cases {
                let mut v = [x];
                activate_slice(act, &mut v);
                assert!((f64::from(v[0]) - want).abs() < 2e-6, "{act:?}({x})");
            }
        }
    }

    #[test]
    fn reductions_cover_tails() {
        let mut xs: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin()).collect();
        let m = max(&xs);
        assert_eq!(m, xs.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let want: f64 = xs
            .iter()
            .map(|x| (f64::from(*x) - f64::from(m)).exp())
            .sum();
        let got = exp_shifted_sum(&mut xs, m);
        assert!((f64::from(got) - want).abs() < 1e-5);
    }
}
