//! `llamabox serve` from the outside, with real clients: the official `openai` Python
//! client, curl, wrk, and raw sockets that hang up. Every server is started here, on
//! loopback, with a port the OS picks, and killed when its test ends.
//!
//! Hang-ups are made deterministic by the protocol, not by timing: the client waits
//! for the first event of a streamed answer (the plugin sends it before it starts the
//! prefill) and only then closes its socket, with thousands of prompt tokens still to
//! compute; the run's own report (`decoded=`) then proves where native work stopped.
//!
//! Its modules: the Anthropic and Codex clients, reloads, tenants, and attacks from
//! clients (`attacks`, issue 23).

#[path = "serve/anthropic.rs"]
mod anthropic;
#[path = "serve/attacks.rs"]
mod attacks;
#[path = "serve/codex.rs"]
mod codex;
mod common;
#[path = "serve/reload.rs"]
mod reload;
#[path = "serve/tenants.rs"]
mod tenants;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::serve::*;
use serde_json::{json, Value};

/// The `openai` Python package and `jsonschema` (which checks structured output),
/// installed once outside the clone: a PYTHONPATH.
fn openai_python_path() -> String {
    let pip = common::pip_tool;
    format!("{}:{}", pip("openai", "3.51.0"), pip("jsonschema", "4.23.0"))
}

/// Run tests/serve/SCRIPT (an official-SDK client's checks) against `server`: it must
/// exit 0 and print at least `at_least` `ok: ` lines.
fn python_checks(server: &Server, script: &str, at_least: usize) {
    let out = Command::new("python3")
        .arg(common::repo_root().join("tests/serve").join(script))
        .args([&server.url("/v1"), "smollm2"])
        .env("PYTHONPATH", openai_python_path())
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script}'s checks failed:\n{report}");
    assert!(report.lines().filter(|l| l.starts_with("ok: ")).count() >= at_least, "{report}");
}

#[test]
fn the_openai_client_and_curl_chat_stream_and_embed() {
    let server = Server::start(&[("smollm2", common::real_model())], &["--threads", "2"]);
    python_checks(&server, "openai_client.py", 22);
    // The Responses API (`client.responses.create`), streamed and not, with
    // instructions, a JSON answer and a function tool's round trip.
    python_checks(&server, "responses_client.py", 6);

    // curl: the streamed text is the whole text, and ends the stream properly. The
    // whole one runs twice first, so that the streamed one is computed as the second
    // was: on the context it left, reusing all of the prompt but its last token (see
    // openai_client.py).
    let question = "What is a llama? Answer in two sentences.";
    post_chat(&server, &chat(question, 32, false), &[]);
    let whole = post_chat(&server, &chat(question, 32, false), &[]);
    let streamed = post_chat(&server, &chat(question, 32, true), &["-N"]);
    assert_eq!(chat_text(&streamed, true), chat_text(&whole, false));

    // Bad input gets OpenAI-shaped errors from the plugin, unknown paths from the server.
    let (status, body) = post(&server, "/v1/chat/completions", &json!({"model": "smollm2"}), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].is_string());
    let (status, _) = curl(&["-X", "POST", "-d", "{not json", &server.url("/v1/chat/completions")]);
    assert_eq!(status, 400);
    // The plugin's reason for a 400 (the field's path and why) is in the server's log,
    // in the request's span, and not in what the client gets.
    let no_messages = r#"{"model":"smollm2"}"#;
    let (status, answer) = curl(&[
        "-i",
        "-H",
        "x-request-id: no-messages",
        "-d",
        no_messages,
        &server.url("/v1/chat/completions"),
    ]);
    assert_eq!(status, 400);
    assert!(!answer.to_ascii_lowercase().contains("llamabox-reason"), "{answer}");
    let logged = (0..250)
        .find_map(|_| {
            let log = server.stderr();
            let line = log.lines().find(|l| l.contains("id=no-messages") && l.contains("refused"));
            let line = line.map(String::from);
            if line.is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            line
        })
        .unwrap_or_else(|| panic!("no reason logged:\n{}", server.stderr()));
    assert!(logged.contains("messages: Missing required parameter"), "{logged}");
    assert_eq!(curl(&[&server.url("/healthz")]).0, 200);
    assert_eq!(curl(&[&server.url("/readyz")]).0, 200);
    assert!(server.metric("llamabox_requests_total{plugin=\"openai\",status=\"200\"}") >= 7.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}

