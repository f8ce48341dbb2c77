//! The conformance suite: one set of checks run against any device plugin.
//!
//! [`run`] takes a loaded [`Plugin`] and one of its opened [`Device`]s and returns a [`Report`]
//! of named [`Check`]s. It covers, in order: the plugin's identity and ABI version; the device
//! description; allocation accounting against `mem_info`; the error codes of bad memory calls
//! (out of memory, zero size, double free, unknown handle); transfer round trips and
//! out-of-range transfers; and each op, for every dtype the device lists, against a naive host
//! reference written below in plain loops over `f64`.
//!
//! An op the device does not list in its description and that answers
//! [`ErrorCode::UNSUPPORTED`] is reported as [`Status::Unsupported`], so a new backend can pass
//! the suite with memory and transfers alone and add ops one at a time. An op that is listed but
//! fails, or an unlisted op that fails with another code, is a [`Status::Fail`].
//!
//! Outputs are compared with a tolerance that depends on the storage dtype (see
//! [`tolerance`]): the reference computes from the inputs as the device stores them (rounded to
//! the dtype), so the tolerance only covers the device's own rounding.
//!
//! The suite frees every buffer it allocates; its last check verifies that free memory returned
//! to the value it had when the suite started.

use std::fmt;

use serde::Serialize;

use crate::abi::{
    ABI_MAJOR, ABI_MIN_MINOR, Activation, ActivationArgs, AttentionArgs, BinaryArgs, BinaryOp,
    BufferHandle, BufferSlice, CastArgs, CopyRegion, DType, ErrorCode, GatherArgs, GemmArgs,
    MatRef, NormArgs, OpKind, Rope2dArgs,
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

/// One named check and its outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Dotted name, e.g. `memory.accounting` or `op.gemm.bias_silu.f16`.
    pub name: String,
    /// The outcome.
    #[serde(flatten)]
    pub status: Status,
}

/// Every check of one run, in the order they ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The checks.
    pub checks: Vec<Check>,
}

impl Report {
    /// Number of checks that passed.
    pub fn passed(&self) -> usize {
        self.count(|status| matches!(status, Status::Pass))
    }

    /// Number of checks that failed.
    pub fn failed(&self) -> usize {
        self.count(|status| matches!(status, Status::Fail(_)))
    }

    /// Number of checks whose op the device does not implement.
    pub fn unsupported(&self) -> usize {
        self.count(|status| matches!(status, Status::Unsupported(_)))
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

/// Relative tolerance of op results stored as `dtype`: a few units in the last place of the
/// storage type, since devices may round intermediates to it.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 1e-2,
        DType::BF16 => 3e-2,
        _ => 1e-4,
    }
}

