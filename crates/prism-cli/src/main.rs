//! `prism`: the command line of the Prism inference engine.
//!
//! Each subcommand lives in its own module; this file only parses arguments and sets up logging.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

mod cmd_bench;
mod cmd_decide;
mod cmd_eval;
#[cfg(feature = "cuda")]
mod cmd_gemm_bench;
mod cmd_gguf;
mod cmd_loadgen;
mod cmd_logits;
mod cmd_render;
mod cmd_serve;
mod cmd_synth;

#[derive(Parser)]
#[command(
    name = "prism",
    version,
    about = "Prism: an exact, fast inference engine for StartLux-Decision models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect GGUF files.
    Gguf {
        #[command(subcommand)]
        command: GgufCommand,
    },
    /// Render a /v1/systemone request into each question's prompt (and, with a model dir, its tokens).
    Render(RenderArgs),
    /// Run the decoder on prompts and print last-position logits.
    Logits(LogitsArgs),
    /// Answer one /v1/systemone request on this machine through the engine and print the response body.
    Decide(DecideArgs),
    /// Serve the /v1/systemone HTTP API (default: the bundled demo model, random weights).
    Serve(cmd_serve::ServeArgs),
    /// Load a /v1/systemone server with many clients; report throughput and latency, and check every
    /// answer under load against the same request alone.
    Loadgen(cmd_loadgen::LoadgenArgs),
    /// Run a labelled suite (one JSON request a line with its labels) in bulk, in-process or against a
    /// server; report accuracy, calibration (ECE, Brier, log loss) and, against an earlier run, agreement
    /// and probability drift (results.json, report.md, reliability.png).
    Eval(cmd_eval::EvalArgs),
    /// Write a random-weight model directory with the real Qwen3.5 shapes of a size (GGUF + small files).
    Synth(SynthArgs),
    /// Latency of the decision path (short question, shared evidence, long question) against its floors.
    Bench(BenchArgs),
    /// The integer GEMM's speed at the model's projection shapes next to bf16 (CUDA builds only).
    #[cfg(feature = "cuda")]
    GemmBench(cmd_gemm_bench::GemmBenchArgs),
}

#[derive(Subcommand)]
enum GgufCommand {
    /// Print a GGUF file's metadata and a table of every tensor (name, type, shape).
    Info {
        /// The GGUF file.
        file: PathBuf,
    },
}

