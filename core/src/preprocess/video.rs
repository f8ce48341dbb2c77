//! Video preprocessing for the Qwen-VL towers, equal to vLLM 0.33's `qwen2_vl` and `qwen3_vl`
//! video loaders (which frames are read) and transformers' `Qwen2VLVideoProcessor` and
//! `Qwen3VLVideoProcessor` (what those frames become).
//!
//! 1. [`sample_frames`]: the indices a loader reads, from the container's frame count and fps
//!    ([`VideoLoader::Qwen2Vl`]: an even count, `torch.arange` in float32 and truncation;
//!    [`VideoLoader::Qwen3Vl`]: any count, `np.linspace` rounded half to even).
//! 2. [`preprocess_frames`]: every frame resized to one size (Qwen2-VL and Qwen2.5-VL: the
//!    image `smart_resize` of a frame; Qwen3-VL: a `smart_resize` whose pixel budget covers
//!    all frames) with PyTorch's antialiased bicubic ([`resize_bicubic_aa_u8`]), rescaled and
//!    normalized as torchvision does in float32, and cut into rows of `3 x 2 x p x p` values in
//!    merge-window order per temporal group of two frames, the last frame repeated when the
//!    count is odd; with `video_grid_thw`.
//! 3. [`qwen3_timestamps`] and [`second_per_grid_ts`]: the per-group times Qwen3-VL puts in
//!    its prompt and Qwen2.5-VL's temporal step.
//!
//! [`ffmpeg`] decodes clips as vLLM's default OpenCV decoder does, through the FFmpeg programs,
//! and [`ffmpeg::load_video`] runs a loader's sampling on them.
//!
//! The facts, with their sources, are in the project's video reference; the goldens in
//! `core/tests/fixtures/video/` come from vLLM's own loaders and transformers' processors
//! (`tools/video-goldens/make.py`).

pub mod ffmpeg;

use super::{
    ImageSize, PreprocessError, ProcessorConfig, RgbImage, config::CHANNELS, resize_bicubic_aa_u8,
    smart_resize,
};

/// vLLM's ceiling on the sampling rate a request may ask for (`_MAX_FPS`).
pub const MAX_SAMPLING_FPS: f64 = 30.0;
/// vLLM's ceiling on sampled frames (`_MAX_FRAMES`).
pub const MAX_FRAMES: u32 = 768;

/// Which of vLLM's frame loaders a model's video processor selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VideoLoader {
    /// `qwen2_vl`, for `Qwen2VLVideoProcessor` (Qwen2-VL and Qwen2.5-VL).
    Qwen2Vl,
    /// `qwen3_vl`, for `Qwen3VLVideoProcessor`.
    Qwen3Vl,
}

impl VideoLoader {
    /// vLLM's name for the loader (`video_backend` in `media_io_kwargs`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            VideoLoader::Qwen2Vl => "qwen2_vl",
            VideoLoader::Qwen3Vl => "qwen3_vl",
        }
    }
}

/// Sampling settings (`media_io_kwargs.video`): frames per second to sample and the bounds on
/// the count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingOptions {
    /// Frames per second to sample (capped at [`MAX_SAMPLING_FPS`]); vLLM's default 2.
    pub fps: f64,
    /// Fewest frames (4).
    pub min_frames: u32,
    /// Most frames (768, capped at [`MAX_FRAMES`]).
    pub max_frames: u32,
    /// Frames per temporal patch (2): Qwen2-VL's loader samples a multiple of it.
    pub temporal_patch_size: u32,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            fps: 2.0,
            min_frames: 4,
            max_frames: MAX_FRAMES,
            temporal_patch_size: 2,
        }
    }
}

