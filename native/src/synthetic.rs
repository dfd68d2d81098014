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
    /// Embedding width (a multiple of `n_head`).
    pub n_embd: u32,
    /// Transformer blocks.
    pub n_layer: u32,
    /// Attention heads (a multiple of `n_head_kv`).
    pub n_head: u32,
    /// Key/value heads (`n_head` a multiple of it; fewer is grouped-query attention).
    pub n_head_kv: u32,
    /// Width of the feed-forward layers.
    pub n_ff: u32,
    /// Context length written as trained with.
    pub n_ctx_train: u32,
    /// Seed of the random weights.
    pub seed: u64,
    /// Written as `tokenizer.chat_template` when set.
    pub chat_template: Option<String>,
    /// Written as `llama.pooling_type` when set (1 mean, 2 cls, 3 last): the model then
    /// pools its embeddings itself, as dedicated embedding models do.
    pub pooling_type: Option<u32>,
}

/// A ChatML template in the Jinja form models ship (llama.cpp recognises it by its
/// `<|im_start|>` markers).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl TextModelSpec {
    /// A model whose decodes take microseconds: for tests of behaviour.
    pub fn tiny() -> Self {
        Self {
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 128,
            n_ctx_train: 4096,
            seed: 1,
            chat_template: Some(CHATML_TEMPLATE.into()),
            pooling_type: None,
        }
    }

    /// A model whose 512-token decode takes a good fraction of a second on one core:
    /// for cancel demos and benchmarks.
    pub fn slow() -> Self {
        Self {
            n_embd: 512,
            n_layer: 8,
            n_head: 8,
            n_head_kv: 8,
            n_ff: 1536,
            n_ctx_train: 4096,
            seed: 2,
            chat_template: None,
            pooling_type: None,
        }
    }

    /// Write the model to `path` (overwriting it).
    pub fn write(&self, path: &Path) -> Result<()> {
        backend::init();
        if self.n_head == 0
            || self.n_head_kv == 0
            || !self.n_embd.is_multiple_of(self.n_head)
            || !self.n_head.is_multiple_of(self.n_head_kv)
        {
            return Err(Error::InvalidArgument(format!("inconsistent head counts in {self:?}")));
        }
        let vocab = Vocab::spm();
        let mut file = GgufFile::new()?;
        file.kv_str("general.architecture", "llama")?;
        file.kv_str("general.name", "llamabox synthetic llama")?;
        file.kv_u32("llama.context_length", self.n_ctx_train);
        file.kv_u32("llama.embedding_length", self.n_embd);
        file.kv_u32("llama.block_count", self.n_layer);
        file.kv_u32("llama.feed_forward_length", self.n_ff);
        file.kv_u32("llama.attention.head_count", self.n_head);
        file.kv_u32("llama.attention.head_count_kv", self.n_head_kv);
        file.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
        file.kv_u32("llama.vocab_size", vocab.tokens.len() as u32);
        file.kv_str("tokenizer.ggml.model", "llama")?;
        file.kv_strs("tokenizer.ggml.tokens", &vocab.tokens);
        file.kv_array("tokenizer.ggml.scores", &vocab.scores);
        file.kv_array("tokenizer.ggml.token_type", &vocab.types);
        file.kv_u32("tokenizer.ggml.unknown_token_id", 0);
        file.kv_u32("tokenizer.ggml.bos_token_id", 1);
        file.kv_u32("tokenizer.ggml.eos_token_id", 2);
        if let Some(template) = &self.chat_template {
            file.kv_str("tokenizer.chat_template", template)?;
        }
        if let Some(pooling) = self.pooling_type {
            file.kv_u32("llama.pooling_type", pooling);
        }

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
        file.random_tensors(self.seed, &tensors)?;
        file.write(path)
    }
}

/// Shape of a synthetic projector (mmproj) for a text model of width `n_embd_text`:
/// a LLaVA-1.5 `mlp` vision encoder or a `qwen2a` (whisper) audio encoder, random
/// weights. Both run real attention, so an encode has boundaries where it can stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectorSpec {
    /// Vision or audio, with that encoder's input shape.
    pub kind: ProjectorKind,
    /// Encoder width.
    pub n_embd: u32,
    /// Width of the encoder's feed-forward layers (not `n_embd`).
    pub n_ff: u32,
    /// Attention heads (`n_embd` a multiple of it).
    pub n_head: u32,
    /// Encoder blocks (at least 1).
    pub n_layer: u32,
    /// Width of the text model's input embeddings, which the projector must produce.
    pub n_embd_text: u32,
    /// Seed of the random weights.
    pub seed: u64,
}

