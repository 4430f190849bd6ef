//! Who may read what through the cache (promise 3 in DESIGN.md).
//!
//! The daemon reads the backing store with its own (broad) rights, so it must decide for
//! each client whether the client itself could have read the file. It does so from the
//! client's kernel-verified credentials (`SO_PEERCRED` and `SO_PEERGROUPS` on the Unix
//! socket) and the owner and mode of the file and of every directory on its path, which
//! [`crate::backing::Backing::stat`] returns. The rule is the POSIX one: search (`x`) on
//! every directory, read (`r`) on the file, with the owner, group or other class chosen
//! by the first that matches.
//!
//! It is deliberately stricter than the kernel in two ways, each of which sends the
//! client to read the backing store itself, where the kernel decides:
//! - uid 0 gets no override: a root-squashed export may deny root what the daemon can
//!   read, so root is judged by the mode bits like anyone else;
//! - an object with an access control list is [`Decision::Uncertain`]: the daemon does
//!   not evaluate ACLs.
//!
//! See docs/SEMANTICS.md for the trade-off against passing the client's own descriptor.
//!
//! Every access decision of the daemon is here: reads ([`check`]), listing a directory
//! for a glob ([`may_walk`]), who is an operator ([`is_operator`]) and who may change a
//! job ([`may_change_job`]). Callers (the read path, the jobs, the admin requests) apply
//! the answers; none decides on its own.

use crate::backing::{Owner, Stat};

/// A client's credentials, as the kernel reported them at `connect()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    /// Process id: for logs, and to tell whether a job's lease holder lives (0: the
    /// client is in a pid namespace the daemon cannot see); never for access decisions.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

/// The outcome of an access check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The client could read the file on the backing store.
    Allow,
    /// The client could not.
    Deny,
    /// The daemon cannot tell (an ACL is involved).
    Uncertain,
}

const READ: u32 = 4;
const SEARCH: u32 = 1;

/// Decides whether `creds` may read the file described by `stat`.
pub fn check(stat: &Stat, creds: &Creds) -> Decision {
    let mut verdict = Decision::Allow;
    for dir in &stat.dirs {
        match may(dir, creds, SEARCH) {
            Decision::Deny => return Decision::Deny,
            Decision::Uncertain => verdict = Decision::Uncertain,
            Decision::Allow => {}
        }
    }
    match may(&stat.owner, creds, READ) {
        Decision::Deny => Decision::Deny,
        Decision::Uncertain => Decision::Uncertain,
        Decision::Allow => verdict,
    }
}

/// Decides whether `creds` may list a directory owned as `dir` (read permission on it;
/// search on the directories above is the caller's to check).
pub fn may_list(dir: &Owner, creds: &Creds) -> Decision {
    may(dir, creds, READ)
}

/// Decides whether `creds` may list the last of `dirs` and look inside it: search on
/// every directory from the root to it, and read on it (`dirs` as
/// [`crate::backing::Backing::dir_owners`] gives them).
pub fn may_walk(dirs: &[Owner], creds: &Creds) -> Decision {
    let Some(last) = dirs.last() else {
        return Decision::Deny;
    };
    let mut verdict = may(last, creds, READ);
    for d in dirs {
        match may(d, creds, SEARCH) {
            Decision::Deny => return Decision::Deny,
            Decision::Uncertain => verdict = Decision::Uncertain,
            Decision::Allow => {}
        }
    }
    verdict
}

fn may(o: &Owner, c: &Creds, want: u32) -> Decision {
    if o.acl {
        return Decision::Uncertain;
    }
    let bits = if c.uid == o.uid {
        (o.mode >> 6) & 7
    } else if c.gid == o.gid || c.groups.contains(&o.gid) {
        (o.mode >> 3) & 7
    } else {
        o.mode & 7
    };
    if bits & want != 0 {
        Decision::Allow
    } else {
        Decision::Deny
    }
}

/// True for the operators: root and the daemon's own user. They may evict, list and
/// verify everything, change any job, and vouch for any file of an `immutable` manifest.
pub fn is_operator(creds: &Creds) -> bool {
    creds.uid == 0 || creds.uid == rustix::process::geteuid().as_raw()
}

