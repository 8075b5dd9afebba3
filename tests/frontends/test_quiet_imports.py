"""torchao's known harmless loader notices stay out of a user's stderr, and nothing of ours needs
torchao outside its own path: ``import hf_contbatch`` drops exactly torchao's "Failed to load
<its own _C extension>" lines and pytree's deprecation warnings about torchao's enums (which
transformers' own import of torchao prints on a CPU machine, e.g. in a notebook's first model load),
every other record passes; no module of the package imports torchao, and float and int8 engines
build and serve with torchao unimportable."""

from __future__ import annotations

import ast
import enum
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hf_contbatch.frontends.quiet_imports import KnownImportNotices, quiet_known_import_notices

PACKAGE = Path(__file__).resolve().parents[2] / "hf_contbatch"
NOISE = ("Failed to load", "_pytree", "Enum subclass", "_C_mxfp8", "_C_cutlass")


def _run(code: str) -> subprocess.CompletedProcess:
    # The timeout guards against a hang (a cold import of torch and transformers on a busy machine).
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
def test_a_notebooks_first_cells_print_no_torchao_notices():
    # Notebook 01's order: transformers imported first, then hf_contbatch; transformers' own load
    # of a model imports torchao; then our float pipeline on the same model.
    code = (
        "import transformers, hf_contbatch\n"
        "from hf_contbatch.default_model import default_model_path\n"
        "path = default_model_path()\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype='float32')\n"
        "pipe = hf_contbatch.pipeline('text-generation', model=model, tokenizer=path)\n"
        "print(pipe('The for statement', max_new_tokens=2, do_sample=False, progress_bar=False)[0]['generated_text'])\n"
        "pipe.close()\n"
    )
    proc = _run(code)
    assert proc.stdout.startswith("The for statement")
    assert not [word for word in NOISE if word in proc.stderr], proc.stderr


def test_no_module_of_the_package_imports_torchao():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torchao"]
    assert found == []


@pytest.mark.timeout(300)
def test_float_and_int8_engines_serve_with_torchao_unimportable():
    # sys.modules[name] = None makes `import torchao` fail and transformers' availability check say
    # no: whatever still works then never needed torchao.
    code = (
        "import sys\nsys.modules['torchao'] = None\n"
        "sys.path.insert(0, 'tests')\n"
        "from conftest import build_model, random_prompts, reference_greedy\n"
        "from hf_contbatch import EngineConfig, LLMEngine, SamplingParams\n"
        "model = build_model('llama')\n"
        "prompt = random_prompts([6])[0]\n"
        "want = reference_greedy(model, prompt, 4)\n"
        "for quantization in (None, 'int8'):\n"
        "    eng = LLMEngine(model, EngineConfig(quantization=quantization))\n"
        "    out = eng.submit(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)).result(120)\n"
        "    eng.close()\n"
        "    assert len(out.output_token_ids) == 4\n"
        "    if quantization is None:\n"
        "        assert out.output_token_ids == want, (out.output_token_ids, want)\n"
        "assert sys.modules['torchao'] is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd=PACKAGE.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_filter_drops_exactly_the_known_notices():
    quiet_known_import_notices()
    quiet_known_import_notices()  # idempotent: one filter per logger
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert [type(f) for f in torchao.filters].count(KnownImportNotices) == 1
    theirs = enum.Enum("KernelPreference", "AUTO TORCH", module="torchao.quantization.quantize_.common")
    ours = enum.Enum("Colour", "RED GREEN", module="my_project.colours")
    handler = _Records()
    for logger in (torchao, pytree):
        logger.addHandler(handler)
    try:
        so = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
        torchao.warning(f"Failed to load {so}: Could not load this library: {so}")
        torchao.warning("Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: undefined symbol")
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version.")
        torchao.warning("Failed to load /data/my_checkpoint.bin: truncated")
        deprecated = "%s is an Enum subclass and is now natively supported ... deprecated"
        pytree.warning(deprecated, theirs)
        pytree.warning(deprecated, ours)
    finally:
        for logger in (torchao, pytree):
            logger.removeHandler(handler)
    assert handler.messages == [
        "Skipping import of cpp extensions due to incompatible torch version.",
        "Failed to load /data/my_checkpoint.bin: truncated",
        f"{ours} is an Enum subclass and is now natively supported ... deprecated",
    ]
