use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;

use super::*;

fn secret(text: &str) -> JobSecret {
    JobSecret::new(text, "test").unwrap()
}

/// A connected pair of real sockets on loopback: (client, server, client's address).
fn pair() -> (TcpStream, TcpStream, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, peer) = listener.accept().unwrap();
    (client, server, peer)
}

/// Runs the server's check on one thread and `client` on this one.
fn exchange(
    server_secret: &JobSecret,
    client: impl FnOnce(&TcpStream) -> Result<(), AuthError>,
) -> (Result<(), AuthError>, Result<(), AuthError>) {
    let (c, s, _) = pair();
    let server_secret = server_secret.clone();
    let server = thread::spawn(move || check_tcp(&s, &server_secret));
    let client = client(&c);
    drop(c);
    (client, server.join().unwrap())
}

#[test]
fn the_same_secret_admits_both_sides_and_the_stream_goes_on() {
    let s = secret("a secret of the job, long enough");
    let (c, srv, _) = pair();
    let s2 = s.clone();
    let server = thread::spawn(move || {
        check_tcp(&srv, &s2).unwrap();
        let mut line = [0u8; 5];
        (&srv).read_exact(&mut line).unwrap();
        line
    });
    prove_tcp(&c, &s).unwrap();
    (&c).write_all(b"hello").unwrap();
    assert_eq!(&server.join().unwrap(), b"hello");
}

#[test]
fn another_secret_is_refused_on_both_sides() {
    let (client, server) = exchange(&secret("the job's own secret text"), |c| {
        prove_tcp(c, &secret("a stranger's secret text!"))
    });
    // The stranger learns that the server is not its job's first: the server's
    // proof is checked before the client proves anything.
    assert!(
        matches!(client, Err(AuthError::ServerUnproven)),
        "{client:?}"
    );
    assert!(matches!(server, Err(AuthError::Io(_))), "{server:?}");
}

#[test]
fn a_client_that_answers_without_the_secret_is_refused() {
    let job = secret("the job's own secret text");
    let (client, server) = exchange(&job, |mut c| {
        // Speaks the handshake but cannot compute the answer.
        c.write_all(&MAGIC)?;
        c.write_all(&[7u8; 32])?;
        let mut challenge = [0u8; 64];
        c.read_exact(&mut challenge)?;
        c.write_all(&[0u8; 32])?;
        let mut verdict = [9u8; 1];
        c.read_exact(&mut verdict)?;
        assert_eq!(verdict[0], REFUSED);
        Ok(())
    });
    client.unwrap();
    assert!(matches!(server, Err(AuthError::WrongSecret)), "{server:?}");
}

#[test]
fn a_peer_of_another_protocol_is_told_apart() {
    let job = secret("the job's own secret text");
    let (_, server) = exchange(&job, |mut c| {
        c.write_all(b"{\"type\":\"hello\",\"version\":1}\n")?;
        Ok(())
    });
    assert!(matches!(server, Err(AuthError::NoHandshake)), "{server:?}");
}

#[test]
fn a_recorded_answer_is_worthless_for_the_next_connection() {
    let job = secret("the job's own secret text");
    // An eavesdropper records a genuine client's hello and answer...
    let (c, s, _) = pair();
    let recorder = thread::spawn(move || {
        let mut hello = [0u8; 40];
        (&s).read_exact(&mut hello).unwrap();
        let job = secret("the job's own secret text");
        let (side, challenge) =
            ServerSide::challenge(&job, hello[8..].try_into().unwrap()).unwrap();
        (&s).write_all(&challenge).unwrap();
        let mut answer = [0u8; 32];
        (&s).read_exact(&mut answer).unwrap();
        side.verify(&job, &answer).unwrap();
        (&s).write_all(&[ACCEPTED]).unwrap();
        (hello, answer)
    });
    prove_tcp(&c, &job).unwrap();
    let (hello, answer) = recorder.join().unwrap();
    // ...and replays them to the server: its fresh nonce makes the answer wrong.
    let (_, server) = exchange(&job, move |mut c| {
        c.write_all(&hello)?;
        let mut challenge = [0u8; 64];
        c.read_exact(&mut challenge)?;
        c.write_all(&answer)?;
        let mut verdict = [0u8; 1];
        c.read_exact(&mut verdict)?;
        assert_eq!(verdict[0], REFUSED);
        Ok(())
    });
    assert!(matches!(server, Err(AuthError::WrongSecret)), "{server:?}");
}

