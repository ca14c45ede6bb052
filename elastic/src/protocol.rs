//! The wire format between a member and the coordinator.
//!
//! - The transport is a byte stream (TCP). Each message is one JSON object on one
//!   line, terminated by `\n`, at most [`MAX_LINE`] bytes including the newline.
//!   JSON lines keep the protocol readable in `tcpdump` and writable by hand in tests,
//!   and the line bound caps what a peer can make the other side allocate.
//! - Every object has a `"type"` field naming the message ([`ClientMessage`] from a
//!   member, [`ServerMessage`] from the coordinator); unknown types and missing
//!   fields are errors, unknown extra fields are ignored.
//! - A member MUST send `hello` first, once per connection. Anything else before it
//!   is rejected.
//! - A line longer than [`MAX_LINE`] is an error; the reader does not resynchronise
//!   and the connection is closed after an error message. A line that is not valid
//!   JSON of a known message is an error; the connection stays usable.
//! - Most messages are one-way. Those that need an answer carry a `token` that the
//!   answer echoes: `sync` (answered by `synced`), and `commit_snapshot` and
//!   `read_snapshot` (answered by `snapshot_answer`). A coordinator that predates a
//!   message answers it with a non-fatal `error` line instead, and the request
//!   times out.

use std::io::{self, BufRead, BufReader, Read};

use serde::{Deserialize, Serialize};

use super::{Assignment, Directive, Member, Progress, Report};

/// The longest line either side accepts, newline included (64 KiB).
pub const MAX_LINE: usize = 64 * 1024;

/// Protocol version a member announces in `hello`; the coordinator rejects others.
pub const VERSION: u32 = 1;

/// What a member that did not prove the job's secret is told.
pub(crate) fn without_secret() -> String {
    format!(
        "this control plane admits only processes that prove the job's secret: set {} or {} \
         to the job's (ckpt launch passes it to the ranks it starts)",
        ckpt_auth::SECRET_ENV,
        ckpt_auth::SECRET_FILE_ENV
    )
}

/// A message from a member to the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMessage {
    /// First message of every connection.
    Hello {
        /// Must be [`VERSION`].
        version: u32,
        /// Who is speaking; `member.job` must be the coordinator's job.
        member: Member,
        /// The newest generation number this member has heard of (0: none), so that a
        /// restarted coordinator never hands out a smaller one.
        seen: u64,
        /// The highest checkpoint generation this member knows was used.
        checkpoint_generation: u64,
        /// The generation this member is running and asks to keep, if any (after a
        /// reconnect; a restarted coordinator adopts it when all its members agree).
        claim: Option<Assignment>,
    },
    /// Wait for a generation newer than `after` that includes this member.
    Rendezvous {
        /// The newest generation this member had (0: none).
        after: u64,
    },
    /// Liveness and progress of the member in `generation` (0: in none).
    Heartbeat {
        /// The generation the member is in.
        generation: u64,
        /// Its training thread's progress.
        progress: Progress,
    },
    /// A report about `generation`.
    Report {
        /// The generation the report is about.
        generation: u64,
        /// What happened.
        report: Report,
    },
    /// From now on this member holds `ranks` ranks (a node's launcher whose ranks
    /// were lost or started again). It counts at the next formation; while its
    /// generation runs with fewer, the extra ranks wait to join like new members.
    Hold {
        /// How many ranks.
        ranks: usize,
    },
    /// Set `key` to `value` in `generation`'s key-value space.
    KvSet {
        /// The generation the key belongs to.
        generation: u64,
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// Record `record` as the job's newest committed snapshot on behalf of
    /// `generation` (see [`ControlPlane::commit_snapshot`]). Answered by
    /// [`ServerMessage::SnapshotAnswer`] with the same `token`.
    ///
    /// [`ControlPlane::commit_snapshot`]: crate::ControlPlane::commit_snapshot
    CommitSnapshot {
        /// Echoed in the answer.
        token: u64,
        /// The generation that commits it: it must be running, with this member in it.
        generation: u64,
        /// The record, at most [`MAX_SNAPSHOT_RECORD`](crate::MAX_SNAPSHOT_RECORD)
        /// bytes.
        record: String,
    },
    /// Ask for the job's newest committed snapshot record. Answered by
    /// [`ServerMessage::SnapshotAnswer`] with the same `token`.
    ReadSnapshot {
        /// Echoed in the answer.
        token: u64,
    },
    /// Answer with [`ServerMessage::Synced`] carrying `token` once every message sent
    /// before this one on the connection was handled: how a member knows that a
    /// report reached the control plane before it does what the report warns of
    /// (a rank that failed reports it, syncs, and only then closes its
    /// collectives, so that its peers' errors cannot overtake its own).
    Sync {
        /// Echoed in the answer.
        token: u64,
    },
}

