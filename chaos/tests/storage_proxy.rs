//! Integration tests of the fault-injecting storage proxy.
//!
//! Most tests drive the real `object_store` S3 client through the proxy
//! against a real S3-compatible server (moto). They read the server from
//! `CKPT_TEST_S3_ENDPOINT` and the bucket from `CKPT_TEST_S3_BUCKET`, and
//! skip loudly when the endpoint is not set. The wire-level tests at the end
//! use a scripted fake upstream and always run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ckpt_chaos::storage_proxy::{Direction, StorageFault, StorageProxy};
use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};

/// Bound on every client operation, so a broken proxy fails a test instead
/// of hanging it.
const OP_TIMEOUT: Duration = Duration::from_secs(60);
const MIB: usize = 1024 * 1024;

struct S3Env {
    endpoint: String,
    bucket: String,
}

fn s3_env() -> Option<S3Env> {
    if !ckpt_testkit::has(ckpt_testkit::Capability::Servers) {
        return None;
    }
    Some(S3Env {
        endpoint: ckpt_testkit::env("CKPT_TEST_S3_ENDPOINT"),
        bucket: ckpt_testkit::env("CKPT_TEST_S3_BUCKET"),
    })
}

fn start_proxy(env: &S3Env) -> StorageProxy {
    match StorageProxy::start(&env.endpoint) {
        Ok(proxy) => proxy,
        Err(e) => panic!("proxy did not start in front of {}: {e}", env.endpoint),
    }
}

fn client(proxy: &StorageProxy, env: &S3Env, max_retries: usize) -> AmazonS3 {
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
            base: 2.0,
        },
        max_retries,
        retry_timeout: Duration::from_secs(30),
    };
    let built = AmazonS3Builder::new()
        .with_endpoint(proxy.endpoint())
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_bucket_name(&env.bucket)
        .with_retry(retry)
        .build();
    match built {
        Ok(store) => store,
        Err(e) => panic!("cannot build S3 client: {e}"),
    }
}

/// A key prefix no other test (or earlier run) uses.
fn unique_prefix(test: &str) -> String {
    format!("s3proxy-tests/{}", ckpt_testkit::unique(test))
}

/// Deterministic, non-repeating test data.
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(OP_TIMEOUT, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what} did not finish within {OP_TIMEOUT:?}"),
    }
}

async fn put(store: &AmazonS3, path: &Path, bytes: &[u8]) -> object_store::Result<()> {
    let payload = PutPayload::from(bytes.to_vec());
    bounded("put", store.put(path, payload)).await.map(|_| ())
}

