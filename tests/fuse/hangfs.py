#!/usr/bin/python3
"""A read-only FUSE passthrough of one directory, for tests that hang a backing store.

    hangfs.py SOURCE MOUNTPOINT

Runs in the foreground until unmounted. Hang it with SIGSTOP and release it with
SIGCONT: every call into the mount then blocks in the kernel, as on a hung network file
system. The kernel caches nothing (attribute and entry timeouts 0, direct I/O), so that
each stat, open and read reaches this process.

Debian: fuse3 and python3-fusepy (scripts/fuse-deps.sh installs them).
"""

import errno
import os
import sys

import fusepy


class Passthrough(fusepy.Operations):
    def __init__(self, source):
        self.source = os.path.realpath(source)

    def _path(self, path):
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path)) if fh is None else os.fstat(fh)
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino",
                "st_atime", "st_mtime", "st_ctime")
        out = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = getattr(st, k + "_ns") / 1e9
        return out

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._path(path))

    def readlink(self, path):
        return os.readlink(self._path(path))

    def access(self, path, amode):
        if not os.access(self._path(path), amode):
            raise fusepy.FuseOSError(errno.EACCES)

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise fusepy.FuseOSError(errno.EROFS)
        return os.open(self._path(path), os.O_RDONLY)

    def opendir(self, path):
        if not os.path.isdir(self._path(path)):
            raise fusepy.FuseOSError(errno.ENOTDIR)
        return 0

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)

    def statfs(self, path):
        sv = os.statvfs(self._path(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")
        return {k: getattr(sv, k) for k in keys}


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: hangfs.py SOURCE MOUNTPOINT")
    fusepy.FUSE(
        Passthrough(sys.argv[1]),
        sys.argv[2],
        foreground=True,
        nothreads=False,
        ro=True,
        direct_io=True,
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
        use_ino=True,
        fsname="hangfs",
    )


if __name__ == "__main__":
    main()
