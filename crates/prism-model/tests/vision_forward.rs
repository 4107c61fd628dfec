//! The vision tower's forward pass against transformers' `Qwen3_5VisionModel` in fp32
//! (`tests/fixtures/qwen35-vl-tiny`): every image's merger output (`vision/*.f32`) and, for `square` and
//! `small`, the first rows of every stage (`ref_vision.json`), within 1e-4; and the errors for a bad
//! grid or pixel shape.
//!
//! The input is each image's resized PNG (`resized/`, the processor's exact resize) patchified here as
//! `prism_decision::vision::patchify` does it (checked against `ref_images.json`'s pixel digest).

mod vision_common;

use candle_core::{Device, Tensor};
use prism_model::ModelError;
use vision_common::*;

const TOLERANCE: f32 = 1e-4;

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
