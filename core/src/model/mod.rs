//! Encoder models: what a vision tower is (its dimensions), where its settings come from (a
//! built-in preset or a Hugging Face model directory), and its weights on the host.
//!
//! - [`VisionConfig`] holds the dimensions of one Qwen2-VL, Qwen2.5-VL or Qwen3-VL tower
//!   ([`Family`]); [`VisionConfig::validate`] rejects values a tower cannot run with, naming the
//!   key as Hugging Face spells it.
//! - [`ProcessorConfig`](crate::preprocess::ProcessorConfig), the preprocessing's own options,
//!   holds the image processor settings that belong to a model (patch, merge and temporal sizes,
//!   pixel limits, mean and std); this module reads and writes it as `preprocessor_config.json`.
//! - [`ModelSpec`] pairs the two: [`ModelSpec::preset`] for the built-in presets
//!   ([`presets::PRESET_NAMES`]), [`ModelSpec::from_hf_dir`] for a checkpoint directory's
//!   `config.json` and `preprocessor_config.json`.
//! - [`VisionConfig::weight_specs`] lists every tensor a tower reads, with its Hugging Face name
//!   (without prefix) and shape; [`WeightSource::load`] produces [`HostWeights`] for that list,
//!   either deterministic dummy values or the vision tensors of safetensors files, converted to
//!   the run dtype. A tower then asks [`HostWeights::expect`] for each tensor it uploads.
//!
//! Loading reads only what the tower needs: safetensors headers, then the byte ranges of the
//! vision tensors; with a `model.safetensors.index.json`, only the shards that hold them.
//!
//! ```
//! use iris_core::model::{ModelSpec, WeightSource};
//! use iris_plugin::DType;
//!
//! let spec = ModelSpec::preset("tiny")?;
//! let weights = WeightSource::Dummy { seed: 0 }.load(&spec.vision, DType::F32)?;
//! let hidden = spec.vision.hidden;
//! let qkv = weights.expect("blocks.0.attn.qkv.weight", DType::F32, &[3 * hidden, hidden])?;
//! assert_eq!(qkv.bytes.len(), 3 * hidden * hidden * 4);
//! assert_eq!(weights.total_bytes(), spec.vision.weight_bytes(DType::F32)?);
//! # Ok::<(), iris_core::model::ModelError>(())
//! ```

mod config;
mod dummy;
pub mod presets;
mod weights;

use std::path::PathBuf;

use iris_plugin::DType;

pub use config::{
    Family, HiddenAct, LAYER_NORM_EPS, MAX_DEPTH, ModelSpec, QWEN3_VL_VIDEO_MAX_PIXELS,
    QWEN3_VL_VIDEO_MIN_PIXELS, ROPE_THETA, VideoProcessing, VisionConfig,
};
pub use dummy::{DUMMY_DEFAULT_SEED, dummy_weights};
pub use weights::{
    HostTensor, HostWeights, TensorKind, TensorSpec, VISION_PREFIXES, WeightSource,
    load_safetensors,
};

