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
//!   `targets/<arch>-linux/lib`), and the `nvidia/*/lib` folders of pip's site-packages under
//!   `$VIRTUAL_ENV`, `$CONDA_PREFIX` and `~/.local` (where the `nvidia-cublas-cu12` and
//!   `nvidia-cuda-nvrtc-cu12` wheels put them).
//! - The driver (`libcuda.so.1`) is never preloaded: it belongs to the installed kernel driver
//!   and is found on the loader path only. The toolkit's `lib64/stubs/libcuda.so` is a link-time
//!   stub whose every call fails; it is never searched.
//!
//! When a library is missing, [`missing`] builds an error naming the library, the candidate
//! names cudarc tried and the folders searched.

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
    /// cuBLAS, `libcublas.so.12`.
    Cublas,
    /// cuBLASLt, `libcublasLt.so.12`.
    CublasLt,
    /// NVRTC, `libnvrtc.so.12`.
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
        match self {
            Library::Driver => "libcuda.so.1".to_owned(),
            _ => format!("lib{}.so.{}", self.stem(), cuda_major()),
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
        for library in [Library::CublasLt, Library::Cublas, Library::Nvrtc] {
            if let Some(path) = find_in_roots(library, &search_roots())
                && open_forever(&path)
            {
                loaded.push(path);
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
        .filter_map(|library| find_in_roots(library, &roots))
        .filter(|path| open_forever(path))
        .collect()
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
    for prefix in prefixes {
        roots.extend(pip_nvidia_lib_dirs(&prefix));
    }
    roots.retain(|root| root.is_dir());
    roots.dedup();
    roots
}

/// The `nvidia/*/lib` folders of every `python3*/site-packages` under `prefix`.
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
        let nvidia = python.join("site-packages/nvidia");
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

/// The CUDA major version this build's API feature names (12 for `cuda-12040`).
pub fn cuda_major() -> u32 {
    // The candidate list's `lib<name>.so.<major>` entry carries cudarc's compile-time major.
    12
}

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
    fn a_missing_library_names_itself_and_what_was_tried() {
        let message = missing(Library::Nvrtc).to_string();
        assert!(message.starts_with("libnvrtc.so.12 not found"), "{message}");
        assert!(message.contains("libnvrtc.so.12"), "{message}");
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
    }
}
