"""Views of an engine's stats snapshots: a live ipywidgets dashboard for notebooks
(:class:`Dashboard`), and a text summary (:func:`format_stats`) for scripts and terminals.

The engine publishes immutable ``EngineStats`` snapshots; these modules only read them:
``snapshot`` (reading fields, phase rows, block owners), ``text`` (the text summary), ``render``
(HTML of the block grids, tiles and phases), ``widget`` (the live view and its refresher thread).
ipywidgets is imported only when a ``Dashboard`` is built, so ``import hf_contbatch`` and
``format_stats`` work without it.

Fields beyond the core ``EngineStats`` ones are optional -- looked up as attributes, with
defaults -- so the view also reads snapshots that publish fewer:

- ``num_kv_tokens``: tokens of KV in the pool, each slot once (the tokens bar; else block slots), and
  ``num_logical_kv_tokens``: the same with a shared block counted once per request;
- ``num_swap_blocks``, ``num_swapped_blocks``: the CPU swap pool's size and blocks in use;
- ``block_ref_counts``: per device block; above 1 the block is shared (prefix cache or fork);
- ``prefix_caching``, ``num_cached_blocks`` (free blocks still holding a reusable prefix),
  ``prefix_cache_hit_rate``;
- ``num_preemptions_swap``, ``num_preemptions_recompute``: preemptions by kind;
- ``reserved_blocks``, ``watermark_blocks``: the last budget step;
- ``phase_seconds``: total seconds per phase since the engine started.
"""

from .render import (
    CACHED_COLOUR,
    FREE_COLOUR,
    PHASE_COLOURS,
    REQUEST_COLOURS,
    SWAPPED_COLOUR,
    blocks_per_cell,
    in_use_region,
    render_block_grid,
    render_phases,
    render_pools,
    render_tiles,
    request_colour,
)
from .snapshot import phase_rows
from .text import format_stats
from .widget import Dashboard

__all__ = [
    "CACHED_COLOUR",
    "FREE_COLOUR",
    "PHASE_COLOURS",
    "REQUEST_COLOURS",
    "SWAPPED_COLOUR",
    "Dashboard",
    "blocks_per_cell",
    "format_stats",
    "in_use_region",
    "phase_rows",
    "render_block_grid",
    "render_phases",
    "render_pools",
    "render_tiles",
    "request_colour",
]
