//! Plugins run in-process under `PluginHost`: the demo and test plugins, cancels from
//! anywhere, the embedder's API (and examples/embedder.rs), the fuzz plugin, the soak,
//! and the plugins written in other languages. One test binary; a module per area
//! (`cargo test --release -p llamabox --test guest -- fuzz::`).

mod common;

#[path = "guest/cancel_anywhere.rs"]
mod cancel_anywhere;
#[path = "guest/embedder_example.rs"]
mod embedder_example;
#[path = "guest/embedding.rs"]
mod embedding;
#[path = "guest/fuzz.rs"]
mod fuzz;
#[path = "guest/plugin.rs"]
mod plugin;
#[path = "guest/polyglot.rs"]
mod polyglot;
#[path = "guest/soak.rs"]
mod soak;
#[path = "guest/wit_versions.rs"]
mod wit_versions;
