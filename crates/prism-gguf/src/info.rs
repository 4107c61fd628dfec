//! `prism gguf info`'s report: a file's header, every metadata key with its type and value (long strings
//! and arrays shortened), and a table of its tensors (name, type, shape, elements, bytes) with totals.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use crate::{GgufFile, MetadataValue};

/// Arrays longer than this are shown as a count and their first few items.
const ARRAY_ITEMS_SHOWN: usize = 6;
/// Strings longer than this (in characters) are cut, with their full length noted.
const STRING_CHARS_SHOWN: usize = 64;

/// Writes the report of `gguf` (opened from `path`) to `out`.
pub fn write_info(gguf: &GgufFile, path: &Path, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "file:        {}", path.display())?;
    writeln!(out, "version:     {}", gguf.version())?;
    writeln!(out, "alignment:   {}", gguf.alignment())?;
    writeln!(
        out,
        "size:        {} bytes (data section at {})",
        gguf.file_len(),
        gguf.data_offset()
    )?;
    writeln!(out)?;

    writeln!(out, "metadata ({} keys):", gguf.metadata().len())?;
    let key_width = gguf
        .metadata()
        .iter()
        .map(|(k, _)| k.len())
        .max()
        .unwrap_or(0);
    let typed: Vec<String> = gguf
        .metadata()
        .iter()
        .map(|(_, v)| v.full_type_name())
        .collect();
    let type_width = typed.iter().map(String::len).max().unwrap_or(0);
    for ((key, value), ty) in gguf.metadata().iter().zip(&typed) {
        writeln!(
            out,
            "  {key:<key_width$}  {ty:<type_width$}  {}",
            show_value(value)
        )?;
    }
    writeln!(out)?;

    let tensors = gguf.tensors();
    writeln!(
        out,
        "tensors ({}; shape in ggml ne order, ne0 = contiguous row length first):",
        tensors.len()
    )?;
    let rows: Vec<[String; 6]> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let shape = t
                .dims
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            [
                i.to_string(),
                t.name.clone(),
                t.ggml_type.name().to_string(),
                format!("[{shape}]"),
                t.n_elements().to_string(),
                t.n_bytes().to_string(),
            ]
        })
        .collect();
    let header = ["#", "name", "type", "shape", "elements", "bytes"].map(str::to_string);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let print_row = |out: &mut dyn Write, row: &[String; 6]| -> std::io::Result<()> {
        let [idx, name, ty, shape, elements, bytes] = row;
        writeln!(
            out,
            "  {idx:>w0$}  {name:<w1$}  {ty:<w2$}  {shape:<w3$}  {elements:>w4$}  {bytes:>w5$}",
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
            w4 = widths[4],
            w5 = widths[5],
        )
    };
    print_row(out, &header)?;
    for row in &rows {
        print_row(out, row)?;
    }

    let total_elements: u64 = tensors.iter().map(|t| t.n_elements()).sum();
    let total_bytes: u64 = tensors.iter().map(|t| t.n_bytes()).sum();
    let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
    for t in tensors {
        *by_type.entry(t.ggml_type.name()).or_default() += 1;
    }
    let by_type: Vec<String> = by_type.iter().map(|(ty, n)| format!("{n} {ty}")).collect();
    writeln!(
        out,
        "total: {} tensors ({}), {total_elements} elements, {total_bytes} bytes",
        tensors.len(),
        by_type.join(", ")
    )?;
    Ok(())
}

/// One metadata value on one line: strings quoted and escaped, long strings and arrays shortened.
pub fn show_value(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(s) => show_string(s),
        MetadataValue::Array(items) => {
            let shown: Vec<String> = items
                .iter()
                .take(ARRAY_ITEMS_SHOWN)
                .map(show_value)
                .collect();
            if items.len() <= ARRAY_ITEMS_SHOWN {
                format!("[{}]", shown.join(", "))
            } else {
                format!("[{} items: {}, …]", items.len(), shown.join(", "))
            }
        }
        MetadataValue::U8(v) => v.to_string(),
        MetadataValue::I8(v) => v.to_string(),
        MetadataValue::U16(v) => v.to_string(),
        MetadataValue::I16(v) => v.to_string(),
        MetadataValue::U32(v) => v.to_string(),
        MetadataValue::I32(v) => v.to_string(),
        MetadataValue::U64(v) => v.to_string(),
        MetadataValue::I64(v) => v.to_string(),
        MetadataValue::F32(v) => format!("{v:?}"),
        MetadataValue::F64(v) => format!("{v:?}"),
        MetadataValue::Bool(v) => v.to_string(),
    }
}

fn show_string(s: &str) -> String {
    let n_chars = s.chars().count();
    if n_chars <= STRING_CHARS_SHOWN {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(STRING_CHARS_SHOWN).collect();
        format!("{head:?}… ({n_chars} chars)")
    }
}
