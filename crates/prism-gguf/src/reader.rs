//! The GGUF reader: memory-maps a file, parses and validates the header, metadata and tensor infos, and
//! hands out tensor bytes.
//!
//! Everything read from the file is checked before it is used: every count and length against the bytes
//! that remain (so a crafted count can never cause a large allocation), every size computation with checked
//! arithmetic, every tensor's byte range against the file. After [`GgufFile::open`] succeeds, every tensor's
//! bytes lie inside the file, are aligned, do not overlap another tensor's, and hold a whole number of
//! blocks of its type.
//!
//! Zero-sized dimensions are rejected: no GGUF weight has one, and a zero-byte tensor could sit at any
//! offset, which would weaken the overlap check.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::blocks;
use crate::error::{GgufError, Result};
use crate::metadata::{typed, MetadataType, MetadataValue};
use crate::types::GgmlType;

/// `"GGUF"` as it appears at the start of every file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most this many dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays are allowed to this depth. GGUF itself sets no limit, but recursion must stop
/// somewhere, and no known writer nests at all.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor-info record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne` order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Relative to the start of the data section, as stored in the file.
    pub offset: u64,
}

impl TensorInfo {
    /// Product of the dimensions. Checked at open for tensors of a [`GgufFile`]; saturates at
    /// `u64::MAX` for a hand-made record whose product overflows.
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Bytes of the tensor's data. Saturates at `u64::MAX` for a hand-made record that is not a whole
    /// number of blocks or whose size overflows (never the case for tensors of a [`GgufFile`]).
    pub fn n_bytes(&self) -> u64 {
        checked_n_bytes(&self.dims, self.ggml_type).unwrap_or(u64::MAX)
    }

    /// Elements of one row (`dims[0]`), 1 for a scalar.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of `dims[1..]`).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }
}

/// Byte size of a tensor of `dims` and `ty`: whole rows of whole blocks. `None` on overflow or a row
/// that is not a whole number of blocks.
fn checked_n_bytes(dims: &[u64], ty: GgmlType) -> Option<u64> {
    let ne0 = dims.first().copied().unwrap_or(1);
    let row_bytes = ty.bytes_for(ne0)?;
    dims.iter()
        .skip(1)
        .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
}

enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(map) => map,
            Backing::Owned(bytes) => bytes,
        }
    }
}

