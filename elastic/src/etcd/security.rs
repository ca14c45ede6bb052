//! Who may talk to etcd: TLS (the CA that signed etcd's server certificates, and this
//! client's certificate where etcd requires one) and etcd's own users.
//!
//! # Why
//!
//! Whoever can write a job's keys decides who trains: they can end a generation or
//! join one. The job secret (`CKPT_JOB_SECRET`) guards the coordinator and the node
//! agents, not etcd; etcd is guarded by its own means, TLS with client certificates
//! (`--client-cert-auth`) and users whose roles cover the job's prefix. A cluster
//! shared by several teams is run that way, so the backend must speak it.
//!
//! # Where the settings come from
//!
//! From the environment, as the job secret does and as `etcdctl` does
//! (`ETCDCTL_CACERT`…), so that every process that talks to etcd — `ckpt launch` and
//! its node agent, a rank started by hand with `CKPT_RDZV=etcd://…`, `ckpt bench` —
//! takes the same settings the same way ([`EtcdSettings::from_env`]):
//!
//! | variable | what |
//! |---|---|
//! | `CKPT_ETCD_CACERT` | PEM file of the CA that etcd's server certificates chain to; set: TLS |
//! | `CKPT_ETCD_CERT`, `CKPT_ETCD_KEY` | PEM files of this client's certificate and private key (mutual TLS); both or neither |
//! | `CKPT_ETCD_USER` | the etcd user requests are made as |
//! | `CKPT_ETCD_PASSWORD`, `CKPT_ETCD_PASSWORD_FILE` | its password, or a file holding it; one of the two |
//!
//! TLS is on exactly when a CA is named: the backend trusts no system roots (an
//! etcd cluster's certificates come from its operators' own CA), and one switch
//! cannot disagree with another. Certificate files are read when a client connects,
//! so an error names the file; a password is read when the settings are, and never
//! appears in a log, an error or `Debug` output.
//!
//! # Errors
//!
//! What the TLS layer or etcd refuses — a handshake (no client certificate, a
//! server certificate the CA did not sign), a user or password, a request outside
//! the user's roles — is [`ElasticError::Rejected`] with a message that says which,
//! at once: retrying a refusal cannot help, and it must not look like a timeout.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, Identity, TlsOptions};

use super::EtcdSettings;
use crate::ElasticError;

/// The PEM file of the CA certificate(s) that etcd's server certificates chain to.
pub const CACERT_ENV: &str = "CKPT_ETCD_CACERT";
/// The PEM file of this client's certificate (needs [`KEY_ENV`] and [`CACERT_ENV`]).
pub const CERT_ENV: &str = "CKPT_ETCD_CERT";
/// The PEM file of this client's private key (needs [`CERT_ENV`]).
pub const KEY_ENV: &str = "CKPT_ETCD_KEY";
/// The etcd user.
pub const USER_ENV: &str = "CKPT_ETCD_USER";
/// The etcd user's password.
pub const PASSWORD_ENV: &str = "CKPT_ETCD_PASSWORD";
/// A file holding the etcd user's password (surrounding whitespace ignored).
pub const PASSWORD_FILE_ENV: &str = "CKPT_ETCD_PASSWORD_FILE";

/// Every variable of this module, for a process that hands its environment on.
pub const ALL_ENV: [&str; 6] = [
    CACERT_ENV,
    CERT_ENV,
    KEY_ENV,
    USER_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
];

/// The longest password file read (bytes).
const MAX_PASSWORD_FILE: u64 = 4096;
/// The largest certificate or key file read (bytes).
const MAX_PEM_FILE: u64 = 1 << 20;

/// TLS to etcd: the CA that signed its members' certificates, and this client's own
/// certificate where etcd requires one (`--client-cert-auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM file of the CA certificate(s) that etcd's server certificates chain to.
    pub ca: PathBuf,
    /// PEM files of this client's certificate and of its private key: mutual TLS.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// An etcd user and its password (`Debug` shows the name only).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// The user's name.
    pub name: String,
    password: String,
}

impl EtcdUser {
    /// The user `name` with `password`.
    pub fn new(name: impl Into<String>, password: impl Into<String>) -> EtcdUser {
        EtcdUser {
            name: name.into(),
            password: password.into(),
        }
    }

    pub(super) fn password(&self) -> &str {
        &self.password
    }
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .field("password", &"…")
            .finish()
    }
}

