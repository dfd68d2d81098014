//! The Rust guest SDK for llamabox plugins. It generates the `plugin` world's bindings
//! once (`llamabox:inference` and the WASI 0.2 interfaces it uses), so every Rust plugin
//! shares one set of types, and holds what each plugin would otherwise write again:
//! - [`sequence`]: a batch of one sequence, logits for its last token;
//! - [`argmax`] and [`greedy_next`]: greedy picking with defined NaN and tie rules;
//! - [`decode_with_timeout`]: a decode raced against a timer and cancelled in flight;
//! - [`digest`]: the FNV-1a digests tests compare logits and tokens by;
//! - [`filler`] and [`greedy_params`]: a long prompt to cancel, a greedy generation's
//!   parameters;
//! - [`args`]: the plugin's `--flag value` command line;
//! - [`outcome`]: a call's result as the `key: value` lines tests read it.
//!
//! A plugin for another world (`http-plugin`, a WASI 0.3 one) generates only what this
//! crate lacks with [`generate_world!`], which maps the rest onto this crate.

wit_bindgen::generate!({
    path: "../../wit",
    world: "plugin",
    generate_all,
});

pub mod args;

use std::time::Duration;

pub use llamabox::inference::{cancel, embeddings, generate, llm, media, types};

use cancel::CancelToken;
use generate::{FinishReason, GenerateParams};
use llm::{Batch, Context, Model};
use types::Error;
use wasi::clocks::monotonic_clock;
use wasi::io::poll;

/// Tokens of sequence 0 from position `first`, logits for the last one only (what a
/// prompt's prefill and each generated token need).
pub fn sequence(tokens: &[i32], first: i32) -> Batch {
    sequence_in(0, tokens, first)
}

/// [`sequence`] for sequence `seq`.
pub fn sequence_in(seq: i32, tokens: &[i32], first: i32) -> Batch {
    let n = tokens.len();
    Batch {
        tokens: tokens.to_vec(),
        positions: (first..first + n as i32).collect(),
        seq_ids: vec![seq; n],
        logits: (0..n).map(|i| i + 1 == n).collect(),
    }
}

/// The token with the largest logit: a NaN never wins, ties go to the lowest id (as
/// llama.cpp's greedy sampler picks), and a row with nothing above -inf gives 0.
pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (i, l);
        }
    }
    best.0 as i32
}

/// The greedy pick from the context's last decode: [`argmax`] of its last logits row.
pub fn greedy_next(ctx: &Context) -> Result<i32, Error> {
    Ok(argmax(&ctx.last_logits()?))
}

/// Bindings for a plugin of another world that includes `plugin` (`http-plugin`, the
/// WASI 0.3 `plugin-async`): wit-bindgen's `generate!` with the given `path` and
/// `world`, generating only what this crate lacks; llamabox's interfaces, `wasi:io/poll`
/// and the monotonic clock are this crate's, so their types are shared.
#[macro_export]
macro_rules! generate_world {
    ($($options:tt)*) => {
        wit_bindgen::generate!({
            $($options)*
            with: {
                "llamabox:inference/types@0.1.1": ::llamabox_guest::types,
                "llamabox:inference/cancel@0.1.1": ::llamabox_guest::cancel,
                "llamabox:inference/llm@0.1.1": ::llamabox_guest::llm,
                "llamabox:inference/media@0.1.1": ::llamabox_guest::media,
                "llamabox:inference/generate@0.1.1": ::llamabox_guest::generate,
                "llamabox:inference/embeddings@0.1.1": ::llamabox_guest::embeddings,
                "wasi:io/poll@0.2.12": ::llamabox_guest::wasi::io::poll,
                "wasi:clocks/monotonic-clock@0.2.12": ::llamabox_guest::wasi::clocks::monotonic_clock,
            },
            generate_all,
        });
    };
}

/// An `http-plugin` component (what `llamabox serve` runs) whose incoming handler is
/// `handler(request, out)`: the world's bindings as [`generate_world!`] makes them, the
/// handler's glue and the export. `path` is llamabox's `wit` folder, relative to the
/// plugin's manifest.
#[macro_export]
macro_rules! http_plugin {
    (path: $path:literal, handler: $handler:path $(,)?) => {
        $crate::generate_world!(
            path: $path,
            world: "http-plugin",
        );

        struct HttpPlugin;

        impl exports::wasi::http::incoming_handler::Guest for HttpPlugin {
            fn handle(request: wasi::http::types::IncomingRequest, out: wasi::http::types::ResponseOutparam) {
                $handler(request, out)
            }
        }

        export!(HttpPlugin);
    };
}

