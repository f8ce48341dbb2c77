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

/// Runs `f` on a thread of its own; `None` if it has not returned within `secs` seconds (the
/// thread is left behind: a hang fails the test instead of stalling the suite).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
}

/// On the sync queue each call runs its work on the caller's thread: a second thread that
/// synchronises while the first is inside a call must wake when that call's work completes.
#[test]
fn a_second_thread_synchronising_on_the_sync_queue_wakes() {
    let device = Arc::new(open(&[("queue", "sync"), ("capacity", "256MiB")]));
    const BYTES: u64 = 32 << 20;
    let buf = device.alloc(BYTES).unwrap();
    let worker = {
        let device = Arc::clone(&device);
        std::thread::spawn(move || {
            for value in 0..40 {
                device.fill(&fill(buf, BYTES, value)).unwrap();
            }
        })
    };
    // Waits while the other thread is inside one of its fills, and again after it is done.
    let waiter = Arc::clone(&device);
    let waited = within(30, move || {
        (0..20).all(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            waiter.synchronize().is_ok()
        })
    });
    worker.join().unwrap();
    assert_eq!(
        waited,
        Some(true),
        "synchronize on a second thread never woke up"
    );
    device.free(buf).unwrap();
}

/// A fence is a queue position of its own: every call gives a larger value, even with no work
/// between, and a value never given out is refused rather than waited for forever.
#[test]
fn fences_increase_and_an_unrecorded_one_is_refused() {
    for queue in ["sync", "async"] {
        let options =
            CpuOptions::parse(&[("threads", "1"), ("capacity", "1MiB"), ("queue", queue)]).unwrap();
        let device = Arc::new(CpuDevice::open(options, Logger::discard()).unwrap());
        let first = device.fence().unwrap();
        let second = device.fence().unwrap();
        assert!(second > first, "{queue}: {first} then {second}");
        device.wait_fence(second).unwrap();
        device.wait_fence(first).unwrap();
        let waiter = Arc::clone(&device);
        let err = within(10, move || waiter.wait_fence(u64::MAX))
            .unwrap_or_else(|| panic!("{queue}: wait_fence(u64::MAX) blocked"))
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
        assert!(
            err.message.contains(&u64::MAX.to_string()),
            "{queue}: {err}"
        );
        // The device goes on.
        let buf = device.alloc(4096).unwrap();
        device.fill(&fill(buf, 4096, 1)).unwrap();
        let third = device.fence().unwrap();
        assert!(third > second);
        device.wait_fence(third).unwrap();
        device.synchronize().unwrap();
    }
}

/// Freeing a constant weight right after queueing a product on it is queue-ordered: the
/// product gets the weight it was queued with, whether the free puts the weight's bytes back
/// before, during or after the product looks it up.
#[test]
fn freeing_a_packed_weight_right_after_a_product_on_it_is_queue_ordered() {
    use iris_device_cpu::isa::Tier;
    if Tier::resolve(Tier::Avx2).0 != Tier::Avx2 {
        eprintln!("skipped: no AVX2, so no native bf16 kernel packs weights");
        return;
    }
    let device = open(&[
        ("capacity", "512MiB"),
        ("isa", "avx2"),
        ("queue", "async"),
        ("queue_delay_us", "2000"),
    ]);
    let (m, n, k) = (4u64, 4096u64, 4096u64);
    let bf16 = |i: u64, period: u64| {
        half::bf16::from_f32(((i % period) as f32 - (period / 2) as f32) * 0.125).to_le_bytes()
    };
    let weight = device.alloc(n * k * 2).unwrap();
    let values: Vec<u8> = (0..n * k).flat_map(|i| bf16(i, 13)).collect();
    device.write(weight, 0, &values).unwrap();
    let a_buf = device.alloc(m * k * 2).unwrap();
    let values: Vec<u8> = (0..m * k).flat_map(|i| bf16(i, 5)).collect();
    device.write(a_buf, 0, &values).unwrap();
    let a = MatRef::contiguous(a_buf, 0, DType::BF16, m, k);
    let w = MatRef::contiguous(weight, 0, DType::BF16, n, k);
    let product = |out| GemmArgs {
        a,
        w,
        bias: MatRef::NONE,
        out: MatRef::contiguous(out, 0, DType::BF16, m, n),
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: true,
        workspace: BufferSlice::EMPTY,
    };
    let reference = device.alloc(m * n * 2).unwrap();
    let raced = device.alloc(m * n * 2).unwrap();
    // Packed (and the weight's pages given back) before the race.
    device.gemm(&product(reference)).unwrap();
    device.synchronize().unwrap();
    assert!(device.memory_report().unwrap().held_bytes() > 0);
    device.gemm(&product(raced)).unwrap();
    device.free(weight).unwrap();
    device.synchronize().unwrap();
    let read = |buf| {
        let mut bytes = vec![0u8; usize::try_from(m * n * 2).unwrap()];
        device.read(buf, 0, &mut bytes).unwrap();
        bytes
    };
    let (want, got) = (read(reference), read(raced));
    let differing = want.iter().zip(&got).filter(|(a, b)| a != b).count();
    assert_eq!(
        differing, 0,
        "bytes differing from the product before the free"
    );
}

