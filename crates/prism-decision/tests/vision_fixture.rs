//! Image preprocessing against transformers' image processor (`tests/fixtures/qwen35-vl-tiny`,
//! `ref_images.json`, made by `tools/make_vision_fixture.py`): the resized size and patch grid of all
//! 14 test images, the decoded pixels of the lossless ones, the bicubic resize, and the pixel values of
//! every resized image.

use std::path::PathBuf;

use prism_decision::vision::{
    mrope_positions, patchify, resize_rgb, smart_resize, ImageConfig, ImageRun,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-vl-tiny")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture().join("ref_images.json")).expect("ref_images.json");
    serde_json::from_str(&text).expect("ref_images.json parses")
}

/// RGB bytes of an image file (grayscale widened to RGB, as PIL's `convert("RGB")`).
fn rgb(file: &str) -> (Vec<u8>, usize, usize) {
    let img = image::open(fixture().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let img = img.to_rgb8();
    let (w, h) = img.dimensions();
    (img.into_raw(), h as usize, w as usize)
}

fn usize_of(v: &Value) -> usize {
    v.as_u64().expect("an integer") as usize
}

#[test]
fn the_config_is_the_processors() {
    let r = reference();
    let c = &r["config"];
    let cfg = ImageConfig::default();
    assert_eq!(usize_of(&c["min_pixels"]), cfg.min_pixels);
    assert_eq!(usize_of(&c["max_pixels"]), cfg.max_pixels);
    assert_eq!(usize_of(&c["patch_size"]), cfg.patch_size);
    assert_eq!(usize_of(&c["merge_size"]), cfg.merge_size);
    assert_eq!(usize_of(&c["temporal_patch_size"]), cfg.temporal_patch_size);
    assert_eq!(usize_of(&c["factor"]), cfg.factor());
    for i in 0..3 {
        assert_eq!(c["image_mean"][i].as_f64(), Some(cfg.mean[i] as f64));
        assert_eq!(c["image_std"][i].as_f64(), Some(cfg.std[i] as f64));
    }
}

#[test]
fn resized_sizes_and_grids_equal_the_processors() {
    let r = reference();
    let cfg = ImageConfig::default();
    let images = r["images"].as_object().expect("images");
    assert_eq!(images.len(), 14);
    for (name, x) in images {
        let (h, w) = smart_resize(usize_of(&x["height"]), usize_of(&x["width"]), &cfg).unwrap();
        assert_eq!(
            (h, w),
            (
                usize_of(&x["resized_height"]),
                usize_of(&x["resized_width"])
            ),
            "{name}"
        );
        let grid: Vec<usize> = x["grid_thw"]
            .as_array()
            .unwrap()
            .iter()
            .map(usize_of)
            .collect();
        assert_eq!(grid, [1, h / 16, w / 16], "{name}");
        assert_eq!(usize_of(&x["n_tokens"]), h / 32 * (w / 32), "{name}");
    }
}

#[test]
fn lossless_images_decode_to_the_same_pixels() {
    let r = reference();
    for (name, x) in r["images"].as_object().unwrap() {
        let file = x["file"].as_str().unwrap();
        if !file.ends_with(".png") {
            continue; // JPEG decoders may differ by a level; the resize is checked on resized/ below.
        }
        let (bytes, h, w) = rgb(file);
        assert_eq!(
            (h, w),
            (usize_of(&x["height"]), usize_of(&x["width"])),
            "{name}"
        );
        let sum: u64 = bytes.iter().map(|&b| b as u64).sum();
        assert_eq!(sum, x["decoded_rgb_sum"].as_u64().unwrap(), "{name}");
        let digest = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(digest, x["decoded_rgb_sha256"].as_str().unwrap(), "{name}");
    }
}

#[test]
fn pixel_values_of_the_resized_images_equal_the_processors() {
    let r = reference();
    let cfg = ImageConfig::default();
    for (name, x) in r["images"].as_object().unwrap() {
        // The fixture checked that the processor's values are the resized PNG normalized as
        // `(byte − 127.5) / 127.5` in f32, bit for bit: what `patchify` computes.
        assert_eq!(
            x["pixel_values_equal_normalized_resized_file"], true,
            "{name}"
        );
        let (bytes, h, w) = rgb(x["resized_file"].as_str().unwrap());
        let (values, grid) = patchify(&bytes, h, w, &cfg).unwrap();
        let pv = &x["pixel_values"];
        let shape: Vec<usize> = pv["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(usize_of)
            .collect();
        assert_eq!(shape, [values.len() / 1536, 1536], "{name}");
        assert_eq!(grid[1] * grid[2], shape[0], "{name}");
        let sum: f64 = values.iter().map(|&v| v as f64).sum();
        let sum_sq: f64 = values.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let want_sum = pv["sum"].as_f64().unwrap();
        let want_sq = pv["sum_sq"].as_f64().unwrap();
        assert!(
            (sum - want_sum).abs() <= 1e-9 * want_sq.max(1.0),
            "{name}: sum {sum} vs {want_sum}"
        );
        assert!(
            (sum_sq - want_sq).abs() <= 1e-9 * want_sq,
            "{name}: sum of squares {sum_sq} vs {want_sq}"
        );
        let abs_max = values.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        assert_eq!(abs_max, pv["abs_max"].as_f64().unwrap(), "{name}");
        // The listed values (7 significant digits in the JSON).
        let close = |got: f32, want: &Value| (got as f64 - want.as_f64().unwrap()).abs() <= 1e-6;
        for (i, want) in pv["first"].as_array().unwrap().iter().enumerate() {
            assert!(
                close(values[i], want),
                "{name}: value {i}: {} vs {want}",
                values[i]
            );
        }
        let stride = usize_of(&pv["sample_stride"]);
        for (j, want) in pv["sample"].as_array().unwrap().iter().enumerate() {
            let i = j * stride;
            assert!(
                close(values[i], want),
                "{name}: value {i}: {} vs {want}",
                values[i]
            );
        }
    }
}

#[test]
fn resized_images_are_within_a_level_of_the_processors() {
    let r = reference();
    for (name, x) in r["images"].as_object().unwrap() {
        let (src, h, w) = rgb(x["file"].as_str().unwrap());
        let (want, nh, nw) = rgb(x["resized_file"].as_str().unwrap());
        let got = resize_rgb(&src, h, w, nh, nw).unwrap();
        let (mut max, mut total) = (0u32, 0u64);
        for (a, b) in got.iter().zip(&want) {
            let d = (*a as i32 - *b as i32).unsigned_abs();
            max = max.max(d);
            total += d as u64;
        }
        let mean = total as f64 / want.len() as f64;
        eprintln!("{name}: max {max} mean {mean:.4}");
        // PIL's bicubic, which this follows, is itself within one level of the processor's (the
        // fixture's `pil_backend_max_abs_diff`). The JPEG's pixels differ before the resize (another
        // decoder than PIL's libjpeg), so it gets more room.
        let jpeg = x["file"].as_str().unwrap().ends_with(".jpg");
        let (max_ok, mean_ok) = if jpeg { (4, 0.05) } else { (1, 0.001) };
        assert!(
            max <= max_ok && mean <= mean_ok,
            "{name}: max {max} levels, mean {mean}"
        );
    }
}

#[test]
fn mrope_positions_equal_transformers_for_0_1_2_and_8_images() {
    let text =
        std::fs::read_to_string(fixture().join("ref_prompts.json")).expect("ref_prompts.json");
    let r: Value = serde_json::from_str(&text).unwrap();
    let prompts = r["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 7);
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let n = usize_of(&p["n_tokens"]);
        let grids = p["image_grid_thw"].as_array().cloned().unwrap_or_default();
        let pads = p["image_pad_runs"].as_array().cloned().unwrap_or_default();
        assert_eq!(grids.len(), pads.len(), "{name}");
        let runs: Vec<ImageRun> = pads
            .iter()
            .zip(&grids)
            .map(|(pad, g)| {
                let run = ImageRun {
                    start: usize_of(&pad["start"]),
                    rows: usize_of(&g[1]) / 2,
                    cols: usize_of(&g[2]) / 2,
                };
                assert_eq!(run.rows * run.cols, usize_of(&pad["count"]), "{name}");
                run
            })
            .collect();
        let (positions, next) = mrope_positions(n, &runs).unwrap();
        for axis in 0..3 {
            // A prompt without images has no position ids in the reference: its text positions.
            let w: Vec<u32> = match p["position_ids"].as_array() {
                Some(want) => want[axis]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect(),
                None => (0..n as u32).collect(),
            };
            let got: Vec<u32> = positions.iter().map(|q| q[axis]).collect();
            assert_eq!(got, w, "{name}: axis {axis}");
        }
        assert_eq!(next as u64, p["next_position"].as_u64().unwrap(), "{name}");
        assert_eq!(
            next as i64 - n as i64,
            p["rope_delta"].as_i64().unwrap_or(0),
            "{name}: rope delta"
        );
    }
    // A run out of order or past the end is refused.
    let run = ImageRun {
        start: 5,
        rows: 2,
        cols: 2,
    };
    assert!(mrope_positions(8, &[run]).is_err());
    assert!(mrope_positions(20, &[run, run]).is_err());
}
