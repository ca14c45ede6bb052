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

    /// Sets one setting from text: the one place where a `KEY=VALUE` pair (the CLI's
    /// `-o KEY=VALUE`, Python's `store_options={...}`) becomes a setting.
    ///
    /// | key | setting | value |
    /// |-----|---------|-------|
    /// | `retries` (or `max_retries`) | [`RetrySettings::max_retries`] | count |
    /// | `retry_timeout` | [`RetrySettings::retry_timeout`] | duration |
    /// | `init_backoff` | [`RetrySettings::init_backoff`] | duration |
    /// | `max_backoff` | [`RetrySettings::max_backoff`] | duration |
    /// | `backoff_base` | [`RetrySettings::backoff_base`] | number |
    /// | `request_timeout` | [`StoreConfig::request_timeout`] | duration |
    /// | `connect_timeout` | [`StoreConfig::connect_timeout`] | duration |
    /// | `part_size` | [`StoreConfig::part_size`] | size |
    /// | `part_concurrency` | [`StoreConfig::part_concurrency`] | count |
    /// | `coalesce_gap` | [`StoreConfig::coalesce_gap`] | size |
    /// | `max_coalesced_bytes` | [`StoreConfig::max_coalesced_bytes`] | size |
    /// | `range_concurrency` | [`StoreConfig::range_concurrency`] | count |
    /// | `fsync` | [`StoreConfig::fsync`] | `true`, `false`, `1` or `0` |
    /// | anything else | one of [`StoreConfig::options`] | passed to the backend as is |
    ///
    /// A count is a whole number. A duration is seconds, fractions allowed (`2.5`),
    /// or a number with the unit `ms`, `s`, `m` or `h` (`500ms`, `30s`). A size is
    /// bytes, or a whole number with a binary unit (`k`/`KiB`, `M`/`MiB`,
    /// `G`/`GiB`, `T`/`TiB`; `KB`, `MB`… mean the same). Keys are matched exactly.
    ///
    /// A value that does not parse is a configuration error naming the key and the
    /// value. Whether the values fit together ([`StoreConfig::validate`]) and
    /// whether the backend knows an option's key are checked when the store opens.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let parsed = match key {
            "retries" | "max_retries" => count(value).map(|n| self.retry.max_retries = n),
            "retry_timeout" => duration(value).map(|d| self.retry.retry_timeout = d),
            "init_backoff" => duration(value).map(|d| self.retry.init_backoff = d),
            "max_backoff" => duration(value).map(|d| self.retry.max_backoff = d),
            "backoff_base" => number(value).map(|x| self.retry.backoff_base = x),
            "request_timeout" => duration(value).map(|d| self.request_timeout = d),
            "connect_timeout" => duration(value).map(|d| self.connect_timeout = d),
            "part_size" => size(value)
                .and_then(|n| usize::try_from(n).map_err(|_| "is too large"))
                .map(|n| self.part_size = n),
            "part_concurrency" => count(value).map(|n| self.part_concurrency = n),
            "coalesce_gap" => size(value).map(|n| self.coalesce_gap = n),
            "max_coalesced_bytes" => size(value).map(|n| self.max_coalesced_bytes = n),
            "range_concurrency" => count(value).map(|n| self.range_concurrency = n),
            "fsync" => boolean(value).map(|b| self.fsync = b),
            _ => {
                self.options.push((key.to_string(), value.to_string()));
                Ok(())
            }
        };
        parsed.map_err(|why| Error::config(format!("store option {key}={value:?}: {why}")))
    }

    /// The default settings with each pair applied by [`StoreConfig::set`] in order
    /// (a later pair for the same setting wins).
    pub fn from_pairs<I, K, V>(pairs: I) -> Result<StoreConfig>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut config = StoreConfig::default();
        for (key, value) in pairs {
            config.set(key.as_ref(), value.as_ref())?;
        }
        Ok(config)
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

/// Why a value of [`StoreConfig::set`] did not parse; the caller adds key and value.
type Unparsed = &'static str;

fn count(text: &str) -> std::result::Result<usize, Unparsed> {
    text.trim().parse().map_err(|_| "expected a whole number")
}

fn number(text: &str) -> std::result::Result<f64, Unparsed> {
    text.trim().parse().map_err(|_| "expected a number")
}

