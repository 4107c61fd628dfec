//! `prism render`: each question's prompt messages (system and user text, option ids in letter order),
//! before the chat template. A request the API would refuse prints the API's error body and exits 1.

use std::io::Write;

use anyhow::{Context, Result};
use prism_decision::{
    render_request, DecisionConfig, DecisionRequest, LetterPrompt, ReadMode, RenderedQuestion, RequestDefaults,
};
use serde_json::json;

use crate::RenderArgs;

pub fn run(args: &RenderArgs) -> Result<()> {
    if let Some(dir) = &args.model_dir {
        anyhow::bail!(
            "`prism render --model-dir {}`: chat-templated text and token ids are not wired yet; \
             run without --model-dir to see each question's messages",
            dir.display()
        );
    }
    let body = std::fs::read(&args.request).with_context(|| format!("cannot read {}", args.request.display()))?;
    let config = DecisionConfig::default();
    let rendered = DecisionRequest::parse(&body, &RequestDefaults::default())
        .and_then(|request| render_request(&request, &config));
    let questions = match rendered {
        Ok(questions) => questions,
        Err(error) => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{}", serde_json::to_string_pretty(&error.body())?)?;
            out.flush()?;
            eprintln!("prism render: the API refuses {} (HTTP {})", args.request.display(), error.status());
            std::process::exit(1);
        }
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        let object: serde_json::Map<String, serde_json::Value> =
            questions.iter().map(|q| (q.name.clone(), question_json(q))).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&object)?)?;
    } else {
        for (i, question) in questions.iter().enumerate() {
            if i > 0 {
                writeln!(out)?;
            }
            write_text(&mut out, question)?;
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

fn prompt_json(prompt: &LetterPrompt) -> serde_json::Value {
    json!({"system": prompt.system, "user": prompt.user, "order": prompt.option_ids})
}

fn question_json(question: &RenderedQuestion) -> serde_json::Value {
    json!({
        "type": question.kind.as_str(),
        "mode": mode_name(question.mode),
        "prompts": question.prompts.iter().map(prompt_json).collect::<Vec<_>>(),
    })
}

fn write_text(out: &mut impl Write, question: &RenderedQuestion) -> Result<()> {
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
        writeln!(out, "--- options in letter order: {}", prompt.option_ids.join(", "))?;
    }
    Ok(())
}
