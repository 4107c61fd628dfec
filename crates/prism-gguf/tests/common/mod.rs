//! Helpers shared by the robustness tests.

/// Where each header field of a well-formed GGUF sits: (offset, width in bytes, description).
/// Descriptions: "version", "tensor count", "kv count", "key length", "value type", "1-byte value",
/// "string length", "array element type", "array length", "tensor name length", "n_dims", "dimension",
/// "tensor type", "tensor offset".
pub fn header_fields(bytes: &[u8]) -> Vec<(usize, usize, String)> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
    let mut fields = vec![
        (4, 4, "version".to_string()),
        (8, 8, "tensor count".into()),
        (16, 8, "kv count".into()),
    ];
    let n_tensors = u64_at(8);
    let n_kv = u64_at(16);
    let mut pos = 24;
    fn value(bytes: &[u8], pos: &mut usize, ty: u32, fields: &mut Vec<(usize, usize, String)>) {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => {
                fields.push((*pos, 1, "1-byte value".into()));
                *pos += 1
            }
            2 | 3 => *pos += 2,
            4..=6 => *pos += 4,
            10..=12 => *pos += 8,
            8 => {
                fields.push((*pos, 8, "string length".into()));
                *pos += 8 + u64_at(*pos)
            }
            9 => {
                let elem = u32_at(*pos);
                fields.push((*pos, 4, "array element type".into()));
                fields.push((*pos + 4, 8, "array length".into()));
                let count = u64_at(*pos + 4);
                *pos += 12;
                for _ in 0..count {
                    value(bytes, pos, elem, fields);
                }
            }
            _ => unreachable!(),
        }
    }
    for _ in 0..n_kv {
        fields.push((pos, 8, "key length".into()));
        pos += 8 + u64_at(pos);
        fields.push((pos, 4, "value type".into()));
        let ty = u32_at(pos);
        pos += 4;
        value(bytes, &mut pos, ty, &mut fields);
    }
    for _ in 0..n_tensors {
        fields.push((pos, 8, "tensor name length".into()));
        pos += 8 + u64_at(pos);
        fields.push((pos, 4, "n_dims".into()));
        let n_dims = u32_at(pos) as usize;
        pos += 4;
        for _ in 0..n_dims {
            fields.push((pos, 8, "dimension".into()));
            pos += 8;
        }
        fields.push((pos, 4, "tensor type".into()));
        fields.push((pos + 4, 8, "tensor offset".into()));
        pos += 12;
    }
    fields
}
