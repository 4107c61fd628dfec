//! The `/v1/systemone` HTTP server: axum on tokio in front of `prism-decision`'s engine.
//!
//! - [`server`] — routes, API key, request ids, limits, timeouts, graceful shutdown;
//! - [`body`] — content type, zstd, multipart and `assets`, then `prism-decision`'s validation;
//! - [`stats`] — the counters behind `GET /stats`; [`metrics`] — `GET /metrics` (OpenMetrics text);
//! - [`error`] — every refusal as the API's error body and status; [`protocol`] — the same shape for
//!   requests hyper refuses before any handler runs.

pub mod body;
pub mod error;
pub mod eval_client;
pub mod launch;
pub mod loadgen;
pub mod metrics;
pub mod protocol;
pub mod server;
pub mod stats;

pub use error::ApiError;
pub use metrics::Metrics;
pub use protocol::Counters;
pub use server::{router, serve, ConnectionLimits, ModelInfo, ServerConfig, REQUEST_ID_HEADER};
pub use stats::Stats;
