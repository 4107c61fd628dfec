//! `prism cuda-quant-check`: device tests and timings of the CUDA integer matmul (prism-quant's
//! `cuda` module, kernels/quant_gemm.cu).
//!
//! Random weights quantized by prism-gguf's Q8_0 / Q4_K / Q6_K quantizers (and random Q5_K bytes) at
//! the real shapes, plus ragged shapes (N not a multiple of any tile, odd N, reductions of 1–3 blocks
//! that leave parts empty, parts that are not whole stages), run on the GPU and on the CPU reference
//! (`prism_quant::kernel::matmul`); the outputs must be equal bit for bit. Both tensor-core families
//! run: v1 (64×64) and v2 (every tile), each with 1, 2 and 4 part groups and with the automatic plan;
//! every output of every variant is compared on the device with v1's automatic plan, which is compared
//! with the CPU reference; the plain one-thread-per-output kernel too (small M), and a row alone must
//! have the same bits as inside a batch. Then both families are timed next to cuBLAS bf16 at 27B
//! shapes, with a sweep of the v2 tiles and part groups next to the plan's cost model. Exit status 1
//! if any output differs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendDevice;
use candle_core::{DType, Device, Tensor};
use prism_gguf::quantize::quantize;
use prism_quant::chain::ChainTables;
use prism_quant::cuda::{self as qcuda, CudaQuantWeight};
use prism_quant::cuda_plan::{self, Family, GemmKernel, V2Tile};
use prism_quant::{ActivationScale, QuantError, QuantWeight, WeightFormat};
use rayon::prelude::*;
use serde_json::{json, Value};

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Roughly normal (sum of four uniforms), with a rare 8× outlier like real activations.
    fn activation(&mut self) -> f32 {
        let v = (self.next_f32() + self.next_f32() + self.next_f32() + self.next_f32()) * 0.5;
        if self.next_u64() % 997 == 0 {
            v * 8.0
        } else {
            v
        }
    }
}

struct Report {
    rows: Vec<Value>,
    failed: usize,
}

impl Report {
    fn bits(&mut self, name: &str, got: &[f32], want: &[f32]) {
        let differing = got
            .iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
            + got.len().abs_diff(want.len());
        let ok = differing == 0;
        println!(
            "{name:<78} {differing:>8} of {:>10} differ  {}",
            want.len(),
            if ok { "ok" } else { "FAIL" }
        );
        self.failed += usize::from(!ok);
        self.rows.push(
            json!({"check": name, "outputs": want.len(), "differing_bits": differing, "ok": ok}),
        );
    }

    /// A comparison made on the device: `differing` of `total` outputs differ in their bits.
    fn count(&mut self, name: &str, differing: usize, total: usize) {
        let ok = differing == 0;
        println!(
            "{name:<78} {differing:>8} of {total:>10} differ  {}",
            if ok { "ok" } else { "FAIL" }
        );
        self.failed += usize::from(!ok);
        self.rows
            .push(json!({"check": name, "outputs": total, "differing_bits": differing, "ok": ok}));
    }

    fn pass(&mut self, name: &str, ok: bool, detail: String) {
        println!("{name:<78} {detail}  {}", if ok { "ok" } else { "FAIL" });
        self.failed += usize::from(!ok);
        self.rows
            .push(json!({"check": name, "detail": detail, "ok": ok}));
    }
}

