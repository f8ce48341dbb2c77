//! The AscendCL runtime (libacl_rt.so): initialisation, devices and their visibility,
//! contexts bound to threads, streams, events, memory and copies.
//!
//! What is emulated as the real runtime behaves:
//! - `aclInit` once per process (a second call returns 100002); calls before it fail with
//!   100001;
//! - `ASCEND_RT_VISIBLE_DEVICES` renumbers the NPUs the process sees;
//! - a context is current per thread (`aclrtSetDevice`, `aclrtCreateContext`,
//!   `aclrtSetCurrentContext`); calls that need a device fail with 107002 on a thread without
//!   one, and enqueueing on another device's stream fails with 107003;
//! - work on a stream runs in order on a worker thread, after the call that enqueued it
//!   returned; `aclrtMemcpy` and `aclrtFree` do not wait for it;
//! - `aclrtGetMemInfo` moves with allocations, and the runtime's own contexts and streams
//!   hold memory too (see [`DEFAULT_CONTEXT_BYTES`] and friends);
//! - errors of queued work surface at the next `aclrtSynchronizeStream` or
//!   `aclrtSynchronizeEvent`, once.
//!
//! What is not: timing, HBM bandwidth, cache effects, multi-process sharing, memory the driver
//! reserves before the process starts.

use std::cell::Cell;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::config;
use crate::error::{EmuError, codes, report};
use crate::memory::{self, Heap};
use crate::stream::{Job, StreamInner};

/// Memory the default context of `aclrtSetDevice` holds on its NPU.
pub const DEFAULT_CONTEXT_BYTES: u64 = 64 << 20;
/// Memory an explicit context holds.
pub const CONTEXT_BYTES: u64 = 32 << 20;
/// Memory a stream holds.
pub const STREAM_BYTES: u64 = 2 << 20;

const CONTEXT_MAGIC: u64 = 0x4354_5845_4d55_4c41;
const STREAM_MAGIC: u64 = 0x5354_5245_414d_454d;
const EVENT_MAGIC: u64 = 0x4556_454e_5445_4d55;

/// One emulated NPU.
pub struct Device {
    /// Physical index.
    pub physical: usize,
    /// Its memory.
    pub heap: Mutex<Heap>,
    /// Bytes held by contexts and streams.
    pub reserved: AtomicU64,
    default_context: OnceLock<usize>,
    /// `aclrtSetDevice` calls not yet matched by `aclrtResetDevice`: the default context is
    /// held while it is above 0.
    sets: AtomicU64,
}

impl Device {
    /// `(free, total)`.
    pub fn mem_info(&self) -> (u64, u64) {
        let heap = lock(&self.heap);
        let total = heap.capacity();
        let used = heap.used() + self.reserved.load(Ordering::SeqCst);
        (total.saturating_sub(used), total)
    }

    /// Checks that `[ptr, ptr + len)` lies in a live block of this NPU.
    pub fn check(&self, what: &str, ptr: usize, len: u64) -> Result<(), EmuError> {
        if len == 0 {
            return Ok(());
        }
        if lock(&self.heap).contains(ptr as *const u8, len) {
            Ok(())
        } else {
            Err(EmuError::new(
                codes::RT_DEVICE_MEM_ERROR,
                format!(
                    "{what}: device bytes [{ptr:#x}, +{len}) are not inside a live allocation of NPU {} (freed before the work using them ran, or never allocated)",
                    self.physical
                ),
            ))
        }
    }

    fn reserve(&self, bytes: u64) {
        self.reserved.fetch_add(bytes, Ordering::SeqCst);
    }

