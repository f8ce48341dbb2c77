//! Elementwise ops and row movement: activations, binary ops (with a broadcast row), casts
//! between the float types, and row gathers by device indices (a bad index is flagged in the
//! device status word and reported at the next synchronisation).
//!
//! Also the open-time check of the elementwise kernels' four-columns-per-thread path (these ops',
//! the norms', rotary's and the GEMM epilogue's) against their one-column path, which decides
//! whether the four-wide path serves ([`super::lanes`]).

use std::sync::atomic::Ordering;

use iris_plugin::Backend;
use iris_plugin::abi::{
    Activation, ActivationArgs, BinaryArgs, BinaryOp, BufferHandle, BufferSlice, CastArgs, DType,
    GatherArgs, GemmArgs, MatRef, NormArgs, PluginError, RotaryArgs,
};
use iris_plugin::conformance::decode;
use iris_plugin::validate;

use super::attention::check_values;
use super::{Access, THREADS, WIDE_LANES, addr, dim, dtype_name, grid_2d, kernel_args, lanes_grid};
use crate::device::{BF16_COMPUTE_CAPABILITY, CudaDevice};
use crate::usize_of;

/// Rows and columns of the open-time check's operands: columns a multiple of four, one rotary
/// head of 64.
const CHECK_ROWS: u64 = 8;
const CHECK_COLS: u64 = 64;

kernel_args! {
    /// `activation_<dtype>(x, xs, out, os, rows, cols, kind, lanes)`.
    struct ActivationKernel {
        x: u64, xs: i64, out: u64, os: i64, rows: i64, cols: i64, kind: i32, lanes: i32,
    }
}

kernel_args! {
    /// `binary_<dtype>(a, as, b, bs, out, os, rows, cols, op, lanes)`: `bs` 0 broadcasts b's
    /// row.
    struct BinaryKernel {
        a: u64, a_stride: i64, b: u64, b_stride: i64, out: u64, os: i64, rows: i64, cols: i64,
        op: i32, lanes: i32,
    }
}

kernel_args! {
    /// `cast_<from>_<to>(src, ss, out, os, rows, cols, lanes)`.
    struct CastKernel { src: u64, ss: i64, out: u64, os: i64, rows: i64, cols: i64, lanes: i32 }
}

kernel_args! {
    /// `gather_b<width>(src, ss, src_rows, out, os, indices, rows, cols, status)`.
    struct GatherKernel {
        src: u64, ss: i64, src_rows: i64, out: u64, os: i64, indices: u64, rows: i64, cols: i64,
        status: u64,
    }
}

