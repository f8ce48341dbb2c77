//! Device memory, pinned host staging buffers and fences: the safe layer over the driver's
//! memory calls.
//!
//! Buffers come from a memory pool of this device's own (`cuMemPoolCreate`) and are allocated
//! and freed in stream order (`cuMemAllocFromPoolAsync`, `cuMemFreeAsync`) on the device's one
//! queue, so `free` right after enqueueing work that reads the buffer is safe: the driver
//! releases the memory when the queue reaches the free. The pool's release threshold is 0, so
//! freed memory goes back to the driver at the next synchronisation and `mem_info` sees it.
//! A device without memory pools falls back to `cuMemAlloc` and a `free` that waits for the
//! queue before `cuMemFree`.
//!
//! A [`DeviceView`] is a non-owning view of a buffer's bytes: a raw device address and a length,
//! what ops hand to kernels and cuBLAS. Handles are never device addresses, so a stale handle
//! is an invalid-argument error, never a wild pointer.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUmemoryPool, CUresult, CUstream};
use iris_plugin::abi::{BufferHandle, HostAlloc, HostBufferId};

use crate::error::{CudaError, DriverResultExt};

/// A non-owning view of device bytes: where they start and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceView {
    /// Device address of the first byte.
    pub ptr: CUdeviceptr,
    /// Length in bytes.
    pub len: u64,
}

impl DeviceView {
    /// The address `offset` bytes in (the caller has checked the range).
    pub(crate) fn at(&self, offset: u64) -> CUdeviceptr {
        self.ptr + offset
    }
}

/// How buffers are obtained from the driver.
enum Allocator {
    /// A stream-ordered pool of this device.
    Pool(CUmemoryPool),
    /// Plain `cuMemAlloc`/`cuMemFree` (devices without memory pools).
    Plain,
}

#[derive(Default)]
struct Table {
    live: HashMap<u64, DeviceView>,
    live_bytes: u64,
    /// Bytes and count of buffers freed in stream order whose release may not have happened.
    pending_bytes: u64,
    pending_buffers: u64,
}

/// Stream-ordered frees counted at one moment, to be retired after a wait for the stream.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Pending {
    bytes: u64,
    buffers: u64,
}

/// The buffer table of one device and the pool behind it.
pub struct Memory {
    allocator: Allocator,
    table: Mutex<Table>,
    next_handle: AtomicU64,
}

