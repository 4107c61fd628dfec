//! Tensor parallelism: one model's heads and MLP split over 1, 2 or 4 devices, bit for bit one
//! device's answers on the integer path (issue #25).
//!
//! The split (Megatron's, on the integer contract's part boundaries):
//! - **Attention:** device `g` of `T` holds query heads `g·n_h/T ..` and their KV heads (the
//!   `[query | gate]` rows of `attn_q`, the rows of `attn_k`, `attn_v`), its heads' K/V cache, and the
//!   input columns of `attn_output` that its heads produce.
//! - **DeltaNet:** device `g` holds value heads `g·n_v/T ..` (their `v`, `z`, β, α rows, conv channels,
//!   `ssm_a`, `dt_bias`, recurrent state and `ssm_out` columns) and the query / key heads they read. In
//!   GGUF order value head `h` reads key head `h mod n_k`; where the device's value heads are a whole
//!   number of `n_k`, it holds every key head in order, otherwise one key head per value head (a key
//!   head read by two of its value heads is computed twice: each output depends only on its own weight
//!   row, so the copies have the same bits).
//! - **MLP:** device `g` holds the `g`-th `T`-th of the intermediate channels: its rows of `ffn_gate`
//!   and `ffn_up`, its input columns of `ffn_down`.
//! - Everything else (embedding, norms, the residual stream, the output head) is the same on every
//!   device.
//!
//! The three row-parallel products (`attn_output`, `ssm_out`, `ffn_down`) are split over their inputs,
//! which is exact only where each device's columns are whole parts of the contract's reduction
//! ([`prism_quant::part_bounds`]: four parts of the runs of 128): then a device computes its parts as
//! one device would and [`add_up_the_tree`] adds the shares as the single-device tree adds the parts
//! ([`crate::linear::Linear::Share`]). [`shard`] checks that every split lands on part boundaries and
//! refuses a device count or a model whose heads do not (the 27B's and the tiny fixture's do for 2
//! devices; the 27B's for 4). Float weights are refused: their sums have no fixed tree to split.
//!
//! This module runs the devices as threads of one process on the CPU ([`TensorParallelModel`],
//! [`ThreadAllReduce`]): the reference the GPU split (one device per GPU, the shares exchanged by
//! NCCL's all-gather and added in this order on each GPU) must equal. A share's product runs on the
//! CPU or on a GPU (`prism_quant::cuda::matmul_share`, the same bits).

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use candle_core::Tensor;
use prism_quant::{run_count, PartSpan, RUN};

use crate::error::{ModelError, Result};
use crate::qwen35::{BatchItem, BatchOutput, Qwen35Model};
use crate::state::SequenceState;

/// Adds the devices' shares of a split product and gives every device the sum.
pub trait AllReduce: Send + Sync {
    /// Device `device`'s share in, every device's shares added by [`add_up_the_tree`] out (the same
    /// tensor for every device). Blocks until every device of the group has given its share.
    fn all_reduce(&self, device: usize, share: Tensor) -> candle_core::Result<Tensor>;
}

/// The shares of 1, 2 or 4 devices added as the integer contract's tree adds its parts: `s0`,
/// `s0 + s1`, `(s0 + s1) + (s2 + s3)` (each device's share is its subtree: see
/// [`prism_quant::kernel::matmul_share`]).
pub fn add_up_the_tree(shares: &[Tensor]) -> candle_core::Result<Tensor> {
    match shares {
        [s] => Ok(s.clone()),
        [a, b] => a + b,
        [a, b, c, d] => (a + b)? + (c + d)?,
        _ => candle_core::bail!(
            "tensor parallelism adds the shares of 1, 2 or 4 devices, not {}",
            shares.len()
        ),
    }
}

/// [`AllReduce`] among threads of one process, one per device.
#[derive(Debug)]
pub struct ThreadAllReduce {
    devices: usize,
    round: Mutex<Round>,
    done: Condvar,
}

#[derive(Debug)]
struct Round {
    shares: Vec<Option<Tensor>>,
    arrived: usize,
    /// Rounds completed; a waiter's round is done when this moves past it.
    generation: u64,
    /// The last completed round's sum (kept until the next round completes, which needs every
    /// device, so every waiter has read it by then).
    sum: Option<Tensor>,
    /// Set when a device gave up (its forward failed): every waiter and later call fails.
    aborted: Option<String>,
}

impl ThreadAllReduce {
    pub fn new(devices: usize) -> Self {
        Self {
            devices,
            round: Mutex::new(Round {
                shares: vec![None; devices],
                arrived: 0,
                generation: 0,
                sum: None,
                aborted: None,
            }),
            done: Condvar::new(),
        }
    }

