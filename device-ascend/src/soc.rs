//! The SoC families and their rules: which dtypes and ops a part runs, and how.

use iris_plugin::abi::DType;

/// The part's family, from `aclrtGetSocName`: it decides dtypes and which aclnn ops have
/// kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Atlas A2 (`Ascend910B*`).
    A2,
    /// Atlas A3 (`Ascend910_93*`).
    A3,
    /// Atlas inference cards (`Ascend310P*`): no BF16, no LayerNorm, rotary or fused
    /// attention kernels, f32 matmul only with `cubeMathType = 1`.
    Inference310P,
    /// Anything else: the A2 rules, and the op libraries decide.
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
        } else {
            Family::Other
        }
    }

    /// aclnn matmul's `cubeMathType`: keep the dtype, except where f32 cannot stay f32.
    pub fn cube_math(self, dtype: DType) -> i8 {
        if self == Family::Inference310P && dtype == DType::F32 {
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
        assert_eq!(Family::of("Ascend950PR"), Family::Other);
        assert_eq!(Family::Inference310P.cube_math(DType::F32), 1);
        assert_eq!(Family::Inference310P.cube_math(DType::F16), 0);
        assert_eq!(Family::A2.cube_math(DType::F32), 0);
    }
}
