//! The responses kept for `GET /v1/responses/{id}` and `previous_response_id`: in memory,
//! bounded by a count and a byte budget, the oldest evicted first.
//!
//! Invariants: the entries' sizes add up to at most `max_bytes` and their number to at most
//! `max_responses` (an entry larger than the whole budget is not kept at all); an evicted or
//! deleted response that was still running in the background is aborted (its sequences are
//! dropped), so nothing keeps computing a result no one can read.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;
use tokio::task::AbortHandle;

/// How much the store keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most responses kept (0: none is stored, and responses report `store: false`).
    pub max_responses: usize,
    /// Most bytes of JSON kept (responses and the conversations they continue).
    pub max_bytes: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self { max_responses: 1024, max_bytes: 128 << 20 }
    }
}

/// One stored response.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The response object as `GET` returns it.
    pub response: Value,
    /// The items a response continuing this one starts from: the input items (this
    /// response's own `previous_response_id` chain included) then the output items.
    pub conversation: Vec<Value>,
    /// The background task still computing it.
    pub task: Option<AbortHandle>,
}

impl Stored {
    fn bytes(&self) -> usize {
        json_len(&self.response) + self.conversation.iter().map(json_len).sum::<usize>()
    }

    pub fn status(&self) -> &str {
        self.response["status"].as_str().unwrap_or_default()
    }
}

fn json_len(v: &Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, (Stored, usize)>,
    /// Ids, oldest first (ids already removed are skipped when evicting).
    order: VecDeque<String>,
    bytes: usize,
}

pub struct ResponseStore {
    limits: StoreLimits,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(limits: StoreLimits) -> Self {
        Self { limits, inner: Mutex::new(Inner::default()) }
    }

    /// Whether responses are stored at all.
    pub fn enabled(&self) -> bool {
        self.limits.max_responses > 0 && self.limits.max_bytes > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `stored` under `id` (replacing an entry of that id, which keeps its place in
    /// the eviction order); `false` when it is too large to keep.
    pub fn put(&self, id: &str, stored: Stored) -> bool {
        let size = stored.bytes();
        if !self.enabled() || size > self.limits.max_bytes {
            self.remove(id);
            return false;
        }
        let mut inner = self.lock();
        match inner.entries.insert(id.to_owned(), (stored, size)) {
            Some((_, old)) => inner.bytes -= old,
            None => inner.order.push_back(id.to_owned()),
        }
        inner.bytes += size;
        while inner.bytes > self.limits.max_bytes || inner.entries.len() > self.limits.max_responses
        {
            let Some(oldest) = inner.order.pop_front() else { break };
            if oldest == id {
                // The new entry is the only one left over budget: impossible (checked above),
                // but never evict what was just kept.
                inner.order.push_front(oldest);
                break;
            }
            if let Some((evicted, bytes)) = inner.entries.remove(&oldest) {
                inner.bytes -= bytes;
                if let Some(task) = evicted.task {
                    task.abort();
                }
            }
        }
        true
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().entries.get(id).map(|(s, _)| s.clone())
    }

    /// Replaces the entry of `id` with `update(entry)` if it is still there; returns what
    /// `update` returned.
    pub fn update<T>(&self, id: &str, update: impl FnOnce(&mut Stored) -> T) -> Option<T> {
        let mut inner = self.lock();
        let (stored, size) = inner.entries.get_mut(id)?;
        let out = update(stored);
        let (old, new) = (*size, stored.bytes());
        *size = new;
        inner.bytes = inner.bytes - old + new;
        Some(out)
    }

    /// Removes `id` (aborting its background task); whether it was there.
    pub fn remove(&self, id: &str) -> bool {
        let mut inner = self.lock();
        let Some((stored, bytes)) = inner.entries.remove(id) else { return false };
        inner.bytes -= bytes;
        inner.order.retain(|i| i != id);
        if let Some(task) = stored.task {
            task.abort();
        }
        true
    }

    #[cfg(test)]
    fn len_and_bytes(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.entries.len(), inner.bytes)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn entry(text: &str) -> Stored {
        Stored {
            response: json!({"status": "completed"}),
            conversation: vec![json!(text)],
            task: None,
        }
    }

    #[test]
    fn the_oldest_responses_go_first_when_over_either_bound() {
        let store = ResponseStore::new(StoreLimits { max_responses: 2, max_bytes: 1 << 20 });
        for id in ["a", "b", "c"] {
            assert!(store.put(id, entry(id)));
        }
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());

        let one = entry(&"x".repeat(100)).bytes();
        let store = ResponseStore::new(StoreLimits { max_responses: 10, max_bytes: 2 * one + 1 });
        for id in ["a", "b", "c"] {
            assert!(store.put(id, entry(&"x".repeat(100))));
        }
        assert_eq!(store.len_and_bytes(), (2, 2 * one));
        assert!(store.get("a").is_none());
    }

    #[test]
    fn an_entry_larger_than_the_budget_is_not_kept() {
        let store = ResponseStore::new(StoreLimits { max_responses: 10, max_bytes: 50 });
        assert!(store.put("small", entry("s")));
        assert!(!store.put("big", entry(&"x".repeat(100))));
        assert!(store.get("big").is_none() && store.get("small").is_some());
        let off = ResponseStore::new(StoreLimits { max_responses: 0, max_bytes: 50 });
        assert!(!off.enabled() && !off.put("a", entry("s")));
    }

    #[test]
    fn updates_and_removals_keep_the_byte_count() {
        let store = ResponseStore::new(StoreLimits::default());
        store.put("a", entry("s"));
        store.update("a", |s| s.conversation.push(json!("more text")));
        let expected = store.get("a").unwrap().bytes();
        assert_eq!(store.len_and_bytes(), (1, expected));
        assert!(store.remove("a") && !store.remove("a"));
        assert_eq!(store.len_and_bytes(), (0, 0));
    }
}
