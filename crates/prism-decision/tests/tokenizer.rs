//! Tokenizer tests against reference data made by tools nobody here wrote:
//! - `qwen35-tiny/tokenizer.json` (HF tokenizers) and the tiny GGUFs' vocabulary (llama.cpp's
//!   converter) must give identical ids;
//! - `qwen35-tiny/prompts.json` ids (transformers 5.24.0);
//! - `qwen35-vocab/vocab_ref.json` (tiktoken 0.14.0 over the full Qwen3.5 ranks).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use common::{ids_of, read_json, tiny_added_tokens};
use prism_decision::tokenizer::{
    bytes_to_text, shared_cut, split_points, text_to_bytes, AddedTokenSpec, GgufVocabulary,
    PromptTokenizer, RankListProblem, RankedVocabulary, TokenizerError, TokenizerJsonPipeline,
    TokenizerSource, WholePieceLookup, PIECEWISE_BYTES, QWEN35_SPLIT_REGEX,
};
use prism_gguf::{GgufFile, MetadataValue};
use serde_json::Value;

mod common;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn tiny_dir() -> PathBuf {
    fixtures().join("qwen35-tiny")
}

/// (text, ids, nfc_changes_text) from vocab_ref.json. Its first 59 texts are make_tiny.py's
/// TEST_STRINGS (per its README; checked when the fixture was copied).
fn vocab_ref_pairs() -> Vec<(String, Vec<u32>, bool)> {
    let v = read_json(&fixtures().join("qwen35-vocab/vocab_ref.json"));
    v["pairs"]
        .as_array()
        .expect("pairs")
        .iter()
        .map(|p| {
            (
                p["text"].as_str().expect("text").to_string(),
                ids_of(&p["ids"]),
                p["nfc_changes_text"].as_bool().expect("nfc flag"),
            )
        })
        .collect()
}

/// The 15 rendered prompt texts of prompts.json with their transformers ids.
fn prompt_texts() -> Vec<(String, Vec<u32>)> {
    let v = read_json(&tiny_dir().join("prompts.json"));
    let mut out = Vec::new();
    for key in ["prompts", "thinking_prompts"] {
        for p in v[key].as_array().expect("prompt list") {
            out.push((
                p["text"].as_str().expect("text").to_string(),
                ids_of(&p["ids"]),
            ));
        }
    }
    assert_eq!(out.len(), 15);
    out
}

/// xorshift64* from `state` (made odd): a deterministic stream of numbers for the random texts.
fn xorshift(state: u64) -> impl FnMut() -> u64 {
    let mut state = state | 1;
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Deterministic random strings mixing scripts, whitespace runs, digits, emoji, combining marks,
/// NFD sequences, contractions and special tokens (whole and broken).
fn random_strings(count: usize, seed: u64) -> Vec<String> {
    const PIECES: &[&str] = &[
        "the",
        "The",
        " quick",
        "fox",
        "Decision",
        "option",
        " A",
        "B)",
        "C:",
        "x",
        "Z",
        "'s",
        "'T",
        "'re",
        "'VE",
        "'ll",
        "'D",
        "'m",
        "'",
        "\"",
        "don't",
        " ",
        "  ",
        "    ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        "\r",
        " \n ",
        "\u{a0}",
        "\u{3000}",
        "\u{2003}",
        "\u{200b}",
        "0",
        "7",
        "42",
        "2026",
        "3.14159",
        "-1e-9",
        "1,000",
        "١٢٣",
        "٣",
        "中",
        "文字",
        "漢字",
        "かな",
        "カタカナ",
        "한국어",
        "你好，世界。",
        "。",
        "，",
        "Привет",
        "ёж",
        "Γειά",
        "αβγ",
        "مرحبا",
        "שלום",
        "हिन्दी",
        "क्ष",
        "ภาษาไทย",
        "Qərar",
        "\u{301}",
        "\u{308}",
        "\u{93f}",
        "\u{94d}",
        "\u{e34}",
        "e\u{301}",
        "A\u{30a}",
        "é",
        "ñ",
        "ﬁ",
        "Ａ",
        "🙂",
        "🚀",
        "👩\u{200d}💻",
        "🏳\u{fe0f}\u{200d}🌈",
        "\u{200d}",
        "\u{fe0f}",
        "😀😀",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<tool_call>",
        "</tool_response>",
        "<|fim_prefix|>",
        "<|im_st",
        "<|",
        "|>",
        "<think",
        "think>",
        "< think>",
        "{",
        "}",
        "[",
        "]",
        "\":",
        "=>",
        "->",
        "::",
        "//",
        "#",
        "**",
        "___",
        "...",
        "!!!",
        "?",
        "https://x.org/a?b=1",
        "user@example.org",
        "$100",
        "€",
        "£",
        "¥",
        "%",
        "∑",
        "≤",
    ];
    let mut next = xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let n = 1 + (next() % 14) as usize;
        let mut s = String::new();
        for _ in 0..n {
            match next() % 10 {
                // A random code point now and then (any plane, no surrogates).
                0 => {
                    let ranges: [(u32, u32); 5] = [
                        (0x20, 0x7f),
                        (0xa0, 0x2fff),
                        (0x3000, 0xd7ff),
                        (0xe000, 0xffff),
                        (0x1_0000, 0x2_ffff),
                    ];
                    let (lo, hi) = ranges[(next() % 5) as usize];
                    if let Some(c) = char::from_u32(lo + (next() % u64::from(hi - lo)) as u32) {
                        s.push(c);
                    }
                }
                // A run of one character.
                1 => {
                    let c = [' ', '\n', 'a', '=', '-', '0', '中', '\t'][(next() % 8) as usize];
                    let len = 1 + (next() % 40) as usize;
                    s.extend(std::iter::repeat_n(c, len));
                }
                _ => s.push_str(PIECES[(next() % PIECES.len() as u64) as usize]),
            }
        }
        out.push(s);
    }
    out
}

/// Asserts that `tok` encodes with its direct encoder and that the direct encoder's ids are the
/// `tokenizers` pipeline's on the fixtures' texts, edge cases and `random` random strings.
fn assert_direct_equals_reference(tok: &PromptTokenizer, random: usize, seed: u64) {
    assert!(tok.encodes_directly(), "{tok:?}");
    let mut texts: Vec<String> = vec![
        String::new(),
        " ".into(),
        "<|im_start|>".into(),
        "<|im_start|><|im_end|><think></think>".into(),
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n".into(),
        "a".repeat(3000),
        " ".repeat(257) + "x",
        "\n".repeat(40) + "end",
        "e\u{301}\u{301}\u{308}a\u{30a}".into(),
        "한\u{1100}\u{1161}\u{11a8}".into(),
    ];
    texts.extend(prompt_texts().into_iter().map(|(t, _)| t));
    texts.extend(vocab_ref_pairs().into_iter().map(|(t, _, _)| t));
    texts.extend(random_strings(random, seed));
    texts.extend(ascii_strings(random, seed));
    let mut tokens = 0;
    for text in &texts {
        let direct = tok.encode_in_one_piece(text).unwrap();
        let reference = tok.encode_reference(text).unwrap();
        assert_eq!(direct, reference, "{text:?}");
        tokens += direct.len();
    }
    assert!(tokens > 10 * texts.len(), "{tokens} tokens");
}

