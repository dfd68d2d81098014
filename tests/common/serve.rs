//! `llamabox serve` from the outside, shared by tests/serve.rs and its modules
//! (tests/serve/): a server child process on loopback, curl, raw sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Time any one step may take before the test fails (a hung server, not a slow one).
pub const PATIENCE: Duration = Duration::from_secs(120);

pub fn openai_plugin() -> PathBuf {
    super::guest_plugin("llamabox_openai.wasm")
}

/// A `llamabox serve` child process.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    /// The key `/metrics` asks for, if the server has one (`metrics_key`).
    pub metrics_key: Option<String>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    /// Serve the openai plugin with `models`, plus `flags`; returns once it is ready.
    pub fn start(models: &[(&str, &Path)], flags: &[&str]) -> Server {
        let mut args = vec!["--listen".to_string(), "127.0.0.1:0".into(), "--plugin".into()];
        args.push(format!("openai={}", openai_plugin().display()));
        for (name, path) in models {
            args.push("--model".into());
            args.push(format!("{name}={}", path.display()));
        }
        args.extend(flags.iter().map(|f| f.to_string()));
        Server::spawn(&args)
    }

    /// `llamabox serve ARGS` (plus no compile cache); returns once it is ready.
    pub fn spawn(args: &[String]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_llamabox"));
        command.args(["serve", "--no-compile-cache"]).args(args);
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().expect("starting llamabox serve");
        let (stdout, stderr) =
            (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
        // The readers end with the server's pipes; nothing waits for them.
        drop(collect(child.stdout.take().unwrap(), stdout.clone()));
        drop(collect(child.stderr.take().unwrap(), stderr.clone()));
        let mut server = Server {
            child,
            addr: "127.0.0.1:0".parse().unwrap(),
            metrics_key: None,
            stdout,
            stderr,
        };
        server.wait_for_line("ready");
        let out = server.stdout.lock().unwrap().clone();
        let addr = out
            .lines()
            .find_map(|l| l.strip_prefix("listening on http://"))
            .expect("no listening line");
        server.addr = addr.parse().unwrap();
        server
    }

    pub fn wait_for_line(&mut self, line: &str) {
        let started = Instant::now();
        while !self.stdout.lock().unwrap().lines().any(|l| l == line) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the server exited ({status}) before {line:?}:\n{}\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            assert!(
                started.elapsed() < PATIENCE,
                "no {line:?} line from the server:\n{}",
                self.stdout()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The sum of the metric lines named `name` (with labels, if given as `name{..}`).
    pub fn metric(&self, name: &str) -> f64 {
        let auth = self.metrics_key.as_ref().map(|key| format!("authorization: Bearer {key}"));
        let mut args = vec![self.url("/metrics")];
        if let Some(auth) = auth {
            args.extend(["-H".to_string(), auth]);
        }
        let (status, text) = curl(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(status, 200);
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Wait until the metric is `want`.
    pub fn wait_metric(&self, name: &str, want: f64) {
        let started = Instant::now();
        while self.metric(name) != want {
            assert!(
                started.elapsed() < PATIENCE,
                "{name} stayed {} (want {want})",
                self.metric(name)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's `run ended` log line of request `id`, with its fields.
    pub fn run_report(&self, id: &str) -> String {
        let started = Instant::now();
        loop {
            let tag = format!("id={id} ");
            if let Some(line) =
                self.stderr().lines().find(|l| l.contains(&tag) && l.contains("run ended"))
            {
                return line.to_string();
            }
            assert!(started.elapsed() < PATIENCE, "no run report for {id}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn terminate(&mut self) -> ExitStatus {
        let status =
            Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < PATIENCE,
                "the server did not exit after SIGTERM:\n{}",
                self.stdout()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Resident memory, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Copy a child's output into `into` as it comes.
fn collect(
    stream: impl Read + Send + 'static,
    into: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            let mut text = into.lock().unwrap();
            text.push_str(&line);
            text.push('\n');
        }
    })
}

/// curl with `args`; its status code and body.
pub fn curl(args: &[&str]) -> (u16, String) {
    curl_with_input(args, None)
}

/// curl with `args` and `input` on its stdin (for `@-`).
fn curl_with_input(args: &[&str], input: Option<&str>) -> (u16, String) {
    let mut child = Command::new("curl")
        .args(["-sS", "--max-time", "120", "-w", "\n%{http_code}"])
        .args(args)
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running curl");
    if let Some(input) = input {
        // Written from here while curl runs (it reads all of it before it sends).
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().expect("running curl");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, status) = text.rsplit_once('\n').unwrap();
    (status.parse().unwrap_or(0), body.to_string())
}

/// POST `body` as JSON with curl.
pub fn post(server: &Server, path: &str, body: &Value, extra: &[&str]) -> (u16, String) {
    post_to(&server.url(path), body, extra)
}

/// `post`, which must be answered 200: the answer's body.
pub fn post_ok(server: &Server, path: &str, body: &Value, extra: &[&str]) -> String {
    let (status, body) = post(server, path, body, extra);
    assert_eq!(status, 200, "{body}");
    body
}

/// `post_ok` to `/v1/chat/completions`.
pub fn post_chat(server: &Server, body: &Value, extra: &[&str]) -> String {
    post_ok(server, "/v1/chat/completions", body, extra)
}

/// The body goes on curl's stdin: an argument is at most 128 KiB (MAX_ARG_STRLEN).
pub fn post_to(url: &str, body: &Value, extra: &[&str]) -> (u16, String) {
    let mut args = vec!["-H", "content-type: application/json", "--data-binary", "@-", url];
    args.extend_from_slice(extra);
    curl_with_input(&args, Some(&body.to_string()))
}

/// The text of a chat completion, streamed (SSE deltas joined) or not.
pub fn chat_text(response: &str, streamed: bool) -> String {
    if !streamed {
        let v: Value = serde_json::from_str(response).unwrap_or_else(|e| panic!("{e}: {response}"));
        return v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    }
    assert!(
        response.trim_end().ends_with("data: [DONE]"),
        "the stream did not end with [DONE]:\n{response}"
    );
    response
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| {
            serde_json::from_str::<Value>(data).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

pub fn chat(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
           "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// A prompt of about `words` × 2 tokens that no two callers share.
pub fn long_prompt(words: usize, salt: &str) -> String {
    (0..words).map(|i| format!("{salt}{i}")).collect::<Vec<_>>().join(" ")
}

/// A client that sends `body` to `path` as request `id`, reads until the response has
/// `wait_for` in it, then closes its socket: the hang-up.
pub fn hang_up_after(server: &Server, path: &str, id: &str, body: &Value, wait_for: &str) {
    let mut socket = post_raw(server, IpAddr::from([127, 0, 0, 1]), path, id, body, None);
    let seen = read_until(&mut socket, Some(wait_for), PATIENCE);
    assert!(seen.contains(wait_for), "the server closed first: {seen}");
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    drop(socket);
}

/// `key=value` from a log line.
pub fn log_field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line.find(&format!(" {key}=")).unwrap_or_else(|| panic!("no {key} in {line}"))
        + key.len()
        + 2;
    line[start..].split_whitespace().next().unwrap()
}

/// A connection to `to` from `source` (any 127.x.y.z is this machine: tests use them
/// as distinct clients), with a receive buffer of `recv_buffer` bytes if given (a
/// client that stops reading then stops the server's writes sooner).
pub fn connect_from(source: IpAddr, to: SocketAddr, recv_buffer: Option<u32>) -> TcpStream {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_io().build().expect("a tokio runtime");
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        if let Some(size) = recv_buffer {
            socket.set_recv_buffer_size(size).expect("SO_RCVBUF");
        }
        socket.bind(SocketAddr::new(source, 0)).unwrap_or_else(|e| panic!("binding {source}: {e}"));
        let stream =
            socket.connect(to).await.unwrap_or_else(|e| panic!("connecting from {source}: {e}"));
        stream.into_std().expect("a std stream")
    });
    stream.set_nonblocking(false).expect("a blocking stream");
    stream
}

/// Send `POST path` with `body` from `source`, as request `id`.
pub fn post_raw(
    server: &Server,
    source: IpAddr,
    path: &str,
    id: &str,
    body: &Value,
    recv_buffer: Option<u32>,
) -> TcpStream {
    let body = body.to_string();
    let mut socket = connect_from(source, server.addr, recv_buffer);
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nhost: llamabox\r\nx-request-id: {id}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    socket
}

/// What `socket` reads until its text has `until` in it (`None`: until the server
/// closes), within `patience`. Panics if it takes longer.
pub fn read_until(socket: &mut TcpStream, until: Option<&str>, patience: Duration) -> String {
    let started = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&seen).to_string();
        if until.is_some_and(|u| text.contains(u)) {
            return text;
        }
        let left = patience
            .checked_sub(started.elapsed())
            .unwrap_or_else(|| panic!("nothing more within {patience:?}: {text}"));
        socket.set_read_timeout(Some(left.max(Duration::from_millis(1)))).unwrap();
        match socket.read(&mut buf) {
            Ok(0) => return text,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("nothing more within {patience:?}: {text}")
            }
            // A reset after the answer (the server closed with unread bytes).
            Err(_) => return text,
        }
    }
}

/// Install npm package `name@version` (a client CLI) into the toolchain cache once
/// (scripts/npm-tool.sh) and return its folder.
pub fn npm_tool(name: &str, version: &str) -> PathBuf {
    crate::common::script_path("npm-tool.sh", &[name, version])
}

/// What a bounded run of a client program gave: its status (`None` if it ran past its
/// limit and was killed), stdout and stderr.
pub struct Ran {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

/// Run `command` (a client such as Claude Code or Codex) in a process group of its own,
/// for at most `limit`: past it, the whole group is killed, so nothing it started is
/// left running even when the test then fails.
pub fn run_bounded(command: &mut Command, limit: Duration) -> Ran {
    use std::os::unix::process::CommandExt;
    let mut child = command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting a client");
    let (stdout, stderr) =
        (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
    let readers = [
        collect(child.stdout.take().unwrap(), stdout.clone()),
        collect(child.stderr.take().unwrap(), stderr.clone()),
    ];
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The group too (its leader's id is the group's): whatever the client started.
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
    let _ = child.wait();
    for reader in readers {
        let _ = reader.join();
    }
    let text = |s: &Arc<Mutex<String>>| s.lock().unwrap().clone();
    Ran { status, stdout: text(&stdout), stderr: text(&stderr) }
}
