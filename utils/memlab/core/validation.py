"""Argument checks with one error format: ``name=value is invalid; allowed: what is allowed``.

Every public memlab function checks its arguments with these before doing any work, so a bad
value fails at once with a message that names the argument, the value and what would be accepted.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, TypeVar

__all__ = ["invalid", "check_int", "check_positive_int", "check_number", "check_choice", "check_bool", "check_str",
           "check_mapping", "check_schema", "finite"]

T = TypeVar("T")


def invalid(name: str, value: Any, allowed: str) -> ValueError:
    """The ValueError every check raises, for the caller to raise:
    ``ValueError("name=value is invalid; allowed: ...")``, ``allowed`` saying in words what would
    have been accepted (a value's repr is cut at 80 characters)."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"{name}={shown} is invalid; allowed: {allowed}")


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]`` (None: unbounded), else
    :func:`invalid`."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if minimum is not None and maximum is not None:
        allowed = f"an int from {minimum:,} to {maximum:,}"
    elif minimum is not None:
        allowed = f"an int >= {minimum:,}"
    elif maximum is not None:
        allowed = f"an int <= {maximum:,}"
    else:
        allowed = "an int"
    raise invalid(name, value, allowed)


def check_positive_int(name: str, value: Any, *, maximum: int | None = None) -> int:
    """``value`` if it is an int >= 1 (and <= ``maximum``), else :func:`invalid`."""
    return check_int(name, value, minimum=1, maximum=maximum)


def check_number(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
                 strict_minimum: bool = False) -> float:
    """``float(value)`` if it is a finite int or float (not a bool) within ``[minimum, maximum]``
    (None: unbounded; ``strict_minimum``: ``> minimum``), else :func:`invalid`."""
    ok = finite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if ok:
        return float(value)
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if strict_minimum else '>='} {minimum}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    raise invalid(name, value, "a finite number" + (" " + " and ".join(parts) if parts else ""))


def finite(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) that is finite as a float: ``10**400`` is not (no
    float holds it), nor ``nan`` or ``inf``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_choice(name: str, value: T, allowed: Iterable[T]) -> T:
    """``value`` if it is one of ``allowed``, else :func:`invalid` listing their reprs."""
    options = list(allowed)
    try:
        if value in options:
            return value
    except TypeError:  # an unhashable or uncomparable value is not one of them
        pass
    raise invalid(name, value, ", ".join(map(repr, options)))


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is True or False, else :func:`invalid`."""
    if isinstance(value, bool):
        return value
    raise invalid(name, value, "True or False")


def check_str(name: str, value: Any, allowed: str = "a non-empty string") -> str:
    """``value`` if it is a non-empty str (not only spaces), else :func:`invalid` saying ``allowed``."""
    if isinstance(value, str) and value.strip():
        return value
    raise invalid(name, value, allowed)


def check_mapping(name: str, value: Any, allowed: str = "a dict with str keys, or None") -> dict:
    """``dict(value)`` if it is None (an empty dict) or a mapping whose keys are non-empty strings, else
    :func:`invalid`."""
    from collections.abc import Mapping

    if value is None:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) and k.strip() for k in value):
        return dict(value)
    raise invalid(name, value, allowed)


def check_schema(values: Mapping[str, Any], schema: Mapping[str, Callable[[str, Any], Any]]) -> None:
    """Check each of ``values`` that ``schema`` names with its checker ``check(name, value)`` (which raises
    :func:`invalid`'s ValueError, or a TypeError, naming the argument); keys the schema lacks are left to
    the caller. The one place an entry point's arguments meet their rules, before any work."""
    for key, value in values.items():
        check = schema.get(key)
        if check is not None:
            check(key, value)
