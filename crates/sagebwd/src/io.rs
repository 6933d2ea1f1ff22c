//! Tensor files: reading Q, K, V (and dO) from safetensors, writing results to safetensors.
//! Inputs may be BF16, F16 or F32, each `B × H × N × d`; outputs are written atomically
//! (a temporary file renamed into place), so an interrupted run never leaves half a file.

use crate::error::{Error, Result};
use crate::tensor::{Inputs, Shape};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Names accepted for the output gradient in an input file.
pub const DO_NAMES: [&str; 3] = ["do", "dO", "grad_out"];

fn format_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// One tensor as `(dims, f32 values)`.
fn read_tensor(path: &Path, st: &SafeTensors, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let view = st.tensor(name).map_err(|_| {
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        format_err(
            path,
            format!("no tensor named `{name}` (the file has: {})", names.join(", ")),
        )
    })?;
    let bytes = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format_err(
                path,
                format!("tensor `{name}` has dtype {other:?}; expected BF16, F16 or F32"),
            ))
        }
    };
    let dims = view.shape().to_vec();
    if dims.len() != 4 {
        return Err(format_err(
            path,
            format!("tensor `{name}` has shape {dims:?}; expected 4 dimensions B×H×N×d"),
        ));
    }
    Ok((dims, values))
}

/// Reads `q`, `k`, `v` and, if present, `do` (or `dO`, `grad_out`) from a safetensors file.
pub fn read_inputs(path: &Path, causal: bool) -> Result<Inputs> {
    let bytes = std::fs::read(path).map_err(|e| Error::File {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format_err(path, format!("not a valid safetensors file ({e})")))?;
    let (qd, q) = read_tensor(path, &st, "q")?;
    let (kd, k) = read_tensor(path, &st, "k")?;
    let (vd, v) = read_tensor(path, &st, "v")?;
    let d_o = match DO_NAMES.iter().find(|n| st.names().iter().any(|m| m == *n)) {
        Some(n) => {
            let (dd, t) = read_tensor(path, &st, n)?;
            if dd != qd {
                return Err(format_err(path, format!("`{n}` has shape {dd:?} but `q` has {qd:?}")));
            }
            Some(t)
        }
        None => None,
    };
    if kd != vd {
        return Err(format_err(path, format!("`k` has shape {kd:?} but `v` has {vd:?}")));
    }
    if qd[0] != kd[0] || qd[3] != kd[3] {
        return Err(format_err(
            path,
            format!("`q` {qd:?} and `k` {kd:?} must agree in batch (dim 0) and head dim (dim 3)"),
        ));
    }
    let shape = Shape {
        batch: qd[0],
        heads_q: qd[1],
        heads_kv: kd[1],
        n_q: qd[2],
        n_k: kd[2],
        head_dim: qd[3],
    };
    let inp = Inputs {
        shape,
        causal,
        q,
        k,
        v,
        d_o,
    };
    inp.validate().map_err(|e| format_err(path, e.to_string()))?;
    Ok(inp)
}

/// Element type of a written tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    Bf16,
    F32,
}

/// A named tensor to write.
pub struct OutTensor<'a> {
    pub name: &'a str,
    pub dims: Vec<usize>,
    pub values: &'a [f32],
    pub dtype: OutDtype,
}

/// Writes tensors (with string metadata) to `path` atomically.
pub fn write_tensors(path: &Path, tensors: &[OutTensor], metadata: HashMap<String, String>) -> Result<()> {
    let file_err = |e: &dyn std::fmt::Display| Error::File {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let encoded: Vec<(Vec<u8>, Dtype)> = tensors
        .iter()
        .map(|t| match t.dtype {
            OutDtype::F32 => (t.values.iter().flat_map(|x| x.to_le_bytes()).collect(), Dtype::F32),
            OutDtype::Bf16 => (
                t.values
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
                Dtype::BF16,
            ),
        })
        .collect();
    let views = tensors
        .iter()
        .zip(&encoded)
        .map(|(t, (bytes, dtype))| {
            TensorView::new(*dtype, t.dims.clone(), bytes)
                .map(|v| (t.name.to_string(), v))
                .map_err(|e| file_err(&e))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| file_err(&e))?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| file_err(&e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        file_err(&e)
    })
}

/// Writes the inputs of a problem (for examples and tests), Q/K/V/dO in BF16.
pub fn write_inputs(path: &Path, inp: &Inputs) -> Result<()> {
    let s = inp.shape;
    let qd = vec![s.batch, s.heads_q, s.n_q, s.head_dim];
    let kd = vec![s.batch, s.heads_kv, s.n_k, s.head_dim];
    let mut t = vec![
        OutTensor {
            name: "q",
            dims: qd.clone(),
            values: &inp.q,
            dtype: OutDtype::Bf16,
        },
        OutTensor {
            name: "k",
            dims: kd.clone(),
            values: &inp.k,
            dtype: OutDtype::Bf16,
        },
        OutTensor {
            name: "v",
            dims: kd,
            values: &inp.v,
            dtype: OutDtype::Bf16,
        },
    ];
    if let Some(d_o) = &inp.d_o {
        t.push(OutTensor {
            name: "do",
            dims: qd,
            values: d_o,
            dtype: OutDtype::Bf16,
        });
    }
    write_tensors(path, &t, HashMap::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::random;

    #[test]
    fn inputs_round_trip_and_errors_are_descriptive() {
        let dir = std::env::temp_dir().join(format!("sagebwd-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Shape {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            n_q: 5,
            n_k: 7,
            head_dim: 8,
        };
        let inp = random(s, true, 1.0, 3, true);
        let p = dir.join("in.safetensors");
        write_inputs(&p, &inp).unwrap();
        let back = read_inputs(&p, true).unwrap();
        assert_eq!(back.shape, s);
        assert_eq!(back.q, inp.q);
        assert_eq!(back.d_o, inp.d_o);

        let missing = read_inputs(&dir.join("nope.safetensors"), false)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("nope.safetensors"), "{missing}");
        std::fs::write(dir.join("bad.safetensors"), b"hello").unwrap();
        let bad = read_inputs(&dir.join("bad.safetensors"), false)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("not a valid safetensors"), "{bad}");

        let qd = vec![1, 1, 4, 8];
        let only_q = [OutTensor {
            name: "q",
            dims: qd,
            values: &inp.q[..32],
            dtype: OutDtype::F32,
        }];
        write_tensors(&dir.join("q.safetensors"), &only_q, HashMap::new()).unwrap();
        let e = read_inputs(&dir.join("q.safetensors"), false).unwrap_err().to_string();
        assert!(
            e.contains("no tensor named `k`") && e.contains("the file has: q"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
