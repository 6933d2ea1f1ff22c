//! A run directory belongs to one run. [`claim`] takes an exclusive lock on `run.lock` in it (an OS file
//! lock, `flock` on Linux, through `std::fs::File::try_lock`: released by the kernel when the process
//! ends, however it ends, so a killed run never leaves a stale lock), writes the holder's pid and host
//! into it, and refuses a directory that already holds a run unless the run is resumed or
//! `--overwrite` was given.
//!
//! `--overwrite` clears the files a run writes ([`RUN_FILES`] and leftover temporary files) and
//! nothing else: the user asked for the run to be replaced, and an archive inside the directory would
//! double the disk taken by large checkpoints; files the user put there stay.

use crate::error::{io_err, Error, Result};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = "run.lock";

/// The files a training run writes into its directory.
pub const RUN_FILES: [&str; 5] = [
    "config.json",
    "metrics.jsonl",
    crate::checkpoint::FILE_NAME,
    crate::train::SUMMARY_FILE,
    "loss.png",
];

/// How a run enters its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// A new run: the directory must be new, empty or hold no run files.
    New,
    /// Continue the run in the directory.
    Resume,
    /// Replace the run in the directory (its run files are removed first).
    Overwrite,
}

/// Holds the directory's lock until dropped.
#[derive(Debug)]
pub struct RunDirLock {
    _file: std::fs::File,
    pub dir: PathBuf,
}

/// The run files present in `dir`.
pub fn run_files_in(dir: &Path) -> Vec<&'static str> {
    RUN_FILES.into_iter().filter(|f| dir.join(f).exists()).collect()
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown host".into())
}

/// Locks `dir` (created if needed) for this process and checks it fits `how`.
pub fn claim(dir: &Path, how: Claim) -> Result<RunDirLock> {
    let err = |msg: String| Error::RunDir { path: dir.into(), msg };
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let lock_path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(io_err(&lock_path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                "another process".to_string()
            } else {
                holder.to_string()
            };
            return Err(err(format!(
                "is in use by {holder} (lock {}); wait for it to finish or use another --name",
                lock_path.display()
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(err(format!("cannot lock {}: {e}", lock_path.display()))),
    }
    let me = format!("pid {} on {}", std::process::id(), host_name());
    file.set_len(0).map_err(io_err(&lock_path))?;
    file.rewind().map_err(io_err(&lock_path))?;
    file.write_all(me.as_bytes()).map_err(io_err(&lock_path))?;
    let present = run_files_in(dir);
    match how {
        Claim::New if !present.is_empty() => {
            return Err(err(format!(
            "already holds a run ({}); continue it with --resume, replace it with --overwrite, or use another --name",
            present.join(", ")
        )))
        }
        Claim::Overwrite => {
            for f in present {
                let p = dir.join(f);
                std::fs::remove_file(&p).map_err(io_err(&p))?;
            }
        }
        _ => {}
    }
    remove_stale_temps(dir)?;
    Ok(RunDirLock {
        _file: file,
        dir: dir.into(),
    })
}

/// Temporary files of earlier processes (`.NAME.tmp.<pid>.<n>`) left by a kill: the lock is held, so no
/// other process writes here, and any such file is a dead write.
fn remove_stale_temps(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp.") && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_locked_and_a_used_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let held = claim(dir.path(), Claim::New).unwrap();
        let e = claim(dir.path(), Claim::Resume).unwrap_err().to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(held);
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        let e = claim(dir.path(), Claim::New).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl") && e.contains("--overwrite"), "{e}");
        claim(dir.path(), Claim::Overwrite).unwrap();
        assert!(!dir.path().join("metrics.jsonl").exists());
        assert!(dir.path().join("notes.txt").exists());
    }
}
