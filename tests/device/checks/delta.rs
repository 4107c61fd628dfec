//! The batched delta rule (`delta_rule::chunked_batch` on CUDA:
//! `prism_model::cuda_delta`, the batched kernels of kernels/delta_rule.cu).
//!
//! 1. Bit for bit on the GPU, outputs and every part of every new state (memory, pending keys, values
//!    and decays, pending count), for a batch of seven sequences: roots from a random memory, from
//!    states 37 tokens into a chunk and from zero, a decode-like one-token segment, a segment that
//!    ends exactly on a chunk boundary, two branches of one segment and a branch of a branch; q/k with
//!    2 key heads under 6 value heads. The batched call is compared with (a) the same segments one
//!    call each (`delta_rule::chunked`), (b) v read through a row stride, and (c) the batched call on
//!    q/k tiled to the value heads.
//! 2. The same batch against the CPU twin (`chunked_batch` on the host): ‖Δ‖/‖ref‖ of the outputs and
//!    of the memories after every segment.
//! 3. The decode kernels (one-token segments inside their chunk: the cluster kernel on Hopper and the
//!    portable one) against the pair and scan kernels, bit for bit, at every pending count, at
//!    dk = dv = 128 and 64.
//! 4. Snapshots inside segments (the state after a segment's first rows, written by the scan kernel or
//!    taken at a launch's end) against those rows run alone, bit for bit, and the batch with snapshots
//!    against the batch without (`snapshot_checks`).
//! 5. Launch limits, bit for bit against one call each: 40 one-token sequences from 40 states at
//!    different pending rows (two launches of ≤ 32 segments), and a 2,200-token prompt next to three
//!    short ones (the chunk budget splits the long one across launches).
//! 6. Timing at 27B shapes (48 value heads over 16 key heads, dk = dv = 128), median of 21 runs after a
//!    warm-up, µs: one layer's delta rule for one 275-token prompt, for a 230-token prefix and three
//!    40-token branches of it, and for a decode step of 12 sequences; and the ×3 q/k tiling that
//!    reading the key heads in place saves.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_model::cuda_delta::{delta_rule_batch_with, DecodeKernel};
use prism_model::delta_rule::{
    self, chunked_batch, chunked_batch_with_snapshots, expand_key_heads, RuleSegment, RuleState,
};
use serde_json::json;

use crate::harness::{median_seconds, on_device, Report, Rng};
use crate::kernels::{chunked_rows, delta_rule_inputs};

/// Bound on ‖Δ‖/‖ref‖ against the CPU twin. Both sides compute in f32 with f64 decays, in different
/// summation orders (the CPU's dot products use 8 lanes); the per-segment kernels measured 2.5e-7 on
/// outputs and memories (docs/correctness.md). Starting states that were themselves computed on each
/// side add their own ~1e-7.
const CPU_BOUND: f64 = 1e-5;

/// Packed inputs of a batch on the CPU: `q, k: [N, hk, dk]`, `v: [N, h, dv]`, `g, beta: [N, h]`.
fn batch_inputs(
    rng: &mut Rng,
    n: usize,
    h: usize,
    hk: usize,
    dk: usize,
    dv: usize,
) -> Result<[Tensor; 5]> {
    let [q, k, ..] = delta_rule_inputs(rng, n, hk, dk, dv)?;
    let [_, _, v, g, beta] = delta_rule_inputs(rng, n, h, dk, dv)?;
    Ok([q, k, v, g, beta])
}

/// `x` with q and k tiled to the value heads.
fn tiled(x: &[Tensor; 5]) -> Result<[Tensor; 5]> {
    let h = x[2].dim(1)?;
    Ok([
        expand_key_heads(&x[0], h)?,
        expand_key_heads(&x[1], h)?,
        x[2].clone(),
        x[3].clone(),
        x[4].clone(),
    ])
}

