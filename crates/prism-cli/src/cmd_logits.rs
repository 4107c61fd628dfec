//! `prism logits`.

use anyhow::Result;

use crate::LogitsArgs;

pub fn run(args: &LogitsArgs) -> Result<()> {
    anyhow::bail!("`prism logits --gguf {}`: not implemented yet", args.gguf.display())
}
