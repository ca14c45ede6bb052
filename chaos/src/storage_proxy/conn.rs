//! A TCP connection with a read buffer, as the relay reads it: a head, a
//! line, a run of body bytes.
//!
//! The proxy cannot use a split stream or a framed codec: it must be able to
//! reset the very socket it reads from (`SO_LINGER` 0), and hand the bytes
//! that arrived behind a head to the body that follows. Both are plain with
//! one buffer it owns.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::http::{Parsed, malformed};
use super::rate::Meter;

/// Largest request or response head accepted, in bytes.
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// Largest chunk-size or trailer line accepted, in bytes.
const MAX_LINE: usize = 8 * 1024;
/// Size of the per-connection read buffer bodies stream through.
const IO_BUF: usize = 64 * 1024;

/// A TCP stream with a read buffer. The stream is kept whole (not split) so
/// that it can be reset.
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
}

impl Conn {
    pub(super) fn new(stream: TcpStream) -> Conn {
        let _ = stream.set_nodelay(true);
        Conn {
            stream,
            buf: vec![0; IO_BUF].into_boxed_slice(),
            pos: 0,
            len: 0,
        }
    }

    /// The bytes read and not consumed yet.
    pub(super) fn buffered(&self) -> &[u8] {
        &self.buf[self.pos..self.len]
    }

