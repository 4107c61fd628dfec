// Shared by the build scripts of prism-model and prism-quant (`include!`d): with the `cuda` feature,
// compiles `kernels/<name>.cu` to `$OUT_DIR/<name>.ptx` with the nvcc of `$CUDA_HOME` (or the PATH), so
// the engine never needs a compiler when it starts. Without the feature it does nothing: CI and the CPU
// build need no CUDA toolchain.

fn compile_kernels_to_ptx(names: &[&str]) {
    use std::path::PathBuf;
    use std::process::Command;

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
    for name in names {
        let src = kernels.join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        // compute_80 PTX (int8 mma.sync needs sm_80): JIT-compiled by the driver on every GPU from
        // Ampere on, Hopper included.
        let status = Command::new(&nvcc)
            .args(["-O3", "--ptx", "-arch=compute_80", "-lineinfo"])
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| panic!("cannot run nvcc ({}): {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
