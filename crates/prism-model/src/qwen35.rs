//! The Qwen3.5 dense text decoder: plain structs, weights loaded by GGUF name.
//!
//! A batch of sequences of different lengths is packed into one `[N_total, d]` activation (no padding)
//! for the embedding, norms, projections and MLP; the conv + delta rule and the attention run per
//! sequence segment against that sequence's [`SequenceState`].

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use prism_gguf::GgufFile;

use crate::attention::Attention;
use crate::config::{hf_text_config, read_hf_config, LayerKind, Qwen35Config};
use crate::delta_net::DeltaNet;
use crate::error::{ModelError, Result};
use crate::kv_fp8::KvStorage;
use crate::linear::{FusedLinear, Linear, ProjInput};
use crate::ops::{add_rms_norm, rms_norm_as};
use crate::profile;
use crate::rope::{MRope, Position3};
use crate::state::{LayerState, SequenceState};
use crate::tensor_parallel::{device_range, AllReduce};
use crate::weights::{Precision, WeightLoader};

/// The rows of the packed activation that belong to one sequence.
// A sequence's rows in the packed activation; the delta rule's `RuleSegment` has the same fields but
// `past` (it knows no positions) and stays its own type, as each module's calls take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First row in the packed `[N, d]` activation.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Tokens the sequence had processed before this call.
    pub past: usize,
    /// `Some(p)`: this sequence branches from segment `p` of the same batch (an earlier one) and starts,
    /// in every layer, from `p`'s state right after `p`'s rows ([`BatchItem::parent`]).
    pub parent: Option<usize>,
    /// `Some(p)`: the state after the segment's first `p` rows is wanted too ([`BatchItem::snapshot`]).
    pub snapshot: Option<usize>,
}

/// How to load a model.
// A field list: alike in shape only to other structs' plain fields.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub precision: Precision,
    /// The Hugging Face `config.json` to cross-check the GGUF metadata against.
    pub hf_config: Option<PathBuf>,
    /// Told after each decoder layer is loaded (for a progress display).
    pub progress: Option<LoadProgress>,
    /// How many threads load decoder layers at once (`None`: [`DEFAULT_MAX_LOAD_THREADS`] or the
    /// machine's parallelism, whichever is smaller; `Some(1)`: one after another on the calling thread;
    /// `Some(0)` is refused). On a GPU one loader thread at a time does device work, whatever the count
    /// (`weights::DEVICE_WORK`).
    pub load_threads: Option<usize>,
    /// How the attention layers store keys and values: [`KvStorage::Native`] (the default) or
    /// [`KvStorage::Fp8`] (e4m3 with a scale per token and KV head, [`crate::kv_fp8`]; the load is
    /// refused on a CUDA GPU below compute capability 8.9).
    pub kv_storage: KvStorage,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            precision: Precision::F32,
            hf_config: None,
            progress: None,
            load_threads: None,
            kv_storage: KvStorage::Native,
        }
    }
}

impl LoadOptions {
    /// The number of threads the load uses for the decoder layers ([`LoadOptions::load_threads`]).
    pub fn load_threads(&self) -> Result<usize> {
        match self.load_threads {
            None => Ok(std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(DEFAULT_MAX_LOAD_THREADS)),
            Some(0) => Err(ModelError::InvalidConfig {
                field: "load_threads".into(),
                reason: "0 is not a positive number of threads".into(),
            }),
            Some(n) => Ok(n),
        }
    }
}

/// A load's progress callback: called with (decoder layers loaded, layers in all) after each layer,
/// from whichever loader thread finished it.
#[derive(Clone)]
pub struct LoadProgress(pub std::sync::Arc<dyn Fn(usize, usize) + Send + Sync>);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress(..)")
    }
}

/// SwiGLU feed-forward block.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `ffn_gate` | `ffn_up` ([`Mlp::GATE`], [`Mlp::UP`]): `[2·ffn, d]`, gate rows first, one GEMM.
    pub gate_up: FusedLinear,
    /// `ffn_down`: `[d, ffn]`.
    pub down: Linear,
    ffn: usize,
}

impl Mlp {
    /// Part indices of [`Mlp::gate_up`].
    pub const GATE: usize = 0;
    pub const UP: usize = 1;

    fn load(w: &WeightLoader<'_>, cfg: &Qwen35Config, layer: usize) -> Result<Self> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (gate, up) = (
            format!("blk.{layer}.ffn_gate.weight"),
            format!("blk.{layer}.ffn_up.weight"),
        );
        Ok(Self {
            gate_up: w.fused_linear(&[(&gate, f), (&up, f)], d)?,
            down: w.linear(&format!("blk.{layer}.ffn_down.weight"), d, f)?,
            ffn: f,
        })
    }

    /// The block on `input` (normed rows, or a pending norm: see [`ProjInput`]); returns its output and
    /// the sum a pending norm of `x + residual` formed.
    pub fn forward(&self, input: &ProjInput<'_>) -> Result<(Tensor, Option<Tensor>)> {
        let (gate_up, sum) = self.gate_up.forward_input(input)?;
        let gate_up = gate_up.parts(Self::GATE..Self::UP + 1)?;
        // SwiGLU written in the form ffn_down reads: bf16 for a bf16 GEMM on CUDA, int8 on the integer
        // path on CUDA.
        Ok((self.down.forward_swiglu(&gate_up, self.ffn)?, sum))
    }

    /// The dtype [`Mlp::forward`] wants its input in when the activations are `act`.
    pub fn input_dtype(&self, act: DType) -> DType {
        self.gate_up.input_dtype(act)
    }

    /// Device `device` of `devices`' share ([`crate::tensor_parallel`]): its intermediate channels'
    /// rows of gate | up and their columns of `ffn_down`, reduced by `reduce`.
    pub fn shard(&self, device: usize, devices: usize, reduce: Arc<dyn AllReduce>) -> Result<Self> {
        let mine = device_range(self.ffn, device, devices);
        crate::tensor_parallel::check_share_columns("ffn_down", self.ffn, &mine, device, devices)?;
        let rows: Vec<u32> = mine.clone().map(|c| c as u32).collect();
        Ok(Self {
            gate_up: self.gate_up.select_part_rows(&[rows.clone(), rows])?,
            down: self.down.share_of_device(device, devices, reduce)?,
            ffn: mine.len(),
        })
    }
}

/// A layer's token mixer.
#[derive(Debug, Clone)]
pub enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

