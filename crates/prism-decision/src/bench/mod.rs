//! `prism bench`'s measurements: latency of the decision path on this machine, and how far each latency is from its floor.
//!
//! Three scenarios, each run through the same code the server runs (`crate::decide`: render,
//! chat template, tokenize, forward with the shared evidence prefix computed once, letter read-out):
//! - `short`: one question on the README's ticket (`examples/request.json`, question `team`);
//! - `shared`: the three questions of that request on the one ticket (shared evidence);
//! - `long`: one question whose state is a synthesized ticket that renders to about `--long-tokens`.
//!
//! For each: median and p95 wall time over `--runs` warm runs (after `--warmup`). The floors are measured
//! in the same process on the same device: the bandwidth floor is the bytes of weights one forward pass
//! reads (every main-layer tensor once, in the precision's storage size, plus the 26 letter rows of the
//! output head) divided by the measured copy bandwidth (read + write bytes per second of a large copy,
//! STREAM's convention); the compute floor is the pass's FLOPs (2 × matrix parameters × tokens computed,
//! plus attention's QKᵀ and AV over the causal context, the delta rule's state updates and the conv)
//! divided by the measured rate of a large matmul. Latency ÷ max(floors) is how many times slower than
//! the hardware allows the path is.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_gguf::{GgmlType, GgufFile};
use prism_model::{KvStorage, LayerKind, LoadOptions, Precision, Qwen35Config};
use rayon::prelude::*;
use serde_json::{json, Value};

#[cfg(feature = "cuda")]
pub mod gemm;
pub mod host_profile;
mod think;

use crate::{
    decide, render_request, DecisionConfig, DecisionRequest, DecisionResponse, DecoderLetterModel,
    LetterModel, ModelSource, RequestDefaults,
};

/// [`decide`] on `scenario`'s request; an error names `what` was running, the scenario and the body.
fn decide_scenario(
    what: &str,
    scenario: &Scenario,
    config: &DecisionConfig,
    model: &mut dyn LetterModel,
) -> Result<DecisionResponse> {
    decide(&scenario.request, config, model).map_err(|e| {
        anyhow::anyhow!(
            "{what} {}: {}",
            scenario.name,
            serde_json::to_string(&e.body()).unwrap_or_default()
        )
    })
}

/// The README's example request: one ticket, three questions.
const EXAMPLE_REQUEST: &str = include_str!("../../../../examples/request.json");

/// One scenario's request and what a forward pass of it computes.
struct Scenario {
    name: &'static str,
    what: String,
    request: DecisionRequest,
    /// Tokens of each prompt after chat templating.
    prompt_tokens: Vec<usize>,
    /// Tokens the decoder computes: the shared prefix once, then each prompt's own suffix.
    computed_tokens: usize,
    shared_prefix: usize,
}

/// Measured timings of a scenario, seconds, and what its runs answered.
#[derive(Default)]
struct Timings {
    runs: Vec<f64>,
    /// SHA-256 (hex) of the first run's answers as JSON (shortest round-trip floats, so equal digests
    /// mean equal bits), warm-up runs included.
    answers_sha256: Option<String>,
    /// Whether a later run's answers differed from the first run's.
    answers_differ: bool,
    /// The first run's answers.
    answers: Value,
    /// Through the engine, each timed run's split (ms): rendering and tokenizing (`prepare`),
    /// submission to its first pass (`queue`), that pass to the answer (`compute`), of which the
    /// model's passes (`pass`: [`crate::engine::PassModel::run_pass`], read-out included); the rest of a
    /// run is the submission and the reply's hand-over.
    prepare_ms: Vec<f64>,
    queue_ms: Vec<f64>,
    compute_ms: Vec<f64>,
    pass_ms: Vec<f64>,
}

impl Timings {
    /// Takes one run's answers: the first run's are kept with their digest, a later run's digest only
    /// compared with it.
    fn record_answers(&mut self, answers: &impl serde::Serialize) -> Result<()> {
        let digest = answers_digest(answers)?;
        match &self.answers_sha256 {
            None => {
                self.answers_sha256 = Some(digest);
                self.answers = serde_json::to_value(answers)?;
            }
            Some(first) => self.answers_differ |= *first != digest,
        }
        Ok(())
    }

    /// The integer path promises bit-identical answers for the same request; a benchmark that saw
    /// otherwise measured something broken.
    fn check_same(&self, scenario: &str, precision: Precision) -> Result<()> {
        if self.answers_differ && precision.is_integer() {
            bail!(
                "scenario {scenario}: the answers differed between runs of the same request at {}, which \
                 must give the same bits every time",
                precision.as_str()
            );
        }
        Ok(())
    }

    fn sorted(&self) -> Vec<f64> {
        let mut s = self.runs.clone();
        s.sort_by(f64::total_cmp);
        s
    }

    fn median(&self) -> f64 {
        median_of(&self.runs)
    }

    /// An engine run's split of its time, taken with the run.
    fn record_split(&mut self, run: &EngineRun) {
        self.prepare_ms.push(run.prepare_ms);
        self.queue_ms.push(run.output.queue_ms);
        self.compute_ms.push(run.output.compute_ms);
        self.pass_ms.push(run.pass_ms);
    }

    /// The medians of the engine runs' split (ms), and what is left of the median run time.
    fn split_json(&self) -> Value {
        if self.queue_ms.is_empty() {
            return Value::Null;
        }
        let (prepare, queue, compute, pass) = (
            median_of(&self.prepare_ms),
            median_of(&self.queue_ms),
            median_of(&self.compute_ms),
            median_of(&self.pass_ms),
        );
        json!({
            "prepare_ms": prepare,
            "queue_ms": queue,
            "compute_ms": compute,
            "pass_ms": pass,
            "around_pass_ms": compute - pass,
            "outside_ms": ms(self.median()) - queue - compute,
            "handover_ms": ms(self.median()) - prepare - queue - compute,
        })
    }

    /// Nearest-rank 95th percentile.
    fn p95(&self) -> f64 {
        let s = self.sorted();
        let rank = ((0.95 * s.len() as f64).ceil() as usize).clamp(1, s.len().max(1));
        s.get(rank - 1).copied().unwrap_or(f64::NAN)
    }
}

