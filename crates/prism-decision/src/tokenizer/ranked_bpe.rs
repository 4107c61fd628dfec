//! Byte-pair encoding by rank, as tiktoken does it, as a `tokenizers` model.
//!
//! tiktoken's vocabulary is a list of byte strings with ranks, and no merge list. For each
//! pre-tokenized piece it
//! 1. returns the piece's own rank when the whole piece is a token (whole-piece lookup), else
//! 2. starts from single bytes and repeatedly joins the adjacent pair whose concatenation has the
//!    lowest rank (leftmost on ties) until no adjacent concatenation is a token.
//!
//! The real Qwen3.5 vocabulary has tokens that a merge list derived "from lower ranks" misses
//! (see `tests/fixtures/qwen35-vocab/README.md`), so the tiktoken file is served by this model and
//! not by an HF merge list: the algorithm is tiktoken's by construction. The surrounding pipeline
//! (added tokens, NFC, split regex, byte-level mapping, decoder) is the `tokenizers` crate's, the
//! same as for the other sources.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::BpeTrainer;
use tokenizers::{Model, Token};

use super::byte_level;

/// A tiktoken vocabulary: `bytes_by_rank[r]` is the token of rank `r` (its id).
#[derive(Debug, Clone)]
pub struct RankedVocabulary {
    bytes_by_rank: Vec<Vec<u8>>,
    rank_of: HashMap<Vec<u8>, u32>,
}

/// What is wrong with a rank list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankListProblem {
    /// A line is not `base64 rank`.
    Malformed {
        line: usize,
        reason: String,
    },
    /// The same bytes appear twice.
    DuplicateToken {
        first_rank: u32,
        second_rank: u32,
    },
    /// Ranks must be 0..n with none missing (a rank is the token id).
    RankGap {
        expected: u32,
        found: u32,
    },
    /// Every single byte must be a token, or some text could not be encoded.
    MissingByte {
        byte: u8,
    },
    Empty,
}

impl std::fmt::Display for RankListProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed { line, reason } => write!(f, "line {line}: {reason}"),
            Self::DuplicateToken {
                first_rank,
                second_rank,
            } => {
                write!(
                    f,
                    "ranks {first_rank} and {second_rank} are the same byte string"
                )
            }
            Self::RankGap { expected, found } => {
                write!(
                    f,
                    "ranks must be consecutive from 0: expected rank {expected}, found {found}"
                )
            }
            Self::MissingByte { byte } => write!(f, "the single byte 0x{byte:02x} has no rank"),
            Self::Empty => write!(f, "no ranks"),
        }
    }
}

impl RankedVocabulary {
    /// Builds from tokens listed in rank order (`tokens[r]` has rank `r`).
    pub fn from_tokens_in_rank_order(tokens: Vec<Vec<u8>>) -> Result<Self, RankListProblem> {
        if tokens.is_empty() {
            return Err(RankListProblem::Empty);
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(RankListProblem::Malformed {
                line: 0,
                reason: "more than 2^32 ranks".into(),
            });
        }
        let mut rank_of = HashMap::with_capacity(tokens.len());
        for (rank, bytes) in tokens.iter().enumerate() {
            if let Some(first) = rank_of.insert(bytes.clone(), rank as u32) {
                return Err(RankListProblem::DuplicateToken {
                    first_rank: first,
                    second_rank: rank as u32,
                });
            }
        }
        for byte in 0..=255u8 {
            if !rank_of.contains_key(&[byte][..]) {
                return Err(RankListProblem::MissingByte { byte });
            }
        }
        Ok(Self {
            bytes_by_rank: tokens,
            rank_of,
        })
    }

