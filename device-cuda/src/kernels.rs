//! The NVRTC kernels: their source, compilation, the on-disk cache and the loaded module.
//!
//! All kernels live in one CUDA C source, `kernels/iris.cu`, written without headers (NVRTC from
//! pip ships none). A device compiles it once at `open` for its own architecture (`sm_XY`: the
//! assembler runs and the result is a cubin, which the driver loads whatever its version, unlike
//! PTX from an NVRTC newer than the driver), measures the time and logs it. NVRTC is the one of
//! the CUDA major whose libraries the process loaded ([`crate::libraries`]): its architectures
//! decide the target. The cubin is cached on disk, keyed by the source and options (a blake3
//! hash), the architecture, the driver version and NVRTC's version, so a restart loads it
//! without NVRTC (then the newest entry of any NVRTC version is taken). When NVRTC does not know
//! the device's architecture, the source is compiled to PTX for the newest architecture it knows
//! and the driver finishes it.
//!
//! The cache folder is, in order: the `kernel_cache` option of `[plugins.cuda]`,
//! [`CACHE_ENV`], `$XDG_CACHE_HOME/iris/cuda-kernels`, `~/.cache/iris/cuda-kernels`. The value
//! `off` disables the cache. A cache that cannot be written is logged and skipped.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::driver::result;
use cudarc::driver::sys::{CUfunction, CUmodule};

use crate::error::{CudaError, DriverResultExt};
use crate::result::nvrtc;
use crate::sys;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("../kernels/iris.cu");

/// Environment variable naming the kernel cache folder (`off` disables the cache).
pub const CACHE_ENV: &str = "IRIS_CUDA_KERNEL_CACHE";

/// NVRTC options used for every compilation (the architecture is added per device).
pub const OPTIONS: &[&str] = &["--std=c++17"];

/// Float storage types, as they appear in kernel names.
pub const FLOAT_NAMES: [&str; 3] = ["f32", "f16", "bf16"];

/// Padded head dims of the attention kernels; a head dim runs on the smallest one that holds it.
pub const ATTENTION_SIZES: [u64; 6] = [32, 64, 72, 80, 96, 128];

/// Head dims of the tensor-core attention kernels (`flash_attention_<f16|bf16>_<head dim>`),
/// each its own instantiation.
pub const FLASH_ATTENTION_SIZES: [u64; 5] = [64, 72, 80, 96, 128];
/// Head dims of the 128-query tensor-core attention kernels (`flash_attention_q128_<f16|bf16>_<head
/// dim>`): not 96 and 128, where twice the accumulators leave too few registers (the
/// assembler spills at 96 on sm_80 and at 128 everywhere). The towers' head dims are 72 and 80.
pub const FLASH_ATTENTION_Q128_SIZES: [u64; 3] = [64, 72, 80];
/// Whether the 128-query attention kernels run on compute capability `cc`: 8.0 and 9.0 on. On
/// 8.6 and 8.9 the assembler spills their registers, so the source builds them empty there.
pub fn q128_runs_on(cc: (i32, i32)) -> bool {
    cc == (8, 0) || cc >= (9, 0)
}

/// Storage types of the tensor-core attention kernels.
pub const FLASH_ATTENTION_TYPES: [&str; 2] = ["f16", "bf16"];
/// Queries per block of the tensor-core attention kernels: 64 for `flash_attention_<dtype>_<head
/// dim>` (4 warps of 16 queries), 128 for `flash_attention_q128_<dtype>_<head dim>` (4 warps of
/// 32, each K and V fragment read from shared memory serving two MMAs more).
pub const FLASH_ATTENTION_QUERIES: [u64; 2] = [64, 128];

/// The name of the tensor-core attention kernel for `dtype`, `head_dim` and `queries` per block
/// (one of [`FLASH_ATTENTION_QUERIES`]).
pub fn flash_attention_name(dtype: &str, head_dim: u64, queries: u64) -> String {
    if queries > FLASH_ATTENTION_QUERIES[0] {
        format!("flash_attention_q{queries}_{dtype}_{head_dim}")
    } else {
        format!("flash_attention_{dtype}_{head_dim}")
    }
}

