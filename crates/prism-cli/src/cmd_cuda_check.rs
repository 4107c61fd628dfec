//! `prism cuda-check`: the device tests of our CUDA kernels and of the model on CUDA.
//!
//! The device machine has no Rust toolchain, so these tests ship inside the binary. Each kernel runs on
//! fresh random inputs next to its CPU twin (the one CI tests) and reports ‖Δ‖/‖ref‖ and max |Δ|; the
//! split- and batch-invariance of the GPU kernels is checked bit for bit; the model runs the fixture
//! prompts in bf16 on CUDA against transformers' reference logits and against the CPU bf16 path; the
//! fp8 K/V cache (`--kv-fp8`) is checked against its CPU twin (bytes and scales bit for bit).
//! Exit status 1 if any check fails its bound.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_model::attention::CausalAttention;
use prism_model::delta_rule::{self, RuleState};
use prism_model::{LoadOptions, Precision, Qwen35Model};
use serde_json::{json, Value};

/// The tensor-core attention kernel's checks (a child module: it reports through [`Report`]).
#[path = "cmd_cuda_check_flash.rs"]
mod flash;

/// The batched delta rule's checks (bitwise against one call each and the per-segment kernels, CPU
/// twin, launch limits, 27B timings).
#[path = "cmd_cuda_check_delta.rs"]
mod delta;

/// The fused small kernels' checks (norms, SwiGLU, conv + SiLU, gates, bf16 GEMM inputs).
#[path = "cmd_cuda_check_fused.rs"]
mod fused;
#[path = "cmd_cuda_check_quant.rs"]
mod quant;

/// The fp8 K/V cache's checks (quantize/dequantize bit for bit against the CPU twin, the fp8 flash
/// kernel, the fixture model with fp8 K/V, timings).
#[path = "cmd_cuda_check_kv_fp8.rs"]
mod kv_fp8;

/// Deterministic pseudo-random numbers (xorshift64*), uniform in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn tensor(&mut self, shape: &[usize], scale: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.next_f32() * scale).collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }
}

struct Report {
    rows: Vec<Value>,
    failed: usize,
}

impl Report {
    fn compare(&mut self, name: &str, got: &Tensor, want: &Tensor, bound: f64) -> Result<()> {
        let got = got
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?;
        let want = want
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?;
        let diff = (&got - &want)?;
        let norm_d = diff.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        let norm_r = want.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        let max_abs = diff.abs()?.max(0)?.to_scalar::<f64>()?;
        let rel = if norm_r > 0.0 {
            norm_d / norm_r
        } else {
            norm_d
        };
        let ok = rel.is_finite() && rel <= bound;
        println!(
            "{:<58} ‖Δ‖/‖ref‖ {rel:>10.3e}  max|Δ| {max_abs:>10.3e}  bound {bound:.0e}  {}",
            name,
            if ok { "ok" } else { "FAIL" }
        );
        self.failed += usize::from(!ok);
        self.rows
            .push(json!({"check": name, "rel": rel, "max_abs": max_abs, "bound": bound, "ok": ok}));
        Ok(())
    }

    fn identical(&mut self, name: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        let a: Vec<f32> = a
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let b: Vec<f32> = b
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let differing = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
            + a.len().abs_diff(b.len());
        let ok = differing == 0;
        println!(
            "{:<58} {differing} of {} elements differ in bits  {}",
            name,
            a.len(),
            if ok { "ok" } else { "FAIL" }
        );
        self.failed += usize::from(!ok);
        self.rows
            .push(json!({"check": name, "differing_bits": differing, "ok": ok}));
        Ok(())
    }

    fn note(&mut self, name: &str, value: Value) {
        println!("{name:<58} {value}");
        self.rows.push(json!({"check": name, "value": value}));
    }
}

