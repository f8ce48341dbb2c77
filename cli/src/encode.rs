//! `iris encode`: preprocess images, run a vision tower on the selected device, and write the
//! embeddings to a safetensors file.
//!
//! For measurements, `--warmup` keeps one-time work out of the timed calls, `--repeat` times one
//! batch several times in the same process (steady state, with the weights resident), and
//! `--timings-json` writes every call's time as [`Timings`] for scripts (tools/gpu-check).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use iris_core::encoder::exec::{Runner, Tensor};
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{DUMMY_DEFAULT_SEED, ModelSpec, WeightSource};
use iris_core::preprocess::video::ffmpeg::{Ffmpeg, VideoLimits, load_video_file};
use iris_core::preprocess::video::{SamplingOptions, preprocess_frames};
use iris_core::preprocess::{DecodeLimits, ImageSize, preprocess};
use iris_plugin::DType;
use safetensors::tensor::{Dtype as StDtype, TensorView};

use crate::settings::{GlobalArgs, print_stdout, registry};

/// Which model to run, shared by the commands that load one.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Built-in model preset (qwen2-vl-2b, qwen2.5-vl-7b, qwen3-vl-8b, tiny, ...).
    #[arg(long, conflicts_with = "model_dir", default_value = "tiny")]
    pub model: String,
    /// A Hugging Face model directory (config.json, preprocessor_config.json, safetensors).
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// `dummy` (deterministic random) or safetensors files; with --model-dir, defaults to the
    /// directory's safetensors files, otherwise to `dummy`.
    #[arg(long, value_name = "dummy|FILE", num_args = 1..)]
    pub weights: Vec<String>,
    /// Run dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// Arguments of `iris encode`.
#[derive(Debug, Args)]
pub struct EncodeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Output safetensors file.
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// Encode all images in one tower call (variable-length attention over the batch) and
    /// report the batch's time, instead of one call and one time per image.
    #[arg(long)]
    pub batch: bool,
    /// Run the first tower call once before the others and discard it, so that one-time work at
    /// first use (the CPU device packing constant weights for its bf16 kernels, a GPU loading
    /// its kernels, the allocator growing to its working set) stays out of the printed times
    /// (--timings-json reports it apart, as the first call). For measurements; it costs one
    /// extra forward pass.
    #[arg(long)]
    pub warmup: bool,
    /// With --batch: run the batch this many times (after the warm-up, if any) and report each
    /// call's time; the embeddings written are the first call's (every call computes the same).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "batch",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Write the time of every tower call, in milliseconds, as JSON to this file (see
    /// [`Timings`]).
    #[arg(long, value_name = "FILE")]
    pub timings_json: Option<PathBuf>,
    /// Lower bound on resized pixels, replacing the model's `min_pixels` (as a request's
    /// `mm_processor_kwargs.min_pixels` does in `iris serve`).
    #[arg(long, value_name = "PIXELS")]
    pub min_pixels: Option<u64>,
    /// Upper bound on resized pixels, replacing the model's `max_pixels` (as a request's
    /// `mm_processor_kwargs.max_pixels` does in `iris serve`).
    #[arg(long, value_name = "PIXELS")]
    pub max_pixels: Option<u64>,
    /// Videos (any container and codec FFmpeg reads), sampled and processed as vLLM's
    /// encoder does for the model (its loader's frames, its video processor); repeatable.
    /// Needs the FFmpeg programs.
    #[arg(long = "video", value_name = "FILE")]
    pub videos: Vec<PathBuf>,
    /// Frames per second to sample from videos (vLLM's `media_io_kwargs.video.fps`).
    #[arg(long, value_name = "FPS", default_value_t = SamplingOptions::default().fps)]
    pub video_fps: f64,
    /// Images (PNG, JPEG, WebP, GIF, BMP or TIFF).
    #[arg(required_unless_present = "videos", value_name = "IMAGE")]
    pub images: Vec<PathBuf>,
}

