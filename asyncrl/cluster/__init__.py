"""Where the trainer and the engine run: device placement, JAX's multi-process runtime and its
watchdog, what differs by process in a multi-process run, and ``asyncrl launch``."""