/// Deterministic random ASCII strings (the direct encoder splits ASCII text itself): bytes from every
/// class the split regex tells apart — letters (in contractions too, either case), digits, each
/// space (tab, line feed, vertical tab, form feed, carriage return, space), other symbols and
/// control bytes — and now and then an added token.
fn ascii_strings(count: usize, seed: u64) -> Vec<String> {
    const BYTES: &[u8] = b"aaxxZQsStTrReEvVlLmMdD'''09   \t\n\n\r\x0b\x0c\x1c\x7f\x00.,!?-_\"#<>|";
    const ADDED: &[&str] = &["<|im_start|>", "<|im_end|>", "<think>", "</think>"];
    let mut next = xorshift(seed.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (0..count)
        .map(|_| {
            let len = 1 + (next() % 40) as usize;
            let mut s = String::new();
            for _ in 0..len {
                if next() % 40 == 0 {
                    s.push_str(ADDED[(next() % ADDED.len() as u64) as usize]);
                } else {
                    s.push(BYTES[(next() % BYTES.len() as u64) as usize] as char);
                }
            }
            s
        })
        .collect()
}

#[test]
fn the_direct_encoder_gives_the_tokenizers_pipelines_ids() {
    assert_direct_equals_reference(&tiny_json_tokenizer(), 3000, 11);
    assert_direct_equals_reference(
        &PromptTokenizer::from_gguf(&tiny_gguf("tiny-Q8_0.gguf")).unwrap(),
        3000,
        12,
    );
    // A file used as written keeps the `tokenizers` pipeline (its steps may be anything).
    let as_written = PromptTokenizer::from_tokenizer_json(
        &tiny_dir().join("tokenizer.json"),
        TokenizerJsonPipeline::AsWritten,
    )
    .unwrap();
    assert!(!as_written.encodes_directly());
}

fn tiny_json_tokenizer() -> PromptTokenizer {
    PromptTokenizer::from_model_dir(&tiny_dir()).expect("tiny tokenizer.json")
}

#[test]
fn split_regex_is_the_fixtures_regex() {
    let vocab_ref = read_json(&fixtures().join("qwen35-vocab/vocab_ref.json"));
    assert_eq!(
        vocab_ref["pretokenizer_regex"].as_str(),
        Some(QWEN35_SPLIT_REGEX)
    );
    let tj = read_json(&tiny_dir().join("tokenizer.json"));
    assert_eq!(
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].as_str(),
        Some(QWEN35_SPLIT_REGEX)
    );
}

#[test]
fn tokenizer_json_reproduces_transformers_prompt_ids() {
    let tok = tiny_json_tokenizer();
    assert_eq!(
        tok.source(),
        &TokenizerSource::TokenizerJson {
            path: tiny_dir().join("tokenizer.json"),
            pipeline: TokenizerJsonPipeline::Qwen35
        }
    );
    assert_eq!(tok.whole_piece_lookup(), WholePieceLookup::Off);
    for (text, ids) in prompt_texts() {
        assert_eq!(tok.encode(&text).unwrap(), ids, "prompt {text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // The file as written is the same pipeline for this fixture.
    let as_written = PromptTokenizer::from_tokenizer_json(
        &tiny_dir().join("tokenizer.json"),
        TokenizerJsonPipeline::AsWritten,
    )
    .unwrap();
    for (text, ids) in prompt_texts() {
        assert_eq!(as_written.encode(&text).unwrap(), ids);
    }
}

#[test]
fn special_ids_and_eos_set_of_the_tiny_tokenizer() {
    // README "special ids": endoftext 4096, im_start 4097, im_end 4098, think 4120, /think 4121;
    // the vision tokens follow Qwen's order (248053.. in the real vocabulary, 4096 + 9.. here).
    let tok = tiny_json_tokenizer();
    let s = tok.special_tokens();
    assert_eq!(
        (s.endoftext, s.im_start, s.im_end, s.think, s.end_think),
        (Some(4096), Some(4097), Some(4098), Some(4120), Some(4121))
    );
    assert_eq!(
        (
            s.vision_start,
            s.vision_end,
            s.vision_pad,
            s.image_pad,
            s.video_pad
        ),
        (Some(4105), Some(4106), Some(4107), Some(4108), Some(4109))
    );
    // <|im_end|> and <|endoftext|> always; tokenizer_config.json's eos is <|im_end|>.
    assert_eq!(tok.eos_ids(), &[4096, 4098]);
    assert_eq!(tok.vocab_size(), 4129);
    assert_eq!(
        tok.encode("<|im_start|><think></think><|image_pad|>")
            .unwrap(),
        vec![4097, 4120, 4121, 4108]
    );
    // Special tokens are skipped on request, non-special added tokens (<think>) are not.
    assert_eq!(
        tok.decode(&[4097, 4120, 4121, 4098], true).unwrap(),
        "<think></think>"
    );
}

fn tiny_gguf(name: &str) -> GgufFile {
    GgufFile::open(tiny_dir().join(name)).expect("tiny gguf")
}

#[test]
fn gguf_vocabulary_gives_the_same_ids_as_tokenizer_json() {
    let json_tok = tiny_json_tokenizer();
    let gguf = tiny_gguf("tiny-BF16.gguf");
    let vocab = GgufVocabulary::from_gguf(&gguf).unwrap();
    assert_eq!(
        (vocab.model.as_str(), vocab.pre.as_str()),
        ("gpt2", "qwen35")
    );
    assert_eq!((vocab.tokens.len(), vocab.merges.len()), (4129, 3840));
    assert_eq!(
        (
            vocab.eos_token_id,
            vocab.padding_token_id,
            vocab.add_bos_token
        ),
        (Some(4098), Some(4096), false)
    );
    // The quantized files carry the same vocabulary.
    for other in ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"] {
        assert_eq!(
            GgufVocabulary::from_gguf(&tiny_gguf(other)).unwrap(),
            vocab,
            "{other}"
        );
    }

    let started = Instant::now();
    let gguf_tok = PromptTokenizer::from_gguf(&gguf).unwrap();
    eprintln!("tiny GGUF vocabulary → tokenizer: {:?}", started.elapsed());
    assert_eq!(gguf_tok.source(), &TokenizerSource::GgufVocabulary);
    assert_eq!(gguf_tok.whole_piece_lookup(), WholePieceLookup::Off);
    assert_eq!(gguf_tok.special_tokens(), json_tok.special_tokens());
    assert_eq!(gguf_tok.eos_ids(), &[4096, 4098]);
    assert_eq!(gguf_tok.vocab_size(), json_tok.vocab_size());

    let mut checked = 0;
    for (text, ids, _) in vocab_ref_pairs().iter().take(59) {
        let expected = json_tok.encode(text).unwrap();
        assert_eq!(
            gguf_tok.encode(text).unwrap(),
            expected,
            "TEST_STRINGS entry {text:?}"
        );
        checked += 1;
        // Same ranks as the full vocabulary wherever the text needs no token above rank 4095.
        if ids.iter().all(|&id| id < 4096) {
            assert_eq!(&expected, ids, "{text:?}");
        }
    }
    for (text, ids) in prompt_texts() {
        assert_eq!(gguf_tok.encode(&text).unwrap(), ids, "prompt {text:?}");
        checked += 1;
    }
    for text in random_strings(3000, 1) {
        let expected = json_tok.encode(&text).unwrap();
        assert_eq!(
            gguf_tok.encode(&text).unwrap(),
            expected,
            "random string {text:?}"
        );
        assert_eq!(
            gguf_tok.decode(&expected, false).unwrap(),
            json_tok.decode(&expected, false).unwrap()
        );
        checked += 1;
    }
    assert_eq!(checked, 59 + 15 + 3000);
}

/// The added tokens of vocab_ref.json, with the special flags of the tiny tokenizer.json (the
/// same 33 tokens in the same order, renumbered).
fn full_added_tokens() -> Vec<AddedTokenSpec> {
    let vocab_ref = read_json(&fixtures().join("qwen35-vocab/vocab_ref.json"));
    let special: HashMap<String, bool> = tiny_added_tokens().into_iter().collect();
    let added: Vec<AddedTokenSpec> = vocab_ref["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let content = t["content"].as_str().unwrap().to_string();
            AddedTokenSpec {
                id: t["id"].as_u64().unwrap() as u32,
                special: special[&content],
                content,
            }
        })
        .collect();
    assert_eq!(added.len(), 33);
    added
}

