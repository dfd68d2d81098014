//! The sampling fields chat and text completions share (and the APIs mapped onto chat):
//! how they are read and checked, and what they ask of the host's sampler.

use crate::api::{self, ApiError, Object, OneOrMany};
use llamabox_guest::generate::{self, LogitBias, Penalties, SamplerParams};
use llamabox_guest::llm::Model;

/// Most choices one request may ask for (`n` × prompts): each needs a context, and
/// the host's default `max-contexts` per run is 4.
pub const MAX_CHOICES: usize = 4;

/// Context size cap when `LLAMABOX_N_CTX` does not set one (the model's training length caps it too).
pub(crate) const DEFAULT_N_CTX: u32 = 4096;

/// Contexts are sized in steps of llama.cpp's own padding (it allocates multiples of
/// 256 cells anyway), so requests of similar length ask for the same settings and the
/// host can hand one request's idle context to the next, which then reuses the start
/// of the prompt they share (the chat template's system part, earlier turns).
pub(crate) const CONTEXT_STEP: u32 = 256;
/// The host's default `max-generate-tokens`.
pub(crate) const MAX_GENERATE_TOKENS: u32 = 4096;
/// The host's default `max-stop-strings` and `max-stop-bytes`.
pub(crate) const MAX_STOP_STRINGS: usize = 8;
pub(crate) const MAX_STOP_BYTES: usize = 256;
/// Recent tokens that presence and frequency penalties look at.
pub(crate) const PENALTY_LAST_N: u32 = 64;
/// Text completions' bound on `logprobs` (OpenAI's); chat's `top_logprobs` goes to the
/// host's bound, 20.
pub(crate) const MAX_TEXT_LOGPROBS: u32 = 5;
pub(crate) const MAX_TOP_LOGPROBS: u32 = 20;
/// The host's max-penalty-last-n by default.
pub(crate) const MAX_REPEAT_LAST_N: u32 = 4096;
/// Fields chat and text completions both honour (OpenAI's, llama-server's sampler
/// extras, and `user`, which OpenAI uses only to attribute abuse). Any other field is
/// refused by name unless it is off.
const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
    "n",
    "user",
    "response_format",
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "grammar",
    "json_schema",
    "ignore_eos",
];

/// Fields chat and text completions accept with the values that ask for what this
/// server does anyway (OpenAI's defaults, or a hint that changes no answer), and refuse
/// by name with any other, which would change the answer:
/// - `service_tier`: `"auto"` or `"default"` (one tier here; `flex`, `priority` refused);
/// - `modalities`: `["text"]` (text out; `audio` refused);
/// - `function_call` (the legacy form of `tool_choice`): `"none"` or `"auto"`, which
///   call nothing without legacy `functions` (and `functions` are refused);
/// - `prompt_cache_key` and `safety_identifier`: any string (a hint for routing to a
///   cache, and an end user's id for abuse reports, like `user`: neither changes an
///   answer; this server reuses cached prompt starts by itself);
/// - `best_of` (text completions): equal to `n` (read in `completion`);
/// - `cache_salt` (vLLM's): a string; the server (not the plugin) reads it from the body
///   and keeps the request's prompt cache apart from requests with another salt.
/// Any field at all is accepted off (`null`, `false`, `[]`): `store: false`,
/// `logprobs: false`, `echo: false`, `audio: null`, ...
const AS_DEFAULT: &[api::AsDefault] = &[
    api::AsDefault {
        name: "service_tier",
        values: "\"auto\" or \"default\"",
        accepts: |v| matches!(v.as_str(), Some("auto" | "default")),
    },
    api::AsDefault {
        name: "modalities",
        values: "[\"text\"]",
        accepts: |v| v.as_array().is_some_and(|m| m.len() == 1 && m[0] == "text"),
    },
    api::AsDefault {
        name: "function_call",
        values: "\"none\" or \"auto\"",
        accepts: |v| matches!(v.as_str(), Some("none" | "auto")),
    },
    api::AsDefault {
        name: "prompt_cache_key",
        values: "a string",
        accepts: serde_json::Value::is_string,
    },
    api::AsDefault {
        name: "safety_identifier",
        values: "a string",
        accepts: serde_json::Value::is_string,
    },
    api::AsDefault {
        name: "cache_salt",
        values: "a string",
        accepts: serde_json::Value::is_string,
    },
];

/// How output is constrained: a GBNF grammar or a JSON Schema (text), or neither.
pub(crate) enum Constraint {
    None,
    Grammar(String),
    JsonSchema(String),
}

