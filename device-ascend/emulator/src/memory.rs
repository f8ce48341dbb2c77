//! Emulated device memory: one anonymous mapping per NPU, reserved but not committed
//! (`MAP_NORESERVE`), carved by a first-fit allocator. Freed ranges are returned to the host
//! (`MADV_DONTNEED`), so the host's resident memory follows the device's use.
//!
//! Sizes are charged as `acl_rt.h` and the memory policy documentation describe them:
//! `aclrtMalloc` rounds up to 32 bytes and adds 32 bytes of padding, `aclrtMallocAlign32`
//! rounds up to 32 bytes without padding, and an allocation on huge pages (`HUGE_ONLY`, or
//! `HUGE_FIRST` above 1 MiB) takes whole 2 MiB pages. So a 2 MiB `aclrtMalloc` takes 4 MiB of
//! the device, as on hardware. Blocks start on 512-byte boundaries. Fresh blocks hold garbage
//! (every byte 0xFF: NaN in every float type, -1 as an index), never zeros, so that a read of
//! memory nothing wrote shows. Every device address an op or copy touches is checked against
//! the live blocks when the work runs: a use after `aclrtFree` (a missing queue-ordered free in
//! the caller) is an error here, where real hardware might read stale data.

use std::collections::BTreeMap;

/// Placement alignment of blocks.
pub const BLOCK_ALIGN: u64 = 512;
/// Huge page size: allocations on huge pages are charged in multiples of it.
pub const HUGE_PAGE: u64 = 2 << 20;
/// `HUGE_FIRST` allocations larger than this take huge pages; smaller ones normal pages.
pub const HUGE_FIRST_THRESHOLD: u64 = 1 << 20;
/// What fresh device memory holds.
pub const GARBAGE: u8 = 0xFF;

/// Which allocation entry point asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// `aclrtMalloc`: 32-byte aligned and padded with 32 bytes.
    Malloc,
    /// `aclrtMallocAlign32`: 32-byte aligned, no padding.
    MallocAlign32,
}

/// What an allocation of `size` bytes with `policy` (`aclrtMemMallocPolicy`) costs the device.
pub fn charged(size: u64, policy: u32, entry: Entry) -> u64 {
    let padding = match entry {
        Entry::Malloc => 32,
        Entry::MallocAlign32 => 0,
    };
    let bytes = size.div_ceil(32) * 32 + padding;
    // HUGE_FIRST 0, HUGE_ONLY 1, NORMAL_ONLY 2, then their P2P variants 3, 4, 5.
    let huge = match policy % 3 {
        0 => size > HUGE_FIRST_THRESHOLD,
        1 => true,
        _ => false,
    };
    if huge {
        bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE
    } else {
        bytes
    }
}

/// One NPU's memory.
pub struct Heap {
    base: *mut u8,
    capacity: u64,
    /// Free ranges, start -> length (offsets), coalesced.
    free: BTreeMap<u64, u64>,
    /// Live blocks, start -> (placed length, charged bytes).
    live: BTreeMap<u64, (u64, u64)>,
    /// Bytes charged to live blocks.
    used: u64,
}

// SAFETY: the mapping is plain memory owned by the heap; the device's lock serialises the
// allocator, and the queue orders the uses of the bytes.
unsafe impl Send for Heap {}

impl Heap {
    /// Maps `capacity` bytes.
    pub fn new(capacity: u64) -> Result<Heap, String> {
        let len = usize::try_from(capacity).map_err(|_| "capacity too large".to_owned())?;
        // SAFETY: an anonymous private mapping; no file, no fixed address.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {capacity} bytes failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut free = BTreeMap::new();
        free.insert(0, capacity);
        Ok(Heap {
            base: base.cast::<u8>(),
            capacity,
            free,
            live: BTreeMap::new(),
            used: 0,
        })
    }

    /// Total bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes charged to live blocks.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of live blocks.
    pub fn blocks(&self) -> usize {
        self.live.len()
    }

    /// Allocates a block that costs `cost` bytes (see [`charged`]), charging at most `limit`
    /// bytes in all; `None` when it does not fit. The block holds [`GARBAGE`].
    pub fn alloc(&mut self, cost: u64, limit: u64) -> Option<*mut u8> {
        if self.used.checked_add(cost)? > limit {
            return None;
        }
        let placed = cost.div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN;
        let (&start, &len) = self.free.iter().find(|(_, len)| **len >= placed)?;
        self.free.remove(&start);
        if len > placed {
            self.free.insert(start + placed, len - placed);
        }
        let (offset, len) = (usize::try_from(start).ok()?, usize::try_from(placed).ok()?);
        self.live.insert(start, (placed, cost));
        self.used += cost;
        // SAFETY: `[start, start + placed)` lies inside the mapping and belongs to this block.
        unsafe { std::ptr::write_bytes(self.base.add(offset), GARBAGE, len) };
        Some(self.base.wrapping_add(offset))
    }

