//! The batch's thread: one loop that owns the shared context and every seat's state.
//! It takes what the seats sent, settles calls between steps (`calls.rs`), asks the
//! scheduler (`engine/schedule.rs`) for the next step's rows, decodes them in one
//! `llama_decode` whose abort callback polls every member's stop, and hands each
//! member its part of the result (or rolls the step back: `rollback.rs`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::calls::{Member, Running};
use super::seat::{Op, SeatOp};
use super::sequences::{Sequences, MAX_LEFTOVERS};
use super::{Arrivals, BatchPolicy, StepReport};
use crate::engine::schedule::{
    BesideTurn, Candidate, Pick, Plan, Scheduler, StepEnd, Stepped, Want, YieldTo,
};
use crate::engine::{Booking, Flow};
use crate::native::{self, Batch, CancelFlag, Context, Error, Stop, TokenLoop};

/// How long the thread sleeps when every member waits for its reader.
const DELIVERY_POLL: Duration = Duration::from_millis(1);

/// The batch's thread: the shared context, its sequences, its scheduler and its members.
pub(super) struct Steps {
    pub(super) ctx: Context,
    pub(super) policy: BatchPolicy,
    /// Which sequence each seat is bound to, and the leftovers.
    pub(super) sequences: Sequences,
    /// Whose rows each step takes.
    pub(super) scheduler: Scheduler,
    pub(super) members: BTreeMap<u64, Member>,
    /// What the seats send (set when the loop starts): read between steps, and between
    /// the parts of a media prompt.
    pub(super) inbox: Option<mpsc::Receiver<Op>>,
    /// The member whose media prompt is being evaluated, if any: its queued ops wait,
    /// and its leaving waits in `deferred_leaves` until that evaluation has returned.
    pub(super) evaluating: Option<u64>,
    pub(super) deferred_leaves: Vec<u64>,
    /// Where seats signal an arrival (`Batcher::arrived`), and the flag of this loop.
    pub(super) arrived_slot: Arc<Mutex<Arrivals>>,
    pub(super) arrived: CancelFlag,
    /// This batch's turns on the cores, one a round beside the tenants' own work.
    pub(super) flow: Flow,
    /// The turn of work beside the batch, from the steps that computed tokens.
    pub(super) beside: BesideTurn,
    /// The next step's turn, booked as the last step ended
    /// ([`crate::engine::Cores::book`]); dropped, and so given up, whenever the loop has
    /// no step to run.
    pub(super) booked: Option<Booking>,
    /// Test hook: every step that may yield does so at this node (as if a call arrived
    /// then: a flood of arrivals).
    #[cfg(test)]
    pub(super) yield_at: Option<u64>,
}

/// Rows one member contributes to a step.
pub(super) struct Share {
    id: u64,
    slot: usize,
    rows: Batch,
    /// Rows of a long prompt (see `BatchPolicy::long_prompt_rows`).
    long: bool,
}

impl Steps {
    pub(super) fn new(
        ctx: Context,
        policy: BatchPolicy,
        arrived_slot: Arc<Mutex<Arrivals>>,
    ) -> Self {
        Self {
            ctx,
            sequences: Sequences::new(policy.seats),
            scheduler: Scheduler::new(&policy),
            policy,
            members: BTreeMap::new(),
            inbox: None,
            evaluating: None,
            deferred_leaves: Vec::new(),
            arrived_slot,
            arrived: CancelFlag::new(),
            flow: Flow::new_batch(),
            beside: BesideTurn::default(),
            booked: None,
            #[cfg(test)]
            yield_at: None,
        }
    }

    /// Take what the seats sent, settle it (`advance`: pieces out, ends answered), then
    /// step if anyone has rows; block only when nobody has. The pieces of the step just
    /// computed are handed over before that question is asked, so a generation goes
    /// from step to step without waiting (it used to sleep one `DELIVERY_POLL` a token).
    pub(super) fn run(mut self, ops: mpsc::Receiver<Op>) {
        self.inbox = Some(ops);
        loop {
            // A fresh arrival flag before taking what was sent: a call sent from here on
            // sets it, and one sent before is taken below.
            self.fresh_arrivals();
            if self.receive() {
                return self.close();
            }
            for id in std::mem::take(&mut self.deferred_leaves) {
                self.leave(id);
            }
            self.advance();
            if self.has_rows() {
                self.step();
                continue;
            }
            self.booked = None;
            // Nothing to compute: wait for a seat's op, polling while a reader's full
            // buffer holds a generation back.
            let ops = self.inbox.as_ref().expect("the loop's inbox");
            let op = if self.members.values().any(|m| m.running.is_some()) {
                ops.recv_timeout(DELIVERY_POLL)
                    .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
            } else {
                ops.recv().map_err(|_| true)
            };
            match op {
                Ok(op) => self.take(op),
                Err(true) => return self.close(),
                Err(false) => {}
            }
        }
    }

