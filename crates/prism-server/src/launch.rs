//! `prism serve`'s set-up, without its printing: the connection limits and API key from the flags, the
//! replicas loaded on their devices, the demo model's family, the engine's budgets sized from the free
//! device memory, the warm-up request, the runtime and the shutdown signal. The `prism` binary calls
//! these in order and prints what each gives.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use prism_decision::engine::{Engine, EngineOptions, PrefixCacheLimits};
use prism_decision::{
    DecisionConfig, DecisionRequest, DecoderLetterModel, Family, ModelSource, RequestDefaults,
};
use prism_model::tensor_parallel::TensorParallelModel;
use prism_model::LoadOptions;

use crate::ConnectionLimits;

/// A request that exercises the whole path once before the server opens.
pub const WARM_UP: &str = r#"{"state": "Prism warm-up.", "questions": {"ready": {"type": "noul", "instructions": "Is the engine ready?"}}}"#;

/// `--header-timeout`, `--max-connections` and `--shutdown-grace` (default `--timeout` + 5 s), checked.
pub fn connection_limits(
    header_timeout: f64,
    max_connections: Option<usize>,
    shutdown_grace: Option<f64>,
    timeout: f64,
) -> Result<ConnectionLimits> {
    if !(timeout.is_finite() && timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, got {timeout}");
    }
    let seconds = |name: &str, value: f64| -> Result<Duration> {
        if !(value.is_finite() && value > 0.0) {
            bail!("{name} must be a positive number of seconds, got {value}");
        }
        Ok(Duration::from_secs_f64(value))
    };
    Ok(ConnectionLimits {
        header_timeout: seconds("--header-timeout", header_timeout)?,
        max_connections: match max_connections {
            Some(0) => bail!("--max-connections must be at least 1"),
            Some(n) => n,
            None => default_max_connections(),
        },
        shutdown_grace: seconds("--shutdown-grace", shutdown_grace.unwrap_or(timeout + 5.0))?,
    })
}

/// The API key (`--api-key`, else the one the environment gave), trimmed; none when empty. It must be
/// printable ASCII without spaces.
pub fn api_key(flag: Option<String>, from_env: Option<String>) -> Result<Option<String>> {
    let key = flag
        .or(from_env)
        .map(|key| key.trim().to_string())
        .filter(|key| !key.is_empty());
    if let Some(key) = &key {
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the API key must be printable ASCII without spaces");
        }
    }
    Ok(key)
}

