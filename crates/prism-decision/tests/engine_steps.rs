//! The engine's step loop against a fake model whose state is its token history, so every branch's
//! logits are a function of the whole sequence it was computed on: if the engine stitched a prefix, a
//! cached state, a chunk or a shared group wrongly, the logits (and so the answers) would change.
//! Every answer is compared with `decide` on the same function of the prompt's tokens.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::submit_with;
use prism_decision::engine::{
    thinking::think_alone, Branch, CancelToken, Engine, EngineOptions, GroupInput, GroupOutput,
    JobError, JobResult, NextLogits, PassModel, PrefixCacheLimits, PromptEncoder, SubmitError,
    ThoughtMarkers,
};
use prism_decision::{
    decide, Answer, DecisionConfig, DecisionRequest, DecisionResponse, Family, LetterLogits,
    LetterModel, LetterPrompt, ModelError, RequestDefaults, ThoughtOutcome, ThoughtRequest,
};

mod common;

/// One token per byte of `system \n user`; with thinking on, the token 258 (`<think>`) after them.
/// Tokens 256 (`</think>`) and 257 (end of sequence) end a thought.
struct ByteEncoder;

const END_THINK: u32 = 256;
const END_OF_SEQUENCE: u32 = 257;
const THINK: u32 = 258;
/// The fake's vocabulary.
const VOCAB: usize = 259;

impl PromptEncoder for ByteEncoder {
    fn encode(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        Ok(format!("{}\n{}", prompt.system, prompt.user)
            .bytes()
            .map(u32::from)
            .collect())
    }

    fn encode_thinking(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        let mut tokens = self.encode(prompt)?;
        tokens.push(THINK);
        Ok(tokens)
    }

    fn thought_markers(&self) -> Option<ThoughtMarkers> {
        Some(ThoughtMarkers {
            end_think: END_THINK,
            end_of_sequence: vec![END_OF_SEQUENCE],
            after_end: vec![10, 10],
            close: vec![10, END_THINK, 10, 10],
        })
    }

    fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens
            .iter()
            .filter(|&&t| t < 256)
            .map(|&t| t as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The next-token logits over the fake's vocabulary after a whole token sequence: pseudo-random, with
/// `</think>` and the end of sequence growing likelier as a thought gets longer, and after 10 thought
/// tokens a pull towards the token three back (a thought that drifts into a loop of period 3).
fn next_token_logits(tokens: &[u32]) -> Vec<f32> {
    let since_think = tokens.iter().rev().position(|&t| t == THINK).unwrap_or(0);
    let echo = (since_think > 10).then(|| tokens[tokens.len() - 3]);
    let base = letter_logits(tokens, VOCAB);
    base.iter()
        .enumerate()
        .map(|(i, &l)| match i as u32 {
            END_THINK => l as f32 + since_think as f32 * 0.15,
            END_OF_SEQUENCE => l as f32 + since_think as f32 * 0.05 - 2.0,
            t if Some(t) == echo => l as f32 + 12.0,
            _ => l as f32,
        })
        .collect()
}

/// The letter logits of a whole token sequence.
fn letter_logits(tokens: &[u32], letters: usize) -> Vec<f64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    (0..letters as u64)
        .map(|i| {
            let x = (h ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((x >> 11) as f64 / (1u64 << 53) as f64) * 8.0 - 4.0
        })
        .collect()
}

/// `decide`'s model: the same function of each prompt's tokens, one prompt at a time.
struct Reference;

impl LetterModel for Reference {
    fn model_name(&self) -> &str {
        "fake"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        let mut logits = Vec::new();
        let mut input_tokens = 0;
        for p in prompts {
            let tokens = ByteEncoder.encode(p)?;
            input_tokens += tokens.len() as u64;
            logits.push(letter_logits(&tokens, p.option_ids.len()));
        }
        Ok(LetterLogits {
            logits,
            input_tokens,
            output_tokens: 0,
        })
    }

    /// Each thought alone, on the engine's fake model.
    fn think(&mut self, thoughts: &[ThoughtRequest]) -> Result<Vec<ThoughtOutcome>, ModelError> {
        let mut fake = Fake {
            log: Arc::default(),
            hold_first: None,
            entered: Arc::default(),
            poison: None,
        };
        let mut outcomes = Vec::new();
        for thought in thoughts {
            outcomes.extend(think_alone(
                &mut fake,
                &ByteEncoder,
                std::slice::from_ref(thought),
                EngineOptions::default().max_prompt_tokens,
            )?);
        }
        Ok(outcomes)
    }
}

/// What the fake saw of one pass.
#[derive(Debug, Clone)]
struct PassLog {
    groups: usize,
    branches: usize,
    tokens: usize,
    /// Groups that asked for next-token logits (thought steps).
    thought_steps: usize,
}

/// The engine's model: the state is the token history.
struct Fake {
    log: Arc<Mutex<Vec<PassLog>>>,
    /// The first pass waits for a message (so requests pile up behind it).
    hold_first: Option<mpsc::Receiver<()>>,
    /// Passes begun (the held one counts from its start).
    entered: Arc<AtomicUsize>,
    /// A pass holding this byte sequence anywhere fails.
    poison: Option<Vec<u32>>,
}

impl PassModel for Fake {
    type State = Vec<u32>;

    fn model_name(&self) -> &str {
        "fake"
    }

    fn run_pass(
        &mut self,
        groups: &[GroupInput<'_, Vec<u32>>],
    ) -> Result<Vec<GroupOutput<Vec<u32>>>, ModelError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        if let Some(gate) = self.hold_first.take() {
            let _ = gate.recv_timeout(Duration::from_secs(20));
        }
        let mut outputs = Vec::new();
        let mut log = PassLog {
            groups: groups.len(),
            branches: 0,
            tokens: 0,
            thought_steps: 0,
        };
        for group in groups {
            let mut history = group.start.cloned().unwrap_or_default();
            history.extend_from_slice(group.prefix);
            log.tokens += group.prefix.len();
            let mut logits = Vec::new();
            for &Branch { tokens, letters } in &group.branches {
                assert!(!tokens.is_empty(), "a branch without tokens");
                let mut full = history.clone();
                full.extend_from_slice(tokens);
                if full.windows(4).any(|w| w == [79, 79, 77, 33]) {
                    // "OOM!": the device runs out of memory for this sequence.
                    return Err(ModelError::OutOfMemory(
                        "CUDA_ERROR_OUT_OF_MEMORY (fake)".into(),
                    ));
                }
                if let Some(poison) = &self.poison {
                    if full.windows(poison.len()).any(|w| w == poison.as_slice()) {
                        return Err(ModelError::Backend("poisoned prompt".into()));
                    }
                }
                logits.push(letter_logits(&full, letters));
                log.tokens += tokens.len();
                log.branches += 1;
            }
            log.thought_steps += usize::from(group.want_logits.is_some());
            outputs.push(GroupOutput {
                state: group.want_state.then(|| history.clone()),
                logits,
                next_logits: group.want_logits.map(|_| NextLogits {
                    values: next_token_logits(&history),
                    ids: None,
                }),
            });
        }
        self.log.lock().unwrap().push(log);
        Ok(outputs)
    }

    fn state_bytes(&self, state: &Vec<u32>) -> usize {
        state.len() * 4
    }

    /// "Device memory": 10 bytes a token of the last pass, of 2⁴⁰.
    fn device_memory(&self) -> Option<(u64, u64)> {
        let log = self.log.lock().unwrap();
        log.last().map(|p| (10 * p.tokens as u64, 1 << 40))
    }
}

fn start(
    options: EngineOptions,
    hold_first: Option<mpsc::Receiver<()>>,
    poison: Option<&str>,
) -> (
    Engine,
    prism_decision::EngineWorker,
    Arc<Mutex<Vec<PassLog>>>,
    Arc<AtomicUsize>,
) {
    start_with(options, DecisionConfig::default(), hold_first, poison)
}

fn start_with(
    options: EngineOptions,
    config: DecisionConfig,
    hold_first: Option<mpsc::Receiver<()>>,
    poison: Option<&str>,
) -> (
    Engine,
    prism_decision::EngineWorker,
    Arc<Mutex<Vec<PassLog>>>,
    Arc<AtomicUsize>,
) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let entered = Arc::new(AtomicUsize::new(0));
    let fake = Fake {
        log: log.clone(),
        hold_first,
        entered: entered.clone(),
        poison: poison.map(|p| p.bytes().map(u32::from).collect()),
    };
    let (engine, worker) =
        Engine::start(fake, Arc::new(ByteEncoder), config, options, None).unwrap();
    (engine, worker, log, entered)
}

fn request(state: &str, questions: &[(&str, &str)]) -> DecisionRequest {
    request_with(state, questions, "")
}

/// A request body with `extra` (top-level fields, each followed by `, `) before its questions.
fn request_with(state: &str, questions: &[(&str, &str)], extra: &str) -> DecisionRequest {
    let mut body = format!("{{\"state\": {state:?}, {extra}\"questions\": {{");
    for (i, (name, q)) in questions.iter().enumerate() {
        if i > 0 {
            body.push_str(", ");
        }
        body.push_str(&format!("{name:?}: {q}"));
    }
    body.push_str("}}");
    DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default()).unwrap()
}

