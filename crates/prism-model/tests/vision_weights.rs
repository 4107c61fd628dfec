//! The vision tower's mmproj loading against the fixture made by llama.cpp's converter
//! (`tests/fixtures/qwen35-vl-tiny/mmproj-tiny-vl-F32.gguf`, its `tensors.json`): the configuration, every
//! tensor's shape and values, and the errors for a missing tensor, a misshapen one and another projector.

mod common;

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use prism_gguf::{GgufFile, MetadataValue};
use prism_model::vision::{VisionConfig, VisionWeights};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-vl-tiny")
}

fn mmproj() -> GgufFile {
    GgufFile::open(dir().join("mmproj-tiny-vl-F32.gguf")).expect("the fixture's mmproj opens")
}

/// The fixture's mmproj written again with `edit` applied to its metadata and tensors: `None` from
/// `tensor` drops the tensor, `Some(dims)` declares it with those dims (the same bytes).
fn rewritten(
    meta: impl Fn(&str, &MetadataValue) -> MetadataValue,
    tensor: impl Fn(&str, &[u64]) -> Option<Vec<u64>>,
) -> GgufFile {
    common::rewrite(&mmproj(), |key, value| Some(meta(key, value)), &[], tensor)
}

#[test]
fn the_fixture_loads_with_its_configuration_shapes_and_values() {
    let gguf = mmproj();
    let cfg = VisionConfig::from_gguf(&gguf).unwrap();
    assert_eq!(
        (
            cfg.hidden,
            cfg.ffn,
            cfg.blocks,
            cfg.heads,
            cfg.patch,
            cfg.merge,
            cfg.projection
        ),
        (64, 128, 3, 2, 16, 2, 128)
    );
    assert_eq!(cfg.position_grid, 48);
    assert_eq!(cfg.head_dim(), 32);
    assert_eq!(cfg.merged_width(), 256);
    assert!((cfg.eps - 1e-6).abs() < 1e-12);
    assert_eq!((cfg.mean, cfg.std), ([0.5; 3], [0.5; 3]));

    let w = VisionWeights::load(&gguf, &Device::Cpu).unwrap();
    assert_eq!(w.blocks.len(), 3);
    assert_eq!(w.patch_embed[0].dims(), [64, 3, 16, 16]);
    assert_eq!(w.positions.dims(), [2304, 64]);
    assert_eq!(w.blocks[0].qkv.0.dims(), [192, 64]);
    assert_eq!(w.blocks[2].down.0.dims(), [64, 128]);
    assert_eq!(w.merger[0].0.dims(), [256, 256]);
    assert_eq!(w.merger[1].0.dims(), [128, 256]);

    // Values: each loaded tensor's sum against the float64 sum llama.cpp's file holds (tensors.json).
    let text = std::fs::read_to_string(dir().join("tensors.json")).unwrap();
    let meta: Value = serde_json::from_str(&text).unwrap();
    let sums: std::collections::HashMap<String, f64> = meta["mmproj-tiny-vl-F32.gguf"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| Some((t["name"].as_str()?.to_string(), t["sum"].as_f64()?)))
        .collect();
    assert_eq!(sums.len(), 46, "tensors.json lists a sum per F32 tensor");
    let sum = |t: &Tensor| -> f64 {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|&v| v as f64)
            .sum()
    };
    let mut checked = 0;
    let mut check = |name: &str, t: &Tensor| {
        let want = sums[name];
        let got = sum(t);
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1.0),
            "{name}: {got} vs {want}"
        );
        checked += 1;
    };
    check("v.patch_embd.weight", &w.patch_embed[0]);
    check("v.patch_embd.weight.1", &w.patch_embed[1]);
    check("v.patch_embd.bias", &w.patch_bias);
    check("v.position_embd.weight", &w.positions);
    for (i, b) in w.blocks.iter().enumerate() {
        for (part, (weight, bias)) in [
            ("ln1", &b.ln1),
            ("attn_qkv", &b.qkv),
            ("attn_out", &b.out),
            ("ln2", &b.ln2),
            ("ffn_up", &b.up),
            ("ffn_down", &b.down),
        ] {
            check(&format!("v.blk.{i}.{part}.weight"), weight);
            check(&format!("v.blk.{i}.{part}.bias"), bias);
        }
    }
    check("v.post_ln.weight", &w.post_ln.0);
    check("v.post_ln.bias", &w.post_ln.1);
    for (k, (weight, bias)) in [("mm.0", &w.merger[0]), ("mm.2", &w.merger[1])] {
        check(&format!("{k}.weight"), weight);
        check(&format!("{k}.bias"), bias);
    }
    assert_eq!(checked, 46, "every tensor of the file is loaded");
}

#[test]
fn a_missing_or_misshapen_tensor_or_another_projector_is_refused_by_name() {
    let keep_meta = |_: &str, v: &MetadataValue| v.clone();
    let load_error = |gguf: &GgufFile| {
        VisionWeights::load(gguf, &Device::Cpu)
            .unwrap_err()
            .to_string()
    };
    let missing = rewritten(keep_meta, |name, dims| {
        (name != "v.blk.1.ffn_up.bias").then(|| dims.to_vec())
    });
    let e = load_error(&missing);
    assert!(
        e.contains("v.blk.1.ffn_up.bias") && e.contains("missing"),
        "{e}"
    );

    let misshapen = rewritten(keep_meta, |name, dims| {
        Some(if name == "v.blk.0.attn_qkv.weight" {
            vec![dims[1], dims[0]]
        } else {
            dims.to_vec()
        })
    });
    let e = load_error(&misshapen);
    assert!(
        e.contains("v.blk.0.attn_qkv.weight") && e.contains("shape"),
        "{e}"
    );

    let other = rewritten(
        |key, v| {
            if key == "clip.projector_type" {
                MetadataValue::String("mlp".into())
            } else {
                v.clone()
            }
        },
        |_, dims| Some(dims.to_vec()),
    );
    let e = VisionConfig::from_gguf(&other).unwrap_err().to_string();
    assert!(e.contains("mlp") && e.contains("qwen3vl_merger"), "{e}");

    // The text model is not an mmproj.
    let text = GgufFile::open(dir().join("tiny-vl-BF16.gguf")).unwrap();
    let e = VisionConfig::from_gguf(&text).unwrap_err().to_string();
    assert!(e.contains("clip"), "{e}");
}
