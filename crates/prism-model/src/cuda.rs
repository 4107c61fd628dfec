//! Launchers for our CUDA kernels (`kernels/*.cu`, compiled to fatbins by build.rs), on candle tensors.
//!
//! Each function here has a CPU twin that the CI tests (named in its doc); `prism cuda-check` runs
//! both on fresh random inputs on the device and reports ‖Δ‖/‖ref‖. All kernels take contiguous f32
//! tensors (the activation dtype of the bf16 path) and return new tensors.

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::cublas::{result as cublas, sys as cublas_sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};
use prism_quant::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};

use crate::delta_rule::{RuleState, CHUNK};

const DELTA_RULE_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/delta_rule.fatbin"));
const OPS_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ops.fatbin"));

/// Value columns per delta-rule block (`CW` in delta_rule.cu).
const DELTA_RULE_COLUMNS: usize = 32;
const DELTA_RULE_THREADS: u32 = 256;
/// Chunks per launch of the delta-rule kernels: bounds the pair-scalar scratch (32 KiB per head and
/// chunk) for long prompts. Launch boundaries fall on chunk boundaries, and the state carries across
/// them exactly as across calls, so the split changes no bits.
const DELTA_RULE_CHUNKS_PER_LAUNCH: usize = 32;

/// The CUDA twin of [`crate::delta_rule::chunked`]: same inputs, same state layout, same chunk
/// boundaries. f32 only.
///
/// Runs in launches of up to [`DELTA_RULE_CHUNKS_PER_LAUNCH`] chunks, each two kernels: the pair
/// scalars of all its chunks in parallel (`delta_rule_pairs_f32`), then the chunks in order
/// (`delta_rule_chunked_f32`); see delta_rule.cu.
pub fn delta_rule_chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &RuleState,
) -> Result<(Tensor, RuleState)> {
    let (t_len, heads, dk, dv) = crate::delta_rule::check_inputs(q, k, v, g, beta, state)?;
    if dv % DELTA_RULE_COLUMNS != 0 || dk % 4 != 0 || dk > 256 {
        bail!(
            "delta rule (cuda): dv = {dv} must be a multiple of {DELTA_RULE_COLUMNS}, dk = {dk} a multiple of 4 up to 256"
        );
    }
    let dev = cuda_device(q)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (g, beta) = (g.contiguous()?, beta.contiguous()?);
    let iq = Input::new(&q, DType::F32, "q")?;
    let ik = Input::new(&k, DType::F32, "k")?;
    let iv = Input::new(&v, DType::F32, "v")?;
    let ig = Input::new(&g, DType::F32, "g")?;
    let ib = Input::new(&beta, DType::F32, "beta")?;
    let tokens = TokenInputs {
        q: iq.view::<f32>()?,
        k: ik.view::<f32>()?,
        v: iv.view::<f32>()?,
        g: ig.view::<f32>()?,
        beta: ib.view::<f32>()?,
        heads: i32_arg(heads, "heads")?,
        dk,
        dv,
    };
    let out = alloc::<f32>(&dev, t_len * heads * dv)?;
    let mut state = state.clone();
    let mut t0 = 0;
    while t0 < t_len {
        let room = DELTA_RULE_CHUNKS_PER_LAUNCH * CHUNK - state.pending;
        let n = room.min(t_len - t0);
        state = delta_rule_launch(&dev, &tokens, &out, t0, n, &state)?;
        t0 += n;
    }
    Ok((wrap(out, &dev, (t_len, heads, dv)), state))
}

/// The token inputs of one delta-rule call, as device views.
struct TokenInputs<'a> {
    q: CudaView<'a, f32>,
    k: CudaView<'a, f32>,
    v: CudaView<'a, f32>,
    g: CudaView<'a, f32>,
    beta: CudaView<'a, f32>,
    heads: i32,
    dk: usize,
    dv: usize,
}

/// Sets a kernel's dynamic shared memory limit to what this launch needs.
fn allow_shared(func: &candle_core::cuda_backend::cudarc::driver::CudaFunction, bytes: usize, what: &str) -> Result<()> {
    func.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        i32_arg(bytes, what)?,
    )
    .map_err(launch_err)
}

