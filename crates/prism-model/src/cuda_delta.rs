//! The batched CUDA delta rule behind [`crate::delta_rule::chunked_batch`] and
//! [`crate::delta_rule::chunked`] on CUDA f32 tensors: the launcher of `delta_rule_pairs_batch_f32` and
//! `delta_rule_scan_batch_f32` (kernels/delta_rule.cu).
//!
//! A call takes every segment of a batch and runs them level by level: the segments without a parent
//! first, then the branches of those, and so on (a branch starts from its parent's new state). A level
//! runs as one launch of each kernel while it fits the limits of a launch — [`MAX_SEGMENTS`] segments
//! (the kernel parameter holds their rows and state pointers) and [`CHUNKS_PER_LAUNCH`] chunks in all
//! (the pair-scalar scratch, 32 KiB per head and chunk) — and otherwise as several: a segment that does
//! not fit whole continues in the next launch from the state the first left. Launch boundaries fall on
//! chunk boundaries, and every float a segment gets is formed by the same operations on its own inputs
//! whatever shares its launch, so none of this changes a bit (see the kernel file).
//!
//! Every float is formed by the operation sequence the kernel file lists; the device checks compare a
//! batch with its segments one call each, and with the CPU twin (`tests/device/checks/delta.rs`).

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};
use prism_quant::cuda_launch::PushArg;
use prism_quant::cuda_launch::{
    alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input, Scratch,
};

use crate::delta_rule::{check_batch, RuleSegment, RuleState, CHUNK};

const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/delta_rule.fatbin"));
/// The module name of `IMAGE`.
const MODULE: &str = "prism_delta_rule";

/// Segments per launch (`MAXSEG` in delta_rule.cu).
pub const MAX_SEGMENTS: usize = 32;
/// Chunks per launch, all segments together: bounds the pair-scalar scratch.
pub const CHUNKS_PER_LAUNCH: usize = 32;
/// Value columns per scan block (`CW`) and threads per block (`THREADS`).
const COLUMNS: usize = 32;
const THREADS: u32 = 256;
/// Row strides of the kernels' shared tiles: `XS` (transposed k̂/q̂ of the pair kernel), `US` (U and O
/// tiles), and `dk + KPAD` (row-major k̂/q̂ of the scan kernel).
const XS: usize = CHUNK + 4;
const US: usize = COLUMNS + 4;
const KPAD: usize = 4;

/// The segments of one launch: the C layout of `DeltaSegments` in delta_rule.cu (device pointers as
/// u64, then the ints), passed by value as a kernel parameter.
#[repr(C)]
#[derive(Clone, Copy)]
struct SegmentArgs {
    s_in: [u64; MAX_SEGMENTS],
    pk_in: [u64; MAX_SEGMENTS],
    pu_in: [u64; MAX_SEGMENTS],
    gam_in: [u64; MAX_SEGMENTS],
    start: [i32; MAX_SEGMENTS],
    len: [i32; MAX_SEGMENTS],
    pending: [i32; MAX_SEGMENTS],
    chunk0: [i32; MAX_SEGMENTS + 1],
    count: i32,
    heads: i32,
    key_heads: i32,
    dk: i32,
    dv: i32,
    v_stride: i32,
}