/// Dynamic shared memory of the tensor-core attention kernel for `head_dim` and `queries` per
/// block: two stages of K and V tiles of 64 rows of the head dim padded to 16, plus 8, in 16-bit
/// elements; the 128-query kernels keep their queries there too (the registers could not hold
/// them beside twice the accumulators).
pub fn flash_attention_shared_bytes(head_dim: u64, queries: u64) -> u32 {
    const TILE_ROWS: u64 = 64;
    const ROW_PAD: u64 = 8;
    const TILES: u64 = 4;
    let padded = head_dim.next_multiple_of(16);
    let query_rows = if queries > FLASH_ATTENTION_QUERIES[0] {
        queries
    } else {
        0
    };
    let bytes = (TILES * TILE_ROWS + query_rows) * (padded + ROW_PAD) * 2;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// Every entry point of the module, by name.
pub fn kernel_names() -> Vec<String> {
    let mut names = vec!["copy_regions".to_owned()];
    for dtype in FLOAT_NAMES {
        for op in ["norm", "activation", "binary", "gemm_epilogue", "rotary"] {
            names.push(format!("{op}_{dtype}"));
        }
        for src in FLOAT_NAMES {
            names.push(format!("cast_{src}_{dtype}"));
        }
        for size in ATTENTION_SIZES {
            names.push(format!("attention_{dtype}_{size}"));
        }
    }
    for dtype in FLASH_ATTENTION_TYPES {
        for size in FLASH_ATTENTION_SIZES {
            names.push(flash_attention_name(
                dtype,
                size,
                FLASH_ATTENTION_QUERIES[0],
            ));
        }
        for size in FLASH_ATTENTION_Q128_SIZES {
            names.push(flash_attention_name(
                dtype,
                size,
                FLASH_ATTENTION_QUERIES[1],
            ));
        }
    }
    for width in ["b1", "b2", "b4"] {
        names.push(format!("gather_{width}"));
    }
    names
}

/// What to compile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Machine code for `sm_<cc>` (a cubin).
    Cubin(u32),
    /// PTX for `compute_<cc>`, finished by the driver at load.
    Ptx(u32),
}

impl Target {
    /// The cache file's extension.
    fn ext(self) -> &'static str {
        match self {
            Target::Cubin(_) => "cubin",
            Target::Ptx(_) => "ptx",
        }
    }

    /// The `--gpu-architecture` value.
    pub fn arch(self) -> String {
        match self {
            Target::Cubin(cc) => format!("sm_{cc}"),
            Target::Ptx(cc) => format!("compute_{cc}"),
        }
    }
}

/// A compiled module image.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The cubin, or the PTX text with a trailing NUL.
    pub image: Vec<u8>,
    /// What it was compiled for.
    pub target: Target,
    /// NVRTC's log (with `--ptxas-options=--verbose`, the assembler's resource report).
    pub log: String,
    /// Wall time of the compilation in milliseconds.
    pub millis: u128,
}

/// The `sm_XY` architectures NVRTC can compile for, as `XY` numbers.
pub fn supported_archs(lib: &sys::Nvrtc) -> Result<Vec<u32>, CudaError> {
    let archs = nvrtc::supported_archs(lib)
        .map_err(|err| CudaError::nvrtc("nvrtcGetSupportedArchs", err, String::new()))?;
    Ok(archs
        .into_iter()
        .filter_map(|arch| u32::try_from(arch).ok())
        .collect())
}

/// The target for a device of compute capability `cc` (e.g. 89) given NVRTC's architectures.
pub fn target_for(cc: u32, supported: &[u32]) -> Target {
    if supported.contains(&cc) {
        return Target::Cubin(cc);
    }
    let newest = supported.iter().copied().filter(|arch| *arch <= cc).max();
    Target::Ptx(newest.unwrap_or(cc))
}

