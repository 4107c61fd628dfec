//! What `prism render` shows: each question's prompt messages for a request body (system and user
//! text, option ids in letter order), and with a model directory the chat-templated text and token ids.
//! Images are decoded and resized as a Qwen3.5 vision tower reads them (patches of 16 merged 2 × 2) and
//! placed by spec §3's rules: each prompt says where each image goes and how many pad tokens it takes,
//! and the token ids have each image's `<|image_pad|>` expanded as the engine does.
//!
//! Like the other command drivers outside the CLI ([`crate::setup`], [`crate::bench`]), this returns
//! `anyhow` errors for what goes wrong around the request (a model directory that does not load), and the
//! API's own [`DecisionError`] for a request the API would refuse.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::json;

use crate::chat_template::{PromptFormat, RenderedPrompt};
use crate::engine::decoder::{expand_image_pads, prompt_messages};
use crate::error::FieldErrors;
use crate::image_input::{decode_images, ImageLimits};
use crate::vision::ImageConfig;
use crate::{
    render_request, render_request_with_images, DecisionConfig, DecisionError, DecisionRequest,
    LetterPrompt, ReadMode, RenderedQuestion, RequestDefaults,
};

/// A request's rendered questions, with the model directory's prompt format when one was given.
pub struct Preview {
    pub questions: Vec<RenderedQuestion>,
    format: Option<PromptFormat>,
}

/// Renders the request `body`: the outer error is the model directory's (tokenizer, chat template,
/// decision config), the inner one the API's refusal of the request (its body and status).
pub fn preview(body: &[u8], model_dir: Option<&Path>) -> Result<Result<Preview, DecisionError>> {
    // With a model directory: its tokenizer and chat template (checked as at model load) and its
    // decision config (the wide-choice grouping depends on it).
    let (format, config) = match model_dir {
        Some(dir) => {
            let format = PromptFormat::load_from_model_dir(dir, None).with_context(|| {
                format!(
                    "loading the tokenizer and chat template of {}",
                    dir.display()
                )
            })?;
            let config = DecisionConfig::from_model_dir(dir)?;
            if let Some(ids) = &config.letter_token_ids {
                format.check_letter_token_ids(ids)?;
            }
            (Some(format), config)
        }
        None => (None, DecisionConfig::default()),
    };
    let rendered = DecisionRequest::parse(body, &RequestDefaults::default()).and_then(|request| {
        if request.images.is_empty() {
            return render_request(&request, &config);
        }
        let images = decode_images(
            &request.images,
            &ImageConfig::default(),
            &ImageLimits::default(),
        )
        .map_err(|errors| DecisionError::Request(FieldErrors(errors)))?;
        let tokens: Vec<usize> = images.iter().map(|image| image.tokens()).collect();
        render_request_with_images(&request, &config, &tokens)
    });
    Ok(rendered.map(|questions| Preview { questions, format }))
}

impl Preview {
    /// One JSON object keyed by question: its type, read mode and prompts (system, user, option order,
    /// image slots; with a model directory the templated text, token count and ids).
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let mut object = serde_json::Map::new();
        for question in &self.questions {
            object.insert(
                question.name.clone(),
                question_json(question, self.format.as_ref())?,
            );
        }
        Ok(serde_json::Value::Object(object))
    }

    /// Every question as text, a blank line between them.
    pub fn write_text(&self, out: &mut impl Write) -> Result<()> {
        for (i, question) in self.questions.iter().enumerate() {
            if i > 0 {
                writeln!(out)?;
            }
            write_text(out, question, self.format.as_ref())?;
        }
        Ok(())
    }
}

fn mode_name(mode: ReadMode) -> &'static str {
    match mode {
        ReadMode::SelfAnswered => "self_answered",
        ReadMode::Single => "single",
        ReadMode::Wide => "wide",
    }
}

