//! Hand-crafted corruptions, one per check of the reader: each must give its own typed error, and the
//! message must name what is wrong (the key, the tensor, the offset).

use prism_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};

/// A small valid file. Keys and tensor names are unique byte strings so that tests can find them.
fn base() -> Vec<u8> {
    use MetadataValue as V;
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", V::String("qwen35".into()))
        .unwrap();
    w.add_metadata("k.aaa", V::U32(7)).unwrap();
    w.add_metadata("k.bbb", V::U32(8)).unwrap();
    w.add_metadata("k.flag", V::Bool(true)).unwrap();
    w.add_metadata("k.list", V::Array(vec![V::U32(1), V::U32(2)]))
        .unwrap();
    w.add_metadata("k.text", V::String("hello".into())).unwrap();
    w.add_metadata("general.alignment", V::U32(32)).unwrap();
    w.add_tensor("t_q8", &[32, 2], GgmlType::Q8_0).unwrap();
    w.add_tensor("t_f3", &[64], GgmlType::F32).unwrap();
    w.add_tensor("t_iq", &[256], GgmlType::IQ2_XXS).unwrap();
    let mut data = w.write_header(Vec::new()).unwrap();
    // 127/64: the Q8_0 scale 1/64 is exact in fp16, so the values come back exactly.
    data.write_f32(&[127.0 / 64.0; 64]).unwrap();
    data.write_f32(&[1.5; 64]).unwrap();
    data.write_bytes(&[0; 66]).unwrap();
    data.finish().unwrap()
}

fn find(bytes: &[u8], needle: &[u8]) -> usize {
    let hits: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "{:?} occurs {} times",
        String::from_utf8_lossy(needle),
        hits.len()
    );
    hits[0]
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of the value-type field of metadata key `key`.
fn value_type_at(bytes: &[u8], key: &str) -> usize {
    find(bytes, key.as_bytes()) + key.len()
}

/// Offsets of (n_dims, first dim, type, offset) of tensor `name` (which has `n_dims` dims).
fn tensor_fields(bytes: &[u8], name: &str, n_dims: usize) -> (usize, usize, usize, usize) {
    let n_dims_at = find(bytes, name.as_bytes()) + name.len();
    let type_at = n_dims_at + 4 + 8 * n_dims;
    (n_dims_at, n_dims_at + 4, type_at, type_at + 4)
}

fn parse(bytes: Vec<u8>) -> GgufError {
    GgufFile::from_bytes(bytes).expect_err("the corruption should be detected")
}

fn assert_mentions(err: &GgufError, words: &[&str]) {
    let text = err.to_string();
    for w in words {
        assert!(text.contains(w), "{text:?} should mention {w:?}");
    }
}

#[test]
fn the_base_file_is_valid_and_version_2_reads_the_same() {
    let bytes = base();
    let file = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(file.get_u64("k.aaa").unwrap(), 7);
    assert_eq!(file.dequantize("t_q8").unwrap(), vec![127.0 / 64.0; 64]);
    let err = file.dequantize("t_iq").unwrap_err();
    assert!(
        matches!(&err, GgufError::UnsupportedType { tensor, ty: GgmlType::IQ2_XXS } if tensor == "t_iq")
    );

    let mut v2 = bytes;
    put_u32(&mut v2, 4, 2);
    let file = GgufFile::from_bytes(v2).unwrap();
    assert_eq!(file.version(), 2);
    assert_eq!(file.tensors().len(), 3);
}

#[test]
fn header_errors() {
    let mut b = base();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse(b), GgufError::BadMagic { found } if &found == b"GGML"));

    for version in [0u32, 1, 4, 0x0001_0001] {
        let mut b = base();
        put_u32(&mut b, 4, version);
        assert!(matches!(parse(b), GgufError::UnsupportedVersion { version: v } if v == version));
    }
    let mut b = base();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    let err = parse(b);
    assert!(
        matches!(err, GgufError::BigEndian { swapped: 3, .. }),
        "{err}"
    );
    assert_mentions(&err, &["big-endian"]);

    assert!(matches!(
        parse(Vec::new()),
        GgufError::Truncated {
            offset: 0,
            needed: 4,
            available: 0,
            ..
        }
    ));
    assert!(matches!(
        parse(base()[..10].to_vec()),
        GgufError::Truncated { offset: 8, .. }
    ));

    // Counts that cannot fit in the file are refused before anything is allocated for them.
    let mut b = base();
    put_u64(&mut b, 16, u64::MAX);
    assert_mentions(&parse(b), &["metadata entries", "truncated"]);
    let mut b = base();
    put_u64(&mut b, 8, 1 << 40);
    assert!(matches!(parse(b), GgufError::Truncated { .. }));
}

