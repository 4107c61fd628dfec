//! Shared test helpers: fixture JSON, the golden file and fake letter models.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use prism_decision::engine::{CancelToken, Engine, JobResult};
use prism_decision::pyjson::{self, PyValue};
use prism_decision::DecisionRequest;
use prism_decision::{LetterLogits, LetterModel, LetterPrompt, ModelError};
use serde_json::Value;

pub fn fixture_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(relative)
}

/// A JSON file, parsed with serde_json; panics naming the file.
pub fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of token ids.
pub fn ids_of(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids array")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

/// The added tokens of `qwen35-tiny/tokenizer.json` in its order: (content, special).
pub fn tiny_added_tokens() -> Vec<(String, bool)> {
    let tiny = read_json(&fixture_path("qwen35-tiny/tokenizer.json"));
    tiny["added_tokens"]
        .as_array()
        .expect("added_tokens")
        .iter()
        .map(|t| {
            (
                t["content"].as_str().expect("content").to_string(),
                t["special"].as_bool().expect("special"),
            )
        })
        .collect()
}

/// Prepares `request` and queues it on `engine`; its result arrives on the receiver.
pub fn submit_with(
    engine: &Engine,
    request: DecisionRequest,
    deadline: Option<Instant>,
    cancel: CancelToken,
) -> mpsc::Receiver<JobResult> {
    let (tx, rx) = mpsc::channel();
    let prepared = engine.prepare(request).unwrap();
    engine
        .submit(
            prepared,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
            deadline,
            cancel,
        )
        .unwrap();
    rx
}

/// `golden.json`, read with our Python-compatible parser so its number forms survive.
pub fn golden() -> PyValue {
    let path = fixture_path("decision-golden/golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    pyjson::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn get<'a>(value: &'a PyValue, key: &str) -> &'a PyValue {
    value
        .as_object()
        .and_then(|o| o.get(key))
        .unwrap_or_else(|| panic!("no key {key:?} in {value}"))
}

pub fn list(value: &PyValue) -> &[PyValue] {
    match value {
        PyValue::Array(items) => items,
        other => panic!("not a list: {other}"),
    }
}

/// The golden read-out cases' fake model: `int(sha1(id).hexdigest()[:8], 16) / 2**32 * 8 - 4`.
pub fn sha_logit(id: &str) -> f64 {
    let digest = sha1_smol::Sha1::from(id.as_bytes()).digest().bytes();
    let top = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    top as f64 / 4294967296.0 * 8.0 - 4.0
}

/// A fake model whose letter logit for an option is [`sha_logit`] of its id. Records every call.
#[derive(Default)]
pub struct ShaModel {
    /// The prompts of each call.
    pub calls: Vec<Vec<LetterPrompt>>,
    pub tokens_per_prompt: u64,
}

impl LetterModel for ShaModel {
    fn model_name(&self) -> &str {
        "sha1-fake"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        self.calls.push(prompts.to_vec());
        Ok(LetterLogits {
            logits: prompts
                .iter()
                .map(|p| p.option_ids.iter().map(|id| sha_logit(id)).collect())
                .collect(),
            input_tokens: self.tokens_per_prompt * prompts.len() as u64,
            output_tokens: 0,
        })
    }
}

/// A fake model that returns fixed logits for every prompt, truncated to the prompt's option count.
pub struct FixedModel {
    pub logits: Vec<f64>,
    pub calls: usize,
}

impl LetterModel for FixedModel {
    fn model_name(&self) -> &str {
        "fixed-fake"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        self.calls += 1;
        Ok(fixed_read_out(&self.logits, prompts))
    }
}

/// The read-out of fixed logits: each prompt gets the first of `logits`, one per option, and counts
/// 10 input tokens.
pub fn fixed_read_out(logits: &[f64], prompts: &[LetterPrompt]) -> LetterLogits {
    LetterLogits {
        logits: prompts
            .iter()
            .map(|p| logits[..p.option_ids.len()].to_vec())
            .collect(),
        input_tokens: 10 * prompts.len() as u64,
        output_tokens: 0,
    }
}

/// Relative difference, with an absolute floor for values near zero.
pub fn rel_diff(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-300)
}

/// A test image of the vision fixture (`qwen35-vl-tiny/images`) as a data URI.
pub fn image_uri(file: &str) -> String {
    use base64::Engine as _;
    let bytes = std::fs::read(fixture_path("qwen35-vl-tiny/images").join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let mime = if file.ends_with(".jpg") {
        "image/jpeg"
    } else {
        "image/png"
    };
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// `body` decided by `engine`: its answers' and usage's bytes (timing left out).
pub fn answer_bytes(engine: &Engine, body: &Value) -> String {
    let request = DecisionRequest::parse(
        body.to_string().as_bytes(),
        &prism_decision::RequestDefaults::default(),
    )
    .expect("request");
    let out = engine.decide(request, None).expect("answered");
    format!(
        "{} {}",
        serde_json::to_string(&out.response.answers).unwrap(),
        serde_json::to_string(&out.response.usage).unwrap()
    )
}

/// Every body submitted at once, each from its own thread: [`answer_bytes`] in body order.
pub fn answer_bytes_at_once(engine: &Engine, bodies: &[Value]) -> Vec<String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || answer_bytes(engine, b)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The bundled demo model (`qwen35-tiny`'s `gguf`, its directory's files) with its demo vision tower.
pub fn demo_source(gguf: &str) -> prism_decision::ModelSource {
    let dir = fixture_path("qwen35-tiny");
    prism_decision::ModelSource {
        gguf: dir.join(gguf),
        mmproj: Some(dir.join(prism_model::synth_vision::DEMO_MMPROJ)),
        model_dir: Some(dir),
    }
}
