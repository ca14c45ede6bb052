//! Opening a store from a bad URL or configuration gives one clear sentence.

use ckpt_storage::{Backend, ErrorKind, Store, StoreConfig};

fn open_err(url: &str, config: StoreConfig) -> ckpt_storage::Error {
    match Store::open(url, config) {
        Ok(store) => panic!("{url} opened as {store:?}"),
        Err(e) => e,
    }
}

#[test]
fn unknown_scheme_names_the_scheme_and_the_choices() {
    let err = open_err("ftp://host/dir", StoreConfig::default());
    assert_eq!(err.kind(), ErrorKind::Config);
    let message = err.to_string();
    assert!(message.contains("\"ftp\""), "{message}");
    assert!(message.contains("s3://"), "{message}");
}

#[test]
fn unparsable_url_is_a_config_error() {
    let err = open_err("s3://bad host/x", StoreConfig::default());
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("cannot parse"), "{err}");
    assert_eq!(
        open_err("", StoreConfig::default()).kind(),
        ErrorKind::Config
    );
}

#[test]
fn missing_bucket_is_named() {
    let err = open_err("s3:///prefix", StoreConfig::default());
    assert!(err.to_string().contains("names no bucket"), "{err}");
    let err = open_err("az:///prefix", StoreConfig::default());
    assert!(err.to_string().contains("names no container"), "{err}");
}

#[test]
fn unknown_option_is_named() {
    let config = StoreConfig::default().with_option("aws_no_such_thing", "1");
    let err = open_err("s3://bucket/prefix", config);
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("aws_no_such_thing"), "{err}");
}

#[test]
fn missing_azure_credentials_are_a_config_error() {
    // No account anywhere (the variable is cleared for this process's builder only
    // if present; the test relies on it not being set in the test environment).
    if std::env::var_os("AZURE_STORAGE_ACCOUNT_NAME").is_some() {
        panic!("AZURE_STORAGE_ACCOUNT_NAME is set; this test needs an environment without it");
    }
    let err = open_err("az://container/prefix", StoreConfig::default());
    assert_eq!(err.kind(), ErrorKind::Config);
    let message = err.to_string();
    assert!(
        message.starts_with("cannot configure store az://container/prefix"),
        "{message}"
    );
    assert!(message.to_lowercase().contains("account"), "{message}");
}

#[test]
fn options_do_not_apply_to_local_stores() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let err = open_err(&url, StoreConfig::default().with_option("aws_region", "x"));
    assert_eq!(err.kind(), ErrorKind::Config);
}

#[test]
fn invalid_settings_are_rejected_before_opening() {
    let config = StoreConfig {
        part_concurrency: 0,
        ..StoreConfig::default()
    };
    let err = open_err("memory://x", config);
    assert!(err.to_string().contains("part_concurrency"), "{err}");
}

#[tokio::test]
async fn relative_local_paths_become_absolute_and_are_created_on_write() {
    let dir = tempfile::tempdir().unwrap();
    let nested = dir.path().join("a/b");
    let store = Store::from_url(&format!("file://{}", nested.display())).unwrap();
    assert_eq!(store.backend(), Backend::Local);
    assert!(!nested.exists(), "opening has no side effect");
    assert!(store.list("").await.unwrap().is_empty());
    store.put("k", &b"v"[..]).await.unwrap();
    assert!(
        nested.join("k").is_file(),
        "the first write creates the directory"
    );

    // `file://rel/dir` and a plain relative path resolve against the current directory.
    let cwd = std::env::current_dir().unwrap();
    let rel = format!("target/ckpt-open-test-{}", std::process::id());
    let store = Store::from_url(&format!("file://{rel}")).unwrap();
    let expected = cwd.canonicalize().unwrap().join(&rel);
    assert_eq!(store.url(), format!("file://{}", expected.display()));
    let plain = Store::from_url(&rel).unwrap();
    assert_eq!(plain.url(), store.url());
    store.put("x", &b"1"[..]).await.unwrap();
    assert_eq!(plain.get("x").await.unwrap(), &b"1"[..]);
    std::fs::remove_dir_all(expected).unwrap();
}

#[tokio::test]
async fn keys_cannot_escape_the_root() {
    let store = Store::from_url("memory://escape").unwrap();
    for key in [
        "../outside",
        "a/../../b",
        "/abs",
        "a//b",
        "a/./b",
        "trailing/",
        "",
    ] {
        let err = store.put(key, &b"x"[..]).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{key:?}: {err}");
        assert!(err.to_string().contains("memory://escape"), "{err}");
    }
}

#[tokio::test]
async fn memory_stores_are_shared_by_name() {
    let a = Store::from_url("memory://shared-by-name").unwrap();
    let b = Store::from_url("memory://shared-by-name").unwrap();
    let c = Store::from_url("memory://another-name").unwrap();
    a.put("k", &b"v"[..]).await.unwrap();
    assert_eq!(b.get("k").await.unwrap(), &b"v"[..]);
    assert_eq!(c.get("k").await.unwrap_err().kind(), ErrorKind::NotFound);
}

/// Ranks open the same root at once while the first write of one of them creates
/// its directory: seen missing, then present, the directory is no "file".
#[test]
fn a_local_directory_created_while_the_store_opens_is_not_taken_for_a_file() {
    let base = tempfile::tempdir().expect("tempdir");
    let mut refused = Vec::new();
    for i in 0..300 {
        let dir = base.path().join(format!("root-{i}"));
        let url = format!("file://{}", dir.join("ckpt").display());
        let creator = {
            let dir = dir.clone();
            std::thread::spawn(move || std::fs::create_dir_all(dir.join("ckpt")).expect("mkdir"))
        };
        for _ in 0..20 {
            if let Err(e) = Store::open(&url, StoreConfig::default()) {
                refused.push(e.to_string());
            }
        }
        creator.join().expect("creator");
    }
    assert!(
        refused.is_empty(),
        "{} opens refused, e.g. {}",
        refused.len(),
        refused[0]
    );
}
