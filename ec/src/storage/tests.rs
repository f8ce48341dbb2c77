use std::process::Command;

use super::*;

fn shape(rows: u64, width: u64) -> EntryShape {
    EntryShape {
        rows,
        width,
        dtype: EcDtype::Bf16,
    }
}

fn rows(shape: &EntryShape, seed: f32) -> Vec<u8> {
    let values: Vec<f32> = (0..shape.rows * shape.width)
        .map(|i| seed + i as f32 * 0.25)
        .collect();
    let rows = usize::try_from(shape.rows).unwrap();
    pack_rows(&values, &[], rows, shape.dtype).unwrap()
}

fn store(max_bytes: Option<u64>) -> (tempfile::TempDir, SharedStorage) {
    let dir = tempfile::tempdir().unwrap();
    let store = SharedStorage::open(dir.path(), max_bytes).unwrap();
    (dir, store)
}

fn entries_under(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = walk(root)
        .into_iter()
        .map(|p| p.strip_prefix(root).unwrap().display().to_string())
        .collect();
    names.sort();
    names
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        out.push(path.clone());
        if path.is_dir() {
            out.extend(walk(&path));
        }
    }
    out
}

#[test]
fn an_entry_is_vllms_safetensors_file_byte_for_byte() {
    let (dir, store) = store(None);
    let shape = shape(3, 8);
    let data = rows(&shape, 1.0);
    let report = store.write("abc", &shape, &data).unwrap();
    let path = dir.path().join("abc").join(FILE_NAME);
    let file = fs::read(&path).unwrap();
    assert_eq!(report.bytes, file.len() as u64);

    // The safetensors library (which vLLM's `save_file` wraps) writes the same bytes.
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![3, 8], &data).unwrap();
    let reference = safetensors::serialize([(TENSOR_NAME, view)], None).unwrap();
    assert_eq!(file, reference);

    let loaded = safetensors::SafeTensors::deserialize(&file).unwrap();
    assert_eq!(loaded.names(), vec![TENSOR_NAME]);
    let tensor = loaded.tensor(TENSOR_NAME).unwrap();
    assert_eq!(tensor.dtype(), safetensors::Dtype::BF16);
    assert_eq!(tensor.shape(), &[3, 8]);
    assert_eq!(tensor.data(), &data[..]);
    // Nothing but the entry: no temporary file left.
    assert_eq!(
        entries_under(dir.path()),
        ["abc", "abc/encoder_cache.safetensors"]
    );
    assert_eq!(store.lookup("abc", &shape).unwrap(), Lookup::Hit);
    assert_eq!(store.lookup("abd", &shape).unwrap(), Lookup::Missing);
    let stats = store.stats();
    assert_eq!(
        (
            stats.writes,
            stats.bytes_written,
            stats.hits,
            stats.resident_bytes
        ),
        (1, report.bytes, 1, report.bytes)
    );
}

#[test]
fn rows_interleave_deepstack_levels_after_the_main_output() {
    // Two rows of width 2, two levels: row r = [main r | level0 r | level1 r].
    let main = [1.0, 2.0, 3.0, 4.0];
    let l0 = [10.0, 20.0, 30.0, 40.0];
    let l1 = [100.0, 200.0, 300.0, 400.0];
    let bytes = pack_rows(&main, &[&l0, &l1], 2, EcDtype::F32).unwrap();
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        values,
        [
            1.0, 2.0, 10.0, 20.0, 100.0, 200.0, 3.0, 4.0, 30.0, 40.0, 300.0, 400.0
        ]
    );
    assert!(pack_rows(&main, &[&l0[..2]], 2, EcDtype::F32).is_err());
    assert!(pack_rows(&main, &[], 3, EcDtype::F32).is_err());
}

#[test]
fn bf16_and_f16_rows_round_trip_exactly_from_their_f32_widenings() {
    let bf: Vec<f32> = [-3.5f32, 0.0, 1.0e-3, 65504.0, -1.0e30]
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let bytes = pack_rows(&bf, &[], 1, EcDtype::Bf16).unwrap();
    let back: Vec<f32> = bytes
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(back, bf);
    let f: Vec<f32> = [-3.5f32, 1.0e-3, 65504.0]
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    let bytes = pack_rows(&f, &[], 1, EcDtype::F16).unwrap();
    let back: Vec<f32> = bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(back, f);
}

