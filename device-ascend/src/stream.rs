//! The runtime's objects as RAII values: the device binding, a context, a stream, an event.
//!
//! Teardown order is CANN's: events, then streams, then contexts, then the device. Drops of
//! streams and events must run on a thread whose current context is theirs; the device sets
//! its context before dropping them (see `device.rs`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::AscendError;
use crate::runtime::Runtime;
use crate::sys;

/// One open of a device in this process: one `aclrtSetDevice`, undone by one
/// `aclrtResetDevice` when dropped. The runtime counts sets per device and releases the
/// device's default context at the last reset, so each open resets exactly once: a second
/// open of the same NPU keeps its resources when the first closes, and nothing stays behind
/// after the last.
pub struct DeviceBinding {
    rt: &'static Runtime,
    id: i32,
}

impl DeviceBinding {
    /// Binds device `id` to the calling thread (`aclrtSetDevice`).
    pub fn acquire(rt: &'static Runtime, id: i32) -> Result<DeviceBinding, AscendError> {
        let set = rt
            .acl()
            .aclrtSetDevice
            .as_ref()
            .map_err(|_| rt.missing("aclrtSetDevice"))?;
        // SAFETY: a plain call with a device index; the runtime checks the index.
        rt.check("aclrtSetDevice", unsafe { set(id) })?;
        Ok(DeviceBinding { rt, id })
    }

    /// The device index.
    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for DeviceBinding {
    fn drop(&mut self) {
        if let Ok(reset) = self.rt.acl().aclrtResetDevice.as_ref() {
            // SAFETY: every context, stream and event of this open was destroyed before the
            // binding (field order of the device); this undoes this open's one set.
            let _ = unsafe { reset(self.id) };
        }
    }
}

/// An explicit context on a device (`aclrtCreateContext`).
pub struct Context {
    rt: &'static Runtime,
    raw: sys::aclrtContext,
}

// SAFETY: a context handle may be made current on any thread (`aclrtSetCurrentContext`); the
// device serialises its use.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Creates a context on `device`; it becomes the calling thread's current context.
    pub fn create(rt: &'static Runtime, device: &DeviceBinding) -> Result<Context, AscendError> {
        let create = rt
            .acl()
            .aclrtCreateContext
            .as_ref()
            .map_err(|_| rt.missing("aclrtCreateContext"))?;
        let mut raw: sys::aclrtContext = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for the handle.
        rt.check("aclrtCreateContext", unsafe {
            create(&mut raw, device.id())
        })?;
        if raw.is_null() {
            return Err(AscendError::Internal(
                "aclrtCreateContext succeeded but returned no context".into(),
            ));
        }
        Ok(Context { rt, raw })
    }

