//! The shared-storage connector: vLLM's `ECExampleConnector` file format, written atomically
//! into a store that can be bounded.
//!
//! Layout, exactly vLLM's: `<root>/<identifier>/encoder_cache.safetensors`, a plain safetensors
//! file with one tensor, `ec_cache`, `[num_embeds, width]`, row-major, in the engine's dtype, and
//! no `__metadata__`. vLLM's consumer only checks that the file exists, then loads it; so iris
//! never lets a partial file appear under that name: it writes a temporary file in the same
//! folder and renames it into place. After a crash a temporary file may stay behind (its name
//! starts with `.` and ends in `.tmp`); an entry whose file is not a complete entry of the
//! expected shape is replaced, never trusted.
//!
//! [`SharedStorage`] is synchronous (plain file I/O); callers run it on a blocking pool so that
//! the engine step never waits on the file system. [`SharedStorage::claim`] lets concurrent
//! requests for one identifier encode and write once: the first becomes the owner, the others
//! wait for it and then find the entry.
//!
//! With a byte bound, the store evicts the entries this process wrote that were least recently
//! written or found when a new entry would take it over the bound (entries found on disk at
//! start are never deleted), but never one a request in flight names ([`SharedStorage::pin`]):
//! a reply must not name an entry its own writes evicted. vLLM never evicts: a consumer that
//! reads an entry after its eviction fails that request.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use lru::LruCache;
use tokio::sync::watch;

/// The file name of an entry inside its identifier's folder.
pub const FILE_NAME: &str = "encoder_cache.safetensors";
/// The one tensor's name.
pub const TENSOR_NAME: &str = "ec_cache";
/// The longest identifier accepted: one file name on common file systems.
pub const MAX_IDENTIFIER_BYTES: usize = 255;
/// The largest safetensors header read when checking an entry (a valid entry's is ~100 bytes).
const MAX_HEADER_BYTES: u64 = 1 << 16;

/// Element type of the stored rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EcDtype {
    /// 32-bit float (`F32`).
    F32,
    /// IEEE half (`F16`).
    F16,
    /// bfloat16 (`BF16`).
    Bf16,
}

impl EcDtype {
    /// The name safetensors (and so torch) uses.
    #[must_use]
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
        }
    }

    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }
}

/// The shape and dtype an entry must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryShape {
    /// Rows: the item's embedding tokens (`num_embeds`).
    pub rows: u64,
    /// Values per row: the tower's output width times (1 + deepstack levels).
    pub width: u64,
    /// Element type.
    pub dtype: EcDtype,
}

impl EntryShape {
    /// Bytes of row data.
    #[must_use]
    pub fn data_bytes(&self) -> u64 {
        self.rows
            .saturating_mul(self.width)
            .saturating_mul(self.dtype.size())
    }
}

