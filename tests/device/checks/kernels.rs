//! Kernels against their CPU twins on random inputs, and their split and batch invariance bit for bit:
//! the norms, the causal conv, the one-warp-per-row attention kernel (and the batched-matmul route of
//! head dims the flash kernel lacks) and the chunked delta rule (one call, pieces, decode steps, 48
//! heads from a random memory, a prompt of several launches). One random stream runs through all four
//! in this order, so each gets the inputs it has always had.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use prism_model::attention::CausalAttention;
use prism_model::delta_rule::{self, RuleState};

use crate::harness::{Report, Rng};

/// The group: norms, conv, attention, then the delta rule, on one random stream.
pub fn checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    norm_checks(r, gpu, &mut rng)?;
    conv_checks(r, gpu, &mut rng)?;
    attention_checks(r, gpu, &mut rng)?;
    delta_rule_checks(r, gpu, &mut rng)
}

/// Random delta-rule inputs `[q, k, v, g, beta]` with the value ranges of real ones.
pub fn delta_rule_inputs(
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

/// `delta_rule::chunked` on rows `start..start + n` of `x`, on `device`, from `state`.
pub fn chunked_rows(
    x: &[Tensor; 5],
    (start, n): (usize, usize),
    device: &Device,
    state: &RuleState,
) -> Result<(Tensor, RuleState)> {
    let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(0, start, n)?.to_device(device)?) };
    Ok(delta_rule::chunked(
        &rows(&x[0])?,
        &rows(&x[1])?,
        &rows(&x[2])?,
        &rows(&x[3])?,
        &rows(&x[4])?,
        state,
    )?)
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
        let (o, next) = chunked_rows(x, (at, n), device, &state)?;
        outs.push(o);
        state = next;
        at += n;
    }
    if at != t {
        bail!("piece sizes cover {at} of {t} tokens");
    }
    Ok((Tensor::cat(&outs, 0)?, state))
}

/// The delta rule over all of `x` as one call on the CPU and on the GPU, each from its starting
/// state: the output and the memory compared (`names`), within 1e-4; the GPU's output and state.
fn one_call(
    r: &mut Report,
    gpu: &Device,
    x: &[Tensor; 5],
    (cpu_state, gpu_state): (&RuleState, &RuleState),
    names: [&str; 2],
) -> Result<(Tensor, RuleState)> {
    let t = x[0].dim(0)?;
    let (want, want_state) = delta_rule_in_pieces(x, &Device::Cpu, cpu_state, &[t])?;
    let (got, got_state) = delta_rule_in_pieces(x, gpu, gpu_state, &[t])?;
    r.compare(names[0], &got, &want, 1e-4)?;
    r.compare(names[1], &got_state.memory()?, &want_state.memory()?, 1e-4)?;
    Ok((got, got_state))
}

