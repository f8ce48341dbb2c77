//! Finding the vendor libraries before cudarc touches them.
//!
//! cudarc opens each library by name (`dlopen("libcublas.so.12")`, ...) the first time one of its
//! functions is called, and panics when none of its candidate names opens. This module runs
//! first and makes that lookup both safe and wider:
//!
//! - [`present`] asks cudarc's own `is_culib_present` probe, which opens the same candidate
//!   names cudarc will use, so a library this module reports present is one cudarc will find.
//! - Before probing, [`preload`] opens the CUDA libraries found under install roots that are not
//!   on the dynamic loader's path, by absolute path, and keeps them open: the loader then finds
//!   them under their SONAME when cudarc asks by name. The roots, in order: the folders of
//!   `IRIS_CUDA_LIB_PATH` (`:`-separated), `$CUDA_HOME` and `$CUDA_PATH` (`lib64`, `lib`,
//!   `targets/<arch>-linux/lib`), and the `nvidia/*/lib` folders of pip's `site-packages` and
//!   `dist-packages` under `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local` and the system's Python
//!   prefixes (`/usr/local/lib`, `/usr/lib`, `/usr/lib64`). CUDA 12's wheels
//!   (`nvidia-cublas-cu12`, `nvidia-cuda-nvrtc-cu12`) put each library in a folder of its own,
//!   `nvidia/cublas/lib`, `nvidia/cuda_nvrtc/lib`; CUDA 13's (`nvidia-cublas`, PyTorch's cu130
//!   wheels) put them all in `nvidia/cu13/lib`. Both match `nvidia/*/lib`.
//! - The driver (`libcuda.so.1`) is never preloaded: it belongs to the installed kernel driver
//!   and is found on the loader path only. The toolkit's `lib64/stubs/libcuda.so` is a link-time
//!   stub whose every call fails; it is never searched.
//!
//! One build loads the libraries of one CUDA major ([`cuda_major`], the `cuda-12` or `cuda-13`
//! feature): cudarc names them by the major of its API version. When a library is missing,
//! [`missing`] builds an error naming the library, the candidate names cudarc tried, the folders
//! searched, and, when the other major's library is there instead, the build that loads it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::CudaError;

/// Environment variable with extra folders holding CUDA libraries, separated by `:`.
pub const LIB_PATH_ENV: &str = "IRIS_CUDA_LIB_PATH";

/// A vendor library the plugin uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    /// The driver API, `libcuda.so.1`.
    Driver,
    /// cuBLAS, `libcublas.so.<major>`.
    Cublas,
    /// cuBLASLt, `libcublasLt.so.<major>`.
    CublasLt,
    /// NVRTC, `libnvrtc.so.<major>`.
    Nvrtc,
}

impl Library {
    /// The base name cudarc builds its candidates from.
    fn stem(self) -> &'static str {
        match self {
            Library::Driver => "cuda",
            Library::Cublas => "cublas",
            Library::CublasLt => "cublasLt",
            Library::Nvrtc => "nvrtc",
        }
    }

    /// The file name people know it by, for messages.
    pub fn file_name(self) -> String {
        self.file_name_for(cuda_major())
    }

    /// The file name of this library in CUDA `major`'s user-space libraries.
    pub fn file_name_for(self, major: u32) -> String {
        match self {
            Library::Driver => "libcuda.so.1".to_owned(),
            _ => format!("lib{}.so.{major}", self.stem()),
        }
    }

    /// Its name in messages: `cuBLAS`, `NVRTC`...
    pub fn title(self) -> &'static str {
        match self {
            Library::Driver => "the CUDA driver",
            Library::Cublas => "cuBLAS",
            Library::CublasLt => "cuBLASLt",
            Library::Nvrtc => "NVRTC",
        }
    }

    /// The names cudarc tries, in its order (each once).
    pub fn candidates(self) -> Vec<String> {
        let mut names = cudarc::get_lib_name_candidates(self.stem());
        let mut seen = std::collections::HashSet::new();
        names.retain(|name| seen.insert(name.clone()));
        names
    }
}

/// Whether cudarc will find `library` (after [`preload`]). Never panics.
pub fn present(library: Library) -> bool {
    preload();
    // SAFETY: each probe only opens and closes candidate libraries with dlopen; opening a CUDA
    // library runs no code of ours and has no precondition.
    unsafe {
        match library {
            Library::Driver => cudarc::driver::sys::is_culib_present(),
            Library::Cublas => cudarc::cublas::sys::is_culib_present(),
            Library::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
            Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
        }
    }
}

/// `Ok` when `library` is present, else [`missing`]'s error.
pub fn require(library: Library) -> Result<(), CudaError> {
    if present(library) {
        Ok(())
    } else {
        Err(missing(library))
    }
}

