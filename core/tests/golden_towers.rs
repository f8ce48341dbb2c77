//! The three towers against transformers' outputs on the same weights and pixel values.
//!
//! `tests/data/golden/<model>/` holds a small random-weight checkpoint (config, preprocessor
//! config, safetensors with Hugging Face names) and `golden.safetensors` with the pixel values
//! and grids of two images and the tower's outputs, produced by `tools/golden/make_golden.py`;
//! `tests/data/golden/video/<model>.safetensors` holds a five-frame video's (three temporal
//! groups, the last frame repeated) through the family's video processor and the same tower,
//! by `tools/golden/make_video_golden.py`.
//! The tower must agree to a relative error of 1e-4 in f32, and in bf16 (weights and
//! activations rounded to bf16, products on the CPU device's native bf16 kernels where the CPU
//! has them) to [`BF16_TOLERANCE`] of the same f32 outputs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::layout::Grid;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{Family, ModelSpec, WeightSource};
use iris_core::preprocess::video::{VideoResize, preprocess_frames};
use iris_core::preprocess::{ImageSize, RgbImage};
use iris_plugin::{DType, Plugin};
use safetensors::SafeTensors;

/// Relative error bound for f32.
const TOLERANCE: f64 = 1e-4;
/// Relative error bound for bf16: a few units of bf16's 2^-8 rounding, accumulated over the
/// tower's layers.
const BF16_TOLERANCE: f64 = 3e-2;

fn golden_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/golden")
        .join(model)
}

fn allocator() -> Arc<CachingAllocator> {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "1GiB".into())])
        .expect("the CPU device opens");
    CachingAllocator::new(Arc::new(device))
}

