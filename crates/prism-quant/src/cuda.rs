//! The integer matmul on CUDA (feature `cuda`): launchers for `kernels/quant_gemm.cu`, the contract in
//! [`crate`]'s docs on the device.
//!
//! [`CudaQuantWeight::upload`] puts a [`QuantWeight`]'s arrays on the device; [`matmul`] quantizes an f32
//! activation per (row, run of 128) (one warp per run) and runs the integer GEMM: for Q8_0 on a
//! compute-capability-9.0 GPU the warpgroup tile `qgemm_wg_q8_0` (TMA, `wgmma`), otherwise one thread
//! per output with dp4a ([`Kernel::Simple`]). Every output of a row with finite inputs has the CPU
//! reference's bits ([`crate::kernel::matmul`]); `prism cuda-check` compares them on the device.
//!
//! A row whose input holds a NaN or ±∞ is not reported (that would need a synchronization): the
//! quantizer flags the row and every output of that row is NaN; the other rows keep their bits.

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
};
use std::sync::Arc;

use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Device, Result, Tensor};

use crate::activation::{run_count, RUN};
use crate::cuda_launch::PushArg;
use crate::cuda_launch::{
    alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input, Scratch,
};
use crate::kernel::PartSpan;
use crate::schedule::TileSchedule;
use crate::weight::{QuantWeight, WeightFormat, WeightInfo};

/// The kernels as a fatbin (kernels/build_ptx.rs).
const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/quant_gemm.fatbin"));
const MODULE: &str = "prism_quant_gemm";
/// Threads per block of both kernels.
const THREADS: u32 = 128;
/// Threads of the fused norm quantizer's block (`ADD_NORM_THREADS` in quant_gemm.cu).
const ADD_NORM_THREADS: u32 = 256;

/// A [`QuantWeight`] on a CUDA device: its arrays as they are on the host (row-major), the bytes as
/// `U8` (read as int8 by the kernels), the scales as `F32`. An array the format does not have holds one
/// unused element.
#[derive(Debug, Clone)]
pub struct CudaQuantWeight {
    info: WeightInfo,
    q: Tensor,
    sub_scales: Tensor,
    sub_mins: Tensor,
    d: Tensor,
    dmin: Tensor,
    /// Q8_0 on a Hopper GPU: the run scales run-major `[R, ldsw]` (zero past N) for the warpgroup tile.
    hopper: Option<HopperQ8>,
}

/// What the Q8_0 warpgroup tile (`qgemm_wg_q8_0`, sm_90) reads besides the bytes `q`.
#[derive(Debug, Clone)]
struct HopperQ8 {
    /// Run scales, run-major: `[R, ldsw]` f32, `ldsw` = N rounded up to 256.
    sw_t: Tensor,
    ldsw: usize,
}

/// Rows of the Hopper tile's larger shape (activation rows and weight rows alike).
const WG_TILE: usize = 128;
/// The Hopper tile's shapes (`QwTile` in quant_gemm.cu): activation rows, weight rows, kernel, dynamic
/// shared memory (stages, the 64 KiB part slot, barriers, 1,024 bytes of alignment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileShape {
    /// 128 × 128 outputs a CTA, 4 stages of 33,792 bytes.
    M128,
    /// 64 × 256 outputs a CTA, 3 stages of 43,008 bytes.
    M64,
    /// The swapped tile (`qgemm_wgs_q8_0_n32`): 32 activation rows × 64 outputs a CTA, the weight as
    /// wgmma's 64-row operand; 6 stages of 13,312 bytes, two CTAs an SM, one CTA a job
    /// ([`TileSchedule::waves`]).
    S32,
}

impl TileShape {
    fn rows(self) -> (usize, usize) {
        match self {
            TileShape::M128 => (128, 128),
            TileShape::M64 => (64, 256),
            TileShape::S32 => (32, 64),
        }
    }
    fn kernel(self) -> &'static str {
        match self {
            TileShape::M128 => "qgemm_wg_q8_0",
            TileShape::M64 => "qgemm_wg_q8_0_m64",
            TileShape::S32 => "qgemm_wgs_q8_0_n32",
        }
    }
    fn smem(self) -> usize {
        match self {
            TileShape::M128 => 4 * 33_792 + 256 * 64 * 4 + 2 * 4 * 8 + 1024,
            TileShape::M64 => 3 * 43_008 + 256 * 64 * 4 + 2 * 3 * 8 + 1024,
            // `QwsTile`: stages, the part slot (a float a register of a consumer thread), barriers.
            TileShape::S32 => 6 * 13_312 + 128 * 16 * 4 + 2 * 6 * 8 + 1024,
        }
    }
    /// Whether this is the swapped shape (160 threads, two CTAs an SM, a plain grid of jobs).
    fn swapped(self) -> bool {
        self == TileShape::S32
    }
    fn threads(self) -> u32 {
        if self.swapped() {
            WGS_THREADS
        } else {
            WG_THREADS
        }
    }

    /// The shape for `m` activation rows: 64-row tiles below 1,024 rows where 128-row ones would
    /// compute more rows (a short pass's 276: 320 rows instead of 384), 128-row ones otherwise (at
    /// 2,048 rows the 64-row shape measured 2–4 % slower, and the 8,201-row pass took 975.9 ms with it
    /// against 945.7 with 128-row tiles: `docs/optimization-log.md`).
    pub fn auto(m: usize) -> Self {
        if m < 1024 && m.div_ceil(64) * 64 < m.div_ceil(128) * 128 {
            TileShape::M64
        } else {
            TileShape::M128
        }
    }
}
/// Threads of the Hopper tile: a producer warpgroup and two consumer warpgroups.
const WG_THREADS: u32 = 384;
/// Threads of the swapped tile: a consumer warpgroup and a producer warp.
const WGS_THREADS: u32 = 160;

/// Whether `dev` runs the Hopper tile (compute capability 9.0: `wgmma`, TMA).
fn is_hopper(dev: &CudaDevice) -> Result<bool> {
    let (major, minor) = dev
        .cuda_stream()
        .context()
        .compute_capability()
        .map_err(launch_err)?;
    Ok(major == 9 && minor == 0)
}

