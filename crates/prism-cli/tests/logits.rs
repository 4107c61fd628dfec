//! `prism logits` on the tiny fixture: the JSON lines must carry transformers' fp32 logits (1e-3, the
//! decoder's acceptance bound), and bad inputs must fail with a clear message, not a panic.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

fn read_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join(name)).unwrap()).unwrap()
}

fn tiny_gguf() -> PathBuf {
    fixture_dir().join("tiny-BF16.gguf")
}

/// A scratch directory under cargo's temp dir (`target/tmp`), kept as it is if it exists: tests running
/// at the same time may share it.
fn scratch_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `prism logits ARGS`, on one rayon thread, without panic backtraces.
fn prism_logits(args: &[&OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .arg("logits")
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// Writes `tokens` to a temporary file and runs `prism logits` on tiny-BF16.gguf with `extra` arguments.
fn run(name: &str, tokens: &str, extra: &[&str]) -> Output {
    let path = scratch_dir("logits").join(format!("{name}.json"));
    std::fs::write(&path, tokens).unwrap();
    let (gguf, fixture) = (tiny_gguf(), fixture_dir());
    let mut args: Vec<&OsStr> = vec![
        "--gguf".as_ref(),
        gguf.as_os_str(),
        "--model-dir".as_ref(),
        fixture.as_os_str(),
        "--tokens".as_ref(),
        path.as_os_str(),
    ];
    args.extend(extra.iter().map(OsStr::new));
    prism_logits(&args)
}

/// Asserts that the run exited with `code` and that its stderr names `message`.
#[track_caller]
fn assert_fails(out: &Output, code: i32, message: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(message), "{stderr}");
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// max |a − b| over the pairs of `a` and `b`. (prism-decision's `tests/engine.rs` has the same fold:
/// two crates' tests share no module.)
fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn json_lines_match_transformers() {
    let prompts = read_json("prompts.json");
    let reference = read_json("ref_transformers.json");
    // Prompts 1, 0 and 8 as one batch, out of fixture order.
    let order = [1usize, 0, 8];
    let tokens: Vec<&Value> = order
        .iter()
        .map(|&i| &prompts["prompts"][i]["ids"])
        .collect();
    let out = run(
        "good",
        &serde_json::to_string(&tokens).unwrap(),
        &["--json", "--full"],
    );
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), order.len());

    // The letter rows: the GGUF vocabulary's single-character tokens "A".."Z" (tokenizer.json agrees).
    let tokenizer = read_json("tokenizer.json");
    let vocab = tokenizer["model"]["vocab"].as_object().unwrap();
    let letter_ids: Vec<usize> = ('A'..='Z')
        .map(|c| vocab[&c.to_string()].as_u64().unwrap() as usize)
        .collect();

    for (line, &i) in lines.iter().zip(&order) {
        let want = &reference["prompts"][i];
        assert_eq!(line["n_tokens"], want["n_tokens"]);
        assert_eq!(line["argmax"], want["argmax"], "prompt {i}");
        let got = floats(&line["logits"]);
        let want_logits = floats(&want["logits"]);
        assert_eq!(got.len(), want_logits.len());
        let max_diff = max_abs_diff(&got, &want_logits);
        assert!(max_diff < 1e-3, "prompt {i}: max |Δ| {max_diff}");
        let letters = floats(&line["letter_logits"]);
        assert_eq!(letters.len(), 26);
        for (l, &id) in letters.iter().zip(&letter_ids) {
            assert_eq!(*l, got[id]);
        }
    }

    // Without --full there is no "logits" field; without --json the output is text.
    let out = run("short", "[[4097, 82, 597]]", &["--json"]);
    let line: Value = serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    assert!(line.get("logits").is_none() && line["letter_logits"].as_array().unwrap().len() == 26);
    let out = run("text", "[[4097, 82, 597]]", &[]);
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .starts_with("prompt 0: 3 tokens, argmax "));
}

