//! The cores, shared by turns. A batching host runs every batch (one per model and seat
//! size) on all of its threads, and contexts of their own beside them, so two of them
//! computing at once would run more ggml threads than there are cores. ggml's threads
//! meet at a spinning barrier after every graph node; oversubscribed, each barrier waits
//! for a descheduled thread, and one step can take a hundred times as long. So each
//! native computation takes the cores for its duration, in turn: first come, first
//! served, which alternates whoever is busy at once and lets one alone take every turn.

use std::sync::{Condvar, Mutex, MutexGuard};

/// Turns on the cores, first come first served (a ticket lock).
#[derive(Default)]
pub struct Cores {
    tickets: Mutex<Tickets>,
    served: Condvar,
}

#[derive(Default)]
struct Tickets {
    /// The next ticket to hand out.
    next: u64,
    /// The ticket whose turn it is.
    serving: u64,
}

/// The cores, held until dropped.
pub struct Turn<'a> {
    cores: &'a Cores,
}

impl Cores {
    /// Wait for the cores, behind everyone who asked before.
    pub fn turn(&self) -> Turn<'_> {
        let mut tickets = self.lock();
        let ticket = tickets.next;
        tickets.next += 1;
        while tickets.serving != ticket {
            tickets = self.served.wait(tickets).unwrap_or_else(|p| p.into_inner());
        }
        Turn { cores: self }
    }

    /// Turns ended so far.
    pub fn served(&self) -> u64 {
        self.lock().serving
    }

    /// Turns asked for and not yet ended (the one held included).
    pub fn waiting(&self) -> u64 {
        let tickets = self.lock();
        tickets.next - tickets.serving
    }

    fn lock(&self) -> MutexGuard<'_, Tickets> {
        // A panic while holding the lock leaves the counters whole (two plain adds).
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.cores.lock().serving += 1;
        self.cores.served.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{mpsc, Arc};

    #[test]
    fn turns_are_served_in_the_order_asked_and_one_at_a_time() {
        let cores = Arc::new(Cores::default());
        let first = cores.turn();
        let (order_tx, order) = mpsc::channel();
        let mut waiters = Vec::new();
        for n in 0..3 {
            // Each asks only once the one before is queued, so the order asked is 0, 1, 2.
            let (mine, order_tx) = (cores.clone(), order_tx.clone());
            waiters.push(std::thread::spawn(move || {
                let _turn = mine.turn();
                order_tx.send(n).unwrap();
            }));
            while cores.waiting() != n + 2 {
                std::thread::yield_now();
            }
        }
        assert!(order.try_recv().is_err(), "nobody runs while the first turn is held");
        drop(first);
        waiters.into_iter().for_each(|w| w.join().unwrap());
        assert_eq!(order.try_iter().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(cores.waiting(), 0);
    }
}
