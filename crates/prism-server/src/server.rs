//! The HTTP layer: routes, the API key, request ids, body limits, timeouts and graceful shutdown.
//!
//! Kept thin and typed: each handler turns HTTP into a validated `DecisionRequest` (see [`crate::body`]),
//! prepares it for the [`Engine`] (rendering and tokenization, off the async threads), submits it and
//! turns the answer (or the typed refusal) back into HTTP. A client that goes away cancels its request:
//! the engine stops its work at the next step.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use prism_decision::engine::{CancelToken, Engine, JobError, Prepared, SubmitError};
use prism_decision::{DecisionResponse, RequestDefaults};
use serde::Serialize;
use serde_json::json;

use crate::body::{body_kind, decode_zstd, is_zstd, parse_request, BodyError, ParsedRequest};
use crate::error::{loc, ApiError};
use crate::metrics::{Metrics, CONTENT_TYPE as METRICS_CONTENT_TYPE};
use crate::protocol::{ApiShapedIo, Counters};
use crate::stats::{RunTimes, Stats};

/// The response header that carries each request's id (the TypeSafe SDK reads it).
pub const REQUEST_ID_HEADER: &str = "x-typesafe-request-id";

/// What `/v1/models` says about the model being served.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model's name (the GGUF's `general.name`), reported in every response's `model`.
    pub name: String,
    pub description: String,
    /// `YYYY-MM-DD` when known, else `unknown`.
    pub release_date: String,
    /// The `--precision` the decoder runs in.
    pub precision: String,
    /// The longest prompt accepted (`--max-tokens`).
    pub max_prompt_tokens: usize,
    /// True for the bundled random-weight demo model.
    pub demo: bool,
    /// The release family (`decision_config.json`'s `family`, or `--demo`'s).
    pub family: prism_decision::Family,
}

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// When set, every endpoint but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Largest request body, on the wire and after decompression (413 beyond).
    pub max_body_bytes: usize,
    /// From arrival to answer (408 while the body is still arriving, 504 after).
    pub request_timeout: Duration,
    /// The request defaults (`--gate`, `--none-check`, `--allow-none`).
    pub defaults: RequestDefaults,
    pub model: ModelInfo,
    /// Serve the playground page at `GET /` (without the API key: the page itself holds nothing; it
    /// asks for the key and sends it with its requests). `--no-playground` turns it off.
    pub playground: bool,
}

/// The playground page: HTML, CSS and JS in one file, nothing fetched from elsewhere.
const PLAYGROUND: &str = include_str!("playground.html");

struct Shared {
    config: ServerConfig,
    engine: Engine,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
}

type AppState = Arc<Shared>;

/// The server's router over a running [`Engine`]. `metrics` should be the engine's observer, so
/// `/metrics` sees its passes.
pub fn router(
    config: ServerConfig,
    engine: Engine,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
) -> Router {
    let state: AppState = Arc::new(Shared {
        config,
        engine,
        stats,
        metrics,
    });
    let decide_route = || -> MethodRouter<AppState> { post(decide).fallback(method_not_allowed) };
    let playground = state.config.playground;
    let router = Router::new();
    let router = if playground {
        router.route("/", get(playground_page).fallback(method_not_allowed))
    } else {
        router
    };
    router
        .route("/v1/systemone", decide_route())
        .route("/v1/decisions", decide_route())
        .route("/v1/models", get(models).fallback(method_not_allowed))
        .route("/health", get(health).fallback(method_not_allowed))
        .route("/stats", get(stats_page).fallback(method_not_allowed))
        .route("/metrics", get(metrics_page).fallback(method_not_allowed))
        .route("/openapi.json", get(openapi).fallback(method_not_allowed))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            around_every_request,
        ))
        .with_state(state)
}

