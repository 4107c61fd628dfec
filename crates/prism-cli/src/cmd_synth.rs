//! `prism synth`: write a random-weight model directory with the real Qwen3.5 shapes of a size.
//!
//! DIR gets `model.gguf` (every tensor and metadata key a llama.cpp `qwen35` file of that size and type
//! has, the real 248k vocabulary and the chat template) and the small files prism's loaders read
//! (`config.json`, `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
//! `generation_config.json`, `decision_config.json`). The small files are written and checked first;
//! then the GGUF is streamed (generated and quantized in parallel, written by a second thread), and
//! finally read back: every offset validated, the configuration compared with what was asked for and
//! with `config.json`.
//!
//! With `--mmproj`, DIR also gets the size's vision tower as `mmproj-Qwen3.5-<SIZE>-synth-<TYPE>.gguf`
//! ([`prism_model::synth_vision`]: the keys and tensor names of llama.cpp's converter, random seeded
//! weights, the merger writing the decoder's width), read back and checked the same way; an earlier
//! synthetic mmproj of another type is removed, so the directory holds one and `prism serve
//! --model-dir DIR` finds it. `--mmproj-only` writes that file alone.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use prism_decision::synth_files::{self, ModelDirFiles, GGUF_NAME};
use prism_decision::tokenizer::RankedVocabulary;
use prism_gguf::GgufFile;
use prism_model::synth::{self, SynthFileType, SynthSize, SynthSpec};
use prism_model::synth_vision::{self, MmprojFileType, SynthVisionSpec};
use prism_model::vision::VisionConfig;
use prism_model::Qwen35Config;

use crate::SynthArgs;

fn fixtures_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

/// The real Qwen3.5 rank file bundled in the repository.
fn default_ranks() -> PathBuf {
    fixtures_dir().join("qwen35-vocab/qwen3_6.tiktoken")
}

