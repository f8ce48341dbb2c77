//! Scheduler, encoder cache manager and device encoder cache driven together on the CPU device:
//! property tests on random sequences of arrivals, steps, aborts and resets, and a
//! 10,000-request simulation with Zipf-distributed image popularity.

use std::sync::Arc;

use iris_core::budget::{Policy, SchedulerConfig};
use iris_core::cache::encoder::{EncoderCacheManagement, EncoderCacheManager};
use iris_core::memory::CachingAllocator;
use iris_core::scheduler::{
    MmItem, NewRequest, RequestId, Scheduler, SchedulerError, SchedulerPolicy,
};
use iris_core::simulate::{
    DeviceCacheOutputs, EncoderOutputStore, SizeOnlyOutputs, SyntheticWorkload, build_scheduler,
    check_outputs, run_outputs, simulate_with,
};
use iris_plugin::DType;
use proptest::prelude::*;

/// A caching allocator on the CPU device.
fn cpu_allocator() -> Arc<CachingAllocator> {
    let plugin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "256MiB".into())])
        .unwrap();
    CachingAllocator::new(Arc::new(device))
}

/// Device outputs `hidden` wide in f32 on a fresh CPU device.
fn device_outputs(hidden: u64) -> DeviceCacheOutputs {
    DeviceCacheOutputs::new(cpu_allocator(), hidden, DType::F32)
}

/// After every request ended and a reset: no cache entry, no device byte allocated, and after
/// emptying the allocator's cache nothing reserved either.
fn assert_device_empty(outputs: &DeviceCacheOutputs) {
    assert!(outputs.is_empty());
    assert_eq!(outputs.cache().bytes(), 0);
    let allocator = outputs.allocator();
    assert_eq!(allocator.stats().allocated, 0);
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved, 0);
    assert_eq!(outputs.cache().unknown_frees(), 0);
}

/// The size of image `k`: a function of the hash, as content determines size.
fn image_len(k: u8) -> u64 {
    10 + 17 * u64::from(k)
}

#[derive(Debug, Clone)]
enum Op {
    Arrive { gaps: Vec<(u64, u8)>, tail: u64 },
    Step,
    Abort(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec((0u64..60, 0u8..6), 0..4), 1u64..80)
            .prop_map(|(gaps, tail)| Op::Arrive { gaps, tail }),
        6 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => Just(Op::Reset),
    ]
}

fn request(gaps: &[(u64, u8)], tail: u64) -> NewRequest {
    let mut items = Vec::new();
    let mut pos = 0;
    for &(gap, k) in gaps {
        pos += gap;
        let len = image_len(k);
        // Some images have non-embedding positions (separators): embeds < length.
        let embeds = len - u64::from(k % 3);
        items.push(MmItem::with_embeds(format!("img{k}"), pos, len, embeds));
        pos += len;
    }
    NewRequest::new(pos + tail, items)
}

