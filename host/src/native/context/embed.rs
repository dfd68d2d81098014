//! Embeddings from a text context: the hidden state after the model's final norm, per
//! row or pooled per input. A child module of `context` so it can switch llama.cpp's
//! embedding output on for one call only.
//!
//! Memory: an embedding call uses the context's memory as scratch. It empties it
//! first (so the same input always meets the same state and gives bitwise the same
//! vector) and leaves it empty, whatever the outcome.

use llama_cpp_sys_2 as sys;

use super::{Batch, Context};
use crate::native::cancel::Stop;
use crate::native::model::Token;
use crate::native::{Error, Result};

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
    /// one batch: at most n-seq-max inputs and n-batch tokens in all.
    pub fn embed(&mut self, inputs: &[Vec<Token>], pooling: Pooling, normalize: bool, stop: Option<Stop<'_>>) -> Result<Vec<Vec<f32>>> {
        if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
            return Err(Error::InvalidArgument("every input to embed needs at least one token".into()));
        }
        if inputs.len() > self.params.n_seq_max as usize {
            return Err(Error::InvalidArgument(format!(
                "{} inputs are more than n-seq-max {} (one sequence each)",
                inputs.len(),
                self.params.n_seq_max
            )));
        }
        let mut batch = Batch::default();
        for (seq, tokens) in inputs.iter().enumerate() {
            let one = Batch::sequence(tokens, 0, seq as i32);
            batch.tokens.extend(one.tokens);
            batch.positions.extend(one.positions);
            batch.seq_ids.extend(one.seq_ids);
        }
        batch.logits = vec![true; batch.len()];
        let rows = self.embed_batch(&batch, stop)?;
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
    pub fn embed_rows(&mut self, tokens: &[Token], normalize: bool, stop: Option<Stop<'_>>) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("the input to embed needs at least one token".into()));
        }
        let mut batch = Batch::sequence(tokens, 0, 0);
        batch.logits = vec![true; tokens.len()];
        let mut rows = self.embed_batch(&batch, stop)?;
        if normalize {
            rows.iter_mut().for_each(|r| normalize_l2(r));
        }
        Ok(rows)
    }

    /// Decode `batch` (positions from 0) into emptied memory with embedding output on,
    /// and read every row. Memory is emptied again afterwards.
    fn embed_batch(&mut self, batch: &Batch, stop: Option<Stop<'_>>) -> Result<Vec<Vec<f32>>> {
        let ctx = self.ptr.as_ptr();
        // SAFETY: a live context.
        if unsafe { sys::llama_pooling_type(ctx) } != sys::LLAMA_POOLING_TYPE_NONE {
            return Err(Error::InvalidArgument(
                "this model pools embeddings itself (an embedding model); only generative models are supported yet".into(),
            ));
        }
        if stop.is_some_and(|s| s.is_set()) {
            self.meter.add_cancel();
            return Err(Error::Cancelled);
        }
        self.clear();
        // SAFETY: a live context; switched back below before returning.
        unsafe { sys::llama_set_embeddings(ctx, true) };
        let decoded = self.decode(batch, stop);
        let width = unsafe { sys::llama_model_n_embd_out(self.model.as_ptr()) }.max(0) as usize;
        let rows = decoded.and_then(|()| {
            (0..batch.len())
                .map(|row| {
                    // SAFETY: every row of the successful decode has an output; llama.cpp
                    // returns null (not an abort) for a row it has none for.
                    let ptr = unsafe { sys::llama_get_embeddings_ith(ctx, row as i32) };
                    if ptr.is_null() {
                        return Err(Error::Backend(format!("llama.cpp has no embedding for row {row}")));
                    }
                    // SAFETY: n-embd-out floats, valid until the next decode.
                    Ok(unsafe { std::slice::from_raw_parts(ptr, width) }.to_vec())
                })
                .collect::<Result<Vec<_>>>()
        });
        unsafe { sys::llama_set_embeddings(ctx, false) };
        self.clear();
        rows
    }
}

/// Scale to unit Euclidean length (a zero vector stays zero).
fn normalize_l2(v: &mut [f32]) {
    let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}
