//! Request validation: every refusal names its field and is a 422 (as in the reference API); malformed
//! requests are still told apart from requests the model cannot answer by their class and `type`.

use prism_decision::error::LocPart;
use prism_decision::request::ThinkMode;
use prism_decision::{DecisionError, DecisionRequest, RequestDefaults};

fn parse(body: &str) -> Result<DecisionRequest, DecisionError> {
    DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default())
}

/// The status and the field paths of a refused body.
fn refusal(body: &str) -> (u16, Vec<String>) {
    let error = parse(body).expect_err(body);
    (
        error.status(),
        error
            .field_errors()
            .iter()
            .map(|e| e.path.to_string())
            .collect(),
    )
}

fn with_question(question: &str) -> String {
    format!(r#"{{"state": "s", "questions": {{"team": {question}}}}}"#)
}

#[test]
fn a_full_request_with_defaults() {
    let request = parse(
        r#"{"state": {"a": 1}, "model": "jev-latest", "questions": {
            "team": {"type": "choice", "instructions": "Who?", "criteria": {"billing": "money", "tech": null}},
            "urgent": {"type": "bool"},
            "risk": {"type": "score", "question": "Risk?", "options": ["low", "high"]}}}"#,
    )
    .unwrap();
    assert_eq!(
        request
            .questions
            .iter()
            .map(|q| q.name.as_str())
            .collect::<Vec<_>>(),
        ["team", "urgent", "risk"]
    );
    assert_eq!(
        (
            request.think_mode,
            request.gate,
            request.mix,
            request.think_budget
        ),
        (ThinkMode::Auto, 0.6, 0.75, 4096)
    );
    assert!(
        request.none_check
            && request.allow_none
            && !request.return_details
            && !request.return_thought
    );
    assert_eq!(request.model.as_deref(), Some("jev-latest"));
    assert_eq!(
        request.questions[1].instructions,
        "Which answer fits the evidence?"
    );
    assert_eq!(
        request.questions[2]
            .options
            .iter()
            .map(|o| o.id.as_str())
            .collect::<Vec<_>>(),
        ["0", "1"]
    );

    // A server's defaults fill what the request leaves out; explicit values win.
    let defaults = RequestDefaults {
        gate: 0.9,
        none_check: false,
        ..RequestDefaults::default()
    };
    let body = r#"{"state": "", "questions": {"q": {"type": "noul"}}, "mix": 0, "think_mode": "never", "think_budget": 12}"#;
    let request = DecisionRequest::parse(body.as_bytes(), &defaults).unwrap();
    assert_eq!(
        (request.gate, request.none_check, request.mix),
        (0.9, false, 0.0)
    );
    assert_eq!(
        (request.think_mode, request.think_budget),
        (ThinkMode::Never, 12)
    );
}