/// The plugin's chat page in a real browser (Debian's headless Chromium, driven over
/// the DevTools protocol by tests/serve/chat_page.py): an answer streams, Stop closes
/// the stream once 8 tokens are shown, and the page reports the server's own figures:
/// the server computed only the few tokens in flight at the hang-up. Then a message
/// over the context fails visibly, and the next one is answered. The page asks for no
/// max_tokens, so the plugin's contexts are capped at 1024 here: an answer of the
/// default 4096 tokens at temperature 1 outlasts the server's 120 s deadline on 2
/// cores, and one did ("network error").
#[test]
fn the_chat_page_streams_and_its_stop_button_stops_the_native_work() {
    let flags = ["--threads", "2", "--plugin-env", "LLAMABOX_N_CTX=1024"];
    let server = Server::start(&[("smollm2", common::real_model())], &flags);
    let (status, page) = curl(&[&server.url("/")]);
    assert_eq!(status, 200);
    assert!(
        page.contains("<title>llamabox chat</title>") && !page.contains("src=\"http"),
        "the page loads nothing from elsewhere"
    );
    let websocket = common::pip_tool("websocket-client", "1.9.2");
    let shot = common::repo_root().join("target/chat-page.png");
    let out = Command::new("python3")
        .arg(common::repo_root().join("tests/serve/chat_page.py"))
        .args([server.url("/"), shot.display().to_string()])
        .env("PYTHONPATH", websocket)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the browser's checks failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    println!("{report:#}");
    let figure = |name: &str| {
        report[name]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in {report}"))
    };
    let (generated, shown, after_stop) =
        (figure("generated"), figure("shown"), figure("afterStop"));
    assert!(shown >= 8.0 && generated >= shown, "{report}");
    assert!(after_stop <= 8.0, "the server went on for {after_stop} tokens after Stop: {report}");
    assert!(figure("stopMs") > 0.0, "{report}");
    assert!(report["text"].as_str().unwrap().starts_with("Stopped."), "{report}");
    assert_eq!(server.metric("llamabox_cancels_total{cause=\"disconnect\"}"), 1.0);
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000, "no screenshot");
    // Then, in the same page: a message over the context fails with the server's error,
    // shown in the conversation, and the next message, sent with Enter, is answered
    // without the failed one; the input is cleared and the conversation scrolled to its end.
    let recovery = &report["recovery"];
    assert!(recovery["error"].as_str().unwrap().contains("maximum context length"), "{recovery}");
    assert_eq!(recovery["resentFailed"], false, "{recovery}");
    assert!(recovery["status"].as_str().unwrap().starts_with("done:"), "{recovery}");
    assert!(!recovery["answer"].as_str().unwrap_or("").trim().is_empty(), "{recovery}");
    assert_eq!((&recovery["input"], &recovery["atEnd"]), (&json!(""), &json!(true)), "{recovery}");
    assert_eq!(recovery["recovered"], true, "{recovery}");
}

/// llama-server's `/tokenize`, `/detokenize` and `/apply-template` on the real model:
/// text round-trips through token ids (and pieces), and the template's prompt is the
/// chat endpoint's, token for token.
#[test]
fn tokenize_detokenize_and_apply_template_agree_with_the_chat_endpoint() {
    let server = Server::start(&[("smollm2", common::real_model())], &["--threads", "2"]);
    let ask = |path: &str, body: Value| {
        let (status, answer) = post(&server, path, &body, &[]);
        (status, serde_json::from_str::<Value>(&answer).unwrap_or_else(|e| panic!("{e}: {answer}")))
    };
    let text = "Llamas 🦙 live in the Andes, at 4000 m — café au lait.";
    let (status, tokenized) = ask("/tokenize", json!({"content": text}));
    assert_eq!(status, 200, "{tokenized}");
    let ids = tokenized["tokens"].clone();
    assert!(ids.as_array().unwrap().len() > 10, "{tokenized}");
    let (status, detokenized) = ask("/detokenize", json!({"tokens": ids}));
    assert_eq!((status, detokenized["content"].as_str()), (200, Some(text)), "{detokenized}");
    // Pieces: text, or the bytes of a character split across tokens (the emoji).
    let (status, pieces) =
        ask("/tokenize", json!({"model": "smollm2", "content": text, "with_pieces": true}));
    assert_eq!(status, 200, "{pieces}");
    let pieces = pieces["tokens"].as_array().unwrap().clone();
    assert_eq!(
        pieces.iter().map(|p| p["id"].clone()).collect::<Vec<_>>(),
        *ids.as_array().unwrap()
    );
    let bytes: Vec<u8> = pieces
        .iter()
        .flat_map(|p| match &p["piece"] {
            Value::String(s) => s.as_bytes().to_vec(),
            bytes => bytes.as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect(),
        })
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    assert!(pieces.iter().any(|p| p["piece"].is_array()), "no piece split a character: {pieces:?}");

    // The template's prompt is what a chat completion of the same body computes.
    let chat = json!({"model": "smollm2", "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a llama?"}]});
    let (status, templated) = ask("/apply-template", chat.clone());
    assert_eq!(status, 200, "{templated}");
    let prompt = templated["prompt"].as_str().unwrap();
    // The GGUF's own Jinja template, rendered by minijinja in the plugin, writes what
    // llama.cpp's built-in ChatML writes.
    let chatml = "<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(prompt, chatml);
    let (status, completion) = ask("/v1/chat/completions", chat);
    assert_eq!(status, 200, "{completion}");
    let (status, prompt_tokens) = ask("/tokenize", json!({"content": prompt, "add_special": true}));
    assert_eq!(status, 200, "{prompt_tokens}");
    assert_eq!(
        prompt_tokens["tokens"].as_array().unwrap().len() as u64,
        completion["usage"]["prompt_tokens"].as_u64().unwrap()
    );

    // Refusals name their field; a text over the host's cap is the request's fault.
    for (path, body, param, code) in [
        (
            "/tokenize",
            json!({"content": "a", "n_probs": 3}),
            "n_probs",
            Some("unsupported_parameter"),
        ),
        ("/tokenize", json!({"content": ["a"]}), "content", None),
        ("/tokenize", json!({"content": "a".repeat(20_000)}), "content", None),
        ("/detokenize", json!({"tokens": [1, 1_000_000]}), "tokens", None),
        ("/detokenize", json!({"tokens": [-1]}), "tokens", None),
        (
            "/apply-template",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
            "tools",
            None,
        ),
        (
            "/apply-template",
            json!({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}),
            "audio",
            Some("unsupported_parameter"),
        ),
        (
            "/apply-template",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}),
            "tools",
            None,
        ),
    ] {
        let (status, error) = ask(path, body);
        assert_eq!(
            (status, error["error"]["param"].as_str(), error["error"]["code"].as_str()),
            (400, Some(param), code),
            "{path}: {error}"
        );
    }
    // Tools reach the prompt: SmolLM2's template shows none, so they join the system turn
    // with how to answer.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let (status, templated) = ask(
        "/apply-template",
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
    );
    let prompt = templated["prompt"].as_str().unwrap_or_default();
    assert!(
        status == 200
            && prompt.starts_with("<|im_start|>system\nYou can call these tools")
            && prompt.contains("get_weather"),
        "{templated}"
    );
    assert_eq!(ask("/tokenize", json!({"model": "gpt-4", "content": "a"})).0, 404);
    assert_eq!(curl(&[&server.url("/tokenize")]).0, 405);
}