    fn unreserve(&self, bytes: u64) {
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// `aclrtContext`.
#[repr(C)]
pub struct Context {
    magic: u64,
    /// Its NPU.
    pub device: Arc<Device>,
    explicit: bool,
}

/// `aclrtStream`.
#[repr(C)]
pub struct Stream {
    magic: u64,
    /// The queue.
    pub inner: Arc<StreamInner>,
    /// Whether a destroy was refused already (`ASCEND_EMU_FAULTED_DESTROY_FAILS`).
    destroy_refused: AtomicBool,
}

/// `aclrtEvent`.
#[repr(C)]
pub struct Event {
    magic: u64,
    recorded: Mutex<Option<(Arc<StreamInner>, u64)>>,
}

struct Emu {
    devices: Vec<Arc<Device>>,
    visible: Vec<usize>,
}

static EMU: OnceLock<Result<Emu, String>> = OnceLock::new();
static INITIALISED: AtomicBool = AtomicBool::new(false);
/// Events created and not destroyed.
static LIVE_EVENTS: AtomicU64 = AtomicU64::new(0);
/// Events created so far.
static EVENTS_CREATED: AtomicU64 = AtomicU64::new(0);

/// `aclrtCreateEvent` calls that succeeded so far.
pub fn events_created() -> u64 {
    EVENTS_CREATED.load(Ordering::SeqCst)
}
static MALLOCS: AtomicU64 = AtomicU64::new(0);

/// Device allocations asked for so far.
pub fn mallocs() -> u64 {
    MALLOCS.load(Ordering::SeqCst)
}
static PINNED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

thread_local! {
    static CURRENT: Cell<*const Context> = const { Cell::new(std::ptr::null()) };
}

fn emu() -> Result<&'static Emu, EmuError> {
    EMU.get_or_init(|| {
        let cfg = config::get();
        let mut devices = Vec::new();
        for physical in 0..cfg.devices as usize {
            devices.push(Arc::new(Device {
                physical,
                heap: Mutex::new(Heap::new(cfg.hbm)?),
                reserved: AtomicU64::new(0),
                default_context: OnceLock::new(),
                sets: AtomicU64::new(0),
            }));
        }
        let visible = match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
            Ok(list) => list
                .split(',')
                .filter_map(|id| id.trim().parse::<usize>().ok())
                .filter(|id| *id < devices.len())
                .collect(),
            Err(_) => (0..devices.len()).collect(),
        };
        Ok(Emu { devices, visible })
    })
    .as_ref()
    .map_err(|message| EmuError::new(codes::RT_INTERNAL_ERROR, message.clone()))
}

/// Locks a mutex, ignoring poisoning (a panic inside the emulation is reported as an error
/// and must not wedge later calls).
pub fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs an entry point: stub mode, initialisation, panics and the recent message.
pub fn entry(name: &str, needs_init: bool, f: impl FnOnce() -> Result<(), EmuError>) -> i32 {
    if config::get().stub {
        return codes::STUB_MODE;
    }
    if needs_init && !INITIALISED.load(Ordering::SeqCst) {
        return report(&EmuError::new(
            codes::UNINITIALIZE,
            format!("{name} called before aclInit"),
        ));
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => codes::SUCCESS,
        Ok(Err(err)) => report(&err),
        Err(payload) => report(&EmuError::new(
            codes::RT_INTERNAL_ERROR,
            format!("{name} panicked: {}", panic_text(payload.as_ref())),
        )),
    }
}

/// The text of a panic payload.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned())
}

fn current() -> Result<&'static Context, EmuError> {
    let ptr = CURRENT.with(Cell::get);
    if ptr.is_null() {
        return Err(EmuError::new(
            codes::RT_CONTEXT_NULL,
            "no current context on this thread (call aclrtSetDevice or aclrtSetCurrentContext on every thread that uses the device)",
        ));
    }
    // SAFETY: only live contexts are made current; destroying one clears it on its thread.
    Ok(unsafe { &*ptr })
}

fn device(logical: i32) -> Result<Arc<Device>, EmuError> {
    let emu = emu()?;
    usize::try_from(logical)
        .ok()
        .and_then(|i| emu.visible.get(i))
        .map(|&physical| Arc::clone(&emu.devices[physical]))
        .ok_or_else(|| {
            EmuError::new(
                codes::RT_INVALID_DEVICEID,
                format!(
                    "device {logical} does not exist ({} visible)",
                    emu.visible.len()
                ),
            )
        })
}

