//! A parked context (`Context::park`, what an idle context in the host's pool has been
//! through) reads as new, and a prompt that starts like what it held reuses that part
//! instead of computing it again: on the generated model, 1 thread, prompts longer
//! than n-batch so that reuse ends inside a later piece.

use std::sync::Arc;

use llamabox_native::{Batch, CancelFlag, Context, ContextParams, Error, Model, PromptPiece, Stop};

use crate::common;
use crate::share::Counts;

fn params(n_seq_max: u32) -> ContextParams {
    ContextParams { n_ctx: 512, n_batch: 64, n_ubatch: 64, n_seq_max, n_threads: 1 }
}

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::tiny_model()).unwrap())
}

/// Deterministic token ids that are all in the vocabulary.
fn tokens(model: &Model, n: usize, salt: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + salt * 13 + 3) % model.n_vocab() as usize) as i32).collect()
}

/// `shared` then `own`: two prompts with a common start (a system message, say).
fn prompt(shared: &[i32], own: &[i32]) -> Vec<i32> {
    [shared, own].concat()
}

/// A common start of `shared` tokens and two prompts `(a, b)` that begin with it, with
/// `own.0` and `own.1` tokens of their own; `salt` and the two after it pick the tokens.
fn shared_and_two_prompts(
    model: &Model,
    shared: usize,
    own: (usize, usize),
    salt: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let start = tokens(model, shared, salt);
    let a = prompt(&start, &tokens(model, own.0, salt + 1));
    let b = prompt(&start, &tokens(model, own.1, salt + 2));
    (start, a, b)
}

fn eval(ctx: &mut Context, prompt: &[i32]) -> Result<i32, Error> {
    ctx.eval(&[PromptPiece::Tokens(prompt.to_vec())], 0, None)
}

/// The last row's logits of `prompt` evaluated on a new context.
fn fresh_logits(model: &Arc<Model>, prompt: &[i32]) -> Vec<f32> {
    fresh_logits_split(model, prompt, 0)
}

/// The same, evaluated in two calls: `prompt[..at]`, then the rest. This is what a
/// reuse of `at` tokens must equal bitwise. (llama.cpp's logits depend on how a prompt
/// is split into ubatches, by rounding: here up to ~2e-3 against one call.)
fn fresh_logits_split(model: &Arc<Model>, prompt: &[i32], at: usize) -> Vec<f32> {
    let mut ctx = Context::new(model.clone(), params(1)).unwrap();
    if at > 0 {
        eval(&mut ctx, &prompt[..at]).unwrap();
    }
    eval(&mut ctx, &prompt[at..]).unwrap();
    ctx.last_logits().unwrap().to_vec()
}

/// Largest difference between two logit rows.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A context that evaluated `first`, then generated (decoded) `generated`, then parked.
fn parked_after(model: &Arc<Model>, first: &[i32], generated: &[i32]) -> Context {
    let mut ctx = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut ctx, first).unwrap();
    for (i, &token) in generated.iter().enumerate() {
        ctx.decode(&Batch::sequence(&[token], (first.len() + i) as i32, 0), None).unwrap();
    }
    ctx.park();
    ctx
}

fn metered(ctx: &mut Context) -> Arc<Counts> {
    let counts = Arc::new(Counts::default());
    ctx.set_tally(counts.clone());
    counts
}

#[test]
fn a_parked_context_reads_as_new() {
    let model = model();
    let first = tokens(&model, 90, 1);
    let ctx = parked_after(&model, &first, &tokens(&model, 5, 2));
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1, "the leftover is not part of what it holds");
    assert_eq!(ctx.leftover().len(), 95, "prompt and generated tokens are kept");
    assert!(ctx.last_logits().is_err(), "the last run's logits are not readable");
    assert!(ctx.logits_ith(0).is_err());
}

