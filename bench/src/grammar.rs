//! Grammar-constrained sampling: llamabox's grammar engine (llguidance, fed GBNF read as
//! llama.cpp reads it) against llama.cpp's own GBNF matcher, on the same logits.
//!
//! Each step both engines see one seeded random row of n-vocab logits (end-of-generation
//! banned, so every grammar keeps going) and pick greedily under the grammar; the
//! report says whether they picked the same tokens. Per-token cost is the time of a
//! constrained pick less an unconstrained one (the candidate fill and greedy pick are
//! in both), medians of paired rounds in alternating order. llama.cpp's matcher gets a
//! time budget per grammar: on ambiguous grammars it slows without bound.

use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use llama_cpp_sys_2 as sys;
use llamabox_native::{Grammar, Model, Sampler, SamplerCaps, SamplerParams, Token};

use crate::stats::Samples;

/// (name, GBNF): ordinary grammars, then the two shapes that multiply llama.cpp's stacks.
fn grammars() -> Vec<(&'static str, String)> {
    let mut chain = String::from("root ::= (r0 \" \")+\n");
    for i in 0..10 {
        chain += &format!("r{i} ::= r{} \"x\" | r{} \"y\"\n", i + 1, i + 1);
    }
    chain += "r10 ::= \"x\" | \"y\"\n";
    vec![
        ("digits `[0-9]+`", "root ::= [0-9]+".into()),
        ("words `([a-z]+ \" \")+`", "root ::= ([a-z]+ \" \")+".into()),
        ("JSON values", JSON.into()),
        ("ambiguous chain, 2^10 parses", chain),
        (
            "nested `\"a\" x \"b\" \\| \"a\" x \"c\"`",
            "root ::= (x \" \")+\nx ::= \"a\" x \"b\" | \"a\" x \"c\" | \"a\"\n".into(),
        ),
    ]
}

/// JSON in GBNF (written here for the bench: objects, arrays, strings with escapes,
/// numbers, literals, optional whitespace).
const JSON: &str = r#"root ::= value
value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// llama.cpp's grammar matcher and greedy pick, as a chain on its own copy of the model.
struct LlamaGrammar {
    chain: *mut sys::llama_sampler,
    candidates: Vec<sys::llama_token_data>,
}

impl LlamaGrammar {
    fn new(model: *mut sys::llama_model, gbnf: Option<&str>) -> anyhow::Result<Self> {
        // SAFETY: default params; the chain owns the stages added to it.
        let chain =
            unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) };
        if let Some(gbnf) = gbnf {
            let text = CString::new(gbnf)?;
            // SAFETY: a live model's vocabulary and valid C strings; null on failure.
            let grammar = unsafe {
                sys::llama_sampler_init_grammar(
                    sys::llama_model_get_vocab(model),
                    text.as_ptr(),
                    c"root".as_ptr(),
                )
            };
            if grammar.is_null() {
                // SAFETY: frees the chain made above.
                unsafe { sys::llama_sampler_free(chain) };
                bail!("llama.cpp refused the grammar");
            }
            // SAFETY: the chain takes ownership.
            unsafe { sys::llama_sampler_chain_add(chain, grammar) };
        }
        // SAFETY: the chain takes ownership.
        unsafe { sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_greedy()) };
        Ok(Self { chain, candidates: Vec::new() })
    }

    fn sample(&mut self, logits: &[f32]) -> Option<Token> {
        let data = |(id, &logit): (Token, &f32)| sys::llama_token_data { id, logit, p: 0.0 };
        self.candidates.clear();
        self.candidates.extend((0..).zip(logits).map(data));
        let mut array = sys::llama_token_data_array {
            data: self.candidates.as_mut_ptr(),
            size: self.candidates.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: `array` points at live candidates for the call.
        unsafe { sys::llama_sampler_apply(self.chain, &mut array) };
        let picked = usize::try_from(array.selected).ok().filter(|&i| i < array.size)?;
        // SAFETY: in bounds (checked above).
        let t = unsafe { *array.data.add(picked) };
        if t.logit == f32::NEG_INFINITY {
            return None;
        }
        // SAFETY: the token passed the grammar stage of this apply.
        unsafe { sys::llama_sampler_accept(self.chain, t.id) };
        Some(t.id)
    }
}

impl Drop for LlamaGrammar {
    fn drop(&mut self) {
        // SAFETY: made by chain_init, freed once.
        unsafe { sys::llama_sampler_free(self.chain) }
    }
}

/// Seeded rows of logits with every end-of-generation token banned.
fn rows(model: &Model, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n)
        .map(|_| {
            let mut row: Vec<f32> = (0..model.n_vocab()).map(|_| rng.f32() * 10.0).collect();
            for (t, logit) in row.iter_mut().enumerate() {
                if model.is_eog(t as Token) {
                    *logit = f32::NEG_INFINITY;
                }
            }
            row
        })
        .collect()
}

struct Row {
    name: &'static str,
    ours_us: Samples,
    theirs_us: Samples,
    ours_create_ms: Samples,
    theirs_create_ms: Samples,
    /// Tokens llama.cpp got through within its budget, of those asked (the worst round).
    theirs_tokens: usize,
    same_tokens: bool,
}

