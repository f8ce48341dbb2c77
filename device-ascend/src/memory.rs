//! Device buffers behind opaque handles, queue-ordered frees, pinned host memory (staging for
//! `write`, host buffers for `alloc_host`), and the driver's memory figures.
//!
//! All of a device's work runs on its one stream, so a free only has to wait for the work
//! enqueued before it: [`Memory::free`] records an event after that work and releases the
//! block with `aclrtFree` once the event completes (checked at later calls, and at
//! `synchronize`). An allocation that fails for lack of memory first waits for the stream and
//! releases those blocks, then retries once.
//!
//! Device blocks come from `aclrtMallocAlign32`, which rounds to 32 bytes without padding, so
//! a segment of whole huge pages takes exactly its size. Where the runtime lacks it, blocks
//! come from `aclrtMalloc`, which adds 32 bytes to each block (an extra huge page for a
//! segment of whole huge pages); [`Memory::overhead`] reports what the rules of `acl_rt.h`
//! make the device charge beyond the bytes requested, so that the device's used memory and the
//! host's figures can be reconciled.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;

use iris_plugin::abi::{BufferHandle, HostBufferId, MemInfo};

use crate::error::AscendError;
use crate::result::AclError;
use crate::runtime::Runtime;
use crate::stream::{Event, Stream, offset_ptr};
use crate::sys;

/// Largest piece of one `write` staged at a time, so that a large upload does not pin a
/// host buffer of its own size.
pub const STAGING_CHUNK: u64 = 64 << 20;
/// Host bytes of one staged piece of a pattern fill: the pattern is built once at this size
/// and copied as often as the range needs.
const FILL_CHUNK: u64 = 1 << 20;
/// Pinned staging kept for reuse between writes; idle blocks beyond it are released.
pub const STAGING_POOL: u64 = 256 << 20;
/// Huge page size: `HUGE_FIRST` blocks above [`HUGE_FIRST_THRESHOLD`] take whole huge pages.
pub const HUGE_PAGE: u64 = 2 << 20;
/// Largest `HUGE_FIRST` block that takes normal pages.
pub const HUGE_FIRST_THRESHOLD: u64 = 1 << 20;
/// What `aclrtMalloc` adds to every block, beyond the 32-byte rounding.
pub const MALLOC_PADDING: u64 = 32;
/// Smallest staging block, so that small writes share blocks.
const STAGING_MIN: u64 = 1 << 20;
/// Alignment `alloc_host` promises.
pub const HOST_ALIGN: usize = 64;

/// A block from `aclrtMallocAlign32` (or `aclrtMalloc`), freed with `aclrtFree` on drop.
pub struct DeviceBlock {
    rt: &'static Runtime,
    ptr: *mut c_void,
    len: u64,
    /// What the device charges for it (see [`charge`]).
    charge: u64,
}

// SAFETY: the block is a device address; its uses are ordered by the stream and the device's
// lock.
unsafe impl Send for DeviceBlock {}
// SAFETY: a shared block only gives out its address and length (no interior mutability); the
// memory behind it is used through the stream.
unsafe impl Sync for DeviceBlock {}

impl DeviceBlock {
    /// The device address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// Bytes requested.
    pub fn bytes(&self) -> u64 {
        self.len
    }

    /// Bytes the device charges for it beyond those requested.
    pub fn overhead(&self) -> u64 {
        self.charge.saturating_sub(self.len)
    }
}

/// Which runtime call allocates device blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMalloc {
    /// `aclrtMallocAlign32`: 32-byte rounding, no padding.
    Align32,
    /// `aclrtMalloc`: 32-byte rounding plus [`MALLOC_PADDING`], where the runtime has no
    /// `aclrtMallocAlign32`.
    Padded,
}

impl DeviceMalloc {
    /// The runtime function's name.
    pub fn name(self) -> &'static str {
        match self {
            DeviceMalloc::Align32 => "aclrtMallocAlign32",
            DeviceMalloc::Padded => "aclrtMalloc",
        }
    }
}

