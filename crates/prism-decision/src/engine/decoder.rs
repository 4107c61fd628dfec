//! The real model: the release's chat template and tokenizer in front of the Qwen3.5 decoder of
//! `prism-model`, as a [`PassModel`] for the engine and as a [`LetterModel`] for [`crate::decide`].
//!
//! Prompts are chat-templated with thinking off and tokenized; a pass's groups run as one batch of
//! the decoder (each group's prefix once, its branches continuing from the prefix's state in the same
//! pass). Only the output-head rows of the letters `A`..`Z` are computed: the read-out needs 26 rows,
//! not the whole vocabulary.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::DType;
use prism_gguf::{GgufError, GgufFile};
use prism_model::tensor_parallel::TensorParallelModel;
use prism_model::vision::VisionWeights;
use prism_model::{
    BatchItem, Decoder, EmbeddingRows, LoadOptions, Position3, Precision, Qwen35Model,
};

use super::pass::{
    Branch, GroupInput, GroupOutput, NextLogits, PassModel, PrefixImages, PromptEncoder,
    ThoughtMarkers,
};
use crate::chat_template::{ChatMessage, ChatRole, ContentPart, PromptFormat, PromptFormatError};
use crate::config::{ConfigError, DecisionConfig};
use crate::model::ImageSlot;
use crate::model::{
    LetterLogits, LetterModel, LetterPrompt, ModelError, ThoughtOutcome, ThoughtRequest,
};
use crate::vision::ImageConfig;

/// Why a decision model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read the model file {path}: {source}")]
    Gguf { path: PathBuf, source: GgufError },
    #[error("model directory {dir}: {source}")]
    PromptFormat {
        dir: PathBuf,
        source: PromptFormatError,
    },
    #[error(transparent)]
    DecisionConfig(#[from] ConfigError),
    #[error("decision_config.json's letter_token_ids disagree with the tokenizer: {0}")]
    LetterTokenIds(PromptFormatError),
    #[error("cannot load the decoder from {path}: {source}")]
    Model {
        path: PathBuf,
        source: prism_model::ModelError,
    },
    #[error("letter {letter} is token {id}, outside the model's {vocab_size} output rows")]
    LetterOutsideVocabulary {
        letter: char,
        id: u32,
        vocab_size: usize,
    },
    #[error("cannot load the vision tower from {path}: {reason}")]
    Mmproj { path: PathBuf, reason: String },
    #[error("model directory {dir} holds several mmproj files ({files}): name one with --mmproj")]
    SeveralMmproj { dir: PathBuf, files: String },
}

/// Where a decision model comes from: its GGUF file and, optionally, the release's model directory
/// (`tokenizer.json`, chat template, `config.json`, `decision_config.json`). Without a directory the
/// tokenizer and chat template come from the GGUF itself and the decision config takes its defaults.
/// The vision tower comes from `mmproj`, else from the one `mmproj-*.gguf` in the model directory;
/// without one the model reads text only (requests with images get a 422).
#[derive(Debug, Clone, Default)]
pub struct ModelSource {
    pub gguf: PathBuf,
    pub model_dir: Option<PathBuf>,
    pub mmproj: Option<PathBuf>,
}

impl ModelSource {
    /// The mmproj file to load: `mmproj` when set, else the one `mmproj-*.gguf` in the model directory
    /// (several there are an error: which one is meant is not guessed).
    pub fn mmproj_path(&self) -> Result<Option<PathBuf>, EngineError> {
        if let Some(path) = &self.mmproj {
            return Ok(Some(path.clone()));
        }
        let Some(dir) = &self.model_dir else {
            return Ok(None);
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(None);
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        let lower = n.to_ascii_lowercase();
                        lower.starts_with("mmproj") && lower.ends_with(".gguf")
                    })
            })
            .collect();
        found.sort();
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(EngineError::SeveralMmproj {
                dir: dir.clone(),
                files: found
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }
}

/// A loaded decision model: the [`LetterModel`] and the decision config that goes with it.
pub struct LoadedDecisionModel {
    pub model: DecoderLetterModel,
    pub config: DecisionConfig,
}

/// [`LetterModel`] and [`PassModel`] over the Qwen3.5 decoder: one model on one device
/// ([`Qwen35Model`], the default), or split over several ([`TensorParallelModel`], made by
/// [`DecoderLetterModel::tensor_parallel`]; the engine's passes only).
pub struct DecoderLetterModel<D: Decoder = Qwen35Model> {
    name: String,
    decoder: D,
    /// The vision tower (from the mmproj file), when the model reads images.
    vision: Option<VisionWeights>,
    /// Images the tower has encoded, and its time on them in nanoseconds ([`PassModel::vision_totals`]).
    vision_images: AtomicU64,
    vision_nanos: AtomicU64,
    format: Arc<PromptFormat>,
    max_prompt_tokens: usize,
}

