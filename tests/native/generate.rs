//! Host-side generation, samplers, chat templates and embeddings, on generated models
//! with 1 thread: greedy generation equal to a plain greedy loop, seeded sampling, a
//! grammar, deterministic cancels in the prefill and in generation (memory holds the
//! prompt plus exactly the delivered tokens), and named errors for bad input. Then the
//! same through the demo plugin.

use std::sync::Arc;

use llamabox::RunOutcome;
use llamabox_native::{
    generate, Batch, CancelFlag, ChatMessage, ChatTemplate, ChunkKind, Context, ContextParams,
    Error, FinishReason, GenerateRequest, Grammar, GrammarSyntax, MediaCaps, MediaContext,
    MediaInput, Model, Outcome, Piece, Pooling, Sampler, SamplerCaps, SamplerParams, Stop, Token,
};

use crate::common;

fn params() -> ContextParams {
    ContextParams { n_ctx: 512, n_batch: 64, n_ubatch: 64, n_seq_max: 4, n_threads: 1 }
}

fn load(path: &std::path::Path) -> Arc<Model> {
    Arc::new(Model::load(path).unwrap())
}

fn prompt(model: &Model) -> Vec<Token> {
    model.tokenize("The llama in the box is", true, false).unwrap()
}

/// A prompt longer than n-batch, so the prefill runs in several decodes.
fn long_prompt(model: &Model) -> Vec<Token> {
    let filler = model.tokenize(" the llama in the box", false, false).unwrap();
    filler.iter().copied().cycle().take(150).collect()
}

/// Run one generation, collecting every piece.
fn run(
    ctx: &mut Context,
    sampler: &SamplerParams,
    request: &GenerateRequest,
    token: &CancelFlag,
) -> (Result<Outcome, Error>, Vec<Piece>) {
    let mut sampler = Sampler::new(ctx.model().clone(), sampler, &SamplerCaps::default()).unwrap();
    let mut pieces = Vec::new();
    let mut sink = |p: Piece| {
        pieces.push(p);
        true
    };
    let outcome = generate(ctx, &mut sampler, request, Stop::on(token), &mut sink);
    (outcome, pieces)
}

fn tokens_of(pieces: &[Piece]) -> Vec<Token> {
    pieces.iter().flat_map(|p| p.tokens.iter().copied()).collect()
}

fn text_of(pieces: &[Piece]) -> String {
    pieces.iter().map(|p| p.text.as_str()).collect()
}

/// Greedy decoding as a plugin would write it: decode, argmax, decode, ...
fn greedy_loop(model: &Arc<Model>, prompt: &[Token], n: usize) -> Vec<Token> {
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    for (i, piece) in prompt.chunks(params().n_batch as usize).enumerate() {
        ctx.decode(&Batch::sequence(piece, (i * params().n_batch as usize) as i32, 0), None)
            .unwrap();
    }
    let mut out = Vec::new();
    let mut pos = prompt.len() as i32;
    while out.len() < n {
        let logits = ctx.last_logits().unwrap();
        let next = (0..logits.len())
            .fold(0, |best, i| if logits[i] > logits[best] { i } else { best })
            as Token;
        if model.is_eog(next) {
            break;
        }
        out.push(next);
        ctx.decode(&Batch::sequence(&[next], pos, 0), None).unwrap();
        pos += 1;
    }
    out
}

#[test]
fn greedy_generation_equals_the_plain_greedy_loop() {
    for path in [common::tiny_model(), common::slow_model()] {
        let model = load(path);
        for prompt in [prompt(&model), long_prompt(&model)] {
            let expected = greedy_loop(&model, &prompt, 24);
            let mut ctx = Context::new(model.clone(), params()).unwrap();
            let (outcome, pieces) = run(
                &mut ctx,
                &SamplerParams::greedy(),
                &GenerateRequest::new(prompt.clone(), 24),
                &CancelFlag::new(),
            );
            let outcome = outcome.unwrap();
            assert_eq!(tokens_of(&pieces), expected);
            assert_eq!(outcome.usage.prompt_tokens as usize, prompt.len());
            assert_eq!(outcome.usage.generated_tokens as usize, expected.len());
            if expected.len() == 24 {
                assert_eq!(outcome.finish, FinishReason::MaxTokens);
            }
            assert_eq!(
                ctx.seq_pos_max(0).unwrap() as usize,
                prompt.len() + expected.len() - 1,
                "memory: prompt + delivered"
            );
            assert_eq!(text_of(&pieces), String::from_utf8_lossy(&bytes_of(&model, &expected)));
        }
    }
}

fn bytes_of(model: &Model, tokens: &[Token]) -> Vec<u8> {
    tokens.iter().flat_map(|&t| model.token_to_piece(t, false).unwrap()).collect()
}

/// A seeded draw at a high temperature, with end-of-generation banned (logit bias -inf)
/// so that a run always yields its full count.
fn seeded(model: &Model, seed: u32) -> SamplerParams {
    SamplerParams {
        temperature: Some(1.5),
        top_k: Some(200),
        seed: Some(seed),
        logit_bias: vec![(model.eos().unwrap(), f32::NEG_INFINITY)],
        ..SamplerParams::default()
    }
}

/// Log-probabilities are the raw logits' softmax at each delivered token's position,
/// whatever the sampler did: replayed decode by decode on a fresh context (the same
/// shapes, so the same logits), `token_logprob` of those logits gives them exactly.
#[test]
fn logprobs_are_the_models_own_distribution_at_each_delivered_token() {
    let model = load(common::tiny_model());
    let prompt = prompt(&model);
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let asked = GenerateRequest { logprobs: Some(4), ..GenerateRequest::new(prompt.clone(), 24) };
    let (outcome, pieces) = run(&mut ctx, &seeded(&model, 5), &asked, &CancelFlag::new());
    outcome.unwrap();
    let delivered = tokens_of(&pieces);
    assert_eq!(delivered.len(), 24);
    for p in &pieces {
        assert_eq!(
            p.logprobs.iter().map(|l| l.token).collect::<Vec<_>>(),
            p.tokens,
            "one entry per token, in order"
        );
    }
    let got: Vec<_> = pieces.iter().flat_map(|p| p.logprobs.iter().cloned()).collect();
    let mut replay = Context::new(model.clone(), params()).unwrap();
    replay.decode(&Batch::sequence(&prompt, 0, 0), None).unwrap();
    let mut below_the_top = 0;
    for (k, (&token, entry)) in delivered.iter().zip(&got).enumerate() {
        let expected = llamabox_native::token_logprob(replay.last_logits().unwrap(), token, 4);
        assert_eq!(entry, &expected, "token {k}");
        assert!(
            entry.logprob <= 0.0
                && entry.top.len() == 4
                && entry.top.windows(2).all(|w| w[0].1 >= w[1].1)
        );
        below_the_top += usize::from(entry.top[0].0 != token);
        replay.decode(&Batch::sequence(&[token], (prompt.len() + k) as i32, 0), None).unwrap();
    }
    // The draw at temperature 1.5 picked tokens the model did not favour: what is
    // reported is the model's distribution, not the sampler's choice.
    assert!(below_the_top > 0, "every drawn token was the model's favourite");
    // Not asked for: no entries.
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let (_, plain) = run(
        &mut ctx,
        &seeded(&model, 5),
        &GenerateRequest::new(prompt.clone(), 4),
        &CancelFlag::new(),
    );
    assert!(plain.iter().all(|p| p.logprobs.is_empty()));
    // Over the bound: refused before anything runs.
    let over = GenerateRequest { logprobs: Some(21), ..GenerateRequest::new(prompt, 4) };
    assert!(matches!(
        run(&mut ctx, &SamplerParams::greedy(), &over, &CancelFlag::new()).0,
        Err(Error::InvalidArgument(_))
    ));
}

