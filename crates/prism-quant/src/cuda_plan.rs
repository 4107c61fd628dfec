//! The host side of the CUDA integer matmul (`kernels/quant_gemm.cu`, launched by `cuda.rs` under the
//! `cuda` feature), kept free of CUDA so CI tests it: which kernel family and instantiation runs a
//! format, its tile and shared memory, how many part groups a launch splits the reduction into, the grid
//! order, the shape checks, and the flat arrays a [`QuantWeight`] uploads.
//!
//! Two tensor-core families compute the same bits:
//! - **v1** (`qgemm_*_64x64`): the first kernel, 64×64 CTA tiles of 4 warps, the part tree in
//!   registers. Kept as a plan option and as the comparison (`PRISM_QGEMM=v1`).
//! - **v2** (`qgemm2_*`): 64×128 and 128×128 CTA tiles of 8 warps, stages aligned to parts, one running
//!   float per output in registers and the closed parts in memory, a rasterized grid. The default.
//!
//! The part groups: a launch with `G` groups (1, 2 or 4) gives each CTA `4 / G` of the reduction's four
//! parts; `G > 1` writes per-group partial results that a second kernel folds with the documented tree.
//! The arithmetic of every output is the same for every family, tile and `G` (the tests below replay
//! both kernels' walks on the CPU and compare with [`crate::kernel::matmul_quantized`] bit for bit), so
//! these are only questions of filling the GPU.

use crate::error::{QuantError, Result};
use crate::weight::{QuantWeight, WeightFormat, WeightInfo};

/// Threads per CTA of the v1 tensor-core kernels (4 warps, 2 × 2, each 32 × 32 outputs).
pub const TC_THREADS: u32 = 128;
/// Threads per CTA of the v2 tensor-core kernels (8 warps, 2 × 4).
pub const TC2_THREADS: u32 = 256;
/// Threads per CTA of the plain one-thread-per-output kernel and of the element-wise kernels.
pub const SIMT_THREADS: u32 = 256;

/// The environment variable that picks the default tensor-core family (`v1` or `v2`; unset: `v2`).
pub const FAMILY_ENV: &str = "PRISM_QGEMM";

/// A family of tensor-core kernels. Every family returns the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// The first kernel: 64×64 tiles.
    V1,
    /// Larger tiles, part-aligned stages, tree state in memory.
    #[default]
    V2,
}

/// The family named by [`FAMILY_ENV`]'s value (`None`: unset). Anything but `v1` / `v2` (any case,
/// surrounding blanks ignored, empty = unset) is an error naming the variable and the value.
pub fn parse_family(value: Option<&str>) -> Result<Family> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("v2") => Ok(Family::V2),
        Some("v1") => Ok(Family::V1),
        Some(other) => Err(QuantError::Input(format!(
            "{FAMILY_ENV}={other:?}: expected \"v1\" (the 64×64 kernels) or \"v2\" (the default)"
        ))),
    }
}

/// The CTA tile of a v2 instantiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V2Tile {
    /// 64 activation rows × 128 outputs, warp tiles 32×32, sized for 2 CTAs per SM.
    T64x128,
    /// 128 × 128, warp tiles 64×32, one CTA per SM.
    T128x128,
    /// Q8_0: the 8 compute warps of [`V2Tile::T128x128`] plus a producer warpgroup that issues every
    /// copy, stages handed over by mbarriers instead of CTA barriers. Other formats: T128x128.
    T128x128Ws,
    /// Q8_0: [`V2Tile::T128x128Ws`] with 96 activation rows (warp tiles 48×32), for the few hundred
    /// rows of a decision pass, which leave a 128-row grid's last tile mostly empty. Other formats:
    /// T128x128.
    T96x128Ws,
    /// Q8_0 on Hopper: [`V2Tile::T128x128Ws`] whose producers copy A and B by TMA (one tensor copy per
    /// stage and matrix, issued by one thread) instead of `cp.async`. Other formats: T128x128.
    T128x128Tma,
    /// Q8_0 on Hopper: [`V2Tile::T96x128Ws`] with TMA copies. Other formats: T128x128.
    T96x128Tma,
    /// Q4_K / Q5_K on Hopper (sm_90a): [`V2Tile::T128x128Tma`]'s producers and stages, 128 activation
    /// rows × 64 outputs, two consumer warpgroups of 64 × 64 on warpgroup MMA (`wgmma`) instead of
    /// `mma.sync`, on weight planes: the consumers split each stage's weights q into q·hi and q·lo
    /// (sub-block scale = 8·hi + lo) and the tensor cores sum whole blocks, with no integer
    /// multiply-add per 32-slice. Other formats: T128x128Tma (Q6_K's sub-blocks of 16 are shorter than
    /// wgmma's k = 32; Q8_0's contract measured no faster on wgmma, docs/benchmarks.md).
    T128x64Wgp,
    /// Q8_0 on Hopper (sm_90a) by the **chained** reduction ([`crate::chain`], not the engine's
    /// contract: its outputs are checked against [`crate::chain::matmul_chained`]): the TMA tiles'
    /// producers and stages, 128 × 128, two consumer warpgroups of 64 × 128 on `wgmma`, one FFMA an
    /// output and block. Needs the weight uploaded with its chain tables
    /// (`CudaQuantWeight::upload_chained`). Other formats: T128x128Tma.
    T128x128Wgc,
}

impl V2Tile {
    // Measured and dropped on 2026-11-30 (docs/benchmarks.md): a 16-warp 128×128 tile (warp tiles
    // 32×32, 128 registers) and Q8_0 stages of 256 bytes; neither beat T128x128. Seventh session:
    // the TMA tiles with 12 / 16 compute warps of 32×32 (96 / 128 rows): 0.97–1.03× T96x128Tma /
    // T128x128Tma.
    pub const ALL: [V2Tile; 7] = [
        V2Tile::T64x128,
        V2Tile::T128x128,
        V2Tile::T128x128Ws,
        V2Tile::T96x128Ws,
        V2Tile::T128x128Tma,
        V2Tile::T96x128Tma,
        V2Tile::T128x64Wgp,
    ];

    /// The tiles whose outputs follow the chained reduction instead of the contract (not in
    /// [`V2Tile::ALL`], which every kernel choice must agree on bit for bit).
    pub const CHAINED: [V2Tile; 1] = [V2Tile::T128x128Wgc];

    /// Whether the tile computes `format` by the chained reduction ([`crate::chain`]).
    pub fn chained(self, format: WeightFormat) -> bool {
        self == V2Tile::T128x128Wgc && format == WeightFormat::Q8_0
    }

    /// Whether the automatic plan ([`choose_v2`]) considers the tile. The wgmma tile is explicit only:
    /// on an H200 it measured 0.99–1.05× the K-quant TMA tiles (docs/benchmarks.md, 2026-11-30, fifth
    /// session), too close for the cost model to tell where it wins.
    pub fn automatic(self) -> bool {
        !matches!(self, V2Tile::T128x64Wgp | V2Tile::T128x128Wgc)
    }
}

/// Which kernel computes the integer matmul. Every choice returns the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmKernel {
    /// The family of [`FAMILY_ENV`] (default v2), tile and part groups chosen from the shape.
    #[default]
    Auto,
    /// A given family, tile and part groups chosen from the shape.
    AutoFamily(Family),
    /// v1 with a fixed number of part groups (1, 2 or 4).
    TensorCore { part_groups: u32 },
    /// v2 with a fixed tile and number of part groups; with `part_groups == 1`, `tail_cols > 0` runs
    /// the last `tail_cols` tile columns of the last raster group split in four ([`TailSplit`]).
    V2 {
        tile: V2Tile,
        part_groups: u32,
        tail_cols: u32,
    },
    /// One thread per output, plain integer loops: the second oracle.
    Simt,
    /// A Q8_0 warp-specialized `mma.sync` tile (`T128x128Ws`, `T96x128Ws`, `T128x128Tma`, `T96x128Tma`)
    /// with one part group and **persistent CTAs**: as many CTAs as fit the GPU at once, each walking
    /// the tiles `i, i + grid, …` in raster order, so a tile's part ends overlap the next tile's first
    /// loads. The same bits as every other choice. (Not the K-quants: the tile loop made their TMA tile
    /// spill and lose 8–11 % when not persistent, more than persistence gained.)
    V2Persistent { tile: V2Tile },
}

/// One tensor-core kernel instantiation (must match the template arguments in quant_gemm.cu).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TilePlan {
    /// The `extern "C"` name in quant_gemm.cu.
    pub kernel: &'static str,
    pub family: Family,
    /// Activation rows per CTA.
    pub bm: usize,
    /// Weight rows (outputs) per CTA.
    pub bn: usize,
    /// Bytes of the reduction per pipeline stage.
    pub bk: usize,
    pub stages: usize,
    pub threads: u32,
    /// Dynamic shared memory of a CTA.
    pub smem_bytes: usize,
    /// CTAs per SM the instantiation is built for (its `__launch_bounds__` minimum).
    pub ctas_per_sm: usize,
    /// Built for sm_90a only: the warp-specialized tile hands the producers' registers to the
    /// compute warps with `setmaxnreg`; elsewhere its compute warps would spill. Never planned on
    /// an older GPU.
    pub hopper_only: bool,
    /// The kernel takes tensor maps of the activations and weights (`cuTensorMapEncodeTiled`, 128-byte
    /// swizzle, boxes of `bk` bytes × `bm` / `bn` rows) after its other arguments.
    pub tma: bool,
    /// Cost-model guess: multiply-adds per SM and clock when every SM is full of these CTAs (not
    /// measured on this tile yet; `prism cuda-quant-check` prints the model next to the timings).
    pub macs_per_sm_clock: f64,
    /// The kernel keeps G = 1's closed parts in shared memory (`SLOT` in quant_gemm.cu): its launch
    /// needs no `[M, N]` scratch buffer.
    pub scratch_in_smem: bool,
}

/// The `Smem<FMT, BM, BN, ALIGN>::STAGE` size of quant_gemm.cu: A and B tiles, the block scales and, for
/// the K-quants, the sub-block scales / mins / activation sums of one stage, rounded up to 128 bytes
/// (TMA tiles: to 1,024, see [`v2_tile_plan`]).
fn stage_bytes(format: WeightFormat, bm: usize, bn: usize, bk: usize) -> usize {
    let blocks_per_stage = bk / format.block_len();
    let mut bytes = bm * bk + bn * bk + 4 * blocks_per_stage * bn;
    match format {
        WeightFormat::Q8_0 => {}
        WeightFormat::Q4K | WeightFormat::Q5K => bytes += 4 * bn + 8 * bn + 8 * bn + 4 * bm * 8,
        WeightFormat::Q6K => bytes += 16 * bn,
    }
    bytes.div_ceil(128) * 128
}

/// Bytes of the reduction per stage: Q8_0 four blocks of 32, K-quants one block of 256.
fn stage_k(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q8_0 => 128,
        _ => 256,
    }
}