/// What the device charges for a `HUGE_FIRST` block of `bytes` from `malloc`, by the rules of
/// `acl_rt.h` and the memory policy documentation: 32-byte rounding, `aclrtMalloc`'s padding,
/// and whole 2 MiB pages above 1 MiB. The normal-page granularity below that is not documented
/// and not counted.
pub fn charge(bytes: u64, malloc: DeviceMalloc) -> u64 {
    let padding = match malloc {
        DeviceMalloc::Align32 => 0,
        DeviceMalloc::Padded => MALLOC_PADDING,
    };
    let rounded = bytes
        .div_ceil(32)
        .saturating_mul(32)
        .saturating_add(padding);
    if bytes > HUGE_FIRST_THRESHOLD {
        rounded.div_ceil(HUGE_PAGE).saturating_mul(HUGE_PAGE)
    } else {
        rounded
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        // SAFETY: allocated by aclrtMallocAlign32 or aclrtMalloc and freed once; no queued
        // work uses it (the queue-ordered free waited for its event, or the stream was
        // synchronised).
        unsafe { self.rt.free_device(self.ptr) };
    }
}

/// Pinned host memory from `aclrtMallocHost`, freed with `aclrtFreeHost` on drop.
pub struct HostBlock {
    rt: &'static Runtime,
    ptr: *mut c_void,
    len: u64,
}

// SAFETY: plain host memory; the device orders its asynchronous uses.
unsafe impl Send for HostBlock {}

impl HostBlock {
    /// Allocates `len` bytes of pinned host memory.
    pub fn new(rt: &'static Runtime, len: u64) -> Result<HostBlock, AscendError> {
        let ptr = rt.malloc_host(len)?;
        let block = HostBlock { rt, ptr, len };
        if !(ptr as usize).is_multiple_of(HOST_ALIGN) {
            return Err(AscendError::Internal(format!(
                "aclrtMallocHost returned {ptr:p}, not {HOST_ALIGN}-byte aligned"
            )));
        }
        Ok(block)
    }

    /// The host address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// Length in bytes.
    pub fn bytes(&self) -> u64 {
        self.len
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        // SAFETY: allocated by aclrtMallocHost and freed once, after the work using it.
        unsafe { self.rt.free_host(self.ptr) };
    }
}

/// Which `aclrtMemAttr` reports this part's memory: HBM on 910-class parts, DDR on edge and
/// inference parts such as the 310P.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// `ACL_HBM_MEM`.
    Hbm,
    /// `ACL_DDR_MEM`.
    Ddr,
}

impl MemKind {
    /// Asks for both and keeps the one with the larger total.
    pub fn detect(rt: &Runtime) -> Result<MemKind, AscendError> {
        let hbm = mem_info(rt, MemKind::Hbm);
        let ddr = mem_info(rt, MemKind::Ddr);
        match (hbm, ddr) {
            (Ok(h), Ok(d)) => Ok(if d.total > h.total {
                MemKind::Ddr
            } else {
                MemKind::Hbm
            }),
            (Ok(_), Err(_)) => Ok(MemKind::Hbm),
            (Err(_), Ok(_)) => Ok(MemKind::Ddr),
            (Err(err), Err(_)) => Err(err),
        }
    }

    /// `HBM` or `DDR`.
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Hbm => "HBM",
            MemKind::Ddr => "DDR",
        }
    }
}

/// `aclrtGetMemInfo` for `kind` on the current context's device.
pub fn mem_info(rt: &Runtime, kind: MemKind) -> Result<MemInfo, AscendError> {
    let attr = match kind {
        MemKind::Hbm => sys::aclrtMemAttr::ACL_HBM_MEM,
        MemKind::Ddr => sys::aclrtMemAttr::ACL_DDR_MEM,
    };
    let (free, total) = rt.mem_info(attr)?;
    Ok(MemInfo { free, total })
}

/// Blocks released once the work before an event is done.
struct Pending {
    event: Event,
    device: Vec<DeviceBlock>,
    host: Vec<HostBlock>,
    /// Whether `device` counts in the allocated figures (buffers from `alloc`, not transient
    /// scratch).
    counted: bool,
}

