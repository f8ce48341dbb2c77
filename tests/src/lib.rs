//! Helpers shared by the integration tests: where cargo put the plugin libraries this test
//! binary depends on.

use std::path::PathBuf;

/// The folder holding the test binary; cargo builds `cdylib` dev-dependencies (the CPU device,
/// the template, the load-failure fixtures) into the same folder.
pub fn artifact_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binaries know their own path");
    exe.parent()
        .expect("a test binary lives in a folder")
        .to_path_buf()
}

/// Path of the plugin library `libiris_device_<name>.so` built next to the test binary.
pub fn plugin_library(name: &str) -> PathBuf {
    artifact_dir().join(iris_plugin::loader::library_file_name(name))
}

/// Path of the load-failure fixture library `libiris_fixture_<name>.so` built next to the test
/// binary. Fixtures are not named like plugins, so plugin discovery (which lists every
/// `libiris_device_*.so` next to the `iris` binary) never picks them up.
pub fn fixture_library(name: &str) -> PathBuf {
    artifact_dir().join(format!("libiris_fixture_{name}.so"))
}