/// The median of `values` (NaN when empty).
fn median_of(values: &[f64]) -> f64 {
    let mut s = values.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// What a model's forward pass touches, from its GGUF and configuration.
struct ModelCost {
    config: Qwen35Config,
    /// Matrix parameters every token goes through (all 2-D tensors of the main layers).
    matrix_params: u64,
    /// Bytes one pass reads: every main-layer tensor and the final norm once, in the precision's storage,
    /// and the 26 letter rows of the output head.
    weight_bytes: u64,
}

impl ModelCost {
    fn new(gguf: &GgufFile, precision: Precision) -> Result<Self> {
        let config = Qwen35Config::from_gguf(gguf)?;
        let matrix_size = precision.matrix_dtype().size_in_bytes() as u64;
        let vector_size = precision.activation_dtype().size_in_bytes() as u64;
        let main_layer = |name: &str| -> bool {
            name.strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|i| i < config.n_layers)
        };
        let (mut matrix_params, mut weight_bytes) = (0u64, 0u64);
        for t in gguf.tensors() {
            if main_layer(&t.name) || t.name == "output_norm.weight" {
                if t.dims.len() == 2
                    && main_layer(&t.name)
                    && !t.name.ends_with("ssm_conv1d.weight")
                {
                    matrix_params += t.n_elements();
                    // The integer paths keep quantized matrices as stored; the float paths convert them.
                    let stored_quantized =
                        !matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
                    weight_bytes += if precision.is_integer() && stored_quantized {
                        t.n_bytes()
                    } else {
                        t.n_elements() * matrix_size
                    };
                } else {
                    weight_bytes += t.n_elements() * vector_size;
                }
            }
        }
        let head_row_bytes = config.hidden_size as u64 * matrix_size;
        Ok(Self {
            config,
            matrix_params,
            weight_bytes: weight_bytes + 26 * head_row_bytes,
        })
    }

    /// FLOPs of a pass over `segments` (past tokens, new tokens), with `n_prompts` read-outs of 26 rows.
    fn flops(&self, segments: &[(usize, usize)], n_prompts: usize) -> f64 {
        let c = &self.config;
        let new_tokens: usize = segments.iter().map(|&(_, t)| t).sum();
        let n_attention = c
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count() as f64;
        let n_delta = c
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::DeltaNet)
            .count() as f64;
        let matrices = 2.0 * self.matrix_params as f64 * new_tokens as f64;
        // Causal attention: query at position p reads p + 1 keys; QKᵀ and AV, 2 FLOPs per multiply-add.
        let key_reads: f64 = segments
            .iter()
            .map(|&(past, t)| (t * past) as f64 + (t * (t + 1)) as f64 / 2.0)
            .sum();
        let attention = n_attention * key_reads * 4.0 * (c.n_heads * c.head_dim) as f64;
        // Recurrent delta rule per value head and token: decay, Sᵀk, rank-1 update, Sᵀq (~7 dk·dv).
        let state = (c.linear_key_head_dim * c.linear_value_head_dim * c.linear_value_heads) as f64;
        let conv = 2.0 * (c.conv_dim() * c.conv_kernel) as f64;
        let delta = n_delta * new_tokens as f64 * (7.0 * state + conv);
        let head = 2.0 * 26.0 * c.hidden_size as f64 * n_prompts as f64;
        matrices + attention + delta + head
    }
}

fn parse_request(value: &Value) -> Result<DecisionRequest> {
    let body = serde_json::to_vec(value)?;
    DecisionRequest::parse(&body, &RequestDefaults::default()).map_err(|e| {
        anyhow::anyhow!(
            "bench request refused: {}",
            serde_json::to_string(&e.body()).unwrap_or_default()
        )
    })
}

/// A ticket of `sentences` varied support-ticket sentences (deterministic).
fn long_ticket(sentences: usize) -> String {
    const SUBJECTS: [&str; 6] = [
        "the invoice",
        "my card",
        "the mobile app",
        "the export",
        "our account",
        "the refund",
    ];
    const EVENTS: [&str; 6] = [
        "was charged twice",
        "shows an error",
        "stopped syncing",
        "is still pending",
        "got declined",
        "timed out",
    ];
    let mut text = String::from("Ticket history follows.");
    for i in 0..sentences {
        text.push_str(&format!(
            " Update {}: on day {} {} {} after {} attempts, reference #{}.",
            i + 1,
            i % 28 + 1,
            SUBJECTS[i % SUBJECTS.len()],
            EVENTS[(i / SUBJECTS.len()) % EVENTS.len()],
            i % 5 + 2,
            10_000 + i * 37
        ));
    }
    text
}

impl Scenario {
    fn new(
        name: &'static str,
        what: String,
        request: DecisionRequest,
        model: &DecoderLetterModel,
    ) -> Result<Self> {
        let config = crate::DecisionConfig::default();
        let mut prompts = Vec::new();
        for question in render_request(&request, &config).map_err(|e| anyhow::anyhow!("{e}"))? {
            for prompt in &question.prompts {
                prompts.push(model.prompt_tokens(prompt)?);
            }
        }
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let shared_prefix = if refs.len() > 1 {
            prism_model::shared_prefix_len(&refs)
        } else {
            0
        };
        let computed_tokens =
            shared_prefix + refs.iter().map(|p| p.len() - shared_prefix).sum::<usize>();
        Ok(Self {
            name,
            what,
            request,
            prompt_tokens: refs.iter().map(|p| p.len()).collect(),
            computed_tokens,
            shared_prefix,
        })
    }

    /// (past, new) token segments of the pass: the shared prefix, then each suffix after it.
    fn segments(&self) -> Vec<(usize, usize)> {
        let mut s = Vec::new();
        if self.shared_prefix > 0 {
            s.push((0, self.shared_prefix));
        }
        s.extend(
            self.prompt_tokens
                .iter()
                .map(|&n| (self.shared_prefix, n - self.shared_prefix)),
        );
        s
    }
}

fn scenarios(model: &DecoderLetterModel, long_tokens: usize) -> Result<Vec<Scenario>> {
    let example: Value = serde_json::from_str(EXAMPLE_REQUEST).context("examples/request.json")?;
    let mut short = example.clone();
    if let Some(questions) = short.get_mut("questions").and_then(Value::as_object_mut) {
        questions.retain(|name, _| name == "team");
    }
    let short_request = parse_request(&short)?;
    let shared_request = parse_request(&example)?;

    // The long ticket: one question, the state's ticket grown until the prompt has about long_tokens.
    let long_with = |sentences: usize| -> Result<Scenario> {
        let mut value = short.clone();
        value["state"] =
            json!({"ticket": long_ticket(sentences), "customer": example["state"]["customer"]});
        Scenario::new("long", String::new(), parse_request(&value)?, model)
    };
    let base = long_with(0)?.prompt_tokens[0];
    let probe = 64;
    let per_sentence =
        (long_with(probe)?.prompt_tokens[0].saturating_sub(base) as f64 / probe as f64).max(1.0);
    let mut sentences = ((long_tokens.saturating_sub(base)) as f64 / per_sentence)
        .round()
        .max(1.0) as usize;
    let mut long = long_with(sentences)?;
    for _ in 0..3 {
        let have = long.prompt_tokens[0] as f64;
        let adjust = ((long_tokens as f64 - have) / per_sentence).round() as i64;
        if adjust == 0 {
            break;
        }
        sentences = (sentences as i64 + adjust).max(1) as usize;
        long = long_with(sentences)?;
    }
    long.what =
        format!("1 question, ticket of {sentences} sentences (target {long_tokens} tokens)");

    let short = Scenario::new(
        "short",
        "1 question on the README ticket".into(),
        short_request,
        model,
    )?;
    let shared = Scenario::new(
        "shared",
        "3 questions on the README ticket".into(),
        shared_request,
        model,
    )?;
    Ok(vec![short, shared, long])
}

