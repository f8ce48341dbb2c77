//! Every op of the plugin, through the real ABI, against an f64 host reference, on a stand-in
//! device: the stand-in driver runs the plugin's own kernels on the CPU (one fiber per CUDA
//! thread, `tests/standin/emu.cpp`) and stand-in cuBLAS and cuBLASLt compute GEMMs on the
//! host with the libraries' column-major conventions (`tests/standin/cublas.c`).
//!
//! This checks what can go wrong without a GPU: argument validation, launch arguments and
//! grids, row-major to column-major mapping, the choice of fused and unfused GEMM epilogues,
//! and the kernels' indexing, tiling, synchronisation and numerics. It cannot check speed, or
//! that cuBLAS(Lt) itself behaves as its stand-in does; `tools/gpu-check.sh` covers those.

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

use std::ffi::{CString, c_char, c_void};
use std::ops::Not;
use std::time::{Duration, Instant};

use common::{Libraries, plugin_library, run};
use half::{bf16, f16};
use iris_plugin::abi::{
    Activation, ActivationArgs, AttentionArgs, BinaryArgs, BinaryOp, BufferHandle, BufferSlice,
    CastArgs, CopyRegion, DType, GatherArgs, GemmArgs, MatRef, NormArgs, RotaryArgs,
};
use iris_plugin::{Device, ErrorCode, load_library};

#[test]
fn gemm_matches_the_reference_on_every_path() {
    run("gemm", &[], Libraries::Full);
}

#[test]
fn gemm_falls_back_to_cublas_when_cublaslt_has_no_algorithm() {
    run("gemm", &[("IRIS_STANDIN_LT_NO_ALGO", "1")], Libraries::Full);
}

#[test]
fn norms_activations_and_binary_ops_match_the_reference() {
    run("elementwise", &[], Libraries::Full);
}

#[test]
fn rotary_gather_cast_and_batched_copies_match_the_reference() {
    run("movement", &[], Libraries::Full);
}

#[test]
fn gathers_report_bad_indices_when_the_driver_runs_copies_later() {
    // The stand-in's deferred mode: copies into page-locked memory run at the next wait, as on
    // a GPU, so a status read before the wait would miss the flag.
    run("movement", &[("IRIS_STANDIN_DEFER", "1")], Libraries::Full);
}

#[test]
fn synchronize_reads_the_gather_status_without_blocking_copies() {
    run("status", &[("IRIS_STANDIN_DEFER", "1")], Libraries::Full);
}

/// Library calls follow their stream's earlier work, with the stand-in driver's copies deferred
/// as a GPU runs them: a product on cuBLAS (f32) and on cuBLASLt (bf16, f16), and cuDNN's
/// attention, each enqueued right behind a `write_async` of its input with no kernel launch
/// between, compute from the values written, not from what the buffer held before.
#[test]
fn library_calls_read_what_their_stream_wrote_before_them() {
    run(
        "library_order",
        &[("IRIS_STANDIN_DEFER", "1")],
        Libraries::Full,
    );
}

#[test]
fn attention_matches_the_reference_for_every_head_dim() {
    run("attention", &[], Libraries::Full);
}

#[test]
fn a_128_query_attention_kernel_that_differs_at_open_does_not_serve() {
    run(
        "wrong_q128",
        &[("IRIS_STANDIN_WRONG_KERNEL", "flash_attention_q128_bf16_80")],
        Libraries::Full,
    );
}

#[test]
fn an_elementwise_kernel_whose_four_wide_path_differs_at_open_runs_one_wide() {
    run(
        "wrong_wide",
        &[("IRIS_STANDIN_WRONG_WIDE", "activation_bf16:2")],
        Libraries::Full,
    );
}

/// cuDNN's fused attention (the stand-in `libcudnn.so.9`, computing in f64) under
/// `attention_engine = cudnn` on the emulated Ampere device: it passes its check at open at
/// every head dim and type; after open, a call whose plans are not built yet runs the plugin's
/// kernel without waiting for them (nor for the handle the builder thread holds), and once they
/// are, each run of equal-length segments is one cuDNN call, right; unaligned views stay on the
/// plugin's kernel; the device memory its plans add after open is reported; and no descriptor
/// or handle is left behind when the device closes (the stand-in aborts on a handle used by two
/// threads at once).
#[test]
fn attention_runs_on_cudnn_where_it_passed_its_check() {
    run(
        "cudnn",
        &[("IRIS_STANDIN_CUDNN_PLAN_BYTES", "65536")],
        Libraries::Full,
    );
}

/// Plans built after open stop at the option `cudnn_plan_memory` (1 MiB here; the stand-in's
/// plans take half a MiB each at their first execution): a third shape runs the plugin's
/// kernel, right, and is never built, while the two plans made before keep serving. `trim` (a
/// reset) then gives their memory back, exactly, so that the device's memory is where it was
/// before them and the report names none; the third shape is built at its next calls.
#[test]
fn cudnn_plans_stop_at_the_plan_memory_option_and_trim_gives_them_back() {
    run(
        "cudnn_plan_memory",
        &[("IRIS_STANDIN_CUDNN_PLAN_BYTES", "524288")],
        Libraries::Full,
    );
}

/// As above with a cuDNN that keeps what its plans loaded until its handle goes (the stand-in's
/// `IRIS_STANDIN_CUDNN_PLAN_MEMORY_KEPT`): `trim` drops the plans but reports nothing given
/// back, the report still names the memory, and the option still holds new shapes off.
#[test]
fn trim_reports_what_a_cudnn_keeping_its_kernels_did_not_give_back() {
    run(
        "cudnn_plan_memory",
        &[
            ("IRIS_STANDIN_CUDNN_PLAN_BYTES", "524288"),
            ("IRIS_STANDIN_CUDNN_PLAN_MEMORY_KEPT", "1"),
        ],
        Libraries::Full,
    );
}

/// A plan built after open whose first execution cannot get the device memory it loads (the
/// stand-in's half a MiB, with the device filled but for 400 KiB): the call still succeeds,
/// right, on the plugin's kernel; later calls of that shape run the kernel without trying the
/// plan again, with memory free again too; the failed plan adds nothing to the device's memory
/// or the report; other shapes keep taking cuDNN; and a trim lets the shape's plan be built
/// again (the failure may have been for lack of memory), after which it serves.
#[test]
fn a_cudnn_plan_whose_first_execution_fails_leaves_its_shape_to_the_kernel() {
    run(
        "cudnn_failed_execution",
        &[("IRIS_STANDIN_CUDNN_PLAN_BYTES", "524288")],
        Libraries::Full,
    );
}

/// cuDNN's attention made wrong (the stand-in adds 0.5 to an output): the check at open keeps
/// it from serving, `iris devices` says why, and attention is right on the plugin's kernel.
#[test]
fn cudnn_attention_that_differs_at_open_does_not_serve() {
    run(
        "wrong_cudnn",
        &[("IRIS_STANDIN_CUDNN_WRONG", "1")],
        Libraries::Full,
    );
}

