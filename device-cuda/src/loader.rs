//! Finding and opening the vendor libraries.
//!
//! - The driver, `libcuda.so.1`, is opened by cudarc (whose driver bindings the plugin uses),
//!   by name on the dynamic loader's path only: it belongs to the installed kernel driver. It is
//!   one file for every CUDA major. [`driver_present`] asks cudarc's own probe, which opens the
//!   names cudarc will use, so a driver reported present is one cudarc will find (cudarc panics
//!   on a missing library); [`driver_missing`] names what was tried. The toolkit's
//!   `lib64/stubs/libcuda.so` is a link-time stub whose every call fails; it is never searched.
//! - cuBLAS, cuBLASLt and NVRTC carry their CUDA major in their file names
//!   (`libcublas.so.12`, `libcublas.so.13`): [`open`] opens one library of one major, first
//!   from the install roots by absolute path, then by name on the loader's path. Only the
//!   versioned names are tried: every installation (toolkit, pip wheels, distribution packages)
//!   has them, while an unversioned `libcublas.so` link may point at any release.
//!   [`crate::libraries`] decides which major to load.
//! - cuDNN (optional: the fused attention of [`crate::cudnn`]) is `libcudnn.so.9` for either
//!   CUDA major, found the same way (pip's `nvidia-cudnn-cu12` and `nvidia-cudnn-cu13` wheels
//!   put it in `nvidia/cudnn/lib`); [`crate::cudnn`] checks which CUDA release it was built for.
//!
//! The install roots, in order: the folders of `IRIS_CUDA_LIB_PATH` (`:`-separated),
//! `$CUDA_HOME` and `$CUDA_PATH` (`lib64`, `lib`, `targets/<arch>-linux/lib`), and the
//! `nvidia/*/lib` folders of pip's `site-packages` and `dist-packages` under `$VIRTUAL_ENV`,
//! `$CONDA_PREFIX`, `~/.local` and the system's Python prefixes (`/usr/local/lib`, `/usr/lib`,
//! `/usr/lib64`). CUDA 12's wheels (`nvidia-cublas-cu12`, `nvidia-cuda-nvrtc-cu12`) put each
//! library in a folder of its own, `nvidia/cublas/lib`, `nvidia/cuda_nvrtc/lib`; CUDA 13's
//! (`nvidia-cublas`, PyTorch's cu130 wheels) put them all in `nvidia/cu13/lib`. Both match
//! `nvidia/*/lib`.
//!
//! A library opened by absolute path satisfies later lookups of its SONAME: cuBLAS's dependency
//! on cuBLASLt resolves to the cuBLASLt opened before it, wherever that was found.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::CudaError;

/// Environment variable with extra folders holding CUDA libraries, separated by `:`.
pub const LIB_PATH_ENV: &str = "IRIS_CUDA_LIB_PATH";

/// The cuDNN major whose library the plugin opens: 9, whose backend API has the fused attention
/// operation (from 9.13.1) the plugin builds.
pub const CUDNN_MAJOR: u32 = 9;

/// A vendor library the plugin uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// The driver API, `libcuda.so.1`.
    Driver,
    /// cuBLAS, `libcublas.so.<major>`.
    Cublas,
    /// cuBLASLt, `libcublasLt.so.<major>`.
    CublasLt,
    /// NVRTC, `libnvrtc.so.<major>`.
    Nvrtc,
    /// cuDNN, `libcudnn.so.9` for every CUDA major (its own major is in the name; which CUDA
    /// release it was built for, only its `cudnnGetCudartVersion` says).
    Cudnn,
}

impl Library {
    /// The base name of its files.
    fn stem(self) -> &'static str {
        match self {
            Library::Driver => "cuda",
            Library::Cublas => "cublas",
            Library::CublasLt => "cublasLt",
            Library::Nvrtc => "nvrtc",
            Library::Cudnn => "cudnn",
        }
    }

    /// Its file name in CUDA `major`'s libraries (the driver's is the same for every major).
    ///
    /// ```
    /// use iris_device_cuda::loader::Library;
    /// assert_eq!(Library::CublasLt.file_name(13), "libcublasLt.so.13");
    /// assert_eq!(Library::Driver.file_name(13), "libcuda.so.1");
    /// assert_eq!(Library::Cudnn.file_name(12), "libcudnn.so.9");
    /// ```
    pub fn file_name(self, major: u32) -> String {
        match self {
            Library::Driver => "libcuda.so.1".to_owned(),
            Library::Cudnn => format!("lib{}.so.{CUDNN_MAJOR}", self.stem()),
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
            Library::Cudnn => "cuDNN",
        }
    }
}

