//! Argument checks every backend runs before it enqueues work, so that no backend re-implements
//! them: buffers are known, byte ranges lie inside their buffers, views are aligned for their
//! dtype, shapes and dtypes agree, outputs do not overlap inputs the contract keeps apart,
//! scalars are in range, and workspaces are large enough.
//!
//! A backend builds a [`Checker`] for one call from the op's name and a way to look up a
//! buffer's length, then calls the function for its op: [`gemm`], [`norm`], [`activation`],
//! [`binary`], [`rotary`], [`attention`], [`gather_rows`], [`cast`], [`fill`],
//! [`copy_batch`], [`range`]. Each returns the checked operands as [`Mat`]s (dimensions as
//! `usize`, the byte range touched) or an [`ErrorCode::INVALID_ARGUMENT`](crate::abi::ErrorCode::INVALID_ARGUMENT) error whose message
//! starts with the op and names the argument at fault.
//!
//! Workspace queries run the same functions with [`Checker::shapes_only`]: buffer handles are
//! not looked up and overlaps are not checked, since a caller may size a workspace before any
//! operand exists (every handle then null).
//!
//! What cannot be checked when a call is made is the content of device memory (gather
//! indices, device-side segment boundaries): those are the caller's obligation, documented on
//! each argument struct.
//!
//! ```
//! use iris_plugin::abi::{BufferHandle, DType, MatRef};
//! use iris_plugin::validate::Checker;
//!
//! // A device with one buffer of 64 bytes, handle 1.
//! let lens = |buf: BufferHandle| (buf.0 == 1).then_some(64);
//! let check = Checker::new("gemm", &lens);
//! let fits = MatRef::contiguous(BufferHandle(1), 0, DType::F32, 4, 4);
//! assert_eq!(check.mat("a", &fits).unwrap().rows, 4);
//! let too_big = MatRef::contiguous(BufferHandle(1), 0, DType::F32, 5, 4);
//! let err = check.mat("a", &too_big).unwrap_err();
//! assert!(err.message.contains("gemm: `a`"), "{}", err.message);
//! ```

use std::fmt;

use crate::abi::{
    Activation, ActivationArgs, AttentionArgs, BinaryArgs, BinaryOp, BufferHandle, BufferSlice,
    CastArgs, CopyRegion, DType, FillArgs, GatherArgs, GemmArgs, MatRef, NormArgs, PluginError,
    RotaryArgs,
};

/// Checks the arguments of one call of `op`.
pub struct Checker<'a> {
    op: &'a str,
    lens: Option<&'a dyn Fn(BufferHandle) -> Option<u64>>,
}

