//! Launchers for our CUDA kernels (`kernels/*.cu`, compiled to fatbins by build.rs), on candle tensors.
//!
//! Each function here has a CPU twin that the CI tests (named in its doc); `prism cuda-check` runs
//! both on fresh random inputs on the device and reports ‖Δ‖/‖ref‖. All kernels take f32 tensors (the
//! activation dtype of the bf16 path) and return new tensors; the norms, SwiGLU, the gates and the
//! conv read strided views (column ranges of fused projections) in place, and the producers of bf16
//! GEMM inputs can write bf16.
//!
//! A twin takes its op's parameters as they are, so the signatures repeat those of the CPU functions
//! (`ops.rs`, `vision.rs`, ...) on purpose: the op checks the shapes and dispatches, the twin only launches.
//! Every launcher goes through the same steps (shapes, contiguous inputs, [`Input`]s, an output, the
//! launch), written out per kernel: the arguments and the safety argument are each kernel's own.

use candle_core::cuda_backend::cudarc::cublas::{result as cublas, sys as cublas_sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Shape, Storage, StorageRef, Tensor, D};
use prism_quant::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};
use prism_quant::cuda_launch::{Launch, PushArg};

use crate::ops::{row_map, RowMap};

const OPS_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ops.fatbin"));

/// Gives the device memory that the stream-ordered allocator keeps after frees back to the driver
/// (synchronizes the device first). candle allocates with `cuMemAllocAsync` from the device's memory
/// pool, which keeps freed memory for reuse: on an H200 (2026-11-30) a process that had loaded, run and
/// dropped a 27B bf16 model still held 56 GB of device memory, which nothing else on the GPU could
/// use.
pub fn release_cached_memory(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    // The whole context: the loader threads' uploads and conversions ran on their own per-thread
    // streams, which the model's stream does not wait for.
    ctx.synchronize().map_err(launch_err)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver calls on the device's current pool; `pool` is written by the first call
    // and used only if that call succeeded.
    let trimmed = unsafe {
        sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device())
            .result()
            .and_then(|()| sys::cuMemPoolTrimTo(pool, 0).result())
    };
    // Returning cached memory is housekeeping: a device or driver without memory pools keeps it, and
    // the load goes on.
    if let Err(e) = trimmed {
        tracing::warn!("could not return cached device memory to the driver: {e}");
    }
    Ok(())
}

/// Which normalisation [`norm_rows`] applies (`mode` and `scale` in ops.cu).
#[derive(Debug, Clone, Copy)]
enum NormMode {
    Rms,
    GatedRms,
    L2,
    /// L2, then times the factor (the delta rule's query scale 1/√dk), as candle's `x * f` does it.
    L2Scaled(f32),
}

impl NormMode {
    fn code(self) -> i32 {
        match self {
            NormMode::Rms => 0,
            NormMode::GatedRms => 1,
            NormMode::L2 => 2,
            NormMode::L2Scaled(_) => 3,
        }
    }

    fn scale(self) -> f32 {
        match self {
            NormMode::L2Scaled(f) => f,
            _ => 1.0,
        }
    }
}

/// Rows at least this long are normalised by one block each (`norm_rows_block_f32`), shorter ones by
/// one warp each (`norm_rows_f32`). The choice depends on the row length only, never on the number
/// of rows, so a row's bits do not depend on the call it is in.
const NORM_BLOCK_MIN_LEN: usize = 1024;
/// Threads of `norm_rows_block_f32` (`NORM_THREADS` in ops.cu).
const NORM_BLOCK_THREADS: u32 = 256;

/// A tensor a kernel reads in place as rows of `d` contiguous elements ([`RowMap`]), under its storage
/// guard.
struct RowsInput<'a> {
    guard: StorageRef<'a>,
    start: usize,
    map: RowMap,
    name: &'static str,
}

impl<'a> RowsInput<'a> {
    fn new(t: &'a Tensor, d: usize, name: &'static str) -> Result<Self> {
        if t.dtype() != DType::F32 {
            bail!("{name}: expected F32, found {:?}", t.dtype());
        }
        let (guard, layout) = t.storage_and_layout();
        let Some(map) = row_map(layout.dims(), layout.stride(), d) else {
            bail!(
                "{name} {:?} (strides {:?}) cannot be read as rows of {d}",
                layout.dims(),
                layout.stride()
            );
        };
        Ok(Self {
            guard,
            start: layout.start_offset(),
            map,
            name,
        })
    }

    fn view(&self) -> Result<CudaView<'_, f32>> {
        match &*self.guard {
            Storage::Cuda(cs) => Ok(cs
                .as_cuda_slice::<f32>()?
                .slice(self.start..self.start + self.map.span)),
            _ => bail!("{} is not on a CUDA device", self.name),
        }
    }

    /// `(inner, inner_stride, outer)` as kernel arguments.
    fn strides(&self) -> Result<(i64, i64, i64)> {
        let arg = |v: usize| {
            i64::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("{}: stride {v} does not fit in i64", self.name))
            })
        };
        Ok((
            arg(self.map.inner.max(1))?,
            arg(self.map.inner_stride)?,
            arg(self.map.outer)?,
        ))
    }
}

/// `t` itself when a kernel can read it in place as rows of `d` ([`row_map`]), else a contiguous copy.
fn readable_rows(t: &Tensor, d: usize) -> Result<Tensor> {
    if row_map(t.dims(), t.stride(), d).is_some() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// An output buffer in the dtype the consumer wants: f32, or bf16 for a bf16 GEMM.
enum Output {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<half::bf16>),
}

impl Output {
    fn new(dev: &CudaDevice, dtype: DType, len: usize, what: &str) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(Output::F32(alloc(dev, len)?)),
            DType::BF16 => Ok(Output::Bf16(alloc(dev, len)?)),
            other => bail!("{what} (cuda): cannot write {other:?}"),
        }
    }

    /// The kernels' `y_bf16` flag.
    fn is_bf16(&self) -> i32 {
        i32::from(matches!(self, Output::Bf16(_)))
    }

    fn push<'a>(&'a self, b: &mut Launch<'a>) {
        match self {
            Output::F32(s) => b.arg(s),
            Output::Bf16(s) => b.arg(s),
        };
    }

    fn wrap(self, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
        match self {
            Output::F32(s) => wrap(s, dev, shape),
            Output::Bf16(s) => wrap(s, dev, shape),
        }
    }
}

/// A null device pointer for an optional kernel input.
const NULL: u64 = 0;

