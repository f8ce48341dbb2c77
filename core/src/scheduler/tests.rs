use super::*;
use crate::cache::encoder::EncoderCacheManager;

fn config(mnbt: u64) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: mnbt,
        ..SchedulerConfig::default()
    }
}

/// A scheduler whose largest item is `m` tokens, with compute budget and cache as given.
fn scheduler(
    mut c: SchedulerConfig,
    m: u64,
    compute: Option<u64>,
    cache: Option<u64>,
) -> Scheduler {
    c.max_num_encoder_input_tokens = compute;
    c.encoder_cache_size = cache;
    Scheduler::with_item_limit(c, m).unwrap()
}

/// The same, following the `progress` policy.
fn progress(mut c: SchedulerConfig, m: u64, compute: Option<u64>, cache: Option<u64>) -> Scheduler {
    c.policy = Policy::Progress;
    scheduler(c, m, compute, cache)
}

fn add(s: &mut Scheduler, prompt_len: u64, items: Vec<MmItem>) -> RequestId {
    s.add_request(NewRequest::new(prompt_len, items)).unwrap()
}

fn tokens(out: &StepOutput, id: RequestId) -> u64 {
    out.scheduled
        .iter()
        .find(|(r, _)| *r == id)
        .map_or(0, |(_, t)| *t)
}

fn encoded(out: &StepOutput) -> Vec<(RequestId, usize)> {
    out.encoder_inputs
        .iter()
        .map(|e| (e.request, e.index))
        .collect()
}

fn step(s: &mut Scheduler) -> (StepOutput, Vec<RequestId>) {
    let out = s.schedule().unwrap();
    let finished = s.update_from_output(&out);
    s.manager().verify().unwrap();
    (out, finished)
}

/// Runs until nothing is unfinished; every step must schedule a token. Returns finishing steps.
fn run_to_completion(s: &mut Scheduler, max_steps: u64) -> HashMap<RequestId, u64> {
    let mut done = HashMap::new();
    while s.has_unfinished() {
        let (out, finished) = step(s);
        assert!(
            out.total_tokens() > 0,
            "step {} scheduled nothing: {} waiting, {} running",
            out.step,
            s.num_waiting(),
            s.num_running()
        );
        assert!(out.step < max_steps, "not done after {max_steps} steps");
        for id in finished {
            done.insert(id, out.step);
        }
    }
    done
}

#[test]
fn text_and_item_in_one_step() {
    let mut s = scheduler(config(1000), 600, None, None);
    let a = add(&mut s, 800, vec![MmItem::new("x", 100, 600)]);
    let (out, finished) = step(&mut s);
    assert_eq!(out.scheduled, vec![(a, 800)]);
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(finished, vec![a]);
    // Released on finish, but kept resident as freeable.
    assert_eq!(
        (
            s.manager().num_free_slots(),
            s.manager().num_freeable_slots()
        ),
        (400, 1000)
    );
}

#[test]
fn window_stops_before_an_item_beyond_it() {
    let mut s = scheduler(config(500), 600, None, Some(1000));
    let a = add(&mut s, 1200, vec![MmItem::new("x", 500, 600)]);
    let (out, _) = step(&mut s);
    assert_eq!(tokens(&out, a), 500);
    assert!(
        out.encoder_inputs.is_empty(),
        "item starts at the window's end"
    );
    let (out, _) = step(&mut s);
    assert_eq!(encoded(&out), vec![(a, 0)]);
}

#[test]
fn chunked_item_spans_steps_and_is_released_once_consumed() {
    let mut s = scheduler(config(500), 600, None, Some(1000));
    let a = add(&mut s, 800, vec![MmItem::new("x", 100, 600)]);
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, a), encoded(&out)), (500, vec![(a, 0)]));
    assert_eq!(s.manager().references("x"), Some(1));
    // Second step reads the cached output; no second encoder run.
    let (out, finished) = step(&mut s);
    assert_eq!(tokens(&out, a), 300);
    assert!(out.encoder_inputs.is_empty());
    assert_eq!(finished, vec![a]);
    assert_eq!(s.manager().references("x"), Some(0));
}

