//! The engine end to end on the built-in CPU device with the `tiny` model and dummy weights.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::encoder::tower::VisionTower;
use crate::model::DUMMY_DEFAULT_SEED;
use crate::preprocess::preprocess;
use crate::test_support::{cpu_allocator, cpu_device};

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
};

/// The tower run directly on one image: what the engine's gathered rows must equal.
fn reference(bytes: &[u8]) -> Vec<f32> {
    let spec = ModelSpec::preset("tiny").unwrap();
    let allocator = cpu_allocator("1GiB");
    let runner = Runner::new(allocator);
    let host = config().weights.load(&spec.vision, DType::F32).unwrap();
    let tower = VisionTower::new(&runner, spec.vision.clone(), &host, DType::F32).unwrap();
    let image = preprocess(bytes, &spec.processor, &DecodeLimits::default()).unwrap();
    let rows = image.num_patches() as u64;
    let pixels = runner
        .upload_f32(
            &image.pixel_values,
            DType::F32,
            rows,
            spec.vision.patch_row_len() as u64,
        )
        .unwrap();
    let out = tower.forward(&runner, &pixels, &[image.grid_thw]).unwrap();
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
    let encoder = engine.reset_encoder_cache().await;
    assert_eq!(encoder.encoder_cache_entries, 1);
    assert!(encoder.encoder_cache_bytes >= 64 * 64 * 4);
    // The encoder cache's blocks went back to the allocator, which still holds them.
    assert_eq!(
        engine.gauges().allocator_allocated_bytes,
        after_start.allocator_allocated_bytes
    );
    let trim = engine.reset_allocator().await;
    assert!(trim.allocator_bytes > 0);
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
    let nothing = engine.reset_all().await;
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
        engine.reset_all().await;
    }
    for (round, task) in tasks.into_iter().enumerate() {
        let results = task.await.unwrap().expect("survives the reset");
        for (k, r) in results.iter().enumerate() {
            assert_close(&r.embeddings.clone().unwrap().0, &expected[(round + k) % 6]);
        }
    }
    engine.reset_all().await;
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
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
            vec![input(b"GIF89a not an image".to_vec())],
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
    engine.reset_all().await;
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_consumer_aborts_its_request() {
    let mut cfg = config();
    // A small step budget spreads the request over many steps.
    cfg.scheduler.max_num_batched_tokens = 128;
    let engine = Arc::new(Engine::start(cfg, device()).unwrap());
    let after_start = engine.metrics_snapshot().after_start;
    let in_flight = |e: &Engine| e.memory_json()["in_flight_requests"].as_u64().unwrap();
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
    for _ in 0..1000 {
        if in_flight(&engine) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(in_flight(&engine), 0, "the abort released the request");
    engine.reset_all().await;
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&after_start)
    );
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
    engine.reset_all().await;
    assert_eq!(
        baseline_figures(&engine.gauges()),
        baseline_figures(&m.after_start)
    );
}
