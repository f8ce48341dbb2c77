//! GEMM: `out = act(a · Wᵀ + bias) (+ out)` through cuBLASLt (f16, bf16, and f32 with the
//! `tf32` option) or cuBLAS (f32 in full f32), with f32 accumulation in every case.
//!
//! Row-major views are read as column-major matrices without copies: `out[m, n]` row-major is
//! `outᵀ` column-major (`n x m`, leading dimension = the row stride), so the library computes
//! `outᵀ = W · aᵀ` with `W` transposed unless `w` is stored `[k, n]`.
//!
//! What the library does not fuse runs in one small kernel after it (`gemm_epilogue_*`):
//! cuBLASLt applies the bias (from an aligned copy in the workspace when the bias is not
//! aligned for it); cuBLAS does not. Activations always run in that kernel: cuBLASLt's GELU
//! epilogue is not the tanh formula computed in f32 (on an H200 with cuBLASLt 13.1 it left 40%
//! of f16 and bf16 outputs off the once-rounded result, up to 125 f16 ulps, in the tails), and
//! the libraries fuse no other activation. An output is rounded to its type once: an
//! accumulating GEMM with an activation, and an f16/bf16 GEMM with an activation, compute the
//! product into an f32 scratch in the workspace, then `out = act(t + bias) (+ out)` in f32.
//! Scratch for the libraries (and that f32 product) comes from the host's workspace, sized by
//! `gemm_workspace`, so the host accounts every byte.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Instant;

use cudarc::driver::sys::CUstream;
use iris_plugin::abi::{Activation, DType, GemmArgs, PluginError};
use iris_plugin::validate::{self, Checker, Gemm};

use super::{
    Access, Compute, THREADS, addr, dim, dtype_name, i64_of, kernel_args, lanes_grid, lock,
    optional_addr,
};
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::result::{cublas, cublaslt};
use crate::sys::cublas as cublas_sys;
use crate::sys::cublaslt::{self as lt_sys, CublasLt};

/// Library scratch on Hopper (what NVIDIA recommends for cuBLAS there).
const WORKSPACE_HOPPER: u64 = 32 << 20;
/// Library scratch on earlier architectures.
const WORKSPACE_DEFAULT: u64 = 4 << 20;
/// Alignment cuBLASLt is told at most, as a power of two (its default assumption, 256 bytes).
const MAX_ALIGNMENT_LOG2: u32 = 8;
/// Alignment cuBLAS and cuBLASLt require of their workspace (`cublasSetWorkspace` refuses less).
/// The host's workspace may start at any offset, so the plugin asks for this much minus one
/// more and rounds the start up.
pub(crate) const WORKSPACE_ALIGNMENT: u64 = 256;
/// The split-K reduction schemes cuBLASLt's heuristic may choose: partial sums in the compute
/// type (f32) in the workspace, or no split (`CUBLASLT_REDUCTION_SCHEME_NONE`, 0, is no bit).
const REDUCTION_SCHEMES: u32 =
    lt_sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;

/// Bias addresses cuBLASLt's bias epilogue is given only when aligned this much; others are
/// copied to an aligned place in the workspace first.
const BIAS_ALIGNMENT: u64 = 16;

kernel_args! {
    /// `gemm_epilogue_<dtype>(src, src_f32, ss, out, os, bias, rows, cols, kind, accumulate,
    /// lanes)`: `out = act(src + bias) (+ out)`; `src` 0 is a zero product, `bias` 0 none.
    struct EpilogueKernel {
        src: u64, src_f32: i32, ss: i64, out: u64, os: i64, bias: u64, rows: i64, cols: i64,
        kind: i32, accumulate: i32, lanes: i32,
    }
}

/// cuBLASLt set-ups already made, by problem: its descriptors, layouts and algorithm, or that
/// cuBLASLt has no algorithm for it and cuBLAS computes it. Building them costs several library
/// calls and a heuristic search; a tower runs the same few problems thousands of times.
#[derive(Default)]
pub struct GemmState {
    plans: HashMap<AlgoKey, LtPlan>,
}

/// What cuBLASLt was found to do for one problem.
enum LtPlan {
    /// Its descriptors and the algorithm the heuristic chose for them.
    Ready(Box<LtSetup>),
    /// The heuristic had no algorithm: cuBLAS computes the product.
    UseCublas,
}

