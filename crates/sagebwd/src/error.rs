//! The library's error type: every fallible entry point returns `Result<T, Error>`.

use std::path::PathBuf;

/// Everything that can go wrong when the library is handed a problem.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit together (tensor lengths, head counts, sequence lengths).
    #[error("shape error: {0}")]
    Shape(String),
    /// A head dimension this backend does not implement.
    #[error("unsupported head dimension {got}: {supported}")]
    HeadDim { got: usize, supported: String },
    /// A configuration that is not valid (block sizes, unknown product or preset name).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// NaN or Inf found in an input tensor (checked mode).
    #[error("non-finite value in input `{tensor}` at flat index {index} (value {value})")]
    NonFinite { tensor: String, index: usize, value: f32 },
    /// A finite input value the method cannot represent (see `inputs::check_magnitudes`).
    #[error("input `{tensor}` at flat index {index} (value {value:e}): {bound}")]
    OutOfRange {
        tensor: String,
        index: usize,
        value: f32,
        bound: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    /// A tensor file that exists but is not what we expect.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// A backend (GPU runtime, compiler) failed.
    #[error("{0}")]
    Backend(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
