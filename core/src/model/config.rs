//! Tower dimensions ([`VisionConfig`]), processor options ([`ProcessorConfig`]) and their
//! parsing from a Hugging Face model directory.
//!
//! Missing keys take the defaults of transformers' configuration classes
//! (`Qwen2VLVisionConfig`, `Qwen2_5_VLVisionConfig`, `Qwen3VLVisionConfig`) and image processor
//! (`Qwen2VLImageProcessor`), because published checkpoints rely on them: Qwen2-VL-7B's
//! `vision_config` carries only `in_chans`, `model_type` and `spatial_patch_size`.

use std::path::Path;

use iris_plugin::Activation;
use serde_json::{Map, Value};

use super::ModelError;
use crate::preprocess::video::{VideoLoader, VideoResize};
use crate::preprocess::{CLIP_MEAN, CLIP_STD, ProcessorConfig};

/// LayerNorm / RMSNorm epsilon of every Qwen-VL vision tower (hard-coded in transformers).
pub const LAYER_NORM_EPS: f64 = 1e-6;
/// Base of the vision rotary embedding's inverse frequencies (hard-coded in transformers).
pub const ROPE_THETA: f64 = 10_000.0;

/// Deepest tower accepted: published towers have 24 to 32 blocks; a far larger value is a typo
/// that would otherwise make tensor lists of billions of entries.
pub const MAX_DEPTH: usize = 1024;

/// `Qwen2VLImageProcessor`'s default `size.shortest_edge` (56 * 56 pixels).
const DEFAULT_MIN_PIXELS: u64 = 56 * 56;
/// `Qwen2VLImageProcessor`'s default `size.longest_edge` (28 * 28 * 1280 pixels).
const DEFAULT_MAX_PIXELS: u64 = 28 * 28 * 1280;

/// The tower families iris implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Qwen2-VL: LayerNorm, quick-gelu MLP, full attention, LayerNorm merger.
    Qwen2Vl,
    /// Qwen2.5-VL: RMSNorm, SiLU-gated MLP, window attention with full-attention layers.
    Qwen25Vl,
    /// Qwen3-VL: patch 16, learned position embeddings, gelu-tanh MLP, deepstack mergers.
    Qwen3Vl,
}

impl Family {
    /// Every family.
    pub const ALL: [Family; 3] = [Family::Qwen2Vl, Family::Qwen25Vl, Family::Qwen3Vl];

    /// The `model_type` Hugging Face writes for this family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "qwen2_vl",
            Family::Qwen25Vl => "qwen2_5_vl",
            Family::Qwen3Vl => "qwen3_vl",
        }
    }

    /// The family of a Hugging Face `model_type` (`qwen3_vl_moe` shares Qwen3-VL's tower).
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        match model_type {
            "qwen2_vl" => Some(Family::Qwen2Vl),
            "qwen2_5_vl" => Some(Family::Qwen25Vl),
            "qwen3_vl" | "qwen3_vl_moe" => Some(Family::Qwen3Vl),
            _ => None,
        }
    }

    /// The key naming the tower width in this family's vision config.
    pub fn hidden_key(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "embed_dim",
            Family::Qwen25Vl | Family::Qwen3Vl => "hidden_size",
        }
    }

    /// The key naming the merger's output width in this family's vision config.
    pub fn out_hidden_key(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "hidden_size",
            Family::Qwen25Vl | Family::Qwen3Vl => "out_hidden_size",
        }
    }

    /// The key naming the MLP width in this family's vision config.
    pub fn intermediate_key(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "mlp_ratio",
            Family::Qwen25Vl | Family::Qwen3Vl => "intermediate_size",
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// The MLP activation of a tower (`hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HiddenAct {
    /// `quick_gelu`: `x * sigmoid(1.702 x)`.
    QuickGelu,
    /// `gelu`: exact (erf) GELU.
    Gelu,
    /// `gelu_pytorch_tanh`: tanh-approximated GELU.
    GeluTanh,
    /// `silu` (also `swish`).
    Silu,
}

impl HiddenAct {
    /// Parses a transformers `ACT2FN` name.
    pub fn parse(name: &str) -> Option<HiddenAct> {
        match name {
            "quick_gelu" => Some(HiddenAct::QuickGelu),
            "gelu" => Some(HiddenAct::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(HiddenAct::GeluTanh),
            "silu" | "swish" => Some(HiddenAct::Silu),
            _ => None,
        }
    }

    /// The name transformers uses.
    pub fn name(self) -> &'static str {
        match self {
            HiddenAct::QuickGelu => "quick_gelu",
            HiddenAct::Gelu => "gelu",
            HiddenAct::GeluTanh => "gelu_pytorch_tanh",
            HiddenAct::Silu => "silu",
        }
    }

    /// The ABI activation op computing it.
    pub fn activation(self) -> Activation {
        match self {
            HiddenAct::QuickGelu => Activation::QUICK_GELU,
            HiddenAct::Gelu => Activation::GELU_ERF,
            HiddenAct::GeluTanh => Activation::GELU_TANH,
            HiddenAct::Silu => Activation::SILU,
        }
    }
}

