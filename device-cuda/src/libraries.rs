//! Which CUDA major's user-space libraries (cuBLAS, cuBLASLt, NVRTC) the process loads, and
//! loading them.
//!
//! The driver is one file for every major and the plugin calls its CUDA 12.4 API, which every
//! 12.x and 13.x driver runs. cuBLAS, cuBLASLt and NVRTC exist once per major
//! (`libcublas.so.12`, `libcublas.so.13`); the plugin calls them through its own tables
//! ([`crate::sys`]), whose entry points and types are the same in both, so one plugin runs over
//! either. It loads the libraries of one major, never a mix: cuBLAS and cuBLASLt of one release
//! are built for each other, and the kernels, their cache key and the architectures they are
//! compiled for follow the NVRTC of that same major.
//!
//! The rule, applied at the first `open` that needs the libraries ([`load`]):
//!
//! 1. CUDA 13 is a candidate when the driver runs it (13.0 or newer, R580+) and the device is
//!    compute capability 7.5 or newer (CUDA 13 dropped Maxwell, Pascal and Volta). CUDA 12 is
//!    always a candidate (the plugin needs a 12.0 driver and compute capability 7.0 anyway).
//! 2. Candidates are tried newest first: with a CUDA 13 driver both majors run, and the newer
//!    libraries know the newer GPUs (what PyTorch's cu130 wheels install).
//! 3. A major is usable when its cuBLAS and cuBLASLt open and report that major. The first
//!    usable major with its NVRTC wins; when none has NVRTC, the first usable one, whose
//!    kernels must then come from the kernel cache.
//!
//! The choice holds for the process (the libraries are never unloaded); a later device it does
//! not suit (a Volta beside Turing GPUs under CUDA 13) is refused with the reason.
//! [`CudaLibraries::summary`] says what was loaded and why each other major was not; it is the
//! device's `cuda_libraries` property, shown by `iris devices`.

use std::path::PathBuf;
use std::sync::Mutex;

use iris_plugin::Logger;

use crate::device::version_text;
use crate::error::CudaError;
use crate::loader::{self, Library, Opened};
use crate::result::{cublas, cublaslt, nvrtc};
use crate::sys;

/// The CUDA majors whose libraries the plugin loads, newest first (the order of preference).
pub const CUDA_MAJORS: [u32; 2] = [13, 12];

/// The oldest driver (as `cuDriverGetVersion` writes it) that runs CUDA `major`'s libraries:
/// the major's first release.
pub fn min_driver_version(major: u32) -> i32 {
    i32::try_from(major * 1000).unwrap_or(i32::MAX)
}

/// The oldest compute capability CUDA `major`'s libraries and NVRTC support: Volta with CUDA
/// 12, Turing from CUDA 13 on.
pub fn min_compute_capability(major: u32) -> (i32, i32) {
    if major >= 13 { (7, 5) } else { (7, 0) }
}

/// The majors to try, in order, for a driver of version `driver_version` and a device of
/// compute capability `cc`, and why each major left out is.
///
/// ```
/// use iris_device_cuda::libraries::preference;
/// assert_eq!(preference(13000, (9, 0)).0, vec![13, 12]);
/// let (order, left_out) = preference(12080, (9, 0));
/// assert_eq!(order, vec![12]);
/// assert_eq!(left_out[0].0, 13);
/// ```
pub fn preference(driver_version: i32, cc: (i32, i32)) -> (Vec<u32>, Vec<(u32, String)>) {
    let mut order = Vec::new();
    let mut left_out = Vec::new();
    for major in CUDA_MAJORS {
        let (min_cc, min_driver) = (min_compute_capability(major), min_driver_version(major));
        if driver_version < min_driver {
            left_out.push((
                major,
                format!(
                    "the driver supports CUDA {}, its libraries need {} or newer",
                    version_text(driver_version),
                    version_text(min_driver)
                ),
            ));
        } else if cc < min_cc {
            left_out.push((
                major,
                format!(
                    "compute capability {}.{} is below the {}.{} its libraries support",
                    cc.0, cc.1, min_cc.0, min_cc.1
                ),
            ));
        } else {
            order.push(major);
        }
    }
    (order, left_out)
}

