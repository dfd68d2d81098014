//! Models a plugin may open, by name. The embedder registers names and paths; guests
//! only ever see names. Each model is loaded once, on first open, and shared.
//!
//! The registry is live: the embedder adds, replaces and unloads entries while runs go
//! on (it is shared as `Arc<ModelRegistry>`, see `PluginHost::models`). A run that
//! opened a model holds an `Arc` to it, so replacing or unloading a name changes what
//! the *next* `open` finds; the old weights stay loaded until the last model handle and
//! context using them are gone.
//!
//! Each entry also keeps the contexts runs left idle on its model
//! ([`ModelRegistry::keep_idle_contexts`], off by default; see `idle.rs`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tokio::sync::OnceCell;

use super::batch::{BatchPolicy, BatchPool};
use super::idle::IdleContexts;
use crate::native::{Model, Offload};

/// The models and projectors plugins may open, by name, each loaded once on first open
/// and shared by every run; the embedder changes it while runs go on.
#[derive(Default)]
pub struct ModelRegistry {
    inner: RwLock<Inner>,
    /// Idle contexts each loaded model keeps (shared with subsets and every entry).
    keep_idle: Arc<AtomicUsize>,
    /// How one-sequence contexts are batched (shared with subsets); `None`: they are not.
    batch: Arc<RwLock<Option<BatchPolicy>>>,
    /// Where models loaded from now on put their layers (shared with subsets).
    offload: Arc<RwLock<Offload>>,
}

#[derive(Default)]
struct Inner {
    models: HashMap<String, Arc<Registration>>,
    /// Projectors (mmproj files) by name; each media context loads its own copy.
    projectors: HashMap<String, PathBuf>,
}

/// One registration. Replacing a name makes a new entry, so an `open` racing with the
/// replacement loads either the old file or the new one, never a mix.
struct Registration {
    path: PathBuf,
    loaded: OnceCell<Arc<Model>>,
    /// Contexts on this entry's model that runs left for later runs.
    idle: Arc<IdleContexts>,
    /// The shared contexts batching this entry's model.
    batch: Arc<BatchPool>,
}

/// A model opened through the registry, with the engine's state for it.
#[derive(Clone)]
pub struct Opened {
    pub model: Arc<Model>,
    pub(crate) idle: Arc<IdleContexts>,
    pub(crate) batch: Arc<BatchPool>,
    /// The registry's batching policy when it was opened.
    pub(crate) policy: Option<BatchPolicy>,
}

/// Why a registered model could not be opened. The path stays in the host's log; the
/// guest sees only the name.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No model or projector is registered under this name.
    #[error("nothing registered as {0:?}")]
    NotFound(String),
    /// The file registered under this name did not load (the log says why).
    #[error("{0:?} could not be loaded")]
    LoadFailed(String),
}

