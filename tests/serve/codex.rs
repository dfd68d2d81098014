//! Codex CLI (npm `@openai/codex`) against `llamabox serve`'s `/v1/responses`.
//!
//! Codex speaks only the Responses API, streamed, with `store: false` and the whole
//! history in every request, beside fields and tools this server does not run
//! (`reasoning`, `include`, `client_metadata`, a `namespace` of functions, the hosted
//! `web_search`). The model is tiny and Codex sends no `temperature`, so what it
//! would do with its tools is chance; a recording proxy between Codex and the server
//! makes the turns deterministic by setting two documented fields and nothing else:
//! `temperature: 0`, and `tool_choice` — on the first request a named function
//! (`view_image`, which only reads a file), on later ones `"none"` — and a `maxLength`
//! on that call's `path`. So Codex must read
//! the server's streamed `function_call`, run its own tool, send the call and its
//! output back in the history, and print the server's final answer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{self, serve::*};

/// Codex, as npm serves it; its native binary comes in the platform's package.
const CODEX: (&str, &str) = ("@openai/codex", "0.171.0");

/// Longest a whole `codex exec` run may take (a few requests on 2 cores).
const CODEX_PATIENCE: Duration = Duration::from_secs(540);

/// One request through the proxy: Codex's body as sent, the body forwarded, and the
/// server's raw HTTP response.
pub(crate) struct Exchange {
    pub(crate) sent: Value,
    pub(crate) forwarded: Value,
    pub(crate) response: String,
}

/// How the proxy changes a request's JSON body before forwarding it; `first` is true
/// for the client's first request.
pub(crate) type Rewrite = fn(first: bool, fields: &mut serde_json::Map<String, Value>);

/// A proxy on loopback in front of `upstream` (its base URL is returned): each JSON
/// request is changed by `rewrite` (for determinism: see the module's text), and
/// everything is recorded.
pub(crate) fn start_proxy(
    upstream: std::net::SocketAddr,
    rewrite: Rewrite,
) -> (String, Arc<Mutex<Vec<Exchange>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let shared = log.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().map_while(Result::ok) {
            let log = shared.clone();
            std::thread::spawn(move || relay(client, upstream, rewrite, &log));
        }
    });
    (url, log)
}

/// One request from `client` to `upstream` (`connection: close` on both sides).
fn relay(
    mut client: TcpStream,
    upstream: std::net::SocketAddr,
    rewrite: Rewrite,
    log: &Mutex<Vec<Exchange>>,
) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    let head_end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match client.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    let request_line = head.lines().next().unwrap_or_default().to_string();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while raw.len() < head_end + length {
        match client.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let body = &raw[head_end..head_end + length];
    let (path, sent) = (request_line.split(' ').nth(1).unwrap_or("/").to_string(), body);
    let sent: Value = serde_json::from_slice(sent).unwrap_or(Value::Null);
    let mut forwarded = sent.clone();
    if let Value::Object(fields) = &mut forwarded {
        let first = !log.lock().unwrap().iter().any(|e| e.sent["model"].is_string());
        rewrite(first, fields);
    }
    let method = request_line.split(' ').next().unwrap_or("GET");
    let body = if forwarded.is_null() { Vec::new() } else { forwarded.to_string().into_bytes() };
    let mut server = TcpStream::connect(upstream).unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {upstream}\r\nconnection: close\r\naccept: text/event-stream\r\n"
    );
    if method == "POST" {
        request += &format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len());
    }
    server.write_all(request.as_bytes()).unwrap();
    server.write_all(b"\r\n").unwrap();
    server.write_all(&body).unwrap();
    // The answer goes back as it comes (a stream stays a stream), and is kept.
    let mut response = Vec::new();
    loop {
        match server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                response.extend_from_slice(&buf[..n]);
                if client.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let response = dechunked(&String::from_utf8_lossy(&response));
    log.lock().unwrap().push(Exchange { sent, forwarded, response });
}

/// A raw HTTP/1.1 response with its body out of chunked framing, if it had that.
fn dechunked(raw: &str) -> String {
    let Some((head, mut rest)) = raw.split_once("\r\n\r\n") else { return raw.to_string() };
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return raw.to_string();
    }
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].strip_prefix("\r\n").unwrap_or(&after[size..]);
    }
    format!("{head}\r\n\r\n{body}")
}

