//! OpenAI's wire types: request fields (read one by one, so that a bad one is named in
//! the error's `param`), responses, stream chunks and errors.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use llamabox_guest::types::Error as HostError;

/// An error answered as OpenAI's `{"error": {...}}` with an HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: something in the request is wrong; `param` names the field.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(Into::into),
            code: None,
        }
    }

    /// 400 for a field `path` whose value is none of `allowed`, listing them:
    /// `'input[0].role' must be "user", "system" or "assistant"`.
    pub fn not_one_of(path: &str, allowed: &[&str]) -> Self {
        let quoted: Vec<String> = allowed.iter().map(|a| format!("\"{a}\"")).collect();
        let choices = match quoted.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        Self::invalid(format!("'{path}' must be {choices}"), Some(path))
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: 404, ..Self::invalid(message, None) }
    }

    pub fn model_not_found(name: &str) -> Self {
        ApiError {
            status: 404,
            ..Self::invalid(format!("The model `{name}` does not exist"), Some("model"))
        }
        .with_code("model_not_found")
    }

    pub fn method_not_allowed(method: &str, path: &str, allowed: &str) -> Self {
        ApiError {
            status: 405,
            ..Self::invalid(format!("{method} is not allowed on {path}; use {allowed}"), None)
        }
        .with_code("method_not_allowed")
    }

    pub fn too_large(cap: u64) -> Self {
        ApiError {
            status: 413,
            ..Self::invalid(format!("The request body is larger than {cap} bytes"), None)
        }
        .with_code("request_too_large")
    }

    pub fn server(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        let inner = Inner {
            message: &self.message,
            kind: self.kind,
            param: self.param.as_deref(),
            code: self.code,
        };
        to_json(&Outer { error: inner })
    }
}

/// What a host call's failure means to the client.
impl From<HostError> for ApiError {
    fn from(e: HostError) -> Self {
        match e {
            HostError::InvalidArgument(m) => ApiError::invalid(m, None),
            HostError::ContextFull => {
                ApiError::invalid("The context is full: the prompt and the answer do not fit", None)
                    .with_code("context_length_exceeded")
            }
            HostError::ModelNotFound(name) => ApiError::model_not_found(&name),
            HostError::LimitExceeded(m) => ApiError {
                status: 503,
                ..ApiError::server(format!("A server limit was reached, try again later: {m}"))
            }
            .with_code("limit_exceeded"),
            HostError::Cancelled => ApiError::server("The request was cancelled"),
            HostError::Backend(m) => ApiError::server(format!("Inference failed: {m}")),
        }
    }
}

impl ApiError {
    /// The error in Anthropic's shape (`/v1/messages`):
    /// `{"type":"error","error":{"type","message"}}`, its type from the status. A field's
    /// path, which Anthropic's errors have no place for, leads the message.
    pub fn to_anthropic_json(&self) -> String {
        let kind = match self.status {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 | 405 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        let message = match &self.param {
            Some(param) if !self.message.contains(&format!("'{param}'")) => {
                format!("{param}: {}", self.message)
            }
            _ => self.message.clone(),
        };
        serde_json::json!({"type": "error", "error": {"type": kind, "message": message}})
            .to_string()
    }
}

/// Where each of a mapped chat body's messages and tools came from in the request the
/// client sent (`input[2]`, `system`, `messages[1].content[0]`): an API mapped onto the
/// chat path (Responses, Messages) names its own fields in errors the chat path finds.
#[derive(Debug, Default)]
pub struct Origins {
    pub messages: Vec<String>,
    pub tools: Vec<String>,
    /// What the chat path's `messages` as a whole is called (`input`, `messages`).
    pub all_messages: &'static str,
}

impl Origins {
    /// `e` with a chat path (`messages[3].content`, `tools[0].function.parameters`, or
    /// `messages` itself) rewritten to the client's, in its message too.
    pub fn name(&self, mut e: ApiError) -> ApiError {
        let Some(param) = e.param.clone() else { return e };
        let rebased = |list: &str, origins: &[String]| -> Option<(String, String)> {
            let rest = param.strip_prefix(list)?.strip_prefix('[')?;
            let index = rest.split_once(']')?.0;
            let origin = origins.get(index.parse::<usize>().ok()?)?;
            Some((format!("{list}[{index}]"), origin.clone()))
        };
        let (from, to) =
            match rebased("messages", &self.messages).or_else(|| rebased("tools", &self.tools)) {
                Some((from, to)) => (from, to),
                None if param == "messages" => (param.clone(), self.all_messages.to_string()),
                None => return e,
            };
        e.message = e.message.replace(&format!("'{from}"), &format!("'{to}"));
        e.param = Some(param.replacen(&from, &to, 1));
        e
    }
}

/// A fresh id such as `chatcmpl-1f0c...`: 64 bits from the host's random source (via std's hasher keys).
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    format!("{prefix}-{random:016x}")
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("response types serialize")
}

