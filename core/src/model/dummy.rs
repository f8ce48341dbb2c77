//! Dummy weights: deterministic pseudo-random values, like vLLM's `--load-format dummy`, for
//! benchmarks and memory profiling without a checkpoint.
//!
//! Each tensor draws from its own generator, seeded by the seed and the tensor's name, so a
//! tensor's values do not depend on which other tensors exist or in which order they are made.
//! Values are drawn in f32 and rounded to the run dtype, so f16 and bf16 weights are the f32
//! ones rounded.
//!
//! Ranges keep activations in a normal range through any depth (unlike vLLM's ±1e-3, which
//! makes every output nearly zero): matrices and biases `U(-1/√fan_in, 1/√fan_in)` as PyTorch's
//! `nn.Linear` initialises them, norm scales `1 + U(-0.02, 0.02)`, norm shifts and embeddings
//! `U(-0.02, 0.02)`.

use std::collections::BTreeMap;

use iris_plugin::DType;

use super::ModelError;
use super::config::VisionConfig;
use super::weights::{HostTensor, HostWeights, TensorKind, encode_f32};

/// The seed `iris` uses when none is given.
pub const DUMMY_DEFAULT_SEED: u64 = 0;

/// Spread of norm parameters and embeddings around their centre.
const SMALL_RANGE: f32 = 0.02;

/// Deterministic dummy weights for `config` in `dtype`.
pub fn dummy_weights(
    config: &VisionConfig,
    dtype: DType,
    seed: u64,
) -> Result<HostWeights, ModelError> {
    dummy_weights_with_progress(config, dtype, seed, &mut |_| {})
}

/// [`dummy_weights`], calling `made_bytes` with the bytes made so far after each tensor.
pub(crate) fn dummy_weights_with_progress(
    config: &VisionConfig,
    dtype: DType,
    seed: u64,
    made_bytes: &mut dyn FnMut(u64),
) -> Result<HostWeights, ModelError> {
    if dtype.size().is_none() {
        return Err(ModelError::UnsupportedDtype { dtype });
    }
    config.validate()?;
    let mut tensors = BTreeMap::new();
    let mut done = 0u64;
    for spec in config.weight_specs() {
        let values = dummy_values(seed, &spec.name, spec.numel(), spec.kind);
        let bytes = encode_f32(&values, dtype);
        done += bytes.len() as u64;
        made_bytes(done);
        tensors.insert(
            spec.name,
            HostTensor {
                dtype,
                shape: spec.shape,
                bytes,
            },
        );
    }
    Ok(HostWeights::new(
        dtype,
        tensors,
        format!("dummy (seed {seed})"),
    ))
}

/// The f32 values of one dummy tensor.
pub(crate) fn dummy_values(seed: u64, name: &str, numel: usize, kind: TensorKind) -> Vec<f32> {
    let (centre, half_width) = match kind {
        TensorKind::Matrix { fan_in } | TensorKind::Bias { fan_in } => {
            (0.0, 1.0 / (fan_in.max(1) as f32).sqrt())
        }
        TensorKind::NormWeight => (1.0, SMALL_RANGE),
        TensorKind::NormBias | TensorKind::Embedding => (0.0, SMALL_RANGE),
    };
    let mut rng = SplitMix64::new(seed ^ fnv1a(name.as_bytes()));
    (0..numel)
        .map(|_| centre + half_width * (2.0 * rng.next_unit() - 1.0))
        .collect()
}

/// FNV-1a, 64-bit: a stable hash of the tensor name (std's hasher is not stable across
/// releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough for weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 bits, every value exactly representable in f32.
    fn next_unit(&mut self) -> f32 {
        let bits = u32::try_from(self.next_u64() >> 40).unwrap_or(0); // < 2^24 always fits
        bits as f32 / 16_777_216.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_on_name_and_seed_only() {
        let k = TensorKind::Matrix { fan_in: 64 };
        let a = dummy_values(7, "blocks.0.attn.qkv.weight", 100, k);
        assert_eq!(a, dummy_values(7, "blocks.0.attn.qkv.weight", 100, k));
        assert_ne!(a, dummy_values(8, "blocks.0.attn.qkv.weight", 100, k));
        assert_ne!(a, dummy_values(7, "blocks.1.attn.qkv.weight", 100, k));
        // A prefix of a longer draw: the count does not change earlier values.
        assert_eq!(
            &dummy_values(7, "blocks.0.attn.qkv.weight", 250, k)[..100],
            &a[..]
        );
    }

    #[test]
    fn ranges() {
        let w = dummy_values(1, "w", 10_000, TensorKind::Matrix { fan_in: 100 });
        assert!(w.iter().all(|v| v.abs() <= 0.1));
        let mean: f32 = w.iter().sum::<f32>() / w.len() as f32;
        assert!(mean.abs() < 0.005, "mean {mean}");
        let spread = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            spread > 0.09,
            "values should fill the range, max |v| = {spread}"
        );
        let n = dummy_values(1, "n", 1000, TensorKind::NormWeight);
        assert!(n.iter().all(|v| (v - 1.0).abs() <= SMALL_RANGE));
        let b = dummy_values(1, "b", 1000, TensorKind::NormBias);
        assert!(b.iter().all(|v| v.abs() <= SMALL_RANGE));
    }
}
