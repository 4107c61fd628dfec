//! The writer against the reader, and against llama.cpp's own files.

use common::{fixture_path, Rng};
use prism_gguf::{blocks, quantize, GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};

mod common;

fn every_value_type() -> Vec<(String, MetadataValue)> {
    use MetadataValue as V;
    vec![
        ("t.u8".into(), V::U8(250)),
        ("t.i8".into(), V::I8(-120)),
        ("t.u16".into(), V::U16(65_000)),
        ("t.i16".into(), V::I16(-32_000)),
        ("t.u32".into(), V::U32(4_000_000_000)),
        ("t.i32".into(), V::I32(-2_000_000_000)),
        ("t.f32".into(), V::F32(1e-6)),
        ("t.bool".into(), V::Bool(true)),
        ("t.string".into(), V::String("Grüße, 世界 🙂\n".into())),
        ("t.empty_string".into(), V::String(String::new())),
        ("t.u64".into(), V::U64(u64::MAX)),
        ("t.i64".into(), V::I64(i64::MIN)),
        ("t.f64".into(), V::F64(-1.0e300)),
        (
            "t.array_u8".into(),
            V::Array((0..=255).map(V::U8).collect()),
        ),
        (
            "t.array_i32".into(),
            V::Array(vec![V::I32(3), V::I32(3), V::I32(2), V::I32(0)]),
        ),
        (
            "t.array_f32".into(),
            V::Array(vec![V::F32(0.5), V::F32(-0.0), V::F32(f32::INFINITY)]),
        ),
        (
            "t.array_bool".into(),
            V::Array(vec![V::Bool(true), V::Bool(false)]),
        ),
        (
            "t.array_str".into(),
            V::Array(vec![V::String("Ġ Ġ".into()), V::String(String::new())]),
        ),
        ("t.array_f64".into(), V::Array(vec![V::F64(1e-300)])),
        (
            "t.array_u64".into(),
            V::Array(vec![V::U64(1), V::U64(u64::MAX)]),
        ),
        ("t.array_empty".into(), V::Array(vec![])),
        (
            "t.array_of_arrays".into(),
            V::Array(vec![
                V::Array(vec![V::String("a".into()), V::String("b".into())]),
                V::Array(vec![V::U16(7)]),
                V::Array(vec![V::Array(vec![V::I64(-1)])]),
            ]),
        ),
        ("general.alignment".into(), V::U32(64)),
    ]
}

