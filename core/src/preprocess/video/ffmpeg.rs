//! Decoding videos as vLLM's default OpenCV decoder does, through the FFmpeg programs.
//!
//! vLLM reads a clip with OpenCV's FFmpeg backend: its frame count (the stream's, else the
//! duration times the frame rate, rounded; else a count of packets), its frame rate (FFmpeg's
//! guess from the stream's rates), every frame up to the last one sampled, and the sampled ones
//! converted to RGB by libswscale's default conversion. iris runs `ffprobe` for the first two
//! and `ffmpeg -pix_fmt rgb24` for the frames, whose colours are those OpenCV gives, bit for
//! bit (checked on H.264 and VP9 clips by `core/tests/video_decode.rs`). A separate process
//! keeps a decoder crash on a hostile clip out of the server, and needs no FFmpeg libraries at
//! build time; images need nothing of this.
//!
//! A clip whose display matrix rotates it (a phone's portrait video) is turned as OpenCV turns
//! it ([`Rotation`]), not as the `ffmpeg` program would: iris reads the frames unrotated
//! (`-noautorotate`) and turns them itself, and [`VideoInfo::size`] is the turned size, so that
//! admission, resizing and the identifier see the frames vLLM sees.
//!
//! The programs are found on `PATH`, or at `IRIS_FFMPEG` and `IRIS_FFPROBE`.
//!
//! The clips come from untrusted clients, so every run is confined: FFmpeg may open only the
//! local file given (`-protocol_whitelist file`) and only as one of [`CONTAINERS`]
//! (`-format_whitelist`; without it an HLS playlist or a concat list would make it read other
//! files of the server); its standard error is drained while its output is read, so that a
//! damaged clip's flood of complaints cannot block it and iris on each other; and it is killed
//! and reaped when the video takes longer than [`VideoLimits::max_decode_time`] or iris stops
//! reading early.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{SamplingOptions, VideoError, VideoLoader, f64_to_u32, sample_frames};
use crate::preprocess::{ImageSize, RgbImage};

/// vLLM's limit on one frame's pixels (`VLLM_MAX_IMAGE_PIXELS`'s default, Pillow's).
pub const MAX_FRAME_PIXELS: u64 = 178_956_970;
/// vLLM's limit on decoded bytes per request (`VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`).
pub const MAX_DECODED_BYTES: u64 = 715_827_880;
/// iris's default limit on the time the FFmpeg programs may spend on one video (vLLM has none:
/// its decoding runs in-process); a minute is many times what a clip within
/// [`MAX_DECODED_BYTES`] takes.
pub const MAX_DECODE_TIME: Duration = Duration::from_secs(60);

/// The containers FFmpeg may open a clip as (its demuxers' names, for `-format_whitelist`):
/// MP4/MOV (and 3GP, M4V), Matroska and WebM, AVI, MPEG-TS and -PS, FLV, ASF (WMV), Ogg, and raw
/// H.264 and HEVC streams. None of them opens another file or a URL; the ones left out that do
/// (HLS, DASH, concat lists, image sequences) are what the whitelist refuses.
pub const CONTAINERS: &str = "mov,matroska,avi,mpegts,mpeg,flv,asf,ogg,h264,hevc";

/// Most bytes of a program's standard error kept for its error message; the rest is read and
/// dropped, so that a damaged clip's line per bad frame costs no memory.
const STDERR_KEPT: usize = 64 * 1024;
/// Most bytes of an ffprobe report read (a report on one stream is well under 2 KiB).
const REPORT_LIMIT: u64 = 1 << 20;

/// Limits on what a video may decode to, and on the time decoding may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoLimits {
    /// Most pixels in one frame.
    pub max_frame_pixels: u64,
    /// Most bytes of RGB frames kept.
    pub max_decoded_bytes: u64,
    /// Longest the FFmpeg programs may run on one video, probing and decoding together; past it
    /// they are killed and the video is refused ([`MAX_DECODE_TIME`] by default).
    pub max_decode_time: Duration,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits {
            max_frame_pixels: MAX_FRAME_PIXELS,
            max_decoded_bytes: MAX_DECODED_BYTES,
            max_decode_time: MAX_DECODE_TIME,
        }
    }
}

