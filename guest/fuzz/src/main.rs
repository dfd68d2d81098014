//! The fuzz plugin: random sequences of llamabox WIT calls from a seed, biased toward
//! the values that break C code (0, 1, the maximum and one past it, negatives, huge
//! lists), with handles that belong to another context, media context or model, and
//! drops in unusual orders (a model before its contexts, a media context before its
//! chunks, a token while a call under it is pending).
//!
//! `--seed N --calls M --models a,b --projectors x,y`. Every call must return `Ok` or
//! a named error; the host must never trap the plugin or abort. Prints `fuzz-*` lines.
//! `--grammars N` runs N hostile grammars (grammars.rs) instead of the call sequence.

// The plugin world's bindings, shared by every Rust plugin (guest/sdk).
use llamabox_guest::{llamabox, wasi};

mod grammars;

use std::collections::BTreeMap;

use llamabox::inference::cancel::CancelToken;
use llamabox::inference::llm::{Batch, Context, ContextParams, Model, PendingDecode};
use llamabox::inference::media::{Chunk, Image, Input, MediaContext, PendingEncode};
use llamabox::inference::types::Error;

/// SplitMix64: seeded, so a failing run replays from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    /// Mostly plausible (below `plausible`), often an edge, sometimes anything.
    fn int(&mut self, plausible: i64) -> i64 {
        match self.below(8) {
            0 => [0, 1, -1, plausible, plausible + 1, plausible - 1][self.below(6) as usize],
            1 => {
                [i32::MIN as i64, i32::MAX as i64, u32::MAX as i64, 1 << 24][self.below(4) as usize]
            }
            2 => self.next() as i32 as i64,
            _ => self.below(plausible.max(1) as u64) as i64,
        }
    }

    fn s32(&mut self, plausible: i64) -> i32 {
        self.int(plausible) as i32
    }

    fn u32(&mut self, plausible: i64) -> u32 {
        self.int(plausible) as u32
    }

    /// A list length: usually small, sometimes an edge, rarely huge.
    fn len(&mut self, plausible: usize) -> usize {
        match self.below(12) {
            0 => 0,
            1 => 1,
            2 => plausible + 1,
            3 if self.chance(4) => 100_000 + self.below(100_000) as usize,
            _ => self.below(plausible as u64 + 1) as usize,
        }
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len() as u64) as usize])
    }

    /// A name from `names`, or one in `one_in` times (and whenever `names` is empty) a
    /// name nobody registered, `missing`.
    fn name(&mut self, names: &[String], one_in: u64, missing: &str) -> String {
        match self.pick(names) {
            Some(name) if !self.chance(one_in) => name.clone(),
            _ => missing.to_string(),
        }
    }

    /// Remove a random element (a drop, in whatever order the dice say).
    fn take<T>(&mut self, items: &mut Vec<T>) -> Option<T> {
        (!items.is_empty()).then(|| items.swap_remove(self.below(items.len() as u64) as usize))
    }
}

struct Options {
    seed: u64,
    calls: u64,
    models: Vec<String>,
    projectors: Vec<String>,
    grammars: u64,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        seed: 1,
        calls: 200,
        models: vec!["default".into()],
        projectors: Vec::new(),
        grammars: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let list = |v: &str| v.split(',').filter(|s| !s.is_empty()).map(String::from).collect();
        match flag.as_str() {
            "--seed" => o.seed = value.parse().map_err(|_| format!("--seed: {value:?}"))?,
            "--calls" => o.calls = value.parse().map_err(|_| format!("--calls: {value:?}"))?,
            "--models" => o.models = list(&value),
            "--projectors" => o.projectors = list(&value),
            "--grammars" => {
                o.grammars = value.parse().map_err(|_| format!("--grammars: {value:?}"))?
            }
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    Ok(o)
}

/// Everything the plugin holds, so calls can mix handles of different owners.
#[derive(Default)]
struct Held {
    models: Vec<Model>,
    contexts: Vec<Context>,
    media: Vec<MediaContext>,
    chunks: Vec<Chunk>,
    tokens: Vec<CancelToken>,
    capabilities: Vec<String>,
    decodes: Vec<PendingDecode>,
    encodes: Vec<PendingEncode>,
}

/// Outcomes by kind, for the summary line.
#[derive(Default)]
struct Tally {
    calls: u64,
    by_kind: BTreeMap<&'static str, u64>,
    /// Distinct backend messages (not a crash, but worth a look).
    backend: BTreeMap<String, u64>,
}

impl Tally {
    fn record<T>(&mut self, result: &Result<T, Error>) {
        self.calls += 1;
        let kind = match result {
            Ok(_) => "ok",
            Err(Error::Cancelled) => "cancelled",
            Err(Error::InvalidArgument(_)) => "invalid-argument",
            Err(Error::ContextFull) => "context-full",
            Err(Error::ModelNotFound(_)) => "model-not-found",
            Err(Error::LimitExceeded(_)) => "limit-exceeded",
            Err(Error::Backend(m)) => {
                *self.backend.entry(m.clone()).or_default() += 1;
                "backend"
            }
        };
        *self.by_kind.entry(kind).or_default() += 1;
    }