/// A matmul descriptor (whose bias pointer is set per call, under the state's lock), the
/// layouts of W, a and the output, and the chosen algorithm.
struct LtSetup {
    desc: MatmulDesc,
    a_layout: Layout,
    b_layout: Layout,
    d_layout: Layout,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// SAFETY: cuBLASLt descriptors are plain host objects the library does not tie to a thread;
// they are used only under the `GemmState` mutex.
unsafe impl Send for LtSetup {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    dtype: u32,
    f32_out: bool,
    transa: bool,
    dims: [u64; 6],
    epilogue: u32,
    alignments: [u32; 4],
    workspace: u64,
    tf32: bool,
}

/// What one GEMM call does, decided from shapes and dtypes only (the workspace query must not
/// depend on buffers).
struct Plan {
    /// Through cuBLASLt (else cuBLAS).
    lt: bool,
    /// The product goes into an f32 scratch first, and the epilogue kernel computes bias,
    /// activation and accumulation from it with one rounding: an accumulating GEMM with an
    /// activation, or an f16/bf16 output with an activation cuBLASLt does not fuse.
    via_scratch: bool,
    /// Library scratch bytes.
    library_workspace: u64,
    /// Bytes of the f32 product scratch.
    scratch_bytes: u64,
    /// Bytes of an aligned copy of the bias, for cuBLASLt's bias epilogue when the bias itself
    /// is not aligned for it.
    bias_stage_bytes: u64,
}

impl CudaDevice {
    pub(crate) fn gemm_workspace_impl(&self, args: &GemmArgs) -> Result<u64, PluginError> {
        let gemm = validate::gemm(&Checker::shapes_only("gemm_workspace"), args)?;
        let compute = self.compute("gemm_workspace")?;
        Ok(compute.plan(&gemm, args)?.workspace_bytes())
    }

    pub(crate) fn gemm_impl(&self, args: &GemmArgs) -> Result<(), PluginError> {
        let op = "gemm";
        let gemm = self.with_checker(op, |check| validate::gemm(check, args))?;
        let compute = self.compute(op)?;
        let plan = compute.plan(&gemm, args)?;
        let needed = plan.workspace_bytes();
        let mut operands = vec![("a", &gemm.a), ("w", &gemm.w), ("out", &gemm.out)];
        if let Some(bias) = &gemm.bias {
            operands.push(("bias", bias));
        }
        self.with_checker(op, |check| {
            check.workspace(&args.workspace, needed, &operands)
        })?;
        if gemm.m == 0 || gemm.n == 0 {
            return Ok(());
        }
        let out = addr(self, op, &gemm.out)?;
        let bias = optional_addr(self, op, &gemm.bias)?;
        let stream = self.cu_stream();
        let epilogue = |src: u64,
                        src_f32: bool,
                        src_stride: u64,
                        bias: u64,
                        kind: Activation,
                        accumulate: bool| {
            compute.epilogue(
                stream, &gemm, out, src, src_f32, src_stride, bias, kind, accumulate,
            )
        };
        if gemm.k == 0 {
            // The product is zero: only the bias, the activation and the accumulation remain.
            return epilogue(0, false, 0, bias, args.activation, args.accumulate)
                .map_err(|err| err.into_plugin(op));
        }
        let workspace = if needed == 0 {
            0
        } else {
            self.view(op, args.workspace.buf)?.at(args.workspace.offset)
        };
        let workspace = align_workspace(workspace);
        let operands = Operands {
            a: addr(self, op, &gemm.a)?,
            w: addr(self, op, &gemm.w)?,
            library_workspace: (workspace, plan.library_workspace),
        };
        let outcome = if plan.via_scratch {
            let scratch = workspace + plan.library_workspace;
            compute
                .product(
                    stream,
                    &gemm,
                    args,
                    &plan,
                    &operands,
                    Product::scratch(scratch, gemm.n as u64),
                )
                .and_then(|_| {
                    epilogue(
                        scratch,
                        true,
                        gemm.n as u64,
                        bias,
                        args.activation,
                        args.accumulate,
                    )
                })
        } else {
            // cuBLASLt takes the bias (from an aligned copy when the bias is not aligned for
            // it), so the output is rounded once; an f32 output takes the activation after.
            let lt_bias = if plan.lt && bias != 0 {
                if bias % BIAS_ALIGNMENT == 0 {
                    bias
                } else {
                    let stage = workspace + plan.bias_stage_offset();
                    compute
                        .stage_bias(stream, stage, bias, plan.bias_stage_bytes)
                        .map_err(|err| err.into_plugin(op))?;
                    stage
                }
            } else {
                0
            };
            let product = Product {
                ptr: out,
                ld: gemm.out.stride as u64,
                f32: false,
                beta: if args.accumulate { 1.0 } else { 0.0 },
                bias: lt_bias,
            };
            compute
                .product(stream, &gemm, args, &plan, &operands, product)
                .and_then(|fused| {
                    let rest_bias = if fused.bias { 0 } else { bias };
                    let rest_act = args.activation;
                    if rest_bias == 0 && rest_act == Activation::NONE {
                        Ok(())
                    } else {
                        epilogue(
                            out,
                            false,
                            gemm.out.stride as u64,
                            rest_bias,
                            rest_act,
                            false,
                        )
                    }
                })
        };
        outcome.map_err(|err| err.into_plugin(op))
    }
}

impl Plan {
    /// What `gemm_workspace` asks the host for: the scratches, the bias copy, and the slack to
    /// align them.
    fn workspace_bytes(&self) -> u64 {
        let used = self.bias_stage_offset() + self.bias_stage_bytes;
        if used == 0 {
            0
        } else {
            used + WORKSPACE_ALIGNMENT - 1
        }
    }

