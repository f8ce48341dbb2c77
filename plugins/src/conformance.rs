//! The conformance suite: one set of checks run against any device plugin, at the shapes real
//! vision towers use.
//!
//! [`run`] takes a loaded [`Plugin`] and one of its opened [`Device`]s and returns a [`Report`]
//! of named [`Check`]s. It covers, in order: the plugin's identity and ABI version; the device
//! description; memory accounting (the plugin's own report exactly, the device-wide free
//! figure within a tolerance, since other processes share a GPU); the error codes of bad calls;
//! transfers, fills and batched copies; the in-order queue (many ops then one read, a free
//! right after enqueueing work that reads the buffer, a host slice reused right after `write`,
//! host staging with fences); and each op, for every float dtype the device lists, against a
//! host reference computed in `f64`: gemm at tower sizes (1024x1280x3840, 1024x5120x1280) and
//! odd ones (333x77x129) with strided, offset and transposed operands, bias, every activation
//! and accumulation; attention with head dims 64, 72, 80 and 128 over segments of 1, 63, 257
//! and 1024 tokens in one call, and with queries and keys whose unscaled products overflow
//! f16; norms at widths 1152, 1280 and 3584; rotary from tables;
//! gather with repeated, out-of-order device indices; cast between every pair of dtypes.
//!
//! An op the device does not list in its description and that answers
//! [`ErrorCode::UNSUPPORTED`] is reported as [`Status::Unsupported`], so a new backend can pass
//! the suite with memory and transfers alone and add ops one at a time. An op that is listed but
//! fails, or an unlisted op that fails with another code, is a [`Status::Fail`].
//!
//! Outputs are compared with a tolerance that depends on the storage dtype (see
//! [`tolerance`]): the reference computes from the inputs as the device stores them (rounded to
//! the dtype), so the tolerance only covers the device's own rounding. Large outputs are checked
//! at a deterministic sample of positions (corners included) so that the reference stays cheap.
//! Every op check records the time of the op itself (enqueue to `synchronize`) and the
//! throughput it achieved.
//!
//! The suite frees every buffer it allocates; its last check verifies that the plugin's own
//! accounting returned exactly to where it started.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::abi::{
    ABI_MAJOR, ABI_MIN_MINOR, Activation, ActivationArgs, AttentionArgs, BinaryArgs, BinaryOp,
    BufferHandle, BufferSlice, CastArgs, CopyRegion, DType, ErrorCode, FillArgs, GatherArgs,
    GemmArgs, MatRef, NormArgs, OpKind, RotaryArgs,
};
use crate::host::{Device, DeviceError, Plugin};

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", content = "detail", rename_all = "lowercase")]
pub enum Status {
    /// The device behaved as the ABI requires.
    Pass,
    /// The device did not; the text says how.
    Fail(String),
    /// The device does not implement the op (it is not listed and answered "unsupported").
    Unsupported(String),
}

impl Status {
    /// `pass`, `fail` or `unsupported`.
    pub fn label(&self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail(_) => "fail",
            Status::Unsupported(_) => "unsupported",
        }
    }

    /// The explanation of a failure or of an unsupported op; empty for a pass.
    pub fn detail(&self) -> &str {
        match self {
            Status::Pass => "",
            Status::Fail(detail) | Status::Unsupported(detail) => detail,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Pass => f.write_str("pass"),
            Status::Fail(detail) => write!(f, "fail: {detail}"),
            Status::Unsupported(detail) => write!(f, "unsupported: {detail}"),
        }
    }
}

/// How fast an op check ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timing {
    /// Seconds from enqueueing the op to the end of `synchronize`.
    pub seconds: f64,
    /// Work per second, in `unit`.
    pub throughput: f64,
    /// `GFLOP/s` for matrix products and attention, `GB/s` (bytes read and written) for the
    /// rest.
    pub unit: &'static str,
}

/// One named check and its outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Dotted name, e.g. `op.gemm.tower_qkv.bf16`.
    pub name: String,
    /// The outcome.
    #[serde(flatten)]
    pub status: Status,
    /// Time and throughput of the op, for op checks that ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timing: Option<Timing>,
}

/// Every check of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Checks in the order they ran.
    pub checks: Vec<Check>,
}

/// Checks of optional capabilities, where "unsupported" is a complete answer: iris falls back
/// (host staging through ordinary memory, pixels staged instead of lent with `write_async`, no
/// device memory kept for reuse to give back at `trim`).
pub const OPTIONAL_CHECKS: &[&str] = &["queue.host_staging", "queue.write_async", "memory.trim"];

impl Report {
    /// Number of passed checks.
    pub fn passed(&self) -> usize {
        self.count(|status| matches!(status, Status::Pass))
    }

    /// Number of failed checks.
    pub fn failed(&self) -> usize {
        self.count(|status| matches!(status, Status::Fail(_)))
    }

    /// Number of unsupported ops.
    pub fn unsupported(&self) -> usize {
        self.count(|status| matches!(status, Status::Unsupported(_)))
    }

    /// Names of the unsupported checks that are not [`OPTIONAL_CHECKS`]: what the device lacks
    /// of what iris needs from it.
    pub fn missing(&self) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|c| matches!(c.status, Status::Unsupported(_)))
            .map(|c| c.name.as_str())
            .filter(|name| !OPTIONAL_CHECKS.contains(name))
            .collect()
    }

    /// Whether no check failed.
    pub fn is_ok(&self) -> bool {
        self.failed() == 0
    }

    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks
            .iter()
            .filter(|check| matches!(check.status, Status::Fail(_)))
    }

    fn count(&self, pred: impl Fn(&Status) -> bool) -> usize {
        self.checks
            .iter()
            .filter(|check| pred(&check.status))
            .count()
    }
}

/// Relative tolerance of op outputs stored in `dtype`: `|got - want| <= tol · max(|want|, 1)`.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 1e-2,
        DType::BF16 => 3e-2,
        _ => 1e-4,
    }
}

/// Device-wide free memory may move by this much during the suite for reasons outside the
/// plugin (other processes on a shared GPU, the driver's own bookkeeping): the larger of 64 MiB
/// and 1% of the device.
pub fn free_memory_tolerance(total: u64) -> u64 {
    (64u64 << 20).max(total / 100)
}

/// Runs every check against `device`, an opened device of `plugin`.
pub fn run(plugin: &Plugin, device: &Arc<Device>) -> Report {
    let mut suite = Suite {
        device,
        report: Report::default(),
    };
    let start_report = device.memory_report();
    let start_info = device.mem_info();
    suite.record("plugin.identity", || check_identity(plugin, device));
    suite.record("device.description", || check_description(device));
    suite.record("device.synchronize", || {
        device.synchronize().map_err(fail_with("synchronize"))
    });
    suite.record("memory.accounting", || check_accounting(device));
    suite.record("memory.out_of_memory", || check_out_of_memory(device));
    suite.record("memory.zero_size", || {
        expect_code(
            "alloc(0)",
            ErrorCode::INVALID_ARGUMENT,
            device.alloc(0).map(|buf| {
                let _ = device.free(buf);
            }),
        )
    });
    suite.record("memory.double_free", || check_double_free(device));
    suite.record("memory.unknown_handle", || check_unknown_handle(device));
    suite.record("transfer.round_trip", || check_round_trip(device));
    suite.record("transfer.copy_batch", || check_copy_batch(device));
    suite.record("transfer.fill", || check_fill(device));
    suite.record("transfer.out_of_range", || check_out_of_range(device));
    suite.record("queue.many_ops_then_read", || check_many_ops(device));
    suite.record("queue.free_after_enqueue", || {
        check_free_after_enqueue(device)
    });
    suite.record("queue.write_reuses_host_slice", || {
        check_write_reuse(device)
    });
    suite.record("queue.host_staging", || check_staging(device));
    suite.record("queue.write_async", || check_write_async(device));
    suite.record("errors.bad_op_arguments", || check_bad_op_arguments(device));

    let dtypes: Vec<DType> = device
        .description()
        .dtypes
        .iter()
        .copied()
        .filter(|dtype| dtype.is_float())
        .collect();
    for &dtype in &dtypes {
        suite.op_checks(dtype);
    }
    for &from in &dtypes {
        for &to in &dtypes {
            let name = format!("op.cast.{from}_to_{to}");
            suite.timed(&name, || case_cast(device, from, to));
        }
    }

    suite.record("memory.trim", || check_trim(device));
    suite.record("memory.all_freed", || {
        let start = start_report.clone().map_err(fail_with("memory_report"))?;
        let start_info = start_info.map_err(fail_with("mem_info"))?;
        device.synchronize().map_err(fail_with("synchronize"))?;
        let end = device.memory_report().map_err(fail_with("memory_report"))?;
        if (end.allocated, end.buffers) != (start.allocated, start.buffers) {
            return Err(fail(format!(
                "the plugin counted {} bytes in {} buffers before the suite and {} bytes in {} after it",
                start.allocated, start.buffers, end.allocated, end.buffers
            )));
        }
        let end_info = device.mem_info().map_err(fail_with("mem_info"))?;
        let tol = free_memory_tolerance(end_info.total);
        if end_info.free.abs_diff(start_info.free) > tol {
            return Err(fail(format!(
                "device free memory was {} bytes before the suite and is {} after it (tolerance {tol})",
                start_info.free, end_info.free
            )));
        }
        Ok(())
    });
    suite.report
}

