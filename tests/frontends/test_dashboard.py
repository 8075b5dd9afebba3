"""The dashboard reads stats snapshots, renders them, and refreshes from a sleeping daemon thread."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import threading
import time

import pytest

from hf_contbatch import CacheConfig, EngineConfig, EngineStats, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.frontends.dashboard import (
    Dashboard,
    format_stats,
    in_use_region,
    phase_rows,
    render_block_grid,
    render_pools,
)
from hf_contbatch.frontends.dashboard.render import render_phases, render_tiles
from hf_contbatch.frontends.dashboard.text import format_ms
from hf_contbatch.request import RequestMetrics

from conftest import random_prompts

PHASES = ("reap", "budget", "admit", "preempt", "decode")


def make_stats(**overrides) -> EngineStats:
    """A snapshot of an 8-block pool: blocks 0-2 held by request 5, block 3 by request 7."""
    base = dict(
        num_blocks=8,
        block_size=16,
        num_free_blocks=4,
        num_used_blocks=4,
        peak_used_blocks=6,
        capacity_tokens=128,
        num_waiting=2,
        num_running=2,
        num_swapped=0,
        num_finished=3,
        num_preemptions=1,
        num_generated_tokens=40,
        num_iterations=12,
        throughput_tokens_per_s=123.4,
        mean_ttft_s=0.05,
        mean_itl_s=0.01,
        recent_phases=((11, tuple((p, 0.001) for p in PHASES)),),
        block_owner=(5, 5, 5, 7, -1, -1, -1, -1),
    )
    base.update(overrides)
    return EngineStats(**base)


def with_fields(stats: EngineStats, **fields) -> EngineStats:
    """``stats`` with optional fields set."""
    return dataclasses.replace(stats, **fields)


def eventually(condition, timeout_s: float = 50.0) -> bool:
    """Poll ``condition`` every 20 ms until it holds or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class FakeSource:
    """Anything with stats(): counts the calls, returns whatever snapshot the test sets."""

    def __init__(self, stats: EngineStats) -> None:
        self.snapshot = stats
        self.calls = 0
        self.engine = self  # Dashboard looks for engine.closed like on a pipeline
        self.closed = False

    def stats(self) -> EngineStats:
        self.calls += 1
        return self.snapshot


