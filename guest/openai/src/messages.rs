//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API.
//!
//! As with `/v1/responses`, a Messages request is mapped onto a chat completion's body
//! ([`chat_body`]) and runs on the chat path's core (template, sampling, the tool-call
//! envelope, runs); only the answer is written in Anthropic's shape, whole or as its
//! server-sent events. Errors on these paths are Anthropic's
//! `{"type":"error","error":{"type","message"}}` (`ApiError::to_anthropic_json`).
//!
//! Honoured: `model`, `max_tokens` (required, as Anthropic's API requires it), `system`
//! (a string or text blocks), `messages` (`text`, `image` with a base64 or URL source,
//! `tool_use` and `tool_result` blocks), `tools` (custom tools: `name`, `description`,
//! `input_schema`), `tool_choice` (`auto`, `any`, `tool`, `none`,
//! `disable_parallel_tool_use`), `stop_sequences`, `temperature`, `top_p`, `top_k`,
//! `metadata.user_id` and `stream`. Accepted as asking for what this server does
//! anyway: `cache_control` on any block (prompts are reused whenever their start is in
//! memory), `thinking` `{"type":"disabled"}` or `{"type":"adaptive"}` (the model
//! decides, and this one never thinks; `enabled` is refused), `output_config.effort`
//! (no reasoning to spend it on), `context_management` edits that clear thinking, and
//! `service_tier` `"auto"` or `"standard_only"`. `output_config.format` (a JSON
//! Schema) is the chat path's `response_format`. A `max_tokens` above the host's
//! 4096 lets the answer fill the rest of its context. A `system` block that is Claude
//! Code's `x-anthropic-billing-header:` line is dropped, as Anthropic's API takes it
//! for a header. `system` messages among the
//! others are system turns; `thinking` blocks in the history are dropped, as
//! Anthropic drops earlier turns' thinking. Tools of Anthropic's server kinds (a
//! `type` such as `web_search_20250305`) and tools with `defer_loading` are skipped:
//! this server runs none of the first and shows the model none of the second, and
//! never pretends to run one. Anything else is refused with a 400 naming the field by
//! its path.

use serde_json::{json, Map, Value};

use crate::api::{self, ApiError, AsDefault, Object, Origins, Usage};
use crate::completions::{Ended, EventStream, Events, Format};
use crate::handlers;
use crate::http::Reply;
use crate::sampling::MAX_GENERATE_TOKENS;
use crate::tools::{Call, CallDelta};

/// The fields a Messages request may have (others are refused unless off).
const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "stream",
    "output_config",
    "context_management",
];

/// Fields accepted with the values that ask for what this server does anyway.
const AS_DEFAULT: &[AsDefault] = &[
    AsDefault {
        name: "thinking",
        values: "{\"type\":\"disabled\"} or {\"type\":\"adaptive\"} (the model has no thinking to enable)",
        accepts: |v| matches!(v.get("type").and_then(Value::as_str), Some("disabled" | "adaptive")),
    },
    AsDefault {
        name: "service_tier",
        values: "\"auto\" or \"standard_only\"",
        accepts: |v| matches!(v.as_str(), Some("auto" | "standard_only")),
    },
];

/// How a `system` block that is a header for Anthropic's API, not text for the model,
/// begins.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn unsupported(path: &str) -> ApiError {
    invalid(format!("'{path}' is not supported by this server"), path)
}

/// A block's fields beyond `allowed` that ask for something (`cache_control` is
/// allowed everywhere: prompt reuse here needs no marks).
fn refuse_fields(block: &Map<String, Value>, allowed: &[&str], path: &str) -> Result<(), ApiError> {
    match block
        .iter()
        .find(|(k, v)| !allowed.contains(&k.as_str()) && k.as_str() != "cache_control" && !off(v))
    {
        Some((name, _)) => Err(unsupported(&format!("{path}.{name}"))),
        None => Ok(()),
    }
}

/// Whether a value asks for nothing: `null`, `false` or `[]`.
fn off(value: &Value) -> bool {
    matches!(value, Value::Null | Value::Bool(false)) || value.as_array().is_some_and(Vec::is_empty)
}

fn string<'a>(block: &'a Map<String, Value>, name: &str, path: &str) -> Result<&'a str, ApiError> {
    match block.get(name) {
        Some(Value::String(s)) => Ok(s),
        _ => {
            let p = format!("{path}.{name}");
            Err(invalid(format!("'{p}' must be a string"), &p))
        }
    }
}

