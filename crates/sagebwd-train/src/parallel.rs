//! Data parallelism: one engine per GPU (a *replica*), all holding the same weights.
//!
//! [`DataParallel`] is itself an [`Engine`], so the training loop does not change: it hands over
//! micro-batches of `micro_batch × replicas` sequences, and each replica takes its contiguous share
//! of the sequences, in its own thread. Before the gradient norm (or the update, whichever comes
//! first) the replicas' gradients are summed into every replica ([`Replica::all_reduce`]: NCCL
//! on GPUs, host memory on the CPU), so every replica clips and applies the same update and the
//! weights stay identical without ever being sent. The gradient scale the loop passes is already
//! `1 / tokens per step` over all replicas, so the sum is the step's mean gradient.
//!
//! Tokens per step = micro-batch × sequence × accumulation × replicas ([`crate::train::TrainConfig`]).

use crate::engine::{Engine, EngineState};
use crate::error::{Error, Result};
use crate::model::{Batch, Weights};

/// An engine that can be one of several data-parallel replicas.
pub trait Replica: Engine + Send {
    /// What the replicas need to exchange gradients (NCCL communicators for GPUs).
    type Group;
    /// Prepares the exchange between `replicas` (all built for the same model).
    fn group(replicas: &[Self]) -> Result<Self::Group>
    where
        Self: Sized;
    /// Replaces every replica's gradients by the sum over all replicas.
    fn all_reduce(group: &Self::Group, replicas: &mut [Self]) -> Result<()>
    where
        Self: Sized;
}

pub struct DataParallel<E: Replica> {
    replicas: Vec<E>,
    group: E::Group,
    /// Gradients were accumulated since the last exchange.
    pending: bool,
}

impl<E: Replica> DataParallel<E> {
    /// Needs at least one replica; every replica must hold the same weights and optimizer state.
    pub fn new(replicas: Vec<E>) -> Result<DataParallel<E>> {
        if replicas.is_empty() {
            return Err(Error::Config("data parallelism needs at least one replica".into()));
        }
        let group = E::group(&replicas)?;
        Ok(DataParallel {
            replicas,
            group,
            pending: false,
        })
    }

    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Replica `i` (to check that the replicas stay identical).
    pub fn replica(&self, i: usize) -> &E {
        &self.replicas[i]
    }

    fn exchange(&mut self) -> Result<()> {
        if self.pending && self.replicas.len() > 1 {
            E::all_reduce(&self.group, &mut self.replicas)?;
        }
        self.pending = false;
        Ok(())
    }

    /// Runs `f` on every replica with a non-empty share of `b`'s sequences, each in its own thread;
    /// returns the token-weighted mean of the replicas' mean losses.
    fn each_share(&mut self, b: &Batch, f: impl Fn(&mut E, &Batch) -> Result<f64> + Sync) -> Result<f64> {
        let shares = shares(b.batch, self.replicas.len());
        let results: Vec<Result<(f64, usize)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .replicas
                .iter_mut()
                .zip(&shares)
                .filter(|(_, (_, n))| *n > 0)
                .map(|(engine, &(first, n))| {
                    let f = &f;
                    scope.spawn(move || {
                        let tokens = n * b.seq;
                        let (from, to) = (first * b.seq, first * b.seq + tokens);
                        let share = Batch {
                            inputs: &b.inputs[from..to],
                            targets: &b.targets[from..to],
                            batch: n,
                            seq: b.seq,
                        };
                        Ok((f(engine, &share)?, tokens))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
                .collect()
        });
        let (mut sum, mut tokens) = (0.0, 0usize);
        for r in results {
            let (loss, n) = r?;
            sum += loss * n as f64;
            tokens += n;
        }
        Ok(sum / tokens.max(1) as f64)
    }
}

/// `(first sequence, sequences)` of each of `replicas` shares of `n` sequences: contiguous, sizes
/// differing by at most one (a short validation batch may leave some replicas without work).
pub fn shares(n: usize, replicas: usize) -> Vec<(usize, usize)> {
    (0..replicas)
        .map(|r| (r * n / replicas, (r + 1) * n / replicas - r * n / replicas))
        .collect()
}

impl<E: Replica> Engine for DataParallel<E> {
    fn describe(&self) -> String {
        let n = self.replicas.len();
        if n == 1 {
            return self.replicas[0].describe();
        }
        format!("{n} × {}, data parallel", self.replicas[0].describe())
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.pending = false;
        self.replicas.iter_mut().try_for_each(|r| r.zero_grads())
    }

    fn forward_backward(&mut self, b: &Batch, grad_scale: f32) -> Result<f64> {
        self.pending = true;
        self.each_share(b, |e, share| e.forward_backward(share, grad_scale))
    }

    fn loss(&mut self, b: &Batch) -> Result<f64> {
        self.each_share(b, |e, share| e.loss(share))
    }

    fn grad_norm(&mut self) -> Result<f64> {
        self.exchange()?;
        self.replicas[0].grad_norm()
    }

    fn update(&mut self, lr: f32, grad_scale: f32) -> Result<()> {
        self.exchange()?;
        self.replicas.iter_mut().try_for_each(|r| r.update(lr, grad_scale))
    }

    fn gradients(&self) -> Result<Weights> {
        if self.pending && self.replicas.len() > 1 {
            return Err(Error::Config(
                "the replicas' gradients are not summed yet (call grad_norm first)".into(),
            ));
        }
        self.replicas[0].gradients()
    }

    fn export(&self) -> Result<EngineState> {
        self.replicas[0].export()
    }

    fn import(&mut self, s: EngineState) -> Result<()> {
        let last = self.replicas.len() - 1;
        for r in &mut self.replicas[..last] {
            r.import(EngineState {
                weights: s.weights.clone(),
                adam_m: s.adam_m.clone(),
                adam_v: s.adam_v.clone(),
                adam_t: s.adam_t,
            })?;
        }
        self.replicas[last].import(s)
    }

    fn peak_memory(&self) -> Option<u64> {
        self.replicas.iter().filter_map(|r| r.peak_memory()).max()
    }

    fn energy_millijoules(&self) -> Option<u64> {
        self.replicas.iter().map(|r| r.energy_millijoules()).sum()
    }
}

/// Sums gradients through host memory, in replica order (deterministic).
impl Replica for crate::engine::CpuEngine {
    type Group = ();

    fn group(_: &[Self]) -> Result<()> {
        Ok(())
    }

    fn all_reduce(_: &(), replicas: &mut [Self]) -> Result<()> {
        let (first, rest) = replicas.split_first_mut().expect("at least one replica");
        for other in rest.iter() {
            add_into(&mut first.grads, &other.grads);
        }
        for other in rest.iter_mut() {
            other.grads = first.grads.clone();
        }
        Ok(())
    }
}

fn add_into(sum: &mut Weights, x: &Weights) {
    for (s, t) in sum.tensors_mut().into_iter().zip(x.tensors()) {
        s.iter_mut().zip(t).for_each(|(a, b)| *a += b);
    }
}
