//! Seeded synthetic GGUF models for tests and offline demos: a llama text model with
//! random weights and an SPM vocabulary, written in milliseconds with ggml's own gguf
//! writer. Same spec and seed, same file.

use std::ffi::{c_char, CString};
use std::path::Path;

use llama_cpp_sys_2 as sys;

use super::{backend, Error, Result};

/// Shape of a synthetic llama model. `write` makes the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextModelSpec {
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub n_ff: u32,
    pub n_ctx_train: u32,
    pub seed: u64,
}

impl TextModelSpec {
    /// A model whose decodes take microseconds: for tests of behaviour.
    pub fn tiny() -> Self {
        Self { n_embd: 64, n_layer: 2, n_head: 4, n_head_kv: 2, n_ff: 128, n_ctx_train: 4096, seed: 1 }
    }

    /// A model whose 512-token decode takes a good fraction of a second on one core:
    /// for cancel demos and benchmarks.
    pub fn slow() -> Self {
        Self { n_embd: 512, n_layer: 8, n_head: 8, n_head_kv: 8, n_ff: 1536, n_ctx_train: 4096, seed: 2 }
    }

    /// Write the model to `path` (overwriting it).
    pub fn write(&self, path: &Path) -> Result<()> {
        backend::init();
        if self.n_head == 0 || self.n_head_kv == 0 || self.n_embd % self.n_head != 0 || self.n_head % self.n_head_kv != 0 {
            return Err(Error::InvalidArgument(format!("inconsistent head counts in {self:?}")));
        }
        let vocab = Vocab::spm();
        let mut file = GgufFile::new()?;
        file.kv_str("general.architecture", "llama");
        file.kv_str("general.name", "llamabox synthetic llama");
        file.kv_u32("llama.context_length", self.n_ctx_train);
        file.kv_u32("llama.embedding_length", self.n_embd);
        file.kv_u32("llama.block_count", self.n_layer);
        file.kv_u32("llama.feed_forward_length", self.n_ff);
        file.kv_u32("llama.attention.head_count", self.n_head);
        file.kv_u32("llama.attention.head_count_kv", self.n_head_kv);
        file.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
        file.kv_u32("llama.vocab_size", vocab.tokens.len() as u32);
        file.kv_str("tokenizer.ggml.model", "llama");
        file.kv_strs("tokenizer.ggml.tokens", &vocab.tokens);
        file.kv_f32s("tokenizer.ggml.scores", &vocab.scores);
        file.kv_i32s("tokenizer.ggml.token_type", &vocab.types);
        file.kv_u32("tokenizer.ggml.unknown_token_id", 0);
        file.kv_u32("tokenizer.ggml.bos_token_id", 1);
        file.kv_u32("tokenizer.ggml.eos_token_id", 2);

        let (e, v, ff) = (self.n_embd as usize, vocab.tokens.len(), self.n_ff as usize);
        let e_kv = e / self.n_head as usize * self.n_head_kv as usize;
        let mut tensors: Vec<(String, Vec<usize>)> = vec![
            ("token_embd.weight".into(), vec![e, v]),
            ("output_norm.weight".into(), vec![e]),
            ("output.weight".into(), vec![e, v]),
        ];
        for l in 0..self.n_layer {
            let blk = |name: &str, shape: Vec<usize>| (format!("blk.{l}.{name}.weight"), shape);
            tensors.extend([
                blk("attn_norm", vec![e]),
                blk("attn_q", vec![e, e]),
                blk("attn_k", vec![e, e_kv]),
                blk("attn_v", vec![e, e_kv]),
                blk("attn_output", vec![e, e]),
                blk("ffn_norm", vec![e]),
                blk("ffn_gate", vec![e, ff]),
                blk("ffn_up", vec![e, ff]),
                blk("ffn_down", vec![ff, e]),
            ]);
        }
        let mut rng = SplitMix64(self.seed);
        for (name, shape) in &tensors {
            let data: Vec<f32> = if shape.len() == 1 {
                vec![1.0; shape[0]] // norms: identity scale
            } else {
                // Uniform with the variance of N(0, 1/fan_in): activations stay O(1).
                let bound = (3.0 / shape[0] as f32).sqrt();
                (0..shape.iter().product::<usize>()).map(|_| rng.uniform(bound)).collect()
            };
            file.tensor_f32(name, shape, data)?;
        }
        file.write(path)
    }
}

/// An SPM vocabulary: `<unk>`, `<s>`, `</s>`, all 256 byte tokens (llama.cpp's SPM
/// tokenizer falls back to them and requires every one), then letters and a few words.
struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
}

impl Vocab {
    fn spm() -> Self {
        const NORMAL: i32 = 1;
        const UNKNOWN: i32 = 2;
        const CONTROL: i32 = 3;
        const BYTE: i32 = 6;
        let mut v = Vocab { tokens: Vec::new(), scores: Vec::new(), types: Vec::new() };
        let mut push = |text: String, score: f32, ty: i32| {
            v.tokens.push(text);
            v.scores.push(score);
            v.types.push(ty);
        };
        push("<unk>".into(), 0.0, UNKNOWN);
        push("<s>".into(), 0.0, CONTROL);
        push("</s>".into(), 0.0, CONTROL);
        for b in 0..=255u8 {
            push(format!("<0x{b:02X}>"), 0.0, BYTE);
        }
        let letters = ('a'..='z').chain('A'..='Z').map(String::from);
        let words = [
            "the", "llama", "box", "cancel", "token", "hello", "world", "plugin", "wasm", "in", "of", "to",
            "and", "is", "it", "that", "stop", "now", "fast",
        ];
        let pieces = std::iter::once("\u{2581}".to_string())
            .chain(letters.clone())
            .chain(letters.map(|l| format!("\u{2581}{l}")))
            .chain(words.iter().map(|w| w.to_string()))
            .chain(words.iter().map(|w| format!("\u{2581}{w}")))
            .chain([",", ".", "!", "?", "'", "-"].map(String::from));
        for (i, piece) in pieces.enumerate() {
            // Longer pieces score higher so the tokenizer prefers them.
            push(piece.clone(), piece.chars().count() as f32 - i as f32 * 1e-4, NORMAL);
        }
        v
    }
}

