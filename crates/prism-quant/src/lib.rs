//! W8A8 (int8) and W4A8 formats and the exact integer matmuls.
//!
//! Weights run as the file stores them — Q8_0 blocks as int8 with their scales, Q4_K / Q5_K / Q6_K on
//! their own sub-block scales and mins — and activations as int8 with one static scale per linear input.
//! Products are summed exactly in integers per block; the blocks are combined in f32 in an order that
//! depends only on the reduction length. The CPU code here ([`kernel`]) is **the reference**: a device
//! kernel must return the same bits for every output.
//!
//! # The arithmetic, exactly
//!
//! Notation: `x` an f32 activation row of length `K`, `W` a weight of `N` rows of `K`, `y = x · Wᵀ`.
//! `fma(a, b, c)` is IEEE fused multiply-add (one rounding), `+` and `·` are IEEE f32 with round to
//! nearest even, `f32(i)` converts an i32 to f32 rounding to nearest even (`__int2float_rn`).
//!
//! 1. **Activation scale** (per linear input, from calibration): `scale = absmax / 127`,
//!    `inv_scale = 127 / absmax`, both f32 divisions done once on the host; kernels receive the bits.
//! 2. **Activation quantization** (per element, per row, independent of other rows):
//!    `qa = clamp(rint(x · inv_scale), −127, 127)`, one f32 multiplication, `rint` = round half to
//!    even, clamp after rounding. Non-finite `x` is an error ([`QuantError::NonFiniteActivation`]);
//!    on CUDA the model's path instead makes every output of that row NaN, without a synchronization
//!    (other rows keep their bits; see [`op`] for where each path reports it).
//! 3. **Integer block sums** (exact in i32; any summation order gives the same integer, so a kernel
//!    may use dp4a / IMMA / widening multiplies freely as long as nothing saturates):
//!    - Q8_0 (blocks of 32, `q ∈ [−128, 127]`): `D_b = Σ_{i<32} q_i·qa_i` (|D_b| ≤ 520,192).
//!    - Q4_K / Q5_K (blocks of 256 = 8 sub-blocks of 32; `q ∈ [0,15]` / `[0,31]`, 6-bit `sc_j`, `m_j`):
//!      `D_b = Σ_j sc_j · Σ_{i∈j} q_i·qa_i` (|D_b| ≤ 63,495,936 for Q5_K, 30,723,840 for Q4_K),
//!      `M_b = Σ_j m_j · Σ_{i∈j} qa_i` (|M_b| ≤ 2,048,256).
//!    - Q6_K (blocks of 256 = 16 sub-blocks of 16; `q − 32 ∈ [−32, 31]`, signed 8-bit `sc_j`):
//!      `D_b = Σ_j sc_j · Σ_{i∈j} (q_i − 32)·qa_i` (|D_b| ≤ 133,169,152).
//! 4. **Block reduction** in a fixed order that depends only on the block count `nb = K / block`:
//!    four contiguous parts, part `p` = blocks `⌊p·nb/4⌋ .. ⌊(p+1)·nb/4⌋` ([`kernel::part_bounds`]);
//!    each part starts from `+0.0` and runs over its blocks in increasing order
//!    `acc = fma(d_b, f32(D_b), acc)`, and for Q4_K/Q5_K then `acc = fma(−dmin_b, f32(M_b), acc)`
//!    (`d_b`, `dmin_b` the block's f16 scales widened exactly to f32). `f32(D_b)` is exact up to 2^24
//!    and rounds to nearest even above (K-quants only): deterministic on every device.
//! 5. **Combination**: `t = (p_0 + p_1) + (p_2 + p_3)`, then `y = t · scale`.
//!
//! Nothing depends on the number of rows, the batch, the tiling or the threads. For tensor parallelism
//! that splits `K` over 2 or 4 devices, each device computes whole parts (2 or 1 of them) and the partial
//! results are combined with the same tree, giving the single-device bits.
//!
//! # Pieces
//! - [`weight`]: [`QuantWeight`] — a tensor's GGUF bytes unpacked (one signed byte per weight, integer
//!   sub-block scales/mins, f32 block scales); `dequantize_row` reproduces ggml's dequantization bit for
//!   bit (embedding lookups).
//! - [`activation`]: [`ActivationScale`], the static quantization.
//! - [`kernel`]: the CPU reference (rayon over output strips).
//! - [`chain`]: the chained Q8_0 reduction, a measured candidate for step 4 (one FFMA an output and
//!   block) with its own CPU reference; only the explicit chained CUDA tile computes it.
//! - [`op`]: [`QuantMatmul`], the candle `CustomOp1` (CPU), whose `forward` runs [`cuda`] on a GPU.

pub mod activation;
pub mod chain;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_launch;
pub mod cuda_plan;
pub mod error;
pub mod kernel;
pub mod op;
pub mod weight;

pub use activation::{quantize_rows, ActivationScale, QuantizedRows, QMAX};
pub use error::{QuantError, Result};
pub use kernel::{matmul, part_bounds, PARTS};
pub use op::{NonFiniteMode, QuantMatmul};
pub use weight::{QuantWeight, WeightFormat, WeightInfo};