const NOUL: &str = r#"{"type": "noul", "instructions": "Is it late?"}"#;
const CHOICE: &str = r#"{"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech", "sales"]}"#;
const SCORE: &str =
    r#"{"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]}"#;
const ONE: &str = r#"{"type": "choice", "instructions": "Which?", "criteria": ["only"]}"#;

fn wide() -> String {
    let ids: Vec<String> = (0..40).map(|i| format!("\"team_{i}\"")).collect();
    format!(
        r#"{{"type": "choice", "instructions": "Which of many teams?", "criteria": [{}]}}"#,
        ids.join(", ")
    )
}

fn alone(request: &DecisionRequest) -> DecisionResponse {
    decide(request, &DecisionConfig::default(), &mut Reference).unwrap()
}

fn same_answer(got: &DecisionResponse, want: &DecisionResponse) {
    assert_eq!(got.answers, want.answers);
    assert_eq!(got.usage, want.usage);
    assert_eq!(got.model, want.model);
}

fn submit(engine: &Engine, request: DecisionRequest) -> mpsc::Receiver<JobResult> {
    submit_with(engine, request, None, CancelToken::default())
}

#[test]
fn requests_share_passes_and_answer_as_alone() {
    let (go, gate) = mpsc::channel();
    let (engine, worker, log, _) = start(EngineOptions::default(), Some(gate), None);
    let wide = wide();
    let mut requests = Vec::new();
    for i in 0..24 {
        // Eight distinct evidences, each asked three times with other questions.
        let state = format!("Ticket {}: the parcel arrived late and crushed.", i % 8);
        let questions: Vec<(&str, &str)> = match i % 4 {
            0 => vec![("late", NOUL), ("team", CHOICE), ("mood", SCORE)],
            1 => vec![("team", CHOICE)],
            2 => vec![("many", wide.as_str()), ("one", ONE)],
            _ => vec![("late", NOUL), ("one", ONE)],
        };
        requests.push(request(&state, &questions));
    }
    let receivers: Vec<_> = requests
        .iter()
        .map(|r| submit(&engine, r.clone()))
        .collect();
    go.send(()).unwrap();
    for (request, rx) in requests.iter().zip(receivers) {
        let output = rx.recv().unwrap().unwrap();
        same_answer(&output.response, &alone(request));
    }
    let stats = engine.stats();
    assert!(
        stats.max_requests_per_pass >= 8,
        "passes held at most {} requests",
        stats.max_requests_per_pass
    );
    assert_eq!(stats.answered, 24);
    // Requests with the same evidence in one pass share its computation: the busiest pass computed
    // fewer groups than it held requests.
    let passes = log.lock().unwrap().clone();
    assert!(passes.iter().any(|p| p.groups < p.branches));
    // The model's device memory as asked after each pass: the last pass's, and the most of any. The
    // engine asks once a pass's answers are out, so the last answer may arrive before that query.
    let last = passes.last().unwrap().tokens as u64 * 10;
    let most = passes.iter().map(|p| p.tokens as u64 * 10).max().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut stats = stats;
    while stats.device_memory.map(|m| m.used_bytes) != Some(last)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
        stats = engine.stats();
    }
    let memory = stats.device_memory.expect("the fake reports device memory");
    assert_eq!(
        (memory.used_bytes, memory.total_bytes, memory.max_used_bytes),
        (last, 1 << 40, most)
    );
    drop(engine);
    worker.join();
}

