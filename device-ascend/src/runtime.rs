//! Finding and opening CANN's libraries, once per process: the runtime, the aclnn base and the
//! op libraries, with `aclInit` called once.
//!
//! Search order (CANN's own scripts search the install roots in this order): the install
//! roots named by `$ASCEND_INSTALL_PATH`, `$ASCEND_HOME_PATH` and `$ASCEND_TOOLKIT_HOME`, and
//! the root above `$ASCEND_OPP_PATH` (its `opp/` folder; CANN's build scripts take the
//! package root from it the same way); then the folders of `$LD_LIBRARY_PATH`; then
//! `~/Ascend/cann`, `~/Ascend/ascend-toolkit/latest`, `/usr/local/Ascend/cann`,
//! `/usr/local/Ascend/ascend-toolkit/latest` and `/opt/Ascend/cann`; and last the dynamic
//! loader's own search (`ld.so.cache`). Each root is searched in `lib64/` and in
//! `<arch>-linux/lib64/` (`aarch64-linux`, `x86_64-linux`), where CANN's toolkit packages put
//! the real files. The runtime is `libacl_rt.so`, or `libascendcl.so` on CANN releases before
//! the split; the folder it came from is searched first for the other libraries.
//!
//! Every runtime file found is a candidate, in that order: one that answers `aclInit` with
//! 100039 (`ACL_ERROR_COMPILING_STUB_MODE`, the SDK's link stubs, which often sit on
//! `LD_LIBRARY_PATH` before the driver's runtime) is skipped and the search goes on; the
//! files skipped are reported ([`Runtime::skipped`]) and make the probe's reason when no
//! real runtime follows.
//!
//! Ops are resolved one by one (the `aclnn!` macro): in the split op libraries of CANN 8.5 and
//! later (`libopapi_math.so`, `libopapi_nn.so`, `libopapi_transformer.so`), then in the single
//! `libopapi.so` (every op, CANN 7.0 to 8.x; deprecated from 9.0), then in the feature
//! libraries of CANN 7.x to 8.3 (`libaclnn_ops_infer.so`, `libaclnn_ops_train.so`,
//! `libaclnn_math.so`, `libaclnn_rand.so`; deprecated from 8.5). A missing op makes that op
//! unsupported, never a failure to load.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::AscendError;
use crate::result::{AclError, AclnnStatus};
use crate::sys;
use crate::sys::nnopbase::NnopBase;
use crate::sys::opapi::OpApi;
use crate::sys::runtime::AclRuntime;

/// Runtime library names, newest first.
pub const RUNTIME_LIBRARIES: [&str; 2] = ["libacl_rt.so", "libascendcl.so"];
/// The aclnn base library (tensors, scalars, arrays, executors).
pub const NNOPBASE_LIBRARY: &str = "libnnopbase.so";
/// Op libraries in resolution order: CANN 8.5's split libraries, the single library of
/// CANN 7.0 to 8.x, then the feature libraries of CANN 7.x to 8.3.
pub const OP_LIBRARIES: [&str; 8] = [
    "libopapi_math.so",
    "libopapi_nn.so",
    "libopapi_transformer.so",
    "libopapi.so",
    "libaclnn_ops_infer.so",
    "libaclnn_ops_train.so",
    "libaclnn_math.so",
    "libaclnn_rand.so",
];
/// Variables naming CANN install roots, searched first, in this order.
pub const ROOT_ENVS: [&str; 3] = [
    "ASCEND_INSTALL_PATH",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
];
/// The operator package folder (`<root>/opp`) of an install; its parent is an install root.
pub const OPP_PATH_ENV: &str = "ASCEND_OPP_PATH";
/// Which physical NPUs the runtime shows, as `CUDA_VISIBLE_DEVICES` does for CUDA. The runtime
/// itself applies it; iris reports it.
pub const VISIBLE_DEVICES_ENV: &str = "ASCEND_RT_VISIBLE_DEVICES";

/// Default install roots after the environment's, in CANN's order; `~` is the home folder.
const DEFAULT_ROOTS: [&str; 5] = [
    "~/Ascend/cann",
    "~/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/opt/Ascend/cann",
];

/// Resolves one aclnn op (both phases) in the op libraries: an [`OpFns`](crate::ops::OpFns),
/// or an [`AscendError::MissingSymbol`] naming the libraries searched. `$rt` is a [`Runtime`].
macro_rules! aclnn {
    ($rt:expr, $ws:ident, $run:ident) => {{
        let rt: &$crate::runtime::Runtime = $rt;
        rt.ops()
            .iter()
            .find_map(|lib| match (lib.api.$ws.as_ref(), lib.api.$run.as_ref()) {
                (Ok(ws), Ok(run)) => Some($crate::ops::OpFns {
                    get_workspace: *ws,
                    run: *run,
                    ws_name: stringify!($ws),
                    name: stringify!($run),
                    library: lib.name,
                }),
                _ => None,
            })
            .ok_or_else(|| rt.missing_op(stringify!($run)))
    }};
}
pub(crate) use aclnn;