/// A parsed, validated GGUF file. The tensor data stays in the (memory-mapped) file.
pub struct GgufFile {
    backing: Backing,
    path: Option<PathBuf>,
    header: Header,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("n_metadata", &self.header.metadata.len())
            .field("n_tensors", &self.header.tensors.len())
            .field("alignment", &self.header.alignment)
            .field("data_offset", &self.header.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let backing = if len == 0 {
            // Mapping an empty file fails on Linux; an empty buffer gives the proper "truncated" error.
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. Like every mmap-based model loader, we rely on the file not
            // being truncated or rewritten while it is open; doing so is outside this program's contract.
            Backing::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?)
        };
        let mut parsed = Self::parse(backing)?;
        parsed.path = Some(path.to_path_buf());
        Ok(parsed)
    }

    /// Parses a GGUF held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(backing: Backing) -> Result<GgufFile> {
        let header = parse_header(backing.bytes())?;
        Ok(GgufFile {
            backing,
            path: None,
            header,
        })
    }

    /// The path given to [`GgufFile::open`], if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, MetadataValue)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.header
            .key_index
            .get(key)
            .and_then(|&i| self.header.metadata.get(i))
            .map(|(_, v)| v)
    }

    /// A non-negative integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        typed(
            key,
            self.get(key),
            "non-negative integer",
            MetadataValue::as_u64,
        )
    }

    /// An integer of any integer type that fits in an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        typed(key, self.get(key), "integer", MetadataValue::as_i64)
    }

    /// An f32 or f64.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        typed(key, self.get(key), "f32 or f64", MetadataValue::as_f64)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        typed(key, self.get(key), "string", MetadataValue::as_str)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        typed(key, self.get(key), "bool", MetadataValue::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Result<&[MetadataValue]> {
        typed(key, self.get(key), "array", MetadataValue::as_array)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// Length of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.header
            .tensor_index
            .get(name)
            .and_then(|&i| self.header.tensors.get(i))
    }

    /// The bytes of `info`'s data. For a record of this file the range was validated at open; a record
    /// that does not describe this file's data (hand-made, or from another file) gets an empty slice
    /// rather than a panic when it falls outside the file.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let range = checked_n_bytes(&info.dims, info.ggml_type).and_then(|n_bytes| {
            let start = self.header.data_offset.checked_add(info.offset)?;
            let end = start.checked_add(n_bytes)?;
            Some((usize::try_from(start).ok()?, usize::try_from(end).ok()?))
        });
        match range {
            Some((start, end)) => self.backing.bytes().get(start..end).unwrap_or(&[]),
            None => &[],
        }
    }

    /// The bytes of the tensor called `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::UnknownTensor {
                name: name.to_string(),
            })?;
        Ok(self.tensor_bytes(info))
    }

    /// The tensor called `name` as f32, in storage order (`ne0` fastest), exactly as ggml's
    /// `dequantize_row_*` compute it.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::UnknownTensor {
                name: name.to_string(),
            })?;
        self.dequantize_info(info)
    }

    /// The bytes of row `row` (the `row`-th run of `dims[0]` elements) of `info`'s data.
    pub fn row_bytes(&self, info: &TensorInfo, row: u64) -> Result<&[u8]> {
        let n_rows = info.n_rows();
        let row_len = info.row_len();
        let out_of_range = || GgufError::RowOutOfRange {
            tensor: info.name.clone(),
            row,
            n_rows,
        };
        if row >= n_rows {
            return Err(out_of_range());
        }
        let row_bytes =
            info.ggml_type
                .bytes_for(row_len)
                .ok_or_else(|| GgufError::SizeOverflow {
                    tensor: info.name.clone(),
                })?;
        let start = row
            .checked_mul(row_bytes)
            .and_then(|start| usize::try_from(start).ok())
            .ok_or_else(out_of_range)?;
        let len = usize::try_from(row_bytes).map_err(|_| out_of_range())?;
        self.tensor_bytes(info)
            .get(start..start + len)
            .ok_or_else(out_of_range)
    }

    /// Row `row` of `info` as f32 (for example one embedding out of a quantized token table).
    pub fn dequantize_row(&self, info: &TensorInfo, row: u64) -> Result<Vec<f32>> {
        if !info.ggml_type.can_dequantize() {
            return Err(GgufError::UnsupportedType {
                tensor: info.name.clone(),
                ty: info.ggml_type,
            });
        }
        let bytes = self.row_bytes(info, row)?;
        let n = usize::try_from(info.row_len()).map_err(|_| GgufError::SizeOverflow {
            tensor: info.name.clone(),
        })?;
        blocks::dequantize_named(&info.name, info.ggml_type, bytes, n)
    }

    /// As [`GgufFile::dequantize`], for a record of this file.
    pub fn dequantize_info(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        if !info.ggml_type.can_dequantize() {
            return Err(GgufError::UnsupportedType {
                tensor: info.name.clone(),
                ty: info.ggml_type,
            });
        }
        let n_elements =
            usize::try_from(info.n_elements()).map_err(|_| GgufError::SizeOverflow {
                tensor: info.name.clone(),
            })?;
        blocks::dequantize_named(
            &info.name,
            info.ggml_type,
            self.tensor_bytes(info),
            n_elements,
        )
    }
}

/// What the header parse produces: the version, metadata, tensor infos and data layout a [`GgufFile`]
/// keeps.
struct Header {
    version: u32,
    metadata: Vec<(String, MetadataValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

/// A read position in the file's bytes. Every read checks the bytes that remain first.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn truncated(&self, what: String, needed: u64) -> GgufError {
        GgufError::Truncated {
            what,
            offset: self.pos as u64,
            needed,
            available: self.remaining() as u64,
        }
    }

    /// Takes `n` bytes, or fails naming `what` (only built on failure).
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        match usize::try_from(n) {
            Ok(n) if n <= self.remaining() => {
                let start = self.pos;
                self.pos += n;
                Ok(&self.bytes[start..start + n])
            }
            _ => Err(self.truncated(what(), n)),
        }
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A u64 length followed by that many bytes of UTF-8.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(|| format!("length of {}", what()))?;
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidUtf8 {
                what: what(),
                offset: start + e.valid_up_to() as u64,
            }),
        }
    }

    /// Refuses `count` items of at least `min_size` bytes each unless they can fit in what remains.
    /// Called before any allocation sized by `count`.
    fn check_count(
        &self,
        count: u64,
        min_size: usize,
        what: impl FnOnce() -> String,
    ) -> Result<usize> {
        let needed = count.checked_mul(min_size as u64);
        match needed {
            Some(needed) if needed <= self.remaining() as u64 => Ok(count as usize),
            _ => Err(self.truncated(what(), needed.unwrap_or(u64::MAX))),
        }
    }
}

