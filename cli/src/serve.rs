//! `iris serve`: the engine behind the HTTP server, until Ctrl-C.

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::engine::{EngineArgs, startup_line};
use crate::http::{self, ServeArgs};
use crate::settings::GlobalArgs;

/// Arguments of `iris serve`.
#[derive(Debug, Args)]
pub struct ServeCmd {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    server: ServeArgs,
}

/// Runs `iris serve`: starts the engine (start-up profiling included), binds, prints
/// `listening on http://ADDR` and serves until Ctrl-C, then drains in-flight requests.
pub fn run(global: &GlobalArgs, args: &ServeCmd) -> anyhow::Result<ExitCode> {
    let engine = Arc::new(args.engine.start(global)?);
    eprintln!("{}", startup_line(&engine));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = args.server.bind().await.with_context(|| {
            format!("cannot listen on {}:{}", args.server.host, args.server.port)
        })?;
        let addr = listener.local_addr()?;
        let app = http::router(Arc::clone(&engine), args.server.server_config())?;
        // The line scripts wait for (and learn the port from, with --port 0).
        let mut out = std::io::stdout().lock();
        writeln!(out, "iris serve: listening on http://{addr}")?;
        out.flush()?;
        drop(out);
        http::serve(listener, app, http::ctrl_c())
            .await
            .context("the server stopped")
    })?;
    drop(runtime);
    Ok(ExitCode::SUCCESS)
}
