//! Chat template and prompt format tests.
//!
//! References: `qwen35-tiny/prompts.json` (rendered and tokenized by transformers 5.24.0) and, for
//! template behaviour beyond those prompts, renders by jinja2 3.1.6 set up as transformers'
//! `_compile_jinja_template` (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls, `tojson` =
//! `json.dumps(x, ensure_ascii=False, ...)`, `raise_exception`) of the fixture's real Qwen3.5 template
//! and of `FEATURES_TEMPLATE` below: `JINJA2_REFERENCE` holds jinja2's output verbatim (generated
//! with a throwaway script outside the repository; the inputs are in the JSON next to the outputs).

use std::path::{Path, PathBuf};

use common::{ids_of, read_json};
use prism_decision::chat_template::{
    ChatMessage, ChatRole, ChatTemplate, ChatTemplateError, ContentPart, PromptFormat,
    PromptFormatError, RenderOptions, TemplateOrigin, LETTERS,
};
use prism_decision::tokenizer::{PromptTokenizer, TokenizerJsonPipeline};
use prism_gguf::GgufFile;
use serde_json::Value;

mod common;

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

/// Messages in the JSON shape transformers takes.
fn messages_of(value: &Value) -> Vec<ChatMessage> {
    value
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let role = match m["role"].as_str().expect("role") {
                "system" => ChatRole::System,
                "user" => ChatRole::User,
                "assistant" => ChatRole::Assistant,
                "tool" => ChatRole::Tool,
                other => panic!("role {other}"),
            };
            match &m["content"] {
                Value::String(text) => ChatMessage::new(role, text.clone()),
                Value::Array(parts) => ChatMessage::with_parts(
                    role,
                    parts
                        .iter()
                        .map(|p| match p["type"].as_str() {
                            Some("image") => ContentPart::Image,
                            Some("text") => {
                                ContentPart::Text(p["text"].as_str().expect("text").to_string())
                            }
                            other => panic!("part type {other:?}"),
                        })
                        .collect(),
                ),
                other => panic!("content {other}"),
            }
        })
        .collect()
}

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("prism-chat-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn copy(&self, name: &str) {
        std::fs::copy(tiny_dir().join(name), self.0.join(name)).unwrap();
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Checks the 12 thinking-off prompts and the 3 thinking-on prompts of prompts.json: rendered text
/// and ids exactly as transformers made them.
fn assert_reproduces_prompts(format: &PromptFormat) -> usize {
    let prompts = read_json(&tiny_dir().join("prompts.json"));
    let list = prompts["prompts"].as_array().unwrap();
    let mut checked = 0;
    // Renders `messages` and compares text and ids with the reference entry `p`.
    let mut check = |messages: &Value, thinking: bool, p: &Value| {
        let rendered = format
            .render_and_encode(&messages_of(messages), thinking)
            .unwrap();
        assert_eq!(
            rendered.text,
            p["text"].as_str().unwrap(),
            "prompt {}",
            p["name"]
        );
        assert_eq!(rendered.ids, ids_of(&p["ids"]), "prompt {}", p["name"]);
        checked += 1;
    };
    for p in list {
        check(&p["messages"], p["enable_thinking"].as_bool().unwrap(), p);
    }
    for p in prompts["thinking_prompts"].as_array().unwrap() {
        let from = &list[p["from_prompt"].as_u64().unwrap() as usize];
        assert!(p["enable_thinking"].as_bool().unwrap());
        check(&from["messages"], true, p);
    }
    checked
}

#[test]
fn model_dir_reproduces_the_transformers_prompts() {
    let started = std::time::Instant::now();
    let format = PromptFormat::load_from_model_dir(&tiny_dir(), None).unwrap();
    eprintln!(
        "PromptFormat (tiny model dir) loaded and checked in {:?}",
        started.elapsed()
    );
    assert_eq!(
        format.template().origin(),
        &TemplateOrigin::JinjaFile(tiny_dir().join("chat_template.jinja"))
    );
    assert_eq!(assert_reproduces_prompts(&format), 15);
    // generation_config.json eos_token_id [4098, 4096].
    assert_eq!(format.eos_ids(), &[4096, 4098]);
    assert!(format.supports_thinking());
}

#[test]
fn prompt_format_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<PromptFormat>();
}

