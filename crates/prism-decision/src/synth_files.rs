//! The tokenizer side of a synthetic Qwen3.5 model: the GGUF `tokenizer.ggml.*` keys and the model
//! directory's small files (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
//! `generation_config.json`, `decision_config.json`), rebuilt from the tiktoken rank file of the real
//! vocabulary the way llama.cpp's converter and Qwen's release lay them out.
//!
//! - BPE tokens are the ranks (ids 0..248,043), as byte-level text; the 33 added tokens follow at
//!   248,044.. ([`QWEN35_ADDED_TOKENS`], qwen35-reference §1.3): CONTROL (3) when special or shaped
//!   `<|…|>`, else USER_DEFINED (4), as the converter types them; the GGUF pads the list to the model's
//!   row count with `[PAD<id>]` tokens of type UNUSED (5), as the converter does.
//! - Merges are derived from the ranks ([`merges_from_ranks`]): for each token, tiktoken's BPE over its
//!   bytes with only the lower ranks; the two final parts are its merge. Tokens that do not end in two
//!   parts (232 in Qwen3.5) get none, so only a whole-piece lookup reaches them (see the tokenizer
//!   module on why the Qwen3.5 pipeline does none).
//! - `decision_config.json` lists the letter ids the tokenizer itself gives `A`..`Z` right after the
//!   thinking-off assistant prefix, checked again by loading the written directory.

use std::path::{Path, PathBuf};

use prism_gguf::MetadataValue;
use serde_json::{json, Map, Value};

use crate::chat_template::{PromptFormat, PromptFormatError};
use crate::config::{ConfigError, DecisionConfig, DECISION_CONFIG_FILE};
use crate::tokenizer::{
    bytes_to_text, GgufVocabulary, RankedVocabulary, QWEN35_SPLIT_REGEX, QWEN35_TOKENIZER_CLASS,
};

/// The GGUF's file name inside a model directory `prism synth` writes (and `prism bench` reads by
/// default).
pub const GGUF_NAME: &str = "model.gguf";

/// Qwen3.5's added tokens in id order (the first gets the id after the last BPE rank), with transformers'
/// `special` flag (`<tool_call>` … `</think>` are not special). Source: the tiny fixture's
/// `tokenizer.json`, made from Qwen's release (fixture README).
pub const QWEN35_ADDED_TOKENS: [(&str, bool); 33] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
    ("<|audio_start|>", true),
    ("<|audio_end|>", true),
    ("<tts_pad>", true),
    ("<tts_text_bos>", true),
    ("<tts_text_eod>", true),
    ("<tts_text_bos_single>", true),
    ("<|audio_pad|>", true),
];

