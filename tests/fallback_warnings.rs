//! The warnings of a fallback to an older checkpoint: a binary of its own, with a
//! global tracing subscriber, so that no other test's subscribers race with it.

use ckpt_testkit as common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use ckpt::format::MANIFEST;
use ckpt::{LoadRequest, load_latest};
use common::{local_store, model, rank_file_name_in, save_world, step_dir};

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log() -> &'static Log {
    static LOG: OnceLock<Log> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Log::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .init();
        log
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn falling_back_warns_naming_the_step_and_the_damage() {
    let log = log();
    let (store, dir) = local_store("fallback-warnings");
    save_world(&store, 1, 2, &model(1, 64), |_| {}).await;
    save_world(&store, 2, 2, &model(2, 64), |_| {}).await;
    save_world(&store, 3, 2, &model(3, 64), |_| {}).await;

    // Step 3: a damaged manifest; step 2: a flipped bit in a data file.
    let manifest = dir.path().join(step_dir(3)).join(MANIFEST);
    let text = std::fs::read(&manifest).unwrap();
    std::fs::write(&manifest, &text[..text.len() - 3]).unwrap();
    let data_name = rank_file_name_in(dir.path(), 2, 1);
    let data = dir.path().join(step_dir(2)).join(&data_name);
    let mut bytes = std::fs::read(&data).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x08;
    std::fs::write(&data, bytes).unwrap();

    let (reader, _) = load_latest(&store, LoadRequest::everything)
        .await
        .expect("falls back to step 1");
    assert_eq!(reader.step(), 1);
    // `latest` (manifests only) skips step 3 and names step 2, with a warning too.
    assert_eq!(ckpt::latest(&store).await.unwrap().unwrap().step, 2);
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("skipping corrupt checkpoint")
                && l.contains("step=3")
                && l.contains(&format!("{}/{MANIFEST}", step_dir(3)))),
        "{text}"
    );
    assert!(
        lines.iter().any(|l| l.contains("falling back")
            && l.contains("step=2")
            && l.contains(&format!("{}/{data_name}", step_dir(2)))),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("skipping corrupt checkpoint") && l.contains("step=3")),
        "{text}"
    );
}