// ---------------------------------------------------------------------------------------------
// Suite plumbing
// ---------------------------------------------------------------------------------------------

/// Why a check did not pass.
enum Problem {
    Fail(String),
    Unsupported(String),
}

type Outcome = Result<(), Problem>;

/// What an op check measured: its time and the work done (flops or bytes).
struct Measured {
    seconds: f64,
    work: f64,
    unit: &'static str,
}

struct Suite<'d> {
    device: &'d Arc<Device>,
    report: Report,
}

impl Suite<'_> {
    fn record(&mut self, name: &str, check: impl FnOnce() -> Outcome) {
        let status = status_of(check());
        self.report.checks.push(Check {
            name: name.to_owned(),
            status,
            timing: None,
        });
    }

    fn timed(&mut self, name: &str, check: impl FnOnce() -> Result<Measured, Problem>) {
        let (status, timing) = match check() {
            Ok(measured) => {
                let throughput = if measured.seconds > 0.0 {
                    measured.work / measured.seconds / 1e9
                } else {
                    0.0
                };
                let timing = Timing {
                    seconds: measured.seconds,
                    throughput,
                    unit: measured.unit,
                };
                (Status::Pass, Some(timing))
            }
            Err(problem) => (status_of(Err(problem)), None),
        };
        self.report.checks.push(Check {
            name: name.to_owned(),
            status,
            timing,
        });
    }

    fn op_checks(&mut self, dtype: DType) {
        let device = self.device;
        for case in GEMM_CASES {
            let name = format!("op.gemm.{}.{dtype}", case.name);
            self.timed(&name, || case_gemm(device, dtype, case));
        }
        for &width in &NORM_WIDTHS {
            for rms in [false, true] {
                let op = if rms { "rms_norm" } else { "layer_norm" };
                self.timed(&format!("op.{op}.w{width}.{dtype}"), || {
                    case_norm(device, dtype, rms, width, false)
                });
            }
        }
        for rms in [false, true] {
            let op = if rms { "rms_norm" } else { "layer_norm" };
            self.timed(&format!("op.{op}.in_place.{dtype}"), || {
                case_norm(device, dtype, rms, 1280, true)
            });
        }
        // `NONE` is gemm's "no activation", not an activation function of its own.
        for activation in Activation::ALL
            .into_iter()
            .filter(|a| *a != Activation::NONE)
        {
            let act_name = activation.name().unwrap_or("unknown");
            self.timed(&format!("op.activation.{act_name}.{dtype}"), || {
                case_activation(device, dtype, activation)
            });
        }
        for op in [BinaryOp::ADD, BinaryOp::MUL] {
            let op_name = op.name().unwrap_or("unknown");
            for broadcast in [false, true] {
                let shape = if broadcast { "broadcast" } else { "same_shape" };
                self.timed(&format!("op.binary.{op_name}_{shape}.{dtype}"), || {
                    case_binary(device, dtype, op, broadcast)
                });
            }
        }
        for head_dim in [72, 80] {
            self.timed(&format!("op.rotary.d{head_dim}.{dtype}"), || {
                case_rotary(device, dtype, head_dim)
            });
        }
        for head_dim in ATTENTION_HEAD_DIMS {
            self.timed(&format!("op.attention.d{head_dim}.{dtype}"), || {
                case_attention(device, dtype, head_dim, false)
            });
        }
        self.timed(&format!("op.attention.d64.large_logits.{dtype}"), || {
            case_attention(device, dtype, 64, true)
        });
        self.timed(&format!("op.gather_rows.{dtype}"), || {
            case_gather(device, dtype)
        });
    }
}

fn status_of(outcome: Outcome) -> Status {
    match outcome {
        Ok(()) => Status::Pass,
        Err(Problem::Fail(detail)) => Status::Fail(detail),
        Err(Problem::Unsupported(detail)) => Status::Unsupported(detail),
    }
}

fn fail_with(what: &'static str) -> impl Fn(DeviceError) -> Problem {
    move |err| Problem::Fail(format!("{what}: {err}"))
}

fn fail(message: impl Into<String>) -> Problem {
    Problem::Fail(message.into())
}

/// Maps an op's result: "unsupported" from an op the device does not list is not a failure.
fn op_result<T>(device: &Device, op: OpKind, result: Result<T, DeviceError>) -> Result<T, Problem> {
    result.map_err(|err| {
        if err.code == ErrorCode::UNSUPPORTED && !device.supports(op) {
            Problem::Unsupported(err.message)
        } else if err.code == ErrorCode::UNSUPPORTED {
            Problem::Fail(format!(
                "the device lists `{op}` in its description but answered: {err}"
            ))
        } else {
            Problem::Fail(err.to_string())
        }
    })
}

/// Expects `result` to fail with `code`.
fn expect_code<T>(what: &str, code: ErrorCode, result: Result<T, DeviceError>) -> Outcome {
    match result {
        Ok(_) => Err(fail(format!(
            "{what} succeeded; expected a {} error",
            code.name()
        ))),
        Err(err) if err.code == code => Ok(()),
        Err(err) => Err(fail(format!(
            "{what}: expected a {} error, got {err}",
            code.name()
        ))),
    }
}

/// Runs an op and waits for it; the seconds it took.
fn time_op(
    device: &Device,
    op: OpKind,
    call: impl FnOnce() -> Result<(), DeviceError>,
) -> Result<f64, Problem> {
    // Earlier uploads must not count in the op's time.
    device.synchronize().map_err(fail_with("synchronize"))?;
    let started = Instant::now();
    op_result(device, op, call())?;
    device
        .synchronize()
        .map_err(fail_with("synchronize after the op"))?;
    Ok(started.elapsed().as_secs_f64())
}

/// Buffers of one check, freed when it ends (also on an early return).
struct Scratch<'d> {
    device: &'d Device,
    bufs: Vec<BufferHandle>,
}

impl<'d> Scratch<'d> {
    fn new(device: &'d Device) -> Self {
        Scratch {
            device,
            bufs: Vec::new(),
        }
    }

    fn alloc(&mut self, bytes: u64) -> Result<BufferHandle, Problem> {
        let buf = self
            .device
            .alloc(bytes.max(1))
            .map_err(fail_with("alloc"))?;
        self.bufs.push(buf);
        Ok(buf)
    }

    /// Uploads `values` as a `rows x cols` matrix of `dtype` at byte `offset` of a fresh
    /// buffer, with `row_stride` elements per row (padding filled with a sentinel); returns
    /// the view and the values as stored.
    fn upload_at(
        &mut self,
        dtype: DType,
        rows: u64,
        cols: u64,
        row_stride: u64,
        offset: u64,
        values: &[f32],
    ) -> Result<(MatRef, Vec<f32>), Problem> {
        let size = elem_size(dtype);
        let mut padded = vec![SENTINEL; index(rows * row_stride)];
        for r in 0..index(rows) {
            let c = index(cols);
            let dst = r * index(row_stride);
            padded[dst..dst + c].copy_from_slice(&values[r * c..(r + 1) * c]);
        }
        let buf = self.alloc((offset + rows * row_stride * size).max(1))?;
        let bytes = encode(dtype, &padded);
        if !bytes.is_empty() {
            self.device
                .write(buf, offset, &bytes)
                .map_err(fail_with("write"))?;
        }
        let stored = values.iter().map(|&v| round_to(dtype, v)).collect();
        let mat = MatRef {
            buf,
            offset,
            dtype,
            rows,
            cols,
            row_stride,
        };
        Ok((mat, stored))
    }

    fn upload(
        &mut self,
        dtype: DType,
        rows: u64,
        cols: u64,
        values: &[f32],
    ) -> Result<(MatRef, Vec<f32>), Problem> {
        self.upload_at(dtype, rows, cols, cols, 0, values)
    }

    /// An i32 `[1, len]` vector on the device.
    fn upload_i32(&mut self, values: &[i32]) -> Result<MatRef, Problem> {
        let len = values.len() as u64;
        let buf = self.alloc(4 * len)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        if !bytes.is_empty() {
            self.device
                .write(buf, 0, &bytes)
                .map_err(fail_with("write"))?;
        }
        Ok(MatRef::vector(buf, 0, DType::I32, len))
    }

    /// A `rows x cols` output matrix, pre-filled with a sentinel so that an op that writes
    /// nothing cannot pass.
    fn output(&mut self, dtype: DType, rows: u64, cols: u64) -> Result<MatRef, Problem> {
        let values = vec![SENTINEL; index(rows * cols)];
        Ok(self.upload(dtype, rows, cols, &values)?.0)
    }