/// Run every grammar, `rounds` paired rounds of `tokens` greedy steps; a Markdown report.
pub fn report(
    model_path: &Path,
    tokens: usize,
    rounds: usize,
    budget: Duration,
) -> anyhow::Result<String> {
    let model = Arc::new(Model::load(model_path).context("loading the model")?);
    let c_path = CString::new(model_path.as_os_str().as_encoded_bytes())?;
    // SAFETY: default params and a valid path; a second, independent copy for llama.cpp's matcher.
    let raw = unsafe {
        sys::llama_model_load_from_file(c_path.as_ptr(), sys::llama_model_default_params())
    };
    anyhow::ensure!(!raw.is_null(), "llama.cpp could not load the model");
    let caps = SamplerCaps::default();
    let logits = rows(&model, tokens, 7);
    let mut out = Vec::new();
    for (name, gbnf) in grammars() {
        let mut row = Row {
            name,
            ours_us: Samples::default(),
            theirs_us: Samples::default(),
            ours_create_ms: Samples::default(),
            theirs_create_ms: Samples::default(),
            theirs_tokens: tokens,
            same_tokens: true,
        };
        let params = SamplerParams {
            grammar: Some(Grammar { text: gbnf.clone(), root: None }),
            ..SamplerParams::greedy()
        };
        for round in 0..rounds {
            let ours = |row: &mut Row| -> anyhow::Result<Vec<Token>> {
                let started = Instant::now();
                let mut s = Sampler::new(model.clone(), &params, &caps)?;
                row.ours_create_ms.push_secs(started.elapsed().as_secs_f64() * 1e3);
                let mut plain = Sampler::new(model.clone(), &SamplerParams::greedy(), &caps)?;
                let (mut picked, mut with, mut without) =
                    (Vec::new(), Duration::ZERO, Duration::ZERO);
                for l in &logits {
                    let t0 = Instant::now();
                    picked.push(s.sample(l)?);
                    with += t0.elapsed();
                    let t1 = Instant::now();
                    plain.sample(l)?;
                    without += t1.elapsed();
                }
                row.ours_us.push_secs(
                    with.saturating_sub(without).as_secs_f64() * 1e6 / logits.len() as f64,
                );
                Ok(picked)
            };
            let theirs = |row: &mut Row| -> anyhow::Result<Vec<Token>> {
                let started = Instant::now();
                let mut s = LlamaGrammar::new(raw, Some(&gbnf))?;
                row.theirs_create_ms.push_secs(started.elapsed().as_secs_f64() * 1e3);
                let mut plain = LlamaGrammar::new(raw, None)?;
                let (mut picked, mut with, mut without) =
                    (Vec::new(), Duration::ZERO, Duration::ZERO);
                for l in &logits {
                    if with > budget {
                        break;
                    }
                    let t0 = Instant::now();
                    let Some(t) = s.sample(l) else { break };
                    with += t0.elapsed();
                    picked.push(t);
                    let t1 = Instant::now();
                    plain.sample(l);
                    without += t1.elapsed();
                }
                row.theirs_us.push_secs(
                    with.saturating_sub(without).as_secs_f64() * 1e6 / picked.len().max(1) as f64,
                );
                row.theirs_tokens = row.theirs_tokens.min(picked.len());
                Ok(picked)
            };
            let (a, b) = if round % 2 == 0 {
                let a = ours(&mut row)?;
                (a, theirs(&mut row)?)
            } else {
                let b = theirs(&mut row)?;
                (ours(&mut row)?, b)
            };
            row.same_tokens &= a[..b.len()] == b[..];
        }
        eprintln!("grammar bench: {name} done");
        out.push(row);
    }
    // SAFETY: loaded above, freed once, after every sampler on it.
    unsafe { sys::llama_model_free(raw) };
    let machine = crate::machine::Machine::read();
    let mut md = format!(
        "# Grammar-constrained sampling: llguidance (llamabox) vs llama.cpp's GBNF matcher\n\n\
         {} ({} cores), ggml {}; model {} (n-vocab {}); 1 thread (sampling is single-threaded in both).\n\
         {rounds} paired rounds of {tokens} greedy tokens on seeded random logits (end of generation banned); \
         per-token cost = constrained pick − unconstrained pick, median (min–max) of rounds. \
         llama.cpp's matcher stops after {budget:?} of grammar time per round.\n\n\
         | grammar | llguidance µs/token | llama.cpp µs/token | llama.cpp / llguidance | compile ms (llguidance / llama.cpp) | same tokens |\n|---|---|---|---|---|---|\n",
        machine.cpu,
        machine.cores,
        machine.ggml_features.join(" "),
        model_path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        model.n_vocab(),
    );
    for r in &out {
        let cut = if r.theirs_tokens < tokens {
            format!(" ({} of {tokens} tokens within the budget)", r.theirs_tokens)
        } else {
            String::new()
        };
        md += &format!(
            "| {} | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}){cut} | {:.1}× | {:.1} / {:.1} | {} |\n",
            r.name,
            r.ours_us.median(),
            r.ours_us.min(),
            r.ours_us.max(),
            r.theirs_us.median(),
            r.theirs_us.min(),
            r.theirs_us.max(),
            r.theirs_us.median() / r.ours_us.median().max(1e-9),
            r.ours_create_ms.median(),
            r.theirs_create_ms.median(),
            if r.same_tokens { "yes" } else { "**no**" },
        );
    }
    Ok(md)
}
