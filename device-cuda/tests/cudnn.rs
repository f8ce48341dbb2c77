//! The attention graphs the plugin builds, against a real cuDNN, on a machine without a GPU: the
//! tensors and the fused attention operation of every shape the towers run finalize in the
//! vendor's own library, which checks their attributes, types and shapes (the operation graph,
//! heuristics and execution take a handle, which needs a GPU: gpu-check covers those).
//!
//! Opt-in, as the library is large (the PyPI wheel `nvidia-cudnn-cu12` or `nvidia-cudnn-cu13` is
//! about 0.7 GB): set `IRIS_TEST_CUDNN_DIR` to its `nvidia/cudnn/lib` folder
//! (`pip download nvidia-cudnn-cu12 --no-deps` and unzip it). Without that variable the test
//! says why it skips. cuDNN's sub-libraries link against the driver: the scenario runs in a
//! child with the stand-in driver on the loader's path.

mod common;

use std::path::PathBuf;

use common::{Libraries, SCENARIO_ENV, run};
use iris_device_cuda::cudnn::{self, SdpaShape};

/// The folder with `libcudnn.so.9`.
const CUDNN_DIR_ENV: &str = "IRIS_TEST_CUDNN_DIR";

#[test]
fn the_attention_operations_of_the_towers_finalize_in_a_real_cudnn() {
    if std::env::var_os(CUDNN_DIR_ENV).is_none() {
        eprintln!(
            "skipped: {CUDNN_DIR_ENV} is not set (a folder with cuDNN 9.13.1 or newer, such as \
             the nvidia/cudnn/lib of pip's nvidia-cudnn-cu12 wheel)"
        );
        return;
    }
    run("operations", &[], Libraries::Driver);
}

/// The child of the test above.
#[test]
#[ignore = "a child-process scenario, run by the other test of this file"]
fn scenario() {
    assert_eq!(
        std::env::var(SCENARIO_ENV).as_deref(),
        Ok("operations"),
        "run by the parent test"
    );
    let dir = PathBuf::from(std::env::var_os(CUDNN_DIR_ENV).expect("set by the parent"));
    // Whichever CUDA release the wheel was built for: the check of the major is the loader's
    // (tests/standin.rs covers it), the graphs are the same for both.
    let library = [12, 13]
        .into_iter()
        .find_map(|major| cudnn::open_in(&dir, major).ok())
        .unwrap_or_else(|| {
            panic!(
                "cuDNN in {}: {}",
                dir.display(),
                cudnn::open_in(&dir, 12).err().unwrap_or_default()
            )
        });
    let library: &'static _ = Box::leak(Box::new(library));
    eprintln!(
        "cuDNN {} built for CUDA {} from {}",
        library.version_text(),
        library.cudart,
        library.path.display()
    );
    // The towers' runs at the serving step and the plugin's check at open: Qwen3-VL's 41
    // images of 784 tokens (32, 8, 1) at head dim 72, Qwen2-VL's 1024-token images and
    // Qwen2.5-VL's 64-token windows at 80, the check's 2 x 130 and 1 x 1 at every head dim.
    let mut shapes = Vec::new();
    for (heads, head_dim, runs) in [
        (16u64, 72u64, &[(32u64, 784u64), (8, 784), (1, 784)][..]),
        (16, 80, &[(8, 1024), (512, 64)][..]),
        (2, 64, &[(2, 130), (1, 1)][..]),
        (2, 72, &[(2, 130), (1, 1)][..]),
        (2, 80, &[(2, 130), (1, 1)][..]),
        (2, 96, &[(2, 130), (1, 1)][..]),
        (2, 128, &[(2, 130), (1, 1)][..]),
    ] {
        for &(batch, tokens) in runs {
            for bf16 in [true, false] {
                let width = heads * head_dim;
                shapes.push(SdpaShape {
                    bf16,
                    heads,
                    head_dim,
                    tokens,
                    batch,
                    // Q, K and V column blocks of the fused QKV output; O rows of its own.
                    strides: [3 * width, 3 * width, 3 * width, width],
                });
            }
        }
    }
    let failures: Vec<String> = shapes
        .iter()
        .filter_map(|shape| {
            cudnn::finalize_operation(library, shape)
                .err()
                .map(|err| format!("{shape:?}: {err}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} operations did not finalize:\n{}",
        failures.len(),
        shapes.len(),
        failures.join("\n")
    );
    eprintln!("{} attention operations finalized", shapes.len());
}