    /// Frees the block starting at `ptr`; false for an address that is no block's start.
    pub fn free(&mut self, ptr: *mut u8) -> bool {
        let Some(start) = self.offset_of(ptr) else {
            return false;
        };
        let Some((placed, cost)) = self.live.remove(&start) else {
            return false;
        };
        self.used -= cost;
        self.release_pages(start, placed);
        let mut start = start;
        let mut len = placed;
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back()
            && prev + prev_len == start
        {
            self.free.remove(&prev);
            start = prev;
            len += prev_len;
        }
        if let Some(&next_len) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += next_len;
        }
        self.free.insert(start, len);
        true
    }

    /// Whether `[ptr, ptr + len)` lies inside one live block.
    pub fn contains(&self, ptr: *const u8, len: u64) -> bool {
        let Some(at) = self.offset_of(ptr) else {
            return false;
        };
        match self.live.range(..=at).next_back() {
            Some((&start, &(placed, _))) => {
                at.checked_add(len).is_some_and(|end| end <= start + placed)
            }
            None => false,
        }
    }

    /// Whether `ptr` lies inside this heap's mapping.
    pub fn owns(&self, ptr: *const u8) -> bool {
        self.offset_of(ptr).is_some()
    }

    fn offset_of(&self, ptr: *const u8) -> Option<u64> {
        let (p, b) = (ptr as usize, self.base as usize);
        let offset = u64::try_from(p.checked_sub(b)?).ok()?;
        (offset < self.capacity).then_some(offset)
    }

    /// Gives the whole pages of a freed range back to the host.
    fn release_pages(&mut self, start: u64, len: u64) {
        const PAGE: u64 = 4096;
        let first = start.div_ceil(PAGE) * PAGE;
        let end = (start + len) / PAGE * PAGE;
        if end <= first {
            return;
        }
        let (Ok(offset), Ok(bytes)) = (usize::try_from(first), usize::try_from(end - first)) else {
            return;
        };
        // SAFETY: a page-aligned range inside the mapping that no live block covers.
        unsafe {
            libc::madvise(
                self.base.add(offset).cast::<libc::c_void>(),
                bytes,
                libc::MADV_DONTNEED,
            );
        }
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        if let Ok(len) = usize::try_from(self.capacity) {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe {
                libc::munmap(self.base.cast::<libc::c_void>(), len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_charged_placed_and_coalesced() {
        let mut heap = Heap::new(1 << 20).unwrap();
        let a = heap
            .alloc(charged(100, 0, Entry::Malloc), u64::MAX)
            .unwrap();
        assert_eq!(heap.used(), 160);
        // SAFETY: `a` is a live block of at least 100 bytes.
        assert!(
            unsafe { std::slice::from_raw_parts(a, 100) }
                .iter()
                .all(|b| *b == GARBAGE)
        );
        let b = heap.alloc(1000, u64::MAX).unwrap();
        assert_eq!((b as usize - a as usize) % 512, 0);
        assert!(heap.contains(b, 1000));
        assert!(!heap.contains(b, 2000));
        assert!(heap.free(a));
        assert!(!heap.free(a));
        assert!(!heap.contains(a, 1));
        assert!(heap.free(b));
        assert_eq!(heap.used(), 0);
        // Everything coalesced: one block of the whole capacity fits again.
        assert!(heap.alloc(1 << 20, u64::MAX).is_some());
        assert!(heap.alloc(1, u64::MAX).is_none());
    }

    #[test]
    fn padding_and_huge_pages_are_charged_as_documented() {
        let mib = 1u64 << 20;
        // aclrtMalloc of a 2 MiB segment on huge pages: 2 MiB + 32 bytes, so two huge pages.
        assert_eq!(charged(2 * mib, 0, Entry::Malloc), 4 * mib);
        assert_eq!(charged(2 * mib, 0, Entry::MallocAlign32), 2 * mib);
        assert_eq!(charged(20 * mib, 1, Entry::MallocAlign32), 20 * mib);
        assert_eq!(charged(3 * mib, 0, Entry::MallocAlign32), 4 * mib);
        // At or below 1 MiB HUGE_FIRST takes normal pages; NORMAL_ONLY always does.
        assert_eq!(charged(mib, 0, Entry::Malloc), mib + 32);
        assert_eq!(charged(100, 0, Entry::MallocAlign32), 128);
        assert_eq!(charged(4 * mib, 2, Entry::Malloc), 4 * mib + 32);
    }

    #[test]
    fn the_limit_bounds_what_is_charged() {
        let mut heap = Heap::new(1 << 20).unwrap();
        assert!(heap.alloc(4096, 4000).is_none());
        assert!(heap.alloc(4096, 8192).is_some());
    }
}
