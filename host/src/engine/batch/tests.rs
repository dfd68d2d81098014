//! The batch's tests: seats on the tiny generated model, trip wires at node N.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc as pieces;

use super::seat::Op;
use super::sequences::MAX_LEFTOVERS;
use super::*;
use crate::engine::schedule::Claim;
use crate::engine::{Cores, Meter};
use crate::native::synthetic::TextModelSpec;
use crate::native::{
    self, Batch, CancelFlag, Context, ContextParams, Error, FinishReason, GenerateRequest, Model,
    Piece, PromptPiece, Sampler, Stop, Token,
};
use crate::worker::Call;
use crate::worker::Tracker;

const MIN_TURN: Duration = crate::engine::schedule::BesideTurn::MIN;

fn model() -> Arc<Model> {
    static MODEL: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
    MODEL
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("llamabox-batch-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("tiny.gguf");
            TextModelSpec::tiny().write(&path).unwrap();
            Arc::new(Model::load(&path).unwrap())
        })
        .clone()
}

/// A pool on the test model, and the steps it ran.
struct Fixture {
    pool: BatchPool,
    policy: BatchPolicy,
    steps: Arc<Mutex<Vec<StepReport>>>,
    tracker: Tracker,
}

impl Fixture {
    fn new(step_rows: u32) -> Self {
        let steps: Arc<Mutex<Vec<StepReport>>> = Arc::default();
        let seen = steps.clone();
        let policy = BatchPolicy {
            step_rows,
            observer: Some(Arc::new(move |r: &StepReport| seen.lock().unwrap().push(*r))),
            ..BatchPolicy::new(4, 256, 1)
        };
        Self { pool: BatchPool::default(), policy, steps, tracker: Tracker::new() }
    }

    async fn seat_in(&self, group: &str, meter: Arc<Meter>) -> Seat {
        let model = model();
        self.pool
            .lease(
                &self.policy,
                &model,
                SeatRequest {
                    n_ctx: 256,
                    n_batch: 256,
                    group,
                    claim: Claim::default(),
                    may_wait: false,
                },
                meter,
                &self.tracker,
            )
            .await
            .expect("batched")
            .expect("a seat")
    }

    async fn seat(&self) -> Seat {
        self.seat_in("g", Arc::default()).await
    }

    fn steps(&self) -> Vec<StepReport> {
        self.steps.lock().unwrap().clone()
    }
}

/// Hold the batch's thread until the returned gate is dropped: calls sent meanwhile
/// all join the next step.
fn pause(seat: &Seat) -> mpsc::Sender<()> {
    let (gate, wait) = mpsc::channel();
    seat.batcher.ops.send(Op::Pause(wait)).unwrap();
    gate
}

fn prompt(seed: i32, n: usize) -> Vec<Token> {
    let n_vocab = model().n_vocab() as i32;
    (0..n as i32).map(|i| (seed * 7919 + i * 104_729).rem_euclid(n_vocab)).collect()
}

/// The last row's logits of `tokens` decoded on a context of its own.
fn solo_logits(tokens: &[Token]) -> Vec<f32> {
    let params =
        ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
    let mut ctx = Context::new(model(), params).unwrap();
    ctx.decode(&Batch::sequence(tokens, 0, 0), None).unwrap();
    ctx.last_logits().unwrap().to_vec()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[tokio::test]
async fn three_seats_share_one_step_and_each_gets_its_own_logits() {
    let f = Fixture::new(512);
    let seats = [f.seat().await, f.seat().await, f.seat().await];
    let prompts: Vec<Vec<Token>> = (0..3).map(|i| prompt(i, 40)).collect();
    let gate = pause(&seats[0]);
    let calls: Vec<_> = seats
        .iter()
        .zip(&prompts)
        .map(|(s, p)| s.decode(Batch::sequence(p, 0, 0), CancelFlag::new()))
        .collect();
    drop(gate);
    for call in calls {
        call.await.unwrap().unwrap();
    }
    let steps = f.steps();
    assert_eq!(
        (steps.len(), steps[0].seats, steps[0].rows),
        (1, 3, 120),
        "one step for all three: {steps:?}"
    );
    for (seat, p) in seats.iter().zip(&prompts) {
        let batched = seat.logits(None).await.unwrap().unwrap();
        let solo = solo_logits(p);
        // Batched numerics are not bitwise solo ones (the module doc says why).
        let scale = solo.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(
            max_diff(&batched, &solo) < 1e-2 * scale,
            "batched vs solo logits differ by {} (logits up to {scale})",
            max_diff(&batched, &solo)
        );
        assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 39);
    }
}

/// Wait (bounded) until `n` turns are asked for on `cores`.
async fn turns_asked(cores: &Cores, n: u64) {
    for _ in 0..10_000 {
        if cores.waiting() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{} turns asked for, not {n}", cores.waiting());
}

/// A long decode of a context of its own beside a batch passes the cores at its graph's
/// boundaries once it has held them a turn: a turn asked for while it computes comes
/// before it ends. With a turn longer than the decode, only after.
#[test]
fn a_long_decode_beside_a_batch_passes_the_cores_to_whoever_waits() {
    for (turn, passes) in [(Duration::ZERO, true), (Duration::from_secs(3600), false)] {
        let cores = Arc::new(Cores::default());
        cores.set_turn(turn);
        let params =
            ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
        let mut ctx = Context::new(model(), params).unwrap();
        let meter = Arc::new(Meter::new());
        ctx.set_tally(meter.clone());
        ctx.share_cores(Some(cores.clone()));
        ctx.set_device_chunk_work(Some(1)); // a boundary after every matmul
        let wait_for = |n| {
            while cores.waiting() != n {
                std::thread::yield_now();
            }
        };
        let held = cores.turn();
        let decoding = std::thread::spawn(move || {
            ctx.decode(&Batch::sequence(&prompt(5, 200), 0, 0), None).unwrap();
        });
        wait_for(2);
        // The decode counts its rows before it gives its turn back: 0 while it computes.
        let waiter = {
            let (cores, meter) = (cores.clone(), meter.clone());
            std::thread::spawn(move || {
                let _turn = cores.turn();
                meter.decoded()
            })
        };
        wait_for(3);
        drop(held);
        let decoded_when_the_waiter_ran = waiter.join().unwrap();
        decoding.join().unwrap();
        assert_eq!(decoded_when_the_waiter_ran == 0, passes, "turn {turn:?}");
        assert_eq!(meter.decoded(), 200);
    }
}

#[tokio::test]
async fn batches_of_one_policy_and_contexts_beside_them_compute_in_turns() {
    let f = Fixture::new(512);
    // Two batches of one policy (two seat sizes) and a context of its own sharing its cores.
    let small = BatchPolicy { seat_n_ctx: 128, ..f.policy.clone() };
    let (model, meter) = (model(), Arc::new(Meter::new()));
    let a = f.seat().await;
    let b = f
        .pool
        .lease(
            &small,
            &model,
            SeatRequest {
                n_ctx: 128,
                n_batch: 128,
                group: "g",
                claim: Claim::default(),
                may_wait: false,
            },
            meter,
            &f.tracker,
        )
        .await
        .expect("batched")
        .expect("a seat");
    let mut solo = Context::new(
        model,
        ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 },
    )
    .unwrap();
    solo.share_cores(Some(f.policy.cores.clone()));
    let held = f.policy.cores.turn();
    let decode_a = a.decode(Batch::sequence(&prompt(1, 8), 0, 0), CancelFlag::new());
    let decode_b = b.decode(Batch::sequence(&prompt(2, 8), 0, 0), CancelFlag::new());
    let tokens = prompt(3, 8);
    let solo = std::thread::spawn(move || solo.decode(&Batch::sequence(&tokens, 0, 0), None));
    // Each asks for a turn and waits: none computes while the cores are held.
    turns_asked(&f.policy.cores, 4).await;
    assert!(f.steps().is_empty() && !solo.is_finished(), "computed out of turn: {:?}", f.steps());
    drop(held);
    decode_a.await.unwrap().unwrap();
    decode_b.await.unwrap().unwrap();
    solo.join().unwrap().unwrap();
    assert_eq!(f.steps().len(), 2);
    // Each batch gives up the turn it booked for a next step once it finds none.
    turns_asked(&f.policy.cores, 0).await;
}