#[test]
fn a_repeated_evidence_comes_from_the_prefix_cache_with_the_same_answer() {
    let (engine, worker, log, _) = start(EngineOptions::default(), None, None);
    let state = "A long complaint about a crushed parcel that arrived two days late.";
    let first = request(state, &[("late", NOUL), ("team", CHOICE)]);
    let follow_up = request(state, &[("mood", SCORE)]);
    let a = engine.decide(first.clone(), None).unwrap();
    same_answer(&a.response, &alone(&first));
    assert_eq!(a.cached_tokens, 0);
    let computed_before = log.lock().unwrap().iter().map(|p| p.tokens).sum::<usize>();
    let b = engine.decide(follow_up.clone(), None).unwrap();
    same_answer(&b.response, &alone(&follow_up));
    assert!(b.cached_tokens > 0);
    // The follow-up computed only its question's tail.
    let follow_up_tokens =
        log.lock().unwrap().iter().map(|p| p.tokens).sum::<usize>() - computed_before;
    assert_eq!(
        follow_up_tokens as u64 + b.cached_tokens,
        b.response.usage.input_tokens
    );
    let stats = engine.stats().prefix_cache;
    assert_eq!((stats.hits, stats.misses), (1, 1));
    assert_eq!(stats.tokens_saved, b.cached_tokens);
    // The same request again: identical answer from the cache.
    let again = engine.decide(first.clone(), None).unwrap();
    same_answer(&again.response, &a.response);
    drop(engine);
    worker.join();
}

#[test]
fn a_tiny_cache_evicts_and_answers_stay_the_same() {
    let options = EngineOptions {
        prefix_cache: PrefixCacheLimits {
            max_tokens: 400,
            max_bytes: 1 << 20,
        },
        ..EngineOptions::default()
    };
    let (engine, worker, _, _) = start(options, None, None);
    for round in 0..2 {
        for i in 0..6 {
            let r = request(
                &format!("Evidence number {i} with enough text to take a good number of tokens."),
                &[("late", NOUL)],
            );
            let out = engine.decide(r.clone(), None).unwrap();
            same_answer(&out.response, &alone(&r));
            let _ = round;
        }
    }
    let stats = engine.stats().prefix_cache;
    assert!(stats.evictions > 0, "{stats:?}");
    assert!(stats.cached_tokens <= 400);
    drop(engine);
    worker.join();
}

#[test]
fn long_evidence_is_computed_in_chunks_and_others_are_not_held_back() {
    let options = EngineOptions {
        max_batch_tokens: 256,
        ..EngineOptions::default()
    };
    let (go, gate) = mpsc::channel();
    let (engine, worker, log, _) = start(options, Some(gate), None);
    let long_state = "The customer wrote at length. ".repeat(60); // ~1,800 tokens
    let long = request(&long_state, &[("late", NOUL), ("team", CHOICE)]);
    let short = request("Short note.", &[("late", NOUL)]);
    let rx_long = submit(&engine, long.clone());
    let rx_short = submit(&engine, short.clone());
    go.send(()).unwrap();
    let short_out = rx_short.recv().unwrap().unwrap();
    let long_out = rx_long.recv().unwrap().unwrap();
    same_answer(&short_out.response, &alone(&short));
    same_answer(&long_out.response, &alone(&long));
    // The short request finished in fewer passes than the long one needed.
    assert!(short_out.passes < long_out.passes);
    let stats = engine.stats();
    assert!(stats.evidence_chunks >= 5, "{stats:?}");
    assert!(log.lock().unwrap().iter().all(|p| p.tokens <= 256 + 200));
    drop(engine);
    worker.join();
}

#[test]
fn cancelled_and_expired_requests_stop_and_leave_the_others_unchanged() {
    let (go, gate) = mpsc::channel();
    let (engine, worker, _, entered) = start(EngineOptions::default(), Some(gate), None);
    let first = request("The first one holds the pass.", &[("late", NOUL)]);
    let rx_first = submit(&engine, first.clone());
    // The others arrive while the first pass runs.
    while entered.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    // Queued behind the held pass: one cancelled, one already past its deadline, one normal.
    let cancel = CancelToken::default();
    let rx_c = submit_with(
        &engine,
        request("To cancel.", &[("late", NOUL)]),
        None,
        cancel.clone(),
    );
    let rx_d = submit_with(
        &engine,
        request("Too late.", &[("late", NOUL)]),
        Some(Instant::now()),
        CancelToken::default(),
    );
    let normal = request("A normal one.", &[("team", CHOICE)]);
    let rx_normal = submit(&engine, normal.clone());
    cancel.cancel();
    go.send(()).unwrap();
    same_answer(&rx_first.recv().unwrap().unwrap().response, &alone(&first));
    assert!(matches!(rx_c.recv().unwrap(), Err(JobError::Cancelled)));
    assert!(matches!(
        rx_d.recv().unwrap(),
        Err(JobError::DeadlineExceeded)
    ));
    same_answer(
        &rx_normal.recv().unwrap().unwrap().response,
        &alone(&normal),
    );
    let stats = engine.stats();
    assert_eq!((stats.cancelled, stats.deadline_exceeded), (1, 1));
    drop(engine);
    worker.join();
}

