//! The device: options, description, and the [`Backend`] implementation the exported vtable
//! forwards to.
//!
//! [`Backend`]'s required methods are the minimum a device must do; every op method has a
//! default that reports "unsupported". Implement an op by overriding its method *and* listing
//! its [`OpKind`](iris_plugin::OpKind) in [`DeviceDesc::ops`]: a listed op that fails is a
//! conformance failure, an unlisted one is reported as unsupported.

use iris_plugin::Backend;
use iris_plugin::abi::{
    BufferHandle, CopyRegion, DType, DeviceDesc, FillArgs, MemInfo, MemoryReport, PluginError,
    Property, property,
};

use crate::error::invalid;
use crate::memory::Memory;

/// Capacity when the `capacity` option is absent.
pub const DEFAULT_CAPACITY: u64 = 256 << 20;

/// Options of [`TemplateDevice::open`], from the `[plugins.template]` table of the config.
/// Values arrive as text whatever their type in the TOML file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateOptions {
    /// Bytes of memory the device offers.
    pub capacity: u64,
    /// Device name shown by `iris devices`.
    pub name: String,
}

impl Default for TemplateOptions {
    fn default() -> Self {
        TemplateOptions {
            capacity: DEFAULT_CAPACITY,
            name: "template device".to_owned(),
        }
    }
}

impl TemplateOptions {
    /// Parses `capacity` (a positive number of bytes) and `name`. An unknown key is an error
    /// that names it: a typo in a config file must not be silently ignored.
    pub fn parse(pairs: &[(&str, &str)]) -> Result<TemplateOptions, PluginError> {
        let mut options = TemplateOptions::default();
        for (key, value) in pairs {
            match *key {
                "capacity" => {
                    options.capacity = value
                        .trim()
                        .parse::<u64>()
                        .ok()
                        .filter(|bytes| *bytes > 0)
                        .ok_or_else(|| {
                            invalid(
                                "open",
                                format!(
                                    "option `capacity`: expected a positive number of bytes, got `{value}`"
                                ),
                            )
                        })?;
                }
                "name" => options.name = (*value).to_owned(),
                other => {
                    return Err(invalid(
                        "open",
                        format!("unknown option `{other}` (known: capacity, name)"),
                    ));
                }
            }
        }
        Ok(options)
    }
}

/// One opened device. The host may call it from any thread, so its state is behind a lock.
#[derive(Debug)]
pub struct TemplateDevice {
    options: TemplateOptions,
    memory: Memory,
}

impl TemplateDevice {
    /// Opens the device. A real backend creates its context and streams here, and reports a
    /// driver failure as [`ErrorCode::UNAVAILABLE`](iris_plugin::ErrorCode::UNAVAILABLE).
    pub fn open(options: TemplateOptions) -> TemplateDevice {
        TemplateDevice {
            memory: Memory::new(options.capacity),
            options,
        }
    }
}

impl Backend for TemplateDevice {
    fn describe(&self) -> DeviceDesc {
        DeviceDesc {
            name: self.options.name.as_str().into(),
            vendor: "iris backend template".into(),
            total_memory: self.options.capacity,
            dtypes: DType::ALL.to_vec().into(),
            // No op yet: list each one here as it is implemented.
            ops: Vec::new().into(),
            // Facts iris shows in `iris devices --json`; see `iris_plugin::abi::property`.
            properties: vec![Property::new(property::QUEUE, "sync")].into(),
        }
    }

    fn mem_info(&self) -> Result<MemInfo, PluginError> {
        Ok(self.memory.mem_info())
    }

    fn memory_report(&self) -> Result<MemoryReport, PluginError> {
        let (allocated, buffers) = self.memory.usage();
        Ok(MemoryReport {
            allocated,
            buffers,
            // A real backend lists what it holds outside `alloc` here: its context, library
            // handles, compiled kernels, workspace pools.
            held: Vec::new().into(),
        })
    }

    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        self.memory.alloc(bytes)
    }

    fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        // Nothing is ever queued here, so freeing at once is queue-ordered. A device with a
        // stream defers the release until the work enqueued before it is done.
        self.memory.free(buf)
    }

    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        self.memory.write(dst, offset, src)
    }

    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        self.memory.read(src, offset, dst)
    }

    fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        self.memory.copy_batch(regions)
    }

    fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
        self.memory.fill(args)
    }

    fn synchronize(&self) -> Result<(), PluginError> {
        // Every call completes before it returns; a device with a queue waits for it here and
        // reports a failure of the work it ran.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_unknown_keys_are_named() {
        let options = TemplateOptions::parse(&[("capacity", "4096"), ("name", "t0")]).unwrap();
        assert_eq!(options.capacity, 4096);
        assert_eq!(options.name, "t0");
        let err = TemplateOptions::parse(&[("capacty", "1")]).unwrap_err();
        assert!(err.message.contains("`capacty`"), "{}", err.message);
        let err = TemplateOptions::parse(&[("capacity", "0")]).unwrap_err();
        assert!(err.message.contains("capacity"), "{}", err.message);
    }
}