/// The `response` of a streamed answer's last event (`response.completed`).
fn completed(raw: &str) -> Value {
    let data = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|d| d["type"] == "response.completed")
        .unwrap_or_else(|| panic!("no response.completed event in:\n{raw}"));
    data["response"].clone()
}

/// A child in a process group of its own, killed with all of it when dropped, and
/// with anything else that still carries its `CODEX_HOME` (a process that left the
/// group keeps its environment).
struct Group {
    child: Child,
    /// `CODEX_HOME=...`, as it appears in /proc/PID/environ.
    mark: Vec<u8>,
}

impl Group {
    /// The live processes (zombies aside) in its group or with its mark.
    fn left(&self) -> Vec<(u32, String)> {
        let pgid = self.child.id();
        let mut left = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().map_while(Result::ok) {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            // pid (comm) state ppid pgrp ...: read after the command's closing paren.
            let fields: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, r)| r.split_whitespace().collect())
                .unwrap_or_default();
            if fields.first() == Some(&"Z") || pid == std::process::id() {
                continue;
            }
            let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            let marked = environ.split(|b| *b == 0).any(|var| var == self.mark.as_slice());
            if marked || fields.get(2) == Some(&pgid.to_string().as_str()) {
                let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                left.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
            }
        }
        left
    }

    fn kill(&mut self) {
        let pgid = self.child.id();
        let group = format!("-{pgid}");
        let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
        let _ = self.child.wait();
        for (pid, _) in self.left() {
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `codex exec PROMPT` at `base_url` with model `smollm2`, bounded in time; its exit
/// status, stdout and stderr. Nothing it started is left running.
fn codex_exec(codex: &Path, base_url: &str, prompt: &str) -> (bool, String, String) {
    // Under target/, not /tmp: Codex refuses to put its helpers under a temporary folder.
    let scratch = common::repo_root().join(format!("target/test-codex/{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (home, work) = (scratch.join("codex-home"), scratch.join("work"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    // Codex's own system prompt (~20 KB) gives way to a short one, so that each request
    // fits the default 4096-token contexts and is computed in seconds: the request's
    // shape (fields, tools, history) is Codex's own.
    let instructions = scratch.join("instructions.md");
    std::fs::write(&instructions, "You are a coding agent. Answer briefly.\n").unwrap();
    let provider = format!(
        "model_providers.local={{name=\"local\",base_url=\"{base_url}\",wire_api=\"responses\",env_key=\"OPENAI_API_KEY\"}}"
    );
    let (stdout, stderr) = (scratch.join("stdout"), scratch.join("stderr"));
    let mut command = Command::new(codex);
    command
        .args(["exec", "--skip-git-repo-check", "-c", "model_provider=local", "-c", &provider])
        .arg("-c")
        .arg(format!("model_instructions_file=\"{}\"", instructions.display()))
        .args(["-m", "smollm2", prompt])
        .current_dir(&work)
        .env("CODEX_HOME", &home)
        .env("HOME", &scratch)
        .env("OPENAI_API_KEY", "anything")
        .env_remove("OPENAI_BASE_URL")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap());
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mark = format!("CODEX_HOME={}", home.display()).into_bytes();
    let mut group = Group { child: command.spawn().expect("starting codex"), mark };
    let started = Instant::now();
    let status = loop {
        if let Some(status) = group.child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > CODEX_PATIENCE {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Whatever it left goes with it, then nothing may be left.
    group.kill();
    let left = group.left();
    let (stdout, stderr) =
        (std::fs::read_to_string(stdout).unwrap(), std::fs::read_to_string(stderr).unwrap());
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(left.is_empty(), "codex left processes running: {left:?}");
    let status = status.unwrap_or_else(|| {
        panic!("codex ran past {CODEX_PATIENCE:?} and was killed:\n{stdout}\n{stderr}")
    });
    (status.success(), stdout, stderr)
}

/// Greedy, a forced `view_image` call first and `"none"` after; the call's `path` is
/// held to 64 characters, so that a greedy string cannot run on to max_tokens (it did,
/// to 3,569 characters, for one working directory's prompt).
fn codex_rewrite(first: bool, fields: &mut serde_json::Map<String, Value>) {
    let choice =
        if first { json!({"type": "function", "name": "view_image"}) } else { json!("none") };
    fields.insert("tool_choice".into(), choice);
    fields.insert("temperature".into(), json!(0));
    for tool in fields.get_mut("tools").and_then(Value::as_array_mut).into_iter().flatten() {
        if tool["name"] == "view_image" {
            if let Some(path) = tool.pointer_mut("/parameters/properties/path") {
                path["maxLength"] = json!(64);
            }
        }
    }
}

/// Codex installs from npm (once, into the toolchain cache), reaches the server through
/// the recording proxy, makes the tool call the server streams to it, sends the whole
/// history back (`store: false`), and prints the server's answer; every request it
/// made was a 200.
#[test]
fn codex_exec_runs_a_tool_and_answers_through_responses() {
    let codex = npm_tool(CODEX.0, CODEX.1).join("node_modules/.bin/codex");
    let server = Server::start(
        &[("smollm2", common::real_model())],
        &["--threads", "2", "--deadline-ms", "400000"],
    );
    let (base_url, log) = start_proxy(server.addr, codex_rewrite);
    let base_url = format!("{base_url}/v1");
    let (ok, stdout, stderr) = codex_exec(&codex, &base_url, "Look at the picture, then say hi.");
    println!("codex's stdout:\n{stdout}\ncodex's stderr:\n{stderr}");
    let all = log.lock().unwrap();
    for (i, e) in all.iter().enumerate() {
        println!("request {i}: {}", e.response.lines().next().unwrap_or_default());
    }
    assert!(ok, "codex failed");

    // Its requests to /v1/responses (any other would be counted below too).
    let log: Vec<&Exchange> = all.iter().filter(|e| e.sent.is_object()).collect();

    // What Codex sends: the fields and tools this server accepts or skips.
    let first = &log.first().expect("no request from codex").sent;
    assert_eq!(first["stream"], true, "{first}");
    assert_eq!(first["store"], false, "{first}");
    assert!(first["reasoning"].is_object() && first["include"].is_array(), "{first}");
    let kinds: Vec<&str> =
        first["tools"].as_array().unwrap().iter().filter_map(|t| t["type"].as_str()).collect();
    assert!(kinds.contains(&"function") && kinds.iter().any(|k| *k != "function"), "{kinds:?}");

    // Every request was a 200 from the plugin, and only those were made.
    let n = log.len();
    assert!(n >= 2, "codex made {n} request(s), not a call and its answer");
    for e in all.iter() {
        assert!(e.response.starts_with("HTTP/1.1 200"), "{}", e.response);
    }
    let ok_requests = server.metric("llamabox_requests_total{plugin=\"openai\",status=\"200\"}");
    assert_eq!(ok_requests, all.len() as f64);
    assert_eq!(server.metric("llamabox_requests_total"), all.len() as f64, "some were not 200");

    // The first answer is the forced call; Codex ran it and sent the call and its output
    // back, with the whole history (nothing is stored here).
    let call = completed(&log[0].response)["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "function_call")
        .cloned()
        .expect("the first answer calls a function");
    assert_eq!(call["name"], "view_image");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["path"].is_string(), "{arguments}");
    let history = log[1].sent["input"].as_array().unwrap();
    assert_eq!(log[1].sent["store"], false);
    assert!(history.len() > 2, "the whole history is sent: {history:?}");
    let sent_call = history.iter().find(|i| i["type"] == "function_call").expect("the call");
    assert_eq!((&sent_call["call_id"], &sent_call["name"]), (&call["call_id"], &call["name"]));
    let output = history.iter().find(|i| i["type"] == "function_call_output").expect("its output");
    assert_eq!(output["call_id"], call["call_id"]);
    assert!(log[1].forwarded["tool_choice"] == "none");

    // Codex printed the server's last answer.
    let last = completed(&log[n - 1].response);
    let answer: String = last["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .filter_map(|part| part["text"].as_str())
        .collect();
    assert!(!answer.trim().is_empty(), "the last answer has no text: {last}");
    assert!(stdout.contains(answer.trim()), "codex did not print {answer:?}:\n{stdout}");
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}
