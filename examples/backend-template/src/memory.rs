//! The device's memory: a table from opaque handles to buffers, bounded by a capacity.
//!
//! A real backend keeps the same table, with driver allocations (`cuMemAlloc`, `aclrtMalloc`)
//! in place of the `Vec<u8>`s. What the host relies on, and the conformance suite checks:
//!
//! - handles are opaque integers, never host pointers, and `0` is never a handle;
//! - `mem_info` reflects allocations at once: free memory drops by at least the bytes
//!   allocated and returns exactly when they are freed;
//! - a request larger than the free memory is an out-of-memory error (its own code, so the host
//!   can evict and retry), a zero-size request, a double free or an unknown handle an invalid
//!   argument;
//! - every byte range is checked against its buffer before anything is copied, with the shared
//!   checks of [`iris_plugin::validate`] that every backend calls.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use iris_plugin::abi::{BufferHandle, CopyRegion, FillArgs, MemInfo, PluginError};
use iris_plugin::validate::{self, Checker};

use crate::error::{invalid, out_of_memory};

/// The buffer table and its accounting.
#[derive(Debug)]
pub struct Memory {
    capacity: u64,
    table: Mutex<Table>,
}

#[derive(Debug)]
struct Table {
    next_handle: u64,
    used: u64,
    buffers: HashMap<u64, Vec<u8>>,
}

impl Memory {
    /// An empty table that admits at most `capacity` bytes.
    pub fn new(capacity: u64) -> Memory {
        Memory {
            capacity,
            table: Mutex::new(Table {
                next_handle: 1,
                used: 0,
                buffers: HashMap::new(),
            }),
        }
    }

    /// `(free, total)` bytes.
    pub fn mem_info(&self) -> MemInfo {
        let used = self.lock().used;
        MemInfo {
            free: self.capacity.saturating_sub(used),
            total: self.capacity,
        }
    }