/// What the container says about its video stream, as OpenCV reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoInfo {
    /// Frames (`CAP_PROP_FRAME_COUNT`).
    pub total_frames: u32,
    /// Frames per second (`CAP_PROP_FPS`); 0 when unknown.
    pub fps: f64,
    /// `total_frames / fps` (0 when the rate is unknown), as vLLM computes it.
    pub duration: f64,
    /// Frame size as OpenCV gives the frames: after [`VideoInfo::rotation`]
    /// (`CAP_PROP_FRAME_WIDTH` and `CAP_PROP_FRAME_HEIGHT`).
    pub size: ImageSize,
    /// How the decoded frames are turned.
    pub rotation: Rotation,
}

/// How OpenCV's FFmpeg backend turns a clip's frames (`CAP_PROP_ORIENTATION_AUTO`, on by
/// default): by the angle of the stream's display matrix, `-round(av_display_rotation_get)`
/// taken into [0, 360), with `cv::rotate`, and only when that angle is 90, 180 or 270; a clip
/// with any other angle is left as it is.
///
/// ```
/// use iris_core::preprocess::video::ffmpeg::Rotation;
/// use iris_core::preprocess::{ImageSize, RgbImage};
/// // A phone held upright: FFmpeg's angle is -90, OpenCV's 90.
/// let upright = [0, 65536, 0, -65536, 0, 0, 0, 0, 1 << 30];
/// assert_eq!(Rotation::of_display_matrix(&upright), Rotation::Clockwise);
/// // A red pixel left of a blue one, turned counterclockwise: blue on top.
/// let frame = RgbImage { size: ImageSize::new(2, 1), pixels: vec![255, 0, 0, 0, 0, 255] };
/// let turned = Rotation::Counterclockwise.turn(frame);
/// assert_eq!(turned.size, ImageSize::new(1, 2));
/// assert_eq!(turned.pixels, [0, 0, 255, 255, 0, 0]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// No display matrix, or an angle of 0 or one OpenCV does not apply.
    None,
    /// Angle 90: `ROTATE_90_CLOCKWISE`.
    Clockwise,
    /// Angle 180: `ROTATE_180`.
    Half,
    /// Angle 270: `ROTATE_90_COUNTERCLOCKWISE`.
    Counterclockwise,
}

impl Rotation {
    /// The rotation OpenCV applies for a stream's display matrix (FFmpeg's 3x3, row by row,
    /// 16.16 fixed point but for the last column).
    #[must_use]
    pub fn of_display_matrix(matrix: &[i32; 9]) -> Rotation {
        // FFmpeg's av_display_rotation_get: the counterclockwise angle, NaN for a singular
        // matrix (OpenCV's angle is then no multiple of 90).
        let fixed = |i: usize| f64::from(matrix[i]) / 65536.0;
        let scale = [fixed(0).hypot(fixed(3)), fixed(1).hypot(fixed(4))];
        if scale[0] == 0.0 || scale[1] == 0.0 {
            return Rotation::None;
        }
        let counterclockwise =
            -((fixed(1) / scale[1]).atan2(fixed(0) / scale[0]) * 180.0 / std::f64::consts::PI);
        // OpenCV's cvRound rounds half to even; the angle is within [-180, 180].
        match (-counterclockwise.round_ties_even()).rem_euclid(360.0) {
            90.0 => Rotation::Clockwise,
            180.0 => Rotation::Half,
            270.0 => Rotation::Counterclockwise,
            _ => Rotation::None,
        }
    }

    /// The size of a `size` frame once turned (a quarter turn swaps the sides; turning back
    /// does the same).
    #[must_use]
    pub fn turn_size(self, size: ImageSize) -> ImageSize {
        match self {
            Rotation::Clockwise | Rotation::Counterclockwise => {
                ImageSize::new(size.height, size.width)
            }
            Rotation::None | Rotation::Half => size,
        }
    }

