//! The decision procedure through `decide` with fake models: batching, single-option and wide choices,
//! answers and their JSON shape, refusals and model failures.

mod common;

use common::{rel_diff, FixedModel, ShaModel};
use prism_decision::readout::softmax;
use prism_decision::{
    decide, Answer, DecisionConfig, DecisionError, DecisionRequest, LetterLogits, LetterModel,
    LetterPrompt, ModelError, RequestDefaults,
};

fn request(body: &str) -> DecisionRequest {
    DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

const THREE_QUESTIONS: &str = r#"{"state": {"ticket": "I was charged twice", "amount": 12.5},
    "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Payments", "tech": null, "sales": "Deals"}},
        "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        "risk": {"type": "score", "instructions": "How risky?", "criteria": ["low", {"level": "mid"}, "high", "critical"]}
    }}"#;

#[test]
fn three_questions_in_one_model_call() {
    let mut config = DecisionConfig::default();
    config.temperature_by_type.choice = 0.5;
    config.temperature_by_type.noul = 2.0;
    config.temperature_by_type.score = 1.25;
    let logits = vec![1.0, 3.0, -0.5, 0.25];
    let mut model = FixedModel {
        logits: logits.clone(),
        calls: 0,
    };
    let response = decide(&request(THREE_QUESTIONS), &config, &mut model).unwrap();
    assert_eq!(model.calls, 1);
    assert_eq!(response.usage.input_tokens, 30);
    assert_eq!(response.usage.output_tokens, 0);
    assert_eq!(response.model, "fixed-fake");
    assert_eq!(
        response.answers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        ["team", "urgent", "risk"]
    );

    // Softmax of logits / temperature, written out here independently of the crate.
    let expect = |n: usize, t: f64| -> Vec<f64> {
        let e: Vec<f64> = logits[..n].iter().map(|l| (l / t).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    };
    let Some(Answer::Choice(team)) = response.answers.get("team") else {
        panic!()
    };
    let p = expect(3, 0.5);
    assert_eq!(team.choice.as_deref(), Some("tech"));
    for (id, want) in ["billing", "tech", "sales"].iter().zip(&p) {
        assert!(rel_diff(*team.probabilities.get(id).unwrap(), *want) < 1e-14);
    }
    assert!(rel_diff(team.confidence, (p[1] - 1.0 / 3.0) / (2.0 / 3.0)) < 1e-14);
    assert!(team.none_probability.is_none() && team.details.is_none());

    let Some(Answer::Noul(urgent)) = response.answers.get("urgent") else {
        panic!()
    };
    assert!(rel_diff(urgent.noul, expect(2, 2.0)[0]) < 1e-14);

    let Some(Answer::Score(risk)) = response.answers.get("risk") else {
        panic!()
    };
    let p = expect(4, 1.25);
    let score: f64 = p.iter().enumerate().map(|(i, q)| i as f64 * q).sum();
    assert!(rel_diff(risk.score, score) < 1e-14);
    // Mode is level 1; D_uniform for 4 levels around 1.5 is 1.
    let d_mode = p[0] + p[2] + 2.0 * p[3];
    let want = (1.0 - d_mode).max(0.0);
    assert!(
        want > 0.1 && (risk.confidence - want).abs() < 1e-14,
        "{} vs {want}",
        risk.confidence
    );
    assert_eq!(
        risk.legend.get("1").unwrap().dumps(),
        "{\"level\": \"mid\"}"
    );
}

#[test]
fn response_json_shape() {
    let mut model = FixedModel {
        logits: vec![0.0, 1.0, 2.0, 3.0],
        calls: 0,
    };
    let response = decide(
        &request(THREE_QUESTIONS),
        &DecisionConfig::default(),
        &mut model,
    )
    .unwrap();
    let json = serde_json::to_value(&response).unwrap();
    let keys = |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&json), ["answers", "usage", "model", "x_latency_ms"]);
    assert_eq!(keys(&json["answers"]), ["team", "urgent", "risk"]);
    assert_eq!(
        keys(&json["answers"]["team"]),
        ["type", "choice", "confidence", "probabilities"]
    );
    assert_eq!(
        keys(&json["answers"]["team"]["probabilities"]),
        ["billing", "tech", "sales"]
    );
    assert_eq!(json["answers"]["team"]["type"], "choice");
    assert_eq!(json["answers"]["team"]["choice"], "sales");
    assert_eq!(keys(&json["answers"]["urgent"]), ["type", "noul"]);
    assert_eq!(
        keys(&json["answers"]["risk"]),
        ["type", "score", "confidence", "legend", "probabilities"]
    );
    assert_eq!(
        json["answers"]["risk"]["legend"],
        serde_json::json!({"0": "low", "1": {"level": "mid"}, "2": "high", "3": "critical"})
    );
    assert_eq!(
        keys(&json["answers"]["risk"]["probabilities"]),
        ["0", "1", "2", "3"]
    );
    assert_eq!(
        json["usage"],
        serde_json::json!({"input_tokens": 30, "output_tokens": 0})
    );
    assert!(json["x_latency_ms"].as_f64().unwrap() >= 0.0);
}