#[test]
fn a_prompt_sharing_the_start_computes_only_the_rest() {
    let model = model();
    // 100 shared: past n-batch 64, reuse ends in the 2nd piece.
    let (_, a, b) = shared_and_two_prompts(&model, 100, (20, 30), 3);
    let mut ctx = parked_after(&model, &a, &tokens(&model, 4, 6));
    let meter = metered(&mut ctx);
    assert_eq!(eval(&mut ctx, &b).unwrap(), b.len() as i32);
    assert_eq!(meter.reused(), 100, "the shared start is kept");
    assert_eq!(meter.decoded(), 30, "only the rest is computed");
    assert_eq!(ctx.seq_pos_max(0).unwrap(), b.len() as i32 - 1);
    assert!(ctx.leftover().is_empty());
    let logits = ctx.last_logits().unwrap().to_vec();
    assert_eq!(
        logits,
        fresh_logits_split(&model, &b, 100),
        "the logits of a new context that was given the shared part first"
    );
    // Against one call, llama.cpp's own rounding for another ubatch split, nothing more:
    // a prompt with another start differs by whole units.
    assert!(max_diff(&logits, &fresh_logits(&model, &b)) < 0.02);
    let other_start = prompt(&tokens(&model, 100, 33), &b[100..]);
    assert!(max_diff(&logits, &fresh_logits(&model, &other_start)) > 0.5);

    // The same prompt again: all but the last row is kept (its logits are wanted).
    ctx.park();
    let meter = metered(&mut ctx);
    eval(&mut ctx, &b).unwrap();
    assert_eq!((meter.reused(), meter.decoded()), (b.len() as u64 - 1, 1));
    // Bitwise what the same calls give on a context that was never parked: the kept
    // cells are exactly the ones computed before.
    let mut replay = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut replay, &a).unwrap();
    replay.seq_rm(0, 100, -1).unwrap();
    eval(&mut replay, &b[100..]).unwrap();
    replay.seq_rm(0, b.len() as i32 - 1, -1).unwrap();
    eval(&mut replay, &b[b.len() - 1..]).unwrap();
    assert_eq!(ctx.last_logits().unwrap(), replay.last_logits().unwrap());
    assert!(max_diff(ctx.last_logits().unwrap(), &fresh_logits(&model, &b)) < 0.02);
}

#[test]
fn nothing_shared_nothing_reused() {
    let model = model();
    let a = tokens(&model, 40, 7);
    let mut b = tokens(&model, 40, 8);
    b[0] = (a[0] + 1) % model.n_vocab() as i32;
    let mut ctx = parked_after(&model, &a, &[]);
    let meter = metered(&mut ctx);
    eval(&mut ctx, &b).unwrap();
    assert_eq!((meter.reused(), meter.decoded()), (0, 40));
    assert_eq!(ctx.last_logits().unwrap(), fresh_logits(&model, &b));
}

/// A cancelled (or failed) prompt on a parked context leaves it reading as new, with
/// the part it had kept still there to reuse.
#[test]
fn a_cancelled_reusing_prompt_leaves_the_context_as_it_was() {
    let model = model();
    let (shared, a, b) = shared_and_two_prompts(&model, 70, (10, 90), 9);
    let mut ctx = parked_after(&model, &a, &[]);
    let token = CancelFlag::new();
    token.trip_after(40); // in the second of the rest's two pieces
    assert_eq!(
        ctx.eval(&[PromptPiece::Tokens(b.clone())], 0, Some(Stop::on(&token))),
        Err(Error::Cancelled)
    );
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);
    assert_eq!(ctx.leftover(), &shared[..], "the kept part is leftover again");

    let bad = prompt(&shared, &[model.n_vocab() as i32]);
    assert!(matches!(eval(&mut ctx, &bad), Err(Error::InvalidArgument(_))));
    assert_eq!((ctx.seq_pos_max(0).unwrap(), ctx.leftover()), (-1, &shared[..]));

    let meter = metered(&mut ctx);
    eval(&mut ctx, &b).unwrap();
    assert_eq!(meter.reused(), 70);
    assert_eq!(ctx.last_logits().unwrap(), fresh_logits_split(&model, &b, 70));
}

