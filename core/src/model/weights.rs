//! The tensors a tower needs ([`TensorSpec`]), host-side weights ([`HostWeights`]) and loading
//! them from safetensors files.
//!
//! Loading reads each file's header (8-byte length, JSON) and then, with plain reads at the
//! recorded offsets, only the bytes of the vision tensors: a full Qwen2.5-VL-72B checkpoint costs
//! the ~1.4 GB (bf16) of its tower, not 140 GB. With a `model.safetensors.index.json`, shards that
//! hold no vision tensor are never opened. No memory map is used, so a file changed while
//! loading gives an error or wrong values, never undefined behaviour.
//!
//! Names: checkpoints store the tower under `visual.` (Qwen2/2.5-VL releases), `model.visual.`
//! (transformers >= 4.52 exports, Qwen3-VL) or no prefix (a tower saved on its own). The prefix
//! is detected from where `patch_embed.proj.weight` is found. Tensors under that prefix that the
//! tower does not use (for example a saved `rotary_pos_emb.inv_freq` buffer) are skipped with a
//! debug log rather than refused, because such buffers appear in real exports and never change
//! a tower's output.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use iris_plugin::DType;
use safetensors::tensor::{Dtype as StDtype, Metadata, TensorInfo};
use serde_json::Value;

use super::ModelError;
use super::config::{Family, VisionConfig};

/// The prefixes under which checkpoints store the vision tower, in detection order.
pub const VISION_PREFIXES: [&str; 3] = ["model.visual.", "visual.", ""];

/// The tensor every tower has; its location decides the prefix.
const ANCHOR: &str = "patch_embed.proj.weight";

/// safetensors' own limit on the JSON header (100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// What a tensor is, which decides its dummy initialisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A linear or convolution weight; `fan_in` inputs per output.
    Matrix {
        /// Inputs feeding each output (in_features, or C*T*P*P for the patch convolution).
        fan_in: usize,
    },
    /// A linear or convolution bias.
    Bias {
        /// Inputs feeding each output of the layer the bias belongs to.
        fan_in: usize,
    },
    /// A LayerNorm / RMSNorm scale (initialised near 1).
    NormWeight,
    /// A LayerNorm shift.
    NormBias,
    /// A learned embedding table (Qwen3-VL's position embeddings).
    Embedding,
}

