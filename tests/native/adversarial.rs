//! Random and adversarial calls against the native layer, the one that talks to
//! llama.cpp and mtmd: every call must return `Ok` or a named error (never abort the
//! process), and a failed call must leave the context's memory as it was.
//!
//! Seeded and bounded: `LLAMABOX_FUZZ_ITERS` calls (default 400 here; `make fuzz` runs
//! many more) from seed `LLAMABOX_FUZZ_SEED`.

use std::sync::Arc;

use llamabox_native::synthetic::SplitMix64;
use llamabox_native::{
    Batch, CancelFlag, Context, ContextParams, Error, MediaCaps, MediaContext, MediaInput, Model,
    Stop,
};

use crate::common;

/// Seeded, so a failing run can be replayed from its seed.
struct Rng(SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Mostly plausible values, sometimes the edges that break C code.
    fn int(&mut self, plausible: i64) -> i64 {
        match self.below(10) {
            0 => [-1, 0, i32::MIN as i64, i32::MAX as i64, plausible, plausible + 1]
                [self.below(6) as usize],
            1 => self.next() as i32 as i64,
            _ => self.below(plausible.max(1) as u64) as i64,
        }
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn random_batch(rng: &mut Rng, ctx: &Context, n_vocab: i64) -> Batch {
    let n = match rng.below(8) {
        0 => 0,
        1 => ctx.params().n_batch as usize + 1 + rng.below(4) as usize,
        _ => 1 + rng.below(ctx.params().n_batch as u64) as usize,
    };
    let seq = rng.int(ctx.params().n_seq_max as i64) as i32;
    let start = match rng.below(4) {
        0 => rng.int(64) as i32,
        _ => ctx.seq_pos_max(seq.clamp(0, ctx.params().n_seq_max as i32 - 1)).unwrap_or(-1) + 1,
    };
    let mut batch = Batch::sequence(
        &(0..n).map(|_| rng.below(n_vocab as u64) as i32).collect::<Vec<_>>(),
        start,
        seq,
    );
    // At most one thing wrong per batch, so valid decodes are common too.
    match rng.below(12) {
        0 => batch.logits.pop().map(drop).unwrap_or(()),
        1 => batch.positions.reverse(),
        2 if n > 1 => batch.seq_ids[n / 2] = rng.int(4) as i32,
        3 => batch.logits.iter_mut().for_each(|l| *l = true),
        4 if n > 0 => batch.tokens[rng.below(n as u64) as usize] = rng.int(n_vocab) as i32,
        5 if n > 0 => batch.positions[n - 1] = rng.int(1 << 20) as i32,
        _ => {}
    }
    batch
}

fn memory(ctx: &Context) -> Vec<i32> {
    (0..ctx.params().n_seq_max as i32).map(|s| ctx.seq_pos_max(s).unwrap()).collect()
}

#[test]
fn random_decodes_memory_ops_and_media_inputs_never_crash_or_leak_state() {
    let iters = env("LLAMABOX_FUZZ_ITERS", 400);
    let seed = env("LLAMABOX_FUZZ_SEED", 7);
    let mut rng = Rng(SplitMix64(seed));
    let model = Arc::new(Model::load(common::tiny_model()).unwrap());
    let n_vocab = model.n_vocab() as i64;
    let params = ContextParams { n_ctx: 256, n_batch: 32, n_ubatch: 8, n_seq_max: 3, n_threads: 1 };
    let mut ctx = Context::new(model.clone(), params).unwrap();
    let mut vision = MediaContext::new(common::tiny_vision(), model.clone(), 1).unwrap();
    let caps = MediaCaps { max_image_side: 256, max_audio_samples: 16_000 };
    let (mut ok, mut refused, mut cancelled) = (0u64, 0u64, 0u64);

    for i in 0..iters {
        let before = memory(&ctx);
        let result: Result<(), Error> = match rng.below(10) {
            0..=5 => {
                let batch = random_batch(&mut rng, &ctx, n_vocab);
                let token = CancelFlag::new();
                if rng.below(3) == 0 {
                    token.trip_after(1 + rng.below(200));
                }
                ctx.decode(&batch, Some(Stop::on(&token)))
            }
            6 => ctx.seq_rm(rng.int(3) as i32, rng.int(64) as i32, rng.int(64) as i32 - 1),
            7 => ctx.logits_ith(rng.int(40) as u32).map(drop),
            8 => {
                let tokens: Vec<i32> = (0..rng.below(6)).map(|_| rng.int(n_vocab) as i32).collect();
                model.detokenize(&tokens, rng.below(2) == 0, rng.below(2) == 0).map(drop)
            }
            _ => {
                let (w, h) = (rng.int(300) as u32, rng.int(300) as u32);
                let bytes =
                    (w as usize).saturating_mul(h as usize).saturating_mul(3).min(300 * 300 * 3);
                let rgb = vec![(i % 251) as u8; if rng.below(4) == 0 { bytes + 1 } else { bytes }];
                let markers = rng.below(3) as usize;
                let prompt = format!("x{}", MediaContext::marker().repeat(markers));
                vision
                    .tokenize(
                        &prompt,
                        &[MediaInput::Image { width: w, height: h, rgb }],
                        caps,
                        usize::MAX,
                    )
                    .map(drop)
            }
        };
        match &result {
            Ok(()) => ok += 1,
            Err(Error::Cancelled) => cancelled += 1,
            Err(Error::InvalidArgument(_))
            | Err(Error::ContextFull)
            | Err(Error::LimitExceeded { .. })
            | Err(Error::Grammar { .. }) => refused += 1,
            Err(e) => panic!("call {i} (seed {seed}): unexpected error {e}"),
        }
        let after = memory(&ctx);
        if result.is_err() {
            assert_eq!(
                before, after,
                "call {i} (seed {seed}) failed ({result:?}) but changed memory"
            );
        }
        if after.iter().any(|&p| p > 200) {
            ctx.clear();
        }
    }
    println!("fuzz: {iters} calls from seed {seed}: {ok} ok, {refused} refused, {cancelled} cancelled, 0 crashes");
    assert!(ok > 0 && refused > 0, "the mix must exercise both paths");
}

/// A context-params value biased to the edges: 0, 1, powers of two and their
/// neighbours (256 is llama.cpp's n-ctx padding), u32::MAX, or anything.
fn param(rng: &mut Rng) -> u32 {
    match rng.below(8) {
        0 => [0, 1, 2, u32::MAX, u32::MAX - 255, i32::MAX as u32, 256, 257][rng.below(8) as usize],
        1 => rng.next() as u32,
        n => {
            let p = 1u32 << rng.below(if n < 5 { 10 } else { 17 });
            [p - 1, p, p.saturating_add(1)][rng.below(3) as usize].max(1)
        }
    }
}

/// Create the context only when it is small enough for a test machine; otherwise only
/// the up-front check runs (which is all that stands between a guest and llama.cpp).
fn check_params(model: &Arc<Model>, params: ContextParams) -> Result<bool, Error> {
    let allocated = params.allocated_n_ctx()?;
    if allocated > 1 << 16 || params.n_threads > 2 || params.n_batch > 4096 {
        return Ok(false);
    }
    let mut ctx = Context::new(model.clone(), params)?;
    assert_eq!(
        ctx.params().n_ctx,
        allocated,
        "{params:?}: llama.cpp allocated another n-ctx than predicted"
    );
    // One token in every sequence, each with an output row: the shape llama.cpp's
    // output buffer asserts on.
    let n_seq = params.n_seq_max.min(ctx.params().n_batch) as i32;
    let batch = Batch {
        tokens: vec![1; n_seq as usize],
        positions: vec![0; n_seq as usize],
        seq_ids: (0..n_seq).collect(),
        logits: vec![true; n_seq as usize],
    };
    ctx.decode(&batch, None).unwrap_or_else(|e| panic!("{params:?}: decode failed: {e}"));
    Ok(true)
}

#[test]
fn every_context_params_combination_gives_a_context_or_a_named_error() {
    let model = Arc::new(Model::load(common::tiny_model()).unwrap());
    let p = |n_ctx, n_batch, n_ubatch, n_seq_max| ContextParams {
        n_ctx,
        n_batch,
        n_ubatch,
        n_seq_max,
        n_threads: 1,
    };
    // The shapes that aborted the host: n-seq-max above the n-batch llama.cpp settles on.
    for (params, message) in [
        (p(8, 512, 8, 16), "n-seq-max 16 needs an n-batch of at least 16 (one output row per sequence), but n-batch is 8 (n-batch 512 is cut to n-ctx 8)"),
        (p(256, 1, 1, 2), "n-seq-max 2 needs an n-batch of at least 2 (one output row per sequence), but n-batch is 1"),
        (p(256, 64, 128, 1), "n-ubatch 128 is larger than n-batch 64"),
        (p(0, 64, 64, 1), "n-ctx must be at least 1"),
        (p(u32::MAX, 64, 64, 1), "n-ctx 4294967295 padded for 1 sequences (4294967296 cells each) is above 2^32 cells"),
    ] {
        assert_eq!(check_params(&model, params), Err(Error::InvalidArgument(message.into())), "{params:?}");
    }
    // Exactly at the edges: the smallest shapes that work.
    assert_eq!(check_params(&model, p(16, 16, 1, 16)), Ok(true));
    assert_eq!(check_params(&model, p(1, 1, 1, 1)), Ok(true));
    assert_eq!(p(8, 8, 8, 1).allocated_n_ctx(), Ok(256), "n-ctx is padded to 256");
    assert_eq!(
        p(300, 64, 64, 3).allocated_n_ctx(),
        Ok(3 * 256),
        "each sequence's share is padded again"
    );
    assert_eq!(p(4096, 64, 64, 16).allocated_n_ctx(), Ok(4096));
    assert_eq!(
        p(480, 64, 64, 16).allocated_n_ctx(),
        Ok(4096),
        "16 sequences take 16 x 256 cells whatever n-ctx asks"
    );

    let seed = env("LLAMABOX_FUZZ_SEED", 11);
    let iters = env("LLAMABOX_FUZZ_ITERS", 400);
    let mut rng = Rng(SplitMix64(seed));
    let (mut created, mut refused, mut checked) = (0, 0, 0);
    for i in 0..iters {
        let params = ContextParams {
            n_ctx: param(&mut rng),
            n_batch: param(&mut rng),
            n_ubatch: param(&mut rng),
            n_seq_max: param(&mut rng),
            n_threads: param(&mut rng).min(if rng.below(2) == 0 { 1 } else { u32::MAX }),
        };
        match check_params(&model, params) {
            Ok(true) => created += 1,
            Ok(false) => checked += 1,
            Err(Error::InvalidArgument(m)) => {
                assert!(
                    !m.contains('{') && !m.contains("ContextParams"),
                    "call {i}: a Debug struct in {m:?}"
                );
                refused += 1
            }
            Err(e) => panic!("call {i} (seed {seed}) {params:?}: {e:?}"),
        }
    }
    println!("context params: {iters} from seed {seed}: {created} created, {checked} valid but too large to create here, {refused} refused");
    assert!(created > 0 && refused > 0);
}
