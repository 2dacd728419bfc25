"""Components by name: workflows, reward functions, datasets/tasks, engines, estimators.

A spec is one of
  * a registered alias, e.g. ``gsm8k``;
  * an import path ``pkg.module:Symbol`` (``Symbol`` may be dotted, ``Class.method``);
  * a mapping ``{target: <alias or import path>, kwargs: {...}}``, whose kwargs are
    bound to the component.

Built-ins register themselves with :func:`register` when their module is imported;
those modules are imported lazily, on the first :func:`resolve` of their kind, so
adding a component never means editing a central factory and importing asyncrl
stays cheap.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import threading
from typing import Any, Callable, Mapping

from asyncrl.errors import ConfigError

KINDS = ("workflow", "reward", "dataset", "engine", "estimator")

# Modules whose import registers the built-ins of each kind. Each entry is imported
# once, on the first resolve of that kind; a module missing here is simply skipped
# (the package may be installed without it), any other import error propagates.
BUILTIN_MODULES: dict[str, list[str]] = {
    "workflow": ["asyncrl.rollout.workflow", "workflows"],
    "reward": ["workflows"],
    "dataset": ["asyncrl.data", "workflows"],
    "engine": ["asyncrl.engine", "asyncrl.engine.jax_engine"],
    "estimator": ["asyncrl.algo"],
}

_registry: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_loaded: set[str] = set()
_lock = threading.RLock()


def register(kind: str, name: str | None = None) -> Callable[[Any], Any]:
    """Decorator: register a class or function under ``name`` (default: its ``__name__``)."""
    if kind not in _registry:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")

    def decorate(obj: Any) -> Any:
        alias = name or obj.__name__
        with _lock:
            existing = _registry[kind].get(alias)
            if existing is not None and existing is not obj and _qualname(existing) != _qualname(obj):
                raise ValueError(f"{kind} alias {alias!r} is already registered to {_qualname(existing)}")
            _registry[kind][alias] = obj
        return obj

    return decorate


def registered(kind: str) -> dict[str, Any]:
    """The built-in and user-registered components of ``kind`` (imports the built-ins)."""
    _load_builtins(kind)
    with _lock:
        return dict(_registry[kind])


def resolve(kind: str, spec: Any, where: str | None = None) -> Any:
    """The component a spec names. With kwargs, a ``functools.partial`` binding them.

    ``where`` is the config path of the spec (e.g. ``workflow`` or ``rewards.0``); every
    error names it.
    """
    where = where or kind
    target, kwargs = _split_spec(spec, where)
    obj = _lookup(kind, target, where)
    if not kwargs:
        return obj
    _check_kwargs(obj, kwargs, where)
    return functools.partial(obj, **kwargs)


def _split_spec(spec: Any, where: str) -> tuple[str, dict]:
    if isinstance(spec, str):
        if not spec.strip():
            raise ConfigError(f"{where}: empty component spec")
        return spec.strip(), {}
    if hasattr(spec, "target") and hasattr(spec, "kwargs"):  # config.ComponentRef
        return spec.target, dict(spec.kwargs)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"target", "kwargs"}
        if "target" not in spec or unknown:
            raise ConfigError(f"{where}: a component mapping has keys 'target' and optional 'kwargs' (given {sorted(spec)})")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ConfigError(f"{where}.kwargs: must be a mapping (given {kwargs!r})")
        return str(spec["target"]), dict(kwargs)
    raise ConfigError(f"{where}: a component spec is an alias, 'pkg.module:Symbol' or {{target, kwargs}} (given {spec!r})")


def _lookup(kind: str, target: str, where: str) -> Any:
    if ":" in target:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                raise ConfigError(f"{where}: cannot import module '{module_name}' (from '{target}')") from None
            raise
        obj: Any = module
        for piece in attr.split("."):
            if not hasattr(obj, piece):
                raise ConfigError(f"{where}: module '{module_name}' has no attribute '{attr}' (from '{target}')")
            obj = getattr(obj, piece)
        return obj
    _load_builtins(kind)
    with _lock:
        known = _registry[kind]
        if target in known:
            return known[target]
        names = sorted(known)
    close = difflib.get_close_matches(target, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    listing = ", ".join(names) if names else "none registered"
    raise ConfigError(
        f"{where}: unknown {kind} '{target}'{hint} Known {kind}s: {listing}; "
        "or give an import path 'pkg.module:Symbol'"
    )


def _check_kwargs(obj: Any, kwargs: dict, where: str) -> None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call itself complain
    try:
        signature.bind_partial(**kwargs)
    except TypeError as err:
        accepted = [
            p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        raise ConfigError(
            f"{where}.kwargs: {err} for {_qualname(obj)}; it accepts: {', '.join(accepted) or 'no keyword arguments'}"
        ) from None


def _load_builtins(kind: str) -> None:
    for module_name in BUILTIN_MODULES.get(kind, []):
        if module_name in _loaded:
            continue
        with _lock:
            if module_name in _loaded:
                continue
            try:
                importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                if err.name is None or not module_name.startswith(err.name):
                    raise
            _loaded.add(module_name)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