/// The names cudarc tries for the driver, in its order (each once).
pub fn driver_candidates() -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(Library::Driver.stem());
    let mut seen = std::collections::HashSet::new();
    names.retain(|name| seen.insert(name.clone()));
    names
}

/// Whether cudarc will find the driver. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: the probe only opens and closes candidate libraries with dlopen; opening the
    // driver runs no code of ours and has no precondition.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// `Ok` when the driver is present, else [`driver_missing`]'s error.
pub fn require_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(driver_missing())
    }
}

/// The error for a driver that is not found: the names tried.
pub fn driver_missing() -> CudaError {
    CudaError::LibraryMissing {
        library: Library::Driver.file_name(0),
        tried: format!(
            "names {} on the dynamic loader's path (LD_LIBRARY_PATH, ldconfig)",
            driver_candidates().join(", ")
        ),
    }
}

/// A library [`open`] opened, and where it was found.
#[derive(Debug)]
pub struct Opened {
    /// The open library; closed when dropped.
    pub library: libloading::Library,
    /// The absolute path it was opened from, or its file name when the loader's path had it.
    pub path: PathBuf,
}

/// Why [`open`] could not open a library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotOpened {
    /// No file of its name in the install roots nor on the loader's path.
    NotFound {
        /// Its file name, `libcublasLt.so.13`.
        file: String,
    },
    /// Found, but the dynamic loader refused it (a missing dependency, another architecture).
    Refused {
        /// Where it was found: an absolute path, or the file name on the loader's path.
        path: String,
        /// The dynamic loader's message.
        reason: String,
    },
}

impl fmt::Display for NotOpened {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotOpened::NotFound { file } => write!(f, "{file} not found"),
            NotOpened::Refused { path, reason } => write!(f, "{path} does not load ({reason})"),
        }
    }
}

/// Opens `library` of CUDA `major` (not the driver): from the install roots by absolute path,
/// else by name on the dynamic loader's path.
pub fn open(library: Library, major: u32) -> Result<Opened, NotOpened> {
    open_from(library, major, &search_roots(), true)
}

/// Opens `library` of CUDA `major` from the folder `dir` only. Tests use it to point the plugin
/// at a pip-installed NVRTC.
pub fn open_in(dir: &Path, library: Library, major: u32) -> Result<Opened, NotOpened> {
    open_from(library, major, &[dir.to_path_buf()], false)
}

/// What was searched, for messages: the loader's path and the install roots.
pub fn searched() -> String {
    let roots = search_roots();
    let mut text = "searched the dynamic loader's path (LD_LIBRARY_PATH, ldconfig)".to_owned();
    if roots.is_empty() {
        text.push_str(&format!(
            "; no install roots ({LIB_PATH_ENV}, CUDA_HOME, CUDA_PATH, pip's nvidia/*/lib) were found"
        ));
    } else {
        let shown: Vec<String> = roots
            .iter()
            .map(|root| root.display().to_string())
            .collect();
        text.push_str(&format!(" and the folders {}", shown.join(", ")));
    }
    text
}