    /// A workspace of `bytes` (none when 0).
    fn workspace(&mut self, bytes: u64) -> Result<BufferSlice, Problem> {
        if bytes == 0 {
            return Ok(BufferSlice::EMPTY);
        }
        let buf = self.alloc(bytes)?;
        Ok(BufferSlice {
            buf,
            offset: 0,
            bytes,
        })
    }

    fn download(&self, mat: &MatRef) -> Result<Vec<f32>, Problem> {
        let (start, end) = mat
            .byte_range()
            .ok_or_else(|| fail("output view out of range"))?;
        let mut bytes = vec![0u8; index(end - start)];
        if !bytes.is_empty() {
            self.device
                .read(mat.buf, start, &mut bytes)
                .map_err(fail_with("read"))?;
        }
        let all = decode(mat.dtype, &bytes);
        let mut out = Vec::with_capacity(index(mat.rows * mat.cols));
        for r in 0..mat.rows {
            let at = index(r * mat.row_stride);
            out.extend_from_slice(&all[at..at + index(mat.cols)]);
        }
        Ok(out)
    }

    fn finish(mut self) -> Outcome {
        let mut first_error = None;
        for buf in std::mem::take(&mut self.bufs) {
            if let Err(err) = self.device.free(buf) {
                first_error.get_or_insert(fail(format!("free: {err}")));
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // Only reached with buffers left on an early return; the failure is already reported
        // and `memory.all_freed` catches a free that did not work.
        for buf in self.bufs.drain(..) {
            let _ = self.device.free(buf);
        }
    }
}

/// Written into outputs before an op runs.
const SENTINEL: f32 = 7.25;

fn elem_size(dtype: DType) -> u64 {
    // Callers only pass dtypes with a size (filtered in `run`).
    dtype.size().unwrap_or(4)
}

/// A host index from a device-side count; the suite's shapes fit in memory.
fn index(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// A host count as `f64` (exact below 2^53).
#[allow(clippy::cast_precision_loss)]
fn float(value: usize) -> f64 {
    value as f64
}

fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
    }
}

/// Little-endian values of `dtype` (f16, bf16, else f32) as f32: how the suite reads results,
/// and how a plugin may read its own checks' results.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

fn round_to(dtype: DType, value: f32) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(value).to_f32(),
        DType::BF16 => half::bf16::from_f32(value).to_f32(),
        _ => value,
    }
}

/// Compares device output with the reference at positions `at` (all when `None`):
/// `|got - want| <= tol · max(|want|, 1)`.
fn compare_at(tol: f64, got: &[f32], want: &dyn Fn(usize) -> f64, at: &[usize]) -> Outcome {
    let mut bad = 0usize;
    let mut first = None;
    for &i in at {
        let (g, w) = (f64::from(got[i]), want(i));
        // Written so that a NaN on either side fails.
        let within = (g - w).abs() <= tol * w.abs().max(1.0);
        if !within {
            bad += 1;
            first.get_or_insert((i, g, w));
        }
    }
    match first {
        None => Ok(()),
        Some((i, g, w)) => Err(fail(format!(
            "{bad} of {} checked values outside tolerance {tol:e}; first at index {i}: got {g}, expected {w}",
            at.len()
        ))),
    }
}

/// Compares every value.
fn compare_all(tol: f64, got: &[f32], want: &[f64]) -> Outcome {
    if got.len() != want.len() {
        return Err(fail(format!(
            "{} values read back, {} expected",
            got.len(),
            want.len()
        )));
    }
    let all: Vec<usize> = (0..got.len()).collect();
    compare_at(tol, got, &|i| want[i], &all)
}

/// Deterministic inputs in `[-scale, scale]` (xorshift; no dependency, same on every run).
fn values(seed: u64, len: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| (rng.unit() * 2.0 - 1.0) * scale).collect()
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In `[0, 1)`.
    fn unit(&mut self) -> f32 {
        // 24 random bits map exactly onto f32's mantissa.
        let bits = u32::try_from(self.next() >> 40).unwrap_or(0);
        #[allow(clippy::cast_precision_loss)]
        let unit = bits as f32 / (1u32 << 24) as f32;
        unit
    }

    fn below(&mut self, n: usize) -> usize {
        index(self.next() % (n as u64).max(1))
    }
}

/// Positions to check in a `rows x cols` output: every position when small, else the four
/// corners, the first and last row and column, and a pseudo-random sample.
fn sample(rows: usize, cols: usize, seed: u64) -> Vec<usize> {
    /// Up to this many outputs are checked in full.
    const FULL: usize = 1 << 16;
    /// Random positions checked in larger outputs.
    const SAMPLED: usize = 4096;
    if rows * cols <= FULL {
        return (0..rows * cols).collect();
    }
    let mut at: Vec<usize> = Vec::with_capacity(SAMPLED + 2 * (rows + cols));
    at.extend(0..cols);
    at.extend((0..cols).map(|c| (rows - 1) * cols + c));
    at.extend((0..rows).map(|r| r * cols));
    at.extend((0..rows).map(|r| r * cols + cols - 1));
    let mut rng = Rng::new(seed);
    at.extend((0..SAMPLED).map(|_| rng.below(rows * cols)));
    at.sort_unstable();
    at.dedup();
    at
}

// ---------------------------------------------------------------------------------------------
// Identity, description, memory, transfers, queue
// ---------------------------------------------------------------------------------------------

// `ABI_MIN_MINOR` is 0 today, so the minor check cannot fail yet; it matters once it is raised.
#[allow(clippy::absurd_extreme_comparisons)]
fn check_identity(plugin: &Plugin, device: &Device) -> Outcome {
    if plugin.name().trim().is_empty() {
        return Err(fail("the plugin reports an empty name"));
    }
    if plugin.version().trim().is_empty() {
        return Err(fail("the plugin reports an empty version"));
    }
    if plugin.abi_major() != ABI_MAJOR || plugin.abi_minor() < ABI_MIN_MINOR {
        return Err(fail(format!(
            "ABI {}.{} is outside this host's window {ABI_MAJOR}.{ABI_MIN_MINOR}+",
            plugin.abi_major(),
            plugin.abi_minor()
        )));
    }
    let probe = plugin.probe();
    if probe.device_count <= device.ordinal() {
        return Err(fail(format!(
            "the probe reports {} devices, but device {} is open",
            probe.device_count,
            device.ordinal()
        )));
    }
    Ok(())
}

fn check_description(device: &Device) -> Outcome {
    let desc = device.description();
    if desc.name.trim().is_empty() {
        return Err(fail("the device name is empty"));
    }
    for required in [DType::F32, DType::I32] {
        if !desc.dtypes.contains(&required) {
            return Err(fail(format!(
                "dtypes {:?} do not include {required}",
                desc.dtypes
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            )));
        }
    }
    if let Some(unknown) = desc.dtypes.iter().find(|dtype| dtype.size().is_none()) {
        return Err(fail(format!("dtype {unknown} is not defined by this ABI")));
    }
    if let Some(unknown) = desc.ops.iter().find(|op| op.name().is_none()) {
        return Err(fail(format!("op {unknown} is not defined by this ABI")));
    }
    if let Some((key, _)) = desc
        .properties
        .iter()
        .find(|(key, _)| key.trim().is_empty())
    {
        return Err(fail(format!("a property has an empty key `{key}`")));
    }
    let info = device.mem_info().map_err(fail_with("mem_info"))?;
    if info.total != desc.total_memory {
        return Err(fail(format!(
            "description says {} bytes of memory, mem_info says {}",
            desc.total_memory, info.total
        )));
    }
    if info.free > info.total {
        return Err(fail(format!(
            "mem_info reports {} bytes free of {} total",
            info.free, info.total
        )));
    }
    Ok(())
}

/// Bytes the accounting check allocates: large enough to show in a GPU's free figure, small
/// enough for any device.
const ACCOUNTING_BYTES: u64 = 256 << 20;

