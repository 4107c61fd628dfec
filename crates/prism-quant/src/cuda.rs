//! The integer matmul on CUDA: launchers for `kernels/quant_gemm.cu` (compiled to a fatbin by build.rs).
//!
//! [`CudaQuantWeight::upload`] puts a [`QuantWeight`]'s unpacked arrays on the device (one byte per
//! weight, stored as `U8` and read as `int8` by the kernels; block scales `F32`); [`matmul`] quantizes
//! an f32 activation with its static scale and runs the integer GEMM. Every output has the bits of the
//! CPU reference ([`crate::kernel::matmul`]) whatever the kernel, the tiling, the part grouping or `M`
//! (`prism cuda-quant-check` checks it on the device). The host-side plan (families, tiles, part
//! groups, checks, the flat arrays) is [`crate::cuda_plan`], which CI tests.
//!
//! [`GemmKernel::Auto`] runs the family named by `PRISM_QGEMM` (`v1` or `v2`, read once per process;
//! unset: `v2`), so a deployment can go back to the first kernel without a rebuild.
//!
//! # Non-finite inputs
//!
//! The CPU reference refuses a call whose input holds a NaN or ±∞ (quantization would clamp it to a
//! finite int8 and hide it). On the device, finding that out means reading a flag back: a stream
//! synchronization per GEMM. So the quantization kernel marks, per row, the first non-finite column
//! (flags zeroed on the device with a memset), and two ways follow:
//! - **row poisoning** ([`matmul_deferred`], [`matmul_poisoned`], what the model runs): after the GEMM a
//!   tiny kernel sets every output of a marked row to NaN. No synchronization; the other rows keep
//!   their bits (each row is quantized and multiplied on its own), so one sequence's divergence never
//!   reaches another sequence of the batch, and it flows through that sequence's later operations to
//!   its logits, where the read-out reports it.
//! - **the eager check** ([`matmul`], [`matmul_with`], [`DeviceQuantized::check_finite`]): the same
//!   NaN rows, then the flags are read back (one synchronization) and the call fails with the CPU's
//!   [`QuantError::NonFiniteActivation`], naming the same row and element.

use candle_core::cuda_backend::cudarc::driver::sys::{self, CUdevice_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Device, Result, Tensor};

use crate::activation::ActivationScale;
use crate::chain::ChainTables;
use crate::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};
use crate::cuda_plan::{
    self, DeviceLimits, Family, FlatWeight, GemmKernel, LaunchPlan, SIMT_THREADS,
};
use crate::error::QuantError;
use crate::weight::{QuantWeight, WeightFormat, WeightInfo};

/// The kernels as a fatbin (sm_80 / sm_89 / sm_90a machine code + compute_80 PTX, kernels/build_ptx.rs).
const QUANT_GEMM_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/quant_gemm.fatbin"));
const MODULE: &str = "prism_quant_gemm";

