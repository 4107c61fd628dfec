//! Configuration logic on synthetic metadata shaped like every released dense size (0.8B–27B), the
//! config.json cross-check, and the typed errors for bad files and bad inputs.

mod common;

use std::collections::HashMap;

use common::*;
use prism_gguf::{GgufFile, MetadataValue};
use prism_model::{
    BatchItem, LayerKind, LoadOptions, ModelError, Precision, Qwen35Config, Qwen35Model,
};
use serde_json::json;

// ---------------------------------------------------------------------------------------------------
// Synthetic metadata for the real sizes (reference doc §1.1 / §3.2)
// ---------------------------------------------------------------------------------------------------

struct Size {
    name: &'static str,
    d: u64,
    layers: u64,
    ffn: u64,
    n_h: u64,
    n_kv: u64,
    n_v: u64,
    /// Derived widths from the reference table: q_proj out, conv_dim, value_dim.
    q_out: usize,
    conv_dim: usize,
    value_dim: usize,
}

// The reference table as it is, one whole entry a size, though the small ones share most widths: each
// entry reads against its row of the reference doc.
const SIZES: [Size; 5] = [
    Size {
        name: "0.8B",
        d: 1024,
        layers: 24,
        ffn: 3584,
        n_h: 8,
        n_kv: 2,
        n_v: 16,
        q_out: 4096,
        conv_dim: 6144,
        value_dim: 2048,
    },
    Size {
        name: "2B",
        d: 2048,
        layers: 24,
        ffn: 6144,
        n_h: 8,
        n_kv: 2,
        n_v: 16,
        q_out: 4096,
        conv_dim: 6144,
        value_dim: 2048,
    },
    Size {
        name: "4B",
        d: 2560,
        layers: 32,
        ffn: 9216,
        n_h: 16,
        n_kv: 4,
        n_v: 32,
        q_out: 8192,
        conv_dim: 8192,
        value_dim: 4096,
    },
    Size {
        name: "9B",
        d: 4096,
        layers: 32,
        ffn: 12288,
        n_h: 16,
        n_kv: 4,
        n_v: 32,
        q_out: 8192,
        conv_dim: 8192,
        value_dim: 4096,
    },
    Size {
        name: "27B",
        d: 5120,
        layers: 64,
        ffn: 17408,
        n_h: 24,
        n_kv: 4,
        n_v: 48,
        q_out: 12288,
        conv_dim: 10240,
        value_dim: 6144,
    },
];

const VOCAB: usize = 248_320;

/// Metadata as the current llama.cpp converter writes it, with the MTP block included
/// (`block_count = L + 1`, `nextn_predict_layers = 1`) when `mtp` is set.
// examples/bench_synthetic.rs writes many of the same keys for its own small model: a list of data, and
// an example and a test target share no module.
fn metadata(s: &Size, mtp: bool, recurrent_layers: bool) -> HashMap<String, MetadataValue> {
    let block_count = s.layers + u64::from(mtp);
    let mut m = HashMap::new();
    let mut put = |k: &str, v: MetadataValue| {
        m.insert(k.to_string(), v);
    };
    put(
        "general.architecture",
        MetadataValue::String("qwen35".into()),
    );
    put("qwen35.block_count", MetadataValue::U32(block_count as u32));
    if mtp {
        put("qwen35.nextn_predict_layers", MetadataValue::U32(1));
    }
    // The Qwen3.5 metadata keys as data, one `put` a key (the bench example lists the same keys for
    // its shape: each file's table says what its model is).
    put("qwen35.context_length", MetadataValue::U32(262_144));
    put("qwen35.embedding_length", MetadataValue::U32(s.d as u32));
    put(
        "qwen35.feed_forward_length",
        MetadataValue::U32(s.ffn as u32),
    );
    put(
        "qwen35.attention.head_count",
        MetadataValue::U32(s.n_h as u32),
    );
    put(
        "qwen35.attention.head_count_kv",
        MetadataValue::U32(s.n_kv as u32),
    );
    put("qwen35.attention.key_length", MetadataValue::U32(256));
    put("qwen35.attention.value_length", MetadataValue::U32(256));
    put(
        "qwen35.attention.layer_norm_rms_epsilon",
        MetadataValue::F32(1e-6),
    );
    put("qwen35.rope.freq_base", MetadataValue::F32(1e7));
    put("qwen35.rope.dimension_count", MetadataValue::U32(64));
    put(
        "qwen35.rope.dimension_sections",
        MetadataValue::Array(
            [11, 11, 10, 0]
                .into_iter()
                .map(MetadataValue::I32)
                .collect(),
        ),
    );
    put("qwen35.ssm.conv_kernel", MetadataValue::U32(4));
    put("qwen35.ssm.state_size", MetadataValue::U32(128));
    put("qwen35.ssm.group_count", MetadataValue::U32(16));
    put(
        "qwen35.ssm.time_step_rank",
        MetadataValue::U32(s.n_v as u32),
    );
    put(
        "qwen35.ssm.inner_size",
        MetadataValue::U32((s.n_v * 128) as u32),
    );
    put("qwen35.full_attention_interval", MetadataValue::U32(4));
    if recurrent_layers {
        // The MTP block (last) is full-attention shaped.
        let flags = (0..block_count).map(|i| MetadataValue::Bool(i < s.layers && (i + 1) % 4 != 0));
        put(
            "qwen35.attention.recurrent_layers",
            MetadataValue::Array(flags.collect()),
        );
    }
    m
}

