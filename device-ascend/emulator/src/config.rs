//! The emulation's settings and fault injection, read from the environment once per process.
//!
//! | Variable | Meaning | Default |
//! |---|---|---|
//! | `ASCEND_EMU_DEVICES` | physical NPUs | 2 |
//! | `ASCEND_EMU_HBM` | memory per NPU (bytes, or with `KiB`..`TiB`) | 16 GiB |
//! | `ASCEND_EMU_SOC` | `aclrtGetSocName()`; only Atlas A2 and A3 parts (`Ascend910B*`, `Ascend910_93*`) have BF16, the fused attention and rotary ops, and f32 matmul with `cubeMathType` 0; every other part (`Ascend910ProB`, `Ascend310B1`, ...) refuses them, as the op documentation lists them; `Ascend310P*` also has DDR memory and no LayerNorm | `Ascend910B3` |
//! | `ASCEND_EMU_STUB` | `1`: behave as CANN's link stubs (every call returns 100039); a folder: only a copy of the library loaded from a file in that folder does (so one install can hold stubs before the real runtime) | off |
//! | `ASCEND_EMU_INIT_ERROR` | `aclInit` returns this code (100002 still initialises, as a second `aclInit` does) | 0 |
//! | `ASCEND_EMU_FAIL_MALLOC_AT` | the N-th device allocation (`aclrtMalloc` or `aclrtMallocAlign32`) of the process fails with 207001 | off |
//! | `ASCEND_EMU_NO_MALLOC_ALIGN32` | `1`: `aclrtMallocAlign32` answers 207000 (not supported), as on a runtime without it | off |
//! | `ASCEND_EMU_FAIL_OP` | an aclnn op (`aclnnSoftmax`) fails: its N-th kernel (`ASCEND_EMU_FAIL_OP_AT`, default 1) reports 507015 at the next synchronisation, or with `ASCEND_EMU_FAIL_OP_WHEN=launch` its N-th launch returns 561000 | off |
//! | `ASCEND_EMU_PANIC_OP` | an aclnn op panics inside the emulation: its N-th kernel (`ASCEND_EMU_PANIC_OP_AT`, default 1) or, with `ASCEND_EMU_PANIC_OP_WHEN=phase1`, its N-th first phase; the emulation catches it and reports an error, as a C library must | off |
//! | `ASCEND_EMU_FAULTED_DESTROY_FAILS` | `1`: the first `aclrtDestroyStream` of each stream in error fails with the stream's fault (a later one succeeds) | off |
//! | `ASCEND_EMU_MAX_EVENTS` | at most this many events live; `aclrtCreateEvent` beyond it fails with 207007 (no event resource) | unbounded |
//! | `ASCEND_EMU_STATS_AT_EXIT` | `1`: print the first phases and events created at process exit, to stderr | off |
//! | `ASCEND_EMU_QUEUE_DELAY_US` | a pause before each queued task, to make missing synchronisation show | 0 |
//!
//! `ASCEND_RT_VISIBLE_DEVICES` is applied as the real runtime applies it.

use std::sync::OnceLock;

/// Default number of emulated NPUs.
pub const DEFAULT_DEVICES: u32 = 2;
/// Default memory per NPU.
pub const DEFAULT_HBM: u64 = 16 << 30;
/// Default SoC name (an Atlas A2 part).
pub const DEFAULT_SOC: &str = "Ascend910B3";

/// When an injected op failure happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// In the first phase (`GetWorkspaceSize`) or the launch, returned by the call.
    Call,
    /// In the kernel on the stream, reported at the next synchronisation.
    Kernel,
}

/// Settings of this process's emulation.
#[derive(Debug, Clone)]
pub struct Config {
    /// Physical NPUs.
    pub devices: u32,
    /// Bytes per NPU.
    pub hbm: u64,
    /// SoC name.
    pub soc: String,
    /// Behave as link stubs.
    pub stub: bool,
    /// `aclInit`'s return value.
    pub init_error: i32,
    /// The 1-based device allocation that fails.
    pub fail_malloc_at: Option<u64>,
    /// `aclrtMallocAlign32` is refused.
    pub no_malloc_align32: bool,
    /// `(op, n, when)`: the n-th run of `op` fails.
    pub fail_op: Option<(String, u64, When)>,
    /// `(op, n, when)`: the n-th run (or first phase) of `op` panics.
    pub panic_op: Option<(String, u64, When)>,
    /// Pause before each queued task, in microseconds.
    pub queue_delay_us: u64,
    /// Most events live at once.
    pub max_events: Option<u64>,
    /// The first destroy of a stream in error fails.
    pub faulted_destroy_fails: bool,
    /// Print counters at exit.
    pub stats_at_exit: bool,
}

