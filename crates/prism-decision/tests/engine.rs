//! The real decision model (`DecoderLetterModel`: chat template + tokenizer + Qwen3.5 decoder) against
//! transformers' float32 logits for the tiny fixture, and the whole `decide` path on top of it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::submit_with;
use prism_decision::engine::{Branch, GroupInput};
use prism_decision::{
    decide, DecisionConfig, DecisionRequest, DecoderLetterModel, EngineError, LetterModel,
    LetterPrompt, ModelSource, PassModel, RequestDefaults,
};
use prism_model::{LoadOptions, SequenceState};
use serde_json::Value;

mod common;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

fn read_json(name: &str) -> Value {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fixture's GGUF `gguf` with the model directory `model_dir` (tokenizer, template, configs), no mmproj.
fn source(gguf: &str, model_dir: Option<PathBuf>) -> ModelSource {
    ModelSource {
        gguf: fixture_dir().join(gguf),
        model_dir,
        mmproj: None,
    }
}

fn load(gguf: &str, max_tokens: usize) -> (DecoderLetterModel, DecisionConfig) {
    let loaded = DecoderLetterModel::load(
        &source(gguf, Some(fixture_dir())),
        &LoadOptions::default(),
        max_tokens,
    )
    .expect("model loads");
    (loaded.model, loaded.config)
}

/// The fixture prompts that are a system + user conversation (11 of 12), as read-out prompts over all 26
/// letters, with their index in prompts.json.
fn fixture_prompts() -> Vec<(usize, LetterPrompt)> {
    static PROMPTS: OnceLock<Vec<(usize, LetterPrompt)>> = OnceLock::new();
    PROMPTS
        .get_or_init(|| {
            let prompts = read_json("prompts.json");
            let letters: Vec<String> = ('A'..='Z').map(|c| c.to_string()).collect();
            prompts["prompts"]
                .as_array()
                .expect("prompts")
                .iter()
                .filter_map(|p| {
                    let messages = p["messages"].as_array()?;
                    if messages.len() != 2
                        || messages[0]["role"] != "system"
                        || messages[1]["role"] != "user"
                    {
                        return None;
                    }
                    let prompt = LetterPrompt {
                        system: messages[0]["content"].as_str()?.to_string(),
                        user: messages[1]["content"].as_str()?.to_string(),
                        option_ids: letters.clone(),
                        images: Vec::new(),
                    };
                    Some((p["index"].as_u64()? as usize, prompt))
                })
                .collect()
        })
        .clone()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn letter_logits_match_transformers_for_every_fixture_prompt() {
    let (mut model, _) = load("tiny-BF16.gguf", 4096);
    let reference = read_json("ref_transformers.json");
    let prompts = fixture_prompts();
    assert_eq!(prompts.len(), 11);
    let letter_ids = *model.prompt_format().letter_ids();

    let batch: Vec<LetterPrompt> = prompts.iter().map(|(_, p)| p.clone()).collect();
    let together = model.letter_logits(&batch).expect("batch read-out");
    assert_eq!(together.logits.len(), prompts.len());

    let mut worst: f64 = 0.0;
    let mut total_tokens = 0;
    for ((index, prompt), got) in prompts.iter().zip(&together.logits) {
        // The engine's own rendering of the messages is the token sequence transformers was given.
        let ids = model.prompt_tokens(prompt).expect("tokenize");
        let want_ids: Vec<u32> = read_json("prompts.json")["prompts"][*index]["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, want_ids, "prompt {index}: token ids");
        total_tokens += ids.len() as u64;

        let full = reference["prompts"][*index]["logits"]
            .as_array()
            .expect("reference logits");
        let want: Vec<f64> = letter_ids
            .iter()
            .map(|&id| full[id as usize].as_f64().expect("logit"))
            .collect();
        let d = max_abs_diff(got, &want);
        worst = worst.max(d);
        assert!(
            d < 1e-3,
            "prompt {index}: letter logits differ from transformers by {d}"
        );

        // Read alone, the prompt gets bit for bit the letter logits it got in the batch: the decoder is
        // batch-invariant by construction (the product's exactness promise).
        let alone = model
            .letter_logits(std::slice::from_ref(prompt))
            .expect("single read-out");
        assert_eq!(&alone.logits[0], got, "prompt {index}: alone vs batched");
    }
    assert_eq!(together.input_tokens, total_tokens);
    assert_eq!(together.output_tokens, 0);
    eprintln!("letter logits vs transformers: max |Δ| {worst:.2e}");
}

#[test]
fn decide_reads_the_probabilities_off_the_letter_logits() {
    let (mut model, config) = load("tiny-Q8_0.gguf", 4096);
    let body =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/request.json"))
            .expect("examples/request.json");
    let request =
        DecisionRequest::parse(&body, &RequestDefaults::default()).expect("valid request");
    let response = decide(&request, &config, &mut model).expect("decided");
    let json = serde_json::to_value(&response).expect("serializes");

    // Recompute each answer from the model's letter logits of the rendered prompts.
    let rendered = prism_decision::render_request(&request, &config).expect("renders");
    let prompts: Vec<LetterPrompt> = rendered.iter().flat_map(|q| q.prompts.clone()).collect();
    let read = model.letter_logits(&prompts).expect("read-out");
    for (question, logits) in rendered.iter().zip(&read.logits) {
        let t = config.temperature(question.kind);
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = logits.iter().map(|l| ((l - max) / t).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let probs: Vec<f64> = exps.iter().map(|e| e / sum).collect();
        let answer = &json["answers"][&question.name];
        match question.kind.as_str() {
            "noul" => {
                let p_yes = answer["noul"].as_f64().expect("noul");
                assert!(
                    (p_yes - probs[0]).abs() < 1e-12,
                    "{}: {p_yes} vs {}",
                    question.name,
                    probs[0]
                );
            }
            _ => {
                let table = answer["probabilities"].as_object().expect("probabilities");
                assert_eq!(table.len(), probs.len());
                for (p, (_, got)) in probs.iter().zip(table) {
                    assert!(
                        (p - got.as_f64().expect("p")).abs() < 1e-12,
                        "{}",
                        question.name
                    );
                }
            }
        }
    }
    assert_eq!(
        json["usage"]["input_tokens"].as_u64(),
        Some(read.input_tokens)
    );
    assert_eq!(json["model"], "Qwen35 Tiny");
}

#[test]
fn a_prompt_over_the_limit_is_refused_naming_its_question() {
    let (mut model, config) = load("tiny-Q8_0.gguf", 100);
    let body = br#"{"state": "short", "questions": {
        "fits": {"type": "noul", "instructions": "Ok?"},
        "long": {"type": "noul", "instructions": "Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok? Ok?"}}}"#;
    let request = DecisionRequest::parse(body, &RequestDefaults::default()).expect("valid request");
    let error = decide(&request, &config, &mut model).expect_err("too long");
    assert_eq!(error.status(), 422);
    let body = serde_json::to_string(&error.body()).expect("error body");
    assert!(body.contains("long"), "{body}");
}

#[test]
fn load_errors_name_what_is_wrong() {
    let missing = source("no-such.gguf", None);
    match DecoderLetterModel::load(&missing, &LoadOptions::default(), 100) {
        Err(EngineError::Gguf { path, .. }) => assert!(path.ends_with("no-such.gguf")),
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a missing file loaded"),
    }

    // A decision_config.json whose letter ids disagree with the tokenizer is refused at load.
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-engine-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
    ] {
        std::fs::copy(fixture_dir().join(name), dir.join(name)).expect("copy fixture file");
    }
    let (model, _) = load("tiny-Q8_0.gguf", 100);
    let mut ids: Vec<u32> = model.prompt_format().letter_ids().to_vec();
    ids.swap(0, 1);
    std::fs::write(
        dir.join("decision_config.json"),
        serde_json::json!({ "letter_token_ids": ids }).to_string(),
    )
    .expect("write config");
    let source = source("tiny-Q8_0.gguf", Some(dir.clone()));
    let result = DecoderLetterModel::load(&source, &LoadOptions::default(), 100);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Err(EngineError::LetterTokenIds(e)) => {
            let message = e.to_string();
            assert!(message.contains('A') || message.contains('B'), "{message}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("mismatched letter ids loaded"),
    }
}

/// prompts.json batch A (prompts 4-7): four questions on one evidence of 286 shared tokens.
fn batch_a() -> Vec<LetterPrompt> {
    let batch: Vec<LetterPrompt> = fixture_prompts()
        .into_iter()
        .filter(|(i, _)| (4..=7).contains(i))
        .map(|(_, p)| p)
        .collect();
    assert_eq!(batch.len(), 4);
    batch
}

#[test]
fn questions_sharing_evidence_read_the_same_alone_or_together() {
    // prompts.json batch A (prompts 4-7) shares 286 tokens of evidence: the engine runs it once and
    // branches. Each question must read exactly what it reads alone, whatever else is in the batch.
    let (mut model, _) = load("tiny-Q8_0.gguf", 4096);
    let batch = batch_a();
    let together = model.letter_logits(&batch).expect("batch read-out");
    let reversed: Vec<LetterPrompt> = batch.iter().rev().cloned().collect();
    let backwards = model
        .letter_logits(&reversed)
        .expect("reversed batch read-out");
    for (i, prompt) in batch.iter().enumerate() {
        let alone = model
            .letter_logits(std::slice::from_ref(prompt))
            .expect("single read-out");
        assert_eq!(
            alone.logits[0], together.logits[i],
            "prompt {i} alone vs together"
        );
        assert_eq!(
            backwards.logits[batch.len() - 1 - i],
            together.logits[i],
            "prompt {i} in reverse order"
        );
    }
}

#[test]
fn a_pass_reads_the_same_wherever_the_evidence_is_cut() {
    // Batch A's four prompts share 286 tokens. Cut the evidence short of that (at 256, a chunk
    // boundary of the delta rule, or at 0) and the decoder runs the branches' shared tokens once, as an
    // item they continue: every question must read what it reads alone (one sequence) and with the
    // evidence cut at its end.
    let (mut model, _) = load("tiny-Q8_0.gguf", 4096);
    let tokens = batch_a_tokens(&model);
    let common = (0..tokens[0].len())
        .take_while(|&j| tokens.iter().all(|t| t.get(j) == tokens[0].get(j)))
        .count();
    assert!(common > 256 && common % 64 != 0, "{common} shared tokens");
    let read = |model: &mut DecoderLetterModel, cut: usize, together: bool| -> Vec<Vec<f64>> {
        let branches = |range: std::ops::Range<usize>| -> Vec<Branch<'_>> {
            range
                .map(|i| Branch {
                    tokens: &tokens[i][cut..],
                    letters: 26,
                })
                .collect()
        };
        let groups: Vec<GroupInput<'_, _>> = if together {
            vec![group(&tokens[0][..cut], branches(0..tokens.len()))]
        } else {
            (0..tokens.len())
                .map(|i| group(&tokens[i][..cut], branches(i..i + 1)))
                .collect()
        };
        model
            .run_pass(&groups)
            .expect("pass")
            .into_iter()
            .flat_map(|g| g.logits)
            .collect()
    };
    let alone = read(&mut model, 0, false);
    assert_eq!(alone.len(), 4);
    for (cut, together) in [(256, true), (256, false), (common, true), (0, true)] {
        assert_eq!(
            read(&mut model, cut, together),
            alone,
            "evidence cut at {cut}, questions together: {together}"
        );
    }
    // From the evidence's saved state (a prefix-cache hit): the branches alone, sharing their tail.
    let mut evidence = group(&tokens[0][..256], Vec::new());
    evidence.want_state = true;
    let saved = model.run_pass(&[evidence]).expect("evidence pass")[0]
        .state
        .take()
        .expect("the evidence's state");
    let branches: Vec<Branch<'_>> = tokens
        .iter()
        .map(|t| Branch {
            tokens: &t[256..],
            letters: 26,
        })
        .collect();
    let mut cached = group(&[], branches);
    cached.start = Some(&saved);
    let from_cache: Vec<Vec<f64>> = model.run_pass(&[cached]).expect("pass")[0].logits.clone();
    assert_eq!(from_cache, alone, "from the saved evidence");
}

