//! The Python-compatible JSON layer. Expected strings are what CPython 3.11.7 printed for
//! `json.dumps(json.loads(text), ensure_ascii=False)` on this machine.

use prism_decision::error::FieldPath;
use prism_decision::pyjson::{dumps, float_repr, parse, parse_bytes, PyObject, PyValue, MAX_DEPTH};

fn roundtrip(text: &str) -> String {
    dumps(&parse(text).unwrap_or_else(|e| panic!("{text}: {e}")))
}

#[test]
fn numbers_print_back_as_python_does() {
    // (input literal, json.dumps(json.loads(literal))) from CPython 3.11.7.
    let cases = [
        ("1e+16", "1e+16"),
        ("1e16", "1e+16"),
        ("-0.0", "-0.0"),
        ("1e-07", "1e-07"),
        ("123456789.123", "123456789.123"),
        ("1e+22", "1e+22"),
        ("1e400", "Infinity"),
        ("-1e400", "-Infinity"),
        ("0.1", "0.1"),
        ("0.30000000000000004", "0.30000000000000004"),
        ("1.0", "1.0"),
        ("100000.0", "100000.0"),
        ("1e-5", "1e-05"),
        ("0.0001", "0.0001"),
        ("0.00012345", "0.00012345"),
        ("9999999999999998.0", "9999999999999998.0"),
        ("1e15", "1000000000000000.0"),
        ("1.5e300", "1.5e+300"),
        ("5e-324", "5e-324"),
        ("2.2250738585072014e-308", "2.2250738585072014e-308"),
        ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ("-2.5e-10", "-2.5e-10"),
        ("3.14159", "3.14159"),
        ("1E5", "100000.0"),
        ("1.0e+0", "1.0"),
        ("12345678901234567890.5", "1.2345678901234567e+19"),
        ("0.000099999", "9.9999e-05"),
        ("4.35", "4.35"),
        ("2.675", "2.675"),
        ("1e23", "1e+23"),
        ("9007199254740993.0", "9007199254740992.0"),
        // Integers are Python ints: any size, printed exactly; -0 is 0.
        ("100000000000000000000", "100000000000000000000"),
        ("9007199254740993", "9007199254740993"),
        ("123456789012345678", "123456789012345678"),
        (
            "123456789012345678901234567890",
            "123456789012345678901234567890",
        ),
        ("-0", "0"),
        ("0", "0"),
        ("-12", "-12"),
    ];
    for (literal, want) in cases {
        assert_eq!(roundtrip(literal), want, "{literal}");
    }
    assert!(matches!(parse("1.0").unwrap(), PyValue::Float(_)));
    assert!(matches!(parse("10").unwrap(), PyValue::Int(_)));
    assert!(matches!(parse("1e2").unwrap(), PyValue::Float(_)));
}

#[test]
fn float_repr_matches_python_repr() {
    // repr() of these floats in CPython 3.11.7.
    assert_eq!(float_repr(1e16), "1e+16");
    assert_eq!(float_repr(1e-7), "1e-07");
    assert_eq!(float_repr(-0.0), "-0.0");
    assert_eq!(float_repr(0.0), "0.0");
    assert_eq!(float_repr(1.5e-5), "1.5e-05");
    assert_eq!(float_repr(123.0), "123.0");
    assert_eq!(float_repr(1e100), "1e+100");
    assert_eq!(float_repr(f64::INFINITY), "inf");
    assert_eq!(float_repr(f64::NAN), "nan");
}

#[test]
fn strings_escape_like_ensure_ascii_false() {
    let text = r#"{"s": "q\"b\\s\n\r\t\b\f\u0001\u001f\u007f\u00e9\ud83d\ude80\/ ü東", "k": [NaN, Infinity, -Infinity]}"#;
    assert_eq!(
        roundtrip(text),
        "{\"s\": \"q\\\"b\\\\s\\n\\r\\t\\b\\f\\u0001\\u001f\u{7f}é🚀/ ü東\", \"k\": [NaN, Infinity, -Infinity]}"
    );
}

