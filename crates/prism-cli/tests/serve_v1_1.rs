//! `prism serve` with the v1.1 families on the bundled demo model, over real sockets: AutoThink's
//! thoughts end to end (`--demo v1.1`), the none option and `allow_none`, Instant (`--demo instant`),
//! and what the official TypeSafe SDK sees of them (`tests/sdk/check_sdk_v1_1.py`).

mod common;
mod serve_common;

use common::probabilities;
use serde_json::{json, Value};
use serve_common::{repo_path, run_sdk_check, venv_program, Server};

fn post(server: &Server, body: &Value) -> serve_common::Reply {
    server.post_json("/v1/systemone", &serde_json::to_vec(body).unwrap())
}

/// The answers without their `x_details` (which carry timings).
fn without_details(answers: &Value) -> Value {
    let mut answers = answers.clone();
    if let Some(map) = answers.as_object_mut() {
        for answer in map.values_mut() {
            if let Some(answer) = answer.as_object_mut() {
                answer.remove("x_details");
            }
        }
    }
    answers
}

fn questions() -> Value {
    json!({
        "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                 "criteria": {"billing": "Payments and invoices", "technical": "Bugs and outages", "sales": null}},
        "urgent": {"type": "noul", "instructions": "Does this ticket need a reply today?"},
        "mood": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry"]},
    })
}

#[test]
fn demo_v1_1_thinks_end_to_end() {
    let server = Server::start(&["--demo", "v1.1"]);
    let models = server.get("/v1/models").json();
    let model = &models["models"][0];
    assert_eq!(model["family"], "v1.1");

    assert_eq!(model["supports"]["thoughts"], true);
    assert_eq!(model["supports"]["think_mode"]["always"], "yes");

    let request = json!({
        "state": "I was charged twice for my March invoice and the app says my card is declined.",
        "questions": questions(),
        "think_mode": "always", "return_thought": true, "return_details": true,
    });
    let reply = post(&server, &request);
    reply.assert_status(200);
    let body = reply.json();
    let mut thought_tokens = 0;
    for name in ["team", "urgent", "mood"] {
        let answer = &body["answers"][name];
        assert!(answer["thought"].is_string(), "{answer}");
        let details = &answer["x_details"];
        let tokens = details["thought_tokens"].as_u64().expect("thought_tokens");
        // The demo's default think_budget is 64.
        assert!((1..=64).contains(&tokens), "{details}");
        thought_tokens += tokens;
        assert!(
            [
                "end_of_thought",
                "end_of_sequence",
                "budget",
                "loop",
                "length"
            ]
            .contains(&details["stop_reason"].as_str().unwrap()),
            "{details}"
        );
        assert!(details["after_thought"].is_object(), "{details}");
        for key in ["queue_ms", "read_ms", "thought_ms", "total_ms"] {
            assert!(
                details["timings"][key].as_f64().unwrap() >= 0.0,
                "{details}"
            );
        }
    }
    assert_eq!(body["usage"]["output_tokens"], thought_tokens);
    // Every field of these answers is in /openapi.json's schemas.
    let doc = server.get("/openapi.json").json();
    let schemas = &doc["components"]["schemas"];
    for (name, schema) in [
        ("team", "ChoiceAnswer"),
        ("urgent", "NoulAnswer"),
        ("mood", "ScoreAnswer"),
    ] {
        let answer = body["answers"][name].as_object().unwrap();
        for key in answer.keys() {
            assert!(
                schemas[schema]["properties"].get(key).is_some(),
                "{schema} lacks {key}"
            );
        }
        for key in answer["x_details"].as_object().unwrap().keys() {
            assert!(
                schemas["AnswerDetails"]["properties"].get(key).is_some(),
                "AnswerDetails lacks {key}"
            );
        }
    }
    assert!(body["answers"]["team"]["none_probability"].is_f64());
    // No note: a v1.1 model honours every setting sent.
    assert!(body.get("x_notes").is_none(), "{body}");

    // The same request again: the same thoughts and answers.
    let again = post(&server, &request).json();
    assert_eq!(
        without_details(&again["answers"]),
        without_details(&body["answers"])
    );

    // Thoughts counted in /stats.
    let stats = server.get("/stats").json();
    assert_eq!(stats["thoughts"]["finished"], 6, "{}", stats["thoughts"]);
    assert_eq!(stats["thoughts"]["tokens"], 2 * thought_tokens);

    // And in /metrics.
    let metrics = String::from_utf8(server.get("/metrics").body).unwrap();
    assert!(metrics.contains("prism_thoughts_finished 6"), "{metrics}");
    assert!(
        metrics.contains(&format!("prism_thought_tokens {}", 2 * thought_tokens)),
        "{metrics}"
    );
    assert!(metrics.contains("prism_thought_steps_total"), "{metrics}");

    // auto with gate 0: no question is below it, so nothing thinks.
    let never = post(
        &server,
        &json!({"state": "s", "questions": questions(), "think_mode": "auto", "gate": 0.0}),
    )
    .json();
    assert_eq!(never["usage"]["output_tokens"], 0);
    assert!(never["answers"]["team"].get("thought").is_none());
}