#[test]
fn tiktoken_ranks_reproduce_every_vocab_ref_pair() {
    let path = fixtures().join("qwen35-vocab/qwen3_6.tiktoken");
    let started = Instant::now();
    let tok = PromptTokenizer::from_tiktoken_file(&path, &full_added_tokens()).unwrap();
    let load = started.elapsed();
    eprintln!("full tiktoken vocabulary (248,044 ranks + 33 added) → tokenizer: {load:?}");
    assert!(load.as_secs() < 30, "loading took {load:?}");
    assert_eq!(tok.vocab_size(), 248_077);
    assert_eq!(tok.whole_piece_lookup(), WholePieceLookup::On);
    // qwen35-reference §1.3 ids.
    let s = tok.special_tokens();
    assert_eq!(
        (
            s.endoftext,
            s.im_start,
            s.im_end,
            s.think,
            s.end_think,
            s.vision_start,
            s.image_pad
        ),
        (
            Some(248044),
            Some(248045),
            Some(248046),
            Some(248068),
            Some(248069),
            Some(248053),
            Some(248056)
        )
    );

    let pairs = vocab_ref_pairs();
    assert_eq!(pairs.len(), 100);
    let mut agree = 0;
    for (text, ids, nfc_changes_text) in &pairs {
        let got = tok.encode(text).unwrap();
        assert_eq!(&got, ids, "{text:?}");
        agree += 1;
        if !nfc_changes_text {
            assert_eq!(&tok.decode(&got, false).unwrap(), text);
        }
    }
    assert_eq!(agree, 100);

    // README: 104328 `俱乐部` is no merge of two tokens; tiktoken reaches it only as a whole piece.
    assert_eq!(tok.encode("俱乐部").unwrap(), vec![104328]);
    let prefixed = tok.encode("x俱乐部").unwrap();
    assert_eq!(prefixed.len(), 4, "x|俱|乐|部");
    assert!(!prefixed.contains(&104328));
    assert_eq!(tok.decode(&prefixed, false).unwrap(), "x俱乐部");
    // README: 99655 `人力资源` = 人力 (108583) + 资源 (96852), a part ranked after the whole.
    assert_eq!(tok.encode("人力资源").unwrap(), vec![99655]);
    assert_direct_equals_reference(&tok, 3000, 13);
}

