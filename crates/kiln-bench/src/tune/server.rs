//! A `kiln serve` child process on loopback for one configuration of the sweep: started on a
//! free port, waited on until `/health` answers 200, killed when dropped. Its log goes to a
//! file so a failed start can be explained.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hyper::StatusCode;

use crate::client::{ApiClient, Target};

pub struct ServerProcess {
    child: Child,
    pub base_url: String,
    pub log: PathBuf,
}

impl ServerProcess {
    /// Starts `exe serve --host 127.0.0.1 --port P <args>` and waits up to `timeout` for it.
    pub fn start(
        exe: &Path,
        args: &[String],
        log: PathBuf,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let log_file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(exe)
            .args([
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--disable-log-requests",
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let mut server = Self { child, base_url: format!("http://127.0.0.1:{port}"), log };
        server.wait_ready(timeout)?;
        Ok(server)
    }

    fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let client = ApiClient::new(Target::server(&self.base_url, None))?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the server exited ({status}) before it was ready; see {}",
                    self.log.display()
                );
            }
            if let Ok((StatusCode::OK, _)) = runtime.block_on(client.get("/health")) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("the server was not ready after {timeout:?}; see {}", self.log.display())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free right now (the OS's choice for port 0).
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}
