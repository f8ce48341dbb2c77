//! The Ascend plugin over the emulated CANN runtime: the conformance suite, the probe's
//! reasons, fault injection, memory accounting and resource release.

mod common;

use std::sync::Arc;

use common::{
    Layout, emulator_stats, install_in, install_stub, isolated, open, plugin, use_install,
};
use iris_plugin::abi::{
    Activation, ActivationArgs, AttentionArgs, BufferHandle, BufferSlice, CopyRegion, DType,
    ErrorCode, FillArgs, GatherArgs, GemmArgs, MatRef, NormArgs, OpKind, RotaryArgs,
};
use iris_plugin::conformance;
use iris_plugin::{Device, DeviceError};

/// Emulated memory per NPU for these tests: room for the suite's tower shapes, small enough
/// that an oversized allocation fails at once.
const HBM: &str = "4GiB";

fn upload_f32(device: &Device, values: &[f32]) -> BufferHandle {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let buf = device.alloc(bytes.len() as u64).expect("alloc");
    device.write(buf, 0, &bytes).expect("write");
    buf
}

fn download_f32(device: &Device, buf: BufferHandle, len: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; len * 4];
    device.read(buf, 0, &mut bytes).expect("read");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Attention arguments for a workspace query: one head, one segment (`cu` = `[0, tokens]`),
/// placeholder handles (a query reads no buffer).
fn attention_query(dtype: DType, head_dim: u64, cu: &[u32; 2]) -> AttentionArgs<'_> {
    let tokens = u64::from(cu[1]);
    let q = MatRef::contiguous(BufferHandle(1), 0, dtype, tokens, head_dim);
    AttentionArgs {
        q,
        k: q,
        v: q,
        out: MatRef::contiguous(BufferHandle(2), 0, dtype, tokens, head_dim),
        heads: 1,
        head_dim,
        scale: 0.125,
        cu_seqlens: cu.as_slice().into(),
        cu_seqlens_device: MatRef::vector(BufferHandle(3), 0, DType::I32, 2),
        max_seqlen: tokens,
        workspace: BufferSlice::EMPTY,
    }
}

/// Runs an in-place gelu (tanh) over `values` and returns the device's answer.
fn gelu_tanh(device: &Device, values: &[f32]) -> Result<Vec<f32>, DeviceError> {
    let buf = upload_f32(device, values);
    let x = MatRef::contiguous(buf, 0, DType::F32, 1, values.len() as u64);
    let mut args = ActivationArgs {
        x,
        out: x,
        activation: Activation::GELU_TANH,
        workspace: BufferSlice::EMPTY,
    };
    let bytes = device.activation_workspace(&args)?;
    let ws = device.alloc(bytes.max(1)).expect("alloc workspace");
    args.workspace = BufferSlice {
        buf: ws,
        offset: 0,
        bytes,
    };
    let result = device
        .activation(&args)
        .and_then(|()| device.synchronize())
        .map(|()| download_f32(device, buf, values.len()));
    device.free(ws).expect("free");
    device.free(buf).expect("free");
    result
}

fn assert_conformance(device: &Arc<Device>) -> conformance::Report {
    let plugin = device.plugin().clone();
    let report = conformance::run(&plugin, device);
    let failures: Vec<String> = report
        .failures()
        .map(|check| format!("{}: {}", check.name, check.status))
        .collect();
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
    for check in &report.checks {
        let timing = check
            .timing
            .as_ref()
            .map(|t| format!(" {:.4} s {:.2} {}", t.seconds, t.throughput, t.unit))
            .unwrap_or_default();
        println!("{} {}{timing}", check.name, check.status.label());
    }
    report
}

fn assert_released(stats: iris_cann_emulator::EmuStats) {
    assert_eq!(
        (
            stats.tensors,
            stats.scalars,
            stats.int_arrays,
            stats.executors
        ),
        (0, 0, 0, 0),
        "descriptors or executors left alive: {stats:?}"
    );
    assert_eq!(
        stats.device_blocks, 0,
        "device memory left allocated: {stats:?}"
    );
    assert_eq!(
        stats.reserved_bytes, 0,
        "contexts or streams left open: {stats:?}"
    );
    assert_eq!(
        stats.pinned_bytes, 0,
        "pinned host memory left allocated: {stats:?}"
    );
}

#[test]
fn conformance_suite_passes_and_everything_is_released() {
    isolated(
        "conformance_suite_passes_and_everything_is_released",
        &[("ASCEND_EMU_HBM", HBM), ("ASCEND_EMU_QUEUE_DELAY_US", "20")],
        || {
            use_install(Layout::Split);
            let plugin = plugin();
            let probe = plugin.probe();
            assert_eq!(probe.device_count, 2, "{}", probe.reason);
            {
                let device = open(&plugin, 0, &[]);
                let desc = device.description();
                assert_eq!(desc.name, "Ascend910B3");
                assert!(desc.dtypes.contains(&DType::BF16));
                assert_eq!(desc.ops.len(), OpKind::ALL.len(), "{:?}", desc.ops);
                assert_eq!(desc.property("memory_kind"), Some("HBM"));
                // One emulated file under every name: each op resolves in the first split library.
                assert!(
                    desc.property("aclnn_sources")
                        .is_some_and(|s| s.starts_with("libopapi_math.so: Matmul Addmm")),
                    "{:?}",
                    desc.property("aclnn_sources")
                );
                assert_eq!(desc.property("aclnn_missing"), Some("none"));
                let report = assert_conformance(&device);
                assert!(report.missing().is_empty(), "{:?}", report.checks);
                let held = device.memory_report().expect("memory_report");
                // An explicit context (32 MiB) and a stream (2 MiB) in the emulation, and the
                // 512-byte block workspace queries point at (aclrtMallocAlign32: no padding).
                assert_eq!(held.held_bytes(), (34 << 20) + 512, "{held:?}");
            }
            assert_released(emulator_stats(0));
        },
    );
}

