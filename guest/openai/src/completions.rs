//! Completions on the host: the runs behind one request's choices (`n` per prompt, each
//! on a context of its own, which the host batches into shared steps), and how they are
//! written out, whole or streamed, with their log-probabilities.

use std::rc::Rc;

use crate::api::{self, ApiError, ChatChoice, Choice, Completion, Delta, TextChoice, Usage};
use crate::http::{self, Body, Gone, Reply, Streamed};
use crate::sampling::{Sampling, CONTEXT_STEP, DEFAULT_N_CTX, MAX_CHOICES, MAX_GENERATE_TOKENS};
use crate::tools::{Call, CallDelta, Reader};
use llamabox_guest::cancel::CancelToken;
use llamabox_guest::generate::{
    self, FinishReason, GenerateParams, Generation, Logprobs, Piece, Sampler,
};
use llamabox_guest::llm::{Context, ContextParams, Model};
use llamabox_guest::media::{Chunk, MediaContext};
use llamabox_guest::types::Error as HostError;

/// OpenAI's floor for a log-probability: a token the model gives no chance at all
/// (JSON has no -inf).
const LOGPROB_FLOOR: f32 = -9999.0;

/// What a generation starts from.
pub enum Prompt {
    Tokens(Vec<i32>),
    /// Text and images, evaluated into each choice's context before it generates.
    Media(Rc<MediaPrompt>),
}

impl Prompt {
    /// Its length in tokens (an image counts the tokens its embeddings take).
    pub fn n_tokens(&self) -> u32 {
        match self {
            Prompt::Tokens(tokens) => tokens.len() as u32,
            Prompt::Media(m) => m.n_tokens(),
        }
    }
}

pub struct MediaPrompt {
    /// In order; a last run of tokens is the generation's own prompt.
    // Chunks drop before their projector's context.
    pub parts: Vec<MediaPart>,
    pub media: MediaContext,
}

/// A piece of a prompt with media: text tokens (prefilled by a generation of no
/// tokens) or a chunk of the host's media tokenizer (text, or media it encodes), the
/// chunks in a row evaluated in one call.
pub enum MediaPart {
    Tokens(Vec<i32>),
    Chunk(Chunk),
}

impl MediaPrompt {
    /// The parts evaluated before the generation starts, and the tokens it starts with.
    fn split(&self) -> (&[MediaPart], &[i32]) {
        match self.parts.split_last() {
            Some((MediaPart::Tokens(tokens), before)) => (before, tokens),
            _ => (&self.parts, &[]),
        }
    }

    fn n_tokens(&self) -> u32 {
        let n = |p: &MediaPart| match p {
            MediaPart::Tokens(tokens) => tokens.len() as u32,
            MediaPart::Chunk(chunk) => chunk.n_tokens(),
        };
        self.parts.iter().map(n).sum()
    }
}

/// `tokens` decoded into `ctx` after what it holds, by a generation of no tokens: the
/// host's prefill, batched and cancellable like any.
fn prefill(ctx: &Context, tokens: &[i32], cancel: &CancelToken) -> Result<(), ApiError> {
    let generation =
        generate::start(ctx, &llamabox_guest::greedy_params(tokens.to_vec(), 0), cancel)?;
    while generation.next()?.is_some() {}
    match generation.finish_reason() {
        Some(FinishReason::Cancelled) => Err(HostError::Cancelled.into()),
        _ => Ok(()),
    }
}

/// One choice's generation on the host, with what it needs alive. `begin` starts it:
/// the prefill (and any image encode) runs after a stream's first event is out, so a
/// client that hangs up then stops native work in flight.
struct Run {
    // Fields drop in order: the generation before the chunks, context and token.
    generation: Option<Generation>,
    media: Option<Rc<MediaPrompt>>,
    params: GenerateParams,
    /// Which of the request's prompts this choice continues (its tokens count once).
    prompt: usize,
    /// Reads a tool-call envelope out of the answer, when the request offered tools.
    reader: Option<Reader>,
    /// The answer must call a tool (`tool_choice` `required` or a function).
    forced_call: bool,
    n_prompt: u32,
    cancel: CancelToken,
    ctx: Context,
}

