//! Host math for the emulated ops, in f32 over row-major buffers.

use crate::error::{EmuError, codes};
use crate::tensor::View;

/// `x · Φ(x)` with the exact error function.
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// The tanh approximation of GELU.
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `view` seen with `target` dimensions, numpy-style broadcasting (aligned right, size-1
/// dimensions repeat with stride 0).
pub fn broadcast(view: &View, target: &[usize]) -> Result<View, EmuError> {
    if view.dims.len() > target.len() {
        return Err(EmuError::new(
            codes::ACLNN_PARAM_INVALID,
            format!("cannot broadcast {:?} to {target:?}", view.dims),
        ));
    }
    let lead = target.len() - view.dims.len();
    let mut dims = Vec::with_capacity(target.len());
    let mut strides = Vec::with_capacity(target.len());
    for (i, &t) in target.iter().enumerate() {
        if i < lead {
            dims.push(t);
            strides.push(0);
            continue;
        }
        let (d, s) = (view.dims[i - lead], view.strides[i - lead]);
        if d == t {
            dims.push(t);
            strides.push(s);
        } else if d == 1 {
            dims.push(t);
            strides.push(0);
        } else {
            return Err(EmuError::new(
                codes::ACLNN_PARAM_INVALID,
                format!("cannot broadcast {:?} to {target:?}", view.dims),
            ));
        }
    }
    Ok(View {
        dims,
        strides,
        ..view.clone()
    })
}

/// The broadcast shape of two shapes.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, EmuError> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(EmuError::new(
                codes::ACLNN_PARAM_INVALID,
                format!("shapes {a:?} and {b:?} do not broadcast"),
            ));
        };
    }
    Ok(out)
}

/// `c[m, n] = a[m, k] · b[k, n]`, row-major contiguous.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let (ki, ni) = (k as isize, n as isize);
    // SAFETY: the slices hold m·k, k·n and m·n elements; the strides describe row-major
    // layouts of those shapes.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ni,
            false,
            a.as_ptr(),
            1,
            ki,
            b.as_ptr(),
            1,
            ni,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

/// Softmax along axis `axis` of a row-major `dims` buffer, in place.
pub fn softmax(values: &mut [f32], dims: &[usize], axis: usize) {
    let len = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * len + j) * inner + i;
            let max = (0..len)
                .map(|j| values[at(j)])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for j in 0..len {
                let e = (values[at(j)] - max).exp();
                values[at(j)] = e;
                sum += e;
            }
            for j in 0..len {
                values[at(j)] /= sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_match_known_values() {
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
    }

    #[test]
    fn matmul_and_softmax() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [5.0, 6.0, 7.0, 8.0];
        let mut c = [0.0; 4];
        matmul(&a, &b, &mut c, 2, 2, 2);
        assert_eq!(c, [19.0, 22.0, 43.0, 50.0]);
        let mut s = [1.0, 1.0, 0.0, 0.0];
        softmax(&mut s, &[2, 2], 1);
        assert_eq!(s, [0.5, 0.5, 0.5, 0.5]);
        assert_eq!(broadcast_shape(&[4, 1], &[3]).unwrap(), vec![4, 3]);
        assert!(broadcast_shape(&[4, 2], &[3]).is_err());
    }
}
