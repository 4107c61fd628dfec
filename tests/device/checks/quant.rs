//! The integer matmul (`prism_quant::cuda::matmul`, kernels/quant_gemm.cu): the
//! device's bits against the CPU reference (`prism_quant::kernel::matmul`), per format.
//!
//! For Q8_0 (re-blocked per run, and per row), Q4_K and Q6_K weights (Q5_K runs Q4_K's kernel): reductions of 1–40 runs, a
//! Q8_0 row with a short last run, 1 to 300 outputs, 1 to 64 activation rows whose magnitudes differ by
//! 10⁴ with a few massive channels, then a row in the middle of the batch holding a NaN and one holding
//! ±∞ (those rows all NaN, every other row the CPU's bits), and a row alone against the same row in a
//! batch. Every output must be bit-identical.

use anyhow::Result;
use candle_core::{Device, Tensor};
use prism_gguf::quantize::quantize;
use prism_gguf::GgmlType;
use prism_quant::cuda::{matmul, matmul_with, CudaQuantWeight, Kernel, TileShape};
use prism_quant::{Q8Scales, QuantWeight};
use serde_json::json;

use crate::harness::{Report, Rng};

/// A random weight of `rows × cols` in `ty` (Q8_0, Q4_K or Q6_K), by llama.cpp's reference quantizers.
fn weight(
    rng: &mut Rng,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    q8: Q8Scales,
) -> Result<QuantWeight> {
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.05).collect();
    let bytes = quantize(ty, &values)?;
    Ok(QuantWeight::from_gguf_with(
        "check", ty, &bytes, rows, cols, q8,
    )?)
}

/// `m × k` activations: row r scaled by 10^(r mod 5 − 2), every 97th channel × 300.
// The pattern of prism-quant's tests/reference.rs `uneven_activations`, from this crate's own Rng: two
// test targets share no module.
fn activations(rng: &mut Rng, m: usize, k: usize) -> Vec<f32> {
    (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let v = rng.next_f32() * 10f32.powi((r % 5) as i32 - 2);
            if c % 97 == 13 {
                v * 300.0
            } else {
                v
            }
        })
        .collect()
}

