//! Arbitrary bytes into the GGUF reader. A file that parses must also dequantize every tensor it holds
//! (or refuse its type with a typed error), and must survive a rewrite by the writer unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prism_gguf::{GgufError, GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for t in file.tensors() {
        assert_eq!(file.tensor_bytes(t).len() as u64, t.n_bytes());
        match file.dequantize(&t.name) {
            Ok(values) => assert_eq!(values.len() as u64, t.n_elements()),
            Err(GgufError::UnsupportedType { .. }) => assert!(!t.ggml_type.can_dequantize()),
            Err(e) => panic!("tensor {} of a valid file failed to dequantize: {e}", t.name),
        }
    }
    let _ = file.architecture();
    for (key, _) in file.metadata() {
        let _ = (file.get_u64(key), file.get_f64(key), file.get_str(key), file.get_array(key));
    }

    // Round trip: whatever the reader accepts, the writer writes back and the reader reads the same.
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        writer.add_metadata(key.clone(), value.clone()).expect("metadata accepted by the reader");
    }
    for t in file.tensors() {
        writer.add_tensor(t.name.clone(), &t.dims, t.ggml_type).expect("tensor accepted by the reader");
    }
    let mut out = writer.write_header(Vec::new()).expect("header");
    for t in file.tensors() {
        out.write_bytes(file.tensor_bytes(t)).expect("tensor data");
    }
    let again = GgufFile::from_bytes(out.finish().expect("finish")).expect("rewritten file parses");
    // Debug strings compare NaNs as equal, which `==` on f32 would not.
    assert_eq!(format!("{:?}", file.metadata()), format!("{:?}", again.metadata()));
    assert_eq!(file.tensors().len(), again.tensors().len());
    for (a, b) in file.tensors().iter().zip(again.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ggml_type), (&b.name, &b.dims, b.ggml_type));
        assert_eq!(file.tensor_bytes(a), again.tensor_bytes(b));
    }
});