/// The real Qwen3.5 chat template bundled in the repository.
fn default_chat_template() -> PathBuf {
    fixtures_dir().join("qwen35-tiny/chat_template.jinja")
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

pub fn run(args: &SynthArgs) -> Result<()> {
    let started = Instant::now();
    let size = SynthSize::parse(&args.shape)?;
    let file_type = SynthFileType::parse(&args.r#type)?;
    let mut spec = SynthSpec::new(size, file_type, args.seed);
    if let Some(layers) = args.layers {
        spec = spec.with_layers(layers)?;
        spec.name = format!("{} ({layers} layers)", spec.name);
    }
    spec.mtp = args.mtp;
    let vision = if args.mmproj || args.mmproj_only {
        let mut v =
            SynthVisionSpec::new(size, MmprojFileType::parse(&args.mmproj_type)?, args.seed);
        if let Some(blocks) = args.vision_blocks {
            v = v.with_blocks(blocks)?;
            v.name = format!("{} ({blocks} blocks)", v.name);
        }
        // The merger writes the decoder's width, whatever was cut above.
        v.config.projection = spec.config.hidden_size;
        Some(v)
    } else {
        if args.vision_blocks.is_some() {
            bail!("--vision-blocks needs --mmproj");
        }
        None
    };

    if args.mmproj_only {
        if let Some(vision) = &vision {
            std::fs::create_dir_all(&args.out)
                .with_context(|| format!("cannot create {}", args.out.display()))?;
            write_mmproj(args, size, vision)?;
        }
        return Ok(());
    }

    let ranks_path = args.ranks.clone().unwrap_or_else(default_ranks);
    let text = std::fs::read_to_string(&ranks_path).with_context(|| {
        format!(
            "cannot read the vocabulary rank file {}",
            ranks_path.display()
        )
    })?;
    let mut ranks = RankedVocabulary::parse_tiktoken(&text).map_err(|problem| {
        anyhow::anyhow!(
            "{}: bad tiktoken rank list: {problem}",
            ranks_path.display()
        )
    })?;
    if let Some(n) = args.vocab_ranks {
        // Test-only: the first n ranks (as the tiny fixture's tokenizer was cut), no padding rows.
        if n < 256 || n > ranks.len() {
            bail!("--vocab-ranks {n}: must be 256..={}", ranks.len());
        }
        let tokens = (0..n as u32)
            .filter_map(|r| ranks.bytes(r).map(<[u8]>::to_vec))
            .collect();
        ranks = RankedVocabulary::from_tokens_in_rank_order(tokens)
            .map_err(|problem| anyhow::anyhow!("truncated rank list: {problem}"))?;
        spec.config.vocab_size = n + synth_files::QWEN35_ADDED_TOKENS.len();
    }
    let template_path = args
        .chat_template
        .clone()
        .unwrap_or_else(default_chat_template);
    let chat_template = std::fs::read_to_string(&template_path)
        .with_context(|| format!("cannot read the chat template {}", template_path.display()))?;

    let vocab = synth_files::qwen35_vocabulary(&ranks, spec.config.vocab_size)?;
    let tensors = spec.tensors();
    let params: u64 = tensors.iter().map(|t| t.n_elements()).sum();
    let data_bytes: u64 = tensors
        .iter()
        .map(|t| t.ty.bytes_for(t.n_elements()).unwrap_or(0))
        .sum();
    eprintln!(
        "synth: Qwen3.5-{} {} — {} layers ({} DeltaNet + {} attention){}, {} tensors, {:.3} B parameters, \
         ~{:.2} GB of tensor data, seed {}",
        size.label(),
        file_type.name(),
        spec.config.n_layers,
        spec.config.layer_kinds.iter().filter(|k| **k == prism_model::LayerKind::DeltaNet).count(),
        spec.config.layer_kinds.iter().filter(|k| **k == prism_model::LayerKind::Attention).count(),
        if spec.mtp { " + MTP block" } else { "" },
        tensors.len(),
        params as f64 / 1e9,
        gb(data_bytes),
        spec.seed,
    );

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let dir_files = ModelDirFiles {
        hf_config: spec.hf_config_json(vocab.padding_token_id),
        chat_template: chat_template.clone(),
        context_length: spec.config.context_length,
    };
    let written =
        synth_files::write_model_dir(&args.out, &vocab, &dir_files).with_context(|| {
            format!(
                "writing the model directory files into {}",
                args.out.display()
            )
        })?;
    eprintln!(
        "synth: wrote {} small files (letters A..Z = ids {}..{}) in {:.1} s",
        written.files.len(),
        written.letter_token_ids[0],
        written.letter_token_ids[25],
        started.elapsed().as_secs_f64()
    );

    let gguf_path = args.out.join(GGUF_NAME);
    let metadata = synth_files::gguf_tokenizer_metadata(&vocab, &chat_template);
    let writing = Instant::now();
    let mut last_report = Instant::now();
    let mut stderr = std::io::stderr();
    let summary = synth::write_gguf(&gguf_path, &spec, metadata, |p| {
        if last_report.elapsed().as_secs_f64() >= 2.0 {
            last_report = Instant::now();
            let secs = writing.elapsed().as_secs_f64();
            let _ = writeln!(
                stderr,
                "synth: {:5.1}%  {:.2}/{:.2} GB  {:.2} GB/s  tensor {}/{} {}",
                100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
                gb(p.bytes_done),
                gb(p.bytes_total),
                gb(p.bytes_done) / secs.max(1e-9),
                p.tensors_done + 1,
                p.tensors_total,
                p.tensor
            );
        }
    })
    .with_context(|| format!("writing {}", gguf_path.display()))?;
    let write_secs = writing.elapsed().as_secs_f64();

    // Read back: the reader validates every count and offset; the configuration must be the one asked
    // for, and config.json must agree with it.
    let gguf = GgufFile::open(&gguf_path)
        .with_context(|| format!("reading back {}", gguf_path.display()))?;
    let config = Qwen35Config::from_gguf(&gguf).context("the written GGUF's configuration")?;
    if config != spec.config {
        bail!(
            "the written GGUF reads back as {config:?}, not {:?}",
            spec.config
        );
    }
    config
        .check_hf_config_file(&args.out.join("config.json"))
        .context("config.json against the GGUF")?;
    if gguf.tensors().len() != summary.n_tensors || gguf.file_len() != summary.file_bytes {
        bail!(
            "the written GGUF has {} tensors and {} bytes; {} and {} were written",
            gguf.tensors().len(),
            gguf.file_len(),
            summary.n_tensors,
            summary.file_bytes
        );
    }
    println!(
        "wrote {} ({:.2} GB, {} tensors, {:.3} B parameters) in {:.1} s ({:.2} GB/s); total {:.1} s",
        gguf_path.display(),
        gb(summary.file_bytes),
        summary.n_tensors,
        summary.n_elements as f64 / 1e9,
        write_secs,
        gb(summary.file_bytes) / write_secs.max(1e-9),
        started.elapsed().as_secs_f64()
    );
    if let Some(vision) = &vision {
        write_mmproj(args, size, vision)?;
    }
    println!(
        "try: prism decide --gguf {} --model-dir {} examples/request.json",
        gguf_path.display(),
        args.out.display()
    );
    Ok(())
}

/// Writes the vision tower next to the model, removes a synthetic mmproj of another type written
/// there before, and reads the file back: its configuration must be the one asked for and its tensors
/// the planned ones.
fn write_mmproj(args: &SynthArgs, size: SynthSize, spec: &SynthVisionSpec) -> Result<()> {
    let model_name = format!("Qwen3.5-{}-synth", size.label());
    let file_name = spec.file_name(&model_name);
    for other in [
        MmprojFileType::F32,
        MmprojFileType::F16,
        MmprojFileType::Bf16,
    ] {
        let stale = args
            .out
            .join(format!("mmproj-{model_name}-{}.gguf", other.name()));
        if other != spec.file_type && stale.exists() {
            std::fs::remove_file(&stale)
                .with_context(|| format!("removing the earlier {}", stale.display()))?;
            eprintln!("synth: removed the earlier {}", stale.display());
        }
    }
    let path = args.out.join(&file_name);
    let c = &spec.config;
    eprintln!(
        "synth: vision tower {} — {} blocks, width {}, {} heads, MLP {}, merger → {}",
        spec.file_type.name(),
        c.blocks,
        c.hidden,
        c.heads,
        c.ffn,
        c.projection
    );
    let writing = Instant::now();
    let summary = synth_vision::write_mmproj(&path, spec, |_| {})
        .with_context(|| format!("writing {}", path.display()))?;
    let gguf = GgufFile::open(&path).with_context(|| format!("reading back {}", path.display()))?;
    let config = VisionConfig::from_gguf(&gguf).context("the written mmproj's configuration")?;
    if &config != c {
        bail!("the written mmproj reads back as {config:?}, not {c:?}");
    }
    let planned: Vec<(String, Vec<u64>)> = spec
        .tensors()
        .into_iter()
        .map(|t| (t.name, t.dims))
        .collect();
    let found: Vec<(String, Vec<u64>)> = gguf
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone()))
        .collect();
    if planned != found || gguf.file_len() != summary.file_bytes {
        bail!(
            "the written mmproj has {} tensors and {} bytes; {} and {} were written",
            found.len(),
            gguf.file_len(),
            planned.len(),
            summary.file_bytes
        );
    }
    println!(
        "wrote {} ({:.2} GB, {} tensors, {:.3} B parameters) in {:.1} s",
        path.display(),
        gb(summary.file_bytes),
        summary.n_tensors,
        summary.n_elements as f64 / 1e9,
        writing.elapsed().as_secs_f64()
    );
    Ok(())
}