#[test]
fn gguf_alone_reproduces_the_transformers_prompts() {
    // Tokenizer from the GGUF vocabulary and template from its tokenizer.chat_template key.
    let empty = ScratchDir::new("gguf-only");
    let gguf = GgufFile::open(tiny_dir().join("tiny-Q8_0.gguf")).unwrap();
    let format = PromptFormat::load_from_model_dir(&empty.0, Some(&gguf)).unwrap();
    assert_eq!(format.template().origin(), &TemplateOrigin::Gguf);
    assert_eq!(assert_reproduces_prompts(&format), 15);
    // GGUF eos <|im_end|> plus <|im_end|>/<|endoftext|>.
    assert_eq!(format.eos_ids(), &[4096, 4098]);
}

#[test]
fn template_sources_in_priority_order() {
    let jinja = std::fs::read_to_string(tiny_dir().join("chat_template.jinja")).unwrap();
    let gguf = GgufFile::open(tiny_dir().join("tiny-BF16.gguf")).unwrap();

    // chat_template.jinja wins over tokenizer_config.json and the GGUF.
    let format = PromptFormat::load_from_model_dir(&tiny_dir(), Some(&gguf)).unwrap();
    assert!(matches!(
        format.template().origin(),
        TemplateOrigin::JinjaFile(_)
    ));
    assert_eq!(format.template().source(), jinja);

    // Without it, tokenizer_config.json's chat_template (the same text, per the fixture README).
    let dir = ScratchDir::new("config-template");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        dir.copy(f);
    }
    let format = PromptFormat::load_from_model_dir(&dir.0, Some(&gguf)).unwrap();
    assert_eq!(
        format.template().origin(),
        &TemplateOrigin::TokenizerConfig(dir.0.join("tokenizer_config.json"))
    );
    assert_eq!(format.template().source(), jinja);
    assert_eq!(assert_reproduces_prompts(&format), 15);

    // Then the GGUF key.
    let dir = ScratchDir::new("gguf-template");
    dir.copy("tokenizer.json");
    let format = PromptFormat::load_from_model_dir(&dir.0, Some(&gguf)).unwrap();
    assert_eq!(format.template().origin(), &TemplateOrigin::Gguf);
    assert_eq!(format.template().source(), jinja);

    // None at all.
    let err = PromptFormat::load_from_model_dir(&dir.0, None).unwrap_err();
    assert!(
        matches!(
            err,
            PromptFormatError::Template(ChatTemplateError::NotFound { .. })
        ),
        "{err}"
    );
    // No tokenizer at all.
    let empty = ScratchDir::new("nothing");
    let err = PromptFormat::load_from_model_dir(&empty.0, None).unwrap_err();
    assert!(
        matches!(err, PromptFormatError::NoTokenizer { .. }),
        "{err}"
    );
}

#[test]
fn letter_ids_are_single_tokens_after_the_no_think_prefix() {
    let format = PromptFormat::load_from_model_dir(&tiny_dir(), None).unwrap();
    // The reference: tokenizer.json's own vocabulary entries for "A".."Z".
    let vocab = read_json(&tiny_dir().join("tokenizer.json"))["model"]["vocab"].clone();
    let expected: Vec<u32> = LETTERS
        .iter()
        .map(|l| vocab[l.to_string()].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(format.letter_ids().as_slice(), expected.as_slice());
    assert_eq!(format.letter_id('C'), Some(expected[2]));
    assert_eq!(format.letter_id('c'), None);
    // In prompt 0 (transformers' ids) the option letters "A)" .. "C)" are these ids too.
    let prompt0 = read_json(&tiny_dir().join("prompts.json"))["prompts"][0]["ids"].clone();
    let ids = ids_of(&prompt0);
    for (letter, &id) in LETTERS.iter().zip(&expected).take(3) {
        assert!(
            ids.windows(2).any(|w| w == [id, 8]),
            "letter {letter} then ')'"
        );
    }

    format.check_letter_token_ids(&expected).unwrap();
    let mut wrong = expected.clone();
    wrong[2] += 1;
    let err = format.check_letter_token_ids(&wrong).unwrap_err();
    assert!(
        matches!(err, PromptFormatError::LetterIdMismatch { letter: 'C', .. }),
        "{err}"
    );
    assert!(err.to_string().contains(" C "), "{err}");
    let err = format.check_letter_token_ids(&expected[..25]).unwrap_err();
    assert!(
        matches!(err, PromptFormatError::LetterCount { found: 25 }),
        "{err}"
    );
}

fn tiny_tokenizer() -> PromptTokenizer {
    PromptTokenizer::from_model_dir(&tiny_dir()).unwrap()
}

fn fixture_template() -> ChatTemplate {
    ChatTemplate::new(
        std::fs::read_to_string(tiny_dir().join("chat_template.jinja")).unwrap(),
        TemplateOrigin::Inline,
    )
    .unwrap()
}

#[test]
fn a_template_without_the_no_think_prefix_is_refused() {
    // A Qwen2.5-style template: the generation prompt stops at the assistant header.
    let template = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        TemplateOrigin::Inline,
    )
    .unwrap();
    let err = PromptFormat::new(tiny_tokenizer(), template).unwrap_err();
    assert!(
        matches!(&err, PromptFormatError::GenerationPromptSuffix { tail, .. } if tail.ends_with("<|im_start|>assistant\n")),
        "{err}"
    );
    // A template that fails to render is a render error, not a panic.
    let template = ChatTemplate::new(
        "{{ raise_exception('broken on purpose') }}",
        TemplateOrigin::Inline,
    )
    .unwrap();
    let err = PromptFormat::new(tiny_tokenizer(), template).unwrap_err();
    assert!(err.to_string().contains("broken on purpose"), "{err}");
    // A template that does not compile.
    let err = ChatTemplate::new("{% if %}", TemplateOrigin::Inline).unwrap_err();
    assert!(matches!(err, ChatTemplateError::Syntax { .. }), "{err}");
}