impl DecoderLetterModel {
    /// Another handle on the same model (weights, tower and prompt format shared, nothing copied; its
    /// own vision counters): e.g. for a second engine over one loaded model.
    pub fn share(&self) -> Self {
        Self {
            name: self.name.clone(),
            decoder: self.decoder.clone(),
            vision: self.vision.clone(),
            vision_images: AtomicU64::new(0),
            vision_nanos: AtomicU64::new(0),
            format: self.format.clone(),
            max_prompt_tokens: self.max_prompt_tokens,
        }
    }

    /// Loads the GGUF, the prompt format (tokenizer, chat template, the spec's load-time checks) and the
    /// decision config, and checks them against each other. `max_prompt_tokens` is the longest prompt
    /// accepted; longer ones are refused as [`ModelError::PromptTooLong`] (HTTP 422).
    pub fn load(
        source: &ModelSource,
        options: &LoadOptions,
        max_prompt_tokens: usize,
    ) -> Result<LoadedDecisionModel, EngineError> {
        let gguf = GgufFile::open(&source.gguf).map_err(|e| EngineError::Gguf {
            path: source.gguf.clone(),
            source: e,
        })?;
        // A directory that does not exist has no files in it: everything then comes from the GGUF.
        let dir = source.model_dir.clone().unwrap_or_default();
        let format = PromptFormat::load_from_model_dir(&dir, Some(&gguf)).map_err(|e| {
            EngineError::PromptFormat {
                dir: dir.clone(),
                source: e,
            }
        })?;
        let config = match &source.model_dir {
            Some(dir) => DecisionConfig::from_model_dir(dir)?,
            None => DecisionConfig::default(),
        };
        if let Some(ids) = &config.letter_token_ids {
            format
                .check_letter_token_ids(ids)
                .map_err(EngineError::LetterTokenIds)?;
        }
        let mut options = options.clone();
        if options.hf_config.is_none() {
            options.hf_config = source
                .model_dir
                .as_ref()
                .map(|d| d.join("config.json"))
                .filter(|p| p.is_file());
        }
        let decoder = Qwen35Model::from_gguf(&gguf, &options).map_err(|e| EngineError::Model {
            path: source.gguf.clone(),
            source: e,
        })?;
        let vocab_size = decoder.vocab_size();
        for (letter, &id) in ('A'..='Z').zip(format.letter_ids().iter()) {
            if id as usize >= vocab_size {
                return Err(EngineError::LetterOutsideVocabulary {
                    letter,
                    id,
                    vocab_size,
                });
            }
        }
        let vision = match source.mmproj_path()? {
            None => None,
            Some(path) => Some(load_vision(&path, &decoder, &format)?),
        };
        let name = model_name(&gguf, &source.gguf);
        Ok(LoadedDecisionModel {
            model: DecoderLetterModel {
                name,
                decoder,
                vision,
                vision_images: AtomicU64::new(0),
                vision_nanos: AtomicU64::new(0),
                format: Arc::new(format),
                max_prompt_tokens,
            },
            config,
        })
    }

    /// The same model split over devices for tensor parallelism: `models` is the model loaded on
    /// each device where a share should live (1, 2 or 4; one device several times for shares that
    /// share it), the prompt format, vision tower and name of the first. Only the integer path
    /// splits (int8, w4a8); the split model's answers are the unsplit model's bits.
    pub fn tensor_parallel(
        models: &[DecoderLetterModel],
    ) -> Result<DecoderLetterModel<TensorParallelModel>, ModelError> {
        let first = models
            .first()
            .ok_or_else(|| ModelError::Backend("tensor parallelism over no devices".into()))?;
        let decoders: Vec<&Qwen35Model> = models.iter().map(|m| &m.decoder).collect();
        Ok(DecoderLetterModel {
            name: first.name.clone(),
            decoder: TensorParallelModel::over(&decoders).map_err(backend)?,
            vision: first.vision.clone(),
            vision_images: AtomicU64::new(0),
            vision_nanos: AtomicU64::new(0),
            format: first.format.clone(),
            max_prompt_tokens: first.max_prompt_tokens,
        })
    }
}

impl<D: Decoder> DecoderLetterModel<D> {
    /// The vision tower, when the model reads images.
    pub fn vision(&self) -> Option<&VisionWeights> {
        self.vision.as_ref()
    }

    /// The tokenizer, chat template and letter ids in use.
    pub fn prompt_format(&self) -> &PromptFormat {
        &self.format
    }