fn out<T>(ptr: *mut T, value: T) -> Result<(), EmuError> {
    if ptr.is_null() {
        return Err(EmuError::new(codes::INVALID_PARAM, "null out-pointer"));
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { ptr.write(value) };
    Ok(())
}

/// `aclInit`.
pub fn init() -> i32 {
    if config::get().stub {
        return codes::STUB_MODE;
    }
    let forced = config::get().init_error;
    if forced != 0 && forced != codes::REPEAT_INITIALIZE {
        return report(&EmuError::new(forced, "aclInit failed (injected)"));
    }
    if let Err(err) = emu() {
        return report(&err);
    }
    if INITIALISED.swap(true, Ordering::SeqCst) || forced == codes::REPEAT_INITIALIZE {
        return report(&EmuError::new(
            codes::REPEAT_INITIALIZE,
            "aclInit was already called in this process",
        ));
    }
    if config::get().stats_at_exit {
        // SAFETY: registers a plain function without arguments, run once at exit.
        unsafe { libc::atexit(print_stats) };
    }
    codes::SUCCESS
}

/// Prints the process's counters to stderr (`ASCEND_EMU_STATS_AT_EXIT`), for measuring a
/// whole run of a program that loads the emulation.
extern "C" fn print_stats() {
    eprintln!(
        "emulated CANN: {} first phases, {} events created",
        crate::ops::first_phases(),
        events_created()
    );
}

/// `aclFinalize`: the emulation keeps its state (the process may initialise again).
pub fn finalize() -> i32 {
    entry("aclFinalize", true, || Ok(()))
}

/// `aclrtGetDeviceCount`.
pub fn get_device_count(count: *mut u32) -> i32 {
    entry("aclrtGetDeviceCount", true, || {
        let n = u32::try_from(emu()?.visible.len()).unwrap_or(0);
        out(count, n)
    })
}

/// `aclrtSetDevice`: opens the device's default context (at the first set) and makes it
/// current. Sets are counted, as on hardware: each needs its own `aclrtResetDevice`.
pub fn set_device(id: i32) -> i32 {
    entry("aclrtSetDevice", true, || {
        let dev = device(id)?;
        if dev.sets.fetch_add(1, Ordering::SeqCst) == 0 {
            dev.reserve(DEFAULT_CONTEXT_BYTES);
        }
        let ctx = *dev.default_context.get_or_init(|| {
            Box::into_raw(Box::new(Context {
                magic: CONTEXT_MAGIC,
                device: Arc::clone(&dev),
                explicit: false,
            })) as usize
        });
        CURRENT.with(|c| c.set(ctx as *const Context));
        Ok(())
    })
}

/// `aclrtResetDevice`: undoes one `aclrtSetDevice`; the last releases the default context's
/// memory. A reset without a set is a no-op.
pub fn reset_device(id: i32) -> i32 {
    entry("aclrtResetDevice", true, || {
        let dev = device(id)?;
        let before = dev
            .sets
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .unwrap_or(0);
        if before == 1 {
            dev.unreserve(DEFAULT_CONTEXT_BYTES);
        }
        CURRENT.with(|c| {
            // SAFETY: a current context is live.
            if !c.get().is_null() && Arc::ptr_eq(&unsafe { &*c.get() }.device, &dev) {
                c.set(std::ptr::null());
            }
        });
        Ok(())
    })
}

/// `aclrtCreateContext`.
pub fn create_context(context: *mut *mut c_void, id: i32) -> i32 {
    entry("aclrtCreateContext", true, || {
        let dev = device(id)?;
        dev.reserve(CONTEXT_BYTES);
        let ctx = Box::into_raw(Box::new(Context {
            magic: CONTEXT_MAGIC,
            device: dev,
            explicit: true,
        }));
        CURRENT.with(|c| c.set(ctx));
        out(context, ctx.cast::<c_void>())
    })
}

fn context_ref<'a>(ctx: *mut c_void) -> Result<&'a Context, EmuError> {
    if ctx.is_null() {
        return Err(EmuError::new(codes::RT_PARAM_INVALID, "null context"));
    }
    // SAFETY: non-null; the magic is checked.
    let c = unsafe { &*ctx.cast::<Context>() };
    if c.magic != CONTEXT_MAGIC {
        return Err(EmuError::new(codes::RT_PARAM_INVALID, "not a live context"));
    }
    Ok(c)
}

/// `aclrtDestroyContext`.
pub fn destroy_context(ctx: *mut c_void) -> i32 {
    entry("aclrtDestroyContext", true, || {
        let c = context_ref(ctx)?;
        if !c.explicit {
            return Err(EmuError::new(
                codes::RT_PARAM_INVALID,
                "the default context is released by aclrtResetDevice",
            ));
        }
        c.device.unreserve(CONTEXT_BYTES);
        CURRENT.with(|cur| {
            if cur.get() == ctx.cast::<Context>().cast_const() {
                cur.set(std::ptr::null());
            }
        });
        // SAFETY: a live explicit context from `create_context`, destroyed once (the magic is
        // cleared first).
        let mut boxed = unsafe { Box::from_raw(ctx.cast::<Context>()) };
        boxed.magic = 0;
        Ok(())
    })
}

/// `aclrtSetCurrentContext`.
pub fn set_current_context(ctx: *mut c_void) -> i32 {
    entry("aclrtSetCurrentContext", true, || {
        context_ref(ctx)?;
        CURRENT.with(|c| c.set(ctx.cast::<Context>()));
        Ok(())
    })
}

/// `aclrtCreateStream`: a queue with its worker thread, in the current context.
pub fn create_stream(stream: *mut *mut c_void) -> i32 {
    entry("aclrtCreateStream", true, || {
        let ctx = current()?;
        ctx.device.reserve(STREAM_BYTES);
        let inner = StreamInner::start(Arc::clone(&ctx.device))
            .inspect_err(|_| ctx.device.unreserve(STREAM_BYTES))?;
        let handle = Box::into_raw(Box::new(Stream {
            magic: STREAM_MAGIC,
            inner,
            destroy_refused: AtomicBool::new(false),
        }));
        out(stream, handle.cast::<c_void>())
    })
}

/// A stream handle, checked.
pub fn stream_ref<'a>(stream: *mut c_void) -> Result<&'a Stream, EmuError> {
    if stream.is_null() {
        return Err(EmuError::new(
            codes::RT_PARAM_INVALID,
            "null stream (the default stream is not emulated)",
        ));
    }
    // SAFETY: non-null; the magic is checked.
    let s = unsafe { &*stream.cast::<Stream>() };
    if s.magic != STREAM_MAGIC {
        return Err(EmuError::new(codes::RT_PARAM_INVALID, "not a live stream"));
    }
    Ok(s)
}

/// Checks that `stream` belongs to the current context's device.
fn stream_in_context<'a>(stream: *mut c_void) -> Result<&'a Stream, EmuError> {
    let s = stream_ref(stream)?;
    let ctx = current()?;
    if !Arc::ptr_eq(&ctx.device, &s.inner.device) {
        return Err(EmuError::new(
            codes::RT_STREAM_CONTEXT,
            "the stream belongs to another device than the current context",
        ));
    }
    Ok(s)
}

/// `aclrtDestroyStream`: waits for its work, stops its worker.
pub fn destroy_stream(stream: *mut c_void) -> i32 {
    entry("aclrtDestroyStream", true, || {
        let s = stream_in_context(stream)?;
        if config::get().faulted_destroy_fails
            && let Some(fault) = s.inner.sticky()
            && !s.destroy_refused.swap(true, Ordering::SeqCst)
        {
            return Err(fault);
        }
        s.inner.shutdown();
        s.inner.device.unreserve(STREAM_BYTES);
        // SAFETY: a live stream from `create_stream`, destroyed once.
        let mut boxed = unsafe { Box::from_raw(stream.cast::<Stream>()) };
        boxed.magic = 0;
        Ok(())
    })
}

/// `aclrtSynchronizeStream`.
pub fn synchronize_stream(stream: *mut c_void) -> i32 {
    entry("aclrtSynchronizeStream", true, || {
        stream_in_context(stream)?.inner.synchronize()
    })
}

/// `aclrtMalloc`: 32-byte aligned and padded with 32 bytes.
pub fn malloc(dev_ptr: *mut *mut c_void, size: usize, policy: u32) -> i32 {
    entry("aclrtMalloc", true, || {
        allocate("aclrtMalloc", dev_ptr, size, policy, memory::Entry::Malloc)
    })
}

/// `aclrtMallocAlign32`: 32-byte aligned, no padding. With `ASCEND_EMU_NO_MALLOC_ALIGN32` it
/// answers 207000 (feature not supported), as a runtime without it would be met.
pub fn malloc_align32(dev_ptr: *mut *mut c_void, size: usize, policy: u32) -> i32 {
    entry("aclrtMallocAlign32", true, || {
        if config::get().no_malloc_align32 {
            return Err(EmuError::new(
                codes::RT_FEATURE_NOT_SUPPORT,
                "aclrtMallocAlign32 is not supported by this runtime (ASCEND_EMU_NO_MALLOC_ALIGN32)",
            ));
        }
        allocate(
            "aclrtMallocAlign32",
            dev_ptr,
            size,
            policy,
            memory::Entry::MallocAlign32,
        )
    })
}

fn allocate(
    name: &str,
    dev_ptr: *mut *mut c_void,
    size: usize,
    policy: u32,
    kind: memory::Entry,
) -> Result<(), EmuError> {
    let ctx = current()?;
    if size == 0 || policy > 5 {
        return Err(EmuError::new(
            codes::INVALID_PARAM,
            format!("{name}: size {size}, policy {policy}"),
        ));
    }
    let n = MALLOCS.fetch_add(1, Ordering::SeqCst) + 1;
    let size = size as u64;
    if config::get().fail_malloc_at == Some(n) {
        return Err(EmuError::new(
            codes::RT_MEMORY_ALLOCATION,
            format!(
                "out of memory allocating {size} bytes (injected at device allocation #{n}, {name})"
            ),
        ));
    }
    let dev = &ctx.device;
    let limit = {
        let heap = lock(&dev.heap);
        heap.capacity()
            .saturating_sub(dev.reserved.load(Ordering::SeqCst))
    };
    let placed = lock(&dev.heap).alloc(memory::charged(size, policy, kind), limit);
    let ptr = placed.ok_or_else(|| {
        let (free, total) = dev.mem_info();
        EmuError::new(
            codes::RT_MEMORY_ALLOCATION,
            format!(
                "out of memory allocating {size} bytes on NPU {}: {free} of {total} bytes free",
                dev.physical
            ),
        )
    })?;
    out(dev_ptr, ptr.cast::<c_void>())
}

/// `aclrtFree`: immediate, as on hardware (it does not wait for queued work).
pub fn free(ptr: *mut c_void) -> i32 {
    entry("aclrtFree", true, || {
        let ctx = current()?;
        if lock(&ctx.device.heap).free(ptr.cast::<u8>()) {
            Ok(())
        } else {
            Err(EmuError::new(
                codes::RT_MEMORY_FREE,
                format!("aclrtFree({ptr:p}): not a live allocation"),
            ))
        }
    })
}

/// `aclrtMallocHost`: page-aligned host memory.
pub fn malloc_host(host_ptr: *mut *mut c_void, size: usize) -> i32 {
    entry("aclrtMallocHost", true, || {
        let layout = std::alloc::Layout::from_size_align(size.max(1), 4096)
            .map_err(|err| EmuError::new(codes::INVALID_PARAM, err.to_string()))?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(EmuError::new(
                codes::RT_MEMORY_ALLOCATION,
                "host allocation failed",
            ));
        }
        lock(&PINNED).push((ptr as usize, size.max(1)));
        out(host_ptr, ptr.cast::<c_void>())
    })
}

