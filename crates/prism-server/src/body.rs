//! From request bytes to a validated [`DecisionRequest`]: content type, content encoding (zstd), multipart
//! (the TypeSafe SDK's image upload form) and the `assets` map, then `prism-decision`'s validation.
//!
//! The TypeSafe SDK sends `application/json`, compresses bodies of 1 KiB or more with zstd
//! (`Content-Encoding: zstd`), and sends images as `multipart/form-data`: a part named `request` holding
//! the JSON body, whose `assets` map names each image's part (`{"type": "image", "part": "asset-0"}`),
//! followed by the parts themselves. All of that is parsed and checked here, and each asset's placeholder
//! in a string state becomes an `<image>` mark with its image in `images` (decoded later, by the engine).
//!
//! Every size is bounded before anything is allocated for it: the decompressed body by the same limit as
//! the wire body, the zstd window by RFC 8878's 8 MiB (or the body limit, if larger), the number of parts.

use std::io::Read;

use axum::http::StatusCode;
use prism_decision::error::{FieldError, FieldErrors, FieldPath, LocPart};
use prism_decision::image_input::{ImageData, RequestImage};
use prism_decision::pyjson::{self, PyObject, PyValue};
use prism_decision::request::{too_many_images, unknown_fields};
use prism_decision::{DecisionError, DecisionRequest, RequestDefaults};

use crate::error::{loc, ApiError};

/// The largest zstd window accepted when the body limit is smaller (RFC 8878: decoders of HTTP content
/// support windows up to 8 MiB).
pub const ZSTD_MAX_WINDOW: u64 = 8 << 20;
/// Most parts of a multipart body: the request, up to [`MAX_IMAGES`](prism_decision::request::MAX_IMAGES) images, and room to report extras.
pub const MAX_MULTIPART_PARTS: usize = 64;
/// Longest header block of one multipart part.
const MAX_PART_HEADER_BYTES: usize = 16 * 1024;

/// What is wrong with a body before its JSON is read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BodyError {
    #[error("the request body is larger than this server's limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("unsupported Content-Type {0:?}: send application/json, or multipart/form-data with a `request` part")]
    UnsupportedContentType(String),
    #[error(
        "unsupported Content-Encoding {0:?}: send the body uncompressed or compressed with zstd"
    )]
    UnsupportedEncoding(String),
    #[error("the zstd-compressed body cannot be decoded: {0}")]
    BadZstd(String),
    #[error("the multipart body is malformed: {0}")]
    BadMultipart(String),
}

impl BodyError {
    pub fn to_api(&self) -> ApiError {
        let message = self.to_string();
        match self {
            BodyError::TooLarge { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                loc(["body"]),
                "too_large",
                message,
            ),
            BodyError::UnsupportedContentType(_) => ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                loc(["header", "content-type"]),
                "content_type",
                message,
            ),
            BodyError::UnsupportedEncoding(_) => ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                loc(["header", "content-encoding"]),
                "content_encoding",
                message,
            ),
            BodyError::BadZstd(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                loc(["body"]),
                "zstd_invalid",
                message,
            ),
            BodyError::BadMultipart(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                loc(["body"]),
                "multipart_invalid",
                message,
            ),
        }
    }
}

/// How the body is framed, from its `Content-Type`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyKind {
    Json,
    Multipart { boundary: String },
}

/// Splits `type/subtype; key=value; ...` into the lower-cased media type and its parameters.
fn media_type(value: &str) -> (String, Vec<(String, String)>) {
    let mut pieces = split_params(value).into_iter();
    let essence = pieces
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let params = pieces
        .filter_map(|piece| {
            let (key, value) = piece.split_once('=')?;
            Some((key.trim().to_ascii_lowercase(), unquote(value.trim())))
        })
        .collect();
    (essence, params)
}

/// Splits on `;` outside double quotes.
fn split_params(value: &str) -> Vec<String> {
    let mut pieces = vec![String::new()];
    let mut quoted = false;
    let mut escaped = false;
    for c in value.chars() {
        if escaped {
            escaped = false;
        } else if quoted && c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c == ';' && !quoted {
            pieces.push(String::new());
            continue;
        }
        if let Some(last) = pieces.last_mut() {
            last.push(c);
        }
    }
    pieces
}

/// A parameter value without its quotes and backslash escapes.
fn unquote(value: &str) -> String {
    match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => {
            let mut out = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                if c == '\\' {
                    if let Some(next) = chars.next() {
                        out.push(next);
                    }
                } else {
                    out.push(c);
                }
            }
            out
        }
        None => value.to_string(),
    }
}

