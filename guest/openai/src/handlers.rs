//! The endpoints (routed by `routes`): their request checks, the chat core that the
//! Responses and Messages APIs are mapped onto, and generation on the host.

use crate::api::{self, ApiError, Message, Object};
use crate::api::{new_id, now};
use crate::completions::{Choices, Format, MediaPart, MediaPrompt, Prompt};
use crate::http::Reply;
use crate::sampling::{checked_tokens, Constraint, Sampling, MAX_TEXT_LOGPROBS, MAX_TOP_LOGPROBS};
use crate::template::{self, Span, ToolCall, Turn};
use crate::tools::{self, Tools};
use crate::vision;
use llamabox_guest::cancel::CancelToken;
use llamabox_guest::embeddings::{self, Pooling};
use llamabox_guest::llm::{Context, ContextParams, Model};
use llamabox_guest::media::{ChunkKind, Input, MediaContext};
use llamabox_guest::types::Error as HostError;

/// Longest embedding input, in tokens (the host's default `max-n-batch`).
const MAX_EMBED_TOKENS: u32 = 2048;
/// What one request may embed: the host's default `max-embed-inputs` and
/// `max-embed-tokens` (per run, which is per request here). Checked here first, so that
/// a request over them is refused before any of it is computed; the host refuses only
/// the call that would go over, after the ones before it ran.
const MAX_EMBED_INPUTS: usize = 256;
const MAX_EMBED_TOTAL_TOKENS: usize = 8192;

/// The names in `LLAMABOX_MODELS`.
fn model_names() -> Vec<String> {
    let list = std::env::var("LLAMABOX_MODELS").unwrap_or_default();
    list.split(',').map(str::trim).filter(|name| !name.is_empty()).map(String::from).collect()
}

/// Open the request's `model`, if it is one this plugin may use.
fn open_model(body: &Object) -> Result<(String, Model), ApiError> {
    let name: String = body.require("model")?;
    if !model_names().contains(&name) {
        return Err(ApiError::model_not_found(&name));
    }
    let model = Model::open(&name)?;
    Ok((name, model))
}

/// The request's `model`, which llama-server's own endpoints (`/tokenize`, ...) may
/// leave out, as their clients do, when this plugin serves one model.
fn open_model_or_only(body: &Object) -> Result<(String, Model), ApiError> {
    match (body.get::<String>("model")?, model_names().as_slice()) {
        (None, [only]) => Ok((only.clone(), Model::open(only)?)),
        _ => open_model(body),
    }
}

pub(crate) fn models() -> String {
    let data: Vec<api::ModelCard> = model_names().into_iter().map(card).collect();
    let first_id = data.first().map(|card| card.id.clone());
    let last_id = data.last().map(|card| card.id.clone());
    api::to_json(&api::ModelList { object: "list", data, has_more: false, first_id, last_id })
}

/// One served model's card; `created` is when the server loaded its models
/// (`LLAMABOX_MODELS_LOADED_AT`, Unix seconds; 0 outside `llamabox serve`).
fn card(id: String) -> api::ModelCard {
    let created =
        std::env::var("LLAMABOX_MODELS_LOADED_AT").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let created_at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(created);
    api::ModelCard {
        display_name: id.clone(),
        id,
        object: "model",
        created,
        owned_by: "llamabox",
        kind: "model",
        created_at: humantime::format_rfc3339_seconds(created_at).to_string(),
    }
}

/// The card of model `id`, if this plugin serves it.
pub(crate) fn model_card(id: &str) -> Result<api::ModelCard, ApiError> {
    match model_names().into_iter().find(|name| name == id) {
        Some(name) => Ok(card(name)),
        None => Err(ApiError::model_not_found(id)),
    }
}

/// `POST /v1/chat/completions`.
pub(crate) fn chat(body: &Object) -> Result<Reply, ApiError> {
    let format =
        Format { chat: true, id: new_id("chatcmpl"), created: now(), model: String::new() };
    chat_choices(body, format)?.finish()
}

/// A chat body's runs, started (`format.model` is set to the request's model): what
/// `POST /v1/chat/completions` and `POST /v1/responses` (mapped onto a chat body) share.
pub(crate) fn chat_choices(body: &Object, mut format: Format) -> Result<Choices, ApiError> {
    let (sampling, name, model, prompt) = chat_request(body)?;
    format.model = name;
    Choices::start(model, &[prompt], &sampling, "messages", format)
}

/// How many tokens a chat body's prompt has (tools and images included), computed as
/// [`chat_choices`] would, without running it: `POST /v1/messages/count_tokens`.
pub(crate) fn chat_prompt_tokens(body: &Object) -> Result<u32, ApiError> {
    Ok(chat_request(body)?.3.n_tokens())
}