fn check_accounting(device: &Device) -> Outcome {
    device.synchronize().map_err(fail_with("synchronize"))?;
    let before = device.memory_report().map_err(fail_with("memory_report"))?;
    let info_before = device.mem_info().map_err(fail_with("mem_info"))?;
    let bytes = ACCOUNTING_BYTES.min(info_before.free / 4).max(1);
    let buf = device.alloc(bytes).map_err(fail_with("alloc"))?;
    let during = device.memory_report().map_err(fail_with("memory_report"));
    let info_during = device.mem_info().map_err(fail_with("mem_info"));
    let freed = device.free(buf).map_err(fail_with("free"));
    let (during, info_during) = (during?, info_during?);
    freed?;
    device.synchronize().map_err(fail_with("synchronize"))?;
    let after = device.memory_report().map_err(fail_with("memory_report"))?;
    let info_after = device.mem_info().map_err(fail_with("mem_info"))?;
    // Checked sums: the figures are the plugin's, and a wrapped or overflowing sum would
    // panic or compare nonsense instead of failing the check.
    if before.allocated.checked_add(bytes) != Some(during.allocated)
        || before.buffers.checked_add(1) != Some(during.buffers)
    {
        return Err(fail(format!(
            "after allocating {bytes} bytes the plugin counts {} bytes in {} buffers; it counted {} in {} before",
            during.allocated, during.buffers, before.allocated, before.buffers
        )));
    }
    if (after.allocated, after.buffers) != (before.allocated, before.buffers) {
        return Err(fail(format!(
            "after freeing, the plugin counts {} bytes in {} buffers; it counted {} in {} before",
            after.allocated, after.buffers, before.allocated, before.buffers
        )));
    }
    let tol = free_memory_tolerance(info_before.total);
    if info_before
        .free
        .saturating_sub(info_during.free)
        .saturating_add(tol)
        < bytes
    {
        return Err(fail(format!(
            "device free memory went from {} to {} bytes after allocating {bytes} bytes (tolerance {tol})",
            info_before.free, info_during.free
        )));
    }
    if info_after.free.abs_diff(info_before.free) > tol {
        return Err(fail(format!(
            "device free memory was {} bytes before allocating and {} after freeing (tolerance {tol})",
            info_before.free, info_after.free
        )));
    }
    if let Some((what, _)) = after.held.iter().find(|(what, _)| what.trim().is_empty()) {
        return Err(fail(format!(
            "an item of held memory has no name (`{what}`)"
        )));
    }
    Ok(())
}

fn check_out_of_memory(device: &Device) -> Outcome {
    let info = device.mem_info().map_err(fail_with("mem_info"))?;
    let bytes = info.total.saturating_add(1);
    let result = device.alloc(bytes);
    if let Ok(buf) = result {
        let _ = device.free(buf);
        return Err(fail(format!(
            "alloc({bytes}) succeeded on a device of {} bytes; expected out_of_memory",
            info.total
        )));
    }
    expect_code(
        &format!("alloc({bytes}) on a device of {} bytes", info.total),
        ErrorCode::OUT_OF_MEMORY,
        result,
    )
}

fn check_double_free(device: &Device) -> Outcome {
    let buf = device.alloc(64).map_err(fail_with("alloc"))?;
    device.free(buf).map_err(fail_with("first free"))?;
    expect_code("second free", ErrorCode::INVALID_ARGUMENT, device.free(buf))
}

/// A handle no plugin hands out in a short test run.
const UNKNOWN_HANDLE: BufferHandle = BufferHandle(u64::MAX - 7);

fn check_unknown_handle(device: &Device) -> Outcome {
    let code = ErrorCode::INVALID_ARGUMENT;
    expect_code("free(unknown)", code, device.free(UNKNOWN_HANDLE))?;
    expect_code(
        "write(unknown)",
        code,
        device.write(UNKNOWN_HANDLE, 0, &[1]),
    )?;
    let mut byte = [0u8; 1];
    expect_code(
        "read(unknown)",
        code,
        device.read(UNKNOWN_HANDLE, 0, &mut byte),
    )?;
    expect_code("fill(unknown)", code, device.zero(UNKNOWN_HANDLE, 0, 4))?;
    expect_code("free(null)", code, device.free(BufferHandle::NULL))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| u8::try_from(i % 251).unwrap_or(0).wrapping_mul(7) ^ seed)
        .collect()
}

fn read_all(device: &Device, buf: BufferHandle, len: usize) -> Result<Vec<u8>, Problem> {
    let mut bytes = vec![0u8; len];
    device.read(buf, 0, &mut bytes).map_err(fail_with("read"))?;
    Ok(bytes)
}

fn check_round_trip(device: &Device) -> Outcome {
    let mut scratch = Scratch::new(device);
    let buf = scratch.alloc(256)?;
    let mut expected = pattern(256, 0x5a);
    device
        .write(buf, 0, &expected)
        .map_err(fail_with("write"))?;
    let patch = pattern(40, 0xc3);
    device
        .write(buf, 100, &patch)
        .map_err(fail_with("write at offset 100"))?;
    expected[100..140].copy_from_slice(&patch);
    if read_all(device, buf, 256)? != expected {
        return Err(fail("read after write returned different bytes"));
    }
    let mut part = vec![0u8; 50];
    device
        .read(buf, 37, &mut part)
        .map_err(fail_with("read at offset 37"))?;
    if part != expected[37..87] {
        return Err(fail("read at offset 37 returned different bytes"));
    }
    scratch.finish()
}

fn region(
    src: BufferHandle,
    src_offset: u64,
    dst: BufferHandle,
    dst_offset: u64,
    bytes: u64,
) -> CopyRegion {
    CopyRegion {
        src,
        src_offset,
        dst,
        dst_offset,
        bytes,
    }
}

fn check_copy_batch(device: &Device) -> Outcome {
    let mut scratch = Scratch::new(device);
    let a = scratch.alloc(256)?;
    let b = scratch.alloc(256)?;
    let c = scratch.alloc(256)?;
    let (pa, pb) = (pattern(256, 0x21), pattern(256, 0x42));
    let zeros = vec![0u8; 256];
    device.write(a, 0, &pa).map_err(fail_with("write"))?;
    device.write(b, 0, &pb).map_err(fail_with("write"))?;
    device.write(c, 0, &zeros).map_err(fail_with("write"))?;
    // Regions from two sources into a third buffer and back into a source, one of them empty,
    // plus a copy within a buffer to a disjoint range.
    let regions = [
        region(a, 0, c, 128, 32),
        region(b, 200, c, 0, 56),
        region(a, 64, c, 64, 0),
        region(b, 40, c, 170, 10),
        region(a, 0, b, 100, 16),
        region(a, 32, a, 240, 16),
    ];
    device
        .copy_batch(&regions)
        .map_err(fail_with("copy_batch"))?;
    let mut want_c = zeros;
    want_c[128..160].copy_from_slice(&pa[0..32]);
    want_c[0..56].copy_from_slice(&pb[200..256]);
    want_c[170..180].copy_from_slice(&pb[40..50]);
    let mut want_b = pb.clone();
    want_b[100..116].copy_from_slice(&pa[0..16]);
    let mut want_a = pa.clone();
    want_a[240..256].copy_from_slice(&pa[32..48]);
    for (name, buf, want) in [("c", c, want_c), ("b", b, want_b), ("a", a, want_a)] {
        if read_all(device, buf, 256)? != want {
            return Err(fail(format!(
                "copy_batch left the wrong bytes in buffer {name}"
            )));
        }
    }
    scratch.finish()
}

fn check_fill(device: &Device) -> Outcome {
    let mut scratch = Scratch::new(device);
    let buf = scratch.alloc(256)?;
    let base = pattern(256, 0x33);
    device.write(buf, 0, &base).map_err(fail_with("write"))?;
    let fills = [
        (8u64, 24u64, 0xabu32, 1u32),
        (64, 32, 0x7fc0, 2),
        (128, 64, 0x3f80_0000, 4),
        (200, 0, 0, 4),
    ];
    let mut want = base;
    for (offset, bytes, value, width) in fills {
        device
            .fill(&FillArgs {
                dst: BufferSlice { buf, offset, bytes },
                value,
                width,
            })
            .map_err(fail_with("fill"))?;
        let pattern = value.to_le_bytes();
        let w = index(u64::from(width));
        for (i, byte) in want[index(offset)..index(offset + bytes)]
            .iter_mut()
            .enumerate()
        {
            *byte = pattern[i % w];
        }
    }
    if read_all(device, buf, 256)? != want {
        return Err(fail(
            "fill wrote the wrong bytes or wrote outside its range",
        ));
    }
    let code = ErrorCode::INVALID_ARGUMENT;
    let bad = |offset, bytes, value, width| {
        device.fill(&FillArgs {
            dst: BufferSlice { buf, offset, bytes },
            value,
            width,
        })
    };
    expect_code("fill of width 3", code, bad(0, 6, 0, 3))?;
    expect_code("fill at a misaligned offset", code, bad(2, 8, 0, 4))?;
    expect_code("fill past the end", code, bad(248, 16, 0, 1))?;
    expect_code(
        "fill with a value wider than its width",
        code,
        bad(0, 4, 0x1ff, 1),
    )?;
    scratch.finish()
}

