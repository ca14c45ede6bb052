//! Retry behaviour against a real server behind a fault-injecting proxy.
//!
//! The proxy sits on loopback in front of the S3 test server. Its first N
//! connections fail in a chosen way (a 503 answer, or a reset); later connections
//! are relayed untouched. Each test opens its own store, so no pooled connection
//! from another test bypasses the faults.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ckpt_storage::{ErrorKind, RetrySettings, Store, StoreConfig};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy)]
enum Fault {
    /// Read the request head, answer `503 Service Unavailable`, close.
    Unavailable,
    /// Close the connection with a TCP reset before answering.
    Reset,
}

struct FaultProxy {
    endpoint: String,
    connections: Arc<AtomicUsize>,
}

impl FaultProxy {
    async fn start(upstream: String, fault: Fault, failures: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if n < failures {
                        inject(client, fault).await;
                    } else {
                        relay(client, &upstream).await;
                    }
                });
            }
        });
        Self {
            endpoint,
            connections,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn inject(mut client: TcpStream, fault: Fault) {
    match fault {
        Fault::Unavailable => {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = client
                .write_all(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                )
                .await;
            let _ = client.shutdown().await;
        }
        Fault::Reset => {
            // A zero linger makes close send RST at once (the deprecation is about
            // non-zero lingers blocking the thread).
            #[allow(deprecated)]
            let _ = client.set_linger(Some(Duration::ZERO));
            drop(client);
        }
    }
}

async fn relay(mut client: TcpStream, upstream: &str) {
    let address = upstream.trim_start_matches("http://");
    if let Ok(mut server) = TcpStream::connect(address).await {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
    }
}

fn retry_config(max_retries: usize) -> StoreConfig {
    StoreConfig {
        retry: RetrySettings {
            max_retries,
            retry_timeout: Duration::from_secs(30),
            init_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
            backoff_base: 2.0,
        },
        ..StoreConfig::default()
    }
}

/// A store on the S3 server, seeded with `key`, and a second handle on the same
/// bucket prefix reached through a proxy that fails `failures` connections.
async fn through_proxy(
    name: &str,
    fault: Fault,
    failures: usize,
    max_retries: usize,
) -> (Store, FaultProxy) {
    let upstream = env("CKPT_TEST_S3_ENDPOINT");
    let bucket = env("CKPT_TEST_S3_BUCKET");
    let proxy = FaultProxy::start(upstream, fault, failures).await;
    let url = format!("s3://{bucket}/{}", unique(name));
    let store = Store::open(&url, s3_config(&proxy.endpoint, retry_config(max_retries))).unwrap();
    (store, proxy)
}

async fn seed_direct(store: &Store, key: &str, data: &'static [u8]) {
    let direct = Store::open(
        store.url(),
        s3_config(&env("CKPT_TEST_S3_ENDPOINT"), retry_config(0)),
    )
    .unwrap();
    direct.put(key, Bytes::from_static(data)).await.unwrap();
}

#[tokio::test]
async fn get_succeeds_after_503s_within_the_retry_budget() {
    if !has(Capability::Servers) {
        return;
    }
    let (store, proxy) = through_proxy("retry-503", Fault::Unavailable, 3, 5).await;
    seed_direct(&store, "object", b"payload").await;
    assert_eq!(store.get("object").await.unwrap(), &b"payload"[..]);
    assert_eq!(
        proxy.connections(),
        4,
        "3 refused attempts, then one that passed"
    );
}

#[tokio::test]
async fn get_succeeds_after_connection_resets() {
    if !has(Capability::Servers) {
        return;
    }
    let (store, proxy) = through_proxy("retry-reset", Fault::Reset, 2, 5).await;
    seed_direct(&store, "object", b"payload").await;
    assert_eq!(store.get_range("object", 1..4).await.unwrap(), &b"ayl"[..]);
    assert_eq!(proxy.connections(), 3);
}

#[tokio::test]
async fn put_is_retried_after_503() {
    if !has(Capability::Servers) {
        return;
    }
    let (store, proxy) = through_proxy("retry-put", Fault::Unavailable, 2, 5).await;
    store.put("written", &b"through faults"[..]).await.unwrap();
    assert!(proxy.connections() >= 3);
    assert_eq!(store.get("written").await.unwrap(), &b"through faults"[..]);
}

#[tokio::test]
async fn exhausted_retries_give_a_transient_error_naming_the_key() {
    if !has(Capability::Servers) {
        return;
    }
    let (store, proxy) = through_proxy("retry-exhausted", Fault::Unavailable, 100, 2).await;
    let err = store.get("object").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    assert!(err.is_retryable());
    let message = err.to_string();
    assert!(message.contains(store.url()), "{message}");
    assert!(message.contains("object"), "{message}");
    assert!(message.contains("503"), "{message}");
    assert_eq!(proxy.connections(), 3, "one attempt and two retries");
}

#[tokio::test]
async fn resets_past_the_budget_are_transient() {
    if !has(Capability::Servers) {
        return;
    }
    let (store, proxy) = through_proxy("retry-reset-exhausted", Fault::Reset, 100, 1).await;
    let err = store.head("object").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    assert_eq!(proxy.connections(), 2);
}

#[tokio::test]
async fn unreachable_endpoint_is_one_clear_transient_error() {
    // A port that was free a moment ago: nothing listens there.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let store = Store::open(
        "s3://bucket/prefix",
        s3_config(&format!("http://127.0.0.1:{port}"), retry_config(0)),
    )
    .unwrap();
    let err = store.get("key").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let message = err.to_string();
    assert!(message.contains("s3://bucket/prefix/key"), "{message}");
    assert!(message.contains("unreachable"), "{message}");
    assert!(!message.contains('\n'), "one sentence: {message}");
}
