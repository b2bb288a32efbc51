"""A node's lifecycle events: the store, the recorder of its sandboxes' changes, the webhook
dispatcher and the retention sweep, started and stopped with its API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aenv.config import Settings
from aenv.events.cluster import EtcdEventStore, Leadership
from aenv.events.model import Webhook
from aenv.events.recorder import Recorder
from aenv.events.store import EventStore, SqliteEventStore
from aenv.events.webhooks import Dispatcher, UrlRule
from aenv.node.service import NodeService

log = logging.getLogger("aenv.events")
PRUNE_EVERY = 3600.0


class Events:
    def __init__(self, node: NodeService, store: EventStore | None = None) -> None:
        settings: Settings = node.settings
        self.settings = settings
        if store is None:
            store = _store_of(settings)
        self.store: EventStore = store
        self.rule = UrlRule.of(settings.webhook_private_urls, settings.host)
        self.dispatcher = Dispatcher(
            self.store,
            self.rule,
            timeout=settings.webhook_timeout,
            retries=settings.webhook_retries,
            retry_delay=settings.webhook_retry_delay,
        )
        self.recorder = Recorder(node, self.store, written=self.dispatcher.wake)
        self._pruner: asyncio.Task[None] | None = None
        # In a cluster one node delivers at a time (aenv/events/cluster.py); alone, this one.
        self.leadership: Leadership | None = None
        if isinstance(self.store, EtcdEventStore):
            self.leadership = Leadership(self.store, self.dispatcher.start, self.dispatcher.stop)

    async def start(self) -> None:
        await self.store.open()
        self.recorder.start()
        if self.leadership is not None:
            self.leadership.start()
        else:
            self.dispatcher.start()
        self._pruner = asyncio.create_task(self._prune_forever(), name="event retention")

    async def stop(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
        await self.recorder.stop()
        if self.leadership is not None:
            await self.leadership.stop()
        await self.dispatcher.stop()
        await self.store.close()

    async def add_webhook(self, hook: Webhook) -> None:
        """A new webhook is told of what happens from now on."""
        await self.recorder.flush()  # what happened before it was made stays before its start
        await self.store.set_delivered(hook.id, await self.store.last_position())
        await self.store.put_webhook(hook)
        self.dispatcher.wake()

    async def put_webhook(self, hook: Webhook) -> None:
        await self.store.put_webhook(hook)
        self.dispatcher.hooks[hook.id] = hook  # attempts from now on use it
        self.dispatcher.wake()

    async def delete_webhook(self, webhook_id: str) -> None:
        await self.store.delete_webhook(webhook_id)
        self.dispatcher.hooks.pop(webhook_id, None)  # no attempt after the answer
        self.dispatcher.wake()

    async def _prune_forever(self) -> None:
        while True:
            try:
                gone = await self.store.prune(time.time() - self.settings.events_retention_days * 86400)
                if gone:
                    log.info("lifecycle events: %d past their retention removed", gone)
            except Exception as exc:
                log.warning("lifecycle events: could not prune (%s)", exc)
            await asyncio.sleep(PRUNE_EVERY)


def _store_of(settings: Settings) -> EventStore:
    if settings.cluster:
        from aenv.cluster.entries import node_id_of
        from aenv.cluster.store import cluster_store

        return EtcdEventStore(cluster_store(settings), node_id_of(settings))
    return SqliteEventStore(settings.data_dir / "events.db")
