//! The direct encoder: the Qwen3.5 pipeline of this module's `tokenizers` tokenizers (added tokens,
//! NFC, the split regex, byte-level BPE) run straight on the text's bytes, without the `tokenizers`
//! crate's per-token strings, offsets and alignment tracking. Same ids: every step is the one that
//! crate runs, with the libraries it runs them on —
//!
//! 1. added tokens: `aho-corasick` leftmost-longest over every added token's content in the raw text,
//!    as `tokenizers`' `AddedVocabulary` does for tokens that are not normalized and neither strip
//!    spaces nor match single words (built only when every added token is such a token);
//! 2. NFC of each stretch between them (`unicode-normalization-alignments`, the crate `tokenizers`'
//!    normalizer uses; ASCII is left as it is);
//! 3. the split: [`QWEN35_SPLIT_REGEX`] on Oniguruma (the `onig` crate, as `tokenizers`' `onig`
//!    feature runs it), every match and every gap between matches a piece;
//! 4. BPE of each piece's bytes: tiktoken's merging by rank with whole-piece lookup for a ranked
//!    vocabulary ([`RankedVocabulary::encode_piece`], what [`super::RankedBpe`] runs), or `tokenizers`'
//!    BPE for a merge list: every adjacent pair with a merge rank in a heap, the lowest rank first and
//!    the leftmost of equal ranks, a merge skipped when its pair no longer stands.
//!
//! Tested equal to the `tokenizers` pipeline on the fixtures' vocabularies (`tests/tokenizer.rs`).
//! Measured: `examples/tokenize_speed.rs` (numbers in docs/optimization-log.md).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::RwLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use unicode_normalization_alignments::UnicodeNormalization;

use super::{byte_to_char, RankedVocabulary, TokenizerError, QWEN35_SPLIT_REGEX};

/// `tokenizers`' merge table for a byte-level merge list: the id of each byte, and for a pair of ids
/// its merge's rank and the merged token's id.
pub(super) struct MergeTable {
    byte_ids: [u32; 256],
    pairs: HashMap<(u32, u32), (u32, u32), ahash::RandomState>,
    /// Pieces already merged (a piece's ids depend on its bytes alone), up to [`CACHE_PIECES`] of at
    /// most [`CACHE_PIECE_BYTES`] bytes: then no more are added (as `tokenizers`' BPE cache does).
    cache: RwLock<HashMap<Vec<u8>, Vec<u32>, ahash::RandomState>>,
}

/// The most pieces [`MergeTable`] keeps (`tokenizers`' BPE cache holds 10,000 words).
const CACHE_PIECES: usize = 16_384;
/// The longest piece [`MergeTable`] keeps.
const CACHE_PIECE_BYTES: usize = 64;

