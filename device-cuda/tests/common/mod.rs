//! Helpers shared by the stand-in tests: building the stand-in libraries and running a scenario
//! in a child process with them first on `LD_LIBRARY_PATH` (the dynamic loader reads that
//! variable only at process start, and cudarc keeps the first driver it opened).

#![allow(dead_code)] // each test file uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Environment variable naming the scenario a child runs.
pub const SCENARIO_ENV: &str = "IRIS_STANDIN_SCENARIO";

/// Which libraries a child finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Libraries {
    /// No CUDA library at all.
    None,
    /// The stand-in driver alone: no kernels, no cuBLAS.
    Driver,
    /// The stand-in driver running the kernels on the CPU, and stand-in cuBLAS and cuBLASLt.
    Full,
    /// This machine's own CUDA installation, with the environment unchanged (GPU tests).
    System,
    /// The stand-in driver with cuBLAS and cuBLASLt of the other CUDA major only.
    OtherMajor,
}

/// Runs `scenario` of the current test binary in a child and fails with its output unless it
/// passed.
pub fn run(scenario: &str, env: &[(&str, &str)], libraries: Libraries) {
    let output = child(scenario, env, libraries);
    assert!(
        output.status.success(),
        "scenario `{scenario}` failed:\n{}",
        text(&output)
    );
}

/// Runs `scenario` in a child and returns how it ended.
pub fn child(scenario: &str, env: &[(&str, &str)], libraries: Libraries) -> Output {
    let mut command = Command::new(std::env::current_exe().expect("test binary path"));
    command
        .args([
            "scenario",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO_ENV, scenario);
    let lib_dir = match libraries {
        Libraries::System => None,
        Libraries::None => Some(empty_dir()),
        Libraries::Driver => Some(driver_dir().to_path_buf()),
        Libraries::Full => Some(full_dir().to_path_buf()),
        Libraries::OtherMajor => Some(other_major_dir().to_path_buf()),
    };
    if let Some(lib_dir) = lib_dir {
        command
            .env("LD_LIBRARY_PATH", &lib_dir)
            // Keep the child away from this machine's CUDA installs: the scenarios describe a
            // driver and the libraries beside it, nothing else.
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("CUDA_HOME")
            .env_remove("CUDA_PATH")
            .env_remove("IRIS_CUDA_LIB_PATH")
            .env_remove("VIRTUAL_ENV")
            .env_remove("CONDA_PREFIX")
            .env("IRIS_CUDA_KERNEL_CACHE", "off");
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("the child runs")
}

/// A child's output for a failure message.
pub fn text(output: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Why the no-driver scenarios cannot run here: a real driver on the loader path.
pub fn system_driver() -> Option<String> {
    ["libcuda.so.1", "libcuda.so"].into_iter().find_map(|name| {
        // SAFETY: opening the system's CUDA driver runs only its initialisers.
        unsafe { libloading::Library::new(name) }.ok().map(|_| {
            format!("this machine has a CUDA driver ({name}); the no-driver case needs one without")
        })
    })
}

/// A counter of a stand-in library the plugin has loaded (`library`, by its name), read through
/// its `unsigned long long symbol(void)`.
fn standin_counter(library: &str, symbol: &str) -> u64 {
    // SAFETY: the library is a stand-in the plugin already opened; each counter symbol is an
    // `unsigned long long (void)` function without side effects.
    unsafe {
        let loaded = libloading::Library::new(library)
            .unwrap_or_else(|err| panic!("the stand-in {library}: {err}"));
        let counter: libloading::Symbol<unsafe extern "C" fn() -> u64> = loaded
            .get(symbol.as_bytes())
            .unwrap_or_else(|err| panic!("{symbol} in {library}: {err}"));
        counter()
    }
}

/// Memory pools the stand-in driver has not seen destroyed.
pub fn standin_live_pools() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_live_pools")
}

/// Synchronous device-to-host copies (`cuMemcpyDtoH`) the stand-in driver has made.
pub fn standin_blocking_reads() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_blocking_reads")
}

/// Device-to-device copies (`cuMemcpyDtoDAsync`) the stand-in driver has made.
pub fn standin_device_copies() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_device_copies")
}

/// cuBLASLt set-up calls (descriptors, layouts, preferences, heuristics) the stand-in made.
pub fn standin_lt_setups() -> u64 {
    standin_counter(
        &format!("libcublasLt.so.{}", cuda_major()),
        "iris_standin_lt_setups",
    )
}

/// The grid of the last kernel the stand-in driver's emulator ran.
pub fn standin_last_grid() -> [u32; 3] {
    let mut grid = [0u32; 3];
    // SAFETY: the stand-in driver is loaded (the plugin opened it); the symbol is its
    // `void iris_standin_last_grid(unsigned *out)`, which writes three values.
    unsafe {
        let driver = libloading::Library::new("libcuda.so.1").expect("the stand-in driver");
        let last: libloading::Symbol<unsafe extern "C" fn(*mut u32)> = driver
            .get(b"iris_standin_last_grid")
            .expect("the stand-in emulator's last grid");
        last(grid.as_mut_ptr());
    }
    grid
}

/// The plugin library cargo built beside the test binary.
pub fn plugin_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let name = "libiris_device_cuda.so";
    [deps.join(name), deps.parent().unwrap().join(name)]
        .into_iter()
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{name} is built next to {}", deps.display()))
}