impl<'a> Checker<'a> {
    /// A checker that looks buffers up with `lens` (the buffer's length in bytes, or `None`
    /// for a handle the device does not know).
    pub fn new(op: &'a str, lens: &'a dyn Fn(BufferHandle) -> Option<u64>) -> Checker<'a> {
        Checker {
            op,
            lens: Some(lens),
        }
    }

    /// A checker for workspace queries: shapes, dtypes and scalars only.
    pub fn shapes_only(op: &'a str) -> Checker<'a> {
        Checker { op, lens: None }
    }

    /// The op's name.
    pub fn op(&self) -> &str {
        self.op
    }

    /// An invalid-argument error for this op.
    pub fn error(&self, message: impl fmt::Display) -> PluginError {
        PluginError::invalid_argument(format!("{}: {message}", self.op))
    }

    /// Checks a view on its own: known buffer, known dtype, `row_stride >= cols`, an offset
    /// aligned to the element size, a byte range inside the buffer, dimensions that fit in
    /// `usize`.
    pub fn mat(&self, name: &str, m: &MatRef) -> Result<Mat, PluginError> {
        let Some(size) = m.dtype.size() else {
            return Err(self.error(format!("`{name}`: unknown dtype {}", m.dtype)));
        };
        if m.row_stride < m.cols {
            return Err(self.error(format!(
                "`{name}`: row_stride {} is smaller than cols {}",
                m.row_stride, m.cols
            )));
        }
        if m.row_stride > isize::MAX as u64 / size {
            return Err(self.error(format!(
                "`{name}`: row_stride {} is too large",
                m.row_stride
            )));
        }
        if !m.offset.is_multiple_of(size) {
            return Err(self.error(format!(
                "`{name}`: offset {} is not a multiple of the {} element size {size}",
                m.offset, m.dtype
            )));
        }
        let (start, end) = m.byte_range().ok_or_else(|| {
            self.error(format!(
                "`{name}`: a [{}, {}] view with row_stride {} at offset {} overflows",
                m.rows, m.cols, m.row_stride, m.offset
            ))
        })?;
        self.inside(name, m.buf, start, end - start)?;
        Ok(Mat {
            buf: m.buf,
            offset: m.offset,
            end,
            dtype: m.dtype,
            rows: self.fits(name, m.rows)?,
            cols: self.fits(name, m.cols)?,
            stride: self.fits(name, m.row_stride)?,
        })
    }

    /// [`Checker::mat`], or `None` for [`MatRef::NONE`].
    pub fn optional(&self, name: &str, m: &MatRef) -> Result<Option<Mat>, PluginError> {
        if m.is_none() {
            Ok(None)
        } else {
            self.mat(name, m).map(Some)
        }
    }

    /// A float view (`f32`, `f16` or `bf16`).
    pub fn float(&self, name: &str, m: &MatRef) -> Result<Mat, PluginError> {
        let mat = self.mat(name, m)?;
        if !mat.dtype.is_float() {
            return Err(self.error(format!(
                "`{name}`: dtype {} is not a float type (f32, f16, bf16)",
                mat.dtype
            )));
        }
        Ok(mat)
    }

    /// Checks that `[offset, offset + len)` lies inside `buf` (when buffers are looked up).
    pub fn inside(
        &self,
        name: &str,
        buf: BufferHandle,
        offset: u64,
        len: u64,
    ) -> Result<(), PluginError> {
        let Some(lens) = self.lens else {
            return Ok(());
        };
        let Some(buffer_len) = lens(buf) else {
            return Err(self.error(format!("`{name}`: unknown buffer handle {}", buf.0)));
        };
        match offset.checked_add(len) {
            Some(end) if end <= buffer_len => Ok(()),
            _ => Err(self.error(format!(
                "`{name}`: bytes [{offset}, {offset}+{len}) lie outside the buffer of {buffer_len} bytes"
            ))),
        }
    }

    /// Checks a caller's workspace against the bytes the device needs, and that it does not
    /// overlap any operand.
    pub fn workspace(
        &self,
        ws: &BufferSlice,
        needed: u64,
        operands: &[(&str, &Mat)],
    ) -> Result<(), PluginError> {
        if needed == 0 {
            return Ok(());
        }
        if ws.bytes < needed {
            return Err(self.error(format!(
                "`workspace`: {} bytes given, {needed} needed",
                ws.bytes
            )));
        }
        self.inside("workspace", ws.buf, ws.offset, ws.bytes)?;
        let end = ws.offset.saturating_add(ws.bytes);
        for (name, mat) in operands {
            if mat.buf == ws.buf && !mat.is_empty() && ws.offset < mat.end && mat.offset < end {
                return Err(self.error(format!("`workspace` overlaps `{name}`")));
            }
        }
        Ok(())
    }

    /// Fails if `out` overlaps `x` at all. Not checked in shapes-only mode, where handles
    /// may be placeholders.
    pub fn disjoint(
        &self,
        out_name: &str,
        out: &Mat,
        x_name: &str,
        x: &Mat,
    ) -> Result<(), PluginError> {
        if self.lens.is_some() && out.overlaps(x) {
            Err(self.overlap(out_name, x_name, "at all, even as"))
        } else {
            Ok(())
        }
    }

    /// Fails unless `out` is exactly `x` or does not overlap it (not checked in shapes-only
    /// mode).
    pub fn alias_or_disjoint(
        &self,
        out_name: &str,
        out: &Mat,
        x_name: &str,
        x: &Mat,
    ) -> Result<(), PluginError> {
        if self.lens.is_none() || out.same_as(x) || !out.overlaps(x) {
            Ok(())
        } else {
            Err(self.overlap(out_name, x_name, "unless it is exactly"))
        }
    }

    /// Fails unless `m` is `[rows, cols]`.
    pub fn shape(&self, name: &str, m: &Mat, rows: usize, cols: usize) -> Result<(), PluginError> {
        if m.rows == rows && m.cols == cols {
            Ok(())
        } else {
            Err(self.error(format!(
                "`{name}`: expected shape [{rows}, {cols}], got [{}, {}]",
                m.rows, m.cols
            )))
        }
    }

    /// Fails unless `m` has `dtype` (the dtype of operand `other`).
    pub fn same_dtype(
        &self,
        name: &str,
        m: &Mat,
        dtype: DType,
        other: &str,
    ) -> Result<(), PluginError> {
        if m.dtype == dtype {
            Ok(())
        } else {
            Err(self.error(format!(
                "`{name}`: dtype {} differs from `{other}`'s {dtype}",
                m.dtype
            )))
        }
    }

    /// Fails unless `m` has exactly `dtype`.
    pub fn dtype(&self, name: &str, m: &Mat, dtype: DType) -> Result<(), PluginError> {
        if m.dtype == dtype {
            Ok(())
        } else {
            Err(self.error(format!("`{name}`: expected dtype {dtype}, got {}", m.dtype)))
        }
    }

    /// Fails unless `act` is an activation this ABI version defines.
    pub fn activation(&self, name: &str, act: Activation) -> Result<(), PluginError> {
        if Activation::ALL.contains(&act) {
            Ok(())
        } else {
            Err(self.error(format!("`{name}`: unknown activation {}", act.0)))
        }
    }

    /// `value` as `usize`, or an error naming it.
    pub fn fits(&self, name: &str, value: u64) -> Result<usize, PluginError> {
        usize::try_from(value)
            .map_err(|_| self.error(format!("`{name}`: {value} does not fit in memory")))
    }

    fn overlap(&self, out_name: &str, x_name: &str, rule: &str) -> PluginError {
        self.error(format!(
            "`{out_name}` overlaps `{x_name}`; it may not overlap it {rule} the same view"
        ))
    }
}

