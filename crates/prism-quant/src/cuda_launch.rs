//! Small helpers for launching our CUDA kernels on candle tensors, shared by prism-quant's integer GEMM
//! and prism-model's decoder kernels: contiguous views of a tensor's `CudaSlice` held under its storage
//! guard, uninitialized output buffers wrapped back into tensors, launch-error conversion, and
//! [`load_kernel`], which loads our fatbins (machine code for sm_80/sm_89/sm_90a plus PTX).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchArgs,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor};

/// A kernel-launch (driver or cuBLAS) error as a candle error.
pub fn launch_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// `x` as a kernel's `int` argument, or an error naming `what`.
pub fn i32_arg(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle_core::Error::Msg(format!("{what} = {x} does not fit in i32")))
}

/// The CUDA device `t` lives on.
pub fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("expected a CUDA tensor, found one on {other:?}"),
    }
}

/// A read guard on a tensor's CUDA storage plus the element range of its (contiguous) layout.
pub struct Input<'a> {
    guard: candle_core::StorageRef<'a>,
    start: usize,
    end: usize,
    name: &'static str,
}

impl<'a> Input<'a> {
    pub fn new(t: &'a Tensor, dtype: DType, name: &'static str) -> Result<Self> {
        if t.dtype() != dtype {
            bail!("{name}: expected {dtype:?}, found {:?}", t.dtype());
        }
        let (guard, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{name} must be contiguous");
        };
        Ok(Self {
            guard,
            start,
            end,
            name,
        })
    }

    /// A strided tensor's `span` elements from its start offset (its first element to one past its
    /// last), for a kernel that is given the strides itself.
    pub fn spanning(t: &'a Tensor, dtype: DType, name: &'static str, span: usize) -> Result<Self> {
        if t.dtype() != dtype {
            bail!("{name}: expected {dtype:?}, found {:?}", t.dtype());
        }
        let (guard, layout) = t.storage_and_layout();
        let start = layout.start_offset();
        Ok(Self {
            guard,
            start,
            end: start + span,
            name,
        })
    }

    pub fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
        match &*self.guard {
            Storage::Cuda(cs) => {
                let slice = cs.as_cuda_slice::<T>()?;
                match slice.try_slice(self.start..self.end) {
                    Some(view) => Ok(view),
                    None => bail!(
                        "{}: elements {}..{} are outside its buffer of {}",
                        self.name,
                        self.start,
                        self.end,
                        slice.len()
                    ),
                }
            }
            _ => bail!("{} is not on a CUDA device", self.name),
        }
    }
}

/// An uninitialized device buffer of `len` elements (at least one) for a kernel to fill.
pub fn alloc<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the callers' kernels write every element before anything reads it.
    unsafe { dev.alloc::<T>(len.max(1)) }
}

/// Byte alignment of each part of a [`Scratch`] (the driver's own allocation alignment; TMA needs 16).
pub const SCRATCH_ALIGN: usize = 256;

/// How many streams' scratch buffers a thread keeps (the oldest goes first).
const SCRATCH_STREAMS: usize = 4;

