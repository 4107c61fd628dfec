//! Test support: rebuilds a Hugging Face-layout checkpoint (`model.safetensors`, HF tensor names, shapes
//! and conventions) from a `qwen35` GGUF by undoing llama.cpp's `convert_hf_to_gguf.py` transforms as the
//! fixture README lists them. Written independently of `prism_model::hf` (which goes the other way), so
//! that loading the result through `from_hf_dir` checks the loader against the converter, not against
//! itself. The safetensors file is written by hand (8-byte header length, JSON header, raw data) and
//! needs nothing but `prism_gguf` and `serde_json`, so the CLI tests include this file too.
#![allow(dead_code)]

use std::path::Path;

use prism_gguf::GgufFile;
use serde_json::{json, Map, Value};

/// Storage dtype of a tensor in the written file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    Bf16,
    F16,
    F32,
    /// The f32 bits labelled as int32: only for the test that a non-float dtype is refused.
    I32,
}

impl StDtype {
    fn name(self) -> &'static str {
        match self {
            StDtype::Bf16 => "BF16",
            StDtype::F16 => "F16",
            StDtype::F32 => "F32",
            StDtype::I32 => "I32",
        }
    }
}

/// One HF tensor: name, PyTorch shape, values (row-major) and the dtype to store them in.
#[derive(Debug, Clone)]
pub struct HfTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    pub dtype: StDtype,
}

/// How the rebuilt checkpoint stores its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Everything bf16, like the reference checkpoint (derived 1-D values rounded to nearest bf16).
    AllBf16,
    /// Matrices bf16, 1-D tensors f32 (derived values unrounded), conv1d f16 where every value is
    /// exactly an f16, else f32.
    Mixed,
}

/// The DeltaNet head counts the V-head reordering depends on, from the GGUF metadata.
struct Heads {
    n_k: usize,
    n_v: usize,
    dv: usize,
    key_dim: usize,
}

fn meta_usize(gguf: &GgufFile, key: &str) -> usize {
    gguf.get(key)
        .and_then(|v| v.as_u64())
        .unwrap_or_else(|| panic!("GGUF metadata {key}")) as usize
}

/// Round to the nearest bf16 (ties to even), returned widened to f32.
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits((bits.wrapping_add(0x7fff + lsb)) & 0xffff_0000)
}

fn f32_to_f16_bits_exact(x: f32) -> Option<u16> {
    // Only values an f16 holds exactly (normal or subnormal) are stored as f16.
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp_field = ((bits >> 23) & 0xff) as i32;
    let mantissa = bits & 0x7f_ffff;
    if exp_field == 0 {
        // Zero (f32 subnormals are below every f16).
        return (mantissa == 0).then_some(sign);
    }
    let e = exp_field - 127;
    let significand = mantissa | 0x80_0000; // 24 bits, value = significand · 2^(e − 23)
    if e > 15 {
        return None;
    }
    // f16 normals keep 11 significant bits; subnormals are multiples of 2^-24.
    let lowest_kept = if e >= -14 { e - 10 } else { -24 };
    let drop = lowest_kept - (e - 23);
    if drop >= 24 || significand & ((1u32 << drop) - 1) != 0 {
        return None;
    }
    let m = significand >> drop;
    Some(if e >= -14 {
        sign | (((e + 15) as u16) << 10) | (m as u16 & 0x3ff)
    } else {
        sign | m as u16
    })
}

/// HF's grouped value head `h = g·r + j` sits at tiled index `j·n_k + g` in the GGUF.
fn tiled_index(h: usize, heads: &Heads) -> usize {
    let r = heads.n_v / heads.n_k;
    let (g, j) = (h / r, h % r);
    j * heads.n_k + g
}

/// Undo the V-head reordering on rows `first..first + n_v·per_head` of a row-major `[rows, cols]`.
fn untile_rows(v: &[f32], cols: usize, first: usize, per_head: usize, heads: &Heads) -> Vec<f32> {
    let mut out = v.to_vec();
    let block = per_head * cols;
    for h in 0..heads.n_v {
        let src = (first + tiled_index(h, heads) * per_head) * cols;
        let dst = (first + h * per_head) * cols;
        out[dst..dst + block].copy_from_slice(&v[src..src + block]);
    }
    out
}