/// A checked view: the buffer and byte range it touches, its dtype and its dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mat {
    /// The buffer.
    pub buf: BufferHandle,
    /// Byte offset of element (0, 0).
    pub offset: u64,
    /// End of the touched byte range.
    pub end: u64,
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements between row starts.
    pub stride: usize,
}

impl Mat {
    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// Whether rows follow each other without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.stride == self.cols || self.rows <= 1
    }

    /// Whether the byte ranges of the two views intersect (empty views never do).
    pub fn overlaps(&self, other: &Mat) -> bool {
        self.buf == other.buf
            && !self.is_empty()
            && !other.is_empty()
            && self.offset < other.end
            && other.offset < self.end
    }

    /// Whether the two views are the same elements in the same layout.
    pub fn same_as(&self, other: &Mat) -> bool {
        self.buf == other.buf
            && self.offset == other.offset
            && self.dtype == other.dtype
            && self.rows == other.rows
            && self.cols == other.cols
            && (self.stride == other.stride || self.rows <= 1)
    }
}

/// Checked [`GemmArgs`].
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// `[m, k]`.
    pub a: Mat,
    /// `[n, k]`, or `[k, n]` when transposed.
    pub w: Mat,
    /// `[1, n]`.
    pub bias: Option<Mat>,
    /// `[m, n]`.
    pub out: Mat,
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
}