    /// A new arrival flag, counting everyone's calls until the next plan says whose.
    fn fresh_arrivals(&mut self) {
        self.arrived = CancelFlag::new();
        *self.arrived_slot.lock().unwrap_or_else(PoisonError::into_inner) =
            Arrivals { flag: self.arrived.clone(), except: None };
    }

    /// Take every op the seats have sent so far; whether nobody can send any more.
    pub(super) fn receive(&mut self) -> bool {
        loop {
            let next = self.inbox.as_ref().expect("the loop's inbox").try_recv();
            match next {
                Ok(op) => self.take(op),
                Err(e) => return e == mpsc::TryRecvError::Disconnected,
            }
        }
    }

    /// Nobody can send any more (every seat left first): the context is freed here, on
    /// its own thread, when `self` drops.
    pub(super) fn close(mut self) {
        let ids: Vec<u64> = self.members.keys().copied().collect();
        ids.into_iter().for_each(|id| self.leave(id));
    }

    pub(super) fn take(&mut self, op: Op) {
        match op {
            #[cfg(test)]
            Op::Pause(gate) => {
                self.booked = None;
                let _ = gate.recv();
                // What was sent meanwhile is taken next, before any step: not arrivals.
                self.fresh_arrivals();
            }
            #[cfg(test)]
            Op::YieldAt(node) => self.yield_at = Some(node),
            Op::Join { id, group, claim, meter, alive, n_ctx, n_batch } => {
                let member = Member {
                    group,
                    claim,
                    meter,
                    alive,
                    n_ctx,
                    n_batch,
                    slot: None,
                    logits: Vec::new(),
                    queue: VecDeque::new(),
                    running: None,
                };
                tracing::trace!(seat = id, group = %member.group, "seat joined");
                self.members.insert(id, member);
            }
            // A seat that left has no calls (its ops would drop unanswered).
            Op::Seat { id, op } => {
                if let Some(m) = self.members.get_mut(&id) {
                    tracing::trace!(
                        seat = id,
                        group = %m.group,
                        computes = op.computes(),
                        queued = m.queue.len(),
                        "call arrived"
                    );
                    m.queue.push_back(op);
                }
            }
            // The member in a media prompt leaves once that has returned (its dropped
            // seat's call stops it at the next part).
            Op::Leave { id } if self.evaluating == Some(id) => self.deferred_leaves.push(id),
            Op::Leave { id } => self.leave(id),
        }
    }

    /// The seat is gone: stop its work, undo its running call, free its sequence.
    pub(super) fn leave(&mut self, id: u64) {
        if let Some(running) = self.members.get_mut(&id).and_then(|m| m.running.take()) {
            self.member(id).meter.add_cancel();
            self.undo(id, running, Err(Error::Cancelled));
        }
        self.scheduler.forget(id);
        let Some(member) = self.members.remove(&id) else { return };
        if let Some(slot) = member.slot {
            self.sequences.release(slot, member.group);
            self.sequences.keep_leftovers(&mut self.ctx, MAX_LEFTOVERS);
        }
        // `member.alive` drops here: its run sees this seat's native work ended.
    }

    /// Whether some member has rows to decode now.
    pub(super) fn has_rows(&self) -> bool {
        self.members.values().any(|m| match &m.running {
            Some(Running::Decode(_)) => true,
            Some(Running::Generate(g)) => g.undelivered.is_empty() && g.finish.is_none(),
            None => m.queue.front().is_some_and(SeatOp::computes),
        })
    }

    /// Between steps: answer the ops that compute nothing, start the compute ops at the
    /// front of each queue, deliver pieces, and end calls that were cancelled or are done.
    pub(super) fn advance(&mut self) {
        let ids: Vec<u64> = self.members.keys().copied().collect();
        for id in ids {
            loop {
                let running = self.members.get_mut(&id).and_then(|m| m.running.take());
                match running {
                    Some(running) => {
                        if let Some(still) = self.check_running(id, running) {
                            self.members.get_mut(&id).expect("member").running = Some(still);
                            break;
                        }
                    }
                    None => {
                        let Some(op) = self.members.get_mut(&id).and_then(|m| m.queue.pop_front())
                        else {
                            break;
                        };
                        self.start(id, op);
                    }
                }
            }
        }
    }