@pytest.mark.timeout(300)
def test_importing_the_package_and_text_summary_needs_no_ipywidgets():
    code = (
        "import sys; sys.modules['ipywidgets'] = None\n"  # any `import ipywidgets` now raises ImportError
        "import hf_contbatch\nfrom hf_contbatch.frontends.dashboard import format_stats\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=250)


@pytest.mark.timeout(120)
def test_format_stats_states_usage_queues_speed_and_phases():
    text = format_stats(make_stats(), tokens_per_s_now=50.0)
    assert "4/8 used (50%), peak 6" in text
    assert "waiting 2 · running 2 · swapped 0 · finished 3 · preempted 1" in text
    assert "50.0 tok/s now, 123.4 tok/s average" in text and "TTFT 50.0 ms" in text and "ITL 10.0 ms" in text
    assert "decode 1.00 ms" in text


@pytest.mark.timeout(120)
def test_every_number_has_thousands_separators_in_the_text_and_the_widget():
    # One number format (issue 33): a newcomer saw "TTFT 5663.6 ms" beside "5,248 tokens".
    stats = make_stats(
        mean_ttft_s=5.6636,
        mean_itl_s=1.25,
        throughput_tokens_per_s=12345.6,
        num_generated_tokens=5248,
        recent_phases=((11, tuple((p, 2.5) for p in PHASES)),),
    )
    text = format_stats(stats, tokens_per_s_now=2048.0)
    for shown in ("TTFT 5,663.6 ms", "ITL 1,250.0 ms", "2,048.0 tok/s now, 12,345.6 tok/s average", "5,248 tokens"):
        assert shown in text, (shown, text)
    assert "decode 2,500.00 ms" in text
    queues = format_stats(dataclasses.replace(stats, num_waiting=1200, num_finished=34000, num_preemptions=1001))
    assert "waiting 1,200 ·" in queues and "finished 34,000 · preempted 1,001" in queues
    html = render_tiles(dataclasses.replace(stats, num_finished=1500), tokens_per_s_now=2048.0) + render_phases(stats)
    for shown in (
        "<b>5,663.6 ms</b>",
        "<b>1,250.0 ms</b>",
        "<b>2,048.0</b>",
        "avg 12,345.6",
        "<b>1,500</b>",
        "2,500.00 ms",
    ):
        assert shown in html, shown


@pytest.mark.timeout(120)
def test_optional_fields_are_read_from_the_snapshot():
    stats = with_fields(
        make_stats(),
        num_kv_tokens=50,
        num_swap_blocks=6,
        num_swapped_blocks=2,
        num_preemptions_swap=1,
        num_preemptions_recompute=0,
        prefix_caching=True,
        num_cached_blocks=3,
        prefix_cache_hit_rate=0.25,
        block_ref_counts=(1, 2, 1, 1, 0, 0, 0, 0),
    )
    text = format_stats(stats)
    assert "50/128 tokens" in text
    assert "swap pool  2/6 blocks used" in text
    assert "preempted 1 (swap 1, recompute 0)" in text
    assert "hits 25% of prompt tokens · 1 shared blocks · 3 free blocks holding cached prefixes" in text
    pools = render_pools(stats)
    assert "CPU swap pool · 2/6 in use" in pools
    assert pools.split("hfcb-swap")[1].count('title="block') == 2  # owners unknown: two cells drawn in use
    assert "shared by 2 requests" in pools  # block 1 has ref count 2


@pytest.mark.timeout(120)
def test_tokens_held_and_logical_tokens_are_labelled_apart_when_blocks_are_shared():
    shared = with_fields(make_stats(), num_kv_tokens=50, num_logical_kv_tokens=80)
    assert "4/8 used (50%), peak 6, 50/128 tokens (80 logical: shared blocks once per request)\n" in format_stats(
        shared
    )
    unshared = with_fields(make_stats(), num_kv_tokens=50, num_logical_kv_tokens=50)
    assert "4/8 used (50%), peak 6, 50/128 tokens\n" in format_stats(unshared)
    dash = Dashboard(FakeSource(shared))
    assert (
        dash.tokens_label.value == "50/128 tokens (in 64 allocated slots) (80 logical: shared blocks once per request)"
    )
    assert (dash.tokens_bar.value, dash.tokens_bar.max) == (50, 128)


@pytest.mark.timeout(120)
def test_block_grid_has_one_cell_per_block_with_the_request_on_hover():
    html = render_block_grid((5, 5, -1, 7))
    titles = re.findall(r'title="([^"]*)"', html)
    assert html.count("<i") == 4
    assert titles == ["block 0 · request 5", "block 1 · request 5", "block 3 · request 7"]


@pytest.mark.timeout(120)
def test_large_pools_aggregate_blocks_into_at_most_max_cells():
    owners = tuple(i % 3 - 1 for i in range(10_000))  # -1, 0, 1 repeating: two thirds in use
    html = render_block_grid(owners, max_cells=500)
    assert html.count("<i") == 500 and 'data-blocks-per-cell="20"' in html
    first = re.search(r'title="([^"]*)"', html).group(1)
    assert first.startswith("blocks 0–19: 13 in use") and first.endswith("7 free")


@pytest.mark.timeout(120)
def test_phase_rows_reads_engine_and_flat_phase_logs():
    engine_log = ((3, (("reap", 0.1), ("budget", 0.2), ("decode", 1.0))), (4, (("reap", 0.3),)))
    assert phase_rows(engine_log) == [{"reap": 0.1, "budget": 0.2, "decode": 1.0}, {"reap": 0.3}]
    flat = (("reap", 0.1), ("decode", 1.0), ("reap", 0.2), ("decode", 2.0))
    assert phase_rows(flat) == [{"reap": 0.1, "decode": 1.0}, {"reap": 0.2, "decode": 2.0}]


@pytest.mark.timeout(120)
def test_dashboard_costs_nothing_until_displayed_and_its_refresher_sleeps():
    source = FakeSource(make_stats())
    dash = Dashboard(source, refresh_hz=5)
    assert source.calls == 1 and not dash.running  # one synchronous refresh at construction, no thread
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "4/8 used" in bundle["text/plain"]
    assert not dash.running  # outside a kernel nothing would show the updates

    assert "stopped" in dash.header.value
    dash.start()
    try:
        assert "live" in dash.header.value  # from the first frame, before any change
        calls_at_start = source.calls
        time.sleep(1.0)
        snapshots = source.calls - calls_at_start
        assert snapshots <= 8, f"{snapshots} snapshots in 1 s at refresh_hz=5"  # sleeps, never spins
        assert eventually(lambda: source.calls >= 3)
        renders = dash.num_refreshes
        time.sleep(0.6)
        assert dash.num_refreshes == renders  # nothing changed: nothing rendered, nothing sent
        source.snapshot = dataclasses.replace(
            source.snapshot, num_used_blocks=5, num_iterations=13, block_owner=(5, 5, 5, 7, 9, -1, -1, -1)
        )
        assert eventually(lambda: "5/8 in use" in dash.grid.value)
        assert dash.num_refreshes > renders
    finally:
        dash.stop()
    assert not dash.running and "stopped" in dash.header.value
    calls = source.calls
    time.sleep(0.5)
    assert source.calls == calls  # stopped means stopped


@pytest.mark.timeout(120)
def test_refresher_polls_once_a_second_after_two_quiet_seconds():
    source = FakeSource(make_stats())
    dash = Dashboard(source, refresh_hz=20).start()
    try:
        # Two quiet seconds at 20 Hz are 40 unchanged polls; a busy machine slows the polls, so wait
        # for the polls themselves rather than for 2.6 s: the constructor's and start()'s snapshots,
        # one poll that may still render, 40 quiet ones, then two more that come a second apart.
        assert eventually(lambda: source.calls >= 2 + 1 + 40 + 2, timeout_s=100)
        calls = source.calls
        time.sleep(2.0)
        assert source.calls - calls <= 3, f"{source.calls - calls} snapshots in 2 quiet seconds"
    finally:
        dash.stop()


@pytest.mark.timeout(120)
def test_refresher_ends_by_itself_when_the_engine_closes():
    source = FakeSource(make_stats())
    dash = Dashboard(source, refresh_hz=10).start()
    source.closed = True
    assert eventually(lambda: not dash.running)
    assert "closed" in dash.header.value


@pytest.mark.timeout(120)
def test_an_explicit_refresh_sends_every_value_even_unchanged_ones():
    # The refresher thread's messages belong to no notebook cell, and a tool that records a cell's
    # messages (nbclient, nbconvert --execute) drops them: refresh() and stop() must send the frame
    # in full, or a saved notebook could keep an older frame than the one on screen.
    source = FakeSource(make_stats())
    dash = Dashboard(source)
    sent = []
    for w in dash._widgets:
        w._send = lambda msg, buffers=None, w=w: sent.append((w, msg))
    dash._refresh(only_if_changed=False)  # what the refresher does: the grid did not change, not sent
    assert dash.grid not in {w for w, _ in sent}
    sent.clear()
    dash.refresh()
    assert {w for w, _ in sent} == set(dash._widgets)
    grid_states = [msg["state"] for w, msg in sent if w is dash.grid]
    assert grid_states and "4/8 in use" in grid_states[-1]["value"]


@pytest.mark.timeout(120)
def test_bad_arguments_are_rejected_with_the_argument_name():
    source = FakeSource(make_stats())
    with pytest.raises(ValueError, match="refresh_hz"):
        Dashboard(source, refresh_hz=0)
    with pytest.raises(ValueError, match="max_cells"):
        Dashboard(source, max_cells=0)
    with pytest.raises(ValueError, match="stats"):
        Dashboard(object())


@pytest.mark.timeout(600)
def test_live_dashboard_follows_a_real_engine_under_preemption(llama_model):
    engine = LLMEngine(
        llama_model,
        EngineConfig(
            cache=CacheConfig(num_blocks=16, block_size=4), scheduler=SchedulerConfig(max_num_seqs=4), num_threads=1
        ),
    )
    try:
        dash = Dashboard(engine, refresh_hz=20)
        shown_in_use = threading.Event()  # the refresher thread pushed a non-zero blocks-in-use value

        def on_blocks(change):
            if change["new"] > 0 and threading.current_thread() is not threading.main_thread():
                shown_in_use.set()

        dash.blocks_bar.observe(on_blocks, "value")
        dash.start()

        def hold_until_shown(request) -> bool:  # engine thread, after each token: never stops a request
            shown_in_use.wait(timeout=50)  # pauses the engine, blocks in use, until the view has shown them
            return False

        prompts = random_prompts([5, 9, 7, 11, 6, 8, 10, 4, 12, 7, 5, 9])
        handles = [engine.submit(p, SamplingParams(max_new_tokens=24), stop_checker=hold_until_shown) for p in prompts]
        for h in handles:
            h.result(timeout=450)
        assert engine.wait_idle(timeout=150)
        dash.stop()
        stats = dash.refresh()
        # 12 requests of 8-9 blocks each in a 16-block pool: only one or two fit at a time.
        assert stats.num_preemptions > 0
        assert shown_in_use.is_set(), "the refresher thread never showed a block in use"
        assert dash.blocks_bar.value == 0 and "0/16 in use" in dash.grid.value  # every block freed
        assert f"finished 12 · preempted {stats.num_preemptions}" in dash.summary()
    finally:
        engine.close()


def _tile_value(tiles_html: str, label: str) -> str:
    return re.search(rf"<small>{re.escape(label)}</small><b>([^<]*)</b>", tiles_html).group(1)


def _legends(pools_html: str) -> list[str]:
    return re.findall(r"one cell = ([^<]*)</span>", pools_html)


@pytest.mark.timeout(120)
def test_grid_draws_the_in_use_region_of_a_large_pool_one_cell_per_block():
    owners = (3,) * 30 + (-1,) * 8162  # 30 of 8,192 blocks in use, the lowest ones (as allocated)
    assert in_use_region(owners) == 64  # a power of two >= 30, at least 64
    assert in_use_region(owners, high_water=200) == 256  # never shrinks below an earlier high-water mark
    assert in_use_region((-1,) * 20) == 20  # a small pool is drawn whole
    stats = make_stats(
        num_blocks=8192, num_used_blocks=30, num_free_blocks=8162, capacity_tokens=8192 * 16, block_owner=owners
    )
    pools = render_pools(stats)
    device = pools.split("hfcb-swap")[0]
    grid = re.search(r'<div class="hfcb-grid"[^>]*>(.*?)</div>', device).group(0)
    assert grid.count("<i") == 64  # one cell per block of the region, not 512 aggregated cells
    assert len(re.findall(r'title="block \d+ · request 3"', device)) == 30
    assert ",16px)" in grid  # 64 cells: 16 px each
    assert "the other 8,128 have never been used" in device
    assert _legends(pools) == ["1 block"]


@pytest.mark.timeout(120)
def test_each_grid_has_a_legend_true_for_it():
    # a 48-block device pool beside a 4,096-block swap pool with 600 blocks swapped out
    stats = with_fields(
        make_stats(num_blocks=48, num_free_blocks=44, block_owner=(5, 5, 5, 7) + (-1,) * 44),
        num_swap_blocks=4096,
        num_swapped_blocks=600,
    )
    pools = render_pools(stats)
    assert _legends(pools) == ["1 block", "2 blocks (darker = fuller)"]  # swap: 1,024 drawn in 512 cells
    swap = pools.split("hfcb-swap")[1]
    assert 'data-blocks-per-cell="2"' in swap and "the other 3,072 have never been used" in swap
    assert "swapped out" in swap and "prefix-cached" not in swap


@pytest.mark.timeout(120)
def test_tokens_per_s_now_reads_a_dash_when_the_engine_is_idle():
    source = FakeSource(make_stats(num_generated_tokens=40))
    dash = Dashboard(source)
    time.sleep(0.3)
    source.snapshot = dataclasses.replace(source.snapshot, num_generated_tokens=100, num_iterations=20)
    dash.refresh()
    busy = _tile_value(dash.tiles.value, "tokens/s now")
    assert busy != "—" and float(busy) > 0
    source.snapshot = dataclasses.replace(source.snapshot, num_waiting=0, num_running=0, num_finished=7)
    dash.refresh()
    assert _tile_value(dash.tiles.value, "tokens/s now") == "—"
    assert "tok/s now" not in dash.summary()


@pytest.mark.timeout(120)
def test_summary_takes_a_fresh_snapshot_while_the_refresher_runs():
    source = FakeSource(make_stats())
    dash = Dashboard(source, refresh_hz=0.2).start()  # the refresher sleeps 5 s first
    try:
        source.snapshot = dataclasses.replace(source.snapshot, num_waiting=0, num_running=0, num_finished=9)
        assert "waiting 0 · running 0 · swapped 0 · finished 9" in dash.summary()
    finally:
        dash.stop()


@pytest.mark.timeout(600)
def test_frame_after_close_shows_nothing_in_flight(llama_model):
    engine = LLMEngine(
        llama_model, EngineConfig(cache=CacheConfig(num_blocks=128, block_size=4), linear_backend="torch")
    )
    dash = Dashboard(engine)
    started = threading.Event()

    def slow(request) -> bool:  # engine thread, after each token
        started.set()
        time.sleep(0.01)
        return False

    handles = [
        engine.submit(p, SamplingParams(max_new_tokens=150), stop_checker=slow) for p in random_prompts([5, 9, 7])
    ]
    assert started.wait(300)
    engine.close()
    stats = dash.refresh()
    assert all(h.done() for h in handles)
    assert (stats.num_running, stats.num_waiting, stats.num_swapped, stats.num_used_blocks) == (0, 0, 0, 0)
    assert stats.num_kv_tokens == 0
    assert "closed" in dash.header.value
    assert _tile_value(dash.tiles.value, "running") == "0" and _tile_value(dash.tiles.value, "tokens/s now") == "—"
    assert dash.tokens_label.value.startswith("0/")


# A request that arrived at 100 s: first token 0.5 s later, then 12 tokens 0.1 s apart.
ONE_REQUEST = RequestMetrics(
    arrival_time=100.0,
    first_scheduled_time=100.01,
    first_token_time=100.5,
    last_token_time=101.7,
    finished_time=101.8,
    num_generated_tokens=13,
)


@pytest.mark.timeout(120)
def test_one_request_view_shows_that_requests_ttft_and_itl_beside_medians_and_p90():
    stats = with_fields(
        make_stats(),
        median_ttft_s=0.04,
        p90_ttft_s=0.09,
        median_itl_s=0.01,
        p90_itl_s=0.02,
        latest_request_id=7,
        latest_request=ONE_REQUEST,
    )
    text = format_stats(stats)
    assert (
        "latency    TTFT median 40.0 ms, p90 90.0 ms · ITL median 10.0 ms, p90 20.0 ms · "
        "latest request 7: TTFT 500.0 ms · ITL 100.0 ms per token · 13 tokens"
    ) in text
    html = render_tiles(stats, tokens_per_s_now=None)
    assert "<small>TTFT · request 7</small><b>500.0 ms</b>" in html
    assert "<small>ITL · request 7</small><b>100.0 ms</b>" in html and "13 tokens" in html
    assert "median 40.0 ms · p90 90.0 ms" in html and "median 10.0 ms · p90 20.0 ms" in html
    # A snapshot without them (an older engine's, or before any token) shows no latency line or tile.
    bare = make_stats()
    assert "latency" not in format_stats(bare) and "request 7" not in render_tiles(bare, None)


@pytest.mark.timeout(300)
def test_the_text_view_of_a_real_engine_shows_its_only_requests_own_figures(llama_model):
    engine = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=16, block_size=4), num_threads=1))
    try:
        out = engine.submit(random_prompts([9])[0], SamplingParams(max_new_tokens=5)).result(120)
        text = format_stats(engine.stats())
    finally:
        engine.close()
    m = out.metrics
    want = f"latest request {out.request_id}: TTFT {format_ms(m.ttft)} · ITL {format_ms(m.itl)} per token · 5 tokens"
    assert want in text, text
