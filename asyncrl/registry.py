"""Components by name: workflows, reward functions, datasets/tasks, engines, estimators.

A spec is one of
  * a registered alias, e.g. ``gsm8k``;
  * an import path ``pkg.module:Symbol`` (``Symbol`` may be dotted, ``Class.method``);
  * a mapping ``{target: <alias or import path>, kwargs: {...}}``, whose kwargs are
    bound to the component.

Built-ins register themselves with :func:`register` when their module is imported;
those modules are imported lazily, on the first :func:`resolve` of their kind, so
adding a component never means editing a central factory and importing asyncrl
stays cheap. The bundled ``workflows`` package is found by its location next to
``asyncrl`` (:func:`_import_bundled_workflows`), so a user's own top-level package
called ``workflows`` never hides the built-in tasks.

Import paths are imported as given; ``asyncrl train`` and ``asyncrl eval`` put the
current working directory first on ``sys.path`` (as ``python -m`` does), so a module
next to where the command runs is found. A failed import is a :class:`ConfigError`
naming the config field and the underlying error (``No module named ...``).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from asyncrl.errors import ConfigError

KINDS = ("workflow", "reward", "dataset", "engine", "estimator")

# Modules whose import registers the built-ins of each kind. Each entry is imported
# once, on the first resolve of that kind; a module missing here is simply skipped
# (the package may be installed without it), any other import error propagates.
# BUNDLED_WORKFLOWS is asyncrl's own ``workflows`` folder, imported by location.
BUNDLED_WORKFLOWS = "<bundled workflows>"
PRIVATE_WORKFLOWS_NAME = "asyncrl_bundled_workflows"
"""The module name the bundled ``workflows`` package gets when a user's ``workflows`` shadows it."""
BUILTIN_MODULES: dict[str, list[str]] = {
    "workflow": ["asyncrl.rollout.workflow", BUNDLED_WORKFLOWS],
    "reward": [BUNDLED_WORKFLOWS],
    "dataset": ["asyncrl.data", BUNDLED_WORKFLOWS],
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
        module = _import_user_module(module_name, target, where)
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


def _import_user_module(module_name: str, target: str, where: str) -> Any:
    """Import the module of an import path; any failure is a ConfigError naming ``where`` and the cause."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise ConfigError(
                f"{where}: cannot import module '{module_name}' (from '{target}'): {err}. Modules are looked up in the "
                f"current directory ({os.getcwd()}) and on PYTHONPATH: run asyncrl from the directory that holds "
                f"'{module_name.split('.')[0]}', or add that directory to PYTHONPATH"
            ) from None
        raise ConfigError(f"{where}: importing '{module_name}' (from '{target}') failed: {err}{_where_raised(err)}") from None
    except Exception as err:  # noqa: BLE001 - a user module's own error, shown with its location
        raise ConfigError(
            f"{where}: importing '{module_name}' (from '{target}') failed: {type(err).__name__}: {err}{_where_raised(err)}"
        ) from None


def _where_raised(err: BaseException) -> str:
    all_frames = traceback.extract_tb(err.__traceback__)
    frames = [f for f in all_frames if "importlib" not in f.filename] or list(all_frames)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_bundled_workflows() -> None:
    """Import asyncrl's own ``workflows`` package (the folder next to ``asyncrl``).

    As ``workflows`` when that name finds this folder (the usual case); under
    :data:`PRIVATE_WORKFLOWS_NAME` when a user's own ``workflows`` package comes first on
    ``sys.path``, so the built-in tasks and rewards resolve whatever the user's packages are called.
    """
    init = (Path(__file__).resolve().parent.parent / "workflows" / "__init__.py")
    if not init.is_file():
        return  # installed without the bundled workflows
    loaded = sys.modules.get("workflows")
    if loaded is not None and _same_file(getattr(loaded, "__file__", None), init):
        return
    if loaded is None:
        spec = importlib.util.find_spec("workflows")
        if spec is not None and _same_file(spec.origin, init):
            importlib.import_module("workflows")
            return
    if PRIVATE_WORKFLOWS_NAME in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(PRIVATE_WORKFLOWS_NAME, init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load asyncrl's bundled workflows from {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_WORKFLOWS_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[PRIVATE_WORKFLOWS_NAME]
        raise


def _same_file(path: Any, other: Path) -> bool:
    return bool(path) and Path(path).resolve() == other


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
                if module_name == BUNDLED_WORKFLOWS:
                    _import_bundled_workflows()
                else:
                    importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                if err.name is None or not module_name.startswith(err.name):
                    raise
            _loaded.add(module_name)


def _qualname(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"partial({_qualname(obj.func)}, {obj.args!r}, {sorted(obj.keywords.items())!r})"
    module = getattr(obj, "__module__", None) or "?"
    if module == PRIVATE_WORKFLOWS_NAME or module.startswith(PRIVATE_WORKFLOWS_NAME + "."):
        # The bundled package loaded under its private name is the same code as `workflows`.
        module = "workflows" + module[len(PRIVATE_WORKFLOWS_NAME):]
    return f"{module}.{getattr(obj, '__qualname__', repr(obj))}"
