//! Image preprocessing for the Qwen3.5 vision tower (issue #22): the release's resize rule, the
//! normalization and the patch layout the tower reads, as transformers' `Qwen2VLImageProcessor` does
//! them (`tests/fixtures/qwen35-vl-tiny`, `ref_images.json`).
//!
//! An image becomes `pixel_values: [n_patches, 3 · T · P · P]` f32 (T the temporal patch, a still image
//! repeated T times; P the patch size) with `grid = (1, h / P, w / P)`; rows are the patches in
//! merge-window order (window row, window column, row in the window, column in the window), each row
//! channel-major, then the temporal copy, then the patch's pixel rows and columns.

use thiserror::Error;

/// Preprocessing settings (the processor config's `min_pixels`, `max_pixels`, `patch_size`,
/// `merge_size`, `temporal_patch_size`, `image_mean`, `image_std`).
// The processor config's fields; prism-model's `VisionConfig` has the tower's, alike in shape only.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Default for ImageConfig {
    /// Qwen3.5's: 65,536 to 1,048,576 pixels, patches of 16 merged 2 × 2, 2 temporal copies, mean and
    /// std 0.5.
    fn default() -> Self {
        Self {
            min_pixels: 65_536,
            max_pixels: 1_048_576,
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            mean: [0.5; 3],
            std: [0.5; 3],
        }
    }
}

impl ImageConfig {
    /// The side lengths are multiples of this (patch × merge: 32).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }
}

/// What is wrong with an image. (One variant a problem, each with its message: alike in shape only to
/// the other error enums.)
#[derive(Debug, Error, PartialEq)]
pub enum ImageError {
    #[error("the image is {width} × {height} pixels: both sides must be at least 1")]
    Empty { width: usize, height: usize },
    #[error("the image is {width} × {height} pixels: its aspect ratio is above 200")]
    AspectRatio { width: usize, height: usize },
    #[error("pixels: {got} bytes for a {width} × {height} RGB image ({want} expected)")]
    Pixels {
        width: usize,
        height: usize,
        got: usize,
        want: usize,
    },
    #[error("an image's {count} pad tokens from token {start} do not fit a prompt of {n_tokens} tokens in order")]
    Runs {
        start: usize,
        count: usize,
        n_tokens: usize,
    },
    #[error("patches need sides that are multiples of {factor}, not {width} × {height}")]
    NotAligned {
        width: usize,
        height: usize,
        factor: usize,
    },
}