async fn get(store: &AmazonS3, path: &Path) -> object_store::Result<Vec<u8>> {
    bounded("get", async {
        let result = store.get(path).await?;
        Ok(result.bytes().await?.to_vec())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_relay_round_trips() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 2);
    let prefix = unique_prefix("plain");
    let objects: Vec<(Path, Vec<u8>)> = [0, 1000, 3 * MIB + 17]
        .iter()
        .enumerate()
        .map(|(i, &len)| (Path::from(format!("{prefix}/obj-{i}")), data(len, i as u64)))
        .collect();

    for (path, bytes) in &objects {
        put(&store, path, bytes).await.expect("put through proxy");
    }
    for (path, bytes) in &objects {
        let got = get(&store, path).await.expect("get through proxy");
        assert!(got == *bytes, "{path}: bytes differ after round trip");
    }
    let prefix_path = Path::from(prefix.as_str());
    let listed: Vec<_> = bounded("list", store.list(Some(&prefix_path)).try_collect())
        .await
        .expect("list through proxy");
    let mut names: Vec<String> = listed.iter().map(|m| m.location.to_string()).collect();
    names.sort();
    let mut expected: Vec<String> = objects.iter().map(|(p, _)| p.to_string()).collect();
    expected.sort();
    assert_eq!(names, expected);
    for (meta, (_, bytes)) in listed.iter().zip(&objects) {
        assert_eq!(meta.size, bytes.len() as u64, "{}", meta.location);
    }
    for (path, _) in &objects {
        bounded("delete", store.delete(path))
            .await
            .expect("delete through proxy");
    }
    let after: Vec<_> = bounded("list", store.list(Some(&prefix_path)).try_collect())
        .await
        .expect("list after delete");
    assert!(after.is_empty(), "objects left after delete: {after:?}");
    let gone = get(&store, &objects[0].0).await;
    assert!(
        matches!(gone, Err(object_store::Error::NotFound { .. })),
        "deleted object still readable: {gone:?}"
    );

    let stats = proxy.stats();
    // 3 puts + 3 gets + list + 3 deletes + list + get
    assert!(stats.requests >= 12, "requests not counted: {stats:?}");
    assert_eq!(
        (stats.errors, stats.delayed, stats.resets, stats.lost_parts),
        (0, 0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_503_is_absorbed_by_retries() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 5);
    let path = Path::from(format!("{}/obj", unique_prefix("burst503")));
    let bytes = data(64 * 1024, 7);

    proxy.inject(StorageFault::Errors {
        status: 503,
        count: 3,
    });
    put(&store, &path, &bytes)
        .await
        .expect("put retried past three 503s");
    assert_eq!(get(&store, &path).await.expect("get"), bytes);

    let stats = proxy.stats();
    assert_eq!(stats.errors, 3, "{stats:?}");
    // Three refused attempts, then the put and the get.
    assert_eq!(stats.requests, 5, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_delays_a_get() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 2);
    let path = Path::from(format!("{}/obj", unique_prefix("latency")));
    let bytes = data(4096, 3);
    put(&store, &path, &bytes).await.expect("put");

    proxy.inject(StorageFault::Latency { ms: 300, count: 1 });
    let started = Instant::now();
    let got = get(&store, &path).await.expect("delayed get");
    let elapsed = started.elapsed();
    assert_eq!(got, bytes);
    assert!(
        elapsed >= Duration::from_millis(300),
        "get took only {elapsed:?}"
    );
    assert_eq!(proxy.stats().delayed, 1);

    // The fault is spent: the next get is not delayed.
    let started = Instant::now();
    get(&store, &path).await.expect("undelayed get");
    assert!(started.elapsed() < Duration::from_millis(300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_mid_body_on_get_is_retried() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 5);
    let path = Path::from(format!("{}/obj", unique_prefix("reset-get")));
    let bytes = data(MIB, 11);
    put(&store, &path, &bytes).await.expect("put");
    let before = proxy.stats().requests;

    proxy.inject(StorageFault::ResetMidBody { count: 1 });
    let got = get(&store, &path).await.expect("get retried after reset");
    assert!(got == bytes, "bytes differ after a reset mid-body");

    let stats = proxy.stats();
    assert_eq!(stats.resets, 1, "{stats:?}");
    assert!(
        stats.requests >= before + 2,
        "no second request after the reset: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_mid_body_on_put_is_retried() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 5);
    let path = Path::from(format!("{}/obj", unique_prefix("reset-put")));
    let bytes = data(MIB, 13);

    proxy.inject(StorageFault::ResetMidBody { count: 1 });
    put(&store, &path, &bytes)
        .await
        .expect("put retried after reset");
    assert_eq!(proxy.stats().resets, 1);
    let got = get(&store, &path).await.expect("get");
    assert!(got == bytes, "stored object differs after a reset mid-PUT");
    assert_eq!(proxy.stats().resets, 1, "fault reached past its count");
}

/// Where two byte strings of one length differ.
fn differences(a: &[u8], b: &[u8]) -> Vec<usize> {
    assert_eq!(a.len(), b.len(), "lengths differ");
    (0..a.len()).filter(|&i| a[i] != b[i]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_get_flips_the_middle_byte_of_one_ranged_read_only() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 0);
    let path = Path::from(format!("{}/obj", unique_prefix("corrupt-get")));
    let bytes = data(MIB, 19);
    put(&store, &path, &bytes).await.expect("put");

    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Get,
        count: 1,
    });
    // A whole-object GET is not claimed: the fault waits for a ranged one.
    assert!(get(&store, &path).await.expect("get") == bytes);
    let range = 1000..5000u64;
    let ranged = |store: &AmazonS3| {
        let store = store.clone();
        let path = path.clone();
        let range = range.clone();
        async move {
            bounded("get_range", store.get_range(&path, range))
                .await
                .expect("get_range")
        }
    };
    let damaged = ranged(&store).await;
    let want = &bytes[1000..5000];
    assert_eq!(damaged.len(), want.len(), "the length is kept");
    assert_eq!(
        differences(&damaged, want),
        [2000],
        "one byte, in the middle"
    );
    assert_eq!(damaged[2000], !want[2000], "inverted");
    assert_eq!(proxy.stats().corrupted, 1);
    // Spent: the next ranged read is clean.
    assert!(ranged(&store).await == want);
    assert_eq!(proxy.stats().corrupted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_put_is_stored_by_the_test_server_as_it_arrived() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 0);
    let path = Path::from(format!("{}/obj", unique_prefix("corrupt-put")));
    let bytes = data(64 * 1024, 23);

    proxy.inject(StorageFault::CorruptBody {
        direction: Direction::Put,
        count: 1,
    });
    // object_store sends no checksum moto would check: the damaged body is stored
    // and acknowledged. Its ETag is the MD5 of what was stored, which is how the
    // library notices (ckpt-storage's `sent.rs`).
    let result = bounded("put", store.put(&path, PutPayload::from(bytes.clone())))
        .await
        .expect("put");
    assert_eq!(proxy.stats().corrupted, 1);
    let stored = get(&store, &path).await.expect("get");
    assert_eq!(differences(&stored, &bytes), [bytes.len() / 2]);
    let e_tag = result.e_tag.unwrap_or_default();
    assert!(
        e_tag.trim_matches('"').len() == 32,
        "the test server answers MD5 ETags: {e_tag}"
    );
    // A second put, clean, replaces it.
    put(&store, &path, &bytes).await.expect("put");
    assert!(get(&store, &path).await.expect("get") == bytes);
}

async fn multipart(store: &AmazonS3, path: &Path, bytes: &[u8]) -> object_store::Result<()> {
    bounded("multipart upload", async {
        let upload = store.put_multipart(path).await?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, 5 * MIB);
        writer.write(bytes);
        writer.finish().await.map(|_| ())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_part_fails_the_upload() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 3);
    let prefix = unique_prefix("lose-part");
    let bytes = data(12 * MIB, 17);

    // Control: without the fault the same upload succeeds.
    let good = Path::from(format!("{prefix}/good"));
    multipart(&store, &good, &bytes)
        .await
        .expect("multipart upload without faults");
    assert!(get(&store, &good).await.expect("get") == bytes);

    let bad = Path::from(format!("{prefix}/bad"));
    proxy.inject(StorageFault::LosePart { count: 1 });
    let outcome = multipart(&store, &bad, &bytes).await;
    eprintln!("multipart upload with a lost part: {outcome:?}");
    let err = match outcome {
        Ok(()) => panic!("multipart upload with a lost part succeeded"),
        Err(e) => e,
    };
    assert!(
        err.to_string().contains("InvalidPart"),
        "expected the server to reject the part list with InvalidPart, got: {err}"
    );
    assert_eq!(proxy.stats().lost_parts, 1);

    let read_back = get(&store, &bad).await;
    assert!(
        matches!(read_back, Err(object_store::Error::NotFound { .. })),
        "an object exists after a failed upload: {:?}",
        read_back.map(|b| b.len())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_beyond_the_retry_budget_surface() {
    let Some(env) = s3_env() else { return };
    let proxy = start_proxy(&env);
    let store = client(&proxy, &env, 3);
    let path = Path::from(format!("{}/obj", unique_prefix("budget")));

    proxy.inject(StorageFault::Errors {
        status: 503,
        count: 100,
    });
    let started = Instant::now();
    let outcome = put(&store, &path, b"never stored").await;
    eprintln!("put past the retry budget: {outcome:?}");
    assert!(outcome.is_err(), "put succeeded through 100 injected 503s");
    assert!(started.elapsed() < Duration::from_secs(20));
    // One attempt plus three retries.
    assert_eq!(proxy.stats().errors, 4);
}

// ---------------------------------------------------------------------------
// Wire-level tests against a scripted fake upstream (no S3 server needed).
// ---------------------------------------------------------------------------

/// Reads from `stream` until `buf` ends with `terminator`.
fn read_until(stream: &mut TcpStream, buf: &mut Vec<u8>, terminator: &[u8]) {
    let mut byte = [0u8; 1];
    while !buf.ends_with(terminator) {
        match stream.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            other => panic!(
                "stream ended before {:?}: {other:?}; got {:?}",
                String::from_utf8_lossy(terminator),
                String::from_utf8_lossy(buf)
            ),
        }
    }
}

/// A fake upstream serving one connection: for each scripted exchange it
/// reads a request up to the given terminator, reports it, and answers with
/// the given bytes.
fn fake_upstream(script: Vec<(&'static str, &'static str)>) -> (String, mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake upstream");
    let addr = listener.local_addr().expect("fake upstream address");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        for (terminator, answer) in script {
            let mut request = Vec::new();
            read_until(&mut stream, &mut request, terminator.as_bytes());
            let _ = tx.send(String::from_utf8_lossy(&request).into_owned());
            if stream.write_all(answer.as_bytes()).is_err() {
                return;
            }
        }
    });
    (format!("http://{addr}"), rx)
}

fn connect(proxy: &StorageProxy) -> TcpStream {
    let addr = proxy.endpoint().trim_start_matches("http://").to_owned();
    let stream = TcpStream::connect(addr).expect("connect to proxy");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream
}

#[test]
fn relays_chunked_bodies_expect_continue_and_keep_alive() {
    let (upstream, requests) = fake_upstream(vec![
        (
            "0\r\nX-Trailer: yes\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nETag: \"e\"\r\n\r\n\
             5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ),
        (
            "\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
        ),
        ("\r\n\r\n", "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"),
    ]);
    let proxy = StorageProxy::start(&upstream).expect("start proxy");
    let mut client = connect(&proxy);

    client
        .write_all(
            b"PUT /b/k HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n\
              Transfer-Encoding: chunked\r\n\r\n",
        )
        .expect("send head");
    let mut interim = Vec::new();
    read_until(&mut client, &mut interim, b"\r\n\r\n");
    assert_eq!(interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    client
        .write_all(b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nX-Trailer: yes\r\n\r\n")
        .expect("send chunks");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"0\r\n\r\n");
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.ends_with("\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
        "{response}"
    );

    let seen = requests.recv().expect("upstream saw the PUT");
    assert!(seen.starts_with("PUT /b/k HTTP/1.1\r\n"), "{seen}");
    assert!(seen.contains("Host: h\r\n"), "{seen}");
    assert!(!seen.to_ascii_lowercase().contains("expect"), "{seen}");
    assert!(
        seen.ends_with("\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\nX-Trailer: yes\r\n\r\n"),
        "{seen}"
    );

    // Same client connection, next request: keep-alive works.
    client
        .write_all(b"GET /b/k HTTP/1.1\r\nHost: h\r\n\r\n")
        .expect("send GET");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"\r\n\r\nabc");
    let seen = requests.recv().expect("upstream saw the GET");
    assert!(seen.starts_with("GET /b/k HTTP/1.1\r\n"), "{seen}");

    // A HEAD response carries no body even with a Content-Length.
    client
        .write_all(b"HEAD /b/k HTTP/1.1\r\nHost: h\r\n\r\n")
        .expect("send HEAD");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"\r\n\r\n");
    assert!(String::from_utf8_lossy(&response).contains("Content-Length: 3\r\n"));
    assert_eq!(proxy.stats().requests, 3);
}

#[test]
fn faults_answer_without_forwarding() {
    let (upstream, requests) = fake_upstream(vec![(
        "\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )]);
    let proxy = StorageProxy::start(&upstream).expect("start proxy");
    proxy.inject(StorageFault::LosePart { count: 1 });
    proxy.inject(StorageFault::Errors {
        status: 500,
        count: 1,
    });
    let mut client = connect(&proxy);

    // The part upload is swallowed by LosePart (queued first).
    client
        .write_all(
            b"PUT /b/k?partNumber=1&uploadId=u HTTP/1.1\r\nHost: h\r\n\
              Content-Length: 4\r\n\r\nabcd",
        )
        .expect("send part");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"Content-Length: 0\r\n\r\n");
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains("ETag: \""), "{response}");

    // A GET is not a part upload: the Errors fault takes it.
    client
        .write_all(b"GET /b/k HTTP/1.1\r\nHost: h\r\n\r\n")
        .expect("send GET");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"</Error>");
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 500 "), "{response}");
    assert!(
        response.contains("<Code>InternalError</Code>"),
        "{response}"
    );

    // Both faults are spent: this one reaches the upstream, which has seen
    // nothing before it.
    client
        .write_all(b"GET /b/k2 HTTP/1.1\r\nHost: h\r\n\r\n")
        .expect("send GET");
    let mut response = Vec::new();
    read_until(&mut client, &mut response, b"\r\n\r\nok");
    let seen = requests.recv().expect("upstream saw a request");
    assert!(seen.starts_with("GET /b/k2 "), "{seen}");

    let stats = proxy.stats();
    assert_eq!(
        (stats.requests, stats.lost_parts, stats.errors),
        (3, 1, 1),
        "{stats:?}"
    );
}

#[test]
fn malformed_request_closes_the_connection() {
    let (upstream, _requests) = fake_upstream(vec![]);
    let proxy = StorageProxy::start(&upstream).expect("start proxy");
    let mut client = connect(&proxy);
    client
        .write_all(b"PUT / HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        .expect("send garbage");
    let mut response = Vec::new();
    let _ = client.read_to_end(&mut response);
    assert!(
        String::from_utf8_lossy(&response).starts_with("HTTP/1.1 400 "),
        "{:?}",
        String::from_utf8_lossy(&response)
    );
}

/// Documents how the real client frames upload bodies: `object_store` sets
/// `Content-Length` itself, so reqwest does not fall back to chunked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_put_is_sent_with_content_length() {
    let (upstream, requests) = fake_upstream(vec![(
        "\r\n\r\n",
        "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 0\r\n\r\n",
    )]);
    let proxy = StorageProxy::start(&upstream).expect("start proxy");
    let env = S3Env {
        endpoint: upstream,
        bucket: "b".to_owned(),
    };
    let store = client(&proxy, &env, 0);
    put(&store, &Path::from("k"), b"0123456789")
        .await
        .expect("put to the fake upstream");
    let seen = requests.recv().expect("upstream saw the PUT");
    let lower = seen.to_ascii_lowercase();
    assert!(lower.starts_with("put /b/k http/1.1\r\n"), "{seen}");
    assert!(lower.contains("\r\ncontent-length: 10\r\n"), "{seen}");
    assert!(!lower.contains("transfer-encoding"), "{seen}");
}

/// A fake upstream answering each of `connections` connections' one request
/// with a body of `len` bytes (after reading the request head).
fn bulk_upstream(connections: usize, len: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake upstream");
    let addr = listener.local_addr().expect("fake upstream address");
    std::thread::spawn(move || {
        for _ in 0..connections {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            std::thread::spawn(move || {
                let mut request = Vec::new();
                read_until(&mut stream, &mut request, b"\r\n\r\n");
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&vec![7u8; len]);
            });
        }
    });
    format!("http://{addr}")
}

