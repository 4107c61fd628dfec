//! Evidence states kept across requests: the sequence state at a request's branch point (the attention
//! K/V rows and the DeltaNet conv and recurrent state after the evidence), keyed by the exact token
//! prefix, least recently used out first within a token budget and a byte budget.
//!
//! A hit gives the very state a miss would compute (the model's states are a function of the token
//! prefix alone), so on the exact paths an answer's bits do not depend on the cache.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Limits of the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheLimits {
    /// Most tokens kept, summed over entries (`--prefix-cache-tokens`); 0 turns the cache off.
    pub max_tokens: usize,
    /// Most bytes kept, summed over entries' states (`--prefix-cache-bytes`).
    pub max_bytes: u64,
}

/// Counters of the prefix cache (`/stats`'s `prefix_cache` object).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixCacheStats {
    /// Lookups that found their prefix.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Tokens held now (sum of entries' prefix lengths).
    pub cached_tokens: u64,
    /// Bytes held now (sum of entries' state sizes).
    pub bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// Entries dropped to make room.
    pub evictions: u64,
    /// Prompt tokens not computed thanks to hits.
    pub tokens_saved: u64,
    /// States not kept because alone they exceed a budget.
    pub too_large: u64,
}

struct Entry<S> {
    state: S,
    bytes: u64,
    last_used: u64,
}

/// The cache. Not thread-safe by itself: the engine's step loop owns it.
pub struct PrefixCache<S> {
    limits: PrefixCacheLimits,
    entries: HashMap<Arc<[u32]>, Entry<S>>,
    /// `last_used` tick → key, oldest first.
    order: BTreeMap<u64, Arc<[u32]>>,
    tick: u64,
    stats: PrefixCacheStats,
}

impl<S: Clone> PrefixCache<S> {
    pub fn new(limits: PrefixCacheLimits) -> Self {
        PrefixCache {
            limits,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn limits(&self) -> PrefixCacheLimits {
        self.limits
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    fn touch(&mut self, key: &Arc<[u32]>) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(entry) = self.entries.get_mut(key) {
            self.order.remove(&entry.last_used);
            entry.last_used = tick;
            self.order.insert(tick, key.clone());
        }
    }

    /// The state after exactly `key`'s tokens, if kept; counts a hit or a miss.
    pub fn lookup(&mut self, key: &Arc<[u32]>) -> Option<S> {
        if self.limits.max_tokens == 0 {
            return None;
        }
        match self.entries.get(key) {
            Some(entry) => {
                let state = entry.state.clone();
                self.stats.hits += 1;
                self.stats.tokens_saved += key.len() as u64;
                self.touch(key);
                Some(state)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Whether `key` is kept (no counting, no reordering).
    pub fn contains(&self, key: &[u32]) -> bool {
        self.entries.contains_key(key)
    }

    /// Keeps `state` as the state after `key`'s tokens, evicting the least recently used entries until
    /// both budgets hold. A state that alone exceeds a budget is not kept.
    pub fn insert(&mut self, key: Arc<[u32]>, state: S, bytes: usize) {
        let tokens = key.len();
        let bytes = bytes as u64;
        if self.limits.max_tokens == 0 || tokens == 0 {
            return;
        }
        if tokens > self.limits.max_tokens || bytes > self.limits.max_bytes {
            self.stats.too_large += 1;
            return;
        }
        if self.entries.contains_key(&key) {
            self.touch(&key);
            return;
        }
        while self.stats.cached_tokens + tokens as u64 > self.limits.max_tokens as u64
            || self.stats.bytes + bytes > self.limits.max_bytes
        {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(old) = self.entries.remove(&oldest) {
                self.stats.cached_tokens -= oldest.len() as u64;
                self.stats.bytes -= old.bytes;
                self.stats.entries -= 1;
                self.stats.evictions += 1;
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key.clone());
        self.entries.insert(
            key,
            Entry {
                state,
                bytes,
                last_used: self.tick,
            },
        );
        self.stats.cached_tokens += tokens as u64;
        self.stats.bytes += bytes;
        self.stats.entries += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tokens: &[u32]) -> Arc<[u32]> {
        tokens.into()
    }

    #[test]
    fn least_recently_used_goes_first_within_both_budgets() {
        let mut cache = PrefixCache::new(PrefixCacheLimits {
            max_tokens: 10,
            max_bytes: 1000,
        });
        cache.insert(key(&[1, 2, 3, 4]), "a", 100);
        cache.insert(key(&[5, 6, 7, 8]), "b", 100);
        assert_eq!(cache.lookup(&key(&[1, 2, 3, 4])), Some("a"));
        assert_eq!(cache.lookup(&key(&[1, 2, 3])), None);
        // 4 + 4 + 4 > 10 tokens: the least recently used ("b") goes.
        cache.insert(key(&[9, 9, 9, 9]), "c", 100);
        assert!(cache.contains(&[1, 2, 3, 4]));
        assert!(!cache.contains(&[5, 6, 7, 8]));
        assert!(cache.contains(&[9, 9, 9, 9]));
        let stats = cache.stats();
        assert_eq!(
            (
                stats.hits,
                stats.misses,
                stats.evictions,
                stats.cached_tokens,
                stats.bytes
            ),
            (1, 1, 1, 8, 200)
        );
        assert_eq!(stats.tokens_saved, 4);
        // The byte budget binds too.
        // The byte budget binds too: 200 + 850 > 1000, so the least recently used ("a") goes.
        cache.insert(key(&[7]), "d", 850);
        assert!(!cache.contains(&[1, 2, 3, 4]));
        assert_eq!(cache.stats().entries, 2);
        assert_eq!(cache.stats().bytes, 950);
        // Too large alone: not kept, nothing evicted.
        cache.insert(key(&[1; 11]), "e", 1);
        assert_eq!(cache.stats().too_large, 1);
        assert!(cache.contains(&[7]));
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut cache = PrefixCache::new(PrefixCacheLimits {
            max_tokens: 0,
            max_bytes: 1 << 30,
        });
        cache.insert(key(&[1, 2]), 1, 1);
        assert_eq!(cache.lookup(&key(&[1, 2])), None);
        assert_eq!(cache.stats().entries, 0);
    }
}