/// Packs an item's encoder outputs into one row-major `[rows, width * (1 + levels)]` buffer of
/// `dtype`: each row is the main output's row followed by the same row of every deepstack level,
/// as vLLM concatenates them. The values come as `f32`; for an engine that ran in f16 or bf16
/// they are exact widenings, so the conversion back is exact.
///
/// # Errors
/// A message when the parts do not have the same number of rows and one width each.
pub fn pack_rows(
    main: &[f32],
    levels: &[&[f32]],
    rows: usize,
    dtype: EcDtype,
) -> Result<Vec<u8>, String> {
    if rows == 0 || !main.len().is_multiple_of(rows) {
        return Err(format!(
            "{} values do not make {rows} rows of the main output",
            main.len()
        ));
    }
    let hidden = main.len() / rows;
    if let Some(level) = levels.iter().find(|l| l.len() != main.len()) {
        return Err(format!(
            "a deepstack level has {} values, the main output {}",
            level.len(),
            main.len()
        ));
    }
    let width = hidden * (1 + levels.len());
    let size = usize::try_from(dtype.size()).unwrap_or(4);
    // Sized once and written in place: a push per value costs more than the file write.
    let mut out = vec![0u8; rows * width * size];
    let mut chunks = out.chunks_exact_mut(hidden * size);
    for row in 0..rows {
        let range = row * hidden..(row + 1) * hidden;
        for part in std::iter::once(main).chain(levels.iter().copied()) {
            let Some(chunk) = chunks.next() else {
                break;
            };
            let values = &part[range.clone()];
            match dtype {
                EcDtype::F32 => {
                    for (dst, v) in chunk.chunks_exact_mut(4).zip(values) {
                        dst.copy_from_slice(&v.to_le_bytes());
                    }
                }
                EcDtype::F16 => {
                    for (dst, v) in chunk.chunks_exact_mut(2).zip(values) {
                        dst.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                    }
                }
                EcDtype::Bf16 => {
                    for (dst, v) in chunk.chunks_exact_mut(2).zip(values) {
                        dst.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Checks that `identifier` can name one folder inside the store and nothing else: not empty,
/// at most 255 bytes, no `/`, `\` or NUL, not `.` or `..`.
///
/// vLLM's own connector joins the identifier (a client's uuid, verbatim) to the store path
/// unchecked; iris refuses what could name a path outside the store.
///
/// # Errors
/// A message naming what is wrong.
pub fn check_identifier(identifier: &str) -> Result<(), String> {
    if identifier.is_empty() {
        return Err("the identifier is empty".to_owned());
    }
    if identifier.len() > MAX_IDENTIFIER_BYTES {
        return Err(format!(
            "the identifier has {} bytes; at most {MAX_IDENTIFIER_BYTES} make one file name",
            identifier.len()
        ));
    }
    if identifier == "." || identifier == ".." {
        return Err(format!(
            "the identifier {identifier:?} names a folder of the store itself"
        ));
    }
    if let Some(c) = identifier.chars().find(|c| matches!(c, '/' | '\\' | '\0')) {
        return Err(format!(
            "the identifier contains {c:?}, which cannot be part of one file name"
        ));
    }
    Ok(())
}

/// What [`SharedStorage::lookup`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A complete entry of the expected shape.
    Hit,
    /// No entry.
    Missing,
    /// A file that is not a complete entry of the expected shape (the reason); it will be
    /// replaced.
    Invalid(String),
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store's root is not a usable folder.
    #[error("EC store {path}: {reason}")]
    Root {
        /// The root.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file-system call failed.
    #[error("EC store: cannot {action} {path}: {source}")]
    Io {
        /// What iris was doing.
        action: &'static str,
        /// The path it was doing it to.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The identifier cannot name a folder in the store.
    #[error("EC store: bad identifier: {0}")]
    BadIdentifier(String),
    /// The entry alone is larger than the store's bound.
    #[error(
        "EC store: an entry of {bytes} bytes is larger than the store's bound of {max_bytes} bytes (--ec-storage-max-bytes)"
    )]
    EntryTooLarge {
        /// The entry's file size.
        bytes: u64,
        /// The bound.
        max_bytes: u64,
    },
    /// The rows do not have the entry's shape.
    #[error("EC store: {0}")]
    BadRows(String),
}

/// What one write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteReport {
    /// Bytes of the file written.
    pub bytes: u64,
    /// Time from the first byte to the rename.
    pub elapsed: Duration,
    /// Whether an invalid file was replaced.
    pub replaced_invalid: bool,
    /// Entries evicted to stay under the bound.
    pub evicted: u64,
}

/// Cumulative counters of a store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    /// Entries written.
    pub writes: u64,
    /// Bytes of entries written.
    pub bytes_written: u64,
    /// Items found in the store, not encoded again.
    pub hits: u64,
    /// Writes that failed.
    pub write_errors: u64,
    /// Invalid files replaced.
    pub invalid_replaced: u64,
    /// Entries evicted for the bound.
    pub evictions: u64,
    /// Bytes of the entries this process wrote that are still in the store.
    pub resident_bytes: u64,
    /// Total time spent writing, in nanoseconds.
    pub write_time_ns: u64,
}

/// Result of [`SharedStorage::claim`].
#[derive(Debug)]
pub enum Claim {
    /// The caller produces the entry; others wait until the guard is dropped.
    Owner(ClaimGuard),
    /// Another request is producing the entry: wait with [`wait_for_owner`], then look again.
    Wait(watch::Receiver<bool>),
}

/// Held by the one request producing an identifier's entry; dropping it wakes the waiters.
#[derive(Debug)]
pub struct ClaimGuard {
    identifier: String,
    inflight: Arc<Mutex<HashMap<String, watch::Sender<bool>>>>,
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let sender = self
            .inflight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.identifier);
        if let Some(sender) = sender {
            // No receivers left is fine: nobody waits.
            let _ = sender.send(true);
        }
    }
}

/// Waits until the owner of a claim is done (wrote the entry, failed, or went away).
pub async fn wait_for_owner(mut receiver: watch::Receiver<bool>) {
    // An error means the owner's guard is gone, which is also "done".
    let _ = receiver.wait_for(|done| *done).await;
}

/// vLLM's shared-storage connector's store.
#[derive(Debug)]
pub struct SharedStorage {
    root: PathBuf,
    max_bytes: Option<u64>,
    written: Arc<Mutex<Written>>,
    inflight: Arc<Mutex<HashMap<String, watch::Sender<bool>>>>,
    counters: Counters,
}

#[derive(Debug)]
struct Written {
    /// Identifiers this process wrote, with their file sizes, in the order of their last write
    /// or find.
    order: LruCache<String, u64>,
    bytes: u64,
    /// Identifiers named by requests in flight, with how many name each: never evicted.
    pinned: HashMap<String, usize>,
}

impl Default for Written {
    fn default() -> Self {
        Self {
            order: LruCache::unbounded(),
            bytes: 0,
            pinned: HashMap::new(),
        }
    }
}

/// Keeps the entries of one request from eviction while it runs: from [`SharedStorage::pin`],
/// released when dropped.
#[derive(Debug)]
pub struct Pins {
    identifiers: Vec<String>,
    written: Arc<Mutex<Written>>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        for identifier in &self.identifiers {
            if let Some(count) = written.pinned.get_mut(identifier) {
                *count -= 1;
                if *count == 0 {
                    written.pinned.remove(identifier);
                }
            }
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    writes: AtomicU64,
    bytes_written: AtomicU64,
    hits: AtomicU64,
    write_errors: AtomicU64,
    invalid_replaced: AtomicU64,
    evictions: AtomicU64,
    write_time_ns: AtomicU64,
}

/// Distinguishes the temporary files of concurrent writes in one process.
static TEMP_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A random number drawn once per process. With the process id it tells apart the temporary
/// files of processes that share the folder: encoders in containers on several hosts can all
/// be process 1, and a container restarted after a crash gets its predecessor's id (whose
/// temporary files may still be there).
fn process_nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        use std::hash::BuildHasher as _;
        // The standard library seeds each `RandomState` from the operating system's random
        // source; the time only adds to it.
        std::collections::hash_map::RandomState::new().hash_one(SystemTime::now())
    })
}

