//! The conformance suite against every plugin this workspace builds: the CPU device linked in
//! and loaded from its library, in both queue modes, and the backend template; and against a
//! device that lies, to show that the suite can fail.

use std::sync::Arc;

use iris_plugin::conformance::{self, Report, Status};
use iris_plugin::{Device, Plugin, load_library};
use iris_tests::plugin_library;

/// Room for the tower-sized gemm cases (a 1024x5120 input, its weight and output in f32).
const CAPACITY_OPTION: &str = "1073741824";

fn open(plugin: &Plugin, queue: &str) -> Arc<Device> {
    let mut options = vec![("capacity".to_owned(), CAPACITY_OPTION.to_owned())];
    if plugin.name() == "cpu" {
        options.push(("queue".to_owned(), queue.to_owned()));
    }
    let device = plugin
        .open(0, &options)
        .unwrap_or_else(|err| panic!("{} device 0 opens: {err}", plugin.name()));
    Arc::new(device)
}

fn assert_no_failures(report: &Report) {
    let failures: Vec<String> = report
        .failures()
        .map(|check| format!("{}: {}", check.name, check.status))
        .collect();
    assert!(
        failures.is_empty(),
        "failed checks:\n{}",
        failures.join("\n")
    );
    assert!(report.passed() > 0, "no check passed: {report:?}");
}

#[test]
fn builtin_cpu_device_has_no_failures_with_an_async_queue() {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = open(&plugin, "async");
    assert_eq!(device.description().property("queue"), Some("async"));
    let report = conformance::run(&plugin, &device);
    assert_no_failures(&report);
    // Everything but `trim`: the CPU device keeps no memory for reuse beyond what start-up
    // made (its packed weights are the weights' layout, made in the warm-up, not a cache).
    let unsupported: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| c.status.label() == "unsupported")
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        unsupported,
        ["memory.trim"],
        "the CPU device implements everything else"
    );
    // Every op check that passed measured itself.
    for check in report.checks.iter().filter(|c| c.name.starts_with("op.")) {
        let timing = check
            .timing
            .as_ref()
            .unwrap_or_else(|| panic!("{} has no timing", check.name));
        assert!(
            timing.seconds > 0.0 && timing.throughput > 0.0,
            "{}: {timing:?}",
            check.name
        );
    }
}

#[test]
fn cpu_library_has_no_failures_with_a_sync_queue() {
    let plugin = load_library(&plugin_library("cpu")).expect("the CPU library loads");
    let device = open(&plugin, "sync");
    assert_eq!(device.description().property("queue"), Some("sync"));
    let report = conformance::run(&plugin, &device);
    assert_no_failures(&report);
}

#[test]
fn template_passes_and_reports_every_op_unsupported() {
    let plugin = load_library(&plugin_library("template")).expect("the template loads");
    assert_eq!(plugin.name(), "template");
    let device = open(&plugin, "sync");
    let report = conformance::run(&plugin, &device);
    assert_no_failures(&report);
    for check in &report.checks {
        // Ops and the optional capabilities: the template offers none of them.
        let unsupported_ok = check.name.starts_with("op.")
            || conformance::OPTIONAL_CHECKS.contains(&check.name.as_str());
        match (&check.status, unsupported_ok) {
            (Status::Unsupported(_), true) | (Status::Pass, _) => {}
            (status, _) => panic!("{}: unexpected {status}", check.name),
        }
    }
    assert!(report.unsupported() > 0);
    let names: Vec<&str> = report.checks.iter().map(|c| c.name.as_str()).collect();
    for expected in [
        "memory.accounting",
        "memory.out_of_memory",
        "transfer.copy_batch",
        "transfer.fill",
        "queue.free_after_enqueue",
        "op.gemm.tower_qkv_1024x1280x3840.f32",
        "op.attention.d72.bf16",
        "op.cast.f16_to_bf16",
        "memory.all_freed",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }
}

/// A device that lies: it lists gemm and layer norm, but its gemm writes nothing and its layer
/// norm answers "unsupported", and its host staging buffers are a byte short of what was asked.
/// The suite must fail all three and call the unlisted ops unsupported; the host must refuse
/// the short buffer rather than read or write past it.
mod liar {
    use abi_stable::prefix_type::{PrefixRef, WithMetadata};
    use abi_stable::std_types::{RResult, RSlice, RStr};
    use iris_device_cpu::{CpuDevice, CpuOptions};
    use iris_plugin::abi::{
        BufferHandle, CopyRegion, DeviceDesc, DeviceInstance, FillArgs, GemmArgs, HostAlloc,
        HostBufferId, IrisPlugin, IrisPluginRef, LogSink, MemInfo, MemoryReport, NormArgs, OpKind,
        PluginError, PluginOption, ProbeResult,
    };
    use iris_plugin::backend::{device_instance, guard, probe_result};
    use iris_plugin::{Backend, Logger, Plugin};