impl Run {
    /// A context sized for the prompt and `max_tokens`, ready to `begin`. `param`
    /// names the prompt's field in errors; `choice` varies the seed between choices.
    fn start(
        model: &Model,
        prompt: &Prompt,
        index: usize,
        sampling: &Sampling,
        param: &str,
        choice: u32,
    ) -> Result<Run, ApiError> {
        let cap = std::env::var("LLAMABOX_N_CTX")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_N_CTX);
        let limit = model.n_ctx_train().min(cap).max(1);
        let n_prompt = prompt.n_tokens();
        if n_prompt == 0 {
            return Err(ApiError::invalid("The prompt is empty", Some(param)));
        }
        let too_long = |wanted: u32| {
            let message = format!(
                "This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens \
                 ({n_prompt} in the prompt, {} for the completion). Please reduce the length of the prompt or completion.",
                wanted - n_prompt
            );
            ApiError::invalid(message, Some(param)).with_code("context_length_exceeded")
        };
        let max_tokens = match sampling.max_tokens {
            Some(n) if n_prompt + n > limit => return Err(too_long(n_prompt + n)),
            Some(n) => n,
            None if n_prompt >= limit => return Err(too_long(n_prompt + 1)),
            None => (limit - n_prompt).min(MAX_GENERATE_TOKENS),
        };
        let n_ctx = (n_prompt + max_tokens).next_multiple_of(CONTEXT_STEP).min(limit);
        let params = ContextParams {
            n_ctx: Some(n_ctx),
            n_batch: None,
            n_ubatch: None,
            n_seq_max: None,
            n_threads: None,
        };
        let ctx = Context::create(model, params)?;
        let cancel = CancelToken::create()?;
        let (tokens, media) = match prompt {
            Prompt::Tokens(tokens) => (tokens.clone(), None),
            Prompt::Media(m) => (m.split().1.to_vec(), Some(m.clone())),
        };
        let sampler = sampling.sampler(model, choice)?;
        let params = GenerateParams {
            prompt: tokens,
            seq: 0,
            max_tokens,
            stop: sampling.stop.clone(),
            sampler,
            logprobs: sampling.logprobs,
        };
        let reader = sampling.tool_calls.then(|| Reader::new(sampling.json_response));
        let forced_call = sampling.forced_call;
        Ok(Run {
            generation: None,
            media,
            params,
            prompt: index,
            reader,
            forced_call,
            n_prompt,
            cancel,
            ctx,
        })
    }

    /// Evaluate the media prompt, if any, and start generating.
    fn begin(&mut self) -> Result<(), ApiError> {
        if self.generation.is_none() {
            if let Some(m) = &self.media {
                let mut chunks: Vec<&Chunk> = Vec::new();
                for part in m.split().0 {
                    match part {
                        MediaPart::Chunk(chunk) => chunks.push(chunk),
                        MediaPart::Tokens(tokens) => {
                            if !chunks.is_empty() {
                                m.media.eval_chunks(&self.ctx, &chunks, 0, &self.cancel)?;
                                chunks.clear();
                            }
                            prefill(&self.ctx, tokens, &self.cancel)?;
                        }
                    }
                }
                if !chunks.is_empty() {
                    m.media.eval_chunks(&self.ctx, &chunks, 0, &self.cancel)?;
                }
            }
            self.generation = Some(generate::start(&self.ctx, &self.params, &self.cancel)?);
        }
        Ok(())
    }

    /// The next piece (its text what the client is shown: a tool envelope's `response`
    /// text); `None` once generation has ended.
    fn next(&mut self) -> Result<Option<Piece>, ApiError> {
        self.begin()?;
        let Some(generation) = &self.generation else { return Ok(None) };
        let mut piece = generation.next()?;
        match (&mut piece, &mut self.reader) {
            (Some(piece), Some(reader)) => piece.text = reader.push(&piece.text),
            // What the reader held back, once (a JSON response's last braces).
            (None, Some(reader)) => {
                let text = reader.finish();
                if !text.is_empty() {
                    return Ok(Some(Piece { text, tokens: Vec::new(), logprobs: Vec::new() }));
                }
            }
            _ => {}
        }
        Ok(piece)
    }

    /// An answer that had to call a tool and did not even name one: cut short before
    /// (max_tokens), which is an error rather than an answer with neither text nor calls.
    fn unanswered(&self) -> Option<ApiError> {
        if !self.forced_call || !self.calls().is_empty() {
            return None;
        }
        let message = format!(
            "The answer ended ({}) before it named the function the forced tool_choice calls: raise max_tokens (it was {})",
            self.finish_reason(),
            self.params.max_tokens
        );
        Some(ApiError::invalid(message, Some("max_tokens")).with_code("tool_call_cut_short"))
    }

    /// The calls the answer made, once generation has ended.
    fn calls(&self) -> Vec<Call> {
        self.reader.as_ref().map(Reader::calls).unwrap_or_default()
    }

    /// OpenAI's finish reason, once generation has ended.
    fn finish_reason(&self) -> &'static str {
        match self.generation.as_ref().and_then(|g| g.finish_reason()) {
            Some(FinishReason::MaxTokens) => "length",
            _ if !self.calls().is_empty() => "tool_calls",
            _ => "stop",
        }
    }
}

