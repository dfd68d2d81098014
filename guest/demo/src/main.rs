//! The demo plugin: generates text on a model the host registered, then starts a long
//! decode and cancels it from the guest's own event loop (WASI 0.2 pollables) while the
//! decode is running inside llama.cpp.
//!
//! With `--host-generate` it also generates on the host (the `generate` interface, and
//! a plugin-driven `sampler`) and prints both token lists; with `--chat` it formats a
//! question with the model's own chat template and streams the answer; with
//! `--cancel-generation` it cancels a host-side generation from its own timer; with
//! `--token` it decodes under a token another instance (or the embedder) shared, and
//! with `--cancel-shared` it cancels one.
//!
//! What only the test suite wants of a plugin (loops, memory hogs, bad inputs, soaks)
//! is in guest/test-plugin.
//!
//! Output lines are `key: value` so tests can read them.

// The plugin world's bindings, shared by every Rust plugin (guest/sdk).
use llamabox_guest::args::Args;
use llamabox_guest::{
    argmax, decode_with_timeout, digest, filler, finish_name, greedy_next, greedy_params, llamabox,
    outcome, sequence, wasi,
};

use llamabox::inference::cancel::CancelToken;
use llamabox::inference::generate::{
    self, ChatMessage, GenerateParams, Grammar, Sampler, SamplerParams,
};
use llamabox::inference::llm::{Context, ContextParams, Model};
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
    /// A projector name: run the media scenario instead of the text one.
    media: Option<String>,
    /// A shared token's capability: run one long decode under it and report.
    token: Option<String>,
    /// A shared token's capability: cancel it and exit.
    cancel_shared: Option<String>,
    /// Generate on the host too (and with a plugin-driven sampler), printing token ids.
    host_generate: bool,
    /// A question: chat through the model's template and stream the answer.
    chat: Option<String>,
    /// Cancel a host-side generation from a timer after `cancel-after-ms`.
    cancel_generation: bool,
    /// Generate a few tokens under this GBNF grammar (through `sampler` and `start`).
    grammar: Option<String>,
}

impl Options {
    fn read(args: &mut Args) -> Result<Self, String> {
        Ok(Options {
            model: args.string("model", "default"),
            prompt: args.string("prompt", "The llama in the box"),
            generate: args.number("generate", 16)?,
            threads: args.number("threads", 1)?,
            long_tokens: args.number("long-tokens", 512)?,
            cancel_after_ms: args.number("cancel-after-ms", 20)?,
            media: args.value("media"),
            token: args.value("token"),
            cancel_shared: args.value("cancel-shared"),
            host_generate: args.switch("host-generate"),
            chat: args.value("chat"),
            cancel_generation: args.switch("cancel-generation"),
            grammar: args.value("grammar"),
        })
    }
}

fn main() {
    llamabox_guest::args::command(
        "demo",
        &["host-generate", "cancel-generation"],
        Options::read,
        run,
    );
}

