//! The command line as a user meets it: the main commands work, bad input gives one clear line and
//! a non-zero exit, never a panic.

use sagebwd::inputs::random;
use sagebwd::io::write_inputs;
use sagebwd::Shape;
use std::path::Path;
use std::process::{Command, Output};

fn sagebwd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sagebwd"))
        .args(args)
        .output()
        .expect("binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failure is one `error: ...` line (no panic, no backtrace) and exit code 1.
fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.contains("error: ") && err.contains(needle),
        "expected `{needle}` in: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{err}");
}

#[test]
fn accuracy_prints_both_tables_and_json() {
    let o = sagebwd(&[
        "accuracy", "-n", "100", "-d", "64", "--heads", "2", "--sigma", "1,5", "--device", "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("cosine similarity") && out.contains("relative L2 error"));
    let rows = out
        .lines()
        .filter(|l| l.starts_with("sagebwd ") && !l.starts_with("sagebwd accuracy"));
    assert_eq!(rows.count(), 4, "2 σ × 2 tables: {out}");

    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("iso.png");
    let o = sagebwd(&[
        "accuracy",
        "-n",
        "70",
        "-d",
        "32",
        "--heads",
        "2",
        "--heads-kv",
        "1",
        "--causal",
        "--sigma",
        "2",
        "--isolate",
        "--json",
        "--device",
        "cpu",
        "--plot",
        png.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&png).expect("--plot writes the file");
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "a real PNG, {} bytes",
        bytes.len()
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let recs = v.as_array().unwrap();
    assert_eq!(recs.len(), 7 * 8, "7 isolated products × 8 tensors");
    for r in recs {
        let cos = r["cos"].as_f64().unwrap();
        assert!(cos > 0.9 && cos <= 1.0 + 1e-9, "{r}");
    }
}

#[test]
fn attn_round_trips_a_safetensors_file_and_checks_against_exact() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    let output = dir.path().join("out.safetensors");
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 33,
        n_k: 40,
        head_dim: 64,
    };
    write_inputs(&input, &random(s, true, 1.0, 7, true)).unwrap();
    let o = sagebwd(&[
        "attn",
        input.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
        "--causal",
        "--check",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("dk: cos 0.99"), "{out}");
    let bytes = std::fs::read(&output).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("o").unwrap().shape(), &[1, 2, 33, 64]);
    assert_eq!(st.tensor("lse").unwrap().shape(), &[1, 2, 33]);
    assert_eq!(st.tensor("dk").unwrap().shape(), &[1, 1, 40, 64]);
    assert_eq!(st.tensor("dq").unwrap().dtype(), safetensors::Dtype::BF16);
}

#[test]
fn bad_input_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let out = p("out.safetensors");

    assert_clean_error(
        &sagebwd(&["attn", &p("missing.safetensors"), "-o", &out, "--device", "cpu"]),
        "missing.safetensors",
    );

    std::fs::write(p("junk.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}").unwrap();
    assert_clean_error(
        &sagebwd(&["attn", &p("junk.safetensors"), "-o", &out, "--device", "cpu"]),
        "not a valid safetensors",
    );

    let s = Shape::square(1, 1, 8, 16);
    let mut inp = random(s, false, 1.0, 1, false);
    inp.v[5] = f32::INFINITY;
    write_inputs(Path::new(&p("inf.safetensors")), &inp).unwrap();
    assert_clean_error(
        &sagebwd(&["attn", &p("inf.safetensors"), "-o", &out, "--device", "cpu"]),
        "non-finite value in input `v` at flat index 5",
    );

    let mut inp = random(
        Shape {
            heads_q: 3,
            heads_kv: 2,
            ..s
        },
        false,
        1.0,
        1,
        false,
    );
    inp.q.truncate(inp.shape.q_len());
    write_inputs(Path::new(&p("gqa.safetensors")), &inp).unwrap();
    assert_clean_error(
        &sagebwd(&["attn", &p("gqa.safetensors"), "-o", &out, "--device", "cpu"]),
        "multiple of key/value heads",
    );

    assert!(!Path::new(&out).exists(), "no output is written on failure");
    assert_clean_error(&sagebwd(&["accuracy", "-n", "0", "--device", "cpu"]), "n_q is 0");
    assert_clean_error(
        &sagebwd(&["accuracy", "-d", "300", "--device", "cpu"]),
        "unsupported head dimension 300",
    );
    assert_clean_error(
        &sagebwd(&["accuracy", "--int8", "dx", "--device", "cpu"]),
        "unknown product `dx`",
    );
    assert_clean_error(&sagebwd(&["accuracy", "--block-q", "0", "--device", "cpu"]), "block_q");
    assert_clean_error(&sagebwd(&["accuracy", "--sigma=1,0", "--device", "cpu"]), "--sigma");
}