/// Limits on connections (`prism serve`'s flags), so slow or idle clients cannot hold the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request's headers must arrive within this; a keep-alive connection waiting for its next
    /// request is closed after it too (`--header-timeout`).
    pub header_timeout: Duration,
    /// Connections served at once (`--max-connections`); one more gets a 503 and is closed.
    pub max_connections: usize,
    /// After the shutdown signal, requests in flight get this long to finish (`--shutdown-grace`);
    /// idle connections and ones still sending headers are closed at once.
    pub shutdown_grace: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_timeout: Duration::from_secs(30),
            max_connections: 1024,
            shutdown_grace: Duration::from_secs(65),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets the requests in flight finish
/// within `limits.shutdown_grace`. Returns whether every connection ended within the grace period.
///
/// One HTTP/1.1 connection per accepted socket (hyper, with a timer so `header_timeout` holds for the
/// first request and between keep-alive requests), at most `max_connections` at once. Requests hyper
/// refuses itself (unparsable framing or headers) get the API's error shape and are counted in
/// `counters` ([`crate::protocol`]); give it the router's [`Stats`] and [`Metrics`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    counters: Counters,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<bool> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tower::ServiceExt;

    let max = limits
        .max_connections
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    let (stopping, stop_watch) = tokio::sync::watch::channel(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, _remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors or a transient accept failure: back off instead of spinning.
                    tracing::warn!("accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Responses go out as soon as they are written, not held back by Nagle's algorithm waiting
        // for the client's acknowledgement of an earlier segment (what HTTP servers do).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {error}");
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(refuse_connection(stream, max));
            continue;
        };
        let socket = client_socket(&stream);
        // Requests of this connection whose handler is running.
        let in_flight = Arc::new(AtomicU64::new(0));
        let counter = in_flight.clone();
        let service = app
            .clone()
            .map_request(
                move |mut request: axum::extract::Request<hyper::body::Incoming>| {
                    request
                        .extensions_mut()
                        .insert(axum::extract::ConnectInfo(socket));
                    request
                },
            )
            .map_future(move |future| {
                let guard = InFlight::enter(counter.clone());
                async move {
                    let _guard = guard;
                    future.await
                }
            });
        let io = TokioIo::new(ApiShapedIo::new(stream, counters.clone()));
        let connection = builder.serve_connection(io, TowerToHyperService::new(service));
        let mut stop = stop_watch.clone();
        tokio::spawn(async move {
            tokio::pin!(connection);
            let stopped = tokio::select! {
                ended = connection.as_mut() => {
                    if let Err(error) = ended {
                        tracing::debug!("connection ended: {error}");
                    }
                    false
                }
                _ = stop.changed() => true,
            };
            // At shutdown, a connection with no request in its handler (idle, or still sending a
            // header) is closed at once; one with a request finishes that request first.
            if stopped && in_flight.load(Ordering::SeqCst) > 0 {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
            drop(slot);
        });
    }
    drop(listener);
    let _ = stopping.send(true);
    // Every connection's slot back means every connection has ended.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let ended = tokio::time::timeout(limits.shutdown_grace, slots.acquire_many(all))
        .await
        .is_ok();
    Ok(ended)
}

/// Counts a request of a connection while its handler runs.
struct InFlight(Arc<AtomicU64>);

impl InFlight {
    fn enter(counter: Arc<AtomicU64>) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        InFlight(counter)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection over `--max-connections`: a 503 in the API's shape, then closed.
async fn refuse_connection(mut stream: tokio::net::TcpStream, limit: usize) {
    use tokio::io::AsyncWriteExt;
    let message = format!("the server is serving its limit of {limit} connections; retry shortly");
    let body = serde_json::json!({
        "error": message,
        "detail": {"error_type": "overloaded", "message": message},
    })
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
    let _ = stream.shutdown().await;
}

fn client_socket(stream: &tokio::net::TcpStream) -> ClientSocket {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        ClientSocket(Some(stream.as_raw_fd()))
    }
    #[cfg(not(unix))]
    {
        let _ = stream;
        ClientSocket(None)
    }
}

