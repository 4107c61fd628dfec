//! The model side of the server: a bounded queue feeding one worker thread that owns the model.
//!
//! The HTTP layer never runs model math: it validates a request, `submit`s it (a full queue is refused at
//! once, so the server sheds load instead of piling it up) and awaits a oneshot reply. The worker takes
//! one request at a time and runs `prism_decision::decide`, whose single model call per step already
//! batches all of the request's prompts with their shared evidence prefix. The CPU decoder is
//! batch-invariant, so batching several requests into one call would change no answer; it is left for the
//! GPU path, where it pays.
//!
//! A request whose client has gone (its handler timed out) is skipped when its turn comes. A panic inside
//! the model is caught and answered as a 500 for that request; the worker keeps serving.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use prism_decision::{
    decide, DecisionConfig, DecisionError, DecisionRequest, DecisionResponse, LetterLogits,
    LetterModel, LetterPrompt, ModelError,
};
use tokio::sync::oneshot;

use crate::stats::{QueueState, Stats};

/// A finished request.
#[derive(Debug)]
pub struct JobOutput {
    pub response: DecisionResponse,
    /// Time spent waiting in the queue.
    pub queue_ms: f64,
    /// Time the worker spent on it.
    pub compute_ms: f64,
}

pub type JobResult = Result<JobOutput, DecisionError>;

struct Job {
    request: DecisionRequest,
    reply: oneshot::Sender<JobResult>,
    enqueued: Instant,
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: {capacity} requests are already waiting")]
    QueueFull { capacity: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// The queue in front of the model worker.
pub struct Scheduler {
    sender: SyncSender<Job>,
    capacity: usize,
    /// Requests accepted and not yet picked up by the worker.
    waiting: Arc<AtomicUsize>,
    /// Requests the worker is computing (0 or 1).
    running: Arc<AtomicUsize>,
}

/// The worker thread; join it after the last [`Scheduler`] handle is dropped.
pub struct Worker(JoinHandle<()>);

impl Worker {
    /// Waits for the worker to finish what it holds. It ends once every [`Scheduler`] is dropped.
    pub fn join(self) {
        if self.0.join().is_err() {
            tracing::error!("the model worker panicked outside a request");
        }
    }
}

impl Scheduler {
    /// Starts the worker thread that owns `model`. `capacity` (at least 1) requests may wait.
    pub fn start(
        model: Box<dyn LetterModel + Send>,
        config: DecisionConfig,
        capacity: usize,
        stats: Arc<Stats>,
    ) -> std::io::Result<(Scheduler, Worker)> {
        let capacity = capacity.max(1);
        let (sender, receiver) = sync_channel(capacity);
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let (w, r) = (waiting.clone(), running.clone());
        let handle = std::thread::Builder::new()
            .name("prism-model".into())
            .spawn(move || run_worker(model, config, receiver, w, r, stats))?;
        Ok((
            Scheduler {
                sender,
                capacity,
                waiting,
                running,
            },
            Worker(handle),
        ))
    }

    /// Queues a request; the receiver gets its answer.
    pub fn submit(
        &self,
        request: DecisionRequest,
    ) -> Result<oneshot::Receiver<JobResult>, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.sender.try_send(Job {
            request,
            reply,
            enqueued: Instant::now(),
        }) {
            Ok(()) => Ok(answer),
            Err(error) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(match error {
                    TrySendError::Full(_) => SubmitError::QueueFull {
                        capacity: self.capacity,
                    },
                    TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                })
            }
        }
    }

    pub fn queue_state(&self) -> QueueState {
        QueueState {
            depth: self.waiting.load(Ordering::SeqCst),
            capacity: self.capacity,
            running: self.running.load(Ordering::SeqCst),
        }
    }
}

/// Records the size of each model call of a request.
struct CountingModel<'a> {
    inner: &'a mut dyn LetterModel,
    calls: Vec<usize>,
}

impl LetterModel for CountingModel<'_> {
    fn model_name(&self) -> &str {
        self.inner.model_name()
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        self.calls.push(prompts.len());
        self.inner.letter_logits(prompts)
    }
}

