//! The engine end to end on the built-in CPU device with the `tiny` model and dummy weights.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::encoder::tower::VisionTower;
use crate::engine::api::ImageInput;
use crate::model::DUMMY_DEFAULT_SEED;
use crate::preprocess::ImageSize;
use crate::preprocess::preprocess;
use crate::test_support::{cpu_allocator, cpu_device, cpu_device_with};

fn device() -> Device {
    cpu_device("1GiB")
}

fn config() -> EngineConfig {
    let mut config = EngineConfig::new(
        ModelSpec::preset("tiny").expect("tiny preset"),
        WeightSource::Dummy {
            seed: DUMMY_DEFAULT_SEED,
        },
    );
    // Two largest items per step keep start-up profiling short.
    config.scheduler.max_num_batched_tokens = 2048;
    config
}

fn engine() -> Engine {
    Engine::start(config(), device()).expect("the engine starts")
}

/// A PNG of `w x h` whose pixels depend on `seed`, so different seeds hash differently.
fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|i| (i.to_le_bytes()[0]).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &pixels,
        w,
        h,
        image::ExtendedColorType::Rgb8,
    )
    .expect("png encodes");
    out
}

fn input(bytes: Vec<u8>) -> ImageInput {
    ImageInput { bytes }
}

const WITH_EMBEDDINGS: EncodeOptions = EncodeOptions {
    return_embeddings: true,
    processor: ProcessorOverrides {
        min_pixels: None,
        max_pixels: None,
        background: None,
    },
};

/// The tower run directly on one image: what the engine's gathered rows must equal.
fn reference(bytes: &[u8]) -> Vec<f32> {
    let spec = ModelSpec::preset("tiny").unwrap();
    let image = preprocess(bytes, &spec.processor, &DecodeLimits::default()).unwrap();
    run_tower(&image.pixel_values, image.grid_thw)
}

/// The tiny tower with the test weights, run directly on one item's pixel values.
fn run_tower(pixel_values: &[f32], grid: [u32; 3]) -> Vec<f32> {
    let spec = ModelSpec::preset("tiny").unwrap();
    let allocator = cpu_allocator("1GiB");
    let runner = Runner::new(allocator);
    let host = config().weights.load(&spec.vision, DType::F32).unwrap();
    let tower = VisionTower::new(&runner, spec.vision.clone(), &host, DType::F32).unwrap();
    let rows: u64 = grid.iter().map(|&v| u64::from(v)).product();
    let pixels = runner
        .upload_f32(
            pixel_values,
            DType::F32,
            rows,
            spec.vision.patch_row_len() as u64,
        )
        .unwrap();
    let out = tower.forward(&runner, &pixels, &[grid]).unwrap();
    runner.download_f32(&out[0].embeddings).unwrap()
}

fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "value {i}: {x} vs {y}"
        );
    }
}

/// Asks the engine core to check its books between steps (manager and device cache agree,
/// no reference without a request, nothing allocated beyond the weights and the cached
/// outputs); panics with what is wrong.
async fn check(engine: &Engine) {
    let result = engine
        .ask(Command::Check)
        .await
        .expect("the engine answers");
    if let Err(broken) = result {
        panic!("engine books: {broken}");
    }
}

/// Resets everything and asserts that the device and allocator figures are back at the
/// post-start baseline; `context` goes into the failure message.
async fn reset_to_baseline(engine: &Engine, after_start: &MemoryGauges, context: &str) {
    engine.reset_all().await.unwrap();
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(after_start),
        "{context}"
    );
}

