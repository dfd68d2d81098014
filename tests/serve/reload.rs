//! Updating plugins without a restart (issue 36): `POST /admin/reload` and SIGHUP build
//! the config again from its file. Requests in flight finish on the plugin they started
//! on, new requests go to the new one, and a reload that fails keeps the old one.
//!
//! The request in flight is held there by the protocol, not by timing: its client reads
//! the first bytes and then nothing while the reload runs, through a 4 KiB receive
//! buffer, and its answer (3,000 tokens streamed, `ignore_eos`) is far larger than what
//! the socket buffers hold, so its run cannot end before the client reads on.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use super::common;
use super::common::serve::*;

const ADMIN_KEY: &str = "reload-admin-key-0123456789";

/// serve.toml: the plugin file `plugin` as `chat` on `route`, the tiny model, and the
/// admin key; a client may leave its answer unread for minutes.
fn write_config(path: &Path, plugin: &Path, route: &str) {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_key = \"{ADMIN_KEY}\"\n[requests]\nwrite_stall_timeout_ms = 300000\n\
         [models]\ntiny = {:?}\n[[plugins]]\nname = \"chat\"\npath = {plugin:?}\nroute = \"{route}\"\n",
        common::tiny_model()
    );
    std::fs::write(path, text).unwrap();
}

/// The openai plugin's bytes plus a custom section `name`: another digest, the same
/// component.
fn plugin_variant(dir: &Path, name: &str) -> PathBuf {
    let mut bytes = std::fs::read(openai_plugin()).unwrap();
    let payload = [&[name.len() as u8][..], name.as_bytes(), b"!"].concat();
    bytes.push(0); // a custom section: id 0, its size, then its name and payload
    bytes.push(payload.len() as u8);
    bytes.extend_from_slice(&payload);
    let path = dir.join(format!("{name}.wasm"));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn sha256_file(path: &Path) -> String {
    use sha2::{Digest as _, Sha256};
    format!("sha256:{:x}", Sha256::digest(std::fs::read(path).unwrap()))
}

fn status(server: &Server, path: &str) -> u16 {
    curl(&[&server.url(path)]).0
}

fn reload(server: &Server, key: Option<&str>) -> (u16, String) {
    let mut args = vec!["-X".to_string(), "POST".into(), server.url("/admin/reload")];
    if let Some(key) = key {
        args.extend(["-H".into(), format!("authorization: Bearer {key}")]);
    }
    curl(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn a_reload_serves_new_requests_from_the_new_plugin_while_one_in_flight_ends_on_the_old() {
    let dir = common::repo_root()
        .join("target/test-reload")
        .join(format!("reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (v1, v2) = (plugin_variant(&dir, "v1"), plugin_variant(&dir, "v2"));
    let config = dir.join("serve.toml");
    write_config(&config, &v1, "/a");
    let mut server = Server::spawn(&["--config".into(), config.display().to_string()]);
    let info = |digest: &str| {
        format!("llamabox_plugin_info{{plugin=\"chat\",digest=\"{digest}\",signer=\"\"}}")
    };
    assert_eq!(server.metric(&info(&sha256_file(&v1))), 1.0);

    // A long answer in flight on v1, its client reading nothing for now.
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 3000,
        "ignore_eos": true,
        "stream": true,
    });
    let localhost = "127.0.0.1".parse().unwrap();
    let mut in_flight =
        post_raw(&server, localhost, "/a/v1/chat/completions", "held", &body, Some(4096));
    let mut head = [0u8; 12];
    in_flight.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    server.wait_metric("llamabox_in_flight", 1.0);

    // The reload is the operator's: no key, no reload.
    write_config(&config, &v2, "/b");
    assert_eq!(reload(&server, None).0, 401);
    assert_eq!(reload(&server, Some("reload-admin-key-wrong-guess")).0, 401);
    assert_eq!(status(&server, "/a/v1/models"), 200, "nothing changed yet");
    let (code, answer) = reload(&server, Some(ADMIN_KEY));
    assert_eq!(code, 200, "{answer}");
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["reloaded"][0]["route"], "/b", "{answer}");
    assert_eq!(answer["reloaded"][0]["digest"], sha256_file(&v2).as_str(), "{answer}");
    assert_eq!(server.metric("llamabox_in_flight"), 1.0, "the old request still runs");
    assert_eq!(status(&server, "/b/v1/models"), 200);
    assert_eq!(status(&server, "/a/v1/models"), 404);
    assert_eq!(server.metric(&info(&sha256_file(&v2))), 1.0);
    assert_eq!(server.metric(&info(&sha256_file(&v1))), 0.0, "only what is served now");

    // The held request ends on v1, whole.
    in_flight.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut rest = Vec::new();
    let mut buf = [0u8; 65536];
    while !String::from_utf8_lossy(&rest[rest.len().saturating_sub(64)..]).contains("0\r\n\r\n") {
        let n = in_flight.read(&mut buf).expect("the held answer goes on to its end");
        assert!(n > 0, "the connection closed before the answer ended");
        rest.extend_from_slice(&buf[..n]);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("data: [DONE]"), "{}", &rest[rest.len().saturating_sub(400)..]);
    assert!(rest.matches("\"content\":").count() > 1000, "a long answer, not a cut one");
    assert!(rest.contains("\"finish_reason\":\"length\""));

    // A reload under load: requests go on through it, on the same route, and none fails.
    write_config(&config, &v1, "/b");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let url = server.url("/b/v1/chat/completions");
    let load: Vec<_> = (0..2)
        .map(|_| {
            let (stop, url) = (stop.clone(), url.clone());
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8});
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || statuses.is_empty() {
                    statuses.push(post_to(&url, &body, &[]).0);
                }
                statuses
            })
        })
        .collect();
    let (code, answer) = reload(&server, Some(ADMIN_KEY));
    assert_eq!(code, 200, "{answer}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses: Vec<u16> = load.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(server.metric(&info(&sha256_file(&v1))), 1.0);
    eprintln!("reload under load: {} requests, all 200", statuses.len());

    // A config that cannot be served is refused whole; the plugin served stays.
    write_config(&config, &dir.join("missing.wasm"), "/c");
    let (code, answer) = reload(&server, Some(ADMIN_KEY));
    assert_eq!(code, 422, "{answer}");
    assert!(answer.contains("reload refused, the old plugins keep serving"), "{answer}");
    assert!(answer.contains("missing.wasm not found"), "{answer}");
    assert_eq!(status(&server, "/b/v1/models"), 200);

    // SIGHUP reloads too.
    write_config(&config, &v1, "/c");
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    let started = Instant::now();
    while status(&server, "/c/v1/models") != 200 {
        assert!(started.elapsed() < Duration::from_secs(120), "{}", server.stdout());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(status(&server, "/b/v1/models"), 404);
    assert!(server.stdout().contains("SIGHUP: reloading the plugins"), "{}", server.stdout());
    assert!(server.terminate().success());
    let _ = std::fs::remove_dir_all(&dir);
}
