//! A seat's calls on the batch's thread: ops that compute nothing answered between
//! steps, decodes and generations checked as a context of its own would check them and
//! made the seat's *running* call, a generation's token loop started and finished.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc as pieces;

use super::seat::{Caller, SeatOp};
use super::thread::Steps;
use super::MAX_SEAT_LOGIT_ROWS;
use crate::engine::schedule::Claim;
use crate::engine::Meter;
use crate::native::{
    self, Batch, Error, FinishReason, GenerateRequest, Outcome, Piece, Sampler, Token, TokenLoop,
};
use crate::worker::Alive;

pub(super) struct Member {
    /// Its tenant and plugin (shares, rollbacks and leftovers are per group).
    pub(super) group: String,
    /// Its run's claim on the cores (weight, class, deadline).
    pub(super) claim: Claim,
    pub(super) meter: Arc<Meter>,
    /// Counts this seat in its run's tracker until the thread has let go of it.
    pub(super) alive: Alive,
    /// The seat's granted n-ctx (its room) and n-batch (most rows per decode).
    pub(super) n_ctx: u32,
    pub(super) n_batch: u32,
    pub(super) slot: Option<usize>,
    /// Rows of the last successful decode: their logits if they asked for them.
    pub(super) logits: Vec<Option<Vec<f32>>>,
    /// Ops in the order the seat sent them; the first may be running.
    pub(super) queue: VecDeque<SeatOp>,
    /// The compute op at the front, once started.
    pub(super) running: Option<Running>,
}

/// A decode or generation in progress across steps.
pub(super) enum Running {
    Decode(DecodeWork),
    Generate(Box<GenerateWork>),
}

pub(super) struct DecodeWork {
    pub(super) caller: Caller<()>,
    pub(super) batch: Batch,
    /// Rows done (reused ones included).
    pub(super) done: usize,
    /// Where the sequence ended before the call (`seq_pos_max`).
    pub(super) end_before: i32,
    /// The call bound the seat (so failing unbinds it), keeping this many leftover rows.
    pub(super) bound_here: bool,
    pub(super) kept: usize,
    pub(super) logits: Vec<Option<Vec<f32>>>,
}

pub(super) struct GenerateWork {
    pub(super) caller: Caller<Outcome>,
    pub(super) sampler: Box<Sampler>,
    pub(super) request: GenerateRequest,
    pub(super) pieces: pieces::Sender<Piece>,
    pub(super) end_before: i32,
    pub(super) bound_here: bool,
    pub(super) kept: usize,
    pub(super) started: Instant,
    /// Prompt rows done; the token loop starts once all are.
    pub(super) prompt_done: usize,
    pub(super) tokens: Option<TokenLoop>,
    /// The token to decode next.
    pub(super) next: Option<Token>,
    /// Pieces waiting for room in the reader's buffer; the first may carry the one
    /// token decoded but not yet delivered.
    pub(super) undelivered: VecDeque<Piece>,
    /// How it ends, once decided (after the undelivered pieces are out).
    pub(super) finish: Option<native::Result<FinishReason>>,
}

impl Steps {
    /// A running call between steps: ended (`None`) if cancelled, or once its pieces
    /// are out; else it runs on.
    pub(super) fn check_running(&mut self, id: u64, running: Running) -> Option<Running> {
        let stopped = match &running {
            Running::Decode(d) => d.caller.stop().is_set(),
            Running::Generate(g) => g.caller.stop().is_set(),
        };
        if stopped {
            self.members.get(&id).expect("member").meter.add_cancel();
            self.undo(id, running, Err(Error::Cancelled));
            return None;
        }
        let Running::Generate(mut g) = running else { return Some(running) };
        while let Some(piece) = g.undelivered.pop_front() {
            let carries_token = !piece.tokens.is_empty();
            match g.pieces.try_send(piece) {
                Ok(()) => {
                    if carries_token {
                        g.tokens.as_mut().expect("a token loop").delivered();
                    }
                }
                Err(pieces::error::TrySendError::Full(piece)) => {
                    g.undelivered.push_front(piece);
                    return Some(Running::Generate(g));
                }
                Err(pieces::error::TrySendError::Closed(_)) => {
                    // The reader is gone: what was not delivered is not kept.
                    self.undo(id, Running::Generate(g), Ok(FinishReason::Cancelled));
                    return None;
                }
            }
        }
        match g.finish.take() {
            Some(finish) => {
                self.finish_generation(id, g, finish);
                None
            }
            None => Some(Running::Generate(g)),
        }
    }