/// A request's JSON object, read field by field.
#[derive(Debug)]
pub struct Object(Map<String, Value>);

impl Object {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        match serde_json::from_slice(body) {
            Ok(Value::Object(map)) => Ok(Object(map)),
            Ok(_) => Err(ApiError::invalid("The request body must be a JSON object", None)),
            Err(e) => {
                Err(ApiError::invalid(format!("The request body is not valid JSON: {e}"), None))
            }
        }
    }

    /// Field `name`; absent and `null` are both `None`.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ApiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => T::deserialize(value).map(Some).map_err(|e| {
                ApiError::invalid(format!("Invalid value for '{name}': {e}"), Some(name))
            }),
        }
    }

    /// A 400 naming the first field that is not in `honoured` and is not off (`null`,
    /// `false`, `[]`): a field this server would otherwise ignore, leaving the client
    /// believing it got JSON, a tool call or logprobs.
    pub fn refuse_unknown(&self, honoured: &[&str]) -> Result<(), ApiError> {
        self.refuse_unknown_but(honoured, &[])
    }

    /// [`Object::refuse_unknown`], accepting also the fields of `defaults` with a value
    /// that asks for what this server does anyway; another value of one of them is
    /// refused naming the values it may take.
    pub fn refuse_unknown_but(
        &self,
        honoured: &[&str],
        defaults: &[AsDefault],
    ) -> Result<(), ApiError> {
        for (name, value) in &self.0 {
            if honoured.contains(&name.as_str()) || off(value) {
                continue;
            }
            let unsupported = match defaults.iter().find(|d| d.name == name) {
                Some(d) if (d.accepts)(value) => continue,
                Some(d) => format!(
                    "Unsupported value for '{name}': {value}; this server takes {} (what it does anyway)",
                    d.values
                ),
                None => format!("Unsupported parameter: '{name}' is not supported by this server"),
            };
            return Err(
                ApiError::invalid(unsupported, Some(name)).with_code("unsupported_parameter")
            );
        }
        Ok(())
    }

    pub fn require<T: DeserializeOwned>(&self, name: &str) -> Result<T, ApiError> {
        self.get(name)?.ok_or_else(|| {
            ApiError::invalid(format!("Missing required parameter: '{name}'"), Some(name))
        })
    }
}

/// A field accepted only with values that ask for what the server does anyway.
pub struct AsDefault {
    pub name: &'static str,
    /// The values accepted, in words, for the error.
    pub values: &'static str,
    pub accepts: fn(&Value) -> bool,
}

/// A field that takes one value or a list of them (`stop`, `input`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(one) => vec![one],
            OneOrMany::Many(many) => many,
        }
    }
}

/// One chat message as clients send it, read field by field (`Message::read`) so that
/// an error names the field by its whole path (`messages[3].tool_calls[0].function.name`).
///
/// Fields of OpenAI's own message schema that this server does not read — what the
/// SDK writes back when an application appends `message.model_dump()` to its history:
/// `annotations`, `audio`, `function_call` — are accepted when off (`null`, `false`,
/// `[]`), as at the top level of a request; any other value of them, or of a field
/// nobody knows, is refused naming it (`messages[1].audio`): it asks for something
/// (an audio turn, a legacy function call, citations) this server cannot honour.
pub struct Message {
    pub role: String,
    /// `null` for an assistant turn that only called tools.
    pub content: Option<Content>,
    /// The participant's name (a tool message's: the function's).
    pub name: Option<String>,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool turn answers this call.
    pub tool_call_id: Option<String>,
    /// An assistant turn that refused (OpenAI's structured outputs): its text, when the
    /// turn has no content.
    pub refusal: Option<String>,
}

