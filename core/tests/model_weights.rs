//! Model configs and weight loading: safetensors files built here, in every layout a checkpoint
//! ships (single file, shards with an index, each prefix, mixed with language-model tensors).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use iris_core::model::{
    Family, HostWeights, ModelError, ModelSpec, VisionConfig, WeightSource, dummy_weights,
    load_safetensors, presets,
};
use iris_core::preprocess::ProcessorConfig;
use iris_plugin::DType;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde_json::json;

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A fresh empty directory under cargo's per-target temporary folder.
fn tmp_dir(tag: &str) -> PathBuf {
    let n = NEXT_DIR.fetch_add(1, Ordering::SeqCst);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("model-weights-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tiny() -> VisionConfig {
    ModelSpec::preset("tiny").unwrap().vision
}

fn small_qwen25() -> VisionConfig {
    let mut v = ModelSpec::preset("qwen2.5-vl-3b").unwrap().vision;
    v.depth = 2;
    v.hidden = 32;
    v.num_heads = 2;
    v.intermediate = 48;
    v.out_hidden = 40;
    v.window_size = Some(56);
    v.fullatt_block_indexes = vec![1];
    v.validate().unwrap();
    v
}

fn small_qwen3() -> VisionConfig {
    let mut v = ModelSpec::preset("qwen3-vl-2b").unwrap().vision;
    v.depth = 3;
    v.hidden = 32;
    v.num_heads = 2;
    v.intermediate = 64;
    v.out_hidden = 48;
    v.num_position_embeddings = Some(16);
    v.deepstack_visual_indexes = vec![0, 2];
    v.validate().unwrap();
    v
}

/// One tensor to write: name, dtype on disk, shape, little-endian bytes.
struct Disk {
    name: String,
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// The tower's tensors (dummy f32 values, seed 3) stored as `dtype` under `prefix`.
fn tower_tensors(config: &VisionConfig, prefix: &str, dtype: StDtype) -> Vec<Disk> {
    let w = dummy_weights(config, DType::F32, 3).unwrap();
    w.iter()
        .map(|(name, t)| {
            let values = t.to_f32();
            let bytes = match dtype {
                StDtype::F16 => values
                    .iter()
                    .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                    .collect(),
                StDtype::BF16 => values
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => t.bytes.clone(),
            };
            Disk {
                name: format!("{prefix}{name}"),
                dtype,
                shape: t.shape.clone(),
                bytes,
            }
        })
        .collect()
}

/// Language-model tensors a full checkpoint carries beside the tower.
fn lm_tensors() -> Vec<Disk> {
    [
        "model.language_model.layers.0.mlp.up_proj.weight",
        "lm_head.weight",
        "model.embed_tokens.weight",
    ]
    .iter()
    .map(|n| Disk {
        name: (*n).to_string(),
        dtype: StDtype::BF16,
        shape: vec![8, 4],
        bytes: vec![0x3f; 64],
    })
    .collect()
}

fn write_st(path: &Path, tensors: &[Disk]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|d| {
            (
                d.name.clone(),
                TensorView::new(d.dtype, d.shape.clone(), &d.bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn assert_same_values(a: &HostWeights, b: &HostWeights) {
    assert_eq!(a.len(), b.len());
    for (name, t) in a.iter() {
        let u = b.get(name).unwrap();
        assert_eq!(t.shape, u.shape, "{name}");
        assert_eq!(t.dtype, u.dtype, "{name}");
        assert_eq!(t.bytes, u.bytes, "{name}");
    }
}

#[test]
fn single_file_each_prefix_skips_language_model() {
    for config in [tiny(), small_qwen25(), small_qwen3()] {
        let expected = dummy_weights(&config, DType::F32, 3).unwrap();
        for prefix in ["visual.", "model.visual.", ""] {
            let dir = tmp_dir("prefix");
            let mut all = lm_tensors();
            all.extend(tower_tensors(&config, prefix, StDtype::F32));
            let file = dir.join("model.safetensors");
            write_st(&file, &all);
            let got = load_safetensors(&[file], &config, DType::F32)
                .unwrap_or_else(|e| panic!("{} prefix `{prefix}`: {e}", config.family));
            assert_same_values(&got, &expected);
            assert_eq!(got.total_bytes(), config.weight_bytes(DType::F32).unwrap());
        }
    }
}

#[test]
fn half_precision_on_disk_widens_exactly() {
    let config = small_qwen3();
    for dtype in [StDtype::F16, StDtype::BF16] {
        let dir = tmp_dir("half");
        let disk = tower_tensors(&config, "model.visual.", dtype);
        let file = dir.join("model.safetensors");
        write_st(&file, &disk);
        let got = load_safetensors(&[file], &config, DType::F32).unwrap();
        for d in &disk {
            let name = d.name.strip_prefix("model.visual.").unwrap();
            let want: Vec<f32> = match dtype {
                StDtype::F16 => d
                    .bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                _ => d
                    .bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
            };
            let t = got.expect(name, DType::F32, &d.shape).unwrap();
            assert_eq!(t.to_f32(), want, "{name}");
        }
        // Same dtype on disk and at run time: the bytes pass through untouched.
        let run = if dtype == StDtype::F16 {
            DType::F16
        } else {
            DType::BF16
        };
        let same = load_safetensors(&[dir.join("model.safetensors")], &config, run).unwrap();
        for d in &disk {
            let name = d.name.strip_prefix("model.visual.").unwrap();
            assert_eq!(same.get(name).unwrap().bytes, d.bytes, "{name}");
        }
    }
}

#[test]
fn f32_on_disk_narrows_to_run_dtype_like_dummy() {
    let config = tiny();
    let dir = tmp_dir("narrow");
    let file = dir.join("w.safetensors");
    write_st(&file, &tower_tensors(&config, "visual.", StDtype::F32));
    for dtype in [DType::F16, DType::BF16] {
        let got = load_safetensors(std::slice::from_ref(&file), &config, dtype).unwrap();
        // Dummy weights draw in f32 and round the same way.
        assert_same_values(&got, &dummy_weights(&config, dtype, 3).unwrap());
        assert_eq!(got.total_bytes(), config.weight_bytes(dtype).unwrap());
    }
}

/// Writes the tower over two shards plus a language-only shard that is not a valid file:
/// loading succeeds only if that shard is never opened.
fn sharded_checkpoint(config: &VisionConfig, prefix: &str) -> PathBuf {
    let dir = tmp_dir("shards");
    let mut tower = tower_tensors(config, prefix, StDtype::BF16);
    let second = tower.split_off(tower.len() / 2);
    let mut first = tower;
    first.extend(lm_tensors().into_iter().take(1));
    let names = |v: &[Disk], shard: &str| -> Vec<(String, String)> {
        v.iter()
            .map(|d| (d.name.clone(), shard.to_string()))
            .collect()
    };
    let mut map: HashMap<String, String> = HashMap::new();
    map.extend(names(&first, "model-00001-of-00003.safetensors"));
    map.extend(names(&second, "model-00002-of-00003.safetensors"));
    map.insert(
        "lm_head.weight".into(),
        "model-00003-of-00003.safetensors".into(),
    );
    write_st(&dir.join("model-00001-of-00003.safetensors"), &first);
    write_st(&dir.join("model-00002-of-00003.safetensors"), &second);
    std::fs::write(dir.join("model-00003-of-00003.safetensors"), b"not read").unwrap();
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn shards_with_index_read_only_vision_shards() {
    let config = small_qwen25();
    let expected = dummy_weights(&config, DType::BF16, 3).unwrap();
    let dir = sharded_checkpoint(&config, "model.visual.");
    // The directory, and the index file itself.
    for path in [dir.clone(), dir.join("model.safetensors.index.json")] {
        let got = load_safetensors(&[path], &config, DType::BF16).unwrap();
        assert_same_values(&got, &expected);
        assert!(
            got.origin().contains("tensors from 2 files"),
            "{}",
            got.origin()
        );
    }
}

#[test]
fn several_files_and_directory_without_index() {
    let config = tiny();
    let dir = tmp_dir("several");
    let mut tower = tower_tensors(&config, "visual.", StDtype::F32);
    let rest = tower.split_off(10);
    write_st(&dir.join("a.safetensors"), &tower);
    write_st(&dir.join("b.safetensors"), &rest);
    write_st(&dir.join("c.safetensors"), &lm_tensors());
    let expected = dummy_weights(&config, DType::F32, 3).unwrap();
    let files = vec![dir.join("a.safetensors"), dir.join("b.safetensors")];
    assert_same_values(
        &load_safetensors(&files, &config, DType::F32).unwrap(),
        &expected,
    );
    assert_same_values(
        &WeightSource::Safetensors(vec![dir.clone()])
            .load(&config, DType::F32)
            .unwrap(),
        &expected,
    );
}

#[test]
fn missing_tensor_names_it_and_its_shape() {
    let config = tiny();
    let dir = tmp_dir("missing");
    let mut disk = tower_tensors(&config, "visual.", StDtype::F32);
    disk.retain(|d| {
        d.name != "visual.blocks.1.mlp.fc2.bias" && d.name != "visual.merger.ln_q.bias"
    });
    write_st(&dir.join("m.safetensors"), &disk);
    let err = load_safetensors(&[dir.join("m.safetensors")], &config, DType::F32).unwrap_err();
    match &err {
        ModelError::MissingTensor {
            name,
            expected,
            more,
        } => {
            assert!(name == "visual.blocks.1.mlp.fc2.bias" || name == "visual.merger.ln_q.bias");
            assert_eq!(expected, &vec![64]);
            assert_eq!(*more, 1);
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("[64]"), "{err}");
}

#[test]
fn no_tower_at_all_is_a_missing_patch_embed() {
    let dir = tmp_dir("notower");
    write_st(&dir.join("lm.safetensors"), &lm_tensors());
    let err = load_safetensors(&[dir.join("lm.safetensors")], &tiny(), DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{err}");
    assert!(err.to_string().contains("patch_embed.proj.weight"), "{err}");
}

#[test]
fn wrong_shape_names_expected_and_found() {
    let config = tiny();
    let dir = tmp_dir("shape");
    let mut disk = tower_tensors(&config, "", StDtype::F32);
    let qkv = disk
        .iter_mut()
        .find(|d| d.name == "blocks.0.attn.qkv.weight")
        .unwrap();
    qkv.shape = vec![64, 192];
    write_st(&dir.join("s.safetensors"), &disk);
    let err = load_safetensors(&[dir.join("s.safetensors")], &config, DType::F32).unwrap_err();
    match &err {
        ModelError::ShapeMismatch {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "blocks.0.attn.qkv.weight");
            assert_eq!(expected, &vec![192, 64]);
            assert_eq!(found, &vec![64, 192]);
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn unreadable_and_malformed_files() {
    let config = tiny();
    let dir = tmp_dir("bad");
    let err = load_safetensors(&[dir.join("absent.safetensors")], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::Io { .. }), "{err}");
    assert!(err.to_string().contains("absent.safetensors"), "{err}");

    std::fs::write(
        dir.join("garbage.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk",
    )
    .unwrap();
    let err =
        load_safetensors(&[dir.join("garbage.safetensors")], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::BadSafetensors { .. }), "{err}");

    // A valid file cut short: the header promises more data than there is.
    write_st(
        &dir.join("whole.safetensors"),
        &tower_tensors(&config, "visual.", StDtype::F32),
    );
    let bytes = std::fs::read(dir.join("whole.safetensors")).unwrap();
    std::fs::write(dir.join("cut.safetensors"), &bytes[..bytes.len() - 100]).unwrap();
    let err = load_safetensors(&[dir.join("cut.safetensors")], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::BadSafetensors { .. }), "{err}");

    let empty = tmp_dir("empty");
    let err = load_safetensors(&[empty], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::NoWeightFiles { .. }), "{err}");
}

#[test]
fn bad_index_files() {
    let config = small_qwen25();
    let dir = sharded_checkpoint(&config, "visual.");
    let index = dir.join("model.safetensors.index.json");

    std::fs::write(&index, b"{ not json").unwrap();
    let err = load_safetensors(std::slice::from_ref(&dir), &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::BadIndex { .. }), "{err}");

    std::fs::write(&index, br#"{"metadata": {}}"#).unwrap();
    let err = load_safetensors(std::slice::from_ref(&dir), &config, DType::F32).unwrap_err();
    assert!(err.to_string().contains("weight_map"), "{err}");

    std::fs::write(
        &index,
        br#"{"weight_map": {"visual.patch_embed.proj.weight": "../elsewhere.safetensors"}}"#,
    )
    .unwrap();
    let err = load_safetensors(std::slice::from_ref(&dir), &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::BadIndex { .. }), "{err}");
}

#[test]
fn index_pointing_at_wrong_shard() {
    let config = tiny();
    let dir = tmp_dir("wrongshard");
    let tower = tower_tensors(&config, "visual.", StDtype::F32);
    write_st(&dir.join("a.safetensors"), &tower);
    write_st(&dir.join("b.safetensors"), &lm_tensors());
    let mut map: HashMap<String, String> = tower
        .iter()
        .map(|d| (d.name.clone(), "a.safetensors".to_string()))
        .collect();
    map.insert("visual.merger.mlp.2.bias".into(), "b.safetensors".into());
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&json!({ "weight_map": map })).unwrap(),
    )
    .unwrap();
    let err = load_safetensors(&[dir], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::BadIndex { .. }), "{err}");
    assert!(
        err.to_string().contains("visual.merger.mlp.2.bias"),
        "{err}"
    );
}

#[test]
fn ambiguous_prefix_duplicates_and_unsupported_dtype() {
    let config = tiny();
    let dir = tmp_dir("ambig");
    let mut both = tower_tensors(&config, "visual.", StDtype::F32);
    both.extend(tower_tensors(&config, "model.visual.", StDtype::F32));
    write_st(&dir.join("both.safetensors"), &both);
    let err = load_safetensors(&[dir.join("both.safetensors")], &config, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::AmbiguousPrefix { .. }), "{err}");

    let tower = tower_tensors(&config, "visual.", StDtype::F32);
    write_st(&dir.join("one.safetensors"), &tower);
    write_st(&dir.join("two.safetensors"), &tower[..1]);
    let err = load_safetensors(
        &[dir.join("one.safetensors"), dir.join("two.safetensors")],
        &config,
        DType::F32,
    )
    .unwrap_err();
    assert!(matches!(err, ModelError::DuplicateTensor { .. }), "{err}");

    let mut ints = tower_tensors(&config, "visual.", StDtype::F32);
    ints[0].dtype = StDtype::I32;
    let bad = ints[0].name.clone();
    write_st(&dir.join("ints.safetensors"), &ints);
    let err = load_safetensors(&[dir.join("ints.safetensors")], &config, DType::F32).unwrap_err();
    assert!(
        matches!(err, ModelError::UnsupportedTensorDtype { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&bad), "{err}");
}

#[test]
fn unused_vision_tensors_are_skipped() {
    let config = tiny();
    let dir = tmp_dir("extra");
    let mut disk = tower_tensors(&config, "visual.", StDtype::F32);
    disk.push(Disk {
        name: "visual.rotary_pos_emb.inv_freq".into(),
        dtype: StDtype::F32,
        shape: vec![4],
        bytes: vec![0; 16],
    });
    write_st(&dir.join("x.safetensors"), &disk);
    let got = load_safetensors(&[dir.join("x.safetensors")], &config, DType::F32).unwrap();
    assert!(got.get("rotary_pos_emb.inv_freq").is_err());
    assert_eq!(got.len(), config.weight_specs().len());
}

#[test]
fn dummy_weights_are_deterministic_and_order_independent() {
    let config = small_qwen3();
    let a = dummy_weights(&config, DType::F32, 11).unwrap();
    let b = WeightSource::Dummy { seed: 11 }
        .load(&config, DType::F32)
        .unwrap();
    assert_same_values(&a, &b);
    let c = dummy_weights(&config, DType::F32, 12).unwrap();
    assert_ne!(
        a.get("blocks.0.attn.qkv.weight").unwrap().bytes,
        c.get("blocks.0.attn.qkv.weight").unwrap().bytes
    );
    // A deeper tower has different tensors before and after block 0; block 0 stays the same.
    let mut deeper = config.clone();
    deeper.depth = 5;
    let d = dummy_weights(&deeper, DType::F32, 11).unwrap();
    for name in [
        "blocks.0.attn.qkv.weight",
        "blocks.2.mlp.linear_fc1.bias",
        "pos_embed.weight",
    ] {
        assert_eq!(
            a.get(name).unwrap().bytes,
            d.get(name).unwrap().bytes,
            "{name}"
        );
    }
    // Spec names per family.
    for name in [
        "patch_embed.proj.bias",
        "deepstack_merger_list.1.norm.weight",
        "merger.linear_fc2.weight",
    ] {
        assert!(a.get(name).is_ok(), "{name}");
    }
    assert_eq!(
        a.get("deepstack_merger_list.0.norm.weight").unwrap().shape,
        vec![32 * 4]
    );
    assert_eq!(a.get("merger.norm.weight").unwrap().shape, vec![32]);
    assert_eq!(a.get("pos_embed.weight").unwrap().shape, vec![16, 32]);
    assert_eq!(
        a.get("patch_embed.proj.weight").unwrap().shape,
        vec![32, 3, 2, 16, 16]
    );
    let q25 = dummy_weights(&small_qwen25(), DType::F32, 0).unwrap();
    assert!(
        q25.get("blocks.0.norm1.bias").is_err(),
        "RMSNorm has no bias"
    );
    assert_eq!(
        q25.get("blocks.1.mlp.gate_proj.weight").unwrap().shape,
        vec![48, 32]
    );
    assert_eq!(q25.get("merger.mlp.2.weight").unwrap().shape, vec![40, 128]);
}

#[test]
fn expect_checks_dtype_and_shape() {
    let w = dummy_weights(&tiny(), DType::F16, 0).unwrap();
    assert!(
        w.expect("merger.mlp.0.weight", DType::F16, &[256, 256])
            .is_ok()
    );
    let err = w
        .expect("merger.mlp.0.weight", DType::F32, &[256, 256])
        .unwrap_err();
    assert!(matches!(err, ModelError::TensorMismatch { .. }), "{err}");
    let err = w
        .expect("merger.mlp.0.weight", DType::F16, &[256, 64])
        .unwrap_err();
    assert!(err.to_string().contains("[256, 64]"), "{err}");
    assert!(matches!(
        w.get("blocks.9.norm1.weight"),
        Err(ModelError::TensorNotLoaded { .. })
    ));
    let mut w = w;
    let before = w.total_bytes();
    let t = w.take("merger.mlp.0.weight").unwrap();
    assert_eq!(w.total_bytes(), before - t.bytes.len() as u64);
    assert!(dummy_weights(&tiny(), DType(9), 0).is_err());
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

#[test]
fn hf_full_configs_as_published_match_presets() {
    let qwen2_pre = json!({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"
    });
    let qwen3_pre = json!({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast"
    });
    let cases = [
        // Qwen2-VL-7B-Instruct's vision_config, verbatim.
        (
            "qwen2-vl-7b",
            json!({"model_type": "qwen2_vl", "hidden_size": 3584,
                   "vision_config": {"in_chans": 3, "model_type": "qwen2_vl", "spatial_patch_size": 14}}),
            &qwen2_pre,
        ),
        (
            "qwen2-vl-2b",
            json!({"model_type": "qwen2_vl", "hidden_size": 1536,
                   "vision_config": {"hidden_size": 1536, "in_chans": 3, "model_type": "qwen2_vl",
                                     "spatial_patch_size": 14}}),
            &qwen2_pre,
        ),
        (
            "qwen2.5-vl-7b",
            json!({"model_type": "qwen2_5_vl", "vision_config": {
                "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                "temporal_patch_size": 2}}),
            &qwen2_pre,
        ),
        (
            "qwen2.5-vl-72b",
            json!({"model_type": "qwen2_5_vl", "vision_config": {
                "hidden_size": 1280, "in_chans": 3, "intermediate_size": 3456,
                "model_type": "qwen2_5_vl", "out_hidden_size": 8192, "spatial_patch_size": 14,
                "tokens_per_second": 2, "torch_dtype": "bfloat16"}}),
            &qwen2_pre,
        ),
        (
            "qwen3-vl-8b",
            json!({"model_type": "qwen3_vl", "text_config": {"hidden_size": 4096},
                   "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27,
                   "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
                   "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl",
                   "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
                   "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}),
            &qwen3_pre,
        ),
    ];
    for (preset, config, pre) in cases {
        let dir = tmp_dir("hf");
        write_json(&dir.join("config.json"), &config);
        write_json(&dir.join("preprocessor_config.json"), pre);
        let spec = ModelSpec::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{preset}: {e}"));
        let want = ModelSpec::preset(preset).unwrap();
        assert_eq!(spec.vision, want.vision, "{preset}");
        assert_eq!(spec.processor, want.processor, "{preset}");
    }
}

#[test]
fn bare_vision_configs_round_trip_for_every_preset() {
    for want in presets::all() {
        let dir = tmp_dir("bare");
        write_json(&dir.join("config.json"), &want.vision.to_hf_json());
        write_json(
            &dir.join("preprocessor_config.json"),
            &want.processor.to_hf_json(),
        );
        let spec = ModelSpec::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", want.name));
        assert_eq!(spec.vision, want.vision, "{}", want.name);
        assert_eq!(spec.processor, want.processor, "{}", want.name);
        // Without a preprocessor_config.json the family's published settings apply (which the
        // `tiny` preset, with its lowered pixel limit, does not use).
        std::fs::remove_file(dir.join("preprocessor_config.json")).unwrap();
        let spec = ModelSpec::from_hf_dir(&dir).unwrap();
        let published = match want.vision.family {
            Family::Qwen3Vl => ProcessorConfig::qwen3_vl(),
            Family::Qwen2Vl | Family::Qwen25Vl => ProcessorConfig::qwen2_vl(),
        };
        assert_eq!(spec.processor, published, "{}", want.name);
    }
}

#[test]
fn preprocessor_pixel_limit_styles() {
    let vision = json!({"model_type": "qwen2_vl", "embed_dim": 64, "num_heads": 4, "mlp_ratio": 2,
                        "hidden_size": 64, "depth": 2});
    let parse = |pre: serde_json::Value| {
        let dir = tmp_dir("pre");
        write_json(&dir.join("config.json"), &vision);
        write_json(&dir.join("preprocessor_config.json"), &pre);
        ModelSpec::from_hf_dir(&dir)
    };
    let p = parse(json!({"min_pixels": 1000, "max_pixels": 2000}))
        .unwrap()
        .processor;
    assert_eq!((p.min_pixels, p.max_pixels), (1000, 2000));
    let p = parse(json!({"size": {"shortest_edge": 3000, "longest_edge": 4000}}))
        .unwrap()
        .processor;
    assert_eq!((p.min_pixels, p.max_pixels), (3000, 4000));
    // transformers: min_pixels / max_pixels override size.
    let p =
        parse(json!({"size": {"shortest_edge": 3000, "longest_edge": 4000}, "max_pixels": 5000}))
            .unwrap()
            .processor;
    assert_eq!((p.min_pixels, p.max_pixels), (3000, 5000));
    // Defaults of Qwen2VLImageProcessor, and a scalar mean for all channels.
    let p = parse(json!({"image_mean": 0.5})).unwrap().processor;
    assert_eq!((p.min_pixels, p.max_pixels), (3136, 1_003_520));
    assert_eq!(p.image_mean, [0.5; 3]);
    assert_eq!(p.image_std, ProcessorConfig::qwen2_vl().image_std);
    assert_eq!(ModelSpec::preset("tiny").unwrap().vision, {
        let s = parse(json!({})).unwrap();
        s.vision
    });

    let err = parse(json!({"size": {"shortest_edge": 3000}})).unwrap_err();
    assert!(err.to_string().contains("size.longest_edge"), "{err}");
    let err = parse(json!({"min_pixels": 5000, "max_pixels": 10})).unwrap_err();
    assert!(err.to_string().contains("max_pixels"), "{err}");
    let err = parse(json!({"image_std": [0.5, 0.0, 0.5]})).unwrap_err();
    assert!(err.to_string().contains("image_std"), "{err}");
    let err = parse(json!({"image_mean": [0.5, 0.5]})).unwrap_err();
    assert!(err.to_string().contains("image_mean"), "{err}");
    let err = parse(json!({"patch_size": 16})).unwrap_err();
    assert!(
        err.to_string().contains("preprocessor_config.json"),
        "{err}"
    );
    assert!(err.to_string().contains("`patch_size`"), "{err}");
    let err = parse(json!({"merge_size": "two"})).unwrap_err();
    assert!(err.to_string().contains("`merge_size`"), "{err}");
}

#[test]
fn config_errors_name_file_and_key() {
    let parse_config = |config: &[u8]| {
        let dir = tmp_dir("cfg");
        std::fs::write(dir.join("config.json"), config).unwrap();
        ModelSpec::from_hf_dir(&dir)
    };
    let err = parse_config(br#"{"model_type": "llava", "vision_config": {}}"#).unwrap_err();
    assert!(matches!(err, ModelError::UnknownModelType { .. }), "{err}");
    assert!(err.to_string().contains("llava") && err.to_string().contains("config.json"));

    let err = parse_config(br#"{"vision_config": {"depth": 2}}"#).unwrap_err();
    assert!(err.to_string().contains("`model_type`"), "{err}");

    let err = parse_config(
        br#"{"model_type": "qwen2_5_vl", "vision_config": {"hidden_size": 1280, "num_heads": 12}}"#,
    )
    .unwrap_err();
    assert!(matches!(err, ModelError::ConfigKey { .. }), "{err}");
    assert!(
        err.to_string().contains("`vision_config.num_heads`"),
        "{err}"
    );

    // head_dim 1160 / 20 = 58 cannot be split into row and column rotary halves.
    let err = parse_config(
        br#"{"model_type": "qwen3_vl", "vision_config": {"hidden_size": 1160, "num_heads": 20}}"#,
    )
    .unwrap_err();
    assert!(err.to_string().contains("divisible by 4"), "{err}");

    let err = parse_config(br#"{"model_type": "qwen3_vl", "depth": 0}"#).unwrap_err();
    assert!(err.to_string().contains("`depth`"), "{err}");

    let err =
        parse_config(br#"{"model_type": "qwen3_vl", "deepstack_visual_indexes": [8, 16, 40]}"#)
            .unwrap_err();
    assert!(
        err.to_string().contains("`deepstack_visual_indexes`"),
        "{err}"
    );

    let err = parse_config(br#"{"model_type": "qwen3_vl", "num_position_embeddings": 2300}"#)
        .unwrap_err();
    assert!(
        err.to_string().contains("`num_position_embeddings`"),
        "{err}"
    );

    let err = parse_config(br#"{"model_type": "qwen2_5_vl", "vision_config": {"hidden_size": 1280, "window_size": 100}}"#)
        .unwrap_err();
    assert!(
        err.to_string().contains("`vision_config.window_size`"),
        "{err}"
    );

    let err = parse_config(br#"{"model_type": "qwen2_vl", "hidden_act": "relu"}"#).unwrap_err();
    assert!(err.to_string().contains("`hidden_act`"), "{err}");

    let err = parse_config(br#"{"model_type": "qwen2_vl", "vision_config": []}"#).unwrap_err();
    assert!(err.to_string().contains("`vision_config`"), "{err}");

    let err = parse_config(b"{ nope").unwrap_err();
    assert!(matches!(err, ModelError::Json { .. }), "{err}");

    let missing = tmp_dir("nocfg");
    let err = ModelSpec::from_hf_dir(&missing).unwrap_err();
    assert!(matches!(err, ModelError::Io { .. }) && err.to_string().contains("config.json"));

    // A qwen3_vl_moe checkpoint shares the Qwen3-VL tower.
    let spec = parse_config(
        br#"{"model_type": "qwen3_vl_moe", "vision_config": {"out_hidden_size": 2048}}"#,
    )
    .unwrap();
    assert_eq!(spec.vision.family, Family::Qwen3Vl);
}

#[test]
fn validation_of_hand_built_configs() {
    let mut v = tiny();
    v.window_size = Some(112);
    let err = v.validate().unwrap_err();
    assert!(err.to_string().contains("window_size"), "{err}");
    let mut v = small_qwen25();
    v.fullatt_block_indexes = vec![1, 1];
    assert!(v.validate().unwrap_err().to_string().contains("twice"));
    let mut v = small_qwen3();
    v.num_heads = 3;
    assert!(v.validate().unwrap_err().to_string().contains("num_heads"));
    let mut v = tiny();
    v.patch_size = usize::MAX / 2;
    assert!(v.validate().unwrap_err().to_string().contains("overflow"));
    let mut v = tiny();
    v.spatial_merge_size = 1 << 20;
    assert!(
        v.validate()
            .unwrap_err()
            .to_string()
            .contains("spatial_merge_size")
    );
    let mut v = tiny();
    v.depth = 1 << 40;
    assert!(v.validate().unwrap_err().to_string().contains("depth"));
    let mut spec = ModelSpec::preset("qwen3-vl-2b").unwrap();
    spec.processor.min_pixels = 0;
    assert!(
        spec.validate()
            .unwrap_err()
            .to_string()
            .contains("min_pixels")
    );
    // The preprocessing's own bounds: a model that loads can serve (a factor of 256 * 256
    // once divided the start-up profile by zero).
    for (patch, merge, field) in [(2048, 2, "patch_size"), (16, 256, "merge_size")] {
        let mut spec = ModelSpec::preset("qwen3-vl-2b").unwrap();
        spec.processor.patch_size = patch;
        spec.processor.merge_size = merge;
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }
}

/// The golden fixtures' model directories (made by `tools/golden/make_golden.py` with
/// transformers) load as shipped: config style, prefix, shards and on-disk dtype as the
/// manifest records them, and every tensor widened exactly from its stored value.
#[test]
fn golden_model_directories_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
    let models = manifest["models"].as_object().unwrap();
    assert_eq!(models.len(), 3, "one directory per family");
    for (dir_name, entry) in models {
        let dir = root.join(dir_name);
        let spec = ModelSpec::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{dir_name}: {e}"));
        assert_eq!(
            spec.vision.family.model_type(),
            entry["family"].as_str().unwrap()
        );
        spec.validate().unwrap();

        let weights = WeightSource::Safetensors(vec![dir.clone()])
            .load(&spec.vision, DType::F32)
            .unwrap_or_else(|e| panic!("{dir_name}: {e}"));
        assert_eq!(
            weights.len() as u64,
            entry["vision_tensors"].as_u64().unwrap(),
            "{dir_name}"
        );
        let prefix = entry["weight_prefix"].as_str().unwrap();
        if !prefix.is_empty() {
            assert!(
                weights.origin().contains(prefix),
                "{dir_name}: {}",
                weights.origin()
            );
        }

        // Every value equals the stored one, widened.
        let files: Vec<String> = entry["weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        let mut seen = 0;
        for file in &files {
            let bytes = std::fs::read(dir.join(file)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.iter() {
                let Some(short) = name.strip_prefix(prefix) else {
                    continue;
                };
                let Ok(loaded) = weights.get(short) else {
                    assert!(
                        entry["skipped_tensors"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|s| s == name),
                        "{dir_name}: `{name}` neither loaded nor listed as skipped"
                    );
                    continue;
                };
                let want: Vec<f32> = match view.dtype() {
                    StDtype::F32 => view
                        .data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    StDtype::F16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                    StDtype::BF16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                    other => panic!("{dir_name}: `{name}` stored as {other:?}"),
                };
                assert_eq!(loaded.shape, view.shape(), "{dir_name}: {name}");
                assert_eq!(loaded.to_f32(), want, "{dir_name}: {name}");
                seen += 1;
            }
        }
        assert_eq!(seen, weights.len(), "{dir_name}");

        // The fixtures' tensors agree with the dimensions read from the config.
        let golden = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let golden = safetensors::SafeTensors::deserialize(&golden).unwrap();
        let pixels = golden.tensor("pixel_values").unwrap();
        assert_eq!(pixels.shape()[1], spec.vision.patch_row_len(), "{dir_name}");
        let embeddings = golden.tensor("embeddings").unwrap();
        assert_eq!(embeddings.shape()[1], spec.vision.out_hidden, "{dir_name}");
        assert_eq!(
            embeddings.shape()[0] * spec.vision.merge_unit(),
            pixels.shape()[0],
            "{dir_name}"
        );
        for j in 0..spec.vision.deepstack_visual_indexes.len() {
            let d = golden.tensor(&format!("deepstack.{j}")).unwrap();
            assert_eq!(d.shape(), embeddings.shape(), "{dir_name}: deepstack.{j}");
        }
    }
}

/// A model file of the tiny tower stored as `dtype`, with the value at flat index 5 of
/// `name` replaced by `value` (little-endian bytes of `dtype`).
fn tiny_with_value(tag: &str, dtype: StDtype, name: &str, value: &[u8]) -> PathBuf {
    let mut disk = tower_tensors(&tiny(), "visual.", dtype);
    let tensor = disk.iter_mut().find(|d| d.name.ends_with(name)).unwrap();
    let at = 5 * value.len();
    tensor.bytes[at..at + value.len()].copy_from_slice(value);
    let file = tmp_dir(tag).join("model.safetensors");
    write_st(&file, &disk);
    file
}

/// Loads `file` as `run`, which must fail with one non-finite value at index 5 of `name`,
/// the message containing `why`.
fn assert_one_non_finite(file: &Path, run: DType, name: &str, why: &str) {
    let err = load_safetensors(&[file.to_path_buf()], &tiny(), run).unwrap_err();
    let text = err.to_string();
    let one_at_5 = matches!(
        err,
        ModelError::NonFiniteWeights {
            count: 1,
            first: 5,
            ..
        }
    );
    assert!(one_at_5, "as {run}: {err:?}");
    assert!(
        text.contains(&format!("visual.{name}")) && text.contains(why),
        "{text}"
    );
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let name = "blocks.0.attn.qkv.weight";
    for (dtype, bad) in [
        (StDtype::F32, f32::NAN.to_le_bytes().to_vec()),
        (StDtype::F32, f32::NEG_INFINITY.to_le_bytes().to_vec()),
        (StDtype::BF16, bf16::INFINITY.to_le_bytes().to_vec()),
        (StDtype::F16, f16::NAN.to_le_bytes().to_vec()),
    ] {
        let file = tiny_with_value("nan", dtype, name, &bad);
        for run in [DType::F32, DType::BF16] {
            assert_one_non_finite(&file, run, name, "in the file");
        }
    }
}

#[test]
fn values_beyond_the_run_dtype_are_refused() {
    let name = "blocks.0.mlp.fc1.weight";
    // Finite in f32 and bf16, beyond f16's 65504.
    let file = tiny_with_value("overflow", StDtype::F32, name, &1.0e5f32.to_le_bytes());
    for run in [DType::F32, DType::BF16] {
        load_safetensors(std::slice::from_ref(&file), &tiny(), run).unwrap();
    }
    assert_one_non_finite(&file, DType::F16, name, "beyond the range of f16");
}