/// The text of a non-streamed chat completion, and its usage.
fn answer(response: &str) -> (String, u64, u64) {
    let v: Value = serde_json::from_str(response).unwrap_or_else(|e| panic!("{e}: {response}"));
    let usage = &v["usage"];
    (
        chat_text(response, false),
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    )
}

/// Idle contexts (on by default, `--threads` of them per model): a request after
/// another of its group with the same system message and context size reuses the
/// prompt start they share instead of computing it again, and says so in its run's
/// report, its usage (`cached_tokens`) and /metrics. A repeated request reuses all of its prompt but the last
/// token; twice repeated, it is computed alike and answers alike.
#[test]
fn a_later_request_reuses_the_prompt_start_it_shares_with_the_last() {
    later_requests_reuse_prompt_starts(false);
}

#[test]
fn a_later_request_reuses_the_prompt_start_it_shares_with_the_last_in_a_batch_too() {
    later_requests_reuse_prompt_starts(true);
}

/// Unbatched, a request's context is kept idle for the next one; batched, its seat's
/// sequence keeps what it held for the next request of the group bound to it.
fn later_requests_reuse_prompt_starts(batch: bool) {
    let system = "You are a helpful assistant. You answer every question in one short sentence.";
    let ask = |question: &str| {
        json!({"model": "smollm2", "max_tokens": 24, "temperature": 0,
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    };
    let server = Server::start(
        &[("smollm2", common::real_model())],
        &["--threads", "2", "--batch", &batch.to_string()],
    );
    let send = |question: &str, id: &str| {
        let body = post_chat(&server, &ask(question), &["-H", &format!("x-request-id: {id}")]);
        let (text, prompt_tokens, completion_tokens) = answer(&body);
        let report = server.run_report(id);
        println!("{report}");
        let reused: u64 = log_field(&report, "reused").parse().unwrap();
        let decoded: u64 = log_field(&report, "decoded").parse().unwrap();
        assert_eq!(decoded, prompt_tokens - reused + completion_tokens, "{report}");
        // The client is told too: OpenAI's usage.prompt_tokens_details.cached_tokens.
        let usage: Value = serde_json::from_str::<Value>(&body).unwrap()["usage"].clone();
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(reused),
            "{body}"
        );
        if !batch {
            // Kept once the plugin dropped it, after the response's end.
            server.wait_metric("llamabox_idle_contexts", 1.0);
        }
        (text, prompt_tokens, reused)
    };
    let (_, _, reused) = send("What do llamas eat?", "first");
    assert_eq!(reused, 0, "nothing to reuse yet");
    let (_, prompt_tokens, reused) = send("Where do alpacas live?", "second");
    assert!(
        reused > 20 && reused < prompt_tokens,
        "the system part is reused, the question computed: {reused} of {prompt_tokens}"
    );
    let (again, _, reused_again) = send("Where do alpacas live?", "third");
    assert_eq!(
        reused_again,
        prompt_tokens - 1,
        "a repeated prompt is computed for its last token only"
    );
    let (once_more, _, _) = send("Where do alpacas live?", "fourth");
    assert_eq!(once_more, again, "computed alike, answered alike");
    assert_eq!(server.metric("llamabox_tokens_reused_total"), (reused + 2 * reused_again) as f64);
    assert_eq!(
        server.metric("llamabox_live_workers"),
        0.0,
        "idle contexts and batches are no run's threads"
    );

    // A request hung up while it reuses a context (prompt + 200 tokens fit the same
    // 256-cell context). Unbatched, that context is not kept (its run was stopped);
    // batched, its sequence keeps the prompt and the tokens it delivered, which are
    // exactly what memory holds. Either way the next request is answered whole.
    let story = json!({"model": "smollm2", "max_tokens": 200, "temperature": 0, "stream": true,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a long story about a llama."}]});
    hang_up_after(&server, "/v1/chat/completions", "hung-up", &story, "\"content\":\"");
    assert_eq!(log_field(&server.run_report("hung-up"), "outcome"), "Stopped");
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_idle_contexts"), 0.0);
    let (text, _, reused) = send("Where do alpacas live?", "after");
    assert!(!text.is_empty());
    assert_eq!(text, again, "answered as before the hang-up");
    if batch {
        assert!(reused > 20, "the system part the stopped request left is reused: {reused}");
    } else {
        assert_eq!(reused, 0, "the stopped run's context was freed, not kept");
    }
}

/// A hang-up on each API's stream stops its own native work in flight: each run is
/// stopped after the few tokens in flight, not the 400 asked for.
#[test]
fn a_hang_up_on_each_api_stops_its_native_work() {
    let server = Server::start(&[("smollm2", common::real_model())], &["--threads", "2"]);
    let ask = "Tell me a long story about a llama.";
    let cases = [
        ("/v1/chat/completions", chat(ask, 400, true), "\"content\":\""),
        (
            "/v1/completions",
            // A story's start (a bare question may end at once), and no end before 400.
            json!({"model": "smollm2", "prompt": "Once upon a time, a llama", "max_tokens": 400,
                   "temperature": 0, "stream": true, "ignore_eos": true}),
            "\"text\":\"",
        ),
        (
            "/v1/responses",
            json!({"model": "smollm2", "input": ask, "max_output_tokens": 400, "temperature": 0, "stream": true}),
            "output_text.delta",
        ),
        (
            "/v1/messages",
            json!({"model": "smollm2", "max_tokens": 400, "temperature": 0, "stream": true,
                   "messages": [{"role": "user", "content": ask}]}),
            "text_delta",
        ),
    ];
    for (i, (path, body, marker)) in cases.iter().enumerate() {
        let id = format!("hang-up-{i}");
        hang_up_after(&server, path, &id, body, marker);
        let report = server.run_report(&id);
        assert_eq!(log_field(&report, "outcome"), "Stopped", "{path}: {report}");
        let generated: u32 = log_field(&report, "generated").parse().unwrap();
        assert!(generated < 400, "{path} went on to {generated} tokens: {report}");
        server.wait_metric("llamabox_in_flight", 0.0);
    }
    let stopped = server.metric("llamabox_cancels_total{cause=\"disconnect\"}");
    assert_eq!(stopped, cases.len() as f64);
}

#[test]
fn a_hang_up_stops_its_own_native_work_and_nobody_elses() {
    hang_ups_stop_only_their_own_work(false);
}

#[test]
fn a_hang_up_in_a_shared_batch_stops_its_own_native_work_and_nobody_elses() {
    hang_ups_stop_only_their_own_work(true);
}

/// Unbatched, two requests run at once (2 threads, 1 each); batched, they are two
/// seats of one batch on both threads, and a hang-up stops the step they share, rolls
/// it back and re-runs the other's rows. Both from 127.0.0.1: a client may run both. No
/// idle contexts and no prefix to share: B's answer alone and beside A's hang-up must
/// be computed alike (unbatched bit for bit; batched, greedy text where batch shapes
/// flip no near tie, which holds for this prompt).
fn hang_ups_stop_only_their_own_work(batch: bool) {
    let batch = batch.to_string();
    let flags = [
        "--threads",
        "2",
        "--request-threads",
        "1",
        "--idle-contexts",
        "0",
        "--max-client-requests",
        "2",
        "--batch",
        &batch,
        "--batch-seats",
        "2",
    ];
    let server = Server::start(&[("smollm2", common::real_model())], &flags);
    let question = "Name three animals that live in the Andes.";
    let alone = post_chat(&server, &chat(question, 48, false), &[]);

    // A streams while B hangs up mid-prefill of a ~3000-token prompt.
    let prompt = long_prompt(1000, "w");
    let counted = post_chat(&server, &chat(&prompt, 1, false), &[]);
    let (_, prompt_tokens, _) = answer(&counted);
    let other = std::thread::scope(|s| {
        let other =
            s.spawn(|| post(&server, "/v1/chat/completions", &chat(question, 48, true), &["-N"]));
        // A different prompt than the one counted, so no cache could help.
        hang_up_after(
            &server,
            "/v1/chat/completions",
            "prefill-hang-up",
            &chat(&long_prompt(1000, "v"), 64, true),
            "data: ",
        );
        other.join().unwrap()
    });
    let report = server.run_report("prefill-hang-up");
    println!("{report}");
    assert_eq!(log_field(&report, "outcome"), "Stopped");
    assert_eq!(log_field(&report, "generated"), "0");
    let decoded: u64 = log_field(&report, "decoded").parse().unwrap();
    assert!(
        decoded < prompt_tokens,
        "the prefill ran on after the hang-up: {decoded} of {prompt_tokens} tokens"
    );
    // The other request is whole, and the same as when it ran alone.
    assert_eq!(other.0, 200);
    assert_eq!(chat_text(&other.1, true), chat_text(&alone, false));

    // A hang-up during generation stops it too.
    hang_up_after(
        &server,
        "/v1/chat/completions",
        "generation-hang-up",
        &chat(question, 4000, true),
        "\"content\":\"",
    );
    let report = server.run_report("generation-hang-up");
    println!("{report}");
    assert_eq!(log_field(&report, "outcome"), "Stopped");
    let generated: u64 = log_field(&report, "generated").parse().unwrap();
    assert!(generated < 4000, "{report}");

    server.wait_metric("llamabox_cancels_total{cause=\"disconnect\"}", 2.0);
    assert_eq!(server.metric("llamabox_disconnect_stop_seconds_count"), 2.0);
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
    let steps = server.metric("llamabox_batch_step_seats_count");
    if batch == "true" {
        // Two requests at once share steps, and each answers as it did alone.
        let (a, b) = std::thread::scope(|s| {
            let a =
                s.spawn(|| post(&server, "/v1/chat/completions", &chat(question, 48, false), &[]));
            let b = post(&server, "/v1/chat/completions", &chat(question, 48, false), &[]);
            (a.join().unwrap(), b)
        });
        assert_eq!((a.0, b.0), (200, 200));
        assert_eq!(
            (chat_text(&a.1, false), chat_text(&b.1, false)),
            (chat_text(&alone, false), chat_text(&alone, false))
        );
        let steps = server.metric("llamabox_batch_step_seats_count");
        assert!(
            server.metric("llamabox_batch_step_seats_sum") > steps,
            "no step held two requests ({steps} steps)"
        );
    } else {
        assert_eq!(steps, 0.0, "unbatched, no step is a batch's");
    }
}

/// SSE clients (the openai package among them) close their socket as soon as they
/// read `data: [DONE]`, before the body's last chunk, which waits for the plugin's
/// handler to return. Nothing was cut short: that is a success, not a disconnect.
#[test]
fn a_client_that_closes_after_done_is_no_hang_up() {
    let server = Server::start(
        &[("smollm2", common::real_model())],
        &["--threads", "2", "--max-client-requests", "8"],
    );
    const STREAMS: usize = 8;
    std::thread::scope(|s| {
        for i in 0..STREAMS {
            let server = &server;
            s.spawn(move || {
                hang_up_after(
                    server,
                    "/v1/chat/completions",
                    &format!("done-{i}"),
                    &chat("Say hello.", 8, true),
                    "data: [DONE]",
                )
            });
        }
    });
    server.wait_metric("llamabox_in_flight", 0.0);
    let reports: Vec<String> =
        (0..STREAMS).map(|i| server.run_report(&format!("done-{i}"))).collect();
    assert_eq!(server.metric("llamabox_cancels_total{cause=\"disconnect\"}"), 0.0, "{reports:#?}");
    assert_eq!(server.metric("llamabox_disconnect_stop_seconds_count"), 0.0, "{reports:#?}");
    assert_eq!(
        server.metric("llamabox_requests_total{plugin=\"openai\",status=\"200\"}"),
        STREAMS as f64
    );
    assert!(!server.stderr().contains("client hung up"), "{}", server.stderr());

    // One that leaves mid-stream is still a hang-up.
    hang_up_after(
        &server,
        "/v1/chat/completions",
        "mid-stream",
        &chat("Tell me a story.", 4000, true),
        "\"content\":\"",
    );
    assert_eq!(log_field(&server.run_report("mid-stream"), "outcome"), "Stopped");
    server.wait_metric("llamabox_cancels_total{cause=\"disconnect\"}", 1.0);
    assert_eq!(server.metric("llamabox_disconnect_stop_seconds_count"), 1.0);
}

#[test]
fn deadlines_queues_and_body_limits_answer_before_any_work_is_lost() {
    // Two requests from one client (127.0.0.1) meet the queue, not the per-client cap.
    // One seat: one request runs at a time (unbatched, one thread would make it so).
    let flags = [
        "--threads",
        "1",
        "--batch-seats",
        "1",
        "--max-queue",
        "0",
        "--deadline-ms",
        "500",
        "--max-body-bytes",
        "65536",
        "--max-client-requests",
        "2",
    ];
    let server = Server::start(&[("smollm2", common::real_model())], &flags);

    // Far more work than 500 ms on any CPU: the deadline answers 504 and stops it.
    let (status, body) =
        post(&server, "/v1/chat/completions", &chat(&long_prompt(800, "d"), 500, false), &[]);
    assert_eq!(status, 504, "{body}");
    server.wait_metric("llamabox_cancels_total{cause=\"deadline\"}", 1.0);

    // One seat, no queue: while a request runs, the next is refused with Retry-After.
    let holder_body = chat(&long_prompt(1000, "h"), 64, true).to_string();
    let mut holder = TcpStream::connect(server.addr).unwrap();
    write!(
        holder,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{holder_body}",
        holder_body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let _ = holder.read(&mut first).unwrap();
    let out = Command::new("curl")
        .args(["-sS", "-i", "-H", "content-type: application/json", "--data-binary"])
        .arg(chat("hi", 4, false).to_string())
        .arg(server.url("/v1/chat/completions"))
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(head.starts_with("http/1.1 503"), "{head}");
    assert!(head.contains("retry-after: "), "{head}");
    drop(holder);
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"queue_full\"}"),
        1.0
    );

    // A body over the limit: 413 before the plugin runs.
    let big = "x".repeat(70_000);
    let (status, _) = post(&server, "/v1/chat/completions", &chat(&big, 4, false), &[]);
    assert_eq!(status, 413);
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}

#[test]
fn sigterm_drains_requests_in_flight_then_stops_what_is_left() {
    let question = "Tell me about llamas.";
    // A grace period long enough: the request in flight finishes whole.
    let mut server =
        Server::start(&[("smollm2", common::real_model())], &["--shutdown-grace-ms", "60000"]);
    let streamed = std::thread::scope(|s| {
        let url = server.url("/v1/chat/completions");
        let streamed = s.spawn(move || post_to(&url, &chat(question, 48, true), &["-N"]));
        server.wait_metric("llamabox_in_flight", 1.0);
        let status = server.terminate();
        assert!(status.success(), "exit status {status}");
        streamed.join().unwrap()
    });
    assert_eq!(streamed.0, 200);
    assert!(!chat_text(&streamed.1, true).is_empty());
    let out = server.stdout();
    assert!(
        out.contains("draining: 1 requests in flight") && out.trim_end().ends_with("stopped"),
        "{out}"
    );

    // A short one: what is still running when it ends is stopped, and the exit is clean.
    let mut server =
        Server::start(&[("smollm2", common::real_model())], &["--shutdown-grace-ms", "200"]);
    let streamed = std::thread::scope(|s| {
        let url = server.url("/v1/chat/completions");
        let streamed =
            s.spawn(move || post_to(&url, &chat(&long_prompt(800, "s"), 500, true), &["-N"]));
        server.wait_metric("llamabox_in_flight", 1.0);
        let status = server.terminate();
        assert!(status.success(), "exit status {status}");
        streamed.join().unwrap()
    });
    assert!(!streamed.1.contains("[DONE]"), "the stopped request's stream ended as if whole");
    let out = server.stdout();
    assert!(out.contains("grace period over: stopping 1 requests"), "{out}");
}

/// `rgb` (width × height × 3 bytes) as a PNG: one stored (uncompressed) deflate
/// stream, enough for the plugin's decoder.
fn png(width: u32, height: u32, rgb: &[u8]) -> Vec<u8> {
    fn crc32(bytes: &[u8]) -> u32 {
        !bytes.iter().fold(!0u32, |crc, &b| {
            (0..8)
                .fold(crc ^ u32::from(b), |c, _| (c >> 1) ^ (0xEDB8_8320 & (c & 1).wrapping_neg()))
        })
    }
    fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let crc = crc32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    }
    let rows: Vec<u8> = rgb
        .chunks(width as usize * 3)
        .flat_map(|row| std::iter::once(0).chain(row.iter().copied()))
        .collect();
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = rows.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        zlib.extend_from_slice(&len.to_le_bytes());
        zlib.extend_from_slice(&(!len).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    let (a, b) = rows.iter().fold((1u32, 0u32), |(a, b), &x| {
        ((a + u32::from(x)) % 65_521, (b + a + u32::from(x)) % 65_521)
    });
    zlib.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut header = [width.to_be_bytes(), height.to_be_bytes()].concat();
    header.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &header);
    chunk(&mut out, b"IDAT", &zlib);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// A `side` × `side` gradient as a PNG, in base64.
fn gradient_png_base64(side: u32) -> String {
    base64(&png(side, side, &common::gradient(side, side)))
}

/// A server on the tiny model whose openai plugin sees images through `projector`.
fn vision_server(projector: &std::path::Path) -> Server {
    let projector = format!("eyes={}", projector.display());
    let flags = ["--projector", &projector, "--plugin-env", "LLAMABOX_VISION=tiny=eyes"];
    Server::start(&[("tiny", common::tiny_model())], &flags)
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    bytes
        .chunks(3)
        .flat_map(|group| {
            let n =
                group.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
            (0..4).map(move |i| {
                if i <= group.len() {
                    ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char
                } else {
                    '='
                }
            })
        })
        .collect()
}

#[test]
fn a_hang_up_during_an_image_encode_stops_the_encode() {
    let server = vision_server(common::slow_vision());
    let url = format!("data:image/png;base64,{}", gradient_png_base64(64));
    let ask = |stream: bool| {
        json!({"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    };
    // Served whole: the image's embeddings are part of the prompt.
    let whole = post_chat(&server, &ask(false), &["-H", "x-request-id: image-whole"]);
    let text_only = server.run_report("image-whole");
    let (_, prompt_tokens, _) = answer(&whole);
    assert!(
        prompt_tokens > 100,
        "{prompt_tokens} prompt tokens: the image's are missing ({text_only})"
    );

    // The stream's first event goes out before the encode starts; the hang-up lands in it.
    hang_up_after(&server, "/v1/chat/completions", "image-hang-up", &ask(true), "data: ");
    let report = server.run_report("image-hang-up");
    println!("{report}");
    assert_eq!(log_field(&report, "outcome"), "Stopped");
    assert_eq!(
        log_field(&report, "decoded"),
        "0",
        "the prompt was decoded: the encode had finished"
    );
    assert!(
        log_field(&report, "cancels").parse::<u64>().unwrap() >= 1,
        "no native call was cancelled: {report}"
    );
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
    assert_eq!(server.metric("llamabox_cancels_total{cause=\"disconnect\"}"), 1.0);
}

#[test]
fn a_hostile_plugin_gets_answers_for_its_misdeeds_and_the_server_keeps_serving() {
    let config = std::env::temp_dir().join(format!("llamabox-hostile-{}.toml", std::process::id()));
    let plugin = common::guest_plugin("llamabox_http_hostile.wasm");
    // Keys of earlier releases on purpose (top-level max_client_requests, a flat
    // [plugins.limits]): they still work, with a warning.
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nthreads = 2\nmax_client_requests = 1\n[models]\nslow = {:?}\n\
         [[plugins]]\nname = \"hostile\"\npath = {:?}\ndeadline_ms = 1000\n[plugins.limits]\nmax_memory_mib = 32\n",
        common::slow_model().display().to_string(),
        plugin.display().to_string()
    );
    std::fs::write(&config, toml).unwrap();
    let server = Server::spawn(&["--config".into(), config.display().to_string()]);
    let get = |path: &str| curl(&[&server.url(path)]).0;
    assert_eq!(get("/"), 200);
    assert_eq!(get("/trap"), 500, "a trap before the response");
    assert_eq!(get("/no-response"), 500, "a handler that set no response");
    assert_eq!(get("/grow"), 500, "a plugin over its wasm memory limit");
    assert_eq!(get("/spin"), 504, "a plugin spinning in wasm until the deadline");
    // Hang-ups stop a plugin that writes forever and one that decodes forever (on the
    // host: native work in flight; it writes a line after its first decode).
    for (path, id, wait_for) in
        [("/endless", "endless", "more"), ("/decode-forever", "decode-forever", "decoding")]
    {
        let mut socket = TcpStream::connect(server.addr).unwrap();
        write!(socket, "GET {path} HTTP/1.1\r\nhost: x\r\nx-request-id: {id}\r\n\r\n").unwrap();
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains(wait_for) {
            let mut buf = [0u8; 256];
            let n = socket.read(&mut buf).unwrap();
            assert!(n > 0, "{path}: the server closed first");
            seen.extend_from_slice(&buf[..n]);
        }
        // The line comes as the decode is queued: give a worker the moment it takes to
        // start it (a decode of the slow model then runs for seconds), so the hang-up
        // meets it in flight rather than still queued, which a busy machine allowed.
        std::thread::sleep(Duration::from_millis(300));
        drop(socket);
        let report = server.run_report(id);
        assert_eq!(log_field(&report, "outcome"), "Stopped", "{report}");
    }
    let decoding = server.run_report("decode-forever");
    assert!(
        log_field(&decoding, "cancels").parse::<u64>().unwrap() >= 1,
        "the decode was not cancelled: {decoding}"
    );
    // The deadline cuts a stream that never ends: curl sees the body cut short.
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "--max-time", "60"])
        .arg(server.url("/decode-forever"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(18), "curl: {}", String::from_utf8_lossy(&out.stderr));
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
    assert_eq!(server.metric("llamabox_cancels_total{cause=\"disconnect\"}"), 2.0);
    assert_eq!(server.metric("llamabox_cancels_total{cause=\"deadline\"}"), 2.0);
    assert_eq!(server.metric("llamabox_requests_total"), 8.0);
    assert_eq!(get("/"), 200, "the server stopped serving");

    // A client's place is its again once the plugin has finished its body, although
    // the run goes on (here until its deadline): an SSE client that reads `[DONE]` and
    // sends its next request at once is no second request in progress (one each here).
    let mut socket = TcpStream::connect(server.addr).unwrap();
    write!(socket, "GET /linger HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("done\n") {
        let mut buf = [0u8; 256];
        let n = socket.read(&mut buf).unwrap();
        assert!(n > 0, "/linger: the server closed first");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(get("/"), 200, "the next request was refused while the last one's run lingered");
    drop(socket);
    let _ = std::fs::remove_file(config);
}

/// wrk's completed requests (`N requests in`).
fn wrk_requests(output: &str) -> u64 {
    output
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ")?.0.parse().ok())
        .unwrap_or_else(|| panic!("{output}"))
}

#[test]
fn load_with_wrk_and_hang_ups_leaves_no_worker_and_accounts_for_every_request() {
    // wrk's connections are all one client (127.0.0.1): no per-client cap.
    let flags = ["--threads", "2", "--request-threads", "1", "--max-client-requests", "0"];
    let server = Server::start(&[("tiny", common::tiny_model())], &flags);
    let script = std::env::temp_dir().join(format!("llamabox-wrk-{}.lua", std::process::id()));
    let body = json!({"model": "tiny", "prompt": "a b c d", "max_tokens": 8, "temperature": 0})
        .to_string();
    std::fs::write(&script, format!("wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nwrk.body = {}\n", json!(body))).unwrap();
    let hang_up_body = json!({"model": "tiny", "prompt": "a b c d", "max_tokens": 3000, "temperature": 0, "stream": true});
    let mut rss = Vec::new();
    let (mut completed, mut hang_ups, mut cut_off) = (0u64, 0u64, 0u64);
    for (round, connections) in [1u32, 4, 8, 8, 8].into_iter().enumerate() {
        let out = std::thread::scope(|s| {
            let wrk = s.spawn(|| {
                Command::new("wrk")
                    .args([
                        "-t",
                        "1",
                        "-c",
                        &connections.to_string(),
                        "-d",
                        "2s",
                        "--timeout",
                        "10s",
                        "-s",
                    ])
                    .arg(&script)
                    .arg(server.url("/v1/completions"))
                    .output()
                    .expect("running wrk (Debian's wrk package)")
            });
            // Abrupt disconnects among the load, each after its stream began.
            for i in 0..5 {
                hang_up_after(
                    &server,
                    "/v1/completions",
                    &format!("load-{round}-{i}"),
                    &hang_up_body,
                    "data: ",
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            wrk.join().unwrap()
        });
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        println!("wrk -c {connections}:\n{text}");
        assert!(out.status.success() && !text.contains("Non-2xx"), "{text}");
        completed += wrk_requests(&text);
        hang_ups += 5;
        cut_off += u64::from(connections);
        server.wait_metric("llamabox_in_flight", 0.0);
        assert_eq!(
            server.metric("llamabox_live_workers"),
            0.0,
            "native threads outlived their requests"
        );
        // Every request is counted once: wrk's, the hang-ups, and at most one request
        // per wrk connection cut off when its time was up.
        let counted = server.metric("llamabox_requests_total");
        let (low, high) = ((completed + hang_ups) as f64, (completed + hang_ups + cut_off) as f64);
        assert!(
            low <= counted && counted <= high,
            "{counted} requests counted, want {low}..={high}"
        );
        rss.push(server.rss_kib());
    }
    assert_eq!(server.metric("llamabox_queue_depth"), 0.0, "queue places leaked");
    let cancelled = server.metric("llamabox_cancels_total{cause=\"disconnect\"}");
    assert!(cancelled >= hang_ups as f64, "{cancelled} hang-ups stopped of {hang_ups}");
    println!("RSS per round (KiB): {rss:?}");
    // Flat across the repeated rounds at concurrency 8 (allocator noise aside).
    let (first, last) = (rss[2], *rss.last().unwrap());
    assert!(
        last <= first + first / 10 + 8192,
        "RSS grew from {first} to {last} KiB over repeated rounds: {rss:?}"
    );
    let _ = std::fs::remove_file(script);
}

/// Message text is never special-parsed, images or not: with an image, a text that
/// spells the tiny model's `</s>` costs its plain tokens (the host's media tokenizer,
/// which parses special tokens in all it is given, never sees it), and the answer is
/// served whole, the image's embeddings and all.
#[test]
fn a_message_beside_an_image_cannot_spell_a_special_token() {
    let server = vision_server(common::tiny_vision());
    let url = format!("data:image/png;base64,{}", gradient_png_base64(8));
    let prompt_tokens = |text: &str| {
        let body = json!({"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]});
        let response = post_chat(&server, &body, &[]);
        answer(&response).1
    };
    let tokens = |text: &str, parse_special: bool| {
        let body = json!({"model": "tiny", "content": text, "parse_special": parse_special});
        let response = post_ok(&server, "/tokenize", &body, &[]);
        serde_json::from_str::<Value>(&response).unwrap()["tokens"].as_array().unwrap().len() as u64
    };
    assert_eq!(tokens("</s>", true), 1, "</s> is the tiny model's special token");
    let (once, twice) = (prompt_tokens("a</s>"), prompt_tokens("a</s></s>"));
    let plain = tokens("a</s></s>", false) - tokens("a</s>", false);
    assert!(plain > 1);
    assert_eq!(twice - once, plain, "the second </s> took {} tokens", twice - once);
}

/// A stream the deadline cuts ends with one error event in its API's form (which the
/// official SDKs raise) and a clean end of the body, not a body that just stops: chat
/// completions and Anthropic's Messages alike.
#[test]
fn a_deadline_ends_a_stream_with_an_error_event_in_its_apis_form() {
    let server = Server::start(&[("slow", common::slow_chat_model())], &["--deadline-ms", "1500"]);
    let long = |path: &str, body: Value| {
        let out = Command::new("curl")
            .args(["-sS", "-N", "--max-time", "60", "-H", "content-type: application/json"])
            .args(["--data-binary", &body.to_string()])
            .arg(server.url(path))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "curl: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let messages = [json!({"role": "user", "content": "count"})];
    let chat = long(
        "/v1/chat/completions",
        json!({"model": "slow", "messages": messages, "max_tokens": 4000, "ignore_eos": true, "stream": true}),
    );
    let last = chat.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\""), "{last}");
    assert!(last.contains("\"code\":\"deadline_exceeded\""), "{last}");
    assert!(last.contains("deadline of 1500 ms passed"), "{last}");
    assert!(!chat.contains("[DONE]"), "a cut stream is not a finished one");
    // Without `ignore_eos`, a prompt whose prefill alone outlasts the deadline (about 2,500
    // tokens of the slow model): the stream has begun, and is cut in the prefill.
    let document = "llama ".repeat(500);
    let anthropic = long(
        "/v1/messages",
        json!({"model": "slow", "messages": [{"role": "user", "content": document}], "max_tokens": 1000, "stream": true}),
    );
    let last = anthropic.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("event: error\ndata: {\"type\":\"error\""), "{last}");
    assert!(last.contains("\"type\":\"api_error\""), "{last}");
    assert!(!anthropic.contains("message_stop"), "{anthropic}");
    let responses = long(
        "/v1/responses",
        json!({"model": "slow", "input": document, "max_output_tokens": 1000, "stream": true}),
    );
    let last = responses.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("event: error\ndata: {"), "{last}");
    assert!(last.contains("\"code\":\"deadline_exceeded\""), "{last}");
    assert!(!responses.contains("response.completed"), "{responses}");
    server.wait_metric("llamabox_cancels_total{cause=\"deadline\"}", 3.0);
}