/// A call in an assistant turn of the history. Its `index` (which a streamed answer's
/// deltas carry, and a client that joins them may keep) is read and changes nothing.
pub struct ToolCallIn {
    pub id: String,
    pub kind: String,
    pub function: FunctionCallIn,
}

pub struct FunctionCallIn {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// A JSON object's fields, read one by one and named by `path` in errors.
struct Fields {
    map: Map<String, Value>,
    path: String,
}

impl Fields {
    fn new(value: Value, path: String) -> Result<Self, ApiError> {
        match value {
            Value::Object(map) => Ok(Fields { map, path }),
            _ => Err(ApiError::invalid(format!("'{path}' must be an object"), Some(&path))),
        }
    }

    fn path(&self, name: &str) -> String {
        format!("{}.{name}", self.path)
    }

    /// Field `name` (absent and `null` are `None`), taken out.
    fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, ApiError> {
        match self.map.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => T::deserialize(value).map(Some).map_err(|e| {
                let path = self.path(name);
                ApiError::invalid(format!("Invalid value for '{path}': {e}"), Some(&path))
            }),
        }
    }

    fn require<T: DeserializeOwned>(&mut self, name: &str) -> Result<T, ApiError> {
        self.take(name)?.ok_or_else(|| {
            let path = self.path(name);
            ApiError::invalid(format!("Missing required parameter: '{path}'"), Some(&path))
        })
    }

    /// A 400 naming the first field left that is not off: nobody read it.
    fn refuse_rest(&self) -> Result<(), ApiError> {
        match self.map.iter().find(|(_, value)| !off(value)) {
            Some((name, _)) => {
                let path = self.path(name);
                Err(ApiError::invalid(
                    format!("Unsupported parameter: '{path}' is not supported by this server"),
                    Some(&path),
                )
                .with_code("unsupported_parameter"))
            }
            None => Ok(()),
        }
    }
}

/// `object[key]` if it is one of the strings `allowed`, else [`ApiError::not_one_of`]
/// naming `path.key`.
pub fn one_of<'a>(
    object: &'a Map<String, Value>,
    key: &str,
    allowed: &[&str],
    path: &str,
) -> Result<&'a str, ApiError> {
    match object.get(key).and_then(Value::as_str) {
        Some(value) if allowed.contains(&value) => Ok(value),
        _ => Err(ApiError::not_one_of(&format!("{path}.{key}"), allowed)),
    }
}

/// Whether a field's value asks for nothing: `null`, `false` or `[]`.
fn off(value: &Value) -> bool {
    matches!(value, Value::Null | Value::Bool(false)) || value.as_array().is_some_and(Vec::is_empty)
}

impl Message {
    /// `messages[i]`, from its JSON.
    pub fn read(value: Value, i: usize) -> Result<Message, ApiError> {
        let mut f = Fields::new(value, format!("messages[{i}]"))?;
        let role = f.require("role")?;
        let content = match f.take::<Value>("content")? {
            None => None,
            Some(Value::String(text)) => Some(Content::Text(text)),
            Some(Value::Array(parts)) => Some(Content::Parts(
                parts
                    .into_iter()
                    .enumerate()
                    .map(|(j, part)| {
                        let path = format!("{}[{j}]", f.path("content"));
                        ContentPart::deserialize(part).map_err(|e| {
                            ApiError::invalid(
                                format!("Invalid value for '{path}': {e}"),
                                Some(&path),
                            )
                        })
                    })
                    .collect::<Result<_, _>>()?,
            )),
            Some(_) => {
                let path = f.path("content");
                return Err(ApiError::invalid(
                    format!("'{path}' must be a string or a list of content parts"),
                    Some(&path),
                ));
            }
        };
        let name = f.take("name")?;
        let tool_calls = match f.take::<Vec<Value>>("tool_calls")? {
            None => None,
            Some(calls) => Some(
                calls
                    .into_iter()
                    .enumerate()
                    .map(|(j, call)| {
                        ToolCallIn::read(call, format!("{}[{j}]", f.path("tool_calls")))
                    })
                    .collect::<Result<_, _>>()?,
            ),
        };
        let tool_call_id = f.take("tool_call_id")?;
        let refusal = f.take("refusal")?;
        f.refuse_rest()?;
        Ok(Message { role, content, name, tool_calls, tool_call_id, refusal })
    }
}

