//! Checkpoints: one safetensors file holding the weights (`model.<name>`), the AdamW moments
//! (`adam_m.<name>`, `adam_v.<name>`), and in its metadata the run configuration, the step, the
//! data loader's position and the RNG state. Written to a temporary file and renamed into place, so a
//! crash never leaves a half-written checkpoint behind.
//!
//! Integrity: the metadata holds a CRC32 of every tensor's bytes (`crc32`, by tensor name) and of the
//! `meta` JSON text (`meta_crc32`); [`load`] verifies both and names the damaged tensor. A checkpoint
//! without checksums (written before they existed) is refused with a message saying so.

use crate::error::{io_err, Error, Result};
use crate::model::Weights;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;

pub const FILE_NAME: &str = "checkpoint.safetensors";
const FORMAT: &str = "sagebwd-train checkpoint v1";

/// Writes `bytes` to `path` safely: see [`crate::output`].
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::output::write_file(path, bytes)
}

fn crc_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// What a checkpoint holds besides tensors: free-form JSON metadata (config, step, loader, RNG).
pub struct Checkpoint {
    pub weights: Weights,
    pub adam_m: Weights,
    pub adam_v: Weights,
    pub meta: serde_json::Value,
}

fn f32_bytes(t: &[f32]) -> Vec<u8> {
    t.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn save(
    path: &Path,
    weights: &Weights,
    adam_m: &Weights,
    adam_v: &Weights,
    meta: &serde_json::Value,
) -> Result<()> {
    let mut owned: Vec<(String, Vec<u8>, usize)> = Vec::new();
    for (prefix, w) in [("model", weights), ("adam_m", adam_m), ("adam_v", adam_v)] {
        for (name, t) in w.named() {
            owned.push((format!("{prefix}.{name}"), f32_bytes(t), t.len()));
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(name, bytes, n)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, vec![*n], bytes).expect("sizes agree"),
            )
        })
        .collect();
    let crcs: serde_json::Map<String, serde_json::Value> = owned
        .iter()
        .map(|(name, bytes, _)| (name.clone(), crc_hex(bytes).into()))
        .collect();
    let meta_text = meta.to_string();
    let mut info = HashMap::new();
    info.insert("format".to_string(), FORMAT.to_string());
    info.insert("meta_crc32".to_string(), crc_hex(meta_text.as_bytes()));
    info.insert("meta".to_string(), meta_text);
    info.insert("crc32".to_string(), serde_json::Value::Object(crcs).to_string());
    let bytes = safetensors::serialize(views, Some(info)).map_err(|e| Error::Checkpoint {
        path: path.into(),
        msg: e.to_string(),
    })?;
    crate::output::write_with(path, |tmp| {
        std::fs::write(tmp, &bytes).map_err(io_err(tmp))?;
        crate::output::fault_point("checkpoint");
        Ok(())
    })
}

/// Loads a checkpoint into tensors shaped like `like` (the model the run's config builds).
pub fn load(path: &Path, like: &Weights) -> Result<Checkpoint> {
    let err = |msg: String| Error::Checkpoint { path: path.into(), msg };
    if !path.exists() {
        return Err(err(
            "no such file (was the run started, and did it reach its first checkpoint?)".into(),
        ));
    }
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| err(e.to_string()))?;
    let info = header.metadata().clone().unwrap_or_default();
    if info.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(err("not a sagebwd-train checkpoint".into()));
    }
    let (Some(meta_text), Some(meta_crc), Some(crcs)) = (info.get("meta"), info.get("meta_crc32"), info.get("crc32"))
    else {
        return Err(err(
            "has no checksums (written by an older version?): it cannot be verified; start the run again".into(),
        ));
    };
    if &crc_hex(meta_text.as_bytes()) != meta_crc {
        return Err(err(
            "the metadata (run configuration, step, data position) is damaged: its CRC32 does not match".into(),
        ));
    }
    let meta: serde_json::Value = serde_json::from_str(meta_text).map_err(|e| err(e.to_string()))?;
    let crcs: HashMap<String, String> =
        serde_json::from_str(crcs).map_err(|e| err(format!("bad checksum table: {e}")))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
    let read = |prefix: &str| -> Result<Weights> {
        let mut w = like.clone();
        let names: Vec<String> = w.named().into_iter().map(|(n, _)| n).collect();
        for name in names {
            let full = format!("{prefix}.{name}");
            let view = st.tensor(&full).map_err(|_| {
                err(format!(
                    "tensor `{full}` is missing: the checkpoint is of another model"
                ))
            })?;
            let dst = w.get_mut(&name).expect("named tensors exist");
            if view.dtype() != Dtype::F32 || view.data().len() != dst.len() * 4 {
                return Err(err(format!("tensor `{full}` has another size than the model's")));
            }
            match crcs.get(&full) {
                Some(c) if *c == crc_hex(view.data()) => {}
                Some(_) => {
                    return Err(err(format!(
                        "tensor `{full}` is damaged: its data does not match its CRC32"
                    )))
                }
                None => return Err(err(format!("tensor `{full}` has no checksum"))),
            }
            dst.iter_mut()
                .zip(view.data().chunks_exact(4))
                .for_each(|(d, b)| *d = f32::from_le_bytes(b.try_into().unwrap()));
            if let Some(i) = dst.iter().position(|x| !x.is_finite()) {
                return Err(err(format!(
                    "tensor `{full}` holds a non-finite value ({}) at index {i}",
                    dst[i]
                )));
            }
        }
        Ok(w)
    };
    Ok(Checkpoint {
        weights: read("model")?,
        adam_m: read("adam_m")?,
        adam_v: read("adam_v")?,
        meta,
    })
}
