//! How the CLI ends: what a failure means for the exit code ([`Failure`]), the message
//! for a daemon that cannot be reached ([`daemon_failure`]), and standard output that a
//! closed pipe ends quietly ([`emit`], `out!`, `outln!`).

use std::io::{self, Write};
use std::path::Path;

/// How a command failed, which decides the exit code.
#[derive(Debug)]
pub enum Failure {
    /// Exit 1.
    Error(String),
    /// Exit 2 (clap reports its own usage errors with 2 as well).
    Usage(String),
    /// Exit 3: a wait ran out of time.
    NotReady(String),
}

impl Failure {
    pub fn code(&self) -> u8 {
        match self {
            Failure::Error(_) => 1,
            Failure::Usage(_) => 2,
            Failure::NotReady(_) => 3,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Failure::Error(m) | Failure::Usage(m) | Failure::NotReady(m) => m,
        }
    }
}

impl From<String> for Failure {
    fn from(m: String) -> Self {
        Failure::Error(m)
    }
}

/// Writes `text` to standard output. A reader that went away (`shardcache ls | head`)
/// ends the program quietly, as it would a C tool; other write errors fail the command.
pub fn emit(text: &str) -> Result<(), Failure> {
    let mut o = io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(Failure::Error(format!("writing output: {e}"))),
    }
}
/// `print!` through [`emit`] (in functions returning `Result<_, Failure>`).
macro_rules! out {
    ($($t:tt)*) => {
        $crate::output::emit(&format!($($t)*))?
    };
}

/// `println!` through [`emit`].
macro_rules! outln {
    () => {
        $crate::output::emit("\n")?
    };
    ($($t:tt)*) => {
        $crate::output::emit(&(format!($($t)*) + "\n"))?
    };
}

/// What a failed exchange with the daemon means, and what to do about it.
pub fn daemon_failure(socket: &Path, e: &io::Error) -> Failure {
    Failure::Error(match e.kind() {
        // The client library reports every failure to connect as refused; the socket
        // itself tells a daemon that is down from a caller that is kept out.
        io::ErrorKind::ConnectionRefused
            if rustix::fs::access(socket, rustix::fs::Access::WRITE_OK)
                == Err(rustix::io::Errno::ACCESS) =>
        {
            format!(
                "cannot reach shardcached at {}: permission denied\n  the socket's mode or a directory above it keeps this user out (ls -l {0}; the daemon's socket_mode setting)",
                socket.display()
            )
        }
        io::ErrorKind::ConnectionRefused => format!(
            "cannot reach shardcached at {}: {e}\n  is the daemon running? (systemctl status shardcached; or pass --socket / set SHARDCACHE_SOCKET)",
            socket.display()
        ),
        io::ErrorKind::TimedOut => format!(
            "shardcached at {} did not answer in time: it may be overloaded or hung (journalctl -u shardcached; SHARDCACHE_TIMEOUT_MS raises the limit)",
            socket.display()
        ),
        _ => e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn exit_codes_tell_failure_usage_and_not_ready_apart() {
        assert_eq!(Failure::Error(String::new()).code(), 1);
        assert_eq!(Failure::Usage(String::new()).code(), 2);
        assert_eq!(Failure::NotReady(String::new()).code(), 3);
        let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
        let m = daemon_failure(Path::new("/run/x.sock"), &refused);
        assert!(
            m.message()
                .contains("cannot reach shardcached at /run/x.sock")
        );
        assert!(m.message().contains("systemctl status shardcached"));
        assert_eq!(m.code(), 1);
    }
}