fn quant_err(e: QuantError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// A [`QuantWeight`] on a CUDA device: the arrays of [`FlatWeight`] (weights row-major, per-block tables
/// block-major). Arrays the format does not have hold one unused element (the kernels take a pointer
/// for every argument).
#[derive(Debug, Clone)]
pub struct CudaQuantWeight {
    /// Name, format, outputs (`rows`) and inputs (`cols`).
    info: WeightInfo,
    /// `[rows · cols]` U8: the signed weight bytes.
    q: Tensor,
    /// `[blocks, rows, sub-blocks a block]` U8 (signed): sub-block scales.
    sub_scales: Tensor,
    /// `[blocks, rows, 8]` U8: sub-block mins (Q4_K / Q5_K).
    sub_mins: Tensor,
    /// `[blocks, rows]` F32: block scales. Chained Q8_0: the chain coefficients.
    d: Tensor,
    /// `[blocks, rows]` F32 (Q4_K / Q5_K): block min scales. Chained Q8_0: the group corrections
    /// `[groups, rows]`.
    dmin: Tensor,
    /// Uploaded by [`CudaQuantWeight::upload_chained`]: `d` holds the chain coefficients and `dmin`
    /// the group corrections of [`ChainTables`], for the chained tiles only.
    chained: bool,
}

impl CudaQuantWeight {
    pub fn upload(w: &QuantWeight, device: &CudaDevice) -> Result<Self> {
        Self::from_flat(FlatWeight::new(w), false, device)
    }

    /// [`CudaQuantWeight::upload`] of a weight the caller is done with: no host copy of its bytes is
    /// made, and its host memory is freed once on the device (what a model load does).
    pub fn upload_owned(w: QuantWeight, device: &CudaDevice) -> Result<Self> {
        Self::from_flat(FlatWeight::from_owned(w), false, device)
    }

    /// A Q8_0 weight for the chained tiles ([`crate::cuda_plan::V2Tile::chained`]): the block scales
    /// replaced by the chain coefficients and the group corrections of [`ChainTables`], block-major
    /// (`[block][N]`, `[group][N]`: a stage's values for a tile's columns are consecutive, so the
    /// kernel's copies coalesce). Only those tiles take it; every other kernel refuses it (and they
    /// refuse a weight from [`CudaQuantWeight::upload`]).
    pub fn upload_chained(w: &QuantWeight, device: &CudaDevice) -> Result<Self> {
        let tables = ChainTables::new(w).map_err(quant_err)?;
        let mut flat = FlatWeight::new(w);
        flat.d = cuda_plan::transpose(&tables.coef, w.rows(), tables.blocks_per_row);
        flat.dmin = cuda_plan::transpose(&tables.corr, w.rows(), tables.groups_per_row);
        Self::from_flat(flat, true, device)
    }

    /// Copies `flat`'s arrays to the device (its host vectors are freed as each copy completes).
    /// A loader prepares [`FlatWeight::from_owned`] on its own thread and makes only this call under
    /// its device lock.
    pub fn from_flat(flat: FlatWeight, chained: bool, device: &CudaDevice) -> Result<Self> {
        let dev = Device::Cuda(device.clone());
        let bytes = |mut v: Vec<u8>| -> Result<Tensor> {
            if v.is_empty() {
                v.push(0);
            }
            let n = v.len();
            Tensor::from_vec(v, n, &dev)
        };
        let floats = |mut v: Vec<f32>| -> Result<Tensor> {
            if v.is_empty() {
                v.push(0.0);
            }
            let n = v.len();
            Tensor::from_vec(v, n, &dev)
        };
        let FlatWeight {
            info,
            q,
            sub_scales,
            sub_mins,
            d,
            dmin,
        } = flat;
        Ok(Self {
            info,
            q: bytes(q)?,
            sub_scales: bytes(sub_scales)?,
            sub_mins: bytes(sub_mins)?,
            d: floats(d)?,
            dmin: floats(dmin)?,
            chained,
        })
    }

    /// The weight made of rows `rows` of this one, in that order, gathered on the device (the read-out's
    /// letter rows of an output head that lives on the GPU only). Each output of the product depends
    /// only on its own row, so the results are bit-identical to those columns of the full product.
    pub fn select_rows(&self, rows: &[u32]) -> Result<Self> {
        if self.chained {
            bail!(
                "{:?}: rows of a weight uploaded with chain tables cannot be selected",
                self.info.name
            );
        }
        if rows.is_empty() {
            bail!("{:?}: select_rows of no rows", self.info.name);
        }
        if let Some(&row) = rows.iter().find(|&&r| r as usize >= self.info.rows) {
            return Err(quant_err(QuantError::RowOutOfRange {
                tensor: self.info.name.clone(),
                row: row as usize,
                rows: self.info.rows,
            }));
        }
        let device = self.q.device();
        let ids = Tensor::from_vec(rows.to_vec(), rows.len(), device)?;
        let nb = self.info.cols / self.info.format.block_len();
        // `[blocks, rows, per]` tables gathered along the row axis; a table the format does not have
        // (one unused element) stays as it is.
        let per_block_rows = |t: &Tensor, present: bool, per: usize| -> Result<Tensor> {
            if !present {
                return Ok(t.clone());
            }
            t.reshape((nb, self.info.rows, per))?
                .index_select(&ids, 1)?
                .flatten_all()
        };
        let (subs, mins) = (
            self.info.format.has_sub_scales(),
            self.info.format.has_mins(),
        );
        let per = self.info.format.subs_per_block();
        Ok(Self {
            info: WeightInfo {
                rows: rows.len(),
                ..self.info.clone()
            },
            q: self
                .q
                .reshape((self.info.rows, self.info.cols))?
                .index_select(&ids, 0)?
                .flatten_all()?,
            sub_scales: per_block_rows(&self.sub_scales, subs, per)?,
            sub_mins: per_block_rows(&self.sub_mins, mins, per)?,
            d: per_block_rows(&self.d, true, 1)?,
            dmin: per_block_rows(&self.dmin, mins, 1)?,
            chained: false,
        })
    }

    /// Name, format and shape.
    pub fn info(&self) -> WeightInfo {
        self.info.clone()
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }

    pub fn format(&self) -> WeightFormat {
        self.info.format
    }

    /// Outputs.
    pub fn rows(&self) -> usize {
        self.info.rows
    }

    /// Inputs (the reduction length).
    pub fn cols(&self) -> usize {
        self.info.cols
    }

    /// Device bytes held.
    pub fn memory_bytes(&self) -> usize {
        [
            &self.q,
            &self.sub_scales,
            &self.sub_mins,
            &self.d,
            &self.dmin,
        ]
        .iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
    }
}

/// Activations quantized on the device: `q` `[M, K]` U8 (int8 bits) and, for formats with mins, the
/// sums of each 32 quantized values `[M, K/32]` I32.
pub struct DeviceQuantized {
    pub rows: usize,
    pub cols: usize,
    pub q: CudaSlice<u8>,
    pub sums: Option<CudaSlice<i32>>,
    /// `[M]` (at least one element): 0 for a row of finite inputs, else `u32::MAX − c` for the smallest
    /// column `c` of the row holding a NaN or ±∞ ([`decode_bad_row`]).
    bad_rows: CudaSlice<u32>,
}

/// A row flag of [`DeviceQuantized`] as the column of the row's first non-finite input (`None`: clean).
pub fn decode_bad_row(flag: u32) -> Option<usize> {
    (flag != 0).then(|| (u32::MAX - flag) as usize)
}

impl DeviceQuantized {
    /// Buffers for `rows × cols` activations that a producer kernel of another crate quantizes itself
    /// (kernels/act_quant.cuh: the bytes of [`quantize_activations`]): `q`, the per-32 sums when
    /// `with_sums`, the row flags zeroed on the device. `cols` must be a multiple of 32.
    pub fn alloc(dev: &CudaDevice, rows: usize, cols: usize, with_sums: bool) -> Result<Self> {
        if cols % 32 != 0 {
            bail!("int8 quantization (cuda): rows of {cols} are not whole groups of 32");
        }
        Ok(Self {
            rows,
            cols,
            q: alloc::<u8>(dev, rows * cols)?,
            sums: if with_sums {
                Some(alloc::<i32>(dev, rows * cols / 32)?)
            } else {
                None
            },
            // Zeroed on the device (a memset on the stream): no host copy.
            bad_rows: dev.alloc_zeros::<u32>(rows.max(1))?,
        })
    }

    /// The buffers a producer kernel writes: the bytes, the sums (if any) and the row flags (`[rows]`, at
    /// least one element).
    pub fn buffers_mut(
        &mut self,
    ) -> (
        &mut CudaSlice<u8>,
        Option<&mut CudaSlice<i32>>,
        &mut CudaSlice<u32>,
    ) {
        (&mut self.q, self.sums.as_mut(), &mut self.bad_rows)
    }

    /// Every row holding a non-finite input, in row order, with the column of its first one. Reads the
    /// row flags back: synchronizes with the stream.
    pub fn non_finite_rows(&self, dev: &CudaDevice) -> Result<Vec<(usize, usize)>> {
        let flags = dev.clone_dtoh(&self.bad_rows)?;
        Ok(flags
            .iter()
            .take(self.rows)
            .enumerate()
            .filter_map(|(row, &f)| decode_bad_row(f).map(|col| (row, col)))
            .collect())
    }

    /// Reads the row flags back (synchronizes with the stream) and turns the first non-finite input
    /// into the CPU's error ([`QuantError::NonFiniteActivation`], same row and element).
    pub fn check_finite(&self, x: &Tensor, dev: &CudaDevice) -> Result<()> {
        let Some(&(row, col)) = self.non_finite_rows(dev)?.first() else {
            return Ok(());
        };
        let value = x
            .narrow(0, row, 1)?
            .narrow(1, col, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .first()
            .copied()
            .unwrap_or(f32::NAN);
        Err(quant_err(QuantError::NonFiniteActivation {
            row,
            col,
            value,
        }))
    }

    /// Sets every output of `y` (`[rows, n]` f32 on the device) in a row with a non-finite input to
    /// NaN. No synchronization.
    fn poison_rows(&self, y: &mut CudaSlice<f32>, n: usize, dev: &CudaDevice) -> Result<()> {
        if self.rows == 0 || n == 0 {
            return Ok(());
        }
        let func = load_kernel(dev, MODULE, QUANT_GEMM_IMAGE, "poison_rows")?;
        // One warp per row.
        let rows_per_block = (SIMT_THREADS / 32) as usize;
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(rows_per_block) as u32, 1, 1),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i) = (self.rows as i64, n as i64);
        let mut b = func.builder();
        b.arg(&self.bad_rows).arg(y).arg(&m_i).arg(&n_i);
        // SAFETY: bad_rows holds `rows` u32, y rows·n f32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(())
    }

    /// The quantized values as a `[rows, cols]` U8 tensor (int8 bits) and the sums `[rows, cols/32]` I32.
    pub fn into_tensors(self, dev: &CudaDevice) -> (Tensor, Option<Tensor>) {
        let (rows, cols) = (self.rows, self.cols);
        let q = wrap(self.q, dev, (rows, cols));
        let sums = self.sums.map(|s| wrap(s, dev, (rows, cols / 32)));
        (q, sums)
    }
}