#[test]
fn input_released_when_its_last_position_is_consumed() {
    // Item [100, 400) in a 1000-token prompt, 250 tokens a step.
    let mut s = scheduler(config(250), 300, None, Some(300));
    let a = add(&mut s, 1000, vec![MmItem::new("x", 100, 300)]);
    step(&mut s); // computed 250
    assert_eq!(s.manager().references("x"), Some(1));
    step(&mut s); // computed 500 >= 400: released
    assert_eq!(s.num_computed_tokens(a), Some(500));
    assert_eq!(s.manager().references("x"), Some(0));
    assert_eq!(s.manager().num_freeable_slots(), 300);
}

#[test]
fn non_chunked_item_is_never_split() {
    let mut c = config(500);
    c.disable_chunked_mm_input = true;
    let mut s = scheduler(c, 400, None, None);
    let a = add(&mut s, 800, vec![MmItem::new("x", 300, 400)]);
    // Window [0, 500) would cover [300, 500) of the item only: cut back to 300.
    let (out, _) = step(&mut s);
    assert_eq!(tokens(&out, a), 300);
    assert!(out.encoder_inputs.is_empty());
    // Window [300, 800) covers it whole.
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, a), encoded(&out)), (500, vec![(a, 0)]));
}

#[test]
fn non_chunked_item_at_the_window_start_waits_for_room() {
    let mut c = config(500);
    c.disable_chunked_mm_input = true;
    let mut s = scheduler(c, 400, None, None);
    let first = add(&mut s, 200, vec![]);
    let b = add(&mut s, 400, vec![MmItem::new("x", 0, 400)]);
    // 300 tokens left after `first`: the item would be split, so b gets nothing this step.
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, first), tokens(&out, b)), (200, 0));
    let (out, finished) = step(&mut s);
    assert_eq!((tokens(&out, b), encoded(&out)), (400, vec![(b, 0)]));
    assert_eq!(finished, vec![b]);
}

#[test]
fn compute_budget_refusal_cuts_back_to_the_item_start() {
    // Compute budget 600 = one item; tokens 2000.
    let mut s = scheduler(config(2000), 600, Some(600), Some(2000));
    let a = add(&mut s, 600, vec![MmItem::new("x", 0, 600)]);
    let b = add(&mut s, 800, vec![MmItem::new("y", 100, 600)]);
    let (out, _) = step(&mut s);
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(tokens(&out, b), 100, "text before the item only");
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, b), encoded(&out)), (700, vec![(b, 0)]));
}

#[test]
fn space_refusal_cuts_back_and_resumes_when_space_frees() {
    let mut s = scheduler(config(500), 800, None, Some(1000));
    let a = add(&mut s, 1000, vec![MmItem::new("x", 0, 800)]);
    let b = add(&mut s, 700, vec![MmItem::new("y", 100, 600)]);
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, a), tokens(&out, b)), (500, 0));
    // a still holds x (800 of 1000): b gets its text, not its item.
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, a), tokens(&out, b)), (500, 0));
    // a consumed x at the end of step 1 and finished; y evicts x.
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, b), encoded(&out)), (500, vec![(b, 0)]));
    assert_eq!(out.freed, vec![MmHash::from("x")]);
}

#[test]
fn sharing_in_one_step_encodes_once() {
    let mut s = scheduler(config(2000), 600, None, None);
    let a = add(&mut s, 600, vec![MmItem::new("x", 0, 600)]);
    let b = add(&mut s, 700, vec![MmItem::new("x", 100, 600)]);
    let out = s.schedule().unwrap();
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!((tokens(&out, a), tokens(&out, b)), (600, 700));
    assert_eq!(s.manager().references("x"), Some(2));
    assert_eq!(s.manager().stats().hits, 1);
    s.update_from_output(&out);
    assert_eq!(s.manager().references("x"), Some(0));
}