/// A chat body's sampling, model and prompt: everything before its runs start.
fn chat_request(body: &Object) -> Result<(Sampling, String, Model, Prompt), ApiError> {
    let mut sampling = chat_sampling(body)?;
    let mut tools = Tools::read(body)?;
    if let Some(tools) = &mut tools {
        // With a response_format (or llama-server's json_schema), the answer is a call
        // or, under `auto`, a JSON value following that schema, as OpenAI serves it.
        let response = match &sampling.constraint {
            Constraint::None => None,
            Constraint::JsonSchema(text) => {
                Some(serde_json::from_str::<serde_json::Value>(text).expect("written from a Value"))
            }
            Constraint::Grammar(_) => {
                let message = "Use either 'tools' or 'grammar': a GBNF grammar cannot be combined with tool calls";
                return Err(ApiError::invalid(message, Some("grammar")));
            }
        };
        sampling.json_response = response.is_some();
        if sampling.json_response {
            tools.answer_in_json();
        }
        sampling.constraint = Constraint::JsonSchema(tools.schema(response.as_ref()).to_string());
        sampling.constraint_param = "tools";
        sampling.tool_calls = true;
        sampling.forced_call = tools.forced();
    }
    let (turns, images) = chat_messages(body)?;
    let (name, model) = open_model(body)?;
    let rendered = chat_prompt(&model, &turns, tools.as_ref())?;
    if tools.is_none() && rendered.calls_as_json && matches!(sampling.constraint, Constraint::None)
    {
        // The prompt shows earlier calls as the envelope's JSON, and no tool may be
        // called now (none offered, or `tool_choice` "none"): the answer is held to the
        // envelope's text, `{"response":"…"}`, which the reader unwraps, so that it is
        // text and never a call's JSON the model learnt from the history.
        sampling.constraint = Constraint::JsonSchema(tools::RESPONSE_ONLY.to_string());
        sampling.constraint_param = "messages";
        sampling.tool_calls = true;
    }
    let spans = prompt_spans(&model, &rendered)?;
    let prompt = if images.is_empty() {
        Prompt::Tokens(chat_tokens(&model, &rendered.text, &spans)?)
    } else {
        media_prompt(&name, &model, &rendered.text, &spans, images)?
    };
    Ok((sampling, name, model, prompt))
}

/// A chat body's fields beside `messages`: the shared ones, and chat's log-probabilities
/// (`logprobs` true, then `top_logprobs` alternatives, OpenAI's 0 to 20).
fn chat_sampling(body: &Object) -> Result<Sampling, ApiError> {
    let mut sampling = Sampling::read(
        body,
        &["messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"],
    )?;
    let top: Option<u32> = body.get("top_logprobs")?;
    if let Some(n) = top.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid(
            format!("'top_logprobs' {n} must be between 0 and {MAX_TOP_LOGPROBS}"),
            Some("top_logprobs"),
        ));
    }
    sampling.logprobs = match (body.get::<bool>("logprobs")?.unwrap_or(false), top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "'top_logprobs' needs 'logprobs' set to true",
                Some("top_logprobs"),
            ))
        }
        (false, None) => None,
    };
    Ok(sampling)
}

/// A chat request's `messages`, as the chat template takes them, and the images in
/// them (each a marker in its message's text).
fn chat_messages(body: &Object) -> Result<(Vec<Turn>, Vec<Input>), ApiError> {
    let messages: Vec<serde_json::Value> = body.require("messages")?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "'messages' must contain at least one message",
            Some("messages"),
        ));
    }
    let mut inputs = Inputs::default();
    let turns = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| chat_turn(i, Message::read(m, i)?, &mut inputs))
        .collect::<Result<Vec<_>, _>>()?;
    // Beside images, text that spells their marker would take an image's place.
    if let (false, Some(param)) = (inputs.images.is_empty(), inputs.marker_text) {
        let message =
            format!("Text that spells the image marker '{}' cannot go with images", vision::MARKER);
        return Err(ApiError::invalid(message, Some(&param)));
    }
    Ok((turns, inputs.images))
}

/// What a request's messages hold beside their texts: their images (each a marker in
/// its message's text), and the first text that spells the marker itself, if any.
#[derive(Default)]
struct Inputs {
    images: Vec<Input>,
    marker_text: Option<String>,
}

/// `turns` formatted with `model`'s own chat template (and `tools`, when the model may
/// call them), ending with the opening of the assistant's turn: a chat completion's
/// prompt text, and where the texts the client wrote are in it.
///
/// Message text is never parsed for special tokens (SECURITY.md), on every path: plain
/// chat, images, tools and the polyfills. A turn's text (its `content`, what the
/// polyfills wrote into it included) is tokenized as plain text wherever the prompt
/// can be cut provably into the template's pieces and the texts ([`template::split`]);
/// where it cannot, a text that spells a special token is refused (see
/// [`prompt_spans`]). Every other string of the request that the template writes where
/// it likes, among its own text (`tools`, a message's `name` and `tool_call_id`, its
/// calls' ids, names and arguments), is refused with a 400 naming its field if it
/// spells a special token.
fn chat_prompt(
    model: &Model,
    turns: &[Turn],
    tools: Option<&Tools>,
) -> Result<template::Rendered, ApiError> {
    if let Some(tools) = tools {
        no_special_text(model, &tools.listed().to_string(), "tools")?;
    }
    let fields = template_fields(turns);
    // One check of them all together; only if that finds something, one by one to name it.
    let all: Vec<&str> = fields.iter().map(|(_, text)| text.as_str()).collect();
    if no_special_text(model, &all.join("\n"), "messages").is_err() {
        for (param, text) in &fields {
            no_special_text(model, text, param)?;
        }
    }
    let instruction = tools.map(Tools::instruction);
    template::chat_prompt(model, turns, tools.map(Tools::listed), instruction.as_deref())
        .map_err(|e| too_long(e, "messages"))
}

/// The strings of `turns` beside their texts that a template may write among its own
/// text, with their fields' paths.
fn template_fields(turns: &[Turn]) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    for (t, turn) in turns.iter().enumerate() {
        let i = turn.source.unwrap_or(t);
        if let Some(name) = &turn.name {
            fields.push((format!("messages[{i}].name"), name.clone()));
        }
        if let Some(id) = &turn.tool_call_id {
            fields.push((format!("messages[{i}].tool_call_id"), id.clone()));
        }
        for (j, call) in turn.tool_calls.iter().enumerate() {
            let at = format!("messages[{i}].tool_calls[{j}]");
            fields.push((format!("{at}.id"), call.id.clone()));
            fields.push((format!("{at}.function.name"), call.name.clone()));
            let arguments = match &call.arguments {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            fields.push((format!("{at}.function.arguments"), arguments));
        }
    }
    fields.retain(|(_, text)| !text.is_empty());
    fields
}

