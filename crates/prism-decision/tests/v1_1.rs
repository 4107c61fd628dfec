//! The v1.1 decision rules through `decide` with fake models: the none option and `allow_none`,
//! Instant's two orders, and AutoThink's gate and mixing.

mod common;

use common::{fixed_read_out, FixedModel, ShaModel};
use prism_decision::readout::softmax;
use prism_decision::thought::StopReason;
use prism_decision::{
    decide, Answer, DecisionConfig, DecisionRequest, Family, LetterLogits, LetterModel,
    LetterPrompt, ModelError, RequestDefaults, ThoughtOutcome, ThoughtRequest, NONE_OPTION_ID,
};

fn request(body: &str) -> DecisionRequest {
    DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

fn config(family: Family) -> DecisionConfig {
    DecisionConfig {
        family,
        ..DecisionConfig::default()
    }
}

const TEAM: &str = r#"{"state": "I was charged twice", "think_mode": "never",
    "questions": {"team": {"type": "choice", "instructions": "Which team?",
                           "criteria": {"billing": "Payments", "tech": null, "sales": "Deals"}},
                  "urgent": {"type": "noul", "instructions": "Is it urgent?"}}}"#;

fn choice(
    response: &prism_decision::DecisionResponse,
    name: &str,
) -> prism_decision::response::ChoiceAnswer {
    match response.answers.get(name) {
        Some(Answer::Choice(c)) => c.clone(),
        other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn the_none_option_is_an_extra_last_letter_of_choice_questions() {
    let mut model = ShaModel::default();
    let mut release = config(Family::AutoThink);
    release.none_option.text = "None of these teams".into();
    let response = decide(&request(TEAM), &release, &mut model).unwrap();
    let prompts = &model.calls[0];
    // The choice gets a fourth letter worded by the release; the noul does not.
    assert!(
        prompts[0]
            .user
            .ends_with("C) sales: Deals\nD) None of these teams"),
        "{}",
        prompts[0].user
    );
    assert_eq!(
        prompts[0].option_ids.last().map(String::as_str),
        Some(NONE_OPTION_ID)
    );
    assert_eq!(prompts[1].option_ids, ["true", "false"]);
    let team = choice(&response, "team");
    let none = team.none_probability.expect("none_probability");
    let listed: f64 = team.probabilities.iter().map(|(_, p)| p).sum();
    assert!((listed + none - 1.0).abs() < 1e-12);
    assert_eq!(team.probabilities.len(), 3);

    // v1 and none_check off: no none option.
    for (body, family) in [
        (TEAM.to_string(), Family::V1),
        (
            TEAM.replacen('{', r#"{"none_check": false, "#, 1),
            Family::AutoThink,
        ),
    ] {
        let mut model = ShaModel::default();
        let response = decide(&request(&body), &config(family), &mut model).unwrap();
        assert!(model.calls[0][0].user.ends_with("C) sales: Deals"));
        assert_eq!(choice(&response, "team").none_probability, None);
    }
}

#[test]
fn allow_none_gives_a_null_choice_when_none_is_the_most_likely() {
    // Letters A, B, C, D(none): none is the most likely.
    let logits = vec![0.5, 1.0, 0.0, 2.0];
    let mut model = FixedModel {
        logits: logits.clone(),
        calls: 0,
    };
    let release = config(Family::AutoThink);
    let response = decide(&request(TEAM), &release, &mut model).unwrap();
    let team = choice(&response, "team");
    let p = softmax(&logits, 1.0);
    assert_eq!(team.choice, None);
    assert_eq!(team.none_probability, Some(p[3]));
    assert!((team.confidence - (p[3] - 0.25) / 0.75).abs() < 1e-12);
    let json = serde_json::to_value(&response).unwrap();
    assert!(json["answers"]["team"]["choice"].is_null());

    // allow_none off: the most likely listed option, its confidence among the four letters (0 here:
    // it is less likely than an even spread).
    let body = TEAM.replacen('{', r#"{"allow_none": false, "#, 1);
    let response = decide(&request(&body), &release, &mut model).unwrap();
    let team = choice(&response, "team");
    assert_eq!(team.choice.as_deref(), Some("tech"));
    assert!(p[1] < 0.25);
    assert_eq!(team.confidence, 0.0);
    assert_eq!(team.none_probability, Some(p[3]));
}

#[test]
fn a_one_option_choice_is_read_against_none_and_wide_choice_keeps_working() {
    let one = r#"{"state": "s", "think_mode": "never", "questions": {"only": {"type": "choice",
        "instructions": "Is it this?", "criteria": ["the one"]}}}"#;
    let mut model = ShaModel::default();
    let response = decide(&request(one), &config(Family::AutoThink), &mut model).unwrap();
    assert_eq!(model.calls.len(), 1);
    assert_eq!(model.calls[0][0].option_ids.len(), 2);
    assert!(choice(&response, "only").none_probability.is_some());

    let ids: Vec<String> = (0..40).map(|i| format!("\"team_{i}\"")).collect();
    let wide = format!(
        r#"{{"state": "s", "think_mode": "never", "questions": {{"pick": {{"type": "choice",
            "instructions": "Which?", "criteria": [{}]}}}}}}"#,
        ids.join(", ")
    );
    let mut model = ShaModel::default();
    let response = decide(&request(&wide), &config(Family::AutoThink), &mut model).unwrap();
    // 41 letters: two groups, then a final round; the none option is the last letter of its prompts.
    assert_eq!(model.calls.len(), 2);
    for prompt in model.calls.iter().flatten() {
        if let Some(at) = prompt.option_ids.iter().position(|id| id == NONE_OPTION_ID) {
            assert_eq!(at, prompt.option_ids.len() - 1);
        }
    }
    let pick = choice(&response, "pick");
    let total: f64 =
        pick.probabilities.iter().map(|(_, p)| p).sum::<f64>() + pick.none_probability.unwrap();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
}

