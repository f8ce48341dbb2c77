//! iris-device-ascend: iris's device plugin for Huawei Ascend NPUs.
//!
//! The plugin drives AscendCL (the CANN runtime) and the aclnn operator libraries, loaded at
//! run time: the build needs neither the CANN SDK nor libclang, and on a machine without CANN
//! the plugin loads, reports no devices and says why. Bindings come in three layers, as in
//! cudarc:
//!
//! - [`sys`]: bindgen's output, checked in, one dynamically loaded table per library
//!   (`device-ascend/bindgen/generate.sh` regenerates it against `$ASCEND_TOOLKIT_HOME`).
//! - [`result`]: `aclError` and `aclnnStatus` as typed values; [`error::AscendError`] adds the
//!   function's name and `aclGetRecentErrMsg()`, and maps each case to an ABI error code
//!   (207001 and 207018 are out of memory).
//! - the safe layer: [`runtime::Runtime`] (libraries found and opened once, `aclInit` once),
//!   [`calls`] (device count, SoC, versions, memory figures, allocation, copies and fills),
//!   [`stream`] (device binding, context, stream, event as RAII values), [`tensor`] (aclnn
//!   descriptors, scalars, int arrays), [`memory`] (buffers, queue-ordered frees, pinned
//!   staging), [`ops`] (the encoder ops as sequences of aclnn calls) and [`device`] (the
//!   [`iris_plugin::Backend`]), with [`options`], [`soc`] (each SoC family's rules),
//!   [`support`] (the op-support table) and [`properties`] beside it.
//!
//! Execution follows ABI 2: each opened NPU has one stream; ops, copies and fills are
//! enqueued and return; `read` and `synchronize` wait; frees are queue-ordered (a block goes
//! back to the runtime once the work enqueued before its free is done). Workspaces come from
//! the host's allocator through the `*_workspace` queries, so the host accounts every byte.
//!
//! Options (`[plugins.ascend]` in the config): `attention = "auto" | "fused" | "composed"`.
//! Environment: CANN's install variables (`ASCEND_HOME_PATH`, ...; see [`runtime`]) and
//! `ASCEND_RT_VISIBLE_DEVICES`, which the runtime applies. docs/ASCEND.md is the guide for
//! hardware owners.

pub mod calls;
pub mod device;
pub mod error;
pub mod memory;
pub mod ops;
pub mod options;
pub mod properties;
pub mod result;
pub mod runtime;
pub mod soc;
pub mod stream;
pub mod support;
pub mod sys;
pub mod tensor;

pub use device::AscendDevice;
pub use error::AscendError;
pub use options::AscendOptions;

use iris_plugin::Logger;
use iris_plugin::abi::{PluginError, ProbeResult};
use iris_plugin::backend::probe_result;

use crate::result::AclError;
use crate::runtime::{Runtime, VISIBLE_DEVICES_ENV, stub_reason};

/// The plugin's name: `--device ascend`, `[plugins.ascend]`.
pub const NAME: &str = "ascend";

/// How many NPUs the runtime shows, or why there are none.
pub fn device_count() -> Result<u32, String> {
    let rt = Runtime::get().map_err(|none| none.0)?;
    let count = match rt.device_count() {
        Ok(count) => count,
        Err(Ok(AclError::STUB_MODE)) => {
            return Err(stub_reason(
                &rt.acl_path().display().to_string(),
                "aclrtGetDeviceCount",
            ));
        }
        Err(Ok(code)) => {
            let err = rt.check("aclrtGetDeviceCount", code.0).err();
            return Err(format!(
                "0 devices: {}",
                err.map_or_else(|| code.to_string(), |err| err.to_string())
            ));
        }
        Err(Err(err)) => return Err(err.to_string()),
    };
    if count == 0 {
        let visible = std::env::var(VISIBLE_DEVICES_ENV)
            .map(|value| format!(", {VISIBLE_DEVICES_ENV}={value}"))
            .unwrap_or_default();
        return Err(format!(
            "0 devices (runtime {}{visible})",
            rt.acl_path().display()
        ));
    }
    Ok(count)
}

fn probe() -> ProbeResult {
    match device_count() {
        Ok(count) => probe_result(count, ""),
        Err(reason) => probe_result(0, reason),
    }
}

fn open(ordinal: u32, options: &[(&str, &str)], log: Logger) -> Result<AscendDevice, PluginError> {
    let options = AscendOptions::parse(options)?;
    let count = device_count().map_err(PluginError::unavailable)?;
    if ordinal >= count {
        return Err(PluginError::invalid_argument(format!(
            "open: NPU {ordinal} does not exist; the runtime shows {count}"
        )));
    }
    let rt = Runtime::get().map_err(|none| PluginError::unavailable(none.0))?;
    Ok(AscendDevice::open(rt, ordinal, options, log)?)
}

iris_plugin::export_plugin! {
    name: NAME,
    version: env!("CARGO_PKG_VERSION"),
    probe: probe,
    open: open,
}
