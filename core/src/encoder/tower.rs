//! The Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers, each a graph of ABI ops defined once and
//! run on any device that implements them.
//!
//! Structure shared by the three (transformers' `modeling_qwen2_vl.py`, `modeling_qwen2_5_vl.py`,
//! `modeling_qwen3_vl.py`): patch embedding as a matrix product of each patch row with the
//! flattened Conv3d weight; blocks of `x += proj(attn(norm1(x)))`, `x += mlp(norm2(x))` with a
//! fused qkv projection and 2-D rotary on q and k; a merger that normalises, groups each
//! `merge x merge` window of patches into one row and projects it to the language model's width.
//! Differences: Qwen2-VL uses LayerNorm and a quick-gelu MLP; Qwen2.5-VL RMSNorm, a SiLU-gated MLP
//! and window attention except at its full-attention layers; Qwen3-VL patch 16 with a biased
//! patch embedding, interpolated learned position embeddings, a gelu-tanh MLP and deepstack
//! mergers that read hidden states at chosen layers.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use lru::LruCache;

use iris_plugin::{Activation, BinaryOp, DType};

use crate::encoder::EncoderError;
use crate::encoder::exec::{Runner, Segments, Tensor, dtype_size, encode_f32};
use crate::encoder::layout::{
    Grid, distinct_frames, distinct_positions, expand_units, frame_cu_seqlens, interpolated_frame,
    inverse_permutation, patches, rotary_positions, rotary_tables, window_layout,
};
use crate::encoder::plan::StepPlan;
use crate::memory::CachingAllocator;
use crate::model::{Family, HostTensor, HostWeights, VisionConfig};

/// A vision tower with its weights resident on a device.
pub struct VisionTower {
    config: VisionConfig,
    dtype: DType,
    weights: HashMap<String, Tensor>,
    /// Each weight's shape as loaded, so that [`VisionTower::to_host`] gives back the same
    /// host tensors.
    shapes: HashMap<String, Vec<usize>>,
    /// Qwen3-VL's position table stays on the host: interpolation to each frame size is index
    /// arithmetic, done there once per distinct size of a batch.
    pos_table: Option<Vec<f32>>,
    /// The interpolated tables of recent frame sizes.
    pos_frames: FrameCache,
    weight_bytes: u64,
}

/// The rotary tables of one forward pass, `[tokens, head_dim]` f32 each.
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

/// Encoder outputs of one image.
pub struct ImageOutput {
    /// `[tokens, out_hidden]` embeddings.
    pub embeddings: Tensor,
    /// Qwen3-VL deepstack outputs, `[tokens, out_hidden]` each (empty for other families).
    pub deepstack: Vec<Tensor>,
}

impl VisionTower {
    /// Uploads host weights (already in the run dtype) through the runner's allocator; the
    /// host copy stays with the caller.
    pub fn new(
        runner: &Runner,
        config: VisionConfig,
        weights: &HostWeights,
        dtype: DType,
    ) -> Result<VisionTower, EncoderError> {
        let mut tower = VisionTower::empty(config, dtype);
        for (name, tensor) in weights.iter() {
            tower.upload(runner, name, tensor)?;
        }
        Ok(tower)
    }

    /// Uploads host weights like [`VisionTower::new`], dropping each host tensor once its bytes
    /// are on the device: the process holds the weights about once while it loads, not twice
    /// (on a CPU device the device's memory is the process's).
    pub fn from_host(
        runner: &Runner,
        config: VisionConfig,
        weights: HostWeights,
        dtype: DType,
    ) -> Result<VisionTower, EncoderError> {
        VisionTower::from_host_with_progress(runner, config, weights, dtype, &mut |_| {})
    }

    /// [`VisionTower::from_host`], calling `uploaded_bytes` with the bytes uploaded so far after
    /// each tensor (for a progress display: a large tower takes seconds).
    pub fn from_host_with_progress(
        runner: &Runner,
        config: VisionConfig,
        mut weights: HostWeights,
        dtype: DType,
        uploaded_bytes: &mut dyn FnMut(u64),
    ) -> Result<VisionTower, EncoderError> {
        let mut tower = VisionTower::empty(config, dtype);
        let names: Vec<String> = weights.iter().map(|(name, _)| name.to_owned()).collect();
        let mut done = 0u64;
        for name in names {
            let tensor = weights
                .take(&name)
                .map_err(|_| EncoderError::MissingWeight(name.clone()))?;
            tower.upload(runner, &name, &tensor)?;
            // An asynchronous device keeps its own copy of the bytes until the write runs:
            // waiting here bounds the copies in flight to one tensor's.
            runner.allocator().synchronize()?;
            done += tensor.bytes.len() as u64;
            uploaded_bytes(done);
        }
        Ok(tower)
    }