/// Checks [`GemmArgs`] (not its workspace; see [`Checker::workspace`]).
pub fn gemm(check: &Checker<'_>, args: &GemmArgs) -> Result<Gemm, PluginError> {
    let a = check.float("a", &args.a)?;
    let w = check.float("w", &args.w)?;
    let bias = check.optional("bias", &args.bias)?;
    let out = check.float("out", &args.out)?;
    check.activation("activation", args.activation)?;
    let (m, k) = (a.rows, a.cols);
    let (n, wk) = if args.w_transposed {
        (w.cols, w.rows)
    } else {
        (w.rows, w.cols)
    };
    if wk != k {
        let shape = if args.w_transposed {
            "[k, n]"
        } else {
            "[n, k]"
        };
        return Err(check.error(format!(
            "`w`: shape [{}, {}] read as {shape} has k = {wk}, but `a` has k = {k}",
            w.rows, w.cols
        )));
    }
    check.same_dtype("w", &w, a.dtype, "a")?;
    if let Some(bias) = &bias {
        check.same_dtype("bias", bias, a.dtype, "a")?;
        check.shape("bias", bias, 1, n)?;
    }
    check.same_dtype("out", &out, a.dtype, "a")?;
    check.shape("out", &out, m, n)?;
    check.disjoint("out", &out, "a", &a)?;
    check.disjoint("out", &out, "w", &w)?;
    if let Some(bias) = &bias {
        check.disjoint("out", &out, "bias", bias)?;
    }
    Ok(Gemm {
        a,
        w,
        bias,
        out,
        m,
        n,
        k,
    })
}

/// Checked [`NormArgs`].
#[derive(Debug, Clone, Copy)]
pub struct Norm {
    /// Input `[rows, cols]`.
    pub x: Mat,
    /// `[1, cols]`.
    pub weight: Mat,
    /// `[1, cols]` (layer norm only).
    pub bias: Option<Mat>,
    /// Output, `x` itself or disjoint from it.
    pub out: Mat,
}

/// Checks [`NormArgs`]; `rms` forbids a bias.
pub fn norm(check: &Checker<'_>, args: &NormArgs, rms: bool) -> Result<Norm, PluginError> {
    let x = check.float("x", &args.x)?;
    let weight = check.mat("weight", &args.weight)?;
    let bias = if args.bias.is_none() {
        None
    } else if rms {
        return Err(check.error("`bias` must be absent (MatRef::NONE) for RMS norm"));
    } else {
        Some(check.mat("bias", &args.bias)?)
    };
    let out = check.mat("out", &args.out)?;
    let cols = x.cols;
    check.same_dtype("weight", &weight, x.dtype, "x")?;
    check.shape("weight", &weight, 1, cols)?;
    if let Some(bias) = &bias {
        check.same_dtype("bias", bias, x.dtype, "x")?;
        check.shape("bias", bias, 1, cols)?;
    }
    check.same_dtype("out", &out, x.dtype, "x")?;
    check.shape("out", &out, x.rows, cols)?;
    check.alias_or_disjoint("out", &out, "x", &x)?;
    // An output overlapping the parameters would change them while other rows read them.
    check.disjoint("out", &out, "weight", &weight)?;
    if let Some(bias) = &bias {
        check.disjoint("out", &out, "bias", bias)?;
    }
    if !(args.eps >= 0.0 && args.eps.is_finite()) {
        return Err(check.error(format!(
            "`eps`: expected a finite value >= 0, got {}",
            args.eps
        )));
    }
    Ok(Norm {
        x,
        weight,
        bias,
        out,
    })
}

/// Checks [`ActivationArgs`]; returns `(x, out)`.
pub fn activation(check: &Checker<'_>, args: &ActivationArgs) -> Result<(Mat, Mat), PluginError> {
    let x = check.float("x", &args.x)?;
    let out = check.mat("out", &args.out)?;
    check.same_dtype("out", &out, x.dtype, "x")?;
    check.shape("out", &out, x.rows, x.cols)?;
    check.alias_or_disjoint("out", &out, "x", &x)?;
    check.activation("activation", args.activation)?;
    if args.activation == Activation::NONE {
        return Err(check.error("`activation`: `none` is not an activation function"));
    }
    Ok((x, out))
}

/// Checked [`BinaryArgs`].
#[derive(Debug, Clone, Copy)]
pub struct Binary {
    /// `[rows, cols]`.
    pub a: Mat,
    /// `[rows, cols]` or `[1, cols]`.
    pub b: Mat,
    /// `[rows, cols]`.
    pub out: Mat,
    /// Whether `b` is one row broadcast over `a`'s rows.
    pub broadcast: bool,
}

