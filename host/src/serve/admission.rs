//! Admission: a request runs only with a slot of the server, a slot of its plugin and
//! its plugin's llama.cpp threads out of the server's thread budget. Requests wait for
//! those in one bounded queue, each for at most the queue timeout, and when something
//! frees, the next to run is chosen by [`Fair`]: the highest priority class, then the
//! tenant furthest below its weighted share of what is running, then the earliest
//! deadline. So a tenant that floods the queue waits behind everyone else's first
//! request, instead of ahead of them. A tenant also holds at most its own number of
//! queue places ([`Ask::max_queued`]).
//!
//! Before any of that, each client address may have only so many requests in progress
//! ([`Clients`]): a flood guard, not an identity (see `tenants`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// What one request asks of admission.
#[derive(Clone, Debug)]
pub struct Ask {
    /// Its tenant's name: shares are counted per tenant.
    pub tenant: Arc<str>,
    /// Its tenant's weight: a tenant's fair share of what runs grows with it.
    pub weight: u32,
    /// Its tenant's priority class: a higher class goes before any lower one.
    pub priority: u8,
    /// Queue places its tenant may hold.
    pub max_queued: u32,
    /// When its run will be stopped: of equals, the earliest deadline goes first.
    pub deadline: Instant,
    /// Its plugin's index ([`Admission::add_plugin`]).
    pub plugin: usize,
    /// llama.cpp threads it holds while it runs.
    pub threads: u32,
}

/// What the server as a whole admits.
pub struct Admission {
    state: Mutex<State>,
    max_queue: u32,
    timeout: Duration,
}

/// Everything admission counts, under one lock: a handful of integers and a queue of at
/// most `max_queue`, so each decision is a short scan.
struct State {
    free_slots: u32,
    free_threads: u32,
    /// Free slots of each plugin.
    plugin_slots: Vec<u32>,
    /// Running and queued requests of each tenant that has any.
    tenants: HashMap<Arc<str>, Load>,
    queue: Vec<Waiter>,
    /// Waiters that were granted their share but have not taken it yet.
    granted: HashMap<u64, Ask>,
    next_id: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Load {
    running: u32,
    queued: u32,
}

struct Waiter {
    id: u64,
    ask: Ask,
    grant: oneshot::Sender<()>,
}

/// A running request's share; dropping it gives the slots and threads back and lets
/// the next waiter in.
pub struct Admitted {
    admission: Arc<Admission>,
    ask: Ask,
}

/// Why a request was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// `max_queue` requests are waiting already.
    QueueFull,
    /// The tenant holds its `max_queued` places already (its own doing: 429).
    TenantQueueFull(u32),
    /// No slot came free within the queue timeout.
    Timeout,
}

impl Admission {
    /// A server that runs at most `max_concurrent` requests holding at most `threads`
    /// llama.cpp threads together, with at most `max_queue` waiting, each for at most
    /// `timeout`.
    pub fn new(max_concurrent: u32, threads: u32, max_queue: u32, timeout: Duration) -> Self {
        let state = State {
            free_slots: max_concurrent,
            free_threads: threads,
            plugin_slots: Vec::new(),
            tenants: HashMap::new(),
            queue: Vec::new(),
            granted: HashMap::new(),
            next_id: 0,
        };
        Self { state: Mutex::new(state), max_queue, timeout }
    }

    /// A plugin that may run `max_concurrent` requests at once; its index for [`Ask`].
    pub fn add_plugin(&self, max_concurrent: u32) -> usize {
        let mut state = self.lock();
        state.plugin_slots.push(max_concurrent);
        state.plugin_slots.len() - 1
    }

    /// Change how many requests plugin `index` may run at once (a reload); requests
    /// running over the new number finish, and no new one starts until it fits.
    pub fn set_plugin_slots(&self, index: usize, max_concurrent: u32) {
        if let Some(slots) = self.lock().plugin_slots.get_mut(index) {
            *slots = max_concurrent;
        }
    }

