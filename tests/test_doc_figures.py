"""The docs' figures are drawn by scripts from real runs: here the same scripts draw them from
one short run of the quickstart (the full-size figures come from the documented commands, run in
tests/test_doc_commands.py's chains ``staleness_sweep`` and ``placement_figure``)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import plot_metrics  # noqa: E402
import plot_placement  # noqa: E402
import staleness_sweep  # noqa: E402

FIGURES = {
    "docs/placement.png": "python scripts/plot_placement.py --make-runs runs/placement -o docs/placement.png",
    "docs/staleness_reward.png": "python scripts/staleness_sweep.py --staleness 0 1 2 --plot docs/staleness_reward.png",
}
"""Each figure the docs show -> the documented command that draws it."""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The quickstart (max_staleness 1) shortened as tests/test_doc_commands.py shortens it (so its
    programs are compiled already), into ``eta1/`` as scripts/staleness_sweep.py lays out its runs;
    returns the sweep's directory."""
    from asyncrl.config import load_config
    from asyncrl.run.loop import train
    from tests.test_doc_commands import QUICKSTART_QUICK

    out = tmp_path_factory.mktemp("sweep")
    shortened = [value for value in QUICKSTART_QUICK if value != "--set"]
    train(load_config(REPO_ROOT / "configs" / "quickstart.yaml", [*shortened, f"run.output_dir={out / 'eta1'}"]))
    return out


def test_reward_curves_by_staleness_from_a_real_run(small_run, tmp_path, capsys):
    """The run's training reward at each of its 3 RL steps and its evals (step 0, the SFT stage's end, step 5)."""
    png = tmp_path / "rewards.png"
    drawn = staleness_sweep.plot_rewards(small_run, [1], png)
    assert drawn == {"max_staleness 1": {"reward/mean": 3, "eval/reward": 3}}, drawn
    assert png.stat().st_size > 10_000


def test_plot_metrics_compares_runs_given_on_the_command_line(small_run, tmp_path, capsys):
    png, run = tmp_path / "compared.png", str(small_run / "eta1")
    capsys.readouterr()
    assert plot_metrics.main([run, run, "--labels", "first", "again", "-o", str(png)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed["runs"]) == {"first", "again"} and png.is_file()
    with pytest.raises(SystemExit):  # comparing needs an output file
        plot_metrics.main([run, run])


def test_placement_from_a_real_run(small_run, tmp_path, capsys):
    """One device: the trainer and the engine share it, as the run's provenance records."""
    png = tmp_path / "placement.png"
    capsys.readouterr()
    assert plot_placement.main([str(small_run / "eta1"), "--titles", "one device", "-o", str(png)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["runs"] == {"one device": {"0": {"trainer": 1, "engine": 1}}} and png.stat().st_size > 5_000
    recorded = json.loads((small_run / "eta1" / "provenance.json").read_text())["placement"]
    assert recorded["shares_trainer_arrays"] is True and recorded["trainer"] == recorded["engine"]


def test_placement_roles_per_host(tmp_path):
    """Two processes of four devices, each with an engine of its own as two replicas of two: each device's roles."""
    devices = [{"id": i + 2048 * p, "process": p} for p in (0, 1) for i in range(4)]
    placement = {"trainer": [d["id"] for d in devices], "trainer_mesh": {"data": 8, "fsdp": 1, "tensor": 1},
                 "engine": [d["id"] for d in devices], "engine_tensor_parallel": 2, "engine_replicas": 2, "engine_remote_servers": 0,
                 "shares_trainer_arrays": False}
    (tmp_path / "provenance.json").write_text(json.dumps({"devices": devices, "placement": placement}))
    layout = plot_placement.roles(tmp_path)
    assert [names for _, names in layout["hosts"][0]] == [["trainer", "engine"]] * 4
    assert [names for _, names in layout["hosts"][1]] == [["trainer", "engine"]] * 4
    assert plot_placement._replicas(layout) == {0: 0, 1: 0, 2: 1, 3: 1, 2048: 0, 2049: 0, 2050: 1, 2051: 1}
    assert plot_placement.describe(layout) == "trainer mesh data 8; an engine per host: 2 replica(s) x tensor-parallel 2"


def test_every_figure_is_shown_and_drawn_by_a_documented_command():
    """Each image the docs embed is a figure of ``FIGURES`` (the quickstart's curves: the README's
    own plot_metrics command), and each figure's command is in the docs."""
    from tests.test_doc_commands import documented_commands

    shown = set()
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        base = "docs/" if path.parent.name == "docs" else ""
        shown |= {base + image for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", path.read_text())}
    assert shown == {*FIGURES, "docs/quickstart_curves.png"}, shown
    documented = documented_commands()
    for figure, command in FIGURES.items():
        assert (REPO_ROOT / figure).is_file(), figure
        assert command in documented, f"{figure}: its command is not in the docs: {command}"