/// Undo it on the columns (each row holds `n_v` heads of `per_head` columns).
fn untile_cols(v: &[f32], cols: usize, per_head: usize, heads: &Heads) -> Vec<f32> {
    let mut out = v.to_vec();
    for row in 0..v.len() / cols {
        for h in 0..heads.n_v {
            let src = row * cols + tiled_index(h, heads) * per_head;
            let dst = row * cols + h * per_head;
            out[dst..dst + per_head].copy_from_slice(&v[src..src + per_head]);
        }
    }
    out
}

/// The HF tensors of a `qwen35` GGUF, in file order.
pub fn hf_tensors_from_gguf(gguf: &GgufFile, storage: Storage) -> Vec<HfTensor> {
    let n_k = meta_usize(gguf, "qwen35.ssm.group_count");
    let n_v = meta_usize(gguf, "qwen35.ssm.time_step_rank");
    let dk = meta_usize(gguf, "qwen35.ssm.state_size");
    let inner = meta_usize(gguf, "qwen35.ssm.inner_size");
    let heads = Heads {
        n_k,
        n_v,
        dv: inner / n_v,
        key_dim: n_k * dk,
    };
    let mut out = Vec::new();
    for info in gguf.tensors() {
        let ne: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        let torch_shape: Vec<usize> = ne.iter().rev().copied().collect();
        let values = gguf.dequantize(&info.name).unwrap();
        let gguf_name = info.name.as_str();
        let (name, shape, values, derived) = if let Some(rest) = gguf_name.strip_prefix("blk.") {
            let (layer, t) = rest.split_once('.').unwrap();
            let l = |s: &str| format!("model.layers.{layer}.{s}");
            let la = |s: &str| format!("model.layers.{layer}.linear_attn.{s}");
            let minus_one = |v: &[f32]| v.iter().map(|x| x - 1.0).collect::<Vec<f32>>();
            let cols = ne[0];
            match t {
                "attn_norm.weight" => (
                    l("input_layernorm.weight"),
                    torch_shape,
                    minus_one(&values),
                    true,
                ),
                "post_attention_norm.weight" => (
                    l("post_attention_layernorm.weight"),
                    torch_shape,
                    minus_one(&values),
                    true,
                ),
                "attn_q_norm.weight" => (
                    l("self_attn.q_norm.weight"),
                    torch_shape,
                    minus_one(&values),
                    true,
                ),
                "attn_k_norm.weight" => (
                    l("self_attn.k_norm.weight"),
                    torch_shape,
                    minus_one(&values),
                    true,
                ),
                "attn_q.weight" => (l("self_attn.q_proj.weight"), torch_shape, values, false),
                "attn_k.weight" => (l("self_attn.k_proj.weight"), torch_shape, values, false),
                "attn_v.weight" => (l("self_attn.v_proj.weight"), torch_shape, values, false),
                "attn_output.weight" => (l("self_attn.o_proj.weight"), torch_shape, values, false),
                "ffn_gate.weight" => (l("mlp.gate_proj.weight"), torch_shape, values, false),
                "ffn_up.weight" => (l("mlp.up_proj.weight"), torch_shape, values, false),
                "ffn_down.weight" => (l("mlp.down_proj.weight"), torch_shape, values, false),
                "attn_qkv.weight" => {
                    let v = untile_rows(&values, cols, 2 * heads.key_dim, heads.dv, &heads);
                    (la("in_proj_qkv.weight"), torch_shape, v, false)
                }
                "attn_gate.weight" => {
                    let v = untile_rows(&values, cols, 0, heads.dv, &heads);
                    (la("in_proj_z.weight"), torch_shape, v, false)
                }
                "ssm_alpha.weight" => (
                    la("in_proj_a.weight"),
                    torch_shape,
                    untile_rows(&values, cols, 0, 1, &heads),
                    false,
                ),
                "ssm_beta.weight" => (
                    la("in_proj_b.weight"),
                    torch_shape,
                    untile_rows(&values, cols, 0, 1, &heads),
                    false,
                ),
                "ssm_out.weight" => (
                    la("out_proj.weight"),
                    torch_shape,
                    untile_cols(&values, cols, heads.dv, &heads),
                    false,
                ),
                "ssm_conv1d.weight" => {
                    // GGUF ne [K, C] is [C, K] row-major: per channel, K contiguous taps, as HF's [C, 1, K].
                    let (k, c) = (ne[0], ne[1]);
                    let v = untile_rows(&values, k, 2 * heads.key_dim, heads.dv, &heads);
                    (la("conv1d.weight"), vec![c, 1, k], v, false)
                }
                "ssm_a" => {
                    // ssm_a = −exp(A_log)  ⇒  A_log = ln(−ssm_a).
                    let a_log: Vec<f32> = values.iter().map(|a| (-a).ln()).collect();
                    (
                        la("A_log"),
                        torch_shape,
                        untile_rows(&a_log, 1, 0, 1, &heads),
                        true,
                    )
                }
                "ssm_dt.bias" => (
                    la("dt_bias"),
                    torch_shape,
                    untile_rows(&values, 1, 0, 1, &heads),
                    false,
                ),
                "ssm_norm.weight" => (la("norm.weight"), torch_shape, values, false),
                other => panic!("unexpected GGUF tensor blk.{layer}.{other}"),
            }
        } else {
            match gguf_name {
                "token_embd.weight" => (
                    "model.embed_tokens.weight".to_string(),
                    torch_shape,
                    values,
                    false,
                ),
                "output.weight" => ("lm_head.weight".to_string(), torch_shape, values, false),
                "output_norm.weight" => {
                    let v = values.iter().map(|x| x - 1.0).collect();
                    ("model.norm.weight".to_string(), torch_shape, v, true)
                }
                other => panic!("unexpected GGUF tensor {other}"),
            }
        };
        let is_conv = name.ends_with("conv1d.weight");
        let (values, dtype) = match storage {
            Storage::AllBf16 => {
                let v: Vec<f32> = if derived {
                    values.iter().map(|&x| round_bf16(x)).collect()
                } else {
                    values
                };
                (v, StDtype::Bf16)
            }
            Storage::Mixed if is_conv => {
                let all_f16 = values.iter().all(|&x| f32_to_f16_bits_exact(x).is_some());
                (values, if all_f16 { StDtype::F16 } else { StDtype::F32 })
            }
            Storage::Mixed if shape.len() == 1 => (values, StDtype::F32),
            Storage::Mixed => (values, StDtype::Bf16),
        };
        if dtype == StDtype::Bf16 {
            assert!(
                values
                    .iter()
                    .all(|&x| round_bf16(x).to_bits() == x.to_bits()),
                "{name}: GGUF values are not bf16"
            );
        }
        out.push(HfTensor {
            name,
            shape,
            values,
            dtype,
        });
    }
    out
}

