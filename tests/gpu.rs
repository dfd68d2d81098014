//! The GPU tests (`make GPU=vulkan test-gpu`): llama.cpp's Vulkan backend on whatever
//! Vulkan device is present (Mesa's lavapipe in CI, a real Vulkan driver on the CPU).
//! The abort callback does not reach a device, so a cancel stops it at the eval
//! callback's boundaries; these tests trip it at boundary k (the test hook, as the CPU
//! tests do) and check, for a decode, a generation and an encode:
//! - a cancelled call returns `cancelled`;
//! - memory is as before the call;
//! - the next call gives what an uncancelled one gives;
//! - boundaries change nothing: chunked output is bitwise that of an unchunked call.
//!
//! And that greedy output on the device agrees with the CPU's (same binary, 0 GPU
//! layers), to the tolerance printed and asserted below. Small models only: lavapipe
//! decodes about 10× slower than the CPU backend here.

mod common;

use std::sync::Arc;

use llamabox_native::{
    self as native, generate, Batch, CancelFlag, ChunkKind, Context, ContextParams, DeviceKind,
    Error, FinishReason, GenerateRequest, MediaCaps, MediaContext, MediaInput, Model, Offload,
    Piece, Sampler, SamplerCaps, SamplerParams, Stop, Token,
};

/// n-batch 128 in ubatches of 64: a decode of more than 64 rows runs as several graphs.
fn params() -> ContextParams {
    ContextParams { n_ctx: 256, n_batch: 128, n_ubatch: 64, n_seq_max: 1, n_threads: 1 }
}

fn on_gpu(path: &std::path::Path) -> Arc<Model> {
    let model = Model::load_with(path, &Offload::default()).unwrap();
    assert!(
        model.device().is_some(),
        "no GPU found: set GGML_VK_VISIBLE_DEVICES for lavapipe (make GPU=vulkan test-gpu does)"
    );
    Arc::new(model)
}

fn on_cpu(path: &std::path::Path) -> Arc<Model> {
    Arc::new(Model::load_with(path, &Offload { gpu_layers: Some(0), device: None }).unwrap())
}

/// A context on `model` with a boundary after every matmul and attention op.
fn chunked(model: &Arc<Model>) -> Context {
    let mut ctx = Context::new(model.clone(), params()).unwrap();
    ctx.set_device_chunk_work(Some(1));
    ctx
}

fn prompt(model: &Model, n: usize) -> Vec<Token> {
    let words = model.tokenize(" the llama in the box", false, false).unwrap();
    words.iter().copied().cycle().take(n).collect()
}

use common::bitwise_eq;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(logits: &[f32]) -> Token {
    (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best }) as Token
}

#[test]
fn the_gpu_is_listed_and_a_model_puts_every_layer_on_it_unless_told_otherwise() {
    let gpus: Vec<_> = native::devices().into_iter().filter(|d| d.kind.is_gpu()).collect();
    assert!(!gpus.is_empty(), "no GPU among {:?}", native::devices());
    assert!(native::devices().iter().any(|d| d.kind == DeviceKind::Cpu));
    println!("figure: GPU {} = {} ({:?})", gpus[0].name, gpus[0].description, gpus[0].kind);
    let model = on_gpu(common::tiny_model());
    assert_eq!(model.device(), Some(gpus[0].name.as_str()), "the first GPU by default");
    assert!(model.gpu_layers() >= 2, "every layer and the output: {}", model.gpu_layers());
    let cpu = on_cpu(common::tiny_model());
    assert_eq!((cpu.device(), cpu.gpu_layers()), (None, 0));
    let named = Model::load_with(
        common::tiny_model(),
        &Offload { gpu_layers: Some(1), device: Some(gpus[0].name.clone()) },
    )
    .unwrap();
    assert_eq!((named.device(), named.gpu_layers()), (Some(gpus[0].name.as_str()), 1));
    let err = Model::load_with(
        common::tiny_model(),
        &Offload { gpu_layers: None, device: Some("Vulkan99".into()) },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("no GPU named \"Vulkan99\""), "{err}");
}

