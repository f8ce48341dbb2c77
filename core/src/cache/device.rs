//! The device encoder cache: encoder outputs kept on the device, keyed by the item hash
//! (vLLM's model-runner `encoder_cache: dict[mm_hash, Tensor]`).
//!
//! Entries hold [`DeviceBuffer`]s from the caching allocator, so dropping an entry returns its
//! blocks to the allocator's cache; [`crate::memory::CachingAllocator::empty_cache`] then gives
//! them back to the device. The cache frees entries when the encoder cache manager reports
//! hashes as evicted ([`DeviceEncoderCache::free_hashes`]) and on [`DeviceEncoderCache::reset`].
//!
//! A lookup of a hash that is not here is a [`CacheMiss`], a value and not a panic: after a
//! reset during in-flight requests the engine re-encodes the item instead of crashing (the
//! "encoder cache miss" failure of vLLM that iris designs out).

use std::collections::HashMap;

use iris_plugin::{DType, MatRef};
use thiserror::Error;

use crate::memory::DeviceBuffer;

/// One item's encoder output: `tokens x hidden` embeddings of `dtype` in `buffer`, and for
/// models with deepstack mergers (Qwen3-VL) one more buffer of the same shape per deepstack
/// layer.
#[derive(Debug)]
pub struct Entry {
    /// The merged embeddings, `[tokens, hidden]`.
    pub buffer: DeviceBuffer,
    /// Deepstack outputs, each `[tokens, hidden]`, in layer order (empty for other models).
    pub deepstack: Vec<DeviceBuffer>,
    /// Embedding rows.
    pub tokens: u64,
    /// Embedding width.
    pub hidden: u64,
    /// Element type.
    pub dtype: DType,
}

impl Entry {
    /// An entry without deepstack outputs.
    pub fn new(buffer: DeviceBuffer, tokens: u64, hidden: u64, dtype: DType) -> Entry {
        Entry {
            buffer,
            deepstack: Vec::new(),
            tokens,
            hidden,
            dtype,
        }
    }

    /// Adds deepstack outputs.
    pub fn with_deepstack(mut self, deepstack: Vec<DeviceBuffer>) -> Entry {
        self.deepstack = deepstack;
        self
    }

    /// The merged embeddings as a `[tokens, hidden]` view.
    pub fn embeddings(&self) -> MatRef {
        self.buffer.mat(self.dtype, self.tokens, self.hidden)
    }

    /// Deepstack output `index` as a `[tokens, hidden]` view, if there is one.
    pub fn deepstack_embeddings(&self, index: usize) -> Option<MatRef> {
        self.deepstack
            .get(index)
            .map(|buffer| buffer.mat(self.dtype, self.tokens, self.hidden))
    }

    /// Device bytes the entry holds (sum of its blocks' capacities).
    pub fn bytes(&self) -> u64 {
        self.buffer.capacity()
            + self
                .deepstack
                .iter()
                .map(DeviceBuffer::capacity)
                .sum::<u64>()
    }
}

/// A lookup of a hash the device cache does not hold. The engine handles it by re-encoding the
/// item.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("encoder cache miss: no device output for item `{hash}`; it must be encoded again")]
#[non_exhaustive]
pub struct CacheMiss {
    /// The item hash looked up.
    pub hash: String,
}

/// Encoder outputs on the device, by item hash.
#[derive(Debug, Default)]
pub struct DeviceEncoderCache {
    entries: HashMap<String, Entry>,
    bytes: u64,
    unknown_frees: u64,
}

impl DeviceEncoderCache {
    /// An empty cache.
    pub fn new() -> DeviceEncoderCache {
        DeviceEncoderCache::default()
    }

    /// Stores `entry` under `hash`; an entry already there is dropped (its blocks return to
    /// the allocator). Returns the bytes of the replaced entry, 0 if there was none.
    pub fn insert(&mut self, hash: impl Into<String>, entry: Entry) -> u64 {
        self.bytes += entry.bytes();
        match self.entries.insert(hash.into(), entry) {
            Some(old) => {
                let freed = old.bytes();
                self.bytes -= freed;
                freed
            }
            None => 0,
        }
    }

    /// The entry for `hash`, or a [`CacheMiss`].
    pub fn get(&self, hash: &str) -> Result<&Entry, CacheMiss> {
        self.entries.get(hash).ok_or_else(|| CacheMiss {
            hash: hash.to_owned(),
        })
    }

    /// Whether `hash` has an entry.
    pub fn contains(&self, hash: &str) -> bool {
        self.entries.contains_key(hash)
    }

    /// Removes and returns the entry for `hash` (its blocks return to the allocator when the
    /// caller drops it).
    pub fn remove(&mut self, hash: &str) -> Option<Entry> {
        let entry = self.entries.remove(hash)?;
        self.bytes -= entry.bytes();
        Some(entry)
    }

