//! Models a plugin may open, by name. The embedder registers names and paths; guests
//! only ever see names. Each model is loaded once, on first open, and shared.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::OnceCell;

use crate::native::Model;

#[derive(Default)]
pub struct ModelRegistry {
    models: HashMap<String, Entry>,
    /// Projectors (mmproj files) by name; each media context loads its own copy.
    projectors: HashMap<String, PathBuf>,
}

struct Entry {
    path: PathBuf,
    loaded: OnceCell<Arc<Model>>,
}

/// Why a registered model could not be opened. The path stays in the host's log; the
/// guest sees only the name.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("nothing registered as {0:?}")]
    NotFound(String),
    #[error("{0:?} could not be loaded")]
    LoadFailed(String),
}

impl ModelRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register `path` under `name` (replacing an earlier registration).
    pub fn register(&mut self, name: impl Into<String>, path: impl Into<PathBuf>) -> &mut Self {
        self.models.insert(name.into(), Entry { path: path.into(), loaded: OnceCell::new() });
        self
    }

    /// Register a projector (mmproj) under `name`.
    pub fn register_projector(&mut self, name: impl Into<String>, path: impl Into<PathBuf>) -> &mut Self {
        self.projectors.insert(name.into(), path.into());
        self
    }

    pub fn projector_path(&self, name: &str) -> Result<&PathBuf, OpenError> {
        self.projectors.get(name).ok_or_else(|| OpenError::NotFound(name.to_string()))
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }

    /// The model registered as `name`, loading it on first use (off the async executor).
    pub async fn open(&self, name: &str) -> Result<Arc<Model>, OpenError> {
        let entry = self.models.get(name).ok_or_else(|| OpenError::NotFound(name.to_string()))?;
        let model = entry
            .loaded
            .get_or_try_init(|| async {
                let path = entry.path.clone();
                match tokio::task::spawn_blocking(move || Model::load(&path)).await {
                    Ok(Ok(model)) => Ok(Arc::new(model)),
                    Ok(Err(e)) => {
                        tracing::error!("loading model {name:?} from {}: {e}", entry.path.display());
                        Err(OpenError::LoadFailed(name.to_string()))
                    }
                    Err(join) => {
                        tracing::error!("loading model {name:?} panicked: {join}");
                        Err(OpenError::LoadFailed(name.to_string()))
                    }
                }
            })
            .await?;
        Ok(model.clone())
    }
}