impl MergeTable {
    /// From a BPE model's vocabulary (byte-level token strings) and its merges in rank order.
    /// `None` when a byte has no token or a merge names a token the vocabulary lacks (the
    /// `tokenizers` pipeline is used then).
    pub(super) fn new(vocab: &HashMap<String, u32>, merges: &[(String, String)]) -> Option<Self> {
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = *vocab.get(byte_to_char(b as u8).to_string().as_str())?;
        }
        let mut pairs = HashMap::with_capacity_and_hasher(merges.len(), ahash::RandomState::new());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let merged = format!("{a}{b}");
            // A pair listed twice keeps its last rank, as `tokenizers`' map (collected in order) does.
            pairs.insert(
                (*vocab.get(a)?, *vocab.get(b)?),
                (rank as u32, *vocab.get(merged.as_str())?),
            );
        }
        Some(Self {
            byte_ids,
            pairs,
            cache: RwLock::new(HashMap::with_hasher(ahash::RandomState::new())),
        })
    }

    /// The ids of one piece, from the cache or merged (and then cached while there is room).
    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        match piece.len() {
            0 => return,
            1 => return out.push(self.byte_ids[piece[0] as usize]),
            n if n > CACHE_PIECE_BYTES => return self.merge(piece, out),
            _ => {}
        }
        let cache = self.cache.read().unwrap_or_else(|p| p.into_inner());
        if let Some(ids) = cache.get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let full = cache.len() >= CACHE_PIECES;
        drop(cache);
        let from = out.len();
        self.merge(piece, out);
        if !full {
            self.cache
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(piece.to_vec(), out[from..].to_vec());
        }
    }

    /// The ids of one piece, as `tokenizers`' `Word::merge_all` forms them.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        let n = piece.len();
        let mut ids: Vec<u32> = piece.iter().map(|&b| self.byte_ids[b as usize]).collect();
        // Symbol i: `ids[i]`, alive until merged into its left neighbour; `next[i]` / `prev[i]` its
        // neighbours (n / usize::MAX for none).
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        // (rank, position, merged id), the smallest first.
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(&(rank, merged)) = self.pairs.get(&(ids[i], ids[i + 1])) {
                heap.push(Reverse((rank, i, merged)));
            }
        }
        while let Some(Reverse((_, pos, merged))) = heap.pop() {
            if !alive[pos] || next[pos] >= n {
                continue;
            }
            let right = next[pos];
            if self
                .pairs
                .get(&(ids[pos], ids[right]))
                .is_none_or(|&(_, id)| id != merged)
            {
                continue;
            }
            ids[pos] = merged;
            alive[right] = false;
            next[pos] = next[right];
            if next[pos] < n {
                prev[next[pos]] = pos;
            }
            let before = prev[pos];
            if before != usize::MAX {
                if let Some(&(rank, id)) = self.pairs.get(&(ids[before], ids[pos])) {
                    heap.push(Reverse((rank, before, id)));
                }
            }
            if next[pos] < n {
                if let Some(&(rank, id)) = self.pairs.get(&(ids[pos], ids[next[pos]])) {
                    heap.push(Reverse((rank, pos, id)));
                }
            }
        }
        let mut i = 0;
        while i < n {
            out.push(ids[i]);
            i = next[i];
        }
    }
}