/// The body's framing. A missing `Content-Type` is read as JSON (what a bare client means).
pub fn body_kind(content_type: Option<&str>) -> Result<BodyKind, BodyError> {
    let Some(raw) = content_type else {
        return Ok(BodyKind::Json);
    };
    let (essence, params) = media_type(raw);
    match essence.as_str() {
        "application/json" => match params.iter().find(|(k, _)| k == "charset") {
            Some((_, charset))
                if !charset.eq_ignore_ascii_case("utf-8")
                    && !charset.eq_ignore_ascii_case("utf8") =>
            {
                Err(BodyError::UnsupportedContentType(raw.to_string()))
            }
            _ => Ok(BodyKind::Json),
        },
        "multipart/form-data" => {
            let boundary = params
                .into_iter()
                .find(|(k, _)| k == "boundary")
                .map(|(_, v)| v)
                .unwrap_or_default();
            // RFC 2046: 1 to 70 characters, none of them a line break.
            if boundary.is_empty() || boundary.len() > 70 || boundary.contains(['\r', '\n']) {
                return Err(BodyError::BadMultipart(format!(
                    "Content-Type {raw:?} needs a boundary parameter of 1 to 70 characters"
                )));
            }
            Ok(BodyKind::Multipart { boundary })
        }
        _ => Err(BodyError::UnsupportedContentType(raw.to_string())),
    }
}

/// Whether the body is zstd-compressed, from its `Content-Encoding` (absent or `identity`: not).
pub fn is_zstd(content_encoding: Option<&str>) -> Result<bool, BodyError> {
    let Some(raw) = content_encoding else {
        return Ok(false);
    };
    let codings: Vec<String> = raw
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    match codings.as_slice() {
        [] => Ok(false),
        [only] if only == "zstd" => Ok(true),
        _ => Err(BodyError::UnsupportedEncoding(raw.to_string())),
    }
}

/// Decodes a zstd body (one or more frames; skippable frames are skipped), refusing output beyond `limit`
/// bytes, windows beyond [`ZSTD_MAX_WINDOW`] (or `limit`, if larger), and frames whose checksum disagrees.
pub fn decode_zstd(compressed: &[u8], limit: usize) -> Result<Vec<u8>, BodyError> {
    let max_window = ZSTD_MAX_WINDOW.max(limit as u64);
    let mut input = compressed;
    let mut out = Vec::new();
    if input.is_empty() {
        return Err(BodyError::BadZstd("the body is empty".into()));
    }
    while !input.is_empty() {
        match frame_sizes(input)? {
            Frame::Skippable { total } => {
                input = input.get(total..).ok_or_else(|| {
                    BodyError::BadZstd("a skippable frame runs past the end".into())
                })?;
                continue;
            }
            Frame::Data {
                window,
                content_size,
            } => {
                if content_size.is_some_and(|size| size > (limit - out.len()) as u64) {
                    return Err(BodyError::TooLarge { limit });
                }
                if window > max_window {
                    return Err(BodyError::BadZstd(format!(
                        "the frame asks for a {window}-byte window, more than the {max_window} bytes accepted"
                    )));
                }
            }
        }
        let mut decoder = ruzstd::decoding::StreamingDecoder::new(&mut input)
            .map_err(|e| BodyError::BadZstd(e.to_string()))?;
        let room = (limit - out.len()) as u64;
        let read = (&mut decoder)
            .take(room + 1)
            .read_to_end(&mut out)
            .map_err(|e| BodyError::BadZstd(e.to_string()))?;
        if read as u64 > room {
            return Err(BodyError::TooLarge { limit });
        }
        let frame = decoder.into_frame_decoder();
        if !frame.is_finished() {
            return Err(BodyError::BadZstd("the frame is truncated".into()));
        }
        if let (Some(sent), Some(computed)) = (
            frame.get_checksum_from_data(),
            frame.get_calculated_checksum(),
        ) {
            if sent != computed {
                return Err(BodyError::BadZstd(format!(
                    "content checksum mismatch (frame says {sent:#010x}, data gives {computed:#010x})"
                )));
            }
        }
    }
    Ok(out)
}

enum Frame {
    Skippable {
        total: usize,
    },
    Data {
        window: u64,
        content_size: Option<u64>,
    },
}

/// Reads a frame's header far enough to know its window and declared size (RFC 8878 §3.1.1), so that a
/// hostile header cannot make the decoder allocate a large window.
fn frame_sizes(input: &[u8]) -> Result<Frame, BodyError> {
    let bad = |what: &str| BodyError::BadZstd(what.to_string());
    let magic = input
        .get(..4)
        .ok_or_else(|| bad("truncated frame header"))?;
    let magic = u32::from_le_bytes([magic[0], magic[1], magic[2], magic[3]]);
    if magic & 0xFFFF_FFF0 == 0x184D_2A50 {
        let size = input
            .get(4..8)
            .ok_or_else(|| bad("truncated skippable frame"))?;
        let size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]) as usize;
        return Ok(Frame::Skippable {
            total: 8usize.saturating_add(size),
        });
    }
    if magic != 0xFD2F_B528 {
        return Err(bad("not a zstd frame (bad magic number)"));
    }
    let descriptor = *input.get(4).ok_or_else(|| bad("truncated frame header"))?;
    let single_segment = descriptor & 0x20 != 0;
    let dict_id_bytes = [0usize, 1, 2, 4][(descriptor & 0x03) as usize];
    let fcs_bytes = match descriptor >> 6 {
        0 if single_segment => 1,
        0 => 0,
        1 => 2,
        2 => 4,
        _ => 8,
    };
    let mut pos = 5;
    let mut window = None;
    if !single_segment {
        let wd = *input
            .get(pos)
            .ok_or_else(|| bad("truncated frame header"))?;
        let log = 10 + u64::from(wd >> 3);
        let base = 1u64 << log;
        window = Some(base + (base / 8) * u64::from(wd & 7));
        pos += 1;
    }
    pos += dict_id_bytes;
    let content_size = if fcs_bytes == 0 {
        None
    } else {
        let field = input
            .get(pos..pos + fcs_bytes)
            .ok_or_else(|| bad("truncated frame header"))?;
        let mut bytes = [0u8; 8];
        bytes[..fcs_bytes].copy_from_slice(field);
        let value = u64::from_le_bytes(bytes);
        Some(if fcs_bytes == 2 { value + 256 } else { value })
    };
    let window = match (window, content_size) {
        (Some(window), _) => window,
        (None, Some(size)) => size,
        (None, None) => return Err(bad("single-segment frame without a content size")),
    };
    Ok(Frame::Data {
        window,
        content_size,
    })
}