/// `qa = clamp(rint(x · inv_scale), −127, 127)` for `x: [M, K]` f32 on CUDA (`K` a multiple of 32), with
/// the per-32 sums when `with_sums`, and the rows holding a non-finite input marked. Does not
/// synchronize: [`DeviceQuantized::check_finite`] reads the marks.
pub fn quantize_activations(
    x: &Tensor,
    scale: &ActivationScale,
    with_sums: bool,
) -> Result<DeviceQuantized> {
    let dev = cuda_device(x)?;
    let (m, k) = x.dims2()?;
    let qx = DeviceQuantized::alloc(&dev, m, k, with_sums)?;
    let mut x = x.contiguous()?;
    // The kernel reads float4s: the view must start on a 16-byte boundary.
    if x.layout().start_offset() % 4 != 0 {
        x = x.copy()?;
    }
    let ix = Input::new(&x, DType::F32, "activations")?;
    let groups = m * k / 32;
    if groups > 0 {
        let func = load_kernel(&dev, MODULE, QUANT_GEMM_IMAGE, "quantize_act_i8")?;
        // 8 threads a group of 32 (whole warps: SIMT_THREADS is a multiple of 32).
        let cfg = LaunchConfig {
            grid_dim: ((8 * groups).div_ceil(SIMT_THREADS as usize) as u32, 1, 1),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_groups, inv, want) = (groups as i64, scale.inv_scale(), i32::from(with_sums));
        let groups_per_row = i32_arg(k / 32, "groups of 32 per row")?;
        let vx = ix.view::<f32>()?;
        let mut b = func.builder();
        b.arg(&vx).arg(&qx.q);
        match &qx.sums {
            Some(s) => b.arg(s),
            None => b.arg(&qx.q), // unused (want_sums = 0)
        };
        b.arg(&qx.bad_rows)
            .arg(&n_groups)
            .arg(&groups_per_row)
            .arg(&inv)
            .arg(&want);
        // SAFETY: x holds m·k f32 (16-byte aligned, checked above), q m·k bytes, sums m·k/32 i32,
        // bad_rows m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok(qx)
}

/// The GPU's multiprocessor count, shared-memory limits and compute capability, queried from the driver
/// once per device: every integer GEMM launch plans with them, and they never change.
pub fn device_limits(dev: &CudaDevice) -> Result<DeviceLimits> {
    static KNOWN: std::sync::Mutex<Vec<(usize, DeviceLimits)>> = std::sync::Mutex::new(Vec::new());
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    // A poisoned lock only means another thread panicked while holding it; the list stays valid.
    let known = |list: &Vec<(usize, DeviceLimits)>| {
        list.iter().find(|(o, _)| *o == ordinal).map(|(_, l)| *l)
    };
    if let Some(limits) = known(&KNOWN.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(limits);
    }
    let attr = |a: CUdevice_attribute| -> Result<usize> {
        let v = ctx.attribute(a).map_err(launch_err)?;
        Ok(usize::try_from(v).unwrap_or(0))
    };
    let limits = DeviceLimits {
        sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1),
        smem_per_block: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        smem_per_sm: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?,
        compute_major: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
    };
    let mut list = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if known(&list).is_none() {
        list.push((ordinal, limits));
    }
    Ok(limits)
}

