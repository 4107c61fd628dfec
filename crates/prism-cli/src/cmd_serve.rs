//! `prism serve`: the `/v1/systemone` HTTP server, on a GPU when there is one, else on the CPU.
//!
//! Loads the model (the bundled random-weight demo model when no `--gguf` is given), starts the engine,
//! runs one warm-up read-out through the whole path, binds, prints `Ready` with the endpoints and a curl
//! line, and serves until SIGTERM or Ctrl-C, after which the requests in flight are finished before the
//! process exits. Progress goes to stdout (the tests read the `Ready on http://ADDR` line); logs go to
//! stderr.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::{ArgAction, Args};
use prism_decision::engine::{Engine, EngineObserver, EngineOptions, PrefixCacheLimits};
use prism_decision::{
    DecisionRequest, DecoderLetterModel, Family, LetterModel, ModelSource, RequestDefaults,
};
use prism_model::{KvStorage, LoadOptions, LoadProgress, Precision};
use prism_server::{
    router, serve, ConnectionLimits, Counters, Metrics, ModelInfo, ServerConfig, Stats,
};

/// Arguments of `prism serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// The model's GGUF file. Default: the bundled demo model (tiny, random weights: meaningless answers).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// The model directory (tokenizer, chat template, config.json, decision_config.json). Without it the
    /// tokenizer and chat template come from the GGUF and the decision config takes its defaults.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Address to bind. The default serves this machine only; give e.g. 0.0.0.0 to serve the network.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0: any free port; the Ready line says which).
    #[arg(long, default_value_t = 8092)]
    pub port: u16,
    /// Where the model runs: `auto` (a CUDA GPU when this binary has the `cuda` feature and one is
    /// visible, else the CPU), `cpu` or `cuda`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Which GPUs (`--gpus 0`, or `--gpus 0,1,2,3`: one engine replica per GPU behind the one server,
    /// each request sent to the replica that last took its evidence, else to the least loaded).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// Engine replicas on each device (each loads the model and runs its own passes and prefix cache):
    /// several on one GPU or on the CPU share it (for functional tests; a replica per GPU is the fast
    /// layout).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Arithmetic of the forward pass: f32, bf16, int8, w4a8 or auto (as `prism decide`). Default: f32
    /// on the CPU; `auto` on a GPU, which runs a Q8_0 file at int8 (exact, batch-invariant) and any
    /// other file at bf16 (w4a8 on a GPU has only its simple kernel so far: ask for it by name).
    #[arg(long)]
    pub precision: Option<String>,
    /// Threads that load decoder layers at once (default: the machine's cores, at most 8).
    #[arg(long)]
    pub load_threads: Option<usize>,
    /// Store attention keys and values as fp8 (e4m3, one f32 scale per token and KV head): about half
    /// the K/V memory of bf16, so more thoughts and cached evidence fit; answers stay batch-invariant
    /// but move slightly (docs/kv-fp8.md). On the CPU and on GPUs of compute capability 8.9 or newer
    /// (Ada, Hopper); refused at load on older GPUs.
    #[arg(long)]
    pub kv_fp8: bool,
    /// Most questions in one request; more are refused (HTTP 422 naming `questions`).
    #[arg(long, default_value_t = 128)]
    pub max_questions: usize,
    /// Most prompt tokens in one request, all its questions together; more are refused (HTTP 422).
    #[arg(long, default_value_t = 262_144)]
    pub max_request_tokens: usize,
    /// Most tokens computed in one forward pass; requests are packed into passes up to it, and longer
    /// evidence is computed in chunks. (On the H200, 27B bf16 passes of ~10-16k tokens from many
    /// requests ran out of memory on 2026-12-01; 8,192 is the default until that is understood.)
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Most sequence states one forward pass makes: one per prompt read out, one per evidence computed.
    /// On a GPU this bounds a pass's memory. Default: 1024 on the CPU; on a GPU as many as a sixth of
    /// the device memory left after the model and the prefix cache holds (at least 8).
    #[arg(long)]
    pub max_prompts_per_pass: Option<usize>,
    /// Most tokens the prefix cache of evidence states keeps (0: no cache).
    #[arg(long, default_value_t = 65536)]
    pub prefix_cache_tokens: usize,
    /// Most bytes the prefix cache keeps. Default: 2 GiB on the CPU; on a GPU an eighth of the device
    /// memory free after loading.
    #[arg(long)]
    pub prefix_cache_bytes: Option<u64>,
    /// The longest prompt accepted, in tokens; a longer question is refused (HTTP 422) before any model
    /// work, and without tokenizing when its text's length alone proves it (no token of the model
    /// stands for more than its longest token's bytes). It is not derived from --timeout: a prompt the
    /// device cannot compute within --timeout gets a 504 at the deadline and its work stops at the next
    /// pass (the CPU demo computes ~30k tokens in ~100 s).
    #[arg(long, default_value_t = 32768)]
    pub max_tokens: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (else 401). Default: the
    /// PRISM_API_KEY environment variable, if set.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Largest request body in bytes, compressed or not (413 beyond).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Requests that may wait for the model; beyond that the server answers 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue_size: usize,
    /// Seconds from a request's arrival to its answer: a request not answered by then gets 504 (408 if
    /// its body is still arriving), even when the pass that finishes it ends just after. Its work stops
    /// at the engine's first step after the deadline, so it costs at most one more pass (at most
    /// --max-batch-tokens tokens; a longer evidence is computed in chunks of a pass).
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Seconds a client has to send a request's headers; a keep-alive connection waiting for its next
    /// request is closed after them too.
    #[arg(long, default_value_t = 30.0)]
    pub header_timeout: f64,
    /// Connections served at once; one more gets a 503 and is closed. Default: 1024, or fewer when the
    /// process may open fewer files (its descriptor limit less 64).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds the requests in flight get to finish after SIGTERM or Ctrl-C. Default: --timeout + 5.
    #[arg(long)]
    pub shutdown_grace: Option<f64>,
    /// Default `gate` of requests that give none.
    #[arg(long, default_value_t = 0.6)]
    pub gate: f64,
    /// Default `none_check` of requests that give none.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub none_check: bool,
    /// Default `allow_none` of requests that give none (v1.1). Note: typesafe-sdk 0.7.5 cannot read
    /// a `null` choice; `--allow-none false` serves its users a listed option instead (see the README).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub allow_none: bool,
    /// Default `think_budget` of requests that give none, in tokens. Default: 4096; 64 for the demo
    /// model (its thoughts are random tokens that rarely end by themselves).
    #[arg(long)]
    pub think_budget: Option<u32>,
    /// Most thoughts decoded at once (v1.1 AutoThink); further ones wait for a seat. Default: 64 on the
    /// CPU; on a GPU as many as a quarter of the memory the prefix cache leaves holds at eight fresh
    /// sequence states a thought (4 to 512; about 20 for a 27B model on an H200).
    #[arg(long)]
    pub think_seqs: Option<usize>,
    /// The family the bundled demo model is served as: `v1` (one read-out), `v1.1` (AutoThink: thoughts
    /// and the none option) or `instant` (v1.1 Instant: both option orders, the none option). Only
    /// without --gguf: a release's own decision_config.json says its family.
    #[arg(long, value_parser = ["v1", "v1.1", "instant"])]
    pub demo: Option<String>,
    /// Do not serve the playground page at `GET /` (a page to try the model in a browser; served
    /// without the API key, it asks for the key and sends it with its requests).
    #[arg(long)]
    pub no_playground: bool,
}