/// A message from the coordinator to a member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    /// Answer to a valid `hello`.
    Welcome {
        /// The coordinator's job id.
        job: String,
        /// The newest generation the coordinator knows.
        generation: u64,
    },
    /// The member is in a new generation.
    Assigned {
        /// Its place in it.
        assignment: Assignment,
    },
    /// Something the member must do.
    Directive {
        /// What.
        directive: Directive,
    },
    /// A key was set in `generation` (sent to every member of it, the setter too).
    Kv {
        /// The generation the key belongs to.
        generation: u64,
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// Every message before the member's [`ClientMessage::Sync`] with this token was
    /// handled.
    Synced {
        /// The sync's token.
        token: u64,
    },
    /// The answer to a [`ClientMessage::CommitSnapshot`] or
    /// [`ClientMessage::ReadSnapshot`] with this token.
    SnapshotAnswer {
        /// The request's token.
        token: u64,
        /// To a read: the job's newest record, if any. To a commit: absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        record: Option<String>,
        /// Why the request failed, when it did (a commit from a generation that is
        /// not running, an oversize record).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refused: Option<String>,
        /// The failure may pass (a node could not reach the control plane to pass
        /// the request on): retrying later may help. Else retrying cannot.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        transient: bool,
    },
    /// The member's last message was refused.
    Error {
        /// Why, in words.
        message: String,
        /// True when the connection cannot go on (another job, another protocol
        /// version, an oversize line): the coordinator closes it, and reconnecting
        /// with the same identity will not help.
        fatal: bool,
    },
}

/// Longest member id a server accepts.
pub const MAX_ID: usize = 256;

/// Why a server (`who`: "coordinator", "node") serving `job` refuses a hello of
/// protocol `version` from `member`, if it does: another version, another job, an id
/// that is empty or too long. The coordinator and a node agent check the same.
pub fn hello_refusal(version: u32, member: &Member, job: &str, who: &str) -> Option<String> {
    if version != VERSION {
        Some(format!(
            "protocol version {version} is not supported (this {who} speaks {VERSION})"
        ))
    } else if member.job != job {
        Some(format!(
            "job mismatch: this {who} serves job {job:?}, member {:?} belongs to job {:?}",
            member.id, member.job
        ))
    } else if member.id.is_empty() || member.id.len() > MAX_ID {
        Some(format!(
            "member id must be 1 to {MAX_ID} bytes, got {}",
            member.id.len()
        ))
    } else {
        None
    }
}

/// A line could not be read or decoded.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The peer sent more than [`MAX_LINE`] bytes without a newline.
    #[error("line longer than {max} bytes")]
    TooLong {
        /// The bound.
        max: usize,
    },
    /// The line is not a message of this protocol.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The connection failed.
    #[error("connection error: {0}")]
    Io(#[from] io::Error),
}

/// Encodes `message` as one line, newline included. Fails (rather than send a line
/// the peer would refuse) when the line would exceed [`MAX_LINE`].
pub fn encode<T: Serialize>(message: &T) -> Result<String, LineError> {
    let mut line =
        serde_json::to_string(message).map_err(|e| LineError::Malformed(e.to_string()))?;
    line.push('\n');
    if line.len() > MAX_LINE {
        return Err(LineError::TooLong { max: MAX_LINE });
    }
    Ok(line)
}

/// Decodes one line (without its newline) into a message.
pub fn decode<T: for<'de> Deserialize<'de>>(line: &[u8]) -> Result<T, LineError> {
    serde_json::from_slice(line).map_err(|e| LineError::Malformed(e.to_string()))
}

/// Reads newline-terminated lines of at most `max` bytes from a stream, holding at
/// most `max` bytes of a line plus the buffer of the underlying reader.
pub struct LineReader<R> {
    inner: BufReader<R>,
    line: Vec<u8>,
    max: usize,
}

impl<R: Read> LineReader<R> {
    /// Lines of at most [`MAX_LINE`] bytes from `inner`.
    pub fn new(inner: R) -> Self {
        Self::with_max(inner, MAX_LINE)
    }

    /// Lines of at most `max` bytes (newline included) from `inner`.
    pub fn with_max(inner: R, max: usize) -> Self {
        LineReader {
            inner: BufReader::with_capacity(8 * 1024, inner),
            line: Vec::new(),
            max: max.max(1),
        }
    }

    /// The underlying reader (to change its timeouts).
    pub fn get_ref(&self) -> &R {
        self.inner.get_ref()
    }

    /// Reads exactly `out.len()` bytes that follow the last line (a payload whose size
    /// that line announced), through the same buffer.
    pub fn read_exact(&mut self, out: &mut [u8]) -> io::Result<()> {
        self.inner.read_exact(out)
    }

    /// The next line without its newline; `None` at a clean end of stream. A final
    /// line without a newline is dropped: the peer died in the middle of it.
    pub fn next_line(&mut self) -> Result<Option<&[u8]>, LineError> {
        self.line.clear();
        loop {
            let available = match self.inner.fill_buf() {
                Ok(available) => available,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(LineError::Io(e)),
            };
            if available.is_empty() {
                return Ok(None);
            }
            let (take, done) = append_line_part(&mut self.line, available, self.max)?;
            self.inner.consume(take);
            if done {
                return Ok(Some(&self.line));
            }
        }
    }
}

