//! Helpers shared by the stand-in tests: building the stand-in libraries and running a scenario
//! in a child process with them first on `LD_LIBRARY_PATH` (the dynamic loader reads that
//! variable only at process start, and cudarc keeps the first driver it opened).

#![allow(dead_code)] // each test file uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub use iris_device_cuda::loader::Library;

/// Environment variable naming the scenario a child runs.
pub const SCENARIO_ENV: &str = "IRIS_STANDIN_SCENARIO";

/// Which libraries a child finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Libraries {
    /// No CUDA library at all.
    None,
    /// The stand-in driver alone: no kernels, no cuBLAS.
    Driver,
    /// The stand-in driver running the kernels on the CPU, and stand-in cuBLAS and cuBLASLt
    /// under CUDA 12's names (`libcublas.so.12`), reporting version 12.0.0.
    Full,
    /// The same driver with these stand-in libraries, in a folder of this name (one name per
    /// set).
    Installed(&'static str, &'static [Standin]),
    /// This machine's own CUDA installation, with the environment unchanged (GPU tests).
    System,
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
        Libraries::Installed(name, standins) => Some(installed_dir(name, standins)),
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

/// A function of a stand-in library (`library`, by its name), normally one the plugin has
/// loaded. The handle taken here is never closed, so the function stays valid.
///
/// # Safety
/// `F` must be the function's C signature.
unsafe fn standin_fn<F: Copy>(library: &str, symbol: &str) -> F {
    // SAFETY: by the caller's contract; the library stays loaded for the process's life.
    unsafe {
        let loaded = libloading::Library::new(library)
            .unwrap_or_else(|err| panic!("the stand-in {library}: {err}"));
        let function = *loaded
            .get::<F>(symbol.as_bytes())
            .unwrap_or_else(|err| panic!("{symbol} in {library}: {err}"));
        std::mem::forget(loaded);
        function
    }
}

/// A counter or last value of a stand-in library the plugin has loaded (`library`, by its
/// name), read through its `unsigned long long symbol(void)`.
fn standin_counter(library: &str, symbol: &str) -> u64 {
    // SAFETY: each counter symbol is an `unsigned long long (void)` function without side
    // effects, of a stand-in the plugin already opened.
    unsafe { standin_fn::<unsafe extern "C" fn() -> u64>(library, symbol)() }
}

/// Calls that needed the stand-in driver's context after its last release destroyed it.
pub fn standin_calls_after_teardown() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_calls_after_teardown")
}

/// Device and page-locked bytes the stand-in context's destruction freed (still allocated then).
pub fn standin_teardown_bytes() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_teardown_bytes")
}

/// Device memory the stand-in driver has allocated now.
pub fn standin_used_memory() -> u64 {
    standin_counter("libcuda.so.1", "iris_standin_used_memory")
}

