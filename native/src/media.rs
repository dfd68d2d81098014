//! Images and audio through mtmd: tokenizing a prompt with media markers into chunks,
//! and encoding media chunks into embeddings, stoppable in flight.
//!
//! clip has no abort callback, so the stop goes through the scheduler's eval callback
//! (see `chunker`). The callback is installed once per media context; a thread-local
//! scope (`eval_scope::in_eval_scope`) ties it to one call's `Stop` for that call
//! only, so a long-lived media context never holds a pointer to a finished call's
//! state.

use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;

use super::cancel::Stop;
use super::chunker::{Chunker, Pace, DEFAULT_LATENCY_TARGET};
use super::eval_scope::{eval_callback, in_eval_scope};
use super::model::Model;
use super::share::{SharedCores, Tally};
use super::Token;
use super::{backend, Error, Result};

/// One media input for `tokenize`, matched in order with the prompt's markers.
#[derive(Clone, Debug, PartialEq)]
pub enum MediaInput {
    /// Packed RGB, `width * height * 3` bytes.
    Image {
        /// Pixels per row.
        width: u32,
        /// Rows.
        height: u32,
        /// The pixels, row after row, three bytes (R, G, B) each.
        rgb: Vec<u8>,
    },
    /// Mono PCM at the projector's sample rate.
    Audio {
        /// The samples, finite, at least two.
        samples: Vec<f32>,
    },
}

/// Host caps on media inputs, checked before anything is allocated natively.
#[derive(Clone, Copy, Debug)]
pub struct MediaCaps {
    /// Most pixels an image may have on either side.
    pub max_image_side: u32,
    /// Most samples one audio input may have.
    pub max_audio_samples: usize,
}

/// What a [`Chunk`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    /// Text tokens.
    Text,
    /// An image, preprocessed for the projector.
    Image,
    /// Audio, preprocessed for the projector.
    Audio,
}

/// One chunk of a tokenized prompt. Read-only once made, so it is shared (`Arc`) by the
/// guest's handle and any call running on it.
pub struct Chunk {
    ptr: NonNull<sys::mtmd_input_chunk>,
    /// The media context that made it: mtmd asserts when one projector encodes
    /// another's preprocessed data, so a chunk is encoded only by its maker.
    owner: MediaContextId,
    /// Estimated native bytes it holds (see [`Chunk::native_bytes`]).
    bytes: usize,
}

// SAFETY: an mtmd_input_chunk is plain data (token vectors, preprocessed floats) owned by
// this `Chunk` alone (a copy, see `into_chunks`) and tied to no thread, so it may be
// freed from any thread.
unsafe impl Send for Chunk {}
// SAFETY: never mutated after tokenize: every mtmd call on it takes a const pointer and
// only reads, so shared use from several threads is reads only.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// Whether the chunk is text, an image or audio.
    pub fn kind(&self) -> ChunkKind {
        // SAFETY: `self.ptr` is a chunk this `Chunk` owns, live until `Drop`; a read.
        match unsafe { sys::mtmd_input_chunk_get_type(self.ptr.as_ptr()) } {
            sys::MTMD_INPUT_CHUNK_TYPE_IMAGE => ChunkKind::Image,
            sys::MTMD_INPUT_CHUNK_TYPE_AUDIO => ChunkKind::Audio,
            _ => ChunkKind::Text,
        }
    }

    /// Tokens (text) or embeddings (media) the chunk adds.
    pub fn n_tokens(&self) -> usize {
        // SAFETY: as in `kind`: an owned, live chunk; a read.
        unsafe { sys::mtmd_input_chunk_get_n_tokens(self.ptr.as_ptr()) }
    }

    /// Positions the chunk takes in a sequence.
    pub fn n_pos(&self) -> i32 {
        // SAFETY: as in `kind`: an owned, live chunk; a read.
        unsafe { sys::mtmd_input_chunk_get_n_pos(self.ptr.as_ptr()) }
    }

    /// The media context that made this chunk.
    pub fn owner(&self) -> MediaContextId {
        self.owner
    }

    /// Native bytes the chunk holds, estimated (mtmd does not report its sizes): its
    /// text tokens, or for media, per token, the embedding it encodes to plus a 16×16
    /// RGB patch of preprocessed floats (what one token stands for in common
    /// projectors; spectrogram frames are smaller).
    pub fn native_bytes(&self) -> usize {
        self.bytes
    }

    /// The token ids of a text chunk (empty for media).
    pub fn text_tokens(&self) -> &[Token] {
        let mut n = 0usize;
        // SAFETY: an owned, live chunk (as in `kind`) and a valid `n` to write the count
        // to; for a media chunk mtmd writes 0 and returns null.
        let ptr = unsafe { sys::mtmd_input_chunk_get_tokens_text(self.ptr.as_ptr(), &mut n) };
        if ptr.is_null() || self.kind() != ChunkKind::Text {
            return &[];
        }
        // SAFETY: non-null: the data of the text chunk's token vector, `n` tokens owned by
        // the chunk, which `&self` keeps alive and nothing mutates (see `Sync` above).
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: a copy this `Chunk` owns alone (mtmd_input_chunk_copy in `into_chunks`,
        // not an entry of a list), freed once, here.
        unsafe { sys::mtmd_input_chunk_free(self.ptr.as_ptr()) }
    }
}

