//! Attacks on `llamabox serve` from clients (issue 23): stalled request bodies, clients
//! that stop reading, a flood of connections from one client, embeddings priced to run
//! for minutes. While each runs, a normal client's chat completion must be answered
//! within [`NORMAL_CHAT`].
//!
//! Everything is on loopback: the server listens on 127.0.0.1, and attackers connect
//! from other 127.x.y.z addresses (all of 127/8 is this machine), so that the server
//! sees them as other clients than the normal one (127.0.0.1). Every loop is bounded
//! in count, every wait in time.

use std::io::Write;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{self, serve::*};

/// How long the normal client's chat completion may take during an attack.
const NORMAL_CHAT: Duration = Duration::from_secs(5);
/// The server's body timeout in these tests (the default, 10 s, would only make them
/// slower). Longer than the normal chat may take, so the chat is answered while the
/// stalled bodies still stall.
const BODY_TIMEOUT_MS: u64 = 5_000;
/// The write-stall timeout in these tests.
const WRITE_STALL_MS: u64 = 1_000;
/// A silent reader's receive buffer: what a client that means to stall asks for.
const SILENT_RECV_BUFFER: u32 = 4096;
/// How quickly a refusal (429, 413, 400) must come.
const PROMPT: Duration = Duration::from_secs(2);

/// The attackers' addresses: loopback, but not the normal client's 127.0.0.1.
fn attacker(n: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, 10 + n])
}

/// The server every attack meets: SmolLM2 for the normal client, the tiny model for
/// attackers that need a long stream fast; 2 threads, 1 per request, so 2 slots, and
/// the per-address flood guard at 1 request in progress (its default is generous:
/// these tests hold it to account), every other setting at its default.
fn server() -> Server {
    let flags = [
        "--threads",
        "2",
        "--request-threads",
        "1",
        "--body-timeout-ms",
        &BODY_TIMEOUT_MS.to_string(),
        "--write-stall-timeout-ms",
        &WRITE_STALL_MS.to_string(),
        "--max-client-requests",
        "1",
    ]
    .map(String::from);
    Server::start(
        &[("smollm2", common::real_model()), ("tiny", common::tiny_model())],
        &flags.each_ref().map(String::as_str),
    )
}

/// The normal client's chat completion (from 127.0.0.1): answered whole within
/// [`NORMAL_CHAT`]; how long it took.
fn normal_chat(server: &Server, during: &str) -> Duration {
    let started = Instant::now();
    let (status, body) =
        post(server, "/v1/chat/completions", &chat("What is a llama?", 8, false), &[]);
    let took = started.elapsed();
    assert_eq!(status, 200, "the normal chat during {during}: {body}");
    assert!(!chat_text(&body, false).is_empty(), "{body}");
    assert!(took < NORMAL_CHAT, "the normal chat during {during} took {took:?}");
    println!("figure: normal chat answered in {:.0} ms during {during}", took.as_secs_f64() * 1e3);
    took
}