// SAFETY: the pool handle is a driver object usable from any thread while its context lives;
// the table is behind a mutex.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    /// A buffer table for `device` (a `CUdevice` ordinal), with a pool of its own where the
    /// device supports memory pools. The context must be current.
    pub(crate) fn new(device: i32, pools: bool) -> Result<Memory, CudaError> {
        let allocator = if pools {
            Allocator::Pool(create_pool(device)?)
        } else {
            Allocator::Plain
        };
        Ok(Memory {
            allocator,
            table: Mutex::new(Table::default()),
            next_handle: AtomicU64::new(1),
        })
    }

    /// Allocates `bytes` (> 0) usable by work enqueued on `stream` after the call.
    pub(crate) fn alloc(&self, stream: CUstream, bytes: u64) -> Result<BufferHandle, CudaError> {
        let len = usize::try_from(bytes)
            .map_err(|_| CudaError::Invalid(format!("{bytes} bytes do not fit in memory")))?;
        let ptr = match self.raw_alloc(stream, len) {
            Ok(ptr) => ptr,
            Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY) if self.pending_frees() => {
                // Frees still queued hold memory the pool cannot hand out yet: let them run.
                let waited = self.pending();
                // SAFETY: the stream belongs to the current context.
                unsafe { result::stream::synchronize(stream) }.call("cuStreamSynchronize")?;
                self.released(waited);
                self.raw_alloc(stream, len)
                    .map_err(|code| out_of_memory(bytes, code))?
            }
            Err(code) => return Err(out_of_memory(bytes, code)),
        };
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let mut table = self.lock();
        table.live.insert(handle, DeviceView { ptr, len: bytes });
        table.live_bytes += bytes;
        Ok(BufferHandle(handle))
    }

    /// Frees a buffer in stream order: the handle is invalid at once, the memory is released
    /// when `stream` reaches the free.
    pub(crate) fn free(&self, stream: CUstream, buf: BufferHandle) -> Result<(), CudaError> {
        let mut table = self.lock();
        let Some(view) = table.live.get(&buf.0).copied() else {
            return Err(CudaError::Invalid(format!(
                "unknown buffer handle {}",
                buf.0
            )));
        };
        // The handle goes only once the driver took the free: a free that fails changes
        // nothing (the host's allocator keeps the buffer as live and may free it again).
        match self.allocator {
            Allocator::Pool(_) => {
                // Enqueued under the table lock, so `released` never clears a free it has not
                // waited for.
                // SAFETY: `view.ptr` came from this pool and is freed once (removed below).
                unsafe { result::free_async(view.ptr, stream) }.call("cuMemFreeAsync")?;
                table.pending_bytes += view.len;
                table.pending_buffers += 1;
            }
            Allocator::Plain => {
                // Out of the table first, so that no other thread uses it while the queue
                // drains; put back if the driver does not free it.
                table.live.remove(&buf.0);
                drop(table);
                // SAFETY: as above; waiting for the stream first makes the free queue-ordered.
                let freed = unsafe {
                    result::stream::synchronize(stream)
                        .call("cuStreamSynchronize")
                        .and_then(|()| result::free_sync(view.ptr).call("cuMemFree"))
                };
                let mut table = self.lock();
                if let Err(err) = freed {
                    table.live.insert(buf.0, view);
                    return Err(err);
                }
                table.live_bytes -= view.len;
                return Ok(());
            }
        }
        table.live.remove(&buf.0);
        table.live_bytes -= view.len;
        Ok(())
    }

    /// The bytes behind a live handle.
    pub(crate) fn get(&self, buf: BufferHandle) -> Option<DeviceView> {
        self.lock().live.get(&buf.0).copied()
    }

    /// The length of a live buffer, for argument checks.
    pub(crate) fn len(&self, buf: BufferHandle) -> Option<u64> {
        self.get(buf).map(|view| view.len)
    }

    /// `(allocated bytes, buffers)`, counting freed buffers whose release may be pending.
    pub(crate) fn accounting(&self) -> (u64, u64) {
        let table = self.lock();
        (
            table.live_bytes + table.pending_bytes,
            table.live.len() as u64 + table.pending_buffers,
        )
    }

    /// Whether stream-ordered frees may still be pending.
    pub(crate) fn pending_frees(&self) -> bool {
        self.lock().pending_buffers > 0
    }

    /// The frees enqueued so far whose release may not have happened: take it before waiting
    /// for the stream, and hand it to [`Memory::released`] after.
    pub(crate) fn pending(&self) -> Pending {
        let table = self.lock();
        Pending {
            bytes: table.pending_bytes,
            buffers: table.pending_buffers,
        }
    }

    /// Records that the frees counted in `waited` (taken before a wait for the stream) have
    /// taken effect. Frees another thread enqueued during the wait stay pending: the wait may
    /// have returned before the stream reached them.
    pub(crate) fn released(&self, waited: Pending) {
        let mut table = self.lock();
        table.pending_bytes = table.pending_bytes.saturating_sub(waited.bytes);
        table.pending_buffers = table.pending_buffers.saturating_sub(waited.buffers);
    }

    /// Clears pending frees if `stream` has no work left (`cuStreamQuery`).
    pub(crate) fn refresh(&self, stream: CUstream) -> Result<(), CudaError> {
        let mut table = self.lock();
        if table.pending_buffers == 0 {
            return Ok(());
        }
        // SAFETY: the stream belongs to the current context.
        match unsafe { sys::cuStreamQuery(stream) } {
            CUresult::CUDA_SUCCESS => {
                table.pending_bytes = 0;
                table.pending_buffers = 0;
                Ok(())
            }
            CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            code => Err(CudaError::Driver {
                call: "cuStreamQuery",
                code,
            }),
        }
    }

    /// Bytes the pool holds beyond the buffers in use (freed, not yet released to the driver).
    pub(crate) fn pool_cached(&self) -> Result<u64, CudaError> {
        let Allocator::Pool(pool) = self.allocator else {
            return Ok(0);
        };
        let reserved = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )?;
        let used = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )?;
        Ok(reserved.saturating_sub(used))
    }

    /// Frees every live buffer (closing the device), waits for the stream and destroys the pool.
    /// Returns the first error; keeps going after one.
    pub(crate) fn release_all(&self, stream: CUstream) -> Result<(), CudaError> {
        let views: Vec<DeviceView> = {
            let mut table = self.lock();
            table.live_bytes = 0;
            table.live.drain().map(|(_, view)| view).collect()
        };
        let mut first = None;
        let mut note = |outcome: Result<(), CudaError>| {
            if let Err(err) = outcome {
                first.get_or_insert(err);
            }
        };
        for view in views {
            // SAFETY: each address came from this allocator and was removed from the table, so
            // it is freed once.
            note(match self.allocator {
                Allocator::Pool(_) => {
                    unsafe { result::free_async(view.ptr, stream) }.call("cuMemFreeAsync")
                }
                Allocator::Plain => unsafe { result::free_sync(view.ptr) }.call("cuMemFree"),
            });
        }
        let waited = self.pending();
        // SAFETY: the stream belongs to the current context.
        note(unsafe { result::stream::synchronize(stream) }.call("cuStreamSynchronize"));
        self.released(waited);
        if let Allocator::Pool(pool) = self.allocator {
            // SAFETY: every allocation of the pool was freed and the stream has drained.
            note(unsafe { result::mem_pool::destroy(pool) }.call("cuMemPoolDestroy"));
        }
        first.map_or(Ok(()), Err)
    }

    fn raw_alloc(&self, stream: CUstream, len: usize) -> Result<CUdeviceptr, CUresult> {
        // SAFETY: the pool and stream belong to the current context; the memory is returned
        // uninitialised, which the ABI allows.
        unsafe {
            match self.allocator {
                Allocator::Pool(pool) => result::mem_pool::alloc_async(pool, len, stream),
                Allocator::Plain => result::malloc_sync(len),
            }
        }
        .map_err(|err| err.0)
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table's updates cannot be left half done by a panic; keep serving.
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Whether `ptr` points into page-locked host memory (ours from `alloc_host`, or any the
/// process registered with the driver). The driver does not know pageable memory: it answers
/// `CUDA_ERROR_INVALID_VALUE`, which means "no" here.
pub(crate) fn is_page_locked(ptr: *const u8) -> bool {
    let mut kind: u32 = 0;
    // SAFETY: the attribute writes one `CUmemorytype` (a u32) into `kind`; the address is only
    // looked up, never dereferenced.
    let code = unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as CUdeviceptr,
        )
    };
    code == CUresult::CUDA_SUCCESS && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

/// Copies `src` to device address `dst` in `stream`'s order and returns once `src` may be
/// reused, as the ABI's `write` promises: from pageable memory the driver stages the bytes
/// before `cuMemcpyHtoDAsync` returns, but from page-locked memory the copy runs later, so the
/// call then waits for it on an event.
pub(crate) fn write_from_host(
    dst: CUdeviceptr,
    src: &[u8],
    stream: CUstream,
) -> Result<(), CudaError> {
    let page_locked = is_page_locked(src.as_ptr());
    // SAFETY: the caller checked `dst .. dst + src.len()` against a live buffer; `src` stays
    // borrowed until the copy has read it (below, for page-locked memory).
    unsafe { result::memcpy_htod_async(dst, src, stream) }.call("cuMemcpyHtoDAsync")?;
    if page_locked {
        let waited = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .call("cuEventCreate")
            .map(Event)
            .and_then(|event| {
                // SAFETY: event and stream belong to the current context; the event lives
                // until after the wait.
                unsafe {
                    result::event::record(event.0, stream).call("cuEventRecord")?;
                    result::event::synchronize(event.0).call("cuEventSynchronize")
                }
            });
        if waited.is_err() {
            // The copy is queued and reads `src` when it runs, and the caller may reuse `src`
            // once this returns, error or not: wait for the whole queue instead.
            let _ = wait(stream);
        }
        waited?;
    }
    Ok(())
}

/// Waits until every operation enqueued on `stream` has completed.
pub(crate) fn wait(stream: CUstream) -> Result<(), CudaError> {
    // SAFETY: the stream belongs to the current context.
    unsafe { result::stream::synchronize(stream) }.call("cuStreamSynchronize")
}

/// Enqueues a copy of `bytes` between device addresses.
///
/// # Safety
/// Both ranges must lie in live device memory of the current context and must not overlap.
pub(crate) unsafe fn copy_device(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: u64,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: by the caller's contract.
    unsafe { result::memcpy_dtod_async(dst, src, crate::usize_of(bytes), stream) }
        .call("cuMemcpyDtoDAsync")
}

/// Enqueues a fill of `bytes` at `ptr` with `value` repeated at `width` bytes (1, 2 or 4).
///
/// # Safety
/// The range must lie in live device memory of the current context; `ptr` and `bytes` must be
/// multiples of `width`.
pub(crate) unsafe fn fill(
    ptr: CUdeviceptr,
    width: u32,
    value: u32,
    bytes: u64,
    stream: CUstream,
) -> Result<(), CudaError> {
    let count = crate::usize_of(bytes);
    let [b0, b1, _, _] = value.to_le_bytes();
    // SAFETY: by the caller's contract; each memset writes `count / width` elements.
    let (call, code) = unsafe {
        match width {
            1 => (
                "cuMemsetD8Async",
                sys::cuMemsetD8Async(ptr, b0, count, stream),
            ),
            2 => (
                "cuMemsetD16Async",
                sys::cuMemsetD16Async(ptr, u16::from_le_bytes([b0, b1]), count / 2, stream),
            ),
            _ => (
                "cuMemsetD32Async",
                sys::cuMemsetD32Async(ptr, value, count / 4, stream),
            ),
        }
    };
    code.result().call(call)
}

/// Enqueues a copy from device memory into a host slice.
///
/// # Safety
/// `src .. src + dst.len()` must lie in live device memory of the current context; `dst` must
/// stay valid and unread until the stream has been waited for.
pub(crate) unsafe fn read_to_host(
    dst: &mut [u8],
    src: CUdeviceptr,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: by the caller's contract.
    unsafe { result::memcpy_dtoh_async(dst, src, stream) }.call("cuMemcpyDtoHAsync")
}

/// Enqueues a copy of `bytes` from page-locked host memory at `host` to device memory.
///
/// # Safety
/// Both ranges must be live (the host range page-locked) and the host range unchanged until a
/// later wait covers the copy.
pub(crate) unsafe fn upload(
    device: CUdeviceptr,
    host: *const u8,
    bytes: u64,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: by the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(device, host.cast(), crate::usize_of(bytes), stream) }
        .result()
        .call("cuMemcpyHtoDAsync")
}

