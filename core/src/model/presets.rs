//! Built-in presets: the published Qwen-VL vision towers, and `tiny` for demos and tests.
//!
//! Sources of the numbers: each checkpoint's `config.json` on the Hugging Face Hub
//! (`Qwen/<name>-Instruct`), falling back, for keys a file leaves out, to the defaults of
//! transformers' `Qwen2VLVisionConfig`, `Qwen2_5_VLVisionConfig` and `Qwen3VLVisionConfig`,
//! which is how transformers itself fills them. The processor settings are those of each
//! family's `preprocessor_config.json`.

use super::config::{Family, HiddenAct, LAYER_NORM_EPS, ModelSpec, ROPE_THETA, VisionConfig};
use crate::preprocess::ProcessorConfig;

/// Every preset name, in the order `iris` lists them.
pub const PRESET_NAMES: [&str; 11] = [
    "tiny",
    "qwen2-vl-2b",
    "qwen2-vl-7b",
    "qwen2.5-vl-3b",
    "qwen2.5-vl-7b",
    "qwen2.5-vl-32b",
    "qwen2.5-vl-72b",
    "qwen3-vl-2b",
    "qwen3-vl-4b",
    "qwen3-vl-8b",
    "qwen3-vl-32b",
];

/// `max_pixels` of the `tiny` preset: 896 x 896, 1024 embedding tokens at most.
pub const TINY_MAX_PIXELS: u64 = 896 * 896;

/// The preset of that name (case-insensitive), or `None`.
pub fn get(name: &str) -> Option<ModelSpec> {
    let lower = name.to_ascii_lowercase();
    let (vision, processor) = match lower.as_str() {
        // Small enough to encode a 448x448 image (1024 patches) in a fraction of a second
        // unoptimised; Qwen2-VL geometry so it shares that family's processor, with the pixel
        // limit lowered to 896x896 (1024 tokens) so that profiling its largest item stays cheap.
        "tiny" => (
            qwen2_vl(2, 64, 4, 128, 64),
            ProcessorConfig {
                max_pixels: TINY_MAX_PIXELS,
                ..ProcessorConfig::qwen2_vl()
            },
        ),
        // Qwen2-VL-2B-Instruct config.json: vision_config {hidden_size: 1536, in_chans: 3,
        // spatial_patch_size: 14}; the rest are Qwen2VLVisionConfig defaults (depth 32,
        // embed_dim 1280, num_heads 16, mlp_ratio 4, quick_gelu).
        "qwen2-vl-2b" => (
            qwen2_vl(32, 1280, 16, 5120, 1536),
            ProcessorConfig::qwen2_vl(),
        ),
        // Qwen2-VL-7B-Instruct config.json: vision_config {in_chans: 3, spatial_patch_size: 14};
        // hidden_size (output) is the Qwen2VLVisionConfig default 3584.
        "qwen2-vl-7b" => (
            qwen2_vl(32, 1280, 16, 5120, 3584),
            ProcessorConfig::qwen2_vl(),
        ),
        // Qwen2.5-VL-3B-Instruct config.json: vision_config {hidden_size: 1280,
        // out_hidden_size: 2048, ...}; intermediate_size 3420, depth 32, num_heads 16,
        // window_size 112, fullatt_block_indexes [7, 15, 23, 31] as in 7B's file and the
        // Qwen2_5_VLVisionConfig defaults.
        "qwen2.5-vl-3b" => (qwen25_vl(3420, 2048), ProcessorConfig::qwen2_vl()),
        // Qwen2.5-VL-7B-Instruct config.json: vision_config {depth: 32, hidden_size: 1280,
        // intermediate_size: 3420, num_heads: 16, out_hidden_size: 3584, window_size: 112,
        // fullatt_block_indexes: [7, 15, 23, 31]}.
        "qwen2.5-vl-7b" => (qwen25_vl(3420, 3584), ProcessorConfig::qwen2_vl()),
        // Qwen2.5-VL-32B-Instruct config.json: vision_config {intermediate_size: 3456,
        // out_hidden_size: 5120}, other keys as 7B.
        "qwen2.5-vl-32b" => (qwen25_vl(3456, 5120), ProcessorConfig::qwen2_vl()),
        // Qwen2.5-VL-72B-Instruct config.json: vision_config {hidden_size: 1280,
        // intermediate_size: 3456, out_hidden_size: 8192}, other keys as 7B.
        "qwen2.5-vl-72b" => (qwen25_vl(3456, 8192), ProcessorConfig::qwen2_vl()),
        // Qwen3-VL-2B-Instruct config.json: vision_config {depth: 24, hidden_size: 1024,
        // intermediate_size: 4096, num_heads: 16, out_hidden_size: 2048,
        // deepstack_visual_indexes: [5, 11, 17], num_position_embeddings: 2304}.
        "qwen3-vl-2b" => (
            qwen3_vl(24, 1024, 4096, 2048, [5, 11, 17]),
            ProcessorConfig::qwen3_vl(),
        ),
        // Qwen3-VL-4B-Instruct config.json: as 2B with out_hidden_size 2560.
        "qwen3-vl-4b" => (
            qwen3_vl(24, 1024, 4096, 2560, [5, 11, 17]),
            ProcessorConfig::qwen3_vl(),
        ),
        // Qwen3-VL-8B-Instruct config.json: vision_config {depth: 27, hidden_size: 1152,
        // intermediate_size: 4304, num_heads: 16, out_hidden_size: 4096,
        // deepstack_visual_indexes: [8, 16, 24], num_position_embeddings: 2304}.
        "qwen3-vl-8b" => (
            qwen3_vl(27, 1152, 4304, 4096, [8, 16, 24]),
            ProcessorConfig::qwen3_vl(),
        ),
        // Qwen3-VL-32B-Instruct config.json: as 8B with out_hidden_size 5120.
        "qwen3-vl-32b" => (
            qwen3_vl(27, 1152, 4304, 5120, [8, 16, 24]),
            ProcessorConfig::qwen3_vl(),
        ),
        _ => return None,
    };
    let name = PRESET_NAMES.iter().find(|n| **n == lower)?;
    Some(ModelSpec {
        name: (*name).to_string(),
        vision,
        processor,
    })
}