    /// Drops the entries of `hashes` (the manager's evicted hashes); returns the bytes
    /// released. Hashes without an entry are ignored and counted in
    /// [`DeviceEncoderCache::unknown_frees`].
    pub fn free_hashes<S: AsRef<str>>(&mut self, hashes: &[S]) -> u64 {
        let mut released = 0;
        for hash in hashes {
            match self.remove(hash.as_ref()) {
                Some(entry) => released += entry.bytes(),
                None => self.unknown_frees += 1,
            }
        }
        released
    }

    /// Drops every entry; returns the bytes released.
    pub fn reset(&mut self) -> u64 {
        let released = self.bytes;
        self.entries.clear();
        self.bytes = 0;
        released
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Device bytes held (sum of the entries' block capacities).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The hashes held, in no particular order.
    pub fn hashes(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// How many hashes [`DeviceEncoderCache::free_hashes`] was asked to free that had no entry.
    pub fn unknown_frees(&self) -> u64 {
        self.unknown_frees
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::memory::CachingAllocator;

    fn allocator() -> Arc<CachingAllocator> {
        crate::test_support::cpu_allocator("64MiB")
    }

    fn entry(allocator: &Arc<CachingAllocator>, tokens: u64, hidden: u64) -> Entry {
        let buffer = allocator.alloc(tokens * hidden * 4).unwrap();
        Entry::new(buffer, tokens, hidden, DType::F32)
    }

    #[test]
    fn insert_get_and_miss() {
        let allocator = allocator();
        let mut cache = DeviceEncoderCache::new();
        let e = entry(&allocator, 4, 8);
        e.buffer.write_f32(&[1.5; 32]).unwrap();
        assert_eq!(cache.insert("a", e), 0);
        assert!(cache.contains("a"));
        let got = cache.get("a").unwrap();
        assert_eq!((got.tokens, got.hidden, got.dtype), (4, 8, DType::F32));
        assert_eq!(got.buffer.read_f32().unwrap(), vec![1.5; 32]);
        let view = got.embeddings();
        assert_eq!((view.rows, view.cols, view.row_stride), (4, 8, 8));
        let miss = cache.get("b").unwrap_err();
        assert_eq!(miss.hash, "b");
        assert!(miss.to_string().contains("`b`"), "{miss}");
    }

    #[test]
    fn replacing_an_entry_frees_the_old_one() {
        let allocator = allocator();
        let mut cache = DeviceEncoderCache::new();
        cache.insert("a", entry(&allocator, 4, 256));
        assert_eq!(allocator.stats().allocated, 4096);
        assert_eq!(cache.insert("a", entry(&allocator, 2, 256)), 4096);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.bytes(), 2048);
        assert_eq!(allocator.stats().allocated, 2048);
    }

    #[test]
    fn deepstack_buffers_are_counted_and_freed() {
        let allocator = allocator();
        let mut cache = DeviceEncoderCache::new();
        let deepstack = (0..3)
            .map(|_| allocator.alloc(16 * 64 * 2).unwrap())
            .collect();
        let main = allocator.alloc(16 * 64 * 2).unwrap();
        let e = Entry::new(main, 16, 64, DType::BF16).with_deepstack(deepstack);
        assert_eq!(e.bytes(), 4 * 2048);
        assert!(e.deepstack_embeddings(2).is_some());
        assert!(e.deepstack_embeddings(3).is_none());
        cache.insert("q3", e);
        assert_eq!(cache.bytes(), 4 * 2048);
        assert_eq!(allocator.stats().live_buffers, 4);
        assert_eq!(cache.free_hashes(&["q3"]), 4 * 2048);
        assert_eq!(allocator.stats().live_buffers, 0);
    }

    #[test]
    fn free_hashes_ignores_and_counts_unknown_hashes() {
        let allocator = allocator();
        let mut cache = DeviceEncoderCache::new();
        cache.insert("a", entry(&allocator, 1, 256));
        cache.insert("b", entry(&allocator, 1, 512));
        let released = cache.free_hashes(&["a".to_owned(), "zz".to_owned(), "a".to_owned()]);
        assert_eq!(released, 1024);
        assert_eq!(cache.unknown_frees(), 2);
        assert_eq!(cache.hashes(), vec!["b".to_owned()]);
        assert_eq!(cache.bytes(), 2048);
        assert_eq!(allocator.stats().allocated, 2048);
    }

    #[test]
    fn reset_drops_everything_and_the_allocator_can_give_it_back() {
        let allocator = allocator();
        let start = allocator.device().mem_info().unwrap().free;
        let mut cache = DeviceEncoderCache::new();
        for (i, tokens) in [1u64, 7, 300, 2000].into_iter().enumerate() {
            cache.insert(format!("h{i}"), entry(&allocator, tokens, 1024));
        }
        let held = cache.bytes();
        assert_eq!(held, allocator.stats().allocated);
        assert_eq!(cache.reset(), held);
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
        assert_eq!(allocator.stats().allocated, 0);
        assert!(allocator.stats().reserved > 0, "blocks stay cached");
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.device().mem_info().unwrap().free, start);
        assert!(matches!(cache.get("h0"), Err(CacheMiss { .. })));
    }
}
