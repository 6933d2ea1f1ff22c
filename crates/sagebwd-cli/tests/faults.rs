//! Fault injection: kills during checkpoint and metrics writes, concurrent and repeated runs, corrupt
//! checkpoints and shards, a full disk (a file-size limit in a child shell), hostile output paths, bad
//! options, signals. Each case asserts that nothing is lost and that every failure is named.
//!
//! Kills use the `SAGEBWD_FAULT` hook (see `sagebwd_train::output::fault_point`): the process sends
//! itself SIGKILL at the named point. Everything runs on the CPU with a tiny model in a few seconds.

mod common;

use common::{command as cmd, sagebwd as run, stderr, write_corpus, SMALL_MODEL};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `train corpus.txt --preset exact --name t` on the small model, plus `extra`.
fn train_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "train",
        "corpus.txt",
        "--preset",
        "exact",
        "--name",
        "t",
        "--device",
        "cpu",
    ];
    v.extend_from_slice(&SMALL_MODEL);
    v.extend_from_slice(&["--val-every", "5", "--warmup", "2"]);
    v.extend_from_slice(extra);
    v
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    write_corpus(dir.path(), 30);
    let p = dir.path().to_path_buf();
    (dir, p)
}

fn train_losses(run_dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

fn temps_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp."))
        .collect()
}

#[test]
fn a_used_run_directory_is_refused_and_overwrite_replaces_it() {
    let (_t, d) = setup();
    let o = run(&train_args(&["--steps", "2"]), &d);
    assert!(o.status.success(), "{}", stderr(&o));
    let run_dir = d.join("runs/t-exact");
    let before = std::fs::read(run_dir.join("metrics.jsonl")).unwrap();
    let o = run(&train_args(&["--steps", "3"]), &d);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("already holds a run") && e.contains("--overwrite") && e.contains("runs/t-exact"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(run_dir.join("metrics.jsonl")).unwrap(),
        before,
        "the earlier run's metrics changed"
    );
    let o = run(&train_args(&["--steps", "3", "--overwrite"]), &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_losses(&run_dir).len(), 3);
}

#[test]
fn a_second_process_is_refused_with_the_holder_named() {
    let (_t, d) = setup();
    let run_dir = d.join("runs/t-exact");
    let held = sagebwd_train::rundir::claim(&run_dir, sagebwd_train::rundir::Claim::New).unwrap();
    let o = run(&train_args(&["--steps", "2"]), &d);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(&format!("in use by pid {}", std::process::id())), "{e}");
    assert!(
        !run_dir.join("metrics.jsonl").exists(),
        "the refused run wrote into the directory"
    );
    drop(held);
    assert!(run(&train_args(&["--steps", "2"]), &d).status.success());
}