    /// Makes this context current on the calling thread. Every entry point of the device
    /// calls it first: the host may call from any thread.
    pub fn make_current(&self) -> Result<(), AscendError> {
        let set = self
            .rt
            .acl()
            .aclrtSetCurrentContext
            .as_ref()
            .map_err(|_| self.rt.missing("aclrtSetCurrentContext"))?;
        // SAFETY: `raw` is a live context created by `create`.
        self.rt
            .check("aclrtSetCurrentContext", unsafe { set(self.raw) })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Ok(destroy) = self.rt.acl().aclrtDestroyContext.as_ref() {
            // SAFETY: the context is live and its streams and events are gone (drop order).
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// A stream (`aclrtCreateStream`): the device's one in-order queue.
///
/// A task fault (see [`crate::result::AclError::is_task_fault`]) leaves a stream in error for
/// good. Whichever call meets one (a synchronisation, an event of the stream) notes it here;
/// the device then rebuilds the stream ([`Stream::rebuild`]) and reports the fault once.
pub struct Stream {
    rt: &'static Runtime,
    /// The handle; replaced by `rebuild` under the device's lock.
    raw: AtomicPtr<c_void>,
    fault: Fault,
    /// Events done with, kept for the next record.
    pool: EventPool,
    /// Streams a rebuild replaced whose destroy failed: destroyed again with this one.
    stale: Mutex<Vec<RawStream>>,
}

/// A stream handle a rebuild could not destroy.
struct RawStream(sys::aclrtStream);

// SAFETY: as for `Stream`: only destroyed, under the device's lock or at its drop.
unsafe impl Send for RawStream {}

/// An event handle.
struct RawEvent(sys::aclrtEvent);

// SAFETY: an event handle may be used from any thread whose current context is its own; the
// device serialises its use.
unsafe impl Send for RawEvent {}

/// Idle events, recorded again instead of creating one per free, scratch release, staging
/// copy and fence. Bounded by [`EVENT_POOL`]; destroyed with the stream.
type EventPool = Arc<Mutex<Vec<RawEvent>>>;

/// Most idle events kept.
const EVENT_POOL: usize = 256;

/// The first task fault met on a stream, shared with the stream's events.
type Fault = Arc<Mutex<Option<AscendError>>>;

// SAFETY: stream handles may be used from any thread whose current context is the stream's;
// the device sets its context at every entry and serialises enqueueing.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream in the calling thread's current context.
    pub fn create(rt: &'static Runtime, _context: &Context) -> Result<Stream, AscendError> {
        Ok(Stream {
            rt,
            raw: AtomicPtr::new(create_stream(rt)?),
            fault: Arc::new(Mutex::new(None)),
            pool: Arc::new(Mutex::new(Vec::new())),
            stale: Mutex::new(Vec::new()),
        })
    }

    /// The raw handle, for enqueueing calls.
    pub fn raw(&self) -> sys::aclrtStream {
        self.raw.load(Ordering::SeqCst)
    }

    /// Waits for all work on the stream; reports its failure.
    pub fn synchronize(&self) -> Result<(), AscendError> {
        let sync = self
            .rt
            .acl()
            .aclrtSynchronizeStream
            .as_ref()
            .map_err(|_| self.rt.missing("aclrtSynchronizeStream"))?;
        // SAFETY: the stream is live.
        let result = self
            .rt
            .check("aclrtSynchronizeStream", unsafe { sync(self.raw()) });
        note_fault(&self.fault, result)
    }

    /// Takes the task fault met on this stream since the last call, if any.
    pub fn take_fault(&self) -> Option<AscendError> {
        self.fault.lock().ok().and_then(|mut fault| fault.take())
    }

    /// Replaces a stream in error with a new one in the current context (the caller's
    /// context, made current). The old stream is destroyed with the work still queued on it:
    /// after this, no queued work uses any block.
    ///
    /// Fails only when no new stream can be made. When the old stream cannot be destroyed,
    /// the new one serves all the same (the old one, in error, runs nothing more) and the
    /// old one is destroyed again with this one: that error is the `Ok` answer, to log.
    pub fn rebuild(&self, _context: &Context) -> Result<Option<AscendError>, AscendError> {
        let fresh = create_stream(self.rt)?;
        let old = self.raw.swap(fresh, Ordering::SeqCst);
        Ok(destroy_stream(self.rt, old).err().inspect(|_| {
            if let Ok(mut stale) = self.stale.lock() {
                stale.push(RawStream(old));
            }
        }))
    }
}

fn create_stream(rt: &'static Runtime) -> Result<sys::aclrtStream, AscendError> {
    let create = rt
        .acl()
        .aclrtCreateStream
        .as_ref()
        .map_err(|_| rt.missing("aclrtCreateStream"))?;
    let mut raw: sys::aclrtStream = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer; the context is current (caller's contract).
    rt.check("aclrtCreateStream", unsafe { create(&mut raw) })?;
    if raw.is_null() {
        return Err(AscendError::Internal(
            "aclrtCreateStream succeeded but returned no stream".into(),
        ));
    }
    Ok(raw)
}

fn destroy_stream(rt: &'static Runtime, raw: sys::aclrtStream) -> Result<(), AscendError> {
    let destroy = rt
        .acl()
        .aclrtDestroyStream
        .as_ref()
        .map_err(|_| rt.missing("aclrtDestroyStream"))?;
    // SAFETY: a live stream, destroyed once, with its context current (caller's contract).
    rt.check("aclrtDestroyStream", unsafe { destroy(raw) })
}

/// Notes a task fault in `result` for the device to recover from; passes `result` on.
fn note_fault(fault: &Fault, result: Result<(), AscendError>) -> Result<(), AscendError> {
    if let Err(err) = &result
        && err.is_task_fault()
        && let Ok(mut slot) = fault.lock()
    {
        slot.get_or_insert_with(|| err.clone());
    }
    result
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Events go before their stream (CANN's teardown order); every event of the device was
        // dropped into the pool before the stream (field order of the device).
        if let Ok(mut pool) = self.pool.lock()
            && let Ok(destroy) = self.rt.acl().aclrtDestroyEvent.as_ref()
        {
            for event in pool.drain(..) {
                // SAFETY: an idle event of this stream, destroyed once.
                let _ = unsafe { destroy(event.0) };
            }
        }
        // The device synchronised the stream and made its context current before dropping it.
        let _ = destroy_stream(self.rt, self.raw());
        if let Ok(mut stale) = self.stale.lock() {
            for old in stale.drain(..) {
                let _ = destroy_stream(self.rt, old.0);
            }
        }
    }
}

/// An event (`aclrtCreateEvent`), recorded on the stream to know when the work before it is
/// done: queue-ordered frees, staging buffers, fences.
pub struct Event {
    rt: &'static Runtime,
    raw: sys::aclrtEvent,
    /// Its stream's fault note.
    fault: Fault,
    /// Where it goes back when dropped.
    pool: EventPool,
}

// SAFETY: as for streams.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Takes an idle event of `stream` (or creates one) and records it on `stream` after the
    /// work enqueued so far.
    pub fn record(rt: &'static Runtime, stream: &Stream) -> Result<Event, AscendError> {
        let create = rt
            .acl()
            .aclrtCreateEvent
            .as_ref()
            .map_err(|_| rt.missing("aclrtCreateEvent"))?;
        let record = rt
            .acl()
            .aclrtRecordEvent
            .as_ref()
            .map_err(|_| rt.missing("aclrtRecordEvent"))?;
        let pooled = stream.pool.lock().ok().and_then(|mut pool| pool.pop());
        let raw = match pooled {
            Some(event) => event.0,
            None => {
                let mut raw: sys::aclrtEvent = std::ptr::null_mut();
                // SAFETY: `raw` is a valid out-pointer.
                rt.check("aclrtCreateEvent", unsafe { create(&mut raw) })?;
                raw
            }
        };
        let event = Event {
            rt,
            raw,
            fault: Arc::clone(&stream.fault),
            pool: Arc::clone(&stream.pool),
        };
        // SAFETY: both handles are live and belong to the current context.
        let recorded = rt.check("aclrtRecordEvent", unsafe {
            record(event.raw, stream.raw())
        });
        note_fault(&event.fault, recorded)?;
        Ok(event)
    }

    /// Whether the work before the event is done (without waiting).
    pub fn is_complete(&self) -> Result<bool, AscendError> {
        let query = self
            .rt
            .acl()
            .aclrtQueryEventStatus
            .as_ref()
            .map_err(|_| self.rt.missing("aclrtQueryEventStatus"))?;
        let mut status: sys::aclrtEventRecordedStatus::Type =
            sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_NOT_READY;
        // SAFETY: the event is live; `status` is a valid out-pointer.
        let queried = self.rt.check("aclrtQueryEventStatus", unsafe {
            query(self.raw, &mut status)
        });
        note_fault(&self.fault, queried)?;
        Ok(status == sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Waits until the work before the event is done; reports its failure.
    pub fn synchronize(&self) -> Result<(), AscendError> {
        let sync = self
            .rt
            .acl()
            .aclrtSynchronizeEvent
            .as_ref()
            .map_err(|_| self.rt.missing("aclrtSynchronizeEvent"))?;
        // SAFETY: the event is live.
        let result = self
            .rt
            .check("aclrtSynchronizeEvent", unsafe { sync(self.raw) });
        note_fault(&self.fault, result)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // Back to the pool: recording it again is allowed once nothing waits on it.
        if let Ok(mut pool) = self.pool.lock()
            && pool.len() < EVENT_POOL
        {
            pool.push(RawEvent(self.raw));
            return;
        }
        if let Ok(destroy) = self.rt.acl().aclrtDestroyEvent.as_ref() {
            // SAFETY: the event is live; destroying a recorded event is allowed once the
            // caller no longer waits on it.
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// A raw device address (what `aclrtMalloc` returns), offset by `bytes`.
pub fn offset_ptr(base: *mut c_void, bytes: u64) -> *mut c_void {
    // Offsets are checked against the buffer's length before any call; `wrapping_add` keeps
    // the arithmetic free of undefined behaviour for addresses the host never dereferences.
    base.cast::<u8>()
        .wrapping_add(usize::try_from(bytes).unwrap_or(usize::MAX))
        .cast::<c_void>()
}