/// The bundled demo model's directory: next to the binary's checkout (target/*/prism), else the source
/// tree this binary was built from.
pub(crate) fn bundled_model_dir() -> Option<PathBuf> {
    let relative = ["tests", "fixtures", "qwen35-tiny"];
    let from_binary = std::env::current_exe().ok().and_then(|exe| {
        exe.ancestors()
            .nth(3)
            .map(|root| relative.iter().fold(root.to_path_buf(), |p, c| p.join(c)))
    });
    let from_source = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/qwen35-tiny"
    ));
    from_binary
        .into_iter()
        .chain([from_source])
        .find(|dir| dir.join("tiny-Q8_0.gguf").is_file())
}

/// The model to load: `--gguf` (with `--model-dir` when given), or the bundled demo model (then the
/// bool is true). `alternative` ends the error when the demo model is not there (what else to pass).
pub(crate) fn model_source(
    gguf: &Option<PathBuf>,
    model_dir: &Option<PathBuf>,
    alternative: &str,
) -> Result<(ModelSource, bool)> {
    match (gguf, model_dir) {
        (Some(gguf), dir) => Ok((
            ModelSource {
                gguf: gguf.clone(),
                model_dir: dir.clone(),
            },
            false,
        )),
        (None, Some(_)) => bail!("--model-dir needs --gguf (the model file)"),
        (None, None) => {
            let Some(dir) = bundled_model_dir() else {
                bail!(
                    "the bundled demo model (tests/fixtures/qwen35-tiny) is not next to this binary or its source \
                     tree; {alternative}"
                );
            };
            Ok((
                ModelSource {
                    gguf: dir.join("tiny-Q8_0.gguf"),
                    model_dir: Some(dir),
                },
                true,
            ))
        }
    }
}