/// The token whose piece is exactly `text`.
fn token_for(model: &Model, text: &[u8]) -> Token {
    (0..model.n_vocab() as Token)
        .find(|&t| model.token_to_piece(t, false).unwrap() == text)
        .unwrap()
}

#[test]
fn seeded_sampling_is_reproducible_and_seeds_differ() {
    let model = load(common::tiny_model());
    let generate_with = |seed| {
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        let (outcome, pieces) = run(
            &mut ctx,
            &seeded(&model, seed),
            &GenerateRequest::new(prompt(&model), 32),
            &CancelFlag::new(),
        );
        outcome.unwrap();
        tokens_of(&pieces)
    };
    let a = generate_with(7);
    assert_eq!(a.len(), 32);
    assert_eq!(a, generate_with(7), "same seed, same tokens");
    assert_ne!(a, generate_with(8), "another seed, other tokens");
    assert_ne!(
        a,
        greedy_loop(&model, &prompt(&model), 32),
        "sampling at temperature 1.5 is not greedy"
    );
}

#[test]
fn a_digits_only_grammar_yields_only_digits() {
    let model = load(common::tiny_model());
    let grammar = Grammar { text: "root ::= [0-9]+".into(), root: None };
    for seed in 1..4 {
        let sampler = SamplerParams { grammar: Some(grammar.clone()), ..seeded(&model, seed) };
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        let (outcome, pieces) =
            run(&mut ctx, &sampler, &GenerateRequest::new(prompt(&model), 12), &CancelFlag::new());
        assert_eq!(outcome.unwrap().usage.generated_tokens, 12);
        let text = text_of(&pieces);
        assert!(
            !text.is_empty() && text.chars().all(|c| c.is_ascii_digit()),
            "not only digits: {text:?}"
        );
    }
}

#[test]
fn a_stop_string_ends_generation_and_is_not_delivered() {
    let model = load(common::tiny_model());
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let (_, reference) = run(
        &mut ctx,
        &SamplerParams::greedy(),
        &GenerateRequest::new(prompt(&model), 24),
        &CancelFlag::new(),
    );
    let full = text_of(&reference);
    // A stop string from the middle of the greedy text, crossing token boundaries.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 10, "the tiny model's greedy text is too short: {full:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let at = full.find(&stop).unwrap();

    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let stops = vec!["never appears".to_string(), stop.clone()];
    let req = GenerateRequest { stop: stops, ..GenerateRequest::new(prompt(&model), 24) };
    let (outcome, pieces) = run(&mut ctx, &SamplerParams::greedy(), &req, &CancelFlag::new());
    let outcome = outcome.unwrap();
    assert_eq!(outcome.finish, FinishReason::Stop { index: 1 });
    assert_eq!(text_of(&pieces), full[..at], "text up to the stop string, not including it");
    let delivered = tokens_of(&pieces);
    assert_eq!(
        delivered,
        tokens_of(&reference)[..delivered.len()],
        "the same tokens, up to the stop"
    );
    assert_eq!(ctx.seq_pos_max(0).unwrap() as usize, prompt(&model).len() + delivered.len() - 1);
}

/// Polls of the abort callback in a prefill of `prompt` and in one generated token.
fn polls(model: &Arc<Model>, prompt: &[Token]) -> (u64, u64) {
    common::prefill_and_token_polls(|max_tokens, counter| {
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        run(
            &mut ctx,
            &SamplerParams::greedy(),
            &GenerateRequest::new(prompt.to_vec(), max_tokens),
            counter,
        )
        .0
        .unwrap();
    })
}

#[test]
fn a_cancel_in_the_prefill_leaves_memory_as_before_and_the_next_generation_as_if_never_run() {
    let model = load(common::tiny_model());
    let before = prompt(&model);
    let long = long_prompt(&model);
    let (prefill_polls, _) = polls(&model, &long);
    let per_decode = prefill_polls / 3; // 150 tokens in n-batch 64: three decodes
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    ctx.decode(&Batch::sequence(&before, 0, 0), None).unwrap();

    // Cancelled inside the second of the prefill's three decodes.
    let token = CancelFlag::new();
    token.trip_after(per_decode + 5);
    let request = GenerateRequest { prompt: long.clone(), ..GenerateRequest::new(Vec::new(), 8) };
    let (outcome, pieces) = run(&mut ctx, &SamplerParams::greedy(), &request, &token);
    let outcome = outcome.unwrap();
    assert_eq!(outcome.finish, FinishReason::Cancelled);
    assert_eq!(token.polls(), per_decode + 5, "stopped at the poll that tripped the byte");
    assert_eq!((outcome.usage.prompt_tokens, outcome.usage.generated_tokens), (0, 0));
    assert!(pieces.is_empty());
    assert_eq!(ctx.seq_pos_max(0).unwrap() as usize, before.len() - 1, "memory as before the call");

    // The same generation again gives what an uncancelled context gives.
    let (outcome, pieces) = run(&mut ctx, &SamplerParams::greedy(), &request, &CancelFlag::new());
    outcome.unwrap();
    let expected = greedy_loop(&model, &[before.clone(), long].concat(), 8);
    assert_eq!(tokens_of(&pieces), expected);
}