impl EtcdSettings {
    /// The default settings, with TLS and the user from the environment (the
    /// variables of this module; unset or empty ones count as unset). The error names
    /// the variables: a key without a certificate, a certificate without a CA, a user
    /// without a password or a password without a user, both a password and a
    /// password file, an unreadable password file.
    pub fn from_env() -> Result<EtcdSettings, String> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// [`EtcdSettings::from_env`] over `var` (the value of a variable, `None` when
    /// unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<EtcdSettings, String> {
        let identity = match (var(CERT_ENV), var(KEY_ENV)) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
            (None, Some(_)) => {
                return Err(format!(
                    "{KEY_ENV} is set but {CERT_ENV} is not: a client key needs its certificate"
                ));
            }
            (Some(_), None) => {
                return Err(format!(
                    "{CERT_ENV} is set but {KEY_ENV} is not: a client certificate needs its private key"
                ));
            }
        };
        let tls = match (var(CACERT_ENV), identity) {
            (Some(ca), identity) => Some(EtcdTls {
                ca: PathBuf::from(ca),
                identity,
            }),
            (None, Some(_)) => {
                return Err(format!(
                    "{CERT_ENV} is set but {CACERT_ENV} is not: TLS needs the CA that signed etcd's server certificates"
                ));
            }
            (None, None) => None,
        };
        let password = match (var(PASSWORD_ENV), var(PASSWORD_FILE_ENV)) {
            (None, None) => None,
            (Some(_), Some(_)) => {
                return Err(format!(
                    "both {PASSWORD_ENV} and {PASSWORD_FILE_ENV} are set; set one"
                ));
            }
            (Some(text), None) => Some(text),
            (None, Some(path)) => Some(read_password(Path::new(&path))?),
        };
        let user = match (var(USER_ENV), password) {
            (None, None) => None,
            (Some(name), Some(password)) => Some(EtcdUser::new(name, password)),
            (Some(name), None) => {
                return Err(format!(
                    "{USER_ENV}={name:?} needs a password: set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}"
                ));
            }
            (None, Some(_)) => {
                return Err(format!(
                    "an etcd password is set but {USER_ENV} is not: name the user"
                ));
            }
        };
        Ok(EtcdSettings {
            tls,
            user,
            ..EtcdSettings::default()
        })
    }
}

fn read_password(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let what = |e: &dyn std::fmt::Display| {
        format!(
            "cannot read the etcd password file {} ({PASSWORD_FILE_ENV}): {e}",
            path.display()
        )
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PASSWORD_FILE + 1).read_to_string(&mut text))
        .map_err(|e| what(&e))?;
    if text.len() as u64 > MAX_PASSWORD_FILE {
        return Err(what(&format_args!("longer than {MAX_PASSWORD_FILE} bytes")));
    }
    let text = text.trim();
    if text.is_empty() {
        return Err(what(&"the file is empty"));
    }
    Ok(text.to_owned())
}

/// Reads a PEM file that must hold a block whose label ends with `label`
/// (`CERTIFICATE`, `PRIVATE KEY`); the error names `role` and the file.
fn read_pem(path: &Path, role: &str, label: &str) -> Result<Vec<u8>, ElasticError> {
    use std::io::Read;
    let refuse = |e: &dyn std::fmt::Display| {
        ElasticError::Rejected(format!(
            "etcd TLS: cannot use {} as the {role}: {e}",
            path.display()
        ))
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_FILE + 1).read_to_end(&mut bytes))
        .map_err(|e| refuse(&e))?;
    if bytes.len() as u64 > MAX_PEM_FILE {
        return Err(refuse(&format_args!("larger than {MAX_PEM_FILE} bytes")));
    }
    let text = String::from_utf8_lossy(&bytes);
    let holds = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|found| found.ends_with(label))
    });
    if !holds {
        return Err(refuse(&format_args!("no PEM {label} block in it")));
    }
    Ok(bytes)
}

/// The client's TLS configuration, its files read and checked now.
pub(super) fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, ElasticError> {
    let ca = read_pem(&tls.ca, "CA certificate", "CERTIFICATE")?;
    let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
    if let Some((cert, key)) = &tls.identity {
        let cert = read_pem(cert, "client certificate", "CERTIFICATE")?;
        let key = read_pem(key, "client key", "PRIVATE KEY")?;
        options = options.identity(Identity::from_pem(cert, key));
    }
    Ok(options)
}

