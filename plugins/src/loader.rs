//! Finding and loading plugin libraries.
//!
//! A plugin is named (`cpu`, `cuda`, `ascend`, or any vendor name) or given as a path. A name
//! resolves to the file `libiris_device_<name>.so`, searched in order: the folders of
//! `IRIS_PLUGIN_PATH`, the `plugin_dirs` of the config, then the folder of the running
//! executable. Each library is opened on its own (not through abi_stable's
//! one-library-per-interface cache), so several plugins live in one process; libraries are never
//! unloaded, because unloading Rust code with thread-local destructors crashes.
//!
//! Load sequence: open the file; read the [`AbiVersion`] static (missing: not an iris plugin);
//! compare majors and the minor window; compare the root module's layout recursively with
//! abi_stable's checker, with the older side's tables as the prefix the newer side's must
//! match; run the root module's constructor. Each step has its own [`LoadError`] naming the
//! file.

use std::path::{Path, PathBuf};

use abi_stable::StableAbi;
use abi_stable::abi_stability::abi_checking::{
    CheckingGlobals, check_layout_compatibility_with_globals,
};
use abi_stable::library::{LibHeader, LibraryError, RootModuleError, lib_header_from_path};
use thiserror::Error;

use crate::abi::{
    ABI_MAGIC, ABI_MAJOR, ABI_MIN_MINOR, ABI_MINOR, ABI_VERSION_SYMBOL, AbiVersion, IrisPluginRef,
};
use crate::host::Plugin;

/// Prefix and suffix of plugin library file names.
pub const LIBRARY_PREFIX: &str = "libiris_device_";
/// Suffix of plugin library file names.
pub const LIBRARY_SUFFIX: &str = ".so";
/// Environment variable with extra plugin folders, separated by `:`.
pub const PLUGIN_PATH_ENV: &str = "IRIS_PLUGIN_PATH";

/// Why a plugin could not be loaded. Every variant names the file (or, for `NotFound`, every
/// path tried).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No library file for the name in any search folder.
    #[error("plugin `{name}` not found; tried: {}", display_paths(tried))]
    NotFound {
        /// The plugin name asked for.
        name: String,
        /// Every file path tried, in order.
        tried: Vec<PathBuf>,
    },
    /// The file exists but the dynamic loader could not open it.
    #[error("cannot open plugin library {}: {message}", path.display())]
    Open {
        /// The library file.
        path: PathBuf,
        /// The dynamic loader's message.
        message: String,
    },
    /// The library does not export iris's version block.
    #[error("{} is not an iris plugin: {reason}", path.display())]
    NotAnIrisPlugin {
        /// The library file.
        path: PathBuf,
        /// What was missing.
        reason: String,
    },
    /// The plugin was built for another ABI major, or a minor older than the host accepts.
    #[error(
        "plugin {} was built for iris ABI {plugin_major}.{plugin_minor}, but this host needs {host_major}.x with x >= {host_min_minor}",
        path.display()
    )]
    VersionMismatch {
        /// The library file.
        path: PathBuf,
        /// The plugin's ABI major.
        plugin_major: u32,
        /// The plugin's ABI minor.
        plugin_minor: u32,
        /// The host's ABI major.
        host_major: u32,
        /// The oldest plugin minor the host accepts.
        host_min_minor: u32,
    },
    /// abi_stable found that the root module's type layout differs from the host's.
    #[error("plugin {} has an incompatible ABI layout: {details}", path.display())]
    IncompatibleLayout {
        /// The library file.
        path: PathBuf,
        /// abi_stable's report.
        details: String,
    },
    /// The root module's constructor returned an error.
    #[error("plugin {} failed to initialise: {message}", path.display())]
    InitFailed {
        /// The library file.
        path: PathBuf,
        /// The plugin's error message.
        message: String,
    },
    /// The root module's constructor panicked.
    #[error("plugin {} panicked while initialising: {message}", path.display())]
    InitPanicked {
        /// The library file.
        path: PathBuf,
        /// What abi_stable reported about the panic.
        message: String,
    },
}

