//! Cancel tokens shared by capability: between plugin instances, and with the embedder.
//!
//! A capability is 128 random bits (hex), never a counter another tenant could guess,
//! and it opens only within the group it was shared in. The registry holds tokens
//! weakly: a token lives as long as some instance or the embedder holds it.
//!
//! Every operation is one hash-map lookup under the lock, never a scan: an entry is
//! removed by whoever shared it (a plugin's store removes its own when it ends; the
//! embedder calls [`TokenRegistry::unshare`]), and each group holds at most
//! `max_per_group` entries, so one tenant cannot grow the registry for the others.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::native::{CancelFlag, WeakCancelFlag};

/// Entries one group may hold when the embedder does not choose.
pub const DEFAULT_MAX_PER_GROUP: usize = 4096;

/// The cancel tokens shared now, by capability, each within its group; one per host,
/// so plugins in the same group (and the embedder) can cancel each other's calls.
pub struct TokenRegistry {
    inner: Mutex<Inner>,
    max_per_group: usize,
}

#[derive(Default)]
struct Inner {
    shared: HashMap<String, Shared>,
    per_group: HashMap<String, usize>,
}

struct Shared {
    group: String,
    flag: WeakCancelFlag,
}

/// Why a token could not be shared.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// The group already shares as many tokens as it may (the maximum).
    #[error("max-shared-per-group: this group already shares {0} tokens")]
    GroupFull(usize),
    /// The OS random source failed (its message): no capability can be made.
    #[error("the OS random source failed: {0}")]
    Random(String),
}

impl Default for TokenRegistry {
    fn default() -> Self {
        Self::with_max_per_group(DEFAULT_MAX_PER_GROUP)
    }
}

impl TokenRegistry {
    /// A registry where each group shares at most 4096 tokens at once (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry where each group shares at most `max` tokens at once.
    pub fn with_max_per_group(max: usize) -> Self {
        Self { inner: Mutex::default(), max_per_group: max }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Name `flag` by a fresh capability that opens it within `group`, until
    /// [`unshare`](Self::unshare)d.
    pub fn share(&self, group: &str, flag: &CancelFlag) -> Result<String, ShareError> {
        let mut bits = [0u8; 16];
        getrandom::fill(&mut bits).map_err(|e| ShareError::Random(e.to_string()))?;
        let capability: String = bits.iter().map(|b| format!("{b:02x}")).collect();
        let mut inner = self.lock();
        let count = inner.per_group.entry(group.to_string()).or_default();
        if *count >= self.max_per_group {
            return Err(ShareError::GroupFull(self.max_per_group));
        }
        *count += 1;
        inner.shared.insert(
            capability.clone(),
            Shared { group: group.to_string(), flag: flag.downgrade() },
        );
        Ok(capability)
    }

    /// Forget `capability`: it opens nothing from now on.
    pub fn unshare(&self, capability: &str) {
        let mut inner = self.lock();
        let Some(shared) = inner.shared.remove(capability) else { return };
        if let Some(count) = inner.per_group.get_mut(&shared.group) {
            *count -= 1;
            if *count == 0 {
                inner.per_group.remove(&shared.group);
            }
        }
    }

    /// The token `capability` names, if it was shared in `group` and is still held.
    pub fn open(&self, group: &str, capability: &str) -> Option<CancelFlag> {
        let inner = self.lock();
        inner.shared.get(capability).filter(|s| s.group == group).and_then(|s| s.flag.upgrade())
    }

    /// Tokens `group` shares now.
    pub fn shared_in(&self, group: &str) -> usize {
        self.lock().per_group.get(group).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_open_only_in_their_group_and_only_while_held() {
        let registry = TokenRegistry::new();
        let flag = CancelFlag::new();
        let cap = registry.share("tenant-a", &flag).unwrap();
        assert_eq!(cap.len(), 32, "128 bits in hex");
        assert_ne!(
            cap,
            registry.share("tenant-a", &flag).unwrap(),
            "every share is a fresh capability"
        );
        assert!(registry.open("tenant-a", &cap).unwrap().same_as(&flag));
        assert!(registry.open("tenant-b", &cap).is_none(), "another group cannot open it");
        assert!(registry.open("tenant-a", "00000000000000000000000000000000").is_none());
        drop(flag);
        assert!(registry.open("tenant-a", &cap).is_none(), "a token nobody holds is gone");
    }

    #[test]
    fn each_group_has_its_own_cap_and_unsharing_frees_a_place() {
        let registry = TokenRegistry::with_max_per_group(2);
        let flag = CancelFlag::new();
        let a = registry.share("a", &flag).unwrap();
        registry.share("a", &flag).unwrap();
        assert!(matches!(registry.share("a", &flag), Err(ShareError::GroupFull(2))));
        registry.share("b", &flag).expect("another group is not held back by a full one");
        registry.unshare(&a);
        assert!(registry.open("a", &a).is_none(), "an unshared capability opens nothing");
        registry.share("a", &flag).expect("a place was freed");
        assert_eq!((registry.shared_in("a"), registry.shared_in("b")), (2, 1));
        registry.unshare(&a); // twice: nothing left to remove, counts unchanged
        assert_eq!(registry.shared_in("a"), 2);
    }
}