    fn plain(&mut self) {
        self.record::<()>(&Ok(()));
    }
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("fuzz: {e}");
            std::process::exit(2);
        }
    };
    let mut rng = Rng(o.seed);
    let mut held = Held::default();
    let mut tally = Tally::default();
    if o.grammars > 0 {
        let model =
            Model::open(&o.models[0]).unwrap_or_else(|e| panic!("model {}: {e:?}", o.models[0]));
        let ctx = Context::create(
            &model,
            ContextParams {
                n_ctx: Some(512),
                n_batch: None,
                n_ubatch: None,
                n_seq_max: None,
                n_threads: Some(1),
            },
        )
        .unwrap_or_else(|e| panic!("context: {e:?}"));
        let slowest = (0..o.grammars)
            .map(|_| grammars::case(&mut rng, &model, &ctx, &mut tally))
            .max()
            .unwrap_or(0);
        println!("fuzz-grammar-cases: {}", o.grammars);
        println!("fuzz-grammar-slowest-ms: {slowest}");
    }
    for _ in 0..o.calls {
        step(&o, &mut rng, &mut held, &mut tally);
    }
    // Drop what is left in a random order too.
    while !(held.models.is_empty()
        && held.contexts.is_empty()
        && held.media.is_empty()
        && held.chunks.is_empty())
    {
        match rng.below(4) {
            0 => drop(rng.take(&mut held.models)),
            1 => drop(rng.take(&mut held.contexts)),
            2 => drop(rng.take(&mut held.media)),
            _ => drop(rng.take(&mut held.chunks)),
        }
    }
    let kinds: Vec<String> = tally.by_kind.iter().map(|(k, n)| format!("{k}={n}")).collect();
    println!("fuzz-seed: {}", o.seed);
    println!("fuzz-calls: {}", tally.calls);
    println!("fuzz-outcomes: {}", kinds.join(" "));
    for (message, n) in &tally.backend {
        println!("fuzz-backend: {n} x {message}");
    }
}

fn text(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "the llama",
        " ",
        "<s>",
        "</s>",
        "<unk>",
        "<__media__>",
        "\u{0}",
        "é",
        "🦙",
        "\n",
        "<|im_start|>",
        "<",
    ];
    let n = rng.len(12);
    let n = if n > 1000 { 20_000 } else { n };
    (0..n).map(|_| *rng.pick(PIECES).unwrap()).collect()
}

fn params(rng: &mut Rng) -> ContextParams {
    let mut maybe = |plausible: i64| if rng.chance(3) { None } else { Some(rng.u32(plausible)) };
    ContextParams {
        n_ctx: maybe(1024),
        n_batch: maybe(512),
        n_ubatch: maybe(512),
        n_seq_max: maybe(4),
        n_threads: maybe(2),
    }
}

fn batch(rng: &mut Rng, n_vocab: i64, ctx: Option<&Context>) -> Batch {
    let n = rng.len(24);
    let seq = rng.s32(4);
    let start = match ctx {
        Some(ctx) if !rng.chance(4) => ctx.seq_pos_max(seq.clamp(0, 3)).unwrap_or(-1) + 1,
        _ => rng.s32(64),
    };
    let mut batch = Batch {
        tokens: (0..n).map(|_| rng.below(n_vocab as u64) as i32).collect(),
        positions: (start..).take(n).collect(),
        seq_ids: vec![seq; n],
        logits: (0..n).map(|i| i + 1 == n || rng.chance(8)).collect(),
    };
    match rng.below(10) {
        0 => drop(batch.logits.pop()),
        1 => batch.positions.reverse(),
        2 if n > 1 => batch.seq_ids[n / 2] = rng.s32(4),
        3 if n > 0 => batch.tokens[rng.below(n as u64) as usize] = rng.s32(n_vocab),
        4 if n > 0 => batch.positions[n - 1] = rng.s32(1 << 20),
        _ => {}
    }
    batch
}

