//! Quantized weights unpacked once into a layout the integer kernels read directly: one signed byte
//! per weight, the integer sub-block scales and mins, and f32 scales.
//!
//! - Q4_K / Q5_K / Q6_K: as the file stores them (the f16 block scales widened exactly to f32);
//!   [`QuantWeight::dequantize_row`] gives back ggml's own dequantization bit for bit.
//! - Q8_0: **re-blocked** at load into one f32 scale per row and run of [`RUN`] inputs (or per row,
//!   [`Q8Scales::PerRow`]): the run's scale `sw` is the largest `|d_b|` of its blocks and each weight
//!   becomes [`reblock_value`]`(q, d_b, sw)`. The same file always gives the same integers.

use std::ops::Range;

use half::f16;
use prism_gguf::blocks::scale_min_k4;
use prism_gguf::{GgmlType, QK_K};
use rayon::prelude::*;

use crate::activation::{run_count, RUN};
use crate::error::{QuantError, Result};

/// The block formats the integer path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// In the file, blocks of 32: `x = d·q`, `q ∈ [−128, 127]` (the quantizer writes `[−127, 127]`).
    /// Unpacked, re-blocked: `x = sw·q'` with one `sw` per row and run of 128 ([`reblock_value`]).
    Q8_0,
    /// Super-blocks of 256 in 8 sub-blocks of 32: `x = d·sc_j·q − dmin·m_j`, `q ∈ [0, 15]`,
    /// `sc_j, m_j ∈ [0, 63]`.
    Q4K,
    /// As [`Self::Q4K`] with a fifth bit: `q ∈ [0, 31]`.
    Q5K,
    /// Super-blocks of 256 in 16 sub-blocks of 16: `x = d·sc_j·(q − 32)`, `q − 32 ∈ [−32, 31]`,
    /// `sc_j ∈ [−128, 127]`.
    Q6K,
}

impl WeightFormat {
    /// The format of a ggml type, `None` for types the integer path does not run.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q8_0 => Some(Self::Q8_0),
            GgmlType::Q4_K => Some(Self::Q4K),
            GgmlType::Q5_K => Some(Self::Q5K),
            GgmlType::Q6_K => Some(Self::Q6K),
            _ => None,
        }
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4K => GgmlType::Q4_K,
            Self::Q5K => GgmlType::Q5_K,
            Self::Q6K => GgmlType::Q6_K,
        }
    }

    /// Elements per block: one f32 term (`d`, and `dmin`) of the reduction per block.
    pub const fn block_len(self) -> usize {
        match self {
            Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Elements per sub-block (one integer scale, and min).
    pub const fn sub_len(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4K | Self::Q5K => 32,
            Self::Q6K => 16,
        }
    }

    /// Sub-blocks per block.
    pub const fn subs_per_block(self) -> usize {
        self.block_len() / self.sub_len()
    }

    /// Whether the block has integer sub-block scales (all but Q8_0).
    pub const fn has_sub_scales(self) -> bool {
        !matches!(self, Self::Q8_0)
    }

    /// Whether the block has mins (`− dmin·m_j`): Q4_K and Q5_K.
    pub const fn has_mins(self) -> bool {
        matches!(self, Self::Q4K | Self::Q5K)
    }

    /// Bytes of one block in the file.
    pub fn block_bytes(self) -> usize {
        self.ggml_type().type_size()
    }
}

/// The granularity of a re-blocked Q8_0 weight's scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Q8Scales {
    /// One scale per row and run of [`RUN`] inputs (four Q8_0 blocks): the contract's format.
    #[default]
    PerRun,
    /// One scale per row (the largest `|d_b|` of the whole row), stored once per run so that the
    /// kernels are the same; kept to measure against (docs/correctness.md).
    PerRow,
}

/// One re-blocked Q8_0 weight: `clamp(rint(q · d / sw), −128, 127)` where `d` is the weight's own block
/// scale and `sw ≥ |d|` the run's (or row's) scale, both f16 values widened to f32; `sw = 0` gives 0.
///
/// The rational `q·d/sw` is rounded to the nearest integer, ties to even. Computing it as
/// `(f64(q)·f64(d)) / f64(sw)` in IEEE f64 gives exactly that: `q·d` is exact (8 × 11 significant
/// bits), the quotient is correctly rounded, an exact half-integer is representable (so stays a tie),
/// and any other quotient is at least `2⁻¹²·2^−Δ` from a half-integer (`Δ` the exponent gap between
/// `sw` and `d`) while the f64 error is below `2⁻³⁵·2^−Δ`, so the rounding cannot move it across one.
/// Only `q = −128` with `d = −sw` reaches +128, which clamps to 127.
#[inline]
pub fn reblock_value(q: i8, d: f32, sw: f32) -> i8 {
    if sw == 0.0 {
        return 0;
    }
    let t = (f64::from(q) * f64::from(d)) / f64::from(sw);
    t.round_ties_even().clamp(-128.0, 127.0) as i8
}

