//! `prism loadgen`'s load and check: load a `/v1/systemone` server the way many users would, and check its answers.
//!
//! N clients (one thread and one keep-alive connection each) send requests back to back for a duration
//! (or a number of requests); the requests come from `--requests FILE` (one JSON request a line) or from
//! a built-in mix (1–5 questions of every type, evidence of ~100–2,000 tokens, a quarter of the requests
//! asking about an evidence seen before), taken in order across all clients, so a request is sent again
//! only once the list is used up. After the load, up to `--check` of the distinct requests answered
//! under load are sent again one at a time, and each answer is compared with the one it got under load
//! (SHA-256 of the body before `x_latency_ms`, and the largest difference of any number in the
//! answers), so an engine that answered differently when batched is caught. Reports requests/s, input
//! tokens/s, latency percentiles and status counts, as text and optionally as JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// What to send, how hard, and what to check (`prism loadgen`'s flags).
#[derive(Clone, Debug)]
pub struct LoadgenOptions {
    /// The server's base URL, e.g. http://127.0.0.1:8092.
    pub url: String,
    /// Concurrent clients (when `sweep` is empty).
    pub clients: usize,
    /// Seconds of load per client count.
    pub duration: f64,
    /// Stop a client count after this many requests (0: only the duration stops it).
    pub max_requests: u64,
    /// Client counts measured in turn instead of `clients`.
    pub sweep: Vec<usize>,
    /// Requests to send, one JSON request a line; default the built-in mix.
    pub requests: Option<PathBuf>,
    /// Distinct requests in the built-in mix, and its seed.
    pub mix_size: usize,
    pub seed: u64,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Distinct requests answered under load to send again alone and compare (0: none).
    pub check: usize,
}

/// What a load run measured: one row per client count, and the check.
pub struct LoadgenRun {
    /// The decide endpoint.
    pub url: String,
    pub distinct_requests: usize,
    pub distinct_answered: usize,
    /// One object per client count (`clients`, `requests_per_s`, `latency_ms`, `statuses`, …).
    pub levels: Vec<Value>,
    /// `checked`, `mismatches`, `max_abs_difference`, `other_differences`, `first_mismatch`; null
    /// without a check.
    pub check: Value,
}

impl LoadgenRun {
    /// `--json-out`'s report, with the plot's record (null without one).
    pub fn report(&self, options: &LoadgenOptions, plot: Value) -> Value {
        json!({
            "plot": plot,
            "url": self.url,
            "distinct_requests": self.distinct_requests,
            "distinct_answered": self.distinct_answered,
            "mix": if options.requests.is_some() { json!("file") } else { json!({"builtin": true, "size": options.mix_size, "seed": options.seed}) },
            "levels": self.levels,
            "check": self.check,
        })
    }
}

const WORDS: &[&str] = &[
    "the",
    "customer",
    "parcel",
    "arrived",
    "late",
    "and",
    "box",
    "was",
    "crushed",
    "invoice",
    "charged",
    "twice",
    "refund",
    "support",
    "ticket",
    "order",
    "delivery",
    "driver",
    "warehouse",
    "account",
    "password",
    "login",
    "error",
    "page",
    "payment",
    "card",
    "declined",
    "subscription",
    "cancel",
    "renewal",
    "discount",
    "price",
    "shipping",
    "address",
    "wrong",
    "item",
    "missing",
    "broken",
    "replacement",
    "urgent",
    "today",
    "manager",
    "angry",
    "polite",
    "thanks",
    "again",
];

/// The built-in mix: `n` requests, a quarter of them about an evidence asked before.
fn builtin_mix(n: usize, seed: u64) -> Vec<Vec<u8>> {
    // ChaCha12 (rand's StdRng): the same mix for the same seed with this lock file.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut evidences: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let state = if !evidences.is_empty() && rng.random_range(0..4) == 0 {
            evidences[rng.random_range(0..evidences.len())].clone()
        } else {
            // ~1.3 tokens a word: 75 to 1,500 words.
            let words = rng.random_range(75..=1500);
            let mut text = format!("Ticket {i}:");
            for w in 0..words {
                text.push(' ');
                text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
                if w % 17 == 16 {
                    text.push('.');
                }
            }
            evidences.push(text.clone());
            text
        };
        let mut questions = serde_json::Map::new();
        for q in 0..rng.random_range(1..=5) {
            let question = match rng.random_range(0..3) {
                0 => {
                    json!({"type": "noul", "instructions": format!("Does the ticket mention a {}?", WORDS[rng.random_range(0..WORDS.len())])})
                }
                1 => {
                    json!({"type": "choice", "instructions": "Which team should handle this?", "criteria": {"shipping": "Deliveries and parcels", "billing": "Payments, invoices and refunds", "technical": "Logins, errors and pages", "sales": null}})
                }
                _ => {
                    json!({"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "angry", "furious"]})
                }
            };
            questions.insert(format!("q{q}"), question);
        }
        let request = json!({"state": state, "questions": questions});
        out.push(serde_json::to_vec(&request).unwrap_or_default());
    }
    out
}

