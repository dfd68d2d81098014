//! The epoch ticker: running wasm yields at every tick, so deadlines and stops fire
//! even in a guest that never calls the host.

use super::*;

/// How often the engine's epoch advances. A plugin running wasm yields to the executor
/// at every tick, so a guest that loops forever holds no executor thread and a run's
/// deadline can always fire.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// The thread that advances an engine's epoch every `EPOCH_TICK`, so running wasm yields
/// and deadlines fire. Shared by the host and every plugin it loaded: a plugin that
/// outlives its host still has its deadlines. Stops when the last holder is dropped.
pub(super) struct EpochTicker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl EpochTicker {
    pub(super) fn start(engine: &Engine) -> std::io::Result<Self> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stopped, engine) = (stop.clone(), engine.clone());
        std::thread::Builder::new().name("llamabox-epoch".into()).spawn(move || {
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(EPOCH_TICK);
                engine.increment_epoch();
            }
        })?;
        Ok(Self { stop })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
