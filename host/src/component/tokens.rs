//! Cancel tokens shared by capability: between plugin instances, and with the embedder.
//!
//! A capability is 128 random bits (hex), never a counter another tenant could guess,
//! and it opens only within the group it was shared in. The registry holds tokens
//! weakly: a token lives as long as some instance or the embedder holds it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::native::{CancelFlag, WeakCancelFlag};

#[derive(Default)]
pub struct TokenRegistry {
    shared: Mutex<HashMap<String, Shared>>,
}

struct Shared {
    group: String,
    flag: WeakCancelFlag,
}

impl TokenRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Name `flag` by a fresh capability that opens it within `group`. Fails only if the
    /// OS random source does.
    pub fn share(&self, group: &str, flag: &CancelFlag) -> Result<String, getrandom::Error> {
        let mut bits = [0u8; 16];
        getrandom::fill(&mut bits)?;
        let capability: String = bits.iter().map(|b| format!("{b:02x}")).collect();
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        // Forget tokens nobody holds any more, so sharing never grows without bound.
        shared.retain(|_, s| s.flag.upgrade().is_some());
        shared.insert(capability.clone(), Shared { group: group.to_string(), flag: flag.downgrade() });
        Ok(capability)
    }

    /// The token `capability` names, if it was shared in `group` and is still held.
    pub fn open(&self, group: &str, capability: &str) -> Option<CancelFlag> {
        let shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        shared.get(capability).filter(|s| s.group == group).and_then(|s| s.flag.upgrade())
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
        assert_ne!(cap, registry.share("tenant-a", &flag).unwrap(), "every share is a fresh capability");
        assert!(registry.open("tenant-a", &cap).unwrap().same_as(&flag));
        assert!(registry.open("tenant-b", &cap).is_none(), "another group cannot open it");
        assert!(registry.open("tenant-a", "00000000000000000000000000000000").is_none());
        drop(flag);
        assert!(registry.open("tenant-a", &cap).is_none(), "a token nobody holds is gone");
    }
}