#[test]
fn a_group_of_one_question_keeps_the_evidence_state_its_prefix_leaves() {
    // A group of one branch runs as one decoder item with a snapshot at the prefix's end: its question
    // must read what it reads alone, and the state handed back (the prefix cache's entry) must be the
    // evidence's own — so every other question continued from it reads what it reads alone. Cuts
    // inside the conv window's reach, inside a delta-rule chunk and on a chunk boundary.
    let (mut model, _) = load("tiny-Q8_0.gguf", 4096);
    let tokens = batch_a_tokens(&model);
    let alone: Vec<Vec<f64>> = tokens
        .iter()
        .map(|t| {
            let branch = Branch {
                tokens: t,
                letters: 26,
            };
            model.run_pass(&[group(&[], vec![branch])]).expect("pass")[0].logits[0].clone()
        })
        .collect();
    for cut in [2, 100, 256] {
        for (i, t) in tokens.iter().enumerate() {
            let mut one = group(
                &t[..cut],
                vec![Branch {
                    tokens: &t[cut..],
                    letters: 26,
                }],
            );
            one.want_state = true;
            let mut out = model.run_pass(&[one]).expect("pass");
            assert_eq!(
                out[0].logits,
                vec![alone[i].clone()],
                "cut {cut}, question {i}"
            );
            let evidence = out[0].state.take().expect("the evidence state");
            assert_eq!(evidence.n_tokens(), cut);
            let branches: Vec<Branch<'_>> = tokens
                .iter()
                .map(|t| Branch {
                    tokens: &t[cut..],
                    letters: 26,
                })
                .collect();
            let mut follow_up = group(&[], branches);
            follow_up.start = Some(&evidence);
            let read = model.run_pass(&[follow_up]).expect("pass")[0]
                .logits
                .clone();
            assert_eq!(
                read, alone,
                "cut {cut}: every question from question {i}'s evidence"
            );
        }
    }
}

