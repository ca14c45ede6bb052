//! Serving one client connection: each request is answered by the fault that
//! claims it, or relayed upstream and its response relayed back.
//!
//! This is where the faults meet the bytes, so it owns the order of events
//! that each fault depends on: a reset cuts a body after the head and half
//! the bytes went through, a lost part's body is read before the fake answer,
//! a `ResetMidBody` or `CorruptBody` claim on a GET goes back to the queue when
//! the response has no body to damage (or is an error). Bodies stream through the connection's buffer, never
//! whole in memory; chunked bodies are re-chunked as they pass.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::conn::{Conn, MAX_HEAD, without_line_ending};
use super::faults::{Action, Claim, SharedState, Way};
use super::http::{Framing, Request, Response, chunk_size, malformed};
use super::rate::Meter;
use super::replies::{CONTINUE, lost_part_ack, s3_error_response, synthetic_response};

/// Pause between sending the first half of a body and resetting the
/// connection, so the bytes written reach the peer before the RST discards
/// whatever is still queued in the socket.
const RESET_PAUSE: Duration = Duration::from_millis(20);

/// The request id of the `502` sent when the upstream fails.
const UPSTREAM_FAILED_ID: &str = "ckpt-proxy-upstream";

/// What to do with the client connection after a request.
enum Next {
    KeepAlive,
    Close,
    Reset,
}

impl Next {
    /// Keep-alive or close, as the request asked.
    fn after(req: &Request) -> Next {
        if req.keep_alive {
            Next::KeepAlive
        } else {
            Next::Close
        }
    }
}

/// Whether a body was relayed whole or cut at the fault's point.
#[derive(PartialEq, Eq)]
enum BodyEnd {
    Complete,
    Cut,
}

/// Serves one client connection until it closes, breaks or is reset.
pub(super) async fn serve_client(
    stream: TcpStream,
    upstream: SocketAddr,
    shared: Arc<SharedState>,
) {
    let mut client = Conn::new(stream);
    let mut pooled: Option<Conn> = None;
    let mut served: u64 = 0;
    loop {
        let req = match client.read_head(Request::parse).await {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                let reply = synthetic_response(400, &[], "", false, true);
                let _ = client.stream.write_all(&reply).await;
                let _ = client.stream.shutdown().await;
                return;
            }
            Err(_) => return,
        };
        served += 1;
        let request_id = format!("ckpt-proxy-{served}");
        let next = handle(
            &shared,
            upstream,
            &mut client,
            &mut pooled,
            &req,
            &request_id,
        )
        .await;
        match next {
            Ok(Next::KeepAlive) => {}
            Ok(Next::Close) => {
                let _ = client.stream.shutdown().await;
                return;
            }
            Ok(Next::Reset) => {
                client.reset();
                return;
            }
            // A broken client or upstream mid-message: the client connection
            // cannot be kept in sync any more.
            Err(_) => return,
        }
    }
}

async fn handle(
    shared: &SharedState,
    upstream: SocketAddr,
    client: &mut Conn,
    pooled: &mut Option<Conn>,
    req: &Request,
    request_id: &str,
) -> io::Result<Next> {
    let cut = match shared.claim(req) {
        Action::Relay => Cut::None,
        Action::Delay(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Cut::None
        }
        Action::ResetRequestBody => Cut::RequestBody,
        Action::ResetResponseBody(claim) => Cut::ResponseBody(claim),
        Action::CorruptRequestBody => Cut::FlipRequest,
        Action::CorruptResponseBody(claim) => Cut::FlipResponse(claim),
        Action::Error(status) => {
            discard_body(client, req).await?;
            let reply = s3_error_response(status, request_id, req.is_head(), !req.keep_alive);
            client.stream.write_all(&reply).await?;
            return Ok(Next::after(req));
        }
        Action::LosePart => {
            discard_body(client, req).await?;
            let reply = lost_part_ack(request_id, !req.keep_alive);
            client.stream.write_all(&reply).await?;
            return Ok(Next::after(req));
        }
    };
    relay(upstream, client, pooled, req, cut, shared).await
}

/// Reads and drops a request body the proxy answers itself.
async fn discard_body(client: &mut Conn, req: &Request) -> io::Result<()> {
    if req.framing.is_empty() {
        return Ok(());
    }
    if req.expect_continue {
        client.stream.write_all(CONTINUE).await?;
    }
    relay_body(client, None, req.framing, Damage::None, Meter::OFF).await?;
    Ok(())
}

