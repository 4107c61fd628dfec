//! The serving engine: one step loop owns the model and answers many requests at once.
//!
//! - [`Engine`] — the handle a service holds (clone it freely): [`Engine::prepare`] renders and
//!   tokenizes a request on the caller's thread, [`Engine::submit`] queues it (bounded: a full queue is
//!   refused at once), [`Engine::decide`] does both and waits. The loop stops when the last handle is
//!   dropped, after answering what it holds.
//! - [`step`] — the step loop: each step packs the ready prompts of *all* requests in flight into one
//!   forward pass, first come first served, up to a token budget; each request's questions branch
//!   from their evidence, which is computed once (and in chunks when long); requests with the same
//!   evidence share it; a request whose client went away or whose deadline passed stops at the next
//!   step.
//! - [`prefix_cache`] — evidence states kept across requests, LRU within a token and a byte budget.
//! - [`pass`] — the [`PassModel`] trait a model implements to run passes; [`decoder`] — the Qwen3.5
//!   decoder behind it.
//!
//! On the exact paths (the CPU, and the integer path on a GPU) a request's answer is bit-identical
//! whatever else runs in its pass and whether its evidence came from the cache: every branch's logits
//! depend only on its own tokens ([`PassModel`]'s promise), and the decision procedure
//! ([`crate::decide::DecisionTask`]) depends only on those logits.

pub mod decoder;
pub mod pass;
pub mod prefix_cache;
pub mod step;
pub mod thinking;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use decoder::{DecoderLetterModel, EngineError, LoadedDecisionModel, ModelSource};
pub use pass::{
    Branch, GroupInput, GroupOutput, NextLogits, PassModel, PrefixImages, PromptEncoder,
    RequestImages, ThoughtMarkers,
};
pub use prefix_cache::{PrefixCache, PrefixCacheLimits, PrefixCacheStats};

use crate::config::DecisionConfig;
use crate::decide::DecisionTask;
use crate::error::{DecisionError, FieldError, FieldPath, ModelError};
use crate::image_input::{decode_images, DecodedImage, ImageLimits};
use crate::model::LetterPrompt;
use crate::render::evidence_probe;
use crate::request::DecisionRequest;
use crate::response::DecisionResponse;

/// Device bytes one decoding thought holds, from a fresh sequence state's `state_bytes` (which
/// counts its chunk of pending delta-rule rows): four states' worth (its state, the next step's, the
/// memory pool's fragments). Measured for the 27B at int8: 64 thoughts held ~1.2 GB each on the
/// H200 (2026-12-02), and 16 thoughts at most ~1.14 GB each on an H100 (2026-12-06), where a fresh
/// state counts ~309 MB. `prism serve` sizes `--think-seqs` from it and `prism bench --think`
/// refuses a batch that cannot fit.
pub fn thought_device_bytes(state_bytes: u64) -> u64 {
    state_bytes.saturating_mul(4)
}

/// Settings of an engine (the server's flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Most tokens computed in one forward pass (`--max-batch-tokens`). A request's evidence longer
    /// than this is computed in chunks over several passes; a single question longer than this still
    /// runs, alone.
    pub max_batch_tokens: usize,
    /// Most sequence states one forward pass makes (`--max-prompts-per-pass`): one per prompt read out
    /// and one per evidence (or evidence chunk) computed. Each is a whole state (a 27B model's is ~300
    /// MB on a GPU), so on a GPU this bounds a pass's memory; the server sizes it from the free device
    /// memory.
    pub max_prompts_per_pass: usize,
    /// Requests that may wait to be admitted (`--queue-size`); beyond, [`SubmitError::QueueFull`].
    pub queue_size: usize,
    /// Longest prompt accepted, in tokens (`--max-tokens`); longer ones are refused with a 422.
    pub max_prompt_tokens: usize,
    /// Most questions in one request (`--max-questions`); more are refused with a 422 naming
    /// `questions`, before anything is rendered.
    pub max_questions: usize,
    /// Most prompt tokens in one request, summed over its first-round prompts
    /// (`--max-request-tokens`); more are refused with a 422 naming `questions`.
    pub max_request_tokens: usize,
    /// The prefix cache's budgets (`--prefix-cache-tokens`, `--prefix-cache-bytes`).
    pub prefix_cache: PrefixCacheLimits,
    /// Most thoughts decoded at once (`--think-seqs`); each holds a sequence state until it is done.
    /// Further thoughts wait for a seat.
    pub think_seqs: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_batch_tokens: 8192,
            max_prompts_per_pass: 1024,
            queue_size: 64,
            max_prompt_tokens: 32768,
            max_questions: 128,
            max_request_tokens: 262_144,
            prefix_cache: PrefixCacheLimits {
                max_tokens: 65536,
                max_bytes: 2 << 30,
            },
            think_seqs: 64,
        }
    }
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: {capacity} requests are already waiting")]
    QueueFull { capacity: usize },
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Why a queued request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The decision procedure refused or the model failed.
    #[error(transparent)]
    Decision(#[from] DecisionError),
    /// The request's deadline passed before it was answered; its work stopped at the next step.
    #[error("the request was not answered before its deadline")]
    DeadlineExceeded,
    /// The submitter cancelled it (its client went away); its work stopped at the next step.
    #[error("the request was cancelled")]
    Cancelled,
}