#[test]
fn metadata_and_tensors_round_trip() {
    let mut rng = Rng(7);
    let mut writer = GgufWriter::new();
    for (key, value) in every_value_type() {
        writer.add_metadata(key, value).unwrap();
    }
    // (name, dims, type, values to quantize) for the f32 path.
    let quantized_cases: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("f32", vec![7, 3], GgmlType::F32),
        ("f16", vec![64, 2, 3], GgmlType::F16),
        ("bf16", vec![33], GgmlType::BF16),
        ("q8_0", vec![64, 5], GgmlType::Q8_0),
        ("q4_k", vec![512, 3], GgmlType::Q4_K),
        ("q6_k", vec![256, 2, 1, 2], GgmlType::Q6_K),
    ];
    // Raw blocks of types the writer does not quantize itself.
    let raw_cases: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("q5_k_raw", vec![256, 2], GgmlType::Q5_K),
        ("q4_0_raw", vec![32, 3], GgmlType::Q4_0),
        ("q2_k_raw", vec![256], GgmlType::Q2_K),
    ];
    let mut f32_inputs = Vec::new();
    for (name, dims, ty) in &quantized_cases {
        writer.add_tensor(*name, dims, *ty).unwrap();
        let n: u64 = dims.iter().product();
        f32_inputs.push((0..n).map(|_| rng.normal(0.3)).collect::<Vec<f32>>());
    }
    let mut raw_inputs = Vec::new();
    for (name, dims, ty) in &raw_cases {
        writer.add_tensor(*name, dims, *ty).unwrap();
        let n: u64 = dims.iter().product();
        let n_bytes = ty.bytes_for(n).unwrap() as usize;
        let mut bytes: Vec<u8> = (0..n_bytes).map(|_| rng.next_u64() as u8).collect();
        // Keep the fp16 scales finite so that dequantized values compare with `==`.
        for block in bytes.chunks_mut(ty.type_size()) {
            let (d_at, dmin_at) = match ty {
                GgmlType::Q2_K => (80, Some(82)),
                GgmlType::Q5_K => (0, Some(2)),
                _ => (0, None),
            };
            block[d_at..d_at + 2].copy_from_slice(&0x2E66u16.to_le_bytes());
            if let Some(at) = dmin_at {
                block[at..at + 2].copy_from_slice(&0x2C00u16.to_le_bytes());
            }
        }
        raw_inputs.push(bytes);
    }

    let mut data = writer.write_header(Vec::new()).unwrap();
    for values in &f32_inputs {
        // In two pieces where the type's blocks allow, to exercise streaming.
        let info = data.current_tensor().unwrap().clone();
        let row = info.dims[0] as usize;
        if values.len() > row {
            data.write_f32(&values[..row]).unwrap();
            data.write_f32(&values[row..]).unwrap();
        } else {
            data.write_f32(values).unwrap();
        }
    }
    for bytes in &raw_inputs {
        let (a, b) = bytes.split_at(bytes.len() / 3);
        data.write_bytes(a).unwrap();
        data.write_bytes(b).unwrap();
    }
    let file = data.finish().unwrap();
    assert_eq!(file.len() % 64, 0);

    let gguf = GgufFile::from_bytes(file).unwrap();
    assert_eq!(gguf.version(), 3);
    assert_eq!(gguf.alignment(), 64);
    assert_eq!(gguf.data_offset() % 64, 0);
    let expected_meta = every_value_type();
    assert_eq!(gguf.metadata().len(), expected_meta.len());
    for ((key, value), (exp_key, exp_value)) in gguf.metadata().iter().zip(&expected_meta) {
        assert_eq!(key, exp_key);
        assert_eq!(value, exp_value, "{key}");
    }

    for ((name, dims, ty), values) in quantized_cases.iter().zip(&f32_inputs) {
        let info = gguf.tensor_info(name).unwrap();
        assert_eq!((&info.dims, info.ggml_type), (dims, *ty));
        assert_eq!(info.offset % 64, 0);
        let expected_bytes = quantize::quantize(*ty, values).unwrap();
        assert_eq!(gguf.tensor_bytes(info), expected_bytes.as_slice(), "{name}");
        let back = gguf.dequantize(name).unwrap();
        assert_eq!(
            back,
            blocks::dequantize(*ty, &expected_bytes, values.len()).unwrap()
        );
        // Sanity of the formats themselves: lossless, half precision, or within the quantization step.
        let max_abs = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let tolerance = match ty {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => 1e-3 * max_abs,
            GgmlType::BF16 => 8e-3 * max_abs,
            GgmlType::Q8_0 => max_abs / 127.0,
            GgmlType::Q6_K => max_abs / 16.0,
            _ => max_abs / 4.0,
        };
        for (v, b) in values.iter().zip(&back) {
            assert!((v - b).abs() <= tolerance, "{name}: {v} vs {b}");
        }
    }
    for ((name, _, ty), bytes) in raw_cases.iter().zip(&raw_inputs) {
        let info = gguf.tensor_info(name).unwrap();
        assert_eq!(gguf.tensor_bytes(info), bytes.as_slice(), "{name}");
        let n = info.n_elements() as usize;
        assert_eq!(
            gguf.dequantize(name).unwrap(),
            blocks::dequantize(*ty, bytes, n).unwrap()
        );
    }
}