#[test]
fn top_level_fields() {
    // Unknown top-level fields are ignored (forward compatibility, as the reference API does) and
    // reported for the server's `x_notes`.
    let request = parse(r#"{"state": "s", "questions": {"q": {"type": "noul"}}, "think_mod": "auto", "x_trace": 1}"#)
        .unwrap();
    assert_eq!(request.ignored_fields, ["think_mod", "x_trace"]);
    assert_eq!(
        refusal(r#"{"questions": {"q": {"type": "noul"}}}"#),
        (422, vec!["state".into()])
    );
    assert_eq!(
        refusal(r#"{"state": "s"}"#),
        (422, vec!["questions".into()])
    );
    assert_eq!(
        refusal(r#"{"state": "s", "questions": {}}"#),
        (422, vec!["questions".into()])
    );
    assert_eq!(
        refusal(r#"{"state": "s", "questions": []}"#),
        (422, vec!["questions".into()])
    );
    assert_eq!(refusal(r#"[1]"#), (422, vec!["body".into()]));
    let q = r#""questions": {"q": {"type": "noul"}}"#;
    // Each field, next to a valid state and question, and the path it is refused under (422).
    let cases = [
        (r#""think_mode": "sometimes""#, "think_mode"),
        (r#""gate": 1.5"#, "gate"),
        (r#""gate": "0.5""#, "gate"),
        (r#""mix": -0.1"#, "mix"),
        (r#""think_budget": -1"#, "think_budget"),
        (r#""think_budget": 10.0"#, "think_budget"),
        (r#""none_check": "yes""#, "none_check"),
        (r#""return_details": 1"#, "return_details"),
        (r#""model": 3"#, "model"),
        (r#""images": "abc""#, "images"),
        (r#""images": ["a", 2]"#, "images[1]"),
        (
            r#""images": ["a","a","a","a","a","a","a","a","a"]"#,
            "images",
        ),
        (r#""assets": {"x": {}}"#, "assets"),
    ];
    for (field, path) in cases {
        let body = format!(r#"{{"state": "s", {q}, {field}}}"#);
        assert_eq!(refusal(&body), (422, vec![path.to_string()]), "{body}");
    }
    // Up to 8 images parse (whether the engine can use them is decide's business).
    let body = format!(r#"{{"state": "s", {q}, "images": ["a","a","a","a","a","a","a","a"]}}"#);
    assert_eq!(parse(&body).unwrap().images.len(), 8);
}

#[test]
fn question_fields() {
    let cases = [
        (r#"{"instructions": "x"}"#, 422, "questions.team.type"),
        (
            r#"{"type": "multiple", "instructions": "x"}"#,
            422,
            "questions.team.type",
        ),
        (
            r#"{"type": "box", "instructions": "the dog"}"#,
            422,
            "questions.team.type",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": ["a", "b"], "weight": 2}"#,
            422,
            "questions.team.weight",
        ),
        (r#"[1]"#, 422, "questions.team"),
        (
            r#"{"type": "choice", "criteria": ["a", "b"]}"#,
            422,
            "questions.team.instructions",
        ),
        (
            r#"{"type": "choice", "question": " ", "criteria": ["a", "b"]}"#,
            422,
            "questions.team.question",
        ),
        (
            r#"{"type": "choice", "instructions": 3, "criteria": ["a", "b"]}"#,
            422,
            "questions.team.instructions",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "question": "y", "criteria": ["a", "b"]}"#,
            422,
            "questions.team.question",
        ),
        (
            r#"{"type": "choice", "instructions": "x"}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": {}}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "options": []}"#,
            422,
            "questions.team.options",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": "a,b"}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": ["a", "a"]}"#,
            422,
            "questions.team.criteria[1]",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": ["a", 2]}"#,
            422,
            "questions.team.criteria[1]",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": ["a", ""]}"#,
            422,
            "questions.team.criteria[1]",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": {"a": "", " ": "blank"}}"#,
            422,
            "questions.team.criteria. ",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": {"a\rb": "", "c": 1}}"#,
            422,
            "questions.team.criteria.a\rb",
        ),
        (
            r#"{"type": "choice", "instructions": "x", "criteria": ["a"], "options": ["b"]}"#,
            422,
            "questions.team.options",
        ),
        (
            r#"{"type": "noul", "criteria": {"true": "y", "maybe": "m"}}"#,
            422,
            "questions.team.criteria.maybe",
        ),
        (
            r#"{"type": "noul", "criteria": ["true", "false"]}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "score", "instructions": "x", "criteria": ["only"]}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "score", "instructions": "x", "criteria": ["a", null]}"#,
            422,
            "questions.team.criteria[1]",
        ),
        (
            r#"{"type": "score", "instructions": "x", "criteria": "low..high"}"#,
            422,
            "questions.team.criteria",
        ),
        (
            r#"{"type": "score", "instructions": "x", "criteria": [0,1,2,3,4,5,6,7,8,9,10]}"#,
            422,
            "questions.team.criteria",
        ),
    ];
    for (question, status, path) in cases {
        assert_eq!(
            refusal(&with_question(question)),
            (status, vec![path.to_string()]),
            "{question}"
        );
    }
    // Ids: 200 characters are fine, 201 are not.
    let ok = format!(
        r#"{{"type": "choice", "instructions": "x", "criteria": ["{}", "b"]}}"#,
        "é".repeat(200)
    );
    assert!(parse(&with_question(&ok)).is_ok());
    let long = format!(
        r#"{{"type": "choice", "instructions": "x", "criteria": ["{}", "b"]}}"#,
        "é".repeat(201)
    );
    assert_eq!(
        refusal(&with_question(&long)),
        (422, vec!["questions.team.criteria[0]".to_string()])
    );
    // Ten levels are fine.
    assert!(parse(&with_question(
        r#"{"type": "score", "instructions": "x", "criteria": [0,1,2,3,4,5,6,7,8,9]}"#
    ))
    .is_ok());
    // One option and many options are valid for the engine (self-answered / wide choice).
    assert!(parse(&with_question(
        r#"{"type": "choice", "instructions": "x", "criteria": {"only": null}}"#
    ))
    .is_ok());
    let many: Vec<String> = (0..300).map(|i| format!("\"o{i}\"")).collect();
    let wide = format!(
        r#"{{"type": "choice", "instructions": "x", "criteria": [{}]}}"#,
        many.join(",")
    );
    assert_eq!(
        parse(&with_question(&wide)).unwrap().questions[0]
            .options
            .len(),
        300
    );
}

/// The first question's option descriptions as JSON text, in the order of its options.
fn level_descriptions(request: &DecisionRequest) -> Vec<String> {
    request.questions[0]
        .options
        .iter()
        .map(|o| o.description.as_ref().unwrap().dumps())
        .collect()
}

#[test]
fn score_dicts_are_ordered_by_numeric_key() {
    let request = parse(&with_question(
        r#"{"type": "score", "instructions": "x", "criteria": {"10": "ten", "2": "two", "9": "nine", "0": "zero"}}"#,
    ))
    .unwrap();
    let levels = level_descriptions(&request);
    assert_eq!(levels, ["\"zero\"", "\"two\"", "\"nine\"", "\"ten\""]);
    // Not all numeric: the client's order (as the reference keeps {"b": .., "a": ..}).
    let request = parse(&with_question(
        r#"{"type": "score", "instructions": "x", "criteria": {"b": "bee", "1": "one"}}"#,
    ))
    .unwrap();
    let levels = level_descriptions(&request);
    assert_eq!(levels, ["\"bee\"", "\"one\""]);
}

#[test]
fn malformed_wins_over_unanswerable_and_every_error_is_listed() {
    let body = r#"{"state": "s", "questions": {
        "a": {"type": "score", "instructions": "x", "criteria": [0,1,2,3,4,5,6,7,8,9,10]},
        "b": {"type": "choice", "instructions": "", "criteria": ["x", "y"]}}}"#;
    let error = parse(body).unwrap_err();
    assert_eq!(error.status(), 422);
    let paths: Vec<String> = error
        .field_errors()
        .iter()
        .map(|e| e.path.to_string())
        .collect();
    assert_eq!(paths, ["questions.a.criteria", "questions.b.instructions"]);
    // The message leads with the malformed field.
    assert!(
        error.to_string().starts_with("questions.b.instructions: "),
        "{error}"
    );
}

#[test]
fn error_body_shape() {
    let error = parse(&with_question(
        r#"{"type": "score", "instructions": "x", "criteria": [0,1,2,3,4,5,6,7,8,9,10]}"#,
    ))
    .unwrap_err();
    let body = serde_json::to_value(error.body()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "error": "questions.team.criteria: the model cannot answer a score with more than 10 levels, got 11",
            "detail": [{
                "loc": ["body", "questions", "team", "criteria"],
                "msg": "the model cannot answer a score with more than 10 levels, got 11",
                "type": "too_many_levels"
            }]
        })
    );
    let error = parse(&with_question(
        r#"{"type": "choice", "instructions": "x", "criteria": ["a", 7]}"#,
    ))
    .unwrap_err();
    assert_eq!(error.body().detail[0].loc[4], LocPart::Index(1));
    assert_eq!(
        serde_json::to_value(&error.body().detail[0].loc).unwrap(),
        serde_json::json!(["body", "questions", "team", "criteria", 1])
    );

    let error = parse("{\"state\": \"s\",\n \"questions\": }").unwrap_err();
    assert_eq!(error.status(), 422);
    let body = error.body();
    assert_eq!(body.detail[0].kind, "json_invalid");
    assert!(
        body.error.contains("Expecting value: line 2 column 15"),
        "{}",
        body.error
    );
}
