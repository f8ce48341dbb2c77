//! Every kernel compiles with NVRTC for the architectures iris targets, without register
//! spills. Needs no GPU: NVRTC runs the assembler itself when given a real architecture.
//!
//! One plugin build loads the NVRTC of whichever CUDA major it picks, so the kernels are
//! compiled with both: NVRTC 12 from the PyPI wheel `nvidia-cuda-nvrtc-cu12` (12.9) and NVRTC 13
//! from `nvidia-cuda-nvrtc` (13.0), which `.ci/run` installs outside the repository and names in
//! `IRIS_TEST_NVRTC_DIR` (folders separated by `:`), in one process. Without that variable the
//! tests say why they skip; with it, each major must be found in one of its folders.

use std::path::PathBuf;

use iris_device_cuda::kernels::{self, Target};
use iris_device_cuda::libraries::Nvrtc;

/// The folders with `libnvrtc.so.12` and `libnvrtc.so.13`.
const NVRTC_DIR_ENV: &str = "IRIS_TEST_NVRTC_DIR";

/// Ampere (A100, A10/RTX 30), Ada (L4, L40, RTX 40) and Hopper (H100, H200).
const ARCHITECTURES: [u32; 4] = [80, 86, 89, 90];

#[test]
fn every_kernel_compiles_with_nvrtc_12_for_every_architecture_without_spills() {
    compiles_with(12);
}

#[test]
fn every_kernel_compiles_with_nvrtc_13_for_every_architecture_without_spills() {
    compiles_with(13);
}

/// Compiles every kernel with NVRTC of CUDA `major`, found in `IRIS_TEST_NVRTC_DIR`, for each
/// of [`ARCHITECTURES`], and checks the assembler's report.
fn compiles_with(major: u32) {
    let Some(dirs) = std::env::var_os(NVRTC_DIR_ENV) else {
        eprintln!(
            "skipped: {NVRTC_DIR_ENV} is not set (.ci/run installs NVRTC from PyPI and sets it)"
        );
        return;
    };
    let dirs: Vec<PathBuf> = std::env::split_paths(&dirs).collect();
    let mut tried = Vec::new();
    let nvrtc = dirs
        .iter()
        .find_map(|dir| {
            Nvrtc::open_in(dir, major)
                .map_err(|err| tried.push(err.to_string()))
                .ok()
        })
        .unwrap_or_else(|| panic!("{NVRTC_DIR_ENV} holds no loadable NVRTC {major}: {tried:?}"));
    // `open_in` checked that the library's version is of `major`.
    let minor = nvrtc.version.1;
    let supported = kernels::supported_archs(&nvrtc.lib).unwrap();
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
        let compiled = kernels::compile(
            &nvrtc.lib,
            Target::Cubin(arch),
            &["--ptxas-options=--verbose"],
        )
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
