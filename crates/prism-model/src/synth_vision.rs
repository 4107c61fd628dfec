//! Random-weight Qwen3.5 vision towers with the real shapes, written as the `mmproj` GGUF llama.cpp's
//! `convert_hf_to_gguf.py --mmproj` writes: the same `clip.*` keys, in the same order, and the same `v.*` /
//! `mm.*` tensor names and dims as `tests/fixtures/qwen35-vl-tiny/mmproj-tiny-vl-F32.gguf` (which the
//! converter wrote), so [`crate::vision::VisionWeights::load`] reads it like a released file.
//!
//! [`SynthSize::vision_config`] gives the tower of each released size (qwen35-reference §1.2; the
//! 9B/27B tower is transformers' `Qwen3_5VisionConfig` default: 27 blocks, width 1152, 16 heads of 72,
//! MLP 4304, patch 16, merge 2, a 48×48 learned position grid), with the merger writing the decoder's
//! width. [`SynthVisionSpec::tensors`] lists the file's tensors with the storage types the converter
//! picks for an output type ([`MmprojFileType`]): for F16, the two patch-embedding kernels and every
//! other matrix F16, the learned positions and every 1-D tensor F32 (its `tensor_force_quant` and
//! its always-F32 list); for BF16 the patch kernels F32 and the other matrices BF16; for F32 all F32.
//!
//! Values come from [`crate::synth::fill_values`] keyed by (seed, tensor name), so a file is a pure
//! function of its spec: two writes give the same bytes.

use std::io::Write;
use std::path::Path;

use prism_gguf::{GgmlType, MetadataValue};

use crate::synth::{
    write_tensors_to, Init, SynthError, SynthProgress, SynthSize, SynthSummary, SynthTensor,
};
use crate::vision::{VisionConfig, PROJECTOR, TEMPORAL_PATCH};

/// The output types llama.cpp's converter writes an mmproj in (`--outtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmprojFileType {
    F32,
    F16,
    Bf16,
}

