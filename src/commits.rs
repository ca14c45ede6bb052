//! The commit log: the one total order of commits under a root, and the fence.
//!
//! Step numbers do not order commits: a run that resumed from step 30 commits step
//! 40 again after an abandoned step 40 or 50, and the newest checkpoint is the one
//! committed last. Object stores give no counters and no transactions, but they do
//! give create-if-absent, which turns a series of numbered keys into a log:
//!
//! ```text
//! commits/00000000000000000041.json   {step, generation, attempt, world_size}
//! commits/00000000000000000042.json
//! commits/HEAD                        hint: the newest sequence number (may lag)
//! ```
//!
//! Appending record `n + 1` after reading record `n` is a compare-and-swap on the
//! log's tail: when two writers race, one wins and the other re-reads. That makes the
//! fence atomic: a writer appends only after seeing that the newest record's
//! generation is not above its own, so once a world of generation `g + 1` has
//! appended, no writer of generation `g` ever can. Generations in the log are
//! therefore non-decreasing.
//!
//! Reading the newest commit costs two requests (the hint, then a listing that starts
//! at it), whatever the length of the log. The hint is untrusted like every object
//! under the root: [`read_hint`] reads at most [`MAX_HINT_BYTES`] of it, and a hint
//! that is larger or no number is ignored (and reported), never read whole.

use std::time::SystemTime;

use ckpt_storage::{ErrorKind, ObjectInfo, Store};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::attempt::Attempt;
use crate::error::{Error, Result};
use crate::format::{FormatError, seal, unseal};

/// The log's directory under the root.
pub const LOG_DIR: &str = "commits";
/// The hint object: the newest sequence number, in decimal.
pub const LOG_HEAD: &str = "commits/HEAD";
/// Records are tiny; anything larger is hostile.
const MAX_RECORD_BYTES: u64 = 64 << 10;
/// A hint is a decimal `u64` (20 digits at most), maybe with a line ending; the
/// bound leaves room for whitespace and nothing else.
pub const MAX_HINT_BYTES: u64 = 64;

/// The body of one log record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitRecord {
    /// 2.
    pub format_version: u32,
    /// The step committed.
    pub step: u64,
    /// The generation of the world that committed it.
    pub generation: u64,
    /// The attempt's directory name inside the step directory (`g00000003-RUN`).
    pub attempt: String,
    /// Ranks that saved it.
    pub world_size: u32,
}

impl CommitRecord {
    /// The record of `attempt` saved by `world_size` ranks.
    pub fn new(attempt: &Attempt, world_size: u32) -> Self {
        Self {
            format_version: 2,
            step: attempt.step,
            generation: attempt.generation,
            attempt: attempt.name(),
            world_size,
        }
    }

    /// The attempt it names (validated when the record was parsed).
    pub fn attempt(&self) -> Attempt {
        Attempt::parse(self.step, &self.attempt).expect("validated when parsed")
    }

    /// Parses and checks a record read from `object`.
    pub fn parse(bytes: &[u8], object: &str) -> Result<Self, FormatError> {
        let (body, offset) = unseal(bytes, object, MAX_RECORD_BYTES)?;
        let record: CommitRecord = serde_json::from_slice(body).map_err(|e| {
            FormatError::new(object, Some(offset as u64), format!("invalid JSON: {e}"))
        })?;
        if record.format_version != 2 {
            return Err(FormatError::new(
                object,
                None,
                format!("format_version {} is not 2", record.format_version),
            ));
        }
        match Attempt::parse(record.step, &record.attempt) {
            Some(attempt) if attempt.generation == record.generation => {}
            _ => {
                return Err(FormatError::new(
                    object,
                    None,
                    format!(
                        "attempt {:?} is not an attempt name of generation {}",
                        record.attempt, record.generation
                    ),
                ));
            }
        }
        if record.world_size == 0 || record.world_size > crate::format::MAX_WORLD_SIZE {
            return Err(FormatError::new(
                object,
                None,
                format!("world_size {} is out of range", record.world_size),
            ));
        }
        Ok(record)
    }

    fn to_bytes(&self) -> Vec<u8> {
        seal(&serde_json::to_vec(self).expect("records serialize"))
    }
}

/// One record of the log, with where and when it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedCommit {
    /// Position in the log (1-based).
    pub seq: u64,
    /// What was committed.
    pub record: CommitRecord,
    /// When the store wrote the record (the store's clock).
    pub written: SystemTime,
}

/// The key of record `seq`.
pub fn record_key(seq: u64) -> String {
    format!("{LOG_DIR}/{seq:020}.json")
}