/// The state after `tokens` random tokens (value heads `h`) from a random memory, on `device`; the same
/// inputs on every device (a fresh `Rng` per `seed`).
fn state_after(
    seed: u64,
    tokens: usize,
    h: usize,
    dk: usize,
    dv: usize,
    device: &Device,
) -> Result<RuleState> {
    let mut rng = Rng(seed);
    let memory = rng.tensor(&[h, dk, dv], 0.5)?.to_device(device)?;
    let start = RuleState::from_memory(&memory)?;
    if tokens == 0 {
        return Ok(start);
    }
    let x = on_device(&delta_rule_inputs(&mut rng, tokens, h, dk, dv)?, device)?;
    Ok(delta_rule::chunked(&x[0], &x[1], &x[2], &x[3], &x[4], &start)?.1)
}

/// The segments one `delta_rule::chunked` call each (q/k tiled), branches from their parent's new state.
fn one_by_one(
    x: &[Tensor; 5],
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<(Tensor, Vec<RuleState>)> {
    let x = tiled(x)?;
    let mut outs = Vec::with_capacity(segments.len());
    let mut new_states: Vec<RuleState> = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        let start = match seg.parent {
            Some(p) => new_states[p].clone(),
            None => states[i].clone(),
        };
        let (o, state) = chunked_rows(&x, (seg.start, seg.len), x[0].device(), &start)?;
        outs.push(o);
        new_states.push(state);
    }
    Ok((Tensor::cat(&outs, 0)?, new_states))
}

/// One part of a rule state.
type StatePart = fn(&RuleState) -> &Tensor;

/// Outputs and all states of two runs of the same batch, bit for bit.
fn same_results(
    r: &mut Report,
    name: &str,
    got: &(Tensor, Vec<RuleState>),
    want: &(Tensor, Vec<RuleState>),
) -> Result<()> {
    r.identical(&format!("{name}: outputs"), &got.0, &want.0)?;
    let stack = |states: &[RuleState], part: fn(&RuleState) -> &Tensor| -> Result<Tensor> {
        let parts: Vec<Tensor> = states
            .iter()
            .map(|s| part(s).to_device(&Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::stack(&parts, 0)?)
    };
    let (a, b) = (&got.1, &want.1);
    if a.len() != b.len() {
        bail!("{name}: {} states against {}", a.len(), b.len());
    }
    let parts: [(&str, StatePart); 4] = [
        ("  … memories", |s| &s.chunk_start),
        ("  … pending keys", |s| &s.pending_k),
        ("  … pending values", |s| &s.pending_u),
        ("  … pending decays", |s| &s.pending_gamma),
    ];
    for (label, part) in parts {
        r.identical(label, &stack(a, part)?, &stack(b, part)?)?;
    }
    let (pa, pb): (Vec<usize>, Vec<usize>) = (
        a.iter().map(|s| s.pending).collect(),
        b.iter().map(|s| s.pending).collect(),
    );
    let ok = pa == pb;
    r.check(
        "  … pending rows",
        "",
        ok,
        json!({"check": format!("{name}: pending rows"), "ok": ok}),
    );
    Ok(())
}

/// Segments of the given lengths tiling the rows in order, with the given parents.
fn tile(spec: &[(usize, Option<usize>)]) -> Vec<RuleSegment> {
    let mut start = 0;
    spec.iter()
        .map(|&(len, parent)| {
            let seg = RuleSegment {
                start,
                len,
                parent,
                snapshot: None,
            };
            start += len;
            seg
        })
        .collect()
}

fn bitwise_and_accuracy_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (h, hk, dk, dv) = (6usize, 2usize, 128usize, 128usize);
    // (tokens, parent): roots 0, 1, 2, 6; 3 and 4 branch from 0, 5 from 3.
    let segments = tile(&[
        (150, None),
        (1, None),
        (90, None),
        (40, Some(0)),
        (64, Some(0)),
        (5, Some(3)),
        (64, None),
    ]);
    let n: usize = segments.iter().map(|s| s.len).sum();
    let mut rng = Rng(0xDE17_A5EE_0B00_0001);
    let cpu_x = batch_inputs(&mut rng, n, h, hk, dk, dv)?;
    let gpu_x = on_device(&cpu_x, gpu)?;
    // Starting states: a random memory, two 37 tokens into a chunk, zero; branches read none.
    let starts = |device: &Device| -> Result<Vec<RuleState>> {
        let zero = RuleState::zeros(h, dk, dv, DType::F32, device)?;
        Ok(vec![
            state_after(11, 0, h, dk, dv, device)?,
            state_after(12, 37, h, dk, dv, device)?,
            state_after(13, 37, h, dk, dv, device)?,
            zero.clone(),
            zero.clone(),
            zero.clone(),
            zero,
        ])
    };
    let (gpu_states, cpu_states) = (starts(gpu)?, starts(&Device::Cpu)?);
    let [q, k, v, g, beta] = &gpu_x;
    let batched = chunked_batch(q, k, v, g, beta, &segments, &gpu_states)?;

    let alone = one_by_one(&gpu_x, &segments, &gpu_states)?;
    same_results(
        r,
        "delta rule batched (7 segments, 2 levels of branches) vs one call each",
        &batched,
        &alone,
    )?;
    // v as the model passes it: a head range of the conv output's rows, read through the row stride.
    let (vn, vh, vd) = v.dims3()?;
    let wide = Tensor::cat(
        &[
            &Tensor::zeros((vn, 2, vd), DType::F32, gpu)?,
            v,
            &Tensor::ones((vn, 1, vd), DType::F32, gpu)?,
        ],
        1,
    )?;
    let v_in_place = wide.narrow(1, 2, vh)?;
    let strided = chunked_batch(q, k, &v_in_place, g, beta, &segments, &gpu_states)?;
    same_results(
        r,
        "delta rule batched: v read through a row stride (head range of wider rows) vs contiguous",
        &batched,
        &strided,
    )?;
    let t = tiled(&gpu_x)?;
    let expanded = chunked_batch(&t[0], &t[1], &t[2], &t[3], &t[4], &segments, &gpu_states)?;
    same_results(
        r,
        "delta rule batched: 2 key heads read in place vs tiled to 6",
        &batched,
        &expanded,
    )?;

    let [q, k, v, g, beta] = &cpu_x;
    let (want, want_states) = chunked_batch(q, k, v, g, beta, &segments, &cpu_states)?;
    r.compare(
        "delta rule batched vs CPU twin: outputs of 7 segments",
        &batched.0,
        &want,
        CPU_BOUND,
    )?;
    let memories = |states: &[RuleState]| -> Result<Tensor> {
        let m: Vec<Tensor> = states
            .iter()
            .map(|s| s.memory())
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::stack(&m, 0)?)
    };
    r.compare(
        "delta rule batched vs CPU twin: memories after each segment",
        &memories(&batched.1)?,
        &memories(&want_states)?,
        CPU_BOUND,
    )?;
    Ok(())
}

