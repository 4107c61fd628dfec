//! `prism bench --think BUDGET`'s measurement: thought decoding through the engine the server runs (v1.1 AutoThink),
//! for each batch size of `--think-batch`: that many requests submitted at once, each one noul question
//! about its own evidence with `think_mode: "always"` and `think_budget: BUDGET`, so every request decodes
//! one thought of up to BUDGET tokens. The loop detector is off (a random-weight model's thoughts are
//! noise), so thoughts end at the budget unless the model writes `</think>` or an end of sequence.
//!
//! Reported per batch size: the thoughts' tokens and stop reasons, the wall time from submission to the
//! last answer, and two rates — `decode_tokens_per_s` (all thought tokens over the longest thought's
//! decode time, `timings.thought_ms`: the decode phase itself) and `wall_tokens_per_s` (over the whole
//! wall time, prefills included) — plus each request's own rate (tokens / its thought time), and the
//! SHA-256 of the requests' probabilities and thought texts (`thoughts_sha256`).
//!
//! Those two rates count every pass a thought spans, and while some requests' read-outs and thought
//! prefills still run, a decode step shares its pass with up to `--max-batch-tokens` of prefill. So each
//! row also gives the **steady** rate, from the engine's pass log: over the passes that were nothing but
//! one decode step of every thought of the batch (`full_decode_passes`), the median time from one such
//! pass to the next (the whole step: forward, sampling, planning; `steady_step_ms`), and
//! `steady_tokens_per_s` = sequences / that time — what decoding that many sequences at once runs at.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::LoopDetectorConfig;
use crate::engine::CancelToken;
use crate::{Answer, DecisionConfig, DecisionRequest, DecoderLetterModel, Family};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// What the thought measurement runs: the thought budget, the batch sizes, the timed runs of each, the
/// profile mode of one more run of each, and the variants each run is measured under in turn.
pub(super) struct ThinkPlan<'a> {
    pub budget: usize,
    pub batches: &'a [usize],
    pub runs: usize,
    pub profile: prism_model::profile::Mode,
    pub variants: &'a [Variant],
}

/// A setting a batch runs under (e.g. one kernel entry among several that give the same bits), set by
/// `apply` before each batch: several variants are measured on one model load, interleaved (each run
/// of each batch size under every variant in turn), so their comparison shares the machine's state.
pub(super) struct Variant {
    pub label: String,
    pub apply: Box<dyn Fn() -> Result<()>>,
}

