//! The engine behind `prism serve`, over real sockets on the bundled model: many clients at once get
//! the very bytes they get alone, passes hold several requests, a repeated evidence comes from the
//! prefix cache with identical bytes, a tiny cache evicts, a client that leaves is cancelled without
//! touching the others, and `/metrics` is OpenMetrics text that Prometheus' own Python parser reads.

mod serve_common;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::Server;

/// Sixteen distinct requests: eight evidences, two question sets each (one with a wide choice).
fn requests() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for e in 0..8 {
        let state = format!(
            "Ticket {e}: the parcel arrived {} days late and the box was crushed. {}",
            e + 1,
            "The customer asks for a refund. ".repeat(e % 3 + 1)
        );
        let wide: serde_json::Map<String, Value> = (0..30)
            .map(|i| (format!("team_{i}"), Value::Null))
            .collect();
        out.push(
            serde_json::to_vec(&json!({
                "state": state,
                "questions": {
                    "late": {"type": "noul", "instructions": "Was the delivery late?"},
                    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"shipping": null, "billing": null, "sales": null}},
                }
            }))
            .unwrap(),
        );
        out.push(
            serde_json::to_vec(&json!({
                "state": {"ticket": e, "text": state},
                "questions": {
                    "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]},
                    "many": {"type": "choice", "instructions": "Which of many teams?", "criteria": wide},
                }
            }))
            .unwrap(),
        );
    }
    out
}

fn alone_bodies(requests: &[Vec<u8>]) -> Vec<Vec<u8>> {
    // One at a time, no prefix cache: the reference bytes.
    let server = Server::start(&["--prefix-cache-tokens", "0", "--timeout", "600"]);
    requests
        .iter()
        .map(|body| {
            let reply = server.post_json("/v1/systemone", body);
            reply.assert_status(200);
            reply.answer_bytes().to_vec()
        })
        .collect()
}

/// Each body POSTed to /v1/systemone from its own client thread, all at once; the replies in body
/// order with their index.
fn post_all_at_once(
    addr: std::net::SocketAddr,
    bodies: &[Vec<u8>],
) -> Vec<(usize, serve_common::Reply)> {
    let clients: Vec<_> = bodies
        .iter()
        .cloned()
        .enumerate()
        .map(|(c, body)| {
            std::thread::spawn(move || {
                let reply = serve_common::send(
                    addr,
                    "POST",
                    "/v1/systemone",
                    &[("Content-Type", "application/json")],
                    &body,
                );
                (c, reply)
            })
        })
        .collect();
    clients.into_iter().map(|c| c.join().unwrap()).collect()
}

/// A 200 whose answer bytes are `expected` (the same request's alone).
fn assert_alone_bytes(reply: &serve_common::Reply, expected: &[u8], what: &str) {
    assert_eq!(
        reply.status,
        200,
        "{what}: {}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(
        String::from_utf8_lossy(reply.answer_bytes()),
        String::from_utf8_lossy(expected),
        "{what}"
    );
}

#[test]
fn sixty_four_clients_get_their_alone_bytes_and_share_passes() {
    let requests = requests();
    let expected = alone_bodies(&requests);
    // Bytes are checked, not speed: a slow CI machine must not turn answers into 504s.
    let server = Server::start(&["--timeout", "600"]);
    let bodies: Vec<Vec<u8>> = (0..64)
        .map(|c| requests[c % requests.len()].clone())
        .collect();
    for (c, reply) in post_all_at_once(server.addr, &bodies) {
        assert_alone_bytes(
            &reply,
            &expected[c % requests.len()],
            &format!("client {c}"),
        );
    }
    let stats = server.get("/stats").json();
    let engine = &stats["engine"];
    assert!(
        engine["max_requests_per_pass"].as_u64().unwrap() >= 2,
        "no pass held prompts of several requests: {engine}"
    );
    let multi: u64 = engine["requests_per_pass"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.parse::<usize>().unwrap() >= 2)
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert!(multi >= 1, "{engine}");
    assert_eq!(engine["answered"], 64 + 1, "64 clients and the warm-up");
    // Every evidence was asked four times: later ones found it in the cache or in a pass computing it.
    assert!(
        stats["prefix_cache"]["hits"].as_u64().unwrap() >= 1,
        "{stats}"
    );
    assert_eq!(stats["requests"]["by_status"]["200"], 64);

    // A repeated evidence afterwards is a cache hit with the same bytes.
    let hits_before = server.get("/stats").json()["prefix_cache"]["hits"]
        .as_u64()
        .unwrap();
    let again = server.post_json("/v1/systemone", &requests[3]);
    assert_eq!(again.answer_bytes(), expected[3].as_slice());
    let after = server.get("/stats").json();
    assert_eq!(
        after["prefix_cache"]["hits"].as_u64().unwrap(),
        hits_before + 1
    );
}

