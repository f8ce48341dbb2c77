//! Cost of one device call through a plugin loaded from its library (the ABI shims, panic
//! guards and `RResult` conversions) against a direct Rust call of the same `Backend` method on
//! an `iris_device_cpu::CpuDevice`.
//!
//! `cargo bench -p iris-tests --bench op_call -- --warm-up-time 1 --measurement-time 3`
//!
//! Calls: `mem_info`, a 64-byte host-to-device `write`, and `binary` add on a 1x16 f32 matrix
//! when the CPU device implements it (the bench says so when it does not), all with the CPU
//! device's synchronous queue; then the same `binary` call plus `synchronize` on the
//! synchronous and on the asynchronous queue, the cost of handing work to the queue's thread.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use iris_device_cpu::{CpuDevice, CpuOptions};
use iris_plugin::abi::{BinaryArgs, BufferSlice};
use iris_plugin::{Backend, BinaryOp, DType, Logger, MatRef, OpKind};

const CAPACITY: u64 = 64 << 20;
const COLS: u64 = 16;
const BYTES: u64 = COLS * 4;

fn binary_args(a: iris_plugin::BufferHandle, out: iris_plugin::BufferHandle) -> BinaryArgs {
    BinaryArgs {
        a: MatRef::contiguous(a, 0, DType::F32, 1, COLS),
        b: MatRef::contiguous(a, 0, DType::F32, 1, COLS),
        out: MatRef::contiguous(out, 0, DType::F32, 1, COLS),
        op: BinaryOp::ADD,
        workspace: BufferSlice::EMPTY,
    }
}

fn op_call(c: &mut Criterion) {
    let library = iris_tests::plugin_library("cpu");
    let plugin = iris_plugin::load_library(&library)
        .unwrap_or_else(|err| panic!("loading {}: {err}", library.display()));
    let open = |queue: &str| {
        plugin
            .open(
                0,
                &[
                    ("capacity".into(), CAPACITY.to_string()),
                    ("threads".into(), "1".into()),
                    ("queue".into(), queue.into()),
                ],
            )
            .expect("the CPU plugin opens")
    };
    let loaded = open("sync");
    let capacity = CAPACITY.to_string();
    let options = [
        ("threads", "1"),
        ("capacity", capacity.as_str()),
        ("queue", "sync"),
    ];
    let direct = CpuDevice::open(
        CpuOptions::parse(&options).expect("options parse"),
        Logger::discard(),
    )
    .expect("the CPU device opens");

    let data = [0x5au8; 64];
    let (loaded_a, loaded_out) = (
        loaded.alloc(BYTES).expect("alloc"),
        loaded.alloc(BYTES).expect("alloc"),
    );
    let (direct_a, direct_out) = (
        direct.alloc(BYTES).expect("alloc"),
        direct.alloc(BYTES).expect("alloc"),
    );

    let mut group = c.benchmark_group("mem_info");
    group.bench_function("plugin_library", |b| {
        b.iter(|| black_box(loaded.mem_info().expect("mem_info")));
    });
    group.bench_function("direct", |b| {
        b.iter(|| black_box(Backend::mem_info(&direct).expect("mem_info")));
    });
    group.finish();

    let mut group = c.benchmark_group("write_64B");
    group.bench_function("plugin_library", |b| {
        b.iter(|| loaded.write(loaded_a, 0, black_box(&data)).expect("write"));
    });
    group.bench_function("direct", |b| {
        b.iter(|| Backend::write(&direct, direct_a, 0, black_box(&data)).expect("write"));
    });
    group.finish();

    if loaded.supports(OpKind::BINARY) {
        let mut group = c.benchmark_group("binary_add_1x16_f32");
        let loaded_args = binary_args(loaded_a, loaded_out);
        let direct_args = binary_args(direct_a, direct_out);
        group.bench_function("plugin_library", |b| {
            b.iter(|| loaded.binary(black_box(&loaded_args)).expect("binary"));
        });
        group.bench_function("direct", |b| {
            b.iter(|| Backend::binary(&direct, black_box(&direct_args)).expect("binary"));
        });
        group.finish();
    } else {
        eprintln!(
            "binary_add_1x16_f32: skipped, the CPU device does not implement `binary` in this build"
        );
    }

    if loaded.supports(OpKind::BINARY) {
        let mut group = c.benchmark_group("binary_add_1x16_f32_and_synchronize");
        for (name, device) in [("sync_queue", &loaded), ("async_queue", &open("async"))] {
            let (a, out) = (
                device.alloc(BYTES).expect("alloc"),
                device.alloc(BYTES).expect("alloc"),
            );
            let args = binary_args(a, out);
            group.bench_function(name, |b| {
                b.iter(|| {
                    device.binary(black_box(&args)).expect("binary");
                    device.synchronize().expect("synchronize");
                });
            });
            device.free(a).expect("free");
            device.free(out).expect("free");
        }
        group.finish();
    }

    for buffer in [loaded_a, loaded_out] {
        loaded.free(buffer).expect("free");
    }
    for buffer in [direct_a, direct_out] {
        Backend::free(&direct, buffer).expect("free");
    }
}

criterion_group!(benches, op_call);
criterion_main!(benches);
