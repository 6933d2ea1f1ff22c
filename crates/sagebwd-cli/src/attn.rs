//! `sagebwd attn`: attention on the user's own tensors, read from and written to safetensors.

use crate::args::{describe, ConfigArgs, DeviceArg};
use crate::backend::Backend;
use anyhow::{bail, Result};
use clap::Args;
use sagebwd::io::{read_inputs, write_tensors, OutDtype, OutTensor};
use sagebwd::metrics::compare;
use sagebwd::reference::exact;
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct AttnArgs {
    /// Input safetensors file with tensors `q` [B,H,N,d], `k` and `v` [B,H_kv,N_k,d] (BF16, F16 or
    /// F32) and optionally `do` (the output gradient, shaped like `q`) to also get dQ, dK, dV.
    pub input: PathBuf,
    /// Output safetensors file: `o`, `lse` (natural log, F32) and, given `do`, `dq`, `dk`, `dv`.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Causal mask (aligned to the end when N != N_k).
    #[arg(long)]
    pub causal: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Compute exact attention in f64 instead of the quantized method (ignores the configuration).
    #[arg(long)]
    pub exact: bool,
    /// Also compute exact f64 attention and print the error of each output against it.
    #[arg(long, conflicts_with = "exact")]
    pub check: bool,
    /// Write O, dQ, dK, dV as F32 instead of BF16.
    #[arg(long)]
    pub f32: bool,
    /// Where to run the method.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
}

pub fn run(a: AttnArgs) -> Result<()> {
    if a.output.exists() && a.input.canonicalize().ok() == a.output.canonicalize().ok() {
        bail!(
            "--output {} is the input file; refusing to overwrite it",
            a.output.display()
        );
    }
    let cfg = a.config.config()?;
    let inp = read_inputs(&a.input, a.causal)?;
    let s = inp.shape;
    let mut meta = HashMap::from([("causal".to_string(), a.causal.to_string())]);
    // (name, dims, values) of every output, all as f32 on the host.
    let qd = vec![s.batch, s.heads_q, s.n_q, s.head_dim];
    let kd = vec![s.batch, s.heads_kv, s.n_k, s.head_dim];
    let ld = vec![s.batch, s.heads_q, s.n_q];
    let mut outs: Vec<(&str, Vec<usize>, Vec<f32>)> = Vec::new();
    let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    if a.exact {
        let ex = exact(&inp, false)?;
        meta.insert("method".into(), "exact f64 reference".into());
        outs.push(("o", qd.clone(), to32(&ex.o)));
        outs.push(("lse", ld, to32(&ex.lse)));
        if let Some(g) = &ex.grads {
            outs.extend([
                ("dq", qd, to32(&g.dq)),
                ("dk", kd.clone(), to32(&g.dk)),
                ("dv", kd, to32(&g.dv)),
            ]);
        }
    } else {
        let backend = Backend::select(a.device)?;
        let out = backend.run(&inp, &cfg, false)?;
        meta.insert("method".into(), describe(&cfg));
        meta.insert("device".into(), backend.name().into());
        if a.check {
            let ex = exact(&inp, false)?;
            println!("error against exact f64 attention ({}):", describe(&cfg));
            let mut pairs = vec![("o", &out.fwd.o, &ex.o), ("lse", &out.fwd.lse, &ex.lse)];
            if let (Some(g), Some(eg)) = (&out.grads, &ex.grads) {
                pairs.extend([("dq", &g.dq, &eg.dq), ("dk", &g.dk, &eg.dk), ("dv", &g.dv, &eg.dv)]);
            }
            for (name, x, r) in pairs {
                let m = compare(x, r);
                println!(
                    "  {name:>3}: cos {:.6}  rel L2 {:.3e}  rel L1 {:.3e}  RMSE {:.3e}",
                    m.cos, m.rel_l2, m.rel_l1, m.rmse
                );
            }
        }
        outs.push(("o", qd.clone(), out.fwd.o));
        outs.push(("lse", ld, out.fwd.lse));
        if let Some(g) = out.grads {
            outs.extend([("dq", qd, g.dq), ("dk", kd.clone(), g.dk), ("dv", kd, g.dv)]);
        }
    }
    let dtype = if a.f32 { OutDtype::F32 } else { OutDtype::Bf16 };
    let tensors: Vec<OutTensor> = outs
        .iter()
        .map(|(name, dims, values)| OutTensor {
            name,
            dims: dims.clone(),
            values,
            dtype: if *name == "lse" { OutDtype::F32 } else { dtype },
        })
        .collect();
    // Through a temporary file in the output's directory (refusing device nodes and directories; a
    // symlink is written through): see sagebwd_train::output.
    sagebwd_train::output::write_with(&a.output, |tmp| {
        write_tensors(tmp, &tensors, meta).map_err(|e| {
            // write_tensors stages its own `<path>.tmp.<pid>` next to `tmp`; a failed write may leave it.
            let _ = std::fs::remove_file(tmp.with_extension(format!("tmp.{}", std::process::id())));
            sagebwd_train::Error::Data(e.to_string())
        })
    })?;
    let names: Vec<&str> = outs.iter().map(|o| o.0).collect();
    eprintln!("wrote {} ({})", a.output.display(), names.join(", "));
    Ok(())
}
