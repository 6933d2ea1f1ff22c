//! Fixtures shared by the integration tests.

use sagebwd_train::config::ModelConfig;
use sagebwd_train::optim::AdamWConfig;
use sagebwd_train::train::TrainConfig;

/// A one-step run of `model` with `attention` over 16-token sequences, one sequence per micro-batch.
pub fn one_step_config(model: ModelConfig, attention: &str) -> TrainConfig {
    TrainConfig {
        model,
        attention: attention.into(),
        method: None,
        trace: false,
        seq_len: 16,
        micro_batch: 1,
        grad_accum: 1,
        steps: 1,
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 1,
        adamw: AdamWConfig::default(),
        grad_clip: 1.0,
        eval_every: 1,
        eval_tokens: 16,
        checkpoint_every: 1,
        seed: 1,
        gpus: 1,
    }
}
