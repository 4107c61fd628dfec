//! [`Decoder`]: what a caller that runs passes needs of a decoder, whether it is one model on one
//! device ([`Qwen35Model`]) or one model split over several ([`TensorParallelModel`]), so the engine
//! runs either without knowing which.

use candle_core::{Device, Tensor};

use crate::config::Qwen35Config;
use crate::error::Result;
use crate::qwen35::{BatchItem, BatchOutput, Qwen35Model};
use crate::state::SequenceState;
use crate::tensor_parallel::{TensorParallelModel, TensorParallelState};
use crate::weights::Precision;

/// A decoder's forward pass over batches of sequences and what goes with it. Implementations give the
/// same bits for the same model (on the integer path a split model's are one device's).
pub trait Decoder: Send + Sync {
    /// A sequence's state (on every device the decoder uses).
    type State: Clone + Send + Sync + 'static;
    /// The state of an empty sequence.
    fn new_state(&self) -> Result<Self::State>;
    /// [`Qwen35Model::forward`].
    fn forward(&self, items: &mut [BatchItem<'_, Self::State>])
        -> Result<BatchOutput<Self::State>>;
    /// [`Qwen35Model::logits`] of hidden states from [`Self::forward`].
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;
    /// [`Qwen35Model::logits_for_rows`]: the logits of vocabulary rows `rows` alone.
    fn logits_for_rows(&self, hidden: &Tensor, rows: &[u32]) -> Result<Tensor>;
    /// The device its hidden states and logits are on.
    fn device(&self) -> &Device;
    fn config(&self) -> &Qwen35Config;
    fn precision(&self) -> Precision;
    fn vocab_size(&self) -> usize;
    /// Device memory a state holds (all devices together), for the prefix cache's budget.
    fn state_bytes(&self, state: &Self::State) -> usize;
}

impl Decoder for Qwen35Model {
    type State = SequenceState;
    fn new_state(&self) -> Result<SequenceState> {
        Qwen35Model::new_state(self)
    }
    fn forward(&self, items: &mut [BatchItem<'_>]) -> Result<BatchOutput> {
        Qwen35Model::forward(self, items)
    }
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Qwen35Model::logits(self, hidden)
    }
    fn logits_for_rows(&self, hidden: &Tensor, rows: &[u32]) -> Result<Tensor> {
        Qwen35Model::logits_for_rows(self, hidden, rows)
    }
    fn device(&self) -> &Device {
        Qwen35Model::device(self)
    }
    fn config(&self) -> &Qwen35Config {
        Qwen35Model::config(self)
    }
    fn precision(&self) -> Precision {
        Qwen35Model::precision(self)
    }
    fn vocab_size(&self) -> usize {
        Qwen35Model::vocab_size(self)
    }
    fn state_bytes(&self, state: &SequenceState) -> usize {
        state.bytes()
    }
}

/// The split model: device 0's hidden states; the output head, whole on every device, runs on
/// device 0.
impl Decoder for TensorParallelModel {
    type State = TensorParallelState;
    fn new_state(&self) -> Result<TensorParallelState> {
        TensorParallelModel::new_state(self)
    }
    fn forward(
        &self,
        items: &mut [BatchItem<'_, TensorParallelState>],
    ) -> Result<BatchOutput<TensorParallelState>> {
        TensorParallelModel::forward(self, items)
    }
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.first().logits(hidden)
    }
    fn logits_for_rows(&self, hidden: &Tensor, rows: &[u32]) -> Result<Tensor> {
        self.first().logits_for_rows(hidden, rows)
    }
    fn device(&self) -> &Device {
        self.first().device()
    }
    fn config(&self) -> &Qwen35Config {
        // The whole model's shape (a shard's config counts its own heads).
        self.whole_config()
    }
    fn precision(&self) -> Precision {
        self.first().precision()
    }
    fn vocab_size(&self) -> usize {
        self.first().vocab_size()
    }
    fn state_bytes(&self, state: &TensorParallelState) -> usize {
        state.0.iter().map(SequenceState::bytes).sum()
    }
}
