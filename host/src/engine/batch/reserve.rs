//! Reservations: the seats and KV cells of a batch that are leased out, and the runs
//! waiting for them. The seats share one pool of cells (llama.cpp's unified KV), and a
//! seat reserves what its context asked for, so a step never runs out of cells for a
//! seat's rows (leftovers are evicted to make room: `sequences.rs`).
//!
//! When the pool is short, a run that holds no native work yet waits here for cells
//! instead of getting a context of its own (which would use memory and cores outside
//! the batch); a run that already holds some takes a context of its own, so that no
//! two runs wait on each other. Waiters are granted in fair order: the group holding
//! the fewest cells per unit of weight first, then the earliest. A group holds at most
//! its share of the seats and of the cells (`BatchPolicy::group_share`), so the rest
//! stays for others whatever one tenant sends.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// What one lease asks for.
#[derive(Clone, Debug)]
pub(super) struct Ask {
    pub group: String,
    pub weight: u32,
    pub cells: u64,
}

/// What a batch can lease: its seats and its cells, and how much of each one group
/// may hold.
#[derive(Clone, Copy, Debug)]
pub(super) struct Capacity {
    pub seats: u32,
    pub cells: u64,
    pub group_seats: u32,
    pub group_cells: u64,
}

impl Capacity {
    /// `seats` and `cells`, of which one group holds at most `share`, rounded up (and
    /// at least one seat's worth of cells, `seat_cells`).
    pub fn new(seats: u32, cells: u64, seat_cells: u64, share: f64) -> Self {
        let share = share.clamp(0.0, 1.0);
        Self {
            seats,
            cells,
            group_seats: ((seats as f64 * share).ceil() as u32).clamp(1.min(seats), seats),
            group_cells: ((cells as f64 * share) as u64).clamp(seat_cells.min(cells), cells),
        }
    }
}

/// Seats and cells held, of the batch or of one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    seats: u32,
    cells: u64,
}

pub(super) struct Reservations {
    capacity: Capacity,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    held: Held,
    groups: HashMap<String, Held>,
    waiting: Vec<Waiter>,
    /// Waiters granted their reservation that have not taken it yet.
    granted: HashMap<u64, Ask>,
    next_ticket: u64,
}

struct Waiter {
    ticket: u64,
    ask: Ask,
    grant: oneshot::Sender<()>,
}

/// How a reservation went.
pub(super) enum Reserved {
    /// Held now.
    Now,
    /// Held once the receiver hears (see [`Reservations::wait`]).
    Later(u64, oneshot::Receiver<()>),
    /// Not here: the ask can never fit, or the run may not wait.
    No,
}

