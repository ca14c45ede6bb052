//! `ckpt coordinator`: the elastic control plane's coordinator of one job, run
//! until killed.

use std::process::ExitCode;

use ckpt_elastic::timeouts::{Timeouts, millis, parse_seconds};

use crate::exit;
use crate::output::errln;

/// Flags of `ckpt coordinator`.
#[derive(clap::Args)]
pub(crate) struct CoordinatorArgs {
    /// Address to listen on (port 0 picks a free port; the line printed at start
    /// names the real one).
    #[arg(long, value_name = "ADDR")]
    listen: std::net::SocketAddr,
    /// Job id; members of other jobs are refused.
    #[arg(long, value_name = "ID")]
    job: String,
    /// Fewest ranks a generation may have.
    #[arg(long, value_name = "M")]
    min_ranks: usize,
    /// Most ranks a generation may have; more wait to join.
    #[arg(long, value_name = "N")]
    max_ranks: usize,
    /// No heartbeat for this long: the rank is lost. Also how long a restarted
    /// coordinator waits for ranks to come back before forming a new generation.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.heartbeat_timeout.as_secs_f64(), value_parser = parse_seconds)]
    heartbeat_timeout_secs: f64,
    /// Idle this long outside a collective: the rank is hung.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.progress_timeout.as_secs_f64(), value_parser = parse_seconds)]
    progress_timeout_secs: f64,
    /// After a restart, ranks that do not rejoin within this are dropped.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.join_timeout.as_secs_f64(), value_parser = parse_seconds)]
    join_timeout_secs: f64,
    /// Once enough ranks wait, how long to wait for more arriving together.
    #[arg(long, value_name = "MS", default_value_t = millis(Timeouts::DEFAULT.last_call))]
    last_call_ms: u64,
    /// Fewer than --min-ranks for this long: the job is shut down.
    #[arg(long, value_name = "S", default_value_t = Timeouts::DEFAULT.rendezvous_timeout.as_secs_f64(), value_parser = parse_seconds)]
    rendezvous_timeout_secs: f64,
}

pub(crate) fn run_coordinator(args: CoordinatorArgs) -> ExitCode {
    use std::io::Write;
    use std::time::Duration;

    let timeouts = Timeouts {
        last_call: Duration::from_millis(args.last_call_ms),
        heartbeat_timeout: Duration::from_secs_f64(args.heartbeat_timeout_secs),
        progress_timeout: Duration::from_secs_f64(args.progress_timeout_secs),
        join_timeout: Duration::from_secs_f64(args.join_timeout_secs),
        rendezvous_timeout: Duration::from_secs_f64(args.rendezvous_timeout_secs),
    };
    let config = ckpt_elastic::CoordinatorConfig {
        job: args.job,
        min_ranks: args.min_ranks,
        max_ranks: args.max_ranks,
        timeouts,
        // A restarted coordinator waits as long as a member may stay silent.
        settle: timeouts.heartbeat_timeout,
        max_connections: ckpt_elastic::CoordinatorConfig::DEFAULT_MAX_CONNECTIONS,
    };
    // The job's secret, which every member must prove: CKPT_JOB_SECRET or
    // CKPT_JOB_SECRET_FILE, as its launchers and ranks have it.
    let secret = match ckpt_auth::JobSecret::from_env() {
        Ok(secret) => secret,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    if secret.is_none() {
        errln!(
            "coordinator: no job secret ({} or {}): any process that reaches this port may join the job",
            ckpt_auth::SECRET_ENV,
            ckpt_auth::SECRET_FILE_ENV
        );
    }
    let coordinator = match ckpt_elastic::Coordinator::bind(args.listen, config) {
        Ok(coordinator) => coordinator.with_secret(secret),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
            errln!("error: {e}");
            return ExitCode::from(exit::USAGE);
        }
        Err(e) => {
            errln!("error: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(exit::CHECK_FAILED);
        }
    };
    let mut stdout = std::io::stdout();
    let _ = writeln!(
        stdout,
        "coordinator: listening on {}",
        coordinator.local_addr()
    );
    let _ = stdout.flush();
    match coordinator.run() {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            errln!("error: coordinator failed: {e}");
            ExitCode::from(exit::CHECK_FAILED)
        }
    }
}
