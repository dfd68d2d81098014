//! Token sampling over llama.cpp's sampler chain (`llama_sampler_*`), safe for any
//! parameters: everything llama.cpp would assert on, throw through its C API (an abort
//! from Rust's side) or misbehave on is refused up front with `InvalidArgument`.
//!
//! A grammar is matched by llguidance (`native::grammar`), whose work per token is
//! bounded; it bans the tokens it does not allow before the chain runs (on the whole
//! vocabulary, so the truncating samplers only ever see tokens the grammar allows,
//! as in llama.cpp's own order). The chain is then, in llama.cpp's tools' order: logit
//! bias, penalties, top-k, typical, top-p, min-p, temperature, and the final pick:
//! greedy when the temperature is 0, else a seeded draw.

use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use super::grammar::{Constraint, GrammarCaps};
use super::model::Model;
use super::Token;
use super::{backend, Error, Result};

/// Sampling settings. `Default` is greedy decoding with nothing else applied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplerParams {
    /// 0 (or `None`): greedy, the highest logit wins. Otherwise logits are divided by
    /// this before a seeded draw. Finite and >= 0; below [`MIN_TEMPERATURE`] it samples
    /// greedily (the draw's limit as the temperature goes to 0).
    pub temperature: Option<f32>,
    /// Keep the `k` most likely tokens (>= 1).
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability adds up to `p`, in (0, 1].
    pub top_p: Option<f32>,
    /// Drop tokens less likely than `p` × the most likely one, in [0, 1].
    pub min_p: Option<f32>,
    /// Locally typical sampling with mass `p`, in (0, 1].
    pub typical_p: Option<f32>,
    /// Repetition penalties; `None`: none.
    pub penalties: Option<Penalties>,
    /// Seed of the draw (ignored when greedy). `None`: drawn from the OS.
    pub seed: Option<u32>,
    /// Added to a token's logit before anything else; `-inf` bans the token.
    pub logit_bias: Vec<(Token, f32)>,
    /// A GBNF grammar the output must follow, and its start rule (`root` if `None`).
    pub grammar: Option<Grammar>,
    /// A JSON Schema the output must be valid JSON for (not with `grammar`).
    pub json_schema: Option<String>,
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

/// A GBNF grammar for [`SamplerParams::grammar`].
#[derive(Clone, Debug, PartialEq)]
pub struct Grammar {
    /// The grammar's rules, in GBNF.
    pub text: String,
    /// The rule the output must match; `None`: `root`.
    pub root: Option<String>,
}

/// Temperatures below this sample greedily. llama.cpp's temperature stage divides the
/// logits by it: near 1e-38 that overflows to infinities, the softmax turns them into
/// NaN, and the draw picked a banned token ("the grammar excludes every token" with no
/// grammar). Above f32's epsilon no logit can overflow, and the draw is already greedy
/// in all but exact ties.
pub const MIN_TEMPERATURE: f32 = f32::EPSILON;

/// Caps that keep one sampler's memory and the grammar parser's recursion bounded.
/// The component layer sets them from host policy.
#[derive(Clone, Copy, Debug)]
pub struct SamplerCaps {
    /// Longest grammar in bytes: parsing and compiling it is linear in its size.
    pub max_grammar_bytes: usize,
    /// Deepest nesting of `(` groups in a grammar (each level is parser recursion, here
    /// and in llguidance's reader).
    pub max_grammar_nesting: usize,
    /// Most entries in `logit_bias`.
    pub max_logit_bias: usize,
    /// Largest `penalties.last-n` (the sampler allocates a ring of that many tokens).
    pub max_penalty_last_n: u32,
}

impl Default for SamplerCaps {
    fn default() -> Self {
        let grammar = GrammarCaps::default();
        Self {
            max_grammar_bytes: grammar.max_bytes,
            max_grammar_nesting: grammar.max_nesting,
            max_logit_bias: 1024,
            max_penalty_last_n: 4096,
        }
    }
}

impl SamplerCaps {
    fn grammar(&self) -> GrammarCaps {
        GrammarCaps {
            max_bytes: self.max_grammar_bytes,
            max_nesting: self.max_grammar_nesting,
            ..GrammarCaps::default()
        }
    }
}

/// A llama.cpp sampler chain for one model's vocabulary, and the grammar's matcher.
/// Keeps state between tokens (the penalties' history, the grammar's position, the
/// draw's random state), so one sampler follows one stream of tokens.
pub struct Sampler {
    chain: NonNull<sys::llama_sampler>,
    grammar: Option<Constraint>,
    /// Candidates, reused between calls (n-vocab entries).
    candidates: Vec<sys::llama_token_data>,
    model: Arc<Model>,
}

