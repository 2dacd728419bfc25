"""What a GPU runs for one decode chunk, read from XLA's thunk sequence dump.

XLA:GPU turns a compiled program into a sequence of thunks: kernels (``kCustomKernel``,
``kKernel``, library GEMMs, copies) and structure around them (``kCommandBuffer``: thunks
recorded once as a CUDA graph and replayed with one launch; ``kWhile`` with its ``condition:`` and
``body:``; ``kConditional``). With ``--xla_dump_to=DIR`` it writes the sequence as text,
``DIR/*.thunk_sequence_after_thunk_passes.txt``, one thunk a line, nested by indentation::

    011: kWhile         [prev=000 (1) | sink        ]
    condition:
        012: kCustomKernel [source       | next=013 (1)] input_reduce_fusion grid: ...
      body:
        000: kCommandBuffer [source | sink]
            014: kCustomKernel [source       | next=017 (3)  ] input_reduce_fusion_54 grid: ...

:func:`parse_thunks` reads that text (a pure function of it) into :class:`Thunk` s, and
:func:`decode_structure` counts what matters for a decode chunk (one ``lax.while_loop`` over
decode steps): the kernels one step launches, split into those of each decoder layer (the period with which
the body's kernel sequence repeats, :func:`layer_period`) and the rest; whether
they run inside command buffers; how many steps one loop iteration holds (2 when XLA unrolled
the loop once); and the host round trips per generated token: a ``while`` outside a command
buffer is driven by the host, which runs the condition's kernels, copies the predicate back and
launches the next iteration (one round trip per iteration); inside a command buffer (a CUDA
graph conditional node) the device loops by itself (none per token).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional

STRUCTURE_KINDS = frozenset({"kCommandBuffer", "kWhile", "kConditional", "kSequential"})
"""Thunks that hold others; every other thunk is one launch on the device (a kernel, a library
call such as a cuBLAS GEMM, a copy or a memset), counted as a kernel here."""

_THUNK = re.compile(r"^(?P<indent>\s*)(?P<index>\d+):\s+(?P<kind>k\w+)\s*(?:\[[^\]]*\])?\s*(?P<name>\S*)")
_SECTION = re.compile(r"^\s*(?P<section>condition|body|branch\s*\d*|branches)\s*:\s*$")


@dataclasses.dataclass(frozen=True)
class Thunk:
    """One line of the dump: its kind, its name (the fusion or kernel; empty for structure),
    and where it sits: ``path`` the kinds of the thunks around it, outermost first, each with
    the section it is in (``kWhile/body``, ``kCommandBuffer``)."""

    kind: str
    name: str
    path: tuple[str, ...]

    @property
    def is_kernel(self) -> bool:
        return self.kind not in STRUCTURE_KINDS

    @property
    def in_command_buffer(self) -> bool:
        return any(p.startswith("kCommandBuffer") for p in self.path)

    @property
    def in_while_body(self) -> bool:
        return any(p == "kWhile/body" for p in self.path)

    @property
    def in_while_condition(self) -> bool:
        return any(p == "kWhile/condition" for p in self.path)


def parse_thunks(text: str) -> list[Thunk]:
    """The thunks of a ``*thunk_sequence*.txt`` dump in order, each with the structure around it
    (by indentation; a ``condition:`` / ``body:`` line opens that section of the innermost
    ``kWhile`` still open)."""
    out: list[Thunk] = []
    stack: list[tuple[int, str]] = []  # (indent, kind or kind/section) of the open structure thunks
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section is not None:
            for i in range(len(stack) - 1, -1, -1):
                indent, label = stack[i]
                if label.split("/")[0] in ("kWhile", "kConditional"):
                    stack[i] = (indent, label.split("/")[0] + "/" + section.group("section").split()[0])
                    del stack[i + 1:]
                    break
            continue
        found = _THUNK.match(line)
        if found is None:
            continue
        indent = len(found.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kind = found.group("kind")
        out.append(Thunk(kind, found.group("name") if kind not in STRUCTURE_KINDS else "", tuple(label for _, label in stack)))
        if kind in STRUCTURE_KINDS:
            stack.append((indent, kind))
    return out


@dataclasses.dataclass(frozen=True)
class DecodeStructure:
    """What one decode chunk's loop launches (:func:`decode_structure`)."""

    kernels_per_step: int
    kernels_per_layer: int
    kernels_outside_layers: int
    """Per step: the embedding, final norm, lm head, sampling and the loop's bookkeeping."""
    steps_per_iteration: int
    body_in_command_buffer: bool
    """Every kernel of the loop body runs inside a command buffer (one launch per iteration)."""
    while_in_command_buffer: bool
    """The ``while`` itself is inside a command buffer: the device loops without the host."""
    condition_kernels: int
    kernels_outside_loop: int
    """Run once per chunk: before and after the loop."""
    host_round_trips_per_token: float

    def summary(self) -> str:
        """One line for ``asyncrl plan --target``."""
        where = ("the whole loop in a command buffer" if self.while_in_command_buffer else
                 ("the loop body in one command buffer, the while driven by the host" if self.body_in_command_buffer
                  else "kernels launched one by one"))
        return (f"{self.kernels_per_step} kernels per decode step ({self.kernels_per_layer} per layer + "
                f"{self.kernels_outside_layers} outside the layers), {self.steps_per_iteration} step(s) per loop iteration, "
                f"{where} ({self.condition_kernels} condition kernels), {self.host_round_trips_per_token:g} host round "
                f"trip(s) per generated token, {self.kernels_outside_loop} kernels once per chunk")


