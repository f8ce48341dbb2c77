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

/// Compiles `$body` for AVX-512, AVX2+FMA and the baseline, and dispatches at run time. The
/// body is generic over its [`MulAdd`], named by the function's one type parameter: fused on the
/// two FMA levels, a multiply and an add on the baseline (which has no FMA instruction, where
/// `f32::mul_add` would be a library call).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$m:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic<$m: MulAdd>($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                fn v4($($arg: $ty),*) $(-> $ret)? {
                    generic::<Fused>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) $(-> $ret)? {
                    generic::<Fused>($($arg),*)
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
            generic::<Separate>($($arg),*)
        }
    };
}

/// `a·b + c` as a kernel's instruction set computes it. Rust never contracts `a * b + c` into
/// one instruction, so without this the exp's polynomial is a chain of multiplies and adds twice
/// as long as on an FMA unit.
pub(crate) trait MulAdd {
    /// `a·b + c`.
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// One fused multiply-add, rounded once: for code compiled with the `fma` feature.
pub(crate) struct Fused;

impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// A multiply, then an add: for code compiled without the `fma` feature.
pub(crate) struct Separate;

impl MulAdd for Separate {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// `e^x` in f32, about 1 ulp; NaN propagates, results saturate below `e^-87` and above `e^88`.
/// For scalar code outside the vector kernels.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    exp_with::<Separate>(x)
}

/// [`exp`] with `M`'s multiply-adds.
#[inline(always)]
fn exp_with<M: MulAdd>(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer (to nearest even) held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const MAGIC_BITS: u32 = 0x4B40_0000;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = M::mul_add(x, std::f32::consts::LOG2_E, MAGIC);
    let n = t - MAGIC;
    let r = M::mul_add(n, -LN2_LO, M::mul_add(n, -LN2_HI, x));
    let mut p = 1.987_569_1e-4;
    p = M::mul_add(p, r, 1.398_199_9e-3);
    p = M::mul_add(p, r, 8.333_452e-3);
    p = M::mul_add(p, r, 4.166_579_6e-2);
    p = M::mul_add(p, r, 1.666_666_5e-1);
    p = M::mul_add(p, r, 0.5);
    let e = M::mul_add(p, r * r, r + 1.0);
    // n lies in [-126, 127] after the clamp, so n + 127 is a valid biased exponent.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(MAGIC_BITS).wrapping_add(127) << 23);
    e * scale
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
fn sigmoid<M: MulAdd>(x: f32) -> f32 {
    1.0 / (1.0 + exp_with::<M>(-x))
}

/// The scalar definition of every activation, in f32.
#[inline(always)]
fn activate<M: MulAdd>(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GELU_ERF => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::GELU_TANH => gelu_tanh::<M>(x),
        Activation::QUICK_GELU => x * sigmoid::<M>(1.702 * x),
        Activation::SILU => x * sigmoid::<M>(x),
        _ => x,
    }
}

/// `0.5·x·(1 + tanh(z))` written as `x·sigmoid(2z)`, the same function without tanh's
/// cancellation near zero.
#[inline(always)]
fn gelu_tanh<M: MulAdd>(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let z = SQRT_2_OVER_PI * M::mul_add(0.044_715 * x * x, x, x);
    x * sigmoid::<M>(2.0 * z)
}

multiversion! {
    /// Applies `act` to every element (the identity for [`Activation::NONE`]). The activation
    /// must be one this ABI defines; callers validate it.
    pub(crate) fn activate_slice<M>(act: Activation, xs: &mut [f32]) {
        match act {
            Activation::GELU_ERF => {
                // libm's erff is scalar; the merger's GELU is a small share of the tower.
                for x in xs.iter_mut() {
                    *x = activate::<M>(Activation::GELU_ERF, *x);
                }
            }
            Activation::GELU_TANH => xs.iter_mut().for_each(|x| *x = gelu_tanh::<M>(*x)),
            Activation::QUICK_GELU => xs.iter_mut().for_each(|x| *x *= sigmoid::<M>(1.702 * *x)),
            Activation::SILU => xs.iter_mut().for_each(|x| *x *= sigmoid::<M>(*x)),
            _ => {}
        }
    }
}

multiversion! {
    /// `dst[i] += src[i]`.
    pub(crate) fn add_assign<M>(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
        }
    }
}

multiversion! {
    /// `dst[i] *= src[i]`.
    pub(crate) fn mul_assign<M>(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d *= *s;
        }
    }
}

multiversion! {
    /// `dst[i] *= factor`.
    pub(crate) fn scale<M>(dst: &mut [f32], factor: f32) {
        for d in dst.iter_mut() {
            *d *= factor;
        }
    }
}

/// Reduces lane-wise partial results by halves, so that the reduction vectorises: a plain
/// left-to-right loop is one serial chain (its f32 additions cannot be reordered), and at the
/// row lengths of attention's scores that chain costs as much as the row itself.
#[inline(always)]
fn fold<const N: usize>(acc: &mut [f32; N], op: impl Fn(f32, f32) -> f32) -> f32 {
    const { assert!(N.is_power_of_two(), "halving covers every lane") };
    let mut width = N / 2;
    while width > 0 {
        let (low, high) = acc.split_at_mut(width);
        for (a, b) in low.iter_mut().zip(&high[..width]) {
            *a = op(*a, *b);
        }
        width /= 2;
    }
    acc[0]
}