// SAFETY: a sampler chain is plain state used by one thread at a time (`&mut self` for
// every call); nothing in it is tied to the thread that made it. The grammar's matcher
// is Send (asserted at compile time in grammar.rs).
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
            if p.last_n == 0 {
                return invalid("penalties.last-n must be >= 1".into());
            }
            if p.last_n > caps.max_penalty_last_n {
                return Err(Error::limit("max-penalty-last-n", p.last_n, caps.max_penalty_last_n));
            }
            if !p.repeat.is_finite() || p.repeat <= 0.0 {
                return invalid(format!("penalties.repeat {} must be finite and > 0", p.repeat));
            }
            if !p.frequency.is_finite() || !p.presence.is_finite() {
                return invalid("penalties.frequency and penalties.presence must be finite".into());
            }
        }
        if self.logit_bias.len() > caps.max_logit_bias {
            return Err(Error::limit("max-logit-bias", self.logit_bias.len(), caps.max_logit_bias));
        }
        for &(token, bias) in &self.logit_bias {
            model.check_tokens(&[token])?;
            if bias.is_nan() || bias == f32::INFINITY {
                return invalid(format!(
                    "logit bias {bias} for token {token} must be finite or -inf"
                ));
            }
        }
        Ok(())
    }
}

impl Sampler {
    /// Build the chain and compile the grammar. Parameters are checked first; a grammar
    /// that does not parse, or is over a cap, is `InvalidArgument` with the reason.
    /// Bounded work (the grammar's size is capped), but the first grammar of a model
    /// also builds that model's token trie: call it off the executor.
    pub fn new(model: Arc<Model>, params: &SamplerParams, caps: &SamplerCaps) -> Result<Self> {
        backend::init();
        params.check(&model, caps)?;
        let n_vocab = model.n_vocab() as i32;
        // SAFETY: plain constructors (default params); the chain, freed in `Drop`, owns
        // every stage added to it; a null return is handled.
        let chain = NonNull::new(unsafe {
            sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params())
        })
        .ok_or_else(|| Error::Backend("llama.cpp could not create a sampler chain".into()))?;
        let mut sampler = Self { chain, grammar: None, candidates: Vec::new(), model };
        let add =
            |s: &Self, stage: *mut sys::llama_sampler| -> Result<NonNull<sys::llama_sampler>> {
                let stage = NonNull::new(stage)
                    .ok_or_else(|| Error::Backend("llama.cpp could not create a sampler".into()))?;
                // SAFETY: a live chain and a new, non-null stage owned by no one else: the chain
                // takes ownership of it and frees it with itself (never twice: `stage` is only
                // returned for identification, never freed by us).
                unsafe { sys::llama_sampler_chain_add(s.chain.as_ptr(), stage.as_ptr()) };
                Ok(stage)
            };
        if !params.logit_bias.is_empty() {
            let bias: Vec<sys::llama_logit_bias> = params
                .logit_bias
                .iter()
                .map(|&(token, bias)| sys::llama_logit_bias { token, bias })
                .collect();
            // SAFETY: `bias` holds `bias.len()` entries, alive for the call, which llama.cpp
            // copies; every token was checked in [0, n_vocab) (llama.cpp bounds-checks too).
            add(&sampler, unsafe {
                sys::llama_sampler_init_logit_bias(n_vocab, bias.len() as i32, bias.as_ptr())
            })?;
        }
        if let Some(p) = &params.penalties {
            // SAFETY: a plain constructor, ranges checked; it allocates a ring of `last_n`
            // tokens, which `check` capped.
            add(&sampler, unsafe {
                sys::llama_sampler_init_penalties(
                    n_vocab,
                    p.last_n as i32,
                    p.repeat,
                    p.frequency,
                    p.presence,
                )
            })?;
        }
        sampler.grammar = match (&params.grammar, &params.json_schema) {
            (Some(_), Some(_)) => {
                return invalid(
                    "a grammar and a json-schema cannot both constrain one sampler".into(),
                )
            }
            (Some(g), None) => Some(Constraint::gbnf(
                &*sampler.model,
                &g.text,
                g.root.as_deref().unwrap_or("root"),
                &caps.grammar(),
            )?),
            (None, Some(schema)) => {
                Some(Constraint::json_schema(&*sampler.model, schema, &caps.grammar())?)
            }
            (None, None) => None,
        };
        let greedy = params.temperature.is_none_or(|t| t < MIN_TEMPERATURE);
        if !greedy {
            // The constructors below take numbers only and allocate a stage that `add` hands
            // to the chain; their parameters were checked in range by `check`.
            if let Some(k) = params.top_k {
                // SAFETY: a plain constructor; k >= 1 (checked), capped to i32.
                add(&sampler, unsafe {
                    sys::llama_sampler_init_top_k(k.min(i32::MAX as u32) as i32)
                })?;
            }
            if let Some(p) = params.typical_p {
                // SAFETY: a plain constructor; p in (0, 1] (checked).
                add(&sampler, unsafe { sys::llama_sampler_init_typical(p, 1) })?;
            }
            if let Some(p) = params.top_p {
                // SAFETY: a plain constructor; p in (0, 1] (checked).
                add(&sampler, unsafe { sys::llama_sampler_init_top_p(p, 1) })?;
            }
            if let Some(p) = params.min_p {
                // SAFETY: a plain constructor; p in [0, 1] (checked).
                add(&sampler, unsafe { sys::llama_sampler_init_min_p(p, 1) })?;
            }
            // SAFETY: a plain constructor; a finite temperature >= MIN_TEMPERATURE here.
            add(&sampler, unsafe {
                sys::llama_sampler_init_temp(params.temperature.unwrap_or(1.0))
            })?;
            let seed = match params.seed {
                Some(seed) => seed,
                None => {
                    let mut bytes = [0u8; 4];
                    getrandom::fill(&mut bytes)
                        .map_err(|e| Error::Backend(format!("OS random source: {e}")))?;
                    // LLAMA_DEFAULT_SEED (u32::MAX) asks llama.cpp for its own random seed.
                    u32::from_le_bytes(bytes).min(u32::MAX - 1)
                }
            };
            // SAFETY: a plain constructor; any seed is valid.
            add(&sampler, unsafe { sys::llama_sampler_init_dist(seed) })?;
        } else {
            // SAFETY: a plain constructor without arguments.
            add(&sampler, unsafe { sys::llama_sampler_init_greedy() })?;
        }
        let n = sampler.model.n_vocab() as usize;
        sampler.candidates = Vec::with_capacity(n);
        Ok(sampler)
    }

    /// The model whose vocabulary this sampler was made for.
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
        self.candidates.extend(
            logits.iter().enumerate().map(|(id, &logit)| sys::llama_token_data {
                id: id as Token,
                logit,
                p: 0.0,
            }),
        );
        if let Some(grammar) = &mut self.grammar {
            let mask = grammar.mask()?;
            let mut any = false;
            for c in &mut self.candidates {
                if mask.is_allowed(c.id as u32) {
                    any = true;
                } else {
                    c.logit = f32::NEG_INFINITY;
                }
            }
            if !any {
                return invalid("no token is allowed here: the grammar allows none".into());
            }
        }
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
        // SAFETY: `i < size` and `data` points at `size` entries (llama.cpp's contract for
        // apply: within `candidates`, which is alive and not touched since).
        let picked = picked.map(|i| unsafe { *array.data.add(i) });
        match picked {
            // A -inf pick means every token was banned (by the bias, and the grammar).
            Some(t) if t.logit != f32::NEG_INFINITY && self.model.is_valid(t.id) => {
                if let Some(grammar) = &mut self.grammar {
                    grammar.accept(t.id)?;
                }
                // SAFETY: a live chain (`&mut self`) and a token in the vocabulary (checked
                // by `is_valid`), which is all its stages take.
                unsafe { sys::llama_sampler_accept(self.chain.as_ptr(), t.id) };
                Ok(t.id)
            }
            _ if self.grammar.is_some() => invalid("no token is allowed here: every token the grammar allows has logit -inf (banned by the row or the logit bias)".into()),
            _ => invalid("no token is allowed here: every logit is -inf (banned by the row or the logit bias)".into()),
        }
    }

    /// Record `token` as chosen (penalties' history, the grammar's position, ...), for a
    /// plugin that picks tokens itself. A token the grammar does not allow here is
    /// refused (llama.cpp would abort).
    pub fn accept(&mut self, token: Token) -> Result<()> {
        self.model.check_tokens(&[token])?;
        if let Some(grammar) = &mut self.grammar {
            if !grammar.allows(token) {
                return invalid(format!("token {token} is not allowed by the grammar here"));
            }
            grammar.accept(token)?;
        }
        // SAFETY: a live chain (`&mut self`) and a token in the vocabulary (checked above).
        unsafe { sys::llama_sampler_accept(self.chain.as_ptr(), token) };
        Ok(())
    }

    /// Forget the history: penalties, grammar position, and the draw restarts from its seed.
    pub fn reset(&mut self) -> Result<()> {
        if let Some(grammar) = &mut self.grammar {
            grammar.reset()?;
        }
        // SAFETY: the chain is live; resetting touches only its own state.
        unsafe { sys::llama_sampler_reset(self.chain.as_ptr()) };
        Ok(())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: the chain made in `new`, owned by this sampler alone and freed once; it
        // frees every stage added to it.
        unsafe { sys::llama_sampler_free(self.chain.as_ptr()) }
    }
}
