//! The bench workload: which images and videos each prompt sends, and when each prompt is sent.
//!
//! Images are synthetic (structured content: a two-colour gradient at a random angle, filled
//! rectangles and discs, and per-pixel noise, so that encoders and compressors see realistic
//! data) or read from a directory of PNG, JPEG and WebP files. Videos (`--videos-per-prompt`)
//! are synthetic H.264 clips, a camera panning across such an image, encoded by the FFmpeg
//! program, or read from a directory of clips. Everything is deterministic given the seed: the
//! same flags give the same bytes, the same repeats and the same arrival times.
//!
//! Repeats (`--repeat-ratio`): of all image slots, `round(ratio x slots)` reuse an image first
//! sent by an earlier prompt (so the first prompt's slots never repeat, which caps the share at
//! `(prompts - 1) / prompts`); the slots and the reused images are drawn uniformly with the seed.
//! Every other slot gets a fresh image. Video slots repeat in the same way, drawn apart. With
//! `--dataset` (`--video-dataset`), fresh items cycle through the files in name order, so a run
//! needing more fresh items than there are files repeats files too.
//!
//! Arrivals (`--request-rate`): a Poisson process, i.e. exponential gaps with mean `1 / rate`;
//! the first prompt is sent at once. `inf` sends every prompt at once.

use std::fmt;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use image::{ExtendedColorType, ImageEncoder, RgbImage};
use iris_core::budget::Modality;
use iris_core::preprocess::video::ffmpeg::Ffmpeg;
use rayon::iter::{IntoParallelIterator, ParallelIterator};

/// Largest side accepted for a synthetic image.
pub const MAX_SYNTHETIC_SIDE: u32 = 16384;
/// Most bytes of encoded synthetic images a workload holds: every fresh image is made before
/// the load starts and kept for it, so a large `--image-size` at many prompts would otherwise
/// fill the host's memory (and take as long to make) before the first request.
pub const MAX_SYNTHETIC_BYTES: u64 = 8 << 30;
/// JPEG quality of synthetic images.
const JPEG_QUALITY: u8 = 90;
/// File extensions read from `--dataset`, with the media types of their data URLs.
pub const DATASET_EXTENSIONS: [(&str, &str); 4] = [
    ("png", "image/png"),
    ("jpg", "image/jpeg"),
    ("jpeg", "image/jpeg"),
    ("webp", "image/webp"),
];
/// File extensions read from `--video-dataset`, with the media types of their data URLs.
pub const VIDEO_EXTENSIONS: [(&str, &str); 6] = [
    ("mp4", "video/mp4"),
    ("m4v", "video/mp4"),
    ("webm", "video/webm"),
    ("mkv", "video/x-matroska"),
    ("mov", "video/quicktime"),
    ("avi", "video/x-msvideo"),
];
/// Most frames of a synthetic clip.
pub const MAX_SYNTHETIC_FRAMES: u32 = 3600;
/// Pixels the camera moves per frame across a synthetic clip's scene.
const PAN_PER_FRAME: u32 = 2;

/// Why a workload could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    /// `--image-size` is not `WxH` with sides in range.
    #[error("image size {given:?} is not WIDTHxHEIGHT with sides from 1 to {max}")]
    BadImageSize {
        /// The text given.
        given: String,
        /// Largest side accepted.
        max: u32,
    },
    /// `--request-rate` is neither `inf` nor a number of at least [`MIN_REQUEST_RATE`].
    #[error(
        "request rate {given:?} must be a number of requests per second of at least {MIN_REQUEST_RATE} (one every 1000 s), or `inf`"
    )]
    BadRequestRate {
        /// The text given.
        given: String,
    },
    /// `--image-format` is not one of png, jpeg, webp.
    #[error("image format {given:?} must be one of png, jpeg, webp")]
    BadImageFormat {
        /// The text given.
        given: String,
    },
    /// A count or ratio is out of range.
    #[error("{flag} is {value}; {requirement}")]
    OutOfRange {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        requirement: &'static str,
    },
    /// No synthetic sizes were given.
    #[error("no image sizes given for synthetic images")]
    NoSizes,
    /// The fresh synthetic images would hold more than [`MAX_SYNTHETIC_BYTES`].
    #[error(
        "the workload's {fresh} distinct synthetic images pass {max} bytes once encoded (after {made} of them); lower --num-prompts, --images-per-prompt or --image-size, or raise --repeat-ratio"
    )]
    SyntheticTooLarge {
        /// Fresh images the workload needs.
        fresh: usize,
        /// Images made when the bound was passed.
        made: usize,
        /// The bound.
        max: u64,
    },
    /// The dataset directory cannot be read.
    #[error("cannot read dataset directory {path}: {source}")]
    DatasetUnreadable {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The dataset directory holds no image files.
    #[error("dataset directory {path} holds no .png, .jpg, .jpeg or .webp files")]
    DatasetEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// The video dataset directory holds no clips.
    #[error("video dataset directory {path} holds no .mp4, .m4v, .webm, .mkv, .mov or .avi files")]
    VideoDatasetEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// A synthetic clip's size is odd: H.264 in 4:2:0 halves both sides for chroma.
    #[error("video size {size} must have even sides (H.264 4:2:0 halves both for chroma)")]
    OddVideoSize {
        /// The size given.
        size: ImageSize,
    },
    /// The FFmpeg program, needed to make synthetic clips, does not run.
    #[error("making synthetic videos: {0}; or give clips with --video-dataset")]
    FfmpegMissing(String),
    /// FFmpeg failed to encode a synthetic clip.
    #[error("encoding a synthetic {size} clip of {frames} frames with FFmpeg (libx264): {message}")]
    VideoEncode {
        /// Frame size.
        size: ImageSize,
        /// Frames.
        frames: u32,
        /// What failed.
        message: String,
    },
    /// A dataset file cannot be read.
    #[error("cannot read dataset file {path}: {source}")]
    FileUnreadable {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Encoding a synthetic image failed.
    #[error("encoding a synthetic {width}x{height} image as {format}: {source}")]
    Encode {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// The format.
        format: ImageFormat,
        /// The encoder's error.
        source: image::ImageError,
    },
}

/// Width and height of a synthetic image, parsed from `WxH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSize {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl FromStr for ImageSize {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || WorkloadError::BadImageSize {
            given: s.to_owned(),
            max: MAX_SYNTHETIC_SIDE,
        };
        let (w, h) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
        let side = |t: &str| {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|v| (1..=MAX_SYNTHETIC_SIDE).contains(v))
                .ok_or_else(bad)
        };
        Ok(Self {
            width: side(w)?,
            height: side(h)?,
        })
    }
}