/// Where the messages' texts are in `rendered`: the proven cut, or, for a template that
/// rewrites texts so that none can be proven, the texts where they are found, after
/// refusing any text that spells a special token (the one rule either way: a message's
/// text never becomes a special token).
fn prompt_spans(model: &Model, rendered: &template::Rendered) -> Result<Vec<Span>, ApiError> {
    if let Some(spans) = &rendered.spans {
        return Ok(spans.clone());
    }
    for (source, text) in &rendered.texts {
        let param = source.map_or("tools".to_string(), |i| format!("messages[{i}].content"));
        no_special_text(model, text, &param)?;
    }
    let texts: Vec<String> = rendered.texts.iter().map(|(_, t)| t.clone()).collect();
    Ok(template::locate(&rendered.text, &texts))
}

/// Bytes of text checked for special tokens at a time: llama.cpp's special-token split
/// is quadratic in the text's length (and the host caps it, `max-special-text-bytes`),
/// so a long text is checked in windows that overlap by more than any special token's
/// text, which each occurrence therefore lies whole within.
const SPECIAL_WINDOW: usize = 4096;
const SPECIAL_OVERLAP: usize = 256;

/// A 400 naming `param` if `text` spells a special token: it is tokenized with and
/// without special parsing (window by window, [`windows`]), which differ exactly then.
fn no_special_text(model: &Model, text: &str, param: &str) -> Result<(), ApiError> {
    if spells_special(model, text, param)? {
        return Err(ApiError::invalid(
            format!("'{param}' contains a special token's text"),
            Some(param),
        ));
    }
    Ok(())
}

