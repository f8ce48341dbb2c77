//! Every kernel compiles with NVRTC for the architectures iris targets, without register
//! spills. Needs no GPU: NVRTC runs the assembler itself when given a real architecture.
//!
//! NVRTC comes from the PyPI wheels `nvidia-cuda-nvrtc-cu12` (12.9) and `nvidia-cuda-nvrtc`
//! (13.0), which `.ci/run` installs outside the repository and names in `IRIS_TEST_NVRTC_DIR`
//! (folders separated by `:`; the build takes the `libnvrtc.so.<major>` of its CUDA major).
//! Without that variable the test says why it skips.

use std::path::PathBuf;

use iris_device_cuda::kernels::{self, Target};
use iris_device_cuda::loader::{self, Library};

/// The folders with `libnvrtc.so.12` and `libnvrtc.so.13`.
const NVRTC_DIR_ENV: &str = "IRIS_TEST_NVRTC_DIR";

/// Ampere (A100, A10/RTX 30), Ada (L4, L40, RTX 40) and Hopper (H100, H200).
const ARCHITECTURES: [u32; 4] = [80, 86, 89, 90];

#[test]
fn every_kernel_compiles_for_every_architecture_without_spills() {
    let Some(dirs) = std::env::var_os(NVRTC_DIR_ENV) else {
        eprintln!(
            "skipped: {NVRTC_DIR_ENV} is not set (.ci/run installs NVRTC from PyPI and sets it)"
        );
        return;
    };
    let opened: Vec<PathBuf> = std::env::split_paths(&dirs)
        .flat_map(|dir| loader::preload_from(&dir))
        .collect();
    assert!(
        loader::present(Library::Nvrtc),
        "{NVRTC_DIR_ENV}={} holds no loadable {} (opened: {opened:?})",
        dirs.display(),
        Library::Nvrtc.file_name()
    );
    let (major, minor) = kernels::nvrtc_version().unwrap();
    assert_eq!(
        u32::try_from(major).ok(),
        Some(loader::cuda_major()),
        "the build loads its own CUDA major's NVRTC"
    );
    let supported = kernels::supported_archs().unwrap();
    let names = kernels::kernel_names();
    let mut table =
        format!("NVRTC {major}.{minor}; registers / spill bytes (stores+loads) per kernel\n");
    table.push_str(&format!("{:<24}", "kernel"));
    let mut columns = Vec::new();
    for arch in ARCHITECTURES {
        assert!(
            supported.contains(&arch),
            "NVRTC {major}.{minor} cannot compile for sm_{arch}"
        );
        let compiled = kernels::compile(Target::Cubin(arch), &["--ptxas-options=--verbose"])
            .unwrap_or_else(|err| panic!("sm_{arch}: {err}"));
        assert_eq!(
            &compiled.image[..4],
            b"\x7fELF",
            "sm_{arch}: a cubin is an ELF image"
        );
        let resources = kernels::resources(&compiled.log);
        for name in &names {
            let found = resources
                .iter()
                .find(|r| &r.name == name)
                .unwrap_or_else(|| panic!("sm_{arch}: no assembler report for `{name}`"));
            assert!(
                found.spill_stores == 0 && found.spill_loads == 0,
                "sm_{arch}: `{name}` spills registers: {found:?}"
            );
            assert!(
                found.registers > 0,
                "sm_{arch}: `{name}` reports no registers"
            );
        }
        table.push_str(&format!(
            "sm_{arch} ({} ms, {} KiB)  ",
            compiled.millis,
            compiled.image.len() >> 10
        ));
        columns.push(resources);
    }
    table.push('\n');
    for name in &names {
        table.push_str(&format!("{name:<24}"));
        for resources in &columns {
            let r = resources.iter().find(|r| &r.name == name).unwrap();
            table.push_str(&format!(
                "{:>4} regs {}+{:<12}",
                r.registers, r.spill_stores, r.spill_loads
            ));
        }
        table.push('\n');
    }
    eprintln!("{table}");
}
