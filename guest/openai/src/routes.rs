//! Routing: which endpoint answers a request, and how its answer or error is sent (in
//! the API's own error shape). The one module that knows every API's.

use crate::api::{self, ApiError, Object};
use crate::handlers;
use crate::http::{self, Body, Reply};
use crate::wasi::http::types::{IncomingRequest, Method, ResponseOutparam};

/// `GET /`: a chat page, everything inline (no CDN). Its Stop button closes the stream,
/// and it shows the server's own figures for what happened after (from `/metrics`).
const CHAT_PAGE: &str = include_str!("chat.html");

/// Answer one request.
pub fn route(request: IncomingRequest, out: ResponseOutparam) {
    let full = request.path_with_query().unwrap_or_default();
    let path = full.split('?').next().unwrap_or_default();
    let path = if path.len() > 1 { path.trim_end_matches('/') } else { path };
    match handle(&request, path) {
        Ok(Reply::Json(json)) => http::send_json(out, 200, &json),
        Ok(Reply::Stream(stream)) => stream.send(Body::start(out, 200, "text/event-stream")),
        Ok(Reply::Page(html)) => {
            let _ = Body::start(out, 200, "text/html; charset=utf-8").finish_with(html.as_bytes());
        }
        // Anthropic's API answers errors in its own shape.
        Err(e) if path.trim_start_matches("/v1").starts_with("/messages") => {
            http::send_error(out, &e, &e.to_anthropic_json())
        }
        Err(e) => http::send_error(out, &e, &e.to_json()),
    }
}

fn handle(request: &IncomingRequest, path: &str) -> Result<Reply, ApiError> {
    let method = request.method();
    // `GET /v1/models/{id}` (`client.models.retrieve`).
    let model_id = path.strip_prefix("/v1/models/").or_else(|| path.strip_prefix("/models/"));
    // A stored response (`client.responses.retrieve` / `.delete`): none is kept.
    if let Some(id) = path.trim_start_matches("/v1").strip_prefix("/responses/") {
        return Err(ApiError::not_found(format!(
            "No response '{id}': this server stores no responses (store: false); send the whole history with each request"
        )));
    }
    let (allowed, post) = match path {
        "/" | "" | "/v1/models" | "/models" => (Method::Get, false),
        _ if model_id.is_some() => (Method::Get, false),
        "/v1/chat/completions"
        | "/chat/completions"
        | "/v1/completions"
        | "/completions"
        | "/v1/embeddings"
        | "/embeddings"
        | "/tokenize"
        | "/detokenize"
        | "/apply-template"
        | "/v1/responses"
        | "/responses"
        | "/v1/messages"
        | "/messages"
        | "/v1/messages/count_tokens"
        | "/messages/count_tokens" => (Method::Post, true),
        _ => {
            return Err(ApiError::not_found(format!(
                "Unknown request URL: {} {path}",
                crate::method_name(&method)
            )))
        }
    };
    if std::mem::discriminant(&method) != std::mem::discriminant(&allowed) {
        return Err(ApiError::method_not_allowed(
            crate::method_name(&method),
            path,
            crate::method_name(&allowed),
        ));
    }
    if !post {
        return match (path, model_id) {
            ("/" | "", _) => Ok(Reply::Page(CHAT_PAGE)),
            (_, Some(id)) => handlers::model_card(id).map(|card| Reply::Json(api::to_json(&card))),
            (_, None) => Ok(Reply::Json(handlers::models())),
        };
    }
    let body = Object::parse(&http::read_body(request, http::max_body_bytes())?)?;
    match path.trim_start_matches("/v1") {
        "/chat/completions" => handlers::chat(&body),
        "/completions" => handlers::completion(&body),
        "/tokenize" => handlers::post_tokenize(&body).map(Reply::Json),
        "/detokenize" => handlers::post_detokenize(&body).map(Reply::Json),
        "/apply-template" => handlers::post_apply_template(&body).map(Reply::Json),
        "/responses" => crate::responses::create(&body),
        "/messages" => crate::messages::create(&body),
        "/messages/count_tokens" => crate::messages::count_tokens(&body).map(Reply::Json),
        _ => handlers::embed(&body).map(Reply::Json),
    }
}
