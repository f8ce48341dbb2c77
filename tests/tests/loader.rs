//! Loading real plugin libraries, and each load failure on its own fixture library.

use iris_plugin::abi::{ABI_MAJOR, ABI_MINOR};
use iris_plugin::{LoadError, load_library};
use iris_tests::{fixture_library, plugin_library};

#[test]
fn cpu_library_loads_and_opens() {
    let plugin = load_library(&plugin_library("cpu")).expect("the CPU plugin loads");
    assert_eq!(plugin.name(), "cpu");
    assert_eq!(plugin.abi_major(), iris_plugin::abi::ABI_MAJOR);
    assert_eq!(plugin.probe().device_count, 1);
    let device = plugin
        .open(0, &[("capacity".into(), "1MiB".into())])
        .expect("device 0 opens");
    assert_eq!(device.mem_info().unwrap().total, 1 << 20);
    let buf = device.alloc(1024).unwrap();
    device.write(buf, 8, &[1, 2, 3]).unwrap();
    let mut back = [0u8; 3];
    device.read(buf, 8, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3]);
    device.free(buf).unwrap();
}

#[test]
fn not_an_iris_plugin_is_reported_as_such() {
    let path = fixture_library("not_a_plugin");
    let err = load_library(&path).unwrap_err();
    assert!(matches!(err, LoadError::NotAnIrisPlugin { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("libiris_fixture_not_a_plugin.so"), "{text}");
    assert!(text.contains("is not an iris plugin"), "{text}");
}

#[test]
fn next_major_version_is_a_version_mismatch_naming_both_versions() {
    let path = fixture_library("major_mismatch");
    let err = load_library(&path).unwrap_err();
    match &err {
        LoadError::VersionMismatch {
            plugin_major,
            host_major,
            ..
        } => {
            assert_eq!(*plugin_major, ABI_MAJOR + 1);
            assert_eq!(*host_major, ABI_MAJOR);
        }
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("libiris_fixture_major_mismatch.so"), "{text}");
    let plugin_version = format!("ABI {}.{}", ABI_MAJOR + 1, ABI_MINOR);
    let host_version = format!("needs {ABI_MAJOR}.x");
    assert!(text.contains(&plugin_version), "{text}");
    assert!(text.contains(&host_version), "{text}");
}

#[test]
fn a_plugin_built_for_abi_1_is_refused_naming_both_versions() {
    let path = fixture_library("abi_1");
    let err = load_library(&path).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::VersionMismatch {
                plugin_major: 1,
                plugin_minor: 0,
                host_major: ABI_MAJOR,
                ..
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("built for iris ABI 1.0"), "{text}");
    assert!(text.contains(&format!("needs {ABI_MAJOR}.x")), "{text}");
}

/// A plugin built for 2.0 has shorter tables than this host's 2.2: it loads, works, and the
/// host falls back to ordinary memory for staging and to staged uploads for `write_async`,
/// which 2.0 lacks.
#[test]
fn a_plugin_built_for_abi_2_0_loads_and_the_host_falls_back() {
    let path = iris_tests::abi_2_0_fixture().unwrap_or_else(|err| panic!("{err}"));
    let plugin = load_library(&path).unwrap_or_else(|err| panic!("the 2.0 plugin loads: {err}"));
    assert_eq!((plugin.abi_major(), plugin.abi_minor()), (2, 0));
    assert!(
        plugin.abi_minor() < ABI_MINOR,
        "this test needs a host newer than the fixture"
    );
    let device = std::sync::Arc::new(plugin.open(0, &[]).expect("device 0 opens"));
    assert!(!device.has_staging());
    let buf = device.alloc(4096).unwrap();
    let mut staging = device.host_buffer(4096).unwrap();
    assert!(!staging.is_pinned());
    staging.as_mut_slice().unwrap().fill(0x5a);
    device.upload(buf, 0, &mut staging, 0, 4096).unwrap();
    device.zero(buf, 1024, 1024).unwrap();
    let mut back = device.host_buffer(4096).unwrap();
    device.download(buf, 0, &mut back, 0, 4096).unwrap();
    let bytes = back.as_slice().unwrap();
    assert!(bytes[..1024].iter().all(|b| *b == 0x5a));
    assert!(bytes[1024..2048].iter().all(|b| *b == 0));
    assert!(bytes[2048..].iter().all(|b| *b == 0x5a));
    drop((staging, back));
    // No `write_async` either (2.2): the writes object enqueues nothing and says so.
    assert!(!device.has_async_write());
    let source = vec![7u8; 64];
    let (written, waited) = device.with_async_writes(|writes| writes.write(buf, 0, &source));
    assert!(!written.unwrap());
    waited.unwrap();
    // Nor `trim` (2.3): nothing kept to give back.
    assert_eq!(device.trim().unwrap(), None);
    device.free(buf).unwrap();
    // The conformance suite passes, with host staging, `write_async` and `trim` reported as
    // unsupported.
    let report = iris_plugin::conformance::run(&plugin, &device);
    let failures: Vec<String> = report
        .failures()
        .map(|c| format!("{}: {}", c.name, c.status))
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
    for name in ["queue.host_staging", "queue.write_async", "memory.trim"] {
        let check = report
            .checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("the suite checks {name}"));
        assert!(
            check.status.detail().contains("ABI 2.0"),
            "{name}: {}",
            check.status
        );
    }
}

#[test]
fn different_root_module_layout_is_incompatible() {
    let path = fixture_library("bad_layout");
    let err = load_library(&path).unwrap_err();
    assert!(
        matches!(err, LoadError::IncompatibleLayout { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("libiris_fixture_bad_layout.so"), "{text}");
    assert!(text.contains("incompatible ABI layout"), "{text}");
}

#[test]
fn constructor_error_is_reported_with_its_message() {
    let path = fixture_library("init_error");
    let err = load_library(&path).unwrap_err();
    assert!(matches!(err, LoadError::InitFailed { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("libiris_fixture_init_error.so"), "{text}");
    assert!(
        text.contains("the device runtime refused to initialise"),
        "{text}"
    );
}

#[test]
fn constructor_panic_is_reported_as_such() {
    let path = fixture_library("init_panic");
    let err = load_library(&path).unwrap_err();
    assert!(matches!(err, LoadError::InitPanicked { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("libiris_fixture_init_panic.so"), "{text}");
    assert!(text.contains("panicked while initialising"), "{text}");
}

#[test]
fn missing_file_lists_the_path() {
    let path = iris_tests::artifact_dir().join("libiris_device_absent.so");
    let err = load_library(&path).unwrap_err();
    assert!(matches!(err, LoadError::NotFound { .. }), "{err:?}");
    assert!(
        err.to_string().contains("libiris_device_absent.so"),
        "{err}"
    );
}