/// `POST /v1/messages`.
pub(crate) fn create(body: &Object) -> Result<Reply, ApiError> {
    let (chat, stops, origins) = chat_body(body, true)?;
    let chat = Object::parse(&serde_json::to_vec(&chat).expect("a JSON map"))?;
    let model: String = chat.require("model")?;
    let format = Format { chat: true, id: api::new_id("msg"), created: api::now(), model };
    let mut choices = handlers::chat_choices(&chat, format).map_err(|e| origins.name(e))?;
    let mut answer = Answer::new(chat.require("model")?, stops);
    if chat.get::<bool>("stream")?.unwrap_or(false) {
        return Ok(Reply::Stream(Box::new(EventStream { choices, events: answer })));
    }
    let ended = choices.run_one(|_| Ok(()))?;
    Ok(Reply::Json(answer.message(Some(&ended)).to_string()))
}

/// `POST /v1/messages/count_tokens`: the prompt's length as `create` would run it.
pub(crate) fn count_tokens(body: &Object) -> Result<String, ApiError> {
    let (chat, _, origins) = chat_body(body, false)?;
    let chat = Object::parse(&serde_json::to_vec(&chat).expect("a JSON map"))?;
    let tokens = handlers::chat_prompt_tokens(&chat).map_err(|e| origins.name(e))?;
    Ok(json!({"input_tokens": tokens}).to_string())
}

/// The chat completion body a Messages request asks for, its stop sequences, and where
/// the chat body's messages and tools came from.
/// `generating` is false for `count_tokens`, which takes no `max_tokens` and no
/// sampling.
pub(crate) fn chat_body(
    body: &Object,
    generating: bool,
) -> Result<(Map<String, Value>, Vec<String>, Origins), ApiError> {
    let counting: &[&str] = &[
        "model",
        "system",
        "messages",
        "tools",
        "tool_choice",
        "output_config",
        "context_management",
    ];
    let fields = if generating { FIELDS } else { counting };
    body.refuse_unknown_but(fields, AS_DEFAULT)?;
    let model: String = body.require("model")?;
    let mut messages = Vec::new();
    match body.get::<Value>("system")? {
        None => {}
        Some(Value::String(text)) => messages.push(json!({"role": "system", "content": text})),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                let path = format!("system[{i}]");
                let text = text_block(block, &path)?;
                // Claude Code's attribution line, which Anthropic's API reads as a
                // header: it changes on every request, so at the prompt's start it
                // would keep any of the prompt from being reused.
                if !text.starts_with(BILLING_HEADER) {
                    texts.push(text);
                }
            }
            messages.push(json!({"role": "system", "content": texts.join("\n\n")}));
        }
        Some(_) => {
            return Err(invalid("'system' must be a string or a list of text blocks", "system"))
        }
    }
    let given: Vec<Value> = body.require("messages")?;
    if given.is_empty() {
        return Err(invalid("'messages' must contain at least one message", "messages"));
    }
    let mut origins = Origins { all_messages: "messages", ..Origins::default() };
    origins.messages.resize(messages.len(), "system".into());
    for (i, message) in given.iter().enumerate() {
        let path = format!("messages[{i}]");
        chat_message(&mut messages, message, &path)?;
        origins.messages.resize(messages.len(), path);
    }

    let mut chat = Map::new();
    chat.insert("model".into(), json!(model));
    chat.insert("messages".into(), Value::Array(messages));
    let (tools, tool_choice, parallel, tool_origins) = tools(body)?;
    origins.tools = tool_origins;
    let response_format = output_config(body)?;
    context_management(body)?;
    for (name, value) in [
        ("tools", tools),
        ("tool_choice", tool_choice),
        ("parallel_tool_calls", parallel),
        ("response_format", response_format),
    ] {
        if let Some(value) = value {
            chat.insert(name.into(), value);
        }
    }
    if !generating {
        return Ok((chat, Vec::new(), origins));
    }
    // `max_tokens` is a ceiling Anthropic's clients set high (Claude Code asks for
    // 32000): one above the host's cap lets the answer fill what the context has left.
    let max_tokens: u32 = body.require("max_tokens")?;
    if max_tokens == 0 {
        return Err(invalid("'max_tokens' must be at least 1", "max_tokens"));
    }
    if max_tokens <= MAX_GENERATE_TOKENS {
        chat.insert("max_tokens".into(), json!(max_tokens));
    }
    let stops: Vec<String> = body.get("stop_sequences")?.unwrap_or_default();
    if !stops.is_empty() {
        chat.insert("stop".into(), json!(stops));
    }
    let metadata = body.get::<Map<String, Value>>("metadata")?.unwrap_or_default();
    for (key, value) in &metadata {
        match (key.as_str(), value) {
            ("user_id", Value::String(user)) => {
                chat.insert("user".into(), json!(user));
            }
            (_, Value::Null) => {}
            ("user_id", _) => {
                return Err(invalid("'metadata.user_id' must be a string", "metadata.user_id"))
            }
            _ => return Err(unsupported(&format!("metadata.{key}"))),
        }
    }
    for name in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(value) = body.get::<Value>(name)? {
            chat.insert(name.into(), value);
        }
    }
    Ok((chat, stops, origins))
}

