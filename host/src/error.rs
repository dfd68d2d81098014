//! The error type of llamabox's embedder API ([`crate::PluginHost`], [`crate::Plugin`]).
//!
//! How a run *ended* is not an error: a plugin's exit status, a deadline and a
//! [`crate::RunStop`] are [`crate::RunOutcome`]s. An `Error` says the plugin could not be
//! loaded or started, or that it was ended by the host for misbehaving (a trap, a limit).

use std::path::PathBuf;

/// What went wrong loading or running a plugin.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// There is no plugin file at this path.
    #[error("plugin {} not found", .0.display())]
    NotFound(PathBuf),
    /// The bytes are not a WebAssembly component this engine can compile (or a
    /// precompiled one for another engine or wasmtime version).
    #[error("the plugin is not a valid WebAssembly component")]
    NotAComponent(#[source] wasmtime::Error),
    /// The plugin imports interfaces or functions this host does not provide (or with
    /// other types), listed by their import names.
    #[error("the plugin imports what this host does not provide: {}", .missing.join(", "))]
    Link {
        /// The import names this host has nothing for.
        missing: Vec<String>,
        /// wasmtime's error from linking.
        #[source]
        source: wasmtime::Error,
    },
    /// The plugin was built against a version of `llamabox:inference` this host does not
    /// link (a later one, or one older than [`crate::OLDEST_WIT_VERSION`]), and needs
    /// what that version has.
    #[error("the plugin was built against {import}, and this host links llamabox:inference {} to {}: rebuild it against one of those", crate::OLDEST_WIT_VERSION, crate::WIT_VERSION)]
    WitVersion {
        /// The first import of another version, as the plugin spells it.
        import: String,
        /// wasmtime's error from linking.
        #[source]
        source: wasmtime::Error,
    },
    /// The plugin imports a llamabox interface its grant withholds (`interface`; `None`
    /// for a llamabox interface this host does not know).
    #[error("it imports {import} but is not granted {} (its grant: {grant})", .interface.map_or("it", |i| i.name()))]
    NotGranted {
        /// The import's name, as the plugin spells it.
        import: String,
        /// The llamabox interface that import is, if this host knows it.
        interface: Option<crate::grant::Interface>,
        /// The grant the plugin was loaded with.
        grant: crate::grant::Grant,
    },
    /// The plugin exports none of `wasi:cli/run` (a WASI 0.2 command), `run`
    /// (`plugin-async`) and `wasi:http/incoming-handler` (`http-plugin`).
    #[error("the plugin exports none of wasi:cli/run (a WASI 0.2 command), `run` (plugin-async) and wasi:http/incoming-handler (http-plugin)")]
    NoEntryPoint(#[source] wasmtime::Error),
    /// The plugin is of another kind than the call wants: an HTTP handler is served
    /// ([`crate::Plugin::serve_http`]), a command is run ([`crate::Plugin::run`]).
    #[error("the plugin is {found}, not {wanted}")]
    WrongKind {
        /// The kind the call needs (`"an HTTP handler"`, say).
        wanted: &'static str,
        /// The kind the plugin is.
        found: &'static str,
    },
    /// The plugin trapped: a wasm trap (`code` says which), or a host function ended it
    /// (a bad resource handle, say; then `code` is `None` and `source` says why).
    #[error("the plugin trapped{}", .code.map(|c| format!(": {c}")).unwrap_or_default())]
    Trap {
        /// The wasm trap code; `None` when a host function ended the plugin.
        code: Option<wasmtime::Trap>,
        /// wasmtime's error the run ended with.
        #[source]
        source: wasmtime::Error,
    },
    /// The plugin went over one of its run's wasm limits (`limit` names it:
    /// `max-memory-mib`, `max-instances`, `max-table-elements`) and was ended.
    /// Limits on inference resources are not errors of the run: the guest gets a
    /// `limit-exceeded` answer and decides.
    #[error("the plugin went over {limit}")]
    Limit {
        /// The limit's name, as in the config (`max-memory-mib`, ...).
        limit: &'static str,
        /// wasmtime's error the run ended with.
        #[source]
        source: wasmtime::Error,
    },
    /// The host could not set itself up (engine settings, the compile-cache folder, a
    /// thread), or a thread it ran work on panicked.
    #[error("host setup failed: {0}")]
    Host(#[source] wasmtime::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The wasm trap code, if the plugin trapped in wasm.
    pub fn trap_code(&self) -> Option<wasmtime::Trap> {
        match self {
            Error::Trap { code, .. } => *code,
            _ => None,
        }
    }
}
