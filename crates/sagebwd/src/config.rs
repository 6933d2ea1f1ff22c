//! What the method computes: which of the seven attention products run in INT8, smoothing
//! switches, quantization block sizes. `docs/ALGORITHM.md` is the normative description.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The seven matrix products of attention forward + backward (ALGORITHM.md §1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Product {
    /// #1 forward `S = Q Kᵀ`.
    QkFwd,
    /// #2 forward `O = P V`.
    Pv,
    /// #3 backward `S = Q Kᵀ` (recomputed).
    QkBwd,
    /// #4 backward `dV = Pᵀ dO`.
    Dv,
    /// #5 backward `dP = dO Vᵀ`.
    Dp,
    /// #6 backward `dQ = dS K`.
    Dq,
    /// #7 backward `dK = dSᵀ Q`.
    Dk,
}

impl Product {
    pub const ALL: [Product; 7] = [
        Product::QkFwd,
        Product::Pv,
        Product::QkBwd,
        Product::Dv,
        Product::Dp,
        Product::Dq,
        Product::Dk,
    ];

    /// Short name used on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Product::QkFwd => "qk",
            Product::Pv => "pv",
            Product::QkBwd => "qk-bwd",
            Product::Dv => "dv",
            Product::Dp => "dp",
            Product::Dq => "dq",
            Product::Dk => "dk",
        }
    }

    /// The formula, for help texts and tables.
    pub fn formula(self) -> &'static str {
        match self {
            Product::QkFwd => "S = Q K^T (forward)",
            Product::Pv => "O = P V",
            Product::QkBwd => "S = Q K^T (backward recompute)",
            Product::Dv => "dV = P^T dO",
            Product::Dp => "dP = dO V^T",
            Product::Dq => "dQ = dS K",
            Product::Dk => "dK = dS^T Q",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn parse(s: &str) -> Result<Product> {
        let t = s.trim().to_ascii_lowercase();
        Product::ALL
            .into_iter()
            .find(|p| p.name() == t || format!("{}", p.index() + 1) == t)
            .ok_or_else(|| {
                Error::Config(format!(
                    "unknown product `{s}` (expected one of: {})",
                    Product::ALL.map(|p| p.name()).join(", ")
                ))
            })
    }
}

