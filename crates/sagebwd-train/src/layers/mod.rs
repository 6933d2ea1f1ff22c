//! The model's layers, each an explicit forward and a hand-written backward (as in llm.c).
//! Activations are row-major `[tokens, features]` with `tokens = batch × seq` (token `b·T + t`).

pub mod attention;
pub mod embedding;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod rmsnorm;
pub mod rotary;

/// Rows handled per parallel task in the row-wise layers; partial sums over rows are combined in
/// chunk order, so every reduction is reproducible.
pub const ROW_CHUNK: usize = 64;
