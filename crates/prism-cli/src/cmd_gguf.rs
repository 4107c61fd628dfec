//! `prism gguf info`: the report is `prism_gguf::info`.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use prism_gguf::GgufFile;

/// Prints the file's metadata and a table of its tensors to `out`.
pub fn info(path: &Path, out: &mut impl Write) -> Result<()> {
    let gguf = GgufFile::open(path)
        .with_context(|| format!("cannot read GGUF file {}", path.display()))?;
    match prism_gguf::info::write_info(&gguf, path, out) {
        // The reader of our output went away (`prism gguf info x.gguf | head`): not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("cannot write the report"),
    }
}
