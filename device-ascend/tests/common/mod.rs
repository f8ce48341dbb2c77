//! Test harness: an emulated CANN install and tests isolated in child processes.
//!
//! The plugin loads the CANN runtime once per process and `aclInit` runs once per process, as
//! on a real machine; the emulation reads its settings once per process too. So each scenario
//! runs in a child process of the test binary with its own environment: [`isolated`] spawns
//! the binary again, filtered to the one test, with the scenario's variables set.

#![allow(dead_code)] // each test binary uses part of the harness

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use iris_plugin::{Device, Plugin};

/// Set in a child process to the name of the test it runs.
const CHILD_ENV: &str = "IRIS_ASCEND_TEST_CHILD";

/// `target/<profile>`, from the test binary's path (`target/<profile>/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary has a path");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binaries live in target/<profile>/deps")
        .to_path_buf()
}

/// The plugin library built for this test run: in `deps/`, where cargo builds it for the
/// tests (the copy beside it in `target/<profile>` is refreshed only by a build of the crate
/// itself).
pub fn plugin_path() -> PathBuf {
    let path = target_dir()
        .join("deps")
        .join(iris_plugin::loader::library_file_name("ascend"));
    assert!(path.is_file(), "{} is built with the tests", path.display());
    path
}

/// The emulated runtime library (built as a dev-dependency, next to the tests).
pub fn emulator_path() -> PathBuf {
    let path = target_dir().join("deps").join("libiris_cann_emulator.so");
    assert!(path.is_file(), "{} is built with the tests", path.display());
    path
}

/// The emulated op library of an older CANN.
pub fn old_opapi_path() -> PathBuf {
    let path = target_dir()
        .join("deps")
        .join("libiris_cann_emulator_old_opapi.so");
    assert!(path.is_file(), "{} is built with the tests", path.display());
    path
}

/// Which files an emulated install holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// CANN 8.5 and later: runtime, nnopbase, and the three split op libraries.
    Split,
    /// An older CANN: runtime, nnopbase, and one `libopapi.so` without the transformer ops.
    Legacy,
    /// CANN 7.x to 8.3 without the single op library: runtime, nnopbase, and the feature op
    /// libraries (`libaclnn_ops_infer.so`, ...).
    FeatureLibraries,
    /// No CANN at all: the folder exists, the libraries do not.
    Empty,
}

/// Creates an install root (`<root>/lib64/...`, symlinks to the emulation so that every name
/// shares one state) for this process and returns the root.
pub fn install(layout: Layout) -> PathBuf {
    install_in("main", layout, "lib64")
}

/// Creates the install root `name` for this process with the libraries of `layout` in its
/// folder `libdir` (`lib64`, `x86_64-linux/lib64`), and returns the root.
pub fn install_in(name: &str, layout: Layout, libdir: &str) -> PathBuf {
    let root = target_dir().join("tmp").join(format!(
        "ascend-emulated-{}-{}-{name}",
        std::process::id(),
        std::thread::current()
            .name()
            .unwrap_or("main")
            .replace("::", "-")
    ));
    let lib = root.join(libdir);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&lib).expect("create the install root");
    let emulator = emulator_path();
    let link = |target: &Path, name: &str| {
        std::os::unix::fs::symlink(target, lib.join(name)).expect("link an emulated library");
    };
    match layout {
        Layout::Split => {
            for name in [
                "libacl_rt.so",
                "libnnopbase.so",
                "libopapi_math.so",
                "libopapi_nn.so",
                "libopapi_transformer.so",
            ] {
                link(&emulator, name);
            }
        }
        Layout::Legacy => {
            link(&emulator, "libascendcl.so");
            link(&emulator, "libnnopbase.so");
            link(&old_opapi_path(), "libopapi.so");
        }
        Layout::FeatureLibraries => {
            for name in [
                "libascendcl.so",
                "libnnopbase.so",
                "libaclnn_ops_infer.so",
                "libaclnn_ops_train.so",
                "libaclnn_math.so",
                "libaclnn_rand.so",
            ] {
                link(&emulator, name);
            }
        }
        Layout::Empty => {}
    }
    root
}

/// Creates the install root `name` whose `lib64/libacl_rt.so` is a copy of the emulation (a
/// copy, not a link: the dynamic loader then loads it as a library of its own) that behaves
/// as CANN's link stubs, and returns the root. Call before the plugin loads the runtime.
pub fn install_stub(name: &str) -> PathBuf {
    let root = install_in(name, Layout::Empty, "lib64");
    let lib = root.join("lib64");
    std::fs::copy(emulator_path(), lib.join("libacl_rt.so")).expect("copy the emulation");
    // SAFETY: called at the start of a child process's only test, before any other thread
    // reads the environment or the emulation reads its settings.
    unsafe { std::env::set_var("ASCEND_EMU_STUB", &lib) };
    root
}

/// Runs `body` in a child process of this test binary with `env` set (and CANN's variables
/// of the parent cleared); fails with the child's output when the child fails. A test may run
/// several scenarios: each child runs only the one whose name and environment it was given.
pub fn isolated(name: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    let key = format!("{name}|{env:?}");
    match std::env::var(CHILD_ENV) {
        Ok(child) if child == key => {
            body();
            return;
        }
        // Another scenario of this test runs in this child.
        Ok(_) => return,
        Err(_) => {}
    }
    let mut command = Command::new(std::env::current_exe().expect("test binary path"));
    command
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, &key);
    for var in [
        "ASCEND_INSTALL_PATH",
        "ASCEND_HOME_PATH",
        "ASCEND_TOOLKIT_HOME",
        "ASCEND_OPP_PATH",
        "ASCEND_RT_VISIBLE_DEVICES",
        "LD_LIBRARY_PATH",
    ] {
        command.env_remove(var);
    }
    for (key, _) in std::env::vars() {
        if key.starts_with("ASCEND_EMU_") {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().copied());
    let output = command.output().expect("spawn the test binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "isolated test `{name}` failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
}

/// Points this (child) process at an emulated install of `layout`.
pub fn use_install(layout: Layout) -> PathBuf {
    let root = install(layout);
    // SAFETY: called at the start of a child process's only test, before any other thread
    // reads the environment.
    unsafe { std::env::set_var("ASCEND_HOME_PATH", &root) };
    root
}

/// Loads the plugin library.
pub fn plugin() -> Plugin {
    iris_plugin::loader::load_library(&plugin_path()).expect("the Ascend plugin loads")
}

/// Opens NPU `ordinal` with `options`.
pub fn open(plugin: &Plugin, ordinal: u32, options: &[(&str, &str)]) -> Arc<Device> {
    let options: Vec<(String, String)> = options
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Arc::new(
        plugin
            .open(ordinal, &options)
            .unwrap_or_else(|err| panic!("open NPU {ordinal}: {err}")),
    )
}

/// The emulation's counters for physical NPU `device`, read from the loaded library.
pub fn emulator_stats(device: u32) -> iris_cann_emulator::EmuStats {
    // SAFETY: the emulation is already loaded (through its symlinks); opening the same file
    // only takes another reference, and `iris_emu_stats` has this signature.
    unsafe {
        let lib = libloading::Library::new(emulator_path()).expect("the emulation loads");
        let stats: libloading::Symbol<'_, extern "C" fn(u32) -> iris_cann_emulator::EmuStats> =
            lib.get(b"iris_emu_stats\0").expect("iris_emu_stats");
        stats(device)
    }
}
