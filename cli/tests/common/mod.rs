//! What the `iris` binary's integration tests share: starting `iris serve` with the `tiny`
//! model on the built-in CPU device and learning its address.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Start-up (profiling the tiny model in a debug build) is well under this.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Engine flags every test server and in-process bench uses: small steps keep start-up
/// profiling short in a debug build.
pub const ENGINE: [&str; 8] = [
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--weights",
    "dummy",
    "--max-num-batched-tokens",
    "2048",
];

/// `iris` run in `dir` (so no `iris.toml` is picked up), with the environment variables that
/// would change its device, plugins or API key removed.
pub fn iris(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iris"));
    cmd.current_dir(dir)
        .env_remove("IRIS_DEVICE")
        .env_remove("IRIS_PLUGIN_PATH")
        .env_remove("IRIS_API_KEY");
    cmd
}

/// Starts `iris serve --port 0` with [`ENGINE`] and `extra` flags (and `env` set), its stderr going to
/// `stderr`, and waits for its `listening on` line. Returns the child and the base URL, or
/// what went wrong (the child is then killed).
pub fn spawn_serve(
    dir: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
    stderr: Stdio,
) -> Result<(Child, String), String> {
    let mut child = iris(dir)
        .envs(env.iter().copied())
        .arg("serve")
        .args(ENGINE)
        .args(["--port", "0"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|err| format!("iris serve does not start: {err}"))?;
    let Some(stdout) = child.stdout.take() else {
        return Err("stdout is not piped".to_owned());
    };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    // Reads every line until the process ends, so the pipe never fills.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(url) = line.strip_prefix("iris serve: listening on ") {
                    return Ok((child, url.trim().to_owned()));
                }
            }
            Err(err) => {
                let status = child.try_wait().ok().flatten();
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "iris serve did not print its address ({err}; exit {status:?})"
                ));
            }
        }
    }
}

/// Whether the FFmpeg programs run here; without them (and without `IRIS_REQUIRE_FFMPEG`,
/// which `.ci/run` sets, under which their absence fails) a video test skips, saying so.
// Not every test binary decodes videos.
#[allow(dead_code)]
pub fn ffmpeg_runs() -> bool {
    let runs = ["ffmpeg", "ffprobe"].iter().all(|program| {
        Command::new(program)
            .arg("-version")
            .output()
            .is_ok_and(|out| out.status.success())
    });
    if !runs {
        assert!(
            std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none(),
            "IRIS_REQUIRE_FFMPEG is set but ffmpeg or ffprobe does not run"
        );
        eprintln!(
            "skipped: ffmpeg or ffprobe does not run here (install FFmpeg to run the video tests)"
        );
    }
    runs
}