#[test]
fn a_failing_pass_is_retried_one_request_at_a_time() {
    let (go, gate) = mpsc::channel();
    let (engine, worker, _, _) = start(EngineOptions::default(), Some(gate), Some("POISON"));
    let good: Vec<DecisionRequest> = (0..3)
        .map(|i| request(&format!("Fine evidence {i}."), &[("late", NOUL)]))
        .collect();
    let bad = request("POISON in the evidence.", &[("late", NOUL)]);
    let mut receivers: Vec<_> = good.iter().map(|r| submit(&engine, r.clone())).collect();
    let rx_bad = submit(&engine, bad);
    receivers.push(submit(&engine, good[0].clone()));
    go.send(()).unwrap();
    let error = rx_bad.recv().unwrap().unwrap_err();
    assert!(error.to_string().contains("poisoned prompt"), "{error}");
    for (rx, r) in receivers.into_iter().zip(good.iter().chain([&good[0]])) {
        same_answer(&rx.recv().unwrap().unwrap().response, &alone(r));
    }
    assert!(engine.stats().passes_split_after_error >= 1);

    // A request the device has no memory for gets a 503 (not a 500), alone; the others are answered.
    let huge = request("OOM! in the evidence.", &[("late", NOUL)]);
    let fine = request("Fine evidence again.", &[("late", NOUL)]);
    let rx_huge = submit(&engine, huge);
    let rx_fine = submit(&engine, fine.clone());
    match rx_huge.recv().unwrap() {
        Err(JobError::Decision(error)) => {
            assert_eq!(error.status(), 503, "{error}");
            assert!(error.to_string().contains("no memory"), "{error}");
        }
        other => panic!("expected a 503, got {other:?}"),
    }
    same_answer(&rx_fine.recv().unwrap().unwrap().response, &alone(&fine));
    drop(engine);
    worker.join();
}

// Like the tests above, this one starts its own gated engine with its own options and ends by dropping
// it and joining the worker: the gate and the options are what each test is about, so they stay inline.
#[test]
fn a_full_queue_is_refused_and_long_prompts_get_a_422() {
    let (go, gate) = mpsc::channel();
    let options = EngineOptions {
        queue_size: 2,
        max_prompt_tokens: 300,
        max_request_tokens: 1000,
        ..EngineOptions::default()
    };
    let (engine, worker, log, _) = start(options, Some(gate), None);
    let r = request("Queue.", &[("late", NOUL)]);
    let first = submit(&engine, r.clone());
    // Wait until the loop holds the first request inside its pass.
    let waited = Instant::now();
    while engine.queue_state().running == 0 && waited.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let counted = Arc::new(AtomicUsize::new(0));
    let mut queued = Vec::new();
    for _ in 0..2 {
        queued.push(submit(&engine, r.clone()));
    }
    let refused = engine.submit(
        engine.prepare(r.clone()).unwrap(),
        Box::new(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        }),
        None,
        CancelToken::default(),
    );
    assert_eq!(refused.unwrap_err(), SubmitError::QueueFull { capacity: 2 });
    let too_long = engine
        .prepare(request(&"word ".repeat(100), &[("late", NOUL)]))
        .err()
        .unwrap();
    assert_eq!(too_long.status(), 422);
    assert!(too_long.to_string().contains("300"), "{too_long}");
    // Bounded work per request: questions, and prompt tokens all questions together.
    let names: Vec<String> = (0..129).map(|i| format!("q{i}")).collect();
    let many: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), NOUL)).collect();
    let refused = engine.prepare(request("s", &many)).err().unwrap();
    assert_eq!(refused.status(), 422);
    assert_eq!(refused.field_errors()[0].path.to_string(), "questions");
    assert!(refused.to_string().contains("at most 128"), "{refused}");
    let heavy: Vec<(&str, &str)> = names[..8].iter().map(|n| (n.as_str(), NOUL)).collect();
    let refused = engine.prepare(request("s", &heavy)).err().unwrap();
    assert_eq!(refused.status(), 422);
    assert!(refused.to_string().contains("limit of 1000"), "{refused}");
    go.send(()).unwrap();
    assert!(first.recv().unwrap().is_ok());
    for rx in queued {
        assert!(rx.recv().unwrap().is_ok());
    }
    assert!(!log.lock().unwrap().is_empty());
    drop(engine);
    worker.join();
}

