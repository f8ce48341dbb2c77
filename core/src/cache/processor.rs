//! The processor cache: preprocessed multimodal inputs kept by item hash, bounded in bytes.
//!
//! Preprocessing an image (decode, resize, normalise, patchify) costs far more than looking up its
//! hash, so a repeated image reuses the preprocessed payload. Three forms share one byte-bounded
//! LRU ([`ProcessorCache`]):
//!
//! - [`ProcessorCache`] on its own, when preprocessing and the engine share a process;
//! - a mirrored pair, when a frontend preprocesses and an engine consumes: the
//!   [`ProcessorCacheSender`] keeps only sizes and decides whether a payload must travel, the
//!   [`ProcessorCacheReceiver`] keeps the payloads. Fed the same sequence of items, both evict the
//!   same keys in the same order, so the sender knows what the receiver holds without asking.
//!
//! Keeping the two sides identical is a protocol, and protocols break: a receiver asked for a
//! payload it should hold but does not returns [`ProcessorCacheError::Desync`], never a panic. The
//! commonest way to break it is clearing one side only (vLLM's `reset_mm_cache` bug class). Every
//! [`MirroredItem`] carries the sender's *epoch*, the number of times the sender has been cleared;
//! the receiver counts its own clears and refuses an item from a different epoch with
//! [`ProcessorCacheError::EpochMismatch`]. A coordinated reset clears both sides, which moves
//! both epochs together.
//!
//! A capacity of 0 bytes disables caching (`mm_processor_cache_gb = 0`): every lookup misses and
//! every payload is sent. A payload larger than the whole capacity is never stored, on either side.
//!
//! ```
//! use iris_core::cache::processor::{ProcessorCacheReceiver, ProcessorCacheSender};
//!
//! let mut sender = ProcessorCacheSender::new(1024);
//! let mut receiver = ProcessorCacheReceiver::<Vec<u8>>::new(1024);
//!
//! // First sight of the image: the payload travels and both sides record it.
//! let item = sender.prepare("img-a", Some(vec![7u8; 100])).unwrap();
//! assert!(item.payload.is_some());
//! assert_eq!(receiver.receive(item).unwrap(), vec![7u8; 100]);
//!
//! // Second sight: the frontend need not even preprocess; nothing travels.
//! assert!(sender.is_cached("img-a"));
//! let item = sender.prepare::<Vec<u8>>("img-a", None).unwrap();
//! assert!(item.payload.is_none());
//! assert_eq!(receiver.receive(item).unwrap().len(), 100);
//! ```

use std::sync::Arc;

use lru::LruCache;
use thiserror::Error;

/// Bytes in one GiB, the unit of `mm_processor_cache_gb` (vLLM multiplies by `GiB_bytes`).
pub const GIB: u64 = 1 << 30;

/// The size in bytes that a payload occupies in the cache.
pub trait PayloadSize {
    /// The payload's size in bytes (for tensors: the sum of their data sizes).
    fn payload_bytes(&self) -> u64;
}

impl PayloadSize for Vec<u8> {
    fn payload_bytes(&self) -> u64 {
        slice_bytes(self)
    }
}

impl PayloadSize for Vec<f32> {
    fn payload_bytes(&self) -> u64 {
        slice_bytes(self)
    }
}

impl PayloadSize for Vec<u16> {
    fn payload_bytes(&self) -> u64 {
        slice_bytes(self)
    }
}

impl<T: PayloadSize + ?Sized> PayloadSize for Arc<T> {
    fn payload_bytes(&self) -> u64 {
        (**self).payload_bytes()
    }
}

impl<T: PayloadSize + ?Sized> PayloadSize for Box<T> {
    fn payload_bytes(&self) -> u64 {
        (**self).payload_bytes()
    }
}