impl SharedStorage {
    /// Opens the store at `root`, which must be an existing folder (iris does not create it:
    /// a mistyped path should fail at start, not fill another disk). `max_bytes` bounds the
    /// bytes of the entries this process writes.
    ///
    /// # Errors
    /// [`StoreError::Root`] when `root` is missing or not a folder, or the bound is zero.
    pub fn open(root: impl Into<PathBuf>, max_bytes: Option<u64>) -> Result<Self, StoreError> {
        let root = root.into();
        let metadata = fs::metadata(&root).map_err(|err| StoreError::Root {
            path: root.clone(),
            reason: format!("cannot use the folder ({err}); create it first"),
        })?;
        if !metadata.is_dir() {
            return Err(StoreError::Root {
                path: root,
                reason: "is not a folder".to_owned(),
            });
        }
        if max_bytes == Some(0) {
            return Err(StoreError::Root {
                path: root,
                reason: "the byte bound must be above 0".to_owned(),
            });
        }
        Ok(Self {
            root,
            max_bytes,
            written: Arc::default(),
            inflight: Arc::default(),
            counters: Counters::default(),
        })
    }

    /// The store's root folder.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The byte bound, if any.
    #[must_use]
    pub fn max_bytes(&self) -> Option<u64> {
        self.max_bytes
    }