/// The family [`GemmKernel::Auto`] runs: `PRISM_QGEMM` (`v1` / `v2`), read once per process. A value
/// that is neither is an error on every call (naming the variable), not a silent default.
pub fn default_family() -> Result<Family> {
    static FAMILY: std::sync::OnceLock<std::result::Result<Family, String>> =
        std::sync::OnceLock::new();
    let parsed = FAMILY.get_or_init(|| {
        let value = match std::env::var(cuda_plan::FAMILY_ENV) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(v)) => Some(v.to_string_lossy().into_owned()),
        };
        cuda_plan::parse_family(value.as_deref()).map_err(|e| e.to_string())
    });
    parsed
        .clone()
        .map_err(|msg| quant_err(QuantError::Input(msg)))
}

/// The launch [`gemm_quantized`] makes for `kernel` on this device (which family, tile and part
/// groups), for logs and the device checks.
pub fn launch_plan(
    kernel: GemmKernel,
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    dev: &CudaDevice,
) -> Result<LaunchPlan> {
    let family = match kernel {
        GemmKernel::Auto => default_family()?,
        _ => Family::V2, // unused: the kernel names its family
    };
    cuda_plan::plan_launch(kernel, family, format, m, n, k, &device_limits(dev)?).map_err(quant_err)
}

