//! Cancellable media encodes on generated projectors, 1 thread: chunked output equal to
//! plain, deterministic cancels at boundary k, cancel on entry, chunk-list evaluation
//! that leaves memory untouched when cancelled, and bad inputs refused.

use std::sync::Arc;

use llamabox_native::{
    Batch, CancelFlag, ChunkKind, Context, ContextParams, Error, MediaCaps, MediaContext,
    MediaInput, Model, Stop,
};

use crate::common;

const CAPS: MediaCaps = MediaCaps { max_image_side: 1024, max_audio_samples: 16_000 * 30 };

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::tiny_model()).unwrap())
}

fn media(projector: &std::path::Path, model: &Arc<Model>) -> MediaContext {
    MediaContext::new(projector, model.clone(), 1).unwrap()
}

fn image(w: u32, h: u32) -> MediaInput {
    MediaInput::Image { width: w, height: h, rgb: common::gradient(w, h) }
}

/// The single media chunk of `prompt` + one input.
fn media_chunk(m: &mut MediaContext, input: MediaInput) -> Arc<llamabox_native::Chunk> {
    let prompt = format!("look: {}", MediaContext::marker());
    let chunks = m.tokenize(&prompt, &[input], CAPS, usize::MAX).unwrap();
    chunks.into_iter().find(|c| c.kind() != ChunkKind::Text).expect("a media chunk")
}

#[test]
fn chunked_encode_is_bitwise_identical_to_plain_and_stops_at_boundary_k() {
    let model = model();
    for (projector, input) in [
        (common::tiny_vision(), image(48, 40)),
        (common::tiny_audio(), MediaInput::Audio { samples: common::tone(8_000) }),
    ] {
        let mut m = media(projector, &model);
        m.set_chunk_work(1); // a boundary after every matmul and attention op
        let chunk = media_chunk(&mut m, input);
        let plain = m.encode(&chunk, None).unwrap();
        assert_eq!(plain.len(), chunk.n_tokens() * model.n_embd_inp() as usize);

        common::check_encode_stops_at_each_boundary(&mut m, &chunk, &plain);
    }
}

#[test]
fn token_cancelled_on_entry_computes_nothing() {
    let model = model();
    let mut m = media(common::tiny_vision(), &model);
    let chunk = media_chunk(&mut m, image(8, 8));
    let token = CancelFlag::new();
    token.cancel();
    token.trip_after(u64::MAX);
    assert_eq!(m.encode(&chunk, Some(Stop::on(&token))), Err(Error::Cancelled));
    assert_eq!(token.polls(), 0);
}