/// The decode kernels (one-token segments inside their chunk) against the pair and scan kernels, bit
/// for bit: 70 one-token sequences from states at every pending count 0..=63 (the 63s close their
/// chunk and take the general path), two of them branching from others; at dk = dv = 128 (clusters of
/// four column slices on Hopper) and 64 (clusters of two), each with [`DecodeKernel::Auto`] and
/// [`DecodeKernel::Portable`].
fn decode_kernel_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    for (dk, dv) in [(128usize, 128usize), (64, 64)] {
        for kernel in [DecodeKernel::Auto, DecodeKernel::Portable] {
            decode_kernel_case(r, gpu, dk, dv, kernel)?;
        }
    }
    Ok(())
}

fn decode_kernel_case(
    r: &mut Report,
    gpu: &Device,
    dk: usize,
    dv: usize,
    kernel: DecodeKernel,
) -> Result<()> {
    let (h, hk) = (6usize, 2usize);
    let mut rng = Rng(0xDE17_A5EE_0B00_0003);
    let mut spec: Vec<(usize, Option<usize>)> = vec![(1, None); 68];
    spec.push((1, Some(3)));
    spec.push((1, Some(68)));
    let segments = tile(&spec);
    let states = (0..70)
        .map(|i| state_after(300 + i as u64, i % 64, h, dk, dv, gpu))
        .collect::<Result<Vec<_>>>()?;
    let x = on_device(&batch_inputs(&mut rng, 70, h, hk, dk, dv)?, gpu)?;
    let [q, k, v, g, beta] = &x;
    let what = format!("delta rule decode kernel {kernel:?}, dk = {dk}, dv = {dv}");
    let decode = || -> Result<(Tensor, Vec<RuleState>)> {
        let (out, states, _) =
            delta_rule_batch_with(q, k, v, g, beta, &segments, &states, Some(kernel))?;
        Ok((out, states))
    };
    // The decode kernel writes a step's pending row in place when its state's claim on that row is
    // free: this first call finds every claim free (the branches continue their parent's new state in
    // place too). A state's rows past its pending count are read by nobody (a continuation in place
    // writes them), so the comparisons with the pair and scan kernels mask them.
    let decoded = decode()?;
    let continued_in_place = same_storage(&decoded.1[3].pending_k, &states[3].pending_k)?;
    r.check(
        &format!("{what}: the state continued in place shares its buffers"),
        "",
        continued_in_place,
        json!({"check": "decode in place shares the state's buffers", "kernel": format!("{kernel:?}"), "dk": dk, "dv": dv, "ok": continued_in_place}),
    );
    let (general_out, general_states, _) =
        delta_rule_batch_with(q, k, v, g, beta, &segments, &states, None)?;
    let general = (general_out, general_states);
    same_results(
        r,
        &format!("{what}, rows in place: 70 one-token steps (pending 0..=63, branches) vs the pair and scan kernels (rows past pending masked)"),
        &masked(&decoded)?,
        &masked(&general)?,
    )?;
    // From the same states again: every claim is taken, so each step copies its rows into fresh
    // buffers (a branch then continues its parent's fresh state in place, so rows past pending are
    // masked here too).
    let again = decode()?;
    same_results(
        r,
        &format!("{what}, again from the same states (claims taken: copies) vs the pair and scan kernels (rows past pending masked)"),
        &masked(&again)?,
        &masked(&general)?,
    )?;
    let copied = !same_storage(&again.1[3].pending_k, &states[3].pending_k)?;
    r.check(
        "  … a state whose row is claimed is copied",
        "",
        copied,
        json!({"check": "decode with its row claimed copies", "kernel": format!("{kernel:?}"), "dk": dk, "dv": dv, "ok": copied}),
    );
    Ok(())
}

