//! Child processes of a test binary: a test re-runs its own binary on itself (one
//! test, `--exact`) with an environment variable that selects the child role, so that
//! a rank lives in a real OS process and a kill is a real kill.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

/// A running child, its stderr arriving line by line.
pub struct ChildTest {
    child: Child,
    lines: Option<Receiver<String>>,
    reader: Option<JoinHandle<()>>,
    /// Every line read so far that no caller asked for.
    pub seen: Vec<String>,
}

impl ChildTest {
    /// Runs test `test` of this binary with `env` set, `CKPT_FAILPOINT` set to
    /// `failpoint` (removed when `None`), stdout discarded and stderr piped.
    pub fn spawn(test: &str, env: &[(&str, String)], failpoint: Option<&str>) -> ChildTest {
        let mut command = Command::new(std::env::current_exe().expect("current exe"));
        command
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env_remove("CKPT_FAILPOINT")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        if let Some(failpoint) = failpoint {
            command.env("CKPT_FAILPOINT", failpoint);
        }
        let mut child = command.spawn().expect("spawn child");
        let stderr = child.stderr.take().expect("child stderr");
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildTest {
            child,
            lines: Some(rx),
            reader: Some(reader),
            seen: Vec::new(),
        }
    }

    /// The next stderr line, waiting at most `limit`.
    pub fn next_line(&mut self, limit: Duration) -> Result<String, RecvTimeoutError> {
        self.lines
            .as_ref()
            .expect("lines are read until the child is reaped")
            .recv_timeout(limit)
    }

    /// Reads lines until one satisfies `want` (returned) or none comes for `limit`;
    /// the others go to [`ChildTest::seen`].
    pub fn line_matching(
        &mut self,
        limit: Duration,
        want: impl Fn(&str) -> bool,
    ) -> Option<String> {
        loop {
            match self.next_line(limit) {
                Ok(line) if want(&line) => return Some(line),
                Ok(line) => self.seen.push(line),
                Err(_) => return None,
            }
        }
    }

    /// Sends SIGKILL (if it still runs) and reaps the child.
    pub fn kill(mut self) -> ExitStatus {
        let _ = self.child.kill();
        self.reap()
    }

    /// Waits for the child to exit by itself and reaps it.
    pub fn wait(mut self) -> ExitStatus {
        self.reap()
    }

    fn reap(&mut self) -> ExitStatus {
        let status = self.child.wait().expect("wait for child");
        drop(self.lines.take());
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        status
    }
}
