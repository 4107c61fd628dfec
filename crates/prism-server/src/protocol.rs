//! Requests that hyper refuses itself, before any handler runs, answered in the API's error shape.
//!
//! hyper's HTTP/1 server answers a request it cannot parse on its own and closes the connection: **400**
//! (a bad or repeated `Content-Length`, a folded header line (obs-fold), a request line that is not
//! `METHOD TARGET HTTP/1.0|1.1` such as `HTTP/2.0`, bytes that are not HTTP), **414** (a URI longer than
//! its buffer) and **431** (headers larger than its buffer, ~400 KiB). It writes only a status line,
//! `connection: close`, `content-length: 0` and a date, and offers no hook to change that.
//!
//! [`ApiShapedIo`] wraps each connection's socket and recognises that response as it is written: a head
//! with an error status, `connection: close` and `content-length: 0`, and without the
//! `x-typesafe-request-id` header that every response of the router carries. It writes in its place
//! the same status with the API's error body (`{"error", "detail": {"error_type", "message"}}`), a
//! request id and the date hyper gave, and counts it in `/stats` (`requests.protocol_errors` and
//! `by_status`) and `/metrics`.
//!
//! What this cannot do: the cause is not known from the bytes hyper writes (hyper's error comes out
//! only after the connection ends), so the message lists the causes of the status rather than naming
//! one. A connection that opens with the HTTP/2 preface (`PRI * HTTP/2.0`) or that sends no complete
//! header within `--header-timeout` is closed by hyper without any response: there is nothing to
//! reshape.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::{loc, ApiError};
use crate::metrics::Metrics;
use crate::server::{new_request_id, REQUEST_ID_HEADER};
use crate::stats::Stats;

/// Where the accept loop counts what it answers itself.
#[derive(Clone, Default)]
pub struct Counters {
    pub stats: Arc<Stats>,
    pub metrics: Arc<Metrics>,
}

/// hyper's own error response at the start of `buf`: its head's length in bytes, its status, and its
/// `date` header line (without the line break), if any.
pub fn hyper_error_head(buf: &[u8]) -> Option<(usize, u16, Option<&[u8]>)> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let status = std::str::from_utf8(rest.get(..3)?)
        .ok()?
        .parse::<u16>()
        .ok()?;
    if !(400..600).contains(&status) {
        return None;
    }
    let end = memchr::memmem::find(buf, b"\r\n\r\n")?;
    let head = &buf[..end + 2];
    let has = |line: &[u8]| memchr::memmem::find(head, line).is_some();
    let id_line = format!("\r\n{REQUEST_ID_HEADER}:");
    if !has(b"\r\nconnection: close\r\n")
        || !has(b"\r\ncontent-length: 0\r\n")
        || has(id_line.as_bytes())
    {
        return None;
    }
    let date = memchr::memmem::find(head, b"\r\ndate: ").and_then(|start| {
        let line = &head[start + 2..];
        memchr::memmem::find(line, b"\r\n").map(|len| &line[..len])
    });
    Some((end + 4, status, date))
}

/// The API's error for a status hyper answered on its own.
pub fn protocol_error(status: u16) -> ApiError {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    let (kind, message) = match status {
        400 => (
            "bad_request",
            "the request is not well-formed HTTP/1.1 and was not read: a bad or repeated Content-Length, \
             a folded (obs-fold) header line, a request line other than `METHOD TARGET HTTP/1.1` (or \
             HTTP/1.0), or bytes that are not HTTP",
        ),
        414 => (
            "uri_too_long",
            "the request's URI is longer than this server reads",
        ),
        431 => (
            "headers_too_large",
            "the request's headers are larger than this server reads (about 400 KiB)",
        ),
        _ => (
            "bad_request",
            "the request could not be read as HTTP/1.1",
        ),
    };
    ApiError::new(code, loc(["request"]), kind, message)
}

/// The bytes that replace hyper's head: the same status line, the API's body and a request id.
fn replacement(status: u16, date: Option<&[u8]>, id: &str) -> Vec<u8> {
    let error = protocol_error(status);
    let body = serde_json::to_vec(&error.body_json()).unwrap_or_default();
    let reason = error.status.canonical_reason().unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{REQUEST_ID_HEADER}: {id}\r\n\
         connection: close\r\ncontent-length: {}\r\n",
        body.len()
    )
    .into_bytes();
    if let Some(date) = date {
        out.extend_from_slice(date);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

/// A connection's socket as hyper sees it; see the module notes.
pub struct ApiShapedIo<S> {
    inner: S,
    counters: Counters,
    /// The replacement being written: its bytes, how many are written, and the length of hyper's head
    /// to report as written once all of it is.
    replacing: Option<(Vec<u8>, usize, usize)>,
}

impl<S> ApiShapedIo<S> {
    pub fn new(inner: S, counters: Counters) -> Self {
        ApiShapedIo {
            inner,
            counters,
            replacing: None,
        }
    }
}

impl<S: AsyncWrite + Unpin> ApiShapedIo<S> {
    /// Starts a replacement when `buf` begins with hyper's own error response.
    fn intercept(&mut self, buf: &[u8]) -> bool {
        if self.replacing.is_some() {
            return true;
        }
        let Some((head_len, status, date)) = hyper_error_head(buf) else {
            return false;
        };
        let id = new_request_id();
        self.counters.stats.record_protocol_error(status);
        self.counters.metrics.record_http(status);
        tracing::debug!(request_id = %id, "a request hyper could not parse -> {status}");
        self.replacing = Some((replacement(status, date, &id), 0, head_len));
        true
    }

    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let Some((bytes, written, claim)) = &mut self.replacing else {
            return Poll::Ready(Ok(0));
        };
        while *written < bytes.len() {
            match ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..])) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => *written += n,
                Err(error) => return Poll::Ready(Err(error)),
            }
        }
        let claim = *claim;
        self.replacing = None;
        Poll::Ready(Ok(claim))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ApiShapedIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ApiShapedIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.intercept(buf) {
            return this.poll_replacement(cx);
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs.iter().find(|b| !b.is_empty()).map(|b| &**b);
        if first.is_some_and(|first| this.intercept(first)) {
            return this.poll_replacement(cx);
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_only_hypers_own_error_heads() {
        let hyper = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 01 Dec 2026 23:40:37 GMT\r\n\r\n";
        let (len, status, date) = hyper_error_head(hyper).expect("hyper's head");
        assert_eq!((len, status), (hyper.len(), 400));
        assert_eq!(date, Some(&b"date: Tue, 01 Dec 2026 23:40:37 GMT"[..]));
        // The router's responses carry a request id; successes are never touched.
        let ours = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\nx-typesafe-request-id: req_1\r\n\r\n";
        assert!(hyper_error_head(ours).is_none());
        let ok = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        assert!(hyper_error_head(ok).is_none());
        let with_body = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 12\r\n\r\n";
        assert!(hyper_error_head(with_body).is_none());
        assert!(hyper_error_head(b"HTTP/1.1 4").is_none());
        assert!(hyper_error_head(b"{\"a\": 1}").is_none());
    }

    #[test]
    fn the_replacement_is_the_apis_error_shape() {
        let bytes = replacement(431, Some(b"date: X"), "req_abc");
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains("\r\nx-typesafe-request-id: req_abc\r\n"));
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
        assert!(head.ends_with("\r\ndate: X"));
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["detail"]["error_type"], "headers_too_large");
        assert!(json["detail"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
}