/// Every preset, in [`PRESET_NAMES`] order.
pub fn all() -> Vec<ModelSpec> {
    PRESET_NAMES.iter().filter_map(|n| get(n)).collect()
}

fn qwen2_vl(depth: usize, hidden: usize, heads: usize, mlp: usize, out: usize) -> VisionConfig {
    VisionConfig {
        family: Family::Qwen2Vl,
        depth,
        hidden,
        num_heads: heads,
        intermediate: mlp,
        hidden_act: HiddenAct::QuickGelu,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        in_channels: 3,
        out_hidden: out,
        window_size: None,
        fullatt_block_indexes: Vec::new(),
        num_position_embeddings: None,
        deepstack_visual_indexes: Vec::new(),
        layer_norm_eps: LAYER_NORM_EPS,
        rope_theta: ROPE_THETA,
    }
}

fn qwen25_vl(intermediate: usize, out: usize) -> VisionConfig {
    VisionConfig {
        family: Family::Qwen25Vl,
        depth: 32,
        hidden: 1280,
        num_heads: 16,
        intermediate,
        hidden_act: HiddenAct::Silu,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        in_channels: 3,
        out_hidden: out,
        window_size: Some(112),
        fullatt_block_indexes: vec![7, 15, 23, 31],
        num_position_embeddings: None,
        deepstack_visual_indexes: Vec::new(),
        layer_norm_eps: LAYER_NORM_EPS,
        rope_theta: ROPE_THETA,
    }
}

fn qwen3_vl(
    depth: usize,
    hidden: usize,
    intermediate: usize,
    out: usize,
    deepstack: [usize; 3],
) -> VisionConfig {
    VisionConfig {
        family: Family::Qwen3Vl,
        depth,
        hidden,
        num_heads: 16,
        intermediate,
        hidden_act: HiddenAct::GeluTanh,
        patch_size: 16,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        in_channels: 3,
        out_hidden: out,
        window_size: None,
        fullatt_block_indexes: Vec::new(),
        num_position_embeddings: Some(2304),
        deepstack_visual_indexes: deepstack.to_vec(),
        layer_norm_eps: LAYER_NORM_EPS,
        rope_theta: ROPE_THETA,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid_and_named() {
        let all = all();
        assert_eq!(all.len(), PRESET_NAMES.len());
        for spec in &all {
            spec.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            assert!(PRESET_NAMES.contains(&spec.name.as_str()));
        }
    }

    #[test]
    fn lookup_is_case_insensitive_and_unknown_names_fail() {
        assert_eq!(get("Qwen2.5-VL-7B").unwrap().name, "qwen2.5-vl-7b");
        assert!(get("qwen9-vl").is_none());
        let err = ModelSpec::preset("qwen9-vl").unwrap_err();
        assert!(err.to_string().contains("qwen9-vl") && err.to_string().contains("tiny"));
    }

    #[test]
    fn published_dims() {
        let v = get("qwen2-vl-2b").unwrap().vision;
        assert_eq!(
            (v.hidden, v.head_dim(), v.intermediate, v.out_hidden),
            (1280, 80, 5120, 1536)
        );
        let v = get("qwen2.5-vl-72b").unwrap().vision;
        assert_eq!(
            (v.intermediate, v.out_hidden, v.window_size),
            (3456, 8192, Some(112))
        );
        let v = get("qwen3-vl-8b").unwrap().vision;
        assert_eq!((v.depth, v.head_dim(), v.out_hidden), (27, 72, 4096));
        assert_eq!(v.deepstack_visual_indexes, vec![8, 16, 24]);
        let p = get("qwen3-vl-2b").unwrap().processor;
        assert_eq!(
            (p.patch_size, p.min_pixels, p.max_pixels),
            (16, 65_536, 16_777_216)
        );
    }
}
