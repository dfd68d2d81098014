//! `POST /v1/responses` (OpenAI's Responses API): text and images in, text and function
//! calls out, with no state kept between requests.
//!
//! A Responses request is mapped onto a chat completion's body ([`chat_body`]) and runs
//! on the same core as `POST /v1/chat/completions` (template, sampling, constraints,
//! runs); only its answer is written out in the Responses shape, whole or as the
//! Responses API's named server-sent events.
//!
//! Honoured: `model`, `input` (a string, or a list of messages whose `content` is a
//! string or `input_text` / `output_text` / `input_image` parts: an image's URL, a
//! data URL on a model with a projector, `detail` `"auto"`), `instructions` (a system message
//! first), `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format`
//! (`text`, `json_object`, `json_schema`: the chat path's `response_format`),
//! `metadata` (echoed), `user`, `parallel_tool_calls`, `tool_choice` (`"none"`,
//! `"auto"`, `"required"`, `{"type":"function","name"}`), and `store: false`: no
//! response is kept, and the client sends the whole history each time, as Codex does.
//! `store: true` and `previous_response_id` are refused by name, and
//! `GET`/`DELETE /v1/responses/{id}` answer 404 saying that nothing is stored; the
//! answer echoes `store: false` when the request leaves it out.
//! Function `tools` map onto the chat path's tools, `function_call` input items onto
//! an assistant message's tool calls and `function_call_output` items onto tool
//! messages; the calls the model makes are `function_call` output items. Every tool
//! that is not a function (OpenAI's hosted `web_search`, `file_search`, `local_shell`,
//! ..., `custom` tools, Codex's `namespace` groups) is skipped: this server runs none of
//! them and the model is not told of them, so it answers without; one such tool never
//! fails the request.
//! Accepted because they ask for what the server does anyway: `reasoning.effort` (any
//! of the API's values: the model has no reasoning control, so it changes nothing),
//! `reasoning.summary` `"auto"` or `"none"` (the model writes no reasoning, so there is
//! none to summarize), `include: ["reasoning.encrypted_content"]` (there are no
//! reasoning items to carry it), `prompt_cache_key`, `safety_identifier`,
//! `client_metadata` (Codex's: an object of strings, read by nobody here),
//! `service_tier` `"auto"`/`"default"` and `truncation: "disabled"`.
//! Files and audio, and any other field or value not off (`null`, `false`, `[]`), are
//! refused with a 400 naming the field by its path (`reasoning.summary`, `include[1]`).
//! Errors the chat path finds in the mapped body name the request's own fields
//! (`input[3].content`, `tools[2]`, `instructions`: `Origins`).

use serde_json::{json, Map, Value};

use crate::api::{self, ApiError, AsDefault, Object, Origins, Usage};
use crate::completions::{Ended, EventStream, Events};
use crate::handlers;
use crate::http::Reply;
use crate::sampling::MAX_GENERATE_TOKENS;
use crate::tools::{Call, CallDelta};

/// The fields a Responses request may have (others are refused unless off).
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "text",
    "metadata",
    "user",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
    "reasoning",
    "include",
];

/// Fields accepted with the values that ask for what this server does anyway.
const AS_DEFAULT: &[AsDefault] = &[
    AsDefault {
        name: "service_tier",
        values: "\"auto\" or \"default\"",
        accepts: |v| matches!(v.as_str(), Some("auto" | "default")),
    },
    AsDefault { name: "truncation", values: "\"disabled\"", accepts: |v| v == "disabled" },
    AsDefault { name: "prompt_cache_key", values: "a string", accepts: Value::is_string },
    AsDefault { name: "safety_identifier", values: "a string", accepts: Value::is_string },
    AsDefault {
        name: "client_metadata",
        values: "an object of strings",
        accepts: |v| v.as_object().is_some_and(|o| o.values().all(Value::is_string)),
    },
];

/// The `include` values accepted: what they ask for never appears in an answer here.
const INCLUDE: &[&str] = &["reasoning.encrypted_content"];