#[test]
fn details_on_request() {
    let body = THREE_QUESTIONS.replacen('{', r#"{"return_details": true, "#, 1);
    let mut model = FixedModel {
        logits: vec![0.0, 1.0, 2.0, 3.0],
        calls: 0,
    };
    let response = decide(&request(&body), &DecisionConfig::default(), &mut model).unwrap();
    let json = serde_json::to_value(&response).unwrap();
    assert_eq!(json["answers"]["urgent"]["x_details"]["prompts"], 1);
    let first = &json["answers"]["urgent"]["x_details"]["first"];
    assert_eq!(
        first.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["true", "false"]
    );
    assert_eq!(first["true"], json["answers"]["urgent"]["noul"]);
}

#[test]
fn a_single_option_answers_itself_without_the_model() {
    let body = r#"{"state": "s", "questions": {"only": {"type": "choice", "instructions": "x", "criteria": {"yes": "the one"}}}}"#;
    let mut model = ShaModel::default();
    let response = decide(&request(body), &DecisionConfig::default(), &mut model).unwrap();
    assert!(model.calls.is_empty());
    let Some(Answer::Choice(answer)) = response.answers.get("only") else {
        panic!()
    };
    assert_eq!(
        (answer.choice.as_deref(), answer.confidence),
        (Some("yes"), 1.0)
    );
    assert_eq!(answer.probabilities.0, vec![("yes".to_string(), 1.0)]);
    assert_eq!(response.usage.input_tokens, 0);
}

#[test]
fn wide_choices_share_calls_with_other_questions() {
    let ids: Vec<String> = (0..60).map(|i| format!("\"item-{i}\"")).collect();
    let body = format!(
        r#"{{"state": "catalogue", "questions": {{
            "pick": {{"type": "choice", "instructions": "Which item?", "criteria": [{}]}},
            "ok": {{"type": "noul", "instructions": "Fine?"}}}}}}"#,
        ids.join(", ")
    );
    let mut model = ShaModel::default();
    let response = decide(&request(&body), &DecisionConfig::default(), &mut model).unwrap();
    // Call 1: 3 groups of 20 plus the noul; call 2: the final round of 9.
    let sizes: Vec<Vec<usize>> = model
        .calls
        .iter()
        .map(|c| c.iter().map(|p| p.option_ids.len()).collect())
        .collect();
    assert_eq!(sizes, vec![vec![20, 20, 20, 2], vec![9]]);
    // Group prompts show their own options, lettered from A, under the same evidence and question.
    let first_group = &model.calls[0][0];
    assert!(first_group.user.starts_with(
        "Evidence:\ncatalogue\n\nQuestion: Which item?\nOptions:\nA) item-0\nB) item-1\n"
    ));
    assert_eq!(first_group.option_ids[19], "item-19");
    // The final round keeps the finalists in their original order.
    let finalists = &model.calls[1][0].option_ids;
    let mut sorted = finalists.clone();
    sorted.sort_by_key(|id| id[5..].parse::<usize>().unwrap());
    assert_eq!(finalists, &sorted);
    let Some(Answer::Choice(pick)) = response.answers.get("pick") else {
        panic!()
    };
    let total: f64 = pick.probabilities.iter().map(|(_, p)| p).sum();
    assert!((total - 1.0).abs() < 1e-12);
    // Finalists carry 1 - residual; the rest share the residual.
    let finalist_mass: f64 = finalists
        .iter()
        .map(|id| pick.probabilities.get(id).unwrap())
        .sum();
    assert!((finalist_mass - 0.999).abs() < 1e-12);
    assert!(pick.choice.as_ref().is_some_and(|c| finalists.contains(c)));
}

