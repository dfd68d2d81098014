//! Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) for every model.
//! The answer is constrained on the host to a JSON envelope, written compactly:
//! `{"tool_calls":[{"name":…,"arguments":{…}}]}`, or, where the model may answer instead
//! (`auto`), `{"response":"…"}`; this module writes that schema and reads the envelope
//! back into OpenAI's shapes, streaming the `response` text as it comes. It is the
//! generic format llama-server falls back to for templates without a tool syntax of
//! their own. Model-specific syntaxes (Hermes' `<tool_call>`, Llama 3.1's) are not
//! parsed: the grammar has every model answer in the envelope, so every call parses and
//! its arguments follow the function's `parameters` schema.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::{ApiError, Object};

/// Most functions one request may offer: each adds its schema to the grammar, which
/// the host caps anyway (max-grammar-bytes); this names the problem first.
pub const MAX_TOOLS: usize = 64;
/// The envelope's text branch alone: what an answer is held to when its prompt shows
/// earlier calls as the envelope's JSON but no tool may be called now.
pub const RESPONSE_ONLY: &str = r#"{"type":"object","properties":{"response":{"type":"string"}},"required":["response"],"additionalProperties":false}"#;
/// Most calls one answer may make when `parallel_tool_calls` allows several.
pub const MAX_PARALLEL_CALLS: u32 = 8;

/// A function the model may call.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Function {
    name: String,
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    /// A JSON Schema for the arguments; absent: any object.
    #[serde(default)]
    parameters: Option<Value>,
    /// Read so that it is not refused; the arguments always follow `parameters` here.
    #[serde(default)]
    #[allow(dead_code)]
    strict: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    function: Function,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
enum Choice {
    Auto,
    Required,
    Named(String),
}

/// The tools of a request that may call them.
pub struct Tools {
    functions: Vec<Function>,
    choice: Choice,
    parallel: bool,
    /// The request's `tools` as sent, for the prompt.
    listed: Value,
    /// A direct answer is JSON following the request's `response_format`.
    json_response: bool,
}