    fn empty(config: VisionConfig, dtype: DType) -> VisionTower {
        VisionTower {
            config,
            dtype,
            weights: HashMap::new(),
            shapes: HashMap::new(),
            pos_table: None,
            pos_frames: FrameCache::new(FRAME_CACHE_BYTES),
            weight_bytes: 0,
        }
    }

    /// Uploads one host tensor (Qwen3-VL's position table stays on the host).
    fn upload(
        &mut self,
        runner: &Runner,
        name: &str,
        tensor: &HostTensor,
    ) -> Result<(), EncoderError> {
        self.shapes.insert(name.to_owned(), tensor.shape.clone());
        if name == "pos_embed.weight" {
            self.pos_table = Some(tensor.to_f32());
            return Ok(());
        }
        let (rows, cols) = matrix_shape(&tensor.shape);
        let device_tensor = match self.padded_shape(name, (rows, cols)) {
            Some(padded) => {
                let bytes = resize_block(&tensor.bytes, tensor.dtype, (rows, cols), padded)?;
                runner.upload_bytes(&bytes, tensor.dtype, padded.0, padded.1)?
            }
            None => runner.upload_bytes(&tensor.bytes, tensor.dtype, rows, cols)?,
        };
        self.weight_bytes += device_tensor.bytes();
        self.weights.insert(name.to_owned(), device_tensor);
        Ok(())
    }