fn boolean(text: &str) -> std::result::Result<bool, Unparsed> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err("expected true, false, 1 or 0"),
    }
}

fn duration(text: &str) -> std::result::Result<Duration, Unparsed> {
    const EXPECTED: Unparsed = "expected seconds (2.5) or a number with ms, s, m or h (500ms)";
    let (number, unit) = split_unit(text);
    let seconds: f64 = number.parse().map_err(|_| EXPECTED)?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(EXPECTED),
    };
    Duration::try_from_secs_f64(seconds * scale).map_err(|_| "expected a duration of at least 0")
}

fn size(text: &str) -> std::result::Result<u64, Unparsed> {
    const EXPECTED: Unparsed = "expected bytes or a whole number with a unit (16MiB)";
    let (number, unit) = split_unit(text);
    let number: u64 = number.parse().map_err(|_| EXPECTED)?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(EXPECTED),
    };
    number.checked_mul(1 << shift).ok_or("is too large")
}

/// Splits `"16MiB"` into `("16", "MiB")`, each trimmed.
fn split_unit(text: &str) -> (&str, &str) {
    let text = text.trim();
    let at = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(at);
    (number.trim(), unit.trim())
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

    #[test]
    fn set_parses_each_of_ckpts_keys() {
        let config = StoreConfig::from_pairs([
            ("retries", "5"),
            ("retry_timeout", "2.5"),
            ("init_backoff", "500ms"),
            ("max_backoff", "30s"),
            ("backoff_base", "1.5"),
            ("request_timeout", "2m"),
            ("connect_timeout", "1h"),
            ("part_size", "16MiB"),
            ("part_concurrency", "4"),
            ("coalesce_gap", "4096"),
            ("max_coalesced_bytes", "2G"),
            ("range_concurrency", "3"),
            ("fsync", "0"),
        ])
        .unwrap();
        let expected = StoreConfig {
            retry: RetrySettings {
                max_retries: 5,
                retry_timeout: Duration::from_millis(2500),
                init_backoff: Duration::from_millis(500),
                max_backoff: Duration::from_secs(30),
                backoff_base: 1.5,
            },
            request_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(3600),
            part_size: 16 << 20,
            part_concurrency: 4,
            coalesce_gap: 4096,
            max_coalesced_bytes: 2 << 30,
            range_concurrency: 3,
            fsync: false,
            options: Vec::new(),
        };
        assert_eq!(config, expected);
        config.validate().unwrap();
    }

    #[test]
    fn max_retries_is_an_alias_of_retries_and_the_last_pair_wins() {
        let config =
            StoreConfig::from_pairs([("retries", "0"), ("max_retries", "7"), ("fsync", "TRUE")])
                .unwrap();
        assert_eq!(config.retry.max_retries, 7);
        assert!(config.fsync);
    }

    #[test]
    fn other_keys_become_backend_options_in_order() {
        let mut config = StoreConfig::default();
        config.set("aws_endpoint", "http://127.0.0.1:9000").unwrap();
        config.set("no_such_option", "x").unwrap();
        assert_eq!(
            config.options,
            vec![
                (
                    "aws_endpoint".to_string(),
                    "http://127.0.0.1:9000".to_string()
                ),
                ("no_such_option".to_string(), "x".to_string()),
            ]
        );
    }

    #[test]
    fn a_bad_value_is_a_config_error_naming_key_and_value() {
        for (key, value) in [
            ("retries", "lots"),
            ("retries", "-1"),
            ("retry_timeout", "soon"),
            ("init_backoff", "-1"),
            ("max_backoff", "5 fortnights"),
            ("backoff_base", "fast"),
            ("request_timeout", "NaN"),
            ("part_size", "16 parsecs"),
            ("part_size", "1.5MiB"),
            ("coalesce_gap", "99999999999T"),
            ("range_concurrency", ""),
            ("fsync", "maybe"),
        ] {
            let error = StoreConfig::default().set(key, value).unwrap_err();
            assert_eq!(error.kind(), crate::ErrorKind::Config, "{key}={value}");
            let message = error.to_string();
            assert!(message.contains(key), "{message}");
            assert!(message.contains(&format!("{value:?}")), "{message}");
        }
    }
}