#[test]
fn a_tokenizer_that_merges_a_letter_into_the_prefix_is_refused() {
    // The tiny tokenizer.json without the split regex (so "\n\nB" is one piece) and with its last
    // rank replaced by "\n\nB" (merge "ĊĊ" + "B"): B is no longer one token after the prefix.
    let mut json = read_json(&tiny_dir().join("tokenizer.json"));
    json["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let last = vocab
        .iter()
        .find(|(_, id)| id.as_u64() == Some(4095))
        .map(|(k, _)| k.clone())
        .unwrap();
    vocab.remove(&last);
    vocab.insert("ĊĊB".to_string(), Value::from(4095));
    let merges = json["model"]["merges"].as_array_mut().unwrap();
    *merges.last_mut().unwrap() = serde_json::json!(["ĊĊ", "B"]);
    let bytes = serde_json::to_vec(&json).unwrap();
    let tokenizer = PromptTokenizer::from_tokenizer_json_bytes(
        &bytes,
        Path::new("crafted/tokenizer.json"),
        TokenizerJsonPipeline::AsWritten,
    )
    .unwrap();
    let err = PromptFormat::new(tokenizer, fixture_template()).unwrap_err();
    assert!(
        matches!(&err, PromptFormatError::LetterNotOneToken { letter: 'B', tail, .. } if tail == &[4095]),
        "{err}"
    );
    assert!(err.to_string().contains("letter B"), "{err}");
}

#[test]
fn bad_generation_config_is_a_typed_error() {
    let dir = ScratchDir::new("bad-genconfig");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        dir.copy(f);
    }
    // The directory with generation_config.json holding `text`.
    let load_with = |text: &[u8]| {
        std::fs::write(dir.0.join("generation_config.json"), text).unwrap();
        PromptFormat::load_from_model_dir(&dir.0, None)
    };
    let err = load_with(b"{\"eos_token_id\": [4098, 99999]}").unwrap_err();
    assert!(
        matches!(&err, PromptFormatError::BadGenerationConfig { message, .. } if message.contains("99999")),
        "{err}"
    );
    let err = load_with(b"{\"eos_token_id\": \"x\"").unwrap_err();
    assert!(
        matches!(err, PromptFormatError::BadGenerationConfig { .. }),
        "{err}"
    );
    let format = load_with(b"{\"eos_token_id\": 4097}").unwrap();
    assert_eq!(format.eos_ids(), &[4096, 4097, 4098]);
}