/// One part of a multipart body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part<'a> {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: &'a [u8],
}

/// Parses a `multipart/form-data` body (RFC 7578 / RFC 2046 framing): optional preamble, parts with
/// their headers, the close delimiter, optional epilogue. Part names must be unique.
pub fn parse_multipart<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, BodyError> {
    let bad = |message: String| BodyError::BadMultipart(message);
    let delimiter = format!("--{boundary}").into_bytes();
    let mut next_delimiter = b"\r\n".to_vec();
    next_delimiter.extend_from_slice(&delimiter);

    // The first delimiter opens the body or follows a preamble line.
    let mut pos = if body.starts_with(&delimiter) {
        0
    } else {
        memchr::memmem::find(body, &next_delimiter)
            .map(|i| i + 2)
            .ok_or_else(|| {
                bad(format!(
                    "the boundary {boundary:?} does not occur in the body"
                ))
            })?
    };
    let mut parts: Vec<Part<'a>> = Vec::new();
    loop {
        // `pos` is at a delimiter, which lies inside `body` by construction.
        let after = pos + delimiter.len();
        let rest = body.get(after..).unwrap_or_default();
        if rest.starts_with(b"--") {
            break;
        }
        let padding = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        if !rest.get(padding..).unwrap_or_default().starts_with(b"\r\n") {
            return Err(bad(format!(
                "part {}: expected a line break after the boundary (or `--` to close the body)",
                parts.len()
            )));
        }
        let headers_start = after + padding + 2;
        let tail = body.get(headers_start..).unwrap_or_default();
        let (header_block, content_start) = if tail.starts_with(b"\r\n") {
            (&tail[..0], headers_start + 2)
        } else {
            let end = memchr::memmem::find(tail, b"\r\n\r\n").ok_or_else(|| {
                bad(format!(
                    "part {}: its headers are not ended by an empty line",
                    parts.len()
                ))
            })?;
            (&tail[..end], headers_start + end + 4)
        };
        if header_block.len() > MAX_PART_HEADER_BYTES {
            return Err(bad(format!(
                "part {}: headers longer than {MAX_PART_HEADER_BYTES} bytes",
                parts.len()
            )));
        }
        let content = body.get(content_start..).unwrap_or_default();
        let length = memchr::memmem::find(content, &next_delimiter).ok_or_else(|| {
            bad(format!(
                "part {} is not closed by the boundary",
                parts.len()
            ))
        })?;
        let part = part_headers(header_block, &content[..length], parts.len())?;
        if parts.iter().any(|p| p.name == part.name) {
            return Err(bad(format!("two parts are named {:?}", part.name)));
        }
        parts.push(part);
        if parts.len() > MAX_MULTIPART_PARTS {
            return Err(bad(format!("more than {MAX_MULTIPART_PARTS} parts")));
        }
        pos = content_start + length + 2;
    }
    if parts.is_empty() {
        return Err(bad("the body has no parts".into()));
    }
    Ok(parts)
}

/// A part's `Content-Disposition: form-data; name="..."` and `Content-Type`.
fn part_headers<'a>(block: &[u8], data: &'a [u8], index: usize) -> Result<Part<'a>, BodyError> {
    let bad = |message: String| BodyError::BadMultipart(format!("part {index}: {message}"));
    let text = std::str::from_utf8(block).map_err(|_| bad("its headers are not UTF-8".into()))?;
    let mut name = None;
    let mut filename = None;
    let mut content_type = None;
    for line in text.split("\r\n") {
        let (key, value) = line
            .split_once(':')
            .ok_or_else(|| bad(format!("bad header line {line:?}")))?;
        let key = key.trim().to_ascii_lowercase();
        if key == "content-disposition" {
            let (essence, params) = media_type(value);
            if essence != "form-data" {
                return Err(bad(format!(
                    "Content-Disposition must be form-data, got {:?}",
                    value.trim()
                )));
            }
            for (param, value) in params {
                match param.as_str() {
                    "name" => name = Some(value),
                    "filename" => filename = Some(value),
                    _ => {}
                }
            }
        } else if key == "content-type" {
            content_type = Some(value.trim().to_string());
        }
    }
    let name = name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad("no Content-Disposition name".into()))?;
    Ok(Part {
        name,
        filename,
        content_type,
        data,
    })
}

