//! `prism serve`: the `/v1/systemone` HTTP server, on a GPU when there is one, else on the CPU.
//!
//! Loads the model (the bundled random-weight demo model when no `--gguf` is given), starts the engine,
//! runs one warm-up read-out through the whole path, binds, prints `Ready` with the endpoints and a curl
//! line, and serves until SIGTERM or Ctrl-C, after which the requests in flight are finished before the
//! process exits. Progress goes to stdout (the tests read the `Ready on http://ADDR` line); logs go to
//! stderr.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Args};
use prism_decision::engine::{Engine, EngineObserver};
use prism_decision::setup::{device_free_memory, open_devices, resolve_precision};
use prism_decision::{Family, LetterModel, RequestDefaults};
use prism_model::{KvStorage, LoadOptions, LoadProgress};
use prism_server::launch::{self, Budgets};
use prism_server::{router, serve, Counters, Metrics, ModelInfo, ServerConfig, Stats};

/// Arguments of `prism serve`.
// One documented field a flag: alike in shape to the other commands' arguments, each derived by clap
// for its own command.
#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub files: crate::ModelFiles,
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
    /// Tensor parallelism: each engine replica's model split over this many devices (1, 2 or 4), its
    /// attention and DeltaNet heads and MLP channels on the integer path's part boundaries, so every
    /// answer is bit-identical to one device's (int8 and w4a8 only). `--gpus 0,1 --tp 2`: one replica
    /// over both GPUs; `--gpus 0,1,2,3 --tp 2`: two replicas of two; one device (the CPU, or one GPU):
    /// the shares share it (functional tests). The shares are exchanged by device copies after each
    /// row-parallel product (not NCCL yet): not yet faster than one GPU.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
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
    /// evidence is computed in chunks. Default: 8,192 on the CPU; on a GPU as many tokens (a multiple
    /// of 256, from 256 to 8,192) as a quarter of the device memory left after the model and the prefix
    /// cache holds at the model's estimate of a token's peak bytes in a pass. (On the H200, 27B bf16
    /// passes of ~10-16k tokens from many requests ran out of memory on 2026-12-01: hence the cap.)
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
    /// and the none option) or `instant` (v1.1 Instant: both option orders, the none option). The v1.1
    /// families read images with the demo's bundled vision tower (random weights too) unless --mmproj
    /// names another. Only without --gguf: a release's own decision_config.json says its family.
    #[arg(long, value_parser = ["v1", "v1.1", "instant"])]
    pub demo: Option<String>,
    /// Do not serve the playground page at `GET /` (a page to try the model in a browser; served
    /// without the API key, it asks for the key and sends it with its requests).
    #[arg(long)]
    pub no_playground: bool,
}