impl Mixer {
    /// The dtype the mixer's input projections want the normed activation in (activations `act`).
    pub fn input_dtype(&self, act: DType) -> DType {
        match self {
            Mixer::DeltaNet(net) => net.in_proj.input_dtype(act),
            Mixer::Attention(attn) => attn.qkv.input_dtype(act),
        }
    }
}

/// One decoder layer: `u = h + Mixer(norm(h))`, `h' = u + MLP(norm(u))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// `attn_norm` (1 + w baked in).
    pub attn_norm: Tensor,
    /// `post_attention_norm`: the PRE-MLP norm (1 + w baked in).
    pub post_norm: Tensor,
    pub mixer: Mixer,
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// Layer `i`'s tensors, in the order a sequential load has always read them (so its first error is
    /// the same one).
    fn load(
        w: &WeightLoader<'_>,
        cfg: &Qwen35Config,
        i: usize,
        kind: LayerKind,
        kv: KvStorage,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let mixer = match kind {
            LayerKind::DeltaNet => Mixer::DeltaNet(DeltaNet::load(w, cfg, i)?),
            LayerKind::Attention => Mixer::Attention(Attention::load(w, cfg, i, kv)?),
        };
        Ok(Self {
            attn_norm: w.vector(&format!("blk.{i}.attn_norm.weight"), d)?,
            post_norm: w.vector(&format!("blk.{i}.post_attention_norm.weight"), d)?,
            mixer,
            mlp: Mlp::load(w, cfg, i)?,
        })
    }
}

/// Loader threads by default ([`LoadOptions::load_threads`]). Each holds one layer's host buffers at a
/// time, and the tensor conversions inside a layer already run on the loader threads' pool, so more
/// threads mostly buy overlap of one layer's single-threaded steps (shape checks, uploads, casts) with
/// another's work.
pub const DEFAULT_MAX_LOAD_THREADS: usize = 8;

/// The loader threads of a given count: built on first use, kept for the life of the process, shared
/// by loads that run at once.
///
/// No thread that did a load's device work exits while the process goes on: a thread's exit runs the
/// CUDA driver's per-thread clean-up, and that clean-up was seen to hang a load whose loader threads
/// were short-lived (the `model_bf16` hang; docs/optimization-log.md, 2026-12-05, fourth session).
fn loader_pool(threads: usize) -> Option<std::sync::Arc<rayon::ThreadPool>> {
    use std::sync::{Arc, Mutex};
    static POOLS: Mutex<Vec<Arc<rayon::ThreadPool>>> = Mutex::new(Vec::new());
    // Pools only get added, so one left by a panicking thread is still whole.
    let mut pools = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(pool) = pools.iter().find(|p| p.current_num_threads() == threads) {
        return Some(pool.clone());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|k| format!("prism-load-{k}"))
        .build()
        .ok()?;
    let pool = Arc::new(pool);
    pools.push(pool.clone());
    Some(pool)
}

/// `load(0)`, …, `load(n − 1)` on up to `threads` loader threads ([`loader_pool`]; one: the calling
/// thread), returned in index order. Each thread takes the next index from a shared counter, so
/// indices are started in order; after a failure no new index is started, and every index below the
/// failed one has already been started and runs to its end. The error returned is therefore the one
/// of the lowest failing index — the same one a loop over `0..n` would return — whatever the thread
/// count and timing. A panic inside `load(i)` becomes [`ModelError::LayerLoad`] for `i` instead of
/// taking the process down. Rayon work inside `load` (the tensor conversions) runs on the loader
/// threads' pool.
fn load_in_order<T: Send>(
    n: usize,
    threads: usize,
    load: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || {
        let mut done: Vec<(usize, Result<T>)> = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| load(i))).unwrap_or_else(|payload| {
                    Err(ModelError::LayerLoad {
                        layer: i,
                        reason: format!("the loader panicked: {}", panic_message(&*payload)),
                    })
                });
            if result.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            done.push((i, result));
        }
        done
    };

    let threads = threads.clamp(1, n.max(1));
    // A pool that cannot be built leaves the work to the calling thread.
    let finished = match (threads > 1).then(|| loader_pool(threads)).flatten() {
        // Every thread of the pool runs `work` once; the calling thread waits.
        Some(pool) => pool.broadcast(|_| work()),
        None => vec![work()],
    };
    let mut slots: Vec<Option<Result<T>>> = (0..n).map(|_| None).collect();
    for (i, result) in finished.into_iter().flatten() {
        if let Some(slot) = slots.get_mut(i) {
            *slot = Some(result);
        }
    }

    let mut loaded = Vec::with_capacity(n);
    for (i, slot) in slots.into_iter().enumerate() {
        match slot {
            Some(result) => loaded.push(result?),
            None => {
                return Err(ModelError::LayerLoad {
                    layer: i,
                    reason: "no loader thread reached it".into(),
                })
            }
        }
    }
    Ok(loaded)
}

/// The position of the text token after tokens at `positions` (one past their largest on any axis),
/// never before `start` (the sequence's next position before them); item `index` names the error.
fn position_after(positions: &[Position3], start: u32, index: usize) -> Result<u32> {
    let last = positions
        .iter()
        .flat_map(|p| p.iter().copied())
        .max()
        .unwrap_or(0);
    let next = last.checked_add(1).ok_or_else(|| {
        ModelError::InvalidInput(format!("prompt {index}: position overflows u32"))
    })?;
    Ok(next.max(start))
}

/// Layer `l`'s state of every sequence, of the kind `pick` accepts; an error saying the layer is not
/// `what` where a sequence holds another kind.
fn layer_states<'a, T>(
    work: &'a mut [SequenceState],
    l: usize,
    what: &str,
    pick: fn(&mut LayerState) -> Option<&mut T>,
) -> Result<Vec<&'a mut T>> {
    work.iter_mut()
        .map(|s| {
            s.layers
                .get_mut(l)
                .and_then(pick)
                .ok_or_else(|| ModelError::InvalidInput(format!("state layer {l} is not {what}")))
        })
        .collect()
}