#[test]
fn a_silent_client_is_dropped_at_the_timeout() {
    let (c, s, _) = pair();
    let job = secret("the job's own secret text");
    let started = std::time::Instant::now();
    let result = with_timeouts(&s, Duration::from_millis(200), |s| check(s, &job));
    assert!(
        matches!(&result, Err(AuthError::Io(e)) if is_timeout(e)),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    // The stream's own timeouts are back.
    assert_eq!(s.read_timeout().unwrap(), None);
    drop(c);
}

#[test]
fn the_gatekeeper_counts_refusals_and_bounds_handshakes_in_progress() {
    let job = secret("the job's own secret text");
    let gate = Gatekeeper::with_limit("test", Some(job.clone()), 1);
    // One silent connection holds the only handshake place...
    let (silent, s1, p1) = pair();
    let holder = {
        let gate = gate.clone();
        thread::spawn(move || gate.admit(&s1, p1))
    };
    while gate.in_progress.load(Ordering::Acquire) == 0 {
        thread::yield_now();
    }
    // ...so the next is refused at once, whatever it would prove.
    let (_c2, s2, p2) = pair();
    assert!(!gate.admit(&s2, p2));
    assert_eq!(gate.refused(), 1);
    drop(silent);
    assert!(!holder.join().unwrap());
    assert_eq!(gate.refused(), 2);
    // A client with the secret is admitted once the place is free.
    let (c3, s3, p3) = pair();
    let client = thread::spawn(move || prove_tcp(&c3, &job));
    assert!(gate.admit(&s3, p3));
    client.join().unwrap().unwrap();
    assert_eq!(gate.refused(), 2);
}

#[test]
fn without_a_secret_everyone_is_admitted_without_a_handshake() {
    let gate = Gatekeeper::new("test", None);
    let (mut c, s, p) = pair();
    assert!(gate.admit(&s, p));
    c.write_all(b"x").unwrap();
    let mut byte = [0u8; 1];
    (&s).read_exact(&mut byte).unwrap();
    assert_eq!(&byte, b"x");
}

#[test]
fn secrets_too_short_too_long_or_unreadable_are_named() {
    let e = JobSecret::new("  short  ", "CKPT_JOB_SECRET").unwrap_err();
    assert!(e.to_string().contains("has 5 characters"), "{e}");
    assert!(e.to_string().contains("CKPT_JOB_SECRET"), "{e}");
    let e = JobSecret::new(&"x".repeat(MAX_SECRET_LEN + 1), "here").unwrap_err();
    assert!(matches!(e, SecretError::TooLong { .. }), "{e}");
    let dir = std::env::temp_dir().join(format!("ckpt-auth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing");
    let e = JobSecret::from_file(&missing).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let file = dir.join("secret");
    std::fs::write(&file, "the job's own secret text\n").unwrap();
    let from_file = JobSecret::from_file(&file).unwrap();
    assert_eq!(from_file.key, secret("the job's own secret text").key);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generated_secrets_are_accepted_and_differ() {
    let a = JobSecret::generate_text().unwrap();
    let b = JobSecret::generate_text().unwrap();
    assert_eq!(a.len(), 64);
    assert_ne!(a, b);
    JobSecret::new(&a, "generated").unwrap();
    assert_eq!(format!("{:?}", secret(&a)), "JobSecret(…)");
}

#[cfg(feature = "tokio")]
#[tokio::test]
async fn the_async_handshake_speaks_with_the_blocking_one() {
    let job = secret("the job's own secret text");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let job2 = job.clone();
    let client = thread::spawn(move || {
        let c = TcpStream::connect(addr).unwrap();
        prove_tcp(&c, &job2)
    });
    let (mut s, peer) = listener.accept().await.unwrap();
    let gate = Gatekeeper::new("test", Some(job.clone()));
    assert!(gate.admit_async(&mut s, peer).await);
    client.join().unwrap().unwrap();
    // And the async client against the blocking server.
    let std_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = std_listener.local_addr().unwrap();
    let job3 = job.clone();
    let server = thread::spawn(move || {
        let (s, _) = std_listener.accept().unwrap();
        check_tcp(&s, &job3)
    });
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    prove_async(&mut c, &job).await.unwrap();
    server.join().unwrap().unwrap();
}
