//! `ckpt launch` with plain shell commands as ranks: the environment each rank gets,
//! exit statuses, and relaunches (the Python and trainer paths are tested by
//! `python/tests/test_elastic.py` and `trainer/tests/elastic.rs`).

use std::process::{Command, Output};

fn launch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .arg("launch")
        .args(args)
        .output()
        .expect("running ckpt launch")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_fixed_world_gets_torchruns_environment() {
    let out = launch(&[
        "--nproc",
        "2",
        "--",
        "sh",
        "-c",
        "echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT \
         $GROUP_RANK $TORCHELASTIC_RUN_ID $TORCHELASTIC_RESTART_COUNT fd=${CKPT_RENDEZVOUS_FD:-none}",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    for rank in 0..2 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] env {rank} 2 {rank} 2 127.0.0.1 ")))
            .unwrap_or_else(|| panic!("no environment line of rank {rank}:\n{text}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        // port, node, run id, restarts, and no listener handed to a program that
        // does not take it (torch's store binds MASTER_PORT itself)
        assert!(words[8].parse::<u16>().is_ok_and(|p| p > 0), "{line}");
        assert_eq!(words[9], "0", "{line}");
        assert!(!words[10].is_empty(), "{line}");
        assert_eq!(&words[11..], ["0", "fd=none"], "{line}");
    }
}

#[test]
fn a_failed_rank_stops_the_world_and_its_status_is_the_launchers() {
    let out = launch(&[
        "--nproc",
        "2",
        "--grace-secs",
        "1",
        "--",
        "sh",
        "-c",
        "exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stdout(&out));
}

#[test]
fn a_program_that_does_not_exist_is_named() {
    let out = launch(&["--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot start /nonexistent/program"), "{err}");
}

/// The node's only rank dies and is relaunched: its process group ended with it, so
/// the relaunched rank must lead a new one (it used to fail with EPERM).
#[test]
fn the_last_rank_of_a_node_is_relaunched_in_a_new_process_group() {
    let out = launch(&[
        "--nproc",
        "1",
        "--min-ranks",
        "1",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        // The first incarnation fails; the relaunched one exits 0, which a rank does
        // when the job is done.
        "echo restart $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS; \
         [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ]",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("[rank 0] restart 0 of 1"), "{text}");
    assert!(text.contains("[rank 0] restart 1 of 1"), "{text}");
    assert!(text.contains("(restart 1)"), "{text}");
    assert!(
        text.contains("ended with its last rank; process group"),
        "{text}"
    );
}

#[test]
fn a_wedged_rank_is_started_again_without_counting_a_restart() {
    // `ckpt.elastic` exits 76 when a survivor's training thread stays inside a
    // collective its abort did not fail; with no restart allowed, only the wedged
    // path can bring the slot back.
    let out = launch(&[
        "--nproc",
        "1",
        "--min-ranks",
        "1",
        "--max-restarts",
        "0",
        "--",
        "sh",
        "-c",
        "echo process $TORCHELASTIC_RESTART_COUNT; \
         [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ] || exit 76",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("[rank 0] process 0"), "{text}");
    assert!(text.contains("[rank 0] process 1"), "{text}");
    assert!(
        text.contains("could not leave its process group (exit 76)"),
        "{text}"
    );
    assert!(!text.contains("failed"), "{text}");
}

/// Without a job secret in the environment, a launch whose ranks are all its own
/// gives them one secret (the same for all, new for every launch); a secret of the
/// environment reaches them unchanged; one too short stops the launch, named.
#[test]
fn the_ranks_share_a_job_secret_generated_per_launch_unless_one_is_given() {
    let secret_of = |envs: &[(&str, &str)], elastic: &[&str]| -> (Output, Vec<String>) {
        let out = Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .arg("launch")
            .env_remove("CKPT_JOB_SECRET")
            .env_remove("CKPT_JOB_SECRET_FILE")
            .envs(envs.iter().copied())
            .args(["--nproc", "2"])
            .args(elastic)
            .args(["--", "sh", "-c", "echo secret=$CKPT_JOB_SECRET"])
            .output()
            .expect("running ckpt launch");
        let secrets = stdout(&out)
            .lines()
            .filter_map(|l| l.split_once("secret=").map(|(_, s)| s.to_owned()))
            .collect();
        (out, secrets)
    };
    let (out, first) = secret_of(&[], &[]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert_eq!(first.len(), 2, "{}", stdout(&out));
    assert_eq!(first[0], first[1], "one secret for the job's ranks");
    assert_eq!(first[0].len(), 64, "{first:?}");
    let (_, second) = secret_of(&[], &["--min-ranks", "1"]);
    assert_eq!(second.len(), 2);
    assert_eq!(second[0], second[1]);
    assert_ne!(second[0], first[0], "a new secret per launch");

    let given = "the secret of this job, from its user";
    let (out, secrets) = secret_of(&[("CKPT_JOB_SECRET", given)], &["--min-ranks", "1"]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert_eq!(secrets, [given, given]);

    let (out, secrets) = secret_of(&[("CKPT_JOB_SECRET", "too short")], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(secrets.is_empty(), "no rank started: {secrets:?}");
    assert!(stderr.contains("at least 16"), "{stderr}");
}

/// `--rdzv-connect-timeout-secs` bounds the launcher's own attempts to join an
/// unreachable coordinator, and reaches each rank as `CKPT_RDZV_CONNECT_TIMEOUT_SECS`
/// (their own attempts, in `ckpt_elastic::env`); a bound that is not a positive number
/// of seconds is a usage error, named.
#[test]
fn the_coordinators_connect_timeout_bounds_the_launcher_and_reaches_the_ranks() {
    // A port nothing listens on: bound, then released.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let rdzv = format!("tcp://{gone}");
    let out = launch(&[
        "--nproc",
        "1",
        "--min-ranks",
        "1",
        "--rdzv",
        &rdzv,
        "--job-id",
        "gone",
        "--rdzv-connect-timeout-secs",
        "0.5",
        "--",
        "sh",
        "-c",
        "echo bound=$CKPT_RDZV_CONNECT_TIMEOUT_SECS",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains("this node cannot join the coordinator") && text.contains("tried for 0.5 s"),
        "{text}"
    );
    assert!(text.contains("[rank 0] bound=0.5"), "{text}");

    let out = launch(&[
        "--min-ranks",
        "1",
        "--rdzv-connect-timeout-secs",
        "0",
        "--",
        "true",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--rdzv-connect-timeout-secs"), "{stderr}");
}

/// An elastic job that lost a rank for good (no restart left, `--min-ranks` lets the
/// others go on) and is then stopped cleanly is a stopped job: the launcher exits 75
/// (resume from the agreed commit), not the lost rank's 137, which the job survived.
#[test]
fn a_stop_after_a_rank_lost_for_good_is_a_stop() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .arg("launch")
        .args(["--nproc", "2", "--min-ranks", "1", "--max-restarts", "0"])
        .args(["--grace-secs", "5", "--", "sh", "-c"])
        // Rank 0 is killed at once; rank 1 trains until it is told to stop, then
        // exits as `ckpt.elastic` does after its final save (or, never told within
        // 30 s, exits 9: the test fails instead of hanging).
        .arg(
            "if [ \"$LOCAL_RANK\" = 0 ]; then kill -9 $$; fi; \
             trap 'echo stopped; exit 75' TERM; \
             i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; exit 9",
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("running ckpt launch");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut text = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        text.push_str(&line);
        text.push('\n');
        if line.contains("is not restarted") {
            break;
        }
    }
    assert!(text.contains("the others go on"), "{text}");
    // SAFETY: a signal to the launcher this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    for line in lines {
        text.push_str(&line.unwrap());
        text.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(text.contains("[rank 1] stopped"), "{text}");
    assert_eq!(status.code(), Some(75), "{text}");
}
