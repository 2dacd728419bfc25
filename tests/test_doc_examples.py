"""Every Python example the docs show runs here, as written, on the config it names.

The examples are the fenced ```python blocks of README.md and docs/*.md. ``EXAMPLES`` says what
runs each one, and ``test_every_python_example_is_run`` fails on a block it does not account for
(and on an entry whose block is gone). An example is one of:

- a module the docs have you save ("Saved as `mypkg/workflows.py` ..." or "Added to ..." after
  the block): written under that name into a scratch directory that looks like the repository
  root, then trained by the documented commands that follow it (``EXAMPLE_CHAINS``, shortened to
  seconds on the `tiny` model like tests/test_doc_commands.py's chains, which also run them);
- a program: run as written in that directory;
- an excerpt of a larger program (a loop, a method body): run with the names it takes from the
  text around it bound to real objects built from the config the docs name.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT
from tests.test_doc_commands import QUICKSTART_QUICK, Step, run_chain

DOCS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")))

SAVED = re.compile(r"\A\s*(Saved as|Added to) `([\w/]+\.py)`")
"""The sentence after a block that says which file it goes in: saved (a new file) or added to one."""


def python_blocks(root: Path = REPO_ROOT) -> list[tuple[str, str, str]]:
    """``(file:line, code, the text after the block up to the next fence)`` of every ```python block."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for fence in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```\n?", text, re.S | re.M):
            if fence.group(1) != "python":
                continue
            after = text[fence.end():].split("```", 1)[0]
            found.append((f"{path.relative_to(root)}:{text.count(chr(10), 0, fence.start()) + 1}", fence.group(2), after))
    return found


def python_block(doc: str, marker: str) -> str:
    """The one block of ``doc`` (a path under the repository) that contains ``marker``."""
    (code,) = [code for where, code, _ in python_blocks() if where.startswith(doc + ":") and marker in code]
    return code


def saved_modules(workspace_dir: Path, path: str) -> Path:
    """Write every block the docs save as (or add to) ``path`` into ``workspace_dir``, in the docs' order."""
    blocks = [(m.group(1), code) for _, code, after in python_blocks() if (m := SAVED.match(after)) and m.group(2) == path]
    assert blocks and blocks[0][0] == "Saved as", f"no block is saved as {path} (an 'Added to' needs one first)"
    target = workspace_dir / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n\n".join(code for _, code in blocks))
    return target


def _saves(path: str):
    """A chain step's ``prepare``: the docs' blocks of ``path`` written into the workspace, and any
    module of that package a previous test imported forgotten, so the new file is the one imported."""
    package = path.split("/")[0]

    def prepare(ws: Path) -> None:
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]
        saved_modules(ws, path)
    return prepare


CHECK_AGAIN = ("asyncrl train configs/quickstart.yaml --set run.name=check-again --set "
               "workflow=mypkg.workflows:CheckAgainWorkflow --set rollout.max_seq_len=48 --set engine.kv_capacity=48")
SOLVE = "asyncrl train configs/quickstart.yaml --set run.name=solve --set 'workflow={target: mypkg.agents:Solve, kwargs: {turn_discount: 0.9}}'"
FRAMEWORK_AGENT = ("asyncrl train configs/quickstart.yaml --set run.name=framework-agent --set "
                   "'workflow={target: mypkg.agents:FrameworkAgent, kwargs: {http: true}}'")

EXAMPLE_CHAINS: dict[str, tuple[Step, ...]] = {
    # docs/workflows.md: the two-turn CheckAgainWorkflow on the quickstart's task.
    "workflow_example": (Step(CHECK_AGAIN, QUICKSTART_QUICK, prepare=_saves("mypkg/workflows.py")),),
    # docs/agents.md: the two agents written with the OpenAI SDK, in-process and over HTTP.
    "agent_examples": (Step(SOLVE, QUICKSTART_QUICK, prepare=_saves("mypkg/agents.py")),
                       Step(FRAMEWORK_AGENT, QUICKSTART_QUICK, prepare=_saves("mypkg/agents.py"))),
}
"""Documented commands that train a module the docs have you save (tests/test_doc_commands.py
counts them as run)."""

ITEM_TRIE = Step("python scripts/make_item_trie.py --out runs/recommend/items.txt")
EXAMPLE_CHAINS["constrained_workflow"] = (  # docs/decoding.md: a workflow of one's own under the config's trie
    ITEM_TRIE,
    Step("asyncrl train configs/recommend.yaml --set run.name=recommend-own --set workflow=mypkg.recommend:ConstrainedWorkflow",
         QUICKSTART_QUICK, prepare=_saves("mypkg/recommend.py")),
)

