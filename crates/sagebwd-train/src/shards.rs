//! Token shards on disk, in llm.c's format (readable by llm.c and nanoGPT-style loaders).
//!
//! A shard is a 1024-byte header of 256 little-endian `i32`: `[0] = 20240520` (magic),
//! `[1] = 1` (version: tokens are `u16`), `[2]` = number of tokens, the rest 0; then the tokens as
//! little-endian `u16`. A `.bin` file without the magic is read as nanoGPT's headerless `u16` stream.
//!
//! `sagebwd tokenize` writes `val_000000.bin`, `train_000000.bin`, `train_000001.bin`, … into its
//! output directory (training shards hold at most `--shard-tokens` tokens) and `info.json` with the
//! document, token and byte counts of each split (`info-train.json` / `info-val.json` when one split
//! is written at a time with `--split`).

use crate::error::{io_err, Error, Result};
use std::path::{Path, PathBuf};

pub const MAGIC: i32 = 20240520;
pub const VERSION: i32 = 1;
const HEADER_INTS: usize = 256;

/// Writes `tokens` as one shard (through a temporary file renamed into place).
pub fn write_shard(path: &Path, tokens: &[u16]) -> Result<()> {
    let mut buf = Vec::with_capacity(HEADER_INTS * 4 + tokens.len() * 2);
    let mut header = [0i32; HEADER_INTS];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = i32::try_from(tokens.len()).map_err(|_| {
        Error::Data(format!(
            "{}: {} tokens do not fit one shard",
            path.display(),
            tokens.len()
        ))
    })?;
    header.iter().for_each(|h| buf.extend_from_slice(&h.to_le_bytes()));
    tokens.iter().for_each(|t| buf.extend_from_slice(&t.to_le_bytes()));
    crate::output::write_file(path, &buf)
}

/// Reads a shard (llm.c header, or headerless `u16`).
pub fn read_shard(path: &Path) -> Result<Vec<u16>> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    tokens_of(path, &bytes)
}

fn tokens_of(path: &Path, bytes: &[u8]) -> Result<Vec<u16>> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", path.display()));
    let has_header = bytes.len() >= HEADER_INTS * 4 && i32::from_le_bytes(bytes[0..4].try_into().unwrap()) == MAGIC;
    let body = if has_header {
        let version = i32::from_le_bytes(bytes[4..8].try_into().unwrap());
        let n = i32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        if version != VERSION {
            return Err(bad(format!("shard version {version}, expected {VERSION} (u16 tokens)")));
        }
        let body = &bytes[HEADER_INTS * 4..];
        if body.len() != 2 * n {
            return Err(bad(format!(
                "header says {n} tokens but the file holds {} bytes of tokens",
                body.len()
            )));
        }
        body
    } else if bytes.len().is_multiple_of(2) {
        bytes
    } else {
        return Err(bad("neither an llm.c shard nor a u16 token stream (odd size)".into()));
    };
    Ok(body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

/// The training and validation shards of a directory: `*train*.bin` and `*val*.bin`, sorted by name.
pub fn find_shards(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let entries = std::fs::read_dir(dir).map_err(io_err(dir))?;
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    names.sort();
    let has = |p: &PathBuf, s: &str| p.file_name().is_some_and(|n| n.to_string_lossy().contains(s));
    let train: Vec<PathBuf> = names.iter().filter(|p| has(p, "train")).cloned().collect();
    let val: Vec<PathBuf> = names.iter().filter(|p| has(p, "val")).cloned().collect();
    if train.is_empty() {
        return Err(Error::Data(format!(
            "{}: no *train*.bin shards (write some with `sagebwd tokenize`)",
            dir.display()
        )));
    }
    Ok((train, val))
}

/// The info files `sagebwd tokenize` writes into a shard directory.
pub const INFO_FILES: [&str; 3] = ["info.json", "info-train.json", "info-val.json"];

/// One shard as an info file lists it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ListedShard {
    pub file: String,
    pub tokens: usize,
    pub bytes: u64,
    pub crc32: String,
}

