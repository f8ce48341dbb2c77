//! iris's engine over the plugin on the stand-in driver, its kernels on the emulator and the
//! stand-in cuDNN: the memory promise where the plugin keeps device memory of its own while
//! serving. Each cuDNN plan built after open loads what it runs at its first execution (as a
//! real cuDNN loads or compiles kernels), after the engine's post-start baseline; `reset_all`
//! must still bring the device's memory back to that baseline, and say what the plugin gave.
//!
//! As in `tests/ops.rs`, the parent test runs its scenario in a child process with the
//! stand-ins first on `LD_LIBRARY_PATH` (see `common`).

mod common;

use std::time::{Duration, Instant};

use common::{Libraries, plugin_library, run};
use iris_core::engine::api::{EncodeOptions, ImageInput, MemoryGauges};
use iris_core::engine::{Engine, EngineConfig};
use iris_core::model::{DUMMY_DEFAULT_SEED, ModelSpec, WeightSource};
use iris_core::profile::WarmUpMode;
use iris_plugin::{DType, load_library};

/// Device memory a stand-in plan takes at its first execution.
const PLAN_BYTES: u64 = 1 << 20;

/// The `tiny` model served in bf16 with cuDNN's attention (the emulated device is an Ampere,
/// so `attention_engine = cudnn` asks for it): images of two sizes make two plans after the
/// post-start baseline, whose memory shows in the device's figure and in the plugin's held
/// bytes; `reset_all` gives it back through the plugin's `trim` (its `plugin_cache_bytes`),
/// and no baseline figure stays above its post-start value.
#[test]
fn a_reset_gives_back_the_cudnn_plans_built_while_serving() {
    run(
        "reset",
        &[("IRIS_STANDIN_CUDNN_PLAN_BYTES", &PLAN_BYTES.to_string())],
        Libraries::Full,
    );
}

/// The scenario, run in a child process by the test above (never on its own).
#[test]
#[ignore = "a child-process scenario, run by the other test of this file"]
fn scenario() {
    let name = std::env::var(common::SCENARIO_ENV)
        .expect("run by the parent test of tests/engine.rs, which sets IRIS_STANDIN_SCENARIO");
    assert_eq!(name, "reset");
    let plugin = load_library(&plugin_library()).expect("the plugin loads");
    let mut options = common::emulated_kernels(80, common::standin_driver_version());
    options.push(("attention_engine".to_owned(), "cudnn".to_owned()));
    let device = plugin.open(0, &options).expect("the emulated device opens");
    let mut spec = ModelSpec::preset("tiny").expect("the tiny preset");
    // One head of 64: a head dim cuDNN's check at open covers (the preset has four of 16).
    spec.vision.num_heads = 1;
    let mut config = EngineConfig::new(
        spec,
        WeightSource::Dummy {
            seed: DUMMY_DEFAULT_SEED,
        },
    );
    config.dtype = DType::BF16;
    // The ladder would run every step size on the emulator; the first steps of each size pay
    // for it instead, after the baseline, which is what this test is about.
    config.warm_up = WarmUpMode::Off;
    config.scheduler.max_num_batched_tokens = 2048;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let engine = Engine::start(config, device).expect("the engine starts");
        let after_start = engine.gauges();
        // Distinct images of one size until one of them ran on cuDNN: its plan was built (on
        // the plugin's thread) and executed. Start-up ran the smallest image's step (56x56, 16
        // patches) already; these are 48 and 64 patches.
        let mut seed = 0;
        for (width, height) in [(112, 84), (112, 112)] {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                seed += 1;
                let before = common::standin_cudnn_executes();
                let image = ImageInput {
                    bytes: png(width, height, seed),
                };
                engine
                    .encode(vec![image], EncodeOptions::default())
                    .await
                    .expect("the image encodes");
                if common::standin_cudnn_executes() > before {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "no {width}x{height} image ran on cuDNN in 120 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let loaded = engine.gauges();
        assert!(
            loaded.device_used_bytes >= after_start.device_used_bytes + 2 * PLAN_BYTES,
            "two plans' memory above the baseline: {} after start, {} after the load",
            after_start.device_used_bytes,
            loaded.device_used_bytes
        );
        assert_eq!(
            loaded.plugin_held_bytes - after_start.plugin_held_bytes,
            2 * PLAN_BYTES,
            "the plugin reports what its plans took"
        );
        let report = engine.reset_all().await.expect("the reset");
        let after_reset = engine.gauges();
        // The reset drops every plan built after open, those of start-up's steps too: what it
        // gave back is what the plugin reported them to hold.
        assert_eq!(
            report.plugin_cache_bytes,
            loaded.plugin_held_bytes - after_reset.plugin_held_bytes,
            "{report:?}"
        );
        assert!(report.plugin_cache_bytes >= 2 * PLAN_BYTES, "{report:?}");
        // The bench's verdict: nothing above the post-start baseline. Below it by exactly the
        // plans start-up made (their memory was in the baseline).
        let below = after_start.plugin_held_bytes - after_reset.plugin_held_bytes;
        assert_eq!(
            baseline(&after_reset),
            (
                after_start.device_used_bytes - below,
                after_start.allocator_reserved_bytes,
                after_start.allocator_allocated_bytes
            ),
            "device used, allocator reserved and allocated after the reset, against after start"
        );
        // The engine serves on: the dropped shape runs the plugin's kernel, then cuDNN again.
        let image = ImageInput {
            bytes: png(112, 84, seed + 1),
        };
        engine
            .encode(vec![image], EncodeOptions::default())
            .await
            .expect("an image after the reset encodes");
    });
}

/// The figures the bench's verdict compares.
fn baseline(gauges: &MemoryGauges) -> (u64, u64, u64) {
    (
        gauges.device_used_bytes,
        gauges.allocator_reserved_bytes,
        gauges.allocator_allocated_bytes,
    )
}

/// A PNG of `width x height` whose pixels depend on `seed` (so that each hashes apart).
fn png(width: u32, height: u32, seed: u32) -> Vec<u8> {
    let pixels: Vec<u8> = (0..width * height * 3)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed.wrapping_mul(97))).to_le_bytes()[0])
        .collect();
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &pixels,
        width,
        height,
        image::ExtendedColorType::Rgb8,
    )
    .expect("the PNG encodes");
    out
}