/// The integer GEMM on already quantized activations: `y: [M, N]` f32. Every kernel choice gives the
/// same bits. The GEMM alone: rows marked non-finite hold the product of their clamped values (finite
/// and meaningless); [`matmul_deferred`] poisons them.
pub fn gemm_quantized(
    qx: &DeviceQuantized,
    w: &CudaQuantWeight,
    scale: &ActivationScale,
    kernel: GemmKernel,
    dev: &CudaDevice,
) -> Result<Tensor> {
    let y = gemm_slice(qx, w, scale, kernel, dev, false)?;
    Ok(wrap(y, dev, (qx.rows, w.info.rows)))
}

/// [`gemm_quantized`]'s output buffer, `M·N` f32 (at least one element). With `poison`, every output of a
/// row flagged in `qx` (a non-finite input) is NaN: v2 launches and the combine kernels write the NaN in
/// their last write of the output; after the other launches `poison_rows` does.
fn gemm_slice(
    qx: &DeviceQuantized,
    w: &CudaQuantWeight,
    scale: &ActivationScale,
    kernel: GemmKernel,
    dev: &CudaDevice,
    poison: bool,
) -> Result<CudaSlice<f32>> {
    let (m, n, k) = (qx.rows, w.info.rows, w.info.cols);
    if qx.cols != k || (w.info.format.has_mins() && qx.sums.is_none()) {
        bail!(
            "integer matmul (cuda) of {:?}: activations [{m}, {}]{} do not fit a weight of {k} inputs",
            w.info.name,
            qx.cols,
            if qx.sums.is_none() { " without sums" } else { "" }
        );
    }
    let chained_kernel =
        matches!(kernel, GemmKernel::V2 { tile, .. } if tile.chained(w.info.format));
    if chained_kernel != w.chained {
        bail!(
            "integer matmul (cuda) of {:?}: {}",
            w.info.name,
            if w.chained {
                "a weight uploaded with chain tables runs only on a chained tile (V2Tile::CHAINED)"
            } else {
                "a chained tile needs the weight uploaded by CudaQuantWeight::upload_chained"
            }
        );
    }
    let plan = launch_plan(kernel, w.info.format, m, n, k, dev)?;
    let groups = plan.part_groups;
    cuda_plan::check_launch(&w.info.name, w.info.format, m, n, k, groups).map_err(quant_err)?;
    let y = alloc::<f32>(dev, m * n)?;
    if m == 0 || n == 0 {
        return Ok(y);
    }
    let (m_i, n_i, k_i) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "outputs")?,
        i32_arg(k, "inputs")?,
    );
    let s = scale.scale();
    let (iq, isc, imin, id, idmin) = (
        Input::new(&w.q, DType::U8, "weight bytes")?,
        Input::new(&w.sub_scales, DType::U8, "sub-block scales")?,
        Input::new(&w.sub_mins, DType::U8, "sub-block mins")?,
        Input::new(&w.d, DType::F32, "block scales")?,
        Input::new(&w.dmin, DType::F32, "block min scales")?,
    );
    let (vq, vsc, vmin) = (iq.view::<u8>()?, isc.view::<u8>()?, imin.view::<u8>()?);
    let (vd, vdmin) = (id.view::<f32>()?, idmin.view::<f32>()?);
    // Formats without mins never read the sums: any valid pointer will do.
    let no_sums;
    let sums = match &qx.sums {
        Some(sm) => sm,
        None => {
            no_sums = alloc::<i32>(dev, 1)?;
            &no_sums
        }
    };
    let (gx, gy, gz) = plan.grid(m, n);

    let Some(tile) = plan.tile else {
        let func = load_kernel(dev, MODULE, QUANT_GEMM_IMAGE, "qgemm_simt")?;
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, gz),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let fmt = cuda_plan::simt_format_code(w.info.format);
        let mut b = func.builder();
        b.arg(&fmt)
            .arg(&qx.q)
            .arg(sums)
            .arg(&vq)
            .arg(&vsc)
            .arg(&vmin)
            .arg(&vd)
            .arg(&vdmin);
        b.arg(&y).arg(&m_i).arg(&n_i).arg(&k_i).arg(&s);
        // SAFETY: the buffers have the sizes the dimensions say (checked at upload and above).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        let mut y = y;
        if poison {
            qx.poison_rows(&mut y, n, dev)?;
        }
        return Ok(y);
    };
    // The row flags for the kernels that poison in their last write (a null pointer: no poisoning).
    let stream = dev.cuda_stream();
    let (flags_ptr, _flags_sync) = qx.bad_rows.device_ptr(&stream);
    let flags: u64 = if poison { flags_ptr } else { 0 };

    let func = load_kernel(dev, MODULE, QUANT_GEMM_IMAGE, tile.kernel)?;
    func.allow_dynamic_shared(tile.smem_bytes, "shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (gx, gy, gz),
        block_dim: (tile.threads, 1, 1),
        shared_mem_bytes: tile.smem_bytes as u32,
    };
    // G > 1: per-group partial results, folded by the combine kernel. v2 with G = 1 keeps its closed
    // even parts in an [M, N] scratch buffer.
    let target = if groups == 1 {
        None
    } else {
        Some(alloc::<f32>(dev, groups as usize * m * n)?)
    };
    // (Tiles that keep it in shared memory need none: at a long prefill's M it was a gigabyte.)
    let scratch = if tile.family == Family::V2 && groups == 1 && !tile.scratch_in_smem {
        Some(alloc::<f32>(dev, m * n)?)
    } else {
        None
    };
    // A tail split: the tail tiles' four parts go to a [4, m − r0, n − c0] workspace.
    let tail = plan.tail(m, n);
    let tail_ws = match tail {
        Some(t) => Some(alloc::<f32>(dev, 4 * (m - t.r0) * (n - t.c0))?),
        None => None,
    };
    let tail_base = i32_arg(tail.map_or((gx as usize).max(1), |t| t.base), "tail base")?;
    {
        let out = target.as_ref().unwrap_or(&y);
        let mut b = func.builder();
        b.arg(&qx.q)
            .arg(sums)
            .arg(&vq)
            .arg(&vsc)
            .arg(&vmin)
            .arg(&vd)
            .arg(&vdmin);
        b.arg(out).arg(&m_i).arg(&n_i).arg(&k_i).arg(&s);
        let group_m = i32::try_from(plan.group_m).unwrap_or(i32::MAX);
        if tile.family == Family::V2 {
            // The scratch pointer is only used with G = 1 by tiles without the shared-memory slot;
            // otherwise y, which the kernel never reads or writes through it.
            b.arg(scratch.as_ref().unwrap_or(&y)).arg(&group_m);
            // Without a tail the workspace pointer is never used (no CTA reaches tail_base).
            b.arg(&tail_base)
                .arg(tail_ws.as_ref().unwrap_or(&y))
                .arg(&flags);
        }
        let (qa_ptr, _qa_sync) = qx.q.device_ptr(&stream);
        let (wq_ptr, _wq_sync) = vq.device_ptr(&stream);
        let maps;
        if tile.tma {
            maps = [
                byte_rows_map(qa_ptr, m, k, tile.bm)?,
                byte_rows_map(wq_ptr, n, k, tile.bn)?,
            ];
            b.arg(&maps[0]).arg(&maps[1]);
        }
        // SAFETY: as above; the workspace holds G·m·n f32, the scratch m·n; the tensor maps describe
        // the activation and weight buffers (m·k and n·k bytes), alive until the launch is queued.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    if let (Some(t), Some(ws)) = (tail, &tail_ws) {
        let func = load_kernel(dev, MODULE, QUANT_GEMM_IMAGE, "qgemm_combine_tail")?;
        let count = (m - t.r0) * (n - t.c0);
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(SIMT_THREADS as usize) as u32, 1, 1),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r0, c0) = (i32_arg(t.r0, "tail row")?, i32_arg(t.c0, "tail column")?);
        let mut b = func.builder();
        b.arg(ws)
            .arg(&y)
            .arg(&m_i)
            .arg(&n_i)
            .arg(&r0)
            .arg(&c0)
            .arg(&s)
            .arg(&flags);
        // SAFETY: ws holds 4·count f32 (the tail's rows and columns), y m·n f32, the flags m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    if let Some(ws) = &target {
        let func = load_kernel(dev, MODULE, QUANT_GEMM_IMAGE, "qgemm_combine")?;
        let count = m * n;
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(SIMT_THREADS as usize) as u32, 1, 1),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (count_i, g_i, n_l) = (count as i64, groups as i32, n as i64);
        let mut b = func.builder();
        b.arg(ws)
            .arg(&y)
            .arg(&count_i)
            .arg(&g_i)
            .arg(&s)
            .arg(&n_l)
            .arg(&flags);
        // SAFETY: ws holds G·count f32, y count f32, the flags m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    } else if poison && tile.family == Family::V1 {
        // v1 with one part group writes its outputs itself, without the flags.
        let mut y = y;
        qx.poison_rows(&mut y, n, dev)?;
        return Ok(y);
    }
    Ok(y)
}