/// Device and allocator figures that must return to the post-start baseline.
fn baseline_figures(g: &MemoryGauges) -> (u64, u64, u64) {
    (
        g.device_used_bytes,
        g.allocator_reserved_bytes,
        g.allocator_allocated_bytes,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encode_gathers_the_towers_output_and_a_repeat_is_cached() {
    let engine = engine();
    let (a, b) = (png(112, 84, 1), png(56, 56, 2));
    let results = engine
        .encode(vec![input(a.clone()), input(b.clone())], WITH_EMBEDDINGS)
        .await
        .unwrap();
    assert_eq!(results.len(), 2);
    // 112x84 -> 8x6 patches of 14 -> 12 tokens after the 2x2 merge; 56x56 -> 4x4 -> 4.
    assert_eq!(
        (results[0].grid_thw, results[0].num_tokens),
        ([1, 6, 8], 12)
    );
    assert_eq!((results[1].grid_thw, results[1].num_tokens), ([1, 4, 4], 4));
    assert!(results.iter().all(|r| !r.cached));
    let (data, shape) = results[0].embeddings.clone().unwrap();
    assert_eq!(shape, [12, 64]);
    assert_close(&data, &reference(&a));
    assert_close(&results[1].embeddings.clone().unwrap().0, &reference(&b));

    let again = engine
        .encode(vec![input(a)], EncodeOptions::default())
        .await
        .unwrap();
    assert!(
        again[0].cached,
        "the repeat is served from the encoder cache"
    );
    assert_eq!(again[0].mm_hash, results[0].mm_hash);
    assert!(again[0].embeddings.is_none());
    let m = engine.metrics_snapshot();
    assert_eq!((m.encoder_cache_hits, m.encoder_cache_misses), (1, 2));
    assert_eq!((m.processor_cache_hits, m.processor_cache_misses), (1, 2));
    assert_eq!(m.memory.encoder_cache_entries, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_reports_the_grids_encode_gives_and_request_processor_settings_apply() {
    let engine = engine();
    let tiny_max = ModelSpec::preset("tiny").unwrap().processor.max_pixels;
    let image = png(112, 84, 11);
    let plans = engine
        .plan(&[input(image.clone())], &ProcessorOverrides::default())
        .await
        .unwrap();
    assert_eq!(
        plans,
        [ImagePlan {
            grid_thw: [1, 6, 8],
            num_tokens: 12
        }]
    );
    // The plan filled the processor cache: the encode does not decode again.
    let results = engine
        .encode(vec![input(image.clone())], EncodeOptions::default())
        .await
        .unwrap();
    assert_eq!(results[0].grid_thw, plans[0].grid_thw);
    let m = engine.metrics_snapshot();
    assert_eq!((m.processor_cache_hits, m.processor_cache_misses), (1, 1));

    // A narrower pixel range gives the grid the Qwen processor gives for it: 112x84 with
    // max_pixels 56*56 resizes to 56x56 (smart_resize keeps multiples of 28 under the bound).
    let narrow = ProcessorOverrides {
        max_pixels: Some(56 * 56),
        ..ProcessorOverrides::default()
    };
    let options = EncodeOptions {
        return_embeddings: true,
        processor: narrow,
    };
    let plans = engine.plan(&[input(image.clone())], &narrow).await.unwrap();
    let results = engine
        .encode(vec![input(image.clone())], options)
        .await
        .unwrap();
    assert_eq!(plans[0].grid_thw, results[0].grid_thw);
    assert!(plans[0].num_tokens < 12, "{plans:?}");
    assert_eq!(
        results[0].embeddings.as_ref().unwrap().1[0],
        plans[0].num_tokens
    );

    for (overrides, needle) in [
        (
            ProcessorOverrides {
                max_pixels: Some(tiny_max + 1),
                ..ProcessorOverrides::default()
            },
            "above the model's max_pixels",
        ),
        (
            ProcessorOverrides {
                min_pixels: Some(56 * 56 * 4),
                max_pixels: Some(56 * 56),
                background: None,
            },
            "min_pixels 12544 is above max_pixels 3136",
        ),
    ] {
        let err = engine
            .plan(&[input(image.clone())], &overrides)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, EngineError::BadInput { code: "invalid_mm_processor_kwargs", message } if message.contains(needle)),
            "{err:?}"
        );
        let options = EncodeOptions {
            return_embeddings: false,
            processor: overrides,
        };
        assert!(
            engine
                .encode(vec![input(image.clone())], options)
                .await
                .is_err()
        );
    }
    let layout = engine.output_layout();
    assert_eq!((layout.hidden, layout.deepstack_levels), (64, 0));
}

/// A step's input embeddings are assembled with one batched copy (every image row of every
/// request and deepstack level) and at most one fill (the text rows), whatever the number of
/// requests and items in the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_step_assembles_its_embeddings_with_one_copy_and_at_most_one_fill() {
    let engine = engine();
    let images: Vec<Vec<u8>> = (0..3).map(|seed| png(112, 84, 40 + seed)).collect();
    // First encode every image, so that the requests below only assemble cached outputs.
    engine
        .encode(
            images.iter().cloned().map(input).collect(),
            EncodeOptions::default(),
        )
        .await
        .unwrap();
    let (steps_before, counters_before) =
        (engine.metrics_snapshot().steps, engine.device_counters());
    let request = |i: usize| {
        let picked = vec![
            input(images[i % 3].clone()),
            input(images[(i + 1) % 3].clone()),
        ];
        engine.encode(picked, WITH_EMBEDDINGS)
    };
    // Concurrent, so that steps carry several requests.
    let (r0, r1, r2, r3) = tokio::join!(request(0), request(1), request(2), request(3));
    for result in [r0, r1, r2, r3] {
        let result = result.unwrap();
        assert!(result.iter().all(|r| r.cached && r.embeddings.is_some()));
    }
    let steps = engine.metrics_snapshot().steps - steps_before;
    let counters = engine.device_counters().since(&counters_before);
    assert!(steps > 0);
    assert_eq!(
        counters.copy_batches, steps,
        "{counters:?} over {steps} steps"
    );
    assert!(counters.fills <= steps, "{counters:?} over {steps} steps");
    assert_eq!(counters.ops, 0, "nothing is encoded again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reset_reports_what_it_released_and_memory_returns_to_the_baseline() {
    let engine = engine();
    let after_start = engine.metrics_snapshot().after_start;
    engine
        .encode(vec![input(png(224, 224, 3))], EncodeOptions::default())
        .await
        .unwrap();
    let loaded = engine.gauges();
    assert!(loaded.device_used_bytes > after_start.device_used_bytes);
    assert_eq!(loaded.encoder_cache_entries, 1);

    let processor = engine.reset_mm_cache();
    // 224x224: 16x16 patches of 3 x 2 x 14 x 14 values, 4 bytes each.
    assert_eq!(processor.processor_cache_bytes, 256 * 1176 * 4);
    let encoder = engine.reset_encoder_cache().await.unwrap();
    assert_eq!(encoder.encoder_cache_entries, 1);
    assert!(encoder.encoder_cache_bytes >= 64 * 64 * 4);
    // The encoder cache's blocks went back to the allocator, which still holds them.
    assert_eq!(
        engine.gauges().allocator_allocated_bytes,
        after_start.allocator_allocated_bytes
    );
    let trim = engine.reset_allocator().await.unwrap();
    assert!(trim.allocator_bytes > 0);
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
    let nothing = engine.reset_all().await.unwrap();
    assert_eq!(nothing, ResetReport::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_survive_a_reset_and_re_encode() {
    let engine = Arc::new(engine());
    let after_start = engine.metrics_snapshot().after_start;
    let images: Vec<Vec<u8>> = (0..6).map(|i| png(84, 84, i)).collect();
    let expected: Vec<Vec<f32>> = images.iter().map(|b| reference(b)).collect();
    let mut tasks = Vec::new();
    for round in 0..16 {
        let engine = Arc::clone(&engine);
        let chosen = vec![
            input(images[round % 6].clone()),
            input(images[(round + 1) % 6].clone()),
        ];
        tasks.push(tokio::spawn(async move {
            engine.encode(chosen, WITH_EMBEDDINGS).await
        }));
    }
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        engine.reset_all().await.unwrap();
    }
    for (round, task) in tasks.into_iter().enumerate() {
        let results = task.await.unwrap().expect("survives the reset");
        for (k, r) in results.iter().enumerate() {
            assert_close(&r.embeddings.clone().unwrap().0, &expected[(round + k) % 6]);
        }
    }
    reset_to_baseline(&engine, &after_start, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_returns_device_memory_to_the_pre_start_figure_and_wake_up_restores() {
    for level in [1u8, 2] {
        let engine = engine();
        let m = engine.metrics_snapshot();
        let image = png(56, 84, 7);
        let before = engine
            .encode(vec![input(image.clone())], WITH_EMBEDDINGS)
            .await
            .unwrap();
        let report = engine.sleep(level).await.unwrap();
        assert!(report.allocator_bytes >= engine.startup().weights_bytes);
        assert!(engine.is_sleeping());
        let asleep = engine.gauges();
        assert_eq!(asleep.device_used_bytes, m.before_start.device_used_bytes);
        assert_eq!(asleep.allocator_reserved_bytes, 0);
        assert_eq!(
            engine
                .encode(vec![input(image.clone())], EncodeOptions::default())
                .await,
            Err(EngineError::Sleeping)
        );
        engine.wake_up().await.unwrap();
        assert!(!engine.is_sleeping());
        assert_eq!(
            engine.gauges().allocator_allocated_bytes,
            m.after_start.allocator_allocated_bytes
        );
        let after = engine
            .encode(vec![input(image)], WITH_EMBEDDINGS)
            .await
            .unwrap();
        assert!(!after[0].cached, "sleep emptied the encoder cache");
        assert_eq!(after[0].embeddings, before[0].embeddings, "level {level}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_by_name_and_leaves_nothing_behind() {
    let engine = engine();
    let after_start = engine.metrics_snapshot().after_start;
    let good = png(56, 56, 9);
    let mut corrupt = good.clone();
    corrupt.truncate(good.len() / 2);
    let cases: Vec<(Vec<ImageInput>, &str)> = vec![
        (vec![input(good.clone()), input(corrupt)], "corrupt_image"),
        (
            vec![input(b"qoif not an image iris decodes".to_vec())],
            "unknown_image_format",
        ),
        (vec![], "no_images"),
    ];
    for (images, code) in cases {
        match engine.encode(images, EncodeOptions::default()).await {
            Err(EngineError::BadInput { code: got, message }) => {
                assert_eq!(got, code, "{message}");
            }
            other => panic!("expected {code}, got {other:?}"),
        }
    }
    assert_eq!(
        engine.sleep(3).await.unwrap_err().to_string(),
        "sleep level must be 1 or 2, got 3"
    );
    // No image reached the device: memory is at the post-start figures without any reset.
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
    check(&engine).await;
    assert_eq!(engine.memory_json()["in_flight_requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_consumer_aborts_its_request() {
    let mut cfg = config();
    // A small step budget spreads the request over many steps.
    cfg.scheduler.max_num_batched_tokens = 128;
    let engine = Arc::new(Engine::start(cfg, device()).unwrap());
    let after_start = engine.metrics_snapshot().after_start;
    let in_flight = |e: &Engine| e.memory_json()["in_flight_requests"].as_u64().unwrap();
    let pending = |e: &Engine| e.metrics_snapshot().admission.pending_requests;
    let images: Vec<ImageInput> = (0..16).map(|i| input(png(448, 448, 40 + i))).collect();
    let task = {
        let engine = Arc::clone(&engine);
        tokio::spawn(async move { engine.encode(images, EncodeOptions::default()).await })
    };
    for _ in 0..1000 {
        if in_flight(&engine) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(in_flight(&engine), 1, "the request reached the engine core");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    // Until the core drops the request (at its next step boundary), its admission slot stays
    // counted: a request admitted meanwhile would run beside it, past the bound. Read in this
    // order, the slot count can never be below the requests the core still holds.
    for _ in 0..5000 {
        let (pending, in_flight) = (pending(&engine), in_flight(&engine));
        assert!(
            pending >= in_flight,
            "the slot was free ({pending} pending) while the core held {in_flight} request(s)"
        );
        if in_flight == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(in_flight(&engine), 0, "the abort released the request");
    assert_eq!(
        pending(&engine),
        0,
        "the slot came back once the core let go"
    );
    // Before any reset: no reference is left, the manager and the device cache agree, and the
    // allocator's live blocks are the weights plus the cached outputs.
    check(&engine).await;
    let g = engine.gauges();
    assert_eq!(
        g.allocator_allocated_bytes,
        after_start.allocator_allocated_bytes + g.encoder_cache_bytes,
        "{g:?}"
    );
    reset_to_baseline(&engine, &after_start, "").await;
}

#[test]
fn start_is_refused_with_the_numbers_when_memory_is_short() {
    let mut cfg = config();
    cfg.device_memory_utilization = 1.0;
    let device = cpu_device("1GiB");
    // Hold a block so that free < total: a utilization of 1.0 can no longer be met.
    let held = device.alloc(1 << 20).unwrap();
    let err = Engine::start(cfg.clone(), device).err().expect("refused");
    assert!(err.to_string().contains("free"), "{err}");
    let _ = held;
    // Too small a device for the weights and the profiling run fails cleanly too.
    let small = cpu_device("64KiB");
    assert!(Engine::start(config(), small).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_admitted_before_sleep_waits_and_finishes_after_wake_up() {
    let mut cfg = config();
    // A small step budget spreads the request over dozens of steps.
    cfg.scheduler.max_num_batched_tokens = 128;
    let engine = Arc::new(Engine::start(cfg, device()).unwrap());
    let m = engine.metrics_snapshot();
    let in_flight = |e: &Engine| e.memory_json()["in_flight_requests"].as_u64().unwrap();
    let images: Vec<Vec<u8>> = (0..12).map(|i| png(448, 448, 90 + i)).collect();
    let task = {
        let engine = Arc::clone(&engine);
        let inputs = images.iter().cloned().map(input).collect();
        tokio::spawn(async move { engine.encode(inputs, WITH_EMBEDDINGS).await })
    };
    for _ in 0..1000 {
        if in_flight(&engine) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(in_flight(&engine), 1, "the request reached the engine core");
    engine.sleep(1).await.unwrap();
    assert!(
        !task.is_finished(),
        "the request waits while the engine sleeps"
    );
    assert_eq!(in_flight(&engine), 1);
    assert_eq!(
        engine.gauges().device_used_bytes,
        m.before_start.device_used_bytes
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!task.is_finished(), "nothing runs while asleep");
    engine.wake_up().await.unwrap();
    let results = task.await.unwrap().expect("finishes after the wake-up");
    assert_eq!(results.len(), images.len());
    for (result, bytes) in results.iter().zip(&images) {
        assert_close(&result.embeddings.clone().unwrap().0, &reference(bytes));
    }
    engine.reset_all().await.unwrap();
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&m.after_start)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleep_sent_during_a_wake_up_leaves_the_engine_flagged_asleep() {
    let engine = engine();
    engine.sleep(2).await.unwrap();
    // The wake-up reaches the worker first; the sleep flags the engine asleep at once and
    // queues behind it. The wake-up's end must not clear the flag over the sleeping tower.
    let (woke, slept) = tokio::join!(engine.wake_up(), engine.sleep(1));
    woke.unwrap();
    slept.unwrap();
    assert!(
        engine.is_sleeping(),
        "the tower sleeps: the flag must say so"
    );
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        engine.encode(vec![input(png(56, 56, 1))], EncodeOptions::default()),
    )
    .await
    .expect("refused at once, not left waiting for a wake-up");
    assert!(matches!(refused, Err(EngineError::Sleeping)), "{refused:?}");
    engine.wake_up().await.unwrap();
    assert!(!engine.is_sleeping());
    engine
        .encode(vec![input(png(56, 56, 1))], EncodeOptions::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_gives_its_device_memory_back_and_refuses_resets() {
    let mut cfg = config();
    cfg.panic_at_step = Some(2);
    let engine = Engine::start(cfg, device()).unwrap();
    let before = engine.metrics_snapshot().before_start.device_used_bytes;
    engine
        .encode(vec![input(png(56, 56, 1))], EncodeOptions::default())
        .await
        .unwrap();
    assert!(engine.gauges().device_used_bytes > before);
    let failed = engine
        .encode(vec![input(png(56, 56, 2))], EncodeOptions::default())
        .await;
    assert!(
        matches!(failed, Err(EngineError::Internal(_))),
        "{failed:?}"
    );
    // No reset can be asked of a dead engine: its thread gives everything back as it ends.
    let mut used = engine.gauges().device_used_bytes;
    for _ in 0..200 {
        if used == before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        used = engine.gauges().device_used_bytes;
    }
    assert_eq!(used, before, "device memory of the dead engine");
    // A reset asked of it is an error naming the death, not a report of zeros.
    for reset in [
        engine.reset_all().await,
        engine.reset_encoder_cache().await,
        engine.reset_allocator().await,
    ] {
        assert!(matches!(reset, Err(EngineError::Dead(_))), "{reset:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preprocessing_a_client_hung_up_on_stays_counted_until_it_ends() {
    let mut cfg = config();
    cfg.admission = AdmissionConfig {
        max_queued_requests: Some(1),
        max_pending_tokens: None,
    };
    let engine = Engine::start(cfg, device()).unwrap();
    // The client goes away while its image is decoded and resized on the blocking pool.
    let gone = tokio::time::timeout(
        Duration::from_millis(1),
        engine.encode(vec![input(png(1600, 1200, 3))], EncodeOptions::default()),
    )
    .await;
    assert!(gone.is_err(), "the request outlived its client: {gone:?}");
    // The work goes on, so its slot is still taken.
    assert!(matches!(engine.admit(), Err(EngineError::Overloaded)));
    let mut admitted = engine.admit();
    for _ in 0..1000 {
        if admitted.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        admitted = engine.admit();
    }
    assert!(admitted.is_ok(), "the slot comes back when the work ends");
    assert_eq!(engine.metrics_snapshot().admission.pending_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_op_that_panics_fails_its_step_and_the_engine_lives() {
    // The op runs on the engine thread (sync queue) and panics inside the plugin's boundary,
    // which turns the panic into the call's error.
    let device = cpu_device_with(&[
        ("capacity", "1GiB"),
        ("queue", "sync"),
        ("fail_op", "attention"),
        ("fail_op_every", "7"),
        ("fail_op_panics", "true"),
    ]);
    let engine = Engine::start(config(), device).expect("the engine starts");
    let mut failed = 0;
    for seed in 0..12 {
        match engine
            .encode(vec![input(png(56, 56, seed))], EncodeOptions::default())
            .await
        {
            Ok(_) => {}
            Err(err) => {
                assert!(err.to_string().contains("panicked"), "{err}");
                failed += 1;
            }
        }
        engine
            .health()
            .expect("a contained panic is not the engine's death");
    }
    assert!(failed > 0, "some step met the injected panic");
}

/// Device memory taken outside the engine's allocator, as another tenant of the device would;
/// given back on drop.
struct Held {
    device: Arc<Device>,
    handle: iris_plugin::BufferHandle,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.device
            .free(self.handle)
            .expect("the held block is freed");
        self.device.synchronize().expect("the free completes");
    }
}

/// Takes `bytes` of the engine's device outside its allocator.
fn hold(engine: &Engine, bytes: u64) -> Held {
    let device = Arc::clone(engine.shared.allocator.device());
    // An allocation refused by an injected fault is tried once more, as the allocator does.
    let handle = device
        .alloc(bytes)
        .or_else(|_| device.alloc(bytes))
        .expect("the block is held");
    Held { device, handle }
}

/// Free device bytes, as the driver reports them.
fn device_free(engine: &Engine) -> u64 {
    let g = engine.gauges();
    g.device_total_bytes - g.device_used_bytes
}

/// How far the allocator's reserved bytes rise to encode `images` in one request, starting
/// from an empty encoder cache and an emptied allocator: what the step takes from the device.
async fn reserved_growth(engine: &Engine, images: &[Vec<u8>]) -> u64 {
    engine.reset_all().await.unwrap();
    let before = engine.gauges().allocator_reserved_bytes;
    engine
        .encode(
            images.iter().cloned().map(input).collect(),
            EncodeOptions::default(),
        )
        .await
        .expect("the calibration encode");
    let grown = engine.gauges().allocator_reserved_bytes - before;
    engine.reset_all().await.unwrap();
    grown
}

/// Device bytes the tiny tower takes at its peak to encode `images` in one batch (input,
/// activations, outputs), planned without running anything.
fn planned_peak(images: &[Vec<u8>]) -> u64 {
    let spec = ModelSpec::preset("tiny").unwrap();
    let allocator = cpu_allocator("1GiB");
    let host = config().weights.load(&spec.vision, DType::F32).unwrap();
    let tower = VisionTower::new(
        &Runner::new(Arc::clone(&allocator)),
        spec.vision.clone(),
        &host,
        DType::F32,
    )
    .unwrap();
    let planner = Runner::planner(allocator);
    let images: Vec<_> = images
        .iter()
        .map(|bytes| preprocess(bytes, &spec.processor, &DecodeLimits::default()).unwrap())
        .collect();
    let rows = images.iter().map(|i| i.num_patches() as u64).sum();
    let input = planner
        .tensor(DType::F32, rows, spec.vision.patch_row_len() as u64)
        .unwrap();
    let grids: Vec<_> = images.iter().map(|i| i.grid_thw).collect();
    drop(tower.forward(&planner, &input, &grids).unwrap());
    planner.planned_peak()
}

/// The engine with an encoder cache too large for the device: the device, not the manager,
/// bounds what is cached, so memory runs out before the manager evicts anything.
fn device_bound_config() -> EngineConfig {
    let mut cfg = config();
    cfg.scheduler.encoder_cache_size = Some(1 << 22);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_mid_step_is_recovered_by_evicting_unreferenced_outputs() {
    let engine = Engine::start(device_bound_config(), device()).unwrap();
    let after_start = engine.metrics_snapshot().after_start;
    let need = reserved_growth(&engine, &[png(448, 448, 100)]).await;
    // Room for one such step and 2 MiB of cached outputs (64 KiB each): the outputs of the
    // requests before fill it, and a later step finds the device full.
    let held = hold(&engine, device_free(&engine) - need - (2 << 20));
    let image = png(448, 448, 101);
    let expected = reference(&image);
    let mut served = 0;
    while engine.metrics_snapshot().oom_recoveries == 0 {
        assert!(served < 200, "{served} requests and no out-of-memory");
        let seed = 102 + u8::try_from(served % 150).unwrap();
        let results = engine
            .encode(vec![input(png(448, 448, seed))], EncodeOptions::default())
            .await
            .expect("served despite the full device");
        assert_eq!(results[0].num_tokens, 256);
        served += 1;
    }
    let m = engine.metrics_snapshot();
    assert!(m.encoder_cache_evictions > 0, "{m:?}");
    assert_eq!((m.oom_failures, m.device_faults), (0, 0), "{m:?}");
    assert!(
        m.memory.encoder_cache_entries < served,
        "outputs were evicted: {m:?}"
    );
    // The outputs are right after the recovery too.
    let results = engine
        .encode(vec![input(image)], WITH_EMBEDDINGS)
        .await
        .unwrap();
    assert_close(&results[0].embeddings.clone().unwrap().0, &expected);
    check(&engine).await;
    drop(held);
    reset_to_baseline(&engine, &after_start, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_does_not_fit_is_split_and_each_half_runs() {
    let engine = Engine::start(device_bound_config(), device()).unwrap();
    let after_start = engine.metrics_snapshot().after_start;
    let images = [png(672, 672, 113), png(672, 672, 114)];
    let one = planned_peak(&images[..1]);
    let two = planned_peak(&images);
    assert!(
        two > one * 3 / 2,
        "two items take more than one: {two} vs {one}"
    );
    // Room for one item's step but not for both in one batch.
    engine.reset_all().await.unwrap();
    let held = hold(&engine, device_free(&engine) - (one + two) / 2);
    let results = engine
        .encode(images.iter().cloned().map(input).collect(), WITH_EMBEDDINGS)
        .await
        .expect("served in halves");
    for (result, image) in results.iter().zip(&images) {
        assert_close(&result.embeddings.clone().unwrap().0, &reference(image));
    }
    let m = engine.metrics_snapshot();
    assert!(m.oom_recoveries > 0 && m.oom_batch_splits > 0, "{m:?}");
    assert_eq!((m.oom_failures, m.device_faults), (0, 0), "{m:?}");
    check(&engine).await;
    drop(held);
    reset_to_baseline(&engine, &after_start, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_that_can_never_fit_fails_alone_with_the_numbers() {
    let engine = Engine::start(device_bound_config(), device()).unwrap();
    let after_start = engine.metrics_snapshot().after_start;
    engine.reset_all().await.unwrap();
    // 3 MiB left: a small image's step fits, a 448x448 image's input alone (4.8 MB) does not.
    let held = hold(&engine, device_free(&engine) - (3 << 20));
    let (big, small) = (png(448, 448, 120), png(56, 56, 121));
    let (too_big, fine) = tokio::join!(
        engine.encode(
            vec![input(small.clone()), input(big.clone())],
            WITH_EMBEDDINGS
        ),
        engine.encode(vec![input(small.clone())], WITH_EMBEDDINGS),
    );
    match too_big {
        Err(EngineError::TooLargeForDevice {
            message,
            needed_bytes,
            available_bytes,
        }) => {
            assert!(needed_bytes > available_bytes, "{message}");
            assert!(needed_bytes > 448 * 448 * 3 * 4, "{message}");
            for part in [
                "image 1".to_owned(),
                needed_bytes.to_string(),
                available_bytes.to_string(),
            ] {
                assert!(message.contains(&part), "`{part}` missing: {message}");
            }
        }
        other => panic!("expected TooLargeForDevice, got {other:?}"),
    }
    let fine = fine.expect("the request not involved is served");
    assert_close(&fine[0].embeddings.clone().unwrap().0, &reference(&small));
    let m = engine.metrics_snapshot();
    assert_eq!((m.oom_failures, m.device_faults), (1, 0), "{m:?}");
    check(&engine).await;
    // With the memory back, the same image is served.
    drop(held);
    let results = engine
        .encode(vec![input(big.clone())], WITH_EMBEDDINGS)
        .await
        .unwrap();
    assert_close(&results[0].embeddings.clone().unwrap().0, &reference(&big));
    check(&engine).await;
    reset_to_baseline(&engine, &after_start, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_fault_fails_its_step_keeps_earlier_outputs_and_the_engine_goes_on() {
    let (kept, failing) = (png(56, 84, 130), png(84, 56, 131));
    // An engine without faults counts the op calls of start-up and of one encode, so that the
    // fault lands on the first op of the second encode below.
    let (startup_ops, encode_ops) = {
        let engine = engine();
        let startup = engine.device_counters().ops;
        engine
            .encode(vec![input(kept.clone())], EncodeOptions::default())
            .await
            .unwrap();
        (startup, engine.device_counters().ops - startup)
    };
    let at = (startup_ops + encode_ops + 1).to_string();
    let device = cpu_device_with(&[
        ("capacity", "1GiB"),
        ("fail_op", "any"),
        ("fail_op_at", at.as_str()),
    ]);
    let engine = Engine::start(config(), device).unwrap();
    let after_start = engine.metrics_snapshot().after_start;
    engine
        .encode(vec![input(kept.clone())], EncodeOptions::default())
        .await
        .unwrap();
    match engine
        .encode(vec![input(failing.clone())], EncodeOptions::default())
        .await
    {
        Err(EngineError::Device(message)) => {
            assert!(message.contains("injected"), "{message}");
        }
        other => panic!("expected a device error, got {other:?}"),
    }
    // The failed step's output is gone, the earlier one is kept, and the books agree.
    check(&engine).await;
    assert_eq!(engine.gauges().encoder_cache_entries, 1);
    let m = engine.metrics_snapshot();
    assert_eq!(m.device_faults, 1, "{m:?}");
    // The engine goes on: the failed image is encoded now, the kept one comes from the cache.
    let results = engine
        .encode(
            vec![input(failing.clone()), input(kept.clone())],
            WITH_EMBEDDINGS,
        )
        .await
        .expect("the engine is alive");
    assert!(!results[0].cached && results[1].cached, "{results:?}");
    assert_close(
        &results[0].embeddings.clone().unwrap().0,
        &reference(&failing),
    );
    assert_close(&results[1].embeddings.clone().unwrap().0, &reference(&kept));
    check(&engine).await;
    reset_to_baseline(&engine, &after_start, "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_output_is_encoded_again() {
    let engine = engine();
    let after_start = engine.metrics_snapshot().after_start;
    let image = png(112, 84, 140);
    let first = engine
        .encode(vec![input(image.clone())], WITH_EMBEDDINGS)
        .await
        .unwrap();
    let hash = first[0].mm_hash.clone();
    let lost = engine
        .ask(|tx| Command::LoseDeviceEntry(hash, tx))
        .await
        .unwrap();
    assert!(lost);
    // The manager still counts the item: the books disagree, and the check says so.
    let broken = engine.ask(Command::Check).await.unwrap().unwrap_err();
    assert!(broken.contains("device cache holds"), "{broken}");
    let again = engine
        .encode(vec![input(image.clone())], WITH_EMBEDDINGS)
        .await
        .expect("a cache miss is encoded again, not a failure");
    assert!(!again[0].cached);
    assert_close(
        &again[0].embeddings.clone().unwrap().0,
        &first[0].embeddings.clone().unwrap().0,
    );
    assert_eq!(engine.metrics_snapshot().encoder_cache_reencodes, 1);
    check(&engine).await;
    let third = engine
        .encode(vec![input(image)], EncodeOptions::default())
        .await
        .unwrap();
    assert!(third[0].cached);
    assert_eq!(engine.metrics_snapshot().encoder_cache_reencodes, 1);
    reset_to_baseline(&engine, &after_start, "").await;
}

/// A small deterministic generator (xorshift64*), so that a failing soak run can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// What became of one soak request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Outcome {
    Served,
    /// Failed by an injected device fault.
    DeviceFault,
    /// Did not fit next to the work in flight (503, retry later).
    RetryLater,
    /// Its consumer went away before the answer.
    Aborted,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_aborts_resets_and_injected_faults_returns_to_the_baseline() {
    const REQUESTS: u64 = 3000;
    const CONCURRENCY: usize = 32;
    /// Images every request may share (cache hits), next to one fresh image per request.
    const SHARED: u64 = 16;
    const SIZES: [(u32, u32); 4] = [(56, 56), (84, 56), (56, 84), (112, 84)];
    const RESET_EVERY: u64 = 500;
    // Every 40th attention call fails when it runs (a device fault of its step); every 13th
    // raw allocation is refused (the allocator empties its cache and retries).
    let device = cpu_device_with(&[
        ("capacity", "1GiB"),
        ("fail_op", "attention"),
        ("fail_op_every", "40"),
        ("fail_alloc_every", "13"),
    ]);
    let engine = Arc::new(Engine::start(device_bound_config(), device).unwrap());
    let after_start = engine.metrics_snapshot().after_start;
    engine.reset_all().await.unwrap();
    // Room for a step of a few small images and some outputs: large batches do not fit and
    // are split, and the fresh images' outputs fill the device until steps evict them.
    let held = hold(&engine, device_free(&engine) - (5 << 19));
    let semaphore = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut tasks = tokio::task::JoinSet::new();
    for request in 0..REQUESTS {
        let permit = Arc::clone(&semaphore).acquire_owned().await.unwrap();
        // A reset of the encoder cache or of everything, with requests in flight.
        match request % RESET_EVERY {
            0 if request % (2 * RESET_EVERY) == 0 => {
                engine.reset_encoder_cache().await.unwrap();
            }
            0 => {
                engine.reset_all().await.unwrap();
            }
            _ => {}
        }
        let shared = png_of(
            rng.below(SHARED),
            SIZES[usize::try_from(rng.below(4)).unwrap()],
        );
        // 16 tokens, 4 KiB of output: between two resets the fresh images' outputs outgrow
        // the room left, so steps run out of memory and evict.
        let fresh = png_of(SHARED + request, (112, 112));
        let images = match rng.below(3) {
            0 => vec![shared],
            1 => vec![fresh],
            _ => vec![fresh, shared],
        };
        let abort_after = (rng.below(10) == 0).then(|| Duration::from_micros(rng.below(2000)));
        let engine = Arc::clone(&engine);
        tasks.spawn(async move {
            let _permit = permit;
            let count = images.len();
            let call = engine.encode(
                images.into_iter().map(input).collect(),
                EncodeOptions::default(),
            );
            let result = match abort_after {
                // Dropping the future mid-way is what a client that hung up does.
                Some(after) => match tokio::time::timeout(after, call).await {
                    Ok(result) => result,
                    Err(_) => return Outcome::Aborted,
                },
                None => tokio::time::timeout(Duration::from_secs(60), call)
                    .await
                    .unwrap_or_else(|_| panic!("request {request} got no answer")),
            };
            match result {
                Ok(results) => {
                    assert_eq!(results.len(), count, "request {request}");
                    Outcome::Served
                }
                Err(EngineError::Device(message)) if message.contains("injected") => {
                    Outcome::DeviceFault
                }
                Err(EngineError::OutOfMemory { .. }) => Outcome::RetryLater,
                Err(other) => panic!("request {request}: unexpected error {other:?}"),
            }
        });
    }
    let mut outcomes = HashMap::new();
    while let Some(joined) = tasks.join_next().await {
        *outcomes
            .entry(joined.expect("request task"))
            .or_insert(0u64) += 1;
    }
    let m = engine.metrics_snapshot();
    let summary = format!("{outcomes:?} {m:?}");
    eprintln!("soak: {summary}");
    assert_eq!(outcomes.values().sum::<u64>(), REQUESTS);
    assert!(
        outcomes.get(&Outcome::Served).copied().unwrap_or(0) > REQUESTS / 2,
        "{summary}"
    );
    assert!(outcomes.contains_key(&Outcome::Aborted), "{summary}");
    assert!(outcomes.contains_key(&Outcome::DeviceFault), "{summary}");
    assert!(m.device_faults > 0 && m.oom_recoveries > 0, "{summary}");
    assert!(
        engine.shared.allocator.stats().oom_retries > 0,
        "injected allocation failures were retried: {summary}"
    );
    // A request the engine failed for memory counts even when its consumer had gone by the
    // time the answer came (then the test saw it as aborted).
    let retry_later = outcomes.get(&Outcome::RetryLater).copied().unwrap_or(0);
    let aborted = outcomes.get(&Outcome::Aborted).copied().unwrap_or(0);
    assert!(
        (retry_later..=retry_later + aborted).contains(&m.oom_failures),
        "{summary}"
    );
    // Before any reset: nothing in flight, the books agree, nothing allocated beyond the
    // weights and the cached outputs.
    assert_eq!(engine.memory_json()["in_flight_requests"], 0);
    check(&engine).await;
    drop(held);
    reset_to_baseline(&engine, &after_start, &summary).await;
}

/// A PNG of `w x h`, distinct per `seed` (any number of them, unlike [`png`]).
fn png_of(seed: u64, (w, h): (u32, u32)) -> Vec<u8> {
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|i: u32| {
            let v = u64::from(i)
                .wrapping_mul(0x9e37_79b9)
                .wrapping_add(seed.wrapping_mul(0x85eb_ca6b));
            v.to_le_bytes()[1]
        })
        .collect();
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &pixels,
        w,
        h,
        image::ExtendedColorType::Rgb8,
    )
    .expect("png encodes");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_report_predicts_the_encoder_cache_bytes_of_each_family() {
    // The golden towers: one per family, Qwen3-VL with two deepstack levels.
    for (family, side, levels) in [
        ("qwen2_vl", 112, 0),
        ("qwen2_5_vl", 112, 0),
        ("qwen3_vl", 128, 2),
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/golden")
            .join(family);
        let mut spec = ModelSpec::from_hf_dir(&dir).expect("the golden config parses");
        assert_eq!(
            spec.vision.deepstack_visual_indexes.len(),
            levels,
            "{family}"
        );
        // Items of at most 16 tokens (a side x side image), four of them in the cache. Their
        // rows (48, 56 or 72 f32 values) make whole 512-byte blocks, so the measured bytes
        // carry no rounding.
        spec.processor.max_pixels = u64::from(side) * u64::from(side);
        let mut cfg = EngineConfig::new(
            spec,
            WeightSource::Dummy {
                seed: DUMMY_DEFAULT_SEED,
            },
        );
        cfg.scheduler.max_num_batched_tokens = 64;
        cfg.scheduler.encoder_cache_size = Some(64);
        // Images only: a profiled video would set the largest item.
        cfg.scheduler.limit_mm_per_prompt.video = 0;
        let engine = Engine::start(cfg, device()).expect("the engine starts");
        let startup = engine.startup();
        assert_eq!(
            (startup.max_item_tokens, startup.encoder_cache_tokens),
            (16, 64),
            "{family}"
        );
        for seed in 0..4 {
            let results = engine
                .encode(
                    vec![input(png(side, side, 150 + seed))],
                    EncodeOptions::default(),
                )
                .await
                .unwrap();
            assert_eq!(results[0].num_tokens, 16, "{family}");
        }
        let g = engine.gauges();
        assert_eq!(g.encoder_cache_entries, 4, "{family}: the cache is full");
        assert_eq!(
            g.encoder_cache_bytes, startup.encoder_cache_bytes,
            "{family}: measured vs predicted encoder cache bytes"
        );
    }
}

/// `count` frames of `w x h` whose pixels depend on the frame and `seed`, as a loader returns
/// them (the metadata is what vLLM's `qwen2_vl` loader reports for a 10 fps clip read whole).
fn video(count: u32, (w, h): (u32, u32), seed: u8) -> VideoInput {
    use crate::preprocess::video::ffmpeg::VideoMetadata;
    use crate::preprocess::{ImageSize, RgbImage};
    let frames = (0..count)
        .map(|f| RgbImage {
            size: ImageSize::new(w, h),
            pixels: (0..w * h * 3)
                .map(|i| {
                    (i.to_le_bytes()[0] ^ i.to_le_bytes()[1])
                        .wrapping_mul(7)
                        .wrapping_add(seed)
                        .wrapping_add(u8::try_from(f % 256).unwrap_or(0).wrapping_mul(41))
                })
                .collect(),
        })
        .collect();
    VideoInput {
        video: Arc::new(DecodedVideo {
            frames,
            metadata: VideoMetadata {
                total_num_frames: count,
                fps: 10.0,
                duration: f64::from(count) / 10.0,
                video_backend: "opencv",
                frames_indices: (0..count).collect(),
                do_sample_frames: true,
            },
        }),
    }
}

/// The tower run directly on one video's frames, processed as the engine's video processing
/// does: what the engine's gathered rows must equal.
fn video_reference(input: &VideoInput) -> (Vec<f32>, [u32; 3]) {
    let processing = ModelSpec::preset("tiny")
        .unwrap()
        .default_video_processing();
    let processed =
        preprocess_frames(&input.video.frames, &processing.config, processing.resize).unwrap();
    (
        run_tower(&processed.pixel_values, processed.grid_thw),
        processed.grid_thw,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_encodes_beside_an_image_as_the_tower_on_its_temporal_groups() {
    let engine = engine();
    let after_start = engine.metrics_snapshot().after_start;
    // Five frames: an odd count, so the last temporal group repeats the last frame.
    let clip = video(5, (84, 56), 3);
    let image = png(56, 56, 4);
    let items = vec![
        MediaInput::Video(clip.clone()),
        MediaInput::Image(input(image.clone())),
    ];
    let plans = engine
        .plan(&items, &ProcessorOverrides::default())
        .await
        .unwrap();
    let results = engine.encode(items, WITH_EMBEDDINGS).await.unwrap();
    let (expected, grid) = video_reference(&clip);
    // 84x56 -> 6x4 patches of 14 per temporal group, three groups: 3 * 24 / 4 = 18 rows.
    assert_eq!(grid, [3, 4, 6]);
    assert_eq!((results[0].grid_thw, results[0].num_tokens), (grid, 18));
    assert_eq!((plans[0].grid_thw, plans[0].num_tokens), (grid, 18));
    assert_close(&results[0].embeddings.clone().unwrap().0, &expected);
    assert_close(
        &results[1].embeddings.clone().unwrap().0,
        &reference(&image),
    );

    // The same frames again: one processor-cache hit and one encoder-cache hit.
    let again = engine
        .encode(
            vec![MediaInput::Video(clip.clone())],
            EncodeOptions::default(),
        )
        .await
        .unwrap();
    assert!(again[0].cached);
    assert_eq!(again[0].mm_hash, results[0].mm_hash);
    // Other frames are another item.
    let other = engine
        .encode(vec![video(5, (84, 56), 4)], EncodeOptions::default())
        .await
        .unwrap();
    assert!(!other[0].cached);
    assert_ne!(other[0].mm_hash, results[0].mm_hash);

    // The request's max_pixels bounds each frame (Qwen2.5-VL's video processor): 84x56 frames
    // under 56x56 pixels shrink to 56x28, 4x2 patches, as the processor with that setting
    // makes them.
    let narrowed = ProcessorOverrides {
        max_pixels: Some(56 * 56),
        ..ProcessorOverrides::default()
    };
    let small = engine
        .encode(
            vec![MediaInput::Video(clip.clone())],
            EncodeOptions {
                processor: narrowed,
                ..WITH_EMBEDDINGS
            },
        )
        .await
        .unwrap();
    let mut processing = ModelSpec::preset("tiny")
        .unwrap()
        .default_video_processing();
    processing.config.max_pixels = 56 * 56;
    let processed =
        preprocess_frames(&clip.video.frames, &processing.config, processing.resize).unwrap();
    assert_eq!(processed.grid_thw, [3, 2, 4]);
    assert_eq!(small[0].grid_thw, processed.grid_thw);
    assert_close(
        &small[0].embeddings.clone().unwrap().0,
        &run_tower(&processed.pixel_values, processed.grid_thw),
    );
    // Another processing is another processor-cache entry, not the default's.
    assert!(!small[0].cached);
    let plans = engine
        .plan(&[MediaInput::Video(clip.clone())], &narrowed)
        .await
        .unwrap();
    assert_eq!(plans[0].grid_thw, processed.grid_thw);
    check(&engine).await;
    reset_to_baseline(&engine, &after_start, "after videos").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_videos_are_refused_by_name_and_leave_nothing_behind() {
    let engine = engine();
    let after_start = engine.metrics_snapshot().after_start;
    let mut mixed = video(4, (56, 56), 1);
    let mut frames = mixed.video.frames.clone();
    frames[2] = video(1, (84, 56), 1).video.frames[0].clone();
    Arc::make_mut(&mut mixed.video).frames = frames;
    let mut empty = video(1, (56, 56), 1);
    Arc::make_mut(&mut empty.video).frames.clear();
    let cases: Vec<(MediaInput, EncodeOptions, &str)> = vec![
        (mixed.into(), EncodeOptions::default(), "corrupt_video"),
        (empty.into(), EncodeOptions::default(), "video_too_short"),
        (
            // Above the model's video max_pixels, for which the budgets were sized.
            video(4, (56, 56), 2).into(),
            EncodeOptions {
                processor: ProcessorOverrides {
                    max_pixels: Some(
                        ModelSpec::preset("tiny")
                            .unwrap()
                            .default_video_processing()
                            .config
                            .max_pixels
                            + 1,
                    ),
                    ..ProcessorOverrides::default()
                },
                ..EncodeOptions::default()
            },
            "invalid_mm_processor_kwargs",
        ),
        (
            video(4, (56, 56), 2).into(),
            EncodeOptions {
                processor: ProcessorOverrides {
                    min_pixels: Some(56 * 56 * 4),
                    max_pixels: Some(56 * 56),
                    ..ProcessorOverrides::default()
                },
                ..EncodeOptions::default()
            },
            "invalid_mm_processor_kwargs",
        ),
    ];
    for (item, options, code) in cases {
        match engine.encode(vec![item], options).await {
            Err(EngineError::BadInput { code: got, message }) => {
                assert_eq!(got, code, "{message}");
                assert!(
                    message.starts_with("video 0: ") || code == "invalid_mm_processor_kwargs",
                    "{message}"
                );
            }
            other => panic!("expected {code}, got {other:?}"),
        }
    }
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
    check(&engine).await;
    assert_eq!(engine.memory_json()["in_flight_requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_video_reads_the_frames_the_models_loader_samples() {
    let engine = engine();
    let clip = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video/odd9.mp4"),
    )
    .unwrap();
    match engine.load_video(clip, SamplingOptions::default()).await {
        Ok(decoded) => {
            // The tiny model is a Qwen2-VL: its loader reads an even count of frames.
            assert_eq!(decoded.frames.len() % 2, 0);
            assert_eq!(decoded.metadata.frames_indices.len(), decoded.frames.len());
            let results = engine
                .encode(
                    vec![VideoInput {
                        video: Arc::new(decoded),
                    }],
                    EncodeOptions::default(),
                )
                .await
                .unwrap();
            assert!(results[0].num_tokens > 0);
        }
        Err(EngineError::Unsupported { code, message })
            if std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none() =>
        {
            assert_eq!(code, "video_decoder_missing");
            eprintln!("skipped: {message}");
            return;
        }
        Err(other) => panic!("the clip decodes: {other}"),
    }
    match engine
        .load_video(b"not a clip".to_vec(), SamplingOptions::default())
        .await
    {
        Err(EngineError::BadInput { code, message }) => {
            assert_eq!(code, "corrupt_video");
            // The clip was written to a temporary file; a client has no use for its path.
            assert!(
                message.contains("the clip")
                    && !message.contains(std::env::temp_dir().to_string_lossy().as_ref()),
                "{message}"
            );
        }
        other => panic!("expected corrupt_video, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clips_tokens_are_charged_before_its_frames_are_decoded() {
    // A 2048-token budget: the clip's groups at the largest frames pass it.
    let mut cfg = config();
    cfg.scheduler.max_model_len = 2048;
    let engine = Engine::start(cfg, device()).expect("the engine starts");
    let bytes = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video/odd9.mp4"),
    )
    .unwrap();
    let clip = match engine.open_video(bytes, SamplingOptions::default()).await {
        Ok(clip) => clip,
        Err(EngineError::Unsupported { message, .. })
            if std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none() =>
        {
            eprintln!("skipped: {message}");
            return;
        }
        Err(other) => panic!("the clip opens: {other}"),
    };
    let (frames, size) = (clip.frames(), clip.size());
    let processing = engine.video_processing().clone();
    let tokens = u64::from(
        video_shape(frames, size, &processing.config, processing.resize)
            .unwrap()
            .tokens,
    );
    let pending = || engine.metrics_snapshot().admission;

    // A request's min_pixels that scales the frames past the budget is refused by name
    // before a frame is decoded, and charges nothing.
    let mut permit = engine.admit().unwrap();
    let huge = ProcessorOverrides {
        min_pixels: Some(processing.config.max_pixels),
        ..ProcessorOverrides::default()
    };
    match engine.reserve_video(&mut permit, 3, frames, size, &huge) {
        Err(EngineError::BadInput { code, message }) => {
            assert_eq!(code, "video_over_budget", "{message}");
            assert!(message.starts_with("video 3: "), "{message}");
        }
        other => panic!("expected video_over_budget, got {other:?}"),
    }
    assert_eq!(pending().pending_tokens, 0);

    // The clip's tokens are charged from its probe; the decoded frames are what the probe
    // said, and their encode charges nothing more.
    engine
        .reserve_video(&mut permit, 0, frames, size, &ProcessorOverrides::default())
        .unwrap();
    assert_eq!(pending().pending_tokens, tokens);
    let decoded = engine
        .decode_video(clip, Some(permit.hold()))
        .await
        .unwrap();
    assert_eq!(
        (decoded.frames.len(), decoded.frames[0].size),
        (frames, size)
    );
    let results = engine
        .encode_admitted(
            permit,
            vec![VideoInput {
                video: Arc::new(decoded),
            }],
            EncodeOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(results[0].num_tokens, tokens);
    let admission = pending();
    assert_eq!(
        (admission.pending_tokens, admission.peak_pending_tokens),
        (0, tokens)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_over_the_encoder_budget_is_refused_with_the_numbers() {
    // A 2048-token context: the profiled video is 4 frames of the largest image, 2048 tokens,
    // the budget.
    let mut cfg = config();
    cfg.scheduler.max_model_len = 2048;
    let engine = Engine::start(cfg, device()).expect("the engine starts");
    assert_eq!(engine.startup().encoder_compute_budget, 2048);
    let after_start = engine.metrics_snapshot().after_start;
    // 448x448 frames: 32x32 patches of 14, 256 rows per temporal group; 20 frames make 10
    // groups, 2560 rows, over the 2048-token budget of the test configuration.
    let clip = video(20, (448, 448), 5);
    let processing = engine.video_processing().clone();
    let shape = video_shape(
        20,
        ImageSize::new(448, 448),
        &processing.config,
        processing.resize,
    )
    .unwrap();
    assert_eq!(shape.tokens, 2560);
    let refused = |result: Result<(), EngineError>| match result {
        Err(EngineError::BadInput { code, message }) => {
            assert_eq!(code, "video_over_budget", "{message}");
            assert!(
                message.starts_with("video 1: ")
                    && message.contains("2560")
                    && message.contains("2048"),
                "{message}"
            );
        }
        Err(other) => panic!("expected video_over_budget, got {other:?}"),
        Ok(_) => panic!("expected video_over_budget, got results"),
    };
    let items = || {
        vec![
            MediaInput::Image(input(png(56, 56, 4))),
            MediaInput::Video(clip.clone()),
        ]
    };
    refused(
        engine
            .encode(items(), EncodeOptions::default())
            .await
            .map(|_| ()),
    );
    // Refused (by encode, and by plan, which preprocesses for the EC producer) before any
    // item was preprocessed: a clip that a request's min_pixels scales up could otherwise
    // take hundreds of gigabytes of pixels before the scheduler saw it.
    refused(
        engine
            .plan(&items(), &ProcessorOverrides::default())
            .await
            .map(|_| ()),
    );
    let metrics = engine.metrics_snapshot();
    assert_eq!(
        (metrics.processor_cache_hits, metrics.processor_cache_misses),
        (0, 0)
    );
    check(&engine).await;
    reset_to_baseline(&engine, &after_start, "after a refused video").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_profile_sizes_the_largest_video_as_vllm_does_unless_video_is_off() {
    // The tiny model is a Qwen2-VL: its largest image is 896x896, 64x64 patches, 1024 tokens;
    // vLLM's profiling video is 14 frames of it, 7 temporal groups, 7168 tokens.
    let engine = engine();
    let startup = engine.startup();
    assert_eq!(startup.max_item_modality, Modality::Video);
    assert_eq!(
        (startup.max_item_grid, startup.max_item_tokens),
        ([7, 64, 64], 7168)
    );
    assert_eq!(
        startup.modality_max_tokens,
        [(Modality::Image, 1024), (Modality::Video, 7168)]
    );
    assert_eq!(startup.encoder_compute_budget, 7168);
    drop(engine);

    // A 3000-token context fits two temporal groups: 4 frames.
    let mut cfg = config();
    cfg.scheduler.max_model_len = 3000;
    let engine = Engine::start(cfg, device()).expect("the engine starts");
    assert_eq!(engine.startup().max_item_grid, [2, 64, 64]);
    drop(engine);

    // Video off: images set the profile, and a video is refused by name.
    let mut cfg = config();
    cfg.scheduler.limit_mm_per_prompt.video = 0;
    let engine = Engine::start(cfg, device()).expect("the engine starts");
    let startup = engine.startup();
    assert_eq!(
        (startup.max_item_modality, startup.max_item_grid),
        (Modality::Image, [1, 64, 64])
    );
    assert_eq!(startup.modality_max_tokens, [(Modality::Image, 1024)]);
    match engine
        .encode(vec![video(4, (56, 56), 1)], EncodeOptions::default())
        .await
    {
        Err(EngineError::BadInput { code, message }) => {
            assert_eq!(code, "mm_limit_exceeded", "{message}");
            assert!(message.contains("at most 0 video(s)"), "{message}");
        }
        other => panic!("expected mm_limit_exceeded, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_vl_profile_sizes_vllms_two_frame_dummy_video() {
    // Qwen3-VL's video processor spreads 25165824 pixels over the frames: vLLM's dummy video
    // is two frames of 12582912 pixels each, 4096x3072 (128x96 windows of 32), 12288 tokens,
    // fewer than the largest image's 16384: the image sets the profile.
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden/qwen3_vl");
    let mut spec = ModelSpec::from_hf_dir(&dir).expect("the golden config parses");
    spec.processor.max_pixels = 16_777_216;
    let mut cfg = EngineConfig::new(
        spec,
        WeightSource::Dummy {
            seed: DUMMY_DEFAULT_SEED,
        },
    );
    assert_eq!(cfg.video.config.max_pixels, 25_165_824);
    cfg.scheduler.max_num_batched_tokens = 16_384;
    let engine = Engine::start(cfg, device()).expect("the engine starts");
    let startup = engine.startup();
    assert_eq!(
        startup.modality_max_tokens,
        [(Modality::Image, 16_384), (Modality::Video, 12_288)]
    );
    assert_eq!(
        (startup.max_item_modality, startup.max_item_grid),
        (Modality::Image, [1, 256, 256])
    );
}

/// A scheduler setting that must be positive is refused before anything loads: with weights
/// from a file that does not exist, the error is the setting's, not the file's.
#[test]
fn a_zero_scheduler_setting_is_refused_before_the_weights_load() {
    for zeroed in ["max_num_batched_tokens", "max_num_seqs", "kv_block_size"] {
        let mut config = EngineConfig::new(
            ModelSpec::preset("tiny").expect("tiny preset"),
            WeightSource::Safetensors(vec!["/nonexistent/model.safetensors".into()]),
        );
        match zeroed {
            "max_num_batched_tokens" => config.scheduler.max_num_batched_tokens = 0,
            "max_num_seqs" => config.scheduler.max_num_seqs = 0,
            _ => config.scheduler.kv_block_size = 0,
        }
        let Err(err) = Engine::start(config, device()) else {
            panic!("{zeroed} = 0 started an engine");
        };
        let text = err.to_string();
        assert!(
            text.contains(&format!("{zeroed} must be at least 1")),
            "{zeroed}: {text}"
        );
    }
}