impl MmprojFileType {
    /// `f32`, `f16`, `bf16` (case-insensitive).
    pub fn parse(s: &str) -> Result<Self, SynthError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            _ => Err(SynthError::UnknownFileType(format!(
                "{s} (an mmproj is f32, f16 or bf16)"
            ))),
        }
    }

    /// `F32`, `F16`, `BF16`: the suffix of the released file names (`mmproj-…-F16.gguf`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
        }
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`: ALL_F32 0, MOSTLY_F16 1, MOSTLY_BF16 32).
    pub fn ftype(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Bf16 => 32,
        }
    }

    /// The type of a matrix that is neither the patch embedding nor the positions.
    fn matrix(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::Bf16 => GgmlType::BF16,
        }
    }

    /// The patch-embedding kernels' type: F16 in an F16 file, else F32 (the converter's
    /// `tensor_force_quant` for `.patch_embd.weight`).
    fn patch(self) -> GgmlType {
        match self {
            Self::F16 => GgmlType::F16,
            Self::F32 | Self::Bf16 => GgmlType::F32,
        }
    }
}

/// The released towers (qwen35-reference §1.2). The 2B tower's heads and MLP width are not confirmed
/// by an official config; they are taken equal to the 4B's.
const fn tower(size: SynthSize) -> (usize, usize, usize, usize) {
    // (blocks, width, heads, MLP width)
    match size {
        SynthSize::B0_8 => (12, 768, 12, 3072),
        SynthSize::B2 | SynthSize::B4 => (24, 1024, 16, 4096),
        SynthSize::B9 | SynthSize::B27 => (27, 1152, 16, 4304),
    }
}

/// Side of the learned position grid of every release (`num_position_embeddings` 2304 = 48²).
pub const POSITION_GRID: usize = 48;

impl SynthSize {
    /// The vision tower of this size, its merger writing the decoder's width
    /// (`out_hidden_size` = the text `hidden_size`).
    pub fn vision_config(self) -> VisionConfig {
        let (blocks, hidden, heads, ffn) = tower(self);
        VisionConfig {
            hidden,
            ffn,
            blocks,
            heads,
            patch: 16,
            merge: 2,
            projection: self.config().hidden_size,
            position_grid: POSITION_GRID,
            // The converter copies the text `rms_norm_eps` (1e-6) and stores it as f32.
            eps: f64::from(1e-6f32),
            mean: [0.5; 3],
            std: [0.5; 3],
        }
    }
}

/// The bundled demo model's vision tower ([`SynthVisionSpec::demo`]), relative to the demo model's
/// directory (`tests/fixtures/qwen35-tiny`): in a folder of its own, so loading that directory finds no
/// `mmproj-*.gguf` by itself (the v1 demo reads no images).
pub const DEMO_MMPROJ: &str = "vision/mmproj-qwen35-tiny-demo-F16.gguf";

/// The seed of the demo tower's weights.
pub const DEMO_SEED: u64 = 22;

/// A synthetic mmproj: the tower's shape, the output type and the seed.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthVisionSpec {
    /// `general.name`.
    pub name: String,
    pub config: VisionConfig,
    pub file_type: MmprojFileType,
    pub seed: u64,
}

/// Weights of the block and merger matrices (transformers' `initializer_range`).
const MATRIX: Init = Init::normal(0.0, 0.02);
/// Biases.
const BIAS: Init = Init::normal(0.0, 0.02);
/// LayerNorm scales.
const NORM: Init = Init::normal(1.0, 0.02);
/// The patch kernels: an embedding of RMS about 0.7 from pixels in [−1, 1] (as the fixture's recipe).
const PATCH: Init = Init::normal(0.0, 0.03);
/// The learned positions (as the fixture's recipe).
const POSITIONS: Init = Init::normal(0.0, 0.5);

impl SynthVisionSpec {
    /// The tower of a released size.
    pub fn new(size: SynthSize, file_type: MmprojFileType, seed: u64) -> Self {
        Self {
            name: format!(
                "Qwen3.5-{} vision tower synthetic (random weights, seed {seed})",
                size.label()
            ),
            config: size.vision_config(),
            file_type,
            seed,
        }
    }

    /// The bundled demo model's vision tower (`tests/fixtures/qwen35-tiny/vision/`): the shape of a
    /// tiny reference tower (`like`: the qwen35-vl-tiny fixture's, read from its mmproj), its merger
    /// writing `projection` (the demo decoder's width), random seeded weights. The demo model's weights
    /// are random too; this lets the demo read images.
    /// F16, seed [`DEMO_SEED`]; the file is [`DEMO_MMPROJ`] in the demo model's directory.
    pub fn demo(like: &VisionConfig, projection: usize) -> Self {
        Self {
            name: format!("qwen35-tiny demo vision tower (random weights, seed {DEMO_SEED})"),
            config: VisionConfig {
                projection,
                ..like.clone()
            },
            file_type: MmprojFileType::F16,
            seed: DEMO_SEED,
        }
    }

    /// Keeps the first `blocks` ViT blocks (widths unchanged).
    pub fn with_blocks(mut self, blocks: usize) -> Result<Self, SynthError> {
        crate::synth::at_least_one("vision blocks", blocks)?;
        self.config.blocks = blocks;
        Ok(self)
    }

    /// The file name a release gives this tower next to model `name`: `mmproj-{name}-{TYPE}.gguf`.
    pub fn file_name(&self, name: &str) -> String {
        format!("mmproj-{name}-{}.gguf", self.file_type.name())
    }

    fn check(&self) -> Result<(), SynthError> {
        let c = &self.config;
        let invalid = |reason: String| SynthError::InvalidSpec {
            field: "vision config",
            reason,
        };
        for (what, v) in [
            ("hidden", c.hidden),
            ("ffn", c.ffn),
            ("blocks", c.blocks),
            ("heads", c.heads),
            ("patch", c.patch),
            ("merge", c.merge),
            ("projection", c.projection),
            ("position_grid", c.position_grid),
        ] {
            if v == 0 {
                return Err(invalid(format!("{what} must be at least 1")));
            }
        }
        if c.hidden % c.heads != 0 || c.head_dim() % 4 != 0 {
            return Err(invalid(format!(
                "{} heads must divide the width {} into heads of a multiple of 4",
                c.heads, c.hidden
            )));
        }
        Ok(())
    }

    /// Every tensor of the file in the converter's order (the checkpoint's names sorted: the blocks,
    /// the merger, the patch embedding, the positions), with its storage type.
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let c = &self.config;
        let (h, f, p) = (c.hidden as u64, c.ffn as u64, c.patch as u64);
        let merged = c.merged_width() as u64;
        let matrix = self.file_type.matrix();
        let t = |name: String, dims: Vec<u64>, ty: GgmlType, init: Init| SynthTensor {
            name,
            dims,
            ty,
            init,
        };
        let mut out = Vec::new();
        // A linear's weight is `[in, out]` in ggml order, its bias `[out]`.
        let linear = |out: &mut Vec<SynthTensor>, name: &str, inputs: u64, outputs: u64| {
            out.push(t(
                format!("{name}.bias"),
                vec![outputs],
                GgmlType::F32,
                BIAS,
            ));
            out.push(t(
                format!("{name}.weight"),
                vec![inputs, outputs],
                matrix,
                MATRIX,
            ));
        };
        for i in 0..c.blocks {
            let b = |s: &str| format!("v.blk.{i}.{s}");
            linear(&mut out, &b("attn_out"), h, h);
            linear(&mut out, &b("attn_qkv"), h, 3 * h);
            linear(&mut out, &b("ffn_up"), h, f);
            linear(&mut out, &b("ffn_down"), f, h);
            for norm in ["ln1", "ln2"] {
                out.push(t(b(&format!("{norm}.bias")), vec![h], GgmlType::F32, BIAS));
                out.push(t(
                    b(&format!("{norm}.weight")),
                    vec![h],
                    GgmlType::F32,
                    NORM,
                ));
            }
        }
        linear(&mut out, "mm.0", merged, merged);
        linear(&mut out, "mm.2", merged, c.projection as u64);
        out.push(t("v.post_ln.bias".into(), vec![h], GgmlType::F32, BIAS));
        out.push(t("v.post_ln.weight".into(), vec![h], GgmlType::F32, NORM));
        out.push(t("v.patch_embd.bias".into(), vec![h], GgmlType::F32, BIAS));
        let patch = self.file_type.patch();
        for name in ["v.patch_embd.weight", "v.patch_embd.weight.1"] {
            out.push(t(name.into(), vec![p, p, 3, h], patch, PATCH));
        }
        let grid = c.position_grid as u64;
        out.push(t(
            "v.position_embd.weight".into(),
            vec![h, grid * grid],
            GgmlType::F32,
            POSITIONS,
        ));
        debug_assert_eq!(TEMPORAL_PATCH, 2, "two patch kernels");
        out
    }

    /// The file's keys in the converter's order (as the fixture's mmproj has them).
    pub fn metadata(&self) -> Vec<(String, MetadataValue)> {
        let c = &self.config;
        let params: u64 = self.tensors().iter().map(SynthTensor::n_elements).sum();
        let u = |v: usize| MetadataValue::U32(v as u32);
        let triple = |v: [f32; 3]| MetadataValue::Array(v.map(MetadataValue::F32).to_vec());
        let s = |v: &str| MetadataValue::String(v.into());
        let kv = |k: &str, v: MetadataValue| (k.to_string(), v);
        vec![
            kv("general.architecture", s("clip")),
            kv("general.type", s("mmproj")),
            kv("general.name", s(&self.name)),
            kv("general.size_label", s(&size_label(params))),
            kv(
                "general.file_type",
                MetadataValue::U32(self.file_type.ftype()),
            ),
            kv("clip.has_vision_encoder", MetadataValue::Bool(true)),
            kv("clip.vision.projection_dim", u(c.projection)),
            kv("clip.vision.image_size", u(c.position_grid * c.patch)),
            kv("clip.vision.patch_size", u(c.patch)),
            kv("clip.vision.embedding_length", u(c.hidden)),
            kv("clip.vision.feed_forward_length", u(c.ffn)),
            kv("clip.vision.block_count", u(c.blocks)),
            kv("clip.vision.attention.head_count", u(c.heads)),
            kv("clip.vision.image_mean", triple(c.mean)),
            kv("clip.vision.image_std", triple(c.std)),
            kv("clip.projector_type", s(PROJECTOR)),
            kv("clip.use_gelu", MetadataValue::Bool(true)),
            kv("clip.vision.spatial_merge_size", u(c.merge)),
            kv(
                "clip.vision.attention.layer_norm_epsilon",
                MetadataValue::F32(c.eps as f32),
            ),
            kv(
                "clip.vision.is_deepstack_layers",
                MetadataValue::Array(vec![MetadataValue::Bool(false); c.blocks]),
            ),
            kv("general.quantization_version", MetadataValue::U32(2)),
        ]
    }
}

/// gguf-py's `size_label` for a parameter count (`model_weight_count_rounded_notation`): scaled to
/// K, M, B or T, with as many decimals as make at least 2 significant digits (`445K`, `461M`, `1.5M`).
fn size_label(params: u64) -> String {
    let p = params as f64;
    let (scaled, unit) = if p > 1e12 {
        (p * 1e-12, "T")
    } else if p > 1e9 {
        (p * 1e-9, "B")
    } else if p > 1e6 {
        (p * 1e-6, "M")
    } else {
        (p * 1e-3, "K")
    };
    let digits = format!("{}", scaled.round() as u64)
        .trim_start_matches('0')
        .len();
    let decimals = 2usize.saturating_sub(digits);
    format!("{scaled:.decimals$}{unit}")
}

/// Writes the mmproj of `spec` to `path`; `progress` is called after each batch of chunks.
pub fn write_mmproj(
    path: &Path,
    spec: &SynthVisionSpec,
    progress: impl FnMut(&SynthProgress<'_>),
) -> Result<SynthSummary, SynthError> {
    crate::synth::write_file(path, |out| write_mmproj_to(out, spec, progress))
}

/// As [`write_mmproj`], into any sink; returns it with the summary.
pub fn write_mmproj_to<W: Write + Send>(
    out: W,
    spec: &SynthVisionSpec,
    progress: impl FnMut(&SynthProgress<'_>),
) -> Result<(W, SynthSummary), SynthError> {
    spec.check()?;
    write_tensors_to(out, spec.metadata(), &spec.tensors(), spec.seed, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vision::VisionWeights;
    use candle_core::Device;
    use prism_gguf::GgufFile;

    fn fixture() -> GgufFile {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen35-vl-tiny/mmproj-tiny-vl-F32.gguf");
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The fixture's tower, F32, seed 7.
    fn tiny(file_type: MmprojFileType) -> SynthVisionSpec {
        SynthVisionSpec {
            name: "tiny".into(),
            config: VisionConfig::from_gguf(&fixture()).unwrap(),
            file_type,
            seed: 7,
        }
    }

    fn write(spec: &SynthVisionSpec) -> Vec<u8> {
        write_mmproj_to(Vec::new(), spec, |_| {}).unwrap().0
    }

    #[test]
    fn the_tiny_tower_has_the_fixtures_keys_and_tensors() {
        let theirs = fixture();
        let bytes = write(&tiny(MmprojFileType::F32));
        let ours = GgufFile::from_bytes(bytes).unwrap();
        let listing = |g: &GgufFile| -> Vec<(String, Vec<u64>, GgmlType)> {
            g.tensors()
                .iter()
                .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
                .collect()
        };
        assert_eq!(listing(&ours), listing(&theirs));
        // Every key, in order; the same values but the name and the size label.
        let keys =
            |g: &GgufFile| -> Vec<String> { g.metadata().iter().map(|(k, _)| k.clone()).collect() };
        assert_eq!(keys(&ours), keys(&theirs));
        for (key, value) in theirs.metadata() {
            if key == "general.name" {
                continue;
            }
            assert_eq!(ours.get(key), Some(value), "{key}");
        }
        assert_eq!(
            VisionConfig::from_gguf(&ours).unwrap(),
            VisionConfig::from_gguf(&theirs).unwrap()
        );
    }

    #[test]
    fn two_writes_are_the_same_bytes_and_the_tower_runs() {
        for ty in [
            MmprojFileType::F16,
            MmprojFileType::Bf16,
            MmprojFileType::F32,
        ] {
            let spec = tiny(ty);
            let a = write(&spec);
            assert_eq!(a, write(&spec), "{ty:?}");
            let other = write(&SynthVisionSpec { seed: 8, ..spec });
            assert_ne!(a, other, "{ty:?}: the seed changes the weights");
            let gguf = GgufFile::from_bytes(a).unwrap();
            let tower = VisionWeights::load(&gguf, &Device::Cpu).unwrap();
            // A 64×96-pixel image: a 4×6 patch grid, 6 output tokens.
            let grid = [1, 4, 6];
            let width = tower.config.patch_width();
            let pixels: Vec<f32> = (0..24 * width)
                .map(|i| ((i * 37 % 255) as f32 - 127.5) / 127.5)
                .collect();
            let out = tower.forward_pixels(&pixels, grid).unwrap();
            assert_eq!(out.dims(), [6, 128]);
            let values: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
            assert!(values.iter().all(|v| v.is_finite()), "{ty:?}");
            let rms = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
            assert!(rms > 0.05 && rms < 10.0, "{ty:?}: rms {rms}");
        }
    }

    #[test]
    fn storage_types_follow_the_converter() {
        let ty = |spec: &SynthVisionSpec, name: &str| {
            spec.tensors()
                .into_iter()
                .find(|t| t.name == name)
                .map(|t| t.ty)
        };
        let f16 = tiny(MmprojFileType::F16);
        let bf16 = tiny(MmprojFileType::Bf16);
        for (name, a, b) in [
            ("v.patch_embd.weight", GgmlType::F16, GgmlType::F32),
            ("v.patch_embd.weight.1", GgmlType::F16, GgmlType::F32),
            ("v.position_embd.weight", GgmlType::F32, GgmlType::F32),
            ("v.blk.0.attn_qkv.weight", GgmlType::F16, GgmlType::BF16),
            ("v.blk.0.attn_qkv.bias", GgmlType::F32, GgmlType::F32),
            ("mm.2.weight", GgmlType::F16, GgmlType::BF16),
            ("v.post_ln.weight", GgmlType::F32, GgmlType::F32),
        ] {
            assert_eq!(ty(&f16, name), Some(a), "F16 {name}");
            assert_eq!(ty(&bf16, name), Some(b), "BF16 {name}");
        }
    }

    #[test]
    fn real_towers_have_the_released_shapes() {
        // transformers' Qwen3_5VisionConfig defaults (the 9B/27B tower) and the 0.8B's config.
        let c = SynthSize::B27.vision_config();
        assert_eq!(
            (c.blocks, c.hidden, c.heads, c.head_dim(), c.ffn),
            (27, 1152, 16, 72, 4304)
        );
        assert_eq!(
            (c.patch, c.merge, c.position_grid, c.projection),
            (16, 2, 48, 5120)
        );
        assert_eq!(SynthSize::B9.vision_config().projection, 4096);
        assert_eq!(SynthSize::B4.vision_config().projection, 2560);
        let small = SynthSize::B0_8.vision_config();
        assert_eq!((small.blocks, small.hidden, small.heads), (12, 768, 12));
        // The 27B's F16 file: about 0.46 B parameters, 0.92 GB (third-party mmproj files of the 9B/27B
        // are about 0.93 GB).
        let spec = SynthVisionSpec::new(SynthSize::B27, MmprojFileType::F16, 0);
        let tensors = spec.tensors();
        assert_eq!(tensors.len(), 27 * 12 + 10);
        let params: u64 = tensors.iter().map(SynthTensor::n_elements).sum();
        let bytes: u64 = tensors
            .iter()
            .map(|t| t.ty.bytes_for(t.n_elements()).unwrap())
            .sum();
        assert!((450e6..475e6).contains(&(params as f64)), "{params}");
        assert!((0.9e9..0.95e9).contains(&(bytes as f64)), "{bytes}");
        assert_eq!(size_label(params), "461M");
        assert_eq!(size_label(445_056), "445K");
        assert_eq!(size_label(1_500_000), "1.5M");
        assert_eq!(size_label(92_400_000), "92M");
        assert_eq!(spec.file_name("Qwen3.5-27B"), "mmproj-Qwen3.5-27B-F16.gguf");
    }
}