/// Re-blocks one unpacked Q8_0 row in place: `q` its `cols` integers, `d` its `cols / 32` block scales;
/// returns the row's `⌈cols / 128⌉` scales.
fn reblock_row(q: &mut [i8], d: &[f32], scales: Q8Scales) -> Vec<f32> {
    let per_block = WeightFormat::Q8_0.block_len();
    let blocks_per_run = RUN / per_block;
    let largest = |ds: &[f32]| ds.iter().fold(0f32, |m, v| m.max(v.abs()));
    let runs = run_count(q.len());
    let row_max = largest(d);
    let sw: Vec<f32> = (0..runs)
        .map(|r| match scales {
            Q8Scales::PerRun => {
                largest(&d[r * blocks_per_run..((r + 1) * blocks_per_run).min(d.len())])
            }
            Q8Scales::PerRow => row_max,
        })
        .collect();
    for (b, (qb, &db)) in q.chunks_mut(per_block).zip(d).enumerate() {
        let s = sw[b / blocks_per_run];
        for v in qb {
            *v = reblock_value(*v, db, s);
        }
    }
    sw
}

/// What a quantized weight is, apart from its numbers: enough to plan a product, check an input or name
/// the tensor in an error, also once the numbers live on a GPU only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightInfo {
    pub name: String,
    pub format: WeightFormat,
    /// Outputs.
    pub rows: usize,
    /// Inputs (the reduction length).
    pub cols: usize,
}

/// A [`QuantWeight`]'s arrays, borrowed (what a device upload copies).
#[derive(Debug, Clone, Copy)]
pub struct WeightArrays<'a> {
    pub q: &'a [i8],
    pub sub_scales: &'a [i8],
    pub sub_mins: &'a [i8],
    pub d: &'a [f32],
    pub dmin: &'a [f32],
}

/// A weight matrix of `rows` outputs × `cols` inputs (GGUF `[cols, rows]`, PyTorch `(rows, cols)`) in one
/// of the integer formats.
///
/// Layout (all row-major, row `n` of the matrix owning a contiguous run of each):
/// - `q`: `rows·cols` signed bytes, the integer weight of each element (Q8_0: the re-blocked `q'`;
///   Q4_K: the nibble; Q5_K: nibble + fifth bit; Q6_K: `q − 32`);
/// - `sub_scales`: `rows·cols/sub_len` integer scales (empty for Q8_0, whose sub-block scale is 1);
/// - `sub_mins`: `rows·cols/sub_len` integer mins (Q4_K/Q5_K only, else empty);
/// - `d`: Q8_0: `rows·⌈cols/128⌉` run scales `sw`; K-quants: `rows·cols/256` block scales (f16
///   widened to f32, exact);
/// - `dmin`: `rows·cols/block_len` block min-scales (Q4_K/Q5_K only, else empty).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantWeight {
    name: String,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    sub_scales: Vec<i8>,
    sub_mins: Vec<i8>,
    d: Vec<f32>,
    dmin: Vec<f32>,
}

/// GGUF bytes of the file cut into independent tasks of about this many bytes for the parallel unpack
/// (each task a whole number of blocks).
pub const UNPACK_TASK_BYTES: usize = 1 << 18;

/// `n` chunks of `v` of `size` elements, or `n` empty slices for an array the format does not have.
fn chunks_or_empty<T>(v: &mut [T], size: usize, n: usize) -> Vec<&mut [T]> {
    if v.is_empty() {
        (0..n).map(|_| <&mut [T]>::default()).collect()
    } else {
        v.chunks_mut(size).collect()
    }
}

/// A run of consecutive blocks: their GGUF bytes and the slices of the unpacked arrays they fill.
struct BlockRun<'a> {
    raw: &'a [u8],
    q: &'a mut [i8],
    d: &'a mut [f32],
    dmin: &'a mut [f32],
    sub_scales: &'a mut [i8],
    sub_mins: &'a mut [i8],
}

