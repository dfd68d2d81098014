//! Chat templates: messages to a prompt, with the template stored in the model's GGUF
//! (`tokenizer.chat_template`) or one of llama.cpp's built-in templates by name.
//!
//! llama.cpp does not run Jinja here: it recognises a template (by name, or by
//! fingerprints of well-known Jinja sources) and formats with its own code. A template
//! it does not recognise is an error, never a guess.

use std::ffi::{CStr, CString};

use llama_cpp_sys_2 as sys;

use super::model::Model;
use super::{backend, Error, Result};

/// Bytes a message costs beyond its role and content, charged against text limits:
/// the markers a template wraps each message in (ChatML's `<|im_start|>` + `<|im_end|>`
/// and newlines are 25 bytes, Llama 3's headers and `<|eot_id|>` 47, Gemma's turn markers
/// 32). Without it a million empty messages cost nothing and formatted to 24-48 MB.
pub const MESSAGE_OVERHEAD: usize = 64;

/// What `messages` cost against a text limit: their bytes plus each one's overhead.
pub fn messages_cost(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + MESSAGE_OVERHEAD)
        .fold(0, usize::saturating_add)
}

/// One message of a chat, as the template formats it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// Who says it (`system`, `user`, `assistant`, ...), as the template spells it.
    pub role: String,
    /// What it says, as plain text.
    pub content: String,
}

/// Which template to format with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// The model's own (`tokenizer.chat_template` in its GGUF).
    Model,
    /// A built-in template by name (`chatml`, `llama3`, ...; see [`builtin_templates`]).
    Named(String),
}

/// Names of llama.cpp's built-in templates.
pub fn builtin_templates() -> Vec<String> {
    backend::init();
    // SAFETY: with length 0 llama.cpp writes nothing through the (null) output and only
    // returns the count.
    let n = unsafe { sys::llama_chat_builtin_templates(std::ptr::null_mut(), 0) }.max(0) as usize;
    let mut names = vec![std::ptr::null(); n];
    // SAFETY: `names` has room for the `n` pointers llama.cpp writes (it writes at most
    // `len`); they point at the keys of its static template table.
    unsafe { sys::llama_chat_builtin_templates(names.as_mut_ptr(), n) };
    names
        .into_iter()
        .filter(|p| !p.is_null())
        // SAFETY: non-null pointers llama.cpp just wrote: NUL-terminated strings of a
        // static table, alive for the process.
        .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        .collect()
}

impl Model {
    /// The chat template stored in the model's GGUF, if it has one.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: a live model (`&self`); a null name asks for the default template.
        let ptr = unsafe { sys::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        // SAFETY: non-null: a NUL-terminated string owned by the model's metadata (or a
        // static literal), alive while `&self` keeps the model; copied out at once.
        (!ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
    }

    /// Format `messages` into a prompt; `add_assistant` ends it with the start of an
    /// assistant turn. Tokenize the result with `parse_special` so its markers become
    /// their tokens.
    pub fn apply_chat_template(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String> {
        let source = match template {
            ChatTemplate::Model => self.chat_template().ok_or_else(|| {
                Error::InvalidArgument(
                    "this model has no chat template (tokenizer.chat_template); name one".into(),
                )
            })?,
            ChatTemplate::Named(name) => {
                if !builtin_templates().iter().any(|n| n == name) {
                    return Err(Error::InvalidArgument(format!("unknown chat template {name:?}")));
                }
                name.clone()
            }
        };
        let c = |s: &str, what: &str| {
            CString::new(s)
                .map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
        };
        let source = c(&source, "the chat template")?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok((
                    c(&m.role, &format!("message {i}'s role"))?,
                    c(&m.content, &format!("message {i}'s content"))?,
                ))
            })
            .collect::<Result<_>>()?;
        let raw: Vec<sys::llama_chat_message> = owned
            .iter()
            .map(|(role, content)| sys::llama_chat_message {
                role: role.as_ptr(),
                content: content.as_ptr(),
            })
            .collect();
        let mut buf = vec![
            0u8;
            messages_cost(messages)
                .saturating_mul(2)
                .saturating_add(256)
                .min(i32::MAX as usize)
        ];
        loop {
            // SAFETY: `source` and every role and content are NUL-terminated strings owned
            // by `source` and `owned`, alive across the call; `raw` has `raw.len()` entries;
            // llama.cpp writes at most `length` (= `buf.len()`) bytes into `buf`.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    source.as_ptr(),
                    raw.as_ptr(),
                    raw.len(),
                    add_assistant,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                )
            };
            if n < 0 {
                return Err(Error::InvalidArgument(match template {
                    ChatTemplate::Model => "llama.cpp does not recognise this model's chat template; name a built-in one".into(),
                    ChatTemplate::Named(name) => format!("chat template {name:?} could not format these messages"),
                }));
            }
            let n = n as usize;
            if n <= buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf).map_err(|_| {
                    Error::Backend("the chat template produced invalid UTF-8".into())
                });
            }
            buf.resize(n, 0);
        }
    }
}
