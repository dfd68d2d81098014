//! A WASI 0.3 (component-model async) plugin: the three ways another task stops an
//! in-flight call. Each scenario starts a long decode and, at once, either cancels
//! its token from a spawned task, cancels it from the other arm of a `join!`, or drops
//! the decode's future without any token (then the host stops the native work itself).
//!
//! Output lines are `key: value` so tests can read them.

// The plugin world's interfaces come from the shared bindings (guest/sdk); the
// async calls and WASI 0.3 are generated here.
llamabox_guest::generate_world!(
    path: ["../../wit", "../../wit/async"],
    world: "llamabox:plugin-async/plugin-async",
);

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use futures::join;
use llamabox::inference::async_calls;
use llamabox_guest::cancel::CancelToken;
use llamabox_guest::generate;
use llamabox_guest::greedy_params;
use llamabox_guest::llm::{Batch, Context, ContextParams, Model};
use llamabox_guest::types::Error;
use wasi::clocks0_3_0::monotonic_clock::wait_for;

/// How long each scenario waits before it stops its decode: not at all. The decode is
/// then queued or running in the host, never finished, however fast the machine is, so
/// every outcome below is deterministic.
const STOP_AFTER_NS: u64 = 0;

struct Plugin;

impl Guest for Plugin {
    /// Arguments: MODEL-NAME [N-TOKENS].
    async fn run() -> Result<(), ()> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let model = args.first().cloned().unwrap_or_else(|| "default".into());
        let tokens: usize = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(512);
        scenarios(model, tokens).await.map_err(|e| eprintln!("async-demo: {e:?}"))
    }
}

export!(Plugin);

async fn scenarios(model_name: String, n: usize) -> Result<(), Error> {
    let model = Model::open(&model_name)?;
    let params = ContextParams {
        n_ctx: Some((n as u32 + 64).next_power_of_two()),
        n_batch: Some(n as u32),
        n_ubatch: None,
        n_seq_max: Some(1),
        n_threads: Some(1),
    };
    let ctx = Context::create(&model, params.clone())?;
    let filler = model.tokenize(" the llama in the box", false, false)?;
    let tokens: Vec<i32> = filler.iter().copied().cycle().take(n).collect();
    let batch = Batch {
        positions: (0..n as i32).collect(),
        seq_ids: vec![0; n],
        logits: (0..n).map(|i| i + 1 == n).collect(),
        tokens,
    };

    // (a) another task, spawned, cancels the token while this one awaits the decode.
    let token = std::rc::Rc::new(CancelToken::new());
    let canceller = token.clone();
    wit_bindgen::spawn_local(async move {
        wait_for(STOP_AFTER_NS).await;
        canceller.cancel();
    });
    let outcome = async_calls::decode(&ctx, batch.clone(), &token).await;
    println!("async-spawn: {}", show(&outcome));
    println!("memory-after-spawn: seq-pos-max={}", ctx.seq_pos_max(0)?);

    // (b) one task, two arms: the decode, and a sleep that cancels it.
    let token = CancelToken::new();
    let (outcome, ()) = join!(async_calls::decode(&ctx, batch.clone(), &token), async {
        wait_for(STOP_AFTER_NS).await;
        token.cancel();
    });
    println!("async-join: {}", show(&outcome));
    println!("memory-after-join: seq-pos-max={}", ctx.seq_pos_max(0)?);

    // (c) no cancel at all: the decode loses a race with a timeout and its future is
    // dropped. The host drops its future, stops the decode in flight and joins it, so
    // the memory shows no trace of it.
    let never = CancelToken::new();
    let raced =
        first_of(async_calls::decode(&ctx, batch.clone(), &never), wait_for(STOP_AFTER_NS)).await;
    println!("async-drop: {}", if raced.is_none() { "dropped" } else { "finished first" });
    println!("memory-after-drop: seq-pos-max={}", ctx.seq_pos_max(0)?);

    // (d) two decodes in flight at once on two contexts, each with its own token:
    // cancelling one leaves the other to finish.
    let other = Context::create(&model, params)?;
    let (keep, stop) = (CancelToken::new(), CancelToken::new());
    let (kept, stopped, ()) = join!(
        async_calls::decode(&other, batch.clone(), &keep),
        async_calls::decode(&ctx, batch.clone(), &stop),
        async {
            wait_for(STOP_AFTER_NS).await;
            stop.cancel();
        }
    );
    println!("async-two-contexts: kept {}, stopped {}", show(&kept), show(&stopped));
    println!("memory-after-two: seq-pos-max={} and {}", other.seq_pos_max(0)?, ctx.seq_pos_max(0)?);

    // (e) more async calls in flight than the host's max-pending-calls (16): the first
    // runs a long decode, fifteen queue behind it, the seventeenth is refused by name.
    // Whenever the cancel lands, exactly one call is over the cap.
    let token = CancelToken::new();
    let calls: Vec<_> = (0..17).map(|_| async_calls::decode(&ctx, batch.clone(), &token)).collect();
    let (outcomes, ()) = join!(futures::future::join_all(calls), async {
        wait_for(STOP_AFTER_NS).await;
        token.cancel();
    });
    let refused: Vec<String> = outcomes
        .iter()
        .filter_map(|o| match o {
            Err(Error::LimitExceeded(m)) => Some(m.clone()),
            _ => None,
        })
        .collect();
    println!("async-over-cap: {} refused: {}", refused.len(), refused.join("; "));
    ctx.clear()?;

    // And an uncancelled async decode completes.
    let outcome = async_calls::decode(&ctx, batch.clone(), &CancelToken::new()).await;
    println!("async-complete: {}", show(&outcome));
    println!("memory-after-complete: seq-pos-max={}", ctx.seq_pos_max(0)?);

    // (e) a host-side generation read with the async `generation-next`; then one whose
    // `generation-next` future is dropped in the prefill, which cancels it.
    ctx.clear()?;
    let short =
        generate::start(&ctx, &greedy_params(batch.tokens[..8].to_vec(), 4), &CancelToken::new())?;
    let mut generated = 0;
    while let Some(piece) = async_calls::generation_next(&short).await? {
        generated += piece.tokens.len();
    }
    println!("async-generation: {generated} tokens");
    ctx.clear()?;
    let long = generate::start(&ctx, &greedy_params(batch.tokens, 4), &CancelToken::new())?;
    let raced = first_of(async_calls::generation_next(&long), wait_for(STOP_AFTER_NS)).await;
    println!(
        "async-generation-drop: {}",
        if raced.is_none() { "dropped" } else { "finished first" }
    );
    println!(
        "async-generation-after-drop: {}",
        show(&async_calls::generation_next(&long).await.map(|_| ()))
    );
    drop(long);
    println!("memory-after-generation-drop: seq-pos-max={}", ctx.seq_pos_max(0)?);
    Ok(())
}

/// `Some(a's output)` if `a` finishes first; `None` (and `a` dropped) if `b` does.
async fn first_of<A: Future, B: Future>(a: A, b: B) -> Option<A::Output> {
    let (mut a, mut b) = (pin!(a), pin!(b));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = a.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        b.as_mut().poll(cx).map(|_| None)
    })
    .await
}

fn show(outcome: &Result<(), Error>) -> String {
    llamabox_guest::outcome(outcome.clone())
}