#[test]
fn an_old_op_library_without_the_transformer_ops_serves_the_rest() {
    isolated(
        "an_old_op_library_without_the_transformer_ops_serves_the_rest",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Legacy);
            let plugin = plugin();
            assert_eq!(plugin.probe().device_count, 2);
            let device = open(&plugin, 0, &[]);
            let desc = device.description();
            assert_eq!(desc.ops.len(), OpKind::ALL.len(), "{:?}", desc.ops);
            assert_eq!(
                desc.property("aclnn_missing"),
                Some("FlashAttentionVarLenScore RotaryPositionEmbedding")
            );
            assert!(
                desc.property("aclnn_sources")
                    .is_some_and(|s| s.starts_with("libopapi.so: Matmul")),
                "{:?}",
                desc.property("aclnn_sources")
            );
            // The suite passes with rotary and attention composed from the ops present.
            let report = assert_conformance(&device);
            assert!(report.missing().is_empty(), "{:?}", report.checks);

            // Asked for the missing fused attention explicitly: unsupported, naming the op.
            let fused = open(&plugin, 1, &[("attention", "fused")]);
            let err = fused
                .attention_workspace(&attention_query(DType::BF16, 64, &[0, 4]))
                .expect_err("the fused op is missing");
            assert_eq!(err.code, ErrorCode::UNSUPPORTED);
            assert!(
                err.message
                    .contains("aclnnFlashAttentionVarLenScore is not exported by"),
                "{err}"
            );
        },
    );
}

#[test]
fn without_cann_the_probe_names_where_it_looked() {
    isolated("without_cann_the_probe_names_where_it_looked", &[], || {
        let root = use_install(Layout::Empty);
        let probe = plugin().probe();
        assert_eq!(probe.device_count, 0);
        assert!(
            probe.reason.starts_with("libacl_rt.so not found in: "),
            "{}",
            probe.reason
        );
        assert!(
            probe
                .reason
                .contains(&root.join("lib64").display().to_string()),
            "{}",
            probe.reason
        );
        assert!(
            probe
                .reason
                .contains("/usr/local/Ascend/ascend-toolkit/latest/lib64"),
            "{}",
            probe.reason
        );
        let err = plugin().open(0, &[]).expect_err("no device to open");
        assert_eq!(err.code, ErrorCode::UNAVAILABLE);
    });
}

#[test]
fn stub_libraries_mean_no_driver() {
    isolated(
        "stub_libraries_mean_no_driver",
        &[("ASCEND_EMU_STUB", "1")],
        || {
            use_install(Layout::Split);
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 0);
            assert!(
                probe.reason.starts_with("CANN stub library: no driver"),
                "{}",
                probe.reason
            );
            assert!(probe.reason.contains("100039"), "{}", probe.reason);
        },
    );
}

#[test]
fn a_stub_library_first_on_the_path_is_skipped_and_named() {
    isolated(
        "a_stub_library_first_on_the_path_is_skipped_and_named",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            // The stubs' root comes first in the search (ASCEND_INSTALL_PATH), the driver's
            // runtime second (ASCEND_HOME_PATH).
            let stubs = install_stub("stubs");
            let real = use_install(Layout::Split);
            // SAFETY: as in `use_install`.
            unsafe { std::env::set_var("ASCEND_INSTALL_PATH", &stubs) };
            let plugin = plugin();
            let probe = plugin.probe();
            assert_eq!(probe.device_count, 2, "{}", probe.reason);
            let device = open(&plugin, 0, &[]);
            let desc = device.description();
            let stub = stubs.join("lib64").join("libacl_rt.so");
            assert_eq!(
                desc.property("runtime_skipped"),
                Some(stub.display().to_string().as_str())
            );
            assert_eq!(
                desc.property("runtime_library"),
                Some(
                    real.join("lib64")
                        .join("libacl_rt.so")
                        .display()
                        .to_string()
                        .as_str()
                )
            );
            let got = gelu_tanh(&device, &[1.0]).expect("gelu");
            assert!((got[0] - 0.841_192).abs() < 1e-5, "{got:?}");
        },
    );
    // Only stubs: the reason names every file skipped.
    isolated(
        "a_stub_library_first_on_the_path_is_skipped_and_named",
        &[],
        || {
            let stubs = install_stub("stubs");
            // SAFETY: as in `use_install`.
            unsafe { std::env::set_var("ASCEND_HOME_PATH", &stubs) };
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 0);
            assert!(
                probe.reason.starts_with("CANN stub library: no driver"),
                "{}",
                probe.reason
            );
            let stub = stubs.join("lib64").join("libacl_rt.so");
            assert!(
                probe.reason.contains(&stub.display().to_string()),
                "{}",
                probe.reason
            );
        },
    );
}

#[test]
fn the_feature_op_libraries_of_older_cann_serve_every_op() {
    isolated(
        "the_feature_op_libraries_of_older_cann_serve_every_op",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::FeatureLibraries);
            let device = open(&plugin(), 0, &[]);
            let desc = device.description();
            assert_eq!(desc.property("aclnn_missing"), Some("none"));
            assert!(
                desc.property("aclnn_sources")
                    .is_some_and(|s| s.starts_with("libaclnn_ops_infer.so: Matmul")),
                "{:?}",
                desc.property("aclnn_sources")
            );
            let got = gelu_tanh(&device, &[1.0]).expect("gelu");
            assert!((got[0] - 0.841_192).abs() < 1e-5, "{got:?}");
        },
    );
}

#[test]
fn the_arch_folder_and_the_opp_path_lead_to_the_runtime() {
    let arch = format!("{}-linux/lib64", std::env::consts::ARCH);
    // `<root>/<arch>-linux/lib64` only, as CANN's toolkit package lays the files out.
    isolated(
        "the_arch_folder_and_the_opp_path_lead_to_the_runtime",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            let root = install_in("arch", Layout::Split, &arch);
            // SAFETY: as in `use_install`.
            unsafe { std::env::set_var("ASCEND_HOME_PATH", &root) };
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 2, "{}", probe.reason);
        },
    );
    // Only `ASCEND_OPP_PATH` (`<root>/opp`) names the install.
    isolated(
        "the_arch_folder_and_the_opp_path_lead_to_the_runtime",
        &[("ASCEND_EMU_DEVICES", "1")],
        || {
            let root = install_in("opp", Layout::Split, "lib64");
            // SAFETY: as in `use_install`.
            unsafe { std::env::set_var("ASCEND_OPP_PATH", root.join("opp")) };
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 1, "{}", probe.reason);
        },
    );
}

#[test]
fn a_repeated_acl_init_is_not_an_error() {
    isolated(
        "a_repeated_acl_init_is_not_an_error",
        &[("ASCEND_EMU_INIT_ERROR", "100002"), ("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let plugin = plugin();
            assert_eq!(plugin.probe().device_count, 2);
            let device = open(&plugin, 1, &[]);
            let got = gelu_tanh(&device, &[1.0, -1.0]).expect("gelu");
            assert!((got[0] - 0.841_192).abs() < 1e-5, "{got:?}");
        },
    );
}

#[test]
fn a_failing_acl_init_is_the_probe_reason() {
    isolated(
        "a_failing_acl_init_is_the_probe_reason",
        &[("ASCEND_EMU_INIT_ERROR", "100000")],
        || {
            use_install(Layout::Split);
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 0);
            assert!(
                probe.reason.starts_with("aclInit failed"),
                "{}",
                probe.reason
            );
            assert!(
                probe.reason.contains("ACL_ERROR_INVALID_PARAM (100000)"),
                "{}",
                probe.reason
            );
        },
    );
}