fn image(rng: &mut Rng) -> Input {
    let (width, height) = (rng.u32(64), rng.u32(64));
    let exact = (width as usize).saturating_mul(height as usize).saturating_mul(3);
    let len = match rng.below(6) {
        0 => exact.saturating_add(1),
        1 => exact.saturating_sub(1),
        _ => exact,
    };
    // Never ask the guest's own allocator for gigabytes: the host must refuse the size.
    let rgb = vec![rng.below(256) as u8; len.min(3 << 20)];
    Input::Image(Image { width, height, rgb })
}

fn audio(rng: &mut Rng) -> Input {
    let n = rng.len(4000).min(1 << 20);
    let mut samples: Vec<f32> = (0..n).map(|i| (i as f32 * 0.05).sin() * 0.5).collect();
    if n > 0 && rng.chance(6) {
        samples[rng.below(n as u64) as usize] =
            [f32::NAN, f32::INFINITY, 1e30][rng.below(3) as usize];
    }
    Input::Audio(samples)
}

fn token(rng: &mut Rng, capabilities: &[String], tally: &mut Tally) -> CancelToken {
    match rng.below(6) {
        0 => {
            let t = CancelToken::create();
            tally.record(&t);
            let t = t.unwrap_or_else(|_| CancelToken::new());
            t.cancel();
            t
        }
        1 if !capabilities.is_empty() => {
            let t = CancelToken::open_shared(rng.pick(capabilities).unwrap());
            tally.record(&t);
            t.unwrap_or_else(|_| CancelToken::new())
        }
        _ => CancelToken::new(),
    }
}

