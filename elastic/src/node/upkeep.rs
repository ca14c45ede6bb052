//! The node's upkeep: its heartbeat upstream (its ranks' slowest step and highest
//! checkpoint generation), its own checks of its ranks (heartbeat, progress and join
//! timeouts), the watch for the control plane's directives, and how long it bears
//! a control plane out of reach before it shuts its ranks down.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::{debug, warn};

use super::rendezvous::grow;
use super::state::{LocalId, Shared, State};
use super::{TICK, UNREACHABLE_GIVE_UP};
use crate::policy::{hung_member, lost_member};
use crate::{Directive, ElasticError, Progress};

impl Shared {
    /// Rank `c` of the running generation is lost: `cause` names it. It loses its
    /// place (a reconnect cannot claim it back) and is told it is stale, so that it
    /// writes nothing more if it wakes up; its connection stays open for it to read
    /// that. The generation restarts.
    pub(super) fn lose(&self, state: &mut State, c: LocalId, cause: String) {
        let generation = state.running().map(|g| g.assignment.generation);
        warn!(generation, "{cause}");
        if let Some(id) = state.locals.get(&c).map(|l| l.id().to_owned())
            && let Some(g) = state.generation.as_mut()
        {
            g.seats.remove(&id);
        }
        state.tell_stale(c);
        if let Some(generation) = generation {
            self.report_loss(state, generation, cause);
        }
        self.changed.notify_all();
    }

    /// A call upstream reached the control plane.
    pub(super) fn reached(&self) {
        self.lock().unreachable_since = None;
    }

    /// A call upstream failed for want of the control plane (`error`, at `now`).
    /// Once every call has failed so for [`UNREACHABLE_GIVE_UP`], the node shuts its
    /// ranks down with the cause, and says true: the job cannot go on from here,
    /// and a rank connected to the control plane itself would have given up too.
    ///
    /// The outage counts from its start: a backend that reconnects quietly (the TCP
    /// client) fails a call only after its own timeout, which is part of it
    /// ([`ControlPlane::unreachable_for`]); before it stacked with this one, and a
    /// node gave up after twice [`UNREACHABLE_GIVE_UP`]. A node that has not joined a
    /// generation gives up after [`NodeConfig::give_up_before_joining`].
    ///
    /// [`ControlPlane::unreachable_for`]: crate::ControlPlane::unreachable_for
    /// [`NodeConfig::give_up_before_joining`]: super::NodeConfig::give_up_before_joining
    pub(super) fn unreachable(&self, error: &ElasticError, now: Instant) -> bool {
        let hidden = self.upstream.unreachable_for().unwrap_or_default();
        let (since, patience) = {
            let mut state = self.lock();
            if state.shutdown.is_some() {
                return true;
            }
            let patience = if state.joined {
                UNREACHABLE_GIVE_UP
            } else {
                self.config.give_up_before_joining.min(UNREACHABLE_GIVE_UP)
            };
            (*state.unreachable_since.get_or_insert(now), patience)
        };
        let down = now.saturating_duration_since(since).max(hidden);
        if down < patience {
            return false;
        }
        self.relay(Directive::Shutdown {
            reason: format!(
                "the control plane has been out of reach of this node for {} s: {error}",
                down.as_secs()
            ),
        });
        true
    }