/// The message of a panic payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// One sequence of a batch: its state (updated when the call succeeds) and its new tokens. `S`: the
/// state's type, one device's [`SequenceState`] or, for a model split over devices, the state on every
/// device ([`crate::tensor_parallel::TensorParallelState`]).
pub struct BatchItem<'a, S = SequenceState> {
    pub state: &'a mut S,
    pub tokens: &'a [u32],
    /// Explicit M-RoPE positions, one per token (for image blocks). `None`: text positions
    /// `(p, p, p)` continuing from the state's next position.
    pub positions: Option<&'a [Position3]>,
    /// `Some(p)`: this item continues item `p` of the same batch (`p` earlier in the batch) from the
    /// point where `p`'s tokens end — a branch off a shared prefix computed in the same pass. Its own
    /// `state` is ignored on input and holds the branch's state on output. In every layer the branch
    /// starts from `p`'s layer state right after `p`'s tokens, so the weights are read once for the
    /// prefix and all its branches, with the same bits as a prefill of `p` followed by a batch of
    /// branches.
    pub parent: Option<usize>,
    /// `false`: the caller needs this item's outputs but not its state after the call (a read-out
    /// branch). Its `state` is then left as it was, and each layer's new state for it is dropped as
    /// soon as the layer is done (its branches of the same call have taken theirs), instead of every
    /// layer's being held to the end of the call: on the demo model that was ~1.2 MB a branch
    /// (docs/optimization-log.md). Default `true`.
    pub keep_state: bool,
    /// Input embeddings that replace the token embeddings at some of this item's tokens (an image's
    /// merged patches at its pad tokens: [`crate::vision::image_embedding_rows`]). `None` (the
    /// default): every token is embedded by its id.
    pub embeddings: Option<EmbeddingRows<'a>>,
    /// `Some(p)` with `0 < p < tokens.len()`: also return the sequence's state after its first `p` new
    /// tokens ([`BatchOutput::snapshots`]), bit for bit the state that a call on those tokens alone
    /// leaves — an evidence's state for the prefix cache from one pass over evidence and question,
    /// without splitting the item in two. Only for an item without a parent. `None` (the default).
    pub snapshot: Option<usize>,
}

/// Rows of a batch item's input that take given embeddings instead of their tokens' (transformers'
/// `inputs_embeds.masked_scatter` of image features). Checked by the forward pass: `rows` strictly
/// increasing and inside the item's tokens, `values` of shape `[rows.len(), hidden]`; else
/// [`ModelError::EmbeddingRows`].
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingRows<'a> {
    /// Indices into the item's `tokens`.
    pub rows: &'a [usize],
    /// One embedding per row, any float dtype (cast to the activation dtype), on any device (copied to
    /// the model's).
    pub values: &'a Tensor,
}

impl<'a, S> BatchItem<'a, S> {
    pub fn new(state: &'a mut S, tokens: &'a [u32]) -> Self {
        Self {
            state,
            tokens,
            positions: None,
            parent: None,
            keep_state: true,
            embeddings: None,
            snapshot: None,
        }
    }
}

/// Result of a forward pass over a batch (`S`: the state's type, as [`BatchItem`]'s).
#[derive(Debug, Clone)]
pub struct BatchOutput<S = SequenceState> {
    /// Final-normed hidden states of every new token, packed `[N_total, d]` in batch order.
    pub hidden: Tensor,
    /// Each sequence's rows in `hidden`.
    pub segments: Vec<Segment>,
    /// Per item, its state at its [`BatchItem::snapshot`] point (`None` for an item without one).
    pub snapshots: Vec<Option<S>>,
}

impl<S> BatchOutput<S> {
    /// The hidden state at each sequence's last new token, `[B, d]`.
    pub fn last_hidden(&self) -> Result<Tensor> {
        let rows: Vec<u32> = self
            .segments
            .iter()
            .map(|s| (s.start + s.len - 1) as u32)
            .collect();
        let n = rows.len();
        let idx = Tensor::from_vec(rows, n, self.hidden.device())?;
        Ok(self.hidden.index_select(&idx, 0)?)
    }

    /// All new hidden states of sequence `i`, `[len_i, d]`.
    pub fn sequence_hidden(&self, i: usize) -> Result<Tensor> {
        let seg = self.segments.get(i).ok_or_else(|| {
            ModelError::InvalidInput(format!(
                "no sequence {i} in a batch of {}",
                self.segments.len()
            ))
        })?;
        Ok(self.hidden.narrow(0, seg.start, seg.len)?)
    }
}

/// The Qwen3.5 text decoder.
#[derive(Debug, Clone)]
pub struct Qwen35Model {
    config: Qwen35Config,
    device: Device,
    precision: Precision,
    /// How the attention layers store keys and values.
    kv_storage: KvStorage,
    /// `token_embd`: `[vocab, d]`.
    embed: Tensor,
    /// `output` (or `token_embd` when the embeddings are tied): `[vocab, d]`. On the integer path it
    /// is quantized like every projection; the embedding lookup stays the exact dequantized row.
    lm_head: Linear,
    tied_embeddings: bool,
    /// `output_norm` (1 + w baked in).
    final_norm: Tensor,
    layers: Vec<DecoderLayer>,
    rope: MRope,
    /// The fresh state [`Self::new_state`] hands out clones of (its zeros allocated once).
    fresh: SequenceState,
}

