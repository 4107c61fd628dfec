//! The 70 render cases of the reference renderer (`tests/fixtures/decision-golden/golden.json`, made by
//! the model release's own `jev_render_v3` renderer): every rendered case must match its system text,
//! user text and letter order exactly; every refused case must be refused by us too, with an error that
//! names the field (the reference's wording differs, its meaning must match).

mod common;

use common::{get, golden, list};
use prism_decision::error::{ErrorClass, LocPart};
use prism_decision::pyjson::PyValue;
use prism_decision::render::{render_prompt, state_text};
use prism_decision::{
    render_request, DecisionConfig, DecisionRequest, Question, ReadMode, RequestDefaults,
};

/// The question key the client used for a field that has an alias.
fn key_used(question: &PyValue, name: &str, alias: &str) -> String {
    let object = question.as_object().expect("question is an object");
    if object.get(name).is_some_and(|v| *v != PyValue::Null) || !object.contains_key(alias) {
        name.to_string()
    } else {
        alias.to_string()
    }
}

fn path_parts(parts: &[&str]) -> Vec<LocPart> {
    parts.iter().map(|p| LocPart::Key(p.to_string())).collect()
}

#[test]
fn golden_render_cases() {
    let golden = golden();
    let cases = list(get(&golden, "render"));
    assert_eq!(cases.len(), 70);
    let (mut rendered, mut refused) = (0, 0);
    for (i, case) in cases.iter().enumerate() {
        let state = get(case, "state");
        let spec = get(case, "question");
        let expect = get(case, "expect");
        let parsed = Question::from_json("q", spec);
        if let Some(error) = expect.as_object().and_then(|e| e.get("error")) {
            refused += 1;
            let message = error.as_str().expect("error message");
            let instructions_key = key_used(spec, "instructions", "question");
            let criteria_key = key_used(spec, "criteria", "options");
            match message {
                "instructions required" => {
                    let errors =
                        parsed.expect_err(&format!("case {i}: must be refused ({message})"));
                    let first = &errors.0[0];
                    assert_eq!(
                        first.path.0,
                        path_parts(&["questions", "q", &instructions_key]),
                        "case {i}: {first}"
                    );
                    assert_eq!(errors.class(), ErrorClass::Malformed, "case {i}");
                }
                "score needs 2..10 levels" => {
                    let errors =
                        parsed.expect_err(&format!("case {i}: must be refused ({message})"));
                    assert_eq!(errors.0.len(), 1, "case {i}: {errors}");
                    assert_eq!(
                        errors.0[0].path.0,
                        path_parts(&["questions", "q", &criteria_key]),
                        "case {i}"
                    );
                    assert!(
                        errors.0[0].message.contains("more than 10 levels"),
                        "case {i}: {errors}"
                    );
                    // Well-formed but beyond the model: 422.
                    assert_eq!(errors.class(), ErrorClass::Unanswerable, "case {i}");
                }
                m if m.starts_with("bad option id") => {
                    let errors =
                        parsed.expect_err(&format!("case {i}: must be refused ({message})"));
                    let first = &errors.0[0];
                    assert_eq!(
                        first.path.0[..3],
                        path_parts(&["questions", "q", &criteria_key])[..],
                        "case {i}"
                    );
                    assert!(first.message.contains("line break"), "case {i}: {first}");
                    assert_eq!(errors.class(), ErrorClass::Malformed, "case {i}");
                }
                "2..26 options required, got 1" => {
                    // A valid question for the engine (answered without the model); the prompt renderer
                    // refuses it as the reference does.
                    let question = parsed.unwrap_or_else(|e| panic!("case {i}: {e}"));
                    let error = render_prompt(&state_text(state), &question)
                        .expect_err("one option is no prompt");
                    assert_eq!(
                        error.path.0,
                        path_parts(&["questions", "q", "criteria"]),
                        "case {i}"
                    );
                    assert!(error.message.contains("got 1"), "case {i}: {error}");
                }
                other => panic!("case {i}: unexpected golden error {other:?}"),
            }
            continue;
        }
        rendered += 1;
        let question = parsed.unwrap_or_else(|e| panic!("case {i}: refused: {e}"));
        let prompt = render_prompt(&state_text(state), &question)
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        assert_eq!(
            prompt.system,
            get(expect, "system").as_str().unwrap(),
            "case {i}: system"
        );
        assert_eq!(
            prompt.user,
            get(expect, "user").as_str().unwrap(),
            "case {i}: user"
        );
        let order: Vec<&str> = list(get(expect, "order"))
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(prompt.option_ids, order, "case {i}: order");
    }
    assert_eq!((rendered, refused), (45, 25));
}

/// The same cases through the request parser and `render_request`: the engine-level view, where a choice
/// with a single option is answered without a prompt.
#[test]
fn golden_render_cases_as_requests() {
    let golden = golden();
    let config = DecisionConfig::default();
    for (i, case) in list(get(&golden, "render")).iter().enumerate() {
        let mut body = prism_decision::pyjson::PyObject::new();
        body.insert("state".into(), get(case, "state").clone());
        let mut questions = prism_decision::pyjson::PyObject::new();
        questions.insert("q".into(), get(case, "question").clone());
        body.insert("questions".into(), PyValue::Object(questions));
        let parsed =
            DecisionRequest::from_json(&PyValue::Object(body), &RequestDefaults::default());
        let expect = get(case, "expect");
        match expect
            .as_object()
            .and_then(|e| e.get("error"))
            .and_then(PyValue::as_str)
        {
            Some("2..26 options required, got 1") => {
                let request = parsed.unwrap_or_else(|e| panic!("case {i}: {e}"));
                let rendered = render_request(&request, &config).unwrap();
                assert_eq!(rendered[0].mode, ReadMode::SelfAnswered, "case {i}");
                assert!(rendered[0].prompts.is_empty(), "case {i}");
            }
            Some(message) => {
                let error = parsed.expect_err(&format!("case {i}: must be refused ({message})"));
                // Every validation failure is a 422, as in the reference API.
                assert_eq!(error.status(), 422, "case {i}: {error}");
                let body = error.body();
                assert_eq!(
                    body.detail[0].loc[..3],
                    path_parts(&["body", "questions", "q"])[..],
                    "case {i}"
                );
            }
            None => {
                let request = parsed.unwrap_or_else(|e| panic!("case {i}: {e}"));
                let rendered = render_request(&request, &config).unwrap();
                assert_eq!(rendered[0].mode, ReadMode::Single, "case {i}");
                assert_eq!(
                    rendered[0].prompts[0].user,
                    get(expect, "user").as_str().unwrap(),
                    "case {i}"
                );
            }
        }
    }
}