impl Tools {
    /// `tools`, `tool_choice` and `parallel_tool_calls` of a chat body, checked. `None`:
    /// nothing may be called (no tools, or `tool_choice` `none`).
    pub fn read(body: &Object) -> Result<Option<Tools>, ApiError> {
        let listed: Option<Value> = body.get("tools")?;
        let choice: Option<Value> = body.get("tool_choice")?;
        let parallel = body.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
        let Some(listed) = listed.filter(|l| l.as_array().is_some_and(|a| !a.is_empty())) else {
            return match choice {
                None => Ok(None),
                Some(Value::String(s)) if s == "none" => Ok(None),
                Some(_) => Err(ApiError::invalid(
                    "'tool_choice' is only allowed when 'tools' are given",
                    Some("tool_choice"),
                )),
            };
        };
        let tools: Vec<Tool> = serde_json::from_value(listed.clone()).map_err(|e| {
            ApiError::invalid(format!("Invalid value for 'tools': {e}"), Some("tools"))
        })?;
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                format!("{} tools: at most {MAX_TOOLS} per request", tools.len()),
                Some("tools"),
            ));
        }
        let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
        for (i, tool) in tools.into_iter().enumerate() {
            let param = format!("tools[{i}]");
            if tool.kind != "function" {
                return Err(ApiError::invalid(
                    format!(
                        "Unsupported tool type '{}': only function tools are served",
                        tool.kind
                    ),
                    Some(&param),
                ));
            }
            let f = tool.function;
            let valid = (1..=64).contains(&f.name.len())
                && f.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(ApiError::invalid(
                    format!("Function name '{}' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f.name),
                    Some(&param),
                ));
            }
            if functions.iter().any(|g| g.name == f.name) {
                return Err(ApiError::invalid(
                    format!("Function '{}' is defined twice", f.name),
                    Some(&param),
                ));
            }
            if f.parameters.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(ApiError::invalid(
                    "'parameters' must be a JSON Schema object",
                    Some(&param),
                ));
            }
            if let Some(parameters) = &f.parameters {
                check_refs(parameters, &format!("{param}.function.parameters"))?;
            }
            functions.push(f);
        }
        let choice = match choice {
            None => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => return Ok(None),
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::invalid(
                        format!(
                        "Unsupported tool_choice '{other}': use none, auto, required or a function"
                    ),
                        Some("tool_choice"),
                    ))
                }
            },
            Some(named) => {
                let name = match (named.get("type").and_then(Value::as_str), named.pointer("/function/name").and_then(Value::as_str)) {
                    (Some("function"), Some(name)) => name.to_string(),
                    _ => return Err(ApiError::invalid("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}", Some("tool_choice"))),
                };
                if !functions.iter().any(|f| f.name == name) {
                    return Err(ApiError::invalid(
                        format!("tool_choice names '{name}', which is not among the tools"),
                        Some("tool_choice"),
                    ));
                }
                Choice::Named(name)
            }
        };
        Ok(Some(Tools { functions, choice, parallel, listed, json_response: false }))
    }

    /// The request's `tools`, for the prompt.
    pub fn listed(&self) -> &Value {
        &self.listed
    }

    /// Whether the answer must call (`required` or a named function).
    pub fn forced(&self) -> bool {
        self.choice != Choice::Auto
    }

    /// The JSON Schema the answer must follow: the calls, or under `auto` also
    /// `{"response": …}`, a string or, when the request has a `response_format` schema
    /// (`response`), a JSON value following it.
    ///
    /// Each function's `parameters` go in as given, but for two things:
    /// - Objects that list `properties` and do not say `additionalProperties` are
    ///   closed (`false`), as llama.cpp's schema converter reads them: else a call
    ///   could pad its arguments with made-up fields until max_tokens. An object that
    ///   lists no properties stays open (any object), and so do the branches of an
    ///   `allOf`, whose properties add up.
    /// - References resolve: a function whose parameters use `$ref` (Pydantic's
    ///   nested models: `#/$defs/Model`) has them at `$defs/f<index>` of the envelope,
    ///   its references rewritten to point there (`#/$defs/f0/$defs/Model`). Only local
    ///   references (`#`, `#/...`) are taken (checked in `read`); a recursive one is
    ///   the host grammar's to take or refuse (a 400 naming `tools` before any work).
    pub fn schema(&self, response: Option<&Value>) -> Value {
        let mut defs = serde_json::Map::new();
        let mut call = |i: usize, f: &Function| {
            let mut arguments = f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
            close_objects(&mut arguments, false);
            if has_refs(&arguments) {
                let at = format!("f{i}");
                rebase_refs(&mut arguments, &format!("#/$defs/{at}"));
                defs.insert(at.clone(), arguments);
                arguments = json!({"$ref": format!("#/$defs/{at}")});
            }
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let (items, max) = match &self.choice {
            Choice::Named(name) => {
                let i =
                    self.functions.iter().position(|f| &f.name == name).expect("checked in read");
                (call(i, &self.functions[i]), 1)
            }
            _ if self.functions.len() == 1 => (call(0, &self.functions[0]), self.max_calls()),
            _ => {
                let each: Vec<Value> =
                    self.functions.iter().enumerate().map(|(i, f)| call(i, f)).collect();
                (json!({ "anyOf": each }), self.max_calls())
            }
        };
        let calls = json!({
            "type": "object",
            "properties": {"tool_calls": {"type": "array", "items": items, "minItems": 1, "maxItems": max}},
            "required": ["tool_calls"],
            "additionalProperties": false,
        });
        let response = match response {
            None => json!({"type": "string"}),
            Some(schema) if has_refs(schema) => {
                let mut schema = schema.clone();
                rebase_refs(&mut schema, "#/$defs/response");
                defs.insert("response".into(), schema);
                json!({"$ref": "#/$defs/response"})
            }
            Some(schema) => schema.clone(),
        };
        let mut schema = match self.choice {
            Choice::Auto => json!({"anyOf": [calls, {
                "type": "object",
                "properties": {"response": response},
                "required": ["response"],
                "additionalProperties": false,
            }]}),
            _ => calls,
        };
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        schema
    }

    fn max_calls(&self) -> u32 {
        if self.parallel {
            MAX_PARALLEL_CALLS
        } else {
            1
        }
    }

    /// A direct answer (`auto`) is to be JSON following the request's `response_format`.
    pub fn answer_in_json(&mut self) {
        self.json_response = true;
    }

    /// How to answer, for the system turn: the envelope in words.
    pub fn instruction(&self) -> String {
        let call =
            r#"{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}"#;
        let answer =
            if self.json_response { "<your answer, as JSON>" } else { "\"<your answer>\"" };
        match &self.choice {
            Choice::Auto => format!("Answer with a JSON object: {call} to call tools, or {{\"response\": {answer}}} to answer directly."),
            Choice::Required => format!("Answer by calling tools, with a JSON object: {call}"),
            Choice::Named(name) => format!("Answer by calling the function {name}, with a JSON object: {call}"),
        }
    }
}

