//! Corrupt, truncated and crafted GGUF files: every one must give `Ok` or a typed error, never a panic,
//! an over-read or an allocation out of proportion to the file.
//!
//! A counting global allocator records, per thread, the largest single allocation and the peak of live
//! bytes while a file is parsed. The reader sizes every allocation by a count that it has first checked
//! against the bytes that remain in the file, and the largest expansion from file bytes to memory is a
//! one-byte array element becoming a 32-byte `MetadataValue`; so no allocation may exceed 32 × the file
//! length, and the live total stays within a small multiple of it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use common::{fixture_path, header_fields, Rng};
use prism_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};

mod common;

// ---------------------------------------------------------------------------------------------------
// Allocation accounting (this test binary only).

struct CountingAlloc;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static MAX_SINGLE: Cell<usize> = const { Cell::new(0) };
}

fn record_alloc(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = MAX_SINGLE.try_with(|m| m.set(m.get().max(size)));
            let _ = LIVE.try_with(|l| {
                l.set(l.get() + size as isize);
                let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
            });
        }
    });
}

fn record_dealloc(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = LIVE.try_with(|l| l.set(l.get() - size as isize));
        }
    });
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record_alloc(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record_dealloc(layout.size());
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record_dealloc(layout.size());
        record_alloc(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Runs `f` with allocation tracking on; returns its result, the largest single allocation and the
/// peak of live bytes allocated inside `f`.
fn tracked<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    MAX_SINGLE.with(|m| m.set(0));
    TRACKING.with(|t| t.set(true));
    let out = f();
    TRACKING.with(|t| t.set(false));
    (
        out,
        MAX_SINGLE.with(Cell::get),
        PEAK.with(Cell::get).max(0) as usize,
    )
}

// ---------------------------------------------------------------------------------------------------
// Inputs.

/// A small file with every metadata value type and tensors of every dequantizable type.
fn synthetic_gguf() -> Vec<u8> {
    use MetadataValue as V;
    let mut w = GgufWriter::new();
    let meta = vec![
        ("general.architecture", V::String("qwen35".into())),
        ("a.u8", V::U8(1)),
        ("a.i8", V::I8(-1)),
        ("a.u16", V::U16(2)),
        ("a.i16", V::I16(-2)),
        ("a.u32", V::U32(3)),
        ("a.i32", V::I32(-3)),
        ("a.f32", V::F32(0.5)),
        ("a.bool", V::Bool(true)),
        ("a.u64", V::U64(4)),
        ("a.i64", V::I64(-4)),
        ("a.f64", V::F64(0.25)),
        (
            "a.strings",
            V::Array(vec![V::String("x y".into()), V::String("Ġz".into())]),
        ),
        (
            "a.ints",
            V::Array(vec![V::I32(3), V::I32(3), V::I32(2), V::I32(0)]),
        ),
        (
            "a.bools",
            V::Array(vec![V::Bool(true), V::Bool(false), V::Bool(true)]),
        ),
        (
            "a.nested",
            V::Array(vec![
                V::Array(vec![V::U8(1)]),
                V::Array(vec![V::String("q".into())]),
            ]),
        ),
        ("general.alignment", V::U32(32)),
    ];
    for (k, v) in meta {
        w.add_metadata(k, v).unwrap();
    }
    let tensors: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("f32", vec![8, 2], GgmlType::F32),
        ("f16", vec![4, 2, 2], GgmlType::F16),
        ("bf16", vec![6], GgmlType::BF16),
        ("q4_0", vec![32], GgmlType::Q4_0),
        ("q4_1", vec![32], GgmlType::Q4_1),
        ("q5_0", vec![32], GgmlType::Q5_0),
        ("q5_1", vec![32], GgmlType::Q5_1),
        ("q8_0", vec![64], GgmlType::Q8_0),
        ("q2_k", vec![256], GgmlType::Q2_K),
        ("q3_k", vec![256], GgmlType::Q3_K),
        ("q4_k", vec![256, 1, 1, 1], GgmlType::Q4_K),
        ("q5_k", vec![256], GgmlType::Q5_K),
        ("q6_k", vec![256], GgmlType::Q6_K),
        ("iq2_xxs", vec![256], GgmlType::IQ2_XXS),
    ];
    for (name, dims, ty) in &tensors {
        w.add_tensor(*name, dims, *ty).unwrap();
    }
    let mut data = w.write_header(Vec::new()).unwrap();
    let mut byte = 0u8;
    for (_, dims, ty) in &tensors {
        let n: u64 = dims.iter().product();
        let bytes: Vec<u8> = (0..ty.bytes_for(n).unwrap())
            .map(|_| {
                byte = byte.wrapping_mul(31).wrapping_add(7);
                byte
            })
            .collect();
        data.write_bytes(&bytes).unwrap();
    }
    data.finish().unwrap()
}

