//! The training loop end to end on a small synthetic corpus: the loss falls when overfitting,
//! `--resume` reproduces an uninterrupted run exactly, a diverging run stops cleanly keeping its
//! last good checkpoint, and the loss plot is written.

use sagebwd_train::config::ModelConfig;
use sagebwd_train::metrics::{read_records, Record};
use sagebwd_train::optim::AdamWConfig;
use sagebwd_train::plot::{plot_losses, Curve};
use sagebwd_train::train::{steady_rate, train, Corpus, DeviceChoice, EnergyWindow, RunOptions, TrainConfig};
use std::path::Path;

const VOCAB: usize = 64;

fn config(attention: &str, steps: u64) -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab_size: VOCAB,
            dim: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 4,
            ffn_hidden: 64,
            max_seq_len: 64,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            qk_norm: true,
            tied_embeddings: true,
        },
        attention: attention.into(),
        method: None,
        trace: false,
        seq_len: 32,
        micro_batch: 4,
        grad_accum: 2,
        steps,
        lr: 1e-2,
        min_lr: 1e-3,
        warmup: 5,
        adamw: AdamWConfig::default(),
        grad_clip: 1.0,
        eval_every: 5,
        eval_tokens: 256,
        checkpoint_every: 1000,
        seed: 1,
        gpus: 1,
    }
}

/// A corpus with learnable structure: a repeated pseudo-random phrase of 40 tokens.
fn corpus() -> Corpus {
    let phrase: Vec<u16> = (0..40u32).map(|i| ((i * 37 + 11) % VOCAB as u32) as u16).collect();
    let stream: Vec<u16> = phrase.iter().cycle().take(40 * 30).copied().collect();
    Corpus {
        train: stream.clone(),
        val: stream[..400].to_vec(),
        token_bytes: vec![1; VOCAB],
        description: "synthetic".into(),
    }
}

fn opts(dir: &Path) -> RunOptions {
    RunOptions {
        dir: dir.to_path_buf(),
        resume: false,
        overwrite: false,
        force_resume: false,
        progress: false,
        stop_after: None,
        device: DeviceChoice::Cpu,
    }
}

fn train_losses(records: &[Record]) -> Vec<f64> {
    records
        .iter()
        .filter(|r| r.kind == "train")
        .map(|r| r.loss.unwrap())
        .collect()
}

#[test]
fn loss_falls_when_overfitting_a_repeated_phrase_with_fpa_and_sagebwd() {
    for attention in ["fpa", "sagebwd"] {
        let dir = tempfile::tempdir().unwrap();
        let summary = train(&config(attention, 40), &corpus(), &opts(dir.path())).unwrap();
        let losses = train_losses(&read_records(dir.path()).unwrap());
        assert_eq!(losses.len(), 40);
        let first = losses[0];
        assert!(
            (first - (VOCAB as f64).ln()).abs() < 0.3,
            "{attention}: initial loss {first} should be near ln {VOCAB}"
        );
        let last = summary.final_train_loss;
        assert!(last < 0.5 * first, "{attention}: loss {first} → {last} did not halve");
        // 40 steps: a steady-state rate exists, from the same steps as the whole-run rate.
        let steady = summary
            .steady_tokens_per_second
            .expect("40 steps give a steady-state rate");
        assert!(
            steady > 0.0 && steady.is_finite() && steady > 0.2 * summary.tokens_per_second,
            "{steady} vs {}",
            summary.tokens_per_second
        );
        let val = summary.final_val_loss.unwrap();
        // bits per byte with 1 byte per token is loss / ln 2
        assert!((summary.final_val_bpb.unwrap() - val / std::f64::consts::LN_2).abs() < 1e-9);
    }
}

#[test]
fn resume_reproduces_the_uninterrupted_run_exactly() {
    let cfg = TrainConfig {
        checkpoint_every: 4,
        ..config("sagebwd", 12)
    };
    let whole = tempfile::tempdir().unwrap();
    train(&cfg, &corpus(), &opts(whole.path())).unwrap();
    let parts = tempfile::tempdir().unwrap();
    // Interrupted after step 6: the checkpoint holds step 6 (written at the stop); the metrics
    // already hold steps 1..6, and resuming rewrites nothing before them.
    train(
        &cfg,
        &corpus(),
        &RunOptions {
            stop_after: Some(6),
            ..opts(parts.path())
        },
    )
    .unwrap();
    let resumed = train(
        &cfg,
        &corpus(),
        &RunOptions {
            resume: true,
            ..opts(parts.path())
        },
    )
    .unwrap();
    assert_eq!(resumed.steps, 12);
    let (a, b) = (read_records(whole.path()).unwrap(), read_records(parts.path()).unwrap());
    assert_eq!(
        train_losses(&a),
        train_losses(&b),
        "resumed losses differ from the uninterrupted run"
    );
    let vals = |r: &[Record]| r.iter().filter_map(|r| r.val_loss).collect::<Vec<_>>();
    assert_eq!(vals(&a), vals(&b));
    assert_eq!(a.last().unwrap().tokens_seen, b.last().unwrap().tokens_seen);
}

