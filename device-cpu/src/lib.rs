//! iris-device-cpu: the reference device.
//!
//! It implements the whole plugin ABI on the host: buffers are 64-byte-aligned host allocations
//! behind opaque handles ([`memory`]), bounded by a configurable capacity that `mem_info` and
//! `alloc` honour; ops compute in f32 on a rayon pool of `threads` workers, with f16 and bf16 as
//! storage types ([`ops`]). Every other device's ops are tested against these.
//!
//! Calls go through an in-order queue ([`queue`]): asynchronous by default, like an
//! accelerator's stream (a worker thread runs the work in order and calls return at once), or
//! synchronous with `queue = "sync"`. Fault injection ([`faults`]) makes chosen allocations or
//! op calls fail, for testing the host's recovery.
//!
//! The crate builds both as `libiris_device_cpu.so`, loadable like any vendor plugin, and as an
//! rlib that the `iris` binary links in as its built-in default through [`plugin_root`], which
//! returns the same root module the library exports.
//!
//! Options (`[plugins.cpu]` in the config): `threads` (default: available parallelism),
//! `capacity` (default: half of physical memory; bytes with a unit, or a fraction), `queue`
//! (`async`, the default, or `sync`; the `IRIS_CPU_QUEUE` environment variable sets the
//! default), `queue_delay_us`, `poison`, `isa` (the kernel tier: `amx`, `avx512bf16`,
//! `avx512` (also spelled `widened`), `avx2` or `generic`; default: the `IRIS_CPU_ISA`
//! environment variable, else the best the CPU runs; see [`isa`]), and the fault options (see
//! [`faults`]).

pub mod device;
mod error;
pub mod faults;
pub mod isa;
pub mod memory;
pub mod ops;
pub mod queue;

pub use device::{CpuDevice, CpuOptions};
pub use queue::QueueMode;

use iris_plugin::Logger;
use iris_plugin::abi::{PluginError, ProbeResult};

/// The plugin's name.
pub const NAME: &str = "cpu";

fn probe() -> ProbeResult {
    iris_plugin::backend::probe_result(1, "")
}

fn open(ordinal: u32, options: &[(&str, &str)], log: Logger) -> Result<CpuDevice, PluginError> {
    if ordinal != 0 {
        return Err(PluginError::invalid_argument(format!(
            "open: the cpu plugin has one device (ordinal 0), got ordinal {ordinal}"
        )));
    }
    CpuDevice::open(CpuOptions::parse(options)?, log)
}

iris_plugin::export_plugin! {
    name: NAME,
    version: env!("CARGO_PKG_VERSION"),
    probe: probe,
    open: open,
}
