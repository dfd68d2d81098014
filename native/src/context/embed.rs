//! Embeddings from a text context: the hidden state after the model's final norm, per
//! row or pooled per input. A child module of `context` so it can switch llama.cpp's
//! embedding output on for one call only.
//!
//! A model whose GGUF sets a pooling type (a dedicated embedding model) pools in its
//! own graph: `embed` then returns llama.cpp's pooled vectors, for that pooling only,
//! and per-row vectors are not available.
//!
//! Memory: an embedding call uses the context's memory as scratch. It empties it
//! first (so the same input always meets the same state and gives bitwise the same
//! vector) and leaves it empty, whatever the outcome.

use llama_cpp_sys_2 as sys;

use super::{Batch, Context};
use crate::cancel::Stop;
use crate::Pieces;
use crate::Token;
use crate::{Error, Result};

/// How the rows of one input become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every row.
    Mean,
    /// The first row (the CLS / BOS position).
    Cls,
    /// The last row (what a causal model has seen all of the input at).
    Last,
}

impl Context {
    /// One vector (n-embd floats) per input, input `i` decoded as sequence `i`, all in
    /// one batch: at most n-seq-max inputs and n-batch tokens in all. (A model that
    /// pools by itself: one decode per input, each at most n-ubatch tokens.)
    pub fn embed(
        &mut self,
        inputs: &[Vec<Token>],
        pooling: Pooling,
        normalize: bool,
        stop: Option<Stop<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
            return Err(Error::InvalidArgument(
                "every input to embed needs at least one token".into(),
            ));
        }
        if inputs.len() > self.params.n_seq_max as usize {
            return Err(Error::InvalidArgument(format!(
                "{} inputs are more than n-seq-max {} (one sequence each)",
                inputs.len(),
                self.params.n_seq_max
            )));
        }
        if let Some(own) = self.own_pooling()? {
            if own != pooling {
                return Err(Error::InvalidArgument(format!(
                    "this model pools its embeddings itself ({own:?}); ask for that pooling"
                )));
            }
            // One input per decode: llama.cpp's own pooling of a second sequence in the
            // same batch differed from that input's vector alone (checked on a causal
            // llama with mean pooling), so inputs are not batched together here.
            let ubatch = self.params.n_ubatch as usize;
            if let Some(long) = inputs.iter().find(|t| t.len() > ubatch) {
                return Err(Error::InvalidArgument(format!(
                    "an input of {} tokens is longer than n-ubatch {ubatch}: a model that pools needs it in one ubatch",
                    long.len()
                )));
            }
            return inputs
                .iter()
                .map(|tokens| {
                    let mut one = Batch::sequence(tokens, 0, 0);
                    one.logits = vec![true; tokens.len()];
                    let mut v = self.embed_batch(&one, 1, stop)?.remove(0);
                    if normalize {
                        normalize_l2(&mut v);
                    }
                    Ok(v)
                })
                .collect();
        }
        let mut batch = Batch::default();
        for (seq, tokens) in inputs.iter().enumerate() {
            let one = Batch::sequence(tokens, 0, seq as i32);
            batch.tokens.extend(one.tokens);
            batch.positions.extend(one.positions);
            batch.seq_ids.extend(one.seq_ids);
        }
        batch.logits = vec![true; batch.len()];
        let rows = self.embed_batch(&batch, 0, stop)?;
        let mut start = 0;
        Ok(inputs
            .iter()
            .map(|tokens| {
                let own = &rows[start..start + tokens.len()];
                start += tokens.len();
                let mut v = match pooling {
                    Pooling::Cls => own[0].clone(),
                    Pooling::Last => own[own.len() - 1].clone(),
                    Pooling::Mean => {
                        let mut sum = vec![0f32; own[0].len()];
                        for row in own {
                            sum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
                        }
                        sum.iter_mut().for_each(|s| *s /= own.len() as f32);
                        sum
                    }
                };
                if normalize {
                    normalize_l2(&mut v);
                }
                v
            })
            .collect())
    }

    /// Every row's vector (n-embd floats) for one input of at most n-batch tokens.
    pub fn embed_rows(
        &mut self,
        tokens: &[Token],
        normalize: bool,
        stop: Option<Stop<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument(
                "the input to embed needs at least one token".into(),
            ));
        }
        if let Some(own) = self.own_pooling()? {
            return Err(Error::InvalidArgument(format!(
                "this model pools its embeddings itself ({own:?}): no per-row vectors"
            )));
        }
        let mut batch = Batch::sequence(tokens, 0, 0);
        batch.logits = vec![true; tokens.len()];
        let mut rows = self.embed_batch(&batch, 0, stop)?;
        if normalize {
            rows.iter_mut().for_each(|r| normalize_l2(r));
        }
        Ok(rows)
    }

    /// The pooling the model does in its own graph (a GGUF `pooling_type`), if any.
    fn own_pooling(&self) -> Result<Option<Pooling>> {
        // SAFETY: `self.ptr` is live until `Drop`; this reads one of its params.
        match unsafe { sys::llama_pooling_type(self.ptr.as_ptr()) } {
            sys::LLAMA_POOLING_TYPE_NONE => Ok(None),
            sys::LLAMA_POOLING_TYPE_MEAN => Ok(Some(Pooling::Mean)),
            sys::LLAMA_POOLING_TYPE_CLS => Ok(Some(Pooling::Cls)),
            sys::LLAMA_POOLING_TYPE_LAST => Ok(Some(Pooling::Last)),
            other => Err(Error::InvalidArgument(format!(
                "this model's own pooling (llama.cpp type {other}, e.g. rank) is not supported"
            ))),
        }
    }

    /// Decode `batch` (positions from 0) into emptied memory with embedding output on,
    /// and read every row, or (`pooled_seqs` > 0, a model that pools) the vectors of
    /// sequences `0..pooled_seqs`. Memory is emptied again afterwards.
    fn embed_batch(
        &mut self,
        batch: &Batch,
        pooled_seqs: usize,
        stop: Option<Stop<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        let ctx = self.ptr.as_ptr();
        if stop.is_some_and(|s| s.is_set()) {
            self.tally(|t| t.cancelled());
            return Err(Error::Cancelled);
        }
        // From nothing, leftover included: the same input, the same vector.
        self.clear_all();
        // SAFETY: a live context, `&mut self` (no decode in flight); a flag the next
        // decode reads, switched back below before returning.
        unsafe { sys::llama_set_embeddings(ctx, true) };
        // SAFETY: the model is live (`self.model` is an `Arc`); reads a number.
        let width = unsafe { sys::llama_model_n_embd_out(self.model.as_ptr()) }.max(0) as usize;
        let read = |i: usize| {
            // SAFETY: a row of (or a sequence in) the last successful decode; llama.cpp
            // returns null (not an abort) for one it has no output for.
            let ptr = unsafe {
                if pooled_seqs > 0 {
                    sys::llama_get_embeddings_seq(ctx, i as i32)
                } else {
                    sys::llama_get_embeddings_ith(ctx, i as i32)
                }
            };
            if ptr.is_null() {
                return Err(Error::Backend(format!("llama.cpp has no embedding for {i}")));
            }
            // SAFETY: non-null, so llama.cpp's row (or pooled vector) of n-embd-out
            // floats; valid until the next decode, and copied out here.
            Ok(unsafe { std::slice::from_raw_parts(ptr, width) }.to_vec())
        };
        // Rows are read from the hidden states: the decodes end there, no output head.
        // (A pooled vector is computed after the head in llama.cpp's graph.)
        self.hidden_states_only = pooled_seqs == 0
            && self.embeddings_end_early
            && self.model.head_follows_hidden_states();
        let in_turns = pooled_seqs == 0 && self.model.causal_attention();
        let pieces = self.cores.as_ref().filter(|_| in_turns);
        let pieces = pieces.map(|cores| cores.pieces(self.params.n_ubatch as usize));
        let rows = if let Some(pieces) = pieces {
            self.decode_rows_in_turns(batch, stop, pieces, read)
        } else {
            self.decode(batch, stop).and_then(|()| {
                (0..if pooled_seqs > 0 { pooled_seqs } else { batch.len() })
                    .map(read)
                    .collect::<Result<Vec<_>>>()
            })
        };
        // SAFETY: as above; embedding output off again, as `new` made the context.
        unsafe { sys::llama_set_embeddings(ctx, false) };
        self.hidden_states_only = false;
        self.clear_all();
        rows
    }
}

