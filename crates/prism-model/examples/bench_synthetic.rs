//! CPU speed of the f32 reference path on a model of Qwen3.5-0.8B's shape with random weights.
//!
//! `cargo run -p prism-model --example bench_synthetic [-- PATH]` writes the synthetic GGUF (BF16
//! matrices, tied embeddings, 248,320-row vocabulary; about 1.5 GB) to PATH (default
//! `/tmp/prism-synthetic-0.8b.gguf`) unless it exists, loads it in f32 and times a one-shot prefill,
//! a batch of prompts, decoding and a shared-prefix read-out. Only the public API is used, so the same
//! file can be timed against another version of the crate.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Tensor;
use prism_gguf::{GgmlType, GgufWriter, MetadataValue};
use prism_model::delta_rule::{self, RuleState};
use prism_model::{argmax, BatchItem, LoadOptions, ModelError, Qwen35Model};

const D: u64 = 1024;
const LAYERS: u64 = 24;
const FFN: u64 = 3584;
const N_H: u64 = 8;
const N_KV: u64 = 2;
const HEAD: u64 = 256;
const N_K: u64 = 16;
const N_V: u64 = 16;
const DK: u64 = 128;
const VOCAB: u64 = 248_320;

/// A deterministic uniform stream in `[-1, 1)`.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// How a tensor's values are drawn.
enum Fill {
    /// Uniform in `[-a, a]`.
    Uniform(f32),
    /// Uniform in `[lo, hi]`.
    Range(f32, f32),
    Const(f32),
}

fn tensors() -> Vec<(String, Vec<u64>, GgmlType, Fill)> {
    use Fill::*;
    use GgmlType::{BF16, F32};
    let conv_dim = 2 * N_K * DK + N_V * DK;
    let inner = N_V * DK;
    let matrix = |rows_in: u64| Uniform((3.0 / rows_in as f32).sqrt());
    let mut t = vec![
        (
            "token_embd.weight".to_string(),
            vec![D, VOCAB],
            BF16,
            Uniform(0.05),
        ),
        ("output_norm.weight".to_string(), vec![D], F32, Const(1.0)),
    ];
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.push((n("attn_norm.weight"), vec![D], F32, Const(1.0)));
        t.push((n("post_attention_norm.weight"), vec![D], F32, Const(1.0)));
        t.push((n("ffn_gate.weight"), vec![D, FFN], BF16, matrix(D)));
        t.push((n("ffn_up.weight"), vec![D, FFN], BF16, matrix(D)));
        t.push((n("ffn_down.weight"), vec![FFN, D], BF16, matrix(FFN)));
        if (l + 1) % 4 == 0 {
            t.push((n("attn_q.weight"), vec![D, 2 * N_H * HEAD], BF16, matrix(D)));
            t.push((n("attn_k.weight"), vec![D, N_KV * HEAD], BF16, matrix(D)));
            t.push((n("attn_v.weight"), vec![D, N_KV * HEAD], BF16, matrix(D)));
            t.push((
                n("attn_output.weight"),
                vec![N_H * HEAD, D],
                BF16,
                matrix(N_H * HEAD),
            ));
            t.push((n("attn_q_norm.weight"), vec![HEAD], F32, Const(1.0)));
            t.push((n("attn_k_norm.weight"), vec![HEAD], F32, Const(1.0)));
        } else {
            t.push((n("attn_qkv.weight"), vec![D, conv_dim], BF16, matrix(D)));
            t.push((n("attn_gate.weight"), vec![D, inner], BF16, matrix(D)));
            t.push((n("ssm_alpha.weight"), vec![D, N_V], BF16, matrix(D)));
            t.push((n("ssm_beta.weight"), vec![D, N_V], BF16, matrix(D)));
            t.push((n("ssm_out.weight"), vec![inner, D], BF16, matrix(inner)));
            t.push((n("ssm_conv1d.weight"), vec![4, conv_dim], F32, Uniform(0.5)));
            t.push((n("ssm_a"), vec![N_V], F32, Range(-2.0, -0.1)));
            t.push((n("ssm_dt.bias"), vec![N_V], F32, Uniform(1.0)));
            t.push((n("ssm_norm.weight"), vec![DK], F32, Const(1.0)));
        }
    }
    t
}