#[tokio::test]
async fn a_cancel_at_node_n_of_a_three_member_step_stops_only_that_member() {
    let f = Fixture::new(512);
    let seats = [f.seat().await, f.seat().await, f.seat().await];
    let prompts: Vec<Vec<Token>> = (0..3).map(|i| prompt(i + 10, 40)).collect();
    let tokens = [CancelFlag::new(), CancelFlag::new(), CancelFlag::new()];
    const NODE: u64 = 5;
    tokens[1].trip_after(NODE);
    let gate = pause(&seats[0]);
    let calls: Vec<_> = (0..3)
        .map(|i| seats[i].decode(Batch::sequence(&prompts[i], 0, 0), tokens[i].clone()))
        .collect();
    drop(gate);
    let results = futures_join(calls).await;
    assert_eq!(results[1], Err(Error::Cancelled));
    assert_eq!(
        (results[0].clone(), results[2].clone()),
        (Ok(()), Ok(())),
        "the others' calls do not fail"
    );
    assert_eq!(tokens[1].polls(), NODE, "stopped at the node the wire tripped");
    let steps = f.steps();
    assert_eq!(steps.len(), 2, "{steps:?}");
    assert!(steps[0].rolled_back && steps[0].seats == 3, "the step with all three was rolled back");
    assert!(
        !steps[1].rolled_back && steps[1].seats == 2,
        "and re-run at once without the cancelled one"
    );
    assert_eq!(
        seats[1].seq_pos_max(0).await.unwrap().unwrap(),
        -1,
        "the cancelled seat's memory is as before"
    );
    assert!(seats[1].logits(None).await.unwrap().is_err(), "and it has no logits");
    // A control batch where the cancelled step never ran: the two survivors' prompts
    // in one step, then the third alone. The rolled-back step gave back every cell
    // it took, so the survivors and the cancelled seat's redo compute bitwise what
    // the control computes.
    let control = Fixture::new(512);
    let others = [control.seat().await, control.seat().await, control.seat().await];
    let gate = pause(&others[0]);
    let calls: Vec<_> = [0, 2]
        .into_iter()
        .map(|i| others[i].decode(Batch::sequence(&prompts[i], 0, 0), CancelFlag::new()))
        .collect();
    drop(gate);
    assert!(futures_join(calls).await.iter().all(Result::is_ok));
    for i in [0, 2] {
        assert_eq!(seats[i].seq_pos_max(0).await.unwrap().unwrap(), 39);
        assert_eq!(
            seats[i].logits(None).await.unwrap().unwrap(),
            others[i].logits(None).await.unwrap().unwrap(),
            "survivor {i}'s logits are an uncancelled run's"
        );
    }
    // The cancelled seat decodes again as if nothing had happened.
    seats[1].decode(Batch::sequence(&prompts[1], 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    others[1].decode(Batch::sequence(&prompts[1], 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    assert_eq!(
        seats[1].logits(None).await.unwrap().unwrap(),
        others[1].logits(None).await.unwrap().unwrap()
    );
}

/// A group whose cancels roll back steps while another group's rows wait is quarantined
/// after the second: its rows then run only in steps of their own, after the others',
/// so its next hang-up costs nobody else anything. One hang-up costs nothing (the first
/// round's next call is planned as before: as a newcomer's first step, its own).
#[tokio::test]
async fn a_group_that_keeps_rolling_back_shared_steps_runs_in_steps_of_its_own() {
    let f = Fixture::new(512);
    let victim = f.seat_in("victim", Arc::default()).await;
    let attacker = f.seat_in("attacker", Arc::default()).await;
    let mut pos = 0;
    let round = |wire: CancelFlag, seed: i32, pos: i32| {
        let gate = pause(&victim);
        let v = victim.decode(Batch::sequence(&prompt(seed, 20), pos, 0), CancelFlag::new());
        let a = attacker.decode(Batch::sequence(&prompt(seed + 50, 20), 0, 0), wire);
        drop(gate);
        (v, a)
    };
    for seed in 0..2 {
        let wire = CancelFlag::new();
        wire.trip_after(3);
        let before = f.steps().len();
        let (v, a) = round(wire, seed, pos);
        assert_eq!(v.await.unwrap(), Ok(()));
        assert_eq!(a.await.unwrap(), Err(Error::Cancelled));
        let steps = f.steps();
        // Round 0: both newcomers share a step. Round 1: the attacker, behind, has its
        // first step to itself while the victim's rows wait.
        assert!(
            steps[before].seats == 2 - seed as usize && steps[before].rolled_back,
            "round {seed}: the hang-up rolled back a step the victim waited for: {steps:?}"
        );
        pos += 20;
    }
    // Quarantined: its next call never shares a step with the victim's, and still
    // runs (once the victim has nothing, here at once).
    let before = f.steps().len();
    let (v, a) = round(CancelFlag::new(), 9, pos);
    assert_eq!((v.await.unwrap(), a.await.unwrap()), (Ok(()), Ok(())));
    let steps = &f.steps()[before..];
    assert!(steps.len() >= 2 && steps.iter().all(|s| s.seats == 1), "{steps:?}");
}

async fn futures_join<T>(calls: Vec<Call<native::Result<T>>>) -> Vec<native::Result<T>> {
    let mut out = Vec::new();
    for call in calls {
        out.push(call.await.expect("answered"));
    }
    out
}

#[tokio::test]
async fn a_cancel_before_the_step_computes_nothing_for_that_seat() {
    let f = Fixture::new(512);
    let seat = f.seat().await;
    let token = CancelFlag::new();
    token.cancel();
    assert_eq!(
        seat.decode(Batch::sequence(&prompt(1, 8), 0, 0), token).await.unwrap(),
        Err(Error::Cancelled)
    );
    assert!(f.steps().is_empty());
    assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), -1);
}

#[tokio::test]
async fn a_seat_checks_its_calls_as_a_context_of_its_own_would() {
    let f = Fixture::new(512);
    let seat = f.seat().await;
    let mut bad = Batch::sequence(&prompt(1, 4), 0, 0);
    bad.seq_ids[1] = 1;
    assert!(
        matches!(seat.decode(bad, CancelFlag::new()).await.unwrap(), Err(Error::InvalidArgument(m)) if m.contains("outside [0, 1)"))
    );
    let gap = Batch::sequence(&prompt(1, 4), 3, 0);
    assert!(
        matches!(seat.decode(gap, CancelFlag::new()).await.unwrap(), Err(Error::InvalidArgument(m)) if m.contains("must continue at position 0"))
    );
    let mut many = Batch::sequence(&prompt(1, 100), 0, 0);
    many.logits = vec![true; 100];
    assert!(matches!(
        seat.decode(many, CancelFlag::new()).await.unwrap(),
        Err(Error::LimitExceeded { limit: "max-batched-logit-rows", requested: 100, max: 64 })
    ));
    let full = Batch::sequence(&prompt(1, 200), 0, 0);
    seat.decode(full.clone(), CancelFlag::new()).await.unwrap().unwrap();
    assert_eq!(
        seat.decode(Batch::sequence(&prompt(2, 100), 200, 0), CancelFlag::new()).await.unwrap(),
        Err(Error::ContextFull)
    );
    assert!(f.steps().iter().all(|s| !s.rolled_back));
}

fn greedy() -> native::SamplerParams {
    native::SamplerParams::default()
}

/// Tokens a generation on a context of its own picks.
fn solo_generation(prompt: &[Token], max_tokens: u32) -> Vec<Token> {
    let params =
        ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
    let mut ctx = Context::new(model(), params).unwrap();
    let mut sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let mut tokens = Vec::new();
    let token = CancelFlag::new();
    let mut sink = |p: Piece| {
        tokens.extend(p.tokens);
        true
    };
    native::generate(
        &mut ctx,
        &mut sampler,
        &GenerateRequest::new(prompt.to_vec(), max_tokens),
        Stop::on(&token),
        &mut sink,
    )
    .unwrap();
    tokens
}

async fn read_all(mut rx: pieces::Receiver<Piece>) -> Vec<Token> {
    let mut tokens = Vec::new();
    while let Some(p) = rx.recv().await {
        tokens.extend(p.tokens);
    }
    tokens
}

#[tokio::test]
async fn generations_on_seats_batch_their_tokens_and_pick_what_a_context_of_its_own_picks() {
    let f = Fixture::new(512);
    let seats = [f.seat().await, f.seat().await];
    let prompts = [prompt(3, 12), prompt(4, 20)];
    let gate = pause(&seats[0]);
    let mut runs = Vec::new();
    for (seat, p) in seats.iter().zip(&prompts) {
        let (tx, rx) = pieces::channel(64);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        runs.push((
            seat.generate(sampler, GenerateRequest::new(p.clone(), 16), CancelFlag::new(), tx),
            rx,
        ));
    }
    drop(gate);
    for ((call, rx), p) in runs.into_iter().zip(&prompts) {
        let tokens = read_all(rx).await;
        let outcome = call.await.unwrap().unwrap();
        assert_eq!(outcome.finish, FinishReason::MaxTokens);
        assert_eq!(
            (outcome.usage.prompt_tokens, outcome.usage.generated_tokens),
            (p.len() as u32, 16)
        );
        assert_eq!(tokens, solo_generation(p, 16), "greedy tokens equal a context of its own's");
    }
    let steps = f.steps();
    assert!(
        steps.iter().filter(|s| s.seats == 2).count() >= 15,
        "the two generations shared their steps: {steps:?}"
    );
    assert_eq!(
        seats[1].seq_pos_max(0).await.unwrap().unwrap(),
        20 + 16 - 1,
        "the prompt and every delivered token"
    );
}

/// A seat keeps the logits its generation ended on, as a context of its own does: a
/// prefill alone (`max_tokens` 0) and then a generation are each continued by a
/// generation with an empty prompt, and the three pick what one generation picks.
#[tokio::test]
async fn a_generation_on_a_seat_is_continued_from_the_logits_it_ended_on() {
    let f = Fixture::new(512);
    let p = prompt(5, 10);
    let seat = f.seat().await;
    let run = |request: GenerateRequest| {
        let (tx, rx) = pieces::channel(64);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        (seat.generate(sampler, request, CancelFlag::new(), tx), rx)
    };
    let mut picked = Vec::new();
    for request in [
        GenerateRequest::new(p.clone(), 0),
        GenerateRequest::new(Vec::new(), 4),
        GenerateRequest::new(Vec::new(), 4),
    ] {
        let (call, rx) = run(request);
        picked.extend(read_all(rx).await);
        assert_eq!(call.await.unwrap().unwrap().finish, FinishReason::MaxTokens);
    }
    assert_eq!(picked, solo_generation(&p, 8));
    assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 10 + 8 - 1);
    let last = seat.logits(None).await.unwrap().unwrap();
    let solo = solo_logits(&[p, picked].concat());
    let scale = solo.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(max_diff(&last, &solo) < 1e-2 * scale, "the last logits are the last token's");
}

/// Generations of two groups, one with three seats: whether the scheduler caps the
/// heavy group's token rows (its seats then take turns) or not, every generation ends
/// with what a context of its own picks.
#[tokio::test]
async fn generations_of_a_group_whose_token_rows_take_turns_pick_what_they_would_alone() {
    let f = Fixture::new(512);
    let light = f.seat_in("light", Arc::default()).await;
    let heavy = [
        f.seat_in("heavy", Arc::default()).await,
        f.seat_in("heavy", Arc::default()).await,
        f.seat_in("heavy", Arc::default()).await,
    ];
    let prompts: Vec<Vec<Token>> = (0..4).map(|i| prompt(40 + i, 8 + 3 * i as usize)).collect();
    let gate = pause(&light);
    let mut runs = Vec::new();
    for (seat, p) in std::iter::once(&light).chain(&heavy).zip(&prompts) {
        let (tx, rx) = pieces::channel(64);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        runs.push((
            seat.generate(sampler, GenerateRequest::new(p.clone(), 12), CancelFlag::new(), tx),
            rx,
        ));
    }
    drop(gate);
    for ((call, rx), p) in runs.into_iter().zip(&prompts) {
        let tokens = tokio::time::timeout(Duration::from_secs(60), read_all(rx))
            .await
            .expect("every seat's tokens came: none was left waiting for its turn");
        assert_eq!(call.await.unwrap().unwrap().finish, FinishReason::MaxTokens);
        assert_eq!(tokens, solo_generation(p, 12));
    }
}

#[tokio::test]
async fn a_reader_that_stops_reading_holds_back_only_its_own_generation() {
    let f = Fixture::new(512);
    let (slow, fast) = (f.seat().await, f.seat().await);
    let sampler = || Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (slow_tx, slow_rx) = pieces::channel(1);
    let slow_call = slow.generate(
        sampler(),
        GenerateRequest::new(prompt(5, 8), 32),
        CancelFlag::new(),
        slow_tx,
    );
    let (fast_tx, fast_rx) = pieces::channel(64);
    let fast_call = fast.generate(
        sampler(),
        GenerateRequest::new(prompt(6, 8), 24),
        CancelFlag::new(),
        fast_tx,
    );
    assert_eq!(read_all(fast_rx).await.len(), 24);
    assert_eq!(
        fast_call.await.unwrap().unwrap().finish,
        FinishReason::MaxTokens,
        "finished while the other's reader sleeps"
    );
    // The slow reader took nothing: one piece sits in its buffer and one token is
    // decoded but undelivered. Hanging up ends it, and only delivered tokens stay.
    drop(slow_rx);
    let outcome = slow_call.await.unwrap().unwrap();
    assert_eq!((outcome.finish, outcome.usage.generated_tokens), (FinishReason::Cancelled, 1));
    assert_eq!(
        slow.seq_pos_max(0).await.unwrap().unwrap(),
        8,
        "the prompt and the one delivered token"
    );
}

/// A media prompt on a seat is evaluated in parts while another seat generates, and
/// that generation steps between the parts: steps happen while the prompt's
/// evaluation is still unfinished (its seat's meter counts its rows only at the end).
/// Its result is the prompt's: the same end, logits near those of one evaluation.
#[tokio::test]
async fn a_media_prompt_on_a_seat_lets_the_others_step_between_its_parts() {
    let prompt_meter = Arc::new(Meter::new());
    let (steps_seen, evaluating) = (Arc::new(Mutex::new(0usize)), prompt_meter.clone());
    let (seen, while_evaluating) = (steps_seen.clone(), Arc::new(Mutex::new(Vec::new())));
    let during = while_evaluating.clone();
    let mut f = Fixture::new(16);
    f.policy.observer = Some(Arc::new(move |_: &StepReport| {
        *seen.lock().unwrap() += 1;
        during.lock().unwrap().push(evaluating.decoded() == 0);
    }));
    let generating = f.seat().await;
    let prompting = f.seat_in("g", prompt_meter.clone()).await;
    // Both calls reach the batch's thread together: the generation starts first (its
    // seat came first), then the prompt is evaluated.
    let gate = pause(&generating);
    let before = *steps_seen.lock().unwrap();
    let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (tx, rx) = pieces::channel(64);
    let generation =
        generating.generate(sampler, GenerateRequest::new(prompt(9, 4), 24), CancelFlag::new(), tx);
    let long = prompt(10, 120);
    let eval = prompting.eval(vec![PromptPiece::Tokens(long.clone())], 0, CancelFlag::new());
    drop(gate);
    assert_eq!(eval.await.unwrap(), Ok(120));
    assert_eq!(read_all(rx).await.len(), 24);
    generation.await.unwrap().unwrap();
    let interleaved =
        while_evaluating.lock().unwrap()[before..].iter().filter(|&&unfinished| unfinished).count();
    assert!(
        interleaved >= 2,
        "{interleaved} steps of the generation ran between the prompt's parts"
    );
    assert_eq!(prompt_meter.decoded(), 120);
    let parts = prompting.logits(None).await.unwrap().unwrap();
    let whole = solo_logits(&long);
    let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        max_diff(&parts, &whole) < 1e-2 * scale,
        "{} (logits up to {scale})",
        max_diff(&parts, &whole)
    );
}

