//! Errors of the training library: each one a single line that says what is wrong and, where it
//! helps, what to do about it.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("attention: {0}")]
    Attention(#[from] sagebwd::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("data: {0}")]
    Data(String),
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    #[error("{0}")]
    Diverged(String),
    #[error("plot: {0}")]
    Plot(String),
    #[error("GPU: {0}")]
    Gpu(String),
    #[error("output {path}: {msg}")]
    Output { path: PathBuf, msg: String },
    #[error("run directory {path}: {msg}")]
    RunDir { path: PathBuf, msg: String },
    #[error("interrupted by {signal} after step {step}; {saved}")]
    Interrupted { signal: String, step: u64, saved: String },
}

pub type Result<T> = std::result::Result<T, Error>;

/// Wraps an I/O error with the path it concerns.
pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}