/// `aclrtFreeHost`.
pub fn free_host(ptr: *mut c_void) -> i32 {
    entry("aclrtFreeHost", true, || {
        let mut pinned = lock(&PINNED);
        let Some(index) = pinned.iter().position(|(p, _)| *p == ptr as usize) else {
            return Err(EmuError::new(
                codes::RT_MEMORY_FREE,
                format!("aclrtFreeHost({ptr:p}): not from aclrtMallocHost"),
            ));
        };
        let (p, size) = pinned.swap_remove(index);
        let layout = std::alloc::Layout::from_size_align(size, 4096)
            .map_err(|err| EmuError::new(codes::INVALID_PARAM, err.to_string()))?;
        // SAFETY: allocated by `malloc_host` with this layout, freed once.
        unsafe { std::alloc::dealloc(p as *mut u8, layout) };
        Ok(())
    })
}

/// Bytes of pinned host memory live.
pub fn pinned_bytes() -> u64 {
    lock(&PINNED).iter().map(|(_, size)| *size as u64).sum()
}

/// `aclrtGetMemInfo`: HBM on 910-class parts, DDR on the 310P; the other kind reports 0.
pub fn get_mem_info(attr: u32, free: *mut usize, total: *mut usize) -> i32 {
    entry("aclrtGetMemInfo", true, || {
        let ctx = current()?;
        const DDR: u32 = 0;
        const HBM: u32 = 1;
        let (f, t) = ctx.device.mem_info();
        let is_310p = config::get().is_310p();
        let (f, t) = match attr {
            HBM if !is_310p => (f, t),
            DDR if is_310p => (f, t),
            DDR | HBM => (0, 0),
            _ => {
                return Err(EmuError::new(
                    codes::INVALID_PARAM,
                    format!("memory attribute {attr} is not emulated"),
                ));
            }
        };
        out(free, usize::try_from(f).unwrap_or(usize::MAX))?;
        out(total, usize::try_from(t).unwrap_or(usize::MAX))
    })
}