/// A finished request.
#[derive(Debug)]
pub struct JobOutput {
    pub response: DecisionResponse,
    /// From submission to the first pass that computed any of it.
    pub queue_ms: f64,
    /// From that first pass to the answer.
    pub compute_ms: f64,
    /// Passes that computed some of it.
    pub passes: usize,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: u64,
}

pub type JobResult = Result<JobOutput, JobError>;

/// Cancels a submitted request: the engine drops it at its next step and answers
/// [`JobError::Cancelled`]. Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A request rendered and tokenized, ready to queue ([`Engine::prepare`]).
pub struct Prepared {
    task: DecisionTask,
    prompts: Vec<LetterPrompt>,
    tokens: Vec<Vec<u32>>,
    /// The evidence: the tokens every prompt of the request starts with, up to the question.
    key: Arc<[u32]>,
    /// What the prefix cache and the dispatcher know the evidence by: `key` for text; for evidence with
    /// images, `key`, then `u32::MAX` (no token's id), then the images' digest as 8 words.
    cache_key: Arc<[u32]>,
    /// The request's images, decoded, with their evidence positions (`None` for text).
    images: Option<Arc<RequestImages>>,
}

impl Prepared {
    /// Number of questions.
    pub fn questions(&self) -> usize {
        self.task.request().questions.len()
    }

    /// Tokens of the first-round prompts (what `usage.input_tokens` will count for them).
    pub fn prompt_tokens(&self) -> u64 {
        self.tokens.iter().map(|t| t.len() as u64).sum()
    }

    /// Tokens of the shared evidence prefix.
    pub fn evidence_tokens(&self) -> usize {
        self.key.len()
    }

    /// The request's decoded images (`None` for text).
    pub fn images(&self) -> Option<&RequestImages> {
        self.images.as_deref()
    }
}

/// What a reply goes to: called exactly once, from the engine's thread.
pub type Reply = Box<dyn FnOnce(JobResult) + Send>;

pub(crate) struct Job {
    pub(crate) prepared: Prepared,
    pub(crate) reply: Reply,
    pub(crate) deadline: Option<Instant>,
    pub(crate) cancel: CancelToken,
    pub(crate) enqueued: Instant,
}

/// One pass as the engine ran it, for observers (metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassRecord {
    /// The replica that ran the pass (0 with one).
    pub replica: usize,
    /// Distinct requests with prompts or evidence chunks in the pass.
    pub requests: usize,
    /// Prompts read out.
    pub prompts: usize,
    /// Evidence groups (shared prefixes) in the pass.
    pub groups: usize,
    /// Tokens computed (prefixes, chunks and branches).
    pub tokens: usize,
    /// Prefix-cache lookups of the pass that hit / missed.
    pub cache_hits: usize,
    pub cache_misses: usize,
    /// Thought steps (prefills, decode steps, closing read-outs) in the pass.
    pub thought_steps: usize,
}

/// Receives every pass (for metrics); called on the engine's thread, so keep it cheap.
pub trait EngineObserver: Send + Sync {
    fn pass(&self, record: &PassRecord, seconds: f64);
}