/// The norm of every row of `x` (read in place when its layout allows), or of `x + residual` (then also
/// returned), written in `out`. `gate` (mode 1): any tensor with as many rows of the same length.
fn norm_rows(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: Option<&Tensor>,
    gate: Option<&Tensor>,
    eps: f64,
    mode: NormMode,
    out: DType,
) -> Result<(Tensor, Option<Tensor>)> {
    if matches!(mode, NormMode::GatedRms) != gate.is_some()
        || matches!(mode, NormMode::L2 | NormMode::L2Scaled(_)) == weight.is_some()
    {
        bail!(
            "norm (cuda): mode {mode:?} with weight {} and gate {}",
            weight.is_some(),
            gate.is_some()
        );
    }
    let dev = cuda_device(x)?;
    let d = x.dim(candle_core::D::Minus1)?;
    let x = readable_rows(x, d)?;
    let rows = x.elem_count() / d.max(1);
    let residual = match residual {
        Some(r) if r.dims() != x.dims() => {
            bail!("norm residual {:?} does not fit x {:?}", r.dims(), x.dims())
        }
        Some(r) => Some(r.contiguous()?),
        None => None,
    };
    let w = match weight {
        Some(w) if w.dims() != [d] => bail!("norm weight {:?} does not fit rows of {d}", w.dims()),
        Some(w) => Some(w.contiguous()?),
        None => None,
    };
    let gate = gate.map(|g| readable_rows(g, d)).transpose()?;
    let y = Output::new(&dev, out, rows * d, "norm")?;
    let sum = residual
        .as_ref()
        .map(|_| alloc::<f32>(&dev, rows * d))
        .transpose()?;
    if rows > 0 {
        let ix = RowsInput::new(&x, d, "x")?;
        let ig = gate
            .as_ref()
            .map(|g| RowsInput::new(g, d, "gate"))
            .transpose()?;
        if let Some(ig) = &ig {
            if ig.map.rows != rows {
                bail!("norm gate has {} rows of {d}, x has {rows}", ig.map.rows);
            }
        }
        let ir = residual
            .as_ref()
            .map(|r| Input::new(r, DType::F32, "residual"))
            .transpose()?;
        let iw = w
            .as_ref()
            .map(|w| Input::new(w, DType::F32, "norm weight"))
            .transpose()?;
        let (vx, x_str) = (ix.view()?, ix.strides()?);
        let vg = ig.as_ref().map(|g| g.view()).transpose()?;
        let g_str = ig
            .as_ref()
            .map(|g| g.strides())
            .transpose()?
            .unwrap_or((1, 0, 0));
        let vr = ir.as_ref().map(|r| r.view::<f32>()).transpose()?;
        let vw = iw.as_ref().map(|w| w.view::<f32>()).transpose()?;
        let (name, cfg) = if d >= NORM_BLOCK_MIN_LEN {
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (NORM_BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            ("norm_rows_block_f32", cfg)
        } else {
            let rows_per_block = 4u32;
            let cfg = LaunchConfig {
                grid_dim: ((rows as u32).div_ceil(rows_per_block), 1, 1),
                block_dim: (32 * rows_per_block, 1, 1),
                shared_mem_bytes: 0,
            };
            ("norm_rows_f32", cfg)
        };
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, name)?;
        let (rows_i, d_i, eps_f, mode_i, bf16_i) = (
            i32_arg(rows, "rows")?,
            i32_arg(d, "row length")?,
            eps as f32,
            mode.code(),
            y.is_bf16(),
        );
        let scale_f = mode.scale();
        let mut b = func.builder();
        b.arg(&vx).arg(&x_str.0).arg(&x_str.1).arg(&x_str.2);
        match &vr {
            Some(vr) => b.arg(vr),
            None => b.arg(&NULL),
        };
        match &sum {
            Some(s) => b.arg(s),
            None => b.arg(&NULL),
        };
        match &vw {
            Some(vw) => b.arg(vw),
            None => b.arg(&NULL),
        };
        match &vg {
            Some(vg) => b.arg(vg),
            None => b.arg(&NULL),
        };
        b.arg(&g_str.0).arg(&g_str.1).arg(&g_str.2);
        y.push(&mut b);
        b.arg(&bf16_i)
            .arg(&rows_i)
            .arg(&d_i)
            .arg(&eps_f)
            .arg(&mode_i)
            .arg(&scale_f);
        // SAFETY: the views cover every row the kernel reads (row maps checked above, rows counted
        // from x); y and sum hold rows × d elements; null pointers only where the mode reads nothing.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    let shape = x.shape().clone();
    Ok((
        y.wrap(&dev, shape.clone()),
        sum.map(|s| wrap(s, &dev, shape)),
    ))
}

/// CUDA twin of [`crate::ops::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_as(x, weight, eps, DType::F32)
}

/// CUDA twin of [`crate::ops::rms_norm_as`]: the result written in f32 or bf16.
pub fn rms_norm_as(x: &Tensor, weight: &Tensor, eps: f64, out: DType) -> Result<Tensor> {
    Ok(norm_rows(x, None, Some(weight), None, eps, NormMode::Rms, out)?.0)
}

/// CUDA twin of [`crate::ops::add_rms_norm`]: `(x + residual, rms_norm(x + residual))` in one kernel.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
    out: DType,
) -> Result<(Tensor, Tensor)> {
    match norm_rows(
        x,
        Some(residual),
        Some(weight),
        None,
        eps,
        NormMode::Rms,
        out,
    )? {
        (normed, Some(sum)) => Ok((sum, normed)),
        (_, None) => bail!("add_rms_norm (cuda): the kernel returned no sum"),
    }
}

/// CUDA twin of [`crate::ops::gated_rms_norm`].
pub fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if gate.dims() != x.dims() {
        bail!("norm gate {:?} does not fit x {:?}", gate.dims(), x.dims());
    }
    Ok(norm_rows(
        x,
        None,
        Some(weight),
        Some(gate),
        eps,
        NormMode::GatedRms,
        DType::F32,
    )?
    .0)
}

/// CUDA twin of [`crate::ops::gated_rms_norm_rows`], which checks the shapes: `x: [n, h, d]`, the gate
/// `[n, h·d]` read in place; returns `[n, h·d]` in `out`.
pub(crate) fn gated_rms_norm_rows(
    x: &Tensor,
    gate: &Tensor,
    weight: &Tensor,
    eps: f64,
    out: DType,
) -> Result<Tensor> {
    let (n, h, d) = x.dims3()?;
    norm_rows(
        x,
        None,
        Some(weight),
        Some(gate),
        eps,
        NormMode::GatedRms,
        out,
    )?
    .0
    .reshape((n, h * d))
}