/// The merge list a converter derives from ranks: for each token (in rank order), tiktoken's BPE
/// over its bytes with only the lower ranks; the two final parts are its merge. Tokens that do not
/// end in two parts get none (the README's 232 irregular tokens).
fn merges_derived_from_ranks(vocab: &RankedVocabulary) -> (Vec<String>, usize) {
    let mut merges = Vec::new();
    let mut irregular = 0;
    for rank in 256..vocab.len() as u32 {
        let token = vocab.bytes(rank).unwrap();
        // Part boundaries as byte offsets; join the lowest-ranked pair below `rank` until none.
        let mut cuts: Vec<usize> = (0..=token.len()).collect();
        loop {
            let best = (0..cuts.len().saturating_sub(2))
                .filter_map(|i| {
                    let r = vocab.rank(&token[cuts[i]..cuts[i + 2]])?;
                    (r < rank).then_some((r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            cuts.remove(i + 1);
        }
        if cuts.len() == 3 {
            merges.push(format!(
                "{} {}",
                bytes_to_text(&token[..cuts[1]]),
                bytes_to_text(&token[cuts[1]..])
            ));
        } else {
            irregular += 1;
        }
    }
    (merges, irregular)
}

#[test]
fn gguf_path_at_full_size_is_merges_only() {
    // A full-size GGUF vocabulary (248,044 BPE tokens + 33 added) with the merge list derived from
    // the ranks, through the GGUF path: it must load quickly, agree with tiktoken wherever no
    // irregular token is involved (all 100 vocab_ref pairs), and NOT produce tokens that only a
    // whole-piece lookup reaches (the README's examples).
    let path = fixtures().join("qwen35-vocab/qwen3_6.tiktoken");
    let text = std::fs::read_to_string(&path).unwrap();
    let ranks = RankedVocabulary::parse_tiktoken(&text).unwrap();
    let (merges, irregular) = merges_derived_from_ranks(&ranks);
    assert_eq!(
        irregular, 232,
        "README: 232 tokens are not a merge of two lower ranks"
    );
    assert_eq!(merges.len() + irregular, 248_044 - 256);
    let added = full_added_tokens();
    let mut tokens: Vec<String> = (0..ranks.len() as u32)
        .map(|r| bytes_to_text(ranks.bytes(r).unwrap()))
        .collect();
    let mut token_types = vec![1i64; tokens.len()];
    for t in &added {
        assert_eq!(t.id as usize, tokens.len());
        tokens.push(t.content.clone());
        token_types.push(if t.special { 3 } else { 4 });
    }
    let vocab = GgufVocabulary {
        model: "gpt2".into(),
        pre: "qwen35".into(),
        tokens,
        token_types,
        merges,
        eos_token_id: Some(248046),
        padding_token_id: Some(248044),
        add_bos_token: false,
    };
    let started = Instant::now();
    let gguf_tok = PromptTokenizer::from_gguf_vocabulary(&vocab).unwrap();
    let load = started.elapsed();
    eprintln!(
        "full-size GGUF vocabulary (248,077 tokens, {} merges) → tokenizer: {load:?}",
        vocab.merges.len()
    );
    assert!(load.as_secs() < 30, "loading took {load:?}");
    assert_eq!(gguf_tok.whole_piece_lookup(), WholePieceLookup::Off);
    assert_eq!(gguf_tok.eos_ids(), &[248044, 248046]);

    for (text, ids, _) in vocab_ref_pairs() {
        assert_eq!(gguf_tok.encode(&text).unwrap(), ids, "{text:?}");
    }
    // README: 104328 `俱乐部` has no two-token split; 99655 `人力资源` = 人力 (108583) + 资源 (96852)
    // with a part ranked after the whole. Merges only never build them; tiktoken does, as a whole.
    let split = gguf_tok.encode("俱乐部").unwrap();
    assert_eq!(split.len(), 3);
    assert_eq!(gguf_tok.decode(&split, false).unwrap(), "俱乐部");
    assert_eq!(gguf_tok.encode("人力资源").unwrap(), vec![108583, 96852]);
    assert_direct_equals_reference(&gguf_tok, 3000, 14);
}

#[test]
fn ranked_bpe_over_the_tiny_ranks_matches_tokenizer_json() {
    // The tiny vocabulary is ranks 0..4095 of the real one (ids = ranks) and every token is a
    // merge of two lower ranks, so tiktoken's algorithm must agree with the merge list here.
    let json_tok = tiny_json_tokenizer();
    let tj = read_json(&tiny_dir().join("tokenizer.json"));
    let vocab = tj["model"]["vocab"].as_object().unwrap();
    let mut by_rank = vec![Vec::new(); vocab.len()];
    for (token, id) in vocab {
        by_rank[id.as_u64().unwrap() as usize] = text_to_bytes(token).expect("byte-level token");
    }
    let added: Vec<AddedTokenSpec> = tj["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| AddedTokenSpec {
            id: t["id"].as_u64().unwrap() as u32,
            content: t["content"].as_str().unwrap().to_string(),
            special: t["special"].as_bool().unwrap(),
        })
        .collect();
    let ranked = RankedVocabulary::from_tokens_in_rank_order(by_rank).unwrap();
    let tok = PromptTokenizer::from_ranked_vocabulary(ranked, &added, None).unwrap();
    assert_eq!(tok.special_tokens(), json_tok.special_tokens());
    for (text, ids) in prompt_texts() {
        assert_eq!(tok.encode(&text).unwrap(), ids);
    }
    for (text, _, _) in vocab_ref_pairs() {
        assert_eq!(
            tok.encode(&text).unwrap(),
            json_tok.encode(&text).unwrap(),
            "{text:?}"
        );
    }
    for text in random_strings(3000, 2) {
        assert_eq!(
            tok.encode(&text).unwrap(),
            json_tok.encode(&text).unwrap(),
            "{text:?}"
        );
    }
}

// --- whole-piece lookup: the behaviour each source has, on a vocabulary where it matters ---

/// Token i < 256 is byte i; then "ab" (256, merge a+b), "abc" (257, no merge builds it but it
/// splits into the tokens "ab" + "c") and "pqr" (258, no split into two tokens at all).
fn whole_piece_vocabulary() -> (Vec<String>, Vec<String>) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| bytes_to_text(&[b])).collect();
    tokens.extend(["ab", "abc", "pqr"].map(String::from));
    (tokens, vec!["a b".into()])
}

fn crafted_gguf_vocabulary(tokens: Vec<String>, merges: Vec<String>) -> GgufVocabulary {
    let mut tokens = tokens;
    let mut token_types = vec![1i64; tokens.len()];
    tokens.extend(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
        ]
        .map(String::from),
    );
    token_types.extend([3, 3, 3, 4, 4]);
    GgufVocabulary {
        model: "gpt2".into(),
        pre: "qwen35".into(),
        eos_token_id: Some(tokens.len() as u32 - 3),
        padding_token_id: None,
        add_bos_token: false,
        tokens,
        token_types,
        merges,
    }
}

fn crafted_tokenizer_json(tokens: &[String], merges: &[String], ignore_merges: bool) -> Vec<u8> {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), Value::from(i)))
        .collect();
    let level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0",
        "added_tokens": [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT_REGEX}, "behavior": "Isolated", "invert": false},
            level.clone()]},
        "post_processor": level.clone(),
        "decoder": level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}
    }))
    .unwrap()
}

#[test]
fn whole_piece_lookup_is_explicit_per_source() {
    let (tokens, merges) = whole_piece_vocabulary();
    let (ab, abc, pqr) = (256u32, 257u32, 258u32);
    let byte = |c: char| c as u32;
    let (a, c, p, q, r, x) = (
        byte('a'),
        byte('c'),
        byte('p'),
        byte('q'),
        byte('r'),
        byte('x'),
    );

    // GGUF vocabulary (qwen35): merges only, like transformers' Qwen3_5Tokenizer and llama.cpp.
    let gguf_tok = PromptTokenizer::from_gguf_vocabulary(&crafted_gguf_vocabulary(
        tokens.clone(),
        merges.clone(),
    ))
    .unwrap();
    assert_eq!(gguf_tok.whole_piece_lookup(), WholePieceLookup::Off);
    assert_eq!(gguf_tok.encode("abc").unwrap(), vec![ab, c]);
    assert_eq!(gguf_tok.encode("pqr").unwrap(), vec![p, q, r]);
    assert_eq!(gguf_tok.encode("xabc").unwrap(), vec![x, ab, c]);

    // tiktoken ranks: a whole piece that is a token is that token; inside a longer piece a token
    // is reached when two adjacent parts concatenate to it ("ab" + "c"), never otherwise ("pqr").
    let ranked = RankedVocabulary::from_tokens_in_rank_order(
        tokens.iter().map(|t| text_to_bytes(t).unwrap()).collect(),
    )
    .unwrap();
    let tik = PromptTokenizer::from_ranked_vocabulary(ranked, &[], None).unwrap();
    assert_eq!(tik.whole_piece_lookup(), WholePieceLookup::On);
    assert_eq!(tik.encode("abc").unwrap(), vec![abc]);
    assert_eq!(tik.encode("pqr").unwrap(), vec![pqr]);
    assert_eq!(tik.encode("xabc").unwrap(), vec![x, abc]);
    assert_eq!(tik.encode("xpqr").unwrap(), vec![x, p, q, r]);
    assert_eq!(tik.encode("a").unwrap(), vec![a]);

    // tokenizer.json with ignore_merges: true: honoured as written (whole pieces only, then the
    // merge list), replaced by merges only under the Qwen3.5 pipeline, as transformers does.
    let json = crafted_tokenizer_json(&tokens, &merges, true);
    let path = Path::new("crafted/tokenizer.json");
    let as_written =
        PromptTokenizer::from_tokenizer_json_bytes(&json, path, TokenizerJsonPipeline::AsWritten)
            .unwrap();
    assert_eq!(as_written.whole_piece_lookup(), WholePieceLookup::On);
    assert_eq!(as_written.encode("abc").unwrap(), vec![abc]);
    assert_eq!(as_written.encode("pqr").unwrap(), vec![pqr]);
    assert_eq!(as_written.encode("xabc").unwrap(), vec![x, ab, c]);
    let qwen35 =
        PromptTokenizer::from_tokenizer_json_bytes(&json, path, TokenizerJsonPipeline::Qwen35)
            .unwrap();
    assert_eq!(qwen35.whole_piece_lookup(), WholePieceLookup::Off);
    assert_eq!(qwen35.encode("abc").unwrap(), vec![ab, c]);
    assert_eq!(qwen35.encode("pqr").unwrap(), vec![p, q, r]);
}