/// splitmix64: a tiny, fixed, seeded generator, so a spec always gives the same file.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-bound, bound).
    fn uniform(&mut self, bound: f32) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (unit * 2.0 - 1.0) * bound
    }
}

/// A GGUF file being assembled with ggml's gguf API. Tensor data stays in Rust vectors
/// until `write`; ggml holds only the tensor headers.
pub(crate) struct GgufFile {
    gguf: *mut sys::gguf_context,
    meta: *mut sys::ggml_context,
    data: Vec<Vec<f32>>,
}

impl GgufFile {
    const MAX_TENSORS: usize = 4096;

    pub(crate) fn new() -> Result<Self> {
        // SAFETY: plain constructors; null results are checked.
        let gguf = unsafe { sys::gguf_init_empty() };
        let meta = unsafe {
            sys::ggml_init(sys::ggml_init_params {
                mem_size: Self::MAX_TENSORS * sys::ggml_tensor_overhead(),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: true,
            })
        };
        if gguf.is_null() || meta.is_null() {
            return Err(Error::Backend("could not allocate a gguf writer".into()));
        }
        Ok(Self { gguf, meta, data: Vec::new() })
    }

    fn key(key: &str) -> CString {
        CString::new(key).expect("gguf keys are literals without NUL")
    }

    pub(crate) fn kv_str(&mut self, key: &str, value: &str) {
        let value = CString::new(value).expect("gguf values are literals without NUL");
        unsafe { sys::gguf_set_val_str(self.gguf, Self::key(key).as_ptr(), value.as_ptr()) }
    }

    pub(crate) fn kv_u32(&mut self, key: &str, value: u32) {
        unsafe { sys::gguf_set_val_u32(self.gguf, Self::key(key).as_ptr(), value) }
    }

    pub(crate) fn kv_f32(&mut self, key: &str, value: f32) {
        unsafe { sys::gguf_set_val_f32(self.gguf, Self::key(key).as_ptr(), value) }
    }

    pub(crate) fn kv_f32s(&mut self, key: &str, values: &[f32]) {
        unsafe {
            sys::gguf_set_arr_data(self.gguf, Self::key(key).as_ptr(), sys::GGUF_TYPE_FLOAT32, values.as_ptr().cast(), values.len())
        }
    }

    pub(crate) fn kv_i32s(&mut self, key: &str, values: &[i32]) {
        unsafe {
            sys::gguf_set_arr_data(self.gguf, Self::key(key).as_ptr(), sys::GGUF_TYPE_INT32, values.as_ptr().cast(), values.len())
        }
    }

    pub(crate) fn kv_strs(&mut self, key: &str, values: &[String]) {
        let owned: Vec<CString> = values.iter().map(|s| CString::new(s.as_str()).expect("no NUL in vocab")).collect();
        let mut ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
        unsafe { sys::gguf_set_arr_str(self.gguf, Self::key(key).as_ptr(), ptrs.as_mut_ptr(), ptrs.len()) }
    }

    /// Add an F32 tensor; `shape` is ggml order (ne0 = the contiguous dimension).
    pub(crate) fn tensor_f32(&mut self, name: &str, shape: &[usize], mut data: Vec<f32>) -> Result<()> {
        if data.len() != shape.iter().product::<usize>() || shape.is_empty() || shape.len() > 4 {
            return Err(Error::InvalidArgument(format!("tensor {name}: shape {shape:?} does not fit {} values", data.len())));
        }
        if self.data.len() == Self::MAX_TENSORS {
            return Err(Error::InvalidArgument("too many tensors".into()));
        }
        let ne: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let name = CString::new(name).map_err(|_| Error::InvalidArgument("NUL in tensor name".into()))?;
        // SAFETY: `meta` has room for MAX_TENSORS headers; the data pointer stays valid
        // (the Vec's heap buffer does not move when the Vec is moved into `self.data`).
        unsafe {
            let t = sys::ggml_new_tensor(self.meta, sys::GGML_TYPE_F32, ne.len() as i32, ne.as_ptr());
            sys::ggml_set_name(t, name.as_ptr());
            (*t).data = data.as_mut_ptr().cast();
            sys::gguf_add_tensor(self.gguf, t);
        }
        self.data.push(data);
        Ok(())
    }

    pub(crate) fn write(self, path: &Path) -> Result<()> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::InvalidArgument("path contains a NUL byte".into()))?;
        if unsafe { sys::gguf_write_to_file(self.gguf, c_path.as_ptr(), false) } {
            Ok(())
        } else {
            Err(Error::Backend(format!("could not write {}", path.display())))
        }
    }
}

impl Drop for GgufFile {
    fn drop(&mut self) {
        unsafe {
            sys::gguf_free(self.gguf);
            sys::ggml_free(self.meta);
        }
    }
}
