"""The load printed beside machine-dependent figures (issue 48: a quickstart's tok/s several times
below README's on a busy machine, with no word why). Expectations are arithmetic on given readings."""

from __future__ import annotations

import os
import re

import pytest
from test_dashboard import make_stats

from hf_contbatch.frontends.dashboard import format_stats
from hf_contbatch.frontends.machine_load import MachineLoad, load_note


@pytest.mark.timeout(120)
def test_a_load_over_one_and_a_half_per_core_is_busy_and_says_so_in_one_line():
    busy = MachineLoad(7.6, 2)  # the machine: load 7-8 on 2 cores
    assert busy.per_core == pytest.approx(3.8) and busy.busy
    assert busy.short() == "load 7.60 on 2 cores, busy"
    line = busy.busy_line()
    assert "\n" not in line and "busy" in line and "3.8 per core" in line
    assert load_note("; ", busy) == ("; load 7.60 on 2 cores, busy", line)

    own_run = MachineLoad(2.0, 2)  # one generating run on every core of an idle machine
    assert own_run.per_core == 1.0 and not own_run.busy and own_run.busy_line() == ""
    assert load_note(" · ", own_run) == (" · load 2.00 on 2 cores", "")
    assert not MachineLoad(3.0, 2).busy and MachineLoad(3.02, 2).busy  # the threshold: 1.5 per core
    assert MachineLoad(0.5, 1).short() == "load 0.50 on 1 core"


@pytest.mark.timeout(120)
def test_the_reading_now_is_the_os_load_average_over_the_cores():
    now = MachineLoad.now()
    if not hasattr(os, "getloadavg"):  # Windows keeps no load average: nothing is printed
        assert now is None and load_note() == ("", "")
        return
    assert now is not None and now.cores == os.cpu_count() and now.load_1min >= 0
    assert re.fullmatch(r"; load \d+\.\d\d on \d+ cores?(, busy)?", load_note()[0])


@pytest.mark.timeout(120)
def test_format_stats_ends_its_speed_line_with_the_load_and_adds_a_line_when_busy():
    stats = make_stats()
    idle_lines = format_stats(stats, load=MachineLoad(0.4, 2)).splitlines()
    speed = next(i for i, line in enumerate(idle_lines) if line.startswith("speed"))
    assert idle_lines[speed].endswith(" · load 0.40 on 2 cores")
    busy = MachineLoad(7.6, 2)
    busy_lines = format_stats(stats, load=busy).splitlines()
    assert busy_lines[speed].endswith(" · load 7.60 on 2 cores, busy")
    assert busy_lines[speed + 1].strip() == busy.busy_line()
    assert len(busy_lines) == len(idle_lines) + 1
