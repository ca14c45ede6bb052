//! The fault queue: which fault, if any, claims a request.
//!
//! Kept apart from the HTTP code because the claiming rules are the proxy's
//! contract with its callers (earliest matching fault wins, a fault never
//! reaches past the requests it claims, an unused claim goes back where it
//! was), and they are easiest to state and test on plain data, with no
//! socket in sight.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use super::http::Request;
use super::rate::TokenBucket;

/// A fault applied to the next matching requests.
///
/// Serialized with an internal `kind` tag in kebab case, e.g.
/// `{"kind":"errors","status":503,"count":3}` or
/// `{"kind":"reset-mid-body","count":1}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum StorageFault {
    /// Answer the next `count` requests with HTTP `status` (500 or 503
    /// typically) and an S3-style XML error body, without forwarding them
    /// (the request body is read and discarded first). Matches any request.
    Errors {
        /// HTTP status to answer with.
        status: u16,
        /// Number of requests to fail.
        count: usize,
    },
    /// Delay each of the next `count` requests by `ms` before forwarding it.
    /// Matches any request.
    Latency {
        /// Delay in milliseconds.
        ms: u64,
        /// Number of requests to delay.
        count: usize,
    },
    /// For the next `count` requests that carry a body (a PUT's request
    /// body, or a GET's response body): forward about half of the body, then
    /// reset the client connection (TCP RST).
    ///
    /// Matches a PUT with a non-empty request body, or any GET. A GET whose
    /// response turns out to have no body hands the claim back, so the fault
    /// waits for a request it can really cut. For bodies of unknown length
    /// (chunked, or until close) the cut falls in the middle of the first
    /// chunk or read.
    ResetMidBody {
        /// Number of bodies to cut.
        count: usize,
    },
    /// The next `count` multipart UploadPart requests (PUT with
    /// `partNumber=` and `uploadId=` in the query) are swallowed: body read
    /// and discarded, answered `200 OK` with a made-up `ETag`, never
    /// forwarded. The CompleteMultipartUpload that follows then fails at the
    /// server (`InvalidPart`), so a client can never end up with an object
    /// missing a part.
    LosePart {
        /// Number of parts to lose.
        count: usize,
    },
    /// Inverts one byte (XOR `0xff`), the one in the middle of the body, of the
    /// next `count` bodies going `direction`, keeping their length: a request
    /// body of a PUT (a whole object or a multipart part) on its way to the
    /// server, or the response body of a ranged GET on its way to the client.
    ///
    /// Only ranged GETs match: they are the reads of data blocks, which block
    /// checksums cover. A GET whose response turns out to carry no body, or an
    /// error status, hands the claim back. For bodies of unknown length the
    /// flipped byte is the middle one of the first chunk or read.
    CorruptBody {
        /// Which bodies: `put` (request bodies) or `get` (response bodies).
        direction: Direction,
        /// Number of bodies to damage.
        count: usize,
    },
}

/// Which way a body travels, for [`StorageFault::CorruptBody`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// Request bodies of PUTs (single puts and multipart parts).
    Put,
    /// Response bodies of ranged GETs.
    Get,
}

impl StorageFault {
    pub(super) fn count(&self) -> usize {
        match *self {
            StorageFault::Errors { count, .. }
            | StorageFault::Latency { count, .. }
            | StorageFault::ResetMidBody { count }
            | StorageFault::LosePart { count }
            | StorageFault::CorruptBody { count, .. } => count,
        }
    }
}

/// Counters of what the proxy has seen and done so far.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ProxyStats {
    /// Requests received from clients (relayed or answered by a fault).
    pub requests: u64,
    /// Requests answered with an injected error status.
    pub errors: u64,
    /// Requests delayed by an injected latency.
    pub delayed: u64,
    /// Connections reset in the middle of a body.
    pub resets: u64,
    /// Multipart upload parts swallowed and acknowledged with a fake ETag.
    pub lost_parts: u64,
    /// Bodies relayed with one byte inverted.
    #[serde(default)]
    pub corrupted: u64,
    /// Requests by kind: the HTTP method, except that a GET listing a bucket
    /// (ListObjects) counts as `LIST`.
    pub requests_by_kind: BTreeMap<String, u64>,
    /// Request body bytes relayed upstream (PUTs, upload parts).
    pub body_bytes_up: u64,
    /// Response body bytes relayed to clients (GETs).
    pub body_bytes_down: u64,
    /// The bandwidth cap on bodies, in bytes per second (0: none).
    pub rate_bytes_per_second: u64,
}

/// Which way a relayed body goes, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// A request body, to the upstream.
    Up,
    /// A response body, to the client.
    Down,
}

