//! The encoder cache manager: the scheduler's account of encoder-cache space, in embedding tokens.
//!
//! It reproduces vLLM v1's `EncoderCacheManager` (with its 2026 fixes) and holds no device memory:
//! the device encoder cache follows it, freeing the buffers of the hashes
//! [`EncoderCacheManagement::get_freed_mm_hashes`] reports.
//!
//! - Capacity and sizes are in embedding tokens: an item's size counts only the placeholder
//!   positions that are embeddings (see [`crate::scheduler::MmItem`]).
//! - An entry is shared by every request whose item has the same hash.
//! - References are counted per occurrence: the same image twice in one request holds two, and
//!   releasing one occurrence leaves the entry referenced.
//! - An entry that loses its last reference stays resident and reusable ("freeable") until space
//!   is needed; then the entry that became unreferenced earliest is evicted first.
//! - `get_freed_mm_hashes` reports only hashes that are no longer cached, so an entry evicted and
//!   re-allocated in the same step is not dropped by the device cache.
//!
//! Counters: `free` (slots no entry occupies) and `freeable` (free plus unreferenced entries).
//! Invariants, re-counted from scratch after every mutation in debug builds:
//! `free <= freeable <= capacity`, `freeable == free + sum(unreferenced sizes)` and
//! `free == capacity - sum(all cached sizes)`.
//!
//! ```
//! use iris_core::cache::encoder::{EncoderCacheManagement, EncoderCacheManager, RequestId};
//!
//! let mut m = EncoderCacheManager::new(1000);
//! let (a, b) = (RequestId(1), RequestId(2));
//! let img = "img".into();
//! assert!(!m.check_and_update_cache(a, 0, &img));
//! assert!(m.can_allocate(600, 1000, 0));
//! m.allocate(a, 0, &img, 600).unwrap();
//! assert!(m.check_and_update_cache(b, 0, &img)); // shared, no new slots
//! assert_eq!((m.num_free_slots(), m.num_freeable_slots()), (400, 400));
//! m.free(a);
//! m.free(b);
//! assert_eq!((m.num_free_slots(), m.num_freeable_slots()), (400, 1000)); // kept, freeable
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use lru::LruCache;
use thiserror::Error;

/// An item's content hash, shared cheaply between requests, the manager and step outputs.
pub type MmHash = Arc<str>;

/// A request, as the scheduler numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// Errors of the encoder cache manager.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncoderCacheError {
    /// `allocate` was called without room (the caller skipped `can_allocate`).
    #[error(
        "encoder cache: cannot allocate item {index} of {request} ({hash}): it needs {size} embedding tokens but only {free} slots are free"
    )]
    NoSpace {
        /// The request.
        request: RequestId,
        /// The item index in the request.
        index: usize,
        /// The item hash.
        hash: String,
        /// The item size in embedding tokens.
        size: u64,
        /// Free slots.
        free: u64,
    },
    /// `allocate` was called twice for the same occurrence.
    #[error("encoder cache: item {index} of {request} already holds a reference")]
    AlreadyHeld {
        /// The request.
        request: RequestId,
        /// The item index in the request.
        index: usize,
    },
}

/// What a reset released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderCacheReset {
    /// Entries dropped.
    pub entries: usize,
    /// Embedding-token slots given back.
    pub tokens: u64,
    /// References that in-flight requests held (they re-encode).
    pub references: usize,
}

/// Counters of an encoder cache manager.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderCacheStats {
    /// Capacity in embedding tokens.
    pub capacity: u64,
    /// Slots no entry occupies.
    pub free: u64,
    /// Free slots plus the slots of unreferenced entries.
    pub freeable: u64,
    /// Entries held.
    pub entries: usize,
    /// Occurrence references held.
    pub references: usize,
    /// Highest number of occupied slots seen.
    pub peak_used: u64,
    /// Lookups that found the entry and took a new reference.
    pub hits: u64,
    /// Lookups that did not find it.
    pub misses: u64,
    /// Entries allocated (encoder runs).
    pub allocations: u64,
    /// Embedding tokens allocated (tokens the encoder computes).
    pub allocated_tokens: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Resets.
    pub resets: u64,
}