impl BlockRun<'_> {
    fn unpack(self, format: WeightFormat) {
        let block = format.block_len();
        let spb = format.subs_per_block();
        for (b, raw) in self.raw.chunks_exact(format.block_bytes()).enumerate() {
            let q = &mut self.q[b * block..(b + 1) * block];
            match format {
                WeightFormat::Q8_0 => {
                    self.d[b] = fp16(raw[0], raw[1]);
                    for (qi, &byte) in q.iter_mut().zip(&raw[2..34]) {
                        *qi = byte as i8;
                    }
                }
                WeightFormat::Q4K | WeightFormat::Q5K => {
                    self.d[b] = fp16(raw[0], raw[1]);
                    self.dmin[b] = fp16(raw[2], raw[3]);
                    let mut packed = [0u8; 12];
                    packed.copy_from_slice(&raw[4..16]);
                    for j in 0..8 {
                        let (sc, m) = scale_min_k4(j, &packed);
                        // 6-bit values: they fit an i8.
                        self.sub_scales[b * spb + j] = sc as i8;
                        self.sub_mins[b * spb + j] = m as i8;
                    }
                    let (qh, ql) = if format == WeightFormat::Q5K {
                        (Some(&raw[16..48]), &raw[48..176])
                    } else {
                        (None, &raw[16..144])
                    };
                    for c in 0..4 {
                        for l in 0..32 {
                            let byte = ql[32 * c + l];
                            let (mut lo, mut hi) = (byte & 0x0F, byte >> 4);
                            if let Some(qh) = qh {
                                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                            }
                            q[64 * c + l] = lo as i8;
                            q[64 * c + 32 + l] = hi as i8;
                        }
                    }
                }
                WeightFormat::Q6K => {
                    self.d[b] = fp16(raw[208], raw[209]);
                    for j in 0..16 {
                        self.sub_scales[b * spb + j] = raw[192 + j] as i8;
                    }
                    for n in 0..2 {
                        let ql = &raw[64 * n..64 * n + 64];
                        let qh = &raw[128 + 32 * n..128 + 32 * n + 32];
                        let q = &mut q[128 * n..128 * n + 128];
                        for l in 0..32 {
                            let v = [
                                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                            ];
                            for (i, v) in v.into_iter().enumerate() {
                                q[32 * i + l] = v as i8 - 32;
                            }
                        }
                    }
                }
            }
        }
    }
}

