//! `prism decide`: answer one `/v1/systemone` request on this machine and print the response body.
//!
//! The whole product path without the HTTP layer, through the same engine as `prism serve`: parse and
//! validate the request, render each question, chat-template and tokenize, run the decoder (shared
//! evidence prefix computed once), read the letters. Images are read as `prism serve` reads them, by the
//! vision tower of `--mmproj` or the one `mmproj-*.gguf` in `--model-dir`.
//! Without `--gguf` it uses the tiny model bundled in the repository (random weights: the answers mean
//! nothing, but every number is checked against transformers in the test suite).

use anyhow::{Context, Result};
use prism_decision::engine::{Engine, EngineDecideError, EngineOptions};
use prism_decision::setup::open_device;
use prism_decision::{DecisionRequest, DecoderLetterModel, RequestDefaults};
use prism_model::{LoadOptions, Precision};
use std::io::Write;

use crate::DecideArgs;

pub fn run(args: &DecideArgs) -> Result<()> {
    // The same flags and model-source rule as `prism serve` (`ModelFiles`).
    let (source, demo) = args.files.source()?;
    if demo {
        tracing::info!(
            "no --gguf given: using the bundled tiny random-weight model {}",
            source.gguf.display()
        );
    }
    let precision = if args.precision == "auto" {
        let gguf = prism_gguf::GgufFile::open(&source.gguf)
            .with_context(|| format!("opening {}", source.gguf.display()))?;
        Precision::resolve("auto", &gguf)?
    } else {
        Precision::parse(&args.precision)?
    };
    let (device, fallback) = open_device(&args.device, &[])?;
    if let Some(error) = fallback {
        println!("  (no usable CUDA GPU: {error}; serving on the CPU)");
    }
    let options = LoadOptions {
        device,
        precision,
        ..LoadOptions::default()
    };
    tracing::info!("loading {}", source.gguf.display());
    let loaded = DecoderLetterModel::load(&source, &options, args.max_tokens)
        .with_context(|| format!("loading the decision model {}", source.gguf.display()))?;
    let model = loaded.model;
    tracing::info!("ready: {}", prism_decision::LetterModel::model_name(&model));
    let encoder = model.encoder();
    let (engine, worker) = Engine::start(
        model,
        encoder,
        loaded.config,
        EngineOptions {
            max_prompt_tokens: args.max_tokens,
            ..EngineOptions::default()
        },
        None,
    )?;

    let body = std::fs::read(&args.request)
        .with_context(|| format!("cannot read {}", args.request.display()))?;
    let result = match DecisionRequest::parse(&body, &RequestDefaults::default()) {
        Ok(request) => match engine.decide(request, None) {
            Ok(output) => Ok(output.response),
            Err(EngineDecideError::Decision(error))
            | Err(EngineDecideError::Job(prism_decision::JobError::Decision(error))) => Err(error),
            Err(other) => return Err(other.into()),
        },
        Err(error) => Err(error),
    };
    drop(engine);
    worker.join();
    let mut out = std::io::stdout().lock();
    match result {
        Ok(response) => {
            writeln!(out, "{}", serde_json::to_string_pretty(&response)?)?;
            out.flush()?;
            Ok(())
        }
        Err(error) => {
            crate::cmd_render::print_refusal(&mut out, "decide", &args.request, &error)?;
            std::process::exit(1);
        }
    }
}
