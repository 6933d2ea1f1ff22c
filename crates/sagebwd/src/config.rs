//! What the method computes: which of the seven attention products run in INT8, smoothing
//! switches, quantization block sizes. `docs/ALGORITHM.md` is the normative description.

use crate::error::{Error, Result};
use crate::fp8::{Fp8, TensorSum};
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
    /// How P and dS are quantized for products #2, #4, #6, #7 when those are 8-bit (ALGORITHM.md §10);
    /// the default is the `sagebwd` method of §2.
    #[serde(default)]
    pub pds: PdsQuant,
}

/// How one 8-bit operand (P or dS, for one product) is quantized (ALGORITHM.md §10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Format {
    /// INT8 with one FP32 scale per group of `rows` query rows × `cols` keys inside each
    /// `B_q × B_kv` tile (0 = the whole block side), the §2.2 quantizer.
    Int8 { rows: usize, cols: usize },
    /// An FP8 format: P with the fixed scale of §10.2, dS with one power-of-two scale per
    /// (batch, head) from the tensor's amax (§10.3); the other operand an FP8 copy (§10.1).
    Fp8(Fp8),
}

impl Format {
    /// The §2.1 tile group (`B_q × B_kv`).
    pub const TILE: Format = Format::Int8 { rows: 0, cols: 0 };
    /// The forward's §2.1 P group (one row × `B_kv`).
    pub const ROW_BLOCK: Format = Format::Int8 { rows: 1, cols: 0 };

    pub fn is_fp8(self) -> bool {
        matches!(self, Format::Fp8(_))
    }

    pub fn describe(self) -> String {
        match self {
            Format::Int8 { rows, cols } => {
                let side = |n: usize, b: &str| if n == 0 { b.to_string() } else { n.to_string() };
                format!("int8 {}x{}", side(rows, "Bq"), side(cols, "Bkv"))
            }
            Format::Fp8(f) => f.name().to_string(),
        }
    }
}

/// Which scale the FP8 copies of V, dO, K, Q carry (ALGORITHM.md §10.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Fp8OperandScale {
    /// One power-of-two scale per (batch, head, channel): constant along every reduction axis.
    #[default]
    Channel,
    /// One per (batch, head): cuDNN's per-tensor recipe.
    Tensor,
}

/// Where `D = rowsum(dO ∘ O)` takes O from (ALGORITHM.md §10.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum DeltaFrom {
    /// The stored BF16 output of the quantized forward (§5).
    #[default]
    QuantizedO,
    /// O′ = the forward with P unquantized (FP32 P times BF16 V, FP32), not rounded (Attn-QAT).
    UnquantizedP,
}

/// The P / dS quantization of products #2 (`p_fwd`), #4 (`p_bwd`), #6 (`ds_dq`), #7 (`ds_dk`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PdsQuant {
    pub p_fwd: Format,
    pub p_bwd: Format,
    pub ds_dq: Format,
    pub ds_dk: Format,
    pub fp8_operand_scale: Fp8OperandScale,
    pub delta: DeltaFrom,
    /// The FP8 tensor core's sum (exact FP32 by default).
    pub fp8_sum: TensorSum,
}

impl Default for PdsQuant {
    fn default() -> Self {
        PdsQuant {
            p_fwd: Format::ROW_BLOCK,
            p_bwd: Format::TILE,
            ds_dq: Format::TILE,
            ds_dk: Format::TILE,
            fp8_operand_scale: Fp8OperandScale::Channel,
            delta: DeltaFrom::QuantizedO,
            fp8_sum: TensorSum::default(),
        }
    }
}

impl PdsQuant {
    /// The §2 method (every group as §2.1 says).
    pub fn is_default(&self) -> bool {
        *self == PdsQuant::default()
    }

    /// Short label of what differs from the default, e.g. `p=e4m3,ds=int8 1x64`.
    pub fn describe(&self) -> String {
        let d = PdsQuant::default();
        let mut parts = Vec::new();
        for (name, f, f0) in [
            ("p_fwd", self.p_fwd, d.p_fwd),
            ("p_bwd", self.p_bwd, d.p_bwd),
            ("ds_dq", self.ds_dq, d.ds_dq),
            ("ds_dk", self.ds_dk, d.ds_dk),
        ] {
            if f != f0 {
                parts.push(format!("{name}={}", f.describe()));
            }
        }
        if self.fp8_operand_scale != d.fp8_operand_scale {
            parts.push("fp8-operands=tensor".into());
        }
        if self.delta != d.delta {
            parts.push("delta=unquantized-p".into());
        }
        if self.fp8_sum != d.fp8_sum {
            parts.push(format!(
                "fp8-sum={}b/promote{}",
                self.fp8_sum.mantissa_bits, self.fp8_sum.promote
            ));
        }
        parts.join(",")
    }