#[test]
fn a_file_that_is_not_a_complete_entry_of_the_shape_is_replaced_not_trusted() {
    let (dir, store) = store(None);
    let good = shape(4, 6);
    let folder = dir.path().join("id");
    fs::create_dir(&folder).unwrap();
    let path = folder.join(FILE_NAME);
    let full = {
        let (other_dir, other) = self::store(None);
        other.write("id", &good, &rows(&good, 0.0)).unwrap();
        fs::read(other_dir.path().join("id").join(FILE_NAME)).unwrap()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("truncated data", full[..full.len() - 2].to_vec()),
        ("extended", [&full[..], &[0u8; 2]].concat()),
        ("garbage", b"not a safetensors file at all".to_vec()),
        (
            "huge header length",
            [u64::MAX.to_le_bytes().as_slice(), b"{}"].concat(),
        ),
    ];
    for (what, bytes) in cases {
        fs::write(&path, &bytes).unwrap();
        assert!(
            matches!(store.lookup("id", &good).unwrap(), Lookup::Invalid(_)),
            "{what}"
        );
    }
    // A complete entry of another shape or dtype is not this item's entry either.
    fs::write(&path, &full).unwrap();
    assert_eq!(store.lookup("id", &good).unwrap(), Lookup::Hit);
    assert!(matches!(
        store.lookup("id", &shape(4, 3)).unwrap(),
        Lookup::Invalid(reason) if reason.contains("expected")
    ));
    let f32_shape = EntryShape {
        dtype: EcDtype::F32,
        ..good
    };
    assert!(matches!(
        store.lookup("id", &f32_shape).unwrap(),
        Lookup::Invalid(_)
    ));

    fs::write(&path, b"junk").unwrap();
    let report = store.write("id", &good, &rows(&good, 0.0)).unwrap();
    assert!(report.replaced_invalid);
    assert_eq!(fs::read(&path).unwrap(), full);
    assert_eq!(store.stats().invalid_replaced, 1);
}

#[cfg(unix)]
#[test]
fn a_fifo_at_an_entrys_path_is_invalid_not_waited_on() {
    let (dir, store) = store(None);
    let good = shape(4, 6);
    let folder = dir.path().join("id");
    fs::create_dir(&folder).unwrap();
    let path = folder.join(FILE_NAME);
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let (done, result) = std::sync::mpsc::channel();
    let store = std::sync::Arc::new(store);
    let looking = std::sync::Arc::clone(&store);
    // Opening the FIFO for reading blocked until a writer came: never, here.
    std::thread::spawn(move || done.send(looking.lookup("id", &good)).unwrap());
    let lookup = result
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the lookup returns")
        .unwrap();
    assert_eq!(lookup, Lookup::Invalid("not a regular file".to_owned()));
    let report = store.write("id", &good, &rows(&good, 0.0)).unwrap();
    assert!(report.replaced_invalid);
    assert_eq!(store.lookup("id", &good).unwrap(), Lookup::Hit);
}

#[test]
fn identifiers_that_could_leave_the_store_are_refused() {
    let (dir, store) = store(None);
    let s = shape(1, 2);
    let data = rows(&s, 0.0);
    let long = "a".repeat(MAX_IDENTIFIER_BYTES + 1);
    for bad in [
        "",
        ".",
        "..",
        "../escape",
        "a/b",
        "a\\b",
        "nul\0byte",
        &long,
    ] {
        assert!(
            matches!(
                store.write(bad, &s, &data),
                Err(StoreError::BadIdentifier(_))
            ),
            "{bad:?}"
        );
        assert!(store.lookup(bad, &s).is_err(), "{bad:?}");
    }
    assert!(entries_under(dir.path()).is_empty());
    assert!(!dir.path().parent().unwrap().join("escape").exists());
    // The longest single file name is fine, as are uuids and dots inside a name.
    let longest = "b".repeat(MAX_IDENTIFIER_BYTES);
    for good in [
        &longest[..],
        "550e8400-e29b-41d4-a716-446655440000",
        "a..b",
        ".hidden",
    ] {
        store.write(good, &s, &data).unwrap();
    }
    assert_eq!(store.stats().write_errors, 8);
}

#[test]
fn rows_of_the_wrong_size_are_refused_before_anything_is_written() {
    let (dir, store) = store(None);
    let s = shape(2, 2);
    assert!(matches!(
        store.write("x", &s, &[0u8; 6]),
        Err(StoreError::BadRows(_))
    ));
    assert!(entries_under(dir.path()).is_empty());
}

