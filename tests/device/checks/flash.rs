//! The tensor-core attention kernel (`prism_model::cuda_flash`, kernels/flash_attention.cu).
//!
//! 1. Accuracy against the CPU twin (`CausalAttention`, reached through `attend_segment` on CPU tensors,
//!    f32): every head layout × T ∈ {1, 7, 64, 275, 1000, 4096} × past ∈ {0, 37, 300}. Long calls are
//!    checked on three windows of 64 query rows (first, an unaligned middle one, last), each computed
//!    by the twin as its own call with the keys up to the window's end — the twin's result for a row
//!    does not depend on the call it is in, so this is the same reference at a fraction of the CPU time.
//! 2. Batch invariance, bit for bit on the GPU: rows of one call of N rows vs the same rows computed as
//!    a call of fewer rows after a longer past (splits at tile and block boundaries and off them, pieces,
//!    decode steps), the heads of one KV group alone vs inside all heads, bf16 keys/values vs f32.
//! 3. Timing at T = 8192, past 0, 27B attention shapes (24 query heads over 4 KV heads, head dim 256):
//!    the flash kernel (bf16 conversion included) next to `attend_segment`'s route in this build and
//!    next to the batched-matmul route it replaces; and one decode step after 8,191 cached tokens next to
//!    the one-warp-per-row kernel.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use prism_model::attention::attend_segment;
use prism_model::cuda_flash::{
    flash_attention, flash_attention_batch, kv_append_batch, supports, FlashSegment, KvAppend,
};
use serde_json::json;

use crate::harness::{median_seconds, on_device, Report, Rng};

/// Pass bound on ‖Δ‖/‖ref‖ against the f32 CPU twin. The kernel rounds q, k, v and the probabilities
/// to bf16 (relative error ≤ 2⁻⁹ ≈ 2e-3 each, independent from element to element), so outputs land
/// at a few 1e-3; 1e-2 leaves room for peaky softmaxes and long rows while still failing on any
/// indexing, masking or rescaling error (those give errors of order 1).
const FLASH_BOUND: f64 = 1e-2;

/// Head layouts checked: (query heads, KV heads, head dim).
const LAYOUTS: [(usize, usize, usize); 4] = [(24, 4, 256), (16, 4, 256), (8, 2, 128), (4, 2, 64)];

/// Random q, k, v on the CPU: `q: [t, n_h, hd]` (amplitude `q_amp`), `k, v: [n_kv, past + t, hd]`.
pub fn inputs(
    rng: &mut Rng,
    t: usize,
    past: usize,
    (n_h, n_kv, hd): (usize, usize, usize),
    q_amp: f32,
) -> Result<[Tensor; 3]> {
    Ok([
        rng.tensor(&[t, n_h, hd], q_amp)?,
        rng.tensor(&[n_kv, past + t, hd], 1.0)?,
        rng.tensor(&[n_kv, past + t, hd], 1.0)?,
    ])
}

/// Rows `start..start + len` of the call (q, k, v, past) by the CPU twin, as a call of their own.
fn cpu_rows(x: &[Tensor; 3], past: usize, scale: f64, start: usize, len: usize) -> Result<Tensor> {
    let keys = past + start + len;
    let k = x[1].narrow(1, 0, keys)?.contiguous()?;
    let v = x[2].narrow(1, 0, keys)?.contiguous()?;
    Ok(attend_segment(
        &x[0].narrow(0, start, len)?,
        &k,
        &v,
        past + start,
        scale,
    )?)
}

/// The query-row windows compared with the CPU twin.
fn windows(t: usize) -> Vec<(usize, usize)> {
    if t <= 512 {
        vec![(0, t)]
    } else {
        vec![(0, 64), (t / 2 - 29, 64), (t - 64, 64)]
    }
}

