//! The synthetic model's tokenizer files against the reference data:
//! - `qwen35-tiny/tokenizer.json` / `tokenizer_config.json` were made from the first 4,096 Qwen3.5 ranks
//!   with merges derived from the ranks (fixture README): rebuilding them from the same ranks must give
//!   the same vocabulary, merges, added tokens and pipeline;
//! - `qwen35-vocab/vocab_ref.json` (tiktoken over the full ranks): the full-size vocabulary, through the
//!   GGUF keys and through the written `tokenizer.json`, must give its ids;
//! - the letter ids in `decision_config.json` are the ranks of the bytes `A`..`Z` in the rank file.

use std::path::{Path, PathBuf};

use common::{ids_of, read_json, tiny_added_tokens};
use prism_decision::synth_files::{
    gguf_tokenizer_metadata, merges_from_ranks, qwen35_vocabulary, tokenizer_config_json,
    tokenizer_json, write_model_dir, ModelDirFiles, SynthFilesError, QWEN35_ADDED_TOKENS,
};
use prism_decision::tokenizer::{
    GgufVocabulary, PromptTokenizer, RankedVocabulary, TokenizerJsonPipeline, WholePieceLookup,
};
use prism_decision::DecisionConfig;
use serde_json::json;

mod common;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn full_ranks() -> RankedVocabulary {
    let path = fixtures().join("qwen35-vocab/qwen3_6.tiktoken");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    RankedVocabulary::parse_tiktoken(&text).unwrap()
}

fn first_ranks(ranks: &RankedVocabulary, n: usize) -> RankedVocabulary {
    let tokens = (0..n as u32)
        .map(|r| ranks.bytes(r).unwrap().to_vec())
        .collect();
    RankedVocabulary::from_tokens_in_rank_order(tokens).unwrap()
}

fn chat_template() -> String {
    std::fs::read_to_string(fixtures().join("qwen35-tiny/chat_template.jinja")).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tiny_fixture_tokenizer_files_are_rebuilt_from_its_ranks() {
    let ranks = first_ranks(&full_ranks(), 4096);
    let vocab = qwen35_vocabulary(&ranks, 4129).unwrap();
    let theirs = read_json(&fixtures().join("qwen35-tiny/tokenizer.json"));
    let ours = tokenizer_json(&vocab);
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "model",
    ] {
        assert_eq!(ours[key], theirs[key], "tokenizer.json {key}");
    }
    assert_eq!(theirs["model"]["merges"].as_array().unwrap().len(), 3840);

    // tokenizer_config.json: the same keys and values (the chat template included).
    let theirs = read_json(&fixtures().join("qwen35-tiny/tokenizer_config.json"));
    let ours = tokenizer_config_json(&vocab, &chat_template(), 262_144);
    assert_eq!(ours, theirs);

    // The GGUF keys: the tiny GGUF's tokenizer keys, read back the same way, are equal to ours.
    let gguf = prism_gguf::GgufFile::open(fixtures().join("qwen35-tiny/tiny-Q8_0.gguf")).unwrap();
    let from_file = GgufVocabulary::from_gguf(&gguf).unwrap();
    fn first_difference<T: PartialEq + std::fmt::Debug>(what: &str, ours: &[T], theirs: &[T]) {
        assert_eq!(ours.len(), theirs.len(), "{what}: length");
        if let Some(i) = (0..ours.len()).find(|&i| ours[i] != theirs[i]) {
            panic!(
                "{what}[{i}]: ours {:?}, the file's {:?}",
                ours[i], theirs[i]
            );
        }
    }
    first_difference("tokens", &vocab.tokens, &from_file.tokens);
    first_difference("token_type", &vocab.token_types, &from_file.token_types);
    first_difference("merges", &vocab.merges, &from_file.merges);
    assert_eq!(
        (
            &vocab.model,
            &vocab.pre,
            vocab.eos_token_id,
            vocab.padding_token_id,
            vocab.add_bos_token
        ),
        (
            &from_file.model,
            &from_file.pre,
            from_file.eos_token_id,
            from_file.padding_token_id,
            from_file.add_bos_token
        )
    );
    let keys = gguf_tokenizer_metadata(&vocab, &chat_template());
    for (key, value) in &keys {
        assert_eq!(gguf.get(key), Some(value), "GGUF key {key}");
    }
}

