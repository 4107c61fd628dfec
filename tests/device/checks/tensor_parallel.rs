//! Tensor parallelism on the GPU (issue #25): the fixture model at int8 and w4a8 split over two devices
//! that are threads sharing one GPU — each device's row-parallel products the integer kernels' `_share`
//! entries, the shares exchanged by `ThreadAllReduce` — and over two candle CUDA devices of the same GPU
//! (the shares moved between devices by candle's device-to-device copy), against the
//! unsplit model on the same GPU: every hidden state and logit bit for bit over prefill, a branch off a
//! shared prefix, decode steps and the DeltaNet chunk boundary (64 tokens).

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use prism_model::tensor_parallel::{TensorParallelModel, TensorParallelState};
use prism_model::{BatchItem, Decoder, LoadOptions, Precision, Qwen35Model, SequenceState};

use crate::harness::Report;
use crate::model::fixture_prompts;

/// One step: each sequence's new tokens and the item it branches from.
struct Step {
    tokens: Vec<Vec<u32>>,
    parents: Vec<Option<usize>>,
}

fn steps(p: &[Vec<u32>]) -> Result<Vec<Step>> {
    let (a, b, c) = (&p[0], &p[1], &p[2]);
    if a.len() < 70 || b.len() < 31 || c.len() < 12 {
        anyhow::bail!("the fixture prompts are shorter than the scenario needs");
    }
    Ok(vec![
        Step {
            tokens: vec![a[..60].to_vec(), b[..23].to_vec(), c[..9].to_vec()],
            parents: vec![None, None, Some(0)],
        },
        Step {
            tokens: vec![a[60..63].to_vec(), vec![b[23]], vec![c[9]]],
            parents: vec![None, None, None],
        },
        Step {
            tokens: vec![a[63..66].to_vec(), b[24..30].to_vec(), vec![c[10]]],
            parents: vec![None, None, None],
        },
        Step {
            tokens: vec![vec![a[66]], vec![b[30]], vec![c[11]]],
            parents: vec![None, None, None],
        },
    ])
}

/// `step` through `decoder` (the unsplit model or the split one): the last hidden states.
fn run_step<D: Decoder>(decoder: &D, states: &mut [D::State], step: &Step) -> Result<Tensor> {
    let mut items: Vec<BatchItem<'_, D::State>> = states
        .iter_mut()
        .zip(&step.tokens)
        .zip(&step.parents)
        .map(|((state, tokens), parent)| BatchItem {
            parent: *parent,
            ..BatchItem::new(state, tokens)
        })
        .collect();
    Ok(decoder.forward(&mut items)?.last_hidden()?)
}

/// `tp` against `model` over the scenario: each step's last hidden states and their logits.
fn compare(
    r: &mut Report,
    label: &str,
    model: &Qwen35Model,
    tp: &TensorParallelModel,
    scenario: &[Step],
) -> Result<()> {
    let mut alone: Vec<SequenceState> = (0..3)
        .map(|_| model.new_state())
        .collect::<prism_model::Result<_>>()?;
    let mut parallel: Vec<TensorParallelState> = (0..3)
        .map(|_| tp.new_state())
        .collect::<prism_model::Result<_>>()?;
    for (i, step) in scenario.iter().enumerate() {
        let want = run_step(model, &mut alone, step)?;
        let got = run_step(tp, &mut parallel, step)?;
        r.identical(
            &format!("{label}, step {i}: last hidden states vs the unsplit model"),
            &got,
            &want,
        )?;
        r.identical(
            &format!("{label}, step {i}: logits vs the unsplit model"),
            &model.logits(&got.to_device(model.device())?)?,
            &model.logits(&want)?,
        )?;
    }
    Ok(())
}

pub fn checks(r: &mut Report, gpu: &Device, fixtures: &Path) -> Result<()> {
    let scenario = steps(&fixture_prompts(fixtures)?)?;
    // A second candle device on the same GPU: the shares of `over` then live on two devices.
    let other = prism_quant::cuda_launch::open_device(0).context("a second CUDA device")?;
    for (file, precision) in [
        ("tiny-Q8_0.gguf", Precision::Int8),
        ("tiny-Q4_K_M.gguf", Precision::W4a8),
    ] {
        let gguf = prism_gguf::GgufFile::open(fixtures.join(file))
            .with_context(|| format!("opening {file}"))?;
        let options = |device: &Device| LoadOptions {
            device: device.clone(),
            precision,
            ..LoadOptions::default()
        };
        let model = Qwen35Model::from_gguf(&gguf, &options(gpu))?;
        let label = precision.as_str();
        let tp = TensorParallelModel::new(&model, 2)?;
        compare(
            r,
            &format!("{label} ({file}) split over 2 devices sharing the GPU"),
            &model,
            &tp,
            &scenario,
        )?;
        let copy = Qwen35Model::from_gguf(&gguf, &options(&other))?;
        let tp = TensorParallelModel::over(&[&model, &copy])?;
        compare(
            r,
            &format!("{label} ({file}) split over 2 CUDA devices (one GPU, shares copied between devices)"),
            &model,
            &tp,
            &scenario,
        )?;
    }
    Ok(())
}