    /// Allocates `bytes` zeroed bytes.
    pub fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        if bytes == 0 {
            return Err(invalid("alloc", "size must be greater than 0"));
        }
        let mut table = self.lock();
        let free = self.capacity.saturating_sub(table.used);
        if bytes > free {
            return Err(out_of_memory(
                "alloc",
                format!(
                    "{bytes} bytes requested, {free} of {} bytes free",
                    self.capacity
                ),
            ));
        }
        let len = usize::try_from(bytes)
            .map_err(|_| out_of_memory("alloc", format!("{bytes} bytes is too large")))?;
        let handle = table.next_handle;
        table.next_handle += 1;
        table.used += bytes;
        table.buffers.insert(handle, vec![0; len]);
        Ok(BufferHandle(handle))
    }

    /// Frees a buffer.
    pub fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        let mut table = self.lock();
        let removed = table
            .buffers
            .remove(&buf.0)
            .ok_or_else(|| invalid("free", format!("unknown buffer handle {}", buf.0)))?;
        table.used -= removed.len() as u64;
        Ok(())
    }

    /// Bytes and number of live buffers, for the memory report.
    pub fn usage(&self) -> (u64, u64) {
        let table = self.lock();
        (table.used, table.buffers.len() as u64)
    }

    /// The length of a buffer, for [`iris_plugin::validate`].
    pub fn len_of(&self, buf: BufferHandle) -> Option<u64> {
        self.lock().buffers.get(&buf.0).map(|b| b.len() as u64)
    }

    /// Host -> device.
    pub fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        let lens = |buf| self.len_of(buf);
        validate::range(
            &Checker::new("write", &lens),
            "dst",
            dst,
            offset,
            src.len() as u64,
        )?;
        let mut table = self.lock();
        let buffer = buffer_mut(&mut table, "write", dst)?;
        buffer[range(offset, src.len() as u64)].copy_from_slice(src);
        Ok(())
    }

    /// Device -> host.
    pub fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        let lens = |buf| self.len_of(buf);
        validate::range(
            &Checker::new("read", &lens),
            "src",
            src,
            offset,
            dst.len() as u64,
        )?;
        let mut table = self.lock();
        let buffer = buffer_mut(&mut table, "read", src)?;
        dst.copy_from_slice(&buffer[range(offset, dst.len() as u64)]);
        Ok(())
    }

    /// Device -> device copy of several regions. Every region is checked (by the shared
    /// validation) before any byte moves, so a bad region leaves every buffer untouched.
    pub fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        let lens = |buf| self.len_of(buf);
        validate::copy_batch(&Checker::new("copy_batch", &lens), regions)?;
        let mut table = self.lock();
        for region in regions.iter().filter(|r| r.bytes > 0) {
            // No destination overlaps a source (validated), so the order of regions does not
            // matter; going through a temporary keeps the borrow checker out of the way.
            let bytes = buffer_mut(&mut table, "copy_batch", region.src)?
                [range(region.src_offset, region.bytes)]
            .to_vec();
            buffer_mut(&mut table, "copy_batch", region.dst)?
                [range(region.dst_offset, region.bytes)]
            .copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// Fills a range with a repeated value.
    pub fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
        let lens = |buf| self.len_of(buf);
        validate::fill(&Checker::new("fill", &lens), args)?;
        if args.dst.bytes == 0 {
            return Ok(());
        }
        let mut table = self.lock();
        let buffer = buffer_mut(&mut table, "fill", args.dst.buf)?;
        let pattern = args.value.to_le_bytes();
        let width = args.width as usize;
        for (i, byte) in buffer[range(args.dst.offset, args.dst.bytes)]
            .iter_mut()
            .enumerate()
        {
            *byte = pattern[i % width];
        }
        Ok(())
    }

    /// Number of live buffers.
    pub fn buffer_count(&self) -> usize {
        self.lock().buffers.len()
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while the lock was held cannot leave the table half-updated in a way that
        // breaks memory safety; keep serving rather than poisoning every later call.
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn buffer_mut<'a>(
    table: &'a mut Table,
    op: &str,
    buf: BufferHandle,
) -> Result<&'a mut Vec<u8>, PluginError> {
    table
        .buffers
        .get_mut(&buf.0)
        .ok_or_else(|| invalid(op, format!("unknown buffer handle {}", buf.0)))
}

/// `[offset, offset + len)` as a `usize` range; the shared validation has checked it against a
/// buffer, whose length is a `usize`.
fn range(offset: u64, len: u64) -> std::ops::Range<usize> {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    start..start + usize::try_from(len).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iris_plugin::ErrorCode;

    #[test]
    fn accounting_follows_alloc_and_free() {
        let memory = Memory::new(1000);
        let a = memory.alloc(600).unwrap();
        assert_eq!(memory.mem_info().free, 400);
        assert_eq!(
            memory.alloc(500).unwrap_err().code,
            ErrorCode::OUT_OF_MEMORY
        );
        memory.free(a).unwrap();
        assert_eq!(memory.mem_info().free, 1000);
        assert_eq!(
            memory.free(a).unwrap_err().code,
            ErrorCode::INVALID_ARGUMENT
        );
        assert_eq!(memory.buffer_count(), 0);
    }

    #[test]
    fn copies_within_one_buffer_reject_overlap() {
        let memory = Memory::new(1000);
        let a = memory.alloc(64).unwrap();
        memory.write(a, 0, &[1, 2, 3, 4]).unwrap();
        let region = |src_offset, dst_offset| CopyRegion {
            src: a,
            src_offset,
            dst: a,
            dst_offset,
            bytes: 4,
        };
        assert!(memory.copy_batch(&[region(0, 2)]).is_err());
        memory.copy_batch(&[region(0, 32)]).unwrap();
        let mut back = [0; 4];
        memory.read(a, 32, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4]);
    }
}