/// Arguments of `prism render`.
#[derive(Args)]
pub struct RenderArgs {
    /// The request body (JSON, as sent to /v1/systemone).
    pub request: PathBuf,
    /// A model directory (tokenizer, chat template, decision_config.json): also show the
    /// chat-templated text and its token ids.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Print one JSON object keyed by question instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `prism logits`.
#[derive(Args)]
pub struct LogitsArgs {
    /// The model's GGUF file.
    #[arg(long, required_unless_present = "hf_dir")]
    pub gguf: Option<PathBuf>,
    /// Instead of --gguf: a Hugging Face checkpoint directory (config.json, model.safetensors or its
    /// sharded index), for parity work. It is also the model directory unless --model-dir is given.
    #[arg(long, conflicts_with = "gguf")]
    pub hf_dir: Option<PathBuf>,
    /// The model directory (tokenizer, chat template, config.json).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// One already chat-templated prompt text (special tokens are parsed).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    pub prompt_file: Option<PathBuf>,
    /// A JSON array of token-id arrays, one per prompt, run together as one batch.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Arithmetic of the forward pass. `f32` dequantizes the weights and computes in f32 (the reference);
    /// `int8` (Q8_0 files, re-blocked per row and run of 128) and `w4a8` (K-quant files, their own blocks)
    /// run int8 activations with dynamic per-(row, run) scales and exact integer sums (CPU only for
    /// now); `auto` picks by the file's weights; also `bf16`, `f64`.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// One JSON line per prompt.
    #[arg(long)]
    pub json: bool,
    /// Also print the whole logit vector.
    #[arg(long)]
    pub full: bool,
}

/// The model's files, as `prism serve` and `prism decide` take them.
// One documented field a flag: alike in shape to the other commands' arguments, each derived by clap
// for its own command.
#[derive(Args)]
pub struct ModelFiles {
    /// The model's GGUF file. Default: the bundled demo model (tiny, random weights: meaningless answers).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// The model directory (tokenizer, chat template, config.json, decision_config.json). Without it the
    /// tokenizer and chat template come from the GGUF and the decision config takes its defaults.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The vision tower (`mmproj-*.gguf`) that lets the model read a request's `images`. Default: the one
    /// `mmproj-*.gguf` in --model-dir, if any; without one, a request with images is refused (422).
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
}

impl ModelFiles {
    /// The model to load ([`prism_decision::setup::model_source`]) with its vision tower; the bool is
    /// true for the bundled demo model.
    pub fn source(&self) -> anyhow::Result<(prism_decision::ModelSource, bool)> {
        let (mut source, demo) = prism_decision::setup::model_source(
            &self.gguf,
            &self.model_dir,
            "pass --gguf FILE [--model-dir DIR]",
        )?;
        source.mmproj = self.mmproj.clone();
        Ok((source, demo))
    }
}

/// Arguments of `prism decide`.
#[derive(Args)]
pub struct DecideArgs {
    /// The request body (JSON, as sent to /v1/systemone).
    pub request: PathBuf,
    #[command(flatten)]
    pub files: ModelFiles,
    /// Arithmetic of the forward pass: `f32` (dequantized weights, the reference), `int8` (Q8_0 files),
    /// `w4a8` (K-quant files), `auto` (by the file's weights), `bf16` or `f64`.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The longest prompt accepted, in tokens; a longer question is refused (HTTP 422).
    #[arg(long, default_value_t = 32768)]
    pub max_tokens: usize,
    /// Where the model runs: `cpu` or `cuda` (GPU 0; CUDA builds).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Arguments of `prism synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// The released size whose shapes to use: 0.8b, 2b, 4b, 9b or 27b.
    #[arg(long)]
    pub shape: String,
    /// The file type: bf16, q8_0 or q4_k_m (llama-quantize's Q4_K/Q6_K mix).
    #[arg(long = "type")]
    pub r#type: String,
    /// The model directory to write (model.gguf and the small files); created if missing.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights (same seed, same bytes).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep only the first N layers (real widths; the 3:1 DeltaNet/attention pattern is kept).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Also write the multi-token-prediction block (block_count = layers + 1), as current converters do.
    #[arg(long)]
    pub mtp: bool,
    /// The tiktoken rank file of the vocabulary. Default: the Qwen3.5 ranks bundled in tests/fixtures.
    #[arg(long)]
    pub ranks: Option<PathBuf>,
    /// The chat template. Default: the Qwen3.5 template bundled in tests/fixtures.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Test only: keep the first N ranks of the vocabulary (rows = N + 33 added tokens).
    #[arg(long, hide = true)]
    pub vocab_ranks: Option<usize>,
    /// Also write the size's vision tower, `mmproj-Qwen3.5-<SIZE>-synth-<TYPE>.gguf`, which `prism serve
    /// --model-dir DIR` loads so that requests with images are answered.
    #[arg(long)]
    pub mmproj: bool,
    /// Write only the vision tower into DIR (implies --mmproj; `--type` is then not used): to add one
    /// to a synthetic model written before, or to keep it apart from that model (serve with --mmproj).
    #[arg(long)]
    pub mmproj_only: bool,
    /// The mmproj's type: f16 (as released), bf16 or f32.
    #[arg(long, default_value = "f16")]
    pub mmproj_type: String,
    /// Keep only the first N blocks of the vision tower (real widths).
    #[arg(long)]
    pub vision_blocks: Option<usize>,
}

/// Arguments of `prism bench`.
/// `prism bench --profile`'s modes (see `prism_model::profile::Mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProfileArg {
    Sync,
    Events,
}

impl From<ProfileArg> for prism_model::profile::Mode {
    fn from(p: ProfileArg) -> Self {
        match p {
            ProfileArg::Sync => prism_model::profile::Mode::Sync,
            ProfileArg::Events => prism_model::profile::Mode::Events,
        }
    }
}