impl CudaQuantWeight {
    /// Copies `w`'s arrays to `device`.
    pub fn upload(w: &QuantWeight, device: &CudaDevice) -> Result<Self> {
        let dev = Device::Cuda(device.clone());
        let bytes = |v: &[i8]| -> Result<Tensor> {
            let mut b: Vec<u8> = v.iter().map(|&x| x as u8).collect();
            if b.is_empty() {
                b.push(0);
            }
            let n = b.len();
            Tensor::from_vec(b, n, &dev)
        };
        let floats = |v: &[f32]| -> Result<Tensor> {
            let mut f = v.to_vec();
            if f.is_empty() {
                f.push(0.0);
            }
            let n = f.len();
            Tensor::from_vec(f, n, &dev)
        };
        let a = w.arrays();
        let hopper = if w.info().format == WeightFormat::Q8_0 && is_hopper(device)? {
            let (n, runs) = (w.rows(), run_count(w.cols()));
            // Whole tiles of 256 outputs (the 64-row shape's), so every tile's scale copy stays inside.
            let ldsw = n.div_ceil(2 * WG_TILE) * 2 * WG_TILE;
            if a.d.len() != n * runs {
                bail!(
                    "integer matmul: {:?} has {} run scales, not {n} × {runs}",
                    w.name(),
                    a.d.len()
                );
            }
            let mut t = vec![0f32; runs * ldsw];
            for (row, scales) in a.d.chunks_exact(runs).enumerate() {
                for (r, &v) in scales.iter().enumerate() {
                    t[r * ldsw + row] = v;
                }
            }
            Some(HopperQ8 {
                sw_t: Tensor::from_vec(t, runs * ldsw, &dev)?,
                ldsw,
            })
        } else {
            None
        };
        Ok(Self {
            hopper,
            info: w.info(),
            q: bytes(a.q)?,
            sub_scales: bytes(a.sub_scales)?,
            sub_mins: bytes(a.sub_mins)?,
            d: floats(a.d)?,
            dmin: floats(a.dmin)?,
        })
    }

    /// Name, format and shape.
    pub fn info(&self) -> &WeightInfo {
        &self.info
    }
}

/// `y = x · Wᵀ` for `x: [m, k]` f32 on `w`'s device: `[m, n]` f32, each output of a finite row with the
/// CPU reference's bits, each output of a row holding a NaN or ±∞ NaN.
pub fn matmul(x: &Tensor, w: &CudaQuantWeight) -> Result<Tensor> {
    matmul_with(x, w, Kernel::Auto)
}

/// Which device kernel runs a product (the same bits either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// For Q8_0: the skinny kernel up to [`AUTO_SKINNY_ROWS`] rows, the narrow one up to
    /// [`auto_narrow_rows`], past those on a compute-capability-9.0 GPU the swapped tile up to
    /// [`auto_swapped_rows`] and the Hopper warpgroup tile beyond (its shape by [`TileShape::auto`]);
    /// otherwise the simple one.
    Auto,
    /// The simple kernels (one thread an output, dp4a): the comparison for the device checks.
    Simple,
    /// The Hopper tile of this shape where it runs (Q8_0, compute capability 9.0), else the simple one;
    /// a persistent grid of one CTA a multiprocessor, scheduled by [`TileSchedule::balanced`].
    Tile(TileShape),
    /// [`Kernel::Tile`] as a plain grid, every output tile split over K into 1, 2 or 4 CTAs
    /// ([`TileSchedule::split`]; the device checks compare every split with the others).
    TileSplit(TileShape, usize),
    /// [`Kernel::Tile`] scheduled as if the GPU had this many multiprocessors (the device checks run
    /// the persistent grid's rounds and leftover splits at a few tiles).
    TileGrid(TileShape, usize),
    /// [`Kernel::Tile`] launched in the tile order of `group` (see [`tile_group`]; 1: consecutive CTAs
    /// share a weight tile): which CTA computes which tile, never what it computes.
    TileOrder(TileShape, usize),
    /// The skinny kernel where it runs (Q8_0, at most [`SKINNY_ROWS`] rows, K a multiple of 16), else
    /// the simple one. [`Kernel::Auto`] takes it up to [`AUTO_SKINNY_ROWS`] rows.
    Skinny,
    /// The narrow kernel where it runs (Q8_0, at most [`NARROW_ROWS`] rows, K a multiple of 32: tensor
    /// cores through `mma.sync`, any GPU from Ampere on), else the simple one; its split over K chosen
    /// by [`narrow_splits`].
    Narrow,
    /// [`Kernel::Narrow`] with every block of outputs split over K into 1, 2 or 4 CTAs.
    NarrowSplit(usize),
}

/// The most activation rows the narrow kernel takes (`qgemm_narrow_q8_0_m*`: tiles of 8 rows). A
/// 64-row entry measured 1.6–2× slower than the 64-row tile (H100, 2026-12-06) and was dropped.
pub const NARROW_ROWS: usize = 32;

/// The most activation rows [`Kernel::Auto`] gives the narrow kernel (past [`AUTO_SKINNY_ROWS`]); 0:
/// never. Set by [`set_auto_narrow_rows`], [`DEFAULT_AUTO_NARROW_ROWS`] before.
static AUTO_NARROW_ROWS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_AUTO_NARROW_ROWS);

/// [`auto_narrow_rows`] until [`set_auto_narrow_rows`]: measured on an H100 at the 27B's gate | up and
/// down projections, the narrow kernel in 4 splits beat the 64-row tile by 5–24 % at 3 to 16 rows
/// and lost at 32 and 64 (`docs/optimization-log.md`, 2026-12-06).
pub const DEFAULT_AUTO_NARROW_ROWS: usize = 16;

/// Makes [`Kernel::Auto`] run the narrow kernel for products of more than [`AUTO_SKINNY_ROWS`] and at
/// most `rows` rows (capped at [`NARROW_ROWS`]; 0: never) for the rest of the process.
/// Every kernel gives the same bits: this changes only speed.
pub fn set_auto_narrow_rows(rows: usize) {
    AUTO_NARROW_ROWS.store(rows.min(NARROW_ROWS), std::sync::atomic::Ordering::Relaxed);
}