multiversion! {
    /// The largest element, ignoring NaN (`-inf` for an empty or all-NaN slice).
    pub(crate) fn max<M>(xs: &[f32]) -> f32 {
        // Four registers of partial maxima: a max's latency would otherwise bound the loop
        // (attention's softmax calls this on every row of scores).
        let mut acc = [f32::NEG_INFINITY; 4 * LANES];
        let chunks = xs.chunks_exact(4 * LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (a, x) in acc.iter_mut().zip(chunk) {
                // One `maxps` per register: a NaN `x` keeps `a`.
                *a = if *x > *a { *x } else { *a };
            }
        }
        let mut best = fold(&mut acc, |a, b| if b > a { b } else { a });
        for x in tail {
            best = if *x > best { *x } else { best };
        }
        best
    }
}

multiversion! {
    /// Replaces each element by `e^(x - shift)` and returns their sum.
    pub(crate) fn exp_shifted_sum<M>(xs: &mut [f32], shift: f32) -> f32 {
        let mut acc = [0.0f32; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (a, x) in acc.iter_mut().zip(chunk.iter_mut()) {
                *x = exp_with::<M>(*x - shift);
                *a += *x;
            }
        }
        let mut sum = 0.0;
        for x in chunks.into_remainder() {
            *x = exp_with::<M>(*x - shift);
            sum += *x;
        }
        sum + fold(&mut acc, |a, b| a + b)
    }
}

multiversion! {
    /// Sum and sum of squares of `xs - center`, in f32 with lane-wise partial sums.
    pub(crate) fn centered_moments<M>(xs: &[f32], center: f32) -> (f32, f32) {
        let mut sum = [0.0f32; LANES];
        let mut sq = [0.0f32; LANES];
        let chunks = xs.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for ((s, q), x) in sum.iter_mut().zip(sq.iter_mut()).zip(chunk) {
                let d = *x - center;
                *s += d;
                *q = M::mul_add(d, d, *q);
            }
        }
        let (mut s, mut q) = (0.0f32, 0.0f32);
        for x in tail {
            let d = *x - center;
            s += d;
            q += d * d;
        }
        let add = |a: f32, b: f32| a + b;
        (s + fold(&mut sum, add), q + fold(&mut sq, add))
    }
}

multiversion! {
    /// `xs[i] = (xs[i] - center) · inv · weight[i] (+ bias[i])`.
    pub(crate) fn normalize<M>(xs: &mut [f32], center: f32, inv: f32, weight: &[f32], bias: Option<&[f32]>) {
        match bias {
            Some(bias) => {
                for ((x, w), b) in xs.iter_mut().zip(weight).zip(bias) {
                    *x = M::mul_add((*x - center) * inv, *w, *b);
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

    /// Every instruction set this CPU runs (fused multiply-adds on AVX2 and AVX-512, separate
    /// ones on the baseline) computes the vector kernels to within a few ulp of f64, at lengths
    /// off every vector and accumulator width.
    #[test]
    fn each_instruction_set_matches_f64() {
        use crate::isa::{Simd, with_simd};
        let sigmoid = |t: f64| 1.0 / (1.0 + (-t).exp());
        for simd in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            if !simd.supported() {
                eprintln!("skipping {}: this CPU lacks it", simd.name());
                continue;
            }
            for len in [1usize, 7, 16, 63, 64, 65, 200, 256] {
                let xs: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
                let wide: Vec<f64> = xs.iter().copied().map(f64::from).collect();
                let name = format!("{} at length {len}", simd.name());
                let want_max = wide.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                assert_eq!(f64::from(with_simd(simd, || max(&xs))), want_max, "{name}");
                let mut e = xs.clone();
                let sum = with_simd(simd, || exp_shifted_sum(&mut e, 1.5));
                let want: Vec<f64> = wide.iter().map(|x| (x - 1.5).exp()).collect();
                for (got, want) in e.iter().zip(&want) {
                    assert!((f64::from(*got) / want - 1.0).abs() < 1e-6, "exp, {name}");
                }
                let want_sum: f64 = want.iter().sum();
                assert!(
                    (f64::from(sum) / want_sum - 1.0).abs() < 1e-6,
                    "sum, {name}"
                );
                let (s, q) = with_simd(simd, || centered_moments(&xs, 0.25));
                let want_s: f64 = wide.iter().map(|x| x - 0.25).sum();
                let want_q: f64 = wide.iter().map(|x| (x - 0.25).powi(2)).sum();
                assert!((f64::from(s) - want_s).abs() < 1e-4, "moments, {name}");
                assert!(
                    (f64::from(q) / want_q - 1.0).abs() < 1e-6,
                    "moments, {name}"
                );
                let mut act = xs.clone();
                with_simd(simd, || activate_slice(Activation::QUICK_GELU, &mut act));
                for (got, x) in act.iter().zip(&wide) {
                    let want = x * sigmoid(1.702 * x);
                    assert!((f64::from(*got) - want).abs() < 1e-5, "quick-GELU, {name}");
                }
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
