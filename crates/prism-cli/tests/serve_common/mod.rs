//! Shared by the `prism serve` integration tests: start the real binary on a free port, and a small
//! HTTP/1.1 client over `std::net::TcpStream` (one request per connection), so the tests see exactly
//! the bytes on the wire.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub fn repo_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

/// A program of the Python virtualenv that `.ci/run` makes (`target/typesafe-sdk-venv`, or the directory
/// of `PRISM_SDK_PYTHON`), if it is there and `check` (its arguments) succeeds with it. Without it the
/// caller's check is skipped with a message naming `what`, except under `CI=true`, where that panics:
/// CI must run it.
pub fn venv_program(name: &str, check: &[&str], what: &str) -> Option<PathBuf> {
    let python = std::env::var_os("PRISM_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_path("target/typesafe-sdk-venv/bin/python"));
    let program = python.parent().map(|dir| dir.join(name));
    let found = program.filter(|p| {
        p.is_file()
            && Command::new(p)
                .args(check)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        let message =
            format!("{what} (installed by .ci/run in target/typesafe-sdk-venv) is missing");
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{message}: CI must run this check");
        }
        eprintln!("SKIPPED: {message}");
    }
    found
}

/// Runs an SDK check script (`tests/sdk/NAME.py`) with the virtualenv's `python` against `server`
/// (`TYPESAFE_BASE_URL`, `TYPESAFE_API_KEY` = `api_key`, plus `env`); fails the test with the script's
/// and the server's output unless it succeeds; the JSON object it prints, whose `sdk_version` must be
/// the one `.ci/run` pins.
pub fn run_sdk_check(
    python: &std::path::Path,
    script: &str,
    server: &Server,
    api_key: &str,
    env: &[(&str, String)],
) -> Value {
    let mut command = Command::new(python);
    command
        .arg(repo_path(&format!("tests/sdk/{script}")))
        .env("TYPESAFE_BASE_URL", format!("http://{}", server.addr))
        .env("TYPESAFE_API_KEY", api_key)
        .env_remove("TYPESAFE_DEFAULT_MODEL");
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().expect("run the SDK check");
    let report = check_report(&output, &format!("the SDK check {script}"), server);
    assert_eq!(report["sdk_version"], "0.7.5", "the version .ci/run pins");
    report
}

/// The JSON object that a check script run against `server` printed; fails the test with the script's
/// and the server's output unless the script succeeded. `what` names the check in the failure.
pub fn check_report(output: &std::process::Output, what: &str, server: &Server) -> Value {
    assert!(
        output.status.success(),
        "{what} failed:\n{}\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        server.output()
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{what} prints no JSON: {e}"))
}

/// A running `prism serve`, killed when dropped.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    /// Everything printed on stdout so far (the banner, then shutdown lines).
    pub stdout: Arc<Mutex<String>>,
    pub stderr: Arc<Mutex<String>>,
}

fn drain(stream: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            into.lock().unwrap().push_str(&line);
            line.clear();
        }
    });
}