/// A queued fault with the number of requests it may still claim.
#[derive(Debug)]
struct Pending {
    /// Injection order; used to put a handed-back claim where it was.
    id: u64,
    fault: StorageFault,
    remaining: usize,
}

/// State shared between the handle and the connection tasks.
#[derive(Debug, Default)]
struct Shared {
    queue: VecDeque<Pending>,
    next_id: u64,
    stats: ProxyStats,
    rate: Option<TokenBucket>,
}

/// The fault queue and the counters, behind one lock.
#[derive(Debug, Default)]
pub(super) struct SharedState(Mutex<Shared>);

impl SharedState {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // The state stays consistent even if a holder panicked: every
        // critical section is a handful of plain field updates.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Updates the counters.
    pub(super) fn bump(&self, f: impl FnOnce(&mut ProxyStats)) {
        f(&mut self.lock().stats);
    }

    /// The counters so far.
    pub(super) fn stats(&self) -> ProxyStats {
        let state = self.lock();
        let mut stats = state.stats.clone();
        stats.rate_bytes_per_second = state.rate.as_ref().map_or(0, TokenBucket::bytes_per_second);
        stats
    }

    /// Caps relayed bodies at `bytes_per_second` in all (`None`: no cap).
    pub(super) fn limit_rate(&self, bytes_per_second: Option<u64>) {
        self.lock().rate = bytes_per_second.map(TokenBucket::new);
    }

    /// Counts `n` body bytes relayed `way` and books them against the cap;
    /// returns when they may go, or `None` when at once.
    pub(super) fn pass(&self, n: usize, way: Way) -> Option<Instant> {
        let n = n as u64;
        let mut state = self.lock();
        match way {
            Way::Up => state.stats.body_bytes_up += n,
            Way::Down => state.stats.body_bytes_down += n,
        }
        let now = Instant::now();
        let due = state.rate.as_mut()?.reserve(n, now);
        (due > now).then_some(due)
    }

    /// Queues `fault` behind those already queued; a fault that may claim no
    /// request is dropped.
    pub(super) fn push(&self, fault: StorageFault) {
        let remaining = fault.count();
        if remaining == 0 {
            return;
        }
        let mut shared = self.lock();
        let id = shared.next_id;
        shared.next_id += 1;
        shared.queue.push_back(Pending {
            id,
            fault,
            remaining,
        });
    }

    /// Counts the request and lets the earliest matching fault claim it.
    pub(super) fn claim(&self, req: &Request) -> Action {
        let mut state = self.lock();
        state.stats.requests += 1;
        *state
            .stats
            .requests_by_kind
            .entry(req.kind().to_owned())
            .or_default() += 1;
        let chosen = state.queue.iter().enumerate().find_map(|(index, pending)| {
            let action = match pending.fault {
                StorageFault::Errors { status, .. } => Some(Action::Error(status)),
                StorageFault::Latency { ms, .. } => Some(Action::Delay(ms)),
                StorageFault::ResetMidBody { .. } => {
                    if req.method == "PUT" && !req.framing.is_empty() {
                        Some(Action::ResetRequestBody)
                    } else if req.method == "GET" {
                        Some(Action::ResetResponseBody(Claim {
                            id: pending.id,
                            fault: pending.fault,
                        }))
                    } else {
                        None
                    }
                }
                StorageFault::LosePart { .. } => {
                    req.is_multipart_part_upload().then_some(Action::LosePart)
                }
                StorageFault::CorruptBody { direction, .. } => match direction {
                    Direction::Put => (req.method == "PUT" && !req.framing.is_empty())
                        .then_some(Action::CorruptRequestBody),
                    Direction::Get => {
                        req.is_ranged_get()
                            .then_some(Action::CorruptResponseBody(Claim {
                                id: pending.id,
                                fault: pending.fault,
                            }))
                    }
                },
            };
            action.map(|action| (index, action))
        });
        let Some((index, action)) = chosen else {
            return Action::Relay;
        };
        if let Some(pending) = state.queue.get_mut(index) {
            pending.remaining -= 1;
            if pending.remaining == 0 {
                state.queue.remove(index);
            }
        }
        match action {
            Action::Error(_) => state.stats.errors += 1,
            Action::Delay(_) => state.stats.delayed += 1,
            Action::LosePart => state.stats.lost_parts += 1,
            // Counted when the byte is flipped: a GET's claim may come back.
            _ => {}
        }
        action
    }

    /// Returns an unused claim to the queue, in its original place.
    pub(super) fn give_back(&self, claim: Claim) {
        let mut state = self.lock();
        if let Some(pending) = state.queue.iter_mut().find(|p| p.id == claim.id) {
            pending.remaining += 1;
            return;
        }
        let at = state
            .queue
            .iter()
            .position(|p| p.id > claim.id)
            .unwrap_or(state.queue.len());
        state.queue.insert(
            at,
            Pending {
                id: claim.id,
                fault: claim.fault,
                remaining: 1,
            },
        );
    }
}

