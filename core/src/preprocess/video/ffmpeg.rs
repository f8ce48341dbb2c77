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
//! The programs are found on `PATH`, or at `IRIS_FFMPEG` and `IRIS_FFPROBE`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use super::{SamplingOptions, VideoError, VideoLoader, f64_to_u32, sample_frames};
use crate::preprocess::{ImageSize, RgbImage};

/// vLLM's limit on one frame's pixels (`VLLM_MAX_IMAGE_PIXELS`'s default, Pillow's).
pub const MAX_FRAME_PIXELS: u64 = 178_956_970;
/// vLLM's limit on decoded bytes per request (`VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`).
pub const MAX_DECODED_BYTES: u64 = 715_827_880;

/// Limits on what a video may decode to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoLimits {
    /// Most pixels in one frame.
    pub max_frame_pixels: u64,
    /// Most bytes of RGB frames kept.
    pub max_decoded_bytes: u64,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits {
            max_frame_pixels: MAX_FRAME_PIXELS,
            max_decoded_bytes: MAX_DECODED_BYTES,
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
    /// Frame size.
    pub size: ImageSize,
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
    /// [`VideoError::Decode`] when FFmpeg cannot open the clip or it has no video stream.
    pub fn probe(&self, path: &Path) -> Result<VideoInfo, VideoError> {
        let out = run(
            Command::new(&self.ffprobe)
                .args(["-v", "error", "-select_streams", "v:0", "-show_entries"])
                .arg("stream=width,height,nb_frames,r_frame_rate,avg_frame_rate,duration,time_base:format=duration")
                .args(["-of", "json"])
                .arg(path),
        )?;
        let json: Value = serde_json::from_slice(&out).map_err(|err| VideoError::Decode {
            message: format!("ffprobe's report: {err}"),
        })?;
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
        let size = ImageSize::new(dimension("width")?, dimension("height")?);
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
            total = self.count_packets(path)?;
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
        })
    }

    fn count_packets(&self, path: &Path) -> Result<f64, VideoError> {
        let out = run(Command::new(&self.ffprobe)
            .args(["-v", "error", "-select_streams", "v:0", "-count_packets"])
            .args(["-show_entries", "stream=nb_read_packets", "-of", "json"])
            .arg(path))?;
        let json: Value = serde_json::from_slice(&out).map_err(|err| VideoError::Decode {
            message: format!("ffprobe's report: {err}"),
        })?;
        Ok(number(&json["streams"][0]["nb_read_packets"]).unwrap_or(0.0))
    }

    /// Decodes the clip from its first frame up to the last of `indices` and keeps those
    /// (each once, in order). A clip that ends early gives the frames it has, as OpenCV does;
    /// the metadata's indices then name only those.
    ///
    /// # Errors
    /// [`VideoError::TooLarge`] before decoding when a frame or the frames kept exceed
    /// `limits`; [`VideoError::Decode`] when FFmpeg fails before giving a frame.
    pub fn read_frames(
        &self,
        path: &Path,
        info: &VideoInfo,
        indices: &[u32],
        limits: &VideoLimits,
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
        let select = wanted
            .iter()
            .map(|i| format!("eq(n,{i})"))
            .collect::<Vec<_>>()
            .join("+");
        let mut child = Command::new(&self.ffmpeg)
            .args(["-v", "error", "-nostdin", "-i"])
            .arg(path)
            .args(["-map", "0:v:0", "-fps_mode", "passthrough"])
            .args(["-vf", &format!("select='{select}'")])
            .args(["-frames:v", &wanted.len().to_string()])
            .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|err| VideoError::Decode {
                message: format!("running {}: {err}", self.ffmpeg.display()),
            })?;
        let mut stdout = child.stdout.take().ok_or_else(|| VideoError::Decode {
            message: "ffmpeg's output".to_owned(),
        })?;
        let frame_len = usize::try_from(frame_bytes).map_err(|_| VideoError::Decode {
            message: "frame size".to_owned(),
        })?;
        let mut buffer = vec![0u8; frame_len];
        let mut frames = Vec::with_capacity(wanted.len());
        let mut read = Vec::with_capacity(wanted.len());
        // The k-th frame out is the k-th wanted; a clip that ends early gives the first ones.
        for &index in &wanted {
            match stdout.read_exact(&mut buffer) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(err) => {
                    return Err(VideoError::Decode {
                        message: format!("reading frames: {err}"),
                    });
                }
            }
            read.push(index);
            frames.push(RgbImage {
                size: info.size,
                pixels: buffer.clone(),
            });
        }
        drop(stdout);
        let output = child.wait_with_output().map_err(|err| VideoError::Decode {
            message: format!("waiting for ffmpeg: {err}"),
        })?;
        if frames.is_empty() {
            return Err(VideoError::Decode {
                message: first_line(&output.stderr)
                    .unwrap_or_else(|| "no frame could be decoded".to_owned()),
            });
        }
        Ok((read, frames))
    }
}

/// Decodes `bytes` (a clip in any container FFmpeg reads) and samples its frames as vLLM's
/// `loader` does, with its metadata.
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
    let mut file = tempfile::NamedTempFile::new().map_err(|err| VideoError::Decode {
        message: format!("a temporary file for the clip: {err}"),
    })?;
    file.write_all(bytes)
        .and_then(|()| file.flush())
        .map_err(|err| VideoError::Decode {
            message: format!("writing the clip to a temporary file: {err}"),
        })?;
    load_video_file(ffmpeg, file.path(), loader, options, limits)
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
    let info = ffmpeg.probe(path)?;
    let indices = sample_frames(loader, info.total_frames, info.fps, options)?;
    let (read, frames) = ffmpeg.read_frames(path, &info, &indices, limits)?;
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

/// Runs a program to completion and returns its standard output.
fn run(command: &mut Command) -> Result<Vec<u8>, VideoError> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|err| VideoError::Decode {
            message: format!("running ffprobe: {err}"),
        })?;
    if !output.status.success() {
        return Err(VideoError::Decode {
            message: format!(
                "could not open the video stream: {}",
                first_line(&output.stderr).unwrap_or_else(|| output.status.to_string())
            ),
        });
    }
    Ok(output.stdout)
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
