//! The fused small kernels (kernels/ops.cu through `prism_model::ops`): the norms
//! (one block per long row, residual add fused, bf16 output, strided input), SwiGLU on the fused
//! gate | up output, the DeltaNet conv + SiLU and gates read from column ranges of the fused
//! projection, the attention output gate, and the bf16 GEMM taking its input already in bf16.
//!
//! 1. Accuracy against the CPU twins (`prism_model::ops` on CPU tensors, the formulas CI tests) at the
//!    27B shapes: ‖Δ‖/‖ref‖ within 1e-6 (f32 kernels; the CPU and GPU `exp` differ by an ulp or two).
//! 2. Bit for bit on the GPU: a row alone vs in a call of many rows (the reduction order depends on the
//!    row length only); a strided or misaligned view vs its contiguous copy (vector or scalar loads of
//!    the same values); the fused add + norm vs the add then the norm; the conv + SiLU vs the conv
//!    kernel then candle's SiLU, and a prompt in pieces vs one call; the gates and the output gate vs
//!    candle's op chains they replace; every bf16 output vs the f32 output cast by candle; the GEMM on
//!    a bf16 input vs the same GEMM casting an f32 input.
//! 3. Timings (median µs of 20 calls) at one 275-token 27B pass's shapes, next to the candle op chains
//!    they replace where there is one.
//!
//! The attention q/k norm + partial M-RoPE kernel (`MRope::norm_and_rotate`) has its own part
//! ([`qk_norm_rope_checks`]): bit for bit against the chain it replaces (norm kernel, candle rotation,
//! cast), against the CPU twin, rows alone vs in a call, and its timing next to that chain.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use prism_model::delta_net::causal_conv;
use prism_model::ops;
use prism_model::rope::{HeadNorms, MRope, Position3};
use serde_json::json;

use crate::harness::{median_seconds, Report, Rng};

/// ‖Δ‖/‖ref‖ bound of the f32 kernels against their CPU twins: the same formulas, rounding alike but for
/// the order of a row's sum of squares and the last ulp of `exp`/`log`; any indexing or stride error
/// gives errors of order 1.
const BOUND: f64 = 1e-6;

/// 27B shapes of one pass.
const TOKENS: usize = 275;
const HIDDEN: usize = 5120;
const FFN: usize = 17408;

pub fn checks(r: &mut Report, gpu: &Device) -> Result<()> {
    // Its own random stream: the other checks' inputs stay what they were.
    let mut rng = Rng(0xF05E_D0C5_2026_1130);
    norm_checks(r, gpu, &mut rng)?;
    swiglu_checks(r, gpu, &mut rng)?;
    conv_checks(r, gpu, &mut rng)?;
    gate_checks(r, gpu, &mut rng)?;
    gemm_input_checks(r, gpu, &mut rng)?;
    timing_checks(r, gpu, &mut rng)?;
    qk_norm_rope_checks(r, gpu, &mut rng)
}

fn on(gpu: &Device, t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(gpu)?)
}

/// The largest element-wise |Δ| / |ref| (reference zeros counted against the smallest normal f32).
fn max_rel(got: &Tensor, want: &Tensor) -> Result<f64> {
    let got: Vec<f32> = got
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let want: Vec<f32> = want
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    Ok(got
        .iter()
        .zip(&want)
        .map(|(g, w)| {
            (f64::from(*g) - f64::from(*w)).abs() / f64::from(w.abs().max(f32::MIN_POSITIVE))
        })
        .fold(0.0, f64::max))
}

/// `t` as a column range of a wider tensor (like a part of a fused projection output): columns
/// `left..left + width` of `[rows, left + width + right]`, the rest random.
fn inside(rng: &mut Rng, t: &Tensor, left: usize, right: usize) -> Result<Tensor> {
    let (rows, width) = t.dims2()?;
    let l = rng.tensor(&[rows, left], 1.0)?;
    let rr = rng.tensor(&[rows, right], 1.0)?;
    Ok(Tensor::cat(&[&l, t, &rr], 1)?.narrow(1, left, width)?)
}

