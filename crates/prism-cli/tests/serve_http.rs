//! `prism serve` over real sockets: the real binary on a free port, the bundled demo model, a plain
//! HTTP/1.1 client. The reference for every answer is `prism decide` (the same procedure without HTTP,
//! itself checked against transformers and the reference renderer) and the decoder's batch invariance
//! (a question answers with the same bytes alone, in a request with others, and under concurrency).

mod common;
mod serve_common;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{repo_path, send, Reply, Server};

/// `prism decide` on a request body: the CLI path's answers.
fn decide_cli(body: &Value) -> Value {
    let dir = repo_path("target/tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!(
        "serve_http_{}_{:?}.json",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, serde_json::to_vec(body).unwrap()).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_prism"))
        .arg("decide")
        .arg(&path)
        .output()
        .expect("run prism decide");
    let _ = std::fs::remove_file(&path);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn post(server: &Server, body: &Value) -> Reply {
    server.post_json("/v1/systemone", &serde_json::to_vec(body).unwrap())
}

/// A noul answer's probability, or a choice or score answer's probabilities.
fn probabilities(answer: &Value) -> Vec<f64> {
    if answer["type"] == "noul" {
        vec![answer["noul"].as_f64().unwrap()]
    } else {
        common::probabilities(answer)
    }
}

/// TypeSafe's confidences, recomputed from the probabilities.
fn check_answer_arithmetic(name: &str, answer: &Value) {
    match answer["type"].as_str().unwrap() {
        "choice" => {
            let p = probabilities(answer);
            let n = p.len() as f64;
            let sum: f64 = p.iter().sum();
            assert!((sum - 1.0).abs() < 1e-9, "{name}: sum {sum}");
            let (best, p_max) = answer["probabilities"].as_object().unwrap().iter().fold(
                ("", -1.0),
                |acc, (k, v)| {
                    if v.as_f64().unwrap() > acc.1 {
                        (k.as_str(), v.as_f64().unwrap())
                    } else {
                        acc
                    }
                },
            );
            assert_eq!(answer["choice"], best, "{name}");
            if p.len() > 1 {
                let expected = (p_max - 1.0 / n) / (1.0 - 1.0 / n);
                assert!(
                    (answer["confidence"].as_f64().unwrap() - expected).abs() < 1e-12,
                    "{name}"
                );
            }
        }
        "noul" => {
            let p = answer["noul"].as_f64().unwrap();
            assert!(p > 0.0 && p < 1.0, "{name}: {p}");
        }
        "score" => {
            let p = probabilities(answer);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{name}");
            let score: f64 = p.iter().enumerate().map(|(i, p)| i as f64 * p).sum();
            assert!(
                (answer["score"].as_f64().unwrap() - score).abs() < 1e-12,
                "{name}"
            );
            let keys: Vec<String> = answer["legend"]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect();
            assert_eq!(
                keys,
                (0..p.len()).map(|i| i.to_string()).collect::<Vec<_>>(),
                "{name}"
            );
        }
        other => panic!("{name}: unexpected type {other}"),
    }
}

#[test]
fn readme_examples_endpoints_and_banner() {
    let server = Server::start(&[]);
    let banner = server.stdout.lock().unwrap().clone();
    for expected in [
        "DEMO model",
        "random",
        "meaningless",
        "--gguf",
        "[1/3]",
        "[2/3]",
        "[3/3]",
        "Ready on",
        "/v1/models",
        "curl -s",
    ] {
        assert!(
            banner.contains(expected),
            "banner lacks {expected:?}:\n{banner}"
        );
    }

    // The bundled model has no decision_config.json: said as a fact in the banner, not logged as a
    // fault; and a log that is not a terminal (here a pipe) carries no colour codes.
    assert!(banner.contains("decision config: the defaults"), "{banner}");
    let log = server.stderr.lock().unwrap().clone();
    assert!(log.contains("INFO"), "no log lines: {log}");
    assert!(
        !log.contains('\x1b'),
        "colour codes in a piped log: {log:?}"
    );
    assert!(!log.contains("not found"), "{log}");

    // The example request answers exactly what `prism decide` answers for it.
    let example: Value =
        serde_json::from_slice(&std::fs::read(repo_path("examples/request.json")).unwrap())
            .unwrap();
    let reply = post(&server, &example);
    reply.assert_status(200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let body = reply.json();
    let cli = decide_cli(&example);
    assert_eq!(body["answers"], cli["answers"]);
    assert_eq!(body["usage"], cli["usage"]);
    assert_eq!(body["model"], "Qwen35 Tiny");
    assert!(body["x_latency_ms"].as_f64().unwrap() > 0.0);
    assert!(
        body.get("x_notes").is_none(),
        "no notes for a plain request: {body}"
    );
    let id = reply
        .header("x-typesafe-request-id")
        .expect("request id")
        .to_string();
    assert!(id.starts_with("req_") && id.len() == 36, "{id}");
    // The alias answers the same bytes, under another request id.
    let alias = server.post_json("/v1/decisions", &serde_json::to_vec(&example).unwrap());
    assert_eq!(alias.answer_bytes(), reply.answer_bytes());
    assert_ne!(alias.header("x-typesafe-request-id"), Some(id.as_str()));

    // Every curl example of the README, and the one the banner prints.
    let readme = std::fs::read_to_string(repo_path("README.md")).unwrap();
    let curl_bodies: Vec<String> = readme
        .lines()
        .chain(banner.lines())
        .filter(|line| line.contains("curl") && line.contains("/v1/systemone"))
        // The refused example is checked below; the image example needs the v1.1 demo and its tower
        // (`serve_v1_1.rs`), this server is v1.
        .filter(|line| !line.contains("refused-request") && !line.contains("image-request"))
        .filter_map(|line| {
            if let Some(file) = line.split("-d @").nth(1) {
                let file = file.split_whitespace().next()?;
                return Some(std::fs::read_to_string(repo_path(file)).unwrap());
            }
            line.split("-d '")
                .nth(1)
                .and_then(|rest| rest.rsplit_once('\''))
                .map(|(json, _)| json.to_string())
        })
        .collect();
    assert!(
        curl_bodies.len() >= 3,
        "README and banner curl examples found: {curl_bodies:?}"
    );
    for body in &curl_bodies {
        let reply = server.post_json("/v1/systemone", body.as_bytes());
        assert_eq!(
            reply.status,
            200,
            "{body}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    // The README's refused example, and the command that produces it.
    assert!(
        readme.lines().any(|l| l.starts_with("curl ")
            && l.contains("-i")
            && l.contains("-d @examples/refused-request.json")),
        "the README shows the refused example's command"
    );
    let refused = server.post_json(
        "/v1/systemone",
        &std::fs::read(repo_path("examples/refused-request.json")).unwrap(),
    );
    assert_eq!(refused.status, 422);
    assert_eq!(
        refused.locs()[0],
        ["body", "questions", "rating", "criteria"]
    );

    let models = server.get("/v1/models").json();
    let model = &models["models"][0];
    assert_eq!(model["name"], "Qwen35 Tiny");
    assert_eq!(model["precision"], "f32");
    assert_eq!(model["demo"], true);
    assert!(model["description"]
        .as_str()
        .unwrap()
        .contains("random weights"));
    assert!(model["release_date"].is_string());
    assert!(model["supports"]["think_mode"]["always"]
        .as_str()
        .unwrap()
        .starts_with("no"));
    assert!(model["supports"]["images"]
        .as_str()
        .unwrap()
        .starts_with("no"));

    let health = server.get("/health");
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["status"], "ok");

    let stats = server.get("/stats").json();
    let answered = 2 + curl_bodies.len() as u64;
    assert_eq!(stats["requests"]["decisions"], answered);
    assert_eq!(stats["requests"]["by_status"]["422"], 1);
    assert_eq!(stats["latency_ms"]["count"], answered);
    assert!(
        stats["latency_ms"]["p50"].as_f64().unwrap()
            <= stats["latency_ms"]["p99"].as_f64().unwrap()
    );
    // The latency's split: every part counted for every answer, none longer than the latency.
    for part in ["prepare_ms", "queue_wait_ms", "compute_ms", "handoff_ms"] {
        assert_eq!(stats[part]["count"], answered, "{part}");
        assert!(
            stats[part]["max"].as_f64().unwrap() <= stats["latency_ms"]["max"].as_f64().unwrap(),
            "{part}: {stats}"
        );
    }
    assert!(stats["prepare_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(stats["compute_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(
        stats["tokens"]["input"].as_u64().unwrap()
            >= 2 * cli["usage"]["input_tokens"].as_u64().unwrap()
    );
    // The three questions of the example went to the model in one pass.
    assert!(stats["engine"]["prompts_per_pass"]["3"].as_u64().unwrap() >= 1);
    assert_eq!(stats["queue"]["depth"], 0);
    // The example was asked twice (curl line and file): the second time its evidence came from the
    // prefix cache.
    assert!(stats["prefix_cache"]["hits"].as_u64().unwrap() >= 1);
    assert!(stats["cache_hit_rate"].as_f64().unwrap() > 0.0);

    assert_eq!(server.get("/nope").status, 404);
    let wrong_method = server.get("/v1/systemone");
    assert_eq!(wrong_method.status, 405);
    assert_eq!(wrong_method.error_type(), "method_not_allowed");
}

/// Every v1 rule through HTTP: each answer equals `prism decide`'s, and a question asked alone answers
/// with the same bytes as inside the combined request (batch invariance through the server).
#[test]
fn decision_rules_through_http() {
    let server = Server::start(&[]);
    let wide: Vec<String> = (0..30).map(|i| format!("team_{i}")).collect();
    let questions = json!({
        "choice_described": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Payments", "tech": "Bugs", "sales": null}},
        "choice_list": {"type": "choice", "question": "Which colour?", "options": ["red", "green", "blue", "amber"]},
        "choice_hidden_ids": {"type": "choice", "instructions": "Pick one.", "criteria": {"A": "first thing", "B": "second thing"}},
        "choice_single": {"type": "choice", "instructions": "Only one?", "criteria": {"only": "the only option"}},
        "choice_wide": {"type": "choice", "instructions": "Which of thirty?", "criteria": wide},
        "noul_default": {"type": "noul"},
        "noul_alias_bool": {"type": "bool", "instructions": "Is it late?", "criteria": {"true": "it is late", "false": "on time"}},
        "score_list": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]},
        "score_dict": {"type": "score", "instructions": "Priority?", "criteria": {"10": "top", "2": "mid", "1": "low"}},
        "score_ten": {"type": "score", "instructions": "Rate it.", "criteria": ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]},
    });
    let states = [
        json!("The parcel arrived late and the box was crushed."),
        json!({"ticket": "Charged twice", "payments": [49, 49, 49, 49, 49, 49, 98, 49], "vip": true, "note": null}),
        json!(null),
    ];
    for state in states {
        let request = json!({"state": state, "questions": questions, "model": "jev-latest", "think_mode": "never"});
        let reply = post(&server, &request);
        reply.assert_status(200);
        let body = reply.json();
        let cli = decide_cli(&request);
        assert_eq!(body["answers"], cli["answers"], "state {state}");
        assert_eq!(body["usage"], cli["usage"]);
        for (name, answer) in body["answers"].as_object().unwrap() {
            check_answer_arithmetic(name, answer);
        }
        let answers = &body["answers"];
        assert_eq!(answers["choice_single"]["probabilities"]["only"], 1.0);
        assert_eq!(
            answers["choice_wide"]["probabilities"]
                .as_object()
                .unwrap()
                .len(),
            30
        );
        assert_eq!(
            answers["score_dict"]["legend"],
            json!({"0": "low", "1": "mid", "2": "top"}),
            "a score dict is ordered by numeric key"
        );
        assert_eq!(
            answers.as_object().unwrap().keys().collect::<Vec<_>>(),
            questions.as_object().unwrap().keys().collect::<Vec<_>>(),
            "answers keep the question order"
        );

        // Alone, each question answers with exactly the bytes it had in the combined request.
        for (name, question) in questions.as_object().unwrap() {
            let alone = post(
                &server,
                &json!({"state": state, "questions": {name.clone(): question}}),
            );
            assert_eq!(alone.status, 200);
            let alone = alone.json();
            assert_eq!(
                serde_json::to_string(&alone["answers"][name]).unwrap(),
                serde_json::to_string(&answers[name]).unwrap(),
                "{name} alone"
            );
        }
    }

    // A single-option choice needs no model: no tokens.
    let single = post(
        &server,
        &json!({"state": "s", "questions": {"q": questions["choice_single"]}}),
    )
    .json();
    assert_eq!(single["usage"]["input_tokens"], 0);

    // return_details: the read-out per answer; settings without effect are named in `x_notes`.
    let detailed = post(
        &server,
        &json!({"state": "s", "questions": {"q": questions["choice_wide"]}, "return_details": true, "gate": 0.9, "mix": 0.5, "none_check": false}),
    );
    assert_eq!(detailed.status, 200);
    let detailed = detailed.json();
    assert_eq!(
        detailed["answers"]["q"]["x_details"]["first"],
        detailed["answers"]["q"]["probabilities"]
    );
    assert_eq!(
        detailed["answers"]["q"]["x_details"]["prompts"], 3,
        "two group prompts and a final round"
    );
    let notes = detailed["x_notes"].as_array().unwrap();
    assert!(
        notes
            .iter()
            .any(|n| n.as_str().unwrap().contains("`gate`, `mix`")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.as_str().unwrap().contains("none option")),
        "{notes:?}"
    );

    // think_mode "always" needs AutoThink: refused, naming the field.
    let always = post(
        &server,
        &json!({"state": "s", "questions": {"q": questions["noul_default"]}, "think_mode": "always"}),
    );
    assert_eq!(always.status, 422);
    assert_eq!(always.locs()[0], ["body", "think_mode"]);
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

fn multipart(boundary: &str, parts: &[(&str, &str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, content_type, data) in parts {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: {content_type}\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    body
}

/// One hostile or malformed request and what the server must answer.
struct Case {
    name: &'static str,
    content_type: &'static str,
    encoding: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
    /// The `loc` of the first detail entry.
    loc: Vec<String>,
}

fn case(name: &'static str, body: impl Into<Vec<u8>>, status: u16, loc: &[&str]) -> Case {
    let loc = loc.iter().map(|s| s.to_string()).collect();
    Case {
        name,
        content_type: "application/json",
        encoding: None,
        body: body.into(),
        status,
        loc,
    }
}

fn hostile_cases() -> Vec<Case> {
    let q = r#""questions": {"q": {"type": "noul", "instructions": "Is it?"}}"#;
    let with = |extra: &str| format!(r#"{{"state": "s", {q}, {extra}}}"#);
    let question = |spec: &str| format!(r#"{{"state": "s", "questions": {{"q": {spec}}}}}"#);
    let options = |n: usize| {
        (0..n)
            .map(|i| format!("\"o{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let levels = |n: usize| {
        (0..n)
            .map(|i| format!("\"level {i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let valid = format!(r#"{{"state": "s", {q}}}"#);
    let image = r#""iVBORw0KGgo=""#;
    let asset_json = format!(
        r#"{{"state": "<image:1>", {q}, "assets": {{"<image:1>": {{"type": "image", "part": "asset-0"}}}}}}"#
    );
    // One row a refused request: rows alike in shape differ in the body and the `loc` they expect,
    // and each stays whole so that a failure names one case.
    let mut cases = vec![
        case(
            "truncated JSON",
            r#"{"state": "s", "questions": {"#,
            422,
            &["body", "29"],
        ),
        case("empty body", "", 422, &["body", "0"]),
        case("not an object", "[1, 2]", 422, &["body"]),
        case("a bare string", r#""hello""#, 422, &["body"]),
        case("null", "null", 422, &["body"]),
        case(
            "trailing garbage",
            format!("{valid} x"),
            422,
            &["body", &(valid.len() + 1).to_string()],
        ),
        case(
            "invalid UTF-8",
            b"{\"state\": \"\xff\xfe\", \"questions\": {}}".to_vec(),
            422,
            &["body", "11"],
        ),
        // A lone surrogate escape is JSON but not text: refused with the field that holds it.
        case(
            "lone surrogate in the state",
            r#"{"state": "a\ud800b", "questions": {"q1": {"type": "noul", "instructions": "Is it?"}}}"#,
            422,
            &["body", "state"],
        ),
        case(
            "lone surrogate in instructions",
            r#"{"state": "s", "questions": {"q1": {"type": "noul", "instructions": "Is \udc00 it?"}}}"#,
            422,
            &["body", "questions", "q1", "instructions"],
        ),
        case(
            "lone surrogate in a criterion key",
            r#"{"state": "s", "questions": {"q1": {"type": "choice", "instructions": "x", "criteria": {"\ud83d": null, "b": null}}}}"#,
            422,
            &["body", "questions", "q1", "criteria"],
        ),
        // `{"state": ` is 10 characters; the 512th `[` (index 521) opens level 513, one past the limit.
        case(
            "deep nesting",
            format!(r#"{{"state": {}, {q}}}"#, "[".repeat(100_000)),
            422,
            &["body", "521"],
        ),
        case("missing state", format!("{{{q}}}"), 422, &["body", "state"]),
        case(
            "missing questions",
            r#"{"state": "s"}"#,
            422,
            &["body", "questions"],
        ),
        case(
            "questions a list",
            r#"{"state": "s", "questions": ["a"]}"#,
            422,
            &["body", "questions"],
        ),
        case(
            "no questions",
            r#"{"state": "s", "questions": {}}"#,
            422,
            &["body", "questions"],
        ),
        case(
            "question a string",
            question(r#""why?""#),
            422,
            &["body", "questions", "q"],
        ),
        case(
            "question without type",
            question(r#"{"instructions": "x"}"#),
            422,
            &["body", "questions", "q", "type"],
        ),
        case(
            "type a number",
            question(r#"{"type": 3}"#),
            422,
            &["body", "questions", "q", "type"],
        ),
        case(
            "unknown type",
            question(r#"{"type": "essay", "instructions": "x"}"#),
            422,
            &["body", "questions", "q", "type"],
        ),
        case(
            "box question",
            question(r#"{"type": "box", "instructions": "x"}"#),
            422,
            &["body", "questions", "q", "type"],
        ),
        case(
            "empty instructions",
            question(r#"{"type": "choice", "instructions": "", "criteria": ["a", "b"]}"#),
            422,
            &["body", "questions", "q", "instructions"],
        ),
        case(
            "blank instructions",
            question(r#"{"type": "score", "instructions": "  \n ", "criteria": ["a", "b"]}"#),
            422,
            &["body", "questions", "q", "instructions"],
        ),
        case(
            "instructions a number",
            question(r#"{"type": "choice", "instructions": 5, "criteria": ["a", "b"]}"#),
            422,
            &["body", "questions", "q", "instructions"],
        ),
        case(
            "instructions and question",
            question(r#"{"type": "noul", "instructions": "a", "question": "b"}"#),
            422,
            &["body", "questions", "q", "question"],
        ),
        case(
            "choice without criteria",
            question(r#"{"type": "choice", "instructions": "x"}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "choice with no options",
            question(r#"{"type": "choice", "instructions": "x", "criteria": {}}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "criteria a number",
            question(r#"{"type": "choice", "instructions": "x", "criteria": 7}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "duplicate ids",
            question(r#"{"type": "choice", "instructions": "x", "criteria": ["a", "a"]}"#),
            422,
            &["body", "questions", "q", "criteria", "1"],
        ),
        case(
            "empty id",
            question(
                r#"{"type": "choice", "instructions": "x", "criteria": {"": "nothing", "b": "b"}}"#,
            ),
            422,
            &["body", "questions", "q", "criteria", ""],
        ),
        case(
            "id with a newline",
            question(r#"{"type": "choice", "instructions": "x", "criteria": ["a\nb", "c"]}"#),
            422,
            &["body", "questions", "q", "criteria", "0"],
        ),
        case(
            "id of 201 characters",
            question(&format!(
                r#"{{"type": "choice", "instructions": "x", "criteria": ["{}", "b"]}}"#,
                "i".repeat(201)
            )),
            422,
            &["body", "questions", "q", "criteria", "0"],
        ),
        case(
            "id not a string",
            question(r#"{"type": "choice", "instructions": "x", "criteria": ["a", 2]}"#),
            422,
            &["body", "questions", "q", "criteria", "1"],
        ),
        case(
            "2001 options",
            question(&format!(
                r#"{{"type": "choice", "instructions": "x", "criteria": [{}]}}"#,
                options(2001)
            )),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "noul key maybe",
            question(r#"{"type": "noul", "instructions": "x", "criteria": {"maybe": "?"}}"#),
            422,
            &["body", "questions", "q", "criteria", "maybe"],
        ),
        case(
            "noul criteria a list",
            question(r#"{"type": "noul", "instructions": "x", "criteria": ["yes", "no"]}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        // Criteria of the wrong size or kind, one case each: a table of bodies and the field path each
        // 422 must name (alike by design).
        case(
            "score of one level",
            question(r#"{"type": "score", "instructions": "x", "criteria": ["only"]}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "score of 11 levels",
            question(&format!(
                r#"{{"type": "score", "instructions": "x", "criteria": [{}]}}"#,
                levels(11)
            )),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "score of 27 levels",
            question(&format!(
                r#"{{"type": "score", "instructions": "x", "criteria": [{}]}}"#,
                levels(27)
            )),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "score level null",
            question(r#"{"type": "score", "instructions": "x", "criteria": ["a", null, "c"]}"#),
            422,
            &["body", "questions", "q", "criteria", "1"],
        ),
        case(
            "score criteria a string",
            question(r#"{"type": "score", "instructions": "x", "criteria": "0-10"}"#),
            422,
            &["body", "questions", "q", "criteria"],
        ),
        case(
            "unknown question field",
            question(r#"{"type": "noul", "instructions": "x", "weight": 2}"#),
            422,
            &["body", "questions", "q", "weight"],
        ),
        case(
            "think_mode unknown",
            with(r#""think_mode": "sometimes""#),
            422,
            &["body", "think_mode"],
        ),
        case(
            "gate above 1",
            with(r#""gate": 1.5"#),
            422,
            &["body", "gate"],
        ),
        case(
            "mix a string",
            with(r#""mix": "half""#),
            422,
            &["body", "mix"],
        ),
        case(
            "think_budget negative",
            with(r#""think_budget": -1"#),
            422,
            &["body", "think_budget"],
        ),
        case(
            "think_budget huge",
            with(r#""think_budget": 1e400"#),
            422,
            &["body", "think_budget"],
        ),
        case(
            "none_check a string",
            with(r#""none_check": "yes""#),
            422,
            &["body", "none_check"],
        ),
        case(
            "model a number",
            with(r#""model": 5"#),
            422,
            &["body", "model"],
        ),
        case(
            "images not a list",
            with(&format!(r#""images": {image}"#)),
            422,
            &["body", "images"],
        ),
        case(
            "an image",
            with(&format!(r#""images": [{image}]"#)),
            422,
            &["body", "images"],
        ),
        case(
            "nine images",
            with(&format!(r#""images": [{}]"#, [image; 9].join(", "))),
            422,
            &["body", "images"],
        ),
        case(
            "assets inline",
            with(r#""assets": {"a": {"type": "image", "format": "png", "data_base64": "iVBO"}}"#),
            422,
            // Its placeholder is not in the state.
            &["body", "assets", "a"],
        ),
        case(
            "assets naming a part without multipart",
            with(r#""assets": {"a": {"part": "asset-0"}}"#),
            422,
            &["body", "assets", "a", "part"],
        ),
    ];
    let mut odd = |name, content_type, encoding, body: Vec<u8>, status, loc: &[&str]| {
        cases.push(Case {
            name,
            content_type,
            encoding,
            body,
            status,
            loc: loc.iter().map(|s| s.to_string()).collect(),
        })
    };
    odd(
        "text/plain",
        "text/plain",
        None,
        valid.clone().into_bytes(),
        415,
        &["header", "content-type"],
    );
    odd(
        "form encoded",
        "application/x-www-form-urlencoded",
        None,
        valid.clone().into_bytes(),
        415,
        &["header", "content-type"],
    );
    odd(
        "latin-1 JSON",
        "application/json; charset=latin-1",
        None,
        valid.clone().into_bytes(),
        415,
        &["header", "content-type"],
    );
    odd(
        "gzip",
        "application/json",
        Some("gzip"),
        valid.clone().into_bytes(),
        415,
        &["header", "content-encoding"],
    );
    odd(
        "bad zstd",
        "application/json",
        Some("zstd"),
        valid.clone().into_bytes(),
        400,
        &["body"],
    );
    let compressed = zstd(valid.as_bytes());
    odd(
        "truncated zstd",
        "application/json",
        Some("zstd"),
        compressed[..compressed.len() - 6].to_vec(),
        400,
        &["body"],
    );
    let mut flipped = zstd(valid.repeat(20).as_bytes());
    let last = flipped.len() - 1;
    flipped[last] ^= 0x55;
    odd(
        "zstd checksum",
        "application/json",
        Some("zstd"),
        flipped,
        400,
        &["body"],
    );
    odd(
        "zstd of invalid JSON",
        "application/json",
        Some("zstd"),
        zstd(b"{nope"),
        422,
        &["body", "1"],
    );
    odd(
        "multipart without boundary",
        "multipart/form-data",
        None,
        valid.clone().into_bytes(),
        400,
        &["body"],
    );
    odd(
        "multipart garbage",
        "multipart/form-data; boundary=xyz",
        None,
        b"garbage".to_vec(),
        400,
        &["body"],
    );
    let unclosed = multipart("xyz", &[("request", "application/json", valid.as_bytes())]);
    odd(
        "multipart unclosed",
        "multipart/form-data; boundary=xyz",
        None,
        unclosed[..unclosed.len() - 9].to_vec(),
        400,
        &["body"],
    );
    odd(
        "multipart without request",
        "multipart/form-data; boundary=xyz",
        None,
        multipart("xyz", &[("asset-0", "image/png", b"\x89PNG")]),
        400,
        &["body", "request"],
    );
    odd(
        "multipart request not JSON",
        "multipart/form-data; boundary=xyz",
        None,
        multipart("xyz", &[("request", "application/json", b"{oops")]),
        422,
        &["body", "1"],
    );
    odd(
        "multipart unclaimed part",
        "multipart/form-data; boundary=xyz",
        None,
        multipart(
            "xyz",
            &[
                ("request", "application/json", valid.as_bytes()),
                ("extra", "image/png", b"\x89PNG"),
            ],
        ),
        422,
        &["body", "assets"],
    );
    odd(
        "multipart image (the SDK's form)",
        "multipart/form-data; boundary=xyz",
        None,
        multipart(
            "xyz",
            &[
                ("request", "application/json", asset_json.as_bytes()),
                ("asset-0", "image/png", b"\x89PNG\r\n"),
            ],
        ),
        422,
        &["body", "images"],
    );
    odd(
        "zstd multipart image",
        "multipart/form-data; boundary=xyz",
        Some("zstd"),
        zstd(&multipart(
            "xyz",
            &[
                ("request", "application/json", asset_json.as_bytes()),
                ("asset-0", "image/png", b"\x89PNG"),
            ],
        )),
        422,
        &["body", "images"],
    );
    cases
}

#[test]
fn hostile_bodies_get_the_right_status_and_field_and_the_server_keeps_serving() {
    let server = Server::start(&[]);
    let valid =
        br#"{"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}"#;
    let reference = server.post_json("/v1/systemone", valid);
    assert_eq!(reference.status, 200);
    let cases = hostile_cases();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    for case in &cases {
        let mut headers = vec![("Content-Type", case.content_type)];
        if let Some(encoding) = case.encoding {
            headers.push(("Content-Encoding", encoding));
        }
        let reply = send(server.addr, "POST", "/v1/systemone", &headers, &case.body);
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, case.status, "{}: {text}", case.name);
        let body = reply.json();
        assert!(
            body["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{}: {text}",
            case.name
        );
        assert!(
            reply.header("x-typesafe-request-id").is_some(),
            "{}",
            case.name
        );
        if reply.status != 422 {
            // Not a validation failure: the reference API's other shape.
            assert!(
                body["detail"]["error_type"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                    && body["detail"]["message"]
                        .as_str()
                        .is_some_and(|m| !m.is_empty()),
                "{}: {text}",
                case.name
            );
            continue;
        }
        assert_eq!(reply.locs()[0], case.loc, "{}: {text}", case.name);
        for detail in body["detail"].as_array().unwrap() {
            assert!(
                detail["msg"].is_string() && detail["type"].is_string(),
                "{}: {text}",
                case.name
            );
        }
    }
    // Still serving, with the same answer as before.
    let after = server.post_json("/v1/systemone", valid);
    assert_eq!(after.answer_bytes(), reference.answer_bytes());

    // An unknown top-level field is ignored (as the reference API does) and said so in `x_notes`.
    let extra = server.post_json(
        "/v1/systemone",
        br#"{"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}, "temperature": 0.5}"#,
    );
    assert_eq!(extra.status, 200);
    assert_eq!(extra.answer_bytes(), reference.answer_bytes());
    assert_eq!(
        extra.json()["x_notes"],
        json!(["unknown field `temperature` ignored"])
    );

    // 27 options is a wide choice, not an error: every option gets a probability.
    let wide = (0..27)
        .map(|i| format!("\"o{i}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let wide = format!(
        r#"{{"state": "s", "questions": {{"q": {{"type": "choice", "instructions": "x", "criteria": [{wide}]}}}}}}"#
    );
    let reply = server.post_json("/v1/systemone", wide.as_bytes());
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json()["answers"]["q"]["probabilities"]
            .as_object()
            .unwrap()
            .len(),
        27
    );

    // zstd and a multipart body holding only the request answer like plain JSON.
    let zstd_reply = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[
            ("Content-Type", "application/json"),
            ("Content-Encoding", "zstd"),
        ],
        &zstd(valid),
    );
    assert_eq!(zstd_reply.answer_bytes(), reference.answer_bytes());
    let multipart_reply = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[("Content-Type", "multipart/form-data; boundary=\"b;1\"")],
        &multipart("b;1", &[("request", "application/json", valid)]),
    );
    assert_eq!(multipart_reply.answer_bytes(), reference.answer_bytes());
    let stats = server.get("/stats").json();
    assert_eq!(stats["requests"]["decisions"], 6);
}

#[test]
fn body_size_limits() {
    let server = Server::start(&["--max-body-bytes", "1000000"]);
    let big = vec![b' '; 10 << 20];
    let started = Instant::now();
    // Declared too large: refused before the body is read.
    let declared = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json")],
        &big,
    );
    declared.assert_status(413);
    assert_eq!(declared.error_type(), "too_large");
    // No length given (chunked): refused once the limit is passed.
    let chunked = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ],
        &big,
    );
    assert_eq!(chunked.status, 413);
    // A small zstd body that inflates past the limit (a zstd bomb).
    let bomb = zstd(&big);
    assert!(bomb.len() < 10_000, "{}", bomb.len());
    let inflated = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[
            ("Content-Type", "application/json"),
            ("Content-Encoding", "zstd"),
        ],
        &bomb,
    );
    assert_eq!(inflated.status, 413);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let ok = server.post_json(
        "/v1/systemone",
        br#"{"state": "s", "questions": {"q": {"type": "noul"}}}"#,
    );
    assert_eq!(ok.status, 200);
}

#[test]
fn thirty_two_concurrent_clients_get_exactly_their_sequential_answers() {
    let server = Server::start(&[]);
    let bodies: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            serde_json::to_vec(&json!({
                "state": format!("Ticket {i}: the order arrived {} days late.", i * 3),
                "questions": {
                    "team": {"type": "choice", "instructions": "Which team?", "criteria": ["shipping", "billing", "sales"]},
                    "late": {"type": "noul", "instructions": "Was it late?"},
                    "upset": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]},
                },
            }))
            .unwrap()
        })
        .collect();
    let sequential: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| server.post_json("/v1/systemone", b).answer_bytes().to_vec())
        .collect();
    assert!(
        sequential.windows(2).all(|w| w[0] != w[1]),
        "the four requests differ"
    );
    let addr = server.addr;
    let clients: Vec<_> = (0..32)
        .map(|client| {
            let bodies = bodies.clone();
            std::thread::spawn(move || {
                (0..2)
                    .map(|round| {
                        let which = (client + round) % bodies.len();
                        let reply = send(
                            addr,
                            "POST",
                            "/v1/systemone",
                            &[("Content-Type", "application/json")],
                            &bodies[which],
                        );
                        assert_eq!(reply.status, 200);
                        (
                            which,
                            reply.answer_bytes().to_vec(),
                            reply.header("x-typesafe-request-id").unwrap().to_string(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for client in clients {
        for (which, bytes, id) in client.join().expect("client thread") {
            assert_eq!(
                bytes, sequential[which],
                "request {which} under concurrency"
            );
            assert!(ids.insert(id), "request ids are unique");
        }
    }
    assert_eq!(ids.len(), 64);
    let stats = server.get("/stats").json();
    assert_eq!(stats["requests"]["decisions"], 68);
}

#[test]
fn api_key() {
    let server = Server::start(&["--api-key", "s3cret"]);
    let body = br#"{"state": "s", "questions": {"q": {"type": "noul"}}}"#;
    let json = ("Content-Type", "application/json");
    let missing = send(server.addr, "POST", "/v1/systemone", &[json], body);
    assert_eq!(missing.status, 401);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    assert_eq!(missing.error_type(), "authentication_error");
    assert_eq!(
        send(
            server.addr,
            "POST",
            "/v1/systemone",
            &[json, ("Authorization", "Bearer wrong")],
            body
        )
        .status,
        401
    );
    assert_eq!(
        send(
            server.addr,
            "POST",
            "/v1/systemone",
            &[json, ("Authorization", "s3cret")],
            body
        )
        .status,
        401
    );
    assert_eq!(send(server.addr, "GET", "/v1/models", &[], b"").status, 401);
    assert_eq!(send(server.addr, "GET", "/stats", &[], b"").status, 401);
    assert_eq!(
        server.get("/health").status,
        200,
        "health checks need no key"
    );
    let ok = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[json, ("Authorization", "Bearer s3cret")],
        body,
    );
    assert_eq!(ok.status, 200);
    assert!(server.stdout.lock().unwrap().contains("API key required"));

    // The key can come from PRISM_API_KEY.
    let from_env = Server::start_with_env(&[], &[("PRISM_API_KEY", "k3y")]);
    assert_eq!(
        send(from_env.addr, "POST", "/v1/systemone", &[json], body).status,
        401
    );
    assert_eq!(
        send(
            from_env.addr,
            "POST",
            "/v1/systemone",
            &[json, ("Authorization", "Bearer k3y")],
            body
        )
        .status,
        200
    );
}

/// A request whose prompt is long enough to keep the tiny model busy for a while (~3,000 tokens).
fn slow_body() -> Vec<u8> {
    serde_json::to_vec(
        &json!({"state": "word ".repeat(3000), "questions": {"q": {"type": "noul", "instructions": "Busy?"}}}),
    )
    .unwrap()
}

#[test]
fn full_queue_timeout_and_prompt_limit() {
    // One request computing, one waiting: the rest are told to come back.
    let server = Server::start(&["--queue-size", "1"]);
    let addr = server.addr;
    let clients: Vec<_> = (0..6)
        .map(|_| {
            std::thread::spawn(move || {
                send(
                    addr,
                    "POST",
                    "/v1/systemone",
                    &[("Content-Type", "application/json")],
                    &slow_body(),
                )
            })
        })
        .collect();
    let replies: Vec<Reply> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let busy: Vec<&Reply> = replies.iter().filter(|r| r.status == 503).collect();
    assert!(
        !busy.is_empty(),
        "statuses {:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 503));
    assert!(replies.iter().filter(|r| r.status == 200).count() >= 1);
    for reply in busy {
        assert_eq!(reply.header("retry-after"), Some("1"));
        assert_eq!(reply.header("retry-after-ms"), Some("1000"));
        assert_eq!(reply.error_type(), "overloaded");
    }
    let stats = server.get("/stats").json();
    assert!(stats["requests"]["rejected_queue_full"].as_u64().unwrap() >= 1);
    assert_eq!(stats["queue"]["capacity"], 1);

    // A request that outlives --timeout gets 504; the server goes on.
    let server = Server::start(&["--timeout", "0.2", "--max-tokens", "3500"]);
    let late = server.post_json("/v1/systemone", &slow_body());
    late.assert_status(504);
    assert_eq!(late.error_type(), "timeout");
    // A prompt beyond --max-tokens is refused before any model work (once the abandoned request is done).
    let started = Instant::now();
    while server.get("/stats").json()["queue"]["running"] != 0 {
        assert!(started.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(10));
    }
    let long = server.post_json(
        "/v1/systemone",
        &serde_json::to_vec(
            &json!({"state": "word ".repeat(4000), "questions": {"q": {"type": "noul"}}}),
        )
        .unwrap(),
    );
    long.assert_status(422);
    assert_eq!(long.locs()[0], ["body", "questions", "q"]);
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.get("/stats").json()["requests"]["timed_out"], 1);
}

#[test]
fn sigterm_finishes_the_request_in_flight() {
    let mut server = Server::start(&[]);
    let addr = server.addr;
    let in_flight = std::thread::spawn(move || {
        send(
            addr,
            "POST",
            "/v1/systemone",
            &[("Content-Type", "application/json")],
            &slow_body(),
        )
    });
    let started = Instant::now();
    while server.get("/stats").json()["queue"]["running"] != 1 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.sigterm();
    let reply = in_flight.join().unwrap();
    reply.assert_status(200);
    assert!(reply.json()["answers"]["q"]["noul"].is_number());
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status}\n{}", server.output());
    let stdout = server.stdout.lock().unwrap().clone();
    assert!(
        stdout.contains("Shutting down") && stdout.contains("Stopped."),
        "{stdout}"
    );
}

#[test]
fn flag_errors() {
    for (args, expected) in [
        (vec!["--model-dir", "/tmp"], "--model-dir needs --gguf"),
        (vec!["--gate", "2"], "--gate must be from 0 to 1"),
        (vec!["--queue-size", "0"], "--queue-size must be at least 1"),
        (vec!["--precision", "f17"], "f17"),
        (vec!["--gguf", "/nonexistent.gguf"], "/nonexistent.gguf"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_prism"))
            .arg("serve")
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    // The rule that makes --max-tokens and --timeout agree is in the help (issue #26).
    let help = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for rule in [
        "even when the pass that finishes it ends just after",
        "stops at the engine's first step after the deadline",
        "It is not derived from --timeout",
    ] {
        assert!(
            help.split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .contains(rule),
            "{rule}: {help}"
        );
    }
}