#[test]
fn a_decode_on_the_device_is_chunked_without_changing_its_logits_and_stops_at_boundary_k() {
    let model = on_gpu(common::tiny_model());
    let (head, rest) = (prompt(&model, 16), prompt(&model, 120)); // the rest: two ubatches
    let reference = {
        let mut ctx = Context::new(model.clone(), params()).unwrap();
        ctx.decode(&Batch::sequence(&head, 0, 0), None).unwrap();
        ctx.decode(&Batch::sequence(&rest, 16, 0), None).unwrap();
        ctx.last_logits().unwrap().to_vec()
    };
    let mut ctx = chunked(&model);
    ctx.decode(&Batch::sequence(&head, 0, 0), None).unwrap();
    let counter = CancelFlag::counting();
    ctx.decode(&Batch::sequence(&rest, 16, 0), Some(Stop::on(&counter))).unwrap();
    let polls = counter.polls();
    assert!(polls >= 8, "expected boundaries in every ubatch, got {polls} polls");
    assert!(
        bitwise_eq(ctx.last_logits().unwrap(), &reference),
        "chunked logits differ from unchunked by {}",
        max_diff(ctx.last_logits().unwrap(), &reference)
    );
    println!("figure: a 120-token decode on the device polled {polls} times with a boundary after every matmul and attention op");
    // One row (a generation step): ggml-vulkan fuses one-row matmuls with the ADD after
    // them, so no boundary may fall there; the chunked step is bitwise the plain one.
    let next = argmax(&reference);
    let step = |ctx: &mut Context, stop: Option<Stop<'_>>| {
        ctx.decode(&Batch::sequence(&[next], 136, 0), stop).unwrap();
        ctx.last_logits().unwrap().to_vec()
    };
    let plain_step = step(&mut ctx, None);
    ctx.seq_rm(0, 136, -1).unwrap();
    let chunked_step = step(&mut ctx, Some(Stop::on(&counter)));
    assert!(
        bitwise_eq(&plain_step, &chunked_step),
        "a chunked one-row decode differs by {}",
        max_diff(&plain_step, &chunked_step)
    );

    for k in [1, polls / 2, polls - 1] {
        let mut ctx = chunked(&model);
        ctx.decode(&Batch::sequence(&head, 0, 0), None).unwrap();
        let token = CancelFlag::new();
        token.trip_after(k);
        assert_eq!(
            ctx.decode(&Batch::sequence(&rest, 16, 0), Some(Stop::on(&token))),
            Err(Error::Cancelled),
            "tripped at poll {k}"
        );
        // After the trip every split ends at its first boundary: most of the work is skipped.
        assert!(
            token.polls() < polls,
            "stopped at poll {k}, yet polled {} of {polls} times",
            token.polls()
        );
        assert_eq!(ctx.seq_pos_max(0).unwrap(), 15, "memory as before the cancelled decode");
        assert!(ctx.last_logits().is_err(), "no logits from a cancelled decode");
        ctx.decode(&Batch::sequence(&rest, 16, 0), Some(Stop::on(&CancelFlag::new()))).unwrap();
        assert!(
            bitwise_eq(ctx.last_logits().unwrap(), &reference),
            "the decode after a cancel at {k} differs by {}",
            max_diff(ctx.last_logits().unwrap(), &reference)
        );
    }
}

fn run(
    ctx: &mut Context,
    request: &GenerateRequest,
    token: &CancelFlag,
) -> (native::Result<native::Outcome>, Vec<Token>) {
    let mut sampler =
        Sampler::new(ctx.model().clone(), &SamplerParams::greedy(), &SamplerCaps::default())
            .unwrap();
    let mut tokens = Vec::new();
    let mut sink = |p: Piece| {
        tokens.extend(p.tokens);
        true
    };
    let outcome = generate(ctx, &mut sampler, request, Stop::on(token), &mut sink);
    (outcome, tokens)
}