/// A validated request and what the server tells the client about it.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub request: DecisionRequest,
    /// Notes for the response's `x_notes` (the server adds [`Self::family_notes`] and the unknown
    /// fields).
    pub notes: Vec<String>,
    /// The thinking and none-option settings the client sent (`think_mode` only when `auto`).
    pub sent: Vec<&'static str>,
}

impl ParsedRequest {
    /// Notes for the settings the client sent that a model of `family` accepts but does not honour.
    pub fn family_notes(&self, family: prism_decision::Family) -> Vec<String> {
        let listed = |keys: &[&str]| {
            keys.iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // The fields of `fields` that the client sent.
        let sent_of = |fields: &[&str]| -> Vec<&str> {
            self.sent
                .iter()
                .copied()
                .filter(|k| fields.contains(k))
                .collect()
        };
        let mut notes = Vec::new();
        if !family.thinks() {
            let thinking = sent_of(THINKING_FIELDS);
            if !thinking.is_empty() {
                notes.push(format!(
                    "{} accepted but without effect: a {family} model does not think (one read-out per question)",
                    listed(&thinking)
                ));
            }
            if self.sent.contains(&"think_mode") {
                notes.push(format!(
                    "think_mode \"auto\" reads each question once: a {family} model does not think"
                ));
            }
        }
        if !family.has_none_option() {
            let none = sent_of(NONE_FIELDS);
            if !none.is_empty() {
                notes.push(format!(
                    "{} accepted but without effect: a {family} model has no none option; answers carry no none_probability",
                    listed(&none)
                ));
            }
        }
        notes
    }
}

const THINKING_FIELDS: &[&str] = &["gate", "mix", "think_budget", "return_thought", "seed"];
const NONE_FIELDS: &[&str] = &["none_check", "allow_none"];

/// Reads and validates a (decoded) request body.
pub fn parse_request(
    kind: &BodyKind,
    body: &[u8],
    defaults: &RequestDefaults,
) -> Result<ParsedRequest, ApiError> {
    match kind {
        BodyKind::Json => {
            let value = pyjson::parse_bytes(body)
                .map_err(|e| ApiError::from_decision(&DecisionError::Json(e)))?;
            validate(&value, None, defaults)
        }
        BodyKind::Multipart { boundary } => {
            let parts = parse_multipart(body, boundary).map_err(|e| e.to_api())?;
            let request_part = parts.iter().find(|p| p.name == "request").ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    loc(["body", "request"]),
                    "missing",
                    "a multipart body needs a part named `request` holding the JSON request",
                )
            })?;
            if let Some(content_type) = &request_part.content_type {
                if media_type(content_type).0 != "application/json" {
                    return Err(ApiError::new(
                        StatusCode::BAD_REQUEST,
                        loc(["body", "request"]),
                        "content_type",
                        format!(
                            "the `request` part must be application/json, got {content_type:?}"
                        ),
                    ));
                }
            }
            let value = pyjson::parse_bytes(request_part.data)
                .map_err(|e| ApiError::from_decision(&DecisionError::Json(e)))?;
            validate(&value, Some(&parts), defaults)
        }
    }
}

/// Validates the JSON body: `assets` here (they need the parts), everything else in `prism-decision`;
/// all problems are reported together.
fn validate(
    value: &PyValue,
    parts: Option<&[Part]>,
    defaults: &RequestDefaults,
) -> Result<ParsedRequest, ApiError> {
    let Some(object) = value.as_object() else {
        // prism-decision names the problem (the body must be an object).
        return match DecisionRequest::from_json(value, defaults) {
            Ok(request) => Ok(ParsedRequest {
                request,
                notes: Vec::new(),
                sent: Vec::new(),
            }),
            Err(error) => Err(ApiError::from_decision(&error)),
        };
    };
    let mut errors = Vec::new();
    let assets = check_assets(object.get("assets"), parts, &mut errors);
    let without_assets: PyObject = object
        .iter()
        .filter(|(key, _)| *key != "assets")
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    match DecisionRequest::from_json(&PyValue::Object(without_assets), defaults) {
        Ok(mut request) if errors.is_empty() => {
            place_assets(&mut request, assets, &mut errors);
            if !errors.is_empty() {
                return Err(ApiError::from_decision(&DecisionError::Request(
                    FieldErrors(errors),
                )));
            }
            Ok(ParsedRequest {
                request,
                notes: Vec::new(),
                sent: sent(object),
            })
        }
        Ok(_) => Err(ApiError::from_decision(&DecisionError::Request(
            FieldErrors(errors),
        ))),
        Err(DecisionError::Request(FieldErrors(more))) => {
            errors.extend(more);
            Err(ApiError::from_decision(&DecisionError::Request(
                FieldErrors(errors),
            )))
        }
        Err(other) => Err(ApiError::from_decision(&other)),
    }
}

const ASSET_FIELDS: &[&str] = &["type", "format", "data_base64", "part"];

