//! `prism eval --url`: a labelled suite against any `/v1/systemone` server, from many clients; each
//! response body is read by `prism_decision::eval`, as the in-process run's are
//! (`prism_decision::eval::run`), so the same answers give the same `results.json`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Result;
use prism_decision::eval::run::{Progress, Run};
use prism_decision::eval::{answers_from_response, ItemResult, ItemStatus, SuiteItem};
use serde_json::json;

/// The decide endpoint of a server given by its base URL (or by the endpoint itself).
fn endpoint(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.ends_with("/v1/systemone") || url.ends_with("/v1/decisions") {
        url.to_string()
    } else {
        format!("{url}/v1/systemone")
    }
}

/// One item over HTTP: retried on 503 (overloaded) and on transport errors, up to 5 tries.
fn send_item(
    agent: &ureq::Agent,
    url: &str,
    key: Option<&str>,
    item: &SuiteItem,
    stop: &AtomicBool,
) -> Option<ItemResult> {
    let mut last_error = String::new();
    for attempt in 0..5 {
        if attempt > 0 {
            if stop.load(Ordering::SeqCst) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(250 << attempt));
        }
        let mut request = agent.post(url).header("Content-Type", "application/json");
        if let Some(key) = key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        let mut response = match request.send(item.body.as_bytes()) {
            Ok(response) => response,
            Err(error) => {
                last_error = format!("HTTP request failed: {error}");
                continue;
            }
        };
        let status = response.status().as_u16();
        let body = match response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
        {
            Ok(body) => body,
            Err(error) => {
                last_error = format!("reading the response failed: {error}");
                continue;
            }
        };
        if status == 200 {
            return Some(answers_from_response(item, &body).unwrap_or_else(|e| {
                ItemResult::not_answered(item, ItemStatus::Failed, e.to_string())
            }));
        }
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(300).collect());
        last_error = format!("HTTP {status}: {message}");
        if status == 503 {
            continue;
        }
        let kind = if (400..500).contains(&status) {
            ItemStatus::Refused
        } else {
            ItemStatus::Failed
        };
        return Some(ItemResult::not_answered(item, kind, last_error));
    }
    Some(ItemResult::not_answered(
        item,
        ItemStatus::Failed,
        last_error,
    ))
}

/// Runs `items` against the server at `url` (its base URL or its decide endpoint) from `concurrency`
/// clients (default 8) until all are answered or `stop` is set. `log` gets the lines to show.
pub fn run_http(
    url: &str,
    key: Option<String>,
    concurrency: Option<usize>,
    items: &[SuiteItem],
    stop: &AtomicBool,
    log: &mut dyn FnMut(String),
    progress: &dyn Progress,
) -> Result<Run> {
    let endpoint = endpoint(url);
    let key = key.filter(|k| !k.trim().is_empty());
    let concurrency = concurrency.unwrap_or(8);
    // What the server says it is (best effort: any /v1/systemone server may not have /v1/models).
    let base = endpoint
        .trim_end_matches("/v1/systemone")
        .trim_end_matches("/v1/decisions")
        .to_string();
    let models = {
        let mut request = crate::loadgen::agent().get(&format!("{base}/v1/models"));
        if let Some(key) = &key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        request
            .call()
            .ok()
            .filter(|r| r.status().as_u16() == 200)
            .and_then(|mut r| r.body_mut().read_to_vec().ok())
            .and_then(|body| serde_json::from_slice::<serde_json::Value>(&body).ok())
    };
    let model = models.as_ref().and_then(|m| m["models"].get(0).cloned());
    log(format!(
        "eval: {} items against {endpoint} ({concurrency} clients)",
        items.len()
    ));
    progress.start();
    let results: Mutex<Vec<Option<ItemResult>>> = Mutex::new(vec![None; items.len()]);
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..concurrency.min(items.len()) {
            scope.spawn(|| {
                let agent = crate::loadgen::agent();
                loop {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= items.len() {
                        break;
                    }
                    let result = send_item(&agent, &endpoint, key.as_deref(), &items[i], stop);
                    if result.is_some() {
                        progress.item_done();
                    }
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = result;
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(Run {
        results,
        info: json!({
            "mode": "http",
            "url": endpoint,
            "model": model.as_ref().and_then(|m| m["name"].as_str()),
            "precision": model.as_ref().and_then(|m| m["precision"].as_str()),
            "demo": model.as_ref().and_then(|m| m["demo"].as_bool()),
            "concurrency": concurrency,
        }),
    })
}