/// Bookkeeping per chunk, here, in mtmd and in a resource table: charged even to an
/// empty chunk so that counts of chunks are bounded too.
const CHUNK_OVERHEAD: usize = 256;

/// Preprocessed floats one media token stands for, at most, in common projectors (a
/// 16×16 RGB patch).
const PIXELS_PER_TOKEN: usize = 16 * 16 * 3;

/// Names one media context for the life of the process (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MediaContextId(u64);

/// A projector (mmproj) bound to a text model. One call at a time (`&mut self`).
pub struct MediaContext {
    ptr: NonNull<sys::mtmd_context>,
    id: MediaContextId,
    n_embd: usize,
    /// This context's speed and the work budget between encode boundaries it gives.
    pace: Pace,
    /// A fixed budget instead of the paced one (`set_chunk_work`).
    fixed_chunk_work: Option<u64>,
    /// Counts encodes that ended cancelled (a run's usage), if anything does.
    tally: Option<Arc<dyn Tally>>,
    /// Cores it shares with batches that use every thread ([`MediaContext::share_cores`]).
    cores: Option<Arc<dyn SharedCores>>,
    /// Declared last: the text model must outlive the media context.
    model: Arc<Model>,
}

// SAFETY: an mtmd_context (and the clip contexts and ggml scheduler in it) is used by
// one thread at a time: every call that computes takes `&mut self`, and `&self` ones read
// fixed fields only. Nothing in it is tied to the thread that made it, so it may move
// threads. (Not Sync: `&self` from two threads is never needed.)
unsafe impl Send for MediaContext {}

impl MediaContext {
    /// Load a projector for `model`. Blocking (reads the projector's weights).
    pub fn new(path: &Path, model: Arc<Model>, n_threads: u32) -> Result<Self> {
        backend::init();
        if !path.is_file() {
            return Err(Error::Backend(format!("projector file {} not found", path.display())));
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::InvalidArgument("projector path contains a NUL byte".into()))?;
        let threads = i32::try_from(n_threads.max(1)).unwrap_or(i32::MAX);
        // SAFETY: defaults first (the struct gains fields between versions). `c_path` is a
        // NUL-terminated string alive for the call; the text model is live (the `Arc` is
        // kept in `self.model`, dropped after `mtmd_free`). `eval_callback` is a `'static`
        // fn with null user data: it finds its state through a thread-local instead.
        let ptr = unsafe {
            let mut p = sys::mtmd_context_params_default();
            // The projector goes where the text model's layers went.
            p.use_gpu = model.device().is_some();
            p.print_timings = false;
            p.n_threads = threads;
            p.cb_eval = Some(eval_callback);
            p.cb_eval_user_data = std::ptr::null_mut();
            sys::mtmd_init_from_file(c_path.as_ptr(), model.as_ptr(), p)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Backend(format!(
                "mtmd could not load projector {} for this model (see its log)",
                path.display()
            ))
        })?;
        let n_embd = model.n_embd_inp() as usize;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = MediaContextId(NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        Ok(Self {
            ptr,
            id,
            n_embd,
            pace: Pace::new(DEFAULT_LATENCY_TARGET),
            fixed_chunk_work: None,
            tally: None,
            cores: None,
            model,
        })
    }

