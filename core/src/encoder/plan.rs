//! Step plans: every tensor of a step at an offset in one arena.
//!
//! A caching allocator serving a step tensor by tensor reserves more than the step ever holds
//! live at once: requests of a few MiB share 20 MiB segments, a block freed early is too small
//! for the next request and a new segment is made beside it, remainders stay unsplit. On a
//! Qwen2-VL-2B tower that came to 1.65 times the live peak in f32. A step's sequence of
//! allocations and frees is known before it runs, though: the same tower code walked by a
//! planning [`Runner`](super::exec::Runner) records it (a *trace*), and `StepPlan::new`
//! places each tensor at an offset of one arena so that tensors alive at the same time never
//! overlap, largest first, each in the lowest gap that holds it (the greedy-by-size placement
//! of TensorFlow Lite's arena planner). The arena comes from the allocator as one block of
//! its own, and the step costs the arena's size, within a few percent of the live peak, which
//! is also what start-up reserves for it.
//!
//! Tensors still alive when the planned work returns are the step's outputs: they outlive the
//! step (the encoder cache keeps them), so they are not placed in the arena but allocated on
//! their own, and counted apart ([`StepPlan::output_bytes`]).
//!
//! A run that departs from its plan (a tensor of another size at some position, a placed
//! tensor whose space is still held by one the plan thought freed) never shares memory: that
//! tensor is allocated on its own instead, and the departure is counted.

use crate::memory::allocator::MIN_BLOCK_SIZE;

/// One event of a planning trace, in the order the work made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TraceEvent {
    /// The next allocation (its index is the count of `Alloc` events before it), in bytes.
    Alloc(u64),
    /// The allocation of this index was freed.
    Free(usize),
}

/// Where one allocation of a step goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// At `offset` of the arena, `bytes` long (rounded to the allocator's block size).
    Arena {
        /// Byte offset in the arena.
        offset: u64,
        /// Bytes reserved for it.
        bytes: u64,
    },
    /// An output: an allocation of its own.
    Own {
        /// Bytes asked for.
        bytes: u64,
    },
}

/// The placement of a step's allocations (see the module's overview).
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// By allocation index.
    slots: Vec<Slot>,
    /// Bytes the requested sizes ask for, by allocation index (before rounding).
    requested: Vec<u64>,
    arena_bytes: u64,
    live_peak: u64,
    output_bytes: u64,
}

impl StepPlan {
    /// Places the allocations of `trace`; those never freed in it are outputs.
    pub(crate) fn new(trace: &[TraceEvent]) -> StepPlan {
        let mut requested = Vec::new();
        let mut freed_at: Vec<Option<usize>> = Vec::new();
        let mut born_at = Vec::new();
        for (time, event) in trace.iter().enumerate() {
            match *event {
                TraceEvent::Alloc(bytes) => {
                    requested.push(bytes);
                    freed_at.push(None);
                    born_at.push(time);
                }
                TraceEvent::Free(index) => {
                    if let Some(slot) = freed_at.get_mut(index) {
                        *slot = Some(time);
                    }
                }
            }
        }
        let rounded: Vec<u64> = requested.iter().map(|&b| block_bytes(b)).collect();
        // Arena tensors by size, largest first (then earliest), each placed in the lowest gap
        // among the already placed tensors that are alive at the same time.
        let mut order: Vec<usize> = (0..requested.len())
            .filter(|&i| freed_at[i].is_some())
            .collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(rounded[i]), i));
        let alive = |i: usize| (born_at[i], freed_at[i].unwrap_or(usize::MAX));
        let overlaps = |a: (usize, usize), b: (usize, usize)| a.0 < b.1 && b.0 < a.1;
        let mut offsets: Vec<Option<u64>> = vec![None; requested.len()];
        let mut placed: Vec<usize> = Vec::with_capacity(order.len());
        let mut arena_bytes = 0u64;
        for &i in &order {
            let mut busy: Vec<(u64, u64)> = placed
                .iter()
                .filter(|&&j| overlaps(alive(i), alive(j)))
                .filter_map(|&j| offsets[j].map(|at| (at, at.saturating_add(rounded[j]))))
                .collect();
            busy.sort_unstable();
            let size = rounded[i];
            let mut best: Option<(u64, u64)> = None; // (gap, offset)
            let mut cursor = 0u64;
            for &(start, end) in &busy {
                if start >= cursor.saturating_add(size) {
                    let gap = start - cursor;
                    if best.is_none_or(|(g, _)| gap < g) {
                        best = Some((gap, cursor));
                    }
                }
                cursor = cursor.max(end);
            }
            let offset = best.map_or(cursor, |(_, at)| at);
            offsets[i] = Some(offset);
            arena_bytes = arena_bytes.max(offset.saturating_add(size));
            placed.push(i);
        }
        let slots: Vec<Slot> = (0..requested.len())
            .map(|i| match offsets[i] {
                Some(offset) => Slot::Arena {
                    offset,
                    bytes: rounded[i],
                },
                None => Slot::Own {
                    bytes: requested[i],
                },
            })
            .collect();
        // The live peak of arena tensors, walking the trace.
        let (mut live, mut live_peak) = (0u64, 0u64);
        let mut index = 0usize;
        for event in trace {
            match *event {
                TraceEvent::Alloc(_) => {
                    if let Slot::Arena { bytes, .. } = slots[index] {
                        live = live.saturating_add(bytes);
                        live_peak = live_peak.max(live);
                    }
                    index += 1;
                }
                TraceEvent::Free(i) => {
                    if let Some(Slot::Arena { bytes, .. }) = slots.get(i) {
                        live = live.saturating_sub(*bytes);
                    }
                }
            }
        }
        let output_bytes = slots
            .iter()
            .map(|slot| match *slot {
                Slot::Own { bytes } => block_bytes(bytes),
                Slot::Arena { .. } => 0,
            })
            .fold(0u64, u64::saturating_add);
        StepPlan {
            slots,
            requested,
            arena_bytes,
            live_peak,
            output_bytes,
        }
    }

    /// Bytes of the arena: the step's activations, workspaces and inputs.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// The most bytes of arena tensors alive at once: the least any placement needs, against
    /// which [`StepPlan::arena_bytes`] is measured.
    pub fn live_peak(&self) -> u64 {
        self.live_peak
    }

    /// Bytes of the outputs (rounded to the allocator's block size), allocated on their own.
    pub fn output_bytes(&self) -> u64 {
        self.output_bytes
    }

    /// Allocations in the step.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the step allocates nothing.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Where allocation `index` goes, if it asks for `bytes` as planned.
    pub(crate) fn slot(&self, index: usize, bytes: u64) -> Option<Slot> {
        (self.requested.get(index) == Some(&bytes)).then(|| self.slots[index])
    }
}