/// What a Responses request asks for beside the chat body: the settings its answer
/// echoes.
#[derive(Debug)]
pub(crate) struct Echo {
    /// Where the chat body's messages and tools came from, for errors.
    pub origins: Origins,
    pub model: String,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: f64,
    pub top_p: f64,
    pub metadata: Value,
    pub user: Option<String>,
    pub parallel_tool_calls: bool,
    pub tool_choice: Value,
    /// The function tools, as given.
    pub tools: Vec<Value>,
    pub store: bool,
    /// `text.format` as given (`{"type":"text"}` when absent).
    pub format: Value,
    /// `reasoning` as given (`effort` and `summary`, `null` when absent).
    pub reasoning: Value,
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn unsupported(path: &str, what: &str) -> ApiError {
    invalid(format!("'{path}': {what} is not supported by this server"), path)
        .with_code("unsupported_parameter")
}

/// `POST /v1/responses`.
pub(crate) fn create(body: &Object) -> Result<Reply, ApiError> {
    let (chat, echo) = chat_body(body)?;
    let chat = Object::parse(&serde_json::to_vec(&chat).expect("a JSON map"))?;
    let stream = chat.get::<bool>("stream")?.unwrap_or(false);
    let format = crate::completions::Format {
        chat: true,
        id: api::new_id("chatcmpl"),
        created: api::now(),
        model: echo.model.clone(),
    };
    let choices = handlers::chat_choices(&chat, format).map_err(|e| echo.origins.name(e))?;
    let answer = Answer::new(echo);
    if stream {
        return Ok(Reply::Stream(Box::new(EventStream { choices, events: answer })));
    }
    let (mut choices, mut answer) = (choices, answer);
    let ended = choices.run_one(|_| Ok(()))?;
    Ok(Reply::Json(answer.response(Some(&ended)).to_string()))
}

/// The chat completion body a Responses request asks for, and what its answer echoes.
pub(crate) fn chat_body(body: &Object) -> Result<(Map<String, Value>, Echo), ApiError> {
    body.refuse_unknown_but(FIELDS, AS_DEFAULT)?;
    let model: String = body.require("model")?;
    let mut messages = Vec::new();
    let mut origins = Origins { all_messages: "input", ..Origins::default() };
    let instructions: Option<String> = body.get("instructions")?;
    if let Some(text) = &instructions {
        messages.push(json!({"role": "system", "content": text}));
        origins.messages.push("instructions".into());
    }
    match body.get::<Value>("input")? {
        None => return Err(invalid("Missing required parameter: 'input'", "input")),
        Some(Value::String(text)) => {
            messages.push(json!({"role": "user", "content": text}));
            origins.messages.push("input".into());
        }
        Some(Value::Array(items)) => {
            for (i, item) in items.into_iter().enumerate() {
                let path = format!("input[{i}]");
                input_item(&mut messages, item, &path)?;
                origins.messages.resize(messages.len(), path);
            }
        }
        Some(_) => return Err(invalid("'input' must be a string or a list of items", "input")),
    }
    if messages.is_empty() {
        return Err(invalid("'input' must contain at least one item", "input"));
    }
    let max_output_tokens: Option<u32> = body.get("max_output_tokens")?;
    match max_output_tokens {
        Some(0) => {
            return Err(invalid("'max_output_tokens' must be at least 1", "max_output_tokens"))
        }
        Some(n) if n > MAX_GENERATE_TOKENS => {
            let message = format!("'max_output_tokens' must be at most {}", MAX_GENERATE_TOKENS);
            return Err(invalid(message, "max_output_tokens"));
        }
        _ => {}
    }
    // Nothing is stored: asking for it is refused rather than pretended.
    if body.get::<bool>("store")? == Some(true) {
        let message = "'store': this server keeps no responses; send store: false (or leave it out) and the whole history with each request";
        return Err(invalid(message, "store").with_code("unsupported_parameter"));
    }
    let store = false;
    let metadata = body.get::<Map<String, Value>>("metadata")?.unwrap_or_default();
    if let Some((key, _)) = metadata.iter().find(|(_, v)| !v.is_string()) {
        let path = format!("metadata.{key}");
        return Err(invalid(format!("'{path}' must be a string"), &path));
    }
    // Tools: functions go to the chat path; every other kind is skipped (none here).
    let tools: Vec<Value> = body.get("tools")?.unwrap_or_default();
    let (mut functions, mut chat_tools) = (Vec::new(), Vec::new());
    for (i, tool) in tools.iter().enumerate() {
        let path = format!("tools[{i}]");
        match tool.get("type").and_then(Value::as_str) {
            None => {
                return Err(invalid(format!("'{path}.type' is required"), &format!("{path}.type")))
            }
            Some("function") => {
                let fields = ["type", "name", "description", "parameters", "strict"];
                if let Some((name, _)) = tool
                    .as_object()
                    .into_iter()
                    .flatten()
                    .find(|(k, v)| !fields.contains(&k.as_str()) && !off(v))
                {
                    return Err(unsupported(&format!("{path}.{name}"), "this field"));
                }
                let mut function = tool.as_object().cloned().unwrap_or_default();
                function.remove("type");
                function.retain(|_, v| !v.is_null());
                chat_tools.push(json!({"type": "function", "function": function}));
                functions.push(tool.clone());
                origins.tools.push(path);
            }
            Some(_) => {}
        }
    }
    let (tool_choice, chat_choice) = match body.get::<Value>("tool_choice")? {
        None => (json!("auto"), None),
        Some(Value::String(s)) if s == "none" || s == "auto" || s == "required" => {
            (json!(s), Some(json!(s)))
        }
        Some(Value::Object(choice))
            if choice.get("type").and_then(Value::as_str) == Some("function")
                && choice.get("name").is_some_and(Value::is_string) =>
        {
            let function = json!({"type": "function", "function": {"name": choice["name"]}});
            (Value::Object(choice), Some(function))
        }
        Some(_) => {
            return Err(invalid(
                "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\":\"function\",\"name\":...}",
                "tool_choice",
            ))
        }
    };
    // Without function tools, `tool_choice` "none" and "auto" ask for nothing.
    let chat_choice = chat_choice.filter(|c| !chat_tools.is_empty() || c != "none" && c != "auto");
    if chat_tools.is_empty() && chat_choice.is_some() {
        let message = "'tool_choice' asks for a call: it needs function 'tools'";
        return Err(invalid(message, "tool_choice"));
    }
    let parallel_tool_calls = body.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let temperature: Option<f64> = body.get("temperature")?;
    let top_p: Option<f64> = body.get("top_p")?;
    let user: Option<String> = body.get("user")?;
    let stream: Option<bool> = body.get("stream")?;
    let (format, response_format) = text_format(body)?;
    let reasoning = reasoning(body)?;
    include(body)?;

    let mut chat = Map::new();
    chat.insert("model".into(), json!(model));
    chat.insert("messages".into(), Value::Array(messages));
    for (name, value) in [
        ("max_tokens", max_output_tokens.map(Value::from)),
        ("temperature", temperature.map(Value::from)),
        ("top_p", top_p.map(Value::from)),
        ("user", user.clone().map(Value::from)),
        ("stream", stream.map(Value::from)),
        ("response_format", response_format),
        ("tools", (!chat_tools.is_empty()).then_some(Value::Array(chat_tools))),
        ("tool_choice", chat_choice),
        ("parallel_tool_calls", body.get::<bool>("parallel_tool_calls")?.map(Value::from)),
    ] {
        if let Some(value) = value {
            chat.insert(name.into(), value);
        }
    }
    let echo = Echo {
        origins,
        model,
        instructions,
        max_output_tokens,
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        metadata: Value::Object(metadata),
        user,
        parallel_tool_calls,
        tool_choice,
        tools: functions,
        store,
        format,
        reasoning,
    };
    Ok((chat, echo))
}

/// `reasoning` as the answer echoes it. The model has no reasoning control and writes
/// no reasoning: `effort` (any of the API's values) changes nothing, and `summary` is
/// accepted as `"auto"` (a summary when there is reasoning) or `"none"`; a summary
/// asked for (`"concise"`, `"detailed"`) and any other field are refused by path.
fn reasoning(body: &Object) -> Result<Value, ApiError> {
    let reasoning = match body.get::<Value>("reasoning")? {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(reasoning)) => reasoning,
        Some(_) => return Err(invalid("'reasoning' must be an object", "reasoning")),
    };
    for (name, value) in &reasoning {
        let path = format!("reasoning.{name}");
        match (name.as_str(), value.as_str()) {
            (_, None) if value.is_null() => {}
            ("effort", Some("none" | "minimal" | "low" | "medium" | "high" | "xhigh")) => {}
            ("effort", _) => {
                let message = format!(
                    "'{path}' must be \"none\", \"minimal\", \"low\", \"medium\", \"high\" or \"xhigh\""
                );
                return Err(invalid(message, &path));
            }
            ("summary", Some("auto" | "none")) => {}
            ("summary", Some(other)) => {
                let what = format!("a reasoning summary ('{other}': the model writes no reasoning; \"auto\" or \"none\" are accepted)");
                return Err(unsupported(&path, &what));
            }
            ("summary", None) => {
                return Err(invalid(format!("'{path}' must be a string"), &path));
            }
            _ if off(value) => {}
            _ => return Err(unsupported(&path, "this field")),
        }
    }
    let field = |name: &str| reasoning.get(name).cloned().unwrap_or(Value::Null);
    Ok(json!({"effort": field("effort"), "summary": field("summary")}))
}