fn accuracy_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let mut worst = 0f64;
    for layout in LAYOUTS {
        let (n_h, n_kv, hd) = layout;
        if !supports(hd, n_h, n_kv) {
            anyhow::bail!("flash attention does not support {n_h}/{n_kv} heads of dim {hd}");
        }
        let scale = 1.0 / (hd as f64).sqrt();
        // q amplitude 3: scores of standard deviation about 1 (uniform inputs), like a real layer's.
        for t in [1usize, 7, 64, 275, 1000, 4096] {
            for past in [0usize, 37, 300] {
                let x = inputs(rng, t, past, layout, 3.0)?;
                let g = on_device(&x, gpu)?;
                let got =
                    flash_attention(&g[0], &g[1], &g[2], past, scale)?.to_device(&Device::Cpu)?;
                let (mut got_w, mut want_w) = (Vec::new(), Vec::new());
                for (start, len) in windows(t) {
                    got_w.push(got.narrow(0, start, len)?);
                    want_w.push(cpu_rows(&x, past, scale, start, len)?);
                }
                let name = format!(
                    "flash attention {n_h}/{n_kv} hd {hd}: {past} cached + {t} new vs CPU twin"
                );
                r.compare(
                    &name,
                    &Tensor::cat(&got_w, 0)?,
                    &Tensor::cat(&want_w, 0)?,
                    FLASH_BOUND,
                )?;
                worst = worst.max(r.last_rel());
            }
        }
    }
    // Peaky softmax (scores of standard deviation about 8): the running max moves a lot between tiles.
    let layout = (24, 4, 256);
    let scale = 1.0 / 16.0;
    let (t, past) = (600, 37);
    let x = inputs(rng, t, past, layout, 24.0)?;
    let g = on_device(&x, gpu)?;
    let got = flash_attention(&g[0], &g[1], &g[2], past, scale)?.to_device(&Device::Cpu)?;
    let want = cpu_rows(&x, past, scale, 0, t)?;
    let name = "flash attention 24/4 hd 256, peaky scores: 37 cached + 600 new vs CPU twin";
    r.compare(name, &got, &want, FLASH_BOUND)?;
    worst = worst.max(r.last_rel());
    r.note(
        "flash attention: worst ‖Δ‖/‖ref‖ against the CPU twin",
        json!(worst),
    );
    Ok(())
}