/// How a completion is written out: chat or text, and the fields every chunk repeats.
pub struct Format {
    pub chat: bool,
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// What one choice adds in one chunk (or holds, whole): text and its tokens' logprobs.
#[derive(Default)]
struct Addition {
    text: String,
    logprobs: Vec<Logprobs>,
    /// What the answer's calls added (a tool envelope's, read as it is decoded).
    calls: Vec<CallDelta>,
}

impl Format {
    /// Choice `index` of a whole answer, or what one stream chunk says of it (`finish`
    /// set on its last).
    fn choice<'a>(
        &self,
        index: u32,
        text: Option<&'a str>,
        logprobs: Option<TokenLogprobs>,
        finish: Option<&'static str>,
        whole: bool,
    ) -> Choice<'a> {
        self.choice_with_calls(index, text, None, logprobs, finish, whole)
    }

    /// [`Format::choice`], with tool calls (chat only).
    fn choice_with_calls<'a>(
        &self,
        index: u32,
        text: Option<&'a str>,
        tool_calls: Option<Vec<api::ToolCallOut>>,
        logprobs: Option<TokenLogprobs>,
        finish: Option<&'static str>,
        whole: bool,
    ) -> Choice<'a> {
        match logprobs {
            _ if self.chat => {
                let logprobs = match logprobs {
                    Some(TokenLogprobs::Chat(l)) => Some(l),
                    _ => None,
                };
                let delta = Delta { role: whole.then_some("assistant"), content: text, tool_calls };
                let (message, delta) =
                    if whole { (Some(delta), None) } else { (None, Some(delta)) };
                Choice::Chat(ChatChoice { index, message, delta, logprobs, finish_reason: finish })
            }
            Some(TokenLogprobs::Text(l)) => Choice::Text(TextChoice {
                index,
                text: text.unwrap_or(""),
                logprobs: Some(l),
                finish_reason: finish,
            }),
            _ => Choice::Text(TextChoice {
                index,
                text: text.unwrap_or(""),
                logprobs: None,
                finish_reason: finish,
            }),
        }
    }

    /// The log-probabilities of `add`'s tokens in this format's shape, when asked for.
    fn logprobs(
        &self,
        model: &Model,
        add: &Addition,
        offsets: &mut Offsets,
    ) -> Result<Option<TokenLogprobs>, ApiError> {
        if !offsets.asked {
            return Ok(None);
        }
        Ok(Some(if self.chat {
            TokenLogprobs::Chat(chat_logprobs(model, &add.logprobs)?)
        } else {
            TokenLogprobs::Text(text_logprobs(model, &add.logprobs, &mut offsets.text)?)
        }))
    }

    /// A whole completion, or one stream chunk.
    fn json(&self, choices: Vec<Choice>, usage: Option<Usage>, whole: bool) -> String {
        let object = match (self.chat, whole) {
            (true, true) => "chat.completion",
            (true, false) => "chat.completion.chunk",
            (false, _) => "text_completion",
        };
        api::to_json(&Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }

    /// The first chunk of choice `index` of a chat stream: the assistant's role, no text yet.
    fn role_chunk(&self, index: u32) -> String {
        let delta = Delta { role: Some("assistant"), content: Some(""), tool_calls: None };
        self.json(
            vec![Choice::Chat(ChatChoice {
                index,
                message: None,
                delta: Some(delta),
                logprobs: None,
                finish_reason: None,
            })],
            None,
            false,
        )
    }

    /// The usage chunk of a stream (`stream_options.include_usage`): no choices.
    fn usage_chunk(&self, usage: Usage) -> String {
        self.json(vec![], Some(usage), false)
    }
}