/// The v1 instantiation for a weight format.
pub fn v1_tile_plan(format: WeightFormat) -> TilePlan {
    let (kernel, stages) = match format {
        WeightFormat::Q8_0 => ("qgemm_q8_0_64x64", 4),
        WeightFormat::Q4K | WeightFormat::Q5K => ("qgemm_k32_64x64", 3),
        WeightFormat::Q6K => ("qgemm_q6k_64x64", 3),
    };
    let (bm, bn, bk) = (64, 64, stage_k(format));
    TilePlan {
        kernel,
        family: Family::V1,
        bm,
        bn,
        bk,
        stages,
        threads: TC_THREADS,
        smem_bytes: stages * stage_bytes(format, bm, bn, bk),
        ctas_per_sm: 1,
        hopper_only: false,
        tma: false,
        macs_per_sm_clock: 250.0,
        scratch_in_smem: false,
    }
}

/// The v2 instantiation of `tile` for a weight format (`qgemm2_*` in quant_gemm.cu).
pub fn v2_tile_plan(format: WeightFormat, tile: V2Tile) -> TilePlan {
    use WeightFormat::*;
    // (kernel, bm, bn, stages, CTAs per SM, guessed MAC / SM / clock)
    let (kernel, bm, bn, stages, ctas_per_sm, rate) = match (format, tile) {
        (Q8_0, V2Tile::T64x128) => ("qgemm2_q8_0_64x128", 64, 128, 4, 2, 700.0),
        (Q8_0, V2Tile::T128x128) => ("qgemm2_q8_0_128x128", 128, 128, 4, 1, 900.0),
        (Q4K | Q5K, V2Tile::T64x128) => ("qgemm2_k32_64x128", 64, 128, 2, 2, 550.0),
        (Q4K | Q5K, V2Tile::T128x128) => ("qgemm2_k32_128x128", 128, 128, 2, 1, 700.0),
        (Q6K, V2Tile::T64x128) => ("qgemm2_q6k_64x128", 64, 128, 2, 2, 500.0),
        (Q6K, V2Tile::T128x128) => ("qgemm2_q6k_128x128", 128, 128, 2, 1, 650.0),
        // Measured 7–13 % faster than T128x128 on an H200 (docs/benchmarks.md, 2026-11-30).
        (Q8_0, V2Tile::T128x128Ws) => ("qgemm2_q8_0_128x128ws", 128, 128, 4, 1, 1000.0),
        // Measured at M = 275 (2026-11-30): 6–7 % faster than 128×128 ws on 27B's gate|up and down
        // shapes, 9 % slower on a 17,408-wide one; at M = 1 slower than 64×128 (0.116 / 0.097 ms).
        (Q8_0, V2Tile::T96x128Ws) => ("qgemm2_q8_0_96x128ws", 96, 128, 4, 1, 900.0),
        // Measured 10–14 % faster than their cp.async twins on an H200 (docs/benchmarks.md,
        // 2026-11-30, third session): the default Q8_0 tiles on Hopper.
        (Q8_0, V2Tile::T128x128Tma) => ("qgemm2_q8_0_128x128tma", 128, 128, 4, 1, 1100.0),
        (Q8_0, V2Tile::T96x128Tma) => ("qgemm2_q8_0_96x128tma", 96, 128, 4, 1, 990.0),
        // K-quants, warp-specialized with TMA: 2 stages of one 256-element block and the closed
        // part's slot (3 stages without it until the sixth session), fragments of the next 32-slice
        // loaded while the current one is in the tensor cores. Measured 1.00–1.10×
        // (Q4_K) and 1.20–1.25× (Q6_K) T128x128 on an H200 (2026-11-30, third session). The 96-row
        // twins measured 1.2–1.3× the 128-row tiles at M = 275; at 600 the plan takes them there and
        // not at M ≤ 64, where they lost 19–36 % (`tools/qgemm_plan_fit.py`, the sweep of 520455f).
        (Q4K | Q5K, V2Tile::T128x128Tma) => ("qgemm2_k32_128x128tma", 128, 128, 2, 1, 770.0),
        (Q4K | Q5K, V2Tile::T96x128Tma) => ("qgemm2_k32_96x128tma", 96, 128, 2, 1, 600.0),
        (Q6K, V2Tile::T128x128Tma) => ("qgemm2_q6k_128x128tma", 128, 128, 2, 1, 780.0),
        (Q6K, V2Tile::T96x128Tma) => ("qgemm2_q6k_96x128tma", 96, 128, 2, 1, 600.0),
        // Warpgroup MMA (explicit only, see `V2Tile::automatic`): measured 0.99–1.05× the 128×128
        // TMA tile on an H200 (docs/benchmarks.md, 2026-11-30, fifth session), so the same rate.
        (Q4K | Q5K, V2Tile::T128x64Wgp) => ("qgemm2_k32_128x64wgp", 128, 64, 3, 1, 770.0),
        // The chained Q8_0 reduction (explicit only): its loop measured 647–738 TOPS in
        // kernels/bench/imma_rate.cu (2026-11-30, sixth session); the tile itself not yet.
        (Q8_0, V2Tile::T128x128Wgc) => ("qgemm2_q8_0_128x128wgc", 128, 128, 4, 1, 1100.0),
        (_, V2Tile::T128x128Ws | V2Tile::T96x128Ws) => {
            return v2_tile_plan(format, V2Tile::T128x128)
        }
        (_, V2Tile::T128x64Wgp | V2Tile::T128x128Wgc) => {
            return v2_tile_plan(format, V2Tile::T128x128Tma)
        }
    };
    let bk = stage_k(format);
    let wgmma = tile == V2Tile::T128x64Wgp;
    let chained = tile == V2Tile::T128x128Wgc;
    let tma = wgmma || chained || matches!(tile, V2Tile::T128x128Tma | V2Tile::T96x128Tma);
    let warp_specialized = tma || matches!(tile, V2Tile::T128x128Ws | V2Tile::T96x128Ws);
    // The weight-plane tile's stages also hold a second weight plane on a 1,024-byte boundary; the
    // chained tile's, a chain group's corrections (f32 a column).
    let stage = if wgmma {
        stage_bytes(format, bm, bn, bk).next_multiple_of(1024) + bn * bk
    } else if chained {
        stage_bytes(format, bm, bn, bk) + 4 * bn
    } else {
        stage_bytes(format, bm, bn, bk)
    };
    // TMA tiles: stages of whole KiB, and 1 KiB more to start them on the 1,024-byte boundary of the
    // 128-byte swizzle.
    let staged = (stages * stage.next_multiple_of(if tma { 1024 } else { 128 })
        + if warp_specialized { 16 * stages } else { 0 })
    .next_multiple_of(128);
    let align = if tma { 1024 } else { 0 };
    let slot = scratch_slot_bytes(bm, bn, warp_specialized, staged + align);
    TilePlan {
        kernel,
        family: Family::V2,
        bm,
        bn,
        bk,
        stages,
        // The producer warpgroup; the stages' full / empty mbarriers after the stages.
        threads: TC2_THREADS + if warp_specialized { 128 } else { 0 },
        smem_bytes: staged + slot + align,
        ctas_per_sm,
        hopper_only: warp_specialized,
        tma,
        macs_per_sm_clock: rate,
        scratch_in_smem: slot > 0,
    }
}

/// The shared-memory copy of G = 1's closed part that a warp-specialized tile keeps after its stages and
/// barriers when it fits beside the `other` bytes in 227 KiB (`SLOT` in quant_gemm.cu's `qgemm_tc2`):
/// `bm` rows of `bn + 8` floats.
fn scratch_slot_bytes(bm: usize, bn: usize, warp_specialized: bool, other: usize) -> usize {
    let slot = 4 * bm * (bn + 8);
    if warp_specialized && other + slot <= 227 * 1024 {
        slot
    } else {
        0
    }
}

/// The `fmt` argument of the plain kernel (`FMT_*` in quant_gemm.cu).
pub fn simt_format_code(format: WeightFormat) -> i32 {
    match format {
        WeightFormat::Q8_0 => 0,
        WeightFormat::Q4K | WeightFormat::Q5K => 1,
        WeightFormat::Q6K => 2,
    }
}

/// What the launcher needs to know about the GPU (CUDA device attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    pub sm_count: usize,
    /// `MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: the most dynamic shared memory one CTA may ask for.
    pub smem_per_block: usize,
    /// `MAX_SHARED_MEMORY_PER_MULTIPROCESSOR`.
    pub smem_per_sm: usize,
    /// The compute capability's major number (8: Ampere / Ada, 9: Hopper).
    pub compute_major: usize,
}

impl DeviceLimits {
    /// An H100 / H200 (sm_90): 132 SMs, 227 KiB per CTA, 228 KiB per SM.
    pub const H200: DeviceLimits = DeviceLimits {
        sm_count: 132,
        smem_per_block: 227 * 1024,
        smem_per_sm: 228 * 1024,
        compute_major: 9,
    };

    /// CTAs of `plan` that fit on one SM at once (0: the tile does not fit this GPU, or needs Hopper
    /// and this is not one). Each CTA also takes 1 KiB of shared memory reserved by the system.
    pub fn resident_ctas(&self, plan: &TilePlan) -> usize {
        if plan.smem_bytes > self.smem_per_block || (plan.hopper_only && self.compute_major < 9) {
            return 0;
        }
        plan.ctas_per_sm
            .min(self.smem_per_sm / (plan.smem_bytes + 1024))
    }
}

/// How many part groups a v1 launch of `m × n` outputs uses on a GPU with `sm_count` multiprocessors:
/// 1 when the output tiles alone give every SM two CTAs, else 2 or 4 (each doubling the CTAs by
/// splitting the reduction).
pub fn part_groups(plan: &TilePlan, m: usize, n: usize, sm_count: usize) -> u32 {
    let ctas = m.div_ceil(plan.bm) * n.div_ceil(plan.bn);
    let want = 2 * sm_count.max(1);
    if ctas >= want {
        1
    } else if 2 * ctas >= want {
        2
    } else {
        4
    }
}

/// Nominal clock (Hz) and memory rate (bytes/s) of the cost model (H200-like; only ratios matter).
const MODEL_CLOCK_HZ: f64 = 1.75e9;
const MODEL_DRAM_BYTES_PER_S: f64 = 3.0e12;
/// Cycles a CTA spends outside its main loop (pipeline fill, closing the parts).
const MODEL_CTA_FIXED_CYCLES: f64 = 3_000.0;
/// One extra kernel launch (the combine kernel of a split launch).
const MODEL_LAUNCH_S: f64 = 3.0e-6;

/// Modelled cycles of one CTA of `plan` over `k` inputs while `resident` CTAs share its SM.
fn model_cta_cycles(plan: &TilePlan, resident: usize, k: f64) -> f64 {
    (plan.bm * plan.bn) as f64 * k * resident as f64 / plan.macs_per_sm_clock
        + MODEL_CTA_FIXED_CYCLES
}

