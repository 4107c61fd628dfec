//! Experiment: where a request's host time before the first kernel goes — rendering the chat
//! template, and encoding with the full Qwen3.5 vocabulary (the 248k tiktoken ranks of
//! `tests/fixtures/qwen35-vocab`) by the direct encoder against the `tokenizers` pipeline (numbers in
//! docs/optimization-log.md).
//!
//! ```text
//! cargo run --release -p prism-decision --example tokenize_speed [-- REPEATS]
//! ```
//!
//! Texts: the README request's `team` prompt rendered with the tiny fixture's chat template (what
//! `prism bench`'s short scenario renders), and the same with its ticket repeated to ~4 KiB. For each:
//! bytes, tokens, then medians over REPEATS runs (default 200) of rendering the two messages, of
//! `PromptTokenizer::encode_in_one_piece` on the rendered text (the rank backend; the direct encoder)
//! and of `encode_reference` (the `tokenizers` pipeline it replaces), of the split alone (Oniguruma,
//! as the `tokenizers` crate's `onig` feature runs it, with [`QWEN35_SPLIT_REGEX`]; the direct encoder
//! splits ASCII text itself), and of both encodings with the same vocabulary as a `tokenizer.json`
//! with merges (what `prism synth` writes, so what the device's synthetic models encode with; ids
//! checked equal).

use std::path::PathBuf;
use std::time::Instant;

use prism_decision::chat_template::PromptFormat;
use prism_decision::engine::decoder::prompt_messages;
use prism_decision::render::evidence_probe;
use prism_decision::synth_files::{qwen35_vocabulary, tokenizer_json, QWEN35_ADDED_TOKENS};
use prism_decision::tokenizer::{
    shared_cut, AddedTokenSpec, PromptTokenizer, RankedVocabulary, TokenizerJsonPipeline,
    QWEN35_SPLIT_REGEX,
};
use prism_decision::{DecisionConfig, DecisionRequest, DecisionTask, RequestDefaults};
use rayon::prelude::*;

