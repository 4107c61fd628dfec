//! Small helpers for launching our CUDA kernels on candle tensors, shared by prism-quant's integer GEMM
//! and prism-model's decoder kernels: contiguous views of a tensor's `CudaSlice` held under its storage
//! guard, uninitialized output buffers wrapped back into tensors, launch-error conversion, and
//! [`load_kernel`], which loads our fatbins (machine code for sm_80/sm_89/sm_90a plus PTX).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute_enum};
use candle_core::cuda_backend::cudarc::driver::{
    result as driver_result, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView,
    CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, LaunchConfig,
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

/// Whether launches through [`Kernel::builder`] use programmatic dependent launch where the GPU has it
/// (see [`Launch`]); on by default.
static PROGRAMMATIC: AtomicBool = AtomicBool::new(true);

/// Turns programmatic dependent launch on or off for the launches that follow (`prism bench
/// --programmatic-launch off` compares). Results are the same either way: only when a kernel starts
/// changes, not what it computes.
pub fn set_programmatic_launch(on: bool) {
    PROGRAMMATIC.store(on, Ordering::Relaxed);
}

/// Whether programmatic dependent launch is on ([`set_programmatic_launch`]).
pub fn programmatic_launch() -> bool {
    PROGRAMMATIC.load(Ordering::Relaxed)
}

/// A kernel of one of our modules, bound to the device's stream (like candle's `CudaFunc`).
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
    /// The device runs our sm_90a code, whose kernels all begin with the grid-dependency prologue
    /// (`kernels/launch.cuh`): compute capability 9.x.
    programmatic: bool,
}

impl Kernel {
    /// A launch of this kernel on the device's stream.
    pub fn builder(&self) -> Launch<'_> {
        Launch {
            func: &self.func,
            stream: &self.stream,
            programmatic: self.programmatic && programmatic_launch(),
            args: Vec::with_capacity(24),
            pointers: Vec::with_capacity(16),
            _borrows: std::marker::PhantomData,
        }
    }

    /// Whether this kernel may be launched programmatically on its device (its code has the
    /// grid-dependency prologue: compute capability 9.x), whether or not [`programmatic_launch`] is on.
    pub fn programmatic(&self) -> bool {
        self.programmatic
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

/// One kernel argument of a [`Launch`]: the address of a host value the launch borrows, or an index
/// into the launch's own device pointers.
enum Arg {
    Host(*mut c_void),
    Device(usize),
}

/// The arguments of one launch of a [`Kernel`], pushed in the kernel's parameter order with
/// [`PushArg::arg`] (the same calls as cudarc's `LaunchArgs`), then [`Launch::launch`].
///
/// On a GPU of compute capability 9.x (while [`programmatic_launch`] is on) the kernel is launched with
/// the programmatic stream serialization attribute: it may start before the kernel ahead of it on the
/// stream has finished. That is safe because every kernel of ours begins with `PRISM_GRID_PROLOGUE()`
/// (`kernels/launch.cuh`, checked by a test over `kernels/`), which waits for the kernels ahead of it
/// and for their writes before touching memory; what overlaps is the launch and the blocks' start, not
/// the work. The one exception, marked `PRISM_GRID_WAIT_LATER()`: the skinny integer kernel reads its
/// first weights — written once at load, never by a kernel — before it waits. Elsewhere it is a plain
/// `cuLaunchKernel`. Device buffers are passed as their device pointers, with no per-buffer events:
/// [`load_kernel`] refuses a context that tracks them (cudarc's multi-stream synchronization, which
/// [`open_device`] turns off; one stream orders our work).
pub struct Launch<'a> {
    func: &'a CudaFunction,
    stream: &'a Arc<CudaStream>,
    programmatic: bool,
    args: Vec<Arg>,
    pointers: Vec<sys::CUdeviceptr>,
    /// Ties the borrowed host values to the launch.
    _borrows: std::marker::PhantomData<&'a ()>,
}

/// Pushing one kernel argument onto a [`Launch`].
pub trait PushArg<T> {
    fn arg(&mut self, arg: T) -> &mut Self;
}

impl<'a> Launch<'a> {
    fn device(&mut self, ptr: sys::CUdeviceptr) -> &mut Self {
        self.args.push(Arg::Device(self.pointers.len()));
        self.pointers.push(ptr);
        self
    }

