"""Disaggregation: what an engine in a prefill or decode role adds to its step (the engine's one owner
of its agent).

Prefill side, each step: while the forward runs, each layer's newly computed K/V of every hand-off
request is staged as soon as the layer returns (``ForwardContext.after_layer``), so the link's senders
move layer ``i`` while layers ``i + 1...`` compute; a step that ran without layer boundaries (a
compiled decode step) stages its range after the forward. A request that sampled its first token
sends Done and stays held until the ack. The decode side's work is its agent's (``decode``).
"""
from __future__ import annotations

import logging
import os

from polychip.dtypes import KV_WIRE_DTYPES
from polychip.engine.disagg.agent import DisaggSettings
from polychip.engine.disagg.kv_format import (ModelIdentity, PoolFormat, SideInfo, fingerprint_files,
                                              fingerprint_text)
from polychip.engine.disagg.params import logprob_to_wire
from polychip.engine.kv_pool import dtype_name
from polychip.errors import ConfigError, InvalidRequestError, KVTransferError, PolychipError

log = logging.getLogger("polychip.disagg")

STAGE_TIMEOUT = 30.0        # seconds the engine thread waits for room in the staging ring


def side_info(engine, settings: DisaggSettings, name: str) -> SideInfo:
    from polychip.models.loader import weight_files
    mc, loaded = engine.model_config, engine.loaded
    config = os.path.join(loaded.model_dir, "config.json")
    files = weight_files(loaded.model_dir) + ([config] if os.path.exists(config) else [])
    model = ModelIdentity(architecture=mc.architecture, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                          head_dim=mc.head_dim, vocab_size=mc.vocab_size, weights=fingerprint_files(files),
                          tokenizer=fingerprint_text(engine.tokenizer.tok.to_str()))
    pool = engine.pool
    scales = tuple(tuple(map(float, s)) for s in pool.scales) if pool.scales is not None else None
    return SideInfo(role=settings.mode, name=name, device=f"{engine.plugin.name}:{engine.plugin.index}",
                    model=model, pool=PoolFormat(page_size=pool.page_size, dtype=dtype_name(pool.dtype),
                                                 scales=scales), transfer_backend=settings.backend,
                    wire_dtype=declared_wire_dtype(engine, settings.wire_dtype))


def declared_wire_dtype(engine, wire_dtype: str | None) -> str | None:
    """The quantised wire dtype this side declares; fp8 only where its plugin declares fp8 KV
    (``kv_cache_dtypes``), else a ConfigError naming the plugin."""
    if wire_dtype is None or wire_dtype == "int8":
        return wire_dtype
    from polychip.devices import boundary
    plugin, compute = engine.plugin, dtype_name(engine.loaded.dtype)
    declared = boundary.kv_cache_dtypes(plugin, compute)
    if wire_dtype not in declared:
        raise ConfigError(f"--disaggregation-wire-dtype: device {plugin.name}:{plugin.index} does not declare "
                          f"{wire_dtype} among its KV dtypes for a {compute} model (plugin {plugin.name!r} "
                          f"declares {sorted(set(declared))}); use int8 or auto")
    return wire_dtype


def open_disaggregation(engine, config) -> "Disaggregation | None":
    """The engine's role from its config (``--disaggregation-mode``); None for plain serving."""
    if config.disaggregation_mode == "null":
        return None
    if config.tp_size > 1:
        raise ConfigError(f"--disaggregation-mode {config.disaggregation_mode} with --tp-size {config.tp_size}: "
                          "a hand-off moves one rank's pool; tensor parallel sides are not supported yet")
    settings = DisaggSettings(mode=config.disaggregation_mode, backend=config.disaggregation_transfer_backend,
                              host=config.disaggregation_host, bootstrap_port=config.disaggregation_bootstrap_port,
                              connections=config.disaggregation_tcp_connections,
                              transfer_timeout=config.disaggregation_transfer_timeout,
                              staging_bytes=config.disaggregation_buffer_mb << 20,
                              ring_bytes=config.disaggregation_buffer_mb << 20,
                              wire_dtype=KV_WIRE_DTYPES[config.disaggregation_wire_dtype])
    return Disaggregation(engine, settings)


