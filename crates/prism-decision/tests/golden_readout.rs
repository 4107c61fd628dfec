//! The 28 read-out cases of `tests/fixtures/decision-golden/golden.json` (the reference's read-out
//! arithmetic), to 1e-12 relative as its README states: TypeSafe confidences, and wide choices of 27 to 700
//! options run through `decide` with the golden fake model (letter logit = a SHA-1 function of the id).

mod common;

use common::{get, golden, list, rel_diff, ShaModel};
use prism_decision::pyjson::{PyObject, PyValue};
use prism_decision::readout::{choice_confidence, score_confidence};
use prism_decision::{decide, Answer, DecisionConfig, DecisionRequest, RequestDefaults};

const TOLERANCE: f64 = 1e-12;

fn number(value: &PyValue) -> f64 {
    value
        .as_f64()
        .unwrap_or_else(|| panic!("not a number: {value}"))
}

fn close(got: f64, want: f64) -> bool {
    if want == 0.0 {
        got.abs() <= TOLERANCE
    } else {
        rel_diff(got, want) <= TOLERANCE
    }
}

#[test]
fn golden_confidences() {
    let golden = golden();
    let mut checked = 0;
    for (i, case) in list(get(&golden, "readout")).iter().enumerate() {
        if get(case, "kind").as_str() != Some("confidence") {
            continue;
        }
        let p: Vec<f64> = list(get(case, "probabilities"))
            .iter()
            .map(number)
            .collect();
        let (want_choice, want_score) = (
            number(get(case, "expect_choice")),
            number(get(case, "expect_score")),
        );
        let (choice, score) = (choice_confidence(&p), score_confidence(&p));
        assert!(
            close(choice, want_choice),
            "case {i}: choice confidence {choice} vs {want_choice}"
        );
        assert!(
            close(score, want_score),
            "case {i}: score confidence {score} vs {want_score}"
        );
        checked += 1;
    }
    assert_eq!(checked, 20);
}

#[test]
fn golden_wide_choices_through_decide() {
    let golden = golden();
    let mut checked = 0;
    let mut worst: f64 = 0.0;
    for (i, case) in list(get(&golden, "readout")).iter().enumerate() {
        if get(case, "kind").as_str() != Some("wide") {
            continue;
        }
        let ids = list(get(case, "ids"));
        let temperature = number(get(case, "temperature"));
        let expect = get(case, "expect").as_object().expect("expect map");

        let mut question = PyObject::new();
        question.insert("type".into(), PyValue::Str("choice".into()));
        question.insert("instructions".into(), PyValue::Str("Which item?".into()));
        question.insert("criteria".into(), PyValue::Array(ids.to_vec()));
        let mut questions = PyObject::new();
        questions.insert("pick".into(), PyValue::Object(question));
        let mut body = PyObject::new();
        body.insert("state".into(), PyValue::Str("a catalogue".into()));
        body.insert("questions".into(), PyValue::Object(questions));
        body.insert("return_details".into(), PyValue::Bool(true));
        let request =
            DecisionRequest::from_json(&PyValue::Object(body), &RequestDefaults::default())
                .unwrap();

        let mut config = DecisionConfig::default();
        config.temperature_by_type.choice = temperature;
        let mut model = ShaModel {
            tokens_per_prompt: 7,
            ..Default::default()
        };
        let response = decide(&request, &config, &mut model).unwrap();

        let Answer::Choice(answer) = response.answers.get("pick").expect("answer") else {
            panic!("not a choice")
        };
        assert_eq!(answer.probabilities.len(), ids.len(), "case {i}");
        assert_eq!(expect.len(), ids.len(), "case {i}");
        for (id, want) in expect.iter() {
            let got = *answer
                .probabilities
                .get(id)
                .unwrap_or_else(|| panic!("case {i}: no {id}"));
            let want = number(want);
            worst = worst.max(rel_diff(got, want));
            assert!(close(got, want), "case {i}: {id}: {got} vs {want}");
        }
        // The chosen option is the most probable of the golden distribution.
        let best = expect
            .iter()
            .max_by(|a, b| number(a.1).total_cmp(&number(b.1)))
            .unwrap()
            .0;
        assert_eq!(answer.choice.as_deref(), Some(best), "case {i}");

        // Rounds: groups of <= 25 (all in one call), 3 kept from each, again while more than 26.
        let mut n = ids.len();
        let mut expected_calls = vec![];
        while n > 26 {
            let groups = n.div_ceil(25);
            expected_calls.push(groups);
            n = 3 * groups;
        }
        expected_calls.push(1);
        let calls: Vec<usize> = model.calls.iter().map(Vec::len).collect();
        assert_eq!(calls, expected_calls, "case {i}: prompts per model call");
        for prompt in model.calls.iter().flatten() {
            assert!(
                (2..=26).contains(&prompt.option_ids.len()),
                "case {i}: a prompt of {} options",
                prompt.option_ids.len()
            );
        }
        let prompts: usize = calls.iter().sum();
        assert_eq!(response.usage.input_tokens, 7 * prompts as u64, "case {i}");
        let details = answer.details.as_ref().expect("details asked for");
        assert_eq!(details.prompts, prompts, "case {i}");
        checked += 1;
    }
    assert_eq!(checked, 8);
    eprintln!("worst relative difference over the wide cases: {worst:e}");
}
