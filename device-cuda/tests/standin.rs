//! The plugin over a stand-in driver: probe, open, memory, transfers, fills, staging, error
//! mapping and the memory report, through the real ABI, on machines without a GPU.
//!
//! The stand-in (`tests/standin/libcuda.c`) is built with the C compiler and put first on
//! `LD_LIBRARY_PATH` of a child process (see `common`). Each parent test below runs one scenario
//! in a child (this test binary again, running [`scenario`] with `IRIS_STANDIN_SCENARIO`) and
//! fails when the child fails or dies.

// Test data: small indices and byte patterns whose casts are exact, and reference loops that
// read clearer with indices.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::needless_range_loop,
    clippy::type_complexity
)]

mod common;

use common::{
    CUDA13_DRIVER, Libraries, Library, Standin, child, plugin_library, run, standin, system_driver,
    text,
};
use iris_plugin::abi::{
    Activation, ActivationArgs, BufferSlice, CopyRegion, DType, FillArgs, MatRef, property,
};
use iris_plugin::{ErrorCode, Plugin, load_library};

// ---------------------------------------------------------------------------------------------
// Parent tests
// ---------------------------------------------------------------------------------------------

#[test]
fn without_a_driver_probe_names_the_library_and_open_is_unavailable() {
    if let Some(why) = system_driver() {
        eprintln!("skipped: {why}");
        return;
    }
    run("no_driver", &[], Libraries::None);
}

#[test]
fn the_toolkit_stub_is_reported_as_such() {
    run("stub", &[("IRIS_STANDIN_MODE", "stub")], Libraries::Driver);
}

#[test]
fn a_system_whose_fabric_manager_is_down_is_unavailable_with_a_hint() {
    run(
        "not_ready",
        &[("IRIS_STANDIN_MODE", "not_ready")],
        Libraries::Driver,
    );
}

#[test]
fn informational_attributes_that_fail_do_not_fail_open() {
    // 16: the SM count; 36: the memory clock (bandwidth); 13: the SM clock (peak FLOP/s).
    for attribute in ["16", "36", "13"] {
        run(
            "attribute_fails",
            &[("IRIS_STANDIN_FAIL_ATTRIBUTE", attribute)],
            Libraries::Driver,
        );
    }
}

#[test]
fn no_device_and_hidden_devices_give_reasons() {
    run(
        "no_device",
        &[("IRIS_STANDIN_MODE", "no_device")],
        Libraries::Driver,
    );
    run("hidden", &[("CUDA_VISIBLE_DEVICES", "")], Libraries::Driver);
}

#[test]
fn a_driver_older_than_cuda_12_is_refused() {
    run(
        "old_driver",
        &[("IRIS_STANDIN_DRIVER", "11080")],
        Libraries::Driver,
    );
}

#[test]
fn memory_transfers_fills_and_the_report_work() {
    run(
        "memory",
        &[("IRIS_STANDIN_MEMORY", &(64u64 << 20).to_string())],
        Libraries::Driver,
    );
}

#[test]
fn devices_without_memory_pools_free_after_the_queue() {
    run(
        "memory",
        &[
            ("IRIS_STANDIN_POOLS", "0"),
            ("IRIS_STANDIN_MEMORY", &(64u64 << 20).to_string()),
        ],
        Libraries::Driver,
    );
}

#[test]
fn out_of_memory_is_reported_with_sizes_and_the_device_goes_on() {
    run(
        "oom",
        &[
            ("IRIS_STANDIN_OOM_AT", "2"),
            ("IRIS_STANDIN_MEMORY", &(64u64 << 20).to_string()),
        ],
        Libraries::Driver,
    );
}

#[test]
fn driver_failures_carry_the_call_and_the_cuda_name() {
    run(
        "copy_failure",
        &[("IRIS_STANDIN_FAIL_COPY", "719")],
        Libraries::Driver,
    );
}

/// A kernel that faults (an illegal address) leaves the context unusable, as on a GPU: the
/// next synchronisation and every later call fail with the sticky error as `unavailable`,
/// none panics, and closing the device releases the context, which gives back what the
/// plugin could no longer free, with no driver call after it. A new open works again.
#[test]
fn a_kernel_fault_makes_every_later_call_unavailable_and_close_gives_the_memory_back() {
    run("fault", &[], Libraries::Full);
}

#[test]
fn opening_for_ops_without_cublas_is_a_clear_error() {
    run("no_blas", &[], Libraries::Driver);
}

/// CUDA 12's stand-in cuBLAS, cuBLASLt and NVRTC, each reporting 12.
const CUDA12: &[Standin] = &[
    standin(Library::Cublas, 12),
    standin(Library::CublasLt, 12),
    standin(Library::Nvrtc, 12),
];
/// CUDA 13's, each reporting 13: a host with only CUDA 13's libraries (PyTorch's cu130 wheels).
const CUDA13: &[Standin] = &[
    standin(Library::Cublas, 13),
    standin(Library::CublasLt, 13),
    standin(Library::Nvrtc, 13),
];
/// Both majors' complete sets.
const BOTH: &[Standin] = &[
    standin(Library::Cublas, 12),
    standin(Library::CublasLt, 12),
    standin(Library::Nvrtc, 12),
    standin(Library::Cublas, 13),
    standin(Library::CublasLt, 13),
    standin(Library::Nvrtc, 13),
];
/// CUDA 12's complete set beside CUDA 13's cuBLAS and cuBLASLt without NVRTC.
const TWELVE_AND_THIRTEEN_WITHOUT_NVRTC: &[Standin] = &[
    standin(Library::Cublas, 12),
    standin(Library::CublasLt, 12),
    standin(Library::Nvrtc, 12),
    standin(Library::Cublas, 13),
    standin(Library::CublasLt, 13),
];
/// CUDA 12's cuBLAS with CUDA 13's cuBLASLt.
const MIXED: &[Standin] = &[standin(Library::Cublas, 12), standin(Library::CublasLt, 13)];
/// CUDA 12's complete set, and cuBLAS and cuBLASLt under CUDA 13's names that say 12.0.0.
const MISNAMED_13: &[Standin] = &[
    standin(Library::Cublas, 12),
    standin(Library::CublasLt, 12),
    standin(Library::Nvrtc, 12),
    Standin {
        library: Library::Cublas,
        name_major: 13,
        version_major: 12,
    },
    Standin {
        library: Library::CublasLt,
        name_major: 13,
        version_major: 12,
    },
];