/// Tokens `t0..t0 + n` of a call (whole chunks, except possibly the last) from `state`: writes their
/// outputs into `out` and returns the state after them.
fn delta_rule_launch(
    dev: &CudaDevice,
    x: &TokenInputs<'_>,
    out: &CudaSlice<f32>,
    t0: usize,
    n: usize,
    state: &RuleState,
) -> Result<RuleState> {
    let (heads, dk, dv) = (x.heads as usize, x.dk, x.dv);
    let chunks = (state.pending + n).div_ceil(CHUNK);
    let s_in = state.chunk_start.contiguous()?;
    let pk_in = state.pending_k.contiguous()?;
    let pu_in = state.pending_u.contiguous()?;
    let gam_in = state.pending_gamma.contiguous()?;
    let is = Input::new(&s_in, DType::F32, "memory")?;
    let ipk = Input::new(&pk_in, DType::F32, "pending keys")?;
    let ipu = Input::new(&pu_in, DType::F32, "pending values")?;
    let igam = Input::new(&gam_in, DType::F64, "pending decays")?;
    let (vs, vpk, vpu) = (is.view::<f32>()?, ipk.view::<f32>()?, ipu.view::<f32>()?);
    let vgam = igam.view::<f64>()?;

    // Scratch of the pair kernel: At/Bt [H, chunks, 2, 64, 64] and Γ [H, chunks, 64], all written.
    let ab = alloc::<f32>(dev, heads * chunks * 2 * CHUNK * CHUNK)?;
    let gam_s = alloc::<f64>(dev, heads * chunks * CHUNK)?;
    let s_out = alloc::<f32>(dev, heads * dk * dv)?;
    let pk_out = alloc::<f32>(dev, heads * CHUNK * dk)?;
    let pu_out = alloc::<f32>(dev, heads * CHUNK * dv)?;
    let gam_out = alloc::<f64>(dev, heads * CHUNK)?;

    // Shared memory, as laid out at the top of each kernel (XS = CHUNK + 4, US = CW + 4).
    let (xs, us, cw) = (CHUNK + 4, DELTA_RULE_COLUMNS + 4, DELTA_RULE_COLUMNS);
    let pairs_smem = CHUNK * 8 + CHUNK * 4 + 2 * dk * xs * 4;
    let main_smem =
        CHUNK * 8 + 3 * CHUNK * 4 + (dk * cw + 2 * CHUNK * us + dk * xs + (dk * xs).max(2 * CHUNK * CHUNK)) * 4;
    let (t0_i, n_i, dk_i, dv_i, p_i, ch_i) = (
        i32_arg(t0, "token offset")?,
        i32_arg(n, "tokens")?,
        i32_arg(dk, "dk")?,
        i32_arg(dv, "dv")?,
        i32_arg(state.pending, "pending")?,
        i32_arg(chunks, "chunks")?,
    );

    let pairs = load_kernel(dev, "prism_delta_rule", DELTA_RULE_IMAGE, "delta_rule_pairs_f32")?;
    allow_shared(&pairs, pairs_smem, "delta rule pair shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, chunks as u32, 1),
        block_dim: (DELTA_RULE_THREADS, 1, 1),
        shared_mem_bytes: pairs_smem as u32,
    };
    {
        let mut b = pairs.builder();
        b.arg(&x.q).arg(&x.k).arg(&x.g).arg(&x.beta).arg(&vpk).arg(&vgam);
        b.arg(&ab).arg(&gam_s);
        b.arg(&t0_i).arg(&n_i).arg(&x.heads).arg(&dk_i).arg(&p_i);
        // SAFETY: argument types and buffer sizes match the kernel's signature (checked by the caller
        // and above); the kernel reads tokens t0..t0 + n only.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }

    let main = load_kernel(dev, "prism_delta_rule", DELTA_RULE_IMAGE, "delta_rule_chunked_f32")?;
    allow_shared(&main, main_smem, "delta rule shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, (dv / cw) as u32, 1),
        block_dim: (DELTA_RULE_THREADS, 1, 1),
        shared_mem_bytes: main_smem as u32,
    };
    {
        let mut b = main.builder();
        b.arg(&x.q).arg(&x.k).arg(&x.v).arg(&x.beta).arg(&ab).arg(&gam_s);
        b.arg(&vs).arg(&vpk).arg(&vpu);
        b.arg(out).arg(&s_out).arg(&pk_out).arg(&pu_out).arg(&gam_out);
        b.arg(&t0_i).arg(&n_i).arg(&x.heads).arg(&dk_i).arg(&dv_i).arg(&p_i).arg(&ch_i);
        // SAFETY: as above; `out` holds all tokens of the call and this launch writes t0..t0 + n.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(RuleState {
        chunk_start: wrap(s_out, dev, (heads, dk, dv)),
        pending_k: wrap(pk_out, dev, (heads, CHUNK, dk)),
        pending_u: wrap(pu_out, dev, (heads, CHUNK, dv)),
        pending_gamma: wrap(gam_out, dev, (heads, CHUNK)),
        pending: (state.pending + n) % CHUNK,
    })
}

