//! Kernel-reported credentials of a Unix-socket peer.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use crate::access::Creds;

/// Reads `SO_PEERCRED` (pid, uid, gid at `connect()`) and `SO_PEERGROUPS`
/// (supplementary groups, Linux 4.13+; absent on older kernels, which then judge by the
/// primary group only: stricter, never looser).
pub fn peer(conn: &UnixStream) -> io::Result<Creds> {
    let uc = rustix::net::sockopt::socket_peercred(conn)?;
    Ok(Creds {
        pid: uc.pid.as_raw_nonzero().get(),
        uid: uc.uid.as_raw(),
        gid: uc.gid.as_raw(),
        groups: peer_groups(conn).unwrap_or_default(),
    })
}

fn peer_groups(conn: &UnixStream) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    for _ in 0..2 {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` is a live, writable buffer of exactly `len` bytes, and the
        // kernel writes at most `len` bytes (it reports ERANGE with the needed size
        // otherwise); the descriptor is owned by `conn` for the call's duration.
        let r = unsafe {
            libc::getsockopt(
                conn.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
    Err(io::Error::other("SO_PEERGROUPS kept growing"))
}