/// A `CUtensorMap` as a kernel argument (`TmaDesc` in quant_gemm.cu: 128 opaque bytes, passed by value
/// as a `__grid_constant__` parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorMapArg(sys::CUtensorMap);

// SAFETY: plain bytes the driver copies into the kernel's parameter space.
unsafe impl DeviceRepr for TensorMapArg {}

/// The TMA tensor map of a row-major `[rows, k]` byte matrix at `ptr`, read in boxes of 128 bytes of K
/// by `box_rows` rows into shared memory with the 128-byte swizzle (16-byte chunk c of row r lands at
/// chunk c ^ (r & 7), the layout the kernels' `ldmatrix` addressing expects). Rows past `rows` and
/// bytes past `k` read as zeros.
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
    let dims = [k as u64, rows as u64];
    let strides = [k as u64]; // bytes between rows; the innermost stride is the element size
    let boxes = [128u32, u32::try_from(box_rows).unwrap_or(u32::MAX)];
    let element_strides = [1u32, 1];
    let mut map = TensorMapArg(sys::CUtensorMap { opaque: [0; 16] });
    // SAFETY: the driver writes the 128-byte map; every array has `rank` = 2 elements (strides 1).
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
        bail!("integer matmul (cuda): no TMA map for a [{rows}, {k}] byte matrix ({status:?})");
    }
    Ok(map)
}

