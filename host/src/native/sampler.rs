//! Token sampling over llama.cpp's sampler chain (`llama_sampler_*`), safe for any
//! parameters: everything llama.cpp would assert on, throw through its C API (an abort
//! from Rust's side) or misbehave on is refused up front with `InvalidArgument`.
//!
//! The chain is built in a fixed order, the one llama.cpp's own tools use: logit bias,
//! penalties, grammar (on the whole vocabulary, so the truncating samplers only ever
//! see tokens the grammar allows), top-k, typical, top-p, min-p, temperature, then the
//! final pick: greedy when the temperature is 0, else a seeded draw.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use super::model::{Model, Token};
use super::{backend, Error, Result};

/// Sampling settings. `Default` is greedy decoding with nothing else applied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplerParams {
    /// 0 (or `None`): greedy, the highest logit wins. Otherwise logits are divided by
    /// this before a seeded draw. Finite and >= 0.
    pub temperature: Option<f32>,
    /// Keep the `k` most likely tokens (>= 1).
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability adds up to `p`, in (0, 1].
    pub top_p: Option<f32>,
    /// Drop tokens less likely than `p` × the most likely one, in [0, 1].
    pub min_p: Option<f32>,
    /// Locally typical sampling with mass `p`, in (0, 1].
    pub typical_p: Option<f32>,
    pub penalties: Option<Penalties>,
    /// Seed of the draw (ignored when greedy). `None`: drawn from the OS.
    pub seed: Option<u32>,
    /// Added to a token's logit before anything else; `-inf` bans the token.
    pub logit_bias: Vec<(Token, f32)>,
    /// A GBNF grammar the output must follow, and its start rule (`root` if `None`).
    pub grammar: Option<Grammar>,
}

/// Repetition penalties over the last `last_n` tokens the sampler accepted.
#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    /// How many recent tokens count (>= 1; the sampler keeps a ring of this many).
    pub last_n: u32,
    /// Divides positive logits (multiplies negative ones) of repeated tokens; > 0, 1 = off.
    pub repeat: f32,
    /// Subtracted once per occurrence; finite, 0 = off.
    pub frequency: f32,
    /// Subtracted once if present at all; finite, 0 = off.
    pub presence: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Grammar {
    pub text: String,
    pub root: Option<String>,
}

/// Caps that keep one sampler's memory and the grammar parser's recursion bounded.
/// The component layer sets them from host policy.
#[derive(Clone, Copy, Debug)]
pub struct SamplerCaps {
    /// Longest grammar in bytes: llama.cpp's grammar parser and matcher recurse over
    /// nested groups and rule chains, and their depth grows with the text.
    pub max_grammar_bytes: usize,
    /// Deepest nesting of `(` groups in a grammar (each level is parser recursion).
    pub max_grammar_nesting: usize,
    pub max_logit_bias: usize,
    /// Largest `penalties.last-n` (the sampler allocates a ring of that many tokens).
    pub max_penalty_last_n: u32,
}

impl Default for SamplerCaps {
    fn default() -> Self {
        Self { max_grammar_bytes: 16 << 10, max_grammar_nesting: 64, max_logit_bias: 1024, max_penalty_last_n: 4096 }
    }
}

/// A llama.cpp sampler chain for one model's vocabulary. Keeps state between tokens
/// (the penalties' history, the grammar's position, the draw's random state), so one
/// sampler follows one stream of tokens.
pub struct Sampler {
    chain: NonNull<sys::llama_sampler>,
    /// The grammar stage, owned by `chain` (valid while it lives), to check a token
    /// before accepting it: llama.cpp throws (an abort) on a token its grammar rejects.
    grammar: Option<NonNull<sys::llama_sampler>>,
    /// Candidates, reused between calls (n-vocab entries).
    candidates: Vec<sys::llama_token_data>,
    /// Declared last: the vocabulary the grammar stage points into must outlive it.
    model: Arc<Model>,
}

// SAFETY: a sampler chain is plain state used by one thread at a time (`&mut self` for
// every call); nothing in it is tied to the thread that made it.
unsafe impl Send for Sampler {}

fn invalid<T>(what: String) -> Result<T> {
    Err(Error::InvalidArgument(what))
}

