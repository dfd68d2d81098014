//! The native side: llama.cpp through `llamabox_native`, with and without the abort
//! callback, greedy generation, and cancel latency from another thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use llamabox_native::{Batch, CancelFlag, Context, Error, Model, Stop};

use crate::stats::timed;
use crate::workload::{
    argmax, bench_tokens, fnv1a64_logits, fnv1a64_tokens, prompt_batch, Shape, GEN_PROMPT_TOKENS,
};

/// A context on a loaded model, with the benchmark's shape.
pub struct Native {
    pub model: Arc<Model>,
    ctx: Context,
    shape: Shape,
}

/// One decode cancelled from another thread.
#[derive(Clone, Copy, Debug)]
pub struct CancelSample {
    /// When the store happened, from the decode's start.
    pub at: Duration,
    /// From the store to the decode's return.
    pub latency: Duration,
}

pub struct CancelLatency {
    pub samples: Vec<CancelSample>,
    /// Decodes that finished before their cancel arrived (not in `samples`).
    pub finished_first: usize,
    /// After the last cancel, the next decode gave the plain decode's logits.
    pub identical_after: bool,
}

impl Native {
    pub fn new(model: Arc<Model>, shape: Shape) -> anyhow::Result<Self> {
        let ctx =
            Context::new(model.clone(), shape.params()).context("creating the native context")?;
        Ok(Self { model, ctx, shape })
    }

    fn n_vocab(&self) -> u32 {
        self.model.n_vocab()
    }

    /// Decode `batch` on a cleared context, timing the decode call only; returns the
    /// time and the digest of the last row's logits.
    fn decode_once(
        &mut self,
        batch: &Batch,
        stop: Option<Stop<'_>>,
    ) -> anyhow::Result<(Duration, u64)> {
        self.ctx.clear();
        let (time, result) = timed(|| self.ctx.decode(batch, stop));
        result.context("benchmark decode failed")?;
        let logits = self.ctx.logits_ith(batch.len() as u32 - 1)?;
        Ok((time, fnv1a64_logits(logits)))
    }

    /// One timed prompt decode on a cleared context: plain (no callback), or
    /// cancellable (callback installed, flag clear). Returns the time of the decode call
    /// and the digest of the last row's logits.
    pub fn prompt_decode(&mut self, cancellable: bool) -> anyhow::Result<(Duration, u64)> {
        let batch = prompt_batch(&self.shape, self.n_vocab());
        let flag = CancelFlag::new();
        self.decode_once(&batch, cancellable.then(|| Stop::on(&flag)))
    }

    /// Graph nodes that compute in one prompt decode: the abort callback polls once
    /// after each. Counted in an untimed decode (the counting hook adds an atomic add).
    pub fn prompt_nodes(&mut self) -> anyhow::Result<u64> {
        let batch = prompt_batch(&self.shape, self.n_vocab());
        let counter = CancelFlag::new();
        counter.trip_after(u64::MAX);
        self.decode_once(&batch, Some(Stop::on(&counter)))?;
        Ok(counter.polls())
    }

    /// Greedy generation of `shape.gen_tokens` tokens after an 8-token prompt, as the
    /// guest does it: one-token decode, read the logits, argmax. Returns the time from
    /// the first generated token's decode to the last one's logits, and the digest of
    /// the generated tokens.
    pub fn generate(&mut self) -> anyhow::Result<(Duration, u64)> {
        self.generate_until(None)
    }

    /// [`Native::generate`], each decode stoppable by `flag` (the cancel byte clear, or
    /// set from another thread): returns at the first cancelled decode.
    pub fn generate_until(&mut self, flag: Option<&CancelFlag>) -> anyhow::Result<(Duration, u64)> {
        let prompt = Batch::sequence(&bench_tokens(GEN_PROMPT_TOKENS, self.n_vocab()), 0, 0);
        self.ctx.clear();
        let start = Instant::now();
        match self.ctx.decode(&prompt, flag.map(Stop::on)) {
            Err(Error::Cancelled) => return Ok((start.elapsed(), 0)),
            result => result?,
        }
        let mut next = argmax(self.ctx.logits_ith(GEN_PROMPT_TOKENS - 1)?);
        let mut generated = Vec::with_capacity(self.shape.gen_tokens as usize);
        let start = Instant::now();
        for pos in GEN_PROMPT_TOKENS..GEN_PROMPT_TOKENS + self.shape.gen_tokens {
            generated.push(next);
            match self.ctx.decode(&Batch::sequence(&[next], pos as i32, 0), flag.map(Stop::on)) {
                Err(Error::Cancelled) => break,
                result => result?,
            }
            next = argmax(self.ctx.logits_ith(0)?);
        }
        Ok((start.elapsed(), fnv1a64_tokens(&generated)))
    }