#[test]
fn the_bound_evicts_the_oldest_entries_this_process_wrote() {
    let s = shape(16, 16);
    let entry_bytes = {
        let (_dir, probe) = store(None);
        probe.write("p", &s, &rows(&s, 0.0)).unwrap().bytes
    };
    let (dir, store) = store(Some(2 * entry_bytes + entry_bytes / 2));
    // An entry found on disk at start is not the store's to evict.
    fs::create_dir(dir.path().join("foreign")).unwrap();
    fs::write(dir.path().join("foreign").join(FILE_NAME), b"x").unwrap();
    for id in ["a", "b", "c", "d"] {
        store.write(id, &s, &rows(&s, 1.0)).unwrap();
    }
    assert_eq!(
        entries_under(dir.path()),
        [
            "c",
            "c/encoder_cache.safetensors",
            "d",
            "d/encoder_cache.safetensors",
            "foreign",
            "foreign/encoder_cache.safetensors"
        ]
    );
    let stats = store.stats();
    assert_eq!(
        (stats.evictions, stats.resident_bytes),
        (2, 2 * entry_bytes)
    );
    // Rewriting an entry moves it to the back instead of counting it twice.
    store.write("c", &s, &rows(&s, 2.0)).unwrap();
    store.write("e", &s, &rows(&s, 3.0)).unwrap();
    assert!(dir.path().join("c").exists());
    assert!(!dir.path().join("d").exists());

    let too_big = shape(64, 64);
    assert!(matches!(
        store.write("big", &too_big, &rows(&too_big, 0.0)),
        Err(StoreError::EntryTooLarge { .. })
    ));
    assert!(!dir.path().join("big").exists());
}

#[test]
fn a_requests_pinned_entries_are_not_evicted_and_a_found_entry_is_used_again() {
    let s = shape(16, 16);
    let entry_bytes = {
        let (_dir, probe) = store(None);
        probe.write("p", &s, &rows(&s, 0.0)).unwrap().bytes
    };
    let (dir, store) = store(Some(2 * entry_bytes + entry_bytes / 2));
    let exists = |id: &str| dir.path().join(id).join(FILE_NAME).exists();
    store.write("a", &s, &rows(&s, 1.0)).unwrap();
    store.write("b", &s, &rows(&s, 1.0)).unwrap();
    // A request finds `a` (the oldest write) and writes `c` and `d`: its reply names all
    // three, so none of them may go, though they are over the bound; `b` goes.
    let pins = store.pin(["a", "c", "d"]);
    assert_eq!(store.lookup("a", &s).unwrap(), Lookup::Hit);
    store.write("c", &s, &rows(&s, 1.0)).unwrap();
    store.write("d", &s, &rows(&s, 1.0)).unwrap();
    assert!(exists("a") && !exists("b") && exists("c") && exists("d"));
    assert_eq!(store.stats().resident_bytes, 3 * entry_bytes);
    // Released, the next write evicts down to the bound, least recently used first: `a`
    // (found before `c` and `d` were written), then `c`.
    drop(pins);
    store.write("e", &s, &rows(&s, 1.0)).unwrap();
    assert!(!exists("a") && !exists("c") && exists("d") && exists("e"));
    // A find makes an entry the most recently used: `d`, found, outlives `e`.
    assert_eq!(store.lookup("d", &s).unwrap(), Lookup::Hit);
    store.write("f", &s, &rows(&s, 1.0)).unwrap();
    assert!(exists("d") && !exists("e") && exists("f"));
    // Two requests pin one entry: it stays until both have let go.
    let first = store.pin(["d"]);
    let second = store.pin(["d"]);
    drop(first);
    store.write("g", &s, &rows(&s, 1.0)).unwrap();
    assert!(exists("d") && !exists("f"));
    drop(second);
    store.write("h", &s, &rows(&s, 1.0)).unwrap();
    assert!(!exists("d") && exists("g") && exists("h"));
}