/// Random delta-rule inputs `[q, k, v, g, beta]` with the value ranges of real ones.
fn delta_rule_inputs(
    rng: &mut Rng,
    t: usize,
    h: usize,
    dk: usize,
    dv: usize,
) -> Result<[Tensor; 5]> {
    let q = prism_model::ops::l2_norm(&rng.tensor(&[t, h, dk], 1.0)?, 1e-6)?;
    let q = (q * (1.0 / (dk as f64).sqrt()))?;
    let k = prism_model::ops::l2_norm(&rng.tensor(&[t, h, dk], 1.0)?, 1e-6)?;
    let v = rng.tensor(&[t, h, dv], 1.0)?;
    let g = ((rng.tensor(&[t, h], 1.0)? - 1.0)? * 0.1)?; // log-decays in (-0.2, 0]
    let beta = ((rng.tensor(&[t, h], 0.5)? + 0.5)?).clamp(0.01f32, 0.99f32)?;
    Ok([q, k, v, g, beta])
}

/// The delta rule over `x` on `device` from `state`, in calls of the given sizes (the last one takes
/// what is left); returns all outputs and the final state.
fn delta_rule_in_pieces(
    x: &[Tensor; 5],
    device: &Device,
    state: &RuleState,
    pieces: &[usize],
) -> Result<(Tensor, RuleState)> {
    let t = x[0].dim(0)?;
    let mut state = state.clone();
    let mut outs = Vec::new();
    let mut at = 0;
    for (i, &piece) in pieces.iter().enumerate() {
        let n = if i + 1 == pieces.len() {
            t - at
        } else {
            piece.min(t - at)
        };
        if n == 0 {
            continue;
        }
        let s = |x: &Tensor| -> Result<Tensor> { Ok(x.narrow(0, at, n)?.to_device(device)?) };
        let (o, next) = delta_rule::chunked(
            &s(&x[0])?,
            &s(&x[1])?,
            &s(&x[2])?,
            &s(&x[3])?,
            &s(&x[4])?,
            &state,
        )?;
        outs.push(o);
        state = next;
        at += n;
    }
    if at != t {
        bail!("piece sizes cover {at} of {t} tokens");
    }
    Ok((Tensor::cat(&outs, 0)?, state))
}

fn delta_rule_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // Real 27B DeltaNet head shapes: dk = dv = 128; 3 heads keep the CPU twin quick.
    let (t, h, dk, dv) = (300usize, 3usize, 128usize, 128usize);
    let x = delta_rule_inputs(rng, t, h, dk, dv)?;
    let cpu_state = RuleState::zeros(h, dk, dv, DType::F32, &Device::Cpu)?;
    let gpu_state = RuleState::zeros(h, dk, dv, DType::F32, gpu)?;
    let (want, want_state) = delta_rule_in_pieces(&x, &Device::Cpu, &cpu_state, &[t])?;
    let (got, got_state) = delta_rule_in_pieces(&x, gpu, &gpu_state, &[t])?;
    r.compare(
        "delta rule chunked, T=300 H=3 dk=dv=128: output",
        &got,
        &want,
        1e-4,
    )?;
    r.compare(
        "delta rule chunked: memory after 300 tokens",
        &got_state.memory()?,
        &want_state.memory()?,
        1e-4,
    )?;

    // The same tokens in pieces (decode-like single steps included, pieces starting at chunk rows that
    // are not multiples of 16) must give the same bits on the GPU.
    for pieces in [
        &[1usize, 63, 1, 64, 7, 100, 1, 1, 62][..],
        &[5, 17, 200, 3, 1, 74],
        &[3, 13, 16, 33, 1, 1, 1, 29, 203],
    ] {
        let (o, state) = delta_rule_in_pieces(&x, gpu, &gpu_state, pieces)?;
        let name = format!("delta rule (GPU): pieces {pieces:?} vs one call");
        r.identical(&name, &o, &got)?;
        r.identical(
            &format!("  … memory after {pieces:?}"),
            &state.memory()?,
            &got_state.memory()?,
        )?;
        r.identical(
            &format!("  … pending values after {pieces:?}"),
            &state.pending_u,
            &got_state.pending_u,
        )?;
    }

    // 27B head count (48) from a non-zero memory: the grid, not the math, changes.
    let h = 48;
    let x = delta_rule_inputs(rng, 275, h, dk, dv)?;
    let s0 = rng.tensor(&[h, dk, dv], 0.5)?;
    let (want, want_state) =
        delta_rule_in_pieces(&x, &Device::Cpu, &RuleState::from_memory(&s0)?, &[275])?;
    let gpu_s0 = RuleState::from_memory(&s0.to_device(gpu)?)?;
    let (got, got_state) = delta_rule_in_pieces(&x, gpu, &gpu_s0, &[275])?;
    r.compare(
        "delta rule chunked, T=275 H=48 from a random memory: output",
        &got,
        &want,
        1e-4,
    )?;
    r.compare(
        "delta rule chunked, H=48: memory after 275 tokens",
        &got_state.memory()?,
        &want_state.memory()?,
        1e-4,
    )?;
    let (o, _) = delta_rule_in_pieces(&x, gpu, &gpu_s0, &[100, 1, 1, 173])?;
    r.identical(
        "delta rule (GPU), H=48: pieces 100/1/1/173 vs one call",
        &o,
        &got,
    )?;

    // A long prompt takes several launches (32 chunks each); then single decode steps.
    let (t, h) = (2200usize, 2usize);
    let x = delta_rule_inputs(rng, t, h, dk, dv)?;
    let cpu_state = RuleState::zeros(h, dk, dv, DType::F32, &Device::Cpu)?;
    let gpu_state = RuleState::zeros(h, dk, dv, DType::F32, gpu)?;
    let (want, want_state) = delta_rule_in_pieces(&x, &Device::Cpu, &cpu_state, &[t])?;
    let (got, got_state) = delta_rule_in_pieces(&x, gpu, &gpu_state, &[t])?;
    r.compare(
        "delta rule chunked, T=2200 (several launches): output",
        &got,
        &want,
        1e-4,
    )?;
    r.compare(
        "delta rule chunked, T=2200: memory",
        &got_state.memory()?,
        &want_state.memory()?,
        1e-4,
    )?;
    let (o, state) = delta_rule_in_pieces(&x, gpu, &gpu_state, &[2047, 1, 100, 1, 1, 1, 1])?;
    r.identical(
        "delta rule (GPU): prefill 2047/1/100 + decode steps vs one call",
        &o,
        &got,
    )?;
    r.identical(
        "delta rule (GPU): memory after decode steps vs one call",
        &state.memory()?,
        &got_state.memory()?,
    )?;
    Ok(())
}