/// The engine's counters (`/stats`'s `engine` and `prefix_cache` objects).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EngineStats {
    pub passes: u64,
    pub prompts: u64,
    pub tokens_computed: u64,
    /// Passes by the number of requests they held.
    pub requests_per_pass: std::collections::BTreeMap<usize, u64>,
    /// Passes by the number of prompts they read out.
    pub prompts_per_pass: std::collections::BTreeMap<usize, u64>,
    pub max_requests_per_pass: usize,
    pub max_prompts_per_pass: usize,
    pub max_tokens_per_pass: usize,
    /// Evidence chunks computed without read-outs (long evidence split over passes).
    pub evidence_chunks: u64,
    pub answered: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub deadline_exceeded: u64,
    /// Passes that failed with several requests and were retried one request at a time.
    pub passes_split_after_error: u64,
    pub prefix_cache: PrefixCacheStats,
    pub prefix_cache_max_tokens: usize,
    pub prefix_cache_max_bytes: u64,
    pub max_batch_tokens: usize,
    /// The device's memory in use and in all after the last pass, and the most in use after any pass,
    /// in bytes (`None` on the CPU). The driver's count for the whole device: the memory pool keeps what
    /// a pass freed, so "in use" is close to the peak of the passes so far.
    pub device_memory: Option<DeviceMemory>,
    /// Thoughts whose prompt was read / that finished, and the tokens finished thoughts decoded.
    pub thoughts_started: u64,
    pub thoughts_finished: u64,
    pub thought_tokens: u64,
    /// Thought steps run (one per thought per pass it was in).
    pub thought_steps: u64,
    /// Most thoughts decoded at once (`--think-seqs`).
    pub think_seqs: usize,
    /// Images the vision tower has encoded, and its time on them in seconds (from before the tower to
    /// after the device finished it, per request): `vision_seconds / vision_images` is the time per image.
    pub vision_images: u64,
    pub vision_seconds: f64,
}

impl EngineStats {
    /// Adds `other`'s counts to these (the engine's total over replicas): counts and histograms sum,
    /// maxima take the larger, the prefix cache's budgets and the device memory add up (one cache and one
    /// device a replica; replicas sharing a device report it once each).
    pub fn merge(&mut self, other: &EngineStats) {
        // Every field named, so a new one cannot be forgotten here.
        let EngineStats {
            passes,
            prompts,
            tokens_computed,
            requests_per_pass,
            prompts_per_pass,
            max_requests_per_pass,
            max_prompts_per_pass,
            max_tokens_per_pass,
            evidence_chunks,
            answered,
            failed,
            cancelled,
            deadline_exceeded,
            passes_split_after_error,
            prefix_cache,
            prefix_cache_max_tokens,
            prefix_cache_max_bytes,
            max_batch_tokens,
            device_memory,
            thoughts_started,
            thoughts_finished,
            thought_tokens,
            thought_steps,
            think_seqs,
            vision_images,
            vision_seconds,
        } = other;
        self.vision_images += vision_images;
        self.vision_seconds += vision_seconds;
        self.think_seqs += think_seqs;
        self.thoughts_started += thoughts_started;
        self.thoughts_finished += thoughts_finished;
        self.thought_tokens += thought_tokens;
        self.thought_steps += thought_steps;
        self.passes += passes;
        self.prompts += prompts;
        self.tokens_computed += tokens_computed;
        for (k, v) in requests_per_pass {
            *self.requests_per_pass.entry(*k).or_default() += v;
        }
        for (k, v) in prompts_per_pass {
            *self.prompts_per_pass.entry(*k).or_default() += v;
        }
        self.max_requests_per_pass = self.max_requests_per_pass.max(*max_requests_per_pass);
        self.max_prompts_per_pass = self.max_prompts_per_pass.max(*max_prompts_per_pass);
        self.max_tokens_per_pass = self.max_tokens_per_pass.max(*max_tokens_per_pass);
        self.evidence_chunks += evidence_chunks;
        self.answered += answered;
        self.failed += failed;
        self.cancelled += cancelled;
        self.deadline_exceeded += deadline_exceeded;
        self.passes_split_after_error += passes_split_after_error;
        let PrefixCacheStats {
            hits,
            misses,
            cached_tokens,
            bytes,
            entries,
            evictions,
            tokens_saved,
            too_large,
        } = prefix_cache;
        let a = &mut self.prefix_cache;
        a.hits += hits;
        a.misses += misses;
        a.cached_tokens += cached_tokens;
        a.bytes += bytes;
        a.entries += entries;
        a.evictions += evictions;
        a.tokens_saved += tokens_saved;
        a.too_large += too_large;
        self.prefix_cache_max_tokens += prefix_cache_max_tokens;
        self.prefix_cache_max_bytes += prefix_cache_max_bytes;
        self.max_batch_tokens = self.max_batch_tokens.max(*max_batch_tokens);
        self.device_memory = match (self.device_memory, *device_memory) {
            (Some(a), Some(b)) => Some(DeviceMemory {
                used_bytes: a.used_bytes + b.used_bytes,
                total_bytes: a.total_bytes + b.total_bytes,
                max_used_bytes: a.max_used_bytes + b.max_used_bytes,
            }),
            (a, b) => a.or(b),
        };
    }
}

/// A GPU's memory as the engine saw it after its passes ([`EngineStats::device_memory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    pub used_bytes: u64,
    pub total_bytes: u64,
    pub max_used_bytes: u64,
}

