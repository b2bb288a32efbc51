"""`sudo` without setuid: the agent, root already, starts the command for the sandbox's user.

gVisor runs every sandbox with no_new_privs, so a setuid `sudo` never gains privileges. Images get
a small client instead (aenv/runtime/compat/aenv_sudo.c, at /.aenv/bin/sudo, which describes the
protocol): it passes its argv, environment, cwd and stdio over an abstract Unix socket, and the
agent parses sudo's options, applies the policy and spawns the command through the spawn path of
every other command, on the client's stdio. The socket is the sandbox kernel's own: it reaches
nothing outside the sandbox and is saved and restored with it.

Who asks is what the client's SCM_CREDENTIALS say: the sentry lets a process claim only its own
ids (root any). This runsc's SO_PEERCRED answers with the caller's own credentials, so it cannot
be used. The policy is E2B's templates': `user` may run anything as anyone without a password, as
root may; everyone else is refused. Blocking sockets on threads, as for egress.
"""

from __future__ import annotations

import array
import asyncio
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.guest.processes import ProcessError, _which
from aenv.guest.sockets import accepted, listen_abstract, on_loop
from aenv.guest.users import UnknownUser, User, lookup, name_of_uid

SOCKET_NAME = b"\0aenv-sudo"
MAGIC = "aenv-sudo/1"
SUDOERS = ("root", "user")  # who may run anything as anyone, without a password
MAX_REQUEST = 4 << 20
REQUEST_TIMEOUT = 10.0
MAX_CLIENTS = 128  # sudo commands running at once: each holds a thread of the agent
VERSION = "Sudo version 1.9 (aenv: commands are started by the sandbox agent)\n"
USAGE = (
    "usage: sudo -h | -K | -k | -V\n"
    "usage: sudo -v [-knS] [-g group] [-u user]\n"
    "usage: sudo -l [-knS] [-g group] [-u user] [command [arg ...]]\n"
    "usage: sudo [-bEHiknPsS] [-D directory] [-g group] [-u user] [VAR=value] [-i | -s] [command [arg ...]]\n"
)
# What sudo's env_reset keeps of the caller's environment (Debian's defaults).
KEPT_ENV = {"TERM", "COLORTERM", "DISPLAY", "XAUTHORITY", "COLORS", "LS_COLORS", "LANG", "LANGUAGE", "TZ"}
NO_ARGUMENT = set("bEHiknPsSKvlVhAB")
WITH_ARGUMENT = set("ugDCpUrtTRh")
LONG = {
    "user": "u",
    "group": "g",
    "chdir": "D",
    "login": "i",
    "shell": "s",
    "non-interactive": "n",
    "stdin": "S",
    "reset-timestamp": "k",
    "remove-timestamp": "K",
    "validate": "v",
    "list": "l",
    "version": "V",
    "help": "h",
    "set-home": "H",
    "preserve-groups": "P",
    "background": "b",
    "askpass": "A",
    "bell": "B",
    "prompt": "p",
    "close-from": "C",
    "other-user": "U",
    "role": "r",
    "type": "t",
    "command-timeout": "T",
    "chroot": "R",
    "host": "h",
}
RELAYED = {int(s) for s in signal.valid_signals()} - {signal.SIGKILL, signal.SIGSTOP}


class Refused(Exception):
    """sudo's answer without running anything: text for stdout/stderr and an exit code."""

    def __init__(self, code: int, err: str = "", out: str = "") -> None:
        super().__init__(err or out)
        self.code, self.err, self.out = code, err, out


@dataclass
class Request:
    asker: int
    cwd: str
    argv: list[str]
    env: dict[str, str]


@dataclass
class Options:
    flags: set[str] = field(default_factory=set)
    user: str = "root"
    group: str | None = None
    chdir: str | None = None
    preserve: set[str] = field(default_factory=set)  # --preserve-env=A,B
    assignments: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)


@dataclass
class Plan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: User
    background: bool


def parse(args: list[str]) -> Options:
    """sudo's options (stopping at the first operand), VAR=value assignments, the command."""
    opts = Options()
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        i += 1
        if arg == "--":
            break
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name == "preserve-env":
                if eq:
                    opts.preserve.update(v for v in value.split(",") if v)
                else:
                    opts.flags.add("E")
                continue
            flag = LONG.get(name)
            if flag is None:
                raise Refused(1, f"sudo: unrecognized option '{arg}'\n{USAGE}")
            if flag in WITH_ARGUMENT and not (flag == "h" and not eq):
                if not eq:
                    if i >= len(args):
                        raise Refused(1, f"sudo: option '--{name}' requires an argument\n{USAGE}")
                    value, i = args[i], i + 1
                _take(opts, flag, value)
            else:
                opts.flags.add(flag)
            continue
        j = 1
        while j < len(arg):
            flag = arg[j]
            j += 1
            if flag in NO_ARGUMENT and not (flag == "h" and j < len(arg)):
                opts.flags.add(flag)
            elif flag in WITH_ARGUMENT:
                value = arg[j:]
                if not value:
                    if i >= len(args):
                        raise Refused(1, f"sudo: option requires an argument -- '{flag}'\n{USAGE}")
                    value, i = args[i], i + 1
                _take(opts, flag, value)
                break
            else:
                raise Refused(1, f"sudo: invalid option -- '{flag}'\n{USAGE}")
    while i < len(args) and "=" in args[i] and not args[i].startswith("=") and "/" not in args[i].split("=")[0]:
        name, _, value = args[i].partition("=")
        opts.assignments[name] = value
        i += 1
    opts.command = args[i:]
    return opts


