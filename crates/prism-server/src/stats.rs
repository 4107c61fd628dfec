//! Counters behind `GET /stats`: requests by status, tokens, latency percentiles over a recent window,
//! and the engine's own counters (passes, prompts and requests per pass, the prefix cache, the queue).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use prism_decision::engine::{EngineStats, QueueState};
use serde_json::{json, Value};

/// Latencies are summarised over this many most recent requests.
pub const LATENCY_WINDOW: usize = 4096;

/// The most recent samples of one measurement.
#[derive(Debug, Default)]
struct Window(VecDeque<f64>);

impl Window {
    fn push(&mut self, value: f64) {
        if self.0.len() == LATENCY_WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(value);
    }

    /// Count, mean and nearest-rank percentiles; nulls when empty.
    fn summary(&self) -> Value {
        if self.0.is_empty() {
            return json!({"count": 0, "mean": null, "p50": null, "p90": null, "p99": null, "max": null});
        }
        let mut sorted: Vec<f64> = self.0.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let rank =
            |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        json!({
            "count": sorted.len(),
            "mean": sorted.iter().sum::<f64>() / sorted.len() as f64,
            "p50": rank(0.50),
            "p90": rank(0.90),
            "p99": rank(0.99),
            "max": sorted[sorted.len() - 1],
        })
    }
}

#[derive(Debug, Default)]
struct Counters {
    http_requests: u64,
    by_status: BTreeMap<u16, u64>,
    decisions: u64,
    questions: u64,
    input_tokens: u64,
    output_tokens: u64,
    latency_ms: Window,
    prepare_ms: Window,
    queue_ms: Window,
    compute_ms: Window,
    handoff_ms: Window,
    cached_tokens: u64,
    queue_full: u64,
    timed_out: u64,
    body_timed_out: u64,
    client_gone: u64,
    protocol_errors: u64,
}

/// Where an answered request's time went on the server, in milliseconds: its latency (arrival of its
/// headers to its answer) is `prepare + queue + compute + handoff`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunTimes {
    /// Arrival to submission: reading and decoding the body, parsing, rendering and tokenizing (on a
    /// blocking thread), and the hops to and from that thread.
    pub prepare_ms: f64,
    /// Submission to the request's first forward pass.
    pub queue_ms: f64,
    /// First pass to the engine's answer.
    pub compute_ms: f64,
    /// The engine's answer to the handler holding it (the channel and the async runtime's wake-up).
    pub handoff_ms: f64,
}

impl RunTimes {
    /// The split of a request answered `latency_ms` after arrival, `prepare_ms` of it before
    /// submission, with the engine's queue and compute times; the handoff is what is left (at least 0:
    /// the clocks are read on different threads).
    pub fn split(latency_ms: f64, prepare_ms: f64, queue_ms: f64, compute_ms: f64) -> Self {
        Self {
            prepare_ms,
            queue_ms,
            compute_ms,
            handoff_ms: (latency_ms - prepare_ms - queue_ms - compute_ms).max(0.0),
        }
    }
}

/// The server's counters (one lock, taken briefly per request).
#[derive(Debug)]
pub struct Stats {
    started: Instant,
    counters: Mutex<Counters>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            started: Instant::now(),
            counters: Mutex::new(Counters::default()),
        }
    }
}

