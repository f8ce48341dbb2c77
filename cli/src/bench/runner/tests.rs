//! Runner tests: an in-memory target for the scheduling logic, and the HTTP target end to end
//! against the real router (test engine) on a loopback port.

use std::collections::HashSet;
use std::sync::atomic::AtomicUsize;

use super::*;
use crate::bench::workload::{
    ImageFormat, ImageSize, ImageSource, VideoSource, WorkloadSpec, build_workload,
};
use crate::http::test_engine::FakeEngine;
use crate::http::{Limits, ServerConfig};

/// In-memory target: every new hash holds 1 KiB until reset; `leak` keeps 1 byte per reset.
#[derive(Default)]
struct MemTarget {
    seen: Mutex<HashSet<Arc<[u8]>>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    calls: AtomicUsize,
    fail_every: usize,
    leak: bool,
    fail_reset: bool,
    leaked: AtomicUsize,
}

impl MemTarget {
    fn point(&self) -> MemoryPoint {
        let held = u64::try_from(
            self.seen.lock().unwrap().len() * 1024 + self.leaked.load(Ordering::SeqCst),
        )
        .unwrap();
        MemoryPoint {
            device_used_bytes: 4096 + held,
            allocator_reserved_bytes: 2048 + held,
            allocator_allocated_bytes: 1024 + held,
            encoder_cache_bytes: held,
            plugin_held_bytes: 0,
        }
    }
}

impl BenchTarget for MemTarget {
    fn describe(&self) -> String {
        "memory".into()
    }

