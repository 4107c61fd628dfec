//! With the `cuda` feature, compiles the decoder's CUDA kernels (`kernels/delta_rule.cu`,
//! `kernels/ops.cu`, `kernels/flash_attention.cu`, `kernels/kv_fp8.cu`) to PTX at build time (see `kernels/build_ptx.rs`).

include!("../../kernels/build_ptx.rs");

fn main() {
    compile_kernels_to_ptx(&["delta_rule", "ops", "flash_attention", "kv_fp8"]);
}