    /// `frame` turned: each pixel moved, none changed.
    #[must_use]
    pub fn turn(self, frame: RgbImage) -> RgbImage {
        if self == Rotation::None {
            return frame;
        }
        let (width, height) = (frame.size.width as usize, frame.size.height as usize);
        let size = self.turn_size(frame.size);
        let mut pixels = Vec::with_capacity(frame.pixels.len());
        // Row by row of the turned frame, the source pixel each position takes.
        for row in 0..size.height as usize {
            for col in 0..size.width as usize {
                let (x, y) = match self {
                    Rotation::Clockwise => (row, height - 1 - col),
                    Rotation::Half => (width - 1 - col, height - 1 - row),
                    Rotation::Counterclockwise => (width - 1 - row, col),
                    Rotation::None => (col, row),
                };
                let at = (y * width + x) * 3;
                pixels.extend_from_slice(&frame.pixels[at..at + 3]);
            }
        }
        RgbImage { size, pixels }
    }
}

/// The metadata vLLM's loaders return with the frames (`create_hf_metadata`), which its item
/// identifier hashes and its processors read.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoMetadata {
    /// Frames in the container.
    pub total_num_frames: u32,
    /// Its frame rate.
    pub fps: f64,
    /// `total_num_frames / fps`.
    pub duration: f64,
    /// The decoder (`opencv`, whose decoding this reproduces).
    pub video_backend: &'static str,
    /// The indices of the frames read.
    pub frames_indices: Vec<u32>,
    /// Whether every frame was read (the processor then samples itself).
    pub do_sample_frames: bool,
}

/// Frames read from a clip, with vLLM's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedVideo {
    /// The frames, in order.
    pub frames: Vec<RgbImage>,
    /// What vLLM's loader reports with them.
    pub metadata: VideoMetadata,
}

/// The FFmpeg programs.
#[derive(Debug, Clone)]
pub struct Ffmpeg {
    ffmpeg: PathBuf,
    ffprobe: PathBuf,
}

impl Ffmpeg {
    /// The programs at these paths, unchecked ([`Ffmpeg::locate`] checks that they run).
    pub fn with_programs(ffmpeg: impl Into<PathBuf>, ffprobe: impl Into<PathBuf>) -> Ffmpeg {
        Ffmpeg {
            ffmpeg: ffmpeg.into(),
            ffprobe: ffprobe.into(),
        }
    }

    /// The programs named by `IRIS_FFMPEG` and `IRIS_FFPROBE`, else `ffmpeg` and `ffprobe` on
    /// `PATH`, after checking that both run.
    ///
    /// # Errors
    /// [`VideoError::FfmpegMissing`], which says how to install them.
    pub fn locate() -> Result<Ffmpeg, VideoError> {
        let program = |var: &str, name: &str| {
            std::env::var_os(var).map_or_else(|| PathBuf::from(name), PathBuf::from)
        };
        let found = Ffmpeg {
            ffmpeg: program("IRIS_FFMPEG", "ffmpeg"),
            ffprobe: program("IRIS_FFPROBE", "ffprobe"),
        };
        for path in [&found.ffmpeg, &found.ffprobe] {
            let runs = Command::new(path)
                .arg("-version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            if !runs {
                return Err(VideoError::FfmpegMissing {
                    program: path.display().to_string(),
                });
            }
        }
        Ok(found)
    }

    /// The `ffmpeg` program found, for callers that encode with it (`iris bench`'s clips).
    pub fn ffmpeg_program(&self) -> &Path {
        &self.ffmpeg
    }

    /// Reads the clip's frame count, rate and size as OpenCV's FFmpeg backend reports them.
    ///
    /// # Errors
    /// [`VideoError::Decode`] when FFmpeg cannot open the clip, it has no video stream, or
    /// probing takes longer than `limits.max_decode_time`.
    pub fn probe(&self, path: &Path, limits: &VideoLimits) -> Result<VideoInfo, VideoError> {
        self.probe_until(path, Deadline::after(limits.max_decode_time))
    }

