"""The built-in `desktop` template: an X desktop for computer-use agents, as E2B's Desktop SDK
(``e2b-desktop``) drives it.

Built on `base` in two parts:

1. **Packages.** The host resolves Debian's desktop packages against `base`'s own package list
   and downloads them with its own apt (sandboxes here reach no package mirror), from the mirror
   `base` came from, into the new layer before the build sandbox boots; inside, root installs
   them with apt from those files and sets the desktop up (noVNC under /opt/noVNC, no screen
   blanking, the browser as the default). That sandbox's upper becomes the template's last layer.
2. **The running desktop.** A second build sandbox, as the default user ``user``, starts Xvfb on
   :0 at the SDK's default size (1024x768x24, 96 dpi) and an XFCE session, waits until the
   session's window manager, desktop and panel are up, and is checkpointed: a create restores a
   desktop that runs already, booting neither X nor a session.

The SDK starts ``Xvfb :0 ...`` and ``startxfce4`` on every create. In this template both names
are small scripts in /usr/local/bin (first on a login shell's PATH) that find the desktop of the
snapshot running and leave it be; a create asking another size or dpi stops that desktop and
starts the real Xvfb with the SDK's arguments, then ``startxfce4`` a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from aenv.errors import AenvError, Conflict, InvalidRequest, RuntimeFailure, TemplateBuilding, TemplateNotFound
from aenv.node.service import BuildHost, TemplateRecord
from aenv.runtime import hostexec
from aenv.templates.builder import (
    BuildFailed,
    LogFn,
    StartCommand,
    build_instance,
    commit_template,
    ensure_base,
    host_debian_mirror,
    image_runs_here,
    run_in,
    seal,
)

logger = logging.getLogger(__name__)

NAME = "desktop"
BUILD_TIME = "5 minutes"  # what a build took here (docs/desktop.md), for the messages
USER = "user"
HOME = "/home/user"
DISPLAY = ":0"
# What e2b-desktop starts by default (its resolution and dpi arguments): the snapshot's desktop.
XVFB_ARGS = f"{DISPLAY} -ac -screen 0 1024x768x24 -retro -dpi 96 -nolisten tcp -nolisten unix"
# What the SDK runs (Xvfb, xdpyinfo, startxfce4 and its session, xdotool, scrot, xrandr, x11vnc,
# netstat, xdg-open, gtk-launch, websockify for noVNC) and what a computer-use task expects on a
# desktop (a terminal, an editor, a file manager, fonts, icons). No Recommends: they double it.
PACKAGES = [
    "xvfb",
    "x11-utils",
    "x11-xserver-utils",
    "xauth",
    "xfce4-session",
    "xfwm4",
    "xfdesktop4",
    "xfce4-panel",
    "xfce4-settings",
    "xfconf",
    "dbus-x11",
    "xdotool",
    "scrot",
    "x11vnc",
    "net-tools",
    "procps",
    "libgtk-3-bin",
    "xdg-utils",
    "websockify",
    "xfce4-terminal",  # (xterm cannot open its terminal under runsc 20240729: docs/desktop.md)
    "mousepad",
    "thunar",
    "fonts-dejavu-core",
    "fonts-liberation2",
    "adwaita-icon-theme",
    "librsvg2-common",
    "at-spi2-core",
]
# A browser by name, and the x-www-browser it becomes.
BROWSERS = {"chromium": "/usr/bin/chromium", "firefox-esr": "/usr/bin/firefox-esr", "none": ""}
# noVNC's web files only: Debian's `novnc` package depends on nodejs and OpenStack's libraries
# (+78 MiB), none of which the page or its proxy script needs (websockify is installed apart).
NOVNC_PACKAGE = "novnc"
DEBS = ".aenv-debs"  # where the packages wait in the new layer's root (removed by the install)
# A desktop sandbox's defaults (a create may ask others): a browser needs more than a shell's 1 GiB,
# whose limit, once hit, ends the whole sandbox.
LIMITS = {"cpu_count": 2.0, "memory_mb": 2048}
APT_TIMEOUT = 1800.0
START_TIMEOUT = 300.0  # for the session to come up under gVisor, in the build sandbox

SWITCH = "/tmp/.aenv-desktop-switch"  # there while the Xvfb wrapper replaces the snapshot's desktop
XVFB_WRAPPER = f"""#!/bin/sh
# aenv's desktop template: the snapshot runs Xvfb already ({XVFB_ARGS}) with its session.
# The same arguments find it running and leave it. Other ones replace it: the old desktop is
# killed and the real Xvfb started with them; meanwhile {SWITCH} makes xdpyinfo and
# startxfce4 (both wrapped too) wait, so that neither answers for the old desktop.
: > {SWITCH}
running=$(pgrep -o -f '^/usr/bin/Xvfb ')
if [ -n "$running" ]; then
    have=$(tr '\\0' ' ' < /proc/$running/cmdline | cut -d' ' -f2- | sed 's/ *$//')
    if [ "$have" = "$*" ]; then
        rm -f {SWITCH}
        exit 0
    fi
    session=$(pgrep -x -o xfce4-session)
    if [ -n "$session" ]; then
        pkill -KILL -s "$(ps -o sid= -p "$session" | tr -d ' ')"
    fi
    kill -KILL "$running"
    pkill -KILL -u "$(id -u)" -x 'dbus-daemon|dbus-launch|xfconfd|at-spi-bus-launcher|at-spi2-registryd'
    for _ in $(seq 100); do  # until it has exited (a zombie holds no socket)
        state=$(sed 's/^.*) //' /proc/$running/stat 2>/dev/null | cut -c1)
        [ -z "$state" ] || [ "$state" = Z ] && break
        sleep 0.1
    done
    number=${{1#:}}
    rm -f "/tmp/.X${{number%%.*}}-lock" "/tmp/.X11-unix/X${{number%%.*}}"
fi
# The new display's readiness ends the switch (a watcher the sandbox's init reaps, not Xvfb);
# this process becomes that Xvfb.
( (
    for _ in $(seq 200); do
        /usr/bin/xdpyinfo -display "$1" >/dev/null 2>&1 && break
        sleep 0.1
    done
    rm -f {SWITCH}
) & )
exec /usr/bin/Xvfb "$@"
"""
XDPYINFO_WRAPPER = f"""#!/bin/sh
# aenv's desktop template: while the Xvfb wrapper replaces the desktop, wait for the new one.
for _ in $(seq 300); do [ -e {SWITCH} ] || break; sleep 0.1; done
exec /usr/bin/xdpyinfo "$@"
"""
STARTXFCE4_WRAPPER = f"""#!/bin/sh
# aenv's desktop template: the snapshot runs an XFCE session already; a second would fight it.
for _ in $(seq 300); do [ -e {SWITCH} ] || break; sleep 0.1; done
if pgrep -x xfce4-session >/dev/null; then
    exit 0
fi
exec /usr/bin/startxfce4 "$@"
"""
SCREENSAVER_ENTRY = """[Desktop Entry]
Type=Application
Name=Screen stays on
Exec=sh -c "xset s off; xset s noblank; xset -dpms"
"""
# XFCE's default session less Thunar's daemon (16 MiB of RSS in every desktop; a file manager
# started by hand needs none).
SESSION_CLIENTS = ("xfwm4", "xfsettingsd", "xfce4-panel", "xfdesktop")
SESSION_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<channel name="xfce4-session" version="1.0">\n'
    '  <property name="general" type="empty">\n'
    '    <property name="FailsafeSessionName" type="string" value="Failsafe"/>\n'
    '    <property name="LockCommand" type="string" value=""/>\n  </property>\n'
    '  <property name="sessions" type="empty">\n    <property name="Failsafe" type="empty">\n'
    '      <property name="IsFailsafe" type="bool" value="true"/>\n'
    f'      <property name="Count" type="int" value="{len(SESSION_CLIENTS)}"/>\n'
    + "".join(
        f'      <property name="Client{i}_Command" type="array"><value type="string" value="{name}"/></property>\n'
        f'      <property name="Client{i}_Priority" type="int" value="{15 + 5 * i}"/>\n'
        f'      <property name="Client{i}_PerScreen" type="bool" value="false"/>\n'
        for i, name in enumerate(SESSION_CLIENTS)
    )
    + "    </property>\n  </property>\n</channel>\n"
)
FIREFOX_POLICIES = """{"policies": {"DisableAppUpdate": true, "DisableTelemetry": true,
  "DontCheckDefaultBrowser": true, "OverrideFirstRunPage": "", "OverridePostUpdatePage": ""}}
"""


def _file(path: str, text: str, mode: str = "0644", owner: str = "root") -> str:
    """Shell that writes ``text`` to ``path`` (a quoted here-document: nothing in it expands)."""
    assert "AENV_EOF" not in text
    return (
        f"mkdir -p {os.path.dirname(path)}\ncat > {path} <<'AENV_EOF'\n{text}AENV_EOF\n"
        f"chmod {mode} {path}\nchown {owner}:{owner} {path}\n"
    )


def install_script(browser: str) -> str:
    """What root runs in the build sandbox: the downloaded packages installed, the desktop set up."""
    lines = [
        "set -eu",
        f"cd /{DEBS}",
        "apt-get install -y --no-install-recommends -o Dpkg::Options::=--force-confold ./*.deb",
        # noVNC's web files from Debian's package, at the path the SDK starts its proxy from.
        f"dpkg-deb -x extra/{NOVNC_PACKAGE}_*.deb /tmp/novnc",
        "rm -rf /opt/noVNC && mkdir -p /opt && mv /tmp/novnc/usr/share/novnc /opt/noVNC && rm -rf /tmp/novnc",
        "ln -sf vnc.html /opt/noVNC/index.html",
        f"cd / && rm -rf /{DEBS}",
        _file("/usr/local/bin/Xvfb", XVFB_WRAPPER, "0755"),
        _file("/usr/local/bin/startxfce4", STARTXFCE4_WRAPPER, "0755"),
        _file("/usr/local/bin/xdpyinfo", XDPYINFO_WRAPPER, "0755"),
        _file(f"{HOME}/.config/autostart/screensaver.desktop", SCREENSAVER_ENTRY, owner=USER),
        "update-alternatives --set x-terminal-emulator /usr/bin/xfce4-terminal.wrapper || true",
        # Nor is Thunar started behind the session's back: xfdesktop asked D-Bus for it now and then
        # (a desktop under load had one running); `thunar` started by hand still runs.
        "rm -f /usr/share/dbus-1/services/org.xfce.Thunar*.service",
        "rm -f /usr/share/dbus-1/services/org.xfce.FileManager.service",
        _file("/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/xfce4-session.xml", SESSION_XML),
        # The panel's two plugins that run in processes of their own (a GTK each: ~30 MiB of RSS
        # apiece) run inside the panel instead.
        "sed -i 's/^X-XFCE-Internal=FALSE/X-XFCE-Internal=TRUE/' "
        "/usr/share/xfce4/panel/plugins/actions.desktop /usr/share/xfce4/panel/plugins/systray.desktop",
        "mkdir -p /tmp/.X11-unix && chmod 1777 /tmp/.X11-unix",
    ]
    if BROWSERS[browser]:
        lines.append(f"update-alternatives --set x-www-browser {BROWSERS[browser]}")
    if browser == "firefox-esr":
        lines.append(_file("/usr/lib/firefox-esr/distribution/policies.json", FIREFOX_POLICIES))
    lines += [
        "fc-cache -f >/dev/null 2>&1 || true",
        "update-desktop-database /usr/share/applications >/dev/null 2>&1 || true",
        f"chown -R {USER}:{USER} {HOME}",
        "apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin",
    ]
    return "\n".join(lines) + "\n"


# The session: as E2B's SDK starts it, then the screen kept from blanking (Xvfb blanks an idle
# screen after 10 minutes: black screenshots).
START_SCRIPT = f"""
mkdir -p {HOME}/.cache && : > {HOME}/.cache/aenv-desktop-session
/usr/bin/Xvfb {XVFB_ARGS} >/tmp/.aenv-xvfb.log 2>&1 &
for _ in $(seq 200); do xdpyinfo -display {DISPLAY} >/dev/null 2>&1 && break; sleep 0.1; done
xset s off s noblank -dpms >/dev/null 2>&1 || true
exec /usr/bin/startxfce4 >/tmp/.aenv-xfce.log 2>&1
"""
# Up when the SDK's own readiness checks pass (the session, its window manager and desktop) and
# the panel and the desktop have windows on the screen (they draw after the processes start).
READY_SCRIPT = f"""
up=""
xdpyinfo -display {DISPLAY} >/dev/null 2>&1 && up="$up X"
for name in xfce4-session xfwm4 xfdesktop xfce4-panel; do pgrep -x $name >/dev/null && up="$up $name"; done
xdotool search --onlyvisible --class xfce4-panel >/dev/null 2>&1 && up="$up panel-window"
xdotool search --onlyvisible --class xfdesktop >/dev/null 2>&1 && up="$up desktop-window"
[ "$up" = " X xfce4-session xfwm4 xfdesktop xfce4-panel panel-window desktop-window" ] && exit 0
echo "up so far:$up"; ps -eo pid,user,args | head -40
for f in /tmp/.aenv-xvfb.log /tmp/.aenv-xfce.log; do echo "== $f"; tail -20 $f 2>/dev/null; done
exit 1
"""


def description(browser: str) -> str:
    """Names what the template was built from: a node whose recipe changed builds it anew."""
    recipe = "\n".join([*PACKAGES, browser, install_script(browser), START_SCRIPT, READY_SCRIPT])
    return f"Debian desktop (Xvfb, XFCE, noVNC, {browser}) {hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


class Builds:
    """The desktop's build on one node: one at a time. The first create from a `desktop` that is
    not there yet starts one in the background (``AENV_DESKTOP_ON_FIRST_USE``), and is told to
    come back (503 with Retry-After) until it is built."""

    def __init__(self) -> None:
        self.task: asyncio.Future[TemplateRecord] | None = None
        self.started = 0.0
        self.failure = ""  # why the last build failed ("" when it did not)
        self.kept: dict[str, str] = {}  # see build_desktop

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def build(self, node: BuildHost, browser: str, on_log: LogFn | None = None) -> TemplateRecord:
        """Build it now (a request that streams the log), unless a build is under way."""
        if self.running:
            raise Conflict(f"the {NAME} template is being built already (for {self.elapsed():.0f}s)")
        self.started = time.monotonic()
        self.task = asyncio.ensure_future(build_desktop(node, browser=browser, on_log=on_log, kept=self.kept))
        try:
            rec = await asyncio.shield(self.task)
        except AenvError as exc:
            self.failure = exc.message
            raise
        self.failure = ""
        return rec

    def refresh(self, node: BuildHost, on_log: LogFn | None = None) -> None:
        """At a node's start: a `desktop` whose snapshot another guest agent or runtime wrote is
        snapshotted again on its own layers (its packages stay: seconds, not minutes), in the
        node's background work; creates take the old one meanwhile."""
        try:
            current = node.find_template(NAME)
        except TemplateNotFound:
            return

        async def recommit() -> None:
            if current.guest == node.driver.guest_key() and await image_runs_here(node, current):
                return
            if self.running:
                return
            log = on_log or (lambda line: logger.info("desktop: %s", line))
            log(f"the guest agent or runtime changed: snapshotting `{NAME}` again on its own layers")
            self.started = time.monotonic()
            self.task = asyncio.ensure_future(_snapshot(node, current.layers[:-1], current.description, log))
            with contextlib.suppress(AenvError):  # logged; the old snapshot keeps serving creates
                await asyncio.shield(self.task)

        node.spawn(recommit())

    def on_first_use(self, node: BuildHost, browser: str) -> TemplateBuilding:
        """The answer to a create from a `desktop` that is not built: a build started (or one
        already under way) in the node's background work."""
        if not self.running:
            logger.info("a create asked for the %s template: building it (about %s)", NAME, BUILD_TIME)

            async def quietly() -> None:
                with contextlib.suppress(AenvError):  # logged; the next create tries again
                    await self.build(node, browser, on_log=lambda line: logger.info("desktop build: %s", line))

            node.spawn(quietly())
        said = f"; the last one failed: {self.failure[:300]}" if self.failure else ""
        return TemplateBuilding(
            f"the {NAME} template is being built on this node (about {BUILD_TIME}, once; for "
            f"{self.elapsed():.0f}s now): try again in a minute, or build it ahead with "
            f"`aenv template build {NAME}`{said}",
            retry_after=30,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0


def browser_of(name: str) -> str:
    if name not in BROWSERS:
        raise InvalidRequest(f"browser must be one of {', '.join(BROWSERS)}, not {name[:40]!r}")
    return name


async def build_desktop(
    node: BuildHost, *, browser: str = "chromium", on_log: LogFn | None = None, kept: dict[str, str] | None = None
) -> TemplateRecord:
    """Build (or build anew) the `desktop` template on `base`. ``kept`` carries the packages'
    layer of a build whose desktop then failed to come up to the next build of the same recipe on
    the same `base` (it is not downloaded and installed again)."""
    log = on_log or (lambda line: None)
    browser = browser_of(browser)
    if getattr(node.driver, "own_base", None) is not None:
        raise RuntimeFailure(f"the {NAME} template needs Debian's `base`; this node's runtime makes its own")
    base = await ensure_base(node, on_log=log)
    started = time.monotonic()
    packages = [*PACKAGES, *([browser] if browser != "none" else [])]
    key = " ".join([description(browser), *base.layers])
    kept = kept if kept is not None else {}
    installed = kept.pop(key, "")
    if installed and node.files.layer(installed).is_dir():
        log("packages installed already (by the last build, whose desktop did not come up)")
    else:
        installed = await _install_layer(node, base, packages, browser, log)
        log(f"packages installed in {time.monotonic() - started:.0f}s")
    done = False
    try:
        rec = await _snapshot(node, [*base.layers, installed], description(browser), log)
        done = True
    finally:
        if done or len(kept) >= 1:
            node.files.release([installed])  # its record holds it now (or it is garbage)
        else:
            kept[key] = installed
    log(f"template '{NAME}' built in {time.monotonic() - started:.0f}s")
    return rec


async def _snapshot(node: BuildHost, layers: list[str], described: str, log: LogFn) -> TemplateRecord:
    """The desktop started on ``layers`` and committed running, as the `desktop` template: its
    layers are ``layers`` and one more, what the session wrote (it always writes: START_SCRIPT),
    which a new snapshot of it leaves out."""
    log("starting the desktop to snapshot it")
    start = StartCommand(
        argv=["/bin/bash", "-c", START_SCRIPT],
        env={"DISPLAY": DISPLAY},
        cwd=HOME,
        user=USER,
        ready=["/bin/sh", "-c", READY_SCRIPT],
        ready_timeout_s=START_TIMEOUT,
    )
    return await commit_template(
        node,
        name=NAME,
        layers=layers,
        steps=[],
        env={"DISPLAY": DISPLAY},
        start=start,
        description=described,
        user=USER,
        workdir=HOME,
        on_log=log,
        limits=LIMITS,
    )


async def _install_layer(node: BuildHost, base: TemplateRecord, packages: list[str], browser: str, log: LogFn) -> str:
    """A new layer on `base` with the desktop's packages installed and set up: its id."""

    async def fetch(root: Path) -> None:
        await fetch_packages(node, Path(node.files.layer(base.layers[0])), root / DEBS, packages, log)

    async with build_instance(node, base.layers, f"build-{NAME}", before_boot=fetch) as (link, _, upper):
        log("installing the packages in a build sandbox")
        ran = await run_in(link, install_script(browser), on_log=log)
        if ran.code != 0:
            raise BuildFailed(f"installing the desktop failed: {ran.failure}", step=1, output=ran.output[-4000:])
    layer = await seal(node, upper)
    if layer is None:
        raise RuntimeFailure("the desktop's install wrote nothing")
    return layer


async def fetch_packages(node: BuildHost, debian_root: Path, into: Path, packages: list[str], log: LogFn) -> None:
    """Download ``packages`` and what they need beyond what ``debian_root`` (the root filesystem
    debootstrap made for `base`, never one a sandbox wrote) has installed, with the host's apt in
    a private state of its own (the host's own sources, lists and settings untouched), from the
    mirror `base` came from; noVNC's package apart, in ``into/extra``."""
    settings = node.settings
    mirror = (settings.debian_mirror or host_debian_mirror()).rstrip("/")
    suite = settings.debian_suite
    status = debian_root / "var/lib/dpkg/status"
    if not status.is_file() or status.is_symlink():
        raise RuntimeFailure(f"`base` has no package list at {status}")
    keyring = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
    if not keyring.is_file():
        raise RuntimeFailure(f"no Debian archive keyring at {keyring} (apt-get install debian-archive-keyring)")
    work = Path(await asyncio.to_thread(_mkdtemp, node.files.tmp))
    try:
        for sub in ("etc/apt/apt.conf.d", "etc/apt/preferences.d", "etc/apt/sources.list.d", "lists/partial"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        (into / "extra" / "partial").mkdir(parents=True, exist_ok=True)
        (into / "partial").mkdir(exist_ok=True)
        signed = f"[signed-by={keyring}]"
        security = _security_mirror(mirror)
        (work / "etc/apt/sources.list").write_text(
            f"deb {signed} {mirror} {suite} main\n"
            f"deb {signed} {mirror} {suite}-updates main\n"
            + (f"deb {signed} {security} {suite}-security main\n" if security else "")
        )
        apt = [
            "apt-get",
            "-q",
            "-o", f"Dir={work}",
            "-o", f"Dir::Etc={work}/etc/apt",
            "-o", f"Dir::State::Lists={work}/lists",
            "-o", f"Dir::State::status={status}",
            "-o", f"Dir::Cache={work}/cache",
            "-o", "Dir::Etc::trusted=/dev/null",
            "-o", "APT::Sandbox::User=root",  # writes into the node's private directories
            "-o", "Debug::NoLocking=1",
            "-o", "Acquire::Retries=3",
        ]  # fmt: skip
        log(f"resolving the desktop's packages ({suite} from {mirror})")
        await _apt(log, "apt-get update", [*apt, "update"])
        await _apt(
            log,
            "downloading the packages",
            [*apt, "-o", f"Dir::Cache::archives={into}", "install", "-y", "--download-only", "--no-install-recommends"]
            + packages,
        )
        await _apt(log, f"apt-get download {NOVNC_PACKAGE}", [*apt, "download", NOVNC_PACKAGE], cwd=into / "extra")
        debs = list(into.glob("*.deb"))
        size = sum(p.stat().st_size for p in debs)
        log(f"downloaded {len(debs)} packages, {size / 2**20:.0f} MiB")
        for leftover in (into / "partial", into / "extra" / "partial", into / "lock", into / "extra" / "lock"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


def _security_mirror(mirror: str) -> str:
    """Debian's security archive beside ``mirror`` ("" for a mirror of another shape)."""
    if mirror.endswith("/debian"):
        return mirror + "-security"
    return "http://deb.debian.org/debian-security"


def _mkdtemp(under: Path) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="desktop-apt-", dir=under)


async def _apt(log: LogFn, what: str, argv: list[str], cwd: Path | None = None) -> None:
    try:
        out = await hostexec.run(argv, timeout=APT_TIMEOUT, cwd=cwd, umask=0o022)
    except AenvError as exc:
        raise RuntimeFailure(f"{what} failed: {exc.message}") from exc
    for line in out.splitlines()[-3:]:
        log(f"  {line}")
