//! The fp8 K/V cache (`prism_model::kv_fp8`, `cuda_kv_fp8`, kernels/kv_fp8.cu and the
//! fp8 variants of kernels/flash_attention.cu):
//!
//! 1. The device may run it (compute capability 8.9 or newer).
//! 2. Quantization on the GPU equals the CPU twin **bit for bit** (bytes and scales): rows whose scale is
//!    exactly 1 (each holds 448) sweeping ~11.7 M f32 values below 448 of both signs, every tie between
//!    neighbouring e4m3 values and the floats next to it, rows with values past 448, infinities, NaNs,
//!    zeros and subnormals, random rows of many amplitudes, and bf16 input.
//! 3. Dequantization on the GPU equals the CPU twin bit for bit: every finite byte at many scales
//!    (subnormal and huge ones included), to f32 and to bf16.
//! 4. The fp8 flash kernel equals the bf16 flash kernel on the dequantized (bf16) cache **bit for bit**,
//!    is within the flash bound of the CPU twin (f32 attention on the dequantized cache), and is
//!    batch-invariant bit for bit (rows after a cached prefix vs in one call, pieces + decode steps).
//! 5. The fixture model (tiny-Q8_0.gguf at int8) with fp8 K/V on the GPU: its logits against native K/V
//!    on the GPU and against fp8 K/V on the CPU (bounded), its batch invariance bit for bit (alone, in a
//!    batch, between other prompts, branched from a shared prefix, continued from a cached prefix, in
//!    pieces), and its K/V bytes against the GPU's native bf16 cache.
//! 6. Timing at 27B attention shapes: a prefill of 8,192 tokens and a decode step after 8,191 cached
//!    tokens, fp8 kernel next to the bf16 one (and next to dequantize + bf16 kernel).

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_model::attention::attend_segment_fp8;
use prism_model::cuda_flash::{flash_attention, flash_attention_fp8};
use prism_model::kv_fp8::{self, decode_e4m3, encode_e4m3};
use prism_model::state::LayerState;
use prism_model::{KvStorage, LoadOptions, Precision, Qwen35Model, SequenceState};
use serde_json::json;

use crate::harness::{median_seconds, on_device, Report, Rng};
use crate::model::{fixture_prompts, in_pieces};

/// Pass bound on ‖Δ‖/‖ref‖ of the fp8 flash kernel against the CPU twin on the same (dequantized)
/// cache: the bf16 flash kernel's bound (`flash.rs`), as both see the same values up to
/// the kernel's bf16 rounding.
const FLASH_BOUND: f64 = 1e-2;

/// Bound on max |Δlogit| between fp8 and native K/V on the GPU (tiny-Q8_0.gguf at int8, 12 fixture
/// prompts): the CPU test's bound for the int8 path (`crates/prism-model/tests/kv_fp8.rs`, measured
/// 0.301 there, bound 0.6).
const MODEL_FP8_VS_NATIVE_BOUND: f64 = 0.6;

/// Bound on ‖Δ‖/‖ref‖ between the GPU's and the CPU's fp8 integer paths: that of the native integer
/// paths' comparison in `model::integer_checks` (the GPU rounds attention operands to bf16, and the
/// random tiny model turns every int8 rounding that flips into a visible change).
const MODEL_GPU_VS_CPU_BOUND: f64 = 1e-1;

/// Head layouts checked: (query heads, KV heads, head dim).
const LAYOUTS: [(usize, usize, usize); 3] = [(24, 4, 256), (8, 2, 128), (4, 2, 64)];

/// GPU quantization of `x` (on the CPU) against the CPU twin: bytes and scales.
fn quantize_both(r: &mut Report, gpu: &Device, name: &str, x: &Tensor) -> Result<()> {
    let (qc, sc) = kv_fp8::quantize(x)?;
    let (qg, sg) = kv_fp8::quantize(&x.to_device(gpu)?)?;
    r.same_bits(&format!("{name}: bytes"), &qg, &qc)?;
    r.same_bits(&format!("{name}: scales"), &sg, &sc)
}

