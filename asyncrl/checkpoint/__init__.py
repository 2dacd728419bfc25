"""The checkpoint layer: atomic, sharded, asynchronous, verified, pickle-free trainer checkpoints.

:mod:`~asyncrl.checkpoint.store` writes whole checkpoints (its guarantees are in its docstring
and docs/checkpoints.md), :mod:`~asyncrl.checkpoint.layout` their directory layout and what makes
one complete, :mod:`~asyncrl.checkpoint.load` the verified load and resume, :mod:`~asyncrl.checkpoint.arrays`
the array trees on Orbax (each process its own shards), :mod:`~asyncrl.checkpoint.files`
the rollout state's JSON and npz files, :mod:`~asyncrl.checkpoint.convert` format-2 checkpoints, :mod:`~asyncrl.checkpoint.schema` the schemas a load
validates and the config checks a resume runs. Nothing here knows the rollout executor or the loop.
"""

from asyncrl.checkpoint.layout import CHECKPOINT_FORMAT, checkpoint_problems, checkpoints_root, step_dir_name
from asyncrl.checkpoint.load import Checkpoint, latest_checkpoint, load_checkpoint, resume_checkpoint
from asyncrl.checkpoint.store import save_checkpoint, start_checkpoint

__all__ = [
    "CHECKPOINT_FORMAT", "Checkpoint", "checkpoint_problems", "checkpoints_root", "latest_checkpoint",
    "load_checkpoint", "resume_checkpoint", "save_checkpoint", "start_checkpoint", "step_dir_name",
]
