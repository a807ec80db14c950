"""Process-wide state a step or a compile may change, in one registry (``GLOBALS``, each a
``Global(name, read, write)``, added with ``register``): grad mode and the other plain torch settings,
the current CUDA device, the default device, the function- and dispatch-mode stacks, global module and
optimizer hooks, the compiler configs, the RNG streams (``rng.py``).

torch's config values are ContextVars (torch 2.10 and later): ``contained`` runs a probe in a copy of the
context, where what a step sets on any config module is gone when it returns; values of a mutable kind
set before the probe (a list, a dict) are copied and put back if the step edits them in place.
"""

from __future__ import annotations

import copy
import operator
import platform
import sys
import warnings
from collections.abc import Callable
from contextvars import ContextVar, copy_context
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer
import torch.utils.deterministic
from torch.utils._config_module import ConfigModule

from .rng import restore_rng, save_rng

# ----- process-wide state: one registry -------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    return a is b or bool(a == b)


@dataclass(frozen=True)
class Global:
    """One piece of process-wide (or thread-wide) state a step or a compile may change: how to read it,
    and how to put a value read before back (``write`` runs only where ``same(now, saved)`` is False).
    A piece that cannot be read here (a backend not built in) is not saved, and so not restored."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    same: Callable[[Any, Any], bool] = _equal
    # A torch config module: its values are ContextVars (torch 2.10 and later), which ``contained``
    # isolates without a copy, so ``preserved(contained=True)`` skips it.
    contextual: bool = False


GLOBALS: list[Global] = []


def register(
    name: str,
    read: Callable[[], Any],
    write: Callable[[Any], None],
    same: Any = _equal,
    contextual: bool = False,
) -> Global:
    """Save and restore one more piece of process-wide state around every probe (restored in the order
    registered)."""
    g = Global(name, read, write, same, contextual)
    GLOBALS.append(g)
    return g


def _flush_denormal() -> bool:
    """torch has a setter and no getter: a float64 subnormal times one is zero when denormals are
    flushed. On x86 the flag is the thread's MXCSR register, which Python's own float arithmetic obeys
    too: the same answer without a tensor (two tensor ops cold cost more than the rest of the settings)."""
    if _X86:
        return _TINY * _ONE == 0.0
    return bool((torch.full((1,), 1e-310, dtype=torch.float64) * 1.0).item() == 0.0)


# Module globals, not literals: CPython folds constant expressions at compile time.
_TINY, _ONE = 1e-310, 1.0
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _attribute(path: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
    """A flag of a ``torch.backends`` module, read and set as a user would (the path looked up on each
    use, in one ``attrgetter`` call)."""
    owner_path, _, attr = path.removeprefix("torch.").rpartition(".")
    read, owner = operator.attrgetter(f"{owner_path}.{attr}"), operator.attrgetter(owner_path)
    return path, lambda: read(torch), lambda v: setattr(owner(torch), attr, v)


def _cublas(kind: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
    """cuBLAS' reduced-precision reduction for ``kind``: both of its flags, as torch keeps them (setting
    the attribute to a bool would reset the split-k flag)."""
    get = getattr(torch._C, f"_get_cublas_allow_{kind}_reduced_precision_reduction")
    put = getattr(torch._C, f"_set_cublas_allow_{kind}_reduced_precision_reduction")
    return (
        f"cuBLAS {kind} reduced-precision reduction",
        get,
        lambda v: put(*v) if isinstance(v, tuple) else put(v),
    )


def _set_deterministic(v: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


def _set_autograd_grad(v: Any) -> None:
    torch.autograd.grad = v


def _set_fill_uninitialized(v: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = v  # type: ignore[attr-defined]


# Process-wide settings holding plain values, read together as one tuple and written back one by one
# where they differ.
_SETTINGS: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    (
        "deterministic algorithms",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        _set_deterministic,
    ),
    (
        "fill uninitialized memory",
        lambda: torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        _set_fill_uninitialized,
    ),
    (
        "anomaly mode",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda v: torch.autograd.set_detect_anomaly(*v),
    ),
    ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.autograd.grad", lambda: torch.autograd.grad, _set_autograd_grad),
    ("intra-op threads", torch.get_num_threads, torch.set_num_threads),
    ("warn always", torch.is_warn_always_enabled, torch.set_warn_always),
    ("flush denormal", _flush_denormal, torch.set_flush_denormal),
    ("autograd multithreading", torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
    # torch.compile's first use turns it off for the process (see probe.VALIDATION_OFF): a probe that may
    # compile runs with it off, and the user's value comes back after.
    (
        "torch.distributions argument validation",
        lambda: torch.distributions.Distribution._validate_args,
        torch.distributions.Distribution.set_default_validate_args,
    ),
    *map(
        _attribute,
        (
            "torch.backends.cudnn.enabled",
            "torch.backends.cudnn.benchmark",
            "torch.backends.cudnn.deterministic",
            "torch.backends.cudnn.allow_tf32",
            "torch.backends.mkldnn.enabled",
            "torch.backends.cuda.matmul.allow_tf32",
        ),
    ),
    *(
        _cublas(kind)
        for kind in ("fp16", "bf16")
        if hasattr(torch._C, f"_get_cublas_allow_{kind}_reduced_precision_reduction")
    ),
]


def _readable(read: Callable[[], Any]) -> bool:
    try:
        read()
    except Exception:
        return False
    return True


_SETTINGS = [s for s in _SETTINGS if _readable(s[1])]  # a backend not built in: left out


def _read_settings() -> tuple[Any, ...]:
    return tuple(read() for _, read, _ in _SETTINGS)


def _write_settings(saved: tuple[Any, ...]) -> None:
    errors = []
    for (_, read, write), value in zip(_SETTINGS, saved, strict=True):
        try:
            now = read()
            if now is not value and now != value:  # identity first: a function is compared as itself
                write(value)
        except Exception as e:  # each setting is restored even if another fails
            errors.append(e)
    if errors:
        raise errors[0]


def _default_device_context() -> Any:
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _set_default_device_context(saved: Any) -> None:
    """``torch.set_default_device``'s own steps, back to the saved context object (which sits at the
    bottom of the function-mode stack, restored next)."""
    current = _default_device_context()
    if current is not None:
        current.__exit__(None, None, None)
    if saved is not None:
        saved.__enter__()
    torch._GLOBAL_DEVICE_CONTEXT.device_context = saved


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _mode_stack(kind: str) -> tuple[Callable[[], list[Any]], Callable[[list[Any]], None]]:
    """Read and write torch's function-mode or dispatch-mode stack (the very mode objects)."""
    if kind == "function":
        from torch.overrides import _get_current_function_mode_stack as stack
        from torch.overrides import _pop_mode, _push_mode

        length = torch._C._len_torch_function_stack
    else:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as stack
        from torch.utils._python_dispatch import _pop_mode, _push_mode  # type: ignore[assignment]

        length = torch._C._len_torch_dispatch_stack

    def read() -> list[Any]:
        return stack() if length() else []

    def write(saved: list[Any]) -> None:
        while length():
            _pop_mode()
        for mode in saved:
            _push_mode(mode)

    return read, write