/// The encoder-cache accounting a scheduler relies on. [`EncoderCacheManager`] is the default;
/// another policy (another eviction order, a non-sharing encoder-decoder variant) implements this
/// trait and plugs into [`crate::scheduler::Scheduler`] unchanged.
pub trait EncoderCacheManagement {
    /// Capacity in embedding tokens.
    fn capacity(&self) -> u64;
    /// Slots no entry occupies.
    fn num_free_slots(&self) -> u64;
    /// Free slots plus the slots of unreferenced entries.
    fn num_freeable_slots(&self) -> u64;
    /// Whether `hash` is cached; changes nothing.
    fn contains(&self, hash: &str) -> bool;
    /// Whether item `index` of `request` holds a reference.
    fn holds(&self, request: RequestId, index: usize) -> bool;
    /// If `hash` is cached, makes item `index` of `request` a reference to it (taking it out of
    /// the freeable set if it was unreferenced) and returns true; false if not cached. An
    /// occurrence that already holds a reference is not counted twice.
    fn check_and_update_cache(&mut self, request: RequestId, index: usize, hash: &MmHash) -> bool;
    /// Whether an item of `size` embedding tokens can be allocated, given this step's remaining
    /// compute budget and the tokens already scheduled (not yet allocated) this step. Evicts
    /// unreferenced entries, earliest-unreferenced first, when that makes room; reserves nothing.
    fn can_allocate(&mut self, size: u64, compute_budget: u64, already_scheduled: u64) -> bool;
    /// Allocates an entry of `size` slots for `hash`, referenced by item `index` of `request`.
    /// If `hash` is already cached, takes a reference instead.
    fn allocate(
        &mut self,
        request: RequestId,
        index: usize,
        hash: &MmHash,
        size: u64,
    ) -> Result<(), EncoderCacheError>;
    /// Drops the reference of item `index` of `request`, if it holds one.
    fn free_encoder_input(&mut self, request: RequestId, index: usize);
    /// Drops every reference of `request`.
    fn free(&mut self, request: RequestId);
    /// Hashes evicted since the last call that are not cached now (the device frees these).
    fn get_freed_mm_hashes(&mut self) -> Vec<MmHash>;
    /// Drops every entry and reference; both counters return to the capacity.
    fn reset(&mut self) -> EncoderCacheReset;
    /// Current counters.
    fn stats(&self) -> EncoderCacheStats;
    /// Drops the entry of `hash` and every reference to it, as if it had never been allocated;
    /// false if it is not cached. An engine calls it for an entry whose encoder output never
    /// reached the device or was lost (a failed encode, a device fault): the requests that
    /// still need the item allocate it again and re-encode it. The caller frees the device side.
    fn invalidate(&mut self, hash: &str) -> bool;
    /// Evicts every unreferenced entry and returns their hashes (the device frees these): what
    /// an engine does when the device runs out of memory, before it retries.
    fn evict_unreferenced(&mut self) -> Vec<MmHash> {
        // Asking for all freeable slots evicts until nothing unreferenced is left.
        let freeable = self.num_freeable_slots();
        if freeable > self.num_free_slots() {
            self.can_allocate(freeable, u64::MAX, 0);
        }
        self.get_freed_mm_hashes()
    }
}

/// The default encoder cache manager (vLLM v1 semantics, references per occurrence).
#[derive(Debug)]
pub struct EncoderCacheManager {
    capacity: u64,
    free: u64,
    freeable: u64,
    cached: HashMap<MmHash, Entry>,
    /// Unreferenced entries, least recently unreferenced first.
    unreferenced: LruCache<MmHash, u64>,
    freed: Vec<MmHash>,
    /// Per request: the occurrences (item index, hash) holding a reference.
    held: HashMap<RequestId, Vec<(usize, MmHash)>>,
    references: usize,
    peak_used: u64,
    hits: u64,
    misses: u64,
    allocations: u64,
    allocated_tokens: u64,
    evictions: u64,
    resets: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    size: u64,
    refs: u32,
}

impl EncoderCacheManager {
    /// An empty manager of `capacity` embedding tokens.
    pub fn new(capacity: u64) -> Self {
        EncoderCacheManager {
            capacity,
            free: capacity,
            freeable: capacity,
            cached: HashMap::new(),
            unreferenced: LruCache::unbounded(),
            freed: Vec::new(),
            held: HashMap::new(),
            references: 0,
            peak_used: 0,
            hits: 0,
            misses: 0,
            allocations: 0,
            allocated_tokens: 0,
            evictions: 0,
            resets: 0,
        }
    }

