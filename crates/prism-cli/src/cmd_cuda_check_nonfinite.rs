//! `prism cuda-check`: a non-finite value through the whole forward pass of the integer path (a child
//! module of cmd_cuda_check.rs: it reports through its `Report`).
//!
//! The tiny Q8_0 model gets a copy in memory in which one embedding block of one token (a token no
//! fixture prompt uses) has a NaN scale, so that token's embedding holds 32 NaNs. That token is put in
//! the middle of one prompt of a batch of four. On the GPU (row poisoning, no synchronization) the
//! prompt's last hidden state and its letter logits must be all NaN, and the other three prompts must
//! have the bits of the unmodified model on the same batch: the divergence stays in its own sequence
//! through every projection, norm, attention and delta-rule layer, and through the shared-prefix branching
//! of the read-out. On the CPU the same prompt is refused at the first projection (the reference's
//! error).

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_gguf::{GgmlType, GgufFile};
use prism_model::{LoadOptions, Precision, Qwen35Model};
use prism_quant::NonFiniteMode;
use serde_json::json;

use super::Report;

/// `gguf`'s bytes with the first block of `token`'s embedding row made NaN (its f16 scale for Q8_0 and
/// Q4_K/Q5_K blocks, the first element for float rows).
fn with_nan_embedding(path: &Path, gguf: &GgufFile, token: u32) -> Result<GgufFile> {
    let info = gguf
        .tensor_info("token_embd.weight")
        .context("no token_embd.weight")?;
    let rows = info.n_rows();
    if u64::from(token) >= rows {
        bail!("token {token} is outside the embedding's {rows} rows");
    }
    let row_bytes = info.n_bytes() / rows;
    let start = usize::try_from(gguf.data_offset() + info.offset + u64::from(token) * row_bytes)?;
    let nan: Vec<u8> = match info.ggml_type {
        GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::F16 => {
            0x7E00u16.to_le_bytes().to_vec()
        }
        GgmlType::F32 => f32::NAN.to_le_bytes().to_vec(),
        other => bail!("token_embd.weight is {other:?}: no NaN patch for that type"),
    };
    let mut bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    bytes
        .get_mut(start..start + nan.len())
        .context("the embedding row lies outside the file")?
        .copy_from_slice(&nan);
    Ok(GgufFile::from_bytes(bytes)?)
}

/// A check that holds or not, with what was measured.
fn pass(r: &mut Report, name: &str, ok: bool, detail: String) {
    println!("{name:<58} {detail}  {}", if ok { "ok" } else { "FAIL" });
    r.failed += usize::from(!ok);
    r.rows
        .push(json!({"check": name, "detail": detail, "ok": ok}));
}

