//! Proof that a peer belongs to the job: a per-job secret that every connection
//! between the job's processes proves, without sending it.
//!
//! The coordinator, a node's agent, the training ring and the in-memory copy
//! servers listen on TCP ports. On a cluster that one job owns, whoever reaches a
//! port is one of the job's processes; on a shared one (Kubernetes, a multi-tenant
//! Slurm) a process of another job, or a stale process of this one, could join a
//! generation, answer a copy fetch or flood the coordinator. With a [`JobSecret`]
//! configured, each of those servers admits a connection only after a mutual
//! challenge and response:
//!
//! 1. client → server: [`MAGIC`] and a fresh 32-byte client nonce;
//! 2. server → client: a fresh 32-byte server nonce and
//!    `HMAC-SHA256(key, "ckpt server" ‖ client nonce ‖ server nonce)`;
//! 3. client → server: `HMAC-SHA256(key, "ckpt client" ‖ client nonce ‖ server nonce)`;
//! 4. server → client: one byte, [`ACCEPTED`] (or [`REFUSED`] before it closes).
//!
//! `key` is SHA-256 of a label and the secret's text. Both sides prove the secret,
//! so a client also knows that the server it fetches a copy from is the job's.
//! Fresh nonces on both sides make a recorded exchange worthless for a later
//! connection, and the two labels keep a server's proof from serving as a client's.
//! The messages have fixed sizes: nothing a stranger sends makes the server allocate.
//!
//! What it is not: encryption. An attacker who can intercept and rewrite the
//! traffic between two of the job's processes can take over a connection after
//! its handshake; that needs a network the job cannot trust at all, where TLS (or
//! a private network) is the answer.
//!
//! The secret comes from [`SECRET_ENV`] (the text itself) or [`SECRET_FILE_ENV`] (a
//! file holding it); `ckpt launch` generates one when neither is set and it starts
//! the job's coordinator itself, and passes it to its ranks in [`SECRET_ENV`].

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tracing::warn;

/// The environment variable that holds the job's secret.
pub const SECRET_ENV: &str = "CKPT_JOB_SECRET";
/// The environment variable that names a file holding the job's secret.
pub const SECRET_FILE_ENV: &str = "CKPT_JOB_SECRET_FILE";
/// The shortest secret accepted (characters): a shorter one could be guessed from
/// one recorded handshake.
pub const MIN_SECRET_LEN: usize = 16;
/// The longest secret accepted (bytes), which bounds what reading its file takes.
pub const MAX_SECRET_LEN: usize = 4096;
/// How long a server waits for a connection's handshake, and a client for the
/// server's answers.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The first bytes of every authenticated connection (protocol version 1).
pub const MAGIC: [u8; 8] = *b"CKPTJS01";
/// The server's last byte: the client proved the secret.
pub const ACCEPTED: u8 = 0x01;
/// The server's last byte before it closes: the client's proof was wrong.
pub const REFUSED: u8 = 0x00;

const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const KEY_LABEL: &[u8] = b"ckpt job secret v1\0";
const SERVER_LABEL: &[u8] = b"ckpt server";
const CLIENT_LABEL: &[u8] = b"ckpt client";

type HmacSha256 = Hmac<Sha256>;

/// A job's secret, as the key derived from it (the text is not kept).
#[derive(Clone)]
pub struct JobSecret {
    key: [u8; 32],
}

/// Equal secrets derive equal keys (compared without an early exit).
impl PartialEq for JobSecret {
    fn eq(&self, other: &Self) -> bool {
        self.key
            .iter()
            .zip(other.key.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl Eq for JobSecret {}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(…)")
    }
}

/// Why a secret could not be had.
#[derive(Debug)]
pub enum SecretError {
    /// Shorter than [`MIN_SECRET_LEN`] characters (after trimming whitespace).
    TooShort {
        /// Where it came from.
        source: String,
        /// Its length.
        len: usize,
    },
    /// Longer than [`MAX_SECRET_LEN`] bytes.
    TooLong {
        /// Where it came from.
        source: String,
    },
    /// The secret file could not be read.
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        error: io::Error,
    },
    /// Both [`SECRET_ENV`] and [`SECRET_FILE_ENV`] are set (which one is meant?).
    Both,
    /// The system's random source failed.
    Random(String),
}

