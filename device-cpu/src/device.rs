//! The CPU device: options, description, memory, transfers and the queue. Ops live in
//! [`crate::ops`], the queue in [`crate::queue`], fault injection in [`crate::faults`].

use std::sync::Arc;
use std::time::Duration;

use iris_plugin::Logger;
use iris_plugin::abi::{
    ActivationArgs, AsyncWrite, AttentionArgs, BinaryArgs, BufferHandle, CastArgs, CopyRegion,
    DType, DeviceDesc, FillArgs, GatherArgs, GemmArgs, HeldMemory, HostAlloc, HostBufferId,
    MemInfo, MemoryReport, NormArgs, OpKind, PluginError, Property, RotaryArgs, StagedCopy,
    property,
};
use iris_plugin::validate::{self, Checker};

use crate::error::invalid;
use crate::faults::{self, Faults};
use crate::isa::{ISA_ENV, Tier};
use crate::memory::{Memory, Region, check_range};
use crate::ops::Touches;
use crate::ops::native::PackCache;
use crate::queue::{Exec, Queue, QueueMode};

/// Share of physical memory the device offers when no `capacity` option is given: leaves room
/// for the host process, the page cache and the preprocessing that runs beside the device.
pub const DEFAULT_CAPACITY_FRACTION: f64 = 0.5;
/// Capacity used when physical memory cannot be read (not Linux, or no /proc).
pub const FALLBACK_CAPACITY: u64 = 4 << 30;
/// Environment variable that sets the default of the `queue` option (`sync` or `async`).
pub const QUEUE_ENV: &str = "IRIS_CPU_QUEUE";

/// Options of [`CpuDevice::open`], from the `[plugins.cpu]` table of the config.
#[derive(Debug)]
pub struct CpuOptions {
    /// Worker threads for ops (default: the available parallelism).
    pub threads: usize,
    /// Bytes of "device memory" the device offers (default: half of physical memory).
    pub capacity: u64,
    /// How calls complete (default: `async`, or [`QUEUE_ENV`]).
    pub queue: QueueMode,
    /// Delay before each queued item in async mode, to make missing synchronisation show
    /// deterministically in tests (default: none).
    pub queue_delay: Duration,
    /// Fill new buffers with 0xFF (a NaN in every float dtype) instead of zeros.
    pub poison: bool,
    /// Injected faults (default: none).
    pub faults: Faults,
    /// The kernel tier asked for (default: [`ISA_ENV`], else the best the CPU runs); one the
    /// CPU lacks runs as the best it has.
    pub isa: Option<Tier>,
}

impl CpuOptions {
    /// Defaults for this machine.
    pub fn defaults() -> CpuOptions {
        CpuOptions {
            threads: std::thread::available_parallelism().map_or(1, usize::from),
            capacity: default_capacity(),
            queue: default_queue(),
            queue_delay: Duration::ZERO,
            poison: false,
            faults: Faults::default(),
            isa: None,
        }
    }