impl Stats {
    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        // A panic while holding this lock cannot leave the counters inconsistent in a way that matters.
        let mut guard = self
            .counters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut guard)
    }

    /// Any HTTP response.
    pub fn record_http(&self, status: u16) {
        self.with(|c| {
            c.http_requests += 1;
            *c.by_status.entry(status).or_default() += 1;
        });
    }

    /// An answered decision request.
    pub fn record_decision(
        &self,
        questions: usize,
        input_tokens: u64,
        output_tokens: u64,
        latency_ms: f64,
    ) {
        self.with(|c| {
            c.decisions += 1;
            c.questions += questions as u64;
            c.input_tokens += input_tokens;
            c.output_tokens += output_tokens;
            c.latency_ms.push(latency_ms);
        });
    }

    /// One answered request's time split ([`RunTimes`]) and the prompt tokens its evidence took from the
    /// prefix cache.
    pub fn record_run(&self, times: &RunTimes, cached_tokens: u64) {
        self.with(|c| {
            c.prepare_ms.push(times.prepare_ms);
            c.queue_ms.push(times.queue_ms);
            c.compute_ms.push(times.compute_ms);
            c.handoff_ms.push(times.handoff_ms);
            c.cached_tokens += cached_tokens;
        });
    }

    pub fn record_queue_full(&self) {
        self.with(|c| c.queue_full += 1);
    }

    /// A client that closed its connection before its answer (its request was cancelled).
    pub fn record_client_gone(&self) {
        self.with(|c| c.client_gone += 1);
    }

    /// A request not answered within `--timeout` (504).
    pub fn record_timeout(&self) {
        self.with(|c| c.timed_out += 1);
    }

    /// A request hyper refused before any handler ran (400, 414, 431: unparsable framing or headers),
    /// answered by the accept loop.
    pub fn record_protocol_error(&self, status: u16) {
        self.with(|c| {
            c.http_requests += 1;
            *c.by_status.entry(status).or_default() += 1;
            c.protocol_errors += 1;
        });
    }

    /// A request whose body had not arrived within `--timeout` (408).
    pub fn record_body_timeout(&self) {
        self.with(|c| c.body_timed_out += 1);
    }

    /// The `/stats` body.
    pub fn snapshot(&self, model: &str, queue: QueueState, engine: &EngineStats) -> Value {
        let uptime = self.started.elapsed().as_secs_f64();
        let histogram = |map: &BTreeMap<usize, u64>| -> serde_json::Map<String, Value> {
            map.iter().map(|(k, n)| (k.to_string(), json!(n))).collect()
        };
        let cache = &engine.prefix_cache;
        let lookups = cache.hits + cache.misses;
        self.with(|c| {
            let by_status: serde_json::Map<String, Value> =
                c.by_status.iter().map(|(status, n)| (status.to_string(), json!(n))).collect();
            json!({
                "model": model,
                "uptime_s": uptime,
                "requests": {
                    "http": c.http_requests,
                    "by_status": by_status,
                    "decisions": c.decisions,
                    "questions": c.questions,
                    "rejected_queue_full": c.queue_full,
                    "timed_out": c.timed_out,
                    "body_timed_out": c.body_timed_out,
                    "client_closed": c.client_gone,
                    "protocol_errors": c.protocol_errors,
                },
                "tokens": {"input": c.input_tokens, "output": c.output_tokens, "from_prefix_cache": c.cached_tokens},
                "latency_ms": c.latency_ms.summary(),
                "prepare_ms": c.prepare_ms.summary(),
                "queue_wait_ms": c.queue_ms.summary(),
                "compute_ms": c.compute_ms.summary(),
                "handoff_ms": c.handoff_ms.summary(),
                "engine": {
                    "passes": engine.passes,
                    "prompts": engine.prompts,
                    "tokens_computed": engine.tokens_computed,
                    "requests_per_pass": histogram(&engine.requests_per_pass),
                    "prompts_per_pass": histogram(&engine.prompts_per_pass),
                    "max_requests_per_pass": engine.max_requests_per_pass,
                    "max_prompts_per_pass": engine.max_prompts_per_pass,
                    "max_tokens_per_pass": engine.max_tokens_per_pass,
                    "max_batch_tokens": engine.max_batch_tokens,
                    "evidence_chunks": engine.evidence_chunks,
                    "answered": engine.answered,
                    "failed": engine.failed,
                    "cancelled": engine.cancelled,
                    "deadline_exceeded": engine.deadline_exceeded,
                    "passes_split_after_error": engine.passes_split_after_error,
                },
                "prefix_cache": {
                    "hits": cache.hits,
                    "misses": cache.misses,
                    "hit_rate": if lookups == 0 { Value::Null } else { json!(cache.hits as f64 / lookups as f64) },
                    "cached_tokens": cache.cached_tokens,
                    "bytes": cache.bytes,
                    "entries": cache.entries,
                    "evictions": cache.evictions,
                    "tokens_saved": cache.tokens_saved,
                    "too_large": cache.too_large,
                    "max_tokens": engine.prefix_cache_max_tokens,
                    "max_bytes": engine.prefix_cache_max_bytes,
                },
                "queue": {"depth": queue.depth, "capacity": queue.capacity, "running": queue.running},
                "cache_hit_rate": if lookups == 0 { Value::Null } else { json!(cache.hits as f64 / lookups as f64) },
                "thoughts": {
                    "started": engine.thoughts_started,
                    "finished": engine.thoughts_finished,
                    "tokens": engine.thought_tokens,
                    "steps": engine.thought_steps,
                    "think_seqs": engine.think_seqs,
                },
                "vision": {
                    "images": engine.vision_images,
                    "seconds": engine.vision_seconds,
                    "ms_per_image": if engine.vision_images == 0 { Value::Null } else { json!(engine.vision_seconds * 1e3 / engine.vision_images as f64) },
                },
                "gpu_memory_bytes": engine.device_memory.map(|m| json!({
                    "used": m.used_bytes,
                    "total": m.total_bytes,
                    "max_used": m.max_used_bytes,
                })),
                "notes": [
                    format!("latency percentiles are over the last {LATENCY_WINDOW} answered requests"),
                    "a request's latency_ms (arrival of its headers to its answer) = prepare_ms (body, parsing, rendering, tokenizing) + queue_wait_ms (to its first pass) + compute_ms (first pass to answer) + handoff_ms (the answer back to its connection)",
                    "engine.requests_per_pass / prompts_per_pass: forward passes by how many requests / prompts they held",
                    "thoughts: v1.1 AutoThink thoughts whose prompt was read / that finished, the tokens the finished ones decoded, the thought steps run (one per thought per pass), and --think-seqs",
                    "vision: images the vision tower encoded and its time on them (from the tower's start to the device finishing it, per request with images)",
                    "gpu_memory_bytes: the device's memory in use and in all after the last pass, and the most in use after any pass (the driver's count; null on the CPU or before the first pass)",
                ],
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut window = Window::default();
        for v in 1..=100 {
            window.push(v as f64);
        }
        let summary = window.summary();
        assert_eq!(summary["p50"], 50.0);
        assert_eq!(summary["p90"], 90.0);
        assert_eq!(summary["p99"], 99.0);
        assert_eq!(summary["max"], 100.0);
        assert_eq!(summary["mean"], 50.5);
        assert_eq!(Window::default().summary()["p50"], Value::Null);
        for v in 0..LATENCY_WINDOW {
            window.push(1000.0 + v as f64);
        }
        assert_eq!(window.summary()["count"], LATENCY_WINDOW);
        assert_eq!(
            window.summary()["p50"],
            1000.0 + (LATENCY_WINDOW / 2 - 1) as f64
        );
    }
}
