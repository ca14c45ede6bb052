//! How every subcommand that opens a store turns its flags into a [`Store`]: one
//! set of flags (`-o KEY=VALUE`, `--retries`, the timeouts) and one path from them
//! through [`StoreConfig::set`] to [`Store::open`].
//!
//! Commands differ only in the settings they start from ([`Defaults`]): the
//! checkpoint tools give up on an unreachable store sooner than a trainer does,
//! while `probe` and `bench` keep the library's settings, so that what they report
//! is what a trainer would see.

use std::fmt::Debug;
use std::marker::PhantomData;
use std::time::Duration;

use ckpt::Error;
use ckpt::storage::{Store, StoreConfig};
use ckpt_elastic::timeouts::parse_seconds;
use clap::Args;

/// The settings a command starts from, before its flags apply.
pub(crate) trait Defaults: Debug + Clone + Send + Sync + 'static {
    /// The store settings when no flag is given.
    fn config() -> StoreConfig;
}

/// The checkpoint tools (`ls`, `inspect`, `verify`, …): someone waits at the
/// terminal, so a failed request is retried 3 times within 60 s, not for minutes.
#[derive(Debug, Clone)]
pub(crate) enum ToolDefaults {}

impl Defaults for ToolDefaults {
    fn config() -> StoreConfig {
        let mut config = StoreConfig::default();
        config.retry.max_retries = 3;
        config.retry.retry_timeout = Duration::from_secs(60);
        config
    }
}

/// `probe` and `bench` (and bench's rank processes): the library's own settings.
#[derive(Debug, Clone)]
pub(crate) enum LibraryDefaults {}

impl Defaults for LibraryDefaults {
    fn config() -> StoreConfig {
        StoreConfig::default()
    }
}

/// The flags of every command that opens a store.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs<D: Defaults = ToolDefaults> {
    /// Store setting or backend option KEY=VALUE: ckpt's settings (retries,
    /// retry_timeout, request_timeout, part_size, fsync, …; docs/CLI.md), any other
    /// key as object_store names it (e.g. aws_endpoint=http://127.0.0.1:9000).
    /// Repeatable; applies to every URL, after the flags below.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    options: Vec<String>,
    // None of these flags has a clap default: clap keeps a computed default in one
    // static per field, which every `StoreArgs<D>` would share. An absent flag takes
    // `D`'s value instead (in `config`).
    /// Retries of a failed request to a remote store [default: 3 within 60 s; probe
    /// and bench: 10 within 180 s].
    #[arg(long, value_name = "N")]
    retries: Option<usize>,
    /// Time limit of one request to a remote store, body included, in seconds
    /// [default: 60].
    #[arg(long, value_name = "SECS", value_parser = parse_seconds)]
    request_timeout: Option<f64>,
    /// Time limit to connect to a remote store, in seconds [default: 5].
    #[arg(long, value_name = "SECS", value_parser = parse_seconds)]
    connect_timeout: Option<f64>,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

impl<D: Defaults> StoreArgs<D> {
    /// Opens the store at `url` with these flags.
    pub(crate) fn open(&self, url: &str) -> Result<Store, Error> {
        Ok(Store::open(url, self.config()?)?)
    }

    /// The settings: the command's defaults, then the flags, then each `-o` in order,
    /// every one through [`StoreConfig::set`] (the flags as the pairs of [`Self::pairs`]),
    /// so a flag and its `-o` spelling cannot mean two things.
    fn config(&self) -> Result<StoreConfig, Error> {
        let mut config = D::config();
        for pair in self.pairs() {
            let (key, value) = split(&pair)?;
            config.set(key, value)?;
        }
        Ok(config)
    }

    /// The flags given, each as the `KEY=VALUE` of a `-o`, in the order they apply:
    /// what a child process with the same defaults needs to open the store as this
    /// one does.
    pub(crate) fn pairs(&self) -> Vec<String> {
        let flags = [
            self.retries.map(|n| format!("retries={n}")),
            self.request_timeout.map(|s| format!("request_timeout={s}")),
            self.connect_timeout.map(|s| format!("connect_timeout={s}")),
        ];
        flags
            .into_iter()
            .flatten()
            .chain(self.options.iter().cloned())
            .collect()
    }
}

fn split(option: &str) -> Result<(&str, &str), Error> {
    option
        .split_once('=')
        .map(|(key, value)| (key.trim(), value.trim()))
        .ok_or_else(|| Error::Invalid(format!("option {option:?} is not KEY=VALUE")))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Tool {
        #[command(flatten)]
        store: StoreArgs,
    }

    #[derive(Parser)]
    struct Bench {
        #[command(flatten)]
        store: StoreArgs<LibraryDefaults>,
    }

    #[test]
    fn each_command_starts_from_its_own_defaults() {
        let tool = Tool::parse_from(["ckpt"]).store.config().unwrap();
        assert_eq!(tool.retry.max_retries, 3);
        assert_eq!(tool.retry.retry_timeout, Duration::from_secs(60));
        let bench = Bench::parse_from(["ckpt"]).store.config().unwrap();
        assert_eq!(bench, StoreConfig::default());
    }

    #[test]
    fn flags_apply_then_each_option_in_order() {
        let args = Tool::parse_from([
            "ckpt",
            "--retries",
            "7",
            "--request-timeout",
            "2.5",
            "-o",
            "retries=1",
            "-o",
            "aws_region = us-east-1",
        ])
        .store;
        let config = args.config().unwrap();
        assert_eq!(config.retry.max_retries, 1);
        assert_eq!(config.request_timeout, Duration::from_millis(2500));
        assert_eq!(
            config.options,
            vec![("aws_region".to_string(), "us-east-1".to_string())]
        );
        // A child process given the pairs opens the store with the same settings.
        let mut child = vec!["ckpt".to_string()];
        for pair in args.pairs() {
            child.extend(["-o".to_string(), pair]);
        }
        assert_eq!(Tool::parse_from(child).store.config().unwrap(), config);
    }

    #[test]
    fn an_option_without_a_value_is_a_usage_error() {
        let args = Tool::parse_from(["ckpt", "-o", "retries"]).store;
        assert!(matches!(args.config(), Err(Error::Invalid(_))));
    }
}