impl Config {
    /// Whether the SoC is an Atlas A2 or A3 part, the only ones the op documentation gives
    /// BF16, the fused transformer ops and f32 matmul in f32.
    pub fn is_a2_a3(&self) -> bool {
        self.soc.starts_with("Ascend910B") || self.soc.starts_with("Ascend910_93")
    }

    /// Whether the SoC is an Atlas inference (310P) part.
    pub fn is_310p(&self) -> bool {
        self.soc.starts_with("Ascend310P")
    }
}

/// The process's settings.
pub fn get() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let number = |name: &str| var(name).and_then(|v| v.trim().parse::<u64>().ok());
        let when = |name: &str, default: When| match var(name).as_deref().map(str::trim) {
            Some("launch") | Some("phase1") => When::Call,
            Some("kernel") => When::Kernel,
            _ => default,
        };
        Config {
            devices: number("ASCEND_EMU_DEVICES")
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(DEFAULT_DEVICES),
            hbm: var("ASCEND_EMU_HBM")
                .and_then(|v| parse_bytes(&v))
                .unwrap_or(DEFAULT_HBM),
            soc: var("ASCEND_EMU_SOC").unwrap_or_else(|| DEFAULT_SOC.to_owned()),
            stub: var("ASCEND_EMU_STUB").is_some_and(|v| is_stub(v.trim())),
            init_error: var("ASCEND_EMU_INIT_ERROR")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0),
            fail_malloc_at: number("ASCEND_EMU_FAIL_MALLOC_AT"),
            no_malloc_align32: var("ASCEND_EMU_NO_MALLOC_ALIGN32").is_some_and(|v| v.trim() == "1"),
            fail_op: var("ASCEND_EMU_FAIL_OP").map(|op| {
                (
                    op.trim().to_owned(),
                    number("ASCEND_EMU_FAIL_OP_AT").unwrap_or(1),
                    when("ASCEND_EMU_FAIL_OP_WHEN", When::Kernel),
                )
            }),
            panic_op: var("ASCEND_EMU_PANIC_OP").map(|op| {
                (
                    op.trim().to_owned(),
                    number("ASCEND_EMU_PANIC_OP_AT").unwrap_or(1),
                    when("ASCEND_EMU_PANIC_OP_WHEN", When::Kernel),
                )
            }),
            queue_delay_us: number("ASCEND_EMU_QUEUE_DELAY_US").unwrap_or(0),
            max_events: var("ASCEND_EMU_MAX_EVENTS").and_then(|v| v.trim().parse().ok()),
            faulted_destroy_fails: var("ASCEND_EMU_FAULTED_DESTROY_FAILS")
                .is_some_and(|v| v.trim() == "1"),
            stats_at_exit: var("ASCEND_EMU_STATS_AT_EXIT").is_some_and(|v| v.trim() == "1"),
        }
    })
}

/// Whether this copy of the library is a stub: `1` always; a folder when the file this copy
/// was loaded from lies in it (a copy, not a link: the dynamic loader shares one copy among
/// links to the same file).
fn is_stub(setting: &str) -> bool {
    if setting == "1" {
        return true;
    }
    let Some(loaded) = own_file() else {
        return false;
    };
    let canonical = |path: &std::path::Path| std::fs::canonicalize(path).ok();
    match (
        canonical(std::path::Path::new(setting)),
        loaded.parent().and_then(canonical),
    ) {
        (Some(folder), Some(dir)) => folder == dir,
        _ => false,
    }
}

/// The file this code was loaded from, as the dynamic loader names it.
fn own_file() -> Option<std::path::PathBuf> {
    // SAFETY: `Dl_info` is plain data (pointers and integers): all zeros is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let address = is_stub as *const libc::c_void;
    // SAFETY: `address` is code of this library; `info` is a valid out-pointer.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, owned by the loader while the library is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(
        name.to_bytes(),
    )))
}

/// Bytes with an optional binary or decimal unit: `4096`, `8GiB`, `512 MiB`, `2GB`.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().ok()?;
    let unit: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return None,
    };
    number.checked_mul(unit).filter(|bytes| *bytes > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_units() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("8GiB"), Some(8 << 30));
        assert_eq!(parse_bytes("512 MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("0"), None);
        assert_eq!(parse_bytes("lots"), None);
    }
}
