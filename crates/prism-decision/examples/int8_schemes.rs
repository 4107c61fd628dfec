//! Experiment: what int8 activation formats cost on the tiny fixture model (numbers in
//! docs/correctness.md, "The integer path").
//!
//! ```text
//! cargo run -p prism-decision --example int8_schemes -- q8     # tiny-Q8_0.gguf, int8
//! cargo run -p prism-decision --example int8_schemes -- q4     # tiny-Q4_K_M.gguf, w4a8
//! cargo run -p prism-decision --example int8_schemes -- q8 groups   # + which projections matter
//! ```
//!
//! Calibration data are the product's own: the built-in decision prompts
//! ([`prism_decision::calibration_prompts`]) rendered through the fixture's chat template, recorded at
//! bf16 exactly as `calibrate` does. Nothing is chosen on the evaluation prompts.
//!
//! Static per-tensor ranges run on the real integer path (`Precision::Int8` / `W4a8`). The other
//! formats are simulated: the model runs at f32 with recording projections whose observer rewrites each
//! input in place to `q · s` (q the int8 value, s its scale), which is what the exact integer matmul
//! computes up to f32 rounding of the sums. Evaluation:
//! - the 12 fixture prompts' last-position logits against transformers fp32 on the same dequantized
//!   weights (`ref_transformers_dequant_*.json`), as in `int8_accuracy`;
//! - a larger set for less noise: those 12 plus the 45 rendered golden cases, against our f32 path on
//!   the same file (which equals that reference to ~1e-5): mean |Δ| over the whole logit vectors, and
//!   the read-out's letter probabilities (softmax over the options' letters): max |Δp| and same decision.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};
use prism_decision::chat_template::{ChatMessage, PromptFormat};
use prism_gguf::GgufFile;
use prism_model::calibration::{
    model_key, recording_model, Calibration, RangeRecorder, CALIBRATION_VERSION,
};
use prism_model::{BatchItem, LoadOptions, Precision, Qwen35Model};
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

/// An activation format, per projection input.
#[derive(Debug, Clone)]
enum Format {
    /// One static range per tensor (the spec's format).
    Static(f32),
    /// A static range per run of `block` input channels.
    StaticBlocks(usize, Vec<f32>),
    /// Each row's own largest |x| (dynamic, still one scale per row: batch-invariant).
    DynamicRow,
    /// Each run of `block` elements of a row its own largest |x| (llama.cpp's Q8_0/Q8_K activations).
    DynamicBlocks(usize),
}

/// `q · s` for `q = clamp(rint(x · (127 / range)), ±127)`, `s = range / 127`: the spec's quantizer.
fn fake(x: f32, range: f32) -> f32 {
    if range <= 0.0 {
        return 0.0;
    }
    let q = (x * (127.0 / range)).round_ties_even().clamp(-127.0, 127.0);
    q * (range / 127.0)
}

fn absmax(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

impl Format {
    fn apply(&self, row: &mut [f32]) {
        match self {
            Format::Static(r) => row.iter_mut().for_each(|x| *x = fake(*x, *r)),
            Format::StaticBlocks(b, ranges) => {
                for (blk, &r) in row.chunks_mut(*b).zip(ranges) {
                    blk.iter_mut().for_each(|x| *x = fake(*x, r));
                }
            }
            Format::DynamicRow => {
                let r = absmax(row);
                row.iter_mut().for_each(|x| *x = fake(*x, r));
            }
            Format::DynamicBlocks(b) => {
                for blk in row.chunks_mut(*b) {
                    let r = absmax(blk);
                    blk.iter_mut().for_each(|x| *x = fake(*x, r));
                }
            }
        }
    }
}

/// Rewrites an f32 input `[rows, cols]` in place.
struct Simulate<'a>(&'a Format);

impl InplaceOp1 for Simulate<'_> {
    fn name(&self) -> &'static str {
        "simulate-int8-activations"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (_, cols) = layout.shape().dims2()?;
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("simulate: input not contiguous".into()))?;
        let CpuStorage::F32(v) = storage else {
            candle_core::bail!("simulate: input not f32")
        };
        v[start..end]
            .chunks_exact_mut(cols)
            .for_each(|row| self.0.apply(row));
        Ok(())
    }
}