/// What [`set_auto_narrow_rows`] set last.
pub fn auto_narrow_rows() -> usize {
    AUTO_NARROW_ROWS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The most activation rows [`Kernel::Auto`] gives the swapped tile ([`TileShape::S32`]; past 32
/// rows in several activation tiles), past the narrow kernel's; 0: never. Set by
/// [`set_auto_swapped_rows`], [`DEFAULT_AUTO_SWAPPED_ROWS`] before.
static AUTO_SWAPPED_ROWS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_AUTO_SWAPPED_ROWS);

/// [`auto_swapped_rows`] until [`set_auto_swapped_rows`]: measured on an H100 at the 27B's
/// projections (`docs/optimization-log.md`, 2026-12-07), the swapped tile beat or tied the 64-row
/// tile at every shape from 24 to 64 rows (gate | up 0.079–0.092 ms against 0.098–0.103, the
/// 5,120-output products 0.020–0.053 against 0.037–0.068); larger row counts were not measured.
pub const DEFAULT_AUTO_SWAPPED_ROWS: usize = 64;

/// Makes [`Kernel::Auto`] run the swapped tile for products of at most `rows` rows (capped at 64)
/// that the skinny and narrow kernels do not take, for the rest of the process (0: never). Every
/// kernel gives the same bits: this changes only speed.
pub fn set_auto_swapped_rows(rows: usize) {
    AUTO_SWAPPED_ROWS.store(rows.min(64), std::sync::atomic::Ordering::Relaxed);
}

/// What [`set_auto_swapped_rows`] set last.
pub fn auto_swapped_rows() -> usize {
    AUTO_SWAPPED_ROWS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether launches on `dev` use programmatic dependent launch now: it is on
/// ([`crate::cuda_launch::set_programmatic_launch`]) and the code the driver loaded for this GPU has the
/// grid-dependency prologue (compute capability 9.x). For reports.
pub fn programmatic_launch_in_effect(dev: &CudaDevice) -> Result<bool> {
    let kernel = load_kernel(dev, MODULE, IMAGE, "quantize_act_run128")?;
    Ok(kernel.programmatic() && crate::cuda_launch::programmatic_launch())
}

/// Warps of one narrow-kernel CTA (`NARROW_WARPS` in `quant_gemm.cu`).
const NARROW_WARPS: usize = 4;

/// The narrow kernel's entry for `m` rows (1 ≤ m ≤ [`NARROW_ROWS`]; tiles of 8 rows, 1, 2 or 4) and
/// the outputs of one of its CTAs ([`NARROW_WARPS`] warps of 16 outputs, 32 for 17 to 32 rows: one
/// activation read feeds two weight tiles).
fn narrow_kernel(m: usize) -> (&'static str, usize) {
    match m.div_ceil(8) {
        1 => ("qgemm_narrow_q8_0_m8", 16 * NARROW_WARPS),
        2 => ("qgemm_narrow_q8_0_m16", 16 * NARROW_WARPS),
        _ => ("qgemm_narrow_q8_0_m32", 32 * NARROW_WARPS),
    }
}

/// The narrow kernel's split over K for `n` outputs in blocks of `block` on `sms` multiprocessors: the
/// fewest of 1, 2, 4 CTAs a block of outputs that give at least sixteen CTAs a multiprocessor (a CTA of
/// few warps keeps few weight bytes in flight: measured on an H100 at the 27B's gate | up and down
/// projections, 4 splits were the fastest of the three at 3 to 16 rows, `docs/optimization-log.md`).
pub fn narrow_splits(n: usize, block: usize, sms: usize) -> usize {
    let blocks = n.div_ceil(block.max(1));
    [1, 2, 4]
        .into_iter()
        .find(|&s| blocks * s >= 16 * sms)
        .unwrap_or(4)
}

/// The most activation rows the skinny kernel takes (`qgemv_q8_0_m*`: 4 outputs a 128-thread CTA,
/// the weight streamed once; a product of a few rows is bound by the weight stream, where the tiles'
/// few large CTAs leave most SMs idle).
pub const SKINNY_ROWS: usize = 8;

/// The most activation rows [`Kernel::Auto`] gives the skinny kernel. Measured on an H200 at the 27B
/// projections (`docs/optimization-log.md`, 2026-12-02): at one row it reads the weights at 1.8–3.5
/// TB/s (the tiles: 0.5–2.2), at two 1.4–1.8× faster than the 64-row tile at the MLP shapes, at four
/// level with it, at eight 1.4–2.3× slower (its per-row dp4a and shuffles).
pub const AUTO_SKINNY_ROWS: usize = 2;

/// The skinny kernel's entry for `m` rows (1 ≤ m ≤ [`SKINNY_ROWS`]).
fn skinny_kernel(m: usize) -> &'static str {
    match m {
        1 => "qgemv_q8_0_m1",
        2 => "qgemv_q8_0_m2",
        3 | 4 => "qgemv_q8_0_m4",
        _ => "qgemv_q8_0_m8",
    }
}

/// [`matmul`] with the kernel chosen by `kernel`.
pub fn matmul_with(x: &Tensor, w: &CudaQuantWeight, kernel: Kernel) -> Result<Tensor> {
    product(Rows::Plain(&x.contiguous()?), w, kernel, None)
}

/// The share of a tensor-parallel product that the device holding `span` computes, on that device:
/// `x: [m, k]` f32 holds the span's input columns and `w` the same columns of the whole weight (as
/// [`crate::QuantMatmul::share_of_device`] makes them), the result `[m, n]` has the bits of the CPU's
/// [`crate::kernel::matmul_share`] (each output its parts' sums combined as the single-device tree
/// combines them below their common node), whichever kernel runs it.
pub fn matmul_share(x: &Tensor, w: &CudaQuantWeight, span: &PartSpan) -> Result<Tensor> {
    matmul_share_with(x, w, span, Kernel::Auto)
}

/// [`matmul_share`] with the kernel chosen by `kernel`.
pub fn matmul_share_with(
    x: &Tensor,
    w: &CudaQuantWeight,
    span: &PartSpan,
    kernel: Kernel,
) -> Result<Tensor> {
    product(Rows::Plain(&x.contiguous()?), w, kernel, Some(span))
}

/// A share's parts as the `_share` kernels take them (`Parts` in quant_gemm.cu): the runs where parts
/// 1, 2 and 3 begin among the share's own runs (part 0 begins at its first, part 3 ends at its last), the
/// parts it does not hold left empty at the end ([`PartSpan::local_bounds`]). A whole product's
/// kernels derive their bounds from the run count.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Parts([i32; 3]);

// SAFETY: three i32, as the kernel's `struct Parts { int b1, b2, b3; }` parameter lays them out.
unsafe impl DeviceRepr for Parts {}
// SAFETY: as for DeviceRepr above.
unsafe impl crate::cuda_launch::KernelParam for Parts {}

/// The `_share` entry of a product kernel: the same code with its parts' bounds taken as an argument
/// (quant_gemm.cu `part_start`).
fn share_entry(name: &'static str) -> Result<&'static str> {
    Ok(match name {
        "qgemm_run128_q8_0" => "qgemm_run128_q8_0_share",
        "qgemm_run128_k32" => "qgemm_run128_k32_share",
        "qgemm_run128_q6k" => "qgemm_run128_q6k_share",
        "qgemv_q8_0_m1" => "qgemv_q8_0_m1_share",
        "qgemv_q8_0_m2" => "qgemv_q8_0_m2_share",
        "qgemv_q8_0_m4" => "qgemv_q8_0_m4_share",
        "qgemv_q8_0_m8" => "qgemv_q8_0_m8_share",
        "qgemm_narrow_q8_0_m8" => "qgemm_narrow_q8_0_m8_share",
        "qgemm_narrow_q8_0_m16" => "qgemm_narrow_q8_0_m16_share",
        "qgemm_narrow_q8_0_m32" => "qgemm_narrow_q8_0_m32_share",
        "qgemm_wg_q8_0" => "qgemm_wg_q8_0_share",
        "qgemm_wg_q8_0_m64" => "qgemm_wg_q8_0_m64_share",
        "qgemm_wgs_q8_0_n32" => "qgemm_wgs_q8_0_n32_share",
        other => bail!("integer matmul: the kernel {other} has no tensor-parallel share entry"),
    })
}

impl Parts {
    /// The kernels' bounds of `span`'s parts ([`PartSpan::local_bounds`]) in a product of `runs` runs,
    /// which must be exactly the span's.
    fn of(runs: usize, span: &PartSpan) -> Result<Self> {
        let held = span.runs();
        if !span.is_subtree() || held.len() != runs {
            bail!(
                "integer matmul share: parts {:?} of a reduction of {} runs are runs {held:?}, but the \
                 product has {runs} runs",
                span.parts,
                span.total_runs
            );
        }
        let b = span.local_bounds();
        let at = |r: usize| i32_arg(r, "part bound");
        Ok(Self([at(b[1])?, at(b[2])?, at(b[3])?]))
    }
}

/// `swiglu(gate_up) · Wᵀ` for `gate_up: [m, 2f]` f32 (gate columns, then up): the bits of prism-model's
/// CUDA SwiGLU (`swiglu_f32`) followed by [`matmul`], with the SwiGLU computed by the activation
/// quantizer as it reads gate | up (no [m, f] intermediate, one launch fewer).
pub fn matmul_swiglu(gate_up: &Tensor, f: usize, w: &CudaQuantWeight) -> Result<Tensor> {
    matmul_swiglu_with(gate_up, f, w, Kernel::Auto)
}

/// [`matmul_swiglu`] with the kernel chosen by `kernel`.
pub fn matmul_swiglu_with(
    gate_up: &Tensor,
    f: usize,
    w: &CudaQuantWeight,
    kernel: Kernel,
) -> Result<Tensor> {
    let gate_up = gate_up.contiguous()?;
    let (_, width) = gate_up.dims2()?;
    if width != 2 * f {
        bail!("integer matmul: gate | up has {width} columns, not 2 × {f}");
    }
    product(Rows::SwiGlu(&gate_up, f), w, kernel, None)
}

/// `gated_rms_norm(x, gate, weight) · Wᵀ` for the DeltaNet output: `x: [m, h, 128]` f32 (contiguous),
/// `gate: [m, h·128]` f32 with unit column stride (a column range of a fused projection, read in place),
/// `weight: [128]`: the bits of prism-model's CUDA gated norm (`norm_rows_f32`, mode 1) followed by
/// [`matmul`], with the norm formed by the activation quantizer (no [m, h·128] intermediate, one launch
/// fewer). Heads of 128 values only (one run a head).
pub fn matmul_gated_norm(
    x: &Tensor,
    gate: &Tensor,
    weight: &Tensor,
    eps: f64,
    w: &CudaQuantWeight,
) -> Result<Tensor> {
    matmul_gated_norm_with(x, gate, weight, eps, w, Kernel::Auto)
}

/// [`matmul_gated_norm`] with the kernel chosen by `kernel`.
pub fn matmul_gated_norm_with(
    x: &Tensor,
    gate: &Tensor,
    weight: &Tensor,
    eps: f64,
    w: &CudaQuantWeight,
    kernel: Kernel,
) -> Result<Tensor> {
    let (m, h, d) = x.dims3()?;
    if d != RUN {
        bail!(
            "integer matmul: a gated norm of heads of {d} values (the fused quantizer takes {RUN})"
        );
    }
    if gate.dims() != [m, h * d] || gate.stride()[1] != 1 {
        bail!(
            "integer matmul: gated norm gate {:?} (strides {:?}) does not fit x {:?}",
            gate.dims(),
            gate.stride(),
            x.dims()
        );
    }
    if weight.dims() != [d] {
        bail!(
            "integer matmul: gated norm weight {:?}, not [{d}]",
            weight.dims()
        );
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    product(
        Rows::GatedNorm {
            x: &x,
            gate,
            weight: &weight,
            eps: eps as f32,
            heads: h,
        },
        w,
        kernel,
        None,
    )
}

/// `rms_norm(x + residual) · Wᵀ` for a decoder layer's next projection: `x`, `residual: [m, k]` f32
/// (`residual` `None`: the norm of `x` alone), `weight: [k]`; returns `x + residual` (when a residual is
/// given) and the product. The bits of prism-model's CUDA `add_rms_norm` (`norm_rows_block_f32`)
/// followed by [`matmul`], with the residual add and the norm formed by the activation quantizer (no
/// `[m, k]` normed intermediate, one launch fewer). `None` where that kernel does not apply: `k` not a
/// multiple of 128 or smaller than the norm kernel's block rows (1,024), or buffers not 16-byte aligned;
/// the caller then runs the norm and the product apart.
pub fn matmul_add_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
    w: &CudaQuantWeight,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    matmul_add_norm_with(x, residual, weight, eps, w, Kernel::Auto)
}

/// The shortest row the fused norm takes: prism-model's norm runs rows of at least this many values as
/// one block of 256 threads (`NORM_BLOCK_MIN_LEN`), the thread order the fused quantizer repeats.
pub const ADD_NORM_MIN_COLS: usize = 1024;

/// [`matmul_add_norm`] with the kernel chosen by `kernel`.
pub fn matmul_add_norm_with(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
    w: &CudaQuantWeight,
    kernel: Kernel,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    let (m, k) = x.dims2()?;
    if k % RUN != 0 || k < ADD_NORM_MIN_COLS {
        return Ok(None);
    }
    if let Some(r) = residual {
        if r.dims() != x.dims() {
            bail!(
                "integer matmul: norm residual {:?} does not fit x {:?}",
                r.dims(),
                x.dims()
            );
        }
    }
    if weight.dims() != [k] {
        bail!("integer matmul: norm weight {:?}, not [{k}]", weight.dims());
    }
    let x = x.contiguous()?;
    let residual = residual.map(Tensor::contiguous).transpose()?;
    let weight = weight.contiguous()?;
    let dev = cuda_device(&x)?;
    let aligned = |t: &Tensor| -> Result<bool> {
        let input = Input::new(t, DType::F32, "norm operand")?;
        let view = input.view::<f32>()?;
        let stream = dev.cuda_stream();
        let (ptr, _guard) = view.device_ptr(&stream);
        Ok(ptr % 16 == 0)
    };
    if !aligned(&x)? || !residual.as_ref().map_or(Ok(true), aligned)? || !aligned(&weight)? {
        return Ok(None);
    }
    let sum = residual
        .as_ref()
        .map(|_| alloc::<f32>(&dev, m * k))
        .transpose()?;
    let y = product(
        Rows::AddNorm {
            x: &x,
            residual: residual.as_ref(),
            sum: sum.as_ref(),
            weight: &weight,
            eps: eps as f32,
        },
        w,
        kernel,
        None,
    )?;
    Ok(Some((sum.map(|s| wrap(s, &dev, (m, k))), y)))
}

/// Where a product's activation rows come from: a contiguous `[m, k]` f32 tensor, the SwiGLU of a
/// contiguous `[m, 2k]` gate | up tensor, the DeltaNet output norm of `[m, heads, 128]` with its gate,
/// or the RMS norm of a residual sum (its sum written to `sum`).
#[derive(Clone, Copy)]
enum Rows<'a> {
    Plain(&'a Tensor),
    SwiGlu(&'a Tensor, usize),
    GatedNorm {
        x: &'a Tensor,
        gate: &'a Tensor,
        weight: &'a Tensor,
        eps: f32,
        heads: usize,
    },
    AddNorm {
        x: &'a Tensor,
        residual: Option<&'a Tensor>,
        sum: Option<&'a CudaSlice<f32>>,
        weight: &'a Tensor,
        eps: f32,
    },
}

fn product(
    rows: Rows,
    w: &CudaQuantWeight,
    kernel: Kernel,
    share: Option<&PartSpan>,
) -> Result<Tensor> {
    let (x, what) = match rows {
        Rows::Plain(x) => (x, "x"),
        Rows::SwiGlu(gu, _) => (gu, "swiglu(gate | up)"),
        Rows::GatedNorm { x, .. } => (x, "the gated norm of x"),
        Rows::AddNorm { x, .. } => (x, "the norm of x + residual"),
    };
    let dev = cuda_device(x)?;
    let m = x.dim(0)?;
    let k = match rows {
        Rows::Plain(x) | Rows::AddNorm { x, .. } => x.dims2()?.1,
        Rows::SwiGlu(_, f) => f,
        Rows::GatedNorm { heads, .. } => heads * RUN,
    };
    let (n, info) = (w.info.rows, &w.info);
    if k != info.cols {
        bail!(
            "integer matmul: {what} is [{m}, {k}] but {:?} takes {} inputs",
            info.name,
            info.cols
        );
    }
    let runs = run_count(k);
    // A share's parts' bounds, for the `_share` entries (a whole product's kernels derive them).
    let parts = share.map(|span| Parts::of(runs, span)).transpose()?;
    let entry = |name: &'static str| match parts {
        Some(_) => share_entry(name),
        None => Ok(name),
    };
    let want_sums = info.format.has_mins();
    let most_rows = match kernel {
        Kernel::Auto => AUTO_SKINNY_ROWS,
        Kernel::Skinny => SKINNY_ROWS,
        _ => 0,
    };
    let skinny =
        info.format == WeightFormat::Q8_0 && (1..=most_rows).contains(&m) && k % 16 == 0 && n > 0;
    // The narrow kernel's split over K where it runs.
    let auto_narrow = kernel == Kernel::Auto && !skinny && m <= auto_narrow_rows();
    let narrow = match kernel {
        Kernel::Narrow | Kernel::NarrowSplit(_) | Kernel::Auto
            if (kernel != Kernel::Auto || auto_narrow)
                && info.format == WeightFormat::Q8_0
                && (1..=NARROW_ROWS).contains(&m)
                && k % 32 == 0
                && n > 0 =>
        {
            Some(match kernel {
                Kernel::NarrowSplit(splits) => {
                    if ![1, 2, 4].contains(&splits) {
                        bail!("integer matmul narrow kernel: {splits} splits over K (1, 2 or 4)");
                    }
                    splits
                }
                _ => narrow_splits(n, narrow_kernel(m).1, multiprocessors(&dev)?),
            })
        }
        _ => None,
    };
    // The Hopper tile reads the activation scales run-major, [runs, ldsa] with ldsa a whole number of
    // tiles (rows past m are never stored); the simple kernels row-major [m, runs].
    let hopper = w
        .hopper
        .as_ref()
        .zip(match kernel {
            Kernel::Auto => Some((
                if m <= auto_swapped_rows() {
                    TileShape::S32
                } else {
                    TileShape::auto(m)
                },
                Grid::Balanced(None),
                None,
            )),
            Kernel::Simple | Kernel::Skinny | Kernel::Narrow | Kernel::NarrowSplit(_) => None,
            Kernel::Tile(shape) => Some((shape, Grid::Balanced(None), None)),
            Kernel::TileSplit(shape, splits) => Some((shape, Grid::Split(splits), None)),
            Kernel::TileGrid(shape, sms) => Some((shape, Grid::Balanced(Some(sms)), None)),
            Kernel::TileOrder(shape, group) => Some((shape, Grid::Balanced(None), Some(group))),
        })
        .filter(|_| m > 0 && n > 0 && !skinny && narrow.is_none());
    let ldsa = m.div_ceil(WG_TILE) * WG_TILE;
    let (sa_len, sa_row_stride, sa_run_stride) = match hopper {
        Some(_) => (runs * ldsa, 1, ldsa),
        None => (m * runs, runs, 1),
    };
    let y = alloc::<f32>(&dev, m * n)?;
    if m == 0 || n == 0 {
        return Ok(wrap(y, &dev, (m, n)));
    }
    // The tile's schedule and order, chosen before the scratch is laid out (a split tile's shares
    // live there).
    let hopper = match hopper {
        Some((h, (shape, grid, group))) => {
            let (bm, bn) = shape.rows();
            let tiles = m.div_ceil(bm) * n.div_ceil(bn);
            let schedule = match grid {
                Grid::Split(splits) => {
                    if ![1, 2, 4].contains(&splits) {
                        bail!("integer matmul tile: {splits} splits over K (1, 2 or 4)");
                    }
                    TileSchedule::split(tiles, splits)
                }
                Grid::Balanced(Some(sms)) => TileSchedule::balanced(tiles, sms),
                Grid::Balanced(None) if shape.swapped() => {
                    TileSchedule::waves(tiles, 2 * multiprocessors(&dev)?)
                }
                Grid::Balanced(None) => TileSchedule::balanced(tiles, multiprocessors(&dev)?),
            };
            let group = group.unwrap_or_else(|| tile_group(shape, m));
            Some((h, shape, schedule, group))
        }
        None => None,
    };
    let sums_len = if want_sums { m * k / 32 } else { 1 };
    let ws_len = match (hopper, narrow) {
        (Some((_, _, schedule, _)), _) if schedule.splits > 1 => schedule.splits * m * n,
        (None, Some(splits)) if splits > 1 => splits * m * n,
        _ => 1,
    };
    // The quantized activation, its scales, its 32-value sums (formats with mins), the rows' bad
    // flags (zeroed here, set by the quantizer) and a split tile's shares: this thread's scratch.
    let (at, bytes) = Scratch::layout(&[m * k, 4 * sa_len, 4 * sums_len, 4 * m, 4 * ws_len]);
    let mut scratch = Scratch::take(&dev, bytes)?;
    scratch.zero(at[3], 4 * m)?;
    let qa = scratch.view::<u8>(at[0], m * k)?;
    let sa = scratch.view::<f32>(at[1], sa_len)?;
    let sums = scratch.view::<i32>(at[2], sums_len)?;
    let bad = scratch.view::<u32>(at[3], m)?;
    let ws = scratch.view::<f32>(at[4], ws_len)?;
    let (m_i, n_i, k_i) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "outputs")?,
        i32_arg(k, "inputs")?,
    );
    let grid = |units: usize, what: &str| -> Result<u32> {
        u32::try_from(units.div_ceil(THREADS as usize))
            .map_err(|_| candle_core::Error::Msg(format!("{what}: too many for one launch")))
    };
    // The activation quantizer: one warp a (row, run); a gated norm's runs are its heads.
    let cfg = LaunchConfig {
        grid_dim: (grid(32 * m * runs, "activation runs")?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let want = i32::from(want_sums);
    let (rs, cs) = (
        i32_arg(sa_row_stride, "scale row stride")?,
        i32_arg(sa_run_stride, "scale run stride")?,
    );
    if let Rows::GatedNorm {
        gate,
        weight,
        eps,
        heads,
        ..
    } = rows
    {
        let xi = Input::new(x, DType::F32, "gated norm input")?;
        let xv = xi.view::<f32>()?;
        let g_stride = gate.stride()[0];
        let gi = Input::spanning(
            gate,
            DType::F32,
            "gated norm gate",
            (m - 1) * g_stride + heads * RUN,
        )?;
        let gv = gi.view::<f32>()?;
        let wi = Input::new(weight, DType::F32, "gated norm weight")?;
        let wv = wi.view::<f32>()?;
        let func = load_kernel(&dev, MODULE, IMAGE, "quantize_act_gated_norm_run128")?;
        let (g_stride_i, heads_i) = (g_stride as i64, i32_arg(heads, "heads")?);
        let mut b = func.builder();
        b.arg(&xv).arg(&gv).arg(&g_stride_i).arg(&wv).arg(&eps);
        b.arg(&m_i)
            .arg(&heads_i)
            .arg(&qa)
            .arg(&sa)
            .arg(&rs)
            .arg(&cs);
        b.arg(&sums).arg(&want).arg(&bad);
        // SAFETY: x holds m·heads·128 f32; the gate view spans its m rows (g_stride apart, heads·128
        // each); the weight 128 f32; qa m·k bytes, sa m·runs f32 at the strides given, sums m·k/32 i32
        // when asked, bad m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    } else if let Rows::AddNorm {
        residual,
        sum,
        weight,
        eps,
        ..
    } = rows
    {
        let xi = Input::new(x, DType::F32, "norm input")?;
        let xv = xi.view::<f32>()?;
        let ri = residual
            .map(|r| Input::new(r, DType::F32, "norm residual"))
            .transpose()?;
        let rv = ri.as_ref().map(|r| r.view::<f32>()).transpose()?;
        let wi = Input::new(weight, DType::F32, "norm weight")?;
        let wv = wi.view::<f32>()?;
        let func = load_kernel(&dev, MODULE, IMAGE, "quantize_act_add_norm_run128")?;
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&xv);
        match &rv {
            Some(rv) => b.arg(rv),
            None => b.arg(&null),
        };
        match sum {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(&wv).arg(&eps).arg(&m_i).arg(&k_i);
        b.arg(&qa).arg(&sa).arg(&rs).arg(&cs);
        b.arg(&sums).arg(&want).arg(&bad);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(m).map_err(|_| {
                    candle_core::Error::Msg("norm rows: too many for one launch".into())
                })?,
                1,
                1,
            ),
            block_dim: (ADD_NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x (and the residual, and the sum when given) hold m·k contiguous f32, 16-byte aligned
        // (checked by matmul_add_norm_with), the weight k f32; k a multiple of 128; qa m·k bytes, sa
        // m·runs f32 at the strides given, sums m·k/32 i32 when asked, bad m u32; one block a row.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    } else {
        let xi = Input::new(x, DType::F32, "integer matmul input")?;
        let xv = xi.view::<f32>()?;
        let name = match rows {
            Rows::SwiGlu(..) => "quantize_act_swiglu_run128",
            _ => "quantize_act_run128",
        };
        let func = load_kernel(&dev, MODULE, IMAGE, name)?;
        let gu_stride = (2 * k) as i64;
        let mut b = func.builder();
        b.arg(&xv);
        if let Rows::SwiGlu(..) = rows {
            b.arg(&gu_stride);
        }
        b.arg(&m_i).arg(&k_i).arg(&qa).arg(&sa).arg(&rs).arg(&cs);
        b.arg(&sums).arg(&want).arg(&bad);
        // SAFETY: x holds m·k f32 (SwiGLU: m·2k, rows 2k apart); qa m·k bytes, sa m·runs f32 at the
        // strides given (row < m and run < runs index inside sa_len), sums m·k/32 i32 when asked, bad
        // m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    if let Some((h, shape, schedule, group)) = hopper {
        hopper_q8_0(
            &dev,
            TileBuffers {
                qa: &qa,
                sa: &sa,
                ldsa,
                bad: &bad,
                ws: &ws,
                y: &y,
            },
            w,
            h,
            shape,
            (schedule, group, parts),
            (m, n, k),
        )?;
        return Ok(wrap(y, &dev, (m, n)));
    }
    if let Some(splits) = narrow {
        let (wq, wd) = (
            Input::new(&w.q, DType::U8, "weight bytes")?,
            Input::new(&w.d, DType::F32, "scales")?,
        );
        let (wq, wd) = (wq.view::<u8>()?, wd.view::<f32>()?);
        check_aligned(&dev, &wq, info)?;
        let (name, block) = narrow_kernel(m);
        let func = load_kernel(&dev, MODULE, IMAGE, entry(name)?)?;
        let blocks = n.div_ceil(block);
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).map_err(|_| {
                    candle_core::Error::Msg(format!("integer matmul: {n} outputs are too many"))
                })?,
                splits as u32,
                1,
            ),
            block_dim: ((32 * NARROW_WARPS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let splits_i = i32_arg(splits, "splits")?;
        with_counters(&dev, blocks, |counters| {
            let mut b = func.builder();
            b.arg(&qa).arg(&sa).arg(&bad).arg(&wq).arg(&wd);
            b.arg(&m_i).arg(&n_i).arg(&k_i).arg(&y);
            b.arg(&ws).arg(&splits_i).arg(counters);
            if let Some(parts) = &parts {
                b.arg(parts);
            }
            // SAFETY: qa holds m·k bytes (k a multiple of 32, so every 16-byte read of a row is
            // aligned and inside it), sa m·runs f32 row-major, bad m u32; the weight's q n·k bytes
            // (16-byte aligned) and d n·runs f32 (Q8_0 run scales, row-major); y m·n f32; with
            // splits, ws splits·m·n f32 and the counters at least one u32 a block of outputs, all
            // zero (this stream's own set: its launches run in order, and each leaves them zero).
            unsafe { b.launch(cfg) }.map_err(launch_err)?;
            Ok(())
        })?;
        return Ok(wrap(y, &dev, (m, n)));
    }
    if skinny {
        let (wq, wd) = (
            Input::new(&w.q, DType::U8, "weight bytes")?,
            Input::new(&w.d, DType::F32, "scales")?,
        );
        let (wq, wd) = (wq.view::<u8>()?, wd.view::<f32>()?);
        check_aligned(&dev, &wq, info)?;
        let func = load_kernel(&dev, MODULE, IMAGE, entry(skinny_kernel(m))?)?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(n.div_ceil(4)).map_err(|_| {
                    candle_core::Error::Msg(format!("integer matmul: {n} outputs are too many"))
                })?,
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&qa).arg(&sa).arg(&bad).arg(&wq).arg(&wd);
        b.arg(&m_i).arg(&n_i).arg(&k_i).arg(&y);
        if let Some(parts) = &parts {
            b.arg(parts);
        }
        // SAFETY: qa holds m·k bytes (k a multiple of 16, so every 16-byte read of a row is aligned and
        // inside it), sa m·runs f32 row-major, bad m u32; the weight's q n·k bytes and d n·runs f32
        // (Q8_0 run scales, row-major); y m·n f32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        return Ok(wrap(y, &dev, (m, n)));
    }
    let name = match info.format {
        WeightFormat::Q8_0 => "qgemm_run128_q8_0",
        WeightFormat::Q4K | WeightFormat::Q5K => "qgemm_run128_k32",
        WeightFormat::Q6K => "qgemm_run128_q6k",
    };
    if m > 65_535 {
        bail!("integer matmul: {m} rows are more than one launch takes (65,535)");
    }
    let (wq, wsc, wmn) = (
        Input::new(&w.q, DType::U8, "weight bytes")?,
        Input::new(&w.sub_scales, DType::U8, "sub-block scales")?,
        Input::new(&w.sub_mins, DType::U8, "sub-block mins")?,
    );
    let (wd, wdm) = (
        Input::new(&w.d, DType::F32, "scales")?,
        Input::new(&w.dmin, DType::F32, "min scales")?,
    );
    let (wq, wsc, wmn) = (wq.view::<u8>()?, wsc.view::<u8>()?, wmn.view::<u8>()?);
    let (wd, wdm) = (wd.view::<f32>()?, wdm.view::<f32>()?);
    let func = load_kernel(&dev, MODULE, IMAGE, entry(name)?)?;
    let cfg = LaunchConfig {
        grid_dim: (grid(n, "outputs")?, m as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&qa).arg(&sa).arg(&sums).arg(&bad);
    b.arg(&wq).arg(&wd).arg(&wdm).arg(&wsc).arg(&wmn);
    b.arg(&m_i).arg(&n_i).arg(&k_i).arg(&y);
    if let Some(parts) = &parts {
        b.arg(parts);
    }
    // SAFETY: the activation buffers as written above; the weight arrays as uploaded (row-major, the
    // layout of QuantWeight); y holds m·n f32.
    unsafe { b.launch(cfg) }.map_err(launch_err)?;
    Ok(wrap(y, &dev, (m, n)))
}

/// How the Hopper tile's grid is scheduled (see [`TileSchedule`]).
#[derive(Debug, Clone, Copy)]
enum Grid {
    /// [`TileSchedule::balanced`] on this many multiprocessors (`None`: the device's).
    Balanced(Option<usize>),
    /// [`TileSchedule::split`]: a plain grid, every tile split this many ways.
    Split(usize),
}

/// The device's multiprocessors (the persistent grid's CTAs: one each, the tile's shared memory
/// allows no second).
fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(&s) = SMS.get() {
        return Ok(s);
    }
    let count = dev
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(launch_err)?;
    Ok(*SMS.get_or_init(|| usize::try_from(count).unwrap_or(1).max(1)))
}

/// The order in which the Hopper tile's grid walks its tiles: `group` weight tiles for each activation
/// tile. 1 (consecutive CTAs share a weight tile) below 16 activation tiles, 16 from there on: measured on
/// an H200 (`docs/optimization-log.md`, 2026-12-04), at 8,201 rows 643 / 647 TOPS in order 1 against 689
/// / 678 in order 16 (gate|up, down), at 16,384 rows 588 against 684 (the activations no longer stay in
/// L2 when every weight tile passes them all), at 2,048 rows level.
pub fn tile_group(shape: TileShape, m: usize) -> usize {
    let (bm, _) = shape.rows();
    if m.div_ceil(bm) >= 16 {
        16
    } else {
        1
    }
}

/// The buffers of one Hopper tile product: the quantized activation `qa` with its run scales `sa`
/// (run-major, `ldsa` rows a run), the rows' bad flags, the split CTAs' shares of the part tree
/// `[splits, m, n]` (unused without a split) and the output `y`.
struct TileBuffers<'a, 'b> {
    qa: &'a CudaView<'b, u8>,
    sa: &'a CudaView<'b, f32>,
    ldsa: usize,
    bad: &'a CudaView<'b, u32>,
    ws: &'a CudaView<'b, f32>,
    y: &'a CudaSlice<f32>,
}

/// The Q8_0 warpgroup tile (`qgemm_wg_q8_0`): `y = qa · qᵀ` by the contract, `qa` `[m, k]` bytes with
/// run scales `sa` run-major `[runs, ldsa]`, its tiles' jobs on CTAs as `schedule` says; with a share's
/// `parts`, its `_share` entry.
fn hopper_q8_0(
    dev: &CudaDevice,
    TileBuffers {
        qa,
        sa,
        ldsa,
        bad,
        ws,
        y,
    }: TileBuffers,
    w: &CudaQuantWeight,
    h: &HopperQ8,
    shape: TileShape,
    (schedule, group, parts): (TileSchedule, usize, Option<Parts>),
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    let splits = schedule.splits;
    if ![1, 2, 4].contains(&splits) {
        bail!("integer matmul tile: {splits} splits over K (1, 2 or 4)");
    }
    if group == 0 {
        bail!("integer matmul tile: a tile order of 0 weight tiles a group");
    }
    let (bm, bn) = shape.rows();
    let too_many = |what: String| candle_core::Error::Msg(format!("integer matmul: {what}"));
    let (gx, gy) = (m.div_ceil(bm), n.div_ceil(bn));
    let wq = Input::new(&w.q, DType::U8, "weight bytes")?;
    let wq = wq.view::<u8>()?;
    let sw = Input::new(&h.sw_t, DType::F32, "weight run scales")?;
    let sw = sw.view::<f32>()?;
    let stream = dev.cuda_stream();
    let (qa_ptr, _qa_sync) = qa.device_ptr(&stream);
    let (wq_ptr, _wq_sync) = wq.device_ptr(&stream);
    let maps = [
        byte_rows_map(qa_ptr, m, k, bm)?,
        byte_rows_map(wq_ptr, n, k, bn)?,
    ];
    let name = match parts {
        Some(_) => share_entry(shape.kernel())?,
        None => shape.kernel(),
    };
    let func = load_kernel(dev, MODULE, IMAGE, name)?;
    func.allow_dynamic_shared(shape.smem(), "integer matmul tile")?;
    let tiles = gx * gy;
    let jobs = schedule.jobs(tiles);
    let ctas = u32::try_from(schedule.ctas.clamp(1, jobs.max(1)))
        .map_err(|_| too_many(format!("{} CTAs", schedule.ctas)))?;
    let cfg = LaunchConfig {
        grid_dim: (ctas, 1, 1),
        block_dim: (shape.threads(), 1, 1),
        shared_mem_bytes: shape.smem() as u32,
    };
    if splits > 1 && ws.len() < splits * m * n {
        bail!(
            "integer matmul tile: {} share slots for {splits} splits of [{m}, {n}]",
            ws.len()
        );
    }
    let (ldsa_i, ldsw_i) = (i32_arg(ldsa, "scale rows")?, i32_arg(h.ldsw, "scale rows")?);
    let (m_i, n_i, k_i) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "outputs")?,
        i32_arg(k, "inputs")?,
    );
    with_counters(dev, tiles, |counter_buf| {
        let mut b = func.builder();
        b.arg(&maps[0]).arg(&maps[1]);
        b.arg(sa).arg(&ldsa_i).arg(&sw).arg(&ldsw_i).arg(bad);
        let group_i = i32_arg(group, "tile order")?;
        b.arg(&m_i)
            .arg(&n_i)
            .arg(&k_i)
            .arg(y)
            .arg(ws)
            .arg(&group_i)
            .arg(counter_buf);
        let (gx_i, gy_i) = (i32_arg(gx, "row tiles")?, i32_arg(gy, "output tiles")?);
        let (full_i, splits_i, jobs_i) = (
            i32_arg(schedule.full, "whole tiles")?,
            i32_arg(splits, "splits")?,
            i32_arg(jobs, "jobs")?,
        );
        b.arg(&gx_i)
            .arg(&gy_i)
            .arg(&full_i)
            .arg(&splits_i)
            .arg(&jobs_i);
        if let Some(parts) = &parts {
            b.arg(parts);
        }
        // SAFETY: the maps describe qa (m·k bytes) and the weight (n·k bytes), both alive until the launch
        // is queued; sa holds runs·ldsa f32 and sw_t runs·ldsw (ldsa, ldsw whole tiles, so every CTA's
        // 512-byte scale copies stay inside); bad m u32; y m·n f32; with splits, ws splits·m·n f32 (a
        // split tile's job z writes its outputs of ws[z]) and the counters at least one u32 a tile, all
        // zero (this stream's own set: its launches run in order, and each leaves them zero); the jobs
        // are those of `schedule` over gx·gy tiles.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(())
    })
}