/// Copy direction (`aclrtMemcpyKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    HostToHost,
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

fn kind(code: u32) -> Result<Kind, EmuError> {
    Ok(match code {
        0 => Kind::HostToHost,
        1 => Kind::HostToDevice,
        2 => Kind::DeviceToHost,
        3 => Kind::DeviceToDevice,
        _ => {
            return Err(EmuError::new(
                codes::INVALID_PARAM,
                format!("copy kind {code} is not emulated"),
            ));
        }
    })
}

fn check_copy(
    dev: &Device,
    dst: usize,
    dest_max: usize,
    src: usize,
    count: usize,
    k: Kind,
) -> Result<(), EmuError> {
    if count > dest_max {
        return Err(EmuError::new(
            codes::INVALID_PARAM,
            format!("copy of {count} bytes into {dest_max}"),
        ));
    }
    let n = count as u64;
    if matches!(k, Kind::HostToDevice | Kind::DeviceToDevice) {
        dev.check("copy destination", dst, n)?;
    }
    if matches!(k, Kind::DeviceToHost | Kind::DeviceToDevice) {
        dev.check("copy source", src, n)?;
    }
    Ok(())
}

/// `aclrtMemcpy`: immediate; it does not wait for queued work.
pub fn memcpy(dst: *mut c_void, dest_max: usize, src: *const c_void, count: usize, k: u32) -> i32 {
    entry("aclrtMemcpy", true, || {
        let ctx = current()?;
        let k = kind(k)?;
        check_copy(&ctx.device, dst as usize, dest_max, src as usize, count, k)?;
        // SAFETY: device ranges checked; host ranges are the caller's contract.
        unsafe { std::ptr::copy(src.cast::<u8>(), dst.cast::<u8>(), count) };
        Ok(())
    })
}

