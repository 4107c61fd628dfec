//! Causal attention on the tensor cores (`kernels/flash_attention.cu`): bf16 `mma.sync` for QKᵀ and
//! P·V, f32 online softmax, key tiles aligned to absolute positions. Same interface as
//! [`crate::cuda::causal_attention`] and the same CPU twin ([`crate::attention::CausalAttention`]), at
//! bf16 accuracy (q, k, v and the probabilities are rounded to bf16; everything else is f32).
//!
//! Batch-invariant: a query row's output bits depend only on its q, its absolute position and keys /
//! values `0..=pos` — not on `T`, `past`, the grid or the other rows (the argument is in the kernel's
//! header comment). Mixing this kernel with another one for some `T` would lose that across calls, so
//! callers pick it by head dim alone ([`supports`]).
//!
//! [`flash_attention_fp8`] is the same kernel on an fp8 K/V cache ([`crate::kv_fp8`]): it stages the
//! e4m3 bytes and scales and dequantizes each tile in shared memory to the bf16 that
//! [`crate::cuda_kv_fp8::dequantize`] writes, so its output is bit for bit [`flash_attention`] on the
//! dequantized bf16 cache (checked by `prism cuda-check`), with half the cache traffic.

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

/// The fp8 kernel for head dim `hd` (the same key tiles as [`kernel_for`]'s).
fn fp8_kernel_for(hd: usize) -> Option<&'static str> {
    match hd {
        256 => Some("flash_attention_fp8_hd256"),
        128 => Some("flash_attention_fp8_hd128"),
        64 => Some("flash_attention_fp8_hd64"),
        _ => None,
    }
}

/// The launch geometry of one call (both kernels): grid, block and the kernel's int arguments.
struct Geometry {
    cfg_grid: (u32, u32, u32),
    /// `T, n_h, n_kv, past, first_block, n_blocks` as the kernel's ints.
    ints: [i32; 6],
    /// `scale · log2 e`.
    scale_log2: f32,
}