fn norm_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // Long rows (one block per row) at the 4B/9B/27B hidden sizes, the threshold, and a length that is
    // not a multiple of 4 (no vector loads).
    for d in [HIDDEN, 4096, 2560, 1024, 1030] {
        let x = rng.tensor(&[TOKENS, d], 2.0)?;
        let w = rng.tensor(&[d], 1.0)?;
        let want = ops::rms_norm(&x, &w, 1e-6)?;
        let (xg, wg) = (on(gpu, &x)?, on(gpu, &w)?);
        let got = ops::rms_norm(&xg, &wg, 1e-6)?;
        r.compare(
            &format!("rms_norm [{TOKENS}, {d}] (block per row)"),
            &got,
            &want,
            BOUND,
        )?;
        for (start, len) in [(0usize, 1usize), (TOKENS - 1, 1), (40, 7)] {
            let part = ops::rms_norm(&xg.narrow(0, start, len)?, &wg, 1e-6)?;
            r.identical(
                &format!("rms_norm (GPU) D={d}: rows {start}..+{len} alone vs in {TOKENS}"),
                &part,
                &got.narrow(0, start, len)?,
            )?;
        }
        let bf = ops::rms_norm_as(&xg, &wg, 1e-6, DType::BF16)?;
        r.identical(
            &format!("rms_norm (GPU) D={d}: bf16 output vs f32 output cast"),
            &bf,
            &got.to_dtype(DType::BF16)?,
        )?;
    }
    // Misaligned rows (scalar loads) vs the contiguous copy (vector loads): the same values and order.
    let x = rng.tensor(&[TOKENS, HIDDEN], 2.0)?;
    let w = on(gpu, &rng.tensor(&[HIDDEN], 1.0)?)?;
    let xg = on(gpu, &inside(rng, &x, 1, 3)?)?;
    let a = ops::rms_norm(&xg, &w, 1e-6)?;
    let b = ops::rms_norm(&xg.contiguous()?, &w, 1e-6)?;
    r.identical(
        "rms_norm (GPU): misaligned column range vs contiguous copy",
        &a,
        &b,
    )?;

    // Residual add fused into the norm, long rows (block) and short rows (warp).
    for d in [HIDDEN, 256] {
        let x = rng.tensor(&[TOKENS, d], 3.0)?;
        let res = rng.tensor(&[TOKENS, d], 1.0)?;
        let w = rng.tensor(&[d], 1.0)?;
        let (want_sum, want) = ops::add_rms_norm(&x, &res, &w, 1e-6, DType::F32)?;
        let (xg, rg, wg) = (on(gpu, &x)?, on(gpu, &res)?, on(gpu, &w)?);
        let (sum, normed) = ops::add_rms_norm(&xg, &rg, &wg, 1e-6, DType::F32)?;
        r.identical(
            &format!("add_rms_norm D={d}: sum (GPU vs CPU, bitwise)"),
            &sum,
            &want_sum,
        )?;
        r.compare(
            &format!("add_rms_norm D={d}: norm vs CPU"),
            &normed,
            &want,
            BOUND,
        )?;
        let separate = ops::rms_norm(&(&xg + &rg)?, &wg, 1e-6)?;
        r.identical(
            &format!("add_rms_norm (GPU) D={d}: fused vs add then rms_norm"),
            &normed,
            &separate,
        )?;
        let (sum16, normed16) = ops::add_rms_norm(&xg, &rg, &wg, 1e-6, DType::BF16)?;
        r.identical(
            &format!("add_rms_norm (GPU) D={d}: bf16 norm vs f32 norm cast"),
            &normed16,
            &normed.to_dtype(DType::BF16)?,
        )?;
        r.identical(
            &format!("add_rms_norm (GPU) D={d}: sum with a bf16 norm vs with f32"),
            &sum16,
            &sum,
        )?;
        let alone = ops::add_rms_norm(
            &xg.narrow(0, 9, 1)?,
            &rg.narrow(0, 9, 1)?,
            &wg,
            1e-6,
            DType::F32,
        )?
        .1;
        r.identical(
            &format!("add_rms_norm (GPU) D={d}: row 9 alone vs in {TOKENS}"),
            &alone,
            &normed.narrow(0, 9, 1)?,
        )?;
    }

    // The attention q norm on the query halves of [query | gate] heads, read in place.
    let (n_h, hd) = (24usize, 256usize);
    let qg = rng.tensor(&[TOKENS, n_h, 2 * hd], 2.0)?;
    let w = rng.tensor(&[hd], 1.0)?;
    let want = ops::rms_norm(&qg.narrow(2, 0, hd)?, &w, 1e-6)?;
    let (qgg, wg) = (on(gpu, &qg)?, on(gpu, &w)?);
    let got = ops::rms_norm(&qgg.narrow(2, 0, hd)?, &wg, 1e-6)?;
    r.compare(
        "rms_norm of the query halves [275, 24, 256] of [q | gate], in place",
        &got,
        &want,
        BOUND,
    )?;
    let copy = ops::rms_norm(&qgg.narrow(2, 0, hd)?.contiguous()?, &wg, 1e-6)?;
    r.identical(
        "rms_norm (GPU): head-strided view vs contiguous copy",
        &got,
        &copy,
    )?;

    // The DeltaNet gated norm with z read from the fused projection's columns.
    let (n_v, dv) = (48usize, 128usize);
    let o = rng.tensor(&[TOKENS, n_v, dv], 1.0)?;
    let z = rng.tensor(&[TOKENS, n_v * dv], 3.0)?;
    let w = rng.tensor(&[dv], 1.0)?;
    let zg = on(gpu, &inside(rng, &z, 10240, 96)?)?;
    let want = ops::gated_rms_norm_rows(&o, &z, &w, 1e-6, DType::F32)?;
    let (og, wg) = (on(gpu, &o)?, on(gpu, &w)?);
    let got = ops::gated_rms_norm_rows(&og, &zg, &wg, 1e-6, DType::F32)?;
    r.compare(
        "gated rms_norm [275, 48, 128], z in place in the fused output",
        &got,
        &want,
        BOUND,
    )?;
    let old = ops::gated_rms_norm(
        &og,
        &zg.contiguous()?.reshape((TOKENS, n_v, dv))?,
        &wg,
        1e-6,
    )?;
    r.identical(
        "gated rms_norm (GPU): z in place vs contiguous copy",
        &got,
        &old.reshape((TOKENS, n_v * dv))?,
    )?;
    let bf = ops::gated_rms_norm_rows(&og, &zg, &wg, 1e-6, DType::BF16)?;
    r.identical(
        "gated rms_norm (GPU): bf16 output vs f32 output cast",
        &bf,
        &got.to_dtype(DType::BF16)?,
    )?;
    Ok(())
}

