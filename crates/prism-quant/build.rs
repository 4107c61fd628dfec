//! With the `cuda` feature, compiles the integer GEMM kernels (`kernels/quant_gemm.cu`) at build time
//! (see `kernels/build_ptx.rs`).

include!("../../kernels/build_ptx.rs");

fn main() {
    compile_kernels_to_ptx(&["quant_gemm"]);
}