#[test]
fn instant_reads_both_orders_and_averages_per_option() {
    // Logits that depend on the letter position only: the two orders disagree, and the answer is
    // their average per option.
    let logits = vec![2.0, 1.0, 0.0, -1.0];
    let mut model = FixedModel {
        logits: logits.clone(),
        calls: 0,
    };
    let response = decide(&request(TEAM), &config(Family::Instant), &mut model).unwrap();
    assert_eq!(model.calls, 1);
    let p = softmax(&logits, 1.0);
    let team = choice(&response, "team");
    // Given order: billing, tech, sales, none; reversed: sales, tech, billing, none.
    let want = [
        (p[0] + p[2]) / 2.0,
        (p[1] + p[1]) / 2.0,
        (p[2] + p[0]) / 2.0,
    ];
    for ((_, got), want) in team.probabilities.iter().zip(want) {
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
    }
    assert_eq!(team.none_probability, Some(p[3]));
    let two = softmax(&logits[..2], 1.0);
    let Some(Answer::Noul(urgent)) = response.answers.get("urgent") else {
        panic!("noul");
    };
    assert!((urgent.noul - (two[0] + two[1]) / 2.0).abs() < 1e-15);

    // The prompts: each question twice, the second reversed with none kept last.
    let mut model = ShaModel::default();
    let response = decide(&request(TEAM), &config(Family::Instant), &mut model).unwrap();
    let prompts = &model.calls[0];
    assert_eq!(prompts.len(), 4);
    assert_eq!(prompts[0].option_ids[..3], ["billing", "tech", "sales"]);
    assert_eq!(prompts[1].option_ids[..3], ["sales", "tech", "billing"]);
    assert_eq!(prompts[1].option_ids[3], NONE_OPTION_ID);
    assert_eq!(prompts[3].option_ids, ["false", "true"]);
    // Logits that follow the option (not the position) give the same answer in both orders: the
    // reversed read-out is mapped back to its options.
    let mut once = ShaModel::default();
    let autothink = decide(&request(TEAM), &config(Family::AutoThink), &mut once).unwrap();
    assert_eq!(
        choice(&response, "team").probabilities,
        choice(&autothink, "team").probabilities
    );
    // Instant does not think.
    let always = TEAM.replace(r#""think_mode": "never""#, r#""think_mode": "always""#);
    let error = decide(
        &request(&always),
        &config(Family::Instant),
        &mut ShaModel::default(),
    )
    .unwrap_err();
    assert_eq!(error.status(), 422);
}

/// First read-outs from fixed logits; thoughts return other fixed logits.
struct Thinker {
    first: Vec<f64>,
    after: Vec<f64>,
    thoughts: Vec<ThoughtRequest>,
}

impl LetterModel for Thinker {
    fn model_name(&self) -> &str {
        "thinker"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        Ok(fixed_read_out(&self.first, prompts))
    }

    fn think(&mut self, thoughts: &[ThoughtRequest]) -> Result<Vec<ThoughtOutcome>, ModelError> {
        self.thoughts.extend_from_slice(thoughts);
        Ok(thoughts
            .iter()
            .map(|t| ThoughtOutcome {
                logits: self.after[..t.prompt.option_ids.len()].to_vec(),
                tokens: vec![1; 7],
                text: format!("thinking about {}", t.question),
                stop: StopReason::EndOfThought,
                input_tokens: 12,
                ms: 1.0,
            })
            .collect())
    }
}

const URGENT: &str =
    r#"{"state": "s", "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}"#;

fn noul_with(extra: &str, model: &mut Thinker) -> prism_decision::DecisionResponse {
    let body = format!("{URGENT}, {extra}}}");
    decide(&request(&body), &config(Family::AutoThink), model).unwrap()
}

#[test]
fn autothink_thinks_below_the_gate_and_mixes_the_read_outs() {
    let first = vec![1.0, 0.0]; // P(yes) = 0.731
    let after = vec![-1.0, 1.0]; // P(yes) = 0.119
    let thinker = || Thinker {
        first: first.clone(),
        after: after.clone(),
        thoughts: Vec::new(),
    };
    let p_first = softmax(&first, 1.0)[0];
    let p_after = softmax(&after, 1.0)[0];
    let noul = |r: &prism_decision::DecisionResponse| match r.answers.get("urgent") {
        Some(Answer::Noul(n)) => n.clone(),
        other => panic!("{other:?}"),
    };

    // auto, top probability 0.731 >= gate 0.6: no thought.
    let mut model = thinker();
    let response = noul_with(r#""think_mode": "auto", "gate": 0.6"#, &mut model);
    assert!(model.thoughts.is_empty());
    assert_eq!(noul(&response).noul, p_first);
    assert_eq!(response.usage.output_tokens, 0);

    // auto below the gate: a thought, mixed 0.75 / 0.25 by default.
    let mut model = thinker();
    let response = noul_with(
        r#""think_mode": "auto", "gate": 0.9, "return_thought": true, "think_budget": 99, "seed": 5"#,
        &mut model,
    );
    assert_eq!(model.thoughts.len(), 1);
    let asked = &model.thoughts[0];
    assert_eq!(asked.budget, 99);
    assert_eq!(
        asked.seed,
        Some(prism_decision::thought::seed_from_request(5, "urgent"))
    );
    let answer = noul(&response);
    assert!((answer.noul - (0.75 * p_after + 0.25 * p_first)).abs() < 1e-15);
    assert_eq!(answer.thought.as_deref(), Some("thinking about urgent"));
    assert_eq!(response.usage.output_tokens, 7);
    assert_eq!(response.usage.input_tokens, 10 + 12);

    // always with mix 0.3 and details; never.
    let mut model = thinker();
    let response = noul_with(
        r#""think_mode": "always", "mix": 0.3, "return_details": true"#,
        &mut model,
    );
    let answer = noul(&response);
    assert!((answer.noul - (0.3 * p_after + 0.7 * p_first)).abs() < 1e-15);
    assert_eq!(answer.thought, None, "no return_thought");
    let details = answer.details.expect("details");
    assert_eq!(details.first.get("true"), Some(&p_first));
    assert_eq!(details.after_thought.unwrap().get("true"), Some(&p_after));
    assert_eq!(details.thought_tokens, Some(7));
    assert_eq!(details.stop_reason, Some(StopReason::EndOfThought));
    assert_eq!(details.prompts, 2);
    let mut model = thinker();
    noul_with(r#""think_mode": "never""#, &mut model);
    noul_with(r#""think_mode": "always", "think_budget": 0"#, &mut model);
    assert!(model.thoughts.is_empty());
}

/// The loop detector on real text, tokenized by the fixture's Qwen3.5 tokenizer: a thought that falls
/// into repeating one sentence is caught once the sentence has come round four times (and 64 tokens);
/// varied prose, and a list with a repeated shape but changing words, are not.
#[test]
fn the_loop_detector_catches_runaway_repetition_in_real_text() {
    use prism_decision::config::LoopDetectorConfig;
    use prism_decision::thought::LoopDetector;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
    let tokenizer =
        prism_decision::tokenizer::PromptTokenizer::from_model_dir(&dir).expect("tokenizer");
    let detect = |text: &str| -> Option<(usize, prism_decision::thought::Repetition)> {
        let mut detector = LoopDetector::new(LoopDetectorConfig::default());
        let tokens = tokenizer.encode(text).expect("encode");
        tokens
            .iter()
            .enumerate()
            .find_map(|(i, &t)| detector.push(t).map(|r| (i + 1, r)))
    };
    let opening = "The customer was charged twice, so billing should look at it first. ";
    let sentence = "Wait, let me check the invoice again to be sure. ";
    // The sentence's tokens once it repeats (its trailing space joins the next word).
    let repeated = |n: usize| tokenizer.encode(&sentence.repeat(n)).expect("encode").len();
    let unit = (repeated(12) - repeated(2)) / 10;
    let looping = format!("{opening}{}", sentence.repeat(12));
    let (at, repetition) = detect(&looping).expect("a loop");
    assert_eq!(repetition.period, unit, "{repetition:?}");
    assert!(
        repetition.span >= 64 && repetition.span >= 4 * unit,
        "{repetition:?}"
    );
    // Caught as soon as both bounds hold (within a unit of the 64 tokens after the opening), long
    // before the text ends.
    let opening_tokens = tokenizer.encode(opening).expect("encode").len();
    assert!(at <= opening_tokens + 64 + unit, "{at} {repetition:?}");
    assert!(at < tokenizer.encode(&looping).unwrap().len() - 4 * unit);

    let prose = "Evidence first: the invoice from March lists two identical charges of 12.50, \
        one on the 3rd and one on the 4th. The customer's card was later declined, which fits a \
        hold placed by the bank after the double charge. Billing owns refunds; technical support \
        owns the app's payment screen, which only reported the decline. So the first step is a \
        refund of the duplicate, and then a note to the customer explaining the hold. ";
    assert_eq!(detect(prose), None);
    let list: String = (1..=30)
        .map(|i| {
            format!(
                "Step {i}: check the charge of day {} against the ledger.\n",
                i * 7 % 31
            )
        })
        .collect();
    assert_eq!(detect(&list), None);
}