#[test]
fn renders_match_jinja2_with_transformers_settings() {
    let reference: Value = serde_json::from_str(JINJA2_REFERENCE).unwrap();
    let qwen = fixture_template();
    let features = ChatTemplate::new(FEATURES_TEMPLATE, TemplateOrigin::Inline).unwrap();
    let mut checked = 0;
    for case in reference["cases"].as_array().unwrap() {
        let template = match case["template"].as_str().unwrap() {
            "qwen35" => &qwen,
            _ => &features,
        };
        let options = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            enable_thinking: case["enable_thinking"].as_bool().unwrap(),
        };
        let result = template.render(&messages_of(&case["messages"]), options);
        let name = case["name"].as_str().unwrap();
        match (
            case.get("text").and_then(Value::as_str),
            case.get("error").and_then(Value::as_str),
        ) {
            (Some(text), None) => assert_eq!(result.unwrap(), text, "case {name}"),
            (None, Some(error)) => {
                let err = result.unwrap_err();
                assert!(
                    matches!(err, ChatTemplateError::Render { .. }),
                    "case {name}: {err}"
                );
                assert!(
                    err.to_string().contains(error),
                    "case {name}: {err} lacks {error:?}"
                );
            }
            _ => panic!("case {name} has neither text nor error"),
        }
        checked += 1;
    }
    assert_eq!(checked, 13);
}

