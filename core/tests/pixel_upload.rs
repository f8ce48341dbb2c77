//! A step's pixels reach the device unchanged whichever way they travel: lent to the device's
//! queue (`write_async`, one copy per image made by the device, then a cast on the device for
//! a half-precision tower) or converted and staged on the calling thread, on the CPU device in
//! both queue modes.

use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::memory::CachingAllocator;
use iris_plugin::{DType, Device, Plugin};

/// Values per patch row of a 14x14 patch with 2 frames and 3 channels (Qwen2-VL's).
const ROW: usize = 1176;

fn device(queue: &str) -> Arc<Device> {
    let device = Plugin::builtin(iris_device_cpu::plugin_root())
        .open(
            0,
            &[
                ("capacity".into(), "256MiB".into()),
                ("queue".into(), queue.into()),
            ],
        )
        .expect("the CPU device opens");
    Arc::new(device)
}

/// Three images' pixels: one larger than a staging chunk (1 MiB) in every dtype, one smaller,
/// one of a single row.
fn images() -> Vec<Vec<f32>> {
    [600usize, 17, 1]
        .iter()
        .enumerate()
        .map(|(image, &rows)| {
            (0..rows * ROW)
                .map(|i| ((i * 31 + image * 7) % 251) as f32 / 125.0 - 1.0)
                .collect()
        })
        .collect()
}

fn check(queue: &str, dtype: DType) {
    let device = device(queue);
    let runner = Runner::new(CachingAllocator::new(Arc::clone(&device)));
    let images = images();
    let parts: Vec<&[f32]> = images.iter().map(Vec::as_slice).collect();
    let rows = (parts.iter().map(|p| p.len()).sum::<usize>() / ROW) as u64;

    let staged = runner
        .upload_f32_parts(&parts, dtype, rows, ROW as u64)
        .expect("staged upload");
    let before = device.counters();
    let (lent, waited) = device.with_async_writes(|writes| {
        runner.upload_f32_parts_lent(&parts, dtype, rows, ROW as u64, writes)
    });
    let lent = lent.expect("lent upload");
    waited.expect("the writes ran");
    let calls = device.counters().since(&before).host_to_device_calls;

    let want = runner.download_bytes(&staged).expect("download");
    let got = runner.download_bytes(&lent).expect("download");
    assert_eq!(got.len(), want.len());
    assert!(got == want, "{queue} queue, {dtype}: the bytes differ");
    // One write per image, made by the device: no staging chunks. Another dtype is written as
    // f32 and cast on the device, which rounds as the host's conversion does (the bytes
    // above are equal).
    assert!(device.has_async_write());
    assert_eq!(calls, parts.len() as u64, "{queue} queue, {dtype}: uploads");
}

#[test]
fn lent_f32_pixels_arrive_as_staged_ones_on_the_async_queue() {
    check("async", DType::F32);
}

#[test]
fn lent_f32_pixels_arrive_as_staged_ones_on_the_sync_queue() {
    check("sync", DType::F32);
}

#[test]
fn pixels_in_another_dtype_are_written_as_f32_and_cast_on_the_device() {
    check("async", DType::BF16);
    check("sync", DType::F16);
}

#[test]
fn a_bad_shape_is_refused_before_anything_is_enqueued() {
    let device = device("async");
    let runner = Runner::new(CachingAllocator::new(Arc::clone(&device)));
    let images = images();
    let parts: Vec<&[f32]> = images.iter().map(Vec::as_slice).collect();
    let before = device.counters();
    let (lent, waited) = device.with_async_writes(|writes| {
        runner.upload_f32_parts_lent(&parts, DType::F32, 3, ROW as u64, writes)
    });
    let err = lent.expect_err("618 rows do not fit a 3-row tensor");
    assert!(err.to_string().contains("3x1176"), "{err}");
    waited.expect("nothing to wait for");
    assert_eq!(device.counters().since(&before).host_to_device_calls, 0);
}