#[test]
fn visible_devices_renumber_and_hide_npus() {
    isolated(
        "visible_devices_renumber_and_hide_npus",
        &[("ASCEND_RT_VISIBLE_DEVICES", "1"), ("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let plugin = plugin();
            assert_eq!(plugin.probe().device_count, 1);
            let device = open(&plugin, 0, &[]);
            assert_eq!(device.description().property("visible_devices"), Some("1"));
            let buf = device.alloc(1 << 20).expect("alloc");
            // Physical NPU 1 holds the block and the device's sizing block; NPU 0 nothing.
            assert_eq!(emulator_stats(1).device_blocks, 2);
            assert_eq!(emulator_stats(0).device_blocks, 0);
            device.free(buf).expect("free");
            let err = plugin.open(1, &[]).expect_err("one NPU is visible");
            assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT);
        },
    );
    isolated(
        "visible_devices_renumber_and_hide_npus",
        &[("ASCEND_RT_VISIBLE_DEVICES", "")],
        || {
            use_install(Layout::Split);
            let probe = plugin().probe();
            assert_eq!(probe.device_count, 0);
            assert!(probe.reason.starts_with("0 devices"), "{}", probe.reason);
            assert!(
                probe.reason.contains("ASCEND_RT_VISIBLE_DEVICES="),
                "{}",
                probe.reason
            );
        },
    );
}

#[test]
fn segments_of_whole_huge_pages_take_their_size_and_padding_is_reported() {
    const MIB: u64 = 1 << 20;
    // Without aclrtMallocAlign32, aclrtMalloc's 32 bytes of padding make each segment take one
    // more huge page: 4 MiB for the 2 MiB one, 22 MiB for the 20 MiB one.
    for (refused, malloc, extra) in [
        ("0", "aclrtMallocAlign32", 0),
        ("1", "aclrtMalloc", 4 * MIB),
    ] {
        isolated(
            "segments_of_whole_huge_pages_take_their_size_and_padding_is_reported",
            &[
                ("ASCEND_EMU_HBM", "1GiB"),
                ("ASCEND_EMU_NO_MALLOC_ALIGN32", refused),
            ],
            || {
                use_install(Layout::Split);
                let device = open(&plugin(), 0, &[]);
                device.synchronize().expect("synchronize");
                let before = device.mem_info().expect("mem_info");
                let held_before = device.memory_report().expect("report").held_bytes();
                let segments = [2 * MIB, 20 * MIB];
                let bufs: Vec<BufferHandle> = segments
                    .iter()
                    .map(|&bytes| device.alloc(bytes).expect("alloc"))
                    .collect();
                let during = device.mem_info().expect("mem_info");
                let report = device.memory_report().expect("report");
                let requested: u64 = segments.iter().sum();
                assert_eq!(report.allocated, requested);
                assert_eq!(
                    before.free - during.free,
                    requested + extra,
                    "device memory taken by {requested} bytes of segments"
                );
                // The report explains every byte of the difference.
                assert_eq!(report.held_bytes() - held_before, extra, "{report:?}");
                for buf in bufs {
                    device.free(buf).expect("free");
                }
                device.synchronize().expect("synchronize");
                assert_eq!(device.mem_info().expect("mem_info").free, before.free);
                assert_eq!(
                    device.memory_report().expect("report").held_bytes(),
                    held_before
                );
                assert_eq!(device.description().property("device_malloc"), Some(malloc));
            },
        );
    }
}

