//! The step loop: admission, pass packing, the prefix cache, and handing read-outs back to the tasks.
//!
//! Each step:
//! 1. takes every submitted request (blocking only when nothing is in flight);
//! 2. drops the requests that were cancelled or whose deadline passed (their work stops here);
//! 3. packs a pass, oldest request first, up to `max_batch_tokens` computed tokens: a request's ready
//!    prompts branch from its evidence, which comes from the request's own saved state, from the prefix
//!    cache, from another request of the same pass with the same evidence, or is computed in the pass —
//!    in chunks when it does not fit, so a long evidence never holds the others back for long. The
//!    oldest request always gets in, so nobody starves;
//! 4. runs the pass, keeps the evidence states (prefix cache, and each request's own until it is
//!    answered), feeds the read-outs back and answers the requests that are done.
//!
//! A pass that fails with several requests in it is retried one request at a time, so one bad request
//! cannot fail the others; a model panic is caught and answered as that pass's error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use super::pass::{Branch, GroupInput, PassModel, PromptEncoder};
use super::prefix_cache::PrefixCache;
use super::thinking::{Phase, ThoughtRun};
use super::{
    encode_all, EngineObserver, EngineOptions, Job, JobError, JobOutput, PassRecord, Shared,
};
use crate::decide::DecisionTask;
use crate::error::{DecisionError, ModelError};
use crate::model::{LetterLogits, LetterPrompt};

/// Evidence chunks are cut at multiples of this many tokens (the delta rule's chunk length), except
/// the last.
const CHUNK_ALIGN: usize = 64;

/// A request in flight.
struct Active<S> {
    task: DecisionTask,
    reply: Option<super::Reply>,
    deadline: Option<Instant>,
    cancel: super::CancelToken,
    enqueued: Instant,
    first_pass: Option<Instant>,
    passes: usize,
    cached_tokens: u64,
    /// The prompts waiting to be read, their tokens, and the evidence key they all start with.
    prompts: Vec<LetterPrompt>,
    tokens: Vec<Vec<u32>>,
    key: Arc<[u32]>,
    /// The evidence as the prefix cache knows it (the key, plus the images' digest when it has
    /// images).
    cache_key: Arc<[u32]>,
    /// The request's images (`None` for text): the passes that compute its evidence read them.
    images: Option<Arc<super::RequestImages>>,
    /// The state after the first `held.1` tokens of the key (a chunk, or the whole evidence).
    held: Option<(S, usize)>,
    /// Whether the prefix cache was asked for the key already.
    looked_up: bool,
    /// Runs alone in its next pass (a pass it was in failed); cleared once a pass of it succeeds, so a
    /// long-lived request (a thought) goes back to sharing passes.
    solo: bool,
    /// Its questions' thoughts in progress (v1.1 AutoThink).
    thoughts: Vec<ThoughtRun<S>>,
}

impl<S> Active<S> {
    fn start(&self) -> usize {
        self.held.as_ref().map_or(0, |(_, n)| *n)
    }

    fn branch_tokens(&self) -> usize {
        self.tokens.iter().map(|t| t.len() - self.key.len()).sum()
    }
}

/// One evidence group being packed.
struct Planned {
    /// Members: (active index, whether its prompts branch in this pass).
    members: Vec<(usize, bool)>,
    /// Tokens of the key computed in this pass: key[from..to].
    from: usize,
    to: usize,
}

pub(crate) struct StepLoop<M: PassModel> {
    model: M,
    encoder: Arc<dyn PromptEncoder>,
    options: EngineOptions,
    shared: Arc<Shared>,
    observer: Option<Arc<dyn EngineObserver>>,
    /// This loop's replica index (`PassRecord::replica`).
    replica: usize,
    cache: PrefixCache<M::State>,
    active: Vec<Active<M::State>>,
}

