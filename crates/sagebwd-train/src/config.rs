//! Model dimensions: named size presets or explicit values.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// GPT-2 BPE vocabulary size (r50k_base).
pub const GPT2_VOCAB: usize = 50257;

/// A decoder-only Llama-style transformer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    /// Model width `D`.
    pub dim: usize,
    pub n_layers: usize,
    /// Query heads; the head dimension is `dim / n_heads`.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// SwiGLU hidden width.
    pub ffn_hidden: usize,
    /// Longest sequence the rotary table is built for.
    pub max_seq_len: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    /// RMSNorm with a learned gain on every query and key head vector, before rotary.
    pub qk_norm: bool,
    /// The LM head reuses the token embedding matrix.
    pub tied_embeddings: bool,
}

/// Size presets and their approximate parameter counts with the GPT-2 vocabulary (tied embeddings).
pub const SIZE_PRESETS: [(&str, &str); 4] = [
    (
        "tiny",
        "dim 64, 4 layers, 1 head of 64: 0.2M in the blocks + 3.2M embedding (CPU tests and demo)",
    ),
    (
        "small",
        "dim 384, 6 layers, 6 heads: 10.6M in the blocks + 19.3M embedding ≈ 30M",
    ),
    (
        "base",
        "dim 768, 12 layers, 12 heads: 85M in the blocks + 38.6M embedding ≈ 124M",
    ),
    (
        "medium",
        "dim 1024, 24 layers, 16 heads: 308M in the blocks + 51.5M embedding ≈ 360M",
    ),
];

impl ModelConfig {
    /// A preset by name (`tiny`, `small`, `base`, `medium`).
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let (dim, n_layers, n_heads, ffn_hidden) = match name.trim().to_ascii_lowercase().as_str() {
            "tiny" => (64, 4, 1, 176),
            "small" => (384, 6, 6, 1024),
            "base" => (768, 12, 12, 2048),
            "medium" => (1024, 24, 16, 2816),
            other => {
                let names: Vec<&str> = SIZE_PRESETS.iter().map(|p| p.0).collect();
                return Err(Error::Config(format!(
                    "unknown model size `{other}` (expected one of: {})",
                    names.join(", ")
                )));
            }
        };
        Ok(ModelConfig {
            vocab_size: GPT2_VOCAB,
            dim,
            n_layers,
            n_heads,
            n_kv_heads: n_heads,
            ffn_hidden,
            max_seq_len: 4096,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            qk_norm: true,
            tied_embeddings: true,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// One line for logs: "dim 768, 12 layers, 12 heads (12 kv), head dim 64, ffn 2048, vocab 50257,
    /// QK-norm on, embeddings tied".
    pub fn describe(&self) -> String {
        format!(
            "dim {}, {} layers, {} heads ({} kv), head dim {}, ffn {}, vocab {}, QK-norm {}, embeddings {}",
            self.dim,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim(),
            self.ffn_hidden,
            self.vocab_size,
            if self.qk_norm { "on" } else { "off" },
            if self.tied_embeddings { "tied" } else { "untied" }
        )
    }

    /// Training FLOPs per token at sequence length `seq` (forward + backward; PaLM's convention with
    /// causal attention): `6 ×` the weights of every product (block matrices and the LM head, tied
    /// or not) plus `6 · layers · seq · heads · head_dim` for the attention score and value products
    /// (`12 · L · seq · H·hd` without the mask, halved by causality). Norms, rotary and softmax are
    /// not counted.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (d, hd) = (self.dim as f64, self.head_dim() as f64);
        let (q, kv) = (self.n_heads as f64 * hd, self.n_kv_heads as f64 * hd);
        let per_layer = d * (q + 2.0 * kv) + q * d + 3.0 * d * self.ffn_hidden as f64;
        let matmul = self.n_layers as f64 * per_layer + self.vocab_size as f64 * d;
        6.0 * matmul + 6.0 * self.n_layers as f64 * seq as f64 * q
    }

    /// Checks that the dimensions fit together.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab size", self.vocab_size),
            ("dim", self.dim),
            ("layers", self.n_layers),
            ("heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("ffn hidden", self.ffn_hidden),
            ("max sequence length", self.max_seq_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::Config(format!("{name} must be at least 1")));
            }
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return Err(Error::Config(format!(
                "dim {} is not a multiple of heads {}",
                self.dim, self.n_heads
            )));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(Error::Config(format!(
                "heads {} is not a multiple of kv heads {}",
                self.n_heads, self.n_kv_heads
            )));
        }
        let hd = self.head_dim();
        if !hd.is_multiple_of(2) || hd > sagebwd::tensor::MAX_HEAD_DIM_CPU {
            return Err(Error::Config(format!(
                "head dimension {hd} must be even (rotary pairs) and at most {}",
                sagebwd::tensor::MAX_HEAD_DIM_CPU
            )));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(Error::Config(format!("vocab size {} is too large", self.vocab_size)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamLayout;

    /// The preset table's parameter counts are what the layout really allocates.
    #[test]
    fn presets_have_the_documented_sizes() {
        for (name, millions) in [("tiny", 3.4), ("small", 29.9), ("base", 123.6), ("medium", 359.6)] {
            let cfg = ModelConfig::preset(name).unwrap();
            cfg.validate().unwrap();
            let n = ParamLayout::new(&cfg).total as f64 / 1e6;
            assert!(
                (n - millions).abs() / millions < 0.02,
                "{name}: {n:.1}M parameters, documented {millions}M"
            );
        }
    }

    #[test]
    fn bad_dimensions_are_rejected_with_a_reason() {
        let mut cfg = ModelConfig::preset("tiny").unwrap();
        cfg.n_heads = 3;
        assert!(cfg.validate().unwrap_err().to_string().contains("multiple of heads"));
        assert!(ModelConfig::preset("huge").unwrap_err().to_string().contains("tiny"));
    }
}
