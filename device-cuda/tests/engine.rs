//! iris's engine over the plugin on the stand-in driver, its kernels on the emulator and the
//! stand-in cuDNN: the memory promise where the plugin keeps device memory of its own while
//! serving. Each cuDNN plan built after open loads what it runs at its first execution (as a
//! real cuDNN loads or compiles kernels), after the engine's post-start baseline; `reset_all`
//! must still bring the device's memory back to that baseline, and say what the plugin gave.
//! And a kernel fault while serving: the device is lost for every request from then on, and
//! shutting down gives its memory back.
//!
//! As in `tests/ops.rs`, the parent test runs its scenario in a child process with the
//! stand-ins first on `LD_LIBRARY_PATH` (see `common`). The driver defers what a GPU runs
//! asynchronously (`IRIS_STANDIN_DEFER=1`: copies, fills, frees and host functions wait in their
//! stream's queue until something needs them), so a missing wait between the engine's work and
//! the plugin's streams shows here as wrong results or memory read too early.

mod common;

use std::time::{Duration, Instant};

use common::{Libraries, plugin_library, run};
use iris_core::engine::api::{EncodeOptions, EngineError, ImageInput, MemoryGauges};
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
        &[
            ("IRIS_STANDIN_CUDNN_PLAN_BYTES", &PLAN_BYTES.to_string()),
            ("IRIS_STANDIN_DEFER", "1"),
        ],
        Libraries::Full,
    );
}

/// A kernel that faults while serving (an illegal address: the context is unusable from then
/// on, as on a GPU) fails the request in flight with the driver's reason, makes the engine's
/// health say the device is lost, fails later requests instead of hanging them, and shutting
/// the engine down releases the context, which gives every byte back, with no driver call after
/// it.
#[test]
fn a_kernel_fault_while_serving_fails_requests_and_shutdown_gives_the_memory_back() {
    run("fault", &[("IRIS_STANDIN_DEFER", "1")], Libraries::Full);
}

/// The scenarios, run in a child process by the tests above (never on their own).
#[test]
#[ignore = "a child-process scenario, run by the other tests of this file"]
fn scenario() {
    let name = std::env::var(common::SCENARIO_ENV)
        .expect("run by the parent tests of tests/engine.rs, which set IRIS_STANDIN_SCENARIO");
    match name.as_str() {
        "reset" => reset(),
        "fault" => fault(),
        other => panic!("unknown scenario {other}"),
    }
}

/// The emulated device (compute capability 8.0), opened with `extra` options.
fn emulated_device(extra: &[(&str, &str)]) -> iris_plugin::Device {
    let plugin = load_library(&plugin_library()).expect("the plugin loads");
    let mut options = common::emulated_kernels(80, common::standin_driver_version());
    options.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    plugin.open(0, &options).expect("the emulated device opens")
}

/// `spec` with dummy weights, warm-up off (the ladder would run every step size on the
/// emulator) and steps of two largest items.
fn config(spec: ModelSpec) -> EngineConfig {
    let mut config = EngineConfig::new(
        spec,
        WeightSource::Dummy {
            seed: DUMMY_DEFAULT_SEED,
        },
    );
    config.warm_up = WarmUpMode::Off;
    config.scheduler.max_num_batched_tokens = 2048;
    config
}

/// The tiny model in f32 on the emulated device.
fn tiny_engine() -> Engine {
    let config = config(ModelSpec::preset("tiny").expect("the tiny preset"));
    Engine::start(config, emulated_device(&[])).expect("the engine starts")
}

fn fault() {
    let runtime = runtime();
    runtime.block_on(async {
        let engine = tiny_engine();
        let encode = |seed| {
            engine.encode(
                vec![ImageInput {
                    bytes: png(56, 56, seed),
                }],
                EncodeOptions::default(),
            )
        };
        encode(1).await.expect("an image encodes before the fault");
        engine.health().expect("healthy before the fault");

        common::standin_fault_launch(1);
        let err = encode(2).await.expect_err("the step with the fault fails");
        assert!(
            matches!(err, EngineError::DeviceLost(_))
                && err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "the request is told the device is lost, with the driver's reason: {err:?}"
        );
        let health = engine.health().expect_err("the device is lost");
        assert!(matches!(health, EngineError::DeviceLost(_)), "{health:?}");
        // A later request fails too (within the test's time, not hanging).
        let later = tokio::time::timeout(Duration::from_secs(60), encode(3))
            .await
            .expect("a request after the fault is answered");
        let err = later.expect_err("the device cannot compute any more");
        assert!(
            matches!(err, EngineError::DeviceLost(_))
                && err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{err:?}"
        );
        // An image cached before the fault is not served from memory the device lost.
        let cached = encode(1).await;
        assert!(
            cached.is_err(),
            "a cached image after the fault: {cached:?}"
        );
        drop(engine);
    });
    drop(runtime);
    released_cleanly();
}

fn reset() {
    let device = emulated_device(&[("attention_engine", "cudnn")]);
    let mut spec = ModelSpec::preset("tiny").expect("the tiny preset");
    // One head of 64: a head dim cuDNN's check at open covers (the preset has four of 16).
    spec.vision.num_heads = 1;
    // Without the warm-up ladder, the first steps of each size pay for their plans after the
    // baseline, which is what this test is about.
    let mut config = config(spec);
    config.dtype = DType::BF16;
    let runtime = runtime();
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
    drop(runtime);
    released_cleanly();
    assert_eq!(
        common::standin_teardown_bytes(),
        0,
        "a healthy shutdown freed every buffer itself, before the context's release"
    );
}

/// A runtime for the engine's async calls.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// After the engine shut down: no device memory is left, and nothing called the driver after
/// the context's release.
fn released_cleanly() {
    assert_eq!(
        common::standin_calls_after_teardown(),
        0,
        "no driver call after the context's last release"
    );
    assert_eq!(
        common::standin_used_memory(),
        0,
        "no device memory after the context's release"
    );
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
