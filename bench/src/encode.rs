//! Media encode rows: the plain mtmd encode against the cancellable one with its byte
//! clear, and store → return latency of encodes cancelled at random points, on a
//! generated vision projector (`ProjectorSpec::slow_vision`) bound to the generated text
//! model. Native calls only: the guest path adds the same boundary cost as a decode.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use llamabox_native::{
    chunker::DEFAULT_LATENCY_TARGET, CancelFlag, Chunk, ChunkKind, Error, MediaCaps, MediaContext,
    MediaInput, Model, ProjectorSpec, Stop,
};

use crate::stats::{num, timed, Samples};

pub struct EncodeResults {
    label: String,
    embeddings: usize,
    pub plain: Samples,
    cancellable: Samples,
    identical: bool,
    boundaries: u64,
    /// Store → return of cancelled encodes, seconds.
    pub latency: Samples,
    /// The same at other latency targets.
    pub targets: Vec<TargetRow>,
    /// What one boundary costs, from encodes with a boundary after nearly every matmul.
    pub boundary_cost: BoundaryCost,
}

/// The extra time of a densely chunked encode over a plain one, per boundary: a
/// difference of several ms, where a few boundaries' worth (the target rows' overhead
/// column) is within the noise of one encode.
pub struct BoundaryCost {
    /// Boundaries per encode at the smallest budget.
    pub boundaries: u64,
    /// Seconds per boundary, one sample per pair of encodes.
    pub per_boundary: Samples,
}

impl BoundaryCost {
    /// The share of an encode of `encode_secs` that `boundaries` boundaries cost.
    fn share(&self, boundaries: u64, encode_secs: f64) -> f64 {
        self.per_boundary.median() * boundaries as f64 / encode_secs
    }
}

/// Encodes paced to one latency target (`MediaContext::set_latency_target`).
/// Met when the median store → return of its cancels is within the target.
pub struct TargetRow {
    pub target: Duration,
    /// Boundaries per encode once the context has learned its speed.
    boundaries: u64,
    /// Cancellable encode (byte clear) time over the plain encode's, median of pairs.
    overhead: f64,
    pub latency: Samples,
}

impl TargetRow {
    fn met(&self) -> bool {
        self.latency.median() <= self.target.as_secs_f64()
    }
}

/// Measure `runs` rounds (plain and cancellable in alternating order) and `cancels`
/// random cancels.
pub fn measure(
    model_path: &Path,
    dir: &Path,
    threads: u32,
    runs: usize,
    cancels: usize,
    targets: &[Duration],
) -> anyhow::Result<EncodeResults> {
    let model =
        Arc::new(Model::load(model_path).context("loading the text model for the encode rows")?);
    let spec = ProjectorSpec::slow_vision(model.n_embd_inp());
    let path = dir
        .join(format!("vision-e{}-l{}-text{}.gguf", spec.n_embd, spec.n_layer, spec.n_embd_text));
    if !path.is_file() {
        spec.write(&path).with_context(|| format!("writing {}", path.display()))?;
    }
    let mut media = MediaContext::new(&path, model, threads)?;
    let (w, h) = (320u32, 240u32);
    let rgb = (0..h)
        .flat_map(|y| (0..w).flat_map(move |x| [(x * 255 / w) as u8, (y * 255 / h) as u8, 96]))
        .collect();
    let caps = MediaCaps { max_image_side: 1024, max_audio_samples: 0 };
    let chunks = media.tokenize(
        MediaContext::marker(),
        &[MediaInput::Image { width: w, height: h, rgb }],
        caps,
        usize::MAX,
    )?;
    let chunk =
        chunks.into_iter().find(|c| c.kind() == ChunkKind::Image).context("no image chunk")?;

    let reference = media.encode(&chunk, None)?; // also warms up
    let (mut plain, mut cancellable, mut identical) =
        (Samples::default(), Samples::default(), true);
    for round in 0..runs {
        for cancellable_first in [round % 2 == 1, round % 2 == 0] {
            if cancellable_first {
                let flag = CancelFlag::new();
                let (t, out) = timed(|| media.encode(&chunk, Some(Stop::on(&flag))));
                cancellable.push(t);
                identical &= bitwise_eq(&out?, &reference);
            } else {
                let (t, out) = timed(|| media.encode(&chunk, None));
                plain.push(t);
                identical &= bitwise_eq(&out?, &reference);
            }
        }
    }
    let counter = CancelFlag::new();
    counter.trip_after(u64::MAX);
    media.encode(&chunk, Some(Stop::on(&counter)))?;

    let full = plain.median();
    let mut rng = fastrand::Rng::with_seed(11);
    let latency =
        cancel_latency(&mut media, &chunk, full, cancels, &mut rng, &reference, &mut identical)?;

    let mut rows = Vec::new();
    for &target in targets {
        media.set_latency_target(target);
        media.encode(&chunk, Some(Stop::on(&CancelFlag::new())))?; // learns its speed
        let mut ratios = Vec::new();
        for _ in 0..runs {
            let (p, out) = timed(|| media.encode(&chunk, None));
            identical &= bitwise_eq(&out?, &reference);
            let (c, out) = timed(|| media.encode(&chunk, Some(Stop::on(&CancelFlag::new()))));
            identical &= bitwise_eq(&out?, &reference);
            ratios.push(c.as_secs_f64() / p.as_secs_f64());
        }
        ratios.sort_by(f64::total_cmp);
        let counter = CancelFlag::new();
        counter.trip_after(u64::MAX);
        media.encode(&chunk, Some(Stop::on(&counter)))?;
        let latency = cancel_latency(
            &mut media,
            &chunk,
            full,
            cancels,
            &mut rng,
            &reference,
            &mut identical,
        )?;
        rows.push(TargetRow {
            target,
            boundaries: counter.polls(),
            overhead: ratios[ratios.len() / 2] - 1.0,
            latency,
        });
    }
    let boundary_cost = boundary_cost(&mut media, &chunk, 2 * runs, &reference, &mut identical)?;
    let label = format!(
        "generated vision projector (LLaVA mlp, {} wide, {} blocks run, f32) on the generated text model",
        spec.n_embd,
        spec.n_layer - 1
    );
    Ok(EncodeResults {
        label,
        embeddings: chunk.n_tokens(),
        plain,
        cancellable,
        identical,
        boundaries: counter.polls(),
        latency,
        targets: rows,
        boundary_cost,
    })
}