def layer_period(names: list[str], num_layers: int, max_period: Optional[int] = None) -> int:
    """The kernels one decoder layer launches, from the order of a decode step's kernels: the
    layers run one after another, so the sequence of kernel kinds (names without XLA's numeric
    suffixes: ``gemm_fusion_dot_144`` -> ``gemm_fusion_dot``) repeats with the layer's kernel
    count as its period over ``num_layers`` blocks. The period is the shift at which the most
    kernels equal the one that many places later (XLA may fuse a layer's first or last kernel
    into its neighbour, or schedule a few out of order: the count tolerates that). 0 when the
    sequence is too short to hold ``num_layers`` blocks of two. ``max_period``: the longest
    period considered (default ``len(names) // num_layers``; with several steps per loop
    iteration, one step's kernels over ``num_layers``, so that the steps' own period is not
    taken for a layer's)."""
    kinds = [re.sub(r"(_\d+)+$", "", name) for name in names]
    best, period = 0, 0
    longest = len(kinds) // max(num_layers, 1) if max_period is None else max_period
    for shift in range(2, longest + 1):
        matches = sum(a == b for a, b in zip(kinds, kinds[shift:]))
        if matches > best:
            best, period = matches, shift
    return period


def decode_structure(text: str, num_layers: int) -> Optional[DecodeStructure]:
    """The :class:`DecodeStructure` of a decode chunk's thunk sequence dump ``text`` for a model of
    ``num_layers`` decoder layers; None when the dump has no ``while`` loop (not a decode chunk).

    Per layer: :func:`layer_period` of the body's kernels (XLA may move a step's independent
    kernels ahead of the others, so steps are not cut apart); steps per iteration: how many times per
    layer the layers' kernels occur (2 when XLA unrolled the loop, ``engine.decode_inner_steps``
    when the engine did)."""
    thunks = parse_thunks(text)
    loops = [t for t in thunks if t.kind == "kWhile"]
    if not loops:
        return None
    body = [t for t in thunks if t.is_kernel and t.in_while_body]
    layers = max(num_layers, 1)
    # A layer's kernels are launched layers x steps times each (XLA reuses one compiled kernel for
    # identical fusions); the count that covers the most launches is theirs. Counting names alone
    # would pick the most frequent count, which with few layers and several steps per iteration is
    # some pair of kernels outside the layers.
    launches: collections.Counter[int] = collections.Counter()
    for count in collections.Counter(t.name for t in body).values():
        launches[count] += count
    layer_count = max(launches, key=lambda c: (launches[c], c)) if launches else 1
    steps = max(round(layer_count / layers), 1)
    per_step = len(body) // steps
    per_layer = layer_period([t.name for t in body], layers, max_period=per_step // layers)
    loop_in_buffer = loops[0].in_command_buffer
    return DecodeStructure(
        kernels_per_step=per_step,
        kernels_per_layer=per_layer,
        kernels_outside_layers=per_step - per_layer * layers,
        steps_per_iteration=steps,
        body_in_command_buffer=bool(body) and all(t.in_command_buffer for t in body),
        while_in_command_buffer=loop_in_buffer,
        condition_kernels=sum(t.is_kernel and t.in_while_condition for t in thunks),
        kernels_outside_loop=sum(t.is_kernel and not t.in_while_body and not t.in_while_condition for t in thunks),
        host_round_trips_per_token=0.0 if loop_in_buffer else 1.0 / steps,
    )
