//! A plugin's media context as the engine runs it: a projector (mtmd) on a thread of
//! its own, whose encodes take the cores as its tenant's flow beside the batches, in
//! chunks the host's pace sets. `component` holds the [`MediaLease`] and maps WIT calls
//! onto it, as it holds a text context's [`Lease`]; each call returns a [`Call`] that
//! stops its native work in flight when dropped or when its token is set.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{Lease, Meter, Opened};
use crate::native::{
    self, CancelFlag, Chunk, ChunkKind, Error, MediaCaps, MediaContext, MediaContextId, MediaInput,
    PromptPiece, Stop,
};
use crate::worker::{Call, Tracker, Worker};

/// How an encode is cut into chunks: a cancel stops it, and a waiting batch takes the
/// cores, at a chunk's boundary.
#[derive(Clone, Copy, Debug)]
pub(crate) enum EncodePace {
    /// Chunks of about this long, measured as the encode runs.
    Latency(Duration),
    /// Chunks of this much work each, whatever the speed (reproducible boundaries).
    Work(u64),
}

/// What a run asks of a new media context.
pub(crate) struct MediaRequest<'a> {
    pub projector: PathBuf,
    pub threads: u32,
    pub pace: EncodePace,
    /// The tenant: its encodes take the cores as its flow.
    pub group: &'a str,
    pub meter: Arc<Meter>,
    /// The run's threads: it returns only once the lease's native work has stopped.
    pub tracker: &'a Tracker,
}

/// The native side of one plugin media context, and what it supports.
pub(crate) struct MediaLease {
    worker: Worker<MediaContext>,
    id: MediaContextId,
    pub vision: bool,
    pub audio: bool,
    pub sample_rate: Option<u32>,
    /// Positions of several dimensions (M-RoPE), which `eval` does not place yet.
    mrope: bool,
}

impl Opened {
    /// A media context for this model from `want.projector`, on a thread of its own.
    pub(crate) async fn lease_media(&self, want: MediaRequest<'_>) -> native::Result<MediaLease> {
        let MediaRequest { projector, threads, pace, group, meter, tracker } = want;
        let model = self.model.clone();
        // Beside batches, it encodes in turns with them that hold every core, so on
        // their threads.
        let cores = self.policy.as_ref().map(|p| p.cores_for(group));
        let threads = super::lease::own_threads(self.policy.as_ref(), threads);
        let worker = Worker::start("llamabox-media", tracker, move || {
            let mut media = MediaContext::new(&projector, model, threads)?;
            media.set_tally(meter);
            media.share_cores(cores);
            match pace {
                EncodePace::Latency(target) => media.set_latency_target(target),
                EncodePace::Work(units) => media.set_chunk_work(units),
            }
            Ok::<_, Error>(media)
        })
        .await?;
        let probe = worker.call(|m, _| {
            (m.id(), m.supports_vision(), m.supports_audio(), m.audio_sample_rate(), m.uses_mrope())
        });
        let Some((id, vision, audio, sample_rate, mrope)) = probe.await else {
            return Err(Error::Backend("media worker stopped".into()));
        };
        Ok(MediaLease { worker, id, vision, audio, sample_rate, mrope })
    }
}

impl MediaLease {
    /// `MediaContext::tokenize`: chunks of at most `budget` native bytes.
    pub(crate) fn tokenize(
        &self,
        prompt: String,
        inputs: Vec<MediaInput>,
        caps: MediaCaps,
        budget: usize,
    ) -> Call<native::Result<Vec<Arc<Chunk>>>> {
        self.worker.call(move |m, _| m.tokenize(&prompt, &inputs, caps, budget))
    }

    /// The embeddings of `chunk`, which must be this context's (else `invalid-argument`).
    pub(crate) fn encode(
        &self,
        chunk: Arc<Chunk>,
        token: CancelFlag,
    ) -> native::Result<Call<native::Result<Vec<f32>>>> {
        native::check_owner(self.id, &chunk)?;
        Ok(self
            .worker
            .call(move |m, abandoned| m.encode(&chunk, Some(Stop::on_either(&token, abandoned)))))
    }

    /// Whether [`MediaLease::eval_into`] can take `chunks`: all this context's, and no
    /// media ones where its positions have several dimensions. Checked before anything
    /// is encoded.
    pub(crate) fn check_chunks(&self, chunks: &[Arc<Chunk>]) -> native::Result<()> {
        chunks.iter().try_for_each(|c| native::check_owner(self.id, c))?;
        if self.mrope && chunks.iter().any(|c| c.kind() != ChunkKind::Text) {
            return Err(Error::InvalidArgument(
                "projectors with multi-dimensional positions (M-RoPE) are not supported yet".into(),
            ));
        }
        Ok(())
    }

    /// `chunks` evaluated into `context`'s sequence `seq`: its media chunks encoded here,
    /// then the whole list evaluated by `context` (its own thread, or its batch's in
    /// parts) as one all-or-nothing call; each stage stops when `token` is set. The end
    /// position.
    pub(crate) async fn eval_into(
        &self,
        context: &Lease,
        chunks: Vec<Arc<Chunk>>,
        seq: i32,
        token: CancelFlag,
    ) -> native::Result<i32> {
        let encode_token = token.clone();
        let encoded = self.worker.call(move |m, abandoned| {
            m.encode_for_eval(&chunks, Some(Stop::on_either(&encode_token, abandoned)))
        });
        let pieces: Vec<PromptPiece> = stopped_or(encoded.await)?;
        stopped_or(context.eval(pieces, seq, token).await)
    }

    /// Stop its running encode and wait until the projector is freed.
    pub(crate) async fn give_back(self) {
        self.worker.stop().await;
    }
}

/// A call's result, or the error that says its thread stopped first.
fn stopped_or<T>(outcome: Option<native::Result<T>>) -> native::Result<T> {
    outcome.unwrap_or_else(|| {
        Err(Error::Backend("the context stopped before the call finished".into()))
    })
}