fn swiglu_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    for f in [FFN, 1001] {
        let gu = rng.tensor(&[TOKENS, 2 * f], 6.0)?;
        let want = ops::swiglu(&gu, f)?;
        let gug = on(gpu, &gu)?;
        let got = ops::swiglu_as(&gug, f, DType::F32)?;
        r.compare(
            &format!("swiglu [{TOKENS}, 2·{f}] vs CPU"),
            &got,
            &want,
            BOUND,
        )?;
        r.note(
            &format!("swiglu [{TOKENS}, 2·{f}]: max element-wise rel diff vs CPU"),
            json!(max_rel(&got, &want)?),
        );
        let chain = gug
            .narrow(D::Minus1, 0, f)?
            .silu()?
            .mul(&gug.narrow(D::Minus1, f, f)?)?;
        r.identical(
            &format!("swiglu (GPU) f={f}: fused vs candle silu then mul"),
            &got,
            &chain,
        )?;
        let bf = ops::swiglu_as(&gug, f, DType::BF16)?;
        r.identical(
            &format!("swiglu (GPU) f={f}: bf16 output vs f32 output cast"),
            &bf,
            &got.to_dtype(DType::BF16)?,
        )?;
        // As a column range of a wider output, aligned (vector loads) and misaligned (scalar loads).
        for left in [12usize, 1] {
            let wide = on(gpu, &inside(rng, &gu, left, 36)?)?;
            let g = ops::swiglu_as(&wide, f, DType::F32)?;
            r.identical(
                &format!("swiglu (GPU) f={f}: column range at {left} vs contiguous"),
                &g,
                &got,
            )?;
        }
    }
    Ok(())
}

/// The conv + SiLU of `segments` (row ranges of `mixed`, each with its own starting window) on `device`:
/// the output `[N, C]` and each segment's new window. CPU: the twin (`causal_conv`, then SiLU).
fn conv_silu(
    mixed: &Tensor,
    segments: &[(usize, usize)],
    windows: &[Tensor],
    taps: &Tensor,
    device: &Device,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (n, c) = mixed.dims2()?;
    if device.is_cpu() {
        let mut outs = Vec::new();
        let mut new_windows = Vec::new();
        for (&(start, len), window) in segments.iter().zip(windows) {
            let (o, w) = causal_conv(&mixed.narrow(0, start, len)?.contiguous()?, window, taps)?;
            outs.push(o);
            new_windows.push(w);
        }
        return Ok((Tensor::cat(&outs, 0)?.silu()?, new_windows));
    }
    let (mixed, taps) = (mixed.to_device(device)?, taps.to_device(device)?);
    let mut out = prism_model::cuda::ConvSiluOutput::new(&mixed, n, c)?;
    let mut new_windows = Vec::new();
    for (&(start, len), window) in segments.iter().zip(windows) {
        new_windows.push(out.segment(
            &mixed.narrow(0, start, len)?,
            start,
            &window.to_device(device)?,
            &taps,
        )?);
    }
    Ok((out.finish()?, new_windows))
}