pub fn checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let Device::Cuda(dev) = gpu else {
        anyhow::bail!("the integer matmul checks need a CUDA device");
    };
    let mut rng = Rng(0x1A7E_6E12_2026_1201);
    let cases = [
        (GgmlType::Q8_0, Q8Scales::PerRun, 128, 37),
        (GgmlType::Q8_0, Q8Scales::PerRun, 32 * 9, 300),
        (GgmlType::Q8_0, Q8Scales::PerRun, 5120, 64),
        (GgmlType::Q8_0, Q8Scales::PerRow, 1024, 96),
        // The Hopper tile's edges: N past a tile, parts of unequal runs, a short last run.
        (GgmlType::Q8_0, Q8Scales::PerRun, 5120 + 96, 300),
        (GgmlType::Q8_0, Q8Scales::PerRun, 640, 129),
        (GgmlType::Q4_K, Q8Scales::PerRun, 256, 5),
        (GgmlType::Q4_K, Q8Scales::PerRun, 5120, 130),
        (GgmlType::Q4_K, Q8Scales::PerRun, 1536, 64),
        (GgmlType::Q6_K, Q8Scales::PerRun, 768, 1),
        (GgmlType::Q6_K, Q8Scales::PerRun, 4096, 70),
    ];
    for (ty, q8, k, n) in cases {
        let w = weight(&mut rng, ty, n, k, q8)?;
        let dw = CudaQuantWeight::upload(&w, dev)?;
        let tag = format!("int8 matmul (GPU) {ty:?} {q8:?} K={k} N={n}");
        let rows: &[usize] = if ty == GgmlType::Q8_0 {
            &[1, 2, 3, 4, 7, 8, 9, 16, 31, 33, 64, 129, 300]
        } else {
            &[1, 7, 64]
        };
        for &m in rows {
            let x = activations(&mut rng, m, k);
            let want = prism_quant::kernel::matmul(&x, m, &w)?;
            let xg = Tensor::from_vec(x, (m, k), gpu)?;
            let got = matmul(&xg, &dw)?;
            r.identical(
                &format!("{tag} M={m}: vs the CPU reference"),
                &got,
                &Tensor::from_vec(want, (m, n), &Device::Cpu)?,
            )?;
            // Every kernel gives the same bits: the simple one and, on Hopper, both tile shapes
            // (elsewhere those run the simple kernel).
            let mut kernels = vec![("simple kernel".to_string(), Kernel::Simple)];
            if ty == GgmlType::Q8_0 {
                kernels.push(("skinny kernel".into(), Kernel::Skinny));
                // The narrow kernel, its split chosen and each split forced (a product past its
                // rows runs the simple kernel).
                kernels.push(("narrow kernel".into(), Kernel::Narrow));
                for splits in [1, 2, 4] {
                    kernels.push((
                        format!("narrow kernel in {splits} split(s)"),
                        Kernel::NarrowSplit(splits),
                    ));
                }
                kernels.push(("128-row tile".into(), Kernel::Tile(TileShape::M128)));
                kernels.push(("64-row tile".into(), Kernel::Tile(TileShape::M64)));
                // The swapped tile: its waves, every split over K, and a persistent grid of a
                // few CTAs (several jobs a CTA through the same stages).
                for (name, shape) in [("swapped tile", TileShape::S32)] {
                    kernels.push((name.into(), Kernel::Tile(shape)));
                    for splits in [1, 2, 4] {
                        kernels.push((
                            format!("{name} in {splits} split(s)"),
                            Kernel::TileSplit(shape, splits),
                        ));
                    }
                    for sms in [1, 3] {
                        kernels.push((
                            format!("{name} scheduled on {sms} CTA(s)"),
                            Kernel::TileGrid(shape, sms),
                        ));
                    }
                }
                // Every tile order: which CTA computes a tile, never what it computes.
                for group in [1, 2, 3, 8] {
                    kernels.push((
                        format!("128-row tile in tile order {group}"),
                        Kernel::TileOrder(TileShape::M128, group),
                    ));
                    kernels.push((
                        format!("64-row tile in tile order {group}"),
                        Kernel::TileOrder(TileShape::M64, group),
                    ));
                }
                // Every split over K: the parts' tree is the same whoever computes each part.
                for (rows, shape) in [(128, TileShape::M128), (64, TileShape::M64)] {
                    for splits in [1, 2, 4] {
                        kernels.push((
                            format!("{rows}-row tile in {splits} split(s)"),
                            Kernel::TileSplit(shape, splits),
                        ));
                    }
                    // The persistent grid on a few CTAs: rounds of whole tiles, leftovers split 4, 2
                    // or 1 ways, a CTA's jobs one after another through the same stages.
                    for sms in [1, 2, 3, 5, 7] {
                        kernels.push((
                            format!("{rows}-row tile scheduled on {sms} CTA(s)"),
                            Kernel::TileGrid(shape, sms),
                        ));
                    }
                }
            }
            for (label, kernel) in kernels {
                r.identical(
                    &format!("{tag} M={m}: {label} vs the default"),
                    &matmul_with(&xg, &dw, kernel)?,
                    &got,
                )?;
            }
        }
        // Non-finite rows 2 (NaN) and 4 (+inf) of 6: those rows NaN, the others the CPU's bits.
        let mut x = activations(&mut rng, 6, k);
        x[2 * k + k / 2] = f32::NAN;
        x[4 * k] = f32::INFINITY;
        let got = matmul(&Tensor::from_vec(x.clone(), (6, k), gpu)?, &dw)?;
        let mut want = Vec::with_capacity(6 * n);
        for row in 0..6 {
            if row == 2 || row == 4 {
                want.extend(std::iter::repeat_n(f32::NAN, n));
            } else {
                want.extend(prism_quant::kernel::matmul(
                    &x[row * k..(row + 1) * k],
                    1,
                    &w,
                )?);
            }
        }
        r.identical(
            &format!("{tag}: NaN / inf rows NaN, the others the CPU's"),
            &got,
            &Tensor::from_vec(want, (6, n), &Device::Cpu)?,
        )?;
        if ty == GgmlType::Q8_0 {
            let xg = Tensor::from_vec(x.clone(), (6, k), gpu)?;
            for splits in [1, 2, 4] {
                r.identical(
                    &format!("{tag}: NaN / inf rows, 64-row tile in {splits} split(s)"),
                    &matmul_with(&xg, &dw, Kernel::TileSplit(TileShape::M64, splits))?,
                    &got,
                )?;
            }
            for sms in [3, 7] {
                r.identical(
                    &format!("{tag}: NaN / inf rows, 64-row tile scheduled on {sms} CTAs"),
                    &matmul_with(&xg, &dw, Kernel::TileGrid(TileShape::M64, sms))?,
                    &got,
                )?;
            }
        }
        // The candle op on a CUDA tensor (what the model calls): the same bits.
        let op = prism_quant::QuantMatmul::new(std::sync::Arc::new(w.clone()));
        r.identical(
            &format!("{tag}: QuantMatmul::forward on the GPU vs prism_quant::cuda::matmul"),
            &op.forward(&Tensor::from_vec(x.clone(), (6, k), gpu)?)?,
            &got,
        )?;
        // A row alone vs the same row in the batch above.
        let alone = matmul(
            &Tensor::from_vec(x[3 * k..4 * k].to_vec(), (1, k), gpu)?,
            &dw,
        )?;
        r.identical(
            &format!("{tag}: row 3 alone vs in a batch of 6"),
            &alone,
            &got.narrow(0, 3, 1)?,
        )?;
    }
    wide_checks(r, gpu, dev, &mut rng)?;
    share_checks(r, gpu, dev, &mut rng)?;
    swiglu_checks(r, gpu, dev, &mut rng)?;
    gated_norm_checks(r, gpu, dev, &mut rng)?;
    add_norm_checks(r, gpu, dev, &mut rng)
}