/// The size an image of `height × width` is resized to: each side rounded to the nearest multiple of
/// the factor (halves to even, as Python's `round`), then scaled down to at most `max_pixels` (sides
/// floored to the factor) or up to at least `min_pixels` (sides ceiled), with the aspect ratio kept.
/// Returns `(height, width)`.
pub fn smart_resize(
    height: usize,
    width: usize,
    cfg: &ImageConfig,
) -> Result<(usize, usize), ImageError> {
    if height == 0 || width == 0 {
        return Err(ImageError::Empty { width, height });
    }
    if height.max(width) as f64 / height.min(width) as f64 > 200.0 {
        return Err(ImageError::AspectRatio { width, height });
    }
    let factor = cfg.factor() as f64;
    let (h, w) = (height as f64, width as f64);
    let round = |x: f64| (x / factor).round_ties_even() * factor;
    let (mut h_bar, mut w_bar) = (round(h).max(factor), round(w).max(factor));
    if h_bar * w_bar > cfg.max_pixels as f64 {
        let beta = (h * w / cfg.max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / factor).floor() * factor);
        w_bar = factor.max((w / beta / factor).floor() * factor);
    } else if h_bar * w_bar < cfg.min_pixels as f64 {
        let beta = (cfg.min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / factor).ceil() * factor;
        w_bar = (w * beta / factor).ceil() * factor;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// The patches of an RGB image already at its resized size (`rgb`: `height · width · 3` bytes, rows
/// top to bottom; sides multiples of the factor): `(pixel_values, [1, height / P, width / P])`, each
/// value `(byte − 255 · mean) / (255 · std)` in f32, the processor's rescale and normalization fused
/// as it computes them (bit for bit the fixture's `pixel_values`).
pub fn patchify(
    rgb: &[u8],
    height: usize,
    width: usize,
    cfg: &ImageConfig,
) -> Result<(Vec<f32>, [usize; 3]), ImageError> {
    let want = height * width * 3;
    if rgb.len() != want {
        return Err(ImageError::Pixels {
            width,
            height,
            got: rgb.len(),
            want,
        });
    }
    let factor = cfg.factor();
    if height == 0 || width == 0 || height % factor != 0 || width % factor != 0 {
        return Err(ImageError::NotAligned {
            width,
            height,
            factor,
        });
    }
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let row_len = 3 * t * p * p;
    let mut out = Vec::with_capacity(gh * gw * row_len);
    for wr in 0..gh / m {
        for wc in 0..gw / m {
            for r in 0..m {
                for c in 0..m {
                    let (py0, px0) = ((wr * m + r) * p, (wc * m + c) * p);
                    for ch in 0..3 {
                        let (mean, std) = (cfg.mean[ch] * 255.0, cfg.std[ch] * 255.0);
                        for _ in 0..t {
                            for y in 0..p {
                                let line = ((py0 + y) * width + px0) * 3;
                                for x in 0..p {
                                    let byte = rgb[line + x * 3 + ch];
                                    out.push((byte as f32 - mean) / std);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok((out, [1, gh, gw]))
}

/// Fixed-point bits of the resize coefficients (PIL's `PRECISION_BITS` for 8-bit images).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The bicubic kernel with a = −0.5 (PIL's and torchvision's antialiased bicubic).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each of `out_size` outputs along one axis of `in_size` inputs: the first input it reads and its
/// fixed-point weights (antialiased: the kernel widened by the downscale factor, normalized to sum 1).
fn coefficients(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i64>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    (0..out_size)
        .map(|x| {
            let center = (x as f64 + 0.5) * scale;
            let first = ((center - support + 0.5).floor().max(0.0)) as usize;
            let last = ((center + support + 0.5).floor() as usize).min(in_size);
            let weights: Vec<f64> = (first..last)
                .map(|j| bicubic((j as f64 - center + 0.5) / filter_scale))
                .collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { 0.0 }
                        * (1i64 << PRECISION_BITS) as f64;
                    if w < 0.0 {
                        (w - 0.5) as i64
                    } else {
                        (w + 0.5) as i64
                    }
                })
                .collect();
            (first, fixed)
        })
        .collect()
}

/// One separable pass of the resize on interleaved RGB bytes: `lines` lines of `len` pixels each,
/// neighbours `step` pixels apart along the axis and lines `stride` pixels apart.
fn resample_axis(
    src: &[u8],
    (lines, line_stride): (usize, usize),
    (in_len, step): (usize, usize),
    out_len: usize,
) -> Vec<u8> {
    let coeffs = coefficients(in_len, out_len);
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; lines * out_len * 3];
    for line in 0..lines {
        for (o, (first, weights)) in coeffs.iter().enumerate() {
            for ch in 0..3 {
                let mut acc = half;
                for (j, &w) in weights.iter().enumerate() {
                    let at = (line * line_stride + (first + j) * step) * 3 + ch;
                    acc += src[at] as i64 * w;
                }
                out[(line * out_len + o) * 3 + ch] = (acc >> PRECISION_BITS).clamp(0, 255) as u8;
            }
        }
    }
    out
}

/// Resizes interleaved RGB bytes (`height · width · 3`) to `new_height × new_width` with the antialiased
/// bicubic filter in 8-bit fixed point, width first, as PIL's `Image.resize(..., BICUBIC)`: within one
/// level of transformers' torchvision resize on the fixture's images.
pub fn resize_rgb(
    rgb: &[u8],
    height: usize,
    width: usize,
    new_height: usize,
    new_width: usize,
) -> Result<Vec<u8>, ImageError> {
    if rgb.len() != height * width * 3 {
        return Err(ImageError::Pixels {
            width,
            height,
            got: rgb.len(),
            want: height * width * 3,
        });
    }
    if height == 0 || width == 0 {
        return Err(ImageError::Empty { width, height });
    }
    if new_height == 0 || new_width == 0 {
        return Err(ImageError::Empty {
            width: new_width,
            height: new_height,
        });
    }
    let horizontal = if new_width == width {
        rgb.to_vec()
    } else {
        resample_axis(rgb, (height, width), (width, 1), new_width)
    };
    if new_height == height {
        return Ok(horizontal);
    }
    // Vertical: lines are columns (one pixel apart), neighbours a row apart; written column-major, then
    // transposed back to rows.
    let cols = resample_axis(&horizontal, (new_width, 1), (height, new_width), new_height);
    let mut out = vec![0u8; new_height * new_width * 3];
    for x in 0..new_width {
        for y in 0..new_height {
            let (src, dst) = ((x * new_height + y) * 3, (y * new_width + x) * 3);
            out[dst..dst + 3].copy_from_slice(&cols[src..src + 3]);
        }
    }
    Ok(out)
}

/// One image's pad tokens in a prompt: `count` tokens from token index `start`, one per merged patch of a
/// `rows × cols` merged grid (`count == rows · cols`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageRun {
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
}

/// The 3-axis M-RoPE positions (temporal, height, width) of a prompt of `n_tokens` tokens with image pad
/// runs `runs` (in order, not overlapping), and the position its next token takes. A text token at
/// running position `p` gets `(p, p, p)` and `p` grows by one; an image whose run starts at `p` gives its
/// merged patch at row `r`, column `c` the position `(p, p + r, p + c)`, and `p` then grows by
/// `max(rows, cols)`: transformers' `get_rope_index` for still images.
pub fn mrope_positions(
    n_tokens: usize,
    runs: &[ImageRun],
) -> Result<(Vec<prism_model::Position3>, u32), ImageError> {
    let mut out = Vec::with_capacity(n_tokens);
    let mut p: u32 = 0;
    let mut at = 0;
    for run in runs {
        let count = run.rows * run.cols;
        if run.start < at || run.start + count > n_tokens || count == 0 {
            return Err(ImageError::Runs {
                start: run.start,
                count,
                n_tokens,
            });
        }
        for _ in at..run.start {
            out.push([p, p, p]);
            p += 1;
        }
        for r in 0..run.rows as u32 {
            for c in 0..run.cols as u32 {
                out.push([p, p + r, p + c]);
            }
        }
        p += run.rows.max(run.cols) as u32;
        at = run.start + count;
    }
    for _ in at..n_tokens {
        out.push([p, p, p]);
        p += 1;
    }
    Ok((out, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_rounds_halves_to_even_and_clamps_the_area() {
        let cfg = ImageConfig::default();
        // 336 × 400: 10.5 and 12.5 factors round to 10 and 12.
        assert_eq!(smart_resize(400, 336, &cfg), Ok((384, 320)));
        // Below the minimum: ceil; above the maximum: floor.
        assert_eq!(smart_resize(90, 120, &cfg), Ok((224, 320)));
        assert_eq!(smart_resize(1000, 1500, &cfg), Ok((832, 1248)));
        assert_eq!(
            smart_resize(1, 201, &cfg),
            Err(ImageError::AspectRatio {
                width: 201,
                height: 1
            })
        );
        assert!(smart_resize(0, 5, &cfg).is_err());
    }

    #[test]
    fn patch_rows_follow_the_merge_windows() {
        let cfg = ImageConfig::default();
        // A 32 × 64 image whose byte is its column's patch index in the red channel.
        let (h, w) = (32, 64);
        let mut rgb = vec![0u8; h * w * 3];
        for y in 0..h {
            for x in 0..w {
                rgb[(y * w + x) * 3] = ((y / 16) * 4 + x / 16) as u8;
            }
        }
        let (values, grid) = patchify(&rgb, h, w, &cfg).unwrap();
        assert_eq!(grid, [1, 2, 4]);
        let row_len = 3 * 2 * 16 * 16;
        let first_red: Vec<u8> = values
            .chunks(row_len)
            .map(|row| (row[0] * 127.5 + 127.5).round() as u8)
            .collect();
        // Windows (0,0) and (0,1), each 2 × 2 patches in raster order.
        assert_eq!(first_red, [0, 1, 4, 5, 2, 3, 6, 7]);
        assert!(patchify(&rgb, 32, 48, &cfg).is_err());
        // A resize to nothing names the size asked for.
        assert_eq!(
            resize_rgb(&rgb, h, w, 0, 5),
            Err(ImageError::Empty {
                width: 5,
                height: 0
            })
        );
        assert_eq!(resize_rgb(&rgb, h, w, h, w).as_deref(), Ok(&rgb[..]));
        assert!(patchify(&rgb[1..], h, w, &cfg).is_err());
    }
}
