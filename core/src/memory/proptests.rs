//! Property tests of the caching allocator on the CPU device: random sequences of allocations
//! (small and large classes), frees of random live buffers and cache empties, with the books
//! recounted after every step.

use proptest::prelude::*;

use super::allocator::{AllocError, CachingAllocator, DeviceBuffer, MIN_LARGE_ALLOC, SMALL_SIZE};

const CAPACITY: &str = "64MiB";
/// Live buffers above which the sequence frees instead of allocating, so that most steps
/// succeed within the capacity.
const MAX_LIVE: usize = 12;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
    EmptyCache,
}

fn sizes() -> impl Strategy<Value = u64> {
    prop_oneof![
        1u64..=4096,
        4097u64..=SMALL_SIZE,
        SMALL_SIZE + 1..=6 << 20,
        MIN_LARGE_ALLOC..=MIN_LARGE_ALLOC + (4 << 20),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            6 => sizes().prop_map(Op::Alloc),
            4 => any::<usize>().prop_map(Op::Free),
            1 => Just(Op::EmptyCache),
        ],
        1..120,
    )
}

fn used(allocator: &CachingAllocator) -> u64 {
    let info = allocator.device().mem_info().unwrap();
    info.total - info.free
}

/// Recounts the allocator's figures from the live buffers and its segment table.
fn check_books(allocator: &CachingAllocator, live: &[DeviceBuffer], peaks: &mut (u64, u64)) {
    let stats = allocator.stats();
    let capacities: u64 = live.iter().map(DeviceBuffer::capacity).sum();
    let lens: u64 = live.iter().map(DeviceBuffer::len).sum();
    assert_eq!(stats.allocated, capacities, "allocated vs live capacities");
    assert_eq!(stats.requested, lens, "requested vs live lengths");
    assert_eq!(stats.live_buffers, live.len() as u64);

    let segments = allocator.segments();
    let reserved: u64 = segments.iter().map(|segment| segment.size).sum();
    assert_eq!(stats.reserved, reserved, "reserved vs segment sizes");
    assert_eq!(stats.reserved, used(allocator), "reserved vs device used");
    assert_eq!(stats.segments, segments.len() as u64);
    assert_eq!(stats.raw_allocs - stats.raw_frees, stats.segments);

    let mut live_blocks = 0;
    let mut free_bytes = 0;
    for segment in &segments {
        let mut position = 0;
        for block in &segment.blocks {
            assert_eq!(block.offset, position, "blocks tile the segment");
            position += block.size;
            match block.requested {
                Some(_) => live_blocks += 1,
                None => free_bytes += block.size,
            }
        }
        assert_eq!(position, segment.size);
    }
    assert_eq!(live_blocks, live.len());
    assert_eq!(
        free_bytes,
        stats.cached(),
        "free blocks vs reserved - allocated"
    );
    for buffer in live {
        let segment = segments
            .iter()
            .find(|segment| segment.handle == buffer.handle().0)
            .expect("a live buffer's segment is held");
        let block = segment
            .blocks
            .iter()
            .find(|block| block.offset == buffer.offset())
            .expect("a live buffer is a block of its segment");
        assert_eq!(
            (block.size, block.requested),
            (buffer.capacity(), Some(buffer.len()))
        );
    }
    allocator.check_invariants().unwrap();

    peaks.0 = peaks.0.max(stats.allocated);
    peaks.1 = peaks.1.max(stats.reserved);
    assert_eq!(
        (stats.peak_allocated, stats.peak_reserved),
        *peaks,
        "peaks are maxima"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn books_balance_after_every_step(ops in ops()) {
        let allocator = crate::test_support::cpu_allocator(CAPACITY);
        let start = used(&allocator);
        prop_assert_eq!(start, 0);
        let mut live: Vec<DeviceBuffer> = Vec::new();
        let mut peaks = (0, 0);
        for op in ops {
            match op {
                Op::Alloc(_) | Op::Free(_) if live.len() >= MAX_LIVE => {
                    live.swap_remove(0);
                }
                Op::Alloc(bytes) => match allocator.alloc(bytes) {
                    Ok(buffer) => {
                        prop_assert!(buffer.capacity() >= bytes);
                        prop_assert_eq!(buffer.capacity() % 512, 0);
                        live.push(buffer);
                    }
                    Err(AllocError::OutOfMemory { requested, .. }) => {
                        prop_assert_eq!(requested, bytes);
                    }
                    Err(err) => panic!("alloc({bytes}): {err}"),
                },
                Op::Free(index) => {
                    if !live.is_empty() {
                        let index = index % live.len();
                        live.swap_remove(index);
                    }
                }
                Op::EmptyCache => {
                    let before = allocator.stats();
                    let released = allocator.empty_cache().unwrap();
                    let after = allocator.stats();
                    prop_assert_eq!(before.reserved - after.reserved, released);
                    let segments = allocator.segments();
                    prop_assert!(segments.iter().all(|segment| segment
                        .blocks
                        .iter()
                        .any(|block| block.requested.is_some())));
                }
            }
            check_books(&allocator, &live, &mut peaks);
        }
        live.clear();
        allocator.empty_cache().unwrap();
        check_books(&allocator, &live, &mut peaks);
        prop_assert_eq!(used(&allocator), start);
        let stats = allocator.stats();
        prop_assert_eq!(stats.raw_allocs, stats.raw_frees);
        prop_assert_eq!(stats.reserved, 0);
    }
}

/// Segments as layouts (size, pool, blocks), without the handles a dry-run copy leaves null.
fn layout(allocator: &CachingAllocator) -> Vec<(u64, super::PoolKind, Vec<super::BlockInfo>)> {
    allocator
        .segments()
        .into_iter()
        .map(|segment| (segment.size, segment.pool, segment.blocks))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A dry-run copy taken at any point takes the same decisions as the allocator it was taken
    /// from, step for step: the same blocks, segments, counters and peaks, and out-of-memory
    /// at the same requests (after the same empty-and-retry).
    #[test]
    fn a_dry_run_copy_decides_as_the_allocator_does(before in ops(), after in ops()) {
        let allocator = crate::test_support::cpu_allocator(CAPACITY);
        let mut held: Vec<DeviceBuffer> = Vec::new();
        for op in before {
            match op {
                Op::Alloc(bytes) if held.len() < MAX_LIVE => {
                    if let Ok(buffer) = allocator.alloc(bytes) {
                        held.push(buffer);
                    }
                }
                Op::Alloc(_) | Op::Free(_) => {
                    if !held.is_empty() {
                        held.swap_remove(0);
                    }
                }
                Op::EmptyCache => {
                    allocator.empty_cache().unwrap();
                }
            }
        }
        allocator.reset_peaks();
        let dry = allocator.dry_run().unwrap();
        prop_assert!(dry.is_dry_run() && !allocator.is_dry_run());
        prop_assert_eq!(dry.stats(), allocator.stats());
        let (mut real_live, mut dry_live) = (Vec::new(), Vec::new());
        for op in after {
            match op {
                Op::Alloc(_) | Op::Free(_) if real_live.len() >= MAX_LIVE => {
                    real_live.swap_remove(0);
                    dry_live.swap_remove(0);
                }
                Op::Alloc(bytes) => match (allocator.alloc(bytes), dry.alloc(bytes)) {
                    (Ok(real), Ok(copy)) => {
                        prop_assert_eq!((real.offset(), real.capacity()), (copy.offset(), copy.capacity()));
                        prop_assert!(copy.handle().is_null());
                        real_live.push(real);
                        dry_live.push(copy);
                    }
                    (Err(AllocError::OutOfMemory { .. }), Err(AllocError::OutOfMemory { .. })) => {}
                    (real, copy) => panic!("alloc({bytes}): {real:?} vs dry run {copy:?}"),
                },
                Op::Free(index) => {
                    if !real_live.is_empty() {
                        let index = index % real_live.len();
                        real_live.swap_remove(index);
                        dry_live.swap_remove(index);
                    }
                }
                Op::EmptyCache => {
                    prop_assert_eq!(allocator.empty_cache().unwrap(), dry.empty_cache().unwrap());
                }
            }
            prop_assert_eq!(dry.stats(), allocator.stats());
            prop_assert_eq!(layout(&dry), layout(&allocator));
            dry.check_invariants().unwrap();
        }
        // The copy never touched the device: what it holds is the real allocator's only.
        drop((dry_live, dry));
        prop_assert_eq!(used(&allocator), allocator.stats().reserved);
    }
}