    /// The cached hashes and their sizes, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (&MmHash, u64)> {
        self.cached.iter().map(|(h, e)| (h, e.size))
    }

    /// The references an entry holds, or `None` when not cached.
    pub fn references(&self, hash: &str) -> Option<u32> {
        self.cached.get(hash).map(|e| e.refs)
    }

    /// Unreferenced hashes, earliest-unreferenced (next to evict) first.
    pub fn eviction_order(&self) -> Vec<MmHash> {
        self.unreferenced
            .iter()
            .rev()
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// Recounts everything from scratch and checks the invariants; describes the first one broken.
    pub fn verify(&self) -> Result<(), String> {
        let used: u64 = self.cached.values().map(|e| e.size).sum();
        let unreferenced: u64 = self.unreferenced.iter().map(|(_, s)| *s).sum();
        if self.free > self.freeable || self.freeable > self.capacity {
            return Err(format!(
                "free {} <= freeable {} <= capacity {} broken",
                self.free, self.freeable, self.capacity
            ));
        }
        if self.freeable != self.free + unreferenced {
            return Err(format!(
                "freeable {} != free {} + unreferenced {}",
                self.freeable, self.free, unreferenced
            ));
        }
        if self.free + used != self.capacity {
            return Err(format!(
                "free {} != capacity {} - cached {}",
                self.free, self.capacity, used
            ));
        }
        let mut counted: HashMap<&str, u32> = HashMap::new();
        for occurrences in self.held.values() {
            for (_, h) in occurrences {
                *counted.entry(h).or_default() += 1;
            }
        }
        let total: usize = self.held.values().map(Vec::len).sum();
        if total != self.references {
            return Err(format!(
                "references {} != occurrences held {total}",
                self.references
            ));
        }
        for (h, e) in &self.cached {
            let held = counted.get(&**h).copied().unwrap_or(0);
            if held != e.refs {
                return Err(format!("entry {h}: refs {} != occurrences {held}", e.refs));
            }
            if (e.refs == 0) != self.unreferenced.contains(h) {
                return Err(format!(
                    "entry {h}: refs {} but freeable membership {}",
                    e.refs,
                    self.unreferenced.contains(h)
                ));
            }
        }
        if counted.keys().any(|h| !self.cached.contains_key(*h)) {
            return Err("a reference to an entry that is not cached".to_owned());
        }
        if self.unreferenced.len() > self.cached.len() {
            return Err("freeable entries that are not cached".to_owned());
        }
        Ok(())
    }

    fn checked(&self) {
        #[cfg(debug_assertions)]
        if let Err(broken) = self.verify() {
            panic!("encoder cache manager invariant broken: {broken}");
        }
    }

    fn add_reference(&mut self, request: RequestId, index: usize, hash: &MmHash) {
        let Some(entry) = self.cached.get_mut(hash) else {
            return;
        };
        if entry.refs == 0 {
            self.unreferenced.pop(hash);
            self.freeable -= entry.size;
        }
        entry.refs += 1;
        self.references += 1;
        self.held
            .entry(request)
            .or_default()
            .push((index, hash.clone()));
    }

    fn drop_reference(&mut self, hash: &MmHash) {
        self.references -= 1;
        if let Some(entry) = self.cached.get_mut(hash) {
            entry.refs -= 1;
            if entry.refs == 0 {
                self.freeable += entry.size;
                self.unreferenced.push(hash.clone(), entry.size);
            }
        }
    }
}

impl EncoderCacheManagement for EncoderCacheManager {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn num_free_slots(&self) -> u64 {
        self.free
    }

    fn num_freeable_slots(&self) -> u64 {
        self.freeable
    }

    fn contains(&self, hash: &str) -> bool {
        self.cached.contains_key(hash)
    }

    fn holds(&self, request: RequestId, index: usize) -> bool {
        self.held
            .get(&request)
            .is_some_and(|v| v.iter().any(|(i, _)| *i == index))
    }

    fn check_and_update_cache(&mut self, request: RequestId, index: usize, hash: &MmHash) -> bool {
        if !self.cached.contains_key(hash) {
            self.misses += 1;
            return false;
        }
        if !self.holds(request, index) {
            self.hits += 1;
            self.add_reference(request, index, hash);
            self.checked();
        }
        true
    }