    /// Encode in turns on `cores` from now on (see [`Context::share_cores`](super::Context::share_cores)).
    pub fn share_cores(&mut self, cores: Option<Arc<dyn SharedCores>>) {
        self.cores = cores;
    }

    /// Count this context's cancelled encodes in `tally` (a run's).
    pub fn set_tally(&mut self, tally: Arc<dyn Tally>) {
        self.tally = Some(tally);
    }

    fn count_cancel(&self) {
        if let Some(tally) = &self.tally {
            tally.cancelled();
        }
    }

    /// This media context's id, which the chunks it makes carry.
    pub fn id(&self) -> MediaContextId {
        self.id
    }

    /// The text model the projector is bound to; the media context keeps it loaded.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// `Ok` if this media context made `chunk` (and so may encode or evaluate it).
    pub fn check_owns(&self, chunk: &Chunk) -> Result<()> {
        check_owner(self.id, chunk)
    }

    /// Fixed work units between boundaries where an encode can stop, instead of the
    /// budget paced to the latency target: smaller stops sooner after a cancel and
    /// synchronises more often. For tests that need a boundary at every matmul and
    /// attention op.
    pub fn set_chunk_work(&mut self, units: u64) {
        self.fixed_chunk_work = Some(units.max(1));
    }

    /// How long a cancelled encode may run on after the cancel (store → return), about
    /// (default 10 ms). The context measures its own speed on every encode and places
    /// boundaries that far apart; it cannot go below one matmul or attention op.
    pub fn set_latency_target(&mut self, target: Duration) {
        self.pace = Pace::new(target.max(Duration::from_micros(100)));
        self.fixed_chunk_work = None;
    }

    /// The work units the next cancellable encode will put between boundaries.
    pub fn chunk_work(&self) -> u64 {
        self.fixed_chunk_work.unwrap_or_else(|| self.pace.budget())
    }

    /// Whether the projector takes images.
    pub fn supports_vision(&self) -> bool {
        // SAFETY: `self.ptr` is live until `Drop`; reads a fixed property.
        unsafe { sys::mtmd_support_vision(self.ptr.as_ptr()) }
    }

    /// Whether the projector takes audio.
    pub fn supports_audio(&self) -> bool {
        // SAFETY: as in `supports_vision`.
        unsafe { sys::mtmd_support_audio(self.ptr.as_ptr()) }
    }

    /// Sample rate audio input must have, if the projector takes audio.
    pub fn audio_sample_rate(&self) -> Option<u32> {
        // SAFETY: as in `supports_vision`.
        let rate = unsafe { sys::mtmd_get_audio_sample_rate(self.ptr.as_ptr()) };
        (rate > 0).then_some(rate as u32)
    }

    /// Whether a media chunk must be decoded in one ubatch with non-causal attention.
    pub fn needs_non_causal(&self, chunk: &Chunk) -> bool {
        // SAFETY: a live context (as in `supports_vision`) and a live chunk (`&Chunk`); both
        // only read (mtmd looks at the chunk's type and the projector's).
        unsafe { sys::mtmd_decode_use_non_causal(self.ptr.as_ptr(), chunk.ptr.as_ptr()) }
    }

    /// Whether media positions are multi-dimensional (M-RoPE), which llamabox does not
    /// decode yet.
    pub fn uses_mrope(&self) -> bool {
        // SAFETY: as in `supports_vision`.
        unsafe { sys::mtmd_decode_use_mrope(self.ptr.as_ptr()) }
    }

