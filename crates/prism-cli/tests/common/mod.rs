//! Shared by the tests that run the `prism` command to its end: paths in the repository and one run of
//! the built binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// A path relative to the repository root.
pub fn repo(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

/// A file under `examples/`.
pub fn example(name: &str) -> PathBuf {
    repo("examples").join(name)
}

/// A choice or score answer's probabilities, in the order of its options.
pub fn probabilities(answer: &Value) -> Vec<f64> {
    answer["probabilities"]
        .as_object()
        .expect("probabilities")
        .values()
        .map(|p| p.as_f64().expect("a probability"))
        .collect()
}

/// Runs the built `prism` with `args` and the environment variables `env` set, and waits for its output.
pub fn run_prism(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run prism")
}
