//! `prism eval SUITE.jsonl`: run a labelled suite in bulk and report accuracy, calibration and, against
//! an earlier run, agreement and probability drift.
//!
//! The requests go through the in-process engine (the same step loop as `prism serve`, with many requests
//! in flight so that they share passes) or to any `/v1/systemone` server (`--url`, `--concurrency`
//! clients). Either way each response body is read by `prism_decision::eval`, so the same answers give
//! the same `results.json`. Output in `--out`: `results.json`, `report.md`, `reliability.png`
//! (`eval_report.rs`). Ctrl-C stops sending, keeps what is answered and writes a partial report (a
//! second Ctrl-C exits at once).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use prism_decision::engine::{Engine, EngineOptions};
use prism_decision::eval::{
    answers_from_response, compare, parse_suite, summarize, EvalResults, ItemResult, ItemStatus,
    SuiteItem,
};
use prism_decision::{CancelToken, DecoderLetterModel, JobError, SubmitError};
use prism_model::LoadOptions;
use serde_json::json;

use crate::eval_report;

/// Arguments of `prism eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// The suite: one JSON object a line, `{"id", "request", "labels", "tags"}` (README, `prism eval`),
    /// or a sys1bench manifest.
    pub suite: PathBuf,
    /// Where to write results.json, report.md and reliability.png (created if missing).
    #[arg(long, default_value = "eval-out")]
    pub out: PathBuf,
    /// Evaluate this server (its base URL, e.g. http://127.0.0.1:8092) instead of a model in-process.
    #[arg(long, conflicts_with_all = ["gguf", "model_dir", "precision", "device"])]
    pub url: Option<String>,
    /// Sent as `Authorization: Bearer KEY` (with --url). Default: $PRISM_API_KEY.
    #[arg(long, requires = "url")]
    pub api_key: Option<String>,
    /// Requests in flight at once. Default: 8 clients with --url, 64 requests in-process (the engine
    /// packs them into shared passes).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// The model's GGUF file (in-process). Default: the bundled demo model (random weights).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// The model directory (tokenizer, chat template, config.json, decision_config.json).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Arithmetic of the forward pass, as for `prism serve`: f32, bf16, f64, int8, w4a8, auto.
    /// Default: f32 on the CPU, auto on a GPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// Where the model runs: auto, cpu or cuda.
    #[arg(long)]
    pub device: Option<String>,
    /// The longest prompt accepted, in tokens (in-process).
    #[arg(long, default_value_t = 32768)]
    pub max_tokens: usize,
    /// Most tokens in one forward pass (in-process).
    #[arg(long, default_value_t = 8192)]
    pub max_batch_tokens: usize,
    /// Equal-width bins of the ECE and the reliability diagram.
    #[arg(long, default_value_t = 10)]
    pub bins: usize,
    /// An earlier run's results.json (or its directory): report decision agreement, |Δp| and the
    /// items whose decision flipped.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Pass over bad suite lines (listed in the report) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad: bool,
    /// Run only the first N items.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// Progress on stderr: a bar with rate and ETA on a terminal, else a line every tenth of the suite.
struct Progress {
    bar: Option<ProgressBar>,
    total: usize,
    done: AtomicUsize,
    started: Instant,
}