    /// The text that marks where each media input goes in a prompt.
    pub fn marker() -> &'static str {
        // SAFETY: mtmd_default_marker returns a NUL-terminated string literal: static,
        // never null.
        unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }.to_str().unwrap_or("<__media__>")
    }

    /// Split `prompt` into text and media chunks; media inputs fill the markers in order.
    /// The chunks may hold at most `budget` native bytes ([`Chunk::native_bytes`]): the
    /// prompt is tokenized one media input at a time (text up to and including its
    /// marker, as mtmd splits it anyway), and tokenizing stops with `LimitExceeded` at
    /// the input that crosses the budget, so memory never runs more than one input
    /// ahead of what is charged (1000 tiny images were refused only after a 1.3 GB peak).
    pub fn tokenize(
        &mut self,
        prompt: &str,
        inputs: &[MediaInput],
        caps: MediaCaps,
        budget: usize,
    ) -> Result<Vec<Arc<Chunk>>> {
        let invalid = |m: String| Err(Error::InvalidArgument(m));
        let marker = Self::marker();
        let markers = prompt.matches(marker).count();
        if markers != inputs.len() {
            return invalid(format!(
                "the prompt has {markers} media markers but {} inputs were given",
                inputs.len()
            ));
        }
        let (mut chunks, mut held, mut rest) = (Vec::new(), 0usize, prompt);
        for i in 0..=inputs.len() {
            let (segment, media) = match rest.find(marker) {
                Some(at) if i < inputs.len() => (&rest[..at + marker.len()], &inputs[i..=i]),
                _ => (rest, &inputs[..0]),
            };
            rest = &rest[segment.len()..];
            // Only the first part of an empty prompt may be empty (mtmd still gives it
            // the start-of-text token).
            if segment.is_empty() && i > 0 {
                continue;
            }
            let part = self.tokenize_part(segment, media, i, caps, i == 0)?;
            held = part.iter().map(|c| c.native_bytes()).fold(held, usize::saturating_add);
            if held > budget {
                return Err(Error::limit("max-chunk-bytes", held, budget));
            }
            chunks.extend(part);
        }
        Ok(chunks)
    }

    /// mtmd's tokenizer on one part of a prompt (`first`: the part that starts it, and
    /// gets the model's start-of-text token); `index` numbers its input in messages.
    fn tokenize_part(
        &mut self,
        prompt: &str,
        inputs: &[MediaInput],
        index: usize,
        caps: MediaCaps,
        first: bool,
    ) -> Result<Vec<Arc<Chunk>>> {
        let invalid = |m: String| Err(Error::InvalidArgument(m));
        let text = CString::new(prompt)
            .map_err(|_| Error::InvalidArgument("prompt contains a NUL byte".into()))?;
        let bitmaps = inputs
            .iter()
            .map(|input| self.bitmap(index, input, caps))
            .collect::<Result<Vec<_>>>()?;
        let raw: Vec<*const sys::mtmd_bitmap> =
            bitmaps.iter().map(|b| b.0.as_ptr().cast_const()).collect();
        let input = sys::mtmd_input_text {
            text: text.as_ptr(),
            text_len: prompt.len(),
            add_special: first,
            parse_special: true,
        };
        let list = ChunkList::new()?;
        // SAFETY: a live context (`&mut self`; mtmd_tokenize only reads it); a live, empty
        // list it fills; `input.text` is `text`, NUL-terminated, alive across the call;
        // `raw` holds `raw.len()` live bitmaps (owned by `bitmaps`, dropped after the call).
        let (ret, reason) = backend::with_errors(|| unsafe {
            sys::mtmd_tokenize(self.ptr.as_ptr(), list.0.as_ptr(), &input, raw.as_ptr(), raw.len())
        });
        match ret {
            0 => list.into_chunks(self.id, self.n_embd),
            1 => invalid(format!("media markers and inputs do not match: {reason}")),
            2 => invalid(format!("a media input could not be preprocessed: {reason}")),
            other => Err(Error::Backend(format!("mtmd_tokenize failed ({other}): {reason}"))),
        }
    }

    fn bitmap(&self, index: usize, input: &MediaInput, caps: MediaCaps) -> Result<Bitmap> {
        let invalid = |m: String| Err(Error::InvalidArgument(format!("input {index}: {m}")));
        let ptr = match input {
            MediaInput::Image { width, height, rgb } => {
                if !self.supports_vision() {
                    return invalid("this projector takes no images".into());
                }
                let max = caps.max_image_side;
                if *width == 0 || *height == 0 || *width > max || *height > max {
                    return invalid(format!(
                        "image {width}x{height} is outside 1..={max} per side"
                    ));
                }
                let expected = *width as usize * *height as usize * 3;
                if rgb.len() != expected {
                    return invalid(format!(
                        "image {width}x{height} needs {expected} RGB bytes, got {}",
                        rgb.len()
                    ));
                }
                // SAFETY: `rgb` is exactly `width * height * 3` bytes (checked above), what
                // mtmd reads; it copies them into the bitmap.
                unsafe { sys::mtmd_bitmap_init(*width, *height, rgb.as_ptr()) }
            }
            MediaInput::Audio { samples } => {
                if !self.supports_audio() {
                    return invalid("this projector takes no audio".into());
                }
                // mtmd asserts on a single sample: at least two.
                if samples.len() < 2 || samples.len() > caps.max_audio_samples {
                    let max = caps.max_audio_samples;
                    return invalid(format!(
                        "audio of {} samples is outside 2..={max}",
                        samples.len()
                    ));
                }
                if !samples.iter().all(|s| s.is_finite()) {
                    return invalid("audio samples must be finite".into());
                }
                // SAFETY: `samples` has `samples.len()` floats (at least 2, checked), which
                // mtmd copies into the bitmap.
                unsafe { sys::mtmd_bitmap_init_from_audio(samples.len(), samples.as_ptr()) }
            }
        };
        NonNull::new(ptr)
            .map(Bitmap)
            .ok_or_else(|| Error::Backend("could not allocate a bitmap".into()))
    }

    /// Encode a media chunk into `n_tokens × n_embd` embeddings. With a `stop`, the
    /// encode stops at the next chunk boundary once it is set, and returns `Cancelled`
    /// (the partial output is discarded); without one this is the plain mtmd call.
    pub fn encode(&mut self, chunk: &Chunk, stop: Option<Stop<'_>>) -> Result<Vec<f32>> {
        self.check_owns(chunk)?;
        match chunk.kind() {
            ChunkKind::Text => {
                return Err(Error::InvalidArgument("a text chunk has nothing to encode".into()))
            }
            ChunkKind::Image if !self.supports_vision() => {
                return Err(Error::InvalidArgument("this projector takes no images".into()))
            }
            ChunkKind::Audio if !self.supports_audio() => {
                return Err(Error::InvalidArgument("this projector takes no audio".into()))
            }
            _ => {}
        }
        if stop.is_some_and(|s| s.is_set()) {
            self.count_cancel();
            return Err(Error::Cancelled);
        }
        let mut turn = self.cores.as_ref().map(|cores| cores.turn());
        // Beside others on the cores, the boundaries are also where the encode passes the
        // cores to them once it has held them a turn.
        let none: [Stop<'_>; 0] = [];
        let (ret, reason) = match stop.or(turn.is_some().then_some(Stop::Any(&none))) {
            Some(stop) => {
                let chunker = Chunker::with_budget(self.chunk_work());
                let mut pass = || {
                    if let Some(turn) = turn.as_mut() {
                        // mtmd's graphs start and join their own threads: none idle.
                        turn.pass_if_due(&mut || {});
                    }
                };
                let started = Instant::now();
                let ((ret, reason), scope) = in_eval_scope(stop, chunker, Some(&mut pass), || {
                    // SAFETY: a live context, `&mut self` (one encode at a time), and a live
                    // media chunk this context made (`check_owns` above: mtmd asserts on
                    // another projector's data). The eval callback it runs reads only the
                    // scope this closure runs in.
                    backend::with_errors(|| unsafe {
                        sys::mtmd_encode_chunk(self.ptr.as_ptr(), chunk.ptr.as_ptr())
                    })
                });
                let waited = turn.as_ref().map_or(Duration::ZERO, |t| t.waited());
                self.pace.observe(scope.units, started.elapsed().saturating_sub(waited));
                // mtmd returns 0 for a stopped encode: the scope knows it stopped.
                if scope.stopped {
                    self.count_cancel();
                    return Err(Error::Cancelled);
                }
                (ret, reason)
            }
            // SAFETY: as above; outside a scope the eval callback stops nothing.
            None => backend::with_errors(|| unsafe {
                sys::mtmd_encode_chunk(self.ptr.as_ptr(), chunk.ptr.as_ptr())
            }),
        };
        if ret != 0 {
            return Err(Error::Backend(format!("mtmd_encode_chunk failed ({ret}): {reason}")));
        }
        let len = chunk.n_tokens() * self.n_embd;
        // SAFETY: a live context; returns its output buffer's pointer.
        let out = unsafe { sys::mtmd_get_output_embd(self.ptr.as_ptr()) };
        if out.is_null() {
            return Err(Error::Backend("mtmd produced no embeddings".into()));
        }
        // SAFETY: mtmd documents n_tokens × n_embd_inp floats after a successful encode
        // (`n_embd` is the text model's n_embd_inp); the buffer is the context's, which
        // `&mut self` keeps from any other encode until the copy (`to_vec`) is made.
        Ok(unsafe { std::slice::from_raw_parts(out, len) }.to_vec())
    }
}

