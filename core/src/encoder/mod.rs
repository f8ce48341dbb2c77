//! The vision encoder: tensors and an op runner over the caching allocator ([`exec`]), host-side
//! index arithmetic ([`layout`]), step plans that place a step's tensors in one arena
//! ([`plan`]) and the Qwen-VL towers as graphs of ABI ops ([`tower`]).

pub mod exec;
pub mod layout;
pub mod plan;
pub mod tower;

use thiserror::Error;

use crate::memory::AllocError;

/// Why an encoder run failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EncoderError {
    /// The allocator could not provide memory.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A device call failed.
    #[error(transparent)]
    Device(#[from] iris_plugin::DeviceError),
    /// Shapes that do not agree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A weight the graph needs is not loaded.
    #[error("weight `{0}` is not loaded")]
    MissingWeight(String),
}
