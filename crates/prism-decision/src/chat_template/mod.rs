//! The model's chat template (Jinja), rendered the way transformers' `apply_chat_template` does.
//!
//! transformers compiles templates in a sandboxed jinja2 environment with `trim_blocks` and
//! `lstrip_blocks`, the loop-controls extension, a `raise_exception` global and its own `tojson`
//! (`json.dumps(x, ensure_ascii=False)`, no HTML escaping). Templates also call Python string
//! methods (`content.startswith(..)`, `.split(..)`, `.rstrip('\n')`). We render with minijinja set up
//! the same way: pycompat methods for those calls, Python's whitespace for `strip()`/`|trim`
//! (it includes U+001C..U+001F, which Rust's `trim` does not), and a Python-compatible `tojson`.

mod prompt_format;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

use crate::pyjson;
use crate::tokenizer::{read_file, TokenizerConfig, TokenizerError};

pub use prompt_format::{
    PromptFormat, PromptFormatError, RenderedPrompt, LETTERS, NO_THINK_GENERATION_SUFFIX,
    THINK_GENERATION_SUFFIX,
};

/// The GGUF key holding the template (qwen35-reference §3.6).
pub const GGUF_CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat_template";

/// Who speaks in a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatRole {
    System,
    User,
    Assistant,
    Tool,
}

impl ChatRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

/// One part of a multimodal message. The template turns an image part into
/// `<|vision_start|><|image_pad|><|vision_end|>`; the engine expands the pad token later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentPart {
    Text(String),
    Image,
}

/// A message's content: plain text, or parts (text and images) in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One chat message as the template sees it: `{"role": .., "content": ..}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: MessageContent,
}

impl ChatMessage {
    pub fn new(role: ChatRole, text: impl Into<String>) -> Self {
        Self {
            role,
            content: MessageContent::Text(text.into()),
        }
    }

    pub fn system(text: impl Into<String>) -> Self {
        Self::new(ChatRole::System, text)
    }

    pub fn user(text: impl Into<String>) -> Self {
        Self::new(ChatRole::User, text)
    }

    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new(ChatRole::Assistant, text)
    }

    pub fn with_parts(role: ChatRole, parts: Vec<ContentPart>) -> Self {
        Self {
            role,
            content: MessageContent::Parts(parts),
        }
    }

    /// The message as a template value, shaped like the dicts transformers passes:
    /// `{"role", "content"}` with content a string or a list of `{"type": "text", "text"}` /
    /// `{"type": "image"}` (keys in that order, as Python dicts keep them).
    fn to_value(&self) -> Value {
        let content = match &self.content {
            MessageContent::Text(text) => Value::from(text.as_str()),
            MessageContent::Parts(parts) => parts
                .iter()
                .map(|part| match part {
                    ContentPart::Text(text) => FixedMap::value(
                        &["type", "text"],
                        vec![Value::from("text"), Value::from(text.as_str())],
                    ),
                    ContentPart::Image => FixedMap::value(&["type"], vec![Value::from("image")]),
                })
                .collect::<Vec<Value>>()
                .into(),
        };
        FixedMap::value(
            &["role", "content"],
            vec![Value::from(self.role.as_str()), content],
        )
    }
}

/// A dict with fixed keys in a fixed order (minijinja's own maps are built from serde or sorted).
#[derive(Debug)]
struct FixedMap {
    keys: &'static [&'static str],
    values: Vec<Value>,
}

impl FixedMap {
    fn value(keys: &'static [&'static str], values: Vec<Value>) -> Value {
        Value::from_object(FixedMap { keys, values })
    }
}

impl Object for FixedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        let index = self.keys.iter().position(|k| *k == key)?;
        self.values.get(index).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(self.keys)
    }
}

/// Options of one render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderOptions {
    /// End with the assistant's turn header (and the thinking prefix), ready for the answer.
    pub add_generation_prompt: bool,
    /// Qwen3.5's `enable_thinking`: false gives `<think>\n\n</think>\n\n`, true `<think>\n`.
    pub enable_thinking: bool,
}

/// Where the template text came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// `chat_template.jinja` in the model directory.
    JinjaFile(PathBuf),
    /// `chat_template` of `tokenizer_config.json`.
    TokenizerConfig(PathBuf),
    /// The GGUF key `tokenizer.chat_template`.
    Gguf,
    /// Given as a string.
    Inline,
}