/// Which encoder a synthetic projector has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProjectorKind {
    /// Images are letterboxed to `image_size`² and cut into `patch_size`² patches:
    /// (image_size / patch_size)² embeddings per image. llava runs n_layer - 1 blocks.
    Vision {
        /// Side of the square the encoder sees, in pixels.
        image_size: u32,
        /// Side of one patch, in pixels (`image_size` a multiple of it).
        patch_size: u32,
    },
    /// 16 kHz audio, `n_mel` mel bins; every clip becomes 750 embeddings per 30 s.
    Audio {
        /// Mel bins per frame.
        n_mel: u32,
    },
}

impl ProjectorSpec {
    /// A vision projector whose encode takes milliseconds (64 embeddings per image).
    pub fn tiny_vision(n_embd_text: u32) -> Self {
        Self {
            kind: ProjectorKind::Vision { image_size: 64, patch_size: 8 },
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_layer: 4,
            n_embd_text,
            seed: 11,
        }
    }

    /// A vision projector whose encode takes a few hundred milliseconds on one core
    /// (256 patches of width 512 through 6 blocks, ~3.6 GMAC): for cancel demos and
    /// benchmarks.
    pub fn slow_vision(n_embd_text: u32) -> Self {
        Self {
            kind: ProjectorKind::Vision { image_size: 224, patch_size: 14 },
            n_embd: 512,
            n_ff: 1024,
            n_head: 8,
            n_layer: 7,
            n_embd_text,
            seed: 12,
        }
    }

    /// An audio projector whose encode takes milliseconds.
    pub fn tiny_audio(n_embd_text: u32) -> Self {
        Self {
            kind: ProjectorKind::Audio { n_mel: 16 },
            n_embd: 32,
            n_ff: 64,
            n_head: 2,
            n_layer: 2,
            n_embd_text,
            seed: 13,
        }
    }