    fn probe_until(&self, path: &Path, deadline: Deadline) -> Result<VideoInfo, VideoError> {
        let json = self.report(
            &[
                "-select_streams",
                "v:0",
                "-show_entries",
                "stream=width,height,nb_frames,r_frame_rate,avg_frame_rate,duration,time_base:\
                 stream_side_data=displaymatrix:format=duration",
            ],
            path,
            deadline,
        )?;
        let stream = json["streams"]
            .as_array()
            .and_then(|streams| streams.first())
            .ok_or_else(|| VideoError::Decode {
                message: "the file has no video stream".to_owned(),
            })?;
        let dimension = |key: &str| {
            stream[key]
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| VideoError::Decode {
                    message: format!("the video stream has no {key}"),
                })
        };
        let rotation = display_matrix(stream)?
            .as_ref()
            .map_or(Rotation::None, Rotation::of_display_matrix);
        let size = rotation.turn_size(ImageSize::new(dimension("width")?, dimension("height")?));
        // FFmpeg's av_guess_frame_rate: the real base rate, unless it is implausibly high and
        // the average is plausible.
        let real = rate(&stream["r_frame_rate"]);
        let average = rate(&stream["avg_frame_rate"]);
        let fps = if average > 0.0 && real > 210.0 && average < 70.0 {
            average
        } else {
            real
        };
        let mut total = number(&stream["nb_frames"]).unwrap_or(0.0);
        if total <= 0.0 {
            // OpenCV: the container's duration (else the stream's) times the rate, rounded.
            let seconds = number(&json["format"]["duration"])
                .filter(|&s| s > 0.0)
                .or_else(|| number(&stream["duration"]))
                .unwrap_or(0.0);
            total = (seconds * fps + 0.5).floor();
        }
        if total <= 0.0 {
            // No count in the container (raw streams): count the packets, as vLLM counts
            // with a demuxing loop.
            total = self.count_packets(path, deadline)?;
        }
        let total_frames = f64_to_u32(total);
        let duration = if fps > 0.0 {
            f64::from(total_frames) / fps
        } else {
            0.0
        };
        Ok(VideoInfo {
            total_frames,
            fps,
            duration,
            size,
            rotation,
        })
    }

    fn count_packets(&self, path: &Path, deadline: Deadline) -> Result<f64, VideoError> {
        let json = self.report(
            &[
                "-select_streams",
                "v:0",
                "-count_packets",
                "-show_entries",
                "stream=nb_read_packets",
            ],
            path,
            deadline,
        )?;
        Ok(number(&json["streams"][0]["nb_read_packets"]).unwrap_or(0.0))
    }

    /// Runs ffprobe with `args` (after the confinement options) on `path` and returns its JSON
    /// report, parsed.
    fn report(&self, args: &[&str], path: &Path, deadline: Deadline) -> Result<Value, VideoError> {
        let mut command = Command::new(&self.ffprobe);
        command
            .args(["-v", "error"])
            .args(confinement())
            .args(args)
            .args(["-of", "json"])
            .arg(input(path));
        let finished = run_until(&mut command, "ffprobe", deadline, |stdout| {
            // One byte over the limit tells a report cut by it from one that fits.
            let mut report = Vec::new();
            stdout
                .take(REPORT_LIMIT + 1)
                .read_to_end(&mut report)
                .map_err(|err| VideoError::Decode {
                    message: format!("reading ffprobe's report: {err}"),
                })?;
            if report.len() as u64 > REPORT_LIMIT {
                return Err(VideoError::Decode {
                    message: format!("ffprobe's report is over {REPORT_LIMIT} bytes"),
                });
            }
            Ok(report)
        })?;
        if !finished.status.success() {
            return Err(VideoError::Decode {
                message: format!(
                    "could not open the video stream: {}",
                    failure(&finished.stderr, path).unwrap_or_else(|| finished.status.to_string())
                ),
            });
        }
        serde_json::from_slice(&finished.output).map_err(|err| VideoError::Decode {
            message: format!("ffprobe's report: {err}"),
        })
    }

    /// Decodes the clip from its first frame up to the last of `indices` and keeps those
    /// (each once, in order). A clip that ends early gives the frames it has, as OpenCV does;
    /// the metadata's indices then name only those.
    ///
    /// # Errors
    /// [`VideoError::TooLarge`] before decoding when a frame or the frames kept exceed
    /// `limits`; [`VideoError::Decode`] when FFmpeg fails before giving a frame, its output
    /// cannot be read, or decoding takes longer than `limits.max_decode_time`.
    pub fn read_frames(
        &self,
        path: &Path,
        info: &VideoInfo,
        indices: &[u32],
        limits: &VideoLimits,
    ) -> Result<(Vec<u32>, Vec<RgbImage>), VideoError> {
        self.read_frames_until(
            path,
            info,
            indices,
            limits,
            Deadline::after(limits.max_decode_time),
        )
    }

    fn read_frames_until(
        &self,
        path: &Path,
        info: &VideoInfo,
        indices: &[u32],
        limits: &VideoLimits,
        deadline: Deadline,
    ) -> Result<(Vec<u32>, Vec<RgbImage>), VideoError> {
        let pixels = info.size.pixel_count() as u64;
        if pixels > limits.max_frame_pixels {
            return Err(VideoError::TooLarge {
                what: format!("a frame of {}x{}", info.size.width, info.size.height),
                bytes: pixels,
                limit: limits.max_frame_pixels,
                unit: "pixels",
            });
        }
        let mut wanted: Vec<u32> = indices.to_vec();
        wanted.dedup();
        let frame_bytes = pixels * 3;
        let decoded = frame_bytes.saturating_mul(wanted.len() as u64);
        if decoded > limits.max_decoded_bytes {
            return Err(VideoError::TooLarge {
                what: format!(
                    "{} frames of {}x{}",
                    wanted.len(),
                    info.size.width,
                    info.size.height
                ),
                bytes: decoded,
                limit: limits.max_decoded_bytes,
                unit: "bytes",
            });
        }
        if wanted.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        // Every frame is decoded up to the last one wanted (as OpenCV grabs them), but only the
        // wanted ones are converted to RGB and piped: the select filter drops the others before
        // the conversion, and the output stops after the last.
        let terms: Vec<String> = wanted.iter().map(|i| format!("eq(n,{i})")).collect();
        let select = sum_tree(&terms);
        let frame_len = usize::try_from(frame_bytes).map_err(|_| VideoError::Decode {
            message: format!("a frame of {frame_bytes} bytes does not fit in memory"),
        })?;
        let count = wanted.len();
        // FFmpeg would turn the frames itself, not as OpenCV does (it also turns by other
        // angles, and the size would not be the one probed): they come unrotated and
        // `info.rotation` turns them.
        let coded = info.rotation.turn_size(info.size);
        let mut command = Command::new(&self.ffmpeg);
        command
            .args(["-v", "error", "-nostdin", "-noautorotate"])
            .args(confinement())
            .arg("-i")
            .arg(input(path))
            .args(["-map", "0:v:0", "-fps_mode", "passthrough"])
            .args(["-vf", &format!("select='{select}'")])
            .args(["-frames:v", &count.to_string()])
            .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"]);
        // The k-th frame out is the k-th wanted; a clip that ends early gives the first ones.
        let finished = run_until(&mut command, "ffmpeg", deadline, move |mut stdout| {
            let mut pixels = Vec::with_capacity(count);
            for _ in 0..count {
                let mut buffer = vec![0u8; frame_len];
                match stdout.read_exact(&mut buffer) {
                    Ok(()) => pixels.push(buffer),
                    Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => break,
                    Err(err) => {
                        return Err(VideoError::Decode {
                            message: format!("reading ffmpeg's frames: {err}"),
                        });
                    }
                }
            }
            Ok(pixels)
        })?;
        if finished.output.is_empty() {
            return Err(VideoError::Decode {
                message: failure(&finished.stderr, path)
                    .unwrap_or_else(|| "no frame could be decoded".to_owned()),
            });
        }
        let read = wanted[..finished.output.len()].to_vec();
        let frames = finished
            .output
            .into_iter()
            .map(|pixels| {
                info.rotation.turn(RgbImage {
                    size: coded,
                    pixels,
                })
            })
            .collect();
        Ok((read, frames))
    }
}