thread_local! {
    /// Per (this thread, stream): the scratch buffer [`Scratch::take`] hands out, while not taken.
    static SCRATCH: std::cell::RefCell<Vec<(usize, CudaSlice<u8>)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Device memory for the intermediate buffers of one operation's launches (an activation quantized for
/// a product, its scales, partial sums), reused by the next operation this thread launches on the same
/// stream instead of allocated and freed for each: a stream runs its launches in order, so the buffer
/// is free again once the launches that use it are queued. Every stream-ordered allocation and free is
/// a driver call of a few microseconds; a decode step makes hundreds of products.
///
/// Guarantees: a `Scratch` is at least the bytes asked for, is held by one operation at a time (one
/// taken while another is held on the same thread and stream is a fresh allocation), and goes back to
/// its thread and stream when dropped. Its contents are undefined: the kernels write every element
/// they read. Kept per (thread, stream) because candle's device uses the per-thread default stream:
/// two threads with one `CudaDevice` launch on two streams.
pub struct Scratch {
    buf: Option<CudaSlice<u8>>,
    key: usize,
    /// Not `Send`: it goes back to the thread (and so the stream) it was taken on.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Scratch {
    /// A scratch buffer of at least `bytes` on `dev`'s stream (grown to the next power of two when this
    /// thread's is smaller).
    pub fn take(dev: &CudaDevice, bytes: usize) -> Result<Self> {
        let key = Arc::as_ptr(&dev.cuda_stream()) as usize;
        let held = SCRATCH
            .try_with(|s| {
                let mut s = s.try_borrow_mut().ok()?;
                let at = s.iter().position(|(k, _)| *k == key)?;
                Some(s.remove(at).1)
            })
            .ok()
            .flatten();
        let buf = match held {
            Some(b) if b.len() >= bytes => b,
            held => {
                drop(held);
                alloc::<u8>(dev, bytes.max(SCRATCH_ALIGN).next_power_of_two())?
            }
        };
        Ok(Self {
            buf: Some(buf),
            key,
            _thread: std::marker::PhantomData,
        })
    }

    /// Byte offsets of parts of `sizes` bytes laid out one after another, each at a multiple of
    /// [`SCRATCH_ALIGN`], and the bytes they span.
    pub fn layout(sizes: &[usize]) -> (Vec<usize>, usize) {
        let mut at = 0;
        let offsets = sizes
            .iter()
            .map(|&size| {
                let offset = at;
                at += size.div_ceil(SCRATCH_ALIGN).max(1) * SCRATCH_ALIGN;
                offset
            })
            .collect();
        (offsets, at)
    }

    fn buf(&self) -> Result<&CudaSlice<u8>> {
        self.buf
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("scratch buffer already returned".into()))
    }

    /// `len` elements of `T` from byte `offset` (a multiple of [`SCRATCH_ALIGN`]).
    pub fn view<T>(&self, offset: usize, len: usize) -> Result<CudaView<'_, T>> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let buf = self.buf()?;
        if offset % SCRATCH_ALIGN != 0 || offset + bytes > buf.len() {
            bail!(
                "scratch: {bytes} bytes at {offset} do not fit a buffer of {}",
                buf.len()
            );
        }
        let part = buf.slice(offset..offset + bytes);
        // SAFETY: the part is `bytes` = len·size_of::<T>() bytes at an offset aligned for any kernel
        // argument type; device memory has no invalid bit patterns for the plain types kernels take.
        unsafe { part.transmute::<T>(len.max(1)) }
            .ok_or_else(|| candle_core::Error::Msg("scratch: view does not fit".into()))
    }

    /// Zeroes `bytes` from byte `offset` (stream-ordered, before the launches that follow).
    pub fn zero(&mut self, offset: usize, bytes: usize) -> Result<()> {
        let buf = self
            .buf
            .as_mut()
            .ok_or_else(|| candle_core::Error::Msg("scratch buffer already returned".into()))?;
        if offset + bytes > buf.len() {
            bail!(
                "scratch: {bytes} bytes at {offset} do not fit a buffer of {}",
                buf.len()
            );
        }
        let stream = buf.stream().clone();
        let mut part = buf.slice_mut(offset..offset + bytes);
        stream.memset_zeros(&mut part).map_err(launch_err)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let key = self.key;
        // During thread exit the slot may be gone; the buffer is then freed (stream-ordered).
        let _ = SCRATCH.try_with(move |s| {
            let Ok(mut s) = s.try_borrow_mut() else {
                return;
            };
            match s.iter().position(|(k, _)| *k == key) {
                // Taken twice at once (nested): keep the larger.
                Some(at) => {
                    if s[at].1.len() < buf.len() {
                        s[at].1 = buf;
                    }
                }
                None => {
                    if s.len() >= SCRATCH_STREAMS {
                        s.remove(0);
                    }
                    s.push((key, buf));
                }
            }
        });
    }
}

/// A filled device buffer as a contiguous tensor of `shape`.
pub fn wrap<T: CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Opens CUDA device `ordinal` for Prism: a candle device whose stream-ordered allocations keep the
/// memory they free. candle allocates every tensor with `cuMemAllocAsync` from the device's default
/// pool, whose release threshold is 0: at every stream synchronization (each decision reads its
/// logits) the pool hands all free memory back to the driver, and the next pass maps it again, one
/// grow at a time. Measured on an H200 (2026-11-30): an int8 GEMM launch of 27B's `ffn_down` at
/// M = 275 took 257 µs on the GPU and 380 µs from the host, the difference being its two output
/// buffers mapped anew after each synchronization. With the threshold at its maximum the pool keeps
/// its memory for the process's life (what PyTorch's caching allocator does).
pub fn open_device(ordinal: usize) -> Result<Device> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // The same device as candle's `Device::new_cuda` (the per-thread default stream).
    let dev = <CudaDevice as candle_core::backend::BackendDevice>::new(ordinal)?;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(launch_err)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut keep_all: u64 = u64::MAX;
    // SAFETY: `pool` is an out-parameter the driver fills; the attribute takes a pointer to a u64
    // (cuuint64_t), valid for the call.
    let status = unsafe {
        let got = sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device());
        if got != sys::CUresult::CUDA_SUCCESS {
            got
        } else {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep_all as *mut u64).cast(),
            )
        }
    };
    // A GPU or driver without memory pools (cudarc then allocates with plain cuMemAlloc) has nothing
    // to configure; anything else is an error.
    if status != sys::CUresult::CUDA_SUCCESS && ctx.has_async_alloc() {
        bail!("CUDA device {ordinal}: cannot keep the memory pool's free memory ({status:?})");
    }
    // cudarc gives every allocation a read and a write event (two `cuEventCreate` and, when it is
    // freed, two `cuEventDestroy`) for ordering work across streams. It only uses them once the
    // context has more than one stream (`CudaContext::new_stream`); Prism's device has one, the
    // per-thread default stream, and never creates another, so the events are made and destroyed
    // unused on every tensor.
    // SAFETY: cudarc's conditions for turning the tracking off are about ordering buffers between
    // the streams it knows; it knows one here (the per-thread stream, so cudarc never waits on these
    // events anyway), and the loader threads' work on their own per-thread streams is ordered by a
    // whole-context synchronization at the end of a load (`prism_model::cuda::release_cached_memory`).
    unsafe { ctx.disable_event_tracking() };
    Ok(Device::Cuda(dev))
}

