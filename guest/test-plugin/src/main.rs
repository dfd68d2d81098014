//! The test suite's plugin: what no user's plugin should do, one behaviour per run, so
//! the tests can show that the host holds. It loops forever in wasm, allocates until
//! stopped, tokenizes the slowest text the host takes, decodes until cancelled from
//! outside, soaks decodes in random cancels, stops reading a generation, drops calls
//! before their pollables, and makes every bad call the host must refuse.
//!
//! ```text
//! llamabox-test-plugin MODE [--model M] [--long-tokens N] [--token CAPABILITY]
//!                           [--media PROJECTOR] [--cancel-after-ms MS] [--iterations N] [--seed S]
//! ```
//! MODE: spin, hog-memory, tokenize-until-stopped, decode-until-stopped, soak,
//! stall-generation, drop-call-first, bad-inputs. Output lines are `key: value`.

use llamabox_guest::args::Args;
use llamabox_guest::{digest, filler, finish_name, greedy_params, outcome, sequence, wasi};

use llamabox_guest::cancel::CancelToken;
use llamabox_guest::generate::{self, GenerateParams, LogitBias, SamplerParams};
use llamabox_guest::llm::{Batch, Context, ContextParams, Model};
use llamabox_guest::media::{ChunkKind, Image, Input, MediaContext};
use llamabox_guest::types::Error;
use wasi::clocks::monotonic_clock;
use wasi::io::poll;

struct Options {
    mode: String,
    model: String,
    long_tokens: u32,
    /// A shared token's capability to decode under (`decode-until-stopped`).
    token: Option<String>,
    cancel_after_ms: u64,
    iterations: u64,
    seed: u64,
    /// A projector: `bad-inputs` and `drop-call-first` add their media cases.
    media: Option<String>,
}

impl Options {
    fn read(args: &mut Args) -> Result<Self, String> {
        Ok(Options {
            mode: args.word().ok_or("which mode? see the crate's doc")?,
            model: args.string("model", "default"),
            long_tokens: args.number("long-tokens", 512)?,
            token: args.value("token"),
            cancel_after_ms: args.number("cancel-after-ms", 20)?,
            iterations: args.number("iterations", 100)?,
            seed: args.number("seed", 1)?,
            media: args.value("media"),
        })
    }
}

fn main() {
    llamabox_guest::args::command("test-plugin", &[], Options::read, run);
}

fn run(o: &Options) -> Result<(), Error> {
    match o.mode.as_str() {
        "spin" => spin(),
        "hog-memory" => hog_memory(),
        _ => {}
    }
    let model = Model::open(&o.model)?;
    let ctx = Context::create(&model, context_params(o.long_tokens))?;
    println!("model: {} (vocab {}, embd {})", o.model, model.n_vocab(), model.n_embd());
    match o.mode.as_str() {
        "tokenize-until-stopped" => tokenize_until_stopped(&model),
        "decode-until-stopped" => decode_until_stopped(o, &model, &ctx),
        "soak" => soak(o, &model, &ctx),
        "stall-generation" => stall_generation(o, &model, &ctx),
        "drop-call-first" => drop_call_first(o, &model, &ctx),
        "bad-inputs" => {
            bad_inputs(&model, &ctx)?;
            match &o.media {
                Some(projector) => bad_media_inputs(projector, &model, &ctx),
                None => Ok(()),
            }
        }
        other => Err(Error::InvalidArgument(format!("unknown mode {other:?}"))),
    }
}

/// One sequence, room for a `long_tokens` batch and a little more.
fn context_params(long_tokens: u32) -> ContextParams {
    ContextParams {
        n_ctx: Some((long_tokens.max(64) + 64).next_power_of_two()),
        n_batch: Some(long_tokens.max(64)),
        n_ubatch: None,
        n_seq_max: Some(1),
        n_threads: Some(1),
    }
}

/// Loop forever in wasm: only the run's deadline (an epoch interrupt) ends it.
fn spin() -> ! {
    println!("spinning");
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

/// Allocate until something gives: the store's memory limit.
fn hog_memory() -> ! {
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        hoard.push(vec![1; 16 << 20]);
        println!("hoarded {} MiB", hoard.len() * 16);
    }
}

/// Tokenize the slowest text the host takes, until stopped from outside: llama.cpp's
/// special-token partition is quadratic in the number of special tokens, so the most
/// of them that fit under the host's cap is the slowest input.
fn tokenize_until_stopped(model: &Model) -> Result<(), Error> {
    let special = match model.eos() {
        Some(eos) => String::from_utf8_lossy(&model.token_to_piece(eos, true)?).into_owned(),
        None => "<|im_end|>".into(),
    };
    let slow = format!("{special}x").repeat(16 * 1024 / (special.len() + 1));
    println!("tokenizing until stopped");
    loop {
        model.tokenize(&slow, true, true)?;
    }
}

