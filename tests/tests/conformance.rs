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
/// the short buffer rather than read or write past it. Opened with the option `lie`, it tells
/// one other lie instead of the staging one: `fence` (staged transfers work, on a queue that
/// runs each task 200 ms late, but no fence can be recorded) or `report` (its memory report
/// counts `u64::MAX - 1` bytes allocated).
mod liar {
    use abi_stable::prefix_type::{PrefixRef, WithMetadata};
    use abi_stable::std_types::{RResult, RSlice, RStr};
    use iris_device_cpu::{CpuDevice, CpuOptions};
    use iris_plugin::abi::{
        BufferHandle, CopyRegion, DeviceDesc, DeviceInstance, FillArgs, GemmArgs, HostAlloc,
        HostBufferId, IrisPlugin, IrisPluginRef, LogSink, MemInfo, MemoryReport, NormArgs, OpKind,
        PluginError, PluginOption, ProbeResult, StagedCopy,
    };
    use iris_plugin::backend::{device_instance, guard, probe_result};
    use iris_plugin::{Backend, Logger, Plugin};

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Lie {
        ShortStaging,
        Fence,
        Report,
    }

    struct Liar(CpuDevice, Lie);

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
            let mut report = self.0.memory_report()?;
            if self.1 == Lie::Report {
                report.allocated = u64::MAX - 1;
            }
            Ok(report)
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
            if self.1 == Lie::ShortStaging {
                alloc.len = bytes - 1;
            }
            Ok(alloc)
        }
        fn free_host(&self, id: HostBufferId) -> Result<(), PluginError> {
            self.0.free_host(id)
        }
        fn upload(&self, copy: &StagedCopy) -> Result<(), PluginError> {
            self.0.upload(copy)
        }
        fn download(&self, copy: &StagedCopy) -> Result<(), PluginError> {
            self.0.download(copy)
        }
        fn fence(&self) -> Result<u64, PluginError> {
            if self.1 == Lie::Fence {
                return Err(PluginError::internal("fence: no event left"));
            }
            self.0.fence()
        }
        fn wait_fence(&self, value: u64) -> Result<(), PluginError> {
            self.0.wait_fence(value)
        }
    }

    extern "C" fn probe() -> ProbeResult {
        probe_result(1, "")
    }

    extern "C" fn open(
        _ordinal: u32,
        options: RSlice<'_, PluginOption<'_>>,
        _log: LogSink,
    ) -> RResult<DeviceInstance, PluginError> {
        guard("open", || {
            let lie = match options.iter().find(|o| o.key.as_str() == "lie") {
                Some(o) if o.value.as_str() == "fence" => Lie::Fence,
                Some(o) if o.value.as_str() == "report" => Lie::Report,
                _ => Lie::ShortStaging,
            };
            let mut cpu = vec![("threads", "1"), ("capacity", "1GiB")];
            if lie == Lie::Fence {
                cpu.push(("queue_delay_us", "200000"));
            }
            let options = CpuOptions::parse(&cpu)?;
            Ok(device_instance(Liar(
                CpuDevice::open(options, Logger::discard())?,
                lie,
            )))
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

/// A staged upload whose fence cannot be recorded: the host waits for the queue before it
/// answers the error, so the buffer it hands back as idle is idle (before, the next
/// `as_mut_slice` overwrote the source of an upload still queued).
#[test]
fn a_staged_upload_whose_fence_fails_is_done_before_the_buffer_is_reused() {
    let plugin = liar::plugin();
    let options = [("lie".to_owned(), "fence".to_owned())];
    let device = Arc::new(plugin.open(0, &options).expect("the liar opens"));
    let buf = device.alloc(4096).unwrap();
    let mut host = device.host_buffer(4096).unwrap();
    assert!(host.is_pinned());
    host.as_mut_slice().unwrap().fill(1);
    let err = device.upload(buf, 0, &mut host, 0, 4096).unwrap_err();
    assert!(err.message.contains("no event left"), "{err}");
    host.as_mut_slice().unwrap().fill(2);
    let mut back = vec![0u8; 4096];
    device.read(buf, 0, &mut back).unwrap();
    assert!(
        back.iter().all(|b| *b == 1),
        "the upload read the source it was given"
    );
    drop(host);
    device.free(buf).unwrap();
}

/// The suite does its sums on a plugin's figures without overflowing: a memory report
/// counting `u64::MAX - 1` bytes fails the accounting check (it panicked the suite before).
#[test]
fn a_memory_report_near_the_top_of_u64_fails_the_accounting_check() {
    let plugin = liar::plugin();
    let options = [("lie".to_owned(), "report".to_owned())];
    let device = Arc::new(plugin.open(0, &options).expect("the liar opens"));
    let report = conformance::run(&plugin, &device);
    let accounting = report
        .checks
        .iter()
        .find(|check| check.name == "memory.accounting")
        .expect("memory.accounting");
    assert_eq!(accounting.status.label(), "fail");
}
