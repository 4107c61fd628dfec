//! What a command needs before it loads a model: which files (`--gguf`, `--model-dir`, or the bundled
//! demo model), which precision (`--precision`, `auto` read from the file) and which devices
//! (`--device`, `--gpus`). `prism serve`, `eval`, `decide` and `bench` share these rules.
//!
//! Like the other command drivers outside the CLI (`bench`, `eval::run`, `prism_server::loadgen`,
//! `prism_server::launch`), these return `anyhow` errors: they are read by a person, not matched.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use prism_model::Precision;

use crate::ModelSource;

/// The bundled demo model's directory: next to the binary's checkout (target/*/prism), else the source
/// tree this crate was built from.
pub fn bundled_model_dir() -> Option<PathBuf> {
    let relative = ["tests", "fixtures", "qwen35-tiny"];
    let from_binary = std::env::current_exe().ok().and_then(|exe| {
        exe.ancestors()
            .nth(3)
            .map(|root| relative.iter().fold(root.to_path_buf(), |p, c| p.join(c)))
    });
    let from_source = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/qwen35-tiny"
    ));
    from_binary
        .into_iter()
        .chain([from_source])
        .find(|dir| dir.join("tiny-Q8_0.gguf").is_file())
}

/// The model to load: `--gguf` (with `--model-dir` when given), or the bundled demo model (then the
/// bool is true). `alternative` ends the error when the demo model is not there (what else to pass).
pub fn model_source(
    gguf: &Option<PathBuf>,
    model_dir: &Option<PathBuf>,
    alternative: &str,
) -> Result<(ModelSource, bool)> {
    match (gguf, model_dir) {
        (Some(gguf), dir) => Ok((
            ModelSource {
                gguf: gguf.clone(),
                model_dir: dir.clone(),
                mmproj: None,
            },
            false,
        )),
        (None, Some(_)) => bail!("--model-dir needs --gguf (the model file)"),
        (None, None) => {
            let Some(dir) = bundled_model_dir() else {
                bail!(
                    "the bundled demo model (tests/fixtures/qwen35-tiny) is not next to this binary or its source \
                     tree; {alternative}"
                );
            };
            Ok((
                ModelSource {
                    gguf: dir.join("tiny-Q8_0.gguf"),
                    model_dir: Some(dir),
                    mmproj: None,
                },
                true,
            ))
        }
    }
}

/// `--precision` as asked: `auto` reads the file (Q8_0 → int8, K-quants → w4a8, except on a GPU, where
/// a K-quant file runs at bf16: w4a8 there has only its simple, slow kernel so far, and the note says
/// so).
pub fn resolve_precision(
    asked: &str,
    source: &ModelSource,
    on_gpu: bool,
) -> Result<(Precision, Option<&'static str>)> {
    if asked != "auto" {
        return Ok((Precision::parse(asked)?, None));
    }
    let gguf = prism_gguf::GgufFile::open(&source.gguf)
        .with_context(|| format!("opening {}", source.gguf.display()))?;
    Ok(match Precision::resolve("auto", &gguf)? {
        Precision::W4a8 if on_gpu => (
            Precision::Bf16,
            Some("a K-quant file on a GPU runs at bf16 (w4a8 there has only its simple, slow kernel so far; --precision w4a8 asks for it)"),
        ),
        p => (p, None),
    })
}

/// The devices `--device` and `--gpus` name: one, or each GPU of a list of several. The note, when
/// there is one, says why `auto` fell back to the CPU.
pub fn open_devices(name: &str, gpus: &[usize]) -> Result<(Vec<Device>, Option<String>)> {
    if gpus.len() <= 1 {
        let (device, note) = open_device(name, gpus)?;
        return Ok((vec![device], note));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = gpus.iter().find(|&&g| !seen.insert(g)) {
        bail!("--gpus {gpus:?}: GPU {twice} is named twice (use --replicas for several replicas on one GPU)");
    }
    let devices = gpus
        .iter()
        .map(|&g| open_device(name, &[g]).map(|(device, _)| device))
        .collect::<Result<_>>()?;
    Ok((devices, None))
}

/// The device `--device` and `--gpus` name. The note, when there is one, says why `auto` fell back to
/// the CPU (no usable GPU: the error).
pub fn open_device(name: &str, gpus: &[usize]) -> Result<(Device, Option<String>)> {
    if gpus.len() > 1 {
        bail!("--gpus {gpus:?}: this command runs on one GPU");
    }
    let ordinal = gpus.first().copied().unwrap_or(0);
    match name {
        "cpu" => {
            if !gpus.is_empty() {
                bail!("--gpus needs --device cuda or auto");
            }
            Ok((Device::Cpu, None))
        }
        "cuda" | "auto" => {
            #[cfg(feature = "cuda")]
            {
                match prism_quant::cuda_launch::open_device(ordinal) {
                    Ok(device) => Ok((device, None)),
                    Err(error) if name == "auto" && gpus.is_empty() => {
                        Ok((Device::Cpu, Some(error.to_string())))
                    }
                    Err(error) => Err(error).context(format!("opening CUDA device {ordinal}")),
                }
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = ordinal;
                if name == "cuda" || !gpus.is_empty() {
                    bail!("--device cuda / --gpus: this prism was built without the `cuda` feature (cargo build --features cuda)");
                }
                Ok((Device::Cpu, None))
            }
        }
        other => bail!("--device {other:?}: expected auto, cpu or cuda"),
    }
}

/// Free and total device memory in bytes; `None` on the CPU.
pub fn device_free_memory(device: &Device) -> Option<(u64, u64)> {
    prism_model::device_memory(device).map(|(used, total)| (total - used, total))
}
