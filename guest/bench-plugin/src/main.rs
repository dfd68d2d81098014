//! The benchmark plugin (`make bench`, bench/): does exactly the work the benchmark
//! times natively and times it itself, with `wasi:clocks/monotonic-clock` around the
//! measured calls only, so instantiation, context creation, clearing and printing are
//! not in the figures.
//!
//! ```text
//! llamabox-bench-plugin decode   --model M --tokens N --runs R --mode blocking|pending ...
//! llamabox-bench-plugin generate --model M --tokens N --runs R [--sample wasm|host] ...
//! llamabox-bench-plugin host-generate --model M --tokens N --runs R ...
//! llamabox-bench-plugin boundary --model M --tokens N --iters I ...
//! llamabox-bench-plugin noop
//! ```
//! Common options: `--threads T --ctx C --batch B` (context parameters, set by the host
//! so both sides build the same context), `--ubatch host` to leave n-ubatch to the host
//! (which may then make the context a seat of a batch). Output: one `key: value` line
//! per measurement.

// The plugin world's bindings, shared by every Rust plugin (guest/sdk).
use llamabox_guest::args::Args;
use llamabox_guest::{argmax, digest, llamabox, sequence, wasi};

use llamabox::inference::cancel::CancelToken;
use llamabox::inference::generate::{self, GenerateParams, Sampler};
use llamabox::inference::llm::{Batch, Context, ContextParams, Model};
use llamabox::inference::types::Error;
use wasi::clocks::monotonic_clock;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Decode,
    Generate,
    HostGenerate,
    Boundary,
    Noop,
}

struct Options {
    mode: Mode,
    model: String,
    tokens: u32,
    runs: u32,
    pending: bool,
    /// `generate`: pick each token on the host (`sampler.sample`) instead of in wasm.
    host_sampler: bool,
    iters: u32,
    threads: u32,
    ctx: u32,
    batch: u32,
    /// Leave n-ubatch unset: the host may batch the context with others' (a seat).
    host_ubatch: bool,
}

impl Options {
    fn read(args: &mut Args) -> Result<Self, String> {
        let mode = match args.word().as_deref() {
            Some("decode") => Mode::Decode,
            Some("generate") => Mode::Generate,
            Some("host-generate") => Mode::HostGenerate,
            Some("boundary") => Mode::Boundary,
            Some("noop") => Mode::Noop,
            other => {
                return Err(format!(
                    "expected decode|generate|host-generate|boundary|noop, got {other:?}"
                ))
            }
        };
        Ok(Options {
            mode,
            model: args.string("model", "default"),
            tokens: args.number("tokens", 512)?,
            runs: args.number("runs", 5)?,
            pending: args.either("mode", "blocking", "pending")?,
            host_sampler: args.either("sample", "wasm", "host")?,
            iters: args.number("iters", 10_000)?,
            threads: args.number("threads", 1)?,
            ctx: args.number("ctx", 1024)?,
            batch: args.number("batch", 512)?,
            host_ubatch: args.either("ubatch", "set", "host")?,
        })
    }
}

fn main() {
    llamabox_guest::args::command("bench-plugin", &[], Options::read, run);
}

fn run(o: &Options) -> Result<(), Error> {
    if o.mode == Mode::Noop {
        return Ok(());
    }
    let model = Model::open(&o.model)?;
    let params = ContextParams {
        n_ctx: Some(o.ctx),
        n_batch: Some(o.batch),
        n_ubatch: (!o.host_ubatch).then_some(o.batch),
        n_seq_max: Some(1),
        n_threads: Some(o.threads),
    };
    let ctx = Context::create(&model, params)?;
    let n_vocab = model.n_vocab();
    match o.mode {
        Mode::Decode => decode(o, &ctx, n_vocab),
        Mode::Generate => generate(o, &model, &ctx, n_vocab),
        Mode::HostGenerate => host_generate(o, &ctx, n_vocab),
        Mode::Boundary => boundary(o, &ctx, n_vocab),
        Mode::Noop => Ok(()),
    }
}