#[test]
fn bad_inputs_fail_with_a_message() {
    let cases: [(&str, &str, &[&str], &str); 6] = [
        (
            "range",
            "[[1, 2, 4129]]",
            &[],
            "id 4129 is outside the vocabulary (size 4129)",
        ),
        (
            "negative",
            "[[1, -2]]",
            &[],
            "prompt 0, token 1: -2 is not a token id",
        ),
        ("empty", "[[5], []]", &[], "prompt 1 has no tokens"),
        ("notjson", "[[1, 2", &[], "not valid JSON"),
        ("noprompts", "[]", &[], "no prompts"),
        (
            "precision",
            "[[1]]",
            &["--precision", "int4"],
            "unsupported precision \"int4\"",
        ),
    ];
    for (name, tokens, extra, message) in cases {
        let out = run(name, tokens, extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(message), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    // --prompt-file without any tokenizer source: a GGUF with no vocabulary cannot be written here, so
    // check the other failure: a prompt file that does not exist.
    let (gguf, missing) = (tiny_gguf(), fixture_dir().join("no-such-prompt.txt"));
    let out = prism_logits(&[
        "--gguf".as_ref(),
        gguf.as_os_str(),
        "--prompt-file".as_ref(),
        missing.as_os_str(),
    ]);
    assert_fails(&out, 1, "no-such-prompt.txt");
}

#[test]
fn prompt_file_is_tokenized_with_special_tokens_and_matches_transformers() {
    // Prompt 0's chat-templated text: the tokenizer must give prompts.json's ids (special tokens parsed),
    // and the logits must be transformers' (1e-3).
    let prompts = read_json("prompts.json");
    let prompt = &prompts["prompts"][0];
    let path = scratch_dir("logits-text").join("prompt0.txt");
    std::fs::write(&path, prompt["text"].as_str().unwrap()).unwrap();
    let reference = read_json("ref_transformers.json");
    let want = floats(&reference["prompts"][0]["logits"]);
    // Both tokenizer sources: the model directory's tokenizer.json and the GGUF's own vocabulary.
    let gguf = tiny_gguf();
    for model_dir in [Some(fixture_dir()), None] {
        let mut args: Vec<&OsStr> = vec![
            "--json".as_ref(),
            "--full".as_ref(),
            "--gguf".as_ref(),
            gguf.as_os_str(),
        ];
        if let Some(d) = &model_dir {
            args.extend(["--model-dir".as_ref(), d.as_os_str()]);
        }
        args.extend(["--prompt-file".as_ref(), path.as_os_str()]);
        let out = prism_logits(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: Value =
            serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
        assert_eq!(line["n_tokens"].as_u64(), prompt["n_tokens"].as_u64());
        let d = max_abs_diff(&floats(&line["logits"]), &want);
        assert!(d < 1e-3, "max |Δ| {d} (model dir {model_dir:?})");
        assert_eq!(line["letter_logits"].as_array().unwrap().len(), 26);
    }
}

// ---------------------------------------------------------------------------------------------------
// --hf-dir: the same decoder loaded from Hugging Face safetensors
// ---------------------------------------------------------------------------------------------------

#[path = "../../prism-model/tests/hf/gguf_to_hf.rs"]
mod gguf_to_hf;

/// An HF checkpoint directory rebuilt from tiny-BF16.gguf (the model tests check it equals the
/// reference safetensors bit for bit), with the fixture's config.json and tokenizer files.
fn derived_hf_dir(tag: &str) -> PathBuf {
    let gguf = prism_gguf::GgufFile::open(tiny_gguf()).unwrap();
    let tensors = gguf_to_hf::hf_tensors_from_gguf(&gguf, gguf_to_hf::Storage::AllBf16);
    let dir = gguf_to_hf::temp_dir(&format!("cli-{tag}"));
    gguf_to_hf::write_safetensors(&dir.join("model.safetensors"), &tensors);
    for file in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::fs::copy(fixture_dir().join(file), dir.join(file)).unwrap();
    }
    dir
}

/// `prism logits --hf-dir DIR INPUT_FLAG INPUT --json --full`: INPUT_FLAG is `--tokens` or
/// `--prompt-file`.
fn hf_dir_full_logits(dir: &Path, input_flag: &str, input: &Path) -> Output {
    prism_logits(&[
        "--hf-dir".as_ref(),
        dir.as_os_str(),
        input_flag.as_ref(),
        input.as_os_str(),
        "--json".as_ref(),
        "--full".as_ref(),
    ])
}

fn json_lines(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Writes the token ids of fixture prompts `order` to a file in `dir`.
fn token_file(dir: &Path, order: &[usize]) -> PathBuf {
    let prompts = read_json("prompts.json");
    let tokens: Vec<&Value> = order
        .iter()
        .map(|&i| &prompts["prompts"][i]["ids"])
        .collect();
    let path = dir.join("tokens.json");
    std::fs::write(&path, serde_json::to_string(&tokens).unwrap()).unwrap();
    path
}

#[test]
fn hf_dir_matches_transformers_and_the_gguf() {
    let dir = derived_hf_dir("match");
    let reference = read_json("ref_transformers.json");
    let order = [1usize, 0, 8];
    let tokens = token_file(&dir, &order);
    let hf = hf_dir_full_logits(&dir, "--tokens", &tokens);
    let (gguf_path, fixture) = (tiny_gguf(), fixture_dir());
    let gguf = prism_logits(&[
        "--gguf".as_ref(),
        gguf_path.as_os_str(),
        "--model-dir".as_ref(),
        fixture.as_os_str(),
        "--tokens".as_ref(),
        tokens.as_os_str(),
        "--json".as_ref(),
        "--full".as_ref(),
    ]);
    let (hf, gguf) = (json_lines(&hf), json_lines(&gguf));
    assert_eq!(hf.len(), order.len());
    for ((line, &i), gguf_line) in hf.iter().zip(&order).zip(&gguf) {
        let want = floats(&reference["prompts"][i]["logits"]);
        let d = max_abs_diff(&floats(&line["logits"]), &want);
        assert!(d < 1e-3, "prompt {i}: max |Δ| {d}");
        assert_eq!(
            line["argmax"], reference["prompts"][i]["argmax"],
            "prompt {i}"
        );
        // Same weights, same forward pass: the same bits as the GGUF path (letters included).
        assert_eq!(line, gguf_line, "prompt {i}: --hf-dir and --gguf differ");
        assert_eq!(line["letter_logits"].as_array().unwrap().len(), 26);
    }

    // --prompt-file: the tokenizer and chat template come from the --hf-dir directory.
    let prompt = &read_json("prompts.json")["prompts"][0];
    let text = dir.join("prompt0.txt");
    std::fs::write(&text, prompt["text"].as_str().unwrap()).unwrap();
    let out = hf_dir_full_logits(&dir, "--prompt-file", &text);
    let line = &json_lines(&out)[0];
    assert_eq!(line["n_tokens"].as_u64(), prompt["n_tokens"].as_u64());
    let want = floats(&reference["prompts"][0]["logits"]);
    let d = max_abs_diff(&floats(&line["logits"]), &want);
    assert!(d < 1e-3, "--prompt-file: max |Δ| {d}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hf_dir_flag_errors() {
    let dir = scratch_dir("hf-flags");
    let tokens = dir.join("tokens.json");
    std::fs::write(&tokens, "[[4097, 82, 597]]").unwrap();
    let (gguf_path, fixture) = (tiny_gguf(), fixture_dir());
    // Both sources, or neither: a usage error (clap's exit code 2). The command lines are written out
    // flag by flag like the one of `hf_dir_matches_transformers_and_the_gguf`: alike in shape only.
    let both = prism_logits(&[
        "--gguf".as_ref(),
        gguf_path.as_os_str(),
        "--hf-dir".as_ref(),
        fixture.as_os_str(),
        "--tokens".as_ref(),
        tokens.as_os_str(),
    ]);
    assert_fails(&both, 2, "cannot be used with");
    let neither = prism_logits(&["--tokens".as_ref(), tokens.as_os_str()]);
    assert_fails(&neither, 2, "--gguf");
    // A directory without config.json, then one without weights: exit 1 naming what is missing.
    let hf_dir_tokens = || {
        prism_logits(&[
            "--hf-dir".as_ref(),
            dir.as_os_str(),
            "--tokens".as_ref(),
            tokens.as_os_str(),
        ])
    };
    let empty = hf_dir_tokens();
    let stderr = String::from_utf8_lossy(&empty.stderr);
    assert_eq!(empty.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("config.json") && !stderr.contains("panicked"),
        "{stderr}"
    );
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
    let no_weights = hf_dir_tokens();
    assert_fails(&no_weights, 1, "no model.safetensors");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `prism logits --hf-dir` on the real reference checkpoint (the shared fixture folder, whose 14.8 MB
/// model.safetensors is not in the repository), all 12 prompts against transformers fp32. Ignored by
/// default; run with
/// `PRISM_HF_REFERENCE_DIR=/path/to/qwen35-tiny cargo test -p prism-cli --test logits -- --ignored --nocapture`.
#[test]
#[ignore = "needs PRISM_HF_REFERENCE_DIR (the fixture's model.safetensors + config.json)"]
fn hf_dir_reference_checkpoint_matches_transformers() {
    let dir =
        PathBuf::from(std::env::var("PRISM_HF_REFERENCE_DIR").expect("set PRISM_HF_REFERENCE_DIR"));
    let scratch = scratch_dir("hf-ref");
    let order: Vec<usize> = (0..12).collect();
    let tokens = token_file(&scratch, &order);
    let out = hf_dir_full_logits(&dir, "--tokens", &tokens);
    let lines = json_lines(&out);
    let reference = read_json("ref_transformers.json");
    let mut max_d: f64 = 0.0;
    for (line, &i) in lines.iter().zip(&order) {
        let want = floats(&reference["prompts"][i]["logits"]);
        let d = max_abs_diff(&floats(&line["logits"]), &want);
        assert_eq!(
            line["argmax"], reference["prompts"][i]["argmax"],
            "prompt {i}"
        );
        max_d = max_d.max(d);
    }
    assert_eq!(lines.len(), 12);
    eprintln!(
        "prism logits --hf-dir {}: 12 prompts, max |Δ| vs transformers fp32 {max_d:.3e}",
        dir.display()
    );
    assert!(max_d < 1e-3);
    let _ = std::fs::remove_dir_all(&scratch);
}