/// A tensor-parallel device's share of a product (`prism_quant::cuda::matmul_share`: the `_share`
/// kernels, its parts' bounds as an argument) against the CPU's `matmul_share`, on every kernel that
/// the whole product has (the same list as above), for 2 and 4 devices: reductions whose parts are
/// unequal, a short last run, Q4_K and Q6_K on whole blocks; and the shares added up the tree against
/// the GPU's whole product.
fn share_checks(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::cuda_backend::CudaDevice,
    rng: &mut Rng,
) -> Result<()> {
    use prism_quant::cuda::matmul_share_with;
    let cases = [
        (GgmlType::Q8_0, 5120, 300, 2),
        (GgmlType::Q8_0, 5120, 300, 4),
        (GgmlType::Q8_0, 128 * 13 + 64, 129, 2),
        (GgmlType::Q8_0, 17_408, 96, 4),
        (GgmlType::Q4_K, 256 * 8, 70, 4),
        (GgmlType::Q6_K, 256 * 6, 64, 2),
    ];
    for (ty, k, n, devices) in cases {
        let w = weight(rng, ty, n, k, Q8Scales::PerRun)?;
        let whole = prism_quant::QuantMatmul::new(std::sync::Arc::new(w.clone()));
        let dw = CudaQuantWeight::upload(&w, dev)?;
        let rows: &[usize] = if ty == GgmlType::Q8_0 {
            &[1, 2, 5, 16, 33, 64, 200]
        } else {
            &[1, 7]
        };
        for &m in rows {
            let x = activations(rng, m, k);
            let xg = Tensor::from_vec(x.clone(), (m, k), gpu)?;
            let mut shares = Vec::new();
            for g in 0..devices {
                let share = whole.share_of_device(g, devices)?;
                let span = share
                    .share()
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("no span"))?;
                let runs = span.runs();
                let (c0, c1) = (runs.start * 128, (runs.end * 128).min(k));
                let xs: Vec<f32> = (0..m)
                    .flat_map(|row| x[row * k + c0..row * k + c1].iter().copied())
                    .collect();
                let want = prism_quant::matmul_share(&xs, m, share.weight(), &span)?;
                let want = Tensor::from_vec(want, (m, n), &Device::Cpu)?;
                let ds = CudaQuantWeight::upload(share.weight(), dev)?;
                let xsg = Tensor::from_vec(xs, (m, c1 - c0), gpu)?;
                let tag = format!(
                    "int8 matmul share (GPU) {ty:?} K={k} N={n} M={m}, device {g} of {devices} (parts {:?})",
                    span.parts
                );
                let mut kernels = vec![
                    ("default".to_string(), Kernel::Auto),
                    ("simple kernel".to_string(), Kernel::Simple),
                ];
                if ty == GgmlType::Q8_0 {
                    kernels.push(("skinny kernel".into(), Kernel::Skinny));
                    for splits in [1, 2, 4] {
                        kernels.push((
                            format!("narrow kernel in {splits} split(s)"),
                            Kernel::NarrowSplit(splits),
                        ));
                    }
                    for (name, shape) in [
                        ("128-row tile", TileShape::M128),
                        ("64-row tile", TileShape::M64),
                        ("swapped tile", TileShape::S32),
                    ] {
                        kernels.push((name.into(), Kernel::Tile(shape)));
                        for splits in [2, 4] {
                            kernels.push((
                                format!("{name} in {splits} split(s)"),
                                Kernel::TileSplit(shape, splits),
                            ));
                        }
                        kernels.push((format!("{name} on 3 CTAs"), Kernel::TileGrid(shape, 3)));
                    }
                }
                let mut got_default = None;
                for (label, kernel) in kernels {
                    let got = matmul_share_with(&xsg, &ds, &span, kernel)?;
                    r.identical(&format!("{tag}: {label} vs the CPU's share"), &got, &want)?;
                    got_default.get_or_insert(got);
                }
                // The candle op (what `Linear::Share` calls) on the GPU.
                r.identical(
                    &format!("{tag}: QuantMatmul::forward vs the CPU's share"),
                    &share.forward(&xsg.clone())?,
                    &want,
                )?;
                shares.extend(got_default);
            }
            let sum = match shares.as_slice() {
                [a, b] => (a + b)?,
                [a, b, c, d] => ((a + b)? + (c + d)?)?,
                _ => anyhow::bail!("{} shares", shares.len()),
            };
            r.identical(
                &format!(
                    "int8 matmul share (GPU) {ty:?} K={k} N={n} M={m}: {devices} shares added up the tree vs the whole product"
                ),
                &sum,
                &matmul(&xg, &dw)?,
            )?;
        }
    }
    Ok(())
}

