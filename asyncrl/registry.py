"""Components by name: workflows, reward functions, datasets/tasks, engines, estimators.

A spec is one of
  * a registered alias, e.g. ``gsm8k``;
  * an import path ``pkg.module:Symbol`` (``Symbol`` may be dotted, ``Class.method``);
  * a mapping ``{target: <alias or import path>, kwargs: {...}}``, whose kwargs are
    bound to the component.

Components register themselves with :func:`register` when their module is imported. The
registry knows no module by name: the modules to import are the entry points of the group
:data:`ENTRY_POINT_GROUP` (``asyncrl.components``) in the installed packages' metadata, each
named ``<kind>.<label>`` and imported on the first :func:`resolve` of that kind. asyncrl lists
its own built-ins there (setup.cfg), the bundled ``workflows`` package among them, and a
third-party package adds components the same way::

    [options.entry_points]
    asyncrl.components =
        reward.mine = mypkg.rewards

so adding a component never means editing a central factory, and importing asyncrl stays cheap.
A user's own top-level package called ``workflows`` (first on ``sys.path`` when ``asyncrl
train`` runs beside it) does not hide the bundled one: that is loaded from beside ``asyncrl``
under a private name instead (:func:`_import_own_module`).

Import paths are imported as given; ``asyncrl train`` and ``asyncrl eval`` put the
current working directory first on ``sys.path`` (as ``python -m`` does), so a module
next to where the command runs is found. A failed import is a :class:`ConfigError`
naming the config field and the underlying error (``No module named ...``).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
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

ENTRY_POINT_GROUP = "asyncrl.components"
"""The entry-point group naming the modules whose import registers components (``<kind>.<label> = module``)."""
OWN_DISTRIBUTION = "asyncrl"
PRIVATE_PREFIX = "asyncrl_bundled_"
"""A module of asyncrl's own entry points whose name a user's package shadows loads as ``asyncrl_bundled_<name>``."""
OWN_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding ``asyncrl`` and the bundled ``workflows``."""

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
    if not any(_distribution_name(ep) == OWN_DISTRIBUTION for ep in _entry_points()):
        hint += (f" (asyncrl's built-ins are listed in its package metadata, entry-point group {ENTRY_POINT_GROUP}, "
                 "which this Python does not have: install the checkout with pip install -e .)")
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


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _distribution_name(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return str(dist.name) if dist is not None else "?"


def component_modules(kind: str) -> list[tuple[str, str]]:
    """``(module, distribution)`` of each ``asyncrl.components`` entry point of ``kind``, in
    metadata order. A name that is not ``<kind>.<label>`` with a known kind is an error naming
    the package that declares it."""
    found = []
    for entry in _entry_points():
        entry_kind, _, label = entry.name.partition(".")
        if entry_kind not in KINDS or not label:
            raise ConfigError(
                f"entry point '{entry.name} = {entry.value}' of package {_distribution_name(entry)} (group "
                f"{ENTRY_POINT_GROUP}): its name must be '<kind>.<label>' with kind one of {', '.join(KINDS)}"
            )
        if entry_kind == kind:
            found.append((entry.module, _distribution_name(entry)))
    return found


def _import_own_module(module_name: str) -> None:
    """Import a module of asyncrl's own entry points, the one beside ``asyncrl``.

    By its name when that name finds it (the usual case); when a user's package of the same
    top-level name comes first on ``sys.path``, under :data:`PRIVATE_PREFIX` + the name, loaded
    from :data:`OWN_ROOT`, so the built-ins resolve whatever the user's packages are called.
    """
    top, _, rest = module_name.partition(".")
    init = OWN_ROOT / top / "__init__.py"
    found = sys.modules.get(top) or importlib.util.find_spec(top)
    origin = getattr(found, "__file__", None) or getattr(found, "origin", None)
    if top == "asyncrl" or not init.is_file() or (origin and Path(origin).resolve() == init):
        importlib.import_module(module_name)
        return
    private = PRIVATE_PREFIX + top
    if private not in sys.modules:
        spec = importlib.util.spec_from_file_location(private, init, submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load asyncrl's bundled '{top}' from {init}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[private]
            raise
    if rest:
        importlib.import_module(f"{private}.{rest}")


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
    for module_name, distribution in component_modules(kind):
        key = f"{distribution}:{module_name}"
        if key in _loaded:
            continue
        with _lock:
            if key in _loaded:
                continue
            try:
                if distribution == OWN_DISTRIBUTION:
                    _import_own_module(module_name)
                else:
                    importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                raise ConfigError(
                    f"{kind}: package {distribution} declares components in module '{module_name}' (entry-point group "
                    f"{ENTRY_POINT_GROUP}), which cannot be imported: {err}; reinstall that package"
                ) from None
            _loaded.add(key)


def _qualname(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"partial({_qualname(obj.func)}, {obj.args!r}, {sorted(obj.keywords.items())!r})"
    module = getattr(obj, "__module__", None) or "?"
    if module.startswith(PRIVATE_PREFIX):
        # A bundled package loaded under its private name is the same code as under its own.
        module = module[len(PRIVATE_PREFIX):]
    return f"{module}.{getattr(obj, '__qualname__', repr(obj))}"
