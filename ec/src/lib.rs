//! iris-ec: handing encoder outputs to a serving stack.
//!
//! iris can stand in for vLLM's encoder instance in encoder disaggregation ("EPD"): encoder
//! instances publish each item's embeddings through an EC connector, and prefill/decode
//! instances read them instead of running the vision tower. This crate owns what that takes,
//! each part checked against goldens made with vLLM's own code:
//!
//! - vLLM's item identifiers (its multimodal hasher over the original encoded bytes);
//! - the connectors that publish an item's rows (one contiguous `[num_embeds, width]` host buffer
//!   in the engine's dtype, deepstack levels concatenated) under its identifier: files in a
//!   shared folder ([`storage`]), or pushes into a consumer's receive buffer over Mooncake's TCP
//!   transport ([`mooncake`]).
//!
//! Connectors never see a device: they take host rows and run off the engine's step. The HTTP
//! side (`/v1/chat/completions` as vLLM's proxy calls it) lives in the `iris` binary and only
//! translates requests. Dependencies point one way: `cli -> ec -> core -> plugins`.

pub mod config;
pub mod identifier;
pub mod mooncake;
pub mod storage;

pub use identifier::{
    HashAlgorithm, HashFactors, ItemSource, OrderedJson, item_identifier, merge_media_io_kwargs,
};