    /// Where the bias copy starts, from the aligned start of the workspace (after the library's
    /// share and the f32 product, rounded up to the alignment).
    fn bias_stage_offset(&self) -> u64 {
        let end = self.library_workspace + self.scratch_bytes;
        if self.bias_stage_bytes == 0 {
            end
        } else {
            end.next_multiple_of(WORKSPACE_ALIGNMENT)
        }
    }
}

/// The workspace's start rounded up to [`WORKSPACE_ALIGNMENT`]; [`Plan::workspace_bytes`]
/// holds the slack. The f32 product scratch after the library's share is aligned too.
fn align_workspace(start: u64) -> u64 {
    start.next_multiple_of(WORKSPACE_ALIGNMENT)
}

/// What the library applied of what a [`Product`] asked for.
#[derive(Debug, Clone, Copy)]
struct Fused {
    bias: bool,
}

/// Device addresses of the inputs and the library's share of the workspace.
struct Operands {
    a: u64,
    w: u64,
    library_workspace: (u64, u64),
}

/// Where the product goes and what the library fuses into it.
struct Product {
    ptr: u64,
    ld: u64,
    f32: bool,
    beta: f32,
    bias: u64,
}

impl Product {
    fn scratch(ptr: u64, ld: u64) -> Product {
        Product {
            ptr,
            ld,
            f32: true,
            beta: 0.0,
            bias: 0,
        }
    }
}

impl Compute {
    /// Copies `bytes` of bias from `bias` to the aligned `stage` in the workspace, in stream
    /// order before the product that reads it.
    fn stage_bias(
        &self,
        stream: CUstream,
        stage: u64,
        bias: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: `bias` is a checked view of `bytes` bytes; `stage` lies in the host's
        // workspace, which `Plan::workspace_bytes` sized to hold it.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(stage, bias, crate::usize_of(bytes), stream)
        }
        .map_err(|err| CudaError::driver("cuMemcpyDtoDAsync", err))
    }

