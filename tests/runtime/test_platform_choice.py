"""Choosing runsc's platform (aenv/runtime/platforms.py) without runsc: the probes here are
stand-ins returning what a probe would, so that every outcome (fastest wins, a platform that
hangs or cannot checkpoint loses, none works, a kept choice, a changed host) is checked. The real
probes run in tests/runtime/test_platforms_runsc.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from aenv.runtime import platforms
from aenv.runtime.platforms import Trial

pytestmark = pytest.mark.fast

KEY = platforms.host_key(runsc_version="0.0~20240729.0", flags=(), cpu_count=1.0, cpu_limit="share")


class Probes:
    """Stand-in probes: seconds (or a failure) per platform, and a count of the calls."""

    def __init__(self, outcomes: dict[str, Trial]) -> None:
        self.outcomes = outcomes
        self.calls: list[str] = []

    async def __call__(self, name: str) -> Trial:
        self.calls.append(name)
        await asyncio.sleep(0.01)
        return self.outcomes.get(name, Trial(name, error="not offered"))


def works(name: str, total: float) -> Trial:
    return Trial(name, {"spawn": total / 2, "stat": total / 2}, checkpoints=True)


def choose(setting: str, probes: Probes, cache: Path, key: dict[str, object] = KEY) -> platforms.Choice:
    return asyncio.run(platforms.choose(setting, probe=probes, cache=cache, key=dict(key)))


@pytest.fixture(autouse=True)
def no_kvm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "kvm_available", lambda: False)


def test_the_fastest_platform_that_checkpoints_is_chosen_and_kept(tmp_path: Path) -> None:
    cache = tmp_path / "platform.json"
    probes = Probes({"ptrace": works("ptrace", 3.0), "systrap": works("systrap", 1.2)})
    choice = choose("auto", probes, cache)
    assert (choice.platform, choice.by) == ("systrap", "calibration")
    assert sorted(probes.calls) == ["ptrace", "systrap"]  # no kvm probe without /dev/kvm
    kept = json.loads(cache.read_text())
    assert kept["platform"] == "systrap" and kept["key"] == KEY

    again = Probes({})
    choice = choose("auto", again, cache)
    assert (choice.platform, choice.by) == ("systrap", "kept calibration")
    assert again.calls == []  # measured once per host
    report = choice.report()
    assert report["trials"]["systrap"]["totalSeconds"] == pytest.approx(1.2)
    assert report["trials"]["ptrace"]["totalSeconds"] == pytest.approx(3.0)


def test_a_faster_platform_that_fails_or_cannot_checkpoint_loses(tmp_path: Path) -> None:
    probes = Probes(
        {
            "ptrace": works("ptrace", 3.0),
            "systrap": Trial("systrap", {"spawn": 0.1}, checkpoints=False),  # fast, but no pause
            "kvm": Trial("kvm", error="runsc timed out after 30.0s"),  # a platform that hangs
        }
    )
    choice = choose("auto", probes, tmp_path / "p.json")
    assert choice.platform == "ptrace"
    assert choice.report()["trials"]["systrap"] == {"unusable": "checkpoint and restore failed"}


def test_kvm_is_probed_where_the_host_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "kvm_available", lambda: True)
    probes = Probes({"ptrace": works("ptrace", 3.0), "systrap": works("systrap", 2.0), "kvm": works("kvm", 0.5)})
    choice = choose("auto", probes, tmp_path / "p.json", key={**KEY, "kvm": True})
    assert choice.platform == "kvm" and "kvm" in probes.calls


def test_a_named_platform_is_used_unmeasured(tmp_path: Path) -> None:
    probes = Probes({"ptrace": works("ptrace", 1.0)})
    for name in ("ptrace", "systrap", "kvm"):
        choice = choose(name, probes, tmp_path / "p.json")
        assert (choice.platform, choice.by) == (name, "setting")
    assert probes.calls == [] and not (tmp_path / "p.json").exists()


def test_nothing_works_falls_back_to_ptrace_and_keeps_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "p.json"
    probes = Probes({"ptrace": Trial("ptrace", error="boom"), "systrap": Trial("systrap", error="boom")})
    choice = choose("auto", probes, cache)
    assert (choice.platform, choice.by) == ("ptrace", "fallback")
    assert not cache.exists()  # the next start measures again


@pytest.mark.parametrize(
    "changed",
    [
        {"runsc": "0.0~20250101.0"},
        {"kernel": "7.0.0"},
        {"cpus": 64},
        {"flags": ["--directfs=false"]},
        {"sandboxCpus": 2.0},
        {"cpuLimit": "cap"},
    ],  # fmt: skip
)
def test_a_changed_host_is_measured_again(tmp_path: Path, changed: dict[str, object]) -> None:
    cache = tmp_path / "p.json"
    choose("auto", Probes({"ptrace": works("ptrace", 3.0), "systrap": works("systrap", 1.0)}), cache)
    probes = Probes({"ptrace": works("ptrace", 1.0), "systrap": works("systrap", 3.0)})
    choice = choose("auto", probes, cache, key={**KEY, **changed})
    assert (choice.platform, choice.by) == ("ptrace", "calibration") and probes.calls


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", json.dumps({"platform": "bogus", "key": KEY}).encode(), b"\x00" * 100_000],
)
def test_a_damaged_or_strange_kept_file_is_measured_again(tmp_path: Path, content: bytes) -> None:
    cache = tmp_path / "p.json"
    cache.write_bytes(content)
    probes = Probes({"ptrace": works("ptrace", 3.0), "systrap": works("systrap", 1.0)})
    choice = choose("auto", probes, cache)
    assert (choice.platform, choice.by) == ("systrap", "calibration")
    assert json.loads(cache.read_text())["platform"] == "systrap"


def test_nodes_starting_together_share_one_calibration(tmp_path: Path) -> None:
    cache = tmp_path / "p.json"
    probes = Probes({"ptrace": works("ptrace", 3.0), "systrap": works("systrap", 1.0)})

    async def five() -> list[platforms.Choice]:
        return await asyncio.gather(
            *(platforms.choose("auto", probe=probes, cache=cache, key=dict(KEY)) for _ in range(5))
        )

    choices = asyncio.run(five())
    assert {c.platform for c in choices} == {"systrap"}
    assert sorted(probes.calls) == ["ptrace", "systrap"]  # one calibration, four that read it
    assert sorted(c.by for c in choices) == ["calibration"] + ["kept calibration"] * 4