#[test]
fn every_released_size_reads_its_configuration() {
    for s in &SIZES {
        for (mtp, flags) in [(false, false), (true, false), (true, true), (false, true)] {
            let what = format!("{} (mtp {mtp}, recurrent_layers {flags})", s.name);
            let cfg = Qwen35Config::from_metadata(&metadata(s, mtp, flags), VOCAB).expect(&what);
            assert_eq!(cfg.n_layers, s.layers as usize, "{what}");
            assert_eq!(cfg.n_mtp_layers, usize::from(mtp), "{what}");
            assert_eq!(cfg.hidden_size, s.d as usize);
            assert_eq!(cfg.head_dim, 256);
            assert_eq!(
                2 * cfg.n_heads * cfg.head_dim,
                s.q_out,
                "{what}: q_proj out"
            );
            assert_eq!(cfg.conv_dim(), s.conv_dim, "{what}: conv_dim");
            assert_eq!(cfg.linear_value_dim(), s.value_dim, "{what}: value_dim");
            assert_eq!(cfg.linear_key_dim(), 2048);
            assert_eq!(
                (cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                (128, 128)
            );
            assert_eq!(cfg.rotary_dim, 64);
            assert_eq!(cfg.mrope_sections, [11, 11, 10]);
            let full: Vec<usize> = cfg
                .layer_kinds
                .iter()
                .enumerate()
                .filter(|(_, k)| **k == LayerKind::Attention)
                .map(|(i, _)| i)
                .collect();
            let want: Vec<usize> = (0..s.layers as usize).filter(|i| i % 4 == 3).collect();
            assert_eq!(full, want, "{what}: full-attention layers");
        }
    }
}

#[test]
fn recurrent_layers_override_the_interval_rule() {
    let mut m = metadata(&SIZES[0], false, false);
    // Full attention at layers 0 and 5 only.
    let flags = (0..24)
        .map(|i| MetadataValue::Bool(i != 0 && i != 5))
        .collect();
    m.insert(
        "qwen35.attention.recurrent_layers".into(),
        MetadataValue::Array(flags),
    );
    let cfg = Qwen35Config::from_metadata(&m, VOCAB).unwrap();
    assert_eq!(cfg.layer_kinds[0], LayerKind::Attention);
    assert_eq!(cfg.layer_kinds[3], LayerKind::DeltaNet);
    assert_eq!(cfg.layer_kinds[5], LayerKind::Attention);
    // Without the array, the interval key decides.
    let mut m = metadata(&SIZES[0], false, false);
    m.insert(
        "qwen35.full_attention_interval".into(),
        MetadataValue::U32(3),
    );
    let cfg = Qwen35Config::from_metadata(&m, VOCAB).unwrap();
    assert_eq!(cfg.layer_kinds[2], LayerKind::Attention);
    assert_eq!(cfg.layer_kinds[3], LayerKind::DeltaNet);
}

#[test]
fn bad_metadata_gives_errors_that_name_the_key() {
    let base = || metadata(&SIZES[2], true, true);
    let err =
        |m: HashMap<String, MetadataValue>| Qwen35Config::from_metadata(&m, VOCAB).unwrap_err();
    // The base metadata with one key set.
    let with = |key: &str, value: MetadataValue| {
        let mut m = base();
        m.insert(key.into(), value);
        m
    };

    let mut m = base();
    m.remove("qwen35.ssm.inner_size");
    assert!(
        matches!(err(m), ModelError::MissingMetadata { key } if key == "qwen35.ssm.inner_size")
    );

    let e = err(with(
        "general.architecture",
        MetadataValue::String("qwen35moe".into()),
    ));
    assert!(matches!(e, ModelError::UnsupportedArchitecture { found } if found == "qwen35moe"));

    let e = err(with(
        "qwen35.attention.head_count",
        MetadataValue::String("16".into()),
    ));
    assert!(
        matches!(e, ModelError::BadMetadata { key, .. } if key == "qwen35.attention.head_count")
    );

    let e = err(with(
        "qwen35.attention.recurrent_layers",
        MetadataValue::Array(vec![MetadataValue::Bool(true); 5]),
    ));
    assert!(
        matches!(e, ModelError::BadMetadata { key, .. } if key == "qwen35.attention.recurrent_layers")
    );

    let e = err(with(
        "qwen35.attention.head_count_kv",
        MetadataValue::U32(5),
    ));
    assert!(matches!(e, ModelError::InvalidConfig { field, .. } if field == "n_heads"));

    let mut m = with("qwen35.ssm.time_step_rank", MetadataValue::U32(24));
    m.insert("qwen35.ssm.inner_size".into(), MetadataValue::U32(24 * 128));
    assert!(
        matches!(err(m), ModelError::InvalidConfig { field, .. } if field == "linear_value_heads")
    );

    let sections = [16, 16, 16, 0]
        .into_iter()
        .map(MetadataValue::I32)
        .collect();
    let e = err(with(
        "qwen35.rope.dimension_sections",
        MetadataValue::Array(sections),
    ));
    assert!(
        matches!(e, ModelError::InvalidConfig { field, .. } if field == "rope.dimension_sections")
    );

    let e = err(with("qwen35.nextn_predict_layers", MetadataValue::U32(33)));
    assert!(
        matches!(e, ModelError::BadMetadata { key, .. } if key == "qwen35.nextn_predict_layers")
    );

    let e = err(with(
        "tokenizer.ggml.tokens",
        MetadataValue::Array(vec![MetadataValue::String("a".into()); 10]),
    ));
    assert!(matches!(e, ModelError::BadMetadata { key, .. } if key == "tokenizer.ggml.tokens"));
}

// ---------------------------------------------------------------------------------------------------
// config.json cross-check
// ---------------------------------------------------------------------------------------------------

/// A multimodal `config.json` in the shape of the official 9B one (text part only matters).
fn hf_config_9b() -> serde_json::Value {
    let layer_types: Vec<&str> = (0..32)
        .map(|i| {
            if i % 4 == 3 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "vocab_size": 248320,
            "rms_norm_eps": 1e-6, "layer_types": layer_types, "mtp_num_hidden_layers": 1,
            "tie_word_embeddings": false,
            "rope_parameters": { "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10], "mrope_interleaved": true, "rope_type": "default" }
        },
        "vision_config": { "depth": 27, "hidden_size": 1152 }
    })
}

#[test]
fn config_json_agreement_and_mismatches() {
    let cfg = Qwen35Config::from_metadata(&metadata(&SIZES[3], true, true), VOCAB).unwrap();
    cfg.check_hf_config(&hf_config_9b()).unwrap();

    // Older flat style: rope settings at the top level, interval instead of layer_types.
    let mut flat = hf_config_9b()["text_config"].clone();
    let obj = flat.as_object_mut().unwrap();
    obj.remove("rope_parameters");
    obj.remove("layer_types");
    obj.insert("rope_theta".into(), json!(1e7));
    obj.insert("partial_rotary_factor".into(), json!(0.25));
    obj.insert("full_attention_interval".into(), json!(4));
    cfg.check_hf_config(&flat).unwrap();

    let mismatch = |path: &[&str], value: serde_json::Value, field: &str| {
        let mut j = hf_config_9b();
        let mut at = &mut j;
        for p in &path[..path.len() - 1] {
            at = at.get_mut(*p).unwrap();
        }
        at[path[path.len() - 1]] = value;
        match cfg.check_hf_config(&j) {
            Err(ModelError::ConfigMismatch { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{path:?}: expected a mismatch on {field}, got {other:?}"),
        }
    };
    mismatch(&["text_config", "hidden_size"], json!(2048), "hidden_size");
    mismatch(
        &["text_config", "linear_num_value_heads"],
        json!(16),
        "linear_num_value_heads",
    );
    mismatch(
        &["text_config", "num_hidden_layers"],
        json!(33),
        "num_hidden_layers",
    );
    let mut j = hf_config_9b();
    j["text_config"]["layer_types"][0] = json!("full_attention");
    assert!(
        matches!(cfg.check_hf_config(&j), Err(ModelError::ConfigMismatch { field, .. }) if field == "layer_types")
    );
    mismatch(
        &["text_config", "rope_parameters", "rope_theta"],
        json!(1e6),
        "rope_theta",
    );
    mismatch(
        &["text_config", "rope_parameters", "partial_rotary_factor"],
        json!(0.5),
        "partial_rotary_factor",
    );
    mismatch(
        &["text_config", "rope_parameters", "mrope_section"],
        json!([16, 8, 8]),
        "mrope_section",
    );
    mismatch(
        &["text_config", "rms_norm_eps"],
        json!(1e-5),
        "rms_norm_eps",
    );
}

// ---------------------------------------------------------------------------------------------------
// Bad files: rewrite the fixture GGUF with one thing changed
// ---------------------------------------------------------------------------------------------------

/// tiny-BF16.gguf with metadata `key` set to `value`.
fn with_metadata(key: &str, value: MetadataValue) -> GgufFile {
    rewritten(
        |k, v| Some(if k == key { value.clone() } else { v.clone() }),
        &[],
        |_, d| Some(d.to_vec()),
    )
}

/// tiny-BF16.gguf without tensor `name`.
fn without_tensor(name: &str) -> GgufFile {
    rewritten(
        |_, v| Some(v.clone()),
        &[],
        |n, d| (n != name).then(|| d.to_vec()),
    )
}

fn load_err(gguf: &GgufFile, hf_config: Option<std::path::PathBuf>) -> ModelError {
    let options = LoadOptions {
        hf_config,
        ..LoadOptions::default()
    };
    Qwen35Model::from_gguf(gguf, &options).unwrap_err()
}

#[test]
fn unmodified_rewrite_loads() {
    let gguf = rewritten(|_, v| Some(v.clone()), &[], |_, d| Some(d.to_vec()));
    Qwen35Model::from_gguf(&gguf, &LoadOptions::default()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    for name in [
        "blk.5.ssm_a",
        "blk.3.attn_q_norm.weight",
        "output_norm.weight",
        "blk.7.ffn_down.weight",
    ] {
        match load_err(&without_tensor(name), None) {
            ModelError::MissingTensor { name: n } => assert_eq!(n, name),
            other => panic!("dropping {name}: {other}"),
        }
    }
}

#[test]
fn misshaped_tensor_is_named() {
    // Same bytes, transposed dims: only the shape check can catch it.
    let name = "blk.3.attn_k.weight";
    let gguf = rewritten(
        |_, v| Some(v.clone()),
        &[],
        |n, d| {
            Some(if n == name {
                vec![d[1], d[0]]
            } else {
                d.to_vec()
            })
        },
    );
    match load_err(&gguf, None) {
        ModelError::TensorShape {
            name: n,
            expected,
            found,
        } => {
            assert_eq!(n, name);
            assert_eq!(expected, vec![256, 128]);
            assert_eq!(found, vec![128, 256]);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn metadata_that_does_not_fit_the_tensors_is_refused() {
    // One layer more than the file has.
    let gguf = with_metadata("qwen35.block_count", MetadataValue::U32(9));
    assert!(
        matches!(load_err(&gguf, None), ModelError::BadMetadata { key, .. } if key == "qwen35.attention.recurrent_layers")
    );
    // An MTP block declared (block_count 9, nextn 1): the 8 main layers load, the missing MTP block is
    // never looked for.
    let gguf = rewritten(
        |k, v| {
            Some(if k == "qwen35.block_count" {
                MetadataValue::U32(9)
            } else {
                v.clone()
            })
        },
        &[("qwen35.nextn_predict_layers", MetadataValue::U32(1))],
        |_, d| Some(d.to_vec()),
    );
    let model = Qwen35Model::from_gguf(&gguf, &LoadOptions::default()).unwrap();
    assert_eq!(model.config().n_layers, 8);
    assert_eq!(model.config().n_mtp_layers, 1);
    // Wrong hidden size: the first tensor checked names itself.
    let gguf = with_metadata("qwen35.embedding_length", MetadataValue::U32(128));
    assert!(
        matches!(load_err(&gguf, None), ModelError::TensorShape { name, .. } if name == "token_embd.weight")
    );
}

#[test]
fn mismatched_config_json_is_refused() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-model-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good: serde_json::Value = read_json("config.json");
    let gguf = GgufFile::open(fixture_dir().join("tiny-BF16.gguf")).unwrap();
    for (field, value) in [
        ("linear_num_value_heads", json!(2)),
        ("intermediate_size", json!(1024)),
        ("tie_word_embeddings", json!(true)),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let path = dir.join(format!("{field}.json"));
        std::fs::write(&path, bad.to_string()).unwrap();
        let result = Qwen35Model::from_gguf(
            &gguf,
            &LoadOptions {
                hf_config: Some(path),
                ..LoadOptions::default()
            },
        );
        if field == "tie_word_embeddings" {
            // The file has output.weight; a config saying "tied" is not contradicted by its tensors.
            assert!(result.is_ok());
        } else {
            assert!(
                matches!(result.unwrap_err(), ModelError::ConfigMismatch { field: f, .. } if f == field)
            );
        }
    }
    // A tied file (no output.weight) against a config saying untied.
    let tied = without_tensor("output.weight");
    let err = load_err(&tied, Some(fixture_dir().join("config.json")));
    assert!(
        matches!(err, ModelError::ConfigMismatch { field, .. } if field == "tie_word_embeddings")
    );
    let path = dir.join("not-json.json");
    std::fs::write(&path, "{ nope").unwrap();
    assert!(matches!(
        load_err(&gguf, Some(path)),
        ModelError::ConfigJson { .. }
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tied_embeddings_use_the_embedding_matrix_as_the_head() {
    let tied = without_tensor("output.weight");
    let model = Qwen35Model::from_gguf(&tied, &LoadOptions::default()).unwrap();
    assert!(model.tied_embeddings());
    assert!(!bf16_model().tied_embeddings());
    // The head of the tied model at row r is the embedding of token r: logits = ⟨h, E[r]⟩.
    let h = model.last_hidden(&[&prompts()[1]]).unwrap();
    let rows = [0u32, 7, 4128];
    let got = flat_f32(&model.logits_for_rows(&h, &rows).unwrap());
    let src = GgufFile::open(fixture_dir().join("tiny-BF16.gguf")).unwrap();
    let embed = src.dequantize("token_embd.weight").unwrap();
    let hv = flat_f32(&h);
    for (g, &r) in got.iter().zip(&rows) {
        let e = &embed[r as usize * 256..(r as usize + 1) * 256];
        let want: f32 = e.iter().zip(&hv).map(|(a, b)| a * b).sum();
        assert!((g - want).abs() < 1e-4, "row {r}: {g} vs {want}");
    }
}

// ---------------------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------------------

#[test]
fn bad_inputs_give_typed_errors_and_leave_states_alone() {
    let model = bf16_model();
    let vocab = model.vocab_size() as u32;
    let p = &prompts()[1];

    assert!(matches!(
        model.last_hidden(&[p, &[]]),
        Err(ModelError::EmptyPrompt { index: 1 })
    ));
    assert!(matches!(
        model.last_hidden_shared_prefix(&[&[], p]),
        Err(ModelError::EmptyPrompt { index: 0 })
    ));
    assert!(matches!(
        model.forward(&mut []),
        Err(ModelError::InvalidInput(_))
    ));

    let mut bad = p.clone();
    bad[5] = vocab;
    match model.last_hidden(&[p, &bad]) {
        Err(ModelError::TokenOutOfRange {
            index: 1,
            position: 5,
            token,
            vocab_size,
        }) => {
            assert_eq!((token, vocab_size), (vocab, 4129));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        model.last_hidden(&[&[u32::MAX]]),
        Err(ModelError::TokenOutOfRange { .. })
    ));

    let h = model.last_hidden(&[p]).unwrap();
    assert!(
        matches!(model.logits_for_rows(&h, &[1, vocab]), Err(ModelError::RowOutOfRange { row, .. }) if row == vocab)
    );

    // A failed call leaves the state as it was.
    let mut state = model.new_state().unwrap();
    model.prefill(&mut state, &p[..10]).unwrap();
    let mut other = model.new_state().unwrap();
    let err = model.forward(&mut [
        BatchItem::new(&mut state, &p[10..]),
        BatchItem::new(&mut other, &bad),
    ]);
    assert!(err.is_err());
    assert_eq!((state.n_tokens(), other.n_tokens()), (10, 0));

    // Explicit positions must match the token count.
    let positions = [[0u32; 3]; 2];
    let mut s = model.new_state().unwrap();
    let mut item = BatchItem::new(&mut s, &p[..3]);
    item.positions = Some(&positions);
    assert!(matches!(
        model.forward(&mut [item]),
        Err(ModelError::InvalidInput(_))
    ));

    assert!(matches!(
        Precision::parse("int4"),
        Err(ModelError::UnsupportedPrecision(_))
    ));
}

#[test]
fn explicit_text_positions_equal_implicit_ones() {
    // The 3-axis interface with (p, p, p) must be the same computation as the default text positions.
    let model = bf16_model();
    let p = &prompts()[1];
    let positions: Vec<[u32; 3]> = (0..p.len() as u32).map(|i| [i; 3]).collect();
    let mut a = model.new_state().unwrap();
    let mut item = BatchItem::new(&mut a, p);
    item.positions = Some(&positions);
    let explicit = model.forward(&mut [item]).unwrap().last_hidden().unwrap();
    let implicit = model.last_hidden(&[p]).unwrap();
    assert_eq!(max_abs_diff_tensors(&explicit, &implicit), 0.0);
    assert_eq!(a.next_position() as usize, p.len());
}

#[test]
fn a_pass_token_of_27b_is_counted_by_hand() {
    let config = prism_model::synth::SynthSize::B27.config();
    // Widest layer: the SwiGLU (4 × 17,408 f32: gate|up, product, quantized copy) against a DeltaNet
    // layer (2 × (10,240 conv + 6,144 z + 96 a|b) + 48·128·128 / 64 chunk states + 64·48) and an
    // attention layer (2·24·256 + 2·4·256).
    let stream = 3 * 5120;
    let widest = 4 * 17_408;
    assert!(2 * (10_240 + 6_144 + 96) + 12_288 + 3_072 < widest);
    // K and V rows in bf16 in each of the 16 attention layers (every fourth of 64).
    let kv = 16 * 2 * 4 * 256 * 2;
    assert_eq!(config.pass_bytes_per_token(), (stream + widest) * 4 + kv);
    assert_eq!(config.pass_bytes_per_token(), 405_504);
    // Every smaller size needs fewer bytes a token.
    for size in prism_model::synth::SynthSize::ALL {
        assert!(
            size.config().pass_bytes_per_token() <= 405_504,
            "{}",
            size.label()
        );
    }
}
