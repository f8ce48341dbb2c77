//! `iris serve`: the engine behind the HTTP server, until Ctrl-C or SIGTERM.

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::engine::{EngineArgs, startup_line};
use crate::epd::EpdArgs;
use crate::http::{self, ServeArgs};
use crate::settings::GlobalArgs;

/// Arguments of `iris serve`.
#[derive(Debug, Args)]
pub struct ServeCmd {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    server: ServeArgs,
    #[command(flatten)]
    epd: EpdArgs,
}

/// Runs `iris serve`: starts the engine (start-up profiling included), binds, prints
/// `listening on http://ADDR` and serves until Ctrl-C or SIGTERM, then drains in-flight requests.
pub fn run(global: &GlobalArgs, args: &ServeCmd) -> anyhow::Result<ExitCode> {
    // Checked before the engine loads anything: a bad store path fails in a second, not after
    // start-up profiling.
    let epd = Arc::new(args.epd.resolve(
        &args.engine.model.model_id(),
        global.config()?.ec_transfer_config.as_ref(),
    )?);
    let mut server_config = args.server.server_config(Some(Arc::clone(&epd)))?;
    if let Some(warning) = args.server.empty_api_key_warning() {
        eprintln!("{warning}");
    }
    let engine = Arc::new(args.engine.start(global)?);
    server_config.limits.mm_per_prompt = engine.mm_limits();
    eprintln!("{}", startup_line(&engine));
    if let Some(producer) = &epd.producer {
        eprintln!(
            "EC producer: {} (identifiers: {} over model id {:?}; serving model {:?})",
            producer.info_json(),
            epd.algorithm,
            epd.model_id,
            epd.served_model_name
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = args.server.bind().await.with_context(|| {
            format!("cannot listen on {}:{}", args.server.host, args.server.port)
        })?;
        let addr = listener.local_addr()?;
        let app = http::router(Arc::clone(&engine), server_config)?;
        // The line scripts wait for (and learn the port from, with --port 0).
        let mut out = std::io::stdout().lock();
        writeln!(out, "iris serve: listening on http://{addr}")?;
        out.flush()?;
        drop(out);
        http::serve(listener, app, http::shutdown_signal())
            .await
            .context("the server stopped")
    })?;
    // Blocking work of requests the drain gave up on (a decode within its time limit) is not
    // waited for past a few seconds.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    Ok(ExitCode::SUCCESS)
}