impl<M: PassModel> StepLoop<M> {
    // The parameters repeat the fields they fill (a constructor); only the cache and the active list
    // are made here.
    pub(crate) fn new(
        model: M,
        encoder: Arc<dyn PromptEncoder>,
        options: EngineOptions,
        shared: Arc<Shared>,
        observer: Option<Arc<dyn EngineObserver>>,
        replica: usize,
    ) -> Self {
        StepLoop {
            replica,
            model,
            encoder,
            cache: PrefixCache::new(options.prefix_cache),
            options,
            shared,
            observer,
            active: Vec::new(),
        }
    }

    pub(crate) fn run(mut self, receiver: Receiver<Job>) {
        let mut open = true;
        loop {
            // 1. Admission.
            if self.active.is_empty() {
                if !open {
                    return;
                }
                match receiver.recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => return,
                }
            }
            while open {
                match receiver.try_recv() {
                    Ok(job) => self.admit(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            // 2. Drop what nobody waits for any more.
            self.expire();
            // Requests that need no model at all (every question self-answered).
            self.finish_done();
            if self.active.is_empty() {
                continue;
            }
            // 3-4.
            self.step();
        }
    }

    fn admit(&mut self, job: Job) {
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        self.shared.running.fetch_add(1, Ordering::SeqCst);
        let prepared = job.prepared;
        self.active.push(Active {
            task: prepared.task,
            reply: Some(job.reply),
            deadline: job.deadline,
            cancel: job.cancel,
            enqueued: job.enqueued,
            first_pass: None,
            passes: 0,
            cached_tokens: 0,
            prompts: prepared.prompts,
            tokens: prepared.tokens,
            key: prepared.key,
            cache_key: prepared.cache_key,
            images: prepared.images,
            held: None,
            looked_up: false,
            solo: false,
            thoughts: Vec::new(),
        });
    }

    /// Answers request `i` (its response, or `error`) and removes it.
    fn answer(&mut self, i: usize, error: Option<JobError>) {
        let mut active = self.active.remove(i);
        self.shared.running.fetch_sub(1, Ordering::SeqCst);
        let result = match error {
            Some(error) => Err(error),
            None => {
                let now = Instant::now();
                let first = active.first_pass.unwrap_or(now);
                Ok(JobOutput {
                    response: active.task.finish(self.model.model_name()),
                    queue_ms: first.duration_since(active.enqueued).as_secs_f64() * 1e3,
                    compute_ms: now.duration_since(first).as_secs_f64() * 1e3,
                    passes: active.passes,
                    cached_tokens: active.cached_tokens,
                })
            }
        };
        self.shared.stats(|s| match &result {
            Ok(_) => s.answered += 1,
            Err(JobError::Cancelled) => s.cancelled += 1,
            Err(JobError::DeadlineExceeded) => s.deadline_exceeded += 1,
            Err(JobError::Decision(_)) => s.failed += 1,
        });
        if let Some(reply) = active.reply.take() {
            reply(result);
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.active.len() {
            let a = &self.active[i];
            if a.cancel.is_cancelled() {
                self.answer(i, Some(JobError::Cancelled));
            } else if a.deadline.is_some_and(|d| now >= d) {
                self.answer(i, Some(JobError::DeadlineExceeded));
            } else {
                i += 1;
            }
        }
    }

    fn finish_done(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].prompts.is_empty() && self.active[i].task.is_done() {
                self.answer(i, None);
            } else {
                i += 1;
            }
        }
    }

    /// Packs the pass: thoughts' steps first (a decode step is one token, and a thought holds its
    /// seat until it is done), then evidence and read-outs, oldest request first, within the token
    /// budget.
    fn plan(&mut self) -> (Vec<Planned>, Vec<(usize, usize)>, PassRecord) {
        let mut budget = self.options.max_batch_tokens;
        // States still allowed in this pass: one per prompt read out, one per evidence computed (a
        // request's prompts go in together or not at all), one per thought step.
        let mut prompt_room = self.options.max_prompts_per_pass;
        let mut groups: Vec<Planned> = Vec::new();
        let mut thoughts: Vec<(usize, usize)> = Vec::new();
        let mut seats = self
            .active
            .iter()
            .flat_map(|a| &a.thoughts)
            .filter(|t| t.holds_state())
            .count();
        let mut thought_tokens = 0;
        let any_solo = self.active.first().is_some_and(|a| a.solo);
        for i in 0..self.active.len() {
            if any_solo && i > 0 {
                break;
            }
            let a = &self.active[i];
            let evidence = a.held.as_ref().map_or(0, |(_, n)| *n).min(a.key.len());
            for (t, run) in a.thoughts.iter().enumerate() {
                let from = if run.prompt().starts_with(&a.key[..evidence]) {
                    evidence
                } else {
                    0
                };
                let tokens = run.next_tokens(from);
                let fits = (tokens <= budget || (thoughts.is_empty() && groups.is_empty()))
                    && prompt_room > 0;
                let go = match run.phase {
                    Phase::Done => false,
                    Phase::Decode | Phase::Close => fits,
                    // A thought of a request with images starts from its whole evidence (which holds
                    // the images' embeddings), never from scratch.
                    Phase::Prefill => {
                        fits && seats < self.options.think_seqs
                            && (a.images.is_none() || evidence == a.key.len())
                    }
                };
                if go {
                    if run.phase == Phase::Prefill {
                        seats += 1;
                    }
                    thoughts.push((i, t));
                    budget = budget.saturating_sub(tokens);
                    prompt_room -= 1;
                    thought_tokens += tokens;
                }
            }
        }
        let mut record = PassRecord {
            replica: self.replica,
            requests: 0,
            prompts: 0,
            groups: 0,
            tokens: thought_tokens,
            cache_hits: 0,
            cache_misses: 0,
            thought_steps: thoughts.len(),
        };
        let any_solo_first = self.active.first().is_some_and(|a| a.solo);
        let others_waiting = self.active.iter().filter(|a| !a.prompts.is_empty()).count() > 1;
        for i in 0..self.active.len() {
            let empty = groups.is_empty() && thoughts.is_empty();
            if !empty && (any_solo_first || self.active[i].solo) {
                break;
            }
            if self.active[i].prompts.is_empty() {
                continue;
            }
            // The evidence from the cache: looked up once per request (a hit or a miss), and again
            // when another request has put it there since.
            if self.active[i].held.is_none()
                && (!self.active[i].looked_up || self.cache.contains(&self.active[i].cache_key))
            {
                self.active[i].looked_up = true;
                let key = self.active[i].key.clone();
                let cache_key = self.active[i].cache_key.clone();
                if !key.is_empty() {
                    match self.cache.lookup(&cache_key) {
                        Some(state) => {
                            record.cache_hits += 1;
                            self.active[i].cached_tokens += key.len() as u64;
                            self.active[i].held = Some((state, key.len()));
                        }
                        None => record.cache_misses += 1,
                    }
                }
            }
            let a = &self.active[i];
            let branch = a.branch_tokens();
            let key_len = a.key.len();
            // Too many prompts for what is left of this pass: its evidence may still make progress
            // below, but its questions wait (the oldest request's always go in).
            let prompts_fit = empty || a.prompts.len() <= prompt_room;
            let start = a.start();
            let rest = key_len - start;
            // Another request of this pass computes the same evidence from the same point: branch
            // from it.
            if rest > 0 {
                let same = groups.iter().position(|g| {
                    g.from == start
                        && g.to == key_len
                        && g.members.iter().all(|&(_, reads)| reads)
                        && self.active[g.members[0].0].cache_key == a.cache_key
                });
                if let Some(g) = same {
                    if branch <= budget && prompts_fit {
                        groups[g].members.push((i, true));
                        budget -= branch;
                        prompt_room = prompt_room.saturating_sub(a.prompts.len());
                    }
                    continue;
                }
            }
            // A group computing evidence makes one more state (its root's): it counts as a prompt.
            let states = a.prompts.len() + usize::from(rest > 0);
            let prompts_fit = empty || states <= prompt_room;
            if prompts_fit && (rest + branch <= budget || (empty && rest == 0)) {
                prompt_room = prompt_room.saturating_sub(states);
                groups.push(Planned {
                    members: vec![(i, true)],
                    from: start,
                    to: key_len,
                });
                budget = budget.saturating_sub(rest + branch);
                continue;
            }
            if rest == 0 {
                continue;
            }
            // The evidence does not fit with its questions: compute a chunk of it (the whole rest when
            // that fits, so the questions follow in a small pass). While others wait, a chunk takes at
            // most half a pass, so a long evidence never holds them back.
            let room = if others_waiting {
                budget.min((self.options.max_batch_tokens / 2).max(CHUNK_ALIGN))
            } else {
                budget
            };
            let chunk = if rest <= room {
                rest
            } else {
                match (room / CHUNK_ALIGN) * CHUNK_ALIGN {
                    0 if empty => room,
                    aligned => aligned,
                }
            };
            if chunk == 0 || (!empty && (chunk < CHUNK_ALIGN.min(rest) || prompt_room == 0)) {
                continue;
            }
            prompt_room = prompt_room.saturating_sub(1);
            groups.push(Planned {
                members: vec![(i, false)],
                from: start,
                to: start + chunk,
            });
            budget = budget.saturating_sub(chunk);
        }
        let mut in_pass: Vec<usize> = groups
            .iter()
            .flat_map(|g| g.members.iter().map(|&(i, _)| i))
            .chain(thoughts.iter().map(|&(i, _)| i))
            .collect();
        in_pass.sort_unstable();
        in_pass.dedup();
        let requests = in_pass.len();
        for g in &groups {
            record.tokens += g.to - g.from;
            for &(i, reads) in &g.members {
                if reads {
                    record.prompts += self.active[i].prompts.len();
                    record.tokens += self.active[i].branch_tokens();
                }
            }
        }
        record.requests = requests;
        record.groups = groups.len();
        (groups, thoughts, record)
    }

    fn step(&mut self) {
        let (groups, thoughts, record) = self.plan();
        if groups.is_empty() && thoughts.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut members: Vec<usize> = groups
            .iter()
            .flat_map(|g| g.members.iter().map(|&(i, _)| i))
            .chain(thoughts.iter().map(|&(i, _)| i))
            .collect();
        members.sort_unstable();
        members.dedup();
        for &i in &members {
            let a = &mut self.active[i];
            a.first_pass.get_or_insert(started);
            a.task.mark_first_pass(started);
            a.passes += 1;
        }
        for &(i, t) in &thoughts {
            self.active[i].thoughts[t].mark_started(started);
        }
        let result = {
            let inputs: Vec<GroupInput<'_, M::State>> = groups
                .iter()
                .map(|g| {
                    let lead = &self.active[g.members[0].0];
                    let start = lead
                        .held
                        .as_ref()
                        .filter(|(_, n)| *n == g.from)
                        .map(|(s, _)| s);
                    let mut branches = Vec::new();
                    for &(i, reads) in &g.members {
                        if !reads {
                            continue;
                        }
                        let a = &self.active[i];
                        for (prompt, tokens) in a.prompts.iter().zip(&a.tokens) {
                            branches.push(Branch {
                                tokens: &tokens[a.key.len()..],
                                letters: prompt.option_ids.len(),
                            });
                        }
                    }
                    GroupInput {
                        start,
                        prefix: &lead.key[g.from..g.to],
                        branches,
                        want_state: g.to > g.from,
                        want_logits: None,
                        images: lead
                            .images
                            .as_deref()
                            .filter(|_| g.to > g.from)
                            .map(|images| super::PrefixImages {
                                images,
                                offset: g.from,
                            }),
                    }
                })
                .chain(thoughts.iter().map(|&(i, t)| {
                    let a = &self.active[i];
                    let evidence = a
                        .held
                        .as_ref()
                        .filter(|(_, n)| {
                            *n <= a.key.len() && a.thoughts[t].prompt().starts_with(&a.key[..*n])
                        })
                        .map(|(s, n)| (s, *n));
                    a.thoughts[t].input(evidence)
                }))
                .collect();
            let model = &mut self.model;
            catch_unwind(AssertUnwindSafe(|| model.run_pass(&inputs))).unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!("the model panicked in a pass: {what}");
                Err(ModelError::Backend(format!(
                    "internal error in the engine: {what}"
                )))
            })
        };
        let seconds = started.elapsed().as_secs_f64();
        let mut outputs = match result {
            Ok(outputs) if outputs.len() == groups.len() + thoughts.len() => outputs,
            Ok(outputs) => {
                let error = ModelError::Backend(format!(
                    "the model returned {} groups for a pass of {}",
                    outputs.len(),
                    groups.len() + thoughts.len()
                ));
                self.fail_pass(&members, record.requests, error);
                return;
            }
            Err(error) => {
                self.fail_pass(&members, record.requests, error);
                return;
            }
        };
        let thought_outputs = outputs.split_off(groups.len());
        for &i in &members {
            self.active[i].solo = false;
        }
        let vision = self.model.vision_totals();
        self.shared.stats(|s| {
            if let Some((images, seconds)) = vision {
                s.vision_images = images;
                s.vision_seconds = seconds;
            }
            s.passes += 1;
            s.prompts += record.prompts as u64;
            s.tokens_computed += record.tokens as u64;
            *s.requests_per_pass.entry(record.requests).or_default() += 1;
            *s.prompts_per_pass.entry(record.prompts).or_default() += 1;
            s.max_requests_per_pass = s.max_requests_per_pass.max(record.requests);
            s.max_prompts_per_pass = s.max_prompts_per_pass.max(record.prompts);
            s.max_tokens_per_pass = s.max_tokens_per_pass.max(record.tokens);
            s.evidence_chunks += groups
                .iter()
                .filter(|g| g.members.iter().all(|&(_, reads)| !reads))
                .count() as u64;
            s.thought_steps += record.thought_steps as u64;
        });
        if let Some(observer) = &self.observer {
            observer.pass(&record, seconds);
        }