/// One tensor a tower reads: its Hugging Face name without prefix and its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name without the checkpoint prefix, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    /// Shape, outermost first, as PyTorch stores it (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// What the tensor is.
    pub kind: TensorKind,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl VisionConfig {
    /// Every tensor this tower reads, in a fixed order (patch embedding, position embedding,
    /// blocks, merger, deepstack mergers). Shapes follow transformers' modules.
    ///
    /// Call [`VisionConfig::validate`] first: an invalid config yields meaningless shapes.
    pub fn weight_specs(&self) -> Vec<TensorSpec> {
        let (e, m, o) = (self.hidden, self.intermediate, self.out_hidden);
        let u = self.merged_hidden();
        let row = self.patch_row_len();
        let mut specs = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, kind: TensorKind| {
            specs.push(TensorSpec { name, shape, kind });
        };
        let linear = |push: &mut dyn FnMut(String, Vec<usize>, TensorKind),
                      name: &str,
                      out: usize,
                      inp: usize,
                      bias: bool| {
            push(
                format!("{name}.weight"),
                vec![out, inp],
                TensorKind::Matrix { fan_in: inp },
            );
            if bias {
                push(
                    format!("{name}.bias"),
                    vec![out],
                    TensorKind::Bias { fan_in: inp },
                );
            }
        };
        let norm = |push: &mut dyn FnMut(String, Vec<usize>, TensorKind),
                    name: &str,
                    width: usize,
                    with_bias: bool| {
            push(
                format!("{name}.weight"),
                vec![width],
                TensorKind::NormWeight,
            );
            if with_bias {
                push(format!("{name}.bias"), vec![width], TensorKind::NormBias);
            }
        };
        // Qwen2.5-VL's norms are RMSNorm (scale only); the others LayerNorm.
        let layer_norm = self.family != Family::Qwen25Vl;

        push(
            "patch_embed.proj.weight".into(),
            vec![
                e,
                self.in_channels,
                self.temporal_patch_size,
                self.patch_size,
                self.patch_size,
            ],
            TensorKind::Matrix { fan_in: row },
        );
        if self.family == Family::Qwen3Vl {
            push(
                "patch_embed.proj.bias".into(),
                vec![e],
                TensorKind::Bias { fan_in: row },
            );
            if let Some(n) = self.num_position_embeddings {
                push("pos_embed.weight".into(), vec![n, e], TensorKind::Embedding);
            }
        }
        for i in 0..self.depth {
            let b = format!("blocks.{i}");
            norm(&mut push, &format!("{b}.norm1"), e, layer_norm);
            norm(&mut push, &format!("{b}.norm2"), e, layer_norm);
            linear(&mut push, &format!("{b}.attn.qkv"), 3 * e, e, true);
            linear(&mut push, &format!("{b}.attn.proj"), e, e, true);
            match self.family {
                Family::Qwen2Vl => {
                    linear(&mut push, &format!("{b}.mlp.fc1"), m, e, true);
                    linear(&mut push, &format!("{b}.mlp.fc2"), e, m, true);
                }
                Family::Qwen25Vl => {
                    linear(&mut push, &format!("{b}.mlp.gate_proj"), m, e, true);
                    linear(&mut push, &format!("{b}.mlp.up_proj"), m, e, true);
                    linear(&mut push, &format!("{b}.mlp.down_proj"), e, m, true);
                }
                Family::Qwen3Vl => {
                    linear(&mut push, &format!("{b}.mlp.linear_fc1"), m, e, true);
                    linear(&mut push, &format!("{b}.mlp.linear_fc2"), e, m, true);
                }
            }
        }
        match self.family {
            Family::Qwen2Vl | Family::Qwen25Vl => {
                norm(&mut push, "merger.ln_q", e, layer_norm);
                linear(&mut push, "merger.mlp.0", u, u, true);
                linear(&mut push, "merger.mlp.2", o, u, true);
            }
            Family::Qwen3Vl => {
                norm(&mut push, "merger.norm", e, true);
                linear(&mut push, "merger.linear_fc1", u, u, true);
                linear(&mut push, "merger.linear_fc2", o, u, true);
                // Deepstack mergers normalise after the spatial shuffle: their norm is u wide.
                for j in 0..self.deepstack_visual_indexes.len() {
                    let d = format!("deepstack_merger_list.{j}");
                    norm(&mut push, &format!("{d}.norm"), u, true);
                    linear(&mut push, &format!("{d}.linear_fc1"), u, u, true);
                    linear(&mut push, &format!("{d}.linear_fc2"), o, u, true);
                }
            }
        }
        specs
    }

    /// Bytes of all weights in `dtype` (what a tower uploads).
    pub fn weight_bytes(&self, dtype: DType) -> Result<u64, ModelError> {
        let size = dtype.size().ok_or(ModelError::UnsupportedDtype { dtype })?;
        self.weight_specs()
            .iter()
            .try_fold(0u64, |acc, s| {
                let n = s
                    .shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(u64::try_from(d).ok()?))?;
                acc.checked_add(n.checked_mul(size)?)
            })
            .ok_or_else(|| ModelError::SizeOverflow {
                what: "the tower's weights".into(),
            })
    }
}

/// One tensor on the host, in the run dtype, ready to upload.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Element type of `bytes`.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Elements in row-major order, little-endian.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values widened to f32 (exact for every dtype).
    pub fn to_f32(&self) -> Vec<f32> {
        decode_to_f32(&self.bytes, self.dtype)
    }
}