/// The sampling fields chat and text completions share.
pub(crate) struct Sampling {
    /// Choices per prompt (`n`), in [1, MAX_CHOICES].
    pub n: u32,
    /// Alternatives per token when log-probabilities were asked for (chat's
    /// `logprobs` + `top_logprobs`, text's `logprobs`); set by the endpoint.
    pub logprobs: Option<u32>,
    /// The answer is a tool-call envelope ([`Tools`]), read back by the endpoint.
    pub tool_calls: bool,
    /// The envelope's `response` is JSON following the request's `response_format`.
    pub json_response: bool,
    /// The answer must call a tool.
    pub forced_call: bool,
    /// The field the constraint came from, for errors about it.
    pub constraint_param: &'static str,
    pub max_tokens: Option<u32>,
    temperature: f32,
    top_p: f32,
    seed: Option<i64>,
    pub stop: Vec<String>,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(String, f32)>,
    pub stream: bool,
    pub include_usage: bool,
    /// llama-server's extras: 0 / 1.0 / 0 mean off, as there.
    top_k: u32,
    min_p: f32,
    typical_p: f32,
    repeat_penalty: f32,
    repeat_last_n: u32,
    ignore_eos: bool,
    pub constraint: Constraint,
}

impl Sampling {
    /// The shared fields of `body`, after refusing any field outside `SAMPLING_FIELDS`
    /// and `own` (the endpoint's own fields).
    pub(crate) fn read(body: &Object, own: &[&str]) -> Result<Self, ApiError> {
        let honoured: Vec<&str> = SAMPLING_FIELDS.iter().chain(own).copied().collect();
        body.refuse_unknown_but(&honoured, AS_DEFAULT)?;
        let in_range = |name: &str, value: Option<f32>, default: f32, lo: f32, hi: f32| match value
        {
            Some(v) if !(lo..=hi).contains(&v) => Err(ApiError::invalid(
                format!("'{name}' must be between {lo} and {hi}"),
                Some(name),
            )),
            v => Ok(v.unwrap_or(default)),
        };
        let n: u32 = body.get("n")?.unwrap_or(1);
        if n == 0 || n as usize > MAX_CHOICES {
            return Err(ApiError::invalid(
                format!("'n' must be between 1 and {MAX_CHOICES}"),
                Some("n"),
            ));
        }
        // `max_completion_tokens` is the newer name of `max_tokens`.
        let (max_name, max_tokens) = match body.get::<u32>("max_completion_tokens")? {
            Some(n) => ("max_completion_tokens", Some(n)),
            None => ("max_tokens", body.get::<u32>("max_tokens")?),
        };
        match max_tokens {
            Some(0) => {
                return Err(ApiError::invalid(
                    format!("'{max_name}' must be at least 1"),
                    Some(max_name),
                ))
            }
            Some(n) if n > MAX_GENERATE_TOKENS => {
                return Err(ApiError::invalid(
                    format!("'{max_name}' must be at most {MAX_GENERATE_TOKENS}"),
                    Some(max_name),
                ))
            }
            _ => {}
        }
        let stop: Vec<String> =
            body.get::<OneOrMany<String>>("stop")?.map(OneOrMany::into_vec).unwrap_or_default();
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        if stop.len() > MAX_STOP_STRINGS || stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            let message = format!(
                "At most {MAX_STOP_STRINGS} stop sequences of at most {MAX_STOP_BYTES} bytes each"
            );
            return Err(ApiError::invalid(message, Some("stop")));
        }
        let logit_bias: std::collections::BTreeMap<String, f32> =
            body.get("logit_bias")?.unwrap_or_default();
        if let Some((token, _)) =
            logit_bias.iter().find(|(_, &bias)| !(-100.0..=100.0).contains(&bias))
        {
            return Err(ApiError::invalid(
                format!("The bias of token {token} must be between -100 and 100"),
                Some("logit_bias"),
            ));
        }
        let stream = body.get("stream")?.unwrap_or(false);
        let options: Option<api::StreamOptions> = body.get("stream_options")?;
        let repeat_last_n: u32 = body.get("repeat_last_n")?.unwrap_or(PENALTY_LAST_N);
        if repeat_last_n > MAX_REPEAT_LAST_N {
            return Err(ApiError::invalid(
                format!("'repeat_last_n' must be at most {MAX_REPEAT_LAST_N}"),
                Some("repeat_last_n"),
            ));
        }
        let repeat_penalty = body.get::<f32>("repeat_penalty")?.unwrap_or(1.0);
        if !(repeat_penalty > 0.0 && repeat_penalty.is_finite()) {
            return Err(ApiError::invalid(
                "'repeat_penalty' must be above 0",
                Some("repeat_penalty"),
            ));
        }
        let (constraint, constraint_param) = constraint(body)?;
        Ok(Sampling {
            n,
            logprobs: None,
            tool_calls: false,
            json_response: false,
            forced_call: false,
            constraint_param,
            top_k: body.get("top_k")?.unwrap_or(0),
            min_p: in_range("min_p", body.get("min_p")?, 0.0, 0.0, 1.0)?,
            typical_p: in_range("typical_p", body.get("typical_p")?, 1.0, 0.0, 1.0)?,
            repeat_penalty,
            repeat_last_n,
            ignore_eos: body.get("ignore_eos")?.unwrap_or(false),
            constraint,
            max_tokens,
            temperature: in_range("temperature", body.get("temperature")?, 1.0, 0.0, 2.0)?,
            top_p: in_range("top_p", body.get("top_p")?, 1.0, 0.0, 1.0)?,
            seed: body.get("seed")?,
            stop,
            presence_penalty: in_range(
                "presence_penalty",
                body.get("presence_penalty")?,
                0.0,
                -2.0,
                2.0,
            )?,
            frequency_penalty: in_range(
                "frequency_penalty",
                body.get("frequency_penalty")?,
                0.0,
                -2.0,
                2.0,
            )?,
            logit_bias: logit_bias.into_iter().collect(),
            stream,
            include_usage: stream && options.is_some_and(|o| o.include_usage),
        })
    }

    /// The host's sampler chain for choice `choice`: greedy at temperature 0, else a
    /// seeded draw (each choice's seed one past the last one's, so that `n` choices
    /// with a `seed` differ from each other and are each reproducible).
    pub(crate) fn sampler(&self, model: &Model, choice: u32) -> Result<SamplerParams, ApiError> {
        let mut p = generate::greedy_sampler();
        if self.temperature > 0.0 {
            p.temperature = Some(self.temperature);
            if self.top_p <= 0.0 {
                p.top_k = Some(1);
            } else if self.top_p < 1.0 {
                p.top_p = Some(self.top_p);
            }
            p.top_k = p.top_k.or((self.top_k > 0).then_some(self.top_k));
            p.min_p = (self.min_p > 0.0).then_some(self.min_p);
            p.typical_p = (self.typical_p > 0.0 && self.typical_p < 1.0).then_some(self.typical_p);
            // OpenAI's seed is any integer; the host's is 32 bits (the low ones are kept).
            p.seed = self.seed.map(|s| (s as u32).wrapping_add(choice));
        }
        let penalised = self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repeat_penalty != 1.0;
        if penalised && self.repeat_last_n > 0 {
            p.penalties = Some(Penalties {
                last_n: self.repeat_last_n,
                repeat: self.repeat_penalty,
                frequency: self.frequency_penalty,
                presence: self.presence_penalty,
            });
        }
        match &self.constraint {
            Constraint::None => {}
            Constraint::Grammar(text) => {
                p.grammar = Some(generate::Grammar { text: text.clone(), root: None })
            }
            Constraint::JsonSchema(schema) => p.json_schema = Some(schema.clone()),
        }
        if self.ignore_eos {
            // Every end-of-generation token, as llama-server bans them.
            let ends = (0..model.n_vocab() as i32).filter(|&t| model.is_eog(t));
            p.logit_bias.extend(ends.map(|token| LogitBias { token, bias: f32::NEG_INFINITY }));
        }
        for (token, bias) in &self.logit_bias {
            let invalid = || {
                ApiError::invalid(
                    format!("'{token}' in logit_bias is not a token id"),
                    Some("logit_bias"),
                )
            };
            let token: i32 = token.parse().map_err(|_| invalid())?;
            checked_tokens(model, vec![token], "logit_bias")?;
            // -100 bans the token, as OpenAI documents.
            let bias = if *bias <= -100.0 { f32::NEG_INFINITY } else { *bias };
            p.logit_bias.push(LogitBias { token, bias });
        }
        Ok(p)
    }
}

