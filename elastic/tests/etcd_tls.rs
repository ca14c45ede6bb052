//! The etcd control plane against a secured etcd: the test command's member that
//! serves TLS only, requires client certificates (`--client-cert-auth`) and has auth
//! on (`CKPT_TEST_ETCD_TLS`, with the CA, the client's certificate and key, and two
//! users: `ckpt`, whose role covers the tests' prefix, and `ckpt-other`, whose role
//! covers another). Members with the certificate and the password form generations;
//! every client that lacks something is refused at once with an error that says
//! what, never after the connect timeout as if etcd were down.

#![cfg(feature = "etcd")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

mod common;

use ckpt_testkit::{Capability, has_probed};

use ckpt_elastic::{
    Cancel, ControlPlane, CoordinatorConfig, ElasticError, EtcdControlPlane, EtcdJob, EtcdSettings,
    EtcdTls, EtcdUrl, EtcdUser,
};
use common::{assert_one_generation, member, unique_job};

/// What `scripts/test` exports about the secured etcd.
const VARS: [&str; 9] = [
    "CKPT_TEST_ETCD",
    "CKPT_TEST_ETCD_TLS",
    "CKPT_TEST_ETCD_TLS_CACERT",
    "CKPT_TEST_ETCD_TLS_CERT",
    "CKPT_TEST_ETCD_TLS_KEY",
    "CKPT_TEST_ETCD_TLS_USER",
    "CKPT_TEST_ETCD_TLS_PASSWORD_FILE",
    "CKPT_TEST_ETCD_TLS_OTHER_USER",
    "CKPT_TEST_ETCD_TLS_OTHER_PASSWORD_FILE",
];

/// Whether the secured etcd is there; skips loudly, or fails when `CKPT_REQUIRE`
/// names `etcd`.
fn secured_etcd() -> bool {
    let unset: Vec<&str> = VARS
        .iter()
        .copied()
        .filter(|v| std::env::var(v).map_or(true, |value| value.is_empty()))
        .collect();
    has_probed(
        Capability::Etcd,
        (!unset.is_empty()).then(|| {
            format!(
                "{} not set (run `scripts/test`, or source the output of `scripts/test --env`)",
                unset.join(", ")
            )
        }),
    )
}

fn var(name: &str) -> String {
    ckpt_testkit::env(name)
}

fn url() -> EtcdUrl {
    EtcdUrl::parse(&var("CKPT_TEST_ETCD_TLS")).unwrap()
}

fn password(file_var: &str) -> String {
    std::fs::read_to_string(var(file_var))
        .unwrap()
        .trim()
        .to_owned()
}

/// TLS with the test CA and the client certificate.
fn mutual_tls() -> EtcdTls {
    EtcdTls {
        ca: var("CKPT_TEST_ETCD_TLS_CACERT").into(),
        identity: Some((
            var("CKPT_TEST_ETCD_TLS_CERT").into(),
            var("CKPT_TEST_ETCD_TLS_KEY").into(),
        )),
    }
}

/// Everything right: the certificate and the job user's password.
fn good() -> EtcdSettings {
    EtcdSettings {
        tls: Some(mutual_tls()),
        user: Some(EtcdUser::new(
            var("CKPT_TEST_ETCD_TLS_USER"),
            password("CKPT_TEST_ETCD_TLS_PASSWORD_FILE"),
        )),
        ..EtcdSettings::default()
    }
}

/// A launcher's connection for a new job with `settings`: the error it gets, which
/// must come within [`PROMPT`].
fn refusal(settings: EtcdSettings) -> String {
    refusal_at(&url(), settings)
}

fn refusal_at(url: &EtcdUrl, settings: EtcdSettings) -> String {
    let config = CoordinatorConfig::new(unique_job("refused"), 1, 1);
    let started = Instant::now();
    match EtcdJob::connect(url, &config, settings) {
        Ok(_) => panic!("connected to etcd with settings that lack something"),
        Err(ElasticError::Rejected(e)) => {
            let took = started.elapsed();
            eprintln!("refused after {took:?}: {e}");
            assert!(took < PROMPT, "refused after {took:?}: {e}");
            e
        }
        Err(e) => panic!("refused, but not as a refusal (one retrying could not help): {e}"),
    }
}

/// Refusals come at once: well within the connect timeout (30 s), which is what a
/// client that took them for an unreachable etcd would wait.
const PROMPT: Duration = Duration::from_secs(10);

#[test]
fn members_with_a_client_certificate_and_a_password_form_a_generation() {
    if !secured_etcd() {
        return;
    }
    let job = unique_job("tls");
    let config = CoordinatorConfig::new(job.clone(), 3, 3);
    let launcher = EtcdJob::connect(&url(), &config, good()).unwrap();
    let planes: Vec<_> = (0..3)
        .map(|i| {
            std::sync::Arc::new(
                EtcdControlPlane::connect(&url(), member(&job, i), None, good()).unwrap(),
            )
        })
        .collect();
    let threads: Vec<_> = planes
        .iter()
        .map(|p| {
            let p = p.clone();
            std::thread::spawn(move || p.rendezvous(0, &Cancel::new()).unwrap())
        })
        .collect();
    let assignments: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let generation = assert_one_generation(&assignments, &["m0", "m1", "m2"]);
    // Bootstrap keys travel through the same watches.
    planes[0]
        .kv_set(generation, "addr", "127.0.0.1:1234")
        .unwrap();
    let got = planes[2]
        .kv_get(generation, "addr", &Cancel::new(), Duration::from_secs(10))
        .unwrap();
    assert_eq!(got, "127.0.0.1:1234");
    let formed = launcher.wait_for_event(
        Duration::from_secs(10),
        |e| matches!(e, ckpt_elastic::Event::Formed { generation: g, .. } if *g == generation),
    );
    assert!(formed.is_some(), "the launcher sees the generation form");
}