#[test]
fn qwen35_pipeline_replaces_an_older_split_regex() {
    // Qwen2's regex (no \p{M}) ends a letter run before a combining mark; Qwen3.5's keeps the
    // mark in the run. With a merge across that boundary ("b" + U+030C) the ids differ.
    // b + caron has no precomposed form, so NFC leaves the text alone.
    let caron = bytes_to_text("\u{30c}".as_bytes());
    let caron_chars: Vec<char> = caron.chars().collect();
    let mut tokens: Vec<String> = (0..=255u8).map(|b| bytes_to_text(&[b])).collect();
    tokens.extend([caron.clone(), format!("b{caron}"), "ab".to_string()]);
    let (caron_id, b_caron_id, ab_id) = (256u32, 257u32, 258u32);
    let merges = vec![
        format!("{} {}", caron_chars[0], caron_chars[1]),
        format!("b {caron}"),
        "a b".to_string(),
    ];
    let mut json: Value =
        serde_json::from_slice(&crafted_tokenizer_json(&tokens, &merges, false)).unwrap();
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = Value::from(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    let bytes = serde_json::to_vec(&json).unwrap();
    let path = Path::new("crafted/tokenizer.json");
    let as_written =
        PromptTokenizer::from_tokenizer_json_bytes(&bytes, path, TokenizerJsonPipeline::AsWritten)
            .unwrap();
    let qwen35 =
        PromptTokenizer::from_tokenizer_json_bytes(&bytes, path, TokenizerJsonPipeline::Qwen35)
            .unwrap();
    // Qwen2 split: "ab" | "\u{30c}"; Qwen3.5: "ab\u{30c}" merged b+caron first (lower rank).
    assert_eq!(
        as_written.encode("ab\u{30c}").unwrap(),
        vec![ab_id, caron_id]
    );
    assert_eq!(
        qwen35.encode("ab\u{30c}").unwrap(),
        vec!['a' as u32, b_caron_id]
    );
}

// --- errors ---

#[test]
fn missing_and_corrupt_tokenizer_json_are_typed_errors() {
    let err = PromptTokenizer::from_model_dir(Path::new("/nonexistent/model")).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MissingFile { path } if path.ends_with("tokenizer.json")),
        "{err}"
    );

    let good = std::fs::read(tiny_dir().join("tokenizer.json")).unwrap();
    let path = Path::new("x/tokenizer.json");
    let refused = |bytes: &[u8], pipeline| {
        PromptTokenizer::from_tokenizer_json_bytes(bytes, path, pipeline).unwrap_err()
    };
    for corrupt in [
        &good[..good.len() / 2],
        b"{}".as_slice(),
        b"not json".as_slice(),
        b"[1, 2]".as_slice(),
    ] {
        let err = refused(corrupt, TokenizerJsonPipeline::Qwen35);
        assert!(
            matches!(err, TokenizerError::BadTokenizerJson { .. }),
            "{err}"
        );
    }

    // An added token whose id in the file is not the id it gets.
    let mut json: Value = serde_json::from_slice(&good).unwrap();
    json["added_tokens"][1]["id"] = Value::from(4200);
    let err = refused(
        &serde_json::to_vec(&json).unwrap(),
        TokenizerJsonPipeline::Qwen35,
    );
    assert!(
        matches!(&err, TokenizerError::AddedTokenIdMismatch { content, expected: 4200, actual: Some(4097) } if content == "<|im_start|>"),
        "{err}"
    );

    // A merge naming a token that is not in the vocabulary.
    let mut json: Value = serde_json::from_slice(&good).unwrap();
    json["model"]["merges"][0] = serde_json::json!(["Ġ", "nope"]);
    let err = refused(
        &serde_json::to_vec(&json).unwrap(),
        TokenizerJsonPipeline::AsWritten,
    );
    assert!(
        matches!(err, TokenizerError::BadTokenizerJson { .. }),
        "{err}"
    );

    // A byte-level vocabulary without a token for one byte: refused under the Qwen3.5 pipeline
    // (BPE would silently drop that byte), accepted as written.
    let (tokens, merges) = whole_piece_vocabulary();
    let json = crafted_tokenizer_json(&tokens[1..], &merges, false);
    let err = refused(&json, TokenizerJsonPipeline::Qwen35);
    assert!(
        matches!(err, TokenizerError::MissingByteToken { byte: 0 }),
        "{err}"
    );
    PromptTokenizer::from_tokenizer_json_bytes(&json, path, TokenizerJsonPipeline::AsWritten)
        .unwrap();

    // A bad tokenizer_config.json next to a good tokenizer.json.
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-tok-badcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), &good).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), b"{\"eos_token\": 5}").unwrap();
    let err = PromptTokenizer::from_model_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::BadConfig { .. }), "{err}");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        b"{\"eos_token\": \"<|nope|>\"}",
    )
    .unwrap();
    let err = PromptTokenizer::from_model_dir(&dir).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::BadConfig { message, .. } if message.contains("<|nope|>")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A minimal GGUF v3 with the given string/array-of-string/u32 keys and no tensors.
fn gguf_bytes(keys: &[(&str, MetadataValue)]) -> Vec<u8> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn put_value(out: &mut Vec<u8>, v: &MetadataValue) {
        match v {
            MetadataValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetadataValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetadataValue::String(s) => put_str(out, s),
            MetadataValue::Array(items) => {
                let ty = items.first().map_or(8u32, type_code);
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    put_value(out, item);
                }
            }
            other => panic!("not needed here: {other:?}"),
        }
    }
    fn type_code(v: &MetadataValue) -> u32 {
        match v {
            MetadataValue::U32(_) => 4,
            MetadataValue::I32(_) => 5,
            MetadataValue::String(_) => 8,
            MetadataValue::Array(_) => 9,
            other => panic!("not needed here: {other:?}"),
        }
    }
    let mut out = b"GGUF".to_vec();
    // (padded to the default alignment below, where tensor data would start)
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for (key, value) in keys {
        put_str(&mut out, key);
        out.extend_from_slice(&type_code(value).to_le_bytes());
        put_value(&mut out, value);
    }
    out.resize(out.len().next_multiple_of(32), 0);
    out
}

fn strings(items: &[&str]) -> MetadataValue {
    MetadataValue::Array(
        items
            .iter()
            .map(|s| MetadataValue::String(s.to_string()))
            .collect(),
    )
}