#[test]
fn resume_refuses_another_model() {
    let dir = tempfile::tempdir().unwrap();
    train(&config("fpa", 2), &corpus(), &opts(dir.path())).unwrap();
    let mut other = config("fpa", 4);
    other.model.dim = 16;
    let e = train(
        &other,
        &corpus(),
        &RunOptions {
            resume: true,
            ..opts(dir.path())
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("checkpoint"), "{e}");
}

#[test]
fn divergence_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    // A learning rate of 1e30 turns the weights into ±1e30 after the first update.
    let cfg = TrainConfig {
        lr: 1e30,
        min_lr: 1e30,
        warmup: 0,
        grad_clip: 0.0,
        checkpoint_every: 1,
        ..config("fpa", 5)
    };
    let e = train(&cfg, &corpus(), &opts(dir.path())).unwrap_err().to_string();
    assert!(
        e.contains("diverged at step 2") && e.contains("last good checkpoint"),
        "{e}"
    );
    let ckpt = dir.path().join("checkpoint.safetensors");
    let bytes = std::fs::read(&ckpt).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&header.metadata().as_ref().unwrap()["meta"]).unwrap();
    assert_eq!(meta["step"], 1, "the checkpoint must be the one before the divergence");
}

#[test]
fn empty_validation_split_and_too_little_data_are_handled() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = corpus();
    c.val.clear();
    let s = train(&config("exact", 2), &c, &opts(dir.path())).unwrap();
    assert!(s.final_val_loss.is_none());
    c.train.truncate(10);
    let e = train(
        &config("exact", 2),
        &c,
        &RunOptions {
            overwrite: true,
            ..opts(dir.path())
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("needs at least 33"), "{e}");
}

#[test]
fn loss_plot_is_written_as_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    train(&config("fpa", 6), &corpus(), &opts(dir.path())).unwrap();
    let curve = Curve {
        label: "fpa".into(),
        records: read_records(dir.path()).unwrap(),
    };
    for name in ["loss.png", "loss.svg"] {
        let path = dir.path().join(name);
        plot_losses(std::slice::from_ref(&curve), &path, "test").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 5_000, "{name}: only {} bytes", bytes.len());
    }
    let png = std::fs::read(dir.path().join("loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
}

/// Gradient accumulation: two micro-batches of 2 sequences read the same windows as one of 4 and must
/// give the same step (up to f32 summation order), so only tokens per step matters.
#[test]
fn accumulation_matches_a_larger_micro_batch() {
    let one = TrainConfig {
        micro_batch: 4,
        grad_accum: 1,
        ..config("exact", 4)
    };
    let two = TrainConfig {
        micro_batch: 2,
        grad_accum: 2,
        ..config("exact", 4)
    };
    assert_eq!(one.tokens_per_step(), two.tokens_per_step());
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train(&one, &corpus(), &opts(d1.path())).unwrap();
    train(&two, &corpus(), &opts(d2.path())).unwrap();
    let (a, b) = (
        train_losses(&read_records(d1.path()).unwrap()),
        train_losses(&read_records(d2.path()).unwrap()),
    );
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-4, "losses {a:?} vs {b:?}");
    }
    assert!(
        (a[3] - a[0]).abs() > 1e-2,
        "the steps must change the loss for the comparison to mean anything"
    );
}

#[test]
fn steady_rate_is_the_median_after_the_first_three_steps() {
    assert_eq!(steady_rate(&[1.0, 1.0, 1.0, 1.0], 100), None, "fewer than 5 steps");
    // Warm-up steps (5 s) are ignored; the median of [0.5, 0.1, 0.2] is 0.2 s.
    assert_eq!(steady_rate(&[5.0, 5.0, 5.0, 0.5, 0.1, 0.2], 100), Some(500.0));
    // Even count: the mean of the two middle values (0.2, 0.4).
    assert!((steady_rate(&[9.0, 9.0, 9.0, 0.1, 0.2, 0.4, 0.8], 30).unwrap() - 100.0).abs() < 1e-9);
}

#[test]
fn energy_window_is_its_two_end_reads_less_the_work_between_steps() {
    let mut w = EnergyWindow::default();
    w.step_done();
    w.pause(Some((1, 0.0)), Some((1, 0.0)));
    assert_eq!(w.per_token(100), None, "steps before the window opens do not count");
    // Opens at 10 J, t = 1 s; three steps of 1 s at 700 W; an evaluation (50 J, 0.2 s) after the second.
    w.open(Some((10_000, 1.0)));
    w.step_done();
    w.step_done();
    w.pause(Some((1_410_000, 3.0)), Some((1_460_000, 3.2)));
    w.step_done();
    // The evaluation after the last step ends the window.
    w.pause(Some((2_160_000, 4.2)), Some((2_250_000, 4.5)));
    let (per_token, watts) = w.per_token(100).unwrap();
    assert!(
        (per_token - 2100.0 / 300.0).abs() < 1e-9 && (watts - 700.0).abs() < 1e-6,
        "{per_token} {watts}"
    );
    let mut no_counter = EnergyWindow::default();
    no_counter.open(None);
    no_counter.step_done();
    no_counter.pause(Some((1, 1.0)), Some((1, 1.0)));
    assert_eq!(no_counter.per_token(100), None);
    let mut failed = w;
    failed.pause(None, Some((2_300_000, 4.6)));
    assert_eq!(failed.per_token(100), None, "a failed read inside the window");
    let mut short = EnergyWindow::default();
    short.open(Some((0, 0.0)));
    short.step_done();
    short.pause(Some((700, 1.0)), Some((700, 1.0)));
    assert_eq!(short.per_token(1), None, "one steady step is too few");
    short.step_done();
    short.pause(Some((1_050, 1.5)), Some((1_050, 1.5)));
    assert_eq!(short.per_token(1), None, "1.5 s of steps: too few counter updates");
    short.step_done();
    short.pause(Some((1_400, 2.0)), Some((1_400, 2.0)));
    let (per_token, watts) = short.per_token(1).unwrap();
    assert!(
        (per_token - 1.4 / 3.0).abs() < 1e-12 && (watts - 0.7).abs() < 1e-12,
        "{per_token} {watts}"
    );
}
