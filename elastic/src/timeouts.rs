//! The job's time windows, their defaults and their checks, in one place.
//!
//! # Why a module of its own
//!
//! The same five windows (last call, heartbeat, progress, join, rendezvous) are read
//! by the built-in coordinator, published by every etcd launcher under the job's
//! `config` key, and set from two command lines (`ckpt coordinator` and
//! `ckpt-train launch`). When each kept its own defaults they drifted apart (the
//! progress timeout was 30 s on one side and 60 s on the other, so the same job
//! behaved differently depending on who hosted its control plane). Everything that
//! needs a default or a check takes it from here: [`Timeouts::DEFAULT`],
//! [`Timeouts::validate`], [`validate_ranks`] and [`parse_seconds`] for flags.

use std::time::Duration;

/// Time between an agent's heartbeats (500 ms): a tenth of the default heartbeat
/// timeout, so that a few late heartbeats never look like a lost member.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// The time windows that decide when a generation forms and when a member is lost.
/// Durations are wall-clock on whoever applies them (the coordinator, or each etcd
/// agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Once `min_ranks` members wait, how long to wait for more (300 ms): ranks
    /// arriving together land in one generation.
    pub last_call: Duration,
    /// No heartbeat for this long: member lost (SIGSTOP, partition) (5 s). On etcd the
    /// lease's time to live (whole seconds, at least 2).
    pub heartbeat_timeout: Duration,
    /// Idle and not in a collective for this long: member hung (60 s).
    pub progress_timeout: Duration,
    /// After a generation ends, survivors that do not ask for the next one by then
    /// are dropped (10 s).
    pub join_timeout: Duration,
    /// Fewer than `min_ranks` members waiting for this long with no generation
    /// running: the job is shut down (120 s).
    pub rendezvous_timeout: Duration,
}

impl Timeouts {
    /// The defaults of every entry point (library, `ckpt coordinator`, launcher).
    ///
    /// The progress timeout is 60 s: it is the only detector that can blame a live,
    /// heartbeating member, so a false positive (a long step, a slow first
    /// compile or load outside a collective) costs a whole recovery, while a
    /// longer bound only delays the rare stuck loop; crashes and silent members are
    /// found by the connection and the heartbeat timeout regardless.
    pub const DEFAULT: Timeouts = Timeouts {
        last_call: Duration::from_millis(300),
        heartbeat_timeout: Duration::from_secs(5),
        progress_timeout: Duration::from_secs(60),
        join_timeout: Duration::from_secs(10),
        rendezvous_timeout: Duration::from_secs(120),
    };

    /// Checks that the windows make sense; the error names the bad one. Every
    /// window but the last call must be positive (a zero heartbeat timeout would
    /// declare every member lost at once).
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("heartbeat_timeout", self.heartbeat_timeout),
            ("progress_timeout", self.progress_timeout),
            ("join_timeout", self.join_timeout),
            ("rendezvous_timeout", self.rendezvous_timeout),
        ] {
            if value.is_zero() {
                return Err(format!("{name} is zero"));
            }
        }
        Ok(())
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts::DEFAULT
    }
}

/// Checks a generation's size bounds: `1 <= min_ranks <= max_ranks`.
pub fn validate_ranks(min_ranks: usize, max_ranks: usize) -> Result<(), String> {
    if min_ranks == 0 {
        return Err("min_ranks is 0; a generation needs at least one member".into());
    }
    if max_ranks < min_ranks {
        return Err(format!(
            "max_ranks {max_ranks} is below min_ranks {min_ranks}"
        ));
    }
    Ok(())
}

/// Parses a positive number of seconds (fractions allowed), for a command-line
/// flag: what [`Duration::from_secs_f64`] accepts without panicking, and nothing
/// absurd.
pub fn parse_seconds(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if value.is_finite() && value > 0.0 && value <= 1e9 {
        Ok(value)
    } else {
        Err(format!("{text} is not a positive number of seconds"))
    }
}

/// `duration` in whole milliseconds, saturating (for flags and etcd's settings).
pub fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_each_bad_value_is_named() {
        assert_eq!(Timeouts::default().validate(), Ok(()));
        let no_heartbeat = Timeouts {
            heartbeat_timeout: Duration::ZERO,
            ..Timeouts::DEFAULT
        };
        assert_eq!(
            no_heartbeat.validate(),
            Err("heartbeat_timeout is zero".into())
        );
        let no_last_call = Timeouts {
            last_call: Duration::ZERO,
            ..Timeouts::DEFAULT
        };
        assert_eq!(no_last_call.validate(), Ok(()), "members may form at once");
        assert!(validate_ranks(0, 1).unwrap_err().contains("min_ranks is 0"));
        assert!(
            validate_ranks(3, 2)
                .unwrap_err()
                .contains("below min_ranks 3")
        );
        assert_eq!(validate_ranks(2, 2), Ok(()));
    }

    #[test]
    fn seconds_flags_accept_fractions_and_refuse_what_a_duration_cannot_hold() {
        assert_eq!(parse_seconds("0.5"), Ok(0.5));
        assert_eq!(parse_seconds("60"), Ok(60.0));
        for bad in ["0", "-1", "NaN", "inf", "1e10", "five"] {
            assert!(parse_seconds(bad).is_err(), "{bad}");
        }
    }
}