/// What the observer does with each projection input.
#[derive(Default)]
struct Observer {
    /// Formats by projection name (empty: inputs pass unchanged).
    formats: HashMap<String, Format>,
    /// Per-channel largest |x| by name, when collecting.
    channel_max: Option<BTreeMap<String, Vec<f32>>>,
    /// Moments and row maxima by name, when collecting.
    moments: Option<BTreeMap<String, Moments>>,
    /// Counts of values beyond given ranges, when asked.
    beyond: Option<Beyond>,
}

/// Values beyond each projection's range: (beyond, all) by name.
struct Beyond {
    ranges: BTreeMap<String, f32>,
    counts: BTreeMap<String, (u64, u64)>,
}

#[derive(Default)]
struct Moments {
    n: f64,
    sum_sq: f64,
    sum_4: f64,
    row_max: Vec<f32>,
}

fn observe(state: &Mutex<Observer>, names: &[String], x: &Tensor) -> candle_core::Result<()> {
    let mut st = state.lock().unwrap();
    if let Some(max) = st.channel_max.as_mut() {
        let (_, cols) = x.dims2()?;
        let v = x
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for name in names {
            let m = max.entry(name.clone()).or_insert_with(|| vec![0.0; cols]);
            for row in v.chunks_exact(cols) {
                m.iter_mut().zip(row).for_each(|(a, b)| *a = a.max(b.abs()));
            }
        }
    }
    if st.moments.is_some() || st.beyond.is_some() {
        let (_, cols) = x.dims2()?;
        let v = x
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if let Some(moments) = st.moments.as_mut() {
            let m = moments.entry(names[0].clone()).or_default();
            for &a in &v {
                let a2 = f64::from(a) * f64::from(a);
                m.n += 1.0;
                m.sum_sq += a2;
                m.sum_4 += a2 * a2;
            }
            m.row_max.extend(v.chunks_exact(cols).map(absmax));
        }
        if let Some(Beyond { ranges, counts }) = st.beyond.as_mut() {
            let r = ranges[&names[0]];
            let c = counts.entry(names[0].clone()).or_default();
            c.0 += v.iter().filter(|a| a.abs() > r).count() as u64;
            c.1 += v.len() as u64;
        }
    }
    // The parts of a fused projection share one format (they share the input).
    if let Some(format) = names.iter().find_map(|n| st.formats.get(n)) {
        x.inplace_op1(&Simulate(format))?;
    }
    Ok(())
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

/// The projection groups of the diagnosis (by GGUF name).
fn group(name: &str) -> &'static str {
    if name == "output.weight" {
        return "lm_head";
    }
    match name.split('.').nth(2).unwrap_or("") {
        "attn_qkv" | "attn_gate" | "ssm_beta" | "ssm_alpha" => "DeltaNet in-proj",
        "ssm_out" => "DeltaNet out-proj",
        "attn_q" | "attn_k" | "attn_v" => "attention q/k/v",
        "attn_output" => "attention o",
        "ffn_gate" | "ffn_up" => "MLP gate/up",
        "ffn_down" => "MLP down",
        _ => "other",
    }
}

