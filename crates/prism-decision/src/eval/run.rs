//! `prism eval`'s in-process run: the model loaded as `prism serve` loads it, an engine with many
//! requests in flight (so that they share passes), each answer read by [`super::answers_from_response`].
//! The HTTP run (`prism eval --url`) is `prism_server::eval_client`; both give a [`Run`], which
//! [`Run::finish`] turns into [`EvalResults`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result};
use prism_model::LoadOptions;
use serde_json::json;

use super::{compare, summarize, EvalResults, ItemResult, ItemStatus, SuiteItem};
use crate::engine::{Engine, EngineOptions, JobResult};
use crate::{CancelToken, DecisionError, DecoderLetterModel, JobError, SubmitError};

/// What a run gives: each item's result (None: not run), and what the run was (`results.json`'s `run`).
pub struct Run {
    pub results: Vec<Option<ItemResult>>,
    pub info: serde_json::Value,
}

impl Run {
    /// The run's results: the summary over the suite's `suite_items` items, the comparison with an
    /// earlier run (its file name and results), the time it took and whether it was interrupted.
    pub fn finish(
        self,
        suite: String,
        suite_items: usize,
        bins: usize,
        (seconds, interrupted): (f64, bool),
        other: Option<(String, &EvalResults)>,
        skipped_lines: Vec<String>,
    ) -> EvalResults {
        let done: Vec<ItemResult> = self.results.into_iter().flatten().collect();
        let summary = summarize(suite_items, &done, bins);
        let comparison = other.map(|(name, results)| compare(&name, &done, &results.items));
        let mut info = self.info;
        if let Some(object) = info.as_object_mut() {
            object.insert("seconds".into(), json!(seconds));
            object.insert(
                "items_per_second".into(),
                json!(done.len() as f64 / seconds.max(1e-9)),
            );
            object.insert("interrupted".into(), json!(interrupted));
        }
        EvalResults {
            prism_eval: 1,
            suite,
            run: info,
            summary,
            compare: comparison,
            skipped_lines,
            items: done,
        }
    }
}

/// What a run reports as it goes: once when the first request is sent, once per item that ends.
pub trait Progress: Sync {
    fn start(&self);
    fn item_done(&self);
}

/// The in-process run's model and engine (`prism eval`'s flags).
// `prism eval`'s flags as plain fields: alike in shape only to the other option structs (`LogitsOptions`, ...).
#[derive(Clone, Debug, Default)]
pub struct InProcess {
    pub gguf: Option<PathBuf>,
    pub model_dir: Option<PathBuf>,
    /// `--device`; default `auto`.
    pub device: Option<String>,
    /// `--precision`; default f32 on the CPU, auto on a GPU.
    pub precision: Option<String>,
    pub max_tokens: usize,
    pub max_batch_tokens: usize,
    /// Requests in flight; default 64.
    pub concurrency: Option<usize>,
}

/// Loads the model and runs `items` through an engine until all are answered or `stop` is set.
/// `log` gets the lines to show (which model, notes).
pub fn run_in_process(
    options: &InProcess,
    items: &[SuiteItem],
    stop: &AtomicBool,
    log: &mut dyn FnMut(String),
    progress: &dyn Progress,
) -> Result<Run> {
    let (source, demo) = crate::setup::model_source(
        &options.gguf,
        &options.model_dir,
        "pass --gguf FILE [--model-dir DIR] or --url URL",
    )?;
    if demo {
        log(format!(
            "eval: no --gguf or --url given, so this runs the bundled DEMO model ({}): random weights, \
             meaningless answers",
            source.gguf.display()
        ));
    }
    let (device, fallback) =
        crate::setup::open_device(options.device.as_deref().unwrap_or("auto"), &[])?;
    if let Some(error) = fallback {
        log(format!(
            "  (no usable CUDA GPU: {error}; serving on the CPU)"
        ));
    }
    let on_gpu = !device.is_cpu();
    let asked = options
        .precision
        .clone()
        .unwrap_or_else(|| if on_gpu { "auto" } else { "f32" }.to_string());
    let (precision, note) = crate::setup::resolve_precision(&asked, &source, on_gpu)?;
    if let Some(note) = note {
        log(format!("eval: {note}"));
    }
    let load = LoadOptions {
        device,
        precision,
        ..LoadOptions::default()
    };
    log(format!(
        "eval: loading {} ({}, {})",
        source.gguf.display(),
        if on_gpu { "GPU" } else { "CPU" },
        precision.as_str()
    ));
    let loaded = DecoderLetterModel::load(&source, &load, options.max_tokens)
        .with_context(|| format!("loading the decision model {}", source.gguf.display()))?;
    let model = loaded.model;
    let name = crate::LetterModel::model_name(&model).to_string();
    let encoder = model.encoder();
    let concurrency = options.concurrency.unwrap_or(64);
    let (engine, worker) = Engine::start(
        model,
        encoder,
        loaded.config,
        EngineOptions {
            max_prompt_tokens: options.max_tokens,
            max_batch_tokens: options.max_batch_tokens,
            queue_size: concurrency + 1,
            ..EngineOptions::default()
        },
        None,
    )?;
    let results = drive_engine(&engine, items, concurrency, stop, progress);
    drop(engine);
    worker.join();
    Ok(Run {
        results,
        info: json!({
            "mode": "in-process",
            "model": name,
            "gguf": source.gguf.display().to_string(),
            "demo": demo,
            "device": if on_gpu { "cuda" } else { "cpu" },
            "precision": precision.as_str(),
            "concurrency": concurrency,
        }),
    })
}

