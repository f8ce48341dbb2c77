//! Image preprocessing for the Qwen-VL vision towers, equal to Hugging Face's
//! `Qwen2VLImageProcessor` (the PIL implementation).
//!
//! The pipeline, one pure function per step:
//!
//! 1. [`probe`]: detect PNG/JPEG/WebP/GIF/BMP/TIFF from the leading bytes and read the
//!    dimensions from the header; refuse anything over [`DecodeLimits`] before a pixel is
//!    decoded (its default pixel limit is vLLM's `VLLM_MAX_IMAGE_PIXELS` default).
//! 2. [`decode_rgb`]: decode to 8-bit RGB as vLLM's `ImageMediaIO` does: EXIF orientation
//!    applied, alpha pasted onto a background (white by default), dropped or composited onto
//!    white, per [`AlphaMode`]. [`needs_rgb_conversion`] tells from the header whether vLLM
//!    converts the image's mode (which its item identifier records).
//! 3. [`smart_resize`]: the target size, multiples of `patch * merge` within
//!    `[min_pixels, max_pixels]`, with Python's float arithmetic and round-half-to-even.
//! 4. [`resize_bicubic`]: Pillow's bicubic resampling, bit for bit.
//! 5. [`patchify`]: rescale by 1/255, normalize with mean/std, repeat the frame
//!    `temporal_patch_size` times and emit rows of `3 * temporal * patch * patch` values in
//!    merge-window order, with `grid_thw`.
//!
//! [`preprocess`] runs them all and returns a [`PreprocessedImage`], which also carries the item
//! hash: blake3 over the decoded RGB pixels, their dimensions and every [`ProcessorConfig`]
//! option that changes the output.
//!
//! The EXIF orientation is applied, as vLLM (and transformers' `load_image`) applies it before
//! the processor sees the image. Nothing here touches a device, and no input bytes can make it
//! panic.

mod config;
mod decode;
mod error;
mod patchify;
mod resize;
pub mod video;

#[cfg(test)]
mod golden_tests;

pub use config::{
    AlphaMode, CLIP_MEAN, CLIP_STD, DecodeLimits, MAX_ASPECT_RATIO, ProcessorConfig, RESCALE_1_255,
};
pub use decode::{
    ImageInfo, SourceFormat, composite_on_white, decode_rgb, needs_rgb_conversion, paste_on, probe,
};
pub use error::PreprocessError;
pub use patchify::patchify;
pub use resize::{resize_bicubic, resize_bicubic_aa_u8, smart_resize};

/// Width and height in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageSize {
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

impl ImageSize {
    /// A size of `width x height`.
    #[must_use]
    pub const fn new(width: u32, height: u32) -> Self {
        Self { width, height }
    }

    /// `width * height`.
    #[must_use]
    pub fn pixel_count(self) -> usize {
        self.width as usize * self.height as usize
    }
}

/// An 8-bit RGB image, rows top to bottom, pixels interleaved `R G B`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Dimensions.
    pub size: ImageSize,
    /// `width * height * 3` bytes.
    pub pixels: Vec<u8>,
}

/// One item ready for the vision tower: an image, or a video's frames in temporal groups.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessedImage {
    /// `grid_t * grid_h * grid_w` rows of [`ProcessorConfig::patch_dim`] values, row-major.
    pub pixel_values: Vec<f32>,
    /// `[t, h / patch, w / patch]`, as the processor's `image_grid_thw`.
    pub grid_thw: [u32; 3],
    /// Size of the decoded image.
    pub original_size: ImageSize,
    /// Size after `smart_resize`.
    pub resized_size: ImageSize,
    /// Embedding tokens the tower produces for it: `t * h * w / merge^2`.
    pub tokens: u32,
    /// Item hash, 64 lowercase hex digits (see [`item_hash`]; for a video,
    /// [`video::video_hash`]).
    pub hash: String,
    /// An image, or a video whose frames were cut into temporal groups (`grid_thw[0]` of them).
    pub modality: crate::budget::Modality,
}

impl PreprocessedImage {
    /// Number of rows of `pixel_values` (patches before merging).
    #[must_use]
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().map(|&v| v as usize).product()
    }
}