    /// Start `op`, the front of `id`'s queue: answer it now, or make it the running call.
    pub(super) fn start(&mut self, id: u64, op: SeatOp) {
        match op {
            SeatOp::Logits { row, reply } => {
                let logits = &self.member(id).logits;
                let row = row.unwrap_or(logits.len().saturating_sub(1) as u32);
                let result = match logits.get(row as usize) {
                    Some(Some(l)) => Ok(l.clone()),
                    _ if logits.is_empty() => Err(Error::InvalidArgument(
                        "there is no successful decode to read logits from".into(),
                    )),
                    _ => Err(Error::InvalidArgument(format!(
                        "row {row} has no logits: the last successful decode did not ask for them"
                    ))),
                };
                reply.send(result);
            }
            SeatOp::Sample { sampler, row, reply } => {
                let result = match self.member(id).logits.get(row as usize) {
                    Some(Some(l)) => sampler.lock().unwrap_or_else(|p| p.into_inner()).sample(l),
                    _ => Err(Error::InvalidArgument(format!(
                        "row {row} has no logits: the last successful decode did not ask for them"
                    ))),
                };
                reply.send(result);
            }
            SeatOp::PosMax { seq, reply } => {
                let result = check_seq(seq).map(|()| self.end_of(id));
                reply.send(result);
            }
            SeatOp::SeqRm { seq, p0, p1, reply } => {
                let result = self.seq_rm(id, seq, p0, p1);
                reply.send(result);
            }
            SeatOp::Clear { reply } => {
                self.member(id).logits.clear();
                if let Some(slot) = self.member(id).slot {
                    self.sequences.clear(&mut self.ctx, slot);
                }
                reply.send(Ok(()));
            }
            SeatOp::Eval { pieces, seq, caller } => {
                let result = check_seq(seq).and_then(|()| self.eval(id, &pieces, &caller));
                caller.reply.send(result);
            }
            SeatOp::Decode { batch, caller } => match self.check_decode(id, &batch) {
                Err(e) => {
                    caller.reply.send(Err(e));
                }
                Ok(()) if caller.stop().is_set() => {
                    self.member(id).meter.add_cancel();
                    caller.reply.send(Err(Error::Cancelled));
                }
                Ok(()) => {
                    let end_before = self.end_of(id);
                    self.member(id).logits.clear();
                    let first_out = batch.logits.iter().position(|&l| l).unwrap_or(batch.len());
                    let (bound_here, done) =
                        self.bind(id, &batch.tokens, first_out.min(batch.len() - 1));
                    let logits = vec![None; batch.len()];
                    let work = DecodeWork {
                        caller,
                        batch,
                        done,
                        end_before,
                        bound_here,
                        kept: done,
                        logits,
                    };
                    self.member(id).running = Some(Running::Decode(work));
                }
            },
            SeatOp::Generate { sampler, request, pieces, caller } => {
                let model = self.ctx.model().clone();
                let checked = native::check_request(&model, &sampler, &request).and_then(|()| {
                    check_seq(request.seq)?;
                    let m = self.members.get(&id).expect("member");
                    if request.prompt.is_empty() && m.logits.last().is_none_or(Option::is_none) {
                        return Err(native::nothing_to_continue());
                    }
                    self.check_room(id, request.prompt.len())
                });
                if let Err(e) = checked {
                    caller.reply.send(Err(e));
                    return;
                }
                if caller.stop().is_set() {
                    self.member(id).meter.add_cancel();
                    caller.reply.send(Ok(Outcome {
                        finish: FinishReason::Cancelled,
                        usage: native::GenerationUsage::default(),
                    }));
                    return;
                }
                let end_before = self.end_of(id);
                let (bound_here, prompt_done) = if request.prompt.is_empty() {
                    (false, 0)
                } else {
                    self.bind(id, &request.prompt, request.prompt.len() - 1)
                };
                let mut work = GenerateWork {
                    caller,
                    sampler,
                    request,
                    pieces,
                    end_before,
                    bound_here,
                    kept: prompt_done,
                    started: Instant::now(),
                    prompt_done,
                    tokens: None,
                    next: None,
                    undelivered: VecDeque::new(),
                    finish: None,
                };
                // As on a context of its own, the logits read afterwards are those the
                // generation ends on (none if it does not end well: a cancelled decode
                // leaves none there either).
                let last = std::mem::take(&mut self.member(id).logits);
                if work.request.prompt.is_empty() {
                    let logits = last.last().cloned().flatten().unwrap_or_default();
                    self.start_tokens(id, &mut work, &logits);
                }
                self.member(id).running = Some(Running::Generate(Box::new(work)));
            }
        }
    }

