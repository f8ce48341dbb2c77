//! The CPU device: options, description, memory and transfers. Ops live in [`crate::ops`].

use iris_plugin::abi::{
    ActivationArgs, AttentionArgs, BinaryArgs, BufferHandle, CastArgs, CopyRegion, DType,
    DeviceDesc, GatherArgs, GemmArgs, MemInfo, NormArgs, PluginError, Rope2dArgs,
};

use crate::error::invalid;
use crate::memory::{Memory, check_range};

/// Share of physical memory the device offers when no `capacity` option is given: leaves room
/// for the host process, the page cache and the preprocessing that runs beside the device.
pub const DEFAULT_CAPACITY_FRACTION: f64 = 0.5;
/// Capacity used when physical memory cannot be read (not Linux, or no /proc).
pub const FALLBACK_CAPACITY: u64 = 4 << 30;

/// Options of [`CpuDevice::open`], from the `[plugins.cpu]` table of the config.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuOptions {
    /// Worker threads for ops (default: the available parallelism).
    pub threads: usize,
    /// Bytes of "device memory" the device offers (default: half of physical memory).
    pub capacity: u64,
}

impl CpuOptions {
    /// Defaults for this machine.
    pub fn defaults() -> CpuOptions {
        CpuOptions {
            threads: std::thread::available_parallelism().map_or(1, usize::from),
            capacity: default_capacity(),
        }
    }

    /// Parses `key = value` options: `threads` (a positive integer) and `capacity` (bytes,
    /// with an optional `KiB`/`MiB`/`GiB`/`TiB` or `KB`/`MB`/`GB`/`TB` suffix, or a fraction
    /// of physical memory such as `0.25`). Unknown keys are errors naming the key.
    pub fn parse(pairs: &[(&str, &str)]) -> Result<CpuOptions, PluginError> {
        let mut options = CpuOptions::defaults();
        for (key, value) in pairs {
            match *key {
                "threads" => {
                    options.threads = value
                        .trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|threads| *threads > 0)
                        .ok_or_else(|| {
                            invalid(
                                "open",
                                format!(
                                    "option `threads`: expected a positive integer, got `{value}`"
                                ),
                            )
                        })?;
                }
                "capacity" => {
                    options.capacity = parse_capacity(value).ok_or_else(|| {
                        invalid(
                            "open",
                            format!(
                                "option `capacity`: expected bytes (e.g. `8GiB`) or a fraction of memory in (0, 1], got `{value}`"
                            ),
                        )
                    })?;
                }
                other => {
                    return Err(invalid(
                        "open",
                        format!("unknown option `{other}` (known: threads, capacity)"),
                    ));
                }
            }
        }
        Ok(options)
    }
}

/// The reference device: host memory behind opaque handles, ops on a rayon pool.
pub struct CpuDevice {
    pub(crate) memory: Memory,
    pub(crate) pool: rayon::ThreadPool,
    pub(crate) options: CpuOptions,
}

impl CpuDevice {
    /// Opens the device with parsed options.
    pub fn open(options: CpuOptions) -> Result<CpuDevice, PluginError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(options.threads)
            .thread_name(|index| format!("iris-cpu-{index}"))
            .build()
            .map_err(|err| PluginError::internal(format!("open: cannot start threads: {err}")))?;
        Ok(CpuDevice {
            memory: Memory::new(options.capacity),
            pool,
            options,
        })
    }

    /// The options the device was opened with.
    pub fn options(&self) -> &CpuOptions {
        &self.options
    }

    pub(crate) fn describe_impl(&self) -> DeviceDesc {
        DeviceDesc {
            name: format!("CPU ({} threads)", self.options.threads).into(),
            vendor: cpu_vendor().into(),
            total_memory: self.options.capacity,
            dtypes: DType::ALL.to_vec().into(),
            ops: crate::ops::SUPPORTED.to_vec().into(),
        }
    }

    pub(crate) fn mem_info_impl(&self) -> MemInfo {
        self.memory.mem_info()
    }

    pub(crate) fn write_impl(
        &self,
        dst: BufferHandle,
        offset: u64,
        src: &[u8],
    ) -> Result<(), PluginError> {
        let region = self.memory.region("write", dst)?;
        let start = check_range("write", "dst", &region, offset, src.len() as u64)?;
        // SAFETY: the range is inside the region (checked); `src` is host memory the caller
        // lent us, which cannot overlap a device region.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), region.ptr().add(start), src.len());
        }
        Ok(())
    }

    pub(crate) fn read_impl(
        &self,
        src: BufferHandle,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), PluginError> {
        let region = self.memory.region("read", src)?;
        let start = check_range("read", "src", &region, offset, dst.len() as u64)?;
        // SAFETY: the range is inside the region (checked); `dst` is host memory.
        unsafe {
            std::ptr::copy_nonoverlapping(region.ptr().add(start), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    pub(crate) fn copy_regions_impl(
        &self,
        op: &str,
        dst: BufferHandle,
        src: BufferHandle,
        regions: &[CopyRegion],
    ) -> Result<(), PluginError> {
        let dst_region = self.memory.region(op, dst)?;
        let src_region = self.memory.region(op, src)?;
        // Validate everything before copying anything, so a bad region leaves dst untouched.
        let mut checked = Vec::with_capacity(regions.len());
        for (index, region) in regions.iter().enumerate() {
            let what_src = format!("region {index} source");
            let what_dst = format!("region {index} destination");
            let s = check_range(op, &what_src, &src_region, region.src_offset, region.bytes)?;
            let d = check_range(op, &what_dst, &dst_region, region.dst_offset, region.bytes)?;
            let len = usize::try_from(region.bytes)
                .map_err(|_| invalid(op, format!("region {index}: length too large")))?;
            checked.push((s, d, len));
        }
        if dst == src {
            for (index, &(s, d, len)) in checked.iter().enumerate() {
                for &(s2, _, len2) in &checked {
                    if d < s2 + len2 && s2 < d + len {
                        return Err(invalid(
                            op,
                            format!("region {index} destination overlaps a source region"),
                        ));
                    }
                }
                let _ = s;
            }
        }
        for (s, d, len) in checked {
            // SAFETY: both ranges are inside their regions (checked) and, within one buffer,
            // do not overlap (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src_region.ptr().add(s),
                    dst_region.ptr().add(d),
                    len,
                );
            }
        }
        Ok(())
    }
}