/// The socket a request came on, so a handler can notice its client leaving: hyper does not drop a
/// pending HTTP/1 handler when the client closes, so the handler looks at the socket itself. [`serve`]
/// puts it into each request's extensions (as `ConnectInfo`).
#[derive(Debug, Clone, Copy)]
pub struct ClientSocket(Option<i32>);

/// Resolves once the client has closed its side of the connection (a peek reads end of file) or the
/// connection failed; never without a socket. Bytes waiting (a pipelined request) count as present.
/// Safe to peek by descriptor: the connection, and so the descriptor, lives while its handler runs.
async fn client_gone(socket: ClientSocket) {
    #[cfg(unix)]
    if let Some(fd) = socket.0 {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut byte = 0u8;
            // SAFETY: `byte` is a valid one-byte buffer for the call; MSG_PEEK leaves the data to hyper.
            let n = unsafe {
                libc::recv(
                    fd,
                    (&mut byte as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n == 0 {
                return;
            }
            if n < 0 {
                match std::io::Error::last_os_error().kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => {}
                    _ => return,
                }
            }
        }
    }
    let _ = socket;
    std::future::pending::<()>().await
}

/// A per-process random seed for request ids (std's hasher keys come from the OS's randomness).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish()
}

/// splitmix64: a bijection, so distinct counters give distinct ids.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The process's request ids: a counter and two random seeds.
struct RequestIds {
    next: AtomicU64,
    seeds: [u64; 2],
}

/// A new request id, never repeated within the process (the router's responses and the accept loop's
/// answers to requests hyper could not parse draw from the same counter).
pub fn new_request_id() -> String {
    static IDS: std::sync::OnceLock<RequestIds> = std::sync::OnceLock::new();
    let ids = IDS.get_or_init(|| RequestIds {
        next: AtomicU64::new(0),
        seeds: [random_seed(), random_seed()],
    });
    let n = ids.next.fetch_add(1, Ordering::Relaxed);
    // Each half is a bijection of the counter: ids never repeat within a process.
    format!(
        "req_{:016x}{:016x}",
        mix(ids.seeds[0] ^ n),
        mix(ids.seeds[1] ^ n)
    )
}

/// Compares without stopping at the first difference, so response time does not reveal the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(headers: &HeaderMap, key: &str) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::unauthorized(
            "an API key is required: send `Authorization: Bearer KEY`",
        ));
    };
    let value = value.as_bytes();
    let token = value
        .get(..7)
        .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
        .and_then(|_| value.get(7..))
        .map(|t| t.trim_ascii());
    match token {
        Some(token) if same_secret(token, key.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("the API key is not valid")),
        None => Err(ApiError::unauthorized(
            "the Authorization header must be `Bearer KEY`",
        )),
    }
}