#[test]
fn metadata_errors() {
    let mut b = base();
    let at = value_type_at(&b, "k.aaa");
    put_u32(&mut b, at, 13);
    let err = parse(b);
    assert!(
        matches!(&err, GgufError::InvalidValueType { key, type_id: 13, offset } if key == "k.aaa" && *offset == at as u64)
    );

    let mut b = base();
    let at = value_type_at(&b, "k.list");
    put_u32(&mut b, at + 4, 77);
    assert!(
        matches!(parse(b), GgufError::InvalidValueType { key, type_id: 77, .. } if key == "k.list")
    );

    let mut b = base();
    let at = value_type_at(&b, "k.list");
    put_u64(&mut b, at + 8, u64::MAX / 2);
    let err = parse(b);
    assert!(matches!(err, GgufError::Truncated { .. }));
    assert_mentions(&err, &["k.list"]);

    let mut b = base();
    let at = value_type_at(&b, "k.text");
    put_u64(&mut b, at + 4, 1 << 50);
    assert_mentions(&parse(b), &["k.text", "truncated"]);

    let mut b = base();
    let at = value_type_at(&b, "k.flag");
    b[at + 4] = 2;
    assert!(matches!(parse(b), GgufError::InvalidBool { key, byte: 2, .. } if key == "k.flag"));

    let mut b = base();
    let at = find(&b, b"k.bbb");
    b[at + 2..at + 5].copy_from_slice(b"aaa");
    assert!(matches!(parse(b), GgufError::DuplicateKey { key } if key == "k.aaa"));

    let mut b = base();
    let at = find(&b, b"k.text");
    b[at + 3] = 0xFF;
    let err = parse(b);
    assert!(
        matches!(err, GgufError::InvalidUtf8 { offset, .. } if offset == at as u64 + 3),
        "{err}"
    );

    let mut b = base();
    let at = find(&b, b"hello");
    b[at + 1] = 0xC3; // a lead byte followed by an ASCII byte
    let err = parse(b);
    assert!(
        matches!(&err, GgufError::InvalidUtf8 { offset, what } if *offset == at as u64 + 1 && what.contains("k.text"))
    );

    // general.alignment: zero, not a power of two, and a signed type.
    let at = value_type_at(&base(), "general.alignment");
    for bad in [0u32, 3, 48] {
        let mut b = base();
        put_u32(&mut b, at + 4, bad);
        assert!(matches!(parse(b), GgufError::BadAlignment { .. }));
    }
    let mut b = base();
    put_u32(&mut b, at, 5);
    assert!(
        matches!(parse(b), GgufError::WrongType { key, expected: "u32", found: "i32" } if key == "general.alignment")
    );
}