def _hook_dicts(
    module_name: str,
) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[Any, Any], bool]]:
    """A module's global hook registries (``torch.nn.modules.module._global_forward_hooks`` ...): each
    dict object and its items. Their names are listed again only when the module's namespace changes
    size (a scan of its hundred names costs more than the rest)."""
    module = sys.modules[module_name]
    listed: list[Any] = [-1, ()]  # [len(vars(module)) when listed, the names then]

    def names() -> tuple[str, ...]:
        if listed[0] != len(vars(module)):
            found = tuple(
                k for k, v in vars(module).items() if k.startswith("_global_") and isinstance(v, dict)
            )
            listed[:] = [len(vars(module)), found]
        return listed[1]

    def read() -> dict[str, tuple[Any, list[Any]]]:
        return {k: (v, list(v.items())) for k in names() if isinstance(v := getattr(module, k, None), dict)}

    def write(saved: dict[str, tuple[Any, list[Any]]]) -> None:
        for name, (obj, items) in saved.items():
            if getattr(module, name, None) is not obj:
                setattr(module, name, obj)  # the very object the user's handles refer to
            if list(obj.items()) != items:
                obj.clear()
                obj.update(items)

    def same(a: Any, b: Any) -> bool:
        return a.keys() == b.keys() and all(a[k][0] is b[k][0] and a[k][1] == b[k][1] for k in a)

    return read, write, same


# Compiler config modules restored value by value around each variant (``isolated_settings``) when
# imported before it; within a probe, ``contained`` isolates what is set on any config module.
CONFIG_MODULES = (
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._functorch.config",
    "torch.compiler.config",
)


def _read_config(name: str) -> Callable[[], Any]:
    def read() -> tuple[Any, dict[str, Any]]:
        module = sys.modules.get(name)
        if module is None:
            raise LookupError(name)  # not imported: nothing of the user's to keep
        return module, _config_values(module)

    return read


def _config_values(module: Any) -> dict[str, Any]:
    try:
        return module.get_config_copy()
    except Exception:  # a value that cannot be deep-copied (a pass holding a lock): the others kept
        values = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # reading a deprecated key warns
            for key in module._config:
                try:
                    values[key] = copy.deepcopy(getattr(module, key))
                except Exception:
                    continue
        return values


