//! A streaming GGUF v3 writer.
//!
//! Files of any size can be written without holding them in memory: declare the metadata and the tensor
//! infos with [`GgufWriter`], write the header with [`GgufWriter::write_header`], then feed each tensor's
//! data, in declaration order and in as many pieces as wanted, to the returned [`TensorDataWriter`] — as
//! raw bytes of the tensor's type, or as f32 values that it quantizes (F32, F16, BF16, Q8_0, Q4_K, Q6_K).
//!
//! ```no_run
//! use prism_gguf::{GgmlType, GgufWriter, MetadataValue};
//! let mut w = GgufWriter::new();
//! w.add_metadata("general.architecture", MetadataValue::String("qwen35".into()))?;
//! w.add_tensor("output_norm.weight", &[256], GgmlType::F32)?;
//! let mut data = w.create("model.gguf")?;
//! data.write_f32(&[1.0; 256])?;
//! data.finish()?;
//! # Ok::<(), prism_gguf::GgufError>(())
//! ```

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::metadata::{MetadataType, MetadataValue};
use crate::quantize;
use crate::reader::{TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};
use crate::types::GgmlType;

/// The GGUF version this writer produces.
pub const GGUF_WRITE_VERSION: u32 = 3;

fn writer_error(message: String) -> GgufError {
    GgufError::Writer { message }
}

/// Collects metadata and tensor infos, then writes the header.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetadataValue)>,
    keys: HashSet<String>,
    tensors: Vec<TensorInfo>,
    names: HashSet<String>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one metadata entry (kept in insertion order). Arrays must be homogeneous and nested at most
    /// [`MAX_ARRAY_DEPTH`] deep; `general.alignment` must be a power-of-two u32 and then sets the
    /// alignment of the data section. An empty array is written with element type u8.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetadataValue) -> Result<()> {
        let key = key.into();
        check_value(&key, &value, 0)?;
        if key == "general.alignment" {
            match value {
                MetadataValue::U32(a) if a.is_power_of_two() => {}
                MetadataValue::U32(a) => {
                    return Err(GgufError::BadAlignment {
                        value: a.to_string(),
                    })
                }
                ref other => {
                    return Err(GgufError::WrongType {
                        key,
                        expected: "u32",
                        found: other.type_name(),
                    })
                }
            }
        }
        if !self.keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.metadata.push((key, value));
        Ok(())
    }

    /// Declares a tensor of shape `dims` (ggml `ne` order: `dims[0]` is the row length) and type `ty`.
    /// Its data must later be written in declaration order.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<()> {
        let name = name.into();
        if dims.len() > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims: dims.len() as u32,
            });
        }
        for (index, &value) in dims.iter().enumerate() {
            if value == 0 || value > i64::MAX as u64 {
                return Err(GgufError::BadDimension {
                    tensor: name,
                    index,
                    value,
                });
            }
        }
        let info = TensorInfo {
            name,
            dims: dims.to_vec(),
            ggml_type: ty,
            offset: 0,
        };
        let block_size = ty.block_size();
        let ne0 = info.row_len();
        if ne0 % block_size as u64 != 0 {
            return Err(GgufError::NotBlockMultiple {
                tensor: info.name,
                ty,
                ne0,
                block_size,
            });
        }
        if info.n_bytes() == u64::MAX || info.n_elements() > i64::MAX as u64 {
            return Err(GgufError::SizeOverflow { tensor: info.name });
        }
        if !self.names.insert(info.name.clone()) {
            return Err(GgufError::DuplicateTensor { name: info.name });
        }
        self.tensors.push(info);
        Ok(())
    }

    /// The alignment the file will use.
    pub fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The tensor infos with the offsets they will have in the file.
    pub fn planned_tensors(&self) -> Result<Vec<TensorInfo>> {
        let alignment = self.alignment();
        let mut offset = 0u64;
        let mut planned = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let overflow = || GgufError::SizeOverflow {
                tensor: t.name.clone(),
            };
            planned.push(TensorInfo {
                offset,
                ..t.clone()
            });
            let end = offset.checked_add(t.n_bytes()).ok_or_else(overflow)?;
            offset = align_up(end, alignment).ok_or_else(overflow)?;
        }
        Ok(planned)
    }

    /// Writes the header, metadata, tensor infos and the padding before the data section, and returns the
    /// writer that takes the tensor data.
    pub fn write_header<W: Write>(self, mut out: W) -> Result<TensorDataWriter<W>> {
        let alignment = self.alignment();
        let tensors = self.planned_tensors()?;
        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC);
        header.extend_from_slice(&GGUF_WRITE_VERSION.to_le_bytes());
        header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().as_u32().to_le_bytes());
            put_value(&mut header, value);
        }
        for t in &tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.as_u32().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        let header_len = header.len() as u64;
        let padded = align_up(header_len, alignment)
            .ok_or_else(|| writer_error("header size overflows".to_string()))?;
        header.resize(padded as usize, 0);
        out.write_all(&header)
            .map_err(|source| GgufError::Write { source })?;
        Ok(TensorDataWriter {
            out,
            tensors,
            alignment,
            current: 0,
            written_in_current: 0,
            position: padded,
            scratch: Vec::new(),
        })
    }

    /// Creates `path` and writes the header to it (buffered).
    pub fn create(self, path: impl AsRef<Path>) -> Result<TensorDataWriter<BufWriter<File>>> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.write_header(BufWriter::with_capacity(1 << 20, file))
    }
}

