//! Kernel-reported credentials of a Unix-socket peer.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use crate::access::Creds;

/// Reads `SO_PEERCRED` (pid, uid, gid at `connect()`) and `SO_PEERGROUPS`
/// (supplementary groups, Linux 4.13+; absent on older kernels, which then judge by the
/// primary group only: stricter, never looser). The pid is 0 when the peer is in a pid
/// namespace the daemon cannot see.
pub fn peer(conn: &UnixStream) -> io::Result<Creds> {
    let uc = peer_cred(conn)?;
    Ok(Creds {
        pid: uc.pid,
        uid: uc.uid,
        gid: uc.gid,
        groups: peer_groups(conn).unwrap_or_default(),
    })
}

/// `SO_PEERCRED` as the kernel gives it: read into `libc::ucred`, whose pid may be 0
/// (rustix's `UCred` holds a non-zero `Pid`, which a pid from another namespace is not).
fn peer_cred(conn: &UnixStream) -> io::Result<libc::ucred> {
    let mut uc = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `uc` is a live, writable `ucred` of exactly `len` bytes, which is what
    // SO_PEERCRED writes; the descriptor is owned by `conn` for the call's duration.
    let r = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut uc).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(uc)
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