    /// Fails every device waiting now or later (until [`Self::reset`]): a device whose forward failed
    /// calls it so the others do not wait for its share forever.
    pub fn abort(&self, why: &str) {
        let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
        round.aborted.get_or_insert_with(|| why.to_string());
        self.done.notify_all();
    }

    /// A fresh group (before a forward pass, after an aborted one).
    pub fn reset(&self) {
        let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
        round.shares = vec![None; self.devices];
        round.arrived = 0;
        round.sum = None;
        round.aborted = None;
    }
}

impl AllReduce for ThreadAllReduce {
    /// The devices may be one device (threads sharing it) or several: the sum is formed on the device
    /// of the last share to arrive, from every share moved there, and each device gets its own copy.
    /// On a GPU each thread launches on its own stream (candle's per-thread default stream), so a
    /// share's stream is waited for before another thread reads it, the sum's before it is handed
    /// out, and each device's copy is made on its own stream (the round's sum may be freed by
    /// another thread). Between two devices a share moves by candle's `to_device` (a device-to-device
    /// copy on the receiving thread's stream); NCCL is not used yet.
    fn all_reduce(&self, device: usize, share: Tensor) -> candle_core::Result<Tensor> {
        let own = share.device().clone();
        own.synchronize()?;
        let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &round.aborted {
            candle_core::bail!("tensor parallel group aborted: {why}");
        }
        if device >= self.devices || round.shares[device].is_some() {
            candle_core::bail!("tensor parallel group: device {device} gave its share twice or is not in the group");
        }
        round.shares[device] = Some(share);
        round.arrived += 1;
        let mine = round.generation;
        if round.arrived == self.devices {
            let shares: Vec<Tensor> = round.shares.iter_mut().filter_map(Option::take).collect();
            round.arrived = 0;
            let sum = shares
                .iter()
                .map(|s| s.to_device(&own))
                .collect::<candle_core::Result<Vec<_>>>()
                .and_then(|moved| add_up_the_tree(&moved))
                .and_then(|sum| own.synchronize().map(|()| sum));
            match sum {
                Ok(sum) => round.sum = Some(sum),
                Err(e) => round.aborted = Some(e.to_string()),
            }
            round.generation += 1;
            self.done.notify_all();
        } else {
            while round.generation == mine && round.aborted.is_none() {
                round = self.done.wait(round).unwrap_or_else(|e| e.into_inner());
            }
        }
        if let Some(why) = &round.aborted {
            candle_core::bail!("tensor parallel group aborted: {why}");
        }
        let sum = round
            .sum
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("tensor parallel group: no sum".into()))?;
        drop(round);
        if !sum.device().same_device(&own) {
            sum.to_device(&own)
        } else if own.is_cuda() {
            sum.copy()
        } else {
            Ok(sum)
        }
    }
}

