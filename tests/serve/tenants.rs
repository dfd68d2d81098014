//! Tenants from the outside: API keys, what a tenant may reach, its quotas, its own
//! prompt cache, and fair admission against a tenant that floods the queue. Each test
//! starts its own server on loopback and kills it when it ends (common::serve::Server).

use std::io::Write as _;
use std::net::IpAddr;

use serde_json::{json, Value};

use super::common;
use super::common::serve::*;

const KEY_A: &str = "sk-test-alpha-5a1f0c2e9d";
const KEY_B: &str = "sk-test-bravo-77b3e41a08";
const KEY_C: &str = "sk-test-charlie-c0ffee1234";
const METRICS_KEY: &str = "metrics-secret-0123456789";

/// A serve.toml in a temporary file (removed when dropped).
struct ConfigFile(std::path::PathBuf);

impl ConfigFile {
    fn new(name: &str, text: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("llamabox-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        Self(path)
    }

    fn serve(&self) -> Server {
        Server::spawn(&["--config".into(), self.0.display().to_string()])
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `GET path` with `headers`; status and body.
fn get(server: &Server, path: &str, headers: &[&str]) -> (u16, String) {
    let mut args = vec![server.url(path)];
    for header in headers {
        args.extend(["-H".to_string(), header.to_string()]);
    }
    curl(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// The hostile test plugin (its `/headers` path shows what a plugin learns) and the
/// tiny model, served to three tenants: `a` with everything, `b` with one model, `c`
/// with another plugin only.
fn keyed_server(extra: &str) -> (ConfigFile, Server) {
    let config = ConfigFile::new(
        "tenants",
        &format!(
            "listen = \"127.0.0.1:0\"\nthreads = 2\nmetrics_key = {METRICS_KEY:?}\n{extra}\n\
             [models]\ntiny = {:?}\nother = {:?}\n\
             [[plugins]]\nname = \"hostile\"\npath = {:?}\nroute = \"/\"\n\
             [[plugins]]\nname = \"elsewhere\"\npath = {:?}\nroute = \"/elsewhere\"\n\
             [[tenants]]\nname = \"a\"\nkey = {KEY_A:?}\nrequests_per_minute = 5\n\
             [[tenants]]\nname = \"b\"\nkey = {KEY_B:?}\nmodels = [\"other\"]\n\
             [[tenants]]\nname = \"c\"\nkey = {KEY_C:?}\nplugins = [\"elsewhere\"]\n",
            common::tiny_model().display().to_string(),
            common::tiny_mean_pooled_model().display().to_string(),
            common::guest_plugin("llamabox_http_hostile.wasm").display().to_string(),
            common::guest_plugin("llamabox_http_hostile.wasm").display().to_string(),
        ),
    );
    let mut server = config.serve();
    server.metrics_key = Some(METRICS_KEY.into());
    (config, server)
}

#[test]
fn a_key_names_its_tenant_and_the_plugin_learns_the_name_never_the_key() {
    let (_config, server) = keyed_server("");
    // No key, a wrong key, a key without its scheme: 401 in the API's own shape.
    let unscheme = format!("authorization: {KEY_A}");
    for headers in [&[][..], &["authorization: Bearer sk-nobody-0000000000"], &[&unscheme]] {
        let (status, body) = get(&server, "/headers", headers);
        assert_eq!(status, 401, "{headers:?}: {body}");
        let error = json_of(&body);
        assert_eq!(error["error"]["code"], "invalid_api_key", "{body}");
    }
    let (status, body) = get(&server, "/v1/messages", &[]);
    assert_eq!(status, 401);
    let error = json_of(&body);
    assert_eq!(
        (error["type"].as_str(), error["error"]["type"].as_str()),
        (Some("error"), Some("authentication_error")),
        "Anthropic's shape on its path: {body}"
    );

    // Bearer (OpenAI's clients) and x-api-key (Anthropic's) both name a tenant. A
    // client's own tenant header is replaced; no credential reaches the plugin.
    let (status, body) = get(
        &server,
        "/headers",
        &[&format!("authorization: Bearer {KEY_A}"), "x-llamabox-tenant: b"],
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("x-llamabox-tenant: a\n"), "{body}");
    assert!(!body.contains("x-llamabox-tenant: b"), "{body}");
    assert!(!body.contains(KEY_A) && !body.to_lowercase().contains("authorization"), "{body}");
    assert!(body.contains("models: other,tiny\n"), "a has every model: {body}");
    let (status, body) = get(&server, "/headers", &[&format!("x-api-key: {KEY_B}")]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("x-llamabox-tenant: b\n") && !body.contains(KEY_B), "{body}");
    assert!(body.contains("models: other\n"), "b sees only its model: {body}");

    // A tenant may call only its plugins.
    let (status, body) = get(&server, "/headers", &[&format!("x-api-key: {KEY_C}")]);
    assert_eq!(status, 403, "{body}");
    assert_eq!(json_of(&body)["error"]["code"], "permission_denied");
    let (status, body) = get(&server, "/elsewhere/headers", &[&format!("x-api-key: {KEY_C}")]);
    assert_eq!((status, body.contains("x-llamabox-tenant: c\n")), (200, true), "{body}");

    // /metrics is the operator's: behind its own key; tenants' names, never keys.
    assert_eq!(get(&server, "/metrics", &[]).0, 401);
    assert_eq!(get(&server, "/metrics", &[&format!("authorization: Bearer {KEY_A}")]).0, 401);
    let (status, metrics) =
        get(&server, "/metrics", &[&format!("authorization: Bearer {METRICS_KEY}")]);
    assert_eq!(status, 200);
    assert!(metrics.contains("llamabox_tenant_requests_total{tenant=\"a\"} 1"), "{metrics}");
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"hostile\",reason=\"unauthorized\"}"),
        4.0
    );
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"hostile\",reason=\"forbidden\"}"),
        1.0
    );
    for key in [KEY_A, KEY_B, KEY_C, METRICS_KEY] {
        for (what, text) in
            [("metrics", &metrics), ("stdout", &server.stdout()), ("stderr", &server.stderr())]
        {
            assert!(!text.contains(key), "a key in the server's {what}");
        }
    }
    assert!(server.stderr().contains("tenant=a"), "log lines name the tenant");
}

#[test]
fn a_tenant_over_its_quota_gets_429_with_when_to_retry_and_others_are_served() {
    let (_config, server) = keyed_server("");
    let a = format!("authorization: Bearer {KEY_A}");
    // 5 requests a minute: the fifth says 0 remain, the sixth is refused.
    for n in 1..=5 {
        let out = std::process::Command::new("curl")
            .args(["-sS", "-D", "-", "-o", "/dev/null", "-H", &a, &server.url("/headers")])
            .output()
            .unwrap();
        let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("x-ratelimit-limit-requests: 5"), "{head}");
        assert!(
            head.contains(&format!("x-ratelimit-remaining-requests: {}", 5 - n)),
            "{n}: {head}"
        );
    }
    let out = std::process::Command::new("curl")
        .args(["-sS", "-D", "-", "-H", &a, &server.url("/headers")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let head = head.to_lowercase();
    assert!(head.starts_with("http/1.1 429"), "{head}");
    let retry: u64 = head
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .expect("a Retry-After")
        .trim()
        .parse()
        .unwrap();
    assert!((1..=12).contains(&retry), "a request comes back every 12 s: {retry}");
    let error = json_of(body.trim());
    assert_eq!(
        (error["error"]["type"].as_str(), error["error"]["code"].as_str()),
        (Some("requests"), Some("rate_limit_exceeded")),
        "{body}"
    );
    assert_eq!(
        get(&server, "/headers", &[&format!("x-api-key: {KEY_B}")]).0,
        200,
        "b has its own budget"
    );
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"hostile\",reason=\"tenant_quota\"}"),
        1.0
    );
}