/// A pinned staging block for `write`, busy until its event completes.
struct Staging {
    block: HostBlock,
    busy: Option<Event>,
}

/// A device's buffers and pinned host memory.
pub struct Memory {
    rt: &'static Runtime,
    kind: MemKind,
    buffers: HashMap<u64, DeviceBlock>,
    next_handle: u64,
    /// Bytes and count of buffers not yet released (live, or freed but pending).
    allocated: u64,
    buffer_count: u64,
    /// What the device charges for those buffers beyond their bytes.
    overhead: u64,
    /// The allocation call in use.
    malloc: DeviceMalloc,
    host: HashMap<u64, HostBlock>,
    next_host: u64,
    pending: VecDeque<Pending>,
    /// Transient blocks whose release could not be ordered after their work (no event, and
    /// the wait for the stream failed without a task fault): released once a later
    /// synchronisation succeeds ([`Memory::reap_all`]).
    stranded: Vec<DeviceBlock>,
    staging: Vec<Staging>,
}

/// Blocks [`Memory::release_after`] kept: the wait that would have ordered their release
/// failed, so queued work may still use them.
struct Kept {
    error: AscendError,
    device: Vec<DeviceBlock>,
    host: Vec<HostBlock>,
}

impl Memory {
    /// An empty table for a device whose memory `kind` reports.
    pub fn new(rt: &'static Runtime, kind: MemKind) -> Memory {
        Memory {
            rt,
            kind,
            buffers: HashMap::new(),
            next_handle: 1,
            allocated: 0,
            buffer_count: 0,
            overhead: 0,
            malloc: if rt.acl().aclrtMallocAlign32.is_ok() {
                DeviceMalloc::Align32
            } else {
                DeviceMalloc::Padded
            },
            host: HashMap::new(),
            next_host: 1,
            pending: VecDeque::new(),
            stranded: Vec::new(),
            staging: Vec::new(),
        }
    }

    /// Which memory figures the device reports.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// `(free, total)` as the driver sees it, after releasing the blocks whose queued work is
    /// done (a free the host made is then visible in the figures, as on the host's side).
    pub fn mem_info(&mut self) -> Result<MemInfo, AscendError> {
        self.reap()?;
        mem_info(self.rt, self.kind)
    }

    /// `(bytes, buffers)` not yet released.
    pub fn usage(&self) -> (u64, u64) {
        (self.allocated, self.buffer_count)
    }

    /// What the device charges for the buffers not yet released beyond their bytes: rounding
    /// to huge pages, and `aclrtMalloc`'s padding where it is in use.
    pub fn overhead(&self) -> u64 {
        self.overhead
    }

    /// What the device charges for transient scratch whose work is still queued: taken by an
    /// op beyond its caller's workspace (a copy between unaligned or strided regions), and
    /// released once the queue has passed that work.
    pub fn queued_scratch(&self) -> u64 {
        self.pending
            .iter()
            .filter(|p| !p.counted)
            .flat_map(|p| &p.device)
            .map(|block| block.charge)
            .sum()
    }

    /// The allocation call in use (it may change from `aclrtMallocAlign32` to `aclrtMalloc`
    /// at the first allocation, if the runtime refuses the former).
    pub fn device_malloc(&self) -> DeviceMalloc {
        self.malloc
    }

    /// Length of a live buffer.
    pub fn len_of(&self, buf: BufferHandle) -> Option<u64> {
        self.buffers.get(&buf.0).map(DeviceBlock::bytes)
    }

    /// Device address of a live buffer (null for an unknown handle: only reached after
    /// validation, or when sizing a workspace).
    pub fn base(&self, buf: BufferHandle) -> *mut c_void {
        self.buffers
            .get(&buf.0)
            .map_or(std::ptr::null_mut(), DeviceBlock::ptr)
    }

