//! Times the plugin's variable-length attention on one GPU for the head dims and lengths of the
//! vision towers, and prints one JSON object per shape (for `tools/gpu-check.sh`, which compares
//! the figures with PyTorch's scaled-dot-product attention on the same shapes).
//!
//! ```text
//! attention_bench PLUGIN.so [--ordinal N] [--quick]
//! ```
//!
//! Each shape is `segments` packed segments of `tokens` tokens each with 16 heads, bf16: one
//! segment at a range of lengths, and the towers' own launches at their serving step (41
//! Qwen3-VL-8B images of 784 tokens at head dim 72, 8 Qwen2-VL-2B images of 1024 at 80, and
//! 512 Qwen2.5-VL windows of 64 at 80). Each is timed over repeated calls after a warm-up call,
//! with the queue drained before and after, once per tensor-core kernel (`"engine": "kernel"`,
//! `queries` per block: 64, and 128 where that kernel exists, each from a device opened with
//! `attention_engine = "kernel"` and that `attention_queries`) and once through cuDNN's fused
//! attention (`"engine": "cudnn"`, `queries` null, from a device opened with
//! `attention_engine = "cudnn"`; left out, with the reason on stderr, where that device does
//! not open or its check at open kept cuDNN from a head dim); FLOPs count the two matrix
//! products,
//! `4 · segments · tokens² · head_dim · heads`. bf16 at these head dims runs the tensor-core
//! kernels on sm_80 and later; the 64-query lines of one segment carry the TFLOPS
//! docs/PERFORMANCE.md's model expects on an H100 (`expected_h100_tflops`, for 1024 tokens and
//! more; null elsewhere).

// Timing arithmetic: token counts and call counts far below 2^52, so the casts are exact.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]

use std::path::PathBuf;
use std::time::Instant;

use iris_device_cuda::kernels::{FLASH_ATTENTION_Q128_SIZES, FLASH_ATTENTION_QUERIES};
use iris_plugin::abi::{AttentionArgs, BufferHandle, BufferSlice, DType, MatRef};
use iris_plugin::{Device, load_library};

const HEADS: u64 = 16;
const HEAD_DIMS: [u64; 5] = [64, 72, 80, 96, 128];
/// The model's range per head dim (docs/PERFORMANCE.md, "Attention: what to expect on an H100").
const EXPECTED_H100_TFLOPS: [&str; 5] = ["220-300", "220-300", "240-320", "260-340", "280-380"];
/// The shortest segment the expected range applies to.
const EXPECTED_FROM_TOKENS: u64 = 1024;
/// The towers' attention launches at the 8192-token serving step of 448x448 images: segments,
/// tokens per segment, head dim.
const TOWER_SHAPES: [(u64, u64, u64); 3] = [(41, 784, 72), (8, 1024, 80), (512, 64, 80)];