#[test]
fn a_cancel_in_generation_keeps_exactly_the_delivered_tokens() {
    let model = load(common::tiny_model());
    let prompt = prompt(&model);
    let (prefill, per_token) = polls(&model, &prompt);
    let reference = greedy_loop(&model, &prompt, 12);
    assert_eq!(reference.len(), 12);
    for k in [0usize, 1, 5] {
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        let token = CancelFlag::new();
        // In the middle of the decode of generated token k (0-based).
        token.trip_after(prefill + k as u64 * per_token + per_token / 2);
        let (outcome, pieces) = run(
            &mut ctx,
            &SamplerParams::greedy(),
            &GenerateRequest::new(prompt.clone(), 12),
            &token,
        );
        let outcome = outcome.unwrap();
        assert_eq!(outcome.finish, FinishReason::Cancelled);
        assert_eq!(tokens_of(&pieces), reference[..k], "tokens delivered before the cancel");
        assert_eq!(outcome.usage.generated_tokens as usize, k);
        assert_eq!(
            ctx.seq_pos_max(0).unwrap() as usize,
            prompt.len() + k - 1,
            "memory: prompt + delivered tokens"
        );

        // Continue from memory with the token that was in flight: greedy picks the rest.
        let (outcome, pieces) = run(
            &mut ctx,
            &SamplerParams::greedy(),
            &GenerateRequest::new(vec![reference[k]], 4),
            &CancelFlag::new(),
        );
        outcome.unwrap();
        assert_eq!(
            tokens_of(&pieces),
            reference[k + 1..k + 5],
            "continuing after a cancel as if it never happened"
        );
    }
}

#[test]
fn a_sink_that_refuses_a_piece_cancels_and_the_token_is_not_kept() {
    let model = load(common::tiny_model());
    let prompt = prompt(&model);
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let mut sampler =
        Sampler::new(model.clone(), &SamplerParams::greedy(), &SamplerCaps::default()).unwrap();
    let mut delivered = 0;
    let mut sink = |_: Piece| {
        delivered += 1;
        delivered <= 3
    };
    let outcome = generate(
        &mut ctx,
        &mut sampler,
        &GenerateRequest::new(prompt.clone(), 12),
        Stop::on(&CancelFlag::new()),
        &mut sink,
    )
    .unwrap();
    assert_eq!((outcome.finish, outcome.usage.generated_tokens), (FinishReason::Cancelled, 3));
    assert_eq!(ctx.seq_pos_max(0).unwrap() as usize, prompt.len() + 3 - 1);
}

#[test]
fn bad_sampler_parameters_and_grammars_are_named_errors() {
    let model = load(common::tiny_model());
    let caps = SamplerCaps::default();
    let bad = |p: SamplerParams| match Sampler::new(model.clone(), &p, &caps) {
        Err(Error::InvalidArgument(m)) => m,
        Err(e @ Error::Grammar { syntax: GrammarSyntax::Gbnf, .. }) => e.to_string(),
        Err(e) => panic!("expected invalid-argument, got {e:?}"),
        Ok(_) => panic!("accepted {p:?}"),
    };
    let d = SamplerParams::default;
    assert!(bad(SamplerParams { temperature: Some(f32::NAN), ..d() }).contains("temperature"));
    assert!(bad(SamplerParams { temperature: Some(-1.0), ..d() }).contains("temperature"));
    assert!(bad(SamplerParams { top_p: Some(1.5), ..d() }).contains("top-p"));
    assert!(bad(SamplerParams { min_p: Some(f32::INFINITY), ..d() }).contains("min-p"));
    assert!(bad(SamplerParams { top_k: Some(0), ..d() }).contains("top-k"));
    assert!(bad(SamplerParams { logit_bias: vec![(model.n_vocab() as i32, 1.0)], ..d() })
        .contains("outside the vocabulary"));
    assert!(bad(SamplerParams { logit_bias: vec![(5, f32::NAN)], ..d() }).contains("logit bias"));
    let grammar = |text: &str, root: Option<&str>| SamplerParams {
        grammar: Some(Grammar { text: text.into(), root: root.map(Into::into) }),
        ..d()
    };
    let unparsable = bad(grammar("root ::= [0-9", None));
    assert!(unparsable.starts_with("grammar: "), "{unparsable}");
    assert!(
        bad(grammar("digits ::= [0-9]+", None)).contains("root"),
        "a grammar without its start rule"
    );
    // llguidance's Earley matcher takes left recursion, which llama.cpp refused.
    let mut left =
        Sampler::new(model.clone(), &grammar("root ::= root \"a\" | \"a\"", None), &caps).unwrap();
    let mut no_end = vec![0.0; model.n_vocab() as usize];
    no_end[model.eos().unwrap() as usize] = f32::NEG_INFINITY;
    for _ in 0..3 {
        let t = left.sample(&no_end).unwrap();
        assert!(model.token_to_piece(t, false).unwrap().iter().all(|&b| b == b'a'), "only a's");
    }
    // A temperature that underflows samples greedily (it once drew a banned token and
    // blamed a grammar that was not there).
    let mut logits = vec![0.0f32; model.n_vocab() as usize];
    logits[7] = 1.0;
    let mut tiny_t = Sampler::new(
        model.clone(),
        &SamplerParams { temperature: Some(1e-45), seed: Some(1), ..d() },
        &caps,
    )
    .unwrap();
    assert_eq!(tiny_t.sample(&logits).unwrap(), 7);
    assert!(bad(grammar("root ::= undefined-rule", None)).starts_with("grammar: "));
    // llama.cpp would generate 2^64 - 3 rules for this one: refused up front.
    assert!(bad(grammar("root ::= \"a\"{5,2}", None)).contains("maximum below its minimum"));
    assert!(bad(grammar("root ::= \"a\"{99999999999999999999999}", None)).starts_with("grammar: "));
    assert!(bad(grammar("root ::= \"a\"{3000}", None)).starts_with("grammar: "));
    assert!(bad(grammar("root ::= \"\\", None)).starts_with("grammar: "));
    assert!(bad(grammar("root ::= <[]>", None)).starts_with("grammar: "));
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(100), ")".repeat(100));
    assert!(bad(grammar(&deep, None)).contains("nests"));
    // The largest grammar the caps allow (a chain of rules, each one recursion level
    // in llama.cpp's matcher) parses and samples without overflowing the stack.
    let chain: String = (0..1200).map(|i| format!("r{i}::=r{}\n", i + 1)).collect::<String>()
        + "r1200 ::= [0-9]\nroot ::= r0\n";
    assert!(chain.len() <= caps.max_grammar_bytes);
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let (outcome, pieces) = run(
        &mut ctx,
        &SamplerParams { grammar: Some(Grammar { text: chain, root: None }), ..d() },
        &GenerateRequest::new(prompt(&model), 4),
        &CancelFlag::new(),
    );
    outcome.unwrap();
    assert!(text_of(&pieces).chars().all(|c| c.is_ascii_digit()));
}

