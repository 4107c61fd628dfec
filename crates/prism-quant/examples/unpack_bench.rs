//! Load-time cost of the integer path's weights: `cargo run --release -p prism-quant --example
//! unpack_bench`. Unpacks one 27B `ffn_down`-sized Q8_0 tensor (17408 × 5120, 95 MB of GGUF blocks) with
//! `QuantWeight::from_gguf` and joins two of them with `QuantWeight::concat_rows` (what a fused
//! projection does at load), three times each, printing seconds and GB/s.

use std::time::Instant;

use prism_gguf::GgmlType;
use prism_quant::QuantWeight;

fn main() {
    let (rows, cols) = (17408usize, 5120usize);
    // Blocks with a finite fp16 scale and arbitrary quants (the values do not matter for the cost).
    let mut bytes = vec![0u8; rows * cols / 32 * 34];
    for (i, block) in bytes.chunks_exact_mut(34).enumerate() {
        block[0] = (i % 251) as u8;
        block[1] = 0x2c;
        for (j, q) in block[2..].iter_mut().enumerate() {
            *q = ((i * 31 + j * 7) % 256) as u8;
        }
    }
    for _ in 0..3 {
        let t = Instant::now();
        let w =
            QuantWeight::from_gguf("bench", GgmlType::Q8_0, &bytes, rows, cols).expect("unpack");
        let s = t.elapsed().as_secs_f64();
        println!(
            "unpack Q8_0 {rows}×{cols}: {s:.3} s, {:.2} GB/s of GGUF bytes",
            bytes.len() as f64 / s / 1e9
        );
        let t = Instant::now();
        let joined = QuantWeight::concat_rows(&[&w, &w]).expect("concat");
        let s = t.elapsed().as_secs_f64();
        println!(
            "concat_rows of two: {s:.3} s, {:.2} GB/s written",
            joined.memory_bytes() as f64 / s / 1e9
        );
        std::hint::black_box((&w, &joined));
    }
}