/// One item to encode: an image or a video, preprocessed.
struct Input {
    /// The output tensor's name (`image.N` or `video.N`).
    name: String,
    path: PathBuf,
    pixel_values: Vec<f32>,
    grid_thw: [u32; 3],
    original_size: ImageSize,
    resized_size: ImageSize,
    tokens: u32,
    /// Frames read, for a video.
    frames: Option<usize>,
}

/// What `--timings-json` writes: the run's set-up and the time of each tower call, in
/// milliseconds from the upload of the pixels to the read-back of the last output (the same
/// span the printed times cover), and of its forward pass alone.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Timings {
    /// The `--model` preset or the `--model-dir` path.
    pub model: String,
    /// The run dtype.
    pub dtype: String,
    /// The device's name.
    pub device: String,
    /// The plugin that provides the device.
    pub plugin: String,
    /// Whether all images ran in one tower call (`--batch`).
    pub batch: bool,
    /// Items given (images and videos).
    pub images: usize,
    /// Embedding tokens of all the images: one call's with `--batch`.
    pub tokens: u64,
    /// Loading the weights onto the device.
    pub load_ms: f64,
    /// Whether the first call was a warm-up (`--warmup`): its output is discarded and
    /// `calls_ms` leaves it out.
    pub warmup: bool,
    /// The process's first tower call: the warm-up with `--warmup`, else `calls_ms[0]`. It
    /// carries the one-time work of first use, so it is reported apart from the steady state.
    pub first_call_ms: f64,
    /// Every call after the warm-up, in order: one per image, or the batch `--repeat` times.
    pub calls_ms: Vec<f64>,
    /// The forward pass of the first call alone (see `forward_ms`).
    pub first_forward_ms: f64,
    /// The forward pass alone of each call in `calls_ms`: from the pixels on the device (the
    /// upload waited for) to every output on the device (the device waited for), without the
    /// upload and the read-back to host f32. What a serving step spends in the tower, and the
    /// span a framework's model call covers when its inputs and outputs stay on the device.
    pub forward_ms: Vec<f64>,
}