/// Keywords whose values are data, not schemas: never walked.
const DATA_KEYWORDS: [&str; 4] = ["enum", "const", "default", "examples"];

/// A 400 naming `param` for a reference that does not point into the function's own
/// parameters (`#`, `#/...`): nothing else can be resolved here.
fn check_refs(schema: &Value, param: &str) -> Result<(), ApiError> {
    let mut bad = None;
    visit_refs(schema, &mut |r| {
        if r != "#" && !r.starts_with("#/") {
            bad.get_or_insert_with(|| r.to_string());
        }
    });
    match bad {
        Some(r) => Err(ApiError::invalid(
            format!("'$ref' {r:?} is not served: only references within the function's parameters ('#/$defs/...')"),
            Some(param),
        )),
        None => Ok(()),
    }
}

fn visit_refs(schema: &Value, see: &mut impl FnMut(&str)) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("$ref", Value::String(r)) => see(r),
                    (key, _) if DATA_KEYWORDS.contains(&key) => {}
                    _ => visit_refs(value, see),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| visit_refs(v, see)),
        _ => {}
    }
}

fn has_refs(schema: &Value) -> bool {
    let mut any = false;
    visit_refs(schema, &mut |_| any = true);
    any
}

/// Every local reference of `schema` (`#/x`) made to point to the same place in
/// `schema` once it stands at `base` (`base/x`).
fn rebase_refs(schema: &mut Value, base: &str) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("$ref", Value::String(r)) => *r = format!("{base}{}", &r[1..]),
                    (key, _) if DATA_KEYWORDS.contains(&key) => {}
                    (_, value) => rebase_refs(value, base),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