/// Request id, API key, counting and logging around every request.
async fn around_every_request(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let id = new_request_id();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let mut response = match (
        transfer_coding(request.headers()),
        &state.config.api_key,
        path.as_str(),
    ) {
        (Err(error), _, _) => {
            // The body's framing is unknown: nothing more can be read on this connection.
            let mut response = error.into_response();
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
        (Ok(()), Some(key), p) if p != "/health" && !(p == "/" && state.config.playground) => {
            match authorized(request.headers(), key) {
                Ok(()) => next.run(request).await,
                Err(error) => error.into_response(),
            }
        }
        (Ok(()), _, _) => next.run(request).await,
    };
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    let status = response.status().as_u16();
    state.stats.record_http(status);
    state.metrics.record_http(status);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if status >= 500 {
        tracing::warn!(request_id = %id, "{method} {path} -> {status} in {ms:.1} ms");
    } else {
        tracing::debug!(request_id = %id, "{method} {path} -> {status} in {ms:.1} ms");
    }
    response
}

/// RFC 9112 §6.1: a request with a transfer coding the server does not understand gets a 501. hyper
/// frames a body whose last coding is `chunked` and passes the header on; any other coding in it
/// (`gzip, chunked`) would be ignored, so it is refused here.
fn transfer_coding(headers: &HeaderMap) -> Result<(), ApiError> {
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let text = String::from_utf8_lossy(value.as_bytes());
        let unknown: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case("chunked"))
            .collect();
        if !unknown.is_empty() {
            return Err(ApiError::new(
                StatusCode::NOT_IMPLEMENTED,
                loc(["header", "transfer-encoding"]),
                "not_implemented",
                format!(
                    "Transfer-Encoding {text:?}: this server implements only `chunked` (not {})",
                    unknown.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// A header's value as text; a value that is not visible ASCII is refused.
fn header_text(headers: &HeaderMap, name: header::HeaderName) -> Result<Option<&str>, ApiError> {
    match headers.get(&name) {
        None => Ok(None),
        Some(value) => value.to_str().map(Some).map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                loc(["header", name.as_str()]),
                "header_invalid",
                format!("the {name} header is not readable text"),
            )
        }),
    }
}

/// Reads the body, refusing more than `limit` bytes (413).
async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes().to_vec()),
        Err(error) if error.is::<LengthLimitError>() => Err(BodyError::TooLarge { limit }.to_api()),
        Err(error) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            loc(["body"]),
            "body_unreadable",
            format!("the request body could not be read: {error}"),
        )),
    }
}

/// The `/v1/systemone` response, with the notes about settings this engine cannot honour yet.
#[derive(Serialize)]
struct DecideBody<'a> {
    #[serde(flatten)]
    response: &'a DecisionResponse,
    #[serde(rename = "x_notes", skip_serializing_if = "<[String]>::is_empty")]
    notes: &'a [String],
}

