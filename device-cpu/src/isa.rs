//! Kernel tiers: which instruction sets the device's kernels run on.
//!
//! The best tier the CPU supports is picked at open, except that `avx512bf16` is passed over
//! where its `vdpbf16ps` is measured slower than f32 FMAs on widened bf16 ([`bf16_dot_speed`]);
//! [`ISA_ENV`] (or the `isa` option) forces any tier, so one machine can measure every tier it
//! has. A tier the CPU lacks is clamped to the
//! best one it has, with a warning naming both.
//!
//! Each tier fixes two things: the vector instruction set ([`Simd`]) that every f32 kernel runs
//! on (the f32 and f16 matrix products, attention, activations, norms and reductions), and the
//! bf16 matrix product.
//!
//! - `amx`: bf16 products on AMX-BF16 tiles (`tdpbf16ps`, [`crate::ops::amx`]), the rest on
//!   AVX-512. Needs the OS to grant tile data, which is requested once per process; when it
//!   refuses, the tier is not offered.
//! - `avx512bf16`: bf16 products on `vdpbf16ps` (pairs of bf16 multiplied and summed into f32
//!   lanes), weights packed into pairs-of-bf16 panels ([`crate::ops::native`]); the rest on
//!   AVX-512.
//! - `avx512`: everything on AVX-512F; bf16 products on f32 FMAs over the same packed weights,
//!   each pair widened in registers ([`crate::ops::fma`]). Also spelled `widened`.
//! - `avx2`: everything on AVX2 with FMA; bf16 products as on `avx512`, on 8-lane vectors.
//! - `generic`: the baseline instruction set of the build (on x86-64, SSE2 and scalar code);
//!   bf16 operands converted to f32 for the `gemm` crate.
//!
//! The matrix products run on the `gemm` crate's kernels, called per instruction set through
//! [`crate::ops::gemm`]'s own entry point rather than the crate's run-time choice (which would
//! take AVX-512 wherever the CPU has it). Outside x86-64 the `gemm` crate picks its own kernels
//! and only `generic` is offered. A tier's vector code reaches the kernels through a per-thread
//! setting ([`active`]) that the device's threads take from the tier.

use std::cell::Cell;
use std::fmt;

/// Environment variable that forces a kernel tier (`amx`, `avx512bf16`, `avx512`, `avx2`,
/// `generic`).
pub const ISA_ENV: &str = "IRIS_CPU_ISA";

/// A kernel tier, ordered from the most portable to the most specialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// The build's baseline instruction set; bf16 converted to f32 for the `gemm` crate.
    Generic,
    /// AVX2 with FMA; bf16 products on f32 FMAs over packed bf16 weights.
    Avx2,
    /// AVX-512F; bf16 products on f32 FMAs over packed bf16 weights.
    Avx512,
    /// AVX512-BF16 dot products on packed bf16 weights, AVX-512F for the rest.
    Avx512Bf16,
    /// AMX-BF16 tiles on packed bf16 weights, AVX-512F for the rest.
    Amx,
}

/// The vector instruction set f32 kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Simd {
    /// The build's baseline (x86-64: SSE2); the `gemm` crate's scalar kernels on x86-64, its own
    /// choice elsewhere.
    Baseline,
    /// AVX2 with FMA, 8 f32 lanes.
    Avx2,
    /// AVX-512F (with VL for the compiler's narrower forms), 16 f32 lanes.
    Avx512,
}

impl Simd {
    /// The name the device reports as its `gemm_isa` property.
    pub fn name(self) -> &'static str {
        match self {
            Simd::Baseline if cfg!(target_arch = "x86_64") => "scalar",
            Simd::Baseline => "the gemm crate's own",
            Simd::Avx2 => "avx2+fma",
            Simd::Avx512 => "avx512f",
        }
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        match self {
            Simd::Baseline => true,
            Simd::Avx2 => has_avx2_fma(),
            Simd::Avx512 => has_avx512(),
        }
    }

    /// The best this CPU runs.
    pub fn best() -> Simd {
        [Simd::Avx512, Simd::Avx2]
            .into_iter()
            .find(|simd| simd.supported())
            .unwrap_or(Simd::Baseline)
    }
}

thread_local! {
    /// The instruction set the kernels on this thread may use; `None`: the best the CPU runs.
    static ACTIVE: Cell<Option<Simd>> = const { Cell::new(None) };
}

/// The instruction set kernels on this thread run: the tier's, on a device's threads (see
/// [`with_simd`]); the best the CPU runs elsewhere.
pub fn active() -> Simd {
    ACTIVE.get().unwrap_or_else(Simd::best)
}