    pub(super) fn member(&mut self, id: u64) -> &mut Member {
        self.members.get_mut(&id).expect("a member of this batch")
    }

    /// Where the seat's sequence ends (-1: empty, or not bound yet).
    pub(super) fn end_of(&self, id: u64) -> i32 {
        match self.members.get(&id).and_then(|m| m.slot) {
            Some(slot) => self.ctx.seq_pos_max(slot as i32).unwrap_or(-1),
            None => -1,
        }
    }

    /// The scheduler's plan for the next step, as each member's rows in ascending
    /// sequence ids (the same members give the same batch, whoever was picked first),
    /// and whether the step may yield to a newcomer (whose calls count are set here).
    pub(super) fn plan(&mut self) -> (Vec<Share>, bool) {
        let candidates: Vec<Candidate<'_>> = (self.members.iter())
            .filter_map(|(&id, m)| {
                Some(Candidate { id, group: &m.group, claim: m.claim, want: Self::want(m)? })
            })
            .collect();
        let Plan { picks, yields } = self.scheduler.plan(&candidates);
        let mut shares: Vec<Share> = picks.into_iter().map(|pick| self.share(pick)).collect();
        shares.sort_by_key(|s| s.slot);
        #[cfg(test)]
        if let (YieldTo::Anyone, Some(node)) = (&yields, self.yield_at) {
            self.arrived.trip_after(node);
        }
        let listens = yields != YieldTo::Nobody;
        if let YieldTo::AllBut(except) = yields {
            // Calls sent since the fresh flag and taken already may have set it: the
            // step then stops at its first node, and is planned again with them.
            self.arrived_slot.lock().unwrap_or_else(PoisonError::into_inner).except = Some(except);
        }
        (shares, listens)
    }

    /// What a member would compute in the next step: a generation's next token
    /// (delivered, not finished) or the rows left of a prompt.
    pub(super) fn want(m: &Member) -> Option<Want> {
        m.slot?;
        match m.running.as_ref()? {
            Running::Decode(d) => {
                (d.done < d.batch.len()).then(|| Want::Prompt(d.batch.len() - d.done))
            }
            Running::Generate(g) => match &g.tokens {
                None => {
                    let left = g.request.prompt.len() - g.prompt_done;
                    (left > 0).then_some(Want::Prompt(left))
                }
                Some(_) => (g.next.is_some() && g.undelivered.is_empty() && g.finish.is_none())
                    .then_some(Want::Token),
            },
        }
    }

    /// A pick's rows: a generation's next token, or the next rows of a prompt.
    pub(super) fn share(&self, pick: Pick) -> Share {
        let m = &self.members[&pick.id];
        let slot = m.slot.expect("planned members are bound");
        let rows = match &m.running {
            Some(Running::Generate(g)) if g.tokens.is_some() => {
                let pos = g.tokens.as_ref().map_or(0, TokenLoop::pos);
                Batch::sequence(&[g.next.expect("a token was planned")], pos, slot as i32)
            }
            _ => self.prompt_rows(pick.id, pick.rows),
        };
        Share { id: pick.id, slot, rows, long: pick.long }
    }

    /// The next `n` rows of `id`'s prompt (a decode's batch or a generation's prompt).
    pub(super) fn prompt_rows(&self, id: u64, n: usize) -> Batch {
        let m = &self.members[&id];
        let slot = m.slot.expect("a member with a prompt running is bound");
        match &m.running {
            Some(Running::Decode(d)) => {
                let range = d.done..d.done + n;
                Batch {
                    tokens: d.batch.tokens[range.clone()].to_vec(),
                    positions: d.batch.positions[range.clone()].to_vec(),
                    seq_ids: vec![slot as i32; n],
                    logits: d.batch.logits[range].to_vec(),
                }
            }
            Some(Running::Generate(g)) => {
                let prompt = &g.request.prompt;
                let mut rows = Batch::sequence(
                    &prompt[g.prompt_done..g.prompt_done + n],
                    g.end_before + 1 + g.prompt_done as i32,
                    slot as i32,
                );
                rows.logits = (0..n).map(|r| g.prompt_done + r + 1 == prompt.len()).collect();
                rows
            }
            None => unreachable!("planned members are running"),
        }
    }