fn conv_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // The q|k|v columns of the 27B fused projection (10240 of 16480 columns).
    let (c, k) = (10240usize, 4usize);
    let qkv = rng.tensor(&[TOKENS, c], 2.0)?;
    let mixed = inside(rng, &qkv, 0, 6240)?;
    let taps = rng.tensor(&[k, c], 1.0)?;
    let windows: Vec<Tensor> = (0..3)
        .map(|_| rng.tensor(&[k - 1, c], 2.0))
        .collect::<Result<_>>()?;
    let one = [(0usize, TOKENS)];
    let (want, want_w) = conv_silu(&mixed, &one, &windows[..1], &taps, &Device::Cpu)?;
    let (got, got_w) = conv_silu(&mixed, &one, &windows[..1], &taps, gpu)?;
    r.compare(
        "conv + silu [275, 10240] K=4, in place in the fused output, vs CPU",
        &got,
        &want,
        BOUND,
    )?;
    r.identical(
        "conv + silu: new window (GPU vs CPU, bitwise)",
        &got_w[0],
        &want_w[0],
    )?;
    let window_after_one_call = got_w[0].clone();
    let (old, _) = prism_model::cuda::causal_conv(
        &on(gpu, &mixed.contiguous()?)?,
        &on(gpu, &windows[0])?,
        &on(gpu, &taps)?,
    )?;
    r.identical(
        "conv + silu (GPU): fused vs conv kernel then candle silu",
        &got,
        &old.silu()?,
    )?;

    // Three sequences in one call, each from its own window.
    let segs = [(0usize, 100usize), (100, 1), (101, TOKENS - 101)];
    let (want3, want3_w) = conv_silu(&mixed, &segs, &windows, &taps, &Device::Cpu)?;
    let (got3, got3_w) = conv_silu(&mixed, &segs, &windows, &taps, gpu)?;
    r.compare(
        "conv + silu: 3 segments 100/1/174 with their own windows vs CPU",
        &got3,
        &want3,
        BOUND,
    )?;
    for (i, (g, w)) in got3_w.iter().zip(&want3_w).enumerate() {
        r.identical(
            &format!("conv + silu: segment {i} new window (GPU vs CPU)"),
            g,
            w,
        )?;
    }
    // One sequence in pieces (prefill pieces and decode steps), each piece from the last one's window.
    let mut outs = Vec::new();
    let mut window = windows[0].clone();
    let mut at = 0;
    for piece in [1usize, 7, 64, 200, 1, 1, 1] {
        let len = piece.min(TOKENS - at);
        let part = mixed.narrow(0, at, len)?;
        let (o, w) = conv_silu(&part, &[(0, len)], &[window], &taps, gpu)?;
        outs.push(o);
        window = w[0].to_device(&Device::Cpu)?;
        at += len;
    }
    r.identical(
        "conv + silu (GPU): pieces 1/7/64/200/1/1/1 vs one call",
        &Tensor::cat(&outs, 0)?,
        &got,
    )?;
    r.identical(
        "conv + silu (GPU): window after the pieces vs after one call",
        &window,
        &window_after_one_call,
    )?;

    // A snapshot's window (the engine's evidence state inside one segment), written by the same
    // launch: the last K − 1 rows of the start window and the segment's first p rows, bit for bit,
    // the output and the new window unchanged.
    let (gpu_mixed, gpu_window, gpu_taps) =
        (on(gpu, &mixed)?, on(gpu, &windows[0])?, on(gpu, &taps)?);
    for p in [0usize, 1, 2, 3, 4, 100, TOKENS - 1, TOKENS] {
        let padded = Tensor::cat(&[&windows[0], &mixed.narrow(0, 0, p)?], 0)?;
        let want_snap = padded.narrow(0, p, k - 1)?;
        let mut out = prism_model::cuda::ConvSiluOutput::new(&gpu_mixed, TOKENS, c)?;
        let (w, snap) =
            out.segment_with_snapshot(&gpu_mixed, 0, &gpu_window, &gpu_taps, Some(p))?;
        let snap = snap.context("conv + silu: no snapshot window returned")?;
        r.identical(
            &format!("conv + silu (GPU): snapshot window after {p} rows vs the rows (CPU)"),
            &snap,
            &want_snap,
        )?;
        r.identical(
            &format!("conv + silu (GPU): output with a snapshot at {p} vs without"),
            &out.finish()?,
            &got,
        )?;
        r.identical(
            &format!("conv + silu (GPU): new window with a snapshot at {p} vs without"),
            &w,
            &window_after_one_call,
        )?;
    }

    // Decode steps: 100 one-token segments in one call (two launches of at most 64), each from its own
    // window, rows in a shuffled order, against each alone through `segment` — bit for bit.
    for (k, width) in [(4usize, c), (3, 64)] {
        let n = 100usize;
        let rows_in = on(gpu, &rng.tensor(&[n, width], 2.0)?)?;
        let taps_k = on(gpu, &rng.tensor(&[k, width], 1.0)?)?;
        let wins: Vec<Tensor> = (0..n)
            .map(|_| on(gpu, &rng.tensor(&[k - 1, width], 2.0)?))
            .collect::<Result<_>>()?;
        let order: Vec<usize> = (0..n).map(|i| (i * 37) % n).collect();
        let refs: Vec<&Tensor> = order.iter().map(|&i| &wins[i]).collect();
        let mut batched = prism_model::cuda::ConvSiluOutput::new(&rows_in, n, width)?;
        let new_b = batched.decode_rows(&rows_in, &order, &refs, &taps_k)?;
        let out_b = batched.finish()?;
        let mut alone_rows = Vec::new();
        let mut alone_windows = Vec::new();
        for &i in &order {
            let mut one = prism_model::cuda::ConvSiluOutput::new(&rows_in, 1, width)?;
            alone_windows.push(one.segment(&rows_in.narrow(0, i, 1)?, 0, &wins[i], &taps_k)?);
            alone_rows.push((i, one.finish()?));
        }
        alone_rows.sort_by_key(|(i, _)| *i);
        let alone = Tensor::cat(
            &alone_rows.into_iter().map(|(_, t)| t).collect::<Vec<_>>(),
            0,
        )?;
        r.identical(
            &format!(
                "conv + silu (GPU) decode: {n} one-token segments K={k} in one call vs each alone"
            ),
            &out_b,
            &alone,
        )?;
        r.identical(
            &format!("conv + silu (GPU) decode K={k}: new windows vs each alone"),
            &Tensor::stack(&new_b, 0)?,
            &Tensor::stack(&alone_windows, 0)?,
        )?;
    }

    // Another tap count (the generic loop).
    let k = 3;
    let taps3 = rng.tensor(&[k, 64], 1.0)?;
    let m3 = rng.tensor(&[37, 64], 2.0)?;
    let w3 = [rng.tensor(&[k - 1, 64], 2.0)?];
    let (want, _) = conv_silu(&m3, &[(0, 37)], &w3, &taps3, &Device::Cpu)?;
    let (got, _) = conv_silu(&m3, &[(0, 37)], &w3, &taps3, gpu)?;
    r.compare(
        "conv + silu [37, 64] K=3 (generic tap loop) vs CPU",
        &got,
        &want,
        BOUND,
    )?;
    Ok(())
}

