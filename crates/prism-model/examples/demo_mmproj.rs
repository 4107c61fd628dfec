//! Writes the bundled demo model's vision tower, `tests/fixtures/qwen35-tiny/` + [`DEMO_MMPROJ`]: the
//! qwen35-vl-tiny fixture's tower shape (3 blocks, width 64), its merger writing the demo decoder's
//! width (256), random seeded weights, F16 ([`SynthVisionSpec::demo`]).
//!
//! `cargo run -p prism-model --example demo_mmproj`. The test `demo_mmproj` writes it again in memory
//! and requires the committed file to be byte-identical.

use std::path::PathBuf;

use prism_gguf::GgufFile;
use prism_model::synth_vision::{self, SynthVisionSpec, DEMO_MMPROJ};
use prism_model::vision::VisionConfig;
use prism_model::Qwen35Config;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixtures = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"));
    let like = VisionConfig::from_gguf(&GgufFile::open(
        fixtures.join("qwen35-vl-tiny/mmproj-tiny-vl-F32.gguf"),
    )?)?;
    let text = Qwen35Config::from_gguf(&GgufFile::open(
        fixtures.join("qwen35-tiny/tiny-Q8_0.gguf"),
    )?)?;
    let spec = SynthVisionSpec::demo(&like, text.hidden_size);
    let path = fixtures.join("qwen35-tiny").join(DEMO_MMPROJ);
    std::fs::create_dir_all(path.parent().ok_or("the tower's path has no folder")?)?;
    let summary = synth_vision::write_mmproj(&path, &spec, |_| {})?;
    println!("{}: {summary:?}", path.display());
    Ok(())
}