    /// Requests waiting now.
    pub fn queued(&self) -> u32 {
        self.lock().queue.len() as u32
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `ask` needs: at once if it is free and nobody waits, else after waiting in
    /// the queue for its turn ([`Fair`]).
    pub async fn admit(self: &Arc<Self>, ask: Ask) -> Result<Admitted, Refused> {
        let (id, granted) = {
            let mut state = self.lock();
            if state.queue.is_empty() && state.fits(&ask) {
                state.take(&ask);
                return Ok(Admitted { admission: self.clone(), ask });
            }
            let load = state.tenants.get(&ask.tenant).copied().unwrap_or_default();
            if load.queued >= ask.max_queued {
                return Err(Refused::TenantQueueFull(ask.max_queued));
            }
            if state.queue.len() as u32 >= self.max_queue {
                return Err(Refused::QueueFull);
            }
            let (grant, granted) = oneshot::channel();
            let id = state.next_id;
            state.next_id += 1;
            state.tenants.entry(ask.tenant.clone()).or_default().queued += 1;
            state.queue.push(Waiter { id, ask: ask.clone(), grant });
            // It may fit where the first in line does not (another plugin's slots).
            state.dispatch();
            (id, granted)
        };
        // Leaves the queue however the wait ends, a dropped wait (the client left)
        // included; a share granted and never taken goes back.
        let mut place = QueuePlace { admission: self, id, taken: false };
        // A grant that lands as the timeout fires still counts: `granted` decides.
        let _ = tokio::time::timeout(self.timeout, granted).await;
        let taken = self.lock().granted.remove(&id).is_some();
        if !taken {
            return Err(Refused::Timeout);
        }
        place.taken = true;
        Ok(Admitted { admission: self.clone(), ask })
    }
}

/// A request's place in the queue, or the share it was granted, given back when the
/// wait ends without taking it.
struct QueuePlace<'a> {
    admission: &'a Admission,
    id: u64,
    taken: bool,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        if !self.taken {
            self.admission.lock().leave(self.id);
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self.admission.lock();
        state.give_back(&self.ask);
        state.dispatch();
    }
}

impl State {
    /// Whether the shared resources and its plugin's slots hold `ask` now.
    fn fits(&self, ask: &Ask) -> bool {
        self.plugin_has_room(ask) && self.free_slots >= 1 && self.free_threads >= ask.threads
    }

    fn plugin_has_room(&self, ask: &Ask) -> bool {
        self.plugin_slots.get(ask.plugin).is_some_and(|&free| free >= 1)
    }

    fn take(&mut self, ask: &Ask) {
        self.free_slots -= 1;
        self.free_threads -= ask.threads;
        self.plugin_slots[ask.plugin] -= 1;
        self.tenants.entry(ask.tenant.clone()).or_default().running += 1;
    }

    fn give_back(&mut self, ask: &Ask) {
        self.free_slots += 1;
        self.free_threads += ask.threads;
        self.plugin_slots[ask.plugin] += 1;
        self.tenant_changed(&ask.tenant, |load| load.running -= 1);
    }

    /// Waiter `id` gives up its place: it leaves the queue, or, granted but gone before it
    /// took the grant, gives the share back.
    fn leave(&mut self, id: u64) {
        if let Some(at) = self.queue.iter().position(|w| w.id == id) {
            let waiter = self.queue.remove(at);
            self.tenant_changed(&waiter.ask.tenant, |load| load.queued -= 1);
        } else if let Some(ask) = self.granted.remove(&id) {
            self.give_back(&ask);
            self.dispatch();
        }
    }

    /// Change a tenant's load; a tenant with nothing running or queued is forgotten.
    fn tenant_changed(&mut self, tenant: &Arc<str>, change: impl FnOnce(&mut Load)) {
        if let Some(load) = self.tenants.get_mut(tenant) {
            change(load);
            if *load == Load::default() {
                self.tenants.remove(tenant);
            }
        }
    }

    /// Let waiters in, in [`Fair`] order, while what they need is free.
    fn dispatch(&mut self) {
        loop {
            let running = |tenant: &Arc<str>| self.tenants.get(tenant).map_or(0, |l| l.running);
            // Waiters whose plugin is at its own cap are passed over; the first of the
            // rest waits for the shared slots and threads, and nobody overtakes it
            // (a request that needs many threads is not starved by small ones).
            let next = Fair::next(
                self.queue.iter().filter(|w| self.plugin_has_room(&w.ask)).map(|w| (w.id, &w.ask)),
                running,
            );
            let Some(id) = next else { return };
            let at = self.queue.iter().position(|w| w.id == id).expect("picked from the queue");
            if !self.fits(&self.queue[at].ask) {
                return;
            }
            let waiter = self.queue.remove(at);
            self.tenant_changed(&waiter.ask.tenant, |load| load.queued -= 1);
            self.take(&waiter.ask);
            self.granted.insert(waiter.id, waiter.ask);
            // A receiver gone (its wait dropped) finds its grant in `granted` when its
            // place is dropped, and gives it back.
            let _ = waiter.grant.send(());
        }
    }
}

/// The queue's policy, pure: which waiter goes next.
pub struct Fair;

impl Fair {
    /// Of `waiters` (id, ask): the highest priority class; then the tenant with the
    /// fewest requests running per unit of weight; then the earliest deadline; then the
    /// first to arrive (the lowest id).
    pub fn next<'a>(
        waiters: impl Iterator<Item = (u64, &'a Ask)>,
        running: impl Fn(&Arc<str>) -> u32,
    ) -> Option<u64> {
        waiters
            .min_by(|(a_id, a), (b_id, b)| {
                let share =
                    |ask: &Ask| f64::from(running(&ask.tenant)) / f64::from(ask.weight.max(1));
                b.priority
                    .cmp(&a.priority)
                    .then(share(a).total_cmp(&share(b)))
                    .then(a.deadline.cmp(&b.deadline))
                    .then(a_id.cmp(b_id))
            })
            .map(|(id, _)| id)
    }
}

