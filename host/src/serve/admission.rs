//! Admission control: a request runs only with a slot of the server, a slot of its
//! plugin and its plugin's llama.cpp threads out of the server's thread budget. Requests
//! wait for those in a bounded queue, each for at most the queue timeout. Before any of
//! that, each client may have only so many requests in progress ([`Clients`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
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

/// Requests in progress per client, so that no one client can hold every slot (or fill
/// the queue ahead of everyone else).
pub struct Clients {
    max: Option<u32>,
    counts: Arc<Mutex<HashMap<IpAddr, u32>>>,
}

/// One request's place among its client's; given back when dropped.
pub struct ClientPermit {
    counts: Arc<Mutex<HashMap<IpAddr, u32>>>,
    client: IpAddr,
}

impl Clients {
    /// At most `max` requests per client at once (`None`: no cap, none counted).
    pub fn new(max: Option<u32>) -> Self {
        Self { max, counts: Arc::new(Mutex::new(HashMap::new())) }
    }

    /// A place for one more request of `peer` (`None` when nothing is counted), or
    /// `Err(max)` if it has `max` in progress already.
    pub fn enter(&self, peer: IpAddr) -> Result<Option<ClientPermit>, u32> {
        let Some(max) = self.max else { return Ok(None) };
        let client = client_of(peer);
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(client).or_insert(0);
        if *count >= max {
            return Err(max);
        }
        *count += 1;
        Ok(Some(ClientPermit { counts: self.counts.clone(), client }))
    }

    /// Clients with a request in progress now.
    pub fn active(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for ClientPermit {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

/// Who a peer address is, as a client: an IPv4 address (IPv4-mapped IPv6 included), or
/// an IPv6 /64, the block one host or home network is given (any address in it is as
/// easy for that client to use as the next).
fn client_of(peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
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
            let waited =
                tokio::time::timeout(Duration::from_millis(10), server.admit(&plugin)).await;
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

    #[test]
    fn each_client_has_its_own_cap_and_gets_its_places_back() {
        let clients = Clients::new(Some(2));
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let first = clients.enter(a).unwrap();
        let _second = clients.enter(a).unwrap();
        assert_eq!(clients.enter(a).err(), Some(2), "a third of a's is refused");
        assert!(clients.enter(b).unwrap().is_some(), "b is not a");
        drop(first);
        let _again = clients.enter(a).expect("a's place came back");
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().unwrap();
        assert!(clients.enter(mapped).is_err(), "an IPv4-mapped address is its IPv4 client");
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        let (_x, _y) = (
            clients.enter(v6("2001:db8:1:2::1")).unwrap(),
            clients.enter(v6("2001:db8:1:2::ffff")).unwrap(),
        );
        assert!(clients.enter(v6("2001:db8:1:2:abcd::1")).is_err(), "one /64 is one client");
        assert!(clients.enter(v6("2001:db8:1:3::1")).is_ok());
        assert!(Clients::new(None).enter(a).unwrap().is_none(), "no cap: nothing counted");
    }

    #[test]
    fn a_client_whose_requests_all_ended_is_forgotten() {
        let clients = Clients::new(Some(1));
        let permit = clients.enter("127.0.0.2".parse().unwrap()).unwrap();
        assert_eq!(clients.active(), 1);
        drop(permit);
        assert_eq!(clients.active(), 0);
    }
}