fn norm_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let x = rng.tensor(&[257, 5120], 2.0)?;
    let w = rng.tensor(&[5120], 1.0)?;
    let want = prism_model::ops::rms_norm(&x, &w, 1e-6)?;
    let got = prism_model::ops::rms_norm(&x.to_device(gpu)?, &w.to_device(gpu)?, 1e-6)?;
    r.compare("rms_norm [257, 5120]", &got, &want, 1e-6)?;
    // A row alone vs inside the batch: the same bits.
    let alone = prism_model::ops::rms_norm(
        &x.narrow(0, 100, 1)?.to_device(gpu)?,
        &w.to_device(gpu)?,
        1e-6,
    )?;
    r.identical(
        "rms_norm (GPU): row 100 alone vs in a batch of 257",
        &alone,
        &got.narrow(0, 100, 1)?,
    )?;

    let x = rng.tensor(&[190, 48, 128], 2.0)?;
    let z = rng.tensor(&[190, 48, 128], 3.0)?;
    let w = rng.tensor(&[128], 1.0)?;
    let want = prism_model::ops::gated_rms_norm(&x, &z, &w, 1e-6)?;
    let got = prism_model::ops::gated_rms_norm(
        &x.to_device(gpu)?,
        &z.to_device(gpu)?,
        &w.to_device(gpu)?,
        1e-6,
    )?;
    r.compare("gated rms_norm [190, 48, 128]", &got, &want, 1e-6)?;
    let want = prism_model::ops::l2_norm(&x, 1e-6)?;
    let got = prism_model::ops::l2_norm(&x.to_device(gpu)?, 1e-6)?;
    r.compare("l2_norm [190, 48, 128]", &got, &want, 1e-6)?;

    // The delta rule's query norm: one kernel for the L2 norm and the 1/√dk scale, read in place from
    // the conv output's head view, with the bits of the norm of a copy followed by candle's affine.
    let conv_out = rng.tensor(&[190, 80, 128], 1.0)?.to_device(gpu)?;
    let q_view = conv_out.narrow(1, 0, 16)?;
    let scale = 1.0 / 128f64.sqrt();
    let fused = prism_model::ops::l2_norm_scaled(&q_view, 1e-6, scale)?;
    let separate = (prism_model::ops::l2_norm(&q_view.contiguous()?, 1e-6)? * scale)?;
    r.identical(
        "l2_norm_scaled (GPU) of a head view vs l2_norm of a copy, then × 1/√128",
        &fused,
        &separate,
    )?;
    let cpu = prism_model::ops::l2_norm_scaled(&q_view.to_device(&Device::Cpu)?, 1e-6, scale)?;
    r.compare(
        "l2_norm_scaled [190, 16, 128] of a view (GPU vs CPU)",
        &fused,
        &cpu,
        1e-6,
    )?;
    Ok(())
}