/// Runs `launch` with this thread's split counters for `dev`'s stream, at least `count` of them: they
/// stay allocated (and zero between launches: the last CTA of a split tile or block resets its own),
/// so a split product is one launch. Kept per (thread, stream) as [`Scratch`] is: candle's device
/// launches on the per-thread default stream, so two threads with one `CudaDevice` (engine replicas on
/// one GPU, the devices of a tensor-parallel group sharing one) run on two streams, and one set of
/// counters shared by both would mix their tiles' counts.
fn with_counters(
    dev: &CudaDevice,
    count: usize,
    launch: impl FnOnce(&CudaSlice<u32>) -> Result<()>,
) -> Result<()> {
    let stream_key = Arc::as_ptr(&dev.cuda_stream()) as usize;
    TILE_COUNTERS.with(|counters| {
        let mut slot = counters.try_borrow_mut().map_err(|_| {
            candle_core::Error::Msg("integer matmul: tile counters already in use".into())
        })?;
        let at = match slot.iter().position(|(key, _)| *key == stream_key) {
            Some(at) => at,
            None => {
                slot.push((stream_key, dev.alloc_zeros::<u32>(1)?));
                slot.len() - 1
            }
        };
        if slot[at].1.len() < count {
            slot[at].1 = dev.alloc_zeros::<u32>(count.next_power_of_two())?;
        }
        launch(&slot[at].1)
    })
}

