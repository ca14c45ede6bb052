//! What an etcd client knows of its job's keys: a mirror, kept in step by watches,
//! that every blocking call waits on (with a condition variable, so that etcd sees
//! no polling), and the [`Event`]s a launcher reads, derived from the generation
//! record's transitions.
//!
//! A member mirrors the generation record, the bootstrap keys, the leader key and
//! its own record; only the member that leads (see [`super::member`]) mirrors every
//! member's record too. A launcher mirrors the generation record alone.
//!
//! Apart from the connection because it is plain data: it parses and folds key
//! changes, ignoring garbage, and never talks to etcd.

use std::collections::BTreeMap;
use std::time::SystemTime;

use etcd_client::KeyValue;
use tracing::warn;

use super::rules::{GenRecord, GenState, Live, MemberRecord};
use crate::Event;

/// Generation records remembered per generation number (for late directives).
pub(super) const MAX_HISTORY: usize = 8;
/// Bootstrap keys mirrored at most (newest generations win): a key per rank (the
/// ring's addresses) for two generations of 16,384 ranks, with room to spare.
pub(super) const MAX_KEYS: usize = 1 << 16;
/// A key or value longer than this is refused (they are addresses and small JSON).
pub(super) const MAX_VALUE: usize = 64 * 1024;
/// The largest generation record written: under etcd's default request limit
/// (1.5 MiB), with room for the transaction around it.
pub(super) const MAX_RECORD: usize = 1400 * 1024;
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
    pub(super) fn members(&self) -> String {
        format!("{}members/", self.root)
    }
    pub(super) fn leader(&self) -> String {
        format!("{}leader", self.root)
    }
    /// The job's committed snapshot record (see [`super::snapshot`]): outside
    /// [`Keys::shared_range`], so nobody watches it.
    pub(super) fn snapshot(&self) -> String {
        format!("{}snapshot", self.root)
    }
    /// The range a member watches: `g/…` (bootstrap keys), `generation` and
    /// `leader`, which sort together (`g/` < `generation` < `leader`), and nothing
    /// else the job keeps.
    pub(super) fn shared_range(&self) -> (String, String) {
        (format!("{}g/", self.root), format!("{}leader\0", self.root))
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
    /// Every member's record: kept only while this member leads (`all_members`).
    pub(super) members: BTreeMap<String, Live>,
    /// `members` holds every record (this member leads and follows them).
    pub(super) all_members: bool,
    /// This member's own record as etcd holds it (a member's mirror).
    pub(super) mine: Option<Live>,
    /// The lease of the member that leads, while one does.
    pub(super) leader: Option<i64>,
    pub(super) kv: BTreeMap<(u64, String), String>,
    /// How many keys `kv` holds per generation.
    pub(super) kv_count: BTreeMap<u64, usize>,
    pub(super) events: Vec<Event>,
    /// Bumped on every change (the rules task's wake-up).
    pub(super) changes: u64,
}

impl Mirror {
    /// The generation record as last read (borrowed: it lists every node, and the
    /// waits of every node's agent look at it on each change of the mirror).
    pub(super) fn current(&self) -> &GenRecord {
        static NONE: std::sync::LazyLock<GenRecord> = std::sync::LazyLock::new(GenRecord::none);
        self.current.as_ref().unwrap_or(&NONE)
    }

    pub(super) fn set_gen(&mut self, record: GenRecord, revision: i64) {
        if revision <= self.gen_revision {
            return;
        }
        let previous = self.current.take().unwrap_or_else(GenRecord::none);
        let at = SystemTime::now();
        if previous.is_running() && previous.generation == record.generation {
            // Members that left the running generation on purpose (a lost member
            // ends the generation instead, and keeps its place in the record).
            let cause = match &record.state {
                GenState::Running { left, .. } => left.clone(),
                GenState::Ended { cause, .. } => Some(cause.clone()),
                GenState::Shutdown { .. } => None,
            };
            // Every node reads every change of the record: a set, not a search of
            // the record per member (nodes² comparisons at each node otherwise).
            let staying: std::collections::HashSet<&str> =
                record.members.iter().map(|m| m.id.as_str()).collect();
            for gone in previous
                .members
                .iter()
                .filter(|m| !staying.contains(m.id.as_str()))
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

    fn uncount(&mut self, generation: u64) {
        if let Some(n) = self.kv_count.get_mut(&generation) {
            *n -= 1;
            if *n == 0 {
                self.kv_count.remove(&generation);
            }
        }
    }

    /// The keys of `generation`'s key-value space.
    pub(super) fn kv_of(&self, generation: u64) -> Vec<(String, String)> {
        self.kv
            .range((generation, String::new())..)
            .take_while(|((g, _), _)| *g == generation)
            .map(|((_, k), v)| (k.clone(), v.clone()))
            .collect()
    }

    pub(super) fn push(&mut self, event: Event) {
        if self.events.len() >= MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(event);
    }

    /// Folds one key's new value (`None`: deleted) into the mirror; `lease`: the
    /// lease the key lives under (0: none). A member record is this member's own
    /// (`mine`): the records of all are folded by [`Mirror::apply_member`].
    pub(super) fn apply(
        &mut self,
        keys: &Keys,
        key: &str,
        value: Option<&[u8]>,
        revision: i64,
        lease: i64,
    ) {
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
        } else if name == "leader" {
            self.leader = value.map(|_| lease).filter(|&lease| lease != 0);
        } else if let Some(id) = name.strip_prefix("members/") {
            self.mine = value.and_then(|value| member_record(key, id, value, revision));
        } else if let Some(rest) = name.strip_prefix("g/")
            && let Some((generation, kv_key)) = rest.split_once('/')
            && let Ok(generation) = generation.parse::<u64>()
        {
            let entry = (generation, kv_key.to_owned());
            match value.map(|v| String::from_utf8_lossy(v).into_owned()) {
                Some(v) => {
                    if self.kv.insert(entry, v).is_none() {
                        *self.kv_count.entry(generation).or_default() += 1;
                    }
                    while self.kv.len() > MAX_KEYS {
                        if let Some(((g, _), _)) = self.kv.pop_first() {
                            self.uncount(g);
                        }
                    }
                }
                None => {
                    if self.kv.remove(&entry).is_some() {
                        self.uncount(generation);
                    }
                }
            }
        }
    }
}

impl Mirror {
    /// Folds one member record's new value (`None`: deleted) into `members`.
    pub(super) fn apply_member(&mut self, keys: &Keys, kv: &KeyValue, deleted: bool) {
        self.changes += 1;
        let Ok(key) = kv.key_str() else {
            return;
        };
        let Some(id) = key
            .strip_prefix(&keys.root)
            .and_then(|name| name.strip_prefix("members/"))
        else {
            return;
        };
        let record = (!deleted)
            .then(|| member_record(key, id, kv.value(), kv.mod_revision()))
            .flatten();
        match record {
            Some(live) => {
                self.members.insert(id.to_owned(), live);
            }
            None => {
                self.members.remove(id);
            }
        }
    }
}

/// A member record read from etcd, when it is one and names its key.
fn member_record(key: &str, id: &str, value: &[u8], revision: i64) -> Option<Live> {
    if value.len() > MAX_VALUE {
        warn!(key, bytes = value.len(), "oversized member record; ignored");
        return None;
    }
    match serde_json::from_slice::<MemberRecord>(value) {
        Ok(record) if record.member.id == id => Some(Live { record, revision }),
        _ => {
            warn!(key, "member record that does not name its key; ignored");
            None
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
    mirror.apply(keys, key, value, kv.mod_revision(), kv.lease());
}