/// Everything that can go wrong describing a model or loading its weights.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The name is not a built-in preset.
    #[error("unknown model preset `{name}` (known: {known})")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The built-in names, comma separated.
        known: String,
    },
    /// A file or directory could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A key of a configuration file is missing, has the wrong type or a value a tower cannot
    /// run with.
    #[error("{file}: `{key}`: {reason}")]
    ConfigKey {
        /// The file (or `preset NAME` for a built-in preset).
        file: String,
        /// The key, with its parent object (`vision_config.depth`).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A configuration value that no tower can run with, found by [`VisionConfig::validate`] or
    /// the processor options' validation. The key is spelled as in Hugging Face's files.
    #[error("invalid model configuration: `{key}`: {reason}")]
    InvalidConfig {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// `model_type` names no supported tower family.
    #[error(
        "{file}: unsupported model_type `{model_type}` (supported: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe)"
    )]
    UnknownModelType {
        /// The file.
        file: String,
        /// The value found.
        model_type: String,
    },
    /// The run dtype is not one this ABI version defines.
    #[error("unsupported run dtype {dtype}")]
    UnsupportedDtype {
        /// The dtype asked for.
        dtype: DType,
    },
    /// A size computed from the configuration does not fit in 64 bits.
    #[error("size of {what} overflows")]
    SizeOverflow {
        /// What was being sized.
        what: String,
    },
    /// No safetensors file was found where weights were expected.
    #[error("no safetensors files in {}", path.display())]
    NoWeightFiles {
        /// The directory searched.
        path: PathBuf,
    },
    /// A safetensors file is malformed (header, offsets or length).
    #[error("{} is not a valid safetensors file: {reason}", path.display())]
    BadSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A `model.safetensors.index.json` is malformed or disagrees with its shards.
    #[error("bad safetensors index {}: {reason}", path.display())]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The same tensor name appears in two files.
    #[error("tensor `{name}` appears in both {} and {}", first.display(), second.display())]
    DuplicateTensor {
        /// The full tensor name.
        name: String,
        /// The first file holding it.
        first: PathBuf,
        /// The second file holding it.
        second: PathBuf,
    },
    /// The vision tower's tensors are present under more than one prefix.
    #[error(
        "vision tensors found under several prefixes ({prefixes}); keep one tower per set of files"
    )]
    AmbiguousPrefix {
        /// The prefixes found, comma separated.
        prefixes: String,
    },
    /// A tensor the tower needs is in none of the files.
    #[error("missing tensor `{name}` (expected shape {expected:?}){}", more_note(*more))]
    MissingTensor {
        /// The full name looked for.
        name: String,
        /// The shape the tower expects.
        expected: Vec<usize>,
        /// How many other needed tensors are missing too.
        more: usize,
    },
    /// A tensor has a different shape than the configuration implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The full name.
        name: String,
        /// The shape the tower expects.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype the loader does not convert (only F32, F16, BF16 are).
    #[error("tensor `{name}` in {} is stored as {dtype}; only F32, F16 and BF16 are supported", path.display())]
    UnsupportedTensorDtype {
        /// The full name.
        name: String,
        /// The file.
        path: PathBuf,
        /// The dtype in the file.
        dtype: String,
    },
    /// A tensor holds values that are not finite: NaN or infinity in the file, or values
    /// beyond the range of the dtype it is loaded in (an f32 checkpoint loaded as f16). The
    /// tower would turn every output into NaN without an error.
    #[error("tensor `{name}` in {}: {count} of its {numel} values {reason} (the first at flat index {first}); a tower with it computes NaN", path.display())]
    NonFiniteWeights {
        /// The full name.
        name: String,
        /// The file.
        path: PathBuf,
        /// How many values are not finite.
        count: usize,
        /// The tensor's element count.
        numel: usize,
        /// The flat index of the first.
        first: usize,
        /// Where they come from, e.g. `are NaN or infinite in the file`.
        reason: String,
    },
    /// A tower asked for a tensor the loaded weights do not hold.
    #[error("weights hold no tensor `{name}`")]
    TensorNotLoaded {
        /// The name asked for (without prefix).
        name: String,
    },
    /// A tower asked for a tensor with a dtype or shape other than the loaded one.
    #[error(
        "tensor `{name}` is {found_dtype} {found_shape:?}, the tower expects {expected_dtype} {expected_shape:?}"
    )]
    TensorMismatch {
        /// The name asked for (without prefix).
        name: String,
        /// The dtype the tower expects.
        expected_dtype: DType,
        /// The shape the tower expects.
        expected_shape: Vec<usize>,
        /// The dtype held.
        found_dtype: DType,
        /// The shape held.
        found_shape: Vec<usize>,
    },
}

fn more_note(more: usize) -> String {
    if more == 0 {
        String::new()
    } else {
        format!(" and {more} more missing")
    }
}