/// The emulator's own model of `mma.m16n8k16` and `ldmatrix` (tests/standin/emu.cpp), apart
/// from any kernel of the plugin: `emu_check_mma_<type>` (tests/standin/emu_check.cu) builds
/// fragments of a known A and B by the PTX ISA's formulas, directly and through `ldmatrix`
/// (plain and transposed), and every product must equal the plain one exactly (small integers).
#[test]
fn the_emulators_mma_and_ldmatrix_follow_the_ptx_fragment_layouts() {
    type Launch = unsafe extern "C" fn(
        *mut c_void,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> i32;
    let a: Vec<f32> = (0..256).map(|i| ((i * 7 + 3) % 9) as f32 - 4.0).collect();
    // Neither matrix is symmetric in the index pairs a layout could swap (row and column, or
    // the halves of a fragment).
    let b: Vec<f32> = (0..128)
        .map(|i| ((i * 37 + 11) % 13) as f32 - 6.0)
        .collect();
    let mut product = [0.0f64; 128];
    for r in 0..16 {
        for c in 0..8 {
            product[r * 8 + c] = (0..16)
                .map(|k| f64::from(a[r * 16 + k]) * f64::from(b[k * 8 + c]))
                .sum();
        }
    }
    let library = common::emulator_driver();
    for kernel in ["emu_check_mma_f16", "emu_check_mma_bf16"] {
        let mut d = vec![f32::NAN; 4 * 128];
        // SAFETY: the stand-in driver with the emulator; its device memory is host memory, so
        // the kernel's pointer parameters are these vectors, which outlive the synchronous
        // launch. Each symbol has the driver API's signature.
        let status = unsafe {
            let driver = libloading::Library::new(&library).unwrap();
            let init: libloading::Symbol<unsafe extern "C" fn(u32) -> i32> =
                driver.get(b"cuInit").unwrap();
            let get: libloading::Symbol<
                unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> i32,
            > = driver.get(b"cuModuleGetFunction").unwrap();
            let launch: libloading::Symbol<Launch> = driver.get(b"cuLaunchKernel").unwrap();
            assert_eq!(init(0), 0);
            let name = CString::new(kernel).unwrap();
            let mut function = std::ptr::null_mut();
            assert_eq!(get(&mut function, std::ptr::null_mut(), name.as_ptr()), 0);
            let (mut pa, mut pb, mut pd) = (a.as_ptr(), b.as_ptr(), d.as_mut_ptr());
            let mut params: [*mut c_void; 3] = [
                (&mut pa as *mut *const f32).cast(),
                (&mut pb as *mut *const f32).cast(),
                (&mut pd as *mut *mut f32).cast(),
            ];
            let stream = std::ptr::null_mut();
            let extra = std::ptr::null_mut();
            launch(
                function,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                extra,
            )
        };
        assert_eq!(status, 0, "{kernel}: launch");
        for (which, what) in [
            "fragments by the formulas",
            "A and Bᵀ by ldmatrix",
            "B by ldmatrix.trans",
            "accumulating onto C",
        ]
        .iter()
        .enumerate()
        {
            let factor = if which == 3 { 2.0 } else { 1.0 };
            for (i, expected) in product.iter().enumerate() {
                let got = f64::from(d[which * 128 + i]);
                assert!(
                    (got - factor * expected).abs() <= 0.0,
                    "{kernel}, {what}: D[{}][{}] = {got}, expected {}",
                    i / 8,
                    i % 8,
                    factor * expected
                );
            }
        }
    }
}

/// The same ops on this machine's GPU, with its real driver, cuBLAS, cuBLASLt and NVRTC. Skips,
/// saying why, when the plugin finds no device here; fails on anything else.
#[test]
fn every_op_matches_the_reference_on_this_machines_gpu() {
    let plugin = load_library(&plugin_library()).expect("the cuda plugin loads");
    let probe = plugin.probe();
    if probe.device_count == 0 {
        eprintln!("skipped: no CUDA device: {}", probe.reason);
        return;
    }
    // Every scenario runs, each in its own process, and every failure is reported.
    let mut scenarios = vec!["gemm", "elementwise", "movement", "attention", "accounting"];
    if probe.device_count >= 2 {
        scenarios.push("ordinals");
    } else {
        eprintln!("two ordinals in one process: skipped, this machine has one GPU");
    }
    let mut failed = Vec::new();
    for scenario in scenarios {
        let output = common::child(scenario, &[(GPU_ENV, "1")], Libraries::System);
        let text = common::text(&output);
        eprintln!(
            "== scenario {scenario}: {}\n{text}",
            if output.status.success() {
                "passed"
            } else {
                "FAILED"
            }
        );
        if !output.status.success() {
            failed.push(scenario);
        }
    }
    assert!(
        failed.is_empty(),
        "scenarios failed on this GPU: {failed:?} (their output is above)"
    );
}

#[test]
fn every_device_byte_is_accounted_for_and_ops_grow_nothing_after_open() {
    run("accounting", &[], Libraries::Full);
}

/// The same with the diagnostic growth check on (`IRIS_CUDA_CHECK_GROWTH=1`): every entry
/// point waits for the queue and compares the driver's count with the report.
#[test]
fn the_growth_check_waits_and_compares_at_every_entry_point() {
    run(
        "accounting",
        &[(iris_device_cuda::device::CHECK_GROWTH_ENV, "1")],
        Libraries::Full,
    );
}

#[test]
fn every_ordinal_opens_at_once_in_one_process() {
    run(
        "ordinals",
        &[("IRIS_STANDIN_DEVICES", "2")],
        Libraries::Full,
    );
}

/// The whole conformance suite (`iris plugin check`) over the emulated device. Its tower-sized
/// GEMMs and attention take many minutes on the CPU emulation, so it runs on request:
/// `cargo test -p iris-device-cuda --test ops -- --ignored conformance`.
#[test]
#[ignore = "many minutes on the CPU emulation; run on request"]
fn conformance_suite_passes_over_the_emulated_device() {
    let memory = (8u64 << 30).to_string();
    let output = common::child(
        "conformance",
        &[("IRIS_STANDIN_MEMORY", &memory)],
        Libraries::Full,
    );
    // The checks and their outcomes, passed or not.
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{}", common::text(&output));
}

/// One scenario, run in a child process by the tests above (never on its own).
#[test]
#[ignore = "a child-process scenario, run by the other tests of this file"]
fn scenario() {
    let name = std::env::var(common::SCENARIO_ENV)
        .expect("run by the parent tests of tests/ops.rs, which set IRIS_STANDIN_SCENARIO");
    if name == "ordinals" {
        return ordinals();
    }
    if name == "cudnn_plan_memory" {
        let options = [("attention_engine", "cudnn"), ("cudnn_plan_memory", "1")];
        return cudnn_plan_memory(&open_with(0, &options));
    }
    if name == "cudnn_failed_execution" {
        return cudnn_failed_execution(&open_with(0, &[("attention_engine", "cudnn")]));
    }
    if name == "library_order" {
        let device = std::sync::Arc::new(open_with(0, &[("attention_engine", "cudnn")]));
        library_order(&device);
        return device.synchronize().unwrap();
    }
    if name == "cudnn" || name == "wrong_cudnn" {
        let device = open_with(0, &[("attention_engine", "cudnn")]);
        if name == "cudnn" {
            cudnn(device);
        } else {
            wrong_cudnn(&device);
        }
        return;
    }
    let device = open();
    if name == "conformance" {
        return conformance(device);
    }
    match name.as_str() {
        "gemm" => gemm(&device),
        "elementwise" => elementwise(&device),
        "movement" => movement(&device),
        "attention" => attention(&device),
        "wrong_q128" => wrong_q128(&device),
        "wrong_wide" => wrong_wide(&device),
        "status" => status(&device),
        "accounting" => accounting(&device),
        other => panic!("unknown scenario {other}"),
    }
    device.synchronize().unwrap();
}

/// Set in children that run on a real GPU.
const GPU_ENV: &str = "IRIS_TEST_REAL_GPU";

/// Runs `f` and says whether the stand-in's emulator ran four-wide vector accesses in it; `None`
/// on a GPU, which does not count them.
fn runs_wide(f: impl FnOnce()) -> Option<bool> {
    if on_gpu() {
        f();
        return None;
    }
    let before = common::standin_vector_accesses();
    f();
    Some(common::standin_vector_accesses() > before)
}

/// Fails unless the path `runs_wide` saw is the one expected (four columns per thread or one).
fn expect_path(ran_wide: Option<bool>, wide: bool, what: &str) {
    if let Some(ran_wide) = ran_wide {
        assert_eq!(
            ran_wide,
            wide,
            "{what}: expected {} per thread",
            if wide { "four columns" } else { "one column" }
        );
    }
}

/// Whether this child runs on a real GPU (not the stand-in, whose counters tests may read).
fn on_gpu() -> bool {
    std::env::var_os(GPU_ENV).is_some()
}

/// Opens the device with all ops. On the stand-in, the kernels come from a cache entry (the
/// stand-in driver accepts any image and finds kernels by name), so no NVRTC is needed; on a
/// real GPU they are compiled (or taken from the user's kernel cache).
fn open() -> Device {
    open_ordinal(0)
}

/// [`open`] for device `ordinal`.
fn open_ordinal(ordinal: u32) -> Device {
    open_with(ordinal, &[])
}

/// [`open`] for device `ordinal` with these options besides.
fn open_with(ordinal: u32, extra: &[(&str, &str)]) -> Device {
    let extra: Vec<(String, String)> = extra
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect();
    if std::env::var_os(GPU_ENV).is_some() {
        let plugin = load_library(&plugin_library()).unwrap();
        let device = plugin
            .open(ordinal, &extra)
            .expect("opens the GPU with ops");
        let desc = device.description();
        assert_eq!(desc.ops.len(), 9, "every op is listed");
        eprintln!(
            "cuda_libraries: {}",
            desc.property("cuda_libraries").unwrap_or_default()
        );
        return device;
    }
    let plugin = load_library(&plugin_library()).unwrap();
    let mut options = common::emulated_kernels(80, common::standin_driver_version());
    options.extend(extra);
    let device = plugin.open(ordinal, &options).expect("opens with ops");
    let desc = device.description();
    assert_eq!(desc.ops.len(), 9, "every op is listed");
    assert_eq!(
        desc.property(iris_plugin::abi::property::WARM_UP),
        Some(iris_plugin::abi::property::WARM_UP_STEP_SIZES),
        "the host is asked to run its steps at a range of sizes before serving"
    );
    // `iris devices` shows which CUDA libraries were loaded (the stand-ins are CUDA 12's, the
    // stand-in driver 12.4).
    let libraries = desc.property("cuda_libraries").unwrap_or_default();
    assert!(
        libraries.starts_with("CUDA 12 (cuBLAS 12.0.0"),
        "{libraries}"
    );
    let report = device.memory_report().unwrap();
    let held: Vec<&str> = report.held.iter().map(|(what, _)| what.as_str()).collect();
    assert!(
        held.contains(&"kernels") && held.contains(&"kernel status word"),
        "{held:?}"
    );
    device
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

/// Every ordinal open at once in one process, each casting its own data while the others are
/// open, then closed in turn.
fn ordinals() {
    let count = load_library(&plugin_library())
        .unwrap()
        .probe()
        .device_count;
    assert!(
        count >= 2,
        "the scenario needs two devices, the plugin sees {count}"
    );
    let devices: Vec<Device> = (0..count).map(open_ordinal).collect();
    let mut tensors = Vec::new();
    for (i, device) in devices.iter().enumerate() {
        let values: Vec<f64> = (0..64)
            .map(|j| (j as f64 + i as f64 * 100.0) / 8.0)
            .collect();
        let src = Tensor::upload(device, DType::F32, 8, 8, 8, 0, &values);
        let out = Tensor::upload(device, DType::BF16, 8, 8, 8, 0, &[0.0; 64]);
        device
            .cast(&CastArgs {
                src: src.view,
                out: out.view,
                workspace: BufferSlice::EMPTY,
            })
            .unwrap();
        tensors.push((src, out, values));
    }
    for (device, (src, out, values)) in devices.iter().zip(tensors) {
        let expected: Vec<f64> = values.iter().map(|v| round(DType::BF16, *v)).collect();
        assert_eq!(
            out.download(device),
            expected,
            "ordinal {}",
            device.ordinal()
        );
        src.free(device);
        out.free(device);
        device.synchronize().unwrap();
    }
}

/// `synchronize` and `read` make no blocking copy of the gather status word: none without a
/// gather since the last check, and an asynchronous one after a gather.
fn status(device: &Device) {
    let blocking = common::standin_blocking_reads;
    let before = blocking();
    let buf = device.alloc(64).unwrap();
    device.write(buf, 0, &[3u8; 64]).unwrap();
    let mut back = [0u8; 64];
    for _ in 0..3 {
        device.synchronize().unwrap();
        device.read(buf, 0, &mut back).unwrap();
    }
    assert_eq!(back, [3u8; 64]);
    device.free(buf).unwrap();
    let src = Tensor::upload(device, DType::F32, 4, 8, 8, 0, &Rng(3).values(32, 1.0));
    let out = Tensor::upload(device, DType::F32, 3, 8, 8, 0, &[0.0; 24]);
    let gather = |indices: &[i32; 3]| {
        let idx = upload_i32(device, indices);
        device
            .gather_rows(&GatherArgs {
                src: src.view,
                out: out.view,
                indices: MatRef::vector(idx, 0, DType::I32, 3),
                workspace: BufferSlice::EMPTY,
            })
            .unwrap();
        idx
    };
    for (indices, bad) in [([0i32, 9, 1], true), ([3, 2, 1], false), ([1, 1, 1], false)] {
        let idx = gather(&indices);
        let outcome = device.synchronize();
        assert_eq!(outcome.is_err(), bad, "indices {indices:?}: {outcome:?}");
        device.free(idx).unwrap();
    }
    // `read` waits too, and reports the bad index in its own name.
    let idx = gather(&[0, 7, 1]);
    let mut row = [0u8; 32];
    let err = device.read(out.view.buf, 0, &mut row).unwrap_err();
    assert!(
        err.message
            .starts_with("read: a gather_rows enqueued earlier"),
        "{err}"
    );
    device.free(idx).unwrap();
    // A reset's trim between the bad gather and the step's synchronisation leaves the report
    // to the synchronisation (it took it before, and failed the trim instead).
    let idx = gather(&[0, 8, 1]);
    device
        .trim()
        .expect("the trim does not take the step's error");
    let err = device.synchronize().unwrap_err();
    assert!(
        err.message
            .starts_with("synchronize: a gather_rows enqueued earlier"),
        "{err}"
    );
    device.free(idx).unwrap();
    src.free(device);
    out.free(device);
    device.synchronize().unwrap();
    assert_eq!(
        blocking(),
        before,
        "blocking device-to-host copies were made"
    );
}

fn gemm(device: &Device) {
    if !on_gpu() {
        // Split-K sums only in the f32 compute type, in both libraries (the one-rounding
        // contract below): set when the device opened.
        assert_eq!(
            common::standin_reduction_mask(),
            2,
            "cuBLASLt's reduction schemes: COMPUTE_TYPE (or none)"
        );
        assert_eq!(
            common::standin_math_mode() & 16,
            16,
            "cuBLAS: CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"
        );
    }
    // Every case runs, and each broken contract is reported, before the scenario fails.
    let mut failures = Vec::new();
    let vector_accesses = (!on_gpu()).then(common::standin_vector_accesses);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // (m, k, n, activation, bias, accumulate, w_transposed, strided): the epilogue kernel
        // takes four columns per thread in the aligned cases of n = 8 and 24, one in the others.
        let cases = [
            (33, 70, 47, Activation::NONE, false, false, false, false),
            (33, 70, 47, Activation::GELU_TANH, true, false, false, false),
            (17, 24, 40, Activation::GELU_ERF, true, false, true, true),
            (9, 31, 12, Activation::SILU, true, true, false, true),
            (9, 31, 12, Activation::NONE, true, true, true, false),
            (5, 16, 8, Activation::QUICK_GELU, false, true, false, false),
            (21, 40, 24, Activation::GELU_TANH, true, false, false, true),
            (21, 40, 24, Activation::SILU, true, false, true, false),
            (6, 0, 10, Activation::SILU, true, true, false, false),
        ];
        for (i, &(m, k, n, activation, with_bias, accumulate, w_transposed, strided)) in
            cases.iter().enumerate()
        {
            let mut rng = Rng(i as u64 + 1);
            let pad = if strided { 5 } else { 0 };
            let a = Tensor::upload(
                device,
                dtype,
                m,
                k,
                k + pad,
                16,
                &rng.values(m * (k + pad), 1.0),
            );
            let (w_rows, w_cols) = if w_transposed { (k, n) } else { (n, k) };
            let w = Tensor::upload(
                device,
                dtype,
                w_rows,
                w_cols,
                w_cols,
                0,
                &rng.values(w_rows * w_cols, 1.0),
            );
            // An odd element offset leaves the bias unaligned for cuBLASLt's epilogue: the
            // plugin then adds it in its own kernel.
            let bias_offset = if strided { 1 } else { 0 };
            let bias = with_bias.then(|| {
                Tensor::upload(
                    device,
                    dtype,
                    1,
                    n,
                    n,
                    bias_offset,
                    &rng.values(n + bias_offset, 1.0),
                )
            });
            let out = Tensor::upload(
                device,
                dtype,
                m,
                n,
                n + pad,
                0,
                &rng.values(m * (n + pad), 1.0),
            );
            let mut args = GemmArgs {
                a: a.view,
                w: w.view,
                bias: bias.as_ref().map_or(MatRef::NONE, |b| b.view),
                out: out.view,
                activation,
                accumulate,
                w_transposed,
                w_constant: true,
                workspace: BufferSlice::EMPTY,
            };
            let bytes = device.gemm_workspace(&args).unwrap();
            // Every other case lends the workspace at an odd offset: the libraries need 256-byte
            // alignment, which the plugin makes within what it asked for.
            let ws_offset = (i % 2) as u64;
            let workspace = (bytes > 0).then(|| device.alloc(bytes + ws_offset).unwrap());
            if let Some(buf) = workspace {
                args.workspace = BufferSlice {
                    buf,
                    offset: ws_offset,
                    bytes,
                };
            }
            device.gemm(&args).unwrap();
            if !on_gpu() && !accumulate {
                // The same problem again reuses cuBLASLt's descriptors and algorithm (or its
                // answer that cuBLAS computes it).
                let setups = common::standin_lt_setups();
                device.gemm(&args).unwrap();
                assert_eq!(
                    common::standin_lt_setups(),
                    setups,
                    "gemm {dtype} case {i}: cuBLASLt was set up again"
                );
            }
            let got = out.download(device);
            let mut expected = vec![0.0; m * n];
            for r in 0..m {
                for c in 0..n {
                    let mut sum = 0.0;
                    for l in 0..k {
                        let wv = if w_transposed { w.at(l, c) } else { w.at(c, l) };
                        sum += a.at(r, l) * wv;
                    }
                    if let Some(b) = &bias {
                        sum += b.at(0, c);
                    }
                    let mut v = act(activation, sum);
                    if accumulate {
                        v += out.at(r, c);
                    }
                    expected[r * n + c] = v;
                }
            }
            let what = format!("gemm {dtype} case {i} ({m}x{k}x{n}, {activation:?})");
            if let Err(failure) = within(&what, dtype, &got, &expected, k as f64) {
                failures.push(failure);
            }
            // Bias, activation and accumulation round an f16/bf16 output once: a product
            // rounded before them would differ from the once-rounded result in many elements.
            // An f32 sum in another order (tensor cores, tiles, split-K in f32) moves a result
            // across a rounding boundary only rarely. (Not checked when cuBLASLt has no algorithm: cuBLAS
            // then writes the product before the tanh GELU, which has no f32 scratch reserved.)
            let lt_has_algo = std::env::var_os("IRIS_STANDIN_LT_NO_ALGO").is_none();
            if dtype != DType::F32 && lt_has_algo {
                let ulps: Vec<u32> = got
                    .iter()
                    .zip(&expected)
                    .map(|(g, e)| ulp_distance(dtype, *g, round(dtype, *e)))
                    .collect();
                let off = ulps.iter().filter(|u| **u > 0).count();
                let worst = ulps.iter().copied().max().unwrap_or(0);
                if on_gpu() {
                    eprintln!(
                        "{what}: {off} of {} elements not the once-rounded result, at most \
                         {worst} ulp from it",
                        got.len()
                    );
                }
                if off * 100 > got.len() {
                    failures.push(format!(
                        "{what}: {off} of {} elements are not the once-rounded result (at most 1% \
                         may be), the farthest {worst} ulp from it",
                        got.len()
                    ));
                }
            }
            if let Some(buf) = workspace {
                device.free(buf).unwrap();
            }
            for t in [Some(a), Some(w), bias, Some(out)].into_iter().flatten() {
                t.free(device);
            }
        }
    }
    // A workspace smaller than the query's answer is refused before anything runs.
    let a = Tensor::upload(device, DType::BF16, 4, 8, 8, 0, &Rng(9).values(32, 1.0));
    let w = Tensor::upload(device, DType::BF16, 4, 8, 8, 0, &Rng(10).values(32, 1.0));
    let out = Tensor::upload(device, DType::BF16, 4, 4, 4, 0, &[0.0; 16]);
    let args = GemmArgs {
        a: a.view,
        w: w.view,
        bias: MatRef::NONE,
        out: out.view,
        activation: Activation::NONE,
        accumulate: false,
        w_transposed: false,
        w_constant: false,
        workspace: BufferSlice::EMPTY,
    };
    assert!(device.gemm_workspace(&args).unwrap() > 0);
    let err = device.gemm(&args).unwrap_err();
    assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
    assert!(err.message.contains("workspace"), "{err}");
    if !on_gpu() {
        // cuBLASLt's GELU epilogue is not the tanh formula in f32 (see src/ops/gemm.rs): every
        // activation runs in the plugin's epilogue kernel.
        assert_eq!(
            common::standin_gelu_epilogues(),
            0,
            "GELU epilogues requested"
        );
    }
    if let Some(before) = vector_accesses {
        assert!(
            common::standin_vector_accesses() > before,
            "no gemm epilogue took four columns per thread"
        );
    }
    assert!(
        failures.is_empty(),
        "{} gemm case(s) broke the contract:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn elementwise(device: &Device) {
    assert_eq!(
        device_property(device, "elementwise_lanes"),
        "4 where the views are aligned (the same results as 1 at open)"
    );
    // `elementwise_lanes = 1` holds every kernel at one column per thread.
    let narrow = open_with(0, &[("elementwise_lanes", "1")]);
    assert_eq!(
        device_property(&narrow, "elementwise_lanes"),
        "1 (elementwise_lanes = 1)"
    );
    let x = Tensor::upload(&narrow, DType::F32, 4, 64, 64, 0, &[1.5; 256]);
    let ran_wide = runs_wide(|| {
        narrow
            .binary(&BinaryArgs {
                a: x.view,
                b: x.view,
                out: x.view,
                op: BinaryOp::MUL,
                workspace: BufferSlice::EMPTY,
            })
            .unwrap()
    });
    expect_path(ran_wide, false, "mul with elementwise_lanes = 1");
    assert_eq!(x.download(&narrow), vec![2.25; 256]);
    x.free(&narrow);
    drop(narrow);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mut rng = Rng(3);
        // Norms at a tower width, with a row stride that leaves rows unaligned for four-wide
        // loads and one that does not, and at an odd width in place.
        for (rows, cols, stride, in_place, wide) in [
            (5, 1280, 1283, false, false),
            (5, 1280, 1284, false, true),
            (3, 37, 40, true, false),
        ] {
            for rms in [false, true] {
                let x = Tensor::upload(
                    device,
                    dtype,
                    rows,
                    cols,
                    stride,
                    0,
                    &rng.values(rows * stride, 2.0),
                );
                let weight =
                    Tensor::upload(device, dtype, 1, cols, cols, 0, &rng.values(cols, 1.0));
                let bias = (!rms).then(|| {
                    Tensor::upload(device, dtype, 1, cols, cols, 0, &rng.values(cols, 1.0))
                });
                let out = if in_place {
                    None
                } else {
                    Some(Tensor::upload(
                        device,
                        dtype,
                        rows,
                        cols,
                        cols,
                        0,
                        &vec![0.0; rows * cols],
                    ))
                };
                let out_view = out.as_ref().map_or(x.view, |o| o.view);
                let args = NormArgs {
                    x: x.view,
                    weight: weight.view,
                    bias: bias.as_ref().map_or(MatRef::NONE, |b| b.view),
                    out: out_view,
                    eps: 1e-6,
                    workspace: BufferSlice::EMPTY,
                };
                let ran_wide = runs_wide(|| {
                    if rms {
                        assert_eq!(device.rms_norm_workspace(&args).unwrap(), 0);
                        device.rms_norm(&args).unwrap();
                    } else {
                        device.layer_norm(&args).unwrap();
                    }
                });
                expect_path(
                    ran_wide,
                    wide,
                    &format!("norm {dtype} [{rows}, {cols}] / {stride}"),
                );
                let got = out.as_ref().unwrap_or(&x).download(device);
                let mut expected = Vec::new();
                for r in 0..rows {
                    let row: Vec<f64> = (0..cols).map(|c| x.at(r, c)).collect();
                    let mean = if rms {
                        0.0
                    } else {
                        row.iter().sum::<f64>() / cols as f64
                    };
                    let var =
                        row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
                    let inv = 1.0 / (var + 1e-6).sqrt();
                    for c in 0..cols {
                        let shift = bias.as_ref().map_or(0.0, |b| b.at(0, c));
                        expected.push((row[c] - mean) * inv * weight.at(0, c) + shift);
                    }
                }
                close(
                    &format!(
                        "{} {dtype} [{rows}, {cols}]",
                        if rms { "rms_norm" } else { "layer_norm" }
                    ),
                    dtype,
                    &got,
                    &expected,
                    4.0,
                );
                for t in [Some(x), Some(weight), bias, out].into_iter().flatten() {
                    t.free(device);
                }
            }
        }
        // Every activation, from a strided view into a contiguous one: rows of 310 elements
        // (one at a time), of 304 (four at a time), and of 304 starting two elements past an
        // aligned address (one at a time: a four-wide access there would fault on a GPU).
        for (activation, stride, offset) in [
            Activation::GELU_ERF,
            Activation::GELU_TANH,
            Activation::QUICK_GELU,
            Activation::SILU,
        ]
        .into_iter()
        .flat_map(|activation| {
            [
                (activation, 310, 8),
                (activation, 304, 8),
                (activation, 304, 2),
            ]
        }) {
            let x = Tensor::upload(
                device,
                dtype,
                7,
                300,
                stride,
                offset,
                &rng.values(7 * stride + offset, 4.0),
            );
            let out = Tensor::upload(device, dtype, 7, 300, 300, 0, &vec![0.0; 2100]);
            let ran_wide = runs_wide(|| {
                device
                    .activation(&ActivationArgs {
                        x: x.view,
                        out: out.view,
                        activation,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap()
            });
            expect_path(
                ran_wide,
                stride == 304 && offset == 8,
                &format!("activation {activation:?} {dtype} / {stride} + {offset}"),
            );
            let expected: Vec<f64> = (0..7)
                .flat_map(|r| (0..300).map(move |c| (r, c)))
                .map(|(r, c)| act(activation, x.at(r, c)))
                .collect();
            close(
                &format!("activation {activation:?} {dtype} / {stride} + {offset}"),
                dtype,
                &out.download(device),
                &expected,
                1.0,
            );
            x.free(device);
            out.free(device);
        }
        // Add with a broadcast row; multiply in place: 50 columns one at a time, 48 four at a
        // time.
        for cols in [50, 48] {
            let n = 6 * cols;
            let wide = cols % 4 == 0;
            let a = Tensor::upload(device, dtype, 6, cols, cols, 0, &rng.values(n, 1.0));
            let row = Tensor::upload(device, dtype, 1, cols, cols, 0, &rng.values(cols, 1.0));
            let b = Tensor::upload(device, dtype, 6, cols, cols, 0, &rng.values(n, 1.0));
            let out = Tensor::upload(device, dtype, 6, cols, cols, 0, &vec![0.0; n]);
            let ran_wide = runs_wide(|| {
                device
                    .binary(&BinaryArgs {
                        a: a.view,
                        b: row.view,
                        out: out.view,
                        op: BinaryOp::ADD,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap()
            });
            expect_path(
                ran_wide,
                wide,
                &format!("add broadcast {dtype} [6, {cols}]"),
            );
            let expected: Vec<f64> = (0..n)
                .map(|i| a.at(i / cols, i % cols) + row.at(0, i % cols))
                .collect();
            close(
                &format!("add broadcast {dtype} [6, {cols}]"),
                dtype,
                &out.download(device),
                &expected,
                1.0,
            );
            let ran_wide = runs_wide(|| {
                device
                    .binary(&BinaryArgs {
                        a: a.view,
                        b: b.view,
                        out: a.view,
                        op: BinaryOp::MUL,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap()
            });
            expect_path(ran_wide, wide, &format!("mul in place {dtype} [6, {cols}]"));
            let expected: Vec<f64> = (0..n)
                .map(|i| a.at(i / cols, i % cols) * b.at(i / cols, i % cols))
                .collect();
            close(
                &format!("mul in place {dtype} [6, {cols}]"),
                dtype,
                &a.download(device),
                &expected,
                1.0,
            );
            for t in [a, row, b, out] {
                t.free(device);
            }
        }
    }
}

fn movement(device: &Device) {
    let mut rng = Rng(5);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Rotary from tables: 7 tokens, 3 heads of 16 (half a head is 8: four pairs per
        // thread), and 2 heads of 12 (half is 6: one pair per thread).
        for (heads, hd) in [(3, 16), (2, 12)] {
            let tokens = 7;
            let x = Tensor::upload(
                device,
                dtype,
                tokens,
                heads * hd,
                heads * hd + 4,
                0,
                &rng.values(tokens * (heads * hd + 4), 1.0),
            );
            let [cos, sin] = [(); 2].map(|()| {
                let values = rng.values(tokens * hd, 1.0);
                Tensor::upload(device, DType::F32, tokens, hd, hd, 0, &values)
            });
            let ran_wide = runs_wide(|| {
                device
                    .rotary(&RotaryArgs {
                        x: x.view,
                        heads: heads as u64,
                        head_dim: hd as u64,
                        cos: cos.view,
                        sin: sin.view,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap()
            });
            expect_path(ran_wide, hd == 16, &format!("rotary {dtype} head_dim {hd}"));
            let mut expected = Vec::new();
            for t in 0..tokens {
                for h in 0..heads {
                    for j in 0..hd {
                        let half = hd / 2;
                        let v = x.at(t, h * hd + j);
                        let rotated = if j < half {
                            -x.at(t, h * hd + j + half)
                        } else {
                            x.at(t, h * hd + j - half)
                        };
                        expected.push(v * cos.at(t, j) + rotated * sin.at(t, j));
                    }
                }
            }
            close(
                &format!("rotary {dtype} head_dim {hd}"),
                dtype,
                &x.download(device),
                &expected,
                2.0,
            );
            for t in [x, cos, sin] {
                t.free(device);
            }
        }

        // Gather with repeated and out-of-order indices.
        let src = Tensor::upload(device, dtype, 6, 20, 24, 0, &rng.values(6 * 24, 1.0));
        let indices = [5i32, 0, 5, 2, 1, 1, 4];
        let idx = upload_i32(device, &indices);
        let out = Tensor::upload(
            device,
            dtype,
            indices.len(),
            20,
            20,
            0,
            &vec![0.0; indices.len() * 20],
        );
        let args = GatherArgs {
            src: src.view,
            out: out.view,
            indices: MatRef::vector(idx, 0, DType::I32, indices.len() as u64),
            workspace: BufferSlice::EMPTY,
        };
        device.gather_rows(&args).unwrap();
        let expected: Vec<f64> = indices
            .iter()
            .flat_map(|&r| (0..20).map(move |c| (r as usize, c)))
            .map(|(r, c)| src.at(r, c))
            .collect();
        assert_eq!(out.download(device), expected, "gather {dtype}");
        device.free(idx).unwrap();
        // A bad index writes zeros and is reported at the next synchronisation.
        let bad = upload_i32(device, &[1, 99, 0, -1, 2, 3, 4]);
        device
            .gather_rows(&GatherArgs {
                indices: MatRef::vector(bad, 0, DType::I32, 7),
                ..args
            })
            .unwrap();
        let err = device.synchronize().unwrap_err();
        assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
        assert!(err.message.contains("gather_rows"), "{err}");
        let got = out.download(device);
        assert!(got[20..40].iter().all(|v| *v == 0.0) && got[60..80].iter().all(|v| *v == 0.0));
        assert_eq!(
            &got[..20],
            &expected[80..100],
            "good rows are still gathered"
        );
        device.synchronize().expect("the report is given once");
        device.free(bad).unwrap();
        src.free(device);
        out.free(device);

        // Casts to every float dtype, 33 columns (one at a time) and 32 (four at a time).
        for (to, cols) in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .flat_map(|to| [(to, 33), (to, 32)])
        {
            let src = Tensor::upload(device, dtype, 4, cols, 40, 0, &rng.values(160, 3.0));
            let out = Tensor::upload(device, to, 4, cols, cols, 0, &vec![0.0; 4 * cols]);
            let ran_wide = runs_wide(|| {
                device
                    .cast(&CastArgs {
                        src: src.view,
                        out: out.view,
                        workspace: BufferSlice::EMPTY,
                    })
                    .unwrap()
            });
            expect_path(
                ran_wide,
                cols == 32,
                &format!("cast {dtype} -> {to} [4, {cols}]"),
            );
            let expected: Vec<f64> = (0..4 * cols)
                .map(|i| round(to, src.at(i / cols, i % cols)))
                .collect();
            assert_eq!(
                out.download(device),
                expected,
                "cast {dtype} -> {to} [4, {cols}]"
            );
            src.free(device);
            out.free(device);
        }
    }

    // A batched copy of more regions than the driver path takes, across three buffers, with
    // sizes and offsets of every alignment: small regions, regions of several kernel chunks,
    // and regions for the copy engine (64 KiB and more).
    const BYTES: usize = 256 << 10;
    let buffers: Vec<BufferHandle> = (0..3)
        .map(|_| device.alloc(BYTES as u64).unwrap())
        .collect();
    let mut images: Vec<Vec<u8>> = Vec::new();
    for (i, buf) in buffers.iter().enumerate() {
        let bytes: Vec<u8> = (0..BYTES).map(|j| ((j * 31 + i * 7) % 251) as u8).collect();
        device.write(*buf, 0, &bytes).unwrap();
        images.push(bytes);
    }
    let mut regions = Vec::new();
    let mut expected = images.clone();
    let sizes = (0..12u64).map(|r| (r, 16 * (r % 5) + (r % 3) + 1)).chain([
        (12, 9000),
        (13, 12288),
        (14, 65536),
        (15, 70001),
    ]);
    for (r, bytes) in sizes {
        let (src, dst) = ((r % 3) as usize, ((r + 1) % 3) as usize);
        // Sources and destinations of one batch never overlap.
        let (src_offset, dst_offset) = if bytes < 4096 {
            (r * 40 + (r % 4), 2048 + r * 150 + (r % 4) * 4)
        } else {
            (8192 + r * 40 + (r % 4), r * 12288 + (r % 2) * 16)
        };
        regions.push(CopyRegion {
            src: buffers[src],
            src_offset,
            dst: buffers[dst],
            dst_offset,
            bytes,
        });
        let (s, d, n) = (src_offset as usize, dst_offset as usize, bytes as usize);
        let chunk = images[src][s..s + n].to_vec();
        expected[dst][d..d + n].copy_from_slice(&chunk);
    }
    let copies_before = (!on_gpu()).then(common::standin_device_copies);
    device.copy_batch(&regions).unwrap();
    if let Some(before) = copies_before {
        // The two regions of 64 KiB and more went to the copy engine; the fourteen others to
        // one kernel whose grid has a row per region and a column per 4 KiB chunk.
        assert_eq!(common::standin_device_copies() - before, 2);
        assert_eq!(common::standin_last_grid(), [3, 14, 1]);
    }
    for (buf, want) in buffers.iter().zip(&expected) {
        let mut got = vec![0u8; BYTES];
        device.read(*buf, 0, &mut got).unwrap();
        assert!(got == *want, "batched copy");
    }
    let report = device.memory_report().unwrap();
    assert!(
        report
            .held
            .iter()
            .any(|(what, bytes)| what == "copy descriptors" && *bytes > 0),
        "{report:?}"
    );
    for buf in buffers {
        device.free(buf).unwrap();
    }
}

/// What the device holds outside its buffers is reported, and held from `open` on: the first
/// GEMM through each library (whose handles allocate state of their own on first use, as the
/// stand-in cuBLAS models), the epilogue kernel and batched copies of many regions leave device
/// memory where it was after `open` once their buffers are freed. On the stand-in every byte
/// the driver counts is a buffer or a held item.
fn accounting(device: &Device) {
    device.synchronize().unwrap();
    let used = || {
        let info = device.mem_info().unwrap();
        info.total - info.free
    };
    let accounted = || {
        let report = device.memory_report().unwrap();
        report.allocated + report.held.iter().map(|(_, bytes)| *bytes).sum::<u64>()
    };
    let opened = used();
    // On the stand-in the report may exceed the driver's count by the kernels' image (loaded
    // into host memory there); it never falls short, and ops do not change the difference.
    let slack = accounted().checked_sub(opened);
    if !on_gpu() {
        assert!(slack.is_some(), "the report counts every byte after open");
    }
    let mut rng = Rng(7);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for activation in [Activation::NONE, Activation::GELU_TANH, Activation::SILU] {
            let a = Tensor::upload(device, dtype, 40, 64, 64, 0, &rng.values(40 * 64, 1.0));
            let w = Tensor::upload(device, dtype, 48, 64, 64, 0, &rng.values(48 * 64, 1.0));
            let bias = Tensor::upload(device, dtype, 1, 48, 48, 0, &rng.values(48, 1.0));
            let out = Tensor::upload(device, dtype, 40, 48, 48, 0, &vec![0.0; 40 * 48]);
            let mut args = GemmArgs {
                a: a.view,
                w: w.view,
                bias: bias.view,
                out: out.view,
                activation,
                accumulate: false,
                w_transposed: false,
                w_constant: true,
                workspace: BufferSlice::EMPTY,
            };
            let (workspace, slice) = lend_workspace(device, device.gemm_workspace(&args).unwrap());
            args.workspace = slice;
            device.gemm(&args).unwrap();
            device.synchronize().unwrap();
            for t in [a, w, bias, out] {
                t.free(device);
            }
            if let Some(buf) = workspace {
                device.free(buf).unwrap();
            }
        }
    }
    // Batched copies of 20 and of 3000 small regions (more than one launch's descriptors).
    let (src, dst) = (
        device.alloc(1 << 20).unwrap(),
        device.alloc(1 << 20).unwrap(),
    );
    let bytes: Vec<u8> = (0..1 << 20).map(|j| (j % 253) as u8).collect();
    device.write(src, 0, &bytes).unwrap();
    for count in [20u64, 3000] {
        let regions: Vec<CopyRegion> = (0..count)
            .map(|r| CopyRegion {
                src,
                src_offset: r * 300 + r % 7,
                dst,
                dst_offset: r * 310,
                bytes: 100 + r % 50,
            })
            .collect();
        device
            .fill(&iris_plugin::abi::FillArgs {
                dst: BufferSlice {
                    buf: dst,
                    offset: 0,
                    bytes: 1 << 20,
                },
                value: 0,
                width: 1,
            })
            .unwrap();
        device.copy_batch(&regions).unwrap();
        let mut got = vec![0u8; 1 << 20];
        device.read(dst, 0, &mut got).unwrap();
        for region in &regions {
            let (s, d, n) = (
                region.src_offset as usize,
                region.dst_offset as usize,
                region.bytes as usize,
            );
            assert!(
                got[d..d + n] == bytes[s..s + n],
                "{count} regions: region at {d}"
            );
        }
    }
    device.free(src).unwrap();
    device.free(dst).unwrap();
    device.synchronize().unwrap();
    let after = used();
    eprintln!("device used after open {opened} bytes, after the ops and frees {after} bytes");
    assert_eq!(
        after,
        opened,
        "device memory after the ops and frees differs from after open by {} bytes",
        i128::from(after) - i128::from(opened)
    );
    if !on_gpu() {
        assert_eq!(
            accounted().checked_sub(after),
            slack,
            "every byte after the ops is accounted for"
        );
    }
}

fn attention(device: &Device) {
    // The f32-compute kernel: every dtype, head dims up to 128 padded to its sizes.
    let cu = [0, 1, 34, 104];
    for (dtype, head_dims) in [
        (DType::F32, &[8usize, 64, 72, 80, 128][..]),
        (DType::BF16, &[8, 48][..]),
        (DType::F16, &[40][..]),
    ] {
        for &hd in head_dims {
            attention_case(device, dtype, hd, &cu, 0);
            // The stand-in's emulator records grids; a real driver does not.
            if !on_gpu() {
                assert_eq!(
                    common::standin_last_grid(),
                    [70u32.div_ceil(32), 2, 3],
                    "{dtype} head_dim {hd}: the f32-compute kernel's grid"
                );
            }
        }
    }
    // The tensor-core kernels, 64 and 128 queries per block: segments of 1, 17, 64, 65 and 300
    // tokens in one call (a single query, partial query and key tiles, exactly one tile, one
    // row past it, several tiles; the 128-query blocks of the last have one, two and a quarter
    // of a warp's rows).
    let note = device_property(device, "attention_q128");
    assert!(
        note.starts_with(
            "head dims 64, 72, 80 (the same bits as the 64-query kernel at open); \
             attention_queries = auto"
        ),
        "every 128-query kernel passed its check at open: {note}"
    );
    let cu = [0, 1, 18, 82, 147, 447];
    for queries in [64u32, 128] {
        let fixed = open_with(0, &[("attention_queries", &queries.to_string())]);
        for dtype in [DType::BF16, DType::F16] {
            for hd in [64usize, 72, 80, 96, 128] {
                // Views one element into their buffers: rows not 16-byte aligned, so the tiles
                // load element by element instead of by cp.async.
                let offset = usize::from(dtype == DType::F16 && (hd == 80 || hd == 128));
                attention_case(&fixed, dtype, hd, &cu, offset);
                // No 128-query kernels at head dims 96 and 128: they run 64.
                let queries = if hd >= 96 { 64 } else { queries };
                if !on_gpu() {
                    assert_eq!(
                        common::standin_last_grid(),
                        [300u32.div_ceil(queries), 2, 5],
                        "{dtype} head_dim {hd}: the tensor-core kernel's grid ({queries} queries \
                         per block)"
                    );
                }
            }
        }
        drop(fixed);
    }
    // `auto`: 128 queries where the blocks fill every SM twice (the stand-in has 4) and the
    // segments fill three quarters of their query rows: 300 and 200 tokens make 5 blocks a head
    // (10 with 2 heads) of 640 rows, 500 used.
    let long = [0, 300, 500];
    attention_case(device, DType::BF16, 72, &long, 0);
    let grid_long = common::standin_last_grid();
    // Two heads of one 100-token segment: 2 blocks.
    let small = [0, 100];
    attention_case(device, DType::BF16, 72, &small, 0);
    let grid_small = common::standin_last_grid();
    // Four 130-token segments: 16 blocks, their rows barely half used (as Qwen2.5-VL's 64-token
    // windows use half; a grid of one block per window would not show which kernel ran).
    let halves: Vec<u32> = (0..=4).map(|w| w * 130).collect();
    attention_case(device, DType::BF16, 80, &halves, 0);
    let grid_halves = common::standin_last_grid();
    if !on_gpu() {
        assert_eq!(
            grid_long,
            [300u32.div_ceil(128), 2, 2],
            "long segments run 128 queries per block"
        );
        assert_eq!(
            grid_small,
            [2, 2, 1],
            "a small launch runs 64 queries per block"
        );
        assert_eq!(
            grid_halves,
            [130u32.div_ceil(64), 2, 4],
            "segments that fill half the 128-query blocks run 64 queries per block"
        );
    }
    attention_bad_segments(device);
}

/// A device copy of `cu_seqlens` that disagrees with the host copy (the caller's bug): the
/// kernels, whose launch the host copy sized, never read or write outside the call's rows for
/// it, nor leave a segment's queries past the launch's reach unwritten unnoticed, and the next
/// synchronisation reports it (once) as an invalid argument. Both kernel families: the
/// f32-compute one and the tensor-core one.
fn attention_bad_segments(device: &Device) {
    // Two segments of 4 tokens.
    let pair = vec![0u32, 4, 8];
    // Twenty segments of 4 tokens: a launch sized for 4-token segments (one block of 32 or 64
    // queries each), and a device copy whose first segment has 70, every bound inside the rows.
    let twenty: Vec<u32> = (0..=20).map(|i| 4 * i).collect();
    let long_first: Vec<i32> = (0..=20)
        .map(|i| if i == 0 { 0 } else { (69 + i).min(80) })
        .collect();
    let cases: [(&[u32], Vec<i32>, &str); 4] = [
        (
            &pair,
            vec![0, 4, 1_000_000],
            "a segment reaching a million rows past the call's 8",
        ),
        (
            &pair,
            vec![-5, 4, 8],
            "a segment starting before the first row",
        ),
        (&pair, vec![0, 6, 4], "a segment of negative length"),
        (
            &twenty,
            long_first,
            "a segment longer than the launch reaches",
        ),
    ];
    let hd = 64usize;
    for dtype in [DType::F32, DType::BF16] {
        for (host_cu, device_cu, what) in &cases {
            let tokens = *host_cu.last().unwrap() as usize;
            let part = |seed: u64| {
                let values = Rng(seed).values(tokens * hd, 1.0);
                Tensor::upload(device, dtype, tokens, hd, hd, 0, &values)
            };
            let (q, k, v, out) = (part(1), part(2), part(3), part(4));
            let call = |device_cu: &[i32]| {
                let cu_device = upload_i32(device, device_cu);
                device
                    .attention(&AttentionArgs {
                        q: q.view,
                        k: k.view,
                        v: v.view,
                        out: out.view,
                        heads: 1,
                        head_dim: hd as u64,
                        scale: 0.125,
                        cu_seqlens: (*host_cu).into(),
                        cu_seqlens_device: MatRef::vector(
                            cu_device,
                            0,
                            DType::I32,
                            device_cu.len() as u64,
                        ),
                        max_seqlen: 4,
                        workspace: BufferSlice::EMPTY,
                    })
                    .expect("the call itself is valid: the host does not read the device copy");
                let outcome = device.synchronize();
                device.free(cu_device).unwrap();
                outcome
            };
            let err = call(device_cu).expect_err(&format!("{dtype}: {what}: {device_cu:?}"));
            assert_eq!(err.code, ErrorCode::INVALID_ARGUMENT, "{err}");
            assert!(
                err.message
                    .starts_with("synchronize: an attention enqueued earlier found segment bounds"),
                "{dtype}: {what}: {err}"
            );
            // Reported once: the same call with both copies equal computes and passes.
            let equal: Vec<i32> = host_cu.iter().map(|&b| b as i32).collect();
            call(&equal).expect("equal copies");
            for t in [q, k, v, out] {
                t.free(device);
            }
        }
    }
}

/// The `cudnn` scenario (see `attention_runs_on_cudnn_where_it_passed_its_check`).
fn cudnn(device: Device) {
    let note = device_property(&device, "attention_engine");
    let all = "cudnn 9.17.0 for bf16 64, f16 64, bf16 72, f16 72, bf16 80, f16 80, bf16 96, f16 \
               96, bf16 128, f16 128 (within the check's bound of the plugin kernel at open)";
    assert!(
        note.starts_with(&format!("{all}; checked in ")) && note.ends_with(" ms"),
        "every head dim and type passed cuDNN's check at open: {note}"
    );
    let held = device.memory_report().unwrap().held;
    assert!(
        held.iter().any(
            |(what, _)| what == "cuBLAS, cuBLASLt and cuDNN state from their first computation"
        ),
        "{held:?}"
    );
    // The stand-in allocates its handle's state at the first execution, in the check at open:
    // counted there. Each plan's first execution allocates `IRIS_STANDIN_CUDNN_PLAN_BYTES`
    // more (kernels a real cuDNN loads for it): after open, the report must name that too.
    device.synchronize().unwrap();
    let used = || {
        let info = device.mem_info().unwrap();
        info.total - info.free
    };
    let opened = used();
    let plans_after_open = || plans_after_open(&device);
    assert_eq!(plans_after_open(), 0);
    // Segments of 1, 17, 64, 65 and 300 tokens: five lengths, five calls.
    let mixed = [0, 1, 18, 82, 147, 447];
    // Five segments of 130 tokens: one call of four and one of one.
    let equal: Vec<u32> = (0..=5).map(|i| i * 130).collect();
    // After open, plans are built on a thread of their own: a call whose plans are not ready
    // runs the plugin's kernel (right, as `attention_case` checks) and does not wait for them,
    // here while their builds cannot finish. Only the one-token run's plan is ready (the check
    // at open built it, for these strides).
    let cudnn_runs = |dtype, hd, cu: &[u32]| cudnn_runs(&device, dtype, hd, cu);
    common::standin_cudnn_hold_plans(true);
    assert_eq!(cudnn_runs(DType::BF16, 64, &mixed), 1, "a plan being built");
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::standin_cudnn_held_plans() == 0 {
        assert!(Instant::now() < deadline, "no plan was built after 60 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    // While the builder holds cuDNN's handle, calls do not wait for it either: the ready plan's
    // run takes the kernel too.
    assert_eq!(cudnn_runs(DType::BF16, 64, &mixed), 0, "the handle in use");
    common::standin_cudnn_hold_plans(false);
    for dtype in [DType::BF16, DType::F16] {
        for hd in [64usize, 72, 80, 96, 128] {
            for (cu, first, calls) in [(&mixed[..], 1, 5), (&equal[..], 0, 2)] {
                let what = format!("{dtype} head_dim {hd}, segments {cu:?}");
                if (dtype, hd, cu.len()) != (DType::BF16, 64, mixed.len()) {
                    assert_eq!(cudnn_runs(dtype, hd, cu), first, "{what}: first call");
                }
                // Then every run takes cuDNN, once the builder has made their plans.
                until_cudnn_runs(&device, dtype, hd, cu, calls);
            }
        }
    }
    // Views one element into their buffers are not aligned as cuDNN's plans declare: the
    // plugin's kernel computes them.
    let before = common::standin_cudnn_executes();
    attention_case(&device, DType::F16, 80, &mixed, 1);
    assert_eq!(common::standin_cudnn_executes(), before, "unaligned views");
    // Head dims cuDNN was not checked at run the plugin's kernel.
    attention_case(&device, DType::BF16, 48, &mixed, 0);
    assert_eq!(common::standin_cudnn_executes(), before, "head dim 48");
    // So do calls of more than 16 runs (here 17 lengths, one segment each): one launch of the
    // kernel instead of 17 calls.
    let many: Vec<u32> = (0..=17u32).map(|i| i * (i + 1) / 2).collect();
    attention_case(&device, DType::BF16, 64, &many, 0);
    assert_eq!(common::standin_cudnn_executes(), before, "17 runs");
    // The plans made after open, one stand-in allocation each, all in the report: per head dim
    // and type those of 17, 64, 65 and 300 tokens and of 130 tokens times 4 and 1 (the check at
    // open built the one-token plan of these strides already).
    device.synchronize().unwrap();
    let grown = used() - opened;
    assert_eq!(grown, 10 * 6 * 65536, "device memory the plans added");
    assert_eq!(
        plans_after_open(),
        grown,
        "every byte the plans added is reported"
    );
    drop(device);
    assert_eq!(
        common::standin_cudnn_live(),
        (0, 0),
        "a closed device leaves no cuDNN descriptor or handle"
    );
    // `auto` takes cuDNN from Hopper on: this device is an Ampere.
    let auto = open();
    assert_eq!(
        device_property(&auto, "attention_engine"),
        "kernel: attention_engine = auto takes cuDNN from compute capability 9.0 (set \
         attention_engine = cudnn to use it on 8.0)"
    );
}

/// What the memory report says cuDNN's plans built after open hold.
fn plans_after_open(device: &Device) -> u64 {
    device
        .memory_report()
        .unwrap()
        .held
        .iter()
        .filter(|(what, _)| what == "cuDNN plans built after open")
        .map(|(_, bytes)| *bytes)
        .sum()
}

/// How many of its runs cuDNN computed in one attention call over `cu` (2 heads of `hd`, checked
/// against the reference).
fn cudnn_runs(device: &Device, dtype: DType, hd: usize, cu: &[u32]) -> u64 {
    let before = common::standin_cudnn_executes();
    attention_case(device, dtype, hd, cu, 0);
    common::standin_cudnn_executes() - before
}

/// Repeats the attention call over `cu` until cuDNN computes `calls` runs of it (the builder
/// thread has made their plans); fails after 60 s, or on more runs than `calls`.
fn until_cudnn_runs(device: &Device, dtype: DType, hd: usize, cu: &[u32], calls: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ran = cudnn_runs(device, dtype, hd, cu);
        assert!(ran <= calls, "{dtype} {hd}, {cu:?}: {ran} cuDNN calls");
        if ran == calls {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{dtype} {hd}, {cu:?}: {ran} of {calls} runs on cuDNN after 60 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The `cudnn_plan_memory` scenario (see
/// `cudnn_plans_stop_at_the_plan_memory_option_and_trim_gives_them_back` and
/// `trim_reports_what_a_cudnn_keeping_its_kernels_did_not_give_back`).
fn cudnn_plan_memory(device: &Device) {
    let plans_after_open = || plans_after_open(device);
    let used = || {
        device.synchronize().unwrap();
        let info = device.mem_info().unwrap();
        info.total - info.free
    };
    let opened = used();
    // Two shapes' plans, half a MiB each at their first execution: the option's 1 MiB.
    for tokens in [130, 200] {
        until_cudnn_runs(device, DType::BF16, 64, &[0, tokens], 1);
    }
    assert_eq!(plans_after_open(), 1 << 20);
    // A third shape is not built: it runs the plugin's kernel, now and later.
    let built = common::standin_cudnn_plans();
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        assert_eq!(cudnn_runs(device, DType::BF16, 64, &[0, 300]), 0);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(common::standin_cudnn_plans(), built, "no plan was built");
    // The plans made before still serve.
    assert_eq!(cudnn_runs(device, DType::BF16, 64, &[0, 130]), 1);
    assert_eq!(plans_after_open(), 1 << 20);
    assert_eq!(used() - opened, 1 << 20);
    // A reset's `trim` drops the plans built after open (the check's stay: they are the
    // open's).
    let given = device.trim().unwrap();
    if std::env::var_os("IRIS_STANDIN_CUDNN_PLAN_MEMORY_KEPT").is_some() {
        // What cuDNN keeps is still reported, and still holds new shapes off.
        assert_eq!(given, Some(0));
        assert_eq!(plans_after_open(), 1 << 20);
        assert_eq!(used() - opened, 1 << 20);
        let built = common::standin_cudnn_plans();
        for _ in 0..10 {
            assert_eq!(cudnn_runs(device, DType::BF16, 64, &[0, 300]), 0);
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(common::standin_cudnn_plans(), built, "no plan was built");
        return;
    }
    assert_eq!(
        given,
        Some(1 << 20),
        "the bytes the plans' first executions took"
    );
    assert_eq!(plans_after_open(), 0);
    assert_eq!(used(), opened, "device memory back to its value after open");
    // Dropped shapes run the plugin's kernel (right) until built again; the shape the option
    // had refused is built too, now that there is room.
    assert_eq!(cudnn_runs(device, DType::BF16, 64, &[0, 130]), 0);
    for tokens in [130, 300] {
        until_cudnn_runs(device, DType::BF16, 64, &[0, tokens], 1);
    }
    assert_eq!(plans_after_open(), 1 << 20);
    // Nothing to give back twice.
    device.trim().unwrap();
    assert_eq!(device.trim().unwrap(), Some(0));
    assert_eq!(used(), opened);
    // Three shapes asked for at once, while nothing is held: all three are built, and the
    // one whose plan is still unrun when the first two reached the option is dropped unrun
    // (before, it ran too, and the plans held 1.5 MiB under the option's 1 MiB).
    until_cudnn_runs(device, DType::BF16, 64, &[0, 130, 330, 630], 2);
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        assert!(cudnn_runs(device, DType::BF16, 64, &[0, 130, 330, 630]) <= 2);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(plans_after_open(), 1 << 20);
    assert_eq!(used() - opened, 1 << 20);
}

/// The `cudnn_failed_execution` scenario (see
/// `a_cudnn_plan_whose_first_execution_fails_leaves_its_shape_to_the_kernel`).
fn cudnn_failed_execution(device: &Device) {
    const PLAN_BYTES: u64 = 1 << 19;
    let plans_after_open = || plans_after_open(device);
    let used = || {
        device.synchronize().unwrap();
        let info = device.mem_info().unwrap();
        info.total - info.free
    };
    let failed = common::standin_cudnn_failed_executes;
    let opened = used();
    // One 130-token segment: its first call runs the plugin's kernel and asks for the plan,
    // which the builder thread makes (finalizing needs no device memory in the stand-in).
    let cu = [0, 130];
    let built = common::standin_cudnn_plans();
    assert_eq!(cudnn_runs(device, DType::BF16, 64, &cu), 0, "no plan yet");
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::standin_cudnn_plans() == built {
        assert!(Instant::now() < deadline, "no plan was built after 60 s");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Room for the calls' own buffers, not for what the plan's first execution loads.
    let free = device.mem_info().unwrap().free;
    let filler = device.alloc(free - (400 << 10)).unwrap();
    // Every call succeeds, right (`cudnn_runs` checks it against the reference), on the
    // kernel: before the plan is ready, and at the call whose execution of it fails.
    let before = failed();
    let deadline = Instant::now() + Duration::from_secs(60);
    while failed() == before {
        assert!(
            Instant::now() < deadline,
            "the plan was not executed after 60 s"
        );
        assert_eq!(cudnn_runs(device, DType::BF16, 64, &cu), 0);
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(failed(), before + 1, "one failed execution");
    // From then on the shape runs the kernel without trying cuDNN, squeezed or not, and its
    // plan is not built again.
    for _ in 0..3 {
        assert_eq!(cudnn_runs(device, DType::BF16, 64, &cu), 0, "squeezed");
    }
    assert_eq!(plans_after_open(), 0, "the failed plan holds nothing");
    device.free(filler).unwrap();
    for _ in 0..5 {
        assert_eq!(
            cudnn_runs(device, DType::BF16, 64, &cu),
            0,
            "memory free again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(failed(), before + 1, "the refused shape is not tried again");
    assert_eq!(
        common::standin_cudnn_plans(),
        built + 1,
        "nor its plan built again"
    );
    assert_eq!(plans_after_open(), 0);
    assert_eq!(used(), opened, "device memory back to its value after open");
    // Other shapes still take cuDNN, their plans counted as before.
    until_cudnn_runs(device, DType::BF16, 64, &[0, 200], 1);
    assert_eq!(plans_after_open(), PLAN_BYTES);
    assert_eq!(used() - opened, PLAN_BYTES);
    // A trim gives that plan back and drops the refusal: the failure was a first execution,
    // which may have been for lack of memory. The shape's plan is built again and serves.
    assert_eq!(device.trim().unwrap(), Some(PLAN_BYTES));
    assert_eq!(plans_after_open(), 0);
    until_cudnn_runs(device, DType::BF16, 64, &cu, 1);
    assert_eq!(plans_after_open(), PLAN_BYTES);
    assert_eq!(used() - opened, PLAN_BYTES);
    assert_eq!(failed(), before + 1);
}

/// The `library_order` scenario (see `library_calls_read_what_their_stream_wrote_before_them`):
/// a product's `a` and attention's fused qkv are uploaded holding other values, then written
/// again through `write_async` (a host copy into a page-locked slot on the plugin's copy stream,
/// which the queue waits for, then the slot's copy to the device, all deferred), and the library
/// call is enqueued at once. A library computing before that work ran would read the values
/// uploaded first.
fn library_order(device: &std::sync::Arc<Device>) {
    // (m, k, n) of the `gemm` scenario's first case; f32 takes cuBLAS, f16 and bf16 cuBLASLt.
    let (m, k, n) = (33, 70, 47);
    for (i, (dtype, lt)) in [(DType::F32, false), (DType::BF16, true), (DType::F16, true)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng(i as u64 + 40);
        let mut a = Tensor::upload(device, dtype, m, k, k, 0, &rng.values(m * k, 1.0));
        let w = Tensor::upload(device, dtype, n, k, k, 0, &rng.values(n * k, 1.0));
        let out = Tensor::upload(device, dtype, m, n, n, 0, &vec![0.0; m * n]);
        let mut args = GemmArgs {
            a: a.view,
            w: w.view,
            bias: MatRef::NONE,
            out: out.view,
            activation: Activation::NONE,
            accumulate: false,
            w_transposed: false,
            w_constant: true,
            workspace: BufferSlice::EMPTY,
        };
        let workspace = lend_workspace(device, device.gemm_workspace(&args).unwrap());
        args.workspace = workspace.1;
        let written = a.replace(&rng.values(m * k, 1.0));
        let setups = common::standin_lt_setups();
        let ((), waited) = device.with_async_writes(|writes| {
            assert!(
                writes.write(a.view.buf, 0, &written).unwrap(),
                "the plugin takes the write"
            );
            device.gemm(&args).unwrap();
        });
        waited.unwrap();
        assert_eq!(
            common::standin_lt_setups() > setups,
            lt,
            "gemm {dtype}: the product on {}",
            if lt { "cuBLASLt" } else { "cuBLAS" }
        );
        let expected: Vec<f64> = (0..m * n)
            .map(|e| (0..k).map(|l| a.at(e / n, l) * w.at(e % n, l)).sum())
            .collect();
        let what = format!("gemm {dtype} after write_async");
        close(&what, dtype, &out.download(device), &expected, k as f64);
        if let Some(buf) = workspace.0 {
            device.free(buf).unwrap();
        }
        for t in [a, w, out] {
            t.free(device);
        }
    }
    // cuDNN: two runs (two segments of 130 tokens, one of one token), whose plans are built and
    // have executed once first, since a plan's first execution after open waits for the queue.
    let cu = [0, 130, 260, 261];
    until_cudnn_runs(device, DType::BF16, 64, &cu, 2);
    let before = common::standin_cudnn_executes();
    attention_case_by(device, DType::BF16, 64, &cu, 0, |args, qkv| {
        let written = qkv.replace(&Rng(41).values(qkv.host.len(), 1.0));
        let ((), waited) = device.with_async_writes(|writes| {
            assert!(
                writes.write(qkv.view.buf, 0, &written).unwrap(),
                "the plugin takes the write"
            );
            device.attention(args).unwrap();
        });
        waited.unwrap();
    });
    assert_eq!(
        common::standin_cudnn_executes() - before,
        2,
        "cuDNN computed both runs"
    );
}

/// cuDNN made wrong by the stand-in does not serve (see
/// `cudnn_attention_that_differs_at_open_does_not_serve`).
fn wrong_cudnn(device: &Device) {
    let note = device_property(device, "attention_engine");
    assert!(
        note.starts_with(
            "kernel: cuDNN 9.17.0 did not pass the check at open; the plugin's kernel for bf16 64: \
             2 of 33408 outputs differ from the plugin kernel's by more than 4 units in the last \
             place; f16 64: 2 of 33408"
        ),
        "{note}"
    );
    let before = common::standin_cudnn_executes();
    attention_case(device, DType::BF16, 64, &[0, 130, 260], 0);
    assert_eq!(common::standin_cudnn_executes(), before);
}

/// A 128-query attention kernel that computes wrong on the device (the stand-in flips a bit of
/// its output) fails its check at open: `iris devices` says so, and attention at its head dim
/// runs the 64-query kernel, right, even where the options ask for 128.
fn wrong_q128(device: &Device) {
    let note = device_property(device, "attention_q128");
    assert!(
        note.starts_with(
            "head dims 64, 72 (the same bits as the 64-query kernel at open); 64 \
             queries instead for bf16 80: 1 of 10480 outputs differ from the 64-query kernel's"
        ),
        "{note}"
    );
    let fixed = open_with(0, &[("attention_queries", "128")]);
    let cu = [0, 1, 18, 82, 147, 447];
    attention_case(&fixed, DType::BF16, 80, &cu, 0);
    assert_eq!(common::standin_last_grid(), [300u32.div_ceil(64), 2, 5]);
    attention_case(&fixed, DType::BF16, 72, &cu, 0);
    assert_eq!(common::standin_last_grid(), [300u32.div_ceil(128), 2, 5]);
}

/// An elementwise kernel whose four-wide path computes wrong on the device (the stand-in flips a
/// bit of its output) fails the check at open: `iris devices` names it, and every elementwise
/// kernel runs one column per thread, right.
fn wrong_wide(device: &Device) {
    assert_eq!(
        device_property(device, "elementwise_lanes"),
        "1: four columns per thread differed from one at open in activation_bf16 (1 of 512 \
         outputs differ)"
    );
    let x = Tensor::upload(device, DType::BF16, 4, 64, 64, 0, &Rng(9).values(256, 2.0));
    let out = Tensor::upload(device, DType::BF16, 4, 64, 64, 0, &[0.0; 256]);
    let ran_wide = runs_wide(|| {
        device
            .activation(&ActivationArgs {
                x: x.view,
                out: out.view,
                activation: Activation::SILU,
                workspace: BufferSlice::EMPTY,
            })
            .unwrap()
    });
    expect_path(ran_wide, false, "activation after a failed check");
    let expected: Vec<f64> = (0..256)
        .map(|i| act(Activation::SILU, x.at(i / 64, i % 64)))
        .collect();
    close(
        "activation after a failed check",
        DType::BF16,
        &out.download(device),
        &expected,
        1.0,
    );
    x.free(device);
    out.free(device);
}

/// One of the device's description properties: `attention_q128` (which 128-query attention
/// kernels serve), `elementwise_lanes` (how many columns per thread the elementwise kernels take,
/// and why).
fn device_property(device: &Device, key: &str) -> String {
    device
        .description()
        .property(key)
        .unwrap_or_default()
        .to_owned()
}

/// One attention call over `cu` (2 heads of `hd`; q, k and v column blocks of one fused qkv
/// buffer, `offset` elements into it) against the f64 reference.
fn attention_case(device: &Device, dtype: DType, hd: usize, cu: &[u32], offset: usize) {
    attention_case_by(device, dtype, hd, cu, offset, |args, _| {
        device.attention(args).unwrap();
    });
}

/// [`attention_case`] with the call made by `call`, which may first give the fused qkv buffer
/// other contents ([`Tensor::replace`]): the reference is computed from them.
fn attention_case_by(
    device: &Device,
    dtype: DType,
    hd: usize,
    cu: &[u32],
    offset: usize,
    call: impl FnOnce(&AttentionArgs<'_>, &mut Tensor),
) {
    let tokens = *cu.last().unwrap() as usize;
    let max_seqlen = cu.windows(2).map(|s| s[1] - s[0]).max().unwrap();
    let heads = 2;
    let mut rng = Rng(hd as u64 + tokens as u64);
    let width = heads * hd;
    let mut qkv = Tensor::upload(
        device,
        dtype,
        tokens,
        3 * width,
        3 * width,
        offset,
        &rng.values(tokens * 3 * width, 1.0),
    );
    let view = |part: usize| MatRef {
        offset: qkv.view.offset + (part * width) as u64 * dtype.size().unwrap(),
        cols: width as u64,
        ..qkv.view
    };
    let out = Tensor::upload(
        device,
        dtype,
        tokens,
        width,
        width,
        offset,
        &vec![0.0; tokens * width],
    );
    let cu_i32: Vec<i32> = cu.iter().map(|&v| v as i32).collect();
    let cu_device = upload_i32(device, &cu_i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut args = AttentionArgs {
        q: view(0),
        k: view(1),
        v: view(2),
        out: out.view,
        heads: heads as u64,
        head_dim: hd as u64,
        scale,
        cu_seqlens: cu.into(),
        cu_seqlens_device: MatRef::vector(cu_device, 0, DType::I32, cu.len() as u64),
        max_seqlen: u64::from(max_seqlen),
        workspace: BufferSlice::EMPTY,
    };
    // The plugin's kernels need no workspace; cuDNN's plans may.
    let workspace = lend_workspace(device, device.attention_workspace(&args).unwrap());
    args.workspace = workspace.1;
    call(&args, &mut qkv);
    let row = |i: usize, part: usize, h: usize| -> Vec<f64> {
        (0..hd)
            .map(|c| qkv.at(i, part * width + h * hd + c))
            .collect()
    };
    let mut expected = vec![0.0; tokens * width];
    for seg in cu.windows(2) {
        let (start, end) = (seg[0] as usize, seg[1] as usize);
        for h in 0..heads {
            let keys: Vec<Vec<f64>> = (start..end).map(|j| row(j, 1, h)).collect();
            let values: Vec<Vec<f64>> = (start..end).map(|j| row(j, 2, h)).collect();
            for i in start..end {
                let q = row(i, 0, h);
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * f64::from(scale))
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let o = &mut expected[i * width + h * hd..i * width + (h + 1) * hd];
                for (w, v) in weights.iter().zip(&values) {
                    for (o, v) in o.iter_mut().zip(v) {
                        *o += w * v / total;
                    }
                }
            }
        }
    }
    close(
        &format!("attention {dtype} head_dim {hd}, segments {cu:?}"),
        dtype,
        &out.download(device),
        &expected,
        1.0,
    );
    device.free(cu_device).unwrap();
    if let Some(buf) = workspace.0 {
        device.free(buf).unwrap();
    }
    qkv.free(device);
    out.free(device);
}

/// A workspace of `bytes` for an op (none for 0): the buffer to free afterwards, and the slice.
fn lend_workspace(device: &Device, bytes: u64) -> (Option<BufferHandle>, BufferSlice) {
    if bytes == 0 {
        return (None, BufferSlice::EMPTY);
    }
    let buf = device.alloc(bytes).unwrap();
    (
        Some(buf),
        BufferSlice {
            buf,
            offset: 0,
            bytes,
        },
    )
}

fn conformance(device: Device) {
    let plugin = load_library(&plugin_library()).unwrap();
    let device = std::sync::Arc::new(device);
    let report = iris_plugin::conformance::run(&plugin, &device);
    for check in &report.checks {
        eprintln!("{:<48} {}", check.name, check.status);
    }
    eprintln!(
        "{} passed, {} failed, {} unsupported",
        report.passed(),
        report.failed(),
        report.unsupported()
    );
    let failures: Vec<String> = report
        .failures()
        .map(|check| format!("{}: {}", check.name, check.status))
        .collect();
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A matrix on the device and the values it holds (rounded to its dtype), row-major with a
/// stride, `offset` elements into its buffer.
struct Tensor {
    view: MatRef,
    host: Vec<f64>,
    stride: usize,
    offset: usize,
}

impl Tensor {
    fn upload(
        device: &Device,
        dtype: DType,
        rows: usize,
        cols: usize,
        stride: usize,
        offset: usize,
        values: &[f64],
    ) -> Tensor {
        let len = offset
            + if rows == 0 {
                0
            } else {
                (rows - 1) * stride + cols
            };
        let host: Vec<f64> = (0..len)
            .map(|i| round(dtype, values.get(i).copied().unwrap_or(0.0)))
            .collect();
        let size = dtype.size().unwrap() as usize;
        let buf = device.alloc((len.max(1) * size) as u64).unwrap();
        device.write(buf, 0, &encode(dtype, &host)).unwrap();
        Tensor {
            view: MatRef {
                buf,
                offset: (offset * size) as u64,
                dtype,
                rows: rows as u64,
                cols: cols as u64,
                row_stride: stride as u64,
            },
            host,
            stride,
            offset,
        }
    }

    fn at(&self, r: usize, c: usize) -> f64 {
        self.host[self.offset + r * self.stride + c]
    }

    /// Makes `values` (rounded to the dtype, laid out as in [`Tensor::upload`]) what the tensor
    /// holds on the host and returns their bytes, for the caller to write to its buffer.
    fn replace(&mut self, values: &[f64]) -> Vec<u8> {
        let dtype = self.view.dtype;
        for (i, held) in self.host.iter_mut().enumerate() {
            *held = round(dtype, values.get(i).copied().unwrap_or(0.0));
        }
        encode(dtype, &self.host)
    }

    /// The view's elements, row by row.
    fn download(&self, device: &Device) -> Vec<f64> {
        let size = self.view.dtype.size().unwrap() as usize;
        let mut bytes = vec![0u8; self.host.len() * size];
        device.read(self.view.buf, 0, &mut bytes).unwrap();
        let all = decode(self.view.dtype, &bytes);
        let (rows, cols) = (self.view.rows as usize, self.view.cols as usize);
        (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| all[self.offset + r * self.stride + c])
            .collect()
    }

    fn free(self, device: &Device) {
        device.free(self.view.buf).unwrap();
    }
}

fn upload_i32(device: &Device, values: &[i32]) -> BufferHandle {
    let buf = device.alloc((values.len() * 4) as u64).unwrap();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    device.write(buf, 0, &bytes).unwrap();
    buf
}

fn round(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        _ => f64::from(v as f32),
    }
}

fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    match dtype {
        DType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f64(*v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f64(*v).to_le_bytes())
            .collect(),
        _ => values
            .iter()
            .flat_map(|v| (*v as f32).to_le_bytes())
            .collect(),
    }
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
    }
}

fn act(activation: Activation, x: f64) -> f64 {
    match activation {
        Activation::GELU_ERF => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Activation::GELU_TANH => {
            0.5 * x * (1.0 + (0.7978845608028654 * (x + 0.044715 * x * x * x)).tanh())
        }
        Activation::QUICK_GELU => x / (1.0 + (-1.702 * x).exp()),
        Activation::SILU => x / (1.0 + (-x).exp()),
        _ => x,
    }
}

/// The error function in double precision: its Maclaurin series near 0, its continued fraction
/// beyond.
fn erf(x: f64) -> f64 {
    if x.abs() < 2.5 {
        // Maclaurin series.
        let (mut term, mut sum, x2) = (x, x, x * x);
        for n in 1..60 {
            term *= -x2 / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc by its continued fraction (Lentz), for |x| >= 2.5.
        let z = x.abs();
        let mut f = z;
        for n in (1..80).rev() {
            f = z + (n as f64 / 2.0) / f;
        }
        let erfc = (-z * z).exp() / (f * std::f64::consts::PI.sqrt());
        (1.0 - erfc).copysign(x)
    }
}

/// Fails unless every value is within the dtype's tolerance of the reference (`scale` grows
/// the tolerance with the length of a sum).
/// [`close`]'s check as a value: the first element outside the tolerance, named.
fn within(
    what: &str,
    dtype: DType,
    got: &[f64],
    expected: &[f64],
    scale: f64,
) -> Result<(), String> {
    if got.len() != expected.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            expected.len()
        ));
    }
    let tol = tolerance(dtype, scale);
    match got
        .iter()
        .zip(expected)
        // Written so that a NaN is outside.
        .position(|(g, e)| (g - e).abs().le(&(tol * (1.0 + e.abs()))).not())
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i}: got {}, expected {} (tolerance {tol})",
            got[i], expected[i]
        )),
    }
}

/// Units in the last place of `dtype` between two values representable in it (NaN: the most).
fn ulp_distance(dtype: DType, a: f64, b: f64) -> u32 {
    if a.is_nan() || b.is_nan() {
        return u32::MAX;
    }
    // Sign and magnitude bits to one ordered integer line.
    let ordered = |bits: u16| {
        if bits & 0x8000 != 0 {
            -i32::from(bits & 0x7fff)
        } else {
            i32::from(bits)
        }
    };
    let bits = |v: f64| match dtype {
        DType::F16 => f16::from_f64(v).to_bits(),
        _ => bf16::from_f64(v).to_bits(),
    };
    ordered(bits(a)).abs_diff(ordered(bits(b)))
}

fn tolerance(dtype: DType, scale: f64) -> f64 {
    (match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }) * scale.max(1.0).sqrt()
}

fn close(what: &str, dtype: DType, got: &[f64], expected: &[f64], scale: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let tol = tolerance(dtype, scale);
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= tol * (1.0 + e.abs()),
            "{what}: element {i}: got {g}, expected {e} (tolerance {tol})"
        );
    }
}

/// A small deterministic generator of values in `[-scale, scale)`.
struct Rng(u64);

impl Rng {
    fn values(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
            })
            .collect()
    }
}