/// Requests in progress per client address, so that no one address can hold every
/// connection's worth of bodies and runs: a flood guard, off or generous by default.
pub struct Clients {
    max: Option<u32>,
    counts: Arc<Mutex<HashMap<String, u32>>>,
}

/// One request's place among its client's; given back when dropped.
pub struct ClientPermit {
    counts: Arc<Mutex<HashMap<String, u32>>>,
    client: String,
}

impl Clients {
    /// At most `max` requests per client at once (`None`: no cap, none counted).
    pub fn new(max: Option<u32>) -> Self {
        Self { max, counts: Arc::new(Mutex::new(HashMap::new())) }
    }

    /// A place for one more request of the client at `address` (`None` when nothing is
    /// counted), or `Err(max)` if it has `max` in progress already.
    pub fn enter(&self, address: IpAddr) -> Result<Option<ClientPermit>, u32> {
        let Some(max) = self.max else { return Ok(None) };
        let client = super::tenants::client_name(address);
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(client.clone()).or_insert(0);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(tenant: &str, plugin: usize, threads: u32) -> Ask {
        Ask {
            tenant: tenant.into(),
            weight: 1,
            priority: 0,
            max_queued: 64,
            deadline: Instant::now() + Duration::from_secs(60),
            plugin,
            threads,
        }
    }

    fn server(slots: u32, threads: u32, queue: u32, timeout_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(slots, threads, queue, Duration::from_millis(timeout_ms)))
    }

    /// A server of one slot and one thread, its one plugin, and `tenant`'s request
    /// running in the slot.
    async fn one_running(
        tenant: &str,
        queue: u32,
        timeout_ms: u64,
    ) -> (Arc<Admission>, usize, Admitted) {
        let server = server(1, 1, queue, timeout_ms);
        let plugin = server.add_plugin(1);
        let running = server.admit(ask(tenant, plugin, 1)).await.unwrap();
        (server, plugin, running)
    }

    #[tokio::test]
    async fn threads_bound_concurrency_and_the_queue_is_bounded() {
        // 2 threads, 2-thread requests: one at a time; one may wait.
        let server = server(8, 2, 1, 50);
        let plugin = server.add_plugin(8);
        let first = server.admit(ask("a", plugin, 2)).await.unwrap();
        let (second, third) = tokio::join!(server.admit(ask("a", plugin, 2)), async {
            tokio::task::yield_now().await;
            let third = server.admit(ask("a", plugin, 2)).await;
            drop(first);
            third
        });
        assert_eq!(third.err(), Some(Refused::QueueFull));
        let second = second.unwrap();
        assert_eq!(server.admit(ask("a", plugin, 2)).await.err(), Some(Refused::Timeout));
        drop(second);
        assert!(server.admit(ask("a", plugin, 2)).await.is_ok());
        assert_eq!(server.queued(), 0);
        assert!(server.lock().tenants.is_empty(), "nothing running, nobody remembered");
    }

    #[tokio::test]
    async fn a_plugin_cap_holds_below_the_servers_and_does_not_block_other_plugins() {
        let server = server(8, 8, 8, 50);
        let (capped, other) = (server.add_plugin(1), server.add_plugin(1));
        let running = server.admit(ask("a", capped, 1)).await.unwrap();
        let (waiting, passed) = tokio::join!(server.admit(ask("a", capped, 1)), async {
            tokio::task::yield_now().await;
            server.admit(ask("a", other, 1)).await
        });
        assert_eq!(waiting.err(), Some(Refused::Timeout));
        assert!(passed.is_ok(), "a waiter of a full plugin holds nobody else up");
        drop(running);
    }

    #[tokio::test]
    async fn a_wait_that_is_dropped_gives_its_place_back() {
        let (server, plugin, running) = one_running("a", 1, 60_000).await;
        for _ in 0..3 {
            // A client that hangs up while it waits: its wait is dropped.
            let waited =
                tokio::time::timeout(Duration::from_millis(10), server.admit(ask("b", plugin, 1)))
                    .await;
            assert!(waited.is_err());
            assert_eq!(server.queued(), 0);
        }
        drop(running);
        assert!(server.admit(ask("a", plugin, 1)).await.is_ok());
    }

