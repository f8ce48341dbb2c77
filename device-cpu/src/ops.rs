//! The CPU device's ops (f32 compute; f16/bf16 storage).

use iris_plugin::abi::OpKind;

/// Ops this device implements.
pub const SUPPORTED: &[OpKind] = &[];
