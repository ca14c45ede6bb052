//! What only a restarted coordinator does: while its settle window runs, it collects
//! the generations its reconnecting members claim, adopts the newest one once all of
//! its members are back with the same view (training never stops), or, when the
//! window ends without that, restarts every claimant into a generation numbered above
//! every claim.
//!
//! A separate file because it is one story of its own, read apart from the rules of
//! a coordinator that formed its generations itself.

use std::collections::BTreeSet;
use std::time::{Instant, SystemTime};

use tracing::info;

use super::Event;
use super::core::{ConnId, Core, Phase, Running};
use crate::{Assignment, Directive, Member, roster_digest};

impl Core {
    /// While settling: adopts the newest claimed generation once all its members are
    /// back with the same view of it.
    pub(super) fn try_adopt(&mut self, now: Instant) {
        let Some(newest_claim) = self
            .conns
            .values()
            .filter_map(|c| c.claim.as_ref().map(|a| a.generation))
            .max()
        else {
            return;
        };
        let claimants: Vec<(ConnId, &Assignment)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| Some((c, conn.claim.as_ref()?)))
            .filter(|(_, claim)| claim.generation == newest_claim)
            .collect();
        let Some(&(_, first)) = claimants.first() else {
            return;
        };
        if claimants.len() != first.members
            || !claimants.iter().all(|(_, claim)| same_view(claim, first))
        {
            return;
        }
        // The claims agree on the numbers; the generation is whole when their blocks
        // of ranks tile `0..world_size` and the claimants' ids give the digest.
        let mut seats: Vec<(usize, String, usize)> = claimants
            .iter()
            .filter_map(|&(c, claim)| {
                Some((claim.rank, self.conns.get(&c)?.id().to_owned(), claim.ranks))
            })
            .collect();
        seats.sort();
        let mut next = 0usize;
        for (rank, _, ranks) in &seats {
            if *rank != next {
                return;
            }
            next = next.saturating_add(*ranks);
        }
        let digest = roster_digest(seats.iter().map(|(_, id, ranks)| (id.as_str(), *ranks)));
        if next != first.world_size || digest != first.roster {
            return;
        }
        let world_size = first.world_size;
        let seats: Vec<(String, usize)> = seats
            .into_iter()
            .map(|(_, id, ranks)| (id, ranks))
            .collect();
        let ids: Vec<String> = seats.iter().map(|(id, _)| id.clone()).collect();
        let adopted: Vec<ConnId> = claimants.iter().map(|&(c, _)| c).collect();
        let older: Vec<(ConnId, u64)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| Some((c, conn.claim.as_ref()?.generation)))
            .filter(|(c, _)| !adopted.contains(c))
            .collect();
        for c in adopted {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.generation = Some(newest_claim);
                conn.claim = None;
                conn.last_seen = now;
                conn.progress = None;
            }
        }
        self.newest = self.newest.max(newest_claim);
        self.formed_any = true;
        let cause = "adopted after a coordinator restart".to_owned();
        info!(generation = newest_claim, members = ?ids, "generation {cause}");
        self.event(Event::Formed {
            generation: newest_claim,
            members: ids.clone(),
            world_size,
            cause: cause.clone(),
            adopted: true,
            at: SystemTime::now(),
        });
        self.cause = cause;
        self.phase = Phase::Running(Running::new(newest_claim, seats));
        for (c, generation) in older {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.claim = None;
            }
            self.tell_stale(c, generation);
        }
    }

    /// The settle window passed without an adoption: restart every claimant into a
    /// new generation numbered above every claim.
    pub(super) fn end_settling(&mut self, now: Instant) {
        let claimants: Vec<(ConnId, String, u64)> = self
            .conns
            .iter()
            .filter_map(|(&c, conn)| {
                let claim = conn.claim.as_ref()?;
                Some((c, conn.id().to_owned(), claim.generation))
            })
            .collect();
        let Some(newest_claim) = claimants.iter().map(|&(_, _, g)| g).max() else {
            self.phase = Phase::Gathering { after: self.newest };
            self.try_form(now);
            return;
        };
        let cause = format!(
            "coordinator restarted; generation {newest_claim} could not be adopted (not all of its members came back)"
        );
        info!(generation = newest_claim, "generation ended: {cause}");
        self.event(Event::Ended {
            generation: newest_claim,
            cause: cause.clone(),
            at: SystemTime::now(),
        });
        self.cause = cause.clone();
        let mut expected = BTreeSet::new();
        for (c, id, generation) in claimants {
            if let Some(conn) = self.conns.get_mut(&c) {
                conn.claim = None;
            }
            if generation == newest_claim {
                expected.insert(id);
            }
            self.directive(
                c,
                Directive::Restart {
                    generation,
                    cause: cause.clone(),
                },
            );
        }
        self.phase = Phase::Rejoin {
            previous: newest_claim,
            expected,
        };
        self.try_form(now);
    }
}

/// True when `claim` is internally consistent and fits `member`: its block of ranks
/// is `member`'s size and lies inside the world.
pub(super) fn claim_is_coherent(claim: &Assignment, member: &Member) -> bool {
    claim.generation > 0
        && claim.ranks == member.ranks
        && claim.members >= 1
        && claim.members <= claim.world_size
        && claim
            .rank
            .checked_add(claim.ranks)
            .is_some_and(|end| end <= claim.world_size)
}

/// Whether two claims describe the same generation.
fn same_view(a: &Assignment, b: &Assignment) -> bool {
    (a.generation, a.world_size, a.members, a.roster)
        == (b.generation, b.world_size, b.members, b.roster)
}