/// Alignment `aclrtMemcpyAsync` wants of both addresses of a device-to-device copy.
pub const D2D_ALIGN: usize = 64;

/// `aclrtMemcpyAsync`: checked and performed when the stream reaches it. A device-to-device
/// copy between addresses not both 64-byte aligned is refused (107008), as `acl_rt.h`
/// restricts it.
pub fn memcpy_async(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    k: u32,
    stream: *mut c_void,
) -> i32 {
    entry("aclrtMemcpyAsync", true, || {
        let s = stream_in_context(stream)?;
        let k = kind(k)?;
        let (dst, src) = (dst as usize, src as usize);
        if k == Kind::DeviceToDevice
            && !(dst.is_multiple_of(D2D_ALIGN) && src.is_multiple_of(D2D_ALIGN))
        {
            return Err(EmuError::new(
                codes::RT_ADDR_UNALIGNED,
                format!(
                    "aclrtMemcpyAsync: device-to-device copy from {src:#x} to {dst:#x}: both addresses must be {D2D_ALIGN}-byte aligned"
                ),
            ));
        }
        let job: Job = Box::new(move |dev: &Device| {
            check_copy(dev, dst, dest_max, src, count, k)?;
            // SAFETY: device ranges checked against live blocks; host ranges are the caller's
            // contract (pinned memory kept until the work is done).
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
            Ok(())
        });
        s.inner.submit(job);
        Ok(())
    })
}

