//! `ckpt._native.Agent`: the library's elastic agent, for `ckpt.elastic`.
//!
//! A Python rank under an elastic launcher is the same kind of member as a rank of
//! the reference trainer: the agent (`ckpt_elastic::Agent`) runs on its own thread,
//! heartbeats with the training thread's progress marks and takes the control
//! plane's directives. This binding adds nothing to its logic. What it adds is the
//! one thing Python needs and Rust does not: the agent's abort hook cannot call into
//! Python (it runs on the agent's thread, and the training thread may hold the GIL),
//! so the hook only records which generation was aborted and wakes
//! [`Agent::wait_abort`], on which a Python watcher thread waits with the GIL released
//! and then tears the process group down.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ckpt_elastic::{Assignment, Directive, ElasticError as Error, RankEnv, Report};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::ElasticError;

/// How long a "fatal" report waits for the control plane to handle it.
const FATAL_REPORT_WAIT: Duration = Duration::from_secs(2);

/// The generations whose abort hook fired, newest last, and the sockets the hook
/// shuts down.
#[derive(Default)]
struct Aborted {
    newest: Mutex<Option<u64>>,
    changed: Condvar,
    /// The process group's sockets of a generation ([`Agent::guard_sockets`]).
    sockets: Mutex<(u64, Vec<(i32, u64)>)>,
}

impl Aborted {
    fn fire(&self, generation: u64) {
        {
            // Shut down first: that is what wakes a rank blocked in gloo on a
            // stopped peer, which no timeout short of the collective's would.
            let sockets = self.sockets.lock().unwrap_or_else(|p| p.into_inner());
            if sockets.0 == generation {
                for &(fd, inode) in &sockets.1 {
                    if socket_of(fd) != Some((false, inode)) {
                        // Closed by gloo itself, the number possibly reused.
                        continue;
                    }
                    // SAFETY: shutdown(2) on a descriptor number only changes the
                    // state of the socket it names, which was just checked to be
                    // the process group's (its inode); the list is emptied (under
                    // this lock) before the group closes its sockets. A failed call
                    // is harmless.
                    unsafe {
                        libc::shutdown(fd, libc::SHUT_RDWR);
                    }
                }
            }
        }
        let mut newest = self.newest.lock().unwrap_or_else(|p| p.into_inner());
        *newest = Some(newest.map_or(generation, |g| g.max(generation)));
        self.changed.notify_all();
    }

    /// Waits until generation `generation` (or a newer one) was aborted, or `timeout`.
    fn wait(&self, generation: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut newest = self.newest.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if newest.is_some_and(|g| g >= generation) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            newest = self
                .changed
                .wait_timeout(newest, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn to_py(error: Error) -> PyErr {
    let kind = match &error {
        Error::Cancelled => "cancelled",
        Error::Timeout(_) => "timeout",
        Error::Rejected(_) => "rejected",
        Error::Io(_) => "unreachable",
        Error::Protocol(_) => "protocol",
        Error::Shutdown(_) => "shutdown",
    };
    let err = ElasticError::new_err(error.to_string());
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("kind", kind);
    });
    err
}

/// A member of an elastic job: the library's agent over the control plane that the
/// launcher named (`CKPT_RDZV`, `CKPT_JOB_ID`, `CKPT_MEMBER_ID`, `CKPT_NODE_ID`).
#[pyclass(module = "ckpt._native", frozen)]
pub struct Agent {
    agent: ckpt_elastic::Agent,
    env: RankEnv,
    aborted: Arc<Aborted>,
}

#[pymethods]
impl Agent {
    /// Joins the control plane the environment names; `None` when the process was not
    /// started by an elastic launcher (`CKPT_RDZV` unset).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Option<Agent>> {
        let env = match RankEnv::from_env() {
            Ok(Some(env)) => env,
            Ok(None) => return Ok(None),
            Err(e) => return Err(ElasticError::new_err(e)),
        };
        let plane = py.detach(|| env.connect()).map_err(ElasticError::new_err)?;
        let agent = ckpt_elastic::Agent::new(plane, ckpt_elastic::AgentConfig::default());
        Ok(Some(Agent {
            agent,
            env,
            aborted: Arc::default(),
        }))
    }

