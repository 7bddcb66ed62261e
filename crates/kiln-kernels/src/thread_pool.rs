//! A persistent fork-join thread pool for kernels.
//!
//! `run(num_tasks, f)` calls `f(task)` once for every `task in 0..num_tasks`, spread over the
//! pool's workers and the calling thread, and returns when all calls have finished. Tasks are
//! handed out by an atomic counter, so uneven tasks balance themselves.
//!
//! Workers spin briefly between jobs (a decode step issues hundreds of small jobs back to back,
//! and waking a parked thread costs tens of microseconds), then park on a condition variable.
//! No allocation happens per job. A panic in a task is caught on the worker and re-raised on
//! the calling thread. Calls from several threads are serialised; a nested `run` from inside a
//! task runs inline on the calling worker.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

/// Spin iterations before a worker parks (a few milliseconds of `pause`).
const SPIN_LIMIT: u32 = 20_000;

type Job = *const (dyn Fn(usize) + Sync + 'static);

struct Shared {
    /// Bumped once per job; workers run a job when they see a new value.
    epoch: AtomicU64,
    /// The current job; written before `epoch` is bumped, read after it is observed.
    job: Mutex<Option<SendJob>>,
    num_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Workers that have not yet finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

#[derive(Clone, Copy)]
struct SendJob(Job);
// SAFETY: the pointee is `Sync`, and `run` keeps it alive until every worker is done with it.
unsafe impl Send for SendJob {}

thread_local! {
    static IN_POOL_TASK: Cell<bool> = const { Cell::new(false) };
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    dispatch: Mutex<()>,
}

impl ThreadPool {
    /// A pool with `num_threads` threads in all, the caller included (`0` means all cores).
    pub fn new(num_threads: usize) -> Self {
        let num_threads = if num_threads == 0 {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        } else {
            num_threads
        };
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            num_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..num_threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("kiln-worker-{i}"))
                    .spawn(move || worker_loop(&shared))
                    .unwrap_or_else(|e| panic!("cannot spawn kernel worker thread: {e}"))
            })
            .collect();
        Self { shared, workers, dispatch: Mutex::new(()) }
    }

    /// Threads that execute tasks, the caller included.
    pub fn num_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(task)` for every task in `0..num_tasks`; returns when all have run.
    pub fn run<F: Fn(usize) + Sync>(&self, num_tasks: usize, f: F) {
        if num_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || num_tasks == 1 || IN_POOL_TASK.with(Cell::get) {
            (0..num_tasks).for_each(f);
            return;
        }
        let _guard = self.dispatch.lock().unwrap_or_else(PoisonError::into_inner);
        let shared = &*self.shared;
        let job: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: the lifetime is erased only for the duration of this call: we wait below until
        // `pending == 0`, after which no worker touches the job again, and we clear it.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        *shared.job.lock().unwrap_or_else(PoisonError::into_inner) = Some(SendJob(job));
        shared.num_tasks.store(num_tasks, Ordering::Relaxed);
        shared.next_task.store(0, Ordering::Relaxed);
        shared.pending.store(self.workers.len(), Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            shared.wake.notify_all();
        }
        IN_POOL_TASK.with(|c| c.set(true));
        let result = catch_unwind(AssertUnwindSafe(|| run_tasks(shared, &f)));
        IN_POOL_TASK.with(|c| c.set(false));
        while shared.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *shared.job.lock().unwrap_or_else(PoisonError::into_inner) = None;
        if let Err(payload) = result {
            std::panic::resume_unwind(payload);
        }
        assert!(
            !shared.panicked.swap(false, Ordering::AcqRel),
            "a kernel task panicked on a worker thread"
        );
    }
}

fn run_tasks(shared: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let num_tasks = shared.num_tasks.load(Ordering::Relaxed);
    loop {
        let task = shared.next_task.fetch_add(1, Ordering::Relaxed);
        if task >= num_tasks {
            break;
        }
        f(task);
    }
}

fn worker_loop(shared: &Shared) {
    IN_POOL_TASK.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                break;
            }
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            if spins < SPIN_LIMIT {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let lock = shared.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            if shared.epoch.load(Ordering::SeqCst) == seen
                && !shared.shutdown.load(Ordering::SeqCst)
            {
                drop(shared.wake.wait(lock).unwrap_or_else(PoisonError::into_inner));
            } else {
                drop(lock);
            }
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        let job = *shared.job.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(SendJob(job)) = job {
            // SAFETY: `run` keeps the closure alive until `pending` reaches zero, which happens
            // only after this worker's decrement below.
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| run_tasks(shared, f))).is_err() {
                shared.panicked.store(true, Ordering::Release);
            }
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The engine's host work (sampling) runs on the kernels' threads.
impl kiln_backend::HostParallel for ThreadPool {
    fn host_parallel(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        self.run(num_tasks, task);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _lock = self.shared.sleep_lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A raw pointer that tasks may share to write disjoint parts of one output buffer.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(*mut T);
// SAFETY: users only write disjoint index ranges from different tasks (stated at each use).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(slice: &mut [T]) -> Self {
        Self(slice.as_mut_ptr())
    }

    /// A placeholder that must be replaced before use.
    pub fn dangling() -> Self {
        Self(std::ptr::NonNull::dangling().as_ptr())
    }

    /// The base pointer, for kernels that take raw pointers and strides.
    pub fn ptr(&self) -> *mut T {
        self.0
    }

    /// The same memory from element `offset` on.
    ///
    /// # Safety
    /// `offset` must be in bounds of the original slice (or its end).
    #[must_use]
    pub unsafe fn at(&self, offset: usize) -> Self {
        // SAFETY: guaranteed by the caller.
        Self(unsafe { self.0.add(offset) })
    }

    /// # Safety
    /// `offset..offset + len` must be in bounds of the original slice, and no other task may
    /// access that range while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &mut [T] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once_across_many_jobs() {
        let pool = ThreadPool::new(3);
        for num_tasks in [1usize, 2, 7, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..num_tasks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.run(num_tasks, |t| {
                    counts[t].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 50));
        }
    }

    #[test]
    fn nested_run_executes_inline_and_panics_propagate() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        pool.run(4, |_| {
            pool.run(3, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, |t| assert!(t != 5, "boom"));
        }));
        assert!(result.is_err());
        // The pool still works after a panic.
        let after = AtomicUsize::new(0);
        pool.run(8, |_| {
            after.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(after.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let n = AtomicUsize::new(0);
        pool.run(100, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 100);
    }
}