/// Decodes `bytes` (a clip in any container FFmpeg reads) and samples its frames as vLLM's
/// `loader` does, with its metadata: [`open_clip`], then [`OpenedClip::decode`].
///
/// # Errors
/// [`VideoError::Decode`] for a clip FFmpeg cannot open or decode, the sampling errors of
/// [`sample_frames`], [`VideoError::TooLarge`].
pub fn load_video(
    ffmpeg: &Ffmpeg,
    bytes: &[u8],
    loader: VideoLoader,
    options: &SamplingOptions,
    limits: &VideoLimits,
) -> Result<DecodedVideo, VideoError> {
    open_clip(ffmpeg, bytes, loader, options, limits)?.decode(ffmpeg, limits)
}

/// A clip probed and sampled, not yet decoded: what its frames will be is known (how many,
/// their size), so their tokens can be charged before a pixel is decoded.
#[derive(Debug)]
pub struct OpenedClip {
    /// The clip's bytes on disk, deleted when the clip is dropped.
    file: tempfile::NamedTempFile,
    info: VideoInfo,
    indices: Vec<u32>,
    /// The decode time limit began when the clip was opened: probing and decoding share it.
    deadline: Deadline,
}

impl OpenedClip {
    /// The frames the loader samples (each read once): at most what [`OpenedClip::decode`]
    /// returns, fewer only when the container claims frames it does not hold.
    #[must_use]
    pub fn frames(&self) -> usize {
        let mut wanted = self.indices.clone();
        wanted.dedup();
        wanted.len()
    }