/// Fails unless the weight bytes start 16-byte aligned on the device (the kernels' vector reads).
fn check_aligned(dev: &CudaDevice, wq: &CudaView<'_, u8>, info: &WeightInfo) -> Result<()> {
    let stream = dev.cuda_stream();
    let (ptr, _sync) = wq.device_ptr(&stream);
    if ptr % 16 != 0 {
        bail!(
            "integer matmul: {:?}'s bytes are not 16-byte aligned on the device",
            info.name
        );
    }
    Ok(())
}

thread_local! {
    /// Per (this thread, CUDA stream), the split products' per-tile counters (see [`with_counters`]):
    /// a stream's launches run in order, so one set serves all of them.
    static TILE_COUNTERS: std::cell::RefCell<Vec<(usize, CudaSlice<u32>)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A `CUtensorMap` as a kernel argument (`TmaDesc` in quant_gemm.cu: 128 opaque bytes passed by value
/// as a `__grid_constant__` parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorMapArg(sys::CUtensorMap);

// SAFETY: plain bytes the driver copies into the kernel's parameter space.
unsafe impl DeviceRepr for TensorMapArg {}
// SAFETY: as for DeviceRepr above.
unsafe impl crate::cuda_launch::KernelParam for TensorMapArg {}

/// The TMA map of a row-major `[rows, k]` byte matrix at `ptr`, read in boxes of 128 bytes of K by
/// `box_rows` (≤ 256) rows with the 128-byte swizzle (16-byte chunk c of row r lands at chunk c ^ (r & 7):
/// the layout `wgmma` reads). Rows past `rows` and bytes past `k` read as zeros.
fn byte_rows_map(
    ptr: sys::CUdeviceptr,
    rows: usize,
    k: usize,
    box_rows: usize,
) -> Result<TensorMapArg> {
    use sys::{
        CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
        CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    if k % 16 != 0 {
        bail!("integer matmul tile: rows of {k} bytes are not a multiple of 16");
    }
    let dims = [k as u64, rows as u64];
    let strides = [k as u64];
    let boxes = [128u32, u32::try_from(box_rows.min(256)).unwrap_or(256)];
    let element_strides = [1u32, 1];
    let mut map = TensorMapArg(sys::CUtensorMap { opaque: [0; 16] });
    // SAFETY: the driver writes the 128-byte map; every array has rank 2 (strides rank − 1) elements.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map.0,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        bail!("integer matmul tile: no TMA map for a [{rows}, {k}] byte matrix ({status:?})");
    }
    Ok(map)
}
