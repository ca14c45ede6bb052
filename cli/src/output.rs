//! Every byte the command line prints goes through here, so that one place decides
//! what a failed write means.
//!
//! A command whose output pipe closes (`ckpt ls URL --json | head -1`) stops at once
//! and without a word, ended by SIGPIPE as Unix tools are (a shell shows status 141).
//! Rust runs programs with SIGPIPE ignored, and the signal stays ignored while a
//! command runs, on purpose: store connections write to sockets (with `writev`,
//! which cannot ask for MSG_NOSIGNAL), and a connection the server closed must be an
//! error the store retries, not the end of the process. So the write that meets the
//! closed pipe sees EPIPE here, and only then does the process take the signal. Any
//! other failed write (stdout redirected to a full disk) is an error naming itself,
//! with the storage exit code.

use std::fmt;
use std::io::{self, Write};

/// What a failed write to the terminal or a pipe means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WriteFailure {
    /// The reader went away: end quietly, as by SIGPIPE.
    Closed,
    /// Anything else: report it.
    Failed(String),
}

/// Writes `args` to `to`, flushing, and says what a failure means.
pub(crate) fn write_to(to: &mut impl Write, args: fmt::Arguments<'_>) -> Result<(), WriteFailure> {
    to.write_fmt(args)
        .and_then(|()| to.flush())
        .map_err(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => WriteFailure::Closed,
            _ => WriteFailure::Failed(e.to_string()),
        })
}

/// Prints to stdout; see the module doc for a failed write.
pub(crate) fn stdout(args: fmt::Arguments<'_>) {
    if let Err(failure) = write_to(&mut io::stdout().lock(), args) {
        end(failure, "stdout");
    }
}

/// Prints to stderr; see the module doc for a failed write.
pub(crate) fn stderr(args: fmt::Arguments<'_>) {
    if let Err(failure) = write_to(&mut io::stderr().lock(), args) {
        end(failure, "stderr");
    }
}

fn end(failure: WriteFailure, stream: &str) -> ! {
    match failure {
        WriteFailure::Closed => die_of_sigpipe(),
        WriteFailure::Failed(e) => {
            // stderr may be the stream that failed: this is the last attempt.
            let _ = writeln!(io::stderr(), "error: cannot write to {stream}: {e}");
            std::process::exit(i32::from(crate::exit::STORAGE))
        }
    }
}

fn die_of_sigpipe() -> ! {
    // SAFETY: `signal` with SIG_DFL and `raise` take no pointers and are
    // async-signal-safe; restoring the default action and raising the signal in
    // this thread ends the process here, as a write to the closed pipe would have
    // with the default action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}

/// `print!` through [`stdout`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::stdout(format_args!($($arg)*)) };
}

/// `println!` through [`stdout`].
macro_rules! outln {
    () => { $crate::output::stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `eprintln!` through [`stderr`].
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

pub(crate) use {errln, out, outln};

/// Prints `value` as pretty JSON on stdout. False, with the reason on stderr, when
/// it cannot be encoded.
pub(crate) fn print_json(value: &impl serde::Serialize) -> bool {
    match serde_json::to_string_pretty(value) {
        Ok(text) => {
            outln!("{text}");
            true
        }
        Err(e) => {
            errln!("error: cannot encode the JSON output: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;

    use super::*;

    #[test]
    fn a_write_to_a_pipe_whose_reader_closed_means_closed_and_a_full_disk_means_failed() {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a live array of two ints, as pipe(2) wants.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned here, once each.
        let (reader, mut writer) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        assert_eq!(write_to(&mut writer, format_args!("first\n")), Ok(()));
        drop(reader);
        // SIGPIPE is ignored in Rust programs (and so in this test), so the write
        // fails with EPIPE instead of ending the process.
        assert_eq!(
            write_to(&mut writer, format_args!("second\n")),
            Err(WriteFailure::Closed)
        );

        let mut full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        match write_to(&mut full, format_args!("anything")) {
            Err(WriteFailure::Failed(e)) => assert!(e.contains("No space left"), "{e}"),
            other => panic!("a full device is a failure to report, got {other:?}"),
        }
    }
}