/// The error for a library that is not found: its names and the folders searched.
pub fn missing(library: Library) -> CudaError {
    let mut tried = format!(
        "names {} on the dynamic loader's path (LD_LIBRARY_PATH, ldconfig)",
        library.candidates().join(", ")
    );
    if library != Library::Driver {
        let roots = search_roots();
        if roots.is_empty() {
            tried.push_str(&format!(
                "; no install roots ({LIB_PATH_ENV}, CUDA_HOME, CUDA_PATH, pip's nvidia/*/lib) were found"
            ));
        } else {
            let shown: Vec<String> = roots
                .iter()
                .map(|root| root.display().to_string())
                .collect();
            tried.push_str(&format!("; folders {}", shown.join(", ")));
        }
        if let Some(found) = other_major(library) {
            tried.push_str(&format!(
                "; {} is there instead: this is the plugin's CUDA {} build, the CUDA {} build \
                 (`--features cuda-{}`) loads it (docs/CUDA.md)",
                found.display(),
                cuda_major(),
                OTHER_MAJOR,
                OTHER_MAJOR
            ));
        }
    }
    CudaError::LibraryMissing {
        library: library.file_name(),
        tried,
    }
}

/// Opens, once per process, the CUDA libraries found under the install roots, by absolute path,
/// and keeps them open for the life of the process. Returns the files opened.
pub fn preload() -> &'static [PathBuf] {
    static LOADED: OnceLock<Vec<PathBuf>> = OnceLock::new();
    LOADED.get_or_init(|| {
        let mut loaded = Vec::new();
        // cuBLAS needs cuBLASLt: open it first so cuBLAS's dependency resolves to it.
        let roots = search_roots();
        for library in [Library::CublasLt, Library::Cublas, Library::Nvrtc] {
            if let Some(path) = find_in_roots(library, &roots) {
                loaded.extend(open_with_companions(library, &path));
            }
        }
        loaded
    })
}

/// Opens the CUDA libraries (cuBLAS, cuBLASLt, NVRTC) found in `dir` by absolute path and keeps
/// them open, as [`preload`] does for the install roots. Returns the files opened. Tests use it
/// to point the plugin at a pip-installed NVRTC.
pub fn preload_from(dir: &Path) -> Vec<PathBuf> {
    let roots = [dir.to_path_buf()];
    [Library::CublasLt, Library::Cublas, Library::Nvrtc]
        .into_iter()
        .filter_map(|library| find_in_roots(library, &roots).map(|path| (library, path)))
        .flat_map(|(library, path)| open_with_companions(library, &path))
        .collect()
}

/// Opens `path` (a `library` found in an install root) and keeps it open, after the libraries
/// it opens by name at run time from its own folder: NVRTC 13 opens
/// `libnvrtc-builtins.so.13.<minor>` through the loader's path only, so when NVRTC itself was
/// found in an install root its builtins must be loaded first. Returns the files opened.
fn open_with_companions(library: Library, path: &Path) -> Vec<PathBuf> {
    let mut opened = Vec::new();
    if library == Library::Nvrtc
        && let Some(dir) = path.parent()
    {
        let prefix = format!("libnvrtc-builtins.so.{}.", cuda_major());
        let mut builtins: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .filter(|file| {
                file.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name.starts_with(&prefix))
            })
            .collect();
        builtins.sort();
        opened.extend(builtins.into_iter().filter(|file| open_forever(file)));
    }
    if open_forever(path) {
        opened.push(path.to_path_buf());
    }
    opened
}

/// Where `library` of the other CUDA major is, if it is in an install root or on the loader's
/// path, for the hint of [`missing`].
pub fn other_major(library: Library) -> Option<PathBuf> {
    let name = library.file_name_for(OTHER_MAJOR);
    if let Some(path) = search_roots()
        .iter()
        .map(|root| root.join(&name))
        .find(|path| path.is_file())
    {
        return Some(path);
    }
    // SAFETY: opening a CUDA library runs only its initialisers; it is closed again at once.
    unsafe { libloading::Library::new(&name) }
        .ok()
        .map(|_| PathBuf::from(name))
}

/// The folders searched for cuBLAS, cuBLASLt and NVRTC beside the loader path, in order.
pub fn search_roots() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    let mut roots = Vec::new();
    if let Some(paths) = env(LIB_PATH_ENV) {
        roots.extend(std::env::split_paths(&paths));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env(var) {
            let home = PathBuf::from(home);
            roots.push(home.join("lib64"));
            roots.push(home.join("lib"));
            roots.push(home.join(format!("targets/{}-linux/lib", std::env::consts::ARCH)));
        }
    }
    let mut prefixes = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var) {
            prefixes.push(PathBuf::from(prefix).join("lib"));
        }
    }
    if let Some(home) = env("HOME") {
        prefixes.push(PathBuf::from(home).join(".local/lib"));
    }
    // The system's Python: pip run as root, or a distribution's python3-* packages.
    prefixes.extend(SYSTEM_PYTHON_PREFIXES.iter().map(PathBuf::from));
    for prefix in prefixes {
        roots.extend(pip_nvidia_lib_dirs(&prefix));
    }
    roots.retain(|root| root.is_dir());
    roots.dedup();
    roots
}

