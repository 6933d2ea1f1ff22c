//! # sagebwd — INT8 attention for training, the SageBwd method
//!
//! This crate holds everything that does not need a GPU:
//! - [`config`]: which of the seven attention products are INT8, smoothing, block sizes;
//! - [`reference`]: exact attention forward and backward in f64 (the oracle);
//! - [`sim`]: a simulator of the quantized method that follows `docs/ALGORITHM.md` exactly, so GPU
//!   kernels can be compared with it value by value;
//! - [`quant`]: the quantizer shared by the simulator (and mirrored by the kernels);
//! - [`metrics`]: cosine similarity, relative L2 / L1, RMSE;
//! - [`inputs`]: random test problems; [`io`]: safetensors files.

pub mod config;
pub mod error;
pub mod fp8;
pub mod inputs;
pub mod io;
pub mod metrics;
pub mod quant;
pub mod reference;
pub mod sim;
pub mod tensor;

pub use config::{Config, Precision, Product};
pub use error::{Error, Result};
pub use tensor::{Inputs, Shape};
