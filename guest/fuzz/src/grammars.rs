//! Hostile grammars through the sampler and generation calls: nesting past the cap,
//! repetition floods, ambiguity that multiplies parse stacks, comments ended by CR,
//! escapes valid and not, tokens, and random byte mutations of all of these. Every
//! call must return `Ok` or a named error within bounded time (the host's test runs
//! this under a deadline and reads the slowest call from `fuzz-grammar-slowest-ms`).

use super::llamabox::inference::cancel::CancelToken;
use super::llamabox::inference::generate::{self, GenerateParams, Grammar, LogitBias, Sampler};
use super::llamabox::inference::llm::{Context, Model};
use super::wasi::clocks::monotonic_clock;
use super::{Rng, Tally};

/// One hostile GBNF text.
pub fn grammar(rng: &mut Rng) -> String {
    let text = match rng.below(10) {
        // r_i ::= r_{i+1} "x" | r_{i+1} "y": 2^N parses of every string (llama.cpp's
        // matcher took 14 s for N = 16 in one call).
        0 => {
            let n = 8 + rng.below(24);
            let mut g = String::from("root ::= r0\n");
            for i in 0..n {
                g += &format!("r{i} ::= r{} \"x\" | r{} \"y\"\n", i + 1, i + 1);
            }
            g + &format!("r{n} ::= \"x\" | \"y\"\n")
        }
        // Stacks that double with every accepted "a".
        1 => "root ::= x\nx ::= \"a\" x \"b\" | \"a\" x \"c\" | \"\"\n".into(),
        // Nesting hidden after a comment ended by CR.
        2 => {
            let depth = 60 + rng.below(9000) as usize;
            format!("root ::= x # c\rx ::= {}\"a\"{}", "(".repeat(depth), ")".repeat(depth))
        }
        // Repetition floods, sometimes after a CR comment.
        3 => {
            let n = 1 + rng.below(1400) as usize;
            let sep = if rng.chance(2) { " # c\r" } else { "\n" };
            format!(
                "root ::= x{sep}x ::= {}",
                format!("\"a\"{{0,{}}} ", 1 + rng.below(2000)).repeat(n)
            )
        }
        // Nested repetitions.
        4 => format!(
            "root ::= ((\"a\"{{{}}}){{{}}}){{0,{}}}",
            rng.below(64),
            rng.below(64),
            rng.below(64)
        ),
        // Escapes, classes, any-char, tokens.
        5 => {
            let parts = [
                "\"\\x41\"",
                "\"\\u00e9\"",
                "\"\\U0001F600\"",
                "\"\\uD800\"",
                "\"\\U00110000\"",
                "[^\\x00-\\x7f]",
                "[z-a]",
                "[\\]\\-]",
                ".",
                "<[0]>",
                "<[4294967295]>",
                "<|im_end|>",
                "!<[3]>",
                "\"\\q\"",
                "\"\\x4\"",
                "[a-",
                "\"\"*",
                "\"a\"{0}+",
            ];
            let seq: Vec<&str> = (0..1 + rng.below(6))
                .map(|_| parts[rng.below(parts.len() as u64) as usize])
                .collect();
            format!("root ::= {}\n", seq.join(" "))
        }
        // Long chains of rules (each a recursion level in a naive matcher).
        6 => {
            let n = 1 + rng.below(3000);
            let mut g = String::from("root ::= r0\n");
            for i in 0..n {
                g += &format!("r{i}::=r{}\n", i + 1);
            }
            g + &format!("r{n}::=[0-9]\n")
        }
        // Left recursion (accepted by an Earley parser) and empty languages.
        7 => [
            "root ::= root \"a\" | \"a\"",
            "root ::= root \"a\"",
            "root ::= root",
            "root ::= a\na ::= root",
        ][rng.below(4) as usize]
            .into(),
        // Plain small grammars, often valid.
        _ => [
            "root ::= [0-9]+",
            "root ::= \"yes\" | \"no\"",
            "root ::= (\"ab\" | [c-e]*)+ \"!\"",
            "root ::= .{1,3}",
        ][rng.below(4) as usize]
            .into(),
    };
    mutate(rng, text)
}

/// Sometimes insert, delete or swap a few bytes at character boundaries.
fn mutate(rng: &mut Rng, mut text: String) -> String {
    if !rng.chance(3) {
        return text;
    }
    let bits = [
        "(", ")", "|", "\r", "\n", "\r\n", "#", "\"", "[", "]", "{", "}", "\\", "*", "?", "::=",
        " ", "é",
    ];
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(text.len() as u64 + 1) as usize;
        if !text.is_char_boundary(at) {
            continue;
        }
        if rng.chance(2) {
            text.insert_str(at, bits[rng.below(bits.len() as u64) as usize]);
        } else if at < text.len() && text.is_char_boundary(at + 1) {
            text.remove(at);
        }
    }
    text
}

/// One hostile grammar through every call that takes one. Returns the slowest call, ms.
pub fn case(rng: &mut Rng, model: &Model, ctx: &Context, tally: &mut Tally) -> u64 {
    let text = grammar(rng);
    let mut params = generate::greedy_sampler();
    params.grammar = Some(Grammar {
        text,
        root: rng.chance(8).then(|| ["root", "", "x", "r0"][rng.below(4) as usize].into()),
    });
    if rng.chance(2) {
        // Lean toward "a" (the stack-doubling grammar's worst case) or away from the end.
        let bias = model.tokenize("a", false, false).unwrap_or_default();
        params.logit_bias = bias.into_iter().map(|token| LogitBias { token, bias: 50.0 }).collect();
    }
    if rng.chance(3) {
        params.temperature = Some([1e-45, 0.7, 1.5][rng.below(3) as usize]);
        params.seed = Some(rng.below(1000) as u32);
    }
    let mut slowest = 0;
    let mut timed = |tally: &mut Tally, f: &mut dyn FnMut(&mut Tally)| {
        let started = monotonic_clock::now();
        f(tally);
        slowest = slowest.max((monotonic_clock::now() - started) / 1_000_000);
    };
    timed(tally, &mut |tally| {
        let sampler = Sampler::create(model, &params);
        tally.record(&sampler);
        if let Ok(sampler) = sampler {
            for _ in 0..rng.below(6) {
                let token = rng.s32(model.n_vocab() as i64);
                tally.record(&sampler.accept(token));
            }
        }
    });
    timed(tally, &mut |tally| {
        let _ = ctx.clear();
        let prompt = model.tokenize("say", true, false).unwrap_or_default();
        let request = GenerateParams {
            prompt,
            seq: 0,
            max_tokens: 1 + rng.below(48) as u32,
            stop: Vec::new(),
            sampler: params.clone(),
            logprobs: None,
        };
        match generate::start(ctx, &request, &CancelToken::new()) {
            Ok(generation) => loop {
                match generation.next() {
                    Ok(Some(_)) => {}
                    end => {
                        tally.record(&end);
                        break;
                    }
                }
            },
            Err(e) => tally.record::<()>(&Err(e)),
        }
    });
    slowest
}