    /// Write the projector to `path` (overwriting it).
    pub fn write(&self, path: &Path) -> Result<()> {
        backend::init();
        if self.n_head == 0
            || !self.n_embd.is_multiple_of(self.n_head)
            || self.n_ff == self.n_embd
            || self.n_layer == 0
        {
            // n_ff == n_embd would make clip swap the FFN's up and down (a legacy fix).
            return Err(Error::InvalidArgument(format!("unusable projector shape {self:?}")));
        }
        let (e, ff, text) = (self.n_embd as usize, self.n_ff as usize, self.n_embd_text as usize);
        let mut file = GgufFile::new()?;
        file.kv_str("general.architecture", "clip")?;
        file.kv_str("general.name", "llamabox synthetic projector")?;
        let (prefix, blk) = match self.kind {
            ProjectorKind::Vision { .. } => ("clip.vision", "v.blk"),
            ProjectorKind::Audio { .. } => ("clip.audio", "a.blk"),
        };
        file.kv_u32(&format!("{prefix}.embedding_length"), self.n_embd);
        file.kv_u32(&format!("{prefix}.feed_forward_length"), self.n_ff);
        file.kv_u32(&format!("{prefix}.block_count"), self.n_layer);
        file.kv_u32(&format!("{prefix}.attention.head_count"), self.n_head);
        file.kv_u32(&format!("{prefix}.projection_dim"), self.n_embd_text);
        file.kv_f32(&format!("{prefix}.attention.layer_norm_epsilon"), 1e-5);

        let mut tensors: Vec<(String, Vec<usize>)> = Vec::new();
        match self.kind {
            ProjectorKind::Vision { image_size, patch_size } => {
                if patch_size == 0 || !image_size.is_multiple_of(patch_size) {
                    return Err(Error::InvalidArgument(format!(
                        "image size {image_size} is not a multiple of patch size {patch_size}"
                    )));
                }
                let patches = ((image_size / patch_size) as usize).pow(2);
                let p = patch_size as usize;
                file.kv_bool("clip.has_vision_encoder", true);
                file.kv_str("clip.projector_type", "mlp")?;
                file.kv_u32("clip.vision.image_size", image_size);
                file.kv_u32("clip.vision.patch_size", patch_size);
                file.kv_array("clip.vision.image_mean", &[0.5_f32; 3]);
                file.kv_array("clip.vision.image_std", &[0.5_f32; 3]);
                tensors.push(("v.patch_embd.weight".into(), vec![p, p, 3, e]));
                tensors.push(("v.position_embd.weight".into(), vec![e, patches]));
            }
            ProjectorKind::Audio { n_mel } => {
                file.kv_bool("clip.has_audio_encoder", true);
                file.kv_str("clip.projector_type", "qwen2a")?;
                file.kv_u32("clip.audio.num_mel_bins", n_mel);
                // Whisper: two convolutions (the second halves 3000 mel frames to 1500
                // positions), then the encoder blocks.
                tensors.extend([
                    ("a.conv1d.1.weight".into(), vec![3, n_mel as usize, e]),
                    ("a.conv1d.1.bias".into(), vec![1, e]),
                    ("a.conv1d.2.weight".into(), vec![3, e, e]),
                    ("a.conv1d.2.bias".into(), vec![1, e]),
                    ("a.position_embd.weight".into(), vec![e, 1500]),
                ]);
            }
        }
        for l in 0..self.n_layer {
            let t = |name: &str, shape: Vec<usize>| (format!("{blk}.{l}.{name}"), shape);
            tensors.extend([
                t("ln1.weight", vec![e]),
                t("ln1.bias", vec![e]),
                t("attn_q.weight", vec![e, e]),
                t("attn_q.bias", vec![e]),
                t("attn_k.weight", vec![e, e]), // whisper's k has no bias
                t("attn_v.weight", vec![e, e]),
                t("attn_v.bias", vec![e]),
                t("attn_out.weight", vec![e, e]),
                t("attn_out.bias", vec![e]),
                t("ln2.weight", vec![e]),
                t("ln2.bias", vec![e]),
                t("ffn_up.weight", vec![e, ff]),
                t("ffn_up.bias", vec![ff]),
                t("ffn_down.weight", vec![ff, e]),
                t("ffn_down.bias", vec![e]),
            ]);
        }
        match self.kind {
            ProjectorKind::Vision { .. } => tensors.extend([
                ("mm.0.weight".into(), vec![e, text]),
                ("mm.0.bias".into(), vec![text]),
                ("mm.2.weight".into(), vec![text, text]),
                ("mm.2.bias".into(), vec![text]),
            ]),
            ProjectorKind::Audio { .. } => tensors.extend([
                ("mm.a.fc.weight".into(), vec![e, text]),
                ("mm.a.fc.bias".into(), vec![text]),
            ]),
        }
        file.random_tensors(self.seed, &tensors)?;
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
            "the", "llama", "box", "cancel", "token", "hello", "world", "plugin", "wasm", "in",
            "of", "to", "and", "is", "it", "that", "stop", "now", "fast",
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

/// splitmix64: a tiny, fixed, seeded generator, so a spec always gives the same file
/// (and a seeded test run can be replayed).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next number of the sequence.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-bound, bound).
    fn uniform(&mut self, bound: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (unit * 2.0 - 1.0) * bound
    }
}

/// A number type whose arrays gguf stores as they lie in memory.
pub(crate) trait GgufNumber {
    /// Its `GGUF_TYPE_*`, of the same size and layout.
    const TYPE: sys::gguf_type;
}

impl GgufNumber for f32 {
    const TYPE: sys::gguf_type = sys::GGUF_TYPE_FLOAT32;
}

impl GgufNumber for i32 {
    const TYPE: sys::gguf_type = sys::GGUF_TYPE_INT32;
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
        // SAFETY: a plain constructor; a null result is checked below.
        let gguf = unsafe { sys::gguf_init_empty() };
        // SAFETY: a plain constructor; `no_alloc` with a null buffer makes ggml allocate
        // room for MAX_TENSORS headers only (tensor data stays in `data`); null is checked.
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

    /// A string value; one with a NUL byte (a chat template from the caller's spec, say)
    /// is refused rather than cut short.
    pub(crate) fn kv_str(&mut self, key: &str, value: &str) -> Result<()> {
        let value = CString::new(value)
            .map_err(|_| Error::InvalidArgument(format!("{key}: the value contains a NUL byte")))?;
        // SAFETY: `self.gguf` is live and non-null (checked in `new`) until `Drop`; key and
        // value are NUL-terminated strings alive for the call, which gguf copies.
        unsafe { sys::gguf_set_val_str(self.gguf, Self::key(key).as_ptr(), value.as_ptr()) };
        Ok(())
    }

    pub(crate) fn kv_u32(&mut self, key: &str, value: u32) {
        // SAFETY: a live gguf (as in `kv_str`); the key (a temporary alive for the whole
        // statement) is copied by gguf.
        unsafe { sys::gguf_set_val_u32(self.gguf, Self::key(key).as_ptr(), value) }
    }

