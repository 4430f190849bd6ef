//! `shardcache wait`: wait until a registered job's readiness window is cached (for
//! Slurm prologs and init containers), with a progress bar; exit code 3 on timeout.

use std::path::Path;
use std::time::Duration;

use clap::Args as ClapArgs;
use shardcache_client::Client;

use super::{Ctx, unknown_job};
use crate::output::{Failure, daemon_failure};
use crate::render;

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The job id.
    job: String,
    /// Fraction (0–1) of the window's bytes that must be cached.
    #[arg(long, default_value_t = 1.0, value_parser = parse_fraction)]
    fraction: f64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args {
        job,
        fraction,
        timeout,
    } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
    if !s.jobs.iter().any(|j| j.job == job) {
        return Err(Failure::Error(unknown_job(&job, &s)));
    }
    wait_ready(client, socket, &job, fraction, Duration::from_secs(timeout))?;
    outln!("job {job}: ready");
    Ok(())
}

pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not between 0 and 1"))
    }
}

/// Waits until `fraction` of the bytes of the job's readiness window is cached, drawing
/// a progress bar (on a terminal). For Slurm prologs and Kubernetes init containers:
/// [`Failure::NotReady`] on timeout.
pub fn wait_ready(
    client: &Client,
    socket: &Path,
    job: &str,
    fraction: f64,
    timeout: Duration,
) -> Result<(), Failure> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} of the next reads cached",
        )
        .map_err(|e| e.to_string())?,
    );
    bar.set_message(job.to_owned());
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let s = client.status().map_err(|e| daemon_failure(socket, &e))?;
        let Some(j) = s.jobs.iter().find(|j| j.job == job) else {
            return Err(Failure::Error(format!(
                "job `{job}` is no longer registered (unregistered, or the daemon restarted)"
            )));
        };
        bar.set_length(j.window_bytes);
        bar.set_position(j.window_resident_bytes);
        if j.window == 0 || j.window_resident_bytes as f64 >= fraction * j.window_bytes as f64 {
            bar.finish();
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bar.abandon();
            return Err(Failure::NotReady(format!(
                "job `{job}` not ready after {}s: {} of {} cached ({} of {} files), {} wanted; is prefetch on (prefetch_ahead > 0)? is the backing store slow? (shardcache status)",
                timeout.as_secs(),
                render::bytes(j.window_resident_bytes),
                render::bytes(j.window_bytes),
                j.window_resident,
                j.window,
                render::percent((fraction * 1000.0) as u64, 1000),
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
