//! A seat: a plugin's one-sequence context as a sequence of a batch's shared context.
//! Its methods send ops to the batch's thread, in order; each returns a `Call` that
//! stops its native work in flight when dropped or when its token is set.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc as pieces;

use super::reserve::Ask;
use super::Batcher;
use crate::engine::schedule::Claim;
use crate::engine::Meter;
use crate::native::{
    self, Batch, CancelFlag, GenerateRequest, Outcome, Piece, PromptPiece, Sampler, Stop, Token,
};
use crate::worker::{Alive, Call, Reply};

/// A plugin's context as a sequence of a shared context. Dropping it stops its call in
/// flight (if any), removes its rows, and frees the sequence for the next seat.
pub struct Seat {
    pub(super) id: u64,
    /// What it reserved, given back when it drops.
    pub(super) ask: Ask,
    pub(super) batcher: Arc<Batcher>,
}

impl Seat {
    fn send<R: Send + 'static>(&self, make: impl FnOnce(Reply<R>) -> SeatOp) -> Call<R> {
        let (call, reply) = Call::channel();
        let op = make(reply);
        // A long prompt's rows wait for time earned beside others' work: a step thrown
        // away for its arrival would buy nobody an earlier token.
        let arrives =
            op.computes() && op.prompt_rows() <= self.batcher.policy.long_prompt_rows as usize;
        // If the thread is gone, the op (and its reply) drops: the call resolves to `None`.
        let _ = self.batcher.ops.send(Op::Seat { id: self.id, op });
        if arrives {
            // After the send: a flag put in place before it is set; one put after it
            // belongs to a loop that takes the op first.
            let arrivals = self.batcher.arrived.lock().unwrap_or_else(PoisonError::into_inner);
            arrivals.arrive(&self.ask.group);
        }
        call
    }

    /// Decode `batch` (sequence 0 of this seat), stopping in flight when `token` is set.
    pub fn decode(&self, batch: Batch, token: CancelFlag) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::Decode { batch, caller: Caller { token, reply } })
    }

    /// Generate on this seat (native::generate's contract), pieces sent to `pieces`.
    pub fn generate(
        &self,
        sampler: Sampler,
        request: GenerateRequest,
        token: CancelFlag,
        pieces: pieces::Sender<Piece>,
    ) -> Call<native::Result<Outcome>> {
        self.send(|reply| SeatOp::Generate {
            sampler: Box::new(sampler),
            request,
            pieces,
            caller: Caller { token, reply },
        })
    }

    /// `Context::eval` of a media prompt, as a step of its own.
    pub fn eval(
        &self,
        pieces: Vec<PromptPiece>,
        seq: i32,
        token: CancelFlag,
    ) -> Call<native::Result<i32>> {
        self.send(|reply| SeatOp::Eval { pieces, seq, caller: Caller { token, reply } })
    }

    /// Logits of `row` of the last successful decode, or of its last row (`None`).
    pub fn logits(&self, row: Option<u32>) -> Call<native::Result<Vec<f32>>> {
        self.send(|reply| SeatOp::Logits { row, reply })
    }

    /// `sampler.sample` on row `row`'s logits, on the batch's thread.
    pub fn sample(&self, sampler: Arc<Mutex<Sampler>>, row: u32) -> Call<native::Result<Token>> {
        self.send(|reply| SeatOp::Sample { sampler, row, reply })
    }

    pub fn seq_rm(&self, seq: i32, p0: i32, p1: i32) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::SeqRm { seq, p0, p1, reply })
    }

    pub fn seq_pos_max(&self, seq: i32) -> Call<native::Result<i32>> {
        self.send(|reply| SeatOp::PosMax { seq, reply })
    }

    pub fn clear(&self) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::Clear { reply })
    }

    /// Rows one step computes per graph (the shared context's n-ubatch).
    pub fn n_ubatch(&self) -> u32 {
        self.batcher.step_rows
    }
}

impl Drop for Seat {
    /// The seat is free for the next lease at once: its `Leave` goes down the same
    /// channel before that lease's `Join`, so the thread frees the sequence first.
    fn drop(&mut self) {
        let _ = self.batcher.ops.send(Op::Leave { id: self.id });
        self.batcher.reservations.release(&self.ask);
    }
}

/// A call's caller: its token and where its result goes (whose flag says abandoned).
pub(super) struct Caller<T> {
    pub(super) token: CancelFlag,
    pub(super) reply: Reply<native::Result<T>>,
}

impl<T> Caller<T> {
    pub(super) fn stop(&self) -> Stop<'_> {
        Stop::on_either(&self.token, self.reply.abandoned())
    }
}

pub(super) enum Op {
    /// Test hook: the thread waits for the gate before it takes the next op, so a test
    /// can queue several seats' calls for one step.
    #[cfg(test)]
    Pause(std::sync::mpsc::Receiver<()>),
    /// Test hook: every step that may yield does so at this node.
    #[cfg(test)]
    YieldAt(u64),
    Join {
        id: u64,
        group: String,
        claim: Claim,
        meter: Arc<Meter>,
        alive: Alive,
        n_ctx: u32,
        n_batch: u32,
    },
    Seat {
        id: u64,
        op: SeatOp,
    },
    Leave {
        id: u64,
    },
}

pub(super) enum SeatOp {
    Decode {
        batch: Batch,
        caller: Caller<()>,
    },
    Generate {
        sampler: Box<Sampler>,
        request: GenerateRequest,
        pieces: pieces::Sender<Piece>,
        caller: Caller<Outcome>,
    },
    Eval {
        pieces: Vec<PromptPiece>,
        seq: i32,
        caller: Caller<i32>,
    },
    Logits {
        row: Option<u32>,
        reply: Reply<native::Result<Vec<f32>>>,
    },
    Sample {
        sampler: Arc<Mutex<Sampler>>,
        row: u32,
        reply: Reply<native::Result<Token>>,
    },
    SeqRm {
        seq: i32,
        p0: i32,
        p1: i32,
        reply: Reply<native::Result<()>>,
    },
    PosMax {
        seq: i32,
        reply: Reply<native::Result<i32>>,
    },
    Clear {
        reply: Reply<native::Result<()>>,
    },
}

impl SeatOp {
    /// Whether it becomes a running call with rows to decode (it may then end a step of
    /// long prompts alone).
    pub(super) fn computes(&self) -> bool {
        matches!(self, SeatOp::Decode { .. } | SeatOp::Generate { .. } | SeatOp::Eval { .. })
    }

    /// The prompt tokens it brings (before any reuse of a prefix; media not counted).
    fn prompt_rows(&self) -> usize {
        match self {
            SeatOp::Decode { batch, .. } => batch.len(),
            SeatOp::Generate { request, .. } => request.prompt.len(),
            SeatOp::Eval { pieces, .. } => (pieces.iter())
                .map(|p| match p {
                    PromptPiece::Tokens(tokens) => tokens.len(),
                    _ => 0,
                })
                .sum(),
            _ => 0,
        }
    }
}
