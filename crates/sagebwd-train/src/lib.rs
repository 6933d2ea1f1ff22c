//! # sagebwd-train — pre-training a Llama-style language model with SageBwd attention
//!
//! The training step is written out explicitly, llm.c style: every layer has a forward and a
//! hand-written backward (`layers/`), the model (`model.rs`) chains them, and the hardware sits behind
//! one trait (`backend/`): today a CPU backend (f32, rayon, attention from the `sagebwd` crate:
//! exact or the quantized-method simulator); a GPU backend comes next.
//!
//! - [`config`]: model sizes; [`model`]: weights and forward/backward; [`optim`]: AdamW, clipping,
//!   the learning-rate schedule;
//! - [`tokenizer`], [`data`]: GPT-2 BPE, corpus files, shards, the train/validation split, batches;
//! - [`train`]: the training loop; [`checkpoint`]: safetensors checkpoints; [`metrics`]: JSONL
//!   metrics; [`plot`]: loss curves; [`sample`]: the built-in sample corpus.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod layers;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod plot;
pub mod rng;
pub mod sample;
pub mod shards;
pub mod tokenizer;
pub mod train;

pub use error::{Error, Result};