/// Read + write bytes per second of a large copy on `device` (best of a few).
fn copy_bandwidth(device: &Device) -> Result<f64> {
    let mut best = f64::INFINITY;
    if device.is_cpu() {
        let n = 64 << 20; // 64 Mi f32 = 256 MiB each way
        let src = vec![1f32; n];
        let mut dst = vec![0f32; n];
        let piece = 1 << 20;
        for _ in 0..4 {
            let start = Instant::now();
            dst.par_chunks_mut(piece)
                .zip(src.par_chunks(piece))
                .for_each(|(d, s)| d.copy_from_slice(s));
            best = best.min(start.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        Ok(2.0 * (n * 4) as f64 / best)
    } else {
        let n = 256 << 20; // 256 Mi f32 = 1 GiB each way
                           // A plain device-to-device copy (cuMemcpyDtoD) moves data at the DRAM's rate; candle's
                           // `slice_set` runs a strided copy kernel that reaches only about half of it on an H200.
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let src = dev.alloc_zeros::<f32>(n)?;
            let mut dst = dev.alloc_zeros::<f32>(n)?;
            for _ in 0..6 {
                device.synchronize()?;
                let start = Instant::now();
                dev.memcpy_dtod(&src, &mut dst)?;
                device.synchronize()?;
                best = best.min(start.elapsed().as_secs_f64());
            }
            return Ok(2.0 * (n * 4) as f64 / best);
        }
        let src = Tensor::ones(n, DType::F32, device)?;
        let dst = Tensor::zeros(n, DType::F32, device)?;
        for _ in 0..6 {
            device.synchronize()?;
            let start = Instant::now();
            dst.slice_set(&src, 0, 0)?;
            device.synchronize()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n * 4) as f64 / best)
    }
}

/// FLOP/s of large matmuls on `device` in `dtype`, best of a few: candle's matmul, and on the CPU also
/// prism's own row-invariant kernel on a projection-like shape (the faster one sets the floor).
fn matmul_rate(device: &Device, dtype: DType) -> Result<f64> {
    let n = if device.is_cpu() { 1024 } else { 8192 };
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        device.synchronize()?;
        let start = Instant::now();
        let c = a.matmul(&b)?;
        device.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64());
        drop(c);
    }
    let mut rate = 2.0 * (n as f64).powi(3) / best;
    if device.is_cpu() {
        let (m, n, k) = (256, 2048, 1024);
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect();
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = Instant::now();
            std::hint::black_box(prism_model::matmul::matmul_xwt::<f32, f32>(&x, &w, m, n, k));
            best = best.min(start.elapsed().as_secs_f64());
        }
        rate = rate.max(2.0 * (m * n * k) as f64 / best);
    }
    Ok(rate)
}

/// On a CUDA device and an integer precision, cuBLAS's int8 GEMM rate (ops/s, 8192³); `None` elsewhere
/// or when cuBLAS cannot run it (logged).
fn integer_matmul_rate(device: &Device, precision: Precision) -> Result<Option<f64>> {
    if !precision.is_integer() {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        // A floor is a reference, not the measurement: if cuBLAS refuses the int8 product, say so and
        // let the caller fall back to the float rate rather than lose the bench.
        return match prism_model::cuda::int8_matmul_rate(cuda, 8192, 5) {
            Ok(rate) => Ok(Some(rate)),
            Err(e) => {
                tracing::warn!("cuBLAS int8 GEMM rate unavailable ({e}); the compute floor uses the float rate");
                Ok(None)
            }
        };
    }
    let _ = device;
    Ok(None)
}

/// This process's resident memory and its peak, bytes (Linux `/proc/self/status`).
fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line
            .trim_start_matches(key)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Whether our kernels are launched programmatically on `device` (false off CUDA).
fn programmatic_launch_in_effect(device: &Device) -> Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => Ok(prism_quant::cuda::programmatic_launch_in_effect(dev)?),
        _ => Ok(false),
    }
}

fn open_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            #[cfg(feature = "cuda")]
            {
                prism_quant::cuda_launch::open_device(0).context("opening CUDA device 0")
            }
            #[cfg(not(feature = "cuda"))]
            {
                bail!("--device cuda: this prism was built without the `cuda` feature (cargo build --features cuda)")
            }
        }
        other => bail!("--device {other:?}: expected cpu or cuda"),
    }
}

fn default_gguf(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(crate::synth_files::GGUF_NAME);
    if path.is_file() {
        return Ok(path);
    }
    let found: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    match found.as_slice() {
        [one] => Ok(dir.join(one)),
        _ => bail!(
            "{} has no {}; pass --gguf FILE (GGUF files there: {found:?})",
            dir.display(),
            crate::synth_files::GGUF_NAME
        ),
    }
}

/// A CUDA profiler range for `ncu --profile-from-start off` (`--profiler-range`): started on
/// creation, stopped on drop. Without the `cuda` feature it is an error to ask for one.
struct ProfilerRange {
    #[cfg(feature = "cuda")]
    driver: libloading::Library,
}

#[cfg(feature = "cuda")]
type ProfilerCall = unsafe extern "C" fn() -> i32;

impl ProfilerRange {
    #[cfg(feature = "cuda")]
    fn start() -> Result<Self> {
        // SAFETY: loading the CUDA driver library runs no initialisers beyond the driver's own.
        let driver = unsafe { libloading::Library::new("libcuda.so.1") }
            .context("loading libcuda.so.1 for cuProfilerStart")?;
        let range = Self { driver };
        range.call(b"cuProfilerStart\0")?;
        Ok(range)
    }