/// How many elements of two f32 CUDA tensors with the same number of elements differ in their bits
/// (compared on the device; for the device checks, which compare every output of every kernel).
pub fn differing_bits(a: &Tensor, b: &Tensor) -> Result<usize> {
    if a.elem_count() != b.elem_count() {
        bail!(
            "differing_bits: {} vs {} elements",
            a.elem_count(),
            b.elem_count()
        );
    }
    let dev = cuda_device(a)?;
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (ia, ib) = (
        Input::new(&a, DType::F32, "a")?,
        Input::new(&b, DType::F32, "b")?,
    );
    let (va, vb) = (ia.view::<f32>()?, ib.view::<f32>()?);
    let count = dev.clone_htod(&[0u64])?;
    let n = a.elem_count();
    if n > 0 {
        let func = load_kernel(&dev, MODULE, QUANT_GEMM_IMAGE, "count_bit_differences")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(SIMT_THREADS as usize).min(4096) as u32, 1, 1),
            block_dim: (SIMT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n_i = n as i64;
        let mut bld = func.builder();
        bld.arg(&va).arg(&vb).arg(&n_i).arg(&count);
        // SAFETY: both views hold n f32, count one u64.
        unsafe { bld.launch(cfg) }.map_err(launch_err)?;
    }
    let c = dev.clone_dtoh(&count)?;
    Ok(c.first().copied().unwrap_or(0) as usize)
}