/// A choice question this server answers with a null choice: the state, instructions and criteria.
fn find_null_choice(server: &Server) -> (String, String, Value) {
    let criteria = json!({"billing": "Payments and invoices", "technical": "Bugs and outages"});
    for i in 0..40 {
        let state = format!("Ticket {i}: the customer writes about something else entirely.");
        let instructions = format!("Which team should handle ticket {i}?");
        let body = json!({"state": state, "think_mode": "never",
            "questions": {"pick": {"type": "choice", "instructions": instructions, "criteria": criteria}}});
        let answer = post(server, &body).json()["answers"]["pick"].clone();
        if answer["choice"].is_null() {
            return (state, instructions, criteria);
        }
    }
    panic!("no null choice in 40 questions of the demo model");
}

#[test]
fn the_none_option_and_allow_none_over_http() {
    let server = Server::start(&["--demo", "v1.1"]);
    let mut nulls = 0;
    for i in 0..12 {
        let body = json!({"state": format!("Case {i}: a parcel went missing."), "think_mode": "never",
            "questions": {"pick": {"type": "choice", "instructions": "Who should act?",
                                   "criteria": ["courier", "warehouse", "customer"]}}});
        let answer = post(&server, &body).json()["answers"]["pick"].clone();
        let none = answer["none_probability"]
            .as_f64()
            .expect("none_probability");
        let listed = probabilities(&answer);
        assert!(
            (listed.iter().sum::<f64>() + none - 1.0).abs() < 1e-9,
            "{answer}"
        );
        let most = listed.iter().copied().fold(0.0, f64::max);
        // allow_none is on by default: null exactly when none beats every listed option.
        assert_eq!(answer["choice"].is_null(), none > most, "{answer}");
        nulls += usize::from(answer["choice"].is_null());
        // allow_none off: a listed option, the same probabilities.
        let mut listed_only = body.clone();
        listed_only["allow_none"] = json!(false);
        let other = post(&server, &listed_only).json()["answers"]["pick"].clone();
        assert!(other["choice"].is_string(), "{other}");
        assert_eq!(other["probabilities"], answer["probabilities"]);
        // none_check off: no none option.
        let mut no_none = body.clone();
        no_none["none_check"] = json!(false);
        let plain = post(&server, &no_none).json()["answers"]["pick"].clone();
        assert!(plain.get("none_probability").is_none(), "{plain}");
        let sum: f64 = probabilities(&plain).iter().sum();
        assert!((sum - 1.0).abs() < 1e-9);
    }
    eprintln!("{nulls} of 12 null choices");
    // The server default (`--allow-none false`) applies to requests that give none.
    let (state, instructions, criteria) = find_null_choice(&server);
    drop(server);
    let server = Server::start(&["--demo", "v1.1", "--allow-none", "false"]);
    let body = json!({"state": state, "think_mode": "never",
        "questions": {"pick": {"type": "choice", "instructions": instructions, "criteria": criteria}}});
    let answer = post(&server, &body).json()["answers"]["pick"].clone();
    assert!(answer["choice"].is_string(), "{answer}");
}