/// `include`: only values that ask for what never appears here (`INCLUDE`).
fn include(body: &Object) -> Result<(), ApiError> {
    let items = match body.get::<Value>("include")? {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("'include' must be a list", "include")),
    };
    for (i, item) in items.iter().enumerate() {
        let path = format!("include[{i}]");
        match item.as_str() {
            Some(value) if INCLUDE.contains(&value) => {}
            Some(value) => return Err(unsupported(&path, &format!("'{value}'"))),
            None => return Err(invalid(format!("'{path}' must be a string"), &path)),
        }
    }
    Ok(())
}

/// `text.format` as the answer echoes it, and the chat path's `response_format`.
fn text_format(body: &Object) -> Result<(Value, Option<Value>), ApiError> {
    let text = match body.get::<Value>("text")? {
        None => return Ok((json!({"type": "text"}), None)),
        Some(Value::Object(text)) => text,
        Some(_) => return Err(invalid("'text' must be an object", "text")),
    };
    for (name, value) in &text {
        if name != "format" && !value.is_null() {
            return Err(unsupported(&format!("text.{name}"), "this field"));
        }
    }
    let format = match text.get("format") {
        None | Some(Value::Null) => return Ok((json!({"type": "text"}), None)),
        Some(Value::Object(format)) => format,
        Some(_) => return Err(invalid("'text.format' must be an object", "text.format")),
    };
    let kind = format.get("type").and_then(Value::as_str);
    let allowed: &[&str] = match kind {
        Some("text" | "json_object") => &["type"],
        Some("json_schema") => &["type", "name", "schema", "strict", "description"],
        _ => {
            return Err(invalid(
                "'text.format.type' must be \"text\", \"json_object\" or \"json_schema\"",
                "text.format.type",
            ))
        }
    };
    if let Some(name) = format.keys().find(|k| !allowed.contains(&k.as_str())) {
        let path = format!("text.format.{name}");
        return Err(unsupported(&path, "this field"));
    }
    let response_format = match kind {
        Some("json_schema") => {
            let mut schema = format.clone();
            schema.remove("type");
            if !schema.get("name").is_some_and(Value::is_string) {
                return Err(invalid("'text.format.name' is required", "text.format.name"));
            }
            json!({"type": "json_schema", "json_schema": schema})
        }
        _ => json!({"type": kind}),
    };
    Ok((Value::Object(format.clone()), Some(response_format)))
}

/// `input[i]` added to the chat `messages`: a message, a function call (an assistant
/// message's tool call: the one before it, when that is the assistant's) or a call's
/// output (a tool message).
fn input_item(messages: &mut Vec<Value>, item: Value, path: &str) -> Result<(), ApiError> {
    let kind = item.get("type").and_then(Value::as_str).map(String::from);
    let (fields, required): (&[&str], &[&str]) = match kind.as_deref() {
        Some("function_call") => (
            &["type", "call_id", "name", "arguments", "id", "status"],
            &["call_id", "name", "arguments"],
        ),
        Some("function_call_output") => {
            (&["type", "call_id", "output", "id", "status"], &["call_id", "output"])
        }
        _ => {
            messages.push(input_message(item, path)?);
            return Ok(());
        }
    };
    let item = item.as_object().expect("an item with a type");
    if let Some((name, _)) = item.iter().find(|(k, v)| !fields.contains(&k.as_str()) && !off(v)) {
        return Err(unsupported(&format!("{path}.{name}"), "this field"));
    }
    for name in required {
        if !item.get(*name).is_some_and(Value::is_string) {
            let p = format!("{path}.{name}");
            return Err(invalid(format!("'{p}' must be a string"), &p));
        }
    }
    if kind.as_deref() == Some("function_call_output") {
        messages.push(
            json!({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}),
        );
        return Ok(());
    }
    let call = json!({"id": item["call_id"], "type": "function",
                      "function": {"name": item["name"], "arguments": item["arguments"]}});
    match messages.last_mut() {
        Some(last) if last["role"] == "assistant" => {
            let calls = last.as_object_mut().expect("a message").entry("tool_calls");
            calls.or_insert_with(|| json!([])).as_array_mut().expect("a list").push(call);
        }
        _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
    }
    Ok(())
}

