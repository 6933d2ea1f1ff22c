//! Safe output writes, used by every file the project writes (metrics rewrites, config, summary,
//! checkpoints, shards, plots, `attn -o`, `report -o`).
//!
//! A file is written to a temporary file in the same directory (`.NAME.tmp.<pid>.<n>[.ext]`, unique
//! per process and write), flushed to disk (`fsync`), and renamed over the target; the directory is
//! then synced so the rename itself survives a crash. The target must be a regular file or a new
//! path: a directory, device node, FIFO or socket is refused (renaming over `/dev/full` would
//! replace the device with a file). A symlink is written through: the file it points to is
//! replaced and the link stays. On every error path the temporary file is removed, so a full disk
//! leaves nothing behind and the old file untouched.

use crate::error::{io_err, Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Where a write to `path` really lands: `path` itself, or for a symlink the file it points to.
/// Errors name the path and what is wrong with it.
pub fn resolve_target(path: &Path) -> Result<PathBuf> {
    let refuse = |what: &str| Error::Output {
        path: path.into(),
        msg: format!("{what}; refusing to replace it (give a regular file or a new path)"),
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(path.to_path_buf()),
        Err(e) => Err(io_err(path)(e)),
        Ok(m) if m.file_type().is_symlink() => {
            // Write through to the link's target (which may not exist yet: a dangling link is fine).
            let link = std::fs::read_link(path).map_err(io_err(path))?;
            let target = if link.is_absolute() {
                link
            } else {
                path.parent().unwrap_or(Path::new(".")).join(link)
            };
            if std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(refuse("is a symlink to another symlink"));
            }
            resolve_target(&target).map_err(|e| Error::Output {
                path: path.into(),
                msg: format!("symlink target: {e}"),
            })
        }
        Ok(m) if m.is_file() => Ok(path.to_path_buf()),
        Ok(m) if m.is_dir() => Err(refuse("is a directory")),
        Ok(_) => Err(refuse("is not a regular file (a device node, FIFO or socket)")),
    }
}

/// A unique temporary path next to `target`, keeping its extension (so writers that pick the format
/// by extension, like the PNG encoder, still see it).
fn temp_path(target: &Path) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = target
        .file_name()
        .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
    let ext = target
        .extension()
        .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
    target.with_file_name(format!(".{name}.tmp.{}.{n}{ext}", std::process::id()))
}

fn sync_dir(dir: &Path) {
    // Best effort: some file systems refuse to fsync a directory; the rename is still atomic.
    if let Ok(d) = std::fs::File::open(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) {
        let _ = d.sync_all();
    }
}

/// Lets `write` produce the file at a temporary path next to `path`, syncs it and renames it over
/// `path` (see the module docs). The temporary file is removed if anything fails.
pub fn write_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let target = resolve_target(path)?;
    let tmp = temp_path(&target);
    let result = (|| {
        write(&tmp)?;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        drop(f);
        // The target may have become a non-regular file meanwhile; check again right before the rename.
        resolve_target(path)?;
        std::fs::rename(&tmp, &target).map_err(io_err(&target))
    })();
    match result {
        Ok(()) => {
            sync_dir(target.parent().unwrap_or(Path::new(".")));
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Writes `bytes` to `path` safely (see the module docs).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |tmp| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(io_err(tmp))?;
        fault_point("write");
        f.write_all(bytes).map_err(io_err(tmp))
    })
}

/// Test hook for the fault-injection suite: with `SAGEBWD_FAULT=<point>` set, the process kills itself
/// (SIGKILL) when it reaches `<point>` (`write`: in the middle of a safe write, after the temporary file
/// is created; `checkpoint`: just before the checkpoint is renamed into place; `metrics-rewrite`: in
/// the middle of the metrics rewrite on `--resume`). `SAGEBWD_FAULT_AFTER=N` skips the first N visits.
/// Unset (always, outside tests), it does nothing.
pub fn fault_point(point: &str) {
    static VISITS: AtomicU64 = AtomicU64::new(0);
    let Ok(want) = std::env::var("SAGEBWD_FAULT") else {
        return;
    };
    if want != point {
        return;
    }
    let skip: u64 = std::env::var("SAGEBWD_FAULT_AFTER")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if VISITS.fetch_add(1, Ordering::SeqCst) >= skip {
        // SAFETY: raising a signal at the calling thread has no memory-safety preconditions.
        unsafe {
            libc::raise(libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_replace_regular_files_and_refuse_other_targets() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        write_file(&p, b"one").unwrap();
        write_file(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let e = write_file(dir.path(), b"x").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = write_file(Path::new("/dev/null"), b"x").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(Path::new("/dev/null").exists());
        // a symlink is written through and stays a symlink
        let link = dir.path().join("link.txt");
        std::os::unix::fs::symlink("a.txt", &link).unwrap();
        write_file(&link, b"three").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&p).unwrap(), b"three");
        // a failing writer leaves the old file and no temporary file
        let e = write_with(&p, |_| Err(Error::Data("boom".into())))
            .unwrap_err()
            .to_string();
        assert!(e.contains("boom"));
        assert_eq!(std::fs::read(&p).unwrap(), b"three");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".tmp.")), "{names:?}");
    }
}
