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

use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DeviceRepr, LaunchConfig};
use candle_core::{bail, DType, Result, Storage, StorageRef, Tensor};
use prism_quant::cuda_launch::PushArg;
use prism_quant::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};

use crate::attention::attention_dims;

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

/// Keys or values `[n_kv, total, hd]` in bf16 as the kernel reads them: KV head `g` starts `rows · hd`
/// elements after head `g − 1` (`rows ≥ total`), rows of `hd` contiguous. A bf16 tensor with that
/// layout (a cache with room to grow, [`crate::state::KvCache`]) is read in place; anything else is
/// converted to a contiguous bf16 copy first (`rows = total`).
struct HeadRows<'a> {
    guard: StorageRef<'a>,
    start: usize,
    len: usize,
    rows: usize,
    name: &'static str,
}

/// `t` in bf16 with head-strided rows, borrowing it when it already is, else a converted copy (kept in
/// `copy`).
fn head_rows<'a>(
    t: &'a Tensor,
    copy: &'a mut Option<Tensor>,
    name: &'static str,
) -> Result<HeadRows<'a>> {
    let (n_kv, total, hd) = t.dims3()?;
    let layout = t.layout();
    let stride = layout.stride();
    let in_place = t.dtype() == DType::BF16
        && hd % 8 == 0
        && stride[2] == 1
        && (stride[1] == hd || total <= 1)
        && (n_kv <= 1 || (stride[0] % hd == 0 && stride[0] / hd >= total))
        && layout.start_offset() % 8 == 0;
    let src: &'a Tensor = if in_place {
        t
    } else {
        copy.insert(t.to_dtype(DType::BF16)?.contiguous()?)
    };
    let layout = src.layout();
    let rows = if n_kv <= 1 {
        total
    } else {
        layout.stride()[0] / hd.max(1)
    };
    let (guard, _) = src.storage_and_layout();
    Ok(HeadRows {
        guard,
        start: layout.start_offset(),
        len: (n_kv.saturating_sub(1) * rows + total) * hd,
        rows,
        name,
    })
}

impl HeadRows<'_> {
    fn view(&self) -> Result<CudaView<'_, half::bf16>> {
        match &*self.guard {
            Storage::Cuda(cs) => {
                let slice = cs.as_cuda_slice::<half::bf16>()?;
                match slice.try_slice(self.start..self.start + self.len) {
                    Some(view) => Ok(view),
                    None => bail!(
                        "flash attention: {} elements {}..{} are outside its buffer",
                        self.name,
                        self.start,
                        self.start + self.len
                    ),
                }
            }
            _ => bail!("flash attention: {} is not on a CUDA device", self.name),
        }
    }
}

/// Causal attention of `T` new queries `q: [T, n_h, hd]` (absolute positions `past..past + T`) against
/// `k, v: [n_kv, past + T, hd]`, on one CUDA device; returns `[T, n_h·hd]` f32. Query head `h` reads KV
/// head `h / (n_h / n_kv)`; `scale` multiplies the scores.
///
/// Inputs may be f32 (rounded to bf16 here, to nearest even) or already bf16: a KV cache kept in bf16
/// gives the same bits as an f32 one and saves the conversion of all `past + T` keys on every call.
/// bf16 keys and values that are views of a cache with room to grow (rows of each head contiguous,
/// heads further apart) are read in place.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let Some((t_len, n_h, n_kv, hd)) = attention_dims(q.dims(), k.dims(), v.dims(), past) else {
        bail!(
            "flash attention: q {:?}, k {:?}, v {:?} after {past} cached tokens do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    };
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
    let iq = Input::new(&qb, DType::BF16, "q (bf16)")?;
    let (mut k_copy, mut v_copy) = (None, None);
    let ik = head_rows(k, &mut k_copy, "k")?;
    let iv = head_rows(v, &mut v_copy, "v")?;
    let kv_rows = i32_arg(ik.rows, "key rows")?;
    if ik.rows != iv.rows {
        // Both from one cache, or both copied: the kernel takes one head stride.
        bail!(
            "flash attention: keys and values with head strides of {} and {} rows",
            ik.rows,
            iv.rows
        );
    }
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
        let (vq, vk, vv) = (iq.view::<half::bf16>()?, ik.view()?, iv.view()?);
        let mut b = func.builder();
        b.arg(&vq).arg(&vk).arg(&vv).arg(&out);
        b.arg(&t_i)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&past_i)
            .arg(&scale_log2)
            .arg(&first_i)
            .arg(&blocks_i)
            .arg(&kv_rows);
        // SAFETY: argument types match the kernel's signature; q holds T·n_h·hd elements, k and v
        // (n_kv − 1)·rows·hd + (past + T)·hd (checked above), out T·n_h·hd; the kernel reads keys below
        // past + T of each head only and writes the rows of positions past..past + T only.
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
    let dims = attention_dims(q.dims(), k.dims(), v.dims(), past).filter(|&(t_len, _, n_kv, _)| {
        ks.dims() == [n_kv, past + t_len] && vs.dims() == [n_kv, past + t_len]
    });
    let Some((t_len, n_h, n_kv, hd)) = dims else {
        bail!(
            "flash attention (fp8): q {:?}, k {:?}, k scales {:?}, v {:?}, v scales {:?} after {past} cached tokens do not fit",
            q.dims(),
            k.dims(),
            ks.dims(),
            v.dims(),
            vs.dims()
        );
    };
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