/// Dimensions of one vision tower.
///
/// Field names are iris's; [`Family::hidden_key`] and friends give the Hugging Face key of each
/// family, and errors name those keys.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    /// Which tower.
    pub family: Family,
    /// Number of transformer blocks (`depth`).
    pub depth: usize,
    /// Tower width (`embed_dim` in Qwen2-VL, `hidden_size` in 2.5 and 3).
    pub hidden: usize,
    /// Attention heads (`num_heads`).
    pub num_heads: usize,
    /// MLP width (`embed_dim * mlp_ratio` in Qwen2-VL, `intermediate_size` in 2.5 and 3).
    pub intermediate: usize,
    /// MLP activation (`hidden_act`).
    pub hidden_act: HiddenAct,
    /// Spatial patch side in pixels (`patch_size`).
    pub patch_size: usize,
    /// Frames per temporal patch (`temporal_patch_size`).
    pub temporal_patch_size: usize,
    /// Side of the square of patches merged into one output token (`spatial_merge_size`).
    pub spatial_merge_size: usize,
    /// Image channels (`in_channels`, `in_chans` in older files).
    pub in_channels: usize,
    /// Width of the merger's output, the embedding width (`hidden_size` in Qwen2-VL,
    /// `out_hidden_size` in 2.5 and 3).
    pub out_hidden: usize,
    /// Qwen2.5-VL only: window side in pixels (`window_size`).
    pub window_size: Option<usize>,
    /// Qwen2.5-VL only: blocks with full attention (`fullatt_block_indexes`).
    pub fullatt_block_indexes: Vec<usize>,
    /// Qwen3-VL only: learned position embeddings, a square number (`num_position_embeddings`).
    pub num_position_embeddings: Option<usize>,
    /// Qwen3-VL only: blocks whose output feeds a deepstack merger (`deepstack_visual_indexes`).
    pub deepstack_visual_indexes: Vec<usize>,
    /// Norm epsilon ([`LAYER_NORM_EPS`]).
    pub layer_norm_eps: f64,
    /// Rotary base ([`ROPE_THETA`]).
    pub rope_theta: f64,
}

