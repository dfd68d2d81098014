//! A llama context (its memory, i.e. KV cache) with an all-or-nothing, cancellable decode.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use super::cancel::{abort_callback, Stop};
use super::chunker::{Chunker, Pace, DEFAULT_LATENCY_TARGET};
use super::eval_scope::{eval_callback, in_eval_scope};
use super::model::Model;
use super::share::{SharedCores, Tally};
use super::threads::ThreadPool;
use super::Token;
use super::{backend, Error, Result};

mod embed;
pub use embed::Pooling;

/// One piece of a prompt for [`Context::eval`]: text tokens, or a media chunk's
/// embeddings (`non_causal`: decoded in one ubatch with non-causal attention).
#[derive(Clone, Debug, PartialEq)]
pub enum PromptPiece {
    /// Text tokens, decoded in batches of up to n-batch.
    Tokens(Vec<Token>),
    /// A media chunk's embeddings.
    Embeddings {
        /// One row of the model's embedding width per position, row after row.
        embd: Vec<f32>,
        /// Whether the chunk's positions attend to each other both ways (decoded in one
        /// ubatch).
        non_causal: bool,
    },
}

/// Settings of a new context, already resolved (no defaults left to pick).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextParams {
    /// KV cells of the context's memory, over all its sequences (llama.cpp pads it).
    pub n_ctx: u32,
    /// Most tokens one decode takes (a logical batch).
    pub n_batch: u32,
    /// Most tokens computed in one graph (a physical batch); at most `n_batch`.
    pub n_ubatch: u32,
    /// Sequences the context holds side by side (at most [`MAX_SEQ`]).
    pub n_seq_max: u32,
    /// Threads each decode runs on (at most [`MAX_THREADS`]).
    pub n_threads: u32,
}

/// Rows to decode: four parallel columns, as in `llama_batch`, one sequence per row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// Each row's token.
    pub tokens: Vec<Token>,
    /// Each row's position in its sequence.
    pub positions: Vec<i32>,
    /// Each row's sequence (below the context's n-seq-max).
    pub seq_ids: Vec<i32>,
    /// Whether the decode keeps each row's logits.
    pub logits: Vec<bool>,
}

