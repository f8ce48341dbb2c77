//! Scheduler and encoder-cache-manager benches.
//!
//! - `scheduler_step/1024_waiting_x4_images`: one step (schedule + update) of the default
//!   scheduler holding 1,024 waiting requests of 4 images each, kept at that load by replacing
//!   every finished request with a new one; vLLM-like defaults (8192 tokens a step, 256 seqs).
//! - `encoder_cache_manager/replay`: manager operations per second, replaying a trace recorded
//!   from a Zipf-popularity simulation through the same scheduler.
//!
//! Run: `cargo bench -p iris-core --bench scheduler`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iris_core::budget::{BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig};
use iris_core::cache::encoder::{
    EncoderCacheError, EncoderCacheManagement, EncoderCacheManager, EncoderCacheReset,
    EncoderCacheStats, MmHash, RequestId,
};
use iris_core::scheduler::{MmItem, NewRequest, Scheduler, SchedulerPolicy};
use iris_core::simulate::SyntheticWorkload;

const WAITING: usize = 1024;
const IMAGES_PER_REQUEST: u64 = 4;
const IMAGE_TOKENS: u64 = 576; // a 672x672 image on Qwen2-VL (24 x 24 merged patches)
const TEXT_TOKENS: u64 = 64;
const DISTINCT_IMAGES: u64 = 3000;

/// Request `n` of the step bench: 4 images (some shared across requests) separated by text.
fn bench_request(n: u64) -> NewRequest {
    let mut items = Vec::new();
    let mut pos = 0;
    for k in 0..IMAGES_PER_REQUEST {
        pos += TEXT_TOKENS;
        let image = (n * 7 + k * 13) % DISTINCT_IMAGES;
        items.push(MmItem::new(format!("img{image}"), pos, IMAGE_TOKENS));
        pos += IMAGE_TOKENS;
    }
    NewRequest::new(pos + TEXT_TOKENS, items)
}

fn scheduler_step(c: &mut Criterion) {
    let config = SchedulerConfig::default();
    let mut s = Scheduler::with_item_limit(config, IMAGE_TOKENS).unwrap();
    let mut next = 0u64;
    for _ in 0..WAITING {
        s.add_request(bench_request(next)).unwrap();
        next += 1;
    }
    let mut group = c.benchmark_group("scheduler_step");
    group.throughput(Throughput::Elements(1));
    group.bench_function("1024_waiting_x4_images", |b| {
        b.iter(|| {
            let out = s.schedule().unwrap();
            let finished = s.update_from_output(&out);
            // Keep the load constant: every finished request is replaced.
            for _ in finished {
                s.add_request(bench_request(next)).unwrap();
                next += 1;
            }
            black_box(out.total_tokens())
        });
    });
    group.finish();
    assert!(s.num_waiting() + s.num_running() >= WAITING);
}

/// One recorded manager call.
#[derive(Debug, Clone)]
enum Call {
    Check(RequestId, usize, MmHash),
    CanAllocate(u64, u64, u64),
    Allocate(RequestId, usize, MmHash, u64),
    FreeInput(RequestId, usize),
    Free(RequestId),
    Freed,
}

/// A manager that records every call it forwards: the trait makes the recording transparent
/// to the scheduler.
struct Recording {
    inner: EncoderCacheManager,
    trace: Vec<Call>,
}