#[test]
fn media_embeddings_decode_into_a_context_and_a_cancel_leaves_no_trace() {
    let model = model();
    let mut m = media(common::tiny_vision(), &model);
    let chunk = media_chunk(&mut m, image(30, 20));
    let embd = m.encode(&chunk, None).unwrap();
    let params =
        ContextParams { n_ctx: 512, n_batch: 32, n_ubatch: 16, n_seq_max: 1, n_threads: 1 };

    let mut reference = Context::new(model.clone(), params).unwrap();
    reference.decode(&Batch::sequence(&[1, 100, 101], 0, 0), None).unwrap();
    let counter = CancelFlag::counting();
    reference.decode_embeddings(&embd, 0, false, true, Some(Stop::on(&counter))).unwrap();
    let expected = reference.last_logits().unwrap().to_vec();
    assert_eq!(chunk.n_tokens(), 64, "two 32-row pieces of two ubatches each");

    let mut ctx = Context::new(model.clone(), params).unwrap();
    ctx.decode(&Batch::sequence(&[1, 100, 101], 0, 0), None).unwrap();
    let token = CancelFlag::new();
    token.trip_after(counter.polls() * 7 / 8); // in the last ubatch: llama.cpp keeps the first three
    assert_eq!(
        ctx.decode_embeddings(&embd, 0, false, true, Some(Stop::on(&token))),
        Err(Error::Cancelled)
    );
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 2, "memory as before the call");
    ctx.decode_embeddings(&embd, 0, false, true, None).unwrap();
    assert_eq!(ctx.seq_pos_max(0).unwrap(), 2 + chunk.n_pos());
    assert!(bitwise_eq(ctx.last_logits().unwrap(), &expected));

    let mut small = Context::new(model.clone(), params).unwrap();
    match small.decode_embeddings(&embd, 0, true, true, None) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("must be decoded in one ubatch"), "{m}")
        }
        other => panic!("a non-causal chunk larger than n-ubatch must be refused, got {other:?}"),
    }
    assert!(matches!(
        small.decode_embeddings(&embd[1..], 0, false, true, None),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn bad_media_inputs_are_refused_with_a_reason() {
    let model = model();
    let mut vision = media(common::tiny_vision(), &model);
    let mut audio = media(common::tiny_audio(), &model);
    assert!(vision.supports_vision() && !vision.supports_audio());
    assert!(audio.supports_audio() && audio.audio_sample_rate() == Some(16_000));
    let marker = MediaContext::marker();
    let one = format!("a {marker}");
    let cases: Vec<(bool, String, Vec<MediaInput>, &str)> = vec![
        (false, one.clone(), vec![image(0, 8)], "outside 1..=1024"),
        (false, one.clone(), vec![image(8, 5000)], "outside 1..=1024"),
        (
            false,
            one.clone(),
            vec![MediaInput::Image { width: 4, height: 4, rgb: vec![0; 47] }],
            "needs 48 RGB bytes",
        ),
        (false, format!("{marker}{marker}"), vec![image(4, 4)], "2 media markers but 1 inputs"),
        (
            false,
            one.clone(),
            vec![MediaInput::Audio { samples: common::tone(100) }],
            "takes no audio",
        ),
        (true, one.clone(), vec![MediaInput::Audio { samples: vec![] }], "outside 2..="),
        (true, one.clone(), vec![MediaInput::Audio { samples: vec![0.1] }], "outside 2..="),
        (
            true,
            one.clone(),
            vec![MediaInput::Audio { samples: vec![0.0; 16_000 * 30 + 1] }],
            "outside 2..=",
        ),
        (true, one.clone(), vec![MediaInput::Audio { samples: vec![f32::NAN; 10] }], "finite"),
        (true, one.clone(), vec![image(4, 4)], "takes no images"),
    ];
    for (use_audio, prompt, inputs, reason) in cases {
        let m = if use_audio { &mut audio } else { &mut vision };
        match m.tokenize(&prompt, &inputs, CAPS, usize::MAX) {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains(reason), "{msg:?} should mention {reason:?}")
            }
            other => {
                panic!("expected invalid-argument ({reason}), got {:?}", other.map(|c| c.len()))
            }
        }
    }
    let chunks = vision.tokenize(&one, &[image(4, 4)], CAPS, usize::MAX).unwrap();
    assert_eq!(
        chunks.iter().map(|c| c.kind()).collect::<Vec<_>>(),
        [ChunkKind::Text, ChunkKind::Image]
    );
    assert!(
        matches!(vision.encode(&chunks[0], None), Err(Error::InvalidArgument(_))),
        "text chunks have nothing to encode"
    );
}

/// Many inputs are tokenized one at a time against the caller's budget: refused at the
/// input that crosses it (memory never runs far ahead of the charge), and under it
/// the same chunks, text in the same tokens, as the prompt's own parts.
#[test]
fn media_chunks_are_charged_input_by_input() {
    let model = model();
    let mut vision = media(common::tiny_vision(), &model);
    let marker = MediaContext::marker();
    let prompt = format!("one {marker} two {marker}{marker} three");
    let inputs = vec![image(4, 4), image(8, 8), image(2, 2)];
    let chunks = vision.tokenize(&prompt, &inputs, CAPS, usize::MAX).unwrap();
    let kinds: Vec<ChunkKind> = chunks.iter().map(|c| c.kind()).collect();
    use ChunkKind::{Image, Text};
    assert_eq!(kinds, [Text, Image, Text, Image, Image, Text]);
    assert_eq!(
        chunks[0].text_tokens(),
        model.tokenize("one ", true, true).unwrap(),
        "the first part starts the text"
    );
    assert_eq!(chunks[2].text_tokens(), model.tokenize(" two ", false, true).unwrap());
    assert_eq!(chunks[5].text_tokens(), model.tokenize(" three", false, true).unwrap());
    let first_part = chunks[0].native_bytes() + chunks[1].native_bytes();
    let total: usize = chunks.iter().map(|c| c.native_bytes()).sum();
    // Refused at the text after the last image: everything held, one byte over.
    assert_eq!(
        vision.tokenize(&prompt, &inputs, CAPS, total - 1).map(|c| c.len()),
        Err(Error::LimitExceeded {
            limit: "max-chunk-bytes",
            requested: total as u64,
            max: total as u64 - 1
        })
    );
    // Refused at the second image: the first part and the text and image up to it.
    match vision.tokenize(&prompt, &inputs, CAPS, first_part) {
        Err(Error::LimitExceeded { limit: "max-chunk-bytes", requested, max }) => {
            assert_eq!(max, first_part as u64);
            assert!(requested > max && requested < total as u64, "{requested} of {total}");
        }
        other => panic!("expected limit-exceeded, got {:?}", other.map(|c| c.len())),
    }
    assert_eq!(
        vision.tokenize(&prompt, &inputs, CAPS, total).unwrap().len(),
        6,
        "a budget that fits is enough"
    );
}