    /// The frames' size.
    #[must_use]
    pub fn size(&self) -> ImageSize {
        self.info.size
    }

    /// Reads the sampled frames, within the time left of the clip's decode limit.
    ///
    /// # Errors
    /// As [`load_video`].
    pub fn decode(self, ffmpeg: &Ffmpeg, limits: &VideoLimits) -> Result<DecodedVideo, VideoError> {
        read_sampled(
            ffmpeg,
            self.file.path(),
            &self.info,
            &self.indices,
            limits,
            self.deadline,
        )
    }
}

/// Writes `bytes` to a temporary file, probes it and samples its frames as vLLM's `loader`
/// does; the decode time limit starts now.
///
/// # Errors
/// [`VideoError::Decode`] for a clip FFmpeg cannot open, the sampling errors of
/// [`sample_frames`].
pub fn open_clip(
    ffmpeg: &Ffmpeg,
    bytes: &[u8],
    loader: VideoLoader,
    options: &SamplingOptions,
    limits: &VideoLimits,
) -> Result<OpenedClip, VideoError> {
    let deadline = Deadline::after(limits.max_decode_time);
    let mut file = tempfile::NamedTempFile::new().map_err(|err| VideoError::Decode {
        message: format!("a temporary file for the clip: {err}"),
    })?;
    file.write_all(bytes)
        .and_then(|()| file.flush())
        .map_err(|err| VideoError::Decode {
            message: format!("writing the clip to a temporary file: {err}"),
        })?;
    let info = ffmpeg.probe_until(file.path(), deadline)?;
    let indices = sample_frames(loader, info.total_frames, info.fps, options)?;
    Ok(OpenedClip {
        file,
        info,
        indices,
        deadline,
    })
}

/// [`load_video`] on a file.
///
/// # Errors
/// As [`load_video`].
pub fn load_video_file(
    ffmpeg: &Ffmpeg,
    path: &Path,
    loader: VideoLoader,
    options: &SamplingOptions,
    limits: &VideoLimits,
) -> Result<DecodedVideo, VideoError> {
    // One deadline for all the runs, so that the limit bounds the whole request's decoding.
    let deadline = Deadline::after(limits.max_decode_time);
    let info = ffmpeg.probe_until(path, deadline)?;
    let indices = sample_frames(loader, info.total_frames, info.fps, options)?;
    read_sampled(ffmpeg, path, &info, &indices, limits, deadline)
}

/// The frames at `indices` of the clip at `path`, with vLLM's metadata.
fn read_sampled(
    ffmpeg: &Ffmpeg,
    path: &Path,
    info: &VideoInfo,
    indices: &[u32],
    limits: &VideoLimits,
    deadline: Deadline,
) -> Result<DecodedVideo, VideoError> {
    let (read, frames) = ffmpeg.read_frames_until(path, info, indices, limits, deadline)?;
    Ok(DecodedVideo {
        frames,
        metadata: VideoMetadata {
            total_num_frames: info.total_frames,
            fps: info.fps,
            duration: info.duration,
            video_backend: "opencv",
            do_sample_frames: read.len() as u64 == u64::from(info.total_frames),
            frames_indices: read,
        },
    })
}

/// `terms` added up as a balanced tree, `((a+b)+(c+d))`: FFmpeg's expression parser refuses
/// an expression nested too deep, and a flat `a+b+c+...` nests one level a term (over 100
/// terms are refused); the tree nests one level each time the count doubles (10 levels for
/// vLLM's 768 frames).
fn sum_tree(terms: &[String]) -> String {
    match terms {
        [] => "0".to_owned(),
        [one] => one.clone(),
        _ => {
            let (left, right) = terms.split_at(terms.len() / 2);
            format!("({}+{})", sum_tree(left), sum_tree(right))
        }
    }
}

