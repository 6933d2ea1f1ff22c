//! `sagebwd tokenize`, `train` and `report` end to end on a small corpus, and their one-line errors.

mod common;

use common::{sagebwd, stderr, write_corpus, SMALL_MODEL as SMALL};

#[test]
fn tokenize_train_on_shards_and_report() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_corpus(d, 30);
    let o = sagebwd(&["tokenize", "corpus.txt", "-o", "shards", "--val-every", "5"], d);
    assert!(o.status.success(), "{}", stderr(&o));
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("shards/info.json")).unwrap()).unwrap();
    assert_eq!(info["val"]["documents"], 6); // documents 1, 6, 11, 16, 21, 26
    assert_eq!(info["train"]["documents"], 24);
    let shard = std::fs::read(d.join("shards/train_000000.bin")).unwrap();
    assert_eq!(i32::from_le_bytes(shard[0..4].try_into().unwrap()), 20240520);
    assert_eq!(
        shard.len(),
        1024 + 2 * info["train"]["tokens"].as_u64().unwrap() as usize
    );

    // an already-split validation file goes entirely into val shards
    let o = sagebwd(&["tokenize", "corpus.txt", "-o", "valshards", "--split", "val"], d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(d.join("valshards/val_000000.bin").exists() && !d.join("valshards/train_000000.bin").exists());

    let mut args = vec![
        "train",
        "shards",
        "--preset",
        "exact,sagebwd",
        "--steps",
        "3",
        "--name",
        "t",
    ];
    args.extend(SMALL);
    let o = sagebwd(&args, d);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("training on the CPU") && err.contains("tokens per step: 32"),
        "{err}"
    );
    for run in ["runs/t-exact", "runs/t-sagebwd"] {
        let metrics = std::fs::read_to_string(d.join(run).join("metrics.jsonl")).unwrap();
        assert_eq!(
            metrics.lines().filter(|l| l.contains("\"train\"")).count(),
            3,
            "{metrics}"
        );
        assert!(metrics.contains("val_bpb"));
        assert!(d.join(run).join("checkpoint.safetensors").exists());
    }
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("runs/t-compare.png"), "{stdout}");
    assert!(d.join("runs/t-compare.png").exists());

    let o = sagebwd(&["report", "runs/t-exact", "runs/t-sagebwd", "-o", "r.svg"], d);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("t-exact") && table.contains("t-sagebwd") && table.contains("val loss"),
        "{table}"
    );
    // Throughput from each run's summary.json; no energy counter on the CPU, so no tokens/J.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("runs/t-sagebwd/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 3);
    assert!(summary["steady_joules_per_token"].is_null(), "{summary}");
    let row = table.lines().find(|l| l.starts_with("t-sagebwd")).unwrap();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells.len(), 10, "{row}");
    assert!(cells[8].parse::<f64>().unwrap() > 0.0 && cells[9] == "-", "{row}");
    assert!(std::fs::read_to_string(d.join("r.svg")).unwrap().contains("<svg"));

    // --resume continues to the new step count from the checkpoint
    let mut args = vec![
        "train", "shards", "--preset", "exact", "--steps", "5", "--name", "t", "--resume",
    ];
    args.extend(SMALL);
    let o = sagebwd(&args, d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step 3"), "{}", stderr(&o));
}

#[test]
fn bad_input_gives_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_corpus(d, 30);
    std::fs::write(d.join("empty.txt"), "").unwrap();
    let cases: [(&[&str], &str); 7] = [
        (&["train", "missing.txt"], "missing.txt: no such file"),
        (&["train", "empty.txt"], "the corpus is empty"),
        (
            &["train", "corpus.txt", "--dim", "16", "--heads", "3"],
            "not a multiple of heads",
        ),
        (&["train", "corpus.txt", "--model", "huge"], "unknown model size"),
        (&["train", "corpus.txt", "--preset", "int4"], "unknown attention preset"),
        (&["train", "corpus.txt", "--seq", "100000"], "needs at least 100001"),
        (&["report", "nowhere"], "not a run directory"),
    ];
    for (args, want) in cases {
        let o = sagebwd(args, d);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.lines().filter(|l| l.starts_with("error")).count(),
            1,
            "{args:?}: {err}"
        );
    }
    let o = sagebwd(&["tokenize", "missing.xz", "-o", "out"], d);
    assert!(stderr(&o).contains("missing.xz: no such file"), "{}", stderr(&o));
}
