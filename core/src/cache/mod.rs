//! Multimodal caches: the processor cache of preprocessed inputs, the encoder cache manager
//! (the scheduler's account in embedding tokens) and the device cache of encoder outputs.
pub mod device;
pub mod encoder;
pub mod processor;
