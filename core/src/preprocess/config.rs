//! Processor options (what changes the output) and decode limits (what is refused).

use super::PreprocessError;

/// The CLIP normalization mean used by Qwen2-VL and Qwen2.5-VL (`OPENAI_CLIP_MEAN`).
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// The CLIP normalization std used by Qwen2-VL and Qwen2.5-VL (`OPENAI_CLIP_STD`).
// The digits are transformers' own, to be checked by eye; they round to the same f32.
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];
/// `1 / 255`, the rescale factor every Qwen-VL processor ships (as a Python float).
pub const RESCALE_1_255: f64 = 1.0 / 255.0;
/// The aspect-ratio limit of `smart_resize`.
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// What happens to an alpha channel when an image is converted to RGB.
///
/// Part of the item hash: the modes give different pixels for a transparent image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AlphaMode {
    /// Paste onto a background of this colour with the alpha channel as the mask (Pillow's
    /// `Image.paste(im, mask=alpha)`): what vLLM's `convert_image_mode` does with any image
    /// that has transparency, white unless `media_io_kwargs` set `rgba_background_color`.
    /// The default, so that iris sees the picture a vLLM encoder would.
    PasteOn([u8; 3]),
    /// Discard alpha, keeping the stored colour of each pixel: Pillow's `convert("RGB")`, which
    /// is what transformers 4.x's image processors did.
    Drop,
    /// Composite onto a white background with Pillow's `alpha_composite` arithmetic:
    /// transformers 5.x's `convert_to_rgb` (vLLM pastes instead: [`AlphaMode::PasteOn`]).
    CompositeWhite,
}

impl AlphaMode {
    /// vLLM's default: paste onto white.
    pub const VLLM_DEFAULT: Self = Self::PasteOn([255, 255, 255]);
}

impl Default for AlphaMode {
    fn default() -> Self {
        Self::VLLM_DEFAULT
    }
}

/// Options of the Qwen-VL image processor (Hugging Face's `Qwen2VLImageProcessor`): everything
/// that changes `pixel_values`. Build one from a preset and adjust fields, or from a checkpoint's
/// `preprocessor_config.json` (`min_pixels`/`max_pixels` or `size.shortest_edge`/
/// `size.longest_edge`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    /// Spatial patch side in pixels (14 for Qwen2/2.5-VL, 16 for Qwen3-VL).
    pub patch_size: u32,
    /// Patches merged per side into one embedding token (2).
    pub merge_size: u32,
    /// Frames per temporal patch; an image is repeated to this many frames (2).
    pub temporal_patch_size: u32,
    /// Lower bound on resized pixels (`size.shortest_edge` in newer configs).
    pub min_pixels: u64,
    /// Upper bound on resized pixels (`size.longest_edge` in newer configs).
    pub max_pixels: u64,
    /// Per-channel mean subtracted after rescaling.
    pub image_mean: [f32; 3],
    /// Per-channel std divided by after subtracting the mean.
    pub image_std: [f32; 3],
    /// Factor applied to 0..=255 values before normalizing (`1/255`).
    pub rescale_factor: f64,
    /// How alpha is removed.
    pub alpha: AlphaMode,
}

impl ProcessorConfig {
    /// Qwen2-VL and Qwen2.5-VL as published: patch 14, merge 2, temporal 2, CLIP mean/std,
    /// `min_pixels` 3136, `max_pixels` 12845056.
    #[must_use]
    pub fn qwen2_vl() -> Self {
        Self {
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 16384,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            rescale_factor: RESCALE_1_255,
            alpha: AlphaMode::VLLM_DEFAULT,
        }
    }

    /// Qwen2.5-VL: the same processor settings as [`ProcessorConfig::qwen2_vl`].
    #[must_use]
    pub fn qwen2_5_vl() -> Self {
        Self::qwen2_vl()
    }