#[test]
fn key_order_is_kept_and_duplicates_keep_the_first_position() {
    assert_eq!(
        roundtrip(r#"{"z": 1, "a": 2, "m": {"y": [], "b": {}}}"#),
        r#"{"z": 1, "a": 2, "m": {"y": [], "b": {}}}"#
    );
    // A Python dict: the last value wins, at the first key's position.
    assert_eq!(
        roundtrip(r#"{"a": 1, "b": 2, "a": 3}"#),
        r#"{"a": 3, "b": 2}"#
    );
    let mut object = PyObject::new();
    object.insert("x".into(), PyValue::Null);
    object.insert("y".into(), PyValue::Bool(true));
    object.insert("x".into(), PyValue::Bool(false));
    assert_eq!(object.keys().collect::<Vec<_>>(), ["x", "y"]);
    assert_eq!(object.get("x"), Some(&PyValue::Bool(false)));
}

#[test]
fn whitespace_and_separators() {
    assert_eq!(roundtrip(" \t\r\n[1,2 ,\n3]\n "), "[1, 2, 3]");
    assert_eq!(roundtrip("\"plain\""), "\"plain\"");
    assert_eq!(roundtrip("null"), "null");
    // A UTF-8 byte-order mark is skipped, as json.loads(bytes) does.
    assert_eq!(
        dumps(&parse_bytes(b"\xEF\xBB\xBF[true]").unwrap()),
        "[true]"
    );
}

#[test]
fn malformed_json_is_refused_with_its_position() {
    // (text, message prefix, line, column) — positions as CPython reports them. One row a case: rows
    // alike in shape are different inputs, kept one a line so each reads against CPython's message.
    let cases = [
        ("01", "Extra data", 1, 2),
        ("1.", "Extra data", 1, 2),
        (".5", "Expecting value", 1, 1),
        ("tru", "Expecting value", 1, 1),
        ("[1] x", "Extra data", 1, 5),
        ("", "Expecting value", 1, 1),
        ("{\"a\" 1}", "Expecting ':' delimiter", 1, 6),
        ("\"abc", "Unterminated string starting at", 1, 1),
        ("[[[", "Expecting value", 1, 4),
        ("-", "Expecting value", 1, 1),
        ("1e", "Extra data", 1, 2),
        ("\"\\x\"", "Invalid \\escape", 1, 2),
        (
            "{\n  \"a\": 1,\n  \"b\" 2}",
            "Expecting ':' delimiter",
            3,
            7,
        ),
        ("\"a\u{1}b\"", "Invalid control character at", 1, 3),
        (
            "{'a': 1}",
            "Expecting property name enclosed in double quotes",
            1,
            2,
        ),
    ];
    for (text, message, line, column) in cases {
        let error = parse(text).expect_err(text);
        assert!(error.message.starts_with(message), "{text:?}: {error}");
        assert_eq!(
            (error.line, error.column),
            (line, column),
            "{text:?}: {error}"
        );
    }
    // Trailing commas are refused (Python 3.13 names them; 3.11 says "Expecting value").
    assert!(parse("[1,]").is_err());
    assert!(parse("{\"a\": 1,}").is_err());
    // Columns count characters, not bytes.
    let error = parse("[\"東京\" 1]").unwrap_err();
    assert_eq!((error.line, error.column, error.offset), (1, 7, 6));
}

#[test]
fn lone_surrogates_and_bad_utf8_are_refused() {
    for text in [
        r#""\ud83d""#,
        r#""\ude80""#,
        r#""\ud83d\u0041""#,
        r#""\ud83dx""#,
    ] {
        let error = parse(text).expect_err(text);
        assert!(error.message.contains("surrogate"), "{text}: {error}");
        assert_eq!(error.path, Some(FieldPath::root()), "{text}");
    }
    // The path of the value (or of the object whose key) holding one.
    let error = parse(
        r#"{"state": "ok", "questions": {"q1": {"type": "noul", "instructions": "a\ud800b"}}}"#,
    )
    .unwrap_err();
    let path = error.path.expect("a path");
    assert_eq!(path.to_string(), "questions.q1.instructions");
    let error = parse(r#"{"state": ["a", {"x": 1}, {"\udc00": 2}]}"#).unwrap_err();
    assert_eq!(error.path.expect("a path").to_string(), "state[2]");
    // A syntax error has only its offset.
    assert_eq!(parse(r#"{"a": "b" 1}"#).unwrap_err().path, None);
    let error = parse_bytes(b"[\"ok\", \"\xff\"]").unwrap_err();
    assert!(error.message.contains("UTF-8"), "{error}");
    assert_eq!(error.offset, 8);
}

#[test]
fn nesting_and_integer_size_are_bounded() {
    let deep_ok = "[".repeat(MAX_DEPTH - 1) + "[1,2,3,4,5,6,7,8]" + &"]".repeat(MAX_DEPTH - 1);
    let deepest = parse(&deep_ok).unwrap();
    // The recursive walks of the renderer stay within a test thread's stack at the deepest nesting.
    let text = prism_decision::render::state_text(&deepest);
    assert!(
        text.starts_with(&"[".repeat(MAX_DEPTH - 1))
            && text.contains("{\"_index\": 7, \"value\": 8}")
    );
    let too_deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
    assert!(parse(&too_deep).unwrap_err().message.contains("Nesting"));
    let deep_objects = "{\"a\": ".repeat(100_000);
    assert!(parse(&deep_objects).is_err());
    // CPython refuses int literals over 4300 digits.
    assert!(parse(&"7".repeat(4300)).is_ok());
    assert!(parse(&"7".repeat(4301))
        .unwrap_err()
        .message
        .contains("4300"));
}

#[test]
fn serde_view_of_values() {
    let value = parse(r#"{"b": 1, "a": [2.5, "x", null, 100000000000000000000, -0.0]}"#).unwrap();
    let json = serde_json::to_string(&value).unwrap();
    // Key order kept; an int beyond 64 bits becomes the nearest f64 (serde has no exact form for it).
    assert_eq!(json, r#"{"b":1,"a":[2.5,"x",null,1e+20,-0.0]}"#);
    let back = PyValue::from(&serde_json::json!({"k": [1, 2.0, "s"]}));
    assert_eq!(dumps(&back), r#"{"k": [1, 2.0, "s"]}"#);
}