/// GGUF token types (llama.cpp `llama_token_type`).
const TYPE_NORMAL: i64 = 1;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_UNUSED: i64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum SynthFilesError {
    #[error("the vocabulary has {tokens} tokens but the model has only {rows} rows")]
    TooFewRows { tokens: usize, rows: usize },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the written model directory does not load: {0}")]
    PromptFormat(#[from] PromptFormatError),
    #[error("the written decision config does not load: {0}")]
    DecisionConfig(#[from] ConfigError),
}

/// A merge list derived from ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct DerivedMerges {
    /// `"left right"` in the byte-level alphabet, in rank order of the merged token.
    pub merges: Vec<String>,
    /// Ranks (≥ 256) that no merge of two lower-ranked tokens builds.
    pub irregular: Vec<u32>,
}

/// The merge of each token from the lower ranks (see the module docs).
pub fn merges_from_ranks(ranks: &RankedVocabulary) -> DerivedMerges {
    let mut merges = Vec::with_capacity(ranks.len());
    let mut irregular = Vec::new();
    for rank in 256..ranks.len() as u32 {
        let Some(token) = ranks.bytes(rank) else {
            continue;
        };
        // Part boundaries as byte offsets; join the lowest-ranked adjacent pair below `rank` until none.
        let mut cuts: Vec<usize> = (0..=token.len()).collect();
        loop {
            let best = cuts
                .windows(3)
                .enumerate()
                .filter_map(|(i, w)| {
                    let r = ranks.rank(&token[w[0]..w[2]])?;
                    (r < rank).then_some((r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            cuts.remove(i + 1);
        }
        if let [0, middle, _] = cuts[..] {
            merges.push(format!(
                "{} {}",
                bytes_to_text(&token[..middle]),
                bytes_to_text(&token[middle..])
            ));
        } else {
            irregular.push(rank);
        }
    }
    DerivedMerges { merges, irregular }
}

/// The GGUF vocabulary of a Qwen3.5 model with `rows` output rows: the ranks, the added tokens, and
/// `[PAD<id>]` up to `rows`. EOS is `<|im_end|>`, padding `<|endoftext|>`, no BOS.
pub fn qwen35_vocabulary(
    ranks: &RankedVocabulary,
    rows: usize,
) -> Result<GgufVocabulary, SynthFilesError> {
    let n_tokens = ranks.len() + QWEN35_ADDED_TOKENS.len();
    if n_tokens > rows {
        return Err(SynthFilesError::TooFewRows {
            tokens: n_tokens,
            rows,
        });
    }
    let mut tokens = Vec::with_capacity(rows);
    let mut token_types = Vec::with_capacity(rows);
    for rank in 0..ranks.len() as u32 {
        tokens.push(ranks.bytes(rank).map(bytes_to_text).unwrap_or_default());
        token_types.push(TYPE_NORMAL);
    }
    let first_added = tokens.len() as u32;
    for (content, special) in QWEN35_ADDED_TOKENS {
        tokens.push(content.to_string());
        // llama.cpp's converter also makes a non-special token CONTROL when it looks special (`<|…|>`):
        // the tiny fixture's GGUF has `<|fim_prefix|>` as CONTROL and `<think>` as USER_DEFINED.
        let looks_special = content.starts_with("<|") && content.ends_with("|>");
        token_types.push(if special || looks_special {
            TYPE_CONTROL
        } else {
            TYPE_USER_DEFINED
        });
    }
    for id in tokens.len()..rows {
        tokens.push(format!("[PAD{id}]"));
        token_types.push(TYPE_UNUSED);
    }
    let added_id = |content: &str| {
        QWEN35_ADDED_TOKENS
            .iter()
            .position(|(c, _)| *c == content)
            .map(|i| first_added + i as u32)
    };
    Ok(GgufVocabulary {
        model: "gpt2".into(),
        pre: "qwen35".into(),
        tokens,
        token_types,
        merges: merges_from_ranks(ranks).merges,
        eos_token_id: added_id("<|im_end|>"),
        padding_token_id: added_id("<|endoftext|>"),
        add_bos_token: false,
    })
}

/// The `tokenizer.*` GGUF keys, in the converter's order.
pub fn gguf_tokenizer_metadata(
    vocab: &GgufVocabulary,
    chat_template: &str,
) -> Vec<(String, MetadataValue)> {
    let strings = |items: &[String]| {
        MetadataValue::Array(items.iter().cloned().map(MetadataValue::String).collect())
    };
    let mut m = vec![
        (
            GgufVocabulary::MODEL.to_string(),
            MetadataValue::String(vocab.model.clone()),
        ),
        (
            GgufVocabulary::PRE.to_string(),
            MetadataValue::String(vocab.pre.clone()),
        ),
        (GgufVocabulary::TOKENS.to_string(), strings(&vocab.tokens)),
        (
            GgufVocabulary::TOKEN_TYPE.to_string(),
            MetadataValue::Array(
                vocab
                    .token_types
                    .iter()
                    .map(|&t| MetadataValue::I32(t as i32))
                    .collect(),
            ),
        ),
        (GgufVocabulary::MERGES.to_string(), strings(&vocab.merges)),
    ];
    if let Some(id) = vocab.eos_token_id {
        m.push((GgufVocabulary::EOS.to_string(), MetadataValue::U32(id)));
    }
    if let Some(id) = vocab.padding_token_id {
        m.push((GgufVocabulary::PAD.to_string(), MetadataValue::U32(id)));
    }
    m.push((
        GgufVocabulary::ADD_BOS.to_string(),
        MetadataValue::Bool(vocab.add_bos_token),
    ));
    m.push((
        "tokenizer.ggml.add_eos_token".to_string(),
        MetadataValue::Bool(false),
    ));
    m.push((
        "tokenizer.chat_template".to_string(),
        MetadataValue::String(chat_template.to_string()),
    ));
    m
}

/// The added tokens of a GGUF vocabulary: `(id, content, special)`, with transformers' `special` flag
/// (the release's for Qwen3.5's tokens; otherwise CONTROL means special).
fn added_tokens(vocab: &GgufVocabulary) -> Vec<(usize, &str, bool)> {
    vocab
        .tokens
        .iter()
        .zip(&vocab.token_types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED)
        .map(|(id, (t, &ty))| {
            let release = QWEN35_ADDED_TOKENS
                .iter()
                .find(|(c, _)| c == t)
                .map(|(_, special)| *special);
            (id, t.as_str(), release.unwrap_or(ty == TYPE_CONTROL))
        })
        .collect()
}

fn token_text(vocab: &GgufVocabulary, id: Option<u32>) -> Value {
    id.and_then(|id| vocab.tokens.get(id as usize))
        .map_or(Value::Null, |t| Value::String(t.clone()))
}

/// `tokenizer.json` (HF `tokenizers`): ByteLevel BPE over the normal tokens with the merges, NFC, the
/// Qwen3.5 split, and the added tokens, laid out like Qwen's file.
pub fn tokenizer_json(vocab: &GgufVocabulary) -> Value {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let added: Vec<Value> = added_tokens(vocab)
        .into_iter()
        .map(|(id, content, special)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": special})
        })
        .collect();
    let mut bpe_vocab = Map::with_capacity(vocab.tokens.len());
    for (id, (token, &ty)) in vocab.tokens.iter().zip(&vocab.token_types).enumerate() {
        if ty == TYPE_NORMAL {
            bpe_vocab.insert(token.clone(), json!(id));
        }
    }
    let merges: Vec<Value> = vocab
        .merges
        .iter()
        .map(|m| {
            let (left, right) = m.split_once(' ').unwrap_or((m.as_str(), ""));
            json!([left, right])
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT_REGEX}, "behavior": "Isolated", "invert": false},
            byte_level.clone()
        ]},
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": bpe_vocab, "merges": merges
        }
    })
}