/// The sequence number of a record key.
pub fn parse_record_key(key: &str) -> Option<u64> {
    let digits = key.strip_prefix(LOG_DIR)?.strip_prefix('/')?;
    let digits = digits.strip_suffix(".json")?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

async fn read_record(store: &Store, seq: u64, info: &ObjectInfo) -> Result<LoggedCommit> {
    let key = record_key(seq);
    if info.size > MAX_RECORD_BYTES {
        return Err(FormatError::new(
            &key,
            None,
            format!(
                "{} bytes exceeds the {MAX_RECORD_BYTES}-byte record limit",
                info.size
            ),
        )
        .into());
    }
    let bytes = store.get(&key).await?;
    Ok(LoggedCommit {
        seq,
        record: CommitRecord::parse(&bytes, &key)?,
        written: info.last_modified,
    })
}

/// Reads the records listed in `objects` (in order); corrupt records are reported
/// and skipped: a torn log entry must not hide the rest of the log.
async fn read_listed(store: &Store, objects: Vec<ObjectInfo>) -> Result<Vec<LoggedCommit>> {
    let listed: Vec<(u64, ObjectInfo)> = objects
        .into_iter()
        .filter_map(|o| parse_record_key(&o.key).map(|seq| (seq, o)))
        .collect();
    let read: Vec<Option<LoggedCommit>> = futures::stream::iter(listed)
        .map(|(seq, info)| async move {
            match read_record(store, seq, &info).await {
                Ok(record) => Ok(Some(record)),
                Err(e) if e.is_corruption() => {
                    warn!(seq, error = %e, "skipping a corrupt commit record");
                    Ok(None)
                }
                // Deleted by retention between the listing and the read.
                Err(Error::Storage(e)) if e.is_not_found() => Ok(None),
                Err(e) => Err(e),
            }
        })
        .buffered(16)
        .try_collect()
        .await?;
    Ok(read.into_iter().flatten().collect())
}

/// Every record of the log, oldest first.
pub async fn read_all(store: &Store) -> Result<Vec<LoggedCommit>> {
    let objects = store.list(LOG_DIR).await?;
    read_listed(store, objects).await
}

/// The number a hint object holds (`commits/HEAD`, or the root's `latest`), or
/// `None` when there is none to trust.
///
/// The one reader of hints, for every caller: anyone who can write to the root can
/// write a hint, and a hint is only ever an optimisation, so it is read with a
/// bound ([`MAX_HINT_BYTES`], one request that reads nothing of a larger object)
/// and one that is too large, unreadable or not a decimal number is ignored with a
/// warning naming it: the caller then finds its answer the long way, from the log.
pub async fn read_hint(store: &Store, key: &str) -> Result<Option<u64>> {
    let bytes = match store.get_at_most(key, MAX_HINT_BYTES).await {
        Ok(bytes) => bytes,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) if e.kind() == ErrorKind::Permanent => {
            warn!(error = %e, "ignoring the hint {key}");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    let parsed = parse_hint(&bytes);
    if parsed.is_none() {
        warn!(
            "ignoring the hint {key}: {:?} is not a decimal number",
            String::from_utf8_lossy(&bytes)
        );
    }
    Ok(parsed)
}

/// A hint's text: ASCII digits, with whitespace around them.
fn parse_hint(bytes: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(bytes).ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// The newest records: from the hint on (at least the newest record when the log is
/// not empty). Two requests when the hint is current.
pub async fn read_tail(store: &Store) -> Result<Vec<LoggedCommit>> {
    let hint = read_hint(store, LOG_HEAD).await?;
    if let Some(hint) = hint.filter(|&h| h > 0) {
        let objects = store.list_after(LOG_DIR, &record_key(hint - 1)).await?;
        let tail = read_listed(store, objects).await?;
        if !tail.is_empty() {
            return Ok(tail);
        }
        // The hint is ahead of the log (records deleted by hand): read it all.
    }
    read_all(store).await
}

/// Record `seq`, or `None` when there is none (or it is corrupt: reported and
/// skipped, as [`read_all`] skips it).
pub async fn read_one(store: &Store, seq: u64) -> Result<Option<LoggedCommit>> {
    let info = match store.head(&record_key(seq)).await {
        Ok(info) => info,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(read_listed(store, vec![info]).await?.pop())
}

/// The newest record, if any.
pub async fn newest(store: &Store) -> Result<Option<LoggedCommit>> {
    Ok(read_tail(store).await?.pop())
}

/// What an append found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Appended {
    /// The record is in the log at this position (written by this call, or found
    /// there: appending is idempotent per attempt).
    At(u64),
    /// A newer generation has already committed: this attempt must not commit.
    Fenced {
        /// That generation.
        generation: u64,
        /// Its record.
        seq: u64,
    },
}

/// Appends `record` unless a newer generation has committed (the fence).
pub async fn append(store: &Store, record: &CommitRecord) -> Result<Appended> {
    loop {
        let tail = read_tail(store).await?;
        if let Some(found) = tail
            .iter()
            .find(|r| r.record.attempt == record.attempt && r.record.step == record.step)
        {
            return Ok(Appended::At(found.seq));
        }
        let last = tail.last();
        if let Some(last) = last
            && last.record.generation > record.generation
        {
            return Ok(Appended::Fenced {
                generation: last.record.generation,
                seq: last.seq,
            });
        }
        let seq = last.map_or(1, |l| l.seq + 1);
        match store
            .put_if_absent(&record_key(seq), record.to_bytes())
            .await
        {
            Ok(()) => {
                if let Err(e) = store.put(LOG_HEAD, seq.to_string()).await {
                    warn!(seq, error = %e, "could not update the commit log hint");
                }
                return Ok(Appended::At(seq));
            }
            // Someone else took this position: read the tail again.
            Err(e) if e.is_already_exists() => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_round_trip() {
        assert_eq!(record_key(42), "commits/00000000000000000042.json");
        assert_eq!(parse_record_key(&record_key(42)), Some(42));
        assert_eq!(parse_record_key(LOG_HEAD), None);
        assert_eq!(parse_record_key("commits/42.json"), None);
    }

    #[tokio::test]
    async fn appends_are_ordered_and_fenced() {
        let store = Store::from_url("memory://commit-log-test").unwrap();
        let a = CommitRecord::new(&Attempt::new(10, 1, "a").unwrap(), 2);
        let b = CommitRecord::new(&Attempt::new(20, 2, "b").unwrap(), 2);
        let stale = CommitRecord::new(&Attempt::new(30, 1, "a").unwrap(), 2);
        assert_eq!(append(&store, &a).await.unwrap(), Appended::At(1));
        // Idempotent per attempt.
        assert_eq!(append(&store, &a).await.unwrap(), Appended::At(1));
        assert_eq!(append(&store, &b).await.unwrap(), Appended::At(2));
        assert_eq!(
            append(&store, &stale).await.unwrap(),
            Appended::Fenced {
                generation: 2,
                seq: 2
            }
        );
        let all = read_all(&store).await.unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(newest(&store).await.unwrap().unwrap().record, b);
        // A stale hint still finds the tail.
        store.put(LOG_HEAD, "1").await.unwrap();
        assert_eq!(newest(&store).await.unwrap().unwrap().seq, 2);
    }

    #[test]
    fn hints_are_decimal_numbers_and_nothing_else() {
        assert_eq!(parse_hint(b"42"), Some(42));
        assert_eq!(parse_hint(b" 42\n"), Some(42));
        assert_eq!(parse_hint(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"\n",
            b"+42",
            b"-1",
            b"4 2",
            b"42\0\0",
            b"18446744073709551616",
            b"\xff",
        ] {
            assert_eq!(parse_hint(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[tokio::test]
    async fn a_hint_too_large_or_malformed_is_ignored_and_the_log_answers() {
        let store = Store::from_url("memory://commit-log-hint-test").unwrap();
        for step in [10, 20] {
            let record = CommitRecord::new(&Attempt::new(step, 1, "a").unwrap(), 1);
            append(&store, &record).await.unwrap();
        }
        let over = "1".repeat(MAX_HINT_BYTES as usize + 1);
        for hint in [over.as_str(), "two", ""] {
            store.put(LOG_HEAD, hint.to_string()).await.unwrap();
            assert_eq!(read_hint(&store, LOG_HEAD).await.unwrap(), None, "{hint:?}");
            assert_eq!(newest(&store).await.unwrap().unwrap().seq, 2, "{hint:?}");
        }
        store.put(LOG_HEAD, "2\n").await.unwrap();
        assert_eq!(read_hint(&store, LOG_HEAD).await.unwrap(), Some(2));
        store.delete(LOG_HEAD).await.unwrap();
        assert_eq!(read_hint(&store, LOG_HEAD).await.unwrap(), None);
    }

    #[test]
    fn hostile_records_are_rejected() {
        let bad = seal(
            br#"{"format_version":2,"step":1,"generation":1,"attempt":"../x","world_size":1}"#,
        );
        assert!(CommitRecord::parse(&bad, "commits/x").is_err());
        let bad = seal(br#"{"format_version":2,"step":1,"generation":2,"attempt":"g00000001-a","world_size":1}"#);
        assert!(CommitRecord::parse(&bad, "commits/x").is_err());
    }
}
