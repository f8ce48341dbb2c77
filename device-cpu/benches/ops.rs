//! Throughput of the CPU device's heavy ops on 2 threads, through the public ABI: a square f32
//! GEMM (GFLOP/s), the Qwen2-VL tower's GEMM shapes (f32, and bf16 on every kernel tier this
//! CPU runs) and its attention.
//!
//! Throughput is reported in floating-point operations, so criterion's "elem/s" reads as
//! FLOP/s.

use std::hint::black_box;

use abi_stable::std_types::RSlice;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iris_device_cpu::isa::Tier;
use iris_plugin::abi::{AttentionArgs, BufferSlice, GemmArgs};
use iris_plugin::{Activation, DType, Device, MatRef, Plugin};

mod common;
use common::matrix;

const THREADS: usize = 2;

fn device() -> Device {
    device_on(Tier::best())
}

/// The device with its kernel tier forced to `tier`.
fn device_on(tier: Tier) -> Device {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    plugin
        .open(
            0,
            &[
                ("threads".to_owned(), THREADS.to_string()),
                ("capacity".to_owned(), "8GiB".to_owned()),
                // Each call then completes before it returns, so an iteration times the op and
                // not its hand-off to the queue's thread.
                ("queue".to_owned(), "sync".to_owned()),
                ("isa".to_owned(), tier.name().to_owned()),
            ],
        )
        .expect("open the cpu device")
}

/// The tiers with distinct bf16 paths that this CPU runs; the others are named as skipped.
fn bf16_tiers() -> Vec<Tier> {
    [Tier::Amx, Tier::Avx512Bf16, Tier::Avx512, Tier::Avx2]
        .into_iter()
        .filter(|tier| {
            let (used, note) = Tier::resolve(*tier);
            if let Some(note) = &note {
                eprintln!("skipping tier {tier}: {note}");
            }
            used == *tier
        })
        .collect()
}

fn gemm_case(
    c: &mut Criterion,
    dev: &Device,
    name: &str,
    (m, n, k): (u64, u64, u64),
    dtype: DType,
    bias: bool,
) {
    let a = matrix(dev, dtype, m, k);
    let w = matrix(dev, dtype, n, k);
    let bias = if bias {
        matrix(dev, dtype, 1, n)
    } else {
        MatRef::NONE
    };
    let out = matrix(dev, dtype, m, n);
    let args = GemmArgs {
        a,
        w,
        bias,
        out,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: true,
        workspace: BufferSlice::EMPTY,
    };
    let mut group = c.benchmark_group("gemm");
    group.throughput(Throughput::Elements(2 * m * n * k));
    group.sample_size(10);
    group.bench_function(name, |b| {
        b.iter(|| dev.gemm(black_box(&args)).expect("gemm"))
    });
    group.finish();
    for view in [a, w, bias, out] {
        if !view.is_none() {
            dev.free(view.buf).expect("free");
        }
    }
}

/// The `gemm` crate called directly on host vectors, on a pool of the same size: the ceiling
/// the op's overhead is measured against.
fn gemm_crate_baseline(c: &mut Criterion, size: usize) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("pool");
    let lhs: Vec<f32> = (0..size * size).map(|i| (i % 17) as f32 / 17.0).collect();
    let rhs = lhs.clone();
    let mut dst = vec![0.0f32; size * size];
    let stride = isize::try_from(size).expect("fits");
    let mut group = c.benchmark_group("gemm");
    let flops = 2 * (size as u64).pow(3);
    group.throughput(Throughput::Elements(flops));
    group.sample_size(10);
    group.bench_function(format!("gemm crate f32 {size}^3 (baseline)"), |b| {
        b.iter(|| {
            pool.install(|| {
                // SAFETY: three owned `size x size` row-major matrices; dst is distinct.
                unsafe {
                    gemm::gemm(
                        size,
                        size,
                        size,
                        dst.as_mut_ptr(),
                        1,
                        stride,
                        false,
                        lhs.as_ptr(),
                        1,
                        stride,
                        rhs.as_ptr(),
                        1,
                        stride,
                        0.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(THREADS),
                    );
                }
            });
            black_box(&dst);
        })
    });
    group.finish();
}

fn gemm(c: &mut Criterion) {
    gemm_crate_baseline(c, 2048);
    let dev = device();
    gemm_case(
        c,
        &dev,
        "f32 2048x2048x2048",
        (2048, 2048, 2048),
        DType::F32,
        false,
    );
    gemm_case(
        c,
        &dev,
        "f32 qkv m1024 k1280 n3840 +bias",
        (1024, 3840, 1280),
        DType::F32,
        true,
    );
    gemm_case(
        c,
        &dev,
        "f32 fc1 m1024 k1280 n5120 +bias",
        (1024, 5120, 1280),
        DType::F32,
        true,
    );
    drop(dev);
    for tier in bf16_tiers() {
        let dev = device_on(tier);
        for (what, shape) in [
            ("qkv m1024 k1280 n3840", (1024, 3840, 1280)),
            ("fc1 m1024 k1280 n5120", (1024, 5120, 1280)),
            ("fc2 m1024 k5120 n1280", (1024, 1280, 5120)),
        ] {
            let name = format!("bf16 {tier} {what} +bias");
            gemm_case(c, &dev, &name, shape, DType::BF16, true);
        }
    }
}

fn attention_case(c: &mut Criterion, dev: &Device, tokens: u64, dtype: DType) {
    let (heads, head_dim) = (16u64, 80u64);
    let cols = heads * head_dim;
    let qkv = matrix(dev, dtype, tokens, 3 * cols);
    let size = dtype.size().expect("known dtype");
    let part = |i: u64| MatRef {
        offset: i * cols * size,
        cols,
        ..qkv
    };
    let out = matrix(dev, dtype, tokens, cols);
    let cu = [0u32, u32::try_from(tokens).expect("fits")];
    let cu_device = matrix(dev, DType::I32, 1, 2);
    let boundaries: Vec<u8> = cu.iter().flat_map(|c| c.to_le_bytes()).collect();
    dev.write(cu_device.buf, 0, &boundaries).expect("write");
    let mut args = AttentionArgs {
        q: part(0),
        k: part(1),
        v: part(2),
        out,
        heads,
        head_dim,
        // 1/sqrt(80)
        scale: 0.111_803_4,
        cu_seqlens: RSlice::from_slice(&cu),
        cu_seqlens_device: cu_device,
        max_seqlen: tokens,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = dev.attention_workspace(&args).expect("workspace size");
    let ws = dev.alloc(bytes).expect("workspace");
    args.workspace = BufferSlice {
        buf: ws,
        offset: 0,
        bytes,
    };
    let mut group = c.benchmark_group("attention");
    group.throughput(Throughput::Elements(4 * tokens * tokens * cols));
    group.sample_size(10);
    let tier = dev
        .description()
        .property("kernel_tier")
        .map_or_else(String::new, |tier| format!(" {tier}"));
    group.bench_function(format!("{dtype}{tier} {tokens} tokens 16x80"), |b| {
        b.iter(|| dev.attention(black_box(&args)).expect("attention"))
    });
    group.finish();
    for buf in [qkv.buf, out.buf, ws] {
        dev.free(buf).expect("free");
    }
}

fn attention(c: &mut Criterion) {
    let dev = device();
    attention_case(c, &dev, 1024, DType::F32);
    attention_case(c, &dev, 4096, DType::F32);
    drop(dev);
    for tier in bf16_tiers() {
        attention_case(c, &device_on(tier), 1024, DType::BF16);
    }
}

criterion_group!(benches, gemm, attention);
criterion_main!(benches);