/// What the proxy does with one request.
pub(super) enum Action {
    Relay,
    Delay(u64),
    Error(u16),
    ResetRequestBody,
    ResetResponseBody(Claim),
    LosePart,
    CorruptRequestBody,
    CorruptResponseBody(Claim),
}

/// A claim on a queued fault that may be handed back unused.
pub(super) struct Claim {
    id: u64,
    fault: StorageFault,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage_proxy::http::tests::request;

    #[test]
    fn faults_claim_in_order_and_hand_back() {
        let shared = SharedState::default();
        for fault in [
            StorageFault::LosePart { count: 1 },
            StorageFault::ResetMidBody { count: 1 },
            StorageFault::Errors {
                status: 503,
                count: 1,
            },
        ] {
            shared.push(fault);
        }
        let queued_ids = |shared: &SharedState| -> Vec<u64> {
            shared.lock().queue.iter().map(|p| p.id).collect()
        };
        let get = request("GET /b/k HTTP/1.1\r\n\r\n");
        let Action::ResetResponseBody(claim) = shared.claim(&get) else {
            panic!("GET not claimed by ResetMidBody");
        };
        assert_eq!(queued_ids(&shared), [0, 2]);
        shared.give_back(claim);
        assert_eq!(queued_ids(&shared), [0, 1, 2]);
        let part =
            request("PUT /b/k?partNumber=2&uploadId=u HTTP/1.1\r\nContent-Length: 3\r\n\r\n");
        assert!(matches!(shared.claim(&part), Action::LosePart));
        assert!(matches!(shared.claim(&part), Action::ResetRequestBody));
        assert!(matches!(shared.claim(&part), Action::Error(503)));
        assert!(matches!(shared.claim(&part), Action::Relay));
        let stats = shared.stats();
        assert_eq!((stats.requests, stats.errors, stats.lost_parts), (5, 1, 1));
    }

    #[test]
    fn corrupt_body_claims_puts_with_a_body_or_ranged_gets_by_direction() {
        let shared = SharedState::default();
        shared.push(StorageFault::CorruptBody {
            direction: Direction::Get,
            count: 1,
        });
        shared.push(StorageFault::CorruptBody {
            direction: Direction::Put,
            count: 1,
        });
        let whole_get = request("GET /b/k HTTP/1.1\r\n\r\n");
        let ranged_get = request("GET /b/k HTTP/1.1\r\nRange: bytes=0-9\r\n\r\n");
        let empty_put = request("PUT /b/k HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        let put = request("PUT /b/k HTTP/1.1\r\nContent-Length: 3\r\n\r\n");
        assert!(matches!(shared.claim(&whole_get), Action::Relay));
        assert!(matches!(shared.claim(&empty_put), Action::Relay));
        let Action::CorruptResponseBody(claim) = shared.claim(&ranged_get) else {
            panic!("a ranged GET not claimed by CorruptBody get");
        };
        shared.give_back(claim);
        assert!(matches!(shared.claim(&put), Action::CorruptRequestBody));
        assert!(matches!(shared.claim(&put), Action::Relay));
        assert!(matches!(
            shared.claim(&ranged_get),
            Action::CorruptResponseBody(_)
        ));
        assert!(matches!(shared.claim(&ranged_get), Action::Relay));
        let json = serde_json::to_string(&StorageFault::CorruptBody {
            direction: Direction::Put,
            count: 2,
        })
        .ok();
        assert_eq!(
            json.as_deref(),
            Some(r#"{"kind":"corrupt-body","direction":"put","count":2}"#)
        );
    }

    #[test]
    fn a_fault_that_may_claim_nothing_is_not_queued() {
        let shared = SharedState::default();
        shared.push(StorageFault::Errors {
            status: 503,
            count: 0,
        });
        let get = request("GET /b/k HTTP/1.1\r\n\r\n");
        assert!(matches!(shared.claim(&get), Action::Relay));
    }

    #[test]
    fn faults_serialize_with_kind_tag() {
        let json = serde_json::to_string(&StorageFault::ResetMidBody { count: 2 }).ok();
        assert_eq!(
            json.as_deref(),
            Some(r#"{"kind":"reset-mid-body","count":2}"#)
        );
        let back: Option<StorageFault> =
            serde_json::from_str(r#"{"kind":"errors","status":503,"count":3}"#).ok();
        assert_eq!(
            back,
            Some(StorageFault::Errors {
                status: 503,
                count: 3
            })
        );
    }
}