fn quantize_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    const D: usize = 256;
    // 1. Scale exactly 1: each row starts with 448, so x / scale = x and the kernel's e4m3 rounding is
    //    seen directly. Every 97th f32 bit pattern in [0, 448), both signs.
    let top = 448f32.to_bits();
    let mut sweep: Vec<f32> = (0..top)
        .step_by(97)
        .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
        .collect();
    // Every tie between neighbouring finite e4m3 values and the floats just below and above it.
    for b in 0u8..0x7E {
        let mid = (decode_e4m3(b) + decode_e4m3(b + 1)) / 2.0;
        for x in [
            mid,
            f32::from_bits(mid.to_bits() - 1),
            f32::from_bits(mid.to_bits() + 1),
        ] {
            sweep.extend([x, -x]);
        }
    }
    let rows: Vec<f32> = sweep
        .chunks(D - 1)
        .flat_map(|c| {
            let mut row = vec![448.0f32];
            row.extend_from_slice(c);
            row.resize(D, 0.0);
            row
        })
        .collect();
    let n = rows.len() / D;
    let x = Tensor::from_vec(rows, (n, D), &Device::Cpu)?;
    quantize_both(
        r,
        gpu,
        &format!("fp8 KV quantize, scale 1: {} values", n * (D - 1)),
        &x,
    )?;
    // The CPU twin's encoding of those rows is the plain e4m3 rounding (scale 1): a sanity check of the
    // sweep itself.
    let bytes = kv_fp8::quantize(&x)?.0.flatten_all()?.to_vec1::<u8>()?;
    let values = x.flatten_all()?.to_vec1::<f32>()?;
    let plain = values
        .iter()
        .zip(&bytes)
        .filter(|(v, b)| encode_e4m3(**v) != **b)
        .count();
    r.note(
        "fp8 KV quantize, scale 1: CPU bytes that are not the plain e4m3 rounding (expect 0)",
        json!(plain),
    );
    if plain != 0 {
        r.fail("fp8 KV quantize, scale 1: CPU bytes that are not the plain e4m3 rounding");
    }

    // 2. Special rows: past 448, infinities, NaNs, zeros, subnormals, a tie at every scale.
    let specials: Vec<Vec<f32>> = vec![
        vec![500.0, 464.0, 448.5, -1e30, 3.0, -0.0, 1e-45, 2.0],
        vec![f32::INFINITY, 1.0, -2.0, 0.5, f32::NAN, 0.0, -1e-40, 7.0],
        vec![f32::NAN; 8],
        vec![0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.0],
        vec![1e-44, -3e-45, 1e-45, 0.0, 2e-44, -1e-44, 5e-45, 1e-45],
        vec![1e-38, 3.3e-39, -7e-39, 1e-39, 2e-38, 0.0, 1.1e-38, -1e-38],
        vec![f32::MAX, -f32::MAX, 1.0, 3e38, 0.0, 1e30, -1e20, 2.0],
        vec![
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            1.0,
            2.0,
            3.0,
            4.0,
            5.0,
        ],
    ];
    let flat: Vec<f32> = specials.concat();
    let x = Tensor::from_vec(flat, (specials.len(), 8), &Device::Cpu)?;
    quantize_both(
        r,
        gpu,
        "fp8 KV quantize: special rows (inf, NaN, 0, tiny)",
        &x,
    )?;

    // 3. Random K/V-shaped rows of many amplitudes: [n_kv = 4, T = 300, 256] per amplitude.
    let mut random = Vec::new();
    for amp in [1e-30f32, 1e-6, 0.01, 1.0, 3.7, 300.0, 5e4, 1e30] {
        random.push((rng.tensor(&[4, 300, 256], 1.0)? * f64::from(amp))?);
    }
    let x = Tensor::cat(&random, 1)?;
    quantize_both(
        r,
        gpu,
        "fp8 KV quantize: random rows, 8 amplitudes 1e-30..1e30",
        &x,
    )?;
    // 4. Head dims 64 and 128, and bf16 input (converted exactly to f32 on both sides).
    for hd in [64usize, 128] {
        let x = rng.tensor(&[2, 333, hd], 2.5)?;
        quantize_both(r, gpu, &format!("fp8 KV quantize: random rows of {hd}"), &x)?;
    }
    let xb = rng.tensor(&[4, 257, 256], 9.0)?.to_dtype(DType::BF16)?;
    quantize_both(r, gpu, "fp8 KV quantize: bf16 input", &xb)?;
    Ok(())
}

