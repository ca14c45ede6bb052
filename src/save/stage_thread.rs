//! The one thread a checkpointer keeps for the copies of overlapped saves, and how it
//! yields the cores to training. Starting a thread per save cost a spawn and a cold
//! stack on every step; one kept thread, lowered in priority, lets the copy run in
//! the training loop's gaps without taking a core from it.

use std::sync::Mutex;

use tracing::debug;

/// How much less of a contended core the staging thread and its copy workers take
/// than the training threads: Linux's nice value, +5 (about a third of their
/// weight).
#[cfg(target_os = "linux")]
const STAGING_NICE: libc::c_int = 5;

/// Lets the training loop keep the cores the staging copies would take from it: the
/// calling thread (the staging thread, and the copy workers it starts, which
/// inherit this) runs under `SCHED_BATCH` (a thread woken does not preempt the one
/// running) at [`STAGING_NICE`]. The copy of an overlapped save is background work,
/// but it used to take the core from the thread that had just registered a save,
/// or from another rank still registering its own: on W1 in Python (four rank
/// processes on two cores, each rank's copy starting as its save registers) the
/// slowest rank's stall was 8-9 ms, of which the library's own registration took
/// 4-7 ms of preemption, against 0.2 ms alone. With both, 1.4 ms, and its
/// registration 0.2 ms; the copy finishes about as soon where the cores are free
/// (the training thread waits for it before the optimizer step), and later where
/// other work keeps them busy. Device tensors are copied by the device, not these
/// threads. Best effort: elsewhere, or refused, nothing changes.
fn yield_to_training() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
            debug!(
                error = %std::io::Error::last_os_error(),
                "the staging thread keeps the default scheduling policy"
            );
        }
        // SAFETY: who 0 is the calling thread (Linux keeps nice values per thread).
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, STAGING_NICE) } != 0 {
            debug!(
                error = %std::io::Error::last_os_error(),
                "the staging thread keeps the default priority"
            );
        }
    }
}

/// One overlapped save's copy, run on the staging thread.
type StageWork = Box<dyn FnOnce() + Send>;

/// The thread that runs a checkpointer's overlapped copies, one after another,
/// started at its first overlapped save and kept. Starting a thread per save cost
/// the caller up to 25 ms of its stall where the process's other threads were busy
/// (W1 in Python: four rank processes on two cores, each copying its save): the
/// stack's mapping waits for the process's memory map. Handing work to a waiting
/// thread costs a wake-up. Overlapped copies of one checkpointer run one at a time
/// anyway: a caller waits for a save's copy before changing its tensors for the
/// next. The thread ends when the checkpointer is dropped (its queue closes); one
/// whose work panicked is replaced at the next save.
#[derive(Debug, Default)]
pub(super) struct StageThread(Mutex<Option<std::sync::mpsc::Sender<StageWork>>>);

impl StageThread {
    pub(super) fn run(&self, work: StageWork) -> std::io::Result<()> {
        let mut queue = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let work = match queue.as_ref() {
            Some(sender) => match sender.send(work) {
                Ok(()) => return Ok(()),
                Err(std::sync::mpsc::SendError(work)) => work,
            },
            None => work,
        };
        let (sender, receiver) = std::sync::mpsc::channel::<StageWork>();
        std::thread::Builder::new()
            .name("ckpt-stage".into())
            .spawn(move || {
                yield_to_training();
                for work in receiver {
                    work();
                }
            })?;
        sender
            .send(work)
            .expect("the staging thread just started holds its queue");
        *queue = Some(sender);
        Ok(())
    }
}
