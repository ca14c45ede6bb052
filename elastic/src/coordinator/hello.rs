//! A member's hello: who is let in (the job, the protocol version, the ranks it
//! holds), what a second connection of the same member replaces, and what the
//! generation it claims gets it in each phase (adopted while settling, its place
//! back while running, the Restart it may have missed while rejoining, or Stale).

use std::time::Instant;

use tracing::info;

use super::adopt::claim_is_coherent;
use super::core::{ConnId, Core, Outcome, Phase};
use crate::protocol::{self, ServerMessage};
use crate::{Assignment, Directive, MAX_RANKS_PER_MEMBER, Member};

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hello(
        &mut self,
        c: ConnId,
        version: u32,
        member: Member,
        seen: u64,
        checkpoint_generation: u64,
        claim: Option<Assignment>,
        now: Instant,
    ) -> Outcome {
        let refusal = if let Some(refusal) =
            protocol::hello_refusal(version, &member, &self.config.job, "coordinator")
        {
            Some(refusal)
        } else if member.ranks == 0 || member.ranks > MAX_RANKS_PER_MEMBER {
            Some(format!(
                "member {:?} holds {} ranks; a member holds 1 to {MAX_RANKS_PER_MEMBER}",
                member.id, member.ranks
            ))
        } else {
            None
        };
        if let Some(refusal) = refusal {
            self.error(c, &refusal, true);
            return Outcome::Close(refusal);
        }
        let claim = match claim {
            Some(claim) if !claim_is_coherent(&claim, &member) => {
                self.error(
                    c,
                    &format!(
                        "claimed generation {} is not coherent with member {:?} (rank {}, {} of {} ranks, {} members); claim ignored",
                        claim.generation,
                        member.id,
                        claim.rank,
                        claim.ranks,
                        claim.world_size,
                        claim.members
                    ),
                    false,
                );
                None
            }
            claim => claim,
        };
        self.members_seen = true;
        self.newest = self.newest.max(seen);
        self.floor = self.floor.max(checkpoint_generation.saturating_add(1));
        if let Some(claim) = &claim {
            self.newest = self.newest.max(claim.generation);
            self.floor = self.floor.max(claim.checkpoint_generation_floor);
        }
        let id = member.id.clone();
        // A second connection for the same member replaces the first: it keeps the
        // first one's place only if it claims exactly the running generation.
        let reattach = match (&self.phase, &claim) {
            (Phase::Running(running), Some(claim)) => {
                running.members.contains(&id) && running.claimed_by(&id, claim)
            }
            _ => false,
        };
        if let Some(old) = self.conn_of(&id).filter(|&old| old != c) {
            if reattach {
                self.by_member.insert(id.clone(), c);
                self.remove(old, "replaced by a new connection", now);
            } else {
                self.remove(
                    old,
                    "replaced by a new connection without its generation",
                    now,
                );
            }
        }
        self.by_member.insert(id.clone(), c);
        let Some(conn) = self.conns.get_mut(&c) else {
            return Outcome::Close("connection removed".into());
        };
        conn.member = Some(member);
        let welcome = ServerMessage::Welcome {
            job: self.config.job.clone(),
            generation: self.newest,
        };
        self.send(c, &welcome);
        if let Some(reason) = self.shutdown.clone() {
            self.directive(c, Directive::Shutdown { reason });
            return Outcome::Welcomed;
        }
        let Some(claim) = claim else {
            return Outcome::Welcomed;
        };
        let claimed = claim.generation;
        match &self.phase {
            Phase::Settling { .. } => {
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                    conn.claim = Some(claim);
                }
                self.try_adopt(now);
            }
            Phase::Running(_) if reattach => {
                info!(member = %id, generation = claimed, "member reconnected to its generation");
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
            }
            Phase::Rejoin {
                previous, expected, ..
            } if *previous == claimed && expected.contains(&id) => {
                // It may have missed the Restart while it was disconnected.
                let cause = self.cause.clone();
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.generation = Some(claimed);
                }
                self.directive(
                    c,
                    Directive::Restart {
                        generation: claimed,
                        cause,
                    },
                );
            }
            _ => self.tell_stale(c, claimed),
        }
        Outcome::Welcomed
    }
}
