//! Every op of the CPU device against plain-loop references, through the public ABI (the
//! built-in plugin's root module, `Plugin::open`, `Device` calls), so the shims run too.
//!
//! Inputs are seeded pseudo-random values rounded to the storage dtype, so the references (in
//! f64) see exactly what the device sees; tolerances depend on the output dtype.

// Test sizes, offsets and positions are small numbers; the casts between them cannot truncate.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use half::{bf16, f16};
use iris_plugin::abi::{
    ActivationArgs, AttentionArgs, BinaryArgs, BufferSlice, CastArgs, GatherArgs, GemmArgs,
    NormArgs, RotaryArgs,
};
use iris_plugin::{
    Activation, BinaryOp, BufferHandle, DType, Device, DeviceError, ErrorCode, MatRef, OpKind,
    Plugin,
};

use abi_stable::std_types::RSlice;
use iris_device_cpu::isa::Tier;

const SENTINEL: f32 = 1234.5;

fn device(threads: usize) -> Device {
    device_on(threads, Tier::best())
}

/// The device with its kernel tier forced to `tier` (through the `isa` option, which, unlike
/// `IRIS_CPU_ISA`, does not race between test threads).
fn device_on(threads: usize, tier: Tier) -> Device {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let dev = plugin
        .open(
            0,
            &[
                ("threads".to_owned(), threads.to_string()),
                ("capacity".to_owned(), "2GiB".to_owned()),
                ("isa".to_owned(), tier.name().to_owned()),
            ],
        )
        .unwrap();
    assert_eq!(
        dev.description().property("kernel_tier"),
        Some(tier.name()),
        "the device runs the tier asked for"
    );
    dev
}

#[test]
fn each_tier_reports_its_instruction_set_and_widened_names_avx512() {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let open = |name: &str| {
        plugin
            .open(
                0,
                &[
                    ("threads".to_owned(), "1".to_owned()),
                    ("capacity".to_owned(), "64MiB".to_owned()),
                    ("isa".to_owned(), name.to_owned()),
                ],
            )
            .unwrap()
    };
    for tier in tiers() {
        let dev = open(tier.name());
        let description = dev.description();
        assert_eq!(description.property("kernel_tier"), Some(tier.name()));
        assert_eq!(
            description.property("gemm_isa"),
            Some(tier.simd().name()),
            "{tier}"
        );
    }
    let dev = open("widened");
    let widened = dev.description();
    let expected = Tier::resolve(Tier::Avx512).0;
    assert_eq!(widened.property("kernel_tier"), Some(expected.name()));
    let err = plugin
        .open(0, &[("isa".to_owned(), "sse2".to_owned())])
        .map(|_| ())
        .expect_err("an unknown tier is refused")
        .to_string();
    assert!(err.contains("avx2") && err.contains("generic"), "{err}");
}

/// Every tier this CPU and build run; the others are printed as skipped, with the reason.
fn tiers() -> Vec<Tier> {
    Tier::ALL
        .into_iter()
        .filter(|tier| {
            let (used, note) = Tier::resolve(*tier);
            if let Some(note) = &note {
                eprintln!("skipping tier {tier}: {note}");
            }
            used == *tier
        })
        .collect()
}

/// xorshift64*: deterministic test data without a rand dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, dtype: DType, amplitude: f32) -> Vec<f32> {
        (0..n)
            .map(|_| round(dtype, self.next() * amplitude))
            .collect()
    }
}

fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for v in values {
        match dtype {
            DType::F16 => bytes.extend_from_slice(&f16::from_f32(*v).to_le_bytes()),
            DType::BF16 => bytes.extend_from_slice(&bf16::from_f32(*v).to_le_bytes()),
            _ => bytes.extend_from_slice(&v.to_le_bytes()),
        }
    }
    bytes
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

fn size(dtype: DType) -> u64 {
    dtype.size().unwrap()
}

/// A `[rows, cols]` view at element offset `pad` with row stride `cols + extra`, in a buffer of
/// its own whose other elements hold [`SENTINEL`].
fn upload_strided(
    dev: &Device,
    dtype: DType,
    rows: usize,
    cols: usize,
    pad: usize,
    extra: usize,
    data: &[f32],
) -> MatRef {
    assert_eq!(data.len(), rows * cols);
    let stride = cols + extra;
    let total = pad + rows * stride + 3;
    let mut host = vec![SENTINEL; total];
    for r in 0..rows {
        host[pad + r * stride..pad + r * stride + cols].copy_from_slice(&data[r * cols..][..cols]);
    }
    let buf = dev.alloc(total as u64 * size(dtype)).unwrap();
    dev.write(buf, 0, &encode(dtype, &host)).unwrap();
    MatRef {
        buf,
        offset: pad as u64 * size(dtype),
        dtype,
        rows: rows as u64,
        cols: cols as u64,
        row_stride: stride as u64,
    }
}

fn upload(dev: &Device, dtype: DType, rows: usize, cols: usize, data: &[f32]) -> MatRef {
    upload_strided(dev, dtype, rows, cols, 0, 0, data)
}

/// An i32 `[1, len]` vector on the device.
fn upload_i32(dev: &Device, values: &[i32]) -> MatRef {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let buf = dev.alloc(bytes.len().max(4) as u64).unwrap();
    dev.write(buf, 0, &bytes).unwrap();
    MatRef::vector(buf, 0, DType::I32, values.len() as u64)
}

/// The view's elements, after checking that nothing outside them changed from [`SENTINEL`].
fn download(dev: &Device, m: &MatRef) -> Vec<f32> {
    let (rows, cols, stride) = (m.rows as usize, m.cols as usize, m.row_stride as usize);
    let pad = (m.offset / size(m.dtype)) as usize;
    let total = pad + rows * stride + 3;
    let mut bytes = vec![0u8; total * size(m.dtype) as usize];
    dev.read(m.buf, 0, &mut bytes).unwrap();
    let host = decode(m.dtype, &bytes);
    let mut out = Vec::with_capacity(rows * cols);
    for (i, v) in host.iter().enumerate() {
        let inside = i >= pad && (i - pad) / stride < rows && (i - pad) % stride < cols;
        if inside {
            out.push(*v);
        } else {
            assert_eq!(
                *v,
                round(m.dtype, SENTINEL),
                "element {i} outside the view changed"
            );
        }
    }
    out
}