    /// Parses `key = value` options: `threads` (a positive integer), `capacity` (bytes, with
    /// an optional `KiB`/`MiB`/`GiB`/`TiB` or `KB`/`MB`/`GB`/`TB` suffix, or a fraction of
    /// physical memory such as `0.25`), `queue` (`sync` or `async`), `queue_delay_us`,
    /// `poison` (`true`/`false`) and the fault options of [`crate::faults`]. Unknown keys are
    /// errors naming the key.
    pub fn parse(pairs: &[(&str, &str)]) -> Result<CpuOptions, PluginError> {
        let mut options = CpuOptions::defaults();
        for (key, value) in pairs {
            let bad = |expected: &str| {
                invalid(
                    "open",
                    format!("option `{key}`: expected {expected}, got `{value}`"),
                )
            };
            match *key {
                "threads" => {
                    options.threads = value
                        .trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|threads| *threads > 0)
                        .ok_or_else(|| bad("a positive integer"))?;
                }
                "capacity" => {
                    options.capacity = parse_capacity(value).ok_or_else(|| {
                        bad("bytes (e.g. `8GiB`) or a fraction of memory in (0, 1]")
                    })?;
                }
                "queue" => {
                    options.queue = parse_queue(value).ok_or_else(|| bad("`sync` or `async`"))?;
                }
                "queue_delay_us" => {
                    let micros: u64 = value
                        .trim()
                        .parse()
                        .map_err(|_| bad("microseconds (an integer)"))?;
                    options.queue_delay = Duration::from_micros(micros);
                }
                "isa" => {
                    options.isa = Some(Tier::parse(value).ok_or_else(|| bad(TIER_NAMES))?);
                }
                "poison" => {
                    options.poison = value
                        .trim()
                        .parse::<bool>()
                        .map_err(|_| bad("`true` or `false`"))?;
                }
                other => {
                    let known = faults::parse_option(&mut options.faults, other, value)
                        .map_err(|message| invalid("open", message))?;
                    if !known {
                        return Err(invalid(
                            "open",
                            format!(
                                "unknown option `{other}` (known: threads, capacity, queue, queue_delay_us, poison, isa, {})",
                                faults::KEYS.join(", ")
                            ),
                        ));
                    }
                }
            }
        }
        Ok(options)
    }
}

/// The reference device: host memory behind opaque handles, ops on a rayon pool behind an
/// in-order queue.
pub struct CpuDevice {
    /// First, so that dropping the device finishes queued work before anything else goes.
    queue: Queue,
    pub(crate) memory: Arc<Memory>,
    pub(crate) options: CpuOptions,
    /// The kernel tier in use.
    tier: Tier,
    /// Packed copies of constant weights (see [`crate::ops::native`]).
    pub(crate) packs: Arc<PackCache>,
    log: Logger,
}

impl CpuDevice {
    /// Opens the device with parsed options; `log` carries messages to the host.
    pub fn open(options: CpuOptions, log: Logger) -> Result<CpuDevice, PluginError> {
        let requested = match options.isa {
            Some(tier) => tier,
            None => tier_from_env()?,
        };
        let (tier, note) = Tier::resolve(requested);
        if let Some(note) = note {
            log.warn(note);
        } else if tier == Tier::best()
            && let Some(why) = Tier::best_note()
        {
            log.info(why);
        }
        let exec = Exec::new(options.threads, tier)?;
        let queue = Queue::new(options.queue, exec, options.queue_delay)?;
        if options.faults.any() {
            log.warn(format!("fault injection is on: {:?}", options.faults));
        }
        log.debug(format!(
            "opened: {} threads, {} bytes, {} queue, kernel tier {tier}",
            options.threads,
            options.capacity,
            options.queue.name()
        ));
        Ok(CpuDevice {
            memory: Arc::new(Memory::new(options.capacity, options.poison)),
            options,
            tier,
            packs: Arc::new(PackCache::default()),
            queue,
            log,
        })
    }

    /// The options the device was opened with.
    pub fn options(&self) -> &CpuOptions {
        &self.options
    }

    /// The kernel tier in use.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Bytes the packed weight copies add to the buffers they come from (counted in the
    /// memory report): the panels' padding, and the whole copy of a weight whose bytes could
    /// not be given back.
    pub fn packed_bytes(&self) -> u64 {
        self.packs.bytes()
    }

    /// Bytes of weight buffers whose pages the packed copies replaced.
    pub fn replaced_bytes(&self) -> u64 {
        self.packs.released_bytes()
    }