/// Two GETs at once through a proxy capped at 4 MiB/s share the cap: their
/// 2 MiB take at least the time the cap allows for all but one burst (64 KiB),
/// and the counters have both requests and every body byte.
#[test]
fn a_rate_cap_paces_all_connections_together_and_bytes_are_counted() {
    const RATE: usize = 4 * MIB;
    const EACH: usize = MIB;
    let proxy = StorageProxy::start(&bulk_upstream(2, EACH)).expect("start proxy");
    proxy.limit_rate(Some(RATE as u64));
    let started = Instant::now();
    let readers: Vec<_> = (0..2)
        .map(|i| {
            let mut stream = connect(&proxy);
            std::thread::spawn(move || {
                let request = format!("GET /b/object-{i} HTTP/1.1\r\nHost: x\r\n\r\n");
                stream.write_all(request.as_bytes()).expect("send GET");
                let mut head = Vec::new();
                read_until(&mut stream, &mut head, b"\r\n\r\n");
                let mut body = vec![0u8; EACH];
                stream.read_exact(&mut body).expect("read body");
                assert!(body.iter().all(|&b| b == 7), "body damaged");
            })
        })
        .collect();
    for reader in readers {
        reader.join().expect("reader");
    }
    let elapsed = started.elapsed();
    let least = Duration::from_secs_f64((2 * EACH - 64 * 1024) as f64 / RATE as f64);
    assert!(
        elapsed >= least,
        "2 MiB at 4 MiB/s took {elapsed:?}, less than {least:?}"
    );
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    let stats = proxy.stats();
    assert_eq!(stats.body_bytes_down, 2 * EACH as u64);
    assert_eq!(stats.body_bytes_up, 0);
    assert_eq!(stats.requests_by_kind.get("GET"), Some(&2));
    assert_eq!(stats.rate_bytes_per_second, RATE as u64);
}