/// `bytes` rounded up to the allocator's block size, so that every slot is aligned as the
/// allocator's blocks are.
///
/// Sizes come from plugins too (op workspaces): one near `u64::MAX` saturates, as every sum of
/// the plan does, so that the arena is sized past any device (and its allocation refused)
/// rather than wrapped to a few bytes.
fn block_bytes(bytes: u64) -> u64 {
    bytes
        .max(1)
        .div_ceil(MIN_BLOCK_SIZE)
        .saturating_mul(MIN_BLOCK_SIZE)
}

#[cfg(test)]
mod tests {
    use super::TraceEvent::{Alloc, Free};
    use super::*;

    const K: u64 = MIN_BLOCK_SIZE;

    #[test]
    fn tensors_alive_together_never_overlap_and_freed_space_is_reused() {
        // a and b live together; c comes after a is freed and fits in its place.
        let plan = StepPlan::new(&[
            Alloc(4 * K),
            Alloc(2 * K),
            Free(0),
            Alloc(3 * K),
            Free(1),
            Free(2),
        ]);
        assert_eq!(plan.live_peak(), 6 * K);
        assert_eq!(plan.arena_bytes(), 6 * K);
        let Some(Slot::Arena { offset: a, .. }) = plan.slot(0, 4 * K) else {
            panic!("a is in the arena");
        };
        let Some(Slot::Arena { offset: b, .. }) = plan.slot(1, 2 * K) else {
            panic!("b is in the arena");
        };
        let Some(Slot::Arena { offset: c, .. }) = plan.slot(2, 3 * K) else {
            panic!("c is in the arena");
        };
        assert!(a + 4 * K <= b || b + 2 * K <= a, "a and b overlap");
        assert!(c + 3 * K <= b || b + 2 * K <= c, "c and b overlap");
        assert!(c < a + 4 * K && a < c + 3 * K, "c reuses a's space");
    }

    #[test]
    fn tensors_never_freed_are_outputs_on_their_own() {
        let plan = StepPlan::new(&[Alloc(K), Alloc(100), Free(0)]);
        assert_eq!(plan.slot(1, 100), Some(Slot::Own { bytes: 100 }));
        assert_eq!(plan.output_bytes(), K);
        assert_eq!(plan.arena_bytes(), K);
        assert_eq!(
            plan.slot(1, 101),
            None,
            "a different size departs from the plan"
        );
    }

    /// A random trace's placement: no two slots alive at once overlap, and the arena stays
    /// near the live peak.
    #[test]
    fn random_traces_place_without_overlap() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..50 {
            let mut trace = Vec::new();
            let mut live: Vec<usize> = Vec::new();
            let mut count = 0;
            for _ in 0..200 {
                if live.is_empty() || next() % 3 != 0 {
                    trace.push(Alloc(1 + next() % (64 * K)));
                    live.push(count);
                    count += 1;
                } else {
                    let at = usize::try_from(next() % live.len() as u64).expect("an index");
                    trace.push(Free(live.swap_remove(at)));
                }
            }
            let plan = StepPlan::new(&trace);
            let mut alive: Vec<(usize, u64, u64)> = Vec::new();
            let mut index = 0;
            for event in &trace {
                match *event {
                    Alloc(bytes) => {
                        if let Some(Slot::Arena { offset, bytes }) = plan.slot(index, bytes) {
                            for &(other, o, b) in &alive {
                                assert!(
                                    offset + bytes <= o || o + b <= offset,
                                    "slots {index} and {other} overlap while both alive"
                                );
                            }
                            alive.push((index, offset, bytes));
                        }
                        index += 1;
                    }
                    Free(i) => alive.retain(|&(j, ..)| j != i),
                }
            }
            assert!(plan.arena_bytes() >= plan.live_peak());
        }
    }
}