/// The CUDA libraries of one major, loaded for the process.
#[derive(Debug)]
pub struct CudaLibraries {
    /// The CUDA major, 12 or 13.
    pub major: u32,
    /// cuBLAS's entry points.
    pub cublas: sys::Cublas,
    /// cuBLASLt's entry points.
    pub cublaslt: sys::CublasLt,
    /// cuBLAS's version, `(major, minor, patch)`.
    pub cublas_version: (i32, i32, i32),
    /// cuBLASLt's version, `major * 10000 + minor * 100 + patch`.
    pub cublaslt_version: usize,
    /// Where cuBLAS and cuBLASLt were opened from.
    pub paths: (PathBuf, PathBuf),
    /// NVRTC of the same major, or why it did not load (the kernels must then be cached).
    pub nvrtc: Result<Nvrtc, String>,
    /// Each other major and why it was not loaded.
    pub passed_over: Vec<(u32, String)>,
}

impl CudaLibraries {
    /// cuBLAS's version as a number, `major * 10000 + minor * 100 + patch` (130002 is 13.0.2),
    /// as `cublasGetVersion` reports it.
    pub fn cublas_version_number(&self) -> i64 {
        let (major, minor, patch) = self.cublas_version;
        i64::from(major) * 10_000 + i64::from(minor) * 100 + i64::from(patch)
    }

    /// What was loaded and why each other major was not, for `iris devices`: `CUDA 13 (cuBLAS
    /// 13.0.2, NVRTC 13.0); CUDA 12: not tried, ...`. Without this major's NVRTC a device opens
    /// only with cached kernels, which the text then says.
    pub fn summary(&self) -> String {
        let (major, minor, patch) = self.cublas_version;
        let mut text = format!("CUDA {} (cuBLAS {major}.{minor}.{patch}, ", self.major);
        match &self.nvrtc {
            Ok(nvrtc) => text.push_str(&format!("NVRTC {}.{})", nvrtc.version.0, nvrtc.version.1)),
            Err(why) => text.push_str(&format!("kernels from the cache without NVRTC: {why})")),
        }
        for (major, why) in &self.passed_over {
            text.push_str(&format!("; CUDA {major}: {why}"));
        }
        text
    }

    /// Where each library came from, for the log.
    fn origins(&self) -> String {
        let nvrtc = match &self.nvrtc {
            Ok(nvrtc) => format!(
                "NVRTC {}.{} ({})",
                nvrtc.version.0,
                nvrtc.version.1,
                nvrtc.path.display()
            ),
            Err(why) => format!("no NVRTC ({why})"),
        };
        format!(
            "cuBLAS {} ({}), cuBLASLt {} ({}), {nvrtc}",
            version_dotted(self.cublas_version_number()),
            self.paths.0.display(),
            version_dotted(i64::try_from(self.cublaslt_version).unwrap_or(i64::MAX)),
            self.paths.1.display()
        )
    }
}

/// NVRTC, loaded and checked.
#[derive(Debug)]
pub struct Nvrtc {
    /// Its entry points.
    pub lib: sys::Nvrtc,
    /// `(major, minor)`.
    pub version: (i32, i32),
    /// Where it was opened from.
    pub path: PathBuf,
}

impl Nvrtc {
    /// NVRTC of CUDA `major` from the folder `dir` (and no other place), checked to be of that
    /// major. Tests use it to compile the kernels with pip-installed NVRTCs of both majors.
    pub fn open_in(dir: &std::path::Path, major: u32) -> Result<Nvrtc, CudaError> {
        let opened = loader::open_in(dir, Library::Nvrtc, major).map_err(|err| {
            CudaError::LibraryMissing {
                library: Library::Nvrtc.file_name(major),
                tried: format!("{err}; searched {} only", dir.display()),
            }
        })?;
        Nvrtc::load(opened, major).map_err(CudaError::Unsupported)
    }