/// (absolute, relative) tolerance for results stored in `dtype`.
fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F16 => (2e-3, 2e-3),
        DType::BF16 => (2e-2, 1.6e-2),
        _ => (2e-5, 2e-5),
    }
}

fn assert_close(what: &str, dtype: DType, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (atol, rtol) = tolerance(dtype);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what} ({dtype}): element {i}: got {g}, want {w}"
        );
    }
}

fn assert_invalid(result: Result<impl std::fmt::Debug, DeviceError>, needle: &str) {
    let err = result.expect_err("expected an invalid-argument error");
    assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
    assert!(
        err.message.contains(needle),
        "message `{}` does not name `{needle}`",
        err.message
    );
}

fn act_ref(act: Activation, x: f64) -> f64 {
    let sig = |t: f64| 1.0 / (1.0 + (-t).exp());
    match act {
        Activation::GELU_ERF => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Activation::GELU_TANH => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        }
        Activation::QUICK_GELU => x * sig(1.702 * x),
        Activation::SILU => x * sig(x),
        _ => x,
    }
}

/// erf by its Maclaurin series (|x| < 3 here) for an independent reference.
fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let mut sum = 0.0;
    let mut term = x;
    let mut n = 0.0;
    loop {
        let add = term / (2.0 * n + 1.0);
        sum += add;
        if add.abs() < 1e-17 {
            break;
        }
        n += 1.0;
        term *= -x * x / n;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

// ------------------------------------------------------------------------------------------
// Description
// ------------------------------------------------------------------------------------------

#[test]
fn device_lists_every_op_and_dtype() {
    let dev = device(2);
    for op in OpKind::ALL {
        assert!(dev.supports(op), "{op}");
    }
    assert_eq!(dev.description().dtypes, DType::ALL.to_vec());
}

// ------------------------------------------------------------------------------------------
// GEMM
// ------------------------------------------------------------------------------------------

struct GemmCase {
    m: usize,
    n: usize,
    k: usize,
    transposed: bool,
    bias: bool,
    act: Activation,
    accumulate: bool,
    strided: bool,
    /// Pass `w_constant` (the device may pack the weight once and keep it).
    constant: bool,
}

fn run_gemm_case(dev: &Device, dtype: DType, case: &GemmCase, seed: u64) {
    let GemmCase { m, n, k, .. } = *case;
    let mut rng = Rng::new(seed);
    let a = rng.vec(m * k, dtype, 1.0);
    let w = rng.vec(n * k, dtype, 1.0); // [n, k] logically
    let bias = rng.vec(n, dtype, 1.0);
    let old = rng.vec(m * n, dtype, 1.0);
    let (pad, extra) = if case.strided { (3, 5) } else { (0, 0) };
    let a_view = upload_strided(dev, dtype, m, k, pad, extra, &a);
    let w_view = if case.transposed {
        let mut wt = vec![0.0; n * k];
        for j in 0..n {
            for c in 0..k {
                wt[c * n + j] = w[j * k + c];
            }
        }
        upload_strided(dev, dtype, k, n, pad, extra, &wt)
    } else {
        upload_strided(dev, dtype, n, k, pad, extra, &w)
    };
    let bias_view = if case.bias {
        upload_strided(dev, dtype, 1, n, pad, 0, &bias)
    } else {
        MatRef::NONE
    };
    let out_view = upload_strided(dev, dtype, m, n, pad + 1, extra + 2, &old);
    dev.gemm(&GemmArgs {
        a: a_view,
        w: w_view,
        bias: bias_view,
        out: out_view,
        activation: case.act,
        accumulate: case.accumulate,
        w_transposed: case.transposed,
        w_constant: case.constant,
        workspace: BufferSlice::EMPTY,
    })
    .unwrap();
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = if case.bias { f64::from(bias[j]) } else { 0.0 };
            for c in 0..k {
                acc += f64::from(a[i * k + c]) * f64::from(w[j * k + c]);
            }
            let mut v = act_ref(case.act, acc);
            if case.accumulate {
                v += f64::from(old[i * n + j]);
            }
            want[i * n + j] = v;
        }
    }
    let got = download(dev, &out_view);
    let what = format!(
        "gemm m={m} n={n} k={k} t={} bias={} act={:?} acc={} const={} tier={}",
        case.transposed,
        case.bias,
        case.act,
        case.accumulate,
        case.constant,
        dev.description().property("kernel_tier").unwrap_or("?")
    );
    assert_close(&what, dtype, &got, &want);
    for view in [a_view, w_view, bias_view, out_view] {
        if !view.is_none() {
            dev.free(view.buf).unwrap();
        }
    }
}

#[test]
fn gemm_matches_reference_for_every_flag_combination() {
    let acts = [
        Activation::NONE,
        Activation::QUICK_GELU,
        Activation::GELU_ERF,
    ];
    for tier in tiers() {
        let dev = device_on(3, tier);
        let mut seed = 1;
        for dtype in DType::FLOATS {
            for transposed in [false, true] {
                for bias in [false, true] {
                    for act in acts {
                        for accumulate in [false, true] {
                            let case = GemmCase {
                                m: 37,
                                n: 29,
                                k: 23,
                                transposed,
                                bias,
                                act,
                                accumulate,
                                strided: seed % 2 == 0,
                                constant: seed % 3 == 0,
                            };
                            run_gemm_case(&dev, dtype, &case, seed);
                            seed += 1;
                        }
                    }
                }
            }
        }
    }
}

/// Each tier on odd and tile-crossing shapes (the bf16 kernels' 32-column panels, their 4- to
/// 32-row blocks, 96- to 128-row tasks and odd reductions), constant and per-call weights.
#[test]
fn gemm_tiers_match_reference_on_tile_crossing_shapes() {
    let shapes = [(1, 1, 1), (17, 33, 65), (333, 77, 129), (1024, 1280, 24)];
    for tier in tiers() {
        let dev = device_on(2, tier);
        for (i, (m, n, k)) in shapes.into_iter().enumerate() {
            for dtype in [DType::BF16, DType::F32] {
                for constant in [false, true] {
                    let case = GemmCase {
                        m,
                        n,
                        k,
                        transposed: i % 2 == 1,
                        bias: true,
                        act: Activation::GELU_TANH,
                        accumulate: constant,
                        strided: true,
                        constant,
                    };
                    run_gemm_case(&dev, dtype, &case, 500 + i as u64);
                }
            }
        }
    }
}