/// The `lib` folders of the system's Python installations, searched after the user's.
pub const SYSTEM_PYTHON_PREFIXES: [&str; 3] = ["/usr/local/lib", "/usr/lib", "/usr/lib64"];

/// The `nvidia/*/lib` folders of every `python3*/site-packages` and `python3*/dist-packages`
/// (Debian's name) under `prefix`.
fn pip_nvidia_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let Ok(entries) = std::fs::read_dir(prefix) else {
        return dirs;
    };
    let mut pythons: Vec<PathBuf> = entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("python3"))
        })
        .collect();
    pythons.sort();
    for python in pythons {
        for packages in ["site-packages", "dist-packages"] {
            let nvidia = python.join(packages).join("nvidia");
            let Ok(packages) = std::fs::read_dir(&nvidia) else {
                continue;
            };
            let mut libs: Vec<PathBuf> = packages
                .flatten()
                .map(|entry| entry.path().join("lib"))
                .filter(|lib| lib.is_dir())
                .collect();
            libs.sort();
            dirs.extend(libs);
        }
    }
    dirs
}

/// The first file in `roots` named like one of `library`'s candidates.
fn find_in_roots(library: Library, roots: &[PathBuf]) -> Option<PathBuf> {
    let names = library.candidates();
    roots.iter().find_map(|root| {
        names
            .iter()
            .map(|name| root.join(name))
            .find(|path| path.is_file())
    })
}

/// Opens `path` with the dynamic loader and never closes it. Returns whether it opened.
fn open_forever(path: &Path) -> bool {
    // SAFETY: the file is a CUDA library found by name in an install root; its initialisers
    // only set up the library. It stays open for the life of the process (never unloaded).
    match unsafe { libloading::Library::new(path) } {
        Ok(library) => {
            std::mem::forget(library);
            true
        }
        Err(_) => false,
    }
}

/// The CUDA major whose user-space libraries this build loads: 12 with the `cuda-12` feature
/// (cudarc's CUDA 12.4 API), 13 with `cuda-13` (CUDA 13.0). cudarc builds its candidate names
/// (`libcublas.so.<major>`) from it.
pub const fn cuda_major() -> u32 {
    CUDA_MAJOR
}

/// The CUDA API version of this build's bindings, as `cuDriverGetVersion` writes versions.
pub const fn cuda_api_version() -> i32 {
    if CUDA_MAJOR == 13 { 13000 } else { 12040 }
}

#[cfg(feature = "cuda-13")]
const CUDA_MAJOR: u32 = 13;
#[cfg(not(feature = "cuda-13"))]
const CUDA_MAJOR: u32 = 12;
/// The major of the plugin's other build, named in hints.
const OTHER_MAJOR: u32 = if CUDA_MAJOR == 13 { 12 } else { 13 };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_include_the_versioned_sonames() {
        assert!(
            Library::Driver
                .candidates()
                .contains(&"libcuda.so.1".to_owned())
        );
        let major = cuda_major();
        assert!(
            Library::Nvrtc
                .candidates()
                .contains(&format!("libnvrtc.so.{major}"))
        );
        assert!(
            Library::CublasLt
                .candidates()
                .contains(&format!("libcublasLt.so.{major}"))
        );
    }

    #[test]
    fn pip_layouts_are_found_under_a_prefix() {
        let dir = std::env::temp_dir().join(format!("iris-cuda-loader-{}", std::process::id()));
        let lib = dir.join("lib/python3.11/site-packages/nvidia/cublas/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcublasLt.so.12"), b"").unwrap();
        let roots = pip_nvidia_lib_dirs(&dir.join("lib"));
        assert_eq!(roots, vec![lib.clone()]);
        assert_eq!(
            find_in_roots(Library::CublasLt, &roots),
            Some(lib.join("libcublasLt.so.12"))
        );
        assert_eq!(find_in_roots(Library::Nvrtc, &roots), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debian_and_cu13_wheel_layouts_are_found() {
        let dir = std::env::temp_dir().join(format!("iris-cuda-layouts-{}", std::process::id()));
        // CUDA 13's wheels: every library in one `nvidia/cu13/lib`, here in Debian's
        // dist-packages.
        let lib = dir.join("lib/python3.12/dist-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        for library in [Library::Cublas, Library::CublasLt, Library::Nvrtc] {
            std::fs::write(lib.join(library.file_name_for(13)), b"").unwrap();
        }
        let roots = pip_nvidia_lib_dirs(&dir.join("lib"));
        assert_eq!(roots, vec![lib.clone()]);
        let found = find_in_roots(Library::Nvrtc, &roots);
        if cuda_major() == 13 {
            assert_eq!(found, Some(lib.join("libnvrtc.so.13")));
        } else {
            assert_eq!(found, None, "a CUDA 12 build does not take CUDA 13's NVRTC");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_library_names_itself_and_what_was_tried() {
        let message = missing(Library::Nvrtc).to_string();
        let name = format!("libnvrtc.so.{}", cuda_major());
        assert!(
            message.starts_with(&format!("{name} not found")),
            "{message}"
        );
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
    }
}
