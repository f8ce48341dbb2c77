//! iris-core: everything between the plugin ABI and the user-facing binary.
//!
//! Dependencies point one way: `cli -> core -> plugins`. Core validates; devices only report
//! what a caller cannot foresee (out of memory, device lost).

pub mod budget;
pub mod cache;
pub mod config;
pub mod devices;
pub mod encoder;
pub mod engine;
pub mod memory;
pub mod model;
pub mod preprocess;
pub mod profile;
pub mod scheduler;
pub mod simulate;
#[cfg(test)]
mod test_support;