impl fmt::Display for ImageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}

#[cfg(test)]
/// Parses a comma-separated list of sizes (`448x448,1024x768`).
///
/// # Errors
/// [`WorkloadError::BadImageSize`] for the first bad entry, [`WorkloadError::NoSizes`] if empty.
pub fn parse_image_sizes(list: &str) -> Result<Vec<ImageSize>, WorkloadError> {
    let sizes = list
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(str::parse)
        .collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() {
        return Err(WorkloadError::NoSizes);
    }
    Ok(sizes)
}

/// File format of synthetic images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageFormat {
    /// PNG (lossless).
    #[default]
    Png,
    /// JPEG at quality 90.
    Jpeg,
    /// WebP (lossless).
    Webp,
}

impl ImageFormat {
    /// The media type used in data URLs.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Webp => "image/webp",
        }
    }
}

impl FromStr for ImageFormat {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "png" => Ok(Self::Png),
            "jpeg" | "jpg" => Ok(Self::Jpeg),
            "webp" => Ok(Self::Webp),
            _ => Err(WorkloadError::BadImageFormat {
                given: s.to_owned(),
            }),
        }
    }
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Png => "png",
            Self::Jpeg => "jpeg",
            Self::Webp => "webp",
        })
    }
}

/// The slowest `--request-rate`: one request every 1000 s. Slower rates put arrivals past what a
/// clock can add (a rate of 1e-300 puts the second at 1e300 s), and no run would end.
pub const MIN_REQUEST_RATE: f64 = 1e-3;

/// The most item slots (prompts x items per prompt) a workload may have: its slots are listed
/// and its fresh items made before the load starts.
pub const MAX_SLOTS: usize = 10_000_000;

/// Requests per second of the arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RequestRate {
    /// Every prompt at once.
    Infinite,
    /// A Poisson process with this mean rate (requests per second, positive and finite).
    PerSecond(f64),
}

impl FromStr for RequestRate {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        if t == "inf" || t == "infinity" {
            return Ok(Self::Infinite);
        }
        match t.parse::<f64>() {
            Ok(r) if r.is_finite() && r >= MIN_REQUEST_RATE => Ok(Self::PerSecond(r)),
            Ok(r) if r.is_infinite() && r > 0.0 => Ok(Self::Infinite),
            _ => Err(WorkloadError::BadRequestRate {
                given: s.to_owned(),
            }),
        }
    }
}

impl fmt::Display for RequestRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Infinite => f.write_str("inf"),
            Self::PerSecond(r) => write!(f, "{r}"),
        }
    }
}

/// Where images come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageSource {
    /// Generated images, cycling through `sizes`.
    Synthetic {
        /// Sizes, used in turn by successive fresh images.
        sizes: Vec<ImageSize>,
        /// File format.
        format: ImageFormat,
    },
    /// Files from a directory (`.png`, `.jpg`, `.jpeg`, `.webp`), in name order.
    Dataset(PathBuf),
}

/// Where videos come from.
#[derive(Debug, Clone, PartialEq)]
pub enum VideoSource {
    /// H.264 clips made here: a camera panning across a synthetic image.
    Synthetic {
        /// Frame size (even sides).
        size: ImageSize,
        /// Frames per clip.
        frames: u32,
        /// Frames per second the clip declares.
        fps: u32,
    },
    /// Clips from a directory ([`VIDEO_EXTENSIONS`]), in name order.
    Dataset(PathBuf),
}

#[cfg(test)]
impl VideoSource {
    /// The flags' default synthetic clip: 32 frames of 448x448 at 8 fps (4 s), of which vLLM's
    /// Qwen-VL loaders sample 8 at their default 2 fps.
    pub const DEFAULT: Self = Self::Synthetic {
        size: ImageSize {
            width: 448,
            height: 448,
        },
        frames: 32,
        fps: 8,
    };
}

/// What to build.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    /// Image source.
    pub source: ImageSource,
    /// Video source.
    pub video_source: VideoSource,
    /// Number of prompts (requests).
    pub num_prompts: usize,
    /// Images in each prompt.
    pub images_per_prompt: usize,
    /// Videos in each prompt, after its images.
    pub videos_per_prompt: usize,
    /// Share of image slots reused from earlier prompts, in `[0, 1]`.
    pub repeat_ratio: f64,
    /// Seed of every random choice.
    pub seed: u64,
}

