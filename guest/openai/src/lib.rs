//! An OpenAI-compatible API for `llamabox serve`: a `wasi:http/incoming-handler`
//! component (world `llamabox:inference/http-plugin`) that the server instantiates
//! afresh for every request, with its route prefix already stripped.
//!
//! Served paths (the wire format of OpenAI's API, as the official clients send and read it):
//! - `GET /`: a chat page (`chat.html`, all inline) whose Stop button closes the
//!   stream, showing the server's figures for the work after Stop.
//! - `GET /v1/models`: the models named in `LLAMABOX_MODELS` (comma-separated).
//! - `POST /v1/chat/completions`: formatted with the model's own chat template
//!   (`generate.apply-chat-template`), streamed (server-sent events) or not.
//! - `POST /v1/completions`: plain-text or token prompts (several in one request),
//!   streamed or not.
//! - Both take `n` choices per prompt (at most 4 in all, one context each, which the
//!   host batches into shared steps) and `logprobs` (the host's, from the model's
//!   distribution before sampling).
//! - `POST /v1/responses`: OpenAI's Responses API, text in and out (`responses`), on
//!   the chat path's core, streamed (its named events) or not.
//! - `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages
//!   API (`messages`), on the same core, with Anthropic's events and error shape.
//! - `GET /v1/models` answers in OpenAI's shape and Anthropic's at once.
//! - `POST /v1/embeddings`: mean-pooled (or the model's own pooling), normalized vectors,
//!   as `float` lists or `base64` (what the Python client asks for by default).
//! - llama-server's `POST /tokenize` (`content`; `add_special` false, `parse_special`
//!   true and `with_pieces` false unless given), `POST /detokenize` (`tokens`) and
//!   `POST /apply-template` (a chat completion's body: the prompt text it starts from).
//!   Their `model` may be left out when the plugin serves one model.
//!
//! Choices:
//! - Generation runs on the host (`generate.start`: the token loop never calls into
//!   the plugin); each piece is written and flushed to the client as it arrives. A
//!   failed write (the client hung up) drops the generation, which cancels it.
//! - Sampling follows OpenAI's defaults: temperature 1 when not given, 0 is greedy.
//!   `presence_penalty`/`frequency_penalty` map to the host's penalties over the last
//!   64 generated tokens; `logit_bias` to its logit bias (-100 bans the token).
//! - Each request gets its own context sized for prompt + max_tokens, capped by the
//!   model's training length and `LLAMABOX_N_CTX` (default 4096). Without `max_tokens`
//!   generation may fill the rest of that context (at most the host's 4096 tokens).
//! - Chat prompts come from the model's own Jinja template (`template`, minijinja in
//!   the sandbox), tools and tool calls included; the answer to a request with tools is
//!   a JSON envelope constrained on the host and read back into `tool_calls` (`tools`).
//! - Chat prompts are the template's text with special tokens parsed, and the messages'
//!   texts tokenized as plain text (a user cannot write `<|im_end|>` into the prompt);
//!   a completion's `prompt` is plain text too (token-id prompts are taken as given).
//! - Request bodies are read up to `LLAMABOX_MAX_BODY_BYTES` (default 1 MiB); larger is 413.
//! - Errors are OpenAI's `{"error":{"message","type","param","code"}}`: 400 for bad
//!   requests (naming the `param`), 404 for unknown paths and models, 405 for a wrong
//!   method, 413 for a body too big, 503 for a host limit on resources (contexts, KV
//!   cells; a text over the host's size caps is 400, and so are embeddings over what one
//!   request may embed: 256 inputs, 8192 tokens, checked before any is computed),
//!   500 for other host failures. After a stream has started, an error is sent as a
//!   last `data: {"error":...}` event.

// What the plugin world has comes from the shared bindings (guest/sdk); the HTTP
// side is generated here, and every request goes to `routes::route`.
llamabox_guest::http_plugin!(path: "../../wit", handler: routes::route);

mod api;
mod completions;
mod handlers;
mod http;
mod messages;
mod responses;
mod routes;
mod sampling;
mod template;
mod tools;
mod vision;

use wasi::http::types::Method;

/// The request's method, as its name.
fn method_name(method: &Method) -> &str {
    match method {
        Method::Get => "GET",
        Method::Head => "HEAD",
        Method::Post => "POST",
        Method::Put => "PUT",
        Method::Delete => "DELETE",
        Method::Connect => "CONNECT",
        Method::Options => "OPTIONS",
        Method::Trace => "TRACE",
        Method::Patch => "PATCH",
        Method::Other(name) => name,
    }
}