/// Decodes and preprocesses one encoded image (PNG, JPEG or WebP bytes).
///
/// # Errors
/// Every [`PreprocessError`]: an invalid config, an unsupported format, a header over `limits`,
/// a corrupt body, a zero size, an aspect ratio over 200.
///
/// ```
/// use iris_core::preprocess::{preprocess, DecodeLimits, ImageSize, ProcessorConfig};
/// # let mut png = Vec::new();
/// # image::ImageEncoder::write_image(image::codecs::png::PngEncoder::new(&mut png),
/// #     &[128u8; 40 * 30 * 3], 40, 30, image::ExtendedColorType::Rgb8).unwrap();
/// let out = preprocess(&png, &ProcessorConfig::qwen2_vl(), &DecodeLimits::default()).unwrap();
/// // 40x30 is below min_pixels (3136): scaled up to 84x56, a 6x4 grid of 14-pixel patches.
/// assert_eq!(out.resized_size, ImageSize::new(84, 56));
/// assert_eq!(out.grid_thw, [1, 4, 6]);
/// assert_eq!(out.tokens, 6);
/// assert_eq!(out.pixel_values.len(), 24 * 1176);
/// ```
pub fn preprocess(
    bytes: &[u8],
    config: &ProcessorConfig,
    limits: &DecodeLimits,
) -> Result<PreprocessedImage, PreprocessError> {
    config.validate()?;
    let (_, rgb) = decode_rgb(bytes, limits, config.alpha)?;
    preprocess_rgb(&rgb, config)
}

/// Preprocesses an already decoded RGB image (steps 3 to 5).
///
/// # Errors
/// [`PreprocessError::InvalidConfig`], [`PreprocessError::ZeroSize`],
/// [`PreprocessError::AspectRatio`], [`PreprocessError::ResizeOverflow`].
pub fn preprocess_rgb(
    rgb: &RgbImage,
    config: &ProcessorConfig,
) -> Result<PreprocessedImage, PreprocessError> {
    config.validate()?;
    if rgb.pixels.len() != rgb.size.pixel_count() * config::CHANNELS {
        return Err(PreprocessError::InvalidConfig {
            field: "pixels",
            value: format!(
                "{} bytes for {}x{}",
                rgb.pixels.len(),
                rgb.size.width,
                rgb.size.height
            ),
            reason: "an RGB image needs width * height * 3 bytes",
        });
    }
    let resized_size = smart_resize(
        rgb.size,
        config.factor(),
        config.min_pixels,
        config.max_pixels,
    )?;
    let resized = resize_bicubic(rgb, resized_size);
    let (pixel_values, grid_thw) = patchify(&resized, config)?;
    let merge_area = u64::from(config.merge_size) * u64::from(config.merge_size);
    let patches: u64 = grid_thw.iter().map(|&v| u64::from(v)).product();
    let tokens =
        u32::try_from(patches / merge_area).map_err(|_| PreprocessError::ResizeOverflow {
            orig_width: rgb.size.width,
            orig_height: rgb.size.height,
            width: u64::from(resized_size.width),
            height: u64::from(resized_size.height),
        })?;
    Ok(PreprocessedImage {
        pixel_values,
        grid_thw,
        original_size: rgb.size,
        resized_size,
        tokens,
        hash: item_hash(rgb, config),
        modality: crate::budget::Modality::Image,
    })
}

/// Feeds `h` the processor settings that change `pixel_values` of any item: patch, merge and
/// temporal sizes, min/max pixels, mean, std, rescale factor.
pub(crate) fn hash_settings(h: &mut blake3::Hasher, config: &ProcessorConfig) {
    h.update(&config.patch_size.to_le_bytes());
    h.update(&config.merge_size.to_le_bytes());
    h.update(&config.temporal_patch_size.to_le_bytes());
    h.update(&config.min_pixels.to_le_bytes());
    h.update(&config.max_pixels.to_le_bytes());
    for v in config.image_mean.iter().chain(&config.image_std) {
        h.update(&v.to_bits().to_le_bytes());
    }
    h.update(&config.rescale_factor.to_bits().to_le_bytes());
}

/// The item hash: blake3 over a version tag, the decoded image's dimensions and RGB bytes, and
/// every option that changes `pixel_values` (patch, merge and temporal sizes, min/max pixels,
/// mean, std, rescale factor, alpha mode). Decode limits are not part of it: they refuse
/// images but never change one. Returned as 64 lowercase hex digits.
#[must_use]
pub fn item_hash(rgb: &RgbImage, config: &ProcessorConfig) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"iris.preprocess.image.v1\0");
    h.update(&rgb.size.width.to_le_bytes());
    h.update(&rgb.size.height.to_le_bytes());
    h.update(&rgb.pixels);
    hash_settings(&mut h, config);
    match config.alpha {
        AlphaMode::Drop => h.update(&[0]),
        AlphaMode::CompositeWhite => h.update(&[1]),
        AlphaMode::PasteOn(bg) => h.update(&[2, bg[0], bg[1], bg[2]]),
    };
    h.finalize().to_hex().to_string()
}