    pub(crate) fn kv_f32(&mut self, key: &str, value: f32) {
        // SAFETY: as in `kv_u32`.
        unsafe { sys::gguf_set_val_f32(self.gguf, Self::key(key).as_ptr(), value) }
    }

    pub(crate) fn kv_bool(&mut self, key: &str, value: bool) {
        // SAFETY: as in `kv_u32`.
        unsafe { sys::gguf_set_val_bool(self.gguf, Self::key(key).as_ptr(), value) }
    }

    pub(crate) fn kv_array<T: GgufNumber>(&mut self, key: &str, values: &[T]) {
        // SAFETY: as in `kv_u32`; gguf copies `values.len()` elements of `T::TYPE`, which is
        // `T`'s own layout, from `values`, which has them.
        unsafe {
            sys::gguf_set_arr_data(
                self.gguf,
                Self::key(key).as_ptr(),
                T::TYPE,
                values.as_ptr().cast(),
                values.len(),
            )
        }
    }

    pub(crate) fn kv_strs(&mut self, key: &str, values: &[String]) {
        let owned: Vec<CString> =
            values.iter().map(|s| CString::new(s.as_str()).expect("no NUL in vocab")).collect();
        let mut ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
        // SAFETY: as in `kv_u32`; `ptrs` holds `ptrs.len()` NUL-terminated strings owned by
        // `owned`, alive for the call, which gguf copies.
        unsafe {
            sys::gguf_set_arr_str(self.gguf, Self::key(key).as_ptr(), ptrs.as_mut_ptr(), ptrs.len())
        }
    }

    /// Add seeded random F32 tensors. Names ending in `.bias` get small values, other
    /// 1-D tensors (norm scales) ones; the rest uniform with the variance of
    /// N(0, 1/fan_in), so activations stay O(1) through any depth.
    pub(crate) fn random_tensors(
        &mut self,
        seed: u64,
        tensors: &[(String, Vec<usize>)],
    ) -> Result<()> {
        let mut rng = SplitMix64(seed);
        for (name, shape) in tensors {
            let n = shape.iter().product::<usize>();
            let data: Vec<f32> = if name.ends_with(".bias") {
                (0..n).map(|_| rng.uniform(0.02)).collect()
            } else if shape.len() == 1 {
                vec![1.0; n]
            } else {
                let fan_in = shape[..shape.len() - 1].iter().product::<usize>().max(1);
                let bound = (3.0 / fan_in as f32).sqrt();
                (0..n).map(|_| rng.uniform(bound)).collect()
            };
            self.tensor_f32(name, shape, data)?;
        }
        Ok(())
    }

    /// Add an F32 tensor; `shape` is ggml order (ne0 = the contiguous dimension).
    pub(crate) fn tensor_f32(
        &mut self,
        name: &str,
        shape: &[usize],
        mut data: Vec<f32>,
    ) -> Result<()> {
        if data.len() != shape.iter().product::<usize>() || shape.is_empty() || shape.len() > 4 {
            return Err(Error::InvalidArgument(format!(
                "tensor {name}: shape {shape:?} does not fit {} values",
                data.len()
            )));
        }
        if self.data.len() == Self::MAX_TENSORS {
            return Err(Error::InvalidArgument("too many tensors".into()));
        }
        let ne: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let name =
            CString::new(name).map_err(|_| Error::InvalidArgument("NUL in tensor name".into()))?;
        // SAFETY: `meta` has room for MAX_TENSORS headers (fewer so far, checked), so
        // ggml_new_tensor returns a live header (it aborts rather than return null); `ne`
        // holds its 1 to 4 dimensions; the name is copied. The data pointer stays valid
        // (the Vec's heap buffer does not move when the Vec is moved into `self.data`).
        unsafe {
            let t =
                sys::ggml_new_tensor(self.meta, sys::GGML_TYPE_F32, ne.len() as i32, ne.as_ptr());
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
        // SAFETY: a live gguf; a NUL-terminated path alive for the call; every tensor's data
        // pointer is into a buffer of `self.data`, alive until `self` drops after this.
        if unsafe { sys::gguf_write_to_file(self.gguf, c_path.as_ptr(), false) } {
            Ok(())
        } else {
            Err(Error::Backend(format!("could not write {}", path.display())))
        }
    }
}

impl Drop for GgufFile {
    fn drop(&mut self) {
        // SAFETY: both made (non-null) in `new`, owned alone, freed once. gguf keeps copies
        // of the tensor headers, not pointers into `meta`, so the order does not matter;
        // `data` (the tensors' bytes) is dropped after this.
        unsafe {
            sys::gguf_free(self.gguf);
            sys::ggml_free(self.meta);
        }
    }
}