impl VisionConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.num_heads.max(1)
    }

    /// Patches merged into one output token (`spatial_merge_size²`).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }

    /// Width of the merger's input rows (`hidden * spatial_merge_size²`).
    pub fn merged_hidden(&self) -> usize {
        self.hidden * self.merge_unit()
    }

    /// Values in one row of pixel input (`in_channels * temporal * patch * patch`).
    pub fn patch_row_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Floating-point operations of one item of `grid` (`[t, h, w]` in patches) through the
    /// tower, counted as `tools/gpu-check/towers_vs_transformers.py --flops` counts them:
    /// matrix products as `2 m n k` (patch embedding, qkv, projection, MLP, the mergers),
    /// attention as `4 s^2 hidden` per layer and segment of `s` patches (a temporal group, or in
    /// Qwen2.5-VL's windowed layers a window). Norms, activations, softmax and position
    /// embeddings, each well under 1%, are left out. What `iris bench` divides by the encoder's
    /// time for its achieved FLOP/s.
    pub fn flops(&self, grid: [u32; 3]) -> u64 {
        let [t, h, w] = grid.map(u64::from);
        let wide = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        let (d, i, out, depth) = (
            wide(self.hidden),
            wide(self.intermediate),
            wide(self.out_hidden),
            wide(self.depth),
        );
        let m = wide(self.merge_unit());
        let s = h * w;
        let n = t * s;
        let patch_embed = 2 * n * wide(self.patch_row_len()) * d;
        let qkv = depth * 2 * n * d * 3 * d;
        let proj = depth * 2 * n * d * d;
        // Qwen2.5-VL's SwiGLU MLP has three matrices, the others two.
        let matrices = if self.family == Family::Qwen25Vl {
            3
        } else {
            2
        };
        let mlp = depth * 2 * n * d * i * matrices;
        let window = self
            .window_size
            .filter(|_| self.family == Family::Qwen25Vl)
            .map(|window| wide(window / self.spatial_merge_size.max(1) / self.patch_size.max(1)));
        let (full_layers, windowed) = match window {
            Some(unit) if unit > 0 => {
                let merge = wide(self.spatial_merge_size.max(1));
                // Window sides in merged tokens, the last one ragged.
                let sides = |len: u64| {
                    let mut sides = vec![unit; usize::try_from(len / unit).unwrap_or(0)];
                    if !len.is_multiple_of(unit) {
                        sides.push(len % unit);
                    }
                    sides
                };
                let (rows, cols) = (sides(h / merge), sides(w / merge));
                let windowed: u64 = rows
                    .iter()
                    .flat_map(|r| cols.iter().map(move |c| r * c * m))
                    .map(|len| 4 * len * len * d)
                    .sum();
                (wide(self.fullatt_block_indexes.len()), windowed)
            }
            _ => (depth, 0),
        };
        let attention = t * (full_layers * 4 * s * s * d + (depth - full_layers) * windowed);
        let mergers = 1 + wide(self.deepstack_visual_indexes.len());
        let merger = mergers * 2 * (n / m) * (m * d * m * d + m * d * out);
        patch_embed + qkv + proj + mlp + attention + merger
    }

    /// Checks every value a tower depends on; the error names the Hugging Face key.
    pub fn validate(&self) -> Result<(), ModelError> {
        let fam = self.family;
        positive("depth", self.depth)?;
        if self.depth > MAX_DEPTH {
            return Err(invalid(
                "depth",
                format!("{} exceeds the supported {MAX_DEPTH} blocks", self.depth),
            ));
        }
        positive(fam.hidden_key(), self.hidden)?;
        positive("num_heads", self.num_heads)?;
        positive(fam.intermediate_key(), self.intermediate)?;
        positive("patch_size", self.patch_size)?;
        positive("temporal_patch_size", self.temporal_patch_size)?;
        positive("spatial_merge_size", self.spatial_merge_size)?;
        positive("in_channels", self.in_channels)?;
        positive(fam.out_hidden_key(), self.out_hidden)?;
        if !self.hidden.is_multiple_of(self.num_heads) {
            return Err(invalid(
                "num_heads",
                format!(
                    "{} = {} is not divisible by num_heads = {}",
                    fam.hidden_key(),
                    self.hidden,
                    self.num_heads
                ),
            ));
        }
        // The 2-D rotary embedding splits half of each head between rows and columns, and each
        // half rotates pairs: head_dim / 2 / 2 frequencies per axis.
        if !self.head_dim().is_multiple_of(4) {
            return Err(invalid(
                "num_heads",
                format!(
                    "head_dim = {} / {} = {} must be divisible by 4 for the 2-D rotary embedding",
                    self.hidden,
                    self.num_heads,
                    self.head_dim()
                ),
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(invalid(
                "layer_norm_eps",
                format!("{} must be a positive number", self.layer_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                "rope_theta",
                format!("{} must be a positive number", self.rope_theta),
            ));
        }
        // Every tensor's element count (and its bytes in f32) must be representable: the
        // largest tensor of each kind, with the key that makes it large.
        let product = |parts: &[usize]| parts.iter().try_fold(4usize, |acc, &d| acc.checked_mul(d));
        let merged = product(&[
            self.hidden,
            self.spatial_merge_size,
            self.spatial_merge_size,
        ]);
        for (key, elements) in [
            (
                "patch_size",
                product(&[
                    self.hidden,
                    self.in_channels,
                    self.temporal_patch_size,
                    self.patch_size,
                    self.patch_size,
                ]),
            ),
            (fam.hidden_key(), product(&[3, self.hidden, self.hidden])),
            (
                fam.intermediate_key(),
                product(&[self.intermediate, self.hidden]),
            ),
            ("spatial_merge_size", merged.and_then(|u| u.checked_mul(u))),
            (
                fam.out_hidden_key(),
                merged.and_then(|u| u.checked_mul(self.out_hidden)),
            ),
            (
                "num_position_embeddings",
                product(&[self.num_position_embeddings.unwrap_or(1), self.hidden]),
            ),
        ] {
            if elements.is_none() {
                return Err(invalid(key, "the tensor sizes it implies overflow".into()));
            }
        }

        match fam {
            Family::Qwen25Vl => {
                let window = self.window_size.ok_or_else(|| {
                    invalid("window_size", "Qwen2.5-VL needs a window size".into())
                })?;
                let unit = self.patch_size * self.spatial_merge_size;
                if window == 0 || !window.is_multiple_of(unit) {
                    return Err(invalid(
                        "window_size",
                        format!(
                            "{window} must be a positive multiple of patch_size * spatial_merge_size = {unit}"
                        ),
                    ));
                }
                block_indexes(
                    "fullatt_block_indexes",
                    &self.fullatt_block_indexes,
                    self.depth,
                )?;
            }
            Family::Qwen2Vl | Family::Qwen3Vl => {
                absent("window_size", self.window_size.is_some(), fam)?;
                absent(
                    "fullatt_block_indexes",
                    !self.fullatt_block_indexes.is_empty(),
                    fam,
                )?;
            }
        }
        match fam {
            Family::Qwen3Vl => {
                let n = self.num_position_embeddings.ok_or_else(|| {
                    invalid(
                        "num_position_embeddings",
                        "Qwen3-VL needs learned position embeddings".into(),
                    )
                })?;
                if n == 0 || isqrt(n) * isqrt(n) != n {
                    return Err(invalid(
                        "num_position_embeddings",
                        format!("{n} must be a positive square (a grid of embeddings)"),
                    ));
                }
                block_indexes(
                    "deepstack_visual_indexes",
                    &self.deepstack_visual_indexes,
                    self.depth,
                )?;
            }
            Family::Qwen2Vl | Family::Qwen25Vl => {
                absent(
                    "num_position_embeddings",
                    self.num_position_embeddings.is_some(),
                    fam,
                )?;
                absent(
                    "deepstack_visual_indexes",
                    !self.deepstack_visual_indexes.is_empty(),
                    fam,
                )?;
            }
        }
        Ok(())
    }

    /// Parses a vision config object (the `vision_config` of a full model config, or a bare
    /// vision config) of the given family, filling missing keys with transformers' defaults.
    /// `file` and `key_prefix` only shape error messages.
    pub fn from_hf_json(
        family: Family,
        obj: &Map<String, Value>,
        file: &str,
        key_prefix: &str,
    ) -> Result<VisionConfig, ModelError> {
        let o = Obj {
            file,
            prefix: key_prefix,
            map: obj,
        };
        let act = |default: &str| -> Result<HiddenAct, ModelError> {
            let name = o.str_or("hidden_act", default)?;
            HiddenAct::parse(&name).ok_or_else(|| {
                o.err(
                    "hidden_act",
                    format!(
                        "unsupported activation `{name}` (supported: quick_gelu, gelu, gelu_pytorch_tanh, silu)"
                    ),
                )
            })
        };
        // `in_chans` and `spatial_patch_size` are what the original Qwen2-VL / 2.5-VL files
        // carry; transformers ignores them, but their values always equal the real keys'.
        let in_channels = match o.usize_opt("in_channels")? {
            Some(v) => v,
            None => o.usize_or("in_chans", 3)?,
        };
        let cfg = match family {
            // Defaults: transformers' Qwen2VLVisionConfig.
            Family::Qwen2Vl => {
                let hidden = o.usize_or("embed_dim", 1280)?;
                let ratio = o.f64_or("mlp_ratio", 4.0)?;
                VisionConfig {
                    family,
                    depth: o.usize_or("depth", 32)?,
                    hidden,
                    num_heads: o.usize_or("num_heads", 16)?,
                    intermediate: mlp_width(&o, hidden, ratio)?,
                    hidden_act: act("quick_gelu")?,
                    patch_size: patch_size(&o, 14)?,
                    temporal_patch_size: o.usize_or("temporal_patch_size", 2)?,
                    spatial_merge_size: o.usize_or("spatial_merge_size", 2)?,
                    in_channels,
                    out_hidden: o.usize_or("hidden_size", 3584)?,
                    window_size: None,
                    fullatt_block_indexes: Vec::new(),
                    num_position_embeddings: None,
                    deepstack_visual_indexes: Vec::new(),
                    layer_norm_eps: LAYER_NORM_EPS,
                    rope_theta: ROPE_THETA,
                }
            }
            // Defaults: transformers' Qwen2_5_VLVisionConfig (its hidden_size default is 3584,
            // which no published checkpoint relies on: they all write 1280).
            Family::Qwen25Vl => VisionConfig {
                family,
                depth: o.usize_or("depth", 32)?,
                hidden: o.usize_or("hidden_size", 3584)?,
                num_heads: o.usize_or("num_heads", 16)?,
                intermediate: o.usize_or("intermediate_size", 3420)?,
                hidden_act: act("silu")?,
                patch_size: patch_size(&o, 14)?,
                temporal_patch_size: o.usize_or("temporal_patch_size", 2)?,
                spatial_merge_size: o.usize_or("spatial_merge_size", 2)?,
                in_channels,
                out_hidden: o.usize_or("out_hidden_size", 3584)?,
                window_size: Some(o.usize_or("window_size", 112)?),
                fullatt_block_indexes: o
                    .usize_list_or("fullatt_block_indexes", &[7, 15, 23, 31])?,
                num_position_embeddings: None,
                deepstack_visual_indexes: Vec::new(),
                layer_norm_eps: LAYER_NORM_EPS,
                rope_theta: ROPE_THETA,
            },
            // Defaults: transformers' Qwen3VLVisionConfig.
            Family::Qwen3Vl => VisionConfig {
                family,
                depth: o.usize_or("depth", 27)?,
                hidden: o.usize_or("hidden_size", 1152)?,
                num_heads: o.usize_or("num_heads", 16)?,
                intermediate: o.usize_or("intermediate_size", 4304)?,
                hidden_act: act("gelu_pytorch_tanh")?,
                patch_size: patch_size(&o, 16)?,
                temporal_patch_size: o.usize_or("temporal_patch_size", 2)?,
                spatial_merge_size: o.usize_or("spatial_merge_size", 2)?,
                in_channels,
                out_hidden: o.usize_or("out_hidden_size", 3584)?,
                window_size: None,
                fullatt_block_indexes: Vec::new(),
                num_position_embeddings: Some(o.usize_or("num_position_embeddings", 2304)?),
                deepstack_visual_indexes: o
                    .usize_list_or("deepstack_visual_indexes", &[8, 16, 24])?,
                layer_norm_eps: LAYER_NORM_EPS,
                rope_theta: ROPE_THETA,
            },
        };
        cfg.validate().map_err(|e| o.located(e))?;
        Ok(cfg)
    }

    /// This config as a bare Hugging Face vision config (what [`VisionConfig::from_hf_json`]
    /// reads back to an equal config).
    pub fn to_hf_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("model_type".into(), self.family.model_type().into());
        m.insert("depth".into(), self.depth.into());
        m.insert("num_heads".into(), self.num_heads.into());
        m.insert("hidden_act".into(), self.hidden_act.name().into());
        m.insert("patch_size".into(), self.patch_size.into());
        m.insert(
            "temporal_patch_size".into(),
            self.temporal_patch_size.into(),
        );
        m.insert("spatial_merge_size".into(), self.spatial_merge_size.into());
        m.insert("in_channels".into(), self.in_channels.into());
        match self.family {
            Family::Qwen2Vl => {
                m.insert("embed_dim".into(), self.hidden.into());
                m.insert("hidden_size".into(), self.out_hidden.into());
                // Qwen2-VL states the MLP as a ratio; every preset's width is an exact multiple.
                let ratio = if self.hidden == 0 {
                    0.0
                } else {
                    ratio_of(self.intermediate, self.hidden)
                };
                m.insert("mlp_ratio".into(), ratio.into());
            }
            Family::Qwen25Vl | Family::Qwen3Vl => {
                m.insert("hidden_size".into(), self.hidden.into());
                m.insert("out_hidden_size".into(), self.out_hidden.into());
                m.insert("intermediate_size".into(), self.intermediate.into());
            }
        }
        if let Some(w) = self.window_size {
            m.insert("window_size".into(), w.into());
            m.insert(
                "fullatt_block_indexes".into(),
                self.fullatt_block_indexes.clone().into(),
            );
        }
        if let Some(n) = self.num_position_embeddings {
            m.insert("num_position_embeddings".into(), n.into());
            m.insert(
                "deepstack_visual_indexes".into(),
                self.deepstack_visual_indexes.clone().into(),
            );
        }
        Value::Object(m)
    }
}

// The processor options of a model are the preprocessing's own `ProcessorConfig`; this module
// adds how a checkpoint's `preprocessor_config.json` spells them.
impl ProcessorConfig {
    /// Parses a `preprocessor_config.json` object with `Qwen2VLImageProcessor`'s rules:
    /// `min_pixels` / `max_pixels` override `size.shortest_edge` / `size.longest_edge`, and
    /// missing keys take the processor's defaults. Errors name the file and the key.
    pub fn from_hf_json(
        obj: &Map<String, Value>,
        file: &str,
    ) -> Result<ProcessorConfig, ModelError> {
        let o = Obj {
            file,
            prefix: "",
            map: obj,
        };
        let (mut min_pixels, mut max_pixels) = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS);
        match obj.get("size") {
            None | Some(Value::Null) => {}
            Some(Value::Object(size)) => {
                let s = Obj {
                    file,
                    prefix: "size.",
                    map: size,
                };
                // transformers refuses a size without both edges.
                min_pixels = s.u64_opt("shortest_edge")?.ok_or_else(|| {
                    s.err(
                        "shortest_edge",
                        "missing (size needs shortest_edge and longest_edge)".into(),
                    )
                })?;
                max_pixels = s.u64_opt("longest_edge")?.ok_or_else(|| {
                    s.err(
                        "longest_edge",
                        "missing (size needs shortest_edge and longest_edge)".into(),
                    )
                })?;
            }
            Some(other) => {
                return Err(o.err("size", format!("expected an object, found {}", kind(other))));
            }
        }
        if let Some(v) = o.u64_opt("min_pixels")? {
            min_pixels = v;
        }
        if let Some(v) = o.u64_opt("max_pixels")? {
            max_pixels = v;
        }
        let config = ProcessorConfig {
            patch_size: o.u32_or("patch_size", 14)?,
            merge_size: o.u32_or("merge_size", 2)?,
            temporal_patch_size: o.u32_or("temporal_patch_size", 2)?,
            min_pixels,
            max_pixels,
            image_mean: o.channels_or("image_mean", CLIP_MEAN)?,
            image_std: o.channels_or("image_std", CLIP_STD)?,
            ..ProcessorConfig::qwen2_vl()
        };
        validate_processor(&config).map_err(|e| o.located(e))?;
        Ok(config)
    }

    /// These options as a `preprocessor_config.json` object (with `min_pixels` / `max_pixels`).
    pub fn to_hf_json(&self) -> Value {
        serde_json::json!({
            "image_processor_type": "Qwen2VLImageProcessor",
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
        })
    }
}