/// CUDA twin of [`crate::ops::l2_norm`].
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(norm_rows(x, None, None, None, eps, NormMode::L2, DType::F32)?.0)
}

/// CUDA twin of [`crate::ops::l2_norm_scaled`]: one kernel instead of the norm and candle's affine.
pub fn l2_norm_scaled(x: &Tensor, eps: f64, scale: f64) -> Result<Tensor> {
    let mode = NormMode::L2Scaled(scale as f32);
    Ok(norm_rows(x, None, None, None, eps, mode, DType::F32)?.0)
}

/// CUDA twin of [`crate::delta_net::causal_conv`] (bitwise equal: same products and sums in order).
pub fn causal_conv(x: &Tensor, window: &Tensor, taps: &Tensor) -> Result<(Tensor, Tensor)> {
    let dev = cuda_device(x)?;
    let (t_len, c) = x.dims2()?;
    let (k, c_taps) = taps.dims2()?;
    if c_taps != c || window.dims() != [k.saturating_sub(1), c] || k < 2 {
        bail!(
            "causal conv: x {:?}, window {:?}, taps {:?} do not fit",
            x.dims(),
            window.dims(),
            taps.dims()
        );
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
    let (t_i, c_i, k_i) = (
        i32_arg(t_len, "tokens")?,
        i32_arg(c, "channels")?,
        i32_arg(k, "taps")?,
    );
    {
        let (vx, vw, vt) = (ix.view::<f32>()?, iw.view::<f32>()?, it.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vx)
            .arg(&vw)
            .arg(&vt)
            .arg(&out)
            .arg(&new_window)
            .arg(&t_i)
            .arg(&c_i)
            .arg(&k_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok((
        wrap(out, &dev, (t_len, c)),
        wrap(new_window, &dev, (k - 1, c)),
    ))
}

/// Output rows per thread of `causal_conv_silu_f32` (`CONV_ROWS` in ops.cu).
const CONV_SILU_ROWS: usize = 8;
const CONV_SILU_THREADS: u32 = 256;

/// The DeltaNet conv + SiLU of all segments of a call, written into one `[N, C]` output: the fused
/// twin of [`crate::delta_net::causal_conv`] followed by candle's `silu` (the conv bitwise the CPU's,
/// the SiLU candle's CUDA one). Each segment reads its q|k|v rows in place (any row stride), so neither
/// the fused projection's column range nor the per-segment outputs are copied.
pub struct ConvSiluOutput {
    dev: CudaDevice,
    out: CudaSlice<f32>,
    rows: usize,
    channels: usize,
    /// Rows written so far (segments write disjoint rows, in any order).
    filled: usize,
}

/// Most one-token segments of one [`ConvSiluOutput::decode_rows`] launch (`CONV_DECODE_MAX` in ops.cu).
const CONV_DECODE_MAX: usize = 64;

/// The segments of one decode launch: the C layout of `ConvDecodeArgs` in ops.cu, passed by value.
/// Shaped like `FlashBatch` in cuda_flash.rs (pointers, then ints per segment), but each struct mirrors
/// its own kernel's parameter field for field, so no generic one serves both.
#[repr(C)]
#[derive(Clone, Copy)]
struct ConvDecodeArgs {
    window: [u64; CONV_DECODE_MAX],
    row: [i32; CONV_DECODE_MAX],
    count: i32,
}

// SAFETY: plain integers in the layout of the kernel's `ConvDecodeArgs` (64 pointers, 65 ints, tail
// padding to 8 bytes: 776 bytes, checked below).
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for ConvDecodeArgs {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for ConvDecodeArgs {}

const _: () = assert!(std::mem::size_of::<ConvDecodeArgs>() == 776);

impl ConvSiluOutput {
    /// An output for `rows` rows of `channels`, on `like`'s device.
    pub fn new(like: &Tensor, rows: usize, channels: usize) -> Result<Self> {
        let dev = cuda_device(like)?;
        let out = alloc::<f32>(&dev, rows * channels)?;
        Ok(Self {
            dev,
            out,
            rows,
            channels,
            filled: 0,
        })
    }

    /// Rows `start..start + T` of the output from the segment's inputs `x: [T, C]` after `window:
    /// [K−1, C]`, with `taps: [K, C]`; returns the new window (the last K−1 inputs).
    pub fn segment(
        &mut self,
        x: &Tensor,
        start: usize,
        window: &Tensor,
        taps: &Tensor,
    ) -> Result<Tensor> {
        Ok(self.segment_with_snapshot(x, start, window, taps, None)?.0)
    }

    /// [`Self::segment`], also returning, for `snapshot: Some(p)` (p ≤ T), the window after the
    /// segment's first `p` inputs (the last K−1 of `window` and those rows; a snapshot state's window),
    /// written by the same launch.
    pub fn segment_with_snapshot(
        &mut self,
        x: &Tensor,
        start: usize,
        window: &Tensor,
        taps: &Tensor,
        snapshot: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (t_len, c) = x.dims2()?;
        let (k, c_taps) = taps.dims2()?;
        if c != self.channels || c_taps != c || window.dims() != [k.saturating_sub(1), c] || k < 2 {
            bail!(
                "conv + silu: x {:?}, window {:?}, taps {:?} do not fit {} channels",
                x.dims(),
                window.dims(),
                taps.dims(),
                self.channels
            );
        }
        if start + t_len > self.rows || self.filled + t_len > self.rows {
            bail!(
                "conv + silu: segment at row {start} of {t_len} rows after {} of {} rows written",
                self.filled,
                self.rows
            );
        }
        if let Some(p) = snapshot.filter(|&p| p > t_len) {
            bail!("conv + silu: a snapshot after {p} of the segment's {t_len} rows");
        }
        let new_window = alloc::<f32>(&self.dev, (k - 1) * c)?;
        let snap_window = match snapshot {
            Some(_) => Some(alloc::<f32>(&self.dev, (k - 1) * c)?),
            None => None,
        };
        let snap_p = match snapshot {
            Some(p) => i32_arg(p, "snapshot row")?,
            None => -1,
        };
        let row_groups = t_len.div_ceil(CONV_SILU_ROWS);
        if row_groups + 1 > 65535 {
            bail!("conv + silu: a segment of {t_len} tokens is longer than one launch takes");
        }
        let x = readable_rows(x, c)?;
        let (window, taps) = (window.contiguous()?, taps.contiguous()?);
        {
            let ix = RowsInput::new(&x, c, "conv input")?;
            let (iw, it) = (
                Input::new(&window, DType::F32, "conv window")?,
                Input::new(&taps, DType::F32, "conv taps")?,
            );
            let func = load_kernel(&self.dev, "prism_ops", OPS_IMAGE, "causal_conv_silu_f32")?;
            let cfg = LaunchConfig {
                grid_dim: (
                    (c as u32).div_ceil(CONV_SILU_THREADS),
                    (row_groups + 1) as u32,
                    1,
                ),
                block_dim: (CONV_SILU_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let (t_i, c_i, k_i) = (
                i32_arg(t_len, "tokens")?,
                i32_arg(c, "channels")?,
                i32_arg(k, "taps")?,
            );
            let x_stride = ix.strides()?.2;
            // A window-only launch (T = 0) reads no input row: any pointer will do.
            let vx = ix.view()?;
            let (vw, vt) = (iw.view::<f32>()?, it.view::<f32>()?);
            let mut rows_out = self.out.slice_mut(start * c..(start + t_len) * c);
            let mut b = func.builder();
            b.arg(&vx)
                .arg(&x_stride)
                .arg(&vw)
                .arg(&vt)
                .arg(&mut rows_out)
                .arg(&new_window);
            // Without a snapshot (snap_p = −1) the kernel never touches its window: any pointer will do.
            b.arg(snap_window.as_ref().unwrap_or(&new_window))
                .arg(&snap_p);
            b.arg(&t_i).arg(&c_i).arg(&k_i);
            // SAFETY: x covers T rows of C at its row stride (row map), the output slice T rows of C,
            // the windows (old, new and snapshot) K−1 rows and the taps K rows of C; snap_p ≤ T, so
            // the snapshot's window reads only those; the kernel reads and writes nothing else.
            unsafe { b.launch(cfg) }.map_err(launch_err)?;
        }
        self.filled += t_len;
        Ok((
            wrap(new_window, &self.dev, (k - 1, c)),
            snap_window.map(|w| wrap(w, &self.dev, (k - 1, c))),
        ))
    }

    /// Output rows `rows[s]` of one-token segments (decode steps), each from input row `rows[s]` of
    /// `x: [N, C]` (any row stride) after its own `windows[s]: [K−1, C]`, with `taps: [K, C]`, in one
    /// launch per 64 segments; returns the new windows (views of one `[S, K−1, C]` tensor). Bit for bit
    /// what [`Self::segment`] gives each of them alone.
    pub fn decode_rows(
        &mut self,
        x: &Tensor,
        rows: &[usize],
        windows: &[&Tensor],
        taps: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let (n, c) = x.dims2()?;
        let (k, c_taps) = taps.dims2()?;
        if c != self.channels || c_taps != c || k < 2 || rows.len() != windows.len() {
            bail!(
                "conv + silu (decode): x {:?}, taps {:?}, {} rows and {} windows do not fit {} channels",
                x.dims(),
                taps.dims(),
                rows.len(),
                windows.len(),
                self.channels
            );
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= n.min(self.rows)) {
            bail!("conv + silu (decode): row {bad} outside the call's {n} rows");
        }
        let count = rows.len();
        if self.filled + count > self.rows {
            bail!(
                "conv + silu (decode): {count} rows after {} of {} written",
                self.filled,
                self.rows
            );
        }
        let windows: Vec<Tensor> = windows
            .iter()
            .map(|w| {
                if w.dims() != [k - 1, c] {
                    bail!(
                        "conv + silu (decode): window {:?}, not [{}, {c}]",
                        w.dims(),
                        k - 1
                    );
                }
                w.contiguous()
            })
            .collect::<Result<_>>()?;
        let mut new_windows = alloc::<f32>(&self.dev, count * (k - 1) * c)?;
        let x = readable_rows(x, c)?;
        let taps = taps.contiguous()?;
        let func = load_kernel(
            &self.dev,
            "prism_ops",
            OPS_IMAGE,
            "causal_conv_silu_decode_f32",
        )?;
        let stream = self.dev.cuda_stream();
        let ix = RowsInput::new(&x, c, "conv input")?;
        let it = Input::new(&taps, DType::F32, "conv taps")?;
        let iws = windows
            .iter()
            .map(|w| Input::new(w, DType::F32, "conv window"))
            .collect::<Result<Vec<_>>>()?;
        let views = iws
            .iter()
            .map(|w| w.view::<f32>())
            .collect::<Result<Vec<_>>>()?;
        let x_stride = ix.strides()?.2;
        let vx = ix.view()?;
        let vt = it.view::<f32>()?;
        let (c_i, k_i) = (i32_arg(c, "channels")?, i32_arg(k, "taps")?);
        for first in (0..count).step_by(CONV_DECODE_MAX) {
            let part = first..(first + CONV_DECODE_MAX).min(count);
            let mut args = ConvDecodeArgs {
                window: [0; CONV_DECODE_MAX],
                row: [0; CONV_DECODE_MAX],
                count: i32_arg(part.len(), "segments")?,
            };
            let mut guards = Vec::with_capacity(part.len());
            for (j, s) in part.clone().enumerate() {
                let (pointer, guard) = views[s].device_ptr(&stream);
                guards.push(guard);
                args.window[j] = pointer;
                args.row[j] = i32_arg(rows[s], "row")?;
            }
            let mut out_windows =
                new_windows.slice_mut((first * (k - 1) * c)..(part.end * (k - 1) * c));
            let cfg = LaunchConfig {
                grid_dim: ((c as u32).div_ceil(CONV_SILU_THREADS), part.len() as u32, 1),
                block_dim: (CONV_SILU_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&vx)
                .arg(&x_stride)
                .arg(&args)
                .arg(&vt)
                .arg(&mut self.out);
            b.arg(&mut out_windows).arg(&c_i).arg(&k_i);
            // SAFETY: x holds N rows of C at its row stride and every row index is below N; each
            // window pointer is a live contiguous [K−1, C] f32 tensor (guards held); the output holds
            // N rows of C and the new windows `count` windows; the kernel touches nothing else.
            unsafe { b.launch(cfg) }.map_err(launch_err)?;
            drop(guards);
        }
        self.filled += count;
        let all = wrap(new_windows, &self.dev, (count, k - 1, c));
        (0..count).map(|s| all.get(s)).collect()
    }

    /// The whole `[N, C]` output; every row must have been written.
    pub fn finish(self) -> Result<Tensor> {
        if self.filled != self.rows {
            bail!("conv + silu: {} of {} rows written", self.filled, self.rows);
        }
        Ok(wrap(self.out, &self.dev, (self.rows, self.channels)))
    }
}

/// Threads per block of the element-wise kernels.
const ELEMENTWISE_THREADS: u32 = 256;

fn elementwise_config(n: usize) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(ELEMENTWISE_THREADS as usize);
    let blocks = u32::try_from(blocks).map_err(|_| {
        candle_core::Error::Msg(format!("{n} elements are too many for one launch"))
    })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// CUDA twin of [`crate::ops::swiglu_as`]: `gate_up: [n, 2f]` read in place (any row stride), returns
/// `silu(gate) · up`, `[n, f]`, in `out`.
pub fn swiglu(gate_up: &Tensor, f: usize, out: DType) -> Result<Tensor> {
    let dev = cuda_device(gate_up)?;
    let (n, width) = gate_up.dims2()?;
    if width != 2 * f {
        bail!("swiglu: gate | up has {width} columns, not 2 × {f}");
    }
    let y = Output::new(&dev, out, n * f, "swiglu")?;
    if n * f > 0 {
        let gu = readable_rows(gate_up, width)?;
        let ig = RowsInput::new(&gu, width, "gate | up")?;
        let stride = ig.strides()?.2;
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "swiglu_f32")?;
        let cfg = elementwise_config(n * f.div_ceil(4))?;
        let (n_i, f_i, bf16_i) = (i32_arg(n, "rows")?, i32_arg(f, "ffn width")?, y.is_bf16());
        let vg = ig.view()?;
        let mut b = func.builder();
        b.arg(&vg).arg(&stride);
        y.push(&mut b);
        b.arg(&bf16_i).arg(&n_i).arg(&f_i);
        // SAFETY: the view covers n rows of 2f at the row stride; y holds n × f elements.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(y.wrap(&dev, (n, f)))
}

/// CUDA twin of [`crate::ops::delta_net_gates`]: `b, a: [n, h]` read in place (any row stride);
/// returns `(β, g)`, both `[n, h]` f32.
pub fn delta_net_gates(
    b: &Tensor,
    a: &Tensor,
    dt_bias: &Tensor,
    ssm_a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dev = cuda_device(b)?;
    let (n, h) = b.dims2()?;
    if a.dims() != [n, h] || dt_bias.dims() != [h] || ssm_a.dims() != [h] {
        bail!(
            "delta-net gates: b {:?}, a {:?}, dt_bias {:?}, ssm_a {:?} do not fit",
            b.dims(),
            a.dims(),
            dt_bias.dims(),
            ssm_a.dims()
        );
    }
    let beta = alloc::<f32>(&dev, n * h)?;
    let g = alloc::<f32>(&dev, n * h)?;
    if n * h > 0 {
        let (bt, at) = (readable_rows(b, h)?, readable_rows(a, h)?);
        let (dt_bias, ssm_a) = (dt_bias.contiguous()?, ssm_a.contiguous()?);
        let (ib, ia) = (
            RowsInput::new(&bt, h, "beta logits")?,
            RowsInput::new(&at, h, "alpha")?,
        );
        let (idt, isa) = (
            Input::new(&dt_bias, DType::F32, "dt_bias")?,
            Input::new(&ssm_a, DType::F32, "ssm_a")?,
        );
        let (b_stride, a_stride) = (ib.strides()?.2, ia.strides()?.2);
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "deltanet_gates_f32")?;
        let cfg = elementwise_config(n * h)?;
        let (n_i, h_i) = (i32_arg(n, "rows")?, i32_arg(h, "heads")?);
        let (vb, va, vdt, vsa) = (
            ib.view()?,
            ia.view()?,
            idt.view::<f32>()?,
            isa.view::<f32>()?,
        );
        let mut l = func.builder();
        l.arg(&vb)
            .arg(&b_stride)
            .arg(&va)
            .arg(&a_stride)
            .arg(&vdt)
            .arg(&vsa);
        l.arg(&beta).arg(&g).arg(&n_i).arg(&h_i);
        // SAFETY: b and a cover n rows of h at their row strides; the outputs hold n × h elements.
        unsafe { l.launch(cfg) }.map_err(launch_err)?;
    }
    Ok((wrap(beta, &dev, (n, h)), wrap(g, &dev, (n, h))))
}

/// CUDA twin of [`crate::ops::sigmoid_gate`]: `attn: [n, h·d]`, `gate: [n, h, d]` read in place;
/// returns `attn · σ(gate)`, `[n, h·d]`, in `out`.
pub fn sigmoid_gate(attn: &Tensor, gate: &Tensor, out: DType) -> Result<Tensor> {
    let dev = cuda_device(attn)?;
    let (n, h, d) = gate.dims3()?;
    if attn.dims() != [n, h * d] {
        bail!(
            "attention gate {:?} does not fit the output {:?}",
            gate.dims(),
            attn.dims()
        );
    }
    let y = Output::new(&dev, out, n * h * d, "attention gate")?;
    if n * h * d > 0 {
        let attn = attn.contiguous()?;
        let gate = readable_rows(gate, d)?;
        let ia = Input::new(&attn, DType::F32, "attention output")?;
        let ig = RowsInput::new(&gate, d, "attention gate")?;
        let g_str = ig.strides()?;
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "sigmoid_gate_f32")?;
        let cfg = elementwise_config(n * h * d)?;
        i32_arg(n * h, "gate rows")?;
        let (n_i, w_i, d_i, bf16_i) = (
            i32_arg(n, "rows")?,
            i32_arg(h * d, "width")?,
            i32_arg(d, "head dim")?,
            y.is_bf16(),
        );
        let (va, vg) = (ia.view::<f32>()?, ig.view()?);
        let mut b = func.builder();
        b.arg(&va)
            .arg(&vg)
            .arg(&g_str.0)
            .arg(&g_str.1)
            .arg(&g_str.2)
            .arg(&d_i);
        y.push(&mut b);
        b.arg(&bf16_i).arg(&n_i).arg(&w_i);
        // SAFETY: attn holds n × h·d elements, the gate view n·h rows of d; y n × h·d.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(y.wrap(&dev, (n, h * d)))
}

/// Warps per block of the attention kernel (rows × heads of one KV group; see ops.cu).
const ATTENTION_WARPS: usize = 12;
/// Keys per shared-memory tile of the attention kernel (`ATT_KEYS` in ops.cu).
const ATTENTION_KEYS: usize = 32;

/// CUDA twin of [`crate::attention::CausalAttention`]: `q: [T, n_h, hd]`, `k, v: [n_kv, past + T, hd]`,
/// returns `[T, n_h·hd]`.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let dims = crate::attention::attention_dims(q.dims(), k.dims(), v.dims(), past)
        .filter(|&(.., hd)| hd % 32 == 0 && hd <= 256);
    let Some((t_len, n_h, n_kv, hd)) = dims else {
        bail!(
            "causal attention (cuda): q {:?}, k {:?}, v {:?} after {past} cached tokens do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (iq, ik, iv) = (
        Input::new(&q, DType::F32, "q")?,
        Input::new(&k, DType::F32, "k")?,
        Input::new(&v, DType::F32, "v")?,
    );
    let out = alloc::<f32>(&dev, t_len * n_h * hd)?;
    let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "causal_attention_f32")?;
    // One warp per (row, head); a block takes `rows` query rows × `heads` query heads of one KV group
    // (about 12 warps: 56 registers a thread leave room for three blocks an SM) and shares its key
    // tiles among them.
    let group = n_h / n_kv;
    let heads = (1..=group.min(ATTENTION_WARPS))
        .rev()
        .find(|d| group % d == 0)
        .unwrap_or(1);
    let rows = (ATTENTION_WARPS / heads).max(1).min(t_len.max(1));
    let smem = 2 * ATTENTION_KEYS * hd * 4;
    func.allow_dynamic_shared(smem, "attention shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (
            t_len.div_ceil(rows) as u32,
            (n_kv * (group / heads)) as u32,
            1,
        ),
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
    let (rows_i, heads_i) = (
        i32_arg(rows, "rows per block")?,
        i32_arg(heads, "heads per block")?,
    );
    let scale_f = scale as f32;
    {
        let (vq, vk, vv) = (iq.view::<f32>()?, ik.view::<f32>()?, iv.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vq)
            .arg(&vk)
            .arg(&vv)
            .arg(&out)
            .arg(&t_i)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&hd_i)
            .arg(&past_i)
            .arg(&scale_f);
        b.arg(&rows_i).arg(&heads_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(wrap(out, &dev, (t_len, n_h * hd)))
}

/// `y = x · Wᵀ` with bf16 operands and an **f32 result**: `x: [N, in]` (bf16 as its producer wrote it,
/// or f32, rounded to bf16 here), `w: [out, in]` bf16; returns `[N, out]` f32. cuBLAS accumulates in f32
/// (`CUBLAS_COMPUTE_32F`), and the output is not rounded to bf16 — the CPU bf16 path
/// ([`crate::ops::linear`]) does the same.
pub fn linear_bf16(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let (n, k) = x.dims2()?;
    let (out, k_w) = w.dims2()?;
    if k != k_w || w.dtype() != DType::BF16 || !matches!(x.dtype(), DType::F32 | DType::BF16) {
        bail!(
            "linear (cuda): x {:?} {:?} and weight {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    let xb = x.to_dtype(DType::BF16)?.contiguous()?;
    let w = w.contiguous()?;
    let ix = Input::new(&xb, DType::BF16, "x")?;
    let iw = Input::new(&w, DType::BF16, "weight")?;
    let mut y = alloc::<f32>(&dev, n * out)?;
    let (m_i, n_i, k_i) = (
        i32_arg(out, "out features")?,
        i32_arg(n, "rows")?,
        i32_arg(k, "in features")?,
    );
    {
        let stream = dev.cuda_stream();
        let vx = ix.view::<half::bf16>()?;
        let vw = iw.view::<half::bf16>()?;
        let (px, _gx) = vx.device_ptr(&stream);
        let (pw, _gw) = vw.device_ptr(&stream);
        let (py, _gy) = y.device_ptr_mut(&stream);
        let blas = dev.cublas_handle();
        // SAFETY: the pointers are live device buffers of the sizes the dimensions say (w out·in,
        // x N·in bf16, y N·out f32); the handle runs on candle's stream, the one the buffers are used
        // on.
        unsafe {
            gemm_tn(
                *blas.handle(),
                GemmTypes::Bf16F32,
                (m_i, n_i, k_i),
                pw,
                px,
                py,
            )
        }?;
    }
    Ok(wrap(y, &dev, (n, out)))
}

/// The element types of a [`gemm_tn`]: bf16 inputs to an f32 output (`CUBLAS_COMPUTE_32F`), or int8
/// inputs to an i32 output (`CUBLAS_COMPUTE_32I`).
#[derive(Clone, Copy)]
enum GemmTypes {
    Bf16F32,
    Int8I32,
}

/// cuBLAS `gemm_ex` of the row-major `y[n, m] = x[n, k] · w[m, k]ᵀ` (alpha 1, beta 0, the default
/// algorithm): column-major, yᵀ [m × n] = (w as [k × m])ᵀ · (x as [k × n]), leading dimensions k, k
/// and m.
///
/// # Safety
/// `w`, `x` and `y` are live device buffers of m·k, n·k and n·m elements of `types`' input, input and
/// output types, used on the stream `handle` runs on.
unsafe fn gemm_tn(
    handle: cublas_sys::cublasHandle_t,
    types: GemmTypes,
    (m, n, k): (i32, i32, i32),
    w: u64,
    x: u64,
    y: u64,
) -> Result<()> {
    type Scalar = *const std::ffi::c_void;
    let (one_f, zero_f, one_i, zero_i) = (1f32, 0f32, 1i32, 0i32);
    let (alpha, beta, input, output, compute): (Scalar, Scalar, _, _, _) = match types {
        GemmTypes::Bf16F32 => (
            (&one_f as *const f32).cast(),
            (&zero_f as *const f32).cast(),
            cublas_sys::cudaDataType::CUDA_R_16BF,
            cublas_sys::cudaDataType::CUDA_R_32F,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        GemmTypes::Int8I32 => (
            (&one_i as *const i32).cast(),
            (&zero_i as *const i32).cast(),
            cublas_sys::cudaDataType::CUDA_R_8I,
            cublas_sys::cudaDataType::CUDA_R_32I,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
        ),
    };
    // SAFETY: the caller's; alpha and beta point to live scalars of the compute type.
    unsafe {
        cublas::gemm_ex(
            handle,
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            alpha,
            w as *const _,
            input,
            k,
            x as *const _,
            input,
            k,
            beta,
            y as *mut _,
            output,
            m,
            compute,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(launch_err)
}

/// Operations per second (2 per multiply-add) of cuBLAS's int8 GEMM (int8 inputs, i32 accumulation and
/// output, `CUBLAS_COMPUTE_32I`) on an `n × n × n` product, best of `runs`: the int8 tensor-core rate
/// `prism bench` divides the integer path's work by (its compute floor). The inputs are zeros — the
/// tensor cores' speed does not depend on the values.
pub fn int8_matmul_rate(dev: &CudaDevice, n: usize, runs: usize) -> Result<f64> {
    let secs = int8_gemm_seconds(dev, (n, n, n), runs, false)?;
    Ok(2.0 * (n as f64).powi(3) / secs)
}

/// Seconds of one cuBLAS int8 GEMM `y[m, n] = x[m, k] · w[n, k]ᵀ` (int8 inputs, i32 output,
/// `CUBLAS_COMPUTE_32I`), zero inputs: the best of `runs` (`median` false) or their median, each timed
/// between two synchronizations. Every dimension must be a positive multiple of 4 (cuBLAS's int8
/// layout).
pub fn int8_gemm_seconds(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    runs: usize,
    median: bool,
) -> Result<f64> {
    if [m, n, k].iter().any(|&d| d == 0 || d % 4 != 0) {
        bail!("int8 GEMM: {m} × {n} × {k}: every dimension must be a positive multiple of 4 (cuBLAS int8 layout)");
    }
    let a = dev.alloc_zeros::<i8>(n * k)?;
    let b = dev.alloc_zeros::<i8>(m * k)?;
    let mut c = dev.alloc_zeros::<i32>(m * n)?;
    let (m_i, n_i, k_i) = (i32_arg(m, "m")?, i32_arg(n, "n")?, i32_arg(k, "k")?);
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let mut times = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) + 1 {
        stream.synchronize().map_err(launch_err)?;
        let start = std::time::Instant::now();
        {
            let (pa, _ga) = a.device_ptr(&stream);
            let (pb, _gb) = b.device_ptr(&stream);
            let (pc, _gc) = c.device_ptr_mut(&stream);
            // SAFETY: three live device buffers (n·k, m·k bytes, m·n i32) on the handle's stream; the
            // TN layout with leading dimensions k, k and n (multiples of 4) is the one cuBLAS's int8
            // GEMM takes: `a` is the weight side (n × k), `b` the rows (m × k), `c` is y [m, n].
            unsafe {
                gemm_tn(
                    *blas.handle(),
                    GemmTypes::Int8I32,
                    (n_i, m_i, k_i),
                    pa,
                    pb,
                    pc,
                )
            }?;
        }
        stream.synchronize().map_err(launch_err)?;
        times.push(start.elapsed().as_secs_f64());
    }
    // The first call is a warm-up.
    let mut times = times.split_off(1);
    times.sort_by(f64::total_cmp);
    Ok(if median {
        times[times.len() / 2]
    } else {
        times[0]
    })
}

/// Head rows per block of `qk_norm_rope_f32` (one warp each).
const QK_NORM_ROPE_ROWS: u32 = 4;

/// CUDA twin of [`crate::rope::MRope::norm_and_rotate`]: `q: [N, n_h, hd]` and `k` (`N` rows of
/// `n_kv·hd`) read in place (any layout [`row_map`] takes), both normalised and their first
/// `rotary_dim` dims rotated by one kernel; returns `q: [N, n_h, hd]` and `k: [N, n_kv, hd]` in `out`
/// (f32, or bf16 rounded to nearest even). Bit for bit [`rms_norm`] then the candle rotation and cast
/// (see ops.cu).
pub fn qk_norm_rope(
    q: &Tensor,
    k: &Tensor,
    norms: &crate::rope::HeadNorms<'_>,
    cos: &Tensor,
    sin: &Tensor,
    rotary_dim: usize,
    out: DType,
) -> Result<(Tensor, Tensor)> {
    let dev = cuda_device(q)?;
    let (n, n_h, hd) = q.dims3()?;
    let n_kv = if n == 0 || hd == 0 {
        0
    } else {
        k.elem_count() / (n * hd)
    };
    let half = rotary_dim / 2;
    if hd == 0
        || k.dim(0)? != n
        || k.elem_count() != n * n_kv * hd
        || rotary_dim % 2 != 0
        || rotary_dim > hd
    {
        bail!(
            "q/k norm + rope (cuda): q {:?}, k {:?}, rotary dim {rotary_dim} do not fit",
            q.dims(),
            k.dims()
        );
    }
    if cos.dims() != [n, half] || sin.dims() != [n, half] {
        bail!(
            "q/k norm + rope (cuda): cos {:?} / sin {:?} are not [{n}, {half}]",
            cos.dims(),
            sin.dims()
        );
    }
    if norms.q_weight.dims() != [hd] || norms.k_weight.dims() != [hd] {
        bail!(
            "q/k norm + rope (cuda): norm weights {:?} / {:?} are not [{hd}]",
            norms.q_weight.dims(),
            norms.k_weight.dims()
        );
    }
    let yq = Output::new(&dev, out, n * n_h * hd, "q norm + rope")?;
    let yk = Output::new(&dev, out, n * n_kv * hd, "k norm + rope")?;
    let rows = n * (n_h + n_kv);
    if rows > 0 {
        let (qt, kt) = (readable_rows(q, hd)?, readable_rows(k, hd)?);
        let (iq, ik) = (RowsInput::new(&qt, hd, "q")?, RowsInput::new(&kt, hd, "k")?);
        if iq.map.rows != n * n_h || ik.map.rows != n * n_kv {
            bail!(
                "q/k norm + rope (cuda): {} q rows and {} k rows of {hd}, expected {} and {}",
                iq.map.rows,
                ik.map.rows,
                n * n_h,
                n * n_kv
            );
        }
        let (qw, kw) = (norms.q_weight.contiguous()?, norms.k_weight.contiguous()?);
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        let (iqw, ikw) = (
            Input::new(&qw, DType::F32, "q norm weight")?,
            Input::new(&kw, DType::F32, "k norm weight")?,
        );
        let (ic, is) = (
            Input::new(&cos, DType::F32, "rope cos")?,
            Input::new(&sin, DType::F32, "rope sin")?,
        );
        let (q_str, k_str) = (iq.strides()?, ik.strides()?);
        let blocks = u32::try_from(rows.div_ceil(QK_NORM_ROPE_ROWS as usize)).map_err(|_| {
            candle_core::Error::Msg(format!(
                "q/k norm + rope: {rows} head rows are too many for one launch"
            ))
        })?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * QK_NORM_ROPE_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        i32_arg(rows, "head rows")?;
        let (n_i, nh_i, nkv_i, hd_i, rot_i) = (
            i32_arg(n, "tokens")?,
            i32_arg(n_h, "heads")?,
            i32_arg(n_kv, "kv heads")?,
            i32_arg(hd, "head dim")?,
            i32_arg(rotary_dim, "rotary dim")?,
        );
        let (qbf, kbf, eps_f) = (yq.is_bf16(), yk.is_bf16(), norms.eps as f32);
        let (vq, vk) = (iq.view()?, ik.view()?);
        let (vqw, vkw, vc, vs) = (
            iqw.view::<f32>()?,
            ikw.view::<f32>()?,
            ic.view::<f32>()?,
            is.view::<f32>()?,
        );
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "qk_norm_rope_f32")?;
        let mut b = func.builder();
        b.arg(&vq).arg(&q_str.0).arg(&q_str.1).arg(&q_str.2);
        b.arg(&vk).arg(&k_str.0).arg(&k_str.1).arg(&k_str.2);
        b.arg(&vqw).arg(&vkw).arg(&vc).arg(&vs);
        yq.push(&mut b);
        b.arg(&qbf);
        yk.push(&mut b);
        b.arg(&kbf)
            .arg(&n_i)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&hd_i)
            .arg(&rot_i)
            .arg(&eps_f);
        // SAFETY: the q and k views cover N·n_h and N·n_kv rows of hd (row maps, counted above); the
        // weights hold hd elements, cos and sin N × rotary_dim/2; the outputs N·n_h·hd and N·n_kv·hd.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok((yq.wrap(&dev, (n, n_h, hd)), yk.wrap(&dev, (n, n_kv, hd))))
}

/// Threads of the vision tower's row kernels (`ROW_THREADS` in ops.cu).
const ROW_THREADS: u32 = 256;

fn row_config(rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(rows).map_err(|_| {
                candle_core::Error::Msg(format!("{rows} rows are too many for one launch"))
            })?,
            1,
            1,
        ),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The vision tower's LayerNorm on CUDA: `x` `[rows, d]` f32, `(weight, bias)` `[d]`; one block a row
/// (the CPU's chain of ops, summed in another order).
pub fn layer_norm_rows(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let d = x.dim(D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    if weight.dims() != [d] || bias.dims() != [d] {
        bail!(
            "layer norm (cuda): weight {:?} and bias {:?} for rows of {d}",
            weight.dims(),
            bias.dims()
        );
    }
    let y = alloc::<f32>(&dev, rows * d)?;
    if rows * d > 0 {
        let (x, weight, bias) = (x.contiguous()?, weight.contiguous()?, bias.contiguous()?);
        let (ix, iw, ib) = (
            Input::new(&x, DType::F32, "layer norm input")?,
            Input::new(&weight, DType::F32, "layer norm weight")?,
            Input::new(&bias, DType::F32, "layer norm bias")?,
        );
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "layer_norm_rows_f32")?;
        let (d_i, eps_f) = (i32_arg(d, "row length")?, eps as f32);
        let (vx, vw, vb) = (ix.view::<f32>()?, iw.view::<f32>()?, ib.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vx).arg(&vw).arg(&vb).arg(&d_i).arg(&eps_f).arg(&y);
        // SAFETY: x and y hold rows × d f32, weight and bias d.
        unsafe { b.launch(row_config(rows)?) }.map_err(launch_err)?;
    }
    Ok(wrap(y, &dev, x.dims()))
}

/// Softmax over the last axis of `scale · x` on CUDA (`x` f32, made contiguous; the result in place of
/// that copy): one block a row.
pub fn softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let d = x.dim(D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    let mut y = alloc::<f32>(&dev, rows * d)?;
    if rows * d > 0 {
        let x = x.contiguous()?;
        let ix = Input::new(&x, DType::F32, "softmax input")?;
        let stream = dev.cuda_stream();
        stream
            .memcpy_dtod(&ix.view::<f32>()?, &mut y)
            .map_err(launch_err)?;
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "softmax_rows_scaled_f32")?;
        let (d_i, scale_f) = (i32_arg(d, "row length")?, scale as f32);
        let mut b = func.builder();
        b.arg(&y).arg(&d_i).arg(&scale_f);
        // SAFETY: y holds rows × d f32.
        unsafe { b.launch(row_config(rows)?) }.map_err(launch_err)?;
    }
    Ok(wrap(y, &dev, x.dims()))
}

/// The vision tower's fused `qkv` `[n, 3·heads·hd]` (f32) split into q, k, v `[heads, n, hd]`, the
/// rotary embedding (`cos`, `sin`: `[n, hd]`) applied to q and k, in one launch.
pub fn vision_qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    hd: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = cuda_device(qkv)?;
    let n = qkv.dim(0)?;
    if qkv.elem_count() != n * 3 * heads * hd
        || cos.dims() != [n, hd]
        || sin.dims() != [n, hd]
        || hd % 2 != 0
    {
        bail!(
            "vision q|k|v (cuda): {:?} with cos {:?}, sin {:?} for {heads} heads of {hd}",
            qkv.dims(),
            cos.dims(),
            sin.dims()
        );
    }
    let per = heads * n * hd;
    let (q, k, v) = (
        alloc::<f32>(&dev, per)?,
        alloc::<f32>(&dev, per)?,
        alloc::<f32>(&dev, per)?,
    );
    if per > 0 {
        let (qkv, cos, sin) = (qkv.contiguous()?, cos.contiguous()?, sin.contiguous()?);
        let (ix, ic, is) = (
            Input::new(&qkv, DType::F32, "vision q|k|v")?,
            Input::new(&cos, DType::F32, "rotary cos")?,
            Input::new(&sin, DType::F32, "rotary sin")?,
        );
        let func = load_kernel(&dev, "prism_ops", OPS_IMAGE, "vision_qkv_rope_f32")?;
        let (n_i, h_i, hd_i) = (
            i32_arg(n, "patches")?,
            i32_arg(heads, "heads")?,
            i32_arg(hd, "head dim")?,
        );
        let (vx, vc, vs) = (ix.view::<f32>()?, ic.view::<f32>()?, is.view::<f32>()?);
        let mut b = func.builder();
        b.arg(&vx).arg(&vc).arg(&vs).arg(&n_i).arg(&h_i).arg(&hd_i);
        b.arg(&q).arg(&k).arg(&v);
        // SAFETY: qkv holds n × 3·heads·hd f32, cos and sin n × hd; q, k, v heads·n·hd each.
        unsafe { b.launch(elementwise_config(3 * per)?) }.map_err(launch_err)?;
    }
    let shape = (heads, n, hd);
    Ok((
        wrap(q, &dev, shape),
        wrap(k, &dev, shape),
        wrap(v, &dev, shape),
    ))
}