/// Enqueues a copy of `bytes` from device memory to page-locked host memory at `host`.
///
/// # Safety
/// Both ranges must be live (the host range page-locked) and the host range unread until a
/// later wait covers the copy.
pub(crate) unsafe fn download(
    host: *mut u8,
    device: CUdeviceptr,
    bytes: u64,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: by the caller's contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), device, crate::usize_of(bytes), stream) }
        .result()
        .call("cuMemcpyDtoHAsync")
}

/// Pinned (page-locked) host buffers for `alloc_host`.
pub struct HostBuffers {
    table: Mutex<HashMap<u64, (usize, usize)>>,
    next: AtomicU64,
}

impl Default for HostBuffers {
    fn default() -> Self {
        HostBuffers {
            table: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }
}

impl HostBuffers {
    /// Allocates `bytes` of page-locked host memory. Flags 0: cached, not write-combined, so
    /// the host reads downloads at full speed.
    pub(crate) fn alloc(&self, bytes: u64) -> Result<HostAlloc, CudaError> {
        let len = usize::try_from(bytes)
            .map_err(|_| CudaError::Invalid(format!("{bytes} bytes do not fit in memory")))?;
        // SAFETY: a plain host allocation with no flags; the context is current.
        let ptr = unsafe { result::malloc_host(len, 0) }
            .map_err(|err| CudaError::driver("cuMemHostAlloc", err))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, (ptr as usize, len));
        Ok(HostAlloc {
            id: HostBufferId(id),
            ptr: ptr.cast::<u8>(),
            len: bytes,
        })
    }