impl std::fmt::Debug for ModelRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.read();
        f.debug_struct("ModelRegistry")
            .field("models", &inner.models.keys().collect::<Vec<_>>())
            .field("projectors", &inner.projectors.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ModelRegistry {
    /// An empty registry: no models, no idle contexts kept, no batching.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Register `path` under `name`, replacing an earlier registration: runs that
    /// already opened the old model keep it; later opens load `path`.
    pub fn register(&self, name: impl Into<String>, path: impl Into<PathBuf>) -> &Self {
        let idle = Arc::new(IdleContexts::new(self.keep_idle.clone()));
        let entry = Arc::new(Registration {
            path: path.into(),
            loaded: OnceCell::new(),
            idle,
            batch: Arc::default(),
        });
        self.write().models.insert(name.into(), entry);
        self
    }

    /// Keep up to `n` contexts per model that runs dropped (0, the default: free each
    /// at once), for later runs of the same group that ask for the same settings: they
    /// skip creating a context and recompute only the part of their prompt that differs
    /// from the last one's. Each idle context holds its memory (KV cache and compute
    /// buffers) and a sleeping thread. Lowering it frees the extra ones now. Subsets
    /// share this setting with the registry they came from.
    pub fn keep_idle_contexts(&self, n: usize) -> &Self {
        self.keep_idle.store(n, Relaxed);
        for entry in self.read().models.values() {
            entry.idle.shrink();
        }
        self
    }

    /// Batch one-sequence contexts by `policy` (`None`, the default: every context is
    /// a native context of its own). Contexts made later follow it; a plugin sees the
    /// same WIT semantics either way (see `engine::batch`). Subsets share the setting.
    pub fn batch(&self, policy: Option<BatchPolicy>) -> &Self {
        *self.batch.write().unwrap_or_else(|p| p.into_inner()) = policy;
        self
    }

    /// Put the layers of models loaded from now on where `offload` says (the default:
    /// every layer on the first GPU when there is one). Host policy: plugins never
    /// choose a device. Models already loaded stay where they are.
    pub fn offload(&self, offload: Offload) -> &Self {
        *self.offload.write().unwrap_or_else(|p| p.into_inner()) = offload;
        self
    }

    /// The batching policy in force.
    pub fn batch_policy(&self) -> Option<BatchPolicy> {
        self.batch.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Seats of batched contexts leased now, over every model registered here.
    pub fn batch_seats_taken(&self) -> u32 {
        self.read().models.values().map(|entry| entry.batch.seats_taken()).sum()
    }

    /// Contexts kept idle now, over every model registered here.
    pub fn idle_contexts(&self) -> usize {
        self.read().models.values().map(|entry| entry.idle.len()).sum()
    }

    /// Forget `name`: later opens get not-found. Returns whether it was registered.
    /// Its weights are freed once no model handle or context holds them.
    pub fn unload(&self, name: &str) -> bool {
        self.write().models.remove(name).is_some()
    }

    /// Register a projector (mmproj) under `name`, replacing an earlier one. Each media
    /// context loads its own copy, so this affects only media contexts made later.
    pub fn register_projector(&self, name: impl Into<String>, path: impl Into<PathBuf>) -> &Self {
        self.write().projectors.insert(name.into(), path.into());
        self
    }

    /// Forget the projector `name`. Returns whether it was registered.
    pub fn unload_projector(&self, name: &str) -> bool {
        self.write().projectors.remove(name).is_some()
    }

    /// The file registered as the projector `name` (each media context loads its own
    /// copy from it).
    pub fn projector_path(&self, name: &str) -> Result<PathBuf, OpenError> {
        self.read()
            .projectors
            .get(name)
            .cloned()
            .ok_or_else(|| OpenError::NotFound(name.to_string()))
    }

    /// A registry of the models and projectors named in `names` that are registered
    /// here now, sharing their weights: a model loaded through either is loaded once.
    /// For runs that may open only some models ([`crate::RunOptions::models`]).
    pub fn subset<S: AsRef<str>>(&self, names: &[S]) -> ModelRegistry {
        let inner = self.read();
        let pick = |name: &S| name.as_ref().to_string();
        let subset = Inner {
            models: names
                .iter()
                .filter_map(|n| Some((pick(n), inner.models.get(n.as_ref())?.clone())))
                .collect(),
            projectors: names
                .iter()
                .filter_map(|n| Some((pick(n), inner.projectors.get(n.as_ref())?.clone())))
                .collect(),
        };
        ModelRegistry {
            inner: RwLock::new(subset),
            keep_idle: self.keep_idle.clone(),
            batch: self.batch.clone(),
            offload: self.offload.clone(),
        }
    }

    /// Names registered now.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.read().models.keys().cloned().collect();
        names.sort();
        names
    }

    /// Whether the model registered as `name` is loaded now (opened since it was
    /// registered).
    pub fn is_loaded(&self, name: &str) -> bool {
        self.read().models.get(name).is_some_and(|entry| entry.loaded.initialized())
    }

    /// The model registered as `name`, loading it on first use (off the async executor).
    pub async fn open(&self, name: &str) -> Result<Arc<Model>, OpenError> {
        self.open_entry(name).await.map(|opened| opened.model)
    }

    /// [`ModelRegistry::open`], with the engine's idle contexts and batches on that model.
    pub async fn open_entry(&self, name: &str) -> Result<Opened, OpenError> {
        // The lock is not held across the load: the entry is shared, so a replacement
        // or unload meanwhile does not wait for it.
        let entry = self
            .read()
            .models
            .get(name)
            .cloned()
            .ok_or_else(|| OpenError::NotFound(name.to_string()))?;
        let model = entry
            .loaded
            .get_or_try_init(|| async {
                let path = entry.path.clone();
                let offload = self.offload.read().unwrap_or_else(|p| p.into_inner()).clone();
                // llama.cpp's load log goes to the span of the run that loads it.
                let span = tracing::Span::current();
                match tokio::task::spawn_blocking(move || {
                    span.in_scope(|| Model::load_with(&path, &offload))
                })
                .await
                {
                    Ok(Ok(model)) => Ok(Arc::new(model)),
                    Ok(Err(e)) => {
                        tracing::error!(
                            "loading model {name:?} from {}: {e}",
                            entry.path.display()
                        );
                        Err(OpenError::LoadFailed(name.to_string()))
                    }
                    Err(join) => {
                        tracing::error!("loading model {name:?} panicked: {join}");
                        Err(OpenError::LoadFailed(name.to_string()))
                    }
                }
            })
            .await?;
        Ok(Opened {
            model: model.clone(),
            idle: entry.idle.clone(),
            batch: entry.batch.clone(),
            policy: self.batch_policy(),
        })
    }
}
