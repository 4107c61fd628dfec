//! `prism eval SUITE.jsonl`: the flags, the progress bar, Ctrl-C and the summary line. The runs are
//! `prism_decision::eval::run` (in-process) and `prism_server::eval_client` (`--url`); the output
//! files (`results.json`, `report.md`, `reliability.png`) are `prism_decision::eval::report`. Ctrl-C
//! stops sending, keeps what is answered and writes a partial report (a second Ctrl-C exits at once).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use prism_decision::eval::run::{run_in_process, InProcess};
use prism_decision::eval::{parse_suite, EvalResults};
use prism_server::eval_client::run_http;

/// Arguments of `prism eval`.
// One documented field a flag: alike in shape to the other commands' arguments, each derived by clap
// for its own command.
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

/// Progress on stderr from the first request on: a bar with rate and ETA on a terminal, else a line
/// every tenth of the suite.
struct Progress {
    total: usize,
    done: AtomicUsize,
    /// Set when the run starts: the bar (on a terminal) and the start time.
    started: OnceLock<(Option<ProgressBar>, Instant)>,
}

impl Progress {
    fn new(total: usize) -> Progress {
        Progress {
            total,
            done: AtomicUsize::new(0),
            started: OnceLock::new(),
        }
    }

    fn finish(&self) {
        if let Some((Some(bar), _)) = self.started.get() {
            bar.finish_and_clear();
        }
    }
}

impl prism_decision::eval::run::Progress for Progress {
    fn start(&self) {
        self.started.get_or_init(|| {
            let bar = std::io::stderr().is_terminal().then(|| {
                let target = ProgressDrawTarget::stderr();
                let bar = ProgressBar::with_draw_target(Some(self.total as u64), target);
                if let Ok(style) = ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} items  {per_sec}  ETA {eta}",
                ) {
                    bar.set_style(style);
                }
                bar.enable_steady_tick(Duration::from_millis(200));
                bar
            });
            (bar, Instant::now())
        });
    }

    fn item_done(&self) {
        self.start();
        let done = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        match self.started.get() {
            Some((Some(bar), _)) => bar.inc(1),
            Some((None, started)) => {
                let step = self.total.div_ceil(10).max(1);
                if done % step == 0 || done == self.total {
                    let seconds = started.elapsed().as_secs_f64().max(1e-9);
                    let rate = done as f64 / seconds;
                    let eta = (self.total - done) as f64 / rate.max(1e-9);
                    eprintln!(
                        "eval: {done}/{} items  {rate:.1} items/s  ETA {eta:.0} s",
                        self.total
                    );
                }
            }
            None => {}
        }
    }
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
    let progress = Progress::new(items.len());
    let log = &mut |line: String| eprintln!("{line}");
    let run = match &args.url {
        Some(url) => {
            let key = args
                .api_key
                .clone()
                .or_else(|| std::env::var("PRISM_API_KEY").ok());
            run_http(url, key, args.concurrency, &items, &stop, log, &progress)
        }
        None => {
            let options = InProcess {
                gguf: args.gguf.clone(),
                model_dir: args.model_dir.clone(),
                device: args.device.clone(),
                precision: args.precision.clone(),
                max_tokens: args.max_tokens,
                max_batch_tokens: args.max_batch_tokens,
                concurrency: args.concurrency,
            };
            run_in_process(&options, &items, &stop, log, &progress)
        }
    };
    progress.finish();
    let results = run?.finish(
        args.suite.display().to_string(),
        items.len(),
        args.bins,
        (started.elapsed().as_secs_f64(), stop.load(Ordering::SeqCst)),
        other
            .as_ref()
            .map(|(file, results)| (file.display().to_string(), results)),
        suite.skipped.iter().map(|e| e.to_string()).collect(),
    );
    prism_decision::eval::report::write_all(&args.out, &results)?;
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