/// A weight of `n` rows × `k` inputs in `format`: random values through prism-gguf's quantizers (rows
/// quantized in parallel), or, for Q5_K (no quantizer here), random block bytes with small scales.
fn random_weight(format: WeightFormat, n: usize, k: usize, seed: u64) -> Result<QuantWeight> {
    let ty = format.ggml_type();
    let rows_per_task = 64;
    let chunks: Vec<Vec<u8>> = (0..n.div_ceil(rows_per_task))
        .into_par_iter()
        .map(|c| -> Result<Vec<u8>> {
            let mut rng = Rng(seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let rows = rows_per_task.min(n - c * rows_per_task);
            if format == WeightFormat::Q5K {
                let block_bytes = ty.type_size();
                let mut bytes: Vec<u8> = (0..rows * k / 256 * block_bytes)
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                for block in bytes.chunks_exact_mut(block_bytes) {
                    let d = f16_bits(0.001 + 0.002 * rng.next_f32().abs());
                    let dmin = f16_bits(0.0005 + 0.001 * rng.next_f32().abs());
                    block[0..2].copy_from_slice(&d.to_le_bytes());
                    block[2..4].copy_from_slice(&dmin.to_le_bytes());
                }
                return Ok(bytes);
            }
            let values: Vec<f32> = (0..rows * k).map(|_| rng.next_f32() * 0.04).collect();
            Ok(quantize(ty, &values)?)
        })
        .collect::<Result<_>>()?;
    let bytes = chunks.concat();
    Ok(QuantWeight::from_gguf("random", ty, &bytes, n, k)?)
}

/// The f16 bits of a positive normal value (mantissa truncated: any f16 scale will do here).
fn f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    ((exp.clamp(1, 30) as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The rows of an `m`-row batch compared with the CPU reference: all of them up to 64, else 64 spread
/// rows including the first, the last and the ones around the 64- and 128-row tile edges.
fn checked_rows(m: usize) -> Vec<usize> {
    if m <= 64 {
        return (0..m).collect();
    }
    let mut rows: Vec<usize> = vec![0, 1, 62, 63, 64, 65, 127, 128, 129, m / 2, m - 2, m - 1];
    let step = m / 52;
    rows.extend((0..52).map(|i| (i * step + 7).min(m - 1)));
    rows.retain(|&r| r < m);
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Every fixed kernel choice: v1 and each v2 tile, with 1, 2 and 4 part groups, and each v2 tile with
/// one part group and a tail split of 1 and 3 tile columns.
fn fixed_variants() -> Vec<(String, GemmKernel)> {
    let mut v = Vec::new();
    for g in [1u32, 2, 4] {
        v.push((
            format!("v1 64x64 G={g}"),
            GemmKernel::TensorCore { part_groups: g },
        ));
    }
    for tile in V2Tile::ALL {
        for g in [1u32, 2, 4] {
            v.push((
                format!("v2 {tile:?} G={g}"),
                GemmKernel::V2 {
                    tile,
                    part_groups: g,
                    tail_cols: 0,
                },
            ));
        }
        for tail_cols in [1u32, 3] {
            v.push((
                format!("v2 {tile:?} G=1 tail {tail_cols}"),
                GemmKernel::V2 {
                    tile,
                    part_groups: 1,
                    tail_cols,
                },
            ));
        }
    }
    v
}

/// A short name of the launch a kernel choice makes (which instantiation, how many part groups).
fn plan_name(
    kernel: GemmKernel,
    w: &CudaQuantWeight,
    m: usize,
    dev: &candle_core::CudaDevice,
) -> Result<String> {
    let p = qcuda::launch_plan(kernel, w.format(), m, w.rows(), w.cols(), dev)?;
    Ok(match (p.tile, p.tail(m, w.rows())) {
        (Some(t), Some(tail)) => format!(
            "{} G=1, tail of {} tiles from column {}",
            t.kernel, tail.tiles, tail.c0
        ),
        (Some(t), None) if p.persistent_ctas > 0 => {
            format!("{} G=1, {} persistent CTAs", t.kernel, p.persistent_ctas)
        }
        (Some(t), None) => format!("{} G={}", t.kernel, p.part_groups),
        (None, _) => "qgemm_simt".to_string(),
    })
}

/// One weight at one batch size: every kernel choice against v1's automatic plan on the device (all
/// outputs), v1's and v2's automatic plans against the CPU reference (the checked rows).
/// A Q8_0 weight uploaded for the chained tiles, with its tables (the CPU reference's input).
struct Chained {
    weight: CudaQuantWeight,
    tables: ChainTables,
}

/// The chained upload of `w` where the chained tiles can run (Q8_0 on sm_90).
fn chained_upload(w: &QuantWeight, dev: &candle_core::CudaDevice) -> Result<Option<Chained>> {
    if w.format() != WeightFormat::Q8_0 || qcuda::device_limits(dev)?.compute_major < 9 {
        return Ok(None);
    }
    Ok(Some(Chained {
        weight: CudaQuantWeight::upload_chained(w, dev)?,
        tables: ChainTables::new(w)?,
    }))
}

#[allow(clippy::too_many_arguments)]
fn check_case(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::CudaDevice,
    w: &QuantWeight,
    wg: &CudaQuantWeight,
    chained: Option<&Chained>,
    m: usize,
    rng: &mut Rng,
) -> Result<()> {
    let (k, n, format) = (w.cols(), w.rows(), w.format());
    let x: Vec<f32> = (0..m * k).map(|_| rng.activation()).collect();
    // A calibrated range below the batch's max, so some inputs clamp at ±127.
    let absmax = x.iter().fold(0f32, |a, v| a.max(v.abs())) * 0.9;
    let scale = ActivationScale::from_absmax(absmax)?;
    let xg = Tensor::from_slice(&x, (m, k), gpu)?;
    let tag = format!("{format:?} K={k} N={n} M={m}");
    let v1_auto = GemmKernel::AutoFamily(Family::V1);
    let v2_auto = GemmKernel::AutoFamily(Family::V2);
    let y_v1 = qcuda::matmul_with(&xg, wg, &scale, v1_auto)?;
    let y_v2 = qcuda::matmul_with(&xg, wg, &scale, v2_auto)?;

    // The CPU reference on the checked rows (each output depends only on its own row).
    let rows = checked_rows(m);
    let xr: Vec<f32> = rows
        .iter()
        .flat_map(|&i| x[i * k..(i + 1) * k].iter().copied())
        .collect();
    let want = prism_quant::kernel::matmul(&xr, rows.len(), w, &scale)?;
    let idx = Tensor::from_vec(
        rows.iter().map(|&i| i as u32).collect::<Vec<u32>>(),
        rows.len(),
        gpu,
    )?;
    for (name, y) in [("v1", &y_v1), ("v2", &y_v2)] {
        let kernel = if name == "v1" { v1_auto } else { v2_auto };
        let got = to_vec(&y.index_select(&idx, 0)?)?;
        r.bits(
            &format!(
                "{tag}: {name} auto ({}) vs CPU reference, {} rows",
                plan_name(kernel, wg, m, dev)?,
                rows.len()
            ),
            &got,
            &want,
        );
    }
    let total = m * n;
    r.count(
        &format!("{tag}: v2 auto vs v1 auto, all outputs"),
        qcuda::differing_bits(&y_v2, &y_v1)?,
        total,
    );
    let y_auto = qcuda::matmul(&xg, wg, &scale)?;
    r.count(
        &format!(
            "{tag}: default ({}) vs v1 auto",
            plan_name(GemmKernel::Auto, wg, m, dev)?
        ),
        qcuda::differing_bits(&y_auto, &y_v1)?,
        total,
    );
    let mut variants = fixed_variants();
    // Persistent CTAs: the Q8_0 warp-specialized mma.sync tiles.
    let persistent = if format == WeightFormat::Q8_0 {
        vec![
            V2Tile::T128x128Tma,
            V2Tile::T96x128Tma,
            V2Tile::T128x128Ws,
            V2Tile::T96x128Ws,
        ]
    } else {
        Vec::new()
    };
    for tile in persistent {
        variants.push((
            format!("v2 {tile:?} G=1 persistent"),
            GemmKernel::V2Persistent { tile },
        ));
    }
    for (name, kernel) in variants {
        let y = qcuda::matmul_with(&xg, wg, &scale, kernel)?;
        r.count(
            &format!("{tag}: {name} vs v1 auto"),
            qcuda::differing_bits(&y, &y_v1)?,
            total,
        );
    }
    if m <= 190 {
        let y = qcuda::matmul_with(&xg, wg, &scale, GemmKernel::Simt)?;
        r.count(
            &format!("{tag}: plain kernel vs v1 auto"),
            qcuda::differing_bits(&y, &y_v1)?,
            total,
        );
    }
    if m > 1 {
        let i = m - 1;
        for (name, kernel) in [("v1", v1_auto), ("v2", v2_auto)] {
            let alone = qcuda::matmul_with(&xg.narrow(0, i, 1)?, wg, &scale, kernel)?;
            r.count(
                &format!("{tag}: {name} auto, row {i} alone vs in the batch"),
                qcuda::differing_bits(&alone, &y_v1.narrow(0, i, 1)?)?,
                n,
            );
        }
    }
    // The chained tiles against the chained reduction's CPU reference, and every part grouping and
    // tail against G = 1.
    if let Some(c) = chained {
        let want = prism_quant::chain::matmul_chained(&xr, rows.len(), w, &c.tables, &scale)?;
        for tile in V2Tile::CHAINED {
            let kernel = |part_groups, tail_cols| GemmKernel::V2 {
                tile,
                part_groups,
                tail_cols,
            };
            let base = qcuda::matmul_with(&xg, &c.weight, &scale, kernel(1, 0))?;
            r.bits(
                &format!(
                    "{tag}: chained {tile:?} G=1 vs the chained CPU reference, {} rows",
                    rows.len()
                ),
                &to_vec(&base.index_select(&idx, 0)?)?,
                &want,
            );
            for (g, tail) in [(2u32, 0u32), (4, 0), (1, 1), (1, 3)] {
                let y = qcuda::matmul_with(&xg, &c.weight, &scale, kernel(g, tail))?;
                r.count(
                    &format!("{tag}: chained {tile:?} G={g} tail {tail} vs G=1"),
                    qcuda::differing_bits(&y, &base)?,
                    total,
                );
            }
            if m > 1 {
                let i = m - 1;
                let alone =
                    qcuda::matmul_with(&xg.narrow(0, i, 1)?, &c.weight, &scale, kernel(1, 0))?;
                r.count(
                    &format!("{tag}: chained {tile:?}, row {i} alone vs in the batch"),
                    qcuda::differing_bits(&alone, &base.narrow(0, i, 1)?)?,
                    n,
                );
            }
        }
        // Each weight upload runs only on its own kind of tile.
        let refused = qcuda::matmul_with(&xg, &c.weight, &scale, v2_auto).is_err()
            && qcuda::matmul_with(
                &xg,
                wg,
                &scale,
                GemmKernel::V2 {
                    tile: V2Tile::T128x128Wgc,
                    part_groups: 1,
                    tail_cols: 0,
                },
            )
            .is_err();
        r.pass(
            &format!("{tag}: chained and plain uploads refuse each other's kernels"),
            refused,
            String::new(),
        );
    }
    Ok(())
}

fn quant_checks(r: &mut Report, gpu: &Device, dev: &candle_core::CudaDevice) -> Result<()> {
    let shapes = [
        (1024usize, 3584usize),
        (5120, 17408),
        (17408, 5120),
        (5120, 6144),
    ];
    let batch_sizes = [1usize, 7, 64, 190, 1000, 4096];
    let formats = [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K];
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    for (si, &(k, n)) in shapes.iter().enumerate() {
        for (fi, &format) in formats.iter().enumerate() {
            let t0 = Instant::now();
            let w = random_weight(format, n, k, 1000 + (si * 10 + fi) as u64)?;
            let wg = CudaQuantWeight::upload(&w, dev)?;
            let chained = chained_upload(&w, dev)?;
            let quantized_s = t0.elapsed().as_secs_f64();
            for &m in &batch_sizes {
                check_case(r, gpu, dev, &w, &wg, chained.as_ref(), m, &mut rng)?;
            }
            println!("  ({format:?} K={k} N={n}: quantize + upload {quantized_s:.1} s)");
        }
    }
    // Ragged shapes: N odd and not a multiple of any tile; Q8_0 K = 35 blocks (parts of 8, 9, 9, 9
    // blocks: stages of fewer than 4 blocks) and K = 3 blocks (an empty part); K-quants K = 5 blocks
    // (parts of 1, 1, 1, 2) and 1 block (three empty parts).
    let ragged = [
        (WeightFormat::Q8_0, 1120usize, 1001usize),
        (WeightFormat::Q8_0, 96, 72),
        (WeightFormat::Q4K, 1280, 1001),
        (WeightFormat::Q4K, 256, 130),
        (WeightFormat::Q6K, 1280, 1001),
        (WeightFormat::Q6K, 256, 130),
        (WeightFormat::Q5K, 1280, 1001),
    ];
    for (i, &(format, k, n)) in ragged.iter().enumerate() {
        let w = random_weight(format, n, k, 500 + i as u64)?;
        let wg = CudaQuantWeight::upload(&w, dev)?;
        let chained = chained_upload(&w, dev)?;
        for m in [1usize, 7, 130, 333] {
            check_case(r, gpu, dev, &w, &wg, chained.as_ref(), m, &mut rng)?;
        }
    }
    // Q5_K (random block bytes: no quantizer in prism-gguf) at a real shape.
    let (k, n) = (5120, 3584);
    let w = random_weight(WeightFormat::Q5K, n, k, 77)?;
    let wg = CudaQuantWeight::upload(&w, dev)?;
    for m in [1usize, 190, 1000] {
        check_case(r, gpu, dev, &w, &wg, None, m, &mut rng)?;
    }
    Ok(())
}

fn activation_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    // 9 groups of 32: the last warp of the kernel (4 groups a warp) holds only one.
    activation_case(r, gpu, 3, 96)?;
    activation_case(r, gpu, 300, 5120)
}

fn activation_case(r: &mut Report, gpu: &Device, m: usize, k: usize) -> Result<()> {
    let mut rng = Rng(42);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.activation() * 3.0).collect();
    // Exact ties of x · inv_scale (inv_scale = 1 for absmax 127) and the clamp.
    x[..8].copy_from_slice(&[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -300.0]);
    let scale = ActivationScale::from_absmax(127.0)?;
    let xs = ActivationScale::from_absmax(6.0)?;
    for (name, s) in [("inv_scale 1 (ties)", scale), ("absmax 6 (clamping)", xs)] {
        let want = prism_quant::quantize_rows(&x, m, k, &s, 32)?;
        let xg = Tensor::from_slice(&x, (m, k), gpu)?;
        let dq = qcuda::quantize_activations(&xg, &s, true)?;
        let dev = match gpu {
            Device::Cuda(d) => d.clone(),
            _ => bail!("not a CUDA device"),
        };
        dq.check_finite(&xg, &dev)?;
        let (q, sums) = dq.into_tensors(&dev);
        let q: Vec<u8> = q.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
        let differ = q
            .iter()
            .zip(&want.q)
            .filter(|(a, b)| **a as i8 != **b)
            .count();
        r.pass(
            &format!("activation quantization [{m}, {k}], {name}"),
            differ == 0,
            format!("{differ} of {} differ", q.len()),
        );
        let sums: Vec<i32> = match sums {
            Some(t) => t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?,
            None => Vec::new(),
        };
        let ok = sums == want.group_sums;
        r.pass(
            &format!("activation sums per 32, {name}"),
            ok,
            format!("{} sums", want.group_sums.len()),
        );
    }
    Ok(())
}

/// Weights loaded straight to the GPU (what a model load for a GPU makes: the host copy dropped,
/// `CudaQuantWeight::upload_owned` + `QuantMatmul::from_device`): the same bits as a weight kept on the
/// host and uploaded on its first product, and as the CPU reference; rows selected on the device (the
/// read-out's letter rows) equal those columns of the full product and the CPU's product of the same
/// rows; the CPU forward of a GPU-only weight and rows out of range are refused.
fn device_only_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let dev = match gpu {
        Device::Cuda(d) => d.clone(),
        _ => bail!("not a CUDA device"),
    };
    let (m, n, k) = (37usize, 300usize, 1024usize);
    let mut rng = Rng(0x5EED);
    let x: Vec<f32> = (0..m * k).map(|_| rng.activation()).collect();
    let xg = Tensor::from_slice(&x, (m, k), gpu)?;
    let scale = ActivationScale::from_absmax(4.0)?;
    let rows: [u32; 6] = [5, 0, 299, 17, 5, 128];
    for format in [
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ] {
        let tag = format!("GPU-only weight {format:?} [{n}, {k}], M {m}");
        let w = random_weight(format, n, k, 0xD0 + format as u64)?;
        let cpu = prism_quant::kernel::matmul(&x, m, &w, &scale)?;
        let on_host = prism_quant::QuantMatmul::new(std::sync::Arc::new(w.clone()), scale);
        let gpu_only = prism_quant::QuantMatmul::from_device(
            CudaQuantWeight::upload_owned(w.clone(), &dev)?,
            scale,
        );
        let y_host = on_host.forward(&xg)?;
        let y_dev = gpu_only.forward(&xg)?;
        r.bits(
            &format!("{tag}: vs the CPU reference"),
            &to_vec(&y_dev)?,
            &cpu,
        );
        r.bits(
            &format!("{tag}: vs a host weight uploaded on first use"),
            &to_vec(&y_dev)?,
            &to_vec(&y_host)?,
        );
        let picked = Tensor::from_slice(&rows, rows.len(), gpu)?;
        let sel = gpu_only.select_rows(&rows)?;
        let y_sel = sel.forward(&xg)?;
        r.bits(
            &format!("{tag}: rows {rows:?} selected on the device vs those columns"),
            &to_vec(&y_sel)?,
            &to_vec(&y_dev.index_select(&picked, 1)?)?,
        );
        let w_sel = w.select_rows(&rows)?;
        r.bits(
            &format!("{tag}: rows selected on the device vs the CPU's product of those rows"),
            &to_vec(&y_sel)?,
            &prism_quant::kernel::matmul(&x, m, &w_sel, &scale)?,
        );
        let on_cpu = gpu_only.forward(&Tensor::from_slice(&x, (m, k), &Device::Cpu)?);
        r.pass(
            &format!("{tag}: its CPU forward is refused"),
            matches!(&on_cpu, Err(e) if e.to_string().contains("GPU only")),
            format!("{:?}", on_cpu.as_ref().err().map(|e| e.to_string())),
        );
        let out_of_range = gpu_only.select_rows(&[3, n as u32]);
        r.pass(
            &format!("{tag}: row {n} is out of range"),
            matches!(out_of_range, Err(QuantError::RowOutOfRange { row, .. }) if row == n),
            format!("{:?}", out_of_range.as_ref().err().map(|e| e.to_string())),
        );
    }
    Ok(())
}

/// Non-finite inputs. The model's path (no synchronization): every output of a row holding a NaN or
/// ±∞ is NaN and every other row has the bits of the same call on clean inputs, for every kernel (the
/// poisoning runs after the split combine and the v2 scratch), through `QuantMatmul::forward` too. The
/// row flags name each bad row's first non-finite column (as the CPU finds it), and the eager check
/// is the CPU's error naming the same element.
fn non_finite_checks(r: &mut Report, gpu: &Device, dev: &candle_core::CudaDevice) -> Result<()> {
    let k = 5120usize;
    let mut rng = Rng(4242);
    for (format, n, m) in [
        (WeightFormat::Q8_0, 64usize, 300usize),
        (WeightFormat::Q4K, 1001, 300),
        (WeightFormat::Q6K, 1001, 1),
    ] {
        let clean: Vec<f32> = (0..m * k).map(|_| rng.activation() * 3.0).collect();
        let mut x = clean.clone();
        // NaN in one row, ±∞ in others: first columns inside a later group of 32, at the row's very
        // end and at 0; row 9 has two (the first one, column 40, is the one named).
        let mut bad: Vec<(usize, usize, f32)> = vec![(0, 0, f32::NAN)];
        if m > 1 {
            bad = vec![
                (3, 17, f32::NAN),
                (5, 2, f32::INFINITY),
                (7, k - 1, f32::NEG_INFINITY),
                (9, 100, f32::INFINITY),
                (9, 40, f32::NAN),
                (m - 1, 0, f32::NAN),
            ];
        }
        for &(row, col, v) in &bad {
            x[row * k + col] = v;
        }
        let scale = ActivationScale::from_absmax(6.0)?;
        let mut want_rows: Vec<(usize, usize)> = Vec::new();
        let mut scratch = vec![0i8; k];
        for row in 0..m {
            if let Err(col) = prism_quant::activation::quantize_row(
                &x[row * k..(row + 1) * k],
                &scale,
                &mut scratch,
            ) {
                want_rows.push((row, col));
            }
        }
        let bad_rows: Vec<u32> = want_rows.iter().map(|&(row, _)| row as u32).collect();
        let good_rows: Vec<u32> = (0..m as u32)
            .filter(|row| !bad_rows.contains(row))
            .collect();
        let tag = format!("{format:?} K={k} N={n} M={m}, NaN/±inf in rows {bad_rows:?}");
        let w = random_weight(format, n, k, 31)?;
        let wg = CudaQuantWeight::upload(&w, dev)?;
        let (xg, cleang) = (
            Tensor::from_slice(&x, (m, k), gpu)?,
            Tensor::from_slice(&clean, (m, k), gpu)?,
        );
        let bad_idx = Tensor::from_vec(bad_rows.clone(), bad_rows.len(), gpu)?;
        // (None: every row is bad; nothing to compare.)
        let good_idx = if good_rows.is_empty() {
            None
        } else {
            Some(Tensor::from_vec(good_rows.clone(), good_rows.len(), gpu)?)
        };

        // The flags: each bad row with its first non-finite column, as the CPU finds them.
        let qx = qcuda::quantize_activations(&xg, &scale, format.has_mins())?;
        let got_rows = qx.non_finite_rows(dev)?;
        r.pass(
            &format!("{tag}: row flags name each row's first non-finite column"),
            got_rows == want_rows,
            format!("GPU {got_rows:?}, CPU {want_rows:?}"),
        );

        let mut kernels = vec![
            ("default".to_string(), GemmKernel::Auto),
            ("v1 auto".to_string(), GemmKernel::AutoFamily(Family::V1)),
            ("v2 auto".to_string(), GemmKernel::AutoFamily(Family::V2)),
            ("plain".to_string(), GemmKernel::Simt),
        ];
        kernels.extend(fixed_variants());
        for (name, kernel) in kernels {
            let reference = qcuda::matmul_with(&cleang, &wg, &scale, kernel)?;
            let (y, _) = qcuda::matmul_deferred(&xg, &wg, &scale, kernel)?;
            poisoned_rows_report(
                r,
                &format!("{tag}: {name}"),
                &y,
                &reference,
                &bad_idx,
                good_idx.as_ref(),
                n,
            )?;
        }
        // The model's entry point (PRISM_QGEMM_NONFINITE unset or "poison": no synchronization).
        let mode = prism_quant::op::nonfinite_mode()?;
        let op = prism_quant::QuantMatmul::new(std::sync::Arc::new(w.clone()), scale);
        match mode {
            prism_quant::NonFiniteMode::Poison => {
                let y = op.forward(&xg)?;
                let reference = op.forward(&cleang)?;
                poisoned_rows_report(
                    r,
                    &format!("{tag}: QuantMatmul::forward"),
                    &y,
                    &reference,
                    &bad_idx,
                    good_idx.as_ref(),
                    n,
                )?;
            }
            prism_quant::NonFiniteMode::Error => {
                r.pass(
                    &format!("{tag}: QuantMatmul::forward (PRISM_QGEMM_NONFINITE=error)"),
                    op.forward(&xg).is_err(),
                    "refused".into(),
                );
            }
        }

        // The eager check: the CPU's error, naming the same element.
        let cpu = prism_quant::kernel::matmul(&x, m, &w, &scale);
        let gpu_err = qcuda::matmul(&xg, &wg, &scale);
        let same = match (&cpu, &gpu_err) {
            (Err(QuantError::NonFiniteActivation { row, col, .. }), Err(e)) => {
                e.to_string().contains(&format!("row {row}, element {col}"))
            }
            _ => false,
        };
        r.pass(
            &format!("{tag}: eager check is the CPU's error, same element"),
            same,
            format!(
                "CPU: {:?}; GPU: {:?}",
                cpu.as_ref().err().map(|e| e.to_string()),
                gpu_err.as_ref().err().map(|e| e.to_string())
            ),
        );
    }
    Ok(())
}

/// `y`'s rows `bad` are all NaN; its rows `good` have the bits of `reference` (the same call on clean
/// inputs).
fn poisoned_rows_report(
    r: &mut Report,
    name: &str,
    y: &Tensor,
    reference: &Tensor,
    bad: &Tensor,
    good: Option<&Tensor>,
    n: usize,
) -> Result<()> {
    let poisoned = to_vec(&y.index_select(bad, 0)?)?;
    let not_nan = poisoned.iter().filter(|v| !v.is_nan()).count();
    r.count(
        &format!("{name}: bad rows all NaN (outputs not NaN)"),
        not_nan,
        poisoned.len(),
    );
    let Some(good) = good else {
        return Ok(());
    };
    let (yg, rg) = (y.index_select(good, 0)?, reference.index_select(good, 0)?);
    r.count(
        &format!("{name}: other rows vs the clean call"),
        qcuda::differing_bits(&yg, &rg)?,
        good.elem_count() * n,
    );
    Ok(())
}

/// Median seconds of `runs` calls after two warm-up calls, synchronizing around each.
fn time_median(
    dev: &candle_core::CudaDevice,
    runs: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[runs / 2])
}