/// A chat with a system prompt long enough that reusing it is unmistakable.
fn ask(question: &str) -> Value {
    let system = "You are a helpful assistant who knows a great deal about camelids. You answer every question in one short sentence, and never more than that.";
    json!({"model": "smollm2", "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
}

fn cached_tokens(body: &str) -> u64 {
    json_of(body)["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// Prefix reuse is per tenant: a prompt another tenant sent reads as one nobody sent
/// (`cached_tokens` 0), while its own tenant's next request reuses it. Keyed tenants
/// here; in open mode each client address is a tenant (the second half).
#[test]
fn prompts_are_reused_only_within_their_tenant() {
    let config = ConfigFile::new(
        "tenant-cache",
        &format!(
            "listen = \"127.0.0.1:0\"\nthreads = 2\n[models]\nsmollm2 = {:?}\n\
             [[plugins]]\nname = \"openai\"\npath = {:?}\n\
             [[tenants]]\nname = \"a\"\nkey = {KEY_A:?}\n[[tenants]]\nname = \"b\"\nkey = {KEY_B:?}\n",
            common::real_model().display().to_string(),
            openai_plugin().display().to_string(),
        ),
    );
    let server = config.serve();
    let send = |key: &str, question: &str| {
        let body = post_chat(&server, &ask(question), &["-H", &format!("x-api-key: {key}")]);
        cached_tokens(&body)
    };
    assert_eq!(send(KEY_A, "What do llamas eat?"), 0, "nothing to reuse yet");
    assert_eq!(send(KEY_B, "What do llamas eat?"), 0, "a's prompt reads to b as one nobody sent");
    assert!(send(KEY_A, "Where do alpacas live?") > 20, "a reuses its own system prompt");
    assert!(send(KEY_B, "Where do alpacas live?") > 20, "b reuses its own, and only its own");
    // A cache_salt (vLLM's field) splits a tenant's cache further.
    let salted = |salt: &str, question: &str| {
        let mut body = ask(question);
        body["cache_salt"] = json!(salt);
        let body = post_chat(&server, &body, &["-H", &format!("x-api-key: {KEY_A}")]);
        cached_tokens(&body)
    };
    assert_eq!(salted("s1", "What do llamas eat?"), 0, "another salt: nothing of a's own");
    assert!(salted("s1", "Where do alpacas live?") > 20, "the same salt reuses");
    assert_eq!(salted("s2", "Where do alpacas live?"), 0);
    drop(server);

    let open = Server::start(&[("smollm2", common::real_model())], &["--threads", "2"]);
    let from = |address: &str, question: &str| {
        let body = post_chat(&open, &ask(question), &["--interface", address]);
        cached_tokens(&body)
    };
    assert_eq!(from("127.0.0.1", "What do llamas eat?"), 0);
    assert_eq!(from("127.0.0.2", "What do llamas eat?"), 0, "another address is another tenant");
    assert!(from("127.0.0.1", "Where do alpacas live?") > 20, "the same address reuses");
}

/// With the defaults a new user gets, 16 clients from one address at once (how every
/// load test and SDK batch runs) are all answered, and run at once, sharing steps: one
/// address is a tenant, not a cap of one request, and seats are sized by memory (four
/// fixed seats used to queue twelve of them).
#[test]
fn sixteen_clients_from_one_address_are_all_served_with_the_defaults() {
    let server = Server::start(&[("smollm2", common::real_model())], &[]);
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..16)
            .map(|i| {
                let server = &server;
                s.spawn(move || {
                    let question = format!("Client {i}: name an animal of the Andes.");
                    post(server, "/v1/chat/completions", &chat(&question, 32, false), &[])
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    let steps = server.metric("llamabox_batch_step_seats_count");
    let up_to_four = server.metric("llamabox_batch_step_seats_bucket{le=\"4.0\"}");
    assert!(up_to_four < steps, "no step held more than four requests ({steps} steps)");
    assert_eq!(server.metric("llamabox_refused_total"), 0.0);
}

/// A tenant that floods the queue waits behind another tenant's first request: with
/// its 4 runs holding every seat until their deadline and 16 more queued ahead, the
/// victim is let in when the first run ends. First come first served would put it
/// behind all 16 (4 deadlines more than its queue timeout allows: a 503). The flood's
/// requests over its queue share (16, a quarter of the queue) get 429, its own doing.
#[test]
fn a_flooding_address_waits_behind_another_addresss_first_request() {
    let config = ConfigFile::new(
        "fair",
        &format!(
            "listen = \"127.0.0.1:0\"\nthreads = 2\n[requests]\nqueue_timeout_ms = 5000\n[batch]\nseats = 4\n\
             [models]\nslow = {:?}\n[[plugins]]\nname = \"hostile\"\npath = {:?}\ndeadline_ms = 2000\n",
            common::slow_model().display().to_string(),
            common::guest_plugin("llamabox_http_hostile.wasm").display().to_string(),
        ),
    );
    let server = config.serve();
    let flooder = IpAddr::from([127, 0, 0, 20]);
    let mut flood = Vec::new();
    for i in 0..24 {
        let mut socket = connect_from(flooder, server.addr, None);
        write!(
            socket,
            "GET /decode-forever HTTP/1.1\r\nhost: x\r\nx-request-id: flood-{i}\r\n\r\n"
        )
        .unwrap();
        flood.push(socket);
        if i == 3 {
            // The first four hold every seat (four here) before the rest queue.
            server.wait_metric("llamabox_in_flight", 4.0);
        }
    }
    server.wait_metric("llamabox_refused_total{plugin=\"hostile\",reason=\"tenant_quota\"}", 4.0);
    assert_eq!(server.metric("llamabox_queue_depth"), 16.0);
    let (status, body) = get(&server, "/headers", &[]);
    assert_eq!(status, 200, "the victim was not let in before its queue timeout: {body}");
    assert_eq!(
        server.metric("llamabox_refused_total{plugin=\"hostile\",reason=\"queue_timeout\"}"),
        0.0
    );
    drop(flood);
    server.wait_metric("llamabox_in_flight", 0.0);
    assert_eq!(server.metric("llamabox_live_workers"), 0.0);
}