/// Arms a fault in the stand-in driver: the `launches`th kernel launch from now faults (an
/// illegal address), and every later call in the context fails with the sticky error.
pub fn standin_fault_launch(launches: u64) {
    // SAFETY: the symbol is a `void (unsigned long long)` setter of the stand-in driver the
    // plugin already opened.
    unsafe {
        standin_fn::<unsafe extern "C" fn(u64)>("libcuda.so.1", "iris_standin_fault_launch")(
            launches,
        );
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

/// cuBLASLt set-up calls (descriptors, layouts, preferences, heuristics) the stand-in of
/// [`Libraries::Full`] made.
pub fn standin_lt_setups() -> u64 {
    standin_counter("libcublasLt.so.12", "iris_standin_lt_setups")
}

/// cuBLASLt matmuls the stand-in ran with a GELU epilogue.
pub fn standin_gelu_epilogues() -> u64 {
    standin_counter("libcublasLt.so.12", "iris_standin_gelu_epilogues")
}

/// Executions the stand-in cuDNN of [`Libraries::Full`] ran.
pub fn standin_cudnn_executes() -> u64 {
    standin_counter("libcudnn.so.9", "iris_standin_cudnn_executes")
}

/// Executions the stand-in cuDNN refused with an error status.
pub fn standin_cudnn_failed_executes() -> u64 {
    standin_counter("libcudnn.so.9", "iris_standin_cudnn_failed_executes")
}

/// Execution plans the stand-in cuDNN finalized.
pub fn standin_cudnn_plans() -> u64 {
    standin_counter("libcudnn.so.9", "iris_standin_cudnn_plans")
}

/// Execution plans whose finalizing began to wait on [`standin_cudnn_hold_plans`].
pub fn standin_cudnn_held_plans() -> u64 {
    standin_counter("libcudnn.so.9", "iris_standin_cudnn_held_plans")
}

/// Makes the stand-in cuDNN's execution plans wait in their finalizing (holding their handle)
/// while `on`.
pub fn standin_cudnn_hold_plans(on: bool) {
    // SAFETY: the stand-in cuDNN the plugin already opened; the symbol is a `void (int)`
    // function that stores its argument.
    unsafe {
        let loaded = libloading::Library::new("libcudnn.so.9")
            .unwrap_or_else(|err| panic!("the stand-in libcudnn.so.9: {err}"));
        let hold: libloading::Symbol<unsafe extern "C" fn(i32)> = loaded
            .get(b"iris_standin_cudnn_hold_plans")
            .unwrap_or_else(|err| panic!("iris_standin_cudnn_hold_plans: {err}"));
        hold(i32::from(on));
    }
}

/// cuDNN backend descriptors created and not destroyed, and handles likewise.
pub fn standin_cudnn_live() -> (u64, u64) {
    (
        standin_counter("libcudnn.so.9", "iris_standin_cudnn_live_descriptors"),
        standin_counter("libcudnn.so.9", "iris_standin_cudnn_live_handles"),
    )
}

/// The last reduction scheme mask the plugin set on a cuBLASLt preference (7 when none was).
pub fn standin_reduction_mask() -> u64 {
    standin_counter("libcublasLt.so.12", "iris_standin_reduction_mask")
}

/// The last math mode the plugin gave cuBLAS.
pub fn standin_math_mode() -> u64 {
    standin_counter("libcublas.so.12", "iris_standin_math_mode")
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

/// How many four-wide vector loads and stores the stand-in's emulator has run so far: tests
/// compare it before and after a launch to tell which of a kernel's paths ran.
pub fn standin_vector_accesses() -> u64 {
    // SAFETY: as in `standin_last_grid`; the symbol is its
    // `unsigned long long iris_standin_vector_accesses(void)`.
    unsafe {
        let driver = libloading::Library::new("libcuda.so.1").expect("the stand-in driver");
        let count: libloading::Symbol<unsafe extern "C" fn() -> u64> = driver
            .get(b"iris_standin_vector_accesses")
            .expect("the stand-in emulator's vector access count");
        count()
    }
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

fn standin_source(name: &str) -> PathBuf {
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

/// The driver version the stand-in reports by default: the plugin's driver API version, 12.4.
pub fn standin_driver_version() -> i32 {
    iris_device_cuda::device::DRIVER_API_VERSION
}

/// A driver version that runs CUDA 13's libraries, for `IRIS_STANDIN_DRIVER`.
pub const CUDA13_DRIVER: &str = "13000";

/// Options that open the emulated device with all ops: a kernel cache folder holding an entry
/// for compute capability `cc` (`80`) and driver version `driver`. The emulating stand-in
/// driver accepts any image and finds kernels by name, so no NVRTC is needed; without NVRTC the
/// plugin takes the entry of any NVRTC version.
pub fn emulated_kernels(cc: u32, driver: i32) -> Vec<(String, String)> {
    use iris_device_cuda::kernels::{Cache, Target};
    // Children share the folder: the cache writes a temporary file and renames it.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emulated-kernel-cache");
    Cache::new(Some(dir.clone()))
        .store(Target::Cubin(cc), driver, (12, 0), b"emulated")
        .unwrap();
    vec![("kernel_cache".to_owned(), dir.display().to_string())]
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
            &[standin_source("libcuda.c")],
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
            &[standin_source("libcuda.c")],
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
            &[standin_source("emu.cpp")],
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
        build_cublas(&dir, 12, 12);
        build_cudnn(&dir, 12);
        dir
    })
}

/// A stand-in cuDNN 9.17 built for CUDA `cuda_major` in `dir`, as `libcudnn.so.9`.
fn build_cudnn(dir: &Path, cuda_major: u32) {
    let cudart = format!("-DIRIS_STANDIN_CUDNN_CUDART={}", cuda_major * 1000 + 80);
    let name = Library::Cudnn.file_name(cuda_major);
    let soname = format!("-Wl,-soname,{name}");
    compile(
        &cc(),
        &[
            "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread", &soname, &cudart,
        ],
        &[standin_source("cudnn.c"), PathBuf::from("-lm")],
        &dir.join(name),
    );
}

/// A stand-in cuBLAS, cuBLASLt or NVRTC: the CUDA major of its file name and the major its
/// version reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standin {
    /// Which library.
    pub library: Library,
    /// `libcublas.so.<name_major>`.
    pub name_major: u32,
    /// The version's major (`<version_major>.0.0`).
    pub version_major: u32,
}

/// A stand-in named and versioned as CUDA `major`'s `library`.
pub const fn standin(library: Library, major: u32) -> Standin {
    Standin {
        library,
        name_major: major,
        version_major: major,
    }
}

/// The emulating driver and `standins` in the folder `name`.
fn installed_dir(name: &str, standins: &[Standin]) -> PathBuf {
    let built: Vec<PathBuf> = standins.iter().map(|s| built_standin(*s)).collect();
    prepared(name, |dir| {
        copy_emulator_driver(dir);
        for library in &built {
            install_copy(library, &dir.join(library.file_name().unwrap()));
        }
    })
}

/// A stand-in library, built once per process in a folder of its own kind.
fn built_standin(standin: Standin) -> PathBuf {
    let Standin {
        library,
        name_major,
        version_major,
    } = standin;
    let kind = format!("{}-{name_major}-v{version_major}", library.title());
    let dir = prepared(&kind, |dir| match library {
        Library::Cublas | Library::CublasLt => {
            build_cublas_as(dir, library, name_major, version_major);
        }
        Library::Nvrtc => {
            let name = library.file_name(name_major);
            let soname = format!("-Wl,-soname,{name}");
            let version = format!("-DIRIS_STANDIN_NVRTC_MAJOR={version_major}");
            compile(
                &cc(),
                &[
                    "-shared", "-fPIC", "-O1", "-Wall", "-Werror", &soname, &version,
                ],
                &[standin_source("nvrtc.c")],
                &dir.join(name),
            );
        }
        // cuDNN's file name has no CUDA major: `version_major` is the CUDA it was built for.
        Library::Cudnn => build_cudnn(dir, version_major),
        Library::Driver => panic!("the driver is not a stand-in set member"),
    });
    dir.join(library.file_name(name_major))
}

/// The folder `name`, filled by `fill` once per process (tests run on several threads).
fn prepared(name: &str, fill: impl FnOnce(&Path)) -> PathBuf {
    static DONE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let dir = target_dir(name);
    let mut done = DONE.lock().unwrap();
    if !done.iter().any(|finished| finished == name) {
        // Nothing left from an earlier run of another set under this name.
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        fill(&dir);
        done.push(name.to_owned());
    }
    dir
}

/// Copies the emulating stand-in driver into `dir` under both names cudarc tries.
fn copy_emulator_driver(dir: &Path) {
    let driver = emulator_driver();
    install_copy(&driver, &dir.join("libcuda.so.1"));
    install_copy(&driver, &dir.join("libcuda.so"));
}

/// Stand-in cuBLAS and cuBLASLt in `dir`, named `lib*.so.<name_major>`, reporting version
/// `<version_major>.0.0`.
fn build_cublas(dir: &Path, name_major: u32, version_major: u32) {
    for library in [Library::Cublas, Library::CublasLt] {
        build_cublas_as(dir, library, name_major, version_major);
    }
}

/// One stand-in of `tests/standin/cublas.c` (which has both libraries' entry points) in `dir`,
/// named as `library` of CUDA `name_major`, reporting version `<version_major>.0.0`.
fn build_cublas_as(dir: &Path, library: Library, name_major: u32, version_major: u32) {
    let version = format!("-DIRIS_STANDIN_CUBLAS_VERSION={}", version_major * 10_000);
    let name = library.file_name(name_major);
    let soname = format!("-Wl,-soname,{name}");
    compile(
        &cc(),
        &[
            "-shared", "-fPIC", "-O2", "-Wall", "-Werror", &soname, &version,
        ],
        &[standin_source("cublas.c"), PathBuf::from("-lm")],
        &dir.join(name),
    );
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
