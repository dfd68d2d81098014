//! A plugin as its author built it against `llamabox:inference@0.1.0`: bindings from the
//! released text in `wit/released/0.1.0`, not from `wit/`, and no SDK (the SDK follows
//! the current version). It generates greedily on the host and cancels a decode, and
//! prints `key: value` lines the tests compare with a current plugin's.
//!
//! Arguments: `--model NAME --prompt TEXT --generate N`.

wit_bindgen::generate!({
    // Its `deps` is a link to wit/deps: WASI 0.2.12, which 0.1.0 was built on too.
    path: "../../wit/released/0.1.0",
    world: "llamabox:inference/plugin@0.1.0",
    generate_all,
});

use llamabox::inference::cancel::CancelToken;
use llamabox::inference::generate::{self, FinishReason, GenerateParams};
use llamabox::inference::llm::{Batch, Context, ContextParams, Model};
use llamabox::inference::types::Error;

fn main() {
    if let Err(e) = run() {
        eprintln!("compat plugin failed: {e:?}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let arg =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let model = Model::open(&arg("--model").unwrap_or_else(|| "default".into()))?;
    let prompt = model.tokenize(&arg("--prompt").unwrap_or_default(), true, true)?;
    let max_tokens = arg("--generate").and_then(|n| n.parse().ok()).unwrap_or(8);
    let params = ContextParams {
        n_ctx: Some(1024),
        n_batch: Some(512),
        n_ubatch: None,
        n_seq_max: Some(1),
        n_threads: Some(1),
    };
    let ctx = Context::create(&model, params)?;

    let params = GenerateParams {
        prompt: prompt.clone(),
        seq: 0,
        max_tokens,
        stop: Vec::new(),
        sampler: generate::greedy_sampler(),
        logprobs: None,
    };
    let generation = generate::start(&ctx, &params, &CancelToken::new())?;
    let mut ids = Vec::new();
    while let Some(piece) = generation.next()? {
        ids.extend(piece.tokens);
    }
    let ids: Vec<String> = ids.iter().map(i32::to_string).collect();
    println!("host-generated-ids: {}", ids.join(","));
    let finish = match generation.finish_reason() {
        Some(FinishReason::MaxTokens) => "max-tokens",
        Some(FinishReason::EndOfGeneration) => "end-of-generation",
        Some(FinishReason::Stop(_)) => "stop",
        Some(FinishReason::Cancelled) => "cancelled",
        None => "none",
    };
    println!("host-finish: {finish}");

    // A decode under a token cancelled before it starts: `cancelled`, memory untouched.
    ctx.clear()?;
    let cancel = CancelToken::new();
    cancel.cancel();
    let batch = Batch {
        positions: (0..prompt.len() as i32).collect(),
        seq_ids: vec![0; prompt.len()],
        logits: vec![false; prompt.len()],
        tokens: prompt,
    };
    let outcome = match ctx.decode(&batch, &cancel) {
        Err(Error::Cancelled) => "cancelled",
        Ok(()) => "ok",
        Err(_) => "error",
    };
    println!("cancelled-decode: {outcome}, seq-pos-max={}", ctx.seq_pos_max(0)?);
    Ok(())
}
