"""A user's own env adapter or policy class, named by `_target_` in a config file of their own (docs/internals/design.md
§7, "Your own classes").

Our env and policy yamls name a typed schema (`ebrl/config.py`). A yaml that names none is a user's: at validation its
node is merged onto a schema made from the shared dataclass (EnvConfig, PolicyConfig: the keys the runtime reads) and
the class's constructor, so a misspelled key or a wrong type fails with one line, and the defaults are the
constructor's. A shared key the constructor does not take is not passed to it (`constructor_kwargs`); set to anything
but its default, it is an error, since it would have no effect. The contract (the methods the runtime calls) is
checked by the callers: `ebrl/checks.py` and `ebrl/envs/process.py`. Only `complete` imports omegaconf: simulator
workers, which may run under a benchmark's own interpreter, use the rest.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from typing import TYPE_CHECKING, Any, Iterable

from ebrl.errors import BadInput

if TYPE_CHECKING:
    from omegaconf import DictConfig

SIMPLE_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


class ContractError(BadInput, TypeError):
    """A user's class does not do what the runtime calls it for; the message is one line naming the method or field."""


def load_class(target: str, key: str) -> type:
    """The class `target` ("package.module.Class") names, or one line for `key` (e.g. env._target_)."""
    module_name, _, class_name = str(target).rpartition(".")
    if os.getcwd() not in sys.path:  # run.py's own folder is on it, not the user's (`python -m` children have it)
        sys.path.append(os.getcwd())
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        text = " ".join(str(e).split()) or type(e).__name__
        raise ContractError(
            f"{key}={target!r} cannot be imported ({type(e).__name__}: {text}); give "
            "package.module.Class of a module on the Python path (the folder you run from is)"
        ) from e
    if not isinstance(cls, type):
        raise ContractError(f"{key}={target!r} is not a class")
    return cls


def parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The constructor's named parameters, and whether it also takes **kwargs."""
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self", None)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}, var_kw


def _field(p: inspect.Parameter) -> tuple[str, Any, Any]:
    from omegaconf import MISSING

    annotation = p.annotation if p.annotation is not p.empty else Any
    kind = SIMPLE_TYPES.get(annotation, annotation) if isinstance(annotation, str) else annotation
    if kind not in SIMPLE_TYPES.values():  # lists, unions, paths: OmegaConf checks the four plain types only
        kind = Any
    if p.default is p.empty:
        return p.name, kind, dataclasses.field(default=MISSING)
    if isinstance(p.default, (list, dict, tuple)):
        value = list(p.default) if isinstance(p.default, tuple) else p.default
        return p.name, Any, dataclasses.field(default_factory=lambda v=value: type(v)(v))
    if p.default is not None and not isinstance(p.default, (int, float, str, bool)):
        return p.name, Any, dataclasses.field(default=None)  # an object default: null, and the constructor's applies
    return p.name, (kind if p.default is not None else Any), dataclasses.field(default=p.default)


def class_schema(cls: type, base: type, given: Iterable[str]) -> type:
    """A dataclass: `base`'s fields, each with the constructor's default where it takes one, and a field for every
    other constructor parameter but those the runtime passes itself (`given`, e.g. seed)."""
    params, _ = parameters(cls)
    shared, given = {f.name for f in dataclasses.fields(base)}, set(given)
    fields = [
        _field(p) for name, p in params.items() if name not in given and not (name in shared and p.default is p.empty)
    ]  # (required: the base's MISSING)
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields, bases=(base,))


def complete(
    node: DictConfig, cls: type, base: type, group: str, given: Iterable[str], runtime_keys: Iterable[str]
) -> DictConfig:
    """`node` (a user's `group` config) merged onto `class_schema`: one line for a key that is neither the runtime's
    nor a constructor parameter, for a value of the wrong type, for a required parameter left unset, and for a
    shared key set though the constructor does not take it."""
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = class_schema(cls, base, given)
    params, var_kw = parameters(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    accepted = {f.name for f in dataclasses.fields(schema)}
    unknown = [k for k in node if k not in accepted]
    if unknown and not var_kw:
        raise ContractError(
            f"{group}.{unknown[0]} is not a field of {group} {name}: its constructor takes "
            f"{', '.join(p for p in params if p not in set(given)) or 'nothing'}; the runtime's "
            f"{group} keys: {', '.join(sorted(runtime_keys))}"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), {k: v for k, v in node.items() if k not in unknown})
        if unknown:  # **kwargs: the extra keys go to the constructor as they are
            OmegaConf.set_struct(merged, False)
            for k in unknown:
                merged[k] = node[k]
            OmegaConf.set_struct(merged, True)
    except OmegaConfBaseException as e:
        raise ContractError(f"{group}: {' '.join(str(e).split()[:30])} (fields of {name})") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ContractError(f"{group}.{missing[0]} is not set; {name} needs it (no default in its constructor)")
    defaults = OmegaConf.structured(base)
    for key in (f.name for f in dataclasses.fields(base)):
        if key in runtime_keys or key in params or var_kw or key not in node:
            continue
        if OmegaConf.select(defaults, key, default=MISSING) != merged[key]:
            raise ContractError(
                f"{group}.{key}={OmegaConf.to_container(merged)[key]!r} has no effect: {name}'s "
                f"constructor takes no {key}"
            )
    return merged


def constructor_kwargs(cls: type, cfg: dict[str, Any], runtime_keys: Iterable[str]) -> dict[str, Any]:
    """What a group config passes to its class's constructor: every key but the runtime's, and of those only the
    ones the constructor takes unless it takes **kwargs (a user's class need not take every shared key)."""
    params, var_kw = parameters(cls)
    skip = set(runtime_keys)
    return {k: v for k, v in cfg.items() if k not in skip and (var_kw or k in params)}


def base_named(cls: type, name: str) -> type | None:
    """The class among `cls`'s bases whose module-qualified name is `name` (a check that imports nothing)."""
    return next((c for c in cls.__mro__ if f"{c.__module__}.{c.__qualname__}" == name), None)


def missing_methods(cls: type, base: type, methods: Iterable[str]) -> list[str]:
    """The `methods` that `cls` leaves as `base` has them (base's raise NotImplementedError)."""
    return [m for m in methods if getattr(cls, m, None) is getattr(base, m, None)]