fn conv_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let (t, c, k) = (190usize, 10240usize, 4usize);
    let x = rng.tensor(&[t, c], 1.0)?;
    let window = rng.tensor(&[k - 1, c], 1.0)?;
    let taps = rng.tensor(&[k, c], 1.0)?;
    let (want, want_w) = prism_model::delta_net::causal_conv(&x, &window, &taps)?;
    let (got, got_w) = prism_model::delta_net::causal_conv(
        &x.to_device(gpu)?,
        &window.to_device(gpu)?,
        &taps.to_device(gpu)?,
    )?;
    r.identical(
        "causal conv [190, 10240] K=4 (GPU vs CPU, bitwise)",
        &got,
        &want,
    )?;
    r.identical(
        "causal conv: new window (GPU vs CPU, bitwise)",
        &got_w,
        &want_w,
    )?;
    Ok(())
}

fn attention_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // 27B attention shapes: 24 query heads, 4 KV heads, head dim 256.
    let (past, t, n_h, n_kv, hd) = (70usize, 130usize, 24usize, 4usize, 256usize);
    let q = rng.tensor(&[t, n_h, hd], 1.0)?;
    let k = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let v = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let op = CausalAttention {
        past,
        n_heads: n_h,
        scale,
    };
    let want = q.apply_op3_no_bwd(&k, &v, &op)?;
    let got = prism_model::cuda::causal_attention(
        &q.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past,
        scale,
    )?;
    r.compare(
        "causal attention, 70 cached + 130 new, 24/4 heads, hd 256",
        &got,
        &want,
        1e-5,
    )?;
    // The last 30 queries as their own call (100 more cached keys): the same bits.
    let tail = prism_model::cuda::causal_attention(
        &q.narrow(0, 100, 30)?.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past + 100,
        scale,
    )?;
    r.identical(
        "causal attention (GPU): last 30 queries alone vs in the call",
        &tail,
        &got.narrow(0, 100, 30)?,
    )?;
    // The last query as a decode step (T = 1: one row per block).
    let last = prism_model::cuda::causal_attention(
        &q.narrow(0, 129, 1)?.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past + 129,
        scale,
    )?;
    r.identical(
        "causal attention (GPU): last query as a decode step vs in the call",
        &last,
        &got.narrow(0, 129, 1)?,
    )?;

    // 4B/9B shapes: 16 query heads over 4 KV heads (other rows × heads per block).
    let (past, t, n_h, n_kv, hd) = (5usize, 250usize, 16usize, 4usize, 256usize);
    let q = rng.tensor(&[t, n_h, hd], 1.0)?;
    let k = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let v = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let op = CausalAttention {
        past,
        n_heads: n_h,
        scale,
    };
    let want = q.apply_op3_no_bwd(&k, &v, &op)?;
    let got = prism_model::cuda::causal_attention(
        &q.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past,
        scale,
    )?;
    r.compare(
        "causal attention, 5 cached + 250 new, 16/4 heads, hd 256",
        &got,
        &want,
        1e-5,
    )?;
    let tail = prism_model::cuda::causal_attention(
        &q.narrow(0, 243, 7)?.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past + 243,
        scale,
    )?;
    r.identical(
        "causal attention (GPU), 16/4 heads: last 7 queries alone vs in the call",
        &tail,
        &got.narrow(0, 243, 7)?,
    )?;

    // A long prompt at a head dim the flash kernel lacks (160) takes the batched-matmul path (pieces of
    // query rows): 2,500 new tokens after 300. (Head dims 64/128/256 run the flash kernel at every
    // length: `cmd_cuda_check_flash.rs`.)
    let (past, t, n_h, n_kv, hd) = (300usize, 2500usize, 8usize, 2usize, 160usize);
    let q = rng.tensor(&[t, n_h, hd], 1.0)?;
    let k = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let v = rng.tensor(&[n_kv, past + t, hd], 1.0)?;
    let want = prism_model::attention::attend_segment(&q, &k, &v, past, scale)?;
    let got = prism_model::attention::attend_segment(
        &q.to_device(gpu)?,
        &k.to_device(gpu)?,
        &v.to_device(gpu)?,
        past,
        scale,
    )?;
    r.compare(
        "attention, long prompt (matmul path, hd 160): 300 cached + 2500 new",
        &got,
        &want,
        1e-4,
    )?;
    Ok(())
}