/// Why a video cannot be sampled or processed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum VideoError {
    /// The container has no frames.
    #[error("the video has no frames")]
    NoFrames,
    /// Qwen2-VL's loader needs the source frame rate, which the container does not give.
    #[error(
        "the video's frame rate is unknown (0); the qwen2_vl loader samples by time and needs it"
    )]
    UnknownFrameRate,
    /// Too few frames for the loader (Qwen2-VL's samples an even count, at least 2).
    #[error(
        "a video of {total} frame(s) is too short: the {loader} loader samples at least {needed}"
    )]
    TooFewFrames {
        /// Frames in the video.
        total: u32,
        /// Frames the loader needs.
        needed: u32,
        /// The loader.
        loader: &'static str,
    },
    /// A sampling option out of range.
    #[error("invalid video sampling option {field} = {value}: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The frames differ in size, or a frame's pixels do not match its size.
    #[error("frame {index} is {got}, the video's frames are {expected}")]
    FrameSize {
        /// The frame's position.
        index: usize,
        /// What it is.
        got: String,
        /// What the first frame set.
        expected: String,
    },
    /// Resizing or cutting into patches failed.
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
    /// The FFmpeg programs are not installed (or do not run).
    #[error(
        "videos need FFmpeg, and `{program}` does not run: install it (Debian and Ubuntu: \
         `apt-get install ffmpeg`; macOS: `brew install ffmpeg`) or name the programs with \
         IRIS_FFMPEG and IRIS_FFPROBE"
    )]
    FfmpegMissing {
        /// The program that did not run.
        program: String,
    },
    /// The clip cannot be opened or decoded.
    #[error("cannot decode the video: {message}")]
    Decode {
        /// FFmpeg's description of the problem.
        message: String,
    },
    /// The clip would decode to more than the limits allow.
    #[error("video too large: {what} is {bytes} {unit}, over the limit of {limit}")]
    TooLarge {
        /// What is too large.
        what: String,
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
        /// `pixels` or `bytes`.
        unit: &'static str,
    },
}

/// The indices of the frames `loader` reads from a video of `total` frames at `source_fps`.
///
/// # Errors
/// [`VideoError::NoFrames`]; for [`VideoLoader::Qwen2Vl`], [`VideoError::UnknownFrameRate`]
/// when `source_fps <= 0` and [`VideoError::TooFewFrames`] for a one-frame video (vLLM divides
/// by zero there and answers 500); [`VideoError::InvalidOption`] for a non-positive `fps` or a
/// zero temporal patch.
///
/// ```
/// use iris_core::preprocess::video::{SamplingOptions, VideoLoader, sample_frames};
/// // 45 frames at 10 fps, 2 frames a second: an even count for Qwen2-VL, any for Qwen3-VL.
/// let opts = SamplingOptions::default();
/// assert_eq!(sample_frames(VideoLoader::Qwen2Vl, 45, 10.0, &opts)?, [0, 5, 11, 16, 22, 28, 33, 39]);
/// assert_eq!(sample_frames(VideoLoader::Qwen3Vl, 45, 10.0, &opts)?, [0, 6, 11, 16, 22, 28, 33, 38, 44]);
/// # Ok::<(), iris_core::preprocess::video::VideoError>(())
/// ```
pub fn sample_frames(
    loader: VideoLoader,
    total: u32,
    source_fps: f64,
    options: &SamplingOptions,
) -> Result<Vec<u32>, VideoError> {
    if total == 0 {
        return Err(VideoError::NoFrames);
    }
    if options.fps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        || options.fps.is_infinite()
    {
        return Err(VideoError::InvalidOption {
            field: "fps",
            value: options.fps.to_string(),
            reason: "must be a positive number",
        });
    }
    let fps = options.fps.min(MAX_SAMPLING_FPS);
    let max_frames = options.max_frames.min(MAX_FRAMES);
    match loader {
        VideoLoader::Qwen2Vl => {
            let temporal = options.temporal_patch_size;
            if temporal == 0 {
                return Err(VideoError::InvalidOption {
                    field: "temporal_patch_size",
                    value: "0".to_owned(),
                    reason: "must be positive",
                });
            }
            if source_fps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                return Err(VideoError::UnknownFrameRate);
            }
            let t = f64::from(temporal);
            let max_frames = (f64::from(max_frames.min(total)) / t).floor() * t;
            let n = f64::from(total) / source_fps * fps;
            let n = n
                .max(f64::from(options.min_frames))
                .min(max_frames)
                .min(f64::from(total));
            let n = (n / t).floor() * t;
            if n < 1.0 {
                return Err(VideoError::TooFewFrames {
                    total,
                    needed: temporal,
                    loader: loader.name(),
                });
            }
            Ok(arange_f32(total, f64::from(total) / n))
        }
        VideoLoader::Qwen3Vl => {
            // An unknown rate is taken as 24 fps, as transformers does.
            let source_fps = if source_fps > 0.0 { source_fps } else { 24.0 };
            // Python's int() truncates toward zero.
            let n = (f64::from(total) / source_fps * fps).trunc();
            let n = n
                .max(f64::from(options.min_frames))
                .min(f64::from(max_frames))
                .min(f64::from(total));
            Ok(linspace_rounded(total - 1, f64_to_u32(n)))
        }
    }
}