/// A plain decode from position 0 reuses the leftover too, up to its first row with
/// logits; row numbers stay the caller's.
#[test]
fn a_decode_from_the_start_reuses_up_to_its_first_logits_row() {
    let model = model();
    let (shared, a, b) = shared_and_two_prompts(&model, 40, (10, 20), 15);
    let mut ctx = parked_after(&model, &a, &[]);
    let meter = metered(&mut ctx);
    let batch = Batch::sequence(&b, 0, 0);
    ctx.decode(&batch, None).unwrap();
    assert_eq!((meter.reused(), meter.decoded()), (40, 20));
    let mut replay = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut replay, &a).unwrap();
    replay.seq_rm(0, 40, -1).unwrap();
    replay.decode(&Batch::sequence(&b[40..], 40, 0), None).unwrap();
    assert_eq!(
        ctx.logits_ith(59).unwrap(),
        replay.logits_ith(19).unwrap(),
        "row 59 of the caller's batch"
    );
    assert!(ctx.logits_ith(10).is_err(), "a reused row has no logits");

    // Logits wanted from row 5 on: only rows 0..5 can be reused.
    let mut ctx = parked_after(&model, &a, &[]);
    let meter = metered(&mut ctx);
    let mut batch = Batch::sequence(&b, 0, 0);
    batch.logits = (0..b.len()).map(|r| r >= 5).collect();
    ctx.decode(&batch, None).unwrap();
    assert_eq!(meter.reused(), 5);
    let mut replay = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut replay, &a).unwrap();
    replay.seq_rm(0, 5, -1).unwrap();
    let mut rest = Batch::sequence(&b[5..], 5, 0);
    rest.logits = vec![true; b.len() - 5];
    replay.decode(&rest, None).unwrap();
    for row in [5u32, 30, 59] {
        assert_eq!(ctx.logits_ith(row).unwrap(), replay.logits_ith(row - 5).unwrap());
    }

    // Cancelled: reads as new, the kept part is leftover again.
    let mut ctx = parked_after(&model, &a, &[]);
    let token = CancelFlag::new();
    token.trip_after(3);
    assert_eq!(
        ctx.decode(&Batch::sequence(&b, 0, 0), Some(Stop::on(&token))),
        Err(Error::Cancelled)
    );
    assert_eq!((ctx.seq_pos_max(0).unwrap(), ctx.leftover()), (-1, &shared[..]));
}

/// Anything but a prompt from position 0 removes the leftover first: the context
/// behaves as a new one would.
#[test]
fn other_calls_on_a_parked_context_see_it_empty() {
    let model = model();
    let a = tokens(&model, 50, 12);
    let b = tokens(&model, 20, 13);

    let mut ctx = parked_after(&model, &a, &[]);
    assert!(
        ctx.decode(&Batch::sequence(&b, 50, 0), None).is_err(),
        "it does not continue the leftover"
    );
    ctx.decode(&Batch::sequence(&b, 0, 0), None).unwrap(); // b starts unlike a: nothing kept
    assert!(ctx.leftover().is_empty());
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 19);
    assert_eq!(ctx.last_logits().unwrap(), fresh_logits(&model, &b));

    let mut ctx = parked_after(&model, &a, &[]);
    ctx.seq_rm(0, 0, -1).unwrap();
    assert_eq!((ctx.seq_pos_max(0).unwrap(), ctx.leftover().len()), (-1, 0));
    let meter = metered(&mut ctx);
    eval(&mut ctx, &a).unwrap();
    assert_eq!(meter.reused(), 0, "removed means gone, not kept");

    // Clearing a parked context changes nothing it holds (it is empty already), so
    // what it had stays reusable.
    let mut ctx = parked_after(&model, &a, &[]);
    ctx.clear();
    assert_eq!((ctx.seq_pos_max(0).unwrap(), ctx.leftover()), (-1, &a[..]));
    let meter = metered(&mut ctx);
    eval(&mut ctx, &a).unwrap();
    assert_eq!(meter.reused(), a.len() as u64 - 1);
    ctx.clear();
    assert_eq!(
        (ctx.seq_pos_max(0).unwrap(), ctx.leftover().len()),
        (-1, 0),
        "an ordinary clear empties it"
    );

    // A media piece first (embeddings): not tokens, nothing to match.
    let mut ctx = parked_after(&model, &a, &[]);
    let embd = vec![0.01f32; model.n_embd_inp() as usize * 3];
    ctx.eval(
        &[PromptPiece::Embeddings { embd, non_causal: false }, PromptPiece::Tokens(a.clone())],
        0,
        None,
    )
    .unwrap();
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 52);
    ctx.park();
    assert!(ctx.leftover().is_empty(), "memory that is not all tokens is not kept");
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);
}

/// What a run removed or took back is not kept; a context of several sequences keeps
/// nothing.
#[test]
fn only_what_sequence_zero_holds_is_kept() {
    let model = model();
    let a = tokens(&model, 30, 14);
    let mut ctx = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut ctx, &a).unwrap();
    ctx.seq_rm(0, 25, -1).unwrap();
    ctx.park();
    assert_eq!(ctx.leftover(), &a[..25]);

    let mut ctx = Context::new(model.clone(), params(1)).unwrap();
    eval(&mut ctx, &a).unwrap();
    ctx.seq_rm(0, 5, 10).unwrap(); // a hole
    ctx.park();
    assert!(ctx.leftover().is_empty());
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);

    let mut ctx = Context::new(model.clone(), params(2)).unwrap();
    eval(&mut ctx, &a).unwrap();
    ctx.park();
    assert!(ctx.leftover().is_empty());
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);
}
