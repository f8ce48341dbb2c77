//! A tower's weights are held once on the CPU device: after loading and running a tower, the
//! device holds about the checkpoint's bytes for them, packed copies included (a packed weight
//! replaces its buffer's pages instead of sitting beside them), and reading the weights back
//! gives exactly the bytes loaded.

use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::{CachingAllocator, MemorySnapshot};
use iris_core::model::{ModelSpec, WeightSource};
use iris_plugin::{DType, Plugin};

/// What the device may hold for the weights beyond the checkpoint's bytes: the packed panels'
/// padding and the partial pages at each weight's ends (well under 1% at Qwen2-VL's widths).
const TOLERANCE: f64 = 0.03;

fn allocator() -> Arc<CachingAllocator> {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "2GiB".into())])
        .expect("the CPU device opens");
    CachingAllocator::new(Arc::new(device))
}

/// Qwen2-VL-2B's widths (packing pads nothing there) with two blocks, so that it runs in a
/// test's time.
fn spec() -> ModelSpec {
    let mut spec = iris_core::model::presets::get("qwen2-vl-2b").expect("a preset");
    spec.vision.depth = 2;
    spec
}

/// Bytes the device holds for live buffers and for copies beside them, over the checkpoint's.
fn held_over_checkpoint(allocator: &Arc<CachingAllocator>, checkpoint: u64) -> f64 {
    allocator.empty_cache().expect("the cache empties");
    let snapshot = MemorySnapshot::take(allocator).expect("a snapshot");
    let held = snapshot.allocator_allocated + snapshot.plugin_held;
    eprintln!(
        "live buffers {} + held beside them {} = {held} bytes for a checkpoint of {checkpoint}",
        snapshot.allocator_allocated, snapshot.plugin_held
    );
    held as f64 / checkpoint as f64
}

fn check(dtype: DType) {
    let spec = spec();
    let source = WeightSource::Dummy { seed: 7 };
    let host = source.load(&spec.vision, dtype).expect("weights");
    let checkpoint = host.total_bytes();
    let allocator = allocator();
    let tier = allocator.device().description().property("kernel_tier");
    eprintln!("{dtype} on the CPU device, kernel tier {tier:?}");
    let runner = Runner::new(Arc::clone(&allocator));
    let tower = VisionTower::from_host(&runner, spec.vision.clone(), host, dtype).expect("upload");

    // One forward pass: products pack their weights on first use.
    let grid = [1, 4, 4];
    let row_len = spec.vision.patch_row_len();
    let pixels: Vec<f32> = (0..16 * row_len).map(|i| (i % 17) as f32 / 17.0).collect();
    let input = runner
        .upload_f32(&pixels, dtype, 16, row_len as u64)
        .expect("pixels");
    let outputs = tower.forward(&runner, &input, &[grid]).expect("forward");
    let first = runner
        .download_f32(&outputs[0].embeddings)
        .expect("download");
    drop(outputs);
    assert!(first.iter().all(|v| v.is_finite()), "finite embeddings");
    drop(input);
    let ratio = held_over_checkpoint(&allocator, checkpoint);
    assert!(
        ratio <= 1.0 + TOLERANCE,
        "{dtype}: the device holds {ratio:.3}x the checkpoint's bytes for the weights"
    );

    // Reading the weights back gives the bytes loaded, packed or not, and still one copy.
    let back = tower.to_host(&runner).expect("weights read back");
    let loaded = source.load(&spec.vision, dtype).expect("weights");
    assert!(
        back.iter().eq(loaded.iter()),
        "{dtype}: weights read back differ"
    );
    drop((back, loaded));
    let ratio = held_over_checkpoint(&allocator, checkpoint);
    assert!(
        ratio <= 1.0 + TOLERANCE,
        "{dtype}: after reading back, the device holds {ratio:.3}x"
    );

    // The weights still compute the same embeddings.
    let input = runner
        .upload_f32(&pixels, dtype, 16, row_len as u64)
        .expect("pixels");
    let again = tower.forward(&runner, &input, &[grid]).expect("forward");
    let again = runner.download_f32(&again[0].embeddings).expect("download");
    assert_eq!(
        first, again,
        "{dtype}: embeddings after reading the weights back"
    );
}

#[test]
fn bf16_weights_are_held_once() {
    check(DType::BF16);
}

#[test]
fn f32_weights_are_held_once() {
    check(DType::F32);
}