/// Modelled seconds of a v2 launch of `m × n` outputs over `k` inputs with `g` part groups: whole waves
/// of resident CTAs (the last wave costs as much as a full one), each CTA's share of the SM's rate,
/// plus for `g > 1` the workspace traffic and the combine kernel. `None` if the tile does not fit.
pub fn model_seconds(
    plan: &TilePlan,
    limits: &DeviceLimits,
    m: usize,
    n: usize,
    k: usize,
    g: u32,
) -> Option<f64> {
    let resident = limits.resident_ctas(plan);
    if resident == 0 || limits.sm_count == 0 {
        return None;
    }
    let ctas = m.div_ceil(plan.bm) * n.div_ceil(plan.bn) * g as usize;
    let waves = ctas.div_ceil(limits.sm_count * resident) as f64;
    let cta_cycles = model_cta_cycles(plan, resident, k as f64 / f64::from(g));
    let mut t = waves * cta_cycles / MODEL_CLOCK_HZ;
    if g > 1 {
        // The kernel writes G partial results, the combine kernel reads them and writes y.
        let bytes = (2 * g as usize + 1) * m * n * 4;
        t += bytes as f64 / MODEL_DRAM_BYTES_PER_S + MODEL_LAUNCH_S;
    }
    Some(t)
}

/// Modelled seconds of a v2 launch with one part group and a tail split of `tail_cols` columns
/// ([`TailSplit`]): the main tiles in whole waves, the tail's quarter-length CTAs first in the SM slots
/// the main tiles' last wave leaves free, then in quarter waves; plus the workspace traffic and the
/// combine kernel. `None` if the tile does not fit or the split leaves no main tiles (that is G = 4).
pub fn model_seconds_tail(
    plan: &TilePlan,
    limits: &DeviceLimits,
    m: usize,
    n: usize,
    k: usize,
    tail_cols: usize,
) -> Option<f64> {
    let resident = limits.resident_ctas(plan);
    if resident == 0 || limits.sm_count == 0 {
        return None;
    }
    let tail = tail_split(plan, m, n, group_m(plan, m, k) as usize, tail_cols)?;
    if tail.base == 0 {
        return None;
    }
    let slots = limits.sm_count * resident;
    let (full, quarter) = (
        model_cta_cycles(plan, resident, k as f64),
        model_cta_cycles(plan, resident, k as f64 / 4.0),
    );
    let waves = tail.base.div_ceil(slots);
    let free = waves * slots - tail.base;
    let quarters = 4 * tail.tiles;
    let room = free * (full / quarter).floor() as usize;
    let mut t = waves as f64 * full;
    if quarters > room {
        t += (quarters - room).div_ceil(slots) as f64 * quarter;
    }
    let bytes = 9 * (m - tail.r0) * (n - tail.c0) * 4;
    Some(t / MODEL_CLOCK_HZ + bytes as f64 / MODEL_DRAM_BYTES_PER_S + MODEL_LAUNCH_S)
}

/// The tail columns worth trying for a v2 tile with one part group: the fewest whose tiles take up the
/// partial last wave. None when the tiles fill whole waves, or make fewer than two: on the H200
/// (2026-11-30, `docs/benchmarks.md`) a tail after a single wave lost 5–21 % to the split launches
/// (G = 2 / 4) in 3 of 4 measured shapes, the model's guess notwithstanding, while after 2–6 waves it
/// gained 2.5–23 %.
pub fn tail_candidate(
    plan: &TilePlan,
    limits: &DeviceLimits,
    m: usize,
    n: usize,
    k: usize,
) -> Option<u32> {
    let slots = limits.sm_count * limits.resident_ctas(plan);
    if slots == 0 || m == 0 || n == 0 {
        return None;
    }
    let (m_tiles, n_tiles) = (m.div_ceil(plan.bm), n.div_ceil(plan.bn));
    let rest = (m_tiles * n_tiles) % slots;
    if rest == 0 || m_tiles * n_tiles < 2 * slots {
        return None;
    }
    let gm = (group_m(plan, m, k) as usize).clamp(1, m_tiles);
    let last_rows = m_tiles - (m_tiles.div_ceil(gm) - 1) * gm;
    let cols = rest.div_ceil(last_rows);
    (cols < n_tiles).then(|| u32::try_from(cols).unwrap_or(u32::MAX))
}

/// Tile rows per raster group of the v2 grid: all of them (tile rows fastest, every weight tile read
/// from DRAM once) while the activations fit comfortably in L2, else groups whose activation rows take
/// about 16 MiB, so the CTAs running at one time share their weight tiles and activation rows.
pub fn group_m(plan: &TilePlan, m: usize, k: usize) -> u32 {
    let m_tiles = m.div_ceil(plan.bm).max(1);
    let rows_bytes = plan.bm * k.max(1);
    let group = if m * k <= 24 << 20 {
        m_tiles
    } else {
        ((16 << 20) / rows_bytes).clamp(1, m_tiles)
    };
    u32::try_from(group).unwrap_or(u32::MAX)
}

/// The v2 kernel's tile order (the Rust twin of its first lines): CTA `pid` of a grid of
/// `m_tiles × n_tiles` works on tile (row, column) = the returned pair.
pub fn v2_tile_of(pid: usize, m_tiles: usize, n_tiles: usize, group_m: usize) -> (usize, usize) {
    let gm = group_m.clamp(1, m_tiles.max(1));
    let per_group = gm * n_tiles;
    let grp = pid / per_group;
    let first_m = grp * gm;
    let gsize = (m_tiles - first_m).min(gm);
    let in_grp = pid - grp * per_group;
    (first_m + in_grp % gsize, in_grp / gsize)
}

/// The tail split of a v2 launch with one part group: the last `tiles` tiles of the raster order (the
/// last `tail_cols` tile columns of the last raster group: outputs `r0..M` × `c0..N`) run as four CTAs
/// each, one per part of the reduction, as a G = 4 launch would run them, into a `[4, M − r0, N − c0]`
/// workspace that `qgemm_combine_tail` folds with the same tree. The grid's last wave is then made of
/// quarter-length CTAs instead of a few full ones (27B `ffn_gate|up` at M = 275: 816 tiles on 132 SMs
/// are 6.2 waves). Every output keeps its bits: the per-output arithmetic is the same for every G.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailSplit {
    /// Raster index of the first tail tile (the kernel's `tail_base`).
    pub base: usize,
    pub tiles: usize,
    pub r0: usize,
    pub c0: usize,
}

/// Where the tail of `tail_cols` tile columns starts for a v2 tile (`None`: no tail). More columns
/// than the grid has take all of the last raster group.
pub fn tail_split(
    plan: &TilePlan,
    m: usize,
    n: usize,
    group_m: usize,
    tail_cols: usize,
) -> Option<TailSplit> {
    if tail_cols == 0 || m == 0 || n == 0 || plan.family != Family::V2 {
        return None;
    }
    let (m_tiles, n_tiles) = (m.div_ceil(plan.bm), n.div_ceil(plan.bn));
    let gm = group_m.clamp(1, m_tiles);
    let first_m_last = (m_tiles.div_ceil(gm) - 1) * gm;
    let cols = tail_cols.min(n_tiles);
    let tiles = (m_tiles - first_m_last) * cols;
    Some(TailSplit {
        base: m_tiles * n_tiles - tiles,
        tiles,
        r0: first_m_last * plan.bm,
        c0: (n_tiles - cols) * plan.bn,
    })
}

/// The v2 kernel's CTA order with a tail (the Rust twin of its first lines): CTA `pid` of a launch with
/// `tail_base` (no tail: the tile count) works on tile (row, column), part group `z` of `g`.
pub fn v2_cta_of(
    pid: usize,
    m_tiles: usize,
    n_tiles: usize,
    group_m: usize,
    tail_base: usize,
) -> ((usize, usize), usize, usize) {
    if pid < tail_base {
        (v2_tile_of(pid, m_tiles, n_tiles, group_m), 0, 1)
    } else {
        let t = pid - tail_base;
        (
            v2_tile_of(tail_base + t / 4, m_tiles, n_tiles, group_m),
            t % 4,
            4,
        )
    }
}

/// A launch: the kernel, its part groups and, for v2, the raster group and the tail split's columns
/// (0: none; only with one part group). `tile == None` is the plain kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaunchPlan {
    pub tile: Option<TilePlan>,
    pub part_groups: u32,
    pub group_m: u32,
    pub tail_cols: u32,
    /// Persistent CTAs ([`GemmKernel::V2Persistent`]): the grid's size; 0: one CTA a tile (or part).
    pub persistent_ctas: u32,
}

impl LaunchPlan {
    fn simt() -> Self {
        LaunchPlan {
            tile: None,
            part_groups: 1,
            group_m: 1,
            tail_cols: 0,
            persistent_ctas: 0,
        }
    }

    /// The tail split of this launch, if it has one.
    pub fn tail(&self, m: usize, n: usize) -> Option<TailSplit> {
        let t = self.tile?;
        if self.part_groups != 1 {
            return None;
        }
        tail_split(&t, m, n, self.group_m as usize, self.tail_cols as usize)
    }

    /// The grid: v1 (row tiles, column tiles, groups); v2 (row tiles · column tiles, 1, groups); the
    /// plain kernel one thread per output. Sizes must have passed [`check_launch`].
    pub fn grid(&self, m: usize, n: usize) -> (u32, u32, u32) {
        match self.tile {
            None => ((m * n).div_ceil(SIMT_THREADS as usize) as u32, 1, 1),
            Some(t) if t.family == Family::V1 => (
                m.div_ceil(t.bm) as u32,
                n.div_ceil(t.bn) as u32,
                self.part_groups,
            ),
            Some(_) if self.persistent_ctas > 0 => (self.persistent_ctas, 1, 1),
            Some(t) => {
                let tiles = m.div_ceil(t.bm) * n.div_ceil(t.bn);
                let ctas = match self.tail(m, n) {
                    Some(tail) => tail.base + 4 * tail.tiles,
                    None => tiles,
                };
                (ctas as u32, 1, self.part_groups)
            }
        }
    }
}

/// The best v2 (tile, part groups, tail columns) for a shape by [`model_seconds`] and
/// [`model_seconds_tail`], among the tiles that fit.
pub fn choose_v2(
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    limits: &DeviceLimits,
) -> Option<(TilePlan, u32, u32)> {
    let mut best: Option<(f64, TilePlan, u32, u32)> = None;
    let mut consider = |t: Option<f64>, plan: TilePlan, g: u32, tail: u32| {
        if let Some(t) = t {
            // Strictly better only: ties keep the earlier (smaller G, smaller tile, no tail).
            if best.as_ref().is_none_or(|(bt, ..)| t < *bt) {
                best = Some((t, plan, g, tail));
            }
        }
    };
    for tile in V2Tile::ALL.into_iter().filter(|t| t.automatic()) {
        let plan = v2_tile_plan(format, tile);
        for g in [1u32, 2, 4] {
            consider(model_seconds(&plan, limits, m, n, k, g), plan, g, 0);
        }
        if let Some(cols) = tail_candidate(&plan, limits, m, n, k) {
            let t = model_seconds_tail(&plan, limits, m, n, k, cols as usize);
            consider(t, plan, 1, cols);
        }
    }
    best.map(|(_, p, g, tail)| (p, g, tail))
}