    /// The prompt encoder the engine uses off its step loop (shares this model's prompt format).
    pub fn encoder(&self) -> Arc<dyn PromptEncoder> {
        Arc::new(self.format_encoder())
    }

    fn format_encoder(&self) -> FormatEncoder {
        FormatEncoder {
            format: self.format.clone(),
            max_token_bytes: keeps_user_text_whole(&self.format)
                .then(|| self.format.tokenizer().max_token_bytes()),
            markers: thought_markers(&self.format),
            images: self.vision.as_ref().and_then(|v| {
                let pad = self.format.special_tokens().image_pad?;
                Some((image_config(v), pad))
            }),
        }
    }

    /// The decoder.
    pub fn decoder(&self) -> &D {
        &self.decoder
    }

    /// The longest prompt accepted, in tokens.
    pub fn max_prompt_tokens(&self) -> usize {
        self.max_prompt_tokens
    }

    /// A prompt's token ids: system and user message through the chat template with thinking off, so the
    /// text ends in the assistant prefix `<think>\n\n</think>\n\n` where the letter is read.
    pub fn prompt_tokens(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, PromptFormatError> {
        prompt_tokens(&self.format, prompt)
    }
}

fn prompt_tokens(
    format: &PromptFormat,
    prompt: &LetterPrompt,
) -> Result<Vec<u32>, PromptFormatError> {
    Ok(format
        .render_and_encode(&prompt_messages(prompt), false)?
        .ids)
}

/// A prompt's chat messages: the system text, and the user message as text, or as text and image
/// parts when it has images (a slot that is not on a character boundary puts its image at the next
/// one; the engine's slots always are).
pub fn prompt_messages(prompt: &LetterPrompt) -> [ChatMessage; 2] {
    let user = if prompt.images.is_empty() {
        ChatMessage::user(prompt.user.as_str())
    } else {
        let mut parts = Vec::with_capacity(2 * prompt.images.len() + 1);
        let mut from = 0;
        for slot in &prompt.images {
            let mut at = slot.at.clamp(from, prompt.user.len());
            while !prompt.user.is_char_boundary(at) {
                at += 1;
            }
            if at > from {
                parts.push(ContentPart::Text(prompt.user[from..at].to_string()));
            }
            parts.push(ContentPart::Image);
            from = at;
        }
        if from < prompt.user.len() {
            parts.push(ContentPart::Text(prompt.user[from..].to_string()));
        }
        ChatMessage::with_parts(ChatRole::User, parts)
    };
    [ChatMessage::system(prompt.system.as_str()), user]
}

/// Expands each `<|image_pad|>` of `ids` (one per image part, in order) to its image's pad tokens.
pub fn expand_image_pads(
    ids: Vec<u32>,
    pad: u32,
    slots: &[ImageSlot],
) -> Result<Vec<u32>, ModelError> {
    let found = ids.iter().filter(|&&t| t == pad).count();
    if found != slots.len() {
        return Err(ModelError::Backend(format!(
            "the chat template wrote {found} image pad tokens for {} images",
            slots.len()
        )));
    }
    let extra: usize = slots.iter().map(|s| s.tokens.saturating_sub(1)).sum();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut next = slots.iter();
    for t in ids {
        if t == pad {
            let n = next.next().map_or(1, |s| s.tokens);
            out.extend(std::iter::repeat_n(pad, n));
        } else {
            out.push(t);
        }
    }
    Ok(out)
}

/// The preprocessing a vision tower reads: its patch, merge, mean and std; the release's pixel bounds.
fn image_config(vision: &VisionWeights) -> ImageConfig {
    let c = &vision.config;
    ImageConfig {
        patch_size: c.patch,
        merge_size: c.merge,
        temporal_patch_size: prism_model::vision::TEMPORAL_PATCH,
        mean: c.mean,
        std: c.std,
        ..ImageConfig::default()
    }
}

/// Loads the mmproj at `path` onto the decoder's device and checks it against the decoder (its output
/// width) and the tokenizer (which needs `<|image_pad|>`).
fn load_vision(
    path: &Path,
    decoder: &Qwen35Model,
    format: &PromptFormat,
) -> Result<VisionWeights, EngineError> {
    let fail = |reason: String| EngineError::Mmproj {
        path: path.to_path_buf(),
        reason,
    };
    let gguf = GgufFile::open(path).map_err(|e| fail(e.to_string()))?;
    let mut vision =
        VisionWeights::load(&gguf, decoder.device()).map_err(|e| fail(e.to_string()))?;
    // On a GPU the tower's products run in bf16 unless the decoder itself runs in f32.
    if decoder.device().is_cuda() && decoder.precision() != Precision::F32 {
        vision = vision
            .with_matrices(DType::BF16)
            .map_err(|e| fail(e.to_string()))?;
    }
    let hidden = decoder.config().hidden_size;
    if vision.config.projection != hidden {
        return Err(fail(format!(
            "its projector writes {}-wide embeddings; the decoder's are {hidden} wide (another model's mmproj?)",
            vision.config.projection
        )));
    }
    if format.special_tokens().image_pad.is_none() {
        return Err(fail(
            "the tokenizer has no <|image_pad|> token, so images cannot be placed".into(),
        ));
    }
    Ok(vision)
}

/// Whether the chat template puts a decision prompt's user message into its text whole (the Qwen3.5
/// template does, trimmed at its ends, which hold no evidence or instructions): the condition for
/// bounding a prompt's tokens from its evidence and instructions before tokenizing.
fn keeps_user_text_whole(format: &PromptFormat) -> bool {
    let user = crate::render::user_text("\u{1}evidence probe\u{1}", "\u{1}probe?", &["a", "b"]);
    let messages = [
        ChatMessage::system(crate::render::SYSTEM_PROMPT),
        ChatMessage::user(user.as_str()),
    ];
    format
        .render_chat(&messages, false)
        .is_ok_and(|text| text.contains(&user))
}

/// The tokens around a thought in this prompt format; `None` when its chat template has no thinking
/// mode or its tokenizer no `</think>`.
fn thought_markers(format: &PromptFormat) -> Option<ThoughtMarkers> {
    if !format.supports_thinking() {
        return None;
    }
    let end_think = format.special_tokens().end_think?;
    let after_end = format.encode("\n\n").ok()?;
    let close = format.encode("\n</think>\n\n").ok()?;
    Some(ThoughtMarkers {
        end_think,
        end_of_sequence: format.eos_ids().to_vec(),
        after_end,
        close,
    })
}

/// [`PromptEncoder`] over a prompt format.
struct FormatEncoder {
    format: Arc<PromptFormat>,
    max_token_bytes: Option<usize>,
    markers: Option<ThoughtMarkers>,
    /// The vision tower's preprocessing and the `<|image_pad|>` id, when the model reads images.
    images: Option<(ImageConfig, u32)>,
}

impl FormatEncoder {
    /// `ids` with each image's pad expanded (unchanged for a text prompt).
    fn expand(&self, ids: Vec<u32>, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        if prompt.images.is_empty() {
            return Ok(ids);
        }
        let Some((_, pad)) = &self.images else {
            return Err(ModelError::Backend(
                "a prompt with images for a model without a vision tower".into(),
            ));
        };
        expand_image_pads(ids, *pad, &prompt.images)
    }
}

impl PromptEncoder for FormatEncoder {
    fn encode(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        let ids = prompt_tokens(&self.format, prompt)
            .map_err(|e| ModelError::Backend(format!("tokenizer: {e}")))?;
        self.expand(ids, prompt)
    }

