"""Programs' own ``user.*`` xattr calls where the file system keeps none: served from the store.

runsc's gofers answer every xattr call on the sandbox's root file system with EOPNOTSUPP (see
aenv.guest.metadata). The compat shim preloaded into programs (aenv/runtime/compat/aenv_compat.c)
then asks the agent, over an abstract SOCK_SEQPACKET socket, one call a connection:

  request  op (1 byte: "s"et, "g"et, "l"ist, "r"emove), 3 pad bytes, flags (u32), size (u32: the
           caller's buffer), name length (u16), 2 pad bytes; then the name and the value; with the
           file as a descriptor the caller opened (SCM_RIGHTS; O_PATH will do) and the caller's ids
           (SCM_CREDENTIALS, which the sentry checks: a process can claim only its own)
  answer   result (i64: a length, or -errno), then the value or the names

The rules are the kernel's for user.* xattrs: regular files and directories only, the caller's read
(get) or write (set, remove) permission on the file, a sticky directory's owner only, names of at
most 255 bytes, values of at most 64 KiB, and (ext4's block) 4 KiB of names and values a file. The
caller's groups are its user's in /etc/group. Blocking sockets on threads of their own, as for sudo: a
caller that stalls holds one of them for a second at most, never the agent's event loop.
"""

from __future__ import annotations

import array
import errno
import os
import socket
import stat
import struct
import threading
from dataclasses import dataclass

from aenv.guest import metadata
from aenv.guest.sockets import accepted, listen_abstract
from aenv.guest.users import UnknownUser, lookup, name_of_uid

SOCKET_NAME = b"\0aenv-xattr"
HEAD = struct.Struct("<c3xIIH2x")
ANSWER = struct.Struct("<q")
MAX_VALUE = 64 * 1024  # XATTR_SIZE_MAX
WORKERS = 4  # calls answered at once
REQUEST_TIMEOUT = 1.0
XATTR_CREATE, XATTR_REPLACE = 1, 2


@dataclass(frozen=True)
class Call:
    op: bytes
    flags: int
    size: int
    name: str
    value: bytes
    uid: int
    gid: int


class XattrServer:
    """A few threads that each accept a call and answer it: a call is short, and a thread started
    for each would cost more than the call (under the ptrace platform, a millisecond)."""

    def start(self) -> None:
        listener = listen_abstract(SOCKET_NAME, socket.SOCK_SEQPACKET)
        if listener is None:
            return  # taken: programs then get the file system's EOPNOTSUPP
        for i in range(WORKERS):
            threading.Thread(target=self._work, args=(listener,), name=f"xattr-{i}", daemon=True).start()

    def _work(self, listener: socket.socket) -> None:
        for conn in accepted(listener):
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT)  # the shim sends its call at once: a silent caller is let go
            call, fd = _read_call(conn, fds)
            try:
                result, payload = serve(call, fd)
            except OSError as exc:
                result, payload = -(exc.errno or errno.EIO), b""
            conn.sendmsg([ANSWER.pack(result), payload])
        except (OSError, ValueError, UnicodeDecodeError, struct.error):
            pass  # a caller that went away or sent nonsense
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()


def _read_call(conn: socket.socket, fds: list[int]) -> tuple[Call, int]:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    space = socket.CMSG_SPACE(4 * 4) + socket.CMSG_SPACE(struct.calcsize("3i"))
    data, ancillary, flags, _ = conn.recvmsg(HEAD.size + 256 + MAX_VALUE + 1, space, socket.MSG_CMSG_CLOEXEC)
    ids = None
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(raw[: len(raw) - len(raw) % received.itemsize])
            fds.extend(received)
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            ids = struct.unpack("3i", raw[: struct.calcsize("3i")])[1:]
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or ids is None or len(fds) != 1 or len(data) < HEAD.size:
        raise ValueError("malformed call")
    op, call_flags, size, name_length = HEAD.unpack_from(data)
    name = data[HEAD.size : HEAD.size + name_length].decode()
    value = data[HEAD.size + name_length :]
    return Call(op, call_flags, size, name, value, ids[0], ids[1]), fds[0]


def serve(call: Call, fd: int) -> tuple[int, bytes]:
    """(result, payload) of one call on the file open as ``fd``, or OSError with the kernel's errno."""
    st = os.fstat(fd)
    key = _real_path(fd)
    if call.op == b"l":  # listing names takes no permission on the file
        names = b"".join(name.encode() + b"\0" for name in sorted(metadata.STORE.get(key, st) or {}))
        return _sized(names, call.size)
    metadata.check_name(call.name)
    writing = call.op in (b"s", b"r")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise OSError(errno.EPERM if writing else errno.ENODATA, "user xattrs are for files and directories")
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if writing and sticky_dir and call.uid not in (0, st.st_uid):
        raise OSError(errno.EPERM, "a sticky directory's user xattrs are its owner's")
    if not _permitted(st, call.uid, call.gid, writing):
        raise OSError(errno.EACCES, "permission denied")
    attrs = metadata.STORE.get(key, st) or {}
    if call.op == b"g":
        if call.name not in attrs:
            raise OSError(errno.ENODATA, "no such attribute")
        return _sized(attrs[call.name], call.size)
    if call.op == b"r":
        if attrs.pop(call.name, None) is None:
            raise OSError(errno.ENODATA, "no such attribute")
    elif call.op == b"s":
        _check_set(call, attrs)
        attrs[call.name] = call.value
    else:
        raise OSError(errno.EINVAL, "unknown operation")
    if metadata.attrs_size(attrs) > metadata.MAX_TOTAL:
        raise OSError(errno.ENOSPC, "no room left for the file's xattrs")
    metadata.STORE.put(key, st, attrs)
    return 0, b""


def _check_set(call: Call, attrs: metadata.Attrs) -> None:
    if call.flags & ~(XATTR_CREATE | XATTR_REPLACE):
        raise OSError(errno.EINVAL, "unknown flags")
    if len(call.value) > MAX_VALUE:
        raise OSError(errno.E2BIG, "value too large")
    if call.flags & XATTR_CREATE and call.name in attrs:
        raise OSError(errno.EEXIST, "the attribute exists")
    if call.flags & XATTR_REPLACE and call.name not in attrs:
        raise OSError(errno.ENODATA, "no such attribute")


def _sized(data: bytes, size: int) -> tuple[int, bytes]:
    """getxattr's and listxattr's contract: size 0 asks for the length; a smaller buffer is ERANGE."""
    if size == 0:
        return len(data), b""
    if size < len(data):
        raise OSError(errno.ERANGE, "buffer too small")
    return len(data), data


def _real_path(fd: int) -> str:
    path = os.readlink(f"/proc/self/fd/{fd}")
    if not path.startswith("/") or path.endswith(" (deleted)"):
        raise OSError(errno.ENOENT, "the file has no path")
    return path


def _permitted(st: os.stat_result, uid: int, gid: int, writing: bool) -> bool:
    if uid == 0:
        return True
    bit = 2 if writing else 4
    if st.st_uid == uid:
        return bool(st.st_mode >> 6 & bit)
    if st.st_gid == gid or st.st_gid in _groups(uid):
        return bool(st.st_mode >> 3 & bit)
    return bool(st.st_mode & bit)


def _groups(uid: int) -> tuple[int, ...]:
    try:
        return lookup(name_of_uid(uid)).groups
    except UnknownUser:
        return ()