/// Checks processor options on their own; the error names the `preprocessor_config.json` key.
fn validate_processor(p: &ProcessorConfig) -> Result<(), ModelError> {
    positive("patch_size", p.patch_size as usize)?;
    positive("merge_size", p.merge_size as usize)?;
    positive("temporal_patch_size", p.temporal_patch_size as usize)?;
    if p.patch_size.checked_mul(p.merge_size).is_none() {
        return Err(invalid(
            "merge_size",
            "patch_size * merge_size overflows".into(),
        ));
    }
    if p.min_pixels == 0 {
        return Err(invalid("min_pixels", "must be at least 1".into()));
    }
    if p.min_pixels > p.max_pixels {
        return Err(invalid(
            "max_pixels",
            format!(
                "{} is smaller than min_pixels = {}",
                p.max_pixels, p.min_pixels
            ),
        ));
    }
    if let Some(m) = p.image_mean.iter().find(|m| !m.is_finite()) {
        return Err(invalid("image_mean", format!("{m} is not a finite number")));
    }
    if let Some(s) = p.image_std.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
        return Err(invalid(
            "image_std",
            format!("{s} must be a positive number"),
        ));
    }
    // The preprocessing's own bounds too (patch, merge and temporal sizes it can take): a model
    // that loads must be able to serve, not fail every request.
    p.validate().map_err(|err| match err {
        crate::preprocess::PreprocessError::InvalidConfig {
            field,
            value,
            reason,
        } => invalid(field, format!("{value} {reason}")),
        other => invalid("preprocessor_config", other.to_string()),
    })
}