impl Batch {
    /// Tokens of one sequence at consecutive positions from `first_pos`; logits for the
    /// last row only.
    pub fn sequence(tokens: &[Token], first_pos: i32, seq: i32) -> Self {
        let n = tokens.len();
        Self {
            tokens: tokens.to_vec(),
            positions: (first_pos..).take(n).collect(),
            seq_ids: vec![seq; n],
            logits: (0..n).map(|i| i + 1 == n).collect(),
        }
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Rows at all, four columns of one length, at most `n_batch` rows.
    pub fn check_shape(&self, n_batch: u32) -> Result<()> {
        let n = self.len();
        let invalid = |what: String| Err(Error::InvalidArgument(what));
        if n == 0 {
            return invalid("empty batch".into());
        }
        if self.positions.len() != n || self.seq_ids.len() != n || self.logits.len() != n {
            return invalid(format!(
                "batch columns differ in length: {} tokens, {} positions, {} sequence ids, {} logits flags",
                n,
                self.positions.len(),
                self.seq_ids.len(),
                self.logits.len()
            ));
        }
        if n > n_batch as usize {
            return invalid(format!("batch of {n} tokens is larger than n-batch {n_batch}"));
        }
        Ok(())
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// A llama.cpp context on one model: its memory (the KV cache) for up to n-seq-max
/// sequences and its own thread team. A decode that fails or is cancelled leaves the
/// memory as it was.
pub struct Context {
    ptr: NonNull<sys::llama_context>,
    params: ContextParams,
    /// Which rows of the last successful decode have logits; empty after a failed one.
    logit_rows: Vec<bool>,
    /// Rows of that decode that llama.cpp did not compute (reused from the leftover):
    /// row r's logits are its row r - logit_offset.
    logit_offset: usize,
    /// What sequence 0 holds, token by token, while that is known: in a context of one
    /// sequence whose memory came from token decodes only. `None` otherwise.
    history: Option<Vec<Token>>,
    /// Tokens an earlier run left at positions `0..` of sequence 0 when the context was
    /// parked ([`Context::park`]): still in memory, but not part of what the context
    /// holds, which reads as empty. A prompt evaluated or decoded from position 0 that
    /// starts with them is not computed again for that part; anything else removes
    /// them first.
    leftover: Vec<Token>,
    /// The threads every graph of this context runs on; freed after the context.
    team: ThreadPool,
    /// Where this context's decodes and cancels are counted (its run's), if anywhere.
    tally: Option<Arc<dyn Tally>>,
    /// Cores it shares with others who use every thread ([`Context::share_cores`]).
    cores: Option<Arc<dyn SharedCores>>,
    /// How fast this context computes, which places the eval callback's boundaries
    /// ([`super::eval_scope`]): on a GPU, where the abort callback does not reach, and
    /// beside others on the cores, where the turn passes.
    pace: Pace,
    /// A fixed budget instead of the paced one ([`Context::set_device_chunk_work`]).
    chunk_work: Option<u64>,
    /// How long the last decode computed, its waits for turns on shared cores left
    /// out: what sizes the next piece of a long input ([`super::Pieces::observe`]).
    computed: std::time::Duration,
    /// Decodes read only the hidden states (per-row embeddings), so they end after them
    /// ([`Chunker::hidden_states_only`]): the output head is never computed.
    hidden_states_only: bool,
    /// Whether embedding decodes may end after the hidden states (a test turns it off
    /// to compare with the output head computed).
    embeddings_end_early: bool,
    /// Declared last: the model must outlive the context.
    model: Arc<Model>,
}

// SAFETY: a llama_context is used by one thread at a time (`&mut self` for every call
// that computes); it may move between threads.
unsafe impl Send for Context {}

/// Largest n_seq_max llama.cpp accepts (LLAMA_MAX_SEQ).
pub const MAX_SEQ: u32 = 256;

/// Most threads ggml's CPU backend takes (GGML_MAX_N_THREADS).
pub const MAX_THREADS: u32 = 512;

/// llama.cpp pads n-ctx, and each sequence's share of it, to a multiple of this.
const N_CTX_PAD: u64 = 256;

impl ContextParams {
    /// The n-ctx llama.cpp will allocate KV cells for, or why it would refuse these
    /// params (or assert on them). Mirrors `llama_context`'s constructor: n-ctx is padded
    /// to 256, split evenly over the sequences, each share padded to 256 again; n-batch
    /// is cut to n-ctx; every sequence needs an output row, so n-seq-max must fit in
    /// that n-batch (else `GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)`).
    pub fn allocated_n_ctx(&self) -> Result<u32> {
        let Self { n_ctx, n_batch, n_ubatch, n_seq_max, n_threads } = *self;
        let invalid = |what: String| Err(Error::InvalidArgument(what));
        for (name, value) in [
            ("n-ctx", n_ctx),
            ("n-batch", n_batch),
            ("n-ubatch", n_ubatch),
            ("n-seq-max", n_seq_max),
            ("n-threads", n_threads),
        ] {
            if value == 0 {
                return invalid(format!("{name} must be at least 1"));
            }
        }
        if n_ubatch > n_batch {
            return invalid(format!("n-ubatch {n_ubatch} is larger than n-batch {n_batch}"));
        }
        if n_seq_max > MAX_SEQ {
            return invalid(format!(
                "n-seq-max {n_seq_max} is above llama.cpp's maximum {MAX_SEQ}"
            ));
        }
        if n_threads > MAX_THREADS {
            return invalid(format!("n-threads {n_threads} is above ggml's maximum {MAX_THREADS}"));
        }
        let usable_batch = n_batch.min(n_ctx);
        if n_seq_max > usable_batch {
            let cut = if n_ctx < n_batch {
                format!(" (n-batch {n_batch} is cut to n-ctx {n_ctx})")
            } else {
                String::new()
            };
            return invalid(format!(
                "n-seq-max {n_seq_max} needs an n-batch of at least {n_seq_max} (one output row per sequence), but n-batch is {usable_batch}{cut}"
            ));
        }
        let pad = |n: u64| n.div_ceil(N_CTX_PAD) * N_CTX_PAD;
        let per_seq = pad(pad(n_ctx as u64) / n_seq_max as u64);
        let total = per_seq * n_seq_max as u64;
        u32::try_from(total).map_err(|_| {
            Error::InvalidArgument(format!(
                "n-ctx {n_ctx} padded for {n_seq_max} sequences ({per_seq} cells each) is above 2^32 cells"
            ))
        })
    }
}

/// Decode one token on a small throwaway context, as llama.cpp's own tools do before
/// their first request: the model's mmap'd weights are paged in and ggml's buffers
/// touched, so the first real request does not pay for it (about 0.14 s on SmolLM2
/// here). Blocking.
pub fn warm_up(model: Arc<Model>, n_threads: u32) -> Result<()> {
    let token = model.bos().unwrap_or(0);
    let params = ContextParams { n_ctx: 16, n_batch: 16, n_ubatch: 16, n_seq_max: 1, n_threads };
    let mut context = Context::new(model, params)?;
    context.decode(&Batch::sequence(&[token], 0, 0), None)
}

/// A history for a new or cleared context: tracked for one sequence only.
fn fresh_history(params: ContextParams) -> Option<Vec<Token>> {
    (params.n_seq_max == 1).then(Vec::new)
}

impl Context {
    /// A context on `model` with `params` (checked first: see
    /// [`ContextParams::allocated_n_ctx`]), each sequence in a KV stream of its own
    /// (its share of n-ctx). Blocking: it allocates the memory.
    pub fn new(model: Arc<Model>, params: ContextParams) -> Result<Self> {
        Self::create(model, params, false)
    }

    /// A context whose sequences share one pool of n-ctx KV cells (llama.cpp's unified
    /// KV): each holds what it has decoded, however long, until the pool is full
    /// ([`Error::ContextFull`]). Whoever shares it out keeps the sequences within it.
    pub fn new_unified(model: Arc<Model>, params: ContextParams) -> Result<Self> {
        Self::create(model, params, true)
    }

    fn create(model: Arc<Model>, params: ContextParams, unified: bool) -> Result<Self> {
        backend::init();
        let ContextParams { n_ctx, n_batch, n_ubatch, n_seq_max, n_threads } = params;
        params.allocated_n_ctx()?;
        // A failed decode is undone by cutting each sequence back (`all_or_nothing`);
        // recurrent state cannot be cut back to an earlier position.
        // SAFETY: `model` is an `Arc`, so the model is live; both only read its architecture.
        if unsafe {
            sys::llama_model_is_recurrent(model.as_ptr())
                || sys::llama_model_is_hybrid(model.as_ptr())
        } {
            return Err(Error::InvalidArgument(
                "this model keeps recurrent state, which cannot be rolled back after a failed or cancelled decode: llamabox does not run it".into(),
            ));
        }
        let threads = n_threads as i32; // at most MAX_THREADS
        let team = ThreadPool::new(threads)?;
        // SAFETY: start from llama.cpp's defaults (the struct gains fields between versions),
        // with sizes `allocated_n_ctx` checked above (llama.cpp asserts on some others). The
        // model is live, and outlives the context: the context keeps its `Arc` (`model`).
        let (ptr, reason) = backend::with_errors(|| unsafe {
            let mut p = sys::llama_context_default_params();
            p.n_ctx = n_ctx;
            p.n_batch = n_batch;
            p.n_ubatch = n_ubatch;
            p.n_seq_max = n_seq_max;
            p.kv_unified = unified;
            p.n_threads = threads;
            p.n_threads_batch = threads;
            // `eval_callback` is a `'static` fn that reads only this thread's scope; outside
            // one it wants no node, and each split computes whole as without it.
            p.cb_eval = Some(eval_callback);
            p.cb_eval_user_data = std::ptr::null_mut();
            sys::llama_init_from_model(model.as_ptr(), p)
        });
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Backend(format!("llama.cpp could not create the context: {reason}"))
        })?;
        // SAFETY: the team outlives the context (dropped after it, see `Drop`); one team
        // serves both generation and prompt batches, as llama-bench does.
        unsafe { sys::llama_attach_threadpool(ptr.as_ptr(), team.as_ptr(), team.as_ptr()) };
        // llama.cpp may round n_ctx up (padding) or clamp n_batch; report what it chose.
        // SAFETY: `ptr` is the live context just created; these getters read its params.
        let actual = unsafe {
            ContextParams {
                n_ctx: sys::llama_n_ctx(ptr.as_ptr()),
                n_batch: sys::llama_n_batch(ptr.as_ptr()),
                n_ubatch: sys::llama_n_ubatch(ptr.as_ptr()),
                n_seq_max: sys::llama_n_seq_max(ptr.as_ptr()),
                n_threads,
            }
        };
        let history = fresh_history(actual);
        Ok(Self {
            ptr,
            params: actual,
            logit_rows: Vec::new(),
            logit_offset: 0,
            history,
            leftover: Vec::new(),
            team,
            tally: None,
            cores: None,
            pace: Pace::new(DEFAULT_LATENCY_TARGET),
            chunk_work: None,
            computed: std::time::Duration::ZERO,
            hidden_states_only: false,
            embeddings_end_early: true,
            model,
        })
    }

    /// Make the context read as new for its next user: empty memory, no logits, its
    /// work counted nowhere. What sequence 0 holds is kept as leftover tokens when it is
    /// known, so that a next prompt starting the same way reuses it ([`Context::eval`]).
    /// Whoever parks a context decides who may use it next: the leftover is invisible
    /// to the next user, except in how fast its prompt is evaluated.
    pub fn park(&mut self) {
        self.logit_rows.clear();
        self.tally = None;
        if !self.leftover.is_empty() {
            return; // parked again, untouched since
        }
        // SAFETY: the live context's memory (see `memory`); sequence 0 always exists, and
        // an empty one reads -1.
        let end = unsafe { sys::llama_memory_seq_pos_max(self.memory(), 0) };
        match self.history.take() {
            Some(tokens) if !tokens.is_empty() && end + 1 == tokens.len() as i32 => {
                self.leftover = tokens;
                self.history = Some(Vec::new());
            }
            _ => self.clear_all(),
        }
    }

    /// Tokens at the start of sequence 0 kept from before the last [`Context::park`]
    /// and not yet reused or removed.
    pub fn leftover(&self) -> &[Token] {
        &self.leftover
    }

    /// The settings llama.cpp chose (n-ctx padded, n-batch cut to n-ctx).
    pub fn params(&self) -> ContextParams {
        self.params
    }

    /// The model this context runs; the context keeps it loaded.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Cells each sequence may use (n-ctx split over the sequences, as allocated).
    pub fn n_ctx_seq(&self) -> u32 {
        // SAFETY: a live context; reads a number.
        unsafe { sys::llama_n_ctx_seq(self.ptr.as_ptr()) }
    }

    /// The context's memory: owned by the context, live while `self` is.
    fn memory(&self) -> sys::llama_memory_t {
        // SAFETY: `self.ptr` is live until `Drop`; this reads a pointer it owns.
        unsafe { sys::llama_get_memory(self.ptr.as_ptr()) }
    }

    fn check_seq(&self, seq: i32) -> Result<()> {
        if (0..self.params.n_seq_max as i32).contains(&seq) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "sequence id {seq} is outside [0, {})",
                self.params.n_seq_max
            )))
        }
    }

    /// `ContextFull` unless `n_tokens` more cells fit after what `seq` holds, in the
    /// cells one sequence may use. Checked before computing anything: llama.cpp finds
    /// out one n-batch piece at a time, after computing the pieces before (an eval of
    /// 10 000 media chunks into n-ctx 8192 failed after 281 s of encoding).
    fn check_room(&self, seq: i32, n_tokens: usize) -> Result<()> {
        let held = usize::try_from(self.seq_pos_max(seq)? + 1).unwrap_or(0);
        let per_seq = self.n_ctx_seq() as usize;
        if held.saturating_add(n_tokens) > per_seq {
            return Err(Error::ContextFull);
        }
        Ok(())
    }

    /// Highest position of `seq` in memory, -1 when empty (a leftover is not counted).
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.check_seq(seq)?;
        if !self.leftover.is_empty() {
            return Ok(-1); // the leftover is not part of what the context holds
        }
        // SAFETY: the live context's memory; `seq` checked in [0, n_seq_max) above (out of
        // range llama.cpp aborts the process with an assert).
        Ok(unsafe { sys::llama_memory_seq_pos_max(self.memory(), seq) })
    }

    /// Remove the leftover tokens from memory (before any call that does not reuse them).
    fn drop_leftover(&mut self) {
        if !self.leftover.is_empty() {
            // SAFETY: a live memory; removing a whole sequence always succeeds.
            unsafe { sys::llama_memory_seq_rm(self.memory(), 0, 0, -1) };
            self.leftover.clear();
        }
    }

    /// Keep the longest start of the leftover that `tokens` (about to be evaluated into
    /// sequence 0 from position 0) begins with, at most `most` tokens, and make it part
    /// of the sequence again; the rest of the leftover goes. `None`: nothing to match.
    /// Returns how many tokens were kept.
    fn reuse_leftover(&mut self, tokens: Option<&[Token]>, most: usize) -> usize {
        let Some(tokens) = tokens.filter(|_| !self.leftover.is_empty()) else {
            self.drop_leftover();
            return 0;
        };
        let kept = self.leftover.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(most);
        // SAFETY: a live memory; removing a sequence's tail always succeeds.
        unsafe { sys::llama_memory_seq_rm(self.memory(), 0, kept as i32, -1) };
        let mut history = std::mem::take(&mut self.leftover);
        history.truncate(kept);
        self.history = Some(history);
        kept
    }

    /// After a failed call that reused `kept` tokens: memory is back to those, and they
    /// are leftover again, so the context reads as empty, as it did before the call.
    fn restore_leftover(&mut self, kept: usize) {
        if kept > 0 {
            self.leftover = self.history.replace(Vec::new()).unwrap_or_default();
        }
    }

    /// Remove positions `[p0, p1)` of `seq` (`p1 < 0`: to the end). Removing part of a
    /// sequence from the middle is refused by llama.cpp for some memories; that is an error.
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<()> {
        self.check_seq(seq)?;
        if p0 < 0 {
            return Err(Error::InvalidArgument(format!("p0 {p0} is negative")));
        }
        self.drop_leftover();
        // SAFETY: the live context's memory, `&mut self` (no decode in flight); `seq` checked
        // in range and `p0 >= 0`; a removal the memory cannot do returns false.
        if unsafe { sys::llama_memory_seq_rm(self.memory(), seq, p0, p1) } {
            if let Some(tokens) = &mut self.history {
                let (p0, len) = (p0 as usize, tokens.len());
                if p1 < 0 || p1 as usize >= len {
                    tokens.truncate(p0);
                } else if p0 < len && (p1 as usize) > p0 {
                    self.history = None; // a hole: no longer a prefix of anything
                }
            }
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "this memory cannot remove [{p0}, {p1}) from sequence {seq}"
            )))
        }
    }

    /// Empty the context's memory. A leftover is not part of it and stays (a plugin
    /// that clears a context it just created still reuses it).
    pub fn clear(&mut self) {
        self.logit_rows.clear();
        if self.leftover.is_empty() {
            self.clear_all();
        }
    }

    /// Empty memory, leftover included.
    fn clear_all(&mut self) {
        // SAFETY: the live context's memory, `&mut self` (no decode in flight); no logits
        // of the old contents are read after it (`logit_rows` is cleared here).
        unsafe { sys::llama_memory_clear(self.memory(), true) };
        self.logit_rows.clear();
        self.leftover.clear();
        self.history = fresh_history(self.params);
    }

    /// Logits of `row` of the last successful decode, if that row asked for them.
    pub fn logits_ith(&self, row: u32) -> Result<&[f32]> {
        if !self.logit_rows.get(row as usize).copied().unwrap_or(false) {
            return Err(Error::InvalidArgument(format!(
                "row {row} has no logits: the last successful decode did not ask for them"
            )));
        }
        // Rows with logits come after the reused ones.
        let computed_row = (row as usize).checked_sub(self.logit_offset).ok_or_else(|| {
            Error::Backend(format!("row {row} was reused, not computed, and has no logits"))
        })?;
        // SAFETY: a row of the last successful decode that has an output.
        let ptr = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), computed_row as i32) };
        if ptr.is_null() {
            return Err(Error::Backend(format!("llama.cpp has no logits for row {row}")));
        }
        // SAFETY: non-null, so a row of llama.cpp's logits buffer: n_vocab floats (the
        // model's width), which live until the next decode or free, both of which need
        // `&mut self`, so not while the returned slice borrows `self`.
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.model.n_vocab() as usize) })
    }

    /// Everything llama.cpp would otherwise assert on or reject, checked up front so the
    /// caller gets a message that says what is wrong.
    fn check_batch(&self, batch: &Batch) -> Result<()> {
        let invalid = |what: String| Err(Error::InvalidArgument(what));
        batch.check_shape(self.params.n_batch)?;
        self.model.check_tokens(&batch.tokens)?;
        // Each sequence must continue where its memory ends, one position per row.
        let mut next: BTreeMap<i32, i32> = BTreeMap::new();
        for (row, (&seq, &pos)) in batch.seq_ids.iter().zip(&batch.positions).enumerate() {
            self.check_seq(seq)?;
            let expected = match next.get(&seq) {
                Some(&p) => p,
                None => self.seq_pos_max(seq)? + 1,
            };
            if pos != expected {
                return invalid(format!(
                    "row {row}: sequence {seq} must continue at position {expected}, got {pos}"
                ));
            }
            let after = pos
                .checked_add(1)
                .ok_or_else(|| Error::InvalidArgument("position overflow".into()))?;
            next.insert(seq, after);
        }
        Ok(())
    }

    /// Count this context's decoded rows, reused tokens, generated tokens and cancelled
    /// calls in `tally` (its run's) until it is parked.
    pub fn set_tally(&mut self, tally: Arc<dyn Tally>) {
        self.tally = Some(tally);
    }

    /// Decode in turns on `cores` from now on: beside a batch whose steps use every
    /// thread, a context of its own computes only in its turns, cuts a long input into
    /// pieces of about a turn ([`SharedCores::pieces`]), and a long decode passes the
    /// cores at its graph's boundaries once it is due ([`super::CoreTurn::pass_if_due`]).
    pub fn share_cores(&mut self, cores: Option<Arc<dyn SharedCores>>) {
        self.cores = cores;
    }

    /// Compute from now on with threads that each keep to one CPU, where the team uses
    /// every CPU the process may run on (else as before): for a context that computes
    /// only in turns on cores shared with others who use every thread (a batch, and
    /// contexts of their own beside it), so that no two teams ever run at once and a
    /// team woken for its turn never has two threads queued on one CPU
    /// (`ThreadPool::pinned` says why).
    pub fn pin_threads(&mut self) -> Result<()> {
        let team = ThreadPool::pinned(self.params.n_threads as i32)?;
        // SAFETY: `&mut self`: no graph runs on this context. llama.cpp hands the
        // attached team to the CPU backend at each graph, so the old one is unused once
        // the new one is attached, and is freed after it; the new one lives as long as
        // the context (dropped after it, see `Drop`).
        unsafe { sys::llama_attach_threadpool(self.ptr.as_ptr(), team.as_ptr(), team.as_ptr()) };
        self.team = team;
        Ok(())
    }

    /// Put this context's idle threads to sleep now rather than let them spin for its
    /// next graph: for whoever runs it in turns on shared cores (a batch), when the turn
    /// it ends goes to someone waiting. Its next decode wakes them.
    pub fn rest_threads(&self) {
        self.team.rest();
    }

    /// A fixed work budget between the eval callback's boundaries instead of the paced
    /// one (1: a boundary after every matmul and attention op; `u64::MAX`: none unless a
    /// cancel is seen), where there are boundaries: on a GPU, and beside others on the
    /// cores. For tests and the bench's chunked-vs-unchunked rows.
    pub fn set_device_chunk_work(&mut self, units: Option<u64>) {
        self.chunk_work = units;
    }

    /// Compute the output head in embedding decodes too, as llama.cpp's graph has it:
    /// the reference that ending them after the hidden states is checked against.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn compute_head_in_embeddings(&mut self, on: bool) {
        self.embeddings_end_early = !on;
    }

    /// Count work in this context's tally, if it has one.
    pub(crate) fn tally(&self, count: impl FnOnce(&dyn Tally)) {
        if let Some(tally) = &self.tally {
            count(tally.as_ref());
        }
    }

    /// Decode `batch`. With a `stop`, llama.cpp polls it after every graph node and
    /// stops in flight; without one this is the plain llama.cpp call (no callback).
    ///
    /// All or nothing: on any error, memory is restored to exactly what it was before
    /// the call (llama.cpp itself keeps the ubatches an aborted decode finished).
    pub fn decode(&mut self, batch: &Batch, stop: Option<Stop<'_>>) -> Result<()> {
        if stop.is_some_and(|s| s.is_set()) {
            self.tally(|t| t.cancelled());
            return Err(Error::Cancelled);
        }
        self.check_batch(batch)?;
        if self.leftover.is_empty() {
            return self.all_or_nothing(&batch.seq_ids, |ctx| ctx.decode_checked(batch, stop));
        }
        // A parked context (one sequence, so the batch starts it at position 0): rows
        // before the first that wants logits can be the leftover's, and one row is
        // always computed.
        let first_out = batch.logits.iter().position(|&l| l).unwrap_or(batch.len());
        let kept = self.reuse_leftover(Some(&batch.tokens), first_out.min(batch.len() - 1));
        let rest = Batch {
            tokens: batch.tokens[kept..].to_vec(),
            positions: batch.positions[kept..].to_vec(),
            seq_ids: batch.seq_ids[kept..].to_vec(),
            logits: batch.logits[kept..].to_vec(),
        };
        match self.all_or_nothing(&rest.seq_ids, |ctx| ctx.decode_checked(&rest, stop)) {
            Ok(()) => {
                // Rows are the caller's: row r's logits are llama.cpp's row r - kept.
                self.logit_rows = batch.logits.clone();
                self.logit_offset = kept;
                self.tally(|t| t.reused(kept as u64));
                Ok(())
            }
            Err(e) => {
                self.restore_leftover(kept);
                Err(e)
            }
        }
    }

    /// One `llama_decode` of a batch `check_batch` accepted; no rollback of its own.
    fn decode_checked(&mut self, batch: &Batch, stop: Option<Stop<'_>>) -> Result<()> {
        let mut seq_ptrs: Vec<*mut i32> =
            batch.seq_ids.iter().map(|s| s as *const i32 as *mut i32).collect();
        let mut n_seq_id = vec![1i32; batch.len()];
        let mut logits: Vec<i8> = batch.logits.iter().map(|&l| l as i8).collect();
        // For `decode_raw`'s contract: every pointer points into a vector that outlives
        // the call; llama.cpp reads the batch and never writes through these pointers.
        let raw = sys::llama_batch {
            n_tokens: batch.len() as i32,
            token: batch.tokens.as_ptr().cast_mut(),
            embd: std::ptr::null_mut(),
            pos: batch.positions.as_ptr().cast_mut(),
            n_seq_id: n_seq_id.as_mut_ptr(),
            seq_id: seq_ptrs.as_mut_ptr(),
            logits: logits.as_mut_ptr(),
        };
        // SAFETY: as said above `raw`: `batch` (checked: every column `batch.len()` long),
        // `seq_ptrs`, `n_seq_id` and `logits` are alive and unmoved until this returns.
        unsafe { self.decode_raw(raw, &batch.logits, stop) }?;
        if let Some(tokens) = &mut self.history {
            tokens.extend_from_slice(&batch.tokens); // one sequence, continued in order
        }
        Ok(())
    }

    /// Decode media embeddings (`n × n_embd_inp` floats, from a projector) into `seq` at
    /// the positions after its end, in n-batch pieces; logits for the last row if
    /// `logits_last`. `non_causal` runs the whole chunk in one ubatch with non-causal
    /// attention, as some projectors require. All or nothing, like [`Context::decode`].
    pub fn decode_embeddings(
        &mut self,
        embd: &[f32],
        seq: i32,
        non_causal: bool,
        logits_last: bool,
        stop: Option<Stop<'_>>,
    ) -> Result<()> {
        if stop.is_some_and(|s| s.is_set()) {
            self.tally(|t| t.cancelled());
            return Err(Error::Cancelled);
        }
        self.check_seq(seq)?;
        self.drop_leftover();
        self.all_or_nothing(&[seq], |ctx| {
            ctx.embeddings_in(seq, embd, non_causal, logits_last, stop)
        })
    }

    /// Evaluate a prompt into `seq` from its current end: each piece's tokens or
    /// embeddings in turn, in n-batch pieces, logits for the very last row. Returns the
    /// sequence's new length. One all-or-nothing call: if any piece fails or is
    /// stopped, memory is as it was before the first.
    ///
    /// On a parked context, the part of a leading token piece that equals the
    /// leftover's start is kept rather than computed again (at least the last row is
    /// always computed); a failure makes it leftover again.
    pub fn eval(
        &mut self,
        pieces: &[PromptPiece],
        seq: i32,
        stop: Option<Stop<'_>>,
    ) -> Result<i32> {
        self.eval_reusing(pieces, seq, stop).map(|(end, _)| end)
    }

    /// [`Context::eval`], and how many of the leading tokens were kept from the
    /// leftover rather than computed (what a generation reports as cached).
    pub(crate) fn eval_reusing(
        &mut self,
        pieces: &[PromptPiece],
        seq: i32,
        stop: Option<Stop<'_>>,
    ) -> Result<(i32, usize)> {
        if stop.is_some_and(|s| s.is_set()) {
            self.tally(|t| t.cancelled());
            return Err(Error::Cancelled);
        }
        self.check_seq(seq)?;
        let width = (self.model.n_embd_inp() as usize).max(1);
        let rows = |p: &PromptPiece| match p {
            PromptPiece::Tokens(tokens) => tokens.len(),
            PromptPiece::Embeddings { embd, .. } => embd.len() / width,
        };
        self.check_room(seq, pieces.iter().map(rows).fold(0, usize::saturating_add))?;
        let first = match pieces.first() {
            Some(PromptPiece::Tokens(tokens)) if seq == 0 => Some(tokens.as_slice()),
            _ => None,
        };
        // The last row's logits are wanted: a prompt of one piece keeps one row to compute.
        let most =
            first
                .map_or(0, |t| if pieces.len() == 1 { t.len().saturating_sub(1) } else { t.len() });
        let reused = self.reuse_leftover(first, most);
        let last = pieces.len().checked_sub(1);
        let result = self.all_or_nothing(&[seq], |ctx| {
            pieces.iter().enumerate().try_for_each(|(i, piece)| {
                let logits_last = Some(i) == last;
                match piece {
                    PromptPiece::Tokens(tokens) => {
                        let skip = if i == 0 { reused } else { 0 };
                        ctx.tokens_in(seq, &tokens[skip..], logits_last, stop)
                    }
                    PromptPiece::Embeddings { embd, non_causal } => {
                        ctx.embeddings_in(seq, embd, *non_causal, logits_last, stop)
                    }
                }
            })
        });
        if let Err(e) = result {
            self.restore_leftover(reused);
            return Err(e);
        }
        self.tally(|t| t.reused(reused as u64));
        self.seq_pos_max(seq).map(|end| (end + 1, reused))
    }

    /// `tokens` appended to `seq` in n-batch pieces (beside a batch: pieces of about a
    /// turn on the shared cores each, see [`SharedCores::pieces`]); no rollback of
    /// its own.
    fn tokens_in(
        &mut self,
        seq: i32,
        tokens: &[Token],
        logits_last: bool,
        stop: Option<Stop<'_>>,
    ) -> Result<()> {
        let n_batch = self.params.n_batch as usize;
        let mut pieces = self.cores.as_ref().map(|cores| cores.pieces(n_batch));
        let mut start = 0;
        while start < tokens.len() {
            let rows = pieces.as_ref().map_or(n_batch, |p| p.rows().clamp(1, n_batch));
            let piece = &tokens[start..(start + rows).min(tokens.len())];
            let last_piece = start + piece.len() == tokens.len();
            let mut batch = Batch::sequence(piece, self.seq_pos_max(seq)? + 1, seq);
            batch.logits = (0..piece.len())
                .map(|r| logits_last && last_piece && r + 1 == piece.len())
                .collect();
            self.check_batch(&batch)?;
            self.decode_checked(&batch, stop)?;
            if let Some(pieces) = &mut pieces {
                pieces.observe(piece.len(), self.computed);
            }
            start += piece.len();
        }
        Ok(())
    }

    /// Embeddings appended to `seq` (see [`Context::decode_embeddings`]); no rollback
    /// of its own.
    fn embeddings_in(
        &mut self,
        seq: i32,
        embd: &[f32],
        non_causal: bool,
        logits_last: bool,
        stop: Option<Stop<'_>>,
    ) -> Result<()> {
        let width = self.model.n_embd_inp() as usize;
        if width == 0 || embd.is_empty() || !embd.len().is_multiple_of(width) {
            return Err(Error::InvalidArgument(format!(
                "{} floats are not a whole number of {width}-wide embeddings",
                embd.len()
            )));
        }
        // From a model with M-RoPE positions, llama.cpp reads an embedding batch's
        // positions as four per row (one per section), past the one per row given here.
        // SAFETY: the model is live (`self.model` is an `Arc`); reads a field.
        let rope = unsafe { sys::llama_model_rope_type(self.model.as_ptr()) };
        if rope == sys::LLAMA_ROPE_TYPE_MROPE || rope == sys::LLAMA_ROPE_TYPE_IMROPE {
            return Err(Error::InvalidArgument(
                "this model takes multi-dimensional (M-RoPE) positions for embeddings, which llamabox does not decode yet".into(),
            ));
        }
        let n = embd.len() / width;
        let first = self.seq_pos_max(seq)? + 1;
        self.history = None; // not tokens: nothing a later prompt could match
        if non_causal && n > self.params.n_ubatch as usize {
            return Err(Error::InvalidArgument(format!(
                "this media chunk has {n} embeddings and must be decoded in one ubatch, but n-ubatch is {}",
                self.params.n_ubatch
            )));
        }
        let piece = if non_causal { n } else { self.params.n_batch as usize };
        if non_causal {
            // SAFETY: a live context, `&mut self` (no decode in flight); a flag the next
            // decodes read, set back below.
            unsafe { sys::llama_set_causal_attn(self.ptr.as_ptr(), false) };
        }
        let result = (0..n).step_by(piece).try_for_each(|start| {
            let rows = piece.min(n - start);
            let positions: Vec<i32> = (first + start as i32..).take(rows).collect();
            let mut seq_ids = vec![seq; rows];
            let mut seq_ptrs: Vec<*mut i32> = seq_ids.iter_mut().map(|s| s as *mut i32).collect();
            let mut n_seq_id = vec![1i32; rows];
            let flags: Vec<bool> = (0..rows).map(|r| logits_last && start + r + 1 == n).collect();
            let mut logits: Vec<i8> = flags.iter().map(|&l| l as i8).collect();
            // For `decode_raw`'s contract: as in `decode_checked`; `embd` outlives the call.
            let raw = sys::llama_batch {
                n_tokens: rows as i32,
                token: std::ptr::null_mut(),
                embd: embd[start * width..(start + rows) * width].as_ptr().cast_mut(),
                pos: positions.as_ptr().cast_mut(),
                n_seq_id: n_seq_id.as_mut_ptr(),
                seq_id: seq_ptrs.as_mut_ptr(),
                logits: logits.as_mut_ptr(),
            };
            // SAFETY: as said above `raw`: `rows` rows of `width` floats from `embd`, and
            // `positions`, `seq_ids`, `seq_ptrs`, `n_seq_id`, `logits` (`rows` entries each)
            // all alive and unmoved until this returns; not an M-RoPE model (checked).
            unsafe { self.decode_raw(raw, &flags, stop) }
        });
        if non_causal {
            // SAFETY: as above; causal attention back on, as `new` made the context.
            unsafe { sys::llama_set_causal_attn(self.ptr.as_ptr(), true) };
        }
        result
    }

    /// Logits of the last row of the last successful decode, if it asked for them.
    pub fn last_logits(&self) -> Result<&[f32]> {
        match self.logit_rows.len() {
            0 => Err(Error::InvalidArgument(
                "there is no successful decode to read logits from".into(),
            )),
            n => self.logits_ith(n as u32 - 1),
        }
    }

    /// Run `f`; if it fails, remove from every sequence in `seqs` whatever lies past
    /// where it ended before. Valid because every decode continues its sequences
    /// (checked up front), so all a failed call can have added lies past that end.
    fn all_or_nothing(
        &mut self,
        seqs: &[i32],
        f: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let mut seqs = seqs.to_vec();
        seqs.sort_unstable();
        seqs.dedup();
        // SAFETY: the live context's memory; every id in `seqs` was checked in range by the
        // caller (`check_batch`, `check_seq`).
        let ends: Vec<(i32, i32)> = seqs
            .iter()
            .map(|&s| (s, unsafe { sys::llama_memory_seq_pos_max(self.memory(), s) }))
            .collect();
        self.logit_rows.clear();
        let result = f(self);
        if result.is_err() {
            self.logit_rows.clear();
            // SAFETY: the live context's memory; the same checked ids as `ends`.
            let undone = ends.iter().all(|&(seq, end)| unsafe {
                sys::llama_memory_seq_rm(self.memory(), seq, end + 1, -1)
            });
            if let (Some(tokens), Some(&(0, end))) = (&mut self.history, ends.first()) {
                tokens.truncate((end + 1) as usize);
            }
            if !undone {
                // Cannot happen for the memories `new` accepts (a KV cache removes any
                // tail); if it ever does, say so rather than leave a half-applied call.
                self.clear_all();
                return Err(Error::Backend(format!(
                    "a failed call ({}) could not be rolled back: the context's memory was cleared",
                    result.err().map_or_else(String::new, |e| e.to_string())
                )));
            }
        }
        result
    }

    /// One `llama_decode`, with the abort callback installed for it when there is a stop.
    ///
    /// # Safety
    ///
    /// `raw` must be a batch llama.cpp can read for the whole call: `raw.n_tokens` rows in
    /// each of `pos`, `n_seq_id`, `seq_id` (each pointing at `n_seq_id[i]` ids in range)
    /// and `logits`, and either `token` (`n_tokens` ids in the vocabulary) or `embd`
    /// (`n_tokens × n_embd_inp` floats). An `embd` batch must not go to a model with
    /// M-RoPE positions: llama.cpp then reads 4 positions per row. llama.cpp copies the
    /// batch and never writes through these pointers, so they may come from shared borrows.
    unsafe fn decode_raw(
        &mut self,
        raw: sys::llama_batch,
        logit_rows: &[bool],
        stop: Option<Stop<'_>>,
    ) -> Result<()> {
        let mut turn = self.cores.as_ref().map(|cores| cores.turn());
        let ctx = self.ptr;
        let decode = || {
            backend::with_errors(|| match &stop {
                Some(stop) => {
                    // SAFETY: `_installed` is dropped at the end of this arm, right after the
                    // decode, and `stop` (this function's argument) outlives the arm.
                    let _installed = unsafe { AbortCallback::install(ctx, stop) };
                    // SAFETY: `raw` by this function's contract; `ctx` is live and
                    // `&mut self` means no other call runs on it.
                    unsafe { sys::llama_decode(ctx.as_ptr(), raw) }
                }
                // SAFETY: as above, with no abort callback installed.
                None => unsafe { sys::llama_decode(ctx.as_ptr(), raw) },
            })
        };
        // On a GPU the abort callback reaches only the CPU's part of the graph: the eval
        // callback's boundaries stop the device's. A stopped decode returns success with
        // garbage in what its broken-off splits left, so it is a cancel here, and the
        // caller's all-or-nothing rolls its memory back. Beside others on the cores (a
        // batch), the boundaries are also where this decode passes the cores to them once
        // it has held them a turn; on the CPU the abort callback still does the stopping.
        // A decode of per-row embeddings ends after the hidden states, in a scope too.
        let on_device = self.model.device().is_some();
        let device_stop = on_device && stop.is_some();
        let (ret, reason) = if device_stop || turn.is_some() || self.hidden_states_only {
            let none: [Stop<'_>; 0] = [];
            let scope_stop = stop.filter(|_| on_device).unwrap_or(Stop::Any(&none));
            // Beside others, boundaries come twice a turn, so it passes at most half a
            // turn late: at the latency target's, an embedding beside a stream held the
            // cores 13 ms (p50) of a 4 ms turn between the stream's steps.
            let budget = self.chunk_work.unwrap_or_else(|| match &turn {
                Some(turn) => self.pace.budget_within(turn.length() / 2),
                None if device_stop => self.pace.budget(),
                None => u64::MAX,
            });
            let mut chunker = Chunker::with_budget(budget);
            if self.hidden_states_only {
                chunker = chunker.hidden_states_only();
            }
            // Handing the cores over, the team's idle threads rest: spinning for this
            // context's next graph, they took a core from the batch (beside an embedding
            // at 2 threads its steps took 10.8 ms p50, 8.4 with them resting; traced).
            let team = &self.team;
            let mut pass = || {
                if let Some(turn) = turn.as_mut() {
                    turn.pass_if_due(&mut || team.rest());
                }
            };
            let started = std::time::Instant::now();
            let (out, scope) = in_eval_scope(scope_stop, chunker, Some(&mut pass), decode);
            if turn.as_ref().is_some_and(|t| t.others_wait()) {
                team.rest();
            }
            let waited = turn.as_ref().map_or(std::time::Duration::ZERO, |t| t.waited());
            self.computed = started.elapsed().saturating_sub(waited);
            self.pace.observe(scope.units, self.computed);
            if scope.stopped {
                self.tally(|t| t.cancelled());
                return Err(Error::Cancelled);
            }
            out
        } else {
            let started = std::time::Instant::now();
            let ret = decode();
            self.computed = started.elapsed();
            ret
        };
        match ret {
            0 => {
                self.logit_rows = logit_rows.to_vec();
                self.logit_offset = 0;
                self.tally(|t| t.decoded(raw.n_tokens.max(0) as u64));
                Ok(())
            }
            1 => Err(Error::ContextFull),
            -1 => Err(Error::InvalidArgument(format!("llama.cpp rejected the batch: {reason}"))),
            2 => {
                self.tally(|t| t.cancelled());
                Err(Error::Cancelled)
            }
            _ => Err(Error::Backend(format!("llama_decode failed ({ret}): {reason}"))),
        }
    }
}