fn check_out_of_range(device: &Device) -> Outcome {
    let code = ErrorCode::INVALID_ARGUMENT;
    let mut scratch = Scratch::new(device);
    let a = scratch.alloc(64)?;
    let b = scratch.alloc(64)?;
    expect_code("write past the end", code, device.write(a, 60, &[0; 8]))?;
    expect_code(
        "write at an overflowing offset",
        code,
        device.write(a, u64::MAX, &[0; 2]),
    )?;
    let mut dst = [0u8; 8];
    expect_code("read past the end", code, device.read(a, 57, &mut dst))?;
    expect_code(
        "copy past the source end",
        code,
        device.copy(b, 0, a, 32, 33),
    )?;
    expect_code(
        "copy past the destination end",
        code,
        device.copy(b, 63, a, 0, 2),
    )?;
    expect_code(
        "overlapping copy within a buffer",
        code,
        device.copy(a, 8, a, 0, 16),
    )?;
    expect_code(
        "copy_batch with overlapping destinations",
        code,
        device.copy_batch(&[region(a, 0, b, 0, 16), region(a, 32, b, 8, 16)]),
    )?;
    expect_code(
        "copy_batch writing over another region's source",
        code,
        device.copy_batch(&[region(a, 0, b, 0, 16), region(b, 8, a, 32, 8)]),
    )?;
    scratch.finish()
}

