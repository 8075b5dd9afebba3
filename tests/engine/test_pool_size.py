"""Default pool sizes come from what the model can use (max_num_seqs x context), capped by memory."""

from __future__ import annotations

import logging

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig
from hf_contbatch.core.pool_size import Window, blocks_per_request, default_host_kv_blocks, default_swap_blocks

from conftest import build_model

GIB = 2**30


def test_host_kv_pool_holds_max_num_seqs_at_full_context():
    # 128 requests x ceil(1000 / 16) = 63 blocks each, 32 KiB a block: 252 MiB, under the 1 GiB cap
    size = default_host_kv_blocks(32 * 1024, 16, 128, 1000, available_bytes=64 * GIB)
    assert size.num_blocks == 128 * 63
    assert "max_num_seqs 128" in size.reason and "1000" in size.reason


def test_host_kv_pool_is_capped_at_1_gib_and_a_quarter_of_memory():
    # wants 256 x 4096 blocks of 1 MiB (1 TiB): 1 GiB cap = 1024 blocks
    size = default_host_kv_blocks(2**20, 16, 256, 65536, available_bytes=64 * GIB)
    assert size.num_blocks == 1024 and "capped at 1 GiB" in size.reason
    # 2 GiB available: a quarter is 512 MiB = 512 blocks
    size = default_host_kv_blocks(2**20, 16, 256, 65536, available_bytes=2 * GIB)
    assert size.num_blocks == 512 and "25%" in size.reason
    # unknown context: the cap
    assert default_host_kv_blocks(2**20, 16, 4, None, available_bytes=None).num_blocks == 1024


def test_swap_pool_matches_the_device_pool_within_what_the_model_can_use():
    # 48-block device pool: 48 swap blocks (the model could use 4 x 64 = 256)
    assert default_swap_blocks(2**20, 48, 16, 4, 1024, available_bytes=64 * GIB).num_blocks == 48
    # a device pool larger than the model can use: 4 x 64 = 256 blocks
    assert default_swap_blocks(2**20, 4096, 16, 4, 1024, available_bytes=64 * GIB).num_blocks == 256
    # the host KV pool's bytes come off the available memory before the 25% cap:
    # (3 GiB - 1 GiB) / 4 = 512 MiB = 512 blocks of 1 MiB
    size = default_swap_blocks(2**20, 4096, 16, 128, 4096, available_bytes=3 * GIB, host_kv_bytes=GIB)
    assert size.num_blocks == 512


def test_engine_default_pools_and_one_log_line(llama_model, caplog):
    # llama_model: 2 layers, 2 KV heads of 16, context 512, float32
    sched = SchedulerConfig(max_num_seqs=6, preemption_mode="swap")
    with caplog.at_level(logging.INFO, logger="hf_contbatch.engine"):
        engine = LLMEngine(llama_model, EngineConfig(scheduler=sched, linear_backend="torch"))
    try:
        assert engine.block_manager.num_blocks == 6 * 512 // 16  # 192
        assert engine.host_block_manager.num_blocks == 192
        lines = [
            r.getMessage() for r in caplog.records if r.name == "hf_contbatch.engine" and "KV pool" in r.getMessage()
        ]
        assert len(lines) == 1 and "192 blocks of 16 tokens" in lines[0] and "swap pool: 192 blocks" in lines[0]
        assert "max_num_seqs 6" in engine.pool_sizing["kv"]
    finally:
        engine.close()


def test_explicit_sizes_are_kept(llama_model):
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads, 16 channels, float32: 8 KiB
    cfg = CacheConfig(cpu_cache_gib=1 / 1024, swap_space_gib=2 / 1024)  # 1 MiB and 2 MiB
    engine = LLMEngine(
        llama_model, EngineConfig(cache=cfg, scheduler=SchedulerConfig(preemption_mode="swap"), linear_backend="torch")
    )
    try:
        assert engine.block_manager.num_blocks == 2**20 // block
        assert engine.host_block_manager.num_blocks == 2 * 2**20 // block
    finally:
        engine.close()


def test_a_sliding_window_request_needs_its_window_and_one_step_whatever_the_context():
    # W 16, steps of up to 64 tokens, blocks of 16: ceil((16 - 2 + 64) / 16) + 1 = 6 blocks, under the
    # full context's ceil(4096 / 16) = 256; a short context stays the bound when it is smaller.
    assert blocks_per_request(4096, 16, Window(16, 64)) == 6
    assert blocks_per_request(40, 16, Window(16, 64)) == 3
    assert blocks_per_request(4096, 16) == 256 and blocks_per_request(None, 16) is None
    assert blocks_per_request(None, 16, Window(16, 64)) == 6  # bounded even with an unknown context
    size = default_host_kv_blocks(2**20, 16, 8, 4096, available_bytes=64 * GIB, window=Window(16, 64))
    assert size.num_blocks == 8 * 6 and "a window of 16 tokens" in size.reason
    assert (
        default_swap_blocks(2**20, 4096, 16, 8, 4096, available_bytes=64 * GIB, window=Window(16, 64)).num_blocks == 48
    )


def test_engine_default_pool_of_a_sliding_model_holds_its_windows_and_a_null_block():
    # Mistral, every layer over 8 tokens; max_num_seqs 6, max_num_batched_tokens 1024, blocks of 16:
    # each request holds at most ceil((8 - 2 + 1024) / 16) + 1 = 66 blocks, under ceil(512 / 16) = 32
    # of the full context, so the default is the full context's 6 x 32; the pool tensors add the
    # zeroed null block at index 192.
    model = build_model("mistral")
    engine = LLMEngine(model, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=6), linear_backend="torch"))
    try:
        assert engine.block_manager.num_blocks == 192 and engine.block_manager.sliding_window == 8
        assert engine.cache.key_cache[0].shape[0] == 193
        assert not engine.cache.key_cache[0][192].any()
    finally:
        engine.close()
    # A 64-token step budget: ceil((8 - 2 + 64) / 16) + 1 = 6 blocks a request.
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64)
    engine = LLMEngine(model, EngineConfig(scheduler=sched, linear_backend="torch"))
    try:
        assert engine.block_manager.num_blocks == 36
    finally:
        engine.close()


@pytest.mark.parametrize("field, value", [("cpu_cache_gib", 0), ("cpu_cache_gib", True), ("swap_space_gib", -1.0)])
def test_bad_pool_settings_name_the_argument(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})