    /// Resolves NVRTC's table and checks its version's major against the file's.
    fn load(opened: Opened, major: u32) -> Result<Nvrtc, String> {
        let file = Library::Nvrtc.file_name(major);
        // SAFETY: the file is NVRTC, found by its versioned name.
        let lib = unsafe { sys::Nvrtc::load(opened.library) }
            .map_err(|err| format!("{file} lacks an entry point: {err}"))?;
        let version = nvrtc::version(&lib).map_err(|err| format!("{file}: nvrtcVersion: {err}"))?;
        if u32::try_from(version.0).ok() != Some(major) {
            return Err(format!(
                "{file} is NVRTC {}.{}, not CUDA {major}'s",
                version.0, version.1
            ));
        }
        Ok(Nvrtc {
            lib,
            version,
            path: opened.path,
        })
    }
}

/// The libraries of the process: loaded at the first call for a driver of `driver_version`
/// and a device of compute capability `cc`, by the rule of this module; later calls return
/// them, or refuse a device they do not support. A failed choice leaves nothing loaded, so a
/// later call tries again.
pub fn load(
    driver_version: i32,
    cc: (i32, i32),
    log: &Logger,
) -> Result<&'static CudaLibraries, CudaError> {
    static LOADED: Mutex<Option<&'static CudaLibraries>> = Mutex::new(None);
    // The value is a plain reference, consistent across a panic.
    let mut loaded = LOADED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(libraries) = *loaded {
        let min_cc = min_compute_capability(libraries.major);
        if cc < min_cc {
            return Err(CudaError::Unsupported(format!(
                "compute capability {}.{} is below the {}.{} of CUDA {}'s libraries, which this \
                 process loaded for a device opened earlier",
                cc.0, cc.1, min_cc.0, min_cc.1, libraries.major
            )));
        }
        return Ok(libraries);
    }
    let libraries = choose(driver_version, cc)?;
    log.info(format!(
        "CUDA {} libraries: {}{}",
        libraries.major,
        libraries.origins(),
        libraries
            .passed_over
            .iter()
            .map(|(major, why)| format!("; CUDA {major}: {why}"))
            .collect::<String>()
    ));
    // Never unloaded: handles and kernels made with them live as long as the plugin, which the
    // host never unloads either.
    let libraries: &'static CudaLibraries = Box::leak(Box::new(libraries));
    *loaded = Some(libraries);
    Ok(libraries)
}

/// Applies the rule of this module (see there).
fn choose(driver_version: i32, cc: (i32, i32)) -> Result<CudaLibraries, CudaError> {
    let (order, mut passed_over) = preference(driver_version, cc);
    let mut opened_files = Vec::new();
    let mut without_nvrtc: Option<CudaLibraries> = None;
    let mut chosen = None;
    for (index, &major) in order.iter().enumerate() {
        match open_major(major, &mut opened_files) {
            Ok(libraries) if libraries.nvrtc.is_ok() => {
                let driver = version_text(driver_version);
                for later in &order[index + 1..] {
                    passed_over.push((
                        *later,
                        format!("not tried, CUDA {major} comes first with a CUDA {driver} driver"),
                    ));
                }
                chosen = Some(libraries);
                break;
            }
            Ok(libraries) => match &without_nvrtc {
                None => without_nvrtc = Some(libraries),
                Some(first) => passed_over.push((
                    major,
                    format!(
                        "its NVRTC is missing too ({}); CUDA {} comes first",
                        libraries.nvrtc.err().unwrap_or_default(),
                        first.major
                    ),
                )),
            },
            Err(problems) => passed_over.push((major, problems.join(", "))),
        }
    }
    let mut libraries = match (chosen, without_nvrtc) {
        (Some(chosen), Some(skipped)) => {
            passed_over.push((
                skipped.major,
                format!(
                    "cuBLAS and cuBLASLt load but {}; CUDA {} has NVRTC",
                    skipped.nvrtc.err().unwrap_or_default(),
                    chosen.major
                ),
            ));
            chosen
        }
        (Some(chosen), None) | (None, Some(chosen)) => chosen,
        (None, None) => return Err(none_usable(&passed_over, &opened_files)),
    };
    // In the order of preference, as the rule reads.
    passed_over.sort_by_key(|(major, _)| std::cmp::Reverse(*major));
    libraries.passed_over = passed_over;
    Ok(libraries)
}