// SAFETY: plain integers in the layout of the kernel's `DeltaSegments` (4·32 pointers, then 135 ints,
// 1568 bytes with the tail padding of an 8-byte-aligned struct; checked below).
unsafe impl DeviceRepr for SegmentArgs {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for SegmentArgs {}

const _: () = assert!(std::mem::size_of::<SegmentArgs>() == 1568);

/// States taken inside the segments of a scan launch: the C layout of `DeltaSnapshots` in
/// delta_rule.cu (device pointers as u64, then the ints), passed by value as a kernel parameter.
#[repr(C)]
#[derive(Clone, Copy)]
struct SnapshotArgs {
    s: [u64; MAX_SEGMENTS],
    pk: [u64; MAX_SEGMENTS],
    pu: [u64; MAX_SEGMENTS],
    gam: [u64; MAX_SEGMENTS],
    chunk: [i32; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
}

// SAFETY: plain integers in the layout of the kernel's `DeltaSnapshots` (4·32 pointers, then 64 ints;
// checked below).
unsafe impl DeviceRepr for SnapshotArgs {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for SnapshotArgs {}

const _: () =
    assert!(std::mem::size_of::<SnapshotArgs>() == 4 * MAX_SEGMENTS * 8 + 2 * MAX_SEGMENTS * 4);

/// `t` contiguous and starting on a 16-byte boundary (the kernels copy it 16 bytes at a time): itself
/// when it already is, else a copy.
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() * t.dtype().size_in_bytes() % 16 == 0 {
        Ok(t)
    } else {
        t.copy()
    }
}

/// `v: [N, H, dv]` as the scan kernel reads it: token rows of `H·dv` contiguous values, `stride`
/// elements apart, at 16-byte aligned addresses (its copies are 16 bytes). A column range of the conv
/// output (`DeltaNet::qkv_heads`) is read in place; any other layout is copied first.
fn value_rows(v: &Tensor) -> Result<(Tensor, usize)> {
    let (n, h, dv) = v.dims3()?;
    let row = h * dv;
    let strides = v.stride();
    let rows_in_place = strides[2] == 1
        && (h == 1 || strides[1] == dv)
        && (n == 1 || (strides[0] >= row && strides[0] % 4 == 0))
        && v.layout().start_offset() % 4 == 0;
    if rows_in_place && n > 0 {
        let stride = if n == 1 { row } else { strides[0] };
        Ok((v.clone(), stride))
    } else {
        Ok((aligned(v)?, row))
    }
}

/// The CUDA [`crate::delta_rule::chunked_batch_with_snapshots`] (same arguments and result). One-token
/// segments that do not close their chunk (decode steps) run on the decode kernel, the rest on the pair
/// and scan kernels; both give the same bits. A segment's snapshot is written by the scan kernel as it
/// passes the point (or is the state a launch ends with, where a launch ends there).
/// Its parameter list is the CPU function's on purpose: the same signature is the contract between the
/// op and its device twin (the shapes are checked once, in `check_batch`).
pub fn delta_rule_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<BatchResult> {
    delta_rule_batch_with(q, k, v, g, beta, segments, states, Some(DecodeKernel::Auto))
}

/// Outputs `[N, H, dv]`, every segment's state after its rows, and each segment's snapshot state.
pub type BatchResult = (Tensor, Vec<RuleState>, Vec<Option<RuleState>>);

/// Which kernel runs a decode step (one-token segments inside their chunk): the same bits either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// The column slices of a head as one thread-block cluster, each block forming the pair scalars
    /// of a share of the pending rows, where the GPU has clusters (compute capability 9.x) and the
    /// slices of a head (dv / 32) are a multiple of 2; otherwise [`DecodeKernel::Portable`].
    Auto,
    /// Every block forms all the pair scalars of its head (any GPU).
    Portable,
}

/// [`delta_rule_batch`] with its decode steps (one-token segments inside their chunk) on the decode
/// kernel `decode`, or with `None` every segment on the pair and scan kernels: the device checks
/// compare the decode kernels with each other and with the pair and scan kernels.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_batch_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    segments: &[RuleSegment],
    states: &[RuleState],
    decode: Option<DecodeKernel>,
) -> Result<BatchResult> {
    let dims = check_batch(q, k, v, g, beta, segments, states)?;
    let (tokens, heads, dk, dv) = (dims.tokens, dims.heads, dims.dk, dims.dv);
    if dv % COLUMNS != 0 || dk % 4 != 0 || dk == 0 || dk > 256 || v.dtype() != DType::F32 {
        bail!(
            "delta rule (cuda): dv = {dv} must be a multiple of {COLUMNS}, dk = {dk} a multiple of 4 up to 256, dtype f32 (found {:?})",
            v.dtype()
        );
    }
    let dev = cuda_device(q)?;
    let (q, k) = (aligned(q)?, aligned(k)?);
    let (v, v_stride) = value_rows(v)?;
    let (g, beta) = (g.contiguous()?, beta.contiguous()?);
    let (iq, ik, iv) = (
        Input::new(&q, DType::F32, "q")?,
        Input::new(&k, DType::F32, "k")?,
        Input::spanning(
            &v,
            DType::F32,
            "v",
            (tokens.max(1) - 1) * v_stride + heads * dv,
        )?,
    );
    let (ig, ib) = (
        Input::new(&g, DType::F32, "g")?,
        Input::new(&beta, DType::F32, "beta")?,
    );
    let x = BatchInputs {
        q: iq.view::<f32>()?,
        k: ik.view::<f32>()?,
        v: iv.view::<f32>()?,
        g: ig.view::<f32>()?,
        beta: ib.view::<f32>()?,
        heads,
        key_heads: dims.key_heads,
        dk,
        dv,
        v_stride,
    };
    let out = alloc::<f32>(&dev, tokens * heads * dv)?;

    // Level of a segment: 0 without a parent, else one more than its parent's (parents come first).
    let mut level = vec![0usize; segments.len()];
    for (i, seg) in segments.iter().enumerate() {
        if let Some(p) = seg.parent {
            level[i] = level[p] + 1;
        }
    }
    let mut done: Vec<Option<RuleState>> = vec![None; segments.len()];
    let mut snapshots: Vec<Option<RuleState>> = vec![None; segments.len()];
    let levels = level.iter().copied().max().unwrap_or(0);
    for l in 0..=levels {
        let mut work: Vec<Progress> = Vec::new();
        for (i, seg) in segments.iter().enumerate().filter(|(i, _)| level[*i] == l) {
            let state = match seg.parent {
                Some(p) => done[p].clone(),
                None => Some(states[i].clone()),
            };
            let Some(state) = state else {
                bail!("delta rule (cuda): segment {i} runs before its parent");
            };
            work.push(Progress {
                segment: i,
                done: 0,
                state,
            });
        }
        // Decode steps: one launch of the decode kernel per MAX_SEGMENTS of them.
        if let Some(kernel) = decode {
            let steps: Vec<usize> = (0..work.len())
                .filter(|&wi| {
                    let w = &work[wi];
                    segments[w.segment].len == 1 && w.done == 0 && w.state.pending + 1 < CHUNK
                })
                .collect();
            for group in steps.chunks(MAX_SEGMENTS) {
                let parts: Vec<Part<'_>> = group
                    .iter()
                    .map(|&wi| Part {
                        start: segments[work[wi].segment].start,
                        tokens: 1,
                        state: &work[wi].state,
                        snapshot: None,
                    })
                    .collect();
                let next = launch_decode(&dev, &x, &out, &parts, kernel)?;
                drop(parts);
                for (&wi, state) in group.iter().zip(next) {
                    work[wi].done = 1;
                    work[wi].state = state;
                }
            }
        }
        while work.iter().any(|w| w.done < segments[w.segment].len) {
            // The next launch: segments in order, each with all its remaining chunks while the chunk
            // budget lasts; the one that meets the limit takes what is left of it, ending on a chunk
            // boundary, and continues in the next launch.
            let mut budget = CHUNKS_PER_LAUNCH;
            let mut group: Vec<(usize, usize)> = Vec::new(); // (index in `work`, tokens)
            for (wi, w) in work.iter().enumerate() {
                let left = segments[w.segment].len - w.done;
                if left == 0 {
                    continue;
                }
                if group.len() == MAX_SEGMENTS || budget == 0 {
                    break;
                }
                let pending = w.state.pending;
                let take = (pending + left).div_ceil(CHUNK).min(budget);
                group.push((wi, left.min(take * CHUNK - pending)));
                budget -= take;
            }
            let parts: Vec<Part<'_>> = group
                .iter()
                .map(|&(wi, tokens)| {
                    let (seg, done) = (&segments[work[wi].segment], work[wi].done);
                    Part {
                        start: seg.start + done,
                        tokens,
                        state: &work[wi].state,
                        // The snapshot when its point falls inside this part (not at its end: then
                        // the part's own state is it).
                        snapshot: seg
                            .snapshot
                            .filter(|&p| p > done && p < done + tokens)
                            .map(|p| p - done),
                    }
                })
                .collect();
            let next = launch(&dev, &x, &out, &parts)?;
            drop(parts);
            for (&(wi, tokens), (state, inside)) in group.iter().zip(next) {
                let segment = work[wi].segment;
                work[wi].done += tokens;
                if inside.is_some() {
                    snapshots[segment] = inside;
                } else if segments[segment].snapshot == Some(work[wi].done) {
                    snapshots[segment] = Some(state.clone());
                }
                work[wi].state = state;
            }
        }
        for w in work {
            done[w.segment] = Some(w.state);
        }
    }
    let states = done
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            s.ok_or_else(|| {
                candle_core::Error::Msg(format!("delta rule (cuda): segment {i} did not run"))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    for (i, seg) in segments.iter().enumerate() {
        if seg.snapshot.is_some() && snapshots[i].is_none() {
            bail!("delta rule (cuda): segment {i}'s snapshot was not taken");
        }
    }
    Ok((wrap(out, &dev, (tokens, heads, dv)), states, snapshots))
}

/// How far one segment of a level has got.
struct Progress {
    segment: usize,
    /// Its tokens already run.
    done: usize,
    /// Its state after them.
    state: RuleState,
}

/// A snapshot's memory, pending keys, pending values and pending decays (device buffers).
type SnapshotBuffers = (
    CudaSlice<f32>,
    CudaSlice<f32>,
    CudaSlice<f32>,
    CudaSlice<f64>,
);

/// One segment's part of a launch: `tokens` rows from packed row `start`, continuing `state`; with
/// `snapshot: Some(p)` (0 < p < tokens) also the state after its first `p` rows.
struct Part<'a> {
    start: usize,
    tokens: usize,
    state: &'a RuleState,
    snapshot: Option<usize>,
}

/// The token inputs of a batched call, as device views.
struct BatchInputs<'a> {
    q: CudaView<'a, f32>,
    k: CudaView<'a, f32>,
    v: CudaView<'a, f32>,
    g: CudaView<'a, f32>,
    beta: CudaView<'a, f32>,
    heads: usize,
    key_heads: usize,
    dk: usize,
    dv: usize,
    v_stride: usize,
}

