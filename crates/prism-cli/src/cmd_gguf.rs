//! `prism gguf info`.

use std::io::Write;
use std::path::Path;

use anyhow::Result;

/// Prints the file's metadata and a table of its tensors to `out`.
pub fn info(path: &Path, out: &mut impl Write) -> Result<()> {
    let _ = out;
    anyhow::bail!("`prism gguf info {}`: not implemented yet", path.display())
}
