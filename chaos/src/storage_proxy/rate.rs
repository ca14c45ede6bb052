//! The bandwidth cap: one token bucket for the bodies of every connection.
//!
//! A real object store is often slower than the network in front of it: its
//! front ends stream each object at a bounded rate, and a bucket prefix serves
//! so many bytes a second in all however many clients ask. On loopback the
//! test server is as fast as the CPU, so a benchmark of "read each byte once"
//! against "every replica reads everything" would measure memory copies. The cap
//! makes the store the bottleneck again, for all clients together.
//!
//! The bucket is kept as the theoretical time at which its debt is paid (the
//! generic cell rate algorithm): each run of `n` body bytes is due `n / rate`
//! after the previous run (or after now less the burst, when the bucket has
//! been idle), and is held back until then. Bytes are released at most one
//! relay buffer ahead of the rate ([`BURST`]), so a transfer of `N` bytes from
//! idle takes at least `(N - BURST) / rate`, whatever the number of
//! connections sharing it. It is pure arithmetic on instants, so the rule is
//! tested without a clock.

use std::time::{Duration, Instant};

use super::faults::{SharedState, Way};

/// How many bytes may go at once from an idle bucket: one relay buffer.
pub(super) const BURST: u64 = 64 * 1024;

/// A bytes-per-second cap shared by every connection of a proxy.
#[derive(Debug)]
pub(super) struct TokenBucket {
    bytes_per_second: u64,
    /// When the bytes let through so far are paid for; `None` before the first.
    paid_at: Option<Instant>,
}

impl TokenBucket {
    /// A cap of `bytes_per_second` (at least 1).
    pub(super) fn new(bytes_per_second: u64) -> TokenBucket {
        TokenBucket {
            bytes_per_second: bytes_per_second.max(1),
            paid_at: None,
        }
    }

    pub(super) fn bytes_per_second(&self) -> u64 {
        self.bytes_per_second
    }

    /// Books `n` bytes at `now`; returns when they may go (at or before `now`:
    /// at once).
    pub(super) fn reserve(&mut self, n: u64, now: Instant) -> Instant {
        let burst = self.duration_of(BURST);
        let earliest = now.checked_sub(burst).unwrap_or(now);
        let start = self.paid_at.map_or(earliest, |paid| paid.max(earliest));
        let due = start + self.duration_of(n);
        self.paid_at = Some(due);
        due
    }

    fn duration_of(&self, bytes: u64) -> Duration {
        let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(self.bytes_per_second);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// Where the bytes of one relayed body are counted and paced.
#[derive(Clone, Copy)]
pub(super) struct Meter<'a>(Option<(&'a SharedState, Way)>);

impl<'a> Meter<'a> {
    /// Bytes the proxy discards: neither counted nor paced.
    pub(super) const OFF: Meter<'static> = Meter(None);

    /// Bytes relayed `way`, counted in `shared`'s stats and held to its cap.
    pub(super) fn new(shared: &'a SharedState, way: Way) -> Meter<'a> {
        Meter(Some((shared, way)))
    }

    /// Counts `n` bytes about to be written and waits until the cap lets them go.
    pub(super) async fn pass(&self, n: usize) {
        if let Some((shared, way)) = self.0
            && let Some(due) = shared.pass(n, way)
        {
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    /// Runs of bytes booked back to back, as the relays of several connections
    /// book them: the last is due no sooner than the bytes past the burst take at
    /// the rate, and no later than all of them would.
    #[test]
    fn back_to_back_runs_are_due_at_the_rate_after_one_burst() {
        let mut bucket = TokenBucket::new(4 * MIB);
        let now = Instant::now() + Duration::from_secs(1);
        let mut due = now;
        for _ in 0..32 {
            due = bucket.reserve(64 * 1024, now);
        }
        let total = 32 * 64 * 1024;
        let elapsed = due - now;
        assert!(elapsed >= Duration::from_secs_f64((total - BURST) as f64 / (4 * MIB) as f64));
        assert!(elapsed <= Duration::from_secs_f64(total as f64 / (4 * MIB) as f64));
    }

    /// An idle bucket lets one burst go at once, not the whole idle time's worth.
    #[test]
    fn idle_time_buys_one_burst_only() {
        let mut bucket = TokenBucket::new(MIB);
        let start = Instant::now() + Duration::from_secs(1);
        assert!(bucket.reserve(MIB, start) > start);
        let later = start + Duration::from_secs(60);
        assert!(bucket.reserve(BURST, later) <= later);
        assert!(bucket.reserve(BURST, later) > later);
    }
}