/// Polls of a chunked generation of `prompt`: its prefill, and each generated token's decode.
fn generation_polls(model: &Arc<Model>, prompt: &[Token]) -> (u64, u64) {
    common::prefill_and_token_polls(|max_tokens, counter| {
        let request = GenerateRequest::new(prompt.to_vec(), max_tokens);
        run(&mut chunked(model), &request, counter).0.unwrap();
    })
}

#[test]
fn a_generation_on_the_device_stops_at_boundary_k_and_keeps_exactly_the_delivered_tokens() {
    let model = on_gpu(common::tiny_model());
    let request = GenerateRequest::new(prompt(&model, 20), 8);
    let (outcome, reference) = run(&mut chunked(&model), &request, &CancelFlag::new());
    assert_eq!(outcome.unwrap().usage.generated_tokens, 8);
    let (prefill, per_token) = generation_polls(&model, &request.prompt);
    assert!(per_token >= 2, "boundaries in every generation step: {per_token} polls per token");
    for k in [0usize, 3] {
        let mut ctx = chunked(&model);
        let token = CancelFlag::new();
        token.trip_after(prefill + k as u64 * per_token + per_token / 2); // inside the decode of token k
        let (outcome, delivered) = run(&mut ctx, &request, &token);
        let outcome = outcome.unwrap();
        assert_eq!(outcome.finish, FinishReason::Cancelled);
        assert_eq!(delivered, reference[..k], "tokens delivered before the cancel");
        assert_eq!(
            ctx.seq_pos_max(0).unwrap() as usize,
            request.prompt.len() + k - 1,
            "memory: the prompt and the delivered tokens"
        );
        // Continue from memory with the token that was in flight: greedy picks the rest.
        let next = GenerateRequest::new(vec![reference[k]], 3);
        let (outcome, rest) = run(&mut ctx, &next, &CancelFlag::new());
        outcome.unwrap();
        assert_eq!(
            rest,
            reference[k + 1..k + 4],
            "continuing after a cancel as if it never happened"
        );
    }
}

#[test]
fn an_encode_on_the_device_stops_at_boundary_k_and_the_next_equals_an_uncancelled_one() {
    let model = on_gpu(common::tiny_model());
    let mut media = MediaContext::new(common::tiny_vision(), model.clone(), 1).unwrap();
    media.set_chunk_work(1);
    let caps = MediaCaps { max_image_side: 1024, max_audio_samples: 16_000 };
    let input = MediaInput::Image { width: 48, height: 40, rgb: common::gradient(48, 40) };
    let chunks = media
        .tokenize(&format!("look: {}", MediaContext::marker()), &[input], caps, usize::MAX)
        .unwrap();
    let chunk = chunks.into_iter().find(|c| c.kind() != ChunkKind::Text).unwrap();
    let plain = media.encode(&chunk, None).unwrap();
    common::check_encode_stops_at_each_boundary(&mut media, &chunk, &plain);
    let on_cpu = MediaContext::new(common::tiny_vision(), on_cpu(common::tiny_model()), 1)
        .unwrap()
        .encode(&chunk, None);
    // A chunk belongs to the media context that made it: encoding it on another is refused.
    assert!(on_cpu.is_err());
}