#[test]
fn passes_hold_at_most_max_prompts_per_pass() {
    let (go, gate) = mpsc::channel();
    let options = EngineOptions {
        max_prompts_per_pass: 4,
        ..EngineOptions::default()
    };
    let (engine, worker, log, _) = start(options, Some(gate), None);
    let mut requests = Vec::new();
    for i in 0..12 {
        let state = format!("Ticket {i}: the parcel arrived late.");
        let questions: Vec<(&str, &str)> = if i % 2 == 0 {
            vec![("late", NOUL), ("team", CHOICE), ("mood", SCORE)]
        } else {
            vec![("late", NOUL)]
        };
        requests.push(request(&state, &questions));
    }
    let receivers: Vec<_> = requests
        .iter()
        .map(|r| submit(&engine, r.clone()))
        .collect();
    go.send(()).unwrap();
    for (request, rx) in requests.iter().zip(receivers) {
        same_answer(&rx.recv().unwrap().unwrap().response, &alone(request));
    }
    let passes = log.lock().unwrap().clone();
    assert!(passes.iter().all(|p| p.branches <= 4), "{passes:?}");
    assert!(passes.iter().any(|p| p.branches == 4), "{passes:?}");
    assert!(engine.stats().max_prompts_per_pass <= 4);
    drop(engine);
    worker.join();
}

#[test]
fn replica_counters_merge_into_the_engines_totals() {
    use prism_decision::engine::DeviceMemory;
    use prism_decision::EngineStats;
    let mut a = EngineStats {
        passes: 3,
        answered: 5,
        max_requests_per_pass: 4,
        prefix_cache_max_tokens: 100,
        device_memory: Some(DeviceMemory {
            used_bytes: 10,
            total_bytes: 100,
            max_used_bytes: 20,
        }),
        ..EngineStats::default()
    };
    a.requests_per_pass.insert(1, 2);
    a.prefix_cache.hits = 7;
    let mut b = EngineStats {
        passes: 4,
        answered: 6,
        max_requests_per_pass: 9,
        prefix_cache_max_tokens: 100,
        ..EngineStats::default()
    };
    b.requests_per_pass.insert(1, 1);
    b.requests_per_pass.insert(3, 1);
    b.prefix_cache.hits = 1;
    a.merge(&b);
    assert_eq!((a.passes, a.answered, a.max_requests_per_pass), (7, 11, 9));
    assert_eq!(a.requests_per_pass.get(&1), Some(&3));
    assert_eq!(a.requests_per_pass.get(&3), Some(&1));
    assert_eq!(a.prefix_cache.hits, 8);
    assert_eq!(a.prefix_cache_max_tokens, 200);
    // A replica without device memory (the CPU) leaves the other's.
    assert_eq!(a.device_memory.map(|m| m.used_bytes), Some(10));
}

fn autothink() -> DecisionConfig {
    DecisionConfig {
        family: Family::AutoThink,
        ..DecisionConfig::default()
    }
}

/// A request with thoughts: `extra` (fields) is added to the body's top level.
fn thinking_request(state: &str, questions: &[(&str, &str)], extra: &str) -> DecisionRequest {
    request_with(state, questions, &format!("{extra}, "))
}

fn thought_requests() -> Vec<DecisionRequest> {
    let extras = [
        r#""think_mode": "always", "think_budget": 40, "return_thought": true"#,
        r#""think_mode": "always", "think_budget": 25, "seed": 7, "return_thought": true"#,
        r#""think_mode": "auto", "gate": 0.9, "think_budget": 30, "mix": 0.5"#,
        r#""think_mode": "never""#,
    ];
    (0..16)
        .map(|i| {
            let state = format!("Ticket {}: the parcel arrived late and crushed.", i % 5);
            let questions: Vec<(&str, &str)> = match i % 3 {
                0 => vec![("late", NOUL), ("team", CHOICE), ("mood", SCORE)],
                1 => vec![("team", CHOICE), ("one", ONE)],
                _ => vec![("mood", SCORE)],
            };
            thinking_request(&state, &questions, extras[i % extras.len()])
        })
        .collect()
}

