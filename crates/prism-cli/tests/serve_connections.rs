//! Slow, idle and too many connections (issue #26's reproductions), over real sockets: a connection
//! that sends nothing or half a header is closed after `--header-timeout`, as is an idle keep-alive
//! connection; past `--max-connections` a new connection gets a 503 in the API's shape and the server
//! keeps serving; a half-sent header does not hold SIGTERM.

mod serve_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serve_common::Server;

/// Reads until the server closes the connection; the bytes it sent and how long that took.
fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (Vec<u8>, Duration) {
    stream.set_read_timeout(Some(within)).unwrap();
    let started = Instant::now();
    let mut all = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return (all, started.elapsed()),
            Ok(n) => all.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (all, started.elapsed())
            }
            Err(e) => panic!(
                "the server kept the connection open ({e}) after {:?}",
                started.elapsed()
            ),
        }
    }
}

#[test]
fn silent_slow_and_idle_connections_are_closed_after_the_header_timeout() {
    let server = Server::start(&["--header-timeout", "1"]);
    // Sends nothing.
    let mut silent = TcpStream::connect(server.addr).unwrap();
    // Half a header.
    let mut slow = TcpStream::connect(server.addr).unwrap();
    slow.write_all(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Ty")
        .unwrap();
    // A keep-alive connection after one answered request.
    let mut idle = TcpStream::connect(server.addr).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    for (name, stream) in [
        ("silent", &mut silent),
        ("slow", &mut slow),
        ("idle", &mut idle),
    ] {
        let (bytes, took) = read_until_closed(stream, Duration::from_secs(10));
        assert!(
            took < Duration::from_secs(5),
            "{name}: closed after {took:?}"
        );
        if name == "idle" {
            assert!(
                bytes.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }
    // Still serving.
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn past_the_connection_limit_a_new_connection_gets_a_503_and_the_server_goes_on() {
    let server = Server::start(&["--max-connections", "4", "--header-timeout", "3"]);
    let held: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(server.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let reply = server.get("/health");
    reply.assert_status(503);
    assert_eq!(reply.error_type(), "overloaded");
    assert_eq!(reply.header("retry-after"), Some("1"));
    drop(held);
    // The slots come back once those connections are gone.
    let started = Instant::now();
    loop {
        let reply = server.get("/health");
        if reply.status == 200 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "still refused");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_half_sent_header_does_not_hold_shutdown() {
    let mut server = Server::start(&[]);
    let mut slow = TcpStream::connect(server.addr).unwrap();
    slow.write_all(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    server.sigterm();
    let status = server.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "{status:?}\n{}", server.output());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        started.elapsed()
    );
}

// Each connection test starts its own server with the flag it is about and ends on its own checks:
// alike at their edges only.
#[test]
fn a_body_too_slow_is_a_408_counted_apart_from_504s() {
    let server = Server::start(&["--timeout", "0.5"]);
    let mut slow = TcpStream::connect(server.addr).unwrap();
    slow.write_all(
        b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"state\"",
    )
    .unwrap();
    let (bytes, _) = read_until_closed(&mut slow, Duration::from_secs(10));
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let stats = server.get("/stats").json();
    assert_eq!(stats["requests"]["body_timed_out"], 1);
    assert_eq!(stats["requests"]["timed_out"], 0);
    assert_eq!(stats["requests"]["by_status"]["408"], 1);
}

/// Sends `bytes` on a fresh connection and reads the reply until the server closes it.
fn raw_exchange(server: &Server, bytes: &[u8]) -> serve_common::Reply {
    let mut stream = TcpStream::connect(server.addr).unwrap();
    // The server may answer and close before reading everything (a write error is no failure here).
    let _ = stream.write_all(bytes);
    let (reply, _) = read_until_closed(&mut stream, Duration::from_secs(10));
    assert!(
        !reply.is_empty(),
        "no reply to {:?}",
        String::from_utf8_lossy(&bytes[..bytes.len().min(80)])
    );
    serve_common::parse_reply(&reply)
}

#[test]
fn requests_hyper_refuses_get_the_apis_error_shape_and_are_counted() {
    let server = Server::start(&[]);
    let big_header = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(100_000));
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "two Content-Lengths",
            b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello".to_vec(),
            400,
            "bad_request",
        ),
        (
            "a Content-Length that is not a number",
            b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".to_vec(),
            400,
            "bad_request",
        ),
        (
            "a folded header line",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n".to_vec(),
            400,
            "bad_request",
        ),
        (
            "an HTTP/2.0 request line",
            b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n".to_vec(),
            400,
            "bad_request",
        ),
        ("1 MiB of headers", big_header.into_bytes(), 431, "headers_too_large"),
        ("a 100 kB URI", long_uri.into_bytes(), 414, "uri_too_long"),
    ];
    for (name, bytes, status, kind) in &cases {
        let reply = raw_exchange(&server, bytes);
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, *status, "{name}: {text}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/json"),
            "{name}"
        );
        assert!(
            reply
                .header("x-typesafe-request-id")
                .is_some_and(|id| id.starts_with("req_")),
            "{name}: {:?}",
            reply.headers
        );
        assert_eq!(reply.error_type(), *kind, "{name}: {text}");
    }
    let stats = server.get("/stats").json();
    assert_eq!(stats["requests"]["protocol_errors"], cases.len(), "{stats}");
    assert_eq!(stats["requests"]["by_status"]["400"], 4, "{stats}");
    assert_eq!(stats["requests"]["by_status"]["431"], 1, "{stats}");
    assert_eq!(stats["requests"]["by_status"]["414"], 1, "{stats}");
    let metrics = String::from_utf8(server.get("/metrics").body).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("prism_requests_total{status=\"431\"} 1")),
        "{metrics}"
    );
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn a_transfer_coding_other_than_chunked_is_a_501() {
    let server = Server::start(&[]);
    let body = br#"{"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}"#;
    for coding in ["gzip, chunked", "deflate,chunked"] {
        let mut request = format!(
            "POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: {coding}\r\n\r\n{:x}\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        request.extend_from_slice(b"\r\n0\r\n\r\n");
        let reply = raw_exchange(&server, &request);
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, 501, "{coding}: {text}");
        assert_eq!(reply.error_type(), "not_implemented", "{text}");
        assert!(reply.header("x-typesafe-request-id").is_some());
        assert_eq!(reply.header("connection"), Some("close"));
    }
    // Plain chunked is read as before.
    let reply = serve_common::send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ],
        body,
    );
    reply.assert_status(200);
    let stats = server.get("/stats").json();
    assert_eq!(stats["requests"]["by_status"]["501"], 2, "{stats}");
}

/// Issue #26's hostile corpus (`tools/hostile.py`, 100+ requests: malformed JSON, bad framing, oversized
/// headers and bodies, unanswerable questions) gets the statuses and error shapes it expects, and the
/// server stays healthy with the same answers. Plain python3, no virtualenv.
#[test]
fn the_hostile_corpus_leaves_the_server_healthy() {
    let server = Server::start(&[]);
    let output = match std::process::Command::new("python3")
        .arg(serve_common::repo_path("tools/hostile.py"))
        .args([
            "--url",
            &format!("http://{}", server.addr),
            "--deadline",
            "300",
        ])
        .output()
    {
        Ok(output) => output,
        Err(error) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("SKIPPED: python3 cannot run ({error})");
            return;
        }
        Err(error) => panic!("python3: {error}"),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("0 failures, healthy at the end: True"),
        "{stdout}"
    );
    let requests: usize = stdout
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(requests >= 100, "{stdout}");
    assert_eq!(server.get("/health").status, 200);
}
