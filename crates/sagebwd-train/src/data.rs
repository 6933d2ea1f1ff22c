//! Corpus text files → documents → tokens, and the train/validation split.
//!
//! **Format.** A corpus is one or more UTF-8 text files, plain or compressed (`.xz`, `.zst`).
//! Documents are separated by the ASCII record separator RS (byte 0x1E); one newline directly after
//! an RS belongs to the separator and is dropped. A file with no RS is one document. An RS at the
//! very end of a file does not start an empty document.
//!
//! **Tokens.** Each document is encoded with GPT-2 BPE and followed by the end-of-text token (50256),
//! so EOT separates documents and the model learns where one ends.
//!
//! **Split.** Documents are numbered from 0 across all input files in the order given; document `i`
//! is validation when `i % val_every == 1` and training otherwise (with `val_every = 100` this is the
//! rule `../shared/data` was split by). The split is by document, so no document is in both.

use crate::error::{io_err, Error, Result};
use crate::tokenizer::{Tokenizer, EOT};
use rayon::prelude::*;
use std::io::Read;
use std::path::Path;

/// The record separator between documents.
pub const RS: char = '\u{1e}';

/// Reads a corpus file, decompressing `.xz` / `.zst` by extension.
pub fn read_text_file(path: &Path) -> Result<String> {
    if !path.exists() {
        return Err(Error::Data(format!("{}: no such file", path.display())));
    }
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    decode_text(&path.display().to_string(), &bytes)
}

/// Decompresses (by the name's extension) and decodes UTF-8 (invalid sequences become U+FFFD).
pub fn decode_text(name: &str, bytes: &[u8]) -> Result<String> {
    let fail = |e: std::io::Error| Error::Data(format!("{name}: cannot decompress: {e}"));
    let raw = if name.ends_with(".xz") {
        let mut out = Vec::new();
        liblzma::read::XzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(fail)?;
        out
    } else if name.ends_with(".zst") || name.ends_with(".zstd") {
        zstd::stream::decode_all(bytes).map_err(fail)?
    } else {
        bytes.to_vec()
    };
    Ok(match String::from_utf8(raw) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// The documents of one file's text (see the module docs for the rule).
pub fn split_documents(text: &str) -> Vec<&str> {
    let mut docs: Vec<&str> = text.split(RS).collect();
    for d in docs.iter_mut().skip(1) {
        *d = d.strip_prefix('\n').unwrap_or(d);
    }
    if docs.len() > 1 && docs.last().is_some_and(|d| d.is_empty()) {
        docs.pop();
    }
    docs
}

/// Whether document `index` belongs to the validation split.
pub fn is_validation(index: usize, val_every: usize) -> bool {
    val_every >= 2 && index % val_every == 1
}

/// Token streams of the two splits, with their text sizes in bytes.
#[derive(Default)]
pub struct SplitTokens {
    pub train: Vec<u16>,
    pub val: Vec<u16>,
    pub train_docs: usize,
    pub val_docs: usize,
    pub train_bytes: u64,
    pub val_bytes: u64,
}

/// Tokenizes documents in parallel (one task per document: BPE never crosses a document, so the
/// tokens equal a sequential encoding) and splits them by index.
pub fn tokenize_documents(docs: &[&str], val_every: usize) -> SplitTokens {
    let tok = Tokenizer::gpt2();
    let encoded: Vec<Vec<u32>> = docs.par_iter().map(|d| tok.encode(d)).collect();
    let mut out = SplitTokens::default();
    for (i, (ids, doc)) in encoded.into_iter().zip(docs).enumerate() {
        let val = is_validation(i, val_every);
        let (dst, n_docs, n_bytes) = if val {
            (&mut out.val, &mut out.val_docs, &mut out.val_bytes)
        } else {
            (&mut out.train, &mut out.train_docs, &mut out.train_bytes)
        };
        dst.extend(ids.into_iter().map(|t| t as u16)); // GPT-2 ids are < 65536
        dst.push(EOT as u16);
        *n_docs += 1;
        *n_bytes += doc.len() as u64;
    }
    out
}

/// Reads, splits and tokenizes text files (in parallel across files and documents).
pub fn tokenize_files(paths: &[&Path], val_every: usize) -> Result<SplitTokens> {
    let texts: Vec<String> = paths.par_iter().map(|p| read_text_file(p)).collect::<Result<_>>()?;
    let docs: Vec<&str> = texts.iter().flat_map(|t| split_documents(t)).collect();
    Ok(tokenize_documents(&docs, val_every))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_split_on_rs_and_drop_the_newline_after_it() {
        assert_eq!(split_documents("a\nb"), vec!["a\nb"]);
        assert_eq!(
            split_documents("one\n\u{1e}\ntwo\n\u{1e}three\u{1e}\n"),
            vec!["one\n", "two\n", "three"]
        );
        assert_eq!(split_documents(""), vec![""]);
    }

    #[test]
    fn split_is_by_document_index() {
        let docs = ["d0", "d1", "d2", "d3", "d4"];
        let s = tokenize_documents(&docs, 3);
        assert_eq!((s.train_docs, s.val_docs), (3, 2)); // 1 and 4 are validation
        assert_eq!(s.val_bytes, 4);
        assert_eq!(s.val.iter().filter(|&&t| t as u32 == EOT).count(), 2);
        assert_eq!(*s.train.last().unwrap() as u32, EOT);
    }

    #[test]
    fn compressed_files_decode_like_plain_ones() {
        let text = "first\n\u{1e}\nsecond";
        let zst = zstd::stream::encode_all(text.as_bytes(), 3).unwrap();
        assert_eq!(decode_text("x.txt.zst", &zst).unwrap(), text);
        let mut xz = Vec::new();
        liblzma::read::XzEncoder::new(text.as_bytes(), 6)
            .read_to_end(&mut xz)
            .unwrap();
        assert_eq!(decode_text("x.txt.xz", &xz).unwrap(), text);
        let e = decode_text("bad.xz", b"not xz").unwrap_err().to_string();
        assert!(e.contains("bad.xz") && e.contains("decompress"), "{e}");
    }
}