fn write_model(path: &PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let mut w = GgufWriter::new();
    let u32v = |v: u64| MetadataValue::U32(v as u32);
    // The metadata keys llama.cpp writes for a Qwen3.5 GGUF, as data: `tests/config_and_errors.rs`
    // lists the same keys for its own shapes (a table each; sharing it would hide what each file holds).
    let meta: Vec<(&str, MetadataValue)> = vec![
        (
            "general.architecture",
            MetadataValue::String("qwen35".into()),
        ),
        ("qwen35.block_count", u32v(LAYERS)),
        ("qwen35.context_length", u32v(262_144)),
        ("qwen35.embedding_length", u32v(D)),
        ("qwen35.feed_forward_length", u32v(FFN)),
        ("qwen35.attention.head_count", u32v(N_H)),
        ("qwen35.attention.head_count_kv", u32v(N_KV)),
        ("qwen35.attention.key_length", u32v(HEAD)),
        ("qwen35.attention.value_length", u32v(HEAD)),
        (
            "qwen35.attention.layer_norm_rms_epsilon",
            MetadataValue::F32(1e-6),
        ),
        ("qwen35.rope.freq_base", MetadataValue::F32(1e7)),
        ("qwen35.rope.dimension_count", u32v(64)),
        (
            "qwen35.rope.dimension_sections",
            MetadataValue::Array(
                [11, 11, 10, 0]
                    .into_iter()
                    .map(MetadataValue::I32)
                    .collect(),
            ),
        ),
        ("qwen35.ssm.conv_kernel", u32v(4)),
        ("qwen35.ssm.state_size", u32v(DK)),
        ("qwen35.ssm.group_count", u32v(N_K)),
        ("qwen35.ssm.time_step_rank", u32v(N_V)),
        ("qwen35.ssm.inner_size", u32v(N_V * DK)),
        ("qwen35.full_attention_interval", u32v(4)),
    ];
    for (k, v) in meta {
        w.add_metadata(k, v)?;
    }
    let list = tensors();
    for (name, dims, ty, _) in &list {
        w.add_tensor(name.clone(), dims, *ty)?;
    }
    let mut out = w.create(path)?;
    let mut rng = Lcg(42);
    for (_, dims, _, fill) in &list {
        let total: u64 = dims.iter().product();
        let mut left = total;
        while left > 0 {
            let n = left.min(1 << 20);
            let values: Vec<f32> = (0..n)
                .map(|_| match fill {
                    Fill::Uniform(a) => a * rng.next(),
                    Fill::Range(lo, hi) => lo + (hi - lo) * 0.5 * (rng.next() + 1.0),
                    Fill::Const(c) => *c,
                })
                .collect();
            out.write_f32(&values)?;
            left -= n;
        }
    }
    out.finish()?;
    Ok(())
}

/// Runs `f` once: its value and the seconds it took.
fn timed<T, E>(f: impl FnOnce() -> Result<T, E>) -> Result<(T, f64), E> {
    let start = Instant::now();
    let value = f()?;
    Ok((value, start.elapsed().as_secs_f64()))
}

/// Mean seconds per call of `f` over `reps` calls.
fn mean_secs<E>(reps: u32, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let ((), total) = timed(|| (0..reps).try_for_each(|_| f()))?;
    Ok(total / reps as f64)
}

/// The inputs of one delta-rule layer, `[T, H, …]` each.
struct RuleInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl RuleInputs {
    /// Tokens `start..start + len` of every input.
    fn rows(&self, start: usize, len: usize) -> candle_core::Result<Self> {
        let part = |x: &Tensor| x.narrow(0, start, len);
        Ok(Self {
            q: part(&self.q)?,
            k: part(&self.k)?,
            v: part(&self.v)?,
            g: part(&self.g)?,
            beta: part(&self.beta)?,
        })
    }

    fn chunked(&self, state: &RuleState) -> candle_core::Result<(Tensor, RuleState)> {
        delta_rule::chunked(&self.q, &self.k, &self.v, &self.g, &self.beta, state)
    }

    fn recurrent(&self, memory: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        delta_rule::recurrent(&self.q, &self.k, &self.v, &self.g, &self.beta, memory)
    }
}

