//! Steps run to their plan (one arena, tensors at planned places) on the CPU device: the
//! outputs equal a step run tensor by tensor through the allocator, bit for bit; the live
//! bytes measured as the step runs peak where the plan says; the arena stays within 5% of that
//! peak; and a run that departs from its plan takes blocks of its own rather than share
//! memory with a live tensor.

use std::sync::Arc;

use iris_core::encoder::exec::Runner;
use iris_core::encoder::layout::Grid;
use iris_core::encoder::tower::VisionTower;
use iris_core::memory::CachingAllocator;
use iris_core::model::{ModelSpec, WeightSource};
use iris_plugin::{DType, Plugin};

fn allocator() -> Arc<CachingAllocator> {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "2GiB".into())])
        .expect("the CPU device opens");
    CachingAllocator::new(Arc::new(device))
}

/// `preset` with two blocks (full attention and deepstack indexes moved inside them).
fn spec(preset: &str) -> ModelSpec {
    let mut spec = ModelSpec::preset(preset).expect("the preset exists");
    let vision = &mut spec.vision;
    vision.depth = 2;
    if !vision.fullatt_block_indexes.is_empty() {
        vision.fullatt_block_indexes = vec![1];
    }
    if !vision.deepstack_visual_indexes.is_empty() {
        vision.deepstack_visual_indexes = vec![0, 1];
    }
    spec
}

fn pixels(rows: usize, row_len: usize, seed: usize) -> Vec<f32> {
    (0..rows * row_len)
        .map(|i| ((i * 7 + seed * 13) % 31) as f32 / 31.0 - 0.5)
        .collect()
}

/// Every output of a step (embeddings, then deepstack rows, per item), read back.
fn run(runner: &Runner, tower: &VisionTower, dtype: DType, grids: &[Grid]) -> Vec<Vec<f32>> {
    let row_len = tower.config().patch_row_len();
    let parts: Vec<Vec<f32>> = grids
        .iter()
        .enumerate()
        .map(|(i, g)| pixels((g[0] * g[1] * g[2]) as usize, row_len, i))
        .collect();
    let slices: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let rows = parts.iter().map(Vec::len).sum::<usize>() / row_len;
    let (outputs, waited) = runner.device().with_async_writes(|writes| {
        let input = runner
            .upload_f32_parts_lent(&slices, dtype, rows as u64, row_len as u64, writes)
            .expect("upload");
        let outputs = tower.forward(runner, &input, grids).expect("forward");
        runner.allocator().synchronize().expect("the step runs");
        outputs
    });
    waited.expect("the writes complete");
    let mut values = Vec::new();
    for out in outputs {
        values.push(runner.download_f32(&out.embeddings).expect("download"));
        for extra in &out.deepstack {
            values.push(runner.download_f32(extra).expect("download"));
        }
    }
    values
}

fn check(preset: &str, dtype: DType) {
    let spec = spec(preset);
    let allocator = allocator();
    let runner = Runner::new(Arc::clone(&allocator));
    let host = WeightSource::Dummy { seed: 3 }
        .load(&spec.vision, dtype)
        .expect("weights");
    let tower = VisionTower::from_host(&runner, spec.vision.clone(), host, dtype).expect("upload");
    // Two items of different sizes, as a step holds them.
    let grids: Vec<Grid> = vec![[1, 8, 12], [1, 16, 8]];

    let plain = run(&runner, &tower, dtype, &grids);
    let plan = Arc::new(tower.plan_step(&allocator, &grids).expect("a plan"));
    let step = runner.step(Arc::clone(&plan));
    let planned = run(&step, &tower, dtype, &grids);
    let report = step.step_report().expect("a step runner reports");
    drop(step);

    assert_eq!(
        plain, planned,
        "{preset} {dtype}: the arena changes no output"
    );
    assert_eq!(
        report.departures, 0,
        "{preset} {dtype}: the step kept to its plan"
    );
    assert_eq!(
        report.live_peak,
        plan.live_peak(),
        "{preset} {dtype}: the live bytes measured as the step ran peak where planned"
    );
    assert!(report.arena_bytes >= plan.arena_bytes());
    let ratio = report.arena_bytes as f64 / report.live_peak as f64;
    eprintln!(
        "{preset} {dtype}: arena {} for a live peak of {} ({ratio:.4}x), outputs {}",
        report.arena_bytes, report.live_peak, report.output_bytes
    );
    assert!(
        ratio <= 1.05,
        "{preset} {dtype}: the arena is {ratio:.3}x the live peak"
    );
    // Outputs are the cache's: blocks of their own, still here after the step's arena went.
    assert!(report.output_bytes > 0);
    allocator.synchronize().expect("idle");
    assert_eq!(
        allocator.stats().allocated,
        allocator
            .segments()
            .iter()
            .filter(|s| s.pool != iris_core::memory::PoolKind::Whole)
            .flat_map(|s| s.blocks.iter())
            .filter_map(|b| b.requested.map(|_| b.size))
            .sum::<u64>(),
        "the arena's block went back when the step was gone"
    );
}

#[test]
fn a_qwen2_vl_step_runs_to_its_plan_in_f32() {
    check("qwen2-vl-2b", DType::F32);
}

#[test]
fn a_qwen2_5_vl_window_step_runs_to_its_plan_in_bf16() {
    check("qwen2.5-vl-7b", DType::BF16);
}

#[test]
fn a_qwen3_vl_deepstack_step_runs_to_its_plan_in_bf16() {
    check("qwen3-vl-8b", DType::BF16);
}

/// A step that allocates other than its plan says (here: a plan for other grids) never puts
/// a tensor where a live one lies: those allocations are blocks of their own, counted, and
/// the outputs are still right.
#[test]
fn a_step_that_departs_from_its_plan_shares_no_live_memory() {
    let spec = spec("qwen2-vl-2b");
    let dtype = DType::F32;
    let allocator = allocator();
    let runner = Runner::new(Arc::clone(&allocator));
    let host = WeightSource::Dummy { seed: 3 }
        .load(&spec.vision, dtype)
        .expect("weights");
    let tower = VisionTower::from_host(&runner, spec.vision.clone(), host, dtype).expect("upload");
    let grids: Vec<Grid> = vec![[1, 8, 8]];
    let plain = run(&runner, &tower, dtype, &grids);
    let other = Arc::new(tower.plan_step(&allocator, &[[1, 4, 8]]).expect("a plan"));
    let step = runner.step(other);
    let departed = run(&step, &tower, dtype, &grids);
    let report = step.step_report().expect("a report");
    assert!(report.departures > 0, "sizes differ from the plan's");
    assert_eq!(plain, departed);
}