/// Checks [`BinaryArgs`].
pub fn binary(check: &Checker<'_>, args: &BinaryArgs) -> Result<Binary, PluginError> {
    let a = check.float("a", &args.a)?;
    let b = check.mat("b", &args.b)?;
    let out = check.mat("out", &args.out)?;
    check.same_dtype("b", &b, a.dtype, "a")?;
    check.same_dtype("out", &out, a.dtype, "a")?;
    let broadcast = b.rows == 1 && a.rows != 1;
    if !broadcast {
        check.shape("b", &b, a.rows, a.cols)?;
    } else if b.cols != a.cols {
        return Err(check.error(format!(
            "`b`: expected shape [{}, {}] or [1, {}], got [{}, {}]",
            a.rows, a.cols, a.cols, b.rows, b.cols
        )));
    }
    check.shape("out", &out, a.rows, a.cols)?;
    check.alias_or_disjoint("out", &out, "a", &a)?;
    if broadcast {
        check.disjoint("out", &out, "b", &b)?;
    } else {
        check.alias_or_disjoint("out", &out, "b", &b)?;
    }
    if args.op != BinaryOp::ADD && args.op != BinaryOp::MUL {
        return Err(check.error(format!("`op`: unknown binary op {}", args.op.0)));
    }
    Ok(Binary {
        a,
        b,
        out,
        broadcast,
    })
}

/// Checked [`RotaryArgs`].
#[derive(Debug, Clone, Copy)]
pub struct Rotary {
    /// `[tokens, heads · head_dim]`.
    pub x: Mat,
    /// f32 `[tokens, head_dim]`.
    pub cos: Mat,
    /// f32 `[tokens, head_dim]`.
    pub sin: Mat,
    /// Heads per row.
    pub heads: usize,
    /// Channels per head (even).
    pub head_dim: usize,
}

/// Checks [`RotaryArgs`].
pub fn rotary(check: &Checker<'_>, args: &RotaryArgs) -> Result<Rotary, PluginError> {
    let x = check.float("x", &args.x)?;
    let cos = check.mat("cos", &args.cos)?;
    let sin = check.mat("sin", &args.sin)?;
    let heads = check.fits("heads", args.heads)?;
    let head_dim = check.fits("head_dim", args.head_dim)?;
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(check.error(format!(
            "`head_dim`: expected a positive even number, got {head_dim}"
        )));
    }
    if heads.checked_mul(head_dim) != Some(x.cols) {
        return Err(check.error(format!(
            "`heads` {heads} x `head_dim` {head_dim} does not equal `x`'s {} columns",
            x.cols
        )));
    }
    for (name, table) in [("cos", &cos), ("sin", &sin)] {
        check.dtype(name, table, DType::F32)?;
        check.shape(name, table, x.rows, head_dim)?;
        check.disjoint("x", &x, name, table)?;
    }
    Ok(Rotary {
        x,
        cos,
        sin,
        heads,
        head_dim,
    })
}

/// Checked [`AttentionArgs`].
#[derive(Debug, Clone)]
pub struct Attention {
    /// Queries `[tokens, heads · head_dim]`.
    pub q: Mat,
    /// Keys.
    pub k: Mat,
    /// Values.
    pub v: Mat,
    /// Output.
    pub out: Mat,
    /// Device-side boundaries, i32 `[1, segments + 1]`.
    pub cu_seqlens_device: Mat,
    /// Heads.
    pub heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Tokens.
    pub tokens: usize,
    /// `(start, length)` of every segment.
    pub segments: Vec<(usize, usize)>,
}

