//! A video's temporal groups are independent items of one grid: attention never crosses them,
//! and rotary positions (and Qwen3-VL's interpolated position embeddings) repeat per group.
//! So the rows a tower gives group `k` of a video equal the tower run on that group alone, bit
//! for bit, on every family (Qwen2.5-VL's windows included) and for deepstack outputs, as
//! transformers' towers give them.

use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::layout::Grid;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{ModelSpec, WeightSource};
use iris_plugin::{DType, Plugin};

fn runner() -> Runner {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "2GiB".into())])
        .expect("the CPU device opens");
    Runner::new(CachingAllocator::new(Arc::new(device)))
}

/// `preset` with two blocks (full attention and deepstack indexes moved inside them).
fn spec(preset: &str) -> ModelSpec {
    let mut spec = ModelSpec::preset(preset).expect("the preset exists");
    let vision = &mut spec.vision;
    vision.depth = 2;
    if !vision.fullatt_block_indexes.is_empty() {
        vision.fullatt_block_indexes = vec![1];
    }
    if !vision.deepstack_visual_indexes.is_empty() {
        vision.deepstack_visual_indexes = vec![0];
    }
    spec
}

/// Every output of one item (embeddings, then deepstack rows), read back.
fn encode(runner: &Runner, tower: &VisionTower, pixels: &[f32], grid: Grid) -> Vec<Vec<f32>> {
    let row_len = tower.config().patch_row_len() as u64;
    let rows = pixels.len() as u64 / row_len;
    let input = runner
        .upload_f32(pixels, DType::F32, rows, row_len)
        .expect("upload");
    let outputs = tower.forward(runner, &input, &[grid]).expect("forward");
    let out = &outputs[0];
    let mut values = vec![runner.download_f32(&out.embeddings).expect("download")];
    for extra in &out.deepstack {
        values.push(runner.download_f32(extra).expect("download"));
    }
    values
}

fn check(preset: &str) {
    let spec = spec(preset);
    let runner = runner();
    let host = WeightSource::Dummy { seed: 5 }
        .load(&spec.vision, DType::F32)
        .expect("weights");
    let tower =
        VisionTower::from_host(&runner, spec.vision.clone(), host, DType::F32).expect("upload");
    let row_len = spec.vision.patch_row_len();
    // Three temporal groups of 8 x 12 patches (Qwen2.5-VL: more than one window each).
    let (t, h, w) = (3u32, 8u32, 12u32);
    let group_rows = (h * w) as usize;
    let pixels: Vec<f32> = (0..t as usize * group_rows * row_len)
        .map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5)
        .collect();
    let video = encode(&runner, &tower, &pixels, [t, h, w]);
    let tokens = group_rows / 4;
    for k in 0..t as usize {
        let alone = encode(
            &runner,
            &tower,
            &pixels[k * group_rows * row_len..(k + 1) * group_rows * row_len],
            [1, h, w],
        );
        for (output, (whole, single)) in video.iter().zip(&alone).enumerate() {
            let width = single.len() / tokens;
            let rows = &whole[k * tokens * width..(k + 1) * tokens * width];
            let differing = rows
                .iter()
                .zip(single)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differing, 0,
                "{preset}: group {k}, output {output}: {differing} values differ from the group alone"
            );
        }
    }
}

#[test]
fn qwen2_vl_video_groups_equal_the_groups_alone() {
    check("qwen2-vl-2b");
}

#[test]
fn qwen2_5_vl_video_groups_equal_the_groups_alone() {
    check("qwen2.5-vl-3b");
}

#[test]
fn qwen3_vl_video_groups_equal_the_groups_alone() {
    check("qwen3-vl-2b");
}