fn dequantize_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    // Every finite byte (both NaN encodings left out: NaN payloads differ between f16 and the CPU's
    // f32 NaN) at scales from subnormal to huge.
    let finite: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
    let scales: Vec<f32> = vec![
        1.0,
        1.0 / 448.0,
        0.37,
        3e-39,
        1e-45,
        1e-30,
        2.5e30,
        7.0e35,
        f32::MAX / 448.0,
        0.001_234_5,
    ];
    let bytes: Vec<u8> = scales.iter().flat_map(|_| finite.clone()).collect();
    let b = Tensor::from_vec(bytes, (scales.len(), finite.len()), &Device::Cpu)?;
    let s = Tensor::from_vec(scales.clone(), scales.len(), &Device::Cpu)?;
    let (bg, sg) = (b.to_device(gpu)?, s.to_device(gpu)?);
    for dtype in [DType::F32, DType::BF16] {
        let cpu = kv_fp8::dequantize(&b, &s, DType::F32)?.to_dtype(dtype)?;
        let got = kv_fp8::dequantize(&bg, &sg, dtype)?;
        r.same_bits(
            &format!(
                "fp8 KV dequantize to {dtype:?}: {} bytes × {} scales",
                finite.len(),
                scales.len()
            ),
            &got,
            &cpu,
        )?;
    }
    Ok(())
}

/// Random q and a quantized cache for `t` new rows after `past`: `[q, k, k_scale, v, v_scale]` on the
/// CPU (bytes from random f32 keys/values of amplitude 1).
fn fp8_inputs(
    rng: &mut Rng,
    t: usize,
    past: usize,
    (n_h, n_kv, hd): (usize, usize, usize),
) -> Result<[Tensor; 5]> {
    let q = rng.tensor(&[t, n_h, hd], 3.0)?;
    let (k, ks) = kv_fp8::quantize(&rng.tensor(&[n_kv, past + t, hd], 1.0)?)?;
    let (v, vs) = kv_fp8::quantize(&rng.tensor(&[n_kv, past + t, hd], 1.0)?)?;
    Ok([q, k, ks, v, vs])
}

/// The fp8 flash kernel on `x` (GPU tensors), rows `past..past + t` where `x` holds keys `0..past + t`.
fn fp8_flash(x: &[Tensor; 5], past: usize, scale: f64) -> Result<Tensor> {
    Ok(flash_attention_fp8(
        &x[0],
        [&x[1], &x[2], &x[3], &x[4]],
        past,
        scale,
    )?)
}

/// Keys `0..keys` of a quantized cache `[k, k_scale, v, v_scale]` and the q rows `start..start + len`.
fn prefix(x: &[Tensor; 5], start: usize, len: usize, keys: usize) -> Result<[Tensor; 5]> {
    Ok([
        x[0].narrow(0, start, len)?.contiguous()?,
        x[1].narrow(1, 0, keys)?.contiguous()?,
        x[2].narrow(1, 0, keys)?.contiguous()?,
        x[3].narrow(1, 0, keys)?.contiguous()?,
        x[4].narrow(1, 0, keys)?.contiguous()?,
    ])
}