fn median_us(mut f: impl FnMut(), repeats: usize) -> f64 {
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let repeats: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(200);
    // The repository root: the working directory when it holds the fixtures (a binary carried to
    // another machine), else the one this was built in.
    let root = if std::path::Path::new("tests/fixtures/qwen35-tiny").is_dir() {
        PathBuf::from(".")
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    };
    let tiny = root.join("tests/fixtures/qwen35-tiny");
    let format = PromptFormat::load_from_model_dir(&tiny, None)?;
    let config = DecisionConfig::from_model_dir(&tiny)?;
    let ranks_path = root.join("tests/fixtures/qwen35-vocab/qwen3_6.tiktoken");
    let ranks = RankedVocabulary::parse_tiktoken(&std::fs::read_to_string(&ranks_path)?)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    // The release's added tokens after the ranks, as `prism synth` numbers them.
    let added: Vec<AddedTokenSpec> = QWEN35_ADDED_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| AddedTokenSpec {
            id: (ranks.len() + i) as u32,
            content: content.to_string(),
            special: *special,
        })
        .collect();
    let tok = PromptTokenizer::from_tiktoken_file(&ranks_path, &added)?;
    // The same vocabulary as `prism synth` writes it (tokenizer.json with merges derived from the
    // ranks): what the synthetic models on the device encode with.
    let synth_json = tokenizer_json(&qwen35_vocabulary(&ranks, 248_320)?);
    let merges_tok = PromptTokenizer::from_tokenizer_json_bytes(
        &serde_json::to_vec(&synth_json)?,
        std::path::Path::new("synthetic tokenizer.json"),
        TokenizerJsonPipeline::Qwen35,
    )?;
    let split = onig::Regex::new(QWEN35_SPLIT_REGEX)?;

    let body: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        root.join("examples/request.json"),
    )?)?;
    let mut long_body = body.clone();
    let ticket = body["state"]["ticket"].as_str().unwrap_or_default();
    let mut long_ticket = ticket.to_string();
    while long_ticket.len() + ticket.len() < 3400 {
        long_ticket.push('\n');
        long_ticket.push_str(ticket);
    }
    long_body["state"]["ticket"] = serde_json::Value::String(long_ticket);

    println!(
        "prompt   bytes  tokens  render µs  encode µs  µs/token  tokenizers µs  onig split µs  merges-file encode µs  first µs  tokenizers µs"
    );
    for (name, body) in [("short", &body), ("~4 KiB", &long_body)] {
        let request =
            DecisionRequest::parse(&serde_json::to_vec(body)?, &RequestDefaults::default())?;
        let mut task = DecisionTask::new(request, &config)?;
        let prompts = task.next_prompts();
        let prompt = prompts
            .iter()
            .find(|p| p.user.contains("Which team"))
            .or(prompts.first())
            .ok_or_else(|| anyhow::anyhow!("the request renders no prompt"))?;
        let messages = prompt_messages(prompt);
        let text = format.render_chat(&messages, false)?;
        let tokens = tok.encode_in_one_piece(&text)?.len();
        let render = median_us(
            || {
                let _ = std::hint::black_box(format.render_chat(&messages, false));
            },
            repeats,
        );
        let encode = median_us(
            || {
                let _ = std::hint::black_box(tok.encode_in_one_piece(&text));
            },
            repeats,
        );
        let ids = tok.encode_in_one_piece(&text)?;
        // The merge-list encoder keeps the pieces it merged: its first encoding of a text merges
        // every new piece (the short text comes first: nothing is kept yet).
        let first = Instant::now();
        let merged = merges_tok.encode_in_one_piece(&text)?;
        let merges_first_us = first.elapsed().as_secs_f64() * 1e6;
        anyhow::ensure!(merged == ids, "the two backends disagree on {name}");
        let merges_us = median_us(
            || {
                let _ = std::hint::black_box(merges_tok.encode_in_one_piece(&text));
            },
            repeats,
        );
        let reference_us = median_us(
            || {
                let _ = std::hint::black_box(tok.encode_reference(&text));
            },
            repeats,
        );
        let merges_reference_us = median_us(
            || {
                let _ = std::hint::black_box(merges_tok.encode_reference(&text));
            },
            repeats,
        );
        let split_us = median_us(
            || {
                let n = split.find_iter(&text).count();
                std::hint::black_box(n);
            },
            repeats,
        );
        println!(
            "{name:<7} {:>6} {tokens:>7} {render:>10.1} {encode:>10.1} {:>9.2} {reference_us:>14.1} {split_us:>14.1} {merges_us:>22.1} {merges_first_us:>9.1} {merges_reference_us:>14.1}",
            text.len(),
            encode / tokens.max(1) as f64,
        );
        // What `Engine::prepare` encodes: every prompt of the request and the evidence probe, their
        // common beginning once (`encode_sharing`), against each text on its own thread.
        let mut with_probe = prompts.clone();
        with_probe.push(evidence_probe(task.evidence()));
        let texts = with_probe
            .iter()
            .map(|p| format.render_chat(&prompt_messages(p), false))
            .collect::<Result<Vec<String>, _>>()?;
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let shared = median_us(
            || {
                let _ = std::hint::black_box(merges_tok.encode_sharing(&refs));
            },
            repeats,
        );
        let each = median_us(
            || {
                let all: Vec<_> = refs.par_iter().map(|t| merges_tok.encode(t)).collect();
                std::hint::black_box(all);
            },
            repeats,
        );
        // The rest of what `Engine::prepare` does before encoding: the task and its prompts, the
        // probe, rendering every text.
        let bytes = serde_json::to_vec(body)?;
        let task_us = median_us(
            || {
                let request = DecisionRequest::parse(&bytes, &RequestDefaults::default());
                if let Ok(request) = request {
                    if let Ok(mut task) = DecisionTask::new(request, &config) {
                        let prompts = task.next_prompts();
                        std::hint::black_box((prompts, evidence_probe(task.evidence())));
                    }
                }
            },
            repeats,
        );
        let render_all = median_us(
            || {
                for p in &with_probe {
                    let _ = std::hint::black_box(format.render_chat(&prompt_messages(p), false));
                }
            },
            repeats,
        );
        println!(
            "{name:<7} parse + task + prompts + probe {task_us:.1} µs, rendering the {} texts {render_all:.1} µs",
            with_probe.len()
        );
        println!(
            "{name:<7} prompts + probe: {} texts of {:?} bytes, shared cut at {:?}: encode_sharing {shared:.1} µs, each on its own thread {each:.1} µs",
            refs.len(),
            refs.iter().map(|t| t.len()).collect::<Vec<_>>(),
            shared_cut(&refs),
        );
    }
    Ok(())
}