fn f32s(tensors: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let view = tensors
        .tensor(name)
        .unwrap_or_else(|_| panic!("golden has `{name}`"));
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn grids(tensors: &SafeTensors<'_>) -> Vec<Grid> {
    let view = tensors.tensor("grid_thw").expect("golden has grid_thw");
    let values: Vec<u32> = view
        .data()
        .chunks_exact(8)
        .map(|b| {
            let v = i64::from_le_bytes(b.try_into().expect("8 bytes"));
            u32::try_from(v).expect("small grid")
        })
        .collect();
    values.chunks_exact(3).map(|g| [g[0], g[1], g[2]]).collect()
}

/// `max |a - b| / max |b|` and `||a - b|| / ||b||`.
fn relative_errors(actual: &[f32], expected: &[f32]) -> (f64, f64) {
    assert_eq!(actual.len(), expected.len(), "output sizes differ");
    let mut max_diff = 0f64;
    let mut max_ref = 0f64;
    let mut diff_sq = 0f64;
    let mut ref_sq = 0f64;
    for (&a, &b) in actual.iter().zip(expected) {
        let (a, b) = (f64::from(a), f64::from(b));
        max_diff = max_diff.max((a - b).abs());
        max_ref = max_ref.max(b.abs());
        diff_sq += (a - b) * (a - b);
        ref_sq += b * b;
    }
    (max_diff / max_ref, (diff_sq / ref_sq).sqrt())
}

fn check_model(model: &str, dtype: DType, tolerance: f64) {
    check_golden(
        model,
        &format!("{model}/golden.safetensors"),
        dtype,
        tolerance,
    );
}

/// The tower on the pixel values of `file` (under the golden folder) against its outputs.
fn check_golden(model: &str, file: &str, dtype: DType, tolerance: f64) {
    let dir = golden_dir(model);
    let spec = ModelSpec::from_hf_dir(&dir).expect("golden config parses");
    let weights = WeightSource::Safetensors(vec![dir.clone()])
        .load(&spec.vision, dtype)
        .expect("golden weights load");
    let bytes = std::fs::read(dir.join("..").join(file)).expect("golden outputs exist");
    let golden = SafeTensors::deserialize(&bytes).expect("golden outputs parse");
    let grids = grids(&golden);
    let pixels = f32s(&golden, "pixel_values");

    let allocator = allocator();
    let runner = Runner::new(Arc::clone(&allocator));
    let tower =
        VisionTower::new(&runner, spec.vision.clone(), &weights, dtype).expect("weights upload");
    let row_len = spec.vision.patch_row_len() as u64;
    let rows = pixels.len() as u64 / row_len;

    // Peak activation memory predicted by planning equals the one the run reaches.
    let planner = Runner::planner(Arc::clone(&allocator));
    let planned_input = planner.upload_f32(&pixels, dtype, rows, row_len).unwrap();
    let planned = tower.forward(&planner, &planned_input, &grids).unwrap();
    drop(planned);
    drop(planned_input);
    let planned_peak = planner.planned_peak();

    let before = allocator.stats().allocated;
    allocator.reset_peaks();
    let input = runner.upload_f32(&pixels, dtype, rows, row_len).unwrap();
    let outputs = tower
        .forward(&runner, &input, &grids)
        .expect("the tower runs");
    let measured_peak = allocator.stats().peak_allocated - before;
    assert_eq!(
        planned_peak, measured_peak,
        "{model}: planned vs measured peak"
    );

    let mut embeddings = Vec::new();
    let mut deepstack: Vec<Vec<f32>> = Vec::new();
    for output in &outputs {
        embeddings.extend(runner.download_f32(&output.embeddings).unwrap());
        for (j, extra) in output.deepstack.iter().enumerate() {
            if deepstack.len() <= j {
                deepstack.push(Vec::new());
            }
            deepstack[j].extend(runner.download_f32(extra).unwrap());
        }
    }
    let (max_rel, norm_rel) = relative_errors(&embeddings, &f32s(&golden, "embeddings"));
    assert!(
        max_rel < tolerance && norm_rel < tolerance,
        "{model} {dtype}: embeddings differ: max-relative {max_rel:e}, norm-relative {norm_rel:e}"
    );
    for (j, values) in deepstack.iter().enumerate() {
        let (max_rel, norm_rel) =
            relative_errors(values, &f32s(&golden, &format!("deepstack.{j}")));
        assert!(
            max_rel < tolerance && norm_rel < tolerance,
            "{model} {dtype}: deepstack {j} differs: max-relative {max_rel:e}, norm-relative {norm_rel:e}"
        );
    }
    let expected_deepstack = spec.vision.deepstack_visual_indexes.len();
    assert_eq!(
        deepstack.len(),
        expected_deepstack,
        "{model}: deepstack outputs"
    );

    drop(outputs);
    drop(input);
    drop(tower);
    assert_eq!(
        allocator.stats().allocated,
        0,
        "{model}: every buffer returned"
    );
}

#[test]
fn qwen2_vl_matches_transformers() {
    check_model("qwen2_vl", DType::F32, TOLERANCE);
}

#[test]
fn qwen2_vl_in_bf16_stays_within_bf16_tolerance() {
    check_model("qwen2_vl", DType::BF16, BF16_TOLERANCE);
}

#[test]
fn qwen2_5_vl_matches_transformers() {
    check_model("qwen2_5_vl", DType::F32, TOLERANCE);
}

#[test]
fn qwen2_5_vl_in_bf16_stays_within_bf16_tolerance() {
    check_model("qwen2_5_vl", DType::BF16, BF16_TOLERANCE);
}

#[test]
fn qwen3_vl_matches_transformers() {
    check_model("qwen3_vl", DType::F32, TOLERANCE);
}

#[test]
fn qwen3_vl_in_bf16_stays_within_bf16_tolerance() {
    check_model("qwen3_vl", DType::BF16, BF16_TOLERANCE);
}

/// iris's video processing of the golden's frames gives transformers' pixel values, bit for
/// bit: the family's resize rule and the checkpoint's patch geometry and normalization, with the
/// bounds `make_video_golden.py` gave the processor.
fn check_video_processing(model: &str) {
    let spec = ModelSpec::from_hf_dir(&golden_dir(model)).expect("golden config parses");
    let bytes = std::fs::read(golden_dir("video").join(format!("{model}.safetensors")))
        .expect("the video golden exists");
    let golden = SafeTensors::deserialize(&bytes).expect("the video golden parses");
    let view = golden.tensor("frames").expect("frames");
    let (h, w) = (view.shape()[1], view.shape()[2]);
    let frames: Vec<RgbImage> = view
        .data()
        .chunks_exact(h * w * 3)
        .map(|pixels| RgbImage {
            size: ImageSize::new(u32::try_from(w).unwrap(), u32::try_from(h).unwrap()),
            pixels: pixels.to_vec(),
        })
        .collect();
    let mut config = spec.processor.clone();
    let unit = u64::from(config.factor());
    let (resize, frames_budgeted) = match spec.vision.family {
        Family::Qwen3Vl => (VideoResize::OverAllFrames, frames.len() as u64),
        _ => (VideoResize::PerFrame, 1),
    };
    // The processor's bounds were the frames' own size (in merge units, a side of `unit`).
    let units = (h as u64 / unit) * (w as u64 / unit);
    config.min_pixels = unit * unit;
    config.max_pixels = unit * unit * units * frames_budgeted;
    let video = preprocess_frames(&frames, &config, resize).expect("processed");
    assert_eq!(grids(&golden), vec![video.grid_thw], "{model}: grid");
    let expected = f32s(&golden, "pixel_values");
    assert_eq!(video.pixel_values.len(), expected.len(), "{model}: values");
    let differing = video
        .pixel_values
        .iter()
        .zip(&expected)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "{model}: pixel values differ from transformers'"
    );
}

/// Frames to pixel values to rows: iris's processing and tower against transformers'.
fn check_video(model: &str) {
    check_video_processing(model);
    check_golden(
        model,
        &format!("video/{model}.safetensors"),
        DType::F32,
        TOLERANCE,
    );
}

#[test]
fn qwen2_vl_video_matches_transformers() {
    check_video("qwen2_vl");
}

#[test]
fn qwen2_5_vl_video_matches_transformers() {
    check_video("qwen2_5_vl");
}

#[test]
fn qwen3_vl_video_matches_transformers() {
    check_video("qwen3_vl");
}

#[test]
fn videos_in_bf16_stay_within_bf16_tolerance() {
    for model in ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] {
        check_golden(
            model,
            &format!("video/{model}.safetensors"),
            DType::BF16,
            BF16_TOLERANCE,
        );
    }
}