/// `torch.arange(0, total, step).int()` clamped to `total - 1`: the values `step * i` in f64
/// (PyTorch's CPU accumulation type for float32), stored as f32, truncated.
fn arange_f32(total: u32, step: f64) -> Vec<u32> {
    // PyTorch's size: ceil((end - start) / step), in double.
    let count = f64_to_u32((f64::from(total) / step).ceil());
    (0..count)
        .map(|i| {
            #[allow(clippy::cast_possible_truncation)]
            let value = (step * f64::from(i)) as f32;
            f64_to_u32(f64::from(value).trunc()).min(total - 1)
        })
        .collect()
}

/// `np.linspace(0, last, n).round().astype(int)`: numpy's linspace (`start + i * step`, the
/// last value exactly `last`), rounded half to even.
fn linspace_rounded(last: u32, n: u32) -> Vec<u32> {
    match n {
        0 => Vec::new(),
        1 => vec![0],
        _ => {
            let step = f64::from(last) / f64::from(n - 1);
            (0..n)
                .map(|i| {
                    let v = if i == n - 1 {
                        f64::from(last)
                    } else {
                        f64::from(i) * step
                    };
                    f64_to_u32(v.round_ties_even())
                })
                .collect()
        }
    }
}

/// Which video processor resizes the frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VideoResize {
    /// `Qwen2VLVideoProcessor`: each frame as an image, `[min_pixels, max_pixels]` per frame.
    PerFrame,
    /// `Qwen3VLVideoProcessor`: `[min_pixels, max_pixels]` bound `frames x height x width`
    /// (the frame count rounded to the temporal patch), so longer clips get smaller frames.
    OverAllFrames,
}

/// One video ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessedVideo {
    /// `t * h * w` rows of [`ProcessorConfig::patch_dim`] values.
    pub pixel_values: Vec<f32>,
    /// `[t, h / patch, w / patch]`, as the processor's `video_grid_thw`; `t` is the number of
    /// temporal groups (frames / 2, rounded up).
    pub grid_thw: [u32; 3],
    /// Size of the decoded frames.
    pub original_size: ImageSize,
    /// Size after resizing.
    pub resized_size: ImageSize,
    /// Embedding tokens the tower produces for it: `t * h * w / merge^2`.
    pub tokens: u32,
}