fn encode(t: &HfTensor) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(t.values.len() * 4);
    for &x in &t.values {
        match t.dtype {
            StDtype::Bf16 => bytes.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
            StDtype::F16 => {
                bytes.extend_from_slice(&f32_to_f16_bits_exact(x).unwrap().to_le_bytes())
            }
            StDtype::F32 | StDtype::I32 => bytes.extend_from_slice(&x.to_le_bytes()),
        }
    }
    bytes
}

/// Writes `tensors` as a safetensors file (header padded with spaces to a multiple of 8 bytes).
pub fn write_safetensors(path: &Path, tensors: &[HfTensor]) {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut data = Vec::new();
    for t in tensors {
        let bytes = encode(t);
        let start = data.len();
        data.extend_from_slice(&bytes);
        header.insert(
            t.name.clone(),
            json!({ "dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).unwrap();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut file = Vec::with_capacity(8 + header.len() + data.len());
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
}

/// Writes `tensors` as `n` shards plus `model.safetensors.index.json` into `dir`.
pub fn write_sharded(dir: &Path, tensors: &[HfTensor], n: usize) {
    let per = tensors.len().div_ceil(n);
    let mut weight_map = Map::new();
    for (i, chunk) in tensors.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_safetensors(&dir.join(&file), chunk);
        for t in chunk {
            weight_map.insert(t.name.clone(), Value::String(file.clone()));
        }
    }
    let index = json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

/// Puts every tensor under the multimodal wrapper's `model.language_model.` prefix (`lm_head` stays).
pub fn wrap_multimodal(tensors: &[HfTensor]) -> Vec<HfTensor> {
    tensors
        .iter()
        .map(|t| HfTensor {
            name: match t.name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => t.name.clone(),
            },
            ..t.clone()
        })
        .collect()
}

/// A fresh, empty directory under cargo's temp dir for integration tests (`target/tmp`).
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
