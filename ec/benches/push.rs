//! The push connector's cost per item, beside the shared-storage connector's, in one run: one
//! 448x448 image's rows for Qwen2-VL-2B in bf16 (256 tokens x 1536 values, 768 KiB), as the
//! store bench writes them.
//!
//! `cargo bench -p iris-ec --features test-consumer --bench push`. Each iteration is a whole
//! push of a new item on a single-shard consumer over loopback: `reserve`, the Mooncake TCP
//! write with its status, `complete_batch` (the topology and handshake are cached after the
//! first). Targets:
//!
//! - `store, tmpfs`: the shared-storage connector's atomic write to `/dev/shm`, for the ratio;
//! - `push, in-process consumer`: iris's test consumer, on the runtime's other thread;
//! - `push, vLLM consumer`: vLLM 0.33's own `ECMooncakeConnector` consumer with Mooncake's TCP
//!   transport, when `IRIS_BENCH_VLLM_CONSUMER` names its control address (start one with
//!   `tools/bench/mooncake_consumer.py`; its slab must hold every item pushed, about 768 KiB
//!   times the iterations criterion runs, as a consumer keeps an unloaded push for 300 s).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iris_ec::config::MooncakeSettings;
use iris_ec::mooncake::consumer::TestConsumer;
use iris_ec::mooncake::{MooncakeProducer, PushSpec};
use iris_ec::storage::{EcDtype, EntryShape, SharedStorage, pack_rows};

const TOKENS: u64 = 256;
const ROWS: usize = 256;
const WIDTH: u64 = 1536;

fn bench_push(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let shape = EntryShape {
        rows: TOKENS,
        width: WIDTH,
        dtype: EcDtype::Bf16,
    };
    let values: Vec<f32> = (0..TOKENS * WIDTH)
        .map(|i| (i % 977) as f32 * 0.01)
        .collect();
    let rows = Arc::new(pack_rows(&values, &[], ROWS, EcDtype::Bf16).expect("rows"));
    let next = AtomicU64::new(0);
    let spec = || {
        let n = next.fetch_add(1, Ordering::Relaxed);
        PushSpec {
            transfer_id: format!("bench-{}-{n}", std::process::id()),
            mm_hash: format!("bench-item-{}-{n}", std::process::id()),
            rows: TOKENS,
            width: WIDTH,
            dtype: EcDtype::Bf16,
        }
    };
    let producer = MooncakeProducer::new(
        MooncakeSettings {
            control_timeout: Duration::from_secs(30),
        },
        "iris-bench".to_owned(),
    );
    let push = |consumer: &str| {
        runtime.block_on(async {
            let reserved = producer
                .reserve(consumer, vec![spec()])
                .await
                .expect("reserved");
            producer
                .push(reserved, &[Some(Arc::clone(&rows))])
                .await
                .expect("pushed");
        });
    };

    let mut group = c.benchmark_group("ec_publish_448x448_bf16");
    group.throughput(Throughput::Bytes(shape.data_bytes()));
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        let dir = tempfile::tempdir_in(shm).expect("a folder for the store");
        let store = SharedStorage::open(dir.path(), Some(64 * (shape.data_bytes() + 256)))
            .expect("the store opens");
        group.bench_function("store, tmpfs", |b| {
            b.iter(|| {
                let id = spec().mm_hash;
                store.write(&id, &shape, &rows).expect("the write succeeds")
            });
        });
    } else {
        eprintln!("skipped store, tmpfs: /dev/shm is not here");
    }

    let consumer = runtime
        .block_on(TestConsumer::start(1, 64 << 20, 2))
        .expect("the consumer starts");
    let address = consumer.consumer_zmq();
    group.bench_function("push, in-process consumer", |b| {
        b.iter_custom(|iterations| {
            let mut total = Duration::ZERO;
            for _ in 0..iterations {
                let start = Instant::now();
                push(&address);
                total += start.elapsed();
                consumer.release_resident();
            }
            total
        });
    });

    match std::env::var("IRIS_BENCH_VLLM_CONSUMER") {
        Ok(address) => {
            group.bench_function("push, vLLM consumer", |b| b.iter(|| push(&address)));
        }
        Err(_) => eprintln!(
            "skipped push, vLLM consumer: IRIS_BENCH_VLLM_CONSUMER is not set (see tools/bench/mooncake_consumer.py)"
        ),
    }
    group.finish();
}

criterion_group!(benches, bench_push);
criterion_main!(benches);
