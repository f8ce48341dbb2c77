//! The runtime's objects as RAII values: the device binding, a context, a stream, an event.
//!
//! Teardown order is CANN's: events, then streams, then contexts, then the device. Drops of
//! streams and events must run on a thread whose current context is theirs; the device sets
//! its context before dropping them (see `device.rs`).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use crate::error::AscendError;
use crate::runtime::Runtime;
use crate::sys;

/// Opens of each device in this process: `aclrtSetDevice` on the first, `aclrtResetDevice`
/// after the last. A reset releases everything the process holds on the device, so a second
/// open of the same NPU must not lose its resources when the first closes.
static DEVICE_USERS: Mutex<BTreeMap<i32, usize>> = Mutex::new(BTreeMap::new());

/// One open of a device in this process (`aclrtSetDevice`, released with `aclrtResetDevice`
/// when the last open is dropped).
pub struct DeviceBinding {
    rt: &'static Runtime,
    id: i32,
}

impl DeviceBinding {
    /// Binds device `id` to the calling thread and counts this open.
    pub fn acquire(rt: &'static Runtime, id: i32) -> Result<DeviceBinding, AscendError> {
        let mut counts = DEVICE_USERS
            .lock()
            .map_err(|_| AscendError::Internal("the device table lock is poisoned".into()))?;
        let set = rt
            .acl()
            .aclrtSetDevice
            .as_ref()
            .map_err(|_| rt.missing("aclrtSetDevice"))?;
        // SAFETY: a plain call with a device index; the runtime checks the index. Also needed
        // when the device is already counted, to bind it to this thread.
        rt.check("aclrtSetDevice", unsafe { set(id) })?;
        *counts.entry(id).or_insert(0) += 1;
        Ok(DeviceBinding { rt, id })
    }

    /// The device index.
    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for DeviceBinding {
    fn drop(&mut self) {
        let Ok(mut counts) = DEVICE_USERS.lock() else {
            return;
        };
        let last = match counts.get_mut(&self.id) {
            Some(count) if *count > 1 => {
                *count -= 1;
                false
            }
            _ => {
                counts.remove(&self.id);
                true
            }
        };
        if last && let Ok(reset) = self.rt.acl().aclrtResetDevice.as_ref() {
            // SAFETY: every context, stream and event of this open was destroyed before the
            // binding (field order of the device); no other open of this device remains.
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
pub struct Stream {
    rt: &'static Runtime,
    raw: sys::aclrtStream,
}

// SAFETY: stream handles may be used from any thread whose current context is the stream's;
// the device sets its context at every entry and serialises enqueueing.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream in the calling thread's current context.
    pub fn create(rt: &'static Runtime, _context: &Context) -> Result<Stream, AscendError> {
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
        Ok(Stream { rt, raw })
    }

    /// The raw handle, for enqueueing calls.
    pub fn raw(&self) -> sys::aclrtStream {
        self.raw
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
        self.rt
            .check("aclrtSynchronizeStream", unsafe { sync(self.raw) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(destroy) = self.rt.acl().aclrtDestroyStream.as_ref() {
            // SAFETY: the stream is live; the device synchronised it and made its context
            // current before dropping it.
            let _ = unsafe { destroy(self.raw) };
        }
    }
}

/// An event (`aclrtCreateEvent`), recorded on the stream to know when the work before it is
/// done: queue-ordered frees, staging buffers, fences.
pub struct Event {
    rt: &'static Runtime,
    raw: sys::aclrtEvent,
}

// SAFETY: as for streams.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event and records it on `stream` after the work enqueued so far.
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
        let mut raw: sys::aclrtEvent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        rt.check("aclrtCreateEvent", unsafe { create(&mut raw) })?;
        let event = Event { rt, raw };
        // SAFETY: both handles are live and belong to the current context.
        rt.check("aclrtRecordEvent", unsafe { record(event.raw, stream.raw) })?;
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
        self.rt.check("aclrtQueryEventStatus", unsafe {
            query(self.raw, &mut status)
        })?;
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
        self.rt
            .check("aclrtSynchronizeEvent", unsafe { sync(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
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
