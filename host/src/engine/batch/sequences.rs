//! The batch's sequences, its KV manager: which native sequence a seat is
//! bound to, and what an earlier seat of the same group left there to reuse. Each
//! sequence's tokens are kept beside its cells while they are known, so that a new
//! call's prompt can be matched against them.
//!
//! - A seat binds at its first decode or generation, to the free sequence whose
//!   leftover (from a seat of the *same group*) shares the longest start with the
//!   call's tokens; of equal ones the least recently left, so the newest stays for its
//!   own next turn. The rest of the leftover is removed; the kept rows are not computed.
//! - With nothing to reuse, the lowest empty sequence (another tenant's leftover is not
//!   thrown away while an empty one is free); else the leftover left longest ago.
//! - Across groups nothing is kept: the timing must not cross tenants.
//! - The sequences share one pool of cells. Leftovers live in it until a step finds the
//!   pool full (then the oldest goes: `with_room`), and at most `MAX_LEFTOVERS` of them:
//!   every cell in use widens every step's attention (masked for other sequences), so
//!   many leftovers would cost every stream more than reuse saves.

use crate::native::{self, Context, Token};

/// Leftovers kept at most (the most recently left): as many as four fixed seats kept.
/// A pool full of leftovers slowed a lone stream's every token by 20–45% (bench/SERVING.md).
pub(super) const MAX_LEFTOVERS: usize = 4;

/// One native sequence of the shared context.
#[derive(Default)]
struct Slot {
    /// The seat bound to it.
    seat: Option<u64>,
    /// The group whose seat last held it (whose leftover it keeps).
    group: String,
    /// What it holds, token by token, while that is known (not after embeddings).
    tokens: Option<Vec<Token>>,
    /// When its last seat left (`Sequences::releases` then): of two leftovers that serve a
    /// call as well, the older one goes, so the newest stays for its likely next turn.
    released: u64,
}

/// The shared context's sequences and what each holds.
pub(super) struct Sequences {
    slots: Vec<Slot>,
    /// Seats that have left, counted (`Slot::released`).
    releases: u64,
}

impl Sequences {
    /// `n` empty sequences (ids 0..n).
    pub fn new(n: u32) -> Self {
        Self { slots: (0..n).map(|_| Slot::default()).collect(), releases: 0 }
    }

    /// Bind `seat` of `group` to a free sequence for a call whose rows start with
    /// `tokens` (from position 0), reusing at most `most` rows of a leftover. Returns
    /// the sequence and how many rows it already holds.
    pub fn bind(
        &mut self,
        ctx: &mut Context,
        seat: u64,
        group: &str,
        tokens: &[Token],
        most: usize,
    ) -> (usize, usize) {
        let common = |slot: &Slot| match &slot.tokens {
            Some(held) if slot.group == group => {
                held.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(most)
            }
            _ => 0,
        };
        let free = || self.slots.iter().enumerate().filter(|(_, s)| s.seat.is_none());
        // The longest shared start; of equal ones, the least recently left.
        let best = free()
            .map(|(i, s)| (common(s), std::cmp::Reverse(s.released), std::cmp::Reverse(i)))
            .max();
        let empty = |s: &Slot| s.group.is_empty() || s.tokens.as_ref().is_some_and(Vec::is_empty);
        let fresh = free()
            .min_by_key(|(i, s)| (!empty(s), if empty(s) { 0 } else { s.released }, *i))
            .map(|(i, _)| i)
            .expect("a seat was leased, so a sequence is free");
        let (slot, kept) = match best {
            Some((kept, _, std::cmp::Reverse(i))) if kept > 0 => (i, kept),
            _ => (fresh, 0),
        };
        // The rest of what the sequence held goes (all of it from another group).
        let _ = ctx.seq_rm(slot as i32, kept as i32, -1);
        let s = &mut self.slots[slot];
        s.seat = Some(seat);
        s.group = group.to_string();
        s.tokens = Some(s.tokens.take().unwrap_or_default().into_iter().take(kept).collect());
        (slot, kept)
    }