/// The abort callback, installed for one call and removed when dropped, so a context
/// never holds a pointer to a finished call's `Stop`. The guard borrows that `Stop`, so
/// the compiler sees that it cannot outlive it.
struct AbortCallback<'s>(NonNull<sys::llama_context>, PhantomData<&'s Stop<'s>>);

impl<'s> AbortCallback<'s> {
    /// Point `ctx`'s abort callback at `stop` (a pointer into the caller's frame).
    ///
    /// # Safety
    ///
    /// `ctx` must be a live context, and the guard must be dropped, not leaked (e.g.
    /// `mem::forget`): only its `Drop` takes the pointer out of llama.cpp again, and the
    /// next decode would read a freed `Stop` otherwise.
    unsafe fn install(ctx: NonNull<sys::llama_context>, stop: &'s Stop<'_>) -> Self {
        let data = stop as *const Stop as *mut std::ffi::c_void;
        // SAFETY: a live context (the caller's contract); `abort_callback` reads `data` as
        // a `Stop`, which it is, alive for `'s`, and the guard's drop removes it before
        // then.
        unsafe { sys::llama_set_abort_callback(ctx.as_ptr(), Some(abort_callback), data) };
        Self(ctx, PhantomData)
    }
}

impl Drop for AbortCallback<'_> {
    fn drop(&mut self) {
        // SAFETY: the context `install` was given, still live (the guard lives inside one
        // call on it); no callback and null data is llama.cpp's "none".
        unsafe { sys::llama_set_abort_callback(self.0.as_ptr(), None, std::ptr::null_mut()) };
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `&mut self` proves no call is running on this context. Its thread team
        // (a field) is freed after this, once nothing can compute on it.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}