/// `response_format`, llama-server's `grammar` and `json_schema`: at most one of them.
fn constraint(body: &Object) -> Result<(Constraint, &'static str), ApiError> {
    let format: Option<api::ResponseFormat> = body.get("response_format")?;
    let grammar: Option<String> = body.get("grammar")?;
    let schema: Option<serde_json::Value> = body.get("json_schema")?;
    let from_format = match format {
        None | Some(api::ResponseFormat::Text) => None,
        Some(api::ResponseFormat::JsonObject) => Some(serde_json::json!({ "type": "object" })),
        // No schema: any JSON value.
        Some(api::ResponseFormat::JsonSchema { json_schema }) => {
            Some(json_schema.schema.unwrap_or(serde_json::Value::Bool(true)))
        }
    };
    match (from_format, grammar, schema) {
        (None, None, None) => Ok((Constraint::None, "")),
        (None, Some(text), None) => Ok((Constraint::Grammar(text), "grammar")),
        (Some(schema), None, None) => {
            Ok((Constraint::JsonSchema(schema.to_string()), "response_format"))
        }
        (None, None, Some(schema)) => {
            Ok((Constraint::JsonSchema(schema.to_string()), "json_schema"))
        }
        _ => Err(ApiError::invalid(
            "Use one of 'response_format', 'grammar' and 'json_schema'",
            Some("response_format"),
        )),
    }
}

