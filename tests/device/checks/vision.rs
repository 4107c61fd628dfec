//! The Qwen3.5 vision tower on the GPU (`tests/fixtures/qwen35-vl-tiny`): its mmproj on CUDA against
//! the CPU on fixture images (and both against transformers' stored embeddings), the fixture's prompts
//! with images through the text model in f32 on CUDA against the CPU and against transformers' logits,
//! and the time per image of a real-shape tower (the 27B's, random weights from `prism synth`'s
//! writer) on a 640×352 frame (what a 640×360 video frame resizes to).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_gguf::GgufFile;
use prism_model::synth::SynthSize;
use prism_model::synth_vision::{write_mmproj_to, MmprojFileType, SynthVisionSpec};
use prism_model::vision::{image_embedding_rows, VisionWeights};
use prism_model::{BatchItem, EmbeddingRows, LoadOptions, Position3, Precision, Qwen35Model};
use serde_json::{json, Value};

use crate::harness::{fixtures, median_seconds, Report};

/// Environment variable naming the vision fixture's folder. Default: `qwen35-vl-tiny` next to the tiny
/// model's folder ([`fixtures`]).
pub const VL_FIXTURES_ENV: &str = "PRISM_DEVICE_VL_FIXTURES";

/// `<|image_pad|>` in the fixture's tokenizer.
const IMAGE_PAD: u32 = 4108;

/// The tower on CUDA against the CPU: ‖Δ‖/‖ref‖ bound (both f32; the GPU's matmuls and reductions sum
/// in other orders).
const TOWER_BOUND: f64 = 1e-4;
/// Logits, CUDA "f32" against CPU f32, ‖Δ‖/‖ref‖. On CUDA the flash-attention kernel reads q, k and v
/// (and keeps the K/V cache) in bf16 at every precision, so the GPU's f32 decoder is not f32 throughout:
/// the text-only prompt measured 2.4e-4 on an H200 (2026-12-02), the image prompts no more.
const LOGITS_BOUND: f64 = 1e-3;
/// Logits against transformers fp32, max |Δ|, on CUDA (the CPU meets issue #22's 1e-3 in CI; the GPU's
/// bf16 attention operands, above, measured 1.5e-3 on the text-only prompt).
const TRANSFORMERS_LOGITS_MAX: f64 = 5e-3;

fn vl_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(VL_FIXTURES_ENV) {
        return PathBuf::from(dir);
    }
    let tiny = fixtures();
    tiny.parent()
        .map(|p| p.join("qwen35-vl-tiny"))
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/qwen35-vl-tiny"))
}

