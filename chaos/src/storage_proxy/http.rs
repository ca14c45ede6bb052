//! HTTP/1.1 message heads: what the proxy reads from them and what it
//! writes on.
//!
//! Parsing the start line and the header fields is `httparse`'s job: it
//! rejects what RFC 9112 forbids (bad tokens, control bytes in values,
//! obsolete line folding) and says how many bytes the head took, so the
//! bytes after it stay the body's. This module adds what a proxy needs on
//! top: the body's framing (`Transfer-Encoding` over `Content-Length`,
//! conflicting lengths refused), keep-alive, `Expect: 100-continue`, the
//! hop-by-hop fields a proxy must not forward, and the heads it sends on.

use std::io;

use httparse::Status;

/// Largest number of header fields accepted in one head.
const MAX_HEADERS: usize = 128;

/// An error for input the proxy refuses to relay.
pub(super) fn malformed(why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

/// The header fields of a parsed head, values kept as raw bytes.
struct Head {
    headers: Vec<(String, Vec<u8>)>,
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

impl Head {
    fn new(fields: &[httparse::Header<'_>]) -> Head {
        Head {
            headers: fields
                .iter()
                .map(|h| (h.name.to_owned(), trim_ows(h.value).to_vec()))
                .collect(),
        }
    }

    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// The comma-separated list elements of all fields named `name`.
    fn list<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.values(name)
            .flat_map(|v| v.split(|&b| b == b','))
            .map(trim_ows)
            .filter(|e| !e.is_empty())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.list(name)
            .any(|e| e.eq_ignore_ascii_case(token.as_bytes()))
    }

    /// Whether the connection stays open after this message, by the rules
    /// of its HTTP version (`minor` of 1.x).
    fn keep_alive(&self, minor: u8) -> bool {
        if minor == 0 {
            self.has_token("connection", "keep-alive")
        } else {
            !self.has_token("connection", "close")
        }
    }

    /// Body framing as declared by the headers; `None` when neither
    /// `Transfer-Encoding` nor `Content-Length` is present.
    fn declared_framing(&self) -> io::Result<Option<Framing>> {
        if let Some(last) = self.list("transfer-encoding").last() {
            return Ok(Some(if last.eq_ignore_ascii_case(b"chunked") {
                Framing::Chunked
            } else {
                Framing::UntilClose
            }));
        }
        let mut length = None;
        for element in self.list("content-length") {
            let n = std::str::from_utf8(element)
                .ok()
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| malformed("bad content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(malformed("conflicting content-length"));
            }
            length = Some(n);
        }
        if length.is_none() && self.values("content-length").next().is_some() {
            return Err(malformed("empty content-length"));
        }
        Ok(length.map(Framing::Length))
    }

    /// Appends the header fields a proxy may forward: everything except the
    /// hop-by-hop fields (and `Content-Length` when the message is chunked,
    /// as `Transfer-Encoding` overrides it).
    fn write_end_to_end(&self, out: &mut Vec<u8>, also_drop: &[&str]) {
        let chunked = self.values("transfer-encoding").next().is_some();
        let connection_named: Vec<&[u8]> = self.list("connection").collect();
        for (name, value) in &self.headers {
            let hop_by_hop = [
                "connection",
                "keep-alive",
                "proxy-connection",
                "te",
                "upgrade",
            ]
            .iter()
            .chain(also_drop)
            .any(|h| name.eq_ignore_ascii_case(h))
                || connection_named
                    .iter()
                    .any(|c| c.eq_ignore_ascii_case(name.as_bytes()));
            if hop_by_hop || (chunked && name.eq_ignore_ascii_case("content-length")) {
                continue;
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

impl Framing {
    pub(super) fn is_empty(self) -> bool {
        self == Framing::Length(0)
    }
}

/// The outcome of parsing the bytes read so far: `None` until they hold a
/// whole head, then the message and the number of bytes its head took.
pub(super) type Parsed<T> = io::Result<Option<(T, usize)>>;

/// A parsed client request.
pub(super) struct Request {
    head: Head,
    pub(super) method: String,
    target: String,
    pub(super) framing: Framing,
    pub(super) expect_continue: bool,
    pub(super) keep_alive: bool,
}

impl Request {
    /// Parses a request head from the start of `buf`.
    pub(super) fn parse(buf: &[u8]) -> Parsed<Request> {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut fields);
        let used = match parsed
            .parse(buf)
            .map_err(|e| malformed(format!("bad request head: {e}")))?
        {
            Status::Partial => return Ok(None),
            Status::Complete(used) => used,
        };
        let (Some(method), Some(target), Some(minor)) =
            (parsed.method, parsed.path, parsed.version)
        else {
            return Err(malformed("incomplete request line"));
        };
        // The target is sent upstream as it came; httparse lets bytes above
        // 0x7f through, which no S3 client sends unescaped.
        if !target.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(malformed("bad request target"));
        }
        let head = Head::new(parsed.headers);
        let framing = match head.declared_framing()? {
            Some(Framing::UntilClose) => {
                return Err(malformed("request transfer-coding is not chunked"));
            }
            Some(framing) => framing,
            None => Framing::Length(0),
        };
        let request = Request {
            method: method.to_owned(),
            target: target.to_owned(),
            framing,
            expect_continue: head.has_token("expect", "100-continue"),
            keep_alive: head.keep_alive(minor),
            head,
        };
        Ok(Some((request, used)))
    }

    pub(super) fn is_head(&self) -> bool {
        self.method == "HEAD"
    }

    /// The request's kind for the counters: its method, or `LIST` for a GET
    /// that lists a bucket (ListObjects: a `list-type`, `prefix` or `delimiter`
    /// parameter, which no GetObject carries).
    pub(super) fn kind(&self) -> &str {
        if self.method != "GET" {
            return &self.method;
        }
        let query = self.target.split_once('?').map_or("", |(_, q)| q);
        let lists = query.split('&').any(|pair| {
            let key = pair.split_once('=').map_or(pair, |(k, _)| k);
            matches!(key, "list-type" | "prefix" | "delimiter")
        });
        if lists { "LIST" } else { "GET" }
    }

    /// A GET of part of an object (a `Range` header): how data blocks are read.
    pub(super) fn is_ranged_get(&self) -> bool {
        self.method == "GET" && self.head.values("range").next().is_some()
    }

    pub(super) fn is_multipart_part_upload(&self) -> bool {
        if self.method != "PUT" {
            return false;
        }
        let Some((_, query)) = self.target.split_once('?') else {
            return false;
        };
        let has = |key: &str| {
            query
                .split('&')
                .any(|pair| pair.split_once('=').map_or(pair, |(k, _)| k) == key)
        };
        has("partNumber") && has("uploadId")
    }

    /// The head sent upstream: same method, target and end-to-end headers,
    /// always HTTP/1.1 and without the `Expect` the proxy answers itself.
    pub(super) fn upstream_head(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        self.head.write_end_to_end(&mut out, &["expect"]);
        out.extend_from_slice(b"\r\n");
        out
    }
}

/// A parsed upstream response head.
pub(super) struct Response {
    head: Head,
    pub(super) status: u16,
    reason: String,
    pub(super) keep_alive: bool,
}

impl Response {
    /// Parses a response head from the start of `buf`.
    pub(super) fn parse(buf: &[u8]) -> Parsed<Response> {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut fields);
        let used = match parsed
            .parse(buf)
            .map_err(|e| malformed(format!("bad response head: {e}")))?
        {
            Status::Partial => return Ok(None),
            Status::Complete(used) => used,
        };
        let (Some(minor), Some(status)) = (parsed.version, parsed.code) else {
            return Err(malformed("incomplete status line"));
        };
        let head = Head::new(parsed.headers);
        let response = Response {
            status,
            reason: parsed.reason.unwrap_or_default().to_owned(),
            keep_alive: head.keep_alive(minor),
            head,
        };
        Ok(Some((response, used)))
    }

    /// How the body of this response to a `request_method` request is
    /// delimited (RFC 9112 6.3).
    pub(super) fn framing(&self, request_method: &str) -> io::Result<Framing> {
        if request_method == "HEAD" || self.status < 200 || self.status == 204 || self.status == 304
        {
            return Ok(Framing::Length(0));
        }
        Ok(self.head.declared_framing()?.unwrap_or(Framing::UntilClose))
    }

    /// The head sent to the client. `close` adds `Connection: close`.
    pub(super) fn client_head(&self, close: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(format!("HTTP/1.1 {} {}\r\n", self.status, self.reason).as_bytes());
        self.head.write_end_to_end(&mut out, &[]);
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }
}

/// The size of a chunk from its chunk-size line (with its CRLF), chunk
/// extensions ignored.
pub(super) fn chunk_size(line: &[u8]) -> io::Result<u64> {
    // httparse reads an empty size as 0, which would end the body early.
    if !line.first().is_some_and(u8::is_ascii_hexdigit) {
        return Err(malformed("bad chunk size"));
    }
    match httparse::parse_chunk_size(line) {
        Ok(Status::Complete((_, size))) => Ok(size),
        Ok(Status::Partial) | Err(_) => Err(malformed("bad chunk size")),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Parses a whole request head, which must be all of `raw`.
    pub(crate) fn request(raw: &str) -> Request {
        match Request::parse(raw.as_bytes()) {
            Ok(Some((req, used))) => {
                assert_eq!(used, raw.len(), "{raw:?}");
                req
            }
            Ok(None) => panic!("incomplete head: {raw:?}"),
            Err(e) => panic!("parse failed: {e}"),
        }
    }

    fn response(raw: &str) -> Response {
        match Response::parse(raw.as_bytes()) {
            Ok(Some((resp, _))) => resp,
            Ok(None) => panic!("incomplete head: {raw:?}"),
            Err(e) => panic!("parse failed: {e}"),
        }
    }

    #[test]
    fn lists_are_told_from_object_reads() {
        let kind = |line: &str| {
            request(&format!("{line} HTTP/1.1\r\n\r\n"))
                .kind()
                .to_owned()
        };
        assert_eq!(kind("GET /b?list-type=2&prefix=run%2F"), "LIST");
        assert_eq!(kind("GET /b/?delimiter=%2F"), "LIST");
        assert_eq!(kind("GET /b/run/manifest"), "GET");
        assert_eq!(kind("GET /b/run/data?versionId=1"), "GET");
        assert_eq!(kind("HEAD /b/run/data"), "HEAD");
        assert_eq!(kind("PUT /b/k?partNumber=1&uploadId=u"), "PUT");
    }

    #[test]
    fn parses_request_framing() {
        let req = request("PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n");
        assert_eq!(req.framing, Framing::Length(5));
        assert!(req.keep_alive);
        let req = request(
            "PUT /b/k HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\
             Connection: close\r\n\r\n",
        );
        assert_eq!(req.framing, Framing::Chunked);
        assert!(!req.keep_alive);
        let head = String::from_utf8_lossy(&req.upstream_head()).into_owned();
        assert!(!head.to_ascii_lowercase().contains("content-length"));
        assert!(!head.to_ascii_lowercase().contains("connection"));
        let req = request("GET / HTTP/1.1\r\n\r\n");
        assert_eq!(req.framing, Framing::Length(0));
        let req = request("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
        assert!(req.keep_alive);
        assert!(!request("GET / HTTP/1.0\r\n\r\n").keep_alive);
    }

    #[test]
    fn a_head_ends_at_its_blank_line_and_leaves_the_body() {
        let raw = b"\r\nPUT /b/k HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody";
        let Ok(Some((req, used))) = Request::parse(raw) else {
            panic!("not parsed");
        };
        assert_eq!(&raw[used..], b"body");
        assert_eq!(req.method, "PUT");
        for cut in 0..raw.len() - 4 {
            assert!(
                matches!(Request::parse(&raw[..cut]), Ok(None)),
                "a head cut at {cut} is not incomplete"
            );
        }
    }

    #[test]
    fn rejects_malformed_requests() {
        for raw in [
            "GET /\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\0b\r\n\r\n",
            "GET /caf\u{e9} HTTP/1.1\r\n\r\n",
            "PUT / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
            "PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "PUT / HTTP/1.1\r\nContent-Length:\r\n\r\n",
            "PUT / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        ] {
            assert!(Request::parse(raw.as_bytes()).is_err(), "accepted {raw:?}");
        }
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "X: y\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(Request::parse(many.as_bytes()).is_err());
    }

    #[test]
    fn recognises_upload_part() {
        assert!(
            request("PUT /b/k?partNumber=1&uploadId=abc HTTP/1.1\r\n\r\n")
                .is_multipart_part_upload()
        );
        assert!(!request("PUT /b/k?uploadId=abc HTTP/1.1\r\n\r\n").is_multipart_part_upload());
        assert!(
            !request("POST /b/k?partNumber=1&uploadId=abc HTTP/1.1\r\n\r\n")
                .is_multipart_part_upload()
        );
        assert!(!request("PUT /b/k HTTP/1.1\r\n\r\n").is_multipart_part_upload());
    }

    #[test]
    fn parses_chunk_sizes() {
        assert_eq!(chunk_size(b"1a\r\n").ok(), Some(26));
        assert_eq!(chunk_size(b"10;ext=1\r\n").ok(), Some(16));
        assert_eq!(chunk_size(b"0\r\n").ok(), Some(0));
        assert!(chunk_size(b"\r\n").is_err());
        assert!(chunk_size(b"zz\r\n").is_err());
        assert!(chunk_size(b"1a").is_err());
        assert!(chunk_size(b"ffffffffffffffffff\r\n").is_err());
    }

    #[test]
    fn parses_status_lines() {
        let resp = response("HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(resp.status, 204);
        assert_eq!(resp.framing("GET").ok(), Some(Framing::Length(0)));
        assert!(Response::parse(b"HTTP/1.1 2x4 No\r\n\r\n").is_err());
        let resp = response("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n");
        assert!(!resp.keep_alive);
        assert_eq!(resp.framing("GET").ok(), Some(Framing::Length(2)));
        assert_eq!(resp.framing("HEAD").ok(), Some(Framing::Length(0)));
        let resp = response("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(resp.framing("GET").ok(), Some(Framing::UntilClose));
    }

    #[test]
    fn the_client_head_keeps_the_reason_and_drops_hop_by_hop_fields() {
        let resp = response(
            "HTTP/1.1 200 Fine Thanks\r\nConnection: x-private\r\nX-Private: 1\r\n\
             Keep-Alive: timeout=5\r\nETag: \"e\"\r\n\r\n",
        );
        let head = String::from_utf8_lossy(&resp.client_head(true)).into_owned();
        assert_eq!(
            head,
            "HTTP/1.1 200 Fine Thanks\r\nETag: \"e\"\r\nConnection: close\r\n\r\n"
        );
    }
}
