"""``asyncrl plan``: what a config needs on each device, before the hardware is rented.

* :mod:`~asyncrl.plan.formulas` (with :mod:`~asyncrl.plan.activations`): per-device memory from the run
  config and the model's ``config.json`` alone; the accounting ``engine.slots: auto`` and
  ``engine.tensor_parallel: auto`` size a run with (:mod:`asyncrl.run.auto_slots`);
* :mod:`~asyncrl.plan.programs`: the programs a config's stages compile, the one walk both
  ``--target`` and the run's remat choice take;
* :mod:`~asyncrl.plan.compiled`: the real jitted programs lowered on abstract arguments, and XLA's
  memory analysis of them;
* :mod:`~asyncrl.plan.auto`: ``model.remat_policy: auto`` from XLA's compiled peak;
* :mod:`~asyncrl.plan.targets` (the table ``target_specs/``), :mod:`~asyncrl.plan.target` and
  :mod:`~asyncrl.plan.thunk_sequence`: ``--target``, the programs compiled for a GPU or TPU topology
  on any machine, a GPU decode step's kernels read from XLA's thunk sequence;
* :mod:`~asyncrl.plan.command`: the command, its table and the changes that make a config fit.
"""
