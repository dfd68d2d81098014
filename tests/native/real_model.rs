//! The decode contract on the real model (SmolLM2-135M Q4_1, a BPE vocabulary and
//! quantized weights), and the guest on it.

use std::sync::Arc;

use llamabox::RunOutcome;
use llamabox_native::{
    generate, Batch, CancelFlag, ChatMessage, ChatTemplate, Context, ContextParams, Error,
    FinishReason, GenerateRequest, Model, Piece, Sampler, SamplerCaps, SamplerParams, Stop,
};

use crate::common;

const PROMPT: &str = "<|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n";

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::real_model()).unwrap())
}

fn params(n_ubatch: u32) -> ContextParams {
    ContextParams { n_ctx: 512, n_batch: 128, n_ubatch, n_seq_max: 1, n_threads: 1 }
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
    let params = params(32);
    let prompt = model.tokenize(PROMPT, true, true).unwrap();
    let filler = model.tokenize(" Llamas live in the Andes and eat grass.", false, false).unwrap();
    let long: Vec<i32> = filler.iter().copied().cycle().take(96).collect();
    let first = Batch::sequence(&prompt, 0, 0);
    let second = Batch::sequence(&long, prompt.len() as i32, 0);

    let counter = CancelFlag::counting();
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
    assert!(common::bitwise_eq(got, &expected), "logits differ after a cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_on_the_real_model_matches_native_logits() {
    let out =
        common::demo_generates_on_native_logits("smollm2", common::real_model(), PROMPT, 256, "2")
            .await;
    assert!(common::field(&out, "generated").to_lowercase().contains("llama"), "{out}");
}

#[test]
fn host_generation_on_the_real_model_equals_the_greedy_loop() {
    let model = model();
    let params = params(128);
    let messages = [ChatMessage { role: "user".into(), content: "What is a llama?".into() }];
    assert!(model.chat_template().is_some(), "SmolLM2 ships a chat template");
    assert_eq!(model.apply_chat_template(&ChatTemplate::Model, &messages, true).unwrap(), PROMPT);
    let prompt = model.tokenize(PROMPT, true, true).unwrap();

    let mut plain = Context::new(model.clone(), params).unwrap();
    plain.decode(&Batch::sequence(&prompt, 0, 0), None).unwrap();
    let mut expected = Vec::new();
    for pos in prompt.len() as i32.. {
        let logits = plain.last_logits().unwrap();
        let next = (0..logits.len())
            .fold(0, |best, i| if logits[i] > logits[best] { i } else { best })
            as i32;
        if model.is_eog(next) || expected.len() == 32 {
            break;
        }
        expected.push(next);
        plain.decode(&Batch::sequence(&[next], pos, 0), None).unwrap();
    }

    let mut ctx = Context::new(model.clone(), params).unwrap();
    let mut sampler =
        Sampler::new(model.clone(), &SamplerParams::greedy(), &SamplerCaps::default()).unwrap();
    let mut pieces: Vec<Piece> = Vec::new();
    let mut sink = |p: Piece| {
        pieces.push(p);
        true
    };
    let request = GenerateRequest::new(prompt.clone(), 32);
    let outcome =
        generate(&mut ctx, &mut sampler, &request, Stop::on(&CancelFlag::new()), &mut sink)
            .unwrap();
    let got: Vec<i32> = pieces.iter().flat_map(|p| p.tokens.clone()).collect();
    assert_eq!(got, expected);
    let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(text, model.detokenize(&expected, false, false).unwrap());
    assert!(matches!(outcome.finish, FinishReason::MaxTokens | FinishReason::EndOfGeneration));
}

#[test]
fn a_cancel_in_generation_on_the_real_model_keeps_exactly_the_delivered_tokens() {
    let model = model();
    let params = params(128);
    let prompt = model.tokenize(PROMPT, true, true).unwrap();
    let greedy = SamplerParams::greedy;
    let run = |ctx: &mut Context, prompt: &[i32], max_tokens: u32, token: &CancelFlag| {
        let mut sampler = Sampler::new(model.clone(), &greedy(), &SamplerCaps::default()).unwrap();
        let mut tokens = Vec::new();
        let mut sink = |p: Piece| {
            tokens.extend(p.tokens);
            true
        };
        let request = GenerateRequest::new(prompt.to_vec(), max_tokens);
        let outcome = generate(ctx, &mut sampler, &request, Stop::on(token), &mut sink).unwrap();
        (outcome, tokens)
    };
    let counter = CancelFlag::counting();
    let (_, reference) =
        run(&mut Context::new(model.clone(), params).unwrap(), &prompt, 12, &counter);
    let all_polls = counter.polls();
    let counter = CancelFlag::counting();
    run(&mut Context::new(model.clone(), params).unwrap(), &prompt, 0, &counter);
    let prefill = counter.polls();
    let per_token = (all_polls - prefill) / reference.len() as u64;
    assert_eq!(reference.len(), 12);

    let k = 4;
    let mut ctx = Context::new(model.clone(), params).unwrap();
    let token = CancelFlag::new();
    token.trip_after(prefill + k as u64 * per_token + per_token / 2);
    let (outcome, delivered) = run(&mut ctx, &prompt, 12, &token);
    assert_eq!(outcome.finish, FinishReason::Cancelled);
    assert_eq!(delivered, reference[..k]);
    assert_eq!(
        ctx.seq_pos_max(0).unwrap() as usize,
        prompt.len() + k - 1,
        "memory: prompt + delivered tokens"
    );
    let (_, rest) = run(&mut ctx, &reference[k..k + 1], 4, &CancelFlag::new());
    assert_eq!(
        rest,
        reference[k + 1..k + 5],
        "continuing after the cancel as if it never happened"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_host_generation_on_the_real_model_equals_its_own_loop() {
    let (outcome, out) = common::run_demo(
        &[("smollm2", common::real_model())],
        &["--model", "smollm2", "--prompt", PROMPT, "--generate", "24", "--host-generate"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    let guest = common::field(&out, "generated-ids");
    assert_eq!(common::field(&out, "host-generated-ids"), guest);
    assert_eq!(common::field(&out, "sampler-ids"), guest);
    let (outcome, out) = common::run_demo(
        &[("smollm2", common::real_model())],
        &["--model", "smollm2", "--chat", "What is a llama?", "--generate", "24"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    assert_eq!(common::field(&out, "chat-prompt"), PROMPT.replace('\n', "\\n"));
    assert!(common::field(&out, "chat-answer").to_lowercase().contains("llama"), "{out}");
}