#[test]
fn processes_started_at_once_into_one_directory_leave_one_run() {
    let (_t, d) = setup();
    // Four trainings into the same run directory, spawned back to back (no lock held beforehand): the one
    // that claims it first runs; each other one either fails naming the holder or, if it starts after the
    // winner finished, is refused because the directory holds a run (no --resume / --overwrite).
    let children: Vec<_> = (0..4)
        .map(|_| {
            cmd(&train_args(&["--steps", "3"]), &d)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let won = outs.iter().filter(|o| o.status.success()).count();
    assert_eq!(won, 1, "exactly one run may own the directory");
    for o in outs.iter().filter(|o| !o.status.success()) {
        let e = stderr(o);
        assert!(e.contains("in use by pid") || e.contains("--overwrite"), "{e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    let run_dir = d.join("runs/t-exact");
    assert_eq!(train_losses(&run_dir).len(), 3, "the winner's metrics, whole and alone");
    assert!(temps_in(&run_dir).is_empty(), "{:?}", temps_in(&run_dir));
}

#[test]
fn kills_during_checkpoint_and_metrics_writes_lose_nothing() {
    let (_t, d) = setup();
    let whole = run(
        &train_args(&["--steps", "6", "--ckpt-every", "2", "--runs-dir", "whole"]),
        &d,
    );
    assert!(whole.status.success(), "{}", stderr(&whole));
    let expected = train_losses(&d.join("whole/t-exact"));

    // Killed just before the second checkpoint (step 4) is renamed into place: step 2's stays whole.
    let o = cmd(&train_args(&["--steps", "6", "--ckpt-every", "2"]), &d)
        .env("SAGEBWD_FAULT", "checkpoint")
        .env("SAGEBWD_FAULT_AFTER", "1")
        .output()
        .unwrap();
    assert!(!o.status.success(), "the fault hook did not fire");
    let run_dir = d.join("runs/t-exact");
    assert!(
        !temps_in(&run_dir).is_empty(),
        "the kill should have left the temporary checkpoint"
    );
    let metrics = std::fs::read(run_dir.join("metrics.jsonl")).unwrap();

    // Killed in the middle of the metrics rewrite of --resume: the old file is whole.
    let o = cmd(&train_args(&["--steps", "6", "--ckpt-every", "2", "--resume"]), &d)
        .env("SAGEBWD_FAULT", "metrics-rewrite")
        .output()
        .unwrap();
    assert!(!o.status.success(), "the fault hook did not fire");
    assert_eq!(
        std::fs::read(run_dir.join("metrics.jsonl")).unwrap(),
        metrics,
        "a kill during the rewrite changed metrics.jsonl"
    );

    let o = run(&train_args(&["--steps", "6", "--ckpt-every", "2", "--resume"]), &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step 2"), "{}", stderr(&o));
    assert_eq!(
        train_losses(&run_dir),
        expected,
        "the resumed run differs from the uninterrupted one"
    );
    assert!(
        temps_in(&run_dir).is_empty(),
        "stale temporary files: {:?}",
        temps_in(&run_dir)
    );
}

#[test]
fn damaged_checkpoints_and_metrics_are_named() {
    let (_t, d) = setup();
    assert!(run(&train_args(&["--steps", "2"]), &d).status.success());
    let run_dir = d.join("runs/t-exact");
    let ckpt = run_dir.join("checkpoint.safetensors");
    let good = std::fs::read(&ckpt).unwrap();
    // One flipped byte in the tensor data (the end of the file is the last tensor's data).
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 3] ^= 0x40;
    std::fs::write(&ckpt, &bad).unwrap();
    let o = run(&train_args(&["--steps", "4", "--resume"]), &d);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("checkpoint.safetensors") && e.contains("is damaged") && e.contains("tensor `"),
        "{e}"
    );
    // All-zero tensor data.
    let header = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut zero = good.clone();
    zero[header..].iter_mut().for_each(|b| *b = 0);
    std::fs::write(&ckpt, &zero).unwrap();
    let e = stderr(&run(&train_args(&["--steps", "4", "--resume"]), &d));
    assert!(e.contains("is damaged"), "{e}");
    // A damaged metrics line is reported with its number.
    std::fs::write(&ckpt, &good).unwrap();
    let mut m = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    m.push_str("{\"kind\":\"tr\n");
    std::fs::write(run_dir.join("metrics.jsonl"), &m).unwrap();
    let line = m.lines().count();
    let o = run(&["report", "runs/t-exact", "-o", "r.svg"], &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("1 damaged line(s) that are not metrics records (line {line})")),
        "{}",
        stderr(&o)
    );
    let o = run(&train_args(&["--steps", "4", "--resume"]), &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("(line {line})")), "{}", stderr(&o));
}

#[test]
fn resume_lists_changed_settings_and_refuses_meaningful_ones() {
    let (_t, d) = setup();
    assert!(run(&train_args(&["--steps", "2"]), &d).status.success());
    let o = run(
        &train_args(&["--steps", "4", "--resume", "--lr", "1e-3", "--seed", "7"]),
        &d,
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("config.lr") && e.contains("config.seed") && e.contains("--force-resume"),
        "{e}"
    );
    // Other data.
    write_corpus(&d, 31);
    let e = stderr(&run(&train_args(&["--steps", "4", "--resume"]), &d));
    assert!(e.contains("data.train_crc32") || e.contains("data.train_tokens"), "{e}");
    write_corpus(&d, 30);
    let o = run(
        &train_args(&["--steps", "4", "--resume", "--lr", "1e-3", "--force-resume"]),
        &d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("runs/t-exact/config.json")).unwrap()).unwrap();
    assert!(
        (cfg["lr"].as_f64().unwrap() - 1e-3).abs() < 1e-9,
        "config.json keeps the old settings: {cfg}"
    );
}