#[test]
fn repeated_image_in_one_request_holds_two_references() {
    // x at [0,100) and again at [150,250); 200 tokens a step.
    let mut s = scheduler(config(200), 100, None, Some(200));
    let a = add(
        &mut s,
        400,
        vec![MmItem::new("x", 0, 100), MmItem::new("x", 150, 100)],
    );
    let out = s.schedule().unwrap();
    // One encoder run; both occurrences reference the entry.
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(s.manager().references("x"), Some(2));
    s.update_from_output(&out);
    // The first occurrence is consumed and released; the second still holds the entry.
    assert_eq!(s.manager().references("x"), Some(1));
    assert_eq!(s.manager().num_freeable_slots(), 100);
    let (out, _) = step(&mut s); // [200, 400)
    assert!(out.encoder_inputs.is_empty());
    assert_eq!(s.manager().references("x"), Some(0));
}

#[test]
fn released_entry_is_reused_by_a_later_occurrence() {
    // x at [0,100) and again at [300,400); the first is released before the second is reached.
    let mut s = scheduler(config(200), 100, None, Some(200));
    let a = add(
        &mut s,
        500,
        vec![MmItem::new("x", 0, 100), MmItem::new("x", 300, 100)],
    );
    let (out, _) = step(&mut s); // [0, 200)
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(
        s.manager().references("x"),
        Some(0),
        "kept resident, freeable"
    );
    let (out, _) = step(&mut s); // [200, 400): hit
    assert!(out.encoder_inputs.is_empty());
    assert_eq!(s.manager().stats().hits, 1);
    let (_, finished) = step(&mut s);
    assert_eq!(finished, vec![a]);
}

#[test]
fn repeated_image_in_one_window_is_scheduled_once_and_referenced_twice() {
    let mut s = scheduler(config(1000), 100, None, Some(200));
    let a = add(
        &mut s,
        600,
        vec![MmItem::new("x", 0, 100), MmItem::new("x", 300, 100)],
    );
    let out = s.schedule().unwrap();
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(s.manager().references("x"), Some(2));
    assert!(s.manager().holds(a, 1));
}

#[test]
fn mask_sizes_count_embeddings_only() {
    let mask: Vec<bool> = (0..100).map(|i| i % 4 != 0).collect(); // 75 embeddings
    let mut s = scheduler(config(1000), 100, None, Some(100));
    let a = add(
        &mut s,
        300,
        vec![
            MmItem::with_mask("x", 0, &mask),
            MmItem::with_embeds("y", 100, 50, 25),
        ],
    );
    let out = s.schedule().unwrap();
    assert_eq!(
        out.encoder_inputs
            .iter()
            .map(|e| e.embeds)
            .collect::<Vec<_>>(),
        vec![75, 25]
    );
    assert_eq!(tokens(&out, a), 300);
    assert_eq!(s.manager().num_free_slots(), 0);
}

#[test]
fn waiting_head_that_cannot_move_is_set_aside_and_keeps_its_place() {
    // Compute budget 1000: a's item leaves 400, b's 500 does not fit; vLLM tries c behind b.
    let mut s = scheduler(config(2000), 600, Some(1000), Some(2000));
    let a = add(&mut s, 600, vec![MmItem::new("x", 0, 600)]);
    let b = add(&mut s, 500, vec![MmItem::new("y", 0, 500)]);
    let c = add(&mut s, 10, vec![]);
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(a, 600), (c, 10)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![b]);
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(b, 500)]);
    assert_eq!(encoded(&out), vec![(b, 0)]);
}

#[test]
fn progress_waiting_head_that_cannot_move_blocks_those_behind() {
    // Compute budget 1000: a's item leaves 400, b's 500 does not fit; c (text only) waits behind b.
    let mut s = progress(config(2000), 600, Some(1000), Some(2000));
    let a = add(&mut s, 600, vec![MmItem::new("x", 0, 600)]);
    let b = add(&mut s, 500, vec![MmItem::new("y", 0, 500)]);
    let c = add(&mut s, 10, vec![]);
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(a, 600)]);
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(b, 500), (c, 10)]);
    assert_eq!(encoded(&out), vec![(b, 0)]);
}

