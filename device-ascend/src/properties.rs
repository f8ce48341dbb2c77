//! The device description's properties: the part, the libraries loaded and skipped, the
//! versions, and where each aclnn op came from.

use iris_plugin::abi::{Property, property};

use crate::memory::{DeviceMalloc, MemKind};
use crate::options::AscendOptions;
use crate::runtime::{Runtime, VISIBLE_DEVICES_ENV, aclnn};

/// Facts for `iris devices` and bug reports: the part, the libraries, and where each aclnn
/// op came from.
pub fn properties(
    rt: &Runtime,
    soc: &str,
    kind: MemKind,
    malloc: DeviceMalloc,
    options: &AscendOptions,
) -> Vec<Property> {
    let mut props = vec![
        Property::new(property::SOC, soc),
        Property::new(property::QUEUE, "async"),
        Property::new("memory_kind", kind.name()),
        Property::new("device_malloc", malloc.name()),
        Property::new("runtime_library", rt.acl_path().display()),
        Property::new(
            "runtime_skipped",
            if rt.skipped().is_empty() {
                "none".to_owned()
            } else {
                rt.skipped().join(", ")
            },
        ),
        Property::new(
            "nnopbase_library",
            rt.nnopbase_path().map_or_else(
                |reason| format!("missing: {reason}"),
                |p| p.display().to_string(),
            ),
        ),
        Property::new(
            "attention",
            format!("{:?}", options.attention).to_lowercase(),
        ),
    ];
    // The CANN release, which users and bug reports speak of; the AscendCL API version
    // (`aclrtGetVersion`, deprecated) is a different number, kept beside it.
    if let Some(version) = rt.cann_version() {
        props.push(Property::new(property::RUNTIME_VERSION, version));
    }
    if let Some(version) = rt.acl_api_version() {
        props.push(Property::new("acl_api_version", version));
    }
    if let Ok(visible) = std::env::var(VISIBLE_DEVICES_ENV) {
        props.push(Property::new("visible_devices", visible));
    }
    let libs = rt
        .ops()
        .iter()
        .map(|lib| lib.path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    props.push(Property::new(
        "op_libraries",
        if libs.is_empty() {
            "none".to_owned()
        } else {
            libs
        },
    ));
    // Which library each aclnn op came from, grouped by library, and the ops no library has.
    let mut sources: Vec<(&'static str, Vec<&'static str>)> = Vec::new();
    let mut missing: Vec<&'static str> = Vec::new();
    macro_rules! source {
        ($($ws:ident $run:ident),* $(,)?) => {
            $(
                let short = &stringify!($run)["aclnn".len()..];
                match aclnn!(rt, $ws, $run) {
                    Ok(op) => match sources.iter_mut().find(|(lib, _)| *lib == op.library) {
                        Some((_, ops)) => ops.push(short),
                        None => sources.push((op.library, vec![short])),
                    },
                    Err(_) => missing.push(short),
                }
            )*
        };
    }
    source!(
        aclnnMatmulGetWorkspaceSize aclnnMatmul,
        aclnnAddmmGetWorkspaceSize aclnnAddmm,
        aclnnBatchMatMulGetWorkspaceSize aclnnBatchMatMul,
        aclnnLayerNormGetWorkspaceSize aclnnLayerNorm,
        aclnnRmsNormGetWorkspaceSize aclnnRmsNorm,
        aclnnGeluV2GetWorkspaceSize aclnnGeluV2,
        aclnnGeluGetWorkspaceSize aclnnGelu,
        aclnnSiluGetWorkspaceSize aclnnSilu,
        aclnnMulsGetWorkspaceSize aclnnMuls,
        aclnnInplaceSigmoidGetWorkspaceSize aclnnInplaceSigmoid,
        aclnnAddGetWorkspaceSize aclnnAdd,
        aclnnInplaceAddGetWorkspaceSize aclnnInplaceAdd,
        aclnnMulGetWorkspaceSize aclnnMul,
        aclnnInplaceMulGetWorkspaceSize aclnnInplaceMul,
        aclnnInplaceMulsGetWorkspaceSize aclnnInplaceMuls,
        aclnnSoftmaxGetWorkspaceSize aclnnSoftmax,
        aclnnIndexSelectGetWorkspaceSize aclnnIndexSelect,
        aclnnCastGetWorkspaceSize aclnnCast,
        aclnnInplaceCopyGetWorkspaceSize aclnnInplaceCopy,
        aclnnInplaceFillScalarGetWorkspaceSize aclnnInplaceFillScalar,
        aclnnFlashAttentionVarLenScoreGetWorkspaceSize aclnnFlashAttentionVarLenScore,
        aclnnRotaryPositionEmbeddingGetWorkspaceSize aclnnRotaryPositionEmbedding,
    );
    let sources = sources
        .iter()
        .map(|(lib, ops)| format!("{lib}: {}", ops.join(" ")))
        .collect::<Vec<_>>()
        .join("; ");
    props.push(Property::new(
        "aclnn_sources",
        if sources.is_empty() {
            "none".to_owned()
        } else {
            sources
        },
    ));
    props.push(Property::new(
        "aclnn_missing",
        if missing.is_empty() {
            "none".to_owned()
        } else {
            missing.join(" ")
        },
    ));
    props
}