fn rows_of(t: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let parts = rows
        .iter()
        .map(|&r| t.narrow(0, r, 1))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

pub fn checks(r: &mut Report, gpu: &Device, fixtures: &Path, prompts: &[Vec<u32>]) -> Result<()> {
    if prompts.len() < 8 {
        bail!(
            "the non-finite whole-forward check needs 8 fixture prompts, found {}",
            prompts.len()
        );
    }
    let path = fixtures.join("tiny-Q8_0.gguf");
    let clean = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let vocab = clean
        .tensor_info("token_embd.weight")
        .context("no token_embd.weight")?
        .n_rows() as u32;
    let token = (0..vocab)
        .rev()
        .find(|t| prompts.iter().all(|p| !p.contains(t)))
        .context("every token is used")?;
    let bad = with_nan_embedding(&path, &clean, token)?;
    let info = bad
        .tensor_info("token_embd.weight")
        .context("no token_embd.weight")?;
    let row = bad.dequantize_row(info, u64::from(token))?;
    let nans = row.iter().filter(|v| v.is_nan()).count();
    pass(
        r,
        &format!("int8 whole forward: token {token}'s embedding row holds NaN"),
        nans > 0,
        format!("{nans} of {}", row.len()),
    );

    let cpu_opts = LoadOptions {
        device: Device::Cpu,
        precision: Precision::Int8,
        hf_config: None,
    };
    let calibration =
        prism_model::calibration::calibrate(&clean, &cpu_opts, &prompts[..6], "cuda-check")?;
    let mut bad_calibration = calibration.clone();
    bad_calibration.model_key = prism_model::calibration::model_key(&bad);
    let gpu_opts = LoadOptions {
        device: gpu.clone(),
        ..cpu_opts.clone()
    };
    let clean_gpu = Qwen35Model::from_gguf_calibrated(&clean, &gpu_opts, &calibration)?;
    let bad_gpu = Qwen35Model::from_gguf_calibrated(&bad, &gpu_opts, &bad_calibration)?;

    // Prompt 3 with the token in its middle, between prompts 0, 7 and 1.
    let mut poisoned = prompts[3].clone();
    poisoned.insert(poisoned.len() / 2, token);
    let batch: Vec<&[u32]> = vec![&prompts[0], &poisoned, &prompts[7], &prompts[1]];
    let (bad_index, others) = (1usize, [0usize, 2, 3]);

    // The CPU reference refuses the prompt at its first projection.
    let bad_cpu = Qwen35Model::from_gguf_calibrated(&bad, &cpu_opts, &bad_calibration)?;
    let cpu = bad_cpu.last_hidden(&[&poisoned]);
    let refused =
        matches!(&cpu, Err(e) if e.to_string().contains("int8 quantization needs finite inputs"));
    pass(
        r,
        "int8 whole forward, CPU: the prompt with a NaN embedding is refused",
        refused,
        format!("{:?}", cpu.as_ref().err().map(|e| e.to_string())),
    );

    if prism_quant::op::nonfinite_mode()? == NonFiniteMode::Error {
        let got = bad_gpu.last_hidden(&batch);
        pass(
            r,
            "int8 whole forward, GPU with PRISM_QGEMM_NONFINITE=error: refused",
            got.is_err(),
            format!("{:?}", got.as_ref().err().map(|e| e.to_string())),
        );
        return Ok(());
    }
    let want = clean_gpu.last_hidden(&batch)?;
    let got = bad_gpu.last_hidden(&batch)?;
    let bad_row: Vec<f32> = got
        .narrow(0, bad_index, 1)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let not_nan = bad_row.iter().filter(|v| !v.is_nan()).count();
    pass(
        r,
        "int8 whole forward, GPU: the prompt's last hidden state is all NaN",
        not_nan == 0,
        format!("{not_nan} of {} not NaN", bad_row.len()),
    );
    r.identical(
        "int8 whole forward, GPU: the 3 other prompts vs the clean model",
        &rows_of(&got, &others)?,
        &rows_of(&want, &others)?,
    )?;

    // The read-out path (shared prefix, branching, selected head rows): the prompt's letters are NaN,
    // the others' have the clean model's bits.
    let letters: Vec<u32> = (0..26).collect();
    let want = clean_gpu.last_position_rows(&batch, &letters)?;
    let got = bad_gpu.last_position_rows(&batch, &letters)?;
    let bad_letters = got.get(bad_index).context("no read-out for the prompt")?;
    let finite = bad_letters.iter().filter(|v| v.is_finite()).count();
    pass(
        r,
        "int8 read-out, GPU: the prompt's 26 letter logits are not finite",
        finite == 0 && bad_letters.len() == letters.len(),
        format!("{finite} of {} finite", bad_letters.len()),
    );
    let differing: usize = others
        .iter()
        .map(|&i| match (got.get(i), want.get(i)) {
            (Some(g), Some(w)) if g.len() == w.len() => g
                .iter()
                .zip(w)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count(),
            _ => letters.len(),
        })
        .sum();
    pass(
        r,
        "int8 read-out, GPU: the 3 other prompts' letter logits vs the clean model",
        differing == 0,
        format!(
            "{differing} of {} differ in bits",
            others.len() * letters.len()
        ),
    );
    Ok(())
}