    /// The path of an identifier's entry.
    #[must_use]
    pub fn entry_path(&self, identifier: &str) -> PathBuf {
        self.root.join(identifier).join(FILE_NAME)
    }

    /// Looks for a complete entry of `shape`: the header is read and checked, the data is not.
    /// Counts a hit when one is found.
    ///
    /// # Errors
    /// [`StoreError::BadIdentifier`].
    pub fn lookup(&self, identifier: &str, shape: &EntryShape) -> Result<Lookup, StoreError> {
        check_identifier(identifier).map_err(StoreError::BadIdentifier)?;
        let found = check_entry(&self.entry_path(identifier), shape);
        if found == Lookup::Hit {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            // A found entry is in use again: the last to evict among this process's.
            self.written
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .order
                .promote(identifier);
        }
        Ok(found)
    }

    /// Keeps `identifiers` (a request's entries, found or to be written) from eviction until
    /// the returned guard is dropped. A request pins its entries before it looks them up and
    /// holds them until it has answered, so that its own writes (or a concurrent request's)
    /// cannot delete an entry its reply names. While pinned entries alone exceed the bound,
    /// the store stays over it; the next write after their release evicts.
    #[must_use]
    pub fn pin<'a>(&self, identifiers: impl IntoIterator<Item = &'a str>) -> Pins {
        let identifiers: Vec<String> = identifiers.into_iter().map(str::to_owned).collect();
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        for identifier in &identifiers {
            *written.pinned.entry(identifier.clone()).or_default() += 1;
        }
        Pins {
            identifiers,
            written: Arc::clone(&self.written),
        }
    }

    /// Claims the production of `identifier`'s entry: one owner at a time.
    #[must_use]
    pub fn claim(&self, identifier: &str) -> Claim {
        let mut inflight = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = inflight.get(identifier) {
            return Claim::Wait(sender.subscribe());
        }
        let (sender, _) = watch::channel(false);
        inflight.insert(identifier.to_owned(), sender);
        Claim::Owner(ClaimGuard {
            identifier: identifier.to_owned(),
            inflight: Arc::clone(&self.inflight),
        })
    }

    /// Writes an entry: `data` is `shape`'s rows, row-major. The file appears under its final
    /// name complete or not at all; on failure nothing this call created is left behind.
    ///
    /// # Errors
    /// [`StoreError`] naming the path and the operating system's reason (a full disk, a
    /// read-only or missing folder), or the bound an entry alone exceeds.
    pub fn write(
        &self,
        identifier: &str,
        shape: &EntryShape,
        data: &[u8],
    ) -> Result<WriteReport, StoreError> {
        let result = self.write_inner(identifier, shape, data);
        match &result {
            Ok(report) => {
                self.counters.writes.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .bytes_written
                    .fetch_add(report.bytes, Ordering::Relaxed);
                let ns = u64::try_from(report.elapsed.as_nanos()).unwrap_or(u64::MAX);
                self.counters.write_time_ns.fetch_add(ns, Ordering::Relaxed);
                if report.replaced_invalid {
                    self.counters
                        .invalid_replaced
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(_) => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// The store's counters.
    #[must_use]
    pub fn stats(&self) -> StoreStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let resident = self
            .written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes;
        StoreStats {
            writes: load(&self.counters.writes),
            bytes_written: load(&self.counters.bytes_written),
            hits: load(&self.counters.hits),
            write_errors: load(&self.counters.write_errors),
            invalid_replaced: load(&self.counters.invalid_replaced),
            evictions: load(&self.counters.evictions),
            resident_bytes: resident,
            write_time_ns: load(&self.counters.write_time_ns),
        }
    }

    fn write_inner(
        &self,
        identifier: &str,
        shape: &EntryShape,
        data: &[u8],
    ) -> Result<WriteReport, StoreError> {
        check_identifier(identifier).map_err(StoreError::BadIdentifier)?;
        if u64::try_from(data.len()).ok() != Some(shape.data_bytes()) {
            return Err(StoreError::BadRows(format!(
                "{} bytes of rows for a [{}, {}] {} entry of {} bytes",
                data.len(),
                shape.rows,
                shape.width,
                shape.dtype.safetensors_name(),
                shape.data_bytes()
            )));
        }
        let header = header_bytes(shape);
        let file_bytes = 8 + header.len() as u64 + shape.data_bytes();
        if let Some(max_bytes) = self.max_bytes
            && file_bytes > max_bytes
        {
            return Err(StoreError::EntryTooLarge {
                bytes: file_bytes,
                max_bytes,
            });
        }
        let started = Instant::now();
        let folder = self.root.join(identifier);
        let created_folder = match fs::create_dir(&folder) {
            Ok(()) => true,
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => false,
            Err(err) => {
                return Err(StoreError::Io {
                    action: "create the entry folder",
                    path: folder,
                    source: err,
                });
            }
        };
        let final_path = folder.join(FILE_NAME);
        let replaced_invalid = fs::symlink_metadata(&final_path).is_ok();
        let temp_path = folder.join(format!(
            ".{FILE_NAME}.{}.{:016x}.{}.tmp",
            std::process::id(),
            process_nonce(),
            TEMP_SEQUENCE.fetch_add(1, Ordering::Relaxed)
        ));
        let written = File::options()
            .write(true)
            .create_new(true)
            .open(&temp_path)
            .map_err(|err| StoreError::Io {
                action: "create",
                path: temp_path.clone(),
                source: err,
            })
            .and_then(|file| {
                // From here the temporary file is this call's: on failure it is removed (a
                // file this call did not create, as one whose name was taken, is left alone).
                let written = write_file(file, &temp_path, &header, data).and_then(|()| {
                    fs::rename(&temp_path, &final_path).map_err(|err| StoreError::Io {
                        action: "rename into place",
                        path: final_path.clone(),
                        source: err,
                    })
                });
                if written.is_err() {
                    // Best effort: the error to report is the write's, not the clean-up's.
                    let _ = fs::remove_file(&temp_path);
                }
                written
            });
        if let Err(err) = written {
            if created_folder {
                let _ = fs::remove_dir(&folder);
            }
            return Err(err);
        }
        let elapsed = started.elapsed();
        let evicted = self.account(identifier, file_bytes);
        Ok(WriteReport {
            bytes: file_bytes,
            elapsed,
            replaced_invalid,
            evicted,
        })
    }

    /// Records a written entry and evicts the least recently used others that no request in
    /// flight pins, while over the bound.
    fn account(&self, identifier: &str, bytes: u64) -> u64 {
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = written.order.put(identifier.to_owned(), bytes) {
            written.bytes -= old;
        }
        written.bytes += bytes;
        let Some(max_bytes) = self.max_bytes else {
            return 0;
        };
        let mut evicted = 0;
        while written.bytes > max_bytes {
            // Least recently used first; the entry just written is the most recent and never
            // its own victim.
            let Some(victim) = written
                .order
                .iter()
                .rev()
                .map(|(id, _)| id)
                .find(|id| *id != identifier && !written.pinned.contains_key(*id))
                .cloned()
            else {
                break;
            };
            let Some(size) = written.order.pop(&victim) else {
                break;
            };
            written.bytes -= size;
            let folder = self.root.join(&victim);
            // Removing the file is the eviction; a folder left non-empty (a stray temporary
            // file of a crashed writer) is harmless to consumers.
            match fs::remove_file(folder.join(FILE_NAME)) {
                Ok(()) => {
                    let _ = fs::remove_dir(&folder);
                    evicted += 1;
                }
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => tracing::warn!(
                    "EC store: cannot evict {}: {err}",
                    folder.join(FILE_NAME).display()
                ),
            }
        }
        self.counters
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
        evicted
    }
}

/// The safetensors header of an entry: JSON padded with spaces to a multiple of 8 bytes, as
/// the safetensors library writes it.
fn header_bytes(shape: &EntryShape) -> Vec<u8> {
    let json = format!(
        r#"{{"{TENSOR_NAME}":{{"dtype":"{}","shape":[{},{}],"data_offsets":[0,{}]}}}}"#,
        shape.dtype.safetensors_name(),
        shape.rows,
        shape.width,
        shape.data_bytes()
    );
    let mut bytes = json.into_bytes();
    let padded = bytes.len().next_multiple_of(8);
    bytes.resize(padded, b' ');
    bytes
}

/// Writes the entry's bytes into `file` (created at `path`, which errors name).
fn write_file(file: File, path: &Path, header: &[u8], data: &[u8]) -> Result<(), StoreError> {
    let io_err = |action: &'static str| {
        move |err: io::Error| StoreError::Io {
            action,
            path: path.to_owned(),
            source: err,
        }
    };
    let mut out = BufWriter::new(file);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(header))
        .and_then(|()| out.write_all(data))
        .map_err(io_err("write"))?;
    out.into_inner()
        .map_err(|err| err.into_error())
        .map_err(io_err("write"))?;
    Ok(())
}