/// cuBLAS and cuBLASLt (required) and NVRTC (optional) of `major`, each checked to report that
/// major; or every problem found. Files that opened are added to `opened_files`.
fn open_major(
    major: u32,
    opened_files: &mut Vec<(Library, u32)>,
) -> Result<CudaLibraries, Vec<String>> {
    let mut problems = Vec::new();
    // cuBLASLt first: cuBLAS's dependency on it then resolves to this one.
    let lt = open_checked(Library::CublasLt, major, opened_files, |opened, file| {
        // SAFETY: the file is cuBLASLt, found by its versioned name.
        let lib = unsafe { sys::CublasLt::load(opened.library) }
            .map_err(|err| format!("{file} lacks an entry point: {err}"))?;
        let version = cublaslt::version(&lib);
        let number = i64::try_from(version).unwrap_or(i64::MAX);
        check_major(&file, "cuBLASLt", number, major)?;
        Ok((lib, version, opened.path))
    });
    let blas = open_checked(Library::Cublas, major, opened_files, |opened, file| {
        // SAFETY: the file is cuBLAS, found by its versioned name.
        let lib = unsafe { sys::Cublas::load(opened.library) }
            .map_err(|err| format!("{file} lacks an entry point: {err}"))?;
        let version = cublas::version(&lib)
            .map_err(|err| format!("{file}: cublasGetProperty failed: {err}"))?;
        let number =
            i64::from(version.0) * 10_000 + i64::from(version.1) * 100 + i64::from(version.2);
        check_major(&file, "cuBLAS", number, major)?;
        Ok((lib, version, opened.path))
    });
    let (lt, blas) = match (lt, blas) {
        (Ok(lt), Ok(blas)) => (lt, blas),
        (lt, blas) => {
            problems.extend(lt.err());
            problems.extend(blas.err());
            return Err(problems);
        }
    };
    let nvrtc = loader::open(Library::Nvrtc, major)
        .map_err(|err| err.to_string())
        .and_then(|opened| Nvrtc::load(opened, major));
    Ok(CudaLibraries {
        major,
        cublas: blas.0,
        cublaslt: lt.0,
        cublas_version: blas.1,
        cublaslt_version: lt.1,
        paths: (blas.2, lt.2),
        nvrtc,
        passed_over: Vec::new(),
    })
}

/// Opens `library` of `major` and finishes it with `load` (given the opened file and its
/// name), recording the file in `opened_files` when it opened.
fn open_checked<T>(
    library: Library,
    major: u32,
    opened_files: &mut Vec<(Library, u32)>,
    load: impl FnOnce(Opened, String) -> Result<T, String>,
) -> Result<T, String> {
    let file = library.file_name(major);
    match loader::open(library, major) {
        Ok(opened) => {
            opened_files.push((library, major));
            load(opened, file)
        }
        Err(err) => Err(err.to_string()),
    }
}

/// Refuses a library whose version (`major * 10000 + ...`) is of another major than its file
/// name: its entry points or their semantics may differ from what the name promises.
fn check_major(file: &str, title: &str, version: i64, major: u32) -> Result<(), String> {
    if version / 10_000 == i64::from(major) {
        Ok(())
    } else {
        Err(format!(
            "{file} is {title} {}, not CUDA {major}'s",
            version_dotted(version)
        ))
    }
}

