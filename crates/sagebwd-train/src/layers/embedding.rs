//! Token embedding lookup and its scatter-add backward.

/// `[tokens, dim]` rows of `table` (`[vocab, dim]`).
pub fn forward(table: &[f32], dim: usize, tokens: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens.len() * dim);
    for &t in tokens {
        out.extend_from_slice(&table[t as usize * dim..(t as usize + 1) * dim]);
    }
    out
}

/// Adds `d_out` rows into the rows of `d_table` they were read from (in token order: reproducible).
pub fn backward(d_table: &mut [f32], dim: usize, tokens: &[u32], d_out: &[f32]) {
    for (&t, dr) in tokens.iter().zip(d_out.chunks(dim)) {
        let row = &mut d_table[t as usize * dim..(t as usize + 1) * dim];
        row.iter_mut().zip(dr).for_each(|(a, b)| *a += b);
    }
}
