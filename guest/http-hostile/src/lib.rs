//! A hostile `http-plugin`: each path misbehaves one way, so tests/serve.rs can check
//! that the server answers, stops the request's work and keeps serving.
//! - `/trap`: traps before it responds.
//! - `/no-response`: returns without setting a response.
//! - `/spin`: loops forever in wasm before it responds (only the deadline ends it).
//! - `/grow`: allocates until the run's wasm memory limit stops it.
//! - `/endless`: responds 200, then writes to the body forever.
//! - `/decode-forever`: responds 200, decodes on the host until stopped, writing one
//!   line while its first decode is running (a client's hang-up or the deadline must
//!   stop native work in flight).
//! - `/linger`: responds 200 with a whole body, then spins in wasm until the deadline:
//!   the run outlives the response its client has already read.
//! - `/headers`: not hostile: answers with the request's headers, one `name: value` a
//!   line, and the models it may open (what a plugin learns of its tenant).

// What the plugin world has comes from the shared bindings (guest/sdk); the HTTP
// side is generated here.
llamabox_guest::http_plugin!(path: "../../wit", handler: misbehave);

use llamabox_guest::cancel::CancelToken;
use llamabox_guest::llm::{Batch, Context, ContextParams, Model};
use wasi::http::types::{
    Fields, IncomingRequest, OutgoingBody, OutgoingResponse, ResponseOutparam,
};

/// Misbehaves as the request's path says (see the crate's doc).
fn misbehave(request: IncomingRequest, out: ResponseOutparam) {
    match request.path_with_query().unwrap_or_default().as_str() {
        "/trap" => core::arch::wasm32::unreachable(),
        "/no-response" => {}
        "/spin" => {
            let mut n = 0u64;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        "/grow" => {
            let mut held: Vec<Vec<u8>> = Vec::new();
            loop {
                held.push(vec![1; 1 << 20]);
                std::hint::black_box(&held);
            }
        }
        "/endless" => {
            let (stream, body) = start(out);
            while stream.blocking_write_and_flush(b"more\n").is_ok() {}
            // The stream is the body's child: drop it first.
            drop(stream);
            drop(body);
        }
        "/decode-forever" => {
            let (stream, body) = start(out);
            decode_forever(&stream);
            drop(stream);
            drop(body);
        }
        "/linger" => {
            let (stream, body) = start(out);
            let _ = stream.blocking_write_and_flush(b"done\n");
            drop(stream);
            let _ = OutgoingBody::finish(body, None);
            let mut n = 0u64;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        "/headers" => {
            let mut text = String::new();
            for (name, value) in request.headers().entries() {
                text += &format!("{name}: {}\n", String::from_utf8_lossy(&value));
            }
            text += &format!("models: {}\n", std::env::var("LLAMABOX_MODELS").unwrap_or_default());
            let (stream, body) = start(out);
            let _ = stream.blocking_write_and_flush(text.as_bytes());
            drop(stream);
            let _ = OutgoingBody::finish(body, None);
        }
        _ => {
            let (stream, body) = start(out);
            let _ = stream.blocking_write_and_flush(
                b"paths: /trap /no-response /spin /grow /endless /decode-forever /linger /headers\n",
            );
            drop(stream);
            let _ = OutgoingBody::finish(body, None);
        }
    }
}

/// Send 200 and open the body.
fn start(out: ResponseOutparam) -> (wasi::io::streams::OutputStream, OutgoingBody) {
    let response = OutgoingResponse::new(Fields::new());
    let body = response.body().expect("the first call to body");
    ResponseOutparam::set(out, Ok(response));
    let stream = body.write().expect("the first call to write");
    (stream, body)
}

/// Decode a full batch again and again on the first model the server lets us open.
fn decode_forever(stream: &wasi::io::streams::OutputStream) {
    let models = std::env::var("LLAMABOX_MODELS").unwrap_or_default();
    let Some(name) = models.split(',').next() else { return };
    let Ok(model) = Model::open(name) else { return };
    let params = ContextParams {
        n_ctx: Some(512),
        n_batch: Some(512),
        n_ubatch: None,
        n_seq_max: None,
        n_threads: None,
    };
    let Ok(ctx) = Context::create(&model, params) else { return };
    let Ok(cancel) = CancelToken::create() else { return };
    let n = 512;
    let batch = Batch {
        tokens: (0..n).map(|i| i % model.n_vocab() as i32).collect(),
        positions: (0..n).collect(),
        seq_ids: vec![0; n as usize],
        logits: vec![false; n as usize],
    };
    for n in 0u64.. {
        let Ok(pending) = ctx.start_decode(&batch, &cancel) else { return };
        if n == 0 {
            let _ = stream.blocking_write_and_flush(b"decoding\n");
        }
        if pending.finish().is_err() {
            return;
        }
        if ctx.clear().is_err() {
            return;
        }
    }
}