/// Which normalisation [`norm_rows`] applies (`mode` in ops.cu).
#[derive(Debug, Clone, Copy)]
enum NormMode {
    Rms = 0,
    GatedRms = 1,
    L2 = 2,
}

fn norm_rows(x: &Tensor, weight: Option<&Tensor>, gate: Option<&Tensor>, eps: f64, mode: NormMode) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let x = x.contiguous()?;
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    let ix = Input::new(&x, DType::F32, "x")?;
    // Unused pointers still need a valid buffer: pass x.
    let w = match weight {
        Some(w) => {
            if w.dims() != [d] {
                bail!("norm weight {:?} does not fit rows of {d}", w.dims());
            }
            w.contiguous()?
        }
        None => x.clone(),
    };
    let gate = match gate {
        Some(g) => {
            if g.dims() != x.dims() {
                bail!("norm gate {:?} does not fit x {:?}", g.dims(), x.dims());
            }
            g.contiguous()?
        }
        None => x.clone(),
    };
    let iw = Input::new(&w, DType::F32, "norm weight")?;
    let ig = Input::new(&gate, DType::F32, "gate")?;
    let y = alloc::<f32>(&dev, x.elem_count())?;
    let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "norm_rows_f32")?;
    let rows_per_block = 4u32;
    let cfg = LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(rows_per_block), 1, 1),
        block_dim: (32 * rows_per_block, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, d_i, eps_f, mode_i) = (i32_arg(rows, "rows")?, i32_arg(d, "row length")?, eps as f32, mode as i32);
    {
        let (vx, vw, vg) = (ix.view::<f32>()?, iw.view::<f32>()?, ig.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vx).arg(&vw).arg(&vg).arg(&y).arg(&rows_i).arg(&d_i).arg(&eps_f).arg(&mode_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(wrap(y, &dev, x.shape().clone()))
}

/// CUDA twin of [`crate::ops::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    norm_rows(x, Some(weight), None, eps, NormMode::Rms)
}

/// CUDA twin of [`crate::ops::gated_rms_norm`].
pub fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    norm_rows(x, Some(weight), Some(gate), eps, NormMode::GatedRms)
}

/// CUDA twin of [`crate::ops::l2_norm`].
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    norm_rows(x, None, None, eps, NormMode::L2)
}

