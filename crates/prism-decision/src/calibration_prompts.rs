//! The built-in calibration prompts of the integer precisions (int8 / w4a8) and the decoder loader that
//! uses them.
//!
//! A few fixed decision requests (support tickets, an invoice, a product review, a log line: the kinds
//! of evidence a decision model reads) are rendered exactly as served — spec §3 prompts, the model's
//! chat template with thinking off — and run once at bf16 to measure each projection's input range
//! ([`prism_model::calibration`]). The ranges are cached per model file, so this happens once.

use std::path::Path;

use prism_gguf::GgufFile;
use prism_model::calibration::{default_cache_dir, load_or_calibrate};
use prism_model::{LoadOptions, ModelError, Qwen35Model};

use crate::chat_template::{ChatMessage, PromptFormat};
use crate::config::DecisionConfig;
use crate::decide::render_request;
use crate::request::{DecisionRequest, RequestDefaults};

/// Names the prompt set in the calibration cache: change it when [`REQUESTS`] changes.
pub const PROMPT_SET: &str = "decision-v1";

/// The calibration requests (`/v1/systemone` bodies).
pub const REQUESTS: [&str; 4] = [
    r#"{"state": {"ticket": "I was charged twice for my March invoice and now the app says my card is declined. Please fix this today!", "customer": {"plan": "pro", "since": "2021-04-02", "seats": 12}, "last_payments": [49.0, 49.0, 49.0, 98.0, 49.0]},
        "questions": {"team": {"type": "choice", "instructions": "Which team should handle this ticket?", "criteria": {"billing": "Payments, invoices and refunds", "technical": "Bugs, errors and outages", "sales": "Plans, upgrades and quotes"}},
                      "urgent": {"type": "noul", "instructions": "Does this ticket need a reply today?"},
                      "mood": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry"]}}}"#,
    r#"{"state": {"invoice": {"number": "INV-2291", "vendor": "Acme Office Supply GmbH", "total": 1843.20, "currency": "EUR", "due": "2024-07-31", "lines": [{"item": "Printer paper A4, 50 boxes", "amount": 612.5}, {"item": "Standing desk", "amount": 899.0}, {"item": "Delivery", "amount": 331.7}]}, "policy": "Purchases above 1500 EUR need a manager's approval; furniture is capital expenditure."},
        "questions": {"approval": {"type": "noul", "instructions": "Does this invoice need a manager's approval?"},
                      "category": {"type": "choice", "instructions": "What is the main cost category?", "criteria": {"supplies": "Consumables and office supplies", "capex": "Furniture and equipment", "services": "Services and fees"}}}}"#,
    r#"{"state": {"review": "Battery life is great, easily two days. The screen scratches far too easily though, and support never answered my email about it. Would I buy it again? Probably not.", "stars": 2, "product": "Phone X12"},
        "questions": {"sentiment": {"type": "score", "instructions": "How positive is the review overall?", "criteria": ["very negative", "negative", "mixed", "positive", "very positive"]},
                      "topics": {"type": "choice", "instructions": "Which aspect does the reviewer complain about most?", "criteria": {"battery": "Battery and charging", "screen": "Display and durability", "support": "Customer support", "price": "Price and value"}}}}"#,
    r#"{"state": {"service": "checkout-api", "log": ["12:01:07 WARN pool exhausted (64/64), waiting", "12:01:09 ERROR timeout after 2000 ms calling payments", "12:01:09 ERROR timeout after 2000 ms calling payments", "12:01:12 INFO autoscaler: +2 replicas"], "error_rate": 0.173, "p99_ms": 4120},
        "questions": {"page": {"type": "noul", "instructions": "Should the on-call engineer be paged now?"},
                      "cause": {"type": "choice", "instructions": "What is the most likely cause?", "criteria": {"db": "Database connection pool", "downstream": "A slow downstream service", "deploy": "A bad deployment", "traffic": "A traffic spike"}}}}"#,
];

/// Why the calibration prompts could not be made (a bug in [`REQUESTS`] or a template that refuses
/// them): the message names the request.
#[derive(Debug, thiserror::Error)]
#[error("calibration request {index}: {reason}")]
pub struct CalibrationPromptError {
    pub index: usize,
    pub reason: String,
}

/// The token ids of every prompt the built-in requests render to, through `format` (thinking off, as
/// read-outs are served).
pub fn calibration_tokens(format: &PromptFormat) -> Result<Vec<Vec<u32>>, CalibrationPromptError> {
    let config = DecisionConfig::default();
    let mut out = Vec::new();
    for (index, body) in REQUESTS.iter().enumerate() {
        let err = |reason: String| CalibrationPromptError { index, reason };
        let request = DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default())
            .map_err(|e| err(format!("{:?}", e.body())))?;
        for question in
            render_request(&request, &config).map_err(|e| err(format!("{:?}", e.body())))?
        {
            for prompt in question.prompts {
                let messages = [
                    ChatMessage::system(prompt.system.as_str()),
                    ChatMessage::user(prompt.user.as_str()),
                ];
                let ids = format
                    .render_and_encode(&messages, false)
                    .map_err(|e| err(e.to_string()))?
                    .ids;
                out.push(ids);
            }
        }
    }
    Ok(out)
}

/// Loads the decoder of `gguf`. The integer precisions get their activation ranges from the cache in
/// `cache_dir` (default: [`default_cache_dir`]), measured on the built-in prompts the first time (a log
/// line says so).
pub fn load_decoder(
    gguf: &GgufFile,
    options: &LoadOptions,
    format: &PromptFormat,
    cache_dir: Option<&Path>,
) -> Result<Qwen35Model, ModelError> {
    if !options.precision.is_integer() {
        return Qwen35Model::from_gguf(gguf, options);
    }
    let tokens = calibration_tokens(format).map_err(|e| ModelError::Calibration(e.to_string()))?;
    let default_dir = default_cache_dir();
    let dir = cache_dir.or(default_dir.as_deref());
    let calibration = load_or_calibrate(gguf, options, &tokens, PROMPT_SET, dir)?;
    Qwen35Model::from_gguf_calibrated(gguf, options, &calibration)
}
