//! A media prompt on a seat (`media.eval-chunks`): `Context::eval` into the seat's
//! sequence, all or nothing and cancellable, in parts of about a step target, so that
//! the others' calls (those running, and those sent meanwhile) step between its parts.

use std::time::Instant;

use super::seat::{Caller, SeatOp};
use super::thread::Steps;
use crate::engine::Pacer;
use crate::native::Pieces;
use crate::native::{self, Error, PromptPiece};

impl Steps {
    /// `pieces` evaluated into member `id`'s sequence `seq` part by part: a token piece in
    /// parts of about a step target ([`Pacer`]), a media piece whole, each alone on the
    /// cores; between parts, the other members' calls go on one step, and calls they sent
    /// meanwhile start. So a long media prompt (a document with an image) holds neither
    /// the batch's streams nor its newcomers for its whole evaluation. The end position.
    fn eval_in_parts(
        &mut self,
        id: u64,
        seq: i32,
        pieces: &[PromptPiece],
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
        if pieces.is_empty() {
            // Nothing to evaluate: the sequence's end, as `Context::eval` answers it.
            return self.ctx.eval(pieces, seq, Some(caller.stop()));
        }
        let mut pacer = Pacer::new(self.policy.step_rows as usize, self.policy.step_target);
        let mut end = Ok(0);
        for (i, piece) in pieces.iter().enumerate() {
            let tokens = match piece {
                PromptPiece::Tokens(tokens) => Some(tokens.as_slice()),
                PromptPiece::Embeddings { .. } => None,
            };
            let mut from = 0;
            loop {
                // Paced alone too: a call sent meanwhile starts at the next part.
                let part = match tokens {
                    Some(tokens) => {
                        let rows = pacer.rows();
                        PromptPiece::Tokens(tokens[from..(from + rows).min(tokens.len())].to_vec())
                    }
                    None => piece.clone(),
                };
                let rows = match &part {
                    PromptPiece::Tokens(t) => t.len(),
                    PromptPiece::Embeddings { .. } => 0,
                };
                let (result, elapsed) = {
                    let _turn = self.policy.cores.turn_of(&self.flow, self.booked.take());
                    let started = Instant::now();
                    let result = self.sequences.with_room(&mut self.ctx, |ctx| {
                        ctx.eval(std::slice::from_ref(&part), seq, Some(caller.stop()))
                    });
                    self.rest_if_others_wait();
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

    /// Between two parts of `busy`'s media prompt: take what the seats sent, settle the
    /// others' running calls and start what they queued (but a media prompt of their own,
    /// which waits for this one), then one step of them.
    pub(super) fn step_others(&mut self, busy: u64) {
        // A closed inbox means every seat has dropped: their calls end as they would.
        let _ = self.receive();
        let ids: Vec<u64> = self.members.keys().copied().filter(|&m| m != busy).collect();
        for id in ids {
            while let Some(member) = self.members.get_mut(&id) {
                match member.running.take() {
                    Some(running) => {
                        if let Some(still) = self.check_running(id, running) {
                            self.member(id).running = Some(still);
                            break;
                        }
                    }
                    None => {
                        if member.queue.front().is_none_or(|op| matches!(op, SeatOp::Eval { .. })) {
                            break;
                        }
                        let op = member.queue.pop_front().expect("a queued op");
                        self.start(id, op);
                    }
                }
            }
        }
        if self.members.values().any(|m| m.running.is_some()) && self.has_rows() {
            self.step();
        }
    }

    /// A media prompt: `Context::eval` into the seat's sequence (checked by the caller),
    /// in parts.
    pub(super) fn eval(
        &mut self,
        id: u64,
        pieces: &[PromptPiece],
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
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
        self.evaluating = Some(id);
        let result = self.eval_in_parts(id, slot as i32, pieces, caller);
        self.evaluating = None;
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
