//! Requests with images through the decision path (`Engine` over `DecoderLetterModel` with the vision
//! tower of `tests/fixtures/qwen35-vl-tiny`), against transformers' references in `ref_prompts.json`:
//! - each fixture prompt, sent as a request (state, images as base64 or data URIs, one question), renders
//!   and tokenizes to the reference's input ids exactly (images first, one and several; placed by
//!   `<image>` marks);
//! - its answer's probabilities are the softmax of the reference's last-position letter logits (within
//!   2e-4), and `usage.input_tokens` counts the image tokens;
//! - answers are the same bytes alone and batched with the other prompts;
//! - the prefix cache never gives one image's evidence to another image with the same pad tokens;
//! - bad images, mismatched marks and a model without a vision tower are refused under their paths.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use common::ids_of;
use prism_decision::engine::EngineDecideError;
use prism_decision::image_input::ImageLimits;
use prism_decision::request::QuestionType;
use prism_decision::{
    DecisionConfig, DecisionRequest, DecisionTask, DecoderLetterModel, Engine, EngineOptions,
    ModelSource, RequestDefaults,
};
use prism_model::{LoadOptions, Precision};
use serde_json::{json, Value};

mod common;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-vl-tiny")
}

fn refs() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| {
        let text = std::fs::read_to_string(dir().join("ref_prompts.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    })
}

fn image_file(name: &str) -> PathBuf {
    let images = dir().join("images");
    std::fs::read_dir(&images)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("{name}_"))
        })
        .unwrap_or_else(|| panic!("no image {name}"))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The image as the client sends it: base64 for even `k`, a data URI for odd.
fn encoded(name: &str, k: usize) -> String {
    let path = image_file(name);
    let bytes = std::fs::read(&path).unwrap();
    if k % 2 == 0 {
        b64(&bytes)
    } else {
        let mime = if path.extension().unwrap() == "jpg" {
            "image/jpeg"
        } else {
            "image/png"
        };
        format!("data:{mime};base64,{}", b64(&bytes))
    }
}

fn load(mmproj: bool) -> (DecoderLetterModel, DecisionConfig) {
    let source = ModelSource {
        gguf: dir().join("tiny-vl-BF16.gguf"),
        // With the directory, its mmproj-*.gguf is found by itself.
        model_dir: mmproj.then(dir),
        mmproj: None,
    };
    let options = LoadOptions {
        hf_config: Some(dir().join("config.json")),
        precision: Precision::F32,
        ..LoadOptions::default()
    };
    let loaded = DecoderLetterModel::load(&source, &options, 4096).expect("model loads");
    (loaded.model, loaded.config)
}

fn engine() -> &'static (Engine, Vec<u32>, DecisionConfig) {
    static E: OnceLock<(Engine, Vec<u32>, DecisionConfig)> = OnceLock::new();
    E.get_or_init(|| {
        let (model, config) = load(true);
        assert!(
            model.vision().is_some(),
            "the mmproj in the model dir loads"
        );
        let letters = model.prompt_format().letter_ids().to_vec();
        let encoder = model.encoder();
        let (engine, worker) = Engine::start(
            model,
            encoder,
            config.clone(),
            EngineOptions::default(),
            None,
        )
        .unwrap();
        std::mem::forget(worker);
        (engine, letters, config)
    })
}

/// The reference prompt's question and option ids, from its user message.
fn question(p: &Value) -> (String, Vec<String>) {
    let content = p["messages"][1]["content"].as_array().unwrap();
    let text = content.last().unwrap()["text"].as_str().unwrap();
    let after = text.split("Question: ").nth(1).unwrap();
    let (instructions, options) = after.split_once("\nOptions:\n").unwrap();
    let ids = options
        .lines()
        .map(|l| l.split_once(") ").unwrap().1.to_string())
        .collect();
    (instructions.to_string(), ids)
}

/// The reference prompt as a request body.
fn body(p: &Value) -> Value {
    let (instructions, ids) = question(p);
    let images: Vec<String> = p["images"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(k, n)| encoded(n.as_str().unwrap(), k))
        .collect();
    json!({
        "state": p["state"],
        "images": images,
        "questions": {"q": {"type": "choice", "instructions": instructions, "criteria": ids}},
    })
}

fn request(body: &Value) -> DecisionRequest {
    DecisionRequest::parse(body.to_string().as_bytes(), &RequestDefaults::default()).unwrap()
}

fn prompts() -> Vec<&'static Value> {
    refs()["prompts"].as_array().unwrap().iter().collect()
}