/// Decode `batch` on `ctx`, waiting at most `timeout`: when the timer fires first,
/// `token` is cancelled and the decode stops in flight (within one graph node), its
/// memory as before the call. Returns the decode's own result: `cancelled` if the timer
/// won.
pub fn decode_with_timeout(
    ctx: &Context,
    batch: &Batch,
    token: &CancelToken,
    timeout: Duration,
) -> Result<(), Error> {
    let pending = ctx.start_decode(batch, token)?;
    let done = pending.subscribe();
    let timer =
        monotonic_clock::subscribe_duration(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
    if !poll::poll(&[&done, &timer]).contains(&0) {
        token.cancel();
        done.block();
    }
    // The pollable is the pending call's child: dropped before the call is finished.
    drop(done);
    pending.finish()
}

/// `n` tokens of " the llama in the box" over and over: a prompt long enough to cancel
/// in flight, the same on every model.
pub fn filler(model: &Model, n: u32) -> Result<Vec<i32>, Error> {
    let words = model.tokenize(" the llama in the box", false, false)?;
    Ok(words.iter().copied().cycle().take(n as usize).collect())
}

/// A greedy generation of at most `max_tokens` on sequence 0, with no stop strings.
pub fn greedy_params(prompt: Vec<i32>, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        prompt,
        seq: 0,
        max_tokens,
        stop: Vec::new(),
        sampler: generate::greedy_sampler(),
        logprobs: None,
    }
}

/// A generation's finish reason as its WIT name (`stop 0`, `max-tokens`, …; `none`
/// before the end).
pub fn finish_name(reason: Option<FinishReason>) -> String {
    match reason {
        Some(FinishReason::Stop(i)) => format!("stop {i}"),
        Some(FinishReason::EndOfGeneration) => "end-of-generation".into(),
        Some(FinishReason::MaxTokens) => "max-tokens".into(),
        Some(FinishReason::Cancelled) => "cancelled".into(),
        None => "none".into(),
    }
}

/// A unit call's result as a line: `ok`, `cancelled`, or the error's kebab-case name
/// and message (`invalid-argument: …`), as the WIT names them.
pub fn outcome(result: Result<(), Error>) -> String {
    let (name, detail) = match result {
        Ok(()) => return "ok".into(),
        Err(Error::Cancelled) => return "cancelled".into(),
        Err(Error::ContextFull) => return "context-full".into(),
        Err(Error::InvalidArgument(m)) => ("invalid-argument", m),
        Err(Error::ModelNotFound(m)) => ("model-not-found", m),
        Err(Error::LimitExceeded(m)) => ("limit-exceeded", m),
        Err(Error::Backend(m)) => ("backend", m),
    };
    format!("{name}: {detail}")
}

/// FNV-1a digests: equal digests mean bitwise-equal logits (or equal token lists), so
/// a test can compare a plugin's numbers with the host's through one printed line.
pub mod digest {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;

    pub fn bytes(bytes: impl IntoIterator<Item = u8>) -> u64 {
        bytes.into_iter().fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
    }

    /// Over the values' bits, little-endian.
    pub fn logits(values: &[f32]) -> u64 {
        bytes(values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
    }

    pub fn tokens(tokens: &[i32]) -> u64 {
        bytes(tokens.iter().flat_map(|t| t.to_le_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_skips_nan_and_breaks_ties_low() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.25]), 1, "NaN never wins, even first");
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY, -1e30]), 2);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn sequences_ask_for_the_last_rows_logits() {
        let b = sequence_in(2, &[7, 8, 9], 5);
        assert_eq!(
            (b.tokens, b.positions, b.seq_ids, b.logits),
            (vec![7, 8, 9], vec![5, 6, 7], vec![2, 2, 2], vec![false, false, true])
        );
        assert!(sequence(&[], 0).tokens.is_empty());
    }

    #[test]
    fn digests_are_fnv1a() {
        // FNV-1a's published test vectors.
        assert_eq!(digest::bytes(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(digest::bytes(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(digest::bytes(*b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(digest::logits(&[1.0]), digest::bytes(1.0f32.to_bits().to_le_bytes()));
        assert_ne!(digest::logits(&[0.0]), digest::logits(&[-0.0]), "bits, not values");
        assert_eq!(digest::tokens(&[1, 2]), digest::bytes([1, 0, 0, 0, 2, 0, 0, 0]));
    }
}