    /// Buffer lengths for [`iris_plugin::validate`].
    pub(crate) fn lens(&self) -> impl Fn(BufferHandle) -> Option<u64> + '_ {
        |buf| self.memory.len_of(buf)
    }

    /// Queues a prepared op, failing it when it runs if a fault is injected for this call.
    /// Before it runs, packed weights over the bytes it touches are put back in place.
    fn submit_op<J: Touches + Send + 'static>(
        &self,
        op: OpKind,
        name: &'static str,
        job: J,
        run: fn(&J, &Exec) -> Result<(), PluginError>,
    ) -> Result<(), PluginError> {
        let panics = self.options.faults.op_panics;
        let packs = Arc::clone(&self.packs);
        // The call is counted for fault injection only once it is certain to be queued: a call
        // answered with an earlier failure is not run, so it must not use up the fault.
        self.queue.submit_with(name, || {
            let fault = self.options.faults.on_op(op);
            Box::new(move |exec| match fault {
                Some(err) if panics => panic!("{}", err.message),
                Some(err) => Err(err),
                None => {
                    for touch in job.touches() {
                        packs.touch(touch.buf, touch.start, touch.end);
                    }
                    run(&job, exec)
                }
            })
        })
    }

    /// Checks a host staging range.
    fn host_range(
        &self,
        op: &'static str,
        id: HostBufferId,
        offset: u64,
        bytes: u64,
    ) -> Result<(Arc<Region>, usize), PluginError> {
        let region = self.memory.host_region(op, id.0)?;
        let start = check_range(op, "host range", &region, offset, bytes)?;
        Ok((region, start))
    }

    /// Enqueues a copy between a host staging buffer and device memory, either way.
    fn staged(
        &self,
        op: &'static str,
        copy: &StagedCopy,
        to_device: bool,
    ) -> Result<(), PluginError> {
        let (host, host_start) = self.host_range(op, copy.host, copy.host_offset, copy.bytes)?;
        let len = usize::try_from(copy.bytes).unwrap_or(0);
        self.enqueue_on_range(
            op,
            copy.device,
            copy.device_offset,
            copy.bytes,
            move |device, device_start| {
                // SAFETY: ranges inside their regions (checked); host and device regions are
                // distinct allocations; the host leaves the range alone until a fence after
                // this work completes (ABI contract).
                unsafe {
                    if to_device {
                        copy_between(&host, host_start, device, device_start, len);
                    } else {
                        copy_between(device, device_start, &host, host_start, len);
                    }
                }
            },
        )
    }

    /// Checks `bytes` of device buffer `buf` from `offset` and enqueues `copy` on them: in
    /// queue order, after the buffer's packed copies of the range are marked stale (a product
    /// queued earlier still reads the packed copy). `copy` gets the region and the range's
    /// start.
    fn enqueue_on_range(
        &self,
        op: &'static str,
        buf: BufferHandle,
        offset: u64,
        bytes: u64,
        copy: impl FnOnce(&Region, usize) + Send + 'static,
    ) -> Result<(), PluginError> {
        let (region, start) = self.device_range(op, "device", buf, offset, bytes)?;
        let packs = Arc::clone(&self.packs);
        self.queue.submit(
            op,
            Box::new(move |_| {
                packs.touch(buf, offset, offset + bytes);
                copy(&region, start);
                Ok(())
            }),
        )
    }

    /// Checks a device range and resolves its region and start.
    fn device_range(
        &self,
        op: &'static str,
        name: &str,
        buf: BufferHandle,
        offset: u64,
        bytes: u64,
    ) -> Result<(Arc<Region>, usize), PluginError> {
        let lens = self.lens();
        validate::range(&Checker::new(op, &lens), name, buf, offset, bytes)?;
        let region = self.memory.region(op, buf)?;
        let start = check_range(op, name, &region, offset, bytes)?;
        Ok((region, start))
    }
}

/// Copies `len` bytes between two regions.
///
/// # Safety
/// Both ranges lie inside their regions and do not overlap; no other thread writes them during
/// the copy (the queue orders work).
unsafe fn copy_between(src: &Region, src_start: usize, dst: &Region, dst_start: usize, len: usize) {
    // SAFETY: forwarded to the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(src.ptr().add(src_start), dst.ptr().add(dst_start), len);
    }
}

