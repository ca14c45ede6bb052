//! What an etcd client knows of its job's keys: a mirror, kept in step by one watch,
//! that every blocking call waits on (with a condition variable, so that etcd sees
//! no polling), and the [`Event`]s a launcher reads, derived from the generation
//! record's transitions.
//!
//! Apart from the connection because it is plain data: it parses and folds key
//! changes, ignoring garbage, and never talks to etcd.

use std::collections::BTreeMap;
use std::time::SystemTime;

use etcd_client::KeyValue;
use tracing::warn;

use super::rules::{GenRecord, GenState, JobConfig, Live, MemberRecord};
use crate::Event;

/// Generation records remembered per generation number (for late directives).
pub(super) const MAX_HISTORY: usize = 8;
/// Bootstrap keys mirrored at most (newest generations win).
pub(super) const MAX_KEYS: usize = 4096;
/// A key or value longer than this is refused (they are addresses and small JSON).
pub(super) const MAX_VALUE: usize = 64 * 1024;
/// Events kept for [`EtcdJob::events`](super::EtcdJob::events).
pub(super) const MAX_EVENTS: usize = 4096;

/// The job's key names.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    pub(super) root: String,
}

impl Keys {
    pub(super) fn config(&self) -> String {
        format!("{}config", self.root)
    }
    pub(super) fn generation(&self) -> String {
        format!("{}generation", self.root)
    }
    pub(super) fn member(&self, id: &str) -> String {
        format!("{}members/{id}", self.root)
    }
    pub(super) fn kv_of(&self, generation: u64) -> String {
        format!("{}g/{generation:020}/", self.root)
    }
}

/// What this process knows of the job's keys.
#[derive(Default)]
pub(super) struct Mirror {
    /// Revision up to which events were applied.
    pub(super) revision: i64,
    /// A watch runs (else the mirror may be behind).
    pub(super) synced: bool,
    pub(super) current: Option<GenRecord>,
    pub(super) gen_revision: i64,
    pub(super) history: BTreeMap<u64, GenRecord>,
    pub(super) members: BTreeMap<String, Live>,
    pub(super) kv: BTreeMap<(u64, String), String>,
    pub(super) config: Option<JobConfig>,
    pub(super) events: Vec<Event>,
    /// Bumped on every change (the rules task's wake-up).
    pub(super) changes: u64,
}

impl Mirror {
    pub(super) fn current(&self) -> GenRecord {
        self.current.clone().unwrap_or_else(GenRecord::none)
    }

    pub(super) fn set_gen(&mut self, record: GenRecord, revision: i64) {
        if revision <= self.gen_revision {
            return;
        }
        let previous = self.current();
        let at = SystemTime::now();
        if previous.is_running() && previous.generation == record.generation {
            // Members that left the running generation on purpose (a lost member
            // ends the generation instead, and keeps its place in the record).
            let cause = match &record.state {
                GenState::Running { left, .. } => left.clone(),
                GenState::Ended { cause, .. } => Some(cause.clone()),
                GenState::Shutdown { .. } => None,
            };
            for gone in previous
                .members
                .iter()
                .filter(|m| record.rank_of(&m.id).is_none())
            {
                self.push(Event::Left {
                    generation: record.generation,
                    member: gone.id.clone(),
                    cause: cause
                        .clone()
                        .unwrap_or_else(|| format!("member {} left", gone.id)),
                    at,
                });
            }
        }
        match &record.state {
            GenState::Running { .. }
                if record.generation != previous.generation || !previous.is_running() =>
            {
                self.push(Event::Formed {
                    generation: record.generation,
                    members: record.members.iter().map(|m| m.id.clone()).collect(),
                    world_size: record.world_size(),
                    cause: record.cause.clone(),
                    adopted: false,
                    at,
                });
            }
            GenState::Ended { cause, .. }
                if previous.is_running() || previous.generation != record.generation =>
            {
                self.push(Event::Ended {
                    generation: record.generation,
                    cause: cause.clone(),
                    at,
                });
            }
            GenState::Shutdown { reason }
                if !matches!(previous.state, GenState::Shutdown { .. }) =>
            {
                self.push(Event::Shutdown {
                    reason: reason.clone(),
                    at,
                });
            }
            _ => {}
        }
        self.history.insert(record.generation, record.clone());
        while self.history.len() > MAX_HISTORY {
            self.history.pop_first();
        }
        self.current = Some(record);
        self.gen_revision = revision;
    }

    pub(super) fn push(&mut self, event: Event) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(event);
    }

    /// Folds one key's new value (`None`: deleted) into the mirror.
    pub(super) fn apply(&mut self, keys: &Keys, key: &str, value: Option<&[u8]>, revision: i64) {
        self.changes += 1;
        let Some(name) = key.strip_prefix(&keys.root) else {
            return;
        };
        let parse = |what: &str| -> Option<serde_json::Value> {
            let value = value?;
            match serde_json::from_slice(value) {
                Ok(v) => Some(v),
                Err(e) => {
                    warn!(key, error = %e, "unreadable {what} in etcd; ignored");
                    None
                }
            }
        };
        if name == "generation" {
            if let Some(v) = parse("generation record") {
                match serde_json::from_value::<GenRecord>(v) {
                    Ok(record) => self.set_gen(record, revision),
                    Err(e) => {
                        warn!(key, error = %e, "unreadable generation record; ignored");
                        self.gen_revision = self.gen_revision.max(revision);
                    }
                }
            } else if value.is_some() {
                // Not obeyed, but its revision is taken, so that the next proposal
                // replaces it instead of failing its comparison forever.
                self.gen_revision = self.gen_revision.max(revision);
            }
        } else if name == "config" {
            if let Some(v) = parse("job settings") {
                self.config = serde_json::from_value(v).ok();
            }
        } else if let Some(id) = name.strip_prefix("members/") {
            match value {
                None => {
                    self.members.remove(id);
                }
                Some(_) => {
                    let record = parse("member record")
                        .and_then(|v| serde_json::from_value::<MemberRecord>(v).ok());
                    match record {
                        Some(record) if record.member.id == id => {
                            self.members
                                .insert(id.to_owned(), Live { record, revision });
                        }
                        _ => warn!(key, "member record that does not name its key; ignored"),
                    }
                }
            }
        } else if let Some(rest) = name.strip_prefix("g/")
            && let Some((generation, kv_key)) = rest.split_once('/')
            && let Ok(generation) = generation.parse::<u64>()
        {
            let entry = (generation, kv_key.to_owned());
            match value.map(|v| String::from_utf8_lossy(v).into_owned()) {
                Some(v) => {
                    self.kv.insert(entry, v);
                    while self.kv.len() > MAX_KEYS {
                        self.kv.pop_first();
                    }
                }
                None => {
                    self.kv.remove(&entry);
                }
            }
        }
    }
}

pub(super) fn apply_kv(mirror: &mut Mirror, keys: &Keys, kv: &KeyValue, deleted: bool) {
    let Ok(key) = kv.key_str() else {
        return;
    };
    if kv.value().len() > MAX_VALUE {
        warn!(
            key,
            bytes = kv.value().len(),
            "oversized value in etcd; ignored"
        );
        return;
    }
    let value = (!deleted).then(|| kv.value());
    mirror.apply(keys, key, value, kv.mod_revision());
}