/// CUDA twin of [`crate::delta_net::causal_conv`] (bitwise equal: same products and sums in order).
pub fn causal_conv(x: &Tensor, window: &Tensor, taps: &Tensor) -> Result<(Tensor, Tensor)> {
    let dev = cuda_device(x)?;
    let (t_len, c) = x.dims2()?;
    let (k, c_taps) = taps.dims2()?;
    if c_taps != c || window.dims() != [k.saturating_sub(1), c] || k < 2 {
        bail!("causal conv: x {:?}, window {:?}, taps {:?} do not fit", x.dims(), window.dims(), taps.dims());
    }
    let (x, window, taps) = (x.contiguous()?, window.contiguous()?, taps.contiguous()?);
    let (ix, iw, it) = (
        Input::new(&x, DType::F32, "x")?,
        Input::new(&window, DType::F32, "conv window")?,
        Input::new(&taps, DType::F32, "conv taps")?,
    );
    let out = alloc::<f32>(&dev, t_len * c)?;
    let new_window = alloc::<f32>(&dev, (k - 1) * c)?;
    let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "causal_conv_f32")?;
    let total = (t_len + k - 1) * c;
    let cfg = LaunchConfig::for_num_elems(total as u32);
    let (t_i, c_i, k_i) = (i32_arg(t_len, "tokens")?, i32_arg(c, "channels")?, i32_arg(k, "taps")?);
    {
        let (vx, vw, vt) = (ix.view::<f32>()?, iw.view::<f32>()?, it.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vx).arg(&vw).arg(&vt).arg(&out).arg(&new_window).arg(&t_i).arg(&c_i).arg(&k_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok((wrap(out, &dev, (t_len, c)), wrap(new_window, &dev, (k - 1, c))))
}

/// Warps per block of the attention kernel (rows × heads of one KV group; see ops.cu).
const ATTENTION_WARPS: usize = 12;
/// Keys per shared-memory tile of the attention kernel (`ATT_KEYS` in ops.cu).
const ATTENTION_KEYS: usize = 32;

/// CUDA twin of [`crate::attention::CausalAttention`]: `q: [T, n_h, hd]`, `k, v: [n_kv, past + T, hd]`,
/// returns `[T, n_h·hd]`.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f64) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let (t_len, n_h, hd) = q.dims3()?;
    let (n_kv, total, hd_k) = k.dims3()?;
    if v.dims() != k.dims() || hd_k != hd || total != past + t_len || n_kv == 0 || n_h % n_kv != 0 || hd % 32 != 0 || hd > 256 {
        bail!("causal attention (cuda): q {:?}, k {:?}, v {:?} after {past} cached tokens do not fit", q.dims(), k.dims(), v.dims());
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (iq, ik, iv) = (Input::new(&q, DType::F32, "q")?, Input::new(&k, DType::F32, "k")?, Input::new(&v, DType::F32, "v")?);
    let out = alloc::<f32>(&dev, t_len * n_h * hd)?;
    let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "causal_attention_f32")?;
    // One warp per (row, head); a block takes `rows` query rows × `heads` query heads of one KV group
    // (about 12 warps: 56 registers a thread leave room for three blocks an SM) and shares its key
    // tiles among them.
    let group = n_h / n_kv;
    let heads = (1..=group.min(ATTENTION_WARPS)).rev().find(|d| group % d == 0).unwrap_or(1);
    let rows = (ATTENTION_WARPS / heads).max(1).min(t_len.max(1));
    let smem = 2 * ATTENTION_KEYS * hd * 4;
    allow_shared(&func, smem, "attention shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (t_len.div_ceil(rows) as u32, (n_kv * (group / heads)) as u32, 1),
        block_dim: (32 * (rows * heads) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (t_i, nh_i, nkv_i, hd_i, past_i) = (
        i32_arg(t_len, "tokens")?,
        i32_arg(n_h, "heads")?,
        i32_arg(n_kv, "kv heads")?,
        i32_arg(hd, "head dim")?,
        i32_arg(past, "past")?,
    );
    let (rows_i, heads_i) = (i32_arg(rows, "rows per block")?, i32_arg(heads, "heads per block")?);
    let scale_f = scale as f32;
    {
        let (vq, vk, vv) = (iq.view::<f32>()?, ik.view::<f32>()?, iv.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vq).arg(&vk).arg(&vv).arg(&out).arg(&t_i).arg(&nh_i).arg(&nkv_i).arg(&hd_i).arg(&past_i).arg(&scale_f);
        b.arg(&rows_i).arg(&heads_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(wrap(out, &dev, (t_len, n_h * hd)))
}

/// `y = x · Wᵀ` with bf16 operands and an **f32 result**: `x: [N, in]` (f32, rounded to bf16 here),
/// `w: [out, in]` bf16; returns `[N, out]` f32. cuBLAS accumulates in f32 (`CUBLAS_COMPUTE_32F`), and
/// the output is not rounded to bf16 — the CPU bf16 path ([`crate::ops::linear`]) does the same.
pub fn linear_bf16(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let (n, k) = x.dims2()?;
    let (out, k_w) = w.dims2()?;
    if k != k_w || w.dtype() != DType::BF16 || x.dtype() != DType::F32 {
        bail!("linear (cuda): x {:?} {:?} and weight {:?} {:?} do not fit", x.dims(), x.dtype(), w.dims(), w.dtype());
    }
    let xb = x.to_dtype(DType::BF16)?.contiguous()?;
    let w = w.contiguous()?;
    let ix = Input::new(&xb, DType::BF16, "x")?;
    let iw = Input::new(&w, DType::BF16, "weight")?;
    let mut y = alloc::<f32>(&dev, n * out)?;
    let (m_i, n_i, k_i) = (i32_arg(out, "out features")?, i32_arg(n, "rows")?, i32_arg(k, "in features")?);
    {
        let stream = dev.cuda_stream();
        let vx = ix.view::<half::bf16>()?;
        let vw = iw.view::<half::bf16>()?;
        let (px, _gx) = vx.device_ptr(&stream);
        let (pw, _gw) = vw.device_ptr(&stream);
        let (py, _gy) = y.device_ptr_mut(&stream);
        let (alpha, beta) = (1f32, 0f32);
        let blas = dev.cublas_handle();
        // Column-major view: yᵀ [out × N] = (W as [in × out])ᵀ · (x as [in × N]).
        // SAFETY: the pointers are live device buffers of the sizes the dimensions say; the handle
        // runs on candle's stream, the one the buffers are used on.
        unsafe {
            cublas::gemm_ex(
                *blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m_i,
                n_i,
                k_i,
                (&alpha) as *const f32 as *const _,
                pw as *const _,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k_i,
                px as *const _,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k_i,
                (&beta) as *const f32 as *const _,
                py as *mut _,
                cublas_sys::cudaDataType::CUDA_R_32F,
                m_i,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(launch_err)?;
    }
    Ok(wrap(y, &dev, (n, out)))
}