impl ToolCallIn {
    fn read(value: Value, path: String) -> Result<ToolCallIn, ApiError> {
        let mut f = Fields::new(value, path)?;
        let id = f.require("id")?;
        let kind = f.require("type")?;
        let _index: Option<u32> = f.take("index")?;
        let mut g = Fields::new(f.require("function")?, f.path("function"))?;
        let function =
            FunctionCallIn { name: g.require("name")?, arguments: g.require("arguments")? };
        g.refuse_rest()?;
        f.refuse_rest()?;
        Ok(ToolCallIn { id, kind, function })
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    pub image_url: Option<ImageUrl>,
}

#[derive(Deserialize)]
pub struct ImageUrl {
    pub url: String,
}

/// `response_format`: plain text, any JSON object, or JSON valid against a schema.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`. `name`, `description` and `strict` are read (so a
/// misspelt field is refused, not ignored) but change nothing: the output always
/// follows the schema here (it is a grammar), strict or not.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    #[allow(dead_code)]
    pub name: String,
    #[serde(default)]
    #[allow(dead_code)]
    pub description: Option<String>,
    /// Absent: any JSON value.
    #[serde(default)]
    pub schema: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    pub strict: Option<bool>,
}

#[derive(Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// A completion's `prompt` or an embedding's `input`: one text or token list, or a list
/// of them.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Inputs {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i32>),
    TokenLists(Vec<Vec<i32>>),
}

impl Inputs {
    /// How many inputs: 1 for a lone text or token list.
    pub fn count(&self) -> usize {
        match self {
            Inputs::Text(_) | Inputs::Tokens(_) => 1,
            Inputs::Texts(texts) => texts.len(),
            Inputs::TokenLists(lists) => lists.len(),
        }
    }
}

#[derive(Serialize, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Serialize, Clone, Copy)]
pub struct PromptTokensDetails {
    /// Prompt tokens the host found in memory (a prefix an earlier request of the same
    /// group left) and did not compute again.
    pub cached_tokens: u32,
}

#[derive(Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
    /// Anthropic's paging fields: the whole list is one page.
    pub has_more: bool,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
}

/// A served model, in OpenAI's shape (`object`, `created`, `owned_by`) and Anthropic's
/// (`type`, `display_name`, `created_at`) at once: each SDK reads its own fields.
#[derive(Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub display_name: String,
    /// `created` as RFC 3339.
    pub created_at: String,
}

/// A completion, or one chunk of a streamed one (`object` tells which); `C` is the
/// choice: [`ChatChoice`] or [`TextChoice`].
#[derive(Serialize)]
pub struct Completion<'a, C> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a chat or a text completion.
#[derive(Serialize)]
#[serde(untagged)]
pub enum Choice<'a> {
    Chat(ChatChoice<'a>),
    Text(TextChoice<'a>),
}

#[derive(Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    /// The whole answer (`chat.completion`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<Delta<'a>>,
    /// What this chunk adds (`chat.completion.chunk`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta<'a>>,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Chat's `logprobs`: one entry per generated token (of this chunk, when streamed).
#[derive(Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null`: this server refuses nothing as OpenAI's refusals do.
    pub refusal: Option<()>,
}

#[derive(Serialize)]
pub struct ChatTokenLogprob {
    /// The generated token, its fields inline.
    #[serde(flatten)]
    pub chosen: TokenLogprob,
    /// The most likely tokens at this position, most likely first (`top_logprobs` of them).
    pub top_logprobs: Vec<TokenLogprob>,
}

#[derive(Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes (its text may be part of a character).
    pub bytes: Vec<u8>,
}

/// Text completions' `logprobs`, as parallel lists.
#[derive(Serialize, Default)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, the most likely tokens at its position: token text → logprob.
    pub top_logprobs: Vec<TopMap>,
    /// Each token's offset in the completion's text, in characters.
    pub text_offset: Vec<u32>,
}

