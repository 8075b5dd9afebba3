"""Shared fixtures: tiny random-weight models of several families, built from configs (no hub)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Under pytest-xdist (the README's `-n 2`) each worker runs torch on one thread, as do the scripts,
# kernels and servers its tests start: two workers with a thread pool each per core fought over two
# cores and ran the suite slower than one process did. Set before torch starts its thread pool.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads TRITON_INTERPRET when a kernel is decorated (at import of our kernels module), so it
# must be set before any test imports hf_contbatch: on CPU the kernels run under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 512
ROOT = Path(__file__).resolve().parents[1]  # the checkout
ENTRY_POINT = Path(sys.executable).with_name("hf-contbatch")  # pyproject's [project.scripts]


def cli_command() -> list[str]:
    """The installed ``hf-contbatch`` script (it runs ``hf_contbatch.cli:main``), else the module."""
    return [str(ENTRY_POINT)] if ENTRY_POINT.exists() else [sys.executable, "-m", "hf_contbatch.cli"]


def cli_env(**extra: str) -> dict:
    """The environment of a CLI subprocess: this checkout's package first on the path, offline."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    env.pop("HF_CONTBATCH_DEBUG", None)
    return {**env, **extra}


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    base.update(kw)
    return base


def build_model(family: str, seed: int = 0, **overrides):
    """A tiny float32 random model of ``family`` in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        cfg = tf.LlamaConfig(**_common(**overrides))
        cls = tf.LlamaForCausalLM
    elif family == "llama-mqa":
        cfg = tf.LlamaConfig(**_common(num_key_value_heads=1, **overrides))
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(**_common(**{"sliding_window": 8, **overrides}))
        cls = tf.MistralForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**_common(**overrides))
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**_common(head_dim=16, **overrides))
        cls = tf.Qwen3ForCausalLM
    elif family == "gemma":
        cfg = tf.GemmaConfig(**_common(head_dim=16, **overrides))
        cls = tf.GemmaForCausalLM
    elif family == "gemma2":
        cfg = tf.Gemma2Config(
            **_common(
                head_dim=16,
                sliding_window=8,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                query_pre_attn_scalar=16,
                **overrides,
            )
        )
        cls = tf.Gemma2ForCausalLM
    elif family == "phi3":
        cfg = tf.Phi3Config(**_common(**overrides))
        cls = tf.Phi3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    return model


def variant_flags(base, extra):
    """Compiler flags of a narrower build of one of our C kernels: ``base`` then ``extra``, less
    ``-mno-avx512f`` on a CPU without AVX-512, where ``-march=native`` already has none (the very
    build the engine loads, found in the kernel cache instead of compiled again). The test
    session's kernel cache holds the variants: each is compiled once a session, whichever tests
    use it (cpu_prefill.c takes 10-25 s to compile on two cores)."""
    from hf_contbatch.kernels.native_build import cpu_id

    extra = list(extra)
    if "-mno-avx512f" in extra and "avx512f" not in cpu_id().split():
        extra.remove("-mno-avx512f")
    return [*base, *extra]


def enqueue_at_once(engine, prompts, params) -> list:
    """Queue every prompt (token ids) with ``params`` (one ``SamplingParams``, or one per prompt) in
    one ``enqueue`` call and return each one's handle. Tests that count the engine's steps or graphs
    need the requests batched the same way whatever the machine's load: one ``submit`` after another
    lets the engine step in between."""
    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    return [handles[0] for handles in engine.enqueue([engine.build_request(p, sp) for p, sp in zip(prompts, params)])]


def validate_json(instance, schema) -> None:
    """``jsonschema.validate(instance, schema)``. jsonschema is imported on first use: it takes about
    4 s to import where rfc3987-syntax is installed (JupyterLab's dependencies bring it), which every
    pytest-xdist worker would pay when it collects a module importing it."""
    import jsonschema

    jsonschema.validate(instance, schema)


def random_prompts(lengths, seed: int = 1, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    # Avoid special ids 0-2 so EOS never appears in a prompt.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_greedy(model, prompt, max_new_tokens: int):
    """transformers' own greedy generate on the prompt alone (no padding), EOS ignored."""
    # The tiny models have no EOS token (eos_token_id=None), so generate runs the full length
    # without masking any logit (min_new_tokens would mask EOS and change the argmax).
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,  # models with an EOS (the embedded one) generate the full length too
        )
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt) :].tolist()