/// All weights of one tower on the host, by name without prefix.
#[derive(Clone, Debug, PartialEq)]
pub struct HostWeights {
    dtype: DType,
    tensors: BTreeMap<String, HostTensor>,
    total_bytes: u64,
    origin: String,
}

impl HostWeights {
    /// Wraps tensors already in `dtype`.
    pub fn new(
        dtype: DType,
        tensors: BTreeMap<String, HostTensor>,
        origin: impl Into<String>,
    ) -> HostWeights {
        let total_bytes = tensors.values().map(|t| t.bytes.len() as u64).sum();
        HostWeights {
            dtype,
            tensors,
            total_bytes,
            origin: origin.into(),
        }
    }

    /// The run dtype every tensor is in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sum of all tensors' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Where the weights came from, for logs (`dummy (seed 0)`, `safetensors (prefix visual.)`).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensor of that name (without prefix).
    pub fn get(&self, name: &str) -> Result<&HostTensor, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::TensorNotLoaded {
                name: name.to_string(),
            })
    }

    /// The tensor of that name, checked to have `dtype` and `shape`: what a tower calls before
    /// uploading, so a wrong graph fails with both shapes named instead of reading garbage.
    pub fn expect(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<&HostTensor, ModelError> {
        let t = self.get(name)?;
        if t.dtype != dtype || t.shape != shape {
            return Err(ModelError::TensorMismatch {
                name: name.to_string(),
                expected_dtype: dtype,
                expected_shape: shape.to_vec(),
                found_dtype: t.dtype,
                found_shape: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// Removes and returns a tensor (to free host memory once uploaded).
    pub fn take(&mut self, name: &str) -> Result<HostTensor, ModelError> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::TensorNotLoaded {
                name: name.to_string(),
            })?;
        self.total_bytes -= t.bytes.len() as u64;
        Ok(t)
    }

    /// Tensors by name, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HostTensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }
}

/// Where a tower's weights come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// Deterministic pseudo-random values (see [`super::dummy_weights`]).
    Dummy {
        /// Seed mixed with each tensor's name.
        seed: u64,
    },
    /// Safetensors: files, directories (their index, else all `*.safetensors` in them) or
    /// `*.index.json` files.
    Safetensors(Vec<PathBuf>),
}

impl WeightSource {
    /// Produces the weights `config` needs, in `dtype`.
    pub fn load(&self, config: &VisionConfig, dtype: DType) -> Result<HostWeights, ModelError> {
        self.load_with_progress(config, dtype, &mut |_| {})
    }

    /// [`WeightSource::load`], calling `loaded_bytes` with the bytes (in `dtype`) produced so
    /// far after each tensor; [`VisionConfig::weight_bytes`] is the total.
    pub fn load_with_progress(
        &self,
        config: &VisionConfig,
        dtype: DType,
        loaded_bytes: &mut dyn FnMut(u64),
    ) -> Result<HostWeights, ModelError> {
        match self {
            WeightSource::Dummy { seed } => {
                super::dummy::dummy_weights_with_progress(config, dtype, *seed, loaded_bytes)
            }
            WeightSource::Safetensors(paths) => {
                read_safetensors(paths, config, dtype, loaded_bytes)
            }
        }
    }
}

/// Loads the vision tower described by `config` from safetensors `paths`, converted to `dtype`.
///
/// Each path is a `.safetensors` file, a `*.index.json` file, or a directory (its
/// `model.safetensors.index.json` if present, else every `*.safetensors` in it). Errors name the
/// file, the tensor, the expected and the found shape.
pub fn load_safetensors(
    paths: &[PathBuf],
    config: &VisionConfig,
    dtype: DType,
) -> Result<HostWeights, ModelError> {
    read_safetensors(paths, config, dtype, &mut |_| {})
}

/// [`load_safetensors`] with a progress callback (bytes converted so far).
fn read_safetensors(
    paths: &[PathBuf],
    config: &VisionConfig,
    dtype: DType,
    loaded_bytes: &mut dyn FnMut(u64),
) -> Result<HostWeights, ModelError> {
    if dtype.size().is_none() {
        return Err(ModelError::UnsupportedDtype { dtype });
    }
    config.validate()?;
    let mut catalog = Catalog::default();
    for path in paths {
        catalog.add_path(path)?;
    }
    let prefix = catalog.detect_prefix()?;
    let specs = config.weight_specs();

    let missing: Vec<&TensorSpec> = specs
        .iter()
        .filter(|s| !catalog.names.contains_key(&format!("{prefix}{}", s.name)))
        .collect();
    if let Some(first) = missing.first() {
        return Err(ModelError::MissingTensor {
            name: format!("{prefix}{}", first.name),
            expected: first.shape.clone(),
            more: missing.len() - 1,
        });
    }

    // Headers of index shards are read only now, and only for shards holding needed tensors.
    let mut tensors = BTreeMap::new();
    let mut files: HashMap<PathBuf, OpenFile> = HashMap::new();
    let mut done = 0u64;
    for spec in &specs {
        let full = format!("{prefix}{}", spec.name);
        let file_path = catalog.file_of(&full)?;
        let header = &catalog.headers[&file_path];
        let info = header
            .meta
            .info(&full)
            .ok_or_else(|| ModelError::BadSafetensors {
                path: file_path.clone(),
                reason: format!("header lost tensor `{full}`"),
            })?;
        if info.shape != spec.shape {
            return Err(ModelError::ShapeMismatch {
                name: full,
                expected: spec.shape.clone(),
                found: info.shape.clone(),
            });
        }
        let from = disk_dtype(info.dtype).ok_or_else(|| ModelError::UnsupportedTensorDtype {
            name: full.clone(),
            path: file_path.clone(),
            dtype: format!("{:?}", info.dtype),
        })?;
        let data_start = header.data_start;
        let info = info.clone();
        let file = match files.entry(file_path.clone()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(OpenFile {
                file: File::open(&file_path).map_err(|source| ModelError::Io {
                    path: file_path.clone(),
                    source,
                })?,
            }),
        };
        let raw = file.read_range(&file_path, data_start, &info)?;
        let non_finite =
            |count: usize, first: usize, reason: String| ModelError::NonFiniteWeights {
                name: full.clone(),
                path: file_path.clone(),
                count,
                numel: spec.numel(),
                first,
                reason,
            };
        if let Some((count, first)) = count_non_finite(&raw, from) {
            return Err(non_finite(
                count,
                first,
                "are NaN or infinite in the file".to_owned(),
            ));
        }
        // Widening to f32 is exact; any other conversion (f32 or bf16 to f16, f32 to bf16)
        // may round a large finite value to infinity.
        let may_overflow = from != dtype && dtype != DType::F32;
        let bytes = convert(raw, from, dtype);
        if may_overflow && let Some((count, first)) = count_non_finite(&bytes, dtype) {
            return Err(non_finite(
                count,
                first,
                format!(
                    "are beyond the range of {dtype} (stored as {from}); load the model in a wider dtype"
                ),
            ));
        }
        done += bytes.len() as u64;
        loaded_bytes(done);
        tensors.insert(
            spec.name.clone(),
            HostTensor {
                dtype,
                shape: spec.shape.clone(),
                bytes,
            },
        );
    }

    if !prefix.is_empty() {
        let unused: Vec<&String> = catalog
            .names
            .keys()
            .filter(|n| {
                n.strip_prefix(prefix.as_str())
                    .is_some_and(|rest| !tensors.contains_key(rest))
            })
            .collect();
        if !unused.is_empty() {
            tracing::debug!(
                count = unused.len(),
                first = %unused[0],
                "skipping vision tensors the tower does not use"
            );
        }
    }
    let prefix_note = if prefix.is_empty() {
        "no prefix".to_string()
    } else {
        format!("prefix {prefix}")
    };
    Ok(HostWeights::new(
        dtype,
        tensors,
        format!(
            "safetensors ({prefix_note}, tensors from {} files)",
            files.len()
        ),
    ))
}

/// Where a tensor name was found.
enum Origin {
    /// In the header of this file (already read).
    File(PathBuf),
    /// In an index's weight map; the shard's header is read when needed.
    Shard { shard: PathBuf, index: PathBuf },
}

struct Header {
    meta: Metadata,
    /// Offset of the data section (8 + header length).
    data_start: u64,
}

#[derive(Default)]
struct Catalog {
    /// Headers read so far, by file.
    headers: HashMap<PathBuf, Header>,
    names: HashMap<String, Origin>,
}

impl Catalog {
    /// The file holding `full`, its header read and checked to contain it. `full` must be a
    /// catalogued name (the caller checks every needed name first).
    fn file_of(&mut self, full: &str) -> Result<PathBuf, ModelError> {
        let origin = self
            .names
            .get(full)
            .ok_or_else(|| ModelError::MissingTensor {
                name: full.to_string(),
                expected: Vec::new(),
                more: 0,
            })?;
        match origin {
            Origin::File(path) => Ok(path.clone()),
            Origin::Shard { shard, index } => {
                let (shard, index) = (shard.clone(), index.clone());
                if !self.headers.contains_key(&shard) {
                    let header = read_header(&shard)?;
                    self.headers.insert(shard.clone(), header);
                }
                if self.headers[&shard].meta.info(full).is_none() {
                    return Err(ModelError::BadIndex {
                        path: index,
                        reason: format!(
                            "it places `{full}` in {}, which does not contain it",
                            shard.display()
                        ),
                    });
                }
                Ok(shard)
            }
        }
    }

    fn add_path(&mut self, path: &Path) -> Result<(), ModelError> {
        if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if index.is_file() {
                return self.add_index(&index);
            }
            let entries = std::fs::read_dir(path).map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            let mut found = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|source| ModelError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
                    found.push(p);
                }
            }
            if found.is_empty() {
                return Err(ModelError::NoWeightFiles {
                    path: path.to_path_buf(),
                });
            }
            found.sort();
            for p in found {
                self.add_file(&p)?;
            }
            Ok(())
        } else if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".json"))
        {
            self.add_index(path)
        } else {
            self.add_file(path)
        }
    }

    fn add_file(&mut self, path: &Path) -> Result<(), ModelError> {
        if self.headers.contains_key(path) {
            return Ok(());
        }
        let header = read_header(path)?;
        for name in header.meta.tensors().into_keys() {
            self.insert_name(name, Origin::File(path.to_path_buf()), path)?;
        }
        self.headers.insert(path.to_path_buf(), header);
        Ok(())
    }

    fn add_index(&mut self, index: &Path) -> Result<(), ModelError> {
        let text = std::fs::read(index).map_err(|source| ModelError::Io {
            path: index.to_path_buf(),
            source,
        })?;
        let bad = |reason: String| ModelError::BadIndex {
            path: index.to_path_buf(),
            reason,
        };
        let value: Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let dir = index.parent().unwrap_or_else(|| Path::new("."));
        for (name, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| bad(format!("`weight_map.{name}` is not a file name")))?;
            // Shard names are plain file names next to the index; refuse paths that leave it.
            if shard.contains('/') || shard.contains('\\') || shard == ".." || shard.is_empty() {
                return Err(bad(format!(
                    "`weight_map.{name}` = `{shard}` is not a file name in the index's directory"
                )));
            }
            self.insert_name(
                name.clone(),
                Origin::Shard {
                    shard: dir.join(shard),
                    index: index.to_path_buf(),
                },
                index,
            )?;
        }
        Ok(())
    }

    fn insert_name(&mut self, name: String, origin: Origin, from: &Path) -> Result<(), ModelError> {
        if let Some(prev) = self.names.get(&name) {
            let first = match prev {
                Origin::File(path) => path.clone(),
                Origin::Shard { index, .. } => index.clone(),
            };
            return Err(ModelError::DuplicateTensor {
                name,
                first,
                second: from.to_path_buf(),
            });
        }
        self.names.insert(name, origin);
        Ok(())
    }

    fn detect_prefix(&self) -> Result<String, ModelError> {
        let found: Vec<&str> = VISION_PREFIXES
            .iter()
            .copied()
            .filter(|p| self.names.contains_key(&format!("{p}{ANCHOR}")))
            .collect();
        match found.as_slice() {
            [one] => Ok((*one).to_string()),
            [] => Err(ModelError::MissingTensor {
                name: format!("{ANCHOR} (under {})", prefix_list(&VISION_PREFIXES)),
                expected: Vec::new(),
                more: 0,
            }),
            many => Err(ModelError::AmbiguousPrefix {
                prefixes: prefix_list(many),
            }),
        }
    }
}