/// A kernel of one of our modules, bound to the device's stream (like candle's `CudaFunc`).
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// A launch of this kernel on the device's stream.
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Raises this kernel's dynamic shared-memory limit to `bytes` (what a launch needs); the error of a
    /// GPU with less shared memory per block names `what` and the size. The driver is asked once per
    /// function and larger size: a limit already raised that far is kept (launches call this every
    /// time, and the attribute call is a driver round trip).
    pub fn allow_dynamic_shared(&self, bytes: usize, what: &str) -> Result<()> {
        let key = self.func.cu_function() as usize;
        let mut allowed = ALLOWED_SHARED.lock().map_err(|_| {
            candle_core::Error::Msg("CUDA shared-memory limit cache lock poisoned".into())
        })?;
        let allowed = allowed.get_or_insert_with(HashMap::new);
        if allowed.get(&key).is_some_and(|&done| done >= bytes) {
            return Ok(());
        }
        self.func
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32_arg(bytes, what)?,
            )
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "{what}: this GPU does not allow {bytes} bytes of dynamic shared memory per block ({e})"
                ))
            })?;
        allowed.insert(key, bytes);
        Ok(())
    }
}

impl std::ops::Deref for Kernel {
    type Target = CudaFunction;

    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

/// Loaded modules and looked-up functions, per CUDA context. Modules keep their context alive, so a
/// context's address is never reused while it is a key here.
type FunctionKey = (usize, &'static str, &'static str);
type ModuleKey = (usize, &'static str);
static MODULES: Mutex<Option<HashMap<ModuleKey, Arc<CudaModule>>>> = Mutex::new(None);
static FUNCTIONS: Mutex<Option<HashMap<FunctionKey, CudaFunction>>> = Mutex::new(None);
/// The dynamic shared-memory limit each function (by its `CUfunction` handle) was raised to. Handles
/// stay valid while their module is loaded, and modules stay in [`MODULES`] for the process's life.
static ALLOWED_SHARED: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);

/// Kernel `name` of module `module`, whose image is `image` (a fatbin, cubin or NUL-terminated PTX,
/// built by `kernels/build_ptx.rs`). The module is loaded once per device context; the driver picks
/// the machine code for the GPU, or JIT-compiles the PTX on a GPU the fatbin has no code for.
pub fn load_kernel(
    dev: &CudaDevice,
    module: &'static str,
    image: &'static [u8],
    name: &'static str,
) -> Result<Kernel> {
    let stream = dev.cuda_stream();
    let ctx = stream.context().clone();
    let ctx_key = Arc::as_ptr(&ctx) as usize;
    fn poisoned<T>(_: T) -> candle_core::Error {
        candle_core::Error::Msg("CUDA kernel cache lock poisoned".into())
    }
    if let Some(func) = FUNCTIONS
        .lock()
        .map_err(poisoned)?
        .get_or_insert_with(HashMap::new)
        .get(&(ctx_key, module, name))
    {
        return Ok(Kernel {
            func: func.clone(),
            stream,
        });
    }
    let loaded = {
        let mut modules = MODULES.lock().map_err(poisoned)?;
        let modules = modules.get_or_insert_with(HashMap::new);
        match modules.get(&(ctx_key, module)) {
            Some(m) => m.clone(),
            None => {
                // The driver reads the image in place; an owned copy gives it heap alignment.
                let m = ctx
                    .load_module(Ptx::from_binary(image.to_vec()))
                    .map_err(|e| {
                        candle_core::Error::Msg(format!("loading CUDA module {module}: {e}"))
                    })?;
                modules.insert((ctx_key, module), m.clone());
                m
            }
        }
    };
    let func = loaded.load_function(name).map_err(|e| {
        candle_core::Error::Msg(format!("CUDA module {module} has no kernel {name}: {e}"))
    })?;
    FUNCTIONS
        .lock()
        .map_err(poisoned)?
        .get_or_insert_with(HashMap::new)
        .insert((ctx_key, module, name), func.clone());
    Ok(Kernel { func, stream })
}