/// What the TLS layer or etcd refused in `e`, if it did: a TLS handshake, the
/// user's credentials, or a request outside the user's roles. Retrying cannot help.
pub(super) fn refusal(e: &etcd_client::Error, settings: &EtcdSettings) -> Option<String> {
    if let etcd_client::Error::GRpcStatus(status) = e {
        let message = status.message();
        match i32::from(status.code()) {
            code::UNAUTHENTICATED | code::INVALID_ARGUMENT
                if message.contains("authentication failed")
                    || message.contains("invalid auth token") =>
            {
                return Some(format!(
                    "etcd authentication failed for user {}: {message} (check {USER_ENV} and {PASSWORD_ENV} or {PASSWORD_FILE_ENV})",
                    user_name(settings)
                ));
            }
            code::FAILED_PRECONDITION if message.contains("authentication is not enabled") => {
                return Some(format!(
                    "etcd authentication: a user is set ({}) but this etcd cluster has authentication disabled ({message}); unset {USER_ENV} or enable auth in etcd",
                    user_name(settings)
                ));
            }
            code::PERMISSION_DENIED => {
                return Some(format!(
                    "etcd refused the request, permission denied for user {}: {message} (grant the user a role with readwrite on the job's prefix)",
                    user_name(settings)
                ));
            }
            _ => {}
        }
    }
    let chain = error_chain(e);
    let lower = chain.to_ascii_lowercase();
    // Verdicts of the TLS layer (rustls' messages, tonic's for a configuration it
    // cannot use), not a connection that ended mid-handshake, which a member going
    // down also causes and which is retried like any other.
    const TLS_VERDICTS: [&str; 7] = [
        "received fatal alert",
        "invalid peer certificate",
        "received corrupt message",
        "peer is incompatible",
        "peer misbehaved",
        "peer sent no certificates",
        "tls config",
    ];
    if TLS_VERDICTS.iter().any(|m| lower.contains(m)) {
        let hint = match &settings.tls {
            None => format!(
                "this client connects without TLS ({CACERT_ENV} is unset): if etcd serves TLS, name its CA"
            ),
            Some(EtcdTls { identity: None, .. }) => format!(
                "no client certificate is set ({CERT_ENV}, {KEY_ENV}): etcd may require one (--client-cert-auth)"
            ),
            Some(EtcdTls { ca, .. }) => format!(
                "check that {} signed etcd's server certificate and etcd trusts the client certificate",
                ca.display()
            ),
        };
        return Some(format!("etcd TLS handshake failed: {chain}; {hint}"));
    }
    None
}

/// At a client's first contact, when `error` is a failure to reach etcd: whether
/// an endpoint speaks the other protocol (TLS to a plaintext client, plaintext to a
/// TLS client), and if so the refusal that says which variable to change. A server
/// closes a connection in the protocol it does not speak without a word, which the
/// client cannot tell from a member going down; a probe of its own can.
pub(super) async fn protocol_mismatch(
    hosts: &[String],
    settings: &EtcdSettings,
    error: &ElasticError,
) -> Option<ElasticError> {
    for host in hosts {
        match (serves_tls(host).await, &settings.tls) {
            (Some(true), None) => {
                return Some(ElasticError::Rejected(format!(
                    "etcd at {host} speaks TLS and this client does not ({CACERT_ENV} is unset): set {CACERT_ENV} to the CA of etcd's server certificates (the failed request: {error})"
                )));
            }
            (Some(false), Some(_)) => {
                return Some(ElasticError::Rejected(format!(
                    "etcd at {host} does not speak TLS and this client does ({CACERT_ENV} is set): unset {CACERT_ENV}, or serve TLS in etcd (the failed request: {error})"
                )));
            }
            _ => {}
        }
    }
    None
}

/// Whether `host` (`HOST:PORT`) speaks TLS, probed with a TLS record that opens a
/// handshake with messages no server accepts (HelloRequests) and ends in a line
/// break: a TLS server answers with an alert; a plaintext etcd, whose listener reads
/// a line to tell HTTP/1 from HTTP/2, closes. `None`: no connection, or no answer
/// within a second.
async fn serves_tls(host: &str) -> Option<bool> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const ALERT: u8 = 0x15;
    const HANDSHAKE: u8 = 0x16;
    let mut hello = vec![HANDSHAKE, 0x03, 0x01, 0x00, 30];
    hello.extend_from_slice(&[0; 28]);
    hello.extend_from_slice(b"\r\n");
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(host).await.ok()?;
        stream.write_all(&hello).await.ok()?;
        let mut first = [0u8; 3];
        let tls = match stream.read_exact(&mut first).await {
            Ok(_) => matches!(first, [ALERT | HANDSHAKE, 0x03, _]),
            // Closed on the record: not a TLS server, which would have said why.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => false,
            Err(_) => return None,
        };
        Some(tls)
    };
    tokio::time::timeout(std::time::Duration::from_secs(1), probe)
        .await
        .ok()
        .flatten()
}