SLOW_EXAMPLE_CHAINS = {"agent_examples", "constrained_workflow", "workflow_example"}
"""Runs of tens of seconds here (the HTTP agent's episodes each build a client; the trie's
programs compile; the multi-turn workflow trains its SFT and RL stages): run by name or with --runslow."""

def _example_params():
    for name, chain in EXAMPLE_CHAINS.items():
        marks = [pytest.mark.timeout(600)]
        if name in SLOW_EXAMPLE_CHAINS:
            marks.append(pytest.mark.slow)
        yield pytest.param(name, chain, id=name, marks=marks)


@pytest.mark.parametrize("name,chain", list(_example_params()))
def test_saved_examples_train(name, chain, workspace, monkeypatch, capsys, caplog):
    """A module the docs have you save trains with the documented command, and nothing it does
    logs an error (an unclosed client, a task that failed unseen)."""
    run_chain(chain, workspace, monkeypatch, capsys)
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, errors


# ----------------------------------------------------------------------------- programs and excerpts


def test_sft_python_api_runs_as_written(workspace, monkeypatch):
    """docs/sft.md "Python API": the quickstart's SFT stage trained by hand, then its held-out loss."""
    namespace = _run_program(python_block("docs/sft.md", "SFTData.for_task"), workspace, monkeypatch)
    assert namespace["state"]["position"] == 20 * namespace["cfg"].sft.batch_size  # the stage's 20 steps
    assert 0 < namespace["metrics"]["eval/loss"] < 3.2 and namespace["metrics"]["eval/loss_tokens"] > 0  # below uniform


def test_trie_constructors_run_as_written(workspace, monkeypatch):
    """docs/decoding.md "Trie constraints": the three ways to build a trie, the file from make_item_trie.py."""
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "argv", ITEM_TRIE.command.split()[1:])
    runpy.run_path(str(REPO_ROOT / "scripts" / "make_item_trie.py"), run_name="__main__")
    code = python_block("docs/decoding.md", "TokenTrie.from_file")
    namespace = _run_program(code, workspace, monkeypatch)
    assert namespace["trie"].num_sequences == 2 and namespace["trie"].max_depth == 4


@pytest.mark.slow  # the trace of seven steps: about 230 MB, and 40 s to write here
def test_profiler_example_runs_as_written(workspace, monkeypatch):
    """docs/performance.md "Profiling": a shortened quickstart under jax.profiler, then its Perfetto trace."""
    code = python_block("docs/performance.md", "jax.profiler.trace").replace("/tmp/asyncrl-trace", str(workspace / "trace"))
    _run_program(code, workspace, monkeypatch)
    assert list((workspace / "trace" / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
    assert (workspace / "runs" / "quickstart-trace" / "hf" / "config.json").is_file()


def test_own_loop_checkpoints_and_resumes(workspace, monkeypatch):
    """docs/checkpoints.md "For code that builds its own loop": run once, saving when due, then
    again with resume on: the second run finds the first one's last checkpoint and reads its trees
    and rollout state back."""
    import numpy as np
    import optax

    from asyncrl.config import load_config
    from asyncrl.engine.fake import FakeEngine
    from asyncrl.model import load_model
    from asyncrl.rollout.executor import WorkflowExecutor
    from tests.rollout_fakes import TokenWorkflow

    monkeypatch.chdir(workspace)
    code = python_block("docs/checkpoints.md", "ShutdownGuard() as guard")
    _, params = load_model("tiny", with_tokenizer=False).split()
    samples = [{"prompt": str(i), "answer": str(i), "sample_id": i} for i in range(8)]
    saved = None
    for resume, (start, total) in (("never", (0, 4)), ("auto", (4, 6))):
        cfg = load_config("configs/quickstart.yaml", ["run.output_dir=runs/own-loop", "checkpoint.every_steps=2",
                                                      f"checkpoint.resume={resume}"])
        executor = WorkflowExecutor(TokenWorkflow(cfg), FakeEngine(), samples, cfg)
        names = {"cfg": cfg, "params": params, "opt_state": optax.adamw(1e-3).init(params), "executor": executor,
                 "engine": _Engine(), "start": start, "total": total, "stage_index": 0}
        exec(compile(code, "docs/checkpoints.md", "exec"), names)
        saved = saved or names
    assert names["resumed"] is not None and names["resumed"].step == 4 and saved["resumed"] is None
    assert names["engine"].stopped and names["guard"].requested is False
    restored, original = names["params"], saved["params"]
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(restored), _leaves(original)))
    steps = sorted(p.name for p in (workspace / "runs" / "own-loop" / "checkpoints").iterdir())
    assert steps == ["step_00000002", "step_00000004", "step_00000006"], steps


