"""Test-wide settings: JAX's persistent compilation cache (under ``.pytest_cache/``, never the
user's cache directory that runs use by default), CPU only, XLA's compiles without LLVM's
optimisation passes (``tests/helpers.py: TEST_XLA_FLAGS``), and the slow marker.

The settings go through environment variables so that subprocesses started by tests
(mesh and multi-process tests) inherit them too.
"""

from __future__ import annotations

import gc
import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config):
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = cache.mkdir("jax-compilation-cache") if cache is not None else None
    if cache_dir is not None:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_dir))
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # Runs turn JAX's cache on under the user's cache directory (asyncrl/run/compile_cache.py):
        # tests never write there, so with no test cache directory runs keep it off.
        os.environ.setdefault("ASYNCRL_COMPILE_CACHE", "0")
    # Cache every compilation, however small: tests recompile the same tiny models
    # across processes, and small programs are most of what they compile.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    from asyncrl.engine.platform import merge_xla_flags
    from tests.helpers import TEST_XLA_FLAGS

    os.environ["XLA_FLAGS"] = merge_xla_flags(os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Datasets by name (GSM8K) from the local copy beside the checkout, as a user without network
    # points at one; runs started by tests inherit it.
    from tests.helpers import SHARED_DATA

    os.environ.setdefault("ASYNCRL_DATA_DIR", str(SHARED_DATA))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or "slow" in (config.getoption("-m") or ""):
        return
    # A slow test named explicitly on the command line (path::name) runs too.
    named = {arg.split("[")[0] for arg in config.args if "::" in arg}
    skip = pytest.mark.skip(reason="slow: run with --runslow, -m slow, or by node id")
    for item in items:
        if "slow" in item.keywords and item.nodeid.split("[")[0] not in named:
            item.add_marker(skip)


@pytest.fixture
def compile_cache(tmp_path, monkeypatch):
    """JAX's persistent compilation cache on for one test that needs the cache itself (the train
    step compiled in the background reaches the step through it: asyncrl/trainer/precompile.py):
    the suite's directory, or under ``-p no:cacheprovider``, where the suite has none and runs keep
    the cache off (``pytest_configure``), a fresh one in ``tmp_path``. Yields the directory; the
    process's cache settings are restored afterwards."""
    import jax
    from jax._src import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {name: jax.config.values[name] for name in names}
    where = before["jax_compilation_cache_dir"] or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "jax")
    monkeypatch.delenv("ASYNCRL_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", where)  # what a run's enable_compile_cache reads
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    yield where
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


# The tiny model in the four shapes tests want it, each under its own name (module scope: one
# load per test file, as before).


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The built-in ``tiny`` model written to a fresh directory (a Hugging Face layout)."""
    from asyncrl.model.tiny import ensure_tiny

    return ensure_tiny("tiny", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_from_dir(tiny_dir):
    """``tiny`` loaded back from :func:`tiny_dir` (a ``LoadedModel`` with its tokenizer)."""
    from asyncrl.model.loading import load_model

    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def tiny_loaded():
    """``tiny`` loaded by name, with its tokenizer (a ``LoadedModel``)."""
    from asyncrl.model.loading import load_model

    return load_model("tiny")


@pytest.fixture(scope="module")
def tiny_split():
    """``tiny`` without a tokenizer, as ``(loaded_model, graphdef, params)``."""
    from asyncrl.model.loading import load_model

    lm = load_model("tiny", with_tokenizer=False)
    graphdef, params = lm.split()
    return lm, graphdef, params


@pytest.fixture(scope="module")
def tiny_one_layer():
    """A one-layer tiny model as ``(graphdef, params)``: half the compile time of two layers,
    the same code paths (tests/trainer_fixtures.py)."""
    from tests.trainer_fixtures import tiny_model

    return tiny_model(layers=1)


@pytest.fixture
def workspace(tmp_path):
    """A directory that looks like the repository root to the documented relative paths (the docs'
    commands and examples run there: tests/test_doc_commands.py, tests/test_doc_examples.py)."""
    from tests.helpers import REPO_ROOT

    for name in ("configs", "scripts", "asyncrl", "workflows", "docs", "pyproject.toml", "setup.cfg"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    return tmp_path


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # After a test file's last test, its fixtures released: what is still alive (imports, JAX's
    # caches, compiled programs) stays to the end of the session. Frozen, it is out of the
    # collector's generations, so each later full collection no longer walks it again: those
    # walks grow with the session and were a tenth of the suite's time.
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.freeze()


def pytest_unconfigure(config):

    # The interpreter's last garbage collection walks every object the run made (over a million):
    # tens of seconds after the summary, for nothing. Frozen objects are skipped.
    gc.freeze()