/// Runs every check against `device`, an opened device of `plugin`.
pub fn run(plugin: &Plugin, device: &Device) -> Report {
    let mut suite = Suite {
        device,
        report: Report::default(),
    };
    let start = device.mem_info();
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
    suite.record("transfer.copy", || check_copy(device));
    suite.record("transfer.copy_regions", || check_copy_regions(device));
    suite.record("transfer.out_of_range", || check_out_of_range(device));

    let dtypes: Vec<DType> = device
        .description()
        .dtypes
        .iter()
        .copied()
        .filter(|dtype| dtype.size().is_some())
        .collect();
    for &dtype in &dtypes {
        suite.op_checks(dtype);
    }
    for &from in &dtypes {
        for &to in &dtypes {
            let name = format!("op.cast.{from}_to_{to}");
            suite.record(&name, || case_cast(device, from, to));
        }
    }

    suite.record("memory.all_freed", || {
        let start = start.map_err(fail_with("mem_info"))?;
        device.synchronize().map_err(fail_with("synchronize"))?;
        let end = device.mem_info().map_err(fail_with("mem_info"))?;
        if end.free == start.free {
            Ok(())
        } else {
            Err(Problem::Fail(format!(
                "free memory was {} bytes before the suite and is {} bytes after it",
                start.free, end.free
            )))
        }
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

struct Suite<'d> {
    device: &'d Device,
    report: Report,
}

impl Suite<'_> {
    fn record(&mut self, name: &str, check: impl FnOnce() -> Outcome) {
        let status = match check() {
            Ok(()) => Status::Pass,
            Err(Problem::Fail(detail)) => Status::Fail(detail),
            Err(Problem::Unsupported(detail)) => Status::Unsupported(detail),
        };
        self.report.checks.push(Check {
            name: name.to_owned(),
            status,
        });
    }

    fn op_checks(&mut self, dtype: DType) {
        let device = self.device;
        let gemm_variants = [
            GemmVariant::PLAIN,
            GemmVariant {
                name: "bias_silu",
                bias: true,
                activation: Activation::SILU,
                ..GemmVariant::PLAIN
            },
            GemmVariant {
                name: "bias_gelu_tanh_accumulate",
                bias: true,
                activation: Activation::GELU_TANH,
                accumulate: true,
                ..GemmVariant::PLAIN
            },
            GemmVariant {
                name: "transposed_weight_strided",
                w_transposed: true,
                strided_a: true,
                ..GemmVariant::PLAIN
            },
        ];
        for variant in gemm_variants {
            let name = format!("op.gemm.{}.{dtype}", variant.name);
            self.record(&name, || case_gemm(device, dtype, variant));
        }
        for rms in [false, true] {
            let op = if rms { "rms_norm" } else { "layer_norm" };
            self.record(&format!("op.{op}.{dtype}"), || {
                case_norm(device, dtype, rms, false)
            });
            self.record(&format!("op.{op}.in_place.{dtype}"), || {
                case_norm(device, dtype, rms, true)
            });
        }
        // `NONE` is gemm's "no activation", not an activation function of its own.
        for activation in Activation::ALL
            .into_iter()
            .filter(|a| *a != Activation::NONE)
        {
            let act_name = activation.name().unwrap_or("unknown");
            self.record(&format!("op.activation.{act_name}.{dtype}"), || {
                case_activation(device, dtype, activation)
            });
        }
        for (op, op_name) in [(BinaryOp::ADD, "add"), (BinaryOp::MUL, "mul")] {
            for broadcast in [false, true] {
                let shape = if broadcast { "broadcast" } else { "same_shape" };
                self.record(&format!("op.binary.{op_name}_{shape}.{dtype}"), || {
                    case_binary(device, dtype, op, broadcast)
                });
            }
        }
        self.record(&format!("op.rope_2d.{dtype}"), || case_rope(device, dtype));
        self.record(&format!("op.attention.{dtype}"), || {
            case_attention(device, dtype)
        });
        self.record(&format!("op.gather_rows.{dtype}"), || {
            case_gather(device, dtype)
        });
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

    /// Uploads `values` as a `rows x cols` matrix of `dtype` with `row_stride` elements per
    /// row (padding filled with a sentinel); returns the view and the values as stored.
    fn upload_strided(
        &mut self,
        dtype: DType,
        rows: u64,
        cols: u64,
        row_stride: u64,
        values: &[f32],
    ) -> Result<(MatRef, Vec<f32>), Problem> {
        let size = elem_size(dtype);
        let padded: Vec<f32> = (0..rows)
            .flat_map(|r| {
                (0..row_stride).map(move |c| {
                    if c < cols {
                        values[index(r * cols + c)]
                    } else {
                        SENTINEL
                    }
                })
            })
            .collect();
        let buf = self.alloc((rows * row_stride * size).max(1))?;
        let bytes = encode(dtype, &padded);
        if !bytes.is_empty() {
            self.device
                .write(buf, 0, &bytes)
                .map_err(fail_with("write"))?;
        }
        let stored = values.iter().map(|&v| round_to(dtype, v)).collect();
        let mat = MatRef {
            buf,
            offset: 0,
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
        self.upload_strided(dtype, rows, cols, cols, values)
    }

    /// A `rows x cols` output matrix, pre-filled with a sentinel so that an op that writes
    /// nothing cannot pass.
    fn output(&mut self, dtype: DType, rows: u64, cols: u64) -> Result<MatRef, Problem> {
        let values = vec![SENTINEL; index(rows * cols)];
        Ok(self.upload(dtype, rows, cols, &values)?.0)
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
            for c in 0..mat.cols {
                out.push(all[index(r * mat.row_stride + c)]);
            }
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

/// A host index from a device-side count; the suite's shapes are tiny.
fn index(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
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

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
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

/// Compares device output with the reference: `|got - want| <= tol · max(|want|, 1)`.
fn compare(dtype: DType, got: &[f32], want: &[f64]) -> Outcome {
    compare_with(tolerance(dtype), got, want)
}

fn compare_with(tol: f64, got: &[f32], want: &[f64]) -> Outcome {
    if got.len() != want.len() {
        return Err(fail(format!(
            "{} values read back, {} expected",
            got.len(),
            want.len()
        )));
    }
    let mut bad = 0usize;
    let mut first = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g);
        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
        if !ok {
            bad += 1;
            first.get_or_insert((i, g, w));
        }
    }
    match first {
        None => Ok(()),
        Some((i, g, w)) => Err(fail(format!(
            "{bad} of {} values outside tolerance {tol:e}; first at index {i}: got {g}, expected {w}",
            got.len()
        ))),
    }
}

/// Deterministic inputs in `[-scale, scale]` (xorshift; no dependency, same on every run).
fn values(seed: u64, len: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // 24 random bits map exactly onto f32's mantissa.
            let bits = u32::try_from(state >> 40).unwrap_or(0);
            #[allow(clippy::cast_precision_loss)]
            let unit = bits as f32 / (1u32 << 24) as f32;
            (unit * 2.0 - 1.0) * scale
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Identity, description, memory, transfers
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
    if !desc.dtypes.contains(&DType::F32) {
        return Err(fail(format!(
            "dtypes {:?} do not include f32",
            desc.dtypes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        )));
    }
    if let Some(unknown) = desc.dtypes.iter().find(|dtype| dtype.size().is_none()) {
        return Err(fail(format!("dtype {unknown} is not defined by this ABI")));
    }
    if let Some(unknown) = desc.ops.iter().find(|op| op.name().is_none()) {
        return Err(fail(format!("op {unknown} is not defined by this ABI")));
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

/// Bytes the accounting check allocates: small enough for any device.
const ACCOUNTING_BYTES: u64 = 1 << 20;

fn check_accounting(device: &Device) -> Outcome {
    let before = device.mem_info().map_err(fail_with("mem_info"))?;
    let bytes = ACCOUNTING_BYTES.min(before.free / 4).max(1);
    let buf = device.alloc(bytes).map_err(fail_with("alloc"))?;
    let during = device.mem_info().map_err(fail_with("mem_info"));
    let freed = device.free(buf).map_err(fail_with("free"));
    let during = during?;
    freed?;
    device.synchronize().map_err(fail_with("synchronize"))?;
    let after = device.mem_info().map_err(fail_with("mem_info"))?;
    if before.free.saturating_sub(during.free) < bytes {
        return Err(fail(format!(
            "free memory dropped from {} to {} bytes after allocating {bytes} bytes",
            before.free, during.free
        )));
    }
    if after.free != before.free {
        return Err(fail(format!(
            "free memory was {} bytes before allocating and {} after freeing",
            before.free, after.free
        )));
    }
    Ok(())
}

fn check_out_of_memory(device: &Device) -> Outcome {
    let info = device.mem_info().map_err(fail_with("mem_info"))?;
    let bytes = info.free.saturating_add(1);
    let result = device.alloc(bytes);
    if let Ok(buf) = result {
        let _ = device.free(buf);
        return Err(fail(format!(
            "alloc({bytes}) succeeded with {} bytes free; expected out_of_memory",
            info.free
        )));
    }
    expect_code(
        &format!("alloc({bytes}) with {} bytes free", info.free),
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
    expect_code("free(null)", code, device.free(BufferHandle::NULL))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| u8::try_from(i % 251).unwrap_or(0).wrapping_mul(7) ^ seed)
        .collect()
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
    let mut whole = vec![0u8; 256];
    device.read(buf, 0, &mut whole).map_err(fail_with("read"))?;
    if whole != expected {
        return Err(fail("read after write returned different bytes"));
    }
    let mut part = vec![0u8; 50];
    device
        .read(buf, 37, &mut part)
        .map_err(fail_with("read at offset 37"))?;
    if part != expected[37..87] {
        return Err(fail("read at offset 37 returned different bytes"));
    }
    let mut last = [0u8; 1];
    device
        .read(buf, 255, &mut last)
        .map_err(fail_with("read of the last byte"))?;
    if last[0] != expected[255] {
        return Err(fail("the last byte read back differs"));
    }
    scratch.finish()
}

fn check_copy(device: &Device) -> Outcome {
    let mut scratch = Scratch::new(device);
    let a = scratch.alloc(128)?;
    let b = scratch.alloc(128)?;
    let src = pattern(128, 0x11);
    let zeros = vec![0u8; 128];
    device.write(a, 0, &src).map_err(fail_with("write"))?;
    device.write(b, 0, &zeros).map_err(fail_with("write"))?;
    device
        .copy(b, 8, a, 16, 64)
        .map_err(fail_with("copy between buffers"))?;
    device
        .copy(a, 96, a, 0, 32)
        .map_err(fail_with("copy within a buffer"))?;
    device.synchronize().map_err(fail_with("synchronize"))?;
    let mut got = vec![0u8; 128];
    device.read(b, 0, &mut got).map_err(fail_with("read"))?;
    let mut want = zeros;
    want[8..72].copy_from_slice(&src[16..80]);
    if got != want {
        return Err(fail("copy between buffers moved the wrong bytes"));
    }
    device.read(a, 0, &mut got).map_err(fail_with("read"))?;
    let mut want = src.clone();
    want[96..128].copy_from_slice(&src[0..32]);
    if got != want {
        return Err(fail("copy within a buffer moved the wrong bytes"));
    }
    scratch.finish()
}

fn check_copy_regions(device: &Device) -> Outcome {
    let mut scratch = Scratch::new(device);
    let a = scratch.alloc(256)?;
    let b = scratch.alloc(256)?;
    let src = pattern(256, 0x21);
    let zeros = vec![0u8; 256];
    device.write(a, 0, &src).map_err(fail_with("write"))?;
    device.write(b, 0, &zeros).map_err(fail_with("write"))?;
    let regions = [
        CopyRegion {
            src_offset: 0,
            dst_offset: 128,
            bytes: 32,
        },
        CopyRegion {
            src_offset: 200,
            dst_offset: 0,
            bytes: 56,
        },
        CopyRegion {
            src_offset: 64,
            dst_offset: 64,
            bytes: 0,
        },
        CopyRegion {
            src_offset: 40,
            dst_offset: 170,
            bytes: 10,
        },
    ];
    device
        .copy_regions(b, a, &regions)
        .map_err(fail_with("copy_regions between buffers"))?;
    let within = [
        CopyRegion {
            src_offset: 0,
            dst_offset: 200,
            bytes: 16,
        },
        CopyRegion {
            src_offset: 16,
            dst_offset: 240,
            bytes: 16,
        },
    ];
    device
        .copy_regions(a, a, &within)
        .map_err(fail_with("copy_regions within a buffer"))?;
    device.synchronize().map_err(fail_with("synchronize"))?;
    let mut want_b = zeros;
    for region in &regions {
        let (s, d, n) = (
            index(region.src_offset),
            index(region.dst_offset),
            index(region.bytes),
        );
        want_b[d..d + n].copy_from_slice(&src[s..s + n]);
    }
    let mut got = vec![0u8; 256];
    device.read(b, 0, &mut got).map_err(fail_with("read"))?;
    if got != want_b {
        return Err(fail("copy_regions between buffers moved the wrong bytes"));
    }
    let mut want_a = src.clone();
    want_a[200..216].copy_from_slice(&src[0..16]);
    want_a[240..256].copy_from_slice(&src[16..32]);
    device.read(a, 0, &mut got).map_err(fail_with("read"))?;
    if got != want_a {
        return Err(fail("copy_regions within a buffer moved the wrong bytes"));
    }
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
    let regions = [
        CopyRegion {
            src_offset: 0,
            dst_offset: 0,
            bytes: 8,
        },
        CopyRegion {
            src_offset: 60,
            dst_offset: 0,
            bytes: 8,
        },
    ];
    expect_code(
        "copy_regions with a region past the end",
        code,
        device.copy_regions(b, a, &regions),
    )?;
    scratch.finish()
}

// ---------------------------------------------------------------------------------------------
// Ops against host references
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct GemmVariant {
    name: &'static str,
    bias: bool,
    activation: Activation,
    accumulate: bool,
    w_transposed: bool,
    strided_a: bool,
}

impl GemmVariant {
    const PLAIN: GemmVariant = GemmVariant {
        name: "plain",
        bias: false,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        strided_a: false,
    };
}

fn case_gemm(device: &Device, dtype: DType, variant: GemmVariant) -> Outcome {
    const M: u64 = 5;
    const K: u64 = 24;
    const N: u64 = 7;
    let mut scratch = Scratch::new(device);
    let a_stride = if variant.strided_a { K + 5 } else { K };
    let (a, a_h) = scratch.upload_strided(dtype, M, K, a_stride, &values(1, M * K, 1.0))?;
    // Stored as [n, k], or [k, n] when transposed; `w_at(n, k)` reads either.
    let w_values = values(2, N * K, 0.5);
    let (w, w_h) = if variant.w_transposed {
        scratch.upload(dtype, K, N, &w_values)?
    } else {
        scratch.upload(dtype, N, K, &w_values)?
    };
    let w_at = |n: u64, k: u64| -> f64 {
        let i = if variant.w_transposed {
            k * N + n
        } else {
            n * K + k
        };
        f64::from(w_h[index(i)])
    };
    let (bias, bias_h) = if variant.bias {
        let (mat, host) = scratch.upload(dtype, 1, N, &values(3, N, 1.0))?;
        (mat, host)
    } else {
        (MatRef::NONE, vec![0.0; index(N)])
    };
    let (out, prior) = if variant.accumulate {
        scratch.upload(dtype, M, N, &values(4, M * N, 1.0))?
    } else {
        (scratch.output(dtype, M, N)?, vec![0.0; index(M * N)])
    };
    let args = GemmArgs {
        a,
        w,
        bias,
        out,
        activation: variant.activation,
        accumulate: variant.accumulate,
        w_transposed: variant.w_transposed,
    };
    op_result(device, OpKind::GEMM, device.gemm(&args))?;
    let mut want = Vec::with_capacity(index(M * N));
    for m in 0..M {
        for n in 0..N {
            let mut acc = f64::from(bias_h[index(n)]);
            for k in 0..K {
                acc += f64::from(a_h[index(m * K + k)]) * w_at(n, k);
            }
            let mut value = activate(variant.activation, acc);
            if variant.accumulate {
                value += f64::from(prior[index(m * N + n)]);
            }
            want.push(value);
        }
    }
    compare(dtype, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_norm(device: &Device, dtype: DType, rms: bool, in_place: bool) -> Outcome {
    const ROWS: u64 = 4;
    const COLS: u64 = 48;
    const EPS: f32 = 1e-5;
    let op = if rms {
        OpKind::RMS_NORM
    } else {
        OpKind::LAYER_NORM
    };
    let mut scratch = Scratch::new(device);
    // An offset keeps the mean away from zero, so layer norm's centring matters.
    let x_values: Vec<f32> = values(5, ROWS * COLS, 2.0)
        .into_iter()
        .map(|v| v + 0.75)
        .collect();
    let (x, x_h) = scratch.upload(dtype, ROWS, COLS, &x_values)?;
    let (weight, w_h) = scratch.upload(dtype, 1, COLS, &values(6, COLS, 1.5))?;
    let (bias, b_h) = if rms {
        (MatRef::NONE, vec![0.0; index(COLS)])
    } else {
        scratch.upload(dtype, 1, COLS, &values(7, COLS, 1.0))?
    };
    let out = if in_place {
        x
    } else {
        scratch.output(dtype, ROWS, COLS)?
    };
    let args = NormArgs {
        x,
        weight,
        bias,
        out,
        eps: EPS,
    };
    let result = if rms {
        device.rms_norm(&args)
    } else {
        device.layer_norm(&args)
    };
    op_result(device, op, result)?;
    let cols = index(COLS);
    let mut want = Vec::with_capacity(x_h.len());
    for row in x_h.chunks_exact(cols) {
        let row: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        let n = f64::from(u32::try_from(cols).unwrap_or(1));
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f64>() / n
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let inv = 1.0 / (var + f64::from(EPS)).sqrt();
        for c in 0..cols {
            want.push((row[c] - mean) * inv * f64::from(w_h[c]) + f64::from(b_h[c]));
        }
    }
    compare(dtype, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_activation(device: &Device, dtype: DType, activation: Activation) -> Outcome {
    const ROWS: u64 = 3;
    const COLS: u64 = 40;
    let mut scratch = Scratch::new(device);
    let (x, x_h) = scratch.upload(dtype, ROWS, COLS, &values(8, ROWS * COLS, 4.0))?;
    let out = scratch.output(dtype, ROWS, COLS)?;
    let args = ActivationArgs { x, out, activation };
    op_result(device, OpKind::ACTIVATION, device.activation(&args))?;
    let want: Vec<f64> = x_h
        .iter()
        .map(|&v| activate(activation, f64::from(v)))
        .collect();
    compare(dtype, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_binary(device: &Device, dtype: DType, op: BinaryOp, broadcast: bool) -> Outcome {
    const ROWS: u64 = 4;
    const COLS: u64 = 33;
    let mut scratch = Scratch::new(device);
    let (a, a_h) = scratch.upload(dtype, ROWS, COLS, &values(9, ROWS * COLS, 2.0))?;
    let b_rows = if broadcast { 1 } else { ROWS };
    let (b, b_h) = scratch.upload(dtype, b_rows, COLS, &values(10, b_rows * COLS, 2.0))?;
    let out = scratch.output(dtype, ROWS, COLS)?;
    let args = BinaryArgs { a, b, out, op };
    op_result(device, OpKind::BINARY, device.binary(&args))?;
    let cols = index(COLS);
    let want: Vec<f64> = a_h
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let y = if broadcast { b_h[i % cols] } else { b_h[i] };
            let (x, y) = (f64::from(x), f64::from(y));
            if op == BinaryOp::MUL { x * y } else { x + y }
        })
        .collect();
    compare(dtype, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_rope(device: &Device, dtype: DType) -> Outcome {
    const TOKENS: u64 = 6;
    const HEADS: u64 = 2;
    const HEAD_DIM: u64 = 16;
    const THETA: f32 = 10_000.0;
    let mut scratch = Scratch::new(device);
    let (x, x_h) = scratch.upload(
        dtype,
        TOKENS,
        HEADS * HEAD_DIM,
        &values(11, TOKENS * HEADS * HEAD_DIM, 1.0),
    )?;
    // (row, col) of a 2 x 3 grid.
    let positions: Vec<u32> = (0..3u32 * 2).flat_map(|t| [t / 3, t % 3]).collect();
    let args = Rope2dArgs {
        x,
        heads: HEADS,
        head_dim: HEAD_DIM,
        positions: positions.as_slice().into(),
        theta: THETA,
    };
    op_result(device, OpKind::ROPE_2D, device.rope_2d(&args))?;
    let d = index(HEAD_DIM);
    let half = d / 2;
    let quarter = d / 4;
    let quarter_f = f64::from(u32::try_from(quarter).unwrap_or(1));
    let mut want: Vec<f64> = x_h.iter().map(|&v| f64::from(v)).collect();
    for t in 0..index(TOKENS) {
        let (row, col) = (f64::from(positions[2 * t]), f64::from(positions[2 * t + 1]));
        for h in 0..index(HEADS) {
            let base = (t * index(HEADS) + h) * d;
            for c in 0..half {
                let (pos, i) = if c < quarter {
                    (row, c)
                } else {
                    (col, c - quarter)
                };
                let i = f64::from(u32::try_from(i).unwrap_or(0));
                let freq = f64::from(THETA).powf(-i / quarter_f);
                let (sin, cos) = (pos * freq).sin_cos();
                let x1 = f64::from(x_h[base + c]);
                let x2 = f64::from(x_h[base + c + half]);
                want[base + c] = x1 * cos - x2 * sin;
                want[base + c + half] = x2 * cos + x1 * sin;
            }
        }
    }
    compare(dtype, &scratch.download(&x)?, &want)?;
    scratch.finish()
}

fn case_attention(device: &Device, dtype: DType) -> Outcome {
    const TOKENS: u64 = 9;
    const HEADS: u64 = 2;
    const HEAD_DIM: u64 = 8;
    const HEAD_DIM_F32: f32 = 8.0;
    let width = HEADS * HEAD_DIM;
    let mut scratch = Scratch::new(device);
    // One fused [tokens, 3 · width] buffer; q, k and v are strided views into it.
    let (qkv, qkv_h) = scratch.upload(
        dtype,
        TOKENS,
        3 * width,
        &values(12, TOKENS * 3 * width, 1.0),
    )?;
    let size = elem_size(dtype);
    let view = |part: u64| MatRef {
        offset: part * width * size,
        cols: width,
        ..qkv
    };
    let (q, k, v) = (view(0), view(1), view(2));
    let out = scratch.output(dtype, TOKENS, width)?;
    // Three segments, one of them empty.
    let cu_seqlens: Vec<u32> = vec![0, 4, 4, 9];
    let scale = HEAD_DIM_F32.sqrt().recip();
    let mut args = AttentionArgs {
        q,
        k,
        v,
        out,
        heads: HEADS,
        head_dim: HEAD_DIM,
        scale,
        cu_seqlens: cu_seqlens.as_slice().into(),
        workspace: BufferSlice::EMPTY,
    };
    let bytes = op_result(device, OpKind::ATTENTION, device.attention_workspace(&args))?;
    if bytes > 0 {
        let buf = scratch.alloc(bytes)?;
        args.workspace = BufferSlice {
            buf,
            offset: 0,
            bytes,
        };
    }
    op_result(device, OpKind::ATTENTION, device.attention(&args))?;
    let row = index(3 * width);
    let (w, hd) = (index(width), index(HEAD_DIM));
    let at = |t: usize, part: usize, h: usize, c: usize| {
        f64::from(qkv_h[t * row + part * w + h * hd + c])
    };
    let mut want = vec![0.0f64; index(TOKENS * width)];
    for segment in cu_seqlens.windows(2) {
        let (start, end) = (index(u64::from(segment[0])), index(u64::from(segment[1])));
        for h in 0..index(HEADS) {
            for i in start..end {
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
                    want[i * w + h * hd + c] = value;
                }
            }
        }
    }
    compare(dtype, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_gather(device: &Device, dtype: DType) -> Outcome {
    const ROWS: u64 = 6;
    const COLS: u64 = 5;
    let mut scratch = Scratch::new(device);
    let (src, src_h) = scratch.upload(dtype, ROWS, COLS, &values(13, ROWS * COLS, 3.0))?;
    let indices: Vec<u32> = vec![5, 0, 2, 2, 4];
    let out = scratch.output(dtype, 5, COLS)?;
    let args = GatherArgs {
        src,
        out,
        indices: indices.as_slice().into(),
    };
    op_result(device, OpKind::GATHER_ROWS, device.gather_rows(&args))?;
    let cols = index(COLS);
    let want: Vec<f64> = indices
        .iter()
        .flat_map(|&i| {
            let start = index(u64::from(i)) * cols;
            src_h[start..start + cols].iter().map(|&v| f64::from(v))
        })
        .collect();
    // Moving rows is exact.
    compare_with(0.0, &scratch.download(&out)?, &want)?;
    scratch.finish()
}

fn case_cast(device: &Device, from: DType, to: DType) -> Outcome {
    const ROWS: u64 = 3;
    const COLS: u64 = 21;
    let mut scratch = Scratch::new(device);
    let (src, src_h) = scratch.upload(from, ROWS, COLS, &values(14, ROWS * COLS, 50.0))?;
    let out = scratch.output(to, ROWS, COLS)?;
    let args = CastArgs { src, out };
    op_result(device, OpKind::CAST, device.cast(&args))?;
    // Round to nearest even is exact and specified; allow only the last bit of slack.
    let slack = match to {
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
        _ => 1e-7,
    };
    let want: Vec<f64> = src_h.iter().map(|&v| f64::from(round_to(to, v))).collect();
    compare_with(slack, &scratch.download(&out)?, &want)?;
    scratch.finish()
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
        for dtype in DType::ALL {
            assert_eq!(decode(dtype, &encode(dtype, &values)), values);
        }
    }

    #[test]
    fn comparison_reports_the_first_mismatch() {
        assert!(compare_with(1e-4, &[1.0, 2.0], &[1.0, 2.0001]).is_ok());
        let Err(Problem::Fail(text)) = compare_with(1e-4, &[1.0, 2.5], &[1.0, 2.0]) else {
            panic!("a mismatch must fail");
        };
        assert!(text.contains("index 1"), "{text}");
    }

    #[test]
    fn status_serialises_with_a_lowercase_tag_and_detail() {
        let check = Check {
            name: "x".into(),
            status: Status::Fail("why".into()),
        };
        let json = serde_json::to_string(&check).unwrap();
        assert_eq!(json, r#"{"name":"x","status":"fail","detail":"why"}"#);
    }
}