impl Qwen35Model {
    /// Opens a GGUF file and loads the model from it.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        Self::from_gguf(&gguf, options)
    }

    /// Loads every tensor of the main layers by name, checking each shape against the configuration.
    /// MTP (`nextn`) blocks are not loaded. The integer precisions ([`Precision::Int8`],
    /// [`Precision::W4a8`]) need nothing else: activations are quantized per row and run on each
    /// call, on the CPU and on CUDA alike.
    pub fn from_gguf(gguf: &GgufFile, options: &LoadOptions) -> Result<Self> {
        Self::from_gguf_with_q8_scales(gguf, options, prism_quant::Q8Scales::PerRun)
    }

    /// [`Self::from_gguf`] with the given Q8_0 scale granularity on the integer path (the product
    /// uses [`prism_quant::Q8Scales::PerRun`]; [`prism_quant::Q8Scales::PerRow`] is kept to measure
    /// against).
    pub fn from_gguf_with_q8_scales(
        gguf: &GgufFile,
        options: &LoadOptions,
        q8_scales: prism_quant::Q8Scales,
    ) -> Result<Self> {
        let w =
            WeightLoader::new(gguf, &options.device, options.precision).with_q8_scales(q8_scales);
        Self::from_loader(gguf, &w, options)
    }

    /// [`Self::from_gguf`] with every projection dense (at `options.precision`, which must be a float
    /// one) and its input rewritten by `transform` first ([`crate::linear::Linear::Simulated`]): for
    /// experiments that simulate activation formats.
    pub fn from_gguf_simulated(
        gguf: &GgufFile,
        options: &LoadOptions,
        transform: std::sync::Arc<crate::linear::InputTransform>,
    ) -> Result<Self> {
        Self::simulated(gguf, options, transform, false)
    }

    /// [`Self::from_gguf_simulated`] on the integer path's weights (Q8_0 re-blocked per run of 128,
    /// K-quants as stored) instead of the file's: an activation format simulated on the weights the
    /// integer path multiplies.
    // The parameters of `from_gguf_simulated` above: both are thin entry points into `simulated`.
    pub fn from_gguf_simulated_on_integer_weights(
        gguf: &GgufFile,
        options: &LoadOptions,
        transform: std::sync::Arc<crate::linear::InputTransform>,
    ) -> Result<Self> {
        Self::simulated(gguf, options, transform, true)
    }

    fn simulated(
        gguf: &GgufFile,
        options: &LoadOptions,
        transform: std::sync::Arc<crate::linear::InputTransform>,
        on_integer_weights: bool,
    ) -> Result<Self> {
        if options.precision.is_integer() {
            return Err(ModelError::InvalidInput(format!(
                "a simulation runs at a float precision, not {}",
                options.precision.as_str()
            )));
        }
        let mut w = WeightLoader::new(gguf, &options.device, options.precision)
            .with_input_transform(transform);
        if on_integer_weights {
            w = w.simulating_on_integer_weights();
        }
        Self::from_loader(gguf, &w, options)
    }

    /// Loads through `w`.
    pub(crate) fn from_loader(
        gguf: &GgufFile,
        w: &WeightLoader<'_>,
        options: &LoadOptions,
    ) -> Result<Self> {
        let config = Qwen35Config::from_gguf(gguf)?;
        let tied = !w.contains("output.weight");
        if let Some(path) = &options.hf_config {
            let json = read_hf_config(path)?;
            config.check_hf_config(&json)?;
            let text = hf_text_config(&json);
            if let Some(v) = text.get("tie_word_embeddings") {
                if v.as_bool() == Some(false) && tied {
                    return Err(ModelError::ConfigMismatch {
                        field: "tie_word_embeddings".into(),
                        gguf: "tied (no output.weight)".into(),
                        config_json: v.to_string(),
                    });
                }
            }
        }
        Self::from_weights(config, w, tied, options)
    }

    /// Builds the model from `w` (a GGUF file, or an HF checkpoint read through GGUF names and layouts):
    /// every tensor of the main layers by name, each shape checked against `config`.
    pub(crate) fn from_weights(
        config: Qwen35Config,
        w: &WeightLoader<'_>,
        tied: bool,
        options: &LoadOptions,
    ) -> Result<Self> {
        let d = config.hidden_size;
        let threads = options.load_threads()?;
        // Refused before any weight is read: a GPU that cannot hold fp8 keys and values.
        if options.kv_storage.is_fp8() {
            crate::kv_fp8::check_device(&options.device)?;
        }
        let started = std::time::Instant::now();
        let embed = w.matrix("token_embd.weight", config.vocab_size, d)?;
        let embed_s = started.elapsed().as_secs_f64();
        let lm_head = match (tied, w.linear_is_dense()) {
            // A dense tied head is the embedding matrix itself (no second copy).
            (true, true) => Linear::Dense(embed.clone()),
            (true, false) => w.linear("token_embd.weight", config.vocab_size, d)?,
            (false, _) => w.linear("output.weight", config.vocab_size, d)?,
        };
        let final_norm = w.vector("output_norm.weight", d)?;
        let head_s = started.elapsed().as_secs_f64() - embed_s;
        let total = config.layer_kinds.len();
        let loaded = AtomicUsize::new(0);
        let layers = load_in_order(total, threads, |i| {
            let kind = config
                .layer_kinds
                .get(i)
                .ok_or_else(|| ModelError::LayerLoad {
                    layer: i,
                    reason: "no such layer in the configuration".into(),
                })?;
            let layer = DecoderLayer::load(w, &config, i, *kind, options.kv_storage)?;
            if let Some(progress) = &options.progress {
                (progress.0)(loaded.fetch_add(1, Ordering::SeqCst) + 1, total);
            }
            Ok(layer)
        })?;
        let rope = MRope::new(
            config.rotary_dim,
            config.rope_theta,
            config.mrope_sections,
            options.precision.activation_dtype(),
            &options.device,
        )?;
        // The load's transient device buffers (parts stacked into fused projections, casts) go back to
        // the driver, so the memory the process holds is the model's.
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = &options.device {
            crate::cuda::release_cached_memory(dev)?;
        }
        // Where a load's time goes (a 27B Q8_0 file on the H200 machine, before the layers were loaded
        // in parallel: 22–25 s, of which the layers 18.5 s and the embedding 4.2 s).
        let total_s = started.elapsed().as_secs_f64();
        tracing::info!(
            layers = config.n_layers,
            hidden = d,
            vocab = config.vocab_size,
            tied,
            precision = ?options.precision,
            kv = options.kv_storage.as_str(),
            "loaded the decoder in {total_s:.2} s: embedding {embed_s:.2} s, output head {head_s:.2} s, \
             layers {:.2} s on {threads} threads",
            total_s - embed_s - head_s
        );
        let fresh = SequenceState::new(
            &config,
            options.precision.activation_dtype(),
            &options.device,
        )?;
        Ok(Self {
            config,
            device: options.device.clone(),
            precision: options.precision,
            kv_storage: options.kv_storage,
            embed,
            lm_head,
            tied_embeddings: tied,
            final_norm,
            layers,
            rope,
            fresh,
        })
    }

    pub fn config(&self) -> &Qwen35Config {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// How the attention layers store keys and values ([`LoadOptions::kv_storage`]).
    pub fn kv_storage(&self) -> KvStorage {
        self.kv_storage
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Whether the output head reuses the embedding matrix (no `output.weight` in the file).
    pub fn tied_embeddings(&self) -> bool {
        self.tied_embeddings
    }

    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// A fresh, empty sequence state: a clone of one made at load (no device work; its tensors are
    /// shared, never written in place).
    pub fn new_state(&self) -> Result<SequenceState> {
        Ok(self.fresh.clone())
    }

    /// Device `device` of `devices`' share of this model ([`crate::tensor_parallel::shard`], which
    /// checks the split first): its heads and channels of every layer, the rest whole.
    pub(crate) fn shard(
        &self,
        device: usize,
        devices: usize,
        reduce: Arc<dyn AllReduce>,
    ) -> Result<Self> {
        let cfg = &self.config;
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                Ok(DecoderLayer {
                    attn_norm: layer.attn_norm.clone(),
                    post_norm: layer.post_norm.clone(),
                    mixer: match &layer.mixer {
                        Mixer::DeltaNet(net) => {
                            Mixer::DeltaNet(net.shard(device, devices, reduce.clone())?)
                        }
                        Mixer::Attention(attn) => {
                            Mixer::Attention(attn.shard(device, devices, reduce.clone())?)
                        }
                    },
                    mlp: layer.mlp.shard(device, devices, reduce.clone())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let key_heads = crate::delta_net::device_key_heads(
            cfg.linear_key_heads,
            cfg.linear_value_heads,
            device,
            devices,
        )
        .len();
        let config = Qwen35Config {
            n_heads: cfg.n_heads / devices,
            n_kv_heads: cfg.n_kv_heads / devices,
            intermediate_size: cfg.intermediate_size / devices,
            linear_value_heads: cfg.linear_value_heads / devices,
            linear_key_heads: key_heads,
            ..cfg.clone()
        };
        let fresh = SequenceState::new(&config, self.precision.activation_dtype(), &self.device)?;
        Ok(Self {
            config,
            layers,
            fresh,
            ..self.clone()
        })
    }

    /// Runs the new tokens of every item through the decoder, updating each item's state. On error no
    /// state is modified.
    pub fn forward(&self, items: &mut [BatchItem<'_>]) -> Result<BatchOutput> {
        self.forward_impl(items, None)
    }

    /// [`Self::forward`], also returning the packed hidden state `[N, d]` after the embedding and after
    /// each layer (before the final norm): `1 + n_layers` tensors.
    pub fn forward_traced(
        &self,
        items: &mut [BatchItem<'_>],
    ) -> Result<(BatchOutput, Vec<Tensor>)> {
        let mut trace = Vec::with_capacity(self.layers.len() + 1);
        let out = self.forward_impl(items, Some(&mut trace))?;
        Ok((out, trace))
    }

    fn forward_impl(
        &self,
        items: &mut [BatchItem<'_>],
        mut trace: Option<&mut Vec<Tensor>>,
    ) -> Result<BatchOutput> {
        if items.is_empty() {
            return Err(ModelError::InvalidInput("empty batch".into()));
        }
        let vocab = self.config.vocab_size;
        let mut segments = Vec::with_capacity(items.len());
        let mut ids: Vec<u32> = Vec::new();
        let mut positions: Vec<Position3> = Vec::new();
        let mut next_positions = Vec::with_capacity(items.len());
        // Per item, the next position of its snapshot state (`None`: no snapshot).
        let mut snapshot_positions: Vec<Option<u32>> = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            if item.tokens.is_empty() {
                return Err(ModelError::EmptyPrompt { index });
            }
            // A branch's starting point: its parent's state after the parent's tokens of this call.
            let (start_tokens, start_position) = match item.parent {
                Some(p) if p < index => {
                    let seg: &Segment = &segments[p];
                    (seg.past + seg.len, next_positions[p])
                }
                Some(p) => {
                    return Err(ModelError::InvalidInput(format!(
                    "batch item {index} branches from item {p}, which is not earlier in the batch"
                )))
                }
                None => {
                    self.check_state(item.state, index)?;
                    (item.state.n_tokens, item.state.next_position)
                }
            };
            if let Some((position, &token)) = item
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= vocab)
            {
                return Err(ModelError::TokenOutOfRange {
                    index,
                    position,
                    token,
                    vocab_size: vocab,
                });
            }
            let t_len = item.tokens.len();
            let first = positions.len();
            match item.positions {
                Some(p) if p.len() != t_len => {
                    return Err(ModelError::InvalidInput(format!(
                        "prompt {index}: {} positions for {t_len} tokens",
                        p.len()
                    )))
                }
                Some(p) => positions.extend_from_slice(p),
                None => {
                    let p0 = start_position;
                    for j in 0..t_len {
                        let p = u32::try_from(j)
                            .ok()
                            .and_then(|j| p0.checked_add(j))
                            .ok_or_else(|| {
                                ModelError::InvalidInput(format!(
                                    "prompt {index}: position overflows u32"
                                ))
                            })?;
                        positions.push([p; 3]);
                    }
                }
            }
            next_positions.push(position_after(&positions[first..], start_position, index)?);
            if let Some(p) = item.snapshot {
                if p == 0 || p >= t_len || item.parent.is_some() {
                    return Err(ModelError::InvalidInput(format!(
                        "prompt {index}: a snapshot after {p} of {t_len} tokens{} (it must fall \
                         inside an item without a parent)",
                        if item.parent.is_some() {
                            " of a branch"
                        } else {
                            ""
                        }
                    )));
                }
                snapshot_positions.push(Some(position_after(
                    &positions[first..first + p],
                    start_position,
                    index,
                )?));
            } else {
                snapshot_positions.push(None);
            }
            segments.push(Segment {
                start: ids.len(),
                len: t_len,
                past: start_tokens,
                parent: item.parent,
                snapshot: item.snapshot,
            });
            ids.extend_from_slice(item.tokens);
            if let Some(e) = &item.embeddings {
                self.check_embedding_rows(e, t_len, index)?;
            }
        }

        let whole = profile::Section::start("forward (whole pass)", &self.device)?;
        // Work on cheap clones; commit only when everything succeeded.
        let mut work: Vec<SequenceState> = items.iter().map(|it| it.state.clone()).collect();
        // Snapshot states, filled layer by layer (their layers start as the item's own).
        let mut snapshots: Vec<Option<SequenceState>> = items
            .iter()
            .zip(&snapshot_positions)
            .zip(&segments)
            .map(|((item, next), seg)| {
                next.map(|next_position| {
                    let mut state = item.state.clone();
                    state.n_tokens = seg.past + seg.snapshot.unwrap_or(0);
                    state.next_position = next_position;
                    state
                })
            })
            .collect();
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, &self.device)?;
        let mut x = self
            .embed
            .index_select(&ids, 0)?
            .to_dtype(self.precision.activation_dtype())?;
        if items.iter().any(|it| it.embeddings.is_some()) {
            x = self.replace_embeddings(x, items, &segments)?;
        }
        if let Some(t) = trace.as_deref_mut() {
            t.push(x.clone());
        }
        let (cos, sin) = self.rope.cos_sin(&positions)?;
        let eps = self.config.rms_norm_eps;
        let dev = &self.device;
        let act = x.dtype();
        // The residual stream is `x + residual`, `residual` the last block's output not yet added: the
        // next projection forms that sum and its norm (`ProjInput::Norm`), on the integer path on CUDA
        // inside its activation quantizer, elsewhere with the fused add + norm kernel first.
        let mut residual: Option<Tensor> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let input = ProjInput::Norm {
                x: &x,
                residual: residual.as_ref(),
                weight: &layer.attn_norm,
                eps,
            };
            let (mixed, sum) = match &layer.mixer {
                Mixer::DeltaNet(net) => {
                    let mut states = layer_states(&mut work, l, "a DeltaNet state", |s| match s {
                        LayerState::DeltaNet(d) => Some(d),
                        _ => None,
                    })?;
                    let (mixed, layer_snapshots, sum) =
                        profile::time("deltanet layer", dev, || {
                            net.forward(&input, &segments, &mut states)
                        })?;
                    for (snapshot, layer) in snapshots.iter_mut().zip(layer_snapshots) {
                        if let (Some(state), Some(layer)) = (snapshot.as_mut(), layer) {
                            state.layers[l] = LayerState::DeltaNet(layer);
                        }
                    }
                    (mixed, sum)
                }
                Mixer::Attention(attn) => {
                    let mut caches =
                        layer_states(&mut work, l, "an attention cache", |s| match s {
                            LayerState::Attention(c) => Some(c),
                            _ => None,
                        })?;
                    let (mixed, sum) = profile::time("attention layer", dev, || {
                        attn.forward(&input, &self.rope, &cos, &sin, &segments, &mut caches)
                    })?;
                    for ((snapshot, cache), seg) in snapshots.iter_mut().zip(&caches).zip(&segments)
                    {
                        if let (Some(state), Some(p)) = (snapshot.as_mut(), seg.snapshot) {
                            state.layers[l] = LayerState::Attention(cache.prefix(seg.past + p)?);
                        }
                    }
                    (mixed, sum)
                }
            };
            // The residual stream after the previous layer, formed by this layer's first projection.
            if let Some(sum) = sum {
                x = sum;
                if let Some(t) = trace.as_deref_mut() {
                    t.push(x.clone());
                }
            }
            // The layer's new state of an item whose state is not wanted: no one reads it again
            // (branches of it took theirs inside the layer), so it goes now, not at the end.
            for (slot, item) in work.iter_mut().zip(items.iter()) {
                if !item.keep_state {
                    if let (Some(new), Some(old)) =
                        (slot.layers.get_mut(l), item.state.layers.get(l))
                    {
                        *new = old.clone();
                    }
                }
            }
            let (mlp_out, u) = profile::time("mlp", dev, || {
                layer.mlp.forward(&ProjInput::Norm {
                    x: &x,
                    residual: Some(&mixed),
                    weight: &layer.post_norm,
                    eps,
                })
            })?;
            x = u.ok_or_else(|| {
                ModelError::InvalidInput(format!(
                    "layer {l}: the MLP's norm formed no residual sum"
                ))
            })?;
            residual = Some(mlp_out);
        }
        // The final norm of the last residual stream (and that stream, after the last layer).
        let hidden = profile::time("norm", dev, || -> Result<Tensor> {
            match &residual {
                Some(r) => {
                    let (sum, h) = add_rms_norm(&x, r, &self.final_norm, eps, act)?;
                    if let Some(t) = trace {
                        t.push(sum);
                    }
                    Ok(h)
                }
                None => Ok(rms_norm_as(&x, &self.final_norm, eps, act)?),
            }
        })?;
        whole.stop()?;

        for (((item, mut state), seg), next) in items
            .iter_mut()
            .zip(work)
            .zip(&segments)
            .zip(next_positions)
        {
            if !item.keep_state {
                continue;
            }
            state.n_tokens = seg.past + seg.len;
            state.next_position = next;
            *item.state = state;
        }
        Ok(BatchOutput {
            hidden,
            segments,
            snapshots,
        })
    }

    /// Item `index`'s embedding rows against its `t_len` tokens and the model's width.
    fn check_embedding_rows(
        &self,
        e: &EmbeddingRows<'_>,
        t_len: usize,
        index: usize,
    ) -> Result<()> {
        let bad = |reason: String| ModelError::EmbeddingRows { index, reason };
        if let Some(w) = e.rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(bad(format!(
                "rows must be strictly increasing; {} is followed by {}",
                w[0], w[1]
            )));
        }
        if let Some(&last) = e.rows.last().filter(|&&r| r >= t_len) {
            return Err(bad(format!("row {last} is past the item's {t_len} tokens")));
        }
        let want = [e.rows.len(), self.config.hidden_size];
        if e.values.dims() != want {
            return Err(bad(format!(
                "values have shape {:?}, {} rows need {want:?}",
                e.values.dims(),
                e.rows.len()
            )));
        }
        if !e.values.dtype().is_float() {
            return Err(bad(format!(
                "values are {:?}, not floats",
                e.values.dtype()
            )));
        }
        Ok(())
    }

    /// The packed token embeddings `x` (`[N, d]`) with the items' checked embedding rows put in their
    /// place: one gather from the token embeddings followed by every item's values.
    fn replace_embeddings(
        &self,
        x: Tensor,
        items: &[BatchItem<'_>],
        segments: &[Segment],
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let too_many = || ModelError::InvalidInput("too many embedding rows in one batch".into());
        let mut source: Vec<u32> = (0..n)
            .map(|i| u32::try_from(i).map_err(|_| too_many()))
            .collect::<Result<_>>()?;
        let mut parts = vec![x];
        let mut next = n;
        for (item, seg) in items.iter().zip(segments) {
            let Some(e) = &item.embeddings else { continue };
            for (k, &row) in e.rows.iter().enumerate() {
                source[seg.start + row] = u32::try_from(next + k).map_err(|_| too_many())?;
            }
            next += e.rows.len();
            parts.push(
                e.values
                    .to_device(&self.device)?
                    .to_dtype(self.precision.activation_dtype())?,
            );
        }
        let source = Tensor::from_vec(source, n, &self.device)?;
        Ok(Tensor::cat(&parts, 0)?.index_select(&source, 0)?)
    }

    fn check_state(&self, state: &SequenceState, index: usize) -> Result<()> {
        let ok = state.layers.len() == self.config.n_layers
            && state
                .layers
                .iter()
                .zip(&self.config.layer_kinds)
                .all(|(s, k)| {
                    matches!(
                        (s, k),
                        (LayerState::DeltaNet(_), LayerKind::DeltaNet)
                            | (LayerState::Attention(_), LayerKind::Attention)
                    )
                });
        if ok {
            Ok(())
        } else {
            Err(ModelError::InvalidInput(format!(
                "prompt {index}: the state was made for a different model"
            )))
        }
    }

    /// Full logits `[rows, vocab]` for final-normed hidden states `[rows, d]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?)
    }

    /// `Err(RowOutOfRange)` naming the first of `row_ids` past the vocabulary.
    fn check_rows(&self, row_ids: &[u32]) -> Result<()> {
        match row_ids
            .iter()
            .find(|&&r| r as usize >= self.config.vocab_size)
        {
            Some(&row) => Err(ModelError::RowOutOfRange {
                row,
                vocab_size: self.config.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Logits of the selected vocabulary rows only, `[rows, row_ids.len()]` (e.g. the 26 letters of a
    /// read-out instead of the whole vocabulary).
    pub fn logits_for_rows(&self, hidden: &Tensor, row_ids: &[u32]) -> Result<Tensor> {
        self.check_rows(row_ids)?;
        Ok(self.lm_head.select_rows(row_ids)?.forward(hidden)?)
    }

    /// Feeds `tokens` through `state` (prefill, a later piece of a prompt, or one decode step) and returns
    /// the final-normed hidden state of the last token, `[1, d]`.
    pub fn prefill(&self, state: &mut SequenceState, tokens: &[u32]) -> Result<Tensor> {
        let out = self.forward(&mut [BatchItem::new(state, tokens)])?;
        out.last_hidden()
    }

    /// Runs independent prompts as one batch from fresh states; the last hidden state of each, `[B, d]`.
    pub fn last_hidden(&self, prompts: &[&[u32]]) -> Result<Tensor> {
        let mut states = prompts
            .iter()
            .map(|_| self.new_state())
            .collect::<Result<Vec<_>>>()?;
        let mut items: Vec<BatchItem<'_>> = states
            .iter_mut()
            .zip(prompts)
            .map(|(s, p)| BatchItem::new(s, p))
            .collect();
        self.forward(&mut items)?.last_hidden()
    }

    /// Computes `prefix` once, then continues each suffix from a copy of its state (one batch); the last
    /// hidden state of `prefix ++ suffix_i` for each suffix, `[B, d]`. An empty suffix yields the prefix's
    /// own last hidden state.
    pub fn forward_branched(&self, prefix: &[u32], suffixes: &[&[u32]]) -> Result<Tensor> {
        if suffixes.is_empty() {
            return Err(ModelError::InvalidInput("no suffixes".into()));
        }
        if prefix.is_empty() {
            if let Some(index) = suffixes.iter().position(|s| s.is_empty()) {
                return Err(ModelError::EmptyPrompt { index });
            }
            return self.last_hidden(suffixes);
        }
        // One pass: the prefix is item 0 and every non-empty suffix branches from it, so each layer's
        // weights are read once for all of them.
        // Branch states are only placeholders (each layer starts from the parent's state), so they share
        // one fresh state's tensors instead of allocating and zeroing a full state per suffix.
        let fresh = self.new_state()?;
        let mut states = vec![fresh; suffixes.len() + 1];
        let (prefix_state, branch_states) = states.split_at_mut(1);
        let mut items = vec![BatchItem::new(&mut prefix_state[0], prefix)];
        for (st, s) in branch_states.iter_mut().zip(suffixes) {
            if !s.is_empty() {
                let mut item = BatchItem::new(st, s);
                item.parent = Some(0);
                items.push(item);
            }
        }
        let last = self.forward(&mut items)?.last_hidden()?;
        let mut rows = Vec::with_capacity(suffixes.len());
        let mut next_suffix_row = 1;
        for s in suffixes {
            if s.is_empty() {
                rows.push(last.narrow(0, 0, 1)?);
            } else {
                rows.push(last.narrow(0, next_suffix_row, 1)?);
                next_suffix_row += 1;
            }
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// The last hidden state of each prompt, `[B, d]`, computing the prompts' common prefix once. The
    /// branch point may fall anywhere (the delta-rule state carries the chunk in progress), and the
    /// result is bit-identical to running each prompt alone.
    pub fn last_hidden_shared_prefix(&self, prompts: &[&[u32]]) -> Result<Tensor> {
        if let Some(index) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::EmptyPrompt { index });
        }
        let share = shared_prefix_len(prompts);
        if share == 0 {
            return self.last_hidden(prompts);
        }
        let suffixes: Vec<&[u32]> = prompts.iter().map(|p| &p[share..]).collect();
        self.forward_branched(&prompts[0][..share], &suffixes)
    }

    /// The read-out entry point: for prompts that may share a prefix, the logits of the selected
    /// vocabulary rows (e.g. the 26 letters) at each prompt's last position, `[B][rows]`. The shared
    /// prefix is computed once ([`Self::last_hidden_shared_prefix`]).
    pub fn last_position_rows(&self, prompts: &[&[u32]], row_ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_rows(row_ids)?;
        let hidden = self.last_hidden_shared_prefix(prompts)?;
        profile::time("head rows + read back", &self.device, || -> Result<_> {
            Ok(self
                .logits_for_rows(&hidden, row_ids)?
                .to_dtype(DType::F32)?
                .to_vec2()?)
        })
    }

    /// Greedy decoding: prefill `prompt`, then feed back the argmax one token at a time. Stops after
    /// `max_new_tokens` or after emitting a token of `stop_tokens` (which is included).
    pub fn generate_greedy(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        stop_tokens: &[u32],
    ) -> Result<Vec<u32>> {
        let mut state = self.new_state()?;
        let mut out = Vec::with_capacity(max_new_tokens);
        if max_new_tokens == 0 {
            return Ok(out);
        }
        let mut hidden = self.prefill(&mut state, prompt)?;
        loop {
            let next = argmax(&self.logits(&hidden)?)?;
            out.push(next);
            if out.len() >= max_new_tokens || stop_tokens.contains(&next) {
                return Ok(out);
            }
            hidden = self.prefill(&mut state, &[next])?;
        }
    }
}

/// Length of the prefix shared by all prompts, capped so that every prompt keeps at least one token of
/// its own. 0 for fewer than two prompts. (Branching needs no alignment: any branch point gives the same
/// bits as one-by-one runs.)
pub fn shared_prefix_len(prompts: &[&[u32]]) -> usize {
    let (first, rest) = match prompts.split_first() {
        Some(split) if prompts.len() >= 2 => split,
        _ => return 0,
    };
    let mut common = first.len();
    for p in rest {
        common = common.min(
            first
                .iter()
                .zip(p.iter())
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    let shortest = prompts.iter().map(|p| p.len()).min().unwrap_or(0);
    common.min(shortest.saturating_sub(1))
}

/// Index of the largest logit of a `[1, vocab]` or `[vocab]` tensor (the first one on ties).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    let values = logits
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            return Err(ModelError::InvalidInput(format!("logit {i} is NaN")));
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    let (i, _) = best.ok_or_else(|| ModelError::InvalidInput("empty logits".into()))?;
    u32::try_from(i).map_err(|_| ModelError::InvalidInput("vocabulary larger than u32".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_and_state_can_be_shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Qwen35Model>();
        send_sync::<SequenceState>();
        send_sync::<BatchOutput>();
    }

    /// What a plain loop over `0..n` returns: the reference [`load_in_order`] must equal.
    fn sequential<T>(n: usize, load: impl Fn(usize) -> Result<T>) -> Result<Vec<T>> {
        (0..n).map(load).collect()
    }

    fn describe<T: std::fmt::Debug>(r: &Result<Vec<T>>) -> String {
        match r {
            Ok(v) => format!("Ok({v:?})"),
            Err(e) => format!("Err({e})"),
        }
    }

    #[test]
    fn layers_load_in_index_order_on_any_thread_count() {
        // Uneven work so that later indices often finish first.
        let load = |i: usize| {
            std::thread::sleep(std::time::Duration::from_micros(
                ((i * 7919) % 5) as u64 * 200,
            ));
            Ok(i * 10)
        };
        let expected: Vec<usize> = (0..23).map(|i| i * 10).collect();
        for threads in [1, 2, 3, 8, 64] {
            assert_eq!(
                load_in_order(23, threads, load).unwrap(),
                expected,
                "{threads} threads"
            );
        }
        assert!(load_in_order(0, 4, load).unwrap().is_empty());
    }

    #[test]
    fn the_first_failing_layer_in_index_order_is_reported() {
        // Layers 3 and 9 fail; 9 fails at once while 3 takes long, so a parallel load usually sees
        // 9's error first in time. Both are MissingTensor errors naming their layer.
        let load = |i: usize| -> Result<usize> {
            match i {
                3 => {
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    Err(ModelError::MissingTensor {
                        name: format!("blk.{i}.attn_norm.weight"),
                    })
                }
                9 => Err(ModelError::MissingTensor {
                    name: format!("blk.{i}.ffn_up.weight"),
                }),
                _ => Ok(i),
            }
        };
        let reference = describe(&sequential(16, load));
        assert!(reference.contains("blk.3.attn_norm.weight"), "{reference}");
        for threads in [1, 2, 4, 8, 16] {
            for _ in 0..5 {
                assert_eq!(describe(&load_in_order(16, threads, load)), reference);
            }
        }
    }

    #[test]
    fn loads_run_on_loader_threads_that_outlive_them() {
        // The same few threads serve every load of a thread count (none of them exits, so none runs
        // the CUDA driver's thread-exit clean-up), and a load of one runs on the calling thread.
        let caller = std::thread::current().id();
        let seen = std::sync::Mutex::new(std::collections::HashSet::new());
        let load = |i: usize| -> Result<usize> {
            let name = std::thread::current().name().map(str::to_string);
            assert!(
                name.as_deref()
                    .is_some_and(|n| n.starts_with("prism-load-")),
                "{name:?}"
            );
            seen.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(i)
        };
        for _ in 0..3 {
            assert_eq!(
                load_in_order(24, 3, load).unwrap(),
                (0..24).collect::<Vec<_>>()
            );
        }
        let seen = seen.into_inner().unwrap();
        assert!((2..=3).contains(&seen.len()), "{} threads", seen.len());
        assert!(!seen.contains(&caller));
        let on_caller = |i: usize| -> Result<usize> {
            assert_eq!(std::thread::current().id(), caller);
            Ok(i)
        };
        assert_eq!(load_in_order(5, 1, on_caller).unwrap(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_failure_stops_the_remaining_layers() {
        let started = AtomicUsize::new(0);
        let load = |i: usize| -> Result<usize> {
            started.fetch_add(1, Ordering::Relaxed);
            if i == 2 {
                return Err(ModelError::InvalidInput(format!("layer {i}")));
            }
            Ok(i)
        };
        assert!(load_in_order(100, 1, load).is_err());
        // One thread: layers 0, 1 and the failing 2, nothing after.
        assert_eq!(started.swap(0, Ordering::Relaxed), 3);
        assert!(load_in_order(100, 4, load).is_err());
        // Each of the 4 threads finishes at most the layer it holds when 2 fails.
        let with_four = started.load(Ordering::Relaxed);
        assert!(
            (3..=3 + 4).contains(&with_four),
            "{with_four} layers started"
        );
    }

    #[test]
    fn a_panicking_layer_becomes_an_error_naming_it() {
        let load = |i: usize| -> Result<usize> {
            if i == 5 {
                panic!("unpacking blk.{i} went wrong");
            }
            Ok(i)
        };
        for threads in [1, 3, 8] {
            match load_in_order(12, threads, load) {
                Err(ModelError::LayerLoad { layer, reason }) => {
                    assert_eq!(layer, 5);
                    assert!(reason.contains("unpacking blk.5 went wrong"), "{reason}");
                }
                other => panic!("{threads} threads: {}", describe(&other)),
            }
        }
    }

    #[test]
    fn shared_prefix_length_is_the_common_prefix_capped() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b[150] = 9999;
        assert_eq!(shared_prefix_len(&[&a, &b]), 150);
        assert_eq!(shared_prefix_len(&[&a]), 0);
        // Identical prompts: each keeps at least its last token.
        assert_eq!(shared_prefix_len(&[&a, &a]), 199);
        assert_eq!(shared_prefix_len(&[&a[..64], &a]), 63);
        assert_eq!(shared_prefix_len(&[&b, &a[..1], &a]), 0);
    }
}