    /// One `llama_decode` of every member's rows.
    pub(super) fn step(&mut self) {
        let (shares, yields) = self.plan();
        if shares.is_empty() {
            self.booked = None;
            return;
        }
        // llama.cpp's log lines from this step name the groups (tenant/plugin) whose
        // rows it computes.
        let members: Vec<&str> =
            shares.iter().map(|s| self.members[&s.id].group.as_str()).collect();
        let _in_span = tracing::info_span!("batch_step", members = %members.join(",")).entered();
        let mut batch = Batch::default();
        for share in &shares {
            batch.tokens.extend(&share.rows.tokens);
            batch.positions.extend(&share.rows.positions);
            batch.seq_ids.extend(&share.rows.seq_ids);
            batch.logits.extend(&share.rows.logits);
        }
        let tokens = shares.iter().any(|s| {
            matches!(&self.members[&s.id].running, Some(Running::Generate(g)) if g.tokens.is_some())
        });
        // The turn is held until the step's tokens are sampled and sent, and the next
        // step's turn is booked before it ends (`Cores::book`): on cores that work beside
        // the batch keeps busy, this thread would otherwise wait for a core behind that
        // work's threads, and slow them down once it got one.
        let cores = self.policy.cores.clone();
        let turn;
        let (result, elapsed, cancelled) = {
            let mut stops: Vec<Stop<'_>> = shares
                .iter()
                .map(|s| match &self.members[&s.id].running {
                    Some(Running::Decode(d)) => d.caller.stop(),
                    Some(Running::Generate(g)) => g.caller.stop(),
                    None => unreachable!("planned members are running"),
                })
                .collect();
            let members = stops.len();
            if yields {
                stops.push(Stop::on(&self.arrived));
            }
            // A step that someone's next token waits for (token rows, a chat's prompt)
            // shortens the turn of work beside the batch now, while it waits for the
            // cores: a chat sent after the batch fell idle waited out a whole target of
            // another tenant's embedding (traced at 2 threads: TTFT p50 200 ms, 67 alone).
            if shares.iter().any(|s| !s.long) {
                self.set_turn(true);
            }
            turn = cores.turn_of(&self.flow, self.booked.take());
            let started = Instant::now();
            let stop = Stop::Any(&stops);
            let result =
                self.sequences.with_room(&mut self.ctx, |ctx| ctx.decode(&batch, Some(stop)));
            self.rest_if_others_wait();
            (
                result,
                started.elapsed(),
                stops[..members].iter().map(Stop::is_set).collect::<Vec<_>>(),
            )
        };
        let stopped = result == Err(Error::Cancelled);
        let yielded = stopped && !cancelled.iter().any(|&c| c);
        let end = match &result {
            Ok(()) => StepEnd::Computed,
            Err(_) if yielded => StepEnd::Yielded,
            Err(Error::Cancelled) => StepEnd::RolledBack,
            Err(_) => StepEnd::Failed,
        };
        let stepped: Vec<Stepped<'_>> = (shares.iter().zip(&cancelled))
            .map(|(s, &cancelled)| {
                let m = &self.members[&s.id];
                m.alive.add_busy(elapsed.mul_f64(s.rows.len() as f64 / batch.len() as f64));
                Stepped {
                    group: &m.group,
                    weight: m.claim.weight,
                    rows: s.rows.len(),
                    long: s.long,
                    cancelled,
                }
            })
            .collect();
        self.scheduler.stepped(&stepped, elapsed, end);
        if end == StepEnd::Computed {
            self.beside.stepped(elapsed, tokens);
        }
        self.set_turn(self.streaming());
        let report = StepReport {
            seats: shares.len(),
            rows: batch.len(),
            long_rows: shares.iter().filter(|s| s.long).map(|s| s.rows.len()).sum(),
            active_seats: self.members.len(),
            elapsed,
            rolled_back: result.is_err() && !yielded,
            yielded,
        };
        // Each member's group and rows, for finding out who waited on whom.
        tracing::trace!(
            rows = ?shares.iter().map(|s| (&self.members[&s.id].group, s.rows.len())).collect::<Vec<_>>(),
            ms = elapsed.as_secs_f64() * 1e3,
            ?end,
            "batch step"
        );
        if let Some(observe) = &self.policy.observer {
            observe(&report);
        }
        match result {
            Ok(()) => {
                let mut row = 0;
                for share in shares {
                    let (n, id) = (share.rows.len(), share.id);
                    // A token row's sampling is computed here, after the decode: the
                    // scheduler counts it in what the member's group costs a step.
                    let started = Instant::now();
                    self.decoded(share, row);
                    if let Some(member) = self.members.get(&id).filter(|_| n == 1) {
                        self.scheduler.sampled(&member.group, started.elapsed());
                    }
                    row += n;
                }
            }
            // Rolled back for everyone; the cancelled end between steps (`advance`), the
            // others' rows run again in the next step (after the newcomer's, if it yielded).
            Err(Error::Cancelled) => {}
            Err(e) => {
                for share in shares {
                    if let Some(running) = self.member(share.id).running.take() {
                        self.undo(share.id, running, Err(e.clone()));
                    }
                }
            }
        }
        // Most steps have a next one. Booked only now: booked before
        // `rest_if_others_wait`, our own booking would have rested the team for nothing.
        self.booked = Some(cores.book(&self.flow));
        drop(turn);
    }

