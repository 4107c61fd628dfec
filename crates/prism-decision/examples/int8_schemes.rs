//! Experiment: what int8 formats cost on the tiny fixture model (numbers in docs/correctness.md,
//! "The integer path").
//!
//! ```text
//! cargo run -p prism-decision --example int8_schemes -- q8   # tiny-Q8_0.gguf, int8
//! cargo run -p prism-decision --example int8_schemes -- q4   # tiny-Q4_K_M.gguf, w4a8
//! ```
//!
//! The contract's formats run on the real integer path (`Precision::Int8` / `W4a8`; for Q8_0 both weight
//! scale granularities). The other formats are simulated: the model runs at f32 on the file's own
//! (dequantized) weights with projections whose input is first rewritten to `q · s` (q the int8 value,
//! s its scale) — llama.cpp's activation formats (dynamic per 32 for Q8_0 weights, per 256 for the
//! K-quants) among them. Evaluation:
//! - the 12 fixture prompts' last-position logits against transformers fp32 on the same dequantized
//!   weights (`ref_transformers_dequant_*.json`), as in `int8_accuracy`;
//! - a larger set for less noise: those 12 plus the 45 rendered golden cases, against our f32 path on
//!   the same file: mean |Δ| over the whole logit vectors, and the read-out's letter probabilities
//!   (softmax over the options' letters): max |Δp| and same decision.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Tensor;
use prism_decision::chat_template::{ChatMessage, PromptFormat};
use prism_gguf::GgufFile;
use prism_model::Q8Scales;
use prism_model::{LoadOptions, Precision, Qwen35Model};
use serde_json::Value;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