#[test]
fn gguf_without_or_with_bad_vocabulary_keys_is_a_typed_error() {
    let s = |v: &str| MetadataValue::String(v.into());
    let types =
        |t: &[i32]| MetadataValue::Array(t.iter().map(|&x| MetadataValue::I32(x)).collect());
    let file = |keys: &[(&str, MetadataValue)]| {
        GgufFile::from_bytes(gguf_bytes(keys)).expect("crafted gguf")
    };

    let err =
        PromptTokenizer::from_gguf(&file(&[("general.architecture", s("qwen35"))])).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::MissingGgufKey {
                key: "tokenizer.ggml.model"
            }
        ),
        "{err}"
    );

    // 256 byte tokens, "ab" (256) and <|im_end|> (257).
    let mut token_list: Vec<String> = (0..=255u8).map(|b| bytes_to_text(&[b])).collect();
    token_list.extend(["ab".to_string(), "<|im_end|>".to_string()]);
    let token_refs: Vec<&str> = token_list.iter().map(String::as_str).collect();
    let mut type_list = vec![1i32; 257];
    type_list.push(3);
    let base = |model: &str, pre: &str| {
        vec![
            ("tokenizer.ggml.model", s(model)),
            ("tokenizer.ggml.pre", s(pre)),
            ("tokenizer.ggml.tokens", strings(&token_refs)),
            ("tokenizer.ggml.token_type", types(&type_list)),
            ("tokenizer.ggml.merges", strings(&["a b"])),
        ]
    };
    let without = |key: &str| {
        base("gpt2", "qwen35")
            .into_iter()
            .filter(|(k, _)| *k != key)
            .collect::<Vec<_>>()
    };
    // The base keys after `edit`: the error they give.
    type Keys = Vec<(&'static str, MetadataValue)>;
    let edited = |edit: &dyn Fn(&mut Keys)| {
        let mut keys = base("gpt2", "qwen35");
        edit(&mut keys);
        PromptTokenizer::from_gguf(&file(&keys)).unwrap_err()
    };
    for key in [
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    ] {
        let err = PromptTokenizer::from_gguf(&file(&without(key))).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::MissingGgufKey { key: k } if *k == key),
            "{err}"
        );
    }
    let err = PromptTokenizer::from_gguf(&file(&base("llama", "qwen35"))).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedModel { found, .. } if found == "llama"),
        "{err}"
    );
    let err = PromptTokenizer::from_gguf(&file(&base("gpt2", "qwen2-but-not"))).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedPreTokenizer { found } if found == "qwen2-but-not"),
        "{err}"
    );

    let err = edited(&|keys| keys[3].1 = types(&type_list[1..]));
    assert!(
        matches!(
            err,
            TokenizerError::TokenTypeCountMismatch {
                tokens: 258,
                token_types: 257
            }
        ),
        "{err}"
    );

    let err = edited(&|keys| keys[2].1 = MetadataValue::U32(7));
    assert!(
        matches!(
            err,
            TokenizerError::BadGgufValue {
                key: "tokenizer.ggml.tokens",
                ..
            }
        ),
        "{err}"
    );

    let err = edited(&|keys| keys.push(("tokenizer.ggml.eos_token_id", MetadataValue::U32(999))));
    assert!(
        matches!(
            err,
            TokenizerError::IdOutOfRange {
                id: 999,
                vocab_size: 258,
                ..
            }
        ),
        "{err}"
    );

    // A byte without a token: text containing it could not be encoded faithfully.
    let err = edited(&|keys| {
        keys[2].1 = strings(&token_refs[1..]);
        keys[3].1 = types(&type_list[1..]);
    });
    assert!(
        matches!(err, TokenizerError::MissingByteToken { byte: 0 }),
        "{err}"
    );

    let mut keys = base("gpt2", "qwen35");
    keys.push(("tokenizer.ggml.eos_token_id", MetadataValue::U32(257)));
    let tok = PromptTokenizer::from_gguf(&file(&keys)).unwrap();
    assert_eq!(
        tok.encode("abc<|im_end|>").unwrap(),
        vec![256, u32::from(b'c'), 257]
    );
    assert_eq!(tok.eos_ids(), &[257]);
}

// The same one-line check as chat_template.rs makes for PromptFormat: each type has its own test.
#[test]
fn tokenizers_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<PromptTokenizer>();
}

#[test]
fn bad_gguf_vocabulary_contents_are_typed_errors() {
    let (tokens, merges) = whole_piece_vocabulary();
    let good = crafted_gguf_vocabulary(tokens, merges);
    PromptTokenizer::from_gguf_vocabulary(&good).unwrap();

    // Each edit of the good vocabulary, and the error it must give.
    type Edit = fn(&mut GgufVocabulary);
    type Expect = fn(&TokenizerError) -> bool;
    let bad: [(&str, Edit, Expect); 5] = [
        (
            "merge without a space",
            |v| v.merges.push("a".into()),
            |e| matches!(e, TokenizerError::BadMerge { index: 1, .. }),
        ),
        (
            "merge of an unknown piece",
            |v| v.merges.push("ab zz".into()),
            |e| matches!(e, TokenizerError::BadMerge { reason, .. } if reason.contains("\"zz\"")),
        ),
        (
            "merge whose result is no token",
            |v| v.merges.push("ab ab".into()),
            |e| matches!(e, TokenizerError::BadMerge { reason, .. } if reason.contains("abab")),
        ),
        (
            "token type 6",
            |v| v.token_types[5] = 6,
            |e| {
                matches!(
                    e,
                    TokenizerError::UnsupportedTokenType {
                        id: 5,
                        token_type: 6,
                        ..
                    }
                )
            },
        ),
        (
            "duplicate token",
            |v| v.tokens[7] = v.tokens[6].clone(),
            |e| {
                matches!(
                    e,
                    TokenizerError::DuplicateToken {
                        first: 6,
                        second: 7,
                        ..
                    }
                )
            },
        ),
    ];
    for (what, edit, expect) in bad {
        let mut v = good.clone();
        edit(&mut v);
        let err = PromptTokenizer::from_gguf_vocabulary(&v).unwrap_err();
        assert!(expect(&err), "{what}: {err}");
    }

    // Unused (type 5) entries are padding ids: skipped, not an error, and not encodable.
    let mut v = good.clone();
    v.tokens.push("[PAD300]".into());
    v.token_types.push(5);
    let tok = PromptTokenizer::from_gguf_vocabulary(&v).unwrap();
    assert_eq!(tok.token_to_id("[PAD300]"), None);
}