/// Batch A's prompts as the decoder reads them.
fn batch_a_tokens(model: &DecoderLetterModel) -> Vec<Vec<u32>> {
    batch_a()
        .iter()
        .map(|p| model.prompt_tokens(p).expect("tokenizes"))
        .collect()
}

fn group<'a>(prefix: &'a [u32], branches: Vec<Branch<'a>>) -> GroupInput<'a, SequenceState> {
    GroupInput {
        start: None,
        prefix,
        branches,
        want_state: false,
        want_logits: None,
        images: None,
    }
}

#[test]
fn the_gguf_alone_serves_the_same_read_out() {
    // Without a model directory the tokenizer and chat template come from the GGUF's own metadata.
    let source = source("tiny-Q8_0.gguf", None);
    let mut alone = DecoderLetterModel::load(&source, &LoadOptions::default(), 4096)
        .expect("loads")
        .model;
    let (mut with_dir, _) = load("tiny-Q8_0.gguf", 4096);
    let prompts: Vec<LetterPrompt> = fixture_prompts()
        .into_iter()
        .take(3)
        .map(|(_, p)| p)
        .collect();
    let a = alone.letter_logits(&prompts).expect("read-out");
    let b = with_dir.letter_logits(&prompts).expect("read-out");
    assert_eq!(a.logits, b.logits);
}