#[test]
fn nested_arrays_are_limited_in_depth() {
    let nest = |depth: usize| {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(b"deep");
        b.extend_from_slice(&9u32.to_le_bytes());
        for _ in 0..depth - 1 {
            b.extend_from_slice(&9u32.to_le_bytes());
            b.extend_from_slice(&1u64.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes()); // innermost: u8 × 1
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(42);
        b
    };
    let ok = GgufFile::from_bytes(nest(prism_gguf::MAX_ARRAY_DEPTH)).unwrap();
    let mut v = ok.get("deep").unwrap();
    for _ in 0..prism_gguf::MAX_ARRAY_DEPTH {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v.as_u64(), Some(42));
    let err = parse(nest(prism_gguf::MAX_ARRAY_DEPTH + 1));
    assert!(matches!(err, GgufError::NestingTooDeep { key, .. } if key == "deep"));
}

#[test]
fn tensor_info_errors() {
    let mut b = base();
    let at = find(&b, b"t_f3");
    b[at..at + 4].copy_from_slice(b"t_q8");
    // The two names are now equal; `find` would see two, so patch through the saved offset.
    assert!(matches!(parse(b), GgufError::DuplicateTensor { name } if name == "t_q8"));

    let (n_dims_at, dim0_at, type_at, offset_at) = tensor_fields(&base(), "t_q8", 2);

    let mut b = base();
    put_u32(&mut b, n_dims_at, 5);
    assert!(matches!(parse(b), GgufError::TooManyDims { tensor, n_dims: 5 } if tensor == "t_q8"));

    let mut b = base();
    put_u64(&mut b, dim0_at + 8, 0);
    assert!(
        matches!(parse(b), GgufError::BadDimension { tensor, index: 1, value: 0 } if tensor == "t_q8")
    );

    let mut b = base();
    put_u64(&mut b, dim0_at, 1 << 63);
    assert!(matches!(parse(b), GgufError::BadDimension { index: 0, .. }));

    let mut b = base();
    put_u64(&mut b, dim0_at, 33);
    let err = parse(b);
    assert!(
        matches!(&err, GgufError::NotBlockMultiple { tensor, ne0: 33, block_size: 32, ty: GgmlType::Q8_0 } if tensor == "t_q8")
    );

    // 32 × 2^58 elements = 2^63 > i64::MAX; 32 × 2^62 overflows u64.
    for rows in [1u64 << 58, 1 << 62] {
        let mut b = base();
        put_u64(&mut b, dim0_at + 8, rows);
        assert!(matches!(parse(b), GgufError::SizeOverflow { tensor } if tensor == "t_q8"));
    }
    // 32 × 2^40 elements fits, but its bytes lie far outside the file.
    let mut b = base();
    put_u64(&mut b, dim0_at + 8, 1 << 40);
    assert!(matches!(parse(b), GgufError::OutOfBounds { tensor, .. } if tensor == "t_q8"));

    let mut b = base();
    put_u32(&mut b, type_at, 4); // a retired ggml type id
    assert!(matches!(parse(b), GgufError::InvalidType { tensor, type_id: 4 } if tensor == "t_q8"));
    let mut b = base();
    put_u32(&mut b, type_at, 0); // F32: ne0 = 32 is fine but 64 × 4 bytes no longer fit before t_f3
    assert!(
        matches!(parse(b), GgufError::Overlap { first, second } if first == "t_q8" && second == "t_f3")
    );

    let mut b = base();
    put_u64(&mut b, offset_at, 16);
    assert!(
        matches!(parse(b), GgufError::Misaligned { tensor, offset: 16, alignment: 32 } if tensor == "t_q8")
    );

    let mut b = base();
    put_u64(&mut b, offset_at, 1 << 20);
    let err = parse(b);
    assert!(matches!(err, GgufError::OutOfBounds { .. }));
    assert_mentions(&err, &["t_q8", "outside the file"]);

    let mut b = base();
    put_u64(&mut b, offset_at, u64::MAX - 31);
    assert!(matches!(parse(b), GgufError::OutOfBounds { .. }));

    let (_, _, _, f3_offset_at) = tensor_fields(&base(), "t_f3", 1);
    let mut b = base();
    put_u64(&mut b, f3_offset_at, 32);
    assert!(matches!(parse(b), GgufError::Overlap { .. }));

    // The last tensor's data cut short by one byte.
    let mut b = base();
    let file = GgufFile::from_bytes(b.clone()).unwrap();
    let last = file.tensor_info("t_iq").unwrap();
    let end = (file.data_offset() + last.offset + last.n_bytes()) as usize;
    b.truncate(end - 1);
    assert!(matches!(parse(b), GgufError::OutOfBounds { tensor, .. } if tensor == "t_iq"));
}

#[test]
fn open_reports_the_path_and_reads_files() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-gguf-crafted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(&err, GgufError::Io { path, .. } if path == &missing));
    assert_mentions(&err, &["missing.gguf"]);

    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&empty),
        Err(GgufError::Truncated { .. })
    ));

    let good = dir.join("good.gguf");
    std::fs::write(&good, base()).unwrap();
    let file = GgufFile::open(&good).unwrap();
    assert_eq!(file.path(), Some(good.as_path()));
    assert_eq!(file.dequantize("t_f3").unwrap(), vec![1.5; 64]);
    std::fs::remove_dir_all(&dir).unwrap();
}