#[test]
fn added_tokens_are_the_release_tokens() {
    // The tiny fixture's added tokens are the 33 real ones renumbered; vocab_ref.json has their real ids.
    let theirs = tiny_added_tokens();
    let ours: Vec<(String, bool)> = QWEN35_ADDED_TOKENS
        .iter()
        .map(|(c, s)| (c.to_string(), *s))
        .collect();
    assert_eq!(ours, theirs);
    let reference = read_json(&fixtures().join("qwen35-vocab/vocab_ref.json"));
    let ids: Vec<(u64, String)> = reference["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["id"].as_u64().unwrap(),
                t["content"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let vocab = qwen35_vocabulary(&full_ranks(), 248_320).unwrap();
    for (id, content) in ids {
        assert_eq!(vocab.tokens[id as usize], content);
    }
}

#[test]
fn full_vocabulary_encodes_like_tiktoken_through_gguf_keys_and_tokenizer_json() {
    let ranks = full_ranks();
    let derived = merges_from_ranks(&ranks);
    assert_eq!(
        derived.irregular.len(),
        232,
        "fixture README: 232 tokens are not a merge of two lower ranks"
    );
    let vocab = qwen35_vocabulary(&ranks, 248_320).unwrap();
    assert_eq!(vocab.tokens.len(), 248_320);
    assert_eq!(
        (vocab.eos_token_id, vocab.padding_token_id),
        (Some(248_046), Some(248_044))
    );
    assert_eq!(vocab.tokens[248_077], "[PAD248077]");
    assert_eq!(vocab.token_types[248_077], 5);
    assert_eq!(vocab.tokens[248_068], "<think>");
    assert_eq!(
        vocab.token_types[248_068], 4,
        "<think> is not special: USER_DEFINED"
    );
    assert_eq!(
        vocab.token_types[248_046], 3,
        "<|im_end|> is special: CONTROL"
    );
    assert_eq!(
        vocab.token_types[248_060], 3,
        "<|fim_prefix|> looks special: CONTROL"
    );

    let keys = gguf_tokenizer_metadata(&vocab, "template");
    let read_back =
        GgufVocabulary::from_metadata(|key| keys.iter().find(|(k, _)| k == key).map(|(_, v)| v))
            .unwrap();
    assert_eq!(read_back, vocab);
    let from_gguf = PromptTokenizer::from_gguf_vocabulary(&read_back).unwrap();
    let json_bytes = serde_json::to_vec(&tokenizer_json(&vocab)).unwrap();
    let from_json = PromptTokenizer::from_tokenizer_json_bytes(
        &json_bytes,
        Path::new("tokenizer.json"),
        TokenizerJsonPipeline::Qwen35,
    )
    .unwrap();
    assert_eq!(from_json.whole_piece_lookup(), WholePieceLookup::Off);
    let reference = read_json(&fixtures().join("qwen35-vocab/vocab_ref.json"));
    let pairs = reference["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 100);
    for pair in pairs {
        let text = pair["text"].as_str().unwrap();
        let ids = ids_of(&pair["ids"]);
        assert_eq!(from_gguf.encode(text).unwrap(), ids, "GGUF keys: {text:?}");
        assert_eq!(
            from_json.encode(text).unwrap(),
            ids,
            "tokenizer.json: {text:?}"
        );
    }
}

#[test]
fn model_dir_letter_ids_are_the_letter_bytes() {
    let ranks = full_ranks();
    let vocab = qwen35_vocabulary(&ranks, 248_320).unwrap();
    let dir = scratch("synth_files_model_dir");
    let files = ModelDirFiles {
        hf_config: json!({"model_type": "qwen3_5_text", "vocab_size": 248_320}),
        chat_template: chat_template(),
        context_length: 262_144,
    };
    let written = write_model_dir(&dir, &vocab, &files).unwrap();
    let expected: Vec<u32> = ('A'..='Z')
        .map(|c| ranks.rank(&[c as u8]).unwrap())
        .collect();
    assert_eq!(written.letter_token_ids.to_vec(), expected);
    let config = DecisionConfig::from_model_dir(&dir).unwrap();
    assert_eq!(config.letter_token_ids, Some(expected));
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "decision_config.json",
    ] {
        assert!(written.files.contains(&dir.join(name)), "{name}");
    }
    assert_eq!(
        read_json(&dir.join("generation_config.json"))["eos_token_id"],
        json!([248_046, 248_044])
    );
}

#[test]
fn too_small_models_are_typed_errors() {
    let ranks = first_ranks(&full_ranks(), 300);
    assert!(matches!(
        qwen35_vocabulary(&ranks, 300),
        Err(SynthFilesError::TooFewRows {
            tokens: 333,
            rows: 300
        })
    ));
}