/// A JSON object written in this order (most likely first), as OpenAI writes it.
pub struct TopMap(pub Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[derive(Serialize, Default)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// A call the model made: whole in a message; in a stream, the first delta of call
/// `index` carries its id, type and name, and later ones pieces of its arguments.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallOut,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct FunctionCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Serialize)]
pub struct TextChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
pub struct EmbeddingList<'a> {
    pub object: &'static str,
    pub data: Vec<Embedding>,
    pub model: &'a str,
    pub usage: EmbeddingUsage,
}

#[derive(Serialize)]
pub struct Embedding {
    pub object: &'static str,
    pub index: u32,
    pub embedding: Vector,
}

/// `encoding_format` `float` (a list) or `base64` (little-endian f32s).
#[derive(Serialize)]
#[serde(untagged)]
pub enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
pub struct EmbeddingUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
}

/// `/tokenize`'s answer: token ids, or [`TokenPiece`]s (`with_pieces`).
#[derive(Serialize)]
pub struct Tokens<T> {
    pub tokens: Vec<T>,
}

#[derive(Serialize)]
pub struct TokenPiece {
    pub id: i32,
    pub piece: Piece,
}

/// A token's bytes as llama-server shows them: text if they are whole UTF-8, else
/// the bytes (a piece of a character split across tokens).
#[derive(Serialize, Debug, PartialEq)]
#[serde(untagged)]
pub enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

impl From<Vec<u8>> for Piece {
    fn from(bytes: Vec<u8>) -> Self {
        match String::from_utf8(bytes) {
            Ok(text) => Piece::Text(text),
            Err(e) => Piece::Bytes(e.into_bytes()),
        }
    }
}

/// `/detokenize`'s answer.
#[derive(Serialize)]
pub struct Detokenized {
    pub content: String,
}

/// `/apply-template`'s answer.
#[derive(Serialize)]
pub struct TemplatedPrompt {
    pub prompt: String,
}

