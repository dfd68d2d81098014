//! Generation on the context's own thread: prefill the prompt, then sample → decode →
//! deliver, one token at a time, with no hop to the caller per token. Pieces go to a
//! caller-supplied sink as they are produced.
//!
//! **Memory afterwards** (whatever the outcome): the sequence holds what it held before,
//! plus the prompt, plus every token that was *delivered* (each piece's `tokens`).
//! - A token is decoded before it is delivered; if its decode is cancelled or fails,
//!   or the sink refuses it, it is not delivered and not in memory.
//! - An end-of-generation token is not decoded and not delivered.
//! - A prefill that is cancelled or fails leaves memory as before the call (the prompt
//!   is decoded all or nothing, across its n-batch pieces); the outcome then has
//!   `prompt_tokens == 0`.
//!
//! So a later generation on the same sequence continues exactly after the last
//! delivered token.

use std::time::{Duration, Instant};

use super::cancel::Stop;
use super::context::{Batch, Context, PromptPiece};
use super::logprobs::{token_logprob, TokenLogprob, MAX_TOP_LOGPROBS};
use super::sampler::Sampler;
use super::Token;
use super::{Error, Result};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Decoded after the sequence's current end; its last token's logits pick the
    /// first generated token. Empty: continue from the logits of the context's last
    /// decode (a chunk list evaluated through the media path, say), which must have
    /// been the end of `seq`.
    pub prompt: Vec<Token>,
    /// The context's sequence to generate into.
    pub seq: i32,
    /// Most tokens to generate (0: prefill only).
    pub max_tokens: u32,
    /// Generation ends when the text contains one of these; the stop string and
    /// anything after it are not delivered as text (their tokens are, see `Piece`).
    pub stop: Vec<String>,
    /// Report each delivered token's log-probability and this many most likely
    /// alternatives (at most [`MAX_TOP_LOGPROBS`]); `None`: none.
    pub logprobs: Option<u32>,
}

impl GenerateRequest {
    /// `max_tokens` after `prompt` in sequence 0, with no stop strings and no logprobs:
    /// the plain request, which the others start from (`GenerateRequest { stop, ..new() }`).
    pub fn new(prompt: Vec<Token>, max_tokens: u32) -> Self {
        Self { prompt, seq: 0, max_tokens, stop: Vec::new(), logprobs: None }
    }
}