/// A model as iris runs it: a name, its tower and its processor settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Preset name, or the directory a model was read from.
    pub name: String,
    /// The vision tower.
    pub vision: VisionConfig,
    /// The image processor options.
    pub processor: ProcessorConfig,
}

/// Qwen3-VL checkpoints' video pixel bounds (`video_preprocessor_config.json`'s `size`), over
/// all frames of a video.
pub const QWEN3_VL_VIDEO_MIN_PIXELS: u64 = 4096;
/// See [`QWEN3_VL_VIDEO_MIN_PIXELS`].
pub const QWEN3_VL_VIDEO_MAX_PIXELS: u64 = 25_165_824;

/// How a model's videos are sampled and processed ([`ModelSpec::video_processing`]).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoProcessing {
    /// The video processor's settings (patch geometry, pixel bounds, mean and std).
    pub config: ProcessorConfig,
    /// How frames are resized.
    pub resize: VideoResize,
    /// vLLM's loader, which chooses the frames.
    pub loader: VideoLoader,
}

impl ModelSpec {
    /// A built-in preset by name (case-insensitive); see [`super::presets::PRESET_NAMES`].
    pub fn preset(name: &str) -> Result<ModelSpec, ModelError> {
        super::presets::get(name).ok_or_else(|| ModelError::UnknownPreset {
            name: name.to_string(),
            known: super::presets::PRESET_NAMES.join(", "),
        })
    }