    #[tokio::test]
    async fn a_grant_whose_wait_was_dropped_goes_to_the_next() {
        let (server, plugin, running) = one_running("a", 4, 60_000).await;
        // Two waiters: the first is granted when `running` ends but its future is
        // never polled again (dropped), so the grant must pass to the second.
        let mut first = Box::pin(server.admit(ask("b", plugin, 1)));
        assert!(futures_poll(&mut first).is_none());
        let mut second = Box::pin(server.admit(ask("c", plugin, 1)));
        assert!(futures_poll(&mut second).is_none());
        drop(running);
        assert_eq!(server.lock().granted.len(), 1, "the first in line was granted");
        drop(first);
        let admitted = tokio::time::timeout(Duration::from_secs(5), second).await;
        assert!(admitted.unwrap().is_ok());
        assert!(server.lock().granted.is_empty());
    }

    /// Poll a future once.
    fn futures_poll<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::Pin::new(f).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn without_a_queue_a_free_slot_is_still_taken() {
        let (server, plugin, running) = one_running("a", 0, 50).await;
        assert_eq!(server.admit(ask("a", plugin, 1)).await.err(), Some(Refused::QueueFull));
        drop(running);
        assert!(server.admit(ask("a", plugin, 1)).await.is_ok());
    }

    #[tokio::test]
    async fn a_tenant_holds_at_most_its_queue_places_and_others_keep_theirs() {
        let (server, plugin, _running) = one_running("flood", 8, 60_000).await;
        let flood = Ask { max_queued: 2, ..ask("flood", plugin, 1) };
        let mut waits: Vec<_> = (0..2).map(|_| Box::pin(server.admit(flood.clone()))).collect();
        for wait in &mut waits {
            assert!(futures_poll(wait).is_none());
        }
        assert_eq!(server.admit(flood.clone()).await.err(), Some(Refused::TenantQueueFull(2)));
        let mut other = Box::pin(server.admit(ask("other", plugin, 1)));
        assert!(futures_poll(&mut other).is_none(), "another tenant still queues");
        assert_eq!(server.queued(), 3);
    }

    #[test]
    fn the_next_is_the_tenant_furthest_below_its_weighted_share() {
        let at = Instant::now();
        let with = |tenant: &str, weight, priority, deadline_s| Ask {
            weight,
            priority,
            deadline: at + Duration::from_secs(deadline_s),
            ..ask(tenant, 0, 0)
        };
        let running = |counts: &'static [(&'static str, u32)]| {
            move |t: &Arc<str>| counts.iter().find(|(n, _)| *n == t.as_ref()).map_or(0, |c| c.1)
        };
        // A flood: "f" has 3 running and arrived first; "v" has none.
        let queue = [(1, with("f", 1, 0, 10)), (2, with("f", 1, 0, 10)), (3, with("v", 1, 0, 20))];
        let pick = |q: &[(u64, Ask)], r| Fair::next(q.iter().map(|(i, a)| (*i, a)), r);
        assert_eq!(pick(&queue, running(&[("f", 3)])), Some(3));
        // Weights: 3 running at weight 3 is a share of 1, below 2 running at weight 1.
        let weighted = [(1, with("light", 1, 0, 10)), (2, with("heavy", 3, 0, 10))];
        assert_eq!(pick(&weighted, running(&[("light", 2), ("heavy", 3)])), Some(2));
        assert_eq!(pick(&weighted, running(&[("light", 1), ("heavy", 6)])), Some(1));
        // Priority classes first, whatever the shares.
        let classes = [(1, with("v", 1, 0, 10)), (2, with("f", 1, 1, 10))];
        assert_eq!(pick(&classes, running(&[("f", 9)])), Some(2));
        // Equal shares: the earliest deadline, then the first to arrive.
        let equals = [(1, with("a", 1, 0, 30)), (2, with("b", 1, 0, 20)), (3, with("c", 1, 0, 20))];
        assert_eq!(pick(&equals, running(&[])), Some(2));
        assert_eq!(pick(&[], running(&[])), None);
    }

    #[tokio::test]
    async fn a_flooding_tenant_waits_behind_anothers_first_request() {
        let server = server(2, 2, 16, 60_000);
        let plugin = server.add_plugin(2);
        let running = server.admit(ask("flood", plugin, 1)).await.unwrap();
        let _also_running = server.admit(ask("flood", plugin, 1)).await.unwrap();
        let mut floods: Vec<_> =
            (0..5).map(|_| Box::pin(server.admit(ask("flood", plugin, 1)))).collect();
        for wait in &mut floods {
            assert!(futures_poll(wait).is_none());
        }
        let mut victim = Box::pin(server.admit(ask("victim", plugin, 1)));
        assert!(futures_poll(&mut victim).is_none());
        drop(running);
        let victims = futures_poll(&mut victim);
        assert!(matches!(victims, Some(Ok(_))), "the victim goes next");
        for wait in &mut floods {
            assert!(futures_poll(wait).is_none(), "the flood still waits");
        }
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