/// `output_config`: `format` (a JSON Schema the answer follows) as the chat path's
/// `response_format`; `effort` is accepted, as the model has no reasoning to spend it on.
fn output_config(body: &Object) -> Result<Option<Value>, ApiError> {
    let Some(config) = body.get::<Map<String, Value>>("output_config")? else {
        return Ok(None);
    };
    refuse_fields(&config, &["effort", "format"], "output_config")?;
    if config.get("effort").is_some_and(|e| !e.is_string() && !e.is_null()) {
        return Err(invalid("'output_config.effort' must be a string", "output_config.effort"));
    }
    let format = match config.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(format)) => format,
        Some(_) => {
            let p = "output_config.format";
            return Err(invalid(format!("'{p}' must be an object"), p));
        }
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        let p = "output_config.format.type";
        return Err(invalid(format!("'{p}' must be \"json_schema\""), p));
    }
    refuse_fields(format, &["type", "schema"], "output_config.format")?;
    match format.get("schema") {
        Some(schema @ Value::Object(_)) => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": true},
        }))),
        _ => {
            let p = "output_config.format.schema";
            Err(invalid(format!("'{p}' must be a JSON Schema object"), p))
        }
    }
}

/// `context_management`: edits that clear earlier thinking ask for nothing here (no
/// thinking is kept); edits that would rewrite the prompt are refused.
fn context_management(body: &Object) -> Result<(), ApiError> {
    let Some(management) = body.get::<Map<String, Value>>("context_management")? else {
        return Ok(());
    };
    refuse_fields(&management, &["edits"], "context_management")?;
    let edits = management.get("edits").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    for (i, edit) in edits.iter().enumerate() {
        let kind = edit.get("type").and_then(Value::as_str).unwrap_or_default();
        if !kind.starts_with("clear_thinking") {
            return Err(unsupported(&format!("context_management.edits[{i}]")));
        }
    }
    Ok(())
}

/// A text block's text (`system[i]`, a tool result's content).
fn text_block(block: &Value, path: &str) -> Result<String, ApiError> {
    let Some(block) = block.as_object().filter(|b| b["type"] == "text") else {
        return Err(ApiError::not_one_of(&format!("{path}.type"), &["text"]));
    };
    refuse_fields(block, &["type", "text", "citations"], path)?;
    Ok(string(block, "text", path)?.to_string())
}

/// `messages[i]` added to the chat messages: a user message (its `tool_result` blocks
/// become tool messages, before its own text and images), or an assistant message (its
/// `tool_use` blocks become tool calls).
fn chat_message(out: &mut Vec<Value>, message: &Value, path: &str) -> Result<(), ApiError> {
    let Some(message) = message.as_object() else {
        return Err(invalid(format!("'{path}' must be an object"), path));
    };
    refuse_fields(message, &["role", "content"], path)?;
    // A system message among the others (Claude Code sends them): text only.
    let role = api::one_of(message, "role", &["user", "assistant", "system"], path)?;
    let blocks = match message.get("content") {
        Some(Value::String(text)) => {
            out.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            let p = format!("{path}.content");
            return Err(invalid(format!("'{p}' must be a string or a list of blocks"), &p));
        }
    };
    let (mut parts, mut calls) = (Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let p = format!("{path}.content[{j}]");
        let Some(block) = block.as_object() else {
            return Err(invalid(format!("'{p}' must be an object"), &p));
        };
        match (role, block.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => {
                let text = text_block(&Value::Object(block.clone()), &p)?;
                parts.push(json!({"type": "text", "text": text}));
            }
            ("user", Some("image")) => parts.push(image(block, &p)?),
            ("user", Some("tool_result")) => out.push(tool_result(block, &p)?),
            ("assistant", Some("tool_use")) => {
                refuse_fields(block, &["type", "id", "name", "input"], &p)?;
                let input = block.get("input").filter(|v| v.is_object()).ok_or_else(|| {
                    invalid(format!("'{p}.input' must be an object"), &format!("{p}.input"))
                })?;
                calls.push(json!({
                    "id": string(block, "id", &p)?,
                    "type": "function",
                    "function": {"name": string(block, "name", &p)?, "arguments": input.to_string()},
                }));
            }
            // Earlier turns' thinking is dropped, as Anthropic's API drops it.
            ("assistant", Some("thinking" | "redacted_thinking")) => {}
            (_, Some(other)) => {
                let p = format!("{p}.type");
                return Err(invalid(
                    format!("'{p}': a {role} message cannot hold a '{other}' block here"),
                    &p,
                ));
            }
            (_, None) => {
                let p = format!("{p}.type");
                return Err(invalid(format!("'{p}' is required"), &p));
            }
        }
    }
    if role == "system" {
        let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        out.push(json!({"role": "system", "content": text.join("\n\n")}));
    } else if role == "assistant" {
        let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        let content = if text.is_empty() && !calls.is_empty() { Value::Null } else { json!(text) };
        let mut message = json!({"role": "assistant", "content": content});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        out.push(message);
    } else if !parts.is_empty() {
        out.push(json!({"role": "user", "content": parts}));
    }
    Ok(())
}

