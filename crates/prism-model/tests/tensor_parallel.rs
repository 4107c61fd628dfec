//! Tensor parallelism on the CPU (issue #25): the tiny int8 model split over two devices (threads of
//! this process) computes every hidden state and logit with one device's bits — prefill, a branch off a
//! shared prefix, decode steps and a DeltaNet chunk boundary — and splits that cannot be exact are
//! refused with the reason.

mod common;
mod quantized;

use common::{bits, prompts, q8_model};
use prism_model::tensor_parallel::{TensorParallelItem, TensorParallelModel, TensorParallelState};
use prism_model::Precision;
use prism_model::{BatchItem, BatchOutput, Decoder, Qwen35Model, SequenceState};
use prism_quant::Q8Scales;
use quantized::{int8_model, w4a8_model};

/// One step of the scenario: for each sequence, its new tokens and the item it branches from.
struct Step {
    tokens: Vec<Vec<u32>>,
    parents: Vec<Option<usize>>,
}

/// `step` through `decoder` (one device's model or the split one): each sequence's new tokens as an
/// item continuing its state (or branching from its parent item).
fn run_step<D: Decoder>(
    decoder: &D,
    states: &mut [D::State],
    step: &Step,
) -> BatchOutput<D::State> {
    let mut items: Vec<BatchItem<'_, D::State>> = states
        .iter_mut()
        .zip(&step.tokens)
        .zip(&step.parents)
        .map(|((state, tokens), parent)| BatchItem {
            parent: *parent,
            ..BatchItem::new(state, tokens)
        })
        .collect();
    decoder.forward(&mut items).unwrap()
}

#[test]
fn two_devices_compute_one_devices_bits() {
    let model = int8_model();
    let tp = TensorParallelModel::new(model, 2).unwrap();
    assert_eq!(tp.devices().len(), 2);
    let p = prompts();
    // Three sequences: two prompts and a branch off the first; then decode steps, one crossing the
    // DeltaNet chunk boundary (64 tokens) of the first sequence.
    let steps = [
        Step {
            tokens: vec![p[0][..60].to_vec(), p[1][..23].to_vec(), p[2][..9].to_vec()],
            parents: vec![None, None, Some(0)],
        },
        Step {
            tokens: vec![p[0][60..63].to_vec(), vec![p[1][23]], vec![p[2][9]]],
            parents: vec![None, None, None],
        },
        Step {
            tokens: vec![p[0][63..66].to_vec(), p[1][24..30].to_vec(), vec![p[2][10]]],
            parents: vec![None, None, None],
        },
    ];
    let mut alone: Vec<SequenceState> = (0..3).map(|_| model.new_state().unwrap()).collect();
    let mut parallel: Vec<TensorParallelState> = (0..3).map(|_| tp.new_state().unwrap()).collect();
    for (i, step) in steps.iter().enumerate() {
        let want = run_step(model, &mut alone, step);
        let got = run_step(&tp, &mut parallel, step);
        assert_eq!(got.segments, want.segments, "step {i}");
        assert_eq!(
            bits(&got.hidden),
            bits(&want.hidden),
            "step {i}: hidden states"
        );
        let logits = |m: &Qwen35Model, hidden: candle_core::Tensor| m.logits(&hidden).unwrap();
        assert_eq!(
            bits(&logits(&tp.devices()[0], got.last_hidden().unwrap())),
            bits(&logits(model, want.last_hidden().unwrap())),
            "step {i}: logits"
        );
    }
    // Every device holds its half of the heads.
    let cfg = tp.devices()[1].config();
    assert_eq!((cfg.n_heads, cfg.n_kv_heads), (2, 1));
    assert_eq!(cfg.linear_value_heads, 2);
    assert_eq!(cfg.intermediate_size, model.config().intermediate_size / 2);
}

