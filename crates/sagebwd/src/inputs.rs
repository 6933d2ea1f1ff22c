//! Random test problems: Gaussian Q, K with standard deviation σ, V and dO with σ = 1, rounded to BF16.

use crate::tensor::{Inputs, Shape};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::StandardNormal;

fn gaussian(rng: &mut StdRng, n: usize, sigma: f32) -> Vec<f32> {
    (0..n).map(|_| sigma * rng.sample::<f32, _>(StandardNormal)).collect()
}

/// A reproducible random problem. `sigma_qk` is the standard deviation of Q and K.
pub fn random(shape: Shape, causal: bool, sigma_qk: f32, seed: u64, with_do: bool) -> Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut inp = Inputs {
        shape,
        causal,
        q: gaussian(&mut rng, shape.q_len(), sigma_qk),
        k: gaussian(&mut rng, shape.kv_len(), sigma_qk),
        v: gaussian(&mut rng, shape.kv_len(), 1.0),
        d_o: with_do.then(|| gaussian(&mut rng, shape.q_len(), 1.0)),
    };
    inp.round_to_bf16();
    inp
}

/// Adds to K a per-(batch, kv head, channel) offset drawn from N(0, std²), the same for every token:
/// the shared channel offset real keys carry, which K-smoothing exists to remove.
pub fn add_key_channel_offset(inp: &mut Inputs, std: f32, seed: u64) {
    let d = inp.shape.head_dim;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_0FF5E7);
    for head in inp.k.chunks_mut(inp.shape.n_k * d) {
        let offset = gaussian(&mut rng, d, std);
        for row in head.chunks_mut(d) {
            row.iter_mut().zip(&offset).for_each(|(x, o)| *x = crate::tensor::bf16(*x + o));
        }
    }
}
