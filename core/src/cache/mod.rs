//! Multimodal caches: the processor cache of preprocessed inputs and the encoder cache manager.
pub mod encoder;
pub mod processor;