impl std::fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateOrigin::JinjaFile(p) | TemplateOrigin::TokenizerConfig(p) => {
                write!(f, "{}", p.display())
            }
            TemplateOrigin::Gguf => write!(f, "GGUF {GGUF_CHAT_TEMPLATE_KEY}"),
            TemplateOrigin::Inline => write!(f, "inline template"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error(
        "no chat template: none of {dir}/chat_template.jinja, tokenizer_config.json's chat_template \
         or the GGUF key {GGUF_CHAT_TEMPLATE_KEY}"
    )]
    NotFound { dir: PathBuf },
    #[error(transparent)]
    File(#[from] TokenizerError),
    #[error("{path} is not UTF-8 text")]
    NotUtf8 { path: PathBuf },
    #[error("GGUF key {GGUF_CHAT_TEMPLATE_KEY} is {found}, not a string")]
    BadGgufValue { found: &'static str },
    #[error("chat template from {origin} does not compile: {message}")]
    Syntax {
        origin: TemplateOrigin,
        message: String,
    },
    #[error("chat template from {origin} failed to render: {message}")]
    Render {
        origin: TemplateOrigin,
        message: String,
    },
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: TemplateOrigin,
    /// `bos_token`/`eos_token`/`pad_token`: transformers passes the special tokens to templates.
    special_token_vars: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a template.
    pub fn new(
        source: impl Into<String>,
        origin: TemplateOrigin,
    ) -> Result<Self, ChatTemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatTemplateError::Syntax {
                    origin: origin.clone(),
                    message: e.to_string(),
                })?,
        );
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(|out, _state, value| {
            out.write_str(&python_str(value))
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
        });
        env.add_filter("string", |value: &Value| Value::from(python_str(value)));
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| ChatTemplateError::Syntax {
                origin: origin.clone(),
                message: describe(&e),
            })?;
        Ok(Self {
            env,
            source,
            origin,
            special_token_vars: Vec::new(),
        })
    }

    /// The template of a model: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template`, else the GGUF's `tokenizer.chat_template` (the order transformers and
    /// llama.cpp-converted releases agree on: the separate file wins).
    pub fn load(
        dir: &Path,
        tokenizer_config: Option<&TokenizerConfig>,
        gguf: Option<&prism_gguf::GgufFile>,
    ) -> Result<Self, ChatTemplateError> {
        let jinja_path = dir.join("chat_template.jinja");
        let mut template = match read_file(&jinja_path) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|_| ChatTemplateError::NotUtf8 {
                    path: jinja_path.clone(),
                })?;
                Self::new(text, TemplateOrigin::JinjaFile(jinja_path))?
            }
            Err(TokenizerError::MissingFile { .. }) => {
                if let Some(text) = tokenizer_config.and_then(|c| c.chat_template.clone()) {
                    Self::new(
                        text,
                        TemplateOrigin::TokenizerConfig(dir.join("tokenizer_config.json")),
                    )?
                } else if let Some(value) = gguf.and_then(|g| g.get(GGUF_CHAT_TEMPLATE_KEY)) {
                    let text = value.as_str().ok_or(ChatTemplateError::BadGgufValue {
                        found: value.type_name(),
                    })?;
                    Self::new(text, TemplateOrigin::Gguf)?
                } else {
                    return Err(ChatTemplateError::NotFound {
                        dir: dir.to_path_buf(),
                    });
                }
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(config) = tokenizer_config {
            template.set_special_tokens(None, config.eos_token.clone(), config.pad_token.clone());
        }
        Ok(template)
    }

    /// Sets the `bos_token`/`eos_token`/`pad_token` variables the template may use.
    pub fn set_special_tokens(
        &mut self,
        bos: Option<String>,
        eos: Option<String>,
        pad: Option<String>,
    ) {
        self.special_token_vars = [("bos_token", bos), ("eos_token", eos), ("pad_token", pad)]
            .into_iter()
            .filter_map(|(name, value)| value.map(|v| (name, v)))
            .collect();
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> &TemplateOrigin {
        &self.origin
    }

    /// Renders `messages` (no tools, no documents).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let template =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| ChatTemplateError::Render {
                    origin: self.origin.clone(),
                    message: describe(&e),
                })?;
        let mut vars: BTreeMap<&str, Value> = BTreeMap::new();
        let messages: Vec<Value> = messages.iter().map(ChatMessage::to_value).collect();
        vars.insert("messages", Value::from(messages));
        vars.insert(
            "add_generation_prompt",
            Value::from(options.add_generation_prompt),
        );
        vars.insert("enable_thinking", Value::from(options.enable_thinking));
        for (name, value) in &self.special_token_vars {
            vars.insert(name, Value::from(value.as_str()));
        }
        template
            .render(Value::from(vars))
            .map_err(|e| ChatTemplateError::Render {
                origin: self.origin.clone(),
                message: describe(&e),
            })
    }
}