/// Runs `f` with the kernels on this thread limited to `simd` (which the CPU must run; a
/// higher one is clamped to the best it runs), then restores the previous setting.
pub fn with_simd<R>(simd: Simd, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Simd>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ACTIVE.set(self.0);
        }
    }
    let _restore = Restore(ACTIVE.replace(Some(simd.min(Simd::best()))));
    f()
}

/// Limits this thread's kernels to `simd` for the thread's life (for a pool's workers).
pub(crate) fn set_thread_simd(simd: Simd) {
    ACTIVE.set(Some(simd.min(Simd::best())));
}

impl Tier {
    /// Every tier, most portable first.
    pub const ALL: [Tier; 5] = [
        Tier::Generic,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Bf16,
        Tier::Amx,
    ];

    /// The name [`ISA_ENV`] takes and `kernel_tier` reports.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Generic => "generic",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Bf16 => "avx512bf16",
            Tier::Amx => "amx",
        }
    }

    /// Parses a tier name (surrounding blanks and case ignored); `widened`, the name of the
    /// widened-bf16 tier before it was split by instruction set, names `avx512`.
    pub fn parse(value: &str) -> Option<Tier> {
        let value = value.trim().to_ascii_lowercase();
        if value == "widened" {
            return Some(Tier::Avx512);
        }
        Tier::ALL.into_iter().find(|tier| tier.name() == value)
    }

    /// The vector instruction set the tier's f32 kernels run on.
    pub fn simd(self) -> Simd {
        match self {
            Tier::Generic => Simd::Baseline,
            Tier::Avx2 => Simd::Avx2,
            Tier::Avx512 | Tier::Avx512Bf16 | Tier::Amx => Simd::Avx512,
        }
    }

    /// Whether this CPU has the instructions the tier's kernels need (for AMX: and the OS
    /// granted tile data; the first call asks for it).
    pub fn supported(self) -> bool {
        match self {
            Tier::Generic => true,
            // Outside x86-64 the `gemm` crate chooses for itself: only `generic` is honest.
            Tier::Avx2 | Tier::Avx512 => self.simd().supported(),
            Tier::Avx512Bf16 => has_avx512_bf16(),
            Tier::Amx => has_avx512_bf16() && crate::ops::amx::usable(),
        }
    }

    /// The tier the device runs unless told otherwise: the best the CPU supports, except that
    /// `avx512bf16` is passed over where `vdpbf16ps` is slow ([`bf16_dot_speed`] below
    /// [`MIN_BF16_DOT_SPEED`]): there bf16 products run faster on `avx512`'s f32 FMAs.
    pub fn best() -> Tier {
        Tier::best_of(Tier::supported, bf16_dot_speed)
    }

    /// [`Tier::best`] for a CPU described by `supported` and a measured dot-product speed
    /// (asked for only when `avx512bf16` is a candidate).
    fn best_of(supported: impl Fn(Tier) -> bool, dot_speed: impl FnOnce() -> Option<f64>) -> Tier {
        let mut dot_speed = Some(dot_speed);
        Tier::ALL
            .into_iter()
            .rev()
            .filter(|tier| supported(*tier))
            .find(|tier| {
                *tier != Tier::Avx512Bf16
                    || dot_speed
                        .take()
                        .and_then(|measure| measure())
                        .is_none_or(|speed| speed >= MIN_BF16_DOT_SPEED)
            })
            .unwrap_or(Tier::Generic)
    }

    /// Why [`Tier::best`] passed over a supported tier, if it did (for `iris devices` and the
    /// open log).
    pub fn best_note() -> Option<String> {
        let speed = bf16_dot_speed()?;
        (Tier::Avx512Bf16.supported() && !Tier::Amx.supported() && speed < MIN_BF16_DOT_SPEED).then(
            || {
                format!(
                    "kernel tier `avx512bf16` passed over: `vdpbf16ps` runs at {speed:.2}x the f32 \
                     multiply-add rate on this CPU, so bf16 products are faster on f32 FMAs \
                     (`avx512`); {ISA_ENV}=avx512bf16 or the `isa` option selects it anyway"
                )
            },
        )
    }

    /// The tier to run when `requested` is asked for: itself when the CPU supports it, else the
    /// one [`Tier::best`] would pick among the tiers below it, with a note saying why.
    pub fn resolve(requested: Tier) -> (Tier, Option<String>) {
        if requested.supported() {
            return (requested, None);
        }
        // The default among the tiers below it (so a slow dot product is passed over here too).
        let used = Tier::best_of(|tier| tier < requested && tier.supported(), bf16_dot_speed);
        let why = match requested {
            Tier::Amx if has_amx() && has_avx512_bf16() => {
                "the OS refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)".to_owned()
            }
            Tier::Amx if has_amx() => {
                "this CPU lacks AVX512-BF16, which the AMX tier also runs on".to_owned()
            }
            _ => format!("this CPU lacks {}", requested.features()),
        };
        (
            used,
            Some(format!(
                "kernel tier `{}` requested but {why}: using `{}`",
                requested.name(),
                used.name()
            )),
        )
    }

    /// The CPU features the tier needs, for messages.
    pub fn features(self) -> &'static str {
        match self {
            Tier::Generic => "nothing",
            Tier::Avx2 => "AVX2 and FMA (on x86-64)",
            Tier::Avx512 => "AVX-512F/VL (on x86-64)",
            Tier::Avx512Bf16 => "AVX-512F/BW and AVX512-BF16",
            Tier::Amx => "AMX-TILE and AMX-BF16",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dot-product speed below which [`Tier::best`] passes over `avx512bf16`. Its kernel runs
/// at about 89% of `vdpbf16ps`'s rate on the tower's shapes and `avx512`'s bf16 products at
/// about 70% of the f32 multiply-add rate, so the two break even near 0.8; CPUs sit well to either side
/// (measured 2.0 on AMD Zen 5's full-width units, 0.49 on an Intel Xeon whose `vdpbf16ps`
/// issues every other cycle).
pub const MIN_BF16_DOT_SPEED: f64 = 0.75;

/// The flop rate of `vdpbf16ps` over that of AVX-512 f32 multiply-adds on this CPU, measured
/// once per process on the calling thread (about a millisecond); `None` without AVX512-BF16.
/// Both count two flops per multiply-add, so 1.0 means bf16 products are no faster than f32.
pub fn bf16_dot_speed() -> Option<f64> {
    static SPEED: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    *SPEED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if has_avx512_bf16() {
            return Some(probe::dot_speed());
        }
        None
    })
}