impl iris_plugin::Backend for CpuDevice {
    fn describe(&self) -> DeviceDesc {
        self.describe_impl()
    }

    fn mem_info(&self) -> Result<MemInfo, PluginError> {
        Ok(self.mem_info_impl())
    }

    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        self.memory.alloc(bytes)
    }

    fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        self.memory.free(buf)
    }

    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        self.write_impl(dst, offset, src)
    }

    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        self.read_impl(src, offset, dst)
    }

    fn copy(
        &self,
        dst: BufferHandle,
        dst_offset: u64,
        src: BufferHandle,
        src_offset: u64,
        bytes: u64,
    ) -> Result<(), PluginError> {
        let region = CopyRegion {
            src_offset,
            dst_offset,
            bytes,
        };
        self.copy_regions_impl("copy", dst, src, &[region])
    }

    fn copy_regions(
        &self,
        dst: BufferHandle,
        src: BufferHandle,
        regions: &[CopyRegion],
    ) -> Result<(), PluginError> {
        self.copy_regions_impl("copy_regions", dst, src, regions)
    }

    fn synchronize(&self) -> Result<(), PluginError> {
        // Every op runs to completion before returning.
        Ok(())
    }

    fn gemm(&self, args: &GemmArgs) -> Result<(), PluginError> {
        self.gemm_impl(args)
    }

    fn layer_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.layer_norm_impl(args)
    }

    fn rms_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        self.rms_norm_impl(args)
    }

    fn activation(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        self.activation_impl(args)
    }

    fn binary(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        self.binary_impl(args)
    }

    fn rope_2d(&self, args: &Rope2dArgs<'_>) -> Result<(), PluginError> {
        self.rope_2d_impl(args)
    }

    fn attention_workspace(&self, args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        self.attention_workspace_impl(args)
    }

    fn attention(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        self.attention_impl(args)
    }

    fn gather_rows(&self, args: &GatherArgs<'_>) -> Result<(), PluginError> {
        self.gather_rows_impl(args)
    }

    fn cast(&self, args: &CastArgs) -> Result<(), PluginError> {
        self.cast_impl(args)
    }
}

/// Physical memory times [`DEFAULT_CAPACITY_FRACTION`].
pub fn default_capacity() -> u64 {
    physical_memory().map_or(FALLBACK_CAPACITY, |total| {
        fraction_of(total, DEFAULT_CAPACITY_FRACTION)
    })
}

fn fraction_of(total: u64, fraction: f64) -> u64 {
    // Memory sizes are far below 2^53, where f64 is exact enough for a capacity.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let bytes = (total as f64 * fraction) as u64;
    bytes
}

fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn parse_capacity(value: &str) -> Option<u64> {
    let value = value.trim();
    if value.contains('.') && !value.chars().any(char::is_alphabetic) {
        let fraction: f64 = value.parse().ok()?;
        if !(fraction > 0.0 && fraction <= 1.0) {
            return None;
        }
        return Some(fraction_of(
            physical_memory().unwrap_or(FALLBACK_CAPACITY),
            fraction,
        ));
    }
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let number: u64 = digits.parse().ok()?;
    let multiplier: u64 = match unit.trim() {
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
    number.checked_mul(multiplier).filter(|bytes| *bytes > 0)
}

fn cpu_vendor() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_accepts_units_and_fractions() {
        assert_eq!(parse_capacity("1024"), Some(1024));
        assert_eq!(parse_capacity("2GiB"), Some(2 << 30));
        assert_eq!(parse_capacity("3 MB"), Some(3_000_000));
        assert!(parse_capacity("0.25").is_some());
        assert_eq!(parse_capacity("1.5"), None);
        assert_eq!(parse_capacity("0"), None);
        assert_eq!(parse_capacity("12 parsecs"), None);
    }

    #[test]
    fn unknown_options_name_the_key() {
        let err = CpuOptions::parse(&[("thread", "2")]).unwrap_err();
        assert!(err.message.contains("`thread`"), "{}", err.message);
        let err = CpuOptions::parse(&[("threads", "zero")]).unwrap_err();
        assert!(err.message.contains("threads"), "{}", err.message);
        let options = CpuOptions::parse(&[("threads", "3"), ("capacity", "1MiB")]).unwrap();
        assert_eq!((options.threads, options.capacity), (3, 1 << 20));
    }

    #[test]
    fn overlapping_copies_within_a_buffer_are_rejected() {
        let device = CpuDevice::open(CpuOptions {
            threads: 1,
            capacity: 1 << 20,
        })
        .unwrap();
        let buf = device.memory.alloc(64).unwrap();
        let overlapping = CopyRegion {
            src_offset: 0,
            dst_offset: 8,
            bytes: 16,
        };
        assert!(
            device
                .copy_regions_impl("copy", buf, buf, &[overlapping])
                .is_err()
        );
        let disjoint = CopyRegion {
            src_offset: 0,
            dst_offset: 32,
            bytes: 16,
        };
        assert!(
            device
                .copy_regions_impl("copy", buf, buf, &[disjoint])
                .is_ok()
        );
    }
}