/// A constant weight is packed once and kept, counted in the memory report; rewriting its
/// buffer drops the copy (the next product sees the new weight) and freeing it releases it.
#[test]
fn constant_weights_are_packed_once_and_released() {
    let dev = device_on(2, Tier::best());
    let native = iris_device_cpu::ops::native::Kernel::for_tier(Tier::best())
        .is_some_and(|kernel| kernel.available());
    if !native {
        eprintln!(
            "skipped: this CPU runs no bf16 kernel of its own (AVX2 at least), which is what \
             packs weights"
        );
        return;
    }
    let (m, n, k) = (5, 40, 6);
    let a = upload(&dev, DType::BF16, m, k, &[1.0; 30]);
    let w = upload(&dev, DType::BF16, n, k, &[0.5; 240]);
    let out = upload(&dev, DType::BF16, m, n, &[0.0; 200]);
    let args = GemmArgs {
        a,
        w,
        bias: MatRef::NONE,
        out,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: true,
        workspace: BufferSlice::EMPTY,
    };
    let held = |dev: &Device| dev.memory_report().unwrap().held_bytes();
    assert_eq!(held(&dev), 0);
    dev.gemm(&args).unwrap();
    assert!(download(&dev, &out).iter().all(|v| *v == 3.0));
    let packed = held(&dev);
    // Two panels of 32 columns, three pairs of bf16 each.
    assert!(packed >= 2 * 32 * 3 * 4, "{packed} bytes held");
    dev.gemm(&args).unwrap();
    assert_eq!(held(&dev), packed, "the second product reuses the copy");
    dev.write(w.buf, 0, &encode(DType::BF16, &[2.0; 240]))
        .unwrap();
    dev.gemm(&args).unwrap();
    assert!(download(&dev, &out).iter().all(|v| *v == 12.0));
    assert_eq!(
        held(&dev),
        packed,
        "the stale copy was replaced, not kept beside"
    );
    dev.free(w.buf).unwrap();
    assert_eq!(held(&dev), 0);
    for buf in [a.buf, out.buf] {
        dev.free(buf).unwrap();
    }
}

#[test]
fn gemm_handles_blocks_and_degenerate_sizes() {
    let dev = device(2);
    let cases = [
        // More output columns than one f16/bf16 weight block, more rows than one
        // activation-and-accumulate block.
        (300, 530, 19, Activation::SILU, true),
        (300, 530, 19, Activation::NONE, false),
        (1, 1, 1, Activation::GELU_TANH, false),
        (5, 7, 0, Activation::NONE, false),
        (5, 7, 0, Activation::SILU, true),
        (0, 7, 3, Activation::NONE, false),
    ];
    for (i, (m, n, k, act, accumulate)) in cases.into_iter().enumerate() {
        for dtype in DType::FLOATS {
            for transposed in [false, true] {
                let case = GemmCase {
                    m,
                    n,
                    k,
                    transposed,
                    bias: true,
                    act,
                    accumulate,
                    strided: true,
                    constant: transposed,
                };
                run_gemm_case(&dev, dtype, &case, 100 + i as u64);
            }
        }
    }
}

#[test]
fn gemm_rejects_bad_arguments() {
    let dev = device(2);
    let a = upload(&dev, DType::F32, 4, 3, &[0.5; 12]);
    let w = upload(&dev, DType::F32, 5, 3, &[0.5; 15]);
    let out = upload(&dev, DType::F32, 4, 5, &[0.0; 20]);
    let w16 = upload(&dev, DType::F16, 5, 3, &[0.5; 15]);
    let base = GemmArgs {
        a,
        w,
        bias: MatRef::NONE,
        out,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: false,
        workspace: BufferSlice::EMPTY,
    };
    dev.gemm(&base).unwrap();
    let unknown = MatRef {
        buf: BufferHandle(9999),
        ..a
    };
    assert_invalid(dev.gemm(&GemmArgs { a: unknown, ..base }), "`a`");
    let outside = MatRef { rows: 40, ..a };
    assert_invalid(dev.gemm(&GemmArgs { a: outside, ..base }), "`a`");
    let narrow = MatRef { cols: 2, ..w };
    assert_invalid(dev.gemm(&GemmArgs { w: narrow, ..base }), "`w`");
    assert_invalid(dev.gemm(&GemmArgs { w: w16, ..base }), "`w`");
    let wide_out = MatRef {
        cols: 4,
        row_stride: 5,
        ..out
    };
    assert_invalid(
        dev.gemm(&GemmArgs {
            out: wide_out,
            ..base
        }),
        "`out`",
    );
    let bad_bias = MatRef::contiguous(w.buf, 0, DType::F32, 1, 4);
    assert_invalid(
        dev.gemm(&GemmArgs {
            bias: bad_bias,
            ..base
        }),
        "`bias`",
    );
    assert_invalid(
        dev.gemm(&GemmArgs {
            out: a,
            a: out,
            ..base
        }),
        "`w`",
    );
    let overlapping = MatRef::contiguous(a.buf, 0, DType::F32, 4, 5);
    let small_a = MatRef::contiguous(a.buf, 0, DType::F32, 4, 3);
    assert_invalid(
        dev.gemm(&GemmArgs {
            a: small_a,
            out: MatRef::contiguous(a.buf, 4, DType::F32, 2, 5),
            ..base
        }),
        "`out`",
    );
    let _ = overlapping;
    let bad_stride = MatRef { row_stride: 2, ..a };
    assert_invalid(
        dev.gemm(&GemmArgs {
            a: bad_stride,
            ..base
        }),
        "row_stride",
    );
    let misaligned = MatRef {
        offset: 2,
        rows: 1,
        ..a
    };
    assert_invalid(
        dev.gemm(&GemmArgs {
            a: misaligned,
            ..base
        }),
        "`a`",
    );
    let bad_dtype = MatRef {
        dtype: DType(77),
        ..a
    };
    assert_invalid(
        dev.gemm(&GemmArgs {
            a: bad_dtype,
            ..base
        }),
        "dtype",
    );
    assert_invalid(
        dev.gemm(&GemmArgs {
            activation: Activation(42),
            ..base
        }),
        "activation",
    );
}