/// `--runs` decodes of the same `--tokens`-token batch on a cleared context, each timed
/// around the decode call only (blocking `decode`, or `start-decode`, wait on its
/// pollable, `finish`, as an event loop would).
fn decode(o: &Options, ctx: &Context, n_vocab: u32) -> Result<(), Error> {
    let batch = sequence(&bench_tokens(o.tokens, n_vocab), 0);
    let token = CancelToken::new();
    for _ in 0..o.runs {
        ctx.clear()?;
        let start = monotonic_clock::now();
        if o.pending {
            let pending = ctx.start_decode(&batch, &token)?;
            pending.subscribe().block();
            pending.finish()?;
        } else {
            ctx.decode(&batch, &token)?;
        }
        let ns = monotonic_clock::now() - start;
        let logits = ctx.logits_ith(o.tokens - 1)?;
        println!("run: ns={ns} logits={:016x}", digest::logits(&logits));
    }
    Ok(())
}

/// Greedy generation of `--tokens` tokens after an 8-token prompt, as a plugin does it:
/// one-token decode, then the next token from the row's logits: `logits-ith` (n_vocab
/// floats out) and argmax in wasm, or with `--sample host` the host's greedy sampler
/// (`sampler.sample`: no logits cross). A one-token generation warms the context up
/// first (as llama-bench's tg warm-up), untimed.
fn generate(o: &Options, model: &Model, ctx: &Context, n_vocab: u32) -> Result<(), Error> {
    let sampler =
        o.host_sampler.then(|| Sampler::create(model, &generate::greedy_sampler())).transpose()?;
    let pick = |row: u32| match &sampler {
        Some(sampler) => sampler.sample(ctx, row),
        None => Ok(argmax(&ctx.logits_ith(row)?)),
    };
    greedy(ctx, n_vocab, 1, &pick)?;
    for _ in 0..o.runs {
        let (ns, generated) = greedy(ctx, n_vocab, o.tokens, &pick)?;
        println!("run: ns={ns} tokens={:016x}", digest::tokens(&generated));
    }
    Ok(())
}

/// Decode the prompt on a cleared context, then generate `n` tokens, each picked from
/// its decode's one row by `pick`; the nanoseconds from the first generated token's
/// decode to the last one's pick, and the tokens.
fn greedy(
    ctx: &Context,
    n_vocab: u32,
    n: u32,
    pick: &dyn Fn(u32) -> Result<i32, Error>,
) -> Result<(u64, Vec<i32>), Error> {
    let token = CancelToken::new();
    ctx.clear()?;
    ctx.decode(&sequence(&bench_tokens(PROMPT_TOKENS, n_vocab), 0), &token)?;
    let mut next = pick(PROMPT_TOKENS - 1)?;
    let mut generated = Vec::with_capacity(n as usize);
    let start = monotonic_clock::now();
    for pos in PROMPT_TOKENS..PROMPT_TOKENS + n {
        generated.push(next);
        ctx.decode(&sequence(&[next], pos as i32), &token)?;
        next = pick(0)?;
    }
    Ok((monotonic_clock::now() - start, generated))
}

/// The same greedy generation as `generate`, run by the host (`generate.start`): the
/// decode → sample loop stays on the context's thread and only pieces cross the
/// boundary. Prints the host's own generation time (`usage.generation-ns`: from the end
/// of the prefill to the last token, the span `generate` times), the tokens' digest
/// (equal to `generate`'s unless the model hits end-of-generation, which the host stops
/// at: `generated` says how many came), and the bytes that crossed into the guest per
/// token (text plus 4 bytes per token id; the list headers are not counted).
fn host_generate(o: &Options, ctx: &Context, n_vocab: u32) -> Result<(), Error> {
    host_greedy(ctx, n_vocab, 1)?;
    for _ in 0..o.runs {
        let (ns, generated, bytes) = host_greedy(ctx, n_vocab, o.tokens)?;
        let per_token = bytes as f64 / generated.len().max(1) as f64;
        println!(
            "run: ns={ns} tokens={:016x} generated={} bytes-per-token={per_token:.1}",
            digest::tokens(&generated),
            generated.len()
        );
    }
    Ok(())
}

