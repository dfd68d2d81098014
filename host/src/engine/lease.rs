//! A plugin's context as the engine runs it. The engine decides, by the host's policy,
//! what backs it: a seat of a batch (one sequence of a native context shared with other
//! runs), an idle context the same tenant left, or a new native context on a thread of
//! its own. `component` holds the [`Lease`] and maps WIT calls onto it; every call here
//! returns a [`Call`] that stops its native work in flight when dropped or when its
//! token is set, whatever backs it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;

use super::batch::{BatchPolicy, Seat, SeatRequest};
use super::registry::Opened;
use super::schedule::Claim;
use super::Meter;
use crate::native::{
    self, Batch, CancelFlag, Context, ContextParams, Error, GenerateRequest, Outcome, Piece,
    Pooling, PromptPiece, Sampler, Stop, Token,
};
use crate::worker::{Call, Tracker, Worker};

/// Pieces a generation may run ahead of its reader. A context of its own then waits
/// (`FULL_BUFFER_POLL`); a seat sits out the batch's steps until there is room.
const PIECE_BUFFER: usize = 32;

/// How often a context of its own looks for room in a full piece buffer.
const FULL_BUFFER_POLL: Duration = Duration::from_millis(1);

/// What a run asks of a new context.
pub(crate) struct LeaseRequest<'a> {
    /// The settings after the host's defaults and caps.
    pub params: ContextParams,
    /// The plugin set n-ubatch itself: it gets a native context of its own, whose
    /// ubatches it chose (a seat's are the batch's).
    pub ubatch_chosen: bool,
    /// Cells as llama.cpp allocates them for `params` (what the run is charged).
    pub allocated_n_ctx: u32,
    /// The tenant: idle contexts and a batch's leftovers only go to their own group.
    pub group: &'a str,
    /// The run's claim on the cores: how a batch schedules the seat's rows.
    pub claim: Claim,
    pub meter: Arc<Meter>,
    /// The run's threads: it returns only once the lease's native work has stopped.
    pub tracker: &'a Tracker,
}

/// The native side of one plugin context.
pub(crate) enum Lease {
    /// A native context of its own on its own thread.
    Own(Worker<Context>),
    /// One sequence of a batch's shared context.
    Seat(Seat),
}

impl Opened {
    /// Back a new context: a seat when the host batches contexts like this one (one
    /// sequence, n-ubatch left to the host, n-ctx within a seat) and one is free, else
    /// an idle context of the same group and settings, else a new one. Returns the
    /// settings it runs with.
    pub(crate) async fn lease(
        &self,
        want: LeaseRequest<'_>,
    ) -> Result<(Lease, ContextParams), Error> {
        let want = LeaseRequest { params: own_params(self.policy.as_ref(), want.params), ..want };
        if let Some(seat) = self.lease_seat(&want).await {
            return seat;
        }
        if let Some(reused) = self.reuse_idle(&want).await {
            return Ok(reused);
        }
        let (model, cores, meter, params) = (
            self.model.clone(),
            self.policy.as_ref().map(|p| p.cores_for(want.group)),
            want.meter,
            want.params,
        );
        let init = move || {
            let mut context = Context::new(model, params)?;
            context.set_tally(meter);
            // Beside batches, it decodes in turns with them (their steps use every core),
            // on threads kept one a CPU as theirs are.
            if cores.is_some() {
                context.pin_threads()?;
            }
            context.share_cores(cores);
            Ok::<_, Error>(context)
        };
        let worker = Worker::start("llamabox-context", want.tracker, init).await?;
        match worker.call(|c, _| c.params()).await {
            Some(params) => Ok((Lease::Own(worker), params)),
            None => Err(Error::Backend("context worker stopped".into())),
        }
    }

    async fn lease_seat(
        &self,
        want: &LeaseRequest<'_>,
    ) -> Option<Result<(Lease, ContextParams), Error>> {
        let policy = self.policy.as_ref()?;
        if want.params.n_seq_max != 1 || want.ubatch_chosen {
            return None;
        }
        let seat = SeatRequest {
            n_ctx: want.allocated_n_ctx,
            n_batch: want.params.n_batch,
            group: want.group,
            claim: want.claim,
            // A run holding no native work waits for a seat; one holding some does not,
            // so that two runs never wait on each other's seats.
            may_wait: want.tracker.live() == 0,
        };
        let seat =
            self.batch.lease(policy, &self.model, seat, want.meter.clone(), want.tracker).await?;
        Some(seat.map(|seat| {
            let granted = ContextParams {
                n_ctx: want.allocated_n_ctx,
                n_ubatch: seat.n_ubatch().min(want.params.n_batch),
                n_threads: policy.threads,
                ..want.params
            };
            (Lease::Seat(seat), granted)
        }))
    }