fn read_requests(path: &PathBuf) -> Result<Vec<Vec<u8>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .with_context(|| format!("{}: line {} is not JSON", path.display(), i + 1))?;
        if !value.is_object() {
            bail!("{}: line {} is not a JSON object", path.display(), i + 1);
        }
        out.push(line.as_bytes().to_vec());
    }
    if out.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(out)
}

/// One HTTP exchange's outcome.
struct Sent {
    status: u16,
    body: Vec<u8>,
}

/// A blocking HTTP/1.1 client with keep-alive: statuses are answers, not errors; 10 minutes at most.
pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into()
}

fn send(agent: &ureq::Agent, url: &str, key: Option<&str>, body: &[u8]) -> Result<Sent> {
    let mut request = agent.post(url).header("Content-Type", "application/json");
    if let Some(key) = key {
        request = request.header("Authorization", &format!("Bearer {key}"));
    }
    let mut response = request.send(body)?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()?;
    Ok(Sent { status, body })
}

/// SHA-256 of the answer: the body up to `,"x_latency_ms"` (timings excluded).
fn answer_digest(body: &[u8]) -> String {
    let marker = b",\"x_latency_ms\"";
    let end = body
        .windows(marker.len())
        .position(|w| w == marker)
        .unwrap_or(body.len());
    let digest = Sha256::digest(&body[..end]);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the clients of one level saw.
#[derive(Default)]
struct Tally {
    latencies_ms: Vec<f64>,
    /// The server's own latency of each answer (`x_latency_ms`: its headers' arrival to its answer).
    server_ms: Vec<f64>,
    /// The client's latency less the server's, answer by answer: connection, request and response
    /// bytes, and both sides' HTTP handling outside the server's clock.
    transport_ms: Vec<f64>,
    statuses: BTreeMap<u16, u64>,
    input_tokens: u64,
    /// Tokens decoded (thoughts) by the answered requests.
    output_tokens: u64,
    transport_errors: u64,
}

fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The first answer (200) each distinct request got under load: its body.
type Answered = Arc<Mutex<BTreeMap<usize, Vec<u8>>>>;

struct Level<'a> {
    url: &'a str,
    key: Option<&'a str>,
    requests: &'a Arc<Vec<Vec<u8>>>,
    answered: &'a Answered,
    clients: usize,
    duration: Duration,
    max_requests: u64,
}

