"""A device slot held on the Prefect server: one slot of a global concurrency limit (``gpu:0``),
held with a lease that this process renews, so no wait for it and no hold of it lasts forever.

- **Waiting ends.** A slot that stays taken, or a server that stays away, ends the wait after
  ``wait_s`` with :class:`~areal_eval.failures.OrchestrationUnavailable` (transient: retried, on
  record). A limit that does not exist is a :class:`~areal_eval.config.parsing.ConfigError`.
- **A holder that dies frees its slot.** The lease lasts ``lease_s`` unless renewed (every quarter
  of it, through a server restart); the server's repossessor frees an expired one. A server keeps
  leases across its restart when started with :data:`LEASE_STORAGE_ENV` set to
  :data:`FILE_LEASE_STORAGE` (Prefect's default keeps them in memory).
- **A lease a restart forgot is given back.** On a server that keeps leases in memory, a restart
  forgets every lease but keeps the slots counted. A holder learns it from its next renewal
  (the lease is gone long before it could have expired) and frees its slot by name at the end.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.exceptions import MissingContextError

from areal_eval.config.parsing import ConfigError
from areal_eval.failures import OrchestrationUnavailable

LEASE_STORAGE_ENV = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"
FILE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
"""Prefect's lease storage under ``$PREFECT_HOME/concurrency_leases``: leases outlive a restart."""
LEASE_S = 60.0
"""The shortest lease Prefect's server grants: a dead holder's slot is free within it (plus the
repossessor's loop, 15 s by default)."""


def leases_kept_in_memory() -> str | None:
    """A line of warning when the server keeps concurrency leases in memory (Prefect's default:
    a restart then leaks the slots whose holders die meanwhile); None otherwise, or unknown."""
    try:
        with get_client(sync_client=True) as client:
            storage = client.request("GET", "/admin/settings").json()["server"]["concurrency"]["lease_storage"]
    except Exception:  # noqa: BLE001 - an older server, or settings not readable: nothing to say
        return None
    if storage == FILE_LEASE_STORAGE or not storage.endswith(".memory"):
        return None
    return (
        "the Prefect server keeps concurrency leases in memory: a restart leaks the slot of an evaluation "
        f"that dies meanwhile; start it with {LEASE_STORAGE_ENV}={FILE_LEASE_STORAGE}"
    )


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (its lines in the UI), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _status(exc: BaseException) -> int | None:
    return exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None


class DeviceSlot:
    """One slot of the global concurrency limit ``name``, held inside ``with``.

    Only the acquisition is waited for and retried, never the block."""

    def __init__(self, name: str, *, wait_s: float, lease_s: float = LEASE_S, max_backoff_s: float = 30.0):
        self.name, self.wait_s, self.lease_s, self.max_backoff_s = name, wait_s, lease_s, max_backoff_s
        self.lease_id: uuid.UUID | None = None
        self.forgotten = False
        """The server lost the lease while the slot stayed counted: freed by name at the end."""
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> DeviceSlot:
        self._acquire()
        self._renewer = threading.Thread(target=self._renew_until_stopped, name=f"lease {self.name}", daemon=True)
        self._renewer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=60)
        self._release()

    def _acquire(self) -> None:
        deadline, delay, said = time.monotonic() + self.wait_s, 1.0, None
        while True:
            try:
                with get_client(sync_client=True) as client:
                    reply = client.increment_concurrency_slots_with_lease(
                        [self.name], 1, "concurrency", self.lease_s
                    ).json()
                self.lease_id, self._renewed_at = uuid.UUID(reply["lease_id"]), time.monotonic()
                if not reply["limits"]:  # a name with no limit gets an empty lease
                    self._release()
                    create = f"prefect gcl create {self.name} --limit 1"
                    raise ConfigError(f"gpu_slot: no global concurrency limit {self.name!r} ({create})")
                return
            except (httpx.HTTPError, OSError) as exc:
                locked = _status(exc) == 423
                why = "every slot is held" if locked else f"the Prefect API did not answer ({exc!r:.200})"
                wait = (
                    min(float(exc.response.headers.get("Retry-After", delay)), self.max_backoff_s) if locked else delay
                )
            if time.monotonic() + wait > deadline:
                raise OrchestrationUnavailable(
                    f"concurrency slot {self.name!r} not acquired in {self.wait_s:.0f} s: {why}"
                    + (f" ({self.holders()})" if locked else "")
                )
            if why != said:
                _logger().warning("concurrency slot %r: %s; waiting up to %.0f s", self.name, why, self.wait_s)
                said = why
            time.sleep(wait)
            delay = min(self.max_backoff_s, 2 * delay)

    def holders(self) -> str:
        """How full the limit is, and what may hold it: evaluations still running, or, on a server
        that keeps leases in memory, a slot leaked by a restart (and how to free it)."""
        try:
            with get_client(sync_client=True) as client:
                limit = client.read_global_concurrency_limit_by_name(self.name)
            held = f"{limit.active_slots}/{limit.limit} held"
        except Exception:  # noqa: BLE001 - only for the message
            held = "held"
        if (warning := leases_kept_in_memory()) is None:
            return f"{held} by evaluations still running; a holder that died frees its slot within {self.lease_s:.0f} s"
        return f"{held}; {warning}, and free a leaked slot by hand: prefect gcl update {self.name} --active-slots 0"

    def _renew_until_stopped(self) -> None:
        away = False
        while not self._stop.wait(self.lease_s / 4):
            try:
                if not self._renew():
                    return
                away = False
            except (httpx.HTTPError, OSError) as exc:
                if not away:
                    _logger().warning("concurrency slot %r: lease not renewed (%r); retrying", self.name, exc)
                    away = True

    def _renew(self) -> bool:
        """Renew the lease; False when the server no longer has it (expired, or forgotten by a
        restart: then :attr:`forgotten`, since it was renewed too recently to have expired)."""
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(self.lease_id, self.lease_s)
        except httpx.HTTPStatusError as exc:
            if _status(exc) != 410:
                raise
            self.forgotten = time.monotonic() - self._renewed_at < self.lease_s - 5
            what = "forgotten by a server restart: its slot is freed by name when done" if self.forgotten else "expired"
            _logger().warning("concurrency slot %r: lease %s %s", self.name, self.lease_id, what)
            return False
        self._renewed_at = time.monotonic()
        return True

    def _release(self) -> None:
        """Give the slot back, trying for as long as the lease lasts: after that, it expires. A
        lease the server forgot (its release would do nothing) is found by renewing it first."""
        if self.lease_id is None:
            return
        deadline, delay = time.monotonic() + self.lease_s, 1.0
        while True:
            try:
                if self.forgotten or not self._renew():
                    if self.forgotten:
                        with get_client(sync_client=True) as client:
                            client.release_concurrency_slots([self.name], 1, time.monotonic() - self._renewed_at)
                    return
                with get_client(sync_client=True) as client:
                    client.release_concurrency_slots_with_lease(self.lease_id)
                return
            except (httpx.HTTPError, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    _logger().warning("concurrency slot %r: not released (%r); its lease expires", self.name, exc)
                    return
                time.sleep(delay)
                delay = min(self.max_backoff_s, 2 * delay)
