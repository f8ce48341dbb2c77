//! Loading real plugin libraries, and each load failure on its own fixture library.

use iris_plugin::{LoadError, load_library};
use iris_tests::plugin_library;

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
    let path = plugin_library("not_a_plugin");
    let err = load_library(&path).unwrap_err();
    assert!(matches!(err, LoadError::NotAnIrisPlugin { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("libiris_device_not_a_plugin.so"), "{text}");
    assert!(text.contains("is not an iris plugin"), "{text}");
}
