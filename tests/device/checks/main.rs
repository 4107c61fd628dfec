//! The device checks (see the crate's doc): one `#[test]` a group, each reporting every comparison on
//! stdout (`--nocapture`) and failing with the names of the checks that failed. Run them one at a time
//! (`--test-threads=1`): the timings must not share the GPU.
#![cfg(feature = "cuda")]

mod delta;
mod flash;
mod fused;
mod harness;
mod kernels;
mod kv_fp8;
mod model;
mod quant;
mod tensor_parallel;
mod vision;

use anyhow::Result;
use harness::{fixtures, run_group};

// The tests below are alike in shape: each group is its own `#[test]` so that libtest can run one group
// by name (the device runs pick groups) and reports each on its own.

/// Norms, the causal conv, the one-warp attention kernel and the chunked delta rule (`kernels.rs`).
#[test]
fn kernels() -> Result<()> {
    run_group("kernels", kernels::checks)
}

/// The tensor-core attention kernel: accuracy, invariance, timings (`flash.rs`).
#[test]
fn flash_attention() -> Result<()> {
    run_group("flash attention", flash::checks)
}

/// The fused small kernels and the q/k norm + M-RoPE kernel (`fused.rs`).
#[test]
fn fused_kernels() -> Result<()> {
    run_group("fused kernels", fused::checks)
}

/// The batched delta rule (`delta.rs`).
#[test]
fn delta_rule_batched() -> Result<()> {
    run_group("batched delta rule", delta::checks)
}

/// The fixture model in bf16 (`model.rs`).
#[test]
fn model_bf16() -> Result<()> {
    run_group("model bf16", |r, gpu| {
        model::bf16_checks(r, gpu, &fixtures())
    })
}

/// The integer matmul against the CPU reference, bit for bit (`quant.rs`).
#[test]
fn integer_matmul() -> Result<()> {
    run_group("integer matmul", quant::checks)
}

/// The fixture model on the integer path (`model.rs`).
#[test]
fn model_integer() -> Result<()> {
    run_group("model integer", |r, gpu| {
        model::integer_checks(r, gpu, &fixtures())
    })
}

/// Tensor parallelism on one GPU (`tensor_parallel.rs`).
#[test]
fn tensor_parallel() -> Result<()> {
    run_group("tensor parallel", |r, gpu| {
        tensor_parallel::checks(r, gpu, &fixtures())
    })
}

/// The fp8 K/V cache (`kv_fp8.rs`).
#[test]
fn kv_fp8() -> Result<()> {
    run_group("fp8 K/V", |r, gpu| kv_fp8::checks(r, gpu, &fixtures()))
}

/// The vision tower on CUDA against the CPU and transformers, and a real-shape tower's time per image
/// (`vision.rs`).
#[test]
fn vision_tower() -> Result<()> {
    run_group("vision tower", |r, gpu| {
        vision::tower_checks(r, gpu)?;
        vision::real_shape_timing(r, gpu)
    })
}

/// The vision fixture's prompts with images, tower and decoder in f32 on CUDA against the CPU
/// (`vision.rs`).
#[test]
fn vision_prompts() -> Result<()> {
    run_group("vision prompts", vision::prompt_checks)
}