    /// The prompts rendered, and their common beginning (the system prompt and the evidence) encoded
    /// once ([`PromptFormat::encode_sharing`]); where rendering or encoding fails, each prompt is
    /// encoded alone, so that an error names its own prompt.
    fn encode_many(&self, prompts: &[LetterPrompt]) -> Vec<Result<Vec<u32>, ModelError>> {
        let shared = prompts
            .iter()
            .map(|p| self.format.render_chat(&prompt_messages(p), false))
            .collect::<Result<Vec<String>, _>>()
            .ok()
            .and_then(|texts| {
                let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
                self.format.encode_sharing(&texts).ok()
            });
        match shared {
            Some(all) => all
                .into_iter()
                .zip(prompts)
                .map(|(ids, prompt)| self.expand(ids, prompt))
                .collect(),
            None => {
                use rayon::prelude::*;
                prompts.par_iter().map(|p| self.encode(p)).collect()
            }
        }
    }

    fn image_config(&self) -> Option<ImageConfig> {
        self.images.as_ref().map(|(config, _)| config.clone())
    }

    fn image_pad(&self) -> Option<u32> {
        self.images.as_ref().map(|(_, pad)| *pad)
    }

    fn max_token_bytes(&self) -> Option<usize> {
        self.max_token_bytes
    }

    fn encode_thinking(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        if self.markers.is_none() {
            return Err(ModelError::CannotThink);
        }
        let ids = self
            .format
            .render_and_encode(&prompt_messages(prompt), true)
            .map_err(|e| ModelError::Backend(format!("tokenizer: {e}")))?
            .ids;
        self.expand(ids, prompt)
    }

    fn thought_markers(&self) -> Option<ThoughtMarkers> {
        self.markers.clone()
    }