/// `Ok` if the media context `id` made `chunk`.
pub fn check_owner(id: MediaContextId, chunk: &Chunk) -> Result<()> {
    if chunk.owner == id {
        Ok(())
    } else {
        Err(Error::InvalidArgument("this chunk was made by another media context: only the media context that tokenized it may encode it".into()))
    }
}

impl MediaContext {
    /// The pieces `Context::eval` takes for `chunks`: text chunks' tokens, media chunks
    /// encoded (each stoppable by `stop`). Only this media context's chunks.
    pub fn encode_for_eval(
        &mut self,
        chunks: &[Arc<Chunk>],
        stop: Option<Stop<'_>>,
    ) -> Result<Vec<super::PromptPiece>> {
        chunks
            .iter()
            .map(|chunk| match chunk.kind() {
                ChunkKind::Text => {
                    self.check_owns(chunk)?;
                    Ok(super::PromptPiece::Tokens(chunk.text_tokens().to_vec()))
                }
                _ => Ok(super::PromptPiece::Embeddings {
                    embd: self.encode(chunk, stop)?,
                    non_causal: self.needs_non_causal(chunk),
                }),
            })
            .collect()
    }
}

impl Drop for MediaContext {
    fn drop(&mut self) {
        // SAFETY: owned, freed once; no encode runs (`&mut self`). Chunks it made are
        // copies that do not point into it, so they may outlive it. The text model is
        // freed after (the `model` field drops after this).
        unsafe { sys::mtmd_free(self.ptr.as_ptr()) }
    }
}