    #[cfg(feature = "cuda")]
    fn call(&self, name: &[u8]) -> Result<()> {
        // SAFETY: both entry points have the signature `CUresult f(void)`.
        let code = unsafe {
            let f: libloading::Symbol<ProfilerCall> = self
                .driver
                .get(name)
                .with_context(|| format!("libcuda has no {}", String::from_utf8_lossy(name)))?;
            f()
        };
        if code != 0 {
            bail!(
                "{} returned CUDA error {code}",
                String::from_utf8_lossy(name)
            );
        }
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn start() -> Result<Self> {
        bail!("--profiler-range needs a CUDA build (the `cuda` feature)")
    }
}

#[cfg(feature = "cuda")]
impl Drop for ProfilerRange {
    fn drop(&mut self) {
        if let Err(e) = self.call(b"cuProfilerStop\0") {
            tracing::warn!("{e:#}");
        }
    }
}

fn ms(secs: f64) -> f64 {
    secs * 1e3
}

/// What `prism bench` measures, and how (its flags).
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The model directory (tokenizer, chat template, config.json, decision_config.json).
    pub model_dir: PathBuf,
    /// The GGUF file; default DIR/model.gguf (or the directory's only .gguf).
    pub gguf: Option<PathBuf>,
    /// `--precision` (`auto` included).
    pub precision: String,
    /// fp8 K/V storage.
    pub kv_fp8: bool,
    /// `cpu` or `cuda` (device 0).
    pub device: String,
    pub runs: usize,
    pub warmup: usize,
    /// Prompt length of the long scenario, in tokens.
    pub long_tokens: usize,
    /// A profiled run of each scenario after the timed ones, in this mode (off: none).
    pub profile: prism_model::profile::Mode,
    pub load_threads: Option<usize>,
    /// Each scenario through the engine too (with `profile`, one profiled run of each there as well:
    /// the report's `engine_profile`).
    pub engine: bool,
    /// Each scenario through the engine over the model split over this many devices that share the
    /// one (`DecoderLetterModel::tensor_parallel`): the report's `tensor_parallel`, its answers'
    /// digests required equal to the direct path's.
    pub tp: Option<usize>,
    /// A CUDA profiler range around the last timed run of each scenario.
    pub profiler_range: bool,
    /// A sampling profile of the host's CPU time ([`host_profile`]) written here: the last timed run
    /// of each scenario, or with `think` every timed run of each batch size.
    pub host_profile: Option<PathBuf>,
    /// Thought decoding instead of the read-out scenarios: the thought budget.
    pub think: Option<usize>,
    /// With `think`: the batch sizes.
    pub think_batch: Vec<usize>,
    /// With `engine`: batches of this many distinct three-question requests submitted at once, one
    /// measurement each (the report's `engine_batches`).
    pub engine_batch: Vec<usize>,
    /// CUDA: the integer products of 3 to this many rows on the narrow kernel
    /// (`prism_quant::cuda::set_auto_narrow_rows`; `None`: the built-in choice).
    pub narrow_rows: Option<usize>,
    /// CUDA: the integer products up to this many rows (past the narrow kernel's) on the swapped tile
    /// (`prism_quant::cuda::set_auto_swapped_rows`; `None`: the built-in choice).
    pub swapped_rows: Option<usize>,
    /// CUDA (compute capability 9.x): launch our kernels with programmatic dependent launch
    /// (`prism_quant::cuda_launch::set_programmatic_launch`; empty: on). With both values (`--think`
    /// only), each thought run is measured under each in turn on the one model load (the rows'
    /// `variant`).
    pub programmatic_launch: Vec<bool>,
}

/// The thought runs' variants: programmatic launch as each `--programmatic-launch` value says, in turn,
/// when it gives several, else none. Each label says whether that value is in effect on `device`
/// (a GPU before compute capability 9.0 launches plainly either way).
fn launch_variants(args: &BenchOptions, device: &Device) -> Result<Vec<think::Variant>> {
    if args.programmatic_launch.len() < 2 {
        return Ok(Vec::new());
    }
    #[cfg(feature = "cuda")]
    {
        let mut variants = Vec::new();
        for &on in &args.programmatic_launch {
            prism_quant::cuda_launch::set_programmatic_launch(on);
            let in_effect = programmatic_launch_in_effect(device)?;
            variants.push(think::Variant {
                label: format!(
                    "programmatic-launch {} (in effect: {in_effect})",
                    if on { "on" } else { "off" }
                ),
                apply: Box::new(move || {
                    prism_quant::cuda_launch::set_programmatic_launch(on);
                    Ok(())
                }),
            });
        }
        Ok(variants)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        bail!("--programmatic-launch chooses how CUDA kernels are launched: this build has no CUDA")
    }
}