impl Progress {
    fn new(total: usize) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} items  {per_sec}  ETA {eta}",
            ) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress {
            bar,
            total,
            done: AtomicUsize::new(0),
            started: Instant::now(),
        }
    }

    fn inc(&self) {
        let done = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        match &self.bar {
            Some(bar) => bar.inc(1),
            None => {
                let step = self.total.div_ceil(10).max(1);
                if done % step == 0 || done == self.total {
                    let seconds = self.started.elapsed().as_secs_f64().max(1e-9);
                    let rate = done as f64 / seconds;
                    let eta = (self.total - done) as f64 / rate.max(1e-9);
                    eprintln!(
                        "eval: {done}/{} items  {rate:.1} items/s  ETA {eta:.0} s",
                        self.total
                    );
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// What a run gives: each item's result (None: not run), and what the run was.
struct Run {
    results: Vec<Option<ItemResult>>,
    info: serde_json::Value,
}

pub fn run(args: &EvalArgs) -> Result<()> {
    if args.bins == 0 {
        bail!("--bins must be at least 1");
    }
    if args.concurrency == Some(0) {
        bail!("--concurrency must be at least 1");
    }
    let text = std::fs::read_to_string(&args.suite)
        .with_context(|| format!("cannot read the suite {}", args.suite.display()))?;
    let suite = parse_suite(&text, args.skip_bad).with_context(|| {
        format!(
            "{}: a bad suite line (--skip-bad passes over bad lines)",
            args.suite.display()
        )
    })?;
    for bad in &suite.skipped {
        eprintln!("eval: skipped {}: {bad}", args.suite.display());
    }
    let mut items = suite.items;
    if let Some(limit) = args.limit {
        items.truncate(limit);
    }
    if items.is_empty() {
        bail!("{}: no items to run", args.suite.display());
    }
    // Read the other run first: a bad --compare file should not cost a whole run.
    let other = match &args.compare {
        Some(path) => {
            let file = if path.is_dir() {
                path.join("results.json")
            } else {
                path.clone()
            };
            let bytes = std::fs::read(&file)
                .with_context(|| format!("cannot read --compare {}", file.display()))?;
            let results = EvalResults::from_bytes(&bytes)
                .with_context(|| format!("--compare {}", file.display()))?;
            Some((file, results))
        }
        None => None,
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create --out {}", args.out.display()))?;

    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                eprintln!("\neval: interrupted again; exiting without a report");
                std::process::exit(130);
            }
            eprintln!("\neval: interrupted; finishing the requests in flight, then writing a partial report (Ctrl-C again to quit at once)");
        })
        .context("installing the Ctrl-C handler")?;
    }

    let started = Instant::now();
    let run = match &args.url {
        Some(url) => run_http(args, url, &items, &stop)?,
        None => run_in_process(args, &items, &stop)?,
    };
    let seconds = started.elapsed().as_secs_f64();
    let done: Vec<ItemResult> = run.results.into_iter().flatten().collect();
    let summary = summarize(items.len(), &done, args.bins);
    let comparison = other
        .as_ref()
        .map(|(file, results)| compare(&file.display().to_string(), &done, &results.items));
    let mut info = run.info;
    if let Some(object) = info.as_object_mut() {
        object.insert("seconds".into(), json!(seconds));
        object.insert(
            "items_per_second".into(),
            json!(done.len() as f64 / seconds.max(1e-9)),
        );
        object.insert("interrupted".into(), json!(stop.load(Ordering::SeqCst)));
    }
    let results = EvalResults {
        prism_eval: 1,
        suite: args.suite.display().to_string(),
        run: info,
        summary,
        compare: comparison,
        skipped_lines: suite.skipped.iter().map(|e| e.to_string()).collect(),
        items: done,
    };
    eval_report::write_all(&args.out, &results)?;
    print_summary(&results, &args.out);
    if !results.summary.complete {
        eprintln!(
            "eval: PARTIAL: {} of {} items run (interrupted)",
            results.items.len(),
            results.summary.suite_items
        );
        std::process::exit(130);
    }
    Ok(())
}

fn fmt(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.4}"))
}

fn print_summary(results: &EvalResults, out: &Path) {
    let s = &results.summary;
    println!(
        "{} items answered ({} refused, {} failed{}), {} labelled questions: accuracy {}  ECE {}  Brier {}  log loss {}{}",
        s.items,
        s.refused,
        s.failed,
        if s.complete { String::new() } else { format!(", {} NOT RUN", s.not_run) },
        s.questions,
        fmt(s.accuracy),
        fmt(s.ece),
        fmt(s.brier),
        fmt(s.log_loss),
        s.score_mae.map_or(String::new(), |m| format!("  score MAE {m:.4}")),
    );
    if let Some(c) = &results.compare {
        println!(
            "vs {}: {} of {} decisions agree ({}), mean |Δp| {}, max |Δp| {}, {} flipped",
            c.other,
            c.agreeing,
            c.questions,
            fmt(c.agreement),
            fmt(c.mean_abs_dp),
            fmt(c.max_abs_dp),
            c.flipped.len()
        );
    }
    println!(
        "wrote {0}/results.json, {0}/report.md, {0}/reliability.png",
        out.display()
    );
}