fn gate_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    // β and α columns of the 27B DeltaNet projection (the last 96 of 16480), large enough to saturate.
    let h = 48usize;
    let proj = rng.tensor(&[TOKENS, 16480], 12.0)?;
    let dt_bias = rng.tensor(&[h], 2.0)?;
    let ssm_a = (rng.tensor(&[h], 1.0)?.abs()? * -8.0)?;
    let (b, a) = (proj.narrow(1, 16384, h)?, proj.narrow(1, 16384 + h, h)?);
    let (want_beta, want_g) = ops::delta_net_gates(&b, &a, &dt_bias, &ssm_a)?;
    let pg = on(gpu, &proj)?;
    let (bg, ag, dg, sg) = (
        pg.narrow(1, 16384, h)?,
        pg.narrow(1, 16384 + h, h)?,
        on(gpu, &dt_bias)?,
        on(gpu, &ssm_a)?,
    );
    let (beta, g) = ops::delta_net_gates(&bg, &ag, &dg, &sg)?;
    r.compare(
        "delta-net gates: beta [275, 48] in place vs CPU",
        &beta,
        &want_beta,
        BOUND,
    )?;
    r.compare(
        "delta-net gates: g [275, 48] in place vs CPU",
        &g,
        &want_g,
        BOUND,
    )?;
    let chain_beta = ops::sigmoid(&bg)?;
    let chain_g = ops::softplus(&ag.broadcast_add(&dg)?)?.broadcast_mul(&sg)?;
    r.identical(
        "delta-net gates (GPU): beta vs candle's sigmoid chain",
        &beta,
        &chain_beta,
    )?;
    r.identical(
        "delta-net gates (GPU): g vs candle's softplus chain",
        &g,
        &chain_g,
    )?;

    // The attention output gate from the gate halves of [query | gate] heads; also one decode row.
    let (n_h, hd) = (24usize, 256usize);
    for n in [TOKENS, 1] {
        let qg = rng.tensor(&[n, n_h, 2 * hd], 6.0)?;
        let attn = rng.tensor(&[n, n_h * hd], 1.0)?;
        let want = ops::sigmoid_gate(&attn, &qg.narrow(2, hd, hd)?, DType::F32)?;
        let (qgg, ag) = (on(gpu, &qg)?, on(gpu, &attn)?);
        let gate = qgg.narrow(2, hd, hd)?;
        let got = ops::sigmoid_gate(&ag, &gate, DType::F32)?;
        r.compare(
            &format!("attention gate [{n}, 24·256], gate in place, vs CPU"),
            &got,
            &want,
            BOUND,
        )?;
        let chain = ag.mul(&ops::sigmoid(&gate.contiguous()?.reshape((n, n_h * hd))?)?)?;
        r.identical(
            &format!("attention gate (GPU) [{n}]: fused vs candle's sigmoid then mul"),
            &got,
            &chain,
        )?;
        let bf = ops::sigmoid_gate(&ag, &gate, DType::BF16)?;
        r.identical(
            &format!("attention gate (GPU) [{n}]: bf16 output vs f32 output cast"),
            &bf,
            &got.to_dtype(DType::BF16)?,
        )?;
    }
    Ok(())
}