/// The prompt through the chat template with thinking off, as the model reads it.
/// With images, the text shows the template's one `<|image_pad|>` per image and the ids have each
/// expanded to the image's pad tokens, as the engine reads it.
fn templated(prompt: &LetterPrompt, format: &PromptFormat) -> Result<RenderedPrompt> {
    let mut rendered = format.render_and_encode(&prompt_messages(prompt), false)?;
    if !prompt.images.is_empty() {
        let pad = format.special_tokens().image_pad.context(
            "the model directory's tokenizer has no <|image_pad|> token, so images cannot be placed",
        )?;
        rendered.ids = expand_image_pads(rendered.ids, pad, &prompt.images)?;
    }
    Ok(rendered)
}

/// Where each image of a prompt goes: its byte offset in the user message and its pad tokens.
fn image_lines(prompt: &LetterPrompt) -> Vec<String> {
    prompt
        .images
        .iter()
        .enumerate()
        .map(|(i, slot)| {
            format!(
                "image {} at byte {} of the user message: {} tokens",
                i + 1,
                slot.at,
                slot.tokens
            )
        })
        .collect()
}

fn prompt_json(prompt: &LetterPrompt, format: Option<&PromptFormat>) -> Result<serde_json::Value> {
    let mut value =
        json!({"system": prompt.system, "user": prompt.user, "order": prompt.option_ids});
    if !prompt.images.is_empty() {
        value["images"] = prompt
            .images
            .iter()
            .map(|slot| json!({"at": slot.at, "tokens": slot.tokens}))
            .collect();
    }
    if let Some(format) = format {
        let rendered = templated(prompt, format)?;
        value["text"] = json!(rendered.text);
        value["n_tokens"] = json!(rendered.ids.len());
        value["ids"] = json!(rendered.ids);
    }
    Ok(value)
}

fn question_json(
    question: &RenderedQuestion,
    format: Option<&PromptFormat>,
) -> Result<serde_json::Value> {
    let prompts = question
        .prompts
        .iter()
        .map(|p| prompt_json(p, format))
        .collect::<Result<Vec<_>>>()?;
    Ok(json!({
        "type": question.kind.as_str(),
        "mode": mode_name(question.mode),
        "prompts": prompts,
    }))
}

fn write_text(
    out: &mut impl Write,
    question: &RenderedQuestion,
    format: Option<&PromptFormat>,
) -> Result<()> {
    let kind = question.kind.as_str();
    match question.mode {
        ReadMode::SelfAnswered => {
            writeln!(
                out,
                "=== {} ({kind}): a single option, answered without the model (probability 1)",
                question.name
            )?;
            return Ok(());
        }
        ReadMode::Single => writeln!(out, "=== {} ({kind})", question.name)?,
        ReadMode::Wide => writeln!(
            out,
            "=== {} ({kind}): wide choice, first round of {} prompts (later rounds depend on the read-outs)",
            question.name,
            question.prompts.len()
        )?,
    }
    for (i, prompt) in question.prompts.iter().enumerate() {
        if question.prompts.len() > 1 {
            writeln!(out, "--- prompt {} of {}", i + 1, question.prompts.len())?;
        }
        writeln!(out, "--- system\n{}", prompt.system)?;
        writeln!(out, "--- user\n{}", prompt.user)?;
        for line in image_lines(prompt) {
            writeln!(out, "--- {line}")?;
        }
        writeln!(
            out,
            "--- options in letter order: {}",
            prompt.option_ids.join(", ")
        )?;
        if let Some(format) = format {
            let rendered = templated(prompt, format)?;
            writeln!(out, "--- chat template (thinking off)\n{}", rendered.text)?;
            let ids: Vec<String> = rendered.ids.iter().map(u32::to_string).collect();
            writeln!(
                out,
                "--- {} token ids\n[{}]",
                rendered.ids.len(),
                ids.join(", ")
            )?;
        }
    }
    Ok(())
}
