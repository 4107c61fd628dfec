//! `prism eval`'s model-free part: labelled suites ([`suite`]), the metrics ([`metrics`]), each item's
//! answers read from a `/v1/systemone` response, the summary per question type and tag, and the
//! comparison of two runs ([`results`]). Whoever runs the requests (the in-process engine or an HTTP
//! client) hands each response body here; the same body gives the same results, bit for bit.

pub mod metrics;
pub mod results;
pub mod suite;

pub use metrics::{Bin, Metrics, Scored};
pub use results::{
    answers_from_response, compare, summarize, Comparison, EvalResults, Flip, ItemResult,
    ItemStatus, Ordered, QuestionResult, ResultsError, Summary,
};
pub use suite::{parse_line, parse_suite, Suite, SuiteError, SuiteItem, SuiteQuestion};