fn gemm_input_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let x = on(gpu, &rng.tensor(&[TOKENS, HIDDEN], 2.0)?)?;
    let w = on(gpu, &rng.tensor(&[1024, HIDDEN], 0.05)?)?.to_dtype(DType::BF16)?;
    let from_f32 = ops::linear(&x, &w)?;
    let from_bf16 = ops::linear(&x.to_dtype(DType::BF16)?, &w)?;
    r.identical(
        "bf16 GEMM (GPU): bf16 input vs f32 input cast inside",
        &from_bf16,
        &from_f32,
    )?;
    let want = ops::linear(&x.to_device(&Device::Cpu)?, &w.to_device(&Device::Cpu)?)?;
    r.compare(
        "bf16 GEMM [275, 5120] × [1024, 5120]ᵀ, bf16 input, vs CPU",
        &from_bf16,
        &want,
        1e-5,
    )?;
    Ok(())
}

fn timing_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let x = on(gpu, &rng.tensor(&[TOKENS, HIDDEN], 2.0)?)?;
    let res = on(gpu, &rng.tensor(&[TOKENS, HIDDEN], 1.0)?)?;
    let w = on(gpu, &rng.tensor(&[HIDDEN], 1.0)?)?;
    let t = 1e6 * median_seconds(gpu, 20, || Ok(ops::rms_norm(&x, &w, 1e-6)?))?;
    r.note("time: rms_norm [275, 5120] f32 out, µs", json!(t));
    let t = 1e6
        * median_seconds(gpu, 20, || {
            Ok(ops::add_rms_norm(&x, &res, &w, 1e-6, DType::BF16)?)
        })?;
    r.note(
        "time: add + rms_norm [275, 5120] (sum f32, norm bf16), µs",
        json!(t),
    );
    let t = 1e6
        * median_seconds(gpu, 20, || {
            Ok((
                (&x + &res)?,
                ops::rms_norm(&x, &w, 1e-6)?.to_dtype(DType::BF16)?,
            ))
        })?;
    r.note(
        "time: separate add, rms_norm, cast (what it replaces), µs",
        json!(t),
    );

    let gu = on(gpu, &rng.tensor(&[TOKENS, 2 * FFN + 64], 4.0)?)?.narrow(1, 0, 2 * FFN)?;
    let t = 1e6 * median_seconds(gpu, 20, || Ok(ops::swiglu_as(&gu, FFN, DType::BF16)?))?;
    r.note("time: swiglu [275, 2·17408] → bf16, µs", json!(t));
    let t = 1e6
        * median_seconds(
            gpu,
            20,
            || Ok(ops::swiglu(&gu, FFN)?.to_dtype(DType::BF16)?),
        )?;
    r.note(
        "time: candle silu, mul, cast (what it replaces), µs",
        json!(t),
    );

    let (c, k) = (10240usize, 4usize);
    let mixed = on(gpu, &rng.tensor(&[TOKENS, 16480], 2.0)?)?.narrow(1, 0, c)?;
    let taps = on(gpu, &rng.tensor(&[k, c], 1.0)?)?;
    let window = on(gpu, &rng.tensor(&[k - 1, c], 1.0)?)?;
    let t = 1e6
        * median_seconds(gpu, 20, || {
            let mut out = prism_model::cuda::ConvSiluOutput::new(&mixed, TOKENS, c)?;
            out.segment(&mixed, 0, &window, &taps)?;
            Ok(out.finish()?)
        })?;
    r.note("time: conv + silu [275, 10240] in place, µs", json!(t));
    let t = 1e6
        * median_seconds(gpu, 20, || {
            let (o, _) = prism_model::cuda::causal_conv(&mixed.contiguous()?, &window, &taps)?;
            Ok(o.silu()?)
        })?;
    r.note("time: copy, conv, silu (what it replaces), µs", json!(t));

    let proj = on(gpu, &rng.tensor(&[TOKENS, 16480], 4.0)?)?;
    let (b, a) = (proj.narrow(1, 16384, 48)?, proj.narrow(1, 16432, 48)?);
    let (dt, sa) = (
        on(gpu, &rng.tensor(&[48], 1.0)?)?,
        on(gpu, &rng.tensor(&[48], 1.0)?)?,
    );
    let t = 1e6 * median_seconds(gpu, 20, || Ok(ops::delta_net_gates(&b, &a, &dt, &sa)?))?;
    r.note("time: delta-net gates [275, 48], µs", json!(t));
    let t = 1e6
        * median_seconds(gpu, 20, || {
            let beta = ops::sigmoid(&b)?;
            let g = ops::softplus(&a.broadcast_add(&dt)?)?.broadcast_mul(&sa)?;
            Ok((beta, g))
        })?;
    r.note("time: candle gate chains (what it replaces), µs", json!(t));

    let qg = on(gpu, &rng.tensor(&[TOKENS, 24, 512], 4.0)?)?;
    let attn = on(gpu, &rng.tensor(&[TOKENS, 24 * 256], 1.0)?)?;
    let gate = qg.narrow(2, 256, 256)?;
    let t = 1e6
        * median_seconds(gpu, 20, || {
            Ok(ops::sigmoid_gate(&attn, &gate, DType::BF16)?)
        })?;
    r.note("time: attention gate [275, 6144] → bf16, µs", json!(t));
    let t = 1e6
        * median_seconds(gpu, 20, || {
            let g = gate.contiguous()?.reshape((TOKENS, 24 * 256))?;
            Ok(attn.mul(&ops::sigmoid(&g)?)?.to_dtype(DType::BF16)?)
        })?;
    r.note(
        "time: copy, candle sigmoid, mul, cast (what it replaces), µs",
        json!(t),
    );
    Ok(())
}

