//! Request images, from what the client sent to what the vision tower reads (issue #22, spec §2–§3).
//!
//! An image arrives as a base64 string or a `data:` URI (the JSON `images` list, or an SDK asset's
//! `data_base64`) or as raw bytes (a multipart part named by an SDK asset). [`decode_image`] then:
//! 1. refuses more than [`ImageLimits::max_bytes`] encoded bytes, before decoding any base64;
//! 2. reads the header only (format by signature: PNG, JPEG, WebP, GIF) and refuses a side above
//!    [`ImageLimits::max_side`] or more than [`ImageLimits::max_pixels`] pixels *before* the pixels are
//!    decoded, and decodes with the `image` crate's allocation limit as a second guard, so a crafted
//!    image (a tiny file claiming 65,535 × 65,535 pixels) cannot exhaust memory;
//! 3. decodes to 8-bit RGB (grayscale replicated, alpha dropped, a GIF's first frame);
//! 4. resizes by the release's rule ([`crate::vision::smart_resize`], [`crate::vision::resize_rgb`]) and
//!    normalizes into patches ([`crate::vision::patchify`]).
//!
//! Every error names the image's field path (`images[i]`, or `assets.<placeholder>`): undecodable data is
//! a 400 ([`ErrorClass::BadData`]), an image beyond the limits a 422.

use std::io::Cursor;
use std::sync::Arc;

use base64::Engine as _;
use sha2::{Digest, Sha256};

use crate::error::{FieldError, FieldPath};
use crate::vision::{patchify, resize_rgb, smart_resize, ImageConfig};

/// What the client sent for one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageData {
    /// A base64 string, or a `data:[<media type>];base64,<data>` URI (not decoded yet).
    Encoded(String),
    /// The image file's bytes (a multipart part).
    Bytes(Arc<[u8]>),
}

/// One image of a request and where it came from in the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestImage {
    pub data: ImageData,
    /// The field that holds it (`images[i]` or `assets.<placeholder>`): what errors name.
    pub path: FieldPath,
}

/// Bounds on one image, checked before its pixels are decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Most bytes of the image file (after base64 decoding).
    pub max_bytes: usize,
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Most pixels (width × height) of the decoded image.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// 32 MiB files, sides up to 16,384 and 50 megapixels (150 MB of RGB at most): above any camera
    /// frame, far below what exhausts a server.
    fn default() -> Self {
        ImageLimits {
            max_bytes: 32 << 20,
            max_side: 16_384,
            max_pixels: 50_000_000,
        }
    }
}

/// An image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedImage {
    /// Size of the decoded image.
    pub width: usize,
    pub height: usize,
    /// The patches the tower reads: `[grid[0] · grid[1] · grid[2], 3 · T · P · P]` in merge-window
    /// order ([`patchify`]).
    pub pixels: Vec<f32>,
    /// `(1, h / P, w / P)` of the resized image.
    pub grid: [usize; 3],
    /// Merged rows and columns (`h / (P · merge)`, `w / (P · merge)`): the image's pad tokens are
    /// `rows · cols` in raster order.
    pub rows: usize,
    pub cols: usize,
    /// SHA-256 of the image file's bytes: what the prefix cache keys image-bearing evidence on.
    pub sha256: [u8; 32],
}

impl DecodedImage {
    /// The image's pad tokens in a prompt (one per merged patch).
    pub fn tokens(&self) -> usize {
        self.rows * self.cols
    }
}

/// The image file's bytes from a base64 string or a data URI (whitespace ignored, padding optional).
/// Refuses, before decoding, data longer than `max_bytes` would need.
pub fn image_bytes(
    data: &ImageData,
    path: &FieldPath,
    max_bytes: usize,
) -> Result<Arc<[u8]>, FieldError> {
    let text = match data {
        ImageData::Bytes(bytes) => {
            if bytes.len() > max_bytes {
                return Err(too_large(path, bytes.len(), max_bytes));
            }
            return Ok(bytes.clone());
        }
        ImageData::Encoded(text) => text.trim(),
    };
    let payload = if let Some(rest) = strip_prefix_ignore_case(text, "data:") {
        let Some((header, payload)) = rest.split_once(',') else {
            return Err(bad_data(
                path,
                "image_data_uri",
                "a data URI needs a comma before its data (data:image/png;base64,...)",
            ));
        };
        if !header
            .split(';')
            .any(|p| p.trim().eq_ignore_ascii_case("base64"))
        {
            return Err(bad_data(
                path,
                "image_data_uri",
                "a data URI must be base64-encoded (data:image/png;base64,...)",
            ));
        }
        payload
    } else {
        text
    };
    let compact: Vec<u8> = payload
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    // 4 base64 characters make at most 3 bytes.
    let at_most = compact.len() / 4 * 3 + 3;
    if at_most > max_bytes.saturating_add(3) {
        return Err(too_large(path, compact.len() / 4 * 3, max_bytes));
    }
    if compact.is_empty() {
        return Err(bad_data(path, "image_empty", "the image data is empty"));
    }
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let bytes = engine.decode(&compact).map_err(|e| {
        bad_data(
            path,
            "image_base64",
            format!("not valid base64 (a base64 string or a data URI is expected): {e}"),
        )
    })?;
    if bytes.len() > max_bytes {
        return Err(too_large(path, bytes.len(), max_bytes));
    }
    Ok(bytes.into())
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &text[prefix.len()..])
}