impl std::fmt::Display for SecretError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretError::TooShort { source, len } => write!(
                f,
                "the job secret from {source} has {len} characters; at least {MIN_SECRET_LEN} are needed"
            ),
            SecretError::TooLong { source } => write!(
                f,
                "the job secret from {source} is longer than {MAX_SECRET_LEN} bytes"
            ),
            SecretError::File { path, error } => write!(
                f,
                "cannot read the job secret file {} ({SECRET_FILE_ENV}): {error}",
                path.display()
            ),
            SecretError::Both => write!(
                f,
                "both {SECRET_ENV} and {SECRET_FILE_ENV} are set; set one"
            ),
            SecretError::Random(e) => write!(f, "cannot generate a job secret: {e}"),
        }
    }
}

impl std::error::Error for SecretError {}

impl JobSecret {
    /// The secret whose text is `text` (surrounding whitespace ignored), `source`
    /// naming where it came from in errors.
    pub fn new(text: &str, source: &str) -> Result<JobSecret, SecretError> {
        let text = text.trim();
        if text.len() > MAX_SECRET_LEN {
            return Err(SecretError::TooLong {
                source: source.to_owned(),
            });
        }
        let len = text.chars().count();
        if len < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                source: source.to_owned(),
                len,
            });
        }
        let mut hash = Sha256::new();
        hash.update(KEY_LABEL);
        hash.update(text.as_bytes());
        Ok(JobSecret {
            key: hash.finalize().into(),
        })
    }

    /// The job's secret from the environment ([`SECRET_ENV`] or the file that
    /// [`SECRET_FILE_ENV`] names); `None` when neither is set.
    pub fn from_env() -> Result<Option<JobSecret>, SecretError> {
        let text = std::env::var(SECRET_ENV).ok().filter(|t| !t.is_empty());
        let file = std::env::var_os(SECRET_FILE_ENV).filter(|f| !f.is_empty());
        match (text, file) {
            (Some(_), Some(_)) => Err(SecretError::Both),
            (Some(text), None) => JobSecret::new(&text, SECRET_ENV).map(Some),
            (None, Some(path)) => JobSecret::from_file(&PathBuf::from(path)).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The secret held in the file at `path` (surrounding whitespace ignored).
    pub fn from_file(path: &std::path::Path) -> Result<JobSecret, SecretError> {
        JobSecret::new(&read_secret_file(path)?, &path.display().to_string())
    }

    /// A new secret's text: 32 random bytes in hex, to pass on in [`SECRET_ENV`].
    pub fn generate_text() -> Result<String, SecretError> {
        let mut bytes = [0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(|e| SecretError::Random(e.to_string()))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    fn mac(&self, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> HmacSha256 {
        let mut mac =
            <HmacSha256 as Mac>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        mac.update(label);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac
    }
}

/// Reads a secret file, bounded by [`MAX_SECRET_LEN`] (a path to a device or a huge
/// file is an error, not an allocation).
fn read_secret_file(path: &std::path::Path) -> Result<String, SecretError> {
    let error = |error| SecretError::File {
        path: path.to_owned(),
        error,
    };
    let file = std::fs::File::open(path).map_err(error)?;
    let mut text = String::new();
    file.take(MAX_SECRET_LEN as u64 + 1)
        .read_to_string(&mut text)
        .map_err(error)?;
    if text.len() > MAX_SECRET_LEN {
        return Err(SecretError::TooLong {
            source: path.display().to_string(),
        });
    }
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            warn!(
                path = %path.display(),
                "the job secret file can be read by other users (chmod 600 it)"
            );
        }
    }
    Ok(text)
}

/// Why a handshake failed.
#[derive(Debug)]
pub enum AuthError {
    /// The connection failed, closed or timed out during the handshake.
    Io(io::Error),
    /// The peer did not open with [`MAGIC`]: it runs without the job's secret, or
    /// speaks another protocol.
    NoHandshake,
    /// The client's proof is wrong: it holds another secret.
    WrongSecret,
    /// The server's proof is wrong: it holds another secret (or it is not the
    /// job's server).
    ServerUnproven,
    /// The server refused this client's proof.
    Refused,
    /// Too many handshakes were in progress at this server; the connection was
    /// closed at once.
    Busy,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthError::Io(e) if is_timeout(e) => write!(
                f,
                "no job-secret handshake within {HANDSHAKE_TIMEOUT:?} (a peer without {SECRET_ENV}?)"
            ),
            AuthError::Io(e) => write!(f, "job-secret handshake: {e}"),
            AuthError::NoHandshake => write!(
                f,
                "the peer did not open with the job-secret handshake (it runs without {SECRET_ENV}?)"
            ),
            AuthError::WrongSecret => write!(f, "the peer proved another job secret"),
            AuthError::ServerUnproven => write!(
                f,
                "the server did not prove this job's secret (another job's server, or one without {SECRET_ENV})"
            ),
            AuthError::Refused => write!(
                f,
                "the server refused this process's job secret (is {SECRET_ENV} the job's?)"
            ),
            AuthError::Busy => write!(f, "too many job-secret handshakes in progress"),
        }
    }
}