impl SamplerParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Everything llama.cpp would assert on or misread, checked against `caps`.
    pub fn check(&self, model: &Model, caps: &SamplerCaps) -> Result<()> {
        let unit = |name: &str, v: Option<f32>, zero_ok: bool| match v {
            Some(p) if !(0.0..=1.0).contains(&p) || (p == 0.0 && !zero_ok) => {
                let range = if zero_ok { "[0, 1]" } else { "(0, 1]" };
                invalid(format!("{name} {p} is outside {range}"))
            }
            _ => Ok(()),
        };
        if let Some(t) = self.temperature {
            if !t.is_finite() || t < 0.0 {
                return invalid(format!("temperature {t} must be finite and >= 0"));
            }
        }
        if self.top_k == Some(0) {
            return invalid("top-k must be >= 1".into());
        }
        unit("top-p", self.top_p, false)?;
        unit("min-p", self.min_p, true)?;
        unit("typical-p", self.typical_p, false)?;
        if let Some(p) = &self.penalties {
            if p.last_n == 0 || p.last_n > caps.max_penalty_last_n {
                return invalid(format!("penalties.last-n {} is outside [1, {}]", p.last_n, caps.max_penalty_last_n));
            }
            if !p.repeat.is_finite() || p.repeat <= 0.0 {
                return invalid(format!("penalties.repeat {} must be finite and > 0", p.repeat));
            }
            if !p.frequency.is_finite() || !p.presence.is_finite() {
                return invalid("penalties.frequency and penalties.presence must be finite".into());
            }
        }
        if self.logit_bias.len() > caps.max_logit_bias {
            return Err(Error::InvalidArgument(format!(
                "{} logit-bias entries is above the limit {}",
                self.logit_bias.len(),
                caps.max_logit_bias
            )));
        }
        for &(token, bias) in &self.logit_bias {
            model.check_tokens(&[token])?;
            if bias.is_nan() || bias == f32::INFINITY {
                return invalid(format!("logit bias {bias} for token {token} must be finite or -inf"));
            }
        }
        if let Some(g) = &self.grammar {
            check_grammar(g, caps)?;
        }
        Ok(())
    }
}

/// Size, NUL bytes and nesting: what would crash or overflow llama.cpp's parser rather
/// than fail it. Whether the grammar parses is llama.cpp's call.
fn check_grammar(g: &Grammar, caps: &SamplerCaps) -> Result<()> {
    if g.text.len() > caps.max_grammar_bytes {
        return invalid(format!("grammar of {} bytes is above the limit {}", g.text.len(), caps.max_grammar_bytes));
    }
    if g.text.trim().is_empty() {
        return invalid("grammar is empty".into());
    }
    let root = g.root.as_deref().unwrap_or("root");
    if g.text.contains('\0') || root.contains('\0') {
        return invalid("grammar contains a NUL byte".into());
    }
    if root.is_empty() {
        return invalid("grammar root rule name is empty".into());
    }
    // Group nesting outside literals, comments and character classes: each `(` is one
    // level of recursion in llama.cpp's parser (parse_sequence -> parse_alternates).
    let (mut depth, mut deepest, mut repeated) = (0usize, 0usize, 0u64);
    let mut chars = g.text.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '[' => {
                let close = if c == '"' { '"' } else { ']' };
                while let Some(d) = chars.next() {
                    if d == '\\' {
                        chars.next();
                    } else if d == close {
                        break;
                    }
                }
            }
            '#' => {
                for d in chars.by_ref() {
                    if d == '\n' {
                        break;
                    }
                }
            }
            '(' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            ')' => depth = depth.saturating_sub(1),
            '{' => {
                let body: String = chars.by_ref().take_while(|&d| d != '}').collect();
                repeated = repeated.saturating_add(check_repetition(&body)?);
            }
            _ => {}
        }
    }
    if deepest > caps.max_grammar_nesting {
        return invalid(format!("grammar nests groups {deepest} deep, above the limit {}", caps.max_grammar_nesting));
    }
    if repeated > MAX_GRAMMAR_REPETITIONS {
        return invalid(format!(
            "grammar repetitions {{m,n}} add up to {repeated} copies, above the limit {MAX_GRAMMAR_REPETITIONS}"
        ));
    }
    Ok(())
}

/// Copies of a symbol all `{m,n}` of a grammar may ask for together. llama.cpp expands
/// each into up to max(m, n) rules or symbols (it caps one at 2000, not their sum), so
/// 16 KiB of `"a"{0,2000}` would become millions of rules: hundreds of MB.
const MAX_GRAMMAR_REPETITIONS: u64 = 4096;

/// The copies one `{m,n}` / `{m}` / `{m,}` asks for. `{m,n}` with n < m is refused:
/// llama.cpp's parser computes n - m in unsigned 64 bits and would generate rules until
/// the host runs out of memory. Anything malformed llama.cpp refuses by itself.
fn check_repetition(body: &str) -> Result<u64> {
    let count = |s: &str| s.trim().parse::<u64>().ok();
    Ok(match body.split_once(',') {
        Some((min, max)) if max.trim().is_empty() => count(min).map_or(0, |m| m.saturating_add(1)),
        Some((min, max)) => match (count(min), count(max)) {
            (Some(min), Some(max)) if max < min => {
                return invalid(format!("grammar repetition {{{}}} has a maximum below its minimum", body.trim()))
            }
            (min, max) => min.max(max).unwrap_or(0),
        },
        None => count(body).unwrap_or(0),
    })
}