/// Checks the SDK's `assets` map against the multipart parts (each part claimed by exactly one asset)
/// and gives each asset's placeholder with its image (the part's bytes, or its `data_base64`), under
/// the path `assets.<placeholder>`.
fn check_assets(
    assets: Option<&PyValue>,
    parts: Option<&[Part]>,
    errors: &mut Vec<FieldError>,
) -> Vec<(String, RequestImage)> {
    let path = FieldPath::root().key("assets");
    let mut claimed: Vec<&str> = Vec::new();
    let mut images = Vec::new();
    let mut count = 0;
    match assets {
        None | Some(PyValue::Null) => {}
        Some(PyValue::Object(map)) => {
            if map.is_empty() {
                errors.push(FieldError::malformed(
                    path.clone(),
                    "value_error",
                    "`assets` must not be empty (leave it out)",
                ));
            }
            for (name, entry) in map.iter() {
                count += 1;
                let entry_path = path.key(name);
                let Some(entry) = entry.as_object() else {
                    errors.push(FieldError::malformed(
                        entry_path,
                        "type_error",
                        format!(
                            "an asset must be an object {{\"type\": \"image\", \"part\": ...}}, got {}",
                            entry.type_name()
                        ),
                    ));
                    continue;
                };
                errors.extend(unknown_fields(entry, ASSET_FIELDS, &entry_path));
                match entry.get("type") {
                    None | Some(PyValue::Null) => {}
                    Some(PyValue::Str(kind)) if kind == "image" => {}
                    Some(other) => errors.push(FieldError::malformed(
                        entry_path.key("type"),
                        "value_error",
                        format!("the only asset type is \"image\", got {}", other.dumps()),
                    )),
                }
                match (entry.get("part"), entry.get("data_base64")) {
                    (Some(PyValue::Str(part)), _) => match parts {
                        None => errors.push(FieldError::malformed(
                            entry_path.key("part"),
                            "value_error",
                            format!("names part {part:?}, but the body is not multipart/form-data"),
                        )),
                        Some(parts) => match parts.iter().find(|p| p.name == *part && p.name != "request") {
                            None => errors.push(FieldError::malformed(
                                entry_path.key("part"),
                                "value_error",
                                format!("names part {part:?}, which the multipart body does not have"),
                            )),
                            Some(_) if claimed.contains(&part.as_str()) => errors.push(FieldError::malformed(
                                entry_path.key("part"),
                                "value_error",
                                format!("part {part:?} is claimed by two assets (each part belongs to exactly one)"),
                            )),
                            Some(found) => {
                                claimed.push(found.name.as_str());
                                if found.data.is_empty() {
                                    errors.push(FieldError::malformed(
                                        entry_path.key("part"),
                                        "value_error",
                                        format!("part {part:?} is empty"),
                                    ));
                                } else {
                                    images.push((
                                        name.to_string(),
                                        RequestImage {
                                            data: ImageData::Bytes(found.data.into()),
                                            path: entry_path.clone(),
                                        },
                                    ));
                                }
                            }
                        },
                    },
                    (Some(other), _) if *other != PyValue::Null => errors.push(FieldError::malformed(
                        entry_path.key("part"),
                        "type_error",
                        format!("must be a part name (string), got {}", other.type_name()),
                    )),
                    (_, Some(PyValue::Str(data))) => {
                        if data.trim().is_empty() {
                            errors.push(FieldError::malformed(
                                entry_path.key("data_base64"),
                                "value_error",
                                "is empty",
                            ));
                        } else {
                            images.push((
                                name.to_string(),
                                RequestImage {
                                    data: ImageData::Encoded(data.clone()),
                                    path: entry_path.key("data_base64"),
                                },
                            ));
                        }
                        match entry.get("format") {
                            Some(PyValue::Str(format)) if ["png", "jpg", "jpeg"].contains(&format.as_str()) => {}
                            other => errors.push(FieldError::malformed(
                                entry_path.key("format"),
                                "value_error",
                                format!(
                                    "data_base64 needs a format: \"png\", \"jpg\" or \"jpeg\", got {}",
                                    other.map(|v| v.dumps()).unwrap_or_else(|| "nothing".into())
                                ),
                            )),
                        }
                    }
                    (_, Some(other)) if *other != PyValue::Null => errors.push(FieldError::malformed(
                        entry_path.key("data_base64"),
                        "type_error",
                        format!("must be a base64 string, got {}", other.type_name()),
                    )),
                    _ => errors.push(FieldError::malformed(
                        entry_path,
                        "missing",
                        "an asset needs `part` (multipart) or `data_base64`",
                    )),
                }
            }
        }
        Some(other) => errors.push(FieldError::malformed(
            path.clone(),
            "type_error",
            format!(
                "must be an object (placeholder -> asset), got {}",
                other.type_name()
            ),
        )),
    }
    for part in parts.unwrap_or_default() {
        if part.name != "request" && !claimed.contains(&part.name.as_str()) {
            errors.push(FieldError::malformed(
                path.clone(),
                "value_error",
                format!(
                    "multipart part {:?} is not named by any asset in `assets`",
                    part.name
                ),
            ));
        }
    }
    errors.extend(too_many_images(path.clone(), count));
    images
}