impl CpuDevice {
    /// The `peak_flops` property: one core's timed f32 multiply-add roof for the tier's SIMD
    /// times the threads; bf16 at the native dot's measured speed where the tier runs it, else
    /// at f32's (the kernels widen bf16 and f16 to f32).
    fn peak_flops(&self) -> Option<String> {
        let f32_peak =
            crate::isa::f32_core_roof(self.tier.simd())? * self.options.threads.max(1) as f64;
        let bf16_peak = match self.tier {
            Tier::Avx512Bf16 | Tier::Amx => f32_peak * crate::isa::bf16_dot_speed().unwrap_or(1.0),
            _ => f32_peak,
        };
        Some(format!(
            "f32={f32_peak:.4e},bf16={bf16_peak:.4e},f16={f32_peak:.4e}"
        ))
    }
}

impl iris_plugin::Backend for CpuDevice {
    fn describe(&self) -> DeviceDesc {
        DeviceDesc {
            name: format!("CPU ({} threads)", self.options.threads).into(),
            vendor: cpu_vendor().into(),
            total_memory: self.options.capacity,
            dtypes: DType::ALL.to_vec().into(),
            ops: crate::ops::SUPPORTED.to_vec().into(),
            properties: vec![
                Property::new(property::QUEUE, self.queue.mode().name()),
                Property::new(property::COMPUTE_UNITS, self.options.threads),
                Property::new(property::KERNEL_TIER, self.tier),
                // What the matrix products and the other vector code run on, set by the tier.
                Property::new(GEMM_ISA, self.tier.simd().name()),
            ]
            .into_iter()
            // Why the default tier is what it is, on CPUs with AVX512-BF16.
            .chain(
                crate::isa::bf16_dot_speed()
                    .map(|speed| Property::new(BF16_DOT_SPEED, format!("{speed:.2}"))),
            )
            .chain(
                self.peak_flops()
                    .map(|peak| Property::new(property::PEAK_FLOPS, peak)),
            )
            .collect::<Vec<_>>()
            .into(),
        }
    }

    fn mem_info(&self) -> Result<MemInfo, PluginError> {
        // What packed copies add is device memory as much as buffers are: a host budgeting by
        // `free` sees it (as the non-allocator memory the memory report names).
        let info = self.memory.mem_info();
        Ok(MemInfo {
            free: info.free.saturating_sub(self.packs.bytes()),
            ..info
        })
    }

    fn memory_report(&self) -> Result<MemoryReport, PluginError> {
        let (allocated, buffers) = self.memory.usage();
        Ok(MemoryReport {
            allocated,
            buffers,
            held: held_memory(self.packs.bytes()).into(),
        })
    }

    fn alloc(&self, bytes: u64) -> Result<BufferHandle, PluginError> {
        // Packed copies take capacity as buffers do (`mem_info` counts them); an injected
        // fault counts only allocations that would otherwise be made.
        self.memory.alloc(bytes, self.packs.bytes(), || {
            self.options.faults.on_alloc(bytes)
        })
    }

    fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        // Queued work holds the region: the memory goes when that work is done.
        self.memory.free(buf)?;
        // After the table forgets the buffer, so a product still queued cannot re-add a copy
        // (see `PackCache::get_or_pack`); the copies' bytes go now, the buffer's with its
        // region.
        self.packs.evict(buf);
        Ok(())
    }

    fn write(&self, dst: BufferHandle, offset: u64, src: &[u8]) -> Result<(), PluginError> {
        let (region, start) = self.device_range("write", "dst", dst, offset, src.len() as u64)?;
        if self.queue.mode() == QueueMode::Sync {
            self.packs.touch(dst, offset, offset + src.len() as u64);
            // SAFETY: the range is inside the region (checked); `src` is host memory the
            // caller lent us, which cannot overlap a device region.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), region.ptr().add(start), src.len());
            }
            return Ok(());
        }
        // Asynchronous: the bytes travel with the work, so `src` is free on return.
        let data = src.to_vec();
        let packs = Arc::clone(&self.packs);
        self.queue.submit(
            "write",
            Box::new(move |_| {
                packs.touch(dst, offset, offset + data.len() as u64);
                // SAFETY: as above; the region lives in this closure.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        region.ptr().add(start),
                        data.len(),
                    );
                }
                Ok(())
            }),
        )
    }

    fn read(&self, src: BufferHandle, offset: u64, dst: &mut [u8]) -> Result<(), PluginError> {
        let (region, start) = self.device_range("read", "src", src, offset, dst.len() as u64)?;
        self.queue.synchronize()?;
        // A packed weight is unpacked into place: the bytes read are the ones written.
        self.packs.touch(src, offset, offset + dst.len() as u64);
        // SAFETY: the range is inside the region (checked) and the work before this call is
        // done; `dst` is host memory.
        unsafe {
            std::ptr::copy_nonoverlapping(region.ptr().add(start), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    fn copy_batch(&self, regions: &[CopyRegion]) -> Result<(), PluginError> {
        const OP: &str = "copy_batch";
        let lens = self.lens();
        validate::copy_batch(&Checker::new(OP, &lens), regions)?;
        let mut copies = Vec::with_capacity(regions.len());
        for region in regions.iter().filter(|r| r.bytes > 0) {
            let src = self.memory.region(OP, region.src)?;
            let dst = self.memory.region(OP, region.dst)?;
            let src_start = check_range(OP, "src", &src, region.src_offset, region.bytes)?;
            let dst_start = check_range(OP, "dst", &dst, region.dst_offset, region.bytes)?;
            // The length is inside a region, so it fits in usize.
            let len = usize::try_from(region.bytes).unwrap_or(0);
            let touched = [
                (region.src, region.src_offset),
                (region.dst, region.dst_offset),
            ]
            .map(|(buf, offset)| (buf, offset, offset + region.bytes));
            copies.push((src, src_start, dst, dst_start, len, touched));
        }
        let packs = Arc::clone(&self.packs);
        self.queue.submit(
            OP,
            Box::new(move |_| {
                for (src, src_start, dst, dst_start, len, touched) in &copies {
                    for (buf, first, end) in touched {
                        packs.touch(*buf, *first, *end);
                    }
                    // SAFETY: ranges inside their regions (checked); no destination overlaps
                    // another region's destination or any source (validated).
                    unsafe { copy_between(src, *src_start, dst, *dst_start, *len) };
                }
                Ok(())
            }),
        )
    }

    fn fill(&self, args: &FillArgs) -> Result<(), PluginError> {
        const OP: &str = "fill";
        let lens = self.lens();
        validate::fill(&Checker::new(OP, &lens), args)?;
        if args.dst.bytes == 0 {
            return Ok(());
        }
        let (region, start) =
            self.device_range(OP, "dst", args.dst.buf, args.dst.offset, args.dst.bytes)?;
        let len = usize::try_from(args.dst.bytes).unwrap_or(0);
        let (value, width) = (args.value, args.width);
        let packs = Arc::clone(&self.packs);
        let (filled, first, end) = (
            args.dst.buf,
            args.dst.offset,
            args.dst.offset + args.dst.bytes,
        );
        self.queue.submit(
            OP,
            Box::new(move |_| {
                packs.touch(filled, first, end);
                // SAFETY: the range is inside the region (checked), which this work holds.
                let bytes = unsafe { std::slice::from_raw_parts_mut(region.ptr().add(start), len) };
                let pattern = value.to_le_bytes();
                let width = width as usize;
                if width == 1 || pattern[..width].iter().all(|b| *b == pattern[0]) {
                    bytes.fill(pattern[0]);
                } else {
                    for chunk in bytes.chunks_exact_mut(width) {
                        chunk.copy_from_slice(&pattern[..width]);
                    }
                }
                Ok(())
            }),
        )
    }

    fn synchronize(&self) -> Result<(), PluginError> {
        self.queue.synchronize()
    }

    fn gemm(&self, args: &GemmArgs) -> Result<(), PluginError> {
        let job = self.prepare_gemm(args)?;
        self.submit_op(OpKind::GEMM, "gemm", job, |job, exec| job.run(exec))
    }

    fn layer_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        let job = self.prepare_norm(args, false)?;
        self.submit_op(OpKind::LAYER_NORM, "layer_norm", job, |job, exec| {
            job.run(exec)
        })
    }

    fn rms_norm(&self, args: &NormArgs) -> Result<(), PluginError> {
        let job = self.prepare_norm(args, true)?;
        self.submit_op(OpKind::RMS_NORM, "rms_norm", job, |job, exec| job.run(exec))
    }

    fn activation(&self, args: &ActivationArgs) -> Result<(), PluginError> {
        let job = self.prepare_activation(args)?;
        self.submit_op(OpKind::ACTIVATION, "activation", job, |job, exec| {
            job.run(exec)
        })
    }

    fn binary(&self, args: &BinaryArgs) -> Result<(), PluginError> {
        let job = self.prepare_binary(args)?;
        self.submit_op(OpKind::BINARY, "binary", job, |job, exec| job.run(exec))
    }

    fn rotary(&self, args: &RotaryArgs) -> Result<(), PluginError> {
        let job = self.prepare_rotary(args)?;
        self.submit_op(OpKind::ROTARY, "rotary", job, |job, exec| job.run(exec))
    }

    fn attention_workspace(&self, args: &AttentionArgs<'_>) -> Result<u64, PluginError> {
        self.attention_workspace_impl(args)
    }

    fn attention(&self, args: &AttentionArgs<'_>) -> Result<(), PluginError> {
        let job = self.prepare_attention(args)?;
        self.submit_op(OpKind::ATTENTION, "attention", job, |job, exec| {
            job.run(exec)
        })
    }

    fn gather_rows(&self, args: &GatherArgs) -> Result<(), PluginError> {
        let job = self.prepare_gather(args)?;
        self.submit_op(OpKind::GATHER_ROWS, "gather_rows", job, |job, exec| {
            job.run(exec)
        })
    }

    fn cast(&self, args: &CastArgs) -> Result<(), PluginError> {
        let job = self.prepare_cast(args)?;
        self.submit_op(OpKind::CAST, "cast", job, |job, exec| job.run(exec))
    }

    fn alloc_host(&self, bytes: u64) -> Result<HostAlloc, PluginError> {
        let (id, region) = self.memory.alloc_host(bytes)?;
        Ok(HostAlloc {
            id: HostBufferId(id),
            ptr: region.ptr(),
            len: region.len() as u64,
        })
    }

    fn free_host(&self, id: HostBufferId) -> Result<(), PluginError> {
        self.memory.free_host(id.0)
    }

    fn upload(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        self.staged("upload", copy, true)
    }

    fn download(&self, copy: &StagedCopy) -> Result<(), PluginError> {
        self.staged("download", copy, false)
    }

    fn fence(&self) -> Result<u64, PluginError> {
        Ok(self.queue.fence())
    }

    fn wait_fence(&self, value: u64) -> Result<(), PluginError> {
        self.queue.wait(value)
    }

    fn write_async(&self, write: &AsyncWrite) -> Result<(), PluginError> {
        let len = usize::try_from(write.bytes).unwrap_or(0);
        if write.host.is_null() && len > 0 {
            return Err(invalid("write_async", "the host source is a null pointer"));
        }
        let source = HostSource(write.host);
        self.enqueue_on_range(
            "write_async",
            write.device,
            write.device_offset,
            write.bytes,
            move |region, start| {
                let source = source;
                // SAFETY: the device range lies inside its region (checked); the host keeps
                // `len` bytes at the source alive and unchanged until a fence after this work
                // completes (ABI contract), and host memory is never a device region.
                unsafe {
                    std::ptr::copy_nonoverlapping(source.0, region.ptr().add(start), len);
                }
            },
        )
    }
}

/// A host address lent to the queue by `write_async`.
struct HostSource(*const u8);

// SAFETY: the host lends the memory until a fence after the write completes, whichever thread
// reads it (ABI contract of `write_async`).
unsafe impl Send for HostSource {}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        // The queue, dropped first (field order), finishes the work already queued.
        self.log.debug("closing");
    }
}