def _take(opts: Options, flag: str, value: str) -> None:
    if flag == "u":
        opts.user = value
    elif flag == "g":
        opts.group = value
    elif flag == "D":
        opts.chdir = value
    # -C, -p, -U, -r, -t, -T, -R, -h host: nothing to prompt, close or confine here


def _target(name: str) -> User:
    try:
        return lookup(name[1:] if name.startswith("#") and name[1:].isdigit() else name)
    except UnknownUser:
        raise Refused(1, f"sudo: unknown user {name}\n") from None


def _group_id(name: str) -> int:
    wanted = name[1:] if name.startswith("#") else name
    try:
        with open("/etc/group", encoding="utf-8", errors="replace") as f:
            for line in f:
                row = line.rstrip("\n").split(":")
                if len(row) >= 3 and row[2].isdigit() and wanted in (row[0], row[2]):
                    return int(row[2])
    except OSError:
        pass
    if wanted.isdigit():
        return int(wanted)
    raise Refused(1, f"sudo: unknown group {name}\n")


def _escaped(args: list[str]) -> str:
    """The command for ``shell -c``, escaped as sudo escapes it for -s and -i."""
    return " ".join("".join(c if c.isalnum() or c in "_-$" else "\\" + c for c in a) for a in args)


def plan(req: Request, base_env: Callable[[User], dict[str, str]]) -> Plan:
    """What to run for ``req``, or Refused with sudo's answer. ``base_env`` is the environment
    the agent gives every command of a user (PATH, HOME, the sandbox's variables, the proxy)."""
    name = name_of_uid(req.asker)
    if req.asker != 0 and name not in SUDOERS:
        raise Refused(1, f"{name} is not in the sudoers file.\n")
    opts = parse(req.argv[1:])
    flags = opts.flags
    target = _target(opts.user)
    if opts.group is not None:
        target = User(target.name, target.uid, _group_id(opts.group), target.home, target.shell, target.groups)
    if "h" in flags:
        raise Refused(0, out=USAGE)
    if "V" in flags:
        raise Refused(0, out=VERSION)
    if "l" in flags and not opts.command:
        raise Refused(0, out=f"User {name} may run the following commands on sandbox:\n    (ALL : ALL) NOPASSWD: ALL\n")
    if flags & {"v", "k", "K"} and not opts.command and not flags & {"i", "s"}:
        raise Refused(0)  # no password is ever asked: no timestamp to validate or remove
    if not opts.command and not flags & {"i", "s"}:
        raise Refused(1, USAGE)

    env = base_env(target)
    if "E" in flags:
        env = {**req.env, **{k: env[k] for k in ("PATH", "USER", "LOGNAME")}}
    env.update({k: v for k, v in req.env.items() if k in KEPT_ENV or k.startswith("LC_") or k in opts.preserve})
    if flags & {"H", "i"}:
        env["HOME"] = target.home
    env.update(opts.assignments)

    cwd = req.cwd if req.cwd and os.path.isdir(req.cwd) else "/"
    if "i" in flags:
        cwd = target.home if os.path.isdir(target.home) else "/"
        argv = [target.shell, "-l", *(["-c", _escaped(opts.command)] if opts.command else [])]
    elif "s" in flags:
        shell = req.env.get("SHELL") or target.shell
        argv = [shell, *(["-c", _escaped(opts.command)] if opts.command else [])]
    else:
        argv = [_command_path(opts.command[0], cwd, env["PATH"]), *opts.command[1:]]
    if opts.chdir is not None:
        cwd = opts.chdir if opts.chdir.startswith("/") else os.path.join(cwd, opts.chdir)
        if not os.path.isdir(cwd):
            raise Refused(1, f"sudo: unable to change directory to {opts.chdir}: No such file or directory\n")
    if "l" in flags:
        raise Refused(0, out=argv[0] + "\n")
    caller = lookup(name)
    env.update(
        {
            "SUDO_USER": caller.name,
            "SUDO_UID": str(caller.uid),
            "SUDO_GID": str(caller.gid),
            "SUDO_COMMAND": " ".join(argv)[:4096],
        }
    )
    return Plan(argv, env, cwd, target, background="b" in flags)