impl EncoderCacheManagement for Recording {
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }
    fn num_free_slots(&self) -> u64 {
        self.inner.num_free_slots()
    }
    fn num_freeable_slots(&self) -> u64 {
        self.inner.num_freeable_slots()
    }
    fn contains(&self, hash: &str) -> bool {
        self.inner.contains(hash)
    }
    fn holds(&self, request: RequestId, index: usize) -> bool {
        self.inner.holds(request, index)
    }
    fn check_and_update_cache(&mut self, request: RequestId, index: usize, hash: &MmHash) -> bool {
        self.trace.push(Call::Check(request, index, hash.clone()));
        self.inner.check_and_update_cache(request, index, hash)
    }
    fn can_allocate(&mut self, size: u64, compute_budget: u64, already: u64) -> bool {
        self.trace
            .push(Call::CanAllocate(size, compute_budget, already));
        self.inner.can_allocate(size, compute_budget, already)
    }
    fn invalidate(&mut self, hash: &str) -> bool {
        self.inner.invalidate(hash)
    }
    fn allocate(
        &mut self,
        request: RequestId,
        index: usize,
        hash: &MmHash,
        size: u64,
    ) -> Result<(), EncoderCacheError> {
        self.trace
            .push(Call::Allocate(request, index, hash.clone(), size));
        self.inner.allocate(request, index, hash, size)
    }
    fn free_encoder_input(&mut self, request: RequestId, index: usize) {
        self.trace.push(Call::FreeInput(request, index));
        self.inner.free_encoder_input(request, index);
    }
    fn free(&mut self, request: RequestId) {
        self.trace.push(Call::Free(request));
        self.inner.free(request);
    }
    fn get_freed_mm_hashes(&mut self) -> Vec<MmHash> {
        self.trace.push(Call::Freed);
        self.inner.get_freed_mm_hashes()
    }
    fn reset(&mut self) -> EncoderCacheReset {
        self.inner.reset()
    }
    fn stats(&self) -> EncoderCacheStats {
        self.inner.stats()
    }
}

fn record_trace() -> (u64, Vec<Call>) {
    let workload = SyntheticWorkload {
        requests: 2_000,
        distinct_images: 1_000,
        zipf_exponent: 1.0,
        max_images_per_request: 4,
        image_tokens: (64, 1024),
        text_tokens: (16, 128),
        requests_per_step: 8,
        seed: 7,
    }
    .generate();
    let config = SchedulerConfig {
        encoder_cache_size: Some(16_384),
        ..SchedulerConfig::default()
    };
    let budget =
        EncoderBudget::new(&config, &[(Modality::Image, ModalityLimits::new(1024))]).unwrap();
    let capacity = budget.cache_size();
    let manager = Recording {
        inner: EncoderCacheManager::new(capacity),
        trace: Vec::new(),
    };
    let mut s = Scheduler::new(config, budget, manager);
    let mut next = 0;
    let mut step = 0;
    while next < workload.len() || s.has_unfinished() {
        while next < workload.len() && workload[next].arrival_step <= step {
            let w = &workload[next];
            let items = w
                .items
                .iter()
                .map(|i| MmItem::new(i.hash.as_str(), i.offset, i.length))
                .collect();
            s.add_request(NewRequest::new(w.prompt_len, items)).unwrap();
            next += 1;
        }
        let out = s.schedule().unwrap();
        s.update_from_output(&out);
        step += 1;
    }
    (capacity, s.into_parts().1.trace)
}

fn replay(capacity: u64, trace: &[Call]) -> u64 {
    let mut m = EncoderCacheManager::new(capacity);
    let mut acc = 0u64;
    for call in trace {
        match call {
            Call::Check(r, i, h) => acc += u64::from(m.check_and_update_cache(*r, *i, h)),
            Call::CanAllocate(n, c, a) => acc += u64::from(m.can_allocate(*n, *c, *a)),
            Call::Allocate(r, i, h, n) => {
                // The trace was valid when recorded; replay is the same sequence.
                m.allocate(*r, *i, h, *n).unwrap();
            }
            Call::FreeInput(r, i) => m.free_encoder_input(*r, *i),
            Call::Free(r) => m.free(*r),
            Call::Freed => acc += m.get_freed_mm_hashes().len() as u64,
        }
    }
    acc
}

fn manager_ops(c: &mut Criterion) {
    let (capacity, trace) = record_trace();
    let mut group = c.benchmark_group("encoder_cache_manager");
    group.throughput(Throughput::Elements(trace.len() as u64));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function(format!("replay_{}_ops", trace.len()), |b| {
        b.iter(|| black_box(replay(capacity, &trace)));
    });
    group.finish();
}

criterion_group!(benches, scheduler_step, manager_ops);
criterion_main!(benches);
