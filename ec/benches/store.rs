//! Write throughput of the shared-storage connector's store: one 448x448 image's entry for
//! Qwen2-VL-2B in bf16 (256 tokens x 1536 values, 768 KiB), written atomically (temporary file,
//! rename) to tmpfs (`/dev/shm`) and to the disk that holds the system's temporary folder.
//!
//! `cargo bench -p iris-ec --bench store`. Each iteration writes a new identifier; the store is
//! bounded to 64 entries, so evictions (one unlink each) are part of the steady state, as in a
//! long-running bounded store.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iris_ec::storage::{EcDtype, EntryShape, SharedStorage, pack_rows};

const TOKENS: u64 = 256;
const WIDTH: u64 = 1536;

fn bench_store(c: &mut Criterion) {
    let shape = EntryShape {
        rows: TOKENS,
        width: WIDTH,
        dtype: EcDtype::Bf16,
    };
    let values: Vec<f32> = (0..TOKENS * WIDTH)
        .map(|i| (i % 977) as f32 * 0.01)
        .collect();
    let rows = pack_rows(&values, &[], TOKENS as usize, EcDtype::Bf16).expect("rows");
    let mut group = c.benchmark_group("ec_store_write");
    group.throughput(Throughput::Bytes(shape.data_bytes()));
    let shm = Path::new("/dev/shm");
    let places = [
        ("tmpfs", shm.is_dir().then_some(shm.to_path_buf())),
        ("disk", Some(std::env::temp_dir())),
    ];
    for (name, parent) in places {
        let Some(parent) = parent else {
            eprintln!("skipped {name}: /dev/shm is not here");
            continue;
        };
        let dir = tempfile::tempdir_in(&parent).expect("a folder for the store");
        let store = SharedStorage::open(dir.path(), Some(64 * (shape.data_bytes() + 256)))
            .expect("the store opens");
        let next = AtomicU64::new(0);
        group.bench_function(format!("448x448 bf16 entry, {name}"), |b| {
            b.iter(|| {
                let id = format!("item-{}", next.fetch_add(1, Ordering::Relaxed));
                store.write(&id, &shape, &rows).expect("the write succeeds")
            });
        });
    }
    group.finish();
    let packing = TOKENS as usize;
    c.bench_function("pack_rows 448x448 bf16", |b| {
        b.iter(|| pack_rows(&values, &[], packing, EcDtype::Bf16).expect("rows"));
    });
}

criterion_group!(benches, bench_store);
criterion_main!(benches);