/// Many calls enqueued back to back, then one read: the read must see all of them, in order.
/// A chain of fills and copies (which every device has), then, when the device has `binary`,
/// a chain of in-place additions.
fn check_many_ops(device: &Device) -> Outcome {
    const ROUNDS: u32 = 200;
    const COLS: u64 = 256;
    let mut scratch = Scratch::new(device);
    let (a, b) = (scratch.alloc(4096)?, scratch.alloc(4096)?);
    for round in 0..ROUNDS {
        // Each round's copy must see that round's fill, and not a later one.
        device
            .fill(&FillArgs {
                dst: BufferSlice {
                    buf: a,
                    offset: 0,
                    bytes: 4096,
                },
                value: round % 256,
                width: 1,
            })
            .map_err(fail_with("fill"))?;
        device
            .copy(b, u64::from(round % 16) * 256, a, 0, 256)
            .map_err(fail_with("copy"))?;
    }
    let got = read_all(device, b, 4096)?;
    for slot in 0..16u32 {
        let last = (ROUNDS - 1 - (ROUNDS - 1 - slot) % 16) % 256;
        let at = index(u64::from(slot) * 256);
        if got[at..at + 256]
            .iter()
            .any(|&byte| u32::from(byte) != last)
        {
            return Err(fail(format!(
                "after {ROUNDS} fills and copies, slot {slot} holds {} instead of {last}: calls ran out of order",
                got[at]
            )));
        }
    }
    if !device.supports(OpKind::BINARY) {
        return scratch.finish();
    }
    let (x, x_h) = scratch.upload(DType::F32, 4, COLS, &values(31, 4 * COLS, 1.0))?;
    let (one, _) = scratch.upload(DType::F32, 1, COLS, &vec![1.0; index(COLS)])?;
    let mut args = BinaryArgs {
        a: x,
        b: one,
        out: x,
        op: BinaryOp::ADD,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::BINARY, device.binary_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    for _ in 0..ROUNDS {
        op_result(device, OpKind::BINARY, device.binary(&args))?;
    }
    let want: Vec<f64> = x_h
        .iter()
        .map(|v| f64::from(*v) + f64::from(ROUNDS))
        .collect();
    compare_all(tolerance(DType::F32), &scratch.download(&x)?, &want)?;
    scratch.finish()
}

/// A buffer freed right after enqueueing work that reads it: the work must still see its
/// contents.
fn check_free_after_enqueue(device: &Device) -> Outcome {
    const LEN: usize = 1 << 20;
    let mut scratch = Scratch::new(device);
    let dst = scratch.alloc(LEN as u64)?;
    let src = device.alloc(LEN as u64).map_err(fail_with("alloc"))?;
    let data = pattern(LEN, 0x6d);
    let copied = device
        .write(src, 0, &data)
        .and_then(|()| device.copy(dst, 0, src, 0, LEN as u64));
    let freed = device.free(src);
    copied.map_err(fail_with("write and copy"))?;
    freed.map_err(fail_with("free right after the copy"))?;
    if read_all(device, dst, LEN)? != data {
        return Err(fail(
            "a copy from a buffer freed right after it was enqueued read the wrong bytes",
        ));
    }
    scratch.finish()
}

/// A host slice overwritten right after `write` returned: the device must have taken the old
/// contents.
fn check_write_reuse(device: &Device) -> Outcome {
    const LEN: usize = 1 << 16;
    let mut scratch = Scratch::new(device);
    let a = scratch.alloc(LEN as u64)?;
    let b = scratch.alloc(LEN as u64)?;
    let first = pattern(LEN, 0x11);
    let mut host = first.clone();
    device.write(a, 0, &host).map_err(fail_with("write"))?;
    host.copy_from_slice(&pattern(LEN, 0x99));
    device.write(b, 0, &host).map_err(fail_with("write"))?;
    if read_all(device, a, LEN)? != first {
        return Err(fail(
            "`write` returned before it had taken the host slice: a later change to the slice reached the device",
        ));
    }
    if read_all(device, b, LEN)? != host {
        return Err(fail("the second write left the wrong bytes"));
    }
    scratch.finish()
}

/// Host staging buffers: uploads and downloads ordered by fences, the buffer reused at once.
fn check_staging(device: &Arc<Device>) -> Outcome {
    const LEN: u64 = 1 << 20;
    if !device.has_staging() {
        return Err(Problem::Unsupported(format!(
            "the plugin was built for ABI {}.{}, before host staging",
            device.plugin().abi_major(),
            device.plugin().abi_minor()
        )));
    }
    let mut scratch = Scratch::new(device);
    let buf = scratch.alloc(2 * LEN)?;
    let mut staging = device.host_buffer(LEN).map_err(fail_with("alloc_host"))?;
    if !staging.is_pinned() {
        return Err(Problem::Unsupported(
            "the device offers no host staging buffers; the host stages through ordinary memory"
                .to_owned(),
        ));
    }
    let first = pattern(index(LEN), 0x17);
    let second = pattern(index(LEN), 0x71);
    staging
        .as_mut_slice()
        .map_err(fail_with("staging"))?
        .copy_from_slice(&first);
    device
        .upload(buf, 0, &mut staging, 0, LEN)
        .map_err(fail_with("upload"))?;
    // Reusing the buffer at once must wait for the first upload, not overwrite its data.
    staging
        .as_mut_slice()
        .map_err(fail_with("staging"))?
        .copy_from_slice(&second);
    device
        .upload(buf, LEN, &mut staging, 0, LEN)
        .map_err(fail_with("upload"))?;
    let mut back = device
        .host_buffer(2 * LEN)
        .map_err(fail_with("alloc_host"))?;
    device
        .download(buf, 0, &mut back, 0, 2 * LEN)
        .map_err(fail_with("download"))?;
    let got = back.as_slice().map_err(fail_with("staging"))?;
    if got[..index(LEN)] != first[..] || got[index(LEN)..] != second[..] {
        return Err(fail(
            "bytes uploaded and downloaded through host staging buffers differ",
        ));
    }
    drop((staging, back));
    scratch.finish()
}

/// `write_async` (ABI 2.2): ordered after a fill enqueued before it and before a copy enqueued
/// after it, a range outside the buffer refused, and the source free again once the writes
/// are finished.
fn check_write_async(device: &Arc<Device>) -> Outcome {
    const LEN: usize = 1 << 20;
    if !device.has_async_write() {
        return Err(Problem::Unsupported(format!(
            "no `write_async` (the plugin speaks ABI {}.{}, or answered unsupported): iris stages instead",
            device.plugin().abi_major(),
            device.plugin().abi_minor()
        )));
    }
    let mut scratch = Scratch::new(device);
    let buf = scratch.alloc(LEN as u64)?;
    let copy = scratch.alloc(LEN as u64)?;
    device
        .fill(&FillArgs {
            dst: BufferSlice {
                buf,
                offset: 0,
                bytes: LEN as u64,
            },
            value: 0xA5,
            width: 1,
        })
        .map_err(fail_with("fill"))?;
    let mut source = pattern(LEN / 2, 0x3c);
    let (enqueued, waited) = device.with_async_writes(|writes| {
        let written = writes
            .write(buf, (LEN / 4) as u64, &source)
            .map_err(fail_with("write_async"))?;
        if !written {
            return Err(Problem::Unsupported(
                "the plugin answered `write_async` with unsupported: iris stages instead"
                    .to_owned(),
            ));
        }
        match writes.write(buf, LEN as u64 - 8, &source) {
            Err(err) if err.code == ErrorCode::INVALID_ARGUMENT => {}
            Err(err) => {
                return Err(fail(format!(
                    "a write past the buffer's end failed with {} instead of invalid argument",
                    err.code.name()
                )));
            }
            Ok(_) => return Err(fail("a write past the buffer's end was accepted")),
        }
        device
            .copy(copy, 0, buf, 0, LEN as u64)
            .map_err(fail_with("copy after write_async"))
    });
    enqueued?;
    waited.map_err(fail_with("write_async's fence"))?;
    // Finished: the device no longer reads the source, so changing it changes nothing.
    source.fill(0);
    let mut want = vec![0xA5; LEN];
    want[LEN / 4..LEN / 4 + LEN / 2].copy_from_slice(&pattern(LEN / 2, 0x3c));
    if read_all(device, buf, LEN)? != want {
        return Err(fail(
            "`write_async` left the wrong bytes (or ran out of order with the fill before it)",
        ));
    }
    if read_all(device, copy, LEN)? != want {
        return Err(fail(
            "a copy enqueued after `write_async` did not see the written bytes",
        ));
    }
    scratch.finish()
}

/// `trim` (ABI 2.3), run after the op checks so that whatever the plugin keeps from them is
/// there to give back: a buffer allocated before it keeps its bytes and its place in the
/// plugin's count, and the device works on after it (a copy out of that buffer).
fn check_trim(device: &Arc<Device>) -> Outcome {
    const LEN: usize = 1 << 16;
    let mut scratch = Scratch::new(device);
    let buf = scratch.alloc(LEN as u64)?;
    let copy = scratch.alloc(LEN as u64)?;
    let bytes = pattern(LEN, 0x5a);
    device.write(buf, 0, &bytes).map_err(fail_with("write"))?;
    let before = device.memory_report().map_err(fail_with("memory_report"))?;
    let given = device.trim().map_err(fail_with("trim"))?;
    let after = device.memory_report().map_err(fail_with("memory_report"))?;
    if (after.allocated, after.buffers) != (before.allocated, before.buffers) {
        return Err(fail(format!(
            "the plugin counted {} bytes in {} buffers before `trim` and {} bytes in {} after it",
            before.allocated, before.buffers, after.allocated, after.buffers
        )));
    }
    if read_all(device, buf, LEN)? != bytes {
        return Err(fail("a buffer allocated before `trim` lost its bytes"));
    }
    device
        .copy(copy, 0, buf, 0, LEN as u64)
        .map_err(fail_with("copy after trim"))?;
    if read_all(device, copy, LEN)? != bytes {
        return Err(fail("a copy after `trim` left the wrong bytes"));
    }
    scratch.finish()?;
    match given {
        Some(_) => Ok(()),
        None => Err(Problem::Unsupported(format!(
            "no `trim` (the plugin speaks ABI {}.{}, or answered unsupported): it keeps no \
             device memory for reuse to give back",
            device.plugin().abi_major(),
            device.plugin().abi_minor()
        ))),
    }
}

/// Ops with arguments the shared validation rejects answer invalid-argument, not a crash.
fn check_bad_op_arguments(device: &Device) -> Outcome {
    let code = ErrorCode::INVALID_ARGUMENT;
    let mut scratch = Scratch::new(device);
    let (a, _) = scratch.upload(DType::F32, 4, 8, &values(41, 32, 1.0))?;
    let (w, _) = scratch.upload(DType::F32, 6, 9, &values(42, 54, 1.0))?;
    let out = scratch.output(DType::F32, 4, 6)?;
    let gemm = GemmArgs {
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
    if device.supports(OpKind::GEMM) {
        expect_code("gemm with k 8 against k 9", code, device.gemm(&gemm))?;
        let in_place = GemmArgs { out: a, ..gemm };
        expect_code("gemm writing over its input", code, device.gemm(&in_place))?;
    }
    if device.supports(OpKind::ATTENTION) {
        let cu = [0u32, 3];
        let cu_device = scratch.upload_i32(&[0, 3])?;
        let attention = AttentionArgs {
            q: a,
            k: a,
            v: a,
            out,
            heads: 2,
            head_dim: 4,
            scale: 0.5,
            cu_seqlens: cu.as_slice().into(),
            cu_seqlens_device: cu_device,
            max_seqlen: 3,
            workspace: BufferSlice::EMPTY,
        };
        expect_code(
            "attention whose cu_seqlens end before the last token",
            code,
            device.attention_workspace(&attention),
        )?;
    }
    if device.supports(OpKind::ACTIVATION) {
        let act = ActivationArgs {
            x: a,
            out: a,
            activation: Activation(99),
            workspace: BufferSlice::EMPTY,
        };
        expect_code("an unknown activation", code, device.activation(&act))?;
    }
    device.synchronize().map_err(fail_with("synchronize"))?;
    scratch.finish()
}

// ---------------------------------------------------------------------------------------------
// Ops against host references
// ---------------------------------------------------------------------------------------------

/// One gemm case: `a` is `[m, k]`, the weight `[n, k]` (or `[k, n]` when transposed).
#[derive(Clone, Copy)]
struct GemmCase {
    name: &'static str,
    m: u64,
    k: u64,
    n: u64,
    bias: bool,
    activation: Activation,
    accumulate: bool,
    w_transposed: bool,
    /// `a` with a row stride wider than `k` at a byte offset into its buffer.
    strided_a: bool,
}

impl GemmCase {
    const ODD: GemmCase = GemmCase {
        name: "",
        m: 333,
        k: 77,
        n: 129,
        bias: true,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        strided_a: false,
    };
}

/// Tower shapes (Qwen2-VL-2B's fused qkv and its MLP's down projection with the residual) and
/// odd shapes that cross every tile boundary.
const GEMM_CASES: [GemmCase; 8] = [
    GemmCase {
        name: "tower_qkv_1024x1280x3840",
        m: 1024,
        k: 1280,
        n: 3840,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "tower_fc2_residual_1024x5120x1280",
        m: 1024,
        k: 5120,
        n: 1280,
        accumulate: true,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_strided_transposed_333x77x129",
        bias: false,
        w_transposed: true,
        strided_a: true,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_gelu_erf",
        activation: Activation::GELU_ERF,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_gelu_tanh",
        activation: Activation::GELU_TANH,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_quick_gelu",
        activation: Activation::QUICK_GELU,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_silu",
        activation: Activation::SILU,
        ..GemmCase::ODD
    },
    GemmCase {
        name: "odd_gelu_tanh_accumulate",
        activation: Activation::GELU_TANH,
        accumulate: true,
        ..GemmCase::ODD
    },
];

fn case_gemm(device: &Device, dtype: DType, case: GemmCase) -> Result<Measured, Problem> {
    let GemmCase { m, k, n, .. } = case;
    let mut scratch = Scratch::new(device);
    let (a_stride, a_offset) = if case.strided_a {
        (k + 5, 3 * 64)
    } else {
        (k, 0)
    };
    let (a, a_h) = scratch.upload_at(dtype, m, k, a_stride, a_offset, &values(1, m * k, 1.0))?;
    let w_values = values(2, n * k, 0.5);
    let (w, w_h) = if case.w_transposed {
        scratch.upload(dtype, k, n, &w_values)?
    } else {
        scratch.upload(dtype, n, k, &w_values)?
    };
    let (bias, bias_h) = if case.bias {
        scratch.upload(dtype, 1, n, &values(3, n, 1.0))?
    } else {
        (MatRef::NONE, vec![0.0; index(n)])
    };
    let (out, prior) = if case.accumulate {
        scratch.upload(dtype, m, n, &values(4, m * n, 1.0))?
    } else {
        (scratch.output(dtype, m, n)?, vec![0.0; index(m * n)])
    };
    let mut args = GemmArgs {
        a,
        w,
        bias,
        out,
        activation: case.activation,
        accumulate: case.accumulate,
        w_transposed: case.w_transposed,
        // The weight is uploaded once and never written: a device may cache a packed copy.
        w_constant: true,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::GEMM, device.gemm_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::GEMM, || device.gemm(&args))?;
    let got = scratch.download(&out)?;
    let (mu, ku, nu) = (index(m), index(k), index(n));
    let want = |i: usize| {
        let (r, c) = (i / nu, i % nu);
        let mut acc = f64::from(bias_h[c]);
        for j in 0..ku {
            let w = if case.w_transposed {
                w_h[j * nu + c]
            } else {
                w_h[c * ku + j]
            };
            acc += f64::from(a_h[r * ku + j]) * f64::from(w);
        }
        let mut value = activate(case.activation, acc);
        if case.accumulate {
            value += f64::from(prior[i]);
        }
        value
    };
    compare_at(tolerance(dtype), &got, &want, &sample(mu, nu, m ^ n))?;
    scratch.finish()?;
    Ok(Measured {
        seconds,
        work: 2.0 * float(mu) * float(ku) * float(nu),
        unit: "GFLOP/s",
    })
}

/// Widths of Qwen-VL towers' norms: Qwen3-VL's 1152, Qwen2-VL's 1280, Qwen2.5-VL-7B's 3584
/// (its merger input).
const NORM_WIDTHS: [u64; 3] = [1152, 1280, 3584];
/// Rows of the norm, activation and binary cases.
const ELEMENTWISE_ROWS: u64 = 64;

fn case_norm(
    device: &Device,
    dtype: DType,
    rms: bool,
    cols: u64,
    in_place: bool,
) -> Result<Measured, Problem> {
    const EPS: f32 = 1e-6;
    let rows = ELEMENTWISE_ROWS;
    let op = if rms {
        OpKind::RMS_NORM
    } else {
        OpKind::LAYER_NORM
    };
    let mut scratch = Scratch::new(device);
    // An offset keeps the mean away from zero, so layer norm's centring matters.
    let x_values: Vec<f32> = values(5, rows * cols, 2.0)
        .into_iter()
        .map(|v| v + 0.75)
        .collect();
    let (x, x_h) = scratch.upload(dtype, rows, cols, &x_values)?;
    let (weight, w_h) = scratch.upload(dtype, 1, cols, &values(6, cols, 1.5))?;
    let (bias, b_h) = if rms {
        (MatRef::NONE, vec![0.0; index(cols)])
    } else {
        scratch.upload(dtype, 1, cols, &values(7, cols, 1.0))?
    };
    let out = if in_place {
        x
    } else {
        scratch.output(dtype, rows, cols)?
    };
    let mut args = NormArgs {
        x,
        weight,
        bias,
        out,
        eps: EPS,
        workspace: BufferSlice::EMPTY,
    };
    let query = if rms {
        device.rms_norm_workspace(&args)
    } else {
        device.layer_norm_workspace(&args)
    };
    args.workspace = scratch.workspace(op_result(device, op, query)?)?;
    let seconds = time_op(device, op, || {
        if rms {
            device.rms_norm(&args)
        } else {
            device.layer_norm(&args)
        }
    })?;
    let n = index(cols);
    let mut want = Vec::with_capacity(x_h.len());
    for row in x_h.chunks_exact(n) {
        let row: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f64>() / float(n)
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / float(n);
        let inv = 1.0 / (var + f64::from(EPS)).sqrt();
        for c in 0..n {
            want.push((row[c] - mean) * inv * f64::from(w_h[c]) + f64::from(b_h[c]));
        }
    }
    compare_all(tolerance(dtype), &scratch.download(&out)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(2 * rows * cols * elem_size(dtype), seconds))
}

fn bandwidth(bytes: u64, seconds: f64) -> Measured {
    #[allow(clippy::cast_precision_loss)]
    let work = bytes as f64;
    Measured {
        seconds,
        work,
        unit: "GB/s",
    }
}

fn case_activation(
    device: &Device,
    dtype: DType,
    activation: Activation,
) -> Result<Measured, Problem> {
    let (rows, cols) = (ELEMENTWISE_ROWS, 1280);
    let mut scratch = Scratch::new(device);
    let (x, x_h) = scratch.upload(dtype, rows, cols, &values(8, rows * cols, 4.0))?;
    let out = scratch.output(dtype, rows, cols)?;
    let mut args = ActivationArgs {
        x,
        out,
        activation,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(
        device,
        OpKind::ACTIVATION,
        device.activation_workspace(&args),
    )?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::ACTIVATION, || device.activation(&args))?;
    let want: Vec<f64> = x_h
        .iter()
        .map(|&v| activate(activation, f64::from(v)))
        .collect();
    compare_all(tolerance(dtype), &scratch.download(&out)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(2 * rows * cols * elem_size(dtype), seconds))
}

fn case_binary(
    device: &Device,
    dtype: DType,
    op: BinaryOp,
    broadcast: bool,
) -> Result<Measured, Problem> {
    let (rows, cols) = (ELEMENTWISE_ROWS, 1280);
    let mut scratch = Scratch::new(device);
    let (a, a_h) = scratch.upload(dtype, rows, cols, &values(9, rows * cols, 2.0))?;
    let b_rows = if broadcast { 1 } else { rows };
    let (b, b_h) = scratch.upload(dtype, b_rows, cols, &values(10, b_rows * cols, 2.0))?;
    // In place on `a`, as the towers use it (residuals, gating).
    let mut args = BinaryArgs {
        a,
        b,
        out: a,
        op,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::BINARY, device.binary_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::BINARY, || device.binary(&args))?;
    let n = index(cols);
    let want: Vec<f64> = a_h
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let y = if broadcast { b_h[i % n] } else { b_h[i] };
            let (x, y) = (f64::from(x), f64::from(y));
            if op == BinaryOp::MUL { x * y } else { x + y }
        })
        .collect();
    compare_all(tolerance(dtype), &scratch.download(&a)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(3 * rows * cols * elem_size(dtype), seconds))
}

