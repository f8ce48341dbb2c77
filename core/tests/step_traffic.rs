//! What a forward pass sends to the device does not grow with the tower's depth: pixels,
//! attention segments, gather indices, rotary tables and position embeddings cross once per
//! pass, and every layer reads them on the device.
//!
//! Each family's small test configuration (`tests/data/golden/<model>/config.json`) runs at
//! depth 2 and depth 8 with dummy weights on the same two images; the bytes written host to
//! device during the pass must be equal, while the number of ops grows with the depth.

use std::path::Path;
use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{DUMMY_DEFAULT_SEED, ModelSpec, WeightSource};
use iris_plugin::host::Counters;
use iris_plugin::{DType, Plugin};

/// Counters of one forward pass (pixel upload included) at `depth`.
fn pass(model: &str, depth: usize) -> Counters {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/golden")
        .join(model);
    let spec = ModelSpec::from_hf_dir(&dir).expect("the test config parses");
    let mut vision = spec.vision.clone();
    vision.depth = depth;
    // The same layers at both depths keep their deepstack and full-attention roles.
    vision.deepstack_visual_indexes.retain(|&i| i < 2);
    vision.fullatt_block_indexes.retain(|&i| i < 2);
    let weights = WeightSource::Dummy {
        seed: DUMMY_DEFAULT_SEED,
    }
    .load(&vision, DType::F32)
    .expect("dummy weights");
    let device = Plugin::builtin(iris_device_cpu::plugin_root())
        .open(0, &[("capacity".into(), "1GiB".into())])
        .expect("the CPU device opens");
    let device = Arc::new(device);
    let runner = Runner::new(CachingAllocator::new(Arc::clone(&device)));
    let tower = VisionTower::new(&runner, vision.clone(), &weights, DType::F32).expect("upload");
    let merge = u32::try_from(vision.spatial_merge_size).expect("small");
    // Two images of different shapes, multiples of the merge size.
    let grids = [[1, 4 * merge, 6 * merge], [1, 2 * merge, 2 * merge]];
    let rows: usize = grids.iter().map(|g| (g[1] * g[2]) as usize).sum();
    let row_len = vision.patch_row_len();
    let pixels: Vec<f32> = (0..rows * row_len)
        .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
        .collect();
    device.synchronize().expect("weights uploaded");
    let before = device.counters();
    let input = runner
        .upload_f32(&pixels, DType::F32, rows as u64, row_len as u64)
        .expect("pixels upload");
    let outputs = tower.forward(&runner, &input, &grids).expect("forward");
    device.synchronize().expect("the pass completes");
    let counters = device.counters().since(&before);
    assert_eq!(outputs.len(), 2);
    counters
}

fn check(model: &str) {
    let shallow = pass(model, 2);
    let deep = pass(model, 8);
    assert!(shallow.host_to_device_bytes > 0);
    assert_eq!(
        shallow.host_to_device_bytes, deep.host_to_device_bytes,
        "{model}: bytes uploaded per pass at depth 2 vs 8"
    );
    assert_eq!(
        shallow.host_to_device_calls, deep.host_to_device_calls,
        "{model}: uploads per pass at depth 2 vs 8"
    );
    assert!(
        deep.ops > shallow.ops,
        "{model}: the deeper tower runs more ops ({} vs {})",
        deep.ops,
        shallow.ops
    );
}

#[test]
fn qwen2_vl_uploads_the_same_bytes_at_any_depth() {
    check("qwen2_vl");
}

#[test]
fn qwen2_5_vl_uploads_the_same_bytes_at_any_depth() {
    check("qwen2_5_vl");
}

#[test]
fn qwen3_vl_uploads_the_same_bytes_at_any_depth() {
    check("qwen3_vl");
}