/// Where a `ResetMidBody` fault cuts a relayed exchange, or a `CorruptBody`
/// fault flips a byte of it.
enum Cut {
    None,
    RequestBody,
    ResponseBody(Claim),
    FlipRequest,
    FlipResponse(Claim),
}

/// What happens to one relayed body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Damage {
    /// Relayed as it is.
    None,
    /// About half is relayed, then the caller resets the connection.
    Cut,
    /// Relayed whole, its middle byte inverted.
    Flip,
}

/// Sends `head` upstream over the pooled connection if it still looks
/// usable, else over a fresh one.
async fn upstream_for(
    upstream: SocketAddr,
    pooled: &mut Option<Conn>,
    head: &[u8],
) -> io::Result<Conn> {
    if let Some(mut conn) = pooled.take().filter(Conn::looks_reusable)
        && conn.stream.write_all(head).await.is_ok()
    {
        return Ok(conn);
    }
    let mut conn = Conn::new(TcpStream::connect(upstream).await?);
    conn.stream.write_all(head).await?;
    Ok(conn)
}

async fn relay(
    upstream: SocketAddr,
    client: &mut Conn,
    pooled: &mut Option<Conn>,
    req: &Request,
    cut: Cut,
    shared: &SharedState,
) -> io::Result<Next> {
    let (request_damage, mut response_claim, response_damage) = match cut {
        Cut::None => (Damage::None, None, Damage::None),
        Cut::RequestBody => (Damage::Cut, None, Damage::None),
        Cut::ResponseBody(claim) => (Damage::None, Some(claim), Damage::Cut),
        Cut::FlipRequest => (Damage::Flip, None, Damage::None),
        Cut::FlipResponse(claim) => (Damage::None, Some(claim), Damage::Flip),
    };

    let mut up = match upstream_for(upstream, pooled, &req.upstream_head()).await {
        Ok(conn) => conn,
        Err(_) => {
            if let Some(claim) = response_claim.take() {
                shared.give_back(claim);
            }
            // The request body is still unread: answer and close.
            let reply = s3_error_response(502, UPSTREAM_FAILED_ID, req.is_head(), true);
            client.stream.write_all(&reply).await?;
            return Ok(Next::Close);
        }
    };

    if !req.framing.is_empty() {
        if req.expect_continue {
            client.stream.write_all(CONTINUE).await?;
        }
        let meter = Meter::new(shared, Way::Up);
        if relay_body(
            client,
            Some(&mut up.stream),
            req.framing,
            request_damage,
            meter,
        )
        .await?
            == BodyEnd::Cut
        {
            shared.bump(|s| s.resets += 1);
            up.reset();
            return Ok(Next::Reset);
        }
        if request_damage == Damage::Flip {
            shared.bump(|s| s.corrupted += 1);
        }
    }

    // Read the final response head, passing interim (1xx) responses on.
    let resp = loop {
        let parsed = up.read_head(Response::parse).await.ok().flatten();
        let Some(resp) = parsed.filter(|r| r.status != 101) else {
            if let Some(claim) = response_claim.take() {
                shared.give_back(claim);
            }
            let reply = s3_error_response(502, UPSTREAM_FAILED_ID, req.is_head(), !req.keep_alive);
            client.stream.write_all(&reply).await?;
            return Ok(Next::after(req));
        };
        if resp.status >= 200 {
            break resp;
        }
        client.stream.write_all(&resp.client_head(false)).await?;
    };

    let framing = resp.framing(&req.method)?;
    if (framing.is_empty()
        || (response_damage == Damage::Flip && !(200..300).contains(&resp.status)))
        && let Some(claim) = response_claim.take()
    {
        // Nothing to cut, or an error whose body no checksum covers: the fault
        // waits for a response with data in its body.
        shared.give_back(claim);
    }
    let until_close = framing == Framing::UntilClose;
    let client_keep_alive = req.keep_alive && !until_close;
    client
        .stream
        .write_all(&resp.client_head(!client_keep_alive))
        .await?;
    let damage = if response_claim.is_some() {
        response_damage
    } else {
        Damage::None
    };
    // Counted before the body goes out: a client that reads the damaged body, fails
    // its checksum and gives up must find the count already there (counted after,
    // a test could read the statistics before the relay task got to it).
    if damage == Damage::Flip {
        shared.bump(|s| s.corrupted += 1);
    }
    let meter = Meter::new(shared, Way::Down);
    let end = relay_body(&mut up, Some(&mut client.stream), framing, damage, meter).await?;
    if end == BodyEnd::Cut {
        shared.bump(|s| s.resets += 1);
        up.reset();
        return Ok(Next::Reset);
    }
    if resp.keep_alive && !until_close {
        *pooled = Some(up);
    }
    Ok(if client_keep_alive {
        Next::KeepAlive
    } else {
        Next::Close
    })
}

