//! The native layer's decode contract, on a generated model with 1 thread:
//! deterministic cancels (a test hook trips the cancel byte after graph node N), memory
//! restored to exactly its state before a cancelled call, and bitwise-identical logits
//! afterwards.

use std::sync::Arc;

use llamabox_native::{Batch, CancelFlag, Context, ContextParams, Error, Model, Stop};

use crate::common;

fn params(n_ubatch: u32) -> ContextParams {
    ContextParams { n_ctx: 512, n_batch: 128, n_ubatch, n_seq_max: 2, n_threads: 1 }
}

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::tiny_model()).unwrap())
}

/// Deterministic token ids that are all in the vocabulary.
fn tokens(model: &Model, n: usize, salt: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + salt * 13 + 3) % model.n_vocab() as usize) as i32).collect()
}

fn decode(ctx: &mut Context, batch: &Batch, token: &CancelFlag) -> Result<(), Error> {
    ctx.decode(batch, Some(Stop::on(token)))
}

/// Logits of `batch`'s last row, decoded after `prefix` on a fresh context: what an
/// uncancelled run gives.
fn reference(model: &Arc<Model>, n_ubatch: u32, prefix: &Batch, batch: &Batch) -> Vec<f32> {
    let mut ctx = Context::new(model.clone(), params(n_ubatch)).unwrap();
    ctx.decode(prefix, None).unwrap();
    ctx.decode(batch, None).unwrap();
    ctx.logits_ith(batch.len() as u32 - 1).unwrap().to_vec()
}

/// Decodes `batch` again, uncancelled: its last row's logits must be `expected` bit for
/// bit.
fn assert_decodes_as_uncancelled(ctx: &mut Context, batch: &Batch, expected: &[f32]) {
    decode(ctx, batch, &CancelFlag::new()).unwrap();
    let got = ctx.logits_ith(batch.len() as u32 - 1).unwrap();
    assert!(common::bitwise_eq(got, expected), "logits differ from an uncancelled run");
}

/// Graph nodes the CPU backend polls the abort callback for in one ubatch of `n` tokens.
fn polls_per_ubatch(model: &Arc<Model>, n: usize) -> u64 {
    let mut ctx = Context::new(model.clone(), params(n as u32)).unwrap();
    let counter = CancelFlag::counting();
    decode(&mut ctx, &Batch::sequence(&tokens(model, n, 9), 0, 0), &counter).unwrap();
    counter.polls()
}

#[test]
fn decode_cancelled_mid_graph_changes_nothing() {
    let model = model();
    let prefix = Batch::sequence(&tokens(&model, 8, 1), 0, 0);
    let batch = Batch::sequence(&tokens(&model, 24, 2), 8, 0);
    let expected = reference(&model, 64, &prefix, &batch);

    let mut ctx = Context::new(model.clone(), params(64)).unwrap();
    ctx.decode(&prefix, None).unwrap();
    let token = CancelFlag::new();
    token.trip_after(5);
    assert_eq!(decode(&mut ctx, &batch, &token), Err(Error::Cancelled));
    assert_eq!(token.polls(), 5, "the decode must stop at the poll that tripped the byte");
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 7, "memory must be as before the call");
    assert!(ctx.logits_ith(23).is_err(), "a cancelled decode leaves no logits to read");

    assert_decodes_as_uncancelled(&mut ctx, &batch, &expected);
}

#[test]
fn decode_cancelled_in_its_second_ubatch_removes_the_first() {
    let model = model();
    let n_ubatch = 16;
    let per_ubatch = polls_per_ubatch(&model, n_ubatch);
    assert!(per_ubatch > 10, "a llama graph has many nodes, got {per_ubatch}");

    let prefix = Batch::sequence(&tokens(&model, 5, 3), 0, 0);
    let batch = Batch::sequence(&tokens(&model, 3 * n_ubatch, 4), 5, 0);
    let expected = reference(&model, n_ubatch as u32, &prefix, &batch);

    let mut ctx = Context::new(model.clone(), params(n_ubatch as u32)).unwrap();
    ctx.decode(&prefix, None).unwrap();
    let token = CancelFlag::new();
    token.trip_after(per_ubatch + 3); // three nodes into the second ubatch
    assert_eq!(decode(&mut ctx, &batch, &token), Err(Error::Cancelled));
    assert_eq!(token.polls(), per_ubatch + 3);
    // llama.cpp keeps the finished first ubatch (positions 5..21); the host removes it.
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 4);

    assert_decodes_as_uncancelled(&mut ctx, &batch, &expected);
}

