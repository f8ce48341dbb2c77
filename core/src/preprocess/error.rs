//! Errors of image preprocessing.

/// Why an image could not be preprocessed. Every variant names the numbers involved; none is
/// reachable as a panic.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PreprocessError {
    /// The bytes are not PNG, JPEG or WebP. `detected` names what the signature looks like
    /// ("GIF", "BMP", ...) or says that no known signature matched.
    #[error(
        "unsupported image format: detected {detected}; accepted formats are PNG, JPEG and WebP"
    )]
    UnsupportedFormat {
        /// The format found from the leading bytes.
        detected: String,
    },
    /// The header announces an image larger than the configured decode limits. Raised from the
    /// header alone, before any pixel data is decoded.
    #[error("image too large: {width}x{height} exceeds the {limit_name} limit of {limit}")]
    TooLarge {
        /// Width from the header.
        width: u32,
        /// Height from the header.
        height: u32,
        /// Which limit: "max_width", "max_height", "max_pixels" or "max_alloc" (bytes).
        limit_name: &'static str,
        /// The limit's value.
        limit: u64,
    },
    /// The bytes claim a supported format but cannot be decoded (truncated, corrupt).
    #[error("cannot decode {format} image: {message}")]
    Decode {
        /// The format the bytes claim to be.
        format: &'static str,
        /// The decoder's description of the problem.
        message: String,
    },
    /// Width or height is zero.
    #[error("image has zero size: {width}x{height}")]
    ZeroSize {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
    },
    /// `max(w, h) / min(w, h)` exceeds the processor's limit (200 for the Qwen-VL processors).
    #[error("aspect ratio {ratio} of {width}x{height} exceeds the limit of {max_ratio}")]
    AspectRatio {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// `max(w, h) / min(w, h)`.
        ratio: f64,
        /// The limit.
        max_ratio: f64,
    },
    /// The size `smart_resize` computes does not fit the integer types used downstream.
    #[error("resized size {width}x{height} of a {orig_width}x{orig_height} image is too large")]
    ResizeOverflow {
        /// Original width.
        orig_width: u32,
        /// Original height.
        orig_height: u32,
        /// Computed width (saturated).
        width: u64,
        /// Computed height (saturated).
        height: u64,
    },
    /// A processor option is out of range.
    #[error("invalid processor config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The option's name, as in `preprocessor_config.json`.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}
