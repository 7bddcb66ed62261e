//! The forward thread of asynchronous scheduling (`--async-scheduling`): runs one model forward
//! at a time while the engine thread goes on with host work.
//!
//! A [`ForwardJob`] carries the model, the step's batch and its logits buffer to the thread and
//! back, so exactly one thread owns them at any moment: the engine thread between steps, this
//! thread from [`ForwardThread::launch`] until [`ForwardThread::wait`] returns the job. The model
//! never runs two forwards at once (a job is launched only after the previous one came back).
//! A launch yields the launching thread's core, so that a forward thread woken onto it starts
//! before the engine thread's work that overlaps the forward (measured: docs/BENCHMARKS.md).
//!
//! A forward that panics is caught here and comes back as an error with the model, marked
//! `panicked`: the engine then fails every later step (the model's state is unknown), as the
//! synchronous engine's thread would have ended. Dropping the thread's handle lets a running
//! forward finish, then ends the thread.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kiln_models::{ForwardBatch, ForwardError, Logits, StepModel};

/// One forward: what it needs, and once back, how it went.
pub(crate) struct ForwardJob {
    pub model: Box<dyn StepModel>,
    pub batch: ForwardBatch,
    /// `[rows, vocab]`, written by the forward.
    pub logits: Logits,
    /// The forward's result (set on the forward thread).
    pub result: Result<(), ForwardError>,
    /// Wall time of the forward on the forward thread, and when it ended.
    pub elapsed: Duration,
    pub finished_at: Option<Instant>,
    /// The forward panicked (`result` says so too): the model's state is unknown.
    pub panicked: bool,
}

impl ForwardJob {
    /// A forward of `batch` by `model` into `logits`, not yet run.
    pub fn new(model: Box<dyn StepModel>, batch: ForwardBatch, logits: Logits) -> Self {
        Self {
            model,
            batch,
            logits,
            result: Ok(()),
            elapsed: Duration::ZERO,
            finished_at: None,
            panicked: false,
        }
    }
}

/// A thread that runs the forwards handed to it, one at a time.
pub(crate) struct ForwardThread {
    /// `None` once dropping (ends the thread).
    jobs: Option<SyncSender<ForwardJob>>,
    done: Receiver<ForwardJob>,
    thread: Option<JoinHandle<()>>,
}

impl ForwardThread {
    pub fn spawn() -> std::io::Result<Self> {
        let (jobs, job_rx) = sync_channel::<ForwardJob>(1);
        let (done_tx, done) = sync_channel(1);
        let thread = std::thread::Builder::new().name("kiln-forward".into()).spawn(move || {
            for mut job in job_rx {
                let start = Instant::now();
                let ForwardJob { model, batch, logits, .. } = &mut job;
                job.result = catch_unwind(AssertUnwindSafe(|| model.forward(batch, logits)))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(ToString::to_string)
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic".into());
                        job.panicked = true;
                        Err(ForwardError::Device(format!("the forward panicked: {what}")))
                    });
                job.elapsed = start.elapsed();
                job.finished_at = Some(Instant::now());
                if done_tx.send(job).is_err() {
                    return;
                }
            }
        })?;
        Ok(Self { jobs: Some(jobs), done, thread: Some(thread) })
    }

    /// Starts `job`'s forward; hands the job back if the thread has ended.
    pub fn launch(&self, job: ForwardJob) -> Result<(), Box<ForwardJob>> {
        match &self.jobs {
            Some(jobs) => {
                jobs.send(job).map_err(|e| Box::new(e.0))?;
                // The forward thread was just woken, maybe onto this thread's core: let it run
                // before the work that overlaps its forward.
                std::thread::yield_now();
                Ok(())
            }
            None => Err(Box::new(job)),
        }
    }

    /// Waits for the launched job; `None` if the thread has ended (the job is lost with it).
    pub fn wait(&self) -> Option<ForwardJob> {
        self.done.recv().ok()
    }
}

impl Drop for ForwardThread {
    fn drop(&mut self) {
        // A job still running finishes (its result waits in the channel, which has room for
        // it) and the thread ends.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