/// Exercises loop controls, namespace, reversed slicing, Python string methods and whitespace,
/// `tojson` options, Python scalar printing and `|items` order.
const FEATURES_TEMPLATE: &str = r##"{%- set ns = namespace(count=0, last='') -%}
{%- for m in messages[::-1] -%}
{%- if loop.index > 3 %}{% break %}{% endif -%}
{%- if m.role == 'assistant' %}{% continue %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
{%- set ns.last = m.role -%}
[{{ loop.index0 }}:{{ m.role }}:{{ m.content|trim }}:{{ m.content.strip()|length }}:{{ m.content.rstrip('x')|length }}:{{ m.content.lstrip()|length }}]
{% endfor -%}
count={{ ns.count }} last={{ ns.last }}
{{ messages|tojson }}
{{ messages|tojson(indent=2) }}
{{ messages[0]|tojson(sort_keys=true) }}
{{ [1, 2.5, 1e16, 1e-7, -0.0, 100.0, true, none, "é\"\n\u0001"]|tojson }}
{{ {"b": 1, "a": [1, {"c": none}], "d": []}|tojson(indent=1, separators=(",", ":")) }}
{{ "a,b,,c".split(",")|join("|") }} {{ "  x  ".lstrip() }}| {{ "Hello".startswith("He") }} {{ "abc".endswith("bc") }} {{ "x</think>y".split("</think>")[-1] }}
{{ 2.0 }} {{ 1e16 }} {{ 3 / 2 }} {{ 7 // 2 }} {{ true }} {{ none }} {{ false|string }} {{ 0.1 + 0.2 }}
{%- for k, v in {"z": 1, "a": 2}|items %} {{ k }}={{ v }}{% endfor %}

{% if add_generation_prompt %}GEN {{ enable_thinking }}{% endif %}
"##;

/// jinja2 3.1.6's renders (transformers' environment) of the cases below.
// Kept as jinja2's script wrote it: cases repeat the same messages on purpose, each one a whole
// input next to its output, so the reference can be compared with a fresh run line for line.
const JINJA2_REFERENCE: &str = r##"{
 "jinja2": "3.1.6",
 "cases": [
  {
   "template": "qwen35",
   "name": "multi_turn_with_reasoning",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": "Q1?"
    },
    {
     "role": "assistant",
     "content": "<think>\nI weigh it.\n</think>\n\nA"
    },
    {
     "role": "user",
     "content": "Q2?"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "text": "<|im_start|>system\nYou decide.<|im_end|>\n<|im_start|>user\nQ1?<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  },
  {
   "template": "qwen35",
   "name": "multi_turn_thinking_on",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": "Q1?"
    },
    {
     "role": "assistant",
     "content": "B"
    },
    {
     "role": "user",
     "content": "Q2?"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": true,
   "text": "<|im_start|>system\nYou decide.<|im_end|>\n<|im_start|>user\nQ1?<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
  },
  {
   "template": "qwen35",
   "name": "reasoning_after_last_query",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": "Q1?"
    },
    {
     "role": "assistant",
     "content": "<think>\nwhy\n</think>\n\nC"
    }
   ],
   "add_generation_prompt": false,
   "enable_thinking": false,
   "text": "<|im_start|>system\nYou decide.<|im_end|>\n<|im_start|>user\nQ1?<|im_end|>\n<|im_start|>assistant\n<think>\nwhy\n</think>\n\nC<|im_end|>\n"
  },
  {
   "template": "qwen35",
   "name": "images",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": [
      {
       "type": "image"
      },
      {
       "type": "text",
       "text": "\n\nWhat is shown?"
      },
      {
       "type": "image"
      }
     ]
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "text": "<|im_start|>system\nYou decide.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\n\nWhat is shown?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  },
  {
   "template": "qwen35",
   "name": "tool_turns",
   "messages": [
    {
     "role": "user",
     "content": "weather?"
    },
    {
     "role": "assistant",
     "content": "checking"
    },
    {
     "role": "tool",
     "content": "sunny"
    },
    {
     "role": "tool",
     "content": "22C"
    },
    {
     "role": "user",
     "content": "thanks"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": true,
   "text": "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\nchecking<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n<think>\n"
  },
  {
   "template": "qwen35",
   "name": "python_whitespace_trim",
   "messages": [
    {
     "role": "system",
     "content": "\u001c sys 　"
    },
    {
     "role": "user",
     "content": "\u001f  evidence\u001d\n \u001e"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "text": "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nevidence<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  },
  {
   "template": "qwen35",
   "name": "no_generation_prompt",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": "Q?"
    }
   ],
   "add_generation_prompt": false,
   "enable_thinking": false,
   "text": "<|im_start|>system\nYou decide.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
  },
  {
   "template": "qwen35",
   "name": "error_no_messages",
   "messages": [],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "error": "No messages provided."
  },
  {
   "template": "qwen35",
   "name": "error_system_not_first",
   "messages": [
    {
     "role": "user",
     "content": "Q?"
    },
    {
     "role": "system",
     "content": "You decide."
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "error": "System message must be at the beginning."
  },
  {
   "template": "qwen35",
   "name": "error_no_user_query",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "error": "No user query found in messages."
  },
  {
   "template": "qwen35",
   "name": "error_image_in_system",
   "messages": [
    {
     "role": "system",
     "content": [
      {
       "type": "image"
      }
     ]
    },
    {
     "role": "user",
     "content": "Q"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "error": "System message cannot contain images."
  },
  {
   "template": "qwen35",
   "name": "tool_after_user",
   "messages": [
    {
     "role": "user",
     "content": "Q"
    },
    {
     "role": "tool",
     "content": "x"
    },
    {
     "role": "assistant",
     "content": "y"
    },
    {
     "role": "user",
     "content": "z"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "text": "<|im_start|>user\nQ<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n<|im_start|>user\nz<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  },
  {
   "template": "features",
   "name": "features",
   "messages": [
    {
     "role": "system",
     "content": "You decide."
    },
    {
     "role": "user",
     "content": "  pad  x"
    },
    {
     "role": "assistant",
     "content": "a\tb \"quoted\" é ü 中 \\ /"
    },
    {
     "role": "user",
     "content": "Q\u001c"
    }
   ],
   "add_generation_prompt": true,
   "enable_thinking": false,
   "text": "[0:user:Q:1:2:2]\n[2:user:pad  x:6:7:6]\ncount=2 last=user\n[{\"role\": \"system\", \"content\": \"You decide.\"}, {\"role\": \"user\", \"content\": \"  pad  x\"}, {\"role\": \"assistant\", \"content\": \"a\\tb \\\"quoted\\\" é ü 中 \\\\ /\"}, {\"role\": \"user\", \"content\": \"Q\\u001c\"}]\n[\n  {\n    \"role\": \"system\",\n    \"content\": \"You decide.\"\n  },\n  {\n    \"role\": \"user\",\n    \"content\": \"  pad  x\"\n  },\n  {\n    \"role\": \"assistant\",\n    \"content\": \"a\\tb \\\"quoted\\\" é ü 中 \\\\ /\"\n  },\n  {\n    \"role\": \"user\",\n    \"content\": \"Q\\u001c\"\n  }\n]\n{\"content\": \"You decide.\", \"role\": \"system\"}\n[1, 2.5, 1e+16, 1e-07, -0.0, 100.0, true, null, \"é\\\"\\n\\u0001\"]\n{\n \"b\":1,\n \"a\":[\n  1,\n  {\n   \"c\":null\n  }\n ],\n \"d\":[]\n}\na|b||c x  | True True y\n2.0 1e+16 1.5 3 True None False 0.30000000000000004 z=1 a=2\nGEN False"
  }
 ]
}
"##;