    struct Liar(CpuDevice);

    impl Backend for Liar {
        fn describe(&self) -> DeviceDesc {
            let mut desc = self.0.describe();
            desc.ops = vec![OpKind::GEMM, OpKind::LAYER_NORM].into();
            desc
        }
        fn mem_info(&self) -> Result<MemInfo, PluginError> {
            self.0.mem_info()
        }
        fn memory_report(&self) -> Result<MemoryReport, PluginError> {
            self.0.memory_report()
        }
        fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
            self.0.alloc(bytes)
        }
        fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
            self.0.free(buf)
        }
        fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
            self.0.write(dst, offset, src)
        }
        fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
            self.0.read(src, offset, dst)
        }
        fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
            self.0.copy_batch(regions)
        }
        fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
            self.0.fill(args)
        }
        fn synchronize(&self) -> Result<(), PluginError> {
            self.0.synchronize()
        }
        fn gemm(&self, _args: &GemmArgs) -> Result<(), PluginError> {
            Ok(())
        }
        fn layer_norm(&self, _args: &NormArgs) -> Result<(), PluginError> {
            Err(PluginError::unsupported("layer_norm: not yet"))
        }
        /// One byte short of what was asked for.
        fn alloc_host(&self, bytes: u64) -> Result<HostAlloc, PluginError> {
            let mut alloc = self.0.alloc_host(bytes)?;
            alloc.len = bytes - 1;
            Ok(alloc)
        }
        fn free_host(&self, id: HostBufferId) -> Result<(), PluginError> {
            self.0.free_host(id)
        }
    }

    extern "C" fn probe() -> ProbeResult {
        probe_result(1, "")
    }

    extern "C" fn open(
        _ordinal: u32,
        _options: RSlice<'_, PluginOption<'_>>,
        _log: LogSink,
    ) -> RResult<DeviceInstance, PluginError> {
        guard("open", || {
            let options = CpuOptions::parse(&[("threads", "1"), ("capacity", "1GiB")])?;
            Ok(device_instance(Liar(CpuDevice::open(
                options,
                Logger::discard(),
            )?)))
        })
    }

    const MODULE: &WithMetadata<IrisPlugin> = &WithMetadata::new(IrisPlugin {
        name: RStr::from_str("liar"),
        version: RStr::from_str("0.0.0"),
        probe,
        open,
    });

    pub fn plugin() -> Plugin {
        Plugin::builtin(IrisPluginRef(PrefixRef::from_ref(MODULE)))
    }

    /// A probe that answers -1 as a C plugin's unsigned count: 4294967295 devices.
    extern "C" fn probe_minus_one() -> ProbeResult {
        probe_result(u32::MAX, "")
    }

    const MINUS_ONE: &WithMetadata<IrisPlugin> = &WithMetadata::new(IrisPlugin {
        name: RStr::from_str("liar"),
        version: RStr::from_str("0.0.0"),
        probe: probe_minus_one,
        open,
    });

    pub fn counting_minus_one() -> Plugin {
        Plugin::builtin(IrisPluginRef(PrefixRef::from_ref(MINUS_ONE)))
    }
}

#[test]
fn a_device_count_past_any_host_reads_as_none_with_the_count_named() {
    let probe = liar::counting_minus_one().probe();
    assert_eq!(probe.device_count, 0);
    assert!(
        probe
            .reason
            .contains("reported 4294967295 devices, more than the 1024"),
        "{}",
        probe.reason
    );
}

#[test]
fn listed_ops_that_misbehave_fail_and_unlisted_ones_are_unsupported() {
    let plugin = liar::plugin();
    let device = Arc::new(plugin.open(0, &[]).expect("the liar opens"));
    let report = conformance::run(&plugin, &device);
    let status = |name: &str| {
        report
            .checks
            .iter()
            .find(|check| check.name == name)
            .map(|check| check.status.label())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert_eq!(status("op.gemm.odd_silu.f32"), "fail");
    assert_eq!(status("op.gemm.tower_qkv_1024x1280x3840.bf16"), "fail");
    assert_eq!(status("op.layer_norm.w1280.f32"), "fail");
    assert_eq!(status("op.rms_norm.w1280.f32"), "unsupported");
    assert_eq!(status("op.attention.d80.f16"), "unsupported");
    assert_eq!(status("queue.host_staging"), "fail");
    assert_eq!(status("memory.accounting"), "pass");
    assert_eq!(status("memory.all_freed"), "pass");
    assert!(!report.is_ok());
    let err = device.host_buffer(4096).unwrap_err();
    assert!(
        err.message
            .contains("asked for 4096 bytes, the plugin answered 4095 bytes"),
        "{err}"
    );
}