    /// Parses a tiktoken rank file: one `base64(token bytes) rank` per line, ranks 0..n in order.
    pub fn parse_tiktoken(text: &str) -> Result<Self, RankListProblem> {
        let mut tokens = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = line.trim_end_matches('\r');
            if line.is_empty() {
                continue;
            }
            let mut fields = line.split(' ');
            let (Some(encoded), Some(rank_text), None) =
                (fields.next(), fields.next(), fields.next())
            else {
                return Err(RankListProblem::Malformed {
                    line: line_no,
                    reason: "expected `base64 rank`".into(),
                });
            };
            let bytes = decode_base64(encoded).ok_or_else(|| RankListProblem::Malformed {
                line: line_no,
                reason: format!("`{}` is not base64", truncate(encoded)),
            })?;
            let rank: u32 = rank_text.parse().map_err(|_| RankListProblem::Malformed {
                line: line_no,
                reason: format!("`{}` is not a rank", truncate(rank_text)),
            })?;
            let expected = tokens.len() as u32;
            if rank != expected {
                return Err(RankListProblem::RankGap {
                    expected,
                    found: rank,
                });
            }
            tokens.push(bytes);
        }
        Self::from_tokens_in_rank_order(tokens)
    }

    pub fn len(&self) -> usize {
        self.bytes_by_rank.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes_by_rank.is_empty()
    }

    pub fn rank(&self, bytes: &[u8]) -> Option<u32> {
        self.rank_of.get(bytes).copied()
    }

    pub fn bytes(&self, rank: u32) -> Option<&[u8]> {
        self.bytes_by_rank.get(rank as usize).map(Vec::as_slice)
    }

    /// tiktoken's encoding of one pre-tokenized piece: whole-piece lookup, then merging by rank.
    /// Returns `(rank, start, end)` byte spans of `piece`.
    pub fn encode_piece(&self, piece: &[u8]) -> Vec<(u32, usize, usize)> {
        if let Some(rank) = self.rank(piece) {
            return vec![(rank, 0, piece.len())];
        }
        self.merge_by_rank(piece)
    }

    /// The merge loop. A heap keyed by (rank of the concatenation, start of the left part) gives
    /// the same choice as tiktoken's linear scan (lowest rank, leftmost first) in O(n log n), so a
    /// long run of one character does not take quadratic time.
    fn merge_by_rank(&self, piece: &[u8]) -> Vec<(u32, usize, usize)> {
        let n = piece.len();
        if n == 0 {
            return Vec::new();
        }
        // Part i starts at byte i; `end[i]` is its end, `next[i]`/`prev[i]` the neighbours
        // (n / usize::MAX for none), `alive[i]` false once merged into its left neighbour.
        let mut end: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some(rank) = self.rank(&piece[i..i + 2]) {
                heap.push(Reverse((rank, i, i + 2)));
            }
        }
        while let Some(Reverse((_, left, span_end))) = heap.pop() {
            // Stale unless `left` is still a part and its right neighbour still ends at `span_end`.
            if !alive[left] {
                continue;
            }
            let right = end[left];
            if right >= n || !alive[right] || end[right] != span_end {
                continue;
            }
            alive[right] = false;
            end[left] = span_end;
            if span_end < n {
                prev[span_end] = left;
            }
            let before = prev[left];
            if before != usize::MAX {
                if let Some(rank) = self.rank(&piece[before..span_end]) {
                    heap.push(Reverse((rank, before, span_end)));
                }
            }
            if span_end < n {
                let after_end = end[span_end];
                if let Some(rank) = self.rank(&piece[left..after_end]) {
                    heap.push(Reverse((rank, left, after_end)));
                }
            }
        }
        let mut parts = Vec::new();
        let mut i = 0;
        while i < n {
            // Every part is a single byte or a concatenation found in the vocabulary, and every
            // single byte has a rank (checked at load), so the lookup cannot miss.
            let rank = self.rank(&piece[i..end[i]]).unwrap_or(u32::MAX);
            parts.push((rank, i, end[i]));
            i = end[i];
        }
        parts
    }
}

/// An added token the ranked model must know by id (it never produces them itself: the
/// tokenizer's added vocabulary splits them out of the text first).
#[derive(Debug, Clone)]
pub(crate) struct RankedAddedToken {
    pub id: u32,
    pub content: String,
}