impl CudaDevice {
    pub(crate) fn activation_impl(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        let op = "activation";
        let (x, out) = self.with_checker(op, |check| validate::activation(check, args))?;
        let compute = self.compute(op)?;
        if x.is_empty() {
            return Ok(());
        }
        let (x_addr, out_addr) = (addr(self, op, &x)?, addr(self, op, &out)?);
        let (rows, cols) = (x.rows as u64, x.cols as u64);
        let lanes = compute.lanes(
            rows,
            cols,
            &[Access::of(x_addr, &x), Access::of(out_addr, &out)],
        );
        let mut launch = ActivationKernel {
            x: x_addr,
            xs: dim(x.stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(x.rows),
            cols: dim(x.cols),
            kind: i32::try_from(args.activation.0).unwrap_or(0),
            lanes: lanes as i32,
        };
        let name = format!("activation_{}", dtype_name(x.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }

    pub(crate) fn binary_impl(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        let op = "binary";
        let checked = self.with_checker(op, |check| validate::binary(check, args))?;
        let compute = self.compute(op)?;
        let (a, b, out) = (checked.a, checked.b, checked.out);
        if a.is_empty() {
            return Ok(());
        }
        let (a_addr, b_addr, out_addr) = (
            addr(self, op, &a)?,
            addr(self, op, &b)?,
            addr(self, op, &out)?,
        );
        let b_stride = if checked.broadcast { 0 } else { b.stride };
        let (rows, cols) = (a.rows as u64, a.cols as u64);
        let b_access = Access {
            stride: b_stride as u64,
            ..Access::of(b_addr, &b)
        };
        let lanes = compute.lanes(
            rows,
            cols,
            &[Access::of(a_addr, &a), b_access, Access::of(out_addr, &out)],
        );
        let mut launch = BinaryKernel {
            a: a_addr,
            a_stride: dim(a.stride),
            b: b_addr,
            b_stride: dim(b_stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(a.rows),
            cols: dim(a.cols),
            op: i32::try_from(args.op.0).unwrap_or(0),
            lanes: lanes as i32,
        };
        let name = format!("binary_{}", dtype_name(a.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }

    pub(crate) fn gather_impl(&self, args: &GatherArgs) -> Result<(), PluginError> {
        let op = "gather_rows";
        let (src, out, indices) =
            self.with_checker(op, |check| validate::gather_rows(check, args))?;
        let compute = self.compute(op)?;
        if out.is_empty() {
            return Ok(());
        }
        let width = match src.dtype.size() {
            Some(1) => "b1",
            Some(2) => "b2",
            _ => "b4",
        };
        let mut launch = GatherKernel {
            src: addr(self, op, &src)?,
            ss: dim(src.stride),
            src_rows: dim(src.rows),
            out: addr(self, op, &out)?,
            os: dim(out.stride),
            indices: addr(self, op, &indices)?,
            rows: dim(out.rows),
            cols: dim(out.cols),
            status: compute.status.ptr,
        };
        compute
            .launch(
                self.cu_stream(),
                &format!("gather_{width}"),
                grid_2d(out.rows as u64, out.cols as u64),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))?;
        compute.status_may_change();
        Ok(())
    }

    pub(crate) fn cast_impl(&self, args: &CastArgs) -> Result<(), PluginError> {
        let op = "cast";
        let (src, out) = self.with_checker(op, |check| validate::cast(check, args))?;
        let compute = self.compute(op)?;
        if src.is_empty() || out.same_as(&src) {
            return Ok(());
        }
        let (src_addr, out_addr) = (addr(self, op, &src)?, addr(self, op, &out)?);
        let (rows, cols) = (src.rows as u64, src.cols as u64);
        let lanes = compute.lanes(
            rows,
            cols,
            &[Access::of(src_addr, &src), Access::of(out_addr, &out)],
        );
        let mut launch = CastKernel {
            src: src_addr,
            ss: dim(src.stride),
            out: out_addr,
            os: dim(out.stride),
            rows: dim(src.rows),
            cols: dim(src.cols),
            lanes: lanes as i32,
        };
        let name = format!("cast_{}_{}", dtype_name(src.dtype), dtype_name(out.dtype));
        compute
            .launch(
                self.cu_stream(),
                &name,
                lanes_grid(rows, cols, lanes),
                THREADS,
                &mut launch,
            )
            .map_err(|err| err.into_plugin(op))
    }
}

/// One kernel of the open-time check, as its op runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    Activation,
    Binary,
    Cast,
    Rotary,
    GemmEpilogue,
    LayerNorm,
}

impl Checked {
    const ALL: [Checked; 6] = [
        Checked::Activation,
        Checked::Binary,
        Checked::Cast,
        Checked::Rotary,
        Checked::GemmEpilogue,
        Checked::LayerNorm,
    ];

    fn name(self) -> &'static str {
        match self {
            Checked::Activation => "activation",
            Checked::Binary => "binary",
            Checked::Cast => "cast",
            Checked::Rotary => "rotary",
            Checked::GemmEpilogue => "gemm_epilogue",
            Checked::LayerNorm => "norm",
        }
    }

    /// The dtype of this kernel's output in the check of `dtype`: the cast's is the other one.
    fn out_dtype(self, dtype: DType) -> DType {
        match (self, dtype) {
            (Checked::Cast, DType::F32) => DType::BF16,
            (Checked::Cast, _) => DType::F32,
            _ => dtype,
        }
    }
}

/// The check's operands in one dtype.
struct CheckOperands {
    dtype: DType,
    x: BufferHandle,
    y: BufferHandle,
    w: BufferHandle,
    bias: BufferHandle,
    tables: BufferHandle,
    workspace: BufferSlice,
}

impl CheckOperands {
    /// The check's GEMM: `out = silu(x · wᵀ + bias) + out`, whose activation and accumulation
    /// the epilogue kernel computes from the library's f32 product.
    fn gemm_args(&self, out: BufferHandle) -> GemmArgs {
        let dtype = self.dtype;
        GemmArgs {
            a: MatRef::contiguous(self.x, 0, dtype, CHECK_ROWS, CHECK_COLS),
            w: MatRef::contiguous(self.w, 0, dtype, CHECK_COLS, CHECK_COLS),
            bias: MatRef::contiguous(self.bias, 0, dtype, 1, CHECK_COLS),
            out: MatRef::contiguous(out, 0, dtype, CHECK_ROWS, CHECK_COLS),
            activation: Activation::SILU,
            accumulate: true,
            w_transposed: false,
            w_constant: true,
            workspace: self.workspace,
        }
    }
}

impl CudaDevice {
    /// Runs every elementwise kernel four columns per thread and one column per thread on the
    /// same inputs, in f32, f16 and bf16, and returns the kernels whose results differed (empty:
    /// the four-wide path may serve). The kernels do the same arithmetic per element on both
    /// paths, so their results must be the same bits; norms sum a thread's four columns before
    /// the block's sum, so theirs may differ by a few units in the last place. The compute's
    /// width cap is left at one; the caller sets it from the answer. Buffers allocated go into
    /// `buffers`.
    pub(crate) fn check_elementwise_lanes(
        &self,
        buffers: &mut Vec<BufferHandle>,
    ) -> Result<Vec<String>, PluginError> {
        let op = "open";
        let compute = self.compute(op)?;
        let mut alloc = |bytes: u64| self.alloc_for_open(buffers, bytes);
        let n = CHECK_ROWS * CHECK_COLS;
        let mut differing = Vec::new();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let size = dtype.size().unwrap_or(4);
            let operands = CheckOperands {
                dtype,
                x: alloc(n * size)?,
                y: alloc(n * size)?,
                w: alloc(CHECK_COLS * CHECK_COLS * size)?,
                bias: alloc(CHECK_COLS * size)?,
                tables: alloc(2 * n * 4)?,
                workspace: BufferSlice::EMPTY,
            };
            self.write(operands.x, 0, &check_input(dtype, n, 1))?;
            self.write(operands.y, 0, &check_input(dtype, n, 2))?;
            self.write(
                operands.w,
                0,
                &check_input(dtype, CHECK_COLS * CHECK_COLS, 3),
            )?;
            self.write(operands.bias, 0, &check_input(dtype, CHECK_COLS, 4))?;
            self.write(operands.tables, 0, &check_input(DType::F32, 2 * n, 5))?;
            // cuBLASLt has no bf16 GEMM before compute capability 8.0 (the device offers none).
            let gemm_runs = dtype != DType::BF16 || self.info.cc >= BF16_COMPUTE_CAPABILITY;
            let bytes = if gemm_runs {
                self.gemm_workspace_impl(&operands.gemm_args(operands.x))?
            } else {
                0
            };
            let operands = CheckOperands {
                workspace: BufferSlice {
                    buf: alloc(bytes.max(1))?,
                    offset: 0,
                    bytes,
                },
                ..operands
            };
            // Outputs of either dtype the cast writes (4 bytes an element at most).
            let outs = [alloc(n * 4)?, alloc(n * 4)?];
            for kernel in Checked::ALL {
                if kernel == Checked::GemmEpilogue && !gemm_runs {
                    continue;
                }
                let out_dtype = kernel.out_dtype(dtype);
                let mut results = Vec::new();
                for (lanes, out, pattern) in [(1, outs[0], 0x00u8), (WIDE_LANES, outs[1], 0xff)] {
                    // Each output starts with its own pattern, so that elements a path leaves
                    // unwritten differ too; rotary and the accumulating epilogue start from
                    // their input.
                    match kernel {
                        Checked::Rotary => self.write(out, 0, &check_input(dtype, n, 1))?,
                        Checked::GemmEpilogue => self.write(out, 0, &check_input(dtype, n, 2))?,
                        _ => self.write(out, 0, &vec![pattern; usize_of(n * 4)])?,
                    }
                    compute.lanes_cap.store(lanes, Ordering::Release);
                    let ran = self.run_checked(kernel, &operands, out);
                    compute.lanes_cap.store(1, Ordering::Release);
                    ran?;
                    let mut bytes = vec![0u8; usize_of(n * out_dtype.size().unwrap_or(4))];
                    self.read(out, 0, &mut bytes)?;
                    results.push(decode(out_dtype, &bytes));
                }
                let [narrow, wide] = &results[..] else {
                    continue;
                };
                let bad = narrow
                    .iter()
                    .zip(wide)
                    .filter(|&(a, b)| {
                        if kernel == Checked::LayerNorm {
                            // A few units in the last place of the larger of the value and 1.
                            (a - b).abs() > 8.0 * unit(out_dtype) * a.abs().max(1.0)
                                || a.is_nan() != b.is_nan()
                        } else {
                            a.to_bits() != b.to_bits()
                        }
                    })
                    .count();
                if bad > 0 {
                    differing.push(format!(
                        "{}_{} ({bad} of {n} outputs differ)",
                        kernel.name(),
                        dtype_name(dtype)
                    ));
                }
            }
        }
        Ok(differing)
    }

    /// Runs one kernel of the check into `out`.
    fn run_checked(
        &self,
        kernel: Checked,
        operands: &CheckOperands,
        out: BufferHandle,
    ) -> Result<(), PluginError> {
        let dtype = operands.dtype;
        let mat = |buf| MatRef::contiguous(buf, 0, dtype, CHECK_ROWS, CHECK_COLS);
        let row = |buf| MatRef::contiguous(buf, 0, dtype, 1, CHECK_COLS);
        let table = |offset| {
            MatRef::contiguous(operands.tables, offset, DType::F32, CHECK_ROWS, CHECK_COLS)
        };
        match kernel {
            Checked::Activation => self.activation_impl(&ActivationArgs {
                x: mat(operands.x),
                out: mat(out),
                activation: Activation::GELU_TANH,
                workspace: BufferSlice::EMPTY,
            }),
            Checked::Binary => self.binary_impl(&BinaryArgs {
                a: mat(operands.x),
                b: mat(operands.y),
                out: mat(out),
                op: BinaryOp::MUL,
                workspace: BufferSlice::EMPTY,
            }),
            Checked::Cast => self.cast_impl(&CastArgs {
                src: mat(operands.x),
                out: MatRef::contiguous(out, 0, kernel.out_dtype(dtype), CHECK_ROWS, CHECK_COLS),
                workspace: BufferSlice::EMPTY,
            }),
            Checked::Rotary => self.rotary_impl(&RotaryArgs {
                x: mat(out),
                heads: 1,
                head_dim: CHECK_COLS,
                cos: table(0),
                sin: table(CHECK_ROWS * CHECK_COLS * 4),
                workspace: BufferSlice::EMPTY,
            }),
            Checked::GemmEpilogue => self.gemm_impl(&operands.gemm_args(out)),
            Checked::LayerNorm => self.norm_impl(
                "layer_norm",
                &NormArgs {
                    x: mat(operands.x),
                    weight: row(operands.bias),
                    bias: row(operands.y),
                    out: mat(out),
                    eps: 1e-6,
                    workspace: BufferSlice::EMPTY,
                },
                false,
            ),
        }
    }
}

/// `count` values of `dtype` for the check: [`check_values`]' bf16 patterns widened for f32.
fn check_input(dtype: DType, count: u64, seed: u64) -> Vec<u8> {
    if dtype != DType::F32 {
        return check_values(dtype, count, seed);
    }
    check_values(DType::BF16, count, seed)
        .chunks_exact(2)
        .flat_map(|pair| (u32::from(u16::from_le_bytes([pair[0], pair[1]])) << 16).to_le_bytes())
        .collect()
}

/// The spacing of `dtype`'s values at 1.
pub(crate) fn unit(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 2f32.powi(-10),
        DType::BF16 => 2f32.powi(-7),
        _ => f32::EPSILON,
    }
}
