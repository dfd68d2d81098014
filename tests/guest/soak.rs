//! Several plugin instances at once, each decoding again and again with random cancels:
//! every result is complete and identical to the reference, or cancelled leaving no
//! trace; nothing deadlocks; resident memory stays flat after warm-up.
//!
//! `LLAMABOX_SOAK_INSTANCES` × `LLAMABOX_SOAK_ITERS` (defaults 4 × 40 here; `make soak`
//! runs more).

use std::sync::Arc;
use std::time::Duration;

use llamabox::{Limits, ModelRegistry, Plugin, PluginHost, RunOutcome};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::common;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Resident set size of this process, from /proc.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// One round: `instances` plugins at once, each soaking `iters` decodes.
async fn round(plugin: &Arc<Plugin>, instances: u64, iters: u64, seed: u64) -> (u64, u64) {
    let mut runs = tokio::task::JoinSet::new();
    for i in 0..instances {
        let plugin = plugin.clone();
        runs.spawn(async move {
            let out = MemoryOutputPipe::new(1 << 16);
            let mut wasi = WasiCtxBuilder::new();
            wasi.stdout(out.clone()).stderr(out.clone());
            let (iters, seed) = (iters.to_string(), (seed * 1000 + i).to_string());
            wasi.args(&["test-plugin", "soak", "--model", "tiny", "--long-tokens", "96", "--iterations", &iters, "--seed", &seed]);
            let outcome = plugin.run(wasi).await.unwrap();
            let text = String::from_utf8(out.contents().to_vec()).unwrap();
            assert_eq!(outcome, RunOutcome::Success, "{text}");
            let soak = common::field(&text, "soak").to_string();
            let counts: Vec<u64> = soak.split(", ").map(|part| part.split(' ').next().unwrap().parse().unwrap()).collect();
            assert_eq!(counts[2], 0, "instance {i}: a decode was neither complete-and-identical nor cleanly cancelled: {soak}");
            (counts[0], counts[1])
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(300), runs.join_all())
        .await
        .expect("soak deadlocked");
    all.into_iter().fold((0, 0), |(f, c), (f2, c2)| (f + f2, c + c2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_decode_and_cancel_at_random_without_wrong_results_or_growth() {
    let (instances, iters) = (env("LLAMABOX_SOAK_INSTANCES", 4), env("LLAMABOX_SOAK_ITERS", 40));
    let rounds = env("LLAMABOX_SOAK_ROUNDS", 3).max(1);
    let registry = ModelRegistry::new();
    registry.register("tiny", common::tiny_model());
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = Arc::new(host.load(common::test_plugin()).unwrap());

    // Warm-up: the allocator's per-thread arenas fill up as worker threads come and go
    // (every context runs on a fresh thread); resident memory settles after a few rounds.
    let (mut finished, mut cancelled) = (0, 0);
    for r in 0..3 {
        let (f, c) = round(&plugin, instances, iters, r).await;
        (finished, cancelled) = (finished + f, cancelled + c);
    }
    let rss_warm = rss_kib();
    for r in 0..rounds {
        let (f, c) = round(&plugin, instances, iters, 100 + r).await;
        (finished, cancelled) = (finished + f, cancelled + c);
        println!("soak: after round {}: RSS {} KiB", r + 1, rss_kib());
    }
    let rss_end = rss_kib();
    let total = (3 + rounds) * instances * iters;
    println!(
        "soak: {instances} instances x {iters} decodes x {} rounds = {total}: {finished} finished, {cancelled} cancelled; \
         RSS after warm-up {rss_warm} KiB, at end {rss_end} KiB",
        3 + rounds
    );
    assert_eq!(finished + cancelled, total);
    assert!(finished > 0 && cancelled > 0, "random delays must produce both outcomes");
    assert_eq!(host.live_workers(), 0);
    assert!(rss_end < rss_warm + 24 * 1024, "RSS grew from {rss_warm} KiB to {rss_end} KiB");
}
