"""The asynchronous rollout core: trajectories, the staleness ledger, the queue, workflows,
the executor and prepare_batch. Imports no jax."""

from asyncrl.rollout.batch import BatchSource, PreparedBatch, prepare_batch
from asyncrl.rollout.executor import WorkflowExecutor
from asyncrl.rollout.ledger import StalenessLedger
from asyncrl.rollout.queue import QueueClosed, SimpleDataQueue
from asyncrl.rollout.rewards import RewardFunction
from asyncrl.rollout.trajectory import TrainBatch, Trajectory, TrajectoryBuilder, TrajectoryGroup
from asyncrl.rollout.workflow import RolloutWorkflow, SingleTurnWorkflow, SkipSample, build_workflow

__all__ = [
    "Trajectory", "TrajectoryGroup", "TrainBatch", "TrajectoryBuilder", "SimpleDataQueue", "QueueClosed",
    "StalenessLedger", "RolloutWorkflow", "SingleTurnWorkflow", "RewardFunction", "SkipSample", "build_workflow",
    "WorkflowExecutor", "prepare_batch", "PreparedBatch", "BatchSource",
]