        // Apply: states, then read-outs. Indices stay valid until requests are removed at the end.
        let mut finished: Vec<(usize, Result<(), DecisionError>)> = Vec::new();
        for (g, out) in groups.iter().zip(outputs) {
            if let Some(state) = out.state {
                let lead = &self.active[g.members[0].0];
                if g.to == lead.key.len() {
                    let bytes = self.model.state_bytes(&state);
                    self.cache
                        .insert(lead.cache_key.clone(), state.clone(), bytes);
                }
                for &(i, _) in &g.members {
                    self.active[i].held = Some((state.clone(), g.to));
                }
            }
            let mut logits = out.logits.into_iter();
            for &(i, reads) in &g.members {
                if !reads {
                    continue;
                }
                let n = self.active[i].prompts.len();
                let mine: Vec<Vec<f64>> = logits.by_ref().take(n).collect();
                if mine.len() != n {
                    finished.push((
                        i,
                        Err(DecisionError::ModelOutput(format!(
                            "{} read-outs for {n} prompts",
                            mine.len()
                        ))),
                    ));
                    continue;
                }
                let result = self.feed(i, mine);
                if result.is_err() || self.active[i].task.is_done() {
                    finished.push((i, result));
                }
            }
        }
        // Thought steps: sample, stop, and hand finished thoughts to their tasks.
        for (&(i, t), output) in thoughts.iter().zip(thought_outputs) {
            if finished.iter().any(|f| f.0 == i) {
                continue;
            }
            let result = self.advance_thought(i, t, output);
            if result.is_err() || self.active[i].task.is_done() {
                finished.push((i, result));
            }
        }
        for a in &mut self.active {
            a.thoughts.retain(|run| run.phase != Phase::Done);
        }
        self.shared.stats(|s| s.prefix_cache = self.cache.stats());
        finished.sort_by_key(|f| f.0);
        finished.dedup_by_key(|f| f.0);
        // Answer, highest index first so the others keep theirs.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, result) in finished {
            match result {
                Ok(()) => self.answer(i, None),
                Err(error) => self.answer(i, Some(JobError::Decision(error))),
            }
        }
        // The device's memory after the pass, read once its answers are out: the query is a driver
        // round trip that no answer should wait for.
        if let Some((used, total)) = self.model.device_memory() {
            self.shared.stats(|s| {
                let max = s.device_memory.map_or(0, |m| m.max_used_bytes).max(used);
                s.device_memory = Some(super::DeviceMemory {
                    used_bytes: used,
                    total_bytes: total,
                    max_used_bytes: max,
                });
            });
        }
        // Requests still waiting to run alone go first (stable: the others keep their order).
        self.active.sort_by_key(|a| !a.solo);
    }

    /// Applies a thought step's output to thought `t` of request `i`; a finished thought goes to the
    /// task, and a thought that just started counts.
    fn advance_thought(
        &mut self,
        i: usize,
        t: usize,
        output: super::pass::GroupOutput<M::State>,
    ) -> Result<(), DecisionError> {
        let a = &mut self.active[i];
        let run = &mut a.thoughts[t];
        let phase = run.phase;
        run.apply(output).map_err(|e| a.task.model_error(e))?;
        if let Some(outcome) = run.take_outcome(&*self.encoder) {
            let id = run.id;
            let tokens = outcome.tokens.len() as u64;
            a.task.feed_thought(id, outcome)?;
            self.shared.stats(|s| {
                s.thoughts_finished += 1;
                s.thought_tokens += tokens;
            });
        } else if phase == Phase::Prefill {
            self.shared.stats(|s| s.thoughts_started += 1);
        }
        Ok(())
    }

    /// Feeds request `i` its read-outs and prepares its next round's prompts or its thoughts.
    fn feed(&mut self, i: usize, logits: Vec<Vec<f64>>) -> Result<(), DecisionError> {
        let a = &mut self.active[i];
        let input_tokens = a.tokens.iter().map(|t| t.len() as u64).sum();
        a.prompts.clear();
        a.tokens.clear();
        a.task.feed(LetterLogits {
            logits,
            input_tokens,
            output_tokens: 0,
        })?;
        if a.task.is_done() {
            return Ok(());
        }
        // Questions that think now.
        for (id, request) in a.task.next_thoughts() {
            let run = ThoughtRun::new(id, &request, &*self.encoder, self.options.max_prompt_tokens)
                .map_err(|e| a.task.model_error(e))?;
            a.thoughts.push(run);
        }
        // A further wide-choice round: same evidence, other options.
        let prompts = a.task.next_prompts();
        let tokens = encode_all(
            &*self.encoder,
            &a.task,
            &prompts,
            self.options.max_prompt_tokens,
        )?;
        if let Some(bad) = tokens
            .iter()
            .position(|t| t.len() <= a.key.len() || !t.starts_with(&a.key))
        {
            return Err(DecisionError::ModelOutput(format!(
                "prompt {bad} of a later round does not continue the request's evidence"
            )));
        }
        a.prompts = prompts;
        a.tokens = tokens;
        Ok(())
    }

    fn fail_pass(&mut self, members: &[usize], requests: usize, error: ModelError) {
        let mut members = members.to_vec();
        if requests > 1 {
            tracing::warn!(
                "a pass of {requests} requests failed ({error}); retrying them one at a time"
            );
            self.shared.stats(|s| s.passes_split_after_error += 1);
            for i in members {
                self.active[i].solo = true;
            }
            // Solo requests first, in their order, so each runs alone next.
            self.active.sort_by_key(|a| !a.solo);
            return;
        }
        members.sort_unstable();
        members.dedup();
        for i in members.into_iter().rev() {
            let error = match &error {
                ModelError::OutOfMemory(m) => ModelError::OutOfMemory(m.clone()),
                other => ModelError::Backend(other.to_string()),
            };
            let decision = self.active[i].task.model_error(error);
            self.answer(i, Some(JobError::Decision(decision)));
        }
    }
}