    fn plan(&self, gemm: &Gemm, args: &GemmArgs) -> Result<Plan, PluginError> {
        let dtype = gemm.a.dtype;
        if dtype == DType::BF16 && self.cc < crate::device::BF16_COMPUTE_CAPABILITY {
            return Err(PluginError::unsupported(format!(
                "gemm: bf16 needs compute capability 8.0, this device has {}.{}",
                self.cc.0, self.cc.1
            )));
        }
        let limit = i32::MAX as usize;
        let too_big = [
            gemm.m,
            gemm.n,
            gemm.k,
            gemm.a.stride,
            gemm.w.stride,
            gemm.out.stride,
        ]
        .into_iter()
        .any(|value| value > limit);
        if too_big {
            return Err(PluginError::unsupported(format!(
                "gemm: dimensions and row strides must be below 2^31 (m {}, n {}, k {})",
                gemm.m, gemm.n, gemm.k
            )));
        }
        let lt = dtype != DType::F32 || self.tf32;
        let activated = args.activation != Activation::NONE;
        // A half-precision output rounded before the activation would be rounded twice.
        let via_scratch = activated && (args.accumulate || dtype != DType::F32);
        let library_workspace = if gemm.k == 0 || gemm.m == 0 || gemm.n == 0 {
            0
        } else if self.cc.0 >= 9 {
            WORKSPACE_HOPPER
        } else {
            WORKSPACE_DEFAULT
        };
        let scratch_bytes = if via_scratch && gemm.k > 0 {
            (gemm.m as u64) * (gemm.n as u64) * 4
        } else {
            0
        };
        let bias_stage_bytes = match &gemm.bias {
            Some(bias) if lt && !via_scratch && gemm.k > 0 => {
                (gemm.n as u64) * bias.dtype.size().unwrap_or(4)
            }
            _ => 0,
        };
        Ok(Plan {
            lt,
            via_scratch,
            library_workspace,
            scratch_bytes,
            bias_stage_bytes,
        })
    }

    /// Enqueues the product into `product` through cuBLASLt or cuBLAS, and says what of the
    /// bias and activation the library applied. When cuBLASLt has no algorithm for a problem
    /// (an alignment or layout it does not take), cuBLAS computes the product instead and the
    /// caller applies the bias and activation.
    fn product(
        &self,
        stream: CUstream,
        gemm: &Gemm,
        args: &GemmArgs,
        plan: &Plan,
        operands: &Operands,
        product: Product,
    ) -> Result<Fused, CudaError> {
        let unfused = Fused { bias: false };
        if !plan.lt {
            return self
                .product_blas(gemm, args, operands, &product)
                .map(|()| unfused);
        }
        match self.product_lt(stream, gemm, args, operands, &product) {
            Ok(()) => Ok(Fused {
                bias: product.bias != 0,
            }),
            Err(CudaError::Blas {
                call: "cublasLtMatmulAlgoGetHeuristic",
                ..
            }) => self
                .product_blas(gemm, args, operands, &product)
                .map(|()| unfused),
            Err(err) => Err(err),
        }
    }