/// Greedy thoughts (temperature 0) from the fixture's three thinking-on prompts are transformers'
/// greedy tokens (`ref_generate.json`, 24 each): the thinking prompt is rendered by the engine's own
/// chat template and each step's next-token logits come from the engine's pass with the thought's
/// state carried from step to step.
#[test]
fn greedy_thoughts_are_transformers_tokens() {
    let (mut model, config) = load("tiny-BF16.gguf", 4096);
    let reference = read_json("ref_generate.json");
    let prompts = fixture_prompts();
    let mut requests = Vec::new();
    let mut wants = Vec::new();
    for generation in reference["generations"].as_array().expect("generations") {
        let from = generation["from_prompt"].as_u64().expect("from_prompt") as usize;
        let (_, prompt) = prompts
            .iter()
            .find(|(i, _)| *i == from)
            .expect("the thinking prompt's conversation");
        let want: Vec<u32> = generation["generated_ids"]
            .as_array()
            .expect("generated_ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        requests.push(prism_decision::ThoughtRequest {
            question: generation["name"].as_str().unwrap_or("q").to_string(),
            prompt: prompt.clone(),
            budget: want.len(),
            seed: Some(1),
            sampling: prism_decision::config::SamplingConfig {
                temperature: 0.0,
                ..config.thought_sampling.clone()
            },
            loop_detector: config.loop_detector.clone(),
        });
        wants.push(want);
    }
    assert_eq!(requests.len(), 3);
    // All three decoded together (one pass per step), then each alone: the same tokens.
    let together = model.think(&requests).expect("thoughts");
    for ((outcome, want), request) in together.iter().zip(&wants).zip(&requests) {
        assert_eq!(&outcome.tokens, want, "{}", request.question);
        assert_eq!(outcome.stop, prism_decision::thought::StopReason::Budget);
        assert_eq!(outcome.logits.len(), 26);
        let alone = model.think(std::slice::from_ref(request)).expect("alone");
        assert_eq!(alone[0], *outcome_without_time(outcome, &alone[0]));
    }
}

/// `outcome` with `other`'s wall time (the only field allowed to differ between two runs).
fn outcome_without_time<'a>(
    outcome: &prism_decision::ThoughtOutcome,
    other: &'a prism_decision::ThoughtOutcome,
) -> &'a prism_decision::ThoughtOutcome {
    let mut same = outcome.clone();
    same.ms = other.ms;
    assert_eq!(&same, other);
    other
}

