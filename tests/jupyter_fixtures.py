"""Fixtures and helpers for the notebook and browser tests (imported by them, not by conftest.py).

Every Jupyter, IPython and Chromium state directory lives under pytest's temp dir, never in the
home directory; the kernels import this checkout (PYTHONPATH) and never reach the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def jupyter_env(state_dir: Path) -> dict:
    """Environment for kernels and servers: state dirs under ``state_dir``, this checkout importable,
    offline Hugging Face, quiet tokenizers."""
    dirs = {
        "JUPYTER_CONFIG_DIR": "jupyter-config",
        "JUPYTER_DATA_DIR": "jupyter-data",
        "JUPYTER_RUNTIME_DIR": "jupyter-runtime",
        "IPYTHONDIR": "ipython",
        "MPLCONFIGDIR": "mpl",
        "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
        "XDG_CONFIG_HOME": "xdg-config",
        "XDG_CACHE_HOME": "xdg-cache",
    }
    env = dict(os.environ)
    for var, sub in dirs.items():
        path = state_dir / sub
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    seed_kernel_cache(Path(env["XDG_CACHE_HOME"]))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def seed_kernel_cache(xdg_cache: Path) -> None:
    """Copy this process's kernel cache (``native_build.cache_dir()``: the C kernels built and the
    GEMM and attention timings measured on this CPU, by this session's earlier tests or before) into
    ``xdg_cache``/hf_contbatch. A kernel started with that cache finds them as a user's second
    session on the machine does, instead of building and timing again in every notebook (many
    seconds each on two cores). The first run on an empty cache is tested in test_cli.py."""
    from hf_contbatch.kernels.native_build import cache_dir

    source = cache_dir()
    if source.is_dir():
        shutil.copytree(source, xdg_cache / "hf_contbatch", dirs_exist_ok=True)


def widget_models(nb) -> dict:
    """``{model_id: {"model_name": ..., "state": {...}}}`` saved by nbclient in the notebook metadata."""
    return nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def models_with_class(nb, dom_class: str) -> list[dict]:
    """Saved states of the widgets carrying ``dom_class`` (e.g. "hfcb-block-grid")."""
    return [m["state"] for m in widget_models(nb).values() if dom_class in m["state"].get("_dom_classes", [])]


def cell_text(cell) -> str:
    """All stream and text/plain output of a code cell, joined."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def cell_by_tag(nb, tag: str):
    """The one cell tagged ``tag`` (notebooks tag the cells tests look at)."""
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def require_default_model() -> None:
    from hf_contbatch.default_model import default_model_path

    if not (Path(default_model_path()) / "config.json").exists():
        pytest.fail(
            "the embedded default model is missing (hf_contbatch/default_model/config.json); "
            "train it with scripts/train_default_model.py"
        )


def browser_missing_reason() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (run .ci/install-system-packages.sh)")
    for module in ("playwright", "jupyterlab"):
        # Found, not imported: importing jupyterlab loads jupyter_server and jsonschema (about 5 s),
        # which every pytest-xdist worker would pay when it collects the browser tests.
        if importlib.util.find_spec(module) is None:
            missing.append(f"the {module} package (pip install -e '.[dev]')")
    return "browser test needs " + " and ".join(missing) if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a random token, its root dir and state in temp dirs."""
    root = tmp_path_factory.mktemp("lab-root")
    env = jupyter_env(tmp_path_factory.mktemp("lab-state"))
    # The "Jupyter news?" toast can cover the widgets in screenshots: answer it in user settings.
    notify = Path(
        env["JUPYTERLAB_SETTINGS_DIR"], "@jupyterlab", "apputils-extension", "notification.jupyterlab-settings"
    )
    notify.parent.mkdir(parents=True, exist_ok=True)
    notify.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    log_path = root.parent / f"{root.name}-lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--allow-root",
                "--ip=127.0.0.1",
                f"--port={port}",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 450
            while True:
                try:
                    urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=10)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("JupyterLab did not start:\n" + log_path.read_text()[-4000:]) from None
                    time.sleep(0.25)
            yield {"base": base, "token": token, "root": root, "log": log_path}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=75)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's Chromium driven by Playwright (no `playwright install`), state in temp dirs."""
    from playwright.sync_api import sync_playwright

    state = tmp_path_factory.mktemp("chromium-state")
    env = jupyter_env(state)  # Chromium writes crash reports and dconf under the XDG dirs
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=env)
        try:
            yield b
        finally:
            b.close()


def copy_notebook(name: str, dest: Path) -> Path:
    target = dest / name
    shutil.copy(NOTEBOOKS / name, target)
    return target
