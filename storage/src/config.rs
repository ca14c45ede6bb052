//! Settings of a [`Store`](crate::Store): plain data with documented defaults.
//!
//! Credentials and endpoints come from the ecosystem's standard environment
//! variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`, read by object_store's builders), so a
//! training job configured for any other tool works unchanged. What ckpt itself adds
//! (retry policy, timeouts, how large objects are split and how reads are merged)
//! lives here, with defaults that suit checkpoints of tens of GiB.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The smallest part S3 accepts for any part of a multipart upload but the last.
pub const MIN_PART_SIZE: usize = 5 * 1024 * 1024;

/// Retry policy for requests to remote stores (S3, GCS, Azure).
///
/// A request that fails with a 5xx status, throttling, a reset connection or a
/// timeout is retried with exponential backoff until `max_retries` retries were made
/// or `retry_timeout` has elapsed since the first attempt, whichever comes first.
/// Local disk and memory stores do not retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RetrySettings {
    /// Retries after the first attempt. Default 10; 0 disables retries.
    pub max_retries: usize,
    /// Give up retrying once this much time has passed since the first attempt.
    /// Default 180 s.
    #[serde(with = "duration_ms")]
    pub retry_timeout: Duration,
    /// Backoff before the first retry. Default 100 ms.
    #[serde(with = "duration_ms")]
    pub init_backoff: Duration,
    /// Upper bound of one backoff. Default 15 s.
    #[serde(with = "duration_ms")]
    pub max_backoff: Duration,
    /// Growth factor of the backoff (jittered). Default 2.
    pub backoff_base: f64,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            max_retries: 10,
            retry_timeout: Duration::from_secs(180),
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            backoff_base: 2.0,
        }
    }
}

/// Settings of a store. Every field has a default suited to large checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreConfig {
    /// Retry policy of remote stores.
    pub retry: RetrySettings,
    /// Time limit of one HTTP request, body included. Default 60 s.
    #[serde(with = "duration_ms")]
    pub request_timeout: Duration,
    /// Time limit to establish a connection. Default 5 s.
    #[serde(with = "duration_ms")]
    pub connect_timeout: Duration,
    /// Size of each part of a streaming upload (the last may be smaller).
    /// Default 16 MiB; at least 5 MiB, as S3 requires.
    pub part_size: usize,
    /// Parts of one streaming upload in flight at once. Default 8. Memory held by
    /// one upload is at most `part_size × (part_concurrency + 1)`.
    pub part_concurrency: usize,
    /// Ranges of one `get_ranges` call closer than this many bytes are fetched as
    /// one request. Default 1 MiB.
    pub coalesce_gap: u64,
    /// A coalesced request never grows beyond this many bytes. Default 64 MiB.
    pub max_coalesced_bytes: u64,
    /// Range requests of one `get_ranges` call in flight at once. Default 8.
    pub range_concurrency: usize,
    /// Local disk only: fsync files and their directories before a write returns.
    /// Default true; turning it off trades crash safety for speed.
    pub fsync: bool,
    /// Extra options for the backend's builder, as object_store names them
    /// (e.g. `("aws_endpoint", "http://127.0.0.1:9000")`, `("google_service_account",
    /// "/path/key.json")`). They override the environment. An unknown key is a
    /// configuration error.
    pub options: Vec<(String, String)>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            retry: RetrySettings::default(),
            request_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            part_size: 16 * 1024 * 1024,
            part_concurrency: 8,
            coalesce_gap: 1024 * 1024,
            max_coalesced_bytes: 64 * 1024 * 1024,
            range_concurrency: 8,
            fsync: true,
            options: Vec::new(),
        }
    }
}

impl StoreConfig {
    /// Adds one backend option (see [`StoreConfig::options`]).
    pub fn with_option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.push((key.into(), value.into()));
        self
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, retry: RetrySettings) -> Self {
        self.retry = retry;
        self
    }

    /// Checks that the settings are usable; the error names the field and its value.
    pub fn validate(&self) -> Result<()> {
        if self.part_size < MIN_PART_SIZE {
            return Err(Error::config(format!(
                "part_size {} is below the 5 MiB ({MIN_PART_SIZE} bytes) minimum of multipart uploads",
                self.part_size
            )));
        }
        if self.part_concurrency == 0 {
            return Err(Error::config("part_concurrency must be at least 1, got 0"));
        }
        if self.range_concurrency == 0 {
            return Err(Error::config("range_concurrency must be at least 1, got 0"));
        }
        if self.max_coalesced_bytes == 0 {
            return Err(Error::config(
                "max_coalesced_bytes must be at least 1, got 0",
            ));
        }
        if !(self.retry.backoff_base >= 1.0 && self.retry.backoff_base.is_finite()) {
            return Err(Error::config(format!(
                "retry.backoff_base must be a finite number >= 1, got {}",
                self.retry.backoff_base
            )));
        }
        if self.retry.init_backoff > self.retry.max_backoff {
            return Err(Error::config(format!(
                "retry.init_backoff {:?} exceeds retry.max_backoff {:?}",
                self.retry.init_backoff, self.retry.max_backoff
            )));
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::config(format!(
                "timeouts must be positive, got request_timeout {:?} and connect_timeout {:?}",
                self.request_timeout, self.connect_timeout
            )));
        }
        Ok(())
    }
}

mod duration_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis().min(u128::from(u64::MAX)) as u64)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        StoreConfig::default().validate().unwrap();
    }

    #[test]
    fn small_parts_are_rejected_with_both_values() {
        let config = StoreConfig {
            part_size: 1024,
            ..StoreConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains("1024"), "{message}");
        assert!(message.contains("5 MiB"), "{message}");
    }

    #[test]
    fn backoff_bounds_are_checked() {
        let config = StoreConfig::default().with_retry(RetrySettings {
            init_backoff: Duration::from_secs(20),
            ..RetrySettings::default()
        });
        assert!(config.validate().is_err());
    }
}