impl Reservations {
    pub fn new(capacity: Capacity) -> Self {
        Self { capacity, state: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserve a seat and `ask.cells`: at once when they are free and nobody waits
    /// ahead, else a place in line when `may_wait`.
    pub fn reserve(&self, ask: Ask, may_wait: bool) -> Reserved {
        if ask.cells > self.capacity.group_cells || self.capacity.seats == 0 {
            return Reserved::No;
        }
        let mut state = self.lock();
        if state.waiting.is_empty() && state.fits(&self.capacity, &ask) {
            state.take(&ask);
            return Reserved::Now;
        }
        if !may_wait {
            return Reserved::No;
        }
        let (grant, granted) = oneshot::channel();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.waiting.push(Waiter { ticket, ask, grant });
        state.dispatch(&self.capacity);
        Reserved::Later(ticket, granted)
    }

    /// Wait for the reservation of `ticket`; whether it is held. If this is dropped
    /// first, its place (or the reservation granted and not taken) goes to the next in
    /// line.
    pub async fn wait(&self, ticket: u64, granted: oneshot::Receiver<()>) -> bool {
        let mut place = Place { reservations: self, ticket, taken: false };
        // A grant's sender is only dropped by a grant or by `Place::drop`.
        let _ = granted.await;
        place.taken = self.lock().granted.remove(&ticket).is_some();
        place.taken
    }

    /// Give back what `ask` reserved, and let the next in line in.
    pub fn release(&self, ask: &Ask) {
        let mut state = self.lock();
        state.give_back(ask);
        state.dispatch(&self.capacity);
    }

    /// Seats reserved now.
    pub fn seats_taken(&self) -> u32 {
        self.lock().held.seats
    }
}

impl State {
    fn group(&self, group: &str) -> Held {
        self.groups.get(group).copied().unwrap_or_default()
    }

    fn group_fits(&self, capacity: &Capacity, ask: &Ask) -> bool {
        let held = self.group(&ask.group);
        held.seats < capacity.group_seats && held.cells + ask.cells <= capacity.group_cells
    }

    fn fits(&self, capacity: &Capacity, ask: &Ask) -> bool {
        self.held.seats < capacity.seats
            && self.held.cells + ask.cells <= capacity.cells
            && self.group_fits(capacity, ask)
    }

    fn take(&mut self, ask: &Ask) {
        self.held.seats += 1;
        self.held.cells += ask.cells;
        let group = self.groups.entry(ask.group.clone()).or_default();
        group.seats += 1;
        group.cells += ask.cells;
    }

    fn give_back(&mut self, ask: &Ask) {
        self.held.seats -= 1;
        self.held.cells -= ask.cells;
        if let Some(group) = self.groups.get_mut(&ask.group) {
            group.seats -= 1;
            group.cells -= ask.cells;
            if *group == Held::default() {
                self.groups.remove(&ask.group);
            }
        }
    }

    /// Grant waiters in fair order while the first in line fits. A waiter whose group
    /// holds its share already is passed over (it waits for its own group's seats),
    /// so it never holds up the others.
    fn dispatch(&mut self, capacity: &Capacity) {
        loop {
            let next = (self.waiting.iter().enumerate())
                .filter(|(_, w)| self.group_fits(capacity, &w.ask))
                .min_by_key(|(_, w)| {
                    let held = self.group(&w.ask.group).cells;
                    // Cells per unit of weight, compared without division.
                    let per_weight = held as u128 * 1_000_000 / w.ask.weight.max(1) as u128;
                    (per_weight, w.ticket)
                })
                .map(|(at, _)| at);
            let Some(at) = next else { return };
            if !self.fits(capacity, &self.waiting[at].ask) {
                return;
            }
            let waiter = self.waiting.remove(at);
            self.take(&waiter.ask);
            self.granted.insert(waiter.ticket, waiter.ask);
            // A waiter that is gone gives it back when its place drops.
            let _ = waiter.grant.send(());
        }
    }
}

/// A waiter's place in line, or the reservation granted to it, given back when the wait
/// ends without taking it.
struct Place<'a> {
    reservations: &'a Reservations,
    ticket: u64,
    taken: bool,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut state = self.reservations.lock();
        if let Some(at) = state.waiting.iter().position(|w| w.ticket == self.ticket) {
            state.waiting.remove(at);
        } else if let Some(ask) = state.granted.remove(&self.ticket) {
            state.give_back(&ask);
        }
        // Either way the line may move: a waiter behind it may fit now.
        state.dispatch(&self.reservations.capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(group: &str, weight: u32, cells: u64) -> Ask {
        Ask { group: group.into(), weight, cells }
    }

    fn now(r: &Reservations, a: Ask) -> bool {
        matches!(r.reserve(a, false), Reserved::Now)
    }

    #[test]
    fn seats_are_sized_by_cells_and_a_group_keeps_to_its_share() {
        // 8 seats, 1000 cells, a group at most half of each.
        let r = Reservations::new(Capacity::new(8, 1000, 100, 0.5));
        assert!(now(&r, ask("a", 1, 300)));
        assert!(now(&r, ask("a", 1, 200)));
        // A third of 100 would put "a" over 500 cells.
        assert!(!now(&r, ask("a", 1, 100)));
        assert!(now(&r, ask("b", 1, 400)));
        // 900 of 1000 held: 200 does not fit for anyone.
        assert!(!now(&r, ask("c", 1, 200)));
        assert!(now(&r, ask("c", 1, 100)));
        // Seats: 4 held of 8, "c" may take 3 more (4 per group), cells permitting.
        r.release(&ask("b", 1, 400));
        for _ in 0..3 {
            assert!(now(&r, ask("c", 1, 100)));
        }
        assert!(!now(&r, ask("c", 1, 0)), "a group holds at most half of the seats");
        assert_eq!(r.seats_taken(), 6);
        // Larger than a group may ever hold: never here, not even by waiting.
        assert!(matches!(r.reserve(ask("d", 1, 501), true), Reserved::No));
    }

    #[tokio::test]
    async fn waiters_go_in_fair_order_and_a_dropped_wait_gives_its_grant_back() {
        let r = Reservations::new(Capacity::new(4, 400, 100, 1.0));
        for _ in 0..4 {
            assert!(now(&r, ask("flood", 1, 100)));
        }
        let Reserved::Later(t1, g1) = r.reserve(ask("flood", 1, 100), true) else { panic!() };
        let Reserved::Later(t2, g2) = r.reserve(ask("victim", 1, 100), true) else { panic!() };
        let Reserved::Later(t3, g3) = r.reserve(ask("heavy", 4, 100), true) else { panic!() };
        // Nobody may jump the line while it waits, even where it fits.
        assert!(!now(&r, ask("late", 1, 0)));
        // The first seat back goes to the victim (no cells held), though it came later.
        r.release(&ask("flood", 1, 100));
        assert!(r.wait(t2, g2).await);
        // The next to "heavy": 0 cells per weight against "flood"'s 300; its wait is
        // dropped after the grant, so the grant passes on to "flood".
        r.release(&ask("flood", 1, 100));
        drop(g3);
        {
            let place = Place { reservations: &r, ticket: t3, taken: false };
            drop(place);
        }
        assert!(r.wait(t1, g1).await);
        assert_eq!(r.seats_taken(), 4);
        let state = r.lock();
        assert_eq!(state.group("flood"), Held { seats: 3, cells: 300 });
        assert_eq!(state.group("heavy"), Held::default());
        assert!(state.waiting.is_empty() && state.granted.is_empty());
    }
}