    /// Allocates `bytes` with `aclrtMallocAlign32` or `aclrtMalloc` (huge pages first). On out of memory it waits
    /// for `stream`, releases pending frees and retries once; an error of the work it waited
    /// for is returned in `deferred` for the next `synchronize`.
    pub fn alloc(
        &mut self,
        bytes: u64,
        stream: &Stream,
        deferred: &mut Option<AscendError>,
    ) -> Result<BufferHandle, AscendError> {
        let block = self.malloc_or_wait(bytes, stream, deferred)?;
        let handle = self.next_handle;
        self.next_handle += 1;
        self.allocated += bytes;
        self.buffer_count += 1;
        self.overhead += block.overhead();
        self.buffers.insert(handle, block);
        Ok(BufferHandle(handle))
    }

    /// Frees a buffer, queue-ordered: the handle is gone at once, the block once the work
    /// enqueued before this call is done.
    ///
    /// A free that fails has changed nothing: the handle stays live (the caller's allocator
    /// keeps the buffer and may free it again). A task fault met on the way is not this call's
    /// failure: the stream noted it, and the next synchronisation reports it.
    pub fn free(&mut self, buf: BufferHandle, stream: &Stream) -> Result<(), AscendError> {
        let Some(block) = self.buffers.remove(&buf.0) else {
            return Err(AscendError::Internal(format!(
                "free: unknown buffer handle {}",
                buf.0
            )));
        };
        if let Err(kept) = self.release_after(stream, vec![block], Vec::new(), true) {
            let Kept { error, device, .. } = *kept;
            if let Some(block) = device.into_iter().next() {
                self.buffers.insert(buf.0, block);
            }
            return Err(error);
        }
        self.reap()
    }

    /// A device block outside the buffer table, for scratch an op needs beyond its caller's
    /// workspace; hand it back with [`Memory::retire`] right after enqueueing its use. On out
    /// of memory it waits for queued frees as [`Memory::alloc`] does.
    pub fn transient(
        &mut self,
        bytes: u64,
        stream: &Stream,
        deferred: &mut Option<AscendError>,
    ) -> Result<DeviceBlock, AscendError> {
        self.malloc_or_wait(bytes, stream, deferred)
    }

    /// A block of `bytes`. On out of memory while frees are still queued, waits for
    /// `stream`, releases them and retries once; an error of the work it waited for goes to
    /// `deferred`, for the next `synchronize` (it belongs to that work, not to this call).
    fn malloc_or_wait(
        &mut self,
        bytes: u64,
        stream: &Stream,
        deferred: &mut Option<AscendError>,
    ) -> Result<DeviceBlock, AscendError> {
        self.reap()?;
        let block = match self.malloc(bytes) {
            Err(code) if code.is_out_of_memory() && !self.pending.is_empty() => {
                if let Err(err) = stream.synchronize() {
                    deferred.get_or_insert(err);
                }
                self.reap()?;
                self.malloc(bytes)
            }
            other => other,
        };
        block.map_err(|code| self.malloc_error(code, bytes))
    }

    /// Releases a transient block once the work enqueued so far is done. When that cannot be
    /// ordered (see [`Memory::free`]), the block waits for the next successful
    /// synchronisation and the wait's error is returned.
    pub fn retire(&mut self, block: DeviceBlock, stream: &Stream) -> Result<(), AscendError> {
        self.release_after(stream, vec![block], Vec::new(), false)
            .map_err(|kept| {
                let Kept { error, device, .. } = *kept;
                self.stranded.extend(device);
                error
            })
    }

    /// Releases blocks once the work enqueued so far is done: behind an event, or, when no
    /// event can be recorded (out of event resources, or a stream in error), after waiting
    /// for the stream, so that no queued work is left using them. A task fault met by that
    /// wait leaves no work running (the stream dropped what followed the fault, and noted
    /// it for the device to report once): the blocks are released. Any other failure of the
    /// wait leaves the blocks to the caller, with the error.
    fn release_after(
        &mut self,
        stream: &Stream,
        device: Vec<DeviceBlock>,
        host: Vec<HostBlock>,
        counted: bool,
    ) -> Result<(), Box<Kept>> {
        match Event::record(self.rt, stream) {
            Ok(event) => {
                self.pending.push_back(Pending {
                    event,
                    device,
                    host,
                    counted,
                });
                Ok(())
            }
            Err(_) => match stream.synchronize() {
                Err(error) if !error.is_task_fault() => Err(Box::new(Kept {
                    error,
                    device,
                    host,
                })),
                _ => {
                    self.release(device, host, counted);
                    Ok(())
                }
            },
        }
    }