/// One step of reading a line of at most `max` bytes: appends to `line` what
/// `available` (the reader's buffered bytes) holds of it. Returns how many bytes to
/// consume and whether the line is complete, in which case its `\n` (and a `\r`
/// before it) are already taken off. Fails before appending when the line would
/// exceed `max`. Shared by [`LineReader`] and the coordinator's asynchronous reader.
pub(crate) fn append_line_part(
    line: &mut Vec<u8>,
    available: &[u8],
    max: usize,
) -> Result<(usize, bool), LineError> {
    let (take, done) = match available.iter().position(|&b| b == b'\n') {
        Some(newline) => (newline + 1, true),
        None => (available.len(), false),
    };
    if line.len().saturating_add(take) > max {
        return Err(LineError::TooLong { max });
    }
    line.extend_from_slice(&available[..take]);
    if done {
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
    }
    Ok((take, done))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> Member {
        Member::new("job", "a", "127.0.0.1", "n0")
    }

    #[test]
    fn messages_round_trip_as_one_line_each() {
        let messages = vec![
            ClientMessage::Hello {
                version: VERSION,
                member: member(),
                seen: 3,
                checkpoint_generation: 2,
                claim: None,
            },
            ClientMessage::Heartbeat {
                generation: 3,
                progress: Progress {
                    step: 7,
                    in_collective: true,
                    idle_ms: 12,
                    checkpoint_generation: 2,
                },
            },
            ClientMessage::Report {
                generation: 3,
                report: Report::CollectiveFailed {
                    peer: Some(1),
                    reason: "ring\nbroken".into(),
                },
            },
        ];
        let mut wire = String::new();
        for message in &messages {
            let line = encode(message).unwrap();
            assert_eq!(line.matches('\n').count(), 1, "{line:?}");
            wire.push_str(&line);
        }
        let mut reader = LineReader::new(wire.as_bytes());
        for message in &messages {
            let line = reader.next_line().unwrap().unwrap();
            assert_eq!(&decode::<ClientMessage>(line).unwrap(), message);
        }
        assert!(reader.next_line().unwrap().is_none());
    }

    #[test]
    fn an_oversize_line_is_an_error_before_it_is_buffered() {
        let wire = vec![b'x'; 3 * MAX_LINE];
        let mut reader = LineReader::new(&wire[..]);
        let error = reader.next_line().unwrap_err();
        assert!(
            matches!(error, LineError::TooLong { max: MAX_LINE }),
            "{error}"
        );
        assert!(reader.line.capacity() <= 2 * MAX_LINE);
    }

    #[test]
    fn a_line_of_exactly_the_bound_is_accepted() {
        let mut wire = vec![b'x'; 9];
        wire.push(b'\n');
        let mut reader = LineReader::with_max(&wire[..], 10);
        assert_eq!(reader.next_line().unwrap().unwrap().len(), 9);
        let mut longer = vec![b'x'; 10];
        longer.push(b'\n');
        let mut reader = LineReader::with_max(&longer[..], 10);
        assert!(matches!(reader.next_line(), Err(LineError::TooLong { .. })));
    }

    #[test]
    fn malformed_lines_name_the_problem() {
        for line in [
            &b"not json"[..],
            b"{\"type\":\"launch_missiles\"}",
            b"{\"type\":\"rendezvous\"}",
            b"{\"type\":\"rendezvous\",\"after\":-1}",
            b"\xff\xfe",
        ] {
            let error = decode::<ClientMessage>(line).unwrap_err();
            assert!(matches!(error, LineError::Malformed(_)), "{error}");
        }
    }

    #[test]
    fn a_torn_final_line_is_dropped_and_crlf_is_accepted() {
        let wire = b"{\"type\":\"rendezvous\",\"after\":1}\r\n{\"type\":\"rend";
        let mut reader = LineReader::new(&wire[..]);
        let line = reader.next_line().unwrap().unwrap().to_vec();
        assert_eq!(
            decode::<ClientMessage>(&line).unwrap(),
            ClientMessage::Rendezvous { after: 1 }
        );
        assert!(reader.next_line().unwrap().is_none());
    }

    #[test]
    fn a_payload_after_a_line_is_read_through_the_same_buffer() {
        let wire = b"ok 3\nabcok 1\nz";
        let mut reader = LineReader::with_max(&wire[..], 16);
        assert_eq!(reader.next_line().unwrap().unwrap(), b"ok 3");
        let mut payload = [0u8; 3];
        reader.read_exact(&mut payload).unwrap();
        assert_eq!(&payload, b"abc");
        assert_eq!(reader.next_line().unwrap().unwrap(), b"ok 1");
        let mut short = [0u8; 2];
        assert!(
            reader.read_exact(&mut short).is_err(),
            "one byte left, two asked"
        );
    }

    #[test]
    fn encode_refuses_a_line_the_peer_would_refuse() {
        let message = ClientMessage::KvSet {
            generation: 1,
            key: "k".into(),
            value: "v".repeat(MAX_LINE),
        };
        assert!(matches!(encode(&message), Err(LineError::TooLong { .. })));
    }
}