fn run(o: &Options) -> Result<(), Error> {
    if let Some(capability) = &o.cancel_shared {
        let cancelled = CancelToken::open_shared(capability).map(|token| token.cancel());
        println!("cancel-shared: {}", outcome(cancelled));
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

    if let Some(projector) = &o.media {
        return media(o, projector, &model, &ctx);
    }
    if let Some(capability) = &o.token {
        let token = CancelToken::open_shared(capability)?;
        let tokens = filler(&model, o.long_tokens)?;
        println!("shared-decode: {}", outcome(ctx.decode(&sequence(&tokens, 0), &token)));
        println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
        return Ok(());
    }

    if let Some(question) = &o.chat {
        return chat(o, question, &model, &ctx);
    }
    if o.cancel_generation {
        return cancel_generation(o, &model, &ctx);
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
    println!(
        "generated: {}",
        String::from_utf8_lossy(&text).trim_start().replace('\n', "\n           ")
    );
    Ok(())
}

fn join(ids: &[i32]) -> String {
    ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
}

/// The same greedy generation as `generate`, run on the host: once as a streamed
/// generation (no logits cross the boundary), once with a sampler the plugin drives
/// row by row.
fn host_generate(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    let prompt = model.tokenize(&o.prompt, true, true)?;
    ctx.clear()?;
    let generation =
        generate::start(ctx, &greedy_params(prompt.clone(), o.generate), &CancelToken::new())?;
    let mut ids = Vec::new();
    while let Some(piece) = generation.next()? {
        ids.extend(piece.tokens);
    }
    println!("host-generated-ids: {}", join(&ids));
    println!("host-finish: {}", finish_name(generation.finish_reason()));
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
    let generation = generate::start(
        ctx,
        &GenerateParams { stop: stop.clone(), ..greedy_params(tokens.clone(), o.generate) },
        &CancelToken::new(),
    )?;
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
    println!("chat-finish: {}", finish_name(generation.finish_reason()));
    drop(generation);

    let bad_template =
        generate::apply_chat_template(model, &messages, true, Some("no-such-template"));
    println!("chat-bad-template: {}", outcome(bad_template.map(|_| ())));
    let bad_sampler = SamplerParams { top_p: Some(2.0), ..generate::greedy_sampler() };
    println!(
        "chat-bad-sampler: {}",
        outcome(
            generate::start(
                ctx,
                &GenerateParams { sampler: bad_sampler, ..greedy_params(tokens.clone(), 4) },
                &CancelToken::new()
            )
            .map(|_| ())
        )
    );
    let bad_grammar = SamplerParams {
        grammar: Some(Grammar { text: "root ::= [0-9".into(), root: None }),
        ..generate::greedy_sampler()
    };
    println!("chat-bad-grammar: {}", outcome(Sampler::create(model, &bad_grammar).map(|_| ())));
    let too_many = generate::start(
        ctx,
        &GenerateParams { stop, ..greedy_params(tokens, 1 << 20) },
        &CancelToken::new(),
    );
    println!("chat-too-many-tokens: {}", outcome(too_many.map(|_| ())));
    Ok(())
}

/// Start a long generation on the host and cancel it from this event loop after
/// `cancel-after-ms`: the prefill or the token in flight stops; the context then holds
/// the prompt (if its prefill finished) plus exactly the tokens that were delivered.
fn cancel_generation(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    ctx.clear()?;
    let prompt = filler(model, o.long_tokens)?;
    let token = CancelToken::new();
    let generation = generate::start(ctx, &greedy_params(prompt, 64), &token)?;
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
        println!(
            "cancel-generation-latency: cancel -> end {:.2} ms",
            (monotonic_clock::now() - at) as f64 / 1e6
        );
    }
    let usage = generation.usage().ok_or(Error::Backend("no usage after the end".into()))?;
    println!("cancel-generation-finish: {}", finish_name(generation.finish_reason()));
    println!("cancel-generation-delivered: {delivered} (prompt decoded: {})", usage.prompt_tokens);
    let expected = usage.prompt_tokens as i32 + delivered as i32 - 1;
    let held = ctx.seq_pos_max(0)?;
    let verdict = if held == expected && usage.generated_tokens as usize == delivered {
        "consistent".to_string()
    } else {
        format!("holds {held}, expected {expected}")
    };
    println!("cancel-generation-memory: {verdict}");
    drop(generation);
    ctx.clear()?;
    let again = generate::start(ctx, &greedy_params(filler(model, 5)?, 4), &CancelToken::new())?;
    while again.next()?.is_some() {}
    println!(
        "after-cancel: {}",
        if again.finish_reason().is_some() { "ok" } else { "no finish reason" }
    );
    Ok(())
}

/// Generate under a grammar, on the host and with a plugin-driven sampler.
fn constrained(o: &Options, grammar: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let sampler = SamplerParams {
        grammar: Some(Grammar { text: grammar.into(), root: None }),
        ..generate::greedy_sampler()
    };
    println!("grammar-sampler: {}", outcome(Sampler::create(model, &sampler).map(|_| ())));
    let prompt = model.tokenize(&o.prompt, true, true)?;
    let generation = generate::start(
        ctx,
        &GenerateParams { sampler, ..greedy_params(prompt, o.generate) },
        &CancelToken::new(),
    )?;
    let mut text = String::new();
    while let Some(piece) = generation.next()? {
        text.push_str(&piece.text);
    }
    println!("grammar-generated: {text}");
    Ok(())
}

/// Start a long decode, let it run for `cancel-after-ms`, cancel it from this event
/// loop, and time the cancel until the pending decode is ready.
fn cancel_long_decode(o: &Options, model: &Model, ctx: &Context) -> Result<(), Error> {
    ctx.clear()?;
    let tokens = filler(model, o.long_tokens)?;
    let token = CancelToken::new();
    let started = monotonic_clock::now();
    let pending = ctx.start_decode(&sequence(&tokens, 0), &token)?;
    let report = cancel_from_event_loop(&pending.subscribe(), &token, o.cancel_after_ms, started);
    println!("long-decode: {}", report.describe(&pending.finish()));
    println!("memory-after: seq-pos-max={}", ctx.seq_pos_max(0)?);
    // The same decode with the SDK's helper: a deadline of the plugin's own.
    let timeout = std::time::Duration::from_millis(o.cancel_after_ms);
    println!(
        "timed-decode: {}",
        outcome(decode_with_timeout(ctx, &sequence(&tokens, 0), &CancelToken::new(), timeout))
    );
    println!("memory-after-timed: seq-pos-max={}", ctx.seq_pos_max(0)?);
    ctx.clear()
}

/// What happened when the event loop raced a call against a timer.
struct CancelReport {
    started: u64,
    cancel_at: Option<u64>,
    ready_at: u64,
}

/// Wait for `done` or `after_ms`, whichever comes first; on the timer, cancel `token`
/// and wait for the call to notice.
fn cancel_from_event_loop(
    done: &poll::Pollable,
    token: &CancelToken,
    after_ms: u64,
    started: u64,
) -> CancelReport {
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
            (Ok(_), None) => {
                format!("finished before the cancel, in {:.1} ms", ms(self.ready_at - self.started))
            }
            (Err(e), _) => format!("unexpected {e:?}"),
            (Ok(_), Some(_)) => {
                "finished although cancelled (the cancel came after the last boundary)".into()
            }
        }
    }
}