/// More output tiles than the GPU has multiprocessors (the 27B gate|up width, 34,816 outputs, at a short
/// K): the default's persistent grid on the real device — at 64 rows a round of whole tiles and 4 tiles
/// split in quarters, at 300 rows five rounds and 20 quarter-split tiles — against the plain grid, the
/// simple kernel and, at 64 rows, the CPU reference.
fn wide_checks(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::cuda_backend::CudaDevice,
    rng: &mut Rng,
) -> Result<()> {
    let (k, n) = (1024, 34_816);
    let w = weight(rng, GgmlType::Q8_0, n, k, Q8Scales::PerRun)?;
    let dw = CudaQuantWeight::upload(&w, dev)?;
    for m in [64, 300] {
        let tag = format!("int8 matmul (GPU) Q8_0 K={k} N={n} M={m}");
        let x = activations(rng, m, k);
        let xg = Tensor::from_vec(x.clone(), (m, k), gpu)?;
        let got = matmul(&xg, &dw)?;
        if m == 64 {
            let want = prism_quant::kernel::matmul(&x, m, &w)?;
            r.identical(
                &format!("{tag}: the default vs the CPU reference"),
                &got,
                &Tensor::from_vec(want, (m, n), &Device::Cpu)?,
            )?;
        }
        for (label, kernel) in [
            ("simple kernel", Kernel::Simple),
            (
                "64-row tile, plain grid",
                Kernel::TileSplit(TileShape::M64, 1),
            ),
            (
                "128-row tile, plain grid",
                Kernel::TileSplit(TileShape::M128, 1),
            ),
            ("128-row tile", Kernel::Tile(TileShape::M128)),
        ] {
            r.identical(
                &format!("{tag}: {label} vs the default"),
                &matmul_with(&xg, &dw, kernel)?,
                &got,
            )?;
        }
    }
    Ok(())
}