struct Bitmap(NonNull<sys::mtmd_bitmap>);

impl Drop for Bitmap {
    fn drop(&mut self) {
        // SAFETY: made by mtmd_bitmap_init*, owned by this `Bitmap` alone (mtmd_tokenize
        // copies what it needs), freed once.
        unsafe { sys::mtmd_bitmap_free(self.0.as_ptr()) }
    }
}

struct ChunkList(NonNull<sys::mtmd_input_chunks>);

impl ChunkList {
    fn new() -> Result<Self> {
        // SAFETY: no arguments; a null return is handled.
        NonNull::new(unsafe { sys::mtmd_input_chunks_init() })
            .map(Self)
            .ok_or_else(|| Error::Backend("could not allocate a chunk list".into()))
    }

    /// Copy each chunk out, so each can be owned (and freed) on its own.
    fn into_chunks(self, owner: MediaContextId, n_embd: usize) -> Result<Vec<Arc<Chunk>>> {
        // SAFETY: a live list this `ChunkList` owns; a read.
        let n = unsafe { sys::mtmd_input_chunks_size(self.0.as_ptr()) };
        let chunks = (0..n)
            .map(|i| {
                // SAFETY: `i < n`, so mtmd_input_chunks_get returns a live entry of the list
                // (alive until `self` drops, after this); the copy is a new chunk owned by
                // the `Chunk` made from it.
                let copy = unsafe {
                    sys::mtmd_input_chunk_copy(sys::mtmd_input_chunks_get(self.0.as_ptr(), i))
                };
                NonNull::new(copy)
                    .map(|ptr| Chunk { ptr, owner, bytes: 0 })
                    .ok_or_else(|| Error::Backend("could not copy a chunk".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        let f32s = std::mem::size_of::<f32>();
        Ok(chunks
            .into_iter()
            .map(|mut chunk| {
                let tokens = chunk.n_tokens();
                chunk.bytes = CHUNK_OVERHEAD
                    + match chunk.kind() {
                        ChunkKind::Text => tokens * std::mem::size_of::<Token>(),
                        _ => f32s * tokens * (n_embd + PIXELS_PER_TOKEN),
                    };
                Arc::new(chunk)
            })
            .collect())
    }
}

impl Drop for ChunkList {
    fn drop(&mut self) {
        // SAFETY: made by mtmd_input_chunks_init, owned alone, freed once; it frees its
        // entries, which no `Chunk` points at (they hold copies).
        unsafe { sys::mtmd_input_chunks_free(self.0.as_ptr()) }
    }
}