/// The `tokenizers` model over a [`RankedVocabulary`]. Token strings are byte-level text, like
/// an HF BPE vocabulary, so the byte-level pre-tokenizer and decoder work unchanged.
pub struct RankedBpe {
    vocab: RankedVocabulary,
    added_by_content: HashMap<String, u32>,
    added_by_id: HashMap<u32, String>,
}

impl RankedBpe {
    pub(crate) fn new(vocab: RankedVocabulary, added: &[RankedAddedToken]) -> Self {
        let added_by_content = added.iter().map(|t| (t.content.clone(), t.id)).collect();
        let added_by_id = added.iter().map(|t| (t.id, t.content.clone())).collect();
        Self {
            vocab,
            added_by_content,
            added_by_id,
        }
    }

    pub fn vocabulary(&self) -> &RankedVocabulary {
        &self.vocab
    }
}

impl Model for RankedBpe {
    // `Model` demands a trainer type; this model is never trained (nothing calls it).
    type Trainer = BpeTrainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        // `sequence` is one piece after the byte-level pre-tokenizer: one character per byte.
        let mut bytes = Vec::with_capacity(sequence.len());
        let mut char_starts = Vec::with_capacity(sequence.len() + 1);
        for (offset, c) in sequence.char_indices() {
            let b = byte_level::char_to_byte(c).ok_or_else(|| {
                format!(
                    "character {c:?} of a pre-tokenized piece is outside the byte-level alphabet"
                )
            })?;
            bytes.push(b);
            char_starts.push(offset);
        }
        char_starts.push(sequence.len());
        let parts = self.vocab.encode_piece(&bytes);
        let mut tokens = Vec::with_capacity(parts.len());
        for (rank, start, end) in parts {
            if rank == u32::MAX {
                return Err(format!("no rank for a part of the piece {sequence:?}").into());
            }
            let (from, to) = (char_starts[start], char_starts[end]);
            tokens.push(Token::new(rank, sequence[from..to].to_string(), (from, to)));
        }
        Ok(tokens)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.added_by_content.get(token) {
            return Some(id);
        }
        byte_level::text_to_bytes(token).and_then(|bytes| self.vocab.rank(&bytes))
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        if let Some(content) = self.added_by_id.get(&id) {
            return Some(content.clone());
        }
        self.vocab.bytes(id).map(byte_level::bytes_to_text)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        let mut vocab: HashMap<String, u32> = self
            .vocab
            .bytes_by_rank
            .iter()
            .enumerate()
            .map(|(rank, bytes)| (byte_level::bytes_to_text(bytes), rank as u32))
            .collect();
        vocab.extend(self.added_by_content.iter().map(|(c, &id)| (c.clone(), id)));
        vocab
    }

    fn get_vocab_size(&self) -> usize {
        self.vocab.len() + self.added_by_id.len()
    }

    fn save(&self, _folder: &Path, _prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        Err("a ranked (tiktoken) vocabulary is not saved as a tokenizers model".into())
    }

    fn get_trainer(&self) -> BpeTrainer {
        BpeTrainer::default()
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Standard base64 with `=` padding (the tiktoken file format). `None` on anything else.
pub(crate) fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let input = text.as_bytes();
    if input.len() % 4 != 0 {
        return None;
    }
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(input.len() / 4 * 3);
    let chunks = input.len() / 4;
    for (index, chunk) in input.chunks_exact(4).enumerate() {
        let last = index + 1 == chunks;
        let padding = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if padding > 2 || (padding > 0 && !last) {
            return None;
        }
        let mut acc = 0u32;
        for &c in &chunk[..4 - padding] {
            acc = (acc << 6) | value(c)?;
        }
        acc <<= 6 * padding as u32;
        let decoded = [(acc >> 16) as u8, (acc >> 8) as u8, acc as u8];
        out.extend_from_slice(&decoded[..3 - padding]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_padded_and_rejects_garbage() {
        assert_eq!(decode_base64("IQ==").as_deref(), Some(&b"!"[..]));
        assert_eq!(decode_base64("aGk=").as_deref(), Some(&b"hi"[..]));
        assert_eq!(decode_base64("aGV5").as_deref(), Some(&b"hey"[..]));
        assert_eq!(decode_base64("").as_deref(), Some(&b""[..]));
        assert_eq!(decode_base64("aGk"), None);
        assert_eq!(decode_base64("a=Gk"), None);
        assert_eq!(decode_base64("aG!="), None);
    }

    fn vocab(extra: &[&[u8]]) -> RankedVocabulary {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.extend(extra.iter().map(|t| t.to_vec()));
        RankedVocabulary::from_tokens_in_rank_order(tokens).unwrap()
    }

    fn ranks(v: &RankedVocabulary, text: &str) -> Vec<u32> {
        v.encode_piece(text.as_bytes())
            .into_iter()
            .map(|(r, _, _)| r)
            .collect()
    }

    #[test]
    fn merges_by_rank_of_the_concatenation() {
        // "ab" (256) < "bc" (257) < "abc" (258).
        let v = vocab(&[b"ab", b"bc", b"abc"]);
        assert_eq!(ranks(&v, "abc"), vec![258]); // whole-piece lookup
        assert_eq!(ranks(&v, "abcabc"), vec![258, 258]);
        // "xabc": x|ab|c after the first merge, then "abc" joins (ab, c).
        assert_eq!(ranks(&v, "xabc"), vec![b'x' as u32, 258]);
        // "bcx": bc|x.
        assert_eq!(ranks(&v, "bcx"), vec![257, b'x' as u32]);
    }

    #[test]
    fn reaches_tokens_whose_part_has_a_higher_rank() {
        // "wxy" (257) is reached through ("w", "xy"), while its split ("wx", "y") has a part
        // ranked after it (258): xy joins first, then w + xy.
        let v = vocab(&[b"xy", b"wxy", b"wx"]);
        assert_eq!(ranks(&v, "wxyz"), vec![257, b'z' as u32]);
        // A token no pair builds is only reachable as a whole piece.
        let v = vocab(&[b"pq", b"rs", b"pqrst"]);
        assert_eq!(ranks(&v, "pqrst"), vec![258]);
        assert_eq!(
            ranks(&v, "pqrstu"),
            vec![256, 257, b't' as u32, b'u' as u32]
        );
    }

    #[test]
    fn ties_go_to_the_leftmost_pair() {
        let v = vocab(&[b"aa"]);
        assert_eq!(ranks(&v, "aaa"), vec![256, b'a' as u32]);
        assert_eq!(ranks(&v, "aaaaa"), vec![256, 256, b'a' as u32]);
    }

    #[test]
    fn long_runs_are_fast_and_complete() {
        let v = vocab(&[b"aa", b"aaaa", b"aaaaaaaa"]);
        let run = "a".repeat(100_001);
        let parts = v.encode_piece(run.as_bytes());
        let covered: usize = parts.iter().map(|&(_, s, e)| e - s).sum();
        assert_eq!(covered, run.len());
        assert_eq!(parts.iter().filter(|p| p.0 == 258).count(), 12_500);
    }

    #[test]
    fn rank_list_problems_are_reported() {
        assert_eq!(
            RankedVocabulary::parse_tiktoken("").unwrap_err(),
            RankListProblem::Empty
        );
        assert!(matches!(
            RankedVocabulary::parse_tiktoken("IQ== 1\n").unwrap_err(),
            RankListProblem::RankGap {
                expected: 0,
                found: 1
            }
        ));
        assert!(matches!(
            RankedVocabulary::parse_tiktoken("IQ==\n").unwrap_err(),
            RankListProblem::Malformed { line: 1, .. }
        ));
        // One assertion a problem, alike in shape: each matches its own variant's fields.
        assert!(matches!(
            RankedVocabulary::parse_tiktoken("IQ== 0\nIQ== 1\n").unwrap_err(),
            RankListProblem::DuplicateToken {
                first_rank: 0,
                second_rank: 1
            }
        ));
        assert!(matches!(
            RankedVocabulary::parse_tiktoken("IQ== 0\n").unwrap_err(),
            RankListProblem::MissingByte { byte: 0 }
        ));
    }
}