#[test]
fn a_client_without_a_client_certificate_is_refused_naming_tls() {
    if !secured_etcd() {
        return;
    }
    let mut settings = good();
    settings.tls = Some(EtcdTls {
        identity: None,
        ..mutual_tls()
    });
    let e = refusal(settings);
    assert!(e.contains("TLS"), "{e}");
    assert!(
        e.contains("client certificate"),
        "the error says what is missing: {e}"
    );
}

#[test]
fn a_client_that_does_not_speak_tls_is_refused_naming_tls() {
    if !secured_etcd() {
        return;
    }
    let mut settings = good();
    settings.tls = None;
    let e = refusal(settings);
    assert!(e.contains("TLS"), "{e}");
    assert!(
        e.contains("CKPT_ETCD_CACERT"),
        "the error says what to set: {e}"
    );
}

#[test]
fn a_client_that_does_not_speak_tls_and_has_no_user_is_refused_naming_tls() {
    if !secured_etcd() {
        return;
    }
    // No user: nothing is sent when connecting; the first request finds out.
    let e = refusal(EtcdSettings::default());
    assert!(e.contains("TLS"), "{e}");
    assert!(
        e.contains("CKPT_ETCD_CACERT"),
        "the error says what to set: {e}"
    );
}

#[test]
fn a_tls_client_against_a_plaintext_etcd_is_refused_naming_tls() {
    if !secured_etcd() {
        return;
    }
    let plaintext = EtcdUrl::parse(&var("CKPT_TEST_ETCD")).unwrap();
    let settings = EtcdSettings {
        tls: Some(mutual_tls()),
        ..EtcdSettings::default()
    };
    let e = refusal_at(&plaintext, settings);
    assert!(e.contains("TLS"), "{e}");
}

#[test]
fn a_wrong_password_is_refused_naming_authentication() {
    if !secured_etcd() {
        return;
    }
    let mut settings = good();
    let secret = "not-the-password-0123456789";
    settings.user = Some(EtcdUser::new(var("CKPT_TEST_ETCD_TLS_USER"), secret));
    let e = refusal(settings);
    assert!(e.contains("authentication failed"), "{e}");
    assert!(
        e.contains(&var("CKPT_TEST_ETCD_TLS_USER")),
        "the error names the user: {e}"
    );
    assert!(!e.contains(secret), "the error shows the password: {e}");
}

#[test]
fn a_user_without_permission_on_the_prefix_is_refused() {
    if !secured_etcd() {
        return;
    }
    let mut settings = good();
    settings.user = Some(EtcdUser::new(
        var("CKPT_TEST_ETCD_TLS_OTHER_USER"),
        password("CKPT_TEST_ETCD_TLS_OTHER_PASSWORD_FILE"),
    ));
    let e = refusal(settings);
    assert!(e.contains("permission denied"), "{e}");
    assert!(
        e.contains(&var("CKPT_TEST_ETCD_TLS_OTHER_USER")),
        "the error names the user: {e}"
    );
}

#[test]
fn a_missing_certificate_file_is_named_before_any_connection() {
    // No server needed: the files are read before etcd is contacted.
    let missing = PathBuf::from("/nonexistent/ckpt-etcd-client.crt");
    let ca = std::env::temp_dir().join(format!("ckpt-etcd-tls-ca-{}.pem", std::process::id()));
    std::fs::write(
        &ca,
        "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let settings = EtcdSettings {
        tls: Some(EtcdTls {
            ca: ca.clone(),
            identity: Some((missing.clone(), "/nonexistent/key.pem".into())),
        }),
        ..EtcdSettings::default()
    };
    let config = CoordinatorConfig::new(unique_job("files"), 1, 1);
    let url = EtcdUrl::parse("etcd://127.0.0.1:9/ckpt-test-tls").unwrap();
    let e = match EtcdJob::connect(&url, &config, settings.clone()) {
        Err(ElasticError::Rejected(e)) => e,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected without a client certificate file"),
    };
    assert!(e.contains(&missing.display().to_string()), "{e}");
    assert!(e.contains("client certificate"), "{e}");
    // A file that holds no certificate is named too.
    let not_pem = ca.with_extension("txt");
    std::fs::write(&not_pem, "hello").unwrap();
    let settings = EtcdSettings {
        tls: Some(EtcdTls {
            ca: not_pem.clone(),
            identity: None,
        }),
        ..settings
    };
    let e = match EtcdJob::connect(&url, &config, settings) {
        Err(ElasticError::Rejected(e)) => e,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected with a CA file that holds no certificate"),
    };
    assert!(e.contains(&not_pem.display().to_string()), "{e}");
    assert!(e.contains("no PEM CERTIFICATE"), "{e}");
    let _ = std::fs::remove_file(ca);
    let _ = std::fs::remove_file(not_pem);
}
