"""Ready workflows, tasks and reward functions for asyncrl.

Importing this package registers its components (datasets ``copy``, ``reverse``,
``add``, ``gsm8k``, ``next_item``, ``calculator_agent_demos``; rewards ``positional_match``, ``exact_match``, ``gsm8k_answer``,
``gsm8k_correct``, ``gsm8k_format``; workflows ``multi_turn``, ``calculator_agent``).
asyncrl's registry imports it lazily on the first resolve of a workflow, reward or
dataset.
"""

from . import calculator_agent, gsm8k, multi_turn, recommend, synthetic  # noqa: F401  (registration side effects; relative, so it also loads under a private name)