/// Errors of the processor caches.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProcessorCacheError {
    /// `mm_processor_cache_gb` was negative or not a number.
    #[error("mm_processor_cache_gb must be a finite number >= 0, got {gib}")]
    InvalidCapacity {
        /// The value given.
        gib: String,
    },
    /// The sender was asked about an item it does not hold and given no payload to send.
    #[error(
        "processor cache sender: item {hash} is not cached on the receiver, so its payload must be sent, but none was given"
    )]
    PayloadRequired {
        /// The item hash.
        hash: String,
    },
    /// The receiver was told it holds an item that it does not: the two sides diverged.
    #[error(
        "processor cache desynchronised: the sender expects the receiver to hold item {hash}, but it does not (receiver holds {receiver_entries} entries, {receiver_bytes} bytes)"
    )]
    Desync {
        /// The item hash.
        hash: String,
        /// Entries the receiver holds.
        receiver_entries: usize,
        /// Bytes the receiver holds.
        receiver_bytes: u64,
    },
    /// The sender and the receiver have been cleared a different number of times.
    #[error(
        "processor cache desynchronised: sender epoch {sender_epoch} (times cleared) differs from receiver epoch {receiver_epoch}; clear both sides together"
    )]
    EpochMismatch {
        /// The sender's epoch carried by the item.
        sender_epoch: u64,
        /// The receiver's epoch.
        receiver_epoch: u64,
    },
    /// The payload's own size differs from the size the sender recorded.
    #[error(
        "processor cache desynchronised: item {hash} was recorded by the sender as {sender_bytes} bytes but its payload is {payload_bytes} bytes"
    )]
    SizeMismatch {
        /// The item hash.
        hash: String,
        /// The size the sender recorded.
        sender_bytes: u64,
        /// The payload's size.
        payload_bytes: u64,
    },
}

/// Counters of a processor cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessorCacheStats {
    /// Lookups that found the item.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Entries removed to make room.
    pub evictions: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes held now.
    pub bytes: u64,
    /// The byte bound.
    pub capacity: u64,
}