#[test]
fn unsupported_features_are_refused_not_faked() {
    let mut model = ShaModel::default();
    let with_image = THREE_QUESTIONS.replacen('{', r#"{"images": ["aGVsbG8="], "#, 1);
    let error = decide(
        &request(&with_image),
        &DecisionConfig::default(),
        &mut model,
    )
    .unwrap_err();
    assert_eq!(error.status(), 422);
    assert_eq!(error.field_errors()[0].path.to_string(), "images");
    // A v1 model does not think.
    let thinking = THREE_QUESTIONS.replacen('{', r#"{"think_mode": "always", "#, 1);
    let error = decide(&request(&thinking), &DecisionConfig::default(), &mut model).unwrap_err();
    assert_eq!(error.status(), 422);
    assert_eq!(error.field_errors()[0].path.to_string(), "think_mode");
    assert!(error.to_string().contains("does not think"), "{error}");
    assert!(model.calls.is_empty());
    // A v1.1 AutoThink release served by a read-out-only model cannot think either.
    let autothink = DecisionConfig {
        family: prism_decision::Family::AutoThink,
        ..DecisionConfig::default()
    };
    let error = decide(&request(&thinking), &autothink, &mut model).unwrap_err();
    assert_eq!(error.status(), 422);
    assert_eq!(error.field_errors()[0].path.to_string(), "think_mode");
    assert!(
        error.to_string().contains("cannot decode thoughts"),
        "{error}"
    );
    // "never" and the default "auto" give the single read-out.
    let never = THREE_QUESTIONS.replacen('{', r#"{"think_mode": "never", "#, 1);
    assert!(decide(&request(&never), &DecisionConfig::default(), &mut model).is_ok());
}

/// How a `FailingModel` answers a pass.
type Answering = fn(&[LetterPrompt]) -> Result<LetterLogits, ModelError>;

/// A model that fails in a chosen way.
struct FailingModel(Answering);

impl LetterModel for FailingModel {
    fn model_name(&self) -> &str {
        "failing"
    }
    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        (self.0)(prompts)
    }
}

#[test]
fn model_failures() {
    let config = DecisionConfig::default();
    let request = request(THREE_QUESTIONS);
    // A prompt too long for the server: 422 naming its question.
    let mut model = FailingModel(|_| {
        Err(ModelError::PromptTooLong {
            prompt: 2,
            tokens: 9000,
            limit: 8192,
        })
    });
    let error = decide(&request, &config, &mut model).unwrap_err();
    assert_eq!(error.status(), 422);
    assert_eq!(error.field_errors()[0].path.to_string(), "questions.risk");
    let mut model = FailingModel(|_| Err(ModelError::Backend("CUDA out of memory".into())));
    let error = decide(&request, &config, &mut model).unwrap_err();
    assert!(matches!(error, DecisionError::Model(_)));
    assert_eq!(error.status(), 500);
    // Wrong shapes (a prompt without logits; two logits where a prompt has more letters) and
    // non-finite logits are errors, not answers.
    let wrong_shapes: [Answering; 2] = [
        |p| {
            Ok(LetterLogits {
                logits: vec![vec![0.0; 2]; p.len() - 1],
                ..Default::default()
            })
        },
        |p| {
            Ok(LetterLogits {
                logits: vec![vec![0.0; 2]; p.len()],
                ..Default::default()
            })
        },
    ];
    for shape in wrong_shapes {
        assert!(matches!(
            decide(&request, &config, &mut FailingModel(shape)),
            Err(DecisionError::ModelOutput(_))
        ));
    }
    let mut model = FailingModel(|p| {
        Ok(LetterLogits {
            logits: p
                .iter()
                .map(|p| vec![f64::NAN; p.option_ids.len()])
                .collect(),
            ..Default::default()
        })
    });
    assert!(matches!(
        decide(&request, &config, &mut model),
        Err(DecisionError::NonFiniteLogits { .. })
    ));
}

/// A model whose logits are all 0.5 but one, at (`prompt`, `letter`), which is `value`.
struct OneBadLogit {
    prompt: usize,
    letter: usize,
    value: f64,
}

impl LetterModel for OneBadLogit {
    fn model_name(&self) -> &str {
        "one-bad-logit"
    }
    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        let mut logits: Vec<Vec<f64>> = prompts
            .iter()
            .map(|p| vec![0.5; p.option_ids.len()])
            .collect();
        logits[self.prompt][self.letter] = self.value;
        Ok(LetterLogits {
            logits,
            ..Default::default()
        })
    }
}

/// A diverged forward pass (on CUDA the integer path turns a sequence's rows NaN instead of failing at
/// the projection) reaches the read-out as non-finite letter logits of that prompt only: the request is
/// refused with a typed 500 naming the question whose prompt diverged, whichever letter went bad.
#[test]
fn non_finite_letter_logits_name_their_question() {
    let config = DecisionConfig::default();
    let request = request(THREE_QUESTIONS);
    // The prompts come in question order: team (3 options), urgent (2), risk (4).
    for (prompt, letter, value, want_question) in [
        (2usize, 3usize, f64::NAN, "risk"),
        (1, 0, f64::INFINITY, "urgent"),
        (0, 1, f64::NEG_INFINITY, "team"),
    ] {
        let mut model = OneBadLogit {
            prompt,
            letter,
            value,
        };
        let error = decide(&request, &config, &mut model).unwrap_err();
        assert_eq!(error.status(), 500, "{error}");
        let message = error.to_string();
        match &error {
            DecisionError::NonFiniteLogits {
                question,
                prompt: got_prompt,
                logits,
            } => {
                assert_eq!(
                    (question.as_str(), *got_prompt),
                    (want_question, prompt),
                    "{message}"
                );
                assert_eq!(logits[letter].to_bits(), value.to_bits(), "{logits:?}");
                assert_eq!(
                    logits.iter().filter(|l| l.is_finite()).count(),
                    logits.len() - 1,
                    "{logits:?}"
                );
            }
            other => panic!("expected NonFiniteLogits, got {other:?}"),
        }
        assert!(
            message.contains(&format!("question {want_question:?}")),
            "{message}"
        );
        assert!(message.contains("not finite"), "{message}");
    }
    // The same model with every logit finite answers.
    let mut model = OneBadLogit {
        prompt: 2,
        letter: 3,
        value: 0.5,
    };
    assert!(decide(&request, &config, &mut model).is_ok());
}

#[test]
fn the_trait_is_object_safe() {
    let mut boxed: Box<dyn LetterModel> = Box::new(FixedModel {
        logits: vec![0.0; 26],
        calls: 0,
    });
    let response = decide(
        &request(THREE_QUESTIONS),
        &DecisionConfig::default(),
        boxed.as_mut(),
    )
    .unwrap();
    let Some(Answer::Choice(team)) = response.answers.get("team") else {
        panic!()
    };
    // Equal logits: uniform probabilities, zero confidence, the first option chosen.
    assert_eq!(team.choice.as_deref(), Some("billing"));
    assert!(team.confidence.abs() < 1e-15);
    assert_eq!(softmax(&[0.0, 0.0], 1.0), [0.5, 0.5]);
}

#[test]
fn decision_config_defaults_and_checks() {
    let config: DecisionConfig =
        serde_json::from_str(r#"{"temperature_by_type": {"bool": 1.5}, "extra": 1}"#).unwrap();
    assert_eq!(config.temperature_by_type.noul, 1.5);
    assert_eq!(config.temperature_by_type.choice, 1.0);
    assert_eq!(
        (
            config.wide_choice.group,
            config.wide_choice.keep,
            config.wide_choice.residual
        ),
        (25, 3, 1e-3)
    );
    assert!(config.letter_token_ids.is_none());
    config.validate().unwrap();
    for bad in [
        r#"{"temperature_by_type": {"score": 0}}"#,
        r#"{"wide_choice": {"group": 27}}"#,
        r#"{"wide_choice": {"keep": 13}}"#,
        r#"{"wide_choice": {"residual": 1.0}}"#,
        r#"{"letter_token_ids": [1, 2, 3]}"#,
    ] {
        let config: DecisionConfig = serde_json::from_str(bad).unwrap();
        assert!(config.validate().is_err(), "{bad}");
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-decision-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(
        DecisionConfig::from_model_dir(&dir).unwrap(),
        DecisionConfig::default()
    );
    std::fs::write(
        dir.join("decision_config.json"),
        r#"{"wide_choice": {"group": 20}}"#,
    )
    .unwrap();
    assert_eq!(
        DecisionConfig::from_model_dir(&dir)
            .unwrap()
            .wide_choice
            .group,
        20
    );
    std::fs::write(
        dir.join("decision_config.json"),
        r#"{"wide_choice": {"group": "x"}}"#,
    )
    .unwrap();
    let error = DecisionConfig::from_model_dir(&dir).unwrap_err();
    assert!(
        error.to_string().contains("decision_config.json"),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