/// `aclrtMemsetAsync`.
pub fn memset_async(
    dst: *mut c_void,
    max: usize,
    value: i32,
    count: usize,
    stream: *mut c_void,
) -> i32 {
    entry("aclrtMemsetAsync", true, || {
        let s = stream_in_context(stream)?;
        if count > max {
            return Err(EmuError::new(
                codes::INVALID_PARAM,
                format!("memset of {count} bytes into {max}"),
            ));
        }
        let dst = dst as usize;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let byte = value as u8;
        s.inner.submit(Box::new(move |dev: &Device| {
            dev.check("memset destination", dst, count as u64)?;
            // SAFETY: range checked against a live block.
            unsafe { std::ptr::write_bytes(dst as *mut u8, byte, count) };
            Ok(())
        }));
        Ok(())
    })
}

/// `aclrtCreateEvent`.
pub fn create_event(event: *mut *mut c_void) -> i32 {
    entry("aclrtCreateEvent", true, || {
        current()?;
        if let Some(max) = config::get().max_events
            && LIVE_EVENTS.load(Ordering::SeqCst) >= max
        {
            return Err(EmuError::new(
                codes::RT_NO_EVENT_RESOURCE,
                format!("no event resource: {max} events live (ASCEND_EMU_MAX_EVENTS)"),
            ));
        }
        LIVE_EVENTS.fetch_add(1, Ordering::SeqCst);
        EVENTS_CREATED.fetch_add(1, Ordering::SeqCst);
        let handle = Box::into_raw(Box::new(Event {
            magic: EVENT_MAGIC,
            recorded: Mutex::new(None),
        }));
        out(event, handle.cast::<c_void>())
    })
}

fn event_ref<'a>(event: *mut c_void) -> Result<&'a Event, EmuError> {
    if event.is_null() {
        return Err(EmuError::new(codes::RT_PARAM_INVALID, "null event"));
    }
    // SAFETY: non-null; the magic is checked.
    let e = unsafe { &*event.cast::<Event>() };
    if e.magic != EVENT_MAGIC {
        return Err(EmuError::new(codes::RT_PARAM_INVALID, "not a live event"));
    }
    Ok(e)
}

/// `aclrtDestroyEvent`.
pub fn destroy_event(event: *mut c_void) -> i32 {
    entry("aclrtDestroyEvent", true, || {
        event_ref(event)?;
        // SAFETY: a live event from `create_event`, destroyed once.
        let mut boxed = unsafe { Box::from_raw(event.cast::<Event>()) };
        boxed.magic = 0;
        LIVE_EVENTS.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    })
}