/// An `image` block as a chat image part: a base64 source becomes a data URL.
fn image(block: &Map<String, Value>, path: &str) -> Result<Value, ApiError> {
    refuse_fields(block, &["type", "source"], path)?;
    let p = format!("{path}.source");
    let source = block
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(format!("'{p}' must be an object"), &p))?;
    let url = match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            refuse_fields(source, &["type", "media_type", "data"], &p)?;
            let media_type = string(source, "media_type", &p)?;
            format!("data:{media_type};base64,{}", string(source, "data", &p)?)
        }
        Some("url") => {
            refuse_fields(source, &["type", "url"], &p)?;
            string(source, "url", &p)?.to_string()
        }
        _ => return Err(ApiError::not_one_of(&format!("{p}.type"), &["base64", "url"])),
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// A `tool_result` block as a tool message; an error result says so first.
fn tool_result(block: &Map<String, Value>, path: &str) -> Result<Value, ApiError> {
    refuse_fields(block, &["type", "tool_use_id", "content", "is_error"], path)?;
    let mut text = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => {
            let texts: Result<Vec<String>, ApiError> = blocks
                .iter()
                .enumerate()
                .map(|(k, b)| text_block(b, &format!("{path}.content[{k}]")))
                .collect();
            texts?.join("\n")
        }
        Some(_) => {
            let p = format!("{path}.content");
            return Err(invalid(format!("'{p}' must be a string or a list of text blocks"), &p));
        }
    };
    if block.get("is_error") == Some(&Value::Bool(true)) {
        text = format!("Error: {text}");
    }
    Ok(
        json!({"role": "tool", "tool_call_id": string(block, "tool_use_id", path)?, "content": text}),
    )
}

/// The chat path's `tools`, `tool_choice` and `parallel_tool_calls`, and each chat
/// tool's path among the request's `tools`.
type ChatTools = (Option<Value>, Option<Value>, Option<Value>, Vec<String>);

/// `tools`, `tool_choice` and `disable_parallel_tool_use` as the chat path's fields.
/// Custom tools (no `type`, or `"custom"`) are functions; Anthropic's server tools are
/// skipped.
fn tools(body: &Object) -> Result<ChatTools, ApiError> {
    let given: Vec<Value> = body.get("tools")?.unwrap_or_default();
    let (mut functions, mut paths) = (Vec::new(), Vec::new());
    for (i, tool) in given.iter().enumerate() {
        let path = format!("tools[{i}]");
        let Some(tool) = tool.as_object() else {
            return Err(invalid(format!("'{path}' must be an object"), &path));
        };
        match tool.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(kind)) if kind == "custom" => {}
            Some(_) => continue,
        }
        // A deferred tool is not shown to the model until a tool search loads it.
        if tool.get("defer_loading") == Some(&Value::Bool(true)) {
            continue;
        }
        refuse_fields(tool, &["type", "name", "description", "input_schema"], &path)?;
        let mut function = json!({"name": string(tool, "name", &path)?});
        if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
            function["description"] = description.clone();
        }
        match tool.get("input_schema") {
            Some(schema @ Value::Object(_)) => function["parameters"] = schema.clone(),
            _ => {
                let p = format!("{path}.input_schema");
                return Err(invalid(format!("'{p}' must be a JSON Schema object"), &p));
            }
        }
        functions.push(json!({"type": "function", "function": function}));
        paths.push(path);
    }
    let choice = match body.get::<Map<String, Value>>("tool_choice")? {
        None => None,
        Some(choice) => {
            let kind = choice.get("type").and_then(Value::as_str);
            let allowed: &[&str] = match kind {
                Some("tool") => &["type", "name", "disable_parallel_tool_use"],
                Some("auto" | "any") => &["type", "disable_parallel_tool_use"],
                Some("none") => &["type"],
                _ => {
                    return Err(invalid(
                        "'tool_choice.type' must be \"auto\", \"any\", \"tool\" or \"none\"",
                        "tool_choice.type",
                    ))
                }
            };
            refuse_fields(&choice, allowed, "tool_choice")?;
            Some(choice)
        }
    };
    if functions.is_empty() {
        return match choice.as_ref().and_then(|c| c["type"].as_str()) {
            Some("any" | "tool") => Err(invalid(
                "'tool_choice' asks for a tool call: it needs custom 'tools'",
                "tool_choice",
            )),
            _ => Ok((None, None, None, Vec::new())),
        };
    }
    let parallel = choice
        .as_ref()
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        .map(|disable| json!(!disable));
    let chat_choice = choice.map(|c| match c["type"].as_str() {
        Some("any") => json!("required"),
        Some("tool") => json!({"type": "function", "function": {"name": c["name"]}}),
        Some(kind) => json!(kind),
        None => unreachable!("checked above"),
    });
    Ok((Some(Value::Array(functions)), chat_choice, parallel, paths))
}

