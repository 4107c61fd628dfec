//! `prism eval`'s model-free part: labelled suites ([`suite`]), the metrics ([`metrics`]), each item's
//! answers read from a `/v1/systemone` response, the summary per question type and tag, and the
//! comparison of two runs ([`results`]). Whoever runs the requests (the in-process engine or an HTTP
//! client) hands each response body here; the same body gives the same results, bit for bit. Also the
//! in-process run itself ([`run`]: the engine with many requests in flight) and the output files
//! ([`report`]: results.json, report.md, reliability.png).

pub mod metrics;
pub mod report;
pub mod results;
pub mod run;
pub mod suite;

pub use metrics::{Bin, Metrics, Scored};
pub use results::{
    answers_from_response, compare, summarize, Comparison, EvalResults, Flip, ItemResult,
    ItemStatus, Ordered, QuestionResult, ResultsError, Summary,
};
pub use suite::{parse_line, parse_suite, Suite, SuiteError, SuiteItem, SuiteQuestion};