    /// Queues the kernel on the stream with the arguments pushed so far.
    ///
    /// # Safety
    /// The arguments must be the kernel's parameters in order and type, and the kernel must stay inside
    /// the buffers it is given (as for cudarc's `LaunchArgs::launch`).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> std::result::Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let pointers = &self.pointers;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match *a {
                Arg::Host(p) => p,
                Arg::Device(i) => (&pointers[i]) as *const sys::CUdeviceptr as *mut c_void,
            })
            .collect();
        if self.programmatic {
            // SAFETY: a zeroed attribute is a valid value of the plain C struct; only its id and the
            // union member of that id are read.
            let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?;
        } else {
            driver_result::launch_kernel(
                self.func.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut params,
            )?;
        }
        Ok(())
    }
}

/// A value passed to a kernel by value: a number, or a `#[repr(C)]` struct laid out as the kernel's
/// parameter type.
///
/// # Safety
/// The type's bytes must be what the kernel's parameter of that position expects (as for cudarc's
/// `DeviceRepr`, which it extends).
pub unsafe trait KernelParam: DeviceRepr {}

macro_rules! kernel_params {
    ($($t:ty),*) => { $(
        // SAFETY: a plain number is passed by value as C passes it.
        unsafe impl KernelParam for $t {}
    )* };
}
kernel_params!(i8, u8, i16, u16, i32, u32, i64, u64, isize, usize, f32, f64, bool);

impl<'a, 'b: 'a, T: KernelParam> PushArg<&'b T> for Launch<'a> {
    fn arg(&mut self, arg: &'b T) -> &mut Self {
        self.args.push(Arg::Host(arg as *const T as *mut c_void));
        self
    }
}

impl<'a, 'b: 'a, T> PushArg<&'b CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b CudaSlice<T>) -> &mut Self {
        // No events are tracked (see `Launch`): the guard does nothing.
        let (ptr, _guard) = arg.device_ptr(self.stream);
        self.device(ptr)
    }
}

impl<'a, 'b: 'a, T> PushArg<&'b mut CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b mut CudaSlice<T>) -> &mut Self {
        // No events are tracked (see `Launch`): the guard does nothing.
        let (ptr, _guard) = arg.device_ptr_mut(self.stream);
        self.device(ptr)
    }
}

impl<'a, 'b: 'a, 'c: 'b, T> PushArg<&'b CudaView<'c, T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b CudaView<'c, T>) -> &mut Self {
        // No events are tracked (see `Launch`): the guard does nothing.
        let (ptr, _guard) = arg.device_ptr(self.stream);
        self.device(ptr)
    }
}

impl<'a, 'b: 'a, 'c: 'b, T> PushArg<&'b mut CudaViewMut<'c, T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b mut CudaViewMut<'c, T>) -> &mut Self {
        // No events are tracked (see `Launch`): the guard does nothing.
        let (ptr, _guard) = arg.device_ptr_mut(self.stream);
        self.device(ptr)
    }
}

/// Loaded modules and looked-up functions, per CUDA context. Modules keep their context alive, so a
/// context's address is never reused while it is a key here.
type FunctionKey = (usize, &'static str, &'static str);
type ModuleKey = (usize, &'static str);
static MODULES: Mutex<Option<HashMap<ModuleKey, Arc<CudaModule>>>> = Mutex::new(None);
/// Each function with whether it may be launched programmatically ([`Kernel::programmatic`]).
static FUNCTIONS: Mutex<Option<HashMap<FunctionKey, (CudaFunction, bool)>>> = Mutex::new(None);
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
    if ctx.is_event_tracking() {
        bail!(
            "CUDA kernel {name}: the device tracks events per buffer; open it with \
             prism_quant::cuda_launch::open_device"
        );
    }
    let ctx_key = Arc::as_ptr(&ctx) as usize;
    fn poisoned<T>(_: T) -> candle_core::Error {
        candle_core::Error::Msg("CUDA kernel cache lock poisoned".into())
    }
    if let Some((func, programmatic)) = FUNCTIONS
        .lock()
        .map_err(poisoned)?
        .get_or_insert_with(HashMap::new)
        .get(&(ctx_key, module, name))
    {
        return Ok(Kernel {
            func: func.clone(),
            stream,
            programmatic: *programmatic,
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
    // The grid-dependency prologue is compiled into code of virtual architecture 9.0 on
    // (`kernels/launch.cuh`): the function the driver picked must come from such code (our sm_90a
    // machine code), not from the compute_80 PTX.
    let programmatic = func
        .get_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PTX_VERSION)
        .is_ok_and(|v| v >= 90);
    FUNCTIONS
        .lock()
        .map_err(poisoned)?
        .get_or_insert_with(HashMap::new)
        .insert((ctx_key, module, name), (func.clone(), programmatic));
    Ok(Kernel {
        func,
        stream,
        programmatic,
    })
}