/// Runs the benchmark and returns its report (the JSON `prism bench --json` prints). `progress`
/// gets the lines to show while it runs (the profiles, the thought rows).
pub fn run(args: &BenchOptions, progress: &mut dyn FnMut(String)) -> Result<Value> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if let Some(path) = &args.host_profile {
        host_profile::check_writable(path)?;
    }
    #[cfg(feature = "cuda")]
    if let Some(rows) = args.narrow_rows {
        prism_quant::cuda::set_auto_narrow_rows(rows);
    }
    #[cfg(feature = "cuda")]
    if let Some(rows) = args.swapped_rows {
        prism_quant::cuda::set_auto_swapped_rows(rows);
    }
    #[cfg(feature = "cuda")]
    if let [on] = args.programmatic_launch.as_slice() {
        prism_quant::cuda_launch::set_programmatic_launch(*on);
    }
    if args.programmatic_launch.len() > 1 && args.think.is_none() {
        bail!("--programmatic-launch on,off (both) is measured with --think only");
    }
    let device = open_device(&args.device)?;
    let variants = launch_variants(args, &device)?;
    // With variants, each row's `variant` says how it was launched.
    let programmatic = if variants.is_empty() {
        Some(programmatic_launch_in_effect(&device)?)
    } else {
        None
    };
    let gguf_path = match &args.gguf {
        Some(p) => p.clone(),
        None => default_gguf(&args.model_dir)?,
    };
    let gguf =
        GgufFile::open(&gguf_path).with_context(|| format!("opening {}", gguf_path.display()))?;
    let precision = Precision::resolve(&args.precision, &gguf)?;
    let source = ModelSource {
        gguf: gguf_path.clone(),
        model_dir: Some(args.model_dir.clone()),
        mmproj: None,
    };
    let kv_storage = if args.kv_fp8 {
        KvStorage::Fp8
    } else {
        KvStorage::Native
    };
    let options = LoadOptions {
        device: device.clone(),
        precision,
        load_threads: args.load_threads,
        kv_storage,
        ..LoadOptions::default()
    };
    let memory_before = process_memory();
    let loading = Instant::now();
    let loaded = DecoderLetterModel::load(&source, &options, args.long_tokens.max(4096) * 2)
        .with_context(|| format!("loading {}", gguf_path.display()))?;
    device.synchronize()?;
    let load_secs = loading.elapsed().as_secs_f64();
    let memory_loaded = process_memory();
    let device_loaded = prism_model::device_memory(&device);
    let mut model = loaded.model;
    let cost = ModelCost::new(&gguf, precision)?;
    let mut host = args
        .host_profile
        .as_deref()
        .map(host_profile::HostProfile::start)
        .transpose()?;

    if let Some(budget) = args.think {
        let plan = think::ThinkPlan {
            budget,
            batches: &args.think_batch,
            runs: args.runs,
            profile: args.profile,
            variants: &variants,
        };
        let (rows, profile) =
            think::thought_rows(model, &loaded.config, plan, host.as_mut(), progress)?;
        if let Some(host) = host {
            host.finish()?;
        }
        let report = json!({
            "model": gguf_path.display().to_string(),
            "device": args.device,
            "precision": precision.as_str(),
            "load_s": load_secs,
            "device_memory_bytes": prism_model::device_memory(&device).map(|m| json!({
                "used": m.0,
                "total": m.1,
                "after_load": device_loaded.map(|l| l.0),
            })),
            "narrow_rows": args.narrow_rows,
            "swapped_rows": args.swapped_rows,
            "programmatic_launch": programmatic,
            "thoughts": rows,
            "profile": profile,
        });
        return Ok(report);
    }
    let scenarios = scenarios(&model, args.long_tokens)?;
    let mut timed = Vec::new();
    for scenario in &scenarios {
        let mut timings = Timings::default();
        for run in 0..args.warmup + args.runs {
            let last = run + 1 == args.warmup + args.runs;
            let mut range = if args.profiler_range && last {
                Some(ProfilerRange::start()?)
            } else {
                None
            };
            if let (Some(host), true) = (host.as_mut(), last) {
                host.open(scenario.name);
            }
            let start = Instant::now();
            let response = decide_scenario("scenario", scenario, &loaded.config, &mut model)?;
            device.synchronize()?;
            let secs = start.elapsed().as_secs_f64();
            // Stop the profiler range (if any) after the synchronization.
            let _ = range.take();
            if let Some(host) = &host {
                host.close();
            }
            if run >= args.warmup {
                timings.runs.push(secs);
            }
            if response.answers.len() != scenario.request.questions.len() {
                bail!(
                    "scenario {}: {} answers for {} questions",
                    scenario.name,
                    response.answers.len(),
                    scenario.request.questions.len()
                );
            }
            timings.record_answers(&response.answers)?;
        }
        timings.check_same(scenario.name, precision)?;
        timed.push(timings);
    }
    if let Some(host) = host {
        host.finish()?;
    }
    let mut profiles = serde_json::Map::new();
    if args.profile != prism_model::profile::Mode::Off {
        prism_model::profile::set_mode(args.profile);
        prism_model::profile::take()?;
        for scenario in &scenarios {
            let start = Instant::now();
            decide_scenario("profiling", scenario, &loaded.config, &mut model)?;
            device.synchronize()?;
            let total = start.elapsed().as_secs_f64();
            profiles.insert(
                scenario.name.to_string(),
                profile_report(args.profile, scenario.name, "", total, progress)?,
            );
        }
        prism_model::profile::set_mode(prism_model::profile::Mode::Off);
    }
    let model_name = crate::LetterModel::model_name(&model).to_string();
    let tensor_parallel = match args.tp {
        Some(devices) => Some(tensor_parallel_timings(
            &model,
            devices,
            &loaded.config,
            &scenarios,
            &timed,
            args,
            precision,
        )?),
        None => None,
    };
    // The same requests through the engine the server runs (its step loop, one request at a time, the
    // prefix cache off so every run computes its evidence): what the engine adds to the decision path.
    let (engine_runs, engine_profiles, followup, batches) = if args.engine {
        engine_timings(model, &loaded.config, &scenarios, args, precision, progress)?
    } else {
        drop(model);
        (Vec::new(), serde_json::Map::new(), None, Vec::new())
    };
    // The follow-up's answers against the one-question request's computed whole: the same bits.
    let followup = match followup {
        Some((timings, profile)) => {
            let short = scenarios
                .iter()
                .zip(&timed)
                .find(|(s, _)| s.name == "short")
                .map(|(_, t)| t.answers_sha256.clone());
            if short.as_ref() != Some(&timings.answers_sha256) {
                bail!(
                    "the prefix-cache follow-up answered {:?}, the one-question request computed whole {short:?}",
                    timings.answers_sha256
                );
            }
            Some(json!({
                "what": "the short request after the shared one (its evidence from the prefix cache), through the engine",
                "runs_ms": timings.runs.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
                "median_ms": ms(timings.median()),
                "p95_ms": ms(timings.p95()),
                "answers_sha256": timings.answers_sha256,
                "answers_same_every_run": !timings.answers_differ,
                "split": timings.split_json(),
                "profile": profile,
            }))
        }
        None => None,
    };
    // Memory before the floor measurements, whose buffers would otherwise be the peak.
    let memory_after = process_memory();
    let device_after = prism_model::device_memory(&device);

    let bandwidth = copy_bandwidth(&device)?;
    let matmul_dtype = if device.is_cpu() {
        DType::F32
    } else {
        precision.matrix_dtype()
    };
    // The integer path's work runs on the int8 tensor cores: on a GPU its floor is cuBLAS's int8 rate.
    let (rate, rate_label) = match integer_matmul_rate(&device, precision)? {
        Some(rate) => (rate, "INT8, cuBLAS".to_string()),
        None => (
            matmul_rate(&device, matmul_dtype)?,
            format!("{matmul_dtype:?}"),
        ),
    };
    let mut rows = Vec::new();
    for (i, (scenario, timings)) in scenarios.iter().zip(&timed).enumerate() {
        let engine = engine_runs.get(i);
        let bytes = cost.weight_bytes;
        let flops = cost.flops(&scenario.segments(), scenario.prompt_tokens.len());
        let bandwidth_floor = bytes as f64 / bandwidth;
        let compute_floor = flops / rate;
        let floor = bandwidth_floor.max(compute_floor);
        rows.push(json!({
            "scenario": scenario.name,
            "what": scenario.what,
            "prompts": scenario.prompt_tokens.len(),
            "prompt_tokens": scenario.prompt_tokens,
            "shared_prefix_tokens": scenario.shared_prefix,
            "computed_tokens": scenario.computed_tokens,
            "runs_ms": timings.runs.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
            "median_ms": ms(timings.median()),
            "p95_ms": ms(timings.p95()),
            "weight_bytes": bytes,
            "flops": flops,
            "bandwidth_floor_ms": ms(bandwidth_floor),
            "compute_floor_ms": ms(compute_floor),
            "floor_ms": ms(floor),
            "median_over_floor": timings.median() / floor,
            "tokens_per_s": scenario.computed_tokens as f64 / timings.median(),
            "answers_sha256": timings.answers_sha256,
            "answers_same_every_run": !timings.answers_differ,
            "answers": timings.answers,
            "engine": engine.map(|e| json!({
                "runs_ms": e.runs.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
                "median_ms": ms(e.median()),
                "p95_ms": ms(e.p95()),
                "answers_sha256": e.answers_sha256,
                "answers_same_every_run": !e.answers_differ,
                "split": e.split_json(),
            })),
        }));
    }
    let report = json!({
        "profile": profiles,
        "engine_profile": engine_profiles,
        "followup": followup,
        "engine_batches": batches,
        "tensor_parallel": tensor_parallel,
        "model": model_name,
        "gguf": gguf_path.display().to_string(),
        "device": args.device,
        "precision": precision.as_str(),
        "kv_storage": kv_storage.as_str(),
        "narrow_rows": args.narrow_rows,
        "swapped_rows": args.swapped_rows,
        "programmatic_launch": programmatic,
        "threads": rayon::current_num_threads(),
        "layers": cost.config.n_layers,
        "hidden_size": cost.config.hidden_size,
        "vocab_size": cost.config.vocab_size,
        "matrix_params": cost.matrix_params,
        "load_s": load_secs,
        "process_rss_bytes": {
            "before_load": memory_before.map(|m| m.0),
            "after_load": memory_loaded.map(|m| m.0),
            "after_runs": memory_after.map(|m| m.0),
            "peak": memory_after.map(|m| m.1),
        },
        "device_memory_bytes": {
            "after_load": device_loaded.map(|m| m.0),
            "after_runs": device_after.map(|m| m.0),
            "total": device_after.map(|m| m.1),
        },
        "copy_bandwidth_bytes_per_s": bandwidth,
        "matmul_flops_per_s": rate,
        "matmul_dtype": rate_label,
        "warmup": args.warmup,
        "runs": args.runs,
        "scenarios": rows,
    });
    Ok(report)
}