const GROUPS: [&str; 7] = [
    "DeltaNet in-proj",
    "DeltaNet out-proj",
    "attention q/k/v",
    "attention o",
    "MLP gate/up",
    "MLP down",
    "lm_head",
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map(String::as_str).unwrap_or("q8");
    let groups = args.iter().any(|a| a == "groups");
    let (file, precision, reference, block) = match which {
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
    let calibration_prompts =
        prism_decision::calibration_prompts::calibration_tokens(&format).unwrap();
    let prompts = load_prompts(&format, reference);
    let options = |precision| LoadOptions {
        hf_config: Some(dir.join("config.json")),
        precision,
        ..LoadOptions::default()
    };

    // Calibration pass, as `calibrate` runs it (bf16), also collecting per-channel maxima.
    let state = Arc::new(Mutex::new(Observer {
        channel_max: Some(BTreeMap::new()),
        moments: Some(BTreeMap::new()),
        ..Observer::default()
    }));
    let obs = state.clone();
    let recorder = Arc::new(RangeRecorder::with_observer(Arc::new(
        move |n: &[String], x: &Tensor| observe(&obs, n, x),
    )));
    {
        let model = recording_model(&gguf, &options(Precision::Bf16), recorder.clone()).unwrap();
        for p in &calibration_prompts {
            let mut s = model.new_state().unwrap();
            let out = model.forward(&mut [BatchItem::new(&mut s, p)]).unwrap();
            model.logits_for_rows(&out.hidden, &[0]).unwrap();
        }
    }
    let channel_max = state.lock().unwrap().channel_max.take().unwrap();
    let moments = state.lock().unwrap().moments.take().unwrap();
    let absmax_ranges = recorder.ranges();
    let mse_ranges = recorder.mse_ranges();
    let n_tokens: usize = calibration_prompts.iter().map(Vec::len).sum();
    println!(
        "{file} at {}: calibration {} built-in prompts, {n_tokens} tokens; evaluation {} prompts ({} tokens)\n",
        precision.as_str(),
        calibration_prompts.len(),
        prompts.all.len(),
        prompts.all.iter().map(|p| p.0.len()).sum::<usize>()
    );
    println!("smallest-error range / largest |x| by projection group (calibration data):");
    for g in GROUPS {
        let r: Vec<f32> = mse_ranges
            .iter()
            .filter(|(n, _)| group(n) == g)
            .map(|(n, r)| r / absmax_ranges[n])
            .collect();
        if !r.is_empty() {
            let (lo, hi) = r
                .iter()
                .fold((f32::MAX, 0f32), |(a, b), &x| (a.min(x), b.max(x)));
            println!("  {g}: {lo:.2}–{hi:.2}");
        }
    }
    println!();

    let all_refs: Vec<&[u32]> = prompts.all.iter().map(|p| p.0.as_slice()).collect();
    // The simulated formats run on one f32 recording model; its observer reads `state.formats`.
    let obs = state.clone();
    let sim_recorder = Arc::new(RangeRecorder::with_observer(Arc::new(
        move |n: &[String], x: &Tensor| observe(&obs, n, x),
    )));
    let sim = recording_model(&gguf, &options(Precision::F32), sim_recorder).unwrap();
    let f32_logits = last_logits(&sim, &all_refs);
    let simulate = |formats: HashMap<String, Format>| -> Score {
        state.lock().unwrap().formats = formats;
        let got = last_logits(&sim, &all_refs);
        state.lock().unwrap().formats.clear();
        score(&got, &f32_logits, &prompts)
    };
    let integer = |ranges: &BTreeMap<String, f32>| -> Score {
        let calibration = Calibration {
            version: CALIBRATION_VERSION,
            model_key: model_key(&gguf),
            prompt_set: "int8_schemes".into(),
            n_prompts: calibration_prompts.len(),
            n_tokens,
            ranges: ranges.clone(),
        };
        let model =
            Qwen35Model::from_gguf_calibrated(&gguf, &options(precision), &calibration).unwrap();
        score(&last_logits(&model, &all_refs), &f32_logits, &prompts)
    };
    let names: Vec<String> = absmax_ranges.keys().cloned().collect();

    // Clipping or resolution? How often the evaluation prompts exceed the calibrated largest |x|, and
    // where a typical row's largest |x| sits in that range.
    state.lock().unwrap().beyond = Some(Beyond {
        ranges: absmax_ranges.clone(),
        counts: BTreeMap::new(),
    });
    last_logits(&sim, &all_refs);
    let beyond = state.lock().unwrap().beyond.take().unwrap().counts;
    println!("calibration inputs by group (range = largest |x| of calibration): kurtosis, range / RMS, median row max / range; evaluation values beyond the range");
    for g in GROUPS {
        let (mut kurt, mut range_rms, mut row_med, mut frac) =
            ((f64::MAX, 0f64), (f64::MAX, 0f64), (f64::MAX, 0f64), 0f64);
        let widen = |r: &mut (f64, f64), x: f64| *r = (r.0.min(x), r.1.max(x));
        for (n, m) in moments.iter().filter(|(n, _)| group(n) == g) {
            let rms = (m.sum_sq / m.n).sqrt();
            widen(&mut kurt, m.sum_4 / m.n / (rms.powi(4)));
            widen(&mut range_rms, f64::from(absmax_ranges[n]) / rms);
            let mut rows = m.row_max.clone();
            rows.sort_by(|a, b| a.total_cmp(b));
            widen(
                &mut row_med,
                f64::from(rows[rows.len() / 2] / absmax_ranges[n]),
            );
            let (b, all) = beyond[n];
            frac = frac.max(b as f64 / all as f64);
        }
        println!(
            "  {g}: kurtosis {:.1}–{:.1}, range/RMS {:.1}–{:.1}, median row max/range {:.2}–{:.2}; beyond ≤ {:.1e}",
            kurt.0, kurt.1, range_rms.0, range_rms.1, row_med.0, row_med.1, frac
        );
    }
    println!();
    let every = |f: &dyn Fn(&str) -> Option<Format>| -> HashMap<String, Format> {
        names
            .iter()
            .filter_map(|n| Some((n.clone(), f(n)?)))
            .collect()
    };
    let n_all = prompts.all.len();

    print_header(n_all);
    print_row(
        "static per tensor, largest |x| (integer path; CALIBRATION_VERSION 1)",
        &integer(&absmax_ranges),
        n_all,
    );
    print_row(
        "static per tensor, smallest-error range (integer path; version 2)",
        &integer(&mse_ranges),
        n_all,
    );
    print_row(
        "simulated: static per tensor, smallest-error range",
        &simulate(every(&|n| Some(Format::Static(mse_ranges[n])))),
        n_all,
    );
    let blocks = |n: &str| -> Vec<f32> { channel_max[n].chunks(block).map(absmax).collect() };
    print_row(
        &format!("simulated: static per {block} input channels, largest |x|"),
        &simulate(every(&|n| Some(Format::StaticBlocks(block, blocks(n))))),
        n_all,
    );
    print_row(
        "simulated: dynamic per row",
        &simulate(every(&|_| Some(Format::DynamicRow))),
        n_all,
    );
    let heavy = |n: &str| matches!(group(n), "DeltaNet out-proj" | "MLP down");
    print_row(
        "simulated: dynamic per row for DeltaNet out-proj and MLP down, static smallest-error elsewhere",
        &simulate(every(&|n| Some(if heavy(n) { Format::DynamicRow } else { Format::Static(mse_ranges[n]) }))),
        n_all,
    );
    print_row(
        &format!("simulated: dynamic per {block} elements (llama.cpp-like)"),
        &simulate(every(&|_| Some(Format::DynamicBlocks(block)))),
        n_all,
    );
    if block != 32 {
        print_row(
            "simulated: dynamic per 32 elements",
            &simulate(every(&|_| Some(Format::DynamicBlocks(32)))),
            n_all,
        );
    }

    if groups {
        println!("\nOne group quantized (static, largest |x| / smallest-error range / dynamic per row), the rest f32:\n");
        println!("| group | largest |x| | smallest-error | dynamic per row |");
        println!("|---|---|---|---|");
        for g in GROUPS {
            let only = |f: &dyn Fn(&str) -> Format| every(&|n| (group(n) == g).then(|| f(n)));
            let a = simulate(only(&|n| Format::Static(absmax_ranges[n])));
            let m = simulate(only(&|n| Format::Static(mse_ranges[n])));
            let d = simulate(only(&|_| Format::DynamicRow));
            println!(
                "| {g} | {:.3} ({:.3}) | {:.3} ({:.3}) | {:.3} ({:.3}) |",
                a.all_mean, a.fix_mean, m.all_mean, m.fix_mean, d.all_mean, d.fix_mean
            );
        }
        println!("(mean |Δ| over the {n_all} prompts vs f32; in brackets the 12 fixture prompts vs transformers)");
        println!("\nDiagnostic only (chosen on these prompts, so not a candidate): all ranges × k, integer path");
        println!("(k = 0.99 / 1.01: the same noise level, other roundings: how much of a difference is chance)");
        for (label, ranges, ks) in [
            (
                "smallest-error",
                &mse_ranges,
                &[0.6f32, 0.8, 0.99, 1.01, 1.25][..],
            ),
            ("largest |x|", &absmax_ranges, &[0.99f32, 1.01][..]),
        ] {
            for &k in ks {
                let scaled: BTreeMap<String, f32> =
                    ranges.iter().map(|(n, r)| (n.clone(), r * k)).collect();
                let s = integer(&scaled);
                println!(
                    "  {label} × {k}: mean |Δ| {:.3} ({:.3}), letters max |Δp| {:.3}, same decision {}/{n_all}",
                    s.all_mean, s.fix_mean, s.letter_max, s.same_decision
                );
            }
        }
        println!("\nOne layer quantized (static, largest |x|):");
        for layer in 0..8 {
            let pre = format!("blk.{layer}.");
            let s = simulate(every(&|n| {
                n.starts_with(&pre)
                    .then(|| Format::Static(absmax_ranges[n]))
            }));
            println!(
                "  layer {layer}: mean |Δ| {:.3} ({:.3})",
                s.all_mean, s.fix_mean
            );
        }
    }
}