fn flash_checks(r: &mut Report, gpu: &Device, rng: &mut Rng) -> Result<()> {
    let mut worst = 0f64;
    for layout in LAYOUTS {
        let (n_h, n_kv, hd) = layout;
        let scale = 1.0 / (hd as f64).sqrt();
        for (t, past) in [(1usize, 0usize), (7, 37), (64, 300), (275, 0), (1000, 37)] {
            let x = fp8_inputs(rng, t, past, layout)?;
            let g = on_device(&x, gpu)?;
            let got = fp8_flash(&g, past, scale)?;
            // Bit for bit the bf16 kernel on the cache dequantized to bf16.
            let kb = kv_fp8::dequantize(&g[1], &g[2], DType::BF16)?;
            let vb = kv_fp8::dequantize(&g[3], &g[4], DType::BF16)?;
            let via_bf16 = flash_attention(&g[0], &kb, &vb, past, scale)?;
            let tag = format!("fp8 flash {n_h}/{n_kv} hd {hd}: {past} cached + {t} new");
            r.same_bits(
                &format!("{tag} vs bf16 kernel on the dequantized cache"),
                &got,
                &via_bf16,
            )?;
            // Against the CPU twin (f32 attention on the f32-dequantized cache): the last rows, as a
            // call of their own after past + start cached keys (the twin's rows do not depend on the
            // call they are in).
            let rows = t.min(200);
            let start = t - rows;
            let cpu = attend_segment_fp8(
                &x[0].narrow(0, start, rows)?.contiguous()?,
                [&x[1], &x[2], &x[3], &x[4]],
                past + start,
                scale,
            )
            .context("CPU twin")?;
            r.compare(
                &format!("{tag} vs CPU twin (last {rows} rows)"),
                &got.narrow(0, start, rows)?,
                &cpu,
                FLASH_BOUND,
            )?;
            worst = worst.max(r.last_rel());
        }
    }
    r.note(
        "fp8 flash: worst ‖Δ‖/‖ref‖ against the CPU twin",
        json!(worst),
    );

    // Batch invariance: rows after a cached prefix and pieces + decode steps vs one call.
    for (layout, n) in [((24, 4, 256), 700usize), ((4, 2, 64), 300)] {
        let (n_h, n_kv, hd) = layout;
        let scale = 1.0 / (hd as f64).sqrt();
        let x = on_device(&fp8_inputs(rng, n, 0, layout)?, gpu)?;
        let full = fp8_flash(&x, 0, scale)?;
        let tag = format!("fp8 flash (GPU) {n_h}/{n_kv} hd {hd}, {n} rows");
        for s in [1usize, 17, 63, 64, 65, n / 2 + 3, n - 1] {
            let tail = fp8_flash(&prefix(&x, s, n - s, n)?, s, scale)?;
            r.same_bits(
                &format!("{tag}: rows {s}.. after {s} cached vs in one call"),
                &tail,
                &full.narrow(0, s, n - s)?,
            )?;
        }
        let mut outs = Vec::new();
        let mut at = 0;
        for piece in [1usize, 7, 64, 100, 1, 1, 33] {
            outs.push(fp8_flash(&prefix(&x, at, piece, at + piece)?, at, scale)?);
            at += piece;
        }
        outs.push(fp8_flash(&prefix(&x, at, n - 3 - at, n - 3)?, at, scale)?);
        for at in n - 3..n {
            outs.push(fp8_flash(&prefix(&x, at, 1, at + 1)?, at, scale)?);
        }
        r.same_bits(
            &format!("{tag}: pieces 1/7/64/100/1/1/33/rest + 3 decode steps vs one call"),
            &Tensor::cat(&outs, 0)?,
            &full,
        )?;
    }
    Ok(())
}

fn timing_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (t, n_h, n_kv, hd) = (8192usize, 24usize, 4usize, 256usize);
    let scale = 1.0 / 16.0;
    let q = (Tensor::randn(0f32, 1.0, (t, n_h, hd), gpu)? * 1.7)?.to_dtype(DType::BF16)?;
    let k = Tensor::randn(0f32, 1.0, (n_kv, t, hd), gpu)?;
    let v = Tensor::randn(0f32, 1.0, (n_kv, t, hd), gpu)?;
    let (k8, ks) = kv_fp8::quantize(&k)?;
    let (v8, vs) = kv_fp8::quantize(&v)?;
    let (kb, vb) = (k.to_dtype(DType::BF16)?, v.to_dtype(DType::BF16)?);
    let bf16_ms = 1e3 * median_seconds(gpu, 5, || Ok(flash_attention(&q, &kb, &vb, 0, scale)?))?;
    let fp8_ms = 1e3
        * median_seconds(gpu, 5, || {
            Ok(flash_attention_fp8(&q, [&k8, &ks, &v8, &vs], 0, scale)?)
        })?;
    let deq_ms = 1e3
        * median_seconds(gpu, 5, || {
            let kd = kv_fp8::dequantize(&k8, &ks, DType::BF16)?;
            let vd = kv_fp8::dequantize(&v8, &vs, DType::BF16)?;
            Ok(flash_attention(&q, &kd, &vd, 0, scale)?)
        })?;
    r.note(
        "prefill T=8192, 24/4 hd 256: bf16 flash kernel, bf16 cache: median ms",
        json!(bf16_ms),
    );
    r.note("  … fp8 flash kernel, fp8 cache: median ms", json!(fp8_ms));
    r.note(
        "  … dequantize to bf16 + bf16 flash kernel: median ms",
        json!(deq_ms),
    );
    let quant_ms = 1e3
        * median_seconds(gpu, 9, || {
            let (a, _) = kv_fp8::quantize(&k)?;
            Ok(a)
        })?;
    r.note(
        "  … quantizing 8192 tokens' keys (4 KV heads × 256): median ms",
        json!(quant_ms),
    );
    let q1 = q.narrow(0, t - 1, 1)?.contiguous()?;
    let bf16_step =
        1e3 * median_seconds(gpu, 9, || Ok(flash_attention(&q1, &kb, &vb, t - 1, scale)?))?;
    let fp8_step = 1e3
        * median_seconds(gpu, 9, || {
            Ok(flash_attention_fp8(
                &q1,
                [&k8, &ks, &v8, &vs],
                t - 1,
                scale,
            )?)
        })?;
    r.note(
        "decode step after 8191 cached, 24/4 hd 256: bf16 flash kernel: median ms",
        json!(bf16_step),
    );
    r.note("  … fp8 flash kernel: median ms", json!(fp8_step));
    Ok(())
}