/// Whether `text` spells a special token ([`no_special_text`]).
fn spells_special(model: &Model, text: &str, param: &str) -> Result<bool, ApiError> {
    for window in windows(text, SPECIAL_WINDOW, SPECIAL_OVERLAP) {
        let parsed = tokenize(model, window, false, true, param)?;
        if parsed != tokenize(model, window, false, false, param)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `text` in windows of at most `size` bytes (cut at character boundaries), each
/// starting `overlap` bytes or less before the last one ended: any piece of at most
/// `overlap` bytes lies whole within one of them.
fn windows(text: &str, size: usize, overlap: usize) -> Vec<&str> {
    let floor = |mut at: usize| {
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    let mut out = Vec::new();
    let mut start = 0;
    loop {
        let end = floor((start + size).min(text.len()));
        out.push(&text[start..end]);
        if end == text.len() {
            return out;
        }
        // At least one character on, at most `overlap` bytes back.
        let back = floor(end.saturating_sub(overlap));
        start = if back > start { back } else { end };
    }
}

/// `POST /apply-template` (llama-server's): the prompt text a chat completion of the
/// same body starts from, its fields checked as there; images stand as their marker.
pub(crate) fn post_apply_template(body: &Object) -> Result<String, ApiError> {
    chat_sampling(body)?;
    let tools = Tools::read(body)?;
    let (turns, _images) = chat_messages(body)?;
    let (_, model) = open_model_or_only(body)?;
    let prompt = chat_prompt(&model, &turns, tools.as_ref())?.text;
    Ok(api::to_json(&api::TemplatedPrompt { prompt }))
}

/// `POST /tokenize` (llama-server's): `content` as token ids, with each one's piece
/// if `with_pieces`. Special-token text is parsed unless `parse_special` is false.
pub(crate) fn post_tokenize(body: &Object) -> Result<String, ApiError> {
    body.refuse_unknown(&["model", "content", "add_special", "parse_special", "with_pieces"])?;
    let content: String = body.require("content")?;
    // llama-server's defaults.
    let add_special = body.get("add_special")?.unwrap_or(false);
    let parse_special = body.get("parse_special")?.unwrap_or(true);
    let with_pieces = body.get("with_pieces")?.unwrap_or(false);
    let (_, model) = open_model_or_only(body)?;
    let tokens = tokenize(&model, &content, add_special, parse_special, "content")?;
    if !with_pieces {
        return Ok(api::to_json(&api::Tokens { tokens }));
    }
    let pieces = tokens
        .into_iter()
        .map(|id| Ok(api::TokenPiece { id, piece: model.token_to_piece(id, true)?.into() }));
    Ok(api::to_json(&api::Tokens { tokens: pieces.collect::<Result<Vec<_>, ApiError>>()? }))
}

/// `POST /detokenize` (llama-server's): `tokens` as text, special tokens as theirs.
pub(crate) fn post_detokenize(body: &Object) -> Result<String, ApiError> {
    body.refuse_unknown(&["model", "tokens"])?;
    let tokens: Vec<i32> = body.require("tokens")?;
    let (_, model) = open_model_or_only(body)?;
    let tokens = checked_tokens(&model, tokens, "tokens")?;
    let content = model.detokenize(&tokens, false, true).map_err(|e| too_long(e, "tokens"))?;
    Ok(api::to_json(&api::Detokenized { content }))
}

/// The templated prompt's tokens: the template's pieces parsed for special tokens
/// (`<|im_start|>`, ...), the messages' texts not (a user cannot write a special
/// token, and long texts escape the host's cap on special parsing).
fn chat_tokens(model: &Model, prompt: &str, spans: &[Span]) -> Result<Vec<i32>, ApiError> {
    let mut tokens = Vec::new();
    for span in spans {
        let text = &prompt[span.start..span.end];
        tokens.extend(tokenize(model, text, tokens.is_empty(), !span.message, "messages")?);
    }
    if tokens.is_empty() {
        tokens = tokenize(model, "", true, true, "messages")?;
    }
    Ok(tokens)
}

/// `model.tokenize`, with a text over the host's size caps answered as 400 naming `param`.
fn tokenize(
    model: &Model,
    text: &str,
    add_special: bool,
    parse_special: bool,
    param: &str,
) -> Result<Vec<i32>, ApiError> {
    if text.is_empty() && !add_special {
        return Ok(Vec::new());
    }
    model.tokenize(text, add_special, parse_special).map_err(|e| too_long(e, param))
}

/// `inputs` as token lists, one per input; `param` names them in errors. Texts are
/// plain, as OpenAI reads them: special-token text is not parsed (send token ids for that).
fn token_lists(model: &Model, inputs: api::Inputs, param: &str) -> Result<Vec<Vec<i32>>, ApiError> {
    match inputs {
        api::Inputs::Text(text) => Ok(vec![tokenize(model, &text, true, false, param)?]),
        api::Inputs::Texts(texts) => {
            texts.iter().map(|t| tokenize(model, t, true, false, param)).collect()
        }
        api::Inputs::Tokens(tokens) => Ok(vec![checked_tokens(model, tokens, param)?]),
        api::Inputs::TokenLists(lists) => {
            lists.into_iter().map(|t| checked_tokens(model, t, param)).collect()
        }
    }
}

/// A host limit on the request's own text is the request's fault: 400, not 503.
fn too_long(e: HostError, param: &str) -> ApiError {
    match e {
        HostError::LimitExceeded(m) => {
            ApiError::invalid(format!("'{param}' is too long: {m}"), Some(param))
        }
        e => e.into(),
    }
}

/// A prompt with images: text and images for the model's projector (named in
/// `LLAMABOX_VISION`), in order. The host's media tokenizer parses special tokens in
/// all the text it is given, so the whole prompt goes to it in one call (one
/// all-or-nothing evaluation, every image encoded before any text is decoded) only if
/// no message text in it spells a special token (nor the template's text the image
/// marker). Else, so that those texts stay plain, the text is tokenized here as
/// [`chat_tokens`] does and each image alone, as its marker (the projector's own text
/// around it kept, the start-of-text tokens it writes at the start of each call not),
/// the parts before the generation's own prompt prefilled in turn; so is a prompt over
/// the host's cap on special-parsed text.
fn media_prompt(
    name: &str,
    model: &Model,
    prompt: &str,
    spans: &[Span],
    images: Vec<Input>,
) -> Result<Prompt, ApiError> {
    use vision::Segment;
    let Some(projector) = vision::projector_for(name) else {
        let message = format!(
            "The model '{name}' takes no images here (no projector for it in LLAMABOX_VISION)"
        );
        return Err(ApiError::invalid(message, Some("messages")));
    };
    let segments = vision::segments(prompt, spans);
    let markers = segments.iter().filter(|s| matches!(s, Segment::Media)).count();
    if markers != images.len() {
        let message = format!("The chat template wrote {markers} of the messages' {} images: it rewrote a message with images in it", images.len());
        return Err(ApiError::invalid(message, Some("messages")));
    }
    let media = MediaContext::open(&projector, model)?;
    let marker = media.marker();
    let mut whole = true;
    for segment in &segments {
        whole &= match segment {
            Segment::Template(text) => !text.contains(vision::MARKER) && !text.contains(&marker),
            Segment::Text(text) => !spells_special(model, text, "messages")?,
            Segment::Media => true,
        };
    }
    if whole {
        let text: String = segments
            .iter()
            .map(|s| match s {
                Segment::Template(text) | Segment::Text(text) => text,
                Segment::Media => marker.as_str(),
            })
            .collect();
        match media.tokenize(&text, &images) {
            Ok(chunks) => {
                let parts = chunks.into_iter().map(MediaPart::Chunk).collect();
                return Ok(Prompt::Media(std::rc::Rc::new(MediaPrompt { parts, media })));
            }
            Err(HostError::LimitExceeded(m)) if m.contains("max-special-text-bytes") => {}
            Err(e) => return Err(too_long(e, "messages")),
        }
    }
    let bos = tokenize(model, "", true, false, "messages")?;
    let (mut parts, mut tokens) = (Vec::new(), Vec::new());
    let mut images = images.into_iter();
    for segment in segments {
        let first = parts.is_empty() && tokens.is_empty();
        match segment {
            Segment::Template(text) => {
                tokens.extend(tokenize(model, text, first, true, "messages")?)
            }
            Segment::Text(text) => tokens.extend(tokenize(model, text, first, false, "messages")?),
            Segment::Media => {
                let image = images.next().expect("as many images as markers");
                let chunks =
                    media.tokenize(&marker, &[image]).map_err(|e| too_long(e, "messages"))?;
                for (k, chunk) in chunks.into_iter().enumerate() {
                    if chunk.kind() != ChunkKind::Text {
                        if !tokens.is_empty() {
                            parts.push(MediaPart::Tokens(std::mem::take(&mut tokens)));
                        }
                        parts.push(MediaPart::Chunk(chunk));
                        continue;
                    }
                    let text = chunk.text_tokens();
                    let skip =
                        if k == 0 && !first && text.starts_with(&bos) { bos.len() } else { 0 };
                    tokens.extend_from_slice(&text[skip..]);
                }
            }
        }
    }
    if !tokens.is_empty() {
        parts.push(MediaPart::Tokens(tokens));
    }
    Ok(Prompt::Media(std::rc::Rc::new(MediaPrompt { parts, media })))
}

/// One turn for the chat template: roles as the template knows them, text parts
/// joined, each image part a marker (its image pushed onto `images`), an assistant's
/// calls with their arguments as objects, a tool's answer with the call it answers.
fn chat_turn(i: usize, m: Message, inputs: &mut Inputs) -> Result<Turn, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            let param = format!("messages[{i}].role");
            return Err(ApiError::invalid(
                format!("Unsupported role '{other}': use system, user, assistant or tool"),
                Some(&param),
            ));
        }
    };
    let content = match m.content {
        // A refusal an assistant turn gave is what it said.
        None => m.refusal.unwrap_or_default(),
        Some(api::Content::Text(text)) => {
            if text.contains(vision::MARKER) {
                inputs.marker_text.get_or_insert(format!("messages[{i}].content"));
            }
            text
        }
        Some(api::Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.into_iter().enumerate() {
                let param = format!("messages[{i}].content[{j}]");
                match (part.kind.as_str(), part.text, part.image_url) {
                    ("text", Some(t), _) => {
                        if t.contains(vision::MARKER) {
                            inputs.marker_text.get_or_insert(format!("{param}.text"));
                        }
                        text.push_str(&t)
                    }
                    ("image_url", _, Some(image)) => {
                        inputs.images.push(Input::Image(vision::decode(&image.url, &param)?));
                        text.push_str(vision::MARKER);
                    }
                    (kind, _, _) => {
                        let message = format!("Unsupported content part '{kind}': text and image_url parts are served");
                        return Err(ApiError::invalid(message, Some(&param)));
                    }
                }
            }
            text
        }
    };
    let calls = m.tool_calls.unwrap_or_default();
    if !calls.is_empty() && role != "assistant" {
        return Err(ApiError::invalid(
            "Only assistant messages carry 'tool_calls'",
            Some(&format!("messages[{i}].tool_calls")),
        ));
    }
    let tool_calls = calls
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            if c.kind != "function" {
                return Err(ApiError::invalid(
                    format!("Unsupported tool call type '{}'", c.kind),
                    Some(&format!("messages[{i}].tool_calls[{j}]")),
                ));
            }
            // Templates read arguments as an object; text that is not JSON stays text.
            let arguments = serde_json::from_str(&c.function.arguments)
                .unwrap_or(serde_json::Value::String(c.function.arguments));
            Ok(ToolCall { id: c.id, name: c.function.name, arguments })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tool_call_id = match (role, m.tool_call_id) {
        ("tool", None) => {
            return Err(ApiError::invalid(
                "A tool message needs 'tool_call_id'",
                Some(&format!("messages[{i}].tool_call_id")),
            ))
        }
        ("tool", id) => id,
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "Only tool messages carry 'tool_call_id'",
                Some(&format!("messages[{i}].tool_call_id")),
            ))
        }
        (_, None) => None,
    };
    Ok(Turn { role: role.into(), content, tool_calls, tool_call_id, name: m.name, source: Some(i) })
}

