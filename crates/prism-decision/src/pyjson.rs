//! JSON the way Python's `json` module reads and writes it.
//!
//! The reference renderer serialises the evidence with `json.dumps(x, ensure_ascii=False)` after reading
//! the request with `json.loads`, so the prompt text depends on details that `serde_json` (without
//! `arbitrary_precision`, which we must not enable) loses: integers of any size print back exactly
//! (`100000000000000000000`), while numbers with a fraction or exponent are f64 and print with Python's
//! `repr` (`1e+16`, `-0.0`, `1e-07`). Object key order is kept, and a repeated key keeps its first position
//! with the last value, as a Python dict does.
//!
//! Deviations from `json.loads`, on purpose: lone UTF-16 surrogates (`"\ud800"`) are rejected (a Rust
//! `String` cannot hold them) with the path of the value or key that holds one ([`JsonError::path`]),
//! nesting is bounded by [`MAX_DEPTH`], and input must be UTF-8 (a leading byte-order mark is skipped).

use std::collections::HashMap;
use std::fmt;

use crate::error::{FieldPath, LocPart};

/// Deepest nesting of arrays and objects accepted by [`parse`]. Python stops near 1,000 (its recursion
/// limit); we stop earlier so that every recursive walk of a value stays far from the stack's end.
pub const MAX_DEPTH: usize = 512;

/// Longest integer literal accepted, in digits: Python's `int` refuses longer strings (`sys.int_info`
/// `default_max_str_digits`).
pub const MAX_INT_DIGITS: usize = 4300;

/// A JSON value as Python holds it after `json.loads`.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    Null,
    Bool(bool),
    /// A number written without fraction or exponent: a Python `int` of any size.
    Int(PyInt),
    /// A number written with a fraction or an exponent: a Python `float` (may be infinite or NaN, as
    /// `json.loads` accepts `1e400`, `Infinity` and `NaN`).
    Float(f64),
    Str(String),
    Array(Vec<PyValue>),
    Object(PyObject),
}

/// An integer of any size, kept as its canonical decimal text (optional `-`, no leading zeros, never `-0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyInt(String);

impl PyInt {
    /// The integer's decimal text, exactly as Python's `str(int)` prints it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn to_i64(&self) -> Option<i64> {
        self.0.parse().ok()
    }

    pub fn to_u64(&self) -> Option<u64> {
        self.0.parse().ok()
    }

    /// The nearest f64 (Python's `float(int)`, except that huge values become infinite instead of raising).
    pub fn to_f64(&self) -> f64 {
        // Decimal integer text always parses as f64 (correctly rounded, overflow to infinity).
        self.0.parse().unwrap_or(f64::NAN)
    }

    /// Makes the canonical form from a validated literal: digits with an optional leading `-`.
    fn from_literal(text: &str) -> PyInt {
        if text == "-0" {
            PyInt("0".to_string())
        } else {
            PyInt(text.to_string())
        }
    }
}

impl From<i64> for PyInt {
    fn from(value: i64) -> Self {
        PyInt(value.to_string())
    }
}

impl From<u64> for PyInt {
    fn from(value: u64) -> Self {
        PyInt(value.to_string())
    }
}

impl From<usize> for PyInt {
    fn from(value: usize) -> Self {
        PyInt(value.to_string())
    }
}

/// An object with Python dict semantics: insertion order, and re-inserting a key replaces its value
/// in place.
#[derive(Debug, Clone, Default)]
pub struct PyObject {
    entries: Vec<(String, PyValue)>,
    index: HashMap<String, usize>,
}