async fn decide(
    State(state): State<AppState>,
    socket: Option<axum::Extension<axum::extract::ConnectInfo<ClientSocket>>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let socket = socket.map_or(ClientSocket(None), |s| s.0 .0);
    let arrived = Instant::now();
    let config = &state.config;
    let limit = config.max_body_bytes;
    let declared =
        header_text(&headers, header::CONTENT_LENGTH)?.and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(BodyError::TooLarge { limit }.to_api());
    }
    let kind = body_kind(header_text(&headers, header::CONTENT_TYPE)?).map_err(|e| e.to_api())?;
    let zstd = is_zstd(header_text(&headers, header::CONTENT_ENCODING)?).map_err(|e| e.to_api())?;

    let bytes = match tokio::time::timeout(config.request_timeout, read_body(body, limit)).await {
        Ok(bytes) => bytes?,
        Err(_) => {
            state.stats.record_body_timeout();
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                loc(["body"]),
                "timeout",
                format!(
                    "the request body did not arrive within {} s",
                    config.request_timeout.as_secs_f64()
                ),
            ));
        }
    };

    // Decompression, multipart, JSON parsing, rendering and tokenization are CPU work on untrusted
    // input: off the async threads, and off the engine's.
    let defaults = config.defaults.clone();
    let family = config.model.family;
    let engine = state.engine.clone();
    let (prepared, notes, questions): (Prepared, Vec<String>, usize) =
        tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
            let decoded = if zstd {
                decode_zstd(&bytes, limit).map_err(|e| e.to_api())?
            } else {
                bytes
            };
            let mut parsed: ParsedRequest = parse_request(&kind, &decoded, &defaults)?;
            let family_notes = parsed.family_notes(family);
            parsed.notes.extend(family_notes);
            for field in &parsed.request.ignored_fields {
                parsed
                    .notes
                    .push(format!("unknown field `{field}` ignored"));
            }
            let questions = parsed.request.questions.len();
            let prepared = engine
                .prepare(parsed.request)
                .map_err(|e| ApiError::from_decision(&e))?;
            Ok((prepared, parsed.notes, questions))
        })
        .await
        .map_err(|e| internal(format!("the request parser failed: {e}")))??;

    let prepare_ms = arrived.elapsed().as_secs_f64() * 1e3;
    let (sender, answer) = tokio::sync::oneshot::channel();
    let cancel = CancelToken::default();
    // Dropped with this handler: when the client goes away before the answer, the engine stops the
    // request's work at its next step.
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    state
        .engine
        .submit(
            prepared,
            Box::new(move |result| {
                let _ = sender.send(result);
            }),
            Some(arrived + config.request_timeout),
            cancel,
        )
        .map_err(|error| match error {
            SubmitError::QueueFull { .. } => {
                state.stats.record_queue_full();
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    loc(["body"]),
                    "overloaded",
                    format!("{error}; retry shortly"),
                )
                .with_retry_after(1)
            }
            SubmitError::ShuttingDown => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                loc(["body"]),
                "shutting_down",
                error.to_string(),
            )
            .with_retry_after(1),
        })?;
    let timed_out = || {
        state.stats.record_timeout();
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            loc(["body"]),
            "timeout",
            format!(
                "the request was not answered within {} s",
                config.request_timeout.as_secs_f64()
            ),
        )
    };
    // The engine drops the request at its deadline; the extra second only covers the step in flight.
    let remaining =
        config.request_timeout.saturating_sub(arrived.elapsed()) + Duration::from_secs(1);
    let waited = tokio::select! {
        waited = tokio::time::timeout(remaining, answer) => waited,
        () = client_gone(socket) => {
            // Nobody reads this answer; dropping the handler cancels the request in the engine.
            state.stats.record_client_gone();
            return Err(ApiError::new(
                StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                loc(["body"]),
                "client_closed_request",
                "the client closed the connection before the answer".to_string(),
            ));
        }
    };
    let output = match waited {
        // The deadline is the promise: an answer the last pass finished after it is a 504 too (the
        // engine stops a request's work at the first step after its deadline, so at most one pass
        // runs late).
        Ok(Ok(Ok(_))) if arrived.elapsed() > config.request_timeout => return Err(timed_out()),
        Ok(Ok(Ok(output))) => output,
        Ok(Ok(Err(JobError::Decision(refused)))) => return Err(ApiError::from_decision(&refused)),
        Ok(Ok(Err(JobError::DeadlineExceeded))) | Err(_) => return Err(timed_out()),
        Ok(Ok(Err(JobError::Cancelled))) => {
            return Err(internal("the request was cancelled".into()))
        }
        Ok(Err(_)) => return Err(internal("the engine stopped before answering".into())),
    };
    let mut response = output.response;
    // The client's latency as the server sees it: arrival to answer, queue wait included.
    response.latency_ms = arrived.elapsed().as_secs_f64() * 1e3;
    state.stats.record_run(
        &RunTimes::split(
            response.latency_ms,
            prepare_ms,
            output.queue_ms,
            output.compute_ms,
        ),
        output.cached_tokens,
    );
    state.stats.record_decision(
        questions,
        response.usage.input_tokens,
        response.usage.output_tokens,
        response.latency_ms,
    );
    state.metrics.record_decision(
        response.latency_ms / 1e3,
        output.queue_ms / 1e3,
        response.usage.input_tokens,
        response.usage.output_tokens,
    );
    let json = serde_json::to_vec(&DecideBody {
        response: &response,
        notes: &notes,
    })
    .map_err(|e| internal(format!("the response could not be serialized: {e}")))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        json,
    )
        .into_response())
}

/// Cancels a submitted request when dropped (the handler's future is dropped when its client goes).
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

fn internal(message: String) -> ApiError {
    tracing::error!("{message}");
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        loc(["body"]),
        "internal",
        message,
    )
}

fn json_response(value: serde_json::Value) -> Response {
    let json = serde_json::to_vec(&value).unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        json,
    )
        .into_response()
}