#[test]
fn a_temporary_file_of_another_process_with_this_id_is_left_alone() {
    // A container restarted after a crash has its predecessor's process id, and encoders in
    // containers on several hosts share one: the temporary files such a process left (named
    // with the id and a per-process sequence number) neither fail this process's writes nor
    // are deleted by them.
    let (dir, store) = store(None);
    let folder = dir.path().join("a");
    fs::create_dir(&folder).unwrap();
    let next = TEMP_SEQUENCE.load(Ordering::Relaxed);
    let strays: Vec<PathBuf> = (next..next + 64)
        .map(|seq| folder.join(format!(".{FILE_NAME}.{}.{seq}.tmp", std::process::id())))
        .collect();
    for stray in &strays {
        fs::write(stray, b"another writer's bytes").unwrap();
    }
    let s = shape(4, 4);
    store.write("a", &s, &rows(&s, 1.0)).unwrap();
    assert_eq!(store.lookup("a", &s).unwrap(), Lookup::Hit);
    for stray in &strays {
        assert_eq!(fs::read(stray).unwrap(), b"another writer's bytes");
    }
}

#[test]
fn a_missing_root_or_a_file_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let err = SharedStorage::open(dir.path().join("nope"), None).unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
    assert!(err.to_string().contains("create it first"), "{err}");
    let file = dir.path().join("file");
    fs::write(&file, b"").unwrap();
    assert!(
        SharedStorage::open(&file, None)
            .unwrap_err()
            .to_string()
            .contains("not a folder")
    );
    assert!(SharedStorage::open(dir.path(), Some(0)).is_err());
}

#[test]
fn a_root_removed_after_start_fails_the_write_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    fs::create_dir(&root).unwrap();
    let store = SharedStorage::open(&root, None).unwrap();
    fs::remove_dir(&root).unwrap();
    let s = shape(1, 2);
    let err = store.write("x", &s, &rows(&s, 0.0)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&root.join("x").display().to_string()),
        "{text}"
    );
    assert!(
        matches!(err, StoreError::Io { ref source, .. } if source.kind() == io::ErrorKind::NotFound)
    );
    assert!(!root.exists());
    assert_eq!(store.stats().write_errors, 1);
}

#[tokio::test]
async fn concurrent_claims_for_one_identifier_have_one_owner() {
    let (_dir, store) = store(None);
    let Claim::Owner(guard) = store.claim("x") else {
        panic!("the first claim owns the identifier");
    };
    let Claim::Wait(receiver) = store.claim("x") else {
        panic!("a second claim waits");
    };
    assert!(matches!(store.claim("y"), Claim::Owner(_)));
    let waiter = tokio::spawn(wait_for_owner(receiver));
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    drop(guard);
    waiter.await.unwrap();
    // Once the owner is done, the next claim owns it again.
    assert!(matches!(store.claim("x"), Claim::Owner(_)));
}

/// A small tmpfs mounted for one test and unmounted when dropped. Mounting needs root (or
/// CAP_SYS_ADMIN); where it is refused the test says so and skips.
struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(options: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => Some(Self { dir }),
            _ => {
                eprintln!(
                    "skipped: cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN), so a full or read-only file system cannot be made"
                );
                None
            }
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_disk_fails_the_write_leaves_nothing_and_the_store_keeps_working() {
    let Some(fs) = SmallFs::mount("size=64k") else {
        return;
    };
    let root = fs.dir.path();
    let store = SharedStorage::open(root, None).unwrap();
    let small = shape(4, 4);
    store.write("small", &small, &rows(&small, 0.0)).unwrap();
    let big = shape(256, 256);
    let err = store.write("big", &big, &rows(&big, 0.0)).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StoreError::Io { .. }), "{text}");
    assert!(
        text.contains(&root.join("big").display().to_string()),
        "{text}"
    );
    assert!(text.to_lowercase().contains("space"), "{text}");
    assert_eq!(
        entries_under(root),
        ["small", "small/encoder_cache.safetensors"]
    );
    assert_eq!(store.lookup("small", &small).unwrap(), Lookup::Hit);
    store.write("again", &small, &rows(&small, 1.0)).unwrap();
}

#[test]
fn a_read_only_store_fails_the_write_naming_the_path() {
    let Some(fs) = SmallFs::mount("size=64k,ro") else {
        return;
    };
    let root = fs.dir.path();
    let store = SharedStorage::open(root, None).unwrap();
    let s = shape(2, 2);
    let err = store.write("x", &s, &rows(&s, 0.0)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&root.join("x").display().to_string()),
        "{text}"
    );
    assert!(text.to_lowercase().contains("read-only"), "{text}");
    assert!(entries_under(root).is_empty());
}