/// A choice's `logprobs`, chat's or text's.
enum TokenLogprobs {
    Chat(api::ChatLogprobs),
    Text(api::TextLogprobs),
}

/// Where a choice's text stands, for text completions' `text_offset`, and whether
/// log-probabilities were asked for at all (else `logprobs` is `null`).
#[derive(Clone, Copy, Default)]
struct Offsets {
    asked: bool,
    text: u32,
}

/// A token as OpenAI shows it: its text (invalid UTF-8 as U+FFFD) and its bytes.
fn token_text(model: &Model, token: i32) -> Result<(String, Vec<u8>), ApiError> {
    let bytes = model.token_to_piece(token, false)?;
    Ok((String::from_utf8_lossy(&bytes).into_owned(), bytes))
}

fn floor(logprob: f32) -> f32 {
    if logprob.is_nan() {
        LOGPROB_FLOOR
    } else {
        logprob.max(LOGPROB_FLOOR)
    }
}

/// Chat's `logprobs.content`: each token with its bytes and its alternatives.
fn chat_logprobs(model: &Model, all: &[Logprobs]) -> Result<api::ChatLogprobs, ApiError> {
    let entry = |token: i32, logprob: f32| -> Result<api::TokenLogprob, ApiError> {
        let (token, bytes) = token_text(model, token)?;
        Ok(api::TokenLogprob { token, logprob: floor(logprob), bytes })
    };
    let content = all
        .iter()
        .map(|l| {
            let chosen = entry(l.chosen.token, l.chosen.logprob)?;
            let top_logprobs =
                l.top.iter().map(|t| entry(t.token, t.logprob)).collect::<Result<_, _>>()?;
            Ok(api::ChatTokenLogprob { chosen, top_logprobs })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(api::ChatLogprobs { content, refusal: None })
}

/// Text completions' `logprobs`: parallel lists, offsets counted in characters from the
/// start of the completion (`offset` carries on across a stream's chunks).
fn text_logprobs(
    model: &Model,
    all: &[Logprobs],
    offset: &mut u32,
) -> Result<api::TextLogprobs, ApiError> {
    let mut out = api::TextLogprobs::default();
    for l in all {
        let (text, _) = token_text(model, l.chosen.token)?;
        out.text_offset.push(*offset);
        *offset += text.chars().count() as u32;
        out.tokens.push(text);
        out.token_logprobs.push(floor(l.chosen.logprob));
        let top = l
            .top
            .iter()
            .map(|t| Ok((token_text(model, t.token)?.0, floor(t.logprob))))
            .collect::<Result<_, ApiError>>()?;
        out.top_logprobs.push(api::TopMap(top));
    }
    Ok(out)
}

/// A grammar or schema that the host will not take is the request's fault, named
/// before anything starts (a stream could only report it as its last event): the host
/// compiles it here once, as the generation would.
fn check_constraint(model: &Model, sampling: &Sampling) -> Result<(), ApiError> {
    let params = sampling.sampler(model, 0)?;
    if params.grammar.is_none() && params.json_schema.is_none() {
        return Ok(());
    }
    let param = sampling.constraint_param;
    match Sampler::create(model, &params) {
        Ok(_) => Ok(()),
        Err(HostError::InvalidArgument(m) | HostError::LimitExceeded(m)) => {
            Err(ApiError::invalid(format!("Invalid '{param}': {m}"), Some(param)))
        }
        Err(e) => Err(e.into()),
    }
}

/// Calls as a whole message lists them, or (`index` set) as a stream's deltas do.
fn calls_out(calls: Vec<Call>, streamed: bool) -> Vec<api::ToolCallOut> {
    calls
        .into_iter()
        .enumerate()
        .map(|(i, c)| api::ToolCallOut {
            index: streamed.then_some(i as u32),
            id: Some(api::new_id("call")),
            kind: Some("function"),
            function: api::FunctionCallOut { name: Some(c.name), arguments: c.arguments },
        })
        .collect()
}

/// The choices of one request: every prompt × `n`, running side by side on the host.
pub struct Choices {
    // The runs (and their contexts) drop before the model.
    runs: Vec<Run>,
    model: Model,
    format: Format,
    logprobs: bool,
    stream: bool,
    include_usage: bool,
}

impl Choices {
    /// `n` runs (`sampling.n`) for each prompt, each on a context of its own: at most
    /// [`MAX_CHOICES`] in all, else a 400 naming `n` (or `param`, for many prompts).
    pub fn start(
        model: Model,
        prompts: &[Prompt],
        sampling: &Sampling,
        param: &str,
        format: Format,
    ) -> Result<Choices, ApiError> {
        let total = prompts.len() * sampling.n as usize;
        if total > MAX_CHOICES {
            let message = format!(
                "{} prompts × n = {} asks for {total} choices: at most {MAX_CHOICES} per request",
                prompts.len(),
                sampling.n
            );
            return Err(ApiError::invalid(
                message,
                Some(if prompts.len() > 1 { param } else { "n" }),
            ));
        }
        check_constraint(&model, sampling)?;
        let mut runs = Vec::with_capacity(total);
        for (index, prompt) in prompts.iter().enumerate() {
            for choice in 0..sampling.n {
                runs.push(Run::start(&model, prompt, index, sampling, param, choice)?);
            }
        }
        let (logprobs, stream, include_usage) =
            (sampling.logprobs.is_some(), sampling.stream, sampling.include_usage);
        Ok(Choices { runs, model, format, logprobs, stream, include_usage })
    }

    /// The usage of every run: each prompt counted once (and its cached tokens with it),
    /// every choice's generated tokens.
    fn usage(&self) -> Usage {
        let (mut prompt_tokens, mut completion_tokens, mut cached_tokens) = (0, 0, 0);
        for (i, run) in self.runs.iter().enumerate() {
            let usage = run.generation.as_ref().and_then(|g| g.usage());
            completion_tokens += usage.map_or(0, |u| u.generated_tokens);
            if i == 0 || self.runs[i - 1].prompt != run.prompt {
                // A media prompt was evaluated before the generation: count it here.
                prompt_tokens += run.n_prompt;
                cached_tokens += usage.map_or(0, |u| u.cached_tokens);
            }
        }
        let prompt_tokens_details = api::PromptTokensDetails { cached_tokens };
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details,
        }
    }

    /// The first run's prompt length, known before it runs.
    pub(crate) fn prompt_tokens(&self) -> u32 {
        self.runs.first().map_or(0, |run| run.n_prompt)
    }

    /// Which of the request's stop strings ended the first run, if one did.
    fn stop_index(&self) -> Option<usize> {
        match self.runs.first()?.generation.as_ref()?.finish_reason()? {
            FinishReason::Stop(i) => Some(i as usize),
            _ => None,
        }
    }

    /// Start every run, then take one piece from each live run in turn (the host steps
    /// them together), telling `event` of each piece and each run's end, with the
    /// choice's index.
    fn drive(
        &mut self,
        mut event: impl FnMut(&Self, u32, Event) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        for run in &mut self.runs {
            run.begin()?;
        }
        let mut live: Vec<usize> = (0..self.runs.len()).collect();
        while !live.is_empty() {
            let mut still = Vec::with_capacity(live.len());
            for i in live {
                match self.runs[i].next()? {
                    Some(piece) => {
                        let reader = self.runs[i].reader.as_mut();
                        let calls = reader.map(Reader::call_deltas).unwrap_or_default();
                        let (text, logprobs) = (piece.text, piece.logprobs);
                        event(self, i as u32, Event::Piece(Addition { text, logprobs, calls }))?;
                        still.push(i);
                    }
                    None => event(self, i as u32, Event::Ended)?,
                }
            }
            live = still;
        }
        Ok(())
    }

    /// The first run, as it is decoded (`progress` with each non-empty piece of text
    /// and each call's delta), for `POST /v1/responses` and `POST /v1/messages` (one
    /// choice): its whole text, OpenAI's finish reason, the usage, and the calls it made.
    pub(crate) fn run_one(
        &mut self,
        mut progress: impl FnMut(Progress) -> Result<(), ApiError>,
    ) -> Result<Ended, ApiError> {
        let (mut text, mut reason, mut calls) = (String::new(), "stop", Vec::new());
        self.drive(|c, i, event| match event {
            Event::Piece(add) if i == 0 => {
                if !add.text.is_empty() {
                    progress(Progress::Text(&add.text))?;
                    text.push_str(&add.text);
                }
                add.calls.iter().try_for_each(|delta| progress(Progress::Call(delta)))
            }
            Event::Piece(_) => Ok(()),
            Event::Ended => {
                let run = &c.runs[i as usize];
                if let Some(e) = run.unanswered() {
                    return Err(e);
                }
                if i == 0 {
                    reason = run.finish_reason();
                    calls = run.calls();
                }
                Ok(())
            }
        })?;
        Ok(Ended { text, reason, stop: self.stop_index(), usage: self.usage(), calls })
    }

    /// The whole answer now, or a stream to send.
    pub fn finish(mut self) -> Result<Reply, ApiError> {
        if self.stream {
            return Ok(Reply::Stream(Box::new(Stream { choices: self })));
        }
        let mut whole: Vec<Addition> = (0..self.runs.len()).map(|_| Addition::default()).collect();
        self.drive(|_, i, event| {
            if let Event::Piece(add) = event {
                let all = &mut whole[i as usize];
                all.text.push_str(&add.text);
                all.logprobs.extend(add.logprobs);
            }
            Ok(())
        })?;
        let mut choices = Vec::with_capacity(whole.len());
        for (i, add) in whole.iter().enumerate() {
            let logprobs = self.format.logprobs(
                &self.model,
                add,
                &mut Offsets { asked: self.logprobs, text: 0 },
            )?;
            let run = &self.runs[i];
            if let Some(e) = run.unanswered() {
                return Err(e);
            }
            let reason = Some(run.finish_reason());
            let calls = calls_out(run.calls(), false);
            // A message that calls tools has no text (OpenAI's `content: null`).
            let (text, calls) = if calls.is_empty() {
                (Some(add.text.as_str()), None)
            } else {
                (None, Some(calls))
            };
            choices
                .push(self.format.choice_with_calls(i as u32, text, calls, logprobs, reason, true));
        }
        Ok(Reply::Json(self.format.json(choices, Some(self.usage()), true)))
    }
}

/// What [`Choices::drive`] reports of a run.
enum Event {
    Piece(Addition),
    Ended,
}

/// How the first run ended (`Choices::run_one`): its whole text, OpenAI's finish
/// reason, which of the request's stop strings ended it, the usage, and the calls it made.
pub(crate) struct Ended {
    pub text: String,
    pub reason: &'static str,
    pub stop: Option<usize>,
    pub usage: Usage,
    pub calls: Vec<Call>,
}

#[cfg(test)]
impl Ended {
    /// An end for the answer-shape tests: no stop string; 10 prompt tokens (4 of them
    /// cached) and 3 generated.
    pub fn test(text: &str, reason: &'static str, calls: &[Call]) -> Self {
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 3,
            total_tokens: 13,
            prompt_tokens_details: crate::api::PromptTokensDetails { cached_tokens: 4 },
        };
        Self { text: text.into(), reason, stop: None, usage, calls: calls.to_vec() }
    }
}