/// Pairs of a plain encode and one paced to the smallest latency target (a boundary
/// after nearly every matmul), in alternating order: the time difference per boundary.
fn boundary_cost(
    media: &mut MediaContext,
    chunk: &Chunk,
    pairs: usize,
    reference: &[f32],
    identical: &mut bool,
) -> anyhow::Result<BoundaryCost> {
    media.set_latency_target(Duration::ZERO); // the smallest the context allows
    media.encode(chunk, Some(Stop::on(&CancelFlag::new())))?; // learns its speed
    let counter = CancelFlag::new();
    counter.trip_after(u64::MAX);
    *identical &= bitwise_eq(&media.encode(chunk, Some(Stop::on(&counter)))?, reference);
    let boundaries = counter.polls();
    let mut per_boundary = Samples::default();
    for pair in 0..pairs {
        let (mut plain, mut dense) = (Duration::ZERO, Duration::ZERO);
        for dense_first in [pair % 2 == 1, pair % 2 == 0] {
            let (t, out) = if dense_first {
                timed(|| media.encode(chunk, Some(Stop::on(&CancelFlag::new()))))
            } else {
                timed(|| media.encode(chunk, None))
            };
            *identical &= bitwise_eq(&out?, reference);
            *if dense_first { &mut dense } else { &mut plain } = t;
        }
        per_boundary
            .push_secs((dense.as_secs_f64() - plain.as_secs_f64()) / boundaries.max(1) as f64);
    }
    Ok(BoundaryCost { boundaries, per_boundary })
}

/// `cancels` encodes cancelled from another thread at random points in [0, 0.9 × `full`)
/// seconds: store → return of those that were cancelled. Every encode after a cancel
/// must equal `reference`.
fn cancel_latency(
    media: &mut MediaContext,
    chunk: &Chunk,
    full: f64,
    cancels: usize,
    rng: &mut fastrand::Rng,
    reference: &[f32],
    identical: &mut bool,
) -> anyhow::Result<Samples> {
    let mut latency = Samples::default();
    for _ in 0..cancels {
        let flag = CancelFlag::new();
        let (canceller, delay) = (flag.clone(), Duration::from_secs_f64(rng.f64() * 0.9 * full));
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(delay);
            let stored = Instant::now();
            canceller.cancel();
            let _ = tx.send(stored);
        });
        let outcome = media.encode(chunk, Some(Stop::on(&flag)));
        let returned = Instant::now();
        let _ = thread.join();
        let stored = rx.recv().context("canceller thread")?;
        if outcome == Err(Error::Cancelled) {
            latency.push(returned.saturating_duration_since(stored));
        }
        *identical &= bitwise_eq(&media.encode(chunk, None)?, reference);
    }
    Ok(latency)
}