/// `POST /v1/completions`.
pub(crate) fn completion(body: &Object) -> Result<Reply, ApiError> {
    let mut sampling = Sampling::read(body, &["prompt", "logprobs", "best_of"])?;
    // `best_of` choices of which `n` are returned: the same as `n` alone when they are equal.
    if let Some(best_of) = body.get::<u32>("best_of")?.filter(|&b| b != sampling.n) {
        return Err(ApiError::invalid(
            format!("Unsupported value for 'best_of': {best_of}; this server takes best_of equal to n ({}), what it does anyway", sampling.n),
            Some("best_of"),
        )
        .with_code("unsupported_parameter"));
    }
    // Text completions' `logprobs` is the number of alternatives, OpenAI's 0 to 5.
    sampling.logprobs = body.get::<u32>("logprobs")?;
    if let Some(n) = sampling.logprobs.filter(|&n| n > MAX_TEXT_LOGPROBS) {
        return Err(ApiError::invalid(
            format!("'logprobs' {n} must be between 0 and {MAX_TEXT_LOGPROBS}"),
            Some("logprobs"),
        ));
    }
    let prompt: api::Inputs = body.require("prompt")?;
    let (name, model) = open_model(body)?;
    if prompt.count() == 0 {
        return Err(ApiError::invalid("'prompt' is an empty list", Some("prompt")));
    }
    let prompts = token_lists(&model, prompt, "prompt")?;
    let prompts: Vec<Prompt> = prompts.into_iter().map(Prompt::Tokens).collect();
    let format = Format { chat: false, id: new_id("cmpl"), created: now(), model: name };
    Choices::start(model, &prompts, &sampling, "prompt", format)?.finish()
}