/// Values that sit on the edges of what a count, length, dimension or offset may be.
fn boundary_values(width: usize, file_len: usize) -> Vec<u64> {
    let mut v = vec![0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 31, 32, 33, 255, 256];
    v.extend([
        file_len as u64 - 1,
        file_len as u64,
        file_len as u64 + 1,
        file_len as u64 / 2,
    ]);
    v.extend([u32::MAX as u64, u32::MAX as u64 - 1, 1 << 31, 0x8000_0001]);
    if width == 8 {
        v.extend([
            u64::MAX,
            u64::MAX - 7,
            u64::MAX / 2,
            1 << 62,
            1 << 32,
            (1 << 40) + 32,
            i64::MAX as u64 + 1,
        ]);
    }
    v
}

// ---------------------------------------------------------------------------------------------------
// The check applied to every input.

struct Stats {
    ok: usize,
    errors: usize,
    max_ratio: f64,
}

/// Parses `bytes` (and, with `dequantize_all`, dequantizes every tensor): asserts no panic, typed
/// results, consistent accessors and bounded allocations.
fn check(bytes: Vec<u8>, dequantize_all: bool, label: &str, stats: &mut Stats) {
    let len = bytes.len();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        tracked(|| match GgufFile::from_bytes(bytes) {
            Ok(file) => {
                for t in file.tensors() {
                    let data = file.tensor_bytes(t);
                    assert_eq!(data.len() as u64, t.n_bytes(), "{label}: tensor {}", t.name);
                    assert!(file.data_offset() + t.offset + t.n_bytes() <= file.file_len());
                    assert_eq!(file.tensor_info(&t.name), Some(t));
                    if dequantize_all {
                        match file.dequantize(&t.name) {
                            Ok(values) => assert_eq!(values.len() as u64, t.n_elements()),
                            Err(GgufError::UnsupportedType { .. }) => {
                                assert!(!t.ggml_type.can_dequantize())
                            }
                            Err(e) => panic!("{label}: dequantize {} failed: {e}", t.name),
                        }
                    }
                }
                for (key, value) in file.metadata() {
                    assert!(
                        std::ptr::eq(file.get(key).unwrap(), value),
                        "{label}: key {key}"
                    );
                }
                Ok(())
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                Err(e)
            }
        })
    }));
    let (result, max_single, peak) = match outcome {
        Ok(r) => r,
        Err(_) => panic!("reader panicked on {label}"),
    };
    if result.is_ok() {
        stats.ok += 1;
    } else {
        stats.errors += 1;
    }
    // Dequantized output is sized by the (validated) element count of data that is in the file: at most
    // 4 bytes per element and 32 elements per byte (Q2_K packs ~3 elements per byte; 1-bit types are not
    // dequantized).
    let limit = 32 * len.max(64) + 4096;
    assert!(
        max_single <= limit,
        "{label}: single allocation of {max_single} bytes for a {len}-byte file"
    );
    let peak_limit = if dequantize_all {
        64 * len.max(64) + 65536
    } else {
        40 * len.max(64) + 65536
    };
    assert!(
        peak <= peak_limit,
        "{label}: {peak} live bytes for a {len}-byte file"
    );
    if len >= 4096 {
        stats.max_ratio = stats.max_ratio.max(max_single as f64 / len as f64);
    }
}