/// Decode long batches (under the shared `--token` if given) until one is cancelled.
fn decode_until_stopped(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let token = match &o.token {
        Some(capability) => CancelToken::open_shared(capability)?,
        None => CancelToken::new(),
    };
    let batch = sequence(&filler(model, o.long_tokens)?, 0);
    println!("decoding until stopped");
    loop {
        match ctx.decode(&batch, &token) {
            Ok(()) => ctx.clear()?,
            Err(Error::Cancelled) => {
                println!("stopped: cancelled");
                println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
}

/// Decode the same batch again and again, each time cancelling it from this event loop
/// after a random delay: every decode must either finish with the reference logits or
/// be cancelled and leave memory empty.
fn soak(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let batch = sequence(&filler(model, o.long_tokens)?, 0);
    let started = monotonic_clock::now();
    ctx.clear()?;
    ctx.decode(&batch, &CancelToken::new())?;
    let reference = digest::logits(&ctx.last_logits()?);
    let full_us = ((monotonic_clock::now() - started) / 1000).max(1);
    let mut rng = o.seed | 1;
    let (mut finished, mut cancelled, mut wrong) = (0u64, 0u64, 0u64);
    for _ in 0..o.iterations {
        ctx.clear()?;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let token = CancelToken::new();
        let pending = ctx.start_decode(&batch, &token)?;
        let done = pending.subscribe();
        let timer = monotonic_clock::subscribe_duration(rng % (full_us * 3 / 2) * 1000);
        if !poll::poll(&[&done, &timer]).contains(&0) {
            token.cancel();
        }
        match pending.finish() {
            Ok(()) if digest::logits(&ctx.last_logits()?) == reference => finished += 1,
            Err(Error::Cancelled) if ctx.seq_pos_max(0)? == -1 => cancelled += 1,
            _ => wrong += 1,
        }
    }
    println!("soak: {finished} finished, {cancelled} cancelled, {wrong} wrong");
    Ok(())
}

/// A reader that stops reading: the host buffers a bounded number of pieces and then
/// waits; a cancel ends the wait, and the piece it could not deliver is not kept.
fn stall_generation(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let prompt = model.tokenize("The llama in the box", true, true)?;
    let no_end = SamplerParams {
        logit_bias: vec![LogitBias { token: model.eos().unwrap_or(0), bias: f32::NEG_INFINITY }],
        ..generate::greedy_sampler()
    };
    let token = CancelToken::new();
    let generation = generate::start(
        ctx,
        &GenerateParams { sampler: no_end, ..greedy_params(prompt.clone(), 256) },
        &token,
    )?;
    monotonic_clock::subscribe_duration(o.cancel_after_ms * 1_000_000).block();
    token.cancel();
    let mut delivered = 0;
    while let Some(piece) = generation.next()? {
        delivered += piece.tokens.len();
    }
    println!(
        "stalled-generation: {delivered} delivered, {}",
        finish_name(generation.finish_reason())
    );
    let consistent = ctx.seq_pos_max(0)? == prompt.len() as i32 + delivered as i32 - 1;
    println!(
        "stalled-generation-memory: {}",
        if consistent { "consistent" } else { "inconsistent" }
    );
    Ok(())
}

/// Drop a running pending-decode, generation and (with `--media`) pending-encode
/// while the pollable from its `subscribe()` is still alive, as a garbage collector
/// may: the drop stops the call, and the orphaned pollable is simply ready. Memory is
/// left as the stopped call found it.
fn drop_call_first(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let tokens = filler(model, o.long_tokens)?;
    ctx.clear()?;
    let pending = ctx.start_decode(&sequence(&tokens, 0), &CancelToken::new())?;
    let ready = pending.subscribe();
    drop(pending);
    outlive(ready, "decode");
    println!("drop-first-decode-memory: seq-pos-max={}", ctx.seq_pos_max(0)?);

    ctx.clear()?;
    let generation = generate::start(ctx, &greedy_params(tokens.clone(), 64), &CancelToken::new())?;
    let ready = generation.subscribe();
    drop(generation);
    outlive(ready, "generation");

    if let Some(projector) = &o.media {
        let media = MediaContext::open(projector, model)?;
        let image = Input::Image(Image { width: 64, height: 64, rgb: vec![128; 64 * 64 * 3] });
        let chunks = media.tokenize(&format!("look: {}", media.marker()), &[image])?;
        let chunk = chunks
            .iter()
            .find(|c| c.kind() != ChunkKind::Text)
            .ok_or(Error::Backend("no media chunk".into()))?;
        let pending = media.start_encode_chunk(chunk, &CancelToken::new())?;
        let ready = pending.subscribe();
        drop(pending);
        outlive(ready, "encode");
    }
    // The context still works after all of that.
    ctx.clear()?;
    ctx.decode(&sequence(&tokens[..tokens.len().min(5)], 0), &CancelToken::new())?;
    println!("drop-first-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
    Ok(())
}

/// Wait on a pollable whose call was dropped (it must be ready at once, not trap),
/// then drop it.
fn outlive(ready: poll::Pollable, what: &str) {
    ready.block();
    drop(ready);
    println!("drop-first-{what}: ok");
}

/// Every bad input the host must refuse with a clear error, each followed by a good call.
fn bad_inputs(model: &Model, ctx: &Context) -> Result<(), Error> {
    let never = CancelToken::new();
    let n_vocab = model.n_vocab() as i32;
    let good = model.tokenize("hello", true, false)?;
    let cases: Vec<(&str, Batch)> = vec![
        ("token-too-large", sequence(&[n_vocab], 0)),
        ("token-negative", sequence(&[-1], 0)),
        ("empty-batch", sequence(&[], 0)),
        ("batch-too-large", sequence(&vec![good[0]; ctx.n_batch() as usize + 1], 0)),
        (
            "seq-out-of-range",
            Batch { seq_ids: vec![ctx.n_seq_max() as i32], ..sequence(&good[..1], 0) },
        ),
        ("position-gap", sequence(&good, 5)),
        ("columns-differ", Batch { positions: vec![], ..sequence(&good, 0) }),
    ];
    for (name, batch) in cases {
        println!("bad-input {name}: {}", outcome(ctx.decode(&batch, &never)));
    }
    println!("bad-input unknown-model: {}", outcome(Model::open("no-such-model").map(|_| ())));
    println!(
        "meta: architecture={} missing={} long-key={}",
        model.meta("general.architecture")?.unwrap_or_default(),
        model.meta("no.such.key")?.is_none(),
        outcome(model.meta(&"k".repeat(300)).map(|_| ())),
    );
    let shaped = |n_ctx: u32,
                  n_batch: u32,
                  n_ubatch: Option<u32>,
                  n_seq_max: Option<u32>,
                  n_threads: u32| ContextParams {
        n_ctx: Some(n_ctx),
        n_batch: Some(n_batch),
        n_ubatch,
        n_seq_max,
        n_threads: Some(n_threads),
    };
    let shapes = [
        ("huge-n-ctx", shaped(1 << 24, 64, None, None, 1)),
        ("too-many-threads", shaped(256, 64, None, None, 1 << 20)),
        ("n-seq-max-above-n-ctx", shaped(8, 512, None, Some(16), 1)),
        ("n-seq-max-above-n-batch", shaped(256, 1, None, Some(2), 1)),
        ("n-ubatch-above-n-batch", shaped(256, 64, Some(128), Some(1), 1)),
        ("zero-n-ctx", shaped(0, 64, None, Some(1), 1)),
    ];
    for (name, shape) in shapes {
        println!("bad-input {name}: {}", outcome(Context::create(model, shape).map(|_| ())));
    }
    let extra: Vec<_> =
        (0..4).map(|_| Context::create(model, shaped(256, 64, None, None, 1))).collect();
    println!(
        "bad-input too-many-contexts: {}",
        outcome(extra.into_iter().last().unwrap().map(|_| ()))
    );
    println!("bad-input logits-of-unrequested-row: {}", outcome(ctx.logits_ith(0).map(|_| ())));
    println!("good-tokens: {}", good.len());
    println!("good-after-bad: {}", outcome(ctx.decode(&sequence(&good, 0), &never)));
    println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
    Ok(())
}

/// Media and budget cases: a chunk passed to a media context that did not make it, a
/// context whose padded memory is over the KV budget, more tokens than allowed.
fn bad_media_inputs(projector: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let never = CancelToken::new();
    let maker = MediaContext::open(projector, model)?;
    let other = MediaContext::open(projector, model)?;
    let image = Input::Image(Image { width: 8, height: 8, rgb: vec![100; 8 * 8 * 3] });
    let chunks = maker.tokenize(&format!("look {}", maker.marker()), &[image]);
    println!(
        "bad-input chunk-budget: {}",
        outcome(chunks.as_ref().map(|_| ()).map_err(Clone::clone))
    );
    if let Ok(chunks) = chunks {
        let refs: Vec<&_> = chunks.iter().collect();
        let media_chunk = chunks
            .iter()
            .find(|c| c.kind() != ChunkKind::Text)
            .ok_or(Error::Backend("no media chunk".into()))?;
        println!(
            "bad-input foreign-chunk-encode: {}",
            outcome(other.encode_chunk(media_chunk, &never).map(|_| ()))
        );
        println!(
            "bad-input foreign-chunk-start-encode: {}",
            outcome(other.start_encode_chunk(media_chunk, &never).map(|_| ()))
        );
        println!(
            "bad-input foreign-chunk-eval: {}",
            outcome(other.eval_chunks(ctx, &refs, 0, &never).map(|_| ()))
        );
        println!(
            "good-own-chunk-eval: {}",
            outcome(maker.eval_chunks(ctx, &refs, 0, &never).map(|_| ()))
        );
    }
    let padded = ContextParams {
        n_ctx: Some(480),
        n_batch: Some(64),
        n_ubatch: None,
        n_seq_max: Some(16),
        n_threads: Some(1),
    };
    println!("bad-input kv-cells-padded: {}", outcome(Context::create(model, padded).map(|_| ())));
    let mut tokens = Vec::new();
    let over = loop {
        match CancelToken::create() {
            Ok(token) => tokens.push(token),
            Err(e) => break e,
        }
    };
    println!("bad-input too-many-tokens: {} (after {})", outcome(Err(over)), tokens.len());
    Ok(())
}