impl Sampler {
    /// Build the chain. Parameters are checked first; a grammar llama.cpp cannot parse
    /// is `InvalidArgument` with llama.cpp's reason.
    pub fn new(model: Arc<Model>, params: &SamplerParams, caps: &SamplerCaps) -> Result<Self> {
        backend::init();
        params.check(&model, caps)?;
        let n_vocab = model.n_vocab() as i32;
        // SAFETY: default params; the chain owns every stage added to it.
        let chain = NonNull::new(unsafe { sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params()) })
            .ok_or_else(|| Error::Backend("llama.cpp could not create a sampler chain".into()))?;
        let mut sampler = Self { chain, grammar: None, candidates: Vec::new(), model };
        let add = |s: &Self, stage: *mut sys::llama_sampler| -> Result<NonNull<sys::llama_sampler>> {
            let stage = NonNull::new(stage).ok_or_else(|| Error::Backend("llama.cpp could not create a sampler".into()))?;
            // SAFETY: the chain takes ownership of the stage and frees it with itself.
            unsafe { sys::llama_sampler_chain_add(s.chain.as_ptr(), stage.as_ptr()) };
            Ok(stage)
        };
        if !params.logit_bias.is_empty() {
            let bias: Vec<sys::llama_logit_bias> =
                params.logit_bias.iter().map(|&(token, bias)| sys::llama_logit_bias { token, bias }).collect();
            // SAFETY: tokens checked in-vocabulary; llama.cpp copies the array.
            add(&sampler, unsafe { sys::llama_sampler_init_logit_bias(n_vocab, bias.len() as i32, bias.as_ptr()) })?;
        }
        if let Some(p) = &params.penalties {
            // SAFETY: checked ranges; allocates a ring of `last_n` (capped) tokens.
            add(&sampler, unsafe { sys::llama_sampler_init_penalties(n_vocab, p.last_n as i32, p.repeat, p.frequency, p.presence) })?;
        }
        if let Some(g) = &params.grammar {
            let stage = sampler.grammar_stage(g)?;
            sampler.grammar = Some(add(&sampler, stage)?);
        }
        let greedy = params.temperature.is_none_or(|t| t == 0.0);
        if !greedy {
            // SAFETY (all below): parameters checked in range above.
            if let Some(k) = params.top_k {
                add(&sampler, unsafe { sys::llama_sampler_init_top_k(k.min(i32::MAX as u32) as i32) })?;
            }
            if let Some(p) = params.typical_p {
                add(&sampler, unsafe { sys::llama_sampler_init_typical(p, 1) })?;
            }
            if let Some(p) = params.top_p {
                add(&sampler, unsafe { sys::llama_sampler_init_top_p(p, 1) })?;
            }
            if let Some(p) = params.min_p {
                add(&sampler, unsafe { sys::llama_sampler_init_min_p(p, 1) })?;
            }
            add(&sampler, unsafe { sys::llama_sampler_init_temp(params.temperature.unwrap_or(1.0)) })?;
            let seed = match params.seed {
                Some(seed) => seed,
                None => {
                    let mut bytes = [0u8; 4];
                    getrandom::fill(&mut bytes).map_err(|e| Error::Backend(format!("OS random source: {e}")))?;
                    // LLAMA_DEFAULT_SEED (u32::MAX) asks llama.cpp for its own random seed.
                    u32::from_le_bytes(bytes).min(u32::MAX - 1)
                }
            };
            add(&sampler, unsafe { sys::llama_sampler_init_dist(seed) })?;
        } else {
            add(&sampler, unsafe { sys::llama_sampler_init_greedy() })?;
        }
        let n = sampler.model.n_vocab() as usize;
        sampler.candidates = Vec::with_capacity(n);
        Ok(sampler)
    }

    /// Parse the grammar into a stage (not yet owned by the chain). llama.cpp logs why a
    /// grammar fails (its parser's detail goes to stderr); the last error line it logged
    /// on this thread becomes the message.
    fn grammar_stage(&self, g: &Grammar) -> Result<*mut sys::llama_sampler> {
        let text = CString::new(g.text.as_str()).map_err(|_| Error::InvalidArgument("grammar contains a NUL byte".into()))?;
        let root = CString::new(g.root.as_deref().unwrap_or("root"))
            .map_err(|_| Error::InvalidArgument("grammar root contains a NUL byte".into()))?;
        // SAFETY: valid C strings and the model's vocabulary; a parse failure returns
        // null (the parser catches its own exceptions).
        let (stage, reason) = backend::with_errors(|| unsafe {
            sys::llama_sampler_init_grammar(self.model.vocab_ptr(), text.as_ptr(), root.as_ptr())
        });
        if stage.is_null() {
            return invalid(format!("grammar: {reason}"));
        }
        Ok(stage)
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Pick a token from one row of logits (n-vocab floats) and accept it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<Token> {
        let n_vocab = self.model.n_vocab() as usize;
        if logits.len() != n_vocab {
            return invalid(format!("{} logits for a vocabulary of {n_vocab}", logits.len()));
        }
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().map(|(id, &logit)| sys::llama_token_data { id: id as Token, logit, p: 0.0 }));
        let mut array = sys::llama_token_data_array {
            data: self.candidates.as_mut_ptr(),
            size: self.candidates.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: `array` points at `candidates`, alive and unaliased for the call;
        // samplers may reorder, shrink or re-point `data` within it.
        unsafe { sys::llama_sampler_apply(self.chain.as_ptr(), &mut array) };
        let picked = usize::try_from(array.selected).ok().filter(|&i| i < array.size);
        // SAFETY: `data` points at `size` entries (llama.cpp's contract for apply).
        let picked = picked.map(|i| unsafe { *array.data.add(i) });
        match picked {
            // A -inf pick means every token was banned (by the grammar or a bias):
            // accepting it would make the grammar throw.
            Some(t) if t.logit != f32::NEG_INFINITY && self.model.is_valid(t.id) => {
                // SAFETY: the token passed the grammar stage of this very apply.
                unsafe { sys::llama_sampler_accept(self.chain.as_ptr(), t.id) };
                Ok(t.id)
            }
            _ => invalid("no token is allowed here (the grammar or logit bias excludes every token)".into()),
        }
    }

    /// Record `token` as chosen (penalties' history, the grammar's position, ...), for a
    /// plugin that picks tokens itself. A token the grammar does not allow here is
    /// refused (llama.cpp would abort).
    pub fn accept(&mut self, token: Token) -> Result<()> {
        self.model.check_tokens(&[token])?;
        if let Some(grammar) = self.grammar {
            let mut one = sys::llama_token_data { id: token, logit: 0.0, p: 0.0 };
            let mut array = sys::llama_token_data_array { data: &mut one, size: 1, selected: -1, sorted: false };
            // SAFETY: the grammar stage lives as long as the chain; one valid candidate.
            unsafe { sys::llama_sampler_apply(grammar.as_ptr(), &mut array) };
            if one.logit == f32::NEG_INFINITY {
                return invalid(format!("token {token} is not allowed by the grammar here"));
            }
        }
        // SAFETY: token in vocabulary and, if there is a grammar, allowed by it.
        unsafe { sys::llama_sampler_accept(self.chain.as_ptr(), token) };
        Ok(())
    }

    /// Forget the history: penalties, grammar position, and the draw restarts from its seed.
    pub fn reset(&mut self) {
        unsafe { sys::llama_sampler_reset(self.chain.as_ptr()) }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: the chain owns (and frees) every stage, the grammar stage included.
        unsafe { sys::llama_sampler_free(self.chain.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> SamplerCaps {
        SamplerCaps::default()
    }

    fn grammar(text: &str) -> Grammar {
        Grammar { text: text.into(), root: None }
    }

    #[test]
    fn grammar_nesting_and_size_are_capped_before_llama_cpp_sees_them() {
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(65), ")".repeat(65));
        let err = check_grammar(&grammar(&deep), &caps()).unwrap_err();
        assert!(err.to_string().contains("nests groups 65 deep"), "{err}");
        // Parentheses inside literals, classes and comments are not nesting.
        let quoted = format!("root ::= \"{}\" [(] # {}\n", "(".repeat(100), "(".repeat(100));
        check_grammar(&grammar(&quoted), &caps()).unwrap();
        let big = format!("root ::= \"{}\"", "a".repeat(16 << 10));
        assert!(check_grammar(&grammar(&big), &caps()).unwrap_err().to_string().contains("above the limit"));
        assert!(check_grammar(&grammar("  "), &caps()).is_err());
        let backwards = check_grammar(&grammar("root ::= \"a\"{ 5 , 2 }"), &caps()).unwrap_err();
        assert!(backwards.to_string().contains("maximum below its minimum"), "{backwards}");
        check_grammar(&grammar("root ::= \"a\"{2,5} \"{9,1}\" [{] \"b\"{3} \"c\"{1,}"), &caps()).unwrap();
        let many = "root ::= x\n".to_string() + &"x ::= \"a\"{0,2000}\n".repeat(3);
        assert!(check_grammar(&grammar(&many), &caps()).unwrap_err().to_string().contains("add up to 6000"));
        check_grammar(&grammar(&("root ::= x\n".to_string() + &"x ::= \"a\"{0,2000}\n".repeat(2))), &caps()).unwrap();
        assert!(check_grammar(&grammar("root ::= \"\0\""), &caps()).is_err());
    }
}