/// An API's answer written as server-sent events while its one run is decoded
/// (`POST /v1/responses`, `POST /v1/messages`): each returns the events to send.
pub(crate) trait Events {
    /// Before anything is generated; the prompt is `prompt_tokens` long.
    fn opening(&mut self, prompt_tokens: u32) -> String;
    /// A piece of text.
    fn text(&mut self, text: &str) -> String;
    /// What a call added as it was decoded.
    fn call(&mut self, delta: &CallDelta) -> String;
    /// After the last piece: the answer's end.
    fn closing(&mut self, ended: &Ended) -> String;
    /// An error after the stream started: its last event.
    fn error(&mut self, e: &ApiError) -> String;
}

/// A run streamed as an API's events.
pub(crate) struct EventStream<E> {
    pub choices: Choices,
    pub events: E,
}

impl<E: Events> Streamed for EventStream<E> {
    /// The opening events go out before the prompt is evaluated; each piece as it
    /// comes. A failed write means the client is gone: stop at once (dropping the run
    /// cancels it).
    fn send(mut self: Box<Self>, body: Body) {
        if let Ok(last) = self.write(&body) {
            let _ = body.finish_with(last.as_bytes());
        }
    }
}

impl<E: Events> EventStream<E> {
    /// Every event but the last ones, which are returned.
    fn write(&mut self, body: &Body) -> Result<String, Gone> {
        body.write(self.events.opening(self.choices.prompt_tokens()).as_bytes())?;
        let gone = std::cell::Cell::new(None);
        let events = &mut self.events;
        let ran = self.choices.run_one(|progress| {
            let written = match progress {
                Progress::Text(text) => events.text(text),
                Progress::Call(delta) => events.call(delta),
            };
            body.write(written.as_bytes()).map_err(|g| {
                gone.set(Some(g));
                ApiError::invalid("the client is gone", None)
            })
        });
        if let Some(g) = gone.take() {
            return Err(g);
        }
        Ok(match ran {
            Ok(ended) => self.events.closing(&ended),
            Err(e) => self.events.error(&e),
        })
    }
}