    /// The node's own checks of its ranks in the running generation.
    pub(super) fn check_ranks(&self, now: Instant) {
        let policy = self.policy();
        let timeouts = self.config.timeouts;
        let mut state = self.lock();
        let Some(g) = state.running() else {
            return;
        };
        let generation = g.assignment.generation;
        let formed = g.formed;
        let seats: Vec<String> = g.seats.keys().cloned().collect();
        for id in seats {
            let Some(c) = state.local_of(&id) else {
                // Given a place, then gone before taking it (its fatal report or
                // its exit raced the node's ask): the world has a hole.
                if let Some(g) = state.generation.as_mut() {
                    g.seats.remove(&id);
                }
                let cause = lost_member(
                    &id,
                    format_args!("gone before it joined generation {generation}"),
                );
                warn!(generation, "{cause}");
                self.report_loss(&state, generation, cause);
                return;
            };
            let local = &state.locals[&c];
            let silent = now.saturating_duration_since(local.last_seen);
            let joined = local
                .progress
                .as_ref()
                .is_some_and(|(g, _)| *g == generation);
            let verdict = if silent > timeouts.heartbeat_timeout {
                Some(lost_member(
                    &id,
                    format_args!("no heartbeat for {} ms", silent.as_millis()),
                ))
            } else if let Some((g, p)) = &local.progress
                && *g == generation
                && policy.hung(p)
            {
                Some(hung_member(&id, p.idle_ms))
            } else if !joined
                && local.wants.is_none()
                && now.saturating_duration_since(formed) > timeouts.join_timeout
            {
                Some(lost_member(
                    &id,
                    format_args!(
                        "did not join generation {generation} within {} ms",
                        timeouts.join_timeout.as_millis()
                    ),
                ))
            } else {
                None
            };
            if let Some(cause) = verdict {
                self.lose(&mut state, c, cause);
                return;
            }
        }
    }

    /// What the node says in its heartbeat: its ranks' slowest step and highest
    /// checkpoint generation. Hangs are the node's to judge, so it is never idle.
    /// One heartbeat upstream now.
    pub(super) fn beat(&self) {
        let (generation, progress) = self.progress();
        if let Err(e) = self.upstream.heartbeat(generation, &progress) {
            debug!(error = %e, "node heartbeat not sent");
        }
    }

    pub(super) fn progress(&self) -> (u64, Progress) {
        let state = self.lock();
        let Some(g) = state.running() else {
            let progress = Progress {
                checkpoint_generation: state.checkpoint_generation,
                ..Progress::default()
            };
            return (0, progress);
        };
        let generation = g.assignment.generation;
        let mut progress = Progress {
            step: u64::MAX,
            ..Progress::default()
        };
        for (_, local) in state.live() {
            if let Some((g, p)) = &local.progress
                && *g == generation
            {
                progress.step = progress.step.min(p.step);
                progress.checkpoint_generation =
                    progress.checkpoint_generation.max(p.checkpoint_generation);
            }
        }
        if progress.step == u64::MAX {
            progress.step = 0;
        }
        progress.checkpoint_generation = progress
            .checkpoint_generation
            .max(state.checkpoint_generation);
        (generation, progress)
    }
}

/// Heartbeats upstream, passes directives on, checks the node's ranks, and keeps
/// the rank count the control plane has in step with the live ranks.
pub(super) fn upkeep_loop(shared: &Arc<Shared>) {
    let interval = shared.config.heartbeat_interval;
    let mut next_beat = Instant::now();
    while !shared.stopping.load(Ordering::SeqCst) {
        if shared.silent.load(Ordering::SeqCst) {
            std::thread::sleep(interval);
            continue;
        }
        let now = Instant::now();
        if now >= next_beat {
            shared.beat();
            next_beat = now + interval;
            shared.check_ranks(now);
            grow(shared);
        }
        let (generation, asking) = {
            let state = shared.lock();
            let generation = state
                .generation
                .as_ref()
                .map_or(0, |g| g.assignment.generation);
            (generation, state.asking.clone())
        };
        let wait = next_beat.saturating_duration_since(Instant::now());
        match shared.upstream.watch(generation, wait) {
            Ok(Some(directive)) => {
                shared.reached();
                if let (Directive::Shutdown { .. }, Some((_, _, cancel))) = (&directive, asking) {
                    cancel.cancel();
                }
                shared.relay(directive);
            }
            Ok(None) => shared.reached(),
            Err(e) => {
                warn!(error = %e, "the node cannot watch the control plane");
                if matches!(e, ElasticError::Rejected(_) | ElasticError::Shutdown(_)) {
                    shared.relay(Directive::Shutdown {
                        reason: format!("the control plane refused this node: {e}"),
                    });
                    return;
                }
                if matches!(e, ElasticError::Io(_)) {
                    let asking = shared.lock().asking.as_ref().map(|(_, _, c)| c.clone());
                    if shared.unreachable(&e, Instant::now())
                        && let Some(cancel) = asking
                    {
                        cancel.cancel();
                    }
                }
                std::thread::sleep(TICK);
            }
        }
    }
}