fn read_json(dir: &Path, name: &str) -> Result<Value> {
    let path = dir.join(name);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// An 8-bit RGB PNG's bytes, height and width.
fn read_png(path: &Path) -> Result<(Vec<u8>, usize, usize)> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = png::Decoder::new(file)
        .read_info()
        .with_context(|| format!("decoding {}", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader
        .next_frame(&mut buf)
        .with_context(|| format!("decoding {}", path.display()))?;
    if (info.color_type, info.bit_depth) != (png::ColorType::Rgb, png::BitDepth::Eight) {
        bail!("{}: not an 8-bit RGB PNG", path.display());
    }
    buf.truncate(info.buffer_size());
    Ok((buf, info.height as usize, info.width as usize))
}

/// Image `name`'s pixel values and grid, from its resized PNG (`ref_images.json`'s `resized_file`,
/// whose pixels are exactly the processor's), the grid checked against the processor's.
fn pixels(dir: &Path, images: &Value, name: &str) -> Result<(Vec<f32>, [usize; 3])> {
    let entry = &images["images"][name];
    let file = entry["resized_file"]
        .as_str()
        .with_context(|| format!("ref_images.json: {name} has no resized_file"))?;
    let (rgb, h, w) = read_png(&dir.join(file))?;
    let (values, grid) = prism_decision::vision::patchify(
        &rgb,
        h,
        w,
        &prism_decision::vision::ImageConfig::default(),
    )?;
    let want: Vec<usize> = entry["grid_thw"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    if grid.to_vec() != want {
        bail!("{name}: grid {grid:?}, the processor's {want:?}");
    }
    Ok((values, grid))
}

/// transformers' merger output for image `name` (`vision/NAME.f32`), `[tokens, width]`.
fn reference_embeddings(dir: &Path, name: &str, width: usize) -> Result<Tensor> {
    let path = dir.join("vision").join(format!("{name}.f32"));
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let rows = values.len() / width;
    Ok(Tensor::from_vec(values, (rows, width), &Device::Cpu)?)
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

fn load_tower(dir: &Path, device: &Device) -> Result<VisionWeights> {
    let gguf =
        GgufFile::open(dir.join("mmproj-tiny-vl-F32.gguf")).context("the fixture's mmproj")?;
    Ok(VisionWeights::load(&gguf, device)?)
}

/// The fixture's tower on CUDA against the CPU on 3 images of different shapes (a square, a 640×360
/// JPEG frame, a portrait), and both against transformers.
pub fn tower_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let dir = vl_dir();
    let images = read_json(&dir, "ref_images.json")?;
    let cpu = load_tower(&dir, &Device::Cpu)?;
    let cuda = load_tower(&dir, gpu)?;
    let width = cpu.config.projection;
    for name in ["square", "wide", "tall"] {
        let (values, grid) = pixels(&dir, &images, name)?;
        let on_cpu = cpu.forward_pixels(&values, grid)?;
        let on_gpu = cuda.forward_pixels(&values, grid)?;
        let want = reference_embeddings(&dir, name, width)?;
        r.compare(
            &format!("vision tower {name} {grid:?}: CUDA vs CPU"),
            &on_gpu,
            &on_cpu,
            TOWER_BOUND,
        )?;
        let d_gpu = max_abs(&on_gpu, &want)?;
        let d_cpu = max_abs(&on_cpu, &want)?;
        r.check(
            &format!("vision tower {name}: vs transformers, max |Δ|"),
            &format!("CUDA {d_gpu:.3e}  CPU {d_cpu:.3e}  bound 1e-4"),
            d_gpu <= 1e-4,
            json!({"check": format!("vision tower {name} vs transformers"), "max_abs_cuda": d_gpu,
                   "max_abs_cpu": d_cpu, "bound": 1e-4, "ok": d_gpu <= 1e-4}),
        );
    }
    // The same image twice on the GPU: the same bits.
    let (values, grid) = pixels(&dir, &images, "wide")?;
    let a = cuda.forward_pixels(&values, grid)?;
    let b = cuda.forward_pixels(&values, grid)?;
    r.identical("vision tower wide on CUDA: run twice", &a, &b)?;
    // What the engine runs on a GPU: the block and merger products in bf16. Measured against
    // transformers relative to the embeddings' largest magnitude.
    let bf16 = load_tower(&dir, gpu)?.with_matrices(DType::BF16)?;
    for name in ["square", "wide", "tall"] {
        let (values, grid) = pixels(&dir, &images, name)?;
        let got = bf16.forward_pixels(&values, grid)?;
        let want = reference_embeddings(&dir, name, width)?;
        let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
        let rel = max_abs(&got, &want)? / scale;
        r.check(
            &format!(
                "vision tower {name}, bf16 products on CUDA: vs transformers, max |Δ| / max |ref|"
            ),
            &format!("{rel:.3e}  bound 2e-2"),
            rel <= 2e-2,
            json!({"check": format!("vision tower {name} bf16 vs transformers"), "max_rel": rel,
                   "bound": 2e-2, "ok": rel <= 2e-2}),
        );
    }
    // Frames of one size together (what the engine does with a request's same-size images): each
    // frame's rows as when it runs alone, within the products' rounding.
    let (f0, g0) = pixels(&dir, &images, "frame0")?;
    let (f1, _) = pixels(&dir, &images, "frame1")?;
    let both: Vec<f32> = f0.iter().chain(&f1).copied().collect();
    let together = bf16.forward_pixels(&both, [2, g0[1], g0[2]])?;
    let alone = Tensor::cat(
        &[bf16.forward_pixels(&f0, g0)?, bf16.forward_pixels(&f1, g0)?],
        0,
    )?;
    let scale = alone.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
    let rel = max_abs(&together, &alone)? / scale;
    r.check(
        "vision tower, bf16: two frames together vs each alone, max |Δ| / max",
        &format!("{rel:.3e}  bound 1e-2"),
        rel <= 1e-2,
        json!({"check": "vision tower bf16 frames together vs alone", "max_rel": rel, "bound": 1e-2,
               "ok": rel <= 1e-2}),
    );
    Ok(())
}

/// One reference prompt's inputs.
struct Prompt {
    name: String,
    tokens: Vec<u32>,
    positions: Option<Vec<Position3>>,
    images: Vec<String>,
    logits: Tensor,
}

fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().map(|x| x as u32))
        .collect()
}

fn prompts(dir: &Path) -> Result<Vec<Prompt>> {
    let refs = read_json(dir, "ref_prompts.json")?;
    refs["prompts"]
        .as_array()
        .context("ref_prompts.json: no prompts")?
        .iter()
        .map(|entry| -> Result<Prompt> {
            let name = entry["name"].as_str().unwrap_or("?").to_string();
            let tokens = ids(&entry["input_ids"]).with_context(|| format!("{name}: input_ids"))?;
            let positions = match entry["position_ids"].as_array() {
                None => None,
                Some(axes) => {
                    let axes: Vec<Vec<u32>> = axes
                        .iter()
                        .map(ids)
                        .collect::<Option<_>>()
                        .with_context(|| format!("{name}: position_ids"))?;
                    if axes.len() != 3 || axes.iter().any(|a| a.len() != tokens.len()) {
                        bail!("{name}: position_ids is not [3][tokens]");
                    }
                    Some(
                        (0..tokens.len())
                            .map(|i| [axes[0][i], axes[1][i], axes[2][i]])
                            .collect(),
                    )
                }
            };
            let images = entry["images"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            let logits: Vec<f32> = entry["last_logits"]
                .as_array()
                .with_context(|| format!("{name}: last_logits"))?
                .iter()
                .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
                .collect();
            let n = logits.len();
            Ok(Prompt {
                name,
                tokens,
                positions,
                images,
                logits: Tensor::from_vec(logits, n, &Device::Cpu)?,
            })
        })
        .collect()
}

/// An image's pixel values and patch grid, by name.
type PixelsOf<'a> = dyn Fn(&str) -> Result<(Vec<f32>, [usize; 3])> + 'a;

/// The last position's logits of `p` on `model`, its images run through `tower` (same device).
fn last_logits(
    model: &Qwen35Model,
    tower: &VisionWeights,
    p: &Prompt,
    pixels_of: &PixelsOf<'_>,
) -> Result<Tensor> {
    let embeddings = if p.images.is_empty() {
        None
    } else {
        let outs = p
            .images
            .iter()
            .map(|name| {
                let (values, grid) = pixels_of(name)?;
                Ok(tower.forward_pixels(&values, grid)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Some(image_embedding_rows(&p.tokens, IMAGE_PAD, &outs)?)
    };
    let mut state = model.new_state()?;
    let mut item = BatchItem::new(&mut state, &p.tokens);
    item.positions = p.positions.as_deref();
    item.embeddings = embeddings
        .as_ref()
        .map(|(rows, values)| EmbeddingRows { rows, values });
    let out = model.forward(&mut [item])?;
    let last = out.hidden.get(p.tokens.len() - 1)?.unsqueeze(0)?;
    Ok(model.logits(&last)?.squeeze(0)?.to_device(&Device::Cpu)?)
}

/// The fixture's 7 prompts (0, 1, 2 and 8 images) through the text model in f32, tower and decoder
/// on CUDA against both on the CPU, and against transformers' last-position logits.
pub fn prompt_checks(r: &mut Report, gpu: &Device) -> Result<()> {
    let dir = vl_dir();
    let images = read_json(&dir, "ref_images.json")?;
    let pixels_of = |name: &str| pixels(&dir, &images, name);
    let load = |device: &Device| -> Result<(Qwen35Model, VisionWeights)> {
        let options = LoadOptions {
            device: device.clone(),
            hf_config: Some(dir.join("config.json")),
            precision: Precision::F32,
            ..LoadOptions::default()
        };
        Ok((
            Qwen35Model::load(&dir.join("tiny-vl-BF16.gguf"), &options)?,
            load_tower(&dir, device)?,
        ))
    };
    let (cpu_model, cpu_tower) = load(&Device::Cpu)?;
    let (gpu_model, gpu_tower) = load(gpu)?;
    let mut worst = 0f64;
    for p in prompts(&dir)? {
        let on_cpu = last_logits(&cpu_model, &cpu_tower, &p, &pixels_of)?;
        let on_gpu = last_logits(&gpu_model, &gpu_tower, &p, &pixels_of)?;
        r.compare(
            &format!(
                "prompt {} ({} images) f32 logits: CUDA vs CPU",
                p.name,
                p.images.len()
            ),
            &on_gpu,
            &on_cpu,
            LOGITS_BOUND,
        )?;
        let d = max_abs(&on_gpu, &p.logits)?;
        worst = worst.max(d);
        let same = prism_model::argmax(&on_gpu)? == prism_model::argmax(&p.logits)?;
        r.check(
            &format!("prompt {} on CUDA vs transformers", p.name),
            &format!("max |Δ| {d:.3e}  bound {TRANSFORMERS_LOGITS_MAX:.0e}  same argmax {same}"),
            d <= TRANSFORMERS_LOGITS_MAX && same,
            json!({"check": format!("prompt {} on CUDA vs transformers", p.name), "max_abs": d,
                   "bound": TRANSFORMERS_LOGITS_MAX, "same_argmax": same,
                   "ok": d <= TRANSFORMERS_LOGITS_MAX && same}),
        );
    }
    r.note(
        "prompts with images on CUDA vs transformers: worst max |Δ|",
        json!(worst),
    );
    Ok(())
}

/// A real-shape tower (the 27B's: 27 blocks, width 1152, merger → 5120; random F16 weights as
/// `prism synth --mmproj` writes them) on CUDA with bf16 products (as the engine runs it): time per
/// 640×352 frame (880 patches, 220 tokens), for 8 frames one at a time and together, and one frame with
/// f32 products; output finite.
pub fn real_shape_timing(r: &mut Report, gpu: &Device) -> Result<()> {
    let spec = SynthVisionSpec::new(SynthSize::B27, MmprojFileType::F16, 0);
    let (bytes, _) = write_mmproj_to(Vec::new(), &spec, |_| {})?;
    let gguf = GgufFile::from_bytes(bytes)?;
    let f32_tower = VisionWeights::load(&gguf, gpu)?;
    drop(gguf);
    let tower = f32_tower.clone().with_matrices(DType::BF16)?;
    let grid = [1, 22, 40];
    let n = 22 * 40;
    let width = tower.config.patch_width();
    let frame: Vec<f32> = (0..n * width)
        .map(|i| ((i * 7919 % 256) as f32 - 127.5) / 127.5)
        .collect();
    let out = tower.forward_pixels(&frame, grid)?;
    let values: Vec<f32> = out.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?;
    let finite = values.iter().all(|v| v.is_finite());
    r.check(
        "27B-shape tower on one 640×352 frame: [220, 5120], finite",
        &format!("{:?}", out.dims()),
        finite && out.dims() == [220, 5120],
        json!({"check": "27B-shape tower output", "dims": out.dims(), "finite": finite,
               "ok": finite && out.dims() == [220, 5120]}),
    );
    let one = median_seconds(gpu, 5, || Ok(tower.forward_pixels(&frame, grid)?))?;
    r.note(
        "27B-shape tower on CUDA: ms per 640×352 frame (median of 5)",
        json!(one * 1e3),
    );
    let eight = median_seconds(gpu, 3, || {
        (0..8)
            .map(|_| Ok(tower.forward_pixels(&frame, grid)?))
            .collect::<Result<Vec<_>>>()
    })?;
    r.note(
        "27B-shape tower on CUDA: ms for 8 frames one at a time (median of 3)",
        json!(eight * 1e3),
    );
    let eight_frames: Vec<f32> = (0..8).flat_map(|_| frame.iter().copied()).collect();
    let together = median_seconds(gpu, 3, || {
        Ok(tower.forward_pixels(&eight_frames, [8, grid[1], grid[2]])?)
    })?;
    r.note(
        "27B-shape tower on CUDA: ms for 8 frames together (median of 3)",
        json!(together * 1e3),
    );
    let f32_one = median_seconds(gpu, 3, || Ok(f32_tower.forward_pixels(&frame, grid)?))?;
    r.note(
        "27B-shape tower on CUDA with f32 products: ms per frame (median of 3)",
        json!(f32_one * 1e3),
    );
    Ok(())
}