/// Requests waiting and in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct QueueState {
    /// Submitted and not yet taken by the step loop.
    pub depth: usize,
    pub capacity: usize,
    /// Taken by the step loop and not yet answered.
    pub running: usize,
}

pub(crate) struct Shared {
    pub(crate) waiting: AtomicUsize,
    pub(crate) running: AtomicUsize,
    pub(crate) stats: Mutex<EngineStats>,
}

impl Shared {
    pub(crate) fn stats<R>(&self, f: impl FnOnce(&mut EngineStats) -> R) -> R {
        let mut guard = self
            .stats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut guard)
    }
}

/// One step loop and its model: a replica of the engine.
struct Replica {
    sender: SyncSender<Job>,
    shared: Arc<Shared>,
}

/// A handle on a running engine: one step loop per replica (one model each, e.g. one per GPU) behind
/// one queue interface. A request goes to the replica that last took its evidence (whose prefix cache
/// may hold it), otherwise to the least loaded one; every replica computes the same bits for a request,
/// so which one answers changes nothing in the answer.
#[derive(Clone)]
pub struct Engine {
    replicas: Arc<[Replica]>,
    /// Evidence hash → the replica that last took that evidence (bounded: cleared when full).
    affinity: Arc<Mutex<std::collections::HashMap<u64, usize>>>,
    encoder: Arc<dyn PromptEncoder>,
    config: Arc<DecisionConfig>,
    options: EngineOptions,
    model_name: Arc<str>,
    /// Bounds on request images ([`Engine::with_image_limits`]).
    image_limits: ImageLimits,
}

/// Most evidences the dispatcher remembers before it forgets them all.
const AFFINITY_ENTRIES: usize = 1 << 16;

/// The step loops' threads; [`EngineWorker::join`] waits for them once every [`Engine`] is dropped.
pub struct EngineWorker(Vec<JoinHandle<()>>);

impl EngineWorker {
    pub fn join(self) {
        for handle in self.0 {
            if handle.join().is_err() {
                tracing::error!("an engine step loop panicked outside a pass");
            }
        }
    }
}