/// Runs `iris encode`.
pub fn run(global: &GlobalArgs, args: &EncodeArgs) -> anyhow::Result<ExitCode> {
    let dtype = args.model.dtype()?;
    let spec = args.model.spec()?;
    let source = args.model.weight_source()?;
    let mut processor = spec.processor.clone();
    if let Some(min_pixels) = args.min_pixels {
        processor.min_pixels = min_pixels;
    }
    if let Some(max_pixels) = args.max_pixels {
        processor.max_pixels = max_pixels;
    }
    processor
        .validate()
        .context("--min-pixels/--max-pixels: bad processor settings")?;
    let limits = DecodeLimits::default();
    // The resized images must fit what a decoded one may be: a --min-pixels of 10^13 would
    // otherwise resize a small image to tens of terabytes.
    for (flag, value) in [
        ("--min-pixels", args.min_pixels),
        ("--max-pixels", args.max_pixels),
    ] {
        if let Some(pixels) = value.filter(|&p| p > limits.max_pixels) {
            anyhow::bail!(
                "{flag} {pixels} is above {} pixels, the most an image may decode to",
                limits.max_pixels
            );
        }
    }

    // Preprocess everything first: a bad image or video fails before any device work.
    let mut inputs = Vec::with_capacity(args.images.len() + args.videos.len());
    for (index, path) in args.images.iter().enumerate() {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let image = preprocess(&bytes, &processor, &limits)
            .with_context(|| format!("{}: cannot preprocess", path.display()))?;
        inputs.push(Input {
            name: format!("image.{index}"),
            path: path.clone(),
            pixel_values: image.pixel_values,
            grid_thw: image.grid_thw,
            original_size: image.original_size,
            resized_size: image.resized_size,
            tokens: image.tokens,
            frames: None,
        });
    }
    if !args.videos.is_empty() {
        let video = spec.video_processing(args.model.model_dir.as_deref())?;
        let mut config = video.config;
        if let Some(min_pixels) = args.min_pixels {
            config.min_pixels = min_pixels;
        }
        if let Some(max_pixels) = args.max_pixels {
            config.max_pixels = max_pixels;
        }
        let ffmpeg = Ffmpeg::locate()?;
        let sampling = SamplingOptions {
            fps: args.video_fps,
            temporal_patch_size: config.temporal_patch_size,
            ..SamplingOptions::default()
        };
        for (index, path) in args.videos.iter().enumerate() {
            let decoded = load_video_file(
                &ffmpeg,
                path,
                video.loader,
                &sampling,
                &VideoLimits::default(),
            )
            .with_context(|| format!("{}: cannot decode", path.display()))?;
            let processed = preprocess_frames(&decoded.frames, &config, video.resize)
                .with_context(|| format!("{}: cannot preprocess", path.display()))?;
            inputs.push(Input {
                name: format!("video.{index}"),
                path: path.clone(),
                pixel_values: processed.pixel_values,
                grid_thw: processed.grid_thw,
                original_size: processed.original_size,
                resized_size: processed.resized_size,
                tokens: processed.tokens,
                frames: Some(decoded.frames.len()),
            });
        }
    }

    let config = global.config()?;
    let device = registry(&config).open_selected(&config)?;
    let (device_label, plugin_label) = (
        device.description().name.clone(),
        device.plugin().name().to_owned(),
    );
    let device_name = format!("{device_label} ({plugin_label})");
    let allocator = CachingAllocator::new(Arc::new(device));
    let runner = Runner::new(Arc::clone(&allocator));

    let started = Instant::now();
    let weights = source
        .load(&spec.vision, dtype)
        .context("cannot load weights")?;
    let tower = VisionTower::from_host(&runner, spec.vision.clone(), weights, dtype)?;
    let load_s = started.elapsed().as_secs_f64();
    print_stdout(&format!(
        "model {} ({:?}), {} weights in {dtype} ({} bytes) on {device_name}, loaded in {load_s:.2} s\n",
        spec.name,
        spec.vision.family,
        source_name(&source),
        tower.weight_bytes(),
    ))?;

    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    let call = |group: &[usize]| encode_group(&runner, &tower, &spec, dtype, &inputs, group);
    // One group per tower call: every image alone, or all of them together.
    let groups: Vec<Vec<usize>> = if args.batch {
        vec![(0..inputs.len()).collect()]
    } else {
        (0..inputs.len()).map(|index| vec![index]).collect()
    };
    let warmup = match (args.warmup, groups.first()) {
        (true, Some(first)) => Some(call(first)?.1),
        _ => None,
    };
    let mut calls: Vec<CallTimes> = Vec::new();
    for group in &groups {
        let (host, times) = call(group)?;
        calls.push(times);
        let elapsed = times.call_s;
        for (&index, parts) in group.iter().zip(host) {
            for (j, (bytes, shape)) in parts.into_iter().enumerate() {
                let name = match j {
                    0 => inputs[index].name.clone(),
                    _ => format!("{}.deepstack.{}", inputs[index].name, j - 1),
                };
                tensors.push((name, bytes, shape));
            }
            let image = &inputs[index];
            let path = &image.path;
            let timing = if group.len() == 1 {
                format!("{elapsed:.3} s")
            } else {
                format!("batch of {} in {elapsed:.3} s", group.len())
            };
            let frames = image
                .frames
                .map_or_else(String::new, |n| format!("{n} frames of "));
            print_stdout(&format!(
                "{}: {frames}{}x{} -> {}x{}, grid {:?}, {} tokens, {timing}\n",
                path.display(),
                image.original_size.width,
                image.original_size.height,
                image.resized_size.width,
                image.resized_size.height,
                image.grid_thw,
                image.tokens,
            ))?;
        }
    }
    // `--repeat` requires `--batch`, so there is one group to run again.
    if let Some(group) = groups.first().filter(|_| args.repeat > 1) {
        for _ in 1..args.repeat {
            calls.push(call(group)?.1);
        }
        let calls_s: Vec<f64> = calls.iter().map(|c| c.call_s).collect();
        let forward_s: Vec<f64> = calls.iter().map(|c| c.forward_s).collect();
        print_stdout(&format!(
            "{} calls of the batch of {}: {}; forward pass alone: {}\n",
            calls.len(),
            group.len(),
            spread(&calls_s),
            spread(&forward_s)
        ))?;
    }
    drop(tower);
    if let Some(path) = &args.timings_json {
        let ms = |s: f64| s * 1e3;
        let first = warmup.or(calls.first().copied());
        let timings = Timings {
            model: args.model.model_id(),
            dtype: dtype.to_string(),
            device: device_label,
            plugin: plugin_label,
            batch: args.batch,
            images: inputs.len(),
            tokens: inputs.iter().map(|input| u64::from(input.tokens)).sum(),
            load_ms: ms(load_s),
            warmup: warmup.is_some(),
            // At least one image is required, so there is a first call.
            first_call_ms: ms(first.map_or(0.0, |c| c.call_s)),
            calls_ms: calls.iter().map(|c| ms(c.call_s)).collect(),
            first_forward_ms: ms(first.map_or(0.0, |c| c.forward_s)),
            forward_ms: calls.iter().map(|c| ms(c.forward_s)).collect(),
        };
        let text = serde_json::to_string_pretty(&timings)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write --timings-json {}", path.display()))?;
    }
    write_safetensors(&args.out, &tensors, &spec)?;
    print_stdout(&format!(
        "wrote {} tensors to {}\n",
        tensors.len(),
        args.out.display()
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// A tensor's bytes (little-endian f32) and shape, as read back from the device.
type HostTensor = (Vec<u8>, Vec<usize>);

/// The time of one tower call.
#[derive(Debug, Clone, Copy)]
struct CallTimes {
    /// Upload, forward pass and read-back of every output: the whole call.
    call_s: f64,
    /// The forward pass alone, the device waited for before and after it.
    forward_s: f64,
}

/// One tower call over the images `group` names: upload, forward, and read-back of every
/// output (embeddings, then deepstack features), which waits for the device, so the call's
/// time covers the whole encode; the forward pass is timed apart, between two waits for the
/// device.
fn encode_group(
    runner: &Runner,
    tower: &VisionTower,
    spec: &ModelSpec,
    dtype: DType,
    inputs: &[Input],
    group: &[usize],
) -> anyhow::Result<(Vec<Vec<HostTensor>>, CallTimes)> {
    let row_len = spec.vision.patch_row_len() as u64;
    let started = Instant::now();
    let (pixels, grids) = batch_inputs(inputs, group);
    let rows = pixels.len() as u64 / row_len;
    let input = runner.upload_f32(&pixels, dtype, rows, row_len)?;
    runner.allocator().synchronize()?;
    let forward_started = Instant::now();
    let outputs = tower.forward(runner, &input, &grids)?;
    runner.allocator().synchronize()?;
    let forward_s = forward_started.elapsed().as_secs_f64();
    drop(input);
    let mut host = Vec::with_capacity(outputs.len());
    for output in &outputs {
        let mut parts = vec![download(runner, &output.embeddings)?];
        for extra in &output.deepstack {
            parts.push(download(runner, extra)?);
        }
        host.push(parts);
    }
    let call_s = started.elapsed().as_secs_f64();
    Ok((host, CallTimes { call_s, forward_s }))
}

/// `median 0.007 s, min 0.007 s, max 0.008 s` over `seconds` (not empty).
fn spread(seconds: &[f64]) -> String {
    let mut sorted = seconds.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
    let mid = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    };
    format!("median {median:.3} s, min {min:.3} s, max {max:.3} s")
}

/// The pixel rows and grids of the images `group` names, concatenated for one tower call.
fn batch_inputs(inputs: &[Input], group: &[usize]) -> (Vec<f32>, Vec<[u32; 3]>) {
    let pixels = group
        .iter()
        .flat_map(|&index| inputs[index].pixel_values.iter().copied())
        .collect();
    let grids = group.iter().map(|&index| inputs[index].grid_thw).collect();
    (pixels, grids)
}

/// A tensor's values as little-endian f32 bytes and its shape.
fn download(runner: &Runner, tensor: &Tensor) -> anyhow::Result<HostTensor> {
    let values = runner.download_f32(tensor)?;
    let shape = vec![
        usize::try_from(tensor.rows())?,
        usize::try_from(tensor.cols())?,
    ];
    Ok((values.iter().flat_map(|v| v.to_le_bytes()).collect(), shape))
}

impl ModelArgs {
    /// The run dtype `--dtype` names.
    ///
    /// # Errors
    /// A dtype other than f32, f16 or bf16.
    pub fn dtype(&self) -> anyhow::Result<DType> {
        // Towers compute in floating point: the ABI's integer types (index tensors) are not
        // a model's dtype.
        DType::parse(&self.dtype)
            .filter(|dtype| matches!(*dtype, DType::F32 | DType::F16 | DType::BF16))
            .with_context(|| format!("--dtype: expected f32, f16 or bf16, got `{}`", self.dtype))
    }

    /// The model `--model` or `--model-dir` names.
    ///
    /// # Errors
    /// An unknown preset or an unreadable model directory.
    pub fn spec(&self) -> anyhow::Result<ModelSpec> {
        Ok(match &self.model_dir {
            Some(dir) => ModelSpec::from_hf_dir(dir)?,
            None => ModelSpec::preset(&self.model)?,
        })
    }

    /// The model id as the user named it: the `--model` preset, or the `--model-dir` path as
    /// given (vLLM hashes its `--model` string into item identifiers the same way).
    #[must_use]
    pub fn model_id(&self) -> String {
        match &self.model_dir {
            Some(dir) => dir.display().to_string(),
            None => self.model.clone(),
        }
    }

    /// The weights `--weights` asks for.
    ///
    /// # Errors
    /// `dummy` combined with files.
    pub fn weight_source(&self) -> anyhow::Result<WeightSource> {
        match self.weights.as_slice() {
            [] => Ok(match &self.model_dir {
                Some(dir) => WeightSource::Safetensors(vec![dir.clone()]),
                None => WeightSource::Dummy {
                    seed: DUMMY_DEFAULT_SEED,
                },
            }),
            [only] if only == "dummy" => Ok(WeightSource::Dummy {
                seed: DUMMY_DEFAULT_SEED,
            }),
            files => {
                if files.iter().any(|f| f == "dummy") {
                    bail!("--weights: `dummy` cannot be combined with files");
                }
                Ok(WeightSource::Safetensors(
                    files.iter().map(PathBuf::from).collect(),
                ))
            }
        }
    }
}

fn source_name(source: &WeightSource) -> String {
    match source {
        WeightSource::Dummy { .. } => "dummy".to_owned(),
        WeightSource::Safetensors(paths) => format!("{} safetensors path(s)", paths.len()),
    }
}

fn write_safetensors(
    out: &Path,
    tensors: &[(String, Vec<u8>, Vec<usize>)],
    spec: &ModelSpec,
) -> anyhow::Result<()> {
    let views = tensors
        .iter()
        .map(|(name, bytes, shape)| {
            TensorView::new(StDtype::F32, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .with_context(|| format!("tensor {name}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let metadata = HashMap::from([
        ("model".to_owned(), spec.name.clone()),
        ("producer".to_owned(), "iris encode".to_owned()),
    ]);
    safetensors::serialize_to_file(views, Some(metadata), out)
        .with_context(|| format!("cannot write {}", out.display()))
}
