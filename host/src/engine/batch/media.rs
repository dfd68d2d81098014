//! A media prompt on a seat (`media.eval-chunks`): `Context::eval` into the seat's
//! sequence, all or nothing and cancellable, in parts of about a step target while
//! other members have calls running, so that the others step between its parts.

use std::time::Instant;

use super::calls::check_seq;
use super::seat::Caller;
use super::thread::Steps;
use crate::native::context::Pacer;
use crate::native::{self, Error, PromptPiece};

impl Steps {
    /// `pieces` evaluated into `seq` part by part: while other members have calls
    /// running, a token piece in parts of about a step target ([`Pacer`]), a media piece
    /// whole, each alone on the cores; between parts, those calls go on one step (new
    /// calls wait for the prompt's end). With nobody else running, the rest at once. So
    /// a long media prompt (a document with an image) no longer holds every stream of
    /// the batch for its whole evaluation. The end position.
    pub(super) fn eval_in_parts(
        &mut self,
        id: u64,
        pieces: &[PromptPiece],
        seq: i32,
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
        if pieces.is_empty() {
            // Nothing to evaluate: the sequence's end, as `Context::eval` answers it.
            return self.ctx.eval(pieces, seq, Some(caller.stop()));
        }
        let mut pacer = Pacer::new(self.policy.step_rows as usize);
        let mut end = Ok(0);
        for (i, piece) in pieces.iter().enumerate() {
            let tokens = match piece {
                PromptPiece::Tokens(tokens) => Some(tokens.as_slice()),
                PromptPiece::Embeddings { .. } => None,
            };
            let mut from = 0;
            loop {
                // Paced only while others have calls running: alone, the rest at once.
                let others = self.members.iter().any(|(&m, x)| m != id && x.running.is_some());
                let part = match tokens {
                    Some(tokens) => {
                        let rows = if others { pacer.rows() } else { tokens.len() - from };
                        PromptPiece::Tokens(tokens[from..(from + rows).min(tokens.len())].to_vec())
                    }
                    None => piece.clone(),
                };
                let rows = match &part {
                    PromptPiece::Tokens(t) => t.len(),
                    PromptPiece::Embeddings { .. } => 0,
                };
                let (result, elapsed) = {
                    let _turn = self.policy.cores.turn();
                    let started = Instant::now();
                    let result =
                        self.ctx.eval(std::slice::from_ref(&part), seq, Some(caller.stop()));
                    (result, started.elapsed())
                };
                self.members[&id].alive.add_busy(elapsed);
                end = Ok(result?);
                if rows > 0 {
                    pacer.observe(rows, elapsed);
                }
                from += rows;
                let piece_done = tokens.is_none_or(|t| from >= t.len());
                let prompt_done = piece_done && i + 1 == pieces.len();
                if !prompt_done {
                    self.step_others(id);
                }
                if piece_done {
                    break;
                }
            }
        }
        end
    }

    /// One step for the members other than `busy` whose calls are running (their
    /// pieces delivered, their cancels seen first), without starting new calls.
    pub(super) fn step_others(&mut self, busy: u64) {
        let ids: Vec<u64> = self.members.keys().copied().filter(|&m| m != busy).collect();
        for id in ids {
            let running = self.members.get_mut(&id).and_then(|m| m.running.take());
            if let Some(running) = running {
                let still = self.check_running(id, running);
                if let Some(member) = self.members.get_mut(&id) {
                    member.running = still;
                }
            }
        }
        if self.members.values().any(|m| m.running.is_some()) && self.has_rows() {
            self.step();
        }
    }

    /// A media prompt: `Context::eval` into the seat's sequence, in parts.
    pub(super) fn eval(
        &mut self,
        id: u64,
        pieces: &[PromptPiece],
        seq: i32,
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
        check_seq(seq)?;
        let rows: usize = pieces
            .iter()
            .map(|p| match p {
                PromptPiece::Tokens(t) => t.len(),
                PromptPiece::Embeddings { embd, .. } => {
                    embd.len() / (self.ctx.model().n_embd_inp() as usize).max(1)
                }
            })
            .fold(0, usize::saturating_add);
        self.check_room(id, rows)?;
        let (bound_here, _) = self.bind(id, &[], 0);
        let slot = self.members[&id].slot.expect("bound");
        self.member(id).logits.clear();
        let start = self.ctx.seq_pos_max(slot as i32).map_or(0, |end| end + 1);
        let result = self.eval_in_parts(id, pieces, slot as i32, caller);
        if result.is_err() {
            // The parts evaluated before the one that failed (that one rolled itself
            // back): the prompt is all or nothing.
            let _ = self.ctx.seq_rm(slot as i32, start, -1);
        }
        match result {
            Ok(end) => {
                self.sequences.forget_tokens(slot);
                let last = self.ctx.last_logits().map(<[f32]>::to_vec).ok();
                let m = self.member(id);
                m.logits = vec![last];
                m.meter.add_decoded(rows as u64);
                Ok(end)
            }
            Err(e) => {
                if e == Error::Cancelled {
                    self.member(id).meter.add_cancel();
                }
                if bound_here {
                    self.unbind(id, 0);
                }
                Err(e)
            }
        }
    }
}