/// An injected op fault counts calls whose work is queued: a call answered with an earlier
/// failure (its work dropped) does not use it up.
#[test]
fn an_injected_op_fault_skips_calls_answered_with_an_earlier_failure() {
    use iris_plugin::abi::GatherArgs;
    let options = CpuOptions::parse(&[
        ("threads", "1"),
        ("capacity", "64MiB"),
        ("queue", "async"),
        ("fail_op", "gemm"),
        ("fail_op_at", "1"),
    ])
    .unwrap();
    let device = CpuDevice::open(options, Logger::discard()).unwrap();
    let buf = |bytes| device.alloc(bytes).unwrap();
    // A gather whose index is out of range fails when it runs.
    let (src, out, indices) = (buf(16), buf(16), buf(4));
    device.fill(&fill(indices, 4, 0x7f)).unwrap();
    device
        .gather_rows(&GatherArgs {
            src: MatRef::contiguous(src, 0, DType::F32, 1, 4),
            out: MatRef::contiguous(out, 0, DType::F32, 1, 4),
            indices: MatRef::vector(indices, 0, DType::I32, 1),
            workspace: BufferSlice::EMPTY,
        })
        .unwrap();
    // A download queued after the gather: once its bytes arrive, the gather's failure is kept.
    let staged = buf(64);
    device.fill(&fill(staged, 64, 0xab)).unwrap();
    let host = device.alloc_host(64).unwrap();
    device
        .download(&StagedCopy {
            device: staged,
            device_offset: 0,
            host: host.id,
            host_offset: 0,
            bytes: 64,
        })
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // SAFETY: reads one byte of host staging memory the device gave out; the queued download
    // writes it, and a volatile read of a byte observes either value.
    while unsafe { host.ptr.read_volatile() } != 0xab {
        assert!(
            std::time::Instant::now() < deadline,
            "the download never ran"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let (a, w, c) = (buf(4 * 8 * 4), buf(3 * 8 * 4), buf(4 * 3 * 4));
    let args = GemmArgs {
        a: MatRef::contiguous(a, 0, DType::F32, 4, 8),
        w: MatRef::contiguous(w, 0, DType::F32, 3, 8),
        bias: MatRef::NONE,
        out: MatRef::contiguous(c, 0, DType::F32, 4, 3),
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: false,
        workspace: BufferSlice::EMPTY,
    };
    let err = device.gemm(&args).unwrap_err();
    assert!(err.message.contains("gather_rows"), "{err}");
    // The first gemm that is queued is the one the fault picks.
    device.gemm(&args).unwrap();
    let err = device.synchronize().unwrap_err();
    assert!(
        err.message.contains("injected fault (call #1 of gemm)"),
        "{err}"
    );
    device.free_host(host.id).unwrap();
}

/// A refused `alloc(0)` is no allocation: it does not count toward `fail_alloc_at`.
#[test]
fn a_refused_empty_allocation_does_not_count_toward_an_injected_fault() {
    let device = open(&[("fail_alloc_at", "2")]);
    let first = device.alloc(64).unwrap();
    let err = device.alloc(0).unwrap_err();
    assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
    let err = device.alloc(64).unwrap_err();
    assert!(err.message.contains("injected"), "{err}");
    device.free(first).unwrap();
}
