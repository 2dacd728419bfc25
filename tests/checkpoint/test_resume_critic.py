"""Resume of a PPO-with-critic run (``algo.estimator: gae``) is bitwise exact in synchronous mode,
critic included; the run exports its critic as ``hf_critic/`` beside ``hf/``."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from asyncrl.checkpoint import checkpoint_problems, checkpoints_root, load_checkpoint, step_dir_name
from tests.checkpoint.test_resume import (
    PROCESS_WIDE,
    assert_rows_equal,
    assert_saved_at_publish,
    read_rows,
    run_in_process,
    write_config,
)

GAE = {"algo": {"estimator": "gae", "kl_coef": 0.0, "reward_kl_coef": 0.05, "lam": 0.9},
       "critic": {"optim": {"lr": 0.003}}}


@pytest.mark.slow  # two 4-step runs: ~110 s on a loaded 2-core machine
def test_critic_run_resumes_bitwise_and_exports_its_critic(tmp_path):
    out = tmp_path / "critic-run"
    config = write_config(tmp_path, out, **GAE)
    run_in_process(config)
    want = read_rows(out)
    assert len(want) == 4 and {"loss/value", "train/explained_variance", "train/return_mean"} <= set(want[0])
    assert len({row["loss/value"] for row in want}) > 1  # the critic trains
    final = load_checkpoint(checkpoints_root(out) / step_dir_name(4))
    assert {"critic_params", "critic_opt_state"} <= set(final.arrays)
    assert (out / "hf_critic" / "config.json").is_file() and (out / "hf" / "config.json").is_file()
    saved_head = final.arrays["critic_params"]["value_head/kernel"].copy()

    # Lose the last checkpoint and the exports: the resume continues from step 2 and must
    # reproduce steps 3 and 4 to the bit (losses, value metrics, rewards), and the same critic.
    shutil.rmtree(checkpoints_root(out) / step_dir_name(4))
    shutil.rmtree(out / "hf")
    shutil.rmtree(out / "hf_critic")
    assert_saved_at_publish(load_checkpoint(checkpoints_root(out) / step_dir_name(2)))
    run_in_process(config, "checkpoint.resume=auto")
    assert_rows_equal(read_rows(out), want, also=frozenset(PROCESS_WIDE))
    again = load_checkpoint(checkpoints_root(out) / step_dir_name(4))
    assert not checkpoint_problems(again.path)
    np.testing.assert_array_equal(again.arrays["critic_params"]["value_head/kernel"], saved_head)
    for name in ("critic_params", "critic_opt_state"):
        for key, value in final.arrays[name].items():
            np.testing.assert_array_equal(again.arrays[name][key], value, err_msg=f"{name}/{key}")
    assert (out / "hf_critic" / "config.json").is_file()