/// The logits of a reference file (`{"prompts": [{"logits": [...]}, ...]}`) as a `[prompts, vocab]`
/// tensor, checked against the expected shape.
fn reference_logits(path: &std::path::Path, (n, vocab): (usize, usize)) -> Result<Tensor> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let prompts = json["prompts"]
        .as_array()
        .with_context(|| format!("{}: no prompts", path.display()))?;
    let mut values = Vec::with_capacity(n * vocab);
    for (i, entry) in prompts.iter().take(n).enumerate() {
        let logits = entry["logits"]
            .as_array()
            .with_context(|| format!("{}: prompt {i} has no logits", path.display()))?;
        if logits.len() != vocab {
            anyhow::bail!(
                "{}: prompt {i} has {} logits, expected {vocab}",
                path.display(),
                logits.len()
            );
        }
        for x in logits {
            values.push(x.as_f64().with_context(|| {
                format!("{}: prompt {i}: a logit is not a number", path.display())
            })? as f32);
        }
    }
    if values.len() != n * vocab {
        anyhow::bail!(
            "{}: {} prompts, expected {n}",
            path.display(),
            prompts.len()
        );
    }
    Ok(Tensor::from_vec(values, (n, vocab), &Device::Cpu)?)
}

/// Mean |a − b| over all elements (f64).
fn mean_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    Ok((a - b)?.abs()?.mean_all()?.to_scalar::<f64>()?)
}

/// The 12 prompts of the fixture's prompts.json, as token ids.
fn fixture_prompts(fixtures: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    let path = fixtures.join("prompts.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    json["prompts"]
        .as_array()
        .context("prompts.json: no prompts")?
        .iter()
        .map(|p| {
            p["ids"].as_array().map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect()
            })
        })
        .collect::<Option<_>>()
        .context("prompts.json: bad ids")
}