#[test]
fn out_of_memory_carries_the_sizes_and_the_device_recovers() {
    isolated(
        "out_of_memory_carries_the_sizes_and_the_device_recovers",
        &[
            ("ASCEND_EMU_HBM", "1GiB"),
            // The device's open makes the first aclrtMalloc (its sizing block).
            ("ASCEND_EMU_FAIL_MALLOC_AT", "4"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let a = device.alloc(4096).expect("first alloc");
            let b = device.alloc(4096).expect("second alloc");
            let err = device
                .alloc(8192)
                .expect_err("the third aclrtMalloc is refused");
            assert!(err.is_out_of_memory(), "{err}");
            assert!(err.message.contains("8192 bytes"), "{err}");
            assert!(err.message.contains("207001"), "{err}");
            let c = device.alloc(8192).expect("the next alloc works");
            let err = device.alloc(2 << 30).expect_err("more than the NPU holds");
            assert!(err.is_out_of_memory(), "{err}");
            assert!(
                err.message.contains(&format!("{} bytes", 2u64 << 30)),
                "{err}"
            );
            assert!(err.message.contains("of 1073741824 bytes free"), "{err}");
            for buf in [a, b, c] {
                device.free(buf).expect("free");
            }
        },
    );
}

#[test]
fn an_out_of_memory_waits_for_queued_frees_and_retries() {
    isolated(
        "an_out_of_memory_waits_for_queued_frees_and_retries",
        &[
            ("ASCEND_EMU_HBM", "1GiB"),
            ("ASCEND_EMU_QUEUE_DELAY_US", "20000"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let big = 700 << 20;
            let a = device.alloc(big).expect("alloc");
            device.zero(a, 0, 1 << 20).expect("queue work on the block");
            // Queue-ordered: the block stays until the fill is done.
            device.free(a).expect("free");
            let report = device.memory_report().expect("report");
            assert_eq!(
                report.allocated, big,
                "a freed block counts until it is released"
            );
            // Does not fit beside the pending block: waits for the queue, releases, retries.
            let b = device.alloc(big).expect("alloc after the queued free");
            device.free(b).expect("free");
            device.synchronize().expect("synchronize");
            assert_eq!(device.memory_report().expect("report").allocated, 0);
        },
    );
}

#[test]
fn scratch_an_op_takes_waits_for_queued_frees_too() {
    isolated(
        "scratch_an_op_takes_waits_for_queued_frees_too",
        &[
            ("ASCEND_EMU_HBM", "1GiB"),
            // Keeps the freed block's work queued when the copy asks for its scratch.
            ("ASCEND_EMU_QUEUE_DELAY_US", "3000000"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            // A strided copy of 256Ki rows of 12 bytes: its source made contiguous in 3 MiB of
            // scratch the plugin takes (copy_batch has no workspace argument).
            let (rows, width) = (256u64 << 10, 12u64);
            let src = device.alloc(rows * 16).expect("alloc");
            let dst = device.alloc(rows * 20).expect("alloc");
            device.zero(src, 0, rows * 16).expect("zero");
            device.synchronize().expect("synchronize");
            let regions: Vec<CopyRegion> = (0..rows)
                .map(|row| CopyRegion {
                    src,
                    src_offset: 16 * row,
                    dst,
                    dst_offset: 20 * row,
                    bytes: width,
                })
                .collect();
            // A block that leaves less than the scratch free, freed behind queued work.
            let free = device.mem_info().expect("mem_info").free;
            let filler = device.alloc(free - (2 << 20)).expect("alloc");
            device
                .zero(filler, 0, 1 << 20)
                .expect("queue work on the block");
            device.free(filler).expect("free");
            // Does not fit beside the pending block: waits for the queue, releases, retries.
            device
                .copy_batch(&regions)
                .expect("the copy's scratch after the queued free");
            device.synchronize().expect("synchronize");
            device.free(src).expect("free");
            device.free(dst).expect("free");
            device.synchronize().expect("synchronize");
            assert_eq!(device.memory_report().expect("report").allocated, 0);
        },
    );
}

#[test]
fn a_failing_kernel_is_reported_at_synchronize_and_the_device_goes_on() {
    isolated(
        "a_failing_kernel_is_reported_at_synchronize_and_the_device_goes_on",
        &[("ASCEND_EMU_FAIL_OP", "aclnnGelu"), ("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let err = gelu_tanh(&device, &[1.0; 16]).expect_err("the first gelu kernel fails");
            assert_eq!(err.code, ErrorCode::INTERNAL, "{err}");
            assert!(err.message.contains("aclrtSynchronizeStream"), "{err}");
            assert!(
                err.message
                    .contains("ACL_ERROR_RT_AICORE_EXCEPTION (507015)"),
                "{err}"
            );
            assert!(
                err.message.contains("injected"),
                "the runtime's recent message: {err}"
            );
            let got = gelu_tanh(&device, &[1.0]).expect("the next one works");
            assert!((got[0] - 0.841_192).abs() < 1e-5);
        },
    );
    isolated(
        "a_failing_kernel_is_reported_at_synchronize_and_the_device_goes_on",
        &[
            ("ASCEND_EMU_FAIL_OP", "aclnnGelu"),
            ("ASCEND_EMU_FAIL_OP_WHEN", "launch"),
            ("ASCEND_EMU_HBM", HBM),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let err = gelu_tanh(&device, &[1.0; 16]).expect_err("the launch fails");
            assert_eq!(err.op, "activation", "reported by the call itself: {err}");
            assert!(
                err.message.contains("aclnnGelu failed: ACLNN_ERR_INNER"),
                "{err}"
            );
            assert!(gelu_tanh(&device, &[1.0]).is_ok());
        },
    );
}

/// Gathers rows `indices` of a 2x2 f32 matrix `[[1, 2], [3, 4]]`; the device's answer after
/// `synchronize`.
fn gather_2x2(device: &Device, indices: [i32; 2]) -> Result<Vec<f32>, DeviceError> {
    let [src, idx, out, ws] = enqueue_gather_2x2(device, indices)?;
    // Healthy calls between the fault and the synchronisation that reports it.
    for buf in [ws, idx, src] {
        device.free(buf).expect("free after a queued fault");
    }
    let result = device.synchronize().map(|()| download_f32(device, out, 4));
    device.free(out).expect("free");
    result
}

/// Enqueues the gather of rows `indices` of a 2x2 f32 matrix `[[1, 2], [3, 4]]`; returns its
/// source, indices, output and workspace buffers.
fn enqueue_gather_2x2(
    device: &Device,
    indices: [i32; 2],
) -> Result<[BufferHandle; 4], DeviceError> {
    let src = upload_f32(device, &[1.0, 2.0, 3.0, 4.0]);
    let index_bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_le_bytes()).collect();
    let idx = device.alloc(8).expect("alloc");
    device.write(idx, 0, &index_bytes).expect("write");
    let out = device.alloc(16).expect("alloc");
    let mut args = GatherArgs {
        src: MatRef::contiguous(src, 0, DType::F32, 2, 2),
        out: MatRef::contiguous(out, 0, DType::F32, 2, 2),
        indices: MatRef::contiguous(idx, 0, DType::I32, 1, 2),
        workspace: BufferSlice::EMPTY,
    };
    let bytes = device.gather_rows_workspace(&args)?;
    let ws = device.alloc(bytes.max(1)).expect("alloc workspace");
    args.workspace = BufferSlice {
        buf: ws,
        offset: 0,
        bytes,
    };
    device.gather_rows(&args)?;
    Ok([src, idx, out, ws])
}

#[test]
fn a_kernel_fault_is_reported_once_and_later_work_succeeds() {
    isolated(
        "a_kernel_fault_is_reported_once_and_later_work_succeeds",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            device.synchronize().expect("synchronize");
            let baseline = device.mem_info().expect("mem_info").free;
            // An index outside the source is an AI core exception on the NPU; the stream
            // stays in error until it is rebuilt.
            let err = gather_2x2(&device, [0, 7]).expect_err("the out-of-range index faults");
            assert!(
                err.message
                    .contains("ACL_ERROR_RT_AICORE_EXCEPTION (507015)"),
                "{err}"
            );
            device
                .synchronize()
                .expect("the fault is reported once, by the synchronisation that covers it");
            let got = gather_2x2(&device, [1, 0]).expect("work after the fault succeeds");
            assert_eq!(got, vec![3.0, 4.0, 1.0, 2.0]);
            device.synchronize().expect("synchronize");
            assert_eq!(device.mem_info().expect("mem_info").free, baseline);
        },
    );
}

/// A stream in error that cannot be destroyed at the first try does not make the NPU
/// unusable: a new stream serves, and the old one is destroyed at close (before, the device
/// was marked lost and every later call failed).
#[test]
fn a_faulted_stream_that_cannot_be_destroyed_does_not_lose_the_npu() {
    isolated(
        "a_faulted_stream_that_cannot_be_destroyed_does_not_lose_the_npu",
        &[
            ("ASCEND_EMU_HBM", HBM),
            ("ASCEND_EMU_FAULTED_DESTROY_FAILS", "1"),
        ],
        || {
            use_install(Layout::Split);
            let before_open = emulator_stats(0).reserved_bytes;
            let device = open(&plugin(), 0, &[]);
            let opened = emulator_stats(0).reserved_bytes;
            let err = gather_2x2(&device, [0, 7]).expect_err("the out-of-range index faults");
            assert!(
                err.message
                    .contains("ACL_ERROR_RT_AICORE_EXCEPTION (507015)"),
                "{err}"
            );
            let got = gather_2x2(&device, [1, 0]).expect("work after the fault succeeds");
            assert_eq!(got, vec![3.0, 4.0, 1.0, 2.0]);
            assert!(
                emulator_stats(0).reserved_bytes > opened,
                "the old stream is still there"
            );
            drop(device);
            assert_eq!(
                emulator_stats(0).reserved_bytes,
                before_open,
                "closing destroyed the old stream too"
            );
        },
    );
}

/// Enqueues a gather with an index outside its 2x2 source (an AI core exception on the NPU)
/// and waits until the emulated NPU has run it into the fault, which no call has met yet.
/// Returns the source, indices, output and workspace buffers.
fn fault_unseen(device: &Device) -> [BufferHandle; 4] {
    let buffers = enqueue_gather_2x2(device, [0, 7]).expect("the launch is accepted");
    std::thread::sleep(std::time::Duration::from_millis(300));
    buffers
}

fn assert_fault(err: &DeviceError) {
    assert!(
        err.message
            .contains("ACL_ERROR_RT_AICORE_EXCEPTION (507015)"),
        "{err}"
    );
}

/// A free, an upload or a download is the first call to meet a fault (recording its event
/// fails on a stream in error): it succeeds, and the fault is reported once, by the next
/// synchronisation or fence wait. Before, the free answered the fault after giving its
/// handle up, and the host's allocator kept handing out the dead buffer.
#[test]
fn calls_that_meet_an_unreported_fault_succeed_and_it_is_reported_once() {
    isolated(
        "calls_that_meet_an_unreported_fault_succeed_and_it_is_reported_once",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            device.synchronize().expect("synchronize");
            let baseline = device.mem_info().expect("mem_info").free;

            // A free meets it.
            for buf in fault_unseen(&device) {
                device.free(buf).expect("a free after the fault");
            }
            assert_fault(&device.synchronize().expect_err("the fault is reported"));
            device.synchronize().expect("reported once");

            // An upload meets it.
            let buffers = fault_unseen(&device);
            device
                .write(buffers[2], 0, &[0u8; 16])
                .expect("an upload after the fault");
            assert_fault(&device.synchronize().expect_err("the fault is reported"));
            device.synchronize().expect("reported once");
            for buf in buffers {
                device.free(buf).expect("free");
            }

            // A download into pinned memory meets it: its fence is recorded on the stream in
            // error, and the wait for that fence reports the fault.
            let mut host = device.host_buffer(16).expect("host buffer");
            let buffers = fault_unseen(&device);
            device
                .download(buffers[2], 0, &mut host, 0, 16)
                .expect("a download after the fault");
            let err = host.as_slice().map(drop).expect_err("the fence's wait");
            assert_fault(&err);
            device.synchronize().expect("reported once");
            drop(host);
            for buf in buffers {
                device.free(buf).expect("free");
            }

            let got = gather_2x2(&device, [1, 0]).expect("work after the faults succeeds");
            assert_eq!(got, vec![3.0, 4.0, 1.0, 2.0]);
            device.synchronize().expect("synchronize");
            assert_eq!(device.mem_info().expect("mem_info").free, baseline);
        },
    );
}

#[test]
fn copies_at_any_offset_and_per_row_copies_merged() {
    isolated(
        "copies_at_any_offset_and_per_row_copies_merged",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let source: Vec<u8> = (0..=255).collect();
            let src = device.alloc(256).expect("alloc");
            device.write(src, 0, &source).expect("write");
            let dst = device.alloc(512).expect("alloc");
            device.zero(dst, 0, 512).expect("zero");
            let region = |src_offset, dst_offset, bytes| CopyRegion {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            };
            // Per-row copies of 12 bytes, 16 apart in the source and 20 in the destination
            // (one strided copy), then single copies: unaligned, aligned (a plain
            // aclrtMemcpyAsync), and unaligned again.
            let mut regions: Vec<CopyRegion> = (0..6)
                .map(|row| region(4 + 16 * row, 200 + 20 * row, 12))
                .collect();
            regions.push(region(3, 5, 40));
            regions.push(region(128, 384, 64));
            regions.push(region(250, 340, 6));
            device.copy_batch(&regions).expect("copy_batch");
            let mut got = vec![0u8; 512];
            device.read(dst, 0, &mut got).expect("read");
            let mut want = vec![0u8; 512];
            for r in &regions {
                let at = |v: u64| usize::try_from(v).expect("a small offset");
                let (s, d, n) = (at(r.src_offset), at(r.dst_offset), at(r.bytes));
                want[d..d + n].copy_from_slice(&source[s..s + n]);
            }
            assert_eq!(got, want);
            device.free(src).expect("free");
            device.free(dst).expect("free");
        },
    );
}