/// How the banner names where the model runs: `CPU`, `CUDA GPU 0`, `CUDA GPUs 0,1`, with the replica
/// count when there is more than one.
pub fn device_name(on_gpu: bool, gpus: &[usize], replicas: usize) -> String {
    let name = match (on_gpu, gpus.len()) {
        (true, 0 | 1) => format!("CUDA GPU {}", gpus.first().copied().unwrap_or(0)),
        (true, _) => format!(
            "CUDA GPUs {}",
            gpus.iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
        (false, _) => "CPU".to_string(),
    };
    match replicas {
        1 => name,
        n => format!("{name}, {n} engine replicas"),
    }
}

/// Checks `prism serve --tp tp` over `devices`: 1, 2 or 4 devices a replica, and either one device (the
/// shares share it) or a multiple of `tp` devices (consecutive groups of `tp` become one replica's).
pub fn check_tensor_parallel(devices: &[Device], tp: usize) -> Result<()> {
    if !matches!(tp, 1 | 2 | 4) {
        bail!("--tp takes 1, 2 or 4 devices a replica, not {tp}");
    }
    if tp > 1 && devices.len() > 1 && devices.len() % tp != 0 {
        bail!(
            "--tp {tp} splits each replica over {tp} devices, but {} GPUs were given (a multiple of {tp} is needed)",
            devices.len()
        );
    }
    Ok(())
}

/// The replicas of `prism serve --tp tp`: `models` as [`load_replicas`] loaded them (`replicas`
/// copies on each device, device by device), each replica split by
/// [`DecoderLetterModel::tensor_parallel`] over `tp` consecutive devices' copies — or, with one device,
/// over `tp` handles on the same copy (its shares cut from one load, not `tp`).
pub fn tensor_parallel_replicas(
    models: Vec<DecoderLetterModel>,
    devices: usize,
    tp: usize,
    replicas: usize,
) -> Result<Vec<DecoderLetterModel<TensorParallelModel>>> {
    if tp == 0 || replicas == 0 || models.len() != devices * replicas {
        bail!(
            "{} loaded models are not {replicas} on each of {devices} devices",
            models.len()
        );
    }
    if devices > 1 && devices % tp != 0 {
        bail!("{devices} devices do not make replicas of {tp}");
    }
    // Copy `copy` of device `g`'s load; one device holds every share of its replicas.
    let index = |g: usize, copy: usize| {
        if devices == 1 {
            copy
        } else {
            g * replicas + copy
        }
    };
    let mut out = Vec::with_capacity(devices.div_ceil(tp) * replicas);
    for group in 0..devices.div_ceil(tp) {
        for copy in 0..replicas {
            let shares: Vec<DecoderLetterModel> = (0..tp)
                .map(|i| models[index(group * tp + i, copy)].share())
                .collect();
            out.push(DecoderLetterModel::tensor_parallel(&shares).map_err(|e| {
                anyhow::anyhow!("cannot split the model over {tp} devices (--tp): {e}")
            })?);
        }
    }
    Ok(out)
}

/// One model per replica, `replicas` on each device, loaded with `options` (its device replaced);
/// `on_replica(index, device, copy)` is called before each load when there is more than one.
pub fn load_replicas(
    source: &ModelSource,
    devices: &[Device],
    replicas: usize,
    options: &LoadOptions,
    max_tokens: usize,
    on_replica: &mut dyn FnMut(usize, usize, usize),
) -> Result<(Vec<DecoderLetterModel>, DecisionConfig)> {
    let mut models = Vec::with_capacity(devices.len() * replicas);
    let mut config = None;
    for (d, device) in devices.iter().enumerate() {
        for r in 0..replicas {
            if devices.len() * replicas > 1 {
                on_replica(models.len(), d, r);
            }
            let options = LoadOptions {
                device: device.clone(),
                ..options.clone()
            };
            let loaded = DecoderLetterModel::load(source, &options, max_tokens)
                .with_context(|| format!("loading the decision model {}", source.gguf.display()))?;
            models.push(loaded.model);
            config = Some(loaded.config);
        }
    }
    Ok((models, config.context("no replica was loaded")?))
}

/// The family the model is served as: `--demo`'s (default v1.1) for the demo model, `None` (the
/// release's own) otherwise; `--demo` with a release is an error.
pub fn demo_family(flag: Option<&str>, demo: bool) -> Result<Option<Family>> {
    match (flag, demo) {
        (Some(_), false) => bail!(
            "--demo chooses the family of the bundled demo model; with --gguf the release's \
             decision_config.json says its family"
        ),
        (family, true) => Ok(Some(match family.unwrap_or("v1.1") {
            "v1" => Family::V1,
            "instant" => Family::Instant,
            _ => Family::AutoThink,
        })),
        (None, false) => Ok(None),
    }
}

/// Where the decision config came from, when it is not the model directory's own file.
pub fn config_note(source: &ModelSource, demo: bool) -> &'static str {
    match &source.model_dir {
        Some(_) if demo => " (decision config: the defaults, the family from --demo)",
        Some(dir) if !dir.join("decision_config.json").is_file() => {
            " (decision config: the defaults, as the model directory has no decision_config.json)"
        }
        Some(_) => "",
        None => " (decision config: the defaults, as no --model-dir was given)",
    }
}

/// The engine's limits as the flags give them (`None`: sized from the device).
// A field list: alike in shape only to other structs' plain fields.
#[derive(Clone, Debug)]
pub struct Budgets {
    pub replicas: usize,
    pub max_batch_tokens: Option<usize>,
    pub max_prompts_per_pass: Option<usize>,
    pub prefix_cache_tokens: usize,
    pub prefix_cache_bytes: Option<u64>,
    pub think_seqs: Option<usize>,
    pub queue_size: usize,
    pub max_tokens: usize,
    pub max_questions: usize,
    pub max_request_tokens: usize,
}

