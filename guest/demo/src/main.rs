//! The demo plugin: generates text on a model the host registered, then starts a long
//! decode and cancels it from the guest's own event loop (WASI 0.2 pollables) while the
//! decode is running inside llama.cpp.
//!
//! With `--host-generate` it also generates on the host (the `generate` interface, and
//! a plugin-driven `sampler`) and prints both token lists; with `--chat` it formats a
//! question with the model's own chat template and streams the answer; with
//! `--cancel-generation` it cancels a host-side generation from its own timer.
//!
//! Output lines are `key: value` so tests can read them.

// The plugin world's bindings, shared by every Rust plugin (guest/sdk).
use llamabox_guest::{argmax, decode_with_timeout, digest, greedy_next, llamabox, sequence, wasi};

use llamabox::inference::cancel::CancelToken;
use llamabox::inference::generate::{self, ChatMessage, FinishReason, GenerateParams, Generation, Grammar, Sampler, SamplerParams};
use llamabox::inference::llm::{Batch, Context, ContextParams, Model};
use llamabox::inference::media::{ChunkKind, Image, Input, MediaContext};
use llamabox::inference::types::Error;
use wasi::clocks::monotonic_clock;
use wasi::io::poll;

struct Options {
    model: String,
    prompt: String,
    generate: u32,
    threads: u32,
    long_tokens: u32,
    cancel_after_ms: u64,
    bad_inputs: bool,
    /// A projector name: run the media scenario instead of the text one.
    media: Option<String>,
    /// A shared token's capability: run one long decode under it and report.
    token: Option<String>,
    /// A shared token's capability: cancel it and exit.
    cancel_shared: Option<String>,
    /// Misbehave: loop forever in wasm.
    spin: bool,
    /// Misbehave: decode long batches (under `token` if given) until stopped from outside.
    decode_until_stopped: bool,
    /// Misbehave: tokenize the slowest text the host takes (special tokens packed as
    /// tightly as its max-special-text-bytes allows), until stopped from outside.
    tokenize_until_stopped: bool,
    /// Misbehave: allocate until something gives.
    hog_memory: bool,
    /// Soak: this many decodes, each raced against a random-length timer.
    soak: Option<u64>,
    seed: u64,
    /// Generate on the host too (and with a plugin-driven sampler), printing token ids.
    host_generate: bool,
    /// A question: chat through the model's template and stream the answer.
    chat: Option<String>,
    /// Cancel a host-side generation from a timer after `cancel-after-ms`.
    cancel_generation: bool,
    /// Start a generation, stop reading it, cancel it while the host waits for room.
    stall_generation: bool,
    /// Generate a few tokens under this GBNF grammar (through `sampler` and `start`).
    grammar: Option<String>,
    /// Drop each kind of pending call before the pollable from its `subscribe()` (the
    /// order a garbage collector may choose), then poll and drop the pollable.
    drop_call_first: bool,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut o = Options {
            model: "default".into(),
            prompt: "The llama in the box".into(),
            generate: 16,
            threads: 1,
            long_tokens: 512,
            cancel_after_ms: 20,
            bad_inputs: false,
            media: None,
            token: None,
            cancel_shared: None,
            spin: false,
            decode_until_stopped: false,
            tokenize_until_stopped: false,
            hog_memory: false,
            soak: None,
            seed: 1,
            host_generate: false,
            chat: None,
            cancel_generation: false,
            stall_generation: false,
            grammar: None,
            drop_call_first: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or(format!("{flag} needs a value"));
            let number = |v: String| v.parse::<u64>().map_err(|_| format!("{flag}: {v:?} is not a number"));
            match flag.as_str() {
                "--model" => o.model = value()?,
                "--prompt" => o.prompt = value()?,
                "--generate" => o.generate = number(value()?)? as u32,
                "--threads" => o.threads = number(value()?)? as u32,
                "--long-tokens" => o.long_tokens = number(value()?)? as u32,
                "--cancel-after-ms" => o.cancel_after_ms = number(value()?)?,
                "--bad-inputs" => o.bad_inputs = true,
                "--media" => o.media = Some(value()?),
                "--token" => o.token = Some(value()?),
                "--cancel-shared" => o.cancel_shared = Some(value()?),
                "--spin" => o.spin = true,
                "--decode-until-stopped" => o.decode_until_stopped = true,
                "--tokenize-until-stopped" => o.tokenize_until_stopped = true,
                "--hog-memory" => o.hog_memory = true,
                "--soak" => o.soak = Some(number(value()?)?),
                "--seed" => o.seed = number(value()?)?,
                "--host-generate" => o.host_generate = true,
                "--chat" => o.chat = Some(value()?),
                "--cancel-generation" => o.cancel_generation = true,
                "--stall-generation" => o.stall_generation = true,
                "--grammar" => o.grammar = Some(value()?),
                "--drop-call-first" => o.drop_call_first = true,
                _ => return Err(format!("unknown argument {flag:?}")),
            }
        }
        Ok(o)
    }
}

