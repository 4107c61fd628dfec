// Shared by the build scripts of prism-model and prism-quant (`include!`d): with the `cuda` feature,
// compiles `kernels/<name>.cu` to `$OUT_DIR/<name>.ptx` and `$OUT_DIR/<name>.fatbin` (sm_80, sm_89,
// sm_90a machine code + compute_80 PTX) with the nvcc of `$CUDA_HOME` (or the PATH), so
// the engine never needs a compiler when it starts. Without the feature it does nothing: CI and the CPU
// build need no CUDA toolchain.

fn compile_kernels_to_ptx(names: &[&str]) {
    use std::path::PathBuf;

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../kernels/build_ptx.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let kernels = manifest.join("../../kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .unwrap_or_else(|_| PathBuf::from("nvcc"));
    // Headers the kernels include (kernels/*.cuh).
    if let Ok(dir) = std::fs::read_dir(&kernels) {
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "cuh") {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    for name in names {
        let src = kernels.join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        // compute_80 PTX (int8 mma.sync needs sm_80): JIT-compiled by the driver on every GPU from
        // Ampere on, Hopper included.
        let ptx = out.join(format!("{name}.ptx"));
        run_nvcc(&nvcc, &["-O3", "--ptx", "-arch=compute_80", "-lineinfo"], &src, &ptx);
        // The image the engine loads: machine code for Ampere (sm_80), Ada (sm_89) and Hopper
        // (sm_90a), plus the compute_80 PTX for any later GPU, so no driver JIT at start on the
        // GPUs we target.
        let fatbin = out.join(format!("{name}.fatbin"));
        run_nvcc(
            &nvcc,
            &[
                "-O3",
                "--fatbin",
                "-lineinfo",
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_89,code=sm_89",
                "-gencode=arch=compute_90a,code=sm_90a",
                "-gencode=arch=compute_80,code=compute_80",
            ],
            &src,
            &fatbin,
        );
    }
}

fn run_nvcc(nvcc: &std::path::Path, args: &[&str], src: &std::path::Path, out: &std::path::Path) {
    let status = std::process::Command::new(nvcc)
        .args(args)
        .arg(src)
        .arg("-o")
        .arg(out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run nvcc ({}): {e}", nvcc.display()));
    assert!(status.success(), "nvcc {args:?} failed on {}", src.display());
}