    /// Qwen3-VL as published: patch 16, merge 2, temporal 2, mean/std 0.5, shortest/longest
    /// edge 65536 / 16777216 pixels.
    #[must_use]
    pub fn qwen3_vl() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: RESCALE_1_255,
            alpha: AlphaMode::VLLM_DEFAULT,
        }
    }

    /// The side every resized dimension is a multiple of: `patch_size * merge_size`.
    #[must_use]
    pub fn factor(&self) -> u32 {
        self.patch_size.saturating_mul(self.merge_size)
    }

    /// Values per row of `pixel_values`: `3 * temporal_patch_size * patch_size^2`.
    #[must_use]
    pub fn patch_dim(&self) -> usize {
        let p = self.patch_size as usize;
        CHANNELS * self.temporal_patch_size as usize * p * p
    }

    /// Checks that every option is usable.
    ///
    /// # Errors
    /// [`PreprocessError::InvalidConfig`] naming the first bad option.
    pub fn validate(&self) -> Result<(), PreprocessError> {
        let bad = |field: &'static str, value: String, reason: &'static str| {
            Err(PreprocessError::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.patch_size == 0 || self.patch_size > MAX_PATCH_SIZE {
            return bad(
                "patch_size",
                self.patch_size.to_string(),
                "must be in 1..=1024",
            );
        }
        if self.merge_size == 0 || self.merge_size > MAX_MERGE_SIZE {
            return bad(
                "merge_size",
                self.merge_size.to_string(),
                "must be in 1..=64",
            );
        }
        if self.temporal_patch_size == 0 || self.temporal_patch_size > MAX_TEMPORAL {
            return bad(
                "temporal_patch_size",
                self.temporal_patch_size.to_string(),
                "must be in 1..=64",
            );
        }
        if self.min_pixels > self.max_pixels {
            return bad(
                "min_pixels",
                format!("{} (max_pixels {})", self.min_pixels, self.max_pixels),
                "must not exceed max_pixels",
            );
        }
        if self.max_pixels == 0 {
            return bad("max_pixels", "0".into(), "must be positive");
        }
        // With no lower bound, a side shorter than half the factor rounds to 0 pixels.
        if self.min_pixels == 0 {
            return bad("min_pixels", "0".into(), "must be positive");
        }
        for (i, s) in self.image_std.iter().enumerate() {
            if !s.is_finite() || *s == 0.0 {
                return bad(
                    "image_std",
                    format!("{s} (channel {i})"),
                    "must be finite and non-zero",
                );
            }
        }
        if self.image_mean.iter().any(|m| !m.is_finite()) {
            return bad(
                "image_mean",
                format!("{:?}", self.image_mean),
                "must be finite",
            );
        }
        if !self.rescale_factor.is_finite() {
            return bad(
                "rescale_factor",
                self.rescale_factor.to_string(),
                "must be finite",
            );
        }
        Ok(())
    }
}

impl Default for ProcessorConfig {
    fn default() -> Self {
        Self::qwen2_vl()
    }
}

/// Limits checked against the image header before any pixel is decoded, and passed to the
/// decoder as a second line of defence. They refuse decompression bombs; they do not change the
/// output and are not part of the item hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest accepted width.
    pub max_width: u32,
    /// Largest accepted height.
    pub max_height: u32,
    /// Largest accepted `width * height`.
    pub max_pixels: u64,
    /// Most bytes the decoder may allocate.
    pub max_alloc: u64,
}

impl Default for DecodeLimits {
    /// 32768 per side and Pillow's decompression-bomb error threshold (`2 * MAX_IMAGE_PIXELS`
    /// = 178956970 pixels); 1 GiB of decoder allocations (an RGBA image at the pixel limit).
    fn default() -> Self {
        Self {
            max_width: 32_768,
            max_height: 32_768,
            max_pixels: 178_956_970,
            max_alloc: 1 << 30,
        }
    }
}

pub(crate) const CHANNELS: usize = 3;
const MAX_PATCH_SIZE: u32 = 1024;
const MAX_MERGE_SIZE: u32 = 64;
const MAX_TEMPORAL: u32 = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_differ_where_published() {
        let q2 = ProcessorConfig::qwen2_vl();
        let q3 = ProcessorConfig::qwen3_vl();
        q2.validate().unwrap();
        q3.validate().unwrap();
        assert_eq!(q2.factor(), 28);
        assert_eq!(q3.factor(), 32);
        assert_eq!(q2.patch_dim(), 1176);
        assert_eq!(q3.patch_dim(), 1536);
        assert_eq!(ProcessorConfig::qwen2_5_vl(), q2);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let mut c = ProcessorConfig::qwen2_vl();
        c.patch_size = 0;
        assert!(matches!(
            c.validate(),
            Err(PreprocessError::InvalidConfig {
                field: "patch_size",
                ..
            })
        ));
        let mut c = ProcessorConfig::qwen2_vl();
        c.min_pixels = c.max_pixels + 1;
        assert!(matches!(
            c.validate(),
            Err(PreprocessError::InvalidConfig {
                field: "min_pixels",
                ..
            })
        ));
        let mut c = ProcessorConfig::qwen2_vl();
        c.image_std[1] = 0.0;
        assert!(matches!(
            c.validate(),
            Err(PreprocessError::InvalidConfig {
                field: "image_std",
                ..
            })
        ));
    }
}
