//! Multimodal caches: the device cache of encoder outputs.

pub mod device;
