//! Rendering rules of spec §3 beyond what the golden cases pin down: state text, array annotation, option
//! lines. (The golden cases themselves are in `golden_render.rs`.)

use prism_decision::pyjson::{parse, PyValue};
use prism_decision::render::{
    annotate_long_arrays, is_bare_id, option_labels, render_prompt, state_text, user_text,
    SYSTEM_PROMPT,
};
use prism_decision::Question;

fn state(json: &str) -> String {
    state_text(&parse(json).unwrap())
}

fn labels(spec: &str) -> Vec<String> {
    option_labels(&Question::from_json("q", &parse(spec).unwrap()).unwrap())
}

#[test]
fn empty_and_blank_states_render_as_none() {
    for json in ["null", "{}", "[]", "\"\"", "\"   \"", "\"\\n\\t \""] {
        assert_eq!(state(json), "(none)", "{json}");
    }
    assert_eq!(state("0"), "0");
    assert_eq!(state("false"), "false");
    assert_eq!(state("-0.0"), "-0.0");
    // Strings are used as they are: not stripped, not re-encoded.
    assert_eq!(state("\"  a\\\"b\\n\""), "  a\"b\n");
    assert_eq!(state("[\"\"]"), "[\"\"]");
}

#[test]
fn arrays_of_eight_or_more_items_are_annotated_at_every_depth() {
    assert_eq!(state("[1, 2, 3, 4, 5, 6, 7]"), "[1, 2, 3, 4, 5, 6, 7]");
    assert_eq!(
        state("{\"x\": [[0, 1, 2, 3, 4, 5, 6, 7], 1]}"),
        "{\"x\": [[{\"_index\": 0, \"value\": 0}, {\"_index\": 1, \"value\": 1}, {\"_index\": 2, \"value\": 2}, \
         {\"_index\": 3, \"value\": 3}, {\"_index\": 4, \"value\": 4}, {\"_index\": 5, \"value\": 5}, \
         {\"_index\": 6, \"value\": 6}, {\"_index\": 7, \"value\": 7}], 1]}"
    );
    // Items of an annotated array are annotated inside too; an object item keeps its keys after `_index`.
    let nested = parse("[[1,2,3,4,5,6,7,8],2,3,4,5,6,7,{\"k\": [0,0,0,0,0,0,0,0]}]").unwrap();
    let annotated = annotate_long_arrays(&nested);
    let PyValue::Array(items) = &annotated else {
        panic!()
    };
    assert_eq!(items.len(), 8);
    assert!(items[0]
        .dumps()
        .starts_with("{\"_index\": 0, \"value\": [{\"_index\": 0, \"value\": 1}, "));
    assert!(items[7]
        .dumps()
        .starts_with("{\"_index\": 7, \"k\": [{\"_index\": 0, \"value\": 0}, "));
    // An item with its own `_index` keeps it, in first position (a Python dict {"_index": i, **item}).
    let own = parse("[{\"a\": 1, \"_index\": \"mine\"},{},{},{},{},{},{},{}]").unwrap();
    let text = annotate_long_arrays(&own).dumps();
    assert!(
        text.starts_with("[{\"_index\": \"mine\", \"a\": 1}, {\"_index\": 1}, "),
        "{text}"
    );
}

#[test]
fn bare_ids() {
    for id in [
        "A", "z", "(b)", "3.", "12", "option_2", "opt 1", "Option A", "[c]", "d)", "choice-4",
        "(0)", "7:",
    ] {
        assert!(is_bare_id(id), "{id}");
    }
    for id in [
        "label 0", "AB", "a1", "option", "opt", "high", "1.5", "", "(", "team_a",
    ] {
        assert!(!is_bare_id(id), "{id}");
    }
}

#[test]
fn option_lines() {
    // Description shown after the id; a repeat of the id (case, spaces and _ ignored) shows the id only.
    assert_eq!(
        labels(
            r#"{"type": "choice", "instructions": "x", "criteria": {"high_risk": "High Risk", "low": "calm", "mid": null, "x": "  "}}"#
        ),
        ["high_risk", "low: calm", "mid", "x"]
    );
    // A `-` is not ignored (the release's renderer, spec §3): `OPT-2` is not a repeat of `opt2`, while
    // `Opt_2` and `OPT 2` are.
    assert_eq!(
        labels(
            r#"{"type": "choice", "instructions": "x", "criteria": {"opt1": "first", "opt2": "OPT-2", "opt_3": "Opt 3", "op-4": "OP-4"}}"#
        ),
        ["opt1: first", "opt2: OPT-2", "opt_3", "op-4"]
    );
    // Bare ids are hidden only when every option has a description.
    assert_eq!(
        labels(r#"{"type": "choice", "instructions": "x", "criteria": {"A": "first", "B": null}}"#),
        ["A: first", "B"]
    );
    assert_eq!(
        labels(
            r#"{"type": "choice", "instructions": "x", "criteria": {"1.": "first", "(2)": ["a", 1]}}"#
        ),
        ["first", "[\"a\", 1]"]
    );
    // Noul shows yes/no; a description that only says yes/no (or true/false) adds nothing.
    assert_eq!(
        labels(r#"{"type": "noul", "criteria": {"false": "No", "true": "TRUE"}}"#),
        ["yes", "no"]
    );
    assert_eq!(
        labels(r#"{"type": "bool", "criteria": {"false": "It can wait"}}"#),
        ["yes", "no: It can wait"]
    );
    // Score levels are numbered; non-string levels are JSON.
    assert_eq!(
        labels(
            r#"{"type": "score", "instructions": "x", "criteria": ["0", {"level": "mid"}, "high"]}"#
        ),
        ["0", "1: {\"level\": \"mid\"}", "2: high"]
    );
}

#[test]
fn prompt_layout() {
    let question = Question::from_json(
        "q",
        &parse(r#"{"type": "choice", "question": " Which? ", "options": ["x", "y"]}"#).unwrap(),
    )
    .unwrap();
    let prompt = render_prompt("E", &question).unwrap();
    assert_eq!(prompt.system, SYSTEM_PROMPT);
    assert_eq!(
        prompt.user,
        "Evidence:\nE\n\nQuestion: Which?\nOptions:\nA) x\nB) y"
    );
    assert_eq!(prompt.option_ids, ["x", "y"]);
    assert_eq!(
        user_text("s", "i", &[]),
        "Evidence:\ns\n\nQuestion: i\nOptions:"
    );
    // JSON instructions render as JSON text.
    let question = Question::from_json(
        "q",
        &parse(r#"{"type": "noul", "instructions": {"task": "Is it spam?"}}"#).unwrap(),
    )
    .unwrap();
    assert_eq!(question.instructions, "{\"task\": \"Is it spam?\"}");
}

#[test]
fn prompts_take_two_to_twenty_six_options() {
    let ids: Vec<String> = (0..27).map(|i| format!("\"o{i}\"")).collect();
    let spec = format!(
        r#"{{"type": "choice", "instructions": "x", "criteria": [{}]}}"#,
        ids.join(", ")
    );
    let question = Question::from_json("wide", &parse(&spec).unwrap()).unwrap();
    let error = render_prompt("s", &question).unwrap_err();
    assert_eq!(error.path.to_string(), "questions.wide.criteria");
    assert!(error.message.contains("got 27"), "{error}");
}
