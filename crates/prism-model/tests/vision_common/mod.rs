//! Shared helpers of the vision tests: the `qwen35-vl-tiny` fixture's paths and JSON, the tower loaded
//! once per test binary, and each image's pixel values from its resized PNG.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::Device;
use prism_gguf::GgufFile;
use prism_model::vision::VisionWeights;
use serde_json::Value;

// `common` has the same two helpers for `qwen35-tiny`; the vision tests keep their own for the vision
// fixture so that they do not depend on the text model's helpers.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-vl-tiny")
}

pub fn json(name: &str) -> Value {
    let path = dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn tower() -> &'static VisionWeights {
    static W: OnceLock<VisionWeights> = OnceLock::new();
    W.get_or_init(|| {
        let gguf = GgufFile::open(dir().join("mmproj-tiny-vl-F32.gguf")).unwrap();
        VisionWeights::load(&gguf, &Device::Cpu).unwrap()
    })
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("float array")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// An RGB PNG's bytes and size.
pub fn read_png(path: &std::path::Path) -> (Vec<u8>, usize, usize) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(
        (info.color_type, info.bit_depth),
        (png::ColorType::Rgb, png::BitDepth::Eight),
        "{}",
        path.display()
    );
    buf.truncate(info.buffer_size());
    (buf, info.height as usize, info.width as usize)
}

/// The processor's pixel values of an image already at its resized size (mean = std = 0.5, patch 16,
/// merge 2, 2 frames): rows in merge-window order, each `[channel][frame][y][x]`.
// The same loops as prism-decision's image preprocessing (src/vision.rs), which depends on this crate
// and so is out of its tests' reach; this copy fixes the fixture's numbers.
pub fn patchify(rgb: &[u8], height: usize, width: usize) -> (Vec<f32>, [usize; 3]) {
    let (p, m, t) = (16, 2, 2);
    let (gh, gw) = (height / p, width / p);
    let mut out = Vec::with_capacity(gh * gw * 3 * t * p * p);
    for wr in 0..gh / m {
        for wc in 0..gw / m {
            for r in 0..m {
                for c in 0..m {
                    let (py0, px0) = ((wr * m + r) * p, (wc * m + c) * p);
                    for ch in 0..3 {
                        for _ in 0..t {
                            for y in 0..p {
                                let line = ((py0 + y) * width + px0) * 3;
                                for x in 0..p {
                                    out.push((rgb[line + x * 3 + ch] as f32 - 127.5) / 127.5);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    (out, [1, gh, gw])
}

/// Image `name`'s pixel values and grid, checked against the processor's digest.
pub fn pixels(name: &str) -> (Vec<f32>, [usize; 3]) {
    let images = json("ref_images.json");
    let entry = &images["images"][name];
    let file = entry["resized_file"].as_str().unwrap();
    let (rgb, h, w) = read_png(&dir().join(file));
    let (values, grid) = patchify(&rgb, h, w);
    let want_grid: Vec<usize> = entry["grid_thw"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(grid.to_vec(), want_grid, "{name}");
    let digest = &entry["pixel_values"];
    let first = floats(&digest["first"]);
    // The JSON's floats have 7 significant digits.
    let d = max_abs_diff(&values[..first.len()], &first);
    assert!(d < 1e-6, "{name}: pixel values off by {d}");
    let sum: f64 = values.iter().map(|&v| v as f64).sum();
    let want = digest["sum"].as_f64().unwrap();
    assert!(
        (sum - want).abs() < 1e-6 * want.abs().max(1.0),
        "{name}: sum {sum} vs {want}"
    );
    (values, grid)
}

pub fn reference_embeddings(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir().join("vision").join(format!("{name}.f32"))).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