fn read_json(path: PathBuf) -> Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn absmax(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Each run of `block` elements of a row quantized with its own largest |x| (`block` ≥ the row: one
/// scale per row), written back as `q · s`.
fn simulate(x: &Tensor, block: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = x.dims2()?;
    let mut v = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for row in v.chunks_exact_mut(cols.max(1)) {
        for run in row.chunks_mut(block) {
            let r = absmax(run);
            let (s, inv) = if r > 0.0 {
                (r / 127.0, 127.0 / r)
            } else {
                (0.0, 0.0)
            };
            for x in run {
                *x = (*x * inv).round_ties_even().clamp(-127.0, 127.0) * s;
            }
        }
    }
    Tensor::from_vec(v, (rows, cols), x.device())
}

struct Prompts {
    /// The 12 fixture prompts and their reference logits (transformers, same dequantized weights).
    fixture: Vec<Vec<u32>>,
    reference: Vec<Vec<f32>>,
    /// Fixture prompts then golden cases, each with its option count (letters A..).
    all: Vec<(Vec<u32>, usize)>,
    letters: Vec<u32>,
}

fn load_prompts(format: &PromptFormat, reference: &str) -> Prompts {
    let p = read_json(fixture("qwen35-tiny/prompts.json"));
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let fixture_ids: Vec<Vec<u32>> = p["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| ids(&x["ids"]))
        .collect();
    let r = read_json(fixture(&format!("qwen35-tiny/{reference}")));
    let reference = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let mut all: Vec<(Vec<u32>, usize)> = fixture_ids.iter().map(|p| (p.clone(), 4)).collect();
    let golden = read_json(fixture("decision-golden/golden.json"));
    for case in golden["render"].as_array().unwrap() {
        let expect = &case["expect"];
        let (Some(system), Some(user), Some(order)) = (
            expect["system"].as_str(),
            expect["user"].as_str(),
            expect["order"].as_array(),
        ) else {
            continue;
        };
        let messages = [ChatMessage::system(system), ChatMessage::user(user)];
        all.push((
            format.render_and_encode(&messages, false).unwrap().ids,
            order.len(),
        ));
    }
    let tok = read_json(fixture("qwen35-tiny/tokenizer.json"));
    let letters = ('A'..='Z')
        .map(|c| tok["model"]["vocab"][c.to_string()].as_u64().unwrap() as u32)
        .collect();
    Prompts {
        fixture: fixture_ids,
        reference,
        all,
        letters,
    }
}

// The fold of tests/int8_readout.rs's `best` (over f64 there): an example and a test target share no
// module.
fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

fn last_logits(model: &Qwen35Model, prompts: &[&[u32]]) -> Vec<Vec<f32>> {
    // Batches of 8: the results do not depend on batching, the memory does.
    let mut out = Vec::new();
    for chunk in prompts.chunks(8) {
        let h = model.last_hidden(chunk).unwrap();
        out.extend(model.logits(&h).unwrap().to_vec2::<f32>().unwrap());
    }
    out
}

struct Score {
    fix_max: f32,
    fix_mean: f32,
    fix_argmax: usize,
    all_mean: f32,
    all_max: f32,
    letter_max: f64,
    same_decision: usize,
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

fn score(got: &[Vec<f32>], f32_logits: &[Vec<f32>], p: &Prompts) -> Score {
    let n_fix = p.fixture.len();
    let (mut fix_max, mut fix_sum, mut fix_n, mut fix_argmax) = (0f32, 0f64, 0usize, 0usize);
    for (g, w) in got[..n_fix].iter().zip(&p.reference) {
        for (a, b) in g.iter().zip(w) {
            fix_max = fix_max.max((a - b).abs());
            fix_sum += f64::from((a - b).abs());
            fix_n += 1;
        }
        fix_argmax += usize::from(argmax(g) == argmax(w));
    }
    let (mut all_max, mut all_sum, mut all_n, mut letter_max, mut same) =
        (0f32, 0f64, 0usize, 0f64, 0usize);
    for ((g, w), (_, n_opts)) in got.iter().zip(f32_logits).zip(&p.all) {
        for (a, b) in g.iter().zip(w) {
            all_max = all_max.max((a - b).abs());
            all_sum += f64::from((a - b).abs());
            all_n += 1;
        }
        let pick = |l: &[f32]| -> Vec<f32> {
            p.letters[..*n_opts]
                .iter()
                .map(|&i| l[i as usize])
                .collect()
        };
        let (pg, pw) = (softmax(&pick(g)), softmax(&pick(w)));
        letter_max = pg
            .iter()
            .zip(&pw)
            .map(|(a, b)| (a - b).abs())
            .fold(letter_max, f64::max);
        let best = |v: &[f64]| {
            v.iter()
                .enumerate()
                .fold((0, -1.0), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        };
        same += usize::from(best(&pg) == best(&pw));
    }
    Score {
        fix_max,
        fix_mean: (fix_sum / fix_n as f64) as f32,
        fix_argmax,
        all_mean: (all_sum / all_n as f64) as f32,
        all_max,
        letter_max,
        same_decision: same,
    }
}

fn print_header(n_all: usize) {
    println!(
        "| format | fixture vs transformers-dequant: max / mean |Δ|, argmax | {n_all} prompts vs f32: mean / max |Δ| | letters: max |Δp|, same decision |"
    );
    println!("|---|---|---|---|");
}

fn print_row(label: &str, s: &Score, n_all: usize) {
    println!(
        "| {label} | {:.3} / {:.3}, {}/12 | {:.3} / {:.2} | {:.3}, {}/{n_all} |",
        s.fix_max, s.fix_mean, s.fix_argmax, s.all_mean, s.all_max, s.letter_max, s.same_decision
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map(String::as_str).unwrap_or("q8");
    let (file, precision, reference, llama_block) = match which {
        "q8" => (
            "tiny-Q8_0.gguf",
            Precision::Int8,
            "ref_transformers_dequant_Q8_0.json",
            32,
        ),
        "q4" => (
            "tiny-Q4_K_M.gguf",
            Precision::W4a8,
            "ref_transformers_dequant_Q4_K_M.json",
            256,
        ),
        other => panic!("q8 or q4, not {other}"),
    };
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let dir = fixture("qwen35-tiny");
    let gguf = GgufFile::open(dir.join(file)).unwrap();
    let format = PromptFormat::load_from_model_dir(&dir, Some(&gguf)).unwrap();
    let prompts = load_prompts(&format, reference);
    let options = |precision| LoadOptions {
        hf_config: Some(dir.join("config.json")),
        precision,
        ..LoadOptions::default()
    };
    let all_refs: Vec<&[u32]> = prompts.all.iter().map(|p| p.0.as_slice()).collect();
    let n_all = prompts.all.len();
    println!(
        "{file} at {}: {n_all} prompts ({} tokens)\n",
        precision.as_str(),
        prompts.all.iter().map(|p| p.0.len()).sum::<usize>()
    );
    let f32_model = Qwen35Model::from_gguf(&gguf, &options(Precision::F32)).unwrap();
    let f32_logits = last_logits(&f32_model, &all_refs);
    drop(f32_model);
    let run = |model: Qwen35Model| score(&last_logits(&model, &all_refs), &f32_logits, &prompts);
    let simulated = |block: usize| {
        let transform = Arc::new(move |x: &Tensor| simulate(x, block));
        run(Qwen35Model::from_gguf_simulated(&gguf, &options(Precision::F32), transform).unwrap())
    };

    print_header(n_all);
    print_row(
        "integer path: activations per (row, 128), Q8_0 weights re-blocked per (row, 128)",
        &run(
            Qwen35Model::from_gguf_with_q8_scales(&gguf, &options(precision), Q8Scales::PerRun)
                .unwrap(),
        ),
        n_all,
    );
    if precision == Precision::Int8 {
        print_row(
            "integer path: activations per (row, 128), Q8_0 weights re-blocked per row",
            &run(Qwen35Model::from_gguf_with_q8_scales(
                &gguf,
                &options(precision),
                Q8Scales::PerRow,
            )
            .unwrap()),
            n_all,
        );
    }
    print_row(
        "simulated on the file's weights: dynamic per row",
        &simulated(usize::MAX),
        n_all,
    );
    print_row(
        "simulated on the file's weights: dynamic per (row, 128)",
        &simulated(128),
        n_all,
    );
    print_row(
        &format!("simulated on the file's weights: dynamic per (row, {llama_block}) (llama.cpp's format)"),
        &simulated(llama_block),
        n_all,
    );
    if llama_block != 32 {
        print_row(
            "simulated on the file's weights: dynamic per (row, 32)",
            &simulated(32),
            n_all,
        );
    }
    // The same activation formats on the weights the integer path multiplies (for Q8_0: re-blocked per
    // (row, 128)); per (row, 128) should land on the integer path's own row above.
    let on_integer_weights = |block: usize| {
        let transform = Arc::new(move |x: &Tensor| simulate(x, block));
        run(Qwen35Model::from_gguf_simulated_on_integer_weights(
            &gguf,
            &options(Precision::F32),
            transform,
        )
        .unwrap())
    };
    for block in [128, 32] {
        print_row(
            &format!("simulated on the integer path's weights: dynamic per (row, {block})"),
            &on_integer_weights(block),
            n_all,
        );
    }
}
