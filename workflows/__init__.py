"""Ready workflows, tasks and reward functions for asyncrl.

Importing this package registers its components (aliases such as ``gsm8k``); asyncrl's
registry imports it lazily on the first resolve of a workflow, reward or dataset.
"""
