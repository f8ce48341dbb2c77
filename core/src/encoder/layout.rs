//! Host-side index arithmetic of the Qwen-VL towers: rotary positions, attention segments,
//! Qwen2.5-VL's window reordering and Qwen3-VL's interpolated position embeddings.
//!
//! All of it depends only on the grids of a batch, so it is computed on the host once per call.
//! The per-token tables (position embeddings, rotary angles) are computed once per distinct
//! key ([`Distinct`]) and gathered into token order on the device.

use std::collections::HashMap;

/// A grid `(t, h, w)` in patches.
pub type Grid = [u32; 3];

/// `(row, col)` of every patch, in the processor's merge-window order, repeated per frame:
/// for each `merge x merge` block (row-major over blocks), its patches row-major.
/// Returned flat: `[row0, col0, row1, col1, ...]`.
pub fn rotary_positions(grids: &[Grid], merge: u32) -> Vec<u32> {
    let total: usize = grids.iter().map(|g| patches(*g)).sum();
    let mut out = Vec::with_capacity(2 * total);
    for &[t, h, w] in grids {
        for _ in 0..t {
            for block_row in 0..h / merge {
                for block_col in 0..w / merge {
                    for i in 0..merge {
                        for j in 0..merge {
                            out.push(block_row * merge + i);
                            out.push(block_col * merge + j);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The rotary `cos` and `sin` tables of tokens at `positions` (`[row, col]` pairs, as from
/// [`rotary_positions`]): `[tokens, head_dim]` f32 each, flat. With `q = head_dim / 4`
/// frequencies `f_i = 1 / theta^(2i / (head_dim / 2))`, channel `c < head_dim / 2` has the
/// angle `row · f_c` for `c < q` and `col · f_(c-q)` otherwise, and channel `c + head_dim / 2`
/// repeats it (transformers' `emb = cat(freqs, freqs)`). Everything is computed in f32, as
/// transformers' vision rotary does.
pub fn rotary_tables(positions: &[u32], head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let quarter = head_dim / 4;
    let half = head_dim / 2;
    let freqs: Vec<f32> = (0..quarter)
        .map(|i| {
            // Small integers: exact in f32. Matches `arange(0, dim, 2) / dim`.
            #[allow(clippy::cast_precision_loss)]
            let exponent = (2 * i) as f32 / half as f32;
            1.0 / theta.powf(exponent)
        })
        .collect();
    let tokens = positions.len() / 2;
    // An angle depends only on a position value and a frequency, and a step's positions are
    // small (rows and columns of its grids): each distinct (position, frequency) pair's cos
    // and sin are computed once, with the same f32 operations, and copied into every token.
    let max_position = positions.iter().copied().max().unwrap_or(0) as usize;
    let mut table_cos = vec![0f32; (max_position + 1) * quarter];
    let mut table_sin = vec![0f32; (max_position + 1) * quarter];
    for position in 0..=max_position {
        for (i, freq) in freqs.iter().enumerate() {
            // Positions are u32 values; their rounding to f32 is the rounding transformers
            // applies.
            #[allow(clippy::cast_precision_loss)]
            let angle = position as f32 * freq;
            table_cos[position * quarter + i] = angle.cos();
            table_sin[position * quarter + i] = angle.sin();
        }
    }
    let mut cos = Vec::with_capacity(tokens * head_dim);
    let mut sin = Vec::with_capacity(tokens * head_dim);
    for pair in positions.chunks_exact(2) {
        let (row, col) = (pair[0] as usize * quarter, pair[1] as usize * quarter);
        // Channels [0, quarter) take the row's angles, [quarter, half) the column's, and the
        // second half repeats the first.
        for _ in 0..2 {
            cos.extend_from_slice(&table_cos[row..row + quarter]);
            cos.extend_from_slice(&table_cos[col..col + quarter]);
            sin.extend_from_slice(&table_sin[row..row + quarter]);
            sin.extend_from_slice(&table_sin[col..col + quarter]);
        }
    }
    (cos, sin)
}

/// Full-attention segments: one per frame of each image (`h * w` patches each).
pub fn frame_cu_seqlens(grids: &[Grid]) -> Vec<u32> {
    let mut out = vec![0u32];
    let mut total = 0u32;
    for &[t, h, w] in grids {
        for _ in 0..t {
            total += h * w;
            out.push(total);
        }
    }
    out
}

/// Qwen2.5-VL window layout: the permutation of merge units that groups them into windows
/// (`window_index[i]` = original merge unit placed at position `i`) and the attention segments
/// of the windows in patch units. Windows are `units x units` merge units, with ragged windows
/// at the right and bottom edges; empty windows produce no segment.
pub fn window_layout(grids: &[Grid], merge: u32, units: u32) -> (Vec<u32>, Vec<u32>) {
    let merge_unit = merge * merge;
    let mut index = Vec::new();
    let mut cu = vec![0u32];
    let mut base = 0u32;
    for &[t, h, w] in grids {
        let (gh, gw) = (h / merge, w / merge);
        let windows_h = gh.div_ceil(units);
        let windows_w = gw.div_ceil(units);
        for frame in 0..t {
            for wy in 0..windows_h {
                for wx in 0..windows_w {
                    let mut count = 0;
                    for y in wy * units..((wy + 1) * units).min(gh) {
                        for x in wx * units..((wx + 1) * units).min(gw) {
                            index.push(base + frame * gh * gw + y * gw + x);
                            count += 1;
                        }
                    }
                    if count > 0 {
                        let last = *cu.last().unwrap_or(&0);
                        cu.push(last + count * merge_unit);
                    }
                }
            }
        }
        base += t * gh * gw;
    }
    (index, cu)
}

/// Expands a permutation of merge units to a permutation of patch rows.
pub fn expand_units(unit_index: &[u32], merge_unit: u32) -> Vec<u32> {
    unit_index
        .iter()
        .flat_map(|&unit| (0..merge_unit).map(move |k| unit * merge_unit + k))
        .collect()
}

/// The inverse of a permutation.
pub fn inverse_permutation(index: &[u32]) -> Vec<u32> {
    let mut inverse = vec![0u32; index.len()];
    for (position, &value) in index.iter().enumerate() {
        // Indices of permutations built here are < len <= u32::MAX.
        #[allow(clippy::cast_possible_truncation)]
        let position = position as u32;
        inverse[value as usize] = position;
    }
    inverse
}

/// Rows of a step-wide table that a few distinct keys determine: each distinct key once, in
/// order of first appearance, and for every token the row of the keys' table it takes. A
/// step's tokens share keys (images of one size share their position embeddings, tokens at
/// one `[row, col]` their rotary angles, frames of a video both), so the host computes and
/// uploads only the distinct rows and the device gathers each token's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Distinct<K> {
    /// The distinct keys, in order of first appearance.
    pub keys: Vec<K>,
    /// For each token, its row in the table of the keys' rows.
    pub index: Vec<u32>,
}

/// The distinct `[h, w]` frame sizes of `grids` (Qwen3-VL's position embeddings depend on
/// nothing else): a key stands for `h * w` rows in merge-window order, its frames' tokens take
/// them in that order.
pub fn distinct_frames(grids: &[Grid]) -> Distinct<[u32; 2]> {
    let mut keys = Vec::new();
    let mut base_of: HashMap<[u32; 2], u32> = HashMap::new();
    let mut rows = 0u32;
    let mut index = Vec::with_capacity(grids.iter().map(|g| patches(*g)).sum());
    for &[t, h, w] in grids {
        let base = *base_of.entry([h, w]).or_insert_with(|| {
            keys.push([h, w]);
            let base = rows;
            rows += h * w;
            base
        });
        for _ in 0..t {
            index.extend(base..base + h * w);
        }
    }
    Distinct { keys, index }
}

/// The distinct `[row, col]` pairs of `positions` (as from [`rotary_positions`]): a key is one
/// row of the rotary tables, each token takes its pair's.
pub fn distinct_positions(positions: &[u32]) -> Distinct<[u32; 2]> {
    let (mut max_row, mut max_col) = (0u32, 0u32);
    for pair in positions.chunks_exact(2) {
        max_row = max_row.max(pair[0]);
        max_col = max_col.max(pair[1]);
    }
    // Positions are rows and columns of a step's grids: a dense map of every pair up to the
    // largest is small (a 128x128 grid has 16384), and cheaper than hashing each token.
    let width = max_col as usize + 1;
    let mut row_of = vec![u32::MAX; (max_row as usize + 1) * width];
    let mut keys = Vec::new();
    let mut index = Vec::with_capacity(positions.len() / 2);
    for pair in positions.chunks_exact(2) {
        let slot = &mut row_of[pair[0] as usize * width + pair[1] as usize];
        if *slot == u32::MAX {
            // At most one key per token, and tokens are counted in u32 everywhere.
            #[allow(clippy::cast_possible_truncation)]
            let row = keys.len() as u32;
            *slot = row;
            keys.push([pair[0], pair[1]]);
        }
        index.push(*slot);
    }
    Distinct { keys, index }
}

/// Qwen3-VL's learned position embeddings of one `h x w` frame, bilinearly interpolated from a
/// `side x side` table (`table` is `side * side` rows of `dim` f32), in merge-window order:
/// `[h * w, dim]` flat. Follows transformers' `fast_pos_embed_interpolate`, including torch's
/// `linspace` arithmetic in f32 and its summation order.
pub fn interpolated_frame(
    table: &[f32],
    side: usize,
    dim: usize,
    [h, w]: [u32; 2],
    merge: u32,
) -> Vec<f32> {
    let corners_h: Vec<_> = linspace(side, h as usize)
        .into_iter()
        .map(|y| corners(y, side))
        .collect();
    let corners_w: Vec<_> = linspace(side, w as usize)
        .into_iter()
        .map(|x| corners(x, side))
        .collect();
    let mut out = vec![0f32; h as usize * w as usize * dim];
    let mut at = 0;
    for block_row in 0..h / merge {
        for block_col in 0..w / merge {
            for i in 0..merge {
                for j in 0..merge {
                    let (h0, h1, dh) = corners_h[(block_row * merge + i) as usize];
                    let (w0, w1, dw) = corners_w[(block_col * merge + j) as usize];
                    let [w00, w01, w10, w11] = [
                        (1.0 - dh) * (1.0 - dw),
                        (1.0 - dh) * dw,
                        dh * (1.0 - dw),
                        dh * dw,
                    ];
                    let row = |r: usize| &table[r * dim..][..dim];
                    let (t00, t01) = (row(h0 * side + w0), row(h0 * side + w1));
                    let (t10, t11) = (row(h1 * side + w0), row(h1 * side + w1));
                    let cell = &mut out[at..at + dim];
                    at += dim;
                    // Summation order of transformers: ((p0 + p1) + p2) + p3. Zipped slices
                    // leave the compiler no bounds checks, so the loop is vectorised.
                    for ((((value, &a), &b), &c), &d) in
                        cell.iter_mut().zip(t00).zip(t01).zip(t10).zip(t11)
                    {
                        *value = ((a * w00 + b * w01) + c * w10) + d * w11;
                    }
                }
            }
        }
    }
    out
}

/// Patches in a grid.
pub fn patches(grid: Grid) -> usize {
    grid.iter().map(|&v| v as usize).product()
}

/// torch.linspace(0, side - 1, steps) in f32: the first half counts up from the start, the
/// second half down from the end.
fn linspace(side: usize, steps: usize) -> Vec<f32> {
    // Grid sizes and table sides are far below 2^24, exact in f32.
    #[allow(clippy::cast_precision_loss)]
    let end = (side - 1) as f32;
    if steps == 1 {
        return vec![0.0];
    }
    #[allow(clippy::cast_precision_loss)]
    let step = end / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            #[allow(clippy::cast_precision_loss)]
            if i < halfway {
                i as f32 * step
            } else {
                end - (steps - 1 - i) as f32 * step
            }
        })
        .collect()
}

/// Floor and ceil indices (ceil clipped to the table) and the fractional part.
fn corners(position: f32, side: usize) -> (usize, usize, f32) {
    // Positions lie in [0, side - 1]: truncation is the floor, and fits usize.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let floor = position as usize;
    #[allow(clippy::cast_precision_loss)]
    let fraction = position - floor as f32;
    (floor, (floor + 1).min(side - 1), fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_positions_follow_merge_windows() {
        // A 1 x 2 x 4 grid with merge 2: two blocks, each 2x2, row-major inside.
        let positions = rotary_positions(&[[1, 2, 4]], 2);
        let pairs: Vec<(u32, u32)> = positions.chunks(2).map(|p| (p[0], p[1])).collect();
        assert_eq!(
            pairs,
            vec![
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn rotary_tables_repeat_the_half_and_split_row_and_column() {
        // Token at (row 2, col 3), head_dim 8: quarter 2, frequencies 1 and theta^-0.5.
        let (cos, sin) = rotary_tables(&[2, 3], 8, 100.0);
        assert_eq!(cos.len(), 8);
        let angles = [2.0f32, 2.0 * 0.1, 3.0, 3.0 * 0.1];
        for (c, angle) in angles.iter().enumerate() {
            assert!((cos[c] - angle.cos()).abs() < 1e-6, "cos {c}");
            assert!((sin[c] - angle.sin()).abs() < 1e-6, "sin {c}");
            assert_eq!(cos[c], cos[c + 4]);
            assert_eq!(sin[c], sin[c + 4]);
        }
    }

    #[test]
    fn rotary_tables_equal_each_angle_computed_in_place_bit_for_bit() {
        let positions: Vec<u32> = (0..300u32).flat_map(|i| [i % 37, (i * 7) % 53]).collect();
        let (head_dim, theta) = (80, 10_000.0f32);
        let (cos, sin) = rotary_tables(&positions, head_dim, theta);
        let (quarter, half) = (head_dim / 4, head_dim / 2);
        for (t, pair) in positions.chunks_exact(2).enumerate() {
            for c in 0..head_dim {
                let c_half = c % half;
                let (position, i) = if c_half < quarter {
                    (pair[0], c_half)
                } else {
                    (pair[1], c_half - quarter)
                };
                let freq = 1.0 / theta.powf((2 * i) as f32 / half as f32);
                let angle = position as f32 * freq;
                assert_eq!(
                    cos[t * head_dim + c].to_bits(),
                    angle.cos().to_bits(),
                    "{t} {c}"
                );
                assert_eq!(
                    sin[t * head_dim + c].to_bits(),
                    angle.sin().to_bits(),
                    "{t} {c}"
                );
            }
        }
    }

    /// Each token's row of the distinct table, gathered as the device does.
    fn gather(table: &[f32], width: usize, index: &[u32]) -> Vec<f32> {
        index
            .iter()
            .flat_map(|&row| &table[row as usize * width..][..width])
            .copied()
            .collect()
    }

    #[test]
    fn distinct_rotary_rows_gathered_equal_every_tokens_own_bit_for_bit() {
        // Two images of one size, a two-frame video of another, and a turned image.
        let grids = [[1, 4, 6], [2, 6, 4], [1, 4, 6], [1, 2, 8]];
        let positions = rotary_positions(&grids, 2);
        let distinct = distinct_positions(&positions);
        assert_eq!(distinct.index.len(), positions.len() / 2);
        // 24 pairs of the 4x6 grid, 24 of 6x4 (16 shared with it), 16 of 2x8 (columns 6 and 7
        // new).
        assert_eq!(distinct.keys.len(), 24 + 8 + 4);
        let head_dim = 72;
        let (cos, sin) = rotary_tables(distinct.keys.as_flattened(), head_dim, 10_000.0);
        let (full_cos, full_sin) = rotary_tables(&positions, head_dim, 10_000.0);
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(
            bits(gather(&cos, head_dim, &distinct.index)),
            bits(full_cos)
        );
        assert_eq!(
            bits(gather(&sin, head_dim, &distinct.index)),
            bits(full_sin)
        );
    }

    #[test]
    fn distinct_frames_share_rows_across_images_and_frames() {
        let grids = [[1, 4, 6], [2, 6, 4], [1, 4, 6]];
        let distinct = distinct_frames(&grids);
        assert_eq!(distinct.keys, vec![[4, 6], [6, 4]]);
        let first: Vec<u32> = (0..24).collect();
        let second: Vec<u32> = (24..48).collect();
        let expected = [&first[..], &second, &second, &first].concat();
        assert_eq!(distinct.index, expected);
    }

    #[test]
    fn interpolated_frames_are_in_merge_window_order() {
        // A 2x2 table at its own size with merge 2 is one window: rows in row-major order; at
        // 2x4, two windows of the bilinear columns 0, 1/3, 2/3 and 1.
        let (side, dim) = (2, 1);
        let table = vec![0.0f32, 3.0, 6.0, 9.0];
        assert_eq!(interpolated_frame(&table, side, dim, [2, 2], 2), table);
        let out = interpolated_frame(&table, side, dim, [2, 4], 2);
        let window = |x0: f32, x1: f32| [x0, x1, 6.0 + x0, 6.0 + x1];
        let third = 1.0f32 / 3.0;
        let expected = [window(0.0, 3.0 * third), window(3.0 * (1.0 - third), 3.0)].concat();
        for (got, want) in out.iter().zip(&expected) {
            assert!((got - want).abs() < 1e-6, "{out:?} against {expected:?}");
        }
    }

    #[test]
    fn frames_are_separate_segments() {
        assert_eq!(
            frame_cu_seqlens(&[[2, 4, 4], [1, 2, 6]]),
            vec![0, 16, 32, 44]
        );
    }

    #[test]
    fn window_layout_groups_units_and_keeps_ragged_edges() {
        // 6 x 10 patches with merge 2 -> 3 x 5 merge units; windows of 2 x 2 units.
        let (index, cu) = window_layout(&[[1, 6, 10]], 2, 2);
        assert_eq!(index.len(), 15);
        assert_eq!(&index[..4], &[0, 1, 5, 6]);
        // Windows: rows {0,1} x cols {0,1},{2,3},{4}; row {2} x same -> sizes 4,4,2,2,2,1.
        assert_eq!(cu, vec![0, 16, 32, 40, 48, 56, 60]);
        let mut sorted = index.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..15).collect::<Vec<_>>());
        let inverse = inverse_permutation(&index);
        for (position, &unit) in index.iter().enumerate() {
            assert_eq!(inverse[unit as usize] as usize, position);
        }
    }

    #[test]
    fn linspace_matches_torch_endpoints() {
        let values = linspace(48, 5);
        assert_eq!(values[0], 0.0);
        assert_eq!(values[4], 47.0);
        assert!((values[2] - 23.5).abs() < 1e-6);
    }

    #[test]
    fn interpolation_reproduces_the_table_at_its_own_size() {
        let side = 4;
        let dim = 2;
        let table: Vec<f32> = (0..side * side * dim).map(|v| v as f32).collect();
        let out = interpolated_frame(&table, side, dim, [4, 4], 1);
        assert_eq!(out, table);
    }
}