/// Token ids from the request, each in the model's vocabulary.
pub(crate) fn checked_tokens(
    model: &Model,
    tokens: Vec<i32>,
    param: &str,
) -> Result<Vec<i32>, ApiError> {
    let n_vocab = model.n_vocab() as i64;
    match tokens.iter().find(|&&t| !(0..n_vocab).contains(&(t as i64))) {
        Some(t) => Err(ApiError::invalid(
            format!("Token {t} is not in the model's vocabulary (0..{n_vocab})"),
            Some(param),
        )),
        None => Ok(tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_fields_are_checked() {
        let read =
            |json: &str| Sampling::read(&Object::parse(json.as_bytes()).unwrap(), &["messages"]);
        let s = read(r#"{"max_tokens":16,"temperature":0,"stop":"\n","stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(
            (s.max_tokens, s.temperature, s.stop.clone(), s.stream, s.include_usage),
            (Some(16), 0.0, vec!["\n".to_string()], true, true)
        );
        let s = read(r#"{"max_tokens":16,"max_completion_tokens":4,"stop":["a","b"]}"#).unwrap();
        assert_eq!(
            (s.max_tokens, s.temperature, s.stop.len(), s.include_usage),
            (Some(4), 1.0, 2, false)
        );
        for (json, param) in [
            (r#"{"n":0}"#, "n"),
            (r#"{"n":5}"#, "n"),
            (r#"{"temperature":3}"#, "temperature"),
            (r#"{"top_p":-1}"#, "top_p"),
            (r#"{"max_tokens":0}"#, "max_tokens"),
            (r#"{"max_tokens":-1}"#, "max_tokens"),
            (r#"{"max_completion_tokens":100000}"#, "max_completion_tokens"),
            (r#"{"stop":["1","2","3","4","5","6","7","8","9"]}"#, "stop"),
            (r#"{"presence_penalty":5}"#, "presence_penalty"),
            (r#"{"logit_bias":{"1":200}}"#, "logit_bias"),
            (r#"{"stream":"yes"}"#, "stream"),
            (r#"{"logprobs":true}"#, "logprobs"),
            (r#"{"top_logprobs":2}"#, "top_logprobs"),
            (r#"{"tools":[{"type":"function"}]}"#, "tools"),
            (r#"{"suffix":"x"}"#, "suffix"),
            (r#"{"best_of":2}"#, "best_of"),
            (r#"{"prompt":"x"}"#, "prompt"),
            (r#"{"response_format":{"type":"xml"}}"#, "response_format"),
            (
                r#"{"response_format":{"type":"json_object"},"grammar":"root ::= [0-9]"}"#,
                "response_format",
            ),
            (r#"{"min_p":2}"#, "min_p"),
            (r#"{"repeat_penalty":0}"#, "repeat_penalty"),
            (r#"{"repeat_last_n":100000}"#, "repeat_last_n"),
        ] {
            let e = read(json).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{json}");
        }
    }

    #[test]
    fn structured_output_and_llama_server_extras_reach_the_sampler() {
        let read = |json: &str| {
            Sampling::read(&Object::parse(json.as_bytes()).unwrap(), &["messages"]).unwrap()
        };
        let s = read(
            r#"{"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"integer"}}}}"#,
        );
        assert!(
            matches!(&s.constraint, Constraint::JsonSchema(text) if text == r#"{"type":"integer"}"#)
        );
        assert!(
            matches!(read(r#"{"response_format":{"type":"json_object"}}"#).constraint, Constraint::JsonSchema(t) if t == r#"{"type":"object"}"#)
        );
        assert!(matches!(
            read(r#"{"response_format":{"type":"text"}}"#).constraint,
            Constraint::None
        ));
        assert!(matches!(
            read(r#"{"grammar":"root ::= [0-9]"}"#).constraint,
            Constraint::Grammar(_)
        ));
        assert!(matches!(
            read(r#"{"json_schema":{"type":"boolean"}}"#).constraint,
            Constraint::JsonSchema(_)
        ));
        let s = read(
            r#"{"top_k":5,"min_p":0.1,"typical_p":0.5,"repeat_penalty":1.3,"repeat_last_n":32,"ignore_eos":true}"#,
        );
        assert_eq!(
            (s.top_k, s.min_p, s.typical_p, s.repeat_penalty, s.repeat_last_n, s.ignore_eos),
            (5, 0.1, 0.5, 1.3, 32, true)
        );
    }
}