/// Resizes, normalizes and patchifies decoded frames (all of one size) as the video processor
/// `resize` selects does; `config` holds the processor's patch, merge and temporal sizes, its
/// pixel bounds (`size.shortest_edge` / `size.longest_edge`) and mean and std.
///
/// # Errors
/// [`VideoError::NoFrames`], [`VideoError::FrameSize`], [`VideoError::TooFewFrames`]
/// (Qwen3-VL's resize needs at least a temporal patch of frames), and the resize's errors
/// ([`PreprocessError::AspectRatio`] and the like).
pub fn preprocess_frames(
    frames: &[RgbImage],
    config: &ProcessorConfig,
    resize: VideoResize,
) -> Result<PreprocessedVideo, VideoError> {
    config.validate()?;
    let first = frames.first().ok_or(VideoError::NoFrames)?;
    let size = first.size;
    for (index, frame) in frames.iter().enumerate() {
        if frame.size != size || frame.pixels.len() != size.pixel_count() * CHANNELS {
            return Err(VideoError::FrameSize {
                index,
                got: format!(
                    "{}x{} with {} bytes",
                    frame.size.width,
                    frame.size.height,
                    frame.pixels.len()
                ),
                expected: format!("{}x{} RGB", size.width, size.height),
            });
        }
    }
    let shape = video_shape(frames.len(), size, config, resize)?;
    let resized_size = shape.resized_size;
    let temporal = config.temporal_patch_size as usize;
    let p = config.patch_size as usize;
    let m = config.merge_size as usize;
    let (w, h) = (resized_size.width as usize, resized_size.height as usize);
    let (gh, gw) = (h / p, w / p);
    let groups = frames.len().div_ceil(temporal);
    let row_len = config.patch_dim();
    let mut pixel_values = vec![0f32; groups * gh * gw * row_len];
    let lut = normalize_lut(config);
    let plane = p * p;
    let resized = resize_all(frames, resized_size);
    for (f, resized) in resized.iter().enumerate() {
        // A count that is not a multiple of the temporal patch repeats the last frame into
        // the last group's remaining slots.
        let slots = if f + 1 == frames.len() {
            f % temporal..temporal
        } else {
            f % temporal..f % temporal + 1
        };
        let group = f / temporal;
        for slot in slots {
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for mh in 0..m {
                        for mw in 0..m {
                            let row = group * gh * gw + ((bh * (gw / m) + bw) * m + mh) * m + mw;
                            let out = &mut pixel_values[row * row_len..(row + 1) * row_len];
                            let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                            for (c, table) in lut.iter().enumerate() {
                                let base = (c * temporal + slot) * plane;
                                for dy in 0..p {
                                    let src = ((y0 + dy) * w + x0) * CHANNELS + c;
                                    for dx in 0..p {
                                        out[base + dy * p + dx] =
                                            table[usize::from(resized.pixels[src + dx * CHANNELS])];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(PreprocessedVideo {
        pixel_values,
        grid_thw: shape.grid_thw,
        original_size: size,
        resized_size,
        tokens: shape.tokens,
    })
}

/// What [`preprocess_frames`] makes of a video, computed from its frame count and size alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoShape {
    /// Size of every frame after resizing.
    pub resized_size: ImageSize,
    /// `[t, h, w]` in patches (`video_grid_thw`).
    pub grid_thw: [u32; 3],
    /// Embedding tokens: `t * h * w / merge^2`.
    pub tokens: u32,
}

/// The grid and tokens [`preprocess_frames`] gives `count` frames of `size`, without touching
/// a pixel: admission charges a video's tokens before its frames are resized.
///
/// # Errors
/// As [`preprocess_frames`]'s size checks: [`VideoError::NoFrames`], [`VideoError::TooFewFrames`]
/// and the resize's errors.
pub fn video_shape(
    count: usize,
    size: ImageSize,
    config: &ProcessorConfig,
    resize: VideoResize,
) -> Result<VideoShape, VideoError> {
    if count == 0 {
        return Err(VideoError::NoFrames);
    }
    let frames = u32::try_from(count).map_err(|_| VideoError::InvalidOption {
        field: "frames",
        value: count.to_string(),
        reason: "too many frames",
    })?;
    let resized_size = match resize {
        VideoResize::PerFrame => {
            smart_resize(size, config.factor(), config.min_pixels, config.max_pixels)?
        }
        VideoResize::OverAllFrames => smart_resize_frames(frames, size, config)?,
    };
    let groups = frames.div_ceil(config.temporal_patch_size.max(1));
    let grid_thw = [
        groups,
        resized_size.height / config.patch_size,
        resized_size.width / config.patch_size,
    ];
    let patches: u64 = grid_thw.iter().map(|&v| u64::from(v)).product();
    let merge = u64::from(config.merge_size);
    let tokens = u32::try_from(patches / (merge * merge)).unwrap_or(u32::MAX);
    Ok(VideoShape {
        resized_size,
        grid_thw,
        tokens,
    })
}

/// The engine's cache key of a video: blake3 over a version tag, the frames (count, size, RGB
/// bytes), the processor settings that change `pixel_values` and the resize rule. As
/// [`item_hash`](crate::preprocess::item_hash) for images; the two never collide, their tags
/// differ. 64 lowercase hex digits.
#[must_use]
pub fn video_hash(frames: &[RgbImage], config: &ProcessorConfig, resize: VideoResize) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"iris.preprocess.video.v1\0");
    h.update(&(frames.len() as u64).to_le_bytes());
    for frame in frames {
        h.update(&frame.size.width.to_le_bytes());
        h.update(&frame.size.height.to_le_bytes());
        h.update(&frame.pixels);
    }
    super::hash_settings(&mut h, config);
    h.update(&[match resize {
        VideoResize::PerFrame => 0,
        VideoResize::OverAllFrames => 1,
    }]);
    h.finalize().to_hex().to_string()
}

/// Every frame resized to `to`, frames spread over the host's cores (each frame's resize is
/// independent, and resizing is most of the work).
fn resize_all(frames: &[RgbImage], to: ImageSize) -> Vec<RgbImage> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(frames.len())
        .max(1);
    if threads == 1 {
        return frames.iter().map(|f| resize_bicubic_aa_u8(f, to)).collect();
    }
    let chunk = frames.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let workers: Vec<_> = frames
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|f| resize_bicubic_aa_u8(f, to))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|worker| {
                // A resize does not panic (its sizes are checked above); were one to, the
                // panic carries on here rather than being lost.
                worker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

/// Qwen3-VL's video `smart_resize`: sides below the factor scaled up first (truncating), the
/// aspect-ratio limit, then the pixel bounds applied to `t' x h' x w'` where `t'` is the frame
/// count rounded (half to even) to the temporal patch, and the scale computed from the frame
/// count itself.
fn smart_resize_frames(
    frames: u32,
    size: ImageSize,
    config: &ProcessorConfig,
) -> Result<ImageSize, VideoError> {
    let temporal = config.temporal_patch_size;
    if frames < temporal {
        return Err(VideoError::TooFewFrames {
            total: frames,
            needed: temporal,
            loader: VideoLoader::Qwen3Vl.name(),
        });
    }
    let factor = f64::from(config.factor());
    let (mut h, mut w) = (f64::from(size.height), f64::from(size.width));
    if h < factor || w < factor {
        let scale = (factor / h).max(factor / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    let ratio = h.max(w) / h.min(w);
    if ratio > super::MAX_ASPECT_RATIO {
        return Err(PreprocessError::AspectRatio {
            width: size.width,
            height: size.height,
            ratio,
            max_ratio: super::MAX_ASPECT_RATIO,
        }
        .into());
    }
    let t = f64::from(temporal);
    let n = f64::from(frames);
    let mut h_bar = (h / factor).round_ties_even() * factor;
    let mut w_bar = (w / factor).round_ties_even() * factor;
    let t_bar = (n / t).round_ties_even() * t;
    // The products are exact in f64 (well below 2^53 for any decodable frame).
    let volume = t_bar * h_bar * w_bar;
    #[allow(clippy::cast_precision_loss)]
    let (min_pixels, max_pixels) = (config.min_pixels as f64, config.max_pixels as f64);
    if volume > max_pixels {
        let beta = (n * h * w / max_pixels).sqrt();
        h_bar = factor.max((h / beta / factor).floor() * factor);
        w_bar = factor.max((w / beta / factor).floor() * factor);
    } else if volume < min_pixels {
        let beta = (min_pixels / (n * h * w)).sqrt();
        h_bar = (h * beta / factor).ceil() * factor;
        w_bar = (w * beta / factor).ceil() * factor;
    }
    match (f64_to_u32_checked(w_bar), f64_to_u32_checked(h_bar)) {
        (Some(width), Some(height)) => Ok(ImageSize { width, height }),
        _ => Err(PreprocessError::ResizeOverflow {
            orig_width: size.width,
            orig_height: size.height,
            width: f64_to_u64(w_bar),
            height: f64_to_u64(h_bar),
        }
        .into()),
    }
}

/// Per channel, the normalized value of each 8-bit level as torchvision computes it with
/// transformers' fused rescale: `(v - mean * 255) / (std * 255)` in f32, mean and std first
/// made f32 and multiplied by `1 / rescale_factor` in f32.
fn normalize_lut(config: &ProcessorConfig) -> [[f32; 256]; CHANNELS] {
    #[allow(clippy::cast_possible_truncation)]
    let scale = (1.0 / config.rescale_factor) as f32;
    let mut lut = [[0f32; 256]; CHANNELS];
    for (c, table) in lut.iter_mut().enumerate() {
        let mean = config.image_mean[c] * scale;
        let std = config.image_std[c] * scale;
        for (v, out) in table.iter_mut().enumerate() {
            *out = (f32::from(u8::try_from(v).unwrap_or(u8::MAX)) - mean) / std;
        }
    }
    lut
}

/// Qwen3-VL's timestamps: the sampled indices padded with the last to a multiple of
/// `temporal_patch_size`, each divided by the source fps, then per group the mean of its first
/// and last (vLLM's `_calculate_timestamps`).
///
/// ```
/// use iris_core::preprocess::video::qwen3_timestamps;
/// let t = qwen3_timestamps(&[0, 6, 11, 16, 22, 28, 33, 38, 44], 10.0, 2);
/// assert_eq!(t, [0.3, 1.35, 2.5, 3.55, 4.4]);
/// ```
#[must_use]
pub fn qwen3_timestamps(indices: &[u32], source_fps: f64, temporal_patch_size: u32) -> Vec<f64> {
    let temporal = temporal_patch_size.max(1) as usize;
    let mut padded: Vec<u32> = indices.to_vec();
    if let Some(&last) = indices.last() {
        while !padded.len().is_multiple_of(temporal) {
            padded.push(last);
        }
    }
    padded
        .chunks(temporal)
        .map(|group| {
            let first = f64::from(group[0]) / source_fps;
            let last = f64::from(group[group.len() - 1]) / source_fps;
            (first + last) / 2.0
        })
        .collect()
}

/// Qwen2.5-VL's `second_per_grid_ts`: `temporal_patch_size / sampled_fps`, where the sampled
/// rate is `sampled / total * source_fps`.
#[must_use]
pub fn second_per_grid_ts(
    sampled: usize,
    total: u32,
    source_fps: f64,
    temporal_patch_size: u32,
) -> f64 {
    let sampled_fps = sampled as f64 / f64::from(total) * source_fps;
    f64::from(temporal_patch_size) / sampled_fps
}

/// Saturating conversion of a non-negative, already rounded f64 (NaN and negatives to 0).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn f64_to_u32(v: f64) -> u32 {
    v as u32
}

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn f64_to_u64(v: f64) -> u64 {
    v as u64
}

fn f64_to_u32_checked(v: f64) -> Option<u32> {
    (v >= 0.0 && v <= f64::from(u32::MAX)).then(|| f64_to_u32(v))
}
