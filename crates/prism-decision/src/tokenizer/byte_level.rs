//! The GPT-2 byte-level alphabet: every byte gets a printable character, so byte-level BPE
//! vocabularies (`tokenizer.json`, GGUF `tokenizer.ggml.tokens`/`merges`) can be stored as text.
//! Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100.. in byte order.

/// The character that stands for `byte` in byte-level token strings.
pub fn byte_to_char(byte: u8) -> char {
    BYTE_TO_CHAR[byte as usize]
}

/// The byte a byte-level character stands for, or `None` for a character outside the alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    let code = c as u32;
    if (code as usize) < CHAR_TO_BYTE.len() {
        let b = CHAR_TO_BYTE[code as usize];
        if b >= 0 {
            return Some(b as u8);
        }
    }
    None
}

/// Raw bytes → byte-level string.
pub fn bytes_to_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_char(b)).collect()
}

/// Byte-level string → raw bytes, or `None` when a character is outside the alphabet.
pub fn text_to_bytes(text: &str) -> Option<Vec<u8>> {
    text.chars().map(char_to_byte).collect()
}

const fn is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

const fn build_byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    let mut b = 0usize;
    while b < 256 {
        table[b] = if is_printable(b as u8) {
            match char::from_u32(b as u32) {
                Some(c) => c,
                None => '\0',
            }
        } else {
            let c = match char::from_u32(256 + extra) {
                Some(c) => c,
                None => '\0',
            };
            extra += 1;
            c
        };
        b += 1;
    }
    table
}

// The highest character used is U+0143 (256 + 67).
const CHAR_TABLE_LEN: usize = 0x144;

const fn build_char_to_byte() -> [i16; CHAR_TABLE_LEN] {
    let mut table = [-1i16; CHAR_TABLE_LEN];
    let mut b = 0usize;
    while b < 256 {
        table[BYTE_TO_CHAR[b] as usize] = b as i16;
        b += 1;
    }
    table
}

static BYTE_TO_CHAR: [char; 256] = build_byte_to_char();
static CHAR_TO_BYTE: [i16; CHAR_TABLE_LEN] = build_char_to_byte();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_round_trips_every_byte() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        // Space is 'Ġ' and newline 'Ċ' in every GPT-2 style vocabulary; 0xAD is the last remapped byte.
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        assert_eq!(char_to_byte('中'), None);
    }
}