/// `additionalProperties: false` on every object schema within `schema` that lists
/// `properties` and says nothing of other ones, except the branches of an `allOf`
/// (`in_all_of`), whose properties add up.
fn close_objects(schema: &mut Value, in_all_of: bool) {
    match schema {
        Value::Object(map) => {
            if !in_all_of
                && map.contains_key("properties")
                && !map.contains_key("additionalProperties")
                && !map.contains_key("patternProperties")
                && !map.contains_key("unevaluatedProperties")
            {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (key, value) in map.iter_mut() {
                match key.as_str() {
                    key if DATA_KEYWORDS.contains(&key) => {}
                    "allOf" => {
                        for branch in value.as_array_mut().into_iter().flatten() {
                            close_objects(branch, true);
                        }
                    }
                    // Maps of name to schema.
                    "properties" | "patternProperties" | "$defs" | "definitions"
                    | "dependentSchemas" => {
                        for sub in value.as_object_mut().into_iter().flat_map(|m| m.values_mut()) {
                            close_objects(sub, false);
                        }
                    }
                    _ => close_objects(value, false),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| close_objects(v, false)),
        _ => {}
    }
}

/// A call the model made, as OpenAI returns it: `arguments` is JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// What a call adds to the answer as it is decoded: its name first (`name` is set on
/// its first delta), then pieces of its arguments' JSON text, which add up to
/// [`Call::arguments`].
#[derive(Clone, Debug, PartialEq)]
pub struct CallDelta {
    /// Which call of the answer (0, 1, ...).
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

/// Reads one answer's envelope as its text arrives: the `response` text is handed on
/// as it is decoded (or, for a `response_format` answer, the JSON value's own text),
/// and so are calls ([`Reader::call_deltas`]).
#[derive(Default)]
pub struct Reader {
    raw: String,
    state: State,
    /// `response` is a JSON value (a `response_format`), not a string of text.
    json: bool,
    /// How many bytes of each call's arguments were handed on as deltas.
    sent: Vec<usize>,
}

#[derive(Default)]
enum State {
    /// Not yet known which branch the answer takes.
    #[default]
    Undecided,
    /// In `{"response":"…`: the string's text so far.
    Response(JsonString),
    /// In `{"response":…` with a JSON value: how much of it was handed on.
    Json(usize),
    Calls,
    /// Not an envelope (never from the grammar): handed on as text.
    Plain,
}

const RESPONSE_OPENING: &str = r#"{"response":""#;
const JSON_OPENING: &str = r#"{"response":"#;
const CALLS_OPENING: &str = r#"{"tool_calls":"#;
/// How each call starts, its name first (the schema's order).
const CALL_OPENING: &str = r#"{"name":""#;
const ARGUMENTS_OPENING: &str = r#"","arguments":"#;

impl Reader {
    /// A reader of answers whose `response` is a JSON value following the request's
    /// `response_format` (`json`), or a string of text.
    pub fn new(json: bool) -> Self {
        Reader { json, ..Reader::default() }
    }

    /// Take the next piece of the answer; returns the text to hand on now.
    pub fn push(&mut self, piece: &str) -> String {
        let from = self.raw.len();
        self.raw.push_str(piece);
        let mut out = String::new();
        let opening = if self.json { JSON_OPENING } else { RESPONSE_OPENING };
        match &mut self.state {
            State::Undecided => {
                if self.raw.starts_with(opening) {
                    if self.json {
                        self.state = State::Json(opening.len());
                        return self.push("");
                    }
                    let mut string = JsonString::default();
                    string.feed(&self.raw[opening.len()..], &mut out);
                    self.state = State::Response(string);
                } else if self.raw.starts_with(CALLS_OPENING) {
                    self.state = State::Calls;
                } else if !opening.starts_with(self.raw.as_str())
                    && !CALLS_OPENING.starts_with(self.raw.as_str())
                {
                    out.push_str(&self.raw);
                    self.state = State::Plain;
                }
            }
            State::Response(string) => string.feed(&self.raw[from..], &mut out),
            State::Json(done) => {
                // Held back: what may be the envelope's closing brace (and spaces).
                let end = self.raw.trim_end_matches(|c: char| c == '}' || c.is_whitespace()).len();
                if end > *done {
                    out.push_str(&self.raw[*done..end]);
                    *done = end;
                }
            }
            State::Calls => {}
            State::Plain => out.push_str(piece),
        }
        out
    }

    /// What was held back, once the answer has ended: a JSON response's closing braces
    /// but the envelope's own (all of them, if the answer was cut short).
    pub fn finish(&mut self) -> String {
        let State::Json(done) = &mut self.state else { return String::new() };
        let rest = &self.raw[*done..];
        let whole = serde_json::from_str::<Value>(&self.raw).is_ok();
        let rest = match rest.trim_end().strip_suffix('}') {
            Some(inner) if whole => inner.trim_end(),
            _ => rest,
        };
        *done = self.raw.len();
        rest.to_string()
    }

    /// What the calls added since the last time: a call newly named, the arguments'
    /// text that came after what was handed on.
    pub fn call_deltas(&mut self) -> Vec<CallDelta> {
        if !matches!(self.state, State::Calls) {
            return Vec::new();
        }
        let mut deltas = Vec::new();
        for (index, (name, arguments)) in scan_calls(&self.raw).into_iter().enumerate() {
            let name = match self.sent.get(index) {
                Some(&sent) if sent == arguments.len() => continue,
                Some(_) => None,
                None => {
                    self.sent.push(0);
                    Some(name.to_string())
                }
            };
            let arguments = arguments[self.sent[index]..].to_string();
            self.sent[index] += arguments.len();
            deltas.push(CallDelta { index, name, arguments });
        }
        deltas
    }

    /// The calls, once the answer is whole (none if it answered in text), with their
    /// arguments' text as the model wrote it (what the deltas add up to). If it was cut
    /// short (max_tokens), the whole calls before the cut and the call cut off, with
    /// the text of its arguments so far (as OpenAI returns a call cut by the length
    /// limit), if its name was written.
    pub fn calls(&self) -> Vec<Call> {
        if !matches!(self.state, State::Calls) {
            return Vec::new();
        }
        scan_calls(&self.raw)
            .into_iter()
            .map(|(name, arguments)| Call {
                name: name.to_string(),
                arguments: arguments.to_string(),
            })
            .collect()
    }
}

/// The calls in an envelope's text so far (the grammar writes it compactly:
/// `{"tool_calls":[{"name":"N","arguments":{…}},…]}`): each one's name, once written
/// whole, and the text of its arguments so far.
fn scan_calls(raw: &str) -> Vec<(&str, &str)> {
    let mut calls = Vec::new();
    let Some(mut rest) = raw.strip_prefix(CALLS_OPENING).and_then(|r| r.strip_prefix('[')) else {
        return calls;
    };
    loop {
        let Some(named) = rest.strip_prefix(CALL_OPENING) else { return calls };
        // Names are [A-Za-z0-9_-]: no escapes, so the name ends at its quote.
        let Some(quote) = named.find('"') else { return calls };
        let name = &named[..quote];
        let Some(arguments) = named[quote..].strip_prefix(ARGUMENTS_OPENING) else {
            calls.push((name, ""));
            return calls;
        };
        match json_value_end(arguments) {
            Some(end) => {
                calls.push((name, &arguments[..end]));
                match arguments[end..].strip_prefix("},") {
                    Some(next) => rest = next,
                    None => return calls,
                }
            }
            None => {
                calls.push((name, arguments));
                return calls;
            }
        }
    }
}

/// Where the JSON object or array at the start of `text` ends, if it does.
fn json_value_end(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0u32, false, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '{' | '[' if !in_string => depth += 1,
            '}' | ']' if !in_string => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// A JSON string's contents decoded as they arrive, up to its closing quote; an escape
/// split across pieces waits for its end.
#[derive(Default)]
struct JsonString {
    escape: String,
    /// A high surrogate waiting for its low half.
    high: Option<u32>,
    closed: bool,
}

impl JsonString {
    fn feed(&mut self, text: &str, out: &mut String) {
        for c in text.chars() {
            if self.closed {
                return;
            }
            if self.escape.is_empty() {
                match c {
                    '\\' => self.escape.push(c),
                    '"' => self.closed = true,
                    c => out.push(c),
                }
                continue;
            }
            self.escape.push(c);
            let unit = match self.escape.as_str() {
                e if e.len() == 6 && e.starts_with("\\u") => match u32::from_str_radix(&e[2..], 16)
                {
                    Ok(unit) => unit,
                    Err(_) => 0xFFFD,
                },
                e if e.starts_with("\\u") && e.len() < 6 => continue,
                "\\n" => '\n' as u32,
                "\\t" => '\t' as u32,
                "\\r" => '\r' as u32,
                "\\b" => 8,
                "\\f" => 12,
                e => e[1..].chars().next().map_or(0xFFFD, u32::from),
            };
            self.escape.clear();
            match (self.high.take(), unit) {
                (None, 0xD800..=0xDBFF) => self.high = Some(unit),
                (Some(high), 0xDC00..=0xDFFF) => out.push(
                    char::from_u32(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00))
                        .unwrap_or('\u{FFFD}'),
                ),
                (high, unit) => {
                    if high.is_some() {
                        out.push('\u{FFFD}');
                    }
                    out.push(char::from_u32(unit).unwrap_or('\u{FFFD}'));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(json: &str) -> Result<Option<Tools>, ApiError> {
        Tools::read(&Object::parse(json.as_bytes()).unwrap())
    }

    const WEATHER: &str = r#"{"type":"function","function":{"name":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}"#;

    #[test]
    fn tools_and_tool_choice_are_checked() {
        assert!(tools("{}").unwrap().is_none());
        assert!(tools(&format!(r#"{{"tools":[{WEATHER}],"tool_choice":"none"}}"#))
            .unwrap()
            .is_none());
        assert!(tools(r#"{"tool_choice":"none"}"#).unwrap().is_none());
        let bad = [
            (r#"{"tool_choice":"auto"}"#.to_string(), "tool_choice"),
            (
                r#"{"tools":[{"type":"function","function":{"name":"a b"}}]}"#.to_string(),
                "tools[0]",
            ),
            (
                r#"{"tools":[{"type":"code_interpreter","function":{"name":"a"}}]}"#.to_string(),
                "tools[0]",
            ),
            (
                r#"{"tools":[{"type":"function","function":{"name":"a","parameters":[]}}]}"#
                    .to_string(),
                "tools[0]",
            ),
            (
                r#"{"tools":[{"type":"function","function":{"name":"a","nonsense":1}}]}"#
                    .to_string(),
                "tools",
            ),
            (format!(r#"{{"tools":[{WEATHER},{WEATHER}]}}"#), "tools[1]"),
            (format!(r#"{{"tools":[{WEATHER}],"tool_choice":"sometimes"}}"#), "tool_choice"),
            (
                format!(
                    r#"{{"tools":[{WEATHER}],"tool_choice":{{"type":"function","function":{{"name":"nope"}}}}}}"#
                ),
                "tool_choice",
            ),
            (
                format!(r#"{{"tools":[{WEATHER}],"parallel_tool_calls":"yes"}}"#),
                "parallel_tool_calls",
            ),
        ];
        for (json, param) in bad {
            let e = tools(&json).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{json}: {}", e.message);
        }
        let many = format!(
            r#"{{"tools":[{}]}}"#,
            (0..65)
                .map(|i| format!(r#"{{"type":"function","function":{{"name":"f{i}"}}}}"#))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(tools(&many).err().unwrap().param.as_deref(), Some("tools"));
    }

    #[test]
    fn the_schema_follows_tool_choice_and_parallel_calls() {
        let t = tools(&format!(
            r#"{{"tools":[{WEATHER}],"tool_choice":"required","parallel_tool_calls":false}}"#
        ))
        .unwrap()
        .unwrap();
        let s = t.schema(None);
        assert_eq!(s["properties"]["tool_calls"]["maxItems"], 1);
        assert_eq!(
            s["properties"]["tool_calls"]["items"]["properties"]["name"]["const"],
            "weather"
        );
        assert_eq!(
            s["properties"]["tool_calls"]["items"]["properties"]["arguments"]["required"][0],
            "city"
        );
        let auto = tools(&format!(
            r#"{{"tools":[{WEATHER},{{"type":"function","function":{{"name":"time"}}}}]}}"#
        ))
        .unwrap()
        .unwrap()
        .schema(None);
        assert_eq!(auto["anyOf"][1]["properties"]["response"]["type"], "string");
        assert_eq!(
            auto["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(auto["anyOf"][0]["properties"]["tool_calls"]["maxItems"], MAX_PARALLEL_CALLS);
        let named = r#"{"tools":[WEATHER,{"type":"function","function":{"name":"time"}}],"tool_choice":{"type":"function","function":{"name":"time"}}}"#;
        let named = tools(&named.replace("WEATHER", WEATHER)).unwrap().unwrap().schema(None);
        assert_eq!(
            named["properties"]["tool_calls"]["items"]["properties"]["name"]["const"],
            "time"
        );
        assert_eq!(
            named["properties"]["tool_calls"]["items"]["properties"]["arguments"],
            json!({"type": "object"})
        );
        // Written in the order the model should say it: the name before the arguments.
        let text = named.to_string();
        assert!(text.find(r#""name""#) < text.find(r#""arguments""#), "{text}");
    }

    #[test]
    fn the_reader_streams_a_response_and_reads_calls_whole() {
        let answer = r#"{"response":"Hi \"you\"\n\u00e9\ud83e\udd99 \\o/"}"#;
        // Fed a character at a time, escapes and surrogate pairs split everywhere.
        let mut r = Reader::default();
        let text: String = answer.chars().map(|c| r.push(&c.to_string())).collect();
        assert_eq!(text, "Hi \"you\"\né🦙 \\o/");
        assert!(r.calls().is_empty());
        let mut r = Reader::default();
        assert_eq!(r.push(r#"{"tool_"#), "");
        assert_eq!(r.push(r#"calls":[{"name":"weather","arguments":{"city":"Lima"}},"#), "");
        assert_eq!(r.push(r#"{"name":"time","arguments":{}}]}"#), "");
        let calls = r.calls();
        assert_eq!(
            calls,
            [
                Call { name: "weather".into(), arguments: r#"{"city":"Lima"}"#.into() },
                Call { name: "time".into(), arguments: "{}".into() }
            ]
        );
        // Cut short by max_tokens: the whole calls before the cut, and the one cut off
        // with its arguments' text so far, once its name is written.
        let mut r = Reader::default();
        r.push(r#"{"tool_calls":[{"name":"wea"#);
        assert!(r.calls().is_empty());
        r.push(r#"ther","argu"#);
        assert_eq!(r.calls(), [Call { name: "weather".into(), arguments: String::new() }]);
        r.push(r#"ments":{"city":"Lima"}},{"name":"time","arguments":{"city":"Li"#);
        assert_eq!(
            r.calls(),
            [
                Call { name: "weather".into(), arguments: r#"{"city":"Lima"}"#.into() },
                Call { name: "time".into(), arguments: r#"{"city":"Li"#.into() }
            ]
        );
        let mut r = Reader::default();
        r.push(r#"{"tool_calls":[{"name":"weather","arguments":{"city":"Li"#);
        assert_eq!(
            r.calls(),
            [Call { name: "weather".into(), arguments: r#"{"city":"Li"#.into() }]
        );
        let mut r = Reader::default();
        r.push(r#"{"tool_calls""#);
        assert!(r.calls().is_empty(), "nothing named yet");

        // Calls are handed on as they are decoded: each one's name once it is written
        // whole, then its arguments' text piece by piece (strings holding braces and
        // escaped quotes included), adding up to the calls read at the end.
        let answer = r#"{"tool_calls":[{"name":"note","arguments":{"text":"a } \"b\" {","n":[1,{"m":2}]}},{"name":"time","arguments":{}}]}"#;
        let mut r = Reader::default();
        let mut deltas = Vec::new();
        for c in answer.chars() {
            assert_eq!(r.push(&c.to_string()), "");
            deltas.extend(r.call_deltas());
        }
        let named: Vec<(usize, String)> =
            deltas.iter().filter_map(|d| Some((d.index, d.name.clone()?))).collect();
        assert_eq!(named, [(0, "note".to_string()), (1, "time".to_string())]);
        let calls = r.calls();
        for (i, call) in calls.iter().enumerate() {
            let streamed: String =
                deltas.iter().filter(|d| d.index == i).map(|d| d.arguments.as_str()).collect();
            assert_eq!(streamed, call.arguments);
        }
        assert_eq!(calls[0].arguments, r#"{"text":"a } \"b\" {","n":[1,{"m":2}]}"#);
        assert!(deltas.iter().filter(|d| d.index == 0).count() > 10, "piece by piece");
        assert!(r.call_deltas().is_empty(), "nothing new");
        // A response is no call.
        let mut r = Reader::default();
        r.push(r#"{"response":"hi"}"#);
        assert!(r.call_deltas().is_empty());
        // Not an envelope at all: handed on as it is.
        let mut r = Reader::default();
        assert_eq!(r.push("{\"x"), "{\"x");
        assert_eq!(r.push("y"), "y");
    }

    /// Every `$ref` in `schema`, and whether it resolves within it.
    fn refs(schema: &Value) -> Vec<(String, bool)> {
        let mut all = Vec::new();
        visit_refs(schema, &mut |r| all.push(r.to_string()));
        all.into_iter()
            .map(|r| {
                let ok = schema.pointer(&r[1..]).is_some();
                (r, ok)
            })
            .collect()
    }

    #[test]
    fn nested_models_references_resolve_in_the_envelope() {
        // What Pydantic writes for a model with a nested one, and a recursive one.
        let order = r##"{"type":"function","function":{"name":"order","parameters":{"type":"object","properties":{"owner":{"$ref":"#/$defs/Person"},"items":{"type":"array","items":{"$ref":"#/$defs/Item"}}},"required":["owner"],"$defs":{"Person":{"type":"object","properties":{"name":{"type":"string"}}},"Item":{"type":"object","properties":{"sku":{"type":"string"},"parts":{"type":"array","items":{"$ref":"#/$defs/Item"}}}}}}}}"##;
        let tree = r##"{"type":"function","function":{"name":"tree","parameters":{"type":"object","properties":{"child":{"$ref":"#"}}}}}"##;
        for choice in
            ["\"auto\"", "\"required\"", r#"{"type":"function","function":{"name":"order"}}"#]
        {
            let t =
                tools(&format!(r#"{{"tools":[{WEATHER},{order},{tree}],"tool_choice":{choice}}}"#))
                    .unwrap()
                    .unwrap();
            let schema = t.schema(Some(
                &json!({"$ref": "#/$defs/Answer", "$defs": {"Answer": {"type": "integer"}}}),
            ));
            let refs = refs(&schema);
            assert!(!refs.is_empty() && refs.iter().all(|(_, ok)| *ok), "{choice}: {refs:?}");
            assert!(refs.iter().any(|(r, _)| r == "#/$defs/f1/$defs/Person"), "{refs:?}");
        }
        let t = tools(&format!(r#"{{"tools":[{WEATHER},{order},{tree}]}}"#)).unwrap().unwrap();
        let schema = t.schema(None);
        assert_eq!(schema["$defs"]["f2"]["properties"]["child"]["$ref"], "#/$defs/f2", "recursion");
        assert!(schema["$defs"].get("f0").is_none(), "parameters without references stay in place");
        // The tools as listed for the prompt keep their own references.
        assert_eq!(
            t.listed()[1]["function"]["parameters"]["properties"]["owner"]["$ref"],
            "#/$defs/Person"
        );
        // References out of the function's parameters cannot resolve: refused by path.
        for bad in [r##""https://example.com/s.json""##, r##""#Person""##, r##""other.json#/a""##] {
            let json = format!(
                r#"{{"tools":[{WEATHER},{{"type":"function","function":{{"name":"x","parameters":{{"type":"object","properties":{{"a":{{"$ref":{bad}}}}}}}}}}}]}}"#
            );
            let e = tools(&json).err().unwrap_or_else(|| panic!("{bad} was accepted"));
            assert_eq!(e.param.as_deref(), Some("tools[1].function.parameters"), "{}", e.message);
        }
    }

    #[test]
    fn objects_that_do_not_say_are_closed() {
        let f = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"object","properties":{"b":{"type":"integer"}}},"open":{"type":"object","properties":{},"additionalProperties":true},"any":{"type":"object"},"both":{"allOf":[{"properties":{"x":{"type":"integer"}}},{"properties":{"y":{"type":"integer"}}}]},"e":{"enum":[{"properties":{}}]}}}}}"#;
        let s = tools(&format!(r#"{{"tools":[{f}],"tool_choice":"required"}}"#))
            .unwrap()
            .unwrap()
            .schema(None);
        let args = &s["properties"]["tool_calls"]["items"]["properties"]["arguments"];
        assert_eq!(args["additionalProperties"], false);
        assert_eq!(args["properties"]["a"]["additionalProperties"], false, "nested objects too");
        assert_eq!(
            args["properties"]["open"]["additionalProperties"], true,
            "what a schema says stays"
        );
        assert!(
            args["properties"]["any"].get("additionalProperties").is_none(),
            "no properties: any object"
        );
        assert!(
            args["properties"]["both"]["allOf"][0].get("additionalProperties").is_none(),
            "allOf branches add up"
        );
        assert_eq!(
            args["properties"]["e"]["enum"][0],
            json!({"properties": {}}),
            "data is not a schema"
        );
    }

    #[test]
    fn a_named_or_required_choice_can_only_call() {
        let two = format!(r#"{WEATHER},{{"type":"function","function":{{"name":"time"}}}}"#);
        let format = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
        for (choice, names) in [
            (r#"{"type":"function","function":{"name":"time"}}"#, vec!["time"]),
            (r#""required""#, vec!["weather", "time"]),
        ] {
            let t =
                tools(&format!(r#"{{"tools":[{two}],"tool_choice":{choice}}}"#)).unwrap().unwrap();
            assert!(t.forced());
            // Even with a response_format: no branch but the calls.
            let s = t.schema(Some(&format));
            assert_eq!(s["required"], json!(["tool_calls"]), "{choice}");
            assert!(s.get("anyOf").is_none(), "{choice}");
            let items = &s["properties"]["tool_calls"]["items"];
            let consts: Vec<&str> = match items.get("anyOf") {
                Some(any) => any
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i["properties"]["name"]["const"].as_str().unwrap())
                    .collect(),
                None => vec![items["properties"]["name"]["const"].as_str().unwrap()],
            };
            assert_eq!(consts, names, "{choice}");
        }
        assert!(!tools(&format!(r#"{{"tools":[{two}]}}"#)).unwrap().unwrap().forced());
    }

    #[test]
    fn with_a_response_format_a_direct_answer_is_json_following_it() {
        let mut t = tools(&format!(r#"{{"tools":[{WEATHER}]}}"#)).unwrap().unwrap();
        let format =
            json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let s = t.schema(Some(&format));
        assert_eq!(s["anyOf"][1]["properties"]["response"], format);
        assert_eq!(s["anyOf"][0]["required"], json!(["tool_calls"]));
        t.answer_in_json();
        assert!(t.instruction().contains("as JSON"), "{}", t.instruction());
        // The JSON's own text is handed on as it comes, but for the envelope's brace.
        for answer in
            [r#"{"response":{"n":{"m":[1,2]}}}"#, r#"{"response":"a } b"}"#, r#"{"response":12}"#]
        {
            let mut r = Reader::new(true);
            let mut text: String = answer.chars().map(|c| r.push(&c.to_string())).collect();
            text.push_str(&r.finish());
            assert_eq!(text, answer[r#"{"response":"#.len()..answer.len() - 1], "{answer}");
            assert!(r.calls().is_empty());
        }
        // Cut short: all of it, the JSON being unfinished anyway.
        let mut r = Reader::new(true);
        let text = r.push(r#"{"response":{"n":{"#) + &r.push("}") + &r.finish();
        assert_eq!(text, r#"{"n":{}"#);
        let mut r = Reader::new(true);
        assert_eq!(r.push(r#"{"tool_calls":[{"name":"weather","arguments":{}}]}"#), "");
        assert_eq!(r.calls().len(), 1);
    }
}
