//! The official TypeSafe Python SDK (`typesafe-sdk`, unchanged) against `prism serve`: choice, noul and
//! score questions through the sync and async clients, zstd-compressed bodies, multipart images, typed
//! errors (`tests/sdk/check_sdk.py`). The answers the SDK received must be exactly those a plain JSON request
//! over a socket gets for the same request.
//!
//! The SDK lives in a virtualenv that `.ci/run` creates (`target/typesafe-sdk-venv`, or `PRISM_SDK_PYTHON`
//! naming its python). Without it the test is skipped with a message, except under `CI=true`, where a
//! missing SDK is a failure.

mod serve_common;

use std::path::PathBuf;

use serde_json::json;
use serve_common::{repo_path, run_sdk_check, send, Server};

fn sdk_python() -> Option<PathBuf> {
    let python = std::env::var_os("PRISM_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_path("target/typesafe-sdk-venv/bin/python"));
    python.is_file().then_some(python)
}

#[test]
fn the_typesafe_python_sdk_works_unchanged() {
    let Some(python) = sdk_python() else {
        let message =
            "the TypeSafe SDK virtualenv (target/typesafe-sdk-venv, made by .ci/run) is missing";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{message}: CI must run the SDK test");
        }
        eprintln!("SKIPPED serve_sdk: {message}; run `bash .ci/run` (or set PRISM_SDK_PYTHON) to include it");
        return;
    };
    let server = Server::start(&["--api-key", "sdk-test-key"]);
    let report = run_sdk_check(
        &python,
        "check_sdk.py",
        &server,
        "sdk-test-key",
        &[("PRISM_EXPECTED_MODEL", "Qwen35 Tiny".to_string())],
    );

    // The same request as plain JSON (what the SDK sends, uncompressed): the same answers.
    let criteria =
        json!({"billing": "Payments and invoices", "technical": "Bugs and outages", "sales": null});
    let request = json!({
        "state": report["state"],
        "model": "jev-latest",
        "questions": {
            "team": {"type": "choice", "instructions": "Which team should handle this ticket?", "criteria": criteria},
            "urgent": {"type": "noul", "instructions": "Does this ticket need a reply today?"},
            "mood": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry"]},
        },
    });
    let reply = send(
        server.addr,
        "POST",
        "/v1/systemone",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", "Bearer sdk-test-key"),
        ],
        &serde_json::to_vec(&request).unwrap(),
    );
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["answers"], report["answers"]);

    // What the server saw: the SDK's calls (sync, uncompressed, 4 async) answered, and its refusals.
    let stats = send(
        server.addr,
        "GET",
        "/stats",
        &[("Authorization", "Bearer sdk-test-key")],
        b"",
    )
    .json();
    assert_eq!(stats["requests"]["decisions"], 7, "{stats}");
    assert_eq!(stats["requests"]["by_status"]["422"], 3, "{stats}");
}