/// Puts the SDK's assets into the request: each placeholder where it appears in a string state
/// becomes an `<image>` mark and its image the next of `request.images` (in the order of the
/// placeholders in the text). An asset whose placeholder is not in the state, assets with a state
/// that is not a string, or assets next to `images` are refused (422) under their paths.
fn place_assets(
    request: &mut DecisionRequest,
    assets: Vec<(String, RequestImage)>,
    errors: &mut Vec<FieldError>,
) {
    if assets.is_empty() {
        return;
    }
    let root = FieldPath::root();
    if !request.images.is_empty() {
        errors.push(FieldError::unanswerable(
            root.key("assets"),
            "not_supported",
            "send images either as `images` or as `assets`, not both",
        ));
        return;
    }
    let PyValue::Str(text) = &request.state else {
        errors.push(FieldError::unanswerable(
            root.key("state"),
            "not_supported",
            "image assets go in a string state (the placeholder where the image is); a JSON state \
             cannot hold images",
        ));
        return;
    };
    let mut out = String::with_capacity(text.len());
    let mut used = vec![false; assets.len()];
    let mut images = Vec::new();
    let mut rest = text.as_str();
    loop {
        let next = assets
            .iter()
            .enumerate()
            .filter_map(|(k, (name, _))| rest.find(name.as_str()).map(|at| (at, k)))
            .min_by_key(|&(at, k)| (at, std::cmp::Reverse(assets[k].0.len())));
        let Some((at, k)) = next else {
            break;
        };
        out.push_str(&rest[..at]);
        out.push_str(prism_decision::render::IMAGE_MARK);
        used[k] = true;
        images.push(assets[k].1.clone());
        rest = &rest[at + assets[k].0.len()..];
    }
    out.push_str(rest);
    for ((name, _), used) in assets.iter().zip(&used) {
        if !used {
            errors.push(FieldError::unanswerable(
                root.key("assets").key(name),
                "not_supported",
                format!(
                    "placeholder {name:?} is not in the state: images go in the (string) state; \
                     instructions and criteria cannot hold images"
                ),
            ));
        }
    }
    errors.extend(too_many_images(root.key("assets"), images.len()));
    request.state = PyValue::Str(out);
    request.images = images;
}

/// The thinking and none-option fields the client set (`think_mode` only when it is `auto`).
fn sent(object: &PyObject) -> Vec<&'static str> {
    let set = |key: &str| object.get(key).is_some_and(|v| *v != PyValue::Null);
    let mut sent: Vec<&'static str> = THINKING_FIELDS
        .iter()
        .chain(NONE_FIELDS)
        .copied()
        .filter(|key| set(key))
        .collect();
    if matches!(object.get("think_mode"), Some(PyValue::Str(mode)) if mode == "auto") {
        sent.push("think_mode");
    }
    sent
}

