//! The Qwen2-VL-2B vision tower's ops at the tower's shapes (one 448x448 image: 1024
//! patches, width 1280, MLP 5120, 16 heads of 80), timed one by one on the CPU device, for a
//! per-op comparison with another library (`tools/bench/ops_vs_torch.py` runs this beside
//! torch). f32 unless `IRIS_BENCH_DTYPE` says `bf16` or `f16`.
//!
//! Prints one JSON object per op: name, shape, median seconds over the repeats (after one
//! untimed call) and GFLOP/s. The tier is the device's default or `IRIS_CPU_ISA`; the thread
//! count `IRIS_BENCH_THREADS` (default 2), the repeats `IRIS_BENCH_REPEATS` (default 5);
//! `IRIS_BENCH_OPS`, a comma-separated list of op names, runs only those (for a profiler).
//!
//! The first line, `fma_peak`, is the roof the others are held against: independent chains of
//! fused multiply-adds at the tier's vector width (AVX-512, AVX2 with FMA, or SSE2 multiplies
//! and adds for `generic`), on the same number of threads, with nothing loaded from memory.
//!
//! Run: `cargo bench -p iris-device-cpu --bench tower_ops`.

use std::time::Instant;

use abi_stable::std_types::RSlice;
use iris_plugin::abi::{AttentionArgs, BufferSlice, GemmArgs};
use iris_plugin::{Activation, DType, Device, MatRef, Plugin};

mod common;
use common::matrix;

const TOKENS: u64 = 1024;
const WIDTH: u64 = 1280;
const MLP: u64 = 5120;
const HEADS: u64 = 16;
const HEAD_DIM: u64 = 80;

fn main() {
    let threads = env_number("IRIS_BENCH_THREADS", 2);
    let repeats = env_number("IRIS_BENCH_REPEATS", 5).max(1);
    let dtype = match std::env::var("IRIS_BENCH_DTYPE").as_deref().map(str::trim) {
        Err(_) | Ok("" | "f32") => DType::F32,
        Ok("bf16") => DType::BF16,
        Ok("f16") => DType::F16,
        Ok(other) => panic!("IRIS_BENCH_DTYPE={other}: expected f32, bf16 or f16"),
    };
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let dev = plugin
        .open(
            0,
            &[
                ("threads".to_owned(), threads.to_string()),
                ("capacity".to_owned(), "8GiB".to_owned()),
                // Each call completes before it returns: the time is the op's.
                ("queue".to_owned(), "sync".to_owned()),
            ],
        )
        .expect("open the cpu device");
    let tier = dev
        .description()
        .property("kernel_tier")
        .unwrap_or("unknown")
        .to_owned();
    let only = std::env::var("IRIS_BENCH_OPS").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|list| list.split(',').any(|op| op.trim() == name))
    };
    if wanted("fma_peak") {
        fma_peak(&tier, threads, repeats);
    }
    let gemms = [
        // name, (m, n, k), activation, accumulate (the residual add)
        ("qkv", (TOKENS, 3 * WIDTH, WIDTH), Activation::NONE, false),
        (
            "proj_residual",
            (TOKENS, WIDTH, WIDTH),
            Activation::NONE,
            true,
        ),
        (
            "fc1_quick_gelu",
            (TOKENS, MLP, WIDTH),
            Activation::QUICK_GELU,
            false,
        ),
        ("fc2_residual", (TOKENS, WIDTH, MLP), Activation::NONE, true),
    ];
    for (name, (m, n, k), activation, accumulate) in gemms {
        if !wanted(name) {
            continue;
        }
        let a = matrix(&dev, dtype, m, k);
        let w = matrix(&dev, dtype, n, k);
        let bias = matrix(&dev, dtype, 1, n);
        let out = matrix(&dev, dtype, m, n);
        let args = GemmArgs {
            a,
            w,
            bias,
            out,
            activation,
            accumulate,
            w_transposed: false,
            w_constant: true,
            workspace: BufferSlice::EMPTY,
        };
        let seconds = median(repeats, || dev.gemm(&args).expect("gemm"));
        report(&tier, name, &format!("{m}x{k}x{n}"), seconds, 2 * m * n * k);
        for view in [a, w, bias, out] {
            dev.free(view.buf).expect("free");
        }
    }
    if wanted("attention") {
        attention(&dev, dtype, &tier, repeats);
    }
}