/// Compiles [`SOURCE`] with NVRTC `lib` for `target`, with `extra` options after [`OPTIONS`].
pub fn compile(lib: &sys::Nvrtc, target: Target, extra: &[&str]) -> Result<Compiled, CudaError> {
    let started = Instant::now();
    let source =
        CString::new(SOURCE).map_err(|_| CudaError::Invalid("NUL in kernel source".into()))?;
    let program = nvrtc::create_program(lib, &source, c"iris.cu")
        .map_err(|err| CudaError::nvrtc("nvrtcCreateProgram", err, String::new()))?;
    let program = Program { lib, raw: program };
    let mut options: Vec<String> = OPTIONS.iter().map(|o| (*o).to_owned()).collect();
    options.push(format!("--gpu-architecture={}", target.arch()));
    options.extend(extra.iter().map(|o| (*o).to_owned()));
    let options = options
        .into_iter()
        .map(|option| {
            CString::new(option.clone())
                .map_err(|_| CudaError::Invalid(format!("NUL in NVRTC option `{option}`")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // SAFETY: the program is alive.
    let compiled = unsafe { nvrtc::compile_program(lib, program.raw, &options) };
    let log = program.log();
    compiled.map_err(|err| CudaError::nvrtc("nvrtcCompileProgram", err, log.clone()))?;
    let image = match target {
        // SAFETY (both): the program is alive and compiled, for a real architecture (cubin) or
        // a virtual one (PTX, NUL-terminated).
        Target::Cubin(_) => unsafe { nvrtc::get_cubin(lib, program.raw) }
            .map_err(|err| CudaError::nvrtc("nvrtcGetCUBIN", err, String::new()))?,
        Target::Ptx(_) => unsafe { nvrtc::get_ptx(lib, program.raw) }
            .map_err(|err| CudaError::nvrtc("nvrtcGetPTX", err, String::new()))?,
    };
    Ok(Compiled {
        image,
        target,
        log,
        millis: started.elapsed().as_millis(),
    })
}

/// Register use and spills of one kernel, from the assembler's verbose report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    /// Kernel name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

/// Parses `ptxas info` lines of an NVRTC log compiled with `--ptxas-options=--verbose`.
pub fn resources(log: &str) -> Vec<Resources> {
    let mut found: Vec<Resources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            found.push(Resources {
                name,
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(current) = found.last_mut() {
            if line.contains("bytes spill stores") {
                current.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                current.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("registers") {
                current.registers = number_after(line, "Used ").unwrap_or(0);
            }
        }
    }
    found
}

fn number_before(line: &str, marker: &str) -> Option<u32> {
    let head = line.split(marker).next()?;
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|part| !part.is_empty())?
        .parse()
        .ok()
}

fn number_after(line: &str, marker: &str) -> Option<u32> {
    let tail = line.split(marker).nth(1)?;
    tail.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The on-disk cache of compiled modules.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: Option<PathBuf>,
}

impl Cache {
    /// The cache in `dir`, or no cache.
    pub fn new(dir: Option<PathBuf>) -> Cache {
        Cache { dir }
    }

    /// The cache folder from an option value (`None`: not given), the environment and the
    /// defaults; `off` disables it.
    pub fn locate(option: Option<&str>) -> Cache {
        let chosen = option.map(str::to_owned).or_else(|| {
            std::env::var(CACHE_ENV)
                .ok()
                .filter(|value| !value.is_empty())
        });
        let dir = match chosen.as_deref() {
            Some("off") => None,
            Some(dir) => Some(PathBuf::from(dir)),
            None => std::env::var_os("XDG_CACHE_HOME")
                .filter(|value| !value.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
                .map(|base| base.join("iris/cuda-kernels")),
        };
        Cache { dir }
    }

    /// The folder, if caching.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file a module for `target`, compiled by NVRTC `nvrtc` (`(major, minor)`), for a
    /// driver of version `driver`, is cached in. NVRTC's version is part of the key: another
    /// NVRTC makes other code from the same source (and a fixed NVRTC bug must not stay cached).
    pub fn path(&self, target: Target, driver: i32, nvrtc: (i32, i32)) -> Option<PathBuf> {
        let (major, minor) = nvrtc;
        let name = format!(
            "{}{major}.{minor}.{}",
            self.prefix(target, driver),
            target.ext()
        );
        self.dir.as_ref().map(|dir| dir.join(name))
    }

    /// The cached image for `target` and `driver` and where it was: the one NVRTC `nvrtc` made,
    /// or, when NVRTC is not loadable (`None`), the newest one any NVRTC made.
    pub fn load(
        &self,
        target: Target,
        driver: i32,
        nvrtc: Option<(i32, i32)>,
    ) -> Option<(PathBuf, Vec<u8>)> {
        let path = match nvrtc {
            Some(version) => self.path(target, driver, version)?,
            None => {
                let prefix = self.prefix(target, driver);
                let suffix = format!(".{}", target.ext());
                std::fs::read_dir(self.dir.as_ref()?)
                    .ok()?
                    .flatten()
                    .filter(|entry| {
                        entry.file_name().to_str().is_some_and(|name| {
                            name.starts_with(&prefix) && name.ends_with(&suffix)
                        })
                    })
                    .filter_map(|entry| {
                        let modified = entry.metadata().ok()?.modified().ok()?;
                        Some((modified, entry.path()))
                    })
                    .max()?
                    .1
            }
        };
        let image = std::fs::read(&path)
            .ok()
            .filter(|image| !image.is_empty())?;
        Some((path, image))
    }

    /// Stores an image (written to a temporary file, then renamed, so readers never see half
    /// a file).
    pub fn store(
        &self,
        target: Target,
        driver: i32,
        nvrtc: (i32, i32),
        image: &[u8],
    ) -> std::io::Result<PathBuf> {
        let Some(path) = self.path(target, driver, nvrtc) else {
            return Err(std::io::Error::other("the kernel cache is off"));
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&temp, image)?;
        std::fs::rename(&temp, &path)?;
        Ok(path)
    }

    /// The file name up to NVRTC's version: source and options hash, architecture, driver.
    fn prefix(&self, target: Target, driver: i32) -> String {
        let mut hasher = blake3::Hasher::new();
        hasher.update(SOURCE.as_bytes());
        for option in OPTIONS {
            hasher.update(b"\0");
            hasher.update(option.as_bytes());
        }
        let hash = hasher.finalize().to_hex();
        let arch = match target {
            Target::Cubin(cc) => format!("sm{cc}"),
            Target::Ptx(cc) => format!("compute{cc}"),
        };
        format!("iris-{}-{arch}-driver{driver}-nvrtc", &hash.as_str()[..32])
    }
}

/// A loaded module and its entry points. Unloaded on drop (the context must be current).
pub struct Module {
    module: CUmodule,
    functions: HashMap<String, CUfunction>,
    /// Bytes of the image loaded (a lower bound of the device memory the module holds).
    pub image_bytes: u64,
}

// SAFETY: module and function handles are driver objects usable from any thread while the
// context lives; the map is read-only after `load`.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads an image (cubin, or NUL-terminated PTX) into the current context and looks up
    /// every entry point of [`kernel_names`].
    pub fn load(image: &[u8]) -> Result<Module, CudaError> {
        let mut owned = image.to_vec();
        if owned.last() != Some(&0) {
            // PTX must end with NUL; a cubin ignores trailing bytes.
            owned.push(0);
        }
        // SAFETY: `owned` is a complete module image that outlives the call.
        let module =
            unsafe { result::module::load_data(owned.as_ptr().cast()) }.call("cuModuleLoadData")?;
        let mut loaded = Module {
            module,
            functions: HashMap::new(),
            image_bytes: image.len() as u64,
        };
        for name in kernel_names() {
            // SAFETY: the module is loaded; the name is NUL-free.
            let function = unsafe {
                result::module::get_function(
                    module,
                    CString::new(name.clone()).map_err(|_| CudaError::Invalid(name.clone()))?,
                )
            }
            .call("cuModuleGetFunction")?;
            loaded.functions.insert(name, function);
        }
        Ok(loaded)
    }

    /// The entry point `name`.
    pub fn function(&self, name: &str) -> Result<CUfunction, CudaError> {
        self.functions
            .get(name)
            .copied()
            .ok_or_else(|| CudaError::Invalid(format!("no kernel named `{name}`")))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the module was loaded by `load` and is unloaded once.
        let _ = unsafe { result::module::unload(self.module) };
    }
}

/// An NVRTC program, destroyed on drop.
struct Program<'a> {
    lib: &'a sys::Nvrtc,
    raw: sys::nvrtc::nvrtcProgram,
}

impl Program<'_> {
    fn log(&self) -> String {
        // SAFETY: the program is alive.
        match unsafe { nvrtc::get_program_log(self.lib, self.raw) } {
            Ok(bytes) => {
                let text: Vec<u8> = bytes.into_iter().take_while(|b| *b != 0).collect();
                String::from_utf8_lossy(&text).into_owned()
            }
            Err(_) => String::new(),
        }
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed once.
        let _ = unsafe { nvrtc::destroy_program(self.lib, self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_prefer_machine_code_and_fall_back_to_ptx() {
        let supported = [75, 80, 86, 89, 90];
        assert_eq!(target_for(86, &supported), Target::Cubin(86));
        assert_eq!(target_for(120, &supported), Target::Ptx(90));
        assert_eq!(target_for(87, &supported), Target::Ptx(86));
    }

    #[test]
    fn the_assembler_report_is_parsed_per_kernel() {
        let log = "ptxas info    : Compiling entry function 'norm_f32' for 'sm_80'\n\
                   ptxas info    : Function properties for norm_f32\n\
                   ptxas         .     0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 28 registers, 416 bytes cmem[0]\n";
        assert_eq!(
            resources(log),
            vec![Resources {
                name: "norm_f32".into(),
                registers: 28,
                spill_stores: 8,
                spill_loads: 4,
            }]
        );
    }

    #[test]
    fn cache_keys_name_the_architecture_driver_and_nvrtc() {
        let cache = Cache::new(Some(PathBuf::from("/cache")));
        let path = cache.path(Target::Cubin(90), 12040, (12, 9)).unwrap();
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("iris-") && name.ends_with("-sm90-driver12040-nvrtc12.9.cubin"),
            "{name}"
        );
        assert_ne!(
            cache.path(Target::Cubin(90), 12050, (12, 9)),
            Some(path.clone())
        );
        assert_ne!(cache.path(Target::Cubin(90), 12040, (12, 8)), Some(path));
        assert_eq!(
            Cache::new(None).path(Target::Cubin(90), 12040, (12, 9)),
            None
        );
    }

    #[test]
    fn cache_round_trips_and_without_nvrtc_takes_the_newest_entry() {
        let dir = std::env::temp_dir().join(format!("iris-kernel-cache-{}", std::process::id()));
        let cache = Cache::new(Some(dir.clone()));
        assert_eq!(cache.load(Target::Cubin(80), 1, Some((12, 9))), None);
        assert_eq!(cache.load(Target::Cubin(80), 1, None), None);
        cache
            .store(Target::Cubin(80), 1, (12, 8), b"older")
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        cache
            .store(Target::Cubin(80), 1, (12, 9), b"image")
            .unwrap();
        let image = |nvrtc| {
            cache
                .load(Target::Cubin(80), 1, nvrtc)
                .map(|(_, image)| image)
        };
        assert_eq!(image(Some((12, 9))).as_deref(), Some(&b"image"[..]));
        assert_eq!(image(Some((12, 8))).as_deref(), Some(&b"older"[..]));
        assert_eq!(image(Some((13, 0))), None, "another NVRTC compiles again");
        assert_eq!(image(None).as_deref(), Some(&b"image"[..]));
        assert_eq!(cache.load(Target::Cubin(86), 1, None), None);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn attention_kernels_are_named_and_sized_by_their_queries() {
        assert_eq!(
            flash_attention_name("bf16", 80, 64),
            "flash_attention_bf16_80"
        );
        assert_eq!(
            flash_attention_name("f16", 72, 128),
            "flash_attention_q128_f16_72"
        );
        // Two stages of K and V, 64 rows of 80 + 8; the 128-query kernel adds its queries.
        assert_eq!(flash_attention_shared_bytes(72, 64), 4 * 64 * 88 * 2);
        assert_eq!(
            flash_attention_shared_bytes(80, 128),
            (4 * 64 + 128) * 88 * 2
        );
        // Within the 99 KiB a block may have on sm_86 and sm_89.
        for size in FLASH_ATTENTION_Q128_SIZES {
            assert!(
                flash_attention_shared_bytes(size, 128) <= 99 << 10,
                "{size}"
            );
        }
        assert!(q128_runs_on((8, 0)) && q128_runs_on((9, 0)) && q128_runs_on((10, 0)));
        assert!(!q128_runs_on((8, 6)) && !q128_runs_on((8, 9)) && !q128_runs_on((7, 5)));
    }

    #[test]
    fn every_kernel_in_the_source_is_listed() {
        let names = kernel_names();
        assert_eq!(
            names.len(),
            1 + 3 * (5 + 3 + ATTENTION_SIZES.len())
                + FLASH_ATTENTION_TYPES.len()
                    * (FLASH_ATTENTION_SIZES.len() + FLASH_ATTENTION_Q128_SIZES.len())
                + 3
        );
        for name in [
            "norm",
            "activation",
            "binary",
            "gemm_epilogue",
            "rotary",
            "cast",
            "attention",
            "flash_attention",
            "flash_attention_q128",
            "gather",
            "copy_regions",
        ] {
            assert!(SOURCE.contains(name), "{name}");
        }
    }
}