/// One encoded image or video file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedMedia {
    /// Image or video.
    pub modality: Modality,
    /// The file bytes.
    pub bytes: Arc<[u8]>,
    /// Media type for data URLs.
    pub media_type: &'static str,
    /// Where it came from: a file name, `synthetic WxH #i` or `synthetic WxHxF clip #i`.
    pub label: String,
}

/// The built workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Distinct items, by id: the images, then the videos.
    pub items: Vec<Arc<EncodedMedia>>,
    /// For each prompt, the ids of its items in order (its images, then its videos).
    pub prompts: Vec<Vec<usize>>,
    /// Slots that reuse an item from an earlier prompt.
    pub repeated_slots: usize,
}

impl Workload {
    #[cfg(test)]
    /// Item slots over all prompts.
    pub fn total_slots(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    /// The items of prompt `index`.
    pub fn prompt_items(&self, index: usize) -> Vec<Arc<EncodedMedia>> {
        self.prompts
            .get(index)
            .map(|ids| ids.iter().map(|&i| Arc::clone(&self.items[i])).collect())
            .unwrap_or_default()
    }

    /// Distinct items of `modality`.
    pub fn distinct(&self, modality: Modality) -> usize {
        self.items.iter().filter(|i| i.modality == modality).count()
    }

    /// Items of `modality` in the first prompt (every prompt has as many).
    pub fn per_prompt(&self, modality: Modality) -> usize {
        self.prompts.first().map_or(0, |ids| {
            ids.iter()
                .filter(|&&i| self.items[i].modality == modality)
                .count()
        })
    }
}

/// Checks the workload's counts and ratio (prompts, items per prompt, repeats), which need
/// nothing read or generated, before anything is.
fn check_counts(spec: &WorkloadSpec) -> Result<(), WorkloadError> {
    if spec.num_prompts == 0 {
        return Err(out_of_range(
            "--num-prompts",
            spec.num_prompts,
            "it must be at least 1",
        ));
    }
    if spec
        .images_per_prompt
        .saturating_add(spec.videos_per_prompt)
        == 0
    {
        return Err(out_of_range(
            "--images-per-prompt",
            spec.images_per_prompt,
            "it must be at least 1 unless --videos-per-prompt is",
        ));
    }
    // Every slot is listed, and every fresh item made, before the load starts.
    let slots = spec.num_prompts.checked_mul(
        spec.images_per_prompt
            .saturating_add(spec.videos_per_prompt),
    );
    if slots.is_none_or(|slots| slots > MAX_SLOTS) {
        return Err(out_of_range(
            "--num-prompts",
            spec.num_prompts,
            "prompts x (images + videos per prompt) must be at most 10000000",
        ));
    }
    if !(0.0..=1.0).contains(&spec.repeat_ratio) {
        return Err(out_of_range(
            "--repeat-ratio",
            spec.repeat_ratio,
            "it must be between 0 and 1",
        ));
    }
    Ok(())
}

/// Builds the workload: generates or reads the images and videos and assigns them to prompts.
///
/// # Errors
/// [`WorkloadError`] for out-of-range counts, an unreadable or empty dataset, an encoder error,
/// or synthetic videos without FFmpeg.
pub fn build_workload(spec: &WorkloadSpec) -> Result<Workload, WorkloadError> {
    check_counts(spec)?;
    let (image_prompts, fresh_images, image_repeats) = assign_slots(
        spec.num_prompts,
        spec.images_per_prompt,
        spec.repeat_ratio,
        spec.seed,
    );
    // The video slots' draws are their own, so adding videos leaves the images' as they were.
    let (video_prompts, fresh_videos, video_repeats) = assign_slots(
        spec.num_prompts,
        spec.videos_per_prompt,
        spec.repeat_ratio,
        spec.seed ^ 0x7669_6465_6f73,
    );
    let mut items = fresh_image_items(spec, fresh_images)?;
    let first_video = items.len();
    items.extend(fresh_video_items(spec, fresh_videos)?);
    let prompts = image_prompts
        .into_iter()
        .zip(video_prompts)
        .map(|(mut ids, videos)| {
            ids.extend(videos.into_iter().map(|v| first_video + v));
            ids
        })
        .collect();
    Ok(Workload {
        items,
        prompts,
        repeated_slots: image_repeats + video_repeats,
    })
}

/// The workload's `fresh` distinct images.
fn fresh_image_items(
    spec: &WorkloadSpec,
    fresh: usize,
) -> Result<Vec<Arc<EncodedMedia>>, WorkloadError> {
    if fresh == 0 {
        return Ok(Vec::new());
    }
    match &spec.source {
        ImageSource::Synthetic { sizes, format } => {
            if sizes.is_empty() {
                return Err(WorkloadError::NoSizes);
            }
            fresh_synthetic_images(spec.seed, sizes, *format, fresh, MAX_SYNTHETIC_BYTES)
        }
        ImageSource::Dataset(dir) => cycle_files(&list_dataset(dir)?, Modality::Image, fresh),
    }
}

/// `fresh` synthetic images of `sizes` in turn, made on every core (each image's bytes depend
/// on its seed alone, so the order they are made in changes nothing), refused once their
/// encoded bytes pass `max_bytes`.
fn fresh_synthetic_images(
    seed: u64,
    sizes: &[ImageSize],
    format: ImageFormat,
    fresh: usize,
    max_bytes: u64,
) -> Result<Vec<Arc<EncodedMedia>>, WorkloadError> {
    let held = std::sync::atomic::AtomicU64::new(0);
    let made = std::sync::atomic::AtomicUsize::new(0);
    (0..fresh)
        .into_par_iter()
        .map(|i| {
            let size = sizes[i % sizes.len()];
            let bytes = encode_image(&synthetic_image(size, item_seed(seed, i)), format)?;
            let len = bytes.len() as u64;
            let done = made.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if held.fetch_add(len, std::sync::atomic::Ordering::Relaxed) + len > max_bytes {
                return Err(WorkloadError::SyntheticTooLarge {
                    fresh,
                    made: done,
                    max: max_bytes,
                });
            }
            Ok(Arc::new(EncodedMedia {
                modality: Modality::Image,
                bytes: bytes.into(),
                media_type: format.media_type(),
                label: format!("synthetic {size} #{i}"),
            }))
        })
        .collect()
}

/// The workload's `fresh` distinct videos.
fn fresh_video_items(
    spec: &WorkloadSpec,
    fresh: usize,
) -> Result<Vec<Arc<EncodedMedia>>, WorkloadError> {
    if fresh == 0 {
        return Ok(Vec::new());
    }
    match &spec.video_source {
        VideoSource::Synthetic { size, frames, fps } => {
            let ffmpeg =
                Ffmpeg::locate().map_err(|err| WorkloadError::FfmpegMissing(err.to_string()))?;
            let make = |i: usize| {
                // Apart from the images' seeds, so a clip never pans across a sent image.
                let seed = item_seed(spec.seed ^ 0x636c_6970, i);
                let bytes = synthetic_clip(&ffmpeg, *size, *frames, *fps, seed)?;
                Ok(Arc::new(EncodedMedia {
                    modality: Modality::Video,
                    bytes: bytes.into(),
                    media_type: "video/mp4",
                    label: format!("synthetic {size}x{frames} clip #{i}"),
                }))
            };
            // One FFmpeg (one encoding thread) per core at a time; each clip's bytes depend on
            // its seed alone, so the order they are made in changes nothing.
            (0..fresh).into_par_iter().map(make).collect()
        }
        VideoSource::Dataset(dir) => cycle_files(&list_video_dataset(dir)?, Modality::Video, fresh),
    }
}

/// `fresh` items of `modality` from `files` (with their media types), in turn: each file is
/// read once, and a run needing more items than there are files repeats them.
fn cycle_files(
    files: &[(PathBuf, &'static str)],
    modality: Modality,
    fresh: usize,
) -> Result<Vec<Arc<EncodedMedia>>, WorkloadError> {
    let used = fresh.min(files.len());
    let loaded = files[..used]
        .iter()
        .map(|(path, media_type)| load_file(path, modality, media_type).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((0..fresh).map(|i| Arc::clone(&loaded[i % used])).collect())
}

/// The seed of fresh item `index`.
fn item_seed(seed: u64, index: usize) -> u64 {
    seed ^ (u64::try_from(index).unwrap_or(u64::MAX)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A synthetic H.264 clip (MP4): `frames` frames of `size`, a camera panning
/// [`PAN_PER_FRAME`] pixels a frame across a synthetic image drawn from `seed`, encoded by
/// FFmpeg's libx264 in one thread (so the bytes depend on the seed alone).
///
/// # Errors
/// [`WorkloadError::OddVideoSize`], or [`WorkloadError::VideoEncode`] when FFmpeg fails.
pub fn synthetic_clip(
    ffmpeg: &Ffmpeg,
    size: ImageSize,
    frames: u32,
    fps: u32,
    seed: u64,
) -> Result<Vec<u8>, WorkloadError> {
    if size.width % 2 == 1 || size.height % 2 == 1 {
        return Err(WorkloadError::OddVideoSize { size });
    }
    let failed = |message: String| WorkloadError::VideoEncode {
        size,
        frames,
        message,
    };
    let scene = synthetic_image(
        ImageSize {
            width: size.width + PAN_PER_FRAME * frames,
            height: size.height,
        },
        seed,
    );
    let (w, h) = (size.width as usize, size.height as usize);
    let scene_row = scene.width() as usize * 3;
    let mut raw = Vec::with_capacity(w * h * 3 * frames as usize);
    for f in 0..frames as usize {
        let left = f * PAN_PER_FRAME as usize * 3;
        for row in scene.as_raw().chunks_exact(scene_row) {
            raw.extend_from_slice(&row[left..left + w * 3]);
        }
    }
    let out = tempfile::Builder::new()
        .prefix("iris-bench-clip-")
        .suffix(".mp4")
        .tempfile()
        .map_err(|err| failed(format!("a temporary file for the clip: {err}")))?;
    let mut child = std::process::Command::new(ffmpeg.ffmpeg_program())
        .args(["-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24"])
        .args([
            "-s",
            &size.to_string(),
            "-r",
            &fps.to_string(),
            "-i",
            "pipe:0",
        ])
        .args([
            "-c:v", "libx264", "-pix_fmt", "yuv420p", "-threads", "1", "-f", "mp4",
        ])
        .arg(out.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|err| {
            failed(format!(
                "cannot run {}: {err}",
                ffmpeg.ffmpeg_program().display()
            ))
        })?;
    // Frames go in on a thread while FFmpeg's errors are read here: neither pipe can fill up.
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| failed("no stdin".into()))?;
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &raw));
    let output = child
        .wait_with_output()
        .map_err(|err| failed(format!("waiting for FFmpeg: {err}")))?;
    let written = writer.join();
    if !output.status.success() {
        Err(failed(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    } else if !matches!(written, Ok(Ok(()))) {
        Err(failed("FFmpeg stopped reading the frames".into()))
    } else {
        std::fs::read(out.path()).map_err(|err| failed(format!("reading the clip: {err}")))
    }
}

/// Arrival offsets from the start of the run, one per prompt, non-decreasing.
pub fn arrival_offsets(num_prompts: usize, rate: RequestRate, seed: u64) -> Vec<Duration> {
    let mut rng = SplitMix64::new(seed ^ 0x6172_7269_7661_6c73);
    let mut t = 0.0f64;
    (0..num_prompts)
        .map(|i| {
            if let (RequestRate::PerSecond(r), true) = (rate, i > 0) {
                // Inverse CDF of the exponential distribution; 1 - u is in (0, 1].
                t += -(1.0 - rng.next_f64()).ln() / r;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Lists the image files of `dir` in name order, with their media types.
///
/// # Errors
/// [`WorkloadError::DatasetUnreadable`] or [`WorkloadError::DatasetEmpty`].
pub fn list_dataset(dir: &Path) -> Result<Vec<(PathBuf, &'static str)>, WorkloadError> {
    let files = list_files(dir, &DATASET_EXTENSIONS)?;
    if files.is_empty() {
        return Err(WorkloadError::DatasetEmpty {
            path: dir.to_owned(),
        });
    }
    Ok(files)
}

/// Lists the clips of `dir` in name order, with their media types.
///
/// # Errors
/// [`WorkloadError::DatasetUnreadable`] or [`WorkloadError::VideoDatasetEmpty`].
pub fn list_video_dataset(dir: &Path) -> Result<Vec<(PathBuf, &'static str)>, WorkloadError> {
    let files = list_files(dir, &VIDEO_EXTENSIONS)?;
    if files.is_empty() {
        return Err(WorkloadError::VideoDatasetEmpty {
            path: dir.to_owned(),
        });
    }
    Ok(files)
}

/// The files of `dir` whose lower-case extension `types` names, with its media type, in name
/// order.
fn list_files(
    dir: &Path,
    types: &[(&str, &'static str)],
) -> Result<Vec<(PathBuf, &'static str)>, WorkloadError> {
    let pick = |ext: &str| {
        types
            .iter()
            .find(|(known, _)| *known == ext)
            .map(|(_, media_type)| *media_type)
    };
    let unreadable = |source| WorkloadError::DatasetUnreadable {
        path: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(unreadable)? {
        let path = entry.map_err(unreadable)?.path();
        let picked = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .and_then(|ext| pick(&ext));
        if let (true, Some(what)) = (path.is_file(), picked) {
            files.push((path, what));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// A synthetic image: gradient, shapes and noise, all drawn from `seed`.
pub fn synthetic_image(size: ImageSize, seed: u64) -> RgbImage {
    let mut rng = SplitMix64::new(seed);
    let mut color = || {
        [
            rng.next_below(256),
            rng.next_below(256),
            rng.next_below(256),
        ]
        .map(|c| c as f64)
    };
    let (from, to) = (color(), color());
    let angle = rng.next_f64() * std::f64::consts::TAU;
    let (w, h) = (f64::from(size.width), f64::from(size.height));
    let (dx, dy) = (angle.cos(), angle.sin());
    let span = (w * dx.abs() + h * dy.abs()).max(1.0);
    let shapes: Vec<Shape> = (0..3 + rng.next_below(6))
        .map(|_| {
            let cx = rng.next_f64() * w;
            let cy = rng.next_f64() * h;
            let r = (0.05 + rng.next_f64() * 0.25) * w.min(h);
            let fill = [
                rng.next_below(256),
                rng.next_below(256),
                rng.next_below(256),
            ];
            Shape {
                disc: rng.next_below(2) == 0,
                cx,
                cy,
                r,
                fill: fill.map(|c| u8::try_from(c).unwrap_or(u8::MAX)),
            }
        })
        .collect();
    let noise_seed = rng.next_u64();
    RgbImage::from_fn(size.width, size.height, |x, y| {
        let (fx, fy) = (f64::from(x), f64::from(y));
        if let Some(s) = shapes.iter().rev().find(|s| s.covers(fx, fy)) {
            return image::Rgb(s.fill);
        }
        let pos = (fx * dx + fy * dy).rem_euclid(span) / span;
        let noise =
            SplitMix64::new(noise_seed ^ (u64::from(x) << 32 | u64::from(y))).next_below(33);
        let mut px = [0u8; 3];
        for c in 0..3 {
            let v = from[c] + (to[c] - from[c]) * pos + noise as f64 - 16.0;
            // Clamped to the u8 range first, so the cast cannot truncate.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            {
                px[c] = v.clamp(0.0, 255.0) as u8;
            }
        }
        image::Rgb(px)
    })
}

/// Encodes an RGB image in `format`.
///
/// # Errors
/// [`WorkloadError::Encode`] if the encoder fails.
pub fn encode_image(img: &RgbImage, format: ImageFormat) -> Result<Vec<u8>, WorkloadError> {
    let (width, height) = img.dimensions();
    let mut out = Cursor::new(Vec::new());
    let result =
        match format {
            ImageFormat::Png => image::codecs::png::PngEncoder::new(&mut out).write_image(
                img.as_raw(),
                width,
                height,
                ExtendedColorType::Rgb8,
            ),
            ImageFormat::Jpeg => {
                image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY)
                    .write_image(img.as_raw(), width, height, ExtendedColorType::Rgb8)
            }
            ImageFormat::Webp => image::codecs::webp::WebPEncoder::new_lossless(&mut out)
                .write_image(img.as_raw(), width, height, ExtendedColorType::Rgb8),
        };
    result.map_err(|source| WorkloadError::Encode {
        width,
        height,
        format,
        source,
    })?;
    Ok(out.into_inner())
}

/// SplitMix64 (Steele, Lea, Flood 2014): a small, fast, seedable generator; statistical quality
/// is ample for choosing repeats, arrival gaps and pixels.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        // 2^-53: the top 53 bits as a fraction.
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// Uniform in `[0, n)` (`n > 0`; 0 gives 0), by multiply-shift.
    pub fn next_below(&mut self, n: u64) -> u64 {
        let wide = u128::from(self.next_u64()) * u128::from(n);
        // The high half of a u64 x u64 product fits in u64.
        u64::try_from(wide >> 64).unwrap_or(0)
    }
}

struct Shape {
    disc: bool,
    cx: f64,
    cy: f64,
    r: f64,
    fill: [u8; 3],
}

impl Shape {
    fn covers(&self, x: f64, y: f64) -> bool {
        let (ddx, ddy) = (x - self.cx, y - self.cy);
        if self.disc {
            ddx * ddx + ddy * ddy <= self.r * self.r
        } else {
            ddx.abs() <= self.r && ddy.abs() <= self.r * 0.6
        }
    }
}

/// Assigns item ids to `k` slots in each of `n` prompts: returns prompts, the number of fresh
/// items, and repeated slots.
fn assign_slots(n: usize, k: usize, ratio: f64, seed: u64) -> (Vec<Vec<usize>>, usize, usize) {
    let total = n * k;
    let eligible = total - k;
    let wanted = (ratio * total as f64).round();
    // `wanted` is in [0, total] since the ratio is in [0, 1].
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let repeats = (wanted as usize).min(eligible);
    let mut rng = SplitMix64::new(seed);
    // Partial Fisher-Yates over the eligible slots (those after the first prompt).
    let mut order: Vec<usize> = (k..total).collect();
    for i in 0..repeats {
        let j =
            i + usize::try_from(rng.next_below(u64::try_from(eligible - i).unwrap_or(u64::MAX)))
                .unwrap_or(0);
        order.swap(i, j);
    }
    let mut is_repeat = vec![false; total];
    for &slot in &order[..repeats] {
        is_repeat[slot] = true;
    }
    let mut next_fresh = 0usize;
    let prompts = (0..n)
        .map(|p| {
            let earlier = next_fresh;
            (0..k)
                .map(|s| {
                    if is_repeat[p * k + s] {
                        usize::try_from(rng.next_below(u64::try_from(earlier).unwrap_or(u64::MAX)))
                            .unwrap_or(0)
                    } else {
                        next_fresh += 1;
                        next_fresh - 1
                    }
                })
                .collect()
        })
        .collect();
    (prompts, next_fresh, repeats)
}

fn load_file(
    path: &Path,
    modality: Modality,
    media_type: &'static str,
) -> Result<EncodedMedia, WorkloadError> {
    let bytes = std::fs::read(path).map_err(|source| WorkloadError::FileUnreadable {
        path: path.to_owned(),
        source,
    })?;
    let label = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(EncodedMedia {
        modality,
        bytes: bytes.into(),
        media_type,
        label,
    })
}

fn out_of_range(
    flag: &'static str,
    value: impl fmt::Display,
    requirement: &'static str,
) -> WorkloadError {
    WorkloadError::OutOfRange {
        flag,
        value: value.to_string(),
        requirement,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: usize, k: usize, ratio: f64) -> WorkloadSpec {
        WorkloadSpec {
            source: ImageSource::Synthetic {
                sizes: vec![
                    ImageSize {
                        width: 40,
                        height: 30,
                    },
                    ImageSize {
                        width: 16,
                        height: 64,
                    },
                ],
                format: ImageFormat::Png,
            },
            num_prompts: n,
            video_source: VideoSource::DEFAULT,
            images_per_prompt: k,
            videos_per_prompt: 0,
            repeat_ratio: ratio,
            seed: 7,
        }
    }

    #[test]
    fn parses_sizes_rates_and_formats() {
        assert_eq!(
            "448x336".parse::<ImageSize>().unwrap(),
            ImageSize {
                width: 448,
                height: 336
            }
        );
        assert_eq!(parse_image_sizes("8X8, 16x4").unwrap().len(), 2);
        for bad in ["448", "0x4", "4x", "axb", "20000x1"] {
            assert!(bad.parse::<ImageSize>().is_err(), "{bad}");
        }
        assert!(matches!(
            parse_image_sizes(" , "),
            Err(WorkloadError::NoSizes)
        ));
        assert_eq!("inf".parse::<RequestRate>().unwrap(), RequestRate::Infinite);
        assert_eq!(
            "2.5".parse::<RequestRate>().unwrap(),
            RequestRate::PerSecond(2.5)
        );
        for bad in ["0", "-1", "nan", "fast", "1e-300", "0.0009"] {
            assert!(bad.parse::<RequestRate>().is_err(), "{bad}");
        }
        assert_eq!("JPG".parse::<ImageFormat>().unwrap(), ImageFormat::Jpeg);
        assert!("gif".parse::<ImageFormat>().is_err());
    }

    #[test]
    fn repeats_are_exact_deterministic_and_from_earlier_prompts() {
        let s = spec(10, 3, 0.4);
        let w = build_workload(&s).unwrap();
        assert_eq!(w.total_slots(), 30);
        assert_eq!(w.repeated_slots, 12);
        assert_eq!(w.items.len(), 18);
        let mut first_seen = vec![usize::MAX; w.items.len()];
        for (p, ids) in w.prompts.iter().enumerate() {
            for &id in ids {
                first_seen[id] = first_seen[id].min(p);
            }
        }
        let mut reused = 0;
        for (p, ids) in w.prompts.iter().enumerate() {
            let fresh_here: Vec<usize> = ids
                .iter()
                .copied()
                .filter(|&id| first_seen[id] == p)
                .collect();
            reused += ids.len() - fresh_here.len();
        }
        assert_eq!(reused, 12);
        assert!(w.prompts[0].iter().all(|&id| first_seen[id] == 0));
        let again = build_workload(&s).unwrap();
        assert_eq!(again.prompts, w.prompts);
        assert_eq!(again.items, w.items);
        let other = build_workload(&WorkloadSpec { seed: 8, ..s }).unwrap();
        assert_ne!(other.prompts, w.prompts);
    }

    #[test]
    fn repeat_share_is_capped_by_the_first_prompt() {
        for (n, k) in [(usize::MAX / 2, 3), (MAX_SLOTS, 2)] {
            let err = build_workload(&spec(n, k, 0.5)).unwrap_err();
            assert!(
                err.to_string().contains("--num-prompts") && err.to_string().contains("10000000"),
                "{err}"
            );
        }
        let w = build_workload(&spec(4, 2, 1.0)).unwrap();
        assert_eq!(w.repeated_slots, 6);
        assert_eq!(w.items.len(), 2);
        let none = build_workload(&spec(4, 2, 0.0)).unwrap();
        assert_eq!(none.items.len(), 8);
        assert!(build_workload(&spec(4, 2, 1.5)).is_err());
        assert!(build_workload(&spec(0, 2, 0.0)).is_err());
    }

    #[test]
    fn synthetic_images_past_the_byte_bound_are_refused() {
        let sizes = [ImageSize {
            width: 64,
            height: 64,
        }];
        let one = encode_image(
            &synthetic_image(sizes[0], item_seed(5, 0)),
            ImageFormat::Png,
        )
        .unwrap()
        .len() as u64;
        let made = fresh_synthetic_images(5, &sizes, ImageFormat::Png, 8, 100 * one).unwrap();
        assert_eq!(made.len(), 8);
        // In order, each from its own seed, however the cores shared them out.
        for (i, item) in made.iter().enumerate() {
            let alone = encode_image(
                &synthetic_image(sizes[0], item_seed(5, i)),
                ImageFormat::Png,
            )
            .unwrap();
            assert_eq!(&*item.bytes, &alone[..], "image {i}");
        }
        let err = fresh_synthetic_images(5, &sizes, ImageFormat::Png, 8, 2 * one).unwrap_err();
        assert!(
            matches!(err, WorkloadError::SyntheticTooLarge { fresh: 8, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("--repeat-ratio"), "{err}");
    }

    #[test]
    fn synthetic_images_decode_to_their_size_and_differ() {
        let w = build_workload(&spec(2, 2, 0.0)).unwrap();
        let dims: Vec<(u32, u32)> = w
            .items
            .iter()
            .map(|img| {
                image::load_from_memory(&img.bytes)
                    .unwrap()
                    .to_rgb8()
                    .dimensions()
            })
            .collect();
        assert_eq!(dims, vec![(40, 30), (16, 64), (40, 30), (16, 64)]);
        assert_ne!(w.items[0].bytes, w.items[2].bytes);
        let img = synthetic_image(
            ImageSize {
                width: 64,
                height: 64,
            },
            1,
        );
        let distinct: std::collections::HashSet<_> = img.pixels().map(|p| p.0).collect();
        assert!(
            distinct.len() > 50,
            "structured content expected, got {} colours",
            distinct.len()
        );
        for format in [ImageFormat::Jpeg, ImageFormat::Webp] {
            let bytes = encode_image(&img, format).unwrap();
            assert_eq!(image::load_from_memory(&bytes).unwrap().width(), 64);
        }
    }

    #[test]
    fn dataset_is_listed_in_order_and_cycled() {
        let dir = std::env::temp_dir().join(format!("iris-bench-dataset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = synthetic_image(
            ImageSize {
                width: 8,
                height: 8,
            },
            3,
        );
        std::fs::write(
            dir.join("b.PNG"),
            encode_image(&img, ImageFormat::Png).unwrap(),
        )
        .unwrap();
        std::fs::write(
            dir.join("a.jpg"),
            encode_image(&img, ImageFormat::Jpeg).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("notes.txt"), b"not an image").unwrap();
        let s = WorkloadSpec {
            source: ImageSource::Dataset(dir.clone()),
            ..spec(3, 1, 0.0)
        };
        let w = build_workload(&s).unwrap();
        let labels: Vec<&str> = w.items.iter().map(|i| i.label.as_str()).collect();
        assert_eq!(labels, ["a.jpg", "b.PNG", "a.jpg"]);
        assert_eq!(w.items[1].media_type, "image/png");
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = build_workload(&WorkloadSpec {
            source: ImageSource::Dataset(empty),
            ..s
        })
        .unwrap_err();
        assert!(matches!(err, WorkloadError::DatasetEmpty { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The FFmpeg programs, or `None` (saying why) where they do not run and
    /// `IRIS_REQUIRE_FFMPEG`, which `.ci/run` sets, is unset.
    fn ffmpeg() -> Option<Ffmpeg> {
        match Ffmpeg::locate() {
            Ok(found) => Some(found),
            Err(err) if std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none() => {
                eprintln!("skipped: {err}");
                None
            }
            Err(err) => panic!("IRIS_REQUIRE_FFMPEG is set: {err}"),
        }
    }

    fn video_spec(n: usize, images: usize, videos: usize, ratio: f64) -> WorkloadSpec {
        WorkloadSpec {
            video_source: VideoSource::Synthetic {
                size: ImageSize {
                    width: 64,
                    height: 48,
                },
                frames: 6,
                fps: 3,
            },
            videos_per_prompt: videos,
            ..spec(n, images, ratio)
        }
    }

    #[test]
    fn synthetic_videos_are_h264_clips_that_pan_and_follow_the_images() {
        use iris_core::preprocess::video::ffmpeg::{VideoLimits, load_video};
        use iris_core::preprocess::video::{SamplingOptions, VideoLoader};
        let Some(ffmpeg) = ffmpeg() else { return };
        let s = video_spec(6, 2, 1, 0.5);
        let w = build_workload(&s).unwrap();
        assert_eq!(w.per_prompt(Modality::Image), 2);
        assert_eq!(w.per_prompt(Modality::Video), 1);
        // Each prompt: its images, then its video.
        for ids in &w.prompts {
            let kinds: Vec<Modality> = ids.iter().map(|&i| w.items[i].modality).collect();
            assert_eq!(kinds, [Modality::Image, Modality::Image, Modality::Video]);
        }
        // Half of the 18 slots repeat; the first prompt's never do.
        assert_eq!(w.repeated_slots, 9);
        assert_eq!(w.distinct(Modality::Image) + w.distinct(Modality::Video), 9);
        let clip = w
            .items
            .iter()
            .find(|i| i.modality == Modality::Video)
            .unwrap();
        assert_eq!(clip.media_type, "video/mp4");
        // Every frame, as vLLM's loader would read them at the clip's own rate.
        let sampling = SamplingOptions {
            fps: 3.0,
            ..SamplingOptions::default()
        };
        let decoded = load_video(
            &ffmpeg,
            &clip.bytes,
            VideoLoader::Qwen3Vl,
            &sampling,
            &VideoLimits::default(),
        )
        .unwrap();
        assert_eq!(decoded.metadata.total_num_frames, 6);
        assert!((decoded.metadata.fps - 3.0).abs() < 1e-9);
        let size = decoded.frames[0].size;
        assert_eq!((size.width, size.height), (64, 48));
        assert_ne!(decoded.frames[0], decoded.frames[1], "the camera pans");
        // The same flags make the same bytes; another seed other clips.
        let again = build_workload(&s).unwrap();
        assert_eq!(again.items, w.items);
        let other = build_workload(&WorkloadSpec { seed: 8, ..s }).unwrap();
        assert_ne!(
            other.items.iter().find(|i| i.modality == Modality::Video),
            Some(clip)
        );
        // Videos alone.
        let only = build_workload(&video_spec(2, 0, 2, 0.0)).unwrap();
        assert_eq!(only.distinct(Modality::Video), 4);
        assert_eq!(only.distinct(Modality::Image), 0);
    }

    #[test]
    fn bad_video_workloads_are_refused_with_the_reason() {
        let err = build_workload(&video_spec(2, 0, 0, 0.0)).unwrap_err();
        assert!(err.to_string().contains("--videos-per-prompt"), "{err}");
        let odd = WorkloadSpec {
            video_source: VideoSource::Synthetic {
                size: ImageSize {
                    width: 63,
                    height: 48,
                },
                frames: 4,
                fps: 2,
            },
            ..video_spec(1, 1, 1, 0.0)
        };
        if ffmpeg().is_some() {
            let err = build_workload(&odd).unwrap_err();
            assert!(matches!(err, WorkloadError::OddVideoSize { .. }), "{err}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.WEBM"), b"clip b").unwrap();
        std::fs::write(dir.path().join("a.mp4"), b"clip a").unwrap();
        std::fs::write(dir.path().join("a.png"), b"an image").unwrap();
        let listed = list_video_dataset(dir.path()).unwrap();
        let names: Vec<(String, &str)> = listed
            .iter()
            .map(|(p, t)| (p.file_name().unwrap().to_string_lossy().into_owned(), *t))
            .collect();
        assert_eq!(
            names,
            [
                ("a.mp4".to_owned(), "video/mp4"),
                ("b.WEBM".to_owned(), "video/webm")
            ]
        );
        let w = build_workload(&WorkloadSpec {
            video_source: VideoSource::Dataset(dir.path().to_owned()),
            ..video_spec(3, 0, 1, 0.0)
        })
        .unwrap();
        let labels: Vec<&str> = w.items.iter().map(|i| i.label.as_str()).collect();
        assert_eq!(labels, ["a.mp4", "b.WEBM", "a.mp4"]);
        assert!(w.items.iter().all(|i| i.modality == Modality::Video));
        let empty = tempfile::tempdir().unwrap();
        let err = build_workload(&WorkloadSpec {
            video_source: VideoSource::Dataset(empty.path().to_owned()),
            ..video_spec(1, 0, 1, 0.0)
        })
        .unwrap_err();
        assert!(
            matches!(err, WorkloadError::VideoDatasetEmpty { .. }),
            "{err}"
        );
    }

    #[test]
    fn poisson_arrivals_have_the_requested_mean_rate() {
        let offsets = arrival_offsets(4001, RequestRate::PerSecond(20.0), 1);
        assert_eq!(offsets[0], Duration::ZERO);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = offsets[4000].as_secs_f64() / 4000.0;
        assert!((mean_gap - 0.05).abs() < 0.005, "mean gap {mean_gap}");
        assert!(
            arrival_offsets(5, RequestRate::Infinite, 1)
                .iter()
                .all(|d| d.is_zero())
        );
        assert_eq!(
            arrival_offsets(9, RequestRate::PerSecond(3.0), 5),
            arrival_offsets(9, RequestRate::PerSecond(3.0), 5)
        );
    }
}