impl Engine {
    /// Starts the step loop on its own thread, owning `model`.
    pub fn start<M: PassModel + 'static>(
        model: M,
        encoder: Arc<dyn PromptEncoder>,
        config: DecisionConfig,
        options: EngineOptions,
        observer: Option<Arc<dyn EngineObserver>>,
    ) -> Result<(Engine, EngineWorker), DecisionError> {
        Self::start_replicas(vec![model], encoder, config, options, observer)
    }

    /// Starts one step loop per model (replicas of one model, e.g. one per GPU), each on its own thread
    /// with its own queue of `options.queue_size`, passes and prefix cache. The models must be the same
    /// model (the answers do not depend on the replica; their names must agree).
    pub fn start_replicas<M: PassModel + 'static>(
        models: Vec<M>,
        encoder: Arc<dyn PromptEncoder>,
        config: DecisionConfig,
        options: EngineOptions,
        observer: Option<Arc<dyn EngineObserver>>,
    ) -> Result<(Engine, EngineWorker), DecisionError> {
        config.validate()?;
        // A release that thinks needs a chat template that can: refused here, not at the first
        // question below the gate.
        if config.family.thinks() && encoder.thought_markers().is_none() {
            return Err(DecisionError::Model(ModelError::Backend(format!(
                "decision_config.json says this is a {} model, which thinks, but its chat template has \
                 no thinking mode (or its tokenizer no </think>): thoughts cannot be decoded",
                config.family
            ))));
        }
        let Some(first) = models.first() else {
            return Err(DecisionError::Model(ModelError::Backend(
                "an engine needs at least one model".into(),
            )));
        };
        let model_name: Arc<str> = first.model_name().into();
        if let Some(other) = models.iter().find(|m| m.model_name() != &*model_name) {
            return Err(DecisionError::Model(ModelError::Backend(format!(
                "engine replicas must run one model: {:?} and {:?}",
                &*model_name,
                other.model_name()
            ))));
        }
        let options = EngineOptions {
            max_batch_tokens: options.max_batch_tokens.max(1),
            max_prompts_per_pass: options.max_prompts_per_pass.max(1),
            queue_size: options.queue_size.max(1),
            think_seqs: options.think_seqs.max(1),
            ..options
        };
        let mut replicas = Vec::with_capacity(models.len());
        let mut handles = Vec::with_capacity(models.len());
        let several = models.len() > 1;
        for (index, model) in models.into_iter().enumerate() {
            let (sender, receiver) = sync_channel(options.queue_size);
            let shared = Arc::new(Shared {
                waiting: AtomicUsize::new(0),
                running: AtomicUsize::new(0),
                stats: Mutex::new(EngineStats {
                    prefix_cache_max_tokens: options.prefix_cache.max_tokens,
                    prefix_cache_max_bytes: options.prefix_cache.max_bytes,
                    max_batch_tokens: options.max_batch_tokens,
                    think_seqs: options.think_seqs,
                    ..EngineStats::default()
                }),
            });
            let loop_shared = shared.clone();
            let loop_encoder = encoder.clone();
            let loop_observer = observer.clone();
            let loop_options = options;
            let handle = std::thread::Builder::new()
                // `prism-engine`, or `prism-engine-N` for replica N of several (Linux shows 15 bytes).
                .name(if several {
                    format!("prism-engine-{index}")
                } else {
                    "prism-engine".into()
                })
                .spawn(move || {
                    step::StepLoop::new(
                        model,
                        loop_encoder,
                        loop_options,
                        loop_shared,
                        loop_observer,
                        index,
                    )
                    .run(receiver)
                })
                .map_err(|e| {
                    DecisionError::Model(ModelError::Backend(format!(
                        "cannot start the engine's thread: {e}"
                    )))
                })?;
            replicas.push(Replica { sender, shared });
            handles.push(handle);
        }
        Ok((
            Engine {
                replicas: replicas.into(),
                affinity: Arc::default(),
                encoder,
                config: Arc::new(config),
                options,
                model_name,
                image_limits: ImageLimits::default(),
            },
            EngineWorker(handles),
        ))
    }

    /// Whether the model reads images (it has a vision tower).
    pub fn reads_images(&self) -> bool {
        self.encoder.image_config().is_some()
    }

    /// This engine with other bounds on request images (default [`ImageLimits::default`]).
    pub fn with_image_limits(mut self, limits: ImageLimits) -> Self {
        self.image_limits = limits;
        self
    }

    /// How many replicas (step loops) serve this engine.
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// The replica for evidence `key`: the one that last took it while it is not fuller than the least
    /// loaded by a whole queue's worth, otherwise the least loaded (waiting + running, lowest index on
    /// ties); remembered for the next request on that evidence.
    fn dispatch(&self, key: &[u32]) -> usize {
        if self.replicas.len() == 1 {
            return 0;
        }
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut hasher);
        let hash = hasher.finish();
        let load = |r: &Replica| {
            r.shared.waiting.load(Ordering::SeqCst) + r.shared.running.load(Ordering::SeqCst)
        };
        let (least, least_load) = self
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| (i, load(r)))
            .min_by_key(|&(i, l)| (l, i))
            .unwrap_or((0, 0));
        let mut affinity = self
            .affinity
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let chosen = match affinity.get(&hash) {
            Some(&i)
                if i < self.replicas.len()
                    && load(&self.replicas[i]) < least_load + self.options.queue_size =>
            {
                i
            }
            _ => least,
        };
        if affinity.len() >= AFFINITY_ENTRIES {
            affinity.clear();
        }
        affinity.insert(hash, chosen);
        chosen
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    pub fn decision_config(&self) -> &DecisionConfig {
        &self.config
    }

    /// Renders and tokenizes a request (CPU work: call it off any latency-critical thread). Refuses what
    /// [`crate::decide`] refuses, and prompts longer than `max_prompt_tokens` (422 naming the
    /// question).
    pub fn prepare(&self, request: DecisionRequest) -> Result<Prepared, DecisionError> {
        let questions = request.questions.len();
        if questions > self.options.max_questions {
            return Err(FieldError::unanswerable(
                FieldPath::root().key("questions"),
                "too_many_questions",
                format!(
                    "{questions} questions; this server answers at most {} in one request",
                    self.options.max_questions
                ),
            )
            .into());
        }
        if let Some(max_token_bytes) = self.encoder.max_token_bytes() {
            refuse_by_length(
                &request,
                max_token_bytes,
                self.options.max_prompt_tokens,
                self.options.max_request_tokens,
            )?;
        }
        let decoded = self.decode_images(&request)?;
        let mut task = match &decoded {
            None => DecisionTask::new(request, &self.config)?,
            Some(images) => {
                let tokens: Vec<usize> = images.iter().map(DecodedImage::tokens).collect();
                DecisionTask::with_images(request, &self.config, &tokens)?
            }
        };
        let prompts = task.next_prompts();
        // The prompts and the evidence probe, encoded together (they share the evidence).
        let mut with_probe = prompts.clone();
        with_probe.push(evidence_probe(task.evidence()));
        let mut encoded = self.encoder.encode_many(&with_probe);
        let probe = encoded.pop().unwrap_or_else(|| {
            Err(ModelError::Backend(
                "the encoder returned no ids for the evidence probe".into(),
            ))
        });
        let tokens = check_encoded(
            &task,
            encoded,
            prompts.len(),
            self.options.max_prompt_tokens,
        )?;
        let total: usize = tokens.iter().map(Vec::len).sum();
        if total > self.options.max_request_tokens {
            return Err(FieldError::unanswerable(
                FieldPath::root().key("questions"),
                "request_too_long",
                format!(
                    "the request's prompts have {total} tokens together, more than this server's limit \
                     of {} a request",
                    self.options.max_request_tokens
                ),
            )
            .into());
        }
        let key = if tokens.is_empty() {
            Arc::from(Vec::new())
        } else {
            evidence_key(&probe.map_err(DecisionError::Model)?, &tokens)
        };
        let (images, cache_key) = match decoded {
            None => (None, key.clone()),
            Some(decoded) => {
                let images = place_images(&*self.encoder, decoded, &key, &tokens)?;
                let mut cache_key: Vec<u32> = key.to_vec();
                cache_key.push(u32::MAX);
                cache_key.extend(
                    images
                        .digest
                        .chunks_exact(4)
                        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
                );
                (Some(Arc::new(images)), Arc::from(cache_key))
            }
        };
        Ok(Prepared {
            task,
            prompts,
            tokens,
            key,
            cache_key,
            images,
        })
    }

    /// The request's images decoded for the model's tower (`None` without images): a 422 naming
    /// `images` when the model has no vision tower, the images' own errors (400 for bad data, 422 past
    /// the limits) under their paths.
    fn decode_images(
        &self,
        request: &DecisionRequest,
    ) -> Result<Option<Vec<DecodedImage>>, DecisionError> {
        if request.images.is_empty() {
            return Ok(None);
        }
        let Some(config) = self.encoder.image_config() else {
            return Err(FieldError::unanswerable(
                FieldPath::root().key("images"),
                "no_vision_model",
                "this model has no vision tower, so it cannot read images: serve it with its mmproj file \
                 (`prism serve --mmproj mmproj-....gguf`, or an mmproj-*.gguf in --model-dir)",
            )
            .into());
        };
        decode_images(&request.images, &config, &self.image_limits)
            .map(Some)
            .map_err(|errors| DecisionError::Request(crate::error::FieldErrors(errors)))
    }

    /// Queues a prepared request; `reply` is called once with its answer. `deadline`: the request is
    /// dropped (with [`JobError::DeadlineExceeded`]) at the first step after it; `cancel` drops it
    /// likewise with [`JobError::Cancelled`].
    pub fn submit(
        &self,
        prepared: Prepared,
        reply: Reply,
        deadline: Option<Instant>,
        cancel: CancelToken,
    ) -> Result<(), SubmitError> {
        let replica = &self.replicas[self.dispatch(&prepared.cache_key)];
        replica.shared.waiting.fetch_add(1, Ordering::SeqCst);
        let job = Job {
            prepared,
            reply,
            deadline,
            cancel,
            enqueued: Instant::now(),
        };
        match replica.sender.try_send(job) {
            Ok(()) => Ok(()),
            Err(error) => {
                replica.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(match error {
                    TrySendError::Full(_) => SubmitError::QueueFull {
                        capacity: self.options.queue_size,
                    },
                    TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                })
            }
        }
    }

    /// Prepares, submits and waits (for embedding without an async runtime). `timeout` bounds the wait
    /// and the work alike.
    pub fn decide(
        &self,
        request: DecisionRequest,
        timeout: Option<Duration>,
    ) -> Result<JobOutput, EngineDecideError> {
        let prepared = self.prepare(request)?;
        let (tx, rx) = std::sync::mpsc::channel();
        self.submit(
            prepared,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
            timeout.map(|t| Instant::now() + t),
            CancelToken::default(),
        )?;
        match rx.recv() {
            Ok(result) => Ok(result?),
            Err(_) => Err(EngineDecideError::Submit(SubmitError::ShuttingDown)),
        }
    }

    /// The queues right now, summed over the replicas.
    pub fn queue_state(&self) -> QueueState {
        QueueState {
            depth: self
                .replicas
                .iter()
                .map(|r| r.shared.waiting.load(Ordering::SeqCst))
                .sum(),
            capacity: self.options.queue_size * self.replicas.len(),
            running: self
                .replicas
                .iter()
                .map(|r| r.shared.running.load(Ordering::SeqCst))
                .sum(),
        }
    }

    /// The engine's counters right now, over all replicas ([`EngineStats::merge`]).
    pub fn stats(&self) -> EngineStats {
        let mut all = self.replica_stats().into_iter();
        let first = all.next().unwrap_or_default();
        all.fold(first, |mut total, s| {
            total.merge(&s);
            total
        })
    }

    /// Each replica's counters right now, in replica order.
    pub fn replica_stats(&self) -> Vec<EngineStats> {
        self.replicas
            .iter()
            .map(|r| r.shared.stats(|s| s.clone()))
            .collect()
    }
}