/// `POST /v1/embeddings`.
pub(crate) fn embed(body: &Object) -> Result<String, ApiError> {
    body.refuse_unknown(&["model", "input", "encoding_format", "dimensions", "user"])?;
    let input: api::Inputs = body.require("input")?;
    let base64 = match body.get::<String>("encoding_format")?.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("Unsupported encoding_format '{other}': use float or base64"),
                Some("encoding_format"),
            ))
        }
    };
    let dimensions: Option<u32> = body.get("dimensions")?;
    priced(input.count(), 0)?;
    let (name, model) = open_model(body)?;
    if dimensions.is_some_and(|d| d != model.n_embd()) {
        return Err(ApiError::invalid(
            format!("This model's embeddings have {} dimensions", model.n_embd()),
            Some("dimensions"),
        ));
    }
    let inputs = token_lists(&model, input, "input")?;
    if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid(
            "'input' must be non-empty (and so must each of its items)",
            Some("input"),
        ));
    }
    priced(inputs.len(), inputs.iter().map(Vec::len).sum())?;
    let longest = inputs.iter().map(Vec::len).max().unwrap_or(0) as u32;
    let limit = model.n_ctx_train().min(MAX_EMBED_TOKENS);
    if longest > limit {
        return Err(ApiError::invalid(
            format!("An input of {longest} tokens is longer than the {limit} this model embeds"),
            Some("input"),
        )
        .with_code("context_length_exceeded"));
    }
    // One input at a time on one context, each decoded whole (in one ubatch, which a
    // model that pools by itself needs).
    let n = Some(longest);
    let ctx = Context::create(
        &model,
        ContextParams { n_ctx: n, n_batch: n, n_ubatch: n, n_seq_max: None, n_threads: None },
    )?;
    let cancel = CancelToken::create()?;
    let mut pooling = Pooling::Mean;
    let mut data = Vec::with_capacity(inputs.len());
    for (index, tokens) in inputs.iter().enumerate() {
        let vector = embed_one(&ctx, tokens, &mut pooling, &cancel)?;
        let embedding = if base64 {
            api::Vector::Base64(api::base64(
                &vector.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            ))
        } else {
            api::Vector::Float(vector)
        };
        data.push(api::Embedding { object: "embedding", index: index as u32, embedding });
    }
    let tokens = inputs.iter().map(Vec::len).sum::<usize>() as u32;
    let usage = api::EmbeddingUsage { prompt_tokens: tokens, total_tokens: tokens };
    Ok(api::to_json(&api::EmbeddingList { object: "list", data, model: &name, usage }))
}

/// Whether `inputs` inputs of `tokens` tokens in all are within what one request may
/// embed; else a 400 naming the limit.
fn priced(inputs: usize, tokens: usize) -> Result<(), ApiError> {
    if inputs > MAX_EMBED_INPUTS {
        let message = format!("'input' has {inputs} items: one request may embed at most {MAX_EMBED_INPUTS} (max-embed-inputs)");
        return Err(ApiError::invalid(message, Some("input")));
    }
    if tokens > MAX_EMBED_TOTAL_TOKENS {
        let message = format!("'input' is {tokens} tokens: one request may embed at most {MAX_EMBED_TOTAL_TOKENS} (max-embed-tokens)");
        return Err(ApiError::invalid(message, Some("input")));
    }
    Ok(())
}

