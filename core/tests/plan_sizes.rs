//! A planning run takes sizes from plugins (op workspaces) as well as from the tower: sizes
//! past 64 bits are an error naming the tensor, and the plan's sums saturate instead of
//! wrapping (in a release build a wrapped sum would have sized the step's arena too small).

use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::memory::CachingAllocator;
use iris_plugin::{DType, Plugin};

fn planner() -> Runner {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "64MiB".into())])
        .expect("the CPU device opens");
    Runner::planner(CachingAllocator::new(Arc::new(device)))
}

#[test]
fn a_tensor_past_64_bits_is_an_error_naming_it() {
    let runner = planner();
    let err = runner.tensor(DType::F32, u64::MAX / 2, 3).unwrap_err();
    assert!(
        err.to_string()
            .contains("more bytes than a 64-bit size holds"),
        "{err}"
    );
}

#[test]
fn the_planned_peak_saturates_instead_of_wrapping() {
    let runner = planner();
    let small = runner.tensor(DType::U8, 1, 4096).expect("a small tensor");
    {
        // Two workspaces of nearly 2^64 bytes, as a plugin answering u64::MAX might ask.
        let a = runner.tensor(DType::U8, 1, u64::MAX - 1).expect("planned");
        let b = runner.tensor(DType::U8, 1, u64::MAX - 1).expect("planned");
        assert_eq!(runner.planned_peak(), u64::MAX);
        drop((a, b));
    }
    drop(small);
    // Every block was given back: nothing is live, and planning goes on.
    let after = runner.tensor(DType::U8, 1, 4096).expect("a small tensor");
    drop(after);
    assert_eq!(runner.planned_peak(), u64::MAX);
}

#[test]
fn a_step_plan_of_a_size_near_64_bits_saturates_instead_of_wrapping() {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "64MiB".into())])
        .expect("the CPU device opens");
    let allocator = Arc::new(CachingAllocator::new(Arc::new(device)));
    // A workspace of u64::MAX bytes (a C plugin's "unknown"), then one beside it.
    let plan = Runner::plan_step(&allocator, |runner| {
        let a = runner.tensor(DType::U8, 1, u64::MAX)?;
        let b = runner.tensor(DType::U8, 1, 4096)?;
        drop((a, b));
        Ok(())
    })
    .expect("planned");
    // Wrapped, the arena was a few bytes and every step of the shape failed on the device.
    assert_eq!(plan.arena_bytes(), u64::MAX);
    assert_eq!(plan.live_peak(), u64::MAX);
}