/// Most segments of one batched launch (`FA_BATCH` in flash_attention.cu).
const FA_BATCH: usize = 64;

/// The segments of one [`flash_attention_batch`] launch: the C layout of `FlashBatch`. Shaped like
/// `SegmentArgs` (cuda_delta.rs) and `ConvDecodeArgs` (cuda.rs), but each mirrors its own kernel's struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct FlashBatch {
    k: [u64; FA_BATCH],
    v: [u64; FA_BATCH],
    row: [i32; FA_BATCH],
    t: [i32; FA_BATCH],
    past: [i32; FA_BATCH],
    first_block: [i32; FA_BATCH],
    n_blocks: [i32; FA_BATCH],
    kv_rows: [i32; FA_BATCH],
}

// SAFETY: plain integers in the layout of the kernel's `FlashBatch` (checked below).
unsafe impl DeviceRepr for FlashBatch {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for FlashBatch {}
const _: () = assert!(std::mem::size_of::<FlashBatch>() == FA_BATCH * (2 * 8 + 6 * 4));

/// The segments of one [`kv_append_batch`] launch: the C layout of `KvAppendBatch`. Like
/// [`FlashBatch`] (a pointer pair and ints per segment) but its own struct: each mirrors its kernel's
/// parameter, and a shared one would hand the append kernel fields it does not read.
#[repr(C)]
#[derive(Clone, Copy)]
struct KvAppendBatch {
    k: [u64; FA_BATCH],
    v: [u64; FA_BATCH],
    row: [i32; FA_BATCH],
    t: [i32; FA_BATCH],
    at: [i32; FA_BATCH],
    kv_rows: [i32; FA_BATCH],
}

// SAFETY: plain integers in the layout of the kernel's `KvAppendBatch` (checked below).
unsafe impl DeviceRepr for KvAppendBatch {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for KvAppendBatch {}
const _: () = assert!(std::mem::size_of::<KvAppendBatch>() == FA_BATCH * (2 * 8 + 4 * 4));

/// One sequence's part of [`flash_attention_batch`]: its query rows `row..row + len` of the packed
/// `q`, at absolute positions `past..past + len`, against its own `k, v: [n_kv, past + len, hd]`.
pub struct FlashSegment<'a> {
    pub row: usize,
    pub len: usize,
    pub past: usize,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
}

/// [`flash_attention`] of several sequences in one launch per 64: `q: [N, n_h, hd]` packs every
/// segment's query rows, the segments tile `0..N` in order; returns `[N, n_h·hd]` f32. Each segment's
/// rows are bit for bit what [`flash_attention`] gives that segment alone (the kernel runs the same
/// device function with the same arguments for it).
pub fn flash_attention_batch(
    q: &Tensor,
    segments: &[FlashSegment<'_>],
    scale: f64,
) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let (n, n_h, hd) = q.dims3()?;
    let mut next = 0;
    let mut n_kv = 0;
    for (i, s) in segments.iter().enumerate() {
        let (kv, total, hd_k) = s.k.dims3()?;
        if s.row != next || s.v.dims() != s.k.dims() || hd_k != hd || total != s.past + s.len {
            bail!(
                "flash attention (batch): segment {i} (rows {}..{}, past {}) with k {:?}, v {:?} does not fit",
                s.row,
                s.row + s.len,
                s.past,
                s.k.dims(),
                s.v.dims()
            );
        }
        if i > 0 && kv != n_kv {
            bail!("flash attention (batch): segments with {n_kv} and {kv} KV heads");
        }
        n_kv = kv;
        next += s.len;
    }
    if next != n {
        bail!("flash attention (batch): the segments cover {next} of {n} query rows");
    }
    let Some((_, key_tile)) = kernel_for(hd).filter(|_| supports(hd, n_h, n_kv)) else {
        bail!("flash attention (batch): no kernel for head dim {hd} with {n_h} query heads over {n_kv} KV heads");
    };
    let kernel = match hd {
        256 => "flash_attention_batch_hd256",
        128 => "flash_attention_batch_hd128",
        _ => "flash_attention_batch_hd64",
    };
    let out = alloc::<f32>(&dev, n * n_h * hd)?;
    if n == 0 {
        return Ok(wrap(out, &dev, (0, n_h * hd)));
    }
    let qb = q.to_dtype(DType::BF16)?.contiguous()?;
    let iq = Input::new(&qb, DType::BF16, "q (bf16)")?;
    let vq = iq.view::<half::bf16>()?;
    let smem = (POSITIONS_PER_BLOCK + 4 * key_tile) * (hd + ROW_PAD) * 2;
    let func = load_kernel(&dev, "prism_flash_attention", FLASH_IMAGE, kernel)?;
    func.allow_dynamic_shared(smem, "flash attention shared memory")?;
    let stream = dev.cuda_stream();
    let (nh_i, nkv_i) = (i32_arg(n_h, "heads")?, i32_arg(n_kv, "kv heads")?);
    let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
    for chunk in segments.chunks(FA_BATCH) {
        let live: Vec<&FlashSegment<'_>> = chunk.iter().filter(|s| s.len > 0).collect();
        if live.is_empty() {
            continue;
        }
        let mut copies: Vec<(Option<Tensor>, Option<Tensor>)> =
            live.iter().map(|_| (None, None)).collect();
        let mut inputs = Vec::with_capacity(live.len());
        for (s, (kc, vc)) in live.iter().zip(copies.iter_mut()) {
            let ik = head_rows(s.k, kc, "k")?;
            let iv = head_rows(s.v, vc, "v")?;
            if ik.rows != iv.rows {
                bail!(
                    "flash attention (batch): keys and values with head strides of {} and {} rows",
                    ik.rows,
                    iv.rows
                );
            }
            inputs.push((ik, iv));
        }
        let views = inputs
            .iter()
            .map(|(k, v)| Ok((k.view()?, v.view()?)))
            .collect::<Result<Vec<_>>>()?;
        let mut args = FlashBatch {
            k: [0; FA_BATCH],
            v: [0; FA_BATCH],
            row: [0; FA_BATCH],
            t: [0; FA_BATCH],
            past: [0; FA_BATCH],
            first_block: [0; FA_BATCH],
            n_blocks: [0; FA_BATCH],
            kv_rows: [0; FA_BATCH],
        };
        let mut guards = Vec::with_capacity(2 * live.len());
        let mut most_blocks = 0;
        for (j, (s, ((vk, vv), (ik, _)))) in live.iter().zip(views.iter().zip(&inputs)).enumerate()
        {
            let geo = geometry((s.len, n_h, n_kv), s.past, scale)?;
            let (pk, gk) = vk.device_ptr(&stream);
            let (pv, gv) = vv.device_ptr(&stream);
            guards.push(gk);
            guards.push(gv);
            args.k[j] = pk;
            args.v[j] = pv;
            args.row[j] = i32_arg(s.row, "row")?;
            args.t[j] = geo.ints[0];
            args.past[j] = geo.ints[3];
            args.first_block[j] = geo.ints[4];
            args.n_blocks[j] = geo.ints[5];
            args.kv_rows[j] = i32_arg(ik.rows, "key rows")?;
            most_blocks = most_blocks.max(geo.cfg_grid.1);
        }
        let cfg = LaunchConfig {
            grid_dim: (n_h as u32, most_blocks, live.len() as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut b = func.builder();
        b.arg(&vq).arg(&args).arg(&out);
        b.arg(&nh_i).arg(&nkv_i).arg(&scale_log2);
        // SAFETY: every segment's q and out rows lie inside the packed [N, n_h, hd] q and out (the
        // segments tile 0..N, checked above); each key/value pointer is a live view (guards held) of
        // (n_kv − 1)·rows·hd + (past + T)·hd bf16; the kernel reads keys below past + T of each head and
        // writes its segment's rows only.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        drop(guards);
    }
    Ok(wrap(out, &dev, (n, n_h * hd)))
}

/// One sequence's part of [`kv_append_batch`]: rows `row..row + len` of the packed new keys and values
/// go to positions `at..at + len` of its cache `k, v: [n_kv, rows, hd]` (bf16, contiguous, `at + len ≤
/// rows`).
pub struct KvAppend<'a> {
    pub row: usize,
    pub len: usize,
    pub at: usize,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
}

/// Writes every segment's new keys and values (`k_new, v_new: [N, n_kv, hd]` bf16) into its cache in
/// place, one launch per 64 segments: plain copies, the bits of the new rows. The caller owns the
/// positions written (no other state reads them: [`crate::state::KvCache`]'s claims).
pub fn kv_append_batch(k_new: &Tensor, v_new: &Tensor, appends: &[KvAppend<'_>]) -> Result<()> {
    let dev = cuda_device(k_new)?;
    let (n, n_kv, hd) = k_new.dims3()?;
    if v_new.dims() != k_new.dims() || hd % 8 != 0 {
        bail!(
            "kv append: keys {:?} and values {:?} do not fit",
            k_new.dims(),
            v_new.dims()
        );
    }
    let aligned = |t: &Tensor| -> Result<Tensor> {
        let t = t.contiguous()?;
        if t.layout().start_offset() % 8 == 0 {
            Ok(t)
        } else {
            t.copy()
        }
    };
    let (kn, vn) = (aligned(k_new)?, aligned(v_new)?);
    let (ikn, ivn) = (
        Input::new(&kn, DType::BF16, "new keys")?,
        Input::new(&vn, DType::BF16, "new values")?,
    );
    let (vkn, vvn) = (ikn.view::<half::bf16>()?, ivn.view::<half::bf16>()?);
    for (i, a) in appends.iter().enumerate() {
        let (kv, rows, hd_c) = a.k.dims3()?;
        if a.v.dims() != a.k.dims()
            || kv != n_kv
            || hd_c != hd
            || a.at + a.len > rows
            || a.row + a.len > n
            || a.k.dtype() != DType::BF16
            || a.v.dtype() != DType::BF16
            || !a.k.is_contiguous()
            || !a.v.is_contiguous()
            || a.k.layout().start_offset() % 8 != 0
            || a.v.layout().start_offset() % 8 != 0
        {
            bail!(
                "kv append: segment {i} (rows {}..{} to {}..) into caches {:?} {:?} / {:?} {:?} does not fit",
                a.row,
                a.row + a.len,
                a.at,
                a.k.dims(),
                a.k.dtype(),
                a.v.dims(),
                a.v.dtype()
            );
        }
    }
    let func = load_kernel(
        &dev,
        "prism_flash_attention",
        FLASH_IMAGE,
        "kv_append_batch_bf16",
    )?;
    let stream = dev.cuda_stream();
    let (nkv_i, hd_i) = (i32_arg(n_kv, "kv heads")?, i32_arg(hd, "head dim")?);
    for chunk in appends.chunks(FA_BATCH) {
        let live: Vec<&KvAppend<'_>> = chunk.iter().filter(|a| a.len > 0).collect();
        if live.is_empty() {
            continue;
        }
        let inputs = live
            .iter()
            .map(|a| {
                Ok((
                    Input::new(a.k, DType::BF16, "key cache")?,
                    Input::new(a.v, DType::BF16, "value cache")?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let views = inputs
            .iter()
            .map(|(k, v)| Ok((k.view::<half::bf16>()?, v.view::<half::bf16>()?)))
            .collect::<Result<Vec<_>>>()?;
        let mut args = KvAppendBatch {
            k: [0; FA_BATCH],
            v: [0; FA_BATCH],
            row: [0; FA_BATCH],
            t: [0; FA_BATCH],
            at: [0; FA_BATCH],
            kv_rows: [0; FA_BATCH],
        };
        let mut guards = Vec::with_capacity(2 * live.len());
        let mut most = 0;
        // Filled as `flash_attention_batch` fills its `FlashBatch`: two structs, one per kernel (see
        // `KvAppendBatch`), so the fills stay two as well.
        for (j, (a, (vk, vv))) in live.iter().zip(&views).enumerate() {
            let (pk, gk) = vk.device_ptr(&stream);
            let (pv, gv) = vv.device_ptr(&stream);
            guards.push(gk);
            guards.push(gv);
            args.k[j] = pk;
            args.v[j] = pv;
            args.row[j] = i32_arg(a.row, "row")?;
            args.t[j] = i32_arg(a.len, "rows")?;
            args.at[j] = i32_arg(a.at, "position")?;
            args.kv_rows[j] = i32_arg(a.k.dim(1)?, "cache rows")?;
            most = most.max(a.len);
        }
        let cfg = LaunchConfig {
            grid_dim: (n_kv as u32, most.min(65_535) as u32, live.len() as u32),
            block_dim: (((hd / 8) as u32).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&vkn).arg(&vvn).arg(&args).arg(&nkv_i).arg(&hd_i);
        // SAFETY: every source row is below N (checked), every destination position below the cache's
        // rows (at + len ≤ rows, checked); the pointers are live contiguous bf16 caches (guards held).
        // The kernel writes device memory that the caller's claim reserves for these rows (no reader of
        // those positions exists), through pointers taken from shared borrows: the tensors' host-side
        // values are not touched.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        drop(guards);
    }
    Ok(())
}
