//! Admission control: a request runs only with a slot of the server, a slot of its
//! plugin and its plugin's llama.cpp threads out of the server's thread budget. Requests
//! wait for those in a bounded queue, each for at most the queue timeout.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What the server as a whole admits.
pub struct Admission {
    slots: Arc<Semaphore>,
    threads: Arc<Semaphore>,
    queued: AtomicU32,
    max_queue: u32,
    timeout: Duration,
}

/// What one plugin admits, within its server's [`Admission`].
pub struct PluginAdmission {
    slots: Arc<Semaphore>,
    threads: u32,
}

/// A running request's share; dropping it gives the slots and threads back.
pub struct Admitted {
    _plugin: OwnedSemaphorePermit,
    _server: OwnedSemaphorePermit,
    _threads: OwnedSemaphorePermit,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// `max_queue` requests are waiting already.
    QueueFull,
    /// No slot came free within the queue timeout.
    Timeout,
}

impl Admission {
    pub fn new(max_concurrent: u32, threads: u32, max_queue: u32, timeout: Duration) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent as usize)),
            threads: Arc::new(Semaphore::new(threads as usize)),
            queued: AtomicU32::new(0),
            max_queue,
            timeout,
        }
    }

    /// Requests waiting now.
    pub fn queued(&self) -> u32 {
        self.queued.load(Relaxed)
    }

    /// What `plugin` needs, at once if it is free, else after waiting in the queue
    /// (first come first served).
    pub async fn admit(&self, plugin: &PluginAdmission) -> Result<Admitted, Refused> {
        if self.queued.load(Relaxed) == 0 {
            if let Some(admitted) = self.try_admit(plugin) {
                return Ok(admitted);
            }
        }
        if self.queued.fetch_add(1, Relaxed) >= self.max_queue {
            self.queued.fetch_sub(1, Relaxed);
            return Err(Refused::QueueFull);
        }
        // Leaves the queue however the wait ends, a dropped wait (the client left)
        // included.
        let _place = QueuePlace(&self.queued);
        let acquire = async {
            // Semaphores are only closed by dropping them, which this borrow prevents.
            let plugin_slot = plugin.slots.clone().acquire_owned().await.ok()?;
            let server_slot = self.slots.clone().acquire_owned().await.ok()?;
            let threads = self.threads.clone().acquire_many_owned(plugin.threads).await.ok()?;
            Some(Admitted { _plugin: plugin_slot, _server: server_slot, _threads: threads })
        };
        match tokio::time::timeout(self.timeout, acquire).await {
            Ok(Some(admitted)) => Ok(admitted),
            Ok(None) | Err(_) => Err(Refused::Timeout),
        }
    }
}

/// A place in the queue, given back when dropped.
struct QueuePlace<'a>(&'a AtomicU32);

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Admission {
    /// Everything at once without waiting, or nothing (what was taken goes back).
    fn try_admit(&self, plugin: &PluginAdmission) -> Option<Admitted> {
        Some(Admitted {
            _plugin: plugin.slots.clone().try_acquire_owned().ok()?,
            _server: self.slots.clone().try_acquire_owned().ok()?,
            _threads: self.threads.clone().try_acquire_many_owned(plugin.threads).ok()?,
        })
    }
}

impl PluginAdmission {
    pub fn new(max_concurrent: u32, threads: u32) -> Self {
        Self { slots: Arc::new(Semaphore::new(max_concurrent as usize)), threads }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn threads_bound_concurrency_and_the_queue_is_bounded() {
        // 2 threads, 2-thread requests: one at a time; one may wait.
        let server = Admission::new(8, 2, 1, Duration::from_millis(50));
        let plugin = PluginAdmission::new(8, 2);
        let first = server.admit(&plugin).await.unwrap();
        let (second, third) = tokio::join!(server.admit(&plugin), async {
            tokio::task::yield_now().await;
            let third = server.admit(&plugin).await;
            drop(first);
            third
        });
        assert_eq!(third.err(), Some(Refused::QueueFull));
        let second = second.unwrap();
        assert_eq!(server.admit(&plugin).await.err(), Some(Refused::Timeout));
        drop(second);
        assert!(server.admit(&plugin).await.is_ok());
        assert_eq!(server.queued(), 0);
    }

    #[tokio::test]
    async fn a_plugin_cap_holds_below_the_servers() {
        let server = Admission::new(8, 8, 8, Duration::from_millis(50));
        let plugin = PluginAdmission::new(1, 1);
        let _running = server.admit(&plugin).await.unwrap();
        assert_eq!(server.admit(&plugin).await.err(), Some(Refused::Timeout));
        assert!(server.admit(&PluginAdmission::new(1, 1)).await.is_ok());
    }

    #[tokio::test]
    async fn a_wait_that_is_dropped_gives_its_place_back() {
        let server = Admission::new(1, 1, 1, Duration::from_secs(60));
        let plugin = PluginAdmission::new(1, 1);
        let running = server.admit(&plugin).await.unwrap();
        for _ in 0..3 {
            // A client that hangs up while it waits: its wait is dropped.
            let waited = tokio::time::timeout(Duration::from_millis(10), server.admit(&plugin)).await;
            assert!(waited.is_err());
            assert_eq!(server.queued(), 0);
        }
        drop(running);
        assert!(server.admit(&plugin).await.is_ok());
    }

    #[tokio::test]
    async fn without_a_queue_a_free_slot_is_still_taken() {
        let server = Admission::new(1, 1, 0, Duration::from_millis(50));
        let plugin = PluginAdmission::new(1, 1);
        let running = server.admit(&plugin).await.unwrap();
        assert_eq!(server.admit(&plugin).await.err(), Some(Refused::QueueFull));
        drop(running);
        assert!(server.admit(&plugin).await.is_ok());
    }
}