/// Greedy on the device against greedy on the CPU (same binary, same weights), both
/// fed the CPU's tokens: the logits agree to a measured tolerance, and the two argmaxes
/// differ only where the CPU's own margin between them is within it (a near tie: the
/// CPU backend multiplies Q4_1 weights by activations quantized to Q8_1, ggml-vulkan
/// by F32 ones).
#[test]
fn greedy_on_the_device_agrees_with_the_cpu() {
    // Of the largest logit: twice what was measured (docs/ARCHITECTURE.md, "On the GPU").
    for (name, path, steps, tolerance) in
        [("tiny", common::tiny_model(), 16, 5e-3f32), ("SmolLM2", common::real_model(), 12, 1e-1)]
    {
        let (gpu, cpu) = (on_gpu(path), on_cpu(path));
        let start = gpu.tokenize("The llama in the box is", true, false).unwrap();
        let (mut on_device, mut on_host) =
            (Context::new(gpu, params()).unwrap(), Context::new(cpu, params()).unwrap());
        let (mut worst, mut ties, mut rms) = (0f32, 0, 0f32);
        let (mut batch, mut pos) = (start, 0);
        for step in 0..steps {
            on_device.decode(&Batch::sequence(&batch, pos, 0), None).unwrap();
            on_host.decode(&Batch::sequence(&batch, pos, 0), None).unwrap();
            let (d, h) = (on_device.last_logits().unwrap(), on_host.last_logits().unwrap());
            let scale = h.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            worst = worst.max(max_diff(d, h) / scale);
            let norm = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
            let diff: Vec<f32> = d.iter().zip(h).map(|(x, y)| x - y).collect();
            rms = rms.max(norm(&diff) / norm(h));
            let (next_d, next_h) = (argmax(d), argmax(h));
            if next_d != next_h {
                let margin = (h[next_h as usize] - h[next_d as usize]) / scale;
                assert!(margin <= tolerance, "{name}: step {step}: device picks {next_d}, CPU {next_h}, {margin:.2e} apart on the CPU");
                ties += 1;
            }
            pos += batch.len() as i32;
            batch = vec![next_h];
        }
        println!("figure: {name}: logits on the device differ from the CPU's by at most {worst:.2e} of the largest (RMS of the difference: at most {rms:.2e} of the logits' RMS); greedy picks differ at {ties} of {steps} steps, each a near tie");
        assert!(
            worst < tolerance,
            "{name}: device logits differ from the CPU's by {worst:.2e} of the largest"
        );
    }
}

/// The whole stack on the device: a plugin's decode, on a model the host put on the GPU,
/// stopped in flight by the embedder's token (tripped at its 20th poll), memory as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_decode_on_the_device_is_stopped_in_flight_by_the_embedders_token() {
    use llamabox::{Limits, ModelRegistry, PluginHost, RunOptions, RunOutcome};
    let registry = ModelRegistry::new();
    registry.offload(Offload::default());
    registry.register("slow", common::slow_model());
    assert!(
        registry.open("slow").await.unwrap().device().is_some(),
        "the host put the model on the GPU"
    );
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(common::demo_plugin()).unwrap();
    let flag = CancelFlag::new();
    let capability = host.tokens().share("tenant", &flag).expect("a capability");
    flag.trip_after(20);
    let out = wasmtime_wasi::p2::pipe::MemoryOutputPipe::new(1 << 16);
    let mut wasi = wasmtime_wasi::WasiCtxBuilder::new();
    wasi.stdout(out.clone()).stderr(out.clone());
    wasi.args(&["demo", "--model", "slow", "--token", &capability]);
    let options = RunOptions::default().group("tenant");
    let outcome = plugin.run_with(&options, wasi).await.unwrap();
    let text = String::from_utf8(out.contents().to_vec()).unwrap();
    assert_eq!(outcome, RunOutcome::Success, "{text}");
    assert_eq!(common::field(&text, "shared-decode"), "cancelled", "{text}");
    // Tripped at poll 20; each later split of the graph stops at its first node (one poll
    // each), since a boundary's false ends only its own split.
    assert!(
        (20..30).contains(&flag.polls()),
        "stopped in flight at poll 20, then {} polls in all",
        flag.polls()
    );
    assert_eq!(common::field(&text, "memory-after"), "seq-pos-max=-1", "memory as before");
}
