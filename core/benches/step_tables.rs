//! The host's share of a forward pass: the per-token tables a step computes before its first
//! op, for a Qwen3-VL-8B step of 41 images of 448x448 (8036 tokens, the 8192-token step's
//! images) and of 41 images of mixed sizes. Qwen3-VL's position embeddings (48x48 table,
//! width 1152) and the rotary tables (head dim 72) are computed once per distinct frame size
//! and `[row, col]` pair; what the device then gathers is not timed here.
//!
//! `cargo bench -p iris-core --bench step_tables -- --warm-up-time 1 --measurement-time 5`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use iris_core::encoder::layout::{
    Grid, distinct_frames, distinct_positions, interpolated_frame, rotary_positions, rotary_tables,
};

/// Every distinct frame's interpolated position embeddings: the values a step uploads.
fn pos_embed(table: &[f32], side: usize, dim: usize, grids: &[Grid]) -> usize {
    let frames = distinct_frames(grids);
    frames
        .keys
        .iter()
        .map(|&frame| interpolated_frame(table, side, dim, frame, 2).len())
        .sum()
}

/// The rotary tables of every distinct position pair.
fn rotary(grids: &[Grid], head_dim: usize) -> usize {
    let positions = rotary_positions(grids, 2);
    let pairs = distinct_positions(&positions);
    let (cos, sin) = rotary_tables(pairs.keys.as_flattened(), head_dim, 10_000.0);
    cos.len() + sin.len() + pairs.index.len()
}

fn step_tables(c: &mut Criterion) {
    let (side, dim) = (48usize, 1152usize);
    // Any finite values: the work does not depend on them.
    #[allow(clippy::cast_precision_loss)]
    let table: Vec<f32> = (0..side * side * dim)
        .map(|i| (i % 97) as f32 * 0.01)
        .collect();
    let mut group = c.benchmark_group("step_tables");
    group.sample_size(10);
    let same: Vec<Grid> = vec![[1, 28, 28]; 41];
    let mixed: Vec<Grid> = (0..41u32)
        .map(|i| [1, 20 + 2 * (i % 8), 36 - 2 * (i % 8)])
        .collect();
    for (name, grids) in [("41x448x448", &same), ("41 mixed sizes", &mixed)] {
        group.bench_function(format!("qwen3-vl-8b pos_embed/{name}"), |b| {
            b.iter(|| black_box(pos_embed(&table, side, dim, grids)));
        });
        group.bench_function(format!("qwen3-vl-8b rotary/{name}"), |b| {
            b.iter(|| black_box(rotary(grids, 72)));
        });
    }
    group.finish();
}

criterion_group!(benches, step_tables);
criterion_main!(benches);
