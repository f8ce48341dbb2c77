//! iris-backend-template: the smallest honest iris device plugin.
//!
//! Copy this crate to start a backend for new hardware. It builds `libiris_device_template.so`,
//! which iris loads by name (`--device template`, with the library on `IRIS_PLUGIN_PATH`) or by
//! path. It implements what every device must: a probe, `open` with options, a description,
//! memory info and its own memory report, allocation, transfers, fill, batched copies and
//! synchronisation. Its "device memory" is host memory
//! behind opaque handles ([`memory`]); it implements no op, so every op reports "unsupported"
//! through the defaults of [`iris_plugin::Backend`]. Add ops one at a time and run
//! `iris plugin check` after each (see `docs/WRITING_A_BACKEND.md`).
//!
//! Files, named like the device crates': `lib.rs` (the exported entry points), [`device`]
//! (options, description, the `Backend` impl), [`memory`] (the buffer table and its accounting),
//! `error.rs` (error constructors that name the operation).

pub mod device;
mod error;
pub mod memory;

pub use device::{TemplateDevice, TemplateOptions};

use iris_plugin::Logger;
use iris_plugin::abi::{PluginError, ProbeResult};

/// The plugin's name: the `<name>` of `libiris_device_<name>.so` and of `[plugins.<name>]`.
pub const NAME: &str = "template";

/// How many devices this machine has. A real backend asks its driver here, and reports zero
/// devices with the reason when the driver or runtime library is missing: the probe must never
/// fail or panic on a machine without the hardware.
fn probe() -> ProbeResult {
    iris_plugin::backend::probe_result(1, "")
}

/// Opens device `ordinal` with the `[plugins.template]` options of the config. `log` writes into
/// the host's log, tagged with the plugin's name and the ordinal.
fn open(
    ordinal: u32,
    options: &[(&str, &str)],
    log: Logger,
) -> Result<TemplateDevice, PluginError> {
    if ordinal != 0 {
        return Err(error::invalid(
            "open",
            format!("the template plugin has one device (ordinal 0), got ordinal {ordinal}"),
        ));
    }
    let options = TemplateOptions::parse(options)?;
    log.debug(format!(
        "opening `{}` with {} bytes",
        options.name, options.capacity
    ));
    Ok(TemplateDevice::open(options))
}

// Exports the ABI version block and the abi_stable root module, and wraps `probe` and `open`
// so that a panic becomes an error instead of unwinding into the host.
iris_plugin::export_plugin! {
    name: NAME,
    version: env!("CARGO_PKG_VERSION"),
    probe: probe,
    open: open,
}
