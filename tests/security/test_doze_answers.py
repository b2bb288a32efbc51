"""The doze loop asks a sandbox's agent whether it is alone (``sys.alone``); root in the sandbox
controls that answer. Whatever comes back (a wrong type, a huge reply, an error, nothing, a
flood of frames), the loop keeps going, freezes nothing on a doubtful answer, and the node's
other sandboxes doze as before.

The channel is real (two Channels on real pipes, the far one serving what a hostile agent
would); the node around the Dozer is a stand-in with its sandboxes, settings and a driver that
records freezes, since what is under test is the host's reading of the answer, not runsc's
freezer (tests/node/test_doze.py freezes real sandboxes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.channel import Channel, Stream
from aenv.node import doze
from aenv.node.agentlink import AgentLink
from aenv.node.doze import Dozer
from aenv.node.sandbox import LiveSandbox
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord
from tests.channel.test_channel import pipe_pair

Answer = Callable[[Stream], Awaitable[None]]


def answering(result: Any) -> Answer:
    async def serve(stream: Stream) -> None:
        await stream.end(result=result)

    return serve


async def refusing(stream: Stream) -> None:
    await stream.end(error=("unimplemented", "no such method"))


async def silent(stream: Stream) -> None:
    await asyncio.sleep(3600)  # never answers: the ask times out


async def chattering(stream: Stream) -> None:
    for i in range(50):  # says it is alone, after many messages: it was not idle meanwhile
        await stream.send({"i": i})
    await stream.end(result={"alone": True})


HOSTILE: dict[str, Answer] = {
    "string": answering("alone"),
    "true-as-string": answering({"alone": "true"}),
    "one": answering({"alone": 1}),
    "list": answering([True]),
    "null": answering(None),
    "nested": answering({"alone": {"alone": True}}),
    "huge": answering({"alone": False, "pad": "x" * 200_000}),
    "deep": answering(json.loads("[" * 200 + "]" * 200)),
    "error": refusing,
    "no-answer": silent,
    "chatter": chattering,
}


@dataclass
class Driver:
    frozen: list[str] = field(default_factory=list)

    def dozing(self, instance: Any) -> bool:
        return instance.id in self.frozen

    def doze(self, instance: Any) -> bool:
        self.frozen.append(instance.id)
        return True


@dataclass
class Guest:
    sb: LiveSandbox
    peer: Channel


async def guest(sandbox_id: str, serve: Answer) -> Guest:
    host_end, guest_end = await pipe_pair()
    link = AgentLink(sandbox_id)
    link.channel.attach(*host_end)

    async def on_open(stream: Stream) -> None:
        if stream.method == "sys.alone":
            await serve(stream)
        else:
            await stream.end(error=("unimplemented", stream.method))

    peer = Channel(on_open=on_open)
    peer.attach(*guest_end)
    rec = SandboxRecord(id=sandbox_id, template_id="base", started_at=0.0, end_at=1e12, state=SandboxState.RUNNING)
    sb = LiveSandbox(rec=rec, instance=SimpleNamespace(id=f"inst-{sandbox_id}"), link=link)  # type: ignore[arg-type]
    return Guest(sb, peer)


@pytest.fixture()
async def node(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SimpleNamespace]:
    monkeypatch.setattr(doze, "ASK_TIMEOUT", 0.5)
    stand_in = SimpleNamespace(
        settings=SimpleNamespace(doze_after=0.05),
        sandboxes={},
        driver=Driver(),
        guests=[],
    )
    yield stand_in
    for g in stand_in.guests:
        assert g.sb.link is not None
        g.sb.link.channel.close()
        g.peer.close()


def dozer_of(node: SimpleNamespace) -> Dozer:
    return Dozer(node.settings, node.driver, node.sandboxes.values, lambda: [])


async def passes(dozer: Dozer, count: int) -> None:
    for _ in range(count):
        await dozer.look()
        await asyncio.sleep(0.06)  # one quiet period


@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_a_hostile_answer_freezes_nothing_and_the_neighbour_dozes(node: SimpleNamespace, kind: str) -> None:
    hostile = await guest("hostile", HOSTILE[kind])
    honest = await guest("honest", answering({"alone": True}))
    node.guests += [hostile, honest]
    node.sandboxes.update({"hostile": hostile.sb, "honest": honest.sb})
    dozer = dozer_of(node)
    await passes(dozer, 6)
    assert node.driver.frozen == ["inst-honest"], node.driver.frozen


async def test_the_honest_answer_with_extra_fields_still_dozes(node: SimpleNamespace) -> None:
    """An agent that adds fields (a newer one) is read for ``alone`` alone."""
    newer = await guest("newer", answering({"alone": True, "since": 12, "pids": [1]}))
    node.guests.append(newer)
    node.sandboxes["newer"] = newer.sb
    await passes(dozer_of(node), 4)
    assert node.driver.frozen == ["inst-newer"]