// ------------------------------------------------------------------------------------------
// Norms
// ------------------------------------------------------------------------------------------

fn norm_ref(x: &[f32], cols: usize, w: &[f32], b: Option<&[f32]>, eps: f32, rms: bool) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let n = cols as f64;
        let mean = if rms {
            0.0
        } else {
            row.iter().map(|v| f64::from(*v)).sum::<f64>() / n
        };
        let var = row
            .iter()
            .map(|v| (f64::from(*v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for (c, v) in row.iter().enumerate() {
            let mut y = (f64::from(*v) - mean) * inv * f64::from(w[c]);
            if let Some(b) = b {
                y += f64::from(b[c]);
            }
            out.push(y);
        }
    }
    out
}

#[test]
fn norms_match_reference_in_and_out_of_place() {
    for tier in tiers() {
        norms_match_reference_on(tier);
    }
}

fn norms_match_reference_on(tier: Tier) {
    let dev = device_on(2, tier);
    let mut rng = Rng::new(7);
    for dtype in DType::FLOATS {
        for (rows, cols) in [(1, 1), (33, 77), (130, 300)] {
            for rms in [false, true] {
                for with_bias in [false, true] {
                    if rms && with_bias {
                        continue;
                    }
                    for in_place in [false, true] {
                        let x: Vec<f32> = rng
                            .vec(rows * cols, dtype, 3.0)
                            .iter()
                            .map(|v| v + 0.7)
                            .map(|v| round(dtype, v))
                            .collect();
                        let w = rng.vec(cols, dtype, 1.5);
                        let b = rng.vec(cols, dtype, 1.0);
                        let xv = upload_strided(&dev, dtype, rows, cols, 2, 3, &x);
                        let wv = upload(&dev, dtype, 1, cols, &w);
                        let bv = if with_bias {
                            upload(&dev, dtype, 1, cols, &b)
                        } else {
                            MatRef::NONE
                        };
                        let out = if in_place {
                            xv
                        } else {
                            upload_strided(&dev, dtype, rows, cols, 1, 0, &vec![0.0; rows * cols])
                        };
                        let args = NormArgs {
                            x: xv,
                            weight: wv,
                            bias: bv,
                            out,
                            eps: 1e-6,
                            workspace: BufferSlice::EMPTY,
                        };
                        if rms {
                            dev.rms_norm(&args).unwrap();
                        } else {
                            dev.layer_norm(&args).unwrap();
                        }
                        let want = norm_ref(&x, cols, &w, with_bias.then_some(&b[..]), 1e-6, rms);
                        let got = download(&dev, &out);
                        let what = format!(
                            "norm rms={rms} bias={with_bias} in_place={in_place} {rows}x{cols}"
                        );
                        assert_close(&what, dtype, &got, &want);
                    }
                }
            }
        }
    }
}

#[test]
fn norms_reject_bad_arguments() {
    let dev = device(2);
    let x = upload(&dev, DType::F32, 3, 4, &[1.0; 12]);
    let w = upload(&dev, DType::F32, 1, 4, &[1.0; 4]);
    let w5 = upload(&dev, DType::F32, 1, 5, &[1.0; 5]);
    let b16 = upload(&dev, DType::BF16, 1, 4, &[1.0; 4]);
    let out = upload(&dev, DType::F32, 3, 4, &[0.0; 12]);
    let args = NormArgs {
        x,
        weight: w,
        bias: MatRef::NONE,
        out,
        eps: 1e-5,
        workspace: BufferSlice::EMPTY,
    };
    dev.layer_norm(&args).unwrap();
    assert_invalid(dev.layer_norm(&NormArgs { weight: w5, ..args }), "`weight`");
    assert_invalid(dev.layer_norm(&NormArgs { bias: b16, ..args }), "`bias`");
    assert_invalid(dev.rms_norm(&NormArgs { bias: w, ..args }), "`bias`");
    let shifted = MatRef {
        offset: 4,
        rows: 2,
        ..x
    };
    assert_invalid(
        dev.layer_norm(&NormArgs {
            out: shifted,
            ..args
        }),
        "`out`",
    );
    assert_invalid(
        dev.layer_norm(&NormArgs {
            eps: f32::NAN,
            ..args
        }),
        "`eps`",
    );
    let short = MatRef { rows: 2, ..out };
    assert_invalid(dev.rms_norm(&NormArgs { out: short, ..args }), "`out`");
}

// ------------------------------------------------------------------------------------------
// Activation, binary, gather, cast
// ------------------------------------------------------------------------------------------

#[test]
fn activations_match_reference() {
    for tier in tiers() {
        activations_match_reference_on(tier);
    }
}

fn activations_match_reference_on(tier: Tier) {
    let dev = device_on(2, tier);
    let mut rng = Rng::new(11);
    for dtype in DType::FLOATS {
        // `NONE` is gemm's "no activation", not a function the activation op applies.
        for act in Activation::ALL
            .into_iter()
            .filter(|a| *a != Activation::NONE)
        {
            for in_place in [false, true] {
                let (rows, cols) = (67, 45);
                let x = rng.vec(rows * cols, dtype, 6.0);
                let xv = upload_strided(&dev, dtype, rows, cols, 1, 2, &x);
                let out = if in_place {
                    xv
                } else {
                    upload(&dev, dtype, rows, cols, &vec![0.0; rows * cols])
                };
                dev.activation(&ActivationArgs {
                    x: xv,
                    out,
                    activation: act,
                    workspace: BufferSlice::EMPTY,
                })
                .unwrap();
                let want: Vec<f64> = x.iter().map(|v| act_ref(act, f64::from(*v))).collect();
                let got = download(&dev, &out);
                assert_close(
                    &format!("activation {act:?} in_place={in_place}"),
                    dtype,
                    &got,
                    &want,
                );
            }
        }
    }
    let x = upload(&dev, DType::F32, 2, 2, &[0.0; 4]);
    let y = upload(&dev, DType::F16, 2, 2, &[0.0; 4]);
    assert_invalid(
        dev.activation(&ActivationArgs {
            x,
            out: x,
            activation: Activation::NONE,
            workspace: BufferSlice::EMPTY,
        }),
        "`none` is not an activation function",
    );
    assert_invalid(
        dev.activation(&ActivationArgs {
            x,
            out: y,
            activation: Activation::SILU,
            workspace: BufferSlice::EMPTY,
        }),
        "`out`",
    );
    let half_overlap = MatRef {
        offset: 4,
        rows: 1,
        ..x
    };
    let x1 = MatRef { rows: 1, ..x };
    assert_invalid(
        dev.activation(&ActivationArgs {
            x: x1,
            out: half_overlap,
            activation: Activation::SILU,
            workspace: BufferSlice::EMPTY,
        }),
        "`out`",
    );
    assert_invalid(
        dev.activation(&ActivationArgs {
            x,
            out: x,
            activation: Activation(99),
            workspace: BufferSlice::EMPTY,
        }),
        "activation",
    );
}

#[test]
fn binary_ops_broadcast_and_alias() {
    for tier in tiers() {
        binary_ops_broadcast_and_alias_on(tier);
    }
}

fn binary_ops_broadcast_and_alias_on(tier: Tier) {
    let dev = device_on(2, tier);
    let mut rng = Rng::new(13);
    for dtype in DType::FLOATS {
        for op in [BinaryOp::ADD, BinaryOp::MUL] {
            for broadcast in [false, true] {
                for alias in 0..3 {
                    let (rows, cols) = (50, 333);
                    let a = rng.vec(rows * cols, dtype, 2.0);
                    let b_rows = if broadcast { 1 } else { rows };
                    let b = rng.vec(b_rows * cols, dtype, 2.0);
                    let av = upload_strided(&dev, dtype, rows, cols, 2, 1, &a);
                    let bv = upload_strided(&dev, dtype, b_rows, cols, 1, 4, &b);
                    let out = match alias {
                        1 => av,
                        2 if !broadcast => bv,
                        _ => upload(&dev, dtype, rows, cols, &vec![0.0; rows * cols]),
                    };
                    dev.binary(&BinaryArgs {
                        a: av,
                        b: bv,
                        out,
                        op,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap();
                    let want: Vec<f64> = (0..rows * cols)
                        .map(|i| {
                            let x = f64::from(a[i]);
                            let y = f64::from(b[if broadcast { i % cols } else { i }]);
                            if op == BinaryOp::ADD { x + y } else { x * y }
                        })
                        .collect();
                    let got = download(&dev, &out);
                    assert_close(
                        &format!("binary {} bc={broadcast} alias={alias}", op.0),
                        dtype,
                        &got,
                        &want,
                    );
                }
            }
        }
    }
    let a = upload(&dev, DType::F32, 3, 4, &[1.0; 12]);
    let b = upload(&dev, DType::F32, 2, 4, &[1.0; 8]);
    let b16 = upload(&dev, DType::F16, 3, 4, &[1.0; 12]);
    assert_invalid(
        dev.binary(&BinaryArgs {
            a,
            b,
            out: a,
            op: BinaryOp::ADD,
            workspace: BufferSlice::EMPTY,
        }),
        "`b`",
    );
    assert_invalid(
        dev.binary(&BinaryArgs {
            a,
            b: b16,
            out: a,
            op: BinaryOp::ADD,
            workspace: BufferSlice::EMPTY,
        }),
        "`b`",
    );
    assert_invalid(
        dev.binary(&BinaryArgs {
            a,
            b: a,
            out: a,
            op: BinaryOp(5),
            workspace: BufferSlice::EMPTY,
        }),
        "`op`",
    );
}

#[test]
fn gather_rows_copies_indexed_rows() {
    let dev = device(2);
    let mut rng = Rng::new(17);
    for dtype in DType::FLOATS {
        let (rows, cols) = (40, 21);
        let src = rng.vec(rows * cols, dtype, 1.0);
        let sv = upload_strided(&dev, dtype, rows, cols, 3, 2, &src);
        let indices: Vec<i32> = vec![5, 0, 39, 5, 17, 17, 2];
        let out = upload_strided(
            &dev,
            dtype,
            indices.len(),
            cols,
            1,
            3,
            &vec![0.0; indices.len() * cols],
        );
        let iv = upload_i32(&dev, &indices);
        dev.gather_rows(&GatherArgs {
            src: sv,
            out,
            indices: iv,
            workspace: BufferSlice::EMPTY,
        })
        .unwrap();
        let want: Vec<f64> = indices
            .iter()
            .flat_map(|i| {
                src[*i as usize * cols..][..cols]
                    .iter()
                    .map(|v| f64::from(*v))
            })
            .collect();
        assert_close("gather", dtype, &download(&dev, &out), &want);
        // A bad index is device data: it is reported when the op runs (at once on a
        // synchronous queue, by the next call on an asynchronous one), and its row is zeros.
        let bad = upload_i32(&dev, &[1, 40]);
        let out2 = upload(&dev, dtype, 2, cols, &vec![1.0; 2 * cols]);
        let result = dev
            .gather_rows(&GatherArgs {
                src: sv,
                out: out2,
                indices: bad,
                workspace: BufferSlice::EMPTY,
            })
            .and_then(|()| dev.synchronize());
        assert_invalid(result, "`indices`[1] = 40");
        let got = download(&dev, &out2);
        assert!(got[cols..].iter().all(|v| *v == 0.0), "{got:?}");
        assert_invalid(
            dev.gather_rows(&GatherArgs {
                src: sv,
                out,
                indices: bad,
                workspace: BufferSlice::EMPTY,
            }),
            "`out`",
        );
        let two = upload_i32(&dev, &[0, 1]);
        assert_invalid(
            dev.gather_rows(&GatherArgs {
                src: sv,
                out: MatRef { rows: 2, ..sv },
                indices: two,
                workspace: BufferSlice::EMPTY,
            }),
            "`out`",
        );
        let as_f32 = MatRef {
            dtype: DType::F32,
            ..two
        };
        assert_invalid(
            dev.gather_rows(&GatherArgs {
                src: sv,
                out: out2,
                indices: as_f32,
                workspace: BufferSlice::EMPTY,
            }),
            "`indices`",
        );
    }
}

#[test]
fn cast_converts_every_pair_with_round_to_nearest_even() {
    let dev = device(2);
    let mut rng = Rng::new(19);
    let (rows, cols) = (31, 57);
    for from in DType::FLOATS {
        for to in DType::FLOATS {
            let src = rng.vec(rows * cols, from, 100.0);
            let sv = upload_strided(&dev, from, rows, cols, 1, 2, &src);
            let out = upload_strided(&dev, to, rows, cols, 2, 1, &vec![0.0; rows * cols]);
            dev.cast(&CastArgs {
                src: sv,
                out,
                workspace: BufferSlice::EMPTY,
            })
            .unwrap();
            let got = download(&dev, &out);
            let want: Vec<f32> = src.iter().map(|v| round(to, *v)).collect();
            assert_eq!(got, want, "cast {from} -> {to}");
        }
    }
    // Same view, same dtype: a no-op; same view, other dtype: an overlap.
    let x = upload(&dev, DType::F16, 2, 2, &[1.5, 2.5, 3.5, 4.5]);
    dev.cast(&CastArgs {
        src: x,
        out: x,
        workspace: BufferSlice::EMPTY,
    })
    .unwrap();
    assert_eq!(download(&dev, &x), vec![1.5, 2.5, 3.5, 4.5]);
    let as_bf16 = MatRef {
        dtype: DType::BF16,
        ..x
    };
    assert_invalid(
        dev.cast(&CastArgs {
            src: x,
            out: as_bf16,
            workspace: BufferSlice::EMPTY,
        }),
        "`out`",
    );
    let wrong = MatRef { rows: 1, ..x };
    let other = upload(&dev, DType::F32, 2, 2, &[0.0; 4]);
    assert_invalid(
        dev.cast(&CastArgs {
            src: wrong,
            out: other,
            workspace: BufferSlice::EMPTY,
        }),
        "`out`",
    );
}

// ------------------------------------------------------------------------------------------
// Rotary
// ------------------------------------------------------------------------------------------

/// Qwen-VL tables for `(row, col)` positions: `cos`/`sin` of `cat(θ, θ)`, `[tokens, d]`.
fn rotary_tables(positions: &[u32], d: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let (q, half) = (d / 4, d / 2);
    let freq = |i: usize| 1.0f32 / theta.powf((2 * i) as f32 / half as f32);
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pair in positions.chunks(2) {
        let angles: Vec<f32> = (0..half)
            .map(|c| {
                let p = if c < q { pair[0] } else { pair[1] };
                p as f32 * freq(c % q)
            })
            .collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

fn rotary_ref(x: &[f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) -> Vec<f64> {
    let cols = heads * d;
    let half = d / 2;
    let mut out = vec![0.0; x.len()];
    for t in 0..x.len() / cols {
        let table = |tab: &[f32], c: usize| f64::from(tab[t * d + c]);
        for h in 0..heads {
            let base = t * cols + h * d;
            for c in 0..half {
                let (x1, x2) = (f64::from(x[base + c]), f64::from(x[base + c + half]));
                out[base + c] = x1 * table(cos, c) - x2 * table(sin, c);
                out[base + c + half] = x2 * table(cos, c + half) + x1 * table(sin, c + half);
            }
        }
    }
    out
}

#[test]
fn rotary_rotates_like_qwen_vl() {
    let dev = device(2);
    let mut rng = Rng::new(23);
    for dtype in DType::FLOATS {
        // Small and large positions.
        for (tokens, max_pos) in [(64usize, 9u32), (5, 40_000)] {
            let (heads, d) = (3, 16);
            let x = rng.vec(tokens * heads * d, dtype, 2.0);
            let positions: Vec<u32> = (0..2 * tokens)
                .map(|i| ((rng.next().abs() * max_pos as f32) as u32 + i as u32 % 3).min(max_pos))
                .collect();
            let (cos, sin) = rotary_tables(&positions, d, 10000.0);
            // A view into the middle of a wider qkv-like row.
            let xv = upload_strided(&dev, dtype, tokens, heads * d, 4, 2 * heads * d, &x);
            let cv = upload(&dev, DType::F32, tokens, d, &cos);
            let sv = upload(&dev, DType::F32, tokens, d, &sin);
            dev.rotary(&RotaryArgs {
                x: xv,
                heads: heads as u64,
                head_dim: d as u64,
                cos: cv,
                sin: sv,
                workspace: BufferSlice::EMPTY,
            })
            .unwrap();
            let want = rotary_ref(&x, heads, d, &cos, &sin);
            assert_close(
                &format!("rotary tokens={tokens}"),
                dtype,
                &download(&dev, &xv),
                &want,
            );
        }
    }
    let x = upload(&dev, DType::F32, 2, 12, &[0.0; 24]);
    let table = upload(&dev, DType::F32, 2, 5, &[0.0; 10]);
    let args = RotaryArgs {
        x,
        heads: 2,
        head_dim: 5,
        cos: table,
        sin: table,
        workspace: BufferSlice::EMPTY,
    };
    assert_invalid(dev.rotary(&args), "`head_dim`");
    assert_invalid(
        dev.rotary(&RotaryArgs {
            heads: 2,
            head_dim: 8,
            ..args
        }),
        "`heads`",
    );
    let x8 = upload(&dev, DType::F32, 2, 8, &[0.0; 16]);
    let wide = upload(&dev, DType::F32, 2, 8, &[0.0; 16]);
    let short = upload(&dev, DType::F32, 1, 8, &[0.0; 8]);
    let rotary = RotaryArgs {
        x: x8,
        heads: 1,
        head_dim: 8,
        cos: wide,
        sin: short,
        workspace: BufferSlice::EMPTY,
    };
    assert_invalid(dev.rotary(&rotary), "`sin`");
    let half = upload(&dev, DType::F16, 2, 8, &[0.0; 16]);
    assert_invalid(
        dev.rotary(&RotaryArgs {
            sin: half,
            ..rotary
        }),
        "`sin`: expected dtype f32",
    );
    assert_invalid(dev.rotary(&RotaryArgs { cos: x8, ..rotary }), "`cos`");
}

// ------------------------------------------------------------------------------------------
// Attention
// ------------------------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cols: usize,
    heads: usize,
    d: usize,
    scale: f32,
    cu: &[u32],
) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    for seg in cu.windows(2) {
        let (s, e) = (seg[0] as usize, seg[1] as usize);
        for h in 0..heads {
            for i in s..e {
                let scores: Vec<f64> = (s..e)
                    .map(|j| {
                        (0..d)
                            .map(|c| {
                                f64::from(q[i * cols + h * d + c])
                                    * f64::from(k[j * cols + h * d + c])
                            })
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for c in 0..d {
                    out[i * cols + h * d + c] = (s..e)
                        .zip(&weights)
                        .map(|(j, w)| w * f64::from(v[j * cols + h * d + c]))
                        .sum::<f64>()
                        / total;
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_reference_over_segments() {
    for tier in tiers() {
        let dev = device_on(3, tier);
        let mut rng = Rng::new(29);
        // Empty segments, a segment longer than one key block and one query block, odd lengths.
        let cu: Vec<u32> = vec![0, 0, 7, 7, 300, 301, 338];
        let tokens = 338;
        for dtype in DType::FLOATS {
            let (heads, d) = (2, 12);
            let cols = heads * d;
            // q, k, v as column slices of one fused [tokens, 3 * cols] matrix.
            let qkv = rng.vec(tokens * 3 * cols, dtype, 2.0);
            let fused = upload(&dev, dtype, tokens, 3 * cols, &qkv);
            let part = |i: usize| MatRef {
                offset: fused.offset + (i * cols) as u64 * size(dtype),
                cols: cols as u64,
                ..fused
            };
            let pick = |i: usize| -> Vec<f32> {
                (0..tokens)
                    .flat_map(|t| qkv[t * 3 * cols + i * cols..][..cols].to_vec())
                    .collect()
            };
            let (q, k, v) = (pick(0), pick(1), pick(2));
            let out = upload_strided(&dev, dtype, tokens, cols, 1, 3, &vec![0.0; tokens * cols]);
            let scale = 1.0 / (d as f32).sqrt();
            let cu_i32: Vec<i32> = cu.iter().map(|&c| c as i32).collect();
            let mut args = AttentionArgs {
                q: part(0),
                k: part(1),
                v: part(2),
                out,
                heads: heads as u64,
                head_dim: d as u64,
                scale,
                cu_seqlens: RSlice::from_slice(&cu),
                cu_seqlens_device: upload_i32(&dev, &cu_i32),
                max_seqlen: 293,
                workspace: BufferSlice::EMPTY,
            };
            let bytes = dev.attention_workspace(&args).unwrap();
            assert!(bytes > 0);
            let ws = dev.alloc(bytes + 8).unwrap();
            args.workspace = BufferSlice {
                buf: ws,
                offset: 4,
                bytes: bytes + 4,
            };
            dev.attention(&args).unwrap();
            let want = attention_ref(&q, &k, &v, cols, heads, d, scale, &cu);
            assert_close(
                &format!("attention {dtype} tier {tier}"),
                dtype,
                &download(&dev, &out),
                &want,
            );

            // Too small a workspace, named with the sizes.
            args.workspace = BufferSlice {
                buf: ws,
                offset: 0,
                bytes: bytes - 1,
            };
            assert_invalid(dev.attention(&args), "`workspace`");
            args.workspace = BufferSlice {
                buf: ws,
                offset: 16,
                bytes,
            };
            assert_invalid(dev.attention(&args), "`workspace`");
            args.workspace = BufferSlice {
                buf: fused.buf,
                offset: 0,
                bytes,
            };
            assert_invalid(dev.attention(&args), "`workspace`");
            dev.free(ws).unwrap();
        }
    }
}

#[test]
fn attention_rejects_bad_arguments() {
    let dev = device(2);
    let q = upload(&dev, DType::F32, 6, 8, &[0.1; 48]);
    let k = upload(&dev, DType::F32, 6, 8, &[0.1; 48]);
    let k16 = upload(&dev, DType::F16, 6, 8, &[0.1; 48]);
    let out = upload(&dev, DType::F32, 6, 8, &[0.0; 48]);
    let cu = [0u32, 2, 6];
    let cu_device = upload_i32(&dev, &[0, 2, 6]);
    let args = AttentionArgs {
        q,
        k,
        v: k,
        out,
        heads: 2,
        head_dim: 4,
        scale: 0.5,
        cu_seqlens: RSlice::from_slice(&cu),
        cu_seqlens_device: cu_device,
        max_seqlen: 4,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = dev.attention_workspace(&args).unwrap();
    let ws = dev.alloc(bytes).unwrap();
    let ok = AttentionArgs {
        workspace: BufferSlice {
            buf: ws,
            offset: 0,
            bytes,
        },
        ..args
    };
    dev.attention(&ok).unwrap();
    assert_invalid(dev.attention(&args), "`workspace`");
    for bad in [&[1u32, 6][..], &[0, 4, 2, 6], &[0, 2, 5], &[]] {
        assert_invalid(
            dev.attention(&AttentionArgs {
                cu_seqlens: RSlice::from_slice(bad),
                ..ok
            }),
            "`cu_seqlens`",
        );
        assert_invalid(
            dev.attention_workspace(&AttentionArgs {
                cu_seqlens: RSlice::from_slice(bad),
                ..ok
            }),
            "`cu_seqlens`",
        );
    }
    assert_invalid(dev.attention(&AttentionArgs { heads: 3, ..ok }), "`heads`");
    assert_invalid(
        dev.attention(&AttentionArgs {
            max_seqlen: 6,
            ..ok
        }),
        "`max_seqlen`",
    );
    // The device copy of the boundaries must say what the host copy says; the op finds out
    // when it runs.
    let disagreeing = upload_i32(&dev, &[0, 3, 6]);
    let result = dev
        .attention(&AttentionArgs {
            cu_seqlens_device: disagreeing,
            ..ok
        })
        .and_then(|()| dev.synchronize());
    assert_invalid(result, "`cu_seqlens_device`[1] = 3");
    assert_invalid(dev.attention(&AttentionArgs { k: k16, ..ok }), "`k`");
    assert_invalid(dev.attention(&AttentionArgs { out: q, ..ok }), "`out`");
    let short_v = MatRef { rows: 5, ..k };
    assert_invalid(dev.attention(&AttentionArgs { v: short_v, ..ok }), "`v`");
    let unknown = MatRef {
        buf: BufferHandle(4242),
        ..q
    };
    assert_invalid(dev.attention(&AttentionArgs { q: unknown, ..ok }), "`q`");
}

/// A device on the AVX2 tier, whose native bf16 kernel packs constant weights; `None` where
/// the CPU lacks it.
fn avx2_device(capacity: &str) -> Option<Device> {
    if !tiers().contains(&Tier::Avx2) {
        eprintln!("skipped: this CPU has no AVX2");
        return None;
    }
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let options = [("threads", "1"), ("capacity", capacity), ("isa", "avx2")];
    let options: Vec<(String, String)> = options
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Some(plugin.open(0, &options).unwrap())
}

/// A constant weight that the same call also reads as `a` (or `bias`) must not lose its bytes
/// to the packed copy while the call still reads them.
#[test]
fn a_constant_weight_read_as_another_operand_of_the_same_product_keeps_its_bytes() {
    let Some(dev) = avx2_device("64MiB") else {
        return;
    };
    // Whole pages of weight, so that a kept copy would give them back to the OS.
    let n = 128;
    let mut rng = Rng::new(41);
    let w = upload(&dev, DType::BF16, n, n, &rng.vec(n * n, DType::BF16, 1.0));
    let bias = MatRef { rows: 1, ..w };
    let product = |bias: MatRef, constant: bool| {
        let out = upload(&dev, DType::BF16, n, n, &vec![0.0; n * n]);
        dev.gemm(&GemmArgs {
            a: w,
            w,
            bias,
            out,
            activation: Activation::NONE,
            accumulate: false,
            w_transposed: false,
            w_constant: constant,
            workspace: BufferSlice::EMPTY,
        })
        .unwrap();
        let got = download(&dev, &out);
        dev.free(out.buf).unwrap();
        got
    };
    for bias in [MatRef::NONE, bias] {
        let plain = product(bias, false);
        assert!(plain.iter().any(|v| *v != 0.0));
        assert_eq!(product(bias, true), plain, "bias {:?}", bias.buf);
        // And again, now that any copy would exist.
        assert_eq!(product(bias, true), plain, "bias {:?}, repeated", bias.buf);
    }
}

/// Capacity taken by packed weights (which `mem_info` counts) is not offered again by `alloc`.
#[test]
fn alloc_counts_the_capacity_packed_weights_take() {
    let Some(dev) = avx2_device("4MiB") else {
        return;
    };
    // Rows with gaps: the packed copy sits beside the weight, all of it extra.
    let (m, n, k) = (2, 256, 256);
    let w = upload_strided(&dev, DType::BF16, n, k, 0, 64, &vec![0.5; n * k]);
    let a = upload(&dev, DType::BF16, m, k, &vec![1.0; m * k]);
    let out = upload(&dev, DType::BF16, m, n, &vec![0.0; m * n]);
    dev.gemm(&GemmArgs {
        a,
        w,
        bias: MatRef::NONE,
        out,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: true,
        workspace: BufferSlice::EMPTY,
    })
    .unwrap();
    dev.synchronize().unwrap();
    assert!(dev.memory_report().unwrap().held_bytes() > 0);
    let free = dev.mem_info().unwrap().free;
    let err = dev.alloc(free + 1).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let buf = dev.alloc(free).unwrap();
    dev.free(buf).unwrap();
}

/// `gather_rows` takes a source of any dtype, as the call's check does: integer rows are
/// copied as they are.
#[test]
fn gather_rows_copies_integer_rows() {
    let dev = device(2);
    let indices = upload_i32(&dev, &[2, 0, 2]);
    let src_values: Vec<i32> = (0..12).map(|i| i * 1_000_003 - 7).collect();
    let src_bytes: Vec<u8> = src_values.iter().flat_map(|v| v.to_le_bytes()).collect();
    for (dtype, cols) in [(DType::I32, 4u64), (DType::U8, 16)] {
        let src_buf = dev.alloc(48).unwrap();
        dev.write(src_buf, 0, &src_bytes).unwrap();
        let row_bytes = (cols * size(dtype)) as usize;
        let out_buf = dev.alloc(48).unwrap();
        dev.gather_rows(&GatherArgs {
            src: MatRef::contiguous(src_buf, 0, dtype, 3, cols),
            out: MatRef::contiguous(out_buf, 0, dtype, 3, cols),
            indices,
            workspace: BufferSlice::EMPTY,
        })
        .unwrap();
        dev.synchronize().unwrap();
        let mut got = vec![0u8; 48];
        dev.read(out_buf, 0, &mut got).unwrap();
        let want: Vec<u8> = [2, 0, 2]
            .iter()
            .flat_map(|r| src_bytes[r * row_bytes..][..row_bytes].to_vec())
            .collect();
        assert_eq!(got, want, "{dtype}");
        dev.free(src_buf).unwrap();
        dev.free(out_buf).unwrap();
    }
}

/// The shapes-only workspace query takes shapes no buffer could hold: a head dimension whose
/// workspace cannot be addressed is refused, not a panic or a wrapped size.
#[test]
fn attention_workspace_refuses_a_head_dim_too_large_to_address() {
    let dev = device(2);
    let head_dim = 1u64 << 58;
    let view = MatRef::contiguous(BufferHandle(0), 0, DType::BF16, 1, head_dim);
    let cu = [0u32, 1];
    let args = AttentionArgs {
        q: view,
        k: view,
        v: view,
        out: view,
        heads: 1,
        head_dim,
        scale: 0.5,
        cu_seqlens: RSlice::from_slice(&cu),
        cu_seqlens_device: MatRef::vector(BufferHandle(0), 0, DType::I32, 2),
        max_seqlen: 1,
        workspace: BufferSlice::EMPTY,
    };
    assert_invalid(dev.attention_workspace(&args), "too large");
}