/// Where to look for plugin libraries by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchPath {
    /// Folders from `IRIS_PLUGIN_PATH`, searched first.
    pub env_dirs: Vec<PathBuf>,
    /// Folders from the config's `plugin_dirs`.
    pub config_dirs: Vec<PathBuf>,
    /// The running executable's folder, searched last. Its `deps/` subfolder follows it: that
    /// is where cargo puts plugin libraries built as dependencies of the binary, so a binary
    /// run from a cargo target folder finds the plugins it was built with.
    pub exe_dir: Option<PathBuf>,
}

impl SearchPath {
    /// The search path from the environment (`IRIS_PLUGIN_PATH`), the given config folders,
    /// and the folder of the running executable.
    pub fn from_env(config_dirs: &[PathBuf]) -> SearchPath {
        let env_dirs = std::env::var_os(PLUGIN_PATH_ENV)
            .map(|value| split_path_list(&value.to_string_lossy()))
            .unwrap_or_default();
        let exe_dir = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf));
        SearchPath {
            env_dirs,
            config_dirs: config_dirs.to_vec(),
            exe_dir,
        }
    }

    /// Every folder in search order, without duplicates.
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        let exe_dirs = self
            .exe_dir
            .iter()
            .flat_map(|dir| [dir.clone(), dir.join("deps")]);
        let all = self
            .env_dirs
            .iter()
            .cloned()
            .chain(self.config_dirs.iter().cloned())
            .chain(exe_dirs);
        for dir in all {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs
    }

    /// The first existing library file for plugin `name`, or `NotFound` with every path tried.
    pub fn find(&self, name: &str) -> Result<PathBuf, LoadError> {
        let file = library_file_name(name);
        let mut tried = Vec::new();
        for dir in self.dirs() {
            let candidate = dir.join(&file);
            if candidate.is_file() {
                return Ok(candidate);
            }
            tried.push(candidate);
        }
        Err(LoadError::NotFound {
            name: name.to_owned(),
            tried,
        })
    }

    /// Every plugin library file in the search folders, in search order; a name found in
    /// several folders is listed once (the first).
    pub fn discover(&self) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for dir in self.dirs() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut in_dir: Vec<(String, PathBuf)> = entries
                .filter_map(Result::ok)
                .map(|entry| entry.path())
                .filter_map(|path| {
                    let name = plugin_name_of(&path)?;
                    path.is_file().then_some((name, path))
                })
                .collect();
            in_dir.sort();
            for (name, path) in in_dir {
                if !names.contains(&name) {
                    names.push(name);
                    found.push(path);
                }
            }
        }
        found
    }
}

/// `libiris_device_<name>.so`.
pub fn library_file_name(name: &str) -> String {
    format!("{LIBRARY_PREFIX}{name}{LIBRARY_SUFFIX}")
}