/// `input[i]`: a message (`type` "message", or no `type` and a `role`), as a chat message.
fn input_message(item: Value, path: &str) -> Result<Value, ApiError> {
    let Value::Object(item) = item else {
        return Err(invalid(format!("'{path}' must be an object"), path));
    };
    match item.get("type").and_then(Value::as_str) {
        Some("message") => {}
        None if matches!(item.get("type"), None | Some(Value::Null))
            && item.contains_key("role") => {}
        _ => return Err(ApiError::not_one_of(&format!("{path}.type"), &["message"])),
    }
    for name in item.keys() {
        // `id` and `status`: what the SDK writes back of an earlier answer's output.
        if !["type", "role", "content", "id", "status"].contains(&name.as_str()) {
            let p = format!("{path}.{name}");
            return Err(unsupported(&p, "this field"));
        }
    }
    let role = api::one_of(&item, "role", &["user", "system", "developer", "assistant"], path)?;
    let content = match item.get("content") {
        Some(Value::String(text)) => json!(text),
        Some(Value::Array(parts)) => {
            // Texts run together; an image (a chat image part) starts a new text part.
            let (mut chat_parts, mut text) = (Vec::new(), String::new());
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{path}.content[{j}]");
                let kind = part.get("type").and_then(Value::as_str);
                let allowed: &[&str] = match kind {
                    Some("input_text") => &["type", "text"],
                    Some("output_text") => &["type", "text", "annotations", "logprobs"],
                    Some("input_image") => &["type", "image_url", "detail"],
                    Some(other @ ("input_file" | "input_audio" | "refusal")) => {
                        return Err(unsupported(&format!("{p}.type"), &format!("'{other}'")))
                    }
                    _ => {
                        let p = format!("{p}.type");
                        return Err(ApiError::not_one_of(
                            &p,
                            &["input_text", "output_text", "input_image"],
                        ));
                    }
                };
                if let Some(name) = part
                    .as_object()
                    .and_then(|o| o.iter().find(|(k, v)| !allowed.contains(&k.as_str()) && !off(v)))
                    .map(|(k, _)| k)
                {
                    return Err(unsupported(&format!("{p}.{name}"), "this field"));
                }
                if kind == Some("input_image") {
                    // `detail` asks for a resolution: the projector has one of its own.
                    if part.get("detail").is_some_and(|d| !d.is_null() && d != "auto") {
                        return Err(unsupported(&format!("{p}.detail"), "a detail but \"auto\""));
                    }
                    let Some(url) = part.get("image_url").and_then(Value::as_str) else {
                        let p = format!("{p}.image_url");
                        return Err(invalid(format!("'{p}' must be a URL (a data: URL)"), &p));
                    };
                    if !text.is_empty() {
                        chat_parts.push(json!({"type": "text", "text": std::mem::take(&mut text)}));
                    }
                    chat_parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                    continue;
                }
                match part.get("text") {
                    Some(Value::String(t)) => text.push_str(t),
                    _ => {
                        let p = format!("{p}.text");
                        return Err(invalid(format!("'{p}' must be a string"), &p));
                    }
                }
            }
            if chat_parts.is_empty() {
                json!(text)
            } else {
                if !text.is_empty() {
                    chat_parts.push(json!({"type": "text", "text": text}));
                }
                Value::Array(chat_parts)
            }
        }
        _ => {
            let p = format!("{path}.content");
            return Err(invalid(format!("'{p}' must be a string or a list of parts"), &p));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// The answer being written: its ids, what it echoes, and the events' sequence.
pub(crate) struct Answer {
    id: String,
    item_id: String,
    created_at: u64,
    echo: Echo,
    sequence: u64,
    /// Whether the stream has opened the message item (at its first text).
    opened: bool,
    /// Each call's item id and call id, fixed when the call is named.
    call_ids: Vec<(String, String)>,
    /// Calls whose items the stream added as they were decoded.
    streamed_calls: usize,
}

/// A fresh id such as `resp_1f0c...`.
fn id(prefix: &str) -> String {
    api::new_id(prefix).replacen('-', "_", 1)
}

impl Answer {
    pub(crate) fn new(echo: Echo) -> Self {
        Answer {
            id: id("resp"),
            item_id: id("msg"),
            created_at: api::now(),
            echo,
            sequence: 0,
            opened: false,
            call_ids: Vec::new(),
            streamed_calls: 0,
        }
    }

    /// The message item, with `text` so far.
    fn item(&self, text: Option<&str>, done: bool) -> Value {
        let content = match text {
            Some(text) => vec![part(text)],
            None => vec![],
        };
        json!({
            "type": "message",
            "id": self.item_id,
            "status": if done { "completed" } else { "in_progress" },
            "role": "assistant",
            "content": content,
        })
    }

    /// Call `i`'s item, with its arguments so far.
    fn call_item(&self, i: usize, call: &Call, arguments: &str, done: bool) -> Value {
        let (id, call_id) = &self.call_ids[i];
        json!({
            "type": "function_call",
            "id": id,
            "call_id": call_id,
            "name": call.name,
            "arguments": arguments,
            "status": if done { "completed" } else { "in_progress" },
        })
    }

    /// Give the calls their ids.
    fn fix_calls(&mut self, n: usize) {
        while self.call_ids.len() < n {
            self.call_ids.push((id("fc"), id("call")));
        }
    }

    /// Whether the output has a message: it has text, or calls nothing (an answer
    /// that calls tools has no message unless it wrote text).
    fn has_message(ended: &Ended) -> bool {
        !ended.text.is_empty() || ended.calls.is_empty()
    }

    /// The response object: in progress (`None`), or ended.
    pub(crate) fn response(&mut self, ended: Option<&Ended>) -> Value {
        let (status, output, usage, incomplete) = match ended {
            None => ("in_progress", vec![], Value::Null, Value::Null),
            Some(ended) => {
                self.fix_calls(ended.calls.len());
                let (status, incomplete) = if ended.reason == "length" {
                    ("incomplete", json!({"reason": "max_output_tokens"}))
                } else {
                    ("completed", Value::Null)
                };
                let mut output = Vec::new();
                if Self::has_message(ended) {
                    output.push(self.item(Some(&ended.text), true));
                }
                for (i, call) in ended.calls.iter().enumerate() {
                    output.push(self.call_item(i, call, &call.arguments, true));
                }
                (status, output, usage_json(ended.usage), incomplete)
            }
        };
        let e = &self.echo;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "model": e.model,
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": e.reasoning,
            "store": e.store,
            "temperature": e.temperature,
            "text": {"format": e.format},
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": e.user,
            "metadata": e.metadata,
        })
    }

    /// One server-sent event: its `type` as the event's name, and its sequence number.
    fn event(&mut self, kind: &str, fields: Value) -> String {
        let mut data = Map::new();
        data.insert("type".into(), json!(kind));
        data.insert("sequence_number".into(), json!(self.sequence));
        if let Value::Object(fields) = fields {
            data.extend(fields);
        }
        self.sequence += 1;
        format!("event: {kind}\ndata: {}\n\n", Value::Object(data))
    }

    /// The message item and its text part added.
    fn open_message(&mut self) -> String {
        self.opened = true;
        let item = self.item(None, false);
        let item_id = self.item_id.clone();
        [
            self.event("response.output_item.added", json!({"output_index": 0, "item": item})),
            self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part("")}),
            ),
        ]
        .concat()
    }
}

