//! Causal attention on the tensor cores (`kernels/flash_attention.cu`): bf16 `mma.sync` for QKᵀ and
//! P·V, f32 online softmax, key tiles aligned to absolute positions. Same interface as
//! [`crate::cuda::causal_attention`] and the same CPU twin ([`crate::attention::CausalAttention`]), at
//! bf16 accuracy (q, k, v and the probabilities are rounded to bf16; everything else is f32).
//!
//! Batch-invariant: a query row's output bits depend only on its q, its absolute position and keys /
//! values `0..=pos` — not on `T`, `past`, the grid or the other rows (the argument is in the kernel's
//! header comment). Mixing this kernel with another one for some `T` would lose that across calls, so
//! callers pick it by head dim alone ([`supports`]).

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, DType, Result, Tensor};
use prism_quant::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};

const FLASH_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flash_attention.fatbin"));

/// Absolute positions per block (`FA_ROWS`: 4 warps of 16 rows).
const POSITIONS_PER_BLOCK: usize = 64;
const THREADS: u32 = 128;
/// bf16 elements of padding per shared-memory row (`FA_PAD`).
const ROW_PAD: usize = 8;

/// The kernel for head dim `hd` and its key-tile size (`BK`; fixed per head dim, so never a function of
/// the call's shape).
fn kernel_for(hd: usize) -> Option<(&'static str, usize)> {
    match hd {
        256 => Some(("flash_attention_hd256", 32)),
        128 => Some(("flash_attention_hd128", 64)),
        64 => Some(("flash_attention_hd64", 64)),
        _ => None,
    }
}

/// Whether [`flash_attention`] runs this head layout: head dim 64, 128 or 256, `n_h` query heads in
/// groups over `n_kv` KV heads.
pub fn supports(hd: usize, n_h: usize, n_kv: usize) -> bool {
    kernel_for(hd).is_some() && n_kv > 0 && n_h % n_kv == 0
}

/// Causal attention of `T` new queries `q: [T, n_h, hd]` (absolute positions `past..past + T`) against
/// `k, v: [n_kv, past + T, hd]`, on one CUDA device; returns `[T, n_h·hd]` f32. Query head `h` reads KV
/// head `h / (n_h / n_kv)`; `scale` multiplies the scores.
///
/// Inputs may be f32 (rounded to bf16 here, to nearest even) or already bf16: a KV cache kept in bf16
/// gives the same bits as an f32 one and saves the conversion of all `past + T` keys on every call.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let (t_len, n_h, hd) = q.dims3()?;
    let (n_kv, total, hd_k) = k.dims3()?;
    if v.dims() != k.dims() || hd_k != hd || total != past + t_len || n_kv == 0 || n_h % n_kv != 0 {
        bail!(
            "flash attention: q {:?}, k {:?}, v {:?} after {past} cached tokens do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    for (x, name) in [(q, "q"), (k, "k"), (v, "v")] {
        if x.dtype() != DType::F32 && x.dtype() != DType::BF16 {
            bail!(
                "flash attention: {name} is {:?}, expected f32 or bf16",
                x.dtype()
            );
        }
    }
    let Some((kernel, key_tile)) = kernel_for(hd).filter(|_| supports(hd, n_h, n_kv)) else {
        bail!("flash attention: no kernel for head dim {hd} with {n_h} query heads over {n_kv} KV heads");
    };
    if t_len == 0 {
        return Tensor::zeros((0, n_h * hd), DType::F32, q.device());
    }
    // Positions are i32 in the kernel (element offsets are size_t); position blocks are grid.y.
    i32_arg(total, "keys")?;
    if total.div_ceil(POSITIONS_PER_BLOCK) > 65_535 {
        bail!(
            "flash attention: {total} keys are more than the grid takes ({} positions)",
            65_535 * POSITIONS_PER_BLOCK
        );
    }

    // bf16 (copies of f32 inputs), read by the kernel with 16-byte cp.async.
    let qb = q.to_dtype(DType::BF16)?.contiguous()?;
    let kb = k.to_dtype(DType::BF16)?.contiguous()?;
    let vb = v.to_dtype(DType::BF16)?.contiguous()?;
    let (iq, ik, iv) = (
        Input::new(&qb, DType::BF16, "q (bf16)")?,
        Input::new(&kb, DType::BF16, "k (bf16)")?,
        Input::new(&vb, DType::BF16, "v (bf16)")?,
    );
    let out = alloc::<f32>(&dev, t_len * n_h * hd)?;

    // Blocks cover aligned runs of 64 absolute positions that meet past..past + T.
    let first_block = past / POSITIONS_PER_BLOCK;
    let n_blocks = (total - 1) / POSITIONS_PER_BLOCK + 1 - first_block;
    let smem = (POSITIONS_PER_BLOCK + 4 * key_tile) * (hd + ROW_PAD) * 2;
    let func = load_kernel(&dev, "prism_flash_attention", FLASH_IMAGE, kernel)?;
    func.allow_dynamic_shared(smem, "flash attention shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (n_h as u32, n_blocks as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (t_i, nh_i, nkv_i, past_i) = (
        i32_arg(t_len, "tokens")?,
        i32_arg(n_h, "heads")?,
        i32_arg(n_kv, "kv heads")?,
        i32_arg(past, "past")?,
    );
    let (first_i, blocks_i) = (
        i32_arg(first_block, "first block")?,
        i32_arg(n_blocks, "blocks")?,
    );
    // Scores go through 2^x: scale · log2 e, one f32 for every row and call.
    let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
    {
        let (vq, vk, vv) = (
            iq.view::<half::bf16>()?,
            ik.view::<half::bf16>()?,
            iv.view::<half::bf16>()?,
        );
        let mut b = func.builder();
        b.arg(&vq).arg(&vk).arg(&vv).arg(&out);
        b.arg(&t_i)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&past_i)
            .arg(&scale_log2)
            .arg(&first_i)
            .arg(&blocks_i);
        // SAFETY: argument types match the kernel's signature; q holds T·n_h·hd elements, k and v
        // n_kv·(past + T)·hd, out T·n_h·hd (checked above); the kernel reads keys below past + T only
        // and writes the rows of positions past..past + T only.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(wrap(out, &dev, (t_len, n_h * hd)))
}