fn timings(r: &mut Report, gpu: &Device, dev: &candle_core::CudaDevice) -> Result<()> {
    let shapes = [(5120usize, 17408usize), (17408, 5120)];
    let batch_sizes = [1usize, 16, 64, 128, 256, 512, 2048, 16384];
    let sweep_sizes = [1usize, 16, 64, 128, 512, 2048, 16384];
    let limits = qcuda::device_limits(dev)?;
    println!(
        "\nGEMM alone (activations already quantized); v2+q: v2 with the activation quantization; \
         median of 20 after 2 warm-ups"
    );
    println!(
        "{:<5} {:>5} {:>5} {:>5}  {:>8} {:>6}  {:>8} {:>6} {:<24} {:>8}  {:>8} {:>6}  {:>6} {:>6}",
        "fmt",
        "K",
        "N",
        "M",
        "v1 ms",
        "TOPS",
        "v2 ms",
        "TOPS",
        "v2 plan",
        "v2+q ms",
        "bf16 ms",
        "TFLOPS",
        "v2/v1",
        "v2/bf16"
    );
    let mut sweep = Vec::new();
    for &(k, n) in &shapes {
        let wb = Tensor::randn(0f32, 0.02, (n, k), gpu)?.to_dtype(DType::BF16)?;
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let w = random_weight(format, n, k, 9)?;
            let wg = CudaQuantWeight::upload(&w, dev)?;
            for &m in &batch_sizes {
                let x = Tensor::randn(0f32, 1.0, (m, k), gpu)?;
                let scale = ActivationScale::from_absmax(5.0)?;
                let qx = qcuda::quantize_activations(&x, &scale, format.has_mins())?;
                let gemm = |kernel: GemmKernel| -> Result<f64> {
                    time_median(dev, 20, || {
                        qcuda::gemm_quantized(&qx, &wg, &scale, kernel, dev)?;
                        Ok(())
                    })
                };
                let t_v1 = gemm(GemmKernel::AutoFamily(Family::V1))?;
                let t_v2 = gemm(GemmKernel::AutoFamily(Family::V2))?;
                let t_v2q = time_median(dev, 20, || {
                    qcuda::matmul_deferred(&x, &wg, &scale, GemmKernel::AutoFamily(Family::V2))?;
                    Ok(())
                })?;
                let xb = x.to_dtype(DType::BF16)?;
                let t_b = time_median(dev, 20, || {
                    xb.matmul(&wb.t()?)?;
                    Ok(())
                })?;
                let ops = 2.0 * (m * n * k) as f64;
                let plan = plan_name(GemmKernel::AutoFamily(Family::V2), &wg, m, dev)?;
                println!(
                    "{:<5} {k:>5} {n:>5} {m:>5}  {:>8.3} {:>6.1}  {:>8.3} {:>6.1} {:<24} {:>8.3}  {:>8.3} {:>6.1}  {:>6.2} {:>6.2}",
                    format!("{format:?}"),
                    t_v1 * 1e3,
                    ops / t_v1 / 1e12,
                    t_v2 * 1e3,
                    ops / t_v2 / 1e12,
                    plan.trim_start_matches("qgemm2_"),
                    t_v2q * 1e3,
                    t_b * 1e3,
                    ops / t_b / 1e12,
                    t_v1 / t_v2,
                    t_b / t_v2
                );
                r.rows.push(json!({
                    "timing": format!("{format:?}"), "k": k, "n": n, "m": m,
                    "v1_ms": t_v1 * 1e3, "v1_tops": ops / t_v1 / 1e12,
                    "v2_ms": t_v2 * 1e3, "v2_tops": ops / t_v2 / 1e12, "v2_plan": plan,
                    "v2_with_quantization_ms": t_v2q * 1e3,
                    "bf16_ms": t_b * 1e3, "bf16_tflops": ops / t_b / 1e12,
                    "note": "v1/v2: GEMM alone on quantized activations; median of 20 after 2 warm-ups"
                }));
                if sweep_sizes.contains(&m) {
                    for tile in V2Tile::ALL {
                        for g in [1u32, 2, 4] {
                            let t = time_median(dev, 10, || {
                                qcuda::gemm_quantized(
                                    &qx,
                                    &wg,
                                    &scale,
                                    GemmKernel::V2 {
                                        tile,
                                        part_groups: g,
                                        tail_cols: 0,
                                    },
                                    dev,
                                )?;
                                Ok(())
                            })?;
                            let plan = cuda_plan::v2_tile_plan(format, tile);
                            let model = cuda_plan::model_seconds(&plan, &limits, m, n, k, g);
                            sweep.push((format, k, n, m, tile, g, t, model, ops));
                        }
                    }
                }
            }
        }
    }
    println!("\nv2 tile sweep (GEMM alone, median of 10) next to the plan's cost model");
    println!(
        "{:<5} {:>5} {:>5} {:>5}  {:<9} {:>2}  {:>8} {:>6}  {:>9}",
        "fmt", "K", "N", "M", "tile", "G", "ms", "TOPS", "model ms"
    );
    for (format, k, n, m, tile, g, t, model, ops) in sweep {
        let model_ms = model.map(|s| s * 1e3);
        println!(
            "{:<5} {k:>5} {n:>5} {m:>5}  {:<9} {g:>2}  {:>8.3} {:>6.1}  {:>9}",
            format!("{format:?}"),
            format!("{tile:?}"),
            t * 1e3,
            ops / t / 1e12,
            model_ms.map_or("-".to_string(), |v| format!("{v:.3}"))
        );
        r.rows.push(json!({
            "sweep": format!("{format:?}"), "k": k, "n": n, "m": m, "tile": format!("{tile:?}"),
            "part_groups": g, "ms": t * 1e3, "tops": ops / t / 1e12, "model_ms": model_ms,
        }));
    }
    Ok(())
}

