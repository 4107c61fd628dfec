//! Images over HTTP: a real `prism serve` of the vision fixture (`tests/fixtures/qwen35-vl-tiny`, its
//! mmproj found in --model-dir) answers requests with images (base64 and data URIs, placed first or by
//! `<image>` marks) with the same bytes alone and concurrently, and refuses each bad input with its
//! status and field path; a model served without an mmproj says so (422).

mod serve_common;

use base64::Engine as _;
use serde_json::{json, Value};
use serve_common::{repo_path, Server};

fn vl(file: &str) -> String {
    repo_path(&format!("tests/fixtures/qwen35-vl-tiny/{file}"))
        .display()
        .to_string()
}

fn image(file: &str) -> String {
    let bytes = std::fs::read(vl(&format!("images/{file}"))).expect("fixture image");
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn start() -> Server {
    let gguf = vl("tiny-vl-BF16.gguf");
    let dir = vl("");
    Server::start(&["--gguf", &gguf, "--model-dir", &dir, "--precision", "f32"])
}

fn body(state: &str, images: Vec<String>) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "state": state,
        "images": images,
        "questions": {
            "busy": {"type": "noul", "instructions": "Is the dock in use?"},
            "what": {"type": "choice", "instructions": "What does it show?", "criteria": ["a truck", "a person", "nothing"]},
        },
    }))
    .unwrap()
}

#[test]
fn images_are_answered_over_http() {
    let server = start();
    assert!(
        server.output().contains("vision tower"),
        "{}",
        server.output()
    );
    let square = image("square_256x256.png");
    let wide = format!("data:image/jpeg;base64,{}", image("wide_640x360.jpg"));
    let bodies = [
        body("A photo from the dock.", vec![square.clone()]),
        body(
            "Before <image> and after <image>.",
            vec![square.clone(), wide.clone()],
        ),
        body("", vec![wide.clone(), square.clone()]),
        body("Plain text evidence.", vec![]),
    ];
    let alone: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| {
            let reply = server.post_json("/v1/systemone", b);
            reply.assert_status(200);
            reply.answer_bytes().to_vec()
        })
        .collect();
    // Image tokens are counted: one 256×256 image is 64 of them in each of the two prompts.
    let reply = server.post_json("/v1/systemone", &bodies[0]);
    let text_only = server.post_json("/v1/systemone", &body("A photo from the dock.", vec![]));
    let tokens = |r: &serve_common::Reply| r.json()["usage"]["input_tokens"].as_u64().unwrap();
    assert!(tokens(&reply) >= tokens(&text_only) + 2 * 64);
    // Concurrently: the same bytes.
    let together: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let server = &server;
                s.spawn(move || server.post_json("/v1/systemone", b).answer_bytes().to_vec())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    let models = server.get("/v1/models").json();
    assert!(models.to_string().contains("yes: up to 8"), "{models}");
}

/// The status and the field path: a 422's first `loc`; a 400 (the reference API's
/// `detail.error_type` / `detail.message` shape) names the field at the start of its message, which
/// is turned back into a `loc` here.
fn refusal(server: &Server, body: &[u8]) -> (u16, Vec<String>) {
    let reply = server.post_json("/v1/systemone", body);
    if reply.status == 400 {
        let json = reply.json();
        let message = json["detail"]["message"].as_str().unwrap_or_default();
        let field = message.split(':').next().unwrap_or_default();
        let mut loc = vec!["body".to_string()];
        for part in field.split(['.', '[']) {
            loc.push(part.trim_end_matches(']').to_string());
        }
        return (400, loc);
    }
    let locs = reply.locs();
    (reply.status, locs.first().cloned().unwrap_or_default())
}

#[test]
fn bad_images_are_refused_over_http() {
    let server = start();
    let square = image("square_256x256.png");
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    // Bad base64.
    assert_eq!(
        refusal(&server, &body("x", vec![square.clone(), "%%%".into()])),
        (400, s(&["body", "images", "1"]))
    );
    // Bytes that are no image.
    let junk = base64::engine::general_purpose::STANDARD.encode(b"hello, this is not an image");
    assert_eq!(
        refusal(&server, &body("x", vec![junk])),
        (400, s(&["body", "images", "0"]))
    );
    // Too many images.
    assert_eq!(
        refusal(&server, &body("x", vec![square.clone(); 9])),
        (422, s(&["body", "images"]))
    );
    // Marks that do not match.
    assert_eq!(
        refusal(&server, &body("<image> <image>", vec![square.clone()])),
        (422, s(&["body", "state"]))
    );
    // An image whose header claims 40,000 × 40,000 pixels (a 1×1 PNG with its IHDR rewritten).
    let mut png = std::fs::read(vl("images/square_256x256.png")).unwrap();
    png[16..20].copy_from_slice(&40_000u32.to_be_bytes());
    png[20..24].copy_from_slice(&40_000u32.to_be_bytes());
    let crafted = base64::engine::general_purpose::STANDARD.encode(&png);
    let (status, loc) = refusal(&server, &body("x", vec![crafted]));
    assert_eq!(loc, s(&["body", "images", "0"]));
    assert!(status == 422 || status == 400, "{status}");
    // The server still answers.
    let reply = server.post_json("/v1/systemone", &body("x", vec![square]));
    assert_eq!(reply.status, 200);
}

