//! A [`GrammarCompiler`] that may still be being built: building one walks the whole
//! vocabulary into a trie (most of a second for a 262k-token vocabulary), which need not delay
//! a server's start. Whoever needs the compiler first waits for it; the build runs once.

use std::sync::{Arc, OnceLock};

use super::GrammarCompiler;

/// The outcome of the build: the compiler, or why this model has none.
type Built = Result<Arc<GrammarCompiler>, String>;

/// A shared handle on a compiler built now or on a background thread.
#[derive(Clone)]
pub struct PendingCompiler(Arc<OnceLock<Built>>);

impl PendingCompiler {
    /// A compiler that is already built.
    pub fn ready(compiler: Arc<GrammarCompiler>) -> Self {
        Self(Arc::new(OnceLock::from(Ok(compiler))))
    }

    /// Runs `build` on a new thread; [`PendingCompiler::wait`] blocks until it is done. If no
    /// thread can be started, the outcome is that error.
    pub fn build_in_background<F>(build: F) -> Self
    where
        F: FnOnce() -> Built + Send + 'static,
    {
        let cell = Arc::new(OnceLock::new());
        let slot = Arc::clone(&cell);
        let spawned =
            std::thread::Builder::new().name("kiln-grammar-trie".into()).spawn(move || {
                let _ = slot.set(build());
            });
        if let Err(e) = spawned {
            let _ = cell.set(Err(format!("could not start the grammar compiler's thread: {e}")));
        }
        Self(cell)
    }

    /// The compiler, waiting for its build if it is still running.
    pub fn wait(&self) -> Result<&Arc<GrammarCompiler>, &str> {
        self.0.wait().as_ref().map_err(String::as_str)
    }

    /// The compiler if its build has finished (`None` while it runs).
    pub fn get(&self) -> Option<Result<&Arc<GrammarCompiler>, &str>> {
        self.0.get().map(|built| built.as_ref().map_err(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_build_is_waited_for_and_its_error_kept() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let pending = PendingCompiler::build_in_background(move || {
            rx.recv().unwrap();
            Err("no vocabulary".to_owned())
        });
        assert!(pending.get().is_none(), "still building");
        tx.send(()).unwrap();
        assert_eq!(pending.wait().err(), Some("no vocabulary"));
        assert_eq!(pending.clone().get().and_then(Result::err), Some("no vocabulary"));
    }
}