fn run_in_process(args: &EvalArgs, items: &[SuiteItem], stop: &AtomicBool) -> Result<Run> {
    let (source, demo) = crate::cmd_serve::model_source(
        &args.gguf,
        &args.model_dir,
        "pass --gguf FILE [--model-dir DIR] or --url URL",
    )?;
    if demo {
        eprintln!(
            "eval: no --gguf or --url given, so this runs the bundled DEMO model ({}): random weights, \
             meaningless answers",
            source.gguf.display()
        );
    }
    let device = crate::cmd_serve::open_device(args.device.as_deref().unwrap_or("auto"), &[])?;
    let on_gpu = !device.is_cpu();
    let asked = args
        .precision
        .clone()
        .unwrap_or_else(|| if on_gpu { "auto" } else { "f32" }.to_string());
    let (precision, note) = crate::cmd_serve::resolve_precision(&asked, &source, on_gpu)?;
    if let Some(note) = note {
        eprintln!("eval: {note}");
    }
    let options = LoadOptions {
        device,
        precision,
        ..LoadOptions::default()
    };
    eprintln!(
        "eval: loading {} ({}, {})",
        source.gguf.display(),
        if on_gpu { "GPU" } else { "CPU" },
        precision.as_str()
    );
    let loaded = DecoderLetterModel::load(&source, &options, args.max_tokens)
        .with_context(|| format!("loading the decision model {}", source.gguf.display()))?;
    let model = loaded.model;
    let name = prism_decision::LetterModel::model_name(&model).to_string();
    let encoder = model.encoder();
    let concurrency = args.concurrency.unwrap_or(64);
    let (engine, worker) = Engine::start(
        model,
        encoder,
        loaded.config,
        EngineOptions {
            max_prompt_tokens: args.max_tokens,
            max_batch_tokens: args.max_batch_tokens,
            queue_size: concurrency + 1,
            ..EngineOptions::default()
        },
        None,
    )?;
    let results = drive_engine(&engine, items, concurrency, stop);
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
fn drive_engine(
    engine: &Engine,
    items: &[SuiteItem],
    concurrency: usize,
    stop: &AtomicBool,
) -> Vec<Option<ItemResult>> {
    let progress = Progress::new(items.len());
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
                    progress.inc();
                    next += 1;
                    continue;
                }
            };
            let cancel = CancelToken::default();
            let tx = tx.clone();
            let reply = Box::new(move |result: prism_decision::engine::JobResult| {
                let body = result.and_then(|output| {
                    serde_json::to_vec(&output.response).map_err(|e| {
                        JobError::Decision(prism_decision::DecisionError::ModelOutput(
                            e.to_string(),
                        ))
                    })
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
                    progress.inc();
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
                    Ok(body) => Some(answers_from_response(item, &body).unwrap_or_else(|e| {
                        ItemResult::not_answered(item, ItemStatus::Failed, e.to_string())
                    })),
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
                    progress.inc();
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    progress.finish();
    results
}

/// The decide endpoint of a server given by its base URL (or by the endpoint itself).
fn endpoint(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.ends_with("/v1/systemone") || url.ends_with("/v1/decisions") {
        url.to_string()
    } else {
        format!("{url}/v1/systemone")
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into()
}

/// One item over HTTP: retried on 503 (overloaded) and on transport errors, up to 5 tries.
fn send_item(
    agent: &ureq::Agent,
    url: &str,
    key: Option<&str>,
    item: &SuiteItem,
    stop: &AtomicBool,
) -> Option<ItemResult> {
    let mut last_error = String::new();
    for attempt in 0..5 {
        if attempt > 0 {
            if stop.load(Ordering::SeqCst) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(250 << attempt));
        }
        let mut request = agent.post(url).header("Content-Type", "application/json");
        if let Some(key) = key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        let mut response = match request.send(item.body.as_bytes()) {
            Ok(response) => response,
            Err(error) => {
                last_error = format!("HTTP request failed: {error}");
                continue;
            }
        };
        let status = response.status().as_u16();
        let body = match response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
        {
            Ok(body) => body,
            Err(error) => {
                last_error = format!("reading the response failed: {error}");
                continue;
            }
        };
        if status == 200 {
            return Some(answers_from_response(item, &body).unwrap_or_else(|e| {
                ItemResult::not_answered(item, ItemStatus::Failed, e.to_string())
            }));
        }
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(300).collect());
        last_error = format!("HTTP {status}: {message}");
        if status == 503 {
            continue;
        }
        let kind = if (400..500).contains(&status) {
            ItemStatus::Refused
        } else {
            ItemStatus::Failed
        };
        return Some(ItemResult::not_answered(item, kind, last_error));
    }
    Some(ItemResult::not_answered(
        item,
        ItemStatus::Failed,
        last_error,
    ))
}

fn run_http(args: &EvalArgs, url: &str, items: &[SuiteItem], stop: &AtomicBool) -> Result<Run> {
    let endpoint = endpoint(url);
    let key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("PRISM_API_KEY").ok())
        .filter(|k| !k.trim().is_empty());
    let concurrency = args.concurrency.unwrap_or(8);
    // What the server says it is (best effort: any /v1/systemone server may not have /v1/models).
    let base = endpoint
        .trim_end_matches("/v1/systemone")
        .trim_end_matches("/v1/decisions")
        .to_string();
    let models = {
        let mut request = agent().get(&format!("{base}/v1/models"));
        if let Some(key) = &key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        request
            .call()
            .ok()
            .filter(|r| r.status().as_u16() == 200)
            .and_then(|mut r| r.body_mut().read_to_vec().ok())
            .and_then(|body| serde_json::from_slice::<serde_json::Value>(&body).ok())
    };
    let model = models.as_ref().and_then(|m| m["models"].get(0).cloned());
    eprintln!(
        "eval: {} items against {endpoint} ({concurrency} clients)",
        items.len()
    );
    let progress = Progress::new(items.len());
    let results: Mutex<Vec<Option<ItemResult>>> = Mutex::new(vec![None; items.len()]);
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..concurrency.min(items.len()) {
            scope.spawn(|| {
                let agent = agent();
                loop {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= items.len() {
                        break;
                    }
                    let result = send_item(&agent, &endpoint, key.as_deref(), &items[i], stop);
                    if result.is_some() {
                        progress.inc();
                    }
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = result;
                }
            });
        }
    });
    progress.finish();
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(Run {
        results,
        info: json!({
            "mode": "http",
            "url": endpoint,
            "model": model.as_ref().and_then(|m| m["name"].as_str()),
            "precision": model.as_ref().and_then(|m| m["precision"].as_str()),
            "demo": model.as_ref().and_then(|m| m["demo"].as_bool()),
            "concurrency": concurrency,
        }),
    })
}