fn bad_data(path: &FieldPath, code: &'static str, message: impl Into<String>) -> FieldError {
    FieldError::bad_data(path.clone(), code, message)
}

fn too_large(path: &FieldPath, bytes: usize, max: usize) -> FieldError {
    FieldError::unanswerable(
        path.clone(),
        "image_too_large",
        format!("the image file has {bytes} bytes, more than this server's limit of {max}"),
    )
}

/// Decodes one request image and prepares it for the tower (see the module's steps). `cfg` is the
/// model's preprocessing.
pub fn decode_image(
    image: &RequestImage,
    cfg: &ImageConfig,
    limits: &ImageLimits,
) -> Result<DecodedImage, FieldError> {
    let path = &image.path;
    let bytes = image_bytes(&image.data, path, limits.max_bytes)?;
    let sha256: [u8; 32] = Sha256::digest(&bytes).into();
    let reader = || -> Result<image::io::Reader<Cursor<&[u8]>>, FieldError> {
        let reader = image::io::Reader::new(Cursor::new(&bytes[..]))
            .with_guessed_format()
            .map_err(|e| bad_data(path, "image_invalid", format!("cannot read the image: {e}")))?;
        match reader.format() {
            Some(
                image::ImageFormat::Png
                | image::ImageFormat::Jpeg
                | image::ImageFormat::WebP
                | image::ImageFormat::Gif,
            ) => Ok(reader),
            Some(other) => Err(bad_data(
                path,
                "image_format",
                format!("{other:?} images are not accepted: send PNG, JPEG, WebP or GIF"),
            )),
            None => Err(bad_data(
                path,
                "image_format",
                "not an image this server reads: send PNG, JPEG, WebP or GIF",
            )),
        }
    };
    // The header first: the size is checked before a single pixel is decoded.
    let (width, height) = reader()?.into_dimensions().map_err(|e| {
        bad_data(
            path,
            "image_invalid",
            format!("cannot read the image's header: {e}"),
        )
    })?;
    check_size(path, width, height, limits)?;
    let mut reader = reader()?;
    let mut decode_limits = image::io::Limits::default();
    decode_limits.max_image_width = Some(limits.max_side);
    decode_limits.max_image_height = Some(limits.max_side);
    // RGBA at 16 bits a channel, plus the decoder's own buffers.
    decode_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    reader.limits(decode_limits);
    let decoded = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(e) => FieldError::unanswerable(
            path.clone(),
            "image_too_large",
            format!("the image exceeds this server's decoding limits: {e}"),
        ),
        other => bad_data(
            path,
            "image_invalid",
            format!("cannot decode the image: {other}"),
        ),
    })?;
    check_size(path, decoded.width(), decoded.height(), limits)?;
    let rgb = decoded.to_rgb8();
    let (width, height) = (rgb.width() as usize, rgb.height() as usize);
    let rgb = rgb.into_raw();
    let unanswerable = |e: crate::vision::ImageError| {
        FieldError::unanswerable(path.clone(), "image_size", e.to_string())
    };
    let (new_height, new_width) = smart_resize(height, width, cfg).map_err(unanswerable)?;
    let resized = if (new_height, new_width) == (height, width) {
        rgb
    } else {
        resize_rgb(&rgb, height, width, new_height, new_width).map_err(unanswerable)?
    };
    let (pixels, grid) = patchify(&resized, new_height, new_width, cfg).map_err(unanswerable)?;
    let factor = cfg.factor();
    Ok(DecodedImage {
        width,
        height,
        pixels,
        grid,
        rows: new_height / factor,
        cols: new_width / factor,
        sha256,
    })
}

fn check_size(
    path: &FieldPath,
    width: u32,
    height: u32,
    limits: &ImageLimits,
) -> Result<(), FieldError> {
    let pixels = u64::from(width) * u64::from(height);
    if width == 0 || height == 0 {
        return Err(bad_data(
            path,
            "image_invalid",
            format!("the image is {width} × {height} pixels"),
        ));
    }
    if width > limits.max_side || height > limits.max_side || pixels > limits.max_pixels {
        return Err(FieldError::unanswerable(
            path.clone(),
            "image_too_large",
            format!(
                "the image is {width} × {height} pixels; this server takes sides up to {} and at most {} \
                 pixels",
                limits.max_side, limits.max_pixels
            ),
        ));
    }
    Ok(())
}

/// Decodes every image of a request (in parallel on the rayon pool), reporting every bad one (each
/// under its own path, in the request's order).
pub fn decode_images(
    images: &[RequestImage],
    cfg: &ImageConfig,
    limits: &ImageLimits,
) -> Result<Vec<DecodedImage>, Vec<FieldError>> {
    use rayon::prelude::*;
    let decoded: Vec<_> = images
        .par_iter()
        .map(|image| decode_image(image, cfg, limits))
        .collect();
    let mut out = Vec::with_capacity(images.len());
    let mut errors = Vec::new();
    for result in decoded {
        match result {
            Ok(decoded) => out.push(decoded),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}