/// An error with its detail and location, on one line.
fn describe(e: &Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        message.push_str(": ");
        message.push_str(&inner.to_string());
        source = inner.source();
    }
    message
}

/// transformers' `raise_exception(message)`: the render fails with that message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `str(value)` as Python prints scalars: `True`/`False`, `None`, floats as `repr` (`1e+16`,
/// `2.0`). Undefined prints as nothing. Lists and dicts keep minijinja's display (Python would
/// print their `repr`); no Qwen3.5 template prints a container.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_string(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_string(),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => pyjson::float_repr(f),
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Python's `str.strip`/`lstrip`/`rstrip` without arguments use Python's whitespace; the rest of
/// the Python methods come from minijinja-contrib's pycompat.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(text), true) = (value.as_str(), args.is_empty()) {
        let stripped = match method {
            "strip" => Some(text.trim_matches(pyjson::is_py_space)),
            "lstrip" => Some(text.trim_start_matches(pyjson::is_py_space)),
            "rstrip" => Some(text.trim_end_matches(pyjson::is_py_space)),
            _ => None,
        };
        if let Some(stripped) = stripped {
            return Ok(Value::from(stripped));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// jinja2's `trim(value, chars=None)`: Python's `str.strip(chars)`.
fn trim(value: &Value, chars: Option<String>) -> Result<Value, Error> {
    let text = value.to_string();
    let out = match chars {
        Some(chars) => {
            let set: Vec<char> = chars.chars().collect();
            text.trim_matches(&set[..]).to_string()
        }
        None => text.trim_matches(pyjson::is_py_space).to_string(),
    };
    Ok(if value.is_safe() {
        Value::from_safe_string(out)
    } else {
        Value::from(out)
    })
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`. Keyword arguments `indent`, `separators` and `sort_keys` are honoured;
/// `ensure_ascii=True` is refused rather than silently ignored.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson(ensure_ascii=True) is not supported",
        ));
    }
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "indent must be an integer or a string",
                    )
                })?;
                Some(" ".repeat(n.clamp(0, 64) as usize))
            }
        },
    };
    // Python's defaults: (', ', ': ') without indent, (',', ': ') with it.
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item(&Value::from(0))?;
            let b = v.get_item(&Value::from(1))?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be two strings",
                    ))
                }
            }
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let writer = JsonWriter {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    writer.write(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonWriter {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonWriter {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
        if depth > 256 {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value nested too deeply",
            ));
        }
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                // Integers print as integers and floats as Python's repr, even when integral
                // (`100.0`, `1e+16`, `-0.0`): `as_i64` alone would turn those into integers.
                if let (true, Ok(n)) = (value.is_integer(), i128::try_from(value.clone())) {
                    out.push_str(&n.to_string());
                } else {
                    let f = f64::try_from(value.clone()).map_err(|_| {
                        Error::new(ErrorKind::InvalidOperation, "tojson: unsupported number")
                    })?;
                    out.push_str(&pyjson::json_float(f));
                }
            }
            ValueKind::String => pyjson::write_string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_list(out, &items, depth)?;
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    pyjson::write_string(out, key);
                    out.push_str(&self.key_sep);
                    self.write(out, item, depth + 1)?;
                }
                self.newline(out, depth);
                out.push('}');
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON serializable", value.kind()),
                ))
            }
        }
        Ok(())
    }

    fn write_list(&self, out: &mut String, items: &[Value], depth: usize) -> Result<(), Error> {
        if items.is_empty() {
            out.push_str("[]");
            return Ok(());
        }
        out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            self.write(out, item, depth + 1)?;
        }
        self.newline(out, depth);
        out.push(']');
        Ok(())
    }
}

/// Python's json turns keys into strings: `true`/`false`/`null`, numbers as printed.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None | ValueKind::Undefined => "null".to_string(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => pyjson::json_float(f64::try_from(key.clone()).unwrap_or(f64::NAN)),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: keys must be str, int, float, bool or None",
            ))
        }
    })
}