fn invariance_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    for (layout, n) in [
        ((24, 4, 256), 1000usize),
        ((8, 2, 128), 700),
        ((4, 2, 64), 300),
    ] {
        let (n_h, n_kv, hd) = layout;
        let scale = 1.0 / (hd as f64).sqrt();
        let x = on_device(&inputs(rng, n, 0, layout, 3.0)?, gpu)?;
        let full = flash_attention(&x[0], &x[1], &x[2], 0, scale)?;
        let tag = format!("flash attention (GPU) {n_h}/{n_kv} hd {hd}, {n} rows");
        // Split points on and off the 16-row warp, 64-position block and key-tile boundaries.
        for s in [1usize, 17, 32, 63, 64, 65, 100, 255, n / 2 + 3, n - 1] {
            let tail = flash_attention(&x[0].narrow(0, s, n - s)?, &x[1], &x[2], s, scale)?;
            r.identical(
                &format!("{tag}: rows {s}.. after {s} cached vs in one call"),
                &tail,
                &full.narrow(0, s, n - s)?,
            )?;
            let k = x[1].narrow(1, 0, s)?.contiguous()?;
            let v = x[2].narrow(1, 0, s)?.contiguous()?;
            let head = flash_attention(&x[0].narrow(0, 0, s)?, &k, &v, 0, scale)?;
            r.identical(
                &format!("{tag}: rows ..{s} alone vs in one call"),
                &head,
                &full.narrow(0, 0, s)?,
            )?;
        }
        // The whole sequence as a prefill in pieces followed by decode steps.
        let mut outs = Vec::new();
        let mut at = 0;
        for piece in [1usize, 7, 64, 100, 1, 1, 33] {
            let keys = at + piece;
            let k = x[1].narrow(1, 0, keys)?.contiguous()?;
            let v = x[2].narrow(1, 0, keys)?.contiguous()?;
            outs.push(flash_attention(
                &x[0].narrow(0, at, piece)?,
                &k,
                &v,
                at,
                scale,
            )?);
            at = keys;
        }
        outs.push(flash_attention(
            &x[0].narrow(0, at, n - at - 3)?,
            &x[1].narrow(1, 0, n - 3)?.contiguous()?,
            &x[2].narrow(1, 0, n - 3)?.contiguous()?,
            at,
            scale,
        )?);
        for at in n - 3..n {
            let k = x[1].narrow(1, 0, at + 1)?.contiguous()?;
            let v = x[2].narrow(1, 0, at + 1)?.contiguous()?;
            outs.push(flash_attention(&x[0].narrow(0, at, 1)?, &k, &v, at, scale)?);
        }
        r.identical(
            &format!("{tag}: pieces 1/7/64/100/1/1/33/rest + 3 decode steps vs one call"),
            &Tensor::cat(&outs, 0)?,
            &full,
        )?;
        // The heads of KV group 1 alone (one KV head) vs inside all heads: other heads share no state.
        let group = n_h / n_kv;
        let q1 = x[0].narrow(1, group, group)?.contiguous()?;
        let k1 = x[1].narrow(0, 1, 1)?.contiguous()?;
        let v1 = x[2].narrow(0, 1, 1)?.contiguous()?;
        let alone = flash_attention(&q1, &k1, &v1, 0, scale)?;
        r.identical(
            &format!("{tag}: KV group 1's {group} heads alone vs among {n_h}"),
            &alone,
            &full.narrow(1, group * hd, group * hd)?,
        )?;
        // Keys and values handed over in bf16 (a bf16 KV cache): the same bits as f32 ones.
        let bf16 = flash_attention(
            &x[0],
            &x[1].to_dtype(DType::BF16)?,
            &x[2].to_dtype(DType::BF16)?,
            0,
            scale,
        )?;
        r.identical(&format!("{tag}: bf16 keys/values vs f32"), &bf16, &full)?;
    }
    batched(rng, gpu, r)?;
    // A long prompt: the second half after the first half cached, rows off every boundary.
    let (layout, n) = ((24, 4, 256), 4396usize);
    let x = on_device(&inputs(rng, n, 0, layout, 3.0)?, gpu)?;
    let scale = 1.0 / 16.0;
    let full = flash_attention(&x[0], &x[1], &x[2], 0, scale)?;
    let s = 2047;
    let tail = flash_attention(&x[0].narrow(0, s, n - s)?, &x[1], &x[2], s, scale)?;
    r.identical(
        "flash attention (GPU) 24/4 hd 256, 4396 rows: rows 2047.. after 2047 cached vs one call",
        &tail,
        &full.narrow(0, s, n - s)?,
    )?;
    Ok(())
}

