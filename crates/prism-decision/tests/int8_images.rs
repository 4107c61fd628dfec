//! The integer decoders on image prompts (issue #22): the bundled demo model (`tiny-Q8_0.gguf` at int8,
//! `tiny-Q4_K_M.gguf` at w4a8) with its demo vision tower answers requests with images byte for byte the
//! same alone, batched with other image requests in shared passes, and from the prefix cache.

mod common;

use common::{answer_bytes, answer_bytes_at_once, image_uri};
use prism_decision::{DecoderLetterModel, Engine, EngineOptions};
use prism_model::{LoadOptions, Precision};
use serde_json::{json, Value};

/// Six requests: one to three images each (placed by marks or first), two questions, and one
/// repeating another's evidence with other questions.
fn bodies() -> Vec<Value> {
    let choice = json!({"type": "choice", "instructions": "Which team handles it?",
        "criteria": {"dock": null, "yard": null, "office": null}});
    let noul = json!({"type": "noul", "instructions": "Is anything out of place?"});
    let score = json!({"type": "score", "instructions": "How busy is it?", "criteria": ["quiet", "normal", "busy"]});
    vec![
        json!({"state": "The dock camera at noon.", "images": [image_uri("square_256x256.png")],
            "questions": {"team": choice, "odd": noul}}),
        json!({"state": "Before: <image> and after: <image>", "images": [image_uri("frame0_384x216.png"), image_uri("frame5_384x216.png")],
            "questions": {"busy": score, "odd": noul}}),
        json!({"state": "Three shots of the yard.", "images": [image_uri("wide_640x360.jpg"), image_uri("tall_200x500_gray.png"), image_uri("small_120x90.png")],
            "questions": {"team": choice, "busy": score}}),
        json!({"state": "The dock camera at noon.", "images": [image_uri("square_256x256.png")],
            "questions": {"busy": score}}),
        json!({"state": {"note": "gate <image> closed"}, "images": [image_uri("frame3_384x216.png")],
            "questions": {"odd": noul}}),
        json!({"state": "No picture today.", "questions": {"team": choice}}),
    ]
}

fn engine(gguf: &str, precision: Precision) -> Engine {
    let source = common::demo_source(gguf);
    let options = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    let loaded = DecoderLetterModel::load(&source, &options, 8192).expect("the demo model loads");
    assert!(loaded.model.vision().is_some(), "the demo tower loads");
    let encoder = loaded.model.encoder();
    let (engine, worker) = Engine::start(
        loaded.model,
        encoder,
        loaded.config,
        EngineOptions::default(),
        None,
    )
    .unwrap();
    std::mem::forget(worker);
    engine
}

fn check(gguf: &str, precision: Precision) {
    let bodies = bodies();
    // Alone: one engine, one request at a time, in order (the fourth hits the first one's evidence).
    let single = engine(gguf, precision);
    let alone: Vec<String> = bodies.iter().map(|b| answer_bytes(&single, b)).collect();
    // Batched: a fresh engine, every request at once, then all again from its prefix cache.
    let batched = engine(gguf, precision);
    let together = answer_bytes_at_once(&batched, &bodies);
    let cached = answer_bytes_at_once(&batched, &bodies);
    let stats = batched.stats();
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&together[i], want, "{precision:?}: request {i} batched");
        assert_eq!(
            &cached[i], want,
            "{precision:?}: request {i} from the cache"
        );
    }
    assert!(
        stats.max_requests_per_pass >= 2,
        "{precision:?}: passes held at most {} requests",
        stats.max_requests_per_pass
    );
    assert!(
        stats.prefix_cache.hits >= bodies.len() as u64,
        "{precision:?}: the second round hits the cache ({} hits)",
        stats.prefix_cache.hits
    );
    // The images change the answers: the first request without its image reads otherwise.
    let mut plain = bodies[0].clone();
    plain.as_object_mut().unwrap().remove("images");
    assert_ne!(
        answer_bytes(&single, &plain),
        alone[0],
        "{precision:?}: the image is read"
    );
}

#[test]
fn int8_answers_with_images_are_the_same_alone_batched_and_cached() {
    check("tiny-Q8_0.gguf", Precision::Int8);
}

#[test]
fn w4a8_answers_with_images_are_the_same_alone_batched_and_cached() {
    check("tiny-Q4_K_M.gguf", Precision::W4a8);
}