/// The answer being written: its ids and the stream's content blocks.
pub(crate) struct Answer {
    id: String,
    model: String,
    stops: Vec<String>,
    /// Content blocks started so far in the stream, and the kind of the last one if it
    /// is still open.
    blocks: usize,
    open: Option<Block>,
    call_ids: Vec<String>,
    /// Calls whose blocks the stream started as they were decoded.
    streamed_calls: usize,
}

/// The kinds of content block a stream writes.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Text,
    Call,
}

impl Answer {
    fn new(model: String, stops: Vec<String>) -> Self {
        Answer {
            id: id("msg"),
            model,
            stops,
            blocks: 0,
            open: None,
            call_ids: Vec::new(),
            streamed_calls: 0,
        }
    }

    /// Start the next content block (ending the open one).
    fn start_block(&mut self, kind: Block, block: Value) -> String {
        let events = self.stop_block();
        let index = self.blocks;
        (self.blocks, self.open) = (index + 1, Some(kind));
        events + &event("content_block_start", json!({"index": index, "content_block": block}))
    }

    /// End the open content block, if one is.
    fn stop_block(&mut self) -> String {
        match self.open.take() {
            Some(_) => event("content_block_stop", json!({"index": self.blocks - 1})),
            None => String::new(),
        }
    }

    /// A delta of the open block.
    fn block_delta(&self, delta: Value) -> String {
        event("content_block_delta", json!({"index": self.blocks - 1, "delta": delta}))
    }

    fn fix_calls(&mut self, n: usize) {
        while self.call_ids.len() < n {
            self.call_ids.push(id("toolu"));
        }
    }

    /// Anthropic's stop reason and stop sequence.
    fn stop(&self, ended: &Ended) -> (&'static str, Option<String>) {
        match (ended.reason, ended.stop) {
            ("length", _) => ("max_tokens", None),
            _ if !ended.calls.is_empty() => ("tool_use", None),
            (_, Some(i)) => ("stop_sequence", self.stops.get(i).cloned()),
            _ => ("end_turn", None),
        }
    }

    /// A call's block, with its input (`{}` while streaming: the input comes as deltas).
    fn call_block(&self, i: usize, call: &Call, whole: bool) -> Value {
        let input = if whole {
            serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}))
        } else {
            json!({})
        };
        json!({"type": "tool_use", "id": self.call_ids[i], "name": call.name, "input": input})
    }

    /// The message object: as it starts (`None`), or ended.
    fn message(&mut self, ended: Option<&Ended>) -> Value {
        let (content, stop_reason, stop_sequence, usage) = match ended {
            None => (vec![], Value::Null, None, json!({"input_tokens": 0, "output_tokens": 0})),
            Some(ended) => {
                self.fix_calls(ended.calls.len());
                let mut content = Vec::new();
                if !ended.text.is_empty() {
                    content.push(json!({"type": "text", "text": ended.text}));
                }
                for (i, call) in ended.calls.iter().enumerate() {
                    content.push(self.call_block(i, call, true));
                }
                let (reason, sequence) = self.stop(ended);
                (content, json!(reason), sequence, usage_json(ended.usage))
            }
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        })
    }
}

/// One server-sent event, its `type` both the event's name and the data's `type`.
fn event(kind: &str, fields: Value) -> String {
    let mut data = Map::new();
    data.insert("type".into(), json!(kind));
    if let Value::Object(fields) = fields {
        data.extend(fields);
    }
    format!("event: {kind}\ndata: {}\n\n", Value::Object(data))
}

/// A fresh id such as `msg_1f0c...`.
fn id(prefix: &str) -> String {
    api::new_id(prefix).replacen('-', "_", 1)
}

/// Anthropic's usage: `input_tokens` are those computed, beside those read from memory.
fn usage_json(usage: Usage) -> Value {
    let cached = usage.prompt_tokens_details.cached_tokens;
    json!({
        "input_tokens": usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    })
}

impl Events for Answer {
    /// The events before anything is generated: the message, empty; a ping.
    fn opening(&mut self, input_tokens: u32) -> String {
        let mut message = self.message(None);
        message["usage"]["input_tokens"] = json!(input_tokens);
        event("message_start", json!({"message": message})) + &event("ping", json!({}))
    }

    /// A piece of text (a text block started first, at the first).
    fn text(&mut self, text: &str) -> String {
        let mut events = String::new();
        if self.open != Some(Block::Text) {
            events += &self.start_block(Block::Text, json!({"type": "text", "text": ""}));
        }
        events + &self.block_delta(json!({"type": "text_delta", "text": text}))
    }