impl Server {
    /// `prism serve --port 0 ARGS...`, waiting for its `Ready on http://ADDR` line.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// Without `--gguf` or `--demo` in `args`, the demo model is served as a v1 model (`--demo v1`:
    /// these tests check v1's answers; the v1.1 families have their own tests).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_prism"));
        command.arg("serve").args(["--port", "0"]);
        if !args.iter().any(|a| *a == "--gguf" || *a == "--demo") {
            command.args(["--demo", "v1"]);
        }
        command
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .env_remove("PRISM_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        // A shell without job control starts background commands with SIGQUIT ignored, and an ignored
        // signal stays ignored across exec: `cargo test &` would hand that to the server, and the
        // stack-dump test checks SIGQUIT's default action. The server gets the default back.
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: signal(2) is async-signal-safe; the closure touches nothing else.
            unsafe {
                command.pre_exec(|| {
                    libc::signal(libc::SIGQUIT, libc::SIG_DFL);
                    Ok(())
                });
            }
        }
        let mut child = command.spawn().expect("start prism serve");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        drain(child.stdout.take().expect("stdout"), stdout.clone());
        drain(child.stderr.take().expect("stderr"), stderr.clone());
        let started = Instant::now();
        loop {
            let text = stdout.lock().unwrap().clone();
            if let Some(rest) = text.split("Ready on http://").nth(1) {
                let addr = rest
                    .split_whitespace()
                    .next()
                    .expect("address")
                    .parse()
                    .expect("socket address");
                return Server {
                    child,
                    addr,
                    stdout,
                    stderr,
                };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "prism serve exited with {status} before Ready:\n{text}\n{}",
                    stderr.lock().unwrap()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no Ready line after 60 s:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (graceful shutdown).
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Waits for the process to exit (after a signal).
    pub fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                started.elapsed() < within,
                "prism serve still running after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn post_json(&self, path: &str, body: &[u8]) -> Reply {
        send(
            self.addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body,
        )
    }

    pub fn get(&self, path: &str) -> Reply {
        send(self.addr, "GET", path, &[], b"")
    }

    pub fn output(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout.lock().unwrap(),
            self.stderr.lock().unwrap()
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// Asserts that the status is `status`, showing the body when it is not.
    #[track_caller]
    pub fn assert_status(&self, status: u16) {
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The response's bytes before `"x_latency_ms"` (answers, usage, model): what must be identical
    /// between two runs of the same request.
    pub fn answer_bytes(&self) -> &[u8] {
        let marker = b",\"x_latency_ms\"";
        let end = self
            .body
            .windows(marker.len())
            .position(|w| w == marker)
            .expect("a latency_ms field");
        &self.body[..end]
    }

    /// `detail.error_type` of an error that is not a validation failure (the reference API's shape
    /// `{"detail": {"error_type": ..., "message": ...}}`), checking that the message is there too.
    pub fn error_type(&self) -> String {
        let body = self.json();
        assert!(
            body["detail"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "no detail.message: {body}"
        );
        body["detail"]["error_type"]
            .as_str()
            .unwrap_or_else(|| panic!("no detail.error_type: {body}"))
            .to_string()
    }

    /// The `loc` of each `detail` entry, as strings.
    pub fn locs(&self) -> Vec<Vec<String>> {
        let body = self.json();
        body["detail"]
            .as_array()
            .unwrap_or_else(|| panic!("no detail list: {body}"))
            .iter()
            .map(|d| {
                d["loc"]
                    .as_array()
                    .expect("loc")
                    .iter()
                    .map(|p| p.as_str().map(String::from).unwrap_or(p.to_string()))
                    .collect()
            })
            .collect()
    }
}

/// One request on a fresh connection (`Connection: close`). The body is sent with a Content-Length unless
/// the headers say `Transfer-Encoding: chunked` (then it is sent as one chunk per 64 KiB). A write error
/// (the server answered early and closed) does not stop the response from being read.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (key, value) in headers {
        head.push_str(&format!("{key}: {value}\r\n"));
    }
    if !chunked
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut writer = stream.try_clone().expect("clone stream");
    let body = body.to_vec();
    let sender = std::thread::spawn(move || {
        writer.write_all(head.as_bytes())?;
        if chunked {
            for chunk in body.chunks(64 * 1024) {
                writer.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())?;
                writer.write_all(chunk)?;
                writer.write_all(b"\r\n")?;
            }
            writer.write_all(b"0\r\n\r\n")
        } else {
            writer.write_all(&body)
        }
    });
    let mut raw = Vec::new();
    let read = stream.read_to_end(&mut raw);
    let _ = sender.join();
    if raw.is_empty() {
        panic!("no response to {method} {path}: {read:?}");
    }
    parse_reply(&raw)
}

pub fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = std::str::from_utf8(&raw[..split]).expect("ASCII headers");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = unchunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

fn unchunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..line_end]).unwrap().trim(), 16)
                .expect("hex size");
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[line_end + 2..line_end + 2 + size]);
        data = &data[line_end + 4 + size..];
    }
}