/// The engine's timings of each scenario, their profiles, and the prefix-cache follow-up's timings
/// and profile ([`followup_timings`]).
type EngineTimings = (
    Vec<Timings>,
    serde_json::Map<String, Value>,
    Option<(Timings, Option<Value>)>,
    Vec<Value>,
);

/// Each scenario's request through an [`crate::Engine`] on `model` (prefix cache off, one request
/// at a time), `args.warmup` + `args.runs` times; the timings of the timed runs and the answers' digest.
fn engine_timings(
    model: DecoderLetterModel,
    config: &crate::DecisionConfig,
    scenarios: &[Scenario],
    args: &BenchOptions,
    precision: Precision,
    progress: &mut dyn FnMut(String),
) -> Result<EngineTimings> {
    let followup_model = model.share();
    let clock = Arc::new(PassClock::default());
    let (engine, worker) = bench_engine(model, config.clone(), 64, false, Some(clock.clone()))?;
    let all = scenario_timings(
        &engine,
        &clock,
        scenarios,
        args,
        precision,
        "through the engine",
    )?;
    // One more run of each scenario with the model's profile on: the sections of the engine's passes,
    // to set against the direct path's (what the engine adds, where).
    let mut profiles = serde_json::Map::new();
    if args.profile != prism_model::profile::Mode::Off {
        prism_model::profile::set_mode(args.profile);
        prism_model::profile::take()?;
        for scenario in scenarios {
            let start = Instant::now();
            engine.decide(scenario.request.clone(), None).map_err(|e| {
                anyhow::anyhow!("profiling {} through the engine: {e}", scenario.name)
            })?;
            let total = start.elapsed().as_secs_f64();
            profiles.insert(
                scenario.name.to_string(),
                profile_report(
                    args.profile,
                    scenario.name,
                    " through the engine",
                    total,
                    progress,
                )?,
            );
        }
        prism_model::profile::set_mode(prism_model::profile::Mode::Off);
    }
    let mut batches = Vec::new();
    for &size in &args.engine_batch {
        batches.push(batch_timings(&engine, &clock, size, args, progress)?);
    }
    drop(engine);
    worker.join();
    let followup = followup_timings(followup_model, config, scenarios, args, precision, progress)?;
    Ok((all, profiles, followup, batches))
}

/// Each scenario's request through `engine`, `args.warmup` + `args.runs` times: the timed runs, their
/// splits and the answers' digest (the same every run). `what` names the engine in errors.
fn scenario_timings(
    engine: &crate::Engine,
    clock: &PassClock,
    scenarios: &[Scenario],
    args: &BenchOptions,
    precision: Precision,
    what: &str,
) -> Result<Vec<Timings>> {
    let mut all = Vec::new();
    for scenario in scenarios {
        let mut timings = Timings::default();
        for run in 0..args.warmup + args.runs {
            let start = Instant::now();
            let run_ = timed_decide(engine, clock, &scenario.request)
                .map_err(|e| anyhow::anyhow!("scenario {} {what}: {e}", scenario.name))?;
            let secs = start.elapsed().as_secs_f64();
            if run >= args.warmup {
                timings.runs.push(secs);
                timings.record_split(&run_);
            }
            timings.record_answers(&run_.output.response.answers)?;
        }
        timings.check_same(scenario.name, precision)?;
        all.push(timings);
    }
    Ok(all)
}

/// Each scenario through an engine over `model` split over `devices` devices that share its one
/// (prefix cache off, one request at a time, `args.warmup` + `args.runs` times): the medians, and the
/// answers' digests, which must equal the direct path's (`direct`).
fn tensor_parallel_timings(
    model: &DecoderLetterModel,
    devices: usize,
    config: &crate::DecisionConfig,
    scenarios: &[Scenario],
    direct: &[Timings],
    args: &BenchOptions,
    precision: Precision,
) -> Result<Value> {
    let shares: Vec<DecoderLetterModel> = (0..devices).map(|_| model.share()).collect();
    let split = DecoderLetterModel::tensor_parallel(&shares)
        .map_err(|e| anyhow::anyhow!("--tp {devices}: {e}"))?;
    let clock = Arc::new(PassClock::default());
    let (engine, worker) = bench_engine(split, config.clone(), 64, false, Some(clock.clone()))?;
    let what = format!("split over {devices} devices");
    let all = scenario_timings(&engine, &clock, scenarios, args, precision, &what)?;
    let mut rows = Vec::new();
    for ((scenario, alone), timings) in scenarios.iter().zip(direct).zip(all) {
        if timings.answers_sha256 != alone.answers_sha256 {
            bail!(
                "scenario {} split over {devices} devices answered {:?}, the one device {:?}",
                scenario.name,
                timings.answers_sha256,
                alone.answers_sha256
            );
        }
        rows.push(json!({
            "scenario": scenario.name,
            "runs_ms": timings.runs.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
            "median_ms": ms(timings.median()),
            "answers_sha256": timings.answers_sha256,
            "split": timings.split_json(),
        }));
    }
    drop(engine);
    worker.join();
    Ok(json!({
        "devices": devices,
        "what": "each scenario through the engine over the model split over this many devices sharing the one (its answers' digests equal the direct path's)",
        "scenarios": rows,
    }))
}

