//! The `/v1/systemone` HTTP server: axum on tokio in front of a bounded queue and one model worker.
//!
//! - [`server`] — routes, API key, request ids, limits, timeouts, graceful shutdown;
//! - [`body`] — content type, zstd, multipart and `assets`, then `prism-decision`'s validation;
//! - [`scheduler`] — the bounded queue and the worker thread that owns the model;
//! - [`stats`] — the counters behind `GET /stats`;
//! - [`error`] — every refusal as the API's error body and status.

pub mod body;
pub mod error;
pub mod scheduler;
pub mod server;
pub mod stats;

pub use error::ApiError;
pub use scheduler::{Scheduler, SubmitError, Worker};
pub use server::{router, serve, ModelInfo, ServerConfig, REQUEST_ID_HEADER};
pub use stats::Stats;