    fn decode(&self, tokens: &[u32]) -> String {
        self.format.decode(tokens, true).unwrap_or_else(|e| {
            tracing::warn!("cannot decode a thought's tokens: {e}");
            String::new()
        })
    }
}

/// A decoder error as the engine reports it: the device running out of memory (CUDA's
/// `CUDA_ERROR_OUT_OF_MEMORY`, or an allocation failure) is told apart, so the request gets a 503 and the
/// server goes on.
fn backend(error: impl std::fmt::Display) -> ModelError {
    let message = error.to_string();
    if message.contains("OUT_OF_MEMORY") || message.contains("out of memory") {
        ModelError::OutOfMemory(message)
    } else {
        ModelError::Backend(message)
    }
}

/// A prefix's image inputs to the decoder: its tokens' positions, and the rows (indices into the
/// prefix) that take image embeddings with those embeddings (`None` when the prefix is a chunk without
/// pads).
struct PrefixInputs<'a> {
    positions: &'a [Position3],
    rows: Vec<usize>,
    values: Option<candle_core::Tensor>,
}

impl<D: Decoder> DecoderLetterModel<D> {
    /// The image inputs of a group prefix of `len` tokens: the tower runs here the first time the
    /// request's images are needed (each image alone, so its embeddings do not depend on the others
    /// or on the pass), and its output is kept with the request for later chunks.
    fn prefix_inputs<'a>(
        &self,
        prefix: &PrefixImages<'a>,
        len: usize,
    ) -> Result<PrefixInputs<'a>, ModelError> {
        let images = prefix.images;
        let (from, to) = (prefix.offset, prefix.offset + len);
        let positions = images.positions.get(from..to).ok_or_else(|| {
            ModelError::Backend(format!(
                "a prefix of evidence tokens {from}..{to} past the {} positions of its images",
                images.positions.len()
            ))
        })?;
        let first = images.pad_rows.partition_point(|&r| r < from);
        let end = images.pad_rows.partition_point(|&r| r < to);
        if first == end {
            return Ok(PrefixInputs {
                positions,
                rows: Vec::new(),
                values: None,
            });
        }
        let vision = self.vision.as_ref().ok_or_else(|| {
            ModelError::Backend("a pass holds images but the model has no vision tower".into())
        })?;
        let all = images.embeddings(|decoded| -> Result<candle_core::Tensor, ModelError> {
            let device = self.decoder.device().clone();
            let started = std::time::Instant::now();
            let out = prism_model::profile::time(
                "vision tower",
                &device,
                || -> prism_model::Result<_> {
                    // Consecutive images of one size go through the tower together, as the frames
                    // of one video (frames attend only within themselves): the same computation per
                    // image, in fewer and larger products.
                    let mut each = Vec::new();
                    for group in decoded.chunk_by(|a, b| a.grid == b.grid && a.grid[0] == 1) {
                        let [t, h, w] = group[0].grid;
                        each.push(if let [image] = group {
                            vision.forward_pixels(&image.pixels, image.grid)?
                        } else {
                            let pixels: Vec<f32> = group
                                .iter()
                                .flat_map(|i| i.pixels.iter().copied())
                                .collect();
                            vision.forward_pixels(&pixels, [t * group.len(), h, w])?
                        });
                    }
                    Ok(candle_core::Tensor::cat(&each, 0)?)
                },
            )
            .map_err(backend)?;
            // Once per request with images: the device's work counted in the tower's time.
            device.synchronize().map_err(backend)?;
            self.vision_images
                .fetch_add(decoded.len() as u64, Ordering::Relaxed);
            self.vision_nanos.fetch_add(
                u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            Ok(out)
        })?;
        if all.dims().first() != Some(&images.pad_rows.len()) {
            return Err(ModelError::Backend(format!(
                "the vision tower gave embeddings of shape {:?} for {} image pads",
                all.dims(),
                images.pad_rows.len()
            )));
        }
        let values = all.narrow(0, first, end - first).map_err(backend)?;
        Ok(PrefixInputs {
            positions,
            rows: images.pad_rows[first..end]
                .iter()
                .map(|r| r - from)
                .collect(),
            values: Some(values),
        })
    }
}

/// A branch's letter count must be one the read-out takes.
fn check_letters(branch: &Branch<'_>) -> Result<(), ModelError> {
    if branch.letters == 0 || branch.letters > 26 {
        return Err(ModelError::Backend(format!(
            "a branch reads {} letters; the read-out takes 1 to 26",
            branch.letters
        )));
    }
    Ok(())
}