/// Makes `device`'s CUDA context current on this thread (a thread of a tensor-parallel group runs a
/// device's forward; nothing to do on the CPU).
fn bind(device: &candle_core::Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        dev.cuda_stream().context().bind_to_thread().map_err(|e| {
            candle_core::Error::Msg(format!("cannot make the CUDA context current: {e:?}"))
        })?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// Device `device` of `devices`' slice `lo..hi` of `n` things (heads, channels).
pub(crate) fn device_range(n: usize, device: usize, devices: usize) -> Range<usize> {
    n * device / devices..n * (device + 1) / devices
}

/// Checks that device `device`'s input columns `cols` of the row-parallel product `what` (over `k`
/// inputs) are exactly its parts of the contract's reduction.
pub(crate) fn check_share_columns(
    what: &str,
    k: usize,
    cols: &Range<usize>,
    device: usize,
    devices: usize,
) -> Result<()> {
    let span =
        PartSpan::of_device(run_count(k), device, devices).map_err(|source| ModelError::Quant {
            name: what.to_string(),
            source,
        })?;
    let runs = span.runs();
    let parts = runs.start * RUN..(runs.end * RUN).min(k);
    if parts != *cols {
        return Err(ModelError::InvalidInput(format!(
            "tensor parallelism over {devices} devices: {what} ({k} inputs) would give device {device} \
             inputs {cols:?}, but its parts of the integer reduction are inputs {parts:?}; this model's \
             heads cannot be split over {devices} devices bit-exactly"
        )));
    }
    Ok(())
}

/// Device `device` of `devices` (1, 2 or 4): the model with its share of every layer (see the module
/// docs), the row-parallel products reduced by `reduce`. Refuses a split that is not exact.
pub fn shard(
    model: &Qwen35Model,
    device: usize,
    devices: usize,
    reduce: Arc<dyn AllReduce>,
) -> Result<Qwen35Model> {
    let cfg = model.config();
    if !matches!(devices, 1 | 2 | 4) || device >= devices {
        return Err(ModelError::InvalidInput(format!(
            "tensor parallelism runs on 1, 2 or 4 devices (device {device} of {devices})"
        )));
    }
    for (what, n) in [
        ("attention heads", cfg.n_heads),
        ("KV heads", cfg.n_kv_heads),
        ("DeltaNet value heads", cfg.linear_value_heads),
        ("MLP channels", cfg.intermediate_size),
    ] {
        if n % devices != 0 {
            return Err(ModelError::InvalidInput(format!(
                "tensor parallelism over {devices} devices: the model's {n} {what} do not split evenly"
            )));
        }
    }
    model.shard(device, devices, reduce)
}

/// A sequence's state on every device of a [`TensorParallelModel`] (each holds its heads' part).
#[derive(Debug, Clone)]
pub struct TensorParallelState(pub Vec<SequenceState>);

/// One sequence of a [`TensorParallelModel::forward`] batch: a [`BatchItem`] whose state is on every
/// device (its embeddings, when given, are embedded by every device whole).
pub type TensorParallelItem<'a> = BatchItem<'a, TensorParallelState>;

/// The result of a [`TensorParallelModel::forward`]: device 0's hidden states (every device's are the
/// same bits) and each snapshot on every device.
pub type TensorParallelOutput = BatchOutput<TensorParallelState>;

/// A model split over devices that are threads of this process ([`shard`] of each, one
/// [`ThreadAllReduce`]): the CPU reference of tensor parallelism, and on GPUs its functional form
/// (shards on one GPU, or each on its own, the shares exchanged through [`ThreadAllReduce`]; NCCL is
/// not used yet).
pub struct TensorParallelModel {
    devices: Vec<Qwen35Model>,
    /// The unsplit model's configuration (each device's counts its own heads).
    whole: crate::config::Qwen35Config,
    reduce: Arc<ThreadAllReduce>,
    /// One forward pass at a time (the group's rounds are the pass's).
    pass: Mutex<()>,
}

impl TensorParallelModel {
    /// `model` split over `devices` (1, 2 or 4), every share on the model's device.
    pub fn new(model: &Qwen35Model, devices: usize) -> Result<Self> {
        Self::over(&vec![model; devices])
    }

    /// One model split over `models.len()` devices (1, 2 or 4), device `g`'s share cut from
    /// `models[g]`: the same model loaded on each device where the shares should live (a GPU each,
    /// or one device several times).
    pub fn over(models: &[&Qwen35Model]) -> Result<Self> {
        let devices = models.len();
        let reduce = Arc::new(ThreadAllReduce::new(devices));
        if let Some(first) = models.first() {
            if models.iter().any(|m| m.config() != first.config()) {
                return Err(ModelError::InvalidInput(
                    "tensor parallelism: the models given for the devices are not the same model"
                        .into(),
                ));
            }
        }
        let shards = models
            .iter()
            .enumerate()
            .map(|(g, model)| shard(model, g, devices, reduce.clone()))
            .collect::<Result<Vec<_>>>()?;
        // The shards' tensors were made on this thread's stream; the devices' threads read them.
        for model in &shards {
            model.device().synchronize()?;
        }
        let whole = models
            .first()
            .map(|m| m.config().clone())
            .ok_or_else(|| ModelError::InvalidInput("tensor parallelism over no devices".into()))?;
        Ok(Self {
            devices: shards,
            whole,
            reduce,
            pass: Mutex::new(()),
        })
    }

    /// Each device's model.
    pub fn devices(&self) -> &[Qwen35Model] {
        &self.devices
    }

    /// Device 0's model (its output head and embedding are the whole model's).
    pub fn first(&self) -> &Qwen35Model {
        &self.devices[0]
    }

    /// The unsplit model's configuration.
    pub fn whole_config(&self) -> &crate::config::Qwen35Config {
        &self.whole
    }

    pub fn new_state(&self) -> Result<TensorParallelState> {
        Ok(TensorParallelState(
            self.devices
                .iter()
                .map(Qwen35Model::new_state)
                .collect::<Result<_>>()?,
        ))
    }

    /// [`Qwen35Model::forward`] on every device at once; returns device 0's hidden states (every
    /// device's are the same bits) and each snapshot on every device. On error no state is modified.
    pub fn forward(&self, items: &mut [TensorParallelItem<'_>]) -> Result<TensorParallelOutput> {
        let _pass = self.pass.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.devices.len();
        if items.iter().any(|item| item.state.0.len() != n) {
            return Err(ModelError::InvalidInput(format!(
                "a tensor-parallel state must hold one state per device ({n})"
            )));
        }
        // Each device works on copies of its states, written back only when every device succeeded.
        let mut states: Vec<Vec<SequenceState>> = (0..n)
            .map(|g| items.iter().map(|item| item.state.0[g].clone()).collect())
            .collect();
        self.reduce.reset();
        let outputs: Vec<Result<BatchOutput>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .devices
                .iter()
                .zip(states.iter_mut())
                .map(|(model, device_states)| {
                    let items = &*items;
                    let reduce = &self.reduce;
                    scope.spawn(move || {
                        if let Err(e) = bind(model.device()) {
                            reduce.abort(&e.to_string());
                            return Err(e);
                        }
                        let mut batch: Vec<BatchItem<'_>> = device_states
                            .iter_mut()
                            .zip(items)
                            .map(|(state, item)| BatchItem {
                                state,
                                tokens: item.tokens,
                                positions: item.positions,
                                parent: item.parent,
                                keep_state: item.keep_state,
                                embeddings: item.embeddings,
                                snapshot: item.snapshot,
                            })
                            .collect();
                        // The thread's stream ends with it: its work is waited for before the
                        // states and outputs go back to the caller's thread.
                        let out = model.forward(&mut batch).and_then(|out| {
                            model
                                .device()
                                .synchronize()
                                .map(|()| out)
                                .map_err(Into::into)
                        });
                        if let Err(e) = &out {
                            reduce.abort(&e.to_string());
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ModelError::Candle(candle_core::Error::Msg(
                            "a tensor-parallel device panicked".into(),
                        )))
                    })
                })
                .collect()
        });
        let outputs = outputs.into_iter().collect::<Result<Vec<_>>>()?;
        for (g, device_states) in states.into_iter().enumerate() {
            for (item, state) in items.iter_mut().zip(device_states) {
                item.state.0[g] = state;
            }
        }
        // Each item's snapshot from every device (an item has one on all devices or on none).
        let mut snapshots: Vec<Option<TensorParallelState>> = vec![None; items.len()];
        for out in &outputs {
            for (slot, snapshot) in snapshots.iter_mut().zip(&out.snapshots) {
                if let Some(state) = snapshot {
                    slot.get_or_insert_with(|| TensorParallelState(Vec::with_capacity(n)))
                        .0
                        .push(state.clone());
                }
            }
        }
        let first = outputs
            .into_iter()
            .next()
            .ok_or_else(|| ModelError::InvalidInput("no devices".into()))?;
        Ok(TensorParallelOutput {
            hidden: first.hidden,
            segments: first.segments,
            snapshots,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_27b_heads_split_on_part_boundaries_over_2_and_4_devices() {
        // Qwen3.5-27B: 24 query heads of 256 (attn_output 6,144 inputs), 48 DeltaNet value heads of
        // 128 over 16 key heads (ssm_out 6,144 inputs), 17,408 MLP channels.
        for devices in [2, 4] {
            for g in 0..devices {
                for (what, heads, width) in [
                    ("attn_output", 24, 256),
                    ("ssm_out", 48, 128),
                    ("ffn_down", 17_408, 1),
                ] {
                    let mine = device_range(heads, g, devices);
                    let cols = mine.start * width..mine.end * width;
                    check_share_columns(what, heads * width, &cols, g, devices).unwrap();
                }
            }
        }
        // 24 value heads a device are not a whole number of the 16 key heads: one key head each, value
        // head h reading h mod 16; 12 a device likewise.
        let keys = crate::delta_net::device_key_heads(16, 48, 1, 2);
        assert_eq!(keys, (24..48).map(|h| h % 16).collect::<Vec<_>>());
        assert_eq!(crate::delta_net::device_key_heads(16, 48, 3, 4).len(), 12);
        // 32 value heads a device over 16 key heads: every key head once, in order.
        assert_eq!(
            crate::delta_net::device_key_heads(16, 64, 1, 2),
            (0..16).collect::<Vec<_>>()
        );
        // A split off the part boundaries is refused: 6 heads of 256 over 4 devices would give device
        // 1 heads 1..3 (runs 2..6), but its part is runs 3..6.
        assert!(check_share_columns("x", 6 * 256, &(256..768), 1, 4).is_err());
    }

    #[test]
    fn shares_add_up_the_tree_in_order() {
        let t = |v: f32| Tensor::new(&[v], &candle_core::Device::Cpu).unwrap();
        // (1e8 + -1e8) + (1 + 1) = 2, but (1e8 + 1) + (-1e8 + 1) = 0 in f32 (1e8 ± 1 rounds to
        // ±1e8): the shares are added in the tree's pairs, in device order.
        let sum = add_up_the_tree(&[t(1e8), t(-1e8), t(1.0), t(1.0)]).unwrap();
        assert_eq!(sum.to_vec1::<f32>().unwrap(), vec![2.0]);
        let sum = add_up_the_tree(&[t(1e8), t(1.0), t(-1e8), t(1.0)]).unwrap();
        assert_eq!(sum.to_vec1::<f32>().unwrap(), vec![0.0]);
        assert!(add_up_the_tree(&[t(1.0), t(2.0), t(3.0)]).is_err());
    }
}