#[test]
fn a_plugin_driven_sampler_refuses_tokens_its_grammar_forbids() {
    let model = load(common::tiny_model());
    let p = SamplerParams {
        grammar: Some(Grammar { text: "root ::= \"ab\"".into(), root: None }),
        ..SamplerParams::default()
    };
    let mut sampler = Sampler::new(model.clone(), &p, &SamplerCaps::default()).unwrap();
    let (a, z) = (token_for(&model, b"a"), token_for(&model, b"z"));
    let eos = model.eos().unwrap();
    assert!(
        matches!(sampler.accept(z), Err(Error::InvalidArgument(m)) if m.contains("not allowed"))
    );
    assert!(
        matches!(sampler.accept(eos), Err(Error::InvalidArgument(_))),
        "end of generation before the grammar is complete"
    );
    sampler.accept(a).unwrap();
    // Logits that favour "z" above all: the grammar still forces "b".
    let mut logits = vec![0.0f32; model.n_vocab() as usize];
    logits[z as usize] = 100.0;
    let b = sampler.sample(&logits).unwrap();
    assert_eq!(model.token_to_piece(b, false).unwrap(), b"b");
    // Now only the end is allowed; a row that bans it leaves nothing to pick.
    logits[eos as usize] = f32::NEG_INFINITY;
    assert!(
        matches!(sampler.sample(&logits), Err(Error::InvalidArgument(m)) if m.contains("no token is allowed"))
    );
    assert!(sampler.sample(&[0.0; 3]).is_err(), "a row of the wrong width");
}

#[test]
fn chat_templates_from_the_model_or_by_name_and_named_errors() {
    let tiny = load(common::tiny_model());
    let messages = vec![
        ChatMessage { role: "system".into(), content: "Be brief.".into() },
        ChatMessage { role: "user".into(), content: "Hi".into() },
    ];
    let chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(tiny.apply_chat_template(&ChatTemplate::Model, &messages, true).unwrap(), chatml);
    assert_eq!(
        tiny.apply_chat_template(&ChatTemplate::Named("chatml".into()), &messages, true).unwrap(),
        chatml
    );
    let no_prompt = tiny.apply_chat_template(&ChatTemplate::Model, &messages, false).unwrap();
    assert_eq!(no_prompt, chatml.trim_end_matches("<|im_start|>assistant\n"));
    let llama3 =
        tiny.apply_chat_template(&ChatTemplate::Named("llama3".into()), &messages, true).unwrap();
    assert!(llama3.contains("<|start_header_id|>user<|end_header_id|>"), "{llama3}");

    let named = |r: Result<String, Error>| match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected invalid-argument, got {other:?}"),
    };
    assert!(named(tiny.apply_chat_template(
        &ChatTemplate::Named("no-such".into()),
        &messages,
        true
    ))
    .contains("unknown chat template"));
    let slow = load(common::slow_model());
    assert_eq!(slow.chat_template(), None);
    assert!(named(slow.apply_chat_template(&ChatTemplate::Model, &messages, true))
        .contains("no chat template"));
    let nul = vec![ChatMessage { role: "user".into(), content: "a\0b".into() }];
    assert!(named(tiny.apply_chat_template(&ChatTemplate::Model, &nul, true)).contains("NUL"));
    // Empty messages are not free: what a template adds per message is charged (a
    // million of them once cost 0 bytes and formatted to 24-48 MB).
    for name in ["chatml", "llama3", "gemma", "mistral-v7", "phi3", "deepseek3"] {
        let empty = vec![ChatMessage { role: "user".into(), content: String::new() }; 500];
        let Ok(text) = tiny.apply_chat_template(&ChatTemplate::Named(name.into()), &empty, true)
        else {
            continue;
        };
        let cost = llamabox_native::chat::messages_cost(&empty);
        assert!(text.len() <= cost, "{name}: {} bytes formatted from {cost} charged", text.len());
    }
}

/// Beside a batch (a context that shares the cores), a long input's rows are decoded in
/// the pieces the cores give, one turn on the cores each, so that the batch's steps can
/// run between them; the rows are those of one decode, up to rounding. Alone, one
/// decode, one turn. Pieces of 256 rows give bitwise the same rows here; 128-row pieces
/// run some of the attention through other ggml kernels, which round differently (about
/// 0.4% of the scale at worst on this model), while a wrong position or a lost piece
/// would change rows entirely.
/// A context big enough to embed a long input, and an input of `words` words.
fn long_input(model: &Model, words: usize) -> (ContextParams, Vec<Token>) {
    let big =
        ContextParams { n_ctx: 1024, n_batch: 1024, n_ubatch: 512, n_seq_max: 1, n_threads: 1 };
    let words = (0..words).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    (big, model.tokenize(&words, true, false).unwrap())
}

#[test]
fn beside_a_batch_an_embedding_takes_the_cores_in_pieces() {
    let model = load(common::tiny_model());
    let (big, tokens) = long_input(&model, 200);
    assert!(tokens.len() > 600, "{} tokens", tokens.len());
    let mut alone = Context::new(model.clone(), big).unwrap();
    let whole = alone.embed_rows(&tokens, false, None).unwrap();
    let scale = whole.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));

    for (piece_rows, tolerance) in [(256, 0.0), (128, 1e-2)] {
        let cores = Arc::new(crate::share::CountedTurns::new(piece_rows));
        let mut beside = Context::new(model.clone(), big).unwrap();
        beside.share_cores(Some(cores.clone()));
        let short = &tokens[..20];
        assert_eq!(
            beside.embed_rows(short, false, None).unwrap(),
            alone.embed_rows(short, false, None).unwrap()
        );
        assert_eq!(cores.turns(), 1, "a short input: one decode, one turn");
        let pieces = beside.embed_rows(&tokens, false, None).unwrap();
        let turns = cores.turns() - 1;
        let (n, expected) = (tokens.len(), tokens.len().div_ceil(piece_rows));
        assert_eq!(turns as usize, expected, "{n} rows in {piece_rows}-row pieces");
        assert_eq!(pieces.len(), whole.len());
        let worst = whole
            .iter()
            .flatten()
            .zip(pieces.iter().flatten())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= tolerance * scale.max(1.0),
            "{piece_rows}-row pieces: rows differ by {worst} (scale {scale})"
        );
        assert_eq!(beside.seq_pos_max(0).unwrap(), -1, "embedding leaves memory empty");
        eprintln!("embedding in {piece_rows}-row pieces: {n} rows, worst difference {worst:e}");
    }
}