/// The batched-matmul route that `attend_segment` took for long prompts before the flash kernel:
/// f32 cuBLAS matmuls and a materialized causal mask, in pieces of 2048 query rows.
fn matmul_route(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f64) -> Result<Tensor> {
    const PIECE: usize = 2048;
    let (t, n_h, hd) = q.dims3()?;
    let n_kv = k.dim(0)?;
    let group = n_h / n_kv;
    let mut pieces = Vec::new();
    for start in (0..t).step_by(PIECE) {
        let len = PIECE.min(t - start);
        let keys = past + start + len;
        let (kp, vp) = (k.narrow(1, 0, keys)?, v.narrow(1, 0, keys)?);
        let q_g = q
            .narrow(0, start, len)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n_kv, group * len, hd))?;
        let scores = (q_g.matmul(&kp.t()?)? * scale)?.reshape((n_kv, group, len, keys))?;
        let first = past + start;
        let mask: Vec<f32> = (0..len)
            .flat_map(|i| {
                (0..keys).map(move |j| {
                    if j > first + i {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (len, keys), q.device())?;
        let probs = prism_model::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?
            .reshape((n_kv, group * len, keys))?;
        pieces.push(
            probs
                .matmul(&vp)?
                .reshape((n_h, len, hd))?
                .transpose(0, 1)?
                .reshape((len, n_h * hd))?,
        );
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

fn timing_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (t, n_h, n_kv, hd) = (8192usize, 24usize, 4usize, 256usize);
    let scale = 1.0 / 16.0;
    let q = (Tensor::randn(0f32, 1.0, (t, n_h, hd), gpu)? * 1.7)?;
    let k = Tensor::randn(0f32, 1.0, (n_kv, t, hd), gpu)?;
    let v = Tensor::randn(0f32, 1.0, (n_kv, t, hd), gpu)?;
    let flash_ms = 1e3 * median_seconds(gpu, 5, || Ok(flash_attention(&q, &k, &v, 0, scale)?))?;
    let route_ms = 1e3 * median_seconds(gpu, 3, || Ok(attend_segment(&q, &k, &v, 0, scale)?))?;
    let matmul_ms = 1e3 * median_seconds(gpu, 3, || matmul_route(&q, &k, &v, 0, scale))?;
    // QKᵀ and P·V over the causal triangle: 4·hd flops per (row, head, key).
    let flops = 4.0 * (hd * n_h) as f64 * (t * (t + 1) / 2) as f64;
    r.note(
        "flash attention T=8192, 24/4 hd 256: median ms (5 runs, bf16 conversion included)",
        json!(flash_ms),
    );
    r.note(
        "  … flash attention TFLOP/s (causal QKᵀ + PV)",
        json!(flops / flash_ms / 1e9),
    );
    r.note(
        "  … attend_segment, this build's CUDA route: median ms (3 runs)",
        json!(route_ms),
    );
    r.note(
        "  … batched-matmul route (pieces of 2048 rows): median ms (3 runs)",
        json!(matmul_ms),
    );
    r.note(
        "  … speed-up over the batched-matmul route",
        json!(matmul_ms / flash_ms),
    );
    // Accuracy at full length: rows at the start, middle and end against the CPU twin.
    let got = flash_attention(&q, &k, &v, 0, scale)?.to_device(&Device::Cpu)?;
    let x = [
        q.to_device(&Device::Cpu)?,
        k.to_device(&Device::Cpu)?,
        v.to_device(&Device::Cpu)?,
    ];
    let (mut got_w, mut want_w) = (Vec::new(), Vec::new());
    for (start, len) in [(0usize, 16usize), (4093, 16), (t - 16, 16)] {
        got_w.push(got.narrow(0, start, len)?);
        want_w.push(cpu_rows(&x, 0, scale, start, len)?);
    }
    r.compare(
        "flash attention T=8192, 24/4 hd 256: 48 rows vs CPU twin",
        &Tensor::cat(&got_w, 0)?,
        &Tensor::cat(&want_w, 0)?,
        FLASH_BOUND,
    )?;

    // One decode step after 8,191 cached tokens.
    let (q1, k1, v1) = (q.narrow(0, t - 1, 1)?.contiguous()?, k.clone(), v.clone());
    let flash_step =
        1e3 * median_seconds(gpu, 9, || Ok(flash_attention(&q1, &k1, &v1, t - 1, scale)?))?;
    let old_step = 1e3
        * median_seconds(gpu, 9, || {
            Ok(prism_model::cuda::causal_attention(
                &q1,
                &k1,
                &v1,
                t - 1,
                scale,
            )?)
        })?;
    r.note(
        "flash attention decode step after 8191 cached, 24/4 hd 256: median ms",
        json!(flash_step),
    );
    r.note(
        "  … one-warp-per-row kernel (cuda::causal_attention), same step: median ms",
        json!(old_step),
    );
    Ok(())
}

/// The flash-attention device checks (accuracy, bitwise invariance, timing); see the module doc.
pub fn checks(r: &mut Report, gpu: &Device) -> Result<()> {
    // Its own random stream: the other checks' inputs stay what they were.
    let mut rng = Rng(0xF1A5_4A77_0E77_1001);
    accuracy_checks(r, gpu, &mut rng)?;
    invariance_checks(r, gpu, &mut rng)?;
    timing_checks(r, gpu)
}

/// Several sequences in one launch, bit for bit each alone: segments of 1 (decode steps), 7, 64 and 300
/// rows after 0 to 1,000 cached keys, 70 of them (two launches of at most 64), their new keys and values
/// written by `kv_append_batch` into caches with room to grow (heads `rows ≥ past + T` apart, read in
/// place) — against `flash_attention` of each segment alone on contiguous copies.
fn batched(rng: &mut Rng, gpu: &Device, r: &mut Report) -> Result<()> {
    for (n_h, n_kv, hd) in LAYOUTS {
        let lens: Vec<(usize, usize)> = (0..70)
            .map(|i| {
                let t = [1usize, 1, 1, 7, 64, 300][i % 6];
                let past = [0usize, 1, 63, 64, 255, 1000][(i * 7) % 6];
                (t, past)
            })
            .collect();
        let n: usize = lens.iter().map(|(t, _)| t).sum();
        let q = rng.tensor(&[n, n_h, hd], 3.0)?.to_device(gpu)?;
        let k_new = rng
            .tensor(&[n, n_kv, hd], 1.0)?
            .to_dtype(DType::BF16)?
            .to_device(gpu)?;
        let v_new = rng
            .tensor(&[n, n_kv, hd], 1.0)?
            .to_dtype(DType::BF16)?
            .to_device(gpu)?;
        // Each sequence's cache: its past keys in a room of past + T + 37 rows. (Drawn like k_new and
        // v_new above, as every bf16 input of this file is; this crate builds only with CUDA.)
        let mut rooms = Vec::new();
        for &(t, past) in &lens {
            let rows = past + t + 37;
            let k = rng
                .tensor(&[n_kv, rows, hd], 1.0)?
                .to_dtype(DType::BF16)?
                .to_device(gpu)?;
            let v = rng
                .tensor(&[n_kv, rows, hd], 1.0)?
                .to_dtype(DType::BF16)?
                .to_device(gpu)?;
            rooms.push((k, v));
        }
        let mut appends = Vec::new();
        let mut row = 0;
        for (&(t, past), (k, v)) in lens.iter().zip(&rooms) {
            appends.push(KvAppend {
                row,
                len: t,
                at: past,
                k,
                v,
            });
            row += t;
        }
        kv_append_batch(&k_new, &v_new, &appends)?;
        let views: Vec<(Tensor, Tensor)> = lens
            .iter()
            .zip(&rooms)
            .map(|(&(t, past), (k, v))| Ok((k.narrow(1, 0, past + t)?, v.narrow(1, 0, past + t)?)))
            .collect::<Result<_>>()?;
        let mut segments = Vec::new();
        let mut row = 0;
        for (&(t, past), (k, v)) in lens.iter().zip(&views) {
            segments.push(FlashSegment {
                row,
                len: t,
                past,
                k,
                v,
            });
            row += t;
        }
        let scale = 1.0 / (hd as f64).sqrt();
        let got = flash_attention_batch(&q, &segments, scale)?;
        let mut alone = Vec::new();
        let (mut want_rows, mut got_rows) = (Vec::new(), Vec::new());
        let mut row = 0;
        for (&(t, past), (k, v)) in lens.iter().zip(&views) {
            let (kc, vc) = (k.contiguous()?, v.contiguous()?);
            // The appended rows are the new keys' and values' bits.
            for (new, cache) in [(&k_new, &kc), (&v_new, &vc)] {
                want_rows.push(
                    new.narrow(0, row, t)?
                        .transpose(0, 1)?
                        .contiguous()?
                        .flatten_all()?,
                );
                got_rows.push(cache.narrow(1, past, t)?.contiguous()?.flatten_all()?);
            }
            alone.push(flash_attention(
                &q.narrow(0, row, t)?,
                &kc,
                &vc,
                past,
                scale,
            )?);
            row += t;
        }
        let tag = format!("flash attention (GPU) {n_h}/{n_kv} hd {hd}");
        r.identical(
            &format!("{tag}: kv_append_batch, 70 segments' rows at their positions"),
            &Tensor::cat(&got_rows, 0)?,
            &Tensor::cat(&want_rows, 0)?,
        )?;
        r.identical(
            &format!("{tag}: 70 segments (T 1-300, past 0-1000, caches with room) in one batched call vs each alone"),
            &got,
            &Tensor::cat(&alone, 0)?,
        )?;
    }
    Ok(())
}