#[inline]
fn fp16(lo: u8, hi: u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

impl QuantWeight {
    /// Unpacks the GGUF bytes of tensor `name` (type `ty`, `rows` rows of `cols` elements), Q8_0
    /// re-blocked per row and run ([`Q8Scales::PerRun`]). Lengths are checked before anything is
    /// allocated; a non-finite Q8_0 block scale is [`QuantError::NonFiniteScale`].
    pub fn from_gguf(
        name: &str,
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        Self::from_gguf_with(name, ty, bytes, rows, cols, Q8Scales::PerRun)
    }

    /// [`Self::from_gguf`] with the given Q8_0 scale granularity (ignored for the K-quants).
    pub fn from_gguf_with(
        name: &str,
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        q8_scales: Q8Scales,
    ) -> Result<Self> {
        let format = WeightFormat::from_ggml(ty).ok_or_else(|| QuantError::UnsupportedType {
            tensor: name.to_string(),
            ty,
        })?;
        let block = format.block_len();
        if cols == 0 || cols % block != 0 {
            return Err(QuantError::PartialBlock {
                tensor: name.to_string(),
                ty,
                cols,
                block,
            });
        }
        let overflow = || QuantError::SizeOverflow {
            tensor: name.to_string(),
            rows,
            cols,
        };
        let n_elements = rows.checked_mul(cols).ok_or_else(overflow)?;
        let n_blocks = n_elements / block;
        let expected = n_blocks
            .checked_mul(format.block_bytes())
            .ok_or_else(overflow)?;
        if bytes.len() != expected {
            return Err(QuantError::ByteLength {
                tensor: name.to_string(),
                ty,
                rows,
                cols,
                expected,
                actual: bytes.len(),
            });
        }
        let n_subs = n_elements / format.sub_len();
        let mut w = QuantWeight {
            name: name.to_string(),
            format,
            rows,
            cols,
            q: vec![0; n_elements],
            sub_scales: if format.has_sub_scales() {
                vec![0; n_subs]
            } else {
                Vec::new()
            },
            sub_mins: if format.has_mins() {
                vec![0; n_subs]
            } else {
                Vec::new()
            },
            d: vec![0.0; n_blocks],
            dmin: if format.has_mins() {
                vec![0.0; n_blocks]
            } else {
                Vec::new()
            },
        };
        // Blocks are independent: unpack them in tasks of about UNPACK_TASK_BYTES of the file on the
        // rayon pool (a 27B file is ~27 GB of blocks; one thread unpacked ~1.5 GB/s). Every array is
        // cut at the same block boundaries, so each task owns its slices.
        let spb = format.subs_per_block();
        let task_blocks = (UNPACK_TASK_BYTES / format.block_bytes()).max(1);
        let n_tasks = n_blocks.div_ceil(task_blocks);
        let raw = bytes.chunks(task_blocks * format.block_bytes());
        let q = w.q.chunks_mut(task_blocks * block);
        let d = w.d.chunks_mut(task_blocks);
        let dmin = chunks_or_empty(&mut w.dmin, task_blocks, n_tasks);
        let sub_scales = chunks_or_empty(&mut w.sub_scales, task_blocks * spb, n_tasks);
        let sub_mins = chunks_or_empty(&mut w.sub_mins, task_blocks * spb, n_tasks);
        let tasks: Vec<_> = raw
            .zip(q)
            .zip(d)
            .zip(dmin)
            .zip(sub_scales)
            .zip(sub_mins)
            .map(|(((((raw, q), d), dmin), sub_scales), sub_mins)| BlockRun {
                raw,
                q,
                d,
                dmin,
                sub_scales,
                sub_mins,
            })
            .collect();
        tasks.into_par_iter().for_each(|run| run.unpack(format));
        if format == WeightFormat::Q8_0 {
            w.reblock_q8_0(q8_scales)?;
        }
        Ok(w)
    }

    /// Replaces the unpacked Q8_0 blocks (`q`, one `d` per 32) by the re-blocked integers and one
    /// scale per row and run, row by row on the rayon pool.
    fn reblock_q8_0(&mut self, q8_scales: Q8Scales) -> Result<()> {
        let block = self.format.block_len();
        if let Some(i) = self.d.iter().position(|d| !d.is_finite()) {
            return Err(QuantError::NonFiniteScale {
                tensor: self.name.clone(),
                row: i / (self.cols / block),
                col: i % (self.cols / block) * block,
                value: self.d[i],
            });
        }
        let (cols, blocks) = (self.cols, self.cols / block);
        let scales: Vec<Vec<f32>> = self
            .q
            .par_chunks_mut(cols)
            .zip(self.d.par_chunks(blocks))
            .map(|(q, d)| reblock_row(q, d, q8_scales))
            .collect();
        self.d = scales.concat();
        Ok(())
    }

    /// Name, format and shape.
    pub fn info(&self) -> WeightInfo {
        WeightInfo {
            name: self.name.clone(),
            format: self.format,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// The arrays in their layout (all row-major, see [`QuantWeight`]), empty where the format has none.
    pub fn arrays(&self) -> WeightArrays<'_> {
        WeightArrays {
            q: &self.q,
            sub_scales: &self.sub_scales,
            sub_mins: &self.sub_mins,
            d: &self.d,
            dmin: &self.dmin,
        }
    }

    /// The tensor's name (for error messages).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Outputs.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs (the reduction length).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Entries of `d` per row: runs of 128 (Q8_0) or blocks of 256 (K-quants).
    pub fn scales_per_row(&self) -> usize {
        match self.format {
            WeightFormat::Q8_0 => run_count(self.cols),
            _ => self.cols / self.format.block_len(),
        }
    }

    /// Integer weights of row `n` (`cols` values).
    pub fn row_q(&self, n: usize) -> &[i8] {
        &self.q[n * self.cols..(n + 1) * self.cols]
    }

    /// Integer sub-block scales of row `n` (empty for Q8_0).
    pub fn row_sub_scales(&self, n: usize) -> &[i8] {
        let per_row = self.cols / self.format.sub_len();
        self.sub_scales
            .get(n * per_row..(n + 1) * per_row)
            .unwrap_or(&[])
    }

    /// Integer sub-block mins of row `n` (empty unless Q4_K/Q5_K).
    pub fn row_sub_mins(&self, n: usize) -> &[i8] {
        let per_row = self.cols / self.format.sub_len();
        self.sub_mins
            .get(n * per_row..(n + 1) * per_row)
            .unwrap_or(&[])
    }

    /// Scales of row `n`: per run of 128 (Q8_0, `sw`) or per block of 256 (K-quants, `d`).
    pub fn row_d(&self, n: usize) -> &[f32] {
        let per_row = self.scales_per_row();
        &self.d[n * per_row..(n + 1) * per_row]
    }

    /// Block min-scales `dmin` of row `n` (empty unless Q4_K/Q5_K).
    pub fn row_dmin(&self, n: usize) -> &[f32] {
        let per_row = self.scales_per_row();
        self.dmin.get(n * per_row..(n + 1) * per_row).unwrap_or(&[])
    }

    /// Row `n` as f32: for the K-quants exactly as ggml's reference `dequantize_row_*` computes it
    /// (the same f32 operations in the same order); for Q8_0 the re-blocked values `q'·sw` the integer
    /// path multiplies.
    pub fn dequantize_row(&self, n: usize) -> Result<Vec<f32>> {
        if n >= self.rows {
            return Err(QuantError::RowOutOfRange {
                tensor: self.name.clone(),
                row: n,
                rows: self.rows,
            });
        }
        let (q, d) = (self.row_q(n), self.row_d(n));
        let (sc, m, dmin) = (
            self.row_sub_scales(n),
            self.row_sub_mins(n),
            self.row_dmin(n),
        );
        let sub = self.format.sub_len();
        let mut out = vec![0f32; self.cols];
        for (e, (y, &qe)) in out.iter_mut().zip(q).enumerate() {
            let (b, j) = (e / self.format.block_len(), e / sub);
            *y = match self.format {
                WeightFormat::Q8_0 => qe as f32 * d[e / RUN],
                WeightFormat::Q4K | WeightFormat::Q5K => {
                    // ggml: d1 = d·sc, m1 = dmin·m once per sub-block, then d1·q − m1.
                    let d1 = d[b] * sc[j] as f32;
                    let m1 = dmin[b] * m[j] as f32;
                    d1 * qe as f32 - m1
                }
                // ggml: (d·sc)·(q − 32).
                WeightFormat::Q6K => d[b] * sc[j] as f32 * qe as f32,
            };
        }
        Ok(out)
    }

    /// The whole matrix as f32 (`rows·cols`, row-major), [`Self::dequantize_row`] of every row.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for n in 0..self.rows {
            out.extend(self.dequantize_row(n)?);
        }
        Ok(out)
    }

    /// A weight made of the given rows, in that order (e.g. the 26 letter rows of the output head).
    /// Each output of the integer matmul depends only on its own row, so the selected outputs are
    /// bit-identical to the same outputs of the full matrix.
    pub fn select_rows(&self, rows: &[u32]) -> Result<QuantWeight> {
        let mut out = QuantWeight {
            name: self.name.clone(),
            format: self.format,
            rows: rows.len(),
            cols: self.cols,
            q: Vec::with_capacity(rows.len() * self.cols),
            sub_scales: Vec::new(),
            sub_mins: Vec::new(),
            d: Vec::new(),
            dmin: Vec::new(),
        };
        for &r in rows {
            let r = r as usize;
            if r >= self.rows {
                return Err(QuantError::RowOutOfRange {
                    tensor: self.name.clone(),
                    row: r,
                    rows: self.rows,
                });
            }
            out.q.extend_from_slice(self.row_q(r));
            out.sub_scales.extend_from_slice(self.row_sub_scales(r));
            out.sub_mins.extend_from_slice(self.row_sub_mins(r));
            out.d.extend_from_slice(self.row_d(r));
            out.dmin.extend_from_slice(self.row_dmin(r));
        }
        Ok(out)
    }

    /// The weight's input columns `cols` (e.g. one device's share of a tensor-parallel product): the
    /// range must start on a run of 128 (Q8_0) or a block of 256 (K-quants) and end on one or at the
    /// last column. Each run's integers and scales are the whole weight's, so the share's products
    /// over its runs are the same integers and promotions.
    pub fn select_cols(&self, cols: Range<usize>) -> Result<QuantWeight> {
        let unit = match self.format {
            WeightFormat::Q8_0 => RUN,
            _ => self.format.block_len(),
        };
        let aligned = |c: usize| c % unit == 0 || c == self.cols;
        if cols.start >= cols.end
            || cols.end > self.cols
            || cols.start % unit != 0
            || !aligned(cols.end)
        {
            return Err(QuantError::Input(format!(
                "{:?}: columns {cols:?} of {} are not whole runs of {unit}",
                self.name, self.cols
            )));
        }
        let width = cols.end - cols.start;
        let scales = match self.format {
            WeightFormat::Q8_0 => cols.start / RUN..run_count(cols.end),
            _ => cols.start / unit..cols.end / unit,
        };
        let sub = self.format.sub_len();
        let subs = cols.start / sub..cols.end / sub;
        let mut out = QuantWeight {
            name: self.name.clone(),
            format: self.format,
            rows: self.rows,
            cols: width,
            q: Vec::with_capacity(self.rows * width),
            sub_scales: Vec::new(),
            sub_mins: Vec::new(),
            d: Vec::with_capacity(self.rows * scales.len()),
            dmin: Vec::new(),
        };
        for n in 0..self.rows {
            out.q.extend_from_slice(&self.row_q(n)[cols.clone()]);
            out.d.extend_from_slice(&self.row_d(n)[scales.clone()]);
            if let Some(s) = self.row_sub_scales(n).get(subs.clone()) {
                out.sub_scales.extend_from_slice(s);
            }
            if let Some(m) = self.row_sub_mins(n).get(subs.clone()) {
                out.sub_mins.extend_from_slice(m);
            }
            if let Some(m) = self.row_dmin(n).get(scales.clone()) {
                out.dmin.extend_from_slice(m);
            }
        }
        Ok(out)
    }

    /// One weight whose rows are the rows of `parts`, in that order (e.g. a layer's projections that
    /// read the same input, run as one GEMM). The parts must share the format and the number of inputs
    /// ([`QuantError::ConcatFormat`], [`QuantError::ConcatCols`] name the two tensors). Each output of
    /// the integer matmul depends only on its own row and its input (whose scales come from the input
    /// alone), so the product's columns are bit-identical to the parts' own products. The name is
    /// the parts' names joined by `+`.
    pub fn concat_rows(parts: &[&QuantWeight]) -> Result<QuantWeight> {
        let (first, rest) = parts.split_first().ok_or(QuantError::ConcatEmpty)?;
        let mut rows = first.rows;
        for other in rest {
            if other.format != first.format {
                return Err(QuantError::ConcatFormat {
                    first: first.name.clone(),
                    first_format: first.format,
                    other: other.name.clone(),
                    other_format: other.format,
                });
            }
            // Shaped like the format check above, with its own variant: the error names what differs.
            if other.cols != first.cols {
                return Err(QuantError::ConcatCols {
                    first: first.name.clone(),
                    first_cols: first.cols,
                    other: other.name.clone(),
                    other_cols: other.cols,
                });
            }
            rows = rows
                .checked_add(other.rows)
                .ok_or_else(|| QuantError::SizeOverflow {
                    tensor: other.name.clone(),
                    rows: other.rows,
                    cols: other.cols,
                })?;
        }
        // Every array is row-major with a fixed run per row, so the rows of the parts follow each other
        // by plain concatenation (slice copies: these are most of a model's weights at load).
        fn join<T: Copy>(parts: &[&QuantWeight], f: fn(&QuantWeight) -> &[T]) -> Vec<T> {
            let mut out = Vec::with_capacity(parts.iter().map(|p| f(p).len()).sum());
            for p in parts {
                out.extend_from_slice(f(p));
            }
            out
        }
        Ok(QuantWeight {
            name: parts
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join("+"),
            format: first.format,
            rows,
            cols: first.cols,
            q: join(parts, |p| &p.q),
            sub_scales: join(parts, |p| &p.sub_scales),
            sub_mins: join(parts, |p| &p.sub_mins),
            d: join(parts, |p| &p.d),
            dmin: join(parts, |p| &p.dmin),
        })
    }

    /// Bytes held (for logs).
    pub fn memory_bytes(&self) -> usize {
        self.q.len()
            + self.sub_scales.len()
            + self.sub_mins.len()
            + 4 * (self.d.len() + self.dmin.len())
    }
}