#[test]
fn demo_instant_reads_both_orders() {
    let server = Server::start(&["--demo", "instant"]);
    let model = server.get("/v1/models").json()["models"][0].clone();
    assert_eq!(model["family"], "v1.1-instant");
    assert_eq!(model["supports"]["both_orders"], true);
    let body = json!({"state": "s", "questions": questions(), "return_details": true});
    let reply = post(&server, &body).json();
    for name in ["team", "urgent", "mood"] {
        assert_eq!(reply["answers"][name]["x_details"]["prompts"], 2, "{reply}");
    }
    assert!(reply["answers"]["team"]["none_probability"].is_f64());
    let always = post(
        &server,
        &json!({"state": "s", "questions": questions(), "think_mode": "always"}),
    );
    assert_eq!(always.status, 422);
    assert_eq!(always.locs()[0], ["body", "think_mode"]);
    // --demo is for the demo model only.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["serve", "--port", "0", "--demo", "v1", "--gguf"])
        .arg(repo_path("tests/fixtures/qwen35-tiny/tiny-Q8_0.gguf"))
        .output()
        .expect("run prism serve");
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--demo chooses the family"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn what_the_typesafe_sdk_sees_of_v1_1() {
    let Some(python) = venv_program(
        "python",
        &["-c", "import typesafe_sdk"],
        "the TypeSafe SDK virtualenv",
    ) else {
        return;
    };
    let server = Server::start(&["--demo", "v1.1"]);
    let (state, instructions, criteria) = find_null_choice(&server);
    let report = run_sdk_check(
        &python,
        "check_sdk_v1_1.py",
        &server,
        "unused",
        &[
            ("NULL_STATE", state),
            ("NULL_INSTRUCTIONS", instructions),
            ("NULL_CRITERIA", criteria.to_string()),
        ],
    );
    // What the README says: a null choice fails the SDK's validation.
    let error = report["null_choice_error"].as_str().unwrap();
    eprintln!(
        "typesafe-sdk on a null choice: {error}: {}",
        report["null_choice_message"]
    );
    assert!(
        report["null_choice_message"]
            .as_str()
            .unwrap()
            .contains("choice"),
        "{report}"
    );
}

/// The v1.1 demo reads images with its bundled tower (`tests/fixtures/qwen35-tiny/vision/`); the v1 demo
/// has none.
#[test]
fn the_v1_1_demo_reads_images() {
    let server = Server::start(&["--demo", "v1.1"]);
    let models = server.get("/v1/models").json();
    let images = models["models"][0]["supports"]["images"].as_str().unwrap();
    assert!(images.starts_with("yes"), "{models}");
    // The README's image example answers, its
    // usage counting the image's 70 tokens (96 × 64 pixels resized to 320 × 224) in every prompt.
    let readme = std::fs::read_to_string(repo_path("README.md")).unwrap();
    assert!(readme.lines().any(|l| l.starts_with("curl ")
        && l.contains("/v1/systemone")
        && l.contains("-d @examples/image-request.json")));
    let image_request = std::fs::read(repo_path("examples/image-request.json")).unwrap();
    let reply = server.post_json("/v1/systemone", &image_request);
    reply.assert_status(200);
    let mut plain: Value = serde_json::from_slice(&image_request).unwrap();
    plain.as_object_mut().unwrap().remove("images");
    let state = plain["state"].as_str().unwrap().replace("<image>", "");
    plain["state"] = json!(state);
    let without = post(&server, &plain).json();
    let with = reply.json();
    assert!(
        with["usage"]["input_tokens"].as_u64().unwrap()
            >= without["usage"]["input_tokens"].as_u64().unwrap() + 2 * 70,
        "two questions, each reading the image's 70 pads: {with} / {without}"
    );
    assert_ne!(with["answers"], without["answers"], "the image is read");
    let v1 = Server::start(&["--demo", "v1"]);
    assert_eq!(v1.post_json("/v1/systemone", &image_request).status, 422);
}