/// Qwen-VL's rotary tables for tokens of a `grid_h x grid_w` grid in merge-window order:
/// `cos`/`sin` of `cat(θ, θ)` where `θ` is the row angle on the first quarter of channels and
/// the column angle on the second. Returned as f32 `[tokens, head_dim]` pairs.
fn rotary_tables(tokens: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let quarter = head_dim / 4;
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(tokens * head_dim);
    let mut sin = Vec::with_capacity(tokens * head_dim);
    for t in 0..tokens {
        let (row, col) = (float(t / 16), float(t % 16));
        let angles: Vec<f64> = (0..half)
            .map(|c| {
                let (pos, i) = if c < quarter {
                    (row, c)
                } else {
                    (col, c - quarter)
                };
                pos * 10_000f64.powf(-float(2 * i) / float(half))
            })
            .collect();
        for _ in 0..2 {
            #[allow(clippy::cast_possible_truncation)]
            cos.extend(angles.iter().map(|a| a.cos() as f32));
            #[allow(clippy::cast_possible_truncation)]
            sin.extend(angles.iter().map(|a| a.sin() as f32));
        }
    }
    (cos, sin)
}

fn case_rotary(device: &Device, dtype: DType, head_dim: u64) -> Result<Measured, Problem> {
    // q and k of 16 heads side by side, as a fused qkv buffer's first two thirds.
    const TOKENS: u64 = 257;
    const HEADS: u64 = 32;
    let mut scratch = Scratch::new(device);
    let cols = HEADS * head_dim;
    let (x, x_h) = scratch.upload_at(
        dtype,
        TOKENS,
        cols,
        cols + cols / 2,
        0,
        &values(11, TOKENS * cols, 1.0),
    )?;
    let (cos_h, sin_h) = rotary_tables(index(TOKENS), index(head_dim));
    let (cos, _) = scratch.upload(DType::F32, TOKENS, head_dim, &cos_h)?;
    let (sin, _) = scratch.upload(DType::F32, TOKENS, head_dim, &sin_h)?;
    let mut args = RotaryArgs {
        x,
        heads: HEADS,
        head_dim,
        cos,
        sin,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::ROTARY, device.rotary_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::ROTARY, || device.rotary(&args))?;
    let (d, half, w) = (index(head_dim), index(head_dim / 2), index(cols));
    let mut want: Vec<f64> = x_h.iter().map(|&v| f64::from(v)).collect();
    for t in 0..index(TOKENS) {
        for h in 0..index(HEADS) {
            let base = t * w + h * d;
            for c in 0..half {
                let (x1, x2) = (f64::from(x_h[base + c]), f64::from(x_h[base + c + half]));
                let table = |tab: &[f32], i: usize| f64::from(tab[t * d + i]);
                want[base + c] = x1 * table(&cos_h, c) - x2 * table(&sin_h, c);
                want[base + c + half] = x2 * table(&cos_h, c + half) + x1 * table(&sin_h, c + half);
            }
        }
    }
    compare_all(tolerance(dtype), &scratch.download(&x)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(2 * TOKENS * cols * elem_size(dtype), seconds))
}

/// Head dims of the vision towers: 64 (small towers), 72 (Qwen3-VL), 80 (Qwen2/2.5-VL), 128.
const ATTENTION_HEAD_DIMS: [u64; 4] = [64, 72, 80, 128];
/// Segment lengths in one attention call: a single token, odd lengths around tile sizes, and
/// a 448x448 image's 1024 patches.
const SEGMENTS: [u32; 4] = [1, 63, 257, 1024];

/// Every query and key element of the large-logits attention case: with head dim 64, each
/// product of a query and a key is 64 · 40² = 102400, beyond f16's largest value (65504),
/// while the scaled logit (12800) and everything else fits. An attention that multiplies in
/// f16 and scales afterwards gets infinities and then NaN.
const LARGE_LOGIT_INPUT: f32 = 40.0;