/// One step of output: the tokens delivered and the text released with them.
///
/// `text` is always whole UTF-8: bytes of a character split across tokens, and text
/// that may be the start of a stop string, are held back and released with a later
/// piece (or the final one). Invalid UTF-8 from the model becomes U+FFFD.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Piece {
    /// Text released with this piece (possibly empty, while a character or a possible
    /// stop string is held back).
    pub text: String,
    /// Tokens delivered with this piece, now in memory.
    pub tokens: Vec<Token>,
    /// One per token when the request asked for log-probabilities, else empty.
    pub logprobs: Vec<TokenLogprob>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The text matched `stop[index]`.
    Stop {
        /// Which of the request's stop strings matched.
        index: u32,
    },
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_tokens` tokens were delivered.
    MaxTokens,
    /// The token (or the call's abandonment) stopped it: in the prefill (nothing was
    /// added to memory) or at the token in flight.
    Cancelled,
}

/// What one generation decoded and how long it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenerationUsage {
    /// Prompt tokens decoded into memory (0 if the prefill did not complete).
    pub prompt_tokens: u32,
    /// Of those, the leading ones found in memory and not computed again: a prefix an
    /// earlier run of the group left (an idle context's leftover, a seat's sequence).
    pub cached_tokens: u32,
    /// Tokens delivered.
    pub generated_tokens: u32,
    /// Wall time of the prefill.
    pub prefill: Duration,
    /// Wall time from the end of the prefill to the end of generation.
    pub generation: Duration,
}

/// How a generation ended, and what it used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Why it ended.
    pub finish: FinishReason,
    /// What it decoded and how long it took.
    pub usage: GenerationUsage,
}

/// Where pieces go. Returns false when the piece could not be delivered (the reader
/// is gone, or the call was stopped while waiting for room): generation then ends as
/// cancelled and the piece's tokens are taken back out of memory.
pub trait Sink {
    /// Hand `piece` to the reader; false if it could not be delivered.
    fn deliver(&mut self, piece: Piece) -> bool;
}

impl<F: FnMut(Piece) -> bool> Sink for F {
    fn deliver(&mut self, piece: Piece) -> bool {
        self(piece)
    }
}

/// Check a request against what generation needs before anything is decoded.
pub fn check_request(
    model: &std::sync::Arc<super::Model>,
    sampler: &Sampler,
    request: &GenerateRequest,
) -> Result<()> {
    if let Some(i) = request.stop.iter().position(String::is_empty) {
        return Err(Error::InvalidArgument(format!("stop string {i} is empty")));
    }
    if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(Error::InvalidArgument(format!("logprobs {n} is above {MAX_TOP_LOGPROBS}")));
    }
    if !std::sync::Arc::ptr_eq(sampler.model(), model) {
        return Err(Error::InvalidArgument("the sampler was made for another model".into()));
    }
    model.check_tokens(&request.prompt)
}

/// The error for a generation with no prompt on a context without logits to go on.
pub fn nothing_to_continue() -> Error {
    Error::InvalidArgument(
        "the prompt is empty and the context's last decode left no logits to continue from".into(),
    )
}

/// The token loop of one generation after its prefill, as steps for whoever drives the
/// decodes: [`generate`] on a context of its own, or a batch of many sequences. Both
/// keep the memory rule of the module doc through it: pick a token from the last
/// logits, decode it, then hand out its piece; a token not delivered is removed.
pub struct TokenLoop {
    model: std::sync::Arc<super::Model>,
    max_tokens: u32,
    /// Alternatives to report per token, when log-probabilities were asked for.
    logprobs: Option<u32>,
    /// The log-probability of the token [`TokenLoop::pick`] chose, for its piece.
    picked: Option<TokenLogprob>,
    text: TextStream,
    usage: GenerationUsage,
    /// Where the next token goes in the sequence.
    pos: i32,
    /// A token decoded whose piece is not delivered yet (a batch picks the next token
    /// while the logits are at hand, before the reader has taken the last piece).
    in_flight: bool,
    started: Instant,
}

/// What [`TokenLoop::pick`] chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Decode this token at [`TokenLoop::pos`].
    Decode(Token),
    /// Generation ends, for this reason; nothing more is decoded.
    Finish(FinishReason),
}

impl TokenLoop {
    /// After a prefill of `prompt_tokens` (`cached_tokens` of them found in memory) that
    /// took `prefill`; the next token goes at `pos`.
    pub fn new(
        model: std::sync::Arc<super::Model>,
        request: &GenerateRequest,
        pos: i32,
        prompt_tokens: u32,
        cached_tokens: u32,
        prefill: Duration,
    ) -> Self {
        let usage =
            GenerationUsage { prompt_tokens, cached_tokens, prefill, ..GenerationUsage::default() };
        let text = TextStream::new(&request.stop);
        Self {
            model,
            max_tokens: request.max_tokens,
            logprobs: request.logprobs,
            picked: None,
            text,
            usage,
            pos,
            in_flight: false,
            started: Instant::now(),
        }
    }

    /// Where the next token goes in the sequence.
    pub fn pos(&self) -> i32 {
        self.pos
    }

    /// The next token from the logits of the last row decoded, or why generation ends.
    pub fn pick(&mut self, sampler: &mut Sampler, logits: &[f32]) -> Result<Pick> {
        if self.usage.generated_tokens + u32::from(self.in_flight) >= self.max_tokens {
            return Ok(Pick::Finish(FinishReason::MaxTokens));
        }
        let token = sampler.sample(logits)?;
        // From the logits as the model left them: `sample` works on a copy.
        self.picked = self.logprobs.map(|top| token_logprob(logits, token, top));
        Ok(if self.model.is_eog(token) {
            Pick::Finish(FinishReason::EndOfGeneration)
        } else {
            Pick::Decode(token)
        })
    }

    /// `token` is in memory at `pos`: the piece to deliver, and the stop string it
    /// completed, if any. Call [`TokenLoop::delivered`] once the piece is delivered.
    pub fn decoded(&mut self, token: Token) -> Result<(Piece, Option<FinishReason>)> {
        let (text, matched) = self.text.push(&self.model.token_to_piece(token, false)?);
        self.in_flight = true;
        let logprobs = self.picked.take().filter(|p| p.token == token).into_iter().collect();
        Ok((
            Piece { text, tokens: vec![token], logprobs },
            matched.map(|index| FinishReason::Stop { index: index as u32 }),
        ))
    }

    /// The piece of the last [`TokenLoop::decoded`] token was delivered: the token
    /// counts, and the next one goes after it.
    pub fn delivered(&mut self) {
        self.in_flight = false;
        self.usage.generated_tokens += 1;
        self.pos += 1;
    }

    /// Text still held back (after an error, or at the end).
    pub fn flush(&mut self) -> Option<Piece> {
        let text = self.text.flush();
        (!text.is_empty()).then(|| Piece { text, ..Piece::default() })
    }

    /// The outcome, once `finish` is decided and the held-back text flushed.
    pub fn outcome(&self, finish: FinishReason) -> Outcome {
        Outcome {
            finish,
            usage: GenerationUsage { generation: self.started.elapsed(), ..self.usage },
        }
    }
}

/// Run one generation on `ctx`. Errors other than a cancel (a full context, a grammar
/// that allows no token) are returned after memory is made to hold exactly what the
/// module doc says.
pub fn generate(
    ctx: &mut Context,
    sampler: &mut Sampler,
    request: &GenerateRequest,
    stop: Stop<'_>,
    sink: &mut dyn Sink,
) -> Result<Outcome> {
    let GenerateRequest { prompt, seq, .. } = request;
    let seq = *seq;
    if prompt.is_empty() && ctx.last_logits().is_err() {
        return Err(nothing_to_continue());
    }
    check_request(ctx.model(), sampler, request)?;

    let started = Instant::now();
    let cached = match prefill(ctx, prompt, seq, stop) {
        Ok(cached) => cached,
        Err(Error::Cancelled) => {
            return Ok(Outcome {
                finish: FinishReason::Cancelled,
                usage: GenerationUsage::default(),
            })
        }
        Err(e) => return Err(e),
    };
    let pos = ctx.seq_pos_max(seq)? + 1;
    let mut tokens = TokenLoop::new(
        ctx.model().clone(),
        request,
        pos,
        prompt.len() as u32,
        cached as u32,
        started.elapsed(),
    );
    let finish = loop {
        let token = match tokens.pick(sampler, ctx.last_logits()?)? {
            Pick::Decode(token) => token,
            Pick::Finish(reason) => break reason,
        };
        match ctx.decode(&Batch::sequence(&[token], tokens.pos(), seq), Some(stop)) {
            Ok(()) => {}
            Err(Error::Cancelled) => break FinishReason::Cancelled,
            Err(e) => {
                if let Some(rest) = tokens.flush() {
                    sink.deliver(rest);
                }
                return Err(e);
            }
        }
        let (piece, matched) = tokens.decoded(token)?;
        if !sink.deliver(piece) {
            // Not delivered, so not kept: memory holds only delivered tokens.
            ctx.seq_rm(seq, tokens.pos(), -1)?;
            break FinishReason::Cancelled;
        }
        tokens.delivered();
        if let Some(reason) = matched {
            break reason;
        }
    };
    if let Some(rest) = tokens.flush() {
        sink.deliver(rest);
    }
    let outcome = tokens.outcome(finish);
    ctx.tally(|t| t.generated(outcome.usage.generated_tokens.into()));
    Ok(outcome)
}

/// Decode `prompt` after the end of `seq`, logits for its last token: `Context::eval`,
/// the one all-or-nothing path (n-batch pieces, every earlier piece undone on failure).
/// Returns how many of its tokens were found in memory rather than computed.
fn prefill(ctx: &mut Context, prompt: &[Token], seq: i32, stop: Stop<'_>) -> Result<usize> {
    if prompt.is_empty() {
        return Ok(0);
    }
    ctx.eval_reusing(&[PromptPiece::Tokens(prompt.to_vec())], seq, Some(stop))
        .map(|(_, cached)| cached)
}

/// Bytes in, whole UTF-8 text out, with stop strings matched across token boundaries.
pub(crate) struct TextStream {
    pending: Vec<u8>,
    stops: Vec<Vec<u8>>,
}

impl TextStream {
    pub(crate) fn new(stops: &[String]) -> Self {
        Self { pending: Vec::new(), stops: stops.iter().map(|s| s.as_bytes().to_vec()).collect() }
    }

    /// Add a token's bytes. Returns the text that can be released now and, if a stop
    /// string now appears, its index (the text before it is released, the rest dropped).
    pub(crate) fn push(&mut self, bytes: &[u8]) -> (String, Option<usize>) {
        self.pending.extend_from_slice(bytes);
        let earliest = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| find(&self.pending, s).map(|at| (at, i)))
            .min();
        if let Some((at, index)) = earliest {
            let text = String::from_utf8_lossy(&self.pending[..at]).into_owned();
            self.pending.clear();
            return (text, Some(index));
        }
        // Hold back the longest tail that could still grow into a stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| (1..s.len()).rev().find(|&k| self.pending.ends_with(&s[..k])).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let (text, used) = whole_utf8(&self.pending[..self.pending.len() - hold]);
        self.pending.drain(..used);
        (text, None)
    }

    /// Everything still held back (at the end of generation).
    pub(crate) fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The text of `bytes` up to an incomplete character at the end (which stays for the
/// next token), with invalid sequences replaced by U+FFFD; and how many bytes it used.
fn whole_utf8(bytes: &[u8]) -> (String, usize) {
    let mut text = String::new();
    let mut used = 0;
    loop {
        match std::str::from_utf8(&bytes[used..]) {
            Ok(s) => {
                text.push_str(s);
                return (text, bytes.len());
            }
            Err(e) => {
                let valid = used + e.valid_up_to();
                // SAFETY-free: `from_utf8` just said these bytes are valid.
                text.push_str(std::str::from_utf8(&bytes[used..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        used = valid + n;
                    }
                    None => return (text, valid),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, Option<usize>, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut stream = TextStream::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            let (text, matched) = stream.push(p);
            out.push(text);
            if matched.is_some() {
                return (out, matched, stream.flush());
            }
        }
        let rest = stream.flush();
        (out, None, rest)
    }

    #[test]
    fn a_character_split_across_tokens_is_released_whole() {
        let euro = "€".as_bytes(); // 3 bytes
        let (out, matched, rest) = run(&[], &[b"a", &euro[..1], &euro[1..2], &euro[2..], b"b"]);
        assert_eq!(out, ["a", "", "", "€", "b"]);
        assert_eq!((matched, rest.as_str()), (None, ""));
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let (out, _, rest) = run(&[], &[b"a\xffb", b"\xe2\x82"]);
        assert_eq!(out, ["a\u{fffd}b", ""]);
        assert_eq!(rest, "\u{fffd}", "an incomplete character at the very end is flushed lossily");
    }

    #[test]
    fn stop_strings_match_across_pieces_and_their_prefix_is_held_back() {
        let (out, matched, rest) = run(&["</s>", "STOP"], &[b"hello <", b"/", b"s> after"]);
        assert_eq!(out, ["hello ", "", ""]);
        assert_eq!((matched, rest.as_str()), (Some(0), ""));
        // A held-back prefix that does not complete is released.
        let (out, matched, _) = run(&["STOP"], &[b"ST", b"ART"]);
        assert_eq!((out, matched), (vec!["".to_string(), "START".to_string()], None));
        // The earliest match wins, text before it is released with the match.
        let (out, matched, _) = run(&["b", "abc"], &[b"xab"]);
        assert_eq!((out, matched), (vec!["xa".to_string()], Some(0)));
    }
}