    fn product_blas(
        &self,
        gemm: &Gemm,
        args: &GemmArgs,
        operands: &Operands,
        product: &Product,
    ) -> Result<(), CudaError> {
        let (ws, ws_bytes) = operands.library_workspace;
        let transa = if args.w_transposed {
            cublas_sys::cublasOperation_t::CUBLAS_OP_N
        } else {
            cublas_sys::cublasOperation_t::CUBLAS_OP_T
        };
        let compute_type = if self.tf32 {
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let input_type = match gemm.a.dtype {
            DType::F16 => cublas_sys::cudaDataType::CUDA_R_16F,
            DType::BF16 => cublas_sys::cudaDataType::CUDA_R_16BF,
            _ => cublas_sys::cudaDataType::CUDA_R_32F,
        };
        let output_type = if product.f32 {
            cublas_sys::cudaDataType::CUDA_R_32F
        } else {
            input_type
        };
        // Half-precision inputs always accumulate in f32; TF32 only concerns f32 inputs.
        let compute_type = if gemm.a.dtype == DType::F32 {
            compute_type
        } else {
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let int = |value: u64| {
            i32::try_from(value)
                .map_err(|_| CudaError::Unsupported(format!("gemm: {value} is 2^31 or more")))
        };
        let (n, m, k) = (
            int(gemm.n as u64)?,
            int(gemm.m as u64)?,
            int(gemm.k as u64)?,
        );
        let (lda, ldb, ldc) = (
            int(gemm.w.stride as u64)?,
            int(gemm.a.stride as u64)?,
            int(product.ld)?,
        );
        let (alpha, beta) = (1.0f32, product.beta);
        // The handle keeps the workspace pointer between calls: set and use it under one lock.
        let _guard = lock(&self.gemm);
        // SAFETY: the handle is alive; the workspace is `ws_bytes` of live device memory the
        // host lent for this call (queue-ordered, so reusing it later is safe); all operand
        // addresses and leading dimensions describe checked views (dimensions below 2^31).
        unsafe {
            cublas::set_workspace(
                &self.libs.cublas,
                self.blas.raw,
                ws as *mut c_void,
                crate::usize_of(ws_bytes),
            )
            .map_err(|e| CudaError::blas("cublasSetWorkspace", e))?;
            cublas::gemm_ex(
                &self.libs.cublas,
                self.blas.raw,
                transa,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                (&alpha as *const f32).cast(),
                operands.w as *const c_void,
                input_type,
                lda,
                operands.a as *const c_void,
                input_type,
                ldb,
                (&beta as *const f32).cast(),
                product.ptr as *mut c_void,
                output_type,
                ldc,
                compute_type,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|e| CudaError::blas("cublasGemmEx", e))
        }
    }

    fn product_lt(
        &self,
        stream: CUstream,
        gemm: &Gemm,
        args: &GemmArgs,
        operands: &Operands,
        product: &Product,
    ) -> Result<(), CudaError> {
        let lt_err = |call: &'static str| move |e| CudaError::blas(call, e);
        let epilogue = if product.bias != 0 {
            lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        } else {
            lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
        };
        let (ws, ws_bytes) = operands.library_workspace;
        let key = AlgoKey {
            dtype: gemm.a.dtype.0,
            f32_out: product.f32,
            transa: args.w_transposed,
            dims: [
                gemm.m as u64,
                gemm.n as u64,
                gemm.k as u64,
                gemm.w.stride as u64,
                gemm.a.stride as u64,
                product.ld,
            ],
            epilogue: epilogue as u32,
            alignments: [
                alignment(operands.w),
                alignment(operands.a),
                alignment(product.ptr),
                alignment(product.ptr),
            ],
            workspace: ws_bytes,
            tf32: self.tf32,
        };
        // The bias pointer is set on the shared descriptor and read by the matmul enqueued
        // right after: both under the lock.
        let mut state = lock(&self.gemm);
        // A problem seen for the first time costs a heuristic search and, where the library
        // loads its kernels lazily, their loading in the first matmul's call: both are timed
        // and logged (debug), so that a slow first request names what it waited for.
        let mut first_seen = None;
        let plan = match state.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                let started = Instant::now();
                let plan = entry.insert(self.set_up_lt(&key)?);
                first_seen = Some((started.elapsed(), Instant::now()));
                plan
            }
        };
        let setup = match plan {
            LtPlan::Ready(setup) => setup,
            LtPlan::UseCublas => {
                return Err(CudaError::Blas {
                    call: "cublasLtMatmulAlgoGetHeuristic",
                    status: "no algorithm (cached)".into(),
                    alloc_failed: false,
                });
            }
        };
        if product.bias != 0 {
            let bias_ptr = product.bias as *const c_void;
            // SAFETY: the attribute takes a device pointer; the value outlives the call.
            unsafe {
                cublaslt::set_matmul_desc_attribute(
                    &self.libs.cublaslt,
                    setup.desc.raw,
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&bias_ptr as *const *const c_void).cast(),
                    std::mem::size_of::<*const c_void>(),
                )
            }
            .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
        }
        let (alpha, beta) = (1.0f32, product.beta);
        // SAFETY: descriptors are alive; A, B, C = D and the bias are checked views of live
        // buffers (C is D, read when beta is 1); the workspace is the host's, `ws_bytes` long;
        // the algorithm was chosen for exactly these descriptors.
        unsafe {
            cublaslt::matmul(
                &self.libs.cublaslt,
                self.lt.raw,
                setup.desc.raw,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                operands.w as *const c_void,
                setup.a_layout.raw,
                operands.a as *const c_void,
                setup.b_layout.raw,
                product.ptr as *const c_void,
                setup.d_layout.raw,
                product.ptr as *mut c_void,
                setup.d_layout.raw,
                &setup.algo,
                ws as *mut c_void,
                crate::usize_of(ws_bytes),
                stream.cast(),
            )
        }
        .map_err(lt_err("cublasLtMatmul"))?;
        if let Some((heuristic, enqueue)) = first_seen {
            self.log.debug(format!(
                "cuBLASLt problem {}x{}x{} ({}{}{}): heuristic {:.2} ms, first matmul call {:.2} ms",
                gemm.m,
                gemm.n,
                gemm.k,
                dtype_name(gemm.a.dtype),
                if product.f32 { " to f32" } else { "" },
                if product.bias != 0 { ", bias" } else { "" },
                heuristic.as_secs_f64() * 1e3,
                enqueue.elapsed().as_secs_f64() * 1e3,
            ));
        }
        Ok(())
    }

    /// Builds cuBLASLt's descriptors for the problem `key` and asks its heuristic for an
    /// algorithm; an empty answer is [`LtPlan::UseCublas`].
    fn set_up_lt(&self, key: &AlgoKey) -> Result<LtPlan, CudaError> {
        let lt_err = |call: &'static str| move |e| CudaError::blas(call, e);
        let dtype = DType(key.dtype);
        let data_type = match dtype {
            DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
            _ => lt_sys::cudaDataType::CUDA_R_32F,
        };
        let out_type = if key.f32_out {
            lt_sys::cudaDataType::CUDA_R_32F
        } else {
            data_type
        };
        let compute_type = if dtype == DType::F32 && key.tf32 {
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let [m, n, k, w_ld, a_ld, out_ld] = key.dims;
        let lib = &self.libs.cublaslt;
        let desc = MatmulDesc {
            lib,
            raw: cublaslt::create_matmul_desc(lib, compute_type, lt_sys::cudaDataType::CUDA_R_32F)
                .map_err(lt_err("cublasLtMatmulDescCreate"))?,
        };
        let transa: i32 = if key.transa {
            cublas_sys::cublasOperation_t::CUBLAS_OP_N as i32
        } else {
            cublas_sys::cublasOperation_t::CUBLAS_OP_T as i32
        };
        // A stored [k, n] when not transposed (read transposed), [n, k] when it is.
        let (a_rows, a_cols) = if key.transa { (n, k) } else { (k, n) };
        let a_layout = Layout::new(lib, data_type, a_rows, a_cols, w_ld)?;
        let b_layout = Layout::new(lib, data_type, k, m, a_ld)?;
        let d_layout = Layout::new(lib, out_type, n, m, out_ld)?;
        let pref = Preference {
            lib,
            raw: cublaslt::create_matmul_pref(lib)
                .map_err(lt_err("cublasLtMatmulPreferenceCreate"))?,
        };
        // SAFETY: each attribute value is the type the attribute takes (i32 operation, u32
        // epilogue, u64 and u32 preferences) and outlives the call.
        unsafe {
            let set_desc = |attr, value: *const c_void, size| {
                cublaslt::set_matmul_desc_attribute(lib, desc.raw, attr, value, size)
                    .map_err(lt_err("cublasLtMatmulDescSetAttribute"))
            };
            set_desc(
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transa as *const i32).cast(),
                4,
            )?;
            set_desc(
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&key.epilogue as *const u32).cast(),
                4,
            )?;
            let set_pref = |attr, value: *const c_void, size| {
                cublaslt::set_matmul_pref_attribute(lib, pref.raw, attr, value, size)
                    .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))
            };
            set_pref(
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&key.workspace as *const u64).cast(),
                8,
            )?;
            let prefs = [
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            for (attr, value) in prefs.into_iter().zip(key.alignments.iter()) {
                set_pref(attr, (value as *const u32).cast(), 4)?;
            }
            // Split-K partial sums only in the f32 compute type (or no split): cuBLASLt's
            // default mask also allows summing them in place in an f16/bf16 output, which rounds
            // every partial sum and breaks the one-rounding contract (PyTorch sets the same
            // mask when reduced-precision reductions are disallowed).
            let reductions = REDUCTION_SCHEMES;
            set_pref(
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                (&reductions as *const u32).cast(),
                4,
            )?;
        }
        // SAFETY: every descriptor is alive and describes the operands.
        let heuristic = unsafe {
            cublaslt::get_matmul_algo_heuristic(
                lib,
                self.lt.raw,
                desc.raw,
                a_layout.raw,
                b_layout.raw,
                d_layout.raw,
                d_layout.raw,
                pref.raw,
            )
        };
        match heuristic {
            Ok(algo) => Ok(LtPlan::Ready(Box::new(LtSetup {
                desc,
                a_layout,
                b_layout,
                d_layout,
                algo,
            }))),
            Err(_) => Ok(LtPlan::UseCublas),
        }
    }

    /// `out = act(src + bias) (+ out)` over the gemm's output.
    #[allow(clippy::too_many_arguments)]
    fn epilogue(
        &self,
        stream: CUstream,
        gemm: &Gemm,
        out: u64,
        src: u64,
        src_f32: bool,
        src_stride: u64,
        bias: u64,
        kind: Activation,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let out_bytes = gemm.out.dtype.size().unwrap_or(4);
        let (rows, cols) = (gemm.m as u64, gemm.n as u64);
        let mut views = vec![Access::of(out, &gemm.out)];
        if src != 0 {
            views.push(Access {
                addr: src,
                stride: src_stride,
                elem_bytes: if src_f32 { 4 } else { out_bytes },
            });
        }
        if bias != 0 {
            views.push(Access {
                addr: bias,
                stride: 0,
                elem_bytes: out_bytes,
            });
        }
        let lanes = self.lanes(rows, cols, &views);
        let mut launch = EpilogueKernel {
            src,
            src_f32: i32::from(src_f32),
            ss: i64_of(src_stride),
            out,
            os: dim(gemm.out.stride),
            bias,
            rows: dim(gemm.m),
            cols: dim(gemm.n),
            kind: i32::try_from(kind.0).unwrap_or(0),
            accumulate: i32::from(accumulate),
            lanes: lanes as i32,
        };
        let name = format!("gemm_epilogue_{}", dtype_name(gemm.out.dtype));
        self.launch(
            stream,
            &name,
            lanes_grid(rows, cols, lanes),
            THREADS,
            &mut launch,
        )
    }
}