async fn models(State(state): State<AppState>) -> Response {
    let m = &state.config.model;
    json_response(json!({
        "models": [{
            "name": m.name,
            "description": m.description,
            "release_date": m.release_date,
            "precision": m.precision,
            "max_prompt_tokens": m.max_prompt_tokens,
            "demo": m.demo,
            "family": m.family.as_str(),
            "supports": {
                "question_types": ["choice", "noul", "score"],
                "wide_choice": true,
                "single_option_choice": true,
                "return_details": true,
                "think_mode": match m.family {
                    prism_decision::Family::AutoThink => json!({
                        "auto": "yes: a thought when the first read-out's top probability is below gate",
                        "never": "yes",
                        "always": "yes",
                    }),
                    _ => json!({
                        "auto": format!("accepted: one read-out per question (a {} model does not think)", m.family),
                        "never": "yes",
                        "always": format!("no: refused with 422 (a {} model does not think)", m.family),
                    }),
                },
                "thoughts": m.family.thinks(),
                "none_option": m.family.has_none_option(),
                "both_orders": m.family == prism_decision::Family::Instant,
                "seed": "yes: the seed of the request's thoughts",
                "images": if state.engine.reads_images() {
                    "yes: up to 8 (JSON `images` as base64 or data URIs, or the SDK's `assets`); PNG, JPEG, WebP, GIF"
                } else {
                    "no: this model has no vision tower (serve it with --mmproj); requests with images get 422"
                },
                "content_encoding": ["identity", "zstd"],
                "content_type": ["application/json", "multipart/form-data"],
            },
        }],
    }))
}

async fn health(State(state): State<AppState>) -> Response {
    let queue = state.engine.queue_state();
    json_response(json!({
        "status": "ok",
        "model": state.config.model.name,
        "queue_depth": queue.depth,
        "running": queue.running,
    }))
}

async fn stats_page(State(state): State<AppState>) -> Response {
    let mut body = state.stats.snapshot(
        &state.config.model.name,
        state.engine.queue_state(),
        &state.engine.stats(),
    );
    // Each replica's engine and prefix-cache counters (the totals above are their sums).
    let replicas: Vec<serde_json::Value> = state
        .engine
        .replica_stats()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({
                "replica": i,
                "passes": s.passes,
                "prompts": s.prompts,
                "tokens_computed": s.tokens_computed,
                "answered": s.answered,
                "max_requests_per_pass": s.max_requests_per_pass,
                "prefix_cache": s.prefix_cache,
                "gpu_memory_bytes": s.device_memory,
            })
        })
        .collect();
    if let Some(object) = body.as_object_mut() {
        object.insert("replicas".into(), replicas.into());
    }
    json_response(body)
}

/// The OpenAPI 3.1 description of this API (a document kept next to the routes; a test checks that it
/// lists every route).
const OPENAPI: &str = include_str!("openapi.json");

async fn playground_page() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        PLAYGROUND,
    )
        .into_response()
}

async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        OPENAPI,
    )
        .into_response()
}

async fn metrics_page(State(state): State<AppState>) -> Result<Response, ApiError> {
    let text = state
        .metrics
        .render(state.engine.queue_state(), &state.engine.stats())
        .map_err(|e| internal(format!("the metrics could not be encoded: {e}")))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(METRICS_CONTENT_TYPE),
        )],
        text,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_distinct() {
        let seed = random_seed();
        let ids: std::collections::HashSet<u64> = (0..10_000u64).map(|n| mix(seed ^ n)).collect();
        assert_eq!(ids.len(), 10_000);
    }

    #[test]
    fn bearer_keys() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            authorized(&headers, "k3y").unwrap_err().status,
            StatusCode::UNAUTHORIZED
        );
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer k3y"),
        );
        assert!(authorized(&headers, "k3y").is_ok());
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer k3y"),
        );
        assert!(authorized(&headers, "k3y").is_ok());
        for wrong in ["Bearer k3", "Bearer k3yy", "Basic k3y", "k3y", "Bearer"] {
            headers.insert(header::AUTHORIZATION, HeaderValue::from_static(wrong));
            let error = authorized(&headers, "k3y").unwrap_err();
            assert!(error.www_authenticate, "{wrong}");
        }
    }
}