fn main() {
    if let Err(err) = run() {
        eprintln!("attention_bench: {err}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut plugin = None;
    let mut ordinal = 0u32;
    let mut quick = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ordinal" => {
                let value = args.next().ok_or("--ordinal needs a value")?;
                ordinal = value
                    .parse()
                    .map_err(|_| format!("bad ordinal `{value}`"))?;
            }
            "--quick" => quick = true,
            path if plugin.is_none() => plugin = Some(PathBuf::from(path)),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let plugin = plugin.ok_or("usage: attention_bench PLUGIN.so [--ordinal N] [--quick]")?;
    let plugin = load_library(&plugin).map_err(|err| err.to_string())?;
    let mut devices = FLASH_ATTENTION_QUERIES
        .iter()
        .map(|queries| {
            let options = [
                ("attention_queries".to_owned(), queries.to_string()),
                ("attention_engine".to_owned(), "kernel".to_owned()),
            ];
            let device = plugin
                .open(ordinal, &options)
                .map_err(|err| err.to_string())?;
            Ok((Some(*queries), device))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let cudnn_options = [("attention_engine".to_owned(), "cudnn".to_owned())];
    match plugin.open(ordinal, &cudnn_options) {
        Ok(device) => {
            let note = device
                .description()
                .property("attention_engine")
                .unwrap_or_default()
                .to_owned();
            eprintln!("attention_bench: cuDNN: {note}");
            devices.push((None, device));
        }
        Err(err) => eprintln!("attention_bench: no cuDNN lines: {err}"),
    }
    let lengths: &[u64] = if quick {
        &[1024, 4096]
    } else {
        &[256, 1024, 4096, 16384]
    };
    let mut shapes = Vec::new();
    for (&head_dim, expected) in HEAD_DIMS.iter().zip(EXPECTED_H100_TFLOPS) {
        for &tokens in lengths {
            shapes.push((1, tokens, head_dim, Some(expected)));
        }
    }
    shapes.extend(
        TOWER_SHAPES.map(|(segments, tokens, head_dim)| (segments, tokens, head_dim, None)),
    );
    for (segments, tokens, head_dim, expected) in shapes {
        for (queries, device) in &devices {
            if queries.is_some_and(|queries| queries > FLASH_ATTENTION_QUERIES[0])
                && !FLASH_ATTENTION_Q128_SIZES.contains(&head_dim)
            {
                continue;
            }
            if queries.is_none() && !cudnn_serves(device, head_dim) {
                continue;
            }
            let seconds = time(device, segments, tokens, head_dim)?;
            let flops = 4.0 * (segments * tokens * tokens * head_dim * HEADS) as f64;
            let expected = match expected {
                Some(range) if tokens >= EXPECTED_FROM_TOKENS && *queries == Some(64) => {
                    format!("\"{range}\"")
                }
                _ => "null".to_owned(),
            };
            let (engine, queries) = match queries {
                Some(queries) => ("kernel", queries.to_string()),
                None => ("cudnn", "null".to_owned()),
            };
            println!(
                "{{\"dtype\": \"bf16\", \"heads\": {HEADS}, \"head_dim\": {head_dim}, \
                 \"segments\": {segments}, \"tokens\": {tokens}, \"engine\": \"{engine}\", \
                 \"queries\": {queries}, \"ms\": {:.4}, \"tflops\": {:.2}, \
                 \"expected_h100_tflops\": {expected}}}",
                seconds * 1e3,
                flops / seconds / 1e12
            );
        }
    }
    Ok(())
}

/// Whether `device`'s check at open let cuDNN serve bf16 at `head_dim` (its
/// `attention_engine` property lists the pairs: `cudnn 9.x.y for bf16 64, f16 64, ...`).
fn cudnn_serves(device: &Device, head_dim: u64) -> bool {
    let description = device.description();
    let note = description.property("attention_engine").unwrap_or_default();
    let served = note
        .strip_prefix("cudnn ")
        .and_then(|rest| rest.split_once(" for "))
        .map(|(_, pairs)| pairs.split(" (").next().unwrap_or_default());
    served.is_some_and(|pairs| {
        pairs
            .split(", ")
            .any(|pair| pair == format!("bf16 {head_dim}"))
    })
}

/// Median seconds of one attention call over `segments` packed segments of `tokens` tokens.
fn time(device: &Device, segments: u64, tokens: u64, head_dim: u64) -> Result<f64, String> {
    let err = |e: iris_plugin::DeviceError| e.to_string();
    let width = HEADS * head_dim;
    let rows = segments * tokens;
    let bytes = rows * width * 2;
    let buffers: Vec<BufferHandle> = (0..4)
        .map(|_| device.alloc(bytes))
        .collect::<Result<_, _>>()
        .map_err(err)?;
    // Small values keep the softmax away from overflow; the timing does not depend on them.
    let fill: Vec<u8> = (0..bytes / 2)
        .flat_map(|i| half::bf16::from_f32(((i % 17) as f32 - 8.0) / 64.0).to_le_bytes())
        .collect();
    for buf in &buffers[..3] {
        device.write(*buf, 0, &fill).map_err(err)?;
    }
    let cu: Vec<u32> = (0..=segments)
        .map(|s| u32::try_from(s * tokens).map_err(|_| "too many tokens"))
        .collect::<Result<_, _>>()?;
    let cu_bytes: Vec<u8> = cu.iter().flat_map(|v| v.to_le_bytes()).collect();
    let cu_device = device.alloc(cu_bytes.len() as u64).map_err(err)?;
    device.write(cu_device, 0, &cu_bytes).map_err(err)?;
    let mat = |buf| MatRef::contiguous(buf, 0, DType::BF16, rows, width);
    let mut args = AttentionArgs {
        q: mat(buffers[0]),
        k: mat(buffers[1]),
        v: mat(buffers[2]),
        out: mat(buffers[3]),
        heads: HEADS,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
        cu_seqlens: cu.as_slice().into(),
        cu_seqlens_device: MatRef::vector(cu_device, 0, DType::I32, cu.len() as u64),
        max_seqlen: tokens,
        workspace: BufferSlice::EMPTY,
    };
    // cuDNN's plans may need a workspace; the plugin's kernels need none.
    let workspace_bytes = device.attention_workspace(&args).map_err(err)?;
    let workspace = if workspace_bytes > 0 {
        let buf = device.alloc(workspace_bytes).map_err(err)?;
        args.workspace = BufferSlice {
            buf,
            offset: 0,
            bytes: workspace_bytes,
        };
        Some(buf)
    } else {
        None
    };
    device.attention(&args).map_err(err)?;
    device.synchronize().map_err(err)?;
    // About 50 ms of work per sample, at least 3 calls.
    let first = {
        let start = Instant::now();
        device.attention(&args).map_err(err)?;
        device.synchronize().map_err(err)?;
        start.elapsed().as_secs_f64()
    };
    let calls = ((0.05 / first.max(1e-6)) as usize).clamp(3, 200);
    let mut samples = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..calls {
            device.attention(&args).map_err(err)?;
        }
        device.synchronize().map_err(err)?;
        samples.push(start.elapsed().as_secs_f64() / calls as f64);
    }
    samples.sort_by(f64::total_cmp);
    for buf in buffers.into_iter().chain([cu_device]).chain(workspace) {
        device.free(buf).map_err(err)?;
    }
    Ok(samples[samples.len() / 2])
}