/// The modelled seconds of a v2 launch plan ([`model_seconds`] or [`model_seconds_tail`]).
pub fn model_plan_seconds(
    plan: &LaunchPlan,
    limits: &DeviceLimits,
    m: usize,
    n: usize,
    k: usize,
) -> Option<f64> {
    let t = plan.tile?;
    if plan.part_groups == 1 && plan.tail_cols > 0 {
        model_seconds_tail(&t, limits, m, n, k, plan.tail_cols as usize)
    } else {
        model_seconds(&t, limits, m, n, k, plan.part_groups)
    }
}

/// The launch for `kernel` (with [`GemmKernel::Auto`] resolved to `default_family`) of `m × n` outputs
/// over `k` inputs. Automatic choices never pick a tile that does not fit the GPU's shared memory: v2
/// falls back to v1, v1 to the plain kernel. An explicit tile that does not fit is an error.
pub fn plan_launch(
    kernel: GemmKernel,
    default_family: Family,
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    limits: &DeviceLimits,
) -> Result<LaunchPlan> {
    let fits = |p: &TilePlan| limits.resident_ctas(p) > 0;
    let v1_auto = || {
        let p = v1_tile_plan(format);
        if fits(&p) {
            LaunchPlan {
                tile: Some(p),
                part_groups: part_groups(&p, m, n, limits.sm_count),
                group_m: 1,
                tail_cols: 0,
                persistent_ctas: 0,
            }
        } else {
            LaunchPlan::simt()
        }
    };
    let explicit = |p: TilePlan, g: u32, tail_cols: u32| -> Result<LaunchPlan> {
        if p.hopper_only && limits.compute_major < 9 {
            return Err(QuantError::Input(format!(
                "{}: built for Hopper (sm_90a) only; this GPU is compute capability {}.x",
                p.kernel, limits.compute_major
            )));
        }
        if !fits(&p) {
            return Err(QuantError::Input(format!(
                "{}: {} bytes of shared memory a CTA, the GPU allows {} ({} a multiprocessor)",
                p.kernel, p.smem_bytes, limits.smem_per_block, limits.smem_per_sm
            )));
        }
        if tail_cols > 0 && (g != 1 || p.family != Family::V2) {
            return Err(QuantError::Input(format!(
                "{}: a tail split needs a v2 tile with one part group (G = {g})",
                p.kernel
            )));
        }
        Ok(LaunchPlan {
            tile: Some(p),
            part_groups: g,
            group_m: if p.family == Family::V2 {
                group_m(&p, m, k)
            } else {
                1
            },
            tail_cols,
            persistent_ctas: 0,
        })
    };
    let family = match kernel {
        GemmKernel::Auto => default_family,
        GemmKernel::AutoFamily(f) => f,
        GemmKernel::TensorCore { part_groups } => {
            return explicit(v1_tile_plan(format), part_groups, 0)
        }
        GemmKernel::V2 {
            tile,
            part_groups,
            tail_cols,
        } => return explicit(v2_tile_plan(format, tile), part_groups, tail_cols),
        GemmKernel::Simt => return Ok(LaunchPlan::simt()),
        GemmKernel::V2Persistent { tile } => {
            let p = v2_tile_plan(format, tile);
            let ws_mma = matches!(
                tile,
                V2Tile::T128x128Ws | V2Tile::T96x128Ws | V2Tile::T128x128Tma | V2Tile::T96x128Tma
            );
            if !(ws_mma && p.hopper_only && format == WeightFormat::Q8_0) {
                return Err(QuantError::Input(format!(
                    "{}: persistent CTAs are for the Q8_0 warp-specialized mma.sync tiles ({tile:?} on {format:?})",
                    p.kernel
                )));
            }
            let mut plan = explicit(p, 1, 0)?;
            let tiles = m.div_ceil(p.bm) * n.div_ceil(p.bn);
            let ctas = limits.sm_count * limits.resident_ctas(&p);
            plan.persistent_ctas = u32::try_from(tiles.min(ctas).max(1)).unwrap_or(u32::MAX);
            return Ok(plan);
        }
    };
    Ok(match family {
        Family::V1 => v1_auto(),
        Family::V2 => match choose_v2(format, m, n, k, limits) {
            Some((p, g, tail_cols)) => LaunchPlan {
                tile: Some(p),
                part_groups: g,
                group_m: group_m(&p, m, k),
                tail_cols,
                persistent_ctas: if g == 1 && tail_cols == 0 && format == WeightFormat::Q8_0 {
                    auto_persistent_ctas(&p, m, n, limits)
                } else {
                    0
                },
            },
            None => v1_auto(),
        },
    })
}

/// Tiles a persistent CTA must have before the automatic plan makes the CTAs persistent.
const PERSISTENT_MIN_TILES_PER_CTA: usize = 12;

/// The automatic plan's persistent CTAs for a Q8_0 one-group launch without a tail of `plan` (0: none).
/// The kernel deals tiles to CTAs statically, so it pays for the last round's imbalance that the
/// hardware's own CTA scheduling evens out: measured on an H200 (2026-11-30, sixth session) +3–5 % at
/// 16–132 tiles a CTA, ±0 at 3.4 and −18 % at 6.2 (the 96-row tile at M = 275). So only from
/// [`PERSISTENT_MIN_TILES_PER_CTA`] tiles a CTA, on the warp-specialized `mma.sync` tiles.
fn auto_persistent_ctas(plan: &TilePlan, m: usize, n: usize, limits: &DeviceLimits) -> u32 {
    let ws_mma = plan.hopper_only && !plan.kernel.ends_with("wgp") && !plan.kernel.ends_with("wgc");
    let ctas = limits.sm_count * limits.resident_ctas(plan);
    let tiles = m.div_ceil(plan.bm) * n.div_ceil(plan.bn);
    if ws_mma && ctas > 0 && tiles >= PERSISTENT_MIN_TILES_PER_CTA * ctas {
        u32::try_from(ctas).unwrap_or(0)
    } else {
        0
    }
}

/// The checks every launch makes before touching the device: the reduction is whole blocks, the sizes
/// fit the kernels' `int` arguments and the grid, and `part_groups` is 1, 2 or 4.
pub fn check_launch(
    w_name: &str,
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    groups: u32,
) -> Result<()> {
    let block = format.block_len();
    if k == 0 || k % block != 0 {
        return Err(QuantError::PartialBlock {
            tensor: w_name.to_string(),
            ty: format.ggml_type(),
            cols: k,
            block,
        });
    }
    let fits = |x: usize| i32::try_from(x).is_ok();
    let total = m.checked_mul(n.max(k)).and_then(|x| x.checked_mul(4));
    // v1's grid has column tiles of 64 in y (at most 65,535); v2's has all tiles (64 × 128 at the
    // smallest) in x, an int in the kernel.
    let v2_tiles = m.div_ceil(64).checked_mul(n.div_ceil(128));
    if !fits(m)
        || !fits(n)
        || !fits(k)
        || total.is_none()
        || n.div_ceil(64) > 65_535
        || !v2_tiles.is_some_and(fits)
    {
        return Err(QuantError::Input(format!(
            "CUDA matmul of {w_name:?}: {m} × {k} activations by {n} outputs exceed the kernels' index range"
        )));
    }
    if !matches!(groups, 1 | 2 | 4) {
        return Err(QuantError::Input(format!(
            "CUDA matmul of {w_name:?}: {groups} part groups (1, 2 or 4)"
        )));
    }
    Ok(())
}

/// A [`QuantWeight`]'s arrays as the device stores them: the weights row-major `[rows, cols]`, signed
/// bytes as `u8` bits (candle has no i8); the per-block tables **block-major**: block scales (and min
/// scales) f32 `[blocks, rows]`, sub-block scales / mins `[blocks, rows, sub-blocks a block]`, so that
/// a kernel stage's tables for a tile's consecutive rows are consecutive in memory (its copies
/// coalesce). Absent arrays (Q8_0 has no sub-block scales, only Q4_K/Q5_K have mins) are empty.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatWeight {
    pub info: WeightInfo,
    pub q: Vec<u8>,
    pub sub_scales: Vec<u8>,
    pub sub_mins: Vec<u8>,
    pub d: Vec<f32>,
    pub dmin: Vec<f32>,
}

impl FlatWeight {
    /// From a borrowed weight (copies it first; a loader that is done with the weight uses
    /// [`FlatWeight::from_owned`]).
    pub fn new(w: &QuantWeight) -> Self {
        Self::from_owned(w.clone())
    }

    /// From a weight the caller is done with: the weight bytes are reused in place (an `i8` → `u8`
    /// reinterpretation), only the small per-block tables are reordered.
    pub fn from_owned(w: QuantWeight) -> Self {
        let nb = w.blocks_per_row();
        let (info, arrays) = w.into_arrays();
        let rows = info.rows;
        let bits = |v: Vec<i8>| -> Vec<u8> { v.into_iter().map(|x| x as u8).collect() };
        // Block-major: [block][row] (scales), [block][row][sub-block of the block] (integer tables).
        let block_major = |v: Vec<u8>| -> Vec<u8> {
            if v.is_empty() {
                return v;
            }
            let per_block = v.len() / (rows * nb);
            let mut out = Vec::with_capacity(v.len());
            for b in 0..nb {
                for n in 0..rows {
                    let at = (n * nb + b) * per_block;
                    out.extend_from_slice(&v[at..at + per_block]);
                }
            }
            out
        };
        let dmin = if arrays.dmin.is_empty() {
            arrays.dmin
        } else {
            transpose(&arrays.dmin, rows, nb)
        };
        FlatWeight {
            q: bits(arrays.q),
            sub_scales: block_major(bits(arrays.sub_scales)),
            sub_mins: block_major(bits(arrays.sub_mins)),
            d: transpose(&arrays.d, rows, nb),
            dmin,
            info,
        }
    }
}

