//! The CPU device's queue: what the asynchronous mode makes visible (work still queued when a
//! call returns, frees that take effect later, failures reported by a later call), and the
//! fault injection options.

use std::sync::Arc;

use iris_plugin::abi::{BufferSlice, FillArgs, GemmArgs, StagedCopy};
use iris_plugin::{Activation, Backend, DType, Device, ErrorCode, Logger, MatRef, Plugin};

use iris_device_cpu::{CpuDevice, CpuOptions};

/// Long enough that the calls a test makes right after enqueueing finish well before the queue
/// gets to the work.
const DELAY_US: &str = "200000";

fn open(options: &[(&str, &str)]) -> Device {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let mut all = vec![
        ("threads".to_owned(), "1".to_owned()),
        ("capacity".to_owned(), "64MiB".to_owned()),
    ];
    all.extend(
        options
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    plugin.open(0, &all).expect("the CPU device opens")
}

fn fill(buf: iris_plugin::BufferHandle, bytes: u64, value: u32) -> FillArgs {
    FillArgs {
        dst: BufferSlice {
            buf,
            offset: 0,
            bytes,
        },
        value,
        width: 1,
    }
}

/// A free right after enqueueing work that uses the buffer is queue-ordered: the memory is
/// still held while the work waits, so a memory figure read without synchronising does not
/// show the release. After `synchronize` it does.
#[test]
fn memory_read_without_synchronising_sees_queued_work_unfinished() {
    const BYTES: u64 = 8 << 20;
    let device = open(&[("queue", "async"), ("queue_delay_us", DELAY_US)]);
    let before = device.mem_info().unwrap().free;
    let buf = device.alloc(BYTES).unwrap();
    device.fill(&fill(buf, BYTES, 7)).unwrap();
    device.free(buf).unwrap();
    let unsynchronised = device.mem_info().unwrap().free;
    assert_eq!(
        before - unsynchronised,
        BYTES,
        "the queued fill still holds the freed buffer"
    );
    assert_eq!(device.memory_report().unwrap().buffers, 1);
    device.synchronize().unwrap();
    assert_eq!(device.mem_info().unwrap().free, before);
    assert_eq!(device.memory_report().unwrap().buffers, 0);
}

/// The same sequence on the synchronous queue releases at once: the asynchronous mode is what
/// exposes a host that reads memory figures without synchronising.
#[test]
fn the_synchronous_queue_releases_at_once() {
    const BYTES: u64 = 8 << 20;
    let device = open(&[("queue", "sync")]);
    let before = device.mem_info().unwrap().free;
    let buf = device.alloc(BYTES).unwrap();
    device.fill(&fill(buf, BYTES, 7)).unwrap();
    device.free(buf).unwrap();
    assert_eq!(device.mem_info().unwrap().free, before);
}

/// Host staging memory read before the fence that orders it sees the download unfinished; after
/// the fence, the data. (Through the host's `HostBuffer` this cannot happen: it waits.)
#[test]
fn staging_memory_read_before_its_fence_holds_the_old_bytes() {
    let options = CpuOptions::parse(&[
        ("threads", "1"),
        ("capacity", "64MiB"),
        ("queue", "async"),
        ("queue_delay_us", DELAY_US),
    ])
    .unwrap();
    let device = CpuDevice::open(options, Logger::discard()).unwrap();
    let buf = device.alloc(4096).unwrap();
    device.fill(&fill(buf, 4096, 0xab)).unwrap();
    let host = device.alloc_host(4096).unwrap();
    // SAFETY: `host.ptr` is 4096 bytes of host memory the device gave out; nothing is queued
    // on it yet.
    unsafe { std::ptr::write_bytes(host.ptr, 0x11, 4096) };
    device
        .download(&StagedCopy {
            device: buf,
            device_offset: 0,
            host: host.id,
            host_offset: 0,
            bytes: 4096,
        })
        .unwrap();
    let fence = device.fence().unwrap();
    // SAFETY: reading the first byte while the queue still waits out its delay before the
    // fill and the download: the worker thread does not touch the memory yet.
    let early = unsafe { host.ptr.read_volatile() };
    assert_eq!(early, 0x11, "the download had not run yet");
    device.wait_fence(fence).unwrap();
    // SAFETY: the fence is complete; nothing else uses the memory.
    let late = unsafe { std::slice::from_raw_parts(host.ptr, 4096) };
    assert!(late.iter().all(|b| *b == 0xab));
    device.free_host(host.id).unwrap();
    device.free(buf).unwrap();
}

/// The host's staging buffers order themselves: reading one after a download waits for it.
#[test]
fn host_buffers_wait_for_their_transfers() {
    let device = Arc::new(open(&[("queue", "async"), ("queue_delay_us", "50000")]));
    let buf = device.alloc(4096).unwrap();
    device.fill(&fill(buf, 4096, 0x5c)).unwrap();
    let mut staging = device.host_buffer(4096).unwrap();
    assert!(staging.is_pinned());
    device.download(buf, 0, &mut staging, 0, 4096).unwrap();
    assert!(staging.as_slice().unwrap().iter().all(|b| *b == 0x5c));
    drop(staging);
    device.free(buf).unwrap();
}

fn gemm_args(device: &Device) -> GemmArgs {
    let buf = |rows, cols| {
        let b = device.alloc(rows * cols * 4).unwrap();
        MatRef::contiguous(b, 0, DType::F32, rows, cols)
    };
    GemmArgs {
        a: buf(4, 8),
        w: buf(3, 8),
        bias: MatRef::NONE,
        out: buf(4, 3),
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: false,
        workspace: BufferSlice::EMPTY,
    }
}

/// An injected op failure happens when the work runs: on the async queue the call returns and
/// the next call that waits reports it, naming the op and the call; on the sync queue the call
/// itself fails.
#[test]
fn an_injected_op_fault_surfaces_at_the_next_call_on_the_async_queue() {
    let device = open(&[("queue", "async"), ("fail_op", "gemm"), ("fail_op_at", "2")]);
    let args = gemm_args(&device);
    device.gemm(&args).unwrap();
    device
        .gemm(&args)
        .expect("enqueued; the failure comes later");
    let err = device.synchronize().unwrap_err();
    assert_eq!(err.code, ErrorCode::INTERNAL);
    assert!(
        err.message.contains("asynchronous failure of gemm (call #")
            && err.message.contains("injected fault (call #2 of gemm)"),
        "{err}"
    );
    // Reported once; the device goes on.
    device.gemm(&args).unwrap();
    device.synchronize().unwrap();

    let device = open(&[("queue", "sync"), ("fail_op", "gemm")]);
    let args = gemm_args(&device);
    let err = device.gemm(&args).unwrap_err();
    assert!(err.message.contains("injected fault"), "{err}");
    device.gemm(&args).unwrap();
}

#[test]
fn an_injected_op_panic_is_the_calls_error_and_the_device_goes_on() {
    let device = open(&[
        ("queue", "sync"),
        ("fail_op", "gemm"),
        ("fail_op_panics", "true"),
    ]);
    let args = gemm_args(&device);
    let err = device.gemm(&args).unwrap_err();
    assert_eq!(err.code, ErrorCode::INTERNAL);
    assert!(
        err.message.contains("panicked") && err.message.contains("injected fault"),
        "{err}"
    );
    device.gemm(&args).unwrap();
}

#[test]
fn an_injected_allocation_fault_is_out_of_memory_and_the_device_goes_on() {
    let device = open(&[("fail_alloc_every", "3")]);
    let mut outcomes = Vec::new();
    for _ in 0..6 {
        match device.alloc(1024) {
            Ok(buf) => {
                device.free(buf).unwrap();
                outcomes.push(true);
            }
            Err(err) => {
                assert!(err.is_out_of_memory(), "{err}");
                assert!(err.message.contains("injected"), "{err}");
                outcomes.push(false);
            }
        }
    }
    assert_eq!(outcomes, [true, true, false, true, true, false]);
}

#[test]
fn unknown_fault_options_are_named() {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let err = plugin
        .open(0, &[("fail_op".to_owned(), "gemmm".to_owned())])
        .unwrap_err();
    assert!(err.message.contains("unknown op `gemmm`"), "{err}");
}
