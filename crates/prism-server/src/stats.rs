//! Counters behind `GET /stats`: requests by status, tokens, latency percentiles over a recent window,
//! the size of each model call (prompts per forward batch) and the queue.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

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
    queue_ms: Window,
    compute_ms: Window,
    model_calls: u64,
    prompts: u64,
    batch_sizes: BTreeMap<usize, u64>,
    queue_full: u64,
    timed_out: u64,
    abandoned: u64,
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

/// What the queue looks like right now (owned by the scheduler).
#[derive(Debug, Clone, Copy)]
pub struct QueueState {
    pub depth: usize,
    pub capacity: usize,
    pub running: usize,
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

    /// One request's run on the worker: its wait in the queue, its compute time and its model calls
    /// (prompts per call).
    pub fn record_run(&self, queue_ms: f64, compute_ms: f64, calls: &[usize]) {
        self.with(|c| {
            c.queue_ms.push(queue_ms);
            c.compute_ms.push(compute_ms);
            for &prompts in calls {
                c.model_calls += 1;
                c.prompts += prompts as u64;
                *c.batch_sizes.entry(prompts).or_default() += 1;
            }
        });
    }

    pub fn record_queue_full(&self) {
        self.with(|c| c.queue_full += 1);
    }

    pub fn record_timeout(&self) {
        self.with(|c| c.timed_out += 1);
    }

    /// A queued request whose client was gone (timed out) before its turn: skipped, not computed.
    pub fn record_abandoned(&self) {
        self.with(|c| c.abandoned += 1);
    }

    /// The `/stats` body.
    pub fn snapshot(&self, model: &str, queue: QueueState) -> Value {
        let uptime = self.started.elapsed().as_secs_f64();
        self.with(|c| {
            let by_status: serde_json::Map<String, Value> =
                c.by_status.iter().map(|(status, n)| (status.to_string(), json!(n))).collect();
            let sizes: serde_json::Map<String, Value> =
                c.batch_sizes.iter().map(|(size, n)| (size.to_string(), json!(n))).collect();
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
                    "abandoned_before_run": c.abandoned,
                },
                "tokens": {"input": c.input_tokens, "output": c.output_tokens},
                "latency_ms": c.latency_ms.summary(),
                "queue_wait_ms": c.queue_ms.summary(),
                "compute_ms": c.compute_ms.summary(),
                "batches": {
                    "model_calls": c.model_calls,
                    "prompts": c.prompts,
                    "prompts_per_call": sizes,
                },
                "queue": {"depth": queue.depth, "capacity": queue.capacity, "running": queue.running},
                "cache_hit_rate": null,
                "thoughts": null,
                "gpu_memory_bytes": null,
                "notes": [
                    format!("latency percentiles are over the last {LATENCY_WINDOW} answered requests"),
                    "prompts_per_call: prompts in each forward batch (the questions of one request share one call; \
                     requests are not batched together yet)",
                    "cache_hit_rate is null: there is no prefix cache across requests yet",
                    "thoughts is null: AutoThink is not implemented yet",
                    "gpu_memory_bytes is null: this engine runs on the CPU",
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