fn standin(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/standin")
        .join(name)
}

/// Builds `output` through a temporary file and a rename, so that a child still running the
/// previous build keeps its mapped copy intact.
fn compile(compiler: &str, args: &[&str], inputs: &[PathBuf], output: &Path) {
    let partial = output.with_extension(format!("partial{}", std::process::id()));
    let status = Command::new(compiler)
        .args(args)
        .arg("-o")
        .arg(&partial)
        .args(inputs)
        .status()
        .unwrap_or_else(|err| panic!("{compiler} builds the stand-in libraries: {err}"));
    assert!(
        status.success(),
        "{compiler} failed to build {}",
        output.display()
    );
    std::fs::rename(&partial, output).unwrap();
}

/// Copies `from` to `to` through a temporary file and a rename (see [`compile`]).
fn install_copy(from: &Path, to: &Path) {
    let partial = to.with_extension(format!("partial{}", std::process::id()));
    std::fs::copy(from, &partial).unwrap();
    std::fs::rename(&partial, to).unwrap();
}

/// The driver version the stand-in reports by default: the plugin build's CUDA API version
/// (12.4, or 13.0 for the CUDA 13 build), which that build accepts.
pub fn standin_driver_version() -> i32 {
    iris_device_cuda::loader::cuda_api_version()
}

/// The `-D` define giving the stand-in driver its default version.
fn driver_define() -> String {
    format!("-DIRIS_STANDIN_DRIVER_DEFAULT={}", standin_driver_version())
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_owned())
}

fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned())
}

/// The stand-in driver as `libcuda.so.1` and `libcuda.so` (which cudarc tries first), built
/// once per process. Each test binary builds its own copy in its own folder.
fn driver_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = target_dir("driver");
        let library = dir.join("libcuda.so.1");
        compile(
            &cc(),
            &[
                "-shared",
                "-fPIC",
                "-O1",
                "-Wall",
                "-Werror",
                &driver_define(),
                "-Wl,-soname,libcuda.so.1",
            ],
            &[standin("libcuda.c")],
            &library,
        );
        install_copy(&library, &dir.join("libcuda.so"));
        dir
    })
}

/// The stand-in driver built with the kernel emulator (`libcuda.so.1` of the full set).
pub fn emulator_driver() -> PathBuf {
    full_dir().join("libcuda.so.1")
}

/// The stand-in driver with the kernel emulator, and stand-in cuBLAS and cuBLASLt.
fn full_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = target_dir("full");
        let driver_object = dir.join("libcuda.o");
        compile(
            &cc(),
            &[
                "-c",
                "-fPIC",
                "-O1",
                "-Wall",
                "-Werror",
                "-DIRIS_STANDIN_KERNELS",
                &driver_define(),
            ],
            &[standin("libcuda.c")],
            &driver_object,
        );
        let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let include = format!("-I{}", kernels.display());
        let emulator_object = dir.join("emu.o");
        compile(
            &cxx(),
            &[
                "-c",
                "-fPIC",
                "-O2",
                "-std=c++20",
                "-Wall",
                "-Werror",
                "-Wno-unknown-pragmas",
                &include,
            ],
            &[standin("emu.cpp")],
            &emulator_object,
        );
        let library = dir.join("libcuda.so.1");
        compile(
            &cxx(),
            &["-shared", "-pthread", "-Wl,-soname,libcuda.so.1"],
            &[driver_object, emulator_object],
            &library,
        );
        install_copy(&library, &dir.join("libcuda.so"));
        build_cublas(&dir, cuda_major(), cuda_major());
        dir
    })
}

/// The stand-in driver alone, beside stand-in cuBLAS and cuBLASLt named for the other CUDA
/// major than this build's: a host with only the other major's libraries.
pub fn other_major_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = target_dir("other-major");
        install_copy(
            &driver_dir().join("libcuda.so.1"),
            &dir.join("libcuda.so.1"),
        );
        install_copy(&driver_dir().join("libcuda.so.1"), &dir.join("libcuda.so"));
        build_cublas(&dir, other_major(), other_major());
        dir
    })
}

/// This build's CUDA major (12 or 13).
pub fn cuda_major() -> u32 {
    iris_device_cuda::loader::cuda_major()
}

/// The major of the plugin's other build.
pub fn other_major() -> u32 {
    if cuda_major() == 13 { 12 } else { 13 }
}

/// Stand-in cuBLAS and cuBLASLt in `dir`, named `lib*.so.<name_major>`, reporting version
/// `<version_major>.0.0`.
fn build_cublas(dir: &Path, name_major: u32, version_major: u32) {
    let version = format!("-DIRIS_STANDIN_CUBLAS_VERSION={}", version_major * 10_000);
    for stem in ["libcublas", "libcublasLt"] {
        let name = format!("{stem}.so.{name_major}");
        let soname = format!("-Wl,-soname,{name}");
        compile(
            &cc(),
            &[
                "-shared", "-fPIC", "-O2", "-Wall", "-Werror", &soname, &version,
            ],
            &[standin("cublas.c"), PathBuf::from("-lm")],
            &dir.join(name),
        );
    }
}

fn empty_dir() -> PathBuf {
    target_dir("empty")
}

fn target_dir(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let binary = exe.file_stem().unwrap().to_string_lossy().into_owned();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("standin-{binary}-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