/// `size` distinct three-question requests (the README request, its ticket numbered) through the
/// engine in one pass (rendered and tokenized before, not timed), `args.warmup` + `args.runs` times,
/// each time with tickets of its own (the prefix cache is off): the time from the pass before theirs
/// to their last answer, the engine's passes and their time, and whether every request answered what
/// it answers alone (asked alone just before). With a profile, one more batch profiled: where a pass
/// of several requests goes.
fn batch_timings(
    engine: &crate::Engine,
    clock: &PassClock,
    size: usize,
    args: &BenchOptions,
    progress: &mut dyn FnMut(String),
) -> Result<Value> {
    if size == 0 {
        bail!("--engine-batch sizes must be at least 1");
    }
    let example: Value = serde_json::from_str(EXAMPLE_REQUEST).context("examples/request.json")?;
    let request = |run: usize, k: usize| -> Result<DecisionRequest> {
        let mut value = example.clone();
        let ticket = value["state"]["ticket"].as_str().unwrap_or_default();
        value["state"]["ticket"] = json!(format!("[{run}.{k}] {ticket}"));
        parse_request(&value)
    };
    // One batch: every request prepared; a request of its own submitted first and, once the step
    // loop has taken it, the batch, which so waits for that pass and goes into the next one whole;
    // timed from the first request's answer. `profiling`: the profile's sections of that first pass
    // are dropped. The batch's answers' digests in order.
    let batch = |run: usize, profiling: bool| -> Result<(f64, f64, u64, Vec<String>)> {
        let prepare = |k: usize| -> Result<crate::engine::Prepared> {
            engine.prepare(request(run, k)?).map_err(|e| {
                anyhow::anyhow!("{}", serde_json::to_string(&e.body()).unwrap_or_default())
            })
        };
        let first = prepare(size)?;
        let prepared = (0..size).map(prepare).collect::<Result<Vec<_>>>()?;
        let submit = |prepared, reply: crate::engine::Reply| {
            engine
                .submit(prepared, reply, None, crate::engine::CancelToken::default())
                .map_err(|e| anyhow::anyhow!("{e}"))
        };
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        submit(
            first,
            Box::new(move |result| {
                let _ = first_tx.send(result);
            }),
        )?;
        // Until the step loop has taken it, or it is answered already (then nothing waits on a count
        // that went back to 0).
        let mut first_answer = None;
        while first_answer.is_none() && engine.queue_state().running == 0 {
            first_answer = first_rx.try_recv().ok();
            std::thread::yield_now();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        for (k, prepared) in prepared.into_iter().enumerate() {
            let tx = tx.clone();
            submit(
                prepared,
                Box::new(move |result| {
                    let _ = tx.send((k, result));
                }),
            )?;
        }
        drop(tx);
        match first_answer {
            Some(answer) => answer,
            None => first_rx.recv().context("the engine stopped")?,
        }
        .map_err(|e| anyhow::anyhow!("the request before the batch: {e}"))?;
        let start = Instant::now();
        let passes_before = engine.stats().passes;
        clock.take();
        if profiling {
            prism_model::profile::take()?;
        }
        let mut digests = vec![String::new(); size];
        for (k, result) in rx.iter() {
            let output =
                result.map_err(|e| anyhow::anyhow!("batch of {size}, request {k}: {e}"))?;
            digests[k] = answers_digest(&output.response.answers)?;
        }
        let secs = start.elapsed().as_secs_f64();
        let passes = engine.stats().passes - passes_before;
        Ok((secs, clock.take(), passes, digests))
    };
    let mut walls = Vec::new();
    let mut pass_secs = Vec::new();
    let mut passes = Vec::new();
    let mut differ = 0;
    for run in 0..args.warmup + args.runs {
        // Each request's answer alone (before its batch, same tickets), then the batch.
        let alone = (0..size)
            .map(|k| {
                let output = engine
                    .decide(request(run, k)?, None)
                    .map_err(|e| anyhow::anyhow!("batch request {k} alone: {e}"))?;
                answers_digest(&output.response.answers)
            })
            .collect::<Result<Vec<_>>>()?;
        let (wall, pass, n, digests) = batch(run, false)?;
        differ += digests.iter().zip(&alone).filter(|(a, b)| a != b).count();
        if run >= args.warmup {
            walls.push(wall);
            pass_secs.push(pass);
            passes.push(n);
        }
    }
    let median = median_of(&walls);
    progress(format!(
        "batch of {size} three-question requests through the engine: median {:.1} ms, {:.2} requests/s, \
         {} passes, {differ} answers differing from alone",
        ms(median),
        size as f64 / median,
        passes.first().copied().unwrap_or(0),
    ));
    let profile = if args.profile != prism_model::profile::Mode::Off {
        prism_model::profile::set_mode(args.profile);
        prism_model::profile::take()?;
        let (total, _, _, _) = batch(args.warmup + args.runs, true)?;
        let label = format!("batch of {size}");
        let report = profile_report(args.profile, &label, " through the engine", total, progress)?;
        prism_model::profile::set_mode(prism_model::profile::Mode::Off);
        Some(report)
    } else {
        None
    };
    Ok(json!({
        "requests": size,
        "what": "distinct three-question requests (the README request, tickets numbered) submitted at once, prefix cache off",
        "runs_ms": walls.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
        "median_ms": ms(median),
        "requests_per_s": size as f64 / median,
        "pass_ms": pass_secs.iter().map(|&s| ms(s)).collect::<Vec<_>>(),
        "passes": passes,
        "answers_differing_from_alone": differ,
        "profile": profile,
    }))
}

/// A prefix-cache follow-up through an engine with its prefix cache on: the three-question request
/// once (its evidence cached), then the one-question request on the same evidence, `args.warmup` +
/// `args.runs` times, each computing only its question's tail. Its answers must have the bits of the
/// one-question request computed whole (the `short` scenario's, checked by the caller), and every run
/// must have hit the cache. With a profile, one more run profiled.
// The parameters of `engine_timings`, which calls it with its own: one run's model, scenarios and flags.
fn followup_timings(
    model: DecoderLetterModel,
    config: &crate::DecisionConfig,
    scenarios: &[Scenario],
    args: &BenchOptions,
    precision: Precision,
    progress: &mut dyn FnMut(String),
) -> Result<Option<(Timings, Option<Value>)>> {
    let by_name = |name: &str| scenarios.iter().find(|s| s.name == name);
    let (Some(short), Some(shared)) = (by_name("short"), by_name("shared")) else {
        return Ok(None);
    };
    let clock = Arc::new(PassClock::default());
    let (engine, worker) = bench_engine(model, config.clone(), 64, true, Some(clock.clone()))?;
    engine
        .decide(shared.request.clone(), None)
        .map_err(|e| anyhow::anyhow!("the follow-up's first request: {e}"))?;
    let hits_before = engine.stats().prefix_cache.hits;
    let mut timings = Timings::default();
    for run in 0..args.warmup + args.runs {
        let start = Instant::now();
        let run_ = timed_decide(&engine, &clock, &short.request)
            .map_err(|e| anyhow::anyhow!("the follow-up: {e}"))?;
        let secs = start.elapsed().as_secs_f64();
        if run >= args.warmup {
            timings.runs.push(secs);
            timings.record_split(&run_);
        }
        timings.record_answers(&run_.output.response.answers)?;
    }
    timings.check_same("followup", precision)?;
    let hits = engine.stats().prefix_cache.hits - hits_before;
    if hits < (args.warmup + args.runs) as u64 {
        bail!(
            "the follow-up hit the prefix cache {hits} times in {} runs",
            args.warmup + args.runs
        );
    }
    let profile = if args.profile != prism_model::profile::Mode::Off {
        prism_model::profile::set_mode(args.profile);
        prism_model::profile::take()?;
        let start = Instant::now();
        engine
            .decide(short.request.clone(), None)
            .map_err(|e| anyhow::anyhow!("profiling the follow-up: {e}"))?;
        let total = start.elapsed().as_secs_f64();
        let report = profile_report(
            args.profile,
            "followup",
            " through the engine",
            total,
            progress,
        )?;
        prism_model::profile::set_mode(prism_model::profile::Mode::Off);
        Some(report)
    } else {
        None
    };
    drop(engine);
    worker.join();
    progress(format!(
        "followup (short after shared, prefix cache on): median {:.2} ms",
        ms(timings.median())
    ));
    Ok(Some((timings, profile)))
}

/// The profile sections recorded since the last [`prism_model::profile::take`], printed (one run of
/// `scenario`, `total` seconds; `path` names the path when not the direct one) and as JSON.
fn profile_report(
    mode: prism_model::profile::Mode,
    scenario: &str,
    path: &str,
    total: f64,
    progress: &mut dyn FnMut(String),
) -> Result<Value> {
    let sections = prism_model::profile::take()?;
    progress(format!(
        "profile ({}) of {scenario}{path} (one run, {:.1} ms; device ms, share, host ms):",
        mode.as_str(),
        ms(total)
    ));
    let mut rows = Vec::new();
    for s in &sections {
        let t = s.device.as_secs_f64();
        let h = s.host.as_secs_f64();
        progress(format!(
            "  {:<45} {:>10.2} ms {:>6.1}% {:>10.2} ms {:>6} calls",
            s.name,
            ms(t),
            100.0 * t / total,
            ms(h),
            s.calls
        ));
        rows.push(json!({"section": s.name, "ms": ms(t), "host_ms": ms(h), "calls": s.calls}));
    }
    Ok(json!({"mode": mode.as_str(), "total_ms": ms(total), "sections": rows}))
}

/// Adds up the time of the engine's passes (its observer).
#[derive(Default)]
struct PassClock(std::sync::Mutex<f64>);

impl crate::engine::EngineObserver for PassClock {
    fn pass(&self, _record: &crate::engine::PassRecord, seconds: f64) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) += seconds;
    }
}