    /// Marks the first `n` buffered bytes as used.
    pub(super) fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.len);
    }

    /// Makes buffered bytes available; returns how many are buffered, 0 at
    /// end of stream.
    pub(super) async fn fill(&mut self) -> io::Result<usize> {
        if self.pos == self.len {
            self.pos = 0;
            self.len = self.stream.read(&mut self.buf).await?;
        }
        Ok(self.len - self.pos)
    }

    /// Reads one message head with `parse`, leaving the bytes after it
    /// buffered for the body. Returns `None` on a clean end of stream before
    /// any byte of a head; a head `parse` refuses, or one longer than
    /// [`MAX_HEAD`], is an [`io::ErrorKind::InvalidData`] error.
    pub(super) async fn read_head<T>(
        &mut self,
        parse: impl Fn(&[u8]) -> Parsed<T>,
    ) -> io::Result<Option<T>> {
        let mut head = Vec::new();
        loop {
            let fresh = self.fill().await?;
            if fresh == 0 {
                return if head.is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
            head.extend_from_slice(self.buffered());
            self.pos = self.len;
            if let Some((message, used)) = parse(&head)? {
                // The head was incomplete without the fresh bytes, so what
                // follows it lies among them, still in the buffer.
                let behind = head.len() - used;
                debug_assert!(behind < fresh);
                self.pos = self.len - behind.min(fresh);
                return Ok(Some(message));
            }
            if head.len() > MAX_HEAD {
                return Err(malformed("message head too large"));
            }
        }
    }

    /// Reads one line, its line ending (LF or CRLF) included.
    pub(super) async fn read_line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        loop {
            if self.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let avail = self.buffered();
            if let Some(i) = avail.iter().position(|&b| b == b'\n') {
                line.extend_from_slice(&avail[..=i]);
                self.consume(i + 1);
                return Ok(line);
            }
            line.extend_from_slice(avail);
            self.pos = self.len;
            if line.len() > MAX_LINE {
                return Err(malformed("line too long"));
            }
        }
    }

    /// Copies exactly `n` bytes to `dst` (each run through `meter` first), or
    /// discards them when `dst` is `None`.
    pub(super) async fn copy_exact(
        &mut self,
        mut dst: Option<&mut TcpStream>,
        mut n: u64,
        meter: Meter<'_>,
    ) -> io::Result<()> {
        while n > 0 {
            if self.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let avail = self.buffered();
            let take = avail.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            if let Some(dst) = dst.as_deref_mut() {
                meter.pass(take).await;
                dst.write_all(&avail[..take]).await?;
            }
            self.consume(take);
            n -= take as u64;
        }
        Ok(())
    }

    /// Copies exactly `n` bytes to `dst` as [`Conn::copy_exact`] does, with
    /// the byte at offset `at` (below `n`) inverted on the way.
    pub(super) async fn copy_flipping(
        &mut self,
        mut dst: Option<&mut TcpStream>,
        n: u64,
        at: u64,
        meter: Meter<'_>,
    ) -> io::Result<()> {
        debug_assert!(at < n);
        self.copy_exact(dst.as_deref_mut(), at, meter).await?;
        if self.fill().await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let flipped = !self.buffered()[0];
        if let Some(dst) = dst.as_deref_mut() {
            meter.pass(1).await;
            dst.write_all(&[flipped]).await?;
        }
        self.consume(1);
        self.copy_exact(dst, n - at - 1, meter).await
    }

    /// Whether a pooled connection still looks open: nothing unexpected
    /// buffered and no end of stream or error pending on the socket.
    pub(super) fn looks_reusable(&self) -> bool {
        if !self.buffered().is_empty() {
            return false;
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Closes the connection with a TCP RST rather than a FIN.
    pub(super) fn reset(self) {
        // A zero linger makes close() abort the connection; with zero it does
        // not block, which is why tokio's deprecation does not apply here.
        #[allow(deprecated)]
        let _ = self.stream.set_linger(Some(Duration::ZERO));
        drop(self);
    }
}

/// A line with its line ending (LF or CRLF) removed.
pub(super) fn without_line_ending(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage_proxy::http::Request;
    use tokio::net::TcpListener;

    /// A loopback connection: the writing end, and the reading end as a `Conn`.
    async fn connected() -> (TcpStream, Conn) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (reader, _) = listener.accept().await.unwrap();
        (writer, Conn::new(reader))
    }

    /// Two messages sent a byte at a time, so that heads and bodies arrive in
    /// pieces: each head is whole, and the bytes behind it are the body's.
    #[tokio::test]
    async fn heads_and_bodies_in_pieces_are_read_whole_and_in_order() {
        let (mut writer, mut conn) = connected().await;
        let sent = b"PUT /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nfirst\
                     PUT /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nsecond\r\n0\r\n\r\n";
        let writing = tokio::spawn(async move {
            let _ = writer.set_nodelay(true);
            for byte in sent {
                writer.write_all(&[*byte]).await.unwrap();
            }
            writer
        });

        let Some(first) = conn.read_head(Request::parse).await.unwrap() else {
            panic!("no first head");
        };
        assert!(first.upstream_head().starts_with(b"PUT /a HTTP/1.1\r\n"));
        let mut body = Vec::new();
        while body.len() < 5 {
            assert!(conn.fill().await.unwrap() > 0);
            let take = conn.buffered().len().min(5 - body.len());
            body.extend_from_slice(&conn.buffered()[..take]);
            conn.consume(take);
        }
        assert_eq!(body, b"first");

        let Some(second) = conn.read_head(Request::parse).await.unwrap() else {
            panic!("no second head");
        };
        assert!(second.upstream_head().starts_with(b"PUT /b HTTP/1.1\r\n"));
        assert_eq!(conn.read_line().await.unwrap(), b"6\r\n");
        conn.copy_exact(None, 6, Meter::OFF).await.unwrap();
        assert_eq!(conn.read_line().await.unwrap(), b"\r\n");
        assert_eq!(conn.read_line().await.unwrap(), b"0\r\n");
        assert_eq!(conn.read_line().await.unwrap(), b"\r\n");

        drop(writing.await.unwrap());
        assert!(conn.read_head(Request::parse).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_head_past_the_limit_is_refused() {
        let (mut writer, mut conn) = connected().await;
        // One header line that never ends.
        let mut head = b"GET / HTTP/1.1\r\nX: ".to_vec();
        head.resize(MAX_HEAD + 1, b'a');
        let writing = tokio::spawn(async move { writer.write_all(&head).await });
        let err = match conn.read_head(Request::parse).await {
            Err(e) => e,
            Ok(_) => panic!("an oversized head was accepted"),
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        drop(conn);
        let _ = writing.await;
    }
}
