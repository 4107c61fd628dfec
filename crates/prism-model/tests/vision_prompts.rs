//! Prompts with images against transformers' `Qwen3_5ForConditionalGeneration` in fp32
//! (`tests/fixtures/qwen35-vl-tiny/ref_prompts.json`): the text GGUF (BF16, run in f32) with the tower's
//! outputs in place of the image pad tokens' embeddings and the 3-axis M-RoPE positions; the
//! last-position logits within 1e-3 and the last position's hidden state after the embedding and every
//! layer. Also: a batch of all prompts gives each prompt's bits, and mismatched embedding rows are
//! refused by type.

mod vision_common;

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use prism_model::vision::image_embedding_rows;
use prism_model::{
    BatchItem, EmbeddingRows, LoadOptions, ModelError, Position3, Precision, Qwen35Model,
};
use serde_json::Value;
use vision_common::*;

const TOLERANCE: f32 = 1e-3;
/// `<|image_pad|>`.
const IMAGE_PAD: u32 = 4108;

fn model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| {
        // Our kernels on the calling thread (libtest runs the tests in parallel already).
        std::env::set_var("RAYON_NUM_THREADS", "1");
        let options = LoadOptions {
            hf_config: Some(dir().join("config.json")),
            precision: Precision::F32,
            ..LoadOptions::default()
        };
        Qwen35Model::load(&dir().join("tiny-vl-BF16.gguf"), &options).unwrap()
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// One reference prompt: tokens, positions (`None` for text only), and the rows and values that
/// replace the pad tokens' embeddings (from the tower run on the prompt's images).
struct Prompt {
    name: String,
    tokens: Vec<u32>,
    positions: Option<Vec<Position3>>,
    embeddings: Option<(Vec<usize>, Tensor)>,
    entry: Value,
}

fn prompts() -> &'static Vec<Prompt> {
    static P: OnceLock<Vec<Prompt>> = OnceLock::new();
    P.get_or_init(|| {
        json("ref_prompts.json")["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| {
                let tokens = ids(&entry["input_ids"]);
                let positions = entry["position_ids"].as_array().map(|axes| {
                    let axes: Vec<Vec<u32>> = axes.iter().map(ids).collect();
                    (0..tokens.len())
                        .map(|i| [axes[0][i], axes[1][i], axes[2][i]])
                        .collect()
                });
                let images: Vec<Tensor> = entry["images"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|name| {
                        let (values, grid) = pixels(name.as_str().unwrap());
                        tower().forward_pixels(&values, grid).unwrap()
                    })
                    .collect();
                let embeddings = if images.is_empty() {
                    None
                } else {
                    let (rows, values) = image_embedding_rows(&tokens, IMAGE_PAD, &images).unwrap();
                    let want: Vec<usize> = entry["image_pad_runs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .flat_map(|run| {
                            let start = run["start"].as_u64().unwrap() as usize;
                            start..start + run["count"].as_u64().unwrap() as usize
                        })
                        .collect();
                    assert_eq!(rows, want, "{}", entry["name"]);
                    Some((rows, values))
                };
                Prompt {
                    name: entry["name"].as_str().unwrap().to_string(),
                    tokens,
                    positions,
                    embeddings,
                    entry: entry.clone(),
                }
            })
            .collect()
    })
}

fn item<'a>(p: &'a Prompt, state: &'a mut prism_model::SequenceState) -> BatchItem<'a> {
    let mut item = BatchItem::new(state, &p.tokens);
    item.positions = p.positions.as_deref();
    item.embeddings = p
        .embeddings
        .as_ref()
        .map(|(rows, values)| EmbeddingRows { rows, values });
    item
}