/// The BPE a direct encoder runs.
pub(super) enum DirectBpe<'a> {
    Merges(&'a MergeTable),
    Ranked(&'a RankedVocabulary),
}

/// Added tokens, the split regex: what the direct encoder needs besides the BPE.
pub(super) struct DirectEncoder {
    /// The added tokens' contents (leftmost-longest) and their ids, by pattern index.
    added: Option<(AhoCorasick, Vec<u32>)>,
    split: onig::Regex,
}

impl DirectEncoder {
    /// `added`: each added token's content and id. The caller has checked that every added token is
    /// matched in the raw text without stripping or word rules.
    pub(super) fn new(added: &[(String, u32)]) -> Result<Self, TokenizerError> {
        let split = onig::Regex::new(QWEN35_SPLIT_REGEX)
            .map_err(|e| TokenizerError::Build(format!("Qwen3.5 split regex: {e}")))?;
        let added = if added.is_empty() {
            None
        } else {
            let matcher = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(content, _)| content.as_str()))
                .map_err(|e| TokenizerError::Build(format!("added-token matcher: {e}")))?;
            Some((matcher, added.iter().map(|&(_, id)| id).collect()))
        };
        Ok(Self { added, split })
    }

    /// The ids of `text`; `None` when the BPE meets a byte sequence it has no token for (a ranked
    /// vocabulary checked at load never does), so that the caller can fall back.
    pub(super) fn encode(&self, text: &str, bpe: DirectBpe<'_>) -> Option<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut at = 0;
        if let Some((matcher, added_ids)) = &self.added {
            for m in matcher.find_iter(text) {
                self.encode_stretch(&text[at..m.start()], &bpe, &mut ids)?;
                ids.push(added_ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        self.encode_stretch(&text[at..], &bpe, &mut ids)?;
        Some(ids)
    }

    /// A stretch without added tokens: NFC, the split, BPE of each piece.
    fn encode_stretch(&self, stretch: &str, bpe: &DirectBpe<'_>, ids: &mut Vec<u32>) -> Option<()> {
        if stretch.is_empty() {
            return Some(());
        }
        let normalized;
        let text = if stretch.is_ascii() {
            stretch
        } else {
            normalized = stretch.nfc().map(|(c, _)| c).collect::<String>();
            normalized.as_str()
        };
        let mut piece = |bytes: &[u8]| -> Option<()> {
            match bpe {
                DirectBpe::Merges(table) => table.encode_piece(bytes, ids),
                DirectBpe::Ranked(vocab) => {
                    for (rank, _, _) in vocab.encode_piece(bytes) {
                        if rank == u32::MAX {
                            return None;
                        }
                        ids.push(rank);
                    }
                }
            }
            Some(())
        };
        let bytes = text.as_bytes();
        if text.is_ascii() {
            let mut at = 0;
            while at < bytes.len() {
                let end = ascii_match_end(bytes, at);
                piece(&bytes[at..end])?;
                at = end;
            }
            return Some(());
        }
        let mut prev = 0;
        for (start, end) in self.split.find_iter(text) {
            if prev != start {
                piece(&bytes[prev..start])?;
            }
            piece(&bytes[start..end])?;
            prev = end;
        }
        if prev != text.len() {
            piece(&bytes[prev..])?;
        }
        Some(())
    }
}

/// `\s` on ASCII (Oniguruma's Unicode `\s` there: tab, line feed, vertical tab, form feed, carriage
/// return, space).
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

fn is_newline(b: u8) -> bool {
    matches!(b, b'\r' | b'\n')
}

/// `[^\s\p{L}\p{M}\p{N}]` on ASCII: neither space, letter nor digit.
fn is_other(b: u8) -> bool {
    !is_space(b) && !b.is_ascii_alphanumeric()
}

/// Where the match of [`QWEN35_SPLIT_REGEX`] that starts at `i` ends, in ASCII text (`i` < len):
/// the regex's alternatives in order, each as the backtracking matcher resolves it on ASCII, where
/// `\p{L}` is a letter, `\p{N}` a digit and `\p{M}` nothing. Some alternative matches at every
/// position of ASCII text (a letter, a digit, a space, or any other byte by the fourth), so a
/// search never skips a byte and the matches tile the text. Tested against Oniguruma through the
/// `tokenizers` pipeline.
fn ascii_match_end(b: &[u8], i: usize) -> usize {
    let n = b.len();
    let at = |k: usize| b.get(k).copied();
    let run = |from: usize, f: fn(u8) -> bool| -> usize {
        let mut k = from;
        while k < n && f(b[k]) {
            k += 1;
        }
        k
    };
    let c = b[i];
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == b'\'' {
        let one = at(i + 1).map(|x| x.to_ascii_lowercase());
        let two = at(i + 2).map(|x| x.to_ascii_lowercase());
        match (one, two) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => {
                return i + 3
            }
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+
    let letter = |x: u8| x.is_ascii_alphabetic();
    if !is_newline(c) && !c.is_ascii_alphanumeric() && at(i + 1).is_some_and(letter) {
        return run(i + 1, |x| x.is_ascii_alphabetic());
    }
    if letter(c) {
        return run(i, |x| x.is_ascii_alphabetic());
    }
    // \p{N}
    if c.is_ascii_digit() {
        return i + 1;
    }
    //  ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*
    let other_from = if c == b' ' && at(i + 1).is_some_and(is_other) {
        Some(i + 1)
    } else if is_other(c) {
        Some(i)
    } else {
        None
    };
    if let Some(from) = other_from {
        return run(run(from, is_other), is_newline);
    }
    // What is left is a space: its run is b[i..j].
    let j = run(i, is_space);
    // \s*[\r\n]+ : up to the run's last line break.
    if let Some(last) = (i..j).rev().find(|&k| is_newline(b[k])) {
        return last + 1;
    }
    // \s+(?!\S) : the run to the end of the text, or all of it but its last space.
    if j == n {
        return j;
    }
    if j - i >= 2 {
        return j - 1;
    }
    // \s+
    j
}
