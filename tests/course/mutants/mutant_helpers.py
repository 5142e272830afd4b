"""Wrong answers several chapters' mutants share: state kept between calls (a memo), state kept on a class.

The chapter modules (loaded by file path) import it by adding this folder to ``sys.path``."""
from __future__ import annotations


def memoised(fn, key=None):
    """``fn`` with its answers memoised in a dict it keeps between calls (by ``key(*args)``, default the arguments'
    repr): state that outlives the call."""
    store: dict = {}

    def memo(*args, **kwargs):
        k = key(*args, **kwargs) if key is not None else repr((args, sorted(kwargs.items())))
        if k not in store:
            store[k] = fn(*args, **kwargs)
        return store[k]

    return memo


def counted_on_the_class(cls):
    """``cls``, right, except that every instance is also counted on the class."""

    def __init__(self, *args, **kwargs):
        type(self).made += 1
        cls.__init__(self, *args, **kwargs)

    return type(f"Counted{cls.__name__}", (cls,), {"made": 0, "__init__": __init__})