#[test]
fn max_num_seqs_bounds_running_requests() {
    let mut c = config(1000);
    c.max_num_seqs = 2;
    let mut s = scheduler(c, 10, None, None);
    for _ in 0..3 {
        add(&mut s, 300, vec![]);
    }
    let out = s.schedule().unwrap();
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn abort_releases_everything() {
    let mut s = scheduler(config(500), 800, None, Some(1000));
    let a = add(&mut s, 1000, vec![MmItem::new("x", 0, 800)]);
    step(&mut s);
    assert_eq!(s.manager().references("x"), Some(1));
    assert!(s.abort(a));
    assert!(!s.abort(a));
    assert_eq!(s.manager().num_freeable_slots(), 1000);
    assert!(!s.has_unfinished());
}

#[test]
fn reset_mid_item_re_encodes() {
    let mut s = scheduler(config(500), 800, None, Some(1000));
    let a = add(&mut s, 1000, vec![MmItem::new("x", 0, 800)]);
    step(&mut s);
    let r = s.reset_encoder_cache();
    assert_eq!((r.entries, r.tokens, r.references), (1, 800, 1));
    let (out, finished) = step(&mut s);
    assert_eq!((tokens(&out, a), encoded(&out)), (500, vec![(a, 0)]));
    assert_eq!(finished, vec![a]);
}

#[test]
fn invalid_requests_are_refused() {
    let mut s = scheduler(config(500), 800, None, Some(1000));
    let bad = [
        NewRequest::new(0, vec![]),
        NewRequest::new(100, vec![MmItem::new("x", 50, 100)]),
        NewRequest::new(100, vec![MmItem::new("x", 0, 50), MmItem::new("y", 40, 10)]),
        NewRequest::new(100, vec![MmItem::with_embeds("x", 0, 50, 51)]),
        NewRequest::new(2000, vec![MmItem::new("x", 0, 1001)]),
    ];
    for r in bad {
        assert!(s.add_request(r.clone()).is_err(), "{r:?}");
    }
    let err = s
        .add_request(NewRequest::new(2000, vec![MmItem::new("x", 0, 1001)]))
        .unwrap_err();
    assert!(err.to_string().contains("--encoder-cache-size"), "{err}");
    assert!(!s.has_unfinished());
}

/// The livelock case: two maximum-size items and a cache that fits exactly one.
#[test]
fn two_maximum_items_and_a_cache_for_one_both_complete() {
    let m = 1000;
    let setups: Vec<(&str, SchedulerConfig, Vec<NewRequest>)> = vec![
        (
            "chunked, step smaller than an item",
            config(300),
            vec![
                NewRequest::new(1000, vec![MmItem::new("x", 0, m)]),
                NewRequest::new(1000, vec![MmItem::new("y", 0, m)]),
            ],
        ),
        (
            "chunked, text before each item",
            config(700),
            vec![
                NewRequest::new(1500, vec![MmItem::new("x", 200, m)]),
                NewRequest::new(1100, vec![MmItem::new("y", 50, m)]),
            ],
        ),
        (
            "non-chunked, step of exactly one item",
            SchedulerConfig {
                disable_chunked_mm_input: true,
                ..config(m)
            },
            vec![
                NewRequest::new(1100, vec![MmItem::new("x", 100, m)]),
                NewRequest::new(1100, vec![MmItem::new("y", 100, m)]),
            ],
        ),
        (
            "two items in each request",
            config(400),
            vec![
                NewRequest::new(
                    2100,
                    vec![MmItem::new("x", 0, m), MmItem::new("z", 1100, m)],
                ),
                NewRequest::new(
                    2000,
                    vec![MmItem::new("y", 0, m), MmItem::new("x", 1000, m)],
                ),
            ],
        ),
    ];
    // vLLM 0.33.0 sets aside a waiting request it cannot place, so this case no longer stalls
    // it; both policies must complete it.
    for policy in Policy::ALL {
        for (name, c, requests) in setups.clone() {
            let mut s = scheduler(SchedulerConfig { policy, ..c }, m, None, Some(m));
            let ids: Vec<RequestId> = requests
                .into_iter()
                .map(|r| s.add_request(r).unwrap())
                .collect();
            let done = run_to_completion(&mut s, 100);
            for id in ids {
                assert!(
                    done.contains_key(&id),
                    "{policy}, {name}: {id} did not complete"
                );
            }
            assert_eq!(s.manager().stats().references, 0, "{policy}, {name}");
        }
    }
}

/// The same case with a reset in the middle: both requests are mid-item and must re-encode
/// through a cache that fits one of them.
#[test]
fn two_maximum_items_complete_across_a_reset() {
    let m = 1000;
    let mut s = scheduler(config(300), m, None, Some(m));
    let a = add(&mut s, 1000, vec![MmItem::new("x", 0, m)]);
    let b = add(&mut s, 1000, vec![MmItem::new("y", 0, m)]);
    // Two steps: a holds x with 600 of its 1000 positions consumed; b waits for the space.
    step(&mut s);
    step(&mut s);
    assert_eq!(s.num_computed_tokens(a), Some(600));
    s.reset_encoder_cache();
    let done = run_to_completion(&mut s, 100);
    assert!(done.contains_key(&a));
    assert!(done.contains_key(&b));
}

/// A request refused for cache space has first claim on it: a request behind it may not take
/// the space it is waiting for, even if its own item would fit.
#[test]
fn refused_request_keeps_first_claim_on_freed_space() {
    let m = 1000;
    let mut c = config(800);
    c.max_num_encoder_input_tokens = Some(m);
    c.encoder_cache_size = Some(m);
    c.policy = Policy::Progress;
    let mut s = Scheduler::with_item_limit(c, m).unwrap();
    let p = add(&mut s, 600, vec![MmItem::new("w", 0, 600)]);
    let r = add(&mut s, 1100, vec![MmItem::new("y", 100, m)]);
    let q = add(&mut s, 300, vec![MmItem::new("x", 0, 200)]);
    // Step 0: p encodes w (compute 400 left); y exceeds the compute left, so r gets its text;
    // q encodes x and gets 100 tokens, holding x.
    let (out, _) = step(&mut s);
    assert_eq!(encoded(&out), vec![(p, 0), (q, 0)]);
    assert_eq!(
        (tokens(&out, p), tokens(&out, r), tokens(&out, q)),
        (600, 100, 100)
    );
    // Step 1: r is refused for space (x is held); s's small item would fit the 200 free slots but
    // would eat into r's claim, so s gets no tokens; q finishes and releases x.
    let late = add(&mut s, 200, vec![MmItem::new("z", 0, 100)]);
    let (out, _) = step(&mut s);
    assert_eq!(tokens(&out, r), 0);
    assert_eq!(tokens(&out, q), 200);
    assert_eq!(tokens(&out, late), 0);
    // Step 2: r takes the whole cache.
    let (out, _) = step(&mut s);
    assert_eq!(encoded(&out), vec![(r, 0)]);
    run_to_completion(&mut s, 100);
}

/// Without the claim, a stream of small items arriving every step would keep a maximum item
/// out forever; with it the maximum item is served within a few steps.
#[test]
fn stream_of_small_items_does_not_starve_a_maximum_item() {
    let m = 1000;
    let mut c = config(800);
    c.max_num_encoder_input_tokens = Some(m);
    c.encoder_cache_size = Some(m);
    c.policy = Policy::Progress;
    let mut s = Scheduler::with_item_limit(c, m).unwrap();
    add(&mut s, 600, vec![MmItem::new("w", 0, 600)]);
    let big = add(&mut s, 1100, vec![MmItem::new("y", 100, m)]);
    let mut served = None;
    for n in 0..50u32 {
        add(&mut s, 300, vec![MmItem::new(format!("s{n}"), 0, 200)]);
        let (out, _) = step(&mut s);
        if out.encoder_inputs.iter().any(|e| e.request == big) {
            served = Some(out.step);
            break;
        }
    }
    let served = served.expect("the maximum item was never encoded");
    assert!(served <= 3, "served at step {served}");
}

#[test]
fn policy_is_swappable_through_the_traits() {
    fn drive<P: SchedulerPolicy>(p: &mut P) -> u64 {
        let mut steps = 0;
        while p.has_unfinished() {
            let out = p.schedule().unwrap();
            p.update_from_output(&out);
            steps += 1;
        }
        steps
    }
    let c = config(500);
    let budget = EncoderBudget::new(&c, &[(Modality::Image, ModalityLimits::new(400))]).unwrap();
    let mut s: Scheduler<EncoderCacheManager, EncoderBudget> =
        Scheduler::new(c, budget, EncoderCacheManager::new(400));
    s.add_request(NewRequest::new(900, vec![MmItem::new("x", 0, 400)]))
        .unwrap();
    assert_eq!(drive(&mut s), 2);
}

#[test]
fn unchunked_rule_comes_before_a_cache_hit() {
    // x is cached by a; b's window [0, 300) covers x at [100, 500) only in part. vLLM cuts b
    // back to x's start although x needs no encoder run; the progress policy lets it split x.
    let mut c = config(800);
    c.disable_chunked_mm_input = true;
    for (policy, expected) in [(Policy::Vllm, 100), (Policy::Progress, 300)] {
        let mut s = scheduler(
            SchedulerConfig {
                policy,
                ..c.clone()
            },
            400,
            None,
            None,
        );
        let a = add(&mut s, 500, vec![MmItem::new("x", 0, 400)]);
        let b = add(&mut s, 600, vec![MmItem::new("x", 100, 400)]);
        let (out, _) = step(&mut s);
        assert_eq!(
            (tokens(&out, a), tokens(&out, b)),
            (500, expected),
            "{policy}"
        );
    }
}

#[test]
fn a_window_without_embedding_positions_encodes_nothing() {
    // The item's first position is a marker, not an embedding: a window ending just past it
    // leaves the item for the next step.
    let mut s = scheduler(config(101), 100, None, None);
    let a = add(
        &mut s,
        300,
        vec![MmItem::with_runs("x", 100, 100, vec![(1, 99)])],
    );
    let (out, _) = step(&mut s);
    assert_eq!((tokens(&out, a), encoded(&out)), (101, vec![]));
    let (out, _) = step(&mut s);
    assert_eq!(encoded(&out), vec![(a, 0)]);
    assert_eq!(out.encoder_inputs[0].embeds, 98);
}

#[test]
fn a_waiting_request_is_admitted_only_if_its_whole_prompt_fits_the_kv_cache() {
    // 16-token blocks, 10 usable (11 less the null block). Preemption itself is covered by the
    // vLLM traces (preemption-*.jsonl).
    let mut cfg = config(96);
    cfg.max_num_seqs = 4;
    cfg.num_kv_blocks = Some(11);
    let mut s = scheduler(cfg, 10, None, None);
    let a = add(&mut s, 144, vec![]);
    let b = add(&mut s, 144, vec![]);
    // a takes the whole budget: 96 tokens, 6 blocks.
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(a, 96)]);
    assert_eq!(out.free_kv_blocks, Some(4));
    let c = add(&mut s, 16, vec![]);
    // a's last 48 tokens take 3 more blocks, leaving 1; b's 9 blocks do not fit, and c, behind
    // it, is not tried.
    let (out, finished) = step(&mut s);
    assert_eq!(out.scheduled, vec![(a, 48)]);
    assert_eq!(out.free_kv_blocks, Some(1));
    assert_eq!(finished, vec![a]);
    let (out, _) = step(&mut s);
    assert_eq!(out.scheduled, vec![(b, 96)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![c]);
    assert!(
        s.add_request(NewRequest::new(161, vec![])).is_err(),
        "11 blocks of 16 tokens can never hold 161"
    );
}
