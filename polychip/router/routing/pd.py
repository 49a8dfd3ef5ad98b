"""Prefill/decode pairs behind the router (docs/disaggregation.md).

Workers say their role in ``/server_info`` (``disaggregation.mode``; a deployment's ``role:`` launches
them so). A prefill replica takes no request itself; a request placed on a decode replica (by the
policy: load, KV usage, so its free pages) is paired with the least-loaded prefill replica of the same
model and backend: the body sent to the decode side names it (SGLang's ``bootstrap_host`` /
``bootstrap_port``), and the answer streams from the decode side. The prefill replica counts the
request in flight until its first token (the hand-off is over by then).

With no prefill replica up, a decode replica serves the request plainly; when the prefill side fails
mid-transfer, the decode side prefills the request itself (engine/disagg). Plain replicas beside pairs
(a mixed deployment) are placed as always.
"""
from __future__ import annotations

import json
import logging
from urllib.parse import urlsplit

from polychip.router.fleet.worker import Worker

log = logging.getLogger("polychip.router")


class Pairing:
    def __init__(self, dispatcher, metrics):
        self.d, self.metrics = dispatcher, metrics

    def prefill_for(self, decode: Worker) -> Worker | None:
        """The least-loaded healthy prefill replica that can hand KV to ``decode``."""
        info = decode.info
        found = [r for r in self.d.registry
                 if r.role == "prefill" and r.is_available()
                 and r.serving_model == decode.serving_model and r.info.transfer_backend == info.transfer_backend]
        return min(found, key=lambda r: (r.load(), r.name), default=None)

    def body_for(self, body: bytes, decode: Worker) -> tuple[bytes, Worker | None]:
        """The body to send to ``decode`` and the prefill replica it names (None: served plainly)."""
        if decode.role != "decode":
            return body, None
        prefill = self.prefill_for(decode)
        if prefill is None:
            self.metrics.pd_unpaired.labels(decode.name).inc()
            log.info("no prefill replica is up for %s: it serves the request plainly", decode.name)
            return body, None
        data = json.loads(body)
        data["bootstrap_host"] = urlsplit(prefill.url).hostname
        data["bootstrap_port"] = prefill.info.bootstrap_port
        prefill.inflight += 1
        self.metrics.pd_pairs.labels(prefill.name, decode.name).inc()
        return json.dumps(data).encode(), prefill

    def done(self, prefill: Worker | None) -> None:
        """The paired request's first token came (or the attempt ended): the prefill side is done."""
        if prefill is not None:
            prefill.inflight -= 1