    /// The address and length of a live host buffer.
    pub(crate) fn get(&self, id: HostBufferId) -> Option<(usize, usize)> {
        self.lock().get(&id.0).copied()
    }

    /// Forgets a host buffer and returns its address; the caller frees it once the queue no
    /// longer uses it.
    pub(crate) fn take(&self, id: HostBufferId) -> Option<usize> {
        self.lock().remove(&id.0).map(|(ptr, _)| ptr)
    }

    /// Frees one buffer's memory.
    ///
    /// # Safety
    /// `ptr` must come from [`HostBuffers::take`] and no queued work may still use it.
    pub(crate) unsafe fn free(ptr: usize) -> Result<(), CudaError> {
        // SAFETY: by the caller's contract.
        unsafe { result::free_host(ptr as *mut c_void) }.call("cuMemFreeHost")
    }

    /// Takes every live buffer (closing the device).
    pub(crate) fn drain(&self) -> Vec<usize> {
        self.lock().drain().map(|(_, (ptr, _))| ptr).collect()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, (usize, usize)>> {
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Fences: CUDA events recorded on the queue, numbered in the order they were recorded.
#[derive(Default)]
pub struct Fences {
    state: Mutex<FenceState>,
}

#[derive(Default)]
struct FenceState {
    next: u64,
    /// Events not yet known complete, oldest first.
    open: VecDeque<(u64, Arc<Event>)>,
}

/// One recorded event; destroyed when the last reference goes (a waiter may hold one while
/// another thread retires it from the list).
struct Event(CUevent);

// SAFETY: an event handle is a driver object usable from any thread while its context lives.
unsafe impl Send for Event {}
// SAFETY: as above; the driver synchronises its use.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event was created by `Fences::record` or `write_from_host` and this is its
        // only destruction.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

impl Fences {
    /// Records a fence after the work enqueued on `stream` so far.
    pub(crate) fn record(&self, stream: CUstream) -> Result<u64, CudaError> {
        let mut state = self.lock();
        // Retire events already complete, so the list stays short without a waiter.
        while let Some((_, event)) = state.open.front() {
            // SAFETY: the event is alive (referenced by the list).
            if unsafe { sys::cuEventQuery(event.0) } != CUresult::CUDA_SUCCESS {
                break;
            }
            state.open.pop_front();
        }
        let event = Event(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .call("cuEventCreate")?,
        );
        // SAFETY: event and stream belong to the current context.
        unsafe { result::event::record(event.0, stream) }.call("cuEventRecord")?;
        state.next += 1;
        let value = state.next;
        state.open.push_back((value, Arc::new(event)));
        Ok(value)
    }

    /// Waits until fence `value` has completed.
    pub(crate) fn wait(&self, value: u64) -> Result<(), CudaError> {
        let event = {
            let state = self.lock();
            if value == 0 || value > state.next {
                return Err(CudaError::Invalid(format!(
                    "fence {value} was never recorded (the last one is {})",
                    state.next
                )));
            }
            match state.open.iter().find(|(v, _)| *v == value) {
                Some((_, event)) => Arc::clone(event),
                // Found complete earlier and retired.
                None => return Ok(()),
            }
        };
        // SAFETY: the event is alive while `event` holds a reference.
        unsafe { result::event::synchronize(event.0) }.call("cuEventSynchronize")?;
        let mut state = self.lock();
        // Events up to `value` are complete: the queue runs in order.
        while state.open.front().is_some_and(|(v, _)| *v <= value) {
            state.open.pop_front();
        }
        Ok(())
    }

    /// Destroys every event (closing the device, after the queue drained).
    pub(crate) fn clear(&self) {
        self.lock().open.clear();
    }

    fn lock(&self) -> MutexGuard<'_, FenceState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn create_pool(device: i32) -> Result<CUmemoryPool, CudaError> {
    // SAFETY: the properties struct is plain data; zero is valid for every field not set.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = device;
    // SAFETY: `props` is a valid, fully initialised struct.
    let pool = unsafe { result::mem_pool::create(&props) }.call("cuMemPoolCreate")?;
    let mut threshold: u64 = 0;
    // SAFETY: the release threshold is a u64 attribute of a live pool.
    let set = unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    if let Err(err) = set {
        // SAFETY: the pool was just created and holds nothing.
        let _ = unsafe { result::mem_pool::destroy(pool) };
        return Err(CudaError::driver("cuMemPoolSetAttribute", err));
    }
    Ok(pool)
}

fn pool_attribute(pool: CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64, CudaError> {
    let mut value: u64 = 0;
    // SAFETY: both attributes read are u64 values of a live pool.
    unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
        .call("cuMemPoolGetAttribute")?;
    Ok(value)
}

fn out_of_memory(requested: u64, code: CUresult) -> CudaError {
    if code != CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return CudaError::Driver {
            call: "cuMemAllocFromPoolAsync",
            code,
        };
    }
    let (free, total) = result::mem_get_info().unwrap_or((0, 0));
    CudaError::OutOfMemory {
        what: "device memory".into(),
        requested,
        free: free as u64,
        total: total as u64,
        code,
    }
}

/// Bytes of one page-locked slot of [`AsyncUploads`].
const UPLOAD_SLOT_BYTES: usize = 32 << 20;
/// Slots of [`AsyncUploads`]: a write of more than one slot fills the next while the queue
/// copies the last.
const UPLOAD_SLOTS: usize = 4;

/// `write_async` through page-locked slots: a host function on a stream of its own (run by the
/// driver's thread, not the caller's) copies each piece of the host's bytes into a slot, and
/// the queue, once that has run, copies the slot to the device. The caller returns at once,
/// the host's bytes are read before the queue passes the write (so before any later fence),
/// and the copy into the slot overlaps the queue's earlier work.
pub(crate) struct AsyncUploads {
    /// The stream the host functions run on.
    copy_stream: CUstream,
    slots: Vec<UploadSlot>,
    next: usize,
}

/// One page-locked slot and its two events: `filled` after the host function, on the copy
/// stream; `free` after the device copy out of it, on the queue.
struct UploadSlot {
    host: *mut u8,
    filled: Event,
    free: Event,
}

// SAFETY: the stream, events and page-locked memory are driver objects usable from any thread
// while the context lives; the structure is used under the device's mutex.
unsafe impl Send for AsyncUploads {}

/// What a host function copies: `len` bytes from `src` to `dst`.
struct HostCopy {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

/// The host function of [`AsyncUploads::write`].
///
/// # Safety
/// `data` is a `Box<HostCopy>` leaked for this one call, whose ranges are live and disjoint.
unsafe extern "C" fn host_copy(data: *mut c_void) {
    // SAFETY: by the function's contract; the box is taken back once.
    let copy = unsafe { Box::from_raw(data.cast::<HostCopy>()) };
    // SAFETY: the source is the host's lent memory, the destination a slot no device copy
    // reads now (the copy stream waited for the slot's `free` event).
    unsafe { std::ptr::copy_nonoverlapping(copy.src, copy.dst, copy.len) };
}

impl AsyncUploads {
    /// The copy stream, the events and the page-locked slots, in the current context.
    pub(crate) fn new() -> Result<AsyncUploads, CudaError> {
        let mut copy_stream = std::ptr::null_mut();
        // SAFETY: creates a stream in the current context.
        unsafe {
            sys::cuStreamCreate(
                &mut copy_stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        }
        .result()
        .call("cuStreamCreate")?;
        let mut uploads = AsyncUploads {
            copy_stream,
            slots: Vec::with_capacity(UPLOAD_SLOTS),
            next: 0,
        };
        for _ in 0..UPLOAD_SLOTS {
            let event = || {
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .call("cuEventCreate")
                    .map(Event)
            };
            let (filled, free) = (event()?, event()?);
            // SAFETY: a page-locked host allocation in the current context, freed on drop.
            let host = unsafe { result::malloc_host(UPLOAD_SLOT_BYTES, 0) }
                .map_err(|err| CudaError::driver("cuMemHostAlloc", err))?;
            uploads.slots.push(UploadSlot {
                host: host.cast::<u8>(),
                filled,
                free,
            });
        }
        Ok(uploads)
    }

    /// Enqueues the copy of `bytes` host bytes at `src` to `dst` on `stream`, the queue.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must lie in live device memory, and `src .. src + bytes` in host
    /// memory that stays valid and unchanged until work enqueued on `stream` after this call
    /// has completed.
    pub(crate) unsafe fn write(
        &mut self,
        dst: CUdeviceptr,
        src: *const u8,
        bytes: u64,
        stream: CUstream,
    ) -> Result<(), CudaError> {
        let mut launched = false;
        // SAFETY: the caller's contract, passed on.
        let enqueued = unsafe { self.enqueue(dst, src, bytes, stream, &mut launched) };
        if enqueued.is_err() && launched {
            // A host function already on the copy stream reads `src` when it runs, and a
            // caller told of an error may free `src` at once: wait until the copy stream has
            // run it (and anything it waits for) first.
            // SAFETY: the copy stream belongs to the current context.
            let _ = unsafe { sys::cuStreamSynchronize(self.copy_stream) };
        }
        enqueued
    }

    /// [`AsyncUploads::write`]'s pieces; `launched` says whether a host function reading
    /// `src` was enqueued, so that a failure can wait for it.
    ///
    /// # Safety
    /// As [`AsyncUploads::write`].
    unsafe fn enqueue(
        &mut self,
        dst: CUdeviceptr,
        src: *const u8,
        bytes: u64,
        stream: CUstream,
        launched: &mut bool,
    ) -> Result<(), CudaError> {
        let total = crate::usize_of(bytes);
        let mut done = 0;
        while done < total {
            let len = (total - done).min(UPLOAD_SLOT_BYTES);
            let slot = &self.slots[self.next];
            self.next = (self.next + 1) % self.slots.len();
            // SAFETY: streams and events belong to the current context. The copy stream waits
            // until the queue has copied the slot's last contents out (an event never recorded
            // is complete); the host function gets the box, which it frees (on failure to
            // enqueue, it is freed here); the queue's copy waits for the host function.
            unsafe {
                sys::cuStreamWaitEvent(self.copy_stream, slot.free.0, 0)
                    .result()
                    .call("cuStreamWaitEvent")?;
                let copy = Box::into_raw(Box::new(HostCopy {
                    src: src.add(done),
                    dst: slot.host,
                    len,
                }));
                let status = sys::cuLaunchHostFunc(self.copy_stream, Some(host_copy), copy.cast());
                if status != CUresult::CUDA_SUCCESS {
                    drop(Box::from_raw(copy));
                    status.result().call("cuLaunchHostFunc")?;
                }
                *launched = true;
                result::event::record(slot.filled.0, self.copy_stream).call("cuEventRecord")?;
                sys::cuStreamWaitEvent(stream, slot.filled.0, 0)
                    .result()
                    .call("cuStreamWaitEvent")?;
                upload(dst + done as u64, slot.host, len as u64, stream)?;
                result::event::record(slot.free.0, stream).call("cuEventRecord")?;
            }
            done += len;
        }
        Ok(())
    }
}

impl Drop for AsyncUploads {
    fn drop(&mut self) {
        // SAFETY: the stream was created by `new`; once it and the queue (the caller drained it)
        // have finished, no host function or copy uses the slots, each freed once.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.copy_stream);
            let _ = sys::cuStreamDestroy_v2(self.copy_stream);
            for slot in &self.slots {
                let _ = result::free_host(slot.host.cast());
            }
        }
    }
}