#[test]
fn bad_rank_files_are_typed_errors() {
    let err =
        PromptTokenizer::from_tiktoken_file(Path::new("/nonexistent/x.tiktoken"), &[]).unwrap_err();
    assert!(matches!(err, TokenizerError::MissingFile { .. }), "{err}");

    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-tok-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.tiktoken");
    std::fs::write(&path, "IQ== 0\nIg== 1\n!!!! 2\n").unwrap();
    let err = PromptTokenizer::from_tiktoken_file(&path, &[]).unwrap_err();
    assert!(
        matches!(
            &err,
            TokenizerError::BadRankList {
                problem: RankListProblem::Malformed { line: 3, .. },
                ..
            }
        ),
        "{err}"
    );
    std::fs::write(&path, [0xffu8, 0xfe, b' ', b'0']).unwrap();
    let err = PromptTokenizer::from_tiktoken_file(&path, &[]).unwrap_err();
    assert!(matches!(err, TokenizerError::BadRankList { .. }), "{err}");
    std::fs::remove_dir_all(&dir).ok();

    // Added tokens must lie outside the ranks and be distinct.
    let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let vocab = RankedVocabulary::from_tokens_in_rank_order(bytes).unwrap();
    let spec = |id: u32, content: &str| AddedTokenSpec {
        id,
        content: content.into(),
        special: true,
    };
    let err = PromptTokenizer::from_ranked_vocabulary(vocab.clone(), &[spec(10, "<x>")], None)
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::AddedTokenIdIsRank { id: 10, .. }),
        "{err}"
    );
    let err = PromptTokenizer::from_ranked_vocabulary(
        vocab.clone(),
        &[spec(256, "<x>"), spec(256, "<y>")],
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, TokenizerError::DuplicateToken { .. }),
        "{err}"
    );
    // An id gap after the ranks is allowed: the token keeps its id.
    let tok = PromptTokenizer::from_ranked_vocabulary(vocab, &[spec(300, "<x>")], None).unwrap();
    assert_eq!(tok.encode("a<x>").unwrap(), vec![u32::from(b'a'), 300]);
}

fn nfc(text: &str) -> String {
    use tokenizers::normalizers::NFC;
    use tokenizers::{NormalizedString, Normalizer};
    let mut normalized = NormalizedString::from(text);
    NFC.normalize(&mut normalized).expect("NFC");
    normalized.get().to_string()
}

fn nfd(text: &str) -> String {
    use tokenizers::normalizers::NFD;
    use tokenizers::{NormalizedString, Normalizer};
    let mut normalized = NormalizedString::from(text);
    NFD.normalize(&mut normalized).expect("NFD");
    normalized.get().to_string()
}

/// The cheap bound of `engine::min_prompt_tokens` rests on NFC never shrinking a text below its ASCII
/// bytes plus a quarter of its other bytes. Checked for every scalar value, its decomposition, every
/// partly composed spelling of each composite, and every Hangul syllable spelled in jamo.
#[test]
fn nfc_keeps_the_ascii_bytes_and_a_quarter_of_the_others() {
    use prism_decision::engine::min_prompt_tokens;
    let holds = |text: &str| min_prompt_tokens(text, 1) <= nfc(text).len();
    let mut checked = 0usize;
    for c in (0u32..0x11_0000).filter_map(char::from_u32) {
        let one = c.to_string();
        let decomposed = nfd(&one);
        assert!(holds(&one), "{c:?}");
        assert!(holds(&decomposed), "{c:?} as {decomposed:?}");
        if decomposed != one {
            let chars: Vec<char> = decomposed.chars().collect();
            for k in 1..chars.len() {
                let head: String = chars[..k].iter().collect();
                let tail: String = chars[k..].iter().collect();
                let partly = nfc(&head) + &tail;
                assert!(holds(&partly), "{c:?} as {partly:?}");
            }
        }
        checked += 1;
    }
    assert!(checked > 1_100_000);
    for l in 0x1100..0x1113u32 {
        for v in 0x1161..0x1176u32 {
            for t in std::iter::once(None).chain((0x11A8..0x11C3u32).map(Some)) {
                let text: String = [Some(l), Some(v), t]
                    .into_iter()
                    .flatten()
                    .filter_map(char::from_u32)
                    .collect();
                assert!(holds(&text), "{text:?}");
            }
        }
    }
}

/// The longest token of the tiny tokenizer is 64 bytes (a run of dashes), and no text tokenizes into
/// fewer tokens than the bound says, however compressible.
#[test]
fn no_text_has_fewer_tokens_than_the_length_bound() {
    use prism_decision::engine::min_prompt_tokens;
    let tok = tiny_json_tokenizer();
    let longest = tok.max_token_bytes();
    assert_eq!(longest, 64);
    let texts = [
        "-".repeat(10_000),
        " ".repeat(10_000),
        "<|im_start|>".repeat(500),
        "a".repeat(5_000),
        "U\u{308}\u{304}".repeat(1_000),
        "\u{1100}\u{1161}\u{11A8}".repeat(1_000),
        "\u{212A}".repeat(2_000),
        "The parcel arrived two days late. ".repeat(300),
    ];
    for text in &texts {
        let tokens = tok.encode(text).unwrap().len();
        let bound = min_prompt_tokens(text, longest);
        assert!(
            bound <= tokens,
            "{:?}: {tokens} tokens, bound {bound}",
            &text[..20]
        );
        assert!(bound > 0);
    }
    // The full Qwen3.5 vocabulary's longest token is 128 spaces.
    let ranks = fixtures().join("qwen35-vocab/qwen3_6.tiktoken");
    let full = PromptTokenizer::from_tiktoken_file(&ranks, &full_added_tokens()).unwrap();
    assert_eq!(full.max_token_bytes(), 128);
}

/// A text of about 12 KiB (many times [`PIECEWISE_BYTES`]) made of the random strings (special tokens whole and
/// broken, combining marks, NFD sequences, whitespace runs, contractions) with letter-space-letter
/// places between some of them, so that it is cut into pieces.
fn long_mixed_text(seed: u64) -> String {
    let mut text = String::new();
    for (i, s) in random_strings(4000, seed).iter().enumerate() {
        text.push_str(s);
        if i % 7 == 0 {
            text.push_str("x y");
        }
        if text.len() > 12 * 1024 {
            break;
        }
    }
    assert!(text.len() >= PIECEWISE_BYTES);
    text
}

#[test]
fn split_points_cut_between_a_letter_and_a_space_before_a_letter() {
    let text = long_mixed_text(7);
    let cuts = split_points(&text, 8);
    assert!(cuts.len() >= 4, "{} cuts", cuts.len());
    assert!(cuts.windows(2).all(|w| w[0] + 64 <= w[1]));
    let b = text.as_bytes();
    for &p in &cuts {
        assert!(
            (b[p - 1].is_ascii_alphabetic() && b[p] == b' ' && b[p + 1].is_ascii_alphabetic())
                || (b[p - 1] == b'\n' && b[p].is_ascii_alphabetic()),
            "cut at {p}: {:?}",
            &text[p - 1..p + 2]
        );
    }
    assert!(split_points("no place to cut here: 12 34", 4).is_empty());
    assert!(split_points(&"a".repeat(10_000), 4).is_empty());
}