fn parse_header(bytes: &[u8]) -> Result<Header> {
    let mut cur = Cursor { bytes, pos: 0 };

    let magic: [u8; 4] = cur.array(|| "magic".to_string())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = cur.u32(|| "version".to_string())?;
    if version & 0xFFFF == 0 && version != 0 {
        // A small version number written big-endian reads as a multiple of 65536 here.
        return Err(GgufError::BigEndian {
            raw: version,
            swapped: version.swap_bytes(),
        });
    }
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let n_tensors = cur.u64(|| "tensor count".to_string())?;
    let n_kv = cur.u64(|| "metadata count".to_string())?;

    // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at least
    // 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    let n_kv = cur.check_count(n_kv, 13, || format!("{n_kv} metadata entries"))?;
    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = cur.string(&|| format!("key of metadata entry #{i}"))?;
        let type_offset = cur.pos as u64;
        let type_id = cur.u32(|| format!("value type of metadata key {key:?}"))?;
        let ty = MetadataType::from_u32(type_id).ok_or_else(|| GgufError::InvalidValueType {
            key: key.clone(),
            offset: type_offset,
            type_id,
        })?;
        let value = read_value(&mut cur, ty, &key, 0)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
    }

    let n_tensors = cur.check_count(n_tensors, 24, || format!("{n_tensors} tensor infos"))?;
    let mut tensors = Vec::with_capacity(n_tensors);
    let mut tensor_index = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = cur.string(&|| format!("name of tensor #{i}"))?;
        let n_dims = cur.u32(|| format!("dimension count of tensor {name:?}"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(cur.u64(|| format!("dimension {d} of tensor {name:?}"))?);
        }
        let type_id = cur.u32(|| format!("type of tensor {name:?}"))?;
        let ggml_type = GgmlType::from_u32(type_id).map_err(|_| GgufError::InvalidType {
            tensor: name.clone(),
            type_id,
        })?;
        let offset = cur.u64(|| format!("data offset of tensor {name:?}"))?;
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor { name });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }

    let alignment = match key_index
        .get("general.alignment")
        .and_then(|&i| metadata.get(i))
    {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetadataValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, MetadataValue::U32(a))) => {
            return Err(GgufError::BadAlignment {
                value: a.to_string(),
            })
        }
        Some((_, other)) => {
            return Err(GgufError::WrongType {
                key: "general.alignment".to_string(),
                expected: "u32",
                found: other.type_name(),
            })
        }
    };

    let file_len = bytes.len() as u64;
    let infos_end = cur.pos as u64;
    // alignment ≤ 2^31 and infos_end ≤ file length, so this cannot overflow a u64.
    let data_offset = infos_end.div_ceil(alignment) * alignment;

    let mut ranges = Vec::with_capacity(tensors.len());
    for (index, t) in tensors.iter().enumerate() {
        let (start, end) = validate_tensor(t, alignment, data_offset, file_len)?;
        ranges.push((start, end, index));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if let [(_, first_end, first), (second_start, _, second)] = *pair {
            if second_start < first_end {
                return Err(GgufError::Overlap {
                    first: tensors[first].name.clone(),
                    second: tensors[second].name.clone(),
                });
            }
        }
    }

    Ok(Header {
        version,
        metadata,
        key_index,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

/// Checks one tensor's shape, type geometry and byte range; returns its absolute [start, end).
fn validate_tensor(
    t: &TensorInfo,
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<(u64, u64)> {
    for (index, &value) in t.dims.iter().enumerate() {
        if value == 0 || value > i64::MAX as u64 {
            return Err(GgufError::BadDimension {
                tensor: t.name.clone(),
                index,
                value,
            });
        }
    }
    let block_size = t.ggml_type.block_size();
    let ne0 = t.row_len();
    if ne0 % block_size as u64 != 0 {
        return Err(GgufError::NotBlockMultiple {
            tensor: t.name.clone(),
            ty: t.ggml_type,
            ne0,
            block_size,
        });
    }
    let overflow = || GgufError::SizeOverflow {
        tensor: t.name.clone(),
    };
    // ggml keeps element counts in int64_t.
    let n_elements = t
        .dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    if n_elements > i64::MAX as u64 {
        return Err(overflow());
    }
    let n_bytes = checked_n_bytes(&t.dims, t.ggml_type).ok_or_else(overflow)?;
    if t.offset % alignment != 0 {
        return Err(GgufError::Misaligned {
            tensor: t.name.clone(),
            offset: t.offset,
            alignment,
        });
    }
    let out_of_bounds = |start: u64, end: u64| GgufError::OutOfBounds {
        tensor: t.name.clone(),
        start,
        end,
        file_len,
    };
    let start = data_offset
        .checked_add(t.offset)
        .ok_or_else(|| out_of_bounds(u64::MAX, u64::MAX))?;
    let end = start
        .checked_add(n_bytes)
        .ok_or_else(|| out_of_bounds(start, u64::MAX))?;
    if end > file_len {
        return Err(out_of_bounds(start, end));
    }
    Ok((start, end))
}

/// Reads one value of type `ty`. `depth` counts enclosing arrays.
fn read_value(
    cur: &mut Cursor<'_>,
    ty: MetadataType,
    key: &str,
    depth: usize,
) -> Result<MetadataValue> {
    let what = || format!("value of metadata key {key:?}");
    Ok(match ty {
        MetadataType::U8 => MetadataValue::U8(cur.array::<1>(what)?[0]),
        MetadataType::I8 => MetadataValue::I8(i8::from_le_bytes(cur.array(what)?)),
        MetadataType::U16 => MetadataValue::U16(u16::from_le_bytes(cur.array(what)?)),
        MetadataType::I16 => MetadataValue::I16(i16::from_le_bytes(cur.array(what)?)),
        MetadataType::U32 => MetadataValue::U32(u32::from_le_bytes(cur.array(what)?)),
        MetadataType::I32 => MetadataValue::I32(i32::from_le_bytes(cur.array(what)?)),
        MetadataType::F32 => MetadataValue::F32(f32::from_le_bytes(cur.array(what)?)),
        MetadataType::U64 => MetadataValue::U64(u64::from_le_bytes(cur.array(what)?)),
        MetadataType::I64 => MetadataValue::I64(i64::from_le_bytes(cur.array(what)?)),
        MetadataType::F64 => MetadataValue::F64(f64::from_le_bytes(cur.array(what)?)),
        MetadataType::Bool => {
            let offset = cur.pos as u64;
            let byte = cur.array::<1>(what)?[0];
            MetadataValue::Bool(check_bool(byte, key, offset)?)
        }
        MetadataType::String => MetadataValue::String(cur.string(&what)?),
        MetadataType::Array => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::NestingTooDeep {
                    key: key.to_string(),
                    offset: cur.pos as u64,
                    max_depth: MAX_ARRAY_DEPTH,
                });
            }
            let type_offset = cur.pos as u64;
            let type_id = cur.u32(|| format!("element type of array {key:?}"))?;
            let elem =
                MetadataType::from_u32(type_id).ok_or_else(|| GgufError::InvalidValueType {
                    key: key.to_string(),
                    offset: type_offset,
                    type_id,
                })?;
            let count = cur.u64(|| format!("length of array {key:?}"))?;
            let count = cur.check_count(count, elem.min_size(), || {
                format!("{count} elements of array {key:?}")
            })?;
            let mut items = Vec::with_capacity(count);
            if let Some(size) = elem.fixed_size() {
                // Fixed-size elements: one bounds check for the whole run, then decode in place.
                let run_offset = cur.pos as u64;
                let run = cur.take((count * size) as u64, what)?;
                if elem == MetadataType::Bool {
                    for (i, &byte) in run.iter().enumerate() {
                        check_bool(byte, key, run_offset + i as u64)?;
                    }
                }
                items.extend(run.chunks_exact(size).map(|b| decode_fixed(elem, b)));
            } else {
                for _ in 0..count {
                    items.push(read_value(cur, elem, key, depth + 1)?);
                }
            }
            MetadataValue::Array(items)
        }
    })
}

