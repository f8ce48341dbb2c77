//! Write throughput of the shared-storage connector's store: one 448x448 image's entry for
//! Qwen2-VL-2B in bf16 (256 tokens x 1536 values, 768 KiB), written atomically (temporary file,
//! rename) to tmpfs (`/dev/shm`) and to the disk that holds the system's temporary folder.
//!
//! `cargo bench -p iris-ec --bench store`. Each iteration writes a new identifier; the store is
//! bounded to 64 entries, so evictions (one unlink each) are part of the steady state, as in a
//! long-running bounded store.
//!
//! Beside them, in the same run, what a request costs the engine: one 448x448 image through the
//! `tiny` tower in bf16 on the built-in CPU device, embeddings back on the host (a fresh image
//! each iteration, so the encoder cache never answers), and the same image's entry packed and
//! written to tmpfs. The ratio of the two is the share of a request's time the store adds.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iris_ec::storage::{EcDtype, EntryShape, SharedStorage, pack_rows};

const TOKENS: u64 = 256;
/// [`TOKENS`] as a row count.
const ROWS: usize = 256;
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
    let rows = pack_rows(&values, &[], ROWS, EcDtype::Bf16).expect("rows");
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
    c.bench_function("pack_rows 448x448 bf16", |b| {
        b.iter(|| pack_rows(&values, &[], ROWS, EcDtype::Bf16).expect("rows"));
    });
}

fn bench_request(c: &mut Criterion) {
    use iris_core::config::Config;
    use iris_core::devices::Registry;
    use iris_core::engine::api::{EncodeOptions, ImageInput};
    use iris_core::engine::{Engine, EngineConfig};
    use iris_core::model::{DUMMY_DEFAULT_SEED, ModelSpec, WeightSource};

    let config = Config::from_toml_str(
        "device = \"cpu\"\n[plugins.cpu]\nthreads = 2\n",
        "store bench",
    )
    .expect("config");
    let builtin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    let device = Registry::new(vec![builtin], config.search_path())
        .open_selected(&config)
        .expect("the CPU device opens");
    let mut engine_config = EngineConfig::new(
        ModelSpec::preset("tiny").expect("tiny"),
        WeightSource::Dummy {
            seed: DUMMY_DEFAULT_SEED,
        },
    );
    engine_config.dtype = iris_plugin::DType::BF16;
    engine_config.scheduler.max_num_batched_tokens = 2048;
    let engine = Engine::start(engine_config, device).expect("the engine starts");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let seed = AtomicU64::new(0);
    let image = |n: u64| {
        let img = image::RgbImage::from_fn(448, 448, |x, y| {
            image::Rgb([
                (x ^ y).to_le_bytes()[0],
                n.to_le_bytes()[0],
                n.to_le_bytes()[1],
            ])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png)
            .expect("png");
        out.into_inner()
    };
    let options = EncodeOptions {
        return_embeddings: true,
        ..EncodeOptions::default()
    };
    let mut group = c.benchmark_group("request 448x448 bf16 tiny");
    group.bench_function("engine encode", |b| {
        b.iter(|| {
            let bytes = image(seed.fetch_add(1, Ordering::Relaxed));
            runtime
                .block_on(engine.encode(vec![ImageInput { bytes }], options))
                .expect("encodes")
        });
    });
    let result = runtime
        .block_on(engine.encode(
            vec![ImageInput {
                bytes: image(u64::MAX),
            }],
            options,
        ))
        .expect("encodes")
        .remove(0);
    let (values, shape) = result.embeddings.expect("embeddings");
    let rows = usize::try_from(shape[0]).expect("rows");
    let entry = EntryShape {
        rows: shape[0],
        width: shape[1],
        dtype: EcDtype::Bf16,
    };
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a folder for the store");
    let store = SharedStorage::open(dir.path(), Some(64 * (entry.data_bytes() + 256)))
        .expect("the store opens");
    let next = AtomicU64::new(0);
    group.bench_function("store: pack and write the entry", |b| {
        b.iter(|| {
            let data = pack_rows(&values, &[], rows, EcDtype::Bf16).expect("rows");
            let id = format!("item-{}", next.fetch_add(1, Ordering::Relaxed));
            store.write(&id, &entry, &data).expect("the write succeeds")
        });
    });
    group.finish();
}

criterion_group!(benches, bench_store, bench_request);
criterion_main!(benches);