/// The delta rule alone at this shape (16 heads, dk = dv = 128): one decode token after 40 tokens of
/// the current chunk, row form (what the model runs) against candle tensor ops of the recurrent step.
fn bench_delta_rule() -> candle_core::Result<()> {
    let dev = candle_core::Device::Cpu;
    let (h, dk) = (N_V as usize, DK as usize);
    let unit = |t: usize| -> candle_core::Result<Tensor> {
        let x = Tensor::randn(0f32, 1.0, (t, h, dk), &dev)?;
        x.broadcast_div(&x.sqr()?.sum_keepdim(2)?.sqrt()?)
    };
    let inputs = RuleInputs {
        q: unit(41)?,
        k: unit(41)?,
        v: Tensor::randn(0f32, 1.0, (41, h, dk), &dev)?,
        g: Tensor::rand(-1f32, 0.0, (41, h), &dev)?,
        beta: Tensor::rand(0f32, 1.0, (41, h), &dev)?,
    };
    let start = RuleState::zeros(h, dk, dk, candle_core::DType::F32, &dev)?;
    let (_, state) = inputs.rows(0, 40)?.chunked(&start)?;
    let memory = state.memory()?;
    let reps = 50;
    let row_form = mean_secs(reps, || inputs.rows(40, 1)?.chunked(&state).map(drop))?;
    let recurrent = mean_secs(reps, || inputs.rows(40, 1)?.recurrent(&memory).map(drop))?;
    println!(
        "delta rule, one decode token, one layer: row form {:.0} µs, recurrent tensor ops {:.0} µs",
        row_form * 1e6,
        recurrent * 1e6
    );
    Ok(())
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919)) % VOCAB as u32)
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/prism-synthetic-0.8b.gguf"));
    if !path.exists() {
        let ((), secs) = timed(|| write_model(&path))?;
        println!("wrote {} in {:.1} s", path.display(), secs);
    }
    let (model, secs) = timed(|| Qwen35Model::load(&path, &LoadOptions::default()))?;
    println!("load (dequantize to f32): {secs:.1} s");

    // One-shot prefill of 512 tokens, then 16 greedy decode steps with full logits.
    let prompt = tokens(512, 1);
    let mut state = model.new_state()?;
    let (mut hidden, prefill) = timed(|| model.prefill(&mut state, &prompt))?;
    println!(
        "prefill 512 tokens: {:.2} s ({:.0} tokens/s)",
        prefill,
        512.0 / prefill
    );
    let decode = mean_secs(16, || {
        let next = argmax(&model.logits(&hidden)?)?;
        hidden = model.prefill(&mut state, &[next])?;
        Ok::<(), ModelError>(())
    })?;
    println!(
        "decode (full logits + one token): {:.0} ms/token",
        decode * 1e3
    );

    // A batch of 4 prompts of 128 tokens.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(128, 10 + i)).collect();
    let mut states: Vec<_> = prompts
        .iter()
        .map(|_| model.new_state())
        .collect::<Result<_, _>>()?;
    let mut items: Vec<BatchItem<'_>> = states
        .iter_mut()
        .zip(&prompts)
        .map(|(s, p)| BatchItem::new(s, p))
        .collect();
    let (_, batch) = timed(|| model.forward(&mut items))?;
    println!(
        "batch of 4 x 128 tokens: {:.2} s ({:.0} tokens/s)",
        batch,
        512.0 / batch
    );

    // Read-out: 4 prompts sharing a 300-token prefix, 40 tokens each after it, 26 letter rows.
    let prefix = tokens(300, 99);
    let readout: Vec<Vec<u32>> = (0..4)
        .map(|i| prefix.iter().copied().chain(tokens(40, 200 + i)).collect())
        .collect();
    let refs: Vec<&[u32]> = readout.iter().map(|p| p.as_slice()).collect();
    let rows: Vec<u32> = (0..26).map(|i| 32 + i).collect();
    let (letters, secs) = timed(|| model.last_position_rows(&refs, &rows))?;
    println!(
        "read-out (4 prompts, 300 shared + 40 own tokens, 26 rows): {:.2} s; first logit {:.4}",
        secs, letters[0][0]
    );

    bench_delta_rule()?;
    Ok(())
}