impl PassClock {
    /// The seconds added up since the last call.
    fn take(&self) -> f64 {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One request through the engine, timed in parts.
struct EngineRun {
    output: crate::engine::JobOutput,
    /// Rendering and tokenizing ([`crate::Engine::prepare`]), ms.
    prepare_ms: f64,
    /// The engine's passes while it ran ([`PassClock`]), ms.
    pass_ms: f64,
}

/// [`crate::Engine::decide`] in its parts: prepare (timed), submit, wait; the passes' time from `clock`
/// (the engine runs nothing else meanwhile).
fn timed_decide(
    engine: &crate::Engine,
    clock: &PassClock,
    request: &DecisionRequest,
) -> Result<EngineRun> {
    clock.take();
    let start = Instant::now();
    let prepared = engine
        .prepare(request.clone())
        .map_err(|e| anyhow::anyhow!("{}", serde_json::to_string(&e.body()).unwrap_or_default()))?;
    let prepare_ms = ms(start.elapsed().as_secs_f64());
    let (tx, rx) = std::sync::mpsc::channel();
    engine
        .submit(
            prepared,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
            None,
            crate::engine::CancelToken::default(),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let output = rx
        .recv()
        .context("the engine stopped")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(EngineRun {
        output,
        prepare_ms,
        pass_ms: ms(clock.take()),
    })
}

/// An engine for the benchmarks on `model`: the prefix cache off (every run computes its evidence)
/// unless `cache` (then the server's default budgets), no prompt-length limits, `seats` thoughts
/// decoded at once and a queue that holds them; `observer` sees every pass.
fn bench_engine<D: prism_model::Decoder + 'static>(
    model: DecoderLetterModel<D>,
    config: crate::DecisionConfig,
    seats: usize,
    cache: bool,
    observer: Option<Arc<dyn crate::engine::EngineObserver>>,
) -> Result<(crate::Engine, crate::EngineWorker)> {
    use crate::{Engine, EngineOptions, PrefixCacheLimits};
    let encoder = model.encoder();
    let prefix_cache = if cache {
        EngineOptions::default().prefix_cache
    } else {
        PrefixCacheLimits {
            max_tokens: 0,
            max_bytes: 0,
        }
    };
    Ok(Engine::start(
        model,
        encoder,
        config,
        EngineOptions {
            think_seqs: seats,
            queue_size: seats.max(64),
            max_prompt_tokens: usize::MAX / 2,
            max_request_tokens: usize::MAX / 2,
            prefix_cache,
            ..EngineOptions::default()
        },
        observer,
    )?)
}

/// SHA-256 (hex) of `answers` as JSON: serde_json writes each float as its shortest round-trip
/// decimal, so two digests are equal exactly when the answers have the same bits.
fn answers_digest<T: serde::Serialize>(answers: &T) -> Result<String> {
    use sha2::{Digest, Sha256};
    let json = serde_json::to_string(answers).context("serializing the answers")?;
    Ok(Sha256::digest(json.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
