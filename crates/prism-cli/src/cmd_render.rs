//! `prism render`.

use anyhow::Result;

use crate::RenderArgs;

pub fn run(args: &RenderArgs) -> Result<()> {
    anyhow::bail!("`prism render {}`: not implemented yet", args.request.display())
}
