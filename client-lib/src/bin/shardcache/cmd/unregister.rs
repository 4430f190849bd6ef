//! `shardcache unregister`: forget a registered job (naming the registered ones when
//! it is not).

use clap::Args as ClapArgs;

use super::{Ctx, unknown_job};
use crate::output::{Failure, daemon_failure};

// (The subcommand's help is its variant's doc comment on `Cmd`, in main.rs.)
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The job id.
    job: String,
}

pub fn run(ctx: &Ctx, args: Args) -> Result<(), Failure> {
    let Args { job } = args;
    let client = &ctx.client;
    let socket = ctx.socket.as_path();
    let found = client
        .unregister(&job)
        .map_err(|e| daemon_failure(socket, &e))?;
    if !found {
        let known = client
            .status()
            .map(|s| unknown_job(&job, &s))
            .unwrap_or_else(|_| format!("no job `{job}` is registered"));
        return Err(Failure::Error(known));
    }
    outln!("job {job} unregistered");
    Ok(())
}
