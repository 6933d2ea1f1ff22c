//! `SAGEBWD_PROFILE=1`: GPU time per phase of the training step.
//!
//! A pair of CUDA events is recorded on the stream around each phase and read back in batches, so
//! nothing synchronizes inside the step and it runs as it does in training. A phase's time is the
//! GPU's time between its two events: its kernels plus any idle gap where the host had not yet
//! launched the next one (the sum over phases against the measured step time shows such gaps).
//! The first optimizer step (module loading, cuBLASLt plans) and validation passes are left out.

use super::{cuda_err, Result};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Phases recorded before their events are read (and then reused).
const BATCH: usize = 512;

#[derive(Default)]
struct State {
    /// (phase, start, end), not read yet.
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    spare: Vec<CudaEvent>,
    ms: BTreeMap<&'static str, f64>,
    /// Optimizer steps finished; the first one is not counted.
    steps: u64,
    /// True during validation passes.
    paused: bool,
}

pub struct Profile {
    state: RefCell<State>,
}

impl Profile {
    /// `Some` when `SAGEBWD_PROFILE=1`.
    pub fn from_env() -> Option<Profile> {
        (std::env::var("SAGEBWD_PROFILE").as_deref() == Ok("1")).then(|| Profile {
            state: RefCell::default(),
        })
    }

    /// Runs `f`, which enqueues `phase`'s work on `stream`, between two events.
    pub fn time<T>(&self, stream: &Arc<CudaStream>, phase: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let counted = {
            let st = self.state.borrow();
            st.steps > 0 && !st.paused
        };
        if !counted {
            return f();
        }
        let start = self.recorded_event(stream)?;
        let r = f()?;
        let end = self.recorded_event(stream)?;
        let mut st = self.state.borrow_mut();
        st.pending.push((phase, start, end));
        if st.pending.len() >= BATCH {
            read_pending(&mut st)?;
        }
        Ok(r)
    }

    fn recorded_event(&self, stream: &Arc<CudaStream>) -> Result<CudaEvent> {
        let spare = self.state.borrow_mut().spare.pop();
        let event = match spare {
            Some(e) => e,
            None => stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("profile event", e))?,
        };
        event.record(stream).map_err(|e| cuda_err("profile event", e))?;
        Ok(event)
    }

    /// Called after each optimizer step.
    pub fn step_done(&self) {
        self.state.borrow_mut().steps += 1;
    }

    /// Validation passes are not counted.
    pub fn set_paused(&self, paused: bool) {
        self.state.borrow_mut().paused = paused;
    }

    /// Prints ms per step for each phase (stderr).
    pub fn print(&self, attention: &str) {
        let mut st = self.state.borrow_mut();
        if let Err(e) = read_pending(&mut st) {
            eprintln!("profile: {e}");
            return;
        }
        let steps = st.steps.saturating_sub(1);
        if steps == 0 {
            eprintln!(
                "profile ({attention}): fewer than 2 optimizer steps, nothing counted (the first step is left out)"
            );
            return;
        }
        let per_step = |ms: f64| ms / steps as f64;
        let total: f64 = st.ms.values().sum();
        let products: f64 = st
            .ms
            .iter()
            .filter(|(k, _)| k.starts_with("products"))
            .map(|(_, v)| v)
            .sum();
        eprintln!(
            "profile ({attention}, CUDA events, {steps} steps after the first, validation left out): {:.3} ms per step on the GPU",
            per_step(total)
        );
        let line = |name: &str, ms: f64| {
            eprintln!(
                "  {name:<32} {:8.3} ms  {:5.1} %",
                per_step(ms),
                100.0 * ms / total.max(1e-12)
            )
        };
        for (phase, &ms) in st.ms.iter() {
            line(phase, ms);
        }
        line("products (all)", products);
    }
}

fn read_pending(st: &mut State) -> Result<()> {
    let pending = std::mem::take(&mut st.pending);
    for (phase, start, end) in pending {
        let ms = start.elapsed_ms(&end).map_err(|e| cuda_err("profile event time", e))?;
        *st.ms.entry(phase).or_default() += ms as f64;
        st.spare.extend([start, end]);
    }
    Ok(())
}