/// Outputs and states with every pending row past each state's count zeroed (on the host).
fn masked(result: &(Tensor, Vec<RuleState>)) -> Result<(Tensor, Vec<RuleState>)> {
    let mask = |t: &Tensor, pending: usize| -> Result<Tensor> {
        let t = t.to_device(&Device::Cpu)?;
        let rows = t.dim(1)?;
        let kept = t.narrow(1, 0, pending)?;
        let mut shape = t.dims().to_vec();
        shape[1] = rows - pending;
        Ok(Tensor::cat(
            &[&kept, &Tensor::zeros(shape, t.dtype(), &Device::Cpu)?],
            1,
        )?)
    };
    let states = result
        .1
        .iter()
        .map(|s| {
            Ok(RuleState {
                pending_k: mask(&s.pending_k, s.pending)?,
                pending_u: mask(&s.pending_u, s.pending)?,
                pending_gamma: mask(&s.pending_gamma, s.pending)?,
                ..s.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((result.0.clone(), states))
}

/// Snapshots inside segments (the engine's evidence state from one pass over evidence and question)
/// against the rows before each point run alone from the segment's starting state, bit for bit (rows
/// past the pending count masked): inside a first chunk, on a chunk boundary after 37 pending rows, in
/// a branch, in a segment's second and third launch (a chunk boundary there), and at the very end of a
/// launch (the launch's own state). The batch's outputs and end states are those of the same batch
/// without snapshots.
fn snapshot_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (h, hk, dk, dv) = (6usize, 2usize, 128usize, 128usize);
    let batches: [&[(usize, Option<usize>, usize)]; 2] = [
        &[
            (150, None, 5),
            (90, None, 27),
            (70, Some(0), 20),
            (2200, None, 2100),
            (2200, None, 2048),
        ],
        &[(2200, None, 2048)],
    ];
    for (b, spec) in batches.iter().enumerate() {
        let plain = tile(&spec.iter().map(|&(n, p, _)| (n, p)).collect::<Vec<_>>());
        let segments: Vec<RuleSegment> = plain
            .iter()
            .zip(spec.iter())
            .map(|(seg, &(_, _, point))| RuleSegment {
                snapshot: Some(point),
                ..*seg
            })
            .collect();
        let n: usize = segments.iter().map(|s| s.len).sum();
        let mut rng = Rng(0xDE17_A5EE_0B00_0005 + b as u64);
        let x = on_device(&batch_inputs(&mut rng, n, h, hk, dk, dv)?, gpu)?;
        let states = (0..segments.len())
            .map(|i| state_after(500 + i as u64, if i == 1 { 37 } else { 0 }, h, dk, dv, gpu))
            .collect::<Result<Vec<_>>>()?;
        let [q, k, v, g, beta] = &x;
        let (out, ends, snapshots) =
            chunked_batch_with_snapshots(q, k, v, g, beta, &segments, &states)?;
        let without = chunked_batch(q, k, v, g, beta, &plain, &states)?;
        same_results(
            r,
            &format!("delta rule snapshots, batch {b}: the batch with snapshots vs without"),
            &masked(&(out, ends.clone()))?,
            &masked(&without)?,
        )?;
        let t = tiled(&x)?;
        let mut got = Vec::with_capacity(segments.len());
        let mut want = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            let point = seg.snapshot.unwrap_or(0);
            let start = match seg.parent {
                Some(p) => ends[p].clone(),
                None => states[i].clone(),
            };
            want.push(chunked_rows(&t, (seg.start, point), gpu, &start)?.1);
            got.push(
                snapshots[i]
                    .clone()
                    .with_context(|| format!("segment {i} has no snapshot"))?,
            );
        }
        let outputs = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
        same_results(
            r,
            &format!(
                "delta rule snapshots, batch {b}: {} snapshots vs their rows alone (the outputs: a placeholder)",
                segments.len()
            ),
            &masked(&(outputs.clone(), got))?,
            &masked(&(outputs, want))?,
        )?;
    }
    Ok(())
}

/// Whether two CUDA tensors start at the same device address.
fn same_storage(a: &Tensor, b: &Tensor) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let ptr = |t: &Tensor| -> Result<u64> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else {
            bail!("not a CUDA tensor");
        };
        let slice = cs.as_cuda_slice::<f32>()?;
        let stream = cs.device.cuda_stream();
        let (p, _guard) = slice.device_ptr(&stream);
        Ok(p + (layout.start_offset() * 4) as u64)
    };
    Ok(ptr(a)? == ptr(b)?)
}

