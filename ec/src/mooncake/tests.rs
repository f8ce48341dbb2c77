//! The push path against the in-process consumer: what is sent, what lands, and that every
//! failure leaves nothing reserved.

use std::sync::Arc;
use std::time::Duration;

use super::consumer::{Faults, TestConsumer};
use super::*;

fn producer(timeout_ms: u64) -> MooncakeProducer {
    MooncakeProducer::new(
        MooncakeSettings {
            control_timeout: Duration::from_millis(timeout_ms),
        },
        "iris-test".to_owned(),
    )
}

fn spec(transfer_id: &str, mm_hash: &str, rows: u64) -> PushSpec {
    PushSpec {
        transfer_id: transfer_id.to_owned(),
        mm_hash: mm_hash.to_owned(),
        rows,
        width: 64,
        dtype: EcDtype::Bf16,
    }
}

fn rows(spec: &PushSpec, seed: u8) -> Arc<Vec<u8>> {
    let n = usize::try_from(spec.nbytes()).unwrap();
    Arc::new(
        (0..n)
            .map(|i| (i.to_le_bytes()[0]).wrapping_mul(31).wrapping_add(seed))
            .collect(),
    )
}

fn ops(consumer: &TestConsumer) -> Vec<String> {
    consumer
        .exchanges()
        .iter()
        .map(|e| e.request["op"].as_str().unwrap_or("?").to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_land_on_every_shard_and_are_completed() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    let producer = producer(5_000);
    let specs = vec![spec("t0", "hash-a", 100), spec("t1", "hash-b", 37)];
    let payloads = vec![Some(rows(&specs[0], 1)), Some(rows(&specs[1], 2))];
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), specs.clone())
        .await
        .unwrap();
    assert!(reserved.needs_write(0) && reserved.needs_write(1));
    let report = producer.push(reserved, &payloads).await.unwrap();
    assert_eq!(report.writes, 4);
    assert_eq!(report.bytes, 2 * (specs[0].nbytes() + specs[1].nbytes()));
    for shard in 0..2 {
        for (spec, payload) in specs.iter().zip(&payloads) {
            let (bytes, shape, dtype) = consumer.resident(shard, &spec.mm_hash).unwrap();
            assert_eq!(&bytes, payload.as_deref().unwrap());
            assert_eq!(shape, vec![spec.rows, 64]);
            assert_eq!(dtype, "bfloat16");
        }
    }
    assert_eq!(consumer.live_reservations(), 0);
    let mut seen = ops(&consumer);
    seen.sort();
    assert_eq!(
        seen,
        [
            "complete_batch",
            "complete_batch",
            "peers",
            "reserve_batch",
            "reserve_batch"
        ]
    );
    // Protocol 2: every write asked for a status.
    assert!(consumer.writes().iter().all(|w| w.opcode == 0x81));
    // Every allocation is 256-byte aligned, as vLLM's pool's.
    assert!(consumer.writes().iter().all(|w| w.offset % 256 == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_the_consumer_holds_is_not_written_again() {
    let consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let producer = producer(5_000);
    let first = spec("t0", "hash-a", 10);
    let payload = rows(&first, 3);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![first.clone()])
        .await
        .unwrap();
    producer.push(reserved, &[Some(payload)]).await.unwrap();
    assert_eq!(consumer.exchanges()[1].request["op"], "reserve");
    let writes = consumer.writes().len();

    let again = spec("t1", "hash-a", 10);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![again])
        .await
        .unwrap();
    assert!(!reserved.needs_write(0), "{reserved:?}");
    let report = producer.push(reserved, &[None]).await.unwrap();
    assert_eq!((report.writes, report.cached_items), (0, 1));
    assert_eq!(consumer.writes().len(), writes);
    assert_eq!(consumer.live_reservations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_images_given_one_reservation_are_not_written() {
    // The consumer keys reservations by transfer id: a second image under the first's id
    // gets the first's range.
    let consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let producer = producer(5_000);
    let (a, b) = (spec("t", "hash-a", 8), spec("t", "hash-b", 8));
    let payloads = [Some(rows(&a, 1)), Some(rows(&b, 2))];
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![a, b])
        .await
        .unwrap();
    let err = producer.push(reserved, &payloads).await.unwrap_err();
    assert_eq!(err.failure, PushFailure::Protocol, "{err}");
    assert!(
        err.message
            .contains("overlapping ranges for mm_hash hash-a"),
        "{err}"
    );
    assert!(consumer.writes().is_empty());
    assert!(consumer.resident(0, "hash-a").is_none());
    assert_eq!(consumer.live_reservations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_dropped_mid_way_cancels_what_the_shards_granted() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    consumer.set_faults(Faults {
        slow_reserve: Some((1, Duration::from_millis(500))),
        ..Faults::default()
    });
    let producer = Arc::new(producer(5_000));
    let addr = consumer.consumer_zmq();
    let reserving = {
        let producer = Arc::clone(&producer);
        tokio::spawn(async move { producer.reserve(&addr, vec![spec("t0", "hash-a", 8)]).await })
    };
    // Shard 0 granted its reservation; shard 1 is still thinking when the caller goes away
    // (its client hung up).
    while consumer.live_reservations() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reserving.abort();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(consumer.live_reservations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_named_in_an_answer_that_does_not_parse_is_cancelled() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    consumer.set_faults(Faults {
        malformed_reserve: true,
        ..Faults::default()
    });
    let producer = producer(5_000);
    for specs in [
        vec![spec("t0", "hash-a", 8)],
        vec![spec("t1", "hash-b", 8), spec("t2", "hash-c", 8)],
    ] {
        let err = producer
            .reserve(&consumer.consumer_zmq(), specs)
            .await
            .unwrap_err();
        assert_eq!(err.failure, PushFailure::Protocol, "{err}");
        assert!(err.message.contains("no numeric `dst_ptr`"), "{err}");
        assert_eq!(consumer.live_reservations(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reservations_named_in_a_batch_answer_of_the_wrong_length_are_cancelled() {
    let consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    consumer.set_faults(Faults {
        short_batch_answer: true,
        ..Faults::default()
    });
    let producer = producer(5_000);
    let specs = vec![
        spec("t0", "hash-a", 8),
        spec("t1", "hash-b", 8),
        spec("t2", "hash-c", 8),
    ];
    let err = producer
        .reserve(&consumer.consumer_zmq(), specs)
        .await
        .unwrap_err();
    assert_eq!(err.failure, PushFailure::Protocol, "{err}");
    assert!(
        err.message
            .contains("answered reserve_batch of 3 items with 2 items"),
        "{err}"
    );
    // The two it named are given back; the third, never named, waits for the consumer's TTL.
    assert_eq!(consumer.live_reservations(), 1);
}

// One thread: the cancels' task cannot run before the first poll returns, so that poll is
// pending for certain (with a second worker the task could finish first, and the drop would
// come after the work it is meant to interrupt).
#[tokio::test]
async fn an_abandon_dropped_mid_way_still_cancels_everything() {
    let consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let producer = producer(5_000);
    let specs: Vec<PushSpec> = (0..3)
        .map(|i| spec(&format!("t{i}"), &format!("hash-{i}"), 8))
        .collect();
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), specs)
        .await
        .unwrap();
    assert_eq!(consumer.live_reservations(), 3);
    // The caller of the abandon goes away after its first poll.
    let mut abandon = Box::pin(reserved.abandon());
    assert!(futures::poll!(abandon.as_mut()).is_pending());
    drop(abandon);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(consumer.live_reservations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_1_targets_get_no_status_request() {
    let consumer = TestConsumer::start(1, 1 << 16, 1).await.unwrap();
    let producer = producer(5_000);
    let item = spec("t0", "hash-a", 8);
    let payload = rows(&item, 4);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![item.clone()])
        .await
        .unwrap();
    producer
        .push(reserved, &[Some(Arc::clone(&payload))])
        .await
        .unwrap();
    assert_eq!(consumer.writes()[0].opcode, 0x01);
    assert_eq!(consumer.resident(0, "hash-a").unwrap().0, *payload);
}

/// Runs one push of two items against a consumer with `faults` set after the reservations
/// (`late`) or before them, and returns the error; checks that nothing stays reserved.
async fn failing_push(faults: Faults, late: bool, shards: usize) -> PushError {
    let consumer = TestConsumer::start(shards, 1 << 20, 2).await.unwrap();
    let producer = producer(800);
    let specs = vec![spec("t0", "hash-a", 100), spec("t1", "hash-b", 50)];
    let payloads = vec![Some(rows(&specs[0], 1)), Some(rows(&specs[1], 2))];
    if !late {
        consumer.set_faults(faults.clone());
    }
    let result = match producer.reserve(&consumer.consumer_zmq(), specs).await {
        Err(err) => Err(err),
        Ok(reserved) => {
            consumer.set_faults(faults.clone());
            producer.push(reserved, &payloads).await
        }
    };
    let err = result.unwrap_err();
    assert!(err.to_string().contains(&consumer.consumer_zmq()), "{err}");
    if !faults.never_answer {
        consumer.set_faults(Faults::default());
        assert_eq!(consumer.live_reservations(), 0, "{err}: reservations left");
        assert_eq!(consumer.allocated_bytes(), 0, "{err}: pool not given back");
    }
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_fails_the_push_and_cancels_what_was_reserved() {
    let consumer = TestConsumer::start(2, 40_000, 2).await.unwrap();
    let producer = producer(2_000);
    // The first item fits on both shards, the second on neither.
    let specs = vec![spec("t0", "hash-a", 200), spec("t1", "hash-b", 200)];
    let err = producer
        .reserve(&consumer.consumer_zmq(), specs)
        .await
        .unwrap_err();
    assert_eq!(err.failure, PushFailure::PoolFull, "{err}");
    assert!(err.message.contains("pool is full"), "{err}");
    assert_eq!(consumer.live_reservations(), 0);
    assert_eq!(consumer.allocated_bytes(), 0);
    let cancels = ops(&consumer).iter().filter(|op| *op == "cancel").count();
    assert_eq!(cancels, 2, "one cancel per shard of the reserved item");
    let err = failing_push(
        Faults {
            pool_full: true,
            ..Faults::default()
        },
        false,
        1,
    )
    .await;
    assert_eq!(err.failure, PushFailure::PoolFull);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_fails_the_push_with_its_class_and_leaves_nothing_reserved() {
    let cases = [
        (
            Faults {
                cancel_on_reserve: true,
                ..Faults::default()
            },
            false,
            PushFailure::Cancelled,
        ),
        (
            Faults {
                reject_writes: true,
                ..Faults::default()
            },
            true,
            PushFailure::Rejected,
        ),
        (
            Faults {
                cut_mid_write: true,
                ..Faults::default()
            },
            true,
            PushFailure::Connection,
        ),
        (
            Faults {
                forget_on_complete: true,
                ..Faults::default()
            },
            true,
            PushFailure::Cancelled,
        ),
        (
            Faults {
                advertise_rdma: true,
                ..Faults::default()
            },
            true,
            PushFailure::Rdma,
        ),
        (
            Faults {
                never_answer: true,
                ..Faults::default()
            },
            false,
            PushFailure::Timeout,
        ),
    ];
    for (faults, late, failure) in cases {
        let err = failing_push(faults.clone(), late, 2).await;
        assert_eq!(err.failure, failure, "{faults:?}: {err}");
        if failure == PushFailure::Rdma {
            assert!(err.message.contains("MC_FORCE_TCP=1"), "{err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_is_down_is_named_in_the_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let consumer = format!("tcp://127.0.0.1:{port}");
    let err = producer(300)
        .reserve(&consumer, vec![spec("t0", "hash-a", 4)])
        .await
        .unwrap_err();
    assert!(
        matches!(err.failure, PushFailure::Unreachable | PushFailure::Timeout),
        "{err}"
    );
    assert!(err.to_string().contains(&consumer), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_dropped_unsettled_are_cancelled_in_the_background() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    let producer = producer(2_000);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![spec("t0", "hash-a", 16)])
        .await
        .unwrap();
    assert_eq!(consumer.live_reservations(), 2);
    drop(reserved);
    for _ in 0..200 {
        if consumer.live_reservations() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(consumer.live_reservations(), 0);
    assert_eq!(consumer.allocated_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_outside_the_consumers_buffers_is_refused_before_any_byte() {
    let consumer = TestConsumer::start(1, 4096, 2).await.unwrap();
    let producer = producer(2_000);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![spec("t0", "hash-a", 4)])
        .await
        .unwrap();
    let session = reserved.shards()[0][0].dst_session.clone();
    let base = reserved.shards()[0][0].dst_ptr;
    reserved.abandon().await;
    let err = producer
        .transfer
        .write(&session, base + 4000, &[0u8; 200])
        .await
        .unwrap_err();
    assert_eq!(err.failure, PushFailure::Rejected, "{err}");
    assert!(consumer.writes().is_empty());
    producer
        .transfer
        .write(&session, base, &[7u8; 64])
        .await
        .unwrap();
    assert_eq!(consumer.writes().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_engine_restarted_gets_a_new_handshake() {
    let mut consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let producer = producer(2_000);
    let first = spec("t0", "hash-a", 8);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![first.clone()])
        .await
        .unwrap();
    producer
        .push(reserved, &[Some(rows(&first, 1))])
        .await
        .unwrap();
    // The cached descriptor and the pooled connection now name a data port that is gone.
    consumer.restart_data().await.unwrap();
    let second = spec("t1", "hash-b", 8);
    let payload = rows(&second, 2);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![second])
        .await
        .unwrap();
    producer
        .push(reserved, &[Some(Arc::clone(&payload))])
        .await
        .unwrap();
    assert_eq!(consumer.resident(0, "hash-b").unwrap().0, *payload);
    assert_eq!(consumer.live_reservations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pooled_data_connection_of_a_restarted_consumer_is_dropped() {
    let mut consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let producer = producer(2_000);
    let addr = consumer.consumer_zmq();
    let a = spec("t0", "hash-a", 8);
    let payload_a = rows(&a, 1);
    let reserved = producer.reserve(&addr, vec![a]).await.unwrap();
    // Two writes at once (as two requests' pushes do), after the first handshake, leave two
    // data connections pooled.
    let shard = reserved.shards[0][0].clone();
    producer
        .transfer
        .write(&shard.dst_session, shard.dst_ptr, &payload_a)
        .await
        .unwrap();
    let (first, second) = tokio::join!(
        producer
            .transfer
            .write(&shard.dst_session, shard.dst_ptr, &payload_a),
        producer
            .transfer
            .write(&shard.dst_session, shard.dst_ptr, &payload_a),
    );
    first.unwrap();
    second.unwrap();
    producer.push(reserved, &[Some(payload_a)]).await.unwrap();
    consumer.restart_data().await.unwrap();
    // The restart closes the old connections as its aborted tasks wind down.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = spec("t2", "hash-c", 8);
    let payload = rows(&c, 3);
    let reserved = producer.reserve(&addr, vec![c]).await.unwrap();
    producer
        .push(reserved, &[Some(Arc::clone(&payload))])
        .await
        .unwrap();
    assert_eq!(consumer.resident(0, "hash-c").unwrap().0, *payload);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_past_half_its_ttl_is_taken_again_before_the_write() {
    let consumer = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
    let mut producer = producer(2_000);
    producer.refresh_after = Duration::ZERO;
    let item = spec("t0", "hash-a", 8);
    let payload = rows(&item, 5);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![item])
        .await
        .unwrap();
    producer
        .push(reserved, &[Some(Arc::clone(&payload))])
        .await
        .unwrap();
    let exchanges = consumer.exchanges();
    let ops: Vec<&str> = exchanges
        .iter()
        .map(|e| e.request["op"].as_str().unwrap())
        .collect();
    assert_eq!(
        ops,
        ["peers", "reserve", "cancel", "reserve", "complete_batch"]
    );
    assert_eq!(exchanges[2].request["refresh"], true);
    assert_eq!(exchanges[2].request["abandon"], true);
    assert_eq!(consumer.resident(0, "hash-a").unwrap().0, *payload);
    assert_eq!(consumer.live_reservations(), 0);
    assert_eq!(
        consumer.allocated_bytes(),
        8 * 64 * 2,
        "only the resident item's room"
    );
}

fn allowing(timeout_ms: u64, entries: &[&str]) -> MooncakeProducer {
    producer(timeout_ms).with_allowed_consumers(ConsumerAllowList::parse(entries).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_off_the_allow_list_is_not_contacted() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    let producer = allowing(2_000, &["10.0.0.0/8", "pd-host"]);
    assert!(!producer.allows(&consumer.consumer_zmq()));
    assert!(producer.allows("tcp://10.0.0.7:15000"));
    let err = producer
        .reserve(&consumer.consumer_zmq(), vec![spec("t0", "hash-a", 4)])
        .await
        .unwrap_err();
    assert_eq!(err.failure, PushFailure::NotAllowed, "{err}");
    assert!(err.to_string().contains(&consumer.consumer_zmq()), "{err}");
    assert!(err.to_string().contains("(not_allowed)"), "{err}");
    assert!(consumer.exchanges().is_empty(), "{:?}", ops(&consumer));

    // On the list, the same consumer is pushed to.
    let producer = allowing(2_000, &["10.0.0.0/8", "127.0.0.1"]);
    let item = spec("t1", "hash-a", 4);
    let payload = rows(&item, 1);
    let reserved = producer
        .reserve(&consumer.consumer_zmq(), vec![item])
        .await
        .unwrap();
    producer.push(reserved, &[Some(payload)]).await.unwrap();
    assert!(consumer.resident(1, "hash-a").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_a_consumer_names_off_the_allow_list_fail_the_push_and_cancel_it() {
    // `localhost` reaches the consumer as well as 127.0.0.1 does, but is not on the list:
    // hosts are compared as written.
    for (faults, handshaken) in [
        (
            Faults {
                session_host: Some("localhost".to_owned()),
                ..Faults::default()
            },
            false,
        ),
        (
            Faults {
                data_host: Some("localhost".to_owned()),
                ..Faults::default()
            },
            true,
        ),
    ] {
        let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
        consumer.set_faults(faults.clone());
        let guarded = allowing(2_000, &["127.0.0.0/8"]);
        let item = spec("t0", "hash-a", 4);
        let payload = rows(&item, 1);
        let reserved = guarded
            .reserve(&consumer.consumer_zmq(), vec![item])
            .await
            .unwrap();
        assert_eq!(consumer.live_reservations(), 2);
        let err = guarded.push(reserved, &[Some(payload)]).await.unwrap_err();
        assert_eq!(err.failure, PushFailure::NotAllowed, "{faults:?}: {err}");
        assert!(err.message.contains("localhost:"), "{err}");
        assert_eq!(consumer.handshakes() > 0, handshaken, "{faults:?}");
        assert!(consumer.writes().is_empty(), "{faults:?}");
        assert_eq!(consumer.live_reservations(), 0, "{faults:?}: {err}");
        assert_eq!(consumer.allocated_bytes(), 0, "{faults:?}: {err}");
        let cancels = ops(&consumer).iter().filter(|op| *op == "cancel").count();
        assert_eq!(cancels, 2, "{faults:?}: one cancel per shard");

        // Without a list (vLLM's behaviour), the same consumer is pushed to.
        let open = producer(2_000);
        let item = spec("t1", "hash-a", 4);
        let payload = rows(&item, 1);
        let reserved = open
            .reserve(&consumer.consumer_zmq(), vec![item])
            .await
            .unwrap();
        open.push(reserved, &[Some(payload)]).await.unwrap();
        assert!(consumer.resident(0, "hash-a").is_some(), "{faults:?}");
    }
}