impl std::error::Error for AuthError {}

impl From<io::Error> for AuthError {
    fn from(e: io::Error) -> Self {
        AuthError::Io(e)
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce)
        .map_err(|e| AuthError::Io(io::Error::other(format!("random source: {e}"))))?;
    Ok(nonce)
}

/// The client's half of the exchange, between its two messages.
struct ClientSide {
    nonce: [u8; NONCE_LEN],
}

impl ClientSide {
    fn hello() -> Result<(ClientSide, [u8; 8 + NONCE_LEN]), AuthError> {
        let nonce = fresh_nonce()?;
        let mut hello = [0u8; 8 + NONCE_LEN];
        hello[..8].copy_from_slice(&MAGIC);
        hello[8..].copy_from_slice(&nonce);
        Ok((ClientSide { nonce }, hello))
    }

    /// Checks the server's proof; the client's own.
    fn answer(
        &self,
        secret: &JobSecret,
        challenge: &[u8; NONCE_LEN + MAC_LEN],
    ) -> Result<[u8; MAC_LEN], AuthError> {
        let (server_nonce, proof) = challenge.split_at(NONCE_LEN);
        secret
            .mac(SERVER_LABEL, &self.nonce, server_nonce)
            .verify_slice(proof)
            .map_err(|_| AuthError::ServerUnproven)?;
        Ok(secret
            .mac(CLIENT_LABEL, &self.nonce, server_nonce)
            .finalize()
            .into_bytes()
            .into())
    }
}

/// The server's half of the exchange, between its two messages.
struct ServerSide {
    client_nonce: [u8; NONCE_LEN],
    nonce: [u8; NONCE_LEN],
}

impl ServerSide {
    fn challenge(
        secret: &JobSecret,
        client_nonce: &[u8; NONCE_LEN],
    ) -> Result<(ServerSide, [u8; NONCE_LEN + MAC_LEN]), AuthError> {
        let nonce = fresh_nonce()?;
        let proof = secret.mac(SERVER_LABEL, client_nonce, &nonce).finalize();
        let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&nonce);
        challenge[NONCE_LEN..].copy_from_slice(&proof.into_bytes());
        Ok((
            ServerSide {
                client_nonce: *client_nonce,
                nonce,
            },
            challenge,
        ))
    }

    fn verify(&self, secret: &JobSecret, answer: &[u8; MAC_LEN]) -> Result<(), AuthError> {
        secret
            .mac(CLIENT_LABEL, &self.client_nonce, &self.nonce)
            .verify_slice(answer)
            .map_err(|_| AuthError::WrongSecret)
    }
}

/// Proves the secret to the server at the other end of `stream` and checks the
/// server's proof (blocking; the caller bounds it with the stream's timeouts, as
/// [`prove_tcp`] does).
pub fn prove<S: Read + Write>(stream: &mut S, secret: &JobSecret) -> Result<(), AuthError> {
    let (side, hello) = ClientSide::hello()?;
    stream.write_all(&hello)?;
    stream.flush()?;
    let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
    stream.read_exact(&mut challenge)?;
    let answer = side.answer(secret, &challenge)?;
    stream.write_all(&answer)?;
    stream.flush()?;
    let mut verdict = [0u8; 1];
    match stream.read_exact(&mut verdict) {
        Ok(()) if verdict[0] == ACCEPTED => Ok(()),
        Ok(()) => Err(AuthError::Refused),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(AuthError::Refused),
        Err(e) => Err(e.into()),
    }
}