fn launch_limit_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (h, hk, dk, dv) = (6usize, 2usize, 128usize, 128usize);
    let mut rng = Rng(0xDE17_A5EE_0B00_0002);
    // 40 one-token sequences (more than the 32 segments of a launch) from states at pending rows
    // 13·i mod 64 (0, 13, 26, …: 40 different ones).
    let segments = tile(&[(1, None); 40]);
    let states = (0..40)
        .map(|i| state_after(100 + i as u64, (i * 13) % 64, h, dk, dv, gpu))
        .collect::<Result<Vec<_>>>()?;
    let x = on_device(&batch_inputs(&mut rng, 40, h, hk, dk, dv)?, gpu)?;
    let batched = chunked_batch(&x[0], &x[1], &x[2], &x[3], &x[4], &segments, &states)?;
    let alone = one_by_one(&x, &segments, &states)?;
    same_results(
        r,
        "delta rule batched: 40 decode steps (2 launches) vs one call each",
        &batched,
        &alone,
    )?;

    // A 2,200-token prompt (35 chunks, over the 32-chunk budget) among three short sequences, one of
    // them starting mid-chunk and one branching from the long one. (Run and compared like the case
    // above: each case is its segments, states and name, written out whole.)
    let segments = tile(&[(20, None), (2200, None), (70, None), (33, Some(1))]);
    let n: usize = segments.iter().map(|s| s.len).sum();
    let states = vec![
        state_after(200, 50, h, dk, dv, gpu)?,
        state_after(201, 0, h, dk, dv, gpu)?,
        RuleState::zeros(h, dk, dv, DType::F32, gpu)?,
        RuleState::zeros(h, dk, dv, DType::F32, gpu)?,
    ];
    let x = on_device(&batch_inputs(&mut rng, n, h, hk, dk, dv)?, gpu)?;
    let batched = chunked_batch(&x[0], &x[1], &x[2], &x[3], &x[4], &segments, &states)?;
    let alone = one_by_one(&x, &segments, &states)?;
    same_results(
        r,
        "delta rule batched: 2200-token prompt among 3 short vs one call each",
        &batched,
        &alone,
    )?;
    Ok(())
}