#[test]
fn every_prompt_tokenizes_as_the_processor() {
    let (model, config) = load(true);
    let encoder = model.encoder();
    let image_config = encoder.image_config().expect("a vision model");
    for p in prompts() {
        let name = p["name"].as_str().unwrap();
        let request = request(&body(p));
        let decoded = prism_decision::image_input::decode_images(
            &request.images,
            &image_config,
            &ImageLimits::default(),
        )
        .unwrap();
        let tokens: Vec<usize> = decoded.iter().map(|d| d.tokens()).collect();
        let grids: Vec<Vec<usize>> = decoded.iter().map(|d| d.grid.to_vec()).collect();
        if let Some(want) = p["image_grid_thw"].as_array() {
            let want: Vec<Vec<usize>> = want
                .iter()
                .map(|g| {
                    g.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap() as usize)
                        .collect()
                })
                .collect();
            assert_eq!(grids, want, "{name}");
        }
        let mut task = DecisionTask::with_images(request, &config, &tokens).unwrap();
        let prompts = task.next_prompts();
        assert_eq!(prompts.len(), 1);
        let ids = encoder.encode(&prompts[0]).unwrap();
        let want = ids_of(&p["input_ids"]);
        assert_eq!(ids, want, "{name}: token ids");
    }
}