/// Whether a value asks for nothing: `null`, `false` or `[]`.
fn off(value: &Value) -> bool {
    matches!(value, Value::Null | Value::Bool(false)) || value.as_array().is_some_and(Vec::is_empty)
}

fn part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    })
}

impl Events for Answer {
    /// The events before anything is generated: created, in progress.
    fn opening(&mut self, _prompt_tokens: u32) -> String {
        let response = self.response(None);
        [
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ]
        .concat()
    }

    /// A piece of text (the message opened first, at the first).
    fn text(&mut self, text: &str) -> String {
        let opening = if self.opened { String::new() } else { self.open_message() };
        let item_id = self.item_id.clone();
        opening
            + &self.event(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
            )
    }

    /// What a call added as it was decoded: its item added when it is named, then
    /// pieces of its arguments. Its index follows the message's, if one was opened.
    fn call(&mut self, delta: &CallDelta) -> String {
        let mut events = String::new();
        let index = delta.index + usize::from(self.opened);
        if let Some(name) = &delta.name {
            self.fix_calls(delta.index + 1);
            let call = Call { name: name.clone(), arguments: String::new() };
            let added = self.call_item(delta.index, &call, "", false);
            events += &self
                .event("response.output_item.added", json!({"output_index": index, "item": added}));
            self.streamed_calls = delta.index + 1;
        }
        if !delta.arguments.is_empty() {
            let item_id = self.call_ids[delta.index].0.clone();
            events += &self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": index, "delta": delta.arguments}),
            );
        }
        events
    }

    /// The events after the text: text, part and message done, each call's item with
    /// its arguments (added first, if the stream did not add it as it was decoded),
    /// and the response's end.
    fn closing(&mut self, ended: &Ended) -> String {
        let mut events = String::new();
        let message = Self::has_message(ended);
        if message && !self.opened {
            events += &self.open_message();
        }
        if message {
            let item_id = self.item_id.clone();
            let item = self.item(Some(&ended.text), true);
            let text = ended.text.as_str();
            events += &self.event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            );
            events += &self.event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part(text)}),
            );
            events +=
                &self.event("response.output_item.done", json!({"output_index": 0, "item": item}));
        }
        self.fix_calls(ended.calls.len());
        for (i, call) in ended.calls.iter().enumerate() {
            let index = i + usize::from(message);
            let item_id = self.call_ids[i].0.clone();
            let added = self.call_item(i, call, "", false);
            let done = self.call_item(i, call, &call.arguments, true);
            if i >= self.streamed_calls {
                events += &self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": added}),
                );
                events += &self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": item_id, "output_index": index, "delta": call.arguments}),
                );
            }
            events += &self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "name": call.name, "arguments": call.arguments}),
            );
            events += &self
                .event("response.output_item.done", json!({"output_index": index, "item": done}));
        }
        let response = self.response(Some(ended));
        let last = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        events + &self.event(last, json!({"response": response}))
    }

    /// An error after the stream started: the stream's last event.
    fn error(&mut self, e: &ApiError) -> String {
        self.event("error", json!({"code": e.code, "message": e.message, "param": e.param}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api;

    fn body(json: &str) -> Object {
        Object::parse(json.as_bytes()).unwrap()
    }

    fn mapped(json: &str) -> Result<(Map<String, Value>, Echo), ApiError> {
        chat_body(&body(json))
    }

    fn param(json: &str) -> String {
        let e = mapped(json).expect_err("refused");
        assert_eq!(e.status, 400, "{}", e.to_json());
        e.param.expect("a param").to_string()
    }

    #[test]
    fn input_and_instructions_become_chat_messages() {
        let (chat, echo) =
            mapped(r#"{"model":"m","input":"Say hi","instructions":"Be brief","max_output_tokens":16,"store":false}"#)
                .unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role":"system","content":"Be brief"},{"role":"user","content":"Say hi"}])
        );
        assert_eq!(chat["max_tokens"], 16);
        assert!(!chat.contains_key("stream"));
        assert_eq!(echo.instructions.as_deref(), Some("Be brief"));
        assert!(!echo.store);

        let (chat, _) = mapped(
            r#"{"model":"m","stream":true,"temperature":0,"top_p":0.5,"user":"u","input":[
                {"type":"message","role":"developer","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},
                {"role":"assistant","content":[{"type":"output_text","text":"c","annotations":[]}],"id":"msg_1","status":"completed"},
                {"role":"user","content":"d"}]}"#,
        )
        .unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role":"developer","content":"ab"},{"role":"assistant","content":"c"},{"role":"user","content":"d"}])
        );
        assert_eq!(
            (chat["stream"].clone(), chat["temperature"].clone()),
            (json!(true), json!(0.0))
        );
        assert_eq!((chat["top_p"].clone(), chat["user"].clone()), (json!(0.5), json!("u")));
    }

    #[test]
    fn text_format_maps_to_response_format() {
        let (chat, echo) =
            mapped(r#"{"model":"m","input":"x","text":{"format":{"type":"json_object"}}}"#)
                .unwrap();
        assert_eq!(chat["response_format"], json!({"type":"json_object"}));
        assert_eq!(echo.format, json!({"type":"json_object"}));
        let (chat, _) = mapped(
            r#"{"model":"m","input":"x","text":{"format":{"type":"json_schema","name":"n","strict":true,"schema":{"type":"object"}}}}"#,
        )
        .unwrap();
        assert_eq!(
            chat["response_format"],
            json!({"type":"json_schema","json_schema":{"name":"n","strict":true,"schema":{"type":"object"}}})
        );
        // The mapped body is one the chat path reads.
        let chat = Object::parse(&serde_json::to_vec(&chat).unwrap()).unwrap();
        assert!(chat.get::<api::ResponseFormat>("response_format").unwrap().is_some());
        let (chat, echo) =
            mapped(r#"{"model":"m","input":"x","text":{"format":{"type":"text"}}}"#).unwrap();
        assert_eq!(chat["response_format"], json!({"type":"text"}));
        assert_eq!(echo.format, json!({"type":"text"}));
        assert_eq!(
            param(r#"{"model":"m","input":"x","text":{"format":{"type":"grammar"}}}"#),
            "text.format.type"
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","text":{"format":{"type":"json_object","x":1}}}"#),
            "text.format.x"
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","text":{"verbosity":"low"}}"#),
            "text.verbosity"
        );
        assert_eq!(
            param(
                r#"{"model":"m","input":"x","text":{"format":{"type":"json_schema","schema":{}}}}"#
            ),
            "text.format.name"
        );
    }

    #[test]
    fn fields_not_served_are_refused_by_path() {
        assert_eq!(
            param(r#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#),
            "previous_response_id"
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","reasoning":{"summary":"detailed"}}"#),
            "reasoning.summary"
        );
        assert_eq!(param(r#"{"model":"m","input":"x","truncation":"auto"}"#), "truncation");
        assert_eq!(param(r#"{"model":"m"}"#), "input");
        assert_eq!(param(r#"{"model":"m","input":[]}"#), "input");
        assert_eq!(
            param(r#"{"model":"m","input":"x","max_output_tokens":0}"#),
            "max_output_tokens"
        );
        assert_eq!(param(r#"{"model":"m","input":"x","metadata":{"k":1}}"#), "metadata.k");
        assert_eq!(param(r#"{"model":"m","input":[{"type":"reasoning"}]}"#), "input[0].type");
        assert_eq!(
            param(r#"{"model":"m","input":[{"role":"tool","content":"x"}]}"#),
            "input[0].role"
        );
        assert_eq!(
            param(r#"{"model":"m","input":[{"role":"user","content":"x","name":"n"}]}"#),
            "input[0].name"
        );
        assert_eq!(
            param(
                r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image","file_id":"f"}]}]}"#
            ),
            "input[0].content[1].file_id"
        );
        assert_eq!(
            param(
                r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"data:image/png;base64,AA","detail":"high"}]}]}"#
            ),
            "input[0].content[0].detail"
        );
        let (chat, _) = mapped(
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"What is"},{"type":"input_text","text":" this?"},{"type":"input_image","image_url":"data:image/png;base64,AA","detail":"auto"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            chat["messages"][0]["content"],
            json!([{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}])
        );
        assert_eq!(
            param(
                r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a","extra":1}]}]}"#
            ),
            "input[0].content[0].extra"
        );
        assert_eq!(param(r#"{"model":"m","input":"x","tool_choice":"required"}"#), "tool_choice");
        // Off is accepted; hosted tools are skipped; nothing is stored.
        assert_eq!(param(r#"{"model":"m","input":"x","store":true}"#), "store");
        let (chat, echo) = mapped(
            r#"{"model":"m","input":"x","reasoning":null,"include":[],"background":false,
                "tools":[{"type":"web_search"},{"type":"local_shell"}],"tool_choice":"none",
                "parallel_tool_calls":false,"metadata":{"k":"v"},"truncation":"disabled"}"#,
        )
        .unwrap();
        assert!(!chat.contains_key("tools") && !chat.contains_key("tool_choice"));
        assert!(!echo.store && !echo.parallel_tool_calls);
        assert_eq!(
            (echo.tool_choice.clone(), echo.metadata.clone()),
            (json!("none"), json!({"k":"v"}))
        );
    }

    /// What Codex 0.171 sends (tests/serve/codex.rs runs it): hosted, namespace and
    /// custom tools beside its functions, `reasoning` with a summary on `auto`, `include`,
    /// `store: false`, `prompt_cache_key` and `client_metadata`.
    #[test]
    fn codex_requests_are_accepted() {
        let (chat, echo) = mapped(
            r#"{"model":"m","stream":true,"tool_choice":"auto","parallel_tool_calls":true,
                "reasoning":{"summary":"auto"},"store":false,"include":["reasoning.encrypted_content"],
                "prompt_cache_key":"k","client_metadata":{"thread_id":"t","turn_id":"u"},
                "tools":[{"type":"function","name":"exec_command","description":"d","strict":false,
                          "parameters":{"type":"object","properties":{"cmd":{"type":"string"}},"required":["cmd"],"additionalProperties":false}},
                         {"type":"namespace","name":"multi_agent_v1","description":"d",
                          "tools":[{"type":"function","name":"spawn_agent","parameters":{"type":"object"}}]},
                         {"type":"web_search","external_web_access":false},{"type":"local_shell"},
                         {"type":"custom","name":"apply_patch","format":{"type":"grammar","syntax":"lark","definition":"x"}}],
                "input":[{"type":"message","id":"msg_1","role":"developer","content":[{"type":"input_text","text":"You are Codex."}]},
                         {"type":"message","role":"user","content":[{"type":"input_text","text":"Say hi"}]}]}"#,
        )
        .unwrap();
        // Only the function reaches the chat path: it is all the model is told of.
        let tools = chat["tools"].as_array().unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0]["function"]["name"], "exec_command");
        assert_eq!(chat["tool_choice"], "auto");
        assert_eq!(echo.tools.len(), 1);
        assert!(!echo.store);
        assert_eq!(echo.reasoning, json!({"effort": null, "summary": "auto"}));
        assert_eq!(
            chat["messages"],
            json!([{"role":"developer","content":"You are Codex."},{"role":"user","content":"Say hi"}])
        );
        // The answer echoes the reasoning settings as given.
        let (_, echo) =
            mapped(r#"{"model":"m","input":"x","reasoning":{"effort":"high","summary":null}}"#)
                .unwrap();
        let r = Answer::new(echo).response(Some(&Ended::test("Hi", "stop", &[])));
        assert_eq!(r["reasoning"], json!({"effort": "high", "summary": null}));
        // Only hosted or custom tools: the model answers without tools.
        let (chat, _) = mapped(
            r#"{"model":"m","input":"x","tool_choice":"auto","tools":[{"type":"custom","name":"c"},{"type":"namespace","name":"n","tools":[]}]}"#,
        )
        .unwrap();
        assert!(!chat.contains_key("tools") && !chat.contains_key("tool_choice"));
    }

    #[test]
    fn reasoning_and_include_are_refused_by_path_unless_default() {
        for effort in ["none", "minimal", "low", "medium", "high", "xhigh"] {
            let body =
                format!(r#"{{"model":"m","input":"x","reasoning":{{"effort":"{effort}"}}}}"#);
            assert_eq!(mapped(&body).unwrap().1.reasoning["effort"], effort);
        }
        for summary in ["auto", "none"] {
            let body =
                format!(r#"{{"model":"m","input":"x","reasoning":{{"summary":"{summary}"}}}}"#);
            assert!(mapped(&body).is_ok());
        }
        mapped(r#"{"model":"m","input":"x","reasoning":{},"include":null}"#).unwrap();
        for (body, path) in [
            (r#"{"reasoning":{"effort":"max"}}"#, "reasoning.effort"),
            (r#"{"reasoning":{"effort":3}}"#, "reasoning.effort"),
            (r#"{"reasoning":{"summary":"concise"}}"#, "reasoning.summary"),
            (r#"{"reasoning":{"summary":1}}"#, "reasoning.summary"),
            (r#"{"reasoning":{"generate_summary":"auto"}}"#, "reasoning.generate_summary"),
            (r#"{"reasoning":"high"}"#, "reasoning"),
            (
                r#"{"include":["reasoning.encrypted_content","message.output_text.logprobs"]}"#,
                "include[1]",
            ),
            (r#"{"include":[1]}"#, "include[0]"),
            (r#"{"include":"reasoning.encrypted_content"}"#, "include"),
            (r#"{"client_metadata":{"k":1}}"#, "client_metadata"),
            (
                r#"{"tool_choice":{"type":"custom","name":"c"},"tools":[{"type":"custom","name":"c"}]}"#,
                "tool_choice",
            ),
            (r#"{"tool_choice":"required","tools":[{"type":"web_search"}]}"#, "tool_choice"),
            (r#"{"tools":[{"name":"f"}]}"#, "tools[0].type"),
        ] {
            let mut full: Map<String, Value> = serde_json::from_str(body).unwrap();
            full.insert("model".into(), json!("m"));
            full.insert("input".into(), json!("x"));
            assert_eq!(param(&Value::Object(full).to_string()), path, "{body}");
        }
        let e = mapped(r#"{"model":"m","input":"x","reasoning":{"summary":"detailed"}}"#)
            .expect_err("refused");
        assert_eq!(e.code, Some("unsupported_parameter"));
    }

    fn answer() -> Answer {
        let (_, echo) = mapped(r#"{"model":"m","input":"x","instructions":"i"}"#).unwrap();
        Answer::new(echo)
    }

    #[test]
    fn function_tools_and_items_map_to_chat_tools_and_messages() {
        let (chat, echo) = mapped(
            r#"{"model":"m","tools":[{"type":"web_search"},{"type":"function","name":"f","description":"d",
                "parameters":{"type":"object"},"strict":true}],"tool_choice":{"type":"function","name":"f"},
                "input":[{"role":"user","content":"q"},
                {"type":"function_call","call_id":"c1","name":"f","arguments":"{}","id":"fc_1","status":"completed"},
                {"type":"function_call","call_id":"c2","name":"f","arguments":"{\"a\":1}"},
                {"type":"function_call_output","call_id":"c1","output":"o1"},
                {"type":"function_call_output","call_id":"c2","output":"o2"}]}"#,
        )
        .unwrap();
        assert_eq!(
            chat["tools"],
            json!([{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"},"strict":true}}])
        );
        assert_eq!(chat["tool_choice"], json!({"type":"function","function":{"name":"f"}}));
        assert_eq!(
            chat["messages"],
            json!([{"role":"user","content":"q"},
                   {"role":"assistant","content":null,"tool_calls":[
                       {"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}},
                       {"id":"c2","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},
                   {"role":"tool","tool_call_id":"c1","content":"o1"},
                   {"role":"tool","tool_call_id":"c2","content":"o2"}])
        );
        assert_eq!(echo.tools.len(), 1);
        assert_eq!(echo.tool_choice, json!({"type":"function","name":"f"}));
        // The chat path reads the mapped messages.
        for (i, m) in chat["messages"].as_array().unwrap().iter().enumerate() {
            api::Message::read(m.clone(), i).unwrap();
        }
        assert_eq!(
            param(r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f","x":1}]}"#),
            "tools[0].x"
        );
        assert_eq!(
            param(r#"{"model":"m","input":[{"type":"function_call","call_id":"c","name":"f"}]}"#),
            "input[0].arguments"
        );
        assert_eq!(
            param(
                r#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"o","x":1}]}"#
            ),
            "input[0].x"
        );
    }

    #[test]
    fn calls_are_output_items() {
        let calls = [Call { name: "f".into(), arguments: "{}".into() }];
        let mut a = answer();
        let r = a.response(Some(&Ended::test("", "tool_calls", &calls)));
        assert_eq!(r["output"].as_array().unwrap().len(), 1);
        let call = &r["output"][0];
        assert_eq!(
            (call["type"].clone(), call["name"].clone()),
            (json!("function_call"), json!("f"))
        );
        assert_eq!(
            (call["arguments"].clone(), call["status"].clone()),
            (json!("{}"), json!("completed"))
        );
        assert!(call["id"].as_str().unwrap().starts_with("fc_"));
        assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
        // Streamed: no message without text; the call's events; its ids as in the end.
        let all = [a.opening(0), a.closing(&Ended::test("", "tool_calls", &calls))].concat();
        let events = framed(
            &all,
            &[
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ],
        );
        assert_eq!(events[2].1["item"]["id"], call["id"]);
        assert_eq!(events[6].1["response"]["output"][0]["call_id"], call["call_id"]);
        // Text and a call: the message first, the call at output_index 1.
        let mut a = answer();
        let all = [a.opening(0), a.text("t"), a.closing(&Ended::test("t", "tool_calls", &calls))]
            .concat();
        let events = parse(&all);
        assert_eq!(events[2].1["item"]["type"], "message");
        let call_added = events.iter().find(|(n, d)| {
            n == "response.output_item.added" && d["item"]["type"] == "function_call"
        });
        assert_eq!(call_added.unwrap().1["output_index"], 1);
    }

    #[test]
    fn response_shapes() {
        let mut a = answer();
        let r = a.response(Some(&Ended::test("Hi", "stop", &[])));
        assert!(r["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(
            (r["object"].clone(), r["status"].clone()),
            (json!("response"), json!("completed"))
        );
        assert_eq!(r["incomplete_details"], Value::Null);
        assert_eq!(r["instructions"], "i");
        assert_eq!((r["model"].clone(), r["tools"].clone()), (json!("m"), json!([])));
        assert_eq!(
            (r["tool_choice"].clone(), r["parallel_tool_calls"].clone()),
            (json!("auto"), json!(true))
        );
        let item = &r["output"][0];
        assert!(item["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(item["type"], "message");
        assert_eq!(
            (item["role"].clone(), item["status"].clone()),
            (json!("assistant"), json!("completed"))
        );
        assert_eq!(
            item["content"],
            json!([{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}])
        );
        assert_eq!(
            r["usage"],
            json!({"input_tokens":10,"input_tokens_details":{"cached_tokens":4},"output_tokens":3,
                   "output_tokens_details":{"reasoning_tokens":0},"total_tokens":13})
        );
        let r = a.response(Some(&Ended::test("Hi", "length", &[])));
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"], json!({"reason":"max_output_tokens"}));
    }

    /// The events of stream `all`, checked to be created, in progress, `middle` and
    /// completed, in that order.
    fn framed(all: &str, middle: &[&str]) -> Vec<(String, Value)> {
        let events = parse(all);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        let framed =
            [&["response.created", "response.in_progress"], middle, &["response.completed"]];
        assert_eq!(names, framed.concat());
        events
    }

    /// The events of a stream, as (name, data).
    fn parse(text: &str) -> Vec<(String, Value)> {
        text.split_terminator("\n\n")
            .map(|event| {
                let (name, data) = event.split_once('\n').unwrap();
                let name = name.strip_prefix("event: ").unwrap().to_string();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(data["type"], name.as_str());
                (name, data)
            })
            .collect()
    }

    #[test]
    fn stream_events_come_in_openai_order() {
        let mut a = answer();
        let all =
            [a.opening(0), a.text("H"), a.text("i"), a.closing(&Ended::test("Hi", "stop", &[]))]
                .concat();
        let events = framed(
            &all,
            &[
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ],
        );
        for (i, (_, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], i as u64);
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        assert_eq!(events[2].1["item"]["status"], "in_progress");
        assert_eq!(events[4].1["delta"], "H");
        assert_eq!(events[4].1["item_id"], events[2].1["item"]["id"]);
        assert_eq!(events[6].1["text"], "Hi");
        assert_eq!(events[9].1["response"]["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(events[9].1["response"]["id"], events[0].1["response"]["id"]);
        let last = a.closing(&Ended::test("Hi", "length", &[]));
        assert!(last.contains("event: response.incomplete\n"));

        // A call streamed as it is decoded: its item added when named, its arguments
        // in pieces, then done with the whole text, under the same ids as the answer's.
        let mut a = answer();
        let delta = |name: Option<&str>, arguments: &str| CallDelta {
            index: 0,
            name: name.map(String::from),
            arguments: arguments.into(),
        };
        let calls = [Call { name: "f".into(), arguments: r#"{"a":1}"#.into() }];
        let all = [
            a.opening(0),
            a.call(&delta(Some("f"), "")),
            a.call(&delta(None, r#"{"a":"#)),
            a.call(&delta(None, "1}")),
            a.closing(&Ended::test("", "tool_calls", &calls)),
        ]
        .concat();
        let events = framed(
            &all,
            &[
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ],
        );
        assert_eq!(events[2].1["item"]["name"], "f");
        assert_eq!(events[3].1["item_id"], events[2].1["item"]["id"]);
        assert_eq!(events[5].1["arguments"], calls[0].arguments);
        let output = &events[7].1["response"]["output"][0];
        assert_eq!(output["call_id"], events[2].1["item"]["call_id"]);
        let e = a.error(&ApiError::invalid("bad", Some("x")));
        let (name, data) = &parse(&e)[0];
        assert_eq!(
            (name.as_str(), data["message"].clone(), data["param"].clone()),
            ("error", json!("bad"), json!("x"))
        );
    }
}
