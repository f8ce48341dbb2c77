//! What the CPU device's benches share: their operands.

use iris_plugin::{DType, Device, MatRef};

/// A `[rows, cols]` matrix of `dtype` (f32 bits for any dtype but bf16 and f16) holding small
/// deterministic values, written to a new buffer of `dev`.
pub fn matrix(dev: &Device, dtype: DType, rows: u64, cols: u64) -> MatRef {
    let count = usize::try_from(rows * cols).expect("fits");
    let values = (0..count).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0);
    let bytes: Vec<u8> = match dtype {
        DType::BF16 => values
            .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.flat_map(f32::to_le_bytes).collect(),
    };
    let buf = dev.alloc(bytes.len() as u64).expect("alloc");
    dev.write(buf, 0, &bytes).expect("write");
    MatRef::contiguous(buf, 0, dtype, rows, cols)
}
