//! Runs examples/embedder.rs (what it does, as a product would) and checks each
//! tenant's run ended the way the example says.

use crate::common;

#[path = "../../examples/embedder.rs"]
#[allow(dead_code)]
mod example;

use llamabox::RunOutcome;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedder_example_runs_three_tenants_at_once() {
    let finished =
        example::run_tenants(common::tiny_model(), common::demo_plugin(), common::test_plugin())
            .await
            .unwrap();
    let [alpha, beta, gamma_spin, gamma_decode] = &finished[..] else { panic!("four runs") };
    for f in &finished {
        println!("== {} {:?} {:?}\n{}", f.tenant, f.report.outcome, f.report.usage, f.output);
    }
    assert_eq!(alpha.report.outcome, RunOutcome::Success);
    let generated: u64 = common::field(&alpha.output, "generated-tokens").parse().unwrap();
    assert!(
        alpha.report.usage.tokens_decoded > generated,
        "the prompt and each generated token were decoded"
    );

    assert_eq!(beta.report.outcome, RunOutcome::Success, "{}", beta.output);
    assert!(
        beta.output.contains("stopped: cancelled"),
        "the embedder's token stopped the decode: {}",
        beta.output
    );
    assert!(beta.report.usage.cancels >= 1);

    assert_eq!(gamma_spin.report.outcome, RunOutcome::DeadlineExceeded);
    assert!(gamma_spin.output.contains("spinning"), "output before the deadline is kept");
    assert_eq!(gamma_decode.report.outcome, RunOutcome::Stopped);
    assert!(gamma_decode.output.contains("decoding until stopped"), "{}", gamma_decode.output);
    let ids: std::collections::HashSet<u64> = finished.iter().map(|f| f.report.run_id).collect();
    assert_eq!(ids.len(), 4, "each run has its own id");
}