fn prefix_list(prefixes: &[&str]) -> String {
    prefixes
        .iter()
        .map(|p| {
            if p.is_empty() {
                "no prefix".to_string()
            } else {
                format!("`{p}`")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

struct OpenFile {
    file: File,
}

impl OpenFile {
    fn read_range(
        &mut self,
        path: &Path,
        data_start: u64,
        info: &TensorInfo,
    ) -> Result<Vec<u8>, ModelError> {
        let (start, end) = info.data_offsets;
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        self.file
            .seek(SeekFrom::Start(data_start + start as u64))
            .map_err(io)?;
        let mut buf = vec![0u8; end - start];
        self.file.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }
}

/// Reads and validates a safetensors header without reading any tensor data.
fn read_header(path: &Path) -> Result<Header, ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bad = |reason: String| ModelError::BadSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| bad(format!("{file_len} bytes is too short for a header")))?;
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES || n > file_len.saturating_sub(8) {
        return Err(bad(format!(
            "header length {n} exceeds the file ({file_len} bytes) or the 100 MB limit"
        )));
    }
    let mut header = vec![0u8; usize::try_from(n).map_err(|_| bad("header too large".into()))?];
    file.read_exact(&mut header).map_err(io)?;
    // Metadata's deserialisation validates that offsets are contiguous and match each shape.
    let meta: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = 8 + n;
    let expected = data_start + meta.data_len() as u64;
    if expected != file_len {
        return Err(bad(format!(
            "header describes {expected} bytes, the file has {file_len}"
        )));
    }
    Ok(Header { meta, data_start })
}

/// The on-disk dtypes the loader converts.
fn disk_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// How many little-endian elements of `bytes` (F32, F16 or BF16) are NaN or infinite, and the
/// index of the first; `None` when all are finite. A bit test (exponent all ones), so one pass
/// at memory speed over a checkpoint.
fn count_non_finite(bytes: &[u8], dtype: DType) -> Option<(usize, usize)> {
    let bad: fn(&[u8]) -> bool = match dtype {
        DType::F16 => |c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00,
        DType::BF16 => |c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80,
        DType::F32 => |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 == 0x7f80_0000,
        _ => return None,
    };
    let width = usize::try_from(dtype.size()?).ok()?;
    let count = bytes.chunks_exact(width).filter(|c| bad(c)).count();
    if count == 0 {
        return None;
    }
    let first = bytes.chunks_exact(width).position(bad)?;
    Some((count, first))
}

/// Converts little-endian elements from one dtype to another (round to nearest even when
/// narrowing, exact when widening).
pub(crate) fn convert(raw: Vec<u8>, from: DType, to: DType) -> Vec<u8> {
    if from == to {
        return raw;
    }
    let values = decode_to_f32(&raw, from);
    encode_f32(&values, to)
}

pub(crate) fn decode_to_f32(raw: &[u8], from: DType) -> Vec<f32> {
    match from {
        DType::F16 => raw
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => raw
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        // F32, and the only other dtypes reaching here are rejected before loading.
        _ => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

pub(crate) fn encode_f32(values: &[f32], to: DType) -> Vec<u8> {
    match to {
        DType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}
