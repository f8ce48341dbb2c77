//! Which encoder ops a part and the loaded op libraries can run, and why the others cannot.

use std::collections::HashMap;

use iris_plugin::abi::OpKind;

use crate::error::AscendError;
use crate::runtime::{Runtime, aclnn};
use crate::soc::Family;

/// The ops this part and these op libraries can run, and why the others cannot.
pub fn supported_ops(rt: &Runtime, family: Family) -> (Vec<OpKind>, HashMap<OpKind, String>) {
    let mut missing: HashMap<OpKind, String> = HashMap::new();
    let mut need = |op: OpKind, found: Result<&'static str, AscendError>| {
        if let Err(err) = found {
            missing.entry(op).or_insert_with(|| err.to_string());
        }
    };
    macro_rules! has {
        ($ws:ident, $run:ident) => {
            aclnn!(rt, $ws, $run).map(|op| op.library)
        };
    }
    let copy = || has!(aclnnInplaceCopyGetWorkspaceSize, aclnnInplaceCopy);
    let add = || has!(aclnnInplaceAddGetWorkspaceSize, aclnnInplaceAdd);
    for op in [
        OpKind::GEMM,
        OpKind::LAYER_NORM,
        OpKind::RMS_NORM,
        OpKind::ACTIVATION,
        OpKind::BINARY,
        OpKind::ROTARY,
        OpKind::GATHER_ROWS,
        OpKind::CAST,
    ] {
        need(op, copy());
    }
    need(OpKind::GEMM, has!(aclnnMatmulGetWorkspaceSize, aclnnMatmul));
    need(OpKind::GEMM, has!(aclnnAddmmGetWorkspaceSize, aclnnAddmm));
    need(OpKind::GEMM, add());
    need(
        OpKind::LAYER_NORM,
        has!(aclnnLayerNormGetWorkspaceSize, aclnnLayerNorm),
    );
    need(
        OpKind::RMS_NORM,
        has!(aclnnRmsNormGetWorkspaceSize, aclnnRmsNorm),
    );
    for act in [
        has!(aclnnGeluV2GetWorkspaceSize, aclnnGeluV2),
        has!(aclnnGeluGetWorkspaceSize, aclnnGelu),
        has!(aclnnSiluGetWorkspaceSize, aclnnSilu),
        has!(aclnnMulsGetWorkspaceSize, aclnnMuls),
        has!(aclnnInplaceSigmoidGetWorkspaceSize, aclnnInplaceSigmoid),
        has!(aclnnMulGetWorkspaceSize, aclnnMul),
        has!(aclnnInplaceMulGetWorkspaceSize, aclnnInplaceMul),
    ] {
        need(OpKind::ACTIVATION, act.clone());
        // Gemm's activation epilogue uses the same ops.
        need(OpKind::GEMM, act);
    }
    need(OpKind::BINARY, has!(aclnnAddGetWorkspaceSize, aclnnAdd));
    need(OpKind::BINARY, add());
    need(OpKind::BINARY, has!(aclnnMulGetWorkspaceSize, aclnnMul));
    need(
        OpKind::BINARY,
        has!(aclnnInplaceMulGetWorkspaceSize, aclnnInplaceMul),
    );
    // Rotary composes from elementwise ops where the fused op is missing; the fused op (and
    // the cast of its tables) is an optimisation chosen per call.
    need(
        OpKind::ROTARY,
        has!(aclnnInplaceMulsGetWorkspaceSize, aclnnInplaceMuls),
    );
    need(
        OpKind::ROTARY,
        has!(aclnnInplaceMulGetWorkspaceSize, aclnnInplaceMul),
    );
    need(OpKind::ROTARY, add());
    need(
        OpKind::GATHER_ROWS,
        has!(aclnnIndexSelectGetWorkspaceSize, aclnnIndexSelect),
    );
    need(OpKind::CAST, has!(aclnnCastGetWorkspaceSize, aclnnCast));
    // Attention runs composed everywhere the batched matmul and softmax exist; the fused op
    // is an optimisation chosen per call.
    need(OpKind::ATTENTION, copy());
    need(
        OpKind::ATTENTION,
        has!(aclnnBatchMatMulGetWorkspaceSize, aclnnBatchMatMul),
    );
    need(
        OpKind::ATTENTION,
        has!(aclnnInplaceMulsGetWorkspaceSize, aclnnInplaceMuls),
    );
    need(
        OpKind::ATTENTION,
        has!(aclnnSoftmaxGetWorkspaceSize, aclnnSoftmax),
    );
    if family == Family::Inference310P {
        missing.entry(OpKind::LAYER_NORM).or_insert_with(|| {
            "aclnn has no LayerNorm kernels on Atlas inference (310P) parts".to_owned()
        });
    }
    let ops = OpKind::ALL
        .into_iter()
        .filter(|op| !missing.contains_key(op))
        .collect();
    (ops, missing)
}