    /// Reads a Hugging Face model directory's `config.json` (a full model config with a
    /// `vision_config`, or a bare vision config) and `preprocessor_config.json`.
    ///
    /// Without a `preprocessor_config.json` the family's published settings are used (the
    /// sizes still taken from the vision config).
    pub fn from_hf_dir(dir: &Path) -> Result<ModelSpec, ModelError> {
        let config_path = dir.join("config.json");
        let config = read_json_object(&config_path)?;
        let vision = vision_from_hf_config(&config, &config_path.display().to_string())?;
        let pre_path = dir.join("preprocessor_config.json");
        let pre_file = pre_path.display().to_string();
        let processor = if pre_path.exists() {
            let pre = read_json_object(&pre_path)?;
            ProcessorConfig::from_hf_json(&pre, &pre_file)?
        } else {
            let mut p = match vision.family {
                Family::Qwen2Vl | Family::Qwen25Vl => ProcessorConfig::qwen2_vl(),
                Family::Qwen3Vl => ProcessorConfig::qwen3_vl(),
            };
            let size = |key: &str, value: usize| {
                u32::try_from(value).map_err(|_| ModelError::ConfigKey {
                    file: config_path.display().to_string(),
                    key: key.to_owned(),
                    reason: format!("{value} is too large"),
                })
            };
            p.patch_size = size("patch_size", vision.patch_size)?;
            p.merge_size = size("spatial_merge_size", vision.spatial_merge_size)?;
            p.temporal_patch_size = size("temporal_patch_size", vision.temporal_patch_size)?;
            p
        };
        let spec = ModelSpec {
            name: dir.display().to_string(),
            vision,
            processor,
        };
        spec.check_agreement(&pre_file)?;
        Ok(spec)
    }

    /// How this model's videos are sampled and processed, as vLLM selects it from the video
    /// processor's class: Qwen2-VL and Qwen2.5-VL take `Qwen2VLVideoProcessor` with the image
    /// processor's settings (their checkpoints ship no video configuration) and vLLM's
    /// `qwen2_vl` loader; Qwen3-VL takes `Qwen3VLVideoProcessor` with the settings of the
    /// `video_preprocessor_config.json` its checkpoints ship (pixel bounds 4096 and 25165824 over
    /// all frames) and the `qwen3_vl` loader. A model directory's own
    /// `video_preprocessor_config.json`, when `dir` has one, replaces those settings.
    ///
    /// # Errors
    /// An unreadable or invalid `video_preprocessor_config.json`.
    pub fn video_processing(&self, dir: Option<&Path>) -> Result<VideoProcessing, ModelError> {
        let mut video = self.default_video_processing();
        if let Some(path) = dir
            .map(|dir| dir.join("video_preprocessor_config.json"))
            .filter(|path| path.exists())
        {
            let json = read_json_object(&path)?;
            video.config = ProcessorConfig::from_hf_json(&json, &path.display().to_string())?;
        }
        Ok(video)
    }

    /// The family's video processing with its defaults, as
    /// [`ModelSpec::video_processing`] gives it without a model directory.
    #[must_use]
    pub fn default_video_processing(&self) -> VideoProcessing {
        let (loader, resize, config) = match self.vision.family {
            Family::Qwen2Vl | Family::Qwen25Vl => (
                VideoLoader::Qwen2Vl,
                VideoResize::PerFrame,
                self.processor.clone(),
            ),
            Family::Qwen3Vl => {
                let mut config = self.processor.clone();
                config.min_pixels = QWEN3_VL_VIDEO_MIN_PIXELS;
                config.max_pixels = QWEN3_VL_VIDEO_MAX_PIXELS;
                (VideoLoader::Qwen3Vl, VideoResize::OverAllFrames, config)
            }
        };
        VideoProcessing {
            config,
            resize,
            loader,
        }
    }