fn step(o: &Options, rng: &mut Rng, held: &mut Held, tally: &mut Tally) {
    let n_vocab = held.models.first().map_or(300, |m| m.n_vocab() as i64);
    match rng.below(24) {
        0 | 1 => {
            let model = Model::open(&rng.name(&o.models, 5, "no-such-model"));
            tally.record(&model);
            held.models.extend(model.ok());
        }
        2 => {
            let Some(model) = rng.pick(&held.models) else { return };
            let (add, parse) = (rng.chance(2), rng.chance(2));
            let t = text(rng);
            tally.record(&model.tokenize(&t, add, parse));
        }
        3 => {
            let Some(model) = rng.pick(&held.models) else { return };
            tally.record(&model.token_to_piece(rng.s32(n_vocab), rng.chance(2)));
            tally.record(&Ok::<_, Error>(model.is_eog(rng.s32(n_vocab))));
        }
        4 => {
            let Some(model) = rng.pick(&held.models) else { return };
            let tokens: Vec<i32> = (0..rng.len(64)).map(|_| rng.s32(n_vocab)).collect();
            tally.record(&model.detokenize(&tokens, rng.chance(2), rng.chance(2)));
        }
        5 | 6 => {
            let Some(model) = rng.pick(&held.models) else { return };
            let p = params(rng);
            let ctx = Context::create(model, p);
            tally.record(&ctx);
            held.contexts.extend(ctx.ok());
        }
        7 | 8 => {
            let Some(ctx) = rng.pick(&held.contexts) else { return };
            let b = batch(rng, n_vocab, Some(ctx));
            let t = token(rng, &held.capabilities, tally);
            tally.record(&ctx.decode(&b, &t));
        }
        9 => {
            let Some(ctx) = rng.pick(&held.contexts) else { return };
            let b = batch(rng, n_vocab, Some(ctx));
            let t = token(rng, &held.capabilities, tally);
            let pending = ctx.start_decode(&b, &t);
            tally.record(&pending);
            held.decodes.extend(pending.ok());
            if rng.chance(2) {
                t.cancel();
            }
            if rng.chance(3) {
                held.tokens.push(t); // keep it: otherwise it is dropped while the decode runs
            }
        }
        10 => {
            if let Some(p) = rng.take(&mut held.decodes) {
                if rng.chance(3) {
                    drop(p); // abandon it, finished or not
                    tally.plain();
                } else {
                    tally.record(&p.finish());
                    if rng.chance(4) {
                        tally.record(&p.finish()); // twice
                    }
                }
            }
        }
        11 => {
            let Some(ctx) = rng.pick(&held.contexts) else { return };
            let seq = rng.s32(4);
            match rng.below(7) {
                0 => tally.record(&ctx.logits_ith(rng.u32(32))),
                1 => tally.record(&ctx.last_logits()),
                2 => tally.record(&ctx.seq_rm(seq, rng.s32(64), rng.s32(64))),
                3 => tally.record(&ctx.seq_pos_max(seq)),
                4 => tally.record(&ctx.clear()),
                _ => tally.record(&Ok::<_, Error>((
                    ctx.n_ctx(),
                    ctx.n_batch(),
                    ctx.n_ubatch(),
                    ctx.n_seq_max(),
                ))),
            }
        }
        12 => {
            let t = CancelToken::create();
            tally.record(&t);
            if let Ok(t) = t {
                if rng.chance(3) {
                    let cap = t.share();
                    tally.record(&cap);
                    held.capabilities.extend(cap.ok());
                }
                held.tokens.push(t);
            }
        }
        13 => {
            let t = CancelToken::open_shared(&rng.name(
                &held.capabilities,
                3,
                "0123456789abcdef0123456789abcdef",
            ));
            tally.record(&t);
            if let Ok(t) = t {
                if rng.chance(2) {
                    t.cancel();
                }
            }
        }
        14 => {
            let Some(model) = rng.pick(&held.models) else { return };
            let media = MediaContext::open(&rng.name(&o.projectors, 6, "no-such-projector"), model);
            tally.record(&media);
            held.media.extend(media.ok());
        }
        15 | 16 => {
            let Some(media) = rng.pick(&held.media) else { return };
            let markers = rng.below(4) as usize;
            let n_inputs = if rng.chance(5) { rng.below(4) as usize } else { markers };
            let inputs: Vec<Input> = (0..n_inputs)
                .map(|_| if rng.chance(2) { image(rng) } else { audio(rng) })
                .collect();
            let prompt = format!("{}{}", text(rng), media.marker().repeat(markers));
            let chunks = media.tokenize(&prompt, &inputs);
            tally.record(&chunks);
            held.chunks.extend(chunks.unwrap_or_default());
        }
        17 | 18 => {
            // Any media context with any chunk: often one made by another media context.
            let (Some(media), Some(chunk)) = (rng.pick(&held.media), rng.pick(&held.chunks)) else {
                return;
            };
            let t = token(rng, &held.capabilities, tally);
            if rng.chance(2) {
                tally.record(&media.encode_chunk(chunk, &t));
            } else {
                let pending = media.start_encode_chunk(chunk, &t);
                tally.record(&pending);
                held.encodes.extend(pending.ok());
            }
        }
        19 => {
            if let Some(p) = rng.take(&mut held.encodes) {
                if rng.chance(3) {
                    drop(p);
                    tally.plain();
                } else {
                    tally.record(&p.finish());
                }
            }
        }
        20 => {
            let (Some(media), Some(ctx)) = (rng.pick(&held.media), rng.pick(&held.contexts)) else {
                return;
            };
            let n = rng.len(4).min(held.chunks.len() * 2);
            let chunks: Vec<&Chunk> = (0..n).filter_map(|_| rng.pick(&held.chunks)).collect();
            let t = token(rng, &held.capabilities, tally);
            tally.record(&media.eval_chunks(ctx, &chunks, rng.s32(4), &t));
        }
        21 => {
            let Some(chunk) = rng.pick(&held.chunks) else { return };
            tally.record(&Ok::<_, Error>((
                chunk.kind(),
                chunk.n_tokens(),
                chunk.n_pos(),
                chunk.text_tokens().len(),
            )));
        }
        _ => {
            // Drops in any order: a model before its contexts, a media context before
            // its chunks, a token while a call under it runs.
            match rng.below(7) {
                0 => drop(rng.take(&mut held.models)),
                1 => drop(rng.take(&mut held.contexts)),
                2 => drop(rng.take(&mut held.media)),
                3 => drop(rng.take(&mut held.chunks)),
                4 => drop(rng.take(&mut held.tokens)),
                5 => drop(rng.take(&mut held.decodes)),
                _ => drop(rng.take(&mut held.encodes)),
            }
            tally.plain();
        }
    }
}
