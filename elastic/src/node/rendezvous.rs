//! The node's rendezvous upstream: when it asks the control plane for a generation
//! (every live rank asks, the last call passes, or a generation ended), for how
//! many ranks, and how it hands the block of ranks it is given to its ranks, in
//! order of their ids. Also the count of ranks the control plane has for the node,
//! kept in step with its live ranks.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::state::{Generation, LocalId, Shared, State};
use super::{IDLE, TICK};
use crate::{Assignment, Cancel, Directive, ElasticError, Report};

impl Shared {
    /// Whether the node should ask the control plane for a generation now, and for
    /// how many ranks.
    pub(super) fn should_ask(&self, state: &State, now: Instant) -> Option<(u64, usize)> {
        if state.shutdown.is_some() || state.asking.is_some() {
            return None;
        }
        let live = state.live().count();
        let waiting: Vec<u64> = state
            .live()
            .filter_map(|(_, l)| l.wants.map(|(after, _)| after))
            .collect();
        if waiting.is_empty() {
            return None;
        }
        let after = state.newest;
        match state.running() {
            Some(g) => {
                // A rank of the running generation asks for a newer one: it is over
                // for the node too (at a boundary, or out of turn).
                let generation = g.assignment.generation;
                let member_asks = state.live().any(|(_, l)| {
                    l.wants.is_some_and(|(a, _)| a >= generation) && g.seats.contains_key(l.id())
                });
                member_asks.then_some((generation, live))
            }
            None if state.generation.is_some() => Some((after, live)),
            None => {
                let all = waiting.len() == live && live >= state.expected;
                let called = state
                    .first_ask
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.config.last_call);
                (all || called).then_some((after, live))
            }
        }
    }

    /// When [`Shared::should_ask`] says so, records the ask about to go upstream
    /// (the generation it replaces is over for the node from now on) and returns
    /// it: after which generation, for how many ranks, and its cancel.
    pub(super) fn start_asking(
        &self,
        state: &mut State,
        now: Instant,
    ) -> Option<(u64, usize, Cancel)> {
        let (after, ranks) = self.should_ask(state, now)?;
        let cancel = Cancel::new();
        state.asking = Some((after, ranks, cancel.clone()));
        if let Some(g) = state.generation.as_mut()
            && g.assignment.generation <= after
        {
            g.over = true;
        }
        Some((after, ranks, cancel))
    }

    /// The node got its place in generation `a`: its ranks get theirs.
    pub(super) fn install(&self, a: Assignment, now: Instant) {
        let mut state = self.lock();
        state.joined = true;
        state.newest = state.newest.max(a.generation);
        let mut ids: Vec<String> = state.live().map(|(_, l)| l.id().to_owned()).collect();
        ids.sort();
        let places = a.ranks;
        let seats: BTreeMap<String, usize> = ids
            .iter()
            .take(places)
            .enumerate()
            .map(|(i, id)| (id.clone(), a.rank + i))
            .collect();
        info!(
            generation = a.generation,
            first = a.rank,
            ranks = a.ranks,
            world_size = a.world_size,
            "node has its place in a generation"
        );
        let generation = a.generation;
        // The control plane's Restart of the generation this one replaces travels
        // apart from this answer (another thread relays it) and, once this is
        // installed, would find no generation of its own to end; nor does the
        // control plane send one to a node that asked first (a survivor whose
        // collective failed asks at once, and the node asks for it). The ranks still
        // in the old one hear of its end here, unless the relay told them already, or
        // one of them blocked where only its generation's end reaches it (the ring's
        // bootstrap, a commit) would wait out the join timeout and be dropped. The
        // node's own ask marks the old generation over, so `over` cannot tell. A
        // generation that ended at a checkpoint boundary is not aborted: its ranks
        // finish the same commit and come by themselves.
        if let Some(old) = state
            .generation
            .as_ref()
            .filter(|g| !g.told && !g.at_boundary)
            && old.assignment.generation < generation
        {
            let restart = Directive::Restart {
                generation: old.assignment.generation,
                cause: a.cause.clone(),
            };
            let still_in: Vec<LocalId> = old
                .seats
                .keys()
                .filter_map(|id| state.local_of(id))
                .filter(|c| state.locals.get(c).is_some_and(|l| l.wants.is_none()))
                .collect();
            for c in still_in {
                state.directive(c, restart.clone());
            }
        }
        state.generation = Some(Generation {
            assignment: a,
            seats: seats.clone(),
            formed: now,
            over: false,
            told: false,
            at_boundary: false,
            kv: Vec::new(),
        });
        for id in ids.iter().skip(places) {
            // More live ranks than places (one started while the node asked): it
            // waits for the next generation, and the node holds it from now on.
            debug!(rank = %id, generation, "no place for this rank in this generation");
        }
        let asking: Vec<(LocalId, String)> = state
            .live()
            .filter(|(_, l)| l.wants.is_some_and(|(after, _)| after < generation))
            .map(|(c, l)| (c, l.id().to_owned()))
            .collect();
        for (c, id) in asking {
            if let Some(assignment) = state.assignment_of(&id) {
                if let Some(local) = state.locals.get_mut(&c) {
                    local.wants = None;
                    local.progress = None;
                    local.last_seen = now;
                }
                state.assign(c, assignment);
            }
        }
        if seats.len() < places {
            // A rank counted in the ask died before the answer: the world has a
            // hole, and the node says so at once.
            let cause = format!(
                "node holds {places} ranks in generation {generation} but only {} are alive",
                seats.len()
            );
            drop(state);
            warn!(generation, "{cause}");
            self.report(generation, Report::RankLost { cause });
            return;
        }
        self.changed.notify_all();
    }
}