    /// Who this member is: `job`, `id`, `host` (the local address that reaches the
    /// control plane, where this rank's listeners bind), `node`.
    fn member<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = &self.env.member;
        let out = PyDict::new(py);
        out.set_item("job", &m.job)?;
        out.set_item("id", &m.id)?;
        out.set_item("host", &m.host)?;
        out.set_item("node", &m.node)?;
        Ok(out)
    }

    /// Blocks (GIL released) until a generation newer than the last one includes this
    /// member; returns it as a dict: `generation`, `rank`, `world_size`, `members`
    /// (how many members: rank processes, or nodes), `checkpoint_generation_floor`,
    /// `cause` and `run_id` (the run id this generation saves under). Raises
    /// `ElasticError`
    /// (`kind` "shutdown" when the job is over).
    fn rendezvous<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let assignment = py.detach(|| self.agent.rendezvous()).map_err(to_py)?;
        let aborted = self.aborted.clone();
        let generation = assignment.generation;
        self.agent
            .set_abort_hook(Box::new(move || aborted.fire(generation)));
        assignment_dict(py, &assignment, &self.env.member.job)
    }

    /// Blocks (GIL released) until this member's generation `generation` is aborted
    /// by the control plane (Restart, Stale or Shutdown), or `timeout` seconds pass;
    /// true when it was.
    fn wait_abort(&self, py: Python<'_>, generation: u64, timeout: f64) -> bool {
        let timeout = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::MAX);
        py.detach(|| self.aborted.wait(generation, timeout))
    }

    /// The sockets of generation `generation`'s process group, as `(descriptor,
    /// inode)` pairs: the abort of that generation shuts them down, which makes every
    /// collective blocked on them fail at once, also one waiting on a stopped peer.
    /// Give only connected sockets: gloo's listener thread treats a failed `accept`
    /// as fatal and ends the process. A descriptor whose inode no longer matches (gloo
    /// closes a pair's socket on an error, and the number may be reused) is left
    /// alone. Call it with an empty list before the group is destroyed. Numbers that
    /// are not sockets, or listening ones, are refused.
    fn guard_sockets(&self, generation: u64, sockets: Vec<(i32, u64)>) -> PyResult<()> {
        for &(fd, inode) in &sockets {
            match socket_of(fd) {
                Some((false, found)) if found == inode => {}
                Some((true, _)) => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "descriptor {fd} is a listening socket: shutting it down would end the process"
                    )));
                }
                _ => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "descriptor {fd} is not the socket with inode {inode}"
                    )));
                }
            }
        }
        *self
            .aborted
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = (generation, sockets);
        Ok(())
    }

    /// Whether the current generation was cancelled (aborted, or its directive came).
    fn is_cancelled(&self) -> bool {
        self.agent.cancel().is_cancelled()
    }

    /// The directive received for the current generation, as a dict with `kind`
    /// ("restart", "regroup", "stale", "shutdown") and its fields, or `None`.
    fn directive<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(directive) = self.agent.directive() else {
            return Ok(None);
        };
        let out = PyDict::new(py);
        match directive {
            Directive::Restart { generation, cause } => {
                out.set_item("kind", "restart")?;
                out.set_item("generation", generation)?;
                out.set_item("cause", cause)?;
            }
            Directive::Regroup { generation, cause } => {
                out.set_item("kind", "regroup")?;
                out.set_item("generation", generation)?;
                out.set_item("cause", cause)?;
            }
            Directive::Stale { current } => {
                out.set_item("kind", "stale")?;
                out.set_item("current", current)?;
            }
            Directive::Shutdown { reason } => {
                out.set_item("kind", "shutdown")?;
                out.set_item("reason", reason)?;
            }
        }
        Ok(Some(out))
    }

    /// True once members wait to join: end the generation at the next checkpoint.
    fn regroup_requested(&self) -> bool {
        self.agent.regroup_requested()
    }

    /// The training thread completed step `step` (progress: hang detection).
    fn progress(&self, step: u64) {
        self.agent.progress(step);
    }

    /// The training thread waits on its peers from now on (a collective, a load):
    /// not hung, whatever its idle time.
    fn collective_started(&self) {
        self.agent.collective_started();
    }

    /// The wait on peers is over.
    fn collective_done(&self) {
        self.agent.collective_done();
    }

    /// The checkpoint generation this member saves with (the coordinator keeps later
    /// floors above it).
    fn set_checkpoint_generation(&self, generation: u64) {
        self.agent.set_checkpoint_generation(generation);
    }

    /// Tells the control plane about the current generation. `kind`: "committed",
    /// "ended", "finished" (with `step`), "leaving", "fatal" (with `reason`),
    /// "collective_failed" (with `reason`, and `peer` when known). A "fatal" report
    /// returns once the control plane has handled it (up to 2 s).
    #[pyo3(signature = (kind, *, step = None, reason = None, peer = None))]
    fn report(
        &self,
        py: Python<'_>,
        kind: &str,
        step: Option<u64>,
        reason: Option<String>,
        peer: Option<usize>,
    ) -> PyResult<()> {
        let need_step = || {
            step.ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!("report {kind:?} needs step"))
            })
        };
        let reason = reason.unwrap_or_default();
        let report = match kind {
            "committed" => Report::Committed { step: need_step()? },
            "ended" => Report::Ended { step: need_step()? },
            "finished" => Report::Finished { step: need_step()? },
            "leaving" => Report::Leaving { reason },
            "fatal" => Report::Fatal { reason },
            "collective_failed" => Report::CollectiveFailed { peer, reason },
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown report {other:?}: committed, ended, finished, leaving, fatal, collective_failed"
                )));
            }
        };
        if matches!(report, Report::Fatal { .. }) {
            // The caller aborts its process group next: the control plane must have
            // this report before the peers' errors about the closed connections.
            return py
                .detach(|| self.agent.report_handled(report, FATAL_REPORT_WAIT))
                .map_err(to_py);
        }
        py.detach(|| self.agent.report(report)).map_err(to_py)
    }

    /// Sets `key` in the current generation's key-value space.
    fn kv_set(&self, py: Python<'_>, key: &str, value: &str) -> PyResult<()> {
        py.detach(|| self.agent.kv_set(key, value)).map_err(to_py)
    }

    /// Waits up to `timeout` seconds (GIL released) for `key` in the current
    /// generation; fails at once when the generation is aborted.
    fn kv_get(&self, py: Python<'_>, key: &str, timeout: f64) -> PyResult<String> {
        let timeout = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::MAX);
        py.detach(|| self.agent.kv_get(key, timeout)).map_err(to_py)
    }

    /// Records `record` (at most 4 KiB) as the job's newest committed in-memory
    /// snapshot for the current generation (GIL released); refused once that
    /// generation is over.
    fn commit_snapshot(&self, py: Python<'_>, record: &str) -> PyResult<()> {
        py.detach(|| self.agent.commit_snapshot(record))
            .map_err(to_py)
    }

    /// The job's newest committed snapshot record, whichever generation committed
    /// it, or `None` (GIL released).
    fn committed_snapshot(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| self.agent.committed_snapshot()).map_err(to_py)
    }

    /// The current generation, if this member has one.
    fn generation(&self) -> Option<u64> {
        self.agent.generation()
    }
}

/// Whether `fd` is a listening socket, and its inode; `None` when it is not a socket.
fn socket_of(fd: i32) -> Option<(bool, u64)> {
    // SAFETY: `struct stat` is plain old data: all zeroes is a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) writes only into `stat`, a valid and writable `struct stat`;
    // a descriptor that is not open makes it fail, which is checked.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `listening`, an int.
    let ok = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut listening).cast(),
            &mut len,
        )
    } == 0;
    Some((ok && listening != 0, stat.st_ino))
}

fn assignment_dict<'py>(
    py: Python<'py>,
    a: &Assignment,
    job: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("generation", a.generation)?;
    out.set_item("rank", a.rank)?;
    out.set_item("world_size", a.world_size)?;
    out.set_item("members", a.members)?;
    out.set_item("checkpoint_generation_floor", a.checkpoint_generation_floor)?;
    out.set_item("cause", &a.cause)?;
    out.set_item(
        "run_id",
        ckpt_elastic::env::run_id(job, a.generation, ckpt::RunId::MAX_LEN),
    )?;
    Ok(out)
}