    /// An idle context of the run's group made with the same settings, now counted in
    /// the run and metering it; `None` if there is none (or its thread is gone).
    async fn reuse_idle(&self, want: &LeaseRequest<'_>) -> Option<(Lease, ContextParams)> {
        let worker = self.idle.take(want.group, &want.params)?;
        worker.retrack(want.tracker);
        let meter = want.meter.clone();
        let params = worker
            .call(move |c, _| {
                c.set_tally(meter);
                c.params()
            })
            .await?;
        Some((Lease::Own(worker), params))
    }

    /// The run is done with `lease` (asked for with `requested`). A seat stops its call
    /// and frees its sequence, keeping its tokens as a leftover for `group`. A context
    /// of its own with nothing queued is parked for a later run of `group`; otherwise
    /// its call is stopped and this waits until its thread has freed it, so its memory
    /// is back before the run's budget is.
    pub(crate) async fn give_back(&self, lease: Lease, group: String, requested: ContextParams) {
        let requested = own_params(self.policy.as_ref(), requested);
        let worker = match lease {
            Lease::Own(worker) => worker,
            Lease::Seat(seat) => return drop(seat),
        };
        // Parked on its own thread, so that when the call returns it reads as new and
        // no call of this run is left on it.
        if self.idle.keeps_any() && worker.is_idle() && worker.call(|c, _| c.park()).await.is_some()
        {
            self.idle.put(group, requested, worker);
        } else {
            worker.stop().await;
        }
    }
}

