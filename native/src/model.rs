//! A loaded text model and its vocabulary. Read-only once loaded, so one `Model` is
//! shared (through `Arc`) by every context and every plugin that opens it.

use std::ffi::CString;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

use super::devices::Offload;
use super::grammar::{GrammarEnv, Vocabulary};
use super::{backend, Error, Result, Token};

/// A loaded GGUF text model and its vocabulary, shared read-only by every context on it
/// (freed when the last `Arc` goes).
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
    n_vocab: i32,
    /// The vocabulary as the grammar engine sees it, built by the first grammar.
    grammar_env: OnceLock<Result<GrammarEnv>>,
    /// The GPU holding some of its layers, if any, and how many it holds.
    device: Option<String>,
    gpu_layers: u32,
}

// SAFETY: a llama_model is immutable after loading; llama.cpp documents sharing one
// model between contexts on different threads. The vocabulary is part of the model.
// Nothing in it is tied to the thread that loaded it, so it may also be freed on another.
unsafe impl Send for Model {}
// SAFETY: every `&self` method only reads the model or its vocabulary (the tokenizer is
// documented thread-safe in llama.h); the one lazily built part, `grammar_env`, is
// Rust-side behind a `OnceLock`.
unsafe impl Sync for Model {}

impl Model {
    /// Load a GGUF model with its layers where llama.cpp puts them by default in this
    /// build: every layer on the first GPU if there is one, else on the CPU. Blocking
    /// (reads or maps the whole file, and copies offloaded layers to the device).
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, &Offload::default())
    }

    /// Load a GGUF model with `offload`'s layers on its GPU.
    pub fn load_with(path: &Path, offload: &Offload) -> Result<Self> {
        backend::init();
        let placement = offload.place()?;
        if !path.is_file() {
            return Err(Error::Backend(format!("model file {} not found", path.display())));
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::InvalidArgument("model path contains a NUL byte".into()))?;
        // One device and the end of the list: llama.cpp copies it while loading.
        let mut devices: Vec<sys::ggml_backend_dev_t> =
            placement.device.into_iter().chain([std::ptr::null_mut()]).collect();
        // SAFETY: llama.cpp's default params with a null-terminated device list (a live
        // registry device, or none: then the CPU alone, since 0 layers go anywhere else)
        // alive for the call; `c_path` is a NUL-terminated string alive for the call
        // (llama.cpp keeps neither); a null return is handled below.
        let ptr = unsafe {
            let mut params = sys::llama_model_default_params();
            params.n_gpu_layers = placement.gpu_layers;
            params.devices = devices.as_mut_ptr();
            sys::llama_model_load_from_file(c_path.as_ptr(), params)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Backend(format!("llama.cpp could not load {} (see its log)", path.display()))
        })?;
        // SAFETY: ptr is a live model; the vocab lives as long as the model.
        let vocab = unsafe { sys::llama_model_get_vocab(ptr.as_ptr()) };
        let Some(vocab) = NonNull::new(vocab.cast_mut()) else {
            // SAFETY: `ptr` was loaded above and is owned here alone: no `Model` holds it
            // yet, so it is freed exactly once.
            unsafe { sys::llama_model_free(ptr.as_ptr()) };
            return Err(Error::Backend("model has no vocabulary".into()));
        };
        // SAFETY: a non-null vocabulary of the live model `ptr`; only read.
        let n_vocab = unsafe { sys::llama_vocab_n_tokens(vocab.as_ptr()) };
        // SAFETY: a live model; reads its hyperparameters.
        let n_layer = unsafe { sys::llama_model_n_layer(ptr.as_ptr()) }.max(0) as u32;
        // llama.cpp puts min(asked, layers + the output layer) on the device.
        let gpu_layers = if placement.device.is_some() {
            (placement.gpu_layers.max(0) as u32).min(n_layer + 1)
        } else {
            0
        };
        let device = placement.device_name.filter(|_| gpu_layers > 0);
        Ok(Self { ptr, vocab, n_vocab, grammar_env: OnceLock::new(), device, gpu_layers })
    }

    /// The GPU holding some of its layers (ggml's device name), if any.
    pub fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// Layers on [`Model::device`] (0 on the CPU alone): the output layer counts as one.
    pub fn gpu_layers(&self) -> u32 {
        self.gpu_layers
    }

    /// A value of the model's GGUF metadata, as text (`None` if it has no such key, or
    /// the key is not valid C text).
    pub fn meta(&self, key: &str) -> Option<String> {
        self.meta_within(key, usize::MAX).ok().flatten()
    }

    /// [`Model::meta`], refusing a value longer than `max` bytes before copying it:
    /// `Err` with the value's length.
    pub fn meta_within(&self, key: &str, max: usize) -> Result<Option<String>, usize> {
        let Ok(key) = std::ffi::CString::new(key) else { return Ok(None) };
        let mut buf = vec![0u8; 256.min(max.saturating_add(1))];
        loop {
            // SAFETY: a live model (`&self`), a NUL-terminated key, and a buffer of the
            // length passed, which llama.cpp writes at most that many bytes into (NUL
            // included); it returns the value's whole length, or -1 for no such key.
            let n = unsafe {
                sys::llama_model_meta_val_str(
                    self.as_ptr(),
                    key.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            let Ok(n) = usize::try_from(n) else { return Ok(None) };
            if n > max {
                return Err(n);
            }
            if n < buf.len() {
                return Ok(Some(String::from_utf8_lossy(&buf[..n]).into_owned()));
            }
            buf.resize(n + 1, 0);
        }
    }

    /// Whether the model's attention is causal (each row sees only the rows before it):
    /// `ARCH.attention.causal` in its metadata, true where absent (decoder LLMs).
    pub fn causal_attention(&self) -> bool {
        let arch = self.meta("general.architecture").unwrap_or_default();
        self.meta(&format!("{arch}.attention.causal")).is_none_or(|v| v != "false")
    }

    /// Whether llama.cpp's graph for this model computes nothing after its hidden
    /// states (the node it names `result_norm`, which it reads embeddings from) but the
    /// output head, so a decode of embeddings may end there. Read in the pinned
    /// llama.cpp for these architectures only; some others name a `result_norm` that is
    /// not what they read (a drafter's, a classifier's).
    pub(crate) fn head_follows_hidden_states(&self) -> bool {
        const READ: &[&str] = &[
            "llama", "qwen2", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3", "phi3", "granite",
            "olmo2", "smollm3", "mistral3",
        ];
        self.meta("general.architecture").is_some_and(|arch| READ.contains(&arch.as_str()))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }

    #[cfg(test)]
    pub(crate) fn vocab_ptr(&self) -> *const sys::llama_vocab {
        self.vocab()
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        self.vocab.as_ptr()
    }

    /// Tokens in the vocabulary: valid ids are `0..n_vocab`.
    pub fn n_vocab(&self) -> u32 {
        self.n_vocab as u32
    }

    /// Width of the model's embeddings (what an embedding output has).
    pub fn n_embd(&self) -> u32 {
        // SAFETY: `self.ptr` is live until `Drop` (which needs the last owner); reads a field.
        unsafe { sys::llama_model_n_embd(self.as_ptr()) }.max(0) as u32
    }

    /// Width of input embeddings (what a projector must produce).
    pub fn n_embd_inp(&self) -> u32 {
        // SAFETY: as in `n_embd`: a live model, a read-only getter.
        unsafe { sys::llama_model_n_embd_inp(self.as_ptr()) }.max(0) as u32
    }

    /// The context length the model was trained with.
    pub fn n_ctx_train(&self) -> u32 {
        // SAFETY: as in `n_embd`: a live model, a read-only getter.
        unsafe { sys::llama_model_n_ctx_train(self.as_ptr()) }.max(0) as u32
    }

    /// Layers in the model (without the output layer).
    pub fn n_layer(&self) -> u32 {
        // SAFETY: as in `n_embd`: a live model, a read-only getter.
        unsafe { sys::llama_model_n_layer(self.as_ptr()) }.max(0) as u32
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos(&self) -> Option<Token> {
        // SAFETY: the vocabulary lives as long as the model, which `&self` keeps alive;
        // reads a field (the id may be -1, which `is_valid` filters).
        Some(unsafe { sys::llama_vocab_bos(self.vocab()) }).filter(|&t| self.is_valid(t))
    }

    /// The end-of-sequence token, if the vocabulary has one.
    pub fn eos(&self) -> Option<Token> {
        // SAFETY: as in `bos`.
        Some(unsafe { sys::llama_vocab_eos(self.vocab()) }).filter(|&t| self.is_valid(t))
    }

    /// Whether `token` ends a generation (end of sequence, end of turn, ...); false for
    /// ids outside the vocabulary.
    pub fn is_eog(&self, token: Token) -> bool {
        // SAFETY: a live vocabulary (as in `bos`); llama.cpp looks any id up in a set, and
        // `&&` passes it only ids in [0, n_vocab) anyway.
        self.is_valid(token) && unsafe { sys::llama_vocab_is_eog(self.vocab(), token) }
    }

    /// Whether `token` is in the vocabulary.
    pub fn is_valid(&self, token: Token) -> bool {
        (0..self.n_vocab).contains(&token)
    }

    /// Every token in `[0, n_vocab)`, or an error naming the first that is not.
    pub fn check_tokens(&self, tokens: &[Token]) -> Result<()> {
        match tokens.iter().position(|&t| !self.is_valid(t)) {
            None => Ok(()),
            Some(i) => Err(Error::InvalidArgument(format!(
                "token {} at index {i} is outside the vocabulary [0, {})",
                tokens[i], self.n_vocab
            ))),
        }
    }

    /// Text to tokens. `add_special` adds the BOS/EOS tokens the model wants around a
    /// prompt; `parse_special` reads special tokens written as text (`<|im_start|>`).
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len())
            .map_err(|_| Error::InvalidArgument("text longer than 2^31 bytes".into()))?;
        // One token per byte plus BOS/EOS is an upper bound for every tokenizer llama.cpp has.
        let mut tokens = vec![0 as Token; text.len() + 2];
        // SAFETY: a live vocabulary (tokenizing is documented thread-safe); `text` is `len`
        // readable bytes (llama.cpp takes the length, no NUL needed); llama.cpp writes at
        // most `n_tokens_max` tokens, which is never more than `buf` holds.
        let call = |buf: &mut [Token]| unsafe {
            sys::llama_tokenize(
                self.vocab(),
                text.as_ptr().cast(),
                len,
                buf.as_mut_ptr(),
                buf.len().min(i32::MAX as usize) as i32,
                add_special,
                parse_special,
            )
        };
        let mut n = call(&mut tokens);
        if n < 0 {
            // Only when the bound above is wrong: llama.cpp reports the size it needs.
            tokens.resize(n.unsigned_abs() as usize, 0);
            n = call(&mut tokens);
        }
        if n < 0 {
            return Err(Error::Backend(format!("llama_tokenize failed ({n})")));
        }
        tokens.truncate(n as usize);
        Ok(tokens)
    }

    /// One token's bytes (which may be part of a UTF-8 character).
    pub fn token_to_piece(&self, token: Token, special: bool) -> Result<Vec<u8>> {
        if !self.is_valid(token) {
            return Err(Error::InvalidArgument(format!(
                "token {token} is outside the vocabulary [0, {})",
                self.n_vocab
            )));
        }
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: a live vocabulary; a token checked in range above (out of range,
            // llama.cpp throws from `id_to_token.at`, which must not unwind into Rust);
            // `buf` has `buf.len()` writable bytes, all llama.cpp is told it may write.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab(),
                    token,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            buf.resize(n.unsigned_abs() as usize, 0);
        }
    }

    /// Tokens to text; invalid UTF-8 becomes U+FFFD.
    pub fn detokenize(
        &self,
        tokens: &[Token],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<String> {
        self.check_tokens(tokens)?;
        let n_tokens = i32::try_from(tokens.len())
            .map_err(|_| Error::InvalidArgument("too many tokens".into()))?;
        let mut buf = vec![0u8; tokens.len() * 8 + 16];
        loop {
            let cap = buf.len().min(i32::MAX as usize) as i32;
            // SAFETY: a live vocabulary; `tokens` is `n_tokens` readable ids, all checked in
            // range above; `buf` has at least `cap` writable bytes, all llama.cpp may write.
            let n = unsafe {
                sys::llama_detokenize(
                    self.vocab(),
                    tokens.as_ptr(),
                    n_tokens,
                    buf.as_mut_ptr().cast(),
                    cap,
                    remove_special,
                    unparse_special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            if n == i32::MIN {
                return Err(Error::Backend("detokenized text longer than 2^31 bytes".into()));
            }
            buf.resize(n.unsigned_abs() as usize, 0);
        }
    }
}

/// The grammar engine's view of the model.
impl Vocabulary for Model {
    fn n_vocab(&self) -> u32 {
        Model::n_vocab(self)
    }

    fn is_eog(&self, token: Token) -> bool {
        Model::is_eog(self, token)
    }

    fn token_to_piece(&self, token: Token, special: bool) -> Result<Vec<u8>> {
        Model::token_to_piece(self, token, special)
    }

    fn tokenize_special(&self, text: &str) -> Result<Vec<Token>> {
        self.tokenize(text, false, true)
    }

    /// Every token's bytes in a trie, built once, by the first grammar compiled for
    /// this model (tens of ms for 49k tokens), and shared by every sampler of the model
    /// after that.
    fn grammar_env(&self) -> Result<&GrammarEnv> {
        self.grammar_env.get_or_init(|| GrammarEnv::new(self)).as_ref().map_err(Clone::clone)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: every context, sampler and media context holds an Arc<Model>, so none
        // is alive here; `&mut self` in drop runs once, so the model is freed once.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("n_vocab", &self.n_vocab).finish_non_exhaustive()
    }
}