fn run_level(level: Level<'_>, progress: &mut dyn FnMut(String)) -> Value {
    let Level {
        url,
        key,
        requests,
        answered,
        clients,
        duration,
        max_requests,
    } = level;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (url, key) = (url.to_string(), key.map(str::to_string));
            let (requests, answered, tally, next, stop) = (
                requests.clone(),
                answered.clone(),
                tally.clone(),
                next.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                let agent = agent();
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if max_requests > 0 && i >= max_requests {
                        break;
                    }
                    let r = (i % requests.len() as u64) as usize;
                    let sent_at = Instant::now();
                    let result = send(&agent, &url, key.as_deref(), &requests[r]);
                    let ms = sent_at.elapsed().as_secs_f64() * 1e3;
                    let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
                    match result {
                        Ok(sent) => {
                            *t.statuses.entry(sent.status).or_default() += 1;
                            if sent.status == 200 {
                                t.latencies_ms.push(ms);
                                if let Ok(v) = serde_json::from_slice::<Value>(&sent.body) {
                                    t.input_tokens +=
                                        v["usage"]["input_tokens"].as_u64().unwrap_or(0);
                                    t.output_tokens +=
                                        v["usage"]["output_tokens"].as_u64().unwrap_or(0);
                                    if let Some(server) = v["x_latency_ms"].as_f64() {
                                        t.server_ms.push(server);
                                        t.transport_ms.push(ms - server);
                                    }
                                }
                                answered
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .entry(r)
                                    .or_insert(sent.body);
                            }
                        }
                        Err(_) => t.transport_errors += 1,
                    }
                }
            })
        })
        .collect();
    // Progress once a second.
    loop {
        let finished = threads.iter().all(|t| t.is_finished());
        if finished || started.elapsed() >= duration {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        let n = next.load(Ordering::Relaxed);
        let s = started.elapsed().as_secs_f64();
        progress(format!(
            "\r  {clients} clients: {s:5.1} s, {n} requests, {:.1} req/s   ",
            n as f64 / s.max(1e-9)
        ));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let elapsed = started.elapsed().as_secs_f64();
    progress("\n".into());
    let t = tally.lock().unwrap_or_else(|p| p.into_inner());
    let mut sorted = t.latencies_ms.clone();
    let first: Vec<f64> = sorted.iter().copied().take(50).collect();
    sorted.sort_by(f64::total_cmp);
    let ok = sorted.len() as f64;
    let spread = |values: &[f64]| -> Value {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        json!({
            "count": sorted.len(),
            "p50": percentile(&sorted, 0.50),
            "p95": percentile(&sorted, 0.95),
            "p99": percentile(&sorted, 0.99),
        })
    };
    json!({
        "clients": clients,
        "seconds": elapsed,
        "answered": sorted.len(),
        "requests_per_s": ok / elapsed,
        "input_tokens_per_s": t.input_tokens as f64 / elapsed,
        "output_tokens_per_s": t.output_tokens as f64 / elapsed,
        "latency_ms": {
            "mean": if sorted.is_empty() { Value::Null } else { json!(sorted.iter().sum::<f64>() / ok) },
            "p50": percentile(&sorted, 0.50),
            "p95": percentile(&sorted, 0.95),
            "p99": percentile(&sorted, 0.99),
            "max": sorted.last(),
            "first": first,
        },
        "server_latency_ms": spread(&t.server_ms),
        "transport_ms": spread(&t.transport_ms),
        "statuses": t.statuses.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "transport_errors": t.transport_errors,
    })
}

/// Compares two answers leaf by leaf: the largest absolute difference of paired numbers, and the
/// count of other leaves that differ (a flipped `choice`, a different shape).
fn compare(a: &Value, b: &Value, max_diff: &mut f64, other: &mut u64) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => *max_diff = max_diff.max((x - y).abs()),
            _ => *other += 1,
        },
        (Value::Object(x), Value::Object(y)) if x.len() == y.len() => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => compare(v, w, max_diff, other),
                    None => *other += 1,
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (v, w) in x.iter().zip(y) {
                compare(v, w, max_diff, other);
            }
        }
        _ if a == b => {}
        _ => *other += 1,
    }
}

/// Sends up to `count` of the requests answered under load again, one at a time, and compares.
fn check(
    url: &str,
    key: Option<&str>,
    requests: &[Vec<u8>],
    answered: &BTreeMap<usize, Vec<u8>>,
    count: usize,
) -> Result<Value> {
    let agent = agent();
    let indices: Vec<usize> = answered.keys().copied().collect();
    let step = indices.len().div_ceil(count.max(1)).max(1);
    let (mut checked, mut mismatches, mut refused) = (0u64, 0u64, 0u64);
    let mut max_diff = 0.0f64;
    // Leaves other than numbers that differ: a different `choice` is a flipped decision.
    let mut flips = 0u64;
    let mut first_mismatch = Value::Null;
    for &r in indices.iter().step_by(step).take(count) {
        let under_load = &answered[&r];
        let sent = send(&agent, url, key, &requests[r])
            .with_context(|| format!("request {r} alone: the server did not answer"))?;
        if sent.status != 200 {
            refused += 1;
            continue;
        }
        checked += 1;
        if answer_digest(&sent.body) != answer_digest(under_load) {
            mismatches += 1;
            let parse = |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap_or(Value::Null);
            let (alone, loaded) = (parse(&sent.body), parse(under_load));
            compare(
                &alone["answers"],
                &loaded["answers"],
                &mut max_diff,
                &mut flips,
            );
            if first_mismatch.is_null() {
                first_mismatch = json!({"request": r, "alone": alone["answers"], "under_load": loaded["answers"]});
            }
        }
    }
    Ok(json!({
        "checked": checked,
        "refused_alone": refused,
        "mismatches": mismatches,
        "max_abs_difference": max_diff,
        "other_differences": flips,
        "first_mismatch": first_mismatch,
    }))
}