/// Checks the proof of the client at the other end of `stream` and proves the
/// secret to it (blocking; the caller bounds it, as [`check_tcp`] does).
pub fn check<S: Read + Write>(stream: &mut S, secret: &JobSecret) -> Result<(), AuthError> {
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(AuthError::NoHandshake);
    }
    let mut client_nonce = [0u8; NONCE_LEN];
    stream.read_exact(&mut client_nonce)?;
    let (side, challenge) = ServerSide::challenge(secret, &client_nonce)?;
    stream.write_all(&challenge)?;
    stream.flush()?;
    let mut answer = [0u8; MAC_LEN];
    stream.read_exact(&mut answer)?;
    if let Err(e) = side.verify(secret, &answer) {
        let _ = stream.write_all(&[REFUSED]);
        return Err(e);
    }
    stream.write_all(&[ACCEPTED])?;
    stream.flush()?;
    Ok(())
}

/// Runs `f` on `stream` with its read and write timeouts set to `timeout`, then
/// puts the previous ones back.
fn with_timeouts<T>(
    stream: &TcpStream,
    timeout: Duration,
    f: impl FnOnce(&mut &TcpStream) -> Result<T, AuthError>,
) -> Result<T, AuthError> {
    let (read, write) = (stream.read_timeout()?, stream.write_timeout()?);
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let result = f(&mut &*stream);
    stream.set_read_timeout(read)?;
    stream.set_write_timeout(write)?;
    result
}

/// [`prove`] on a TCP stream, bounded by [`HANDSHAKE_TIMEOUT`].
pub fn prove_tcp(stream: &TcpStream, secret: &JobSecret) -> Result<(), AuthError> {
    prove_tcp_within(stream, secret, HANDSHAKE_TIMEOUT)
}

/// [`prove`] on a TCP stream, each read and write bounded by `timeout` (a caller
/// with a deadline of its own: a peer that listens before it accepts is a wait,
/// not a failure). The stream's own timeouts are put back afterwards.
pub fn prove_tcp_within(
    stream: &TcpStream,
    secret: &JobSecret,
    timeout: Duration,
) -> Result<(), AuthError> {
    with_timeouts(stream, timeout.max(Duration::from_millis(1)), |s| {
        prove(s, secret)
    })
}

/// [`check`] on a TCP stream, bounded by [`HANDSHAKE_TIMEOUT`].
pub fn check_tcp(stream: &TcpStream, secret: &JobSecret) -> Result<(), AuthError> {
    with_timeouts(stream, HANDSHAKE_TIMEOUT, |s| check(s, secret))
}

/// [`prove`] on a tokio stream, bounded by [`HANDSHAKE_TIMEOUT`].
#[cfg(feature = "tokio")]
pub async fn prove_async<S>(stream: &mut S, secret: &JobSecret) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let (side, hello) = ClientSide::hello()?;
        stream.write_all(&hello).await?;
        let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
        stream.read_exact(&mut challenge).await?;
        let answer = side.answer(secret, &challenge)?;
        stream.write_all(&answer).await?;
        let mut verdict = [0u8; 1];
        match stream.read_exact(&mut verdict).await {
            Ok(_) if verdict[0] == ACCEPTED => Ok(()),
            Ok(_) => Err(AuthError::Refused),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(AuthError::Refused),
            Err(e) => Err(e.into()),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(AuthError::Io(io::ErrorKind::TimedOut.into())))
}

/// [`check`] on a tokio stream, bounded by [`HANDSHAKE_TIMEOUT`].
#[cfg(feature = "tokio")]
pub async fn check_async<S>(stream: &mut S, secret: &JobSecret) -> Result<(), AuthError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut magic = [0u8; 8];
        stream.read_exact(&mut magic).await?;
        if magic != MAGIC {
            return Err(AuthError::NoHandshake);
        }
        let mut client_nonce = [0u8; NONCE_LEN];
        stream.read_exact(&mut client_nonce).await?;
        let (side, challenge) = ServerSide::challenge(secret, &client_nonce)?;
        stream.write_all(&challenge).await?;
        let mut answer = [0u8; MAC_LEN];
        stream.read_exact(&mut answer).await?;
        if let Err(e) = side.verify(secret, &answer) {
            let _ = stream.write_all(&[REFUSED]).await;
            return Err(e);
        }
        stream.write_all(&[ACCEPTED]).await?;
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(AuthError::Io(io::ErrorKind::TimedOut.into())))
}

