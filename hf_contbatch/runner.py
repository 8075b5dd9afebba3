"""Builds one flattened, unpadded batch from a ``SchedulerOutput``, runs the model, samples.

All requests' new tokens are concatenated into a single ``[1, T]`` sequence (decode tokens first,
then prefill chunks); the paged attention keeps them apart through the step's metadata, so there is
no padding and no dense mask. Only the rows that produce a token reach the LM head
(``logits_to_keep`` as an index tensor).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from .kv.block_manager import BlockManager
from .kv.paged_cache import AttentionMetadata, PagedKVCache
from .sampler import Sampler
from .scheduler import SchedulerOutput


class ModelRunner:
    """Runs the model for one scheduler step.

    Args:
        model: a transformers causal LM already switched to the paged attention implementation.
        cache: the paged KV cache passed to the forward.
        block_manager: read for block tables (never modified here).
        device: device of the input embeddings.
        sampler: the sampler.
    """

    def __init__(
        self, model, cache: PagedKVCache, block_manager: BlockManager, device: torch.device, sampler: Sampler
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_manager = block_manager
        self.device = device
        self.sampler = sampler
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self.block_size = block_manager.block_size

    def build_metadata(self, out: SchedulerOutput):
        """Flattened ``input_ids`` ``[T]``, ``positions`` ``[T]``, the metadata, and the row of each
        sampled request in the flattened batch."""
        bs = self.block_size
        input_ids: list[int] = []
        pos_starts: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        num_decodes = 0
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            if n == 1 and not req.is_prefill:
                num_decodes += 1
                input_ids.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            else:
                input_ids.extend(req.all_token_ids[start : start + n])
            pos_starts.append(start)
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(self.block_manager.get_block_table(req.request_id))
            if s.samples:
                sample_rows.append(sum(q_lens) - 1)
        num_reqs = len(q_lens)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        block_tables = torch.tensor(padded, dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        query_start_loc_cpu = [0]
        for n in q_lens:
            query_start_loc_cpu.append(query_start_loc_cpu[-1] + n)
        total = query_start_loc_cpu[-1]
        req_index = torch.repeat_interleave(torch.arange(num_reqs), q_lens_t)
        offsets_in_req = torch.arange(total) - torch.tensor(query_start_loc_cpu[:-1], dtype=torch.long)[req_index]
        positions = torch.tensor(pos_starts, dtype=torch.long)[req_index] + offsets_in_req
        slot_mapping = block_tables[req_index, positions // bs].to(torch.long) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=torch.tensor(query_start_loc_cpu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            num_decodes=num_decodes,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, positions.to(dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the step's forward and return ``{request_id: sampled token}`` for sampling requests."""
        if out.is_empty:
            return {}
        ids, positions, meta, sample_rows = self.build_metadata(out)
        self.cache.metadata = meta
        try:
            kwargs = {
                "input_ids": ids.unsqueeze(0),
                "position_ids": positions.unsqueeze(0),
                self._cache_arg: self.cache,
                "use_cache": True,
                "paged_cache": self.cache,
            }
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            if self._supports_logits_to_keep:
                kwargs["logits_to_keep"] = rows
            logits = self.model(**kwargs).logits[0]
            if not self._supports_logits_to_keep:
                logits = logits.index_select(0, rows)
        finally:
            self.cache.metadata = None
        sampled_reqs = [s.request for s in out.scheduled if s.samples]
        tokens = self.sampler.sample(logits, sampled_reqs)
        return {r.request_id: t for r, t in zip(sampled_reqs, tokens)}

    def sampled_requests(self, out: SchedulerOutput) -> Sequence:
        return [s.request for s in out.scheduled if s.samples]