#[test]
fn the_scratch_of_a_strided_copy_is_reported_until_the_queue_passes_it() {
    isolated(
        "the_scratch_of_a_strided_copy_is_reported_until_the_queue_passes_it",
        &[
            ("ASCEND_EMU_HBM", HBM),
            // Keeps the copy queued while the test looks at the device.
            ("ASCEND_EMU_QUEUE_DELAY_US", "50000"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let scratch_row = |report: &iris_plugin::host::PluginMemory| {
                report
                    .held
                    .iter()
                    .find(|(what, _)| what.contains("scratch of queued copies"))
                    .map(|(_, bytes)| *bytes)
                    .expect("the report has a row for copy scratch")
            };
            let (rows, width) = (4096u64, 12u64);
            let src = device.alloc(rows * 16).expect("alloc");
            let dst = device.alloc(rows * 20).expect("alloc");
            device.zero(src, 0, rows * 16).expect("zero");
            device.synchronize().expect("synchronize");
            let free_before = device.mem_info().expect("mem_info").free;
            let report_before = device.memory_report().expect("report");
            assert_eq!(scratch_row(&report_before), 0);
            // Rows 16 bytes apart in the source and 20 in the destination: one strided copy
            // as an op, whose non-contiguous source aclnnInplaceCopy first copies into its
            // workspace. copy_batch has no workspace argument, so the plugin takes it.
            let regions: Vec<CopyRegion> = (0..rows)
                .map(|row| CopyRegion {
                    src,
                    src_offset: 16 * row,
                    dst,
                    dst_offset: 20 * row,
                    bytes: width,
                })
                .collect();
            device.copy_batch(&regions).expect("copy_batch");
            let free_during = device.mem_info().expect("mem_info").free;
            let report_during = device.memory_report().expect("report");
            let scratch = scratch_row(&report_during);
            assert!(
                scratch >= rows * width,
                "the source's {} bytes made contiguous: {report_during:?}",
                rows * width
            );
            assert_eq!(report_during.allocated, report_before.allocated);
            // Every byte the device lost since is in the report.
            assert_eq!(
                free_before - free_during,
                report_during.held_bytes() - report_before.held_bytes(),
                "{report_during:?}"
            );
            device.synchronize().expect("synchronize");
            let report_after = device.memory_report().expect("report");
            assert_eq!(scratch_row(&report_after), 0, "{report_after:?}");
            assert_eq!(device.mem_info().expect("mem_info").free, free_before);
            device.free(src).expect("free");
            device.free(dst).expect("free");
        },
    );
}

#[test]
fn overlapping_opens_of_one_npu_release_everything_after_the_last() {
    isolated(
        "overlapping_opens_of_one_npu_release_everything_after_the_last",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let plugin = plugin();
            let first = open(&plugin, 0, &[]);
            let second = open(&plugin, 0, &[]);
            drop(first);
            // The second open keeps its context: the first close undid only its own set.
            let buf = upload_f32(&second, &[1.5, -2.0]);
            assert_eq!(download_f32(&second, buf, 2), vec![1.5, -2.0]);
            second.free(buf).expect("free");
            drop(second);
            let stats = emulator_stats(0);
            assert_eq!(
                stats.reserved_bytes, 0,
                "every aclrtSetDevice undone: the default context is released ({stats:?})"
            );
        },
    );
}

