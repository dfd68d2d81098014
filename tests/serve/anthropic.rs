//! Anthropic's Messages API (`/v1/messages`): the official `anthropic` SDK and Claude
//! Code (a hang-up on it is one of tests/serve.rs's per-API ones). Each test starts its
//! own server on loopback and kills it when it ends; the clients run bounded in time,
//! in process groups of their own that are killed with them.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{self, serve::*};

/// Claude Code, as npm serves it; its native binary comes in the platform's package.
const CLAUDE_CODE: (&str, &str) = ("@anthropic-ai/claude-code", "2.1.332");

/// The `anthropic` SDK's checks (tests/serve/messages_client.py): create and stream,
/// a stop sequence, `count_tokens` against the usage of an answer, a forced `tool_use`
/// → `tool_result` round trip (streamed too), an image block on a model with a
/// projector, and errors in Anthropic's shape.
#[test]
fn the_anthropic_sdk_creates_streams_calls_tools_counts_tokens_and_sees_images() {
    let projector = format!("eyes={}", common::tiny_vision().display());
    let server = Server::start(
        &[("smollm2", common::real_model()), ("tiny", common::tiny_model())],
        &["--threads", "2", "--projector", &projector, "--plugin-env", "LLAMABOX_VISION=tiny=eyes"],
    );
    let pip = common::pip_tool;
    let path = format!("{}:{}", pip("anthropic", "2.16.0"), pip("jsonschema", "4.23.0"));
    let image = super::gradient_png_base64(8);
    let out = Command::new("python3")
        .arg(common::repo_root().join("tests/serve/messages_client.py"))
        .args([&server.url(""), "smollm2", "tiny", &image])
        .env("PYTHONPATH", path)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "messages_client.py's checks failed:\n{report}");
    assert_eq!(report.lines().filter(|l| l.starts_with("ok: ")).count(), 7, "{report}");
}

/// Claude Code from npm, pointed at the server (`ANTHROPIC_BASE_URL`), run
/// non-interactively (`-p`): it prints an answer, and with `--json-schema` it calls its
/// structured-output tool through the server's tool-call path (a forced call under the
/// envelope grammar), whose input follows the schema. Its own long system prompt and
/// tools do not fit the small model's context, so the test gives it a short one and
/// no built-in tools. The model is tiny: this judges the protocol, not the answers, and
/// a recording proxy (tests/serve/codex.rs's) makes its turns deterministic.
#[test]
fn claude_code_answers_and_calls_its_structured_output_tool() {
    let server = Server::start(&[("smollm2", common::real_model())], &["--threads", "2"]);
    // Claude Code sends no temperature, so whether the tiny model calls the tool or
    // answers in text is chance: a recording proxy makes it greedy and, on the first
    // turn of a conversation, forces the structured-output tool when one is offered.
    let (base_url, log) = crate::codex::start_proxy(server.addr, |_, fields| {
        fields.insert("temperature".into(), json!(0));
        let tools = fields.get("tools").and_then(Value::as_array);
        let offered = tools.is_some_and(|t| t.iter().any(|t| t["name"] == "StructuredOutput"));
        let turns = fields.get("messages").and_then(Value::as_array).map_or(0, Vec::len);
        if offered && turns == 1 {
            let choice = json!({"type": "tool", "name": "StructuredOutput"});
            fields.insert("tool_choice".into(), choice);
        }
    });
    let tool = npm_tool(CLAUDE_CODE.0, CLAUDE_CODE.1);
    let claude = tool.join("node_modules/@anthropic-ai/claude-code-linux-x64/claude");
    // A fresh home: no settings, credentials or history of this machine's user.
    let home = std::env::temp_dir().join(format!("llamabox-claude-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let run = |extra: &[&str]| {
        let mut command = Command::new(&claude);
        command
            .current_dir(&home)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", &home)
            .env("ANTHROPIC_BASE_URL", &base_url)
            .env("ANTHROPIC_API_KEY", "unused-by-an-open-server")
            .env("DISABLE_TELEMETRY", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .args(["--bare", "--model", "smollm2", "--tools", ""])
            .args(["--system-prompt", "You are a helpful assistant. Answer briefly."])
            .args(extra);
        let ran = run_bounded(&mut command, Duration::from_secs(180));
        println!("claude {extra:?}:\n{}{}", ran.stdout, ran.stderr);
        assert!(ran.status.is_some(), "Claude Code ran past 180 s:\n{}", ran.stderr);
        assert!(ran.status.unwrap().success(), "Claude Code failed:\n{}{}", ran.stdout, ran.stderr);
        ran.stdout
    };

    let answer = run(&["-p", "Say hello."]);
    assert!(!answer.trim().is_empty(), "no answer");
    assert!(!answer.contains("API Error"), "{answer}");

    let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                        "required": ["city"]});
    let out = run(&[
        "-p",
        "What is the capital of France?",
        "--output-format",
        "json",
        "--json-schema",
        &schema.to_string(),
    ]);
    let result: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(result["is_error"], false, "{result}");
    assert_eq!(result["stop_reason"], "tool_use", "the answer is a call: {result}");
    assert!(result["structured_output"]["city"].is_string(), "{result}");

    let _ = std::fs::remove_dir_all(&home);
    let requests = server.metric("llamabox_requests_total{plugin=\"openai\",status=\"200\"}");
    assert!(requests >= 2.0, "{requests} requests answered");
    // The structured-output call came from the server's forced-call path, streamed.
    let exchanges = log.lock().unwrap();
    let forced = exchanges.iter().find(|e| e.forwarded["tool_choice"]["type"] == "tool");
    let forced = forced.expect("a request offered the structured-output tool");
    assert!(forced.response.contains("\"type\":\"tool_use\""), "{}", forced.response);
    assert!(forced.response.contains("input_json_delta"), "{}", forced.response);
    assert_eq!(server.metric("llamabox_requests_total{plugin=\"openai\",status=\"400\"}"), 0.0);
}