fn main() {
    let result = Options::parse().and_then(|o| run(&o).map_err(|e| format!("{e:?}")));
    if let Err(e) = result {
        eprintln!("demo: {e}");
        std::process::exit(1);
    }
}

fn run(o: &Options) -> Result<(), Error> {
    if o.spin {
        println!("spinning");
        let mut x = 0u64;
        loop {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }
    if o.hog_memory {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1; 16 << 20]);
            println!("hoarded {} MiB", hoard.len() * 16);
        }
    }
    if let Some(capability) = &o.cancel_shared {
        let outcome = CancelToken::open_shared(capability).map(|token| token.cancel());
        println!("cancel-shared: {}", show(outcome));
        return Ok(());
    }
    let model = Model::open(&o.model)?;
    let n_ctx = (o.long_tokens.max(64) + 64).next_power_of_two();
    let params = ContextParams {
        n_ctx: Some(n_ctx),
        n_batch: Some(o.long_tokens.max(64)),
        n_ubatch: None,
        n_seq_max: Some(1),
        n_threads: Some(o.threads),
    };
    let ctx = Context::create(&model, params)?;
    println!("model: {} (vocab {}, embd {})", o.model, model.n_vocab(), model.n_embd());

    if o.bad_inputs {
        bad_inputs(&model, &ctx)?;
        if let Some(projector) = &o.media {
            bad_media_inputs(projector, &model, &ctx)?;
        }
        return Ok(());
    }
    if o.drop_call_first {
        return drop_call_first(o, &model, &ctx);
    }
    if let Some(projector) = &o.media {
        return media(o, projector, &model, &ctx);
    }
    if let Some(iterations) = o.soak {
        return soak(o, iterations, &model, &ctx);
    }
    if o.tokenize_until_stopped {
        // llama.cpp's special-token partition is quadratic in the number of special
        // tokens: the most of them that fit under the host's cap is the slowest input.
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
    if o.decode_until_stopped {
        let token = match &o.token {
            Some(capability) => CancelToken::open_shared(capability)?,
            None => CancelToken::new(),
        };
        let filler = model.tokenize(" the llama in the box", false, false)?;
        let tokens: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
        println!("decoding until stopped");
        loop {
            match ctx.decode(&sequence(&tokens, 0), &token) {
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
    if let Some(capability) = &o.token {
        let token = CancelToken::open_shared(capability)?;
        let filler = model.tokenize(" the llama in the box", false, false)?;
        let tokens: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
        println!("shared-decode: {}", show(ctx.decode(&sequence(&tokens, 0), &token)));
        println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
        return Ok(());
    }

    if let Some(question) = &o.chat {
        return chat(o, question, &model, &ctx);
    }
    if o.cancel_generation {
        return cancel_generation(o, &model, &ctx);
    }
    if o.stall_generation {
        return stall_generation(o, &model, &ctx);
    }
    if let Some(grammar) = &o.grammar {
        return constrained(o, grammar, &model, &ctx);
    }
    generate(o, &model, &ctx)?;
    if o.host_generate {
        return host_generate(o, &model, &ctx);
    }
    cancel_long_decode(o, &model, &ctx)
}

/// Decode the prompt, print a digest of its logits, then greedy-generate.
fn generate(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let never = CancelToken::new();
    // parse-special: chat-template markers such as <|im_start|> become their tokens.
    let prompt = model.tokenize(&o.prompt, true, true)?;
    println!("prompt-tokens: {}", prompt.len());
    ctx.decode(&sequence(&prompt, 0), &never)?;
    let logits = ctx.logits_ith(prompt.len() as u32 - 1)?;
    println!("prompt-logits: fnv1a64={:016x}", digest::logits(&logits));

    let mut text = Vec::new();
    let mut ids = Vec::new();
    let mut next = argmax(&logits);
    let mut pos = prompt.len() as i32;
    let mut n = 0;
    while n < o.generate && !model.is_eog(next) {
        text.extend(model.token_to_piece(next, false)?);
        ids.push(next);
        ctx.decode(&sequence(&[next], pos), &never)?;
        pos += 1;
        n += 1;
        next = argmax(&ctx.logits_ith(0)?);
    }
    println!("generated-tokens: {n}");
    println!("generated-ids: {}", join(&ids));
    println!("generated: {}", String::from_utf8_lossy(&text).trim_start().replace('\n', "\n           "));
    Ok(())
}

fn join(ids: &[i32]) -> String {
    ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
}

fn params(prompt: Vec<i32>, max_tokens: u32, stop: Vec<String>, sampler: SamplerParams) -> GenerateParams {
    GenerateParams { prompt, seq: 0, max_tokens, stop, sampler, logprobs: None }
}

fn finish_name(generation: &Generation) -> String {
    match generation.finish_reason() {
        Some(FinishReason::Stop(i)) => format!("stop {i}"),
        Some(FinishReason::EndOfGeneration) => "end-of-generation".into(),
        Some(FinishReason::MaxTokens) => "max-tokens".into(),
        Some(FinishReason::Cancelled) => "cancelled".into(),
        None => "none".into(),
    }
}

/// The same greedy generation as `generate`, run on the host: once as a streamed
/// generation (no logits cross the boundary), once with a sampler the plugin drives
/// row by row.
fn host_generate(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let prompt = model.tokenize(&o.prompt, true, true)?;
    ctx.clear()?;
    let generation = generate::start(ctx, &params(prompt.clone(), o.generate, Vec::new(), generate::greedy_sampler()), &CancelToken::new())?;
    let mut ids = Vec::new();
    while let Some(piece) = generation.next()? {
        ids.extend(piece.tokens);
    }
    println!("host-generated-ids: {}", join(&ids));
    println!("host-finish: {}", finish_name(&generation));
    if let Some(u) = generation.usage() {
        println!(
            "host-usage: prompt {} generated {} prefill {:.2} ms generation {:.2} ms",
            u.prompt_tokens,
            u.generated_tokens,
            u.prefill_ns as f64 / 1e6,
            u.generation_ns as f64 / 1e6
        );
    }

    ctx.clear()?;
    let never = CancelToken::new();
    ctx.decode(&sequence(&prompt, 0), &never)?;
    let sampler = Sampler::create(model, &generate::greedy_sampler())?;
    let mut ids = Vec::new();
    let mut pos = prompt.len() as i32;
    while ids.len() < o.generate as usize {
        // The row with logits: the prompt's last, then the single row of each token.
        let row = if ids.is_empty() { prompt.len() as u32 - 1 } else { 0 };
        let next = sampler.sample(ctx, row)?;
        if model.is_eog(next) {
            break;
        }
        ids.push(next);
        ctx.decode(&sequence(&[next], pos), &never)?;
        pos += 1;
    }
    println!("sampler-ids: {}", join(&ids));
    Ok(())
}

/// Chat: the model's own template, then the answer streamed piece by piece as the
/// host produces it. Then bad inputs, each a named error.
fn chat(o: &Options, question: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let messages = [ChatMessage { role: "user".into(), content: question.into() }];
    let prompt = generate::apply_chat_template(model, &messages, true, None)?;
    println!("chat-prompt: {}", prompt.replace('\n', "\\n"));
    let tokens = model.tokenize(&prompt, true, true)?;
    let stop = vec!["<|im_end|>".to_string()];
    let generation = generate::start(ctx, &params(tokens.clone(), o.generate, stop.clone(), generate::greedy_sampler()), &CancelToken::new())?;
    print!("chat-answer: ");
    let mut pieces = 0;
    loop {
        // A real plugin would poll this with its other work; here it only waits.
        generation.subscribe().block();
        match generation.next()? {
            Some(piece) => {
                pieces += 1;
                print!("{}", piece.text);
                use std::io::Write;
                let _ = std::io::stdout().flush();
            }
            None => break,
        }
    }
    println!();
    println!("chat-pieces: {pieces}");
    println!("chat-finish: {}", finish_name(&generation));
    drop(generation);

    let bad_template = generate::apply_chat_template(model, &messages, true, Some("no-such-template"));
    println!("chat-bad-template: {}", show(bad_template.map(|_| ())));
    let bad_sampler = SamplerParams { top_p: Some(2.0), ..generate::greedy_sampler() };
    println!("chat-bad-sampler: {}", show(generate::start(ctx, &params(tokens.clone(), 4, Vec::new(), bad_sampler), &CancelToken::new()).map(|_| ())));
    let bad_grammar = SamplerParams { grammar: Some(Grammar { text: "root ::= [0-9".into(), root: None }), ..generate::greedy_sampler() };
    println!("chat-bad-grammar: {}", show(Sampler::create(model, &bad_grammar).map(|_| ())));
    let too_many = generate::start(ctx, &params(tokens, 1 << 20, stop, generate::greedy_sampler()), &CancelToken::new());
    println!("chat-too-many-tokens: {}", show(too_many.map(|_| ())));
    Ok(())
}

/// Start a long generation on the host and cancel it from this event loop after
/// `cancel-after-ms`: the prefill or the token in flight stops; the context then holds
/// the prompt (if its prefill finished) plus exactly the tokens that were delivered.
fn cancel_generation(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    ctx.clear()?;
    let filler = model.tokenize(" the llama in the box", false, false)?;
    let prompt: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
    let token = CancelToken::new();
    let generation = generate::start(ctx, &params(prompt, 64, Vec::new(), generate::greedy_sampler()), &token)?;
    let timer = monotonic_clock::subscribe_duration(o.cancel_after_ms * 1_000_000);
    let (mut delivered, mut cancelled_at) = (0usize, None);
    loop {
        if cancelled_at.is_none() {
            let ready = generation.subscribe();
            if !poll::poll(&[&ready, &timer]).contains(&0) {
                token.cancel();
                cancelled_at = Some(monotonic_clock::now());
                continue;
            }
        }
        match generation.next()? {
            Some(piece) => delivered += piece.tokens.len(),
            None => break,
        }
    }
    if let Some(at) = cancelled_at {
        println!("cancel-generation-latency: cancel -> end {:.2} ms", (monotonic_clock::now() - at) as f64 / 1e6);
    }
    let usage = generation.usage().ok_or(Error::Backend("no usage after the end".into()))?;
    println!("cancel-generation-finish: {}", finish_name(&generation));
    println!("cancel-generation-delivered: {delivered} (prompt decoded: {})", usage.prompt_tokens);
    let expected = usage.prompt_tokens as i32 + delivered as i32 - 1;
    let held = ctx.seq_pos_max(0)?;
    let verdict = if held == expected && usage.generated_tokens as usize == delivered { "consistent".to_string() } else { format!("holds {held}, expected {expected}") };
    println!("cancel-generation-memory: {verdict}");
    drop(generation);
    ctx.clear()?;
    let again = generate::start(ctx, &params(filler, 4, Vec::new(), generate::greedy_sampler()), &CancelToken::new())?;
    while again.next()?.is_some() {}
    println!("after-cancel: {}", if again.finish_reason().is_some() { "ok" } else { "no finish reason" });
    Ok(())
}

/// Generate under a grammar, on the host and with a plugin-driven sampler.
fn constrained(o: &Options, grammar: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let sampler = SamplerParams { grammar: Some(Grammar { text: grammar.into(), root: None }), ..generate::greedy_sampler() };
    println!("grammar-sampler: {}", show(Sampler::create(model, &sampler).map(|_| ())));
    let prompt = model.tokenize(&o.prompt, true, true)?;
    let generation = generate::start(ctx, &params(prompt, o.generate, Vec::new(), sampler), &CancelToken::new())?;
    let mut text = String::new();
    while let Some(piece) = generation.next()? {
        text.push_str(&piece.text);
    }
    println!("grammar-generated: {text}");
    Ok(())
}

/// A reader that stops reading: the host buffers a bounded number of pieces and then
/// waits; a cancel ends the wait, and the piece it could not deliver is not kept.
fn stall_generation(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let prompt = model.tokenize(&o.prompt, true, true)?;
    let no_end = SamplerParams { logit_bias: vec![generate::LogitBias { token: model.eos().unwrap_or(0), bias: f32::NEG_INFINITY }], ..generate::greedy_sampler() };
    let token = CancelToken::new();
    let generation = generate::start(ctx, &params(prompt.clone(), 256, Vec::new(), no_end), &token)?;
    monotonic_clock::subscribe_duration(o.cancel_after_ms * 1_000_000).block();
    token.cancel();
    let mut delivered = 0;
    while let Some(piece) = generation.next()? {
        delivered += piece.tokens.len();
    }
    println!("stalled-generation: {delivered} delivered, {}", finish_name(&generation));
    let consistent = ctx.seq_pos_max(0)? == prompt.len() as i32 + delivered as i32 - 1;
    println!("stalled-generation-memory: {}", if consistent { "consistent" } else { "inconsistent" });
    Ok(())
}

/// Start a long decode, let it run for `cancel-after-ms`, cancel it from this event
/// loop, and time the cancel until the pending decode is ready.
fn cancel_long_decode(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    ctx.clear()?;
    let filler = model.tokenize(" the llama in the box", false, false)?;
    let tokens: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
    let token = CancelToken::new();
    let started = monotonic_clock::now();
    let pending = ctx.start_decode(&sequence(&tokens, 0), &token)?;
    let report = cancel_from_event_loop(&pending.subscribe(), &token, o.cancel_after_ms, started);
    println!("long-decode: {}", report.describe(&pending.finish()));
    println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
    // The same decode with the SDK's helper: a deadline of the plugin's own.
    let timeout = std::time::Duration::from_millis(o.cancel_after_ms);
    println!("timed-decode: {}", show(decode_with_timeout(ctx, &sequence(&tokens, 0), &CancelToken::new(), timeout)));
    println!("memory-after-timed: seq-pos-max={}", ctx.seq_pos_max(0)?);
    ctx.clear()
}

/// Drop a running pending-decode, generation and (with `--media`) pending-encode
/// while the pollable from its `subscribe()` is still alive, as a garbage collector
/// may: the drop stops the call, and the orphaned pollable is simply ready. Memory is
/// left as the stopped call found it.
fn drop_call_first(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let filler = model.tokenize(" the llama in the box", false, false)?;
    let tokens: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
    ctx.clear()?;
    let pending = ctx.start_decode(&sequence(&tokens, 0), &CancelToken::new())?;
    let ready = pending.subscribe();
    drop(pending);
    outlive(ready, "decode");
    println!("drop-first-decode-memory: seq-pos-max={}", ctx.seq_pos_max(0)?);

    ctx.clear()?;
    let generation = generate::start(ctx, &params(tokens.clone(), 64, Vec::new(), generate::greedy_sampler()), &CancelToken::new())?;
    let ready = generation.subscribe();
    drop(generation);
    outlive(ready, "generation");

    if let Some(projector) = &o.media {
        let media = MediaContext::open(projector, model)?;
        let image = Input::Image(Image { width: 64, height: 64, rgb: vec![128; 64 * 64 * 3] });
        let chunks = media.tokenize(&format!("look: {}", media.marker()), &[image])?;
        let chunk = chunks.iter().find(|c| c.kind() != ChunkKind::Text).ok_or(Error::Backend("no media chunk".into()))?;
        let pending = media.start_encode_chunk(chunk, &CancelToken::new())?;
        let ready = pending.subscribe();
        drop(pending);
        outlive(ready, "encode");
    }
    // The context still works after all of that.
    ctx.clear()?;
    ctx.decode(&sequence(&filler, 0), &CancelToken::new())?;
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

/// What happened when the event loop raced a call against a timer.
struct CancelReport {
    started: u64,
    cancel_at: Option<u64>,
    ready_at: u64,
}

/// Wait for `done` or `after_ms`, whichever comes first; on the timer, cancel `token`
/// and wait for the call to notice.
fn cancel_from_event_loop(done: &poll::Pollable, token: &CancelToken, after_ms: u64, started: u64) -> CancelReport {
    let timer = monotonic_clock::subscribe_duration(after_ms * 1_000_000);
    let ready = poll::poll(&[done, &timer]);
    let cancel_at = (!ready.contains(&0)).then(|| {
        let at = monotonic_clock::now();
        token.cancel();
        done.block();
        at
    });
    CancelReport { started, cancel_at, ready_at: monotonic_clock::now() }
}

impl CancelReport {
    fn describe<T>(&self, outcome: &Result<T, Error>) -> String {
        let ms = |ns: u64| ns as f64 / 1e6;
        match (outcome, self.cancel_at) {
            (Err(Error::Cancelled), Some(at)) => format!(
                "cancelled after {:.1} ms; cancel -> ready {:.2} ms",
                ms(at - self.started),
                ms(self.ready_at - at)
            ),
            (Ok(_), None) => format!("finished before the cancel, in {:.1} ms", ms(self.ready_at - self.started)),
            (Err(e), _) => format!("unexpected {e:?}"),
            (Ok(_), Some(_)) => "finished although cancelled (the cancel came after the last boundary)".into(),
        }
    }
}

/// Encode an image (or an audio clip) and cancel the encode from this event loop, then
/// encode it fully, evaluate prompt + media into the context and generate from it.
fn media(o: &Options, projector: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let media = MediaContext::open(projector, model)?;
    let input = if media.supports_vision() {
        let (width, height) = (320u32, 240u32);
        let rgb = (0..height).flat_map(|y| (0..width).flat_map(move |x| [(x * 255 / width) as u8, (y * 255 / height) as u8, 96])).collect();
        Input::Image(Image { width, height, rgb })
    } else {
        let rate = media.audio_sample_rate().unwrap_or(16_000) as f32;
        Input::Audio((0..rate as usize * 2).map(|i| (i as f32 * 440.0 * std::f32::consts::TAU / rate).sin() * 0.5).collect())
    };
    let kind = if media.supports_vision() { "image" } else { "audio" };
    let prompt = format!("{}Describe this: {}", o.prompt, media.marker());
    let chunks = media.tokenize(&prompt, &[input])?;
    let chunk = chunks.iter().find(|c| c.kind() != ChunkKind::Text).ok_or(Error::Backend("no media chunk".into()))?;
    println!("media: {kind}, {} chunks, {} embeddings", chunks.len(), chunk.n_tokens());

    let token = CancelToken::new();
    let started = monotonic_clock::now();
    let pending = media.start_encode_chunk(chunk, &token)?;
    let report = cancel_from_event_loop(&pending.subscribe(), &token, o.cancel_after_ms, started);
    println!("media-encode: {}", report.describe(&pending.finish()));

    let started = monotonic_clock::now();
    let embd = media.encode_chunk(chunk, &CancelToken::new())?;
    println!("media-full-encode: {} floats in {:.1} ms", embd.len(), (monotonic_clock::now() - started) as f64 / 1e6);

    ctx.clear()?;
    let cancelled = CancelToken::new();
    cancelled.cancel();
    let refs: Vec<&_> = chunks.iter().collect();
    println!("media-eval-cancelled: {:?}", media.eval_chunks(ctx, &refs, 0, &cancelled).err());
    println!("media-eval-memory: seq-pos-max={}", ctx.seq_pos_max(0)?);
    let n_past = media.eval_chunks(ctx, &refs, 0, &CancelToken::new())?;
    let next = greedy_next(ctx)?;
    println!("media-eval: n-past={n_past}, next-token={next}");
    // Generate on the host from there: an empty prompt continues from the last logits.
    let generation = generate::start(ctx, &params(Vec::new(), 4, Vec::new(), generate::greedy_sampler()), &CancelToken::new())?;
    let mut ids = Vec::new();
    while let Some(piece) = generation.next()? {
        ids.extend(piece.tokens);
    }
    println!("media-host-generation: {}", join(&ids));

    // Under a shared token (the embedder's, say), which may stop it at any stage.
    if let Some(capability) = &o.token {
        ctx.clear()?;
        let token = CancelToken::open_shared(capability)?;
        println!("media-eval-shared: {}", show(media.eval_chunks(ctx, &refs, 0, &token).map(|_| ())));
        println!("media-eval-shared-memory: seq-pos-max={}", ctx.seq_pos_max(0)?);
    }
    Ok(())
}

/// Decode the same batch again and again, each time cancelling it from this event loop
/// after a random delay: every decode must either finish with the reference logits or
/// be cancelled and leave memory empty.
fn soak(o: &Options, iterations: u64, model: &Model, ctx: &Context) -> Result<(), Error> {
    let filler = model.tokenize(" the llama in the box", false, false)?;
    let tokens: Vec<i32> = filler.iter().copied().cycle().take(o.long_tokens as usize).collect();
    let batch = sequence(&tokens, 0);
    let started = monotonic_clock::now();
    ctx.clear()?;
    ctx.decode(&batch, &CancelToken::new())?;
    let reference = digest::logits(&ctx.last_logits()?);
    let full_us = ((monotonic_clock::now() - started) / 1000).max(1);
    let mut rng = o.seed | 1;
    let (mut finished, mut cancelled, mut wrong) = (0u64, 0u64, 0u64);
    for _ in 0..iterations {
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
        ("seq-out-of-range", Batch { seq_ids: vec![ctx.n_seq_max() as i32], ..sequence(&good[..1], 0) }),
        ("position-gap", sequence(&good, 5)),
        ("columns-differ", Batch { positions: vec![], ..sequence(&good, 0) }),
    ];
    for (name, batch) in cases {
        println!("bad-input {name}: {}", show(ctx.decode(&batch, &never)));
    }
    println!("bad-input unknown-model: {}", show(Model::open("no-such-model").map(|_| ())));
    let params = |n_ctx: u32, n_threads: u32| ContextParams {
        n_ctx: Some(n_ctx),
        n_batch: Some(64),
        n_ubatch: None,
        n_seq_max: None,
        n_threads: Some(n_threads),
    };
    println!("bad-input huge-n-ctx: {}", show(Context::create(model, params(1 << 24, 1)).map(|_| ())));
    println!("bad-input too-many-threads: {}", show(Context::create(model, params(256, 1 << 20)).map(|_| ())));
    let shaped = |n_ctx: u32, n_batch: u32, n_ubatch: Option<u32>, n_seq_max: u32| ContextParams {
        n_ctx: Some(n_ctx),
        n_batch: Some(n_batch),
        n_ubatch,
        n_seq_max: Some(n_seq_max),
        n_threads: Some(1),
    };
    let shapes = [
        ("n-seq-max-above-n-ctx", shaped(8, 512, None, 16)),
        ("n-seq-max-above-n-batch", shaped(256, 1, None, 2)),
        ("n-ubatch-above-n-batch", shaped(256, 64, Some(128), 1)),
        ("zero-n-ctx", shaped(0, 64, None, 1)),
    ];
    for (name, shape) in shapes {
        println!("bad-input {name}: {}", show(Context::create(model, shape).map(|_| ())));
    }
    let extra: Vec<_> = (0..4).map(|_| Context::create(model, params(256, 1))).collect();
    println!("bad-input too-many-contexts: {}", show(extra.into_iter().last().unwrap().map(|_| ())));
    println!("bad-input logits-of-unrequested-row: {}", show(ctx.logits_ith(0).map(|_| ())));
    println!("good-tokens: {}", good.len());
    let after = ctx.decode(&sequence(&good, 0), &never);
    println!("good-after-bad: {}", show(after));
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
    println!("bad-input chunk-budget: {}", show(chunks.as_ref().map(|_| ()).map_err(Clone::clone)));
    if let Ok(chunks) = chunks {
        let refs: Vec<&_> = chunks.iter().collect();
        let media_chunk = chunks.iter().find(|c| c.kind() != ChunkKind::Text).ok_or(Error::Backend("no media chunk".into()))?;
        println!("bad-input foreign-chunk-encode: {}", show(other.encode_chunk(media_chunk, &never).map(|_| ())));
        println!("bad-input foreign-chunk-start-encode: {}", show(other.start_encode_chunk(media_chunk, &never).map(|_| ())));
        println!("bad-input foreign-chunk-eval: {}", show(other.eval_chunks(ctx, &refs, 0, &never).map(|_| ())));
        println!("good-own-chunk-eval: {}", show(maker.eval_chunks(ctx, &refs, 0, &never).map(|_| ())));
    }
    let padded = ContextParams { n_ctx: Some(480), n_batch: Some(64), n_ubatch: None, n_seq_max: Some(16), n_threads: Some(1) };
    println!("bad-input kv-cells-padded: {}", show(Context::create(model, padded).map(|_| ())));
    let mut tokens = Vec::new();
    let over = loop {
        match CancelToken::create() {
            Ok(token) => tokens.push(token),
            Err(e) => break e,
        }
    };
    println!("bad-input too-many-tokens: {} (after {})", show(Err(over)), tokens.len());
    Ok(())
}

fn show(r: Result<(), Error>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(Error::Cancelled) => "cancelled".into(),
        Err(Error::InvalidArgument(m)) => format!("invalid-argument: {m}"),
        Err(Error::ModelNotFound(m)) => format!("model-not-found: {m}"),
        Err(Error::LimitExceeded(m)) => format!("limit-exceeded: {m}"),
        Err(e) => format!("{e:?}"),
    }
}