#[test]
fn a_free_without_an_event_waits_for_the_queue_first() {
    isolated(
        "a_free_without_an_event_waits_for_the_queue_first",
        &[
            ("ASCEND_EMU_HBM", HBM),
            ("ASCEND_EMU_MAX_EVENTS", "0"),
            ("ASCEND_EMU_QUEUE_DELAY_US", "20000"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let buf = device.alloc(1 << 20).expect("alloc");
            device
                .zero(buf, 0, 1 << 20)
                .expect("queue work on the block");
            // No event can be recorded behind the fill: the free must not release the block
            // under the queued fill.
            device.free(buf).expect("free");
            device.synchronize().expect("the fill ran on live memory");
            assert_eq!(
                emulator_stats(0).device_blocks,
                1,
                "only the sizing block is left"
            );
        },
    );
}

#[test]
fn a_call_at_a_new_offset_reuses_the_workspace_measurement() {
    isolated(
        "a_call_at_a_new_offset_reuses_the_workspace_measurement",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let buf = upload_f32(&device, &[0.5; 64]);
            let ws = device.alloc(1 << 20).expect("alloc workspace");
            // First phases a gelu over 16 values at element `offset` makes, workspace query
            // and run.
            let gelu_at = |offset: u64| {
                let before = emulator_stats(0).first_phases;
                let x = MatRef::contiguous(buf, offset * 4, DType::F32, 1, 16);
                let mut args = ActivationArgs {
                    x,
                    out: x,
                    activation: Activation::GELU_TANH,
                    workspace: BufferSlice::EMPTY,
                };
                let bytes = device.activation_workspace(&args).expect("workspace");
                args.workspace = BufferSlice {
                    buf: ws,
                    offset: 0,
                    bytes,
                };
                device.activation(&args).expect("activation");
                emulator_stats(0).first_phases - before
            };
            let first = gelu_at(0);
            // A second call at the same offset reuses the measurement: only the run's own
            // first phases.
            let run = gelu_at(0);
            assert!(
                first > run,
                "the first call measures its workspace: {first} vs {run}"
            );
            // The same shapes at other offsets: the same.
            for offset in [16, 32, 48] {
                assert_eq!(
                    gelu_at(offset),
                    run,
                    "first phases of a call at offset {offset}"
                );
            }
            device.synchronize().expect("synchronize");
            device.free(ws).expect("free");
            device.free(buf).expect("free");
        },
    );
}

#[test]
fn frees_and_uploads_reuse_events() {
    isolated(
        "frees_and_uploads_reuse_events",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let before = emulator_stats(0).events_created;
            for _ in 0..20 {
                let buf = device.alloc(4096).expect("alloc");
                device.write(buf, 0, &[7u8; 4096]).expect("write");
                device.free(buf).expect("free");
                device.synchronize().expect("synchronize");
            }
            let created = emulator_stats(0).events_created - before;
            assert!(
                created <= 2,
                "{created} events created for 20 uploads and 20 frees"
            );
        },
    );
}

#[test]
fn a_panic_inside_the_emulated_op_is_an_error_not_a_crash() {
    for when in ["kernel", "phase1"] {
        isolated(
            "a_panic_inside_the_emulated_op_is_an_error_not_a_crash",
            &[
                ("ASCEND_EMU_PANIC_OP", "aclnnGelu"),
                ("ASCEND_EMU_PANIC_OP_WHEN", when),
                ("ASCEND_EMU_HBM", HBM),
            ],
            || {
                use_install(Layout::Split);
                let device = open(&plugin(), 0, &[]);
                let err = gelu_tanh(&device, &[1.0]).expect_err("the op panics");
                assert_eq!(err.code, ErrorCode::INTERNAL, "{err}");
                assert!(err.message.contains("panic"), "{err}");
                // The device still works for everything else.
                let buf = upload_f32(&device, &[1.5, 2.5]);
                assert_eq!(download_f32(&device, buf, 2), vec![1.5, 2.5]);
                device.free(buf).expect("free");
            },
        );
    }
}