/// The kernels a fused quantizer's product is checked on: every one that runs `ty`.
fn fused_kernels(ty: GgmlType) -> Vec<(&'static str, Kernel)> {
    let mut kernels = vec![("default", Kernel::Auto), ("simple kernel", Kernel::Simple)];
    if ty == GgmlType::Q8_0 {
        kernels.push(("skinny kernel", Kernel::Skinny));
        kernels.push(("narrow kernel", Kernel::Narrow));
        kernels.push(("narrow kernel in 4 splits", Kernel::NarrowSplit(4)));
        kernels.push(("128-row tile", Kernel::Tile(TileShape::M128)));
        kernels.push(("64-row tile", Kernel::Tile(TileShape::M64)));
    }
    kernels
}

/// The DeltaNet output norm fused into the activation quantizer (`matmul_gated_norm`, what the output
/// projection runs) against prism-model's gated norm kernel followed by the product: the same bits, for
/// every kernel, the gate a strided column range, with K-quant sums and a row holding a NaN.
fn gated_norm_checks(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::cuda_backend::CudaDevice,
    rng: &mut Rng,
) -> Result<()> {
    use candle_core::DType;
    use prism_quant::cuda::matmul_gated_norm_with;
    for (ty, heads, n) in [
        (GgmlType::Q8_0, 5, 129),
        (GgmlType::Q8_0, 48, 64),
        (GgmlType::Q4_K, 4, 64),
    ] {
        let k = heads * 128;
        let w = weight(rng, ty, n, k, Q8Scales::PerRun)?;
        let dw = CudaQuantWeight::upload(&w, dev)?;
        let norm_w = Tensor::from_vec(activations(rng, 1, 128), 128, gpu)?;
        for m in [1, 2, 7, 64, 300] {
            let mut x = activations(rng, m, k);
            if m >= 7 {
                x[5 * k + 130] = f32::NAN;
            }
            let x = Tensor::from_vec(x, (m, heads, 128), gpu)?;
            // The gate: the middle third of a wider projection output, read in place.
            let wide = Tensor::from_vec(activations(rng, m, 3 * k), (m, 3 * k), gpu)?;
            let gate = wide.narrow(1, k, k)?;
            let y = prism_model::ops::gated_rms_norm_rows(&x, &gate, &norm_w, 1e-6, DType::F32)?;
            let want = matmul(&y, &dw)?;
            let kernels = fused_kernels(ty);
            for (label, kernel) in kernels {
                r.identical(
                    &format!(
                        "int8 matmul (GPU) {ty:?} gated norm fused, heads={heads} N={n} M={m}: {label} \
                         vs the norm then the product"
                    ),
                    &matmul_gated_norm_with(&x, &gate, &norm_w, 1e-6, &dw, kernel)?,
                    &want,
                )?;
            }
        }
    }
    Ok(())
}