fn row(t: &Tensor, i: usize) -> Vec<f32> {
    t.get(i)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn every_prompt_matches_transformers() {
    let model = model();
    let stages = [
        "after_embedding",
        "after_layer0",
        "after_layer1",
        "after_layer2",
        "after_layer3",
    ];
    let mut worst = 0f32;
    for p in prompts() {
        let mut state = model.new_state().unwrap();
        let (out, trace) = model.forward_traced(&mut [item(p, &mut state)]).unwrap();
        let last = p.tokens.len() - 1;
        assert_eq!(
            state.next_position() as u64,
            p.entry["next_position"].as_u64().unwrap(),
            "{}",
            p.name
        );
        let hidden = &p.entry["last_hidden"];
        let mut layer_deltas: Vec<String> = Vec::new();
        for (stage, t) in stages.iter().zip(&trace) {
            let d = max_abs_diff(&row(t, last), &floats(&hidden[*stage]));
            layer_deltas.push(format!("{d:.1e}"));
        }
        let d = max_abs_diff(
            &row(&out.hidden, last),
            &floats(&hidden["after_final_norm"]),
        );
        layer_deltas.push(format!("{d:.1e}"));
        let logits = model
            .logits(&out.hidden.get(last).unwrap().unsqueeze(0).unwrap())
            .unwrap();
        let argmax = prism_model::argmax(&logits).unwrap();
        let logits = row(&logits, 0);
        let d = max_abs_diff(&logits, &floats(&p.entry["last_logits"]));
        eprintln!(
            "{}: logits max |Δ| {d:.3e}; hidden (embedding, layers 0-3, final norm) {}; argmax {argmax}",
            p.name,
            layer_deltas.join(" ")
        );
        assert_eq!(
            argmax as u64,
            p.entry["argmax"].as_u64().unwrap(),
            "{}",
            p.name
        );
        worst = worst.max(d);
    }
    eprintln!("all prompts: logits max |Δ| {worst:.3e}");
    assert!(worst <= TOLERANCE, "logits max |Δ| {worst} > {TOLERANCE}");
}

#[test]
fn a_batch_of_all_prompts_gives_each_prompts_bits() {
    let model = model();
    let alone: Vec<Vec<f32>> = prompts()
        .iter()
        .map(|p| {
            let mut state = model.new_state().unwrap();
            let out = model.forward(&mut [item(p, &mut state)]).unwrap();
            row(&out.hidden, p.tokens.len() - 1)
        })
        .collect();
    let mut states: Vec<_> = prompts()
        .iter()
        .map(|_| model.new_state().unwrap())
        .collect();
    let mut items: Vec<BatchItem<'_>> = prompts()
        .iter()
        .zip(states.iter_mut())
        .map(|(p, s)| item(p, s))
        .collect();
    let out = model.forward(&mut items).unwrap();
    for ((p, seg), want) in prompts().iter().zip(&out.segments).zip(&alone) {
        assert_eq!(
            &row(&out.hidden, seg.start + seg.len - 1),
            want,
            "{}",
            p.name
        );
    }
}

#[test]
fn mismatched_embedding_rows_are_refused() {
    let model = model();
    let p = &prompts()[1];
    let (rows, values) = p.embeddings.as_ref().unwrap();
    let mut state = model.new_state().unwrap();
    let run = |rows: &[usize], values: &Tensor, state: &mut prism_model::SequenceState| {
        let mut it = BatchItem::new(state, &p.tokens);
        it.positions = p.positions.as_deref();
        it.embeddings = Some(EmbeddingRows { rows, values });
        model.forward(&mut [it])
    };
    let short = &rows[..rows.len() - 1];
    let mut unordered = rows.clone();
    unordered.swap(0, 1);
    let past: Vec<usize> = rows.iter().map(|r| r + p.tokens.len()).collect();
    let narrow = values.narrow(1, 0, 64).unwrap();
    for (what, rows, values) in [
        ("one row short", short, values),
        ("unordered", &unordered[..], values),
        ("past the tokens", &past[..], values),
        ("narrow values", &rows[..], &narrow),
    ] {
        let before = (state.n_tokens(), state.next_position());
        match run(rows, values, &mut state) {
            Err(ModelError::EmbeddingRows { index: 0, .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!((state.n_tokens(), state.next_position()), before, "{what}");
    }

    // Pad runs against the images' embeddings.
    let image = values.narrow(0, 0, 64).unwrap();
    for (what, images) in [
        ("no image", vec![]),
        ("two images", vec![image.clone(), image.clone()]),
        ("a short image", vec![image.narrow(0, 0, 63).unwrap()]),
    ] {
        assert!(
            matches!(
                image_embedding_rows(&p.tokens, IMAGE_PAD, &images),
                Err(ModelError::ImagePads { .. })
            ),
            "{what}"
        );
    }
    let vector = Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        image_embedding_rows(&p.tokens, IMAGE_PAD, &[vector]),
        Err(ModelError::ImagePads { .. })
    ));
}

/// The comparison above can fail: without the images' embeddings, or with plain 1-D positions, the
/// logits move far past the tolerance (the fixture README's sensitivity table).
#[test]
fn images_and_their_positions_move_the_logits() {
    let model = model();
    let p = &prompts()[1];
    let want = floats(&p.entry["last_logits"]);
    let last = p.tokens.len() - 1;
    let run = |with_embeddings: bool, with_positions: bool| {
        let mut state = model.new_state().unwrap();
        let mut it = item(p, &mut state);
        if !with_embeddings {
            it.embeddings = None;
        }
        if !with_positions {
            it.positions = None;
        }
        let out = model.forward(&mut [it]).unwrap();
        let logits = model
            .logits(&out.hidden.get(last).unwrap().unsqueeze(0).unwrap())
            .unwrap();
        max_abs_diff(&row(&logits, 0), &want)
    };
    let (no_images, plain_positions) = (run(false, true), run(true, false));
    eprintln!(
        "{}: without images {no_images:.3}, with 1-D positions {plain_positions:.3}",
        p.name
    );
    assert!(no_images > 100.0 * TOLERANCE, "{no_images}");
    assert!(plain_positions > 10.0 * TOLERANCE, "{plain_positions}");
}
