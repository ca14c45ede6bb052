//! Putting a save's objects into the store, for every writer of them: the part
//! written create-if-absent (a repeat that finds its own bytes succeeds), and the data
//! file uploaded again, whole, when the store kept other bytes than those sent. Both
//! the training save (`save`) and the offline writer (`writer`) use it, so it sits
//! below both.

use bytes::Bytes;
use ckpt_storage::Store;
use tracing::warn;

use crate::commit::Retry;
use crate::error::{Error, Result};

/// Writes a rank's part create-if-absent: a part is never replaced. Finding the same
/// bytes there is success (a retried write whose first try landed); finding other
/// bytes means the attempt's name was used by another save (a reused run id).
/// A transient failure (a connection reset mid-body) is tried again within the
/// store's retry budget: the comparison makes the create safe to repeat.
pub(crate) async fn put_part(store: &Store, key: &str, bytes: Vec<u8>) -> Result<()> {
    let bytes = Bytes::from(bytes);
    crate::commit::retry(store, "writing a rank part", Retry::Transient, || {
        let bytes = bytes.clone();
        async move {
            match store.put_if_absent(key, bytes.clone()).await {
                Ok(()) => Ok(()),
                Err(e) if e.is_already_exists() => {
                    if store.get(key).await? == bytes {
                        Ok(())
                    } else {
                        Err(Error::Fenced(format!(
                            "{} already holds another save's part: this attempt's name is taken \
                             (give every run its own run id, or a new generation)",
                            store.url().trim_end_matches('/').to_string() + "/" + key
                        )))
                    }
                }
                Err(e) => Err(e.into()),
            }
        }
    })
    .await
}

/// How many times a data file is uploaded while the server stores other bytes
/// than those sent (a part damaged in flight).
const UPLOAD_ATTEMPTS: usize = 3;

/// Uploads `pieces` to `key`, and again, whole, when the server stored a part
/// with other bytes than those sent: a multipart upload cannot resend one part
/// (the store streams them and keeps none), but the save still holds the file.
pub(crate) async fn upload(store: &Store, key: &str, pieces: &[Bytes]) -> Result<()> {
    let mut attempt = 1;
    loop {
        match upload_once(store, key, pieces).await {
            Err(e) if e.is_damaged_in_flight() && attempt < UPLOAD_ATTEMPTS => {
                warn!(key, attempt, error = %e, "a part was damaged on its way to the store; uploading the file again");
                attempt += 1;
            }
            result => return Ok(result?),
        }
    }
}

/// Streams `pieces` to `key` in parts of the store's part size.
async fn upload_once(store: &Store, key: &str, pieces: &[Bytes]) -> ckpt_storage::Result<()> {
    let part = store.config().part_size;
    let mut upload = store.upload(key)?;
    let mut written = 0;
    for piece in pieces {
        let mut offset = 0;
        while offset < piece.len() {
            let end = (offset + part).min(piece.len());
            upload.write(piece.slice(offset..end)).await?;
            written += end - offset;
            if written >= part && written - (end - offset) < part {
                crate::failpoint::hit("during-data-upload");
            }
            offset = end;
        }
    }
    upload.finish().await
}
