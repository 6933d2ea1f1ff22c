//! `train` with method flags and `--trace`, then `diagnose` on its checkpoint and `report` of the
//! trace: the tiny model on the built-in sample, a few steps on the CPU.

mod common;

use common::{sagebwd, stderr};

const TINY: [&str; 16] = [
    "--steps",
    "4",
    "--seq",
    "64",
    "--batch",
    "2",
    "--eval-every",
    "2",
    "--eval-tokens",
    "128",
    "--ckpt-every",
    "4",
    "--device",
    "cpu",
    "--threads",
    "2",
];

#[test]
fn train_with_flags_and_trace_then_diagnose_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut args = vec![
        "train",
        "--preset",
        "sagebwd",
        "--smooth-k",
        "off",
        "--trace",
        "--name",
        "t",
    ];
    args.extend(TINY);
    let o = sagebwd(&args, d);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = d.join("runs/t-sagebwd-smoothK");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["attention"], "sagebwd-smoothK");
    assert_eq!(cfg["method"]["smooth_k"], false);
    assert_eq!(cfg["method"]["precision"][4], "Bf16"); // dp
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["method"], cfg["method"]);

    // One trace per evaluation (steps 2 and 4), every layer of the tiny model, cosines near but below 1.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let traces: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "trace")
        .collect();
    assert_eq!(
        traces.iter().map(|t| t["step"].as_u64().unwrap()).collect::<Vec<_>>(),
        [2, 4]
    );
    for t in &traces {
        assert_eq!(t["config"], "sagebwd-smoothK");
        let layers = t["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 4);
        for l in layers {
            let c = l["ds_cos"].as_f64().unwrap();
            assert!(c > 0.9 && c < 1.0, "{l}");
            assert!(l["q_gain_rms"].as_f64().unwrap() > 0.0);
        }
    }
    let o = sagebwd(&["report", run.to_str().unwrap(), "-o", "r.png"], d);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(d.join("r-trace.png").exists());

    let o = sagebwd(
        &[
            "diagnose",
            run.to_str().unwrap(),
            "--tokens",
            "64",
            "--json",
            "--plot",
            "diag.png",
            "--export",
            "1",
            "-o",
            "l1.safetensors",
        ],
        d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rep["step"], 4);
    assert_eq!(rep["config"], "sagebwd");
    let layers = rep["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    let metric = |l: &serde_json::Value, config: &str, tensor: &str, m: &str| -> f64 {
        let c = l["comparisons"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["config"] == config && c["tensor"] == tensor);
        c.unwrap_or_else(|| panic!("{config} {tensor} missing"))[m]
            .as_f64()
            .unwrap()
    };
    for l in layers {
        assert_eq!(
            l["comparisons"].as_array().unwrap().len(),
            8 * 8,
            "the configuration and 7 isolated products, 8 tensors each"
        );
        // sagebwd keeps dP = dO Vᵀ in BF16: its dP error is far below that of INT8 dP alone.
        assert!(
            metric(l, "sagebwd", "dP", "rel_l2") * 3.0 < metric(l, "int8[dp]+smoothK", "dP", "rel_l2"),
            "{l}"
        );
        // dQ quantized alone leaves dK at the BF16 level, and the other way round.
        assert!(metric(l, "int8[dq]+smoothK", "dQ", "rel_l2") > metric(l, "int8[dq]+smoothK", "dK", "rel_l2"));
        for t in ["D", "P", "dS", "O", "dQ", "dK", "dV"] {
            let c = metric(l, "sagebwd", t, "cos");
            assert!(c > 0.9 && c < 1.0, "{t}: {c}");
        }
        assert!(l["rms_ds"].as_f64().unwrap() < l["rms_dp"].as_f64().unwrap());
        assert!(l["sigma_q"].as_f64().unwrap() > 0.0);
    }
    assert!(d.join("diag.png").exists());

    // The exported layer is a problem for `attn`; its dQ error there is the one diagnose reported.
    let bytes = std::fs::read(d.join("l1.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("q").unwrap().shape(), [1, 1, 64, 64]);
    assert_eq!(st.tensor("do").unwrap().shape(), [1, 1, 64, 64]);
    let o = sagebwd(
        &[
            "attn",
            "l1.safetensors",
            "-o",
            "out.safetensors",
            "--causal",
            "--check",
            "--device",
            "cpu",
        ],
        d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    let want = format!("rel L2 {:.3e}", metric(&layers[1], "sagebwd", "dQ", "rel_l2"));
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("dq:") && l.contains(&want)),
        "{want} not in\n{text}"
    );

    // Bad input: clear one-line errors.
    let o = sagebwd(
        &[
            "diagnose",
            run.to_str().unwrap(),
            "--export",
            "9",
            "-o",
            "x.safetensors",
        ],
        d,
    );
    assert!(
        !o.status.success() && stderr(&o).contains("the model has 4 layers"),
        "{}",
        stderr(&o)
    );
    let o = sagebwd(&["diagnose", "nowhere"], d);
    assert!(
        !o.status.success() && stderr(&o).contains("no such checkpoint"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn method_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let o = sagebwd(&["train", "--preset", "exact", "--smooth-q", "--steps", "1"], d);
    assert!(
        !o.status.success() && stderr(&o).contains("do not apply"),
        "{}",
        stderr(&o)
    );
    let o = sagebwd(
        &[
            "train", "--preset", "sagebwd", "--int8", "dq", "--bf16", "dq", "--steps", "1",
        ],
        d,
    );
    assert!(
        !o.status.success() && stderr(&o).contains("both --int8 and --bf16"),
        "{}",
        stderr(&o)
    );
    let o = sagebwd(&["train", "--preset", "fpa", "--int8", "dx", "--steps", "1"], d);
    assert!(
        !o.status.success() && stderr(&o).contains("unknown product"),
        "{}",
        stderr(&o)
    );
}
