//! `PRISM_STACKS_ON_SIGQUIT=1`: `kill -QUIT` on a running `prism serve` writes one stack line for
//! each of its threads and the memory map to stderr, and the server keeps answering.
#![cfg(target_os = "linux")]

mod serve_common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use serve_common::Server;

fn wait_for(server: &Server, marker: &str) -> String {
    let started = Instant::now();
    loop {
        let text = server.stderr.lock().unwrap().clone();
        if text.contains(marker) {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no {marker:?} on stderr after 30 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn thread_ids(server: &Server) -> HashSet<u32> {
    std::fs::read_dir(format!("/proc/{}/task", server.pid()))
        .expect("the server's threads")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn sigquit(server: &Server) {
    let status = Command::new("kill")
        .args(["-QUIT", &server.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -QUIT failed: {status}");
}

#[test]
fn sigquit_writes_every_threads_stack_and_the_server_carries_on() {
    let server = Server::start_with_env(&[], &[("PRISM_STACKS_ON_SIGQUIT", "1")]);
    let before = thread_ids(&server);
    sigquit(&server);
    let text = wait_for(&server, "prism-stacks end");
    let dump = text
        .split("prism-stacks begin")
        .nth(1)
        .expect("a begin line");
    let (stacks, maps) = dump.split_once("prism-stacks maps").expect("a maps line");

    // One line a thread, each with its own thread id and return addresses in hex.
    let mut tids = HashSet::new();
    let mut names = HashSet::new();
    for line in stacks.lines().filter(|l| l.starts_with("prism-stack tid=")) {
        let rest = &line["prism-stack tid=".len()..];
        let (tid, rest) = rest.split_once(" name=").expect("name");
        assert!(
            tids.insert(tid.parse::<u32>().expect("numeric tid")),
            "{line}"
        );
        let (name, frames) = rest.split_once(" frames:").expect("frames");
        names.insert(name.to_string());
        let frames: Vec<&str> = frames.split_whitespace().collect();
        assert!(frames.len() >= 3, "too few frames: {line}");
        for f in &frames {
            let hex = f.strip_prefix("0x").expect("0x address");
            assert!(usize::from_str_radix(hex, 16).is_ok(), "{line}");
        }
    }
    // Every thread that lived before and after the dump wrote its line (threads may come and go
    // meanwhile, e.g. tokio's blocking pool).
    let after = thread_ids(&server);
    for tid in before.intersection(&after) {
        assert!(tids.contains(tid), "no line for thread {tid}:\n{stacks}");
    }
    assert!(tids.len() >= 3, "{stacks}");
    // The HTTP workers and the engine's step loop are among them.
    assert!(names.contains("prism-http"), "{names:?}");
    assert!(names.contains("prism-engine"), "{names:?}");
    // The map names the binary, whose mappings the addresses are read against.
    assert!(maps.contains("r-xp"), "{maps}");
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_prism"));
    let exe_name = exe.file_name().unwrap().to_str().unwrap();
    assert!(maps.lines().any(|l| l.ends_with(exe_name)), "{maps}");

    // The server is still up, and a second dump works too.
    let health = server.get("/health");
    assert_eq!(health.status, 200);
    sigquit(&server);
    let started = Instant::now();
    while server
        .stderr
        .lock()
        .unwrap()
        .matches("prism-stacks end")
        .count()
        < 2
    {
        // A poll like serve_engine's wait for cancellations: each loop checks its own condition and
        // limit, so it stays written out here.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no second dump"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn without_the_variable_sigquit_keeps_its_default() {
    let mut server = Server::start(&[]);
    sigquit(&server);
    let status = server.wait_exit(Duration::from_secs(30));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(3), "{status:?}");
    assert!(!server.stderr.lock().unwrap().contains("prism-stacks"));
}
