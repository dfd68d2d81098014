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
        Ok(Some(Tools { functions, choice, parallel, listed }))
    }

    /// The request's `tools`, for the prompt.
    pub fn listed(&self) -> &Value {
        &self.listed
    }

    /// The JSON Schema the answer must follow.
    pub fn schema(&self) -> Value {
        let call = |f: &Function| {
            let arguments = f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let (items, max) = match &self.choice {
            Choice::Named(name) => {
                (call(self.functions.iter().find(|f| &f.name == name).expect("checked in read")), 1)
            }
            _ if self.functions.len() == 1 => (call(&self.functions[0]), self.max_calls()),
            _ => (
                json!({"anyOf": self.functions.iter().map(call).collect::<Vec<_>>()}),
                self.max_calls(),
            ),
        };
        let calls = json!({
            "type": "object",
            "properties": {"tool_calls": {"type": "array", "items": items, "minItems": 1, "maxItems": max}},
            "required": ["tool_calls"],
            "additionalProperties": false,
        });
        match self.choice {
            Choice::Auto => json!({"anyOf": [calls, {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": false,
            }]}),
            _ => calls,
        }
    }

    fn max_calls(&self) -> u32 {
        if self.parallel {
            MAX_PARALLEL_CALLS
        } else {
            1
        }
    }

    /// How to answer, for the system turn: the envelope in words.
    pub fn instruction(&self) -> String {
        let call =
            r#"{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}"#;
        match &self.choice {
            Choice::Auto => format!("Answer with a JSON object: {call} to call tools, or {{\"response\": \"<your answer>\"}} to answer directly."),
            Choice::Required => format!("Answer by calling tools, with a JSON object: {call}"),
            Choice::Named(name) => format!("Answer by calling the function {name}, with a JSON object: {call}"),
        }
    }
}

/// A call the model made, as OpenAI returns it: `arguments` is JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// Reads one answer's envelope as its text arrives: the `response` text is handed on
/// as it is decoded; calls are read once the answer is whole.
#[derive(Default)]
pub struct Reader {
    raw: String,
    state: State,
}

#[derive(Default)]
enum State {
    /// Not yet known which branch the answer takes.
    #[default]
    Undecided,
    /// In `{"response":"…`: the string's text so far.
    Response(JsonString),
    Calls,
    /// Not an envelope (never from the grammar): handed on as text.
    Plain,
}

const RESPONSE_OPENING: &str = r#"{"response":""#;
const CALLS_OPENING: &str = r#"{"tool_calls":"#;
/// Between two calls of the envelope.
const CALL_SEPARATOR: &str = r#"},{"name":"#;

impl Reader {
    /// Take the next piece of the answer; returns the text to hand on now.
    pub fn push(&mut self, piece: &str) -> String {
        let from = self.raw.len();
        self.raw.push_str(piece);
        let mut out = String::new();
        match &mut self.state {
            State::Undecided => {
                if self.raw.starts_with(RESPONSE_OPENING) {
                    let mut string = JsonString::default();
                    string.feed(&self.raw[RESPONSE_OPENING.len()..], &mut out);
                    self.state = State::Response(string);
                } else if self.raw.starts_with(CALLS_OPENING) {
                    self.state = State::Calls;
                } else if !RESPONSE_OPENING.starts_with(self.raw.as_str())
                    && !CALLS_OPENING.starts_with(self.raw.as_str())
                {
                    out.push_str(&self.raw);
                    self.state = State::Plain;
                }
            }
            State::Response(string) => string.feed(&self.raw[from..], &mut out),
            State::Calls => {}
            State::Plain => out.push_str(piece),
        }
        out
    }

    /// The calls, once the answer is whole (none if it answered in text; if it was cut
    /// short, the calls before the one cut off).
    pub fn calls(&self) -> Vec<Call> {
        if !matches!(self.state, State::Calls) {
            return Vec::new();
        }
        // Whole, or cut short (max_tokens): then the calls before the one cut off, closed
        // after the last whole one (the grammar writes them compactly, one after another).
        let whole = serde_json::from_str::<Value>(&self.raw).ok().or_else(|| {
            self.raw
                .rmatch_indices(CALL_SEPARATOR)
                .find_map(|(at, _)| serde_json::from_str(&format!("{}}}]}}", &self.raw[..at])).ok())
        });
        let calls = whole
            .as_ref()
            .and_then(|e| e.get("tool_calls"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        calls
            .into_iter()
            .filter_map(|c| {
                Some(Call {
                    name: c.get("name")?.as_str()?.to_string(),
                    arguments: c.get("arguments")?.to_string(),
                })
            })
            .collect()
    }
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
        let s = t.schema();
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
        .schema();
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
        let named = tools(&named.replace("WEATHER", WEATHER)).unwrap().unwrap().schema();
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
        // Cut short by max_tokens: no half calls, the whole ones before it.
        let mut r = Reader::default();
        r.push(r#"{"tool_calls":[{"name":"weather","argu"#);
        assert!(r.calls().is_empty());
        r.push(r#"ments":{"city":"Lima"}},{"name":"time","arguments":{"city":"Li"#);
        assert_eq!(
            r.calls(),
            [Call { name: "weather".into(), arguments: r#"{"city":"Lima"}"#.into() }]
        );
        // Not an envelope at all: handed on as it is.
        let mut r = Reader::default();
        assert_eq!(r.push("{\"x"), "{\"x");
        assert_eq!(r.push("y"), "y");
    }
}