/// Why [`Engine::decide`] got no answer.
#[derive(Debug, thiserror::Error)]
pub enum EngineDecideError {
    #[error(transparent)]
    Decision(#[from] DecisionError),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Job(#[from] JobError),
}

/// A lower bound on the tokens of a prompt whose text includes `text`, from `text` alone, for a
/// tokenizer none of whose tokens stands for more than `max_token_bytes` bytes of normalized text.
///
/// The rule: `ceil((ASCII bytes + non-ASCII bytes / 4) / max_token_bytes)`. Every token covers at most
/// `max_token_bytes` bytes of the NFC-normalized text (added tokens, such as `<|im_start|>`, their
/// content), so a prompt has at least its NFC byte length over that many tokens. NFC can shorten UTF-8
/// text, but never below that count: ASCII is left alone, and a non-ASCII sequence keeps at least a quarter
/// of its bytes (the tightest case is `U` + two combining marks, 5 bytes, composing to the 2-byte `Ǖ`;
/// the Hangul jamo and the Kelvin sign shrink by 3). Checked over every Unicode scalar value, each
/// composite's decompositions and every Hangul syllable (`tests/engine.rs`).
pub fn min_prompt_tokens(text: &str, max_token_bytes: usize) -> usize {
    quarter_bytes(text).div_ceil(4 * max_token_bytes.max(1))
}

/// Four times the ASCII bytes plus the non-ASCII bytes of `text`.
fn quarter_bytes(text: &str) -> usize {
    let ascii = text.bytes().filter(u8::is_ascii).count();
    4 * ascii + (text.len() - ascii)
}

/// Four times the ASCII bytes plus the non-ASCII bytes that the evidence text of `state` certainly
/// contains ([`crate::render::state_text`]: a non-blank string as is, anything else as its JSON, which
/// holds every key and string at least as long as sent).
fn state_quarter_bytes(state: &crate::pyjson::PyValue) -> usize {
    use crate::pyjson::PyValue;
    fn inside(value: &PyValue) -> usize {
        match value {
            PyValue::Str(text) => quarter_bytes(text),
            PyValue::Array(items) => items.iter().map(inside).sum(),
            PyValue::Object(object) => object
                .iter()
                .map(|(key, item)| quarter_bytes(key) + inside(item))
                .sum(),
            _ => 0,
        }
    }
    match state {
        PyValue::Str(text) if crate::pyjson::py_strip(text).is_empty() => 0,
        other => inside(other),
    }
}

/// Refuses, before anything is rendered or tokenized, a request whose evidence and instructions alone
/// prove a prompt longer than `max_prompt_tokens` or prompts longer than `max_request_tokens`
/// together ([`min_prompt_tokens`]: every question's first prompt holds the evidence and its
/// instructions whole).
fn refuse_by_length(
    request: &DecisionRequest,
    max_token_bytes: usize,
    max_prompt_tokens: usize,
    max_request_tokens: usize,
) -> Result<(), DecisionError> {
    let state = state_quarter_bytes(&request.state);
    let per_token = 4 * max_token_bytes.max(1);
    let mut total = 0usize;
    for question in &request.questions {
        let at_least = (state + quarter_bytes(&question.instructions)).div_ceil(per_token);
        if at_least > max_prompt_tokens {
            return Err(FieldError::unanswerable(
                FieldPath::root().key("questions").key(&question.name),
                "prompt_too_long",
                format!(
                    "the prompt has at least {at_least} tokens (its evidence and instructions are longer than                      {max_prompt_tokens} tokens of at most {max_token_bytes} bytes each, this model's longest),                      more than this server's limit of {max_prompt_tokens}"
                ),
            )
            .into());
        }
        total = total.saturating_add(at_least);
    }
    if total > max_request_tokens {
        return Err(FieldError::unanswerable(
            FieldPath::root().key("questions"),
            "request_too_long",
            format!(
                "the request's prompts have at least {total} tokens together (each holds the evidence; no                  token of this model is longer than {max_token_bytes} bytes), more than this server's limit                  of {max_request_tokens} a request"
            ),
        )
        .into());
    }
    Ok(())
}

/// Tokenizes prompts, refusing one longer than `limit` with the 422 naming its question.
pub(crate) fn encode_all(
    encoder: &dyn PromptEncoder,
    task: &DecisionTask,
    prompts: &[LetterPrompt],
    limit: usize,
) -> Result<Vec<Vec<u32>>, DecisionError> {
    check_encoded(task, encoder.encode_many(prompts), prompts.len(), limit)
}

/// The `count` prompts' ids from [`PromptEncoder::encode_many`], checked in order (the first bad
/// prompt is the one reported), refusing one longer than `limit` with the 422 naming its question.
fn check_encoded(
    task: &DecisionTask,
    encoded: Vec<Result<Vec<u32>, ModelError>>,
    count: usize,
    limit: usize,
) -> Result<Vec<Vec<u32>>, DecisionError> {
    if encoded.len() != count {
        return Err(DecisionError::ModelOutput(format!(
            "the encoder returned {} prompts' ids for {count}",
            encoded.len()
        )));
    }
    let mut all = Vec::with_capacity(count);
    for (index, ids) in encoded.into_iter().enumerate() {
        let ids = ids.map_err(|e| task.model_error(e))?;
        if ids.len() > limit {
            return Err(task.model_error(ModelError::PromptTooLong {
                prompt: index,
                tokens: ids.len(),
                limit,
            }));
        }
        if ids.is_empty() {
            return Err(DecisionError::ModelOutput(format!(
                "prompt {index} encodes to no tokens"
            )));
        }
        all.push(ids);
    }
    Ok(all)
}

/// The request's evidence prefix: the tokens its prompts share with a probe prompt that has the same
/// evidence and a question nobody asks, so the branch point sits at the end of the evidence whatever
/// the questions are (a later request with other questions about the same evidence finds the same key).
/// Capped so every prompt keeps at least one token of its own.
fn evidence_key(probe: &[u32], tokens: &[Vec<u32>]) -> Arc<[u32]> {
    let Some(first) = tokens.first() else {
        return Arc::from(Vec::new());
    };
    let mut common = first.iter().zip(probe).take_while(|(a, b)| a == b).count();
    for t in &tokens[1..] {
        common = common.min(first.iter().zip(t).take_while(|(a, b)| a == b).count());
    }
    let shortest = tokens.iter().map(Vec::len).min().unwrap_or(0);
    let common = common.min(shortest.saturating_sub(1));
    Arc::from(&first[..common])
}

/// The request's images against its tokens: the pad tokens must form, inside the evidence `key`, one
/// run per image of exactly its merged patches, and no prompt may hold pads past the evidence (else the
/// evidence's own text holds `<|image_pad|>`, a 422 naming `state`). Gives the images with the
/// evidence's 3-axis positions and pad rows.
fn place_images(
    encoder: &dyn PromptEncoder,
    images: Vec<DecodedImage>,
    key: &[u32],
    tokens: &[Vec<u32>],
) -> Result<RequestImages, DecisionError> {
    let pad = encoder.image_pad().ok_or_else(|| {
        DecisionError::Model(ModelError::Backend(
            "the model reads images but its tokenizer has no <|image_pad|> token".into(),
        ))
    })?;
    let runs = prism_model::vision::pad_runs(key, pad);
    let foreign = || {
        DecisionError::from(FieldError::unanswerable(
            FieldPath::root().key("state"),
            "image_tokens_in_text",
            "the evidence's text holds image tokens of its own (<|image_pad|>, <|vision_start|>); with \
             images, remove them from the text",
        ))
    };
    let fits = runs.len() == images.len()
        && runs
            .iter()
            .zip(&images)
            .all(|(&(_, len), image)| len == image.tokens());
    if !fits || tokens.iter().any(|t| t[key.len()..].contains(&pad)) {
        return Err(foreign());
    }
    let image_runs: Vec<crate::vision::ImageRun> = runs
        .iter()
        .zip(&images)
        .map(|(&(start, _), image)| crate::vision::ImageRun {
            start,
            rows: image.rows,
            cols: image.cols,
        })
        .collect();
    let (positions, _) = crate::vision::mrope_positions(key.len(), &image_runs)
        .map_err(|e| DecisionError::ModelOutput(format!("image positions: {e}")))?;
    let pad_rows = runs
        .iter()
        .flat_map(|&(start, len)| start..start + len)
        .collect();
    Ok(RequestImages::new(images, positions, pad_rows))
}