    /// What a call added as it was decoded: its block started when it is named, then
    /// its input's JSON text, piece by piece.
    fn call(&mut self, delta: &CallDelta) -> String {
        let mut events = String::new();
        if let Some(name) = &delta.name {
            self.fix_calls(delta.index + 1);
            let block = json!({"type": "tool_use", "id": self.call_ids[delta.index], "name": name, "input": {}});
            events += &self.start_block(Block::Call, block);
            self.streamed_calls = delta.index + 1;
        }
        if !delta.arguments.is_empty() {
            let partial = json!({"type": "input_json_delta", "partial_json": delta.arguments});
            events += &self.block_delta(partial);
        }
        events
    }

    /// The events after the text and the calls streamed: the open block's end, the
    /// block of each call not streamed yet, then the stop reason with the usage, and
    /// the message's end.
    fn closing(&mut self, ended: &Ended) -> String {
        let mut events = self.stop_block();
        self.fix_calls(ended.calls.len());
        for (i, call) in ended.calls.iter().enumerate().skip(self.streamed_calls) {
            let block = self.call_block(i, call, false);
            events += &self.start_block(Block::Call, block);
            events += &self
                .block_delta(json!({"type": "input_json_delta", "partial_json": call.arguments}));
            events += &self.stop_block();
        }
        let (reason, sequence) = self.stop(ended);
        let delta = json!({"stop_reason": reason, "stop_sequence": sequence});
        events +=
            &event("message_delta", json!({"delta": delta, "usage": usage_json(ended.usage)}));
        events + &event("message_stop", json!({}))
    }

