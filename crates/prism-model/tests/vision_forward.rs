//! The vision tower's forward pass against transformers' `Qwen3_5VisionModel` in fp32
//! (`tests/fixtures/qwen35-vl-tiny`): every image's merger output (`vision/*.f32`) and, for `square` and
//! `small`, the first rows of every stage (`ref_vision.json`), within 1e-4; and the errors for a bad
//! grid or pixel shape.
//!
//! The input is each image's resized PNG (`resized/`, the processor's exact resize) patchified here as
//! `prism_decision::vision::patchify` does it (checked against `ref_images.json`'s pixel digest).

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use prism_gguf::GgufFile;
use prism_model::vision::VisionWeights;
use prism_model::ModelError;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-vl-tiny")
}

fn json(name: &str) -> Value {
    let path = dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tower() -> &'static VisionWeights {
    static W: OnceLock<VisionWeights> = OnceLock::new();
    W.get_or_init(|| {
        let gguf = GgufFile::open(dir().join("mmproj-tiny-vl-F32.gguf")).unwrap();
        VisionWeights::load(&gguf, &Device::Cpu).unwrap()
    })
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("float array")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// An RGB PNG's bytes and size.
fn read_png(path: &std::path::Path) -> (Vec<u8>, usize, usize) {
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
fn patchify(rgb: &[u8], height: usize, width: usize) -> (Vec<f32>, [usize; 3]) {
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
fn pixels(name: &str) -> (Vec<f32>, [usize; 3]) {
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

fn reference_embeddings(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir().join("vision").join(format!("{name}.f32"))).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn every_fixture_image_matches_transformers() {
    let reference = json("ref_vision.json");
    let images = reference["images"].as_object().unwrap();
    assert_eq!(images.len(), 14);
    let mut worst = 0f32;
    for (name, entry) in images {
        let (values, grid) = pixels(name);
        let out = tower().forward_pixels(&values, grid).unwrap();
        let shape: Vec<usize> = entry["embeddings"]["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(out.dims(), &shape[..], "{name}");
        assert_eq!(
            tower().config.output_tokens(grid).unwrap(),
            entry["n_tokens"].as_u64().unwrap() as usize
        );
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let d = max_abs_diff(&got, &reference_embeddings(name));
        eprintln!("{name} {grid:?}: max |Δ| {d:.3e}");
        worst = worst.max(d);
        assert!(d <= TOLERANCE, "{name}: max |Δ| {d} > {TOLERANCE}");
    }
    eprintln!("all 14 images: max |Δ| {worst:.3e}");
}

#[test]
fn every_stage_matches_transformers_on_square_and_small() {
    let reference = json("ref_vision.json");
    for name in ["square", "small"] {
        let entry = &reference["images"][name];
        let stages = &entry["stages_first_rows"];
        let rows = entry["stages_first_rows_shape"][0].as_u64().unwrap() as usize;
        let (values, grid) = pixels(name);
        let n = values.len() / 1536;
        let pixels = Tensor::from_vec(values, (n, 1536), &Device::Cpu).unwrap();
        let (_, trace) = tower().forward_traced(&pixels, grid).unwrap();
        let mut ours = vec![
            ("patch_embed", trace.patch_embed),
            ("pos_added", trace.with_positions),
        ];
        for (i, b) in trace.blocks.into_iter().enumerate() {
            ours.push((["block0", "block1", "block2"][i], b));
        }
        ours.push(("merger_norm", trace.merger_norm));
        for (stage, t) in ours {
            let got = t
                .narrow(0, 0, rows)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let d = max_abs_diff(&got, &floats(&stages[stage]));
            eprintln!("{name} {stage}: max |Δ| {d:.3e}");
            assert!(d <= TOLERANCE, "{name} {stage}: max |Δ| {d} > {TOLERANCE}");
        }
    }
}

#[test]
fn a_bad_grid_or_pixel_shape_is_refused() {
    let w = tower();
    let zeros = Tensor::zeros((16, 1536), candle_core::DType::F32, &Device::Cpu).unwrap();
    for grid in [[1, 4, 3], [0, 4, 4], [1, 0, 2]] {
        assert!(
            matches!(w.forward(&zeros, grid), Err(ModelError::ImageGrid { .. })),
            "{grid:?}"
        );
    }
    match w.forward(&zeros, [1, 4, 2]) {
        Err(ModelError::ImagePixels {
            expected, found, ..
        }) => {
            assert_eq!((expected, found), ([8, 1536], vec![16, 1536]))
        }
        other => panic!("{other:?}"),
    }
    let narrow = Tensor::zeros((16, 768), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        w.forward(&narrow, [1, 4, 4]),
        Err(ModelError::ImagePixels { .. })
    ));
    assert!(matches!(
        w.forward_pixels(&[0.0; 100], [1, 2, 2]),
        Err(ModelError::ImagePixels { .. })
    ));
    // Two frames of the same image: each frame's tokens are that image's (frames attend only to
    // themselves).
    let (values, grid) = pixels("small");
    let one = w.forward_pixels(&values, grid).unwrap();
    let two: Vec<f32> = values.iter().chain(&values).copied().collect();
    let both = w.forward_pixels(&two, [2, grid[1], grid[2]]).unwrap();
    let n = one.dim(0).unwrap();
    assert_eq!(both.dim(0).unwrap(), 2 * n);
    for f in 0..2 {
        let d = (both.narrow(0, f * n, n).unwrap() - &one)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "frame {f}: {d}");
    }
}