/// The plugin name in a library file name, if it follows the `libiris_device_<name>.so` pattern.
pub fn plugin_name_of(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let name = file
        .strip_prefix(LIBRARY_PREFIX)?
        .strip_suffix(LIBRARY_SUFFIX)?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// Whether `spec` names a file (contains a path separator or ends in `.so`) rather than a
/// plugin name.
pub fn is_path_spec(spec: &str) -> bool {
    spec.contains(std::path::MAIN_SEPARATOR) || spec.ends_with(LIBRARY_SUFFIX)
}

/// Loads the plugin library at `path`.
pub fn load_library(path: &Path) -> Result<Plugin, LoadError> {
    if !path.is_file() {
        return Err(LoadError::NotFound {
            name: path.display().to_string(),
            tried: vec![path.to_path_buf()],
        });
    }
    // The file checked above is the one loaded: the dynamic loader searches its own folders
    // (LD_LIBRARY_PATH, the system's) for a name without a slash, so a bare file name in the
    // current folder is made absolute first.
    let absolute = std::path::absolute(path).map_err(|err| LoadError::Open {
        path: path.to_path_buf(),
        message: err.to_string(),
    })?;
    let path = absolute.as_path();
    let path_buf = absolute.clone();
    let version = read_abi_version(path)?;
    // `checked_sub` rather than `<`: with a minimum of 0 the comparison is vacuous today, but
    // the window moves when old minors are retired.
    if version.major != ABI_MAJOR || version.minor.checked_sub(ABI_MIN_MINOR).is_none() {
        return Err(LoadError::VersionMismatch {
            path: path_buf,
            plugin_major: version.major,
            plugin_minor: version.minor,
            host_major: ABI_MAJOR,
            host_min_minor: ABI_MIN_MINOR,
        });
    }
    let header = lib_header_from_path(path).map_err(|err| library_error(path, err))?;
    check_layout(path, header, version.minor)?;
    // SAFETY: `check_layout` has compared the library's root-module layout (and, through it,
    // every type the plugin exchanges with the host) with this host's.
    let module = unsafe { header.init_root_module_with_unchecked_layout::<IrisPluginRef>() }
        .map_err(|err| library_error(path, err))?;
    Ok(Plugin::from_module(
        module,
        Some(path_buf),
        version.major,
        version.minor,
    ))
}

/// Compares the library's root-module layout with the host's, recursively (the root module,
/// the device table, every argument struct).
///
/// abi_stable's own check lets the library's prefix types have more fields than the host's
/// (a newer plugin) but not fewer. iris also accepts an older minor, whose tables are shorter:
/// then the plugin's layout is the one whose fields the host's must match, field by field.
/// Fields past the plugin's table are read through `Option` accessors, which see them missing.
fn check_layout(path: &Path, header: &LibHeader, plugin_minor: u32) -> Result<(), LoadError> {
    let Some(plugin) = header.layout() else {
        return Err(LoadError::IncompatibleLayout {
            path: path.to_path_buf(),
            details: "the library's root module carries no layout to check".to_owned(),
        });
    };
    let host = <IrisPluginRef as StableAbi>::LAYOUT;
    let (shorter, longer) = if plugin_minor < ABI_MINOR {
        (plugin, host)
    } else {
        (host, plugin)
    };
    // A fresh set of globals per plugin: abi_stable's process-wide set unifies every prefix
    // type it has checked into one expected layout, so after a 2.0 plugin the host's own 2.2
    // tables would be "incompatible" with a 2.2 plugin (and the other way round). Each plugin
    // is checked against the host alone; prefix-type accessors read each table's own field
    // count, so plugins of different minors need not agree with one another.
    let globals = CheckingGlobals::new();
    check_layout_compatibility_with_globals(shorter, longer, &globals).map_err(|err| {
        LoadError::IncompatibleLayout {
            path: path.to_path_buf(),
            details: abi_instability_summary(&err.to_string()),
        }
    })
}

/// Reads the exported [`AbiVersion`] block. The library handle is leaked on purpose: plugins
/// are never unloaded.
fn read_abi_version(path: &Path) -> Result<AbiVersion, LoadError> {
    // SAFETY: opening a library runs its initialisers; loading plugins is the point of this
    // function, and the caller chose the file.
    let library = unsafe { libloading::Library::new(path) }.map_err(|err| LoadError::Open {
        path: path.to_path_buf(),
        message: err.to_string(),
    })?;
    let library: &'static libloading::Library = Box::leak(Box::new(library));
    // SAFETY: the symbol, when present, is the `AbiVersion` static that `export_plugin!`
    // defines; the magic number below guards against an unrelated symbol of the same name.
    let symbol = unsafe { library.get::<*const AbiVersion>(ABI_VERSION_SYMBOL.as_bytes()) }
        .map_err(|_| LoadError::NotAnIrisPlugin {
            path: path.to_path_buf(),
            reason: format!("it does not export the symbol `{ABI_VERSION_SYMBOL}`"),
        })?;
    let pointer: *const AbiVersion = *symbol;
    if pointer.is_null() {
        return Err(LoadError::NotAnIrisPlugin {
            path: path.to_path_buf(),
            reason: format!("the symbol `{ABI_VERSION_SYMBOL}` is null"),
        });
    }
    // SAFETY: non-null and points at a static that lives as long as the leaked library.
    let version = unsafe { pointer.read_unaligned() };
    if version.magic != ABI_MAGIC {
        return Err(LoadError::NotAnIrisPlugin {
            path: path.to_path_buf(),
            reason: format!("`{ABI_VERSION_SYMBOL}` has the wrong magic number"),
        });
    }
    Ok(version)
}

fn library_error(path: &Path, err: LibraryError) -> LoadError {
    let path = path.to_path_buf();
    match err {
        LibraryError::OpenError { err, .. } => LoadError::Open {
            path,
            message: err.to_string(),
        },
        LibraryError::GetSymbolError { err, .. } => LoadError::NotAnIrisPlugin {
            path,
            reason: format!("it has no abi_stable root module ({err})"),
        },
        LibraryError::InvalidAbiHeader(header) => LoadError::IncompatibleLayout {
            path,
            details: format!("abi_stable header {header:?} is not compatible with this host"),
        },
        LibraryError::AbiInstability(instability) => LoadError::IncompatibleLayout {
            path,
            details: abi_instability_summary(&instability.to_string()),
        },
        LibraryError::IncompatibleVersionNumber {
            library_name,
            expected_version,
            actual_version,
        } => LoadError::IncompatibleLayout {
            path,
            details: format!(
                "{library_name}: abi_stable version {actual_version} where {expected_version} was expected"
            ),
        },
        LibraryError::RootModule { err, .. } => match err {
            RootModuleError::Unwound => LoadError::InitPanicked {
                path,
                message: "the root module constructor panicked".to_owned(),
            },
            RootModuleError::Returned(err) => LoadError::InitFailed {
                path,
                message: err.to_string(),
            },
        },
        other => LoadError::InitFailed {
            path,
            message: other.to_string(),
        },
    }
}

fn abi_instability_summary(text: &str) -> String {
    // abi_stable's report lists every mismatching type recursively; the first lines name the
    // root cause, the rest is repetition for nested types.
    let mut lines: Vec<&str> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .collect();
    lines.truncate(12);
    lines.join(" / ")
}

fn split_path_list(value: &str) -> Vec<PathBuf> {
    value
        .split(':')
        .filter(|part| !part.is_empty())
        .map(PathBuf::from)
        .collect()
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "no search folders".to_owned();
    }
    paths
        .iter()
        .map(|path| path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names_round_trip() {
        assert_eq!(library_file_name("cuda"), "libiris_device_cuda.so");
        assert_eq!(
            plugin_name_of(Path::new("/x/libiris_device_cuda.so")).as_deref(),
            Some("cuda")
        );
        assert_eq!(plugin_name_of(Path::new("/x/libiris_device_.so")), None);
        assert_eq!(plugin_name_of(Path::new("/x/libfoo.so")), None);
    }

    #[test]
    fn search_order_is_env_then_config_then_exe() {
        let search = SearchPath {
            env_dirs: vec!["/a".into(), "/b".into()],
            config_dirs: vec!["/c".into(), "/a".into()],
            exe_dir: Some("/d".into()),
        };
        let dirs: Vec<PathBuf> = ["/a", "/b", "/c", "/d", "/d/deps"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(search.dirs(), dirs);
    }

    #[test]
    fn not_found_lists_every_path_tried() {
        let search = SearchPath {
            env_dirs: vec!["/nonexistent/one".into()],
            config_dirs: vec!["/nonexistent/two".into()],
            exe_dir: None,
        };
        let err = search.find("cuda").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("/nonexistent/one/libiris_device_cuda.so"),
            "{text}"
        );
        assert!(
            text.contains("/nonexistent/two/libiris_device_cuda.so"),
            "{text}"
        );
        assert!(matches!(err, LoadError::NotFound { ref tried, .. } if tried.len() == 2));
    }

    #[test]
    fn path_list_splits_on_colons() {
        assert_eq!(
            split_path_list("/a::/b:"),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
    }
}