impl Context {
    /// Beside a batch (a context that shares the cores), an input's rows are decoded in
    /// pieces, each about one turn on the cores ([`crate::SharedCores::pieces`]), so that the batch's
    /// steps run between them instead of waiting for the whole input (seconds for a few
    /// thousand tokens on a CPU). A causal model's later rows see the earlier pieces
    /// through the context's memory, so every row is what one decode would give (up to
    /// rounding). `pieces` sizes them; `read(i)` copies row
    /// `i` of the last decode.
    fn decode_rows_in_turns(
        &mut self,
        batch: &Batch,
        stop: Option<Stop<'_>>,
        mut pieces: Box<dyn Pieces>,
        read: impl Fn(usize) -> Result<Vec<f32>>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut rows = Vec::with_capacity(batch.len());
        let most = self.params.n_ubatch as usize;
        let mut start = 0;
        while start < batch.len() {
            let end = (start + pieces.rows().clamp(1, most)).min(batch.len());
            let part = Batch {
                tokens: batch.tokens[start..end].to_vec(),
                positions: batch.positions[start..end].to_vec(),
                seq_ids: batch.seq_ids[start..end].to_vec(),
                logits: batch.logits[start..end].to_vec(),
            };
            self.decode(&part, stop)?;
            pieces.observe(part.len(), self.computed);
            for i in 0..part.len() {
                rows.push(read(i)?);
            }
            start = end;
        }
        Ok(rows)
    }
}

/// Scale to unit Euclidean length (a zero vector stays zero).
fn normalize_l2(v: &mut [f32]) {
    let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}