fn run_worker(
    mut model: Box<dyn LetterModel + Send>,
    config: DecisionConfig,
    receiver: Receiver<Job>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    stats: Arc<Stats>,
) {
    while let Ok(job) = receiver.recv() {
        waiting.fetch_sub(1, Ordering::SeqCst);
        if job.reply.is_closed() {
            stats.record_abandoned();
            continue;
        }
        running.store(1, Ordering::SeqCst);
        let started = Instant::now();
        let queue_ms = started.duration_since(job.enqueued).as_secs_f64() * 1e3;
        let mut counting = CountingModel {
            inner: &mut *model,
            calls: Vec::new(),
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            decide(&job.request, &config, &mut counting)
        }))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!("the model panicked on a request: {what}");
            Err(DecisionError::Model(ModelError::Backend(format!(
                "internal error in the engine: {what}"
            ))))
        });
        let compute_ms = started.elapsed().as_secs_f64() * 1e3;
        stats.record_run(queue_ms, compute_ms, &counting.calls);
        running.store(0, Ordering::SeqCst);
        // The client may have gone meanwhile; then nobody reads the answer.
        let _ = job.reply.send(result.map(|response| JobOutput {
            response,
            queue_ms,
            compute_ms,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_decision::RequestDefaults;

    /// Logits that depend only on the prompt text, so answers are reproducible.
    struct TextModel;

    impl LetterModel for TextModel {
        fn model_name(&self) -> &str {
            "text-model"
        }

        fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
            if prompts.iter().any(|p| p.user.contains("PANIC")) {
                panic!("asked to panic");
            }
            let logits = prompts
                .iter()
                .map(|p| {
                    (0..p.option_ids.len())
                        .map(|i| ((p.user.len() * 7 + i * 13) % 17) as f64 / 4.0)
                        .collect()
                })
                .collect();
            Ok(LetterLogits {
                logits,
                input_tokens: prompts.len() as u64 * 10,
                output_tokens: 0,
            })
        }
    }

    fn request(state: &str) -> DecisionRequest {
        let body = format!(
            r#"{{"state": "{state}", "questions": {{"a": {{"type": "choice", "instructions": "Which?", "criteria": ["x", "y", "z"]}}, "b": {{"type": "noul", "instructions": "Is it?"}}}}}}"#
        );
        DecisionRequest::parse(body.as_bytes(), &RequestDefaults::default()).unwrap()
    }

    #[tokio::test]
    async fn answers_like_decide_and_survives_a_panic() {
        let stats = Arc::new(Stats::default());
        let (scheduler, worker) = Scheduler::start(
            Box::new(TextModel),
            DecisionConfig::default(),
            4,
            stats.clone(),
        )
        .unwrap();
        let expected = decide(
            &request("hello"),
            &DecisionConfig::default(),
            &mut TextModel,
        )
        .unwrap();
        let answer = scheduler
            .submit(request("hello"))
            .unwrap()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.response.answers, expected.answers);
        assert_eq!(answer.response.usage, expected.usage);
        // Both questions' prompts went to the model in one call.
        assert_eq!(
            stats.snapshot("m", scheduler.queue_state())["batches"]["prompts_per_call"]["2"],
            1
        );

        let error = scheduler
            .submit(request("PANIC"))
            .unwrap()
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(error.status(), 500);
        assert!(error.to_string().contains("asked to panic"), "{error}");
        // Still serving.
        let again = scheduler
            .submit(request("hello"))
            .unwrap()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.response.answers, expected.answers);
        drop(scheduler);
        worker.join();
    }

    /// A model that blocks until told to go on, to fill the queue deterministically.
    struct GatedModel(std::sync::mpsc::Receiver<()>);

    impl LetterModel for GatedModel {
        fn model_name(&self) -> &str {
            "gated"
        }

        fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
            let _ = self.0.recv();
            Ok(LetterLogits {
                logits: prompts
                    .iter()
                    .map(|p| vec![0.0; p.option_ids.len()])
                    .collect(),
                ..Default::default()
            })
        }
    }

    #[tokio::test]
    async fn a_full_queue_is_refused_and_abandoned_requests_are_skipped() {
        let (go, gate) = std::sync::mpsc::channel();
        let stats = Arc::new(Stats::default());
        let (scheduler, worker) = Scheduler::start(
            Box::new(GatedModel(gate)),
            DecisionConfig::default(),
            2,
            stats.clone(),
        )
        .unwrap();
        let first = scheduler.submit(request("one")).unwrap();
        // Wait until the worker holds the first request (it blocks inside the model).
        while scheduler.queue_state().running == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let second = scheduler.submit(request("two")).unwrap();
        let third = scheduler.submit(request("three")).unwrap();
        assert_eq!(
            scheduler.submit(request("four")).unwrap_err(),
            SubmitError::QueueFull { capacity: 2 }
        );
        assert_eq!(scheduler.queue_state().depth, 2);
        drop(second); // its client went away: the worker skips it
        for _ in 0..3 {
            let _ = go.send(());
        }
        assert!(first.await.unwrap().is_ok());
        assert!(third.await.unwrap().is_ok());
        let snapshot = stats.snapshot("m", scheduler.queue_state());
        assert_eq!(snapshot["requests"]["abandoned_before_run"], 1);
        assert_eq!(snapshot["queue"]["depth"], 0);
        drop(scheduler);
        worker.join();
    }
}