def load_family_sweep(name: str = "family_sweep"):
    """``scripts/family_sweep.py`` (the model-type sweep: ``tiny_config``, ``build_tiny``, ``prompts``,
    ``reference``...) loaded as a fresh module called ``name``. Fresh per call, because scripts/ is
    not a package and some test files change the module's globals for their own runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "family_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_greedy(model, prompts, config, max_new_tokens: int, check=None, timeout: float = 120):
    """Serve ``prompts`` (token-id lists) greedy, EOS ignored, queued one after another on a new
    ``LLMEngine(model, config)``, closed afterwards; returns ``(outputs, stats)``: each prompt's new
    token ids and the engine's ``EngineStats`` once idle.

    Asserts the block manager's invariants and that every KV block came back (no leak).
    ``check(engine)``: further assertions made while the engine is still open (its runner's state).
    """
    from hf_contbatch import LLMEngine
    from hf_contbatch.request import SamplingParams

    engine = LLMEngine(model, config)
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        outputs = [h.result(timeout=timeout).output_token_ids for h in handles]
        assert engine.wait_idle(10)
        stats = engine.stats()
        engine.block_manager.check_invariants()
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
        if check is not None:
            check(engine)
    finally:
        engine.close()
    return outputs, stats


@pytest.fixture
def sigint_raises():
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the test, as in a terminal or
    a Jupyter kernel, also where the test process inherited SIGINT ignored (a shell starts its
    background jobs so, and Python then keeps it ignored): tests of Ctrl-C and the Stop button."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_built():
    """The CPU kernels compiled (or found in the kernel cache) once, side by side, before the first
    engine of the session needs them: built lazily one after another they took about 20 s of
    whichever engine test came first on two cores, 11 s side by side. Tests of a first build use
    an empty cache of their own."""
    if not torch.cuda.is_available():
        from hf_contbatch.kernels.prebuild import prebuild_cpu_kernels

        prebuild_cpu_kernels()


@pytest.fixture(scope="session")
def llama_model():
    return build_model("llama")


@pytest.fixture(scope="module")
def tok():
    """The embedded model's tokenizer."""
    from transformers import AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


LM_EVAL_TASKS_DIR = "tests/data/lm_eval_tasks"  # the task YAMLs name their jsonl files relative to the repo root
LM_EVAL_TASKS = ["hfcb_pydoc_gen", "hfcb_pydoc_choice", "hfcb_pydoc_text"]


def local_task_manager():
    """An lm-eval ``TaskManager`` that knows our local tasks only: indexing lm-eval's thousands of
    built-in task YAMLs as well took about 20 s per TaskManager on a 2-core machine."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=LM_EVAL_TASKS_DIR, include_defaults=False)


@pytest.fixture(scope="session")
def lm_eval_hf_results():
    """lm-eval's own ``hf`` model on the embedded model (float32, CPU) over the three local tasks,
    with samples: the reference of tests/frontends/test_integrations_lm_eval.py and, for the base
    model, of test_lora_frontends.py; evaluated once per session (lm-eval must be installed)."""
    lm_eval = pytest.importorskip("lm_eval")

    from hf_contbatch.default_model import default_model_path

    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={default_model_path()},dtype=float32,device=cpu",
            tasks=LM_EVAL_TASKS,
            task_manager=local_task_manager(),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def ref_model():
    """A float32 copy of the embedded model that no engine touches: the ``generate`` reference."""
    from transformers import AutoModelForCausalLM

    from hf_contbatch.default_model import default_model_path

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)


def pytest_sessionstart(session):
    """Under pytest-xdist, the controller builds the CPU kernels (``_cpu_kernels_built``) while its
    workers start and collect (about 25 s): they then find the kernels in the kernel cache instead
    of both compiling the same ones at once on a cold cache. The compilers are subprocesses, so the
    controller's thread holds no lock its event loop needs."""
    numprocesses = getattr(session.config.option, "numprocesses", None)
    if numprocesses and not os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
        import threading

        from hf_contbatch.kernels.prebuild import prebuild_cpu_kernels

        session.config.stash[_PREBUILD] = thread = threading.Thread(target=prebuild_cpu_kernels, daemon=True)
        thread.start()


def pytest_sessionfinish(session):
    thread = session.config.stash.get(_PREBUILD, None)
    if thread is not None:
        thread.join()


_PREBUILD = pytest.StashKey()