#[test]
fn shares_cut_from_a_copy_of_the_model_on_each_device_compute_one_devices_bits() {
    // `TensorParallelModel::over`: device g's share cut from its own copy of the model (on GPUs, the
    // model loaded on each GPU); here two loads of the same file, and the bits of one device.
    let model = int8_model();
    let copy = quantized::load("tiny-Q8_0.gguf", Precision::Int8, Q8Scales::PerRun);
    let tp = TensorParallelModel::over(&[model, &copy]).unwrap();
    let p = prompts();
    let steps = [
        Step {
            tokens: vec![p[0][..40].to_vec(), p[1][..12].to_vec()],
            parents: vec![None, None],
        },
        Step {
            tokens: vec![vec![p[0][40]], vec![p[1][12]]],
            parents: vec![None, None],
        },
    ];
    let mut alone: Vec<SequenceState> = (0..2).map(|_| model.new_state().unwrap()).collect();
    let mut parallel: Vec<TensorParallelState> = (0..2).map(|_| tp.new_state().unwrap()).collect();
    for (i, step) in steps.iter().enumerate() {
        let want = run_step(model, &mut alone, step);
        let got = run_step(&tp, &mut parallel, step);
        assert_eq!(
            bits(&got.last_hidden().unwrap()),
            bits(&want.last_hidden().unwrap()),
            "step {i}"
        );
    }
    // Models of different shapes, or three devices, are refused.
    let other = uneven_key_heads_model();
    let err = match TensorParallelModel::over(&[model, &other]) {
        Ok(_) => panic!("two different models were accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("not the same model"), "{err}");
    assert!(TensorParallelModel::over(&[model, model, model]).is_err());
}

#[test]
fn a_failed_pass_on_one_device_leaves_every_state_as_it_was() {
    let model = int8_model();
    let tp = TensorParallelModel::new(model, 2).unwrap();
    let mut state = tp.new_state().unwrap();
    let tokens = prompts()[0][..5].to_vec();
    let mut items = [TensorParallelItem::new(&mut state, &tokens)];
    tp.forward(&mut items).unwrap();
    // A token outside the vocabulary fails on every device before any product.
    let bad = vec![u32::MAX];
    let mut items = [TensorParallelItem::new(&mut state, &bad)];
    assert!(tp.forward(&mut items).is_err());
    // The group works again, and the state is the one before the failed pass.
    let next = prompts()[0][5..8].to_vec();
    let mut items = [TensorParallelItem::new(&mut state, &next)];
    let got = tp.forward(&mut items).unwrap();
    let mut alone = model.new_state().unwrap();
    let all = prompts()[0][..8].to_vec();
    let want = run_step(
        model,
        std::slice::from_mut(&mut alone),
        &Step {
            tokens: vec![all],
            parents: vec![None],
        },
    );
    assert_eq!(
        bits(&got.last_hidden().unwrap()),
        bits(&want.last_hidden().unwrap())
    );
}

#[test]
fn splits_that_cannot_be_exact_are_refused() {
    let err = |r: prism_model::Result<TensorParallelModel>| match r {
        Ok(_) => panic!("the split was accepted"),
        Err(e) => e.to_string(),
    };
    // Two KV heads over four devices.
    let e = err(TensorParallelModel::new(int8_model(), 4));
    assert!(e.contains("KV heads"), "{e}");
    let e = err(TensorParallelModel::new(int8_model(), 3));
    assert!(e.contains("1, 2 or 4"), "{e}");
    // Q4_K_M: attn_output's 256 inputs are one K-quant block, which two devices cannot share.
    let e = err(TensorParallelModel::new(w4a8_model(), 2));
    assert!(e.contains("attn_output") || e.contains("256"), "{e}");
    // Float weights have no fixed reduction tree to split.
    let e = err(TensorParallelModel::new(q8_model(), 2));
    assert!(e.contains("integer path"), "{e}");
}

/// A random model of `file_type` with the tiny widths that `shape` sets, written here with
/// `prism_model::synth` and loaded at `precision`.
fn synthetic_model(
    file_type: prism_model::synth::SynthFileType,
    precision: prism_model::Precision,
    shape: impl FnOnce(&mut prism_model::Qwen35Config),
) -> Qwen35Model {
    use prism_model::synth::{write_gguf, SynthSize, SynthSpec};
    use prism_model::LoadOptions;
    let mut spec = SynthSpec::new(SynthSize::B0_8, file_type, 7)
        .with_layers(4)
        .unwrap();
    spec.config.vocab_size = 512;
    spec.config.hidden_size = 256;
    shape(&mut spec.config);
    spec.tied_embeddings = false;
    let dir = std::env::temp_dir().join(format!(
        "prism-tp-{}-{}",
        std::process::id(),
        file_type.name()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    write_gguf(&path, &spec, Vec::new(), |_| {}).unwrap();
    let options = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    let model = Qwen35Model::load(&path, &options).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

/// A random Q8_0 model whose devices hold fewer DeltaNet value heads than there are key heads' worth
/// (3 of 6 value heads over 2 key heads: one key head per value head on each device, as the 27B's 24
/// of 48 over 16).
fn uneven_key_heads_model() -> Qwen35Model {
    synthetic_model(
        prism_model::synth::SynthFileType::Q8_0,
        prism_model::Precision::Int8,
        |cfg| {
            cfg.intermediate_size = 512;
            (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) = (4, 2, 64);
            (cfg.rotary_dim, cfg.mrope_sections) = (16, [3, 3, 2]);
            (cfg.linear_key_heads, cfg.linear_value_heads) = (2, 6);
            (cfg.linear_key_head_dim, cfg.linear_value_head_dim) = (128, 128);
        },
    )
}

/// Runs `steps` on `model` alone and split over 2 devices; every step's hidden states must be the same
/// bits.
fn assert_split_matches(model: &Qwen35Model, steps: &[Step]) {
    let tp = TensorParallelModel::new(model, 2).unwrap();
    let n = steps[0].tokens.len();
    let mut alone: Vec<SequenceState> = (0..n).map(|_| model.new_state().unwrap()).collect();
    let mut parallel: Vec<TensorParallelState> = (0..n).map(|_| tp.new_state().unwrap()).collect();
    for (i, step) in steps.iter().enumerate() {
        let want = run_step(model, &mut alone, step);
        let got = run_step(&tp, &mut parallel, step);
        assert_eq!(bits(&got.hidden), bits(&want.hidden), "step {i}");
    }
}

/// A prefill of 66 tokens (past the DeltaNet chunk of 64) with a branch off it, then one decode step.
fn prefill_branch_decode() -> Vec<Step> {
    let tokens: Vec<u32> = (0..70).map(|i| (i * 37 % 500) as u32).collect();
    vec![
        Step {
            tokens: vec![tokens[..66].to_vec(), tokens[10..15].to_vec()],
            parents: vec![None, Some(0)],
        },
        Step {
            tokens: vec![vec![tokens[66]], vec![tokens[67]]],
            parents: vec![None, None],
        },
    ]
}

#[test]
fn devices_with_one_key_head_per_value_head_compute_one_devices_bits() {
    let model = uneven_key_heads_model();
    let tp = TensorParallelModel::new(&model, 2).unwrap();
    let cfg = tp.devices()[1].config();
    assert_eq!((cfg.linear_value_heads, cfg.linear_key_heads), (3, 3));
    assert_split_matches(&model, &prefill_branch_decode());
}

#[test]
fn a_w4a8_model_split_on_k_quant_blocks_computes_one_devices_bits() {
    // Q4_K_M (Q4_K with llama-quantize's Q6_K tensors): every device's columns of attn_output (2 heads
    // of 128), ssm_out (2 value heads of 128) and ffn_down (512 channels) are whole 256-blocks.
    let model = synthetic_model(
        prism_model::synth::SynthFileType::Q4KM,
        prism_model::Precision::W4a8,
        |cfg| {
            cfg.intermediate_size = 1024;
            (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) = (4, 2, 128);
            (cfg.rotary_dim, cfg.mrope_sections) = (32, [6, 5, 5]);
            (cfg.linear_key_heads, cfg.linear_value_heads) = (2, 4);
            (cfg.linear_key_head_dim, cfg.linear_value_head_dim) = (128, 128);
        },
    );
    assert_split_matches(&model, &prefill_branch_decode());
}

#[test]
fn a_snapshot_on_every_device_continues_as_one_devices_snapshot() {
    // An evidence's state taken inside a pass (the prefix cache's snapshot) continues with the bits
    // one device's snapshot continues with.
    let model = int8_model();
    let tp = TensorParallelModel::new(model, 2).unwrap();
    let p = &prompts()[4];
    let (evidence, question) = (&p[..70], &p[70..80]);
    let mut alone = model.new_state().unwrap();
    let mut item = BatchItem::new(&mut alone, evidence);
    item.snapshot = Some(50);
    let want = model.forward(&mut [item]).unwrap();
    let mut state = tp.new_state().unwrap();
    let mut item = TensorParallelItem::new(&mut state, evidence);
    item.snapshot = Some(50);
    let got = tp.forward(&mut [item]).unwrap();
    assert_eq!(bits(&got.hidden), bits(&want.hidden));
    let (Some(mut one), Some(mut both)) = (want.snapshots[0].clone(), got.snapshots[0].clone())
    else {
        panic!("no snapshot");
    };
    assert_eq!(both.0.len(), 2);
    let tail = [&evidence[50..], question].concat();
    let want = model
        .forward(&mut [BatchItem::new(&mut one, &tail)])
        .unwrap();
    let got = tp
        .forward(&mut [TensorParallelItem::new(&mut both, &tail)])
        .unwrap();
    assert_eq!(bits(&got.hidden), bits(&want.hidden));
}