#[test]
fn a_tiny_prefix_cache_evicts_and_keeps_the_bytes() {
    let requests = requests();
    let expected = alone_bodies(&requests[..6]);
    let server = Server::start(&["--prefix-cache-tokens", "300"]);
    for _ in 0..2 {
        for (body, want) in requests[..6].iter().zip(&expected) {
            let reply = server.post_json("/v1/systemone", body);
            assert_eq!(reply.answer_bytes(), want.as_slice());
        }
    }
    let cache = &server.get("/stats").json()["prefix_cache"];
    assert!(cache["evictions"].as_u64().unwrap() >= 1, "{cache}");
    assert!(cache["cached_tokens"].as_u64().unwrap() <= 300, "{cache}");
}

#[test]
fn a_client_that_leaves_is_cancelled_and_the_others_keep_their_bytes() {
    let requests = requests();
    let expected = alone_bodies(&requests[..4]);
    // Small passes, so the long request takes many steps and its cancellation is seen between them.
    let server = Server::start(&["--max-batch-tokens", "128"]);
    let long = serde_json::to_vec(&json!({
        "state": "A very long complaint. ".repeat(3000),
        "questions": {"late": {"type": "noul", "instructions": "Was it late?"}},
    }))
    .unwrap();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(server.addr).unwrap();
        let head = format!(
            "POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            long.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(&long).unwrap();
        // Leave once the engine is computing it (before that, leaving stops it even earlier).
        let started = Instant::now();
        while server.get("/stats").json()["queue"]["running"] == 0 {
            assert!(started.elapsed() < Duration::from_secs(60));
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(stream); // the client leaves before its answer
        let started = Instant::now();
        while server.get("/stats").json()["queue"]["running"] != 0 {
            assert!(started.elapsed() < Duration::from_secs(60), "not cancelled");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let addr = server.addr;
    let others: Vec<_> = requests[..4]
        .iter()
        .cloned()
        .map(|body| {
            std::thread::spawn(move || {
                serve_common::send(
                    addr,
                    "POST",
                    "/v1/systemone",
                    &[("Content-Type", "application/json")],
                    &body,
                )
            })
        })
        .collect();
    for (other, want) in others.into_iter().zip(&expected) {
        let reply = other.join().unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.answer_bytes(), want.as_slice());
    }
    let started = Instant::now();
    loop {
        let engine = server.get("/stats").json()["engine"].clone();
        if engine["cancelled"].as_u64().unwrap() == 2 {
            // Cancelled requests were not answered: only the warm-up and the four others were.
            assert_eq!(engine["answered"], 5, "{engine}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the requests of the clients that left were never cancelled: {engine}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn metrics_are_openmetrics_text_that_prometheus_parses() {
    let server = Server::start(&[]);
    let body = &requests()[0];
    for _ in 0..3 {
        assert_eq!(server.post_json("/v1/systemone", body).status, 200);
    }
    assert_eq!(server.get("/nope").status, 404);
    let reply = server.get("/metrics");
    assert_eq!(reply.status, 200);
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text = String::from_utf8(reply.body.clone()).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    for needle in [
        "prism_requests_total{status=\"200\"} 3",
        "prism_requests_total{status=\"404\"} 1",
        "prism_request_latency_seconds_count 3",
        "prism_pass_requests_bucket",
        "prism_prefix_cache_hits_total 2",
        "prism_queue_depth 0",
    ] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    // Prometheus' own parser, the `prometheus_client` Python package.
    let Some(python) = serve_common::venv_program(
        "python",
        &["-c", "import prometheus_client.openmetrics.parser"],
        "the prometheus_client Python package",
    ) else {
        return;
    };
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
families = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    families[family.name] = {"type": family.type, "samples": len(family.samples)}
print(json.dumps(families))
"#;
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "Prometheus' parser refused /metrics: {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let families: BTreeMap<String, Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(families["prism_requests"]["type"], "counter");
    assert_eq!(
        families["prism_request_latency_seconds"]["type"],
        "histogram"
    );
    assert_eq!(families["prism_queue_depth"]["type"], "gauge");
}

#[test]
fn loadgen_checks_every_answer_under_load_and_reports() {
    let server = Server::start(&["--timeout", "600"]);
    let out = std::env::temp_dir().join(format!("prism-loadgen-{}.json", std::process::id()));
    let png = out.with_extension("png");
    let run = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["loadgen", "--url", &format!("http://{}", server.addr)])
        .args(["--sweep", "1,4", "--duration", "2", "--mix-size", "8"])
        .args(["--check", "8", "--expect-identical"])
        .arg("--json-out")
        .arg(&out)
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    assert_eq!(report["distinct_requests"], 8);
    // The sweep's picture: each level's p50 (blue) and p95 (orange) point where the scale puts it.
    let image = image::open(&png).unwrap().to_rgb8();
    let _ = std::fs::remove_file(&png);
    assert_eq!(image.dimensions(), (640, 480));
    let (x_max, y_max) = (
        report["plot"]["x_max_ms"].as_f64().unwrap(),
        report["plot"]["y_max_requests_per_s"].as_f64().unwrap(),
    );
    let centre = |level: &Value, key: &str| -> (u32, u32) {
        let ms = level["latency_ms"][key].as_f64().unwrap();
        let rps = level["requests_per_s"].as_f64().unwrap();
        (
            40 + ((ms / x_max) * 560.0).round() as u32,
            400 - ((rps / y_max) * 380.0).round() as u32,
        )
    };
    let levels_drawn = report["levels"].as_array().unwrap();
    for (i, level) in levels_drawn.iter().enumerate() {
        for (key, color) in [("p50", [31u8, 119, 180]), ("p95", [255, 127, 14])] {
            let (px, py) = centre(level, key);
            // Points drawn later (the p95 series after the p50 one) may cover it: only a point with
            // no other point within 12 pixels must show its own colour.
            let covered = levels_drawn.iter().enumerate().any(|(j, other)| {
                ["p50", "p95"].iter().any(|&k| {
                    (j, k) != (i, key) && {
                        let (ox, oy) = centre(other, k);
                        ox.abs_diff(px) < 12 && oy.abs_diff(py) < 12
                    }
                })
            });
            if !covered {
                assert_eq!(
                    image.get_pixel(px, py).0,
                    color,
                    "{key} point of {level} at ({px}, {py})"
                );
            }
        }
    }
    // The series drawn last (p95) shows its colour somewhere whatever the points. The p50 series may
    // lie wholly under it when the two percentiles of every level fall within a pixel of each other
    // (a run seen in CI); its points that no other point covers were checked above.
    assert!(
        image.pixels().any(|p| p.0 == [255u8, 127, 14]),
        "no p95 pixel"
    );
    let levels = report["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for (level, clients) in levels.iter().zip([1, 4]) {
        assert_eq!(level["clients"], clients);
        assert!(level["answered"].as_u64().unwrap() >= 1, "{level}");
        assert_eq!(level["transport_errors"], 0);
        assert!(level["latency_ms"]["p50"].as_f64().unwrap() > 0.0);
        assert!(level["requests_per_s"].as_f64().unwrap() > 0.0);
        // Every answer's server latency was read, and the client waited at least that long.
        assert_eq!(level["server_latency_ms"]["count"], level["answered"]);
        assert!(level["server_latency_ms"]["p50"].as_f64().unwrap() > 0.0);
        assert!(
            level["transport_ms"]["p50"].as_f64().unwrap() > 0.0,
            "{level}"
        );
    }
    // Every distinct request answered under load was sent again alone: same bytes.
    let answered = report["distinct_answered"].as_u64().unwrap();
    assert!(answered >= 1);
    assert_eq!(report["check"]["checked"], answered);
    assert_eq!(report["check"]["mismatches"], 0);
    // The server saw the load and the check.
    let stats = server.get("/stats").json();
    let under_load: u64 = levels.iter().map(|l| l["answered"].as_u64().unwrap()).sum();
    assert!(stats["requests"]["decisions"].as_u64().unwrap() >= under_load + answered);

    // --max-requests stops a level after that many requests.
    let run = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["loadgen", "--url", &format!("http://{}", server.addr)])
        .args([
            "--clients",
            "2",
            "--duration",
            "60",
            "--max-requests",
            "5",
            "--mix-size",
            "8",
        ])
        .args(["--check", "0", "--json-out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success());
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    assert_eq!(report["levels"][0]["answered"], 5);
    assert!(report["levels"][0]["seconds"].as_f64().unwrap() < 30.0);
}

#[test]
fn openapi_describes_every_route() {
    let server = Server::start(&[]);
    let reply = server.get("/openapi.json");
    assert_eq!(reply.status, 200);
    let doc = reply.json();
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/v1/systemone", "post"),
        ("/v1/decisions", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/stats", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ] {
        assert!(paths[path][method].is_object(), "{path} {method}");
        // Each route is really there.
        let status = if method == "get" {
            server.get(path).status
        } else {
            server.post_json(path, &requests()[0]).status
        };
        assert_eq!(status, 200, "{path}");
    }
    // Every $ref points at a component that exists.
    let text = String::from_utf8(reply.body.clone()).unwrap();
    let references: Vec<&str> = text.split("\"$ref\": \"#/").skip(1).collect();
    assert!(references.len() >= 10, "{} references", references.len());
    for reference in references {
        let target = reference.split('"').next().unwrap();
        let mut node = &doc;
        for part in target.split('/') {
            node = &node[part];
        }
        assert!(!node.is_null(), "dangling $ref #/{target}");
    }
}

/// A request body with `n` noul questions (`q0` … on the state "s").
fn noul_questions(n: usize) -> Vec<u8> {
    let questions: serde_json::Map<String, Value> = (0..n)
        .map(|i| {
            (
                format!("q{i}"),
                json!({"type": "noul", "instructions": format!("Is {i} true?")}),
            )
        })
        .collect();
    serde_json::to_vec(&json!({"state": "s", "questions": questions})).unwrap()
}

#[test]
fn one_request_cannot_ask_for_unbounded_work() {
    // Issue #26's reproduction: 2,000 noul questions in one body (once 2.3 GB of RSS and 36 s).
    let server = Server::start(&[]);
    let body = noul_questions(2000);
    let started = Instant::now();
    let reply = server.post_json("/v1/systemone", &body);
    reply.assert_status(422);
    assert_eq!(reply.locs()[0], ["body", "questions"]);
    assert!(started.elapsed() < Duration::from_secs(10));
    // Within the question limit but over the request's token limit.
    let server = Server::start(&["--max-request-tokens", "500"]);
    let reply = server.post_json("/v1/systemone", &requests()[1]);
    reply.assert_status(422);
    assert_eq!(reply.locs()[0], ["body", "questions"]);
    assert_eq!(reply.json()["detail"][0]["type"], "request_too_long");
    // The server goes on.
    assert_eq!(
        server.post_json("/v1/systemone", &requests()[0]).status,
        200
    );
}

/// The process's peak resident memory so far (`VmHWM`), in bytes.
#[cfg(target_os = "linux")]
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// Issue #26: 1,000 noul questions peaked at 2.4 GB on the demo model (~2.4 MB a question: every
/// read-out branch held a state of every layer until the end of its pass). Now a branch's state goes
/// layer by layer; 400 questions must stay under 1.5 MB a question (they take ~0.9 MB, mostly the
/// pass's activations; before the fix they took ~2.4 MB).
#[cfg(target_os = "linux")]
#[test]
fn memory_per_question_stays_well_below_the_old_two_megabytes() {
    let server = Server::start(&["--max-questions", "400", "--timeout", "600"]);
    let before = peak_rss(server.pid());
    let body = noul_questions(400);
    let reply = server.post_json("/v1/systemone", &body);
    reply.assert_status(200);
    assert_eq!(reply.json()["answers"].as_object().unwrap().len(), 400);
    let grown = peak_rss(server.pid()).saturating_sub(before);
    let per_question = grown as f64 / 400.0;
    assert!(
        per_question < 1.5e6,
        "the peak grew by {:.0} MB, {:.2} MB a question",
        grown as f64 / 1e6,
        per_question / 1e6
    );
}

/// Issue #26: an 8 MB state was refused only after tokenizing it (10 s), and 128 questions over a
/// 600 kB state would render and tokenize 77 MB. Their length alone proves them too long (no token of
/// the demo model stands for more than 64 bytes), so both are refused at once, naming the field.
#[test]
fn text_too_long_by_its_length_alone_is_refused_without_tokenizing() {
    let server = Server::start(&["--timeout", "600"]);
    // A 422 within 3 s: too soon for tokenizing.
    let refused_at_once = |body: &[u8]| {
        let started = Instant::now();
        let reply = server.post_json("/v1/systemone", body);
        let took = started.elapsed();
        reply.assert_status(422);
        assert!(took < Duration::from_secs(3), "refused after {took:?}");
        reply
    };
    let state = "word ".repeat(1_600_000);
    let body = serde_json::to_vec(&json!({
        "state": state,
        "questions": {"late": {"type": "noul", "instructions": "Is it late?"}},
    }))
    .unwrap();
    let reply = refused_at_once(&body);
    assert_eq!(reply.locs(), [["body", "questions", "late"]]);
    // (8,000,000 bytes of state + 11 of instructions) / 64 bytes a token, rounded up.
    let error = reply.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("at least 125001 tokens"), "{error}");

    let questions: serde_json::Map<String, Value> = (0..128)
        .map(|i| {
            (
                format!("q{i}"),
                json!({"type": "noul", "instructions": "Is it?"}),
            )
        })
        .collect();
    let body =
        serde_json::to_vec(&json!({"state": "w".repeat(600_000), "questions": questions})).unwrap();
    let reply = refused_at_once(&body);
    assert_eq!(reply.locs(), [["body", "questions"]]);
    assert_eq!(reply.json()["detail"][0]["type"], "request_too_long");
    // Nothing was left behind: a small request is answered.
    let small =
        br#"{"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}"#;
    assert_eq!(server.post_json("/v1/systemone", small).status, 200);
}

/// Issue #25's tensor parallelism on one device (`--tp 2`: the model's heads and MLP split over two
/// devices that share the CPU, at int8): every answer is the bytes of the unsplit int8 model's alone,
/// under sixteen concurrent clients, twice (the second round from the prefix cache); a float model is
/// refused at start with the reason.
#[test]
fn a_model_split_over_two_devices_answers_as_one() {
    let requests = requests();
    let alone_server = Server::start(&[
        "--precision",
        "int8",
        "--prefix-cache-tokens",
        "0",
        "--timeout",
        "600",
    ]);
    let expected: Vec<Vec<u8>> = requests
        .iter()
        .map(|body| {
            let reply = alone_server.post_json("/v1/systemone", body);
            reply.assert_status(200);
            reply.answer_bytes().to_vec()
        })
        .collect();
    drop(alone_server);
    let server = Server::start(&["--precision", "int8", "--tp", "2", "--timeout", "600"]);
    assert!(
        server
            .output()
            .contains("each replica over 2 devices (--tp)"),
        "{}",
        server.output()
    );
    for round in 0..2 {
        for (c, reply) in post_all_at_once(server.addr, &requests) {
            assert_alone_bytes(
                &reply,
                &expected[c],
                &format!("--tp 2, round {round}, client {c}"),
            );
        }
    }
    let stats = server.get("/stats").json();
    assert!(
        stats["prefix_cache"]["hits"].as_u64().unwrap() >= requests.len() as u64,
        "{stats}"
    );
    drop(server);
    // f32 (the CPU's default): no exact split, refused before serving.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["serve", "--demo", "v1", "--port", "0", "--tp", "2"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("integer path"), "{stderr}");
    // --tp 3 is not a split the contract has.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_prism"))
        .args([
            "serve",
            "--demo",
            "v1",
            "--port",
            "0",
            "--precision",
            "int8",
            "--tp",
            "3",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--tp takes 1, 2 or 4"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Issue #25's data-parallel layout on one device: two engine replicas behind one server. Every answer
/// is the bytes of one replica alone; both replicas take work under concurrent load; a request on an
/// evidence seen before goes to the replica that took it (its prefix cache hits).
#[test]
fn two_replicas_answer_as_one_and_keep_evidence_affinity() {
    let requests = requests();
    let expected = alone_bodies(&requests);
    let server = Server::start(&["--replicas", "2", "--timeout", "600"]);
    // The sixteen requests at once from sixteen clients, twice over (the second round on evidence
    // the first round computed).
    for round in 0..2 {
        for (c, reply) in post_all_at_once(server.addr, &requests) {
            assert_alone_bytes(&reply, &expected[c], &format!("round {round}, client {c}"));
        }
    }
    let stats = server.get("/stats").json();
    let replicas = stats["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{stats}");
    for replica in replicas {
        assert!(replica["passes"].as_u64().unwrap() >= 1, "{replica}");
        assert!(replica["answered"].as_u64().unwrap() >= 1, "{replica}");
    }
    let answered: u64 = replicas
        .iter()
        .map(|r| r["answered"].as_u64().unwrap())
        .sum();
    assert_eq!(answered, stats["engine"]["answered"].as_u64().unwrap());
    // The two rounds and the server's warm-up question.
    assert_eq!(answered, 2 * requests.len() as u64 + 1, "{stats}");
    // The second round's requests found their evidence on the replica the dispatcher sent them to:
    // every one of the sixteen is a hit there (the first round's own evidences share nothing across
    // the eight tickets, so it cannot have made them).
    let hits: u64 = replicas
        .iter()
        .map(|r| r["prefix_cache"]["hits"].as_u64().unwrap())
        .sum();
    assert!(hits >= requests.len() as u64, "{stats}");
    assert_eq!(stats["queue"]["capacity"], 2 * 64);
    // /metrics counts each replica's passes and tokens (label `replica`), as /stats does.
    let metrics = String::from_utf8(server.get("/metrics").body).unwrap();
    for (i, replica) in replicas.iter().enumerate() {
        for (name, key) in [
            ("prism_replica_passes_total", "passes"),
            ("prism_replica_tokens_computed_total", "tokens_computed"),
        ] {
            let prefix = format!("{name}{{replica=\"{i}\"}} ");
            let value: u64 = metrics
                .lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("no {prefix}in\n{metrics}"))
                .trim()
                .parse()
                .unwrap();
            assert_eq!(value, replica[key].as_u64().unwrap(), "{prefix}");
        }
    }
}