/// A refusal read whole from `socket`: its status line must be `status`, with a JSON
/// error body; checked to come within [`PROMPT`].
fn refusal(socket: &mut std::net::TcpStream, status: &str) -> Value {
    let started = Instant::now();
    let text = read_until(socket, None, PROMPT);
    assert!(text.starts_with(&format!("HTTP/1.1 {status}")), "want {status}: {text}");
    assert!(started.elapsed() < PROMPT, "{status} took {:?}", started.elapsed());
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A streamed completion on the tiny model that runs for thousands of tokens (its
/// end-of-sequence token banned), faster than any client that stops reading can
/// stay ahead of.
fn endless_stream() -> Value {
    json!({"model": "tiny", "prompt": "a b c d", "max_tokens": 4000, "temperature": 0, "stream": true,
           "logit_bias": {"2": -100}})
}

#[test]
fn stalled_bodies_hold_no_slot_and_get_408_and_bodies_over_the_cap_get_413() {
    let server = server();
    // Four clients each stall a body (4000 bytes announced, 1 sent); a second stalled
    // body from each is refused at once: a client has 1 request in progress at most.
    let started = Instant::now();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 4000\r\n\r\n{";
    let mut stalled = Vec::new();
    for n in 0..4 {
        let mut first = connect_from(attacker(n), server.addr, None);
        first.write_all(head.as_bytes()).unwrap();
        stalled.push(first);
        // The server has the first in progress before the second comes.
        server.wait_metric("llamabox_reading_bodies", f64::from(n + 1));
        let mut second = connect_from(attacker(n), server.addr, None);
        second.write_all(head.as_bytes()).unwrap();
        let error = refusal(&mut second, "429");
        assert!(
            error["error"]["message"].as_str().unwrap().contains("1 requests in progress"),
            "{error}"
        );
    }
    normal_chat(&server, "4 stalled bodies");
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"body_timeout\"}"),
        0.0,
        "the chat came after the stall ended"
    );

    // Each stalled body is answered 408 once its timeout is over, not before.
    for mut socket in stalled {
        let text =
            read_until(&mut socket, None, Duration::from_millis(BODY_TIMEOUT_MS) + NORMAL_CHAT);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains(&format!("did not arrive within {BODY_TIMEOUT_MS} ms")), "{text}");
    }
    let waited = started.elapsed();
    assert_eq!(server.metric("llamabox_reading_bodies"), 0.0);
    assert!(waited >= Duration::from_millis(BODY_TIMEOUT_MS), "408 after {waited:?}");
    println!(
        "figure: 4 stalled bodies answered 408 within {:.2} s of the first",
        waited.as_secs_f64()
    );
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"body_timeout\"}"),
        4.0
    );
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"client_limit\"}"),
        4.0
    );

    // Over the body cap (1 MiB by default): 413 for a Content-Length at once...
    let mut socket = connect_from(attacker(5), server.addr, None);
    socket
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2000000\r\n\r\n",
        )
        .unwrap();
    refusal(&mut socket, "413");
    // ...and for a chunked body once it has sent more than the cap.
    let mut socket = connect_from(attacker(6), server.addr, None);
    socket
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .unwrap();
    let mut writer = socket.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = format!("{:x}\r\n{}\r\n", 64 << 10, "x".repeat(64 << 10));
        // 17 × 64 KiB: past the cap; the server may close before the last ones.
        for _ in 0..17 {
            if writer.write_all(chunk.as_bytes()).is_err() {
                return;
            }
        }
        let _ = writer.write_all(b"0\r\n\r\n");
    });
    let text = read_until(&mut socket, Some("\r\n\r\n"), PATIENCE);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    sender.join().unwrap();
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"body_too_large\"}"),
        2.0
    );
    normal_chat(&server, "nothing (after the stalled bodies)");
    server.wait_metric("llamabox_in_flight", 0.0);
}

#[test]
fn clients_that_stop_reading_are_cut_off_and_hold_at_most_their_share() {
    let server = server();
    // One client, two streams it never reads: the first takes a slot, the second is
    // refused at once (its 429 is read), so a slot stays free for everyone else.
    let silent = post_raw(
        &server,
        attacker(0),
        "/v1/completions",
        "silent-1",
        &endless_stream(),
        Some(SILENT_RECV_BUFFER),
    );
    server.wait_metric("llamabox_in_flight", 1.0);
    let started = Instant::now();
    let mut second = post_raw(
        &server,
        attacker(0),
        "/v1/completions",
        "silent-2",
        &endless_stream(),
        Some(SILENT_RECV_BUFFER),
    );
    refusal(&mut second, "429");
    normal_chat(&server, "a silent reader (and its refused second)");
    // It is cut off after the write-stall timeout: its run stopped, its connection
    // closed (reading it now ends, after what the kernel still held).
    server.wait_metric("llamabox_cancels_total{cause=\"write_stall\"}", 1.0);
    println!(
        "figure: a silent reader was cut off {:.2} s after its stream began",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(log_field(&server.run_report("silent-1"), "outcome"), "Stopped");
    let mut silent = silent;
    let held = read_until(&mut silent, None, PATIENCE);
    assert!(
        held.starts_with("HTTP/1.1 200") && !held.contains("[DONE]"),
        "{}",
        &held[..held.len().min(200)]
    );

    // Two clients, one silent stream each: both slots. The normal chat waits in the
    // queue until the write-stall timeout frees one.
    let a = post_raw(
        &server,
        attacker(1),
        "/v1/completions",
        "silent-a",
        &endless_stream(),
        Some(SILENT_RECV_BUFFER),
    );
    let b = post_raw(
        &server,
        attacker(2),
        "/v1/completions",
        "silent-b",
        &endless_stream(),
        Some(SILENT_RECV_BUFFER),
    );
    server.wait_metric("llamabox_in_flight", 2.0);
    normal_chat(&server, "2 silent readers from 2 clients (every slot)");
    server.wait_metric("llamabox_cancels_total{cause=\"write_stall\"}", 3.0);
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
    assert_eq!(
        server.metric("llamabox_cancels_total{cause=\"disconnect\"}"),
        0.0,
        "counted as write stalls only"
    );
    drop((a, b));
}

#[test]
fn a_flood_from_one_client_gets_429_and_everyone_else_is_served() {
    let server = server();
    // 24 connections from one client, each a whole request for a streamed chat.
    const FLOOD: usize = 24;
    let started = Instant::now();
    let mut flood: Vec<_> = (0..FLOOD)
        .map(|i| {
            post_raw(
                &server,
                attacker(0),
                "/v1/chat/completions",
                &format!("flood-{i}"),
                &chat("Tell me about llamas.", 64, true),
                None,
            )
        })
        .collect();
    normal_chat(&server, "a flood of 24 connections from one client");
    let (mut served, mut refused) = (0, 0);
    for socket in &mut flood {
        let head = read_until(socket, Some("\r\n\r\n"), PATIENCE);
        if head.starts_with("HTTP/1.1 429") {
            assert!(head.to_lowercase().contains("retry-after: "), "{head}");
            refused += 1;
        } else {
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            served += 1;
        }
    }
    let refused_in = started.elapsed();
    println!("figure: flood of {FLOOD}: {served} served, {refused} refused 429 (all answered within {:.2} s)", refused_in.as_secs_f64());
    assert!(served >= 1 && refused >= FLOOD - 4, "{served} served, {refused} refused");
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"openai\",reason=\"client_limit\"}"),
        refused as f64
    );
    drop(flood);
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}