/// One line of progress on stdout, flushed at once (a pipe would otherwise hold it back).
macro_rules! say {
    ($($arg:tt)*) => {{
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}

pub fn run(args: &ServeArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&args.gate) {
        bail!("--gate must be from 0 to 1, got {}", args.gate);
    }
    let limits = launch::connection_limits(
        args.header_timeout,
        args.max_connections,
        args.shutdown_grace,
        args.timeout,
    )?;
    if args.queue_size == 0 {
        bail!("--queue-size must be at least 1");
    }
    let api_key = launch::api_key(args.api_key.clone(), std::env::var("PRISM_API_KEY").ok())?;
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let (devices, fallback) = open_devices(&args.device, &args.gpus)?;
    launch::check_tensor_parallel(&devices, args.tp)?;
    if let Some(error) = fallback {
        say!("  (no usable CUDA GPU: {error}; serving on the CPU)");
    }
    let device = devices[0].clone();
    let on_gpu = !device.is_cpu();
    let asked = args
        .precision
        .clone()
        .unwrap_or_else(|| if on_gpu { "auto" } else { "f32" }.to_string());
    let mut device_name = launch::device_name(
        on_gpu,
        &args.gpus,
        devices.len().div_ceil(args.tp) * args.replicas,
    );
    if args.tp > 1 {
        device_name.push_str(&format!(", each replica over {} devices (--tp)", args.tp));
    }
    say!(
        "Prism {} — /v1/systemone server ({device_name}, precision {asked})",
        env!("CARGO_PKG_VERSION")
    );
    let (mut source, demo) = args.files.source()?;
    let demo_family = launch::demo_family(args.demo.as_deref(), demo)?;
    if let (Some(family), None) = (demo_family, &source.mmproj) {
        // The v1.1 families read images: the demo gets its bundled tower.
        if family != Family::V1 {
            source.mmproj = source
                .model_dir
                .as_ref()
                .map(|dir| dir.join(prism_model::synth_vision::DEMO_MMPROJ))
                .filter(|path| path.is_file());
        }
    }
    if demo {
        let dir = source.model_dir.as_deref().unwrap_or(&source.gguf);
        say!("");
        say!(
            "  NOTE: no --gguf given, so this serves the bundled DEMO model ({}).",
            dir.display()
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
    let progress = LoadProgress(Arc::new(move |done: usize, total: usize| {
        let step = total.div_ceil(10).max(1);
        if done % step == 0 || done == total {
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            say!(
                "      layers {done}/{total}  ({:.2} GB/s)",
                size as f64 * done as f64 / total as f64 / seconds / 1e9
            );
        }
    }));
    let options = LoadOptions {
        precision,
        progress: Some(progress),
        load_threads: args.load_threads,
        kv_storage,
        ..LoadOptions::default()
    };
    let (models, mut config) = launch::load_replicas(
        &source,
        &devices,
        args.replicas,
        &options,
        args.max_tokens,
        &mut |i, d, r| {
            if args.tp > 1 && devices.len() > 1 {
                say!(
                    "      device {d}: share {} of replica {}",
                    d % args.tp,
                    d / args.tp * args.replicas + r
                )
            } else {
                say!("      replica {i} (device {d}, copy {r}):")
            }
        },
    )?;
    if let Some(family) = demo_family {
        config.family = family;
        say!("      the demo model is served as a {family} model (--demo)");
    }
    let family = config.family;
    let model = &models[0];
    let name = model.model_name().to_string();
    say!(
        "      done in {:.2} s: {name}, {} layers{}",
        started.elapsed().as_secs_f64(),
        model.decoder().config().n_layers,
        launch::config_note(&source, demo)
    );
    match model.vision() {
        Some(vision) => say!(
            "      vision tower: {} blocks, {}-wide, patch {} (images accepted, up to 8 a request)",
            vision.config.blocks,
            vision.config.hidden,
            vision.config.patch
        ),
        None => say!("      no vision tower (no --mmproj): requests with images get 422"),
    }
    let free_memory = device_free_memory(&device);
    if let Some((free, total)) = free_memory {
        say!(
            "      device memory: {:.1} GB free of {:.1} GB",
            free as f64 / 1e9,
            total as f64 / 1e9
        );
    }
    let budgets = Budgets {
        replicas: args.replicas,
        max_batch_tokens: args.max_batch_tokens,
        max_prompts_per_pass: args.max_prompts_per_pass,
        prefix_cache_tokens: args.prefix_cache_tokens,
        prefix_cache_bytes: args.prefix_cache_bytes,
        think_seqs: args.think_seqs,
        queue_size: args.queue_size,
        max_tokens: args.max_tokens,
        max_questions: args.max_questions,
        max_request_tokens: args.max_request_tokens,
    };
    let engine_options = launch::engine_options(&budgets, model, free_memory)?;
    let encoder = model.encoder();
    let metrics = Arc::new(Metrics::default());
    let observer: Arc<dyn EngineObserver> = metrics.clone();
    let (engine, worker) = if args.tp > 1 {
        let split =
            launch::tensor_parallel_replicas(models, devices.len(), args.tp, args.replicas)?;
        Engine::start_replicas(split, encoder, config, engine_options, Some(observer))
    } else {
        Engine::start_replicas(models, encoder, config, engine_options, Some(observer))
    }
    .context("cannot start the engine")?;

    say!("[2/3] Warm-up: one question through the whole path ...");
    let started = Instant::now();
    let tokens = launch::warm_up(&engine)?;
    say!(
        "      done in {:.0} ms ({tokens} prompt tokens)",
        started.elapsed().as_secs_f64() * 1e3
    );

    let stats = Arc::new(Stats::default());
    let server_config = ServerConfig {
        api_key: api_key.clone(),
        max_body_bytes: args.max_body_bytes,
        request_timeout: Duration::from_secs_f64(args.timeout),
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
            precision: precision_name,
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

    let runtime = launch::runtime()?;
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
            launch::wait_for_signal().await;
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