/// The largest power of two dividing `ptr`, capped at 2^[`MAX_ALIGNMENT_LOG2`].
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(MAX_ALIGNMENT_LOG2)
}

/// A cuBLASLt matmul descriptor, destroyed on drop.
struct MatmulDesc {
    lib: &'static CublasLt,
    raw: lt_sys::cublasLtMatmulDesc_t,
}

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created once with `lib`, destroyed once.
        let _ = unsafe { cublaslt::destroy_matmul_desc(self.lib, self.raw) };
    }
}

/// A cuBLASLt matmul preference, destroyed on drop.
struct Preference {
    lib: &'static CublasLt,
    raw: lt_sys::cublasLtMatmulPreference_t,
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created once with `lib`, destroyed once.
        let _ = unsafe { cublaslt::destroy_matmul_pref(self.lib, self.raw) };
    }
}

/// A cuBLASLt matrix layout, destroyed on drop.
struct Layout {
    lib: &'static CublasLt,
    raw: lt_sys::cublasLtMatrixLayout_t,
}

impl Layout {
    fn new(
        lib: &'static CublasLt,
        dtype: lt_sys::cudaDataType,
        rows: u64,
        cols: u64,
        ld: u64,
    ) -> Result<Layout, CudaError> {
        let ld = i64::try_from(ld)
            .map_err(|_| CudaError::Unsupported(format!("leading dimension {ld}")))?;
        cublaslt::create_matrix_layout(lib, dtype, rows, cols, ld)
            .map(|raw| Layout { lib, raw })
            .map_err(|e| CudaError::blas("cublasLtMatrixLayoutCreate", e))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created once with `lib`, destroyed once.
        let _ = unsafe { cublaslt::destroy_matrix_layout(self.lib, self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspaces_are_rounded_up_to_256_bytes_within_the_slack() {
        assert_eq!(align_workspace(0x1000), 0x1000);
        assert_eq!(align_workspace(0x1001), 0x1100);
        assert_eq!(align_workspace(0x10ff), 0x1100);
        let plan = Plan {
            lt: true,
            via_scratch: true,
            library_workspace: WORKSPACE_DEFAULT,
            scratch_bytes: 12,
            bias_stage_bytes: 40,
        };
        let start = 0x1001;
        let stage = align_workspace(start) + plan.bias_stage_offset();
        assert_eq!(stage % WORKSPACE_ALIGNMENT, 0);
        assert!(stage >= align_workspace(start) + plan.library_workspace + plan.scratch_bytes);
        assert!(stage + plan.bias_stage_bytes <= start + plan.workspace_bytes());
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
    }
}
