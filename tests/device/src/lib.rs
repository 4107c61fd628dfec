//! The device checks of Prism's CUDA code, as one test binary (`checks/main.rs`; this library is
//! empty). Every check runs a kernel, or the fixture model, on the GPU next to its CPU twin (the code
//! CI tests) and compares them: within a stated bound, or bit for bit where the kernel promises the
//! CPU's bits or its own bits under other batch compositions and splits. Without the `cuda` feature
//! the binary has no tests, so CI builds the crate without a GPU.
//!
//! Built here, run on the GPU machine (which has no Rust toolchain):
//!
//! ```text
//! bash tools/device/build-tests.sh        # .device-carry/device-tests.xz
//! bash tools/device/run.sh checks         # on the device: unpacks and runs it, log in $OUT/checks.log
//! ```
//!
//! or by hand: `device-tests --test-threads=1 --nocapture` from the repository root, with
//! `PRISM_DEVICE_JSON=FILE` for the machine-readable record of every check and
//! `PRISM_DEVICE_FIXTURES=DIR` when the fixtures are not at `tests/fixtures/qwen35-tiny` (and
//! `PRISM_DEVICE_VL_FIXTURES=DIR` when the vision fixture is not `qwen35-vl-tiny` next to it).