/// Encode an image (or an audio clip) and cancel the encode from this event loop, then
/// encode it fully, evaluate prompt + media into the context and generate from it.
fn media(o: &Options, projector: &str, model: &Model, ctx: &Context) -> Result<(), Error> {
    let media = MediaContext::open(projector, model)?;
    let input = if media.supports_vision() {
        let (width, height) = (320u32, 240u32);
        let rgb = (0..height)
            .flat_map(|y| {
                (0..width)
                    .flat_map(move |x| [(x * 255 / width) as u8, (y * 255 / height) as u8, 96])
            })
            .collect();
        Input::Image(Image { width, height, rgb })
    } else {
        let rate = media.audio_sample_rate().unwrap_or(16_000) as f32;
        Input::Audio(
            (0..rate as usize * 2)
                .map(|i| (i as f32 * 440.0 * std::f32::consts::TAU / rate).sin() * 0.5)
                .collect(),
        )
    };
    let kind = if media.supports_vision() { "image" } else { "audio" };
    let prompt = format!("{}Describe this: {}", o.prompt, media.marker());
    let chunks = media.tokenize(&prompt, &[input])?;
    let chunk = chunks
        .iter()
        .find(|c| c.kind() != ChunkKind::Text)
        .ok_or(Error::Backend("no media chunk".into()))?;
    println!("media: {kind}, {} chunks, {} embeddings", chunks.len(), chunk.n_tokens());

    let token = CancelToken::new();
    let started = monotonic_clock::now();
    let pending = media.start_encode_chunk(chunk, &token)?;
    let report = cancel_from_event_loop(&pending.subscribe(), &token, o.cancel_after_ms, started);
    println!("media-encode: {}", report.describe(&pending.finish()));

    let started = monotonic_clock::now();
    let embd = media.encode_chunk(chunk, &CancelToken::new())?;
    println!(
        "media-full-encode: {} floats in {:.1} ms",
        embd.len(),
        (monotonic_clock::now() - started) as f64 / 1e6
    );

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
    let generation = generate::start(ctx, &greedy_params(Vec::new(), 4), &CancelToken::new())?;
    let mut ids = Vec::new();
    while let Some(piece) = generation.next()? {
        ids.extend(piece.tokens);
    }
    println!("media-host-generation: {}", join(&ids));

    // Under a shared token (the embedder's, say), which may stop it at any stage.
    if let Some(capability) = &o.token {
        ctx.clear()?;
        let token = CancelToken::open_shared(capability)?;
        println!(
            "media-eval-shared: {}",
            outcome(media.eval_chunks(ctx, &refs, 0, &token).map(|_| ()))
        );
        println!("media-eval-shared-memory: seq-pos-max={}", ctx.seq_pos_max(0)?);
    }
    Ok(())
}
