//! A tower whose MLP width is not a multiple of 16 (Qwen2.5-VL-3B and 7B's 3420) runs its MLP
//! padded with zeros on the device, so that the products' rows are 16-byte aligned. Its
//! outputs must be those of the same tower given explicitly zero-padded weights at the aligned
//! width, bit for bit, and the weights it gives back must be the ones it was given.
//!
//! Each family's small test configuration (`tests/data/golden/<model>/config.json`) runs with
//! an MLP width of 20 (padded to 32) on the CPU device, in f32 and bf16.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{DUMMY_DEFAULT_SEED, HostTensor, HostWeights, ModelSpec, WeightSource};
use iris_plugin::{DType, Plugin};

const WIDTH: usize = 20;
const ALIGNED: usize = 32;

/// The names of a block's MLP tensors whose inner dimension is the MLP width: the first
/// products' weights (rows) and biases, and the second product's weight (columns).
fn mlp_role(family_model: &str, name: &str) -> Option<&'static str> {
    let (_, suffix) = name.strip_prefix("blocks.")?.split_once('.')?;
    let (first, second): (&[&str], &str) = match family_model {
        "qwen2_vl" => (&["mlp.fc1"], "mlp.fc2"),
        "qwen2_5_vl" => (&["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj"),
        _ => (&["mlp.linear_fc1"], "mlp.linear_fc2"),
    };
    match suffix.rsplit_once('.')? {
        (module, "weight") if first.contains(&module) => Some("rows"),
        (module, "bias") if first.contains(&module) => Some("vector"),
        (module, "weight") if module == second => Some("cols"),
        _ => None,
    }
}

/// `tensor` zero-padded from [`WIDTH`] to [`ALIGNED`] along its MLP dimension.
fn pad(tensor: &HostTensor, role: &str) -> HostTensor {
    let size = tensor.bytes.len() / tensor.numel();
    let mut padded = tensor.clone();
    match role {
        "rows" | "vector" => {
            padded.shape[0] = ALIGNED;
            padded.bytes.resize(tensor.bytes.len() / WIDTH * ALIGNED, 0);
        }
        _ => {
            padded.shape[1] = ALIGNED;
            padded.bytes = tensor
                .bytes
                .chunks(WIDTH * size)
                .flat_map(|row| {
                    let mut row = row.to_vec();
                    row.resize(ALIGNED * size, 0);
                    row
                })
                .collect();
        }
    }
    padded
}

fn outputs(runner: &Runner, tower: &VisionTower, grids: &[[u32; 3]]) -> Vec<Vec<u32>> {
    let vision = tower.config();
    let rows: usize = grids.iter().map(|g| (g[0] * g[1] * g[2]) as usize).sum();
    let row_len = vision.patch_row_len();
    #[allow(clippy::cast_precision_loss)]
    let pixels: Vec<f32> = (0..rows * row_len)
        .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
        .collect();
    let input = runner
        .upload_f32(&pixels, tower.dtype(), rows as u64, row_len as u64)
        .expect("pixels upload");
    let mut bits = Vec::new();
    for output in tower.forward(runner, &input, grids).expect("forward") {
        for tensor in std::iter::once(&output.embeddings).chain(&output.deepstack) {
            let values = runner.download_f32(tensor).expect("read back");
            bits.push(values.into_iter().map(f32::to_bits).collect());
        }
    }
    bits
}

fn check(model: &str, dtype: DType) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/golden")
        .join(model);
    let spec = ModelSpec::from_hf_dir(&dir).expect("the test config parses");
    let mut narrow = spec.vision.clone();
    narrow.intermediate = WIDTH;
    let weights = WeightSource::Dummy {
        seed: DUMMY_DEFAULT_SEED,
    }
    .load(&narrow, dtype)
    .expect("dummy weights");
    let mut wide = narrow.clone();
    wide.intermediate = ALIGNED;
    let mut padded = BTreeMap::new();
    let mut roles = 0;
    for (name, tensor) in weights.iter() {
        let tensor = match mlp_role(model, name) {
            Some(role) => {
                roles += 1;
                pad(tensor, role)
            }
            None => tensor.clone(),
        };
        padded.insert(name.to_owned(), tensor);
    }
    assert!(roles >= 3 * narrow.depth, "{model}: {roles} MLP tensors");
    let padded = HostWeights::new(dtype, padded, "padded by the test");

    let device = Plugin::builtin(iris_device_cpu::plugin_root())
        .open(0, &[("capacity".into(), "1GiB".into())])
        .expect("the CPU device opens");
    let runner = Runner::new(CachingAllocator::new(Arc::new(device)));
    let narrow_tower = VisionTower::new(&runner, narrow, &weights, dtype).expect("upload");
    let wide_tower = VisionTower::new(&runner, wide, &padded, dtype).expect("upload");
    assert_eq!(
        narrow_tower.weight_bytes(),
        wide_tower.weight_bytes(),
        "{model}: the narrow tower holds its MLP at the aligned width"
    );
    // Two images, one a two-frame video-like grid.
    let merge = 2;
    let grids = [[1, 4 * merge, 6 * merge], [2, 2 * merge, 2 * merge]];
    assert_eq!(
        outputs(&runner, &narrow_tower, &grids),
        outputs(&runner, &wide_tower, &grids),
        "{model} {dtype}: padded MLP against explicit zero weights"
    );
    assert_eq!(
        narrow_tower.to_host(&runner).expect("weights back"),
        HostWeights::new(
            dtype,
            weights
                .iter()
                .map(|(n, t)| (n.to_owned(), t.clone()))
                .collect(),
            "device copy"
        ),
        "{model}: the weights given back are the ones loaded"
    );
}

#[test]
fn qwen2_vl_mlp_padding_changes_no_output() {
    check("qwen2_vl", DType::F32);
    check("qwen2_vl", DType::BF16);
}

#[test]
fn qwen2_5_vl_mlp_padding_changes_no_output() {
    check("qwen2_5_vl", DType::F32);
    check("qwen2_5_vl", DType::BF16);
}

#[test]
fn qwen3_vl_mlp_padding_changes_no_output() {
    check("qwen3_vl", DType::F32);
    check("qwen3_vl", DType::BF16);
}