class Disaggregation:
    def __init__(self, engine, settings: DisaggSettings, name: str | None = None):
        self.engine, self.settings, self.mode = engine, settings, settings.mode
        side = side_info(engine, settings, name or f"{settings.host} pid {os.getpid()}")
        if settings.mode == "prefill":
            from polychip.engine.disagg.prefill import PrefillAgent
            self.agent = PrefillAgent(engine, settings, side)
            if name is None:            # named after the port it took (0 asks for a free one)
                self.agent.side = side.model_copy(update={"name": f"{settings.host}:{self.agent.bootstrap_port}"})
        else:
            from polychip.engine.disagg.decode import DecodeAgent
            self.agent = DecodeAgent(engine, settings, side)
        self._active: list = []
        self._layers_staged = 0

    def name_after(self, url: str) -> None:
        """Name this side after the server's URL in what it tells its peers (and they log)."""
        name = f"{self.agent.side.name} of {url}" if self.mode == "prefill" else url
        self.agent.side = self.agent.side.model_copy(update={"name": name})

    def begin(self) -> None:
        """Start listening (prefill) or connecting (decode); the engine thread must be running."""
        self.agent.begin()
        if self.mode == "prefill":
            log.info("%s listening on bootstrap port %d (%s backend)", self.agent.side.describe(),
                     self.agent.bootstrap_port, self.settings.backend)

    # the engine's hand-off operations (engine thread)
    def receive(self, req, remote) -> None:
        """Decode side: reserve ``req``'s pages now (KVTransferError when they cannot be) and ask ``remote``."""
        eng = self.engine
        if self.mode != "decode":
            raise InvalidRequestError("bootstrap_host / bootstrap_port name a prefill side; this server is a "
                                      "prefill side (--disaggregation-mode decode takes them)")
        if not eng.scheduler.reserve(req):
            need = eng.pages.pages_for(len(req.prompt_ids))
            raise KVTransferError(f"the decode side cannot reserve {need} KV pages for a {len(req.prompt_ids)}-token "
                                  f"prompt now ({eng.pages.num_free} free, {eng.cache.evictable_pages()} "
                                  f"evictable); refused before asking prefill {remote.address}")
        self.agent.receive(req, remote)

    def add_handoff(self, prompt_ids: list[int], params, outbound) -> str:
        """Prefill side: run ``prompt_ids`` for a decode side; its KV and first token go to ``outbound``
        and its pages stay until ``end_handoff``."""
        eng = self.engine
        rid = eng.add_request(prompt_ids, params, outbound.request_id)
        eng.scheduler.find(rid).handoff = outbound
        return rid

    def end_handoff(self, request_id: str) -> None:
        """Prefill side: the decode side acknowledged (or the hand-off failed): free the pages."""
        if not self.engine.scheduler.release_held(request_id):
            self.engine.abort(request_id)           # still computing: stop it

    def land(self, req, first_token: int, logprob) -> None:
        """Decode side: ``req``'s KV is in its pages; book the first token and decode from here."""
        eng = self.engine
        eng.scheduler.land(req, first_token, logprob)
        eng.counters["prompt_tokens_queried"] += len(req.prompt_ids)
        eng.emit(req)

    def fall_back(self, req) -> None:
        """Decode side: the hand-off failed; prefill ``req`` here."""
        self.engine.scheduler.fall_back(req)

    # prefill side
    def before_forward(self, scheduled) -> None:
        """Let the forward stage each layer of this step's hand-off requests as it completes."""
        self._active = [(r, r.num_computed_tokens, r.num_computed_tokens + n) for r, n in scheduled
                        if r.handoff is not None and r.handoff.open]
        self._layers_staged = 0
        self.engine.runner.after_layer = self._after_layer if self._active else None

    def _after_layer(self, layer: int) -> None:
        self._stage(range(layer, layer + 1))
        self._layers_staged = layer + 1

    def _stage(self, layers: range) -> None:
        eng, agent = self.engine, self.agent
        for req, start, end in self._active:
            ob = req.handoff
            if not ob.open:
                continue
            begin = 0 if ob.staged_upto == 0 else start       # the first step sends the cached prefix too
            try:
                ob.stage(eng.plugin, eng.pool, req.pages, begin, min(end, len(req.prompt_ids)), layers,
                         agent.staging_ring, STAGE_TIMEOUT)
            except PolychipError as e:
                agent.end(ob.link, ob.room, f"staging its KV failed: {e}", notify=True)

    def after_step(self, unservable) -> None:
        """Stage what the forward did not (no layer boundaries), send Done for requests that sampled
        their first token, and end the hand-offs the engine could not serve."""
        self._refuse(unservable)
        if not self._active:
            return
        self.engine.runner.after_layer = None
        layers = self.engine.model_config.num_layers
        if self._layers_staged < layers:
            self._stage(range(self._layers_staged, layers))
        for req, start, end in self._active:
            ob = req.handoff
            ob.staged_upto = max(ob.staged_upto, min(end, len(req.prompt_ids)))
            if req.output_ids and ob.open:
                lp = req.logprobs[0] if req.logprobs else None
                ob.finish(req.output_ids[0], logprob_to_wire(lp))
        self._active = []

    def _refuse(self, reqs) -> None:
        for req in reqs:
            ob = req.handoff
            if ob is not None and ob.open:
                self.agent.end(ob.link, ob.room, f"the prefill side cannot serve it ({req.finish_reason})",
                               notify=True)

    def status(self) -> dict:
        return self.agent.status()

    def stop(self) -> None:
        self.agent.stop()