    /// An error after the stream started: the stream's last event.
    fn error(&mut self, e: &ApiError) -> String {
        format!("event: error\ndata: {}\n\n", e.to_anthropic_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> Object {
        Object::parse(json.as_bytes()).unwrap()
    }

    fn mapped(json: &str) -> Map<String, Value> {
        chat_body(&body(json), true).unwrap().0
    }

    fn param(json: &str) -> String {
        chat_body(&body(json), true).unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn system_and_blocks_become_chat_messages() {
        let chat = mapped(
            r#"{"model":"m","max_tokens":8,"stop_sequences":["\n"],"temperature":0,"top_k":4,
                "metadata":{"user_id":"u1"},"thinking":{"type":"disabled"},
                "system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.332.1c9;"},
                          {"type":"text","text":"Be brief.","cache_control":{"type":"ephemeral"}},{"type":"text","text":"Be kind."}],
                "messages":[
                  {"role":"user","content":"Weather?"},
                  {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},
                    {"type":"text","text":"Let me look."},
                    {"type":"tool_use","id":"toolu_1","name":"weather","input":{"city":"Lima"}}]},
                  {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"sunny"}]},
                    {"type":"text","text":"And tomorrow?"},
                    {"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]}]}"#,
        );
        let messages = chat["messages"].as_array().unwrap();
        assert_eq!(messages[0], json!({"role": "system", "content": "Be brief.\n\nBe kind."}));
        assert_eq!(messages[1], json!({"role": "user", "content": "Weather?"}));
        assert_eq!(messages[2]["content"], "Let me look.");
        assert_eq!(messages[2]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(messages[2]["tool_calls"][0]["function"]["arguments"], r#"{"city":"Lima"}"#);
        assert_eq!(
            messages[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(messages[4]["content"][0]["text"], "And tomorrow?");
        assert_eq!(messages[4]["content"][1]["image_url"]["url"], "data:image/png;base64,AAAA");
        assert_eq!((chat["max_tokens"].clone(), chat["stop"].clone()), (json!(8), json!(["\n"])));
        assert_eq!((chat["temperature"].clone(), chat["top_k"].clone()), (json!(0), json!(4)));
        assert_eq!(chat["user"], "u1");
    }

    #[test]
    fn what_claude_code_sends_is_served() {
        // Claude Code 2.1's request, in short: adaptive thinking, effort, a
        // context-management edit that clears thinking, a deferred tool, a system
        // message among the others, and a max_tokens above the host's cap.
        let chat = mapped(
            r#"{"model":"m","max_tokens":32000,"stream":true,
                "thinking":{"type":"adaptive","display":"omitted"},
                "output_config":{"effort":"high"},
                "context_management":{"edits":[{"type":"clear_thinking_20251015","keep":"all"}]},
                "metadata":{"user_id":"{\"session_id\":\"s\"}"},
                "tools":[{"name":"Read","description":"r","input_schema":{"type":"object"}},
                         {"name":"Later","description":"l","input_schema":{"type":"object"},"defer_loading":true}],
                "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},
                            {"role":"system","content":[{"type":"text","text":"env","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        assert!(chat.get("max_tokens").is_none(), "bounded by the context instead");
        assert_eq!(chat["tools"].as_array().unwrap().len(), 1, "the deferred tool is not shown");
        assert_eq!(chat["messages"][1], json!({"role": "system", "content": "env"}));
        let chat = mapped(
            r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],
                "output_config":{"format":{"type":"json_schema","schema":{"type":"object"}}}}"#,
        );
        assert_eq!(chat["response_format"]["json_schema"]["schema"], json!({"type": "object"}));
    }

    #[test]
    fn tools_and_tool_choice_map_onto_the_chat_path() {
        let tools = r#""tools":[{"name":"weather","description":"d","input_schema":{"type":"object"},"cache_control":{"type":"ephemeral"}},
                                {"type":"web_search_20250305","name":"web_search","max_uses":3}]"#;
        let with = |choice: &str| {
            mapped(&format!(
                r#"{{"model":"m","max_tokens":8,"messages":[{{"role":"user","content":"hi"}}],{tools}{choice}}}"#
            ))
        };
        let chat = with("");
        assert_eq!(chat["tools"].as_array().unwrap().len(), 1, "the server tool is skipped");
        assert_eq!(chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
        assert!(chat.get("tool_choice").is_none());
        assert_eq!(with(r#","tool_choice":{"type":"any"}"#)["tool_choice"], "required");
        assert_eq!(with(r#","tool_choice":{"type":"none"}"#)["tool_choice"], "none");
        let chat = with(
            r#","tool_choice":{"type":"tool","name":"weather","disable_parallel_tool_use":true}"#,
        );
        assert_eq!(chat["tool_choice"]["function"]["name"], "weather");
        assert_eq!(chat["parallel_tool_calls"], false);
    }

    #[test]
    fn fields_not_served_are_refused_by_path() {
        let msg = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (json, path) in [
            (format!(r#"{{"model":"m",{msg}}}"#), "max_tokens"),
            (format!(r#"{{"model":"m","max_tokens":0,{msg}}}"#), "max_tokens"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"thinking":{{"type":"enabled","budget_tokens":1024}}}}"#), "thinking"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"context_management":{{"edits":[{{"type":"clear_tool_uses_20250919"}}]}}}}"#), "context_management.edits[0]"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"output_config":{{"task_budget":1}}}}"#), "output_config.task_budget"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"output_config":{{"format":{{"type":"json_object"}}}}}}"#), "output_config.format.type"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"container":"c"}}"#), "container"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"metadata":{{"tier":"x"}}}}"#), "metadata.tier"),
            (r#"{"model":"m","max_tokens":8,"messages":[]}"#.into(), "messages"),
            (r#"{"model":"m","max_tokens":8,"messages":[{"role":"tool","content":"x"}]}"#.into(), "messages[0].role"),
            (r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"document","source":{}}]}]}"#.into(), "messages[0].content[0].type"),
            (r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"text","text":"x","source":{"a":1}}]}]}"#.into(), "messages[0].content[0].source"),
            (r#"{"model":"m","max_tokens":8,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":"x"}]}]}"#.into(), "messages[0].content[0].input"),
            (r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"file","file_id":"f"}}]}]}"#.into(), "messages[0].content[0].source.type"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"tool_choice":{{"type":"any"}}}}"#), "tool_choice"),
            (format!(r#"{{"model":"m","max_tokens":8,{msg},"tools":[{{"name":"f"}}]}}"#), "tools[0].input_schema"),
        ] {
            assert_eq!(param(&json), path, "{json}");
        }
        // count_tokens takes no max_tokens, and refuses sampling fields.
        let count = |json: &str| chat_body(&body(json), false);
        assert!(count(&format!(r#"{{"model":"m",{msg}}}"#)).is_ok());
        let e = count(&format!(r#"{{"model":"m",{msg},"temperature":0.5}}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
    }

    #[test]
    fn answers_in_anthropic_shape() {
        let mut answer = Answer::new("m".into(), vec!["STOP".into()]);
        let calls = [Call { name: "weather".into(), arguments: r#"{"city":"Lima"}"#.into() }];
        let ended = Ended::test("", "tool_calls", &calls);
        let message = answer.message(Some(&ended));
        assert_eq!(message["stop_reason"], "tool_use");
        assert_eq!(message["content"][0]["type"], "tool_use");
        assert_eq!(message["content"][0]["input"], json!({"city": "Lima"}));
        assert!(message["content"][0]["id"].as_str().unwrap().starts_with("toolu_"));
        assert_eq!(
            message["usage"],
            json!({"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 3})
        );
        let stopped = Ended { stop: Some(0), ..Ended::test("hi", "stop", &[]) };
        let message = answer.message(Some(&stopped));
        assert_eq!(
            (message["stop_reason"].clone(), message["stop_sequence"].clone()),
            (json!("stop_sequence"), json!("STOP"))
        );
        assert_eq!(message["content"], json!([{"type": "text", "text": "hi"}]));
        let long = Ended::test("hi", "length", &[]);
        assert_eq!(answer.message(Some(&long))["stop_reason"], "max_tokens");
        let done = Ended::test("hi", "stop", &[]);
        assert_eq!(answer.message(Some(&done))["stop_reason"], "end_turn");
    }

    #[test]
    fn stream_events_come_in_anthropic_order() {
        let mut answer = Answer::new("m".into(), vec![]);
        let calls = [Call { name: "f".into(), arguments: r#"{"a":1}"#.into() }];
        let ended = Ended::test("Hi", "tool_calls", &calls);
        let all =
            answer.opening(10) + &answer.text("H") + &answer.text("i") + &answer.closing(&ended);
        let events: Vec<(String, Value)> = all
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e.split_once('\n').unwrap();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(name.strip_prefix("event: ").unwrap(), data["type"]);
                (name.strip_prefix("event: ").unwrap().to_string(), data)
            })
            .collect();
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 10);
        assert_eq!(events[6].1["index"], 1);
        assert_eq!(events[6].1["content_block"]["input"], json!({}));
        assert_eq!(
            events[7].1["delta"],
            json!({"type": "input_json_delta", "partial_json": "{\"a\":1}"})
        );
        assert_eq!(events[9].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[9].1["usage"]["output_tokens"], 3);
    }

    #[test]
    fn calls_stream_as_they_are_decoded() {
        let mut answer = Answer::new("m".into(), vec![]);
        let delta = |index: usize, name: Option<&str>, arguments: &str| CallDelta {
            index,
            name: name.map(String::from),
            arguments: arguments.into(),
        };
        let mut all = answer.opening(10);
        for d in [
            delta(0, Some("f"), ""),
            delta(0, None, "{\"a\":"),
            delta(0, None, "1}"),
            delta(1, Some("g"), "{}"),
        ] {
            all += &answer.call(&d);
        }
        let calls = [
            Call { name: "f".into(), arguments: "{\"a\":1}".into() },
            Call { name: "g".into(), arguments: "{}".into() },
        ];
        let ended = Ended::test("", "tool_calls", &calls);
        all += &answer.closing(&ended);
        let events: Vec<Value> = all
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| serde_json::from_str(e.split_once("\ndata: ").unwrap().1).unwrap())
            .collect();
        let shape: Vec<String> = events
            .iter()
            .map(|e| format!("{}{}", e["type"].as_str().unwrap(), e["index"]))
            .collect();
        assert_eq!(
            shape,
            [
                "message_startnull",
                "pingnull",
                "content_block_start0",
                "content_block_delta0",
                "content_block_delta0",
                "content_block_stop0",
                "content_block_start1",
                "content_block_delta1",
                "content_block_stop1",
                "message_deltanull",
                "message_stopnull"
            ]
        );
        assert_eq!(events[2]["content_block"]["name"], "f");
        let partial: String =
            events[3..5].iter().map(|e| e["delta"]["partial_json"].as_str().unwrap()).collect();
        assert_eq!(partial, calls[0].arguments);
        // The ids are the ones the whole message gives.
        assert_eq!(
            events[6]["content_block"]["id"],
            answer.message(Some(&ended))["content"][1]["id"]
        );
    }

    #[test]
    fn chat_path_errors_name_the_requests_own_fields() {
        let (_, _, origins) = chat_body(
            &body(
                r#"{"model":"m","max_tokens":8,"system":"s",
                    "tools":[{"type":"web_search_20250305","name":"w"},{"name":"f","input_schema":{"type":"object"}}],
                    "messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},
                      {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"},{"type":"text","text":"c"}]}]}"#,
            ),
            true,
        )
        .unwrap();
        let named = |param: &str| {
            let e = ApiError::invalid(format!("'{param}' is wrong"), Some(param));
            let e = origins.name(e);
            (e.param.unwrap(), e.message)
        };
        assert_eq!(named("messages[0].content").0, "system.content");
        assert_eq!(
            named("messages[4].content"),
            ("messages[2].content".into(), "'messages[2].content' is wrong".into())
        );
        assert_eq!(named("messages[3].content").0, "messages[2].content");
        assert_eq!(named("tools[0].function.parameters").0, "tools[1].function.parameters");
        assert_eq!(named("messages").0, "messages");
        assert_eq!(named("max_tokens").0, "max_tokens");
    }

    #[test]
    fn errors_take_anthropic_shape() {
        let e = param(r#"{"model":"m","max_tokens":8,"messages":[{"role":"bot","content":"x"}]}"#);
        assert_eq!(e, "messages[0].role");
        let e = ApiError::invalid("bad", Some("messages[0].role")).to_anthropic_json();
        let e: Value = serde_json::from_str(&e).unwrap();
        assert_eq!(e["type"], "error");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["message"], "messages[0].role: bad");
        let busy: Value = serde_json::from_str(
            &ApiError { status: 503, ..ApiError::invalid("busy", None) }.to_anthropic_json(),
        )
        .unwrap();
        assert_eq!(busy["error"]["type"], "overloaded_error");
    }
}
