"""The `desktop` template with E2B's Desktop SDK (``e2b_desktop``), unchanged: create, screenshot,
mouse and keyboard, windows, the noVNC stream through the port proxy; a running desktop forked,
paused and resumed. Real runsc sandboxes; the template is built once (minutes) on the suite's node.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b_desktop import Sandbox
from PIL import Image, ImageChops
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server

pytestmark = [pytest.mark.runsc, pytest.mark.sandbox, pytest.mark.timeout(2400)]


@pytest.fixture()
def env(desktop: Server, e2b_env: Server) -> Server:
    return e2b_env


@pytest.fixture()
def sbx(env: Server) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300)
    yield sandbox
    sandbox.kill()


def png(data: bytes | bytearray) -> Image.Image:
    image = Image.open(io.BytesIO(bytes(data)))
    assert image.format == "PNG"
    return image.convert("RGB")


def changed(a: Image.Image, b: Image.Image, box: tuple[int, int, int, int] | None = None) -> bool:
    if box is not None:
        a, b = a.crop(box), b.crop(box)
    return ImageChops.difference(a, b).getbbox() is not None


def wait_for(what: str, check: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception:  # noqa: BLE001 - not there yet (xdotool finds no window: exit 1)
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.5)


def open_terminal(sandbox: Sandbox, title: str) -> str:
    """A terminal (XFCE's: VTE) with ``title`` on the desktop, focused: its window id."""
    sandbox.commands.run(f"xfce4-terminal --disable-server --title {title} --geometry 80x20+100+100", background=True)
    ids: list[str] = []

    def found() -> bool:
        ids[:] = sandbox.commands.run(f"xdotool search --onlyvisible --name {title}").stdout.split()
        return bool(ids)

    wait_for(f"a window named {title}", found)
    sandbox.commands.run(f"xdotool windowactivate --sync {ids[0]} || xdotool windowfocus --sync {ids[0]}")
    return ids[0]


def test_a_created_desktop_answers_the_sdk_at_its_default_size(sbx: Sandbox) -> None:
    assert sbx.get_screen_size() == (1024, 768)
    assert sbx.get_cursor_position() == (512, 384)  # nothing moved Xvfb's pointer from the centre
    shot = png(sbx.screenshot())
    assert shot.size == (1024, 768)
    assert len(shot.resize((64, 48)).getcolors(64 * 48) or []) > 4  # a drawn desktop (panel, icons), not blank
    env = sbx.commands.run("echo $DISPLAY; whoami; pgrep -c -x Xvfb; pgrep -c -x xfce4-session").stdout.split()
    assert env == [":0", "user", "1", "1"]  # the snapshot's desktop, not a second one
    # Trimmed: no file manager daemon, the panel's plugins inside the panel.
    assert sbx.commands.run("pgrep -c -x Thunar; pgrep -c -f 'panel/[w]rapper'; true").stdout.split() == ["0", "0"]


def test_the_template_asks_room_for_a_browser(desktop: Server, api: httpx.Client) -> None:
    template = api.get("/templates/desktop").json()
    assert (template["cpuCount"], template["memoryMB"]) == (2, 2048) and template["public"] is True


def test_keyboard_and_mouse_reach_the_desktop(sbx: Sandbox) -> None:
    window = open_terminal(sbx, "aenv-keys")
    assert sbx.get_window_title(window) == "aenv-keys"
    before = png(sbx.screenshot())
    sbx.write("echo typed-by-xdotool > /tmp/typed.txt")
    sbx.press("enter")
    wait_for("the typed command's file", lambda: sbx.files.read("/tmp/typed.txt") == "typed-by-xdotool\n", 30)
    assert changed(before, png(sbx.screenshot()))
    sbx.press(["ctrl", "d"])  # the shell ends: its window goes
    wait_for("the terminal closing", lambda: not sbx.commands.run("pgrep -x xfce4-terminal || true").stdout.strip(), 30)
    sbx.move_mouse(100, 200)
    assert sbx.get_cursor_position() == (100, 200)
    # A right click on the desktop opens xfdesktop's menu: the screen around the pointer changes.
    sbx.move_mouse(700, 400)
    time.sleep(1)
    plain = png(sbx.screenshot())
    sbx.right_click()
    box = (700, 400, 800, 500)
    wait_for("xfdesktop's menu", lambda: changed(plain, png(sbx.screenshot()), box), 20)
    sbx.press("esc")


def test_another_size_starts_a_desktop_of_that_size(env: Server) -> None:
    sandbox = Sandbox.create(resolution=(800, 600), timeout=300)
    try:
        assert sandbox.get_screen_size() == (800, 600)
        assert png(sandbox.screenshot()).size == (800, 600)
        assert sandbox.commands.run("pgrep -c -x Xvfb; pgrep -c -x xfce4-session").stdout.split() == ["1", "1"]
    finally:
        sandbox.kill()


def test_the_stream_is_served_through_the_port_proxy(sbx: Sandbox, env: Server) -> None:
    sbx.stream.start(require_auth=True)
    key = sbx.stream.get_auth_key()
    url = sbx.stream.get_url(auth_key=key)
    assert url.startswith(f"https://6080-{sbx.sandbox_id}.") and f"password={key}" in url
    routed = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "6080"}
    page = httpx.get(f"{env.url}/vnc.html", headers=routed, timeout=30)
    assert page.status_code == 200 and "noVNC" in page.text
    by_host = {"Host": f"6080-{sbx.sandbox_id}.aenv.test"}
    assert httpx.get(f"{env.url}/app/ui.js", headers=by_host, timeout=30).status_code == 200
    # The page's WebSocket: x11vnc's RFB greeting through websockify, the proxy and the agent.
    ws_url = env.url.replace("http", "ws", 1) + "/websockify"
    with ws_connect(ws_url, additional_headers=routed, subprotocols=["binary"], open_timeout=30) as ws:  # type: ignore[list-item]
        greeting = ws.recv(timeout=30)
        assert bytes(greeting if isinstance(greeting, bytes) else greeting.encode()).startswith(b"RFB 003.")
        ws.send(b"RFB 003.008\n")
        security = ws.recv(timeout=30)
        assert isinstance(security, bytes) and 2 in security[1:]  # VNC authentication: the password is asked
    sbx.stream.stop()