/// The engine options: what the flags fix, the rest sized from `free_memory` (free and total bytes of
/// the device, `None` on the CPU), shared by the replicas on one device.
pub fn engine_options(
    budgets: &Budgets,
    model: &DecoderLetterModel,
    free_memory: Option<(u64, u64)>,
) -> Result<EngineOptions> {
    // Budgets are per replica; replicas sharing a device share its free memory.
    let per_device = budgets.replicas as u64;
    let cache_bytes = budgets.prefix_cache_bytes.unwrap_or(match free_memory {
        Some((free, _)) => free / 8 / per_device,
        None => 2 << 30,
    });
    // One sequence state, as each prompt of a pass makes (without its K/V rows, which grow with it).
    let state_bytes = model
        .decoder()
        .new_state()
        .map(|state| state.bytes() as u64)
        .context("cannot make a sequence state")?
        .max(1);
    // A replica's share of the device memory the prefix caches leave.
    let left =
        free_memory.map(|(free, _)| free.saturating_sub(cache_bytes * per_device) / per_device);
    let max_prompts_per_pass = budget(
        budgets.max_prompts_per_pass,
        "max-prompts-per-pass",
        left,
        // A sixth of what the cache leaves: measured on the H200 (27B bf16, 2026-12-01), half
        // of it ran out of memory under 16 and 64 clients (the pool's fragments, the pass's
        // activations and the delta rule's buffers come on top of the states).
        |left| (left / 6 / state_bytes).clamp(8, 1024) as usize,
        1024,
    )?;
    let think_seqs = budget(
        budgets.think_seqs,
        "think-seqs",
        left,
        // A quarter of what the cache leaves, at `thought_device_bytes` a seat: with an eighth
        // of the memory a seat at one state each, 64 clients with thoughts ran out of memory on
        // the H200 (27B int8, 2026-12-02).
        |left| {
            (left / 4 / prism_decision::engine::thought_device_bytes(state_bytes).max(1))
                .clamp(4, 512) as usize
        },
        64,
    )?;
    let max_batch_tokens = budget(
        budgets.max_batch_tokens,
        "max-batch-tokens",
        left,
        // A quarter of what the cache leaves, at the config's estimate of a token's peak bytes
        // in a pass; never above the CPU's 8,192 (27B bf16 passes of 10-16k tokens ran out of
        // memory on the H200 on 2026-12-01, with the cache and the states of many requests).
        |left| {
            let per_token = model.decoder().config().pass_bytes_per_token().max(1) as u64;
            pass_tokens(left / 4 / per_token)
        },
        MAX_BATCH_TOKENS,
    )?;
    let options = EngineOptions {
        think_seqs,
        max_batch_tokens,
        max_prompts_per_pass,
        queue_size: budgets.queue_size,
        max_prompt_tokens: budgets.max_tokens,
        max_questions: budgets.max_questions,
        max_request_tokens: budgets.max_request_tokens,
        prefix_cache: PrefixCacheLimits {
            max_tokens: budgets.prefix_cache_tokens,
            max_bytes: cache_bytes,
        },
    };
    Ok(options)
}

/// A budget: `flag` where given (`--NAME`, at least 1), else `sized` of `left` (a replica's share of the
/// device memory left, on a GPU), else `cpu` (on the CPU).
fn budget(
    flag: Option<usize>,
    name: &str,
    left: Option<u64>,
    sized: impl FnOnce(u64) -> usize,
    cpu: usize,
) -> Result<usize> {
    Ok(match (flag, left) {
        (Some(0), _) => bail!("--{name} must be at least 1"),
        (Some(n), _) => n,
        (None, Some(left)) => sized(left),
        (None, None) => cpu,
    })
}

/// The default token budget of a pass (vLLM's default `max_num_batched_tokens` too).
pub const MAX_BATCH_TOKENS: usize = 8192;

/// A pass's default token budget when `fits` tokens fit in the memory set aside: a multiple of 256
/// (the delta rule's 64-token chunks, the tiles' rows), at least 256, at most [`MAX_BATCH_TOKENS`].
pub fn pass_tokens(fits: u64) -> usize {
    let fits = usize::try_from(fits).unwrap_or(usize::MAX);
    (fits / 256 * 256).clamp(256, MAX_BATCH_TOKENS)
}

/// One question ([`WARM_UP`]) through the whole path; its prompt tokens.
pub fn warm_up(engine: &Engine) -> Result<u64> {
    let request = DecisionRequest::parse(WARM_UP.as_bytes(), &RequestDefaults::default())
        .map_err(anyhow::Error::from)
        .and_then(|request| Ok(engine.decide(request, None)?))
        .context("the warm-up request failed")?;
    Ok(request.response.usage.input_tokens)
}

/// The server's runtime: two async workers (the model runs on the engine's threads), eight blocking
/// threads for parsing and tokenizing.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(8)
        .thread_name("prism-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// SIGTERM or Ctrl-C (SIGINT).
pub async fn wait_for_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

/// 1024 connections, or the process's descriptor limit less 64 (for the model files, the listener and
/// the logs) when that is lower.
pub fn default_max_connections() -> usize {
    #[cfg(target_os = "linux")]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid out-parameter for the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            let usable = (limit.rlim_cur as usize).saturating_sub(64).max(1);
            return usable.min(1024);
        }
    }
    1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_tokens_are_whole_256s_within_bounds() {
        assert_eq!(pass_tokens(0), 256);
        assert_eq!(pass_tokens(255), 256);
        assert_eq!(pass_tokens(1000), 768);
        assert_eq!(pass_tokens(8191), 7936);
        assert_eq!(pass_tokens(8192), MAX_BATCH_TOKENS);
        assert_eq!(pass_tokens(u64::MAX), MAX_BATCH_TOKENS);
        // 27B (405,504 bytes a token) on a device with 20 GB left after the cache: a quarter holds
        // 12,329 tokens, so the cap; with 4 GB left, 2,466 tokens, so 2,304.
        assert_eq!(pass_tokens(20_000_000_000 / 4 / 405_504), MAX_BATCH_TOKENS);
        assert_eq!(pass_tokens(4_000_000_000 / 4 / 405_504), 2304);
    }
}