fn alone_with(request: &DecisionRequest, config: &DecisionConfig) -> DecisionResponse {
    decide(request, config, &mut Reference).unwrap()
}

/// The thinking requests of [`thought_requests`], submitted at once behind a held first pass: each
/// answers as `decide` does alone. Returns the most thought steps any pass held, the thoughts the
/// answers hold and the engine's stats.
fn thoughts_at_once(options: EngineOptions) -> (usize, usize, prism_decision::EngineStats) {
    let (go, gate) = mpsc::channel();
    let (engine, worker, log, _) = start_with(options, autothink(), Some(gate), None);
    let requests = thought_requests();
    let receivers: Vec<_> = requests
        .iter()
        .map(|r| submit(&engine, r.clone()))
        .collect();
    go.send(()).unwrap();
    let mut thoughts = 0;
    for (request, rx) in requests.iter().zip(receivers) {
        let output = rx.recv().unwrap().unwrap();
        let want = alone_with(request, &autothink());
        same_answer(&output.response, &want);
        // The thoughts' tokens count as output.
        let with_thought = want
            .answers
            .iter()
            .filter(|(_, a)| match a {
                Answer::Choice(c) => c.thought.is_some(),
                Answer::Noul(n) => n.thought.is_some(),
                Answer::Score(s) => s.thought.is_some(),
            })
            .count();
        if request.return_thought {
            assert!(with_thought > 0, "think_mode always gives thoughts");
            assert!(want.usage.output_tokens > 0);
        }
        thoughts += with_thought;
    }
    let stats = engine.stats();
    let most = log
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.thought_steps)
        .max()
        .unwrap_or(0);
    drop(engine);
    worker.join();
    (most, thoughts, stats)
}

#[test]
fn thoughts_decode_in_shared_passes_and_answer_as_alone() {
    let (most, thoughts, stats) = thoughts_at_once(EngineOptions::default());
    assert!(thoughts >= 8, "{thoughts} thoughts");
    assert!(stats.thoughts_finished >= thoughts as u64);
    assert_eq!(stats.thoughts_started, stats.thoughts_finished);
    // Thoughts of different requests decoded in the same passes.
    assert!(most >= 4, "at most {most} thought steps in a pass");
}

#[test]
fn think_seqs_bounds_the_thoughts_decoded_at_once() {
    let (most, _, _) = thoughts_at_once(EngineOptions {
        think_seqs: 2,
        ..EngineOptions::default()
    });
    assert_eq!(most, 2, "thought steps in a pass");
}