fn attention(dev: &Device, dtype: DType, tier: &str, repeats: usize) {
    let cols = HEADS * HEAD_DIM;
    let qkv = matrix(dev, dtype, TOKENS, 3 * cols);
    let part = |i: u64| MatRef {
        offset: i * cols * dtype.size().expect("a float dtype"),
        cols,
        ..qkv
    };
    let out = matrix(dev, dtype, TOKENS, cols);
    let cu = [0u32, u32::try_from(TOKENS).expect("fits")];
    let cu_device = matrix(dev, DType::F32, 1, 2);
    let boundaries: Vec<u8> = cu.iter().flat_map(|c| c.to_le_bytes()).collect();
    dev.write(cu_device.buf, 0, &boundaries).expect("write");
    let mut args = AttentionArgs {
        q: part(0),
        k: part(1),
        v: part(2),
        out,
        heads: HEADS,
        head_dim: HEAD_DIM,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        cu_seqlens: RSlice::from_slice(&cu),
        cu_seqlens_device: MatRef {
            dtype: DType::I32,
            ..cu_device
        },
        max_seqlen: TOKENS,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = dev.attention_workspace(&args).expect("workspace size");
    let ws = dev.alloc(bytes).expect("workspace");
    args.workspace = BufferSlice {
        buf: ws,
        offset: 0,
        bytes,
    };
    let seconds = median(repeats, || dev.attention(&args).expect("attention"));
    let shape = format!("{HEADS}x{TOKENS}x{HEAD_DIM}");
    report(
        tier,
        "attention",
        &shape,
        seconds,
        4 * TOKENS * TOKENS * cols,
    );
    for buf in [qkv.buf, out.buf, cu_device.buf, ws] {
        dev.free(buf).expect("free");
    }
}

/// Steps per chain and call of the roof loops.
const PEAK_ITERATIONS: u64 = 50_000_000;

/// Times the tier's roof loop ([`iris_device_cpu::isa::roof`]) on each of `threads` threads at
/// once and reports the rate; on the bf16 tiers, `vdpbf16ps`'s too.
fn fma_peak(tier: &str, threads: usize, repeats: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use iris_device_cpu::isa::roof;
        let on_threads = |kernel: fn(u64) -> f32, flops_per_step: u64, name: &str| {
            let seconds = median(repeats, || {
                std::thread::scope(|scope| {
                    for _ in 0..threads {
                        scope.spawn(|| std::hint::black_box(kernel(PEAK_ITERATIONS)));
                    }
                });
            });
            let flops = PEAK_ITERATIONS * roof::CHAINS as u64 * flops_per_step * threads as u64;
            report(tier, name, &format!("{threads} threads"), seconds, flops);
        };
        let avx512 = is_x86_feature_detected!("avx512f");
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match tier {
            // SAFETY (each closure): the feature was detected just above.
            "avx512" | "avx512bf16" | "amx" if avx512 => {
                on_threads(|n| unsafe { roof::fma_avx512(n) }, 32, "fma_peak");
            }
            "avx2" | "avx512" | "avx512bf16" | "amx" if avx2 => {
                on_threads(|n| unsafe { roof::fma_avx2(n) }, 16, "fma_peak");
            }
            _ => on_threads(|n| unsafe { roof::mul_add_sse2(n) }, 8, "fma_peak"),
        }
        if matches!(tier, "avx512bf16" | "amx") && is_x86_feature_detected!("avx512bf16") {
            on_threads(|n| unsafe { roof::dot_bf16_avx512(n) }, 64, "bf16_dot_peak");
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (tier, threads, repeats);
}

/// The median time of `repeats` calls of `f`, after one untimed call.
fn median(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn report(tier: &str, name: &str, shape: &str, seconds: f64, flops: u64) {
    let gflops = flops as f64 / seconds / 1e9;
    println!(
        "{{\"tier\": \"{tier}\", \"op\": \"{name}\", \"shape\": \"{shape}\", \
         \"seconds\": {seconds:.6}, \"gflops\": {gflops:.1}}}"
    );
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(default)
}