    fn can_allocate(&mut self, size: u64, compute_budget: u64, already_scheduled: u64) -> bool {
        if size > compute_budget {
            return false;
        }
        let need = size.saturating_add(already_scheduled);
        if need <= self.free {
            return true;
        }
        if need > self.freeable {
            return false;
        }
        while need > self.free {
            let Some((hash, size)) = self.unreferenced.pop_lru() else {
                // Unreachable while freeable == free + unreferenced (verified in debug builds).
                return false;
            };
            self.cached.remove(&hash);
            self.free += size;
            self.evictions += 1;
            self.freed.push(hash);
        }
        self.checked();
        true
    }

    fn allocate(
        &mut self,
        request: RequestId,
        index: usize,
        hash: &MmHash,
        size: u64,
    ) -> Result<(), EncoderCacheError> {
        if self.holds(request, index) {
            return Err(EncoderCacheError::AlreadyHeld { request, index });
        }
        if self.cached.contains_key(hash) {
            self.add_reference(request, index, hash);
            self.checked();
            return Ok(());
        }
        if size > self.free {
            return Err(EncoderCacheError::NoSpace {
                request,
                index,
                hash: hash.to_string(),
                size,
                free: self.free,
            });
        }
        // The first reference below takes the slots out of `freeable`.
        self.free -= size;
        self.cached.insert(hash.clone(), Entry { size, refs: 0 });
        self.add_reference(request, index, hash);
        self.allocations += 1;
        self.allocated_tokens += size;
        self.peak_used = self.peak_used.max(self.capacity - self.free);
        self.checked();
        Ok(())
    }

    fn free_encoder_input(&mut self, request: RequestId, index: usize) {
        let Some(occurrences) = self.held.get_mut(&request) else {
            return;
        };
        let Some(pos) = occurrences.iter().position(|(i, _)| *i == index) else {
            return;
        };
        let (_, hash) = occurrences.swap_remove(pos);
        if occurrences.is_empty() {
            self.held.remove(&request);
        }
        self.drop_reference(&hash);
        self.checked();
    }

    fn free(&mut self, request: RequestId) {
        let Some(occurrences) = self.held.remove(&request) else {
            return;
        };
        // Release in item order, so entries become freeable (and later evictable) in that order.
        let mut occurrences = occurrences;
        occurrences.sort_unstable_by_key(|(i, _)| *i);
        for (_, hash) in occurrences {
            self.drop_reference(&hash);
        }
        self.checked();
    }

    fn get_freed_mm_hashes(&mut self) -> Vec<MmHash> {
        // Eviction order, as vLLM reports it; an entry evicted twice in one step is reported once.
        let mut freed = std::mem::take(&mut self.freed);
        let mut seen = Vec::with_capacity(freed.len());
        freed.retain(|h| {
            let keep = !self.cached.contains_key(h) && !seen.contains(h);
            if keep {
                seen.push(h.clone());
            }
            keep
        });
        freed
    }

    fn reset(&mut self) -> EncoderCacheReset {
        let report = EncoderCacheReset {
            entries: self.cached.len(),
            tokens: self.capacity - self.free,
            references: self.references,
        };
        self.cached.clear();
        self.unreferenced.clear();
        self.freed.clear();
        self.held.clear();
        self.references = 0;
        self.free = self.capacity;
        self.freeable = self.capacity;
        self.resets += 1;
        self.checked();
        report
    }

    fn invalidate(&mut self, hash: &str) -> bool {
        let Some(entry) = self.cached.remove(hash) else {
            return false;
        };
        if entry.refs == 0 {
            self.unreferenced.pop(hash);
        } else {
            // Its slots were out of `freeable` while referenced.
            self.freeable += entry.size;
            for occurrences in self.held.values_mut() {
                let before = occurrences.len();
                occurrences.retain(|(_, h)| &**h != hash);
                self.references -= before - occurrences.len();
            }
            self.held.retain(|_, occurrences| !occurrences.is_empty());
        }
        self.free += entry.size;
        self.checked();
        true
    }