    /// Validates the tower, the processor settings and that they agree on the patch geometry.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.vision.validate()?;
        validate_processor(&self.processor)?;
        self.check_agreement("processor settings")
    }

    fn check_agreement(&self, file: &str) -> Result<(), ModelError> {
        let (v, p) = (&self.vision, &self.processor);
        for (key, proc_value, vision_key, vision_value) in [
            (
                "patch_size",
                p.patch_size as usize,
                "patch_size",
                v.patch_size,
            ),
            (
                "merge_size",
                p.merge_size as usize,
                "spatial_merge_size",
                v.spatial_merge_size,
            ),
            (
                "temporal_patch_size",
                p.temporal_patch_size as usize,
                "temporal_patch_size",
                v.temporal_patch_size,
            ),
        ] {
            if proc_value != vision_value {
                return Err(ModelError::ConfigKey {
                    file: file.to_string(),
                    key: key.to_string(),
                    reason: format!(
                        "{proc_value} differs from the vision config's {vision_key} = {vision_value}"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Parses a `config.json` object: a full model config (with `vision_config`) or a bare vision
/// config.
pub(crate) fn vision_from_hf_config(
    config: &Map<String, Value>,
    file: &str,
) -> Result<VisionConfig, ModelError> {
    let top = Obj {
        file,
        prefix: "",
        map: config,
    };
    match config.get("vision_config") {
        Some(Value::Object(vision)) => {
            let sub = Obj {
                file,
                prefix: "vision_config.",
                map: vision,
            };
            // The top-level model_type names the model; the vision config's own is a fallback.
            let model_type = match top.str_opt("model_type")? {
                Some(t) => t,
                None => sub
                    .str_opt("model_type")?
                    .ok_or_else(|| top.err("model_type", "missing".into()))?,
            };
            let family = family_of(&model_type, file)?;
            VisionConfig::from_hf_json(family, vision, file, "vision_config.")
        }
        Some(other) => Err(top.err(
            "vision_config",
            format!("expected an object, found {}", kind(other)),
        )),
        None => {
            let model_type = top
                .str_opt("model_type")?
                .ok_or_else(|| top.err("model_type", "missing".into()))?;
            let family = family_of(&model_type, file)?;
            VisionConfig::from_hf_json(family, config, file, "")
        }
    }
}

fn family_of(model_type: &str, file: &str) -> Result<Family, ModelError> {
    Family::from_model_type(model_type).ok_or_else(|| ModelError::UnknownModelType {
        file: file.to_string(),
        model_type: model_type.to_string(),
    })
}

pub(crate) fn read_json_object(path: &Path) -> Result<Map<String, Value>, ModelError> {
    let text = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_json::from_slice(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ModelError::ConfigKey {
            file: path.display().to_string(),
            key: "(top level)".into(),
            reason: format!("expected an object, found {}", kind(&other)),
        }),
    }
}

/// A JSON object being read, with what error messages need to locate its keys.
struct Obj<'a> {
    file: &'a str,
    prefix: &'a str,
    map: &'a Map<String, Value>,
}

impl Obj<'_> {
    fn err(&self, key: &str, reason: String) -> ModelError {
        ModelError::ConfigKey {
            file: self.file.to_string(),
            key: format!("{}{key}", self.prefix),
            reason,
        }
    }

    /// Attaches the file and key prefix to a validation error.
    fn located(&self, e: ModelError) -> ModelError {
        match e {
            ModelError::InvalidConfig { key, reason } => self.err(&key, reason),
            other => other,
        }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn u64_opt(&self, key: &str) -> Result<Option<u64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                // 14.0 is how some exporters write 14.
                None => match v.as_f64() {
                    Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => {
                        Ok(Some(whole_f64_to_u64(f)))
                    }
                    _ => Err(self.err(key, format!("expected a non-negative integer, found {v}"))),
                },
            },
        }
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.u64_opt(key)? {
            None => Ok(None),
            Some(n) => usize::try_from(n)
                .map(Some)
                .map_err(|_| self.err(key, format!("{n} does not fit this machine's sizes"))),
        }
    }

    fn u32_or(&self, key: &str, default: u32) -> Result<u32, ModelError> {
        let value = self.usize_or(key, default as usize)?;
        u32::try_from(value).map_err(|_| self.err(key, format!("{value} is too large")))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        Ok(self.usize_opt(key)?.unwrap_or(default))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(key, format!("expected a number, found {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<String>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(key, format!("expected a string, found {v}"))),
        }
    }

    fn str_or(&self, key: &str, default: &str) -> Result<String, ModelError> {
        Ok(self.str_opt(key)?.unwrap_or_else(|| default.to_string()))
    }

    fn usize_list_or(&self, key: &str, default: &[usize]) -> Result<Vec<usize>, ModelError> {
        match self.get(key) {
            None => Ok(default.to_vec()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| {
                            self.err(
                                key,
                                format!("expected a list of block indexes, found {item}"),
                            )
                        })
                })
                .collect(),
            Some(v) => Err(self.err(key, format!("expected a list, found {v}"))),
        }
    }

    /// A per-channel value: a list of three numbers, or one number for all channels (as
    /// transformers accepts).
    fn channels_or(&self, key: &str, default: [f32; 3]) -> Result<[f32; 3], ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Array(items)) => {
                if items.len() != 3 {
                    return Err(self.err(
                        key,
                        format!(
                            "expected 3 values (one per RGB channel), found {}",
                            items.len()
                        ),
                    ));
                }
                let mut out = [0.0; 3];
                for (slot, item) in out.iter_mut().zip(items) {
                    *slot = item
                        .as_f64()
                        .map(round_to_f32)
                        .ok_or_else(|| self.err(key, format!("expected numbers, found {item}")))?;
                }
                Ok(out)
            }
            Some(v) => v
                .as_f64()
                .map(|x| [round_to_f32(x); 3])
                .ok_or_else(|| self.err(key, format!("expected a list of numbers, found {v}"))),
        }
    }
}

fn mlp_width(o: &Obj<'_>, hidden: usize, ratio: f64) -> Result<usize, ModelError> {
    // transformers: int(embed_dim * mlp_ratio), i.e. truncation.
    let width = (usize_to_f64(hidden) * ratio).floor();
    if !(1.0..9.0e15).contains(&width) {
        return Err(o.err(
            "mlp_ratio",
            format!("{ratio} gives an MLP width of {width} for embed_dim = {hidden}"),
        ));
    }
    usize::try_from(whole_f64_to_u64(width))
        .map_err(|_| o.err("mlp_ratio", format!("MLP width {width} does not fit")))
}

fn patch_size(o: &Obj<'_>, default: usize) -> Result<usize, ModelError> {
    match o.usize_opt("patch_size")? {
        Some(v) => Ok(v),
        None => o.usize_or("spatial_patch_size", default),
    }
}