    /// Copies the weights back to the host, as [`VisionTower::new`] received them: what a
    /// level-1 sleep keeps so that waking up needs no reload from the weight source.
    pub fn to_host(&self, runner: &Runner) -> Result<HostWeights, EncoderError> {
        let mut tensors = BTreeMap::new();
        for (name, tensor) in &self.weights {
            let shape = self
                .shapes
                .get(name)
                .cloned()
                .ok_or_else(|| EncoderError::MissingWeight(name.clone()))?;
            let mut bytes = runner.download_bytes(tensor)?;
            let loaded = matrix_shape(&shape);
            if loaded != (tensor.rows(), tensor.cols()) {
                // A padded MLP weight: the loaded block is its top left.
                bytes = resize_block(&bytes, self.dtype, (tensor.rows(), tensor.cols()), loaded)?;
            }
            tensors.insert(
                name.clone(),
                HostTensor {
                    dtype: self.dtype,
                    shape,
                    bytes,
                },
            );
        }
        if let Some(table) = &self.pos_table {
            let name = "pos_embed.weight";
            let shape = self
                .shapes
                .get(name)
                .cloned()
                .unwrap_or_else(|| vec![table.len()]);
            tensors.insert(
                name.to_owned(),
                HostTensor {
                    dtype: self.dtype,
                    shape,
                    // Widening to f32 was exact, so narrowing back restores the loaded bytes.
                    bytes: encode_f32(table, self.dtype),
                },
            );
        }
        Ok(HostWeights::new(self.dtype, tensors, "device copy"))
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The run dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of weights resident on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Embedding tokens an image of this grid produces.
    pub fn tokens(&self, grid: Grid) -> u64 {
        patches(grid) as u64 / self.config.merge_unit() as u64
    }

    /// Plans a step on `grids` (see [`StepPlan`]) whose input is uploaded by
    /// [`Runner::upload_f32_parts_lent`] (or made by [`Runner::upload_placeholder`]) on a runner
    /// of `allocator`, then run by [`VisionTower::forward`] and dropped after it: the order every
    /// step of this tower takes.
    ///
    /// # Errors
    /// Grids the tower cannot run.
    pub fn plan_step(
        &self,
        allocator: &Arc<CachingAllocator>,
        grids: &[Grid],
    ) -> Result<StepPlan, EncoderError> {
        let rows: u64 = grids.iter().map(|g| patches(*g) as u64).sum();
        let row_len = self.config.patch_row_len() as u64;
        Runner::plan_step(allocator, |planner| {
            let input = planner.upload_placeholder(self.dtype, rows, row_len)?;
            let outputs = self.forward(planner, &input, grids)?;
            drop(input);
            Ok(outputs)
        })
    }

    /// Runs the tower on `pixels` (`[patches, C*T*P*P]`, the images' rows concatenated in
    /// order) for images of the given grids; one output per image, each in its own buffers.
    pub fn forward(
        &self,
        runner: &Runner,
        pixels: &Tensor,
        grids: &[Grid],
    ) -> Result<Vec<ImageOutput>, EncoderError> {
        self.forward_with_progress(runner, pixels, grids, &mut |_| Ok(()))
    }

    /// [`VisionTower::forward`], calling `layers_done` with the number of blocks submitted
    /// after each one (of [`VisionConfig::depth`]); an error it returns stops the run.
    pub fn forward_with_progress(
        &self,
        runner: &Runner,
        pixels: &Tensor,
        grids: &[Grid],
        layers_done: &mut dyn FnMut(usize) -> Result<(), EncoderError>,
    ) -> Result<Vec<ImageOutput>, EncoderError> {
        let cfg = &self.config;
        let merge = u32::try_from(cfg.spatial_merge_size).map_err(|_| shape("merge size"))?;
        let merge_unit = merge * merge;
        let hidden_size = cfg.hidden as u64;
        let total: u64 = grids.iter().map(|g| patches(*g) as u64).sum();
        let row_len = cfg.patch_row_len() as u64;
        if pixels.rows() != total || pixels.cols() != row_len {
            return Err(EncoderError::Shape(format!(
                "pixel values are {}x{}, grids need {total}x{row_len}",
                pixels.rows(),
                pixels.cols(),
            )));
        }
        for grid in grids {
            if grid[1] % merge != 0 || grid[2] % merge != 0 || grid.contains(&0) {
                return Err(EncoderError::Shape(format!(
                    "grid {grid:?} is not a non-empty multiple of the merge size {merge}"
                )));
            }
        }

        // Patch embedding (and Qwen3's interpolated position embeddings).
        let mut hidden = runner.linear(
            pixels,
            self.weight("patch_embed.proj.weight")?,
            self.optional("patch_embed.proj.bias"),
            Activation::NONE,
        )?;
        if let Some(table) = &self.pos_table {
            let side = integer_sqrt(cfg.num_position_embeddings.unwrap_or(0));
            // Each distinct frame size is interpolated once and gathered into every frame of
            // that size on the device. Planning sizes tensors only: the host tables are not
            // worth computing for it.
            let frames = distinct_frames(grids);
            let distinct_rows: u64 = frames.keys.iter().map(|&[h, w]| u64::from(h * w)).sum();
            let tables: Vec<Arc<Vec<f32>>> = if runner.is_planning() {
                Vec::new()
            } else {
                frames
                    .keys
                    .iter()
                    .map(|&frame| {
                        self.pos_frames.get_or_insert(frame, || {
                            interpolated_frame(table, side, cfg.hidden, frame, merge)
                        })
                    })
                    .collect()
            };
            let parts: Vec<&[f32]> = tables.iter().map(|t| t.as_slice()).collect();
            let pos = gathered(
                runner,
                &parts,
                self.dtype,
                [distinct_rows, hidden_size],
                &frames.index,
            )?;
            runner.binary_in_place(&hidden, &pos, BinaryOp::ADD)?;
        }

        let mut positions = rotary_positions(grids, merge);
        // Everything that depends only on the grids is uploaded once here and read by every
        // layer: attention segments, the window permutation, the rotary tables.
        let full = runner.segments(frame_cu_seqlens(grids))?;
        let mut window = None;
        let mut restore: Option<Vec<u32>> = None;
        if cfg.family == Family::Qwen25Vl {
            let window_size = cfg.window_size.unwrap_or(0);
            let units = window_size / cfg.spatial_merge_size / cfg.patch_size;
            let units = u32::try_from(units.max(1)).map_err(|_| shape("window size"))?;
            let (unit_index, cu) = window_layout(grids, merge, units);
            let rows = expand_units(&unit_index, merge_unit);
            hidden = runner.gather_rows(&hidden, &runner.indices(&rows)?)?;
            positions = rows
                .iter()
                .flat_map(|&row| {
                    let at = row as usize * 2;
                    [positions[at], positions[at + 1]]
                })
                .collect();
            window = Some(runner.segments(cu)?);
            restore = Some(inverse_permutation(&unit_index));
        }
        // The rotary base (10000) is exact in f32, the precision the tables are computed in.
        #[allow(clippy::cast_possible_truncation)]
        let theta = cfg.rope_theta as f32;
        let head_dim = cfg.head_dim();
        // Tokens at one [row, col] share their angles: each distinct pair's row is computed
        // once and gathered into token order on the device.
        let pairs = distinct_positions(&positions);
        let (cos, sin) = if runner.is_planning() {
            (Vec::new(), Vec::new())
        } else {
            rotary_tables(pairs.keys.as_flattened(), head_dim, theta)
        };
        let distinct_rows = pairs.keys.len() as u64;
        let cols = head_dim as u64;
        let rotary = Rotary {
            cos: gathered(
                runner,
                &[&cos],
                DType::F32,
                [distinct_rows, cols],
                &pairs.index,
            )?,
            sin: gathered(
                runner,
                &[&sin],
                DType::F32,
                [distinct_rows, cols],
                &pairs.index,
            )?,
        };

        let mut deepstack = Vec::new();
        for layer in 0..cfg.depth {
            let segments = match &window {
                Some(window) if !cfg.fullatt_block_indexes.contains(&layer) => window,
                _ => &full,
            };
            self.block(runner, layer, &hidden, &rotary, segments)?;
            if let Some(j) = cfg
                .deepstack_visual_indexes
                .iter()
                .position(|&i| i == layer)
            {
                deepstack.push(self.merger(
                    runner,
                    &format!("deepstack_merger_list.{j}"),
                    &hidden,
                    true,
                )?);
            }
            layers_done(layer + 1)?;
        }
        drop((rotary, full, window));
        let merged = self.merger(runner, "merger", &hidden, false)?;
        drop(hidden);

        // Split per image (restoring Qwen2.5's window order) into buffers of their own, so that
        // each image's entry in the encoder cache owns exactly its bytes.
        let mut outputs = Vec::with_capacity(grids.len());
        let mut start = 0u64;
        for grid in grids {
            let tokens = self.tokens(*grid);
            let split = |tensor: &Tensor, order: Option<&Tensor>| -> Result<Tensor, EncoderError> {
                match order {
                    Some(indices) => runner.gather_rows(tensor, indices),
                    None => {
                        let out = runner.tensor(tensor.dtype(), tokens, tensor.cols())?;
                        runner.copy_rows(&tensor.row_range(start, tokens)?, &out)?;
                        Ok(out)
                    }
                }
            };
            let order = match &restore {
                Some(inverse) => {
                    let from = usize::try_from(start).map_err(|_| shape("rows"))?;
                    let len = usize::try_from(tokens).map_err(|_| shape("rows"))?;
                    Some(runner.indices(&inverse[from..from + len])?)
                }
                None => None,
            };
            let embeddings = split(&merged, order.as_ref())?;
            let mut extra = Vec::with_capacity(deepstack.len());
            for output in &deepstack {
                extra.push(split(output, order.as_ref())?);
            }
            outputs.push(ImageOutput {
                embeddings,
                deepstack: extra,
            });
            start += tokens;
        }
        Ok(outputs)
    }

    /// One transformer block, updating `hidden` in place.
    fn block(
        &self,
        runner: &Runner,
        layer: usize,
        hidden: &Tensor,
        rotary: &Rotary,
        segments: &Segments,
    ) -> Result<(), EncoderError> {
        let cfg = &self.config;
        let p = format!("blocks.{layer}");
        let heads = cfg.num_heads as u64;
        let head_dim = cfg.head_dim() as u64;

        let normed = self.norm(runner, &format!("{p}.norm1"), hidden)?;
        let qkv = runner.linear(
            &normed,
            self.weight(&format!("{p}.attn.qkv.weight"))?,
            self.optional(&format!("{p}.attn.qkv.bias")),
            Activation::NONE,
        )?;
        drop(normed);
        let d = cfg.hidden as u64;
        // q and k are adjacent column blocks: one rotary call covers both as 2 * heads heads.
        runner.rotary(
            &qkv.col_range(0, 2 * d)?,
            2 * heads,
            head_dim,
            &rotary.cos,
            &rotary.sin,
        )?;
        let attended = runner.attention(
            &qkv.col_range(0, d)?,
            &qkv.col_range(d, d)?,
            &qkv.col_range(2 * d, d)?,
            heads,
            head_dim,
            segments,
        )?;
        drop(qkv);
        runner.linear_accumulate(
            &attended,
            self.weight(&format!("{p}.attn.proj.weight"))?,
            self.optional(&format!("{p}.attn.proj.bias")),
            hidden,
        )?;
        drop(attended);

        let normed = self.norm(runner, &format!("{p}.norm2"), hidden)?;
        match cfg.family {
            Family::Qwen2Vl => {
                let inner = runner.linear(
                    &normed,
                    self.weight(&format!("{p}.mlp.fc1.weight"))?,
                    self.optional(&format!("{p}.mlp.fc1.bias")),
                    cfg.hidden_act.activation(),
                )?;
                drop(normed);
                runner.linear_accumulate(
                    &inner,
                    self.weight(&format!("{p}.mlp.fc2.weight"))?,
                    self.optional(&format!("{p}.mlp.fc2.bias")),
                    hidden,
                )?;
            }
            Family::Qwen25Vl => {
                let gate = runner.linear(
                    &normed,
                    self.weight(&format!("{p}.mlp.gate_proj.weight"))?,
                    self.optional(&format!("{p}.mlp.gate_proj.bias")),
                    cfg.hidden_act.activation(),
                )?;
                let up = runner.linear(
                    &normed,
                    self.weight(&format!("{p}.mlp.up_proj.weight"))?,
                    self.optional(&format!("{p}.mlp.up_proj.bias")),
                    Activation::NONE,
                )?;
                drop(normed);
                runner.binary_in_place(&gate, &up, BinaryOp::MUL)?;
                drop(up);
                runner.linear_accumulate(
                    &gate,
                    self.weight(&format!("{p}.mlp.down_proj.weight"))?,
                    self.optional(&format!("{p}.mlp.down_proj.bias")),
                    hidden,
                )?;
            }
            Family::Qwen3Vl => {
                let inner = runner.linear(
                    &normed,
                    self.weight(&format!("{p}.mlp.linear_fc1.weight"))?,
                    self.optional(&format!("{p}.mlp.linear_fc1.bias")),
                    cfg.hidden_act.activation(),
                )?;
                drop(normed);
                runner.linear_accumulate(
                    &inner,
                    self.weight(&format!("{p}.mlp.linear_fc2.weight"))?,
                    self.optional(&format!("{p}.mlp.linear_fc2.bias")),
                    hidden,
                )?;
            }
        }
        Ok(())
    }

    /// A patch merger: norm, group `merge²` rows, two linears with GELU between. Qwen3's
    /// deepstack mergers normalise after grouping (`postshuffle`).
    fn merger(
        &self,
        runner: &Runner,
        prefix: &str,
        hidden: &Tensor,
        postshuffle: bool,
    ) -> Result<Tensor, EncoderError> {
        let cfg = &self.config;
        let merge_unit = cfg.merge_unit() as u64;
        let rows = hidden.rows() / merge_unit;
        let wide = hidden.cols() * merge_unit;
        let (norm_name, fc1, fc2) = match cfg.family {
            Family::Qwen3Vl => ("norm", "linear_fc1", "linear_fc2"),
            _ => ("ln_q", "mlp.0", "mlp.2"),
        };
        let grouped = if postshuffle {
            let grouped = hidden.reshape(rows, wide)?;
            self.norm(runner, &format!("{prefix}.{norm_name}"), &grouped)?
        } else {
            self.norm(runner, &format!("{prefix}.{norm_name}"), hidden)?
                .reshape(rows, wide)?
        };
        let inner = runner.linear(
            &grouped,
            self.weight(&format!("{prefix}.{fc1}.weight"))?,
            self.optional(&format!("{prefix}.{fc1}.bias")),
            Activation::GELU_ERF,
        )?;
        drop(grouped);
        runner.linear(
            &inner,
            self.weight(&format!("{prefix}.{fc2}.weight"))?,
            self.optional(&format!("{prefix}.{fc2}.bias")),
            Activation::NONE,
        )
    }

    /// The device shape of a block's MLP weight whose inner width (`intermediate`) is not a
    /// multiple of [`INNER_ALIGN`]: its inner dimension padded with zeros to the next one, so
    /// that every row of the MLP's products starts 16-byte aligned in f16 and bf16 (Hopper's
    /// TMA needs strides of whole 16 bytes; without them cuBLASLt runs its older kernels).
    /// Qwen2.5-VL-3B and 7B's 3420 becomes 3424. Whatever the first product's zero rows and
    /// the activation leave in the padding (finite values) meets zero columns of the second
    /// product, so the outputs are the unpadded ones. `None` for every other weight.
    fn padded_shape(&self, name: &str, (rows, cols): (u64, u64)) -> Option<(u64, u64)> {
        let inner = self.config.intermediate as u64;
        let padded = inner.next_multiple_of(INNER_ALIGN);
        if padded == inner {
            return None;
        }
        let (_, suffix) = name.strip_prefix("blocks.")?.split_once('.')?;
        let (first, second): (&[&str], &str) = match self.config.family {
            Family::Qwen2Vl => (&["mlp.fc1"], "mlp.fc2"),
            Family::Qwen25Vl => (&["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj"),
            Family::Qwen3Vl => (&["mlp.linear_fc1"], "mlp.linear_fc2"),
        };
        match suffix.rsplit_once('.')? {
            (module, "weight") if first.contains(&module) && rows == inner => Some((padded, cols)),
            (module, "bias") if first.contains(&module) && cols == inner => Some((rows, padded)),
            (module, "weight") if module == second && cols == inner => Some((rows, padded)),
            _ => None,
        }
    }

    fn norm(&self, runner: &Runner, prefix: &str, x: &Tensor) -> Result<Tensor, EncoderError> {
        let weight = self.weight(&format!("{prefix}.weight"))?;
        // Norm epsilons are 1e-6 in every Qwen-VL tower; f32 holds them exactly enough.
        #[allow(clippy::cast_possible_truncation)]
        let eps = self.config.layer_norm_eps as f32;
        match self.config.family {
            Family::Qwen25Vl => runner.rms_norm(x, weight, eps),
            _ => runner.layer_norm(x, weight, self.optional(&format!("{prefix}.bias")), eps),
        }
    }

    fn weight(&self, name: &str) -> Result<&Tensor, EncoderError> {
        self.weights
            .get(name)
            .ok_or_else(|| EncoderError::MissingWeight(name.to_owned()))
    }

    fn optional(&self, name: &str) -> Option<&Tensor> {
        self.weights.get(name)
    }
}

/// Elements the MLP's inner width is padded to a multiple of (see
/// [`VisionTower::padded_shape`]): 32 bytes of f16 or bf16, so also Ascend's 16-element cube
/// blocks.
const INNER_ALIGN: u64 = 16;

/// A weight's shape as the `[rows, cols]` matrix it is uploaded as: vectors (norm weights,
/// biases) become single rows so they broadcast; higher ranks (the Conv3d patch embedding)
/// flatten to `[out, in]`.
fn matrix_shape(shape: &[usize]) -> (u64, u64) {
    let first = shape.first().copied().unwrap_or(1) as u64;
    let rest: u64 = shape.iter().skip(1).map(|&d| d as u64).product();
    if shape.len() == 1 {
        (1, first)
    } else {
        (first, rest)
    }
}

/// The row-major `from` matrix of `dtype` elements as a `to` matrix: the block both share
/// copied, the rest zero (padding when `to` is larger, cropping when it is smaller).
fn resize_block(
    bytes: &[u8],
    dtype: DType,
    from: (u64, u64),
    to: (u64, u64),
) -> Result<Vec<u8>, EncoderError> {
    let fit = |v: u64| usize::try_from(v).map_err(|_| shape("weight"));
    let size = fit(dtype_size(dtype))?;
    let ((rows, cols), (new_rows, new_cols)) =
        ((fit(from.0)?, fit(from.1)?), (fit(to.0)?, fit(to.1)?));
    if bytes.len() != rows * cols * size {
        return Err(EncoderError::Shape(format!(
            "{} bytes are not a {rows}x{cols} matrix of {size}-byte elements",
            bytes.len()
        )));
    }
    let mut out = vec![0u8; new_rows * new_cols * size];
    let width = cols.min(new_cols) * size;
    for row in 0..rows.min(new_rows) {
        out[row * new_cols * size..][..width].copy_from_slice(&bytes[row * cols * size..][..width]);
    }
    Ok(out)
}

/// Host bytes the interpolated position tables of recent frame sizes may hold: 17 frame sizes
/// of 448x448 images at Qwen3-VL-8B's width (3.6 MB each), or one of 1792x1792.
const FRAME_CACHE_BYTES: usize = 64 << 20;

/// Qwen3-VL's interpolated position embeddings of the frame sizes used most recently, bounded
/// in bytes: a size seen before costs a step no host work (interpolating one 448x448 frame at
/// width 1152 took 1.5 ms of a Zen 3 core), which matters most to a step of one image. A table
/// larger than the bound is made every time and not kept.
struct FrameCache {
    state: Mutex<FrameCacheState>,
    capacity: usize,
}

struct FrameCacheState {
    tables: LruCache<[u32; 2], Arc<Vec<f32>>>,
    bytes: usize,
}

impl FrameCache {
    fn new(capacity: usize) -> FrameCache {
        FrameCache {
            state: Mutex::new(FrameCacheState {
                tables: LruCache::unbounded(),
                bytes: 0,
            }),
            capacity,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FrameCacheState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table of `frame`, made by `make` (outside the lock) when it is not held.
    fn get_or_insert(&self, frame: [u32; 2], make: impl FnOnce() -> Vec<f32>) -> Arc<Vec<f32>> {
        if let Some(table) = self.lock().tables.get(&frame) {
            return Arc::clone(table);
        }
        let table = Arc::new(make());
        let bytes = |table: &Vec<f32>| table.len() * std::mem::size_of::<f32>();
        if bytes(&table) <= self.capacity {
            let mut state = self.lock();
            if let Some(old) = state.tables.put(frame, Arc::clone(&table)) {
                // Another step made the same table meanwhile.
                state.bytes -= bytes(&old);
            }
            state.bytes += bytes(&table);
            while state.bytes > self.capacity {
                let Some((_, evicted)) = state.tables.pop_lru() else {
                    break;
                };
                state.bytes -= bytes(&evicted);
            }
        }
        table
    }
}

/// A `[index.len(), cols]` tensor of `dtype` whose row `i` is row `index[i]` of the host table
/// `parts` (concatenated, `rows x cols` in all): the table is uploaded and its rows gathered on
/// the device, or uploaded as it is where `index` keeps every row in place (one image). `parts`
/// is empty while planning.
fn gathered(
    runner: &Runner,
    parts: &[&[f32]],
    dtype: DType,
    [rows, cols]: [u64; 2],
    index: &[u32],
) -> Result<Tensor, EncoderError> {
    let table = if runner.is_planning() {
        runner.tensor(dtype, rows, cols)?
    } else {
        runner.upload_f32_parts(parts, dtype, rows, cols)?
    };
    let in_place = index.len() as u64 == rows && index.iter().zip(0u32..).all(|(&i, j)| i == j);
    if in_place {
        return Ok(table);
    }
    runner.gather_rows(&table, &runner.indices(index)?)
}

fn integer_sqrt(value: usize) -> usize {
    let mut root = 0usize;
    while (root + 1) * (root + 1) <= value {
        root += 1;
    }
    root
}

fn shape(what: &str) -> EncoderError {
    EncoderError::Shape(format!("{what} does not fit in memory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_cache_keeps_recent_sizes_within_its_bytes() {
        // Room for 100 f32: tables of 40 values, so two fit and a third evicts the oldest.
        let cache = FrameCache::new(400);
        let made = std::cell::Cell::new(0);
        let table = |value: f32| {
            made.set(made.get() + 1);
            vec![value; 40]
        };
        let first = cache.get_or_insert([2, 2], || table(1.0));
        let again = cache.get_or_insert([2, 2], || table(9.0));
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(made.get(), 1, "a held size is not made again");
        cache.get_or_insert([2, 4], || table(2.0));
        cache.get_or_insert([2, 2], || table(9.0)); // now the most recent
        cache.get_or_insert([4, 4], || table(3.0)); // evicts [2, 4]
        assert_eq!(made.get(), 3);
        let held: Vec<[u32; 2]> = cache.lock().tables.iter().map(|(k, _)| *k).collect();
        assert_eq!(held, vec![[4, 4], [2, 2]]);
        assert_eq!(cache.lock().bytes, 320);
        // A table over the bound is made and returned, not kept.
        let big = cache.get_or_insert([8, 8], || vec![0.0; 200]);
        assert_eq!(big.len(), 200);
        assert_eq!(cache.lock().tables.len(), 2);
        assert_eq!(cache.lock().bytes, 320);
    }
}