fn user_name(settings: &EtcdSettings) -> String {
    match &settings.user {
        Some(user) => format!("{:?}", user.name),
        None => format!("(none: {USER_ENV} is unset)"),
    }
}

/// `e` and its sources, joined.
fn error_chain(e: &etcd_client::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let part = inner.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = inner.source();
    }
    text
}

/// gRPC status codes (etcd-client's statuses are tonic's, whose `Code` converts to
/// these numbers).
mod code {
    pub(super) const INVALID_ARGUMENT: i32 = 3;
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const FAILED_PRECONDITION: i32 = 9;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<EtcdSettings, String> {
        EtcdSettings::from_vars(|name| {
            vars.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        })
    }

    #[test]
    fn no_variables_mean_plaintext_without_a_user() {
        assert_eq!(settings(&[]).unwrap(), EtcdSettings::default());
    }

    #[test]
    fn a_ca_turns_tls_on_and_a_certificate_and_key_add_a_client_identity() {
        let s = settings(&[
            (CACERT_ENV, "/ca.pem"),
            (CERT_ENV, "/c.pem"),
            (KEY_ENV, "/k.pem"),
            (USER_ENV, "job"),
            (PASSWORD_ENV, "pw"),
        ])
        .unwrap();
        assert_eq!(
            s.tls,
            Some(EtcdTls {
                ca: "/ca.pem".into(),
                identity: Some(("/c.pem".into(), "/k.pem".into())),
            })
        );
        assert_eq!(s.user, Some(EtcdUser::new("job", "pw")));
        let only_ca = settings(&[(CACERT_ENV, "/ca.pem")]).unwrap();
        assert_eq!(only_ca.tls.unwrap().identity, None);
    }

    #[test]
    fn incomplete_or_contradicting_variables_are_refused_by_name() {
        for (vars, names) in [
            (&[(KEY_ENV, "/k.pem")][..], [KEY_ENV, CERT_ENV]),
            (
                &[(CERT_ENV, "/c.pem"), (CACERT_ENV, "/ca")][..],
                [CERT_ENV, KEY_ENV],
            ),
            (
                &[(CERT_ENV, "/c.pem"), (KEY_ENV, "/k")][..],
                [CERT_ENV, CACERT_ENV],
            ),
            (&[(USER_ENV, "job")][..], [USER_ENV, PASSWORD_ENV]),
            (&[(PASSWORD_ENV, "pw")][..], [USER_ENV, USER_ENV]),
            (
                &[
                    (USER_ENV, "job"),
                    (PASSWORD_ENV, "pw"),
                    (PASSWORD_FILE_ENV, "/p"),
                ][..],
                [PASSWORD_ENV, PASSWORD_FILE_ENV],
            ),
        ] {
            let e = settings(vars).unwrap_err();
            for name in names {
                assert!(e.contains(name), "{vars:?}: {e}");
            }
            assert!(
                !e.contains("pw\""),
                "{vars:?}: the error shows the password: {e}"
            );
        }
    }

    #[test]
    fn a_password_file_is_read_trimmed_and_a_missing_one_is_named() {
        let dir = std::env::temp_dir().join(format!("ckpt-etcd-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret\n").unwrap();
        let path = file.to_str().unwrap();
        let s = settings(&[(USER_ENV, "job"), (PASSWORD_FILE_ENV, path)]).unwrap();
        assert_eq!(s.user.unwrap().password(), "s3cret");
        let gone = dir.join("gone");
        let e = settings(&[
            (USER_ENV, "job"),
            (PASSWORD_FILE_ENV, gone.to_str().unwrap()),
        ])
        .unwrap_err();
        assert!(e.contains(gone.to_str().unwrap()), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn debug_output_shows_the_user_but_not_the_password() {
        let s = EtcdSettings {
            user: Some(EtcdUser::new("job", "hunter2-secret")),
            ..EtcdSettings::default()
        };
        let shown = format!("{s:?}");
        assert!(shown.contains("job"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