    /// A decode's batch as a context of the seat's own would check it.
    pub(super) fn check_decode(&self, id: u64, batch: &Batch) -> native::Result<()> {
        batch.check_shape(self.members[&id].n_batch)?;
        let invalid = |what: String| Err(Error::InvalidArgument(what));
        let outputs = batch.logits.iter().filter(|&&l| l).count();
        if outputs > MAX_SEAT_LOGIT_ROWS {
            return Err(Error::LimitExceeded {
                limit: "max-batched-logit-rows",
                requested: outputs as u64,
                max: MAX_SEAT_LOGIT_ROWS as u64,
            });
        }
        self.ctx.model().check_tokens(&batch.tokens)?;
        let rows = batch.seq_ids.iter().zip(&batch.positions).enumerate();
        for (expected, (row, (&seq, &pos))) in (self.end_of(id) + 1..).zip(rows) {
            check_seq(seq)?;
            if pos != expected {
                return invalid(format!(
                    "row {row}: sequence {seq} must continue at position {expected}, got {pos}"
                ));
            }
        }
        self.check_room(id, batch.len())
    }

    /// `ContextFull` unless `rows` more fit in the seat's n-ctx.
    pub(super) fn check_room(&self, id: u64, rows: usize) -> native::Result<()> {
        let held = (self.end_of(id) + 1) as usize;
        if held.saturating_add(rows) > self.members[&id].n_ctx as usize {
            return Err(Error::ContextFull);
        }
        Ok(())
    }

    /// Bind an unbound seat to a free sequence for a call whose rows start with `tokens`
    /// (`Sequences::bind`); returns whether it bound the seat now and how many rows are
    /// already in memory.
    pub(super) fn bind(&mut self, id: u64, tokens: &[Token], most: usize) -> (bool, usize) {
        let m = &self.members[&id];
        if m.slot.is_some() {
            return (false, 0);
        }
        let (slot, kept) = self.sequences.bind(&mut self.ctx, id, &m.group, tokens, most);
        let member = self.member(id);
        member.slot = Some(slot);
        member.meter.add_reused(kept as u64);
        (true, kept)
    }

    pub(super) fn seq_rm(&mut self, id: u64, seq: i32, p0: i32, p1: i32) -> native::Result<()> {
        check_seq(seq)?;
        if p0 < 0 {
            return Err(Error::InvalidArgument(format!("p0 {p0} is negative")));
        }
        let Some(slot) = self.members[&id].slot else { return Ok(()) };
        self.sequences.remove(&mut self.ctx, slot, p0, p1)
    }

    /// The token loop starts from `logits` (the prompt's last row).
    pub(super) fn start_tokens(&mut self, id: u64, work: &mut GenerateWork, logits: &[f32]) {
        let model = self.ctx.model().clone();
        let pos = self.end_of(id) + 1;
        let prompt = work.request.prompt.len() as u32;
        let mut tokens = TokenLoop::new(
            model,
            &work.request,
            pos,
            prompt,
            work.kept as u32,
            work.started.elapsed(),
        );
        match tokens.pick(&mut work.sampler, logits) {
            Ok(native::Pick::Decode(token)) => work.next = Some(token),
            Ok(native::Pick::Finish(reason)) => work.finish = Some(Ok(reason)),
            Err(e) => work.finish = Some(Err(e)),
        }
        work.tokens = Some(tokens);
        if work.finish.is_some() {
            self.keep_last_logits(id, logits.to_vec());
        }
    }

    /// A generation ended with `logits` (its last decoded row) at hand: they are the
    /// seat's last logits, which a generation with an empty prompt continues from.
    pub(super) fn keep_last_logits(&mut self, id: u64, logits: Vec<f32>) {
        self.member(id).logits = vec![Some(logits)];
    }

    pub(super) fn finish_generation(
        &mut self,
        id: u64,
        mut g: Box<GenerateWork>,
        finish: native::Result<FinishReason>,
    ) {
        let tokens = g.tokens.as_mut().expect("a token loop");
        if let Some(rest) = tokens.flush() {
            let _ = g.pieces.try_send(rest); // as `generate`: the last text, if there is room
        }
        let outcome = finish.map(|reason| tokens.outcome(reason));
        if let Ok(o) = &outcome {
            self.member(id).meter.add_generated(o.usage.generated_tokens.into());
        }
        g.caller.reply.send(outcome);
    }
}

/// A seat has one sequence, 0.
pub(super) fn check_seq(seq: i32) -> native::Result<()> {
    if seq == 0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("sequence id {seq} is outside [0, 1)")))
    }
}