/// What one run hands on as it is decoded: text, or what a call added.
pub(crate) enum Progress<'a> {
    Text(&'a str),
    Call(&'a CallDelta),
}

/// Generations streamed as server-sent events.
pub struct Stream {
    choices: Choices,
}

impl Streamed for Stream {
    /// Write each piece as it comes. A failed write means the client is gone: stop
    /// at once (dropping the generations cancels them).
    fn send(mut self: Box<Self>, body: Body) {
        if let Ok(last) = self.events(&body) {
            let _ = body.finish_with(http::event(&last).as_bytes());
        }
    }
}

impl Stream {
    /// Every event but the last, which is returned: `[DONE]`, or an error.
    fn events(&mut self, body: &Body) -> Result<String, Gone> {
        let choices = &mut self.choices;
        if choices.format.chat {
            for i in 0..choices.runs.len() {
                body.event(&choices.format.role_chunk(i as u32))?;
            }
        }
        let mut offsets = vec![Offsets { asked: choices.logprobs, text: 0 }; choices.runs.len()];
        // A failed write is kept aside: the runs' loop only knows ApiError.
        let gone = std::cell::Cell::new(None);
        let send = |json: &str| {
            body.event(json).map_err(|g| {
                gone.set(Some(g));
                ApiError::invalid("the client is gone", None)
            })
        };
        let driven = choices.drive(|c, i, event| {
            let json = match event {
                Event::Piece(add) => {
                    if !add.text.is_empty() || !add.logprobs.is_empty() {
                        let logprobs =
                            c.format.logprobs(&c.model, &add, &mut offsets[i as usize])?;
                        let choice = c.format.choice(i, Some(&add.text), logprobs, None, false);
                        send(&c.format.json(vec![choice], None, false))?;
                    }
                    // Each call as OpenAI streams it, as it is decoded: its index, id,
                    // type and name first, then pieces of its arguments.
                    for delta in add.calls {
                        let named = delta.name.is_some();
                        let call = api::ToolCallOut {
                            index: Some(delta.index as u32),
                            id: named.then(|| api::new_id("call")),
                            kind: named.then_some("function"),
                            function: api::FunctionCallOut {
                                name: delta.name,
                                arguments: delta.arguments,
                            },
                        };
                        let choice = c.format.choice_with_calls(
                            i,
                            None,
                            Some(vec![call]),
                            None,
                            None,
                            false,
                        );
                        send(&c.format.json(vec![choice], None, false))?;
                    }
                    return Ok(());
                }
                Event::Ended => {
                    let run = &c.runs[i as usize];
                    if let Some(e) = run.unanswered() {
                        return Err(e);
                    }
                    // Chat ends a choice with an empty delta, text with empty text.
                    let reason = Some(run.finish_reason());
                    let text = (!c.format.chat).then_some("");
                    c.format.json(vec![c.format.choice(i, text, None, reason, false)], None, false)
                }
            };
            send(&json)
        });
        if let Some(g) = gone.take() {
            return Err(g);
        }
        if let Err(e) = driven {
            // Too late for an HTTP status: the error is the stream's last event.
            return Ok(e.to_json());
        }
        if choices.include_usage {
            body.event(&choices.format.usage_chunk(choices.usage()))?;
        }
        Ok("[DONE]".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(chat: bool) -> Format {
        Format { chat, id: "x-1".into(), created: 7, model: "m".into() }
    }

    /// Choice 0 alone, as a stream chunk.
    fn chunk(
        f: &Format,
        text: Option<&str>,
        logprobs: Option<TokenLogprobs>,
        finish: Option<&'static str>,
    ) -> String {
        f.json(vec![f.choice(0, text, logprobs, finish, false)], None, false)
    }

    #[test]
    fn chat_json_shapes() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            total_tokens: 5,
            prompt_tokens_details: api::PromptTokensDetails { cached_tokens: 1 },
        };
        let f = format(true);
        assert_eq!(
            f.json(
                vec![
                    f.choice(0, Some("hi"), None, Some("stop"), true),
                    f.choice(1, Some("yo"), None, Some("length"), true)
                ],
                Some(usage),
                true
            ),
            r#"{"id":"x-1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"logprobs":null,"finish_reason":"stop"},{"index":1,"message":{"role":"assistant","content":"yo"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}}"#
        );
        assert_eq!(
            f.role_chunk(2),
            r#"{"id":"x-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":2,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#
        );
        assert_eq!(
            chunk(&f, Some("hi"), None, None),
            r#"{"id":"x-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null}]}"#
        );
        assert_eq!(
            chunk(&f, None, None, Some("length")),
            r#"{"id":"x-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}"#
        );
        assert_eq!(
            f.usage_chunk(usage),
            r#"{"id":"x-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}}"#
        );
    }

    #[test]
    fn text_json_shapes() {
        let f = format(false);
        assert_eq!(
            f.json(vec![f.choice(3, Some("a"), None, None, false)], None, false),
            r#"{"id":"x-1","object":"text_completion","created":7,"model":"m","choices":[{"index":3,"text":"a","logprobs":null,"finish_reason":null}]}"#
        );
    }

    #[test]
    fn logprob_shapes_and_the_floor() {
        let top = api::TopMap(vec![("b".into(), -0.5), ("a".into(), -1.0)]);
        assert_eq!(
            serde_json::to_string(&top).unwrap(),
            r#"{"b":-0.5,"a":-1.0}"#,
            "most likely first, not sorted by key"
        );
        assert_eq!(
            (floor(f32::NEG_INFINITY), floor(f32::NAN), floor(-0.25)),
            (LOGPROB_FLOOR, LOGPROB_FLOOR, -0.25)
        );
        let text = api::TextLogprobs {
            tokens: vec!["a".into()],
            token_logprobs: vec![-0.5],
            top_logprobs: vec![top],
            text_offset: vec![0],
        };
        let f = format(false);
        assert_eq!(
            chunk(&f, Some("a"), Some(TokenLogprobs::Text(text)), None),
            r#"{"id":"x-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"a","logprobs":{"tokens":["a"],"token_logprobs":[-0.5],"top_logprobs":[{"b":-0.5,"a":-1.0}],"text_offset":[0]},"finish_reason":null}]}"#
        );
        let chat = api::ChatLogprobs {
            content: vec![api::ChatTokenLogprob {
                chosen: api::TokenLogprob { token: "é".into(), logprob: -0.1, bytes: "é".into() },
                top_logprobs: vec![],
            }],
            refusal: None,
        };
        let f = format(true);
        assert_eq!(
            chunk(&f, Some("é"), Some(TokenLogprobs::Chat(chat)), None),
            r#"{"id":"x-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"é"},"logprobs":{"content":[{"token":"é","logprob":-0.1,"bytes":[195,169],"top_logprobs":[]}],"refusal":null},"finish_reason":null}]}"#
        );
    }
}