/// A library and where it was opened from.
pub struct Lib<T> {
    /// The generated table of the library's functions.
    pub api: T,
    /// The file name searched for (`libopapi_nn.so`).
    pub name: &'static str,
    /// The file opened.
    pub path: PathBuf,
}

/// The folders searched for CANN's libraries, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPath {
    /// Folders, without duplicates.
    pub dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// The search path this process's environment describes.
    pub fn from_env() -> SearchPath {
        let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
        let home = var("HOME").map(PathBuf::from);
        let mut roots: Vec<PathBuf> = ROOT_ENVS
            .iter()
            .filter_map(|env| var(env).map(PathBuf::from))
            .collect();
        if let Some(opp) = var(OPP_PATH_ENV) {
            // `<root>/opp` (or `<root>/opp/`): the root is the folder above.
            if let Some(root) = Path::new(&opp).parent() {
                roots.push(root.to_path_buf());
            }
        }
        let mut dirs: Vec<PathBuf> = Vec::new();
        for root in &roots {
            dirs.extend(root_dirs(root));
        }
        if let Some(paths) = var("LD_LIBRARY_PATH") {
            dirs.extend(std::env::split_paths(&paths).filter(|dir| !dir.as_os_str().is_empty()));
        }
        for root in DEFAULT_ROOTS {
            let root = match (root.strip_prefix("~/"), &home) {
                (Some(rest), Some(home)) => home.join(rest),
                (Some(_), None) => continue,
                (None, _) => PathBuf::from(root),
            };
            dirs.extend(root_dirs(&root));
        }
        let mut unique: Vec<PathBuf> = Vec::with_capacity(dirs.len());
        for dir in dirs {
            if !unique.contains(&dir) {
                unique.push(dir);
            }
        }
        SearchPath { dirs: unique }
    }

    /// The folders as one line for messages.
    pub fn describe(&self) -> String {
        self.dirs
            .iter()
            .map(|dir| dir.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Every file of `names` in the folders, `first` (when given) before the path, in search
    /// order; then the bare names, for the dynamic loader's own search.
    fn candidates(&self, names: &[&'static str], first: Option<&Path>) -> Vec<Candidate> {
        let dirs = first
            .into_iter()
            .chain(self.dirs.iter().map(PathBuf::as_path));
        let mut found = Vec::new();
        for dir in dirs {
            for name in names {
                let path = dir.join(name);
                if path.is_file() {
                    found.push(Candidate { name, path });
                }
            }
        }
        found.extend(names.iter().map(|name| Candidate {
            name,
            path: PathBuf::from(name),
        }));
        found
    }

    /// Opens the first of `names` found, searching `first` (when given) before the path, and
    /// the dynamic loader's own search last. `Ok(None)` when no file exists; `Err` with the
    /// loader's message when one exists but does not open.
    fn open(
        &self,
        names: &[&'static str],
        first: Option<&Path>,
    ) -> Result<Option<(libloading::Library, &'static str, PathBuf)>, String> {
        let mut failures = Vec::new();
        for candidate in self.candidates(names, first) {
            match candidate.open() {
                Ok(lib) => return Ok(Some((lib, candidate.name, candidate.path))),
                Err(Some(err)) => failures.push(err),
                Err(None) => {}
            }
        }
        if failures.is_empty() {
            Ok(None)
        } else {
            Err(failures.join("; "))
        }
    }
}

/// `<root>/lib64` and `<root>/<arch>-linux/lib64`, where CANN's toolkit keeps the files the
/// `lib64` folder links to.
fn root_dirs(root: &Path) -> [PathBuf; 2] {
    [
        root.join("lib64"),
        root.join(format!("{}-linux", std::env::consts::ARCH))
            .join("lib64"),
    ]
}

/// A library file to try: a path in a search folder, or a bare name for the dynamic loader.
struct Candidate {
    name: &'static str,
    path: PathBuf,
}

impl Candidate {
    /// Whether this is a bare name, left to the dynamic loader's search.
    fn is_bare(&self) -> bool {
        self.path.as_os_str() == self.name
    }

    /// Opens the library. `Err(None)` when a bare name is not on the loader's path (not a
    /// failure: the file simply is not there); `Err(Some(..))` with the loader's message when
    /// a file exists but does not open.
    fn open(&self) -> Result<libloading::Library, Option<String>> {
        // SAFETY: opening a library runs its initialisers; CANN's libraries (and the
        // emulation) are ordinary shared objects meant to be opened this way. A bare name
        // lets the dynamic loader search ld.so.cache.
        match unsafe { libloading::Library::new(&self.path) } {
            Ok(lib) => Ok(lib),
            Err(_) if self.is_bare() => Err(None),
            Err(err) => Err(Some(format!("{}: {err}", self.path.display()))),
        }
    }

    /// The file for messages.
    fn describe(&self) -> String {
        if self.is_bare() {
            format!("{} (on the dynamic loader's path)", self.name)
        } else {
            self.path.display().to_string()
        }
    }
}

/// The loaded libraries of this process, `aclInit` done.
pub struct Runtime {
    acl: Lib<AclRuntime>,
    nnopbase: Result<Lib<NnopBase>, String>,
    ops: Vec<Lib<OpApi>>,
    search: SearchPath,
    skipped: Vec<String>,
}

/// Why there is no runtime in this process (the probe's reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoRuntime(pub String);

static RUNTIME: OnceLock<Result<Runtime, NoRuntime>> = OnceLock::new();

impl Runtime {
    /// The process's runtime, loaded and initialised on first use. Later calls return the
    /// same answer: libraries are never unloaded and `aclInit` runs once per process.
    pub fn get() -> Result<&'static Runtime, NoRuntime> {
        RUNTIME
            .get_or_init(|| Runtime::load(SearchPath::from_env()))
            .as_ref()
            .map_err(Clone::clone)
    }

    fn load(search: SearchPath) -> Result<Runtime, NoRuntime> {
        let mut failures = Vec::new();
        let mut skipped = Vec::new();
        let mut found = None;
        for candidate in search.candidates(&RUNTIME_LIBRARIES, None) {
            let library = match candidate.open() {
                Ok(library) => library,
                Err(Some(err)) => {
                    failures.push(err);
                    continue;
                }
                Err(None) => continue,
            };
            // SAFETY: `from_library` only resolves symbols; the library stays open in the table.
            let api = match unsafe { AclRuntime::from_library(library) } {
                Ok(api) => api,
                Err(err) => {
                    failures.push(format!("{}: {err}", candidate.describe()));
                    continue;
                }
            };
            let Ok(init) = api.aclInit.as_ref() else {
                failures.push(format!(
                    "{} is not an AscendCL runtime: it does not export aclInit",
                    candidate.describe()
                ));
                continue;
            };
            // SAFETY: aclInit takes an optional config path; null means none.
            let code = AclError(unsafe { init(std::ptr::null()) });
            if code == AclError::STUB_MODE {
                // The SDK's link stubs: the driver's runtime may come later in the search.
                skipped.push(candidate.describe());
                continue;
            }
            found = Some((api, candidate, code));
            break;
        }
        let Some((api, candidate, code)) = found else {
            return Err(NoRuntime(if !skipped.is_empty() {
                let mut reason = stub_reason(&skipped.join(", "), "aclInit");
                if !failures.is_empty() {
                    reason.push_str(&format!("; also could not open {}", failures.join("; ")));
                }
                reason
            } else if !failures.is_empty() {
                format!("cannot open {}", failures.join("; "))
            } else {
                format!(
                    "{} not found in: {} (nor {}, nor on the dynamic loader's path); install CANN or set ASCEND_HOME_PATH",
                    RUNTIME_LIBRARIES[0],
                    search.describe(),
                    RUNTIME_LIBRARIES[1]
                )
            }));
        };
        let acl = Lib {
            api,
            name: candidate.name,
            path: candidate.path,
        };
        // Another library of this process (torch_npu, a second plugin copy) may have
        // initialised AscendCL already: that is the state we want.
        if code.0 != sys::ACL_SUCCESS && code != AclError::REPEAT_INITIALIZE {
            return Err(NoRuntime(format!(
                "aclInit failed in {}: {code}{}",
                acl.path.display(),
                recent_message(&acl.api)
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default()
            )));
        }
        let dir = acl.path.parent().map(Path::to_path_buf);
        let nnopbase = match search.open(&[NNOPBASE_LIBRARY], dir.as_deref()) {
            // SAFETY: as for the runtime.
            Ok(Some((library, name, path))) => unsafe { NnopBase::from_library(library) }
                .map(|api| Lib { api, name, path })
                .map_err(|err| err.to_string()),
            Ok(None) => Err(format!(
                "{NNOPBASE_LIBRARY} not found in: {}",
                search.describe()
            )),
            Err(failures) => Err(format!("cannot open {failures}")),
        };
        let mut ops = Vec::new();
        for name in OP_LIBRARIES {
            // A missing op library is normal (split or legacy, never both); a broken one only
            // loses its ops, reported by `missing_op`.
            if let Ok(Some((library, name, path))) = search.open(&[name], dir.as_deref()) {
                // SAFETY: as for the runtime.
                if let Ok(api) = unsafe { OpApi::from_library(library) } {
                    ops.push(Lib { api, name, path });
                }
            }
        }
        Ok(Runtime {
            acl,
            nnopbase,
            ops,
            search,
            skipped,
        })
    }

    /// The runtime library's table.
    pub fn acl(&self) -> &AclRuntime {
        &self.acl.api
    }

    /// Where the runtime was loaded from.
    pub fn acl_path(&self) -> &Path {
        &self.acl.path
    }

    /// The aclnn base library, or why it is missing.
    pub fn nnopbase(&self) -> Result<&NnopBase, AscendError> {
        self.nnopbase
            .as_ref()
            .map(|lib| &lib.api)
            .map_err(|reason| AscendError::Unsupported {
                op: "aclnn",
                reason: reason.clone(),
            })
    }

    /// Where the aclnn base library was loaded from, or why it was not.
    pub fn nnopbase_path(&self) -> Result<&Path, &str> {
        self.nnopbase
            .as_ref()
            .map(|lib| lib.path.as_path())
            .map_err(String::as_str)
    }

    /// The runtime files skipped before the one loaded: CANN's link stubs (100039 from
    /// `aclInit`). Empty when the first file found was the runtime.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// The op libraries found, in resolution order.
    pub fn ops(&self) -> &[Lib<OpApi>] {
        &self.ops
    }

    /// The error for an op no library exports.
    pub fn missing_op(&self, function: &'static str) -> AscendError {
        let library = if self.ops.is_empty() {
            format!(
                "any op library: none of {} found in: {}",
                OP_LIBRARIES.join(", "),
                self.search.describe()
            )
        } else {
            self.ops
                .iter()
                .map(|lib| lib.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        AscendError::MissingSymbol { function, library }
    }

    /// `Ok` for `ACL_SUCCESS`, else the error of `function` with `aclGetRecentErrMsg()`.
    pub fn check(&self, function: &'static str, code: i32) -> Result<(), AscendError> {
        AclError(code).result().map_err(|code| AscendError::Acl {
            function,
            code,
            message: recent_message(&self.acl.api).unwrap_or_default(),
        })
    }

    /// `Ok` for a zero aclnn status, else the error of `function` with the recent message.
    pub fn check_aclnn(&self, function: &'static str, status: i32) -> Result<(), AscendError> {
        AclnnStatus(status)
            .result()
            .map_err(|code| AscendError::Aclnn {
                function,
                code,
                message: recent_message(&self.acl.api).unwrap_or_default(),
            })
    }

    /// A runtime function, or the error naming it and the library.
    pub fn missing(&self, function: &'static str) -> AscendError {
        AscendError::MissingSymbol {
            function,
            library: self.acl.path.display().to_string(),
        }
    }
}

/// The probe's reason for stub libraries: `files` (one or several, as one line) answered
/// `function` with 100039.
pub fn stub_reason(files: &str, function: &str) -> String {
    format!(
        "CANN stub library: no driver ({files} returned ACL_ERROR_COMPILING_STUB_MODE (100039) from {function}; the SDK's link stubs are on the library path instead of the driver's runtime)"
    )
}

/// `aclGetRecentErrMsg()`, when the runtime has it and it has something to say.
fn recent_message(acl: &AclRuntime) -> Option<String> {
    let get = acl.aclGetRecentErrMsg.as_ref().ok()?;
    // SAFETY: returns a thread-local C string owned by the runtime, or null, valid until the
    // next runtime call on this thread; `text` copies it at once.
    unsafe { crate::calls::text(get()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_path_lists_environment_roots_first_without_duplicates() {
        // The environment is process-wide; this test only reads it.
        let path = SearchPath::from_env();
        let defaults = PathBuf::from("/usr/local/Ascend/cann/lib64");
        assert!(path.dirs.contains(&defaults), "{:?}", path.dirs);
        let mut seen = path.dirs.clone();
        seen.dedup();
        assert_eq!(seen.len(), path.dirs.len());
        assert!(path.describe().contains("/opt/Ascend/cann/lib64"));
        // Each root also in its `<arch>-linux/lib64`, right after its `lib64`.
        let arch = PathBuf::from(format!(
            "/usr/local/Ascend/cann/{}-linux/lib64",
            std::env::consts::ARCH
        ));
        let at = |dir: &PathBuf| path.dirs.iter().position(|d| d == dir);
        assert_eq!(at(&arch), at(&defaults).map(|i| i + 1), "{:?}", path.dirs);
    }

    #[test]
    fn stub_reason_names_the_code() {
        let text = stub_reason("/x/libacl_rt.so", "aclInit");
        assert!(text.starts_with("CANN stub library: no driver"), "{text}");
        assert!(text.contains("100039"), "{text}");
    }
}