/// Beside others who always wait, an embedding on two threads passes the cores at its
/// boundaries and rests its team's idle threads at each hand-over: ggml wakes them for
/// the next graph, so the rows are bitwise those of free cores (a team left asleep
/// would hang its next graph at the first barrier).
#[test]
fn an_embedding_that_hands_the_cores_over_rests_its_threads_and_goes_on() {
    use std::sync::atomic::Ordering::Relaxed;
    let model = load(common::tiny_model());
    let (big, tokens) = long_input(&model, 120);
    let big = ContextParams { n_threads: 2, ..big };
    let rows = |cores: Arc<crate::share::CountedTurns>| {
        let mut ctx = Context::new(model.clone(), big).unwrap();
        ctx.share_cores(Some(cores.clone() as Arc<dyn llamabox_native::SharedCores>));
        let rows = ctx.embed_rows(&tokens, false, None).unwrap();
        let passes = cores.passes.load(Relaxed);
        generates_as_a_greedy_loop(&mut ctx, &model);
        (rows, passes)
    };
    let (free, none) = rows(Arc::new(crate::share::CountedTurns::new(128)));
    let (passed, passes) = rows(Arc::new(crate::share::CountedTurns::crowded(128)));
    assert_eq!(none, 0);
    assert!(passes > 0, "the embedding passed the cores at its boundaries");
    assert_eq!(passed, free);
}

/// The CPUs the calling thread may run on (Linux), from /proc/thread-self/status.
fn this_threads_cpus() -> Option<String> {
    let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|l| l.trim().to_string())
}

