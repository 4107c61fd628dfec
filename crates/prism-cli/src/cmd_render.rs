//! `prism render`: each question's prompt messages (system and user text, option ids in letter order),
//! before the chat template, as [`prism_decision::preview`] renders them (images placed, with
//! `--model-dir` the templated text and token ids). A request the API would refuse prints the API's error
//! body and exits 1.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use prism_decision::preview::preview;
use prism_decision::DecisionError;

use crate::RenderArgs;

/// A refused request as `prism COMMAND` reports it: the API's error body on `out`, a line naming the
/// request file and the HTTP status on stderr.
pub fn print_refusal(
    out: &mut impl Write,
    command: &str,
    request: &Path,
    error: &DecisionError,
) -> Result<()> {
    writeln!(out, "{}", serde_json::to_string_pretty(&error.body())?)?;
    out.flush()?;
    eprintln!(
        "prism {command}: the API refuses {} (HTTP {})",
        request.display(),
        error.status()
    );
    Ok(())
}

pub fn run(args: &RenderArgs) -> Result<()> {
    let body = std::fs::read(&args.request)
        .with_context(|| format!("cannot read {}", args.request.display()))?;
    let mut out = std::io::stdout().lock();
    let rendered = match preview(&body, args.model_dir.as_deref())? {
        Ok(rendered) => rendered,
        Err(error) => {
            print_refusal(&mut out, "render", &args.request, &error)?;
            std::process::exit(1);
        }
    };
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&rendered.to_json()?)?
        )?;
    } else {
        rendered.write_text(&mut out)?;
    }
    out.flush()?;
    Ok(())
}