#[test]
fn a_large_write_is_staged_through_a_bounded_pinned_pool() {
    isolated(
        "a_large_write_is_staged_through_a_bounded_pinned_pool",
        &[
            ("ASCEND_EMU_HBM", HBM),
            ("ASCEND_EMU_QUEUE_DELAY_US", "50000"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            // 640 MiB: ten staging chunks, more than the pinned pool holds.
            let block: Vec<u8> = (0..(1usize << 20) + 7)
                .map(|i| u8::try_from(i % 251).unwrap_or(0))
                .collect();
            let mut data = block.repeat(640);
            data.truncate(640 << 20);
            let len = data.len();
            let buf = device.alloc(len as u64).expect("alloc");
            device.write(buf, 0, &data).expect("write");
            let pinned = emulator_stats(0).pinned_bytes;
            assert!(pinned <= 256 << 20, "{pinned} bytes pinned for staging");
            let mut back = vec![0u8; 4096];
            for offset in [0usize, 64 << 20, len - 4096] {
                device.read(buf, offset as u64, &mut back).expect("read");
                assert!(back == data[offset..offset + 4096], "bytes at {offset}");
            }
            device.free(buf).expect("free");
        },
    );
}

#[test]
fn calls_from_many_threads_set_the_context_on_each() {
    isolated(
        "calls_from_many_threads_set_the_context_on_each",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let buf = std::thread::scope(|s| {
                s.spawn(|| upload_f32(&device, &[3.0, 4.0]))
                    .join()
                    .expect("thread")
            });
            let got = std::thread::scope(|s| {
                s.spawn(|| download_f32(&device, buf, 2))
                    .join()
                    .expect("thread")
            });
            assert_eq!(got, vec![3.0, 4.0]);
            std::thread::scope(|s| s.spawn(|| device.free(buf)).join().expect("thread"))
                .expect("free");
        },
    );
}

#[test]
fn the_310p_has_no_bf16_or_layer_norm_and_reports_ddr() {
    isolated(
        "the_310p_has_no_bf16_or_layer_norm_and_reports_ddr",
        &[("ASCEND_EMU_SOC", "Ascend310P3"), ("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let desc = device.description();
            assert!(!desc.dtypes.contains(&DType::BF16), "{:?}", desc.dtypes);
            assert!(!device.supports(OpKind::LAYER_NORM));
            // Rotary and attention compose from the ops the 310P has.
            assert!(device.supports(OpKind::ROTARY));
            let x16 = MatRef::contiguous(BufferHandle(1), 0, DType::F16, 4, 64);
            let table = MatRef::contiguous(BufferHandle(2), 0, DType::F32, 4, 64);
            let rotary = RotaryArgs {
                x: x16,
                heads: 1,
                head_dim: 64,
                cos: table,
                sin: MatRef {
                    offset: 1024,
                    ..table
                },
                workspace: BufferSlice::EMPTY,
            };
            assert!(device.rotary_workspace(&rotary).expect("rotary") > 0);
            assert!(device.supports(OpKind::RMS_NORM));
            assert_eq!(desc.property("memory_kind"), Some("DDR"));
            assert_eq!(device.mem_info().expect("mem_info").total, 4 << 30);
            let x = MatRef::contiguous(BufferHandle(1), 0, DType::F16, 2, 8);
            let w = MatRef::contiguous(BufferHandle(2), 0, DType::F16, 1, 8);
            let norm = NormArgs {
                x,
                weight: w,
                bias: MatRef::NONE,
                out: x,
                eps: 1e-6,
                workspace: BufferSlice::EMPTY,
            };
            let err = device
                .layer_norm_workspace(&norm)
                .expect_err("no LayerNorm kernels");
            assert_eq!(err.code, ErrorCode::UNSUPPORTED);
            assert!(err.message.contains("310P"), "{err}");
            let bf16 = NormArgs {
                x: MatRef {
                    dtype: DType::BF16,
                    ..x
                },
                weight: MatRef {
                    dtype: DType::BF16,
                    ..w
                },
                out: MatRef {
                    dtype: DType::BF16,
                    ..x
                },
                ..norm
            };
            let err = device.rms_norm_workspace(&bf16).expect_err("no bf16");
            assert_eq!(err.code, ErrorCode::UNSUPPORTED);
            // f16 works, and f32 attention runs composed with cubeMathType 1.
            let got = gelu_tanh(&device, &[1.0]).expect("gelu");
            assert!((got[0] - 0.841_192).abs() < 1e-5);
            let attention = attention_query(DType::F32, 8, &[0, 3]);
            assert!(device.attention_workspace(&attention).expect("attention") > 0);
            drop(device);
            // Asking for the fused kernels this part has not is refused at open, by name.
            let options = [("attention".to_owned(), "fused".to_owned())];
            let err = plugin()
                .open(0, &options)
                .expect_err("no fused attention on the 310P");
            assert!(
                err.message.contains("attention = \"fused\"")
                    && err.message.contains("Ascend310P3"),
                "{err}"
            );
        },
    );
}

#[test]
fn mem_info_shows_a_free_once_its_queued_work_is_done() {
    isolated(
        "mem_info_shows_a_free_once_its_queued_work_is_done",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            device.synchronize().expect("synchronize");
            let baseline = device.mem_info().expect("mem_info").free;
            let buf = device.alloc(64 << 20).expect("alloc");
            device.write(buf, 0, &[1u8; 4096]).expect("write");
            assert!(device.mem_info().expect("mem_info").free < baseline);
            device.free(buf).expect("free");
            // No synchronisation: the free is queue-ordered, and once the queue has run the
            // figures must show it without one.
            let mut free = 0;
            for _ in 0..500 {
                free = device.mem_info().expect("mem_info").free;
                if free == baseline {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert_eq!(free, baseline, "the freed block still counts as used");
        },
    );
}

#[test]
fn a_pattern_fill_takes_no_device_memory_outside_the_allocator() {
    isolated(
        "a_pattern_fill_takes_no_device_memory_outside_the_allocator",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let buf = device.alloc(4096).expect("alloc");
            device
                .fill(&FillArgs {
                    dst: BufferSlice {
                        buf,
                        offset: 0,
                        bytes: 4096,
                    },
                    value: 0,
                    width: 4,
                })
                .expect("zero fill");
            let mallocs = emulator_stats(0).mallocs;
            // f16 1.0 (0x3c00): not one repeated byte, so no memset can write it.
            device
                .fill(&FillArgs {
                    dst: BufferSlice {
                        buf,
                        offset: 2,
                        bytes: 4092,
                    },
                    value: 0x3c00,
                    width: 2,
                })
                .expect("pattern fill");
            device.synchronize().expect("synchronize");
            assert_eq!(
                emulator_stats(0).mallocs,
                mallocs,
                "fill allocated device memory"
            );
            let mut bytes = vec![0u8; 4096];
            device.read(buf, 0, &mut bytes).expect("read");
            assert_eq!(&bytes[..2], &[0, 0]);
            assert!(bytes[2..4094].chunks_exact(2).all(|h| h == [0x00, 0x3c]));
            assert_eq!(&bytes[4094..], &[0, 0]);
            device.free(buf).expect("free");
        },
    );
}

#[test]
fn the_runtime_version_is_the_cann_release() {
    isolated(
        "the_runtime_version_is_the_cann_release",
        &[("ASCEND_EMU_HBM", HBM)],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let desc = device.description();
            // aclsysGetCANNVersion's release, not aclrtGetVersion's AscendCL API version.
            assert_eq!(desc.property("runtime_version"), Some("8.5.0"));
            assert_eq!(desc.property("acl_api_version"), Some("1.0.0"));
        },
    );
}