use crate::common::bitwise_eq;

/// Regression (issue 10): a chunk tokenized by one media context and encoded by
/// another with a different projector made clip assert ("Output buffer size
/// mismatch", `GGML_ASSERT(i01 >= 0 && i01 < ne01)`). A chunk is bound to its maker.
#[test]
fn a_chunk_is_encoded_only_by_the_media_context_that_made_it() {
    let model = model();
    let mut vision = media(common::tiny_vision(), &model);
    let mut other_vision = media(common::tiny_vision(), &model);
    let mut audio = media(common::tiny_audio(), &model);
    let picture = media_chunk(&mut vision, image(16, 16));
    let sound = media_chunk(&mut audio, MediaInput::Audio { samples: common::tone(800) });
    for (m, chunk) in [(&mut other_vision, &picture), (&mut audio, &picture), (&mut vision, &sound)]
    {
        match m.encode(chunk, None) {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains("made by another media context"), "{msg}")
            }
            other => panic!("a foreign chunk must be refused, got {:?}", other.map(|e| e.len())),
        }
    }
    assert_eq!(
        vision.encode(&picture, None).unwrap().len(),
        picture.n_tokens() * model.n_embd_inp() as usize
    );
    assert!(
        picture.native_bytes() >= picture.n_tokens() * model.n_embd_inp() as usize * 4,
        "charged at least its embeddings"
    );
}

/// Chunk-list evaluation is one native all-or-nothing call: the same logits as
/// decoding piece by piece, and a failure in the last piece undoes the first ones.
#[test]
fn eval_is_one_all_or_nothing_call_over_text_and_media_pieces() {
    use llamabox_native::PromptPiece as Piece;
    let model = model();
    let mut m = media(common::tiny_vision(), &model);
    let prompt = format!("look: {} and tell", MediaContext::marker());
    let chunks = m.tokenize(&prompt, &[image(16, 16)], CAPS, usize::MAX).unwrap();
    let pieces = m.encode_for_eval(&chunks, None).unwrap();
    assert_eq!(pieces.len(), 3);
    let params =
        ContextParams { n_ctx: 512, n_batch: 64, n_ubatch: 64, n_seq_max: 1, n_threads: 1 };

    let mut by_piece = Context::new(model.clone(), params).unwrap();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        match piece {
            Piece::Tokens(t) => {
                let mut batch = Batch::sequence(t, by_piece.seq_pos_max(0).unwrap() + 1, 0);
                batch.logits = (0..t.len()).map(|r| last && r + 1 == t.len()).collect();
                by_piece.decode(&batch, None).unwrap()
            }
            Piece::Embeddings { embd, non_causal } => {
                by_piece.decode_embeddings(embd, 0, *non_causal, last, None).unwrap()
            }
        }
    }
    let mut ctx = Context::new(model.clone(), params).unwrap();
    let n_past = ctx.eval(&pieces, 0, None).unwrap();
    assert_eq!(n_past, by_piece.seq_pos_max(0).unwrap() + 1);
    assert!(bitwise_eq(ctx.last_logits().unwrap(), by_piece.last_logits().unwrap()));

    let mut broken = pieces.clone();
    broken.push(Piece::Tokens(vec![model.n_vocab() as i32]));
    match ctx.eval(&broken, 0, None) {
        Err(Error::InvalidArgument(msg)) => {
            assert!(msg.contains("outside the vocabulary"), "{msg}")
        }
        other => panic!("a bad last piece must fail the whole call, got {other:?}"),
    }
    assert_eq!(ctx.seq_pos_max(0).unwrap(), n_past - 1, "the earlier pieces were undone");
    let token = CancelFlag::new();
    token.trip_after(3);
    assert_eq!(ctx.eval(&pieces, 0, Some(Stop::on(&token))), Err(Error::Cancelled));
    assert_eq!(ctx.seq_pos_max(0).unwrap(), n_past - 1);
}