fn softmax(logits: &[f64], t: f64) -> Vec<f64> {
    let m = logits.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| ((l - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

fn answer_bytes(response: &prism_decision::DecisionResponse) -> String {
    serde_json::to_string(&response.answers).unwrap()
}

#[test]
fn answers_match_transformers_logits() {
    let (engine, letters, config) = engine();
    let t = config.temperature(QuestionType::Choice);
    let mut worst = 0f64;
    for p in prompts() {
        let name = p["name"].as_str().unwrap();
        let out = engine
            .decide(request(&body(p)), Some(Duration::from_secs(600)))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let (_, ids) = question(p);
        let logits: Vec<f64> = letters[..ids.len()]
            .iter()
            .map(|&l| p["last_logits"][l as usize].as_f64().unwrap())
            .collect();
        let want = softmax(&logits, t);
        let answer = serde_json::to_value(&out.response.answers).unwrap();
        for (id, w) in ids.iter().zip(&want) {
            let got = answer["q"]["probabilities"][id].as_f64().unwrap();
            worst = worst.max((got - w).abs());
            assert!((got - w).abs() < 2e-4, "{name} {id}: {got} vs {w}");
        }
        assert_eq!(
            out.response.usage.input_tokens,
            p["n_tokens"].as_u64().unwrap(),
            "{name}: usage counts the image tokens"
        );
    }
    eprintln!("worst probability difference: {worst:.2e}");
}

#[test]
fn answers_are_the_same_alone_and_batched() {
    let (engine, _, _) = engine();
    let bodies: Vec<Value> = prompts().into_iter().map(body).collect();
    let alone: Vec<String> = bodies
        .iter()
        .map(|b| answer_bytes(&engine.decide(request(b), None).unwrap().response))
        .collect();
    // All at once: one step loop packs them into shared passes.
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                s.spawn(move || answer_bytes(&engine.decide(request(b), None).unwrap().response))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
}

#[test]
fn the_prefix_cache_keys_on_the_image_bytes() {
    // A separate engine, so the cache counts are this test's.
    let (model, config) = load(true);
    let encoder = model.encoder();
    let (engine, _worker) =
        Engine::start(model, encoder, config, EngineOptions::default(), None).unwrap();
    let ask = |frame: &str| {
        let body = json!({
            "state": "A frame of the dock camera.",
            "images": [encoded(frame, 0)],
            "questions": {"q": {"type": "noul", "instructions": "Is the dock in use?"}},
        });
        let out = engine.decide(request(&body), None).unwrap();
        (answer_bytes(&out.response), out.cached_tokens)
    };
    // frame0 and frame1 have the same size, so the same pad tokens.
    let (first, cached) = ask("frame0");
    assert_eq!(cached, 0);
    let (other, cached) = ask("frame1");
    assert_eq!(
        cached, 0,
        "another image must not hit the first one's evidence"
    );
    assert_ne!(first, other);
    let (again, cached) = ask("frame0");
    assert!(cached > 0, "the same image hits");
    assert_eq!(again, first);
    assert_eq!(engine.stats().prefix_cache.hits, 1);
}

fn refused(engine: &Engine, body: &Value) -> (u16, Vec<String>, String) {
    let error = match engine.decide(request(body), None) {
        Err(EngineDecideError::Decision(e)) => e,
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("accepted: {body}"),
    };
    let detail = error.body().detail;
    let loc = detail[0]
        .loc
        .iter()
        .map(|p| {
            serde_json::to_value(p)
                .unwrap()
                .to_string()
                .trim_matches('"')
                .to_string()
        })
        .collect();
    (error.status(), loc, error.to_string())
}

fn tiny_png(width: u32, height: u32) -> Vec<u8> {
    let mut bytes = Vec::new();
    let image = image::RgbImage::from_pixel(width, height, image::Rgb([10, 200, 30]));
    image::DynamicImage::ImageRgb8(image)
        .write_to(
            &mut std::io::Cursor::new(&mut bytes),
            image::ImageOutputFormat::Png,
        )
        .unwrap();
    bytes
}

/// A PNG whose header claims `width × height` pixels, with no pixel data to back it.
fn crafted_png(width: u32, height: u32) -> Vec<u8> {
    let mut png = tiny_png(1, 1);
    // IHDR's width and height sit at bytes 16..24, its CRC at 29..33 (recomputed, so only the size is
    // wrong).
    png[16..20].copy_from_slice(&width.to_be_bytes());
    png[20..24].copy_from_slice(&height.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    png
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn bad_images_are_refused_under_their_paths() {
    let (engine, _, _) = engine();
    let with = |state: &str, images: Vec<String>| {
        json!({
            "state": state,
            "images": images,
            "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
        })
    };
    let good = encoded("square", 0);
    // Bad base64: 400 naming images[1].
    let (status, loc, _) = refused(
        engine,
        &with("s", vec![good.clone(), "not base64 !!".into()]),
    );
    assert_eq!(
        (status, loc),
        (400, vec!["body".into(), "images".into(), "1".into()])
    );
    // Base64 of bytes that are no image: 400.
    let (status, loc, msg) = refused(engine, &with("s", vec![b64(b"hello, world")]));
    assert_eq!(
        (status, loc),
        (400, vec!["body".into(), "images".into(), "0".into()]),
        "{msg}"
    );
    // A data URI that is not base64: 400.
    let (status, _, _) = refused(engine, &with("s", vec!["data:image/png,abc".into()]));
    assert_eq!(status, 400);
    // A truncated PNG: 400.
    let png = tiny_png(64, 64);
    let (status, _, _) = refused(engine, &with("s", vec![b64(&png[..png.len() / 2])]));
    assert_eq!(status, 400);
    // A header claiming 60,000 × 60,000 pixels: 422 before any pixel is decoded.
    let (status, loc, msg) = refused(engine, &with("s", vec![b64(&crafted_png(60_000, 60_000))]));
    assert_eq!(
        (status, loc),
        (422, vec!["body".into(), "images".into(), "0".into()])
    );
    assert!(msg.contains("60000 × 60000"), "{msg}");
    // Marks that do not match the images: 422 naming state.
    let (status, loc, _) = refused(engine, &with("a <image> b <image>", vec![good.clone()]));
    assert_eq!((status, loc), (422, vec!["body".into(), "state".into()]));
    // Nine images: refused by the request's validation (422 naming images).
    let nine = json!({
        "state": "s",
        "images": vec![good.clone(); 9],
        "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
    });
    let error = DecisionRequest::parse(nine.to_string().as_bytes(), &RequestDefaults::default())
        .unwrap_err();
    assert_eq!(error.status(), 422);
    // A GIF and a WebP decode (the first frame of the GIF).
    let mut gif = Vec::new();
    image::DynamicImage::ImageRgb8(image::RgbImage::from_pixel(40, 30, image::Rgb([1, 2, 3])))
        .write_to(
            &mut std::io::Cursor::new(&mut gif),
            image::ImageOutputFormat::Gif,
        )
        .unwrap();
    engine
        .decide(request(&with("s", vec![b64(&gif)])), None)
        .unwrap();
}

#[test]
fn a_model_without_a_vision_tower_says_so() {
    let (model, config) = load(false);
    assert!(model.vision().is_none());
    let encoder = model.encoder();
    let (engine, _worker) =
        Engine::start(model, encoder, config, EngineOptions::default(), None).unwrap();
    let body = json!({
        "state": "s",
        "images": [encoded("square", 0)],
        "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
    });
    let (status, loc, msg) = refused(&engine, &body);
    assert_eq!((status, loc), (422, vec!["body".into(), "images".into()]));
    assert!(msg.contains("no vision tower"), "{msg}");
    // Text still works.
    let body =
        json!({"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}});
    engine.decide(request(&body), None).unwrap();
}
