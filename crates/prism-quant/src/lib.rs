//! W8A8 (int8) and W4A8 weight/activation formats and the exact integer matmuls.
//!
//! Q8_0 weights are re-blocked once at load into int8 with one f32 scale per output row and run of 128
//! inputs; Q4_K / Q5_K / Q6_K weights run on the file's own integers, sub-block scales and mins.
//! Activations are int8 with a dynamic scale per row and run of 128 inputs, computed from the row's own
//! values (no calibration). Products are summed exactly in integers per run; the runs are combined in
//! f32 in an order that depends only on the reduction length. The CPU code here ([`kernel`]) is **the
//! reference**: a device kernel must return the same bits for every output.
//!
//! # The arithmetic, exactly
//!
//! Notation: `x` an f32 activation row of length `K`, `W` a weight of `N` rows of `K`, `y = x · Wᵀ`.
//! `fma(a, b, c)` is IEEE fused multiply-add (one rounding), `+`, `·` and `/` are IEEE f32 with round to
//! nearest even (CUDA: `__fadd_rn`, `__fmul_rn`, `__fdiv_rn`; no contraction into FMAs except the
//! `fma`s written here), `f32(i)` converts an i32 to f32 rounding to nearest even (`__int2float_rn`),
//! `rint` rounds to the nearest integer, ties to even.
//!
//! 0. **Runs.** The inputs are cut into runs of [`RUN`] = 128 columns: run `r` is columns
//!    `128·r .. min(128·r + 128, K)`, `R = ⌈K / 128⌉` runs (only a Q8_0 weight can have a shorter last
//!    run, of a multiple of 32; K-quant rows are whole 256-blocks, so a run is one half of a block).
//! 1. **Activation scale** (per row and run, from that row's own values): `amax = max |x_i|` over the
//!    run (exact). If `amax < 2⁻¹²⁰` ([`AMAX_MIN`]) the run quantizes to zeros with `sa = 0`; otherwise
//!    `sa = amax / 127` and `inv = 127 / amax`, two f32 divisions.
//! 2. **Activation quantization**: `qa = clamp(rint(x · inv), −127, 127)`, one f32 multiplication,
//!    clamp after rounding (−128 is never produced). Non-finite `x` is an error
//!    ([`QuantError::NonFiniteActivation`], naming the row and column).
//! 3. **Weights** (once, at load; see [`weight`]):
//!    - Q8_0 (blocks of 32, `q ∈ [−128, 127]`, f16 `d_b`): a run's scale is `sw = max |d_b|` over the
//!      (up to) four blocks of the run, the f16 value widened exactly to f32; each weight becomes
//!      `q' = clamp(rint(q · d_b / sw), −128, 127)`, the rational `q·d_b/sw` rounded exactly (computed
//!      as `(f64(q)·f64(d_b)) / f64(sw)` in IEEE f64, which is exact to the last bit needed: see
//!      [`weight::reblock_value`]). A negative `d_b` flips the sign of its block's weights; a block with
//!      `d_b = 0` gives zeros; a run whose four `d_b` are all 0 has `sw = 0` and zero weights; only
//!      `q = −128` with `d_b = −sw` reaches `+128`, clamped to 127. A non-finite `d_b` is refused at
//!      load ([`QuantError::NonFiniteScale`]). ([`Q8Scales::PerRow`], one `sw` per row, is the measured
//!      alternative; the product uses [`Q8Scales::PerRun`].)
//!    - Q4_K / Q5_K (blocks of 256 = 8 sub-blocks of 32; `q ∈ [0,15]` / `[0,31]`, 6-bit `sc_j`, `m_j`,
//!      f16 `d_b`, `dmin_b`) and Q6_K (blocks of 256 = 16 sub-blocks of 16; `q − 32 ∈ [−32, 31]`,
//!      signed 8-bit `sc_j`, f16 `d_b`): as the file stores them.
//! 4. **Integer run sums** (exact in i32; any summation order gives the same integer, so a kernel may
//!    use dp4a / IMMA / widening multiplies freely):
//!    - Q8_0: `I_r = Σ_{i∈r} q'_i·qa_i` (|I_r| ≤ 2,080,768 < 2²⁴, so `f32(I_r)` is exact).
//!    - Q4_K / Q5_K (run `r` = half `h = r mod 2` of block `b = ⌊r/2⌋`, sub-blocks `j = 4h .. 4h+4`):
//!      `I_r = Σ_j sc_j · Σ_{i∈j} q_i·qa_i` (|I_r| ≤ 15,361,920 for Q4_K, 31,749,696 for Q5_K),
//!      `M_r = Σ_j m_j · Σ_{i∈j} qa_i` (|M_r| ≤ 1,024,128).
//!    - Q6_K (sub-blocks `j = 8h .. 8h+8` of 16): `I_r = Σ_j sc_j · Σ_{i∈j} (q_i − 32)·qa_i`
//!      (|I_r| ≤ 66,584,576).
//!
//!    `f32(I_r)` is exact up to 2²⁴ and rounds to nearest even above (Q5_K, Q6_K only): deterministic.
//! 5. **Promotion, once per run**: the run's weight factor is `sw_r` (Q8_0) or `d_b` (K-quants), and
//!    `acc = fma(f32(I_r), sa_r · sw_r, acc)` — the product `sa_r · sw_r` rounded once (IEEE
//!    multiplication commutes: the operand order is free) — then for Q4_K / Q5_K
//!    `acc = fma(f32(M_r), sa_r · (−dmin_b), acc)`. A zero run (`sa_r = 0`) adds `+0`.
//! 6. **Order**: the `R` runs form four contiguous parts, part `p` = runs `⌊p·R/4⌋ .. ⌊(p+1)·R/4⌋`
//!    ([`kernel::part_bounds`]); each part starts from `+0.0` and takes its runs in increasing order
//!    (step 5); then `y = (p_0 + p_1) + (p_2 + p_3)`. No scale multiplies the result.
//!
//! Nothing depends on the number of rows, the batch, the tiling or the threads: a row's scales and sums
//! come from that row alone. For tensor parallelism that splits `K` over 2 or 4 devices, each device
//! takes whole parts (2 or 1 of them; a part is whole runs, so each device quantizes its own columns
//! with the same scales), and the partial results are combined with the same tree, giving the
//! single-device bits.
//!
//! # Pieces
//! - [`weight`]: [`QuantWeight`] — a tensor's GGUF bytes unpacked (one signed byte per weight, integer
//!   sub-block scales/mins, f32 scales), Q8_0 re-blocked; `dequantize_row` gives the values the integer
//!   path multiplies (for the K-quants ggml's own dequantization bit for bit).
//! - [`activation`]: the dynamic per-(row, run) quantization.
//! - [`kernel`]: the CPU reference (rayon over output strips).
//! - [`op`]: [`QuantMatmul`], the candle `CustomOp1`, and on a CUDA tensor the device path below.
//! - `cuda` (feature `cuda`): the contract on the device (`kernels/quant_gemm.cu`): a per-(row, run)
//!   activation quantizer; for Q8_0 on Hopper a warpgroup-MMA tile fed by TMA; elsewhere (K-quants,
//!   other GPUs) a simple kernel, one thread per output with dp4a. Both are checked against [`kernel`]
//!   bit for bit by `prism cuda-check`.
//! - [`schedule`]: which CTA of the Hopper tile's persistent grid computes which share of which tile.
//! - `cuda_launch` (feature `cuda`): loading and launching the project's CUDA kernels (used by
//!   prism-model's float kernels).

pub mod activation;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_launch;
pub mod error;
pub mod kernel;
pub mod op;
pub mod schedule;
pub mod weight;

pub use activation::{quantize_rows, run_count, QuantizedRows, AMAX_MIN, QMAX, RUN};
pub use error::{QuantError, Result};
pub use kernel::{matmul, matmul_share, part_bounds, PartSpan, PARTS};
pub use op::QuantMatmul;
pub use weight::{Q8Scales, QuantWeight, WeightFormat, WeightInfo};