/// Checks [`AttentionArgs`], including the host boundaries and `max_seqlen`. With
/// [`Checker::shapes_only`] it is what a workspace query runs.
pub fn attention(check: &Checker<'_>, args: &AttentionArgs<'_>) -> Result<Attention, PluginError> {
    let q = check.float("q", &args.q)?;
    let k = check.mat("k", &args.k)?;
    let v = check.mat("v", &args.v)?;
    let out = check.mat("out", &args.out)?;
    let (tokens, cols) = (q.rows, q.cols);
    for (name, view) in [("k", &k), ("v", &v), ("out", &out)] {
        check.same_dtype(name, view, q.dtype, "q")?;
        check.shape(name, view, tokens, cols)?;
    }
    let heads = check.fits("heads", args.heads)?;
    let head_dim = check.fits("head_dim", args.head_dim)?;
    if head_dim == 0 || heads == 0 || heads.checked_mul(head_dim) != Some(cols) {
        return Err(check.error(format!(
            "`heads` {heads} x `head_dim` {head_dim} does not equal the {cols} columns of `q`"
        )));
    }
    if !args.scale.is_finite() {
        return Err(check.error(format!(
            "`scale`: expected a finite value, got {}",
            args.scale
        )));
    }
    for (name, view) in [("q", &q), ("k", &k), ("v", &v)] {
        check.disjoint("out", &out, name, view)?;
    }
    let segments = segments(check, args.cu_seqlens.as_slice(), tokens)?;
    let longest = segments.iter().map(|s| s.1).max().unwrap_or(0);
    if check.fits("max_seqlen", args.max_seqlen)? != longest {
        return Err(check.error(format!(
            "`max_seqlen`: {} given, but the longest segment of `cu_seqlens` has {longest} tokens",
            args.max_seqlen
        )));
    }
    let cu_seqlens_device = check.mat("cu_seqlens_device", &args.cu_seqlens_device)?;
    check.dtype("cu_seqlens_device", &cu_seqlens_device, DType::I32)?;
    check.shape(
        "cu_seqlens_device",
        &cu_seqlens_device,
        1,
        args.cu_seqlens.len(),
    )?;
    check.disjoint("out", &out, "cu_seqlens_device", &cu_seqlens_device)?;
    Ok(Attention {
        q,
        k,
        v,
        out,
        cu_seqlens_device,
        heads,
        head_dim,
        tokens,
        segments,
    })
}

/// Checks [`GatherArgs`]; returns `(src, out, indices)`.
pub fn gather_rows(check: &Checker<'_>, args: &GatherArgs) -> Result<(Mat, Mat, Mat), PluginError> {
    let src = check.mat("src", &args.src)?;
    let out = check.mat("out", &args.out)?;
    let indices = check.mat("indices", &args.indices)?;
    check.dtype("indices", &indices, DType::I32)?;
    if indices.rows != 1 && !(indices.rows == 0 && out.rows == 0) {
        return Err(check.error(format!(
            "`indices`: expected a [1, len] vector, got [{}, {}]",
            indices.rows, indices.cols
        )));
    }
    check.same_dtype("out", &out, src.dtype, "src")?;
    check.shape("out", &out, indices.cols, src.cols)?;
    check.disjoint("out", &out, "src", &src)?;
    check.disjoint("out", &out, "indices", &indices)?;
    Ok((src, out, indices))
}

/// Checks [`CastArgs`]; returns `(src, out)`. Both are float views of one shape, disjoint
/// unless they are the same view of one dtype.
pub fn cast(check: &Checker<'_>, args: &CastArgs) -> Result<(Mat, Mat), PluginError> {
    let src = check.float("src", &args.src)?;
    let out = check.float("out", &args.out)?;
    check.shape("out", &out, src.rows, src.cols)?;
    if !out.same_as(&src) {
        check.disjoint("out", &out, "src", &src)?;
    }
    Ok((src, out))
}

/// Checks [`FillArgs`]: width 1, 2 or 4, alignment, range inside the buffer.
pub fn fill(check: &Checker<'_>, args: &FillArgs) -> Result<(), PluginError> {
    let width = args.width;
    if !matches!(width, 1 | 2 | 4) {
        return Err(check.error(format!("`width`: expected 1, 2 or 4, got {width}")));
    }
    let dst = &args.dst;
    let width = u64::from(width);
    if !dst.offset.is_multiple_of(width) || !dst.bytes.is_multiple_of(width) {
        return Err(check.error(format!(
            "`dst`: offset {} and length {} must be multiples of the width {width}",
            dst.offset, dst.bytes
        )));
    }
    if width < 4 && args.value >> (8 * width) != 0 {
        return Err(check.error(format!(
            "`value`: {:#x} does not fit in {width} bytes",
            args.value
        )));
    }
    if dst.bytes == 0 {
        return Ok(());
    }
    check.inside("dst", dst.buf, dst.offset, dst.bytes)
}