/// Standard base64 (with padding) of `bytes`.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let n = group.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= group.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_of_lists_the_choices_it_takes() {
        let object: Map<String, Value> = serde_json::from_str(r#"{"role": "tool"}"#).unwrap();
        let error =
            one_of(&object, "role", &["user", "system", "assistant"], "input[2]").unwrap_err();
        assert_eq!(error.message, r#"'input[2].role' must be "user", "system" or "assistant""#);
        assert_eq!(error.param.as_deref(), Some("input[2].role"));
        assert_eq!(one_of(&object, "role", &["user", "tool"], "m").ok(), Some("tool"));
        let two = ApiError::not_one_of("s.type", &["base64", "url"]).message;
        assert_eq!(two, r#"'s.type' must be "base64" or "url""#);
        assert_eq!(ApiError::not_one_of("t", &["text"]).message, r#"'t' must be "text""#);
    }

    #[test]
    fn base64_pads_like_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }

    #[test]
    fn fields_this_server_would_ignore_are_refused_by_name() {
        let body = Object::parse(
            br#"{"model": "m", "logprobs": false, "tools": [], "echo": null, "top_logprobs": 3}"#,
        )
        .unwrap();
        let e = body.refuse_unknown(&["model"]).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref(), e.code),
            (400, Some("top_logprobs"), Some("unsupported_parameter"))
        );
        Object::parse(br#"{"model": "m", "logprobs": false}"#)
            .unwrap()
            .refuse_unknown(&["model"])
            .unwrap();
        let format = |json: &str| {
            serde_json::from_str::<ResponseFormat>(json).map(|_| ()).map_err(|e| e.to_string())
        };
        format(r#"{"type": "json_object"}"#).unwrap();
        format(r#"{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}"#).unwrap();
        assert!(format(r#"{"type": "xml"}"#).is_err());
        assert!(
            format(r#"{"type": "json_schema", "json_schema": {"name": "x", "schemas": {}}}"#)
                .is_err(),
            "a misspelt field is not ignored"
        );
    }

    #[test]
    fn fields_are_named_in_errors() {
        let o = Object::parse(br#"{"model":"m","temperature":"hot","stop":null}"#).unwrap();
        assert_eq!(o.require::<String>("model").unwrap(), "m");
        assert_eq!(o.get::<Vec<String>>("stop").unwrap(), None);
        let e = o.get::<f32>("temperature").unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("temperature")));
        let e = o.require::<Vec<Value>>("messages").err().unwrap();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.to_json().starts_with(r#"{"error":{"message":"Missing required parameter: 'messages'","type":"invalid_request_error","param":"messages","code":null}}"#));
        assert_eq!(Object::parse(b"[1]").unwrap_err().status, 400);
        assert_eq!(Object::parse(b"{").unwrap_err().param, None);
    }

    #[test]
    fn token_pieces_are_text_when_whole_utf8_else_bytes() {
        let pieces = vec![
            TokenPiece { id: 1, piece: b" llama".to_vec().into() },
            TokenPiece { id: 2, piece: vec![0xf0, 0x9f].into() },
        ];
        assert_eq!(
            to_json(&Tokens { tokens: pieces }),
            r#"{"tokens":[{"id":1,"piece":" llama"},{"id":2,"piece":[240,159]}]}"#
        );
        assert_eq!(to_json(&Tokens { tokens: vec![1, 2] }), r#"{"tokens":[1,2]}"#);
        assert_eq!(Piece::from(Vec::new()), Piece::Text(String::new()));
    }

    #[test]
    fn content_is_text_or_parts() {
        let m: Vec<Value> =
            serde_json::from_str(r#"[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"a"}]},{"role":"assistant","content":null}]"#)
                .unwrap();
        let m: Vec<Message> =
            m.into_iter().enumerate().map(|(i, v)| Message::read(v, i).ok().unwrap()).collect();
        assert!(matches!(&m[0].content, Some(Content::Text(t)) if t == "hi"));
        assert!(matches!(&m[1].content, Some(Content::Parts(p)) if p[0].kind == "text"));
        assert!(m[2].content.is_none());
    }

    #[test]
    fn messages_the_sdk_writes_back_are_read() {
        let read = |json: &str| Message::read(serde_json::from_str(json).unwrap(), 3);
        // openai-python's `message.model_dump()` of an answer, and of one that called a tool.
        let m = read(r#"{"content":"Hi","refusal":null,"role":"assistant","annotations":[],"audio":null,"function_call":null,"tool_calls":null}"#).ok().unwrap();
        assert!(matches!(m.content, Some(Content::Text(t)) if t == "Hi"));
        let m = read(r#"{"content":null,"refusal":null,"role":"assistant","annotations":null,"audio":null,"function_call":null,"tool_calls":[{"id":"c","function":{"arguments":"{}","name":"f"},"type":"function","index":0}]}"#).ok().unwrap();
        assert_eq!(m.tool_calls.unwrap()[0].function.name, "f");
        // What they would ask for, this server cannot do: refused by their whole path.
        for (json, param) in [
            (r#"{"role":"assistant","content":"x","audio":{"id":"a"}}"#, "messages[3].audio"),
            (
                r#"{"role":"assistant","content":null,"function_call":{"name":"f","arguments":"{}"}}"#,
                "messages[3].function_call",
            ),
            (
                r#"{"role":"assistant","content":"x","annotations":[{"type":"url_citation"}]}"#,
                "messages[3].annotations",
            ),
            (r#"{"role":"user","content":"x","mood":"sunny"}"#, "messages[3].mood"),
            (
                r#"{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}","strict":true}}]}"#,
                "messages[3].tool_calls[0].function.strict",
            ),
            (
                r#"{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":{"a":1}}}]}"#,
                "messages[3].tool_calls[0].function.arguments",
            ),
            (
                r#"{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"},"index":"first"}]}"#,
                "messages[3].tool_calls[0].index",
            ),
            (
                r#"{"role":"assistant","tool_calls":[{"type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
                "messages[3].tool_calls[0].id",
            ),
            (
                r#"{"role":"assistant","tool_calls":[{"id":"c","type":"function"}]}"#,
                "messages[3].tool_calls[0].function",
            ),
            (r#"{"role":"assistant","tool_calls":{}}"#, "messages[3].tool_calls"),
            (r#"{"role":"user","content":7}"#, "messages[3].content"),
            (r#"{"role":"user","content":[{"text":"a"}]}"#, "messages[3].content[0]"),
            (r#"{"content":"x"}"#, "messages[3].role"),
            (r#"{"role":"user","name":5}"#, "messages[3].name"),
            (r#""hi""#, "messages[3]"),
        ] {
            let e = read(json).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{json}: {}", e.message);
            assert!(e.message.contains(param), "{}", e.message);
        }
    }
}