fn open_from(
    library: Library,
    major: u32,
    roots: &[PathBuf],
    loader_path: bool,
) -> Result<Opened, NotOpened> {
    debug_assert!(library != Library::Driver, "cudarc opens the driver");
    let file = library.file_name(major);
    if let Some(path) = roots
        .iter()
        .map(|root| root.join(&file))
        .find(|path| path.is_file())
    {
        match library {
            Library::Nvrtc => open_siblings(&path, &format!("libnvrtc-builtins.so.{major}.")),
            Library::Cudnn => open_siblings(&path, "libcudnn_"),
            _ => {}
        }
        // SAFETY: a CUDA library found by its versioned name in an install root; opening it
        // runs only its initialisers.
        return match unsafe { libloading::Library::new(&path) } {
            Ok(opened) => Ok(Opened {
                library: opened,
                path,
            }),
            Err(err) => Err(NotOpened::Refused {
                path: path.display().to_string(),
                reason: err.to_string(),
            }),
        };
    }
    if !loader_path {
        return Err(NotOpened::NotFound { file });
    }
    // SAFETY: as above, found by name on the loader's path.
    match unsafe { libloading::Library::new(&file) } {
        Ok(opened) => Ok(Opened {
            library: opened,
            path: PathBuf::from(file),
        }),
        Err(err) => {
            let reason = err.to_string();
            // glibc's message when the file itself is not found; any other is the file refused
            // (cuBLAS whose cuBLASLt is missing names cuBLASLt here).
            if reason.starts_with(&format!("{file}: cannot open shared object file")) {
                Err(NotOpened::NotFound { file })
            } else {
                Err(NotOpened::Refused { path: file, reason })
            }
        }
    }
}

/// Opens, for the life of the process, the libraries beside `library` (found in an install
/// root) whose names start with `prefix`: NVRTC's builtins (`libnvrtc-builtins.so.<major>.*`),
/// cuDNN's sub-libraries (`libcudnn_graph.so.9`, its engines). Those libraries open them by
/// name through the loader's path only, which does not include the install roots; one already
/// open answers to its name.
fn open_siblings(library: &Path, prefix: &str) {
    let Some(dir) = library.parent() else {
        return;
    };
    let mut left: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|file| {
            file.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(prefix))
        })
        .collect();
    left.sort();
    // A second round for those that need one opened after them (their dependencies are found
    // by name too); any that still does not open is left to the library, which reports it.
    for _ in 0..2 {
        left.retain(|file| {
            // SAFETY: the library's own companion, found beside it; its initialisers only set
            // it up. It stays open for the life of the process (never unloaded).
            match unsafe { libloading::Library::new(file) } {
                Ok(library) => {
                    std::mem::forget(library);
                    false
                }
                Err(_) => true,
            }
        });
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_candidates_include_its_soname() {
        assert!(driver_candidates().contains(&"libcuda.so.1".to_owned()));
    }

    #[test]
    fn pip_layouts_are_found_under_a_prefix() {
        let dir = std::env::temp_dir().join(format!("iris-cuda-loader-{}", std::process::id()));
        let lib = dir.join("lib/python3.11/site-packages/nvidia/cublas/lib");
        std::fs::create_dir_all(&lib).unwrap();
        let roots = pip_nvidia_lib_dirs(&dir.join("lib"));
        assert_eq!(roots, vec![lib.clone()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debian_and_cu13_wheel_layouts_are_found_and_each_major_by_its_name() {
        let dir = std::env::temp_dir().join(format!("iris-cuda-layouts-{}", std::process::id()));
        // CUDA 13's wheels: every library in one `nvidia/cu13/lib`, here in Debian's
        // dist-packages.
        let lib = dir.join("lib/python3.12/dist-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        // Not a loadable library: found by name, then refused by the dynamic loader.
        std::fs::write(lib.join(Library::Nvrtc.file_name(13)), b"").unwrap();
        let roots = pip_nvidia_lib_dirs(&dir.join("lib"));
        assert_eq!(roots, vec![lib.clone()]);
        let thirteen = open_from(Library::Nvrtc, 13, &roots, false).unwrap_err();
        assert!(
            matches!(&thirteen, NotOpened::Refused { path, .. } if path.ends_with("cu13/lib/libnvrtc.so.13")),
            "{thirteen}"
        );
        assert_eq!(
            open_from(Library::Nvrtc, 12, &roots, false).unwrap_err(),
            NotOpened::NotFound {
                file: "libnvrtc.so.12".into()
            },
            "CUDA 12's name is not CUDA 13's"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_library_missing_from_the_loader_path_is_not_found() {
        let err = open_from(Library::CublasLt, 99, &[], true).unwrap_err();
        assert_eq!(err.to_string(), "libcublasLt.so.99 not found");
    }

    #[test]
    fn a_missing_driver_names_itself_and_what_was_tried() {
        let message = driver_missing().to_string();
        assert!(message.starts_with("libcuda.so.1 not found"), "{message}");
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
    }
}