/// GGUF bools are one byte, 0 or 1; anything else means a corrupt or misparsed file.
fn check_bool(byte: u8, key: &str, offset: u64) -> Result<bool> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        byte => Err(GgufError::InvalidBool {
            key: key.to_string(),
            offset,
            byte,
        }),
    }
}

/// Decodes one fixed-size little-endian value; `bytes` has exactly `ty.fixed_size()` bytes.
fn decode_fixed(ty: MetadataType, bytes: &[u8]) -> MetadataValue {
    let mut buf = [0u8; 8];
    let n = bytes.len().min(8);
    buf[..n].copy_from_slice(&bytes[..n]);
    let [b0, b1, b2, b3, ..] = buf;
    let two = [b0, b1];
    let four = [b0, b1, b2, b3];
    match ty {
        MetadataType::U8 => MetadataValue::U8(b0),
        MetadataType::I8 => MetadataValue::I8(b0 as i8),
        // Checked to be 0 or 1 by the caller.
        MetadataType::Bool => MetadataValue::Bool(b0 != 0),
        MetadataType::U16 => MetadataValue::U16(u16::from_le_bytes(two)),
        MetadataType::I16 => MetadataValue::I16(i16::from_le_bytes(two)),
        MetadataType::U32 => MetadataValue::U32(u32::from_le_bytes(four)),
        MetadataType::I32 => MetadataValue::I32(i32::from_le_bytes(four)),
        MetadataType::F32 => MetadataValue::F32(f32::from_le_bytes(four)),
        MetadataType::U64 => MetadataValue::U64(u64::from_le_bytes(buf)),
        MetadataType::I64 => MetadataValue::I64(i64::from_le_bytes(buf)),
        MetadataType::F64 => MetadataValue::F64(f64::from_le_bytes(buf)),
        // Not fixed-size; never passed here.
        MetadataType::String | MetadataType::Array => MetadataValue::Array(Vec::new()),
    }
}