#[test]
fn a_thought_reports_its_stop_and_a_v1_model_refuses_always() {
    let (engine, worker, _, _) = start_with(EngineOptions::default(), autothink(), None, None);
    let mut reasons = std::collections::BTreeSet::new();
    for i in 0..12 {
        let request = thinking_request(
            &format!("Case {i}: a refund was asked twice."),
            &[("team", CHOICE)],
            r#""think_mode": "always", "think_budget": 12, "return_details": true, "return_thought": true"#,
        );
        let response = engine.decide(request, None).unwrap().response;
        let Some(Answer::Choice(team)) = response.answers.get("team") else {
            panic!("no choice answer");
        };
        let details = team.details.as_ref().expect("details");
        let tokens = details.thought_tokens.expect("thought tokens");
        assert!((1..=12).contains(&tokens), "{tokens} thought tokens");
        assert_eq!(response.usage.output_tokens, tokens);
        assert!(details.after_thought.is_some());
        // p = mix · p_after + (1 − mix) · p_first with the default mix 0.75.
        for (id, p) in team.probabilities.iter() {
            let first = details.first.get(id).unwrap();
            let after = details.after_thought.as_ref().unwrap().get(id).unwrap();
            assert!((p - (0.75 * after + 0.25 * first)).abs() < 1e-12);
        }
        reasons.insert(format!("{:?}", details.stop_reason.expect("stop reason")));
    }
    // The fake's `</think>` grows likelier with length: some thoughts end by themselves, others at
    // the budget.
    assert!(reasons.contains("EndOfThought"), "{reasons:?}");
    assert!(reasons.contains("Budget"), "{reasons:?}");
    drop(engine);
    worker.join();

    let (engine, worker, _, _) = start(EngineOptions::default(), None, None);
    let request = thinking_request("x", &[("late", NOUL)], r#""think_mode": "always""#);
    let error = engine.prepare(request).err().expect("refused");
    assert!(error.to_string().contains("does not think"), "{error}");
    drop(engine);
    worker.join();
}

/// A pass that fails runs its requests alone once; a thinking request then goes back to sharing passes
/// (its thought is not decoded alone to the end).
#[test]
fn thoughts_share_passes_again_after_a_failed_pass() {
    let (go, gate) = mpsc::channel();
    let (engine, worker, log, _) = start_with(
        EngineOptions::default(),
        autothink(),
        Some(gate),
        Some("POISON"),
    );
    let thinking: Vec<DecisionRequest> = (0..6)
        .map(|i| {
            thinking_request(
                &format!("Fine evidence {i}."),
                &[("late", NOUL)],
                r#""think_mode": "always", "think_budget": 30"#,
            )
        })
        .collect();
    let receivers: Vec<_> = thinking
        .iter()
        .map(|r| submit(&engine, r.clone()))
        .collect();
    let rx_bad = submit(
        &engine,
        request("POISON in the evidence.", &[("late", NOUL)]),
    );
    go.send(()).unwrap();
    assert!(rx_bad.recv().unwrap().is_err());
    for (rx, r) in receivers.into_iter().zip(&thinking) {
        same_answer(
            &rx.recv().unwrap().unwrap().response,
            &alone_with(r, &autothink()),
        );
    }
    assert!(engine.stats().passes_split_after_error >= 1);
    let most = log
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.thought_steps)
        .max()
        .unwrap_or(0);
    assert!(
        most >= 3,
        "at most {most} thought steps in a pass after the failure"
    );
    drop(engine);
    worker.join();
}

/// The loop detector stops thoughts on the engine: the fake's thoughts drift into a loop of period 3,
/// which a detector of short periods (three rounds over 9 tokens) stops; the answers are still
/// `decide`'s.
#[test]
fn the_loop_detector_stops_thoughts_on_the_engine() {
    let mut config = autothink();
    config.loop_detector = prism_decision::config::LoopDetectorConfig {
        max_period: 4,
        min_repeats: 3,
        min_span: 9,
    };
    let (engine, worker, _, _) = start_with(EngineOptions::default(), config.clone(), None, None);
    let mut loops = 0;
    for i in 0..12 {
        let request = thinking_request(
            &format!("Case {i}: the parcel never came."),
            &[("late", NOUL)],
            r#""think_mode": "always", "think_budget": 200, "return_details": true"#,
        );
        let response = engine.decide(request.clone(), None).unwrap().response;
        let Some(Answer::Noul(late)) = response.answers.get("late") else {
            panic!("no noul answer");
        };
        let details = late.details.as_ref().expect("details");
        if details.stop_reason == Some(prism_decision::thought::StopReason::Loop) {
            loops += 1;
            assert!(details.thought_tokens.unwrap() >= 2);
        }
        let want = alone_with(&request, &config);
        let Some(Answer::Noul(want)) = want.answers.get("late") else {
            panic!("no noul answer");
        };
        assert_eq!(late.noul, want.noul);
    }
    assert!(loops >= 3, "{loops} of 12 thoughts stopped as loops");
    drop(engine);
    worker.join();
}

/// A prompt encoder that cannot think (the default `PromptEncoder` methods).
struct NoThinking;

impl PromptEncoder for NoThinking {
    fn encode(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        ByteEncoder.encode(prompt)
    }
}

/// An AutoThink release whose chat template cannot think is refused when the engine starts, not at
/// the first unsure question; a v1 one starts.
#[test]
fn a_thinking_family_without_a_thinking_template_is_refused_at_start() {
    let fake = || Fake {
        log: Arc::default(),
        hold_first: None,
        entered: Arc::default(),
        poison: None,
    };
    let error = Engine::start(
        fake(),
        Arc::new(NoThinking),
        autothink(),
        EngineOptions::default(),
        None,
    )
    .err()
    .expect("refused");
    assert!(error.to_string().contains("no thinking mode"), "{error}");
    let (engine, worker) = Engine::start(
        fake(),
        Arc::new(NoThinking),
        DecisionConfig::default(),
        EngineOptions::default(),
        None,
    )
    .expect("a v1 engine starts");
    drop(engine);
    worker.join();
}