/// Attention over [`SEGMENTS`]; with `large_logits` every query and key element is
/// [`LARGE_LOGIT_INPUT`] (the probabilities are then uniform and the output each segment's
/// mean value row).
fn case_attention(
    device: &Device,
    dtype: DType,
    head_dim: u64,
    large_logits: bool,
) -> Result<Measured, Problem> {
    const HEADS: u64 = 2;
    let width = HEADS * head_dim;
    let mut cu = vec![0u32];
    for len in SEGMENTS {
        cu.push(cu[cu.len() - 1] + len);
    }
    let tokens = u64::from(cu[cu.len() - 1]);
    let mut scratch = Scratch::new(device);
    // One fused [tokens, 3 · width] buffer; q, k and v are strided views into it.
    let mut qkv_values = values(12 + head_dim, tokens * 3 * width, 1.0);
    if large_logits {
        for row in qkv_values.chunks_mut(index(3 * width)) {
            row[..index(2 * width)].fill(LARGE_LOGIT_INPUT);
        }
    }
    let (qkv, qkv_h) = scratch.upload(dtype, tokens, 3 * width, &qkv_values)?;
    let size = elem_size(dtype);
    let view = |part: u64| MatRef {
        offset: part * width * size,
        cols: width,
        ..qkv
    };
    let (q, k, v) = (view(0), view(1), view(2));
    let out = scratch.output(dtype, tokens, width)?;
    let cu_i32: Vec<i32> = cu
        .iter()
        .map(|&c| i32::try_from(c).unwrap_or(i32::MAX))
        .collect();
    let cu_device = scratch.upload_i32(&cu_i32)?;
    #[allow(clippy::cast_precision_loss)]
    let scale = (head_dim as f32).sqrt().recip();
    let mut args = AttentionArgs {
        q,
        k,
        v,
        out,
        heads: HEADS,
        head_dim,
        scale,
        cu_seqlens: cu.as_slice().into(),
        cu_seqlens_device: cu_device,
        max_seqlen: u64::from(SEGMENTS.iter().copied().max().unwrap_or(0)),
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::ATTENTION, device.attention_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::ATTENTION, || device.attention(&args))?;
    let got = scratch.download(&out)?;
    let row = index(3 * width);
    let (w, hd) = (index(width), index(head_dim));
    let at = |t: usize, part: usize, h: usize, c: usize| {
        f64::from(qkv_h[t * row + part * w + h * hd + c])
    };
    // Query rows checked per segment and head: the first, the last and a few between.
    let mut rng = Rng::new(head_dim);
    let mut checked = Vec::new();
    let mut want = vec![0.0f64; got.len()];
    for segment in cu.windows(2) {
        let (start, end) = (index(u64::from(segment[0])), index(u64::from(segment[1])));
        if start == end {
            continue;
        }
        let mut rows = vec![start, end - 1];
        rows.extend((0..4).map(|_| start + rng.below(end - start)));
        rows.sort_unstable();
        rows.dedup();
        for h in 0..index(HEADS) {
            for &i in &rows {
                let scores: Vec<f64> = (start..end)
                    .map(|j| {
                        (0..hd)
                            .map(|c| at(i, 0, h, c) * at(j, 1, h, c))
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for c in 0..hd {
                    let value: f64 = (start..end)
                        .zip(&exps)
                        .map(|(j, e)| e / total * at(j, 2, h, c))
                        .sum();
                    let position = i * w + h * hd + c;
                    want[position] = value;
                    checked.push(position);
                }
            }
        }
    }
    compare_at(tolerance(dtype), &got, &|i| want[i], &checked)?;
    scratch.finish()?;
    let flops: f64 = SEGMENTS
        .iter()
        .map(|&len| 4.0 * f64::from(len) * f64::from(len) * float(hd) * float(index(HEADS)))
        .sum();
    Ok(Measured {
        seconds,
        work: flops,
        unit: "GFLOP/s",
    })
}

fn case_gather(device: &Device, dtype: DType) -> Result<Measured, Problem> {
    const ROWS: u64 = 300;
    const COLS: u64 = 1280;
    const OUT_ROWS: u64 = 517;
    let mut scratch = Scratch::new(device);
    let (src, src_h) = scratch.upload(dtype, ROWS, COLS, &values(13, ROWS * COLS, 3.0))?;
    // Out of order, with repeats, the first and last rows included.
    let mut rng = Rng::new(17);
    let mut indices: Vec<i32> = (0..OUT_ROWS)
        .map(|_| i32::try_from(rng.below(index(ROWS))).unwrap_or(0))
        .collect();
    indices[0] = i32::try_from(ROWS - 1).unwrap_or(0);
    indices[1] = 0;
    indices[2] = 0;
    let indices_device = scratch.upload_i32(&indices)?;
    let out = scratch.output(dtype, OUT_ROWS, COLS)?;
    let mut args = GatherArgs {
        src,
        out,
        indices: indices_device,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(
        device,
        OpKind::GATHER_ROWS,
        device.gather_rows_workspace(&args),
    )?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::GATHER_ROWS, || device.gather_rows(&args))?;
    let cols = index(COLS);
    let want: Vec<f64> = indices
        .iter()
        .flat_map(|&i| {
            let start = usize::try_from(i).unwrap_or(0) * cols;
            src_h[start..start + cols].iter().map(|&v| f64::from(v))
        })
        .collect();
    // Moving rows is exact.
    compare_all(0.0, &scratch.download(&out)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(2 * OUT_ROWS * COLS * elem_size(dtype), seconds))
}

fn case_cast(device: &Device, from: DType, to: DType) -> Result<Measured, Problem> {
    let (rows, cols) = (ELEMENTWISE_ROWS, 1280);
    let mut scratch = Scratch::new(device);
    let (src, src_h) = scratch.upload(from, rows, cols, &values(14, rows * cols, 50.0))?;
    let out = scratch.output(to, rows, cols)?;
    let mut args = CastArgs {
        src,
        out,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::CAST, device.cast_workspace(&args))?;
    args.workspace = scratch.workspace(bytes)?;
    let seconds = time_op(device, OpKind::CAST, || device.cast(&args))?;
    // Round to nearest even is exact and specified; allow only the last bit of slack.
    let slack = match to {
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
        _ => 1e-7,
    };
    let want: Vec<f64> = src_h.iter().map(|&v| f64::from(round_to(to, v))).collect();
    compare_all(slack, &scratch.download(&out)?, &want)?;
    scratch.finish()?;
    Ok(bandwidth(
        rows * cols * (elem_size(from) + elem_size(to)),
        seconds,
    ))
}

/// Reference activations in `f64`.
fn activate(activation: Activation, x: f64) -> f64 {
    match activation {
        Activation::GELU_ERF => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Activation::GELU_TANH => {
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044_715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh())
        }
        Activation::QUICK_GELU => x / (1.0 + (-1.702 * x).exp()),
        Activation::SILU => x / (1.0 + (-x).exp()),
        _ => x,
    }
}

/// The error function, to about 1e-15 (Taylor series near zero, continued fraction for the
/// tail); `std` has none.
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let value = if z < 2.5 {
        // erf(z) = 2/√π · Σ (-1)^n z^(2n+1) / (n! (2n+1))
        let mut term = z;
        let mut sum = z;
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -z * z / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(z) = exp(-z²)/√π · 1/(z + 1/2/(z + 1/(z + 3/2/(z + ...)))), evaluated bottom-up.
        let mut fraction = z;
        for k in (1..60).rev() {
            fraction = z + f64::from(k) / 2.0 / fraction;
        }
        1.0 - (-z * z).exp() / std::f64::consts::PI.sqrt() / fraction
    };
    value.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!((erf(x) - want).abs() < 1e-12, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn dtype_round_trips_are_exact_for_representable_values() {
        let values = [0.0f32, 1.0, -2.5, 0.125];
        for dtype in DType::FLOATS {
            assert_eq!(decode(dtype, &encode(dtype, &values)), values);
        }
    }

    #[test]
    fn comparison_reports_the_first_mismatch() {
        assert!(compare_all(1e-4, &[1.0, 2.0], &[1.0, 2.0001]).is_ok());
        let Err(Problem::Fail(text)) = compare_all(1e-4, &[1.0, 2.5], &[1.0, 2.0]) else {
            panic!("a mismatch must fail");
        };
        assert!(text.contains("index 1"), "{text}");
        // NaN never passes.
        assert!(compare_all(1e-4, &[f32::NAN], &[1.0]).is_err());
    }

    #[test]
    fn samples_cover_corners_and_stay_in_range() {
        let at = sample(1024, 3840, 7);
        assert!(at.contains(&0) && at.contains(&(1024 * 3840 - 1)));
        assert!(at.contains(&3839) && at.contains(&(1023 * 3840)));
        assert!(at.iter().all(|&i| i < 1024 * 3840));
        assert_eq!(sample(3, 4, 1).len(), 12);
    }

    #[test]
    fn check_serialises_with_a_lowercase_tag_detail_and_timing() {
        let check = Check {
            name: "x".into(),
            status: Status::Fail("why".into()),
            timing: None,
        };
        let json = serde_json::to_string(&check).unwrap();
        assert_eq!(json, r#"{"name":"x","status":"fail","detail":"why"}"#);
        let check = Check {
            name: "y".into(),
            status: Status::Pass,
            timing: Some(Timing {
                seconds: 0.5,
                throughput: 2.0,
                unit: "GB/s",
            }),
        };
        let json = serde_json::to_string(&check).unwrap();
        assert_eq!(
            json,
            r#"{"name":"y","status":"pass","timing":{"seconds":0.5,"throughput":2.0,"unit":"GB/s"}}"#
        );
    }
}