/// Checks a batched copy: every range inside its buffer, and no destination overlapping another
/// region's destination or any region's source.
pub fn copy_batch(check: &Checker<'_>, regions: &[CopyRegion]) -> Result<(), PluginError> {
    for (index, region) in regions.iter().enumerate() {
        if region.bytes == 0 {
            continue;
        }
        check.inside(
            &format!("regions[{index}].src"),
            region.src,
            region.src_offset,
            region.bytes,
        )?;
        check.inside(
            &format!("regions[{index}].dst"),
            region.dst,
            region.dst_offset,
            region.bytes,
        )?;
    }
    // Sort destinations and sources by (buffer, start) so overlaps are found in O(n log n);
    // a step's gather can hold thousands of regions.
    let mut dsts: Vec<(BufferHandle, u64, u64, usize)> = regions
        .iter()
        .enumerate()
        .filter(|(_, r)| r.bytes > 0)
        .map(|(i, r)| (r.dst, r.dst_offset, r.dst_offset + r.bytes, i))
        .collect();
    dsts.sort_unstable();
    for pair in dsts.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.0 == b.0 && b.1 < a.2 {
            return Err(check.error(format!(
                "`regions[{}]`'s destination overlaps `regions[{}]`'s destination",
                b.3, a.3
            )));
        }
    }
    for (index, region) in regions.iter().enumerate() {
        if region.bytes == 0 {
            continue;
        }
        let (start, end) = (region.src_offset, region.src_offset + region.bytes);
        // The destination ranges of one buffer are sorted and disjoint: only the one starting
        // last before `end` can overlap.
        let at = dsts.partition_point(|d| (d.0, d.1) < (region.src, end));
        if let Some(d) = at.checked_sub(1).map(|i| dsts[i])
            && d.0 == region.src
            && d.2 > start
        {
            return Err(check.error(format!(
                "`regions[{}]`'s destination overlaps `regions[{index}]`'s source",
                d.3
            )));
        }
    }
    Ok(())
}

/// Checks a plain byte range of one buffer (`write`, `read`).
pub fn range(
    check: &Checker<'_>,
    name: &str,
    buf: BufferHandle,
    offset: u64,
    len: u64,
) -> Result<(), PluginError> {
    check.inside(name, buf, offset, len)
}