    /// The seat bound to `slot` left: what it holds stays as `group`'s leftover.
    pub fn release(&mut self, slot: usize, group: String) {
        self.releases += 1;
        let s = &mut self.slots[slot];
        (s.seat, s.group, s.released) = (None, group, self.releases);
    }

    /// `slot` is free again, its leftover as it was before a call bound it.
    pub fn unbind(&mut self, slot: usize) {
        self.slots[slot].seat = None;
    }

    /// Cut `slot` back to end at `end` (everything past it removed).
    pub fn truncate(&mut self, ctx: &mut Context, slot: usize, end: i32) {
        let _ = ctx.seq_rm(slot as i32, end + 1, -1);
        if let Some(tokens) = &mut self.slots[slot].tokens {
            tokens.truncate((end + 1) as usize);
        }
    }

    /// `seq_rm` of positions `[p0, p1)` (`p1` < 0: to the end) of `slot`; a hole makes
    /// its tokens unknown (no longer a prefix of anything).
    pub fn remove(
        &mut self,
        ctx: &mut Context,
        slot: usize,
        p0: i32,
        p1: i32,
    ) -> native::Result<()> {
        ctx.seq_rm(slot as i32, p0, p1)?;
        let tokens = &mut self.slots[slot].tokens;
        if let Some(held) = tokens {
            let len = held.len();
            if p1 < 0 || p1 as usize >= len {
                held.truncate(p0.max(0) as usize);
            } else if (p0 as usize) < len && p1 > p0 {
                *tokens = None;
            }
        }
        Ok(())
    }

    /// Run `f` (a decode or an evaluation into the shared context) until it finds room:
    /// while the pool is full, the leftover left longest ago is thrown away and `f`
    /// runs again (a full pool fails before anything is computed). The seats' own
    /// cells are reserved (`reserve.rs`), so once no leftover is left the rows fit,
    /// unless `f` asks for more than its seats reserved.
    pub fn with_room<T>(
        &mut self,
        ctx: &mut Context,
        mut f: impl FnMut(&mut Context) -> native::Result<T>,
    ) -> native::Result<T> {
        loop {
            match f(ctx) {
                Err(native::Error::ContextFull) if self.evict_leftover(ctx) => continue,
                result => return result,
            }
        }
    }

    /// Keep at most `most` leftovers, throwing away those left longest ago.
    pub fn keep_leftovers(&mut self, ctx: &mut Context, most: usize) {
        let held =
            |s: &Slot| !s.group.is_empty() && s.tokens.as_ref().is_none_or(|t| !t.is_empty());
        while self.slots.iter().filter(|s| s.seat.is_none() && held(s)).count() > most {
            if !self.evict_leftover(ctx) {
                return;
            }
        }
    }

    /// Throw away the leftover left longest ago; whether there was one.
    fn evict_leftover(&mut self, ctx: &mut Context) -> bool {
        let oldest = (self.slots.iter().enumerate())
            .filter(|(i, s)| {
                s.seat.is_none() && ctx.seq_pos_max(*i as i32).is_ok_and(|end| end >= 0)
            })
            .min_by_key(|(_, s)| s.released)
            .map(|(i, _)| i);
        let Some(slot) = oldest else { return false };
        let _ = ctx.seq_rm(slot as i32, 0, -1);
        let s = &mut self.slots[slot];
        (s.group, s.tokens) = (String::new(), Some(Vec::new()));
        true
    }

    /// Everything of `slot` removed.
    pub fn clear(&mut self, ctx: &mut Context, slot: usize) {
        let _ = ctx.seq_rm(slot as i32, 0, -1);
        self.slots[slot].tokens = Some(Vec::new());
    }

    /// `tokens` were decoded into `slot`, after what it held.
    pub fn extend(&mut self, slot: usize, tokens: &[Token]) {
        if let Some(held) = &mut self.slots[slot].tokens {
            held.extend(tokens);
        }
    }

    /// `slot` now holds rows that are not tokens (media embeddings): not a prefix of
    /// any prompt.
    pub fn forget_tokens(&mut self, slot: usize) {
        self.slots[slot].tokens = None;
    }
}