/// Whether user `uid` (`operator`: see [`is_operator`]) may replace, unregister or move
/// a job that `registrant` registered: its registrant and operators may.
pub fn may_change_job(registrant: u32, uid: u32, operator: bool) -> bool {
    registrant == uid || operator
}

/// Credentials for the daemon's unit tests.
#[cfg(test)]
pub(crate) mod test_support {
    use super::Creds;

    /// User `uid` in its own group, with no supplementary groups (uid 0: root).
    pub(crate) fn creds(uid: u32) -> Creds {
        Creds {
            pid: 1,
            uid,
            gid: uid,
            groups: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Version;

    fn stat(dirs: &[(u32, u32, u32)], file: (u32, u32, u32)) -> Stat {
        let o = |(uid, gid, mode): (u32, u32, u32)| Owner {
            uid,
            gid,
            mode,
            acl: false,
        };
        Stat {
            path: "f".into(),
            dirs: dirs.iter().copied().map(o).collect(),
            owner: o(file),
            version: Version::default(),
        }
    }

    fn creds(uid: u32, gid: u32, groups: &[u32]) -> Creds {
        Creds {
            pid: 1,
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn posix_classes() {
        let s = stat(&[(0, 0, 0o755)], (1000, 100, 0o640));
        assert_eq!(check(&s, &creds(1000, 1000, &[])), Decision::Allow, "owner");
        assert_eq!(
            check(&s, &creds(2000, 100, &[])),
            Decision::Allow,
            "primary group"
        );
        assert_eq!(
            check(&s, &creds(2000, 2000, &[7, 100])),
            Decision::Allow,
            "supplementary group"
        );
        assert_eq!(check(&s, &creds(2000, 2000, &[7])), Decision::Deny, "other");
        assert_eq!(
            check(&s, &creds(0, 0, &[])),
            Decision::Deny,
            "root gets no override"
        );
    }

    #[test]
    fn owner_class_wins_even_when_it_grants_less() {
        let s = stat(&[(0, 0, 0o755)], (1000, 100, 0o044));
        assert_eq!(check(&s, &creds(1000, 100, &[])), Decision::Deny);
    }

    #[test]
    fn every_directory_needs_search() {
        let s = stat(&[(0, 0, 0o755), (1000, 100, 0o700)], (1000, 100, 0o644));
        assert_eq!(check(&s, &creds(1000, 100, &[])), Decision::Allow);
        assert_eq!(check(&s, &creds(2000, 100, &[])), Decision::Deny);
    }

    #[test]
    fn walking_a_directory_needs_search_on_every_one_and_read_on_it() {
        let o = |uid, mode| Owner {
            uid,
            gid: 100,
            mode,
            acl: false,
        };
        let alice = creds(1000, 1000, &[]);
        let root_dir = o(0, 0o755);
        assert_eq!(may_walk(&[root_dir, o(0, 0o755)], &alice), Decision::Allow);
        assert_eq!(
            may_walk(&[root_dir, o(0, 0o700)], &alice),
            Decision::Deny,
            "a 0700 directory of another user"
        );
        assert_eq!(
            may_walk(&[root_dir, o(0, 0o711)], &alice),
            Decision::Deny,
            "search without read: its names may not be listed"
        );
        assert_eq!(
            may_walk(&[o(0, 0o700), o(1000, 0o755)], &alice),
            Decision::Deny,
            "its own directory below one it may not search"
        );
        assert_eq!(
            may_walk(&[root_dir, o(1000, 0o700)], &alice),
            Decision::Allow
        );
        assert_eq!(may_walk(&[], &alice), Decision::Deny);
    }

    #[test]
    fn acls_are_uncertain_unless_denied_elsewhere() {
        let mut s = stat(&[(0, 0, 0o755)], (1000, 100, 0o644));
        s.owner.acl = true;
        assert_eq!(check(&s, &creds(2000, 2000, &[])), Decision::Uncertain);
        let mut s = stat(&[(0, 0, 0o700)], (1000, 100, 0o644));
        s.owner.acl = true;
        assert_eq!(check(&s, &creds(2000, 2000, &[])), Decision::Deny);
    }
}
