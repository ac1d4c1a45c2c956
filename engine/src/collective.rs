//! The all-reduce primitive on host slices: the fixed-order sum every backend's all-reduce must
//! match (rank 0 + rank 1 + ...), deterministic for any thread count.

/// Sum all-reduce in a fixed order: rank 0 + rank 1 + ....
pub fn all_reduce(partials: &[&[f32]]) -> Vec<f32> {
    let mut sum = partials[0].to_vec();
    for p in &partials[1..] {
        for (s, &v) in sum.iter_mut().zip(p.iter()) {
            *s += v;
        }
    }
    sum
}