/// Asks the control plane for generations when the node's ranks want one.
pub(super) fn rendezvous_loop(shared: &Arc<Shared>) {
    loop {
        let (after, ranks, cancel) = {
            let mut state = shared.lock();
            loop {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(ask) = shared.start_asking(&mut state, Instant::now()) {
                    break ask;
                }
                // Woken by every change; the timeout only ends the last call.
                let wait = match (state.first_ask, &state.generation) {
                    (Some(first), None) => (first + shared.config.last_call)
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                    _ => IDLE,
                };
                state = shared
                    .changed
                    .wait_timeout(state, wait.min(IDLE))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        };
        let outcome = shared
            .upstream
            .hold(ranks)
            .and_then(|()| shared.upstream.rendezvous(after, &cancel));
        let now = Instant::now();
        {
            let mut state = shared.lock();
            state.asking = None;
            if outcome.is_ok() || !matches!(outcome, Err(ElasticError::Cancelled)) {
                state.held = ranks;
            }
        }
        match outcome {
            Ok(assignment) => {
                shared.reached();
                shared.install(assignment, now);
            }
            Err(ElasticError::Cancelled) => {}
            Err(ElasticError::Shutdown(reason)) => {
                shared.relay(Directive::Shutdown { reason });
            }
            Err(e) => {
                warn!(error = %e, "the node's rendezvous failed");
                if !matches!(e, ElasticError::Timeout(_) | ElasticError::Io(_)) {
                    shared.relay(Directive::Shutdown {
                        reason: format!("the control plane refused this node: {e}"),
                    });
                } else if matches!(e, ElasticError::Io(_)) {
                    shared.unreachable(&e, now);
                }
                std::thread::sleep(TICK);
            }
        }
    }
}

/// Keeps the ranks the control plane counts for this node in step with its live
/// ranks: while the node asks for a generation (a rank that connects late is
/// counted before the generation forms), and while it trains (a rank started again
/// waits to join, so that the world grows at the next checkpoint).
pub(super) fn grow(shared: &Shared) {
    let ranks = {
        let state = shared.lock();
        let live = state.live().count();
        let asked = match (&state.asking, state.running()) {
            (Some((_, asked, _)), _) => *asked,
            (None, Some(g)) if live > g.seats.len() => state.held,
            _ => return,
        };
        if live == asked || live == 0 {
            return;
        }
        live
    };
    match shared.upstream.hold(ranks) {
        Ok(()) => {
            let mut state = shared.lock();
            state.held = ranks;
            if let Some((_, asked, _)) = state.asking.as_mut() {
                *asked = ranks;
            }
        }
        Err(e) => debug!(error = %e, "cannot tell the control plane the node's ranks"),
    }
}