/// Runs the thought measurement; the report's `thoughts` rows.
///
/// With a `profile` mode other than off, one more batch of each size runs profiled (see
/// [`prism_model::profile::Mode`]); the sections' device and host times over each such batch are
/// returned too.
pub(super) fn thought_rows(
    model: DecoderLetterModel,
    config: &DecisionConfig,
    plan: ThinkPlan<'_>,
    mut host: Option<&mut super::host_profile::HostProfile>,
    progress: &mut dyn FnMut(String),
) -> Result<(Vec<Value>, Value)> {
    let ThinkPlan {
        budget,
        batches,
        runs,
        profile,
        variants,
    } = plan;
    if budget == 0 {
        bail!("--think must be at least 1 token");
    }
    let most = batches.iter().copied().max().unwrap_or(1).max(1);
    let config = DecisionConfig {
        family: Family::AutoThink,
        loop_detector: LoopDetectorConfig {
            min_span: budget + 1,
            ..config.loop_detector.clone()
        },
        ..config.clone()
    };
    let device = model.decoder().device().clone();
    let state_bytes = model.decoder().new_state()?.bytes() as u64;
    let estimate = crate::engine::thought_device_bytes(state_bytes);
    if let Some((used, total)) = prism_model::device_memory(&device) {
        check_batch_fits(most, estimate, total.saturating_sub(used))?;
    }
    progress(format!(
        "a fresh sequence state: {state_bytes} bytes; a thought estimated at {estimate} bytes on a device"
    ));
    let log = Arc::new(PassLog::default());
    let (engine, worker) = super::bench_engine(model, config, most, false, Some(log.clone()))?;
    let request = |i: usize, run: usize| -> Result<DecisionRequest> {
        let body = json!({
            "state": format!("Ticket {i} (run {run}): the customer was charged twice for the March invoice and the card was declined afterwards."),
            "questions": {"refund": {"type": "noul", "instructions": "Should billing refund the second charge today?"}},
            "think_mode": "always",
            "think_budget": budget,
            "return_thought": true,
            "return_details": true,
        });
        DecisionRequest::parse(body.to_string().as_bytes(), &Default::default())
            .map_err(|e| anyhow::anyhow!("the thought request: {e}"))
    };
    let mut rows = Vec::new();
    let mut profiled = Vec::new();
    let profiling_on = profile != prism_model::profile::Mode::Off;
    // Run 0 warms the path up (its row is not reported); with `profile`, a last run of each batch
    // size is profiled. Each (run, batch size) runs under every variant in turn (`None`: no variants).
    let labels: Vec<Option<usize>> = if variants.is_empty() {
        vec![None]
    } else {
        (0..variants.len()).map(Some).collect()
    };
    let plan: Vec<(usize, usize, Option<usize>)> = (0..=runs)
        .flat_map(|run| batches.iter().map(move |&b| (run, b)))
        .chain(
            batches
                .iter()
                .filter(|_| profiling_on)
                .map(|&b| (runs + 1, b)),
        )
        .flat_map(|(run, b)| labels.iter().map(move |&v| (run, b, v)))
        .collect();
    for (run, batch, variant) in plan {
        let variant = variant.map(|v| &variants[v]);
        if let Some(v) = variant {
            (v.apply)().with_context(|| format!("setting variant {}", v.label))?;
        }
        {
            let profiling = run > runs;
            if profiling {
                prism_model::profile::set_mode(profile);
                prism_model::profile::take()?;
            }
            if batch == 0 {
                bail!("--think-batch sizes must be at least 1");
            }
            // The host profile: every timed run (not the warm-up, not the profiled one).
            let sampled = run >= 1 && !profiling;
            if let (Some(host), true) = (host.as_deref_mut(), sampled) {
                host.open(&format!("think, {batch} at once"));
            }
            log.take();
            let started = Instant::now();
            let mut receivers = Vec::with_capacity(batch);
            // Submitting through a channel is the engine's public pattern; `tests/engine.rs` and
            // `tests/engine_steps.rs` drive it the same way on purpose (a test does not call into the
            // bench it is not testing).
            for i in 0..batch {
                let prepared = engine.prepare(request(i, run)?)?;
                let (tx, rx) = std::sync::mpsc::channel();
                engine
                    .submit(
                        prepared,
                        Box::new(move |r| {
                            let _ = tx.send(r);
                        }),
                        None,
                        CancelToken::default(),
                    )
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                receivers.push(rx);
            }
            let mut tokens = Vec::with_capacity(batch);
            let mut thought_ms = Vec::with_capacity(batch);
            let mut stops = std::collections::BTreeMap::<String, usize>::new();
            // Each request's probability and thought text, in submission order: the digest's input.
            let mut outcomes = Vec::with_capacity(batch);
            for rx in receivers {
                let output = rx
                    .recv()
                    .context("the engine stopped")?
                    .map_err(|e| anyhow::anyhow!("a thought request failed: {e}"))?;
                let Some(Answer::Noul(answer)) = output.response.answers.get("refund") else {
                    bail!("no noul answer");
                };
                let details = answer.details.as_ref().context("no x_details")?;
                tokens.push(details.thought_tokens.unwrap_or(0));
                thought_ms.push(details.timings.thought_ms);
                let stop = details
                    .stop_reason
                    .map_or("none".to_string(), |s| s.as_str().to_string());
                *stops.entry(stop).or_default() += 1;
                outcomes.push((answer.noul, answer.thought.clone()));
            }
            let wall = started.elapsed().as_secs_f64();
            if let Some(host) = host.as_deref() {
                host.close();
            }
            if profiling {
                prism_model::profile::set_mode(prism_model::profile::Mode::Off);
                let sections = prism_model::profile::take()?;
                let steps: u64 = tokens.iter().copied().max().unwrap_or(0);
                progress(format!(
                    "profile ({}) of {batch} thoughts at once ({:.1} ms, {steps} decode steps; device and host ms):",
                    profile.as_str(),
                    wall * 1e3
                ));
                let mut list = Vec::new();
                for s in &sections {
                    let device_ms = s.device.as_secs_f64() * 1e3;
                    let host_ms = s.host.as_secs_f64() * 1e3;
                    progress(format!(
                        "  {:<45} {device_ms:>10.2} {host_ms:>10.2} ms {:>7} calls",
                        s.name, s.calls
                    ));
                    list.push(json!({"section": s.name, "ms": device_ms, "host_ms": host_ms, "calls": s.calls}));
                }
                profiled.push(json!({
                    "variant": variant.map(|v| v.label.as_str()),
                    "mode": profile.as_str(),
                    "sequences": batch,
                    "wall_ms": wall * 1e3,
                    "decode_steps": steps,
                    "sections": list,
                }));
                continue;
            }
            if run == 0 {
                continue;
            }
            let steady = steady_decode(&log.take(), batch);
            let total: u64 = tokens.iter().sum();
            let longest_ms = thought_ms.iter().copied().fold(0.0, f64::max);
            let per_request: Vec<f64> = tokens
                .iter()
                .zip(&thought_ms)
                .map(|(&t, &ms)| t as f64 / (ms / 1e3).max(1e-9))
                .collect();
            let mut sorted = per_request.clone();
            sorted.sort_by(f64::total_cmp);
            let line = json!({
                "run": run,
                "variant": variant.map(|v| v.label.as_str()),
                "sequences": batch,
                "budget": budget,
                "thought_tokens": total,
                "stop_reasons": stops,
                "wall_ms": wall * 1e3,
                "longest_thought_ms": longest_ms,
                "decode_tokens_per_s": total as f64 / (longest_ms / 1e3).max(1e-9),
                "wall_tokens_per_s": total as f64 / wall,
                "per_sequence_tokens_per_s_median": sorted[sorted.len() / 2],
                "passes": steady.passes,
                "full_decode_passes": steady.full_decode_passes,
                "steady_step_ms": steady.step_ms,
                "steady_pass_ms": steady.pass_ms,
                "steady_tokens_per_s": steady.step_ms.map(|ms| batch as f64 / (ms / 1e3).max(1e-9)),
                // The requests of a run and batch size are the same in every build and always get
                // the same thoughts (per-question seeds): equal digests across builds, equal bits.
                "thoughts_sha256": super::answers_digest(&outcomes)?,
                // The device's used memory after the batch (CUDA; the stream-ordered pool keeps what
                // it grew to, so its growth across rows bounds what a batch of thoughts held).
                "device_used_bytes": prism_model::device_memory(&device).map(|m| m.0),
            });
            progress(format!(
                "thoughts{}: {batch:>3} sequences x {budget} tokens: {total} tokens, decode {:.1} tokens/s ({:.1} a sequence), steady {} ({} of {} passes all {batch} decoding, a step {}), wall {:.0} ms",
                variant.map(|v| format!(" ({})", v.label)).unwrap_or_default(),
                line["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
                line["per_sequence_tokens_per_s_median"].as_f64().unwrap_or(0.0),
                steady.step_ms.map_or("-".into(), |ms| format!("{:.1} tokens/s", batch as f64 / (ms / 1e3).max(1e-9))),
                steady.full_decode_passes,
                steady.passes,
                steady.step_ms.map_or("-".into(), |ms| format!("{ms:.2} ms")),
                wall * 1e3
            ));
            rows.push(line);
        }
    }
    let stats = engine.stats();
    drop(engine);
    worker.join();
    progress(format!(
        "engine: {} passes, {} thought steps, {} thoughts",
        stats.passes, stats.thought_steps, stats.thoughts_finished
    ));
    Ok((rows, Value::Array(profiled)))
}

/// One pass of the engine as its observer saw it: when (right after its forward), the forward's
/// seconds, and what it held.
#[derive(Debug, Clone, Copy)]
struct LoggedPass {
    at: Instant,
    seconds: f64,
    groups: usize,
    tokens: usize,
    thought_steps: usize,
}

/// The engine's passes, logged by its observer.
#[derive(Default)]
struct PassLog(Mutex<Vec<LoggedPass>>);

impl crate::engine::EngineObserver for PassLog {
    fn pass(&self, record: &crate::engine::PassRecord, seconds: f64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(LoggedPass {
                at: Instant::now(),
                seconds,
                groups: record.groups,
                tokens: record.tokens,
                thought_steps: record.thought_steps,
            });
    }
}

impl PassLog {
    /// The passes logged since the last call.
    fn take(&self) -> Vec<LoggedPass> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The steady decode figures of one batch's passes (see the module's doc).
#[derive(Debug, PartialEq)]
struct Steady {
    passes: usize,
    /// Passes that were one decode step (one token) of each of the batch's `sequences` and nothing else.
    full_decode_passes: usize,
    /// Median time from a full decode pass to the next one when that is one too (None: no such pair).
    step_ms: Option<f64>,
    /// Median forward time of the full decode passes (None: none).
    pass_ms: Option<f64>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

fn steady_decode(passes: &[LoggedPass], sequences: usize) -> Steady {
    let full =
        |p: &LoggedPass| p.groups == 0 && p.thought_steps == sequences && p.tokens == sequences;
    let steps = passes
        .windows(2)
        .filter(|w| full(&w[0]) && full(&w[1]))
        .map(|w| (w[1].at - w[0].at).as_secs_f64() * 1e3)
        .collect();
    Steady {
        passes: passes.len(),
        full_decode_passes: passes.iter().filter(|p| full(p)).count(),
        step_ms: median(steps),
        pass_ms: median(
            passes
                .iter()
                .filter(|p| full(p))
                .map(|p| p.seconds * 1e3)
                .collect(),
        ),
    }
}

/// Refuses `most` thoughts at once where `per_thought` bytes each exceed the device's `free` bytes:
/// the engine would run out of memory part-way (`prism serve` sizes its seats from the same estimate).
fn check_batch_fits(most: usize, per_thought: u64, free: u64) -> Result<()> {
    let need = per_thought.saturating_mul(most as u64);
    if need > free {
        bail!(
            "--think-batch {most}: {most} thoughts at once hold about {:.1} GB on the device \
             ({:.2} GB each) and {:.1} GB is free; ask for at most {} at once",
            need as f64 / 1e9,
            per_thought as f64 / 1e9,
            free as f64 / 1e9,
            free / per_thought.max(1)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_batch_fits, steady_decode, LoggedPass, Steady};
    use std::time::{Duration, Instant};

    #[test]
    fn the_steady_rate_counts_only_passes_of_every_thought_decoding_alone() {
        let t0 = Instant::now();
        let pass = |ms: u64, groups, tokens, thought_steps| LoggedPass {
            at: t0 + Duration::from_millis(ms),
            seconds: 0.010,
            groups,
            tokens,
            thought_steps,
        };
        let passes = [
            pass(0, 2, 900, 0),   // read-outs
            pass(800, 1, 500, 2), // two thoughts decode beside an evidence: not steady
            pass(830, 0, 3, 3),   // three decode steps: all of the batch
            pass(850, 0, 3, 3),   // 20 ms later
            pass(880, 0, 3, 3),   // 30 ms later
            pass(900, 0, 12, 3),  // a close (several tokens): not a decode pass
            pass(920, 0, 3, 3),   // full, but the pass before it was not
            pass(960, 0, 2, 2),   // one thought done: not all of the batch
        ];
        let steady = steady_decode(&passes, 3);
        assert_eq!(
            steady,
            Steady {
                passes: 8,
                full_decode_passes: 4,
                // The pairs (830, 850) and (850, 880): 20 and 30 ms; the median of two is the larger.
                step_ms: Some(30.0),
                pass_ms: Some(10.0),
            }
        );
        let none = steady_decode(&passes[..2], 3);
        assert_eq!(
            (none.full_decode_passes, none.step_ms, none.pass_ms),
            (0, None, None)
        );
    }

    #[test]
    fn a_thought_batch_must_fit_the_free_device_memory() {
        // The 27B on an 80-GB card: ~1.2 GB a thought, ~47 GB free beside the model.
        let per = 1_200_000_000;
        assert!(check_batch_fits(32, per, 47_000_000_000).is_ok());
        let error = check_batch_fits(64, per, 47_000_000_000)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--think-batch 64"), "{error}");
        assert!(error.contains("at most 39 at once"), "{error}");
        assert!(check_batch_fits(39, per, 47_000_000_000).is_ok());
        assert!(check_batch_fits(40, per, 47_000_000_000).is_err());
    }
}
