//! The bundled demo model's vision tower (`tests/fixtures/qwen35-tiny/vision/`) is what
//! `examples/demo_mmproj.rs` writes, byte for byte, and loads as a tower for the demo decoder.

use std::path::PathBuf;

use prism_gguf::GgufFile;
use prism_model::synth_vision::{self, SynthVisionSpec, DEMO_MMPROJ};
use prism_model::vision::VisionConfig;
use prism_model::Qwen35Config;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

#[test]
fn the_demo_tower_is_the_generators_output_and_fits_the_demo_decoder() {
    let like = VisionConfig::from_gguf(
        &GgufFile::open(fixtures().join("qwen35-vl-tiny/mmproj-tiny-vl-F32.gguf")).unwrap(),
    )
    .unwrap();
    let text = Qwen35Config::from_gguf(
        &GgufFile::open(fixtures().join("qwen35-tiny/tiny-Q8_0.gguf")).unwrap(),
    )
    .unwrap();
    let spec = SynthVisionSpec::demo(&like, text.hidden_size);
    let (written, _) = synth_vision::write_mmproj_to(Vec::new(), &spec, |_| {}).unwrap();
    let path = fixtures().join("qwen35-tiny").join(DEMO_MMPROJ);
    let committed = std::fs::read(&path).unwrap();
    assert!(
        written == committed,
        "{} differs from what `cargo run -p prism-model --example demo_mmproj` writes ({} against {} bytes)",
        path.display(),
        committed.len(),
        written.len()
    );
    let config = VisionConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert_eq!(config.projection, text.hidden_size);
    assert_eq!(
        VisionConfig {
            projection: like.projection,
            ..config
        },
        like,
        "the demo tower has the reference fixture's shape"
    );
}