/// The entry of an info file's `shards` list for a shard just written.
pub fn listed(path: &Path, tokens: usize) -> Result<ListedShard> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(ListedShard {
        file,
        tokens,
        bytes: bytes.len() as u64,
        crc32: format!("{:08x}", crc32fast::hash(&bytes)),
    })
}

/// The training and validation tokens of a shard directory, checked against its info files: every
/// `*train*.bin` / `*val*.bin` must be listed in one, and every listed shard present with its size and
/// CRC32. A directory with no info file (nanoGPT-style shards) is read as it is. Info files without a
/// shard list (older tokenizations) are checked by their token counts.
pub fn read_shard_dir(dir: &Path) -> Result<(Vec<u16>, Vec<u16>)> {
    let (train, val) = find_shards(dir)?;
    let bad = |msg: String| Error::Data(format!("{}: {msg}", dir.display()));
    let mut listed: Vec<ListedShard> = Vec::new();
    let mut counts: Vec<(String, &'static str, usize)> = Vec::new();
    let mut any_info = false;
    for name in INFO_FILES {
        let path = dir.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        any_info = true;
        let info: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", path.display())))?;
        match info.get("shards") {
            Some(list) => listed.extend(
                serde_json::from_value::<Vec<ListedShard>>(list.clone())
                    .map_err(|e| Error::Data(format!("{}: bad shard list: {e}", path.display())))?,
            ),
            None => {
                for split in ["train", "val"] {
                    if let Some(n) = info[split]["tokens"].as_u64().filter(|&n| n > 0) {
                        counts.push((name.to_string(), split, n as usize));
                    }
                }
            }
        }
    }
    let read_all = |paths: &[PathBuf]| -> Result<Vec<u16>> {
        let mut out = Vec::new();
        for p in paths {
            let bytes = std::fs::read(p).map_err(io_err(p))?;
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if any_info && !listed.is_empty() {
                let Some(l) = listed.iter().find(|l| l.file == name) else {
                    return Err(bad(format!("shard {name} is not listed in the directory's info file: a stale shard of another tokenization? Tokenize again with --overwrite, or remove it")));
                };
                if l.bytes != bytes.len() as u64 {
                    return Err(bad(format!("shard {name} holds {} bytes, its info file lists {}: the shard is damaged or from another tokenization", bytes.len(), l.bytes)));
                }
                if l.crc32 != format!("{:08x}", crc32fast::hash(&bytes)) {
                    return Err(bad(format!("shard {name} does not match the CRC32 its info file lists: the shard is damaged or from another tokenization")));
                }
            }
            out.extend(tokens_of(p, &bytes)?);
        }
        Ok(out)
    };
    let (t, v) = (read_all(&train)?, read_all(&val)?);
    for l in &listed {
        if !dir.join(&l.file).exists() {
            return Err(bad(format!("shard {} listed in the info file is missing", l.file)));
        }
    }
    for (info, split, n) in counts {
        let got = if split == "train" { t.len() } else { v.len() };
        if got != n {
            return Err(bad(format!("{info} lists {n} {split} tokens but the {split} shards hold {got}: stale or missing shards? Tokenize again with --overwrite")));
        }
    }
    Ok((t, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_with_the_llm_c_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train_000000.bin");
        let tokens: Vec<u16> = vec![0, 1, 50256, 65535, 7];
        write_shard(&path, &tokens).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 1024 + 10);
        assert_eq!(i32::from_le_bytes(bytes[0..4].try_into().unwrap()), 20240520);
        assert_eq!(i32::from_le_bytes(bytes[8..12].try_into().unwrap()), 5);
        assert_eq!(read_shard(&path).unwrap(), tokens);
        // nanoGPT's headerless stream
        let raw = dir.path().join("val.bin");
        std::fs::write(&raw, [3u8, 0, 4, 1]).unwrap();
        assert_eq!(read_shard(&raw).unwrap(), vec![3, 260]);
        let (train, val) = find_shards(dir.path()).unwrap();
        assert_eq!((train.len(), val.len()), (1, 1));
        std::fs::write(&path, &bytes[..1030]).unwrap();
        assert!(read_shard(&path)
            .unwrap_err()
            .to_string()
            .contains("header says 5 tokens"));
    }
}