/// One normalized vector. Mean pooling, unless the model pools by itself (a dedicated
/// embedding model): then the pooling it accepts, remembered in `pooling`.
fn embed_one(
    ctx: &Context,
    tokens: &[i32],
    pooling: &mut Pooling,
    cancel: &CancelToken,
) -> Result<Vec<f32>, ApiError> {
    let inputs = [tokens.to_vec()];
    let mut tries = vec![*pooling];
    tries.extend([Pooling::Mean, Pooling::Cls, Pooling::Last].into_iter().filter(|p| p != pooling));
    let mut last_error = None;
    for p in tries {
        match embeddings::embed(ctx, &inputs, p, true, cancel) {
            Ok(mut vectors) => {
                *pooling = p;
                return Ok(vectors.remove(0));
            }
            Err(HostError::InvalidArgument(m)) if m.contains("pools its embeddings itself") => {
                last_error = Some(HostError::InvalidArgument(m))
            }
            // The host's embedding budget (max-embed-inputs/-tokens): the request asked
            // for more than it allows, which is the request's fault (400, not 503).
            Err(HostError::LimitExceeded(m)) if m.starts_with("max-embed-") => {
                return Err(ApiError::invalid(
                    format!("'input' is more than this server embeds per request: {m}"),
                    Some("input"),
                ))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(last_error.expect("at least one pooling was tried").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_priced_before_they_run() {
        assert!(priced(MAX_EMBED_INPUTS, MAX_EMBED_TOTAL_TOKENS).is_ok());
        let many = priced(60_000, 0).unwrap_err();
        assert_eq!((many.status, many.param.as_deref()), (400, Some("input")));
        assert!(
            many.message.contains("max-embed-inputs") && many.message.contains("60000"),
            "{}",
            many.message
        );
        let long = priced(1, MAX_EMBED_TOTAL_TOKENS + 1).unwrap_err();
        assert!(
            long.status == 400 && long.message.contains("max-embed-tokens"),
            "{}",
            long.message
        );
    }

    #[test]
    fn fields_that_ask_for_what_the_server_does_anyway_are_accepted() {
        let parse = |json: &str| Object::parse(json.as_bytes()).unwrap();
        let read = |json: &str| Sampling::read(&parse(json), &["messages"]);
        read(r#"{"service_tier":"auto","modalities":["text"],"store":false,"function_call":"none","prompt_cache_key":"k","safety_identifier":"u1","metadata":null}"#).ok().unwrap();
        read(r#"{"service_tier":"default","function_call":"auto"}"#).ok().unwrap();
        for (json, param) in [
            (r#"{"service_tier":"flex"}"#, "service_tier"),
            (r#"{"service_tier":"priority"}"#, "service_tier"),
            (r#"{"modalities":["text","audio"]}"#, "modalities"),
            (r#"{"function_call":{"name":"f"}}"#, "function_call"),
            (r#"{"prompt_cache_key":7}"#, "prompt_cache_key"),
            (r#"{"store":true}"#, "store"),
            (r#"{"reasoning_effort":"low"}"#, "reasoning_effort"),
        ] {
            let e = read(json).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!(
                (e.status, e.param.as_deref(), e.code),
                (400, Some(param), Some("unsupported_parameter")),
                "{json}"
            );
        }
        let e = read(r#"{"service_tier":"flex"}"#).err().unwrap();
        assert!(e.message.contains(r#""auto" or "default""#), "{}", e.message);
        // Text completions' best_of: as many as n, else refused before any model is opened.
        let e = completion(&parse(r#"{"prompt":"x","best_of":3,"n":2}"#)).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let e = completion(&parse(r#"{"prompt":"x","best_of":2,"n":2}"#)).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("model"), "best_of = n passes on: {}", e.message);
    }

    #[test]
    fn tools_go_with_a_response_format_but_not_a_grammar() {
        let parse = |json: &str| Object::parse(json.as_bytes()).unwrap();
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]"#;
        // Checked, then on to the model (which is missing here).
        for format in [
            r#""response_format":{"type":"json_object"}"#,
            r#""response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"integer"}}}"#,
            r#""json_schema":{"type":"integer"}"#,
            r#""response_format":{"type":"text"}"#,
        ] {
            let e = chat(&parse(&format!("{{{tools},{format}}}"))).err().unwrap();
            assert_eq!(e.param.as_deref(), Some("model"), "{format}: {}", e.message);
        }
        let e = chat(&parse(&format!(r#"{{{tools},"grammar":"root ::= [0-9]"}}"#))).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("grammar"));
    }

    #[test]
    fn logprobs_fields_are_checked_per_endpoint() {
        let body = |json: &str| Object::parse(json.as_bytes()).unwrap();
        assert_eq!(
            chat_sampling(&body(r#"{"logprobs":true,"top_logprobs":3}"#)).unwrap().logprobs,
            Some(3)
        );
        assert_eq!(chat_sampling(&body(r#"{"logprobs":true}"#)).unwrap().logprobs, Some(0));
        assert_eq!(
            chat_sampling(&body(r#"{"logprobs":false,"top_logprobs":null}"#)).unwrap().logprobs,
            None
        );
        let chat = [
            (r#"{"top_logprobs":2}"#, "top_logprobs"),
            (r#"{"logprobs":true,"top_logprobs":21}"#, "top_logprobs"),
            (r#"{"logprobs":3}"#, "logprobs"),
        ];
        for (json, param) in chat {
            let e =
                chat_sampling(&body(json)).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{json}");
        }
        // Text completions count alternatives (0 to 5), checked before any model is opened.
        for json in [
            r#"{"logprobs":6,"prompt":"x"}"#,
            r#"{"logprobs":true,"prompt":"x"}"#,
            r#"{"top_logprobs":1,"prompt":"x"}"#,
        ] {
            let e = completion(&body(json)).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!(e.status, 400, "{json}");
            assert!(
                e.param.as_deref().is_some_and(|p| p.ends_with("logprobs")),
                "{json}: {:?}",
                e.param
            );
        }
    }

    #[test]
    fn llama_server_endpoints_check_their_fields_before_any_host_call() {
        type Endpoint = fn(&Object) -> Result<String, ApiError>;
        let parse = |json: &str| Object::parse(json.as_bytes()).unwrap();
        let cases: [(Endpoint, &str, &str); 12] = [
            (post_tokenize, r#"{"add_special":true}"#, "content"),
            (post_tokenize, r#"{"content":7}"#, "content"),
            (post_tokenize, r#"{"content":"a","add_special":"yes"}"#, "add_special"),
            (post_tokenize, r#"{"content":"a","with_pieces":1}"#, "with_pieces"),
            (post_tokenize, r#"{"content":"a","parse_special":null,"n_probs":2}"#, "n_probs"),
            (post_tokenize, r#"{"content":"a","model":3}"#, "model"),
            (post_detokenize, r#"{}"#, "tokens"),
            (post_detokenize, r#"{"tokens":"1 2"}"#, "tokens"),
            (post_detokenize, r#"{"tokens":[1.5]}"#, "tokens"),
            (post_detokenize, r#"{"tokens":[4294967296]}"#, "tokens"),
            (post_detokenize, r#"{"tokens":[1],"content":"x"}"#, "content"),
            (post_apply_template, r#"{"messages":[]}"#, "messages"),
        ];
        for (endpoint, json, param) in cases {
            let e = endpoint(&parse(json)).err().unwrap_or_else(|| panic!("{json} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{json}: {}", e.message);
        }
        let e = post_tokenize(&parse(r#"{"content":"a","n_probs":2}"#)).unwrap_err();
        assert_eq!(e.code, Some("unsupported_parameter"));
        // apply-template takes a chat completion's body, refusing what chat refuses.
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"temperature":0.5"#;
        for (extra, param) in [
            (r#","tools":[{"type":"function"}]}"#, "tools"),
            (r#","temperature":9}"#, "temperature"),
        ] {
            let e = post_apply_template(&parse(&format!("{chat}{extra}"))).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{extra}");
        }
        let e = post_apply_template(&parse(r#"{"messages":[{"role":"tool","content":"x"}]}"#))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_call_id"));
        let e = post_apply_template(&parse(r#"{"messages":[{"role":"critic","content":"x"}]}"#))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn long_texts_are_checked_in_overlapping_windows() {
        let text: String = (0..3000).map(|i| if i % 7 == 0 { 'é' } else { 'a' }).collect();
        let parts = windows(&text, 100, 10);
        assert!(parts.iter().all(|w| w.len() <= 100 && !w.is_empty()));
        assert_eq!(parts.concat().len() > text.len(), true, "they overlap");
        // Every piece of at most 10 bytes is whole within one window.
        let offsets: Vec<usize> =
            parts.iter().map(|w| w.as_ptr() as usize - text.as_ptr() as usize).collect();
        for start in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let end = (start + 10).min(text.len());
            assert!(
                offsets.iter().zip(&parts).any(|(&o, w)| o <= start && end <= o + w.len()),
                "{start}..{end} is cut"
            );
        }
        assert_eq!(windows("", 100, 10), [""]);
        assert_eq!(windows("short", 100, 10), ["short"]);
    }

    #[test]
    fn strings_a_template_writes_among_its_own_are_named_by_path() {
        let m = |i: usize, json: &str| {
            let m = Message::read(serde_json::from_str(json).unwrap(), i).ok().unwrap();
            chat_turn(i, m, &mut Inputs::default()).ok().unwrap()
        };
        let turns = [
            m(0, r#"{"role":"user","content":"hi","name":"ann"}"#),
            m(
                1,
                r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":\"<|x|>\"}"}}]}"#,
            ),
            m(2, r#"{"role":"tool","content":"4","tool_call_id":"c1"}"#),
        ];
        let fields = template_fields(&turns);
        let paths: Vec<&str> = fields.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "messages[0].name",
                "messages[1].tool_calls[0].id",
                "messages[1].tool_calls[0].function.name",
                "messages[1].tool_calls[0].function.arguments",
                "messages[2].tool_call_id",
            ]
        );
        assert_eq!(fields[3].1, r#"{"a":"<|x|>"}"#);
    }

    #[test]
    fn text_that_spells_the_image_marker_cannot_go_with_images() {
        let parse = |json: &str| Object::parse(json.as_bytes()).unwrap();
        // Alone it is text like any.
        let (turns, images) =
            chat_messages(&parse(r#"{"messages":[{"role":"user","content":"a <__media__> b"}]}"#))
                .unwrap();
        assert_eq!((turns[0].content.as_str(), images.len()), ("a <__media__> b", 0));
        let image = format!(
            r#"{{"type":"image_url","image_url":{{"url":"{}"}}}}"#,
            vision::tests::png_url()
        );
        let (turns, images) = chat_messages(&parse(&format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"see "}},{image}]}}]}}"#
        )))
        .unwrap();
        assert_eq!((turns[0].content.as_str(), images.len()), ("see <__media__>", 1));
        for (messages, param) in [
            (
                format!(
                    r#"[{{"role":"user","content":"x <__media__>"}},{{"role":"user","content":[{image}]}}]"#
                ),
                "messages[0].content",
            ),
            (
                format!(
                    r#"[{{"role":"user","content":[{image},{{"type":"text","text":"<__media__>"}}]}}]"#
                ),
                "messages[0].content[1].text",
            ),
        ] {
            let e = chat_messages(&parse(&format!(r#"{{"messages":{messages}}}"#)))
                .err()
                .unwrap_or_else(|| panic!("{messages} was accepted"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{messages}");
        }
    }

    #[test]
    fn chat_messages_map_roles_and_parts() {
        let m = |json: &str| {
            chat_turn(
                1,
                Message::read(serde_json::from_str(json).unwrap(), 1)?,
                &mut Inputs::default(),
            )
        };
        assert_eq!(m(r#"{"role":"developer","content":"x"}"#).unwrap().role, "system");
        assert_eq!(m(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#).unwrap().content, "ab");
        assert_eq!(
            m(r#"{"role":"critic","content":"x"}"#).err().unwrap().param.as_deref(),
            Some("messages[1].role")
        );
        let e = m(r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}"#)
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("messages[1].content[0]"));
        // The tool exchange: calls with their arguments as objects, answers with their call.
        let call = m(r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]}"#).unwrap();
        assert_eq!(
            call.tool_calls,
            [ToolCall {
                id: "c1".into(),
                name: "f".into(),
                arguments: serde_json::json!({"a": 1})
            }]
        );
        let answer = m(r#"{"role":"tool","content":"42","tool_call_id":"c1"}"#).unwrap();
        assert_eq!((answer.role.as_str(), answer.tool_call_id.as_deref()), ("tool", Some("c1")));
        for (json, param) in [
            (r#"{"role":"tool","content":"42"}"#, "messages[1].tool_call_id"),
            (r#"{"role":"user","content":"x","tool_call_id":"c1"}"#, "messages[1].tool_call_id"),
            (
                r#"{"role":"user","content":"x","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
                "messages[1].tool_calls",
            ),
            (
                r#"{"role":"assistant","tool_calls":[{"id":"c","type":"search","function":{"name":"f","arguments":"{}"}}]}"#,
                "messages[1].tool_calls[0]",
            ),
        ] {
            assert_eq!(
                m(json).err().unwrap_or_else(|| panic!("{json} was accepted")).param.as_deref(),
                Some(param),
                "{json}"
            );
        }
        assert_eq!(
            m(r#"{"role":"assistant","content":null,"refusal":"I cannot help with that."}"#)
                .unwrap()
                .content,
            "I cannot help with that."
        );
        // A field nobody reads is refused, not ignored.
        let e = chat_messages(&Object::parse(br#"{"messages":[{"role":"user","content":"x"},{"role":"user","content":"x","audio":{"id":"a"}}]}"#).unwrap()).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("messages[1].audio"));
    }
}
