//! Kernel tiers: which instruction set the device's bf16 matrix products run on.
//!
//! The best tier the CPU supports is picked at open; [`ISA_ENV`] (or the `isa` option) forces a
//! lower one, so one machine can test every tier it has. A tier the CPU lacks is clamped to the
//! best one it has, with a warning naming both.
//!
//! - `amx`: bf16 products on AMX-BF16 tiles (`tdpbf16ps`, [`crate::ops::amx`]), the rest of
//!   the bf16 work (conversions, attention's softmax) on AVX-512. Needs the OS to grant tile
//!   data, which is requested once per process; when it refuses, the tier is not offered.
//! - `avx512bf16`: bf16 products on `vdpbf16ps` (pairs of bf16 multiplied and summed into f32
//!   lanes), weights packed into pairs-of-bf16 panels ([`crate::ops::native`]).
//! - `widened`: bf16 operands widened to f32 and multiplied by the `gemm` crate.
//!
//! f32 and f16 products run on the `gemm` crate in every tier. The `gemm` crate picks its own
//! instruction set at run time (AVX-512F where present, else AVX2 with FMA, else scalar code) and
//! offers no way to ask for a lower one, so a tier below the CPU's best cannot make it run
//! another: there is one tier for the widened path, not one per instruction set, and the device
//! reports what the `gemm` crate runs as its `gemm_isa` property. The names `avx512` and
//! `generic`, two tiers that ran the same code, are accepted for `widened`.

use std::fmt;

/// Environment variable that forces a kernel tier (`amx`, `avx512bf16`, `widened`).
pub const ISA_ENV: &str = "IRIS_CPU_ISA";

/// A kernel tier, ordered from the most portable to the most specialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// bf16 widened to f32 and multiplied by the `gemm` crate, on the instruction set it picks.
    Widened,
    /// AVX512-BF16 dot products on packed bf16 weights.
    Avx512Bf16,
    /// AMX-BF16 tiles on packed bf16 weights.
    Amx,
}

impl Tier {
    /// Every tier, most portable first.
    pub const ALL: [Tier; 3] = [Tier::Widened, Tier::Avx512Bf16, Tier::Amx];

    /// The name [`ISA_ENV`] takes and `kernel_tier` reports.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Widened => "widened",
            Tier::Avx512Bf16 => "avx512bf16",
            Tier::Amx => "amx",
        }
    }

    /// Parses a tier name (surrounding blanks and case ignored); `avx512` and `generic` name
    /// the widened tier.
    pub fn parse(value: &str) -> Option<Tier> {
        let value = value.trim().to_ascii_lowercase();
        if matches!(value.as_str(), "avx512" | "generic") {
            return Some(Tier::Widened);
        }
        Tier::ALL.into_iter().find(|tier| tier.name() == value)
    }

    /// Whether this CPU has the instructions the tier's kernels need (for AMX: and the OS
    /// granted tile data; the first call asks for it).
    pub fn supported(self) -> bool {
        match self {
            Tier::Widened => true,
            Tier::Avx512Bf16 => has_avx512_bf16(),
            Tier::Amx => has_avx512_bf16() && crate::ops::amx::usable(),
        }
    }

    /// The best tier the CPU supports.
    pub fn best() -> Tier {
        [Tier::Amx, Tier::Avx512Bf16]
            .into_iter()
            .find(|tier| tier.supported())
            .unwrap_or(Tier::Widened)
    }

    /// The tier to run when `requested` is asked for: itself when the CPU supports it, else the
    /// best tier below it, with a note saying why.
    pub fn resolve(requested: Tier) -> (Tier, Option<String>) {
        let best = Tier::best();
        if requested <= best {
            return (requested, None);
        }
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
            best,
            Some(format!(
                "kernel tier `{}` requested but {why}: using `{}`",
                requested.name(),
                best.name()
            )),
        )
    }

    /// The CPU features the tier needs, for messages.
    pub fn features(self) -> &'static str {
        match self {
            Tier::Widened => "nothing",
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

/// The instruction set the `gemm` crate's f32 kernels run on this CPU, by the same test it
/// makes (built with its `x86-v4` feature): `avx512f`, `avx2+fma` or `scalar`.
#[cfg(target_arch = "x86_64")]
pub fn gemm_isa() -> &'static str {
    if std::arch::is_x86_feature_detected!("avx512f") {
        "avx512f"
    } else if std::arch::is_x86_feature_detected!("fma") {
        "avx2+fma"
    } else {
        "scalar"
    }
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

/// The instruction set the `gemm` crate's f32 kernels run (not x86-64: its own choice, NEON on
/// aarch64).
#[cfg(not(target_arch = "x86_64"))]
pub fn gemm_isa() -> &'static str {
    "the gemm crate's own"
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
    fn names_round_trip_and_unknown_names_are_refused() {
        for tier in Tier::ALL {
            assert_eq!(Tier::parse(tier.name()), Some(tier));
        }
        assert_eq!(Tier::parse(" AVX512BF16 "), Some(Tier::Avx512Bf16));
        assert_eq!(Tier::parse("sse2"), None);
        // The two names of tiers that ran the same code name the one widened tier.
        assert_eq!(Tier::parse("avx512"), Some(Tier::Widened));
        assert_eq!(Tier::parse("generic"), Some(Tier::Widened));
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
    }
}
