//! Host parallelism for the engine's host work (sampling a step's rows, a draft model's
//! draws): a [`HostParallel`] runs independent tasks on host threads. It is not part of
//! [`crate::Backend`], so a device backend keeps no CPU pool: the CPU backend's thread pool
//! implements it (sampling then shares the kernels' threads), and a GPU backend is paired with
//! [`HostThreads`] (scoped workers spawned per call) by the program that builds the engine.
//!
//! Invariant: every index in `0..num_tasks` runs exactly once, and the call returns after all
//! of them; which thread runs which index is unspecified (tasks are independent).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs independent tasks on host threads (module docs).
pub trait HostParallel: Send + Sync {
    /// Runs `task(i)` for every `i` in `0..num_tasks`, returning once all have run.
    fn host_parallel(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync));
}

/// Every task on the calling thread, in order.
#[derive(Clone, Copy, Debug, Default)]
pub struct Serial;

impl HostParallel for Serial {
    fn host_parallel(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        (0..num_tasks).for_each(task);
    }
}

/// Scoped workers spawned per call, taking task indices from a shared counter; at most
/// `threads` of them, the caller among them.
#[derive(Clone, Copy, Debug)]
pub struct HostThreads {
    threads: usize,
}

impl HostParallel for HostThreads {
    fn host_parallel(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        self.run(num_tasks, task);
    }
}

impl HostThreads {
    /// `threads` workers at most (0 = one per core).
    pub fn new(threads: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        Self { threads: if threads == 0 { cores } else { threads } }
    }

    /// Runs `task(i)` for every `i` in `0..num_tasks`: on the calling thread alone when one
    /// task or one thread, else on up to `threads` scoped workers (the caller among them).
    pub fn run(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        let workers = self.threads.min(num_tasks);
        if workers <= 1 {
            (0..num_tasks).for_each(task);
            return;
        }
        let next = AtomicUsize::new(0);
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= num_tasks {
                    break;
                }
                task(i);
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..workers {
                scope.spawn(work);
            }
            work();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 5] {
            for tasks in [0, 1, 3, 64] {
                let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                HostThreads::new(threads).run(tasks, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{threads} {tasks}");
            }
        }
    }
}