    /// Releases the blocks whose work is done, oldest first (events complete in order on
    /// the one stream).
    ///
    /// A task fault met here is not this call's failure: the stream noted it, and the device
    /// recovers and reports it at its next entry (see `device.rs`); until then nothing more
    /// is released.
    pub fn reap(&mut self) -> Result<(), AscendError> {
        match self.try_reap() {
            Err(err) if err.is_task_fault() => Ok(()),
            other => other,
        }
    }

    fn try_reap(&mut self) -> Result<(), AscendError> {
        while let Some(front) = self.pending.front() {
            if !front.event.is_complete()? {
                break;
            }
            if let Some(done) = self.pending.pop_front() {
                self.release(done.device, done.host, done.counted);
            }
        }
        for staging in &mut self.staging {
            if let Some(event) = &staging.busy
                && event.is_complete()?
            {
                staging.busy = None;
            }
        }
        Ok(())
    }

    /// Releases everything pending; the caller synchronised the stream (or destroyed it).
    pub fn reap_all(&mut self) {
        while let Some(done) = self.pending.pop_front() {
            self.release(done.device, done.host, done.counted);
        }
        self.stranded.clear();
        for staging in &mut self.staging {
            staging.busy = None;
        }
        self.trim_staging();
    }

    /// Enqueues a copy of `src` into `dst` at `offset` through pinned staging; returns once
    /// `src` may be reused.
    pub fn write(
        &mut self,
        dst: BufferHandle,
        offset: u64,
        src: &[u8],
        stream: &Stream,
    ) -> Result<(), AscendError> {
        self.reap()?;
        let base = self.base(dst);
        let chunk = usize::try_from(STAGING_CHUNK).unwrap_or(usize::MAX);
        for (index, piece) in src.chunks(chunk).enumerate() {
            let at = offset + (index as u64) * STAGING_CHUNK;
            let len = piece.len() as u64;
            let slot = self.staging_slot(len)?;
            let host = self.staging[slot].block.ptr();
            // SAFETY: the staging block holds at least `len` bytes and is idle (no queued
            // copy reads it); `piece` is a host slice of `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), host.cast::<u8>(), piece.len());
            }
            // SAFETY: destination range checked against the buffer by the caller; the source
            // is pinned memory that stays untouched until the event recorded below completes.
            unsafe {
                self.rt.memcpy_async(
                    offset_ptr(base, at),
                    host,
                    len,
                    sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                    stream.raw(),
                )
            }?;
            self.staging[slot].busy = match Event::record(self.rt, stream) {
                Ok(event) => Some(event),
                // Without an event to say when the copy has read the staging block, wait
                // for it before the block can be reused.
                Err(_) => match stream.synchronize() {
                    // The stream noted the fault and dropped the copy: the block is idle, and
                    // the next synchronisation reports the fault.
                    Err(err) if !err.is_task_fault() => return Err(err),
                    _ => None,
                },
            };
        }
        Ok(())
    }

    /// Enqueues a fill of `bytes` bytes of `dst` from `offset` with `pattern` repeated
    /// (`bytes` and `offset` are multiples of its length), through pinned staging: no device
    /// scratch and no op workspace, so every device byte stays in the host's accounting.
    pub fn fill_pattern(
        &mut self,
        dst: BufferHandle,
        offset: u64,
        bytes: u64,
        pattern: &[u8],
        stream: &Stream,
    ) -> Result<(), AscendError> {
        let width = pattern.len().max(1) as u64;
        let chunk = bytes.min(FILL_CHUNK / width * width);
        let host: Vec<u8> = pattern
            .iter()
            .copied()
            .cycle()
            .take(usize::try_from(chunk).unwrap_or(usize::MAX))
            .collect();
        let mut done = 0u64;
        while done < bytes {
            let len = chunk.min(bytes - done);
            let piece = &host[..usize::try_from(len).unwrap_or(host.len())];
            self.write(dst, offset + done, piece, stream)?;
            done += len;
        }
        Ok(())
    }

    /// Copies from a buffer into host memory; the caller synchronised the stream.
    pub fn read_synchronized(
        &self,
        src: BufferHandle,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), AscendError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: source range checked by the caller; the stream is idle, so the synchronous
        // copy sees all earlier work; `dst` is a host slice of that length.
        unsafe {
            self.rt.memcpy(
                dst.as_mut_ptr().cast::<c_void>(),
                offset_ptr(self.base(src), offset),
                dst.len() as u64,
                sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        }
    }

    /// Enqueues an asynchronous copy of `bytes` between device (or pinned host) addresses.
    ///
    /// # Safety
    /// Both ranges are `bytes` long inside live blocks of this memory (or pinned host buffers
    /// it gave out), whose release waits for this work.
    pub unsafe fn copy_async(
        &self,
        dst: *mut c_void,
        src: *const c_void,
        bytes: u64,
        kind: sys::aclrtMemcpyKind::Type,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { self.rt.memcpy_async(dst, src, bytes, kind, stream.raw()) }
    }

    /// Enqueues a byte fill.
    ///
    /// # Safety
    /// The range is `bytes` long inside a live block of this memory.
    pub unsafe fn memset_async(
        &self,
        dst: *mut c_void,
        bytes: u64,
        value: u8,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        // SAFETY: the caller's contract.
        unsafe { self.rt.memset_async(dst, bytes, value, stream.raw()) }
    }

    /// Allocates a pinned host buffer for the host's staging.
    pub fn alloc_host(&mut self, bytes: u64) -> Result<(HostBufferId, *mut u8, u64), AscendError> {
        self.reap()?;
        let block = HostBlock::new(self.rt, bytes)?;
        let id = self.next_host;
        self.next_host += 1;
        let ptr = block.ptr().cast::<u8>();
        let len = block.bytes();
        self.host.insert(id, block);
        Ok((HostBufferId(id), ptr, len))
    }

    /// A live host buffer's address and length.
    pub fn host(&self, id: HostBufferId) -> Option<(*mut c_void, u64)> {
        self.host
            .get(&id.0)
            .map(|block| (block.ptr(), block.bytes()))
    }

    /// Frees a host buffer, queue-ordered.
    /// As [`Memory::free`], a failure leaves the buffer live.
    pub fn free_host(&mut self, id: HostBufferId, stream: &Stream) -> Result<bool, AscendError> {
        let Some(block) = self.host.remove(&id.0) else {
            return Ok(false);
        };
        if let Err(kept) = self.release_after(stream, Vec::new(), vec![block], false) {
            let Kept { error, host, .. } = *kept;
            if let Some(block) = host.into_iter().next() {
                self.host.insert(id.0, block);
            }
            return Err(error);
        }
        self.reap()?;
        Ok(true)
    }

    /// Releases everything: for closing, after the stream was synchronised.
    pub fn clear(&mut self) {
        self.reap_all();
        for (_, block) in self.buffers.drain() {
            drop(block);
        }
        self.host.clear();
        self.staging.clear();
        self.allocated = 0;
        self.buffer_count = 0;
        self.overhead = 0;
    }

    fn release(&mut self, device: Vec<DeviceBlock>, host: Vec<HostBlock>, counted: bool) {
        for block in device.iter().filter(|_| counted) {
            self.allocated = self.allocated.saturating_sub(block.bytes());
            self.buffer_count = self.buffer_count.saturating_sub(1);
            self.overhead = self.overhead.saturating_sub(block.overhead());
        }
        // The blocks go back to the runtime here: aclrtFree and aclrtFreeHost on drop.
        drop(host);
        drop(device);
    }

    /// One device block. `aclrtMallocAlign32` where the runtime has it; a runtime that
    /// answers it with "feature not supported" gets `aclrtMalloc` from then on.
    fn malloc(&mut self, bytes: u64) -> Result<DeviceBlock, AclError> {
        let Ok(size) = usize::try_from(bytes) else {
            return Err(AclError::MEMORY_ALLOCATION);
        };
        if self.malloc == DeviceMalloc::Align32 {
            match self.rt.malloc_device(size, true) {
                Ok(ptr) => return Ok(self.block(ptr, bytes)),
                Err(Some(code)) if code.0 != sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT as i32 => {
                    return Err(code);
                }
                // Missing, or "feature not supported": aclrtMalloc from now on.
                Err(_) => self.malloc = DeviceMalloc::Padded,
            }
        }
        match self.rt.malloc_device(size, false) {
            Ok(ptr) => Ok(self.block(ptr, bytes)),
            Err(code) => Err(code.unwrap_or(AclError(sys::ACL_ERROR_FEATURE_UNSUPPORTED))),
        }
    }

    fn block(&self, ptr: *mut c_void, bytes: u64) -> DeviceBlock {
        DeviceBlock {
            rt: self.rt,
            ptr,
            len: bytes,
            charge: charge(bytes, self.malloc),
        }
    }

    fn malloc_error(&self, code: AclError, requested: u64) -> AscendError {
        let function = self.malloc.name();
        let message = match self.rt.check(function, code.0) {
            Err(AscendError::Acl { message, .. }) => message,
            _ => String::new(),
        };
        if code.0 == sys::ACL_ERROR_FEATURE_UNSUPPORTED && self.rt.acl().aclrtMalloc.is_err() {
            return self.rt.missing("aclrtMalloc");
        }
        if code.is_out_of_memory() {
            let info = mem_info(self.rt, self.kind).unwrap_or(MemInfo { free: 0, total: 0 });
            return AscendError::OutOfMemory {
                function,
                code,
                requested,
                free: info.free,
                total: info.total,
                message,
            };
        }
        AscendError::Acl {
            function,
            code,
            message,
        }
    }

    /// An idle staging block of at least `len` bytes.
    fn staging_slot(&mut self, len: u64) -> Result<usize, AscendError> {
        let fit = self
            .staging
            .iter()
            .enumerate()
            .filter(|(_, s)| s.busy.is_none() && s.block.bytes() >= len)
            .min_by_key(|(_, s)| s.block.bytes())
            .map(|(index, _)| index);
        if let Some(index) = fit {
            return Ok(index);
        }
        self.trim_staging();
        // At the pool's bound, wait for a busy block rather than pin more host memory.
        let pinned: u64 = self.staging.iter().map(|s| s.block.bytes()).sum();
        if pinned >= STAGING_POOL
            && let Some(index) = self
                .staging
                .iter()
                .enumerate()
                .filter(|(_, s)| s.block.bytes() >= len)
                .min_by_key(|(_, s)| s.block.bytes())
                .map(|(index, _)| index)
        {
            if let Some(event) = self.staging[index].busy.take() {
                event.synchronize()?;
            }
            return Ok(index);
        }
        let size = len.max(STAGING_MIN).next_power_of_two();
        self.staging.push(Staging {
            block: HostBlock::new(self.rt, size)?,
            busy: None,
        });
        Ok(self.staging.len() - 1)
    }

    /// Releases idle staging blocks while the pool holds more than [`STAGING_POOL`].
    fn trim_staging(&mut self) {
        let mut total: u64 = self.staging.iter().map(|s| s.block.bytes()).sum();
        let mut index = 0;
        while total > STAGING_POOL && index < self.staging.len() {
            if self.staging[index].busy.is_none() {
                total -= self.staging[index].block.bytes();
                self.staging.swap_remove(index);
            } else {
                index += 1;
            }
        }
    }
}