    /// Whether a product that needs an FP8 copy of the other operand is FP8 (any of the four).
    pub fn any_fp8(&self) -> bool {
        [self.p_fwd, self.p_bwd, self.ds_dq, self.ds_dk]
            .iter()
            .any(|f| f.is_fp8())
    }
}

/// Default quantization block sizes; ALGORITHM.md §3 explains the choice.
pub const DEFAULT_BLOCK_Q: usize = 64;
pub const DEFAULT_BLOCK_KV: usize = 128;

/// Named configurations.
pub const PRESETS: [&str; 3] = ["fpa", "sagebwd", "int8-all"];

/// The variants of the P / dS quantization study (ALGORITHM.md §10, docs/QUANTIZATION-DESIGN.md):
/// `sagebwd`'s precisions and smoothing with another [`PdsQuant`].
pub const VARIANTS: [&str; 11] = [
    "int8-row128",
    "int8-row64",
    "int8-axis",
    "p-e4m3",
    "p-e4m3-ds-axis",
    "p-e4m3-ds-e4m3",
    "p-e4m3-ds-e5m2",
    "fp8-tensor",
    "int8-axis-delta-p",
    "p-e4m3-ds-axis-delta-p",
    "p-e4m3-ds-e4m3-delta-p",
];

impl Config {
    fn uniform(p: Precision, smooth_k: bool) -> Config {
        Config {
            precision: [p; 7],
            smooth_k,
            smooth_q: false,
            dq_smooth_k_correction: false,
            block_q: DEFAULT_BLOCK_Q,
            block_kv: DEFAULT_BLOCK_KV,
            pds: PdsQuant::default(),
        }
    }

    /// The P / dS quantization of a named variant (`VARIANTS`), or `None`.
    pub fn variant_pds(name: &str) -> Option<PdsQuant> {
        let row = |n| Format::Int8 { rows: 1, cols: n };
        let e4 = Format::Fp8(Fp8::E4m3);
        let d = PdsQuant::default();
        // Groups whose scale is constant along each product's reduction axis inside a tile.
        let axis = PdsQuant {
            p_bwd: Format::Int8 { rows: 0, cols: 1 },
            ds_dq: Format::Int8 { rows: 1, cols: 0 },
            ds_dk: Format::Int8 { rows: 0, cols: 1 },
            ..d
        };
        let p8 = PdsQuant {
            p_fwd: e4,
            p_bwd: e4,
            ..d
        };
        Some(match name {
            "int8-row128" => PdsQuant {
                p_bwd: row(0),
                ds_dq: row(0),
                ds_dk: row(0),
                ..d
            },
            "int8-row64" => PdsQuant {
                p_fwd: row(64),
                p_bwd: row(64),
                ds_dq: row(64),
                ds_dk: row(64),
                ..d
            },
            "int8-axis" => axis,
            "int8-axis-delta-p" => PdsQuant {
                delta: DeltaFrom::UnquantizedP,
                ..axis
            },
            "p-e4m3" => p8,
            "p-e4m3-ds-axis" => PdsQuant {
                ds_dq: axis.ds_dq,
                ds_dk: axis.ds_dk,
                ..p8
            },
            "p-e4m3-ds-axis-delta-p" => PdsQuant {
                ds_dq: axis.ds_dq,
                ds_dk: axis.ds_dk,
                delta: DeltaFrom::UnquantizedP,
                ..p8
            },
            "p-e4m3-ds-e4m3" => PdsQuant {
                ds_dq: e4,
                ds_dk: e4,
                ..p8
            },
            "p-e4m3-ds-e4m3-delta-p" => PdsQuant {
                ds_dq: e4,
                ds_dk: e4,
                delta: DeltaFrom::UnquantizedP,
                ..p8
            },
            "p-e4m3-ds-e5m2" => {
                let e5 = Format::Fp8(Fp8::E5m2);
                PdsQuant {
                    ds_dq: e5,
                    ds_dk: e5,
                    ..p8
                }
            }
            "fp8-tensor" => PdsQuant {
                ds_dq: e4,
                ds_dk: e4,
                fp8_operand_scale: Fp8OperandScale::Tensor,
                ..p8
            },
            _ => return None,
        })
    }

    /// Whether some GPU kernel implements this configuration: every variant of the P / dS quantization
    /// study (`pds` other than the default) is simulated only.
    pub fn has_kernels(&self) -> bool {
        self.pds.is_default()
    }

