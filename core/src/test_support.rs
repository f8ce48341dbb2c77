//! What the unit tests share: the built-in CPU device at a chosen capacity.

use std::sync::Arc;

use iris_plugin::{Device, Plugin};

use crate::memory::CachingAllocator;

/// Device 0 of the built-in CPU plugin with `capacity` (`"64MiB"`, or bytes).
pub(crate) fn cpu_device(capacity: &str) -> Device {
    Plugin::builtin(iris_device_cpu::plugin_root())
        .open(0, &[("capacity".into(), capacity.into())])
        .expect("the CPU device opens")
}

/// Device 0 of the built-in CPU plugin opened with `options` (capacity, fault injection, ...).
pub(crate) fn cpu_device_with(options: &[(&str, &str)]) -> Device {
    let options: Vec<_> = options
        .iter()
        .map(|(key, value)| ((*key).into(), (*value).into()))
        .collect();
    Plugin::builtin(iris_device_cpu::plugin_root())
        .open(0, &options)
        .expect("the CPU device opens")
}

/// A caching allocator over [`cpu_device`].
pub(crate) fn cpu_allocator(capacity: &str) -> Arc<CachingAllocator> {
    CachingAllocator::new(Arc::new(cpu_device(capacity)))
}
