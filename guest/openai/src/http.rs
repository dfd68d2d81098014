//! `wasi:http` plumbing: the request body (read under a size cap) and the response
//! (JSON in one go, or server-sent events written and flushed one by one).

use crate::api::ApiError;
use crate::wasi::http::types::{
    Fields, IncomingBody, IncomingRequest, OutgoingBody, OutgoingResponse, ResponseOutparam,
};
use crate::wasi::io::streams::{OutputStream, StreamError};

/// Request bodies over this many bytes are refused (413), unless `LLAMABOX_MAX_BODY_BYTES` says otherwise.
const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
/// The most `blocking-write-and-flush` takes at once.
const WRITE_CHUNK: usize = 4096;

/// The body size cap: `LLAMABOX_MAX_BODY_BYTES`, else 1 MiB.
pub fn max_body_bytes() -> u64 {
    std::env::var("LLAMABOX_MAX_BODY_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_BODY_BYTES)
}

/// The whole request body, or 413 as soon as it (or its declared length) passes `cap`.
pub fn read_body(request: &IncomingRequest, cap: u64) -> Result<Vec<u8>, ApiError> {
    let too_large = || ApiError::too_large(cap);
    let headers = request.headers();
    let declared = headers.get("content-length");
    drop(headers);
    for value in declared {
        if std::str::from_utf8(&value)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > cap)
        {
            return Err(too_large());
        }
    }
    let unreadable = || ApiError::server("the request body could not be read");
    let body = request.consume().map_err(|()| unreadable())?;
    let stream = body.stream().map_err(|()| unreadable())?;
    let mut bytes = Vec::new();
    loop {
        match stream.blocking_read(64 * 1024) {
            Ok(chunk) if bytes.len() as u64 + chunk.len() as u64 > cap => return Err(too_large()),
            Ok(chunk) => bytes.extend_from_slice(&chunk),
            Err(StreamError::Closed) => break,
            Err(StreamError::LastOperationFailed(e)) => {
                return Err(ApiError::invalid(
                    format!("reading the request body failed: {}", e.to_debug_string()),
                    None,
                ))
            }
        }
    }
    drop(stream);
    drop(IncomingBody::finish(body));
    Ok(bytes)
}

/// The client went away: a write to the response body failed.
#[derive(Debug)]
pub struct Gone;

/// A response whose status and headers are sent; its body is written piece by piece.
pub struct Body {
    // The stream is the body's child: it must be dropped first (fields drop in order).
    stream: OutputStream,
    body: OutgoingBody,
}

impl Body {
    /// Send the status and headers now; the body follows.
    pub fn start(out: ResponseOutparam, status: u16, content_type: &str) -> Body {
        Body::start_with(out, status, content_type, Vec::new())
    }

    /// [`Body::start`], with `more` headers.
    fn start_with(
        out: ResponseOutparam,
        status: u16,
        content_type: &str,
        more: Vec<(String, Vec<u8>)>,
    ) -> Body {
        let mut headers = vec![("content-type".to_string(), content_type.as_bytes().to_vec())];
        headers.extend(more);
        if content_type == "text/event-stream" {
            headers.push(("cache-control".to_string(), b"no-cache".to_vec()));
        }
        let headers = Fields::from_list(&headers).expect("valid header names and values");
        let response = OutgoingResponse::new(headers);
        response.set_status_code(status).expect("a valid status code");
        let body = response.body().expect("the first call to body");
        ResponseOutparam::set(out, Ok(response));
        let stream = body.write().expect("the first call to write");
        Body { stream, body }
    }

    /// Write and flush `bytes`, in chunks `blocking-write-and-flush` takes.
    pub fn write(&self, bytes: &[u8]) -> Result<(), Gone> {
        for chunk in bytes.chunks(WRITE_CHUNK) {
            self.stream.blocking_write_and_flush(chunk).map_err(|_| Gone)?;
        }
        Ok(())
    }

    /// One server-sent event.
    pub fn event(&self, data: &str) -> Result<(), Gone> {
        self.write(event(data).as_bytes())
    }

    /// Write `last` and end the body at once, with no wait between: the body's end is
    /// out with its last bytes. An SSE client closes as soon as it reads the stream's
    /// last event; the server then finds the body whole, and the run done.
    pub fn finish_with(self, last: &[u8]) -> Result<(), Gone> {
        let mut rest = last;
        while !rest.is_empty() {
            let ready = self.stream.check_write().map_err(|_| Gone)? as usize;
            if ready == 0 {
                self.stream.subscribe().block();
                continue;
            }
            let (now, later) = rest.split_at(ready.min(rest.len()));
            self.stream.write(now).map_err(|_| Gone)?;
            rest = later;
        }
        // Started, not waited for: the end follows at once.
        self.stream.flush().map_err(|_| Gone)?;
        let Body { stream, body } = self;
        drop(stream);
        let _ = OutgoingBody::finish(body, None);
        Ok(())
    }
}

/// What a handler answers: a whole JSON body, a stream, or a page.
pub enum Reply {
    Json(String),
    Stream(Box<dyn Streamed>),
    Page(&'static str),
}

/// An answer written as server-sent events, as it is computed.
pub trait Streamed {
    /// Write the events to `body` (a failed write means the client is gone: stop).
    fn send(self: Box<Self>, body: Body);
}

/// A server-sent event: `data: <data>` and a blank line.
pub fn event(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// A whole JSON response.
pub fn send_json(out: ResponseOutparam, status: u16, json: &str) {
    let _ = Body::start(out, status, "application/json").finish_with(json.as_bytes());
}

/// The header that tells the server why a request was refused, for its log (the
/// server removes it before the client sees the response).
const REASON_HEADER: &str = "llamabox-reason";
/// The longest reason sent.
const MAX_REASON: usize = 300;

/// A whole JSON error response, with its reason for the server's log: the field's path
/// and the message, printable ASCII only.
pub fn send_error(out: ResponseOutparam, e: &ApiError, json: &str) {
    let reason = match &e.param {
        Some(param) => format!("{param}: {}", e.message),
        None => e.message.clone(),
    };
    let reason: Vec<u8> = reason
        .chars()
        .map(|c| if c.is_ascii_graphic() || c == ' ' { c as u8 } else { b'?' })
        .take(MAX_REASON)
        .collect();
    let headers = vec![(REASON_HEADER.to_string(), reason)];
    let body = Body::start_with(out, e.status, "application/json", headers);
    let _ = body.finish_with(json.as_bytes());
}