/// CUDA 13's set with a cuDNN built for CUDA 13, and with one built for CUDA 12.
const CUDA13_CUDNN13: &[Standin] = &[
    standin(Library::Cublas, 13),
    standin(Library::CublasLt, 13),
    standin(Library::Nvrtc, 13),
    standin(Library::Cudnn, 13),
];
const CUDA13_CUDNN12: &[Standin] = &[
    standin(Library::Cublas, 13),
    standin(Library::CublasLt, 13),
    standin(Library::Nvrtc, 13),
    standin(Library::Cudnn, 12),
];

/// Why CUDA 13 is left out under a 12.4 driver.
const DRIVER_12: &str = "the driver supports CUDA 12.4, its libraries need 13.0 or newer";
/// CUDA 12 is not looked at once CUDA 13's complete set loads under a 13.0 driver.
const TWELVE_NOT_TRIED: &str = "not tried, CUDA 13 comes first with a CUDA 13.0 driver";

#[test]
fn one_plugin_opens_over_cuda_12s_libraries_and_says_why_not_13() {
    // A 12.4 driver: CUDA 13 is not a candidate.
    let expected = format!("CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: {DRIVER_12}");
    let env = [
        (EXPECT_ENV, expected.as_str()),
        (KERNELS_ENV, "compiled sm_80"),
    ];
    run("libraries", &env, Libraries::Installed("cuda12", CUDA12));
    // A 13.0 driver, and only CUDA 12's libraries: CUDA 13's are looked for first.
    let expected = "CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: libcublasLt.so.13 not found, \
     libcublas.so.13 not found";
    let env = [
        (EXPECT_ENV, expected),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    run("libraries", &env, Libraries::Installed("cuda12", CUDA12));
    // Without NVRTC the kernels come from the cache, and the description says so.
    let expected = format!(
        "CUDA 12 (cuBLAS 12.0.0, kernels from the cache without NVRTC: libnvrtc.so.12 not \
         found); CUDA 13: {DRIVER_12}"
    );
    let env = [
        (EXPECT_ENV, expected.as_str()),
        (KERNELS_ENV, "cached sm_80"),
        (CACHED_ENV, "1"),
    ];
    run("libraries", &env, Libraries::Full);
    // Without NVRTC and without cached kernels, open says what is missing.
    let env = [(
        EXPECT_ENV,
        "error: libnvrtc.so.12 not found (tried NVRTC of CUDA 12, the major of the cuBLAS \
         loaded, compiles the kernels: libnvrtc.so.12 not found; searched|the kernel cache is off",
    )];
    run("libraries", &env, Libraries::Full);
}

#[test]
fn one_plugin_opens_over_cuda_13s_libraries_and_says_why_not_12() {
    let expected = format!("CUDA 13 (cuBLAS 13.0.0, NVRTC 13.0); CUDA 12: {TWELVE_NOT_TRIED}");
    let env = [
        (EXPECT_ENV, expected.as_str()),
        (KERNELS_ENV, "compiled sm_80"),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    run("libraries", &env, Libraries::Installed("cuda13", CUDA13));
    // A 12.x driver cannot run CUDA 13's libraries, and there are no others.
    let expected = format!(
        "error: no CUDA major's cuBLAS and cuBLASLt load: CUDA 13: {DRIVER_12}; CUDA 12: \
         libcublasLt.so.12 not found, libcublas.so.12 not found (searched the dynamic loader's \
         path"
    );
    let env = [(EXPECT_ENV, expected.as_str())];
    run("libraries", &env, Libraries::Installed("cuda13", CUDA13));
}

/// Which attention a Hopper device runs (`attention_engine`, shown by `iris devices`) as the
/// installed cuDNN allows: `auto` takes a cuDNN 9.13.1+ built for the CUDA major the process
/// loaded and says why it did not take any other; `cudnn` makes any of those reasons an error
/// of the open.
#[test]
fn attention_engine_takes_cudnn_where_it_is_usable_and_says_why_not() {
    let hopper = [
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
        ("IRIS_STANDIN_CC", "90"),
    ];
    let case = |set: Libraries, option: &str, expected: &str, extra: &[(&str, &str)]| {
        let mut env = hopper.to_vec();
        env.extend([(ENGINE_ENV, option), (EXPECT_ENV, expected)]);
        env.extend(extra);
        run("attention_engine", &env, set);
    };
    let usable = Libraries::Installed("cuda13-cudnn13", CUDA13_CUDNN13);
    case(usable, "auto", "cudnn 9.17.0 for bf16 64, f16 64,", &[]);
    case(usable, "kernel", "kernel: attention_engine = kernel", &[]);
    let too_old = "is cuDNN 9.12.0; its fused attention operation needs 9.13.1 or newer";
    case(
        usable,
        "auto",
        &format!("kernel: |{too_old}"),
        &[("IRIS_STANDIN_CUDNN_VERSION", "91200")],
    );
    case(
        usable,
        "cudnn",
        &format!("error: attention_engine = cudnn: |{too_old}"),
        &[("IRIS_STANDIN_CUDNN_VERSION", "91200")],
    );
    // 9.13.0 has the operation, but cuDNN's own frontend builds it from 9.13.1 on.
    case(
        usable,
        "auto",
        "kernel: |is cuDNN 9.13.0; its fused attention operation needs 9.13.1 or newer",
        &[("IRIS_STANDIN_CUDNN_VERSION", "91300")],
    );
    let other_major = "(cuDNN 9.17.0) is built for CUDA 12.8, and this process runs CUDA 13's \
                       libraries: install cuDNN for CUDA 13 (pip's nvidia-cudnn-cu13)";
    let mismatched = Libraries::Installed("cuda13-cudnn12", CUDA13_CUDNN12);
    case(mismatched, "auto", &format!("kernel: |{other_major}"), &[]);
    case(
        mismatched,
        "cudnn",
        &format!("error: attention_engine = cudnn: |{other_major}"),
        &[],
    );
    let missing = Libraries::Installed("cuda13", CUDA13);
    case(
        missing,
        "auto",
        "kernel: libcudnn.so.9 not found (searched",
        &[],
    );
    case(
        missing,
        "cudnn",
        "error: attention_engine = cudnn: libcudnn.so.9 not found",
        &[],
    );
    // A heuristic without engines (what cuDNN answers for shapes none takes): nothing passes
    // the check, and the kernels serve.
    case(
        usable,
        "auto",
        "kernel: cuDNN 9.17.0 did not pass the check at open; the plugin's kernel for bf16 64: no \
         cuDNN engine takes the check's shape",
        &[("IRIS_STANDIN_CUDNN_NO_ENGINE", "1")],
    );
}

#[test]
fn with_both_majors_installed_the_driver_and_the_device_choose() {
    let both = Libraries::Installed("both", BOTH);
    // A 13.0 driver and an Ampere device: CUDA 13, its NVRTC compiling for sm_80.
    let expected = format!("CUDA 13 (cuBLAS 13.0.0, NVRTC 13.0); CUDA 12: {TWELVE_NOT_TRIED}");
    let env = [
        (EXPECT_ENV, expected.as_str()),
        (KERNELS_ENV, "compiled sm_80"),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    run("libraries", &env, both);
    // A 12.4 driver: CUDA 12.
    let expected = format!("CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: {DRIVER_12}");
    run("libraries", &[(EXPECT_ENV, expected.as_str())], both);
    // A Volta device under a 13.0 driver: CUDA 13 no longer supports it.
    let expected = "CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: compute capability 7.0 is \
     below the 7.5 its libraries support";
    let env = [
        (EXPECT_ENV, expected),
        (KERNELS_ENV, "compiled sm_70"),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
        ("IRIS_STANDIN_CC", "70"),
    ];
    run("libraries", &env, both);
    // A Blackwell device (12.0): the kernels' target follows the NVRTC of the major loaded.
    // CUDA 13's knows sm_120; CUDA 12's (up to sm_90 in the stand-in) makes PTX for the newest
    // architecture it knows, which the driver finishes.
    let env = [
        (EXPECT_ENV, "prefix: CUDA 13 (cuBLAS 13.0.0, NVRTC 13.0)"),
        (KERNELS_ENV, "compiled sm_120"),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
        ("IRIS_STANDIN_CC", "120"),
    ];
    run("libraries", &env, both);
    let env = [
        (EXPECT_ENV, "prefix: CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0)"),
        (KERNELS_ENV, "compiled compute_90"),
        ("IRIS_STANDIN_CC", "120"),
    ];
    run("libraries", &env, both);
}

#[test]
fn a_major_with_nvrtc_is_preferred_to_one_without() {
    let expected = "CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: cuBLAS and cuBLASLt load but \
     libnvrtc.so.13 not found; CUDA 12 has NVRTC";
    let env = [
        (EXPECT_ENV, expected),
        (KERNELS_ENV, "compiled sm_80"),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    let libraries = Libraries::Installed("twelve-and-thirteen", TWELVE_AND_THIRTEEN_WITHOUT_NVRTC);
    run("libraries", &env, libraries);
}

#[test]
fn a_mixed_set_of_majors_is_refused_with_a_clear_error() {
    let env = [
        (
            EXPECT_ENV,
            "error: no CUDA major's cuBLAS and cuBLASLt load: CUDA 13: libcublas.so.13 not \
             found; CUDA 12: libcublasLt.so.12 not found; the libraries found \
             (libcublasLt.so.13, libcublas.so.12) are of different CUDA majors: cuBLAS and \
             cuBLASLt must come from one CUDA release",
        ),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    run("libraries", &env, Libraries::Installed("mixed", MIXED));
}

#[test]
fn a_library_whose_version_disagrees_with_its_file_name_is_refused() {
    // The only libraries there are say CUDA 13 under CUDA 12's names.
    let env = [
        (
            EXPECT_ENV,
            "error: no CUDA major's cuBLAS and cuBLASLt load: CUDA 13: the driver supports CUDA \
             12.4, its libraries need 13.0 or newer; CUDA 12: libcublasLt.so.12 is cuBLASLt \
             13.0.0, not CUDA 12's, libcublas.so.12 is cuBLAS 13.0.0, not CUDA 12's",
        ),
        ("IRIS_STANDIN_CUBLAS_VERSION", "130000"),
    ];
    run("libraries", &env, Libraries::Full);
    // Misnamed CUDA 13 files beside a sound CUDA 12 set: CUDA 12 is loaded, and the
    // description says why CUDA 13 was not.
    let env = [
        (
            EXPECT_ENV,
            "CUDA 12 (cuBLAS 12.0.0, NVRTC 12.0); CUDA 13: libcublasLt.so.13 is cuBLASLt 12.0.0, \
             not CUDA 13's, libcublas.so.13 is cuBLAS 12.0.0, not CUDA 13's",
        ),
        ("IRIS_STANDIN_DRIVER", CUDA13_DRIVER),
    ];
    run(
        "libraries",
        &env,
        Libraries::Installed("misnamed13", MISNAMED_13),
    );
}

#[test]
fn a_write_from_page_locked_memory_returns_after_reading_it() {
    // With deferred work the stand-in copies from page-locked memory only when the queue runs,
    // as a GPU does.
    run(
        "pinned_write",
        &[("IRIS_STANDIN_DEFER", "1")],
        Libraries::Driver,
    );
}

#[test]
fn a_free_during_another_threads_synchronize_stays_accounted() {
    run(
        "free_during_synchronize",
        &[
            ("IRIS_STANDIN_DEFER", "1"),
            ("IRIS_STANDIN_SYNC_DELAY_MS", "400"),
            ("IRIS_STANDIN_MEMORY", &(64u64 << 20).to_string()),
        ],
        Libraries::Driver,
    );
}

#[test]
fn several_threads_share_one_device() {
    run(
        "threads",
        &[
            ("IRIS_STANDIN_DEFER", "1"),
            ("IRIS_STANDIN_MEMORY", &(64u64 << 20).to_string()),
        ],
        Libraries::Driver,
    );
}

#[test]
fn staging_buffers_are_pinned_and_round_trip() {
    run("staging", &[], Libraries::Driver);
}

/// `write_async` through the page-locked slots: a write of several slots, at an odd offset,
/// lands whole; with the driver's copies deferred (as a GPU runs them), the host functions and
/// the device copies still run in order, before the fence the host waits for.
#[test]
fn async_writes_go_through_page_locked_slots_in_queue_order() {
    run("write_async", &[], Libraries::Driver);
    run(
        "write_async",
        &[("IRIS_STANDIN_DEFER", "1")],
        Libraries::Driver,
    );
}

/// A free the driver refuses changes nothing: the buffer stays live and counted, and a later
/// free of it releases it (before, the handle was gone and its bytes left the report while
/// the driver still held them). With and without memory pools.
#[test]
fn a_free_the_driver_refuses_leaves_the_buffer_live() {
    let size = (3u64 << 20).to_string();
    run(
        "failed_free",
        &[("IRIS_STANDIN_FAIL_FREE_OF", &size)],
        Libraries::Driver,
    );
    run(
        "failed_free",
        &[
            ("IRIS_STANDIN_FAIL_FREE_OF", &size),
            ("IRIS_STANDIN_POOLS", "0"),
        ],
        Libraries::Driver,
    );
}

/// An open that fails after its memory pool was made (a memory query failing at any point
/// after it) destroys the pool.
#[test]
fn an_open_failing_after_its_pool_was_made_destroys_it() {
    for at in ["2", "3"] {
        run(
            "open_fails_after_pool",
            &[("IRIS_STANDIN_FAIL_MEM_INFO_AT", at)],
            Libraries::Driver,
        );
    }
}

/// A `write_async` whose device copy fails after the slot's host copy was enqueued answers
/// the error only once that host copy has read the source: the caller frees the source right
/// after the error (before, the host copy ran at the next synchronisation and read freed
/// memory: the process died with SIGSEGV).
#[test]
fn a_failed_async_write_is_done_reading_its_source_when_it_returns() {
    run(
        "failed_write_async",
        &[
            ("IRIS_STANDIN_DEFER", "1"),
            ("IRIS_STANDIN_FAIL_COPY", "719"),
        ],
        Libraries::Driver,
    );
}

#[test]
fn no_configuration_makes_the_host_abort() {
    let configurations: &[(&str, &[(&str, &str)], Libraries)] = &[
        ("no driver", &[], Libraries::None),
        ("stub", &[("IRIS_STANDIN_MODE", "stub")], Libraries::Driver),
        (
            "no device",
            &[("IRIS_STANDIN_MODE", "no_device")],
            Libraries::Driver,
        ),
        ("hidden", &[("CUDA_VISIBLE_DEVICES", "")], Libraries::Driver),
        (
            "old driver",
            &[("IRIS_STANDIN_DRIVER", "9020")],
            Libraries::Driver,
        ),
        ("healthy", &[], Libraries::Driver),
        (
            "first allocation fails",
            &[("IRIS_STANDIN_OOM_AT", "1")],
            Libraries::Driver,
        ),
        (
            "no pools",
            &[("IRIS_STANDIN_POOLS", "0")],
            Libraries::Driver,
        ),
        (
            "copies fail",
            &[("IRIS_STANDIN_FAIL_COPY", "700")],
            Libraries::Driver,
        ),
        (
            "two devices",
            &[("IRIS_STANDIN_DEVICES", "2")],
            Libraries::Driver,
        ),
    ];
    for (name, env, libraries) in configurations {
        if *libraries == Libraries::None && system_driver().is_some() {
            continue;
        }
        let output = child("survive", env, *libraries);
        assert!(
            output.status.code() == Some(0),
            "configuration `{name}` ended with {:?}\n{}",
            output.status,
            text(&output)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The child side
// ---------------------------------------------------------------------------------------------

/// One scenario, run in a child process by the tests above (never on its own).
#[test]
#[ignore = "a child-process scenario, run by the other tests of this file"]
fn scenario() {
    let name = std::env::var(common::SCENARIO_ENV)
        .expect("run by the parent tests of tests/standin.rs, which set IRIS_STANDIN_SCENARIO");
    let plugin = load_library(&plugin_library()).expect("the cuda plugin loads");
    assert_eq!(plugin.name(), "cuda");
    match name.as_str() {
        "no_driver" => no_driver(&plugin),
        "stub" => refused(&plugin, "CUDA_ERROR_STUB_LIBRARY"),
        "no_device" => refused(&plugin, "CUDA_ERROR_NO_DEVICE"),
        "hidden" => refused(&plugin, "CUDA_VISIBLE_DEVICES is set and empty"),
        "old_driver" => refused(
            &plugin,
            "the driver supports CUDA 11.8, this plugin needs 12.0",
        ),
        "libraries" => libraries(&plugin),
        "attention_engine" => attention_engine(&plugin),
        "not_ready" => not_ready(&plugin),
        "pinned_write" => pinned_write(&plugin),
        "free_during_synchronize" => free_during_synchronize(&plugin),
        "threads" => threads(&plugin),
        "attribute_fails" => attribute_fails(&plugin),
        "memory" => memory(&plugin),
        "oom" => oom(&plugin),
        "copy_failure" => copy_failure(&plugin),
        "no_blas" => no_blas(&plugin),
        "staging" => staging(&plugin),
        "write_async" => write_async(&plugin),
        "write_async_reuse" => write_async_reuse(&plugin),
        "failed_write_async" => failed_write_async(&plugin),
        "failed_free" => failed_free(&plugin),
        "fault" => fault(&plugin),
        "open_fails_after_pool" => {
            let err = plugin.open(0, &memory_only()).unwrap_err();
            assert!(err.message.contains("cuMemGetInfo"), "{err}");
            assert_eq!(
                common::standin_live_pools(),
                0,
                "the failed open destroyed its memory pool"
            );
        }
        "survive" => survive(&plugin),
        other => panic!("unknown scenario {other}"),
    }
}

fn no_driver(plugin: &Plugin) {
    let probe = plugin.probe();
    assert_eq!(probe.device_count, 0);
    assert!(
        probe.reason.contains("libcuda.so.1 not found"),
        "{}",
        probe.reason
    );
    assert!(probe.reason.contains("libcuda.so.1"), "{}", probe.reason);
    let err = plugin.open(0, &[]).unwrap_err();
    assert_eq!(err.code, ErrorCode::UNAVAILABLE, "{err}");
    assert!(err.message.contains("libcuda.so.1 not found"), "{err}");
}

fn refused(plugin: &Plugin, reason: &str) {
    let probe = plugin.probe();
    assert_eq!(probe.device_count, 0);
    assert!(probe.reason.contains(reason), "{}", probe.reason);
    let err = plugin.open(0, &memory_only()).unwrap_err();
    assert!(
        err.code == ErrorCode::UNAVAILABLE || err.code == ErrorCode::UNSUPPORTED,
        "{err}"
    );
}

fn memory(plugin: &Plugin) {
    let probe = plugin.probe();
    assert_eq!((probe.device_count, probe.reason.as_str()), (1, ""));
    let device = plugin.open(0, &memory_only()).expect("opens memory-only");
    let desc = device.description();
    assert_eq!(desc.name, "iris stand-in device");
    assert_eq!(desc.vendor, "NVIDIA");
    assert_eq!(desc.total_memory, 64 << 20);
    assert!(
        desc.ops.is_empty(),
        "memory-only lists no ops: {:?}",
        desc.ops
    );
    assert!(desc.dtypes.contains(&DType::BF16) && desc.dtypes.contains(&DType::I32));
    assert_eq!(desc.property(property::COMPUTE_CAPABILITY), Some("8.0"));
    let driver = iris_device_cuda::device::version_text(common::standin_driver_version());
    assert_eq!(
        desc.property(property::DRIVER_VERSION),
        Some(driver.as_str())
    );
    assert_eq!(desc.property(property::COMPUTE_UNITS), Some("4"));
    assert_eq!(desc.property(property::QUEUE), Some("async"));
    // 1 GHz memory clock, DDR, 256-bit bus.
    assert_eq!(
        desc.property_u64(property::MEMORY_BANDWIDTH),
        Some(64_000_000_000)
    );
    // Compute capability 8.0 (A100's rates): 4 SMs at 1.5 GHz, 2048 dense tensor-core FLOP per
    // clock and SM in f16 and bf16, 128 FMA FLOP in f32.
    let peak = desc.property(property::PEAK_FLOPS).expect("peak_flops");
    for (dtype, flops) in [("f32", 7.68e11), ("f16", 1.2288e13), ("bf16", 1.2288e13)] {
        assert_eq!(
            property::peak_flops(peak, dtype),
            Some(flops),
            "{dtype} in {peak}"
        );
    }

    let start = device.mem_info().unwrap();
    assert_eq!(start.total, 64 << 20);
    let a = device.alloc(1 << 20).unwrap();
    let b = device.alloc(4096).unwrap();
    assert_eq!(
        device.mem_info().unwrap().free,
        start.free - (1 << 20) - 4096
    );
    let report = device.memory_report().unwrap();
    assert_eq!((report.allocated, report.buffers), ((1 << 20) + 4096, 2));

    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    device.write(a, 100, &data).unwrap();
    let mut back = vec![0u8; 4096];
    device.read(a, 100, &mut back).unwrap();
    assert_eq!(back, data);

    // Fills of every width, and a batched copy across buffers.
    let fill = |offset, bytes, value, width| FillArgs {
        dst: BufferSlice {
            buf: b,
            offset,
            bytes,
        },
        value,
        width,
    };
    device.fill(&fill(0, 16, 0xab, 1)).unwrap();
    device.fill(&fill(16, 16, 0x3f80, 2)).unwrap();
    device.fill(&fill(32, 16, 0x3f80_0000, 4)).unwrap();
    let regions = [
        CopyRegion {
            src: a,
            src_offset: 100,
            dst: b,
            dst_offset: 64,
            bytes: 8,
        },
        CopyRegion {
            src: b,
            src_offset: 0,
            dst: a,
            dst_offset: 0,
            bytes: 4,
        },
    ];
    device.copy_batch(&regions).unwrap();
    let mut head = [0u8; 72];
    device.read(b, 0, &mut head).unwrap();
    assert_eq!(&head[..16], &[0xab; 16]);
    assert_eq!(&head[16..18], &[0x80, 0x3f]);
    assert_eq!(&head[32..36], &1.0f32.to_le_bytes());
    assert_eq!(&head[64..72], &data[..8]);
    let mut first = [0u8; 4];
    device.read(a, 0, &mut first).unwrap();
    assert_eq!(first, [0xab; 4]);

    // Bad arguments are invalid, named, and enqueue nothing.
    let err = device.read(a, (1 << 20) - 2, &mut [0u8; 4]).unwrap_err();
    assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT);
    assert!(err.message.contains("outside the buffer"), "{err}");
    let err = device.fill(&fill(1, 4, 0, 2)).unwrap_err();
    assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT);
    assert_eq!(
        device.alloc(0).unwrap_err().code,
        ErrorCode::INVALID_ARGUMENT
    );

    // Ops need cuBLAS and the kernels: unsupported, with the reason.
    let x = MatRef::contiguous(a, 0, DType::F32, 4, 4);
    let err = device
        .activation(&ActivationArgs {
            x,
            out: x,
            activation: Activation::SILU,
            workspace: BufferSlice::EMPTY,
        })
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::UNSUPPORTED);
    assert!(err.message.contains("memory_only"), "{err}");

    // Free is queue-ordered: the buffers count until the queue has run the frees.
    device.free(a).unwrap();
    device.free(b).unwrap();
    assert_eq!(
        device.free(b).unwrap_err().code,
        ErrorCode::INVALID_ARGUMENT
    );
    device.synchronize().unwrap();
    let report = device.memory_report().unwrap();
    assert_eq!((report.allocated, report.buffers), (0, 0));
    assert_eq!(device.mem_info().unwrap().free, start.free);
}

fn oom(plugin: &Plugin) {
    let device = plugin.open(0, &memory_only()).unwrap();
    let first = device.alloc(1024).unwrap();
    let err = device.alloc(2048).unwrap_err();
    assert_eq!(err.code, ErrorCode::OUT_OF_MEMORY, "{err}");
    assert!(err.message.contains("2048 bytes requested"), "{err}");
    assert!(err.message.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    // Larger than the device: out of memory too, and the device goes on.
    let err = device.alloc(1 << 30).unwrap_err();
    assert_eq!(err.code, ErrorCode::OUT_OF_MEMORY, "{err}");
    let second = device.alloc(2048).unwrap();
    device.free(first).unwrap();
    device.free(second).unwrap();
    device.synchronize().unwrap();
    assert_eq!(device.memory_report().unwrap().allocated, 0);
}

fn copy_failure(plugin: &Plugin) {
    let device = plugin.open(0, &memory_only()).unwrap();
    let buf = device.alloc(64).unwrap();
    let err = device.write(buf, 0, &[1, 2, 3, 4]).unwrap_err();
    assert_eq!(err.code, ErrorCode::UNAVAILABLE, "{err}");
    assert!(
        err.message
            .contains("cuMemcpyHtoDAsync failed: CUDA_ERROR_LAUNCH_FAILED"),
        "{err}"
    );
    let err = device.read(buf, 0, &mut [0u8; 4]).unwrap_err();
    assert!(err.message.contains("CUDA_ERROR_LAUNCH_FAILED"), "{err}");
    device.free(buf).unwrap();
}

fn pinned_write(plugin: &Plugin) {
    let device = std::sync::Arc::new(plugin.open(0, &memory_only()).unwrap());
    let buf = device.alloc(256).unwrap();
    let mut host = device.host_buffer(256).unwrap();
    let written: Vec<u8> = (0..=255).collect();
    host.as_mut_slice().unwrap().copy_from_slice(&written);
    device.write(buf, 0, host.as_slice().unwrap()).unwrap();
    // The ABI lets the caller reuse the slice as soon as `write` returns.
    host.as_mut_slice().unwrap().fill(0xEE);
    let mut back = vec![0u8; 256];
    device.read(buf, 0, &mut back).unwrap();
    assert_eq!(
        back, written,
        "the device holds what the slice held during write"
    );
    // From pageable memory as well.
    device.write(buf, 0, &[7u8; 256]).unwrap();
    device.read(buf, 0, &mut back).unwrap();
    assert_eq!(back, [7u8; 256]);
    device.free(buf).unwrap();
}

fn free_during_synchronize(plugin: &Plugin) {
    use std::sync::Arc;
    use std::time::Duration;
    let device = Arc::new(plugin.open(0, &memory_only()).unwrap());
    let big = 40u64 << 20;
    let first = device.alloc(big).unwrap();
    // The stand-in's synchronize runs the queue, then takes 400 ms to return: the free below
    // lands after the wait and before the synchronize's bookkeeping.
    let syncer = {
        let device = Arc::clone(&device);
        std::thread::spawn(move || device.synchronize().unwrap())
    };
    std::thread::sleep(Duration::from_millis(150));
    device.free(first).unwrap();
    syncer.join().unwrap();
    // The free is still queued (the stand-in holds its memory): it counts as allocated ...
    let report = device.memory_report().unwrap();
    assert!(
        report.allocated >= big,
        "a queued free dropped out of the accounting: {report:?}"
    );
    // ... and an allocation that needs its memory waits for it instead of giving up.
    let second = device
        .alloc(big)
        .expect("the out-of-memory retry waits for the queued free");
    device.free(second).unwrap();
    device.synchronize().unwrap();
    assert_eq!(device.memory_report().unwrap().allocated, 0);
}

fn threads(plugin: &Plugin) {
    use std::sync::Arc;
    const THREADS: usize = 4;
    const ROUNDS: usize = 40;
    let device = Arc::new(plugin.open(0, &memory_only()).unwrap());
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let device = Arc::clone(&device);
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let bytes = 4096 * (1 + (t + round) % 7);
                    let buf = device.alloc(bytes as u64).unwrap();
                    let pattern: Vec<u8> = (0..bytes).map(|i| (i * 31 + t + round) as u8).collect();
                    device.write(buf, 0, &pattern).unwrap();
                    let mut back = vec![0u8; bytes];
                    device.read(buf, 0, &mut back).unwrap();
                    assert!(
                        back == pattern,
                        "thread {t} round {round}: wrong bytes back"
                    );
                    device.free(buf).unwrap();
                    if round % 5 == 0 {
                        device.synchronize().unwrap();
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("a worker thread failed");
    }
    device.synchronize().unwrap();
    let report = device.memory_report().unwrap();
    assert_eq!((report.allocated, report.buffers), (0, 0), "{report:?}");
}

fn not_ready(plugin: &Plugin) {
    let probe = plugin.probe();
    assert_eq!(probe.device_count, 0);
    for part in ["CUDA_ERROR_SYSTEM_NOT_READY", "fabric manager"] {
        assert!(probe.reason.contains(part), "{}", probe.reason);
    }
    let err = plugin.open(0, &memory_only()).unwrap_err();
    assert_eq!(err.code, ErrorCode::UNAVAILABLE, "{err}");
    assert!(err.message.contains("fabric manager"), "{err}");
}

fn attribute_fails(plugin: &Plugin) {
    let device = plugin
        .open(0, &memory_only())
        .expect("opens without the attribute");
    let desc = device.description();
    let failed = std::env::var("IRIS_STANDIN_FAIL_ATTRIBUTE").unwrap();
    let absent: &[&str] = match failed.as_str() {
        // Without the SM count there is no peak either.
        "16" => &[property::COMPUTE_UNITS, property::PEAK_FLOPS],
        "13" => &[property::PEAK_FLOPS],
        _ => &[property::MEMORY_BANDWIDTH],
    };
    for absent in absent {
        assert_eq!(desc.property(absent), None, "{absent} is left out");
    }
    assert_eq!(desc.property(property::COMPUTE_CAPABILITY), Some("8.0"));
}

fn no_blas(plugin: &Plugin) {
    // cuBLAS cannot run on any stand-in: either it is not installed (CI) or it fails to start.
    let err = plugin.open(0, &[]).unwrap_err();
    assert_eq!(
        common::standin_live_pools(),
        0,
        "the failed open destroyed its memory pool"
    );
    assert!(
        err.message.contains("cublasLt") || err.message.contains("cublas"),
        "the error names the library: {err}"
    );
    assert!(
        err.code == ErrorCode::UNAVAILABLE || err.code == ErrorCode::INTERNAL,
        "{err}"
    );
}

/// Opens the device with all ops and compares its `cuda_libraries` property with
/// [`EXPECT_ENV`] (a `prefix:` compares the start only), or, for `error: part|part`, expects
/// `open` to fail as unavailable with every part in its message. [`KERNELS_ENV`] is the start
/// of the `kernels` property; with [`CACHED_ENV`] the kernels come from the cache.
fn libraries(plugin: &Plugin) {
    let expected = std::env::var(EXPECT_ENV).unwrap();
    assert_eq!(plugin.probe().device_count, 1);
    let cc = std::env::var("IRIS_STANDIN_CC").map_or(80, |cc| cc.parse().unwrap());
    let driver = std::env::var("IRIS_STANDIN_DRIVER")
        .map_or(common::standin_driver_version(), |v| v.parse().unwrap());
    let options = if std::env::var_os(CACHED_ENV).is_some() {
        common::emulated_kernels(cc, driver)
    } else {
        Vec::new()
    };
    if let Some(parts) = expected.strip_prefix("error: ") {
        let err = plugin.open(0, &options).unwrap_err();
        assert_eq!(err.code, ErrorCode::UNAVAILABLE, "{err}");
        for part in parts.split('|') {
            assert!(err.message.contains(part), "`{part}` in:\n{err}");
        }
        assert_eq!(
            common::standin_live_pools(),
            0,
            "the failed open destroyed its memory pool"
        );
        // Memory-only needs none of the libraries.
        plugin.open(0, &memory_only()).expect("memory-only opens");
        return;
    }
    let device = plugin.open(0, &options).expect("opens with ops");
    let desc = device.description();
    assert_eq!(desc.ops.len(), 9, "every op is listed");
    let loaded = desc.property("cuda_libraries").unwrap_or_default();
    match expected.strip_prefix("prefix: ") {
        Some(prefix) => assert!(loaded.starts_with(prefix), "{loaded}"),
        None => assert_eq!(loaded, expected),
    }
    if let Ok(kernels) = std::env::var(KERNELS_ENV) {
        let origin = desc.property("kernels").unwrap_or_default();
        assert!(origin.starts_with(&kernels), "{origin}");
    }
    // The driver bindings are 12.4 whichever major's libraries were loaded.
    assert_eq!(desc.property("cuda_api_version"), Some("12.4"));
    // The warm-up at open ran every GEMM path through the tables of the major loaded. A later
    // open in the same process uses the same libraries.
    let loaded = loaded.to_owned();
    drop(device);
    let again = plugin.open(0, &options).expect("opens again");
    assert_eq!(
        again.description().property("cuda_libraries"),
        Some(loaded.as_str())
    );
}

/// Opens the Hopper stand-in with `attention_engine` = [`ENGINE_ENV`] and compares its
/// `attention_engine` property with [`EXPECT_ENV`]: a prefix, or `prefix|part` (the property
/// starts with the prefix and contains the part), or `error: prefix|part` for a failed open.
fn attention_engine(plugin: &Plugin) {
    let option = std::env::var(ENGINE_ENV).unwrap();
    let expected = std::env::var(EXPECT_ENV).unwrap();
    let options = [("attention_engine".to_owned(), option)];
    let (failure, expected) = match expected.strip_prefix("error: ") {
        Some(rest) => (true, rest),
        None => (false, expected.as_str()),
    };
    let (prefix, part) = expected.split_once('|').unwrap_or((expected, ""));
    let text = match plugin.open(0, &options) {
        Ok(device) => {
            assert!(!failure, "the open was expected to fail with `{expected}`");
            let note = device
                .description()
                .property("attention_engine")
                .unwrap_or_default()
                .to_owned();
            drop(device);
            note
        }
        Err(err) => {
            assert!(failure, "the open failed: {err}");
            assert_eq!(
                common::standin_live_pools(),
                0,
                "the failed open destroyed its pool"
            );
            err.message.trim_start_matches("open: ").to_owned()
        }
    };
    assert!(
        text.starts_with(prefix) && text.contains(part),
        "`{prefix}` ... `{part}` in:\n{text}"
    );
}

fn staging(plugin: &Plugin) {
    let device = std::sync::Arc::new(plugin.open(0, &memory_only()).unwrap());
    assert!(device.has_staging());
    let mut host = device.host_buffer(256).unwrap();
    assert!(host.is_pinned());
    for (i, byte) in host.as_mut_slice().unwrap().iter_mut().enumerate() {
        *byte = i as u8;
    }
    let buf = device.alloc(256).unwrap();
    device.upload(buf, 0, &mut host, 0, 256).unwrap();
    let mut back = device.host_buffer(128).unwrap();
    device.download(buf, 64, &mut back, 0, 128).unwrap();
    let expected: Vec<u8> = (64..192).map(|i| i as u8).collect();
    assert_eq!(back.as_slice().unwrap(), expected.as_slice());
    device.free(buf).unwrap();
    drop(host);
    drop(back);
    device.synchronize().unwrap();
}

fn failed_free(plugin: &Plugin) {
    let device = plugin.open(0, &memory_only()).unwrap();
    device.synchronize().unwrap();
    let before = device.mem_info().unwrap().free;
    // 3 MiB: the size the stand-in refuses to free once.
    let buf = device.alloc(3 << 20).unwrap();
    device.write(buf, 0, &[5u8; 16]).unwrap();
    let err = device.free(buf).expect_err("the driver refuses the free");
    assert!(err.message.contains("CUDA_ERROR_INVALID_VALUE"), "{err}");
    let report = device.memory_report().unwrap();
    assert_eq!(
        (report.allocated, report.buffers),
        (3 << 20, 1),
        "still live and counted"
    );
    let mut back = [0u8; 16];
    device.read(buf, 0, &mut back).expect("still usable");
    assert_eq!(back, [5u8; 16]);
    device.free(buf).expect("freed the second time");
    device.synchronize().unwrap();
    let report = device.memory_report().unwrap();
    assert_eq!((report.allocated, report.buffers), (0, 0));
    assert_eq!(
        device.mem_info().unwrap().free,
        before,
        "the driver freed it"
    );
}

fn fault(plugin: &Plugin) {
    use iris_plugin::abi::CastArgs;
    let options = common::emulated_kernels(80, common::standin_driver_version());
    // A device with two buffers and a cast between them (f32 0x3f3f3f3f to bf16 0x3f3f).
    let open = || {
        let device = plugin
            .open(0, &options)
            .expect("opens with the emulated kernels");
        let src = device.alloc(4 * 64).unwrap();
        let out = device.alloc(2 * 64).unwrap();
        device.write(src, 0, &[0x3f; 4 * 64]).unwrap();
        let cast = CastArgs {
            src: MatRef::contiguous(src, 0, DType::F32, 4, 16),
            out: MatRef::contiguous(out, 0, DType::BF16, 4, 16),
            workspace: BufferSlice::EMPTY,
        };
        (device, src, out, cast)
    };
    let (device, src, out, cast) = open();
    device.cast(&cast).unwrap();
    device.synchronize().unwrap();

    common::standin_fault_launch(1);
    device
        .cast(&cast)
        .expect("a launch that faults is accepted, as on a GPU");
    let sticky = |what: &str, err: iris_plugin::DeviceError| {
        assert_eq!(err.code, ErrorCode::UNAVAILABLE, "{what}: {err}");
        assert!(
            err.message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{what}: {err}"
        );
    };
    sticky("synchronize", device.synchronize().unwrap_err());
    sticky("a later op", device.cast(&cast).unwrap_err());
    sticky("read", device.read(out, 0, &mut [0u8; 8]).unwrap_err());
    sticky("write", device.write(src, 0, &[0u8; 8]).unwrap_err());
    sticky("mem_info", device.mem_info().unwrap_err());
    sticky("alloc", device.alloc(64).unwrap_err());
    sticky("free", device.free(src).unwrap_err());
    let report = device
        .memory_report()
        .expect("the plugin's own books still answer");
    assert!(
        report.buffers >= 2,
        "buffers the driver would not free stay counted: {report:?}"
    );
    drop(device);
    assert_eq!(
        common::standin_calls_after_teardown(),
        0,
        "no driver call after the context's last release"
    );
    assert_eq!(
        common::standin_used_memory(),
        0,
        "the context's destruction gave the device's memory back"
    );
    assert!(
        common::standin_teardown_bytes() >= 6 * 64,
        "it freed the buffers the plugin could not: {} bytes",
        common::standin_teardown_bytes()
    );

    // A new open makes a fresh context that computes again.
    let (device, src, out, cast) = open();
    device.cast(&cast).unwrap();
    let mut back = [0u8; 8];
    device.read(out, 0, &mut back).unwrap();
    assert_eq!(back, [0x3f; 8]);
    device.free(src).unwrap();
    device.free(out).unwrap();
}

fn failed_write_async(plugin: &Plugin) {
    let device = std::sync::Arc::new(plugin.open(0, &memory_only()).unwrap());
    let buf = device.alloc(64 << 20).unwrap();
    // Large enough for the allocator to give it its own mapping, unmapped when it is freed.
    let source = vec![7u8; 64 << 20];
    let (written, _) = device.with_async_writes(|writes| writes.write(buf, 0, &source));
    let err = written.expect_err("the queue's copy fails");
    assert!(
        err.message
            .contains("cuMemcpyHtoDAsync failed: CUDA_ERROR_LAUNCH_FAILED"),
        "{err}"
    );
    drop(source);
    // The driver runs whatever is still queued here.
    let _ = device.synchronize();
    device.free(buf).unwrap();
}

fn write_async(plugin: &Plugin) {
    let device = std::sync::Arc::new(plugin.open(0, &memory_only()).unwrap());
    assert!(device.has_async_write());
    // More than three 32 MiB slots, so the slots are reused within one write.
    const BYTES: usize = (100 << 20) + 12345;
    let source: Vec<u8> = (0..BYTES).map(|i| (i * 7 % 251) as u8).collect();
    let second: Vec<u8> = (0..4096).map(|i| (i % 13) as u8).collect();
    let buf = device.alloc(BYTES as u64 + 3).unwrap();
    let ((), waited) = device.with_async_writes(|writes| {
        assert!(
            writes.write(buf, 3, &source).unwrap(),
            "the plugin takes the write"
        );
        // A second write into the start of the same range: it lands after the first.
        assert!(writes.write(buf, 3, &second).unwrap());
    });
    waited.unwrap();
    let mut back = vec![0u8; BYTES];
    device.read(buf, 3, &mut back).unwrap();
    assert!(back[..4096] == second[..], "the later write lands last");
    assert!(
        back[4096..] == source[4096..],
        "every slot's piece lands in place"
    );
    // A range past the buffer is refused before anything is enqueued.
    let (written, _) = device.with_async_writes(|writes| writes.write(buf, 4, &source));
    let err = written.unwrap_err();
    assert!(err.message.contains("write_async"), "{err}");
    device.free(buf).unwrap();
    device.synchronize().unwrap();

    // `staged_writes = true` turns them down: the host stages instead.
    let mut options = memory_only();
    options.push(("staged_writes".to_owned(), "true".to_owned()));
    let staged = std::sync::Arc::new(plugin.open(0, &options).unwrap());
    let buf = staged.alloc(16).unwrap();
    let (written, _) = staged.with_async_writes(|writes| writes.write(buf, 0, &second[..16]));
    assert!(!written.unwrap(), "refused as unsupported");
    assert!(!staged.has_async_write());
    staged.free(buf).unwrap();
}

fn survive(plugin: &Plugin) {
    let probe = plugin.probe();
    if probe.device_count == 0 {
        assert!(!probe.reason.is_empty());
    }
    for options in [memory_only(), Vec::new()] {
        let Ok(device) = plugin.open(0, &options) else {
            continue;
        };
        let _ = device.description();
        let _ = device.mem_info();
        if let Ok(buf) = device.alloc(4096) {
            let _ = device.write(buf, 0, &[0u8; 64]);
            let _ = device.read(buf, 0, &mut [0u8; 64]);
            let _ = device.free(buf);
        }
        let _ = device.synchronize();
        let _ = device.memory_report();
    }
    let _ = plugin.open(1, &memory_only());
    let _ = plugin.open(7, &[]);
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// What the `libraries` scenario expects (see there).
const EXPECT_ENV: &str = "IRIS_TEST_EXPECT_LIBRARIES";
/// The start of the `kernels` property the `libraries` scenario expects.
const KERNELS_ENV: &str = "IRIS_TEST_EXPECT_KERNELS";
/// The `attention_engine` option of the `attention_engine` scenario.
const ENGINE_ENV: &str = "IRIS_TEST_ATTENTION_ENGINE";
/// Set: the `libraries` scenario opens with cached kernels.
const CACHED_ENV: &str = "IRIS_TEST_CACHED_KERNELS";

fn memory_only() -> Vec<(String, String)> {
    vec![("memory_only".to_owned(), "true".to_owned())]
}

// ---------------------------------------------------------------------------------------------
// Slots reused across back-to-back asynchronous writes
// ---------------------------------------------------------------------------------------------

/// Back-to-back `write_async`s of distinct contents, each larger than a page-locked slot and
/// more pieces in all than there are slots, so that slots are refilled across writes. With the
/// stand-in's streams deferred (as a GPU runs them), a slot is refilled only after the queue
/// has copied its last contents out (the copy stream's wait for the slot's `free` event), and
/// the queue copies a slot only after its host function filled it (the queue's wait for
/// `filled`): without either wait, some range of the buffer holds another piece's bytes.
#[test]
fn back_to_back_async_writes_refill_the_slots_in_order() {
    run("write_async_reuse", &[], Libraries::Driver);
    run(
        "write_async_reuse",
        &[("IRIS_STANDIN_DEFER", "1")],
        Libraries::Driver,
    );
}

fn write_async_reuse(plugin: &Plugin) {
    // 32 MiB slots, four of them (device-cuda/src/memory.rs): three writes of two pieces each
    // refill the first two slots.
    const SLOT: usize = 32 << 20;
    const WRITES: usize = 3;
    let device = std::sync::Arc::new(plugin.open(0, &memory_only()).unwrap());
    assert!(device.has_async_write());
    let sources: Vec<Vec<u8>> = (0..WRITES)
        .map(|w| {
            let bytes = SLOT + (8 << 20) + 1000 * w + 1;
            // Distinct per write and per slot-sized piece, so a piece copied from the wrong
            // slot contents shows.
            (0..bytes)
                .map(|i| ((i * 13 + w * 101 + i / SLOT * 53) % 251) as u8)
                .collect()
        })
        .collect();
    // Each write at its own odd offset of one buffer.
    let mut offsets = Vec::with_capacity(WRITES);
    let mut end = 5u64;
    for source in &sources {
        offsets.push(end);
        end += source.len() as u64 + 3;
    }
    let buf = device.alloc(end).unwrap();
    let ((), waited) = device.with_async_writes(|writes| {
        for (source, &offset) in sources.iter().zip(&offsets) {
            assert!(
                writes.write(buf, offset, source).unwrap(),
                "the plugin takes the write"
            );
        }
    });
    waited.unwrap();
    for (w, (source, &offset)) in sources.iter().zip(&offsets).enumerate() {
        let mut back = vec![0u8; source.len()];
        device.read(buf, offset, &mut back).unwrap();
        let wrong = back.iter().zip(source).position(|(got, want)| got != want);
        assert!(
            wrong.is_none(),
            "write {w}: byte {} of {} is not the source's (a slot's piece landed out of order)",
            wrong.unwrap_or(0),
            source.len()
        );
    }
    device.free(buf).unwrap();
    device.synchronize().unwrap();
}