def _write_config(saved: tuple[Any, dict[str, Any]]) -> None:
    module, values = saved
    now = _config_values(module)
    for key, value in values.items():
        try:
            current = now[key]
            if current is not value and bool(current != value):
                setattr(module, key, copy.deepcopy(value))  # never the saved copy itself: it stays pristine
        except Exception:  # a key gone, or values that cannot be compared: left alone
            continue


def _never_same(a: Any, b: Any) -> bool:
    return False  # the writer compares value by value


def _cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _set_cuda_device(saved: int | None) -> None:
    if saved is not None:
        torch.cuda.set_device(saved)


def _contextual_configs() -> bool:
    """torch's config values are ContextVars (torch 2.10 and later); ``torch.compiler.config`` is
    imported with torch."""
    import torch.compiler.config as config

    entry = next(iter(getattr(config, "_config", {}).values()), None)
    return isinstance(getattr(entry, "user_override", None), ContextVar)


CONTEXT_CONFIG = _contextual_configs()

register("settings", _read_settings, _write_settings)
register("current CUDA device", _cuda_device, _set_cuda_device)
# The default device before the function-mode stack: its context lives at the stack's bottom.
register("default device", _default_device_context, _set_default_device_context, lambda a, b: a is b)
register("function-mode stack", *_mode_stack("function"), _same_objects)
register("dispatch-mode stack", *_mode_stack("dispatch"), _same_objects)
register("global module hooks", *_hook_dicts("torch.nn.modules.module"))
register("global optimizer hooks", *_hook_dicts("torch.optim.optimizer"))
for _name in CONFIG_MODULES:
    register(_name, _read_config(_name), _write_config, _never_same, contextual=CONTEXT_CONFIG)
register("RNG streams", save_rng, restore_rng, _never_same)


def save_globals(contained: bool = False) -> list[tuple[Global, Any]]:
    """Each registered piece's value (``contained``: not those a copy of the context isolates)."""
    saved = []
    for g in GLOBALS:
        if contained and g.contextual:
            continue
        try:
            saved.append((g, g.read()))
        except Exception:  # not readable here: not saved, so not restored
            continue
    return saved


def restore_globals(saved: list[tuple[Global, Any]]) -> list[Exception]:
    errors: list[Exception] = []
    for g, value in saved:
        try:
            if g.same is _never_same or not g.same(g.read(), value):
                g.write(value)
        except Exception as e:  # each piece is restored even if another fails
            errors.append(e)
    return errors


# ----- config values: a copy of the context ---------------------------------------------------------


_CONFIG_MODULES_SEEN: list[Any] = [-1, []]  # [len(sys.modules) when listed, the config modules then]


def _config_modules() -> list[Any]:
    """Every imported config module, listed again only when modules were imported since (a scan of
    sys.modules costs a tenth of a millisecond)."""
    if _CONFIG_MODULES_SEEN[0] != len(sys.modules):
        _CONFIG_MODULES_SEEN[:] = [
            len(sys.modules),
            [m for m in list(sys.modules.values()) if isinstance(m, ConfigModule)],
        ]
    return _CONFIG_MODULES_SEEN[1]


def _set_mutable_configs(modules: list[Any]) -> list[tuple[Any, str, Any, Any]]:
    """(module, key, value, copy) for every config value of a mutable kind (a list, set or dict) set
    before the probe: a copy of the context keeps which value is set, not what is edited in it."""
    out = []
    for module in modules:
        for key, entry in module._config.items():
            value = entry.user_override.get()
            if isinstance(value, list | set | dict):
                try:
                    out.append((module, key, value, copy.deepcopy(value)))
                except Exception:  # a value that cannot be copied: left alone
                    continue
    return out


def contained(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a copy of the current context: what it sets on torch's config modules (ContextVars)
    is gone when it returns, without reading a value; what it edits in place in a mutable value set
    before is put back from a copy. Config modules first imported by ``fn`` keep what was set in them
    (they were never the user's state). Without ContextVar configs (older torch): just ``fn()``, and
    ``preserved`` restores the configs value by value."""
    if not CONTEXT_CONFIG:
        return fn()
    before = _config_modules()
    edited = _set_mutable_configs(before)
    context = copy_context()
    try:
        return context.run(fn)
    finally:
        for module, key, value, saved in edited:
            try:
                if value != saved:
                    setattr(module, key, copy.deepcopy(saved))
            except Exception:
                continue
        known = set(map(id, before))
        for module in _config_modules():
            if id(module) not in known:  # imported inside the copy: its values carried out
                for entry in module._config.values():
                    value = context.run(entry.user_override.get)
                    if value is not entry.user_override.get():
                        entry.user_override.set(value)