    fn stats(&self) -> EncoderCacheStats {
        EncoderCacheStats {
            capacity: self.capacity,
            free: self.free,
            freeable: self.freeable,
            entries: self.cached.len(),
            references: self.references,
            peak_used: self.peak_used,
            hits: self.hits,
            misses: self.misses,
            allocations: self.allocations,
            allocated_tokens: self.allocated_tokens,
            evictions: self.evictions,
            resets: self.resets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: RequestId = RequestId(1);
    const B: RequestId = RequestId(2);

    fn h(s: &str) -> MmHash {
        s.into()
    }

    fn slots(m: &EncoderCacheManager) -> (u64, u64) {
        (m.num_free_slots(), m.num_freeable_slots())
    }

    #[test]
    fn sharing_across_requests() {
        let mut m = EncoderCacheManager::new(1000);
        let x = h("x");
        assert!(!m.check_and_update_cache(A, 0, &x));
        assert!(m.can_allocate(300, 1000, 0));
        m.allocate(A, 0, &x, 300).unwrap();
        assert_eq!(slots(&m), (700, 700));
        assert!(m.check_and_update_cache(B, 2, &x));
        assert_eq!(m.references("x"), Some(2));
        assert_eq!(slots(&m), (700, 700));
        m.free(A);
        assert_eq!(m.references("x"), Some(1));
        assert_eq!(slots(&m), (700, 700));
        m.free(B);
        assert_eq!(m.references("x"), Some(0));
        assert_eq!(slots(&m), (700, 1000));
        // Still reusable while unreferenced; a hit takes it out of the freeable set.
        assert!(m.check_and_update_cache(B, 0, &x));
        assert_eq!(slots(&m), (700, 700));
        let s = m.stats();
        assert_eq!(
            (s.hits, s.misses, s.allocations, s.allocated_tokens),
            (2, 1, 1, 300)
        );
    }

    #[test]
    fn same_image_twice_in_one_request_holds_two_references() {
        let mut m = EncoderCacheManager::new(1000);
        let x = h("x");
        m.allocate(A, 0, &x, 400).unwrap();
        assert!(m.check_and_update_cache(A, 1, &x));
        assert_eq!(m.references("x"), Some(2));
        // Asking again for an occurrence that already holds a reference changes nothing.
        assert!(m.check_and_update_cache(A, 1, &x));
        assert_eq!(m.references("x"), Some(2));
        m.free_encoder_input(A, 0);
        assert_eq!(m.references("x"), Some(1));
        assert_eq!(
            slots(&m),
            (600, 600),
            "first occurrence freed, entry still held"
        );
        m.free_encoder_input(A, 0); // already released: no effect
        assert_eq!(m.references("x"), Some(1));
        m.free_encoder_input(A, 1);
        assert_eq!(slots(&m), (600, 1000));
    }

    #[test]
    fn invalidate_drops_the_entry_and_every_reference_to_it() {
        let mut m = EncoderCacheManager::new(1000);
        let (x, y) = (h("x"), h("y"));
        m.allocate(A, 0, &x, 300).unwrap();
        assert!(m.check_and_update_cache(A, 1, &x));
        assert!(m.check_and_update_cache(B, 0, &x));
        m.allocate(B, 1, &y, 200).unwrap();
        assert_eq!(slots(&m), (500, 500));
        assert!(m.invalidate("x"));
        assert!(!m.contains("x") && !m.holds(A, 0) && !m.holds(A, 1) && !m.holds(B, 0));
        assert_eq!(
            m.references("y"),
            Some(1),
            "other entries keep their references"
        );
        assert_eq!(slots(&m), (800, 800));
        assert_eq!(m.stats().references, 1);
        assert!(!m.invalidate("x"), "already gone");
        // Releasing the requests afterwards changes nothing for `x`.
        m.free(A);
        m.free(B);
        assert_eq!(slots(&m), (800, 1000));
        // An unreferenced entry leaves the eviction order too.
        assert!(m.invalidate("y"));
        assert!(m.eviction_order().is_empty());
        assert_eq!(slots(&m), (1000, 1000));
        m.verify().unwrap();
        // Nothing invalidated is reported as freed: the caller frees the device side itself.
        assert!(m.get_freed_mm_hashes().is_empty());
    }

    #[test]
    fn evict_unreferenced_keeps_referenced_entries() {
        let mut m = EncoderCacheManager::new(1000);
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            m.allocate(A, i, &h(name), 100).unwrap();
        }
        m.allocate(B, 0, &h("d"), 100).unwrap();
        assert!(
            m.evict_unreferenced().is_empty(),
            "everything is referenced"
        );
        m.free_encoder_input(A, 2);
        m.free(B);
        let evicted = m.evict_unreferenced();
        assert_eq!(evicted, vec![h("c"), h("d")]);
        assert!(m.contains("a") && m.contains("b"));
        assert_eq!(slots(&m), (800, 800));
        assert_eq!(m.stats().evictions, 2);
        m.verify().unwrap();
    }

    #[test]
    fn eviction_takes_earliest_unreferenced_first() {
        let mut m = EncoderCacheManager::new(300);
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            m.allocate(A, i, &h(name), 100).unwrap();
        }
        // Unreferenced in the order b, a, c.
        m.free_encoder_input(A, 1);
        m.free_encoder_input(A, 0);
        m.free_encoder_input(A, 2);
        assert_eq!(m.eviction_order(), vec![h("b"), h("a"), h("c")]);
        assert_eq!(slots(&m), (0, 300));
        assert!(m.can_allocate(150, 1000, 0));
        assert!(!m.contains("b") && !m.contains("a") && m.contains("c"));
        assert_eq!(slots(&m), (200, 300));
        // In eviction order, as vLLM reports them.
        assert_eq!(m.get_freed_mm_hashes(), vec![h("b"), h("a")]);
        assert!(m.get_freed_mm_hashes().is_empty());
        assert_eq!(m.stats().evictions, 2);
    }