    /// On a GPU, a fixed work budget between boundaries instead of the paced one
    /// (`Context::set_device_chunk_work`).
    pub fn set_device_chunk_work(&mut self, units: Option<u64>) {
        self.ctx.set_device_chunk_work(units);
    }

    /// `count` generations cancelled from another thread at a random point in
    /// [0, 0.9 × `gen_time`): store → return of the generation loop, seconds.
    pub fn generation_cancel_latency(
        &mut self,
        count: usize,
        gen_time: Duration,
    ) -> anyhow::Result<crate::stats::Samples> {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut latency = crate::stats::Samples::default();
        for _ in 0..count {
            let delay = gen_time.mul_f64(0.9 * rng.f64());
            let flag = CancelFlag::new();
            let canceller_flag = flag.clone();
            let (stored, returned) = std::thread::scope(|s| {
                let start = Instant::now();
                let canceller = s.spawn(move || {
                    std::thread::sleep(delay.saturating_sub(start.elapsed()));
                    let stored = Instant::now();
                    canceller_flag.cancel();
                    stored
                });
                let result = self.generate_until(Some(&flag));
                (canceller.join(), result.map(|_| Instant::now()))
            });
            let stored = stored.map_err(|_| anyhow::anyhow!("the canceller thread panicked"))?;
            let returned = returned?;
            // A generation that ended before the store is no sample.
            if let Some(waited) = returned.checked_duration_since(stored) {
                latency.push(waited);
            }
        }
        Ok(latency)
    }

    /// `count` prompt decodes, each cancelled from another thread at a random point in
    /// [0, 0.9 × `decode_time`); the time from the flag's store to the decode's return.
    /// Then one uncancelled decode on the same memory, whose logits must equal `expected`.
    pub fn cancel_latency(
        &mut self,
        count: usize,
        decode_time: Duration,
        expected: u64,
    ) -> anyhow::Result<CancelLatency> {
        let batch = prompt_batch(&self.shape, self.n_vocab());
        let mut rng = fastrand::Rng::with_seed(7);
        let mut samples = Vec::with_capacity(count);
        let mut finished_first = 0;
        self.ctx.clear();
        for _ in 0..count {
            let delay = decode_time.mul_f64(0.9 * rng.f64());
            let flag = CancelFlag::new();
            let ctx = &mut self.ctx;
            let (start, stored, result, returned) = std::thread::scope(|s| {
                let start = Instant::now();
                let canceller_flag = flag.clone();
                let canceller = s.spawn(move || {
                    // Sleep to just before the target, then spin: sleep alone overshoots
                    // by scheduler ticks on a busy machine.
                    let target = start + delay;
                    if let Some(d) =
                        target.checked_duration_since(Instant::now() + Duration::from_millis(2))
                    {
                        std::thread::sleep(d);
                    }
                    while Instant::now() < target {
                        std::hint::spin_loop();
                    }
                    let stored = Instant::now();
                    canceller_flag.cancel();
                    stored
                });
                let result = ctx.decode(&batch, Some(Stop::on(&flag)));
                let returned = Instant::now();
                (start, canceller.join(), result, returned)
            });
            let stored = match stored {
                Ok(t) => t,
                Err(_) => bail!("the canceller thread panicked"),
            };
            match result {
                Err(Error::Cancelled) => {
                    samples.push(CancelSample { at: stored - start, latency: returned - stored })
                }
                // Finished before its cancel came (often on a GPU): its rows are kept, so
                // they go before the next decode. A cancelled one is not cleared after: the
                // next decode (at position 0) fails if it left any row behind.
                Ok(()) => {
                    finished_first += 1;
                    self.ctx.clear();
                }
                Err(e) => return Err(e).context("a decode to be cancelled failed otherwise"),
            }
        }
        // No `clear` here: a cancelled decode must have left memory as it found it.
        self.ctx.decode(&batch, None).context("the decode after the cancels failed")?;
        let digest = fnv1a64_logits(self.ctx.logits_ith(batch.len() as u32 - 1)?);
        Ok(CancelLatency { samples, finished_first, identical_after: digest == expected })
    }
}