fn geometry(
    (t_len, n_h, n_kv): (usize, usize, usize),
    past: usize,
    scale: f64,
) -> Result<Geometry> {
    let total = past + t_len;
    // Positions are i32 in the kernel (element offsets are size_t); position blocks are grid.y.
    i32_arg(total, "keys")?;
    if total.div_ceil(POSITIONS_PER_BLOCK) > 65_535 {
        bail!(
            "flash attention: {total} keys are more than the grid takes ({} positions)",
            65_535 * POSITIONS_PER_BLOCK
        );
    }
    // Blocks cover aligned runs of 64 absolute positions that meet past..past + T.
    let first_block = past / POSITIONS_PER_BLOCK;
    let n_blocks = (total - 1) / POSITIONS_PER_BLOCK + 1 - first_block;
    Ok(Geometry {
        cfg_grid: (n_h as u32, n_blocks as u32, 1),
        ints: [
            i32_arg(t_len, "tokens")?,
            i32_arg(n_h, "heads")?,
            i32_arg(n_kv, "kv heads")?,
            i32_arg(past, "past")?,
            i32_arg(first_block, "first block")?,
            i32_arg(n_blocks, "blocks")?,
        ],
        // Scores go through 2^x: scale · log2 e, one f32 for every row and call.
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
    })
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
    let geo = geometry((t_len, n_h, n_kv), past, scale)?;

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

    let smem = (POSITIONS_PER_BLOCK + 4 * key_tile) * (hd + ROW_PAD) * 2;
    let func = load_kernel(&dev, "prism_flash_attention", FLASH_IMAGE, kernel)?;
    func.allow_dynamic_shared(smem, "flash attention shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: geo.cfg_grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let [t_i, nh_i, nkv_i, past_i, first_i, blocks_i] = geo.ints;
    let scale_log2 = geo.scale_log2;
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

/// [`flash_attention`] on an fp8 cache: `q: [T, n_h, hd]` (f32 or bf16), `kv = [k, k_scale, v,
/// v_scale]` with `k, v: [n_kv, past + T, hd]` e4m3 bytes (`U8`) and `k_scale, v_scale: [n_kv, past +
/// T]` (`F32`, [`crate::kv_fp8`]); returns `[T, n_h·hd]` f32, bit for bit [`flash_attention`] on
/// `k, v` dequantized to bf16 ([`crate::cuda_kv_fp8::dequantize`]).
pub fn flash_attention_fp8(
    q: &Tensor,
    kv: [&Tensor; 4],
    past: usize,
    scale: f64,
) -> Result<Tensor> {
    let [k, ks, v, vs] = kv;
    let dev = cuda_device(q)?;
    let (t_len, n_h, hd) = q.dims3()?;
    let (n_kv, total, hd_k) = k.dims3()?;
    if v.dims() != k.dims()
        || ks.dims() != [n_kv, total]
        || vs.dims() != [n_kv, total]
        || hd_k != hd
        || total != past + t_len
        || n_kv == 0
        || n_h % n_kv != 0
    {
        bail!(
            "flash attention (fp8): q {:?}, k {:?}, k scales {:?}, v {:?}, v scales {:?} after {past} cached tokens do not fit",
            q.dims(),
            k.dims(),
            ks.dims(),
            v.dims(),
            vs.dims()
        );
    }
    if k.dtype() != DType::U8 || v.dtype() != DType::U8 {
        bail!(
            "flash attention (fp8): keys {:?} and values {:?}, expected u8 (e4m3 bytes)",
            k.dtype(),
            v.dtype()
        );
    }
    if ks.dtype() != DType::F32 || vs.dtype() != DType::F32 {
        bail!("flash attention (fp8): scales must be f32");
    }
    let (Some(kernel), Some((_, key_tile))) = (fp8_kernel_for(hd), kernel_for(hd)) else {
        bail!("flash attention (fp8): no kernel for head dim {hd}");
    };
    if t_len == 0 {
        return Tensor::zeros((0, n_h * hd), DType::F32, q.device());
    }
    let geo = geometry((t_len, n_h, n_kv), past, scale)?;
    let qb = q.to_dtype(DType::BF16)?.contiguous()?;
    // The kernel reads the bytes with 16-byte cp.async: rows of hd (a multiple of 16) bytes from a
    // 16-byte-aligned start (a view at another offset is copied).
    let aligned = |t: &Tensor| -> Result<Tensor> {
        let t = t.contiguous()?;
        if t.layout().start_offset() % 16 == 0 {
            Ok(t)
        } else {
            t.copy()
        }
    };
    let (kb, vb) = (aligned(k)?, aligned(v)?);
    let (ksc, vsc) = (ks.contiguous()?, vs.contiguous()?);
    let iq = Input::new(&qb, DType::BF16, "q (bf16)")?;
    let (ik, iv) = (
        Input::new(&kb, DType::U8, "k (e4m3)")?,
        Input::new(&vb, DType::U8, "v (e4m3)")?,
    );
    let (iks, ivs) = (
        Input::new(&ksc, DType::F32, "k scales")?,
        Input::new(&vsc, DType::F32, "v scales")?,
    );
    let out = alloc::<f32>(&dev, t_len * n_h * hd)?;
    let smem = (POSITIONS_PER_BLOCK + 2 * key_tile) * (hd + ROW_PAD) * 2
        + 4 * key_tile * hd
        + 16 * key_tile;
    let func = load_kernel(&dev, "prism_flash_attention", FLASH_IMAGE, kernel)?;
    func.allow_dynamic_shared(smem, "flash attention (fp8) shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: geo.cfg_grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let [t_i, nh_i, nkv_i, past_i, first_i, blocks_i] = geo.ints;
    {
        let vq = iq.view::<half::bf16>()?;
        let (vk, vv) = (ik.view::<u8>()?, iv.view::<u8>()?);
        let (vks, vvs) = (iks.view::<f32>()?, ivs.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vq).arg(&vk).arg(&vks).arg(&vv).arg(&vvs).arg(&out);
        b.arg(&t_i)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&past_i)
            .arg(&geo.scale_log2)
            .arg(&first_i)
            .arg(&blocks_i);
        // SAFETY: argument types match the kernel's signature; q holds T·n_h·hd bf16, k and v
        // n_kv·(past + T)·hd bytes from 16-byte-aligned starts, the scales n_kv·(past + T) floats, out
        // T·n_h·hd floats (checked above); the kernel reads keys below past + T only and writes the rows
        // of positions past..past + T only.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(wrap(out, &dev, (t_len, n_h * hd)))
}