def test_a_running_desktop_forks_with_its_windows(sbx: Sandbox, env: Server, api: httpx.Client) -> None:
    open_terminal(sbx, "aenv-fork")
    r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2}, timeout=300)
    assert r.status_code in (200, 201), r.text
    children = [Sandbox.connect(item["sandbox"]["sandboxID"]) for item in r.json()]
    try:
        for i, child in enumerate(children):
            found = child.commands.run("xdotool search --onlyvisible --name aenv-fork").stdout.split()
            assert len(found) == 1, found  # the source's terminal window, in every child
            assert png(child.screenshot()).size == (1024, 768)
            child.commands.run(f"xdotool windowactivate --sync {found[0]}")
            child.write(f"echo child-{i} > /tmp/who.txt")
            child.press("enter")
        for i, child in enumerate(children):  # each child went its own way
            wait_for(f"child {i}'s file", lambda c=child, n=i: c.files.read("/tmp/who.txt") == f"child-{n}\n", 30)
        assert sbx.commands.run("test -e /tmp/who.txt && echo yes || echo no").stdout.strip() == "no"
    finally:
        for child in children:
            child.kill()


def test_a_desktop_pauses_and_resumes_with_its_windows(sbx: Sandbox) -> None:
    window = open_terminal(sbx, "aenv-pause")
    sbx.beta_pause()
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300)
    assert resumed.commands.run("xdotool search --onlyvisible --name aenv-pause").stdout.split() == [window]
    assert png(resumed.screenshot()).size == (1024, 768)
    assert resumed.get_screen_size() == (1024, 768)


def test_aenv_desktop_starts_the_stream_and_prints_its_url(sbx: Sandbox, env: Server) -> None:
    from typer.testing import CliRunner

    from aenv.cli.main import app
    from tests.conftest import API_KEY

    args = ["--url", env.url, "--api-key", API_KEY, "desktop", sbx.sandbox_id, "--auth", "--no-browser"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    url = httpx.URL(result.stdout.strip().splitlines()[-1])
    # A node on this machine: the sandbox named in a localhost host name, on the node's own port.
    assert url.host == f"6080-{sbx.sandbox_id}.localhost" and url.port == httpx.URL(env.url).port
    assert url.path == "/vnc.html" and url.params["autoconnect"] == "true" and len(url.params["password"]) >= 12
    page = httpx.get(f"{env.url}/vnc.html", headers={"Host": f"{url.host}:{url.port}"}, timeout=30)
    assert page.status_code == 200 and "noVNC" in page.text
    routed = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "6080"}
    ws_url = env.url.replace("http", "ws", 1) + "/websockify"
    with ws_connect(ws_url, additional_headers=routed, subprotocols=["binary"], open_timeout=30) as ws:  # type: ignore[list-item]
        assert bytes(ws.recv(timeout=30)).startswith(b"RFB 003.")  # type: ignore[arg-type]
        ws.send(b"RFB 003.008\n")
        assert 2 in bytes(ws.recv(timeout=30))[1:]  # type: ignore[arg-type]  # the password it set is asked
    # Again: the stream runs already; the URL comes without a password it could not set.
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "password=" not in again.stdout


def test_a_snapshot_of_a_running_desktop_makes_desktops_with_its_windows(
    sbx: Sandbox, env: Server, api: httpx.Client
) -> None:
    open_terminal(sbx, "aenv-snap")
    r = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={}, timeout=300)
    assert r.status_code == 201, r.text
    snapshot = r.json()["snapshotID"]
    try:
        assert sbx.get_screen_size() == (1024, 768)  # the source runs on
        made = Sandbox.create(snapshot, timeout=300)  # the SDK's own start-up finds the snapshot's desktop
        try:
            assert made.commands.run("xdotool search --onlyvisible --name aenv-snap").stdout.split()
            assert made.commands.run("pgrep -c -x Xvfb; pgrep -c -x xfce4-session").stdout.split() == ["1", "1"]
            assert png(made.screenshot()).size == (1024, 768)
        finally:
            made.kill()
    finally:
        api.delete(f"/snapshots/{snapshot}")


def test_the_browser_opens_a_page(sbx: Sandbox) -> None:
    """Chromium, the template's browser, shows a local page (its window titled by the page)."""
    sbx.files.write("/home/user/page.html", "<html><head><title>aenv-page</title></head><body>hi</body></html>")
    sbx.commands.run("x-www-browser --no-first-run file:///home/user/page.html >/tmp/browser.log 2>&1", background=True)
    wait_for(
        "the browser's window",
        lambda: sbx.commands.run("xdotool search --onlyvisible --name aenv-page || true").stdout.strip(),
        120,
    )
    assert "aenv-page" in sbx.get_window_title(sbx.get_current_window_id())