/// `tokenizer_config.json`: `Qwen3_5Tokenizer`, EOS `<|im_end|>`, pad `<|endoftext|>`, no BOS, the chat
/// template embedded.
pub fn tokenizer_config_json(
    vocab: &GgufVocabulary,
    chat_template: &str,
    model_max_length: usize,
) -> Value {
    let mut decoder = Map::new();
    for (id, content, special) in added_tokens(vocab) {
        decoder.insert(
            id.to_string(),
            json!({"content": content, "lstrip": false, "normalized": false, "rstrip": false,
                   "single_word": false, "special": special}),
        );
    }
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "eos_token": token_text(vocab, vocab.eos_token_id),
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": token_text(vocab, vocab.padding_token_id),
        "split_special_tokens": false,
        "tokenizer_class": QWEN35_TOKENIZER_CLASS,
        "unk_token": null
    })
}

/// `generation_config.json`: stop on `<|im_end|>` and `<|endoftext|>`.
pub fn generation_config_json(vocab: &GgufVocabulary) -> Value {
    let eos: Vec<u32> = [vocab.eos_token_id, vocab.padding_token_id]
        .into_iter()
        .flatten()
        .collect();
    json!({"do_sample": false, "eos_token_id": eos, "pad_token_id": vocab.padding_token_id})
}

/// The model directory's files, besides the GGUF.
#[derive(Debug, Clone)]
pub struct ModelDirFiles {
    /// The Hugging Face `config.json` of the decoder.
    pub hf_config: Value,
    pub chat_template: String,
    /// `model_max_length` of `tokenizer_config.json`.
    pub context_length: usize,
}

/// What [`write_model_dir`] wrote.
#[derive(Debug, Clone)]
pub struct WrittenModelDir {
    pub files: Vec<PathBuf>,
    /// The letter ids in `decision_config.json`.
    pub letter_token_ids: [u32; 26],
}

fn write_json(
    dir: &Path,
    name: &str,
    value: &Value,
    files: &mut Vec<PathBuf>,
) -> Result<(), SynthFilesError> {
    let path = dir.join(name);
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    std::fs::write(&path, text).map_err(|source| SynthFilesError::Write {
        path: path.clone(),
        source,
    })?;
    files.push(path);
    Ok(())
}

/// Writes `config.json`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
/// `chat_template.jinja` and `decision_config.json` into `dir` (which must exist). The letter ids come
/// from the written tokenizer and template; then the directory is loaded again as the engine loads it
/// and the decision config's ids are checked against it.
pub fn write_model_dir(
    dir: &Path,
    vocab: &GgufVocabulary,
    files_in: &ModelDirFiles,
) -> Result<WrittenModelDir, SynthFilesError> {
    let mut files = Vec::new();
    write_json(dir, "config.json", &files_in.hf_config, &mut files)?;
    write_json(
        dir,
        "generation_config.json",
        &generation_config_json(vocab),
        &mut files,
    )?;
    write_json(dir, "tokenizer.json", &tokenizer_json(vocab), &mut files)?;
    let tokenizer_config =
        tokenizer_config_json(vocab, &files_in.chat_template, files_in.context_length);
    write_json(dir, "tokenizer_config.json", &tokenizer_config, &mut files)?;
    let template_path = dir.join("chat_template.jinja");
    std::fs::write(&template_path, &files_in.chat_template).map_err(|source| {
        SynthFilesError::Write {
            path: template_path.clone(),
            source,
        }
    })?;
    files.push(template_path);

    let format = PromptFormat::load_from_model_dir(dir, None)?;
    let letter_token_ids = *format.letter_ids();
    let config = DecisionConfig {
        letter_token_ids: Some(letter_token_ids.to_vec()),
        ..DecisionConfig::default()
    };
    let config_json = serde_json::to_value(&config).unwrap_or(Value::Null);
    write_json(dir, DECISION_CONFIG_FILE, &config_json, &mut files)?;
    let read_back = DecisionConfig::from_model_dir(dir)?;
    format.check_letter_token_ids(read_back.letter_token_ids.as_deref().unwrap_or_default())?;
    Ok(WrittenModelDir {
        files,
        letter_token_ids,
    })
}
