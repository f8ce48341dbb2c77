//! Plugins built for different minor versions of the ABI, loaded into one process in both
//! orders: each is checked against the host's layout on its own, so an older plugin loaded
//! first does not make a newer one "incompatible" (or the other way round).
//!
//! One test in its own binary, because the order of the loads is the point.

use iris_plugin::abi::ABI_MINOR;
use iris_plugin::load_library;
use iris_tests::{abi_2_0_fixture, plugin_library};

/// Copies of plugin libraries under other names, so that the dynamic loader maps them again
/// (`dlopen` of a path it already mapped returns the same library); removed on drop, pass or
/// fail.
struct Copies(std::path::PathBuf);

impl Copies {
    fn new() -> Copies {
        let dir = std::env::temp_dir().join(format!("iris-mixed-minors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp folder");
        Copies(dir)
    }

    fn of(&self, path: &std::path::Path, tag: &str) -> std::path::PathBuf {
        let copy = self.0.join(format!("libiris_device_{tag}.so"));
        std::fs::copy(path, &copy).unwrap_or_else(|err| panic!("copy {}: {err}", path.display()));
        copy
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn an_older_and_a_newer_plugin_load_into_one_process_in_either_order() {
    let old = abi_2_0_fixture().unwrap_or_else(|err| panic!("{err}"));
    let new = plugin_library("cpu");
    let copies = Copies::new();
    // Older first, then newer, then an older and a newer again from fresh mappings.
    let loads = [
        old.clone(),
        new.clone(),
        copies.of(&old, "abi20_again"),
        copies.of(&new, "cpu_again"),
    ];
    let mut minors = Vec::new();
    for path in &loads {
        let plugin = load_library(path)
            .unwrap_or_else(|err| panic!("{} loads after the others: {err}", path.display()));
        let device = plugin.open(0, &[]).expect("device 0 opens");
        let buf = device.alloc(64).unwrap();
        device.write(buf, 0, &[9; 64]).unwrap();
        let mut back = [0u8; 64];
        device.read(buf, 0, &mut back).unwrap();
        assert_eq!(back, [9; 64], "{}", path.display());
        device.free(buf).unwrap();
        minors.push(plugin.abi_minor());
    }
    assert_eq!(minors, [0, ABI_MINOR, 0, ABI_MINOR]);
}