fn positive(key: &str, value: usize) -> Result<(), ModelError> {
    if value == 0 {
        Err(invalid(key, "must be at least 1".into()))
    } else {
        Ok(())
    }
}

fn absent(key: &str, present: bool, family: Family) -> Result<(), ModelError> {
    if present {
        Err(invalid(key, format!("does not apply to {family} towers")))
    } else {
        Ok(())
    }
}

fn block_indexes(key: &str, indexes: &[usize], depth: usize) -> Result<(), ModelError> {
    for (i, &b) in indexes.iter().enumerate() {
        if b >= depth {
            return Err(invalid(
                key,
                format!("block {b} does not exist (depth = {depth})"),
            ));
        }
        if indexes[..i].contains(&b) {
            return Err(invalid(key, format!("block {b} is listed twice")));
        }
    }
    Ok(())
}

fn invalid(key: &str, reason: String) -> ModelError {
    ModelError::InvalidConfig {
        key: key.to_string(),
        reason,
    }
}

fn isqrt(n: usize) -> usize {
    // Newton's method on integers; exact for every usize.
    if n < 2 {
        return n;
    }
    let mut x = n;
    let mut y = x.div_ceil(2);
    while y < x {
        x = y;
        y = (x + n / x) / 2;
    }
    x
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn usize_to_f64(n: usize) -> f64 {
    // Model dimensions are far below 2^53, where this is exact.
    n as f64
}

fn ratio_of(a: usize, b: usize) -> f64 {
    usize_to_f64(a) / usize_to_f64(b)
}

/// Rounds a JSON number to f32, the precision the image processor normalises in; values beyond
/// f32's range become infinite, which validation then rejects.
#[allow(clippy::cast_possible_truncation)] // narrowing is the point; see above
fn round_to_f32(x: f64) -> f32 {
    x as f32
}

/// Converts a whole, non-negative f64 below 2^53 (checked by every caller) to u64.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // callers check range and fraction
fn whole_f64_to_u64(f: f64) -> u64 {
    f as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isqrt_exact() {
        for n in 0..2000usize {
            let r = isqrt(n);
            assert!(r * r <= n && (r + 1) * (r + 1) > n, "isqrt({n}) = {r}");
        }
        assert_eq!(isqrt(2304), 48);
    }

    #[test]
    fn whole_f64_roundtrip() {
        for n in [0u64, 1, 14, 4096, 12_845_056, (1 << 40) + 7] {
            let f = f64::from(u32::try_from(n >> 20).unwrap()) * 1_048_576.0
                + f64::from(u32::try_from(n & 0xF_FFFF).unwrap());
            assert_eq!(whole_f64_to_u64(f), n);
        }
    }

    #[test]
    fn float_integers_accepted() {
        let map: Map<String, Value> =
            serde_json::from_str(r#"{"model_type":"qwen2_vl","depth":2.0,"embed_dim":64,"num_heads":4,"hidden_size":64}"#)
                .unwrap();
        let cfg = vision_from_hf_config(&map, "config.json").unwrap();
        assert_eq!(cfg.depth, 2);
        let map: Map<String, Value> =
            serde_json::from_str(r#"{"model_type":"qwen2_vl","depth":2.5}"#).unwrap();
        let err = vision_from_hf_config(&map, "config.json").unwrap_err();
        assert!(err.to_string().contains("`depth`"), "{err}");
    }

    #[test]
    fn tower_flops_are_the_gpu_checks_count() {
        // `python tools/gpu-check/towers_vs_transformers.py --flops --towers
        // qwen2-vl-2b,qwen2.5-vl-7b,qwen3-vl-8b,tiny --image-size S --json F`: one S x S image.
        let cases: [(&str, u32, u64); 14] = [
            ("qwen2-vl-2b", 448, 1_480_819_998_720),
            ("qwen2.5-vl-7b", 448, 1_346_937_815_040),
            ("qwen3-vl-8b", 448, 786_695_454_720),
            ("tiny", 448, 867_172_352),
            ("qwen2-vl-2b", 224, 337_992_744_960),
            ("qwen2.5-vl-7b", 224, 332_707_921_920),
            ("qwen3-vl-8b", 224, 182_335_168_512),
            ("qwen2-vl-2b", 896, 7_984_864_296_960),
            ("qwen2.5-vl-7b", 896, 5_645_449_297_920),
            ("qwen3-vl-8b", 896, 4_064_458_309_632),
            ("tiny", 896, 9_911_140_352),
            // 392 / 28 = 14 merged tokens a side: Qwen2.5-VL's last windows are ragged.
            ("qwen2-vl-2b", 392, 1_102_924_677_120),
            ("qwen2.5-vl-7b", 392, 1_026_404_843_520),
            ("tiny", 392, 567_590_912),
        ];
        for (preset, side, want) in cases {
            let vision = crate::model::ModelSpec::preset(preset).unwrap().vision;
            let patches = side / u32::try_from(vision.patch_size).unwrap();
            assert_eq!(
                vision.flops([1, patches, patches]),
                want,
                "{preset} at {side}x{side}"
            );
        }
        // A video's temporal groups are segments of their own: t groups cost t images.
        let vision = crate::model::ModelSpec::preset("qwen2.5-vl-7b")
            .unwrap()
            .vision;
        assert_eq!(vision.flops([3, 28, 28]), 3 * vision.flops([1, 28, 28]));
    }
}