#[test]
fn a_model_without_mmproj_refuses_images() {
    // The demo model has no vision tower.
    let server = Server::start(&[]);
    let reply = server.post_json(
        "/v1/systemone",
        &body("x", vec![image("square_256x256.png")]),
    );
    assert_eq!(reply.status, 422);
    assert_eq!(reply.locs()[0], ["body", "images"]);
    let text: Value = reply.json();
    assert!(text.to_string().contains("no vision tower"), "{text}");
}

/// The TypeSafe SDK's own image upload (`Image(bytes)` as the state: multipart/form-data with an asset
/// part), sync and async, answered as the same image sent as base64 in plain JSON, placed by a mark.
#[test]
fn the_typesafe_sdk_uploads_an_image() {
    // The virtualenv lookup every SDK test makes (serve_engine's metrics test too), each naming the
    // module it needs; without it the test returns early.
    let Some(python) = serve_common::venv_program(
        "python",
        &["-c", "import typesafe_sdk"],
        "the TypeSafe SDK virtualenv",
    ) else {
        return;
    };
    let server = start();
    let report = serve_common::run_sdk_check(
        &python,
        "check_sdk_images.py",
        &server,
        "unused",
        &[("PRISM_IMAGE", vl("images/square_256x256.png"))],
    );
    let plain = json!({
        "state": "<image>",
        "images": [image("square_256x256.png")],
        "questions": {
            "busy": {"type": "noul", "instructions": "Is the dock in use?"},
            "what": {"type": "choice", "instructions": "What does it show?", "criteria": {"a truck": null, "a person": null, "nothing": null}},
        },
    });
    let reply = server.post_json("/v1/systemone", &serde_json::to_vec(&plain).unwrap());
    reply.assert_status(200);
    let reply = reply.json();
    assert_eq!(reply["answers"], report["answers"], "{reply}\n{report}");
    assert_eq!(reply["usage"], report["usage"]);
}

/// `prism synth --mmproj`: a real-width 0.8B (1 layer, a cut vocabulary) with its vision tower cut to
/// one block. Two runs write the same mmproj bytes; `prism serve --model-dir DIR` finds the mmproj
/// and answers an image request, counting the image's 64 tokens.
#[test]
fn a_synthetic_model_with_its_mmproj_answers_images() {
    let synth = |name: &str| -> std::path::PathBuf {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        let _ = std::fs::remove_dir_all(&dir);
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_prism"))
            .args(["synth", "--out", dir.to_str().unwrap()])
            .args(["--shape", "0.8b", "--layers", "1", "--type", "q8_0"])
            .args(["--vocab-ranks", "1000", "--seed", "3"])
            .args(["--mmproj", "--vision-blocks", "1"])
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .expect("run prism synth");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        dir
    };
    let (a, b) = (synth("synth_mmproj_a"), synth("synth_mmproj_b"));
    let file = "mmproj-Qwen3.5-0.8B-synth-F16.gguf";
    let bytes = std::fs::read(a.join(file)).expect("the mmproj is written");
    assert!(
        bytes == std::fs::read(b.join(file)).unwrap(),
        "same seed, same bytes"
    );
    let gguf = prism_gguf::GgufFile::from_bytes(bytes).unwrap();
    let tower = prism_model::vision::VisionWeights::load(&gguf, &candle_core::Device::Cpu).unwrap();
    assert_eq!(
        (
            tower.config.hidden,
            tower.config.blocks,
            tower.config.projection
        ),
        (768, 1, 1024)
    );

    let server = Server::start(&[
        "--gguf",
        a.join("model.gguf").to_str().unwrap(),
        "--model-dir",
        a.to_str().unwrap(),
    ]);
    assert!(
        server.output().contains("vision tower"),
        "{}",
        server.output()
    );
    let reply = server.post_json(
        "/v1/systemone",
        &body("A photo from the dock.", vec![image("square_256x256.png")]),
    );
    reply.assert_status(200);
    let text_only = server.post_json("/v1/systemone", &body("A photo from the dock.", vec![]));
    let tokens = |r: &serve_common::Reply| r.json()["usage"]["input_tokens"].as_u64().unwrap();
    assert!(tokens(&reply) >= tokens(&text_only) + 2 * 64);
    // /stats counts the tower's image and its time.
    let stats = server.get("/stats").json();
    assert_eq!(stats["vision"]["images"], 1, "{stats}");
    assert!(
        stats["vision"]["ms_per_image"].as_f64().unwrap() > 0.0,
        "{stats}"
    );
}