    /// Whether a member streams (its generation's tokens go out as they come).
    fn streaming(&self) -> bool {
        (self.members.values())
            .any(|m| matches!(&m.running, Some(Running::Generate(g)) if g.tokens.is_some()))
    }

    /// At the end of a turn on the cores: if someone else's work goes next, the team's
    /// idle threads sleep instead of spinning through its turn on the cores it needs.
    pub(super) fn rest_if_others_wait(&self) {
        if self.policy.cores.others_wait() {
            self.ctx.rest_threads();
        }
    }

    /// Set the turn of work beside the batch ([`BesideTurn`]): `awaited` whether a
    /// token waits for the batch's steps.
    fn set_turn(&self, awaited: bool) {
        self.policy.cores.set_turn(self.beside.length(awaited, self.policy.step_target));
    }

    /// A share of a successful step, whose rows started at `first_row` of the step.
    pub(super) fn decoded(&mut self, share: Share, first_row: usize) {
        let Share { id, slot, rows, .. } = share;
        let n = rows.len();
        self.sequences.extend(slot, &rows.tokens);
        let logits_of = |ctx: &Context, r: usize| {
            ctx.logits_ith((first_row + r) as u32).map(<[f32]>::to_vec).ok()
        };
        self.members[&id].meter.add_decoded(n as u64);
        let mut running = self.member(id).running.take().expect("planned members are running");
        match &mut running {
            Running::Decode(d) => {
                for r in 0..n {
                    if rows.logits[r] {
                        d.logits[d.done + r] = logits_of(&self.ctx, r);
                    }
                }
                d.done += n;
                if d.done == d.batch.len() {
                    let Running::Decode(d) = running else { unreachable!() };
                    self.member(id).logits = d.logits;
                    d.caller.reply.send(Ok(()));
                    return;
                }
            }
            Running::Generate(g) => match g.tokens.as_mut() {
                None => {
                    g.prompt_done += n;
                    if g.prompt_done == g.request.prompt.len() {
                        let logits = logits_of(&self.ctx, n - 1).unwrap_or_default();
                        self.start_tokens(id, g, &logits);
                    }
                }
                Some(tokens) => {
                    let token = g.next.take().expect("a token was planned");
                    match tokens.decoded(token) {
                        Ok((piece, matched)) => {
                            g.undelivered.push_back(piece);
                            match matched {
                                Some(reason) => g.finish = Some(Ok(reason)),
                                None => {
                                    let picked = self
                                        .ctx
                                        .logits_ith(first_row as u32)
                                        .and_then(|l| tokens.pick(&mut g.sampler, l));
                                    match picked {
                                        Ok(native::Pick::Decode(next)) => g.next = Some(next),
                                        Ok(native::Pick::Finish(reason)) => {
                                            g.finish = Some(Ok(reason))
                                        }
                                        Err(e) => g.finish = Some(Err(e)),
                                    }
                                }
                            }
                        }
                        Err(e) => g.finish = Some(Err(e)),
                    }
                    if g.finish.is_some() {
                        if let Some(logits) = logits_of(&self.ctx, 0) {
                            self.keep_last_logits(id, logits);
                        }
                    }
                }
            },
        }
        self.member(id).running = Some(running);
    }
}