fn host_greedy(ctx: &Context, n_vocab: u32, n: u32) -> Result<(u64, Vec<i32>, usize), Error> {
    ctx.clear()?;
    let sampler = generate::greedy_sampler();
    let params = GenerateParams {
        prompt: bench_tokens(PROMPT_TOKENS, n_vocab),
        seq: 0,
        max_tokens: n,
        stop: Vec::new(),
        sampler,
        logprobs: None,
    };
    let generation = generate::start(ctx, &params, &CancelToken::new())?;
    let (mut generated, mut bytes) = (Vec::with_capacity(n as usize), 0);
    while let Some(piece) = generation.next()? {
        bytes += piece.text.len() + 4 * piece.tokens.len();
        generated.extend(piece.tokens);
    }
    let ns = generation.usage().map_or(0, |u| u.generation_ns);
    Ok((ns, generated, bytes))
}

/// What crossing the component boundary costs, in nanoseconds per call. Calls are timed
/// in batches (the clock is itself an import: a batch of cheap calls keeps it out of the
/// figure); the median and the fastest batch are printed, since on a shared machine a
/// call that hands work to another thread sometimes waits for that thread's core.
fn boundary(o: &Options, ctx: &Context, n_vocab: u32) -> Result<(), Error> {
    let token = CancelToken::new();
    // Calls that go to the context's worker thread take microseconds: one per batch.
    let heavy = (o.iters / 10).max(100);
    report("empty-import", o.iters / 100, 100, || {
        std::hint::black_box(token.is_cancelled());
        Ok(())
    })?;
    report("worker-round-trip", heavy, 1, || ctx.seq_pos_max(0).map(drop))?;

    let cancelled = CancelToken::new();
    cancelled.cancel();
    let one = sequence(&bench_tokens(1, n_vocab), 0);
    let many = sequence(&bench_tokens(o.tokens, n_vocab), 0);
    let refused = |batch: &Batch| match ctx.decode(batch, &cancelled) {
        Err(Error::Cancelled) => Ok(()),
        other => {
            Err(Error::Backend(format!("a cancelled token must refuse the decode, got {other:?}")))
        }
    };
    report("decode-cancelled-1", heavy, 1, || refused(&one))?;
    report(&format!("decode-cancelled-{}", o.tokens), heavy, 1, || refused(&many))?;

    ctx.clear()?;
    ctx.decode(&one, &token)?;
    report("logits-ith", heavy, 1, || ctx.logits_ith(0).map(drop))?;
    // Not a boundary call, but what a generating plugin does with the logits each token.
    let logits = ctx.logits_ith(0)?;
    report("argmax-in-wasm", heavy, 1, || {
        std::hint::black_box(argmax(std::hint::black_box(&logits)));
        Ok(())
    })?;
    println!("n-vocab: {n_vocab}");
    Ok(())
}

/// Time `batches` batches of `per_batch` calls; print the median and the fastest batch's
/// nanoseconds per call.
fn report(
    name: &str,
    batches: u32,
    per_batch: u32,
    mut call: impl FnMut() -> Result<(), Error>,
) -> Result<(), Error> {
    let mut per_call = Vec::with_capacity(batches as usize);
    for _ in 0..batches.max(1) {
        let start = monotonic_clock::now();
        for _ in 0..per_batch {
            call()?;
        }
        per_call.push((monotonic_clock::now() - start) as f64 / per_batch as f64);
    }
    per_call.sort_by(f64::total_cmp);
    let median = per_call[per_call.len() / 2];
    println!("boundary: {name} median-ns={median:.1} min-ns={:.1}", per_call[0]);
    Ok(())
}

/// Tokens of the generation prompt.
const PROMPT_TOKENS: u32 = 8;

/// The benchmark's token stream: a fixed multiplicative hash of the index, so the guest
/// and the native side (bench/src/workload.rs) decode the same tokens without passing
/// them around. What the tokens are does not change how long a decode takes.
fn bench_tokens(n: u32, n_vocab: u32) -> Vec<i32> {
    (0..n as u64).map(|i| ((i * 2_654_435_761 + 12_345) % n_vocab as u64) as i32).collect()
}