def _command_path(cmd: str, cwd: str, path: str) -> str:
    if "/" in cmd:
        given = cmd if cmd.startswith("/") else os.path.join(cwd, cmd)
        found = given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    else:
        found = _which(cmd, path)
    if found is None:
        raise Refused(1, f"sudo: {cmd}: command not found\n")
    return found


# -- the socket -----------------------------------------------------------------------------------
def frame(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("<I", len(payload)) + payload


class SudoServer:
    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        listener = listen_abstract(SOCKET_NAME, socket.SOCK_STREAM)
        if listener is None:
            return  # taken: sudo then answers that it cannot reach the agent
        threading.Thread(target=self._accept, args=(listener,), name="sudo-accept", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        for conn in accepted(listener):
            if not self.slots.acquire(blocking=False):
                _answer(conn, Refused(1, f"sudo: more than {MAX_CLIENTS} sudo commands at once\n"))
                conn.close()
                continue
            threading.Thread(target=self._client, args=(conn,), name="sudo", daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            self._serve(conn, fds)
        except Refused as answer:
            _answer(conn, answer)
        except (OSError, ValueError, UnicodeDecodeError, struct.error):
            pass  # a client that went away or sent nonsense
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            self.slots.release()

    def _serve(self, conn: socket.socket, fds: list[int]) -> None:
        req = _read_request(conn, fds)
        try:
            todo = plan(req, lambda user: self.agent.process_env(user, None))
        except UnknownUser as exc:
            raise Refused(1, f"sudo: {exc}\n") from None
        assert self.loop is not None
        pid, exited = on_loop(self.loop, self._launch(todo, fds, conn))
        for fd in fds:
            os.close(fd)  # the command has them now
        fds.clear()
        if todo.background:
            raise Refused(0)
        conn.settimeout(None)
        while data := conn.recv(64):  # signals to relay, until the command ends or the client goes
            for sig in data:
                if sig in RELAYED and not exited.done():
                    _signal(pid, sig)
        if not exited.done():
            _signal(pid, signal.SIGKILL)  # the client was killed: so is its command
            return
        code = exited.result()
        conn.sendall(frame(b"x", struct.pack("<i", code)) if code >= 0 else frame(b"k", struct.pack("<i", -code)))

    async def _launch(self, todo: Plan, fds: list[int], conn: socket.socket) -> tuple[int, asyncio.Future[int]]:
        try:
            pid, exited = self.agent.procs.start_with_fds(todo.argv, todo.env, todo.cwd, todo.user, tuple(fds))
        except (OSError, ProcessError) as exc:
            raise Refused(1, f"sudo: unable to execute {todo.argv[0]}: {exc}\n") from None
        exited.add_done_callback(lambda _: _wake(conn))
        return pid, exited


def _signal(pid: int, sig: int) -> None:
    """The command leads a session of its own: its children get the signal too."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _wake(conn: socket.socket) -> None:
    """The command ended: end the relay loop's recv() so it reports the exit."""
    try:
        conn.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def _answer(conn: socket.socket, answer: Refused) -> None:
    try:
        out = b"".join(frame(k, t.encode()) for k, t in ((b"o", answer.out), (b"e", answer.err)) if t)
        conn.sendall(out + frame(b"x", struct.pack("<i", answer.code)))
    except OSError:
        pass


def _read_request(conn: socket.socket, fds: list[int]) -> Request:
    conn.settimeout(REQUEST_TIMEOUT)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    space = socket.CMSG_SPACE(3 * 4) + socket.CMSG_SPACE(struct.calcsize("3i"))
    head, ancillary, _, _ = conn.recvmsg(4, space, socket.MSG_CMSG_CLOEXEC)  # no other command inherits them
    asker = None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(data[: len(data) - len(data) % received.itemsize])
            fds.extend(received)
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            asker = struct.unpack("3i", data[: struct.calcsize("3i")])[1]
    if len(head) != 4:
        raise ValueError("short request")
    (length,) = struct.unpack("<I", head)
    if length > MAX_REQUEST:
        raise Refused(1, "sudo: argument list too long\n")
    if asker is None or len(fds) != 3:
        raise Refused(1, "sudo: the request carries no credentials or no stdio\n")
    body = bytearray()
    while len(body) < length:
        part = conn.recv(min(length - len(body), 1 << 20))
        if not part:
            raise ValueError("short request")
        body += part
    fields = bytes(body).split(b"\0")
    if fields[-1] == b"":
        fields.pop()
    text = [os.fsdecode(f) for f in fields]
    if len(text) < 3 or text[0] != MAGIC or not text[2].isdigit() or len(text) < 3 + int(text[2]) or int(text[2]) < 1:
        raise ValueError("malformed request")
    argc = int(text[2])
    argv = text[3 : 3 + argc]
    env = dict(item.split("=", 1) for item in text[3 + argc :] if "=" in item)
    return Request(asker, text[1], argv, env)