#[derive(Args)]
pub struct BenchArgs {
    /// The model directory (tokenizer, chat template, config.json, decision_config.json).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// The model's GGUF file. Default: DIR/model.gguf (or the directory's only .gguf).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// Arithmetic of the forward pass, as for `prism decide` (`auto` included).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Store attention keys and values as fp8 (e4m3, one f32 scale per token and KV head), as
    /// `prism serve --kv-fp8` does; the report says which storage ran (`kv_storage`). On the CPU and on
    /// GPUs of compute capability 8.9 or newer.
    #[arg(long)]
    pub kv_fp8: bool,
    /// cpu or cuda (device 0; needs a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Timed runs per scenario.
    #[arg(long, default_value_t = 10)]
    pub runs: usize,
    /// Untimed runs per scenario before the timed ones.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Prompt length of the long scenario, in tokens.
    #[arg(long, default_value_t = 8192)]
    pub long_tokens: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// After the timed runs, run each scenario (with `--think`, each batch size) once more profiled and
    /// print where the time goes, per section of the forward pass. `sync` (the default when the flag
    /// has no value): a device synchronization around every section (slower than a plain run; device
    /// time per section). `events`: CUDA events around every section, no synchronization; each
    /// section's device span next to the host's time enqueueing it (span ≈ host time: the host is the
    /// bottleneck).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "sync")]
    pub profile: Option<ProfileArg>,
    /// Threads that load decoder layers at once (default: the machine's cores, at most 8).
    #[arg(long)]
    pub load_threads: Option<usize>,
    /// Also run each scenario through the engine the server runs (its step loop, prefix cache off) and
    /// report its median next to the direct path's; with --profile, profile one run there too.
    #[arg(long)]
    pub engine: bool,
    /// Also run each scenario through the engine over the model split for tensor parallelism over
    /// this many devices (2 or 4; the shares share the one device): its median and answers' digest,
    /// which must be the direct path's (int8 / w4a8 only).
    #[arg(long)]
    pub tp: Option<usize>,
    /// With --engine: also submit this many distinct three-question requests at once (one measurement
    /// per size; with --profile one profiled batch each).
    #[arg(long, value_delimiter = ',')]
    pub engine_batch: Vec<usize>,
    /// CUDA builds: run the integer products of 3 to N rows on the narrow kernel (0: never).
    #[arg(long)]
    pub narrow_rows: Option<usize>,
    /// CUDA builds (Hopper): run the integer products the skinny and narrow kernels leave, up to N
    /// rows (at most 64), on the swapped tile (0: never; default 64).
    #[arg(long)]
    pub swapped_rows: Option<usize>,
    /// CUDA builds (Hopper): launch the kernels with programmatic dependent launch (each kernel's
    /// launch overlaps the tail of the one before it; the results are the same); default on. Both,
    /// `on,off`, with --think: each run measured both ways in turn on one model load.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off, value_delimiter = ',')]
    pub programmatic_launch: Vec<bool>,
    /// CUDA builds: wrap the last timed run of each scenario in a CUDA profiler range
    /// (cuProfilerStart/Stop), so that `ncu --profile-from-start off` records exactly one warm pass
    /// of each scenario and nothing of the load or the floor measurements.
    #[arg(long)]
    pub profiler_range: bool,
    /// Linux on x86_64: sample the host's CPU time (about every millisecond of process CPU time, the
    /// interrupted instruction and, in a build with frame pointers, the return addresses above it)
    /// during the last timed run of each scenario, or with --think every timed run, and write the
    /// samples with the process's memory map to this file; `tools/host_profile.py FILE BINARY` names
    /// the functions from the unstripped binary of the same build.
    #[arg(long, value_name = "FILE")]
    pub host_profile: Option<std::path::PathBuf>,
    /// Instead of the read-out scenarios, measure thought decoding (v1.1 AutoThink) through the engine:
    /// requests thinking up to this many tokens each, `--think-batch` of them at once.
    #[arg(long)]
    pub think: Option<usize>,
    /// With --think: how many thinking requests run at once, one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub think_batch: Vec<usize>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: a log written to a file or a pipe stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if std::env::var_os("PRISM_STACKS_ON_SIGQUIT").is_some_and(|v| v != "0") {
        prism_model::stack_dump::install().context("PRISM_STACKS_ON_SIGQUIT")?;
        tracing::info!(
            "PRISM_STACKS_ON_SIGQUIT: `kill -QUIT {}` writes every thread's stack to stderr",
            std::process::id()
        );
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Gguf {
            command: GgufCommand::Info { file },
        } => cmd_gguf::info(&file, &mut std::io::stdout().lock()),
        Command::Render(args) => cmd_render::run(&args),
        Command::Logits(args) => cmd_logits::run(&args),
        Command::Decide(args) => cmd_decide::run(&args),
        Command::Serve(args) => cmd_serve::run(&args),
        Command::Loadgen(args) => cmd_loadgen::run(&args),
        Command::Eval(args) => cmd_eval::run(&args),
        Command::Synth(args) => cmd_synth::run(&args),
        Command::Bench(args) => cmd_bench::run(&args),
        #[cfg(feature = "cuda")]
        Command::GemmBench(args) => cmd_gemm_bench::run(&args),
    }
}

/// `on` or `off` (a flag's value).
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, found {other:?}")),
    }
}