/// Keeps up to `concurrency` requests in the engine until every item is answered or `stop` is set
/// (then the requests in flight are cancelled and come back as not run).
pub fn drive_engine(
    engine: &Engine,
    items: &[SuiteItem],
    concurrency: usize,
    stop: &AtomicBool,
    progress: &dyn Progress,
) -> Vec<Option<ItemResult>> {
    progress.start();
    let mut results: Vec<Option<ItemResult>> = vec![None; items.len()];
    let (tx, rx) = mpsc::channel::<(usize, Result<Vec<u8>, JobError>)>();
    let mut in_flight: HashMap<usize, CancelToken> = HashMap::new();
    let mut next = 0;
    let mut cancelled = false;
    loop {
        while !stop.load(Ordering::SeqCst) && in_flight.len() < concurrency && next < items.len() {
            let i = next;
            let item = &items[i];
            let prepared = item
                .decision_request()
                .and_then(|request| engine.prepare(request));
            let prepared = match prepared {
                Ok(prepared) => prepared,
                Err(error) => {
                    results[i] = Some(ItemResult::not_answered(
                        item,
                        ItemStatus::Refused,
                        error.to_string(),
                    ));
                    progress.item_done();
                    next += 1;
                    continue;
                }
            };
            let cancel = CancelToken::default();
            let tx = tx.clone();
            let reply = Box::new(move |result: JobResult| {
                let body = result.and_then(|output| {
                    serde_json::to_vec(&output.response)
                        .map_err(|e| JobError::Decision(DecisionError::ModelOutput(e.to_string())))
                });
                let _ = tx.send((i, body));
            });
            match engine.submit(prepared, reply, None, cancel.clone()) {
                Ok(()) => {
                    in_flight.insert(i, cancel);
                    next += 1;
                }
                Err(SubmitError::QueueFull { .. }) => break,
                Err(SubmitError::ShuttingDown) => {
                    results[i] = Some(ItemResult::not_answered(
                        item,
                        ItemStatus::Failed,
                        "the engine stopped".into(),
                    ));
                    progress.item_done();
                    next += 1;
                }
            }
        }
        if in_flight.is_empty() && (next >= items.len() || stop.load(Ordering::SeqCst)) {
            break;
        }
        if stop.load(Ordering::SeqCst) && !cancelled {
            for token in in_flight.values() {
                token.cancel();
            }
            cancelled = true;
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((i, result)) => {
                in_flight.remove(&i);
                let item = &items[i];
                results[i] = match result {
                    Ok(body) => Some(super::answers_from_response(item, &body).unwrap_or_else(
                        |e| ItemResult::not_answered(item, ItemStatus::Failed, e.to_string()),
                    )),
                    Err(JobError::Cancelled) | Err(JobError::DeadlineExceeded) => None,
                    Err(JobError::Decision(error)) => {
                        let status = if error.status() < 500 {
                            ItemStatus::Refused
                        } else {
                            ItemStatus::Failed
                        };
                        Some(ItemResult::not_answered(item, status, error.to_string()))
                    }
                };
                if results[i].is_some() {
                    progress.item_done();
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    results
}