fn mutate_all(
    base: &[u8],
    header_end: usize,
    seed: u64,
    flips: usize,
    dequantize_all: bool,
    stats: &mut Stats,
) {
    let mut rng = Rng(seed);
    // Truncation at every point of the header, and at a sample of points in the data.
    let mut cuts: Vec<usize> = (0..header_end.min(4096)).collect();
    if header_end > 4096 {
        cuts.extend((0..300).map(|_| rng.below(header_end)));
    }
    cuts.extend((0..50).map(|_| header_end + rng.below(base.len() - header_end)));
    for cut in cuts {
        check(
            base[..cut].to_vec(),
            dequantize_all,
            &format!("truncated at {cut}"),
            stats,
        );
    }
    // Random byte flips, concentrated in the header.
    for i in 0..flips {
        let mut m = base.to_vec();
        let n_flips = 1 + rng.below(4);
        for _ in 0..n_flips {
            let at = if rng.below(8) == 0 {
                rng.below(m.len())
            } else {
                rng.below(header_end)
            };
            m[at] ^= 1 << rng.below(8);
        }
        if rng.below(4) == 0 {
            let cut = rng.below(m.len());
            m.truncate(cut);
        }
        check(m, dequantize_all, &format!("flip #{i}"), stats);
    }
    // Every count, length, type, dimension and offset overwritten with boundary values.
    let fields = header_fields(base);
    for (at, width, what) in fields.iter().filter(|(at, ..)| *at < header_end) {
        for value in boundary_values(*width, base.len()) {
            let mut m = base.to_vec();
            m[*at..*at + width].copy_from_slice(&value.to_le_bytes()[..*width]);
            check(
                m,
                dequantize_all,
                &format!("{what} at {at} = {value}"),
                stats,
            );
        }
    }
}

#[test]
fn mutated_and_truncated_files_never_panic_and_allocate_in_proportion() {
    // The allocation bound below rests on this size (one file byte can become one value).
    assert!(std::mem::size_of::<MetadataValue>() <= 32);
    let started = std::time::Instant::now();
    let mut stats = Stats {
        ok: 0,
        errors: 0,
        max_ratio: 0.0,
    };

    let synthetic = synthetic_gguf();
    let header_end = GgufFile::from_bytes(synthetic.clone())
        .unwrap()
        .data_offset() as usize;
    mutate_all(&synthetic, header_end, 1, 20_000, true, &mut stats);

    // The real Q4_K_M file: a 138 KB header (tokenizer arrays, chat template) and 4.8 MB of tensors.
    // Fewer iterations, each copies the whole file; dequantizing is left to the synthetic file.
    let real = std::fs::read(fixture_path("tiny-Q4_K_M.gguf")).unwrap();
    let real_header_end = GgufFile::from_bytes(real.clone()).unwrap().data_offset() as usize;
    let mut rng = Rng(2);
    for i in 0..1500 {
        let mut m = real.clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(real_header_end);
            m[at] ^= 1 << rng.below(8);
        }
        check(m, false, &format!("real flip #{i}"), &mut stats);
    }
    for i in 0..200 {
        let cut = rng.below(real.len());
        check(
            real[..cut].to_vec(),
            false,
            &format!("real truncated #{i} at {cut}"),
            &mut stats,
        );
    }
    let fields = header_fields(&real);
    // Header counts, the first metadata entries, the three big arrays' lengths, and the tensor infos of
    // the first and last tensors.
    let n_fields = fields.len();
    let real_fields: Vec<_> = fields
        .iter()
        .enumerate()
        .filter(|(i, (_, _, what))| *i < 40 || *i + 60 >= n_fields || what == "array length")
        .map(|(_, f)| f.clone())
        .collect();
    for (at, width, what) in real_fields {
        for value in [
            0u64,
            1,
            u32::MAX as u64,
            u64::MAX,
            1 << 62,
            real.len() as u64,
            real.len() as u64 + 32,
        ] {
            let mut m = real.clone();
            m[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
            check(
                m,
                false,
                &format!("real {what} at {at} = {value}"),
                &mut stats,
            );
        }
    }

    eprintln!(
        "robustness: {} inputs, {} parsed, {} typed errors, largest allocation {:.2}x the file (files of 4 KiB or more), {:.1}s",
        stats.ok + stats.errors,
        stats.ok,
        stats.errors,
        stats.max_ratio,
        started.elapsed().as_secs_f64()
    );
    assert!(
        stats.errors > 5000 && stats.ok > 100,
        "mutations should produce both outcomes"
    );
}
