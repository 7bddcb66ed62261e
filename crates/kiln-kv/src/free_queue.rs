//! The free-block queue: an intrusive, index-linked doubly-linked list over block ids.
//!
//! Order is eviction order: the head is taken first by allocation (least recently used), blocks
//! freed later are appended at the tail. Blocks that hold nothing worth keeping (no cached hash)
//! may be pushed at the head instead so that they are reused before any cached block.
//!
//! Representation: `links[i]` holds the neighbours of block `i`; index `num_blocks` is a single
//! sentinel node (its `next` is the head, its `prev` the tail), so no operation branches on an
//! empty list. A block that is not in the queue has both links set to `NIL`.
//!
//! Invariants (checked by [`FreeBlockQueue::check`]):
//! - following `next` from the sentinel visits exactly `len` blocks and comes back to it;
//! - `links[links[i].next].prev == i` for every node on the ring;
//! - a block is on the ring iff its links are not `NIL`.
//!
//! Complexity: every operation is O(1) and allocates nothing; iteration is O(len).

use kiln_core::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link { prev: NIL, next: NIL };

/// An LRU queue of free blocks with O(1) removal from the middle.
#[derive(Clone, Debug)]
pub struct FreeBlockQueue {
    /// `[num_blocks + 1]`: the last entry is the sentinel.
    links: Vec<Link>,
    len: usize,
}

impl FreeBlockQueue {
    /// An empty queue for blocks `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks for u32 links");
        let sentinel = num_blocks as u32;
        let mut links = vec![UNLINKED; num_blocks + 1];
        links[num_blocks] = Link { prev: sentinel, next: sentinel };
        Self { links, len: 0 }
    }

    /// A queue holding every block, in id order (block 0 is taken first).
    pub fn full(num_blocks: usize) -> Self {
        let mut q = Self::new(num_blocks);
        for i in 0..num_blocks {
            q.push_back(BlockId(i as u32));
        }
        q
    }

    #[inline]
    fn sentinel(&self) -> u32 {
        (self.links.len() - 1) as u32
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `block` is in the queue.
    #[inline]
    pub fn contains(&self, block: BlockId) -> bool {
        self.links[block.index()].next != NIL
    }

    /// The block that `pop_front` would return.
    pub fn front(&self) -> Option<BlockId> {
        let head = self.links[self.sentinel() as usize].next;
        (head != self.sentinel()).then_some(BlockId(head))
    }

    /// Links `block` between `prev` and `next` (which must be adjacent).
    #[inline]
    fn link(&mut self, block: BlockId, prev: u32, next: u32) {
        debug_assert!(!self.contains(block), "{block:?} is already free");
        let i = block.0;
        self.links[i as usize] = Link { prev, next };
        self.links[prev as usize].next = i;
        self.links[next as usize].prev = i;
        self.len += 1;
    }

    /// Appends `block` at the tail (evicted last).
    pub fn push_back(&mut self, block: BlockId) {
        let s = self.sentinel();
        let tail = self.links[s as usize].prev;
        self.link(block, tail, s);
    }

    /// Inserts `block` at the head (taken next).
    pub fn push_front(&mut self, block: BlockId) {
        let s = self.sentinel();
        let head = self.links[s as usize].next;
        self.link(block, s, head);
    }

    /// Removes `block` from wherever it is. Panics if it is not in the queue.
    pub fn remove(&mut self, block: BlockId) {
        let Link { prev, next } = self.links[block.index()];
        assert!(next != NIL, "{block:?} is not in the free queue");
        self.links[prev as usize].next = next;
        self.links[next as usize].prev = prev;
        self.links[block.index()] = UNLINKED;
        self.len -= 1;
    }

    /// Takes the least recently freed block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let head = self.front()?;
        self.remove(head);
        Some(head)
    }

    /// Blocks from head (next to be taken) to tail.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let s = self.sentinel();
        let mut cur = self.links[s as usize].next;
        std::iter::from_fn(move || {
            (cur != s).then(|| {
                let b = BlockId(cur);
                cur = self.links[cur as usize].next;
                b
            })
        })
    }

    /// Verifies the ring structure and the length.
    pub fn check(&self) -> Result<(), String> {
        let s = self.sentinel();
        let mut prev = s;
        let mut cur = self.links[s as usize].next;
        let mut n = 0;
        while cur != s {
            if cur == NIL || cur > s {
                return Err(format!("free queue: bad link {cur} after {prev}"));
            }
            let back = self.links[cur as usize].prev;
            if back != prev {
                return Err(format!("free queue: block {cur} has prev {back}, expected {prev}"));
            }
            n += 1;
            if n > self.len {
                return Err(format!("free queue: more than len={} nodes (cycle?)", self.len));
            }
            prev = cur;
            cur = self.links[cur as usize].next;
        }
        if self.links[s as usize].prev != prev {
            return Err("free queue: sentinel's prev is not the tail".into());
        }
        if n != self.len {
            return Err(format!("free queue: {n} nodes on the ring, len={}", self.len));
        }
        let linked = self.links[..s as usize].iter().filter(|l| l.next != NIL).count();
        if linked != n {
            return Err(format!("free queue: {linked} blocks carry links, {n} on the ring"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &FreeBlockQueue) -> Vec<u32> {
        q.iter().map(|b| b.0).collect()
    }

    #[test]
    fn full_queue_is_in_id_order() {
        let q = FreeBlockQueue::full(4);
        assert_eq!(ids(&q), [0, 1, 2, 3]);
        assert_eq!(q.len(), 4);
        q.check().unwrap();
    }

    #[test]
    fn push_pop_remove_keep_order() {
        let mut q = FreeBlockQueue::full(5);
        q.remove(BlockId(2)); // middle
        q.remove(BlockId(0)); // head
        q.remove(BlockId(4)); // tail
        assert_eq!(ids(&q), [1, 3]);
        q.check().unwrap();
        q.push_back(BlockId(4));
        q.push_front(BlockId(0));
        q.push_back(BlockId(2));
        assert_eq!(ids(&q), [0, 1, 3, 4, 2]);
        assert_eq!(q.pop_front(), Some(BlockId(0)));
        assert!(!q.contains(BlockId(0)));
        assert!(q.contains(BlockId(2)));
        q.check().unwrap();
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.front(), None);
        q.check().unwrap();
    }

    #[test]
    #[should_panic(expected = "not in the free queue")]
    fn removing_a_missing_block_panics() {
        let mut q = FreeBlockQueue::new(3);
        q.remove(BlockId(1));
    }

    #[test]
    fn empty_pool() {
        let mut q = FreeBlockQueue::full(0);
        assert_eq!(q.pop_front(), None);
        q.check().unwrap();
    }
}