/// One layer's delta rule for `segments` at 27B shapes (the batched call on the key heads), and the q/k
/// tiling to the value heads that reading them in place saves.
fn time_scenario(
    r: &mut Report,
    gpu: &Device,
    name: &str,
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<()> {
    const RUNS: usize = 21;
    let (h, hk, dk, dv) = (48usize, 16usize, 128usize, 128usize);
    let n: usize = segments.iter().map(|s| s.len).sum();
    let mut rng = Rng(0xDE17_A5EE_0B00_0003);
    let x = on_device(&batch_inputs(&mut rng, n, h, hk, dk, dv)?, gpu)?;
    let new = 1e6
        * median_seconds(gpu, RUNS, || {
            chunked_batch(&x[0], &x[1], &x[2], &x[3], &x[4], segments, states)?;
            Ok(())
        })?;
    let tiling = 1e6
        * median_seconds(gpu, RUNS, || {
            tiled(&x)?;
            Ok(())
        })?;
    r.note(
        &format!("delta rule 27B layer, {name}: batched kernels (key heads in place), median µs"),
        json!(new),
    );
    r.note(
        "  … the ×3 q/k tiling the batched call no longer needs, median µs",
        json!(tiling),
    );
    Ok(())
}

fn timing_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let (h, dk, dv) = (48usize, 128usize, 128usize);
    let zero = RuleState::zeros(h, dk, dv, DType::F32, gpu)?;
    time_scenario(
        r,
        gpu,
        "one prompt T=275",
        &tile(&[(275, None)]),
        std::slice::from_ref(&zero),
    )?;
    let shared = tile(&[(230, None), (40, Some(0)), (40, Some(0)), (40, Some(0))]);
    time_scenario(
        r,
        gpu,
        "prefix 230 + 3 branches of 40",
        &shared,
        &vec![zero.clone(); 4],
    )?;
    let states = (0..12)
        .map(|i| state_after(300 + i as u64, 100 + 7 * i, h, dk, dv, gpu))
        .collect::<Result<Vec<_>>>()?;
    time_scenario(
        r,
        gpu,
        "decode step of 12 sequences",
        &tile(&[(1, None); 12]),
        &states,
    )?;
    // The decode kernels alone, one sequence and 32 (one launch), as a thought decodes: each step
    // continues the last one's states in place (pending rows 0..=29 at the start, so the 22 steps
    // close no chunk).
    for n in [1usize, 32] {
        let start = (0..n)
            .map(|i| state_after(400 + i as u64, 128 + (7 * i) % 30, h, dk, dv, gpu))
            .collect::<Result<Vec<_>>>()?;
        let segments = tile(&vec![(1, None); n]);
        let mut rng = Rng(0xDE17_A5EE_0B00_0005);
        let x = on_device(&batch_inputs(&mut rng, n, h, 16, dk, dv)?, gpu)?;
        for kernel in [DecodeKernel::Auto, DecodeKernel::Portable] {
            let mut states = start.clone();
            let us = 1e6
                * median_seconds(gpu, 21, || {
                    states = delta_rule_batch_with(
                        &x[0],
                        &x[1],
                        &x[2],
                        &x[3],
                        &x[4],
                        &segments,
                        &states,
                        Some(kernel),
                    )?
                    .1;
                    Ok(())
                })?;
            r.note(
                &format!(
                    "delta rule 27B layer, decode step of {n} sequences, decode kernel {kernel:?}, median µs"
                ),
                json!(us),
            );
        }
    }
    Ok(())
}

/// The batched delta-rule device checks (bitwise, CPU twin, launch limits, timing); see the module doc.
pub fn checks(r: &mut Report, gpu: &Device) -> Result<()> {
    bitwise_and_accuracy_checks(r, gpu)?;
    decode_kernel_checks(r, gpu)?;
    snapshot_checks(r, gpu)?;
    launch_limit_checks(r, gpu)?;
    timing_checks(r, gpu)
}
