//! `prism render`: each question's prompt messages (system and user text, option ids in letter order),
//! before the chat template. A request the API would refuse prints the API's error body and exits 1.

use std::io::Write;

use anyhow::{Context, Result};
use prism_decision::chat_template::{ChatMessage, PromptFormat, RenderedPrompt};
use prism_decision::{
    render_request, DecisionConfig, DecisionRequest, LetterPrompt, ReadMode, RenderedQuestion,
    RequestDefaults,
};
use serde_json::json;

use crate::RenderArgs;

pub fn run(args: &RenderArgs) -> Result<()> {
    // With a model directory: its tokenizer and chat template (checked as at model load) and its
    // decision config (the wide-choice grouping depends on it).
    let (format, config) = match &args.model_dir {
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
    let body = std::fs::read(&args.request)
        .with_context(|| format!("cannot read {}", args.request.display()))?;
    let rendered = DecisionRequest::parse(&body, &RequestDefaults::default())
        .and_then(|request| render_request(&request, &config));
    let questions = match rendered {
        Ok(questions) => questions,
        Err(error) => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{}", serde_json::to_string_pretty(&error.body())?)?;
            out.flush()?;
            eprintln!(
                "prism render: the API refuses {} (HTTP {})",
                args.request.display(),
                error.status()
            );
            std::process::exit(1);
        }
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut object = serde_json::Map::new();
        for question in &questions {
            object.insert(
                question.name.clone(),
                question_json(question, format.as_ref())?,
            );
        }
        writeln!(out, "{}", serde_json::to_string_pretty(&object)?)?;
    } else {
        for (i, question) in questions.iter().enumerate() {
            if i > 0 {
                writeln!(out)?;
            }
            write_text(&mut out, question, format.as_ref())?;
        }
    }
    out.flush()?;
    Ok(())
}

fn mode_name(mode: ReadMode) -> &'static str {
    match mode {
        ReadMode::SelfAnswered => "self_answered",
        ReadMode::Single => "single",
        ReadMode::Wide => "wide",
    }
}

/// The prompt through the chat template with thinking off, as the model reads it.
fn templated(prompt: &LetterPrompt, format: &PromptFormat) -> Result<RenderedPrompt> {
    let messages = [
        ChatMessage::system(prompt.system.as_str()),
        ChatMessage::user(prompt.user.as_str()),
    ];
    Ok(format.render_and_encode(&messages, false)?)
}

fn prompt_json(prompt: &LetterPrompt, format: Option<&PromptFormat>) -> Result<serde_json::Value> {
    let mut value =
        json!({"system": prompt.system, "user": prompt.user, "order": prompt.option_ids});
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