/// The `loc` of a field error, for tests and logs.
pub fn loc_strings(loc: &[LocPart]) -> Vec<String> {
    loc.iter()
        .map(|p| match p {
            LocPart::Key(k) => k.clone(),
            LocPart::Index(i) => i.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn multipart(boundary: &str, parts: &[(&str, &str, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, content_type, data) in parts {
            body.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: {content_type}\r\n\r\n"
                )
                .as_bytes(),
            );
            body.extend_from_slice(data);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        body
    }

    #[test]
    fn content_types() {
        assert_eq!(body_kind(None), Ok(BodyKind::Json));
        assert_eq!(
            body_kind(Some("application/json; charset=UTF-8")),
            Ok(BodyKind::Json)
        );
        assert_eq!(
            body_kind(Some("multipart/form-data; boundary=\"a;b\"")),
            Ok(BodyKind::Multipart {
                boundary: "a;b".into()
            })
        );
        assert!(matches!(
            body_kind(Some("text/plain")),
            Err(BodyError::UnsupportedContentType(_))
        ));
        assert!(matches!(
            body_kind(Some("application/json; charset=latin-1")),
            Err(BodyError::UnsupportedContentType(_))
        ));
        assert!(matches!(
            body_kind(Some("multipart/form-data")),
            Err(BodyError::BadMultipart(_))
        ));
        assert_eq!(is_zstd(Some("zstd")), Ok(true));
        assert_eq!(is_zstd(Some("identity")), Ok(false));
        assert!(is_zstd(Some("gzip")).is_err());
        assert!(is_zstd(Some("zstd, zstd")).is_err());
    }

    #[test]
    fn zstd_round_trip_limits_and_corruption() {
        let text = "{\"state\": \"x\"}".repeat(500).into_bytes();
        let compressed = ruzstd::encoding::compress_to_vec(
            &text[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        assert_eq!(decode_zstd(&compressed, 1 << 20).unwrap(), text);
        // Two frames concatenated decode to both contents.
        let mut two = compressed.clone();
        two.extend_from_slice(&compressed);
        assert_eq!(decode_zstd(&two, 1 << 20).unwrap().len(), 2 * text.len());
        // A skippable frame in front is skipped.
        let mut skippable = vec![0x50, 0x2A, 0x4D, 0x18, 3, 0, 0, 0, 1, 2, 3];
        skippable.extend_from_slice(&compressed);
        assert_eq!(decode_zstd(&skippable, 1 << 20).unwrap(), text);
        assert_eq!(
            decode_zstd(&compressed, 100),
            Err(BodyError::TooLarge { limit: 100 })
        );
        assert!(matches!(
            decode_zstd(b"not zstd at all", 1 << 20),
            Err(BodyError::BadZstd(_))
        ));
        assert!(matches!(
            decode_zstd(&compressed[..compressed.len() / 2], 1 << 20),
            Err(BodyError::BadZstd(_))
        ));
        assert!(matches!(
            decode_zstd(&[], 1 << 20),
            Err(BodyError::BadZstd(_))
        ));
        // A header asking for a 2 GiB window (window descriptor exponent 21) is refused before decoding.
        let huge_window = [0x28, 0xB5, 0x2F, 0xFD, 0x00, 21 << 3, 0, 0, 0];
        let error = decode_zstd(&huge_window, 1 << 20).unwrap_err();
        assert!(
            matches!(&error, BodyError::BadZstd(m) if m.contains("window")),
            "{error:?}"
        );
    }

    #[test]
    fn multipart_parts_and_errors() {
        let body = multipart(
            "b0undary",
            &[
                ("request", "application/json", b"{}"),
                ("asset-0", "image/png", b"\x89PNG\r\n--b0"),
            ],
        );
        let parts = parse_multipart(&body, "b0undary").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "request");
        assert_eq!(parts[0].data, b"{}");
        assert_eq!(parts[1].data, b"\x89PNG\r\n--b0");
        assert_eq!(parts[1].content_type.as_deref(), Some("image/png"));
        assert_eq!(parts[1].filename.as_deref(), Some("asset-0"));
        // A preamble is allowed.
        let mut with_preamble = b"ignored preamble\r\n".to_vec();
        with_preamble.extend_from_slice(&body);
        assert_eq!(
            parse_multipart(&with_preamble, "b0undary").unwrap().len(),
            2
        );

        let errors = [
            (b"no boundary here".to_vec(), "does not occur"),
            (body[..body.len() - 16].to_vec(), "not closed"),
            (
                b"--b0undary\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b0undary--".to_vec(),
                "no Content-Disposition name",
            ),
            (
                b"--b0undary\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nx\r\n--b0undary--".to_vec(),
                "form-data",
            ),
            (b"--b0undary\r\nbroken header\r\n\r\nx\r\n--b0undary--".to_vec(), "bad header line"),
            (b"--b0undaryXX".to_vec(), "line break"),
            (b"--b0undary--".to_vec(), "no parts"),
            (
                multipart(
                    "b0undary",
                    &[("request", "application/json", b"{}"), ("request", "application/json", b"{}")],
                ),
                "two parts",
            ),
        ];
        for (body, expected) in errors {
            match parse_multipart(&body, "b0undary") {
                Err(BodyError::BadMultipart(message)) => {
                    assert!(message.contains(expected), "{message}")
                }
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(&body)),
            }
        }
        let many: Vec<(String, Vec<u8>)> = (0..MAX_MULTIPART_PARTS + 1)
            .map(|i| (format!("p{i}"), vec![b'x']))
            .collect();
        let refs: Vec<(&str, &str, &[u8])> = many
            .iter()
            .map(|(n, d)| (n.as_str(), "text/plain", d.as_slice()))
            .collect();
        assert!(parse_multipart(&multipart("b", &refs), "b").is_err());
    }

    fn refused(kind: &BodyKind, body: &[u8]) -> ApiError {
        parse_request(kind, body, &RequestDefaults::default()).expect_err("refused")
    }

    fn locs(error: &ApiError) -> Vec<Vec<String>> {
        error
            .body
            .detail
            .iter()
            .map(|d| loc_strings(&d.loc))
            .collect()
    }

    const QUESTIONS: &str = r#""questions": {"q": {"type": "noul", "instructions": "Is it?"}}"#;

    #[test]
    fn sdk_multipart_images_are_placed_in_the_state() {
        let json = format!(
            r#"{{"state": "see <image:0> then <image:1>", "model": "jev-latest", {QUESTIONS}, "assets": {{"<image:1>": {{"type": "image", "format": "png", "data_base64": "iVBO"}}, "<image:0>": {{"type": "image", "part": "asset-0"}}}}}}"#
        );
        let body = multipart(
            "xyz",
            &[
                ("request", "application/json", json.as_bytes()),
                ("asset-0", "image/png", b"\x89PNG"),
            ],
        );
        let kind = BodyKind::Multipart {
            boundary: "xyz".into(),
        };
        // Each placeholder becomes an `<image>` mark; the images follow the placeholders' order.
        let parsed = parse_request(&kind, &body, &RequestDefaults::default()).unwrap();
        let request = parsed.request;
        assert_eq!(
            request.state,
            PyValue::Str("see <image> then <image>".into())
        );
        assert_eq!(request.images.len(), 2);
        assert_eq!(
            request.images[0].data,
            ImageData::Bytes(b"\x89PNG".as_slice().into())
        );
        assert_eq!(request.images[1].data, ImageData::Encoded("iVBO".into()));
        assert_eq!(
            loc_strings(&request.images[0].path.loc()),
            ["body", "assets", "<image:0>"]
        );

        // A placeholder the state does not hold: 422 naming the asset.
        let json = format!(
            r#"{{"state": "no image here", {QUESTIONS}, "assets": {{"<image:0>": {{"type": "image", "part": "asset-0"}}}}}}"#
        );
        let body = multipart(
            "xyz",
            &[
                ("request", "application/json", json.as_bytes()),
                ("asset-0", "image/png", b"\x89PNG"),
            ],
        );
        let error = refused(&kind, &body);
        assert_eq!(error.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(locs(&error), [["body", "assets", "<image:0>"]]);

        // A part no asset claims, an asset naming a missing part: 422 with the asset's path. (Built like
        // the case above: each case is its own body and the refusal it expects.)
        let json = format!(
            r#"{{"state": "s", {QUESTIONS}, "assets": {{"a": {{"type": "image", "part": "asset-9"}}}}}}"#
        );
        let body = multipart(
            "xyz",
            &[
                ("request", "application/json", json.as_bytes()),
                ("asset-0", "image/png", b"x"),
            ],
        );
        let error = refused(&kind, &body);
        assert_eq!(error.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(locs(&error).contains(&vec![
            "body".into(),
            "assets".into(),
            "a".into(),
            "part".into()
        ]));
        assert!(error
            .body
            .detail
            .iter()
            .any(|d| d.msg.contains("\"asset-0\" is not named")));

        // Without a `request` part.
        let body = multipart("xyz", &[("asset-0", "image/png", b"x")]);
        assert_eq!(locs(&refused(&kind, &body)), [["body", "request"]]);

        // A multipart body with only the request part is an ordinary request.
        let json = format!(r#"{{"state": "s", {QUESTIONS}}}"#);
        let body = multipart("xyz", &[("request", "application/json", json.as_bytes())]);
        let parsed = parse_request(&kind, &body, &RequestDefaults::default()).unwrap();
        assert_eq!(parsed.request.questions.len(), 1);
    }

    #[test]
    fn json_assets_and_notes() {
        // Inline base64 assets in a JSON body: validated, then refused as images.
        let body = format!(
            r#"{{"state": "s", {QUESTIONS}, "assets": {{"a": {{"format": "png", "data_base64": "iVBO"}}}}}}"#
        );
        let error = refused(&BodyKind::Json, body.as_bytes());
        assert_eq!(error.status, StatusCode::UNPROCESSABLE_ENTITY);
        // A part reference without multipart, and a question error alongside: 422 naming both.
        let body = r#"{"state": "s", "questions": {"q": {"type": "choice"}}, "assets": {"a": {"part": "asset-0"}}}"#;
        let error = refused(&BodyKind::Json, body.as_bytes());
        assert_eq!(error.status, StatusCode::UNPROCESSABLE_ENTITY);
        let locs = locs(&error);
        assert!(
            locs.contains(&vec![
                "body".into(),
                "assets".into(),
                "a".into(),
                "part".into()
            ]),
            "{locs:?}"
        );
        assert!(
            locs.iter()
                .any(|l| l.starts_with(&["body".into(), "questions".into(), "q".into()])),
            "{locs:?}"
        );
        // Nine images: 422 too many.
        let assets: Vec<String> = (0..9)
            .map(|i| format!(r#""a{i}": {{"format": "png", "data_base64": "iVBO"}}"#))
            .collect();
        let body = format!(
            r#"{{"state": "s", {QUESTIONS}, "assets": {{{}}}}}"#,
            assets.join(",")
        );
        let error = refused(&BodyKind::Json, body.as_bytes());
        assert!(error
            .body
            .detail
            .iter()
            .any(|d| d.kind == "too_many_images"));

        let body = format!(
            r#"{{"state": "s", {QUESTIONS}, "gate": 0.9, "none_check": true, "think_mode": "auto"}}"#
        );
        let parsed = parse_request(
            &BodyKind::Json,
            body.as_bytes(),
            &RequestDefaults::default(),
        )
        .unwrap();
        let v1 = parsed.family_notes(prism_decision::Family::V1);
        assert_eq!(v1.len(), 3, "{v1:?}");
        assert!(v1[0].contains("`gate`"));
        // An Instant model has the none option but does not think; AutoThink honours all of them.
        let instant = parsed.family_notes(prism_decision::Family::Instant);
        assert_eq!(instant.len(), 2, "{instant:?}");
        assert!(parsed
            .family_notes(prism_decision::Family::AutoThink)
            .is_empty());
        let body = format!(r#"{{"state": "s", {QUESTIONS}}}"#);
        assert!(parse_request(
            &BodyKind::Json,
            body.as_bytes(),
            &RequestDefaults::default()
        )
        .unwrap()
        .family_notes(prism_decision::Family::V1)
        .is_empty());
    }
}