class _Engine:
    """The engine of a loop of one's own, as far as the excerpt uses it (JaxEngine and RemoteEngine stop alike)."""

    stopped = False

    def shutdown(self) -> None:
        self.stopped = True


def _leaves(tree) -> list:
    import jax
    import numpy as np

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def _run_program(code: str, ws: Path, monkeypatch) -> dict:
    """``code`` saved in the workspace and run there as ``python example.py`` would (in this
    interpreter, which has imported what it needs already); returns its globals."""
    monkeypatch.chdir(ws)
    path = ws / "example.py"
    path.write_text(code)
    return runpy.run_path(str(path), run_name="__main__")


# ----------------------------------------------------------------------------- the accounting

EXAMPLES: dict[tuple[str, str], str] = {
    ("docs/workflows.md", "class CheckAgainWorkflow("): "chain workflow_example",
    ("docs/agents.md", "class Solve("): "chain agent_examples",
    ("docs/agents.md", "class FrameworkAgent("): "chain agent_examples",
    ("docs/decoding.md", "class ConstrainedWorkflow("): "chain constrained_workflow",
    ("docs/decoding.md", "TokenTrie.from_file"): "test_trie_constructors_run_as_written",
    ("docs/sft.md", "SFTData.for_task"): "test_sft_python_api_runs_as_written",
    ("docs/performance.md", "jax.profiler.trace"): "test_profiler_example_runs_as_written",
    ("docs/checkpoints.md", "ShutdownGuard() as guard"): "test_own_loop_checkpoints_and_resumes",
    ("docs/workflows.md", "executor.next_batch(v"): "tests/run/test_first_run.py::test_docs_yaml_and_loop_examples_run",
    ("docs/lora.md", "PeftModel.from_pretrained"): "tests/test_doc_commands.py chain lora",
}
"""Each Python block of the docs (its file and a line of it) -> what runs it: a chain of
``EXAMPLE_CHAINS``, a test of this file, or a test elsewhere."""


def test_every_python_example_is_run():
    blocks = python_blocks()
    assert len(blocks) >= len(EXAMPLES) > 5, "hardly any Python block found: the reader is stale"
    for where, code, after in blocks:
        matched = [key for key in EXAMPLES if where.startswith(key[0] + ":") and key[1] in code]
        assert len(matched) == 1, f"{where}: a Python example that {'no' if not matched else 'more than one'} entry of " \
                                  f"EXAMPLES names (add how it runs to tests/test_doc_examples.py)"
        saved = SAVED.match(after)
        assert (saved is not None) == EXAMPLES[matched[0]].startswith("chain "), \
            f"{where}: a module the docs save is trained by a chain of EXAMPLE_CHAINS, and only those"
    for (doc, marker), runner in EXAMPLES.items():
        assert any(where.startswith(doc + ":") and marker in code for where, code, _ in blocks), \
            f"{doc} no longer shows the example with {marker!r}: remove it from EXAMPLES"
        if runner.startswith("chain ") and "test_doc_commands" not in runner:
            assert runner.split()[1] in EXAMPLE_CHAINS, runner
        elif runner.startswith("tests/"):
            path, _, name = runner.replace(" chain ", "::").partition("::")
            assert re.search(rf"def {name}\b|\"{name}\": ", (REPO_ROOT / path).read_text()), runner
        else:
            assert callable(globals().get(runner)), runner


def test_the_reader_finds_python_blocks_and_their_files(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```python\nprint(1)\n```\n")
    (tmp_path / "docs" / "x.md").write_text("Text.\n\n```python\nclass A: ...\n```\n\nSaved as `pkg/a.py`, it runs:\n\n"
                                            "```bash\nasyncrl train a.yaml\n```\n\n```yaml\nk: v\n```\n")
    found = python_blocks(tmp_path)
    assert [(where, code) for where, code, _ in found] == [("README.md:1", "print(1)\n"), ("docs/x.md:3", "class A: ...\n")]
    assert SAVED.match(found[1][2]).groups() == ("Saved as", "pkg/a.py") and SAVED.match(found[0][2]) is None
