//! Every CUDA kernel of ours begins with the grid-dependency prologue (`kernels/launch.cuh`).
//!
//! On a compute-capability-9.x GPU `prism_quant::cuda_launch::Launch` launches every kernel with
//! programmatic stream serialization, so a kernel may start while the one ahead of it is still running;
//! a kernel whose first statement is not `PRISM_GRID_PROLOGUE()` could read what that kernel has not
//! written yet. This test reads the sources (no GPU needed) and fails on any `__global__` function whose
//! body does not start with it.

use std::path::{Path, PathBuf};

fn kernel_sources() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    files
}

/// For each `__global__` definition in `src` (declarations skipped): its name's line and what follows
/// its body's opening brace.
fn kernel_bodies(src: &str) -> Vec<(usize, &str)> {
    let mut bodies = Vec::new();
    let mut from = 0;
    while let Some(at) = src[from..].find("__global__") {
        let start = from + at;
        let mut depth = 0i32;
        let mut body = None;
        for (i, c) in src[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ';' if depth == 0 => break,
                '{' if depth == 0 => {
                    body = Some(start + i + 1);
                    break;
                }
                _ => {}
            }
        }
        let line = src[..start].lines().count() + 1;
        match body {
            Some(b) => {
                bodies.push((line, &src[b..]));
                from = b;
            }
            None => from = start + "__global__".len(),
        }
    }
    bodies
}

/// `text` without leading white space and macro line continuations.
fn first_statement(text: &str) -> &str {
    text.trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
}

#[test]
fn every_kernel_begins_with_the_grid_dependency_prologue() {
    let files = kernel_sources();
    assert!(files.len() >= 5, "found only {files:?} in kernels/");
    let mut kernels = 0;
    let mut missing = Vec::new();
    for path in &files {
        let src = std::fs::read_to_string(path).expect("a kernel source");
        let bodies = kernel_bodies(&src);
        if !bodies.is_empty() && !src.contains("#include \"launch.cuh\"") {
            missing.push(format!("{} does not include launch.cuh", path.display()));
        }
        for (line, body) in bodies {
            kernels += 1;
            let first = first_statement(body);
            if first.starts_with("PRISM_GRID_WAIT_LATER();") {
                // Such a kernel waits in the device function it calls: the file must have the wait.
                if !src.contains("PRISM_GRID_WAIT();") {
                    missing.push(format!(
                        "{}:{line} (waits later, no PRISM_GRID_WAIT)",
                        path.display()
                    ));
                }
            } else if !first.starts_with("PRISM_GRID_PROLOGUE();") {
                missing.push(format!("{}:{line}", path.display()));
            }
        }
    }
    assert!(kernels >= 30, "found only {kernels} kernels");
    assert!(
        missing.is_empty(),
        "kernels whose first statement is neither PRISM_GRID_PROLOGUE() nor PRISM_GRID_WAIT_LATER(): {missing:?}"
    );
}

#[test]
fn the_scan_finds_a_kernel_without_the_prologue() {
    let src = "extern \"C\" __global__ void a(int* x) {\n    PRISM_GRID_PROLOGUE();\n    x[0] = 1;\n}\n\
               __global__ void b(int* x);\n\
               #define K(NAME) \\\n    extern \"C\" __global__ void NAME(int* x) { \\\n        x[0] = 2; \\\n    }\n";
    let bodies = kernel_bodies(src);
    assert_eq!(
        bodies.len(),
        2,
        "a definition in a macro counts, a declaration does not"
    );
    assert!(first_statement(bodies[0].1).starts_with("PRISM_GRID_PROLOGUE();"));
    assert!(first_statement(bodies[1].1).starts_with("x[0] = 2;"));
}