    async fn encode(
        &self,
        images: Vec<Arc<EncodedMedia>>,
    ) -> Result<Vec<EncodedItem>, TargetError> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(3)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_every > 0 && call.is_multiple_of(self.fail_every) {
            return Err(TargetError::Engine("injected failure".into()));
        }
        let mut seen = self.seen.lock().unwrap();
        Ok(images
            .iter()
            .map(|img| EncodedItem {
                mm_hash: format!("{:p}", img.bytes.as_ptr()),
                num_tokens: 10,
                cached: !seen.insert(Arc::clone(&img.bytes)),
            })
            .collect())
    }

    async fn startup_memory(&self) -> Result<StartupMemory, TargetError> {
        Ok(StartupMemory {
            before_start: MemoryPoint::default(),
            after_start: self.point(),
        })
    }

    async fn memory(&self) -> Result<MemoryPoint, TargetError> {
        Ok(self.point())
    }

    async fn cache_counters(&self) -> Result<EngineCounters, TargetError> {
        Ok(EngineCounters {
            encoder_misses: u64::try_from(self.seen.lock().unwrap().len()).unwrap(),
            ..EngineCounters::default()
        })
    }

    async fn reset_all(&self) -> Result<(), TargetError> {
        if self.fail_reset {
            return Err(TargetError::Engine("reset refused".into()));
        }
        self.seen.lock().unwrap().clear();
        if self.leak {
            self.leaked.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

fn workload(prompts: usize, per_prompt: usize, repeat: f64) -> Workload {
    build_workload(&WorkloadSpec {
        source: ImageSource::Synthetic {
            sizes: vec![
                ImageSize {
                    width: 56,
                    height: 56,
                },
                ImageSize {
                    width: 84,
                    height: 28,
                },
            ],
            format: ImageFormat::Png,
        },
        video_source: VideoSource::DEFAULT,
        num_prompts: prompts,
        images_per_prompt: per_prompt,
        videos_per_prompt: 0,
        repeat_ratio: repeat,
        seed: 11,
    })
    .unwrap()
}

fn opts(max_concurrency: Option<usize>) -> RunOptions {
    RunOptions {
        max_concurrency,
        sample_interval: Duration::from_millis(2),
        show_progress: false,
        ..RunOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_capped_and_every_prompt_runs() {
    let target = Arc::new(MemTarget::default());
    let w = workload(12, 2, 0.5);
    let report = run_bench(Arc::clone(&target), &w, &opts(Some(3)))
        .await
        .unwrap();
    assert_eq!(report.stats.completed, 12);
    assert_eq!(report.stats.images, 24);
    assert_eq!(report.stats.tokens, 240);
    assert!(target.max_in_flight.load(Ordering::SeqCst) <= 3);
    assert_eq!(
        report.stats.cached_images, 12,
        "the repeated slots are served as cached"
    );
    assert!(report.verdict.returned);
    assert_eq!(report.exit_code(), 0);
    assert!(
        report.memory.after_load.device_used_bytes > report.memory.after_start.device_used_bytes
    );
    assert!(report.timeline.len() >= 4);
    assert_eq!(report.info.repeated_slots, 12);
}

#[tokio::test]
async fn failed_requests_are_counted_not_fatal() {
    let target = Arc::new(MemTarget {
        fail_every: 3,
        ..MemTarget::default()
    });
    let report = run_bench(target, &workload(9, 1, 0.0), &opts(Some(1)))
        .await
        .unwrap();
    assert_eq!((report.stats.completed, report.stats.failed), (6, 3));
    assert_eq!(
        report.stats.errors,
        vec!["engine: injected failure".to_owned()]
    );
}

#[tokio::test]
async fn memory_that_stays_gives_exit_status_1() {
    let target = Arc::new(MemTarget {
        leak: true,
        ..MemTarget::default()
    });
    let report = run_bench(target, &workload(3, 1, 0.0), &opts(None))
        .await
        .unwrap();
    assert!(!report.verdict.returned);
    assert_eq!(report.verdict.leaked_bytes, 1);
    assert_eq!(report.exit_code(), 1);
    assert!(report.render_text().ends_with("baseline: no (+1 bytes)\n"));
}

#[tokio::test]
async fn a_failed_reset_stops_the_run() {
    let target = Arc::new(MemTarget {
        fail_reset: true,
        ..MemTarget::default()
    });
    let err = run_bench(target, &workload(2, 1, 0.0), &opts(None))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("calling reset_all: engine: reset refused"),
        "{err}"
    );
}

#[test]
fn http_target_rejects_unusable_urls() {
    for url in [
        "https://127.0.0.1:8000",
        "127.0.0.1:8000",
        "http://",
        "not a url",
    ] {
        assert!(
            matches!(HttpTarget::new(url, None), Err(TargetError::Url { .. })),
            "{url}"
        );
    }
    assert_eq!(
        HttpTarget::new("http://127.0.0.1:8000/", None)
            .unwrap()
            .describe(),
        "http://127.0.0.1:8000"
    );
}

/// Starts the router over `engine` on a loopback port; returns the URL and a shutdown sender.
async fn start_server(
    engine: Arc<FakeEngine>,
    api_key: Option<&str>,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let config = ServerConfig {
        limits: Limits::default(),
        api_key: api_key.map(str::to_owned),
        ..ServerConfig::default()
    };
    let app = crate::http::router(engine, config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::http::serve(listener, app, async move {
        let _ = rx.await;
    }));
    (url, tx, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_target_end_to_end_against_the_router() {
    let engine = Arc::new(FakeEngine::new(false));
    let (url, shutdown, server) = start_server(Arc::clone(&engine), Some("k3y")).await;
    let target = Arc::new(HttpTarget::new(&url, Some("k3y".into())).unwrap());
    let w = workload(8, 2, 0.5);
    let report = run_bench(
        target,
        &w,
        &RunOptions {
            request_rate: RequestRate::PerSecond(400.0),
            ..opts(Some(4))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (report.stats.completed, report.stats.failed),
        (8, 0),
        "{:?}",
        report.stats.errors
    );
    // 56x56 -> 4 tokens, 84x28 -> 3 tokens (the test engine merges 2x2 patches of 14 px).
    assert!(report.stats.tokens > 0);
    assert!(report.cache.encoder_hit_rate > 0.0, "{:?}", report.cache);
    assert!(
        report.memory.after_load.allocator_allocated_bytes
            > report.memory.after_start.allocator_allocated_bytes
    );
    assert!(report.memory.after_load.encoder_cache_bytes > 0);
    assert_eq!(report.memory.after_reset, report.memory.after_start);
    assert!(
        report.memory.before_start.device_used_bytes < report.memory.after_start.device_used_bytes
    );
    assert!(report.verdict.returned, "{}", report.render_text());
    assert_eq!(report.to_json()["leaked_bytes"], 0);

    // Without the key every call but /health is refused, so the run cannot start.
    let keyless = Arc::new(HttpTarget::new(&url, None).unwrap());
    let err = run_bench(keyless, &w, &opts(None)).await.unwrap_err();
    assert!(err.to_string().contains("HTTP 401"), "{err}");
    shutdown.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_target_reports_a_leak() {
    let (url, shutdown, server) = start_server(Arc::new(FakeEngine::new(true)), None).await;
    let target = Arc::new(HttpTarget::new(&url, None).unwrap());
    let report = run_bench(target, &workload(4, 1, 0.0), &opts(None))
        .await
        .unwrap();
    assert!(!report.verdict.returned);
    assert_eq!(
        report.verdict.leaked_bytes,
        1 << 20,
        "{}",
        report.render_text()
    );
    assert_eq!(report.exit_code(), 1);
    // A bad encode answer is a counted failure, not a crash.
    let bad = HttpTarget::new(&url, None).unwrap();
    let img = Arc::new(EncodedMedia {
        modality: Modality::Image,
        bytes: Arc::from(&b"not an image"[..]),
        media_type: "image/png",
        label: "junk".into(),
    });
    let err = bad.encode(vec![img]).await.unwrap_err();
    assert!(
        matches!(err, TargetError::Http { status: 400, .. }),
        "{err}"
    );
    shutdown.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_silent_server_times_out() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let target = HttpTarget::new(&url, None)
        .unwrap()
        .with_timeout(Duration::from_millis(50));
    let err = target.memory().await.unwrap_err();
    assert!(
        err.to_string().contains("no complete response within"),
        "{err}"
    );
    hold.abort();
}

#[tokio::test]
async fn a_closed_port_is_a_transport_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let err = HttpTarget::new(&url, None)
        .unwrap()
        .reset_all()
        .await
        .unwrap_err();
    assert!(matches!(err, TargetError::Transport { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_target_over_an_engine() {
    let target = Arc::new(InProcessTarget::new(Arc::new(FakeEngine::new(false))));
    let report = run_bench(target, &workload(6, 2, 0.5), &opts(Some(2)))
        .await
        .unwrap();
    assert_eq!((report.stats.completed, report.stats.failed), (6, 0));
    assert_eq!(report.info.target, "in-process");
    assert_eq!(report.stats.cached_images, 6);
    assert_eq!(report.cache.encoder_hit_rate, 0.5);
    assert!(
        report.memory.after_load.device_used_bytes > report.memory.after_start.device_used_bytes
    );
    assert!(report.verdict.returned, "{}", report.render_text());

    let leaky = Arc::new(InProcessTarget::new(Arc::new(FakeEngine::new(true))));
    let report = run_bench(leaky, &workload(3, 1, 0.0), &opts(None))
        .await
        .unwrap();
    assert_eq!(report.exit_code(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_their_own_row_over_http_and_in_process() {
    // Over HTTP: the server answers 503 `overloaded`; the bench counts refusals, not failures.
    let engine = Arc::new(FakeEngine::new(false));
    let (url, shutdown, server) = start_server(Arc::clone(&engine), None).await;
    engine.set_overloaded(true);
    let target = Arc::new(HttpTarget::new(&url, None).unwrap());
    let report = run_bench(target, &workload(4, 1, 0.0), &opts(Some(2)))
        .await
        .unwrap();
    let s = &report.stats;
    assert_eq!((s.completed, s.refused, s.aborted, s.failed), (0, 4, 0, 0));
    assert!(s.errors.is_empty(), "{:?}", s.errors);
    assert!(
        s.refusal.as_deref().is_some_and(|r| r.contains("503")),
        "{:?}",
        s.refusal
    );
    let text = report.render_text();
    assert!(text.contains("\n  refused:  4 ("), "{text}");
    assert!(text.contains("\n  failed:   0\n"), "{text}");
    assert_eq!(report.to_json()["requests"]["refused"], 4);
    shutdown.send(()).unwrap();
    server.await.unwrap().unwrap();

    // In process: the engine's admission refuses, with the same count.
    let engine = Arc::new(FakeEngine::new(false));
    engine.set_overloaded(true);
    let target = Arc::new(InProcessTarget::new(Arc::clone(&engine)));
    let report = run_bench(target, &workload(3, 1, 0.0), &opts(None))
        .await
        .unwrap();
    assert_eq!((report.stats.refused, report.stats.failed), (3, 0));
    assert_eq!(report.exit_code(), 0, "refusals are load, not a fault");
}

#[tokio::test]
async fn offered_and_served_rates_give_the_capacity_line() {
    let target = Arc::new(MemTarget::default());
    let report = run_bench(
        target,
        &workload(20, 1, 0.0),
        &RunOptions {
            request_rate: RequestRate::PerSecond(200.0),
            ..opts(None)
        },
    )
    .await
    .unwrap();
    let offered = report.info.offered_requests_per_s.unwrap();
    // 19 Poisson intervals at 200/s: the realised rate is near, not at, the asked one.
    assert!((50.0..800.0).contains(&offered), "{offered}");
    let capacity = report.capacity();
    assert_eq!(capacity.offered_requests_per_s, Some(offered));
    assert!(report.render_text().contains("capacity:   offered"));
    let all_at_once = run_bench(
        Arc::new(MemTarget::default()),
        &workload(5, 1, 0.0),
        &opts(None),
    )
    .await
    .unwrap();
    assert_eq!(all_at_once.info.offered_requests_per_s, None);
    assert!(all_at_once.capacity().over_capacity);
    assert!(
        all_at_once
            .render_text()
            .contains("capacity:   every request offered at once"),
        "{}",
        all_at_once.render_text()
    );
}
