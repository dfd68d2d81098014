//! The decode contract on the real model (SmolLM2-135M Q4_1, a BPE vocabulary and
//! quantized weights), and the guest on it.

mod common;

use std::sync::Arc;

use llamabox::native::{Batch, CancelFlag, Context, ContextParams, Error, Model, Stop};
use llamabox::RunOutcome;

const PROMPT: &str = "<|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n";

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::real_model()).unwrap())
}

#[test]
fn real_vocabulary_round_trips() {
    let model = model();
    assert_eq!(model.n_vocab(), 49152);
    let tokens = model.tokenize(PROMPT, false, true).unwrap();
    assert_eq!(model.detokenize(&tokens, false, true).unwrap(), PROMPT);
    let plain = model.tokenize(PROMPT, false, false).unwrap();
    assert!(plain.len() > tokens.len(), "without parse-special the markers are spelled out");
    assert!(model.is_eog(model.tokenize("<|im_end|>", false, true).unwrap()[0]));
}

#[test]
fn cancel_in_second_ubatch_restores_memory_on_the_real_model() {
    let model = model();
    let params = ContextParams { n_ctx: 512, n_batch: 128, n_ubatch: 32, n_seq_max: 1, n_threads: 1 };
    let prompt = model.tokenize(PROMPT, true, true).unwrap();
    let filler = model.tokenize(" Llamas live in the Andes and eat grass.", false, false).unwrap();
    let long: Vec<i32> = filler.iter().copied().cycle().take(96).collect();
    let first = Batch::sequence(&prompt, 0, 0);
    let second = Batch::sequence(&long, prompt.len() as i32, 0);

    let counter = CancelFlag::new();
    counter.trip_after(u64::MAX);
    let mut fresh = Context::new(model.clone(), params).unwrap();
    fresh.decode(&first, None).unwrap();
    fresh.decode(&second, Some(Stop::on(&counter))).unwrap();
    let expected = fresh.logits_ith(95).unwrap().to_vec();
    let per_ubatch = counter.polls() / 3;

    let mut ctx = Context::new(model.clone(), params).unwrap();
    ctx.decode(&first, None).unwrap();
    let token = CancelFlag::new();
    token.trip_after(per_ubatch * 2 + 7); // inside the third ubatch
    assert_eq!(ctx.decode(&second, Some(Stop::on(&token))), Err(Error::Cancelled));
    assert_eq!(ctx.seq_pos_max(0).unwrap(), prompt.len() as i32 - 1);
    ctx.decode(&second, None).unwrap();
    let got = ctx.logits_ith(95).unwrap();
    assert!(got.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "logits differ after a cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_on_the_real_model_matches_native_logits() {
    let path = common::real_model();
    let (outcome, out) = common::run_demo(
        &[("smollm2", path)],
        &["--model", "smollm2", "--prompt", PROMPT, "--generate", "8", "--long-tokens", "256", "--cancel-after-ms", "2"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success);
    assert_eq!(common::field(&out, "prompt-logits"), common::native_prompt_digest(path, PROMPT, 256));
    assert_eq!(common::field(&out, "generated-tokens"), "8");
    assert!(common::field(&out, "generated").to_lowercase().contains("llama"), "{out}");
}