/// How many refusals are logged one by one; after them, one line per
/// [`LOG_EVERY`] more.
const LOGGED_ONE_BY_ONE: u64 = 10;
const LOG_EVERY: u64 = 1000;

/// What a server admits: the secret it checks (none: everyone), its count of
/// refused connections, and a bound on handshakes in progress (so that a flood of
/// silent connections holds neither threads nor descriptors beyond it).
#[derive(Debug)]
pub struct Gatekeeper {
    secret: Option<JobSecret>,
    service: &'static str,
    refused: AtomicU64,
    in_progress: AtomicUsize,
    max_in_progress: usize,
}

/// Handshakes a server runs at once by default; more connections arriving
/// meanwhile are closed at once (and counted as refused).
pub const MAX_HANDSHAKES: usize = 64;

impl Gatekeeper {
    /// The gatekeeper of `service` (named in its log lines).
    pub fn new(service: &'static str, secret: Option<JobSecret>) -> Arc<Gatekeeper> {
        Gatekeeper::with_limit(service, secret, MAX_HANDSHAKES)
    }

    /// [`new`](Self::new) with at most `max_in_progress` handshakes at once.
    pub fn with_limit(
        service: &'static str,
        secret: Option<JobSecret>,
        max_in_progress: usize,
    ) -> Arc<Gatekeeper> {
        Arc::new(Gatekeeper {
            secret,
            service,
            refused: AtomicU64::new(0),
            in_progress: AtomicUsize::new(0),
            max_in_progress: max_in_progress.max(1),
        })
    }

    /// The secret connections must prove, if any.
    pub fn secret(&self) -> Option<&JobSecret> {
        self.secret.as_ref()
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Admits the connection from `peer` when it proves the secret (or when there
    /// is none to prove); a refusal is counted and logged.
    pub fn admit(&self, stream: &TcpStream, peer: SocketAddr) -> bool {
        self.screen(stream, peer).is_ok()
    }

    /// [`admit`](Self::admit), saying why a connection was refused (a server can
    /// then tell a peer of its own protocol that it lacks the secret).
    pub fn screen(&self, stream: &TcpStream, peer: SocketAddr) -> Result<(), AuthError> {
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        let result = match self.enter() {
            Some(_slot) => check_tcp(stream, secret),
            None => Err(AuthError::Busy),
        };
        self.settle(result, peer)
    }

    /// [`admit`](Self::admit) on a tokio stream.
    #[cfg(feature = "tokio")]
    pub async fn admit_async<S>(&self, stream: &mut S, peer: SocketAddr) -> bool
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        self.screen_async(stream, peer).await.is_ok()
    }

    /// [`screen`](Self::screen) on a tokio stream.
    #[cfg(feature = "tokio")]
    pub async fn screen_async<S>(&self, stream: &mut S, peer: SocketAddr) -> Result<(), AuthError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let Some(secret) = &self.secret else {
            return Ok(());
        };
        let result = match self.enter() {
            Some(_slot) => check_async(stream, secret).await,
            None => Err(AuthError::Busy),
        };
        self.settle(result, peer)
    }

    fn enter(&self) -> Option<Slot<'_>> {
        let before = self.in_progress.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(&self.in_progress);
        (before < self.max_in_progress).then_some(slot)
    }

    fn settle(&self, result: Result<(), AuthError>, peer: SocketAddr) -> Result<(), AuthError> {
        if let Err(why) = &result {
            self.record(peer, why);
        }
        result
    }

    /// Counts and logs a refused connection (also for a server that refuses for
    /// a reason of its own after the handshake).
    pub fn record(&self, peer: SocketAddr, why: &AuthError) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= LOGGED_ONE_BY_ONE {
            warn!(service = self.service, %peer, refused = n, "connection refused: {why}");
        } else if n.is_multiple_of(LOG_EVERY) {
            warn!(
                service = self.service,
                last_peer = %peer,
                refused = n,
                "{n} connections refused so far (the last: {why})"
            );
        }
    }
}

/// One handshake in progress; leaving frees its place.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests;