/// M-RoPE positions of `n` tokens: text tokens from `start` (equal on the three axes), except an
/// image-like block at rows 40..104 with distinct (t, h, w) positions on an 8 × 8 grid.
fn rope_positions(n: usize, start: u32) -> Vec<Position3> {
    (0..n)
        .map(|i| {
            let p = start + i as u32;
            if (40..104).contains(&i) {
                let j = (i - 40) as u32;
                [start + 40, start + 40 + j / 8, start + 40 + j % 8]
            } else {
                [p, p, p]
            }
        })
        .collect()
}

/// The chain `norm_and_rotate` replaces on the GPU: the norm kernel on q and on k (k reshaped, a
/// copy), candle's rotation of each, both cast to `out`.
fn qk_chain(
    rope: &MRope,
    q: &Tensor,
    k: &Tensor,
    norms: &HeadNorms<'_>,
    cs: (&Tensor, &Tensor),
    out: DType,
) -> Result<(Tensor, Tensor)> {
    let (n, _, hd) = q.dims3()?;
    let n_kv = k.elem_count() / (n * hd);
    let qn = ops::rms_norm(q, norms.q_weight, norms.eps)?;
    let kn = ops::rms_norm(&k.reshape((n, n_kv, hd))?, norms.k_weight, norms.eps)?;
    let q = rope.apply(&qn, cs.0, cs.1)?.to_dtype(out)?;
    Ok((q, rope.apply(&kn, cs.0, cs.1)?.to_dtype(out)?))
}