/// `--gemm FORMAT,K,N,M,TILE,G`: one GEMM on random weights and activations, one warm-up call and
/// `runs` timed calls (each synchronized), for a profiler to look at one launch shape alone. G is 1, 2
/// or 4, or `1tC` for one part group with a tail split of C tile columns (v2 tiles).
pub fn time_one(spec: &str, runs: usize) -> Result<()> {
    let fields: Vec<&str> = spec.split(',').map(str::trim).collect();
    let [fmt, k, n, m, tile, g] = fields[..] else {
        bail!("--gemm {spec:?}: expected FORMAT,K,N,M,TILE,G (six fields separated by commas)");
    };
    let format = match fmt.to_ascii_lowercase().as_str() {
        "q8_0" => WeightFormat::Q8_0,
        "q4_k" | "q4k" => WeightFormat::Q4K,
        "q5_k" | "q5k" => WeightFormat::Q5K,
        "q6_k" | "q6k" => WeightFormat::Q6K,
        other => bail!("--gemm: unknown weight format {other:?} (q8_0, q4_k, q5_k or q6_k)"),
    };
    let num = |name: &str, v: &str| -> Result<usize> {
        v.parse::<usize>()
            .ok()
            .filter(|&x| x > 0)
            .with_context(|| format!("--gemm: {name} = {v:?} is not a positive integer"))
    };
    let (k, n, m) = (num("K", k)?, num("N", n)?, num("M", m)?);
    let persistent = g == "1p";
    let (g_field, (g, tail_cols)) = (
        g,
        match g {
            "1" | "1p" => (1u32, 0u32),
            "2" => (2, 0),
            "4" => (4, 0),
            other => match other.strip_prefix("1t").map(str::parse::<u32>) {
                Some(Ok(c)) if c > 0 => (1, c),
                _ => bail!(
                    "--gemm: G = {other:?}: expected 1, 2, 4, 1p (persistent CTAs) or 1tC (a tail of C > 0 columns)"
                ),
            },
        },
    );
    if tail_cols > 0 && matches!(tile.to_ascii_lowercase().as_str(), "auto" | "v1") {
        bail!("--gemm: a tail split (G = {g_field:?}) needs a v2 tile, not {tile:?}");
    }
    let kernel = match tile.to_ascii_lowercase().as_str() {
        "auto" => GemmKernel::Auto,
        "v1" => GemmKernel::TensorCore { part_groups: g },
        name => {
            let Some(tile) = V2Tile::ALL
                .into_iter()
                .chain(V2Tile::CHAINED)
                .find(|t| format!("{t:?}").eq_ignore_ascii_case(name))
            else {
                bail!(
                    "--gemm: unknown tile {tile:?} (one of {:?}, {:?}, v1 or auto)",
                    V2Tile::ALL,
                    V2Tile::CHAINED
                );
            };
            if persistent {
                GemmKernel::V2Persistent { tile }
            } else {
                GemmKernel::V2 {
                    tile,
                    part_groups: g,
                    tail_cols,
                }
            }
        }
    };
    if persistent && !matches!(kernel, GemmKernel::V2Persistent { .. }) {
        bail!("--gemm: persistent CTAs (G = 1p) need a v2 tile, not {tile:?}");
    }
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let dev = match &gpu {
        Device::Cuda(d) => d.clone(),
        _ => bail!("not a CUDA device"),
    };
    let w = random_weight(format, n, k, 9)?;
    let wg = match kernel {
        GemmKernel::V2 { tile, .. } if tile.chained(format) => {
            CudaQuantWeight::upload_chained(&w, &dev)?
        }
        _ => CudaQuantWeight::upload(&w, &dev)?,
    };
    let x = Tensor::randn(0f32, 1.0, (m, k), &gpu)?;
    let scale = ActivationScale::from_absmax(5.0)?;
    let qx = qcuda::quantize_activations(&x, &scale, format.has_mins())?;
    let plan = plan_name(kernel, &wg, m, &dev)?;
    let ops = 2.0 * (m * n * k) as f64;
    qcuda::gemm_quantized(&qx, &wg, &scale, kernel, &dev)?;
    dev.synchronize()?;
    for run in 0..runs {
        let t = Instant::now();
        qcuda::gemm_quantized(&qx, &wg, &scale, kernel, &dev)?;
        dev.synchronize()?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "{format:?} K={k} N={n} M={m} {plan}: run {run}: {:.3} ms, {:.1} TOPS",
            s * 1e3,
            ops / s / 1e12
        );
    }
    Ok(())
}

/// Runs the checks (and, with `time`, the timings); writes the results as JSON to `json_out`.
pub fn run(json_out: Option<PathBuf>, time: bool) -> Result<()> {
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let dev = match &gpu {
        Device::Cuda(d) => d.clone(),
        _ => bail!("not a CUDA device"),
    };
    let mut report = Report {
        rows: Vec::new(),
        failed: 0,
    };
    activation_checks(&mut report, &gpu)?;
    device_only_checks(&mut report, &gpu)?;
    non_finite_checks(&mut report, &gpu, &dev)?;
    quant_checks(&mut report, &gpu, &dev)?;
    if time {
        timings(&mut report, &gpu, &dev)?;
    }
    if let Some(path) = json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report.rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if report.failed > 0 {
        bail!("{} CUDA integer-matmul checks failed", report.failed);
    }
    println!("all CUDA integer-matmul checks passed");
    Ok(())
}
