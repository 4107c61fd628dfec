//! The Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention) on candle.
//!
//! Entry points: [`Qwen35Model::load`] (GGUF → model), [`Qwen35Model::from_hf_dir`] (Hugging Face
//! safetensors → the same model, for parity work), [`Qwen35Model::new_state`] /
//! [`Qwen35Model::forward`] (batched, varlen, stateful), [`Qwen35Model::logits_for_rows`] (read-out rows
//! only), [`Qwen35Model::last_hidden_shared_prefix`] (shared evidence), [`Qwen35Model::generate_greedy`].
//!
//! On the CPU the forward pass is batch-invariant by construction: every matmul output ([`matmul`]),
//! attention row ([`attention::CausalAttention`]) and delta-rule token ([`delta_rule::chunked`]) is
//! computed by a fixed sequence of operations on that row's own inputs, so a sequence's results are
//! bit-identical whatever it is batched with, wherever it branches from a shared prefix, however its
//! tokens are split into calls (decode included) and however many threads run. On CUDA (feature
//! `cuda`, modules `cuda` and `cuda_flash`) the norms, conv, delta rule and the tensor-core attention
//! (any prompt length, head dims 64/128/256) keep that property and so does the integer matmul
//! (`prism_quant`), so the int8/w4a8 forward pass is batch-invariant on the GPU too; the bf16 path's
//! cuBLAS matmuls are not.

pub mod attention;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_delta;
#[cfg(feature = "cuda")]
pub mod cuda_flash;
#[cfg(feature = "cuda")]
pub mod cuda_kv_fp8;
pub mod decoder;
pub mod delta_net;
pub mod delta_rule;
pub mod error;
pub mod hf;
pub mod kv_fp8;
pub mod linear;
pub mod matmul;
pub mod ops;
pub mod profile;
pub mod qwen35;
pub mod rope;
pub mod stack_dump;
pub mod state;
pub mod synth;
pub mod synth_vision;
pub mod tensor_parallel;
#[cfg(test)]
mod test_util;
pub mod top;
pub mod vision;
pub mod weights;

pub use config::{read_hf_config, LayerKind, Metadata, Qwen35Config};
pub use decoder::Decoder;
pub use error::{ModelError, Result};
pub use hf::{HfCheckpoint, HfError, HfTextConfig};
pub use kv_fp8::KvStorage;
pub use prism_quant::Q8Scales;
pub use qwen35::{
    argmax, shared_prefix_len, BatchItem, BatchOutput, EmbeddingRows, LoadOptions, LoadProgress,
    Qwen35Model, Segment,
};
pub use rope::Position3;
pub use state::SequenceState;
pub use top::{top_candidates, Candidates};
pub use weights::Precision;

/// Memory of `device` in use and in all, in bytes (the driver's count for the whole device, this process's
/// memory pool included); `None` on the CPU.
pub fn device_memory(device: &candle_core::Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        let cuda = device.as_cuda_device().ok()?;
        let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
        Some(((total - free) as u64, total as u64))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}