/// Tier names for messages.
const TIER_NAMES: &str =
    "`amx`, `avx512bf16`, `avx512` (also spelled `widened`), `avx2` or `generic`";

/// The device's property naming the instruction set the tier's matrix products and other vector
/// code run on (`avx512f`, `avx2+fma`, `scalar`).
pub const GEMM_ISA: &str = "gemm_isa";

/// The device's property giving [`crate::isa::bf16_dot_speed`], the flop rate of `vdpbf16ps`
/// over that of f32 multiply-adds (present on CPUs with AVX512-BF16; below
/// [`crate::isa::MIN_BF16_DOT_SPEED`] the default tier is `avx512`, not `avx512bf16`).
pub const BF16_DOT_SPEED: &str = "bf16_dot_speed";

/// The tier [`ISA_ENV`] asks for, else the best this build runs on this CPU.
fn tier_from_env() -> Result<Tier, PluginError> {
    match std::env::var(ISA_ENV) {
        Ok(value) if !value.trim().is_empty() => Tier::parse(&value).ok_or_else(|| {
            invalid(
                "open",
                format!("{ISA_ENV}=`{value}`: expected {TIER_NAMES}"),
            )
        }),
        _ => Ok(Tier::best()),
    }
}

/// The memory report's items for `packed` bytes of packed weights.
fn held_memory(packed: u64) -> Vec<HeldMemory> {
    if packed == 0 {
        return Vec::new();
    }
    vec![HeldMemory {
        what: "packed weights (beyond the bytes they replace)".into(),
        bytes: packed,
    }]
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

/// [`QUEUE_ENV`] when set to a valid mode, else async.
fn default_queue() -> QueueMode {
    std::env::var(QUEUE_ENV)
        .ok()
        .and_then(|value| parse_queue(&value))
        .unwrap_or(QueueMode::Async)
}

fn parse_queue(value: &str) -> Option<QueueMode> {
    match value.trim() {
        "sync" => Some(QueueMode::Sync),
        "async" => Some(QueueMode::Async),
        _ => None,
    }
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
        let err = CpuOptions::parse(&[("queue", "eventually")]).unwrap_err();
        assert!(err.message.contains("`queue`"), "{}", err.message);
        let options = CpuOptions::parse(&[
            ("threads", "3"),
            ("capacity", "1MiB"),
            ("queue", "sync"),
            ("queue_delay_us", "250"),
            ("fail_alloc_at", "4"),
        ])
        .unwrap();
        assert_eq!((options.threads, options.capacity), (3, 1 << 20));
        assert_eq!(options.queue, QueueMode::Sync);
        assert_eq!(options.queue_delay, Duration::from_micros(250));
        assert!(options.faults.any());
    }

    #[test]
    fn peak_flops_is_the_timed_roof_for_every_float_dtype() {
        use iris_plugin::Backend as _;
        let figure = |threads: &str| {
            let options = CpuOptions::parse(&[("threads", threads), ("capacity", "1MiB")]).unwrap();
            let device = CpuDevice::open(options, iris_plugin::Logger::discard()).unwrap();
            let desc = device.describe();
            let value = desc
                .properties
                .iter()
                .find(|p| p.key.as_str() == property::PEAK_FLOPS)
                .map(|p| p.value.to_string())
                .expect("the CPU device reports its peak on x86-64");
            ["f32", "bf16", "f16"].map(|dtype| {
                property::peak_flops(&value, dtype).unwrap_or_else(|| panic!("{dtype} in {value}"))
            })
        };
        let [f32_one, _, f16_one] = figure("1");
        // Any x86-64 core multiplies and adds faster than 100 MFLOP/s, and none at 10 TFLOP/s.
        assert!((1e8..1e13).contains(&f32_one), "{f32_one}");
        // f16 is widened to f32: its roof is f32's.
        assert_eq!(f16_one, f32_one);
        // One core's roof, times the threads (the roof is timed once per process).
        let [f32_two, ..] = figure("2");
        // (Both are written to five significant figures.)
        assert!(
            (f32_two / f32_one - 2.0).abs() < 1e-3,
            "{f32_two} vs {f32_one}"
        );
    }
}