/// `130002` as `13.0.2`.
fn version_dotted(version: i64) -> String {
    format!(
        "{}.{}.{}",
        version / 10_000,
        (version % 10_000) / 100,
        version % 100
    )
}

/// The error when no major is usable: each major's reasons, a hint when cuBLAS and cuBLASLt
/// were found but of different majors, and what was searched.
fn none_usable(passed_over: &[(u32, String)], opened_files: &[(Library, u32)]) -> CudaError {
    let mut text = String::from("no CUDA major's cuBLAS and cuBLASLt load: ");
    let reasons: Vec<String> = passed_over
        .iter()
        .map(|(major, why)| format!("CUDA {major}: {why}"))
        .collect();
    text.push_str(&reasons.join("; "));
    // A mix: cuBLAS and cuBLASLt were both found, but of no one major.
    let found = |library| opened_files.iter().any(|(found, _)| *found == library);
    let complete = CUDA_MAJORS.iter().any(|major| {
        opened_files.contains(&(Library::Cublas, *major))
            && opened_files.contains(&(Library::CublasLt, *major))
    });
    if found(Library::Cublas) && found(Library::CublasLt) && !complete {
        let files: Vec<String> = opened_files
            .iter()
            .map(|(library, major)| library.file_name(*major))
            .collect();
        text.push_str(&format!(
            "; the libraries found ({}) are of different CUDA majors: cuBLAS and cuBLASLt must \
             come from one CUDA release",
            files.join(", ")
        ));
    }
    text.push_str(&format!(" ({}; docs/CUDA.md)", loader::searched()));
    CudaError::Libraries(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_13_comes_first_where_the_driver_and_device_run_it() {
        assert_eq!(preference(13000, (9, 0)), (vec![13, 12], vec![]));
        assert_eq!(preference(13020, (7, 5)).0, vec![13, 12]);
        let (order, left_out) = preference(12080, (9, 0));
        assert_eq!(order, vec![12]);
        assert_eq!(
            left_out,
            vec![(
                13,
                "the driver supports CUDA 12.8, its libraries need 13.0 or newer".to_owned()
            )]
        );
        let (order, left_out) = preference(13000, (7, 0));
        assert_eq!(order, vec![12]);
        assert!(
            left_out[0].1.contains("7.0 is below the 7.5"),
            "{left_out:?}"
        );
    }

    #[test]
    fn versions_must_match_the_file_names_major() {
        assert_eq!(
            check_major("libcublas.so.13", "cuBLAS", 130_002, 13),
            Ok(())
        );
        assert_eq!(
            check_major("libcublas.so.13", "cuBLAS", 120_405, 13),
            Err("libcublas.so.13 is cuBLAS 12.4.5, not CUDA 13's".to_owned())
        );
    }

    #[test]
    fn two_complete_sets_that_fail_are_not_called_a_mix() {
        let err = none_usable(
            &[(13, "refused".into()), (12, "refused".into())],
            &[
                (Library::CublasLt, 13),
                (Library::Cublas, 13),
                (Library::CublasLt, 12),
                (Library::Cublas, 12),
            ],
        )
        .to_string();
        assert!(!err.contains("different CUDA majors"), "{err}");
    }

    #[test]
    fn mixed_majors_are_named_when_nothing_loads() {
        let err = none_usable(
            &[
                (13, "libcublas.so.13 not found".into()),
                (12, "libcublasLt.so.12 not found".into()),
            ],
            &[(Library::CublasLt, 13), (Library::Cublas, 12)],
        )
        .to_string();
        assert!(
            err.starts_with(
                "no CUDA major's cuBLAS and cuBLASLt load: CUDA 13: libcublas.so.13 not found; \
                 CUDA 12: libcublasLt.so.12 not found; the libraries found (libcublasLt.so.13, \
                 libcublas.so.12) are of different CUDA majors"
            ),
            "{err}"
        );
    }
}