/// A call sent to another seat while a media prompt is evaluated starts between the
/// prompt's parts, instead of waiting for the prompt's end (it used to).
#[tokio::test]
async fn a_call_sent_during_a_media_prompt_starts_before_the_prompt_ends() {
    let prompt_meter = Arc::new(Meter::new());
    let evaluating = prompt_meter.clone();
    // Each step's rows, and whether the media prompt was still being evaluated then.
    let steps: Arc<Mutex<Vec<(usize, bool)>>> = Arc::default();
    let seen = steps.clone();
    let mut f = Fixture::new(16);
    f.policy.observer = Some(Arc::new(move |r: &StepReport| {
        seen.lock().unwrap().push((r.rows, evaluating.decoded() == 0));
    }));
    // The prompting seat joined first, so its prompt starts first; the decode is queued
    // behind it on the batch's thread.
    let prompting = f.seat_in("g", prompt_meter.clone()).await;
    let other = f.seat().await;
    let gate = pause(&prompting);
    let long = prompt(12, 120);
    let eval = prompting.eval(vec![PromptPiece::Tokens(long)], 0, CancelFlag::new());
    let decode = other.decode(Batch::sequence(&prompt(13, 8), 0, 0), CancelFlag::new());
    drop(gate);
    assert_eq!(decode.await, Some(Ok(())));
    assert_eq!(eval.await.unwrap(), Ok(120));
    let steps = steps.lock().unwrap().clone();
    assert!(
        steps.iter().any(|&(rows, unfinished)| rows == 8 && unfinished),
        "the decode's step ran only after the prompt: {steps:?}"
    );
    assert_eq!(prompt_meter.decoded(), 120);
}