/// The dense f32 FLOP/s one core reaches with `simd`'s multiply-adds (fused where the SIMD has
/// them): the roof the matrix products run against, timed once per process and SIMD level.
/// `None` off x86-64.
pub fn f32_core_roof(simd: Simd) -> Option<f64> {
    static ROOFS: [std::sync::OnceLock<Option<f64>>; 3] = [
        std::sync::OnceLock::new(),
        std::sync::OnceLock::new(),
        std::sync::OnceLock::new(),
    ];
    let slot = match simd {
        Simd::Baseline => 0,
        Simd::Avx2 => 1,
        Simd::Avx512 => 2,
    };
    *ROOFS[slot].get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        return Some(probe::f32_roof(simd));
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

/// Throughput loops: [`roof::CHAINS`] independent chains of one arithmetic instruction each,
/// more than its latency times its ports, nothing loaded from memory. The device times two of
/// them for [`bf16_dot_speed`]; the benches report them as the roof their ops are held against.
#[cfg(target_arch = "x86_64")]
pub mod roof {
    use std::arch::x86_64::*;

    /// Independent accumulators per loop.
    pub const CHAINS: usize = 12;

    /// Defines a loop: `$steps` rounds of `$op` on every chain, then the chains' sum (so the
    /// work cannot be optimised away).
    macro_rules! chain_loop {
        ($(#[$meta:meta])* $name:ident, $feature:literal, $vec:ty, $lanes:literal,
         $one:expr, |$x:ident| $op:expr) => {
            $(#[$meta])*
            ///
            /// # Safety
            #[doc = concat!("The CPU has ", $feature, ".")]
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(steps: u64) -> f32 {
                let mut acc: [$vec; CHAINS] = [$one; CHAINS];
                for _ in 0..steps {
                    for $x in &mut acc {
                        *$x = $op;
                    }
                }
                acc.iter()
                    // SAFETY: a vector of `$lanes` f32 is `$lanes` f32.
                    .map(|x| unsafe { std::mem::transmute::<$vec, [f32; $lanes]>(*x) })
                    .flatten()
                    .sum()
            }
        };
    }

    chain_loop!(
        /// AVX-512 f32 fused multiply-adds: 32 flops per instruction.
        fma_avx512, "avx512f", __m512, 16, _mm512_set1_ps(1.0),
        |x| _mm512_fmadd_ps(*x, _mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7))
    );
    chain_loop!(
        /// AVX2 f32 fused multiply-adds: 16 flops per instruction.
        fma_avx2, "avx2,fma", __m256, 8, _mm256_set1_ps(1.0),
        |x| _mm256_fmadd_ps(*x, _mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7))
    );
    chain_loop!(
        /// SSE2 f32 multiplies and adds (the baseline has no FMA): 8 flops per pair.
        mul_add_sse2, "sse2", __m128, 4, _mm_set1_ps(1.0),
        |x| _mm_add_ps(_mm_mul_ps(*x, _mm_set1_ps(0.999_999)), _mm_set1_ps(1e-7))
    );
    chain_loop!(
        /// AVX512-BF16 `vdpbf16ps` on pairs of bf16 2^-7 (so the sums stay finite): 64 flops
        /// per instruction.
        dot_bf16_avx512, "avx512f,avx512bf16", __m512, 16, _mm512_set1_ps(1.0),
        |x| _mm512_dpbf16_ps(*x, small_pairs(), small_pairs())
    );

    /// Every lane a pair of bf16 2^-7.
    #[inline(always)]
    fn small_pairs() -> __m512bh {
        // SAFETY: plain bit patterns; a bf16 vector is the same 512 bits as an i32 vector.
        unsafe { std::mem::transmute(_mm512_set1_epi32(0x3c00_3c00)) }
    }
}

/// The measurement behind [`bf16_dot_speed`].
#[cfg(target_arch = "x86_64")]
mod probe {
    use std::hint::black_box;
    use std::time::Instant;

    use super::roof;

    /// Instructions per chain and run: about 0.1 ms for f32 at 3 GHz.
    const STEPS: u64 = 20_000;
    /// Runs of each loop, alternating; the fastest of each counts.
    const RUNS: usize = 5;

    /// The speed ratio; AVX-512F, BW and AVX512-BF16 were checked by the caller.
    pub(super) fn dot_speed() -> f64 {
        let (mut fma, mut dot) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..RUNS {
            // SAFETY: the caller checked AVX-512F and AVX512-BF16.
            fma = fma.min(timed(|| unsafe { roof::fma_avx512(black_box(STEPS)) }));
            // SAFETY: as above.
            dot = dot.min(timed(|| unsafe { roof::dot_bf16_avx512(black_box(STEPS)) }));
        }
        // Per instruction: 16 lanes x 2 flops for the FMA, 16 lanes x 2 pairs x 2 for the dot.
        (64.0 / dot) / (32.0 / fma)
    }

    /// FLOP/s of one core running `simd`'s f32 loop; the caller's tier checked the SIMD.
    pub(super) fn f32_roof(simd: super::Simd) -> f64 {
        // Flops per instruction (the baseline's per multiply and add pair).
        let (flops, run): (f64, fn(u64) -> f32) = match simd {
            // SAFETY (each arm): the device runs the tier whose SIMD this is only where the CPU
            // has it (`Tier::supported`).
            super::Simd::Avx512 => (32.0, |steps| unsafe { roof::fma_avx512(steps) }),
            super::Simd::Avx2 => (16.0, |steps| unsafe { roof::fma_avx2(steps) }),
            super::Simd::Baseline => (8.0, |steps| unsafe { roof::mul_add_sse2(steps) }),
        };
        // More runs than the ratio takes: this figure is absolute, and the fastest of a few
        // 0.1 ms runs on a shared machine still varies by some 10%.
        let best = (0..RUNS * 8)
            .map(|_| timed(|| run(black_box(STEPS))))
            .fold(f64::INFINITY, f64::min);
        // `CHAINS` and `STEPS` are small constants, exact in f64.
        flops * roof::CHAINS as f64 * STEPS as f64 / best
    }

    fn timed(f: impl FnOnce() -> f32) -> f64 {
        let start = Instant::now();
        black_box(f());
        start.elapsed().as_secs_f64().max(1e-9)
    }
}

/// AVX2 and FMA: the `gemm` crate's `fma` kernels and the AVX2 builds of the vector code.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// AVX-512F and VL (with AVX2 and FMA, which every such CPU has): the `gemm` crate's `avx512f`
/// kernels and the AVX-512 builds of the vector code.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    has_avx2_fma()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// AVX-512F/BW and AVX512-BF16: what the native bf16 kernels and conversions need.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// AMX-TILE and AMX-BF16 from CPUID leaf 7 (`is_x86_feature_detected!` has no stable AMX
/// names yet). The OS must also grant tile data ([`crate::ops::amx::usable`]).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_amx() -> bool {
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 0 gives the highest leaf, checked first.
    #[allow(unused_unsafe)]
    let leaf7 = unsafe {
        use std::arch::x86_64::__cpuid_count;
        if __cpuid_count(0, 0).eax < 7 {
            return false;
        }
        __cpuid_count(7, 0)
    };
    leaf7.edx & (AMX_BF16 | AMX_TILE) == AMX_BF16 | AMX_TILE
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn has_avx2_fma() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn has_avx512() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn has_avx512_bf16() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn has_amx() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_passes_over_a_slow_dot_product_and_only_that() {
        let all = |_: Tier| true;
        let no_amx = |tier: Tier| tier != Tier::Amx;
        let measured = |speed: f64| move || Some(speed);
        let never = || -> Option<f64> { panic!("measured although avx512bf16 is not a candidate") };
        assert_eq!(Tier::best_of(all, never), Tier::Amx);
        assert_eq!(Tier::best_of(no_amx, measured(2.0)), Tier::Avx512Bf16);
        assert_eq!(Tier::best_of(no_amx, measured(0.75)), Tier::Avx512Bf16);
        assert_eq!(Tier::best_of(no_amx, measured(0.49)), Tier::Avx512);
        // No measurement (no AVX512-BF16 to time): nothing to pass over.
        assert_eq!(Tier::best_of(no_amx, || None), Tier::Avx512Bf16);
        let avx2 = |tier: Tier| tier <= Tier::Avx2;
        assert_eq!(Tier::best_of(avx2, never), Tier::Avx2);
        assert_eq!(Tier::best_of(|t| t == Tier::Generic, never), Tier::Generic);
    }

    #[test]
    fn the_dot_product_speed_is_measured_where_the_cpu_has_it() {
        match bf16_dot_speed() {
            Some(speed) => {
                eprintln!("vdpbf16ps runs at {speed:.2}x the f32 multiply-add rate here");
                assert!(has_avx512_bf16());
                assert!(speed.is_finite() && speed > 0.05 && speed < 20.0, "{speed}");
                // Measured once: the same figure again.
                assert_eq!(bf16_dot_speed(), Some(speed));
                let passed_over = Tier::best_note().is_some();
                assert_eq!(
                    passed_over,
                    !Tier::Amx.supported() && speed < MIN_BF16_DOT_SPEED
                );
                if passed_over {
                    assert_eq!(Tier::best(), Tier::Avx512);
                }
            }
            None => {
                eprintln!("no AVX512-BF16 on this CPU: nothing to measure");
                assert!(!has_avx512_bf16());
            }
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for tier in Tier::ALL {
            assert_eq!(Tier::parse(tier.name()), Some(tier));
        }
        assert_eq!(Tier::parse(" AVX512BF16 "), Some(Tier::Avx512Bf16));
        assert_eq!(Tier::parse("sse2"), None);
        // The widened tier's old name is its AVX-512 form.
        assert_eq!(Tier::parse("widened"), Some(Tier::Avx512));
    }

    #[test]
    fn each_tier_limits_the_vector_code_and_the_setting_is_restored() {
        assert_eq!(Tier::Generic.simd(), Simd::Baseline);
        assert_eq!(Tier::Avx2.simd(), Simd::Avx2);
        for tier in [Tier::Avx512, Tier::Avx512Bf16, Tier::Amx] {
            assert_eq!(tier.simd(), Simd::Avx512);
        }
        let outside = active();
        assert_eq!(outside, Simd::best());
        with_simd(Simd::Baseline, || {
            assert_eq!(active(), Simd::Baseline);
            // A higher level than the CPU runs is clamped.
            with_simd(Simd::Avx512, || assert_eq!(active(), Simd::best()));
            assert_eq!(active(), Simd::Baseline);
        });
        assert_eq!(active(), outside);
    }

    #[test]
    fn forced_tiers_clamp_to_what_the_cpu_runs() {
        let best = Tier::best();
        assert!(best.supported());
        for tier in Tier::ALL {
            let (used, note) = Tier::resolve(tier);
            assert!(used <= tier && used.supported());
            assert_eq!(note.is_some(), used != tier, "{tier}: {note:?}");
            if let Some(note) = note {
                assert!(note.contains(tier.name()) && note.contains(used.name()));
            }
        }
        assert_eq!(Tier::resolve(Tier::Amx).0, best);
        // Every tier's instruction set is one this CPU runs once resolved.
        for tier in Tier::ALL {
            assert!(Tier::resolve(tier).0.simd().supported(), "{tier}");
        }
    }
}