/// An embeddings request of `inputs` (texts).
fn embeddings(model: &str, inputs: &[String]) -> Value {
    json!({"model": model, "input": inputs})
}

#[test]
fn embeddings_are_priced_before_they_run() {
    let server = server();
    // 60 000 one-token inputs (300 KB) from another client: minutes of work, refused
    // before any, while the normal chat is served beside it.
    let many = vec!["a".to_string(); 60_000];
    let from = attacker(0).to_string();
    let (refused, took) = std::thread::scope(|s| {
        let big = s.spawn(|| {
            let started = Instant::now();
            (
                post(
                    &server,
                    "/v1/embeddings",
                    &embeddings("smollm2", &many),
                    &["--interface", &from],
                ),
                started.elapsed(),
            )
        });
        normal_chat(&server, "an embeddings request of 60 000 inputs");
        big.join().unwrap()
    });
    assert_eq!(refused.0, 400, "{}", refused.1);
    let error: Value = serde_json::from_str(&refused.1).unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("max-embed-inputs") && message.contains("60000"), "{message}");
    assert_eq!(error["error"]["param"], "input");
    assert!(took < PROMPT, "the refusal took {took:?}");
    println!("figure: 60 000 embedding inputs refused 400 in {:.0} ms", took.as_secs_f64() * 1e3);
    // Fewer, longer inputs over the token budget (8192): refused too.
    let long: Vec<String> = (0..6).map(|i| long_prompt(700, &format!("e{i}x"))).collect();
    let (status, body) = post(&server, "/v1/embeddings", &embeddings("smollm2", &long), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("max-embed-tokens"), "{body}");
    // At the input cap: embedded, and what the cap costs at most in worker calls.
    let started = Instant::now();
    let (status, body) =
        post(&server, "/v1/embeddings", &embeddings("smollm2", &vec!["a".to_string(); 256]), &[]);
    assert_eq!(status, 200, "{}", &body[..body.len().min(300)]);
    println!(
        "figure: 256 one-token inputs (max-embed-inputs) embedded in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}

#[test]
fn the_hosts_embedding_budget_holds_whatever_the_plugin_checks() {
    // Host limits below the openai plugin's own checks: the host refuses the call that
    // would go over (limit-exceeded), and the plugin answers 400 naming the limit.
    let config =
        std::env::temp_dir().join(format!("llamabox-embed-budget-{}.toml", std::process::id()));
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nthreads = 1\n[models]\ntiny = {:?}\n\
         [[plugins]]\nname = \"openai\"\npath = {:?}\n[plugins.limits]\nmax_embed_inputs = 4\nmax_embed_tokens = 64\n",
        common::tiny_model().display().to_string(),
        openai_plugin().display().to_string()
    );
    std::fs::write(&config, toml).unwrap();
    let server = Server::spawn(&["--config".into(), config.display().to_string()]);
    let words = |n: usize| -> Vec<String> { (0..n).map(|i| format!("word{i}")).collect() };
    // Four inputs: within the budget, twice (each request is a run of its own).
    for _ in 0..2 {
        post_ok(&server, "/v1/embeddings", &embeddings("tiny", &words(4)), &[]);
    }
    let (status, body) = post(&server, "/v1/embeddings", &embeddings("tiny", &words(5)), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("max-embed-inputs: this plugin embedded 4 of 4 already"), "{body}");
    let long: Vec<String> = (0..3).map(|i| long_prompt(12, &format!("t{i}x"))).collect();
    let (status, body) = post(&server, "/v1/embeddings", &embeddings("tiny", &long), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("max-embed-tokens"), "{body}");
    assert_eq!(server.metric("llamabox_requests_total{plugin=\"openai\",status=\"400\"}"), 2.0);
    let _ = std::fs::remove_file(config);
}
