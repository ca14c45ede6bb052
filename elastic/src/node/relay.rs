//! What comes down from the control plane to the ranks: its directives (Restart,
//! Regroup, Stale, Shutdown), each passed to the ranks it concerns, and the running
//! generation's keys, passed to its seated ranks as they appear.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::info;

use super::state::{LocalId, Shared, State};
use super::{IDLE, TICK};
use crate::Directive;
use crate::protocol::ServerMessage;

impl Shared {
    /// Passes `directive` from the control plane on to the ranks it concerns.
    pub(super) fn relay(&self, directive: Directive) {
        let mut state = self.lock();
        let seated = |state: &State| -> Vec<LocalId> {
            let Some(g) = &state.generation else {
                return Vec::new();
            };
            g.seats.keys().filter_map(|id| state.local_of(id)).collect()
        };
        match &directive {
            Directive::Restart { generation, .. } | Directive::Regroup { generation, .. } => {
                let ours = state
                    .generation
                    .as_ref()
                    .is_some_and(|g| g.assignment.generation == *generation);
                if !ours {
                    return;
                }
                if matches!(directive, Directive::Restart { .. })
                    && let Some(g) = state.generation.as_mut()
                {
                    g.over = true;
                    g.told = true;
                }
                for c in seated(&state) {
                    state.directive(c, directive.clone());
                }
            }
            Directive::Stale { current } => {
                state.newest = state.newest.max(*current);
                let over = state.generation.as_mut().map(|g| {
                    g.over = true;
                    g.told = true;
                    g.assignment.generation
                });
                info!(
                    current,
                    "the control plane dropped this node; its ranks are stale"
                );
                for c in seated(&state) {
                    // A rank that already left the generation and asks for a newer
                    // one knows it is over: its ask stands, for the node to pass on.
                    let moved_on = state
                        .locals
                        .get(&c)
                        .and_then(|l| l.wants)
                        .is_some_and(|(after, _)| over.is_some_and(|g| after >= g));
                    if !moved_on {
                        state.tell_stale(c);
                    }
                }
            }
            Directive::Shutdown { reason } => {
                state.shutdown = Some(reason.clone());
                // Every rank still connected, stale ones included: one waiting for a
                // generation must hear that none will come.
                let all: Vec<LocalId> = state
                    .locals
                    .iter()
                    .filter(|(_, l)| l.member.is_some())
                    .map(|(&c, _)| c)
                    .collect();
                for c in all {
                    state.directive(c, directive.clone());
                }
            }
        }
        self.changed.notify_all();
    }
}

/// Passes the running generation's keys on to its ranks.
pub(super) fn kv_loop(shared: &Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        let (generation, known) = {
            let state = shared.lock();
            match state.running() {
                Some(g) => (g.assignment.generation, g.kv.len()),
                None => (0, 0),
            }
        };
        if generation == 0 {
            let state = shared.lock();
            let _ = shared.changed.wait_timeout(state, IDLE);
            continue;
        }
        // Bounded by the heartbeat interval, so that a node that is dropped lets go
        // of its control plane (closing its connection) that soon.
        match shared
            .upstream
            .kv_all(generation, known, shared.config.heartbeat_interval)
        {
            Ok(all) if all.len() > known => {
                let mut state = shared.lock();
                let Some(g) = state.generation.as_mut() else {
                    continue;
                };
                if g.assignment.generation != generation {
                    continue;
                }
                let new: Vec<(String, String)> = all
                    .into_iter()
                    .filter(|(k, v)| !g.kv.iter().any(|(k2, v2)| k2 == k && v2 == v))
                    .collect();
                g.kv.extend(new.iter().cloned());
                let ids: Vec<String> = g.seats.keys().cloned().collect();
                let seated: Vec<LocalId> = ids.iter().filter_map(|id| state.local_of(id)).collect();
                for (key, value) in new {
                    let update = ServerMessage::Kv {
                        generation,
                        key,
                        value,
                    };
                    for &c in &seated {
                        state.send(c, &update);
                    }
                }
            }
            Ok(_) => {}
            Err(_) => {
                let state = shared.lock();
                let _ = shared.changed.wait_timeout(state, TICK);
            }
        }
    }
}