impl fmt::Display for Product {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Precision of one product. The exact reference is f64 and is not a `Precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// INT8 × INT8 → INT32, dequantized with the operands' scales.
    Int8,
    /// BF16 operands, FP32 accumulation.
    Bf16,
}

/// A complete description of the quantized method.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    /// Precision of each product, indexed by `Product::index()`.
    pub precision: [Precision; 7],
    /// Subtract the per-(batch, kv-head) token mean of K before quantizing (ALGORITHM.md §4).
    pub smooth_k: bool,
    /// Subtract a per-block token mean of Q and add the bias back (ALGORITHM.md §5).
    pub smooth_q: bool,
    /// Add the exact K-smoothing correction `rowsum(dS) K_m` to dQ (ALGORITHM.md §7).
    pub dq_smooth_k_correction: bool,
    /// Query rows per quantization block, `B_q`.
    pub block_q: usize,
    /// Key/value rows per quantization block, `B_kv`.
    pub block_kv: usize,
}

/// Default quantization block sizes; ALGORITHM.md §3 explains the choice.
pub const DEFAULT_BLOCK_Q: usize = 64;
pub const DEFAULT_BLOCK_KV: usize = 128;

/// Named configurations.
pub const PRESETS: [&str; 3] = ["fpa", "sagebwd", "int8-all"];

impl Config {
    fn uniform(p: Precision, smooth_k: bool) -> Config {
        Config {
            precision: [p; 7],
            smooth_k,
            smooth_q: false,
            dq_smooth_k_correction: false,
            block_q: DEFAULT_BLOCK_Q,
            block_kv: DEFAULT_BLOCK_KV,
        }
    }

    /// All seven products in BF16, no smoothing: FlashAttention.
    pub fn fpa() -> Config {
        Config::uniform(Precision::Bf16, false)
    }

    /// The SageBwd recipe: all INT8 except `dP = dO Vᵀ`, K-smoothing on.
    pub fn sagebwd() -> Config {
        let mut c = Config::uniform(Precision::Int8, true);
        c.precision[Product::Dp.index()] = Precision::Bf16;
        c
    }

    /// All seven products INT8, K-smoothing on.
    pub fn int8_all() -> Config {
        Config::uniform(Precision::Int8, true)
    }

    /// `fpa` with exactly one product switched to INT8 (the isolation method), K-smoothing on
    /// as in `sagebwd` so the quantized operand is the one SageBwd would use.
    pub fn isolate(p: Product) -> Config {
        let mut c = Config::uniform(Precision::Bf16, true);
        c.precision[p.index()] = Precision::Int8;
        c
    }

    pub fn preset(name: &str) -> Result<Config> {
        match name.trim().to_ascii_lowercase().as_str() {
            "fpa" => Ok(Config::fpa()),
            "sagebwd" => Ok(Config::sagebwd()),
            "int8-all" | "int8all" => Ok(Config::int8_all()),
            other => Err(Error::Config(format!(
                "unknown preset `{other}` (expected one of: {})",
                PRESETS.join(", ")
            ))),
        }
    }

    pub fn get(&self, p: Product) -> Precision {
        self.precision[p.index()]
    }

    pub fn set(&mut self, p: Product, prec: Precision) -> &mut Self {
        self.precision[p.index()] = prec;
        self
    }

    pub fn is_int8(&self, p: Product) -> bool {
        self.get(p) == Precision::Int8
    }

    /// Checks the block sizes.
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("block_q", self.block_q), ("block_kv", self.block_kv)] {
            if b == 0 || b > 1024 {
                return Err(Error::Config(format!("{name} must be in 1..=1024, got {b}")));
            }
        }
        Ok(())
    }

    /// A short human-readable label: the preset whose precisions match, with the switches that
    /// differ from it (`sagebwd-smoothK+dQcorr`), else the INT8 product list (`int8[dq]+smoothK`).
    pub fn label(&self) -> String {
        let preset = PRESETS.into_iter().map(|n| (n, Config::preset(n).unwrap())).find(|(_, c)| c.precision == self.precision);
        let (mut s, smooth_k_default) = match preset {
            Some((name, c)) => (name.to_string(), c.smooth_k),
            None => {
                let int8: Vec<&str> = Product::ALL.into_iter().filter(|p| self.is_int8(*p)).map(|p| p.name()).collect();
                (format!("int8[{}]", int8.join(",")), false)
            }
        };
        if self.smooth_k != smooth_k_default {
            s.push_str(if self.smooth_k { "+smoothK" } else { "-smoothK" });
        }
        if self.smooth_q {
            s.push_str("+smoothQ");
        }
        if self.dq_smooth_k_correction {
            s.push_str("+dQcorr");
        }
        s
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::sagebwd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_products() {
        let s = Config::sagebwd();
        for p in Product::ALL {
            assert_eq!(s.is_int8(p), p != Product::Dp, "{p}");
            assert!(!Config::fpa().is_int8(p));
            assert!(Config::int8_all().is_int8(p));
        }
        assert!(s.smooth_k && !s.smooth_q && !s.dq_smooth_k_correction);
    }

    #[test]
    fn names_round_trip_and_labels() {
        for p in Product::ALL {
            assert_eq!(Product::parse(p.name()).unwrap(), p);
        }
        assert!(Product::parse("dx").is_err());
        assert!(Config::preset("nope").is_err());
        for name in PRESETS {
            assert_eq!(Config::preset(name).unwrap().label(), name);
        }
        assert_eq!(Config::isolate(Product::Dq).label(), "int8[dq]+smoothK");
        let mut c = Config::sagebwd();
        c.smooth_k = false;
        c.dq_smooth_k_correction = true;
        assert_eq!(c.label(), "sagebwd-smoothK+dQcorr");
    }
}