/// A layer's residual add and RMS norm fused into the activation quantizer (`matmul_add_norm`, what a
/// layer's first projection and the MLP's gate | up run) against prism-model's `add_rms_norm` (or
/// `rms_norm_as` without a residual) followed by the product: the same product bits for every kernel
/// and the same sum, with K-quant sums, the shortest row it takes, a row wider than the kernel keeps in
/// registers and a row holding a NaN; rows it does not take are refused (`None`).
fn add_norm_checks(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::cuda_backend::CudaDevice,
    rng: &mut Rng,
) -> Result<()> {
    use candle_core::DType;
    use prism_quant::cuda::matmul_add_norm_with;
    for (ty, k, n) in [
        (GgmlType::Q8_0, 1024, 129),
        (GgmlType::Q8_0, 5120, 64),
        (GgmlType::Q8_0, 2560, 300),
        // Wider than the 8,192 columns the kernel keeps in registers: its other groups read twice.
        (GgmlType::Q8_0, 9216, 40),
        (GgmlType::Q4_K, 2048, 64),
    ] {
        let w = weight(rng, ty, n, k, Q8Scales::PerRun)?;
        let dw = CudaQuantWeight::upload(&w, dev)?;
        let norm_w = Tensor::from_vec(activations(rng, 1, k), k, gpu)?;
        for m in [1, 2, 7, 64, 300] {
            let mut x = activations(rng, m, k);
            if m >= 7 {
                x[5 * k + 130] = f32::NAN;
            }
            let x = Tensor::from_vec(x, (m, k), gpu)?;
            let res = Tensor::from_vec(activations(rng, m, k), (m, k), gpu)?;
            for with_residual in [true, false] {
                let (want_sum, h) = if with_residual {
                    let (sum, h) =
                        prism_model::ops::add_rms_norm(&x, &res, &norm_w, 1e-6, DType::F32)?;
                    (Some(sum), h)
                } else {
                    (
                        None,
                        prism_model::ops::rms_norm_as(&x, &norm_w, 1e-6, DType::F32)?,
                    )
                };
                let want = matmul(&h, &dw)?;
                let tag = format!(
                    "int8 matmul (GPU) {ty:?} add + norm fused ({}), K={k} N={n} M={m}",
                    if with_residual {
                        "with a residual"
                    } else {
                        "x alone"
                    }
                );
                for (label, kernel) in fused_kernels(ty) {
                    let name = format!("{tag}: {label} vs the norm then the product");
                    let Some((sum, got)) = matmul_add_norm_with(
                        &x,
                        with_residual.then_some(&res),
                        &norm_w,
                        1e-6,
                        &dw,
                        kernel,
                    )?
                    else {
                        let line = "refused rows it takes";
                        r.check(&name, line, false, json!({"check": name, "ok": false}));
                        continue;
                    };
                    r.identical(&name, &got, &want)?;
                    match (&sum, &want_sum) {
                        (Some(sum), Some(want_sum)) => r.identical(
                            &format!("{tag}: {label}: the sum vs add_rms_norm's"),
                            sum,
                            want_sum,
                        )?,
                        (None, None) => {}
                        _ => {
                            let name = format!("{tag}: {label}: the sum");
                            let line = "a sum where none was asked, or none where one was";
                            r.check(&name, line, false, json!({"check": name, "ok": false}));
                        }
                    }
                }
            }
        }
    }
    // A row shorter than the fused kernel takes: refused, the caller runs the norm apart.
    let (k, n) = (512, 64);
    let w = weight(rng, GgmlType::Q8_0, n, k, Q8Scales::PerRun)?;
    let dw = CudaQuantWeight::upload(&w, dev)?;
    let x = Tensor::from_vec(activations(rng, 3, k), (3, k), gpu)?;
    let norm_w = Tensor::from_vec(activations(rng, 1, k), k, gpu)?;
    let refused = matmul_add_norm_with(&x, None, &norm_w, 1e-6, &dw, Kernel::Auto)?.is_none();
    let name = "int8 matmul (GPU) add + norm fused: a row of 512 is refused";
    r.check(name, "", refused, json!({"check": name, "ok": refused}));
    Ok(())
}

/// The SwiGLU fused into the activation quantizer (`matmul_swiglu`, what the MLP's down projection runs)
/// against prism-model's SwiGLU kernel followed by the product: the same bits, for every kernel, with
/// K-quant sums, short last runs and a row holding a NaN.
// The same parameters and case table shape as `gated_norm_checks` above: each check group takes the
// device and its own cases.
fn swiglu_checks(
    r: &mut Report,
    gpu: &Device,
    dev: &candle_core::cuda_backend::CudaDevice,
    rng: &mut Rng,
) -> Result<()> {
    use candle_core::DType;
    use prism_quant::cuda::matmul_swiglu_with;
    for (ty, f, n) in [
        (GgmlType::Q8_0, 640, 129),
        (GgmlType::Q8_0, 32 * 9, 300),
        (GgmlType::Q4_K, 1536, 64),
    ] {
        let w = weight(rng, ty, n, f, Q8Scales::PerRun)?;
        let dw = CudaQuantWeight::upload(&w, dev)?;
        for m in [1, 2, 7, 64, 300] {
            let mut gu = activations(rng, m, 2 * f);
            if m >= 7 {
                gu[5 * 2 * f + 3] = f32::NAN;
            }
            let gu = Tensor::from_vec(gu, (m, 2 * f), gpu)?;
            let h = prism_model::ops::swiglu_as(&gu, f, DType::F32)?;
            let want = matmul(&h, &dw)?;
            let kernels = fused_kernels(ty);
            for (label, kernel) in kernels {
                r.identical(
                    &format!(
                        "int8 matmul (GPU) {ty:?} swiglu fused, f={f} N={n} M={m}: {label} vs \
                         swiglu then the product"
                    ),
                    &matmul_swiglu_with(&gu, f, &dw, kernel)?,
                    &want,
                )?;
            }
        }
    }
    Ok(())
}