/// One launch of each kernel over `parts` (at most [`MAX_SEGMENTS`], at most [`CHUNKS_PER_LAUNCH`]
/// chunks in all): writes their outputs into `out` (rows of the packed call) and returns their states,
/// each with its snapshot where the part asks for one.
fn launch(
    dev: &CudaDevice,
    x: &BatchInputs<'_>,
    out: &CudaSlice<f32>,
    parts: &[Part<'_>],
) -> Result<Vec<(RuleState, Option<RuleState>)>> {
    let (heads, dk, dv) = (x.heads, x.dk, x.dv);
    let count = parts.len();
    if count == 0 || count > MAX_SEGMENTS {
        bail!("delta rule (cuda): {count} segments in one launch (1 to {MAX_SEGMENTS})");
    }
    // The states, contiguous and 16-byte aligned, kept alive for the launch.
    let held = held_states(parts)?;
    let inputs = state_inputs(&held)?;
    let views = state_views(&inputs)?;

    let stream = dev.cuda_stream();
    let (args, chunks, guards) = segment_args(&stream, x, parts, &views)?;
    if chunks > CHUNKS_PER_LAUNCH {
        bail!("delta rule (cuda): {chunks} chunks in one launch (at most {CHUNKS_PER_LAUNCH})");
    }
    for (name, view) in [("q", &x.q), ("k", &x.k), ("v", &x.v)] {
        let (p, guard) = view.device_ptr(&stream);
        if p % 16 != 0 {
            bail!("delta rule (cuda): {name} is not 16-byte aligned");
        }
        drop(guard);
    }

    // Scratch of the pair kernel (all written by it, read by the scan) and the new states.
    let (ab_len, gam_len, fac_len) = (
        chunks * heads * 2 * CHUNK * CHUNK,
        chunks * heads * CHUNK,
        chunks * heads * 4 * CHUNK,
    );
    let (at, bytes) = Scratch::layout(&[4 * ab_len, 8 * gam_len, 4 * fac_len]);
    let scratch = Scratch::take(dev, bytes)?;
    let ab = scratch.view::<f32>(at[0], ab_len)?;
    let gam_s = scratch.view::<f64>(at[1], gam_len)?;
    let fac = scratch.view::<f32>(at[2], fac_len)?;
    let s_out = alloc::<f32>(dev, count * heads * dk * dv)?; // slots of segments that close a chunk
    let pk_out = alloc::<f32>(dev, count * heads * CHUNK * dk)?;
    let pu_out = alloc::<f32>(dev, count * heads * CHUNK * dv)?;
    let gam_out = alloc::<f64>(dev, count * heads * CHUNK)?;
    // Snapshot buffers of the parts that ask for one, and the kernel's table of them.
    let mut snapshot_args = SnapshotArgs {
        s: [0; MAX_SEGMENTS],
        pk: [0; MAX_SEGMENTS],
        pu: [0; MAX_SEGMENTS],
        gam: [0; MAX_SEGMENTS],
        chunk: [-1; MAX_SEGMENTS],
        rows: [0; MAX_SEGMENTS],
    };
    // Per part: its snapshot's buffers (memory, pending keys, values, decays) and pending rows.
    let mut snapshot_out: Vec<Option<(SnapshotBuffers, usize)>> = Vec::with_capacity(count);
    for part in parts {
        snapshot_out.push(match part.snapshot.filter(|&p| p > 0 && p < part.tokens) {
            Some(p) => Some((
                (
                    alloc::<f32>(dev, heads * dk * dv)?,
                    alloc::<f32>(dev, heads * CHUNK * dk)?,
                    alloc::<f32>(dev, heads * CHUNK * dv)?,
                    alloc::<f64>(dev, heads * CHUNK)?,
                ),
                (part.state.pending + p) % CHUNK,
            )),
            None => None,
        });
    }
    let mut snapshot_guards = Vec::new();
    for (j, (part, buffers)) in parts.iter().zip(&snapshot_out).enumerate() {
        let (Some(p), Some(((s, pk, pu, gam), _))) = (part.snapshot, buffers) else {
            continue;
        };
        let at = part.state.pending + p;
        let (p_s, g_s) = s.device_ptr(&stream);
        let (p_pk, g_pk) = pk.device_ptr(&stream);
        let (p_pu, g_pu) = pu.device_ptr(&stream);
        let (p_gam, g_gam) = gam.device_ptr(&stream);
        snapshot_guards.extend([g_s, g_pk, g_pu, g_gam]);
        snapshot_args.s[j] = p_s;
        snapshot_args.pk[j] = p_pk;
        snapshot_args.pu[j] = p_pu;
        snapshot_args.gam[j] = p_gam;
        snapshot_args.chunk[j] = i32_arg(at / CHUNK, "snapshot chunk")?;
        snapshot_args.rows[j] = i32_arg(at % CHUNK, "snapshot rows")?;
    }

    // Shared memory, as laid out at the top of each kernel.
    let pairs_smem = CHUNK * 8 + 2 * CHUNK * 4 + 2 * dk * XS * 4;
    let ks = dk + KPAD;
    let scan_smem = CHUNK * 8
        + 4 * CHUNK * 4
        + (dk * COLUMNS + 2 * CHUNK * US + CHUNK * ks + (CHUNK * ks).max(2 * CHUNK * CHUNK)) * 4;

    let pairs = load_kernel(dev, MODULE, IMAGE, "delta_rule_pairs_batch_f32")?;
    pairs.allow_dynamic_shared(pairs_smem, "delta rule pair shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, chunks as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: pairs_smem as u32,
    };
    {
        let mut b = pairs.builder();
        b.arg(&x.q).arg(&x.k).arg(&x.g).arg(&x.beta);
        b.arg(&ab).arg(&gam_s).arg(&fac).arg(&args);
        // SAFETY: the arguments match the kernel's signature; the buffers hold what the segment table
        // says (rows start..start + len of the packed inputs, checked against their shapes by
        // check_batch, and states of `heads` heads of dk × dv, checked above); the scratch holds
        // `chunks` chunks of every head.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }

    let scan = load_kernel(dev, MODULE, IMAGE, "delta_rule_scan_batch_f32")?;
    scan.allow_dynamic_shared(scan_smem, "delta rule scan shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, (dv / COLUMNS) as u32, count as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: scan_smem as u32,
    };
    {
        let mut b = scan.builder();
        b.arg(&x.q)
            .arg(&x.k)
            .arg(&x.v)
            .arg(&ab)
            .arg(&gam_s)
            .arg(&fac);
        b.arg(out)
            .arg(&s_out)
            .arg(&pk_out)
            .arg(&pu_out)
            .arg(&gam_out)
            .arg(&args)
            .arg(&snapshot_args);
        // SAFETY: as above; `out` holds every row of the packed call and each segment writes its own
        // rows; the state outputs hold `count` segments; each snapshot pointer is a live buffer of
        // one state (held in `snapshot_out` past the launch, freed in stream order), and a segment's
        // snapshot chunk is one of its chunks in this launch (0 < p < tokens).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    drop(guards);
    drop(snapshot_guards);

    let s_all = wrap(s_out, dev, (count, heads, dk, dv));
    let pk_all = wrap(pk_out, dev, (count, heads, CHUNK, dk));
    let pu_all = wrap(pu_out, dev, (count, heads, CHUNK, dv));
    let gam_all = wrap(gam_out, dev, (count, heads, CHUNK));
    parts
        .iter()
        .zip(snapshot_out)
        .enumerate()
        .map(|(j, (p, snapshot))| {
            // The kernel writes the memory only where a chunk closed; elsewhere it is the input's.
            let chunk_start = if p.state.pending + p.tokens >= CHUNK {
                s_all.get(j)?
            } else {
                p.state.chunk_start.clone()
            };
            let state = RuleState {
                chunk_start,
                pending_k: pk_all.get(j)?,
                pending_u: pu_all.get(j)?,
                pending_gamma: gam_all.get(j)?,
                pending: (p.state.pending + p.tokens) % CHUNK,
                rows: crate::delta_rule::PendingRows::new((p.state.pending + p.tokens) % CHUNK),
            };
            let snapshot = snapshot.map(|((s, pk, pu, gam), rows)| RuleState {
                chunk_start: wrap(s, dev, (heads, dk, dv)),
                pending_k: wrap(pk, dev, (heads, CHUNK, dk)),
                pending_u: wrap(pu, dev, (heads, CHUNK, dv)),
                pending_gamma: wrap(gam, dev, (heads, CHUNK)),
                pending: rows,
                rows: crate::delta_rule::PendingRows::new(rows),
            });
            Ok((state, snapshot))
        })
        .collect()
}

/// The states of `parts` as the kernels read them: the memory, pending keys and pending values
/// contiguous and 16-byte aligned ([`aligned`]), the pending decays contiguous; the caller holds them
/// until its launch is queued.
fn held_states(parts: &[Part<'_>]) -> Result<Vec<[Tensor; 4]>> {
    parts
        .iter()
        .map(|p| {
            Ok([
                aligned(&p.state.chunk_start)?,
                aligned(&p.state.pending_k)?,
                aligned(&p.state.pending_u)?,
                p.state.pending_gamma.contiguous()?,
            ])
        })
        .collect()
}

/// A state's memory, pending keys, values and decays as read guards on their storage.
type StateInputs<'a> = (Input<'a>, Input<'a>, Input<'a>, Input<'a>);

/// Read guards on each of [`held_states`]' tensors, checked for their dtypes (f32, f32, f32, f64).
fn state_inputs(held: &[[Tensor; 4]]) -> Result<Vec<StateInputs<'_>>> {
    held.iter()
        .map(|t| {
            Ok((
                Input::new(&t[0], DType::F32, "memory")?,
                Input::new(&t[1], DType::F32, "pending keys")?,
                Input::new(&t[2], DType::F32, "pending values")?,
                Input::new(&t[3], DType::F64, "pending decays")?,
            ))
        })
        .collect()
}

/// A state's memory, pending keys, values and decays as device views.
type StateViews<'a> = (
    CudaView<'a, f32>,
    CudaView<'a, f32>,
    CudaView<'a, f32>,
    CudaView<'a, f64>,
);

/// The device views of [`state_inputs`]' guards, in the same order.
fn state_views<'a>(inputs: &'a [StateInputs<'_>]) -> Result<Vec<StateViews<'a>>> {
    inputs
        .iter()
        .map(|(s, pk, pu, gam)| {
            Ok((
                s.view::<f32>()?,
                pk.view::<f32>()?,
                pu.view::<f32>()?,
                gam.view::<f64>()?,
            ))
        })
        .collect()
}

/// The segment table of a launch over `parts` (their states' device pointers, rows and pending counts;
/// `chunk0` as the pair and scan kernels count chunks) and the guards that keep the pointers valid.
fn segment_args<'a>(
    stream: &'a std::sync::Arc<CudaStream>,
    x: &BatchInputs<'_>,
    parts: &[Part<'_>],
    views: &'a [StateViews<'a>],
) -> Result<(SegmentArgs, usize, Vec<SyncOnDrop<'a>>)> {
    let count = parts.len();
    let (heads, dk, dv) = (x.heads, x.dk, x.dv);
    let mut args = SegmentArgs {
        s_in: [0; MAX_SEGMENTS],
        pk_in: [0; MAX_SEGMENTS],
        pu_in: [0; MAX_SEGMENTS],
        gam_in: [0; MAX_SEGMENTS],
        start: [0; MAX_SEGMENTS],
        len: [0; MAX_SEGMENTS],
        pending: [0; MAX_SEGMENTS],
        chunk0: [0; MAX_SEGMENTS + 1],
        count: i32_arg(count, "segments")?,
        heads: i32_arg(heads, "heads")?,
        key_heads: i32_arg(x.key_heads, "key heads")?,
        dk: i32_arg(dk, "dk")?,
        dv: i32_arg(dv, "dv")?,
        v_stride: i32_arg(x.v_stride, "v row stride")?,
    };
    let mut guards = Vec::with_capacity(4 * count);
    let mut chunks = 0usize;
    for (j, (part, (s, pk, pu, gam))) in parts.iter().zip(views).enumerate() {
        if part.state.dims()? != (heads, dk, dv) || part.tokens == 0 {
            bail!(
                "delta rule (cuda): launch part {j} does not fit ({} tokens)",
                part.tokens
            );
        }
        let (p_s, g_s) = s.device_ptr(stream);
        let (p_pk, g_pk) = pk.device_ptr(stream);
        let (p_pu, g_pu) = pu.device_ptr(stream);
        let (p_gam, g_gam) = gam.device_ptr(stream);
        if [p_s, p_pk, p_pu].iter().any(|p| p % 16 != 0) || p_gam % 8 != 0 {
            bail!("delta rule (cuda): state buffers of launch part {j} are not 16-byte aligned");
        }
        guards.extend([g_s, g_pk, g_pu, g_gam]);
        args.s_in[j] = p_s;
        args.pk_in[j] = p_pk;
        args.pu_in[j] = p_pu;
        args.gam_in[j] = p_gam;
        args.start[j] = i32_arg(part.start, "segment start")?;
        args.len[j] = i32_arg(part.tokens, "segment tokens")?;
        args.pending[j] = i32_arg(part.state.pending, "pending rows")?;
        args.chunk0[j] = i32_arg(chunks, "chunk index")?;
        chunks += (part.state.pending + part.tokens).div_ceil(CHUNK);
    }
    args.chunk0[count] = i32_arg(chunks, "chunks")?;
    Ok((args, chunks, guards))
}

/// Threads of the decode kernel (`DECODE_THREADS` in delta_rule.cu): a pair scalar's chain a thread,
/// the solve two a column of its slice.
const DECODE_THREADS: u32 = 128;

/// The decode kernel `kernel` runs on `dev` for `dv` value columns: its entry and the column slices of
/// a cluster (1: no cluster), `NS` in delta_rule.cu.
fn decode_entry(
    dev: &CudaDevice,
    kernel: DecodeKernel,
    dv: usize,
) -> Result<(&'static str, usize)> {
    let slices = dv / COLUMNS;
    if kernel == DecodeKernel::Auto && slices % 2 == 0 {
        let (major, _) = dev
            .cuda_stream()
            .context()
            .compute_capability()
            .map_err(launch_err)?;
        if major == 9 {
            return Ok(if slices % 4 == 0 {
                ("delta_rule_decode_cluster4_f32", 4)
            } else {
                ("delta_rule_decode_cluster2_f32", 2)
            });
        }
    }
    Ok(("delta_rule_decode_batch_f32", 1))
}

/// Per-segment destinations of a decode launch: the C layout of `DecodeOutputs` in delta_rule.cu.
/// Its arrays repeat [`SegmentArgs`]'s first fields, but each struct mirrors its own C struct field for
/// field (size asserted below), so they stay two.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecodeOutputs {
    pk: [u64; MAX_SEGMENTS],
    pu: [u64; MAX_SEGMENTS],
    gam: [u64; MAX_SEGMENTS],
    in_place: [i32; MAX_SEGMENTS],
}

// SAFETY: plain integers in the layout of the kernel's `DecodeOutputs` (3·32 pointers, 32 ints: 896
// bytes, checked below).
unsafe impl DeviceRepr for DecodeOutputs {}
// SAFETY: as for DeviceRepr above.
unsafe impl prism_quant::cuda_launch::KernelParam for DecodeOutputs {}

const _: () = assert!(std::mem::size_of::<DecodeOutputs>() == 896);

/// Whether `t`'s elements are its own storage from its start, contiguous and 16-byte aligned: what a
/// kernel may write in place (`aligned` would hand back a copy otherwise).
fn writable_in_place(t: &Tensor) -> bool {
    t.is_contiguous() && t.layout().start_offset() * t.dtype().size_in_bytes() % 16 == 0
}

/// One launch of the decode kernel over `parts` (at most [`MAX_SEGMENTS`] one-token segments whose
/// pending rows stay under [`CHUNK`]): writes their output rows into `out` and returns their states
/// (the memory is the input's: no chunk closes). A part whose state still owns its next pending row
/// ([`crate::delta_rule::PendingRows::claim`]) writes it into its own buffers, and its new state shares
/// them; the others write whole new pending rows into fresh buffers.
fn launch_decode(
    dev: &CudaDevice,
    x: &BatchInputs<'_>,
    out: &CudaSlice<f32>,
    parts: &[Part<'_>],
    kernel: DecodeKernel,
) -> Result<Vec<RuleState>> {
    let (heads, dk, dv) = (x.heads, x.dk, x.dv);
    let count = parts.len();
    if count == 0 || count > MAX_SEGMENTS {
        bail!("delta rule decode (cuda): {count} segments in one launch (1 to {MAX_SEGMENTS})");
    }
    if parts
        .iter()
        .any(|p| p.tokens != 1 || p.state.pending + 1 >= CHUNK)
    {
        bail!("delta rule decode (cuda): a part is not a one-token step inside its chunk");
    }
    // In place where the buffers can be written as they are and the claim on the next row succeeds
    // (claimed last: a refused layout must not consume the claim).
    let in_place: Vec<bool> = parts
        .iter()
        .map(|p| {
            writable_in_place(&p.state.pending_k)
                && writable_in_place(&p.state.pending_u)
                && p.state.pending_gamma.is_contiguous()
                && p.state.rows.claim(p.state.pending)
        })
        .collect();
    let held = held_states(parts)?;
    let inputs = state_inputs(&held)?;
    let views = state_views(&inputs)?;
    let stream = dev.cuda_stream();
    let (args, _, guards) = segment_args(&stream, x, parts, &views)?;

    // Fresh buffers for the parts that copy, one slot each.
    let copies = in_place.iter().filter(|&&p| !p).count();
    // Fresh buffers only where a part copies (a thought's steps all continue in place).
    let fresh = if copies > 0 {
        Some((
            alloc::<f32>(dev, copies * heads * CHUNK * dk)?,
            alloc::<f32>(dev, copies * heads * CHUNK * dv)?,
            alloc::<f64>(dev, copies * heads * CHUNK)?,
        ))
    } else {
        None
    };
    let mut wo = DecodeOutputs {
        pk: [0; MAX_SEGMENTS],
        pu: [0; MAX_SEGMENTS],
        gam: [0; MAX_SEGMENTS],
        in_place: [0; MAX_SEGMENTS],
    };
    let mut slot_of = vec![None; count];
    {
        let ptrs = fresh.as_ref().map(|(pk, pu, gam)| {
            (
                pk.device_ptr(&stream),
                pu.device_ptr(&stream),
                gam.device_ptr(&stream),
            )
        });
        let mut next = 0usize;
        for j in 0..count {
            if in_place[j] {
                // The part's own buffers: the pointers segment_args put in the table.
                wo.pk[j] = args.pk_in[j];
                wo.pu[j] = args.pu_in[j];
                wo.gam[j] = args.gam_in[j];
                wo.in_place[j] = 1;
            } else if let Some(((p_pk, _), (p_pu, _), (p_gam, _))) = &ptrs {
                wo.pk[j] = p_pk + (next * heads * CHUNK * dk * 4) as u64;
                wo.pu[j] = p_pu + (next * heads * CHUNK * dv * 4) as u64;
                wo.gam[j] = p_gam + (next * heads * CHUNK * 8) as u64;
                slot_of[j] = Some(next);
                next += 1;
            }
        }
    }
    // Shared memory as laid out at the top of the kernel: Γ, the memory's and the pending u rows'
    // slices, k̂_r, q̂_r, A, B, u_r, the pending k̂ rows whose pair scalars the block forms.
    let (entry, cluster) = decode_entry(dev, kernel, dv)?;
    let smem = CHUNK * 8
        + (dk * COLUMNS + CHUNK * COLUMNS + 2 * dk + 2 * CHUNK + COLUMNS) * 4
        + CHUNK / cluster * (dk + KPAD) * 4;
    let kernel = load_kernel(dev, MODULE, IMAGE, entry)?;
    kernel.allow_dynamic_shared(smem, "delta rule decode shared memory")?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, (dv / COLUMNS) as u32, count as u32),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    {
        let mut b = kernel.builder();
        b.arg(&x.q).arg(&x.k).arg(&x.v).arg(&x.g).arg(&x.beta);
        b.arg(out).arg(&args).arg(&wo);
        // SAFETY: the arguments match the kernel's signature; each part's row `start` is inside the
        // packed inputs (check_batch) and its state holds `heads` heads of dk × dv with CHUNK pending
        // rows (checked by segment_args); `out` holds every row of the packed call. A part writing in
        // place writes row `pending` of its own contiguous buffers (held alive by `held` until the
        // launch is queued, and by its states after), which its claim gave it alone and which no
        // state reads; the others write their slot of the fresh buffers, which hold `copies` slots.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    drop(guards);
    let fresh = fresh.map(|(pk, pu, gam)| {
        (
            wrap(pk, dev, (copies, heads, CHUNK, dk)),
            wrap(pu, dev, (copies, heads, CHUNK, dv)),
            wrap(gam, dev, (copies, heads, CHUNK)),
        )
    });
    parts
        .iter()
        .zip(slot_of)
        .map(|(p, slot)| {
            let pending = p.state.pending + 1;
            Ok(match (slot, &fresh) {
                (Some(i), Some((pk_all, pu_all, gam_all))) => RuleState {
                    chunk_start: p.state.chunk_start.clone(),
                    pending_k: pk_all.get(i)?,
                    pending_u: pu_all.get(i)?,
                    pending_gamma: gam_all.get(i)?,
                    pending,
                    rows: crate::delta_rule::PendingRows::new(pending),
                },
                _ => RuleState {
                    pending,
                    ..p.state.clone()
                },
            })
        })
        .collect()
}
