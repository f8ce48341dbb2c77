//! Cost of an allocation and its free through the caching allocator, against the device's raw
//! alloc and free, on the CPU device.
//!
//! `cargo bench -p iris-core --bench allocator -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use iris_core::memory::CachingAllocator;
use iris_plugin::Plugin;

const SIZES: [(&str, u64); 3] = [("4KiB", 4 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)];

fn alloc_free(c: &mut Criterion) {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = Arc::new(
        plugin
            .open(
                0,
                &[
                    ("capacity".into(), "1GiB".into()),
                    ("threads".into(), "1".into()),
                ],
            )
            .expect("the CPU device opens"),
    );
    let allocator = CachingAllocator::new(Arc::clone(&device));
    let mut group = c.benchmark_group("alloc_free");
    for (name, bytes) in SIZES {
        group.bench_with_input(BenchmarkId::new("cached", name), &bytes, |b, &bytes| {
            // The first allocation creates the segment; the measured pairs reuse it.
            drop(allocator.alloc(bytes).expect("alloc"));
            b.iter(|| {
                let buffer = allocator.alloc(black_box(bytes)).expect("alloc");
                drop(black_box(buffer));
            });
        });
        group.bench_with_input(BenchmarkId::new("raw", name), &bytes, |b, &bytes| {
            b.iter(|| {
                let handle = device.alloc(black_box(bytes)).expect("alloc");
                device.free(black_box(handle)).expect("free");
            });
        });
    }
    group.finish();
    let stats = allocator.stats();
    // One small segment (shared by 4 KiB and 1 MiB) and one 16 MiB segment: every measured
    // cached pair reused a block.
    assert_eq!(
        stats.raw_allocs, 2,
        "cached pairs made raw allocations: {stats:?}"
    );
}

criterion_group!(benches, alloc_free);
criterion_main!(benches);