#[tokio::test]
async fn a_prompt_chunked_over_steps_never_keeps_a_generation_waiting_more_than_one_step() {
    let f = Fixture::new(32);
    let (generating, prefilling) = (f.seat().await, f.seat().await);
    let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (tx, rx) = pieces::channel(64);
    let generation =
        generating.generate(sampler, GenerateRequest::new(prompt(7, 4), 12), CancelFlag::new(), tx);
    let long = prompt(8, 200);
    let gate = pause(&generating);
    let decode = prefilling.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
    drop(gate);
    decode.await.unwrap().unwrap();
    assert_eq!(read_all(rx).await.len(), 12);
    generation.await.unwrap().unwrap();
    let steps = f.steps();
    assert!(steps.iter().all(|s| s.rows <= 32), "every step within its row budget: {steps:?}");
    let prompt_steps = steps.iter().filter(|s| s.rows > 1).count();
    assert!(prompt_steps >= 200 / 32, "the prompt went in chunks: {steps:?}");
    let chunked = prefilling.logits(None).await.unwrap().unwrap();
    // A prompt in pieces is not bitwise a prompt whole on llama.cpp's CPU kernels
    // either: compare with the same prompt decoded in 32-row pieces on a context of
    // its own, and with the whole one to a tolerance.
    let params =
        ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
    let mut own = Context::new(model(), params).unwrap();
    for (i, piece) in long.chunks(32).enumerate() {
        own.decode(&Batch::sequence(piece, (i * 32) as i32, 0), None).unwrap();
    }
    let (pieces_own, whole) = (own.last_logits().unwrap().to_vec(), solo_logits(&long));
    let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (d_batched, d_own) = (max_diff(&chunked, &whole), max_diff(&pieces_own, &whole));
    assert!(
        d_batched < 1e-2 * scale,
        "batched chunks vs whole: {d_batched} (logits up to {scale}); own chunks vs whole: {d_own}"
    );
    let argmax = |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
    assert_eq!(argmax(&chunked), argmax(&whole));
}