fn bits_f32(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

fn model_checks(
    r: &mut Report,
    gpu: &Device,
    fixtures: &std::path::Path,
    prompts: &[Vec<u32>],
) -> Result<()> {
    let gguf = prism_gguf::GgufFile::open(fixtures.join("tiny-Q8_0.gguf"))
        .context("opening tiny-Q8_0.gguf")?;
    let options = |device: &Device, kv_storage| LoadOptions {
        device: device.clone(),
        precision: Precision::Int8,
        kv_storage,
        ..LoadOptions::default()
    };
    let gpu_fp8 = Qwen35Model::from_gguf(&gguf, &options(gpu, KvStorage::Fp8))?;
    let gpu_native = Qwen35Model::from_gguf(&gguf, &options(gpu, KvStorage::Native))?;
    let cpu_fp8 = Qwen35Model::from_gguf(&gguf, &options(&Device::Cpu, KvStorage::Fp8))?;
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let logits = |m: &Qwen35Model, p: &[&[u32]]| -> Result<Tensor> {
        Ok(m.logits(&m.last_hidden(p)?)?.to_device(&Device::Cpu)?)
    };
    let fp8 = logits(&gpu_fp8, &refs)?;
    let native = logits(&gpu_native, &refs)?;
    let cpu = logits(&cpu_fp8, &refs)?;
    let d = (&fp8 - &native)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()? as f64;
    let ok = d.is_finite() && d > 0.0 && d <= MODEL_FP8_VS_NATIVE_BOUND;
    r.check(
        "int8 (GPU): fp8 K/V vs native (bf16) K/V, 12 prompts",
        &format!("max |Δlogit| {d:.4e}  bound {MODEL_FP8_VS_NATIVE_BOUND}"),
        ok,
        json!({"check": "int8 (GPU): fp8 vs native K/V max |Δlogit|", "max_abs": d, "bound": MODEL_FP8_VS_NATIVE_BOUND, "ok": ok}),
    );
    let mut argmax_same = 0;
    for i in 0..fp8.dim(0)? {
        if prism_model::argmax(&fp8.get(i)?)? == prism_model::argmax(&native.get(i)?)? {
            argmax_same += 1;
        }
    }
    r.note(
        "int8 (GPU): fp8 vs native K/V, same argmax",
        json!(format!("{argmax_same} of {}", fp8.dim(0)?)),
    );
    r.compare(
        "int8 fp8 K/V: GPU vs CPU logits, 12 prompts",
        &fp8,
        &cpu,
        MODEL_GPU_VS_CPU_BOUND,
    )?;

    // Batch invariance on the GPU, bit for bit.
    let alone = logits(&gpu_fp8, &refs[3..4])?;
    r.identical(
        "int8 fp8 K/V (GPU): prompt 3 alone vs in a batch of 12",
        &alone,
        &fp8.narrow(0, 3, 1)?,
    )?;
    let mixed = logits(&gpu_fp8, &[refs[7], refs[3], refs[1]])?;
    r.identical(
        "int8 fp8 K/V (GPU): prompt 3 between prompts 7 and 1",
        &mixed.narrow(0, 1, 1)?,
        &alone,
    )?;
    let shared = gpu_fp8
        .logits(&gpu_fp8.last_hidden_shared_prefix(&refs[..4])?)?
        .to_device(&Device::Cpu)?;
    r.identical(
        "int8 fp8 K/V (GPU): 4 prompts branched from their shared prefix",
        &shared,
        &fp8.narrow(0, 0, 4)?,
    )?;
    let p3 = &prompts[3];
    let mut whole = gpu_fp8.new_state()?;
    gpu_fp8.prefill(&mut whole, p3)?;
    let mut cached = gpu_fp8.new_state()?;
    gpu_fp8.prefill(&mut cached, &p3[..40])?;
    let mut continued = cached.clone();
    let h = gpu_fp8.prefill(&mut continued, &p3[40..])?;
    r.identical(
        "int8 fp8 K/V (GPU): prompt 3 continued from a cached 40-token prefix",
        &gpu_fp8.logits(&h)?,
        &alone,
    )?;
    let (a, b) = (cache_words(&continued)?, cache_words(&whole)?);
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    let ok = differing == 0 && !a.is_empty();
    r.check(
        "int8 fp8 K/V (GPU): stored bytes + scales, cached prefix vs one call",
        &format!("{differing} of {} cache words differ", a.len()),
        ok,
        json!({"check": "int8 fp8 K/V (GPU): stored cache, cached prefix vs one call", "differing": differing, "ok": ok}),
    );
    r.identical(
        "int8 fp8 K/V (GPU): prompt 0 in pieces 1/7/64/rest vs one call",
        &in_pieces(&gpu_fp8, &prompts[0])?,
        &fp8.narrow(0, 0, 1)?,
    )?;

    // Memory: the fp8 cache against the GPU's native (bf16) one.
    let mut native_state = gpu_native.new_state()?;
    gpu_native.prefill(&mut native_state, p3)?;
    // The native cache counts its room: the prompt's n positions and the room to grow.
    let ratio = whole.kv_bytes() as f64 / native_state.kv_bytes() as f64;
    let hd = gpu_fp8.config().head_dim as f64;
    let (n, rows) = (p3.len(), prism_model::state::KvRoom::rows_for(p3.len(), 0));
    let want = (hd + 4.0) / (2.0 * hd) * n as f64 / rows as f64;
    let ok = (ratio - want).abs() < 1e-9;
    r.check(
        "int8 (GPU): K/V bytes fp8 / bf16, prompt 3",
        &format!("{ratio:.4} (expected (hd + 4) / 2hd · n / room = {want:.4})"),
        ok,
        json!({"check": "int8 (GPU): K/V bytes fp8 / bf16", "ratio": ratio, "expected": want, "ok": ok}),
    );
    Ok(())
}

/// Every attention layer's stored bytes and scales of a state, as u32 words.
fn cache_words(state: &SequenceState) -> Result<Vec<u32>> {
    let mut words = Vec::new();
    for layer in state.layers() {
        if let LayerState::Attention(kv) = layer {
            for t in [&kv.k, &kv.v, &kv.k_scale, &kv.v_scale] {
                let t = t.as_ref().context("an fp8 cache without bytes or scales")?;
                words.extend(bits_f32(t)?);
            }
        }
    }
    Ok(words)
}

/// The fp8 K/V device checks; see the module doc.
pub fn checks(r: &mut Report, gpu: &Device, fixtures: &std::path::Path) -> Result<()> {
    let (major, minor) = prism_model::cuda_kv_fp8::compute_capability(gpu)?;
    r.note(
        "fp8 KV: compute capability",
        json!(format!("{major}.{minor}")),
    );
    if let Err(e) = kv_fp8::check_device(gpu) {
        // Below 8.9 the load refuses --kv-fp8: check that it does, and skip the rest.
        let refused = Qwen35Model::from_gguf(
            &prism_gguf::GgufFile::open(fixtures.join("tiny-Q8_0.gguf"))?,
            &LoadOptions {
                device: gpu.clone(),
                precision: Precision::Int8,
                kv_storage: KvStorage::Fp8,
                ..LoadOptions::default()
            },
        )
        .is_err();
        r.note(
            "fp8 KV: not supported on this GPU (the rest is skipped)",
            json!(e.to_string()),
        );
        if !refused {
            r.fail("fp8 KV: the load refuses --kv-fp8 on this GPU");
        }
        return Ok(());
    }
    // Its own random stream: the other checks' inputs stay what they were.
    let mut rng = Rng(0x0F8E_4A3F_2026_1202);
    quantize_checks(r, gpu, &mut rng)?;
    dequantize_checks(r, gpu)?;
    flash_checks(r, gpu, &mut rng)?;
    model_checks(r, gpu, fixtures, &fixture_prompts(fixtures)?)?;
    timing_checks(r, gpu)
}
