//! The playground page (`GET /` on `prism serve`) in a real headless Chromium, driven through WebDriver
//! by `tests/playground/check_playground.py`: fill the evidence and one question of each type, send, and
//! read the rendered probabilities back — they must be the API's for the same request; labels, 400 px,
//! an invalid request's field; a screenshot (`target/playground.png`). Needs Debian's `chromium` and
//! `chromium-driver` (`.ci/run` installs them); without them the test is skipped, except under
//! `CI=true`, where that fails.

mod serve_common;

use serve_common::{check_report, repo_path, send, Server};

fn browser() -> Option<(String, String)> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let driver = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
    if std::path::Path::new(&chromium).is_file() && std::path::Path::new(&driver).is_file() {
        return Some((chromium, driver));
    }
    let message = "chromium and chromedriver (Debian's chromium and chromium-driver, installed by .ci/run) are missing";
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{message}: CI must run the browser test");
    }
    eprintln!("SKIPPED serve_playground: {message}");
    None
}

#[test]
fn the_playground_shows_the_apis_answers_in_a_real_browser() {
    let Some((chromium, driver)) = browser() else {
        return;
    };
    let server = Server::start(&["--demo", "v1.1"]);
    let banner = server.stdout.lock().unwrap().clone();
    assert!(banner.contains("Playground: open"), "{banner}");
    let screenshot = repo_path("target/playground.png");
    let output = std::process::Command::new("python3")
        .arg(repo_path("tests/playground/check_playground.py"))
        .arg(format!("http://{}", server.addr))
        .arg(&screenshot)
        .env("CHROMIUM", &chromium)
        .env("CHROMEDRIVER", &driver)
        .output()
        .expect("run python3");
    let report = check_report(&output, "the browser check", &server);
    // Three questions: the choice's three options and none, yes, and the score's three levels.
    assert!(
        report["probabilities_compared"].as_u64().unwrap() >= 8,
        "{report}"
    );
    assert!(
        report["model_line"].as_str().unwrap().contains("v1.1"),
        "{report}"
    );
    let png = std::fs::read(&screenshot).expect("the screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
}

#[test]
fn the_page_needs_no_key_and_can_be_turned_off() {
    let server = Server::start(&["--api-key", "k3y"]);
    let page = send(server.addr, "GET", "/", &[], b"");
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let html = String::from_utf8(page.body.clone()).unwrap();
    assert!(html.contains("Prism playground") && html.contains("<script>"));
    // Nothing from elsewhere: no external scripts, styles or fonts.
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "the page fetches nothing"
    );
    // Everything else still needs the key.
    assert_eq!(send(server.addr, "GET", "/v1/models", &[], b"").status, 401);
    drop(server);
    let server = Server::start(&["--no-playground"]);
    assert_eq!(send(server.addr, "GET", "/", &[], b"").status, 404);
}