/// Checks the manager's invariants and that the store mirrors the manager exactly.
fn check<O: EncoderOutputStore>(
    s: &Scheduler,
    outputs: &O,
    step: u64,
) -> Result<(), TestCaseError> {
    let m = s.manager();
    m.verify().map_err(TestCaseError::fail)?;
    let st = m.stats();
    prop_assert!(st.free <= st.freeable && st.freeable <= st.capacity);
    let unreferenced: u64 = m
        .entries()
        .filter(|(h, _)| m.references(h) == Some(0))
        .map(|(_, size)| size)
        .sum();
    prop_assert_eq!(st.freeable, st.free + unreferenced);
    check_outputs(m, outputs, step).map_err(|e| TestCaseError::fail(e.to_string()))?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_sequences_keep_invariants_and_finish(
        mnbt in 40u64..400,
        cache in 95u64..400,
        chunked in any::<bool>(),
        kv_blocks in prop::option::of(30u64..200),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let config = SchedulerConfig {
            // Non-chunked items must fit a step: the largest image is 95 tokens.
            max_num_batched_tokens: if chunked { mnbt } else { mnbt.max(95) },
            max_num_seqs: 8,
            encoder_cache_size: Some(cache),
            disable_chunked_mm_input: !chunked,
            // Progress after every step is the progress policy's guarantee, with or without
            // preemption.
            policy: Policy::Progress,
            num_kv_blocks: kv_blocks,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::with_item_limit(config, image_len(5)).unwrap();
        let mut outputs = device_outputs(8);
        let mut ids: Vec<RequestId> = Vec::new();
        let mut step = 0u64;
        for op in ops {
            match op {
                Op::Arrive { gaps, tail } => {
                    // A prompt longer than the KV cache is refused; the rest must be accepted.
                    match s.add_request(request(&gaps, tail)) {
                        Ok(id) => ids.push(id),
                        Err(SchedulerError::PromptExceedsKvCache { .. }) => {}
                        Err(err) => panic!("{err}"),
                    }
                }
                Op::Step => {
                    let out = s.schedule().unwrap();
                    prop_assert!(!s.has_unfinished() || out.total_tokens() > 0, "no progress");
                    run_outputs(&mut outputs, &out, step).unwrap();
                    check(&s, &outputs, step)?;
                    s.update_from_output(&out);
                    step += 1;
                }
                Op::Abort(i) => {
                    if let Some(&id) = ids.get(i) {
                        s.abort(id);
                    }
                }
                Op::Reset => {
                    s.reset_encoder_cache();
                    outputs.reset().unwrap();
                    prop_assert_eq!(s.manager().num_free_slots(), s.manager().capacity());
                }
            }
            check(&s, &outputs, step)?;
        }
        // Drain: every step must make progress, and everything finishes.
        let mut guard = 0;
        while s.has_unfinished() {
            let out = s.schedule().unwrap();
            prop_assert!(out.total_tokens() > 0, "stalled with {} waiting, {} running", s.num_waiting(), s.num_running());
            run_outputs(&mut outputs, &out, step).unwrap();
            check(&s, &outputs, step)?;
            s.update_from_output(&out);
            step += 1;
            guard += 1;
            prop_assert!(guard < 10_000);
        }
        prop_assert_eq!(s.manager().stats().references, 0);
        s.reset_encoder_cache();
        outputs.reset().unwrap();
        check(&s, &outputs, step)?;
        prop_assert_eq!(s.manager().stats().entries, 0);
        assert_device_empty(&outputs);
    }
}

#[test]
fn ten_thousand_zipf_requests_all_complete_and_nothing_is_left() {
    let workload = SyntheticWorkload {
        requests: 10_000,
        distinct_images: 2_000,
        zipf_exponent: 1.0,
        max_images_per_request: 4,
        image_tokens: (64, 1024),
        text_tokens: (16, 128),
        requests_per_step: 8,
        seed: 0x1815,
    }
    .generate();
    let config = SchedulerConfig {
        encoder_cache_size: Some(16_384),
        ..SchedulerConfig::default()
    };
    let mut scheduler = build_scheduler(&workload, &config, None).unwrap();
    let mut outputs = device_outputs(16);
    let summary = simulate_with(&mut scheduler, &workload, &mut outputs, |_| Ok(())).unwrap();

    assert_eq!(summary.requests.len(), 10_000);
    for (r, w) in summary.requests.iter().zip(&workload) {
        assert!(
            r.finish_step >= w.arrival_step,
            "{} finished before arriving",
            r.id
        );
    }
    let prompt_tokens: u64 = workload.iter().map(|w| w.prompt_len).sum();
    assert_eq!(summary.scheduled_tokens, prompt_tokens);
    assert!(summary.hits > 0 && summary.evictions > 0, "{summary:?}");
    assert!(summary.peak_cache_use <= 16_384);
    assert!(!scheduler.has_unfinished());

    // Nothing referenced; resident entries are freeable and a reset returns them all.
    let manager: &EncoderCacheManager = scheduler.manager();
    assert_eq!(manager.stats().references, 0);
    assert_eq!(manager.num_freeable_slots(), manager.capacity());
    scheduler.reset_encoder_cache();
    outputs.reset().unwrap();
    assert_eq!(scheduler.manager().stats().entries, 0);
    assert_eq!(scheduler.manager().num_free_slots(), 16_384);
    assert_device_empty(&outputs);
}

#[test]
fn size_only_store_mirrors_the_manager_too() {
    let workload = SyntheticWorkload {
        requests: 500,
        distinct_images: 100,
        zipf_exponent: 1.0,
        max_images_per_request: 4,
        image_tokens: (64, 1024),
        text_tokens: (16, 128),
        requests_per_step: 4,
        seed: 3,
    }
    .generate();
    let config = SchedulerConfig::default();
    let mut scheduler = build_scheduler(&workload, &config, None).unwrap();
    let mut outputs = SizeOnlyOutputs::default();
    simulate_with(&mut scheduler, &workload, &mut outputs, |_| Ok(())).unwrap();
    assert_eq!(outputs.len(), scheduler.manager().stats().entries);
    scheduler.reset_encoder_cache();
    outputs.reset().unwrap();
    assert!(outputs.is_empty());
}
