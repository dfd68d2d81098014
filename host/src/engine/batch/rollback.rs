//! Undoing a seat's call: all or nothing. A cancelled, failed or abandoned call leaves
//! the seat's sequence as it found it (a generation in its token loop keeps the prompt
//! and what was delivered); a call that bound the seat frees the sequence again with
//! its leftover as before. A step stopped in flight was already cut back for every
//! member by `Context::decode`; the scheduler charges whoever caused it
//! (`Scheduler::stepped`).

use super::calls::Running;
use super::thread::Steps;
use crate::native::{self, Error, FinishReason, Outcome};

impl Steps {
    /// Undo `running` (cancelled, failed, or its seat gone) and answer its caller with
    /// `result` (a generation that ends `Ok(reason)` keeps its delivered tokens).
    pub(super) fn undo(&mut self, id: u64, running: Running, result: native::Result<FinishReason>) {
        match running {
            Running::Decode(d) => {
                if d.bound_here {
                    self.unbind(id, d.kept);
                } else {
                    self.truncate(id, d.end_before);
                }
                d.caller.reply.send(result.map(|_| ()));
            }
            Running::Generate(mut g) => {
                // A cancelled generation is an outcome, not an error (as `generate`).
                let result = match result {
                    Err(Error::Cancelled) => Ok(FinishReason::Cancelled),
                    other => other,
                };
                match g.tokens.as_ref() {
                    // In the token loop: memory keeps the prompt and what was delivered.
                    Some(tokens) => {
                        let end = tokens.pos() - 1;
                        self.truncate(id, end);
                        g.undelivered.clear();
                        self.finish_generation(id, g, result);
                    }
                    // In the prefill: as before the call.
                    None => {
                        if g.bound_here {
                            self.unbind(id, g.kept);
                        } else {
                            self.truncate(id, g.end_before);
                        }
                        let cancelled = Outcome {
                            finish: FinishReason::Cancelled,
                            usage: native::GenerationUsage::default(),
                        };
                        g.caller.reply.send(result.map(|_| cancelled));
                    }
                }
            }
        }
    }

    /// Undo a call that bound the seat, keeping `kept` leftover rows: the sequence
    /// holds what it held when it was bound and is free again (its leftover stays for
    /// a later seat of the group), and the seat reads as empty, as before the call.
    pub(super) fn unbind(&mut self, id: u64, kept: usize) {
        self.truncate(id, kept as i32 - 1);
        if let Some(slot) = self.member(id).slot.take() {
            self.sequences.unbind(slot);
        }
    }

    /// Cut the seat's sequence back to end at `end` (everything past it removed).
    pub(super) fn truncate(&mut self, id: u64, end: i32) {
        let Some(slot) = self.members[&id].slot else { return };
        self.sequences.truncate(&mut self.ctx, slot, end);
    }
}
