//! # sagebwd-train — pre-training a Llama-style language model with SageBwd attention
//!
//! The training step is written out explicitly, llm.c style: every layer has a forward and a
//! hand-written backward (`layers/`), the model (`model.rs`) chains them, and the hardware sits behind
//! one trait (`backend/`) for the CPU path (f32, rayon, attention from the `sagebwd` crate: exact or
//! the quantized-method simulator). The loop drives an [`engine::Engine`]: the CPU engine, the GPU
//! engine ([`gpu`]: cuBLASLt, fused kernels, sagebwd-cuda attention), or several GPU engines in a
//! data-parallel group ([`parallel`], NCCL).
//!
//! - [`config`]: model sizes; [`model`]: weights and forward/backward; [`optim`]: AdamW, clipping,
//!   the learning-rate schedule;
//! - [`tokenizer`], [`data`]: GPT-2 BPE, corpus files, shards, the train/validation split, batches;
//! - [`train`]: the training loop; [`parallel`]: data parallelism over GPUs; [`checkpoint`]: safetensors checkpoints; [`metrics`]: JSONL
//!   metrics; [`plot`]: loss curves; [`sample`]: the built-in sample corpus.

pub mod backend;
pub mod capture;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod layers;
pub mod loader;
pub mod method;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod output;
pub mod parallel;
pub mod plot;
pub mod rng;
pub mod rundir;
pub mod sample;
pub mod shards;
pub mod signals;
pub mod tokenizer;
pub mod trace;
pub mod train;

pub use error::{Error, Result};