/// Writing llama.cpp's own file back out, entry by entry and tensor by tensor, reproduces it byte for byte:
/// the header encoding, the value types, the tensor-info layout and the padding all agree with gguf-py's.
#[test]
fn rewriting_a_llama_cpp_file_reproduces_it_exactly() {
    let path = fixture_path("tiny-Q4_K_M.gguf");
    let original = std::fs::read(&path).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    let mut writer = GgufWriter::new();
    for (key, value) in gguf.metadata() {
        writer.add_metadata(key.clone(), value.clone()).unwrap();
    }
    for t in gguf.tensors() {
        writer
            .add_tensor(t.name.clone(), &t.dims, t.ggml_type)
            .unwrap();
    }
    assert_eq!(writer.planned_tensors().unwrap(), gguf.tensors());
    let mut data = writer
        .write_header(Vec::with_capacity(original.len()))
        .unwrap();
    for t in gguf.tensors() {
        data.write_bytes(gguf.tensor_bytes(t)).unwrap();
    }
    let rewritten = data.finish().unwrap();
    assert_eq!(rewritten.len(), original.len());
    assert!(
        rewritten == original,
        "first difference at byte {:?}",
        rewritten.iter().zip(&original).position(|(a, b)| a != b)
    );
}

#[test]
fn writer_misuse_is_a_typed_error() {
    use MetadataValue as V;
    let mut w = GgufWriter::new();
    w.add_metadata("a", V::U32(1)).unwrap();
    assert!(matches!(
        w.add_metadata("a", V::U8(1)),
        Err(GgufError::DuplicateKey { .. })
    ));
    let mixed = V::Array(vec![V::U32(1), V::I32(1)]);
    assert!(matches!(
        w.add_metadata("mixed", mixed),
        Err(GgufError::Writer { .. })
    ));
    assert!(matches!(
        w.add_metadata("general.alignment", V::U32(48)),
        Err(GgufError::BadAlignment { .. })
    ));
    assert!(matches!(
        w.add_metadata("general.alignment", V::U64(64)),
        Err(GgufError::WrongType { .. })
    ));
    let mut deep = V::Array(vec![V::U8(0)]);
    for _ in 0..prism_gguf::MAX_ARRAY_DEPTH {
        deep = V::Array(vec![deep]);
    }
    assert!(matches!(
        w.add_metadata("deep", deep),
        Err(GgufError::Writer { .. })
    ));

    assert!(matches!(
        w.add_tensor("x", &[48], GgmlType::Q4_K),
        Err(GgufError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        w.add_tensor("x", &[32, 0], GgmlType::Q8_0),
        Err(GgufError::BadDimension { .. })
    ));
    assert!(matches!(
        w.add_tensor("x", &[1, 1, 1, 1, 1], GgmlType::F32),
        Err(GgufError::TooManyDims { .. })
    ));
    assert!(matches!(
        w.add_tensor("x", &[1 << 40, 1 << 40], GgmlType::F32),
        Err(GgufError::SizeOverflow { .. })
    ));
    w.add_tensor("x", &[32, 2], GgmlType::Q8_0).unwrap();
    assert!(matches!(
        w.add_tensor("x", &[32], GgmlType::Q8_0),
        Err(GgufError::DuplicateTensor { .. })
    ));
    w.add_tensor("y", &[256], GgmlType::Q4_0).unwrap();

    let mut data = w.write_header(Vec::new()).unwrap();
    assert!(matches!(
        data.write_f32(&[0.0; 31]),
        Err(GgufError::PartialBlock { .. })
    ));
    assert!(matches!(
        data.write_bytes(&[0; 69]),
        Err(GgufError::Writer { .. })
    ));
    data.write_f32(&[0.5; 64]).unwrap();
    let err = data.write_f32(&[0.0; 256]).unwrap_err();
    assert!(
        matches!(&err, GgufError::UnsupportedType { tensor, .. } if tensor == "y"),
        "{err}"
    );
    data.write_bytes(&[0; 18]).unwrap();
    let err = data.finish().unwrap_err().to_string();
    assert!(err.contains("\"y\"") && err.contains("incomplete"), "{err}");
}
