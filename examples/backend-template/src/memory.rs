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
//! - every byte range is checked against its buffer before anything is copied.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use iris_plugin::abi::{BufferHandle, CopyRegion, MemInfo, PluginError};

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

    /// Host -> device.
    pub fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        let mut table = self.lock();
        let buffer = buffer_mut(&mut table, "write", dst)?;
        let range = checked_range("write", "dst", buffer.len(), offset, src.len() as u64)?;
        buffer[range].copy_from_slice(src);
        Ok(())
    }

    /// Device -> host.
    pub fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        let mut table = self.lock();
        let buffer = buffer_mut(&mut table, "read", src)?;
        let range = checked_range("read", "src", buffer.len(), offset, dst.len() as u64)?;
        dst.copy_from_slice(&buffer[range]);
        Ok(())
    }

    /// Device -> device copy of several regions. Every region is checked before any byte
    /// moves, so a bad region leaves `dst` untouched.
    pub fn copy_regions(
        &self,
        op: &str,
        dst: BufferHandle,
        src: BufferHandle,
        regions: &[CopyRegion],
    ) -> Result<(), PluginError> {
        let mut table = self.lock();
        let dst_len = buffer_mut(&mut table, op, dst)?.len();
        let src_len = buffer_mut(&mut table, op, src)?.len();
        let mut checked = Vec::with_capacity(regions.len());
        for (index, region) in regions.iter().enumerate() {
            let from = checked_range(
                op,
                &format!("region {index} source"),
                src_len,
                region.src_offset,
                region.bytes,
            )?;
            let to = checked_range(
                op,
                &format!("region {index} destination"),
                dst_len,
                region.dst_offset,
                region.bytes,
            )?;
            checked.push((from, to));
        }
        if dst == src {
            for (index, (_, to)) in checked.iter().enumerate() {
                if checked
                    .iter()
                    .any(|(from, _)| to.start < from.end && from.start < to.end)
                {
                    return Err(invalid(
                        op,
                        format!("region {index} destination overlaps a source region"),
                    ));
                }
            }
            let buffer = buffer_mut(&mut table, op, dst)?;
            for (from, to) in checked {
                buffer.copy_within(from, to.start);
            }
            return Ok(());
        }
        let [Some(to_buf), Some(from_buf)] = table.buffers.get_disjoint_mut([&dst.0, &src.0])
        else {
            // Both handles were looked up above under the same lock.
            return Err(invalid(op, "buffer vanished during the copy"));
        };
        for (from, to) in checked {
            to_buf[to].copy_from_slice(&from_buf[from]);
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

/// `[offset, offset + len)` as a `usize` range, if it lies inside a buffer of `buffer_len`.
fn checked_range(
    op: &str,
    what: &str,
    buffer_len: usize,
    offset: u64,
    len: u64,
) -> Result<std::ops::Range<usize>, PluginError> {
    let outside = || {
        invalid(
            op,
            format!(
                "{what}: bytes [{offset}, {offset}+{len}) lie outside the buffer of {buffer_len} bytes"
            ),
        )
    };
    let end = offset.checked_add(len).ok_or_else(outside)?;
    if end > buffer_len as u64 {
        return Err(outside());
    }
    // Both fit: they are at most `buffer_len`, a `usize`.
    let start = usize::try_from(offset).map_err(|_| outside())?;
    let end = usize::try_from(end).map_err(|_| outside())?;
    Ok(start..end)
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
        let overlapping = CopyRegion {
            src_offset: 0,
            dst_offset: 2,
            bytes: 4,
        };
        assert!(memory.copy_regions("copy", a, a, &[overlapping]).is_err());
        let disjoint = CopyRegion {
            src_offset: 0,
            dst_offset: 32,
            bytes: 4,
        };
        memory.copy_regions("copy", a, a, &[disjoint]).unwrap();
        let mut back = [0; 4];
        memory.read(a, 32, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4]);
    }
}