/// Relays one body from `src` to `dst` (or discards it when `dst` is
/// `None`). With [`Damage::Cut`], stops after about half of it and pauses
/// briefly so the bytes reach the peer before the caller resets the
/// connection; with [`Damage::Flip`], relays it whole with its middle byte
/// (of the first chunk or read, when the length is not known) inverted.
async fn relay_body(
    src: &mut Conn,
    mut dst: Option<&mut TcpStream>,
    framing: Framing,
    damage: Damage,
    meter: Meter<'_>,
) -> io::Result<BodyEnd> {
    let cut = damage == Damage::Cut;
    let flip = damage == Damage::Flip;
    let end = match framing {
        Framing::Length(n) => {
            if flip && n > 0 {
                src.copy_flipping(dst.as_deref_mut(), n, n / 2, meter)
                    .await?;
                BodyEnd::Complete
            } else if cut {
                src.copy_exact(dst.as_deref_mut(), n / 2, meter).await?;
                BodyEnd::Cut
            } else {
                src.copy_exact(dst.as_deref_mut(), n, meter).await?;
                BodyEnd::Complete
            }
        }
        Framing::Chunked => relay_chunked(src, dst.as_deref_mut(), damage, meter).await?,
        Framing::UntilClose => {
            let mut flip = flip;
            loop {
                let n = src.fill().await?;
                if n == 0 {
                    break BodyEnd::Complete;
                }
                if flip {
                    src.copy_flipping(dst.as_deref_mut(), n as u64, n as u64 / 2, meter)
                        .await?;
                    flip = false;
                    continue;
                }
                let take = if cut { n / 2 } else { n };
                if let Some(dst) = dst.as_deref_mut() {
                    meter.pass(take).await;
                    dst.write_all(&src.buffered()[..take]).await?;
                }
                src.consume(take);
                if cut {
                    break BodyEnd::Cut;
                }
            }
        }
    };
    if end == BodyEnd::Cut {
        if let Some(dst) = dst {
            dst.flush().await?;
        }
        tokio::time::sleep(RESET_PAUSE).await;
    }
    Ok(end)
}

/// Relays a chunked body, re-chunking it as it passes. With [`Damage::Cut`],
/// stops in the middle of the first chunk (or before the last chunk of an
/// empty body); with [`Damage::Flip`], inverts the middle byte of the first
/// chunk.
async fn relay_chunked(
    src: &mut Conn,
    mut dst: Option<&mut TcpStream>,
    damage: Damage,
    meter: Meter<'_>,
) -> io::Result<BodyEnd> {
    let cut = damage == Damage::Cut;
    let mut flip = damage == Damage::Flip;
    loop {
        let size = chunk_size(&src.read_line().await?)?;
        if size == 0 {
            if cut {
                return Ok(BodyEnd::Cut);
            }
            let mut tail = b"0\r\n".to_vec();
            loop {
                let line = src.read_line().await?;
                let trailer = without_line_ending(&line);
                if trailer.is_empty() {
                    break;
                }
                if tail.len() + trailer.len() > MAX_HEAD {
                    return Err(malformed("trailers too large"));
                }
                tail.extend_from_slice(trailer);
                tail.extend_from_slice(b"\r\n");
            }
            tail.extend_from_slice(b"\r\n");
            if let Some(dst) = dst.as_deref_mut() {
                dst.write_all(&tail).await?;
            }
            return Ok(BodyEnd::Complete);
        }
        if let Some(dst) = dst.as_deref_mut() {
            dst.write_all(format!("{size:x}\r\n").as_bytes()).await?;
        }
        if cut {
            src.copy_exact(dst.as_deref_mut(), size / 2, meter).await?;
            return Ok(BodyEnd::Cut);
        }
        if flip {
            src.copy_flipping(dst.as_deref_mut(), size, size / 2, meter)
                .await?;
            flip = false;
        } else {
            src.copy_exact(dst.as_deref_mut(), size, meter).await?;
        }
        if !without_line_ending(&src.read_line().await?).is_empty() {
            return Err(malformed("chunk data not followed by CRLF"));
        }
        if let Some(dst) = dst.as_deref_mut() {
            dst.write_all(b"\r\n").await?;
        }
    }
}
