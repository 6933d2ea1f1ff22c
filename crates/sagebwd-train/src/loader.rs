//! Batches from a token stream: the stream is cut into windows of `seq + 1` tokens (input and the
//! next-token target, consecutive windows overlapping by one token); every epoch visits all windows in
//! a fresh shuffled order. The position (epoch, index) is the loader's whole state, so a checkpoint
//! can store it and a resumed run reads exactly the batches an uninterrupted one would.

use crate::error::{Error, Result};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    pub index: u64,
}

pub struct Loader {
    tokens: Vec<u16>,
    seq: usize,
    batch: usize,
    seed: u64,
    order: Vec<u32>,
    pub state: LoaderState,
}

/// Number of full windows of `seq + 1` tokens in `len` tokens.
pub fn window_count(len: usize, seq: usize) -> usize {
    len.saturating_sub(1) / seq
}

impl Loader {
    pub fn new(tokens: Vec<u16>, seq: usize, batch: usize, seed: u64) -> Result<Loader> {
        if window_count(tokens.len(), seq) == 0 {
            return Err(Error::Data(format!(
                "the training split has {} tokens; sequence length {seq} needs at least {}",
                tokens.len(),
                seq + 1
            )));
        }
        let mut l = Loader {
            tokens,
            seq,
            batch,
            seed,
            order: Vec::new(),
            state: LoaderState::default(),
        };
        l.shuffle_epoch();
        Ok(l)
    }

    /// Continues from a saved position.
    pub fn restore(&mut self, state: LoaderState) {
        self.state = state;
        self.shuffle_epoch();
    }

    fn shuffle_epoch(&mut self) {
        let n = window_count(self.tokens.len(), self.seq) as u32;
        self.order = (0..n).collect();
        Rng::new(self.seed ^ self.state.epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)).shuffle(&mut self.order);
    }

    /// The next micro-batch: `(inputs, targets)`, each `[batch, seq]`.
    pub fn next_batch(&mut self) -> (Vec<u32>, Vec<u32>) {
        let (mut inputs, mut targets) = (
            Vec::with_capacity(self.batch * self.seq),
            Vec::with_capacity(self.batch * self.seq),
        );
        for _ in 0..self.batch {
            if self.state.index as usize >= self.order.len() {
                self.state = LoaderState {
                    epoch: self.state.epoch + 1,
                    index: 0,
                };
                self.shuffle_epoch();
            }
            let start = self.order[self.state.index as usize] as usize * self.seq;
            let w = &self.tokens[start..start + self.seq + 1];
            inputs.extend(w[..self.seq].iter().map(|&t| t as u32));
            targets.extend(w[1..].iter().map(|&t| t as u32));
            self.state.index += 1;
        }
        (inputs, targets)
    }

    pub fn windows(&self) -> usize {
        self.order.len()
    }
}

/// The validation set: the first windows of the validation stream, in order, up to `max_tokens`
/// target tokens, grouped in batches of at most `batch` windows.
pub fn validation_batches(
    tokens: &[u16],
    seq: usize,
    batch: usize,
    max_tokens: usize,
) -> Vec<(Vec<u32>, Vec<u32>, usize)> {
    let windows = window_count(tokens.len(), seq).min(max_tokens.div_ceil(seq).max(1));
    let mut out = Vec::new();
    for first in (0..windows).step_by(batch.max(1)) {
        let n = batch.min(windows - first);
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for w in first..first + n {
            let win = &tokens[w * seq..w * seq + seq + 1];
            inputs.extend(win[..seq].iter().map(|&t| t as u32));
            targets.extend(win[1..].iter().map(|&t| t as u32));
        }
        out.push((inputs, targets, n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epoch_visits_every_window_once_and_restore_continues_exactly() {
        let tokens: Vec<u16> = (0..41).collect(); // 10 windows of 4 + 1
        let mut l = Loader::new(tokens.clone(), 4, 2, 9).unwrap();
        let mut starts: Vec<u32> = (0..5)
            .flat_map(|_| l.next_batch().0.chunks(4).map(|w| w[0]).collect::<Vec<_>>())
            .collect();
        starts.sort();
        assert_eq!(starts, (0..10).map(|w| w * 4).collect::<Vec<u32>>());
        let (i, t) = l.next_batch();
        assert_eq!(&i[1..4], &t[..3], "targets are inputs shifted by one");
        let saved = l.state;
        let want = l.next_batch();
        let mut resumed = Loader::new(tokens, 4, 2, 9).unwrap();
        resumed.restore(saved);
        assert_eq!(resumed.next_batch(), want);
    }

    #[test]
    fn too_short_a_stream_is_an_error() {
        let e = Loader::new(vec![1, 2, 3], 4, 1, 0).err().unwrap().to_string();
        assert!(e.contains("needs at least 5"), "{e}");
    }
}
