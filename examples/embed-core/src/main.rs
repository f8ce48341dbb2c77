//! iris-core as a library, one idea end to end: load a device plugin from a library path, select
//! the device from a configuration string, start an engine on it, encode one image, and print
//! the embeddings' shape and the memory report.
//!
//! ```sh
//! cargo run -p iris-example-embed-core -- [PLUGIN.so] [IMAGE]
//! ```
//!
//! Without a plugin path it loads the CPU plugin library cargo built next to this binary;
//! without an image it encodes a 224x224 gradient it draws itself. The model is the `tiny`
//! preset with deterministic dummy weights, so nothing is downloaded.

use std::path::PathBuf;

use anyhow::{Context, bail};
use iris_core::config::Config;
use iris_core::devices::Registry;
use iris_core::engine::api::{EncodeOptions, ImageInput};
use iris_core::engine::{Engine, EngineConfig};
use iris_core::model::{DUMMY_DEFAULT_SEED, ModelSpec, WeightSource};
use iris_plugin::SearchPath;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let plugin_path = match args.next() {
        Some(path) => PathBuf::from(path),
        // The search path of a binary includes its folder and `deps/`, where cargo puts the
        // CPU plugin library it built as a dependency.
        None => SearchPath::from_env(&[])
            .find("cpu")
            .context("no plugin path given and no CPU plugin library next to this binary")?,
    };
    let image = match args.next() {
        Some(path) => std::fs::read(&path).with_context(|| format!("reading {path}"))?,
        None => gradient_png(224, 224)?,
    };
    if args.next().is_some() {
        bail!("usage: embed-core [PLUGIN.so] [IMAGE]");
    }

    // The device, chosen by a configuration string: a plugin path, an ordinal, and options for
    // the plugin's `[plugins.<name>]` table (the CPU plugin's here; other plugins ignore it).
    let text = format!(
        "device = {path:?}\ndevice_ordinal = 0\n\n[plugins.cpu]\nthreads = 2\ncapacity = \"2GiB\"\n",
        path = plugin_path.display().to_string()
    );
    let config = Config::from_toml_str(&text, "embed-core")?;
    let registry = Registry::new(Vec::new(), config.search_path());
    let device = registry.open_selected(&config)?;
    println!(
        "device: {} ({}) from {}",
        device.description().name,
        device.plugin().name(),
        plugin_path.display()
    );

    let spec = ModelSpec::preset("tiny").context("the tiny preset")?;
    let weights = WeightSource::Dummy {
        seed: DUMMY_DEFAULT_SEED,
    };
    let engine = Engine::start(EngineConfig::new(spec, weights), device)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let options = EncodeOptions {
        return_embeddings: true,
        ..EncodeOptions::default()
    };
    let results = runtime.block_on(engine.encode(vec![ImageInput { bytes: image }], options))?;
    for result in &results {
        let shape = result.embeddings.as_ref().map(|(_, shape)| *shape);
        println!(
            "image: grid {:?}, {} tokens, embeddings {:?}",
            result.grid_thw,
            result.num_tokens,
            shape.context("embeddings were asked for")?
        );
    }
    println!(
        "memory: {}",
        serde_json::to_string_pretty(&engine.memory_json())?
    );
    Ok(())
}

/// A PNG of a colour gradient, so that the example runs without an image file.
fn gradient_png(width: u32, height: u32) -> anyhow::Result<Vec<u8>> {
    let image = image::RgbImage::from_fn(width, height, |x, y| {
        let r = u8::try_from(x * 255 / width.max(1)).unwrap_or(u8::MAX);
        let g = u8::try_from(y * 255 / height.max(1)).unwrap_or(u8::MAX);
        image::Rgb([r, g, 128])
    });
    let mut bytes = Vec::new();
    image.write_to(
        &mut std::io::Cursor::new(&mut bytes),
        image::ImageFormat::Png,
    )?;
    Ok(bytes)
}
