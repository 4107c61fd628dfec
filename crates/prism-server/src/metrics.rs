//! `GET /metrics`: the server's and the engine's counters in the OpenMetrics text format (which
//! Prometheus scrapes), through the `prometheus-client` crate.

use std::sync::Mutex;

use prism_decision::engine::{EngineObserver, EngineStats, PassRecord, QueueState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    latency: Histogram,
    queue_wait: Histogram,
    input_tokens: Counter,
    output_tokens: Counter,
    pass_requests: Histogram,
    pass_prompts: Histogram,
    pass_tokens: Histogram,
    pass_seconds: Histogram,
    cache_hits: Counter,
    cache_misses: Counter,
    queue_depth: Gauge,
    running: Gauge,
    cache_tokens: Gauge,
    cache_bytes: Gauge,
    cache_evictions: Gauge,
    /// Passes and tokens computed by each engine replica (label `replica`).
    replica_passes: Family<Labels, Counter>,
    replica_tokens: Family<Labels, Counter>,
    /// Thought steps run (v1.1 AutoThink: one per thought per pass), thoughts finished and their tokens.
    thought_steps: Counter,
    thoughts_finished: Gauge,
    thought_tokens: Gauge,
    /// `render` sets gauges and encodes; one at a time.
    render_lock: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        // One registration a metric, alike in shape: a list of names and help texts, each with its own
        // metric type and buckets.
        let mut registry = Registry::with_prefix("prism");
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "requests",
            "HTTP requests answered, by status code",
            requests.clone(),
        );
        let latency = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        registry.register(
            "request_latency_seconds",
            "Decision requests: arrival to answer",
            latency.clone(),
        );
        let queue_wait = Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        registry.register(
            "queue_wait_seconds",
            "Decision requests: submission to their first forward pass",
            queue_wait.clone(),
        );
        let input_tokens = Counter::default();
        registry.register(
            "input_tokens",
            "Prompt tokens of answered requests (cached or not)",
            input_tokens.clone(),
        );
        let output_tokens = Counter::default();
        registry.register(
            "output_tokens",
            "Generated tokens of answered requests",
            output_tokens.clone(),
        );
        let pass_requests = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        registry.register(
            "pass_requests",
            "Requests in each forward pass",
            pass_requests.clone(),
        );
        let pass_prompts = Histogram::new(exponential_buckets(1.0, 2.0, 12));
        registry.register(
            "pass_prompts",
            "Prompts read out in each forward pass",
            pass_prompts.clone(),
        );
        let pass_tokens = Histogram::new(exponential_buckets(16.0, 2.0, 14));
        registry.register(
            "pass_tokens",
            "Tokens computed in each forward pass",
            pass_tokens.clone(),
        );
        let pass_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        registry.register(
            "pass_seconds",
            "Duration of each forward pass",
            pass_seconds.clone(),
        );
        let cache_hits = Counter::default();
        registry.register(
            "prefix_cache_hits",
            "Evidence prefixes found in the prefix cache",
            cache_hits.clone(),
        );
        let cache_misses = Counter::default();
        registry.register(
            "prefix_cache_misses",
            "Evidence prefixes not found in the prefix cache",
            cache_misses.clone(),
        );
        let queue_depth = Gauge::default();
        registry.register(
            "queue_depth",
            "Requests submitted and not yet taken by the engine",
            queue_depth.clone(),
        );
        let running = Gauge::default();
        registry.register(
            "requests_running",
            "Requests taken by the engine and not yet answered",
            running.clone(),
        );
        let cache_tokens = Gauge::default();
        registry.register(
            "prefix_cache_tokens",
            "Tokens held by the prefix cache",
            cache_tokens.clone(),
        );
        let cache_bytes = Gauge::default();
        registry.register(
            "prefix_cache_bytes",
            "Bytes held by the prefix cache",
            cache_bytes.clone(),
        );
        let cache_evictions = Gauge::default();
        registry.register(
            "prefix_cache_evictions",
            "Prefix cache entries evicted since start",
            cache_evictions.clone(),
        );
        let replica_passes = Family::<Labels, Counter>::default();
        registry.register(
            "replica_passes",
            "Forward passes by engine replica",
            replica_passes.clone(),
        );
        let replica_tokens = Family::<Labels, Counter>::default();
        registry.register(
            "replica_tokens_computed",
            "Tokens computed by engine replica",
            replica_tokens.clone(),
        );
        let thought_steps = Counter::default();
        registry.register(
            "thought_steps",
            "Thought steps run (one per thought per forward pass it was in)",
            thought_steps.clone(),
        );
        let thoughts_finished = Gauge::default();
        registry.register(
            "thoughts_finished",
            "Thoughts finished since start",
            thoughts_finished.clone(),
        );
        let thought_tokens = Gauge::default();
        registry.register(
            "thought_tokens",
            "Tokens decoded by the thoughts finished since start",
            thought_tokens.clone(),
        );
        Metrics {
            thought_steps,
            thoughts_finished,
            thought_tokens,
            replica_passes,
            replica_tokens,
            registry,
            requests,
            latency,
            queue_wait,
            input_tokens,
            output_tokens,
            pass_requests,
            pass_prompts,
            pass_tokens,
            pass_seconds,
            cache_hits,
            cache_misses,
            queue_depth,
            running,
            cache_tokens,
            cache_bytes,
            cache_evictions,
            render_lock: Mutex::new(()),
        }
    }
}

impl Metrics {
    /// Any HTTP response.
    pub fn record_http(&self, status: u16) {
        self.requests
            .get_or_create(&vec![("status".to_string(), status.to_string())])
            .inc();
    }

    /// An answered decision request.
    pub fn record_decision(
        &self,
        latency_s: f64,
        queue_s: f64,
        input_tokens: u64,
        output_tokens: u64,
    ) {
        self.latency.observe(latency_s);
        self.queue_wait.observe(queue_s);
        self.input_tokens.inc_by(input_tokens);
        self.output_tokens.inc_by(output_tokens);
    }

    /// The text of `GET /metrics`.
    pub fn render(
        &self,
        queue: QueueState,
        engine: &EngineStats,
    ) -> Result<String, std::fmt::Error> {
        let _guard = self
            .render_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.queue_depth.set(as_i64(queue.depth as u64));
        self.running.set(as_i64(queue.running as u64));
        self.cache_tokens
            .set(as_i64(engine.prefix_cache.cached_tokens));
        self.cache_bytes.set(as_i64(engine.prefix_cache.bytes));
        self.cache_evictions
            .set(as_i64(engine.prefix_cache.evictions));
        self.thoughts_finished.set(as_i64(engine.thoughts_finished));
        self.thought_tokens.set(as_i64(engine.thought_tokens));
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

impl EngineObserver for Metrics {
    fn pass(&self, record: &PassRecord, seconds: f64) {
        self.pass_requests.observe(record.requests as f64);
        self.pass_prompts.observe(record.prompts as f64);
        self.pass_tokens.observe(record.tokens as f64);
        self.pass_seconds.observe(seconds);
        self.cache_hits.inc_by(record.cache_hits as u64);
        self.cache_misses.inc_by(record.cache_misses as u64);
        self.thought_steps.inc_by(record.thought_steps as u64);
        let replica = vec![("replica".to_string(), record.replica.to_string())];
        self.replica_passes.get_or_create(&replica).inc();
        self.replica_tokens
            .get_or_create(&replica)
            .inc_by(record.tokens as u64);
    }
}