/// The display matrix in an ffprobe report on a stream (`stream_side_data=displaymatrix`),
/// if it has one: ffprobe prints its rows as `"\n00000000:  a  b  u\n00000001: ..."`.
fn display_matrix(stream: &Value) -> Result<Option<[i32; 9]>, VideoError> {
    let Some(text) = stream["side_data_list"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|side| side["displaymatrix"].as_str())
    else {
        return Ok(None);
    };
    let values: Vec<i32> = text
        .lines()
        .filter_map(|line| line.split_once(':'))
        .flat_map(|(_, row)| row.split_whitespace().map(str::parse))
        .collect::<Result<_, _>>()
        .map_err(|_| unreadable_matrix(text))?;
    values
        .try_into()
        .map(Some)
        .map_err(|_| unreadable_matrix(text))
}

fn unreadable_matrix(text: &str) -> VideoError {
    VideoError::Decode {
        message: format!("ffprobe's display matrix {text:?} is not 9 numbers"),
    }
}

/// The input options that keep FFmpeg to the one local file, read as one of [`CONTAINERS`].
fn confinement() -> [&'static str; 4] {
    [
        "-protocol_whitelist",
        "file",
        "-format_whitelist",
        CONTAINERS,
    ]
}

/// `path` as FFmpeg's input: with the `file:` protocol named, so that a path with a colon is not
/// taken for another protocol's URL.
fn input(path: &Path) -> OsString {
    let mut url = OsString::from("file:");
    url.push(path);
    url
}

/// When the FFmpeg programs must have finished: `limit` after the decoding began (never, when
/// the limit is too large to be a time).
#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: Option<Instant>,
    limit: Duration,
}

impl Deadline {
    fn after(limit: Duration) -> Deadline {
        Deadline {
            at: Instant::now().checked_add(limit),
            limit,
        }
    }

    /// The time left (zero once past); `None` without a deadline.
    fn remaining(self) -> Option<Duration> {
        self.at
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    fn expired(self, program: &str) -> VideoError {
        VideoError::Decode {
            message: format!(
                "decoding took longer than {} s (the video decode time limit), so {program} was \
                 stopped",
                self.limit.as_secs_f64()
            ),
        }
    }
}

/// A running FFmpeg program, killed and reaped when dropped before it has exited, so that no
/// return (an error, the deadline) leaves it running, or unreaped as a zombie.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        // Errors are ignored: kill fails only for a program that has exited, which wait reaps.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a program gave.
struct Finished<T> {
    /// Its standard output, as the reader made it.
    output: T,
    /// How it exited.
    status: ExitStatus,
    /// The start of its standard error ([`STDERR_KEPT`] bytes).
    stderr: Vec<u8>,
}

/// Runs `command` (`program` names it in errors): `read` takes its standard output and another
/// thread its standard error, at once, so that the program filling one pipe while iris waits on
/// the other cannot block both. Waits for it to exit, at most until `deadline`, when it is
/// killed; an error from `read` kills it at once.
fn run_until<T: Send + 'static>(
    command: &mut Command,
    program: &'static str,
    deadline: Deadline,
    read: impl FnOnce(ChildStdout) -> Result<T, VideoError> + Send + 'static,
) -> Result<Finished<T>, VideoError> {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| VideoError::Decode {
            message: format!(
                "running {program} ({}): {err}",
                Path::new(command.get_program()).display()
            ),
        })?;
    let mut running = Running(child);
    let pipe_missing = |which: &str| VideoError::Decode {
        message: format!("{program}'s {which} was not piped"),
    };
    let stdout = running
        .0
        .stdout
        .take()
        .ok_or_else(|| pipe_missing("output"))?;
    let stderr = running
        .0
        .stderr
        .take()
        .ok_or_else(|| pipe_missing("error output"))?;
    // The readers end when the pipes close, which killing the program does; a reader left
    // behind by an error here sends to a closed channel and ends.
    let (out_tx, out_rx) = mpsc::sync_channel(1);
    spawn_reader(program, move || {
        let _ = out_tx.send(read(stdout));
    })?;
    let (err_tx, err_rx) = mpsc::sync_channel(1);
    spawn_reader(program, move || {
        let _ = err_tx.send(keep_start(stderr));
    })?;
    let output = receive(&out_rx, deadline, program)??;
    let status = wait_until(&mut running.0, deadline, program)?;
    let stderr = receive(&err_rx, deadline, program)?;
    Ok(Finished {
        output,
        status,
        stderr,
    })
}

