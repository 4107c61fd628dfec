//! The integer precisions through the real engine (issue #5): the read-out's letter probabilities of
//! int8 (tiny-Q8_0.gguf) and w4a8 (tiny-Q4_K_M.gguf) against f32 on the same file, on the 45 rendered
//! golden cases of the reference renderer and the 11 chat prompts of the fixture. Numbers in
//! docs/correctness.md.

mod common;

use common::{fixture_path, get, golden, list};
use prism_decision::{DecoderLetterModel, LetterModel, LetterPrompt, ModelSource};
use prism_model::{LoadOptions, Precision};

fn load(file: &str, precision: Precision) -> DecoderLetterModel {
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let dir = fixture_path("qwen35-tiny");
    let source = ModelSource {
        gguf: dir.join(file),
        model_dir: Some(dir),
        mmproj: None,
    };
    let options = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    DecoderLetterModel::load(&source, &options, 32768)
        .unwrap_or_else(|e| panic!("{file} {precision:?}: {e}"))
        .model
}

/// The 45 rendered golden cases as read-out prompts.
fn golden_prompts() -> Vec<LetterPrompt> {
    let golden = golden();
    list(get(&golden, "render"))
        .iter()
        .filter_map(|case| {
            let expect = get(case, "expect").as_object()?;
            let text = |k: &str| expect.get(k).and_then(|v| v.as_str()).map(str::to_string);
            let system = text("system")?;
            let user = text("user")?;
            // The option count is all the read-out needs from the order.
            let n = list(expect.get("order")?).len();
            Some(LetterPrompt {
                system,
                user,
                option_ids: (0..n).map(|i| i.to_string()).collect(),
                images: Vec::new(),
            })
        })
        .collect()
}

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

// prism-model's int8_accuracy has the same fold over f32 as `argmax`: another test crate, nothing to
// share between them.
fn best(p: &[f64]) -> usize {
    p.iter()
        .enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// (max |Δp|, mean |Δp|, same decision, prompts).
fn drift(
    quant: &mut DecoderLetterModel,
    float: &mut DecoderLetterModel,
    prompts: &[LetterPrompt],
) -> (f64, f64, usize, usize) {
    let q = quant.letter_logits(prompts).unwrap().logits;
    let f = float.letter_logits(prompts).unwrap().logits;
    let (mut max, mut sum, mut n, mut same) = (0f64, 0f64, 0usize, 0usize);
    for (a, b) in q.iter().zip(&f) {
        let (pa, pb) = (softmax(a), softmax(b));
        for (x, y) in pa.iter().zip(&pb) {
            max = max.max((x - y).abs());
            sum += (x - y).abs();
            n += 1;
        }
        same += usize::from(best(&pa) == best(&pb));
        if best(&pa) != best(&pb) {
            // How close the f32 decision was: its top probability minus the runner-up's.
            let mut sorted = pb.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            println!(
                "  decision differs; f32 margin {:.3}, quantized {:?} vs f32 {:?}",
                sorted[0] - sorted[1],
                best(&pa),
                best(&pb)
            );
        }
    }
    (max, sum / n as f64, same, q.len())
}

fn fixture_chat_prompts() -> Vec<LetterPrompt> {
    let text = std::fs::read_to_string(fixture_path("qwen35-tiny/prompts.json")).unwrap();
    let prompts: serde_json::Value = serde_json::from_str(&text).unwrap();
    prompts["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| {
            let messages = p["messages"].as_array()?;
            let text = |role: &str| {
                messages
                    .iter()
                    .find(|m| m["role"] == role)
                    .and_then(|m| m["content"].as_str())
                    .map(str::to_string)
            };
            Some(LetterPrompt {
                system: text("system")?,
                user: text("user")?,
                option_ids: (0..4).map(|i| i.to_string()).collect(),
                images: Vec::new(),
            })
        })
        .collect()
}

/// ~35 s on 2 cores (4 models × 56 prompts): a measurement, run on demand with
/// `cargo test -p prism-decision --test int8_readout -- --ignored --nocapture`. CI checks the letter
/// drift on the fixture prompts in prism-model's `int8_accuracy`.
#[test]
#[ignore]
fn int8_and_w4a8_read_outs_against_f32() {
    let golden = golden_prompts();
    assert_eq!(golden.len(), 45);
    let chat = fixture_chat_prompts();
    assert_eq!(chat.len(), 11);
    for (file, precision, bounds) in [
        // Measured (golden / fixture prompts, max |Δp|): int8 0.084 / 0.103, w4a8 0.114 / 0.160 (the
        // old contract's static scales: 0.278 / 0.284 and 0.368 / 0.339). Bounds about 1.5× the worst.
        ("tiny-Q8_0.gguf", Precision::Int8, (0.13, 0.16)),
        ("tiny-Q4_K_M.gguf", Precision::W4a8, (0.17, 0.24)),
    ] {
        let mut quant = load(file, precision);
        let mut float = load(file, Precision::F32);
        let g = drift(&mut quant, &mut float, &golden);
        let c = drift(&mut quant, &mut float, &chat);
        println!(
            "{file} {precision:?} vs f32: golden cases max |Δp| {:.4} mean {:.4}, same decision {}/{}; \
             fixture prompts max |Δp| {:.4} mean {:.4}, same decision {}/{}",
            g.0, g.1, g.2, g.3, c.0, c.1, c.2, c.3
        );
        assert!(g.0 < bounds.0 && c.0 < bounds.1, "{file}: {g:?} {c:?}");
        // Same decision, measured: 45/45 and 11/11 for both (the old contract: int8 44/45 and 9/11,
        // w4a8 44/45 and 7/11). One flip on the fixture prompts is tolerated: this random model swings
        // letter probabilities under int8 noise.
        assert!(
            g.2 == g.3 && c.2 + 1 >= c.3,
            "{file}: decisions {g:?} {c:?}"
        );
    }
}
