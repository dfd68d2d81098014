//! The native layer (`llamabox_native`: llama.cpp and mtmd through our FFI) driven
//! directly, on generated models and on the real one: decodes and their cancels,
//! prefix reuse, media encodes, random and adversarial calls, host-side generation.
//! A few tests end by running the same through the demo plugin. One test binary; a
//! module per area (`cargo test --release -p llamabox --test native -- decode::`).

mod common;

#[path = "native/adversarial.rs"]
mod adversarial;
#[path = "native/decode.rs"]
mod decode;
#[path = "native/generate.rs"]
mod generate;
#[path = "native/media_encode.rs"]
mod media_encode;
#[path = "native/prefix_reuse.rs"]
mod prefix_reuse;
#[path = "native/real_model.rs"]
mod real_model;
#[path = "native/share.rs"]
mod share;