/// Checks a file against the entry `shape` wants: header, tensor, dtype, shape, offsets and
/// file length.
fn check_entry(path: &Path, shape: &EntryShape) -> Lookup {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // Opening a FIFO (anyone who can write the shared folder can make one at an entry's
    // path) would block until a writer came, holding the request, its claim and a blocking
    // thread for good: open without blocking, then take regular files only.
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let mut file = match options.open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Lookup::Missing,
        Err(err) => return Lookup::Invalid(format!("cannot open: {err}")),
    };
    let length = match file.metadata() {
        Ok(m) if !m.is_file() => return Lookup::Invalid("not a regular file".to_owned()),
        Ok(m) => m.len(),
        Err(err) => return Lookup::Invalid(format!("cannot stat: {err}")),
    };
    let mut prefix = [0u8; 8];
    if file.read_exact(&mut prefix).is_err() {
        return Lookup::Invalid(format!("{length} bytes: no safetensors header"));
    }
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES || header_len > length.saturating_sub(8) {
        return Lookup::Invalid(format!(
            "header length {header_len} in a {length}-byte file"
        ));
    }
    let mut header = vec![0u8; usize::try_from(header_len).unwrap_or(0)];
    if file.read_exact(&mut header).is_err() {
        return Lookup::Invalid("truncated header".to_owned());
    }
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(&header) else {
        return Lookup::Invalid("the header is not a JSON object".to_owned());
    };
    if map.len() != 1 {
        return Lookup::Invalid(format!(
            "{} header entries; an entry has exactly `{TENSOR_NAME}`",
            map.len()
        ));
    }
    let Some(tensor) = map.get(TENSOR_NAME) else {
        return Lookup::Invalid(format!("no tensor `{TENSOR_NAME}`"));
    };
    let want = serde_json::json!({
        "dtype": shape.dtype.safetensors_name(),
        "shape": [shape.rows, shape.width],
        "data_offsets": [0, shape.data_bytes()],
    });
    if *tensor != want {
        return Lookup::Invalid(format!("tensor {tensor}, expected {want}"));
    }
    let expected_len = 8 + header_len + shape.data_bytes();
    if length != expected_len {
        return Lookup::Invalid(format!(
            "{length} bytes, expected {expected_len} (truncated or extended)"
        ));
    }
    Lookup::Hit
}

#[cfg(test)]
mod tests;