fn spawn_reader(program: &str, body: impl FnOnce() + Send + 'static) -> Result<(), VideoError> {
    thread::Builder::new()
        .name(format!("iris-{program}-pipe"))
        .spawn(body)
        .map(drop)
        .map_err(|err| VideoError::Decode {
            message: format!("a thread to read {program}'s output: {err}"),
        })
}

/// A reader's result, waited for until `deadline`.
fn receive<T>(rx: &Receiver<T>, deadline: Deadline, program: &str) -> Result<T, VideoError> {
    let received = match deadline.remaining() {
        Some(left) => rx.recv_timeout(left),
        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
    };
    received.map_err(|err| match err {
        RecvTimeoutError::Timeout => deadline.expired(program),
        RecvTimeoutError::Disconnected => VideoError::Decode {
            message: format!("the thread reading {program}'s output failed"),
        },
    })
}

/// Waits for `child` to exit, until `deadline`.
fn wait_until(
    child: &mut Child,
    deadline: Deadline,
    program: &str,
) -> Result<ExitStatus, VideoError> {
    // Its output has ended, so it is exiting: poll briefly, then less often.
    let mut pause = Duration::from_millis(1);
    loop {
        let exited = child.try_wait().map_err(|err| VideoError::Decode {
            message: format!("waiting for {program}: {err}"),
        })?;
        if let Some(status) = exited {
            return Ok(status);
        }
        let left = deadline.remaining().unwrap_or(pause);
        if left.is_zero() {
            return Err(deadline.expired(program));
        }
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Reads `pipe` to its end and keeps its first [`STDERR_KEPT`] bytes.
fn keep_start(mut pipe: impl Read) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                let room = STDERR_KEPT - kept.len();
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            // A pipe that cannot be read is not the clip's fault; the deadline still bounds
            // a program blocked on it.
            Err(_) => break,
        }
    }
    kept
}

/// FFmpeg's reason for a failure to read the clip at `path`: a container outside
/// [`CONTAINERS`] said so, else the first line it wrote, with the input's name (`file:` and the
/// path, a temporary file's for a server's request) said as "the clip": the caller names the
/// clip itself, and a client has no use for the server's paths.
fn failure(stderr: &[u8], path: &Path) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    if let Some(line) = text.lines().find(|l| l.contains("Format not on whitelist")) {
        // FFmpeg names the demuxer that refused: "[hls @ 0x55d…] Format not on whitelist …".
        let format = line
            .trim()
            .strip_prefix('[')
            .and_then(|rest| rest.split_once(" @ "))
            .map_or("unknown", |(name, _)| name);
        return Some(format!(
            "its format ({format}) is not a container iris decodes (it decodes {CONTAINERS})"
        ));
    }
    let named = input(path);
    first_line(stderr)
        .map(|line| without_addresses(&line.replace(named.to_string_lossy().as_ref(), "the clip")))
}

/// `line` without the addresses FFmpeg's log prefixes carry (`[mov,mp4,... @ 0x55f9b56c9e40]`
/// becomes `[mov,mp4,...]`): a client is told what failed, not where the server's heap is.
fn without_addresses(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(" @ 0x") {
        out.push_str(&rest[..at]);
        let after = &rest[at + " @ 0x".len()..];
        let digits = after
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(after.len());
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

fn first_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map(str::to_owned)
}

/// A JSON number or numeric string.
fn number(value: &Value) -> Option<f64> {
    value
        .as_f64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

/// An FFmpeg rational (`"30000/1001"`) as f64; 0 when absent or degenerate.
fn rate(value: &Value) -> f64 {
    let Some(text) = value.as_str() else {
        return 0.0;
    };
    let mut parts = text.splitn(2, '/');
    let num: f64 = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0.0);
    let den: f64 = parts.next().and_then(|d| d.parse().ok()).unwrap_or(1.0);
    if den == 0.0 { 0.0 } else { num / den }
}
