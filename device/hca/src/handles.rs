//! Handle numbering for device objects: monotonic, never reused while the device lives, bounded by a table size.
//! Never reusing a handle lets a stale handle be told apart from a live one in every log line.

/// Hands out handles from `first` upwards; refuses when `max_live` objects exist or the numbers run out.
#[derive(Debug)]
pub struct HandleAllocator {
    next: u32,
    live: u32,
    max_live: u32,
}

impl HandleAllocator {
    pub fn new(first: u32, max_live: u32) -> HandleAllocator {
        HandleAllocator { next: first, live: 0, max_live }
    }

    pub fn allocate(&mut self) -> Option<u32> {
        if self.live >= self.max_live || self.next == u32::MAX {
            return None;
        }
        let handle = self.next;
        self.next += 1;
        self.live += 1;
        Some(handle)
    }

    pub fn release(&mut self) {
        self.live = self.live.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_never_reused() {
        let mut h = HandleAllocator::new(5, 2);
        assert_eq!(h.allocate(), Some(5));
        assert_eq!(h.allocate(), Some(6));
        assert_eq!(h.allocate(), None);
        h.release();
        assert_eq!(h.allocate(), Some(7));
    }
}