impl PartialEq for PyObject {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl PyObject {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`: a new key goes last, an existing key keeps its position.
    pub fn insert(&mut self, key: String, value: PyValue) {
        match self.index.get(&key) {
            Some(&position) => self.entries[position].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&PyValue> {
        self.index
            .get(key)
            .map(|&position| &self.entries[position].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &PyValue)> {
        self.entries
            .iter()
            .map(|(key, value)| (key.as_str(), value))
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(key, _)| key.as_str())
    }
}

impl FromIterator<(String, PyValue)> for PyObject {
    fn from_iter<I: IntoIterator<Item = (String, PyValue)>>(iter: I) -> Self {
        let mut object = PyObject::new();
        for (key, value) in iter {
            object.insert(key, value);
        }
        object
    }
}

impl PyValue {
    /// The name of the value's JSON type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            PyValue::Null => "null",
            PyValue::Bool(_) => "boolean",
            PyValue::Int(_) => "integer",
            PyValue::Float(_) => "number",
            PyValue::Str(_) => "string",
            PyValue::Array(_) => "array",
            PyValue::Object(_) => "object",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&PyObject> {
        match self {
            PyValue::Object(object) => Some(object),
            _ => None,
        }
    }

    /// The value as a float if it is any number (Python `int` or `float`).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            PyValue::Int(int) => Some(int.to_f64()),
            PyValue::Float(value) => Some(*value),
            _ => None,
        }
    }

    /// `json.dumps(self, ensure_ascii=False)`.
    pub fn dumps(&self) -> String {
        dumps(self)
    }
}

impl From<&serde_json::Value> for PyValue {
    /// Converts a `serde_json` value. serde_json has already turned large integers into floats, so this is
    /// exact only for integers that fit in 64 bits; parse text with [`parse`] to keep every literal.
    fn from(value: &serde_json::Value) -> Self {
        match value {
            serde_json::Value::Null => PyValue::Null,
            serde_json::Value::Bool(flag) => PyValue::Bool(*flag),
            serde_json::Value::Number(number) => {
                if let Some(int) = number.as_i64() {
                    PyValue::Int(PyInt::from(int))
                } else if let Some(int) = number.as_u64() {
                    PyValue::Int(PyInt::from(int))
                } else {
                    PyValue::Float(number.as_f64().unwrap_or(f64::NAN))
                }
            }
            serde_json::Value::String(text) => PyValue::Str(text.clone()),
            serde_json::Value::Array(items) => {
                PyValue::Array(items.iter().map(PyValue::from).collect())
            }
            serde_json::Value::Object(map) => PyValue::Object(
                map.iter()
                    .map(|(key, item)| (key.clone(), PyValue::from(item)))
                    .collect(),
            ),
        }
    }
}

impl serde::Serialize for PyValue {
    /// Integers beyond 64 bits are written as the nearest f64 (serde has no way to write the exact digits
    /// without `arbitrary_precision`); NaN and infinities become `null`, as serde_json writes them.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            PyValue::Null => serializer.serialize_unit(),
            PyValue::Bool(flag) => serializer.serialize_bool(*flag),
            PyValue::Int(int) => {
                if let Some(value) = int.to_i64() {
                    serializer.serialize_i64(value)
                } else if let Some(value) = int.to_u64() {
                    serializer.serialize_u64(value)
                } else {
                    serializer.serialize_f64(int.to_f64())
                }
            }
            PyValue::Float(value) => serializer.serialize_f64(*value),
            PyValue::Str(text) => serializer.serialize_str(text),
            PyValue::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            PyValue::Object(object) => {
                let mut map = serializer.serialize_map(Some(object.len()))?;
                for (key, item) in object.iter() {
                    map.serialize_entry(key, item)?;
                }
                map.end()
            }
        }
    }
}

/// Why a text is not JSON, and where (1-based line and column, 0-based character offset, as Python
/// reports them).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}: line {line} column {column} (char {offset})")]
pub struct JsonError {
    pub message: String,
    pub line: usize,
    pub column: usize,
    pub offset: usize,
    /// For a text that is JSON but holds a string no Rust `String` can (a lone surrogate escape), the
    /// place of that string in the document: the keys and indexes leading to the value, or to the
    /// object whose key holds it (`["questions", "q1", "instructions"]`; empty for the top level).
    /// `None` for syntax errors, which only the offset can place.
    pub path: Option<FieldPath>,
}

impl JsonError {
    /// The error as seen from one level up: `step` (the key or index of the value that failed) is put
    /// in front of the path, when there is one.
    fn within(mut self, step: impl FnOnce() -> LocPart) -> Self {
        if let Some(path) = &mut self.path {
            path.0.insert(0, step());
        }
        self
    }
}

/// Parses UTF-8 bytes (a leading byte-order mark is skipped).
pub fn parse_bytes(bytes: &[u8]) -> Result<PyValue, JsonError> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    match std::str::from_utf8(bytes) {
        Ok(text) => parse(text),
        Err(error) => {
            let valid = &bytes[..error.valid_up_to()];
            // The prefix is valid UTF-8 by construction.
            let prefix = std::str::from_utf8(valid).unwrap_or("");
            Err(error_at(prefix, prefix.len(), "invalid UTF-8".to_string()))
        }
    }
}

/// Parses one JSON document as `json.loads` would (see the module notes for the deviations).
pub fn parse(text: &str) -> Result<PyValue, JsonError> {
    let mut parser = Parser {
        text,
        bytes: text.as_bytes(),
        pos: 0,
    };
    parser.skip_whitespace();
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != parser.bytes.len() {
        return Err(parser.error("Extra data"));
    }
    Ok(value)
}

fn error_at(text: &str, byte_pos: usize, message: String) -> JsonError {
    let before = text.get(..byte_pos).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|p| p + 1).unwrap_or(0);
    let column = before[line_start..].chars().count() + 1;
    JsonError {
        message,
        line,
        column,
        offset: before.chars().count(),
        path: None,
    }
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, message: &str) -> JsonError {
        error_at(self.text, self.pos, message.to_string())
    }

    fn error_at(&self, pos: usize, message: String) -> JsonError {
        error_at(self.text, pos, message)
    }

    /// A lone surrogate escape: valid JSON, but not a character, so the value holding it is refused
    /// with its path (filled in on the way up, by the containers).
    fn lone_surrogate(&self, pos: usize, unit: u32) -> JsonError {
        let mut error = self.error_at(
            pos,
            format!("Lone surrogate \\u{unit:04x} (not a character)"),
        );
        error.path = Some(FieldPath::root());
        error
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn starts_with(&self, literal: &str) -> bool {
        self.bytes[self.pos..].starts_with(literal.as_bytes())
    }

    fn value(&mut self, depth: usize) -> Result<PyValue, JsonError> {
        let Some(byte) = self.peek() else {
            return Err(self.error("Expecting value"));
        };
        match byte {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => Ok(PyValue::Str(self.string()?)),
            b'-' if self.starts_with("-Infinity") => {
                self.pos += "-Infinity".len();
                Ok(PyValue::Float(f64::NEG_INFINITY))
            }
            b'-' | b'0'..=b'9' => self.number(),
            _ => {
                for (literal, value) in [
                    ("null", PyValue::Null),
                    ("true", PyValue::Bool(true)),
                    ("false", PyValue::Bool(false)),
                    ("NaN", PyValue::Float(f64::NAN)),
                    ("Infinity", PyValue::Float(f64::INFINITY)),
                ] {
                    if self.starts_with(literal) {
                        self.pos += literal.len();
                        return Ok(value);
                    }
                }
                Err(self.error("Expecting value"))
            }
        }
    }

    fn check_depth(&self, depth: usize) -> Result<(), JsonError> {
        if depth > MAX_DEPTH {
            return Err(self.error_at(self.pos, format!("Nesting deeper than {MAX_DEPTH} levels")));
        }
        Ok(())
    }

    /// Enters an object or array at `depth`: consumes its opening byte, and returns `true` (consuming
    /// `close` too) where it is empty.
    fn open_container(&mut self, depth: usize, close: u8) -> Result<bool, JsonError> {
        self.check_depth(depth)?;
        self.pos += 1;
        self.skip_whitespace();
        if self.peek() == Some(close) {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn object(&mut self, depth: usize) -> Result<PyValue, JsonError> {
        let mut object = PyObject::new();
        if self.open_container(depth, b'}')? {
            return Ok(PyValue::Object(object));
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.error("Expecting property name enclosed in double quotes"));
            }
            let key = self.string()?;
            self.skip_whitespace();
            if self.peek() != Some(b':') {
                return Err(self.error("Expecting ':' delimiter"));
            }
            self.pos += 1;
            self.skip_whitespace();
            let value = match self.value(depth) {
                Ok(value) => value,
                Err(error) => return Err(error.within(|| LocPart::Key(key))),
            };
            object.insert(key, value);
            if self.after_element(b'}', "object")? {
                return Ok(PyValue::Object(object));
            }
        }
    }

    /// After an array item or object member: consumes `,` (refusing a trailing comma before `close`, as
    /// Python does) and returns `false`, or consumes `close` and returns `true`.
    fn after_element(&mut self, close: u8, container: &str) -> Result<bool, JsonError> {
        self.skip_whitespace();
        match self.peek() {
            Some(b',') => {
                let comma = self.pos;
                self.pos += 1;
                self.skip_whitespace();
                if self.peek() == Some(close) {
                    return Err(self.error_at(
                        comma,
                        format!("Illegal trailing comma before end of {container}"),
                    ));
                }
                Ok(false)
            }
            Some(c) if c == close => {
                self.pos += 1;
                Ok(true)
            }
            _ => Err(self.error("Expecting ',' delimiter")),
        }
    }

    fn array(&mut self, depth: usize) -> Result<PyValue, JsonError> {
        let mut items = Vec::new();
        if self.open_container(depth, b']')? {
            return Ok(PyValue::Array(items));
        }
        loop {
            let index = items.len();
            items.push(
                self.value(depth)
                    .map_err(|error| error.within(|| LocPart::Index(index)))?,
            );
            if self.after_element(b']', "array")? {
                return Ok(PyValue::Array(items));
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`: an int without fraction and exponent, else a float.
    fn number(&mut self) -> Result<PyValue, JsonError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error_at(start, "Expecting value".into())),
        }
        let mut is_float = false;
        if self.peek() == Some(b'.') && matches!(self.bytes.get(self.pos + 1), Some(b'0'..=b'9')) {
            self.pos += 1;
            self.digits();
            is_float = true;
        }
        if let Some(b'e' | b'E') = self.peek() {
            let mut ahead = self.pos + 1;
            if let Some(b'+' | b'-') = self.bytes.get(ahead) {
                ahead += 1;
            }
            if matches!(self.bytes.get(ahead), Some(b'0'..=b'9')) {
                self.pos = ahead;
                self.digits();
                is_float = true;
            }
        }
        let literal = &self.text[start..self.pos];
        if is_float {
            // Rust's parse is correctly rounded like Python's float(); overflow gives infinity like Python.
            literal
                .parse::<f64>()
                .map(PyValue::Float)
                .map_err(|_| self.error_at(start, format!("Invalid number {literal:?}")))
        } else {
            let digits = literal.trim_start_matches('-').len();
            if digits > MAX_INT_DIGITS {
                return Err(self.error_at(
                    start,
                    format!("Integer literal of {digits} digits exceeds the limit of {MAX_INT_DIGITS} digits"),
                ));
            }
            Ok(PyValue::Int(PyInt::from_literal(literal)))
        }
    }

    fn hex4(&self, at: usize) -> Option<u32> {
        let hex = self.bytes.get(at..at + 4)?;
        let text = std::str::from_utf8(hex).ok()?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(text, 16).ok()
    }

    fn string(&mut self) -> Result<String, JsonError> {
        let start = self.pos;
        self.pos += 1; // '"'
        let mut out = String::new();
        loop {
            let chunk_start = self.pos;
            while let Some(byte) = self.peek() {
                if byte == b'"' || byte == b'\\' || byte < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // The chunk is bounded by ASCII bytes, so it is a valid UTF-8 slice of the input.
            out.push_str(&self.text[chunk_start..self.pos]);
            match self.peek() {
                None => return Err(self.error_at(start, "Unterminated string starting at".into())),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => self.escape(&mut out)?,
                Some(_) => return Err(self.error("Invalid control character at")),
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Result<(), JsonError> {
        let escape_at = self.pos;
        let Some(kind) = self.bytes.get(self.pos + 1).copied() else {
            return Err(self.error_at(escape_at, "Unterminated string starting at".into()));
        };
        self.pos += 2;
        let simple = match kind {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self
                    .hex4(self.pos)
                    .ok_or_else(|| self.error_at(escape_at, "Invalid \\uXXXX escape".into()))?;
                self.pos += 4;
                let code = match unit {
                    0xD800..=0xDBFF => {
                        let low = if self.bytes.get(self.pos..self.pos + 2) == Some(b"\\u") {
                            self.hex4(self.pos + 2)
                                .filter(|low| (0xDC00..=0xDFFF).contains(low))
                        } else {
                            None
                        };
                        let Some(low) = low else {
                            return Err(self.lone_surrogate(escape_at, unit));
                        };
                        self.pos += 6;
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return Err(self.lone_surrogate(escape_at, unit)),
                    _ => unit,
                };
                // Surrogates were handled above, so every remaining code is a scalar value.
                char::from_u32(code)
                    .ok_or_else(|| self.error_at(escape_at, "Invalid \\uXXXX escape".into()))?
            }
            _ => return Err(self.error_at(escape_at, "Invalid \\escape".into())),
        };
        out.push(simple);
        Ok(())
    }
}

/// `json.dumps(value, ensure_ascii=False)` with the default separators `, ` and `: `.
pub fn dumps(value: &PyValue) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

/// Appends `json.dumps(value, ensure_ascii=False)` to `out`.
pub fn write_value(out: &mut String, value: &PyValue) {
    match value {
        PyValue::Null => out.push_str("null"),
        PyValue::Bool(true) => out.push_str("true"),
        PyValue::Bool(false) => out.push_str("false"),
        PyValue::Int(int) => out.push_str(int.as_str()),
        PyValue::Float(number) => out.push_str(&json_float(*number)),
        PyValue::Str(text) => write_string(out, text),
        PyValue::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, item);
            }
            out.push(']');
        }
        PyValue::Object(object) => {
            out.push('{');
            for (i, (key, item)) in object.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_string(out, key);
                out.push_str(": ");
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

/// A string literal as `json.dumps(..., ensure_ascii=False)` writes it: only `"`, `\` and the control
/// characters below U+0020 are escaped; everything else (U+007F, non-ASCII) stays raw.
pub fn write_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as `json.dumps` writes it: `repr`, with `NaN`, `Infinity` and `-Infinity` for the rest.
pub fn json_float(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_string()
    } else if value.is_infinite() {
        if value > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else {
        float_repr(value)
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip; positional notation when the decimal
/// exponent is in -4..16 (with `.0` for integral values), else `d.ddde±XX` with at least two exponent
/// digits. Non-finite values print as Python's `inf`, `-inf`, `nan`.
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".to_string();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .to_string();
    }
    // Rust's `{:e}` prints the shortest round-trip digits (the same digits as Python's repr, which also
    // takes the shortest string, nearest to the exact value) in the form `-d.ddde-7`.
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let int_len = exponent as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exponent < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exponent.unsigned_abs()));
    }
    out
}

impl fmt::Display for PyValue {
    /// The value as `json.dumps(value, ensure_ascii=False)` prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&dumps(self))
    }
}

/// Python's `str.isspace` for one character (Unicode White_Space plus the separators U+001C..U+001F).
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` with no argument.
pub fn py_strip(text: &str) -> &str {
    text.trim_matches(is_py_space)
}