/// `aclrtRecordEvent`: marks the stream's work enqueued so far; the fault of a stream in
/// error (a task fault is sticky: recording on such a stream fails until it is destroyed).
pub fn record_event(event: *mut c_void, stream: *mut c_void) -> i32 {
    entry("aclrtRecordEvent", true, || {
        let e = event_ref(event)?;
        let s = stream_in_context(stream)?;
        if let Some(fault) = s.inner.sticky() {
            return Err(fault);
        }
        let seq = s.inner.submitted();
        *lock(&e.recorded) = Some((Arc::clone(&s.inner), seq));
        Ok(())
    })
}

/// `aclrtQueryEventStatus`: 1 when complete, 0 when not yet; the fault of a stream in error.
pub fn query_event_status(event: *mut c_void, status: *mut u32) -> i32 {
    entry("aclrtQueryEventStatus", true, || {
        let e = event_ref(event)?;
        let done = match &*lock(&e.recorded) {
            Some((stream, seq)) => {
                if let Some(fault) = stream.sticky() {
                    return Err(fault);
                }
                stream.completed() >= *seq
            }
            None => true,
        };
        out(status, u32::from(done))
    })
}

/// `aclrtSynchronizeEvent`: waits; reports an error of the work before the event.
pub fn synchronize_event(event: *mut c_void) -> i32 {
    entry("aclrtSynchronizeEvent", true, || {
        let e = event_ref(event)?;
        let recorded = lock(&e.recorded).clone();
        match recorded {
            Some((stream, seq)) => stream.wait_for(seq),
            None => Ok(()),
        }
    })
}

/// `aclrtGetSocName`.
pub fn soc_name() -> *const c_char {
    static NAME: OnceLock<std::ffi::CString> = OnceLock::new();
    if config::get().stub {
        return std::ptr::null();
    }
    NAME.get_or_init(|| std::ffi::CString::new(config::get().soc.clone()).unwrap_or_default())
        .as_ptr()
}

/// The CANN release the emulation reports (`aclsysGetCANNVersion`), distinct from the
/// AscendCL API version (`aclrtGetVersion`), as on a real install.
pub const CANN_VERSION: &str = "8.5.0";

/// `aclsysGetCANNVersion(name, version)`: `version` points at an `aclCANNPackageVersion`
/// (`char version[128]`, four `char[64]` parts, `char reserved[128]`); every package of the
/// header's enum (0 to 7) reports [`CANN_VERSION`].
pub fn cann_version(name: u32, version: *mut c_char) -> i32 {
    entry("aclsysGetCANNVersion", false, || {
        if version.is_null() || name > 7 {
            return Err(EmuError::new(
                codes::INVALID_PARAM,
                format!("aclsysGetCANNVersion: package {name}, version {version:p}"),
            ));
        }
        let mut record = [0u8; 128 + 4 * 64 + 128];
        let (major, rest) = CANN_VERSION
            .split_once('.')
            .unwrap_or((CANN_VERSION, "0.0"));
        let (minor, patch) = rest.split_once('.').unwrap_or((rest, "0"));
        for (at, text) in [
            (0, CANN_VERSION),
            (128, major),
            (192, minor),
            (256, "0"),
            (320, patch),
        ] {
            record[at..at + text.len()].copy_from_slice(text.as_bytes());
        }
        // SAFETY: the caller's `aclCANNPackageVersion` is `record.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(record.as_ptr(), version.cast::<u8>(), record.len())
        };
        Ok(())
    })
}

/// `aclrtGetVersion`.
pub fn get_version(major: *mut i32, minor: *mut i32, patch: *mut i32) -> i32 {
    entry("aclrtGetVersion", false, || {
        out(major, 1)?;
        out(minor, 0)?;
        out(patch, 0)
    })
}

/// Live device blocks and bytes charged on physical NPU `index`.
pub fn device_usage(index: usize) -> Option<(usize, u64, u64)> {
    let emu = emu().ok()?;
    let dev = emu.devices.get(index)?;
    let heap = lock(&dev.heap);
    Some((
        heap.blocks(),
        heap.used(),
        dev.reserved.load(Ordering::SeqCst),
    ))
}