/// The tiny fixture model in bf16 on CUDA against transformers (fp32) and against the CPU bf16 path.
fn model_checks(r: &mut Report, gpu: &Device, fixtures: &std::path::Path) -> Result<()> {
    let read = |name: &str| -> Result<Value> {
        let path = fixtures.join(name);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let prompts = fixture_prompts(fixtures)?;
    let reference = read("ref_transformers.json")?;
    let entries = reference["prompts"]
        .as_array()
        .context("ref_transformers.json: no prompts")?;
    let gguf = fixtures.join("tiny-BF16.gguf");
    let load = |device: &Device| {
        Qwen35Model::load(
            &gguf,
            &LoadOptions {
                device: device.clone(),
                precision: Precision::Bf16,
                ..LoadOptions::default()
            },
        )
    };
    let gpu_model = load(gpu)?;
    let cpu_model = load(&Device::Cpu)?;
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let gpu_logits = gpu_model
        .logits(&gpu_model.last_hidden(&refs)?)?
        .to_device(&Device::Cpu)?;
    let cpu_logits = cpu_model.logits(&cpu_model.last_hidden(&refs)?)?;
    let mut argmax_same = 0;
    let mut worst_ref = 0f64;
    for (i, entry) in entries.iter().enumerate() {
        let want: Vec<f32> = entry["logits"]
            .as_array()
            .context("reference logits")?
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        let want = Tensor::from_vec(want, gpu_logits.dim(1)?, &Device::Cpu)?;
        let got = gpu_logits.get(i)?;
        let d = (got.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
            .abs()?
            .max(0)?
            .to_scalar::<f64>()?;
        worst_ref = worst_ref.max(d);
        if prism_model::argmax(&got)? == prism_model::argmax(&want)? {
            argmax_same += 1;
        }
    }
    r.note(
        "model bf16 on CUDA vs transformers fp32: max |Δ| over 12 prompts",
        json!(worst_ref),
    );
    r.note(
        "model bf16 on CUDA vs transformers fp32: same argmax",
        json!(format!("{argmax_same} of {}", entries.len())),
    );
    r.compare(
        "model bf16: CUDA vs CPU logits, 12 prompts",
        &gpu_logits,
        &cpu_logits,
        2e-2,
    )?;
    if argmax_same != entries.len() {
        r.failed += 1;
        println!(
            "FAIL: argmax differs from transformers on {} prompts",
            entries.len() - argmax_same
        );
    }
    // One prompt alone vs inside the 12-prompt batch (cuBLAS bf16 matmuls are not batch-invariant: reported).
    let alone = gpu_model
        .logits(&gpu_model.last_hidden(&refs[3..4])?)?
        .to_device(&Device::Cpu)?;
    let diff = (alone.get(0)? - gpu_logits.get(3)?)?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?;
    r.note(
        "model bf16 on CUDA: prompt 3 alone vs batched, max |Δ| (not batch-invariant yet)",
        json!(diff),
    );
    Ok(())
}

/// The integer path on the GPU: the tiny Q8_0 (int8) and Q4_K_M (w4a8) files. Its matmuls equal the CPU reference bit for bit (cuda-quant-check); here the whole forward
/// pass is checked for invariance on the GPU (alone vs batched, shared prefix, pieces) bit for bit, and
/// its distance to the CPU integer path (whose norms, attention and delta rule use other reduction
/// orders) is reported.
fn integer_model_checks(
    r: &mut Report,
    gpu: &Device,
    fixtures: &std::path::Path,
    prompts: &[Vec<u32>],
) -> Result<()> {
    for (file, precision) in [
        ("tiny-Q8_0.gguf", Precision::Int8),
        ("tiny-Q4_K_M.gguf", Precision::W4a8),
    ] {
        let label = precision.as_str();
        let gguf = prism_gguf::GgufFile::open(fixtures.join(file))
            .with_context(|| format!("opening {file}"))?;
        let cpu_opts = LoadOptions {
            device: Device::Cpu,
            precision,
            ..LoadOptions::default()
        };
        let gpu_opts = LoadOptions {
            device: gpu.clone(),
            ..cpu_opts.clone()
        };
        let gpu_model = Qwen35Model::from_gguf(&gguf, &gpu_opts)?;
        let cpu_model = Qwen35Model::from_gguf(&gguf, &cpu_opts)?;
        let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
        let hidden = gpu_model.last_hidden(&refs)?;
        let batched = gpu_model.logits(&hidden)?;
        let cpu = cpu_model.logits(&cpu_model.last_hidden(&refs)?)?;
        // The read-out's rows: the output head lives on the GPU only, its rows gathered there.
        let letters: Vec<u32> = vec![32, 33, 34, 35, 7, 32];
        let picked = Tensor::from_slice(&letters, letters.len(), gpu)?;
        r.identical(
            &format!("{label} (GPU): logits of 6 selected vocabulary rows vs those columns"),
            &gpu_model.logits_for_rows(&hidden, &letters)?,
            &batched.index_select(&picked, 1)?,
        )?;
        // The GPU's attention rounds q, k, v and p to bf16 (the flash kernel) where the CPU's is f32, and
        // the random tiny model turns each int8 rounding that flips into a visible change: the distance
        // between the two integer paths is bounded loosely (a wrong kernel gives ~1), and the pass/fail
        // that matters is each path's error against the exact-arithmetic reference below.
        r.compare(
            &format!("{label} ({file}): GPU vs CPU integer path, 12 prompts"),
            &batched,
            &cpu,
            1e-1,
        )?;
        let reference = fixtures.join(match precision {
            Precision::Int8 => "ref_transformers_dequant_Q8_0.json",
            _ => "ref_transformers_dequant_Q4_K_M.json",
        });
        let want = reference_logits(&reference, batched.dims2()?)?;
        let gpu_err = mean_abs_diff(&batched, &want)?;
        let cpu_err = mean_abs_diff(&cpu, &want)?;
        r.note(
            &format!("{label}: mean |Δ| vs transformers on the dequantized weights, GPU"),
            json!(gpu_err),
        );
        r.note(
            &format!("{label}: mean |Δ| vs transformers on the dequantized weights, CPU"),
            json!(cpu_err),
        );
        let ok = gpu_err.is_finite() && gpu_err <= 1.25 * cpu_err;
        println!(
            "{:<58} GPU {gpu_err:.4} vs CPU {cpu_err:.4} (bound 1.25×)  {}",
            format!("{label}: GPU error no worse than the CPU reference's"),
            if ok { "ok" } else { "FAIL" }
        );
        r.failed += usize::from(!ok);
        r.rows.push(json!({"check": format!("{label}: GPU error vs CPU error"), "gpu": gpu_err, "cpu": cpu_err, "ok": ok}));
        let alone = gpu_model.logits(&gpu_model.last_hidden(&refs[3..4])?)?;
        r.identical(
            &format!("{label} (GPU): prompt 3 alone vs in a batch of 12, all logits"),
            &alone,
            &batched.narrow(0, 3, 1)?,
        )?;
        let with_two = gpu_model.logits(&gpu_model.last_hidden(&[refs[7], refs[3], refs[1]])?)?;
        r.identical(
            &format!("{label} (GPU): prompt 3 between prompts 7 and 1"),
            &with_two.narrow(0, 1, 1)?,
            &alone,
        )?;
        // Shared prefix: the prompts share their chat-template opening; branch from it.
        let shared = gpu_model.logits(&gpu_model.last_hidden_shared_prefix(&refs[..4])?)?;
        r.identical(
            &format!("{label} (GPU): 4 prompts branched from their shared prefix vs one batch"),
            &shared,
            &batched.narrow(0, 0, 4)?,
        )?;
        // Pieces: prompt 0 in pieces of 1, 7, 64 and the rest.
        let p0 = &prompts[0];
        let mut state = gpu_model.new_state()?;
        let mut at = 0;
        let mut last = None;
        for piece in [1usize, 7, 64, usize::MAX] {
            let n = piece.min(p0.len() - at);
            if n == 0 {
                break;
            }
            last = Some(gpu_model.prefill(&mut state, &p0[at..at + n])?);
            at += n;
        }
        let last = last.context("prompt 0 is empty")?;
        r.identical(
            &format!("{label} (GPU): prompt 0 in pieces 1/7/64/rest vs one call"),
            &gpu_model.logits(&last)?,
            &batched.narrow(0, 0, 1)?,
        )?;
    }
    Ok(())
}

pub fn run(fixtures: Option<PathBuf>, json_out: Option<PathBuf>) -> Result<()> {
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let fixtures = fixtures.unwrap_or_else(|| PathBuf::from("tests/fixtures/qwen35-tiny"));
    let mut report = Report {
        rows: Vec::new(),
        failed: 0,
    };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    norm_checks(&mut report, &gpu, &mut rng)?;
    conv_checks(&mut report, &gpu, &mut rng)?;
    attention_checks(&mut report, &gpu, &mut rng)?;
    flash::checks(&mut report, &gpu)?;
    fused::checks(&mut report, &gpu)?;
    delta_rule_checks(&mut report, &gpu, &mut rng)?;
    delta::checks(&mut report, &gpu)?;
    model_checks(&mut report, &gpu, &fixtures)?;
    quant::checks(&mut report, &gpu)?;
    let prompts = fixture_prompts(&fixtures)?;
    integer_model_checks(&mut report, &gpu, &fixtures, &prompts)?;
    kv_fp8::checks(&mut report, &gpu, &fixtures, &prompts)?;
    if let Some(path) = json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report.rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if report.failed > 0 {
        bail!("{} CUDA checks failed", report.failed);
    }
    println!("all CUDA checks passed");
    Ok(())
}