/// The `(start, length)` of each segment of `cu`, which must start at 0, never decrease and end
/// at `tokens`.
fn segments(
    check: &Checker<'_>,
    cu: &[u32],
    tokens: usize,
) -> Result<Vec<(usize, usize)>, PluginError> {
    if cu.first() != Some(&0) {
        return Err(check.error("`cu_seqlens`: must start with 0"));
    }
    let mut segments = Vec::with_capacity(cu.len() - 1);
    for (i, pair) in cu.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(check.error(format!(
                "`cu_seqlens`: decreases at index {}: {} after {}",
                i + 1,
                pair[1],
                pair[0]
            )));
        }
        segments.push((pair[0] as usize, (pair[1] - pair[0]) as usize));
    }
    let last = cu[cu.len() - 1] as usize;
    if last != tokens {
        return Err(check.error(format!(
            "`cu_seqlens`: ends at {last}, but `q` has {tokens} tokens"
        )));
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(buf: BufferHandle) -> Option<u64> {
        match buf.0 {
            1 => Some(1024),
            2 => Some(256),
            _ => None,
        }
    }

    fn region(src: u64, src_offset: u64, dst: u64, dst_offset: u64, bytes: u64) -> CopyRegion {
        CopyRegion {
            src: BufferHandle(src),
            src_offset,
            dst: BufferHandle(dst),
            dst_offset,
            bytes,
        }
    }

    #[test]
    fn views_outside_their_buffer_or_misaligned_are_named() {
        let check = Checker::new("op", &lens);
        let view = MatRef::contiguous(BufferHandle(2), 2, DType::F32, 1, 4);
        let err = check.mat("x", &view).unwrap_err();
        assert!(err.message.contains("`x`: offset 2"), "{}", err.message);
        let view = MatRef::contiguous(BufferHandle(3), 0, DType::F32, 1, 4);
        let err = check.mat("x", &view).unwrap_err();
        assert!(
            err.message.contains("unknown buffer handle 3"),
            "{}",
            err.message
        );
        // Shapes only: the unknown handle is not looked up.
        assert!(Checker::shapes_only("op").mat("x", &view).is_ok());
    }

    #[test]
    fn batched_copies_reject_overlapping_destinations_and_sources() {
        let check = Checker::new("copy_batch", &lens);
        let ok = [
            region(1, 0, 2, 0, 64),
            region(1, 64, 2, 64, 64),
            region(2, 200, 1, 512, 8),
        ];
        assert!(copy_batch(&check, &ok).is_ok());
        let dst_overlap = [region(1, 0, 2, 0, 64), region(1, 64, 2, 32, 64)];
        let err = copy_batch(&check, &dst_overlap).unwrap_err();
        assert!(
            err.message.contains("destination overlaps"),
            "{}",
            err.message
        );
        let src_overlap = [region(1, 0, 1, 100, 64), region(1, 120, 2, 0, 8)];
        let err = copy_batch(&check, &src_overlap).unwrap_err();
        assert!(
            err.message.contains("overlaps `regions[1]`'s source"),
            "{}",
            err.message
        );
        let outside = [region(2, 250, 1, 0, 8)];
        assert!(copy_batch(&check, &outside).is_err());
    }

    #[test]
    fn fills_check_width_alignment_and_value() {
        let check = Checker::new("fill", &lens);
        let dst = BufferSlice {
            buf: BufferHandle(2),
            offset: 4,
            bytes: 8,
        };
        let fill_args = |value, width| FillArgs { dst, value, width };
        assert!(fill(&check, &fill_args(0x3f80_0000, 4)).is_ok());
        assert!(fill(&check, &fill_args(0, 3)).is_err());
        assert!(fill(&check, &fill_args(0x1_0000, 2)).is_err());
        let misaligned = FillArgs {
            dst: BufferSlice { offset: 2, ..dst },
            value: 0,
            width: 4,
        };
        assert!(fill(&check, &misaligned).is_err());
    }

    #[test]
    fn attention_checks_boundaries_and_max_seqlen() {
        let check = Checker::shapes_only("attention");
        let q = MatRef::contiguous(BufferHandle(1), 0, DType::F32, 10, 8);
        let cu = [0u32, 4, 10];
        let mut args = AttentionArgs {
            q,
            k: MatRef { offset: 320, ..q },
            v: MatRef { offset: 640, ..q },
            out: MatRef {
                buf: BufferHandle(2),
                offset: 0,
                ..q
            },
            heads: 2,
            head_dim: 4,
            scale: 0.5,
            cu_seqlens: cu.as_slice().into(),
            cu_seqlens_device: MatRef::vector(BufferHandle(2), 0, DType::I32, 3),
            max_seqlen: 6,
            workspace: BufferSlice::EMPTY,
        };
        // The device boundaries overlap `out` in buffer 2: only a full check sees it.
        let lens = |_| Some(4096);
        let err = attention(&Checker::new("attention", &lens), &args).unwrap_err();
        assert!(err.message.contains("cu_seqlens_device"), "{}", err.message);
        assert!(attention(&check, &args).is_ok());
        args.cu_seqlens_device.offset = 400;
        let checked = attention(&check, &args).unwrap();
        assert_eq!(checked.segments, vec![(0, 4), (4, 6)]);
        args.max_seqlen = 5;
        assert!(attention(&check, &args).is_err());
    }
}