impl Lease {
    /// Decode `batch`, stopping in flight when `token` is set or the call is dropped.
    pub(crate) fn decode(&self, batch: Batch, token: CancelFlag) -> Call<native::Result<()>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, abandoned| {
                c.decode(&batch, Some(Stop::on_either(&token, abandoned)))
            }),
            Lease::Seat(seat) => seat.decode(batch, token),
        }
    }

    /// Generate (`native::generate`'s contract); its pieces arrive on the receiver,
    /// which ends when the generation does.
    pub(crate) fn generate(
        &self,
        mut sampler: Sampler,
        request: GenerateRequest,
        token: CancelFlag,
    ) -> (Call<native::Result<Outcome>>, mpsc::Receiver<Piece>) {
        let (tx, rx) = mpsc::channel(PIECE_BUFFER);
        let call = match self {
            Lease::Own(worker) => worker.call(move |c, abandoned| {
                let stop = Stop::on_either(&token, abandoned);
                let mut sink = |piece| deliver(&tx, piece, stop);
                native::generate(c, &mut sampler, &request, stop, &mut sink)
                // `tx` drops here: the reader sees the end of the pieces.
            }),
            // The batch's thread never waits for a slow reader: a full buffer only keeps
            // this seat out of the next steps.
            Lease::Seat(seat) => seat.generate(sampler, request, token, tx),
        };
        (call, rx)
    }

    /// `Context::eval` of a prompt with media embeddings into `seq`.
    pub(crate) fn eval(
        &self,
        pieces: Vec<PromptPiece>,
        seq: i32,
        token: CancelFlag,
    ) -> Call<native::Result<i32>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, abandoned| {
                c.eval(&pieces, seq, Some(Stop::on_either(&token, abandoned)))
            }),
            Lease::Seat(seat) => seat.eval(pieces, seq, token),
        }
    }

    /// Logits of `row` of the last successful decode, or of its last row (`None`).
    pub(crate) fn logits(&self, row: Option<u32>) -> Call<native::Result<Vec<f32>>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, _| match row {
                Some(row) => c.logits_ith(row).map(<[f32]>::to_vec),
                None => c.last_logits().map(<[f32]>::to_vec),
            }),
            Lease::Seat(seat) => seat.logits(row),
        }
    }

    /// `sampler` on `row`'s logits, where the logits are: they never leave the thread.
    pub(crate) fn sample(
        &self,
        sampler: Arc<Mutex<Sampler>>,
        row: u32,
    ) -> Call<native::Result<Token>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, _| {
                sampler.lock().unwrap_or_else(PoisonError::into_inner).sample(c.logits_ith(row)?)
            }),
            Lease::Seat(seat) => seat.sample(sampler, row),
        }
    }

    pub(crate) fn seq_rm(&self, seq: i32, p0: i32, p1: i32) -> Call<native::Result<()>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, _| c.seq_rm(seq, p0, p1)),
            Lease::Seat(seat) => seat.seq_rm(seq, p0, p1),
        }
    }

    pub(crate) fn seq_pos_max(&self, seq: i32) -> Call<native::Result<i32>> {
        match self {
            Lease::Own(worker) => worker.call(move |c, _| c.seq_pos_max(seq)),
            Lease::Seat(seat) => seat.seq_pos_max(seq),
        }
    }

    pub(crate) fn clear(&self) -> Call<native::Result<()>> {
        match self {
            Lease::Own(worker) => worker.call(|c, _| {
                c.clear();
                Ok(())
            }),
            Lease::Seat(seat) => seat.clear(),
        }
    }

    /// Pooled embeddings of `inputs`: a context of its own only (embeddings stay
    /// unbatched: a seat answers `invalid-argument` saying so).
    pub(crate) fn embed(
        &self,
        inputs: Vec<Vec<Token>>,
        pooling: Pooling,
        normalize: bool,
        token: CancelFlag,
    ) -> native::Result<Call<native::Result<Vec<Vec<f32>>>>> {
        let worker = self.own("embed")?;
        Ok(worker.call(move |c, abandoned| {
            c.embed(&inputs, pooling, normalize, Some(Stop::on_either(&token, abandoned)))
        }))
    }

    /// One embedding per row of `tokens`: a context of its own only, as `embed`.
    pub(crate) fn embed_rows(
        &self,
        tokens: Vec<Token>,
        normalize: bool,
        token: CancelFlag,
    ) -> native::Result<Call<native::Result<Vec<Vec<f32>>>>> {
        let worker = self.own("embed")?;
        Ok(worker.call(move |c, abandoned| {
            c.embed_rows(&tokens, normalize, Some(Stop::on_either(&token, abandoned)))
        }))
    }

    fn own(&self, what: &str) -> native::Result<&Worker<Context>> {
        match self {
            Lease::Own(worker) => Ok(worker),
            Lease::Seat(_) => Err(Error::InvalidArgument(format!(
                "this context is a sequence of a batched context, which cannot {what}: create the context with n-ubatch set to get a context of its own"
            ))),
        }
    }
}

/// The settings a context of its own runs with. Beside batches (`policy`) it computes
/// only in turns that hold every core ([`super::Cores`]), so it runs on the batches'
/// threads whatever share the run asked for: on fewer, the rest of the cores would idle
/// through its turns (a 2000-token embedding at 2 threads took 25 s on one, 14 on two).
fn own_params(policy: Option<&BatchPolicy>, params: ContextParams) -> ContextParams {
    ContextParams { n_threads: own_threads(policy, params.n_threads), ..params }
}

/// The threads a context of its own (text or media) computes on: the batches' beside
/// them (`own_params` says why), else what the run asked for.
pub(super) fn own_threads(policy: Option<&BatchPolicy>, asked: u32) -> u32 {
    policy.map_or(asked, |policy| policy.threads)
}

/// Hand `piece` to the reader, waiting while its buffer is full (on the context's own
/// thread, which has nothing else to do); false when the reader is gone or `stop` is set.
fn deliver(pieces: &mpsc::Sender<Piece>, mut piece: Piece, stop: Stop<'_>) -> bool {
    loop {
        match pieces.try_send(piece) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(back)) => {
                piece = back;
                std::thread::sleep(FULL_BUFFER_POLL);
                // Checked before retrying: a cancel while waiting ends the generation
                // even if the reader has made room since.
                if stop.is_set() {
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_of_its_own_beside_batches_runs_on_their_threads() {
        let asked =
            ContextParams { n_ctx: 64, n_batch: 64, n_ubatch: 64, n_seq_max: 1, n_threads: 1 };
        let policy = BatchPolicy::new(4, 64, 3);
        assert_eq!(own_params(Some(&policy), asked), ContextParams { n_threads: 3, ..asked });
        assert_eq!(own_params(None, asked), asked, "unbatched, it keeps its share");
    }
}
