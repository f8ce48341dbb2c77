//! The SoC families and their rules: which dtypes and ops a part runs, and how.
//!
//! From the aclnn op documentation: `aclnnMatmul` takes BFLOAT16 only on the 910B-class parts
//! (Atlas A2, and A3); on the 910 (Atlas training series) and the 310P (Atlas inference series)
//! it takes FLOAT16 and FLOAT32, and FLOAT32 only with `cubeMathType` 1
//! (ALLOW_FP32_DOWN_PRECISION: computed in FLOAT16), never 0. `aclnnFlashAttentionVarLenScore`
//! and `aclnnRotaryPositionEmbedding` list Atlas A2 and A3 (and the 950) as supported and the
//! training series, the inference series and the Atlas 200I/500 A2 (310B) as not. Parts this
//! plugin does not know get the rules every documented part accepts: no BF16, FLOAT32 matmuls
//! with `cubeMathType` 1, attention and rotary composed from basic ops.

use iris_plugin::abi::DType;

/// The part's family, from `aclrtGetSocName`: it decides dtypes and which aclnn ops have
/// kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Atlas A2 (`Ascend910B*`).
    A2,
    /// Atlas A3 (`Ascend910_93*`).
    A3,
    /// Atlas training series (`Ascend910A`, `Ascend910ProA`, `Ascend910ProB`,
    /// `Ascend910PremiumA`): no BF16, FLOAT32 matmul only with `cubeMathType = 1`, no fused
    /// attention or rotary kernels.
    Training910,
    /// Atlas inference cards (`Ascend310P*`): as the training series, and no LayerNorm.
    Inference310P,
    /// Anything else (the Atlas 200I/500 A2's `Ascend310B*`, parts newer than this plugin):
    /// the conservative rules of the training series.
    Other,
}

impl Family {
    /// The family of a SoC name.
    pub fn of(soc: &str) -> Family {
        if soc.starts_with("Ascend910_93") {
            Family::A3
        } else if soc.starts_with("Ascend910B") {
            Family::A2
        } else if soc.starts_with("Ascend310P") {
            Family::Inference310P
        } else if soc.starts_with("Ascend910_") {
            // Later 910-class names (`Ascend910_95...`) are not the training series.
            Family::Other
        } else if soc.starts_with("Ascend910") {
            Family::Training910
        } else {
            Family::Other
        }
    }

    /// Whether the documentation confirms BF16 kernels on this part.
    pub fn bf16(self) -> bool {
        matches!(self, Family::A2 | Family::A3)
    }

    /// Whether the fused transformer ops (`aclnnFlashAttentionVarLenScore`,
    /// `aclnnRotaryPositionEmbedding`) are documented for this part.
    pub fn fused_transformer_ops(self) -> bool {
        matches!(self, Family::A2 | Family::A3)
    }

    /// aclnn matmul's `cubeMathType`: keep the dtype (0), except FLOAT32 on parts that
    /// accept it only down-converted (1).
    pub fn cube_math(self, dtype: DType) -> i8 {
        if dtype == DType::F32 && !matches!(self, Family::A2 | Family::A3) {
            1
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_from_soc_names() {
        assert_eq!(Family::of("Ascend910B3"), Family::A2);
        assert_eq!(Family::of("Ascend910_9392"), Family::A3);
        assert_eq!(Family::of("Ascend310P3"), Family::Inference310P);
        assert_eq!(Family::of("Ascend910ProB"), Family::Training910);
        assert_eq!(Family::of("Ascend910A"), Family::Training910);
        assert_eq!(Family::of("Ascend910_9591"), Family::Other);
        assert_eq!(Family::of("Ascend310B1"), Family::Other);
        assert_eq!(Family::of("Ascend950PR"), Family::Other);
    }

    #[test]
    fn only_a2_and_a3_get_bf16_fused_ops_and_f32_kept_in_matmul() {
        for family in [Family::A2, Family::A3] {
            assert!(family.bf16() && family.fused_transformer_ops());
            assert_eq!(family.cube_math(DType::F32), 0);
        }
        for family in [Family::Training910, Family::Inference310P, Family::Other] {
            assert!(!family.bf16() && !family.fused_transformer_ops());
            assert_eq!(family.cube_math(DType::F32), 1);
            assert_eq!(family.cube_math(DType::F16), 0);
        }
    }
}