/// How many CPUs a kernel CPU list ("0-3,8") names.
fn cpu_count(list: &str) -> usize {
    (list.split(','))
        .map(|part| match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// A team that keeps one thread a CPU (where it has a thread for every CPU the process
/// may run on) computes as a free one, and pins the thread that computes as its thread
/// 0, not the one that created it (that may be any thread).
#[test]
fn a_pinned_team_computes_as_before_and_pins_only_the_thread_that_computes() {
    let Some(all) = this_threads_cpus() else { return }; // not Linux: nothing is pinned
    let (count, model) = (cpu_count(&all), load(common::tiny_model()));
    let threads = count.min(8);
    let params = ContextParams { n_threads: threads as u32, ..params() };
    let (mut ctx, creator) = std::thread::scope(|s| {
        (s.spawn(|| {
            let mut ctx = Context::new(model.clone(), params).unwrap();
            ctx.pin_threads().unwrap();
            (ctx, this_threads_cpus())
        }))
        .join()
        .unwrap()
    });
    assert_eq!(creator.as_deref(), Some(all.as_str()), "the creating thread is left free");
    generates_as_a_greedy_loop(&mut ctx, &model);
    let computing = this_threads_cpus().unwrap();
    if threads == count {
        assert_eq!(cpu_count(&computing), 1, "thread 0 keeps to one CPU: {computing} of {all}");
    } else {
        assert_eq!(computing, all, "fewer threads than CPUs: nothing pinned");
    }
}

/// An embedding's decodes end after the model's hidden states, which are all its rows
/// are read from: bitwise the rows of a decode that computes the output head too, alone
/// and in pieces beside a batch, and the context decodes as before afterwards.
#[test]
fn embeddings_end_at_the_hidden_states_with_the_rows_a_whole_graph_gives() {
    let model = load(common::tiny_model());
    let (big, tokens) = long_input(&model, 120);
    let bits = |rows: &[Vec<f32>]| rows.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    for pieces in [None, Some(128)] {
        let mut ctx = Context::new(model.clone(), big).unwrap();
        ctx.share_cores(pieces.map(|rows| {
            Arc::new(crate::share::CountedTurns::new(rows)) as Arc<dyn llamabox_native::SharedCores>
        }));
        let early = ctx.embed_rows(&tokens, false, None).unwrap();
        ctx.compute_head_in_embeddings(true);
        let whole = ctx.embed_rows(&tokens, false, None).unwrap();
        assert_eq!((early.len(), whole.len()), (tokens.len(), tokens.len()));
        let differ =
            |a: &[Vec<f32>]| bits(a).iter().zip(bits(&whole)).filter(|(x, y)| *x != y).count();
        assert_eq!(differ(&early), 0, "values that differ, pieces of {pieces:?} rows");
        ctx.compute_head_in_embeddings(false);
        assert_eq!(differ(&ctx.embed_rows(&tokens, false, None).unwrap()), 0, "once more");
        // Generation afterwards reads logits the head computed.
        generates_as_a_greedy_loop(&mut ctx, &model);
    }
}

/// Six greedy tokens on `ctx` are those of a plain greedy loop: it decodes and
/// samples as a fresh context would, whatever it computed before.
fn generates_as_a_greedy_loop(ctx: &mut Context, model: &Arc<Model>) {
    let request = GenerateRequest::new(prompt(model), 6);
    let (outcome, pieces) = run(ctx, &SamplerParams::greedy(), &request, &CancelFlag::new());
    outcome.unwrap();
    assert_eq!(tokens_of(&pieces), greedy_loop(model, &prompt(model), 6));
}

#[test]
fn embeddings_are_deterministic_distinct_n_embd_wide_and_normalised() {
    let model = load(common::tiny_model());
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    let a = model.tokenize("the llama in the box", true, false).unwrap();
    let b = model.tokenize("hello world, fast plugin", true, false).unwrap();
    let n_embd = model.n_embd() as usize;
    for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
        let first = ctx.embed(&[a.clone(), b.clone()], pooling, false, None).unwrap();
        let again = ctx.embed(&[a.clone(), b.clone()], pooling, false, None).unwrap();
        assert_eq!(first.len(), 2);
        assert!(first.iter().all(|v| v.len() == n_embd));
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&first[0]),
            bits(&again[0]),
            "identical inputs, bitwise identical vectors ({pooling:?})"
        );
        if pooling != Pooling::Cls {
            assert_ne!(
                bits(&first[0]),
                bits(&first[1]),
                "different inputs, different vectors ({pooling:?})"
            );
        }
        let normalised = ctx.embed(std::slice::from_ref(&a), pooling, true, None).unwrap();
        let norm = normalised[0].iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    }
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1, "embedding leaves memory empty");
    let rows = ctx.embed_rows(&a, false, None).unwrap();
    assert_eq!((rows.len(), rows[0].len()), (a.len(), n_embd));
    let mean = ctx.embed(std::slice::from_ref(&a), Pooling::Mean, false, None).unwrap();
    let by_hand: Vec<f32> =
        (0..n_embd).map(|j| rows.iter().map(|r| r[j]).sum::<f32>() / rows.len() as f32).collect();
    assert_eq!(mean[0], by_hand, "mean pooling is the mean of the rows");
    assert_eq!(
        ctx.embed(std::slice::from_ref(&a), Pooling::Last, false, None).unwrap()[0],
        rows[a.len() - 1]
    );

    // Generation still works on the same context afterwards (embedding output is off).
    generates_as_a_greedy_loop(&mut ctx, &model);

    // Cancelled in flight: cancelled, memory empty, the next call as before.
    let token = CancelFlag::new();
    token.trip_after(7);
    assert_eq!(
        ctx.embed(std::slice::from_ref(&a), Pooling::Mean, false, Some(Stop::on(&token))),
        Err(Error::Cancelled)
    );
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);
    assert_eq!(ctx.embed(std::slice::from_ref(&a), Pooling::Mean, false, None).unwrap(), mean);
    let too_many = vec![a.clone(); params().n_seq_max as usize + 1];
    assert!(matches!(
        ctx.embed(&too_many, Pooling::Mean, false, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.embed(&[vec![]], Pooling::Mean, false, None),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_model_that_pools_by_itself_gives_its_own_vectors_for_its_own_pooling() {
    let plain = load(common::tiny_model());
    let pooled = load(common::tiny_mean_pooled_model());
    let inputs = vec![
        plain.tokenize("the llama in the box", true, false).unwrap(),
        plain.tokenize("hello world, fast plugin", true, false).unwrap(),
    ];
    let mut ctx = Context::new(pooled.clone(), params()).unwrap();
    let own = ctx.embed(&inputs, Pooling::Mean, false, None).unwrap();
    assert_eq!(own, ctx.embed(&inputs, Pooling::Mean, false, None).unwrap(), "bitwise repeatable");
    assert!(own.iter().all(|v| v.len() == pooled.n_embd() as usize));
    assert_ne!(own[0], own[1]);
    // The same weights without the pooling key: llama.cpp's mean and ours agree to rounding.
    let ours = Context::new(plain.clone(), params())
        .unwrap()
        .embed(&inputs, Pooling::Mean, false, None)
        .unwrap();
    for (x, y) in own.iter().flatten().zip(ours.iter().flatten()) {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "llama.cpp's mean {x} vs ours {y}");
    }
    let normalised = ctx.embed(&inputs, Pooling::Mean, true, None).unwrap();
    let norm = normalised[1].iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    let refused = |r: Result<Vec<Vec<f32>>, Error>| matches!(r, Err(Error::InvalidArgument(m)) if m.contains("pools its embeddings itself"));
    assert!(
        refused(ctx.embed(&inputs, Pooling::Cls, false, None)),
        "another pooling than the model's"
    );
    assert!(
        refused(ctx.embed_rows(&inputs[0], false, None)),
        "no per-row vectors from a pooling model"
    );
    assert_eq!(ctx.seq_pos_max(0).unwrap(), -1);
}

/// A context holding "Describe this: <image>" evaluated the way `media.eval-chunks`
/// does it (text decoded, the image encoded then decoded), logits for its last row.
fn context_after_an_image(model: &Arc<Model>) -> Context {
    let mut media = MediaContext::new(common::tiny_vision(), model.clone(), 1).unwrap();
    let caps = MediaCaps { max_image_side: 4096, max_audio_samples: 1 << 20 };
    let image = MediaInput::Image { width: 64, height: 64, rgb: common::gradient(64, 64) };
    let chunks = media
        .tokenize(&format!("Describe this: {}", MediaContext::marker()), &[image], caps, usize::MAX)
        .unwrap();
    assert!(chunks.iter().any(|c| c.kind() == ChunkKind::Image));
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        if chunk.kind() == ChunkKind::Text {
            let start = ctx.seq_pos_max(0).unwrap() + 1;
            ctx.decode(&Batch::sequence(chunk.text_tokens(), start, 0), None).unwrap();
        } else {
            let embd = media.encode(chunk, None).unwrap();
            ctx.decode_embeddings(&embd, 0, media.needs_non_causal(chunk), last, None).unwrap();
        }
    }
    ctx
}

#[test]
fn an_empty_prompt_continues_after_a_media_prompt() {
    let model = load(common::tiny_model());
    let mut plain = context_after_an_image(&model);
    let n_past = plain.seq_pos_max(0).unwrap() + 1;
    let eos = model.eos().unwrap() as usize;
    let mut expected = Vec::new();
    for pos in n_past..n_past + 8 {
        // Greedy with end-of-generation banned, as the sampler below is told.
        let logits = plain.last_logits().unwrap();
        let next = (0..logits.len()).filter(|&i| i != eos).fold(0, |best, i| {
            if logits[i] > logits[best] {
                i
            } else {
                best
            }
        }) as Token;
        expected.push(next);
        plain.decode(&Batch::sequence(&[next], pos, 0), None).unwrap();
    }

    let mut ctx = context_after_an_image(&model);
    let eos_banned = SamplerParams {
        logit_bias: vec![(model.eos().unwrap(), f32::NEG_INFINITY)],
        ..SamplerParams::default()
    };
    let (outcome, pieces) =
        run(&mut ctx, &eos_banned, &GenerateRequest::new(Vec::new(), 8), &CancelFlag::new());
    let outcome = outcome.unwrap();
    assert_eq!(tokens_of(&pieces), expected);
    assert_eq!(outcome.usage.prompt_tokens, 0);
    assert_eq!(ctx.seq_pos_max(0).unwrap(), n_past + outcome.usage.generated_tokens as i32 - 1);

    let mut empty = Context::new(model.clone(), params()).unwrap();
    let (outcome, _) = run(
        &mut empty,
        &SamplerParams::greedy(),
        &GenerateRequest::new(Vec::new(), 8),
        &CancelFlag::new(),
    );
    assert!(matches!(outcome, Err(Error::InvalidArgument(m)) if m.contains("no logits")));
}

// ---- Through the demo plugin ----

#[tokio::test(flavor = "multi_thread")]
async fn guest_host_side_greedy_equals_its_own_greedy_loop_and_the_native_one() {
    let model = common::tiny_model();
    let (outcome, out) = common::run_demo(
        &[("tiny", model)],
        &["--model", "tiny", "--generate", "16", "--host-generate"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    let guest = common::field(&out, "generated-ids");
    assert_eq!(common::field(&out, "host-generated-ids"), guest);
    let native = load(model);
    let prompt = native.tokenize("The llama in the box", true, true).unwrap();
    let expected: Vec<String> =
        greedy_loop(&native, &prompt, 16).iter().map(ToString::to_string).collect();
    assert_eq!(guest, expected.join(","));
    assert_eq!(common::field(&out, "host-finish"), "max-tokens");
    assert!(common::field(&out, "host-usage")
        .starts_with(&format!("prompt {} generated 16", prompt.len())));
    // The plugin-driven sampler (greedy through `sampler.sample`) agrees too.
    assert_eq!(common::field(&out, "sampler-ids"), guest);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_that_stops_reading_pauses_the_generation_and_a_cancel_ends_it() {
    let (outcome, out) = common::run_test_plugin(
        &[("tiny", common::tiny_model())],
        &["stall-generation", "--model", "tiny", "--cancel-after-ms", "200"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    let report = common::field(&out, "stalled-generation");
    let delivered: u32 = report.split(' ').next().unwrap().parse().unwrap();
    // 256 tokens asked for; the host stops at its 32-piece buffer until the cancel.
    assert!(delivered <= 32 && report.ends_with("delivered, cancelled"), "{report}");
    assert_eq!(common::field(&out, "stalled-generation-memory"), "consistent");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_deepest_grammar_the_caps_allow_works_from_a_guest() {
    // Parsed in a host call made from the guest (on wasmtime's fiber stack) and matched
    // on the worker: 64 nested groups and a chain of rules filling the byte cap.
    let nested = format!("n ::= {}[0-9]{}\n", "(".repeat(64), ")".repeat(64));
    let mut grammar = format!("root ::= r0 n\n{nested}");
    let mut i = 0;
    while grammar.len() < 16_000 {
        grammar += &format!("r{i}::=r{}\n", i + 1);
        i += 1;
    }
    grammar += &format!("r{i}::=[0-9]\n");
    let (outcome, out) = common::run_demo(
        &[("tiny", common::tiny_model())],
        &["--model", "tiny", "--grammar", &grammar, "--generate", "2"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    assert_eq!(common::field(&out, "grammar-sampler"), "ok");
    let text = common::field(&out, "grammar-generated");
    assert!(!text.is_empty() && text.chars().all(|c| c.is_ascii_digit()), "{text:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn guest_generates_on_the_host_after_an_image_prompt() {
    let (outcome, out) = common::run_demo_with(
        &[("tiny", common::tiny_model())],
        &[("vision", common::tiny_vision())],
        &["--model", "tiny", "--media", "vision"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    let next = common::field(&out, "media-eval").rsplit("next-token=").next().unwrap().to_string();
    let generated = common::field(&out, "media-host-generation");
    assert!(
        generated == next || generated.starts_with(&format!("{next},")),
        "greedy continues with the argmax {next}: {generated}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn guest_chats_through_the_models_template_and_streams_the_answer() {
    let (outcome, out) = common::run_demo(
        &[("tiny", common::tiny_model())],
        &["--model", "tiny", "--chat", "Hi there", "--generate", "12"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    assert_eq!(
        common::field(&out, "chat-prompt"),
        "<|im_start|>user\\nHi there<|im_end|>\\n<|im_start|>assistant\\n"
    );
    assert!(common::field(&out, "chat-pieces").parse::<u32>().unwrap() >= 12);
    assert_eq!(common::field(&out, "chat-finish"), "max-tokens");
    assert!(common::field(&out, "chat-bad-template")
        .starts_with("invalid-argument: unknown chat template"));
    assert!(common::field(&out, "chat-bad-sampler").starts_with("invalid-argument: top-p"));
    assert!(common::field(&out, "chat-bad-grammar").starts_with("invalid-argument: grammar"));
    assert!(common::field(&out, "chat-too-many-tokens")
        .starts_with("limit-exceeded: max-generate-tokens: "));
}

#[tokio::test(flavor = "multi_thread")]
async fn guest_cancels_a_generation_from_its_timer_and_memory_holds_what_was_delivered() {
    let (outcome, out) = common::run_demo(
        &[("slow", common::slow_model())],
        &[
            "--model",
            "slow",
            "--cancel-generation",
            "--long-tokens",
            "512",
            "--cancel-after-ms",
            "30",
        ],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    // Timing decides where the cancel lands, never what it leaves behind.
    let finish = common::field(&out, "cancel-generation-finish");
    assert!(finish == "cancelled" || finish == "max-tokens", "{finish}");
    assert_eq!(common::field(&out, "cancel-generation-memory"), "consistent");
    assert_eq!(common::field(&out, "after-cancel"), "ok");
}

/// The grammars that stalled or crashed llama.cpp's matcher (issue 23), through the
/// sampler: each is refused with a reason or samples tokens, and no call runs long.
/// llama.cpp took 14 s to create the first (N = 16; N = 20 ran past 120 s) and ×4.8 per
/// token on the second; llguidance's limits bound both.
#[test]
fn grammar_bombs_are_refused_or_bounded_per_token() {
    let model = load(common::tiny_model());
    let caps = SamplerCaps::default();
    let chain = |n: usize| {
        let mut g = String::from("root ::= r0\n");
        for i in 0..n {
            g += &format!("r{i} ::= r{} \"x\" | r{} \"y\"\n", i + 1, i + 1);
        }
        g + &format!("r{n} ::= \"x\" | \"y\"\n")
    };
    let doubling = "root ::= x\nx ::= \"a\" x \"b\" | \"a\" x \"c\" | \"\"\n".to_string();
    let hidden_nesting =
        format!("root ::= x # comment\rx ::= {}\"a\"{}", "(".repeat(8155), ")".repeat(8155));
    let hidden_repeats = format!("root ::= x # comment\rx ::= {}", "\"a\"{0,2000} ".repeat(1359));
    let (a, x) = (token_for(&model, b"a"), token_for(&model, b"x"));
    let mut slowest = std::time::Duration::ZERO;
    for (name, text, favoured) in [
        ("chain16", chain(16), x),
        ("chain20", chain(20), x),
        ("doubling", doubling, a),
        ("hidden-nesting", hidden_nesting, a),
        ("hidden-repeats", hidden_repeats, a),
    ] {
        let started = std::time::Instant::now();
        let p = SamplerParams {
            grammar: Some(Grammar { text, root: None }),
            ..SamplerParams::default()
        };
        let mut sampler = match Sampler::new(model.clone(), &p, &caps) {
            Ok(s) => s,
            Err(e @ Error::Grammar { .. }) => {
                println!("{name}: refused in {:?}: {e}", started.elapsed());
                assert!(name.starts_with("hidden"), "{name} should compile: {e}");
                continue;
            }
            Err(e) => panic!("{name}: {e:?}"),
        };
        slowest = slowest.max(started.elapsed());
        let mut logits = vec![0.0f32; model.n_vocab() as usize];
        logits[favoured as usize] = 30.0;
        let mut sampled = 0;
        for _ in 0..200 {
            let step = std::time::Instant::now();
            let picked = sampler.sample(&logits);
            slowest = slowest.max(step.elapsed());
            match picked {
                Ok(_) => sampled += 1,
                Err(e @ Error::Grammar { .. }) => {
                    println!("{name}: stopped after {sampled} tokens: {e}");
                    break;
                }
                Err(e) => panic!("{name}: {e:?}"),
            }
        }
        println!("{name}: {sampled} tokens in {:?}", started.elapsed());
        assert!(sampled > 0, "{name}: a grammar that compiled samples at least one token");
    }
    println!("slowest grammar call: {slowest:?}");
    // A bound, not a benchmark: the calls this replays took 14 s to minutes.
    assert!(slowest < std::time::Duration::from_secs(2), "a grammar call took {slowest:?}");
}

/// JSON Schema through llguidance: a generation under a schema is JSON that validates
/// (compact, whatever the weights say), and schemas over the caps or malformed are
/// refused with a reason.
#[test]
fn a_json_schema_constrains_generation_to_valid_json() {
    let model = load(common::tiny_model());
    let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"type":"integer","minimum":0,"maximum":9},"tag":{"enum":["a","b"]}},"required":["ok","n","tag"],"additionalProperties":false}"#;
    for seed in 0..4 {
        let p = SamplerParams {
            json_schema: Some(schema.into()),
            temperature: Some(1.0),
            seed: Some(seed),
            ..SamplerParams::default()
        };
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        let (outcome, pieces) =
            run(&mut ctx, &p, &GenerateRequest::new(prompt(&model), 48), &CancelFlag::new());
        assert_eq!(
            outcome.unwrap().finish,
            FinishReason::EndOfGeneration,
            "the schema's object ends the generation"
        );
        let text = text_of(&pieces);
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let object = value.as_object().unwrap();
        assert!(
            object["ok"].is_boolean() && (0..=9).contains(&object["n"].as_i64().unwrap()),
            "{text}"
        );
        assert!(
            ["a", "b"].contains(&object["tag"].as_str().unwrap()) && object.len() == 3,
            "{text}"
        );
        assert!(!text.contains(' '), "compact: {text:?}");
    }
    let caps = SamplerCaps::default();
    let bad = |schema: &str| match Sampler::new(
        model.clone(),
        &SamplerParams { json_schema: Some(schema.into()), ..SamplerParams::default() },
        &caps,
    ) {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("{schema}: expected invalid-argument, got {:?}", other.map(|_| ())),
    };
    assert!(bad("{").contains("not JSON"));
    assert!(bad("[1]").contains("object or a boolean"));
    assert!(bad(r#"{"x-guidance":{"lenient":true}}"#).contains("x-guidance"));
    let deep = "{\"type\":\"array\",\"items\":".repeat(40) + "{}" + &"}".repeat(40);
    assert!(bad(&deep).contains("levels deep"));
    // Over the host's max-grammar-bytes: that limit, by name, with the sizes.
    let long = format!("{{\"enum\":[\"{}\"]}}", "a".repeat(20_000));
    let over = SamplerParams { json_schema: Some(long.clone()), ..SamplerParams::default() };
    assert!(matches!(
        Sampler::new(model.clone(), &over, &caps),
        Err(Error::LimitExceeded { limit: "max-grammar-bytes", requested, max })
            if requested == long.len() as u64 && max == caps.max_grammar_bytes as u64
    ));
    // JSON that the schema compiler refuses: an error of the schema, not of a grammar.
    let params = SamplerParams {
        json_schema: Some(r#"{"type":"frobnicate"}"#.into()),
        ..SamplerParams::default()
    };
    match Sampler::new(model.clone(), &params, &caps) {
        Err(e @ Error::Grammar { syntax: GrammarSyntax::JsonSchema, .. }) => {
            assert!(e.to_string().starts_with("json-schema: "), "{e}")
        }
        other => panic!("expected a json-schema error, got {:?}", other.map(|_| ())),
    }
    let both = SamplerParams {
        json_schema: Some("{}".into()),
        grammar: Some(Grammar { text: "root ::= \"a\"".into(), root: None }),
        ..SamplerParams::default()
    };
    assert!(
        matches!(Sampler::new(model.clone(), &both, &caps), Err(Error::InvalidArgument(m)) if m.contains("cannot both"))
    );
}

/// An evaluation whose tokens cannot fit in its sequence fails before anything is
/// computed: no decode counted, memory as it was (llama.cpp would compute n-batch
/// pieces until one found no room).
#[test]
fn an_eval_that_cannot_fit_fails_before_computing() {
    use llamabox_native::PromptPiece;
    let model = load(common::tiny_model());
    let mut ctx = Context::new(
        model.clone(),
        ContextParams { n_ctx: 256, n_batch: 64, n_ubatch: 64, n_seq_max: 1, n_threads: 1 },
    )
    .unwrap();
    let t = token_for(&model, b"a");
    let counts = Arc::new(crate::share::Counts::default());
    ctx.set_tally(counts.clone());
    ctx.eval(&[PromptPiece::Tokens(vec![t; 100])], 0, None).unwrap();
    let decodes = counts.decoded();
    assert_eq!(decodes, 100);
    let too_many = [PromptPiece::Tokens(vec![t; 100]), PromptPiece::Tokens(vec![t; 57])];
    assert_eq!(ctx.eval(&too_many, 0, None), Err(Error::ContextFull));
    assert_eq!(counts.decoded(), decodes, "nothing was computed");
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 99, "memory as it was");
    assert_eq!(
        ctx.eval(&[PromptPiece::Tokens(vec![t; 156])], 0, None).unwrap(),
        256,
        "what fits still fits"
    );
}