/// A byte-bounded LRU of payloads keyed by item hash.
#[derive(Debug)]
pub struct ProcessorCache<T> {
    entries: LruCache<String, (T, u64)>,
    capacity: u64,
    bytes: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl<T> ProcessorCache<T> {
    /// An empty cache bounded to `capacity` bytes (0 disables it).
    pub fn new(capacity: u64) -> Self {
        ProcessorCache {
            entries: LruCache::unbounded(),
            capacity,
            bytes: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// An empty cache bounded to `gib` GiB, as `mm_processor_cache_gb` gives it.
    pub fn with_gib(gib: f64) -> Result<Self, ProcessorCacheError> {
        Ok(Self::new(gib_to_bytes(gib)?))
    }

    /// The byte bound.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether the cache stores anything at all.
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Whether `hash` is held; neither counts as a lookup nor changes the LRU order.
    pub fn contains(&self, hash: &str) -> bool {
        self.entries.contains(hash)
    }

    /// Looks `hash` up, counting a hit or a miss and making a hit the most recently used.
    pub fn get(&mut self, hash: &str) -> Option<&T> {
        match self.entries.get(hash) {
            Some((payload, _)) => {
                self.hits += 1;
                Some(payload)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Stores `payload` under `hash` with the given size, evicting least recently used entries
    /// until it fits. Returns whether it was stored: a payload larger than the capacity is not.
    /// Replacing an existing key counts as neither hit nor miss.
    pub fn insert_sized(&mut self, hash: impl Into<String>, payload: T, bytes: u64) -> bool {
        let hash = hash.into();
        if let Some((_, old)) = self.entries.pop(hash.as_str()) {
            self.bytes -= old;
        }
        if bytes > self.capacity {
            return false;
        }
        while self.bytes + bytes > self.capacity {
            match self.entries.pop_lru() {
                Some((_, (_, size))) => {
                    self.bytes -= size;
                    self.evictions += 1;
                }
                // Unreachable: bytes > 0 implies an entry, and bytes <= capacity was checked.
                None => break,
            }
        }
        self.bytes += bytes;
        self.entries.push(hash, (payload, bytes));
        true
    }

    /// Removes everything; returns the bytes released. Counters of hits, misses and evictions
    /// are kept (they describe the cache's history, not its contents).
    pub fn clear(&mut self) -> u64 {
        let released = self.bytes;
        self.entries.clear();
        self.bytes = 0;
        released
    }

    /// Current counters.
    pub fn stats(&self) -> ProcessorCacheStats {
        ProcessorCacheStats {
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            entries: self.entries.len(),
            bytes: self.bytes,
            capacity: self.capacity,
        }
    }
}

impl<T: PayloadSize> ProcessorCache<T> {
    /// Stores `payload` under `hash`, sized by [`PayloadSize`]; see [`ProcessorCache::insert_sized`].
    pub fn insert(&mut self, hash: impl Into<String>, payload: T) -> bool {
        let bytes = payload.payload_bytes();
        self.insert_sized(hash, payload, bytes)
    }
}

/// One item on its way from the sender to the receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirroredItem<T> {
    /// The item hash.
    pub hash: String,
    /// The payload's size as the sender recorded it.
    pub bytes: u64,
    /// The sender's epoch (times it has been cleared).
    pub epoch: u64,
    /// The payload, or `None` when the receiver already holds it.
    pub payload: Option<T>,
}

/// The frontend side of a mirrored processor cache: sizes only.
#[derive(Debug)]
pub struct ProcessorCacheSender {
    sizes: ProcessorCache<()>,
    epoch: u64,
}

impl ProcessorCacheSender {
    /// A sender mirroring a receiver of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        ProcessorCacheSender {
            sizes: ProcessorCache::new(capacity),
            epoch: 0,
        }
    }

    /// Whether the receiver holds `hash` (no LRU update): when it does, the frontend may skip
    /// preprocessing and call [`ProcessorCacheSender::prepare`] with no payload.
    pub fn is_cached(&self, hash: &str) -> bool {
        self.sizes.contains(hash)
    }

    /// Records one occurrence of `hash` and returns what to send. On a hit the payload (if any)
    /// is dropped; on a miss it is required and travels. Both sides must see the same sequence of
    /// items for their LRU orders to stay identical.
    pub fn prepare<T: PayloadSize>(
        &mut self,
        hash: &str,
        payload: Option<T>,
    ) -> Result<MirroredItem<T>, ProcessorCacheError> {
        if self.sizes.get(hash).is_some() {
            let bytes = self.sizes.entries.peek(hash).map_or(0, |(_, b)| *b);
            return Ok(MirroredItem {
                hash: hash.to_owned(),
                bytes,
                epoch: self.epoch,
                payload: None,
            });
        }
        let Some(payload) = payload else {
            return Err(ProcessorCacheError::PayloadRequired {
                hash: hash.to_owned(),
            });
        };
        let bytes = payload.payload_bytes();
        self.sizes.insert_sized(hash, (), bytes);
        Ok(MirroredItem {
            hash: hash.to_owned(),
            bytes,
            epoch: self.epoch,
            payload: Some(payload),
        })
    }

    /// Clears the sender; returns the bytes the receiver will release when it is cleared too.
    /// Moves the epoch on: the receiver must be cleared as well before the next item.
    pub fn clear(&mut self) -> u64 {
        self.epoch += 1;
        self.sizes.clear()
    }

    /// Times the sender has been cleared.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Current counters (bytes are the receiver's bytes as the sender accounts them).
    pub fn stats(&self) -> ProcessorCacheStats {
        self.sizes.stats()
    }
}

/// The engine side of a mirrored processor cache: the payloads.
#[derive(Debug)]
pub struct ProcessorCacheReceiver<T> {
    cache: ProcessorCache<T>,
    epoch: u64,
}

impl<T: Clone + PayloadSize> ProcessorCacheReceiver<T> {
    /// A receiver of `capacity` bytes (the sender's capacity).
    pub fn new(capacity: u64) -> Self {
        ProcessorCacheReceiver {
            cache: ProcessorCache::new(capacity),
            epoch: 0,
        }
    }

    /// Takes one item from the sender and returns its payload: the one carried, stored for next
    /// time, or the one held. Payloads are cloned out, so large tensors belong in an `Arc`.
    pub fn receive(&mut self, item: MirroredItem<T>) -> Result<T, ProcessorCacheError> {
        if item.epoch != self.epoch {
            return Err(ProcessorCacheError::EpochMismatch {
                sender_epoch: item.epoch,
                receiver_epoch: self.epoch,
            });
        }
        match item.payload {
            Some(payload) => {
                let payload_bytes = payload.payload_bytes();
                if payload_bytes != item.bytes {
                    return Err(ProcessorCacheError::SizeMismatch {
                        hash: item.hash,
                        sender_bytes: item.bytes,
                        payload_bytes,
                    });
                }
                // Counted as a miss so both sides' counters agree.
                self.cache.misses += 1;
                self.cache
                    .insert_sized(item.hash, payload.clone(), item.bytes);
                Ok(payload)
            }
            None => match self.cache.get(&item.hash) {
                Some(payload) => Ok(payload.clone()),
                None => {
                    // The lookup above counted a miss the sender did not; undo it.
                    self.cache.misses -= 1;
                    Err(ProcessorCacheError::Desync {
                        receiver_entries: self.cache.entries.len(),
                        receiver_bytes: self.cache.bytes,
                        hash: item.hash,
                    })
                }
            },
        }
    }

    /// Clears the receiver; returns the bytes released. Moves the epoch on, matching a sender
    /// cleared at the same time.
    pub fn clear(&mut self) -> u64 {
        self.epoch += 1;
        self.cache.clear()
    }

    /// Clears the receiver and adopts `epoch`, the epoch of a sender cleared at the same time:
    /// the recovery after an [`ProcessorCacheError::EpochMismatch`] or a
    /// [`ProcessorCacheError::Desync`]. Returns the bytes released.
    pub fn clear_to(&mut self, epoch: u64) -> u64 {
        self.epoch = epoch;
        self.cache.clear()
    }

    /// The receiver's epoch (times cleared, or the epoch adopted by `clear_to`).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether the receiver holds `hash` (no LRU update).
    pub fn contains(&self, hash: &str) -> bool {
        self.cache.contains(hash)
    }

    /// Current counters.
    pub fn stats(&self) -> ProcessorCacheStats {
        self.cache.stats()
    }
}

fn slice_bytes<E>(s: &[E]) -> u64 {
    u64::try_from(std::mem::size_of_val(s)).unwrap_or(u64::MAX)
}

fn gib_to_bytes(gib: f64) -> Result<u64, ProcessorCacheError> {
    if !gib.is_finite() || gib < 0.0 {
        return Err(ProcessorCacheError::InvalidCapacity {
            gib: gib.to_string(),
        });
    }
    // f64 has 52 bits of mantissa: exact for any practical GiB count; saturate beyond u64.
    let bytes = (gib * 1024.0 * 1024.0 * 1024.0).floor();
    if bytes >= 18_446_744_073_709_551_615.0 {
        return Ok(u64::MAX);
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    // In range and non-negative: checked above.
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(n: usize) -> Vec<u8> {
        vec![1u8; n]
    }

    #[test]
    fn lru_bounded_in_bytes_with_stats() {
        let mut c = ProcessorCache::new(100);
        assert!(c.insert("a", payload(40)));
        assert!(c.insert("b", payload(40)));
        assert!(c.get("a").is_some()); // a is now most recent
        assert!(c.insert("c", payload(40))); // evicts b
        assert!(c.contains("a") && !c.contains("b") && c.contains("c"));
        assert!(c.get("b").is_none());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.evictions), (1, 1, 1));
        assert_eq!((s.entries, s.bytes), (2, 80));
        assert_eq!(c.clear(), 80);
        assert_eq!(c.stats().bytes, 0);
        assert_eq!(c.clear(), 0);
    }

    #[test]
    fn oversized_payload_is_not_stored_and_keeps_others() {
        let mut c = ProcessorCache::new(100);
        c.insert("a", payload(60));
        assert!(!c.insert("big", payload(101)));
        assert!(c.contains("a"));
        assert_eq!(c.stats().evictions, 0);
    }

    #[test]
    fn replacing_a_key_updates_bytes() {
        let mut c = ProcessorCache::new(100);
        c.insert("a", payload(60));
        c.insert("a", payload(30));
        assert_eq!(c.stats().bytes, 30);
        assert_eq!(c.stats().entries, 1);
    }

    #[test]
    fn zero_capacity_disables() {
        let mut c = ProcessorCache::with_gib(0.0).unwrap();
        assert!(!c.is_enabled());
        assert!(!c.insert("a", payload(1)));
        assert!(c.get("a").is_none());
        let mut s = ProcessorCacheSender::new(0);
        let mut r = ProcessorCacheReceiver::new(0);
        for _ in 0..2 {
            let item = s.prepare("a", Some(payload(5))).unwrap();
            assert!(item.payload.is_some());
            assert_eq!(r.receive(item).unwrap().len(), 5);
        }
    }

    #[test]
    fn gib_conversion() {
        assert_eq!(
            ProcessorCache::<Vec<u8>>::with_gib(4.0).unwrap().capacity(),
            4 * GIB
        );
        assert_eq!(
            ProcessorCache::<Vec<u8>>::with_gib(0.5).unwrap().capacity(),
            GIB / 2
        );
        assert!(matches!(
            ProcessorCache::<Vec<u8>>::with_gib(-1.0),
            Err(ProcessorCacheError::InvalidCapacity { .. })
        ));
        assert!(ProcessorCache::<Vec<u8>>::with_gib(f64::NAN).is_err());
    }

    #[test]
    fn mirrored_pair_evicts_identically() {
        let mut s = ProcessorCacheSender::new(100);
        let mut r = ProcessorCacheReceiver::new(100);
        // A sequence with reuse and eviction pressure.
        let seq = [
            ("a", 40),
            ("b", 30),
            ("a", 40),
            ("c", 50),
            ("b", 30),
            ("d", 20),
            ("a", 40),
            ("e", 90),
            ("d", 20),
        ];
        for (hash, n) in seq {
            let pay = if s.is_cached(hash) {
                None
            } else {
                Some(payload(n))
            };
            let item = s.prepare(hash, pay).unwrap();
            assert_eq!(r.receive(item).unwrap().len(), n);
            for key in ["a", "b", "c", "d", "e"] {
                assert_eq!(s.is_cached(key), r.contains(key), "after {hash}: key {key}");
            }
            assert_eq!(s.stats(), r.stats());
        }
    }

    #[test]
    fn receiver_missing_payload_is_a_desync_error() {
        let mut s = ProcessorCacheSender::new(100);
        let mut r = ProcessorCacheReceiver::<Vec<u8>>::new(100);
        s.prepare("a", Some(payload(10))).unwrap(); // never delivered
        let item = s.prepare::<Vec<u8>>("a", None).unwrap();
        assert!(matches!(
            r.receive(item),
            Err(ProcessorCacheError::Desync { ref hash, .. }) if hash == "a"
        ));
        assert_eq!(r.stats().misses, 0);
    }

    #[test]
    fn clearing_one_side_is_detected() {
        let mut s = ProcessorCacheSender::new(100);
        let mut r = ProcessorCacheReceiver::new(100);
        r.receive(s.prepare("a", Some(payload(10))).unwrap())
            .unwrap();

        // Only the receiver is cleared: the sender would otherwise skip "a".
        assert_eq!(r.clear(), 10);
        let err = r
            .receive(s.prepare::<Vec<u8>>("a", None).unwrap())
            .unwrap_err();
        assert_eq!(
            err,
            ProcessorCacheError::EpochMismatch {
                sender_epoch: 0,
                receiver_epoch: 1
            }
        );

        // Only the sender is cleared (after resynchronising both): also refused.
        assert_eq!(s.clear(), 10);
        let item = s.prepare("b", Some(payload(5))).unwrap();
        r.receive(item).unwrap();
        s.clear();
        let item = s.prepare("b", Some(payload(5))).unwrap();
        assert!(matches!(
            r.receive(item),
            Err(ProcessorCacheError::EpochMismatch {
                sender_epoch: 2,
                receiver_epoch: 1
            })
        ));
        // Recovery: clear both and align the receiver on the sender's epoch.
        s.clear();
        assert_eq!(r.clear_to(s.epoch()), 5);
        assert_eq!(r.epoch(), 3);
        let item = s.prepare("b", Some(payload(5))).unwrap();
        assert!(r.receive(item).is_ok());
    }

    #[test]
    fn sender_miss_without_payload_is_an_error() {
        let mut s = ProcessorCacheSender::new(100);
        assert!(matches!(
            s.prepare::<Vec<u8>>("a", None),
            Err(ProcessorCacheError::PayloadRequired { .. })
        ));
    }

    #[test]
    fn size_mismatch_is_detected() {
        let mut s = ProcessorCacheSender::new(100);
        let mut r = ProcessorCacheReceiver::new(100);
        let mut item = s.prepare("a", Some(payload(10))).unwrap();
        item.payload = Some(payload(11));
        assert!(matches!(
            r.receive(item),
            Err(ProcessorCacheError::SizeMismatch { .. })
        ));
    }

    proptest::proptest! {
        /// Fed the same random sequence, sender and receiver hold the same keys, bytes and
        /// counters after every item, and every payload comes back intact.
        #[test]
        fn mirrored_pair_stays_identical(
            capacity in 0u64..300,
            seq in proptest::collection::vec(0u8..12, 1..200),
        ) {
            let mut s = ProcessorCacheSender::new(capacity);
            let mut r = ProcessorCacheReceiver::new(capacity);
            for key in seq {
                // Content determines size: a key always has the same payload.
                let hash = format!("k{key}");
                let size = 1 + (usize::from(key) * 37) % 120;
                let pay = if s.is_cached(&hash) { None } else { Some(vec![key; size]) };
                let item = s.prepare(&hash, pay).unwrap();
                proptest::prop_assert_eq!(r.receive(item).unwrap(), vec![key; size]);
                proptest::prop_assert_eq!(s.stats(), r.stats());
                proptest::prop_assert!(s.stats().bytes <= capacity);
                for k in 0..12u8 {
                    let h = format!("k{k}");
                    proptest::prop_assert_eq!(s.is_cached(&h), r.contains(&h));
                }
            }
        }
    }
}