/// The three tokenizer sources the piecewise and shared encodings are tested on: the tiny
/// `tokenizer.json`, the tiny GGUF's vocabulary and the full 248k tiktoken ranks.
fn three_tokenizers() -> [(&'static str, PromptTokenizer); 3] {
    [
        ("tokenizer.json", tiny_json_tokenizer()),
        (
            "GGUF vocabulary",
            PromptTokenizer::from_gguf(&tiny_gguf("tiny-Q8_0.gguf")).unwrap(),
        ),
        (
            "tiktoken ranks",
            PromptTokenizer::from_tiktoken_file(
                &fixtures().join("qwen35-vocab/qwen3_6.tiktoken"),
                &full_added_tokens(),
            )
            .unwrap(),
        ),
    ]
}

#[test]
fn a_long_text_encoded_in_pieces_gets_the_ids_of_the_whole() {
    for (name, tok) in three_tokenizers() {
        let mut texts: Vec<String> = (0..3).map(long_mixed_text).collect();
        // A prompt as the engine renders it, its evidence grown past the threshold.
        let (prompt, _) = prompt_texts().remove(0);
        // The longest fixture prompt as it is, and repeated past the threshold.
        let longest = prompt_texts()
            .into_iter()
            .map(|(text, _)| text)
            .max_by_key(String::len)
            .unwrap_or_default();
        let repeated = longest.repeat(PIECEWISE_BYTES / longest.len().max(1) + 1);
        assert!(
            repeated.len() >= PIECEWISE_BYTES,
            "{} bytes",
            repeated.len()
        );
        texts.push(longest);
        texts.push(repeated);
        texts.push(prompt.replace(
            "Evidence:",
            &"Evidence: the quick fox said it's done. ".repeat(300),
        ));
        for text in &texts {
            assert!(!split_points(text, 8).is_empty(), "{name}: nothing to cut");
            assert_eq!(
                tok.encode(text).unwrap(),
                tok.encode_in_one_piece(text).unwrap(),
                "{name}: pieces differ from the whole ({} bytes)",
                text.len()
            );
        }
    }
}

#[test]
fn texts_encoded_together_get_the_ids_each_gets_alone() {
    // Groups of texts with a common beginning: the fixture's rendered prompts (they share the chat
    // template's system turn), each of them with its text after a point replaced (the point moved
    // through the text, so the cut falls everywhere: inside words, at spaces, next to special
    // tokens), random strings with random tails, a text and its own prefix, equal texts.
    let prompts: Vec<String> = prompt_texts().into_iter().map(|(t, _)| t).collect();
    let randoms = random_strings(24, 7);
    let mut groups: Vec<Vec<String>> = vec![prompts.clone()];
    for (i, text) in prompts.iter().enumerate().take(4) {
        let mut at = 0;
        while at < text.len() {
            let tails = [" the Other one", "x", "", " A) yes", "\n\n<|im_end|>"];
            let head = &text[..at];
            let mut group: Vec<String> = tails.iter().map(|t| format!("{head}{t}")).collect();
            group.push(text.clone());
            groups.push(group);
            at += 13 + i;
            while at < text.len() && !text.is_char_boundary(at) {
                at += 1;
            }
        }
    }
    for pair in randoms.chunks(3) {
        groups.push(
            pair.iter()
                .map(|tail| format!("{} the quick fox{tail}", randoms[0]))
                .collect(),
        );
    }
    groups.push(vec![prompts[0].clone(), prompts[0].clone()]);
    groups.push(vec![prompts[0].clone()]);
    for (name, tok) in three_tokenizers() {
        let mut cut_groups = 0;
        for group in &groups {
            let texts: Vec<&str> = group.iter().map(String::as_str).collect();
            let alone: Vec<Vec<u32>> = texts
                .iter()
                .map(|t| tok.encode_in_one_piece(t).unwrap())
                .collect();
            assert_eq!(
                tok.encode_sharing(&texts).unwrap(),
                alone,
                "{name}: texts encoded together differ from alone: {texts:?}"
            );
            cut_groups += usize::from(shared_cut(&texts).is_some());
        }
        assert!(
            cut_groups > groups.len() / 2,
            "{name}: {cut_groups} groups cut"
        );
    }
}

#[test]
fn a_newline_before_a_letter_is_a_cut_where_the_evidence_ends_in_numbers() {
    // Evidence whose last few hundred bytes have no letter, space, letter (JSON rows of numbers), then
    // the question, as the README request renders: the texts share everything up to the question's
    // words, and the cut falls before "Question".
    let rows: Vec<String> = (0..24)
        .map(|i| format!("{{\"_index\": {i}, \"value\": {}.0}}", 49 + i % 3))
        .collect();
    let head = format!(
        "<|im_start|>user\nEvidence:\nticket text here\n{{\"rows\": [{}]}}\n\n",
        rows.join(", ")
    );
    let texts = [
        format!("{head}Question: Which team?\nOptions:\nA) billing\nB) ops<|im_end|>\n"),
        format!("{head}Question: \u{1}\nOptions:\nA) \u{1}\nB) \u{1}<|im_end|>\n"),
        format!("{head}Question: Is it urgent?\nOptions:\nA) yes\n\nB) no<|im_end|>\n"),
    ];
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let cut = shared_cut(&refs).expect("a cut");
    assert_eq!(cut, head.len(), "{:?}", &texts[0][cut - 8..cut + 8]);
    for text in &texts {
        let cuts = split_points(text, 8);
        assert!(
            cuts.iter()
                .all(|&p| text.as_bytes()[p - 1] == b'\n' || text.as_bytes()[p] == b' '),
            "{cuts:?}"
        );
    }
    for (name, tok) in three_tokenizers() {
        let alone: Vec<Vec<u32>> = refs
            .iter()
            .map(|t| tok.encode_in_one_piece(t).unwrap())
            .collect();
        assert_eq!(tok.encode_sharing(&refs).unwrap(), alone, "{name}");
        for text in &texts {
            // Cut at every newline before a letter, one at a time: the two sides' ids are the whole's.
            let whole = tok.encode_in_one_piece(text).unwrap();
            let b = text.as_bytes();
            for p in (1..b.len()).filter(|&p| b[p - 1] == b'\n' && b[p].is_ascii_alphabetic()) {
                let mut ids = tok.encode_in_one_piece(&text[..p]).unwrap();
                ids.extend(tok.encode_in_one_piece(&text[p..]).unwrap());
                assert_eq!(ids, whole, "{name}: cut at {p} ({:?})", &text[p - 1..p + 1]);
            }
        }
    }
    assert_eq!(shared_cut(&["a\n1 b", "a\n1 c"]), None);
    assert_eq!(shared_cut(&["x\nabc", "x\nabd"]), Some(2));
}

#[test]
fn a_shared_cut_is_a_split_point_inside_the_common_beginning() {
    let texts = [
        "the quick fox jumps",
        "the quick fox sleeps",
        "the quick fox",
    ];
    let cut = shared_cut(&texts).expect("a cut");
    // The last place in "the quick fox" whose next byte is a letter every text has.
    assert_eq!(cut, 9);
    assert_eq!(&texts[0][cut - 1..cut + 2], "k f");
    assert_eq!(shared_cut(&["the quick fox"]), None);
    assert_eq!(shared_cut(&["the quick", "the quiet"]), Some(3));
    assert_eq!(shared_cut(&["the x", "the y"]), None);
    assert_eq!(shared_cut(&["12 34", "12 35"]), None);
    assert_eq!(shared_cut(&[]), None);
}