/// `y = x · Wᵀ` on the integer path for `x: [M, K]` f32 on CUDA; returns `[M, N]` f32 with the CPU
/// reference's bits. A non-finite activation is the CPU's [`QuantError::NonFiniteActivation`] (wrapped
/// in a candle error): the eager check, which reads the row flags back and so synchronizes with the
/// stream. [`matmul_poisoned`] is the same product without the synchronization (NaN rows instead).
pub fn matmul(x: &Tensor, w: &CudaQuantWeight, scale: &ActivationScale) -> Result<Tensor> {
    matmul_with(x, w, scale, GemmKernel::Auto)
}

/// [`matmul`] with a chosen kernel (the device checks run all of them).
pub fn matmul_with(
    x: &Tensor,
    w: &CudaQuantWeight,
    scale: &ActivationScale,
    kernel: GemmKernel,
) -> Result<Tensor> {
    let (y, qx) = matmul_deferred(x, w, scale, kernel)?;
    qx.check_finite(x, &cuda_device(x)?)?;
    Ok(y)
}

/// The product of activations already quantized on the device by a fused producer (same bytes as
/// [`quantize_activations`] at `scale`), with [`matmul_poisoned`]'s semantics: a row holding a non-finite
/// input comes out as NaN, every other row has the CPU reference's bits. No synchronization.
pub fn matmul_quantized_poisoned(
    qx: &DeviceQuantized,
    w: &CudaQuantWeight,
    scale: &ActivationScale,
    dev: &CudaDevice,
) -> Result<Tensor> {
    if qx.cols != w.info.cols {
        return Err(quant_err(QuantError::InputWidth {
            tensor: w.info.name.clone(),
            expected: w.info.cols,
            found: qx.cols,
        }));
    }
    cuda_plan::check_launch(&w.info.name, w.info.format, 1, w.info.rows, qx.cols, 1)
        .map_err(quant_err)?;
    let y = gemm_slice(qx, w, scale, GemmKernel::Auto, dev, true)?;
    Ok(wrap(y, dev, (qx.rows, w.info.rows)))
}

/// The no-synchronization product: [`matmul_deferred`] with the automatic kernel, the quantized
/// activations dropped. A row of `x` holding a NaN or ±∞ comes out as a row of NaN; every other row
/// has the CPU reference's bits.
pub fn matmul_poisoned(x: &Tensor, w: &CudaQuantWeight, scale: &ActivationScale) -> Result<Tensor> {
    Ok(matmul_deferred(x, w, scale, GemmKernel::Auto)?.0)
}

/// [`matmul_with`] without the synchronizing check: every output of a row whose input holds a NaN or
/// ±∞ is NaN (the other rows keep the reference's bits). Returns the quantized activations too, whose
/// [`DeviceQuantized::check_finite`] the caller may run when it can afford the synchronization.
pub fn matmul_deferred(
    x: &Tensor,
    w: &CudaQuantWeight,
    scale: &ActivationScale,
    kernel: GemmKernel,
) -> Result<(Tensor, DeviceQuantized)> {
    let dev = cuda_device(x)?;
    let (m, k) = x.dims2()?;
    if k != w.info.cols {
        return Err(quant_err(QuantError::InputWidth {
            tensor: w.info.name.clone(),
            expected: w.info.cols,
            found: k,
        }));
    }
    cuda_plan::check_launch(&w.info.name, w.info.format, 1, w.info.rows, k, 1)
        .map_err(quant_err)?;
    let qx = quantize_activations(x, scale, w.info.format.has_mins())?;
    let y = gemm_slice(&qx, w, scale, kernel, &dev, true)?;
    Ok((wrap(y, &dev, (m, w.info.rows)), qx))
}