/// `v` (`rows × cols`, row-major) as `cols × rows`, row-major: per-row tables made block-major for a
/// kernel whose CTAs read a block's values of consecutive rows together.
pub fn transpose<T: Copy>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    assert_eq!(v.len(), rows * cols, "transpose of {rows} × {cols}");
    let mut out = Vec::with_capacity(v.len());
    for c in 0..cols {
        out.extend((0..rows).map(|r| v[r * cols + c]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{ActivationScale, QuantizedRows};
    use crate::kernel::{block_sums, matmul_quantized, quantize_for};
    use prism_gguf::quantize::quantize;

    struct Rng(u64);
    impl Rng {
        fn next_f32(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn weight(format: WeightFormat, rows: usize, cols: usize, rng: &mut Rng) -> QuantWeight {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.05).collect();
        let ty = format.ggml_type();
        QuantWeight::from_gguf("w", ty, &quantize(ty, &values).unwrap(), rows, cols).unwrap()
    }

    /// The tensor-core kernel's walk for one output, replayed on the CPU: part groups of `4 / g` parts,
    /// stages of `plan.bk / block` blocks from the group's first block, parts closed when a block at or
    /// past their end comes (empty ones included), Q8_0's `f32(D_b)` through the 1.5·2^23 bit trick, the
    /// `lo` / pair / `s` tree, and for g > 1 the combine kernel's fold.
    fn kernel_walk(
        qx: &QuantizedRows,
        w: &QuantWeight,
        scale: f32,
        m: usize,
        n: usize,
        g: usize,
    ) -> f32 {
        let plan = v1_tile_plan(w.format());
        let bps = plan.bk / w.format().block_len();
        let nb = w.blocks_per_row();
        let (qa, sums) = (qx.row(m), qx.row_sums(m));
        let (d, dmin) = (w.row_d(n), w.row_dmin(n));
        let mut group_out = Vec::new();
        for z in 0..g {
            let (p_begin, p_end) = (z * 4 / g, (z + 1) * 4 / g);
            let (b_begin, b_end) = (p_begin * nb / 4, p_end * nb / 4);
            let (mut acc, mut lo, mut s) = (0f32, 0f32, 0f32);
            let mut part = p_begin;
            let mut finish = |part: usize, acc: &mut f32| {
                if g == 4 {
                    s = *acc;
                } else if part % 2 == 0 {
                    lo = *acc;
                } else {
                    let pair = lo + *acc;
                    s = if g == 1 && part == 3 { s + pair } else { pair };
                }
                *acc = 0.0;
            };
            let n_stages = (b_end - b_begin).div_ceil(bps);
            for it in 0..n_stages {
                for blk in 0..bps {
                    let b = b_begin + it * bps + blk;
                    if b >= b_end {
                        break;
                    }
                    while b >= (part + 1) * nb / 4 {
                        finish(part, &mut acc);
                        part += 1;
                    }
                    let (db, mb) = block_sums(w, n, b, qa, sums);
                    let dbf = if w.format() == WeightFormat::Q8_0 {
                        let bits = 0x4B40_0000i32.wrapping_add(db);
                        f32::from_bits(bits as u32) - 12_582_912.0
                    } else {
                        db as f32
                    };
                    acc = d[b].mul_add(dbf, acc);
                    if w.format().has_mins() {
                        acc = (-dmin[b]).mul_add(mb as f32, acc);
                    }
                }
            }
            while part < p_end {
                finish(part, &mut acc);
                part += 1;
            }
            group_out.push(s);
        }
        match g {
            1 => group_out[0] * scale,
            2 => (group_out[0] + group_out[1]) * scale,
            _ => ((group_out[0] + group_out[1]) + (group_out[2] + group_out[3])) * scale,
        }
    }

    #[test]
    fn the_kernel_walk_gives_the_reference_bits_for_every_part_grouping() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // Block counts that leave parts empty (1..3 blocks), uneven parts, and stage tails.
        let shapes = [
            (WeightFormat::Q8_0, 32),
            (WeightFormat::Q8_0, 96),
            (WeightFormat::Q8_0, 160),
            (WeightFormat::Q8_0, 32 * 37),
            (WeightFormat::Q4K, 256),
            (WeightFormat::Q4K, 768),
            (WeightFormat::Q4K, 1280),
            (WeightFormat::Q6K, 512),
            (WeightFormat::Q6K, 1536),
        ];
        for (format, k) in shapes {
            let (m, n) = (3, 5);
            let w = weight(format, n, k, &mut rng);
            // Large activations so that Q8_0's block sums reach far beyond 2^16.
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_f32() * 4.0).collect();
            let scale = ActivationScale::from_absmax(4.0).unwrap();
            let qx = quantize_for(&x, m, &w, &scale).unwrap();
            let want = matmul_quantized(&qx, &w, &scale);
            for g in [1, 2, 4] {
                for r in 0..m {
                    for c in 0..n {
                        let got = kernel_walk(&qx, &w, scale.scale(), r, c, g);
                        assert_eq!(
                            got.to_bits(),
                            want[r * n + c].to_bits(),
                            "{format:?} K={k} G={g} output ({r}, {c}): {got} vs {}",
                            want[r * n + c]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_q8_0_bit_trick_is_the_exact_conversion_over_the_whole_block_sum_range() {
        // |D_b| ≤ 128 · 127 · 32 = 520,192 for Q8_0; the trick is exact below 2^22.
        let limit = 128 * 127 * 32;
        for db in (-limit..=limit).step_by(7).chain([-limit, -1, 0, 1, limit]) {
            let via_bits = f32::from_bits(0x4B40_0000i32.wrapping_add(db) as u32) - 12_582_912.0;
            assert_eq!(via_bits.to_bits(), (db as f32).to_bits(), "D_b = {db}");
        }
    }

    #[test]
    fn tile_plans_match_the_kernel_instantiations_and_fit_the_gpu() {
        let q8 = v1_tile_plan(WeightFormat::Q8_0);
        // 64×128 A + 64×128 B + 4 blocks × 64 f32 scales = 17,408 bytes a stage, 4 stages.
        assert_eq!(
            (q8.bm, q8.bn, q8.bk, q8.stages, q8.smem_bytes),
            (64, 64, 128, 4, 4 * 17_408)
        );
        let q4 = v1_tile_plan(WeightFormat::Q4K);
        // 2 × 64×256 + d, dmin (64 f32 each) + scales, mins (64×8 bytes each) + sums (64×8 i32).
        assert_eq!(q4.smem_bytes, 3 * (32_768 + 256 + 256 + 512 + 512 + 2_048));
        assert_eq!(v1_tile_plan(WeightFormat::Q5K), q4);
        let q6 = v1_tile_plan(WeightFormat::Q6K);
        assert_eq!(q6.smem_bytes, 3 * (32_768 + 256 + 1_024));
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let p = v1_tile_plan(format);
            // Whole blocks per stage, and within the 227 KiB a CTA may opt in to on sm_90 (163 KiB sm_80).
            assert_eq!(p.bk % format.block_len(), 0);
            assert!(
                p.hopper_only || p.smem_bytes <= 163 * 1024,
                "{format:?}: {} bytes",
                p.smem_bytes
            );
        }
    }

    #[test]
    fn part_groups_split_the_reduction_only_when_the_tiles_do_not_fill_the_gpu() {
        let p = v1_tile_plan(WeightFormat::Q8_0);
        // Decode on a 132-SM H200: 80 tiles of 64 outputs for N = 5120 → 4 groups.
        assert_eq!(part_groups(&p, 1, 5120, 132), 4);
        // 2 × 80 = 160 tiles: 2 groups bring 320 ≥ 264 CTAs.
        assert_eq!(part_groups(&p, 128, 5120, 132), 2);
        assert_eq!(part_groups(&p, 4096, 17408, 132), 1);
    }

    #[test]
    fn launches_refuse_partial_blocks_and_bad_groupings() {
        assert!(check_launch("w", WeightFormat::Q8_0, 7, 3584, 1024, 1).is_ok());
        assert!(matches!(
            check_launch("w", WeightFormat::Q8_0, 7, 3584, 1000, 1),
            Err(QuantError::PartialBlock {
                cols: 1000,
                block: 32,
                ..
            })
        ));
        assert!(matches!(
            check_launch("w", WeightFormat::Q6K, 7, 3584, 1024 + 32, 1),
            Err(QuantError::PartialBlock { block: 256, .. })
        ));
        assert!(check_launch("w", WeightFormat::Q4K, 7, 64, 256, 3).is_err());
        assert!(check_launch("w", WeightFormat::Q4K, 1 << 31, 64, 256, 1).is_err());
    }

    #[test]
    fn the_flat_arrays_are_the_kernels_layouts() {
        let mut rng = Rng(7);
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let (rows, cols) = (3, 512);
            let w = weight(format, rows, cols, &mut rng);
            let f = FlatWeight::new(&w);
            // A loader's owned conversion gives the same arrays.
            assert_eq!(FlatWeight::from_owned(w.clone()), f);
            assert_eq!(f.info, w.info());
            let subs = cols / format.sub_len();
            let blocks = cols / format.block_len();
            assert_eq!(f.q.len(), rows * cols);
            assert_eq!(f.d.len(), rows * blocks);
            assert_eq!(
                f.sub_scales.len(),
                if format.has_sub_scales() {
                    rows * subs
                } else {
                    0
                }
            );
            assert_eq!(
                f.sub_mins.len(),
                if format.has_mins() { rows * subs } else { 0 }
            );
            assert_eq!(
                f.dmin.len(),
                if format.has_mins() { rows * blocks } else { 0 }
            );
            let per_block = subs / blocks;
            for n in 0..rows {
                // The kernels read element k of row n at n·cols + k, and reinterpret the byte as i8;
                // sub-block j of block b at (b·rows + n)·per_block + j; block scale b at b·rows + n.
                for (k, &q) in w.row_q(n).iter().enumerate() {
                    assert_eq!(f.q[n * cols + k] as i8, q);
                }
                for (s, &sc) in w.row_sub_scales(n).iter().enumerate() {
                    let (b, j) = (s / per_block, s % per_block);
                    assert_eq!(f.sub_scales[(b * rows + n) * per_block + j] as i8, sc);
                }
                for (s, &mn) in w.row_sub_mins(n).iter().enumerate() {
                    let (b, j) = (s / per_block, s % per_block);
                    assert_eq!(f.sub_mins[(b * rows + n) * per_block + j] as i8, mn);
                }
                for (b, &d) in w.row_d(n).iter().enumerate() {
                    assert_eq!(f.d[b * rows + n], d);
                }
                for (b, &dm) in w.row_dmin(n).iter().enumerate() {
                    assert_eq!(f.dmin[b * rows + n], dm);
                }
            }
        }
    }

    /// The v2 kernel's stages for part group [p_begin, p_end) of `nb` blocks: (part, first block,
    /// blocks) in the order the kernel's cursors visit them (the Rust twin of its K loop).
    fn v2_stages(
        nb: usize,
        p_begin: usize,
        p_end: usize,
        bps: usize,
    ) -> Vec<(usize, usize, usize)> {
        let part_end = |p: usize| (p + 1) * nb / 4;
        let (mut p, mut b) = (p_begin, p_begin * nb / 4);
        let mut stages = Vec::new();
        loop {
            while p < p_end && b == part_end(p) {
                p += 1;
            }
            if p >= p_end {
                return stages;
            }
            let count = bps.min(part_end(p) - b);
            stages.push((p, b, count));
            b += count;
        }
    }

    /// The weight-plane wgmma tile's block sum D_b (quant_gemm.cu, `planes_make` / `planes_issue` /
    /// `planes_sums`): the block's q bytes four to a u32 word times hi and times lo of their sub-block's
    /// scale sc = 8·hi + lo (no carry from byte to byte: q ≤ 31 and hi, lo ≤ 7), each plane's u8 bytes
    /// times the activations summed over the whole block, D_b = 8·(hi plane sum) + (lo plane sum).
    fn planes_block_sum(q: &[i8], sc: &[i8], qa: &[i8]) -> i32 {
        let (mut hi_sum, mut lo_sum) = (0i32, 0i32);
        for (word_index, bytes) in q[..256].chunks_exact(4).enumerate() {
            let word = u32::from_le_bytes([
                bytes[0] as u8,
                bytes[1] as u8,
                bytes[2] as u8,
                bytes[3] as u8,
            ]);
            let scale = u32::from(sc[word_index / 8] as u8);
            let (hi, lo) = (
                (word * (scale >> 3)).to_le_bytes(),
                (word * (scale & 7)).to_le_bytes(),
            );
            for e in 0..4 {
                let a = i32::from(qa[4 * word_index + e]);
                hi_sum += i32::from(hi[e]) * a;
                lo_sum += i32::from(lo[e]) * a;
            }
        }
        8 * hi_sum + lo_sum
    }

    #[test]
    fn weight_planes_sum_blocks_exactly_at_the_extremes() {
        // Q5_K's largest q (31) and the largest 6-bit sub-block scale (63 = 8·7 + 7): every product
        // byte is 217, the most a plane byte holds; any carry between packed bytes would show here.
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..64 {
            let q: Vec<i8> = (0..256)
                .map(|i| {
                    if case == 0 {
                        31
                    } else {
                        (((rng.next_f32() + 1.0) * 15.99) as i8 + (i % 2) as i8).min(31)
                    }
                })
                .collect();
            let sc: Vec<i8> = (0..8)
                .map(|_| {
                    if case == 0 {
                        63
                    } else {
                        ((rng.next_f32() + 1.0) * 31.99) as i8
                    }
                })
                .collect();
            let qa: Vec<i8> = (0..256)
                .map(|i| match case {
                    0 => 127,
                    1 => -127,
                    _ => (rng.next_f32() * 127.0) as i8 * if i % 3 == 0 { -1 } else { 1 },
                })
                .collect();
            let want: i32 = (0..256)
                .map(|i| i32::from(sc[i / 32]) * i32::from(q[i]) * i32::from(qa[i]))
                .sum();
            assert_eq!(planes_block_sum(&q, &sc, &qa), want, "case {case}");
        }
    }

    /// The v2 kernel's walk for one output, replayed on the CPU: stages that never straddle a part,
    /// parts closed between stages (empty ones included, leading ones before the first stage), the
    /// closed parts kept in "memory" (scratch / out / the group's workspace slot, NaN until written, so
    /// a read before a write poisons the result), and for g > 1 the combine kernel's fold (the weight-
    /// plane tile's block sums by `planes_block_sum`).
    fn kernel_walk_v2(
        qx: &QuantizedRows,
        w: &QuantWeight,
        scale: f32,
        m: usize,
        n: usize,
        g: usize,
        tile: V2Tile,
    ) -> f32 {
        let plan = v2_tile_plan(w.format(), tile);
        let bps = plan.bk / w.format().block_len();
        let nb = w.blocks_per_row();
        let part_end = |p: usize| (p + 1) * nb / 4;
        let (qa, sums) = (qx.row(m), qx.row_sums(m));
        let (d, dmin) = (w.row_d(n), w.row_dmin(n));
        let (mut scratch, mut out) = (f32::NAN, f32::NAN);
        let mut ws = vec![f32::NAN; g];
        for (z, slot) in ws.iter_mut().enumerate() {
            let (p_begin, p_end) = (z * 4 / g, (z + 1) * 4 / g);
            let mut acc = 0f32;
            let mut closed = p_begin;
            let mut finish = |p: usize, acc: &mut f32| {
                let a = std::mem::replace(acc, 0.0);
                match (g, p % 2) {
                    (4, _) => *slot = a,
                    (2, 0) => *slot = a,
                    (2, _) => *slot += a,
                    (_, 0) => scratch = a,
                    _ if p == 1 => out = scratch + a,
                    _ => out = (out + (scratch + a)) * scale,
                }
            };
            for (p, b0, count) in v2_stages(nb, p_begin, p_end, bps) {
                while closed < p {
                    finish(closed, &mut acc);
                    closed += 1;
                }
                for b in b0..b0 + count {
                    let (mut db, mb) = block_sums(w, n, b, qa, sums);
                    if tile == V2Tile::T128x64Wgp && w.format().has_mins() {
                        db = planes_block_sum(
                            &w.row_q(n)[256 * b..],
                            &w.row_sub_scales(n)[8 * b..],
                            &qa[256 * b..],
                        );
                    }
                    let dbf = if w.format() == WeightFormat::Q8_0 {
                        f32::from_bits(0x4B40_0000i32.wrapping_add(db) as u32) - 12_582_912.0
                    } else {
                        db as f32
                    };
                    acc = d[b].mul_add(dbf, acc);
                    if w.format().has_mins() {
                        acc = (-dmin[b]).mul_add(mb as f32, acc);
                    }
                }
                assert!(b0 + count <= part_end(p));
            }
            while closed < p_end {
                finish(closed, &mut acc);
                closed += 1;
            }
        }
        match g {
            1 => out,
            2 => (ws[0] + ws[1]) * scale,
            _ => ((ws[0] + ws[1]) + (ws[2] + ws[3])) * scale,
        }
    }

    #[test]
    fn the_v2_walk_gives_the_reference_bits_for_every_tile_and_part_grouping() {
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        // Block counts with empty parts (1..3 blocks), parts that are not whole stages (Q8_0: 35 and 37
        // blocks), and whole stages.
        let shapes = [
            (WeightFormat::Q8_0, 32),
            (WeightFormat::Q8_0, 96),
            (WeightFormat::Q8_0, 160),
            (WeightFormat::Q8_0, 32 * 35),
            (WeightFormat::Q8_0, 32 * 37),
            (WeightFormat::Q8_0, 512),
            (WeightFormat::Q4K, 256),
            (WeightFormat::Q4K, 768),
            (WeightFormat::Q4K, 1280),
            (WeightFormat::Q6K, 512),
            (WeightFormat::Q6K, 1536),
        ];
        for (format, k) in shapes {
            let (m, n) = (3, 5);
            let w = weight(format, n, k, &mut rng);
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_f32() * 4.0).collect();
            let scale = ActivationScale::from_absmax(4.0).unwrap();
            let qx = quantize_for(&x, m, &w, &scale).unwrap();
            let want = matmul_quantized(&qx, &w, &scale);
            for tile in V2Tile::ALL {
                for g in [1, 2, 4] {
                    for r in 0..m {
                        for c in 0..n {
                            let got = kernel_walk_v2(&qx, &w, scale.scale(), r, c, g, tile);
                            assert_eq!(
                                got.to_bits(),
                                want[r * n + c].to_bits(),
                                "{format:?} K={k} {tile:?} G={g} output ({r}, {c}): {got} vs {}",
                                want[r * n + c]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn v2_stages_cover_each_part_in_order_without_straddling() {
        for nb in [1usize, 2, 3, 4, 5, 7, 35, 37, 160, 544] {
            for bps in [1usize, 4] {
                for g in [1usize, 2, 4] {
                    for z in 0..g {
                        let (p_begin, p_end) = (z * 4 / g, (z + 1) * 4 / g);
                        let stages = v2_stages(nb, p_begin, p_end, bps);
                        // Concatenated, the stages are exactly the group's blocks in increasing order.
                        let blocks: Vec<usize> =
                            stages.iter().flat_map(|&(_, b, c)| b..b + c).collect();
                        let want: Vec<usize> = (p_begin * nb / 4..p_end * nb / 4).collect();
                        assert_eq!(blocks, want, "nb={nb} bps={bps} G={g} z={z}");
                        for &(p, b, c) in &stages {
                            assert!((1..=bps).contains(&c));
                            assert!(p * nb / 4 <= b && b + c <= (p + 1) * nb / 4);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_family_variable_takes_v1_or_v2_and_names_anything_else() {
        assert_eq!(parse_family(None).unwrap(), Family::V2);
        assert_eq!(parse_family(Some("")).unwrap(), Family::V2);
        assert_eq!(parse_family(Some(" V1 ")).unwrap(), Family::V1);
        assert_eq!(parse_family(Some("v2")).unwrap(), Family::V2);
        let err = parse_family(Some("v3")).unwrap_err().to_string();
        assert!(err.contains("PRISM_QGEMM") && err.contains("v3"), "{err}");
    }

    #[test]
    fn v2_tile_plans_match_the_kernel_instantiations() {
        use WeightFormat::*;
        // (format, tile, kernel, bm, stages, bytes a stage): A bm×bk + B 128×bk + scales (see Smem).
        let cases = [
            (
                Q8_0,
                V2Tile::T64x128,
                "qgemm2_q8_0_64x128",
                64,
                4,
                8_192 + 16_384 + 2_048,
            ),
            (
                Q8_0,
                V2Tile::T128x128,
                "qgemm2_q8_0_128x128",
                128,
                4,
                16_384 + 16_384 + 2_048,
            ),
            // d, dmin 128 f32; scales, mins 128×8 bytes; activation sums bm×8 i32.
            (
                Q4K,
                V2Tile::T64x128,
                "qgemm2_k32_64x128",
                64,
                2,
                16_384 + 32_768 + 1_024 + 2_048 + 2_048,
            ),
            (
                Q5K,
                V2Tile::T128x128,
                "qgemm2_k32_128x128",
                128,
                2,
                2 * 32_768 + 1_024 + 2_048 + 4_096,
            ),
            // d 128 f32; scales 128×16 bytes.
            (
                Q6K,
                V2Tile::T64x128,
                "qgemm2_q6k_64x128",
                64,
                2,
                16_384 + 32_768 + 512 + 2_048,
            ),
            (
                Q6K,
                V2Tile::T128x128,
                "qgemm2_q6k_128x128",
                128,
                2,
                2 * 32_768 + 512 + 2_048,
            ),
            // Q8_0 warp-specialized: a producer warp more, two mbarriers a stage; the others are T128x128.
            (
                Q8_0,
                V2Tile::T128x128Ws,
                "qgemm2_q8_0_128x128ws",
                128,
                4,
                16_384 + 16_384 + 2_048,
            ),
            (
                Q6K,
                V2Tile::T128x128Ws,
                "qgemm2_q6k_128x128",
                128,
                2,
                2 * 32_768 + 512 + 2_048,
            ),
            (
                Q8_0,
                V2Tile::T96x128Ws,
                "qgemm2_q8_0_96x128ws",
                96,
                4,
                12_288 + 16_384 + 2_048,
            ),
            (
                Q8_0,
                V2Tile::T128x128Tma,
                "qgemm2_q8_0_128x128tma",
                128,
                4,
                16_384 + 16_384 + 2_048,
            ),
            (
                Q8_0,
                V2Tile::T96x128Tma,
                "qgemm2_q8_0_96x128tma",
                96,
                4,
                12_288 + 16_384 + 2_048,
            ),
            // K-quant TMA tiles: 2 stages rounded up to whole KiB (and the closed part's slot).
            (
                Q4K,
                V2Tile::T128x128Tma,
                "qgemm2_k32_128x128tma",
                128,
                2,
                71 * 1024,
            ),
            // 96 × 256 + 128 × 256 + d, dmin 512 each + scales, mins 1,024 each + sums 96 × 32 = 62 KiB.
            (
                Q5K,
                V2Tile::T96x128Tma,
                "qgemm2_k32_96x128tma",
                96,
                2,
                62 * 1024,
            ),
            (
                Q6K,
                V2Tile::T96x128Tma,
                "qgemm2_q6k_96x128tma",
                96,
                2,
                59 * 1024,
            ),
            (
                Q6K,
                V2Tile::T128x128Tma,
                "qgemm2_q6k_128x128tma",
                128,
                2,
                67 * 1024,
            ),
            (
                Q5K,
                V2Tile::T96x128Ws,
                "qgemm2_k32_128x128",
                128,
                2,
                2 * 32_768 + 1_024 + 2_048 + 4_096,
            ),
        ];
        for (format, tile, kernel, bm, stages, stage_bytes) in cases {
            let p = v2_tile_plan(format, tile);
            let tma = kernel.ends_with("tma");
            let ws = tma || kernel.ends_with("ws");
            assert_eq!((p.tma, p.hopper_only), (tma, ws), "{kernel}");
            // The swizzled TMA boxes need stages that start on 1,024-byte boundaries.
            assert!(!tma || stage_bytes % 1024 == 0, "{kernel}");
            assert_eq!(
                (p.kernel, p.family, p.bm, p.bn, p.stages, p.threads),
                (
                    kernel,
                    Family::V2,
                    bm,
                    128,
                    stages,
                    if ws { 384 } else { 256 }
                )
            );
            let barriers = if ws { 16 * stages } else { 0 };
            let align = if tma { 1024 } else { 0 };
            // The warp-specialized tiles' copy of G = 1's closed part where it fits: bm rows of 136
            // floats (every warp-specialized tile of this list has it).
            let staged = (stages * stage_bytes + barriers).next_multiple_of(128);
            let slot = if ws { 4 * bm * 136 } else { 0 };
            assert!(staged + slot + align <= 227 * 1024, "{kernel}");
            assert_eq!(p.smem_bytes, staged + slot + align, "{kernel}");
            assert_eq!(p.scratch_in_smem, ws, "{kernel}");
            assert_eq!(p.bk % format.block_len(), 0);
            // The CTAs per SM it is built for fit an H200; every tile that can run on an A100 fits its
            // 163 KiB a CTA (the K-quant TMA tiles take 214 KiB: Hopper only).
            assert_eq!(
                DeviceLimits::H200.resident_ctas(&p),
                p.ctas_per_sm,
                "{kernel}"
            );
            assert!(
                p.hopper_only || p.smem_bytes <= 163 * 1024,
                "{kernel}: {} bytes",
                p.smem_bytes
            );
        }
    }

    /// The chained Q8_0 tile: Smem<FMT_Q8_0, 128, 128, 1024, true>::STAGE is A, B, 4 blocks of scales
    /// and the group corrections (35,328 bytes, rounded to 35 KiB), four stages; explicit only, outside
    /// `ALL`, and the other formats fall back to their TMA tile.
    #[test]
    fn the_chained_tile_plan() {
        let p = v2_tile_plan(WeightFormat::Q8_0, V2Tile::T128x128Wgc);
        assert_eq!(
            (p.kernel, p.bm, p.bn, p.bk, p.stages, p.threads),
            ("qgemm2_q8_0_128x128wgc", 128, 128, 128, 4, 384)
        );
        assert!(p.tma && p.hopper_only);
        // Stages and barriers, rounded to 128 bytes; G = 1's closed part (128 rows of 136 floats);
        // the TMA alignment.
        assert_eq!(
            p.smem_bytes,
            (4 * 35 * 1024 + 16 * 4_usize).next_multiple_of(128) + 4 * 128 * 136 + 1024
        );
        assert_eq!(DeviceLimits::H200.resident_ctas(&p), 1);
        assert!(!V2Tile::ALL.contains(&V2Tile::T128x128Wgc));
        assert!(!V2Tile::T128x128Wgc.automatic());
        assert!(V2Tile::T128x128Wgc.chained(WeightFormat::Q8_0));
        for format in [WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K] {
            assert!(!V2Tile::T128x128Wgc.chained(format));
            assert_eq!(
                v2_tile_plan(format, V2Tile::T128x128Wgc),
                v2_tile_plan(format, V2Tile::T128x128Tma)
            );
        }
        assert!(V2Tile::ALL.iter().all(|t| !t.chained(WeightFormat::Q8_0)));
        assert!(p.scratch_in_smem);
        // The weight-plane tile has no room for the slot (3 stages of 70 KiB): its launches keep the
        // global scratch buffer.
        assert!(!v2_tile_plan(WeightFormat::Q4K, V2Tile::T128x64Wgp).scratch_in_smem);
        assert!(!v2_tile_plan(WeightFormat::Q8_0, V2Tile::T128x128).scratch_in_smem);
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let v: Vec<u32> = (0..6).collect();
        assert_eq!(transpose(&v, 2, 3), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(transpose(&transpose(&v, 2, 3), 3, 2), v);
        assert!(transpose::<f32>(&[], 0, 5).is_empty());
    }

    /// Persistent CTAs: one a resident slot (132 on an H200) or one a tile if fewer; only the
    /// warp-specialized mma.sync tiles, and not before Hopper.
    #[test]
    fn persistent_launches() {
        let h200 = DeviceLimits::H200;
        for (tile, m, n, ctas) in [
            (V2Tile::T128x128Tma, 2048, 17408, 132u32),
            (V2Tile::T96x128Tma, 275, 34816, 132),
            (V2Tile::T128x128Tma, 128, 1024, 8),
        ] {
            let p = plan_launch(
                GemmKernel::V2Persistent { tile },
                Family::V2,
                WeightFormat::Q8_0,
                m,
                n,
                5120,
                &h200,
            )
            .unwrap();
            assert_eq!(p.persistent_ctas, ctas, "{tile:?} {m}×{n}");
            assert_eq!(p.grid(m, n), (ctas, 1, 1));
            assert_eq!((p.part_groups, p.tail(m, n)), (1, None));
        }
        for (tile, format) in [
            (V2Tile::T128x64Wgp, WeightFormat::Q4K),
            (V2Tile::T128x128Wgc, WeightFormat::Q8_0),
            (V2Tile::T128x128, WeightFormat::Q8_0),
            (V2Tile::T128x128Ws, WeightFormat::Q4K),
            (V2Tile::T128x128Tma, WeightFormat::Q4K),
            (V2Tile::T96x128Tma, WeightFormat::Q6K),
        ] {
            let e = plan_launch(
                GemmKernel::V2Persistent { tile },
                Family::V2,
                format,
                2048,
                4096,
                4096,
                &h200,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("persistent"), "{e}");
        }
        // The automatic plan: persistent from 12 tiles a CTA on (5120 × 17408: 136 column tiles, so
        // M = 2,048 is 2,176 tiles, 16.5 a CTA; M = 275 with the 96-row tile 816, 6.2 a CTA).
        let auto = |m: usize| {
            plan_launch(
                GemmKernel::Auto,
                Family::V2,
                WeightFormat::Q8_0,
                m,
                17408,
                5120,
                &h200,
            )
            .unwrap()
        };
        let big = auto(2048);
        assert!(big.tile.unwrap().hopper_only);
        if big.part_groups == 1 && big.tail(2048, 17408).is_none() {
            assert_eq!(big.persistent_ctas, 132);
            assert_eq!(big.grid(2048, 17408), (132, 1, 1));
        }
        assert_eq!(auto(8192).persistent_ctas, 132);
        assert_eq!(auto(275).persistent_ctas, 0);
        assert_eq!(auto(64).persistent_ctas, 0);
        // The K-quants never (their kernels have no tile loop).
        let q4 = plan_launch(
            GemmKernel::Auto,
            Family::V2,
            WeightFormat::Q4K,
            8192,
            17408,
            5120,
            &h200,
        )
        .unwrap();
        assert_eq!(q4.persistent_ctas, 0);
        let ampere = DeviceLimits {
            compute_major: 8,
            ..h200
        };
        let kernel = GemmKernel::V2Persistent {
            tile: V2Tile::T128x128Tma,
        };
        assert!(plan_launch(
            kernel,
            Family::V2,
            WeightFormat::Q8_0,
            512,
            4096,
            4096,
            &ampere
        )
        .is_err());
    }

    #[test]
    fn the_v2_raster_order_visits_every_tile_once() {
        for (m_tiles, n_tiles) in [
            (1usize, 1usize),
            (1, 136),
            (3, 5),
            (16, 136),
            (128, 136),
            (33, 7),
        ] {
            for gm in [1usize, 2, 7, 8, 25, m_tiles, m_tiles + 5] {
                let mut seen = vec![false; m_tiles * n_tiles];
                for pid in 0..m_tiles * n_tiles {
                    let (r, c) = v2_tile_of(pid, m_tiles, n_tiles, gm);
                    assert!(
                        r < m_tiles && c < n_tiles,
                        "{m_tiles}×{n_tiles} gm={gm} pid={pid}"
                    );
                    assert!(!std::mem::replace(&mut seen[r * n_tiles + c], true));
                }
            }
        }
        // A whole-M group walks tile rows fastest (v1's order).
        assert_eq!(v2_tile_of(17, 16, 136, 16), (1, 1));
    }

    #[test]
    fn a_tail_split_runs_every_part_of_every_tile_once_and_its_tail_is_a_rectangle() {
        let p = v2_tile_plan(WeightFormat::Q8_0, V2Tile::T96x128Tma);
        for (m, n) in [
            (275usize, 34816usize),
            (96, 128),
            (1000, 1001),
            (5000, 700),
            (1, 300),
        ] {
            let (m_tiles, n_tiles) = (m.div_ceil(p.bm), n.div_ceil(p.bn));
            for gm in [1usize, 2, 3, 7, m_tiles] {
                for cols in [1usize, 2, 3, n_tiles, n_tiles + 4] {
                    let tail = tail_split(&p, m, n, gm, cols).unwrap();
                    let plan = LaunchPlan {
                        tile: Some(p),
                        part_groups: 1,
                        group_m: gm as u32,
                        tail_cols: cols as u32,
                        persistent_ctas: 0,
                    };
                    assert_eq!(plan.tail(m, n), Some(tail));
                    let ctas = plan.grid(m, n).0 as usize;
                    assert_eq!(ctas, tail.base + 4 * tail.tiles);
                    // parts[tile] = bit mask of the parts its CTAs run.
                    let mut parts = vec![0u8; m_tiles * n_tiles];
                    for pid in 0..ctas {
                        let ((r, c), z, g) = v2_cta_of(pid, m_tiles, n_tiles, gm, tail.base);
                        let mask = if g == 1 { 0b1111 } else { 1u8 << z };
                        let cell = &mut parts[r * n_tiles + c];
                        assert_eq!(
                            *cell & mask,
                            0,
                            "{m}×{n} gm={gm} cols={cols}: tile ({r},{c}) twice"
                        );
                        *cell |= mask;
                        // Tail CTAs, and only they, cover the rectangle r0.. × c0.. of whole tiles.
                        let inside = r * p.bm >= tail.r0 && c * p.bn >= tail.c0;
                        assert_eq!(
                            g == 4,
                            inside,
                            "{m}×{n} gm={gm} cols={cols}: tile ({r},{c})"
                        );
                    }
                    assert!(
                        parts.iter().all(|&b| b == 0b1111),
                        "{m}×{n} gm={gm} cols={cols}"
                    );
                    assert_eq!(
                        tail.tiles,
                        (m_tiles - tail.r0 / p.bm) * (n_tiles - tail.c0 / p.bn)
                    );
                }
            }
        }
        // No tail: no columns, or a plan with more than one part group.
        assert_eq!(tail_split(&p, 275, 34816, 3, 0), None);
        let g2 = LaunchPlan {
            tile: Some(p),
            part_groups: 2,
            group_m: 3,
            tail_cols: 8,
            persistent_ctas: 0,
        };
        assert_eq!(g2.tail(275, 34816), None);
        assert_eq!(g2.grid(275, 34816), (816, 1, 2));
    }

    #[test]
    fn the_plan_splits_the_tail_where_the_last_wave_is_mostly_empty() {
        let h200 = DeviceLimits::H200;
        // 27B ffn_gate|up at a decision's M = 275: 3 × 272 tiles of 96 × 128, 6 waves and 24 tiles on
        // 132 SMs. The 24 tiles (8 columns of the 3 tile rows) become 96 quarter CTAs.
        let plan = plan_launch(
            GemmKernel::Auto,
            Family::V2,
            WeightFormat::Q8_0,
            275,
            34816,
            5120,
            &h200,
        )
        .unwrap();
        assert_eq!(plan.tile.unwrap().kernel, "qgemm2_q8_0_96x128tma");
        assert_eq!((plan.part_groups, plan.tail_cols), (1, 8));
        let tail = plan.tail(275, 34816).unwrap();
        assert_eq!(
            (tail.base, tail.tiles, tail.r0, tail.c0),
            (792, 24, 0, 264 * 128)
        );
        assert_eq!(plan.grid(275, 34816), (792 + 96, 1, 1));
        let p = plan.tile.unwrap();
        let plain = model_seconds(&p, &h200, 275, 34816, 5120, 1).unwrap();
        let split = model_plan_seconds(&plan, &h200, 275, 34816, 5120).unwrap();
        assert!(split < 0.95 * plain, "{split} vs {plain}");
        // Whole waves need no tail: 128 × 132 tiles of 128 × 128.
        let p128 = v2_tile_plan(WeightFormat::Q8_0, V2Tile::T128x128Tma);
        assert_eq!(
            tail_candidate(&p128, &h200, 128 * 128, 132 * 128, 5120),
            None
        );
        // Two waves and 8 tiles (M = 256, 2 × 136 tiles): the 8 tiles, 4 columns of 2 tile rows.
        assert_eq!(tail_candidate(&p128, &h200, 256, 17408, 5120), Some(4));
        // One wave and 4 tiles: no tail (measured slower than a split launch).
        assert_eq!(tail_candidate(&p128, &h200, 128, 17408, 5120), None);
        let small = plan_launch(
            GemmKernel::Auto,
            Family::V2,
            WeightFormat::Q4K,
            64,
            17408,
            5120,
            &h200,
        )
        .unwrap();
        assert_eq!(small.tail_cols, 0, "{small:?}");
        // An explicit tail needs one part group.
        let bad = GemmKernel::V2 {
            tile: V2Tile::T96x128Tma,
            part_groups: 2,
            tail_cols: 8,
        };
        let err = plan_launch(bad, Family::V2, WeightFormat::Q8_0, 275, 34816, 5120, &h200)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tail split"), "{err}");
    }

    #[test]
    fn raster_groups_bound_the_activation_rows_only_when_they_outgrow_l2() {
        let p = v2_tile_plan(WeightFormat::Q8_0, V2Tile::T128x128);
        assert_eq!(group_m(&p, 2048, 5120), 16); // 10 MiB of activations: all 16 tile rows
        assert_eq!(group_m(&p, 16384, 5120), 25); // 16 MiB / (128 · 5120) rows per group
        assert_eq!(group_m(&p, 16384, 17408), 7);
        assert_eq!(group_m(&p, 1, 5120), 1);
    }

    #[test]
    fn the_chooser_fills_the_gpu_and_falls_back_where_tiles_do_not_fit() {
        use WeightFormat::*;
        let h200 = DeviceLimits::H200;
        // Big M: whole reductions per CTA on the big (warp-specialized on Hopper) tile.
        let big = plan_launch(
            GemmKernel::Auto,
            Family::V2,
            Q8_0,
            16384,
            17408,
            5120,
            &h200,
        )
        .unwrap();
        let t = big.tile.unwrap();
        assert_eq!((t.kernel, big.part_groups), ("qgemm2_q8_0_128x128tma", 1));
        // 128 · 136 tiles, 132 a wave: persistent CTAs, one an SM.
        assert_eq!(big.grid(16384, 17408), (132, 1, 1));
        // Decode: 40 column tiles alone would leave most SMs idle: split the reduction.
        let decode = plan_launch(GemmKernel::Auto, Family::V2, Q8_0, 1, 5120, 5120, &h200).unwrap();
        assert_eq!(decode.tile.unwrap().family, Family::V2);
        assert!(decode.part_groups > 1, "{decode:?}");
        // The modelled time of the choice is the smallest over every automatic tile and G; the
        // explicit-only tiles are never chosen.
        for (format, m, n, k) in [
            (Q8_0, 256, 17408, 5120),
            (Q4K, 512, 5120, 17408),
            (Q4K, 64, 17408, 5120),
            (Q6K, 2048, 6144, 5120),
        ] {
            let chosen = plan_launch(GemmKernel::Auto, Family::V2, format, m, n, k, &h200).unwrap();
            let ct = chosen.tile.unwrap();
            assert!(!ct.kernel.contains("wg"), "{format:?} {m}×{n}×{k}: {ct:?}");
            let best = model_plan_seconds(&chosen, &h200, m, n, k).unwrap();
            for tile in V2Tile::ALL.into_iter().filter(|t| t.automatic()) {
                let plan = v2_tile_plan(format, tile);
                for g in [1, 2, 4] {
                    let t = model_seconds(&plan, &h200, m, n, k, g).unwrap();
                    assert!(
                        best <= t,
                        "{format:?} {m}×{n}×{k}: {ct:?} G={} vs {tile:?} G={g}",
                        chosen.part_groups
                    );
                }
                if let Some(cols) = tail_candidate(&plan, &h200, m, n, k) {
                    let t = model_seconds_tail(&plan, &h200, m, n, k, cols as usize).unwrap();
                    assert!(
                        best <= t,
                        "{format:?} {m}×{n}×{k}: {chosen:?} vs {tile:?} tail {cols}"
                    );
                }
            }
        }
        // PRISM_QGEMM=v1 (or an explicit family) gives v1 with its own part-group rule.
        let v1 = plan_launch(GemmKernel::Auto, Family::V1, Q8_0, 128, 5120, 5120, &h200).unwrap();
        assert_eq!(
            (v1.tile.unwrap().kernel, v1.part_groups),
            ("qgemm_q8_0_64x64", 2)
        );
        let v1b = plan_launch(
            GemmKernel::AutoFamily(Family::V1),
            Family::V2,
            Q8_0,
            128,
            5120,
            5120,
            &h200,
        );
        assert_eq!(v1b.unwrap(), v1);
        // An sm_89-sized GPU (99 KiB a CTA): no v2 tile fits, Q8_0 runs v1 (68 KiB), the K-quants'
        // v1 (105 KiB) does not fit either: the plain kernel.
        let ada = DeviceLimits {
            sm_count: 128,
            smem_per_block: 99 * 1024,
            smem_per_sm: 100 * 1024,
            compute_major: 8,
        };
        let q8 = plan_launch(GemmKernel::Auto, Family::V2, Q8_0, 512, 4096, 4096, &ada).unwrap();
        assert_eq!(q8.tile.unwrap().family, Family::V1);
        let q4 = plan_launch(GemmKernel::Auto, Family::V2, Q4K, 512, 4096, 4096, &ada).unwrap();
        assert_eq!(q4.tile, None);
        // An explicit tile that does not fit is an error naming the kernel.
        let explicit_error = |tile: V2Tile, limits: &DeviceLimits| {
            let kernel = GemmKernel::V2 {
                tile,
                part_groups: 1,
                tail_cols: 0,
            };
            plan_launch(kernel, Family::V2, Q8_0, 512, 4096, 4096, limits)
                .unwrap_err()
                .to_string()
        };
        let err = explicit_error(V2Tile::T128x128, &ada);
        assert!(err.contains("qgemm2_q8_0_128x128"), "{err}");
        // An A100-sized GPU (163 KiB a CTA, 164 KiB an SM): the 64×128 tiles run one CTA per SM.
        let a100 = DeviceLimits {
            sm_count: 108,
            smem_per_block: 163 * 1024,
            smem_per_sm: 164 * 1024,
            compute_major: 8,
        };
        assert_eq!(a100.resident_ctas(&v2_tile_plan(Q8_0, V2Tile::T64x128)), 1);
        // The warp-specialized Q8_0 tile is planned on Hopper only (with the shared-memory copy of
        // its closed part it also needs more than the A100's memory).
        let ws = v2_tile_plan(Q8_0, V2Tile::T128x128Ws);
        assert!(ws.hopper_only);
        assert_eq!(a100.resident_ctas(&ws), 0);
        let err = explicit_error(V2Tile::T128x128Ws, &a100);
        assert!(err.contains("qgemm2_q8_0_128x128ws"), "{err}");
        assert_eq!(h200.resident_ctas(&ws), 1);
        let on_a100 =
            plan_launch(GemmKernel::Auto, Family::V2, Q8_0, 2048, 5120, 5120, &a100).unwrap();
        assert_eq!(on_a100.tile.unwrap().kernel, "qgemm2_q8_0_128x128");
        let on_h200 =
            plan_launch(GemmKernel::Auto, Family::V2, Q8_0, 2048, 5120, 5120, &h200).unwrap();
        assert_eq!(on_h200.tile.unwrap().kernel, "qgemm2_q8_0_128x128tma");
    }

    #[test]
    fn the_min_sum_split_of_the_v2_k_quant_kernel_is_exact_over_the_whole_range() {
        // v2 computes M_b = Σ m·s as 64·Σ m·h + Σ m·l on int8 tensor cores, h = s >> 6, l = s & 63, for
        // activation sums s of 32 values in [−127, 127] and 6-bit mins m.
        let limit = 32 * 127;
        for s in -limit..=limit {
            let (h, l) = (s >> 6, s & 63);
            assert!(i8::try_from(h).is_ok() && (0..64).contains(&l), "s = {s}");
            assert_eq!(64 * h + l, s);
        }
        // The largest |64·Σ m·h + Σ m·l| over 8 sub-blocks stays far inside i32.
        let worst: i64 = 8 * 63 * (64 * 64 + 63);
        assert!(worst < i64::from(i32::MAX));
    }
}