/// The attention q/k RMSNorm + partial M-RoPE kernel (`qk_norm_rope_f32` through
/// `MRope::norm_and_rotate`) at the 27B head layout (24 query heads, 4 KV heads, head dim 256,
/// rotary dim 64, sections [11, 11, 10], θ = 1e7) and a small generic one (head dim 96, rotary dim
/// 32): q read in place as the query halves of `[query | gate]` heads, k as a column range of the
/// fused projection output; text positions and an image-like block of 3-D positions.
fn qk_norm_rope_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    for (n_h, n_kv, hd, rot, sections) in [
        (24usize, 4usize, 256usize, 64usize, [11usize, 11, 10]),
        (6, 2, 96, 32, [6, 5, 5]),
    ] {
        let label = format!("q/k norm + rope (h {n_h}/{n_kv}, hd {hd}, rot {rot})");
        let rope_cpu = MRope::new(rot, 1e7, sections, DType::F32, &Device::Cpu)?;
        let rope_gpu = MRope::new(rot, 1e7, sections, DType::F32, gpu)?;
        let qg = rng.tensor(&[TOKENS, n_h, 2 * hd], 3.0)?;
        let k = rng.tensor(&[TOKENS, n_kv * hd], 3.0)?;
        let (qw, kw) = (rng.tensor(&[hd], 1.0)?, rng.tensor(&[hd], 1.0)?);
        let k_wide = inside(rng, &k, n_h * 2 * hd, n_kv * hd)?;
        let pos = rope_positions(TOKENS, 1000);
        let (cos_c, sin_c) = rope_cpu.cos_sin(&pos)?;
        let (cos_g, sin_g) = rope_gpu.cos_sin(&pos)?;
        let norms_c = HeadNorms {
            q_weight: &qw,
            k_weight: &kw,
            eps: 1e-6,
        };
        let (qwg, kwg) = (on(gpu, &qw)?, on(gpu, &kw)?);
        let norms_g = HeadNorms {
            q_weight: &qwg,
            k_weight: &kwg,
            eps: 1e-6,
        };
        let (qgg, kg) = (on(gpu, &qg)?, on(gpu, &k_wide)?);
        let qv = qgg.narrow(2, 0, hd)?;

        let (q, kk) = rope_gpu.norm_and_rotate(&qv, &kg, &norms_g, &cos_g, &sin_g, DType::F32)?;
        let (want_q, want_k) =
            qk_chain(&rope_gpu, &qv, &kg, &norms_g, (&cos_g, &sin_g), DType::F32)?;
        r.identical(
            &format!("{label} (GPU): q vs norm kernel + candle rope"),
            &q,
            &want_q,
        )?;
        r.identical(
            &format!("{label} (GPU): k vs norm kernel + candle rope"),
            &kk,
            &want_k,
        )?;
        let (q16, k2) =
            rope_gpu.norm_and_rotate(&qv, &kg, &norms_g, &cos_g, &sin_g, DType::BF16)?;
        r.identical(
            &format!("{label} (GPU): bf16 q vs f32 q cast"),
            &q16,
            &q.to_dtype(DType::BF16)?,
        )?;
        r.identical(
            &format!("{label} (GPU): bf16 k vs f32 k cast"),
            &k2,
            &kk.to_dtype(DType::BF16)?,
        )?;
        let (qc, kc) = rope_gpu.norm_and_rotate(
            &qv.contiguous()?,
            &kg.contiguous()?,
            &norms_g,
            &cos_g,
            &sin_g,
            DType::F32,
        )?;
        r.identical(
            &format!("{label} (GPU): in place vs contiguous copies (q)"),
            &qc,
            &q,
        )?;
        r.identical(
            &format!("{label} (GPU): in place vs contiguous copies (k)"),
            &kc,
            &kk,
        )?;

        // Against the CPU twin: with the GPU's cos/sin (the kernel alone), and each device its own.
        let qv_c = qg.narrow(2, 0, hd)?;
        let (cq, ck) = rope_cpu.norm_and_rotate(
            &qv_c,
            &k,
            &norms_c,
            &cos_g.to_device(&Device::Cpu)?,
            &sin_g.to_device(&Device::Cpu)?,
            DType::F32,
        )?;
        r.compare(
            &format!("{label}: q vs CPU twin (same cos/sin)"),
            &q,
            &cq,
            BOUND,
        )?;
        r.compare(
            &format!("{label}: k vs CPU twin (same cos/sin)"),
            &kk,
            &ck,
            BOUND,
        )?;
        let (cq, ck) = rope_cpu.norm_and_rotate(&qv_c, &k, &norms_c, &cos_c, &sin_c, DType::F32)?;
        r.compare(
            &format!("{label}: q vs CPU twin (CPU cos/sin)"),
            &q,
            &cq,
            BOUND,
        )?;
        r.compare(
            &format!("{label}: k vs CPU twin (CPU cos/sin)"),
            &kk,
            &ck,
            BOUND,
        )?;

        // Rows alone (a decode step) and a middle range vs inside the call.
        for (start, len) in [(0usize, 1usize), (TOKENS - 1, 1), (37, 70)] {
            let (cs, ss) = (cos_g.narrow(0, start, len)?, sin_g.narrow(0, start, len)?);
            let (pq, pk) = rope_gpu.norm_and_rotate(
                &qv.narrow(0, start, len)?,
                &kg.narrow(0, start, len)?,
                &norms_g,
                &cs,
                &ss,
                DType::F32,
            )?;
            r.identical(
                &format!("{label} (GPU): q rows {start}..+{len} alone vs in {TOKENS}"),
                &pq,
                &q.narrow(0, start, len)?,
            )?;
            r.identical(
                &format!("{label} (GPU): k rows {start}..+{len} alone vs in {TOKENS}"),
                &pk,
                &kk.narrow(0, start, len)?,
            )?;
        }

        // Timing: the fused kernel (bf16 q and k, as the flash path takes them) vs the chain it replaces.
        for n in [TOKENS, 12, 1] {
            let (qn, kn) = (qv.narrow(0, 0, n)?, kg.narrow(0, 0, n)?);
            let (cs, ss) = (cos_g.narrow(0, 0, n)?, sin_g.narrow(0, 0, n)?);
            let t = 1e6
                * median_seconds(gpu, 20, || {
                    Ok(rope_gpu.norm_and_rotate(&qn, &kn, &norms_g, &cs, &ss, DType::BF16)?)
                })?;
            r.note(&format!("time: {label} fused, N={n}, µs"), json!(t));
            let t = 1e6
                * median_seconds(gpu, 20, || {
                    qk_chain(&rope_gpu, &qn, &kn, &norms_g, (&cs, &ss), DType::BF16)
                })?;
            r.note(
                &format!(
                    "time: {label} old chain (2 norms, copy, 2 × 6 rope ops, cast), N={n}, µs"
                ),
                json!(t),
            );
        }
    }
    Ok(())
}