/// Takes the tensor data after the header, tensor by tensor in declaration order.
pub struct TensorDataWriter<W: Write> {
    out: W,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    current: usize,
    written_in_current: u64,
    /// Bytes written to `out` so far (the absolute file position).
    position: u64,
    scratch: Vec<u8>,
}

impl<W: Write> TensorDataWriter<W> {
    /// The tensor whose data is expected next, if any.
    pub fn current_tensor(&self) -> Option<&TensorInfo> {
        self.tensors.get(self.current)
    }

    /// All tensor infos as written in the header.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Appends raw bytes of the current tensor's type. A tensor may be written in several pieces; a piece
    /// may not run past the end of the current tensor. Completing a tensor writes its padding and moves
    /// on to the next.
    pub fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let info = self.current_tensor().ok_or_else(|| {
            writer_error(format!(
                "{} bytes of tensor data given after the last tensor",
                bytes.len()
            ))
        })?;
        let total = info.n_bytes();
        let after = self.written_in_current + bytes.len() as u64;
        if after > total {
            return Err(writer_error(format!(
                "tensor {:?} is {total} bytes; {} written so far plus {} given is too many",
                info.name,
                self.written_in_current,
                bytes.len()
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|source| GgufError::Write { source })?;
        self.position += bytes.len() as u64;
        self.written_in_current = after;
        if after == total {
            self.pad()?;
            self.current += 1;
            self.written_in_current = 0;
        }
        Ok(())
    }

    /// Quantizes `values` to the current tensor's type (F32, F16, BF16, Q8_0, Q4_K or Q6_K, as llama.cpp's
    /// reference quantizers do) and appends them. `values` must be whole blocks of that type.
    pub fn write_f32(&mut self, values: &[f32]) -> Result<()> {
        let info = self.current_tensor().ok_or_else(|| {
            writer_error(format!(
                "{} f32 values given after the last tensor",
                values.len()
            ))
        })?;
        let (ty, name) = (info.ggml_type, info.name.clone());
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let quantized = quantize::quantize_into(ty, values, &mut scratch).map_err(|e| match e {
            GgufError::UnsupportedType { ty, .. } => GgufError::UnsupportedType {
                tensor: name.clone(),
                ty,
            },
            GgufError::PartialBlock {
                ty,
                n_elements,
                block_size,
                ..
            } => GgufError::PartialBlock {
                what: format!("data of tensor {name:?}"),
                ty,
                n_elements,
                block_size,
            },
            other => other,
        });
        let result = quantized.and_then(|()| self.write_bytes(&scratch));
        self.scratch = scratch;
        result
    }

    fn pad(&mut self) -> Result<()> {
        let target = align_up(self.position, self.alignment)
            .ok_or_else(|| writer_error("file size overflows".to_string()))?;
        let zeros = [0u8; 64];
        while self.position < target {
            let n = ((target - self.position) as usize).min(zeros.len());
            self.out
                .write_all(&zeros[..n])
                .map_err(|source| GgufError::Write { source })?;
            self.position += n as u64;
        }
        Ok(())
    }

    /// Checks that every tensor was written completely, flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W> {
        if let Some(info) = self.tensors.get(self.current) {
            return Err(writer_error(format!(
                "tensor {:?} is incomplete: {} of {} bytes written ({} tensors left)",
                info.name,
                self.written_in_current,
                info.n_bytes(),
                self.tensors.len() - self.current
            )));
        }
        self.out
            .flush()
            .map_err(|source| GgufError::Write { source })?;
        Ok(self.out)
    }
}

fn align_up(value: u64, alignment: u64) -> Option<u64> {
    value.checked_next_multiple_of(alignment)
}

fn check_value(key: &str, value: &MetadataValue, depth: usize) -> Result<()> {
    if let MetadataValue::Array(items) = value {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(writer_error(format!(
                "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
            )));
        }
        if let Some(first) = items.first() {
            let ty = first.value_type();
            if let Some(bad) = items.iter().find(|v| v.value_type() != ty) {
                return Err(writer_error(format!(
                    "metadata key {key:?}: array mixes {} and {} elements",
                    ty.name(),
                    bad.type_name()
                )));
            }
        }
        for item in items {
            check_value(key, item, depth + 1)?;
        }
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.push(*v),
        MetadataValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(s) => put_string(out, s),
        MetadataValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::Array(items) => {
            let elem = items
                .first()
                .map_or(MetadataType::U8, MetadataValue::value_type);
            out.extend_from_slice(&elem.as_u32().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}