    #[test]
    fn same_step_reallocation_is_not_reported_freed() {
        let mut m = EncoderCacheManager::new(100);
        m.allocate(A, 0, &h("x"), 100).unwrap();
        m.free(A);
        // B needs y: x is evicted.
        assert!(m.can_allocate(100, 100, 0));
        m.allocate(B, 0, &h("y"), 100).unwrap();
        m.free(B);
        // In the same step, A needs x again: y is evicted and x re-allocated.
        assert!(m.can_allocate(100, 100, 0));
        m.allocate(A, 0, &h("x"), 100).unwrap();
        assert_eq!(m.get_freed_mm_hashes(), vec![h("y")]);
    }

    #[test]
    fn compute_limit_refusal() {
        let mut m = EncoderCacheManager::new(1000);
        assert!(!m.can_allocate(501, 500, 0));
        assert!(m.can_allocate(500, 500, 0));
        assert_eq!(slots(&m), (1000, 1000));
    }

    #[test]
    fn space_limit_refusal_and_already_scheduled() {
        let mut m = EncoderCacheManager::new(1000);
        m.allocate(A, 0, &h("x"), 600).unwrap();
        assert!(m.can_allocate(400, 1000, 0));
        assert!(!m.can_allocate(401, 1000, 0));
        // 300 already scheduled this step (not yet allocated) counts against the free slots.
        assert!(!m.can_allocate(200, 1000, 300));
        assert!(m.can_allocate(100, 1000, 300));
        // Referenced entries are never evicted to make room.
        assert!(!m.can_allocate(1000, 1000, 0));
        assert!(m.contains("x"));
        assert_eq!(m.stats().evictions, 0);
        // allocate without room is an error, not a panic or an underflow.
        assert!(matches!(
            m.allocate(B, 0, &h("y"), 401),
            Err(EncoderCacheError::NoSpace {
                size: 401,
                free: 400,
                ..
            })
        ));
        assert!(matches!(
            m.allocate(A, 0, &h("z"), 1),
            Err(EncoderCacheError::AlreadyHeld { .. })
        ));
    }

    #[test]
    fn reset_returns_everything() {
        let mut m = EncoderCacheManager::new(1000);
        m.allocate(A, 0, &h("x"), 600).unwrap();
        m.allocate(B, 0, &h("y"), 100).unwrap();
        m.free(B);
        let r = m.reset();
        assert_eq!(
            r,
            EncoderCacheReset {
                entries: 2,
                tokens: 700,
                references: 1
            }
        );
        assert_eq!(slots(&m), (1000, 1000));
        assert_eq!(m.stats().entries, 0);
        assert!(!m.holds(A, 0));
        // Releasing what the reset already dropped is harmless.
        m.free(A);
        m.free_encoder_input(B, 0);
        assert_eq!(slots(&m), (1000, 1000));
        assert!(m.get_freed_mm_hashes().is_empty());
    }

    #[test]
    fn allocating_a_cached_hash_takes_a_reference() {
        let mut m = EncoderCacheManager::new(1000);
        m.allocate(A, 0, &h("x"), 600).unwrap();
        m.allocate(B, 0, &h("x"), 600).unwrap();
        assert_eq!(m.references("x"), Some(2));
        assert_eq!(slots(&m), (400, 400));
        assert_eq!(m.stats().allocations, 1);
    }
}