/// `--precision` as asked: `auto` reads the file (Q8_0 → int8, K-quants → w4a8, except on a GPU, where
/// a K-quant file runs at bf16: w4a8 there has only its simple, slow kernel so far, and the note says
/// so).
pub(crate) fn resolve_precision(
    asked: &str,
    source: &ModelSource,
    on_gpu: bool,
) -> Result<(Precision, Option<&'static str>)> {
    if asked != "auto" {
        return Ok((Precision::parse(asked)?, None));
    }
    let gguf = prism_gguf::GgufFile::open(&source.gguf)
        .with_context(|| format!("opening {}", source.gguf.display()))?;
    Ok(match Precision::resolve("auto", &gguf)? {
        Precision::W4a8 if on_gpu => (
            Precision::Bf16,
            Some("a K-quant file on a GPU runs at bf16 (w4a8 there has only its simple, slow kernel so far; --precision w4a8 asks for it)"),
        ),
        p => (p, None),
    })
}

/// One line of progress on stdout, flushed at once (a pipe would otherwise hold it back).
macro_rules! say {
    ($($arg:tt)*) => {{
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}

/// A request that exercises the whole path once before the server opens.
const WARM_UP: &str = r#"{"state": "Prism warm-up.", "questions": {"ready": {"type": "noul", "instructions": "Is the engine ready?"}}}"#;

pub fn run(args: &ServeArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&args.gate) {
        bail!("--gate must be from 0 to 1, got {}", args.gate);
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!(
            "--timeout must be a positive number of seconds, got {}",
            args.timeout
        );
    }
    if args.queue_size == 0 {
        bail!("--queue-size must be at least 1");
    }
    let seconds = |name: &str, value: f64| -> Result<Duration> {
        if !(value.is_finite() && value > 0.0) {
            bail!("{name} must be a positive number of seconds, got {value}");
        }
        Ok(Duration::from_secs_f64(value))
    };
    let limits = ConnectionLimits {
        header_timeout: seconds("--header-timeout", args.header_timeout)?,
        max_connections: match args.max_connections {
            Some(0) => bail!("--max-connections must be at least 1"),
            Some(n) => n,
            None => default_max_connections(),
        },
        shutdown_grace: seconds(
            "--shutdown-grace",
            args.shutdown_grace.unwrap_or(args.timeout + 5.0),
        )?,
    };
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("PRISM_API_KEY").ok())
        .map(|key| key.trim().to_string())
        .filter(|key| !key.is_empty());
    if let Some(key) = &api_key {
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the API key must be printable ASCII without spaces");
        }
    }
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let devices = open_devices(&args.device, &args.gpus)?;
    let device = devices[0].clone();
    let on_gpu = !device.is_cpu();
    let asked = args
        .precision
        .clone()
        .unwrap_or_else(|| if on_gpu { "auto" } else { "f32" }.to_string());
    let device_name = match (on_gpu, args.gpus.len()) {
        (true, 0 | 1) => format!("CUDA GPU {}", args.gpus.first().copied().unwrap_or(0)),
        (true, _) => format!(
            "CUDA GPUs {}",
            args.gpus
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
        (false, _) => "CPU".to_string(),
    };
    let device_name = match devices.len() * args.replicas {
        1 => device_name,
        n => format!("{device_name}, {n} engine replicas"),
    };

    say!(
        "Prism {} — /v1/systemone server ({device_name}, precision {asked})",
        env!("CARGO_PKG_VERSION")
    );
    let (source, demo) = model_source(
        &args.gguf,
        &args.model_dir,
        "pass --gguf FILE [--model-dir DIR]",
    )?;
    if demo {
        say!("");
        say!(
            "  NOTE: no --gguf given, so this serves the bundled DEMO model ({}).",
            source
                .model_dir
                .as_deref()
                .unwrap_or(&source.gguf)
                .display()
        );
        say!("  Its weights are random: its answers are meaningless. It is here to try the API and run the tests.");
        say!("  To serve a real StartLux-Decision release:");
        say!("    prism serve --gguf StartLux-Decision-v1-4B-Q8_0.gguf --model-dir DIR_WITH_ITS_TOKENIZER_AND_CONFIGS");
        say!("");
    }
    let (precision, note) = resolve_precision(&asked, &source, on_gpu)?;
    if let Some(note) = note {
        say!("  NOTE: {note}");
    }
    let kv_storage = if args.kv_fp8 {
        KvStorage::Fp8
    } else {
        KvStorage::Native
    };
    let precision_name = precision.as_str().to_string();
    // For the progress lines: the precision, and the K/V storage where it is not the default.
    let precision_label = match kv_storage {
        KvStorage::Fp8 => format!("{precision_name}, fp8 K/V"),
        KvStorage::Native => precision_name.clone(),
    };
    let size = std::fs::metadata(&source.gguf)
        .with_context(|| format!("cannot read the model file {}", source.gguf.display()))?
        .len();
    say!(
        "[1/3] Loading {} ({:.1} MB): GGUF, tokenizer, chat template, decision config, decoder weights ({}) ...",
        source.gguf.display(),
        size as f64 / 1e6,
        precision_label
    );
    let started = Instant::now();
    // A line every tenth of the decoder's layers: layers done and the file's bytes a second so far.
    let load_started = Instant::now();
    let progress = LoadProgress(Arc::new(move |done: usize, total: usize| {
        let step = total.div_ceil(10).max(1);
        if done % step == 0 || done == total {
            let seconds = load_started.elapsed().as_secs_f64().max(1e-9);
            say!(
                "      layers {done}/{total}  ({:.2} GB/s)",
                size as f64 * done as f64 / total as f64 / seconds / 1e9
            );
        }
    }));
    // One model per replica: `--replicas` on each device.
    let mut models = Vec::with_capacity(devices.len() * args.replicas);
    let mut config = None;
    for (d, replica_device) in devices.iter().enumerate() {
        for r in 0..args.replicas {
            if devices.len() * args.replicas > 1 {
                say!("      replica {} (device {d}, copy {r}):", models.len());
            }
            let options = LoadOptions {
                device: replica_device.clone(),
                precision,
                progress: Some(progress.clone()),
                load_threads: args.load_threads,
                kv_storage,
                ..LoadOptions::default()
            };
            let loaded = DecoderLetterModel::load(&source, &options, args.max_tokens)
                .with_context(|| format!("loading the decision model {}", source.gguf.display()))?;
            models.push(loaded.model);
            config = Some(loaded.config);
        }
    }
    let mut config = config.context("no replica was loaded")?;
    match (&args.demo, demo) {
        (Some(_), false) => bail!(
            "--demo chooses the family of the bundled demo model; with --gguf the release's \
             decision_config.json says its family"
        ),
        (family, true) => {
            config.family = match family.as_deref().unwrap_or("v1.1") {
                "v1" => Family::V1,
                "instant" => Family::Instant,
                _ => Family::AutoThink,
            };
            say!(
                "      the demo model is served as a {} model (--demo)",
                config.family
            );
        }
        (None, false) => {}
    }
    let family = config.family;
    let model = &models[0];
    let name = model.model_name().to_string();
    let layers = model.decoder().config().n_layers;
    let config_note = match &source.model_dir {
        Some(_) if demo => " (decision config: the defaults, the family from --demo)",
        Some(dir) if !dir.join("decision_config.json").is_file() => {
            " (decision config: the defaults, as the model directory has no decision_config.json)"
        }
        Some(_) => "",
        None => " (decision config: the defaults, as no --model-dir was given)",
    };
    say!(
        "      done in {:.2} s: {name}, {layers} layers{config_note}",
        started.elapsed().as_secs_f64()
    );
    let free_memory = device_free_memory(&device);
    if let Some((free, total)) = free_memory {
        say!(
            "      device memory: {:.1} GB free of {:.1} GB",
            free as f64 / 1e9,
            total as f64 / 1e9
        );
    }

    // Budgets are per replica; replicas sharing a device share its free memory.
    let per_device = args.replicas as u64;
    let cache_bytes = args.prefix_cache_bytes.unwrap_or(match free_memory {
        Some((free, _)) => free / 8 / per_device,
        None => 2 << 30,
    });
    // One sequence state, as each prompt of a pass makes (without its K/V rows, which grow with it).
    let state_bytes = model
        .decoder()
        .new_state()
        .map(|state| state.bytes() as u64)
        .context("cannot make a sequence state")?
        .max(1);
    let max_prompts_per_pass = match (args.max_prompts_per_pass, free_memory) {
        (Some(0), _) => bail!("--max-prompts-per-pass must be at least 1"),
        (Some(n), _) => n,
        (None, Some((free, _))) => {
            // A sixth of what the cache leaves: measured on the H200 (27B bf16, 2026-12-01), half
            // of it ran out of memory under 16 and 64 clients (the pool's fragments, the pass's
            // activations and the delta rule's buffers come on top of the states).
            (free.saturating_sub(cache_bytes * per_device) / 6 / per_device / state_bytes)
                .clamp(8, 1024) as usize
        }
        (None, None) => 1024,
    };
    let think_seqs = match (args.think_seqs, free_memory) {
        (Some(0), _) => bail!("--think-seqs must be at least 1"),
        (Some(n), _) => n,
        (None, Some((free, _))) => {
            // A quarter of what the cache leaves, at eight fresh states a thought: measured on the
            // H200 (27B int8, 2026-12-02), 64 thoughts held ~1.2 GB each (their state with a chunk
            // of pending delta-rule rows, the next step's state, the pool's fragments) against a
            // fresh state's ~150 MB; with an eighth of the memory a seat at one state each, 64
            // clients with thoughts ran out of memory.
            (free.saturating_sub(cache_bytes * per_device) / 4 / per_device / (8 * state_bytes))
                .clamp(4, 512) as usize
        }
        (None, None) => 64,
    };
    let engine_options = EngineOptions {
        think_seqs,
        max_batch_tokens: args.max_batch_tokens.unwrap_or(8192),
        max_prompts_per_pass,
        queue_size: args.queue_size,
        max_prompt_tokens: args.max_tokens,
        max_questions: args.max_questions,
        max_request_tokens: args.max_request_tokens,
        prefix_cache: PrefixCacheLimits {
            max_tokens: args.prefix_cache_tokens,
            max_bytes: cache_bytes,
        },
    };
    if engine_options.max_batch_tokens == 0 {
        bail!("--max-batch-tokens must be at least 1");
    }
    let encoder = model.encoder();
    let metrics = Arc::new(Metrics::default());
    let observer: Arc<dyn EngineObserver> = metrics.clone();
    let (engine, worker) =
        Engine::start_replicas(models, encoder, config, engine_options, Some(observer))
            .context("cannot start the engine")?;

    say!("[2/3] Warm-up: one question through the whole path ...");
    let started = Instant::now();
    let warm_up = DecisionRequest::parse(WARM_UP.as_bytes(), &RequestDefaults::default())
        .map_err(anyhow::Error::from)
        .and_then(|request| Ok(engine.decide(request, None)?))
        .context("the warm-up request failed")?;
    say!(
        "      done in {:.0} ms ({} prompt tokens)",
        started.elapsed().as_secs_f64() * 1e3,
        warm_up.response.usage.input_tokens
    );

    let stats = Arc::new(Stats::default());
    let timeout = Duration::from_secs_f64(args.timeout);
    let server_config = ServerConfig {
        api_key: api_key.clone(),
        max_body_bytes: args.max_body_bytes,
        request_timeout: timeout,
        defaults: RequestDefaults {
            gate: args.gate,
            none_check: args.none_check,
            allow_none: args.allow_none,
            think_budget: args.think_budget.unwrap_or(if demo { 64 } else { 4096 }),
            ..RequestDefaults::default()
        },
        model: ModelInfo {
            description: if demo {
                "The bundled demo model: a tiny Qwen3.5 with random weights. Its answers are meaningless.".into()
            } else {
                format!("StartLux-Decision model {name}, served by Prism on the {device_name}")
            },
            name,
            release_date: "unknown".into(),
            precision: precision_name.clone(),
            max_prompt_tokens: args.max_tokens,
            demo,
            family,
        },
        playground: !args.no_playground,
    };
    let counters = Counters {
        stats: stats.clone(),
        metrics: metrics.clone(),
    };
    let app = router(server_config, engine, stats, metrics);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(8)
        .thread_name("prism-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    say!("[3/3] Binding {}:{} ...", args.host, args.port);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((
            args.host.as_str(),
            args.port,
        )))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let address = listener
        .local_addr()
        .context("the listening socket has no address")?;
    let base = format!("http://{address}");
    if !address.ip().is_loopback() && api_key.is_none() {
        say!("  WARNING: listening on {address}, reachable from other machines, without an API key (--api-key).");
    }
    say!(
        "Ready on {base}  ({device_name}, {precision_label}, family {family}{}, {} tokens and {} prompts a pass, prefix cache {} tokens / {:.2} GB, queue {}, timeout {} s, {} connections, body limit {} bytes, API key {})",
        if family.thinks() {
            format!(", {} thoughts at once", engine_options.think_seqs)
        } else {
            String::new()
        },
        engine_options.max_batch_tokens,
        engine_options.max_prompts_per_pass,
        engine_options.prefix_cache.max_tokens,
        engine_options.prefix_cache.max_bytes as f64 / 1e9,
        args.queue_size,
        args.timeout,
        limits.max_connections,
        args.max_body_bytes,
        if api_key.is_some() { "required" } else { "off" }
    );
    if !args.no_playground {
        say!("  Playground: open {base}/ in a browser");
    }
    say!("  POST {base}/v1/systemone   (alias /v1/decisions)");
    say!("  GET  {base}/v1/models");
    say!("  GET  {base}/health");
    say!("  GET  {base}/stats");
    say!("  GET  {base}/metrics");
    say!("Try:");
    let auth = if api_key.is_some() {
        " -H \"Authorization: Bearer $PRISM_API_KEY\""
    } else {
        ""
    };
    say!(
        "  curl -s {base}/v1/systemone -H 'Content-Type: application/json'{auth} -d '{{\"state\": \"The parcel \
         arrived two days late and the box was crushed.\", \"questions\": {{\"late\": {{\"type\": \"noul\", \
         \"instructions\": \"Was the delivery late?\"}}, \"team\": {{\"type\": \"choice\", \"instructions\": \
         \"Which team should handle this?\", \"criteria\": {{\"shipping\": null, \"billing\": null, \"sales\": \
         null}}}}}}}}'"
    );

    // After the signal, in-flight requests get until their own timeout (plus a little) to finish.
    let outcome = runtime.block_on(async move {
        let shutdown = async move {
            wait_for_signal().await;
            say!("Shutting down: no new connections; finishing the requests in flight ...");
        };
        serve(listener, app, limits, counters, shutdown).await
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    match outcome.context("the server failed")? {
        true => {
            // Every handle to the engine is gone with the router: its loop ends after its last request.
            worker.join();
            say!("Stopped.");
        }
        false => say!(
            "Stopped after {:?} with requests still in flight.",
            limits.shutdown_grace
        ),
    }
    Ok(())
}

/// SIGTERM or Ctrl-C (SIGINT).
async fn wait_for_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

/// The devices `--device` and `--gpus` name: one, or each GPU of a list of several.
pub fn open_devices(name: &str, gpus: &[usize]) -> Result<Vec<Device>> {
    if gpus.len() <= 1 {
        return Ok(vec![open_device(name, gpus)?]);
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = gpus.iter().find(|&&g| !seen.insert(g)) {
        bail!("--gpus {gpus:?}: GPU {twice} is named twice (use --replicas for several replicas on one GPU)");
    }
    gpus.iter().map(|&g| open_device(name, &[g])).collect()
}

/// The device `--device` and `--gpus` name.
pub fn open_device(name: &str, gpus: &[usize]) -> Result<Device> {
    if gpus.len() > 1 {
        bail!("--gpus {gpus:?}: this command runs on one GPU");
    }
    let ordinal = gpus.first().copied().unwrap_or(0);
    match name {
        "cpu" => {
            if !gpus.is_empty() {
                bail!("--gpus needs --device cuda or auto");
            }
            Ok(Device::Cpu)
        }
        "cuda" | "auto" => {
            #[cfg(feature = "cuda")]
            {
                match prism_quant::cuda_launch::open_device(ordinal) {
                    Ok(device) => Ok(device),
                    Err(error) if name == "auto" && gpus.is_empty() => {
                        say!("  (no usable CUDA GPU: {error}; serving on the CPU)");
                        Ok(Device::Cpu)
                    }
                    Err(error) => Err(error).context(format!("opening CUDA device {ordinal}")),
                }
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = ordinal;
                if name == "cuda" || !gpus.is_empty() {
                    bail!("--device cuda / --gpus: this prism was built without the `cuda` feature (cargo build --features cuda)");
                }
                Ok(Device::Cpu)
            }
        }
        other => bail!("--device {other:?}: expected auto, cpu or cuda"),
    }
}

/// Free and total device memory in bytes; `None` on the CPU.
fn device_free_memory(device: &Device) -> Option<(u64, u64)> {
    crate::cmd_bench::device_memory(device).map(|(used, total)| (total - used, total))
}

/// 1024 connections, or the process's descriptor limit less 64 (for the model files, the listener and
/// the logs) when that is lower.
fn default_max_connections() -> usize {
    #[cfg(target_os = "linux")]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid out-parameter for the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            let usable = (limit.rlim_cur as usize).saturating_sub(64).max(1);
            return usable.min(1024);
        }
    }
    1024
}