/// The encode section of RESULTS.md.
pub fn table(out: &mut String, r: &EncodeResults) {
    let _ = writeln!(out, "## Media encode: one image, ms\n");
    let _ = writeln!(
        out,
        "{}: a 320×240 image → {} embeddings; {} boundaries per encode.\n",
        r.label, r.embeddings, r.boundaries
    );
    let _ = writeln!(out, "| plain encode | cancellable, byte 0 | vs plain | store → return, median (min–max) | p90 | as fraction of the encode | output vs plain |");
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |");
    let ratio = r.cancellable.ratios_to(&r.plain).median() - 1.0;
    let lat = r.latency.ms();
    let _ = writeln!(
        out,
        "| {} | {} | {:+.1}% | {} ({} cancels) | {} | {:.1}% | {} |\n",
        r.plain.ms(),
        r.cancellable.ms(),
        ratio * 100.0,
        lat,
        r.latency.len(),
        num(r.latency.quantile(0.9) * 1e3),
        lat.median / (r.plain.median() * 1e3) * 100.0,
        if r.identical { "identical (also every encode after a cancel)" } else { "DIFFERENT" }
    );
    let _ = writeln!(
        out,
        "The encode polls the cancel byte only at boundaries: after a matmul or attention op, once the context's work \
         budget is spent or at the next such op once the byte is set. Each media context measures its own speed on \
         its encodes and sets the budget to speed × latency target (default 10 ms, the row above). The scheduler \
         picks each range before computing it, so a cancel waits for the range in flight: at most about \
         max(target, one matmul). Store → return runs from just before the store on another thread to \
         `encode` returning `Cancelled`.\n"
    );
    if r.targets.is_empty() {
        return;
    }
    let _ = writeln!(out, "### Encode cancel latency by target\n");
    let _ = writeln!(
        out,
        "| target | boundaries per encode | cancellable vs plain (byte clear) | the boundaries' cost at {} µs each | store → return, median (min–max) | p90 | median within target |",
        num(r.boundary_cost.per_boundary.median() * 1e6)
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |");
    for t in &r.targets {
        let target_ms = t.target.as_secs_f64() * 1e3;
        let _ = writeln!(
            out,
            "| {target_ms:.0} ms | {} | {:+.1}% | {:+.2}% | {} ({} cancels) | {} | {} |",
            t.boundaries,
            t.overhead * 100.0,
            r.boundary_cost.share(t.boundaries, r.plain.median()) * 100.0,
            t.latency.ms(),
            t.latency.len(),
            num(t.latency.quantile(0.9) * 1e3),
            if t.met() { "met" } else { "**missed**" },
        );
    }
    let c = &r.boundary_cost;
    let _ = writeln!(
        out,
        "\nOne boundary's cost: encodes paced to the smallest target ({} boundaries each, after nearly every matmul) \
         against plain ones, {} pairs in alternating order: {} µs (min {}, max {}) per boundary. The \"cancellable vs \
         plain\" column measures a few boundaries' worth directly and moves with the noise of single encodes; the \
         column beside it is that count times the one boundary's cost.\n",
        c.boundaries,
        c.per_boundary.len(),
        num(c.per_boundary.median() * 1e6),
        num(c.per_boundary.min() * 1e6),
        num(c.per_boundary.max() * 1e6),
    );
}

/// The encode lines of the report's targets: each latency target met by the median
/// store → return, and the boundaries' cost at the default target within 1%.
pub fn targets(out: &mut String, r: &EncodeResults) {
    let met = |ok: bool| if ok { "met" } else { "**missed**" };
    for t in &r.targets {
        let _ = writeln!(
            out,
            "- media encode: a cancel returns within the {:.0} ms latency target (median store → return): {} ms (p90 {}): {}",
            t.target.as_secs_f64() * 1e3,
            num(t.latency.median() * 1e3),
            num(t.latency.quantile(0.9) * 1e3),
            met(t.met())
        );
    }
    let default = r.targets.iter().find(|t| t.target == DEFAULT_LATENCY_TARGET);
    if let Some(t) = default {
        let share = r.boundary_cost.share(t.boundaries, r.plain.median());
        let _ = writeln!(
            out,
            "- media encode: boundaries cost ≤ 1% of the encode at the default {} ms target ({} boundaries × {} µs): {:+.2}%: {}",
            DEFAULT_LATENCY_TARGET.as_millis(),
            t.boundaries,
            num(r.boundary_cost.per_boundary.median() * 1e6),
            share * 100.0,
            met(share <= 0.01)
        );
    }
}

fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