#[test]
fn multi_preset_resume_continues_each_preset_where_it_stands() {
    let (_t, d) = setup();
    assert!(run(&train_args(&["--steps", "2"]), &d).status.success());
    let mut args = train_args(&["--steps", "2", "--resume"]);
    args[3] = "exact,fpa";
    let o = run(&args, &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_losses(&d.join("runs/t-fpa")).len(), 2);
}

#[test]
fn options_are_checked_before_anything_runs() {
    let (_t, d) = setup();
    for (extra, want) in [
        (vec!["--preset", "fpa,bogus"], "bogus"),
        (vec!["--wd", "nan"], "weight decay"),
        (vec!["--clip=-1"], "gradient clip"),
        (vec!["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    ] {
        let mut args = train_args(&["--steps", "2"]);
        args.extend(extra);
        let o = run(&args, &d);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(!d.join("runs").exists(), "{args:?} started a run before failing");
    }
}

#[test]
fn tokenize_refuses_an_earlier_tokenization_and_train_checks_the_shards() {
    let (_t, d) = setup();
    write_corpus(&d, 300);
    let o = run(
        &["tokenize", "corpus.txt", "-o", "shards", "--shard-tokens", "2000"],
        &d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let shards = || {
        std::fs::read_dir(d.join("shards"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("train_"))
            .count()
    };
    let many = shards();
    assert!(many > 1);
    write_corpus(&d, 30);
    let o = run(&["tokenize", "corpus.txt", "-o", "shards"], &d);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    let o = run(&["tokenize", "corpus.txt", "-o", "shards", "--overwrite"], &d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(shards(), 1, "stale shards were left");
    let mut args = train_args(&["--steps", "1"]);
    args[1] = "shards";
    assert!(run(&args, &d).status.success());
    // A stale shard, then a damaged one.
    let shard = d.join("shards/train_000000.bin");
    std::fs::copy(&shard, d.join("shards/train_000007.bin")).unwrap();
    let e = stderr(&run(&[&args[..], &["--overwrite"]].concat(), &d));
    assert!(e.contains("train_000007.bin is not listed"), "{e}");
    std::fs::remove_file(d.join("shards/train_000007.bin")).unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let e = stderr(&run(&[&args[..], &["--overwrite"]].concat(), &d));
    assert!(e.contains("train_000000.bin does not match the CRC32"), "{e}");
}

#[test]
fn outputs_refuse_devices_write_through_links_and_survive_failures() {
    let (_t, d) = setup();
    assert!(run(&train_args(&["--steps", "2"]), &d).status.success());
    // A device node is refused and stays a device.
    let o = run(&["report", "runs/t-exact", "-o", "/dev/null"], &d);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a regular file"), "{}", stderr(&o));
    assert!(!std::fs::metadata("/dev/null").unwrap().file_type().is_file());
    // A symlink is written through and stays a link.
    std::fs::write(d.join("real.svg"), "old").unwrap();
    std::os::unix::fs::symlink("real.svg", d.join("link.svg")).unwrap();
    assert!(run(&["report", "runs/t-exact", "-o", "link.svg"], &d).status.success());
    assert!(std::fs::symlink_metadata(d.join("link.svg"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(d.join("real.svg")).unwrap().contains("<svg"));
    // A run without finite losses: the failed plot leaves the old chart alone.
    std::fs::create_dir_all(d.join("runs/empty")).unwrap();
    std::fs::write(
        d.join("runs/empty/metrics.jsonl"),
        "{\"kind\":\"train\",\"step\":1,\"tokens_seen\":32,\"time\":0.1}\n",
    )
    .unwrap();
    std::fs::write(d.join("keep.png"), "precious").unwrap();
    let o = run(&["report", "runs/empty", "-o", "keep.png"], &d);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no finite losses"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(d.join("keep.png")).unwrap(), "precious");
    // A full disk (a 64 KiB file-size limit, SIGXFSZ ignored so the write fails with EFBIG): the
    // checkpoint write fails with the path named, the earlier checkpoint survives, no temporary file.
    let run_dir = d.join("runs/t-exact");
    let ckpt = std::fs::read(run_dir.join("checkpoint.safetensors")).unwrap();
    let bin = env!("CARGO_BIN_EXE_sagebwd");
    let line = std::iter::once(bin)
        .chain(train_args(&["--steps", "4", "--resume"]))
        .map(|a| format!("'{a}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!("trap '' XFSZ; ulimit -f 64; exec {line}"))
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("error: ") && e.contains("runs/t-exact/"), "{e}");
    assert_eq!(
        std::fs::read(run_dir.join("checkpoint.safetensors")).unwrap(),
        ckpt,
        "the earlier checkpoint changed"
    );
    assert!(
        temps_in(&run_dir).is_empty(),
        "temporary files left: {:?}",
        temps_in(&run_dir)
    );
    let o = run(&train_args(&["--steps", "4", "--resume"]), &d);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn sigint_writes_a_final_checkpoint_and_exits_cleanly() {
    let (_t, d) = setup();
    let child = cmd(&train_args(&["--steps", "100000", "--ckpt-every", "100000"]), &d)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = d.join("runs/t-exact/metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 3 {
        assert!(start.elapsed().as_secs() < 120, "the run did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{e}");
    let step: u64 = e
        .split("after step ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    let next = (step + 1).to_string();
    let o = run(
        &train_args(&["--steps", &next, "--ckpt-every", "100000", "--resume"]),
        &d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("resuming at step {step}")),
        "{}",
        stderr(&o)
    );
}

#[test]
fn extreme_attention_inputs_are_named_never_nan_with_exit_0() {
    let (_t, d) = setup();
    let mut inp = sagebwd::inputs::random(sagebwd::Shape::square(1, 1, 64, 64), false, 1.0, 3, true);
    sagebwd::io::write_inputs(&d.join("ok.safetensors"), &inp).unwrap();
    inp.q[10] = 1e11;
    sagebwd::io::write_inputs(&d.join("big.safetensors"), &inp).unwrap();
    let o = run(
        &["attn", "big.safetensors", "-o", "out.safetensors", "--device", "cpu"],
        &d,
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("input `q`") && e.contains("2^16"), "{e}");
    assert!(!d.join("out.safetensors").exists());
    // A device node as the output is refused and stays a device.
    let o = run(&["attn", "ok.safetensors", "-o", "/dev/null", "--device", "cpu"], &d);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a regular file"), "{}", stderr(&o));
    assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
    // accuracy at σ = 1e6: the validation error, not NaN next to a "perfect" dQ.
    let o = run(
        &[
            "accuracy", "--sigma", "1e6", "-n", "64", "-d", "64", "--heads", "1", "--device", "cpu",
        ],
        &d,
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        !o.status.success() && stderr(&o).contains("input `q`"),
        "{out}\n{}",
        stderr(&o)
    );
    assert!(!out.to_lowercase().contains("nan"), "{out}");
}
