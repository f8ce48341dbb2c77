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

/// Builds the ABI 2.0 compatibility fixture (`tests/fixtures/abi-2-0`, its own cargo workspace)
/// once per test process and returns the path of its library.
///
/// The fixture's sources are copied next to the build folder with the workspace's lock file, so
/// cargo resolves exactly the crate versions the workspace already fetched and builds offline.
pub fn abi_2_0_fixture() -> Result<PathBuf, String> {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_abi_2_0_fixture).clone()
}

fn build_abi_2_0_fixture() -> Result<PathBuf, String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("the tests crate lives inside the workspace")?
        .to_path_buf();
    let fixture = root.join("tests/fixtures/abi-2-0");
    // Next to the test binaries' target folder, so repeated runs build incrementally.
    let work = artifact_dir()
        .parent()
        .and_then(|p| p.parent())
        .ok_or("test binaries live in target/<profile>/deps")?
        .join("fixture-abi-2-0");
    let source = work.join("source");
    std::fs::create_dir_all(source.join("src")).map_err(|e| e.to_string())?;
    let manifest =
        std::fs::read_to_string(fixture.join("Cargo.toml")).map_err(|e| e.to_string())?;
    // The copy points at the workspace's iris-plugin by absolute path.
    let manifest = manifest.replace(
        "path = \"../../../plugins\"",
        &format!("path = {:?}", root.join("plugins").display().to_string()),
    );
    std::fs::write(source.join("Cargo.toml"), manifest).map_err(|e| e.to_string())?;
    let lib = std::fs::read_to_string(fixture.join("src/lib.rs")).map_err(|e| e.to_string())?;
    // The copy includes the template's files by absolute path.
    let template = root.join("examples/backend-template/src");
    let lib = lib.replace(
        "\"../../../../examples/backend-template/src/",
        &format!("\"{}/", template.display()),
    );
    std::fs::write(source.join("src/lib.rs"), lib).map_err(|e| e.to_string())?;
    std::fs::copy(root.join("Cargo.lock"), source.join("Cargo.lock")).map_err(|e| e.to_string())?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = std::process::Command::new(cargo)
        .args(["build", "--offline", "--quiet", "--manifest-path"])
        .arg(source.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(work.join("target"))
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "building the ABI 2.0 fixture failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(work.join("target/debug/libiris_device_abi20.so"))
}