/// Loads the server at each client count in turn, then checks (see the module's doc). `progress` gets
/// the text to show on a terminal as it goes (with its own `\r` and `\n`).
pub fn run(args: &LoadgenOptions, progress: &mut dyn FnMut(String)) -> Result<LoadgenRun> {
    if args.clients == 0 || args.sweep.contains(&0) {
        bail!("client counts must be at least 1");
    }
    if !(args.duration.is_finite() && args.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    let base = args.url.trim_end_matches('/');
    let url = format!("{base}/v1/systemone");
    let requests = Arc::new(match &args.requests {
        Some(path) => read_requests(path)?,
        None => builtin_mix(args.mix_size.max(1), args.seed),
    });
    let key = args.api_key.as_deref();
    progress(format!(
        "prism loadgen: {} distinct requests against {url}\n",
        requests.len()
    ));
    let levels = if args.sweep.is_empty() {
        vec![args.clients]
    } else {
        args.sweep.clone()
    };
    let answered: Answered = Arc::new(Mutex::new(BTreeMap::new()));
    let mut results = Vec::new();
    for &clients in &levels {
        let level = Level {
            url: &url,
            key,
            requests: &requests,
            answered: &answered,
            clients,
            duration: Duration::from_secs_f64(args.duration),
            max_requests: args.max_requests,
        };
        results.push(run_level(level, progress));
    }
    let answered = answered.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let checked = if args.check > 0 {
        progress(format!(
            "  checking {} of the {} distinct requests answered under load, one at a time ...\n",
            args.check.min(answered.len()),
            answered.len()
        ));
        check(&url, key, &requests, &answered, args.check)?
    } else {
        Value::Null
    };
    Ok(LoadgenRun {
        url,
        distinct_requests: requests.len(),
        distinct_answered: answered.len(),
        levels: results,
        check: checked,
    })
}

/// One client count of a sweep, as [`sweep_png`] draws it.
pub struct SweepPoint {
    pub requests_per_s: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
}

/// The axes' ends of a [`sweep_png`] picture.
pub struct SweepScale {
    pub x_max_ms: f64,
    pub y_max_requests_per_s: f64,
}

/// Colours of the sweep picture's two series.
pub const SWEEP_P50: plotters::style::RGBColor = plotters::style::RGBColor(31, 119, 180);
pub const SWEEP_P95: plotters::style::RGBColor = plotters::style::RGBColor(255, 127, 14);

/// Throughput against latency as a 640 × 480 PNG on white, without text (no font is needed on any
/// machine; the numbers are in the table and the JSON): the plot area x 40..600 (latency from 0 to the
/// largest p95 plus a tenth) by y 20..400 (requests/s from 0 to the largest plus a tenth), framed in gray
/// with light grid lines every tenth of each axis; per client count, in the order given, a blue point
/// (p50) and an orange one (p95) at that level's requests/s, each series joined by a line.
pub fn sweep_png(path: &std::path::Path, points: &[SweepPoint]) -> Result<SweepScale> {
    use plotters::prelude::*;
    const GRID: RGBColor = RGBColor(232, 232, 232);
    const FRAME: RGBColor = RGBColor(128, 128, 128);
    let (left, top, right, bottom) = (40i32, 20i32, 600i32, 400i32);
    let finite = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let x_max = points
        .iter()
        .map(|p| finite(p.p95_ms).max(finite(p.p50_ms)))
        .fold(0.0, f64::max)
        * 1.1;
    let y_max = points
        .iter()
        .map(|p| finite(p.requests_per_s))
        .fold(0.0, f64::max)
        * 1.1;
    let (x_max, y_max) = (
        if x_max > 0.0 { x_max } else { 1.0 },
        if y_max > 0.0 { y_max } else { 1.0 },
    );
    let x = |v: f64| left + ((finite(v) / x_max) * (right - left) as f64).round() as i32;
    let y = |v: f64| bottom - ((finite(v) / y_max) * (bottom - top) as f64).round() as i32;
    let root = BitMapBackend::new(path, (640, 480)).into_drawing_area();
    let draw = |r: Result<(), DrawingAreaErrorKind<_>>| r.map_err(|e| anyhow::anyhow!("{e:?}"));
    draw(root.fill(&WHITE))?;
    for i in 1..10 {
        let fx = left + (right - left) * i / 10;
        let fy = bottom - (bottom - top) * i / 10;
        draw(root.draw(&PathElement::new(vec![(fx, top), (fx, bottom)], GRID)))?;
        draw(root.draw(&PathElement::new(vec![(left, fy), (right, fy)], GRID)))?;
    }
    draw(root.draw(&Rectangle::new([(left, top), (right, bottom)], FRAME)))?;
    for (color, latency) in [
        (
            SWEEP_P50,
            &(|p: &SweepPoint| p.p50_ms) as &dyn Fn(&SweepPoint) -> f64,
        ),
        (SWEEP_P95, &|p: &SweepPoint| p.p95_ms),
    ] {
        let series: Vec<(i32, i32)> = points
            .iter()
            .map(|p| (x(latency(p)), y(p.requests_per_s)))
            .collect();
        draw(root.draw(&PathElement::new(series.clone(), color.stroke_width(2))))?;
        for &(px, py) in &series {
            draw(root.draw(&Circle::new((px, py), 5, color.filled())))?;
        }
    }
    draw(root.present())?;
    Ok(SweepScale {
        x_max_ms: x_max,
        y_max_requests_per_s: y_max,
    })
}
