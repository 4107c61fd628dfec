//! Every refusal the server answers with, as one typed value that becomes the API's error body and its
//! status, in the reference API's two shapes:
//! - validation failures (422): `{"error": message, "detail": [{"loc": ["body", ...], "msg": ...,
//!   "type": ...}]}`, every problem with its field path — the TypeSafe SDK's `HTTPValidationError`;
//! - every other error: `{"error": message, "detail": {"error_type": ..., "message": ...}}` — 400 (a
//!   body that cannot be decoded), 401 `authentication_error`, 404/405 (route), 408 (slow body), 413
//!   (too large), 415 (content type or encoding), 499 (the client left), 503 `overloaded` (with
//!   `Retry-After`), 504 `timeout`, 500 (the model failed).
//!
//! `error` repeats the message at the top level for people reading a body by eye.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use prism_decision::error::{ErrorBody, ErrorDetail, LocPart};
use prism_decision::DecisionError;

/// An error response: status, body and the headers that go with it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
    /// `Retry-After` seconds for a 503 (the SDK retries after it).
    pub retry_after_secs: Option<u64>,
    /// `WWW-Authenticate: Bearer` on a 401.
    pub www_authenticate: bool,
}

/// A `loc` path: `["body", "assets", "photo", "part"]`, `["header", "content-type"]`.
pub fn loc<'a>(parts: impl IntoIterator<Item = &'a str>) -> Vec<LocPart> {
    parts
        .into_iter()
        .map(|p| LocPart::Key(p.to_string()))
        .collect()
}

impl ApiError {
    /// An error with one `detail` entry.
    pub fn new(
        status: StatusCode,
        loc: Vec<LocPart>,
        kind: &str,
        message: impl Into<String>,
    ) -> Self {
        let message = message.into();
        ApiError {
            status,
            body: ErrorBody {
                error: message.clone(),
                detail: vec![ErrorDetail {
                    loc,
                    msg: message,
                    kind: kind.into(),
                }],
            },
            retry_after_secs: None,
            www_authenticate: false,
        }
    }

    /// The API's answer to a refused or failed decision.
    pub fn from_decision(error: &DecisionError) -> Self {
        let status =
            StatusCode::from_u16(error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut body = error.body();
        if body.detail.is_empty() {
            // A model failure has no field to name: the whole request is what failed.
            let kind = match error {
                DecisionError::Model(prism_decision::ModelError::OutOfMemory(_)) => "out_of_memory",
                _ => "model_error",
            };
            body.detail.push(ErrorDetail {
                loc: loc(["body"]),
                msg: body.error.clone(),
                kind: kind.into(),
            });
        }
        ApiError {
            status,
            body,
            retry_after_secs: None,
            www_authenticate: false,
        }
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    pub fn unauthorized(message: &str) -> Self {
        let mut error = ApiError::new(
            StatusCode::UNAUTHORIZED,
            loc(["header", "authorization"]),
            "authentication_error",
            message,
        );
        error.www_authenticate = true;
        error
    }

    pub fn not_found(path: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            loc(["path"]),
            "not_found",
            format!("no such endpoint {path:?}: POST /v1/systemone (or /v1/decisions), GET /v1/models, GET /health, GET /stats, GET /metrics, GET /openapi.json, GET / (the playground page, unless --no-playground)"),
        )
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            loc(["method"]),
            "method_not_allowed",
            format!("{method} is not allowed on {path}"),
        )
    }
}

impl ApiError {
    /// The body as JSON, in the shape its status calls for.
    pub fn body_json(&self) -> serde_json::Value {
        if self.status == StatusCode::UNPROCESSABLE_ENTITY {
            return serde_json::to_value(&self.body).unwrap_or_default();
        }
        let error_type = self
            .body
            .detail
            .first()
            .map(|d| d.kind.as_str())
            .unwrap_or("api_error");
        serde_json::json!({
            "error": self.body.error,
            "detail": {"error_type": error_type, "message": self.body.error},
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let json = serde_json::to_vec(&self.body_json())
            .unwrap_or_else(|_| b"{\"error\":\"internal error\"}".to_vec());
        let mut response = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            json,
        )
            .into_response();
        if let Some(secs) = self.retry_after_secs {
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            headers.insert(
                "retry-after-ms",
                HeaderValue::from(secs.saturating_mul(1000)),
            );
        }
        if self.www_authenticate {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