    /// Whether the GPU runs this configuration's forward (but not its backward): an e4m3 P in the forward after an
    /// INT8 #1 and #2 (§10.2), the FP8 copy of V per channel, δ from the quantized O, no Q-smoothing — the
    /// `p-e4m3*` variants but `fp8-tensor`. The kernel (sm_90a) adds each key block's FP8 sum to the FP32 O once:
    /// its O is the simulator's with `fp8_sum.promote = block_kv`.
    pub fn has_fp8_forward_kernel(&self) -> bool {
        self.pds.p_fwd == Format::Fp8(Fp8::E4m3)
            && self.pds.fp8_operand_scale == Fp8OperandScale::Channel
            && self.pds.delta == DeltaFrom::QuantizedO
            && self.is_int8(Product::QkFwd)
            && self.is_int8(Product::Pv)
            && !self.smooth_q
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
            other => match Config::variant_pds(other) {
                Some(pds) => Ok(Config {
                    pds,
                    ..Config::sagebwd()
                }),
                None => Err(Error::Config(format!(
                    "unknown preset `{other}` (expected one of: {}, {})",
                    PRESETS.join(", "),
                    VARIANTS.join(", ")
                ))),
            },
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

    /// Checks the block sizes and the P / dS groups.
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("block_q", self.block_q), ("block_kv", self.block_kv)] {
            if b == 0 || b > 1024 {
                return Err(Error::Config(format!("{name} must be in 1..=1024, got {b}")));
            }
        }
        for (name, f) in [
            ("p_fwd", self.pds.p_fwd),
            ("p_bwd", self.pds.p_bwd),
            ("ds_dq", self.pds.ds_dq),
            ("ds_dk", self.pds.ds_dk),
        ] {
            if let Format::Int8 { rows, cols } = f {
                if rows > self.block_q || cols > self.block_kv {
                    return Err(Error::Config(format!(
                        "{name}: group {rows}x{cols} exceeds the {}x{} tile",
                        self.block_q, self.block_kv
                    )));
                }
            }
        }
        if !matches!(self.pds.p_fwd, Format::Int8 { rows: 1, .. } | Format::Fp8(Fp8::E4m3)) {
            return Err(Error::Config(
                "p_fwd: the forward quantizes P one row at a time (int8 groups 1xN) or e4m3".into(),
            ));
        }
        if self.pds.p_bwd == Format::Fp8(Fp8::E5m2) {
            return Err(Error::Config(
                "p_bwd: P in FP8 is e4m3 (P ∈ [0, 1] needs no range)".into(),
            ));
        }
        if self.pds.ds_dq.is_fp8() != self.pds.ds_dk.is_fp8()
            || (self.pds.ds_dq.is_fp8() && self.pds.ds_dq != self.pds.ds_dk)
        {
            return Err(Error::Config(
                "ds_dq and ds_dk: one FP8 dS serves both, or both are INT8".into(),
            ));
        }
        if !self.pds.is_default() && (self.smooth_q || self.dq_smooth_k_correction) {
            return Err(Error::Config(
                "the P / dS variants are simulated without Q-smoothing and the dQ correction".into(),
            ));
        }
        if !self.pds.fp8_sum.promote.is_multiple_of(crate::fp8::WGMMA_K) {
            return Err(Error::Config(format!(
                "fp8 promotion interval must be a multiple of {}",
                crate::fp8::WGMMA_K
            )));
        }
        Ok(())
    }

    /// A short human-readable label: the preset whose precisions match, with the switches that
    /// differ from it (`sagebwd-smoothK+dQcorr`), else the INT8 product list (`int8[dq]+smoothK`).
    pub fn label(&self) -> String {
        if let Some(v) = VARIANTS.into_iter().find(|v| Config::variant_pds(v) == Some(self.pds)) {
            if self.precision == Config::sagebwd().precision && self.smooth_k {
                return v.to_string();
            }
        }
        let preset = PRESETS
            .into_iter()
            .map(|n| (n, Config::preset(n).unwrap()))
            .find(|(_, c)| c.precision == self.precision);
        let (mut s, smooth_k_default) = match preset {
            Some((name, c)) => (name.to_string(), c.smooth_k),
            None => {
                let int8: Vec<&str> = Product::ALL
                    .into_iter()
                    .filter(|p| self.is_int8(*p))
                    .map(|p| p.name())
                    .collect();
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
        if !self.pds.is_default() {
            s.push_str(&format!("[{}]", self.pds.describe()));
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