#[tokio::test]
async fn a_changed_policy_makes_a_new_batch_and_the_old_one_serves_its_seats_out() {
    let mut f = Fixture::new(512);
    let old = f.seat().await;
    f.policy = BatchPolicy { step_rows: 64, ..f.policy.clone() };
    let new = f.seat().await;
    assert_eq!(
        (old.n_ubatch(), new.n_ubatch()),
        (512, 64),
        "the second seat is in a batch made under the new policy"
    );
    assert!(!Arc::ptr_eq(&old.batcher, &new.batcher));
    let tokens = prompt(11, 8);
    old.decode(Batch::sequence(&tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    new.decode(Batch::sequence(&tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    assert_eq!(f.pool.seats_taken(), 1, "the pool counts only the new batch's seat");
}

#[tokio::test]
async fn of_two_leftovers_that_serve_a_prompt_alike_the_older_one_is_taken() {
    let f = Fixture::new(512);
    let system = prompt(40, 12);
    let with = |rest: &[Token]| [system.as_slice(), rest].concat();
    let (a, b) = (with(&prompt(41, 6)), with(&prompt(42, 6)));
    let (first, second) = (f.seat().await, f.seat().await);
    first.decode(Batch::sequence(&a, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    second.decode(Batch::sequence(&b, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    // `second`'s leftover (sequence 1) is the older one.
    drop(second);
    drop(first);
    let shares_system = f.seat().await;
    shares_system
        .decode(Batch::sequence(&with(&prompt(43, 6)), 0, 0), CancelFlag::new())
        .await
        .unwrap()
        .unwrap();
    // `first`'s leftover is still whole for the conversation it came from.
    let meter = Arc::new(Meter::new());
    let continues = f.seat_in("g", meter.clone()).await;
    let turn = [a.as_slice(), &prompt(44, 4)].concat();
    continues.decode(Batch::sequence(&turn, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    assert_eq!(
        meter.reused(),
        a.len() as u64,
        "the newest leftover was kept for its own continuation"
    );
}

/// The run's claim reaches the scheduler: two seats' 200-row prompts in 64-row steps,
/// the second of weight 3, gets three steps for the first's one (the pure rule is
/// `schedule::tests::weights_…`); with equal weights they alternate.
#[tokio::test]
async fn a_heavier_claim_gets_more_of_each_steps_prompt_rows() {
    for heavy_weight in [3, 1] {
        let (light, heavy) = (Arc::new(Meter::new()), Arc::new(Meter::new()));
        // Each step's (light, heavy) rows before it: what the steps so far computed.
        let seen: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
        let (l, h, s) = (light.clone(), heavy.clone(), seen.clone());
        let policy = BatchPolicy {
            step_rows: 64,
            // Budgets far above 64 rows: every step takes 64 prompt rows.
            step_target: Duration::from_secs(10),
            observer: Some(Arc::new(move |_: &StepReport| {
                s.lock().unwrap().push((l.decoded(), h.decoded()));
            })),
            ..BatchPolicy::new(4, 256, 1)
        };
        let (pool, tracker, model) = (BatchPool::default(), Tracker::new(), model());
        let seat = |group, claim, meter| {
            let request = SeatRequest { n_ctx: 256, n_batch: 256, group, claim, may_wait: false };
            pool.lease(&policy, &model, request, meter, &tracker)
        };
        let a = seat("light", Claim::default(), light.clone()).await.unwrap().unwrap();
        let b =
            seat("heavy", Claim::new(heavy_weight, 0, None), heavy.clone()).await.unwrap().unwrap();
        let gate = pause(&a);
        let first = a.decode(Batch::sequence(&prompt(1, 200), 0, 0), CancelFlag::new());
        let second = b.decode(Batch::sequence(&prompt(2, 200), 0, 0), CancelFlag::new());
        drop(gate);
        assert_eq!(first.await, Some(Ok(())));
        assert_eq!(second.await, Some(Ok(())));
        let lead = seen.lock().unwrap().iter().map(|&(l, h)| h as i64 - l as i64).max();
        match heavy_weight {
            // L 64, H 64, H 64, H 64: the heavy seat 128 rows ahead before step 5.
            3 => assert_eq!(lead, Some(128), "{:?}", seen.lock().unwrap()),
            _ => assert!(lead.unwrap() <= 0, "{:?}", seen.lock().unwrap()),
        }
    }
}

#[tokio::test]
async fn shorter_prompts_go_first_whoever_joined_first() {
    let f = Fixture::new(32);
    let (long, short) = (f.seat().await, f.seat().await);
    let gate = pause(&long);
    let long_call = long.decode(Batch::sequence(&prompt(3, 100), 0, 0), CancelFlag::new());
    let mut short_call = short.decode(Batch::sequence(&prompt(4, 10), 0, 0), CancelFlag::new());
    drop(gate);
    // The 10-row prompt fits the first 32-row step whole; the 100-row one needs four.
    tokio::select! {
        biased;
        done = &mut short_call => done.unwrap().unwrap(),
        _ = long_call => panic!("the longer prompt, which joined first, finished first"),
    }
    let steps = f.steps();
    assert_eq!(
        (steps[0].seats, steps[0].rows),
        (2, 32),
        "the short prompt whole, the rest of the step for the long one: {steps:?}"
    );
}

#[tokio::test]
async fn a_prompt_passed_over_by_shorter_ones_for_eight_steps_goes_first() {
    let f = Fixture::new(8);
    let flood = [f.seat().await, f.seat().await, f.seat().await];
    let waiting = f.seat().await;
    let gate = pause(&waiting);
    // Each flooding seat queues 20 decodes of 8 rows: every one fills a step alone.
    let mut floods = Vec::new();
    for (i, seat) in flood.iter().enumerate() {
        for k in 0..20 {
            floods.push(
                seat.decode(
                    Batch::sequence(&prompt(20 + i as i32, 8), k * 8, 0),
                    CancelFlag::new(),
                ),
            );
        }
    }
    let mut last = floods.pop().expect("queued");
    let mut waited = waiting.decode(Batch::sequence(&prompt(30, 30), 0, 0), CancelFlag::new());
    drop(gate);
    // 60 steps of floods; the 30-row prompt gets a step after every 8 it is passed
    // over, so it is done in about 36.
    tokio::select! {
        biased;
        done = &mut waited => done.unwrap().unwrap(),
        _ = &mut last => panic!("the 30-row prompt waited for every shorter one: {:?}", f.steps().len()),
    }
    last.await.unwrap().unwrap();
    for call in floods {
        call.await.unwrap().unwrap();
    }
}

/// A policy whose prompts of more than 32 rows are long.
fn long_prompt_fixture(share: f64, target: Duration) -> Fixture {
    let mut f = Fixture::new(256);
    f.policy.long_prompt_rows = 32;
    f.policy.long_prompt_share = share;
    f.policy.step_target = target;
    f
}

#[tokio::test]
async fn a_step_of_long_prompts_alone_yields_to_an_arrival_and_runs_again_after_it() {
    let f = long_prompt_fixture(0.25, Duration::from_millis(50));
    let seat = f.seat().await;
    let long = prompt(5, 200);
    let gate = pause(&seat);
    // As if another seat's call arrived after node 3 of the first step.
    seat.batcher.ops.send(Op::YieldAt(3)).unwrap();
    let call = seat.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
    drop(gate);
    call.await.unwrap().unwrap();
    let steps = f.steps();
    assert!(
        steps[0].yielded && !steps[0].rolled_back && steps[0].rows == 200,
        "the first step yielded: {steps:?}"
    );
    assert!(
        steps[1..].iter().all(|s| !s.yielded && !s.rolled_back),
        "the rows ran again, once: {steps:?}"
    );
    assert_eq!(
        steps[1..].iter().map(|s| s.rows).sum::<usize>(),
        200,
        "every row once after the yield: {steps:?}"
    );
    // Memory as if it never yielded: the whole prompt, and logits of what it holds.
    assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 199);
    let (batched, whole) = (seat.logits(None).await.unwrap().unwrap(), solo_logits(&long));
    let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        max_diff(&batched, &whole) < 1e-2 * scale,
        "after a yield: {} (logits up to {scale})",
        max_diff(&batched, &whole)
    );
}

#[tokio::test]
async fn a_flood_of_arrivals_costs_a_long_prompt_at_most_half_its_time() {
    // A 100 µs target: chunks of the 16-row minimum on any machine, so rows remain to
    // yield again once the first yield is made good.
    let f = long_prompt_fixture(0.25, Duration::from_micros(100));
    let seat = f.seat().await;
    // One timed step first: the batch then sizes chunks by speed.
    seat.decode(Batch::sequence(&prompt(5, 32), 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    seat.clear().await.unwrap().unwrap();
    f.steps.lock().unwrap().clear();
    let long = prompt(6, 240);
    let gate = pause(&seat);
    // Every step that may yield does, late in the step.
    seat.batcher.ops.send(Op::YieldAt(20)).unwrap();
    let call = seat.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
    drop(gate);
    // Without making good what it lost, it would yield at every step, for ever.
    let done = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("the long prompt got through the flood");
    done.unwrap().unwrap();
    let steps = f.steps();
    let lost: Duration = steps.iter().filter(|s| s.yielded).map(|s| s.elapsed).sum();
    let kept: Duration = steps.iter().filter(|s| !s.yielded).map(|s| s.elapsed).sum();
    let last_yield =
        steps.iter().filter(|s| s.yielded).map(|s| s.elapsed).max().unwrap_or_default();
    assert!(
        steps.iter().filter(|s| s.yielded).count() >= 2,
        "the flood made it yield again once the first was made good: {steps:?}"
    );
    assert!(lost <= kept + last_yield, "lost {lost:?} to yields against {kept:?} kept: {steps:?}");
    assert_eq!(
        steps.iter().filter(|s| !s.yielded).map(|s| s.rows).sum::<usize>(),
        240,
        "every row computed for good once"
    );
    assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 239);
}

/// A step with prompt rows yields to a call of a group that would go first (a newcomer),
/// not to one of its own group, nor to a long prompt (whose rows would wait for earned
/// time anyway): the newcomer's first token does not wait for the step in flight, and
/// its first step is its own rows.
#[tokio::test]
async fn a_step_of_prompts_yields_to_another_groups_arrival_not_to_its_own() {
    let mut f = Fixture::new(512);
    f.policy.long_prompt_rows = 100;
    let a = f.seat_in("a", Arc::default()).await;
    let a2 = f.seat_in("a", Arc::default()).await;
    let b = f.seat_in("b", Arc::default()).await;
    let c = f.seat_in("c", Arc::default()).await;
    for (arrival, rows, yields) in [(&a2, 8, false), (&c, 120, false), (&b, 8, true)] {
        let before = f.steps().len();
        let held = f.policy.cores.turn();
        let first = a.decode(Batch::sequence(&prompt(1, 64), 0, 0), CancelFlag::new());
        // The step of a's prompt is planned, and waits for the cores.
        turns_asked(&f.policy.cores, 2).await;
        let second = arrival.decode(Batch::sequence(&prompt(2, rows), 0, 0), CancelFlag::new());
        drop(held);
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
        let steps = f.steps().split_off(before);
        let got: Vec<(usize, bool)> = steps.iter().map(|s| (s.rows, s.yielded)).collect();
        if yields {
            assert_eq!(got, [(64, true), (rows, false), (64, false)], "{steps:?}");
        } else {
            assert_eq!(got, [(64, false), (rows, false)], "{steps:?}");
        }
        a.clear().await.unwrap().unwrap();
    }
    assert_eq!(b.seq_pos_max(0).await.unwrap().unwrap(), 7);
}

#[tokio::test]
async fn a_step_with_a_generation_in_it_never_yields_to_just_any_arrival() {
    let f = long_prompt_fixture(1.0, Duration::from_millis(50));
    let (generating, prefilling) = (f.seat().await, f.seat().await);
    let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (tx, rx) = pieces::channel(64);
    let gate = pause(&generating);
    generating.batcher.ops.send(Op::YieldAt(1)).unwrap();
    let generation =
        generating.generate(sampler, GenerateRequest::new(prompt(7, 4), 8), CancelFlag::new(), tx);
    let decode = prefilling.decode(Batch::sequence(&prompt(8, 100), 0, 0), CancelFlag::new());
    drop(gate);
    decode.await.unwrap().unwrap();
    assert_eq!(read_all(rx).await.len(), 8);
    generation.await.unwrap().unwrap();
    assert!(f.steps().iter().all(|s| !s.yielded), "{:?}", f.steps());
}

#[tokio::test]
async fn a_long_prompt_beside_a_generation_runs_only_on_time_it_earned() {
    let share = 0.25;
    // A tiny-model generation step is 25-100 µs: 120 of them earn several such targets.
    let target = Duration::from_micros(200);
    let f = long_prompt_fixture(share, target);
    let (generating, prefilling) = (f.seat().await, f.seat().await);
    let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (tx, rx) = pieces::channel(256);
    let gate = pause(&generating);
    let generation = generating.generate(
        sampler,
        GenerateRequest::new(prompt(9, 4), 120),
        CancelFlag::new(),
        tx,
    );
    let decode = prefilling.decode(Batch::sequence(&prompt(10, 250), 0, 0), CancelFlag::new());
    drop(gate);
    decode.await.unwrap().unwrap();
    read_all(rx).await;
    generation.await.unwrap().unwrap();
    let steps = f.steps();
    // Until the long prompt first ran beside the generation, the generation's steps
    // had to earn it a target's worth at a quarter of the time: three targets.
    let first = steps
        .iter()
        .position(|s| s.long_rows > 0 && s.long_rows < s.rows)
        .unwrap_or_else(|| panic!("the long prompt ran beside the generation: {steps:?}"));
    let earned: Duration =
        steps[..first].iter().filter(|s| s.long_rows == 0).map(|s| s.elapsed).sum();
    assert!(
        earned.as_secs_f64() >= target.as_secs_f64() * (1.0 - share) / share * 0.999,
        "it ran after {earned:?} of others' steps: {steps:?}"
    );
    // Over the steps they shared, the long prompt took about its share: at most what
    // the others' time earned, plus the one target it may run ahead.
    let end = steps.iter().rposition(|s| s.long_rows > 0).expect("the long prompt ran");
    let shared: Vec<&StepReport> = steps[..=end].iter().filter(|s| s.long_rows < s.rows).collect();
    let long: f64 =
        shared.iter().map(|s| s.elapsed.as_secs_f64() * s.long_rows as f64 / s.rows as f64).sum();
    let other: f64 = shared.iter().map(|s| s.elapsed.as_secs_f64()).sum::<f64>() - long;
    let last = shared.iter().map(|s| s.elapsed.as_secs_f64()).fold(0.0, f64::max);
    assert!(
        long <= share / (1.0 - share) * other + target.as_secs_f64() + last,
        "long {long} s beside others' {other} s: {steps:?}"
    );
}

/// Not a gate (timings): what a member's cancel costs the others, on the real model.
/// `LLAMABOX_REAL_MODEL=PATH cargo test --release --lib survivors -- --ignored --nocapture`
/// (the Makefile's environment). Three seats generate while a fourth's 500-token
/// prompt is cancelled at a random node of a step they share; the others lose that
/// step's work (its time) and get their token from the re-run.
#[tokio::test]
#[ignore]
async fn survivors_cost_of_a_cancelled_step() {
    let path = std::env::var("LLAMABOX_REAL_MODEL").expect("LLAMABOX_REAL_MODEL");
    let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
    let threads: u32 =
        std::env::var("LLAMABOX_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
    let steps: Arc<Mutex<Vec<StepReport>>> = Arc::default();
    let seen = steps.clone();
    let policy = BatchPolicy {
        observer: Some(Arc::new(move |r: &StepReport| seen.lock().unwrap().push(*r))),
        ..BatchPolicy::new(4, 2048, threads)
    };
    let (pool, tracker) = (BatchPool::default(), Tracker::new());
    let seat = || {
        pool.lease(
            &policy,
            &model,
            SeatRequest {
                n_ctx: 2048,
                n_batch: 512,
                group: "g",
                claim: Claim::default(),
                may_wait: false,
            },
            Arc::default(),
            &tracker,
        )
    };
    let n_vocab = model.n_vocab() as i32;
    let (mut lost, mut gen_steps, mut shared_steps) = (Vec::new(), Vec::new(), Vec::new());
    let mut rng = crate::native::synthetic::SplitMix64(11);
    for trial in 0..24 {
        let generators = [
            seat().await.unwrap().unwrap(),
            seat().await.unwrap().unwrap(),
            seat().await.unwrap().unwrap(),
        ];
        let victim = seat().await.unwrap().unwrap();
        let mut runs = Vec::new();
        for (i, g) in generators.iter().enumerate() {
            let (tx, rx) = pieces::channel(256);
            let sampler = Sampler::new(
                model.clone(),
                &native::SamplerParams::default(),
                &native::SamplerCaps::default(),
            )
            .unwrap();
            let prompt: Vec<Token> = (0..16)
                .map(|j| (trial * 131 + i as i32 * 17 + j * 7).rem_euclid(n_vocab))
                .collect();
            runs.push((
                g.generate(sampler, GenerateRequest::new(prompt, 64), CancelFlag::new(), tx),
                rx,
            ));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        steps.lock().unwrap().clear();
        let token = CancelFlag::new();
        token.trip_after(1 + rng.next_u64() % 600);
        let prompt: Vec<Token> =
            (0..500).map(|j| (trial * 977 + j * 31).rem_euclid(n_vocab)).collect();
        let result = victim.decode(Batch::sequence(&prompt, 0, 0), token).await.unwrap();
        assert_eq!(result, Err(Error::Cancelled));
        for (call, rx) in runs {
            read_all(rx).await;
            call.await.unwrap().unwrap();
        }
        let seen = steps.lock().unwrap().clone();
        lost.extend(seen.iter().filter(|s| s.rolled_back).map(|s| s.elapsed.as_secs_f64() * 1e3));
        gen_steps.extend(
            seen.iter()
                .filter(|s| !s.rolled_back && s.rows == 3)
                .map(|s| s.elapsed.as_secs_f64() * 1e3),
        );
        // Steps the generations shared with the prompt: how long they waited for a token.
        shared_steps
            .extend(seen.iter().filter(|s| s.rows > 3).map(|s| s.elapsed.as_secs_f64() * 1e3));
    }
    let q = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    println!(
        "threads {threads}: a cancelled step cost its survivors p50 {:.2} ms, p99 {:.2} ms ({} cancels); a 3-seat generation step takes p50 {:.2} ms; \
         beside the 500-row prompt a generating seat waited for its next token p50 {:.2} ms, p99 {:.2} ms, at most {:.2} ms (step target {:?})",
        q(&mut lost, 0.5),
        q(&mut lost, 0.99),
        lost.len(),
        q(&mut gen_steps, 0.5),
        q(&mut shared_steps, 0.5),
        q(&mut shared_steps, 0.99),
        q(&mut shared_steps, 1.0),
        policy.step_target,
    );
}

/// Polls `future` once: whether it is still pending (no timing involved).
fn pending<F: std::future::Future>(future: std::pin::Pin<&mut F>) -> bool {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    future.poll(&mut cx).is_pending()
}

/// Seats are as many as their contexts' cells fit (not a fixed count of the largest),
/// a run holding no native work waits for cells in line and gets the first seat that
/// leaves, and one that holds some is turned away (a context of its own) instead of
/// waiting, so that no two runs wait on each other.
#[tokio::test]
async fn seats_are_as_many_as_their_cells_fit_and_a_run_holding_nothing_waits_for_one() {
    let policy = BatchPolicy { cells: 512, ..BatchPolicy::new(8, 256, 1) };
    let (pool, tracker, model) = (BatchPool::default(), Tracker::new(), model());
    let lease = |n_ctx, may_wait| {
        let request =
            SeatRequest { n_ctx, n_batch: 256, group: "g", claim: Claim::default(), may_wait };
        pool.lease(&policy, &model, request, Arc::default(), &tracker)
    };
    let mut seats = Vec::new();
    for _ in 0..4 {
        seats.push(lease(128, false).await.expect("batched").expect("a seat"));
    }
    assert!(lease(128, false).await.is_none(), "512 cells hold four seats of 128");
    let mut waiting = Box::pin(lease(256, true));
    assert!(pending(waiting.as_mut()), "a run that holds nothing waits");
    drop(seats.pop());
    assert!(pending(waiting.as_mut()), "256 cells are not free yet");
    drop(seats.pop());
    let seat = waiting.await.expect("batched").expect("a seat");
    // The seats decode in their cells, each within what it asked for.
    let calls: Vec<_> = [&seats[0], &seats[1], &seat]
        .into_iter()
        .zip([100, 100, 250])
        .enumerate()
        .map(|(i, (s, n))| s.decode(Batch::sequence(&prompt(i as i32, n), 0, 0), CancelFlag::new()))
        .collect();
    assert!(futures_join(calls).await.iter().all(Result::is_ok));
    assert_eq!(pool.seats_taken(), 3);
}

/// The seats share one pool of cells with the leftovers of earlier seats: a step that
/// finds the pool full throws the oldest leftover away and runs, and the newer
/// leftover is still there for its own group's next turn.
#[tokio::test]
async fn a_full_pool_evicts_the_oldest_leftover_and_keeps_the_newest() {
    let policy = BatchPolicy { cells: 512, ..BatchPolicy::new(4, 256, 1) };
    let (pool, tracker, model) = (BatchPool::default(), Tracker::new(), model());
    let lease = |group, meter| {
        let request = SeatRequest {
            n_ctx: 256,
            n_batch: 256,
            group,
            claim: Claim::default(),
            may_wait: false,
        };
        pool.lease(&policy, &model, request, meter, &tracker)
    };
    let (old, new) = (prompt(50, 200), prompt(51, 200));
    for (group, tokens) in [("old", &old), ("new", &new)] {
        let seat = lease(group, Arc::default()).await.unwrap().unwrap();
        seat.decode(Batch::sequence(tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    }
    // 400 cells of leftovers: 200 more rows do not fit beside both.
    let third = lease("third", Arc::default()).await.unwrap().unwrap();
    third
        .decode(Batch::sequence(&prompt(52, 200), 0, 0), CancelFlag::new())
        .await
        .unwrap()
        .unwrap();
    drop(third);
    for (group, tokens, kept) in [("new", &new, new.len()), ("old", &old, 0)] {
        let meter = Arc::new(Meter::new());
        let seat = lease(group, meter.clone()).await.unwrap().unwrap();
        seat.decode(Batch::sequence(tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        // The rows reused, but the last (a decode computes at least one row).
        assert_eq!(meter.reused() as usize, kept.saturating_sub(1), "{group}'s leftover");
    }
}

/// While a member streams, work beside the batch gets turns of half a step (at least
/// `BesideTurn::MIN`), so a stream's gaps stay near its pace alone; otherwise a step target.
#[tokio::test]
async fn work_beside_a_streaming_batch_gets_short_turns() {
    let turns: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let cores: Arc<Cores> = Arc::default();
    let (seen, read) = (turns.clone(), cores.clone());
    let policy = BatchPolicy {
        step_target: Duration::from_secs(3600),
        observer: Some(Arc::new(move |_: &StepReport| {
            seen.lock().unwrap().push(read.turn_length())
        })),
        cores,
        ..BatchPolicy::new(4, 256, 1)
    };
    let f = Fixture { policy, ..Fixture::new(512) };
    let seat = f.seat().await;
    let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
    let (tx, rx) = pieces::channel(64);
    let generation =
        seat.generate(sampler, GenerateRequest::new(prompt(3, 8), 4), CancelFlag::new(), tx);
    assert_eq!(read_all(rx).await.len(), 4);
    generation.await.unwrap().unwrap();
    seat.decode(Batch::sequence(&prompt(4, 8), 12, 0), CancelFlag::new()).await.unwrap().unwrap();
    let turns = turns.lock().unwrap().clone();
    let hour = Duration::from_secs(3600);
    // The prompt's step, four token steps, then the decode's step.
    assert_eq!(turns.len(), 6, "{turns:?}");
    assert_eq!((turns[0], turns[5]), (hour, hour), "{turns:?}");
    assert!(turns[1..5].iter().all(|&t| t >= MIN_TURN && t < hour), "{turns:?}");
}

/// A step that a token waits for (a chat's prompt) shortens the turn of work beside the
/// batch as soon as it asks for the cores, though the batch was idle (a step target's
/// turn); a long prompt's step leaves the target's turn.
#[tokio::test]
async fn a_chats_step_shortens_the_turn_of_work_beside_an_idle_batch() {
    let hour = Duration::from_secs(3600);
    let mut f = Fixture::new(512);
    f.policy.step_target = hour;
    f.policy.long_prompt_rows = 100;
    let cores = f.policy.cores.clone();
    let seat = f.seat().await;
    seat.decode(Batch::sequence(&prompt(1, 8), 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    assert_eq!(cores.turn_length(), hour, "idle: a target's turn");
    for (rows, short) in [(120, false), (8, true)] {
        seat.clear().await.unwrap().unwrap();
        // Someone else's work holds the cores; the batch's step waits for them.
        let held = cores.turn();
        let decode = seat.decode(Batch::sequence(&prompt(2, rows), 0, 0), CancelFlag::new());
        turns_asked(&cores, 2).await;
        let turn = cores.turn_length();
        drop(held);
        decode.await.unwrap().unwrap();
        if short {
            assert!((MIN_TURN..hour).contains(&turn), "a chat's prompt waits: {turn:?}");
        } else {
            assert_eq!(turn, hour, "a long prompt alone waits a target's turn");
        }
    }
}

/// At most `MAX_LEFTOVERS` leftovers stay in the pool (each widens every step's
/// attention): the most recently left are kept for their next turn, older ones go.
#[tokio::test]
async fn only_the_newest_leftovers_are_kept() {
    // More sequences than leftovers kept, so the cap decides, not the sequences.
    let f =
        Fixture { policy: BatchPolicy::new(2 * MAX_LEFTOVERS as u32, 256, 1), ..Fixture::new(512) };
    let groups: Vec<String> = (0..=MAX_LEFTOVERS).map(|g| format!("g{g}")).collect();
    let prompts: Vec<Vec<Token>> = (0..groups.len()).map(|g| prompt(60 + g as i32, 10)).collect();
    for (group, tokens) in groups.iter().zip(&prompts) {
        let seat = f.seat_in(group, Arc::default()).await;
        seat.decode(Batch::sequence(tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
    }
    // The newest first: its turn must not evict before the oldest is checked.
    for (g, kept) in [(MAX_LEFTOVERS, 9), (0, 0)] {
        let meter = Arc::new(Meter::new());
        let seat = f.seat_in(&groups[g], meter.clone()).await;
        seat.decode(Batch::sequence(&prompts[g], 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        assert_eq!(meter.reused(), kept, "group {g}");
    }
}
