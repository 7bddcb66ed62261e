//! A one-line progress bar on stderr (`[#####.....] 32/64 requests, 0 failed`), redrawn in
//! place as requests finish; silent when disabled.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

const WIDTH: usize = 30;

#[derive(Debug)]
pub struct Progress {
    total: usize,
    done: AtomicUsize,
    enabled: bool,
}

impl Progress {
    pub fn new(total: usize, enabled: bool) -> Self {
        let p = Self { total, done: AtomicUsize::new(0), enabled };
        p.draw(0, 0);
        p
    }

    /// One more request finished; `failed` so far.
    pub fn tick(&self, failed: usize) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        self.draw(done, failed);
    }

    pub fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }

    fn draw(&self, done: usize, failed: usize) {
        if !self.enabled {
            return;
        }
        let filled = (done * WIDTH).checked_div(self.total).unwrap_or(WIDTH);
        let bar: String = (0..WIDTH).map(|i| if i < filled { '#' } else { '.' }).collect();
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r[{bar}] {done}/{} requests, {failed} failed", self.total);
        let _ = err.flush();
    }
}