/// A sampled thought (the release's sampling settings, v1.1 AutoThink) through the engine: the same
/// request gets the same thought and the same bits alone, again, and among other thinking requests.
#[test]
fn sampled_thoughts_are_the_same_alone_and_among_others() {
    use prism_decision::engine::{Engine, EngineOptions};
    let (model, mut config) = load("tiny-Q8_0.gguf", 4096);
    config.family = prism_decision::Family::AutoThink;
    let encoder = model.encoder();
    let (engine, worker) =
        Engine::start(model, encoder, config, EngineOptions::default(), None).expect("engine");
    let body = |state: &str, seed: &str| {
        format!(
            r#"{{"state": {state:?}, "think_mode": "always", "think_budget": 20, "return_thought": true{seed},
               "questions": {{"renew": {{"type": "choice", "instructions": "Should we renew?",
                 "criteria": {{"yes": "Renew", "no": "Do not renew"}}}},
                 "late": {{"type": "noul", "instructions": "Was it late?"}}}}}}"#
        )
    };
    let parse = |text: String| {
        DecisionRequest::parse(text.as_bytes(), &RequestDefaults::default()).expect("request")
    };
    let mine = parse(body("The supplier missed two deadlines.", ""));
    let answer = |r: &prism_decision::DecisionResponse| serde_json::to_value(&r.answers).unwrap();
    let alone = engine.decide(mine.clone(), None).expect("alone").response;
    let again = engine.decide(mine.clone(), None).expect("again").response;
    assert_eq!(answer(&alone), answer(&again));
    assert!(alone.usage.output_tokens > 0);
    let json = answer(&alone);
    let thought = json["renew"]["thought"].as_str().expect("a thought");
    assert!(!thought.is_empty());
    // Among others (different evidence, seeds and questions), submitted at once.
    let mut receivers = Vec::new();
    let others = [
        ("A parcel arrived crushed.", r#", "seed": 3"#),
        ("The invoice was paid twice.", ""),
        ("The supplier missed two deadlines.", r#", "seed": 11"#),
    ];
    for (state, seed) in others {
        receivers.push(submit_with(
            &engine,
            parse(body(state, seed)),
            None,
            Default::default(),
        ));
    }
    let among = engine.decide(mine, None).expect("among").response;
    assert_eq!(answer(&among), answer(&alone));
    for rx in receivers {
        rx.recv().expect("reply").expect("answered");
    }
    // A request seed gives another thought than the prompt-derived one.
    let seeded = engine
        .decide(
            parse(body(
                "The supplier missed two deadlines.",
                r#", "seed": 11"#,
            )),
            None,
        )
        .expect("seeded")
        .response;
    assert_ne!(
        answer(&seeded)["renew"]["thought"],
        json["renew"]["thought"]
    );
    drop(engine);
    worker.join();
}

/// A sampled thought through the engine's pass (next-token candidates picked on the device in blocks)
/// has the tokens of a plain loop that samples each whole row of logits with the same seed: the
/// candidates always hold the sampler's `top_k` best. `top_k` 3 here, so that only a few of the tiny
/// vocabulary's 17 blocks come back.
#[test]
fn sampled_thought_tokens_are_those_of_the_whole_rows() {
    use prism_decision::chat_template::ChatMessage;
    use prism_decision::thought::Sampler;
    let (mut model, config) = load("tiny-Q8_0.gguf", 4096);
    let (_, prompt) = fixture_prompts()[0].clone();
    let sampling = prism_decision::config::SamplingConfig {
        top_k: 3,
        ..config.thought_sampling.clone()
    };
    let budget = 40;
    let request = prism_decision::ThoughtRequest {
        question: "q".into(),
        prompt: prompt.clone(),
        budget,
        seed: Some(42),
        sampling: sampling.clone(),
        loop_detector: config.loop_detector.clone(),
    };
    let outcome = model.think(&[request]).expect("thought").remove(0);

    let format = model.prompt_format();
    let messages = [
        ChatMessage::system(prompt.system.as_str()),
        ChatMessage::user(prompt.user.as_str()),
    ];
    let tokens = format
        .render_and_encode(&messages, true)
        .expect("thinking prompt")
        .ids;
    let end_think = format.special_tokens().end_think.expect("</think>");
    let decoder = model.decoder();
    let mut state = decoder.new_state().expect("state");
    let mut hidden = decoder.prefill(&mut state, &tokens).expect("prefill");
    let mut sampler = Sampler::new(sampling, 42);
    let mut want = Vec::new();
    loop {
        let row: Vec<f32> = decoder
            .logits(&hidden)
            .and_then(|l| Ok(l.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?))
            .expect("logits")
            .remove(0);
        let token = sampler.sample(&row).expect("a token");
        want.push(token);
        if token == end_think || format.eos_ids().contains(&token) || want.len() >= budget {
            break;
        }
        hidden = decoder.prefill(&mut state, &[token]).expect("decode");
    }
    assert_eq!(outcome.tokens, want);
    assert!(want.len() >= 5, "{want:?}");
}