fn delta_rule_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // Real 27B DeltaNet head shapes: dk = dv = 128; 3 heads keep the CPU twin quick.
    let (t, h, dk, dv) = (300usize, 3usize, 128usize, 128usize);
    let x = delta_rule_inputs(rng, t, h, dk, dv)?;
    let cpu_state = RuleState::zeros(h, dk, dv, DType::F32, &Device::Cpu)?;
    let gpu_state = RuleState::zeros(h, dk, dv, DType::F32, gpu)?;
    let (got, got_state) = one_call(
        r,
        gpu,
        &x,
        (&cpu_state, &gpu_state),
        [
            "delta rule chunked, T=300 H=3 dk=dv=128: output",
            "delta rule chunked: memory after 300 tokens",
        ],
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
    let gpu_s0 = RuleState::from_memory(&s0.to_device(gpu)?)?;
    let (got, _) = one_call(
        r,
        gpu,
        &x,
        (&RuleState::from_memory(&s0)?, &gpu_s0),
        [
            "delta rule chunked, T=275 H=48 from a random memory: output",
            "delta rule chunked, H=48: memory after 275 tokens",
        ],
    )?;
    let (o, _) = delta_rule_in_pieces(&x, gpu, &gpu_s0, &[100, 1, 1, 173])?;
    r.identical(
        "delta rule (GPU), H=48: pieces 100/1/1/173 vs one call",
        &o,
        &got,
    )?;

    // A long prompt takes several launches (32 chunks each); then single decode steps. Set up as the
    // T=300 case above (zero states, one call), written out so that each case reads whole with its names.
    let (t, h) = (2200usize, 2usize);
    let x = delta_rule_inputs(rng, t, h, dk, dv)?;
    let cpu_state = RuleState::zeros(h, dk, dv, DType::F32, &Device::Cpu)?;
    let gpu_state = RuleState::zeros(h, dk, dv, DType::F32, gpu)?;
    let (got, got_state) = one_call(
        r,
        gpu,
        &x,
        (&cpu_state, &gpu_state),
        [
            "delta rule chunked, T=2200 (several launches): output",
            "delta rule chunked, T=2200: memory",
        ],
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

/// The one-warp-per-row kernel on GPU copies of rows `start..start + len` of the call `(q, k, v, past)`,
/// as a call of their own after `past + start` cached keys.
fn warp_rows(gpu: &Device, x: &[Tensor; 3], past: usize, rows: (usize, usize)) -> Result<Tensor> {
    let (start, len) = rows;
    let hd = x[0].dim(2)?;
    Ok(prism_model::cuda::causal_attention(
        &x[0].narrow(0, start, len)?.to_device(gpu)?,
        &x[1].to_device(gpu)?,
        &x[2].to_device(gpu)?,
        past + start,
        1.0 / (hd as f64).sqrt(),
    )?)
}

/// (cached keys, new queries, query heads, rows checked as calls of their own: (start, len, name)).
type AttentionCase = (usize, usize, usize, &'static [(usize, usize, &'static str)]);

fn attention_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // 27B attention shapes (24 query heads, 4 KV heads, head dim 256), then 4B/9B shapes (16 query heads
    // over 4 KV heads: other rows × heads per block); rows of the call as calls of their own (the last
    // query of the first as a decode step: T = 1, one row per block) give the same bits.
    let cases: [AttentionCase; 2] = [
        (
            70,
            130,
            24,
            &[
                (
                    100,
                    30,
                    "causal attention (GPU): last 30 queries alone vs in the call",
                ),
                (
                    129,
                    1,
                    "causal attention (GPU): last query as a decode step vs in the call",
                ),
            ],
        ),
        (
            5,
            250,
            16,
            &[(
                243,
                7,
                "causal attention (GPU), 16/4 heads: last 7 queries alone vs in the call",
            )],
        ),
    ];
    let scale = 1.0 / 256f64.sqrt();
    for (past, t, n_h, parts) in cases {
        let x = crate::flash::inputs(rng, t, past, (n_h, 4, 256), 1.0)?;
        let op = CausalAttention {
            past,
            n_heads: n_h,
            scale,
        };
        let want = x[0].apply_op3_no_bwd(&x[1], &x[2], &op)?;
        let got = warp_rows(gpu, &x, past, (0, t))?;
        let name = format!("causal attention, {past} cached + {t} new, {n_h}/4 heads, hd 256");
        r.compare(&name, &got, &want, 1e-5)?;
        for &(start, len, name) in parts {
            let rows = warp_rows(gpu, &x, past, (start, len))?;
            r.identical(name, &rows, &got.narrow(0, start, len)?)?;
        }
    }

    // A long prompt at a head dim the flash kernel lacks (160) takes the batched-matmul path (pieces of
    // query rows): 2,500 new tokens after 300. (Head dims 64/128/256 run the flash kernel at every
    // length: `flash.rs`.)
    let (past, t) = (300usize, 2500usize);
    let [q, k, v] = crate::flash::inputs(rng, t, past, (8, 2, 160), 1.0)?;
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
