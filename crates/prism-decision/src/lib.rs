//! StartLux-Decision: requests, prompt rendering, read-out and calibrated probabilities.
pub mod bench;
pub mod chat_template;
pub mod config;
pub mod decide;
pub mod engine;
pub mod error;
pub mod eval;
pub mod image_input;
pub mod logits;
pub mod model;
pub mod preview;
pub mod pyjson;
pub mod readout;
pub mod render;
pub mod request;
pub mod response;
pub mod setup;
pub mod synth_files;
pub mod thought;
pub mod tokenizer;
pub mod vision;

pub use config::{DecisionConfig, Family, WideChoiceConfig};
pub use decide::{
    decide, render_request, render_request_with_images, DecisionTask, ReadMode, RenderedQuestion,
    ThoughtId, NONE_OPTION_ID,
};
pub use engine::{
    CancelToken, DecoderLetterModel, Engine, EngineError, EngineOptions, EngineStats, EngineWorker,
    JobError, JobOutput, LoadedDecisionModel, ModelSource, PassModel, PrefixCacheLimits, Prepared,
    SubmitError,
};
pub use error::{DecisionError, ErrorBody, FieldError, FieldErrors, ModelError};
pub use model::{LetterLogits, LetterModel, LetterPrompt, ThoughtOutcome, ThoughtRequest};
pub use request::{DecisionRequest, Question, QuestionType, RequestDefaults};
pub use response::{Answer, DecisionResponse};