#[test]
fn token_cancelled_on_entry_touches_nothing() {
    let model = model();
    let mut ctx = Context::new(model.clone(), params(64)).unwrap();
    let prefix = Batch::sequence(&tokens(&model, 6, 5), 0, 0);
    ctx.decode(&prefix, None).unwrap();
    let before = ctx.logits_ith(5).unwrap().to_vec();

    let token = CancelFlag::new();
    token.cancel();
    token.trip_after(u64::MAX); // count polls: there must be none
    let batch = Batch::sequence(&tokens(&model, 4, 6), 6, 0);
    assert_eq!(decode(&mut ctx, &batch, &token), Err(Error::Cancelled));
    assert_eq!(token.polls(), 0, "no graph may run for a token cancelled on entry");
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 5);
    assert_eq!(
        ctx.logits_ith(5).unwrap(),
        &before[..],
        "the previous decode's logits stay readable"
    );
}

#[test]
fn a_cancelled_call_does_not_leave_its_callback_behind() {
    let model = model();
    let mut ctx = Context::new(model.clone(), params(64)).unwrap();
    let token = CancelFlag::new();
    token.trip_after(1);
    assert_eq!(
        decode(&mut ctx, &Batch::sequence(&tokens(&model, 4, 7), 0, 0), &token),
        Err(Error::Cancelled)
    );
    // The token stays cancelled; a plain decode must not see it.
    ctx.decode(&Batch::sequence(&tokens(&model, 4, 7), 0, 0), None).unwrap();
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 3);
}

#[test]
fn other_sequences_survive_a_cancel() {
    let model = model();
    let mut ctx = Context::new(model.clone(), params(8)).unwrap();
    ctx.decode(&Batch::sequence(&tokens(&model, 4, 8), 0, 1), None).unwrap();
    ctx.decode(&Batch::sequence(&tokens(&model, 3, 9), 0, 0), None).unwrap();
    let token = CancelFlag::new();
    token.trip_after(polls_per_ubatch(&model, 8) + 1);
    let batch = Batch::sequence(&tokens(&model, 20, 10), 3, 0);
    assert_eq!(decode(&mut ctx, &batch, &token), Err(Error::Cancelled));
    assert_eq!((ctx.seq_pos_max(0).unwrap(), ctx.seq_pos_max(1).unwrap()), (2, 3));
}

#[test]
fn bad_batches_are_refused_with_a_reason() {
    let model = model();
    let mut ctx = Context::new(model.clone(), params(64)).unwrap();
    let n_vocab = model.n_vocab() as i32;
    let ok = tokens(&model, 3, 11);
    let cases = [
        (Batch::sequence(&[n_vocab], 0, 0), "outside the vocabulary"),
        (Batch::sequence(&[-1], 0, 0), "outside the vocabulary"),
        (Batch::sequence(&[], 0, 0), "empty batch"),
        (Batch::sequence(&vec![ok[0]; 129], 0, 0), "larger than n-batch"),
        (Batch::sequence(&ok, 0, 2), "sequence id 2"),
        (Batch::sequence(&ok, 0, -1), "sequence id -1"),
        (Batch::sequence(&ok, 1, 0), "must continue at position 0"),
        (Batch { logits: vec![true], ..Batch::sequence(&ok, 0, 0) }, "columns differ"),
    ];
    for (batch, reason) in cases {
        match decode(&mut ctx, &batch, &CancelFlag::new()) {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains(reason), "{m:?} should mention {reason:?}")
            }
            other => panic!("{batch:?}: expected invalid-argument ({reason}), got {other:?}"),
        }
    }
    decode(&mut ctx, &Batch::sequence(&ok, 0, 0), &CancelFlag::new()).unwrap();
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 2);
    assert!(matches!(ctx.seq_pos_max(2), Err(Error::InvalidArgument(_))));
    assert!(
        matches!(ctx.logits_ith(0), Err(Error::InvalidArgument(_))),
        "row 0 asked for no logits"
    );
}

#[test]
fn tokenizer_round_trips_and_checks_ids() {
    let model = model();
    let toks = model.tokenize("hello llama box!", false, false).unwrap();
    assert!(!toks.is_empty());
    assert_eq!(model.detokenize(&toks, false, false).unwrap(), "hello llama box!");
    let with_bos = model.tokenize("hello", true, false).unwrap();
    assert_eq!(Some(with_bos[0]), model.bos());
    let piece: Vec<u8> =
        toks.iter().flat_map(|&t| model.token_to_piece(t, false).unwrap()).collect();
    assert_eq!(String::from_utf8(piece).unwrap().trim_start(), "hello llama box!");
    assert!(model.token_to_piece(model.n_vocab() as i32, false).is_err());
    assert!(model.detokenize(&[-5], false, false).is_err());
    assert!(model.is_eog(model.eos().unwrap()) && !model.is_eog(-1));
}