/// How many leading tokens every one of `branches` shares, when there are two or more, leaving each at
/// least one token of its own (its read-out is at its last token); 0 otherwise.
fn shared_branch_tokens(branches: &[Branch<'_>]) -> usize {
    let Some((first, rest)) = branches.split_first() else {
        return 0;
    };
    if rest.is_empty() {
        return 0;
    }
    let mut shared = first.tokens.len();
    for b in rest {
        shared = shared.min(
            first
                .tokens
                .iter()
                .zip(b.tokens)
                .take_while(|(x, y)| x == y)
                .count(),
        );
    }
    let shortest = branches.iter().map(|b| b.tokens.len()).min().unwrap_or(0);
    shared.min(shortest.saturating_sub(1))
}

impl<D: Decoder> PassModel for DecoderLetterModel<D> {
    type State = D::State;

    fn model_name(&self) -> &str {
        &self.name
    }

    fn run_pass(
        &mut self,
        groups: &[GroupInput<'_, D::State>],
    ) -> Result<Vec<GroupOutput<D::State>>, ModelError> {
        // The engine runs passes on its own thread: the GPU's context must be current there.
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(device) = self.decoder.device() {
            device
                .cuda_stream()
                .context()
                .bind_to_thread()
                .map_err(|e| backend(format!("cannot make the CUDA context current: {e:?}")))?;
        }
        // One decoder batch: per group its prefix item (when it has prefix tokens), then its branches,
        // which continue the prefix item in the same pass or, without one, start from the group's state.
        // A fresh state (a new sequence, and the placeholders of branches that continue a prefix or
        // shared-tail item of the pass), made only when some group needs one: a pass of decode steps
        // needs none.
        let device = self.decoder.device().clone();
        // The host's work before the forward (the pass's items and states), a profile section.
        let items_timer =
            prism_model::profile::Section::start("pass: items", &device).map_err(backend)?;
        let needs_fresh = groups.iter().any(|g| {
            (g.start.is_none() && !(g.prefix.is_empty() && g.branches.is_empty()))
                || (!g.prefix.is_empty() && !g.branches.is_empty())
                || shared_branch_tokens(&g.branches) > 0
        });
        let fresh = if needs_fresh {
            Some(self.decoder.new_state().map_err(backend)?)
        } else {
            None
        };
        let fresh_state = || {
            fresh.clone().ok_or_else(|| {
                ModelError::Backend("a pass needed a fresh state it did not make".into())
            })
        };
        // A group of one branch on a text prefix runs as one item, prefix and branch together, its
        // state after the prefix taken as a snapshot inside it: one sequence a layer instead of a
        // prefix and a branch continuing it (on CUDA a second level of delta-rule launches), with the
        // same bits (the decoder's snapshot is the state the prefix alone leaves).
        let joined: Vec<Option<Vec<u32>>> = groups
            .iter()
            .map(|g| match g.branches.as_slice() {
                [branch]
                    if !g.prefix.is_empty() && g.want_logits.is_none() && g.images.is_none() =>
                {
                    Some([g.prefix, branch.tokens].concat())
                }
                _ => None,
            })
            .collect();
        let mut states: Vec<D::State> = Vec::new();
        let mut tokens: Vec<&[u32]> = Vec::new();
        // Per item: where its snapshot is taken (a joined group's prefix length when its state is
        // wanted).
        let mut snapshot_at: Vec<Option<usize>> = Vec::new();
        let mut parents: Vec<Option<usize>> = Vec::new();
        let mut keep: Vec<bool> = Vec::new();
        // Per item: the image rows and positions of a prefix that holds images.
        let mut extras: Vec<Option<PrefixInputs<'_>>> = Vec::new();
        let mut roots: Vec<Option<usize>> = Vec::with_capacity(groups.len());
        // Items whose last position's next-token logits are wanted (thought steps).
        let mut next_items: Vec<usize> = Vec::new();
        let mut next_k: Option<usize> = None;
        let mut branch_items: Vec<(usize, usize)> = Vec::new(); // (item, letters)
        for (group, joined) in groups.iter().zip(&joined) {
            let start = || -> Result<D::State, ModelError> {
                match group.start {
                    Some(state) => Ok(state.clone()),
                    None => fresh_state(),
                }
            };
            if let (Some(joined), [branch]) = (joined, group.branches.as_slice()) {
                check_letters(branch)?;
                states.push(start()?);
                tokens.push(joined);
                parents.push(None);
                keep.push(false);
                extras.push(None);
                snapshot_at.push(group.want_state.then_some(group.prefix.len()));
                roots.push(Some(states.len() - 1));
                branch_items.push((states.len() - 1, branch.letters));
                continue;
            }
            let root = if group.prefix.is_empty() {
                None
            } else {
                states.push(start()?);
                tokens.push(group.prefix);
                snapshot_at.push(None);
                parents.push(None);
                keep.push(group.want_state);
                extras.push(match &group.images {
                    Some(images) => Some(self.prefix_inputs(images, group.prefix.len())?),
                    None => None,
                });
                Some(states.len() - 1)
            };
            roots.push(root);
            if let Some(k) = group.want_logits {
                // One k for the pass: the largest asked for (0, the whole row, when any asks it).
                next_k = Some(match next_k {
                    None => k,
                    Some(0) => 0,
                    Some(_) if k == 0 => 0,
                    Some(other) => other.max(k),
                });
                match root {
                    Some(item) => next_items.push(item),
                    None => {
                        return Err(ModelError::Backend(
                            "next-token logits need a prefix to read".into(),
                        ))
                    }
                }
            }
            // The tokens all of the group's branches begin with (questions that open with the same
            // words, evidence a group's prefix leaves out) run once, as an item the branches
            // continue.
            let shared = shared_branch_tokens(&group.branches);
            let from = if shared == 0 {
                root
            } else {
                states.push(if root.is_some() {
                    fresh_state()?
                } else {
                    start()?
                });
                tokens.push(&group.branches[0].tokens[..shared]);
                snapshot_at.push(None);
                extras.push(None);
                parents.push(root);
                keep.push(false);
                Some(states.len() - 1)
            };
            for branch in &group.branches {
                check_letters(branch)?;
                states.push(if from.is_some() {
                    fresh_state()?
                } else {
                    start()?
                });
                tokens.push(&branch.tokens[shared..]);
                snapshot_at.push(None);
                extras.push(None);
                parents.push(from);
                // Only the letter logits of a branch are read: its states go layer by layer.
                keep.push(false);
                branch_items.push((states.len() - 1, branch.letters));
            }
        }
        let mut logits_rows: Vec<Vec<f32>> = Vec::new();
        let mut next_rows: Vec<NextLogits> = Vec::new();
        let mut snapshots: Vec<Option<D::State>> = Vec::new();
        {
            let mut items: Vec<BatchItem<'_, D::State>> = states
                .iter_mut()
                .zip(&tokens)
                .zip(&parents)
                .zip(&keep)
                .zip(&extras)
                .zip(&snapshot_at)
                .map(
                    |(((((state, t), parent), &keep_state), extra), &snapshot)| {
                        let mut item = BatchItem::new(state, t);
                        item.parent = *parent;
                        item.keep_state = keep_state;
                        item.snapshot = snapshot;
                        if let Some(extra) = extra {
                            item.positions = Some(extra.positions);
                            item.embeddings = extra.values.as_ref().map(|values| EmbeddingRows {
                                rows: &extra.rows,
                                values,
                            });
                        }
                        item
                    },
                )
                .collect();
            items_timer.stop().map_err(backend)?;
            if !items.is_empty() {
                let mut out = self.decoder.forward(&mut items).map_err(backend)?;
                snapshots = std::mem::take(&mut out.snapshots);
                let last_rows = |chosen: &mut dyn Iterator<Item = usize>| {
                    let rows: Vec<u32> = chosen
                        .map(|item| {
                            let segment = &out.segments[item];
                            (segment.start + segment.len - 1) as u32
                        })
                        .collect();
                    let n = rows.len();
                    let index = candle_core::Tensor::from_vec(rows, n, out.hidden.device())?;
                    out.hidden.index_select(&index, 0)
                };
                if !next_items.is_empty() {
                    let hidden = last_rows(&mut next_items.iter().copied()).map_err(backend)?;
                    let device = hidden.device().clone();
                    let k = next_k.unwrap_or(0);
                    next_rows = prism_model::profile::time(
                        "output head: next-token candidates, to the host",
                        &device,
                        || -> prism_model::Result<Vec<NextLogits>> {
                            let logits = self.decoder.logits(&hidden)?;
                            Ok(prism_model::top_candidates(&logits, k)?
                                .into_iter()
                                .map(|c| NextLogits {
                                    values: c.values,
                                    ids: Some(c.ids),
                                })
                                .collect())
                        },
                    )
                    .map_err(backend)?;
                }
                if !branch_items.is_empty() {
                    let rows: Vec<u32> = branch_items
                        .iter()
                        .map(|&(item, _)| {
                            let segment = &out.segments[item];
                            (segment.start + segment.len - 1) as u32
                        })
                        .collect();
                    let n = rows.len();
                    let index = candle_core::Tensor::from_vec(rows, n, out.hidden.device())
                        .map_err(backend)?;
                    logits_rows = prism_model::profile::time(
                        "head rows + read back",
                        &device,
                        || -> prism_model::Result<Vec<Vec<f32>>> {
                            let hidden = out.hidden.index_select(&index, 0)?;
                            let rows = self
                                .decoder
                                .logits_for_rows(&hidden, self.format.letter_ids())?;
                            Ok(rows.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
                        },
                    )
                    .map_err(backend)?;
                }
            }
        }
        let mut rows = logits_rows
            .into_iter()
            .zip(branch_items.iter().map(|&(_, n)| n));
        let mut next_rows = next_rows.into_iter();
        let mut outputs = Vec::with_capacity(groups.len());
        for ((group, root), joined) in groups.iter().zip(roots).zip(&joined) {
            let state = match (group.want_state, root) {
                (true, Some(item)) if joined.is_some() => Some(
                    snapshots
                        .get_mut(item)
                        .and_then(Option::take)
                        .ok_or_else(|| {
                            ModelError::Backend("the decoder returned no evidence snapshot".into())
                        })?,
                ),
                (true, Some(item)) => Some(states[item].clone()),
                _ => None,
            };
            let logits = rows
                .by_ref()
                .take(group.branches.len())
                .map(|(row, letters)| row.into_iter().take(letters).map(f64::from).collect())
                .collect();
            let next_logits = if group.want_logits.is_some() {
                next_rows.next()
            } else {
                None
            };
            outputs.push(GroupOutput {
                state,
                logits,
                next_logits,
            });
        }
        Ok(outputs)
    }

    fn state_bytes(&self, state: &D::State) -> usize {
        self.decoder.state_bytes(state)
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        prism_model::device_memory(self.decoder.device())
    }

    fn vision_totals(&self) -> Option<(u64, f64)> {
        self.vision.as_ref()?;
        Some((
            self.vision_images.load(Ordering::Relaxed),
            self.vision_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        ))
    }
}

impl LetterModel for DecoderLetterModel {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        let tokenizing =
            prism_model::profile::Section::start("render + tokenize", self.decoder.device())
                .map_err(|e| ModelError::Backend(e.to_string()))?;
        // Encoded in parallel, checked in order (the first bad prompt is the one reported).
        let encoded: Vec<_> = {
            use rayon::prelude::*;
            let format = &self.format;
            prompts
                .par_iter()
                .map(|p| prompt_tokens(format, p))
                .collect()
        };
        let mut token_prompts = Vec::with_capacity(prompts.len());
        for (index, (prompt, ids)) in prompts.iter().zip(encoded).enumerate() {
            let n_letters = prompt.option_ids.len();
            if n_letters == 0 || n_letters > 26 {
                return Err(ModelError::Backend(format!(
                    "prompt {index} has {n_letters} options; the read-out takes 1 to 26"
                )));
            }
            let ids = ids.map_err(|e| ModelError::Backend(format!("prompt {index}: {e}")))?;
            if ids.len() > self.max_prompt_tokens {
                return Err(ModelError::PromptTooLong {
                    prompt: index,
                    tokens: ids.len(),
                    limit: self.max_prompt_tokens,
                });
            }
            token_prompts.push(ids);
        }
        tokenizing
            .stop()
            .map_err(|e| ModelError::Backend(e.to_string()))?;
        let refs: Vec<&[u32]> = token_prompts.iter().map(Vec::as_slice).collect();
        let rows = self
            .decoder
            .last_position_rows(&refs, self.format.letter_ids())
            .map_err(|e| ModelError::Backend(e.to_string()))?;
        let logits = rows
            .into_iter()
            .zip(prompts)
            .map(|(row, prompt)| {
                row.into_iter()
                    .take(prompt.option_ids.len())
                    .map(f64::from)
                    .collect()
            })
            .collect();
        // Usage counts every prompt's whole length, as a client would count it; that a shared evidence
        // prefix is computed once is the engine's saving, not the client's.
        let input_tokens = token_prompts.iter().map(|p| p.len() as u64).sum();
        Ok(LetterLogits {
            logits,
            input_tokens,
            output_tokens: 0,
        })
    }

    /// Decodes the thoughts together, each from its own prompt ([`super::thinking::think_alone`]).
    fn think(&mut self, thoughts: &[ThoughtRequest]) -> Result<Vec<ThoughtOutcome>, ModelError> {
        let encoder = self.format_encoder();
        let max_tokens = self.max_prompt_tokens;
        super::thinking::think_alone(self, &encoder, thoughts, max_tokens)
    }
}

/// The model's name for responses: the GGUF's `general.name`, else the file name without `.gguf`.
fn model_name(gguf: &GgufFile, path: &Path) -> String {
    if let Some(name) = gguf.get("general.name").and_then(|v| v.as_str()) {
        if !name.trim().is_empty() {
            return name.trim().to_string();
        }
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string())
}