#[test]
fn parts_other_than_a2_and_a3_get_the_conservative_rules() {
    for soc in ["Ascend910ProB", "Ascend310B1"] {
        isolated(
            "parts_other_than_a2_and_a3_get_the_conservative_rules",
            &[("ASCEND_EMU_SOC", soc), ("ASCEND_EMU_HBM", HBM)],
            || {
                use_install(Layout::Split);
                let device = open(&plugin(), 0, &[]);
                let desc = device.description();
                // BF16 is documented for A2 and A3 only; f32 matmuls run with cubeMathType 1,
                // the only mode these parts accept for f32; attention and rotary composed.
                assert!(!desc.dtypes.contains(&DType::BF16), "{:?}", desc.dtypes);
                // An f32 matmul runs (computed in f16 there, so checked to f16's precision).
                const M: usize = 2;
                const K: usize = 8;
                const N: usize = 3;
                let a: Vec<f32> = (0..M * K).map(|i| (i as f32) * 0.125 - 0.5).collect();
                let w: Vec<f32> = (0..N * K).map(|i| 0.25 - (i as f32) * 0.0625).collect();
                let (a_buf, w_buf) = (upload_f32(&device, &a), upload_f32(&device, &w));
                let out = device.alloc((M * N * 4) as u64).expect("alloc");
                let mut args = GemmArgs {
                    a: MatRef::contiguous(a_buf, 0, DType::F32, M as u64, K as u64),
                    w: MatRef::contiguous(w_buf, 0, DType::F32, N as u64, K as u64),
                    bias: MatRef::NONE,
                    out: MatRef::contiguous(out, 0, DType::F32, M as u64, N as u64),
                    activation: Activation::NONE,
                    accumulate: false,
                    w_transposed: false,
                    w_constant: false,
                    workspace: BufferSlice::EMPTY,
                };
                let bytes = device.gemm_workspace(&args).expect("f32 gemm on this part");
                let ws = device.alloc(bytes.max(1)).expect("alloc");
                args.workspace = BufferSlice {
                    buf: ws,
                    offset: 0,
                    bytes,
                };
                device.gemm(&args).expect("f32 gemm");
                let got = download_f32(&device, out, M * N);
                for row in 0..M {
                    for col in 0..N {
                        let want: f32 = (0..K).map(|i| a[row * K + i] * w[col * K + i]).sum();
                        let err = (got[row * N + col] - want).abs();
                        assert!(err <= 1e-2 * (1.0 + want.abs()), "{got:?}");
                    }
                }
                for buf in [a_buf, w_buf, out, ws] {
                    device.free(buf).expect("free");
                }
                // Attention and rotary compose from basic ops.
                let attention = attention_query(DType::F16, 64, &[0, 4]);
                assert!(device.attention_workspace(&attention).expect("attention") > 0);
                let got = gelu_tanh(&device, &[1.0]).expect("gelu");
                assert!((got[0] - 0.841_192).abs() < 1e-5, "{got:?}");
            },
        );
    }
}

#[test]
fn the_a3_runs_the_fused_attention() {
    // Every call of the fused op fails at launch: a conformance check meets it only when the
    // plugin chose the fused op.
    isolated(
        "the_a3_runs_the_fused_attention",
        &[
            ("ASCEND_EMU_SOC", "Ascend910_9392"),
            ("ASCEND_EMU_HBM", HBM),
            ("ASCEND_EMU_FAIL_OP", "aclnnFlashAttentionVarLenScore"),
            ("ASCEND_EMU_FAIL_OP_WHEN", "launch"),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            let report = conformance::run(device.plugin(), &device);
            let fused: Vec<String> = report
                .failures()
                .map(|check| format!("{}: {}", check.name, check.status))
                .filter(|text| text.contains("aclnnFlashAttentionVarLenScore"))
                .collect();
            assert!(!fused.is_empty(), "{:?}", report.checks);
        },
    );
    isolated(
        "the_a3_runs_the_fused_attention",
        &[
            ("ASCEND_EMU_SOC", "Ascend910_9392"),
            ("ASCEND_EMU_HBM", HBM),
        ],
        || {
            use_install(Layout::Split);
            let device = open(&plugin(), 0, &[]);
            assert!(device.description().dtypes.contains(&DType::BF16));
            assert_conformance(&device);
        },
    );
}

#[test]
fn no_executor_or_descriptor_outlives_a_failed_call() {
    let faults: [&[(&str, &str)]; 4] = [
        &[
            ("ASCEND_EMU_FAIL_OP", "aclnnGelu"),
            ("ASCEND_EMU_FAIL_OP_WHEN", "launch"),
        ],
        &[("ASCEND_EMU_FAIL_OP", "aclnnGelu")],
        &[
            ("ASCEND_EMU_PANIC_OP", "aclnnGelu"),
            ("ASCEND_EMU_PANIC_OP_WHEN", "phase1"),
        ],
        &[("ASCEND_EMU_PANIC_OP", "aclnnGelu")],
    ];
    for fault in faults {
        let mut env = fault.to_vec();
        env.push(("ASCEND_EMU_HBM", HBM));
        isolated(
            "no_executor_or_descriptor_outlives_a_failed_call",
            &env,
            || {
                use_install(Layout::Split);
                {
                    let device = open(&plugin(), 0, &[]);
                    gelu_tanh(&device, &[1.0]).expect_err("the injected fault");
                    let got = gelu_tanh(&device, &[1.0]).expect("the next call");
                    assert!((got[0] - 0.841_192).abs() < 1e-5, "{got:?}");
                    // Every executor was run, or released after its first phase, and every
                    // descriptor destroyed, while the device is still open.
                    let stats = emulator_stats(0);
                    assert_eq!(
                        (
                            stats.executors,
                            stats.tensors,
                            stats.scalars,
                            stats.int_arrays
                        ),
                        (0, 0, 0, 0),
                        "{stats:?}"
                    );
                }
                assert_released(emulator_stats(0));
            },
        );
    }
}
